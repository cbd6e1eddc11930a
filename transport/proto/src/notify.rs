//! NOTIFY frames: what a SUBSCRIBE connection receives (server to client, request id 0).

use vovp_types::{Notification, NotificationKind};

use crate::wire::{object_name, FrameWriter, Reader};
use crate::{DecodeError, Opcode};

/// Appends one NOTIFY frame.
pub fn encode_notification(n: &Notification, buf: &mut Vec<u8>) {
    let mut w = FrameWriter::begin(buf, Opcode::Notify.code(), 0, 0);
    w.u8(n.kind as u8)
        .str(n.name.as_str())
        .u64(n.size)
        .bytes(&n.metadata)
        .u64(n.version);
    w.finish();
}

/// Decodes a NOTIFY frame's payload.
pub fn decode_notification(payload: &[u8]) -> Result<Notification, DecodeError> {
    let mut r = Reader::new(payload);
    let kind = match r.u8()? {
        1 => NotificationKind::Sealed,
        2 => NotificationKind::Deleted,
        3 => NotificationKind::Evicted,
        4 => NotificationKind::Replaced,
        k => return Err(DecodeError::NotificationKind(k)),
    };
    let n = Notification {
        kind,
        name: object_name(r.str()?)?,
        size: r.u64()?,
        metadata: r.bytes()?.into(),
        version: r.u64()?,
    };
    r.finish()?;
    Ok(n)
}
