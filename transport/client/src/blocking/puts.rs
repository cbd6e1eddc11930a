//! Puts that skip a round trip: through this client's lend (one PUBLISH, no CREATE; kept ones
//! also without waiting for its reply) and pipelined small puts (no wait for the reply;
//! failures reported by `Client::sync`).

use std::os::fd::AsFd;
use std::sync::Arc;

use vovp_proto::{Reply, Request, PUT_KEEP_REFERENCE, PUT_PIPELINED};
use vovp_types::{CreateOptions, Error, Location};

use super::{ClientInner, Conn};
use crate::core::{requests, Answered, Expect, OwedObject, Unread, UnreadKind};
use crate::io;
use crate::lent::{self, Lent, Reservation, Reserved};
use crate::pending::{Pending, PipelinedView, ReplyReader};

/// Why [`ClientInner::reserve_lent`] gave no range.
enum Unlent {
    /// Not through a lend (see [`ClientInner::put_lent`]).
    No,
    /// The lend is full and puts still write into it ([`Reservation::Busy`]).
    Busy,
}

impl ClientInner {
    /// Puts through a lend: the bytes are written into this client's lend and one PUBLISH
    /// makes them a sealed object. `None`: not through a lend (too small or too big for one,
    /// a store that lends nothing, the lend busy); the caller puts another way.
    pub(super) fn put_lent(
        &self,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: &CreateOptions,
        keep: bool,
    ) -> Option<Result<(Reply, Answered), Error>> {
        let mut reserved = self
            .reserve_lent(data.len(), metadata.len(), options)
            .ok()?;
        let flags = if keep { PUT_KEEP_REFERENCE } else { 0 };
        let result = self.publish_reserved(&reserved, name, data, metadata, options, flags);
        // NOT_FOUND from PUBLISH is about the lend (never the name): the store no longer
        // has it, so put another way (the bytes are copied again, once).
        if matches!(result, Err(Error::NotFound(_))) {
            reserved.lend_gone();
            return None;
        }
        Some(result)
    }

    /// A range of this client's lend for a put of `size` data and `metadata_len` metadata
    /// bytes (asking for a new lend when the current one is full); else why not.
    fn reserve_lent(
        &self,
        size: usize,
        metadata_len: usize,
        options: &CreateOptions,
    ) -> Result<Reserved, Unlent> {
        if options.device.is_some_and(|d| d != vovp_types::Device::Cpu) {
            return Err(Unlent::No);
        }
        let capacity = || self.core.session.maps().capacity;
        let need = (self.lends.wants(size, metadata_len, capacity)).ok_or(Unlent::No)?;
        // A lend is taken back through the hold table: no table (or a forked child, which
        // cannot announce its writes there), no lend.
        let maps = self.core.session.maps();
        if !maps.shared.as_ref().is_some_and(|s| s.can_announce()) {
            return Err(Unlent::No);
        }
        let generation = self.core.session.generation();
        match self.lends.reserve(need, generation) {
            Reservation::Got(r) => Ok(r),
            Reservation::Busy => Err(Unlent::Busy),
            Reservation::No => Err(Unlent::No),
            Reservation::Lend(asked) => {
                let lent = self.take_lend(asked.at_least);
                asked.install(lent).ok_or(Unlent::No)
            }
        }
    }

    fn publish_reserved(
        &self,
        r: &Reserved,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: &CreateOptions,
        put_flags: u32,
    ) -> Result<(Reply, Answered), Error> {
        let req = r.write(name, data, metadata, options, put_flags)?;
        let (reply, answered) = self.call_in_session(&req)?;
        if answered.1 != r.generation {
            // Reconnected in between: the new daemon knows no such lend (it answered NOT_FOUND).
            return Err(Error::Connection(
                "the daemon went away during a put; put again".into(),
            ));
        }
        Ok((reply, answered))
    }

