//! libFuzzer's entry to `vovp_fuzz_bodies::client_session` (the body, replayed by `cargo test`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vovp_fuzz_bodies::client_session::run(data));
