//! Replays the committed corpus of every fuzz target through its body: the seeds and every
//! input that once found a bug run on each `cargo test`, not only under `scripts/fuzz.sh`.

use std::path::Path;

#[test]
fn every_committed_input_passes_its_target() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus");
    for (target, body) in vovp_fuzz_bodies::TARGETS {
        let dir = root.join(target);
        let mut inputs: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("corpus entry").path())
            .collect();
        inputs.sort();
        assert!(!inputs.is_empty(), "{}: no inputs", dir.display());
        for input in &inputs {
            let bytes = std::fs::read(input).expect("corpus input");
            // A panic names the input that found something.
            eprintln!("{target}: {}", input.display());
            body(&bytes);
        }
        println!("{target}: {} inputs", inputs.len());
    }
}
