//! Puts sent without waiting: one word of the client's hold-table header that lets the store
//! answer "not found" only once it has applied every such put sent before the question.
//!
//! A client may send a small PUT and return before the store answered it (a *pipelined*
//! put: the reply is read later). The put's caller may then tell another process the name by
//! any channel (a pipe, a queue, a barrier), and that process's GET may reach the store before
//! the PUT, which still waits in the first client's socket. So:
//!
//! * **client**: `puts_sent += 1` (`Release`) *before* writing each pipelined PUT, which is
//!   flagged `PUT_PIPELINED`. So once the put has returned, the count includes it.
//! * **store**: counts the flagged PUTs it has applied per client (its own memory, not this
//!   table). Before answering that a name is missing, it loads every other client's
//!   `puts_sent` (`Acquire`) and waits until it has applied that many of each client's puts
//!   (bounded: a client that counts puts it never sends only delays others' misses, by at
//!   most the store's bound).
//!
//! Anything the asking process learnt after a put returned was caused by the increment, so the
//! store's load sees it, and the store answers after that put was applied. A client's death
//! drops its table and its count with it.

use std::sync::atomic::Ordering::{Acquire, Release};

use crate::layout::HoldHeader;

/// The client's side: counts a pipelined put before it is sent.
#[derive(Debug)]
pub struct SentPuts<'a> {
    header: &'a HoldHeader,
}

impl<'a> SentPuts<'a> {
    pub fn new(header: &'a HoldHeader) -> Self {
        SentPuts { header }
    }

    /// Counts one pipelined put about to be sent.
    pub fn count(&self) {
        self.header.puts_sent.fetch_add(1, Release);
    }

    /// Pipelined puts counted so far.
    pub fn sent(&self) -> u64 {
        self.header.puts_sent.load(Acquire)
    }
}
