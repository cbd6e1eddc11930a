//! Releases of dropped views: sent at once, or queued and sent by a small thread
//! ([`ClientOptions::release_delay`]) or with the next request.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use vovp_types::{Error, ObjectId, ObjectRef, ObjectSink};

use super::{ClientInner, MAX_DEFERRED_RELEASES};
use crate::core::{requests, Expect};

/// [`ClientOptions::release_delay`]'s thread: sends the releases that no request carried within
/// the delay. It holds the client weakly and ends with it.
pub(super) struct Flusher {
    due: Mutex<Due>,
    cv: std::sync::Condvar,
}

/// The flusher's state, under its lock.
#[derive(Default)]
struct Due {
    /// A release was queued since the flusher last looked.
    due: bool,
    /// The flusher waits on the condvar (else it is sleeping out a delay and will look by
    /// itself: no wake-up, which is a system call per release, is needed).
    waiting: bool,
}

impl Flusher {
    pub(super) fn start(inner: std::sync::Weak<ClientInner>, delay: Duration) -> Arc<Flusher> {
        let f = Arc::new(Flusher {
            due: Mutex::new(Due::default()),
            cv: std::sync::Condvar::new(),
        });
        let me = f.clone();
        // Without the thread (none could be spawned) releases still ride with requests.
        let _ = std::thread::Builder::new()
            .name("vovp-release".into())
            .spawn(move || me.run(inner, delay));
        f
    }

    /// A release was queued; `first`: into an empty queue, so a flush is due after the delay.
    pub(super) fn wake(&self, first: bool) {
        if first {
            if let Ok(mut due) = self.due.lock() {
                due.due = true;
                if due.waiting {
                    self.cv.notify_one();
                }
            }
        }
    }

    pub(super) fn run(&self, inner: std::sync::Weak<ClientInner>, delay: Duration) {
        loop {
            let Ok(mut due) = self.due.lock() else {
                return;
            };
            while !due.due {
                // Wakes now and then to notice that the client is gone.
                due.waiting = true;
                match self.cv.wait_timeout(due, Duration::from_millis(200)) {
                    Ok((d, _)) => due = d,
                    Err(_) => return,
                }
                due.waiting = false;
                if inner.strong_count() == 0 {
                    return;
                }
            }
            due.due = false;
            drop(due);
            let mut pause = delay;
            loop {
                std::thread::sleep(pause);
                let Some(client) = inner.upgrade() else {
                    return;
                };
                // Never wait for the connection: a call in flight (a GET waiting for its
                // object) would hand the lock to this thread on return, and that wake-up sits
                // on the caller's path. Its releases usually rode with that call anyway.
                if client.try_flush_deferred() {
                    break;
                }
                pause = (pause * 2).min(MAX_FLUSH_RETRY);
            }
        }
    }
}

/// The flusher's longest wait between tries while the connection stays busy.
const MAX_FLUSH_RETRY: Duration = Duration::from_millis(20);

/// A view's way back to its client: releases go out only while the connection it came from
/// is still the current one.
pub(super) struct ViewSink {
    pub(super) inner: Arc<ClientInner>,
    pub(super) generation: u64,
}

impl ObjectSink for ViewSink {
    fn release(&self, id: ObjectId) {
        let id = id.get();
        // A closed connection's end released it; an older connection's died with it.
        if self.inner.is_closed() || self.inner.core.current.generation() != self.generation {
            return;
        }
        if let Some(flusher) = &self.inner.flusher {
            // Deferred: ride ahead of the next request, or the flusher sends it soon.
            let queued = self.inner.core.defer_release_counted(id, self.generation);
            if queued < MAX_DEFERRED_RELEASES {
                flusher.wake(queued == 1);
                return;
            }
        }
        // Never block in Drop: send now if the connection is free, else queue for the next call.
        match self.inner.conn.try_lock() {
            Ok(mut conn) => {
                let mut ids = self.inner.core.take_deferred();
                ids.push(id);
                conn.send_releases(&ids);
            }
            Err(_) => self.inner.core.defer_release(id, self.generation),
        }
    }

    fn seal(&self, obj: &ObjectRef) -> Result<u64, Error> {
        self.inner
            .core
            .check_generation(self.generation, obj.name.as_str())?;
        self.inner
            .call(&requests::seal(obj.name.as_str())?)?
            .version()
    }
}
