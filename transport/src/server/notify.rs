//! A subscriber's connection after SUBSCRIBE: the notification stream.

use vovp_proto::encode_notification;

use super::connection::ConnIo;
use crate::response::TransportError;

/// Streams notifications to a subscriber until it closes its connection. The socket is read
/// meanwhile (subscribers send nothing; any bytes are ignored) so that a closed subscriber is
/// noticed at once, not at the next notification.
pub(super) async fn notify_loop(
    io: &ConnIo<'_>,
    mut rx: tokio::sync::mpsc::Receiver<vovp::Notification>,
    mut out: Vec<u8>,
) -> Result<(), TransportError> {
    let encode = |out: &mut Vec<u8>, n: vovp::Notification| encode_notification(&n, out);
    let watch = |buf: Vec<u8>| io.stream.read(buf);
    let mut closed = Box::pin(watch(Vec::with_capacity(64)));
    loop {
        tokio::select! {
            n = rx.recv() => {
                let Some(n) = n else { return Ok(()) };
                if rx.is_closed() {
                    // The table dropped this subscriber for falling 4096 notifications behind:
                    // end the stream now rather than after the backlog, so the client learns
                    // at once that it missed some.
                    tracing::debug!("subscriber dropped as too slow; closing its stream");
                    return Ok(());
                }
                encode(&mut out, n);
                // Batch whatever else is already queued into the same write.
                while let Ok(n) = rx.try_recv() {
                    encode(&mut out, n);
                }
                let (res, back) = io.flush(out).await;
                out = back;
                if let Err(e) = res {
                    tracing::debug!("subscriber write failed: {e}");
                    return Err(e);
                }
            }
            (res, buf) = &mut closed => match res {
                Ok(0) | Err(_) => {
                    tracing::debug!("subscriber closed its connection ({res:?})");
                    return Ok(());
                }
                Ok(_) => closed = Box::pin(watch(buf)),
            },
        }
    }
}
