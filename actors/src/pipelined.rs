//! Pipelined puts: which of them the store has applied, and who waits for that before it may
//! answer "not found" (vovp-shm's `sent` has the argument).
//!
//! A client sends a small PUT flagged pipelined and returns before the reply; it counted the
//! put in its hold table first. The store counts here the flagged puts it applied (failed ones
//! too: they are done). A question that would answer "missing" first takes a [`Barrier`]: the
//! other clients whose sent count is ahead of what the store applied, with that count as the
//! target. The store answers once every target is reached, or its client is gone, or the
//! caller's bound ran out.
//!
//! The engine's `Session` bounds the wait: rounds of 200 ms, another round while the store
//! applied pipelined puts meanwhile, 5 at most, then asks once more; it also asks again when
//! the total moved since just before the question (a put applied between the question and the
//! barrier). So a process told a name by any channel after its `put` returned finds the
//! object, unless the daemon stalls for over a second. A lying client (its table is its own to
//! write) can delay other clients' misses by one round each while connected; a count more than
//! `MAX_IN_FLIGHT` (128) ahead is not believed at all.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::oneshot;

use vovp_types::HolderId;

/// The most pipelined puts a client of this build has sent and not had answered (its cap on
/// owed replies is 64; 32 before), with room to spare. A hold table claiming more is not
/// believed: a client writing its own count could otherwise make every miss wait.
pub(crate) const MAX_IN_FLIGHT: u64 = 128;

/// Pipelined puts applied per client, and the questions waiting for more.
#[derive(Default)]
pub(crate) struct PipelinedPuts {
    applied: HashMap<HolderId, u64>,
    waiting: Vec<Barrier>,
    /// Pipelined puts applied, all clients together, readable outside the actor: a caller
    /// that read it before its question and finds it moved after a miss asks again (a put
    /// may have been applied between the question and its barrier).
    total: Arc<AtomicU64>,
    /// Barriers made, ever: misses that waited for other clients' puts (STATS' put_barriers).
    made: u64,
}

/// A question waiting until these clients' puts are applied.
struct Barrier {
    /// (client, the sent count to reach).
    targets: Vec<(HolderId, u64)>,
    /// `None` once answered.
    done: Option<oneshot::Sender<()>>,
}

impl PipelinedPuts {
    /// Barriers made, ever.
    pub(crate) fn barriers_made(&self) -> u64 {
        self.made
    }

    /// A barrier for `sent` (every client's sent count, from the hold tables), except the
    /// asking client's own puts (its connection's order already puts them first). `None`:
    /// nothing sent is unapplied, answer now.
    pub(crate) fn barrier(
        &mut self,
        asking: HolderId,
        sent: Vec<(HolderId, u64)>,
    ) -> Option<oneshot::Receiver<()>> {
        // Barriers whose askers stopped waiting (their bound ran out) go now: with no put
        // applied meanwhile, nothing else would drop them.
        self.waiting
            .retain(|b| b.done.as_ref().is_some_and(|d| !d.is_closed()));
        let targets: Vec<_> = sent
            .into_iter()
            .filter(|&(h, n)| {
                let unapplied = n.saturating_sub(self.applied(h));
                // More than a client keeps in flight: a count that is not true; ignored.
                h != asking && unapplied > 0 && unapplied <= MAX_IN_FLIGHT
            })
            .collect();
        if targets.is_empty() {
            return None;
        }
        self.made += 1;
        let (done, rx) = oneshot::channel();
        self.waiting.push(Barrier {
            targets,
            done: Some(done),
        });
        Some(rx)
    }

    /// The count of all pipelined puts applied (see the field).
    pub(crate) fn total(&self) -> Arc<AtomicU64> {
        self.total.clone()
    }

    fn applied(&self, holder: HolderId) -> u64 {
        self.applied.get(&holder).copied().unwrap_or(0)
    }

    /// `holder`'s next pipelined put is applied (or failed).
    pub(crate) fn applied_one(&mut self, holder: HolderId) {
        *self.applied.entry(holder).or_insert(0) += 1;
        self.total.fetch_add(1, Ordering::Release);
        if !self.waiting.is_empty() {
            self.release_reached();
        }
    }

    /// `holder` is gone: nothing more of it will be applied, and nobody waits for it.
    pub(crate) fn forget(&mut self, holder: HolderId) {
        self.applied.remove(&holder);
        for b in &mut self.waiting {
            b.targets.retain(|&(h, _)| h != holder);
        }
        self.release_reached();
    }

    /// Answers every barrier whose targets are all reached; drops those nobody waits for any
    /// more (the asker's bound ran out).
    fn release_reached(&mut self) {
        let applied = &self.applied;
        self.waiting.retain_mut(|b| {
            b.targets
                .retain(|&(h, n)| applied.get(&h).copied().unwrap_or(0) < n);
            if b.targets.is_empty() {
                if let Some(done) = b.done.take() {
                    let _ = done.send(());
                }
                return false;
            }
            b.done.as_ref().is_some_and(|d| !d.is_closed())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(n: u64) -> HolderId {
        HolderId::from_raw(n)
    }

    #[test]
    fn a_barrier_waits_for_other_clients_puts_only() {
        let mut p = PipelinedPuts::default();
        let (a, b) = (holder(1), holder(2));
        // Nothing sent: no barrier; the asker's own puts never make one.
        assert!(p.barrier(a, vec![]).is_none());
        assert!(p.barrier(a, vec![(a, 3)]).is_none());
        let mut rx = p
            .barrier(a, vec![(a, 3), (b, 2)])
            .expect("b's puts are unapplied");
        p.applied_one(b);
        assert!(
            rx.try_recv().is_err(),
            "one of b's two puts is still unapplied"
        );
        p.applied_one(b);
        assert!(rx.try_recv().is_ok());
        // Applied already: no barrier.
        assert!(p.barrier(a, vec![(b, 2)]).is_none());
    }

    #[test]
    fn a_count_beyond_what_a_client_keeps_in_flight_is_not_believed() {
        let mut p = PipelinedPuts::default();
        assert!(p
            .barrier(holder(1), vec![(holder(2), MAX_IN_FLIGHT + 1)])
            .is_none());
        assert!(p
            .barrier(holder(1), vec![(holder(2), MAX_IN_FLIGHT)])
            .is_some());
    }

    #[test]
    fn a_client_that_goes_away_releases_the_barriers_on_it() {
        let mut p = PipelinedPuts::default();
        let mut rx = p
            .barrier(holder(1), vec![(holder(2), 5)])
            .expect("unapplied");
        p.forget(holder(2));
        assert!(rx.try_recv().is_ok());
    }
}
