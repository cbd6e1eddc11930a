//! Writes the seed corpora of `frame_decoder` and `daemon_frames` (fuzz/corpus/<target>/):
//! valid requests and replies of every opcode and the edge cases of
//! `vovp_fuzz_bodies::seeds`. Rerun it after a protocol change and commit the result:
//!
//!     cargo run -p vovp-fuzz-bodies --example gen_corpus
//!
//! (`request_sequence`'s seeds are not generated: its inputs are `arbitrary` bytes, so its
//! corpus is a minimized set of inputs from a fuzzing run; see scripts/fuzz.sh.)

use std::path::Path;

fn main() -> std::io::Result<()> {
    use vovp_fuzz_bodies::seeds;
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus");
    for (target, seeds) in [
        ("frame_decoder", seeds::frame_decoder_seeds()),
        ("daemon_frames", seeds::daemon_frames_seeds()),
        ("client_session", seeds::client_session_seeds()),
    ] {
        let dir = corpus.join(target);
        std::fs::create_dir_all(&dir)?;
        for (name, bytes) in &seeds {
            std::fs::write(dir.join(name), bytes)?;
        }
        println!("{} seeds in {}", seeds.len(), dir.display());
    }
    Ok(())
}
