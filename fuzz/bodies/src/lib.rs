//! The bodies of vovp's fuzz targets, as plain functions of the input bytes: the libFuzzer
//! targets in `fuzz/fuzz_targets/` (their own cargo workspace, which links libFuzzer) are
//! one-line wrappers around them, and `tests/corpus.rs` replays the committed corpus
//! (`fuzz/corpus/<target>/`) through them under `cargo test`, so a seed that once found a bug
//! is re-run on every test run. A body panics on a finding; any other return is a pass.

pub mod client_session;
pub mod daemon_frames;
pub mod frame_decoder;
pub mod request_sequence;
pub mod seeds;

/// Sends all of `bytes`, `MSG_NOSIGNAL`: a peer that closed is `false`, never SIGPIPE (a
/// libFuzzer binary has no Rust `main`, which is what ignores SIGPIPE in normal programs).
pub(crate) fn send_all(socket: impl std::os::fd::AsFd, mut bytes: &[u8]) -> bool {
    while !bytes.is_empty() {
        match rustix::net::send(&socket, bytes, rustix::net::SendFlags::NOSIGNAL) {
            Ok(n) => bytes = &bytes[n..],
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => return false,
        }
    }
    true
}

/// A target's body: panics on a finding.
pub type Body = fn(&[u8]);

/// Every target: its name (its corpus directory) and its body.
pub const TARGETS: [(&str, Body); 4] = [
    ("client_session", client_session::run),
    ("daemon_frames", daemon_frames::run),
    ("frame_decoder", frame_decoder::run),
    ("request_sequence", request_sequence::run),
];
