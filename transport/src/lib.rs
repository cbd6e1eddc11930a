//! vovp over a Unix socket: the wire protocol (PROTOCOL.md), the io_uring daemon with one actor
//! per connection and SCM_RIGHTS fd passing, and the Rust client (blocking and async).

pub mod client;
pub mod fdpass;
pub mod protocol;
pub mod server;

pub use client::{AsyncClient, Client, ClientOptions, Subscription};
pub use protocol::TransportError;
pub use server::{run, ConnectionLimits, ServerConfig};
