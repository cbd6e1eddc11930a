//! A notification stream on a connection of its own.

use std::os::unix::net::UnixStream;
use std::time::Duration;

use vovp_types::Error;

use crate::io::conn_err;
use crate::notify::Notifications;

/// A stream of seal/delete/evict notifications on a dedicated connection.
#[derive(Debug)]
pub struct Subscription {
    stream: UnixStream,
    received: Notifications,
}

/// Ends a [`Subscription`] from another thread: a `next` blocked on it returns at once.
#[derive(Debug)]
pub struct SubscriptionCloser(UnixStream);

impl SubscriptionCloser {
    /// Shuts the stream down; the subscription's `next` then fails with a connection error.
    pub fn close(&self) {
        // Already shut down or gone: nothing left to close.
        let _ = self.0.shutdown(std::net::Shutdown::Both);
    }
}

impl Subscription {
    /// The stream of a connection whose SUBSCRIBE was answered.
    pub(super) fn new(stream: UnixStream) -> Self {
        Subscription {
            stream,
            received: Notifications::default(),
        }
    }

    /// Waits for the next notification: `Ok(None)` when `timeout` passes first (None: wait
    /// forever); the stream stays usable after a timeout. A stream the daemon ended (it drops
    /// subscribers that fall too far behind) or that was closed is `Error::Connection`.
    pub fn next(
        &mut self,
        timeout: Option<Duration>,
    ) -> Result<Option<vovp_types::Notification>, Error> {
        use std::io::{ErrorKind, Read};
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        let mut looked_last = false;
        loop {
            if let Some(n) = self.received.next()? {
                return Ok(Some(n));
            }
            let wait = match deadline {
                None => None,
                Some(d) => match d.checked_duration_since(std::time::Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    // Past the deadline: one last look at what has already arrived (a zero
                    // timeout still reads what is queued), then give up.
                    _ if !looked_last => {
                        looked_last = true;
                        Some(Duration::from_micros(1))
                    }
                    _ => return Ok(None),
                },
            };
            self.stream.set_read_timeout(wait).map_err(conn_err)?;
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(Error::Connection("the notification stream ended".into())),
                Ok(n) => self.received.extend(&chunk[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(conn_err(e)),
            }
        }
    }

    /// A handle that ends this stream from another thread.
    pub fn closer(&self) -> Result<SubscriptionCloser, Error> {
        Ok(SubscriptionCloser(
            self.stream.try_clone().map_err(conn_err)?,
        ))
    }
}
