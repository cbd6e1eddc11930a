//! The transfer threads: a few threads, each running a tokio-uring runtime (its own io_uring),
//! on which every transfer stream is served or received. The daemon's thread never touches a
//! transfer's bytes: it only answers the object-table messages the streams' sessions send.
//!
//! Work is handed out round robin as closures that build their (thread-local, `!Send`) future
//! on the thread that runs it; the streams of one transfer go to different threads, so their
//! copies and page faults run on different cores at once. The threads run at a lower priority
//! than the daemon's thread, which must answer its socket clients even while every core is
//! busy with a transfer.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{mpsc, oneshot};

/// The transfer threads' nice value: on a machine whose cores are all busy, the daemon's
/// thread (socket clients) is scheduled ahead of bulk copies.
const NICE: i32 = 5;

/// Lowers this thread's priority to [`NICE`] (Linux: a thread's own nice value; best effort).
fn yield_to_the_daemon() {
    // SAFETY: plain system calls on this thread's own id.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, NICE);
    }
}

type Job = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()>>> + Send>;

/// The transfer threads (see the module doc).
#[derive(Debug)]
pub(crate) struct Pool {
    threads: Vec<mpsc::UnboundedSender<Job>>,
    next: AtomicUsize,
}

impl Pool {
    /// Starts `threads` threads (at least one).
    pub(crate) fn start(threads: usize) -> std::io::Result<Pool> {
        let mut senders = Vec::new();
        for i in 0..threads.max(1) {
            let (tx, mut rx) = mpsc::unbounded_channel::<Job>();
            std::thread::Builder::new()
                .name(format!("vovp-transfer-{i}"))
                .spawn(move || {
                    yield_to_the_daemon();
                    tokio_uring::start(async move {
                        while let Some(job) = rx.recv().await {
                            tokio_uring::spawn(job());
                        }
                    })
                })?;
            senders.push(tx);
        }
        Ok(Pool {
            threads: senders,
            next: AtomicUsize::new(0),
        })
    }

    pub(crate) fn threads(&self) -> usize {
        self.threads.len()
    }

    /// Runs the future `work` builds on the next thread; its output comes back through the
    /// returned receiver (closed if the thread is gone).
    pub(crate) fn run<T, F, Fut>(&self, work: F) -> oneshot::Receiver<T>
    where
        T: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = T> + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.threads.len();
        let job: Job = Box::new(move || {
            Box::pin(async move {
                let _ = tx.send(work().await);
            })
        });
        // A thread that is gone drops the job, and with it the sender: the caller sees the
        // receiver closed.
        let _ = self.threads[i].send(job);
        rx
    }
}
