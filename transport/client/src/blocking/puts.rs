//! The blocking client's puts that return before the store's answer (the pipelined routes of
//! `vovp_types::put`): a kept put through this client's lend whose PUBLISH goes out without
//! waiting ([`Route::LendPipelined`]), and a small put that keeps nothing, sent inline without
//! waiting ([`Route::InlinePipelined`]; failures reported by `Client::sync`). The small lend's
//! kept puts are `kept.rs`'s.
//!
//! # Pipelined puts: the promises
//!
//! A put small enough to ride in the PUT (below [`lends::MIN_OBJECT`], where lends start; up
//! to the inline limit with lends off) that keeps no reference returns once the request is
//! written: a put costs a write, not a round trip. Python's `put` and the CLI's `vovp put`
//! (which then `sync`s) go this way; the Plasma drop-in does not (Plasma raises
//! `PlasmaStoreFull` and `PlasmaObjectExists` from the put itself). Replies are read later:
//! when they have arrived (before the next pipelined put), before any waiting call's reply, by
//! `sync()`, and when the client is dropped; at most `MAX_UNREAD` (64) are owed.
//! * *Visibility.* The client adds 1 to its hold table's `puts_sent` before writing the PUT
//!   (flagged `PUT_PIPELINED`), under its connection lock, so the count and the PUT go to the
//!   same connection, a reconnect included; a miss elsewhere waits for it
//!   (`vovp_shm::sent`, the store's side in `vovp-actors`' `pipelined`).
//! * *Errors.* What the store refuses whatever its state (a bad name, metadata over the
//!   limit, a name already in the directory) is refused by the put itself, nothing sent; a put
//!   of a name this client put a moment ago waits for that answer first. A failure in the
//!   store (a name taken by a racing put or by an unsealed object, full memory) is logged when
//!   its reply is read and returned by the next `sync()`, never by an unrelated later call.
//!   Puts unanswered when a reconnect replaces the connection went with the old daemon:
//!   `sync()` reports them as a connection error.
//! * *Nothing lost on exit.* The daemon carries out the requests of a peer that closed its
//!   socket (replies dropped), so puts written just before a process exits are applied. A
//!   dropped `Client` reads its owed replies first (2 s per reply at most), but not in a forked
//!   child: those replies are the parent's.
//! * *Not covered:* `list` and STATS of other clients are snapshots and may not show puts on
//!   their way; `Client::close` shuts the socket at once, so failures are no longer read
//!   (`sync` first).
//! * *Opt out:* `ClientOptions::no_pipelined_puts`, Python `pipelined_puts=False`, or
//!   `put(..., wait=True)` in Python. Without a hold table (no shared reads, a forked child)
//!   puts wait. The async client and raw puts through a lend still wait for their reply.
//!
//! # Kept puts through the lend
//!
//! A kept put of [`lends::MIN_OBJECT`] up to the lend's largest object (Python's `put_tensor`
//! of a host tensor among them) goes through the lend as a
//! waiting put does (a range reserved and announced in `lend_writers`, the bytes copied outside
//! the connection lock), then, under the lock, the pipelined put's checks, `puts_sent` += 1 and
//! its PUBLISH (`KEEP_REFERENCE | PIPELINED`) written without waiting; the [`PipelinedView`]
//! over the range comes back at once. The lend handshake (`vovp_shm::lend`) lets a writer
//! withdraw only after PUBLISH's *reply*, so the reservation rides in the owed reply
//! (`OwedObject::writing`) and is dropped when the reply is read. Until then the store cannot
//! take the lend back and the client asks for no new one: a put that finds the lend full while
//! only its own owed puts count as writers reads their replies and tries once more. A failed
//! PUBLISH keeps its reservation with its view (`crate::pending`); a PUBLISH answered
//! NOT_FOUND (the store no longer has the lend) makes the client forget the lend. After a
//! reconnect the old connection's lend is forgotten once nothing writes into it any more (a
//! failed view of it keeps lend puts off until it is dropped: a waiting put's PUBLISH into the
//! old lend could otherwise meet a new lend of the same id). Why: after a pause the PUBLISH
//! round trip cost 231-296 µs of a 1 MiB put's 490 (the store's thread idle, its caches cold);
//! without it the put is the copy, the write and the client's own work (benches/FINDINGS.md,
//! finding 19).
//!
//! [`lends::MIN_OBJECT`]: vovp_types::lends::MIN_OBJECT
//! [`PipelinedView`]: crate::PipelinedView
//! [`Route::LendPipelined`]: vovp_types::put::Route::LendPipelined
//! [`Route::InlinePipelined`]: vovp_types::put::Route::InlinePipelined

