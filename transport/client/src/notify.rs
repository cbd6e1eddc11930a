//! A subscription's side of the wire, with no socket in it: the SUBSCRIBE reply, then NOTIFY
//! frames cut out of the bytes as they arrive ([`Notifications`]). The blocking
//! `Subscription` and the async `AsyncSubscription` read their sockets into it.

use vovp_proto::{decode_notification, Header, Opcode, Request, HEADER_LEN};
use vovp_types::{Error, Notification};

use crate::core::{self, Expect};

/// The reply (`h`, `payload`) to SUBSCRIBE request `id`: `Ok` once the stream is the
/// subscription's.
pub(crate) fn subscribed(h: &Header, payload: &[u8], id: u64) -> Result<(), Error> {
    core::decode_reply(h, payload, id, &Request::Subscribe)?.empty()
}

/// Bytes received on a subscription's stream that do not make a whole notification yet: a
/// read cut short (by a timeout, a cancelled future) must not lose half a notification.
#[derive(Debug, Default)]
pub(crate) struct Notifications {
    pending: Vec<u8>,
}

impl Notifications {
    /// Bytes read from the stream.
    pub(crate) fn extend(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
    }

    /// The next whole notification received, if any (anything but NOTIFY on the stream is a
    /// protocol error).
    pub(crate) fn next(&mut self) -> Result<Option<Notification>, Error> {
        let Some(h) = Header::parse(&self.pending)? else {
            return Ok(None);
        };
        let len = h.frame_len();
        if self.pending.len() < len {
            return Ok(None);
        }
        if h.opcode != Opcode::Notify.code() {
            return Err(Error::Protocol(format!(
                "expected NOTIFY, got opcode {:#x}",
                h.opcode
            )));
        }
        let n = decode_notification(&self.pending[HEADER_LEN..len]);
        self.pending.drain(..len);
        Ok(Some(n?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use vovp_types::{NotificationKind, ObjectName};

    fn note(name: &str, version: u64) -> Notification {
        Notification {
            kind: NotificationKind::Sealed,
            name: ObjectName::new(name).unwrap(),
            size: 3,
            metadata: Arc::from(&b"m"[..]),
            version,
        }
    }

    #[test]
    fn notifications_come_whole_however_the_bytes_are_cut() {
        let mut wire = Vec::new();
        vovp_proto::encode_notification(&note("a", 1), &mut wire);
        vovp_proto::encode_notification(&note("b", 2), &mut wire);
        let mut stream = Notifications::default();
        let mut got = Vec::new();
        // One byte at a time: nothing before a frame is whole, each as soon as it is.
        for b in &wire {
            stream.extend(std::slice::from_ref(b));
            while let Some(n) = stream.next().unwrap() {
                got.push(n);
            }
        }
        assert_eq!(got, [note("a", 1), note("b", 2)]);
        assert!(stream.next().unwrap().is_none());
    }

    #[test]
    fn anything_but_notify_on_the_stream_is_a_protocol_error() {
        let mut wire = Vec::new();
        Request::STATS_FIRST.encode(0, 1, &mut wire);
        let mut stream = Notifications::default();
        stream.extend(&wire);
        assert!(matches!(stream.next(), Err(Error::Protocol(_))));
    }
}