    /// [`super::Client::put_view_later`] of a put through the lend (64 KiB up to the lend's
    /// largest object): written into the lend as [`ClientInner::put_lent`] does, but the
    /// PUBLISH (KEEP_REFERENCE | PIPELINED) goes out without waiting, and the store's copy
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
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: &CreateOptions,
    ) -> Option<Result<PipelinedView, Error>> {
        if !self.pipelined_puts {
            return None;
        }
        // Refused here, now, as a waiting put's would be (before any byte is copied).
        if let Err(e) = crate::core::check_put(name, metadata) {
            return Some(Err(e));
        }
        let reserved = match self.reserve_lent(data.len(), metadata.len(), options) {
            Ok(r) => r,
            // The lend is full and puts still count as writing into it: if they are this
            // client's owed ones, it may be replaced once their replies are read.
            Err(Unlent::Busy) if self.read_owed_lend_puts() => self
                .reserve_lent(data.len(), metadata.len(), options)
                .ok()?,
            Err(_) => return None,
        };
        // The copy runs outside the connection's lock (other threads' calls go on meanwhile).
        let put_flags = PUT_KEEP_REFERENCE | PUT_PIPELINED;
        let flags = crate::core::create_flags(options) | put_flags;
        let req = match reserved.write(name, data, metadata, options, put_flags) {
            Ok(r) => r,
            Err(e) => return Some(Err(e)),
        };
        let mut conn = match self.lock() {
            Ok(c) => c,
            Err(e) => return Some(Err(e)),
        };
        // The mappings and generation of the connection this lock guards: the lend must be
        // that connection's, and the put counted in its hold table.
        let (maps, generation) = self.core.session.current();
        let shared = maps.shared.as_ref().filter(|s| s.can_announce())?;
        if generation != reserved.generation {
            return None;
        }
        let sent = self.send_pipelined(&mut conn, shared, name, flags, &req, || {
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
    pub(super) fn put_pipelined(
        &self,
        name: &str,
        flags: u32,
        metadata: &[u8],
        data: &[u8],
    ) -> Option<Result<(), Error>> {
        if !self.pipelined_puts {
            return None;
        }
        // What the store would refuse whatever its state is refused here, now, as a waiting
        // put's would be: a bad name, too much metadata, a name published already or put by
        // this client a moment ago. (A name another client took but has not published yet
        // fails in the store: `sync` reports it.)
        if let Err(e) = crate::core::check_put(name, metadata) {
            return Some(Err(e));
        }
        let req = match requests::put(name, flags | vovp_proto::PUT_PIPELINED, metadata, data) {
            Ok(r) => r,
            Err(e) => return Some(Err(e)),
        };
        let mut conn = match self.lock() {
            Ok(c) => c,
            Err(e) => return Some(Err(e)),
        };
        // The mappings of the connection this lock guards (a reconnect replaces both under
        // it): the count must go into the hold table of the connection the PUT goes out on.
        let maps = self.core.session.maps();
        let shared = maps.shared.as_ref()?;
        if !shared.can_announce() {
            return None;
        }
        let sent = self.send_pipelined(&mut conn, shared, name, flags, &req, || {
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
    /// pipelined put of `name` with flags `flags`, once the checks every pipelined put makes
    /// pass: room among the owed replies, [`Conn::may_pipeline`], and the put counted in
    /// `puts_sent`. `owe` makes its owed-reply entry and what the caller returns. `Ok(None)`:
    /// not this way (this client's own put of the name is unanswered, so the caller puts the
    /// waiting way, which reads that answer first; or a table that cannot count).
    fn send_pipelined<T>(
        &self,
        conn: &mut Conn,
        shared: &vovp_shm::SharedReader,
        name: &str,
        flags: u32,
        req: &Request<'_>,
        owe: impl FnOnce() -> (OwedObject, T),
    ) -> Result<Option<T>, Error> {
        conn.make_room_for_a_put()?;
        // Counted before it goes out: another client told the name is missing waits for it
        // (vovp-shm's `sent`).
        if !conn.may_pipeline(shared, name, flags, std::iter::empty())? || !shared.count_sent_put()
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

    /// LEND: a new lend of at least `at_least` bytes, its segment mapped writable, and the
    /// connection generation it belongs to.
    pub(super) fn take_lend(&self, at_least: u64) -> Result<Lent, Error> {
        let (reply, answered) = self.call_in_session(&Request::Lend { at_least, flags: 0 })?;
        let lend = reply.lent()?;
        let segment = match answered.0.segment(lend.segment) {
            Some(s) => s,
            None => self.map_segment_of(&answered.0, answered.1, lend.segment)?,
        };
        lent::check(&lend, &segment)?;
        // The store lends only to connections with a hold table; one without is refused
        // before asking (`put_lent`), so this is a daemon out of step: put another way.
        let shared = answered.0.shared.clone().ok_or_else(|| {
            Error::Config("a lend without a hold table to take it back through".into())
        })?;
        Ok((lend, segment, answered.1, shared))
    }
}