use std::os::fd::AsFd;
use std::sync::Arc;

use vovp_proto::Request;
use vovp_types::{Error, Location};

use super::{ClientInner, Conn};
use crate::core::{requests, OwedObject, Unread, UnreadKind};
use crate::io;
use crate::ops::{self, PutArgs, Unlent};
use crate::pending::{Pending, PipelinedView, ReplyReader};

impl ClientInner {
    /// [`super::Client::put_view_later`] of a put through the lend (64 KiB up to the lend's
    /// largest object): written into the lend as a waiting put through it is (`crate::ops`),
    /// but the PUBLISH (KEEP_REFERENCE | PIPELINED) goes out without waiting, and the store's copy
    /// comes back as a [`PipelinedView`]. The put's announced write into the lend rides in
    /// the owed reply and is withdrawn only when that reply is read (a failed put's view
    /// keeps it while it lives: `crate::pending`), as `vovp_shm::lend` requires. `None`: not
    /// this way (pipelining off, not through a lend, a connection that changed meanwhile).
    ///
    /// Kept puts only: the reference a stored put keeps is what keeps its lend from emptying
    /// while the reply is owed. A raw put's object could be evicted meanwhile, and an idle
    /// client's unread reply would then stop the store from taking the emptied lend back
    /// (as a failed kept put's unread reply, or its live view, does: rare, and bounded by
    /// one lend).
    pub(super) fn put_lent_later(
        self: &Arc<Self>,
        put: &PutArgs<'_>,
    ) -> Option<Result<PipelinedView, Error>> {
        let (name, data, metadata) = (put.name, put.data, put.metadata);
        // Refused here, now, as a waiting put's would be (before any byte is copied).
        if let Err(e) = crate::core::check_put(name, metadata) {
            return Some(Err(e));
        }
        let reserve = || {
            let reserved = ops::reserve_lent(self, data.len(), metadata.len());
            ops::poll_once(reserved).unwrap_or(Err(Unlent::No))
        };
        let reserved = match reserve() {
            Ok(r) => r,
            // The lend is full and puts still count as writing into it: if they are this
            // client's owed ones, it may be replaced once their replies are read.
            Err(Unlent::Busy) if self.read_owed_lend_puts() => reserve().ok()?,
            Err(_) => return None,
        };
        // The copy runs outside the connection's lock (other threads' calls go on meanwhile).
        let options = put.options.with(true, true);
        let req = match reserved.write(name, data, metadata, &options) {
            Ok(r) => r,
            Err(e) => return Some(Err(e)),
        };
        let mut conn = match self.lock() {
            Ok(c) => c,
            Err(e) => return Some(Err(e)),
        };
        // The mappings and generation of the connection this lock guards: the lend must be
        // that connection's, and the put counted in its hold table.
        let (maps, generation) = self.core.current.now();
        let shared = maps.shared.as_ref().filter(|s| s.can_announce())?;
        if generation != reserved.generation {
            return None;
        }
        let sent = self.send_pipelined(&mut conn, shared, name, &options, &req, || {
            let pending = Pending::new(
                reserved.ptr(),
                data.len() as u64,
                Location::Host {
                    segment: reserved.segment_id,
                    offset: reserved.offset,
                },
                reserved.mapping().clone(),
                self.sink_maker(generation),
                None,
            );
            let owed = OwedObject {
                name: name.to_owned(),
                pending: Some(pending.clone()),
                writing: Some(reserved),
            };
            (owed, pending)
        });
        // (The view only once its PUBLISH went out: one dropped before would wake the
        // release thread for a reply never owed.)
        let reader: Arc<dyn ReplyReader> = self.clone();
        match sent {
            Ok(pending) => pending.map(|p| Ok(PipelinedView::new(p, reader))),
            // The waiting way reconnects when it may.
            Err(Error::Connection(_)) if self.core.reconnect => None,
            Err(e) => Some(Err(e)),
        }
    }

