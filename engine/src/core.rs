//! What every session of one engine shares ([`Core`]: the actors, the segments, the holder
//! counter) and how a blocking call waits for an actor ([`block_on`]). Below both the engine
//! and its sessions, so neither imports the other's internals.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kameo::actor::ActorRef;
use tokio::sync::oneshot;
use vovp_actors::gpu::GpuActor;
use vovp_actors::table_actor::ObjectTableActor;
use vovp_actors::AllocatorActor;
use vovp_actors::Segment;
use vovp_types::HolderId;

use crate::Config;

/// The actors of one engine; only sessions talk to them.
pub(crate) struct EngineActors {
    pub(crate) table: ActorRef<ObjectTableActor>,
    pub(crate) allocator: ActorRef<AllocatorActor>,
    pub(crate) gpu: ActorRef<GpuActor>,
}

pub(crate) struct Core {
    pub(crate) actors: EngineActors,
    pub(crate) segments: Arc<[Arc<Segment>]>,
    /// Pipelined puts the table actor applied, ever (`vovp_actors::pipelined`).
    pub(crate) pipelined_puts_applied: Arc<AtomicU64>,
    pub(crate) next_holder: AtomicU64,
    pub(crate) config: Config,
    /// Set by `Engine::spawn`: the private runtime thread and its stop signal.
    pub(crate) runtime: Mutex<Option<(std::thread::JoinHandle<()>, oneshot::Sender<()>)>>,
}

impl Core {
    /// Holder ids come from here only, so no two sessions ever share one.
    pub(crate) fn new_holder(&self) -> HolderId {
        HolderId::from_raw(self.next_holder.fetch_add(1, Ordering::Relaxed))
    }
}

/// How long a blocking call polls its reply before parking the thread.
const REPLY_SPIN: Duration = Duration::from_micros(50);

/// Runs `f` to completion on this thread. The engine answers a small request within a few
/// microseconds, but waking a parked thread on another CPU costs tens of microseconds on
/// virtual machines; polling (yielding the CPU in between) for a short while skips that wake-up.
pub(crate) fn block_on<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let start = std::time::Instant::now();
    while start.elapsed() < REPLY_SPIN {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::yield_now();
    }
    futures_executor::block_on(f)
}
