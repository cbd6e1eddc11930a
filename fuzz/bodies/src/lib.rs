//! The bodies of vovp's fuzz targets, as plain functions of the input bytes: the libFuzzer
//! targets in `fuzz/fuzz_targets/` (their own cargo workspace, which links libFuzzer) are
//! one-line wrappers around them, and `tests/corpus.rs` replays the committed corpus
//! (`fuzz/corpus/<target>/`) through them under `cargo test`, so a seed that once found a bug
//! is re-run on every test run. A body panics on a finding; any other return is a pass.

pub mod daemon_frames;
pub mod frame_decoder;
pub mod request_sequence;
pub mod seeds;

/// A target's body: panics on a finding.
pub type Body = fn(&[u8]);

/// Every target: its name (its corpus directory) and its body.
pub const TARGETS: [(&str, Body); 3] = [
    ("daemon_frames", daemon_frames::run),
    ("frame_decoder", frame_decoder::run),
    ("request_sequence", request_sequence::run),
];