    /// Reads every owed reply if some are of puts into the lend (`true`: there were).
    fn read_owed_lend_puts(&self) -> bool {
        let Ok(mut conn) = self.lock() else {
            return false;
        };
        let owed = (conn.wire.unread.iter()).any(|u| u.objects.iter().any(|o| o.writing.is_some()));
        owed && conn.drain_unread().is_ok()
    }

    /// An inline PUT sent without waiting for its reply (read before the next call that
    /// waits for the store, or by [`Client::sync`]): a put then costs a write, not a round
    /// trip. Counted in the hold table first, so no other client is told the name is missing
    /// while the PUT is on its way (vovp-shm's `sent`). `None`: not this way (opted out, no
    /// hold table, a forked child, a broken connection that a waiting call may reconnect).
    pub(super) fn put_pipelined(&self, put: &PutArgs<'_>) -> Option<Result<(), Error>> {
        let (name, data, metadata) = (put.name, put.data, put.metadata);
        let options = put.options.with(false, true);
        // What the store would refuse whatever its state is refused here, now, as a waiting
        // put's would be: a bad name, too much metadata, a name published already or put by
        // this client a moment ago. (A name another client took but has not published yet
        // fails in the store: `sync` reports it.)
        if let Err(e) = crate::core::check_put(name, metadata) {
            return Some(Err(e));
        }
        let req = match requests::put(name, &options, metadata, data) {
            Ok(r) => r,
            Err(e) => return Some(Err(e)),
        };
        let mut conn = match self.lock() {
            Ok(c) => c,
            Err(e) => return Some(Err(e)),
        };
        // The mappings of the connection this lock guards (a reconnect replaces both under
        // it): the count must go into the hold table of the connection the PUT goes out on.
        let maps = self.core.current.maps();
        let shared = maps.shared.as_ref()?;
        if !shared.can_announce() {
            return None;
        }
        let sent = self.send_pipelined(&mut conn, shared, name, &options, &req, || {
            (OwedObject::named(name), ())
        });
        match sent {
            Ok(sent) => sent.map(Ok),
            // The waiting way reconnects when it may.
            Err(Error::Connection(_)) if self.core.reconnect => None,
            Err(e) => Some(Err(e)),
        }
    }

    /// Under the connection's lock (`conn`, whose hold table is `shared`): sends `req`, a
    /// pipelined put of `name` with `options`, once the checks every pipelined put makes
    /// pass: room among the owed replies, [`Conn::may_pipeline`], and the put counted in
    /// `puts_sent`. `owe` makes its owed-reply entry and what the caller returns. `Ok(None)`:
    /// not this way (this client's own put of the name is unanswered, so the caller puts the
    /// waiting way, which reads that answer first; or a table that cannot count).
    fn send_pipelined<T>(
        &self,
        conn: &mut Conn,
        shared: &vovp_shm::SharedReader,
        name: &str,
        options: &vovp_types::PutOptions,
        req: &Request<'_>,
        owe: impl FnOnce() -> (OwedObject, T),
    ) -> Result<Option<T>, Error> {
        conn.make_room_for_a_put()?;
        // Counted before it goes out: another client told the name is missing waits for it
        // (vovp-shm's `sent`).
        if !conn.may_pipeline(shared, name, options, std::iter::empty())?
            || !shared.count_sent_put()
        {
            return Ok(None);
        }
        let (owed, answer) = owe();
        let id = self.core.frame_pipelined(&mut conn.wire, req);
        io::write_all(conn.stream.as_fd(), &conn.wire.out)?;
        conn.wire.unread.push_back(Unread {
            id,
            kind: UnreadKind::Put,
            objects: vec![owed],
        });
        Ok(Some(answer))
    }
}
