//! Writes the seed corpus of `frame_decoder` (fuzz/corpus/frame_decoder/): valid requests and
//! replies of every opcode and the edge cases of `vovp_fuzz_bodies::seeds::frame_decoder_seeds`. Rerun it
//! after a protocol change and commit the result:
//!
//!     cargo run -p vovp-fuzz-bodies --example gen_corpus
//!
//! (`request_sequence`'s seeds are not generated: its inputs are `arbitrary` bytes, so its
//! corpus is a minimized set of inputs from a fuzzing run; see scripts/fuzz.sh.)

use std::path::Path;

fn main() -> std::io::Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus/frame_decoder");
    std::fs::create_dir_all(&dir)?;
    let seeds = vovp_fuzz_bodies::seeds::frame_decoder_seeds();
    for (name, bytes) in &seeds {
        std::fs::write(dir.join(name), bytes)?;
    }
    println!("{} seeds in {}", seeds.len(), dir.display());
    Ok(())
}
