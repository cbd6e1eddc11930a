//! The vovp daemon over a Unix socket: the io_uring server with one actor per connection and
//! SCM_RIGHTS fd passing (the `vovp-engine` binary), and the `vovp` CLI. The wire protocol is
//! `vovp-proto`; the Rust client (which the CLI uses) is `vovp-client`.

#![warn(unreachable_pub, missing_debug_implementations)]

pub mod metrics;
pub mod response;
pub mod server;
pub mod transfer;

pub use response::TransportError;
pub use server::{run, ConnectionLimits, ServerConfig};
pub use transfer::TransferConfig;
