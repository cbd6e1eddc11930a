//! Why bytes are not a valid frame or message.

use crate::{Status, MAX_FETCH_RANGES, MAX_GET_NAMES, MAX_PUBLISH_MANY, VERSION};

/// A frame or payload that does not decode. [`DecodeError::status`] is the status the daemon
/// answers it with; [`DecodeError::is_fatal`] says whether the stream can still be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    #[error("length field {0} is below the header size")]
    LengthBelowHeader(u32),
    #[error("frame of {0} bytes is over the limit")]
    FrameTooLarge(u64),
    #[error("unsupported protocol version {0} (this build speaks {VERSION})")]
    UnsupportedVersion(u16),
    #[error("unknown opcode {0:#04x}")]
    UnknownOpcode(u8),
    #[error("opcode {0:#04x} is not a request")]
    NotARequest(u8),
    #[error("unknown reply status {0}")]
    UnknownStatus(u8),
    #[error("payload ends inside {what} ({have} of {need} bytes)")]
    Truncated {
        what: &'static str,
        need: usize,
        have: usize,
    },
    #[error("{0} unexpected bytes after the fields")]
    Trailing(usize),
    #[error("string is not UTF-8")]
    NotUtf8,
    #[error("invalid object name: {0}")]
    InvalidName(String),
    #[error("count {0} exceeds the payload")]
    ForgedCount(u32),
    #[error("GET of {0} names; at most {MAX_GET_NAMES} per request")]
    TooManyNames(usize),
    #[error("PUBLISH_MANY of {0} objects; at most {MAX_PUBLISH_MANY} per request")]
    TooManyObjects(usize),
    #[error("FETCH names {0} base ranges; at most {MAX_FETCH_RANGES}")]
    TooManyRanges(usize),
    #[error("FETCH's has_base is {0}: 0 (no base) or 1")]
    FetchBaseTag(u8),
    #[error("not a vovp transfer stream (bad magic)")]
    TransferMagic,
    #[error("unknown transfer ASK kind {0}")]
    TransferAsk(u8),
    #[error("PUT announces {announced} data bytes but carries {carried}")]
    PutSize { announced: u64, carried: usize },
    #[error("location kind {0}")]
    LocationKind(u8),
    #[error("device type {0}")]
    DeviceType(u8),
    #[error("notification kind {0}")]
    NotificationKind(u8),
    #[error("asked {asked} names, the reply has {got}")]
    NameCount { asked: usize, got: usize },
}

impl DecodeError {
    /// The status of the daemon's error reply to a request that does not decode.
    pub fn status(&self) -> Status {
        match self {
            DecodeError::UnsupportedVersion(_) => Status::UnsupportedVersion,
            DecodeError::FrameTooLarge(_)
            | DecodeError::TooManyNames(_)
            | DecodeError::TooManyObjects(_)
            | DecodeError::TooManyRanges(_) => Status::TooLarge,
            DecodeError::UnknownOpcode(_) | DecodeError::NotARequest(_) => Status::UnknownOpcode,
            DecodeError::InvalidName(_) => Status::InvalidName,
            _ => Status::Malformed,
        }
    }

    /// True for header errors (bad length or version): the byte stream cannot be
    /// resynchronised and the connection must close.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            DecodeError::LengthBelowHeader(_)
                | DecodeError::FrameTooLarge(_)
                | DecodeError::UnsupportedVersion(_)
        )
    }
}

/// On the client side a reply that does not decode is a protocol error.
impl From<DecodeError> for vovp_types::Error {
    fn from(e: DecodeError) -> Self {
        vovp_types::Error::Protocol(e.to_string())
    }
}
