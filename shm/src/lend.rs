//! Taking a lend back: the handshake between a client writing into its lend and the store that
//! wants the lend's memory, over two words of the client's hold-table header.
//!
//! A lend is part of a client's arena that the client writes objects into before one PUBLISH
//! names each of them (`vovp-actors`' `lends`). The store may free a lend only when no put of
//! that client is writing into it: a write into freed memory could land in an object the
//! client made since in the same range. So:
//!
//! * **write** (client): `lend_writers += 1`, `fence(SeqCst)`, then load `lend_revoked`; if it
//!   names this lend, undo the increment and do not write (ask for a new lend). Otherwise write,
//!   send PUBLISH, and only after its *reply* `lend_writers -= 1` (`Release`): a PUBLISH the
//!   store has not processed yet may still name the lend.
//! * **revoke** (store): store the lend's id in `lend_revoked`, `fence(SeqCst)`, then load
//!   `lend_writers` (`Acquire`); only if it is 0 may the store retire the lend (and free it once
//!   its objects are gone). Otherwise it withdraws the mark (a compare-exchange back to 0):
//!   nothing was retired, and a put that saw the mark meanwhile only went another way.
//! * A client declares that it takes part by writing [`LEND_CLIENT`] into `lend_client` when
//!   it maps its table; the store lends to no connection whose table lacks it (one that never
//!   counted its writers would see its lend freed under its puts).
//!
//! The two SeqCst fences are totally ordered (the same argument as the holds'): if the store's
//! comes first, the client's load sees the revocation and it never writes; if the client's comes
//! first, the store's load sees the count and it keeps the lend. A zero count was stored with
//! `Release` after the last write and the PUBLISH reply, so every write happens before the free.
//!
//! The count covers all of a client's puts (one lend at a time is current). A client that lies
//! (never decrements, or decrements while writing) can only keep its own lend, or corrupt its
//! own objects: its arena holds nothing of anyone else's.

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};

use crate::layout::{HoldHeader, LEND_CLIENT};
use crate::sync::fence;

/// The client's side: puts writing into its lend.
#[derive(Debug)]
pub struct LendWriters<'a> {
    header: &'a HoldHeader,
}

impl<'a> LendWriters<'a> {
    pub fn new(header: &'a HoldHeader) -> Self {
        LendWriters { header }
    }

    /// Declares that this client counts its writers (see the module doc).
    pub fn declare(&self) {
        self.header.lend_client.store(LEND_CLIENT, Release);
    }

    /// Announces a put about to write into lend `lend`; `false` (announcing nothing) when the
    /// store has taken that lend back, so nothing may be written into it.
    pub fn begin(&self, lend: u64) -> bool {
        self.header.lend_writers.fetch_add(1, SeqCst);
        fence(SeqCst);
        if self.header.lend_revoked.load(SeqCst) == lend {
            self.end();
            return false;
        }
        true
    }

    /// Ends a put that [`LendWriters::begin`] let write: after its PUBLISH was answered (or
    /// once it gave up before sending one).
    pub fn end(&self) {
        self.header.lend_writers.fetch_sub(1, Release);
    }
}

/// The store's side: takes a client's lend back.
#[derive(Debug)]
pub struct LendRevoker<'a> {
    header: &'a HoldHeader,
}

impl<'a> LendRevoker<'a> {
    pub fn new(header: &'a HoldHeader) -> Self {
        LendRevoker { header }
    }

    /// Whether the client declared that it takes part in the handshake.
    pub fn client_takes_part(&self) -> bool {
        self.header.lend_client.load(Acquire) == LEND_CLIENT
    }

    /// Takes lend `lend` back if no put is writing into it: `true` when the store may retire
    /// it now. `false`: a put is writing, and the mark is withdrawn again (try later).
    pub fn revoke(&self, lend: u64) -> bool {
        // A put is writing now: leave no mark at all (a stale read only means "not now").
        if self.header.lend_writers.load(Relaxed) != 0 {
            return false;
        }
        self.header.lend_revoked.store(lend, SeqCst);
        fence(SeqCst);
        if self.header.lend_writers.load(Acquire) == 0 {
            return true;
        }
        let _ = self
            .header
            .lend_revoked
            .compare_exchange(lend, 0, SeqCst, Relaxed);
        false
    }

    /// Clears the mark (the client asked for a new lend, so it writes into none now).
    pub fn clear(&self) {
        self.header.lend_revoked.store(0, SeqCst);
    }
}
