//! The daemon's side of the protocol (whose wire is `vovp-proto`): what a connection actor
//! answers — a wire [`Reply`], or one of the runtime-only outcomes the socket task acts on —
//! and the daemon's errors.

use std::sync::Arc;

use vovp_proto::{DecodeError, Failure, Reply, Status};

/// Errors of the daemon: the wire and the socket.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    #[error("malformed frame: {0}")]
    Decode(#[from] DecodeError),
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Setup(String),
}

/// What the connection actor answers a request with.
#[derive(Debug, kameo::Reply)]
pub enum Response {
    /// Bytes only (HELLO's reply also carries fds: the socket task attaches them).
    Reply(Reply),
    /// A segment to map: its reply is [`Reply::Segment`] with the fd (read-write when
    /// `writable`, else read-only) riding on it as SCM_RIGHTS.
    Segment {
        segment: Arc<vovp::Segment>,
        writable: bool,
    },
    /// SHARED's: [`Reply::Shared`], with the directory's and the hold table's fds riding on
    /// it when the store publishes.
    Shared(Option<vovp::SharedFds>),
    /// SUBSCRIBE's: an empty reply, then the connection streams these notifications.
    Subscribed(tokio::sync::mpsc::Receiver<vovp::Notification>),
    /// Nothing is written back (RELEASE with NO_REPLY).
    NoReply,
}

impl From<Reply> for Response {
    fn from(r: Reply) -> Self {
        Response::Reply(r)
    }
}

impl Response {
    pub fn error(status: Status, message: impl Into<String>) -> Self {
        Response::Reply(Reply::error(status, message))
    }

    /// Appends the reply frame for request `opcode`/`request_id` (nothing for `NoReply`).
    pub fn encode(&self, opcode: u8, request_id: u64, buf: &mut Vec<u8>) {
        match self {
            Response::Reply(r) => r.encode(opcode, request_id, buf),
            Response::Segment { segment, writable } => Reply::Segment {
                size: segment.len(),
                writable: *writable,
            }
            .encode(opcode, request_id, buf),
            Response::Shared(fds) => Reply::Shared {
                published: fds.is_some(),
            }
            .encode(opcode, request_id, buf),
            Response::Subscribed(_) => Reply::Empty.encode(opcode, request_id, buf),
            Response::NoReply => {}
        }
    }
}

/// The error reply for a store error.
pub fn error_response(e: &vovp::Error) -> Response {
    Response::Reply(Reply::Failure(Failure::from_error(e)))
}
