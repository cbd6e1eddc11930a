//! The connection: one request at a time over the blocking socket, replies read in order
//! (those of pipelined puts when they are due), reconnect, segment mappings.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vovp_proto::{Opcode, Reply, Request};
use vovp_types::{Error, ObjectRef};

use super::{ClientInner, Conn, DROP_READ_LIMIT};
use crate::core::{self, Answered, Core, Expect, Unread, UnreadKind, Wire};
use crate::io::{self, handshake};
use crate::mapping::{MappedSegment, Mappings};

impl Conn {
    pub(super) fn new(stream: UnixStream) -> Self {
        Conn {
            stream,
            wire: Wire::new(),
            input: io::ReadAhead::new(),
            failed_puts: None,
            small: super::kept::SmallLendSlot::default(),
        }
    }

    /// Reads the replies still owed, then sends the batch `core` frames for `req` and reads
    /// `req`'s reply. Owed replies first: one may release a reference (a pipelined put whose
    /// view was dropped), and that release must reach the store before `req` (a LIST or
    /// STATS would count it, a put needing the memory would miss it).
    pub(super) fn exchange(&mut self, core: &Core, req: &Request<'_>) -> Result<Reply, Error> {
        self.drain_unread()?;
        let id = core.frame(&mut self.wire, req);
        io::write_all(self.stream.as_fd(), &self.wire.out)?;
        self.read_reply(id, req)
    }

    /// Reads the reply to request `id`, `req` (the next frame on the stream).
    pub(super) fn read_reply(&mut self, id: u64, req: &Request<'_>) -> Result<Reply, Error> {
        self.read_reply_with(id, |payload| Reply::decode_for(req, payload))
    }

    /// [`Conn::read_reply`] with the reply's body decoded by `decode`.
    fn read_reply_with(
        &mut self,
        id: u64,
        decode: impl FnOnce(&[u8]) -> Result<Reply, vovp_proto::DecodeError>,
    ) -> Result<Reply, Error> {
        let fd = self.stream.as_fd();
        self.input.next_frame(fd, |h, payload| {
            core::decode_reply_with(h, payload, id, decode)
        })?
    }

    /// Reads the reply of the oldest request sent without waiting. A failed SEAL can only be
    /// reported now, as a warning (the receiver's GET then times out); a failed put is logged
    /// and kept for [`Client::sync`] (another call of this client is not the place: it would
    /// fail for something it did not do). A broken stream is this call's error.
    pub(super) fn read_unread(&mut self) -> Result<(), Error> {
        let Some(Unread { id, kind, objects }) = self.wire.unread.pop_front() else {
            return Ok(());
        };
        // Decoded by opcode and names (PUBLISH's reply decodes as PUT's: an objref).
        let names: Vec<&str> = objects.iter().map(|o| o.name.as_str()).collect();
        let opcode = match kind {
            UnreadKind::Seal => Opcode::Seal,
            UnreadKind::Put if names.len() == 1 => Opcode::Put,
            UnreadKind::Put => Opcode::PublishMany,
        };
        let reply = self.read_reply_with(id, |p| Reply::decode(opcode.code(), p, &names));
        let answers: Vec<Result<ObjectRef, Error>> = match reply {
            Ok(Reply::Published(results)) => results
                .into_iter()
                .map(|r| r.map_err(Error::from))
                .collect(),
            Ok(reply) => vec![reply.object()],
            // A broken stream: this call's error (and the waiting views').
            Err(e @ (Error::Connection(_) | Error::Protocol(_))) => {
                // After a reply that makes no sense the connection stays in use and the store
                // may not have applied the PUBLISH yet: a view keeps its put's range of the
                // lend, as for a refused put. A lost connection took its lends with it (a
                // reconnect starts afresh): nothing left to keep.
                let keep = matches!(e, Error::Protocol(_));
                for o in objects {
                    if let Some(p) = &o.pending {
                        p.resolve(Err(e.clone()), o.writing.filter(|_| keep));
                    }
                }
                return Err(e);
            }
            Err(e) => objects.iter().map(|_| Err(e.clone())).collect(),
        };
        for (object, answer) in objects.into_iter().zip(answers) {
            // (A put's announced write ends here, now that the store has applied its PUBLISH,
            // unless a failed put's view keeps it.)
            let mut writing = object.writing;
            if let (Some(w), Err(Error::NotFound(_))) = (writing.as_mut(), &answer) {
                // PUBLISH's NOT_FOUND is about the lend (never the name): the store no longer
                // has it, so forget it, and there is nothing left for a view to keep.
                w.lend_gone();
                writing = None;
            }
            if let Some(p) = &object.pending {
                p.resolve(answer.clone(), writing);
            }
            let Err(e) = answer else { continue };
            let owned = &object.name;
            match kind {
                UnreadKind::Put => {
                    tracing::warn!("vovp: the put of {owned:?}, sent without waiting, failed: {e}");
                    self.record_failed_puts(e, 1);
                }
                UnreadKind::Seal => tracing::warn!("vovp: deferred seal of {owned:?} failed: {e}"),
            }
        }
        Ok(())
    }

    /// Whether a pipelined put of `name` with `options` (PUT or PUBLISH) may go out now, with
    /// the owed replies that arrived read first. Refused as a waiting put would be: a name in
    /// the directory (unless REPLACE) is `AlreadyExists` at once; `false` while this client's
    /// own put of it is unanswered (`also_owed`: names of puts framed but not written yet), so
    /// that a second put of it waits and fails as it would have without pipelining.
    pub(super) fn may_pipeline<'n>(
        &self,
        shared: &vovp_shm::SharedReader,
        name: &str,
        options: &vovp_types::PutOptions,
        mut also_owed: impl Iterator<Item = &'n str>,
    ) -> Result<bool, Error> {
        // (After reading the replies that came: a put answered is in the directory.)
        if !options.replace && shared.is_published(name) {
            return Err(Error::AlreadyExists(name.to_owned()));
        }
        Ok(!self.wire.unread.iter().any(|u| u.puts(name)) && !also_owed.any(|n| n == name))
    }

    /// Objects named by the requests whose replies are still owed.
    pub(super) fn owed_objects(&self) -> usize {
        self.wire.unread.iter().map(|u| u.objects.len()).sum()
    }

    /// Keeps `e` for [`Client::sync`] (unless an earlier failure is kept) and counts `n` more
    /// failed pipelined puts.
    pub(super) fn record_failed_puts(&mut self, e: Error, n: u64) {
        match &mut self.failed_puts {
            Some((_, count)) => *count += n,
            None => self.failed_puts = Some((e, n)),
        }
    }

    /// Writes one-way RELEASE frames for `ids` now (nothing for none). A failed write is left
    /// for the next call to find: a release has no reply to wait for.
    pub(super) fn send_releases(&mut self, ids: &[u64]) {
        if ids.is_empty() {
            return;
        }
        self.wire.out.clear();
        self.wire.push_releases(ids);
        let _ = io::write_all(self.stream.as_fd(), &self.wire.out);
    }

    /// Reads every reply still owed, in order.
    pub(super) fn drain_unread(&mut self) -> Result<(), Error> {
        while !self.wire.unread.is_empty() {
            self.read_unread()?;
        }
        Ok(())
    }

    /// Before one more pipelined put: replies owed stay few, so this reads those that came,
    /// and at the cap waits for all of them.
    pub(super) fn make_room_for_a_put(&mut self) -> Result<(), Error> {
        if self.owed_objects() >= super::MAX_UNREAD {
            self.drain_unread()
        } else {
            self.drain_arrived()
        }
    }

    /// Reads the owed replies that have arrived, without waiting for the others.
    pub(super) fn drain_arrived(&mut self) -> Result<(), Error> {
        while !self.wire.unread.is_empty() && self.input.frame_arrived(self.stream.as_fd())? {
            self.read_unread()?;
        }
        Ok(())
    }

    /// Asks for segment `segment`'s fd and maps it.
    pub(super) fn map_segment(
        &mut self,
        core: &Core,
        segment: u32,
    ) -> Result<MappedSegment, Error> {
        // The SEGMENT reply carries an fd: read what is still due before asking.
        self.drain_unread()?;
        if !self.input.is_empty() {
            return Err(Error::Protocol(
                "bytes from the daemon that no request asked for, before a SEGMENT reply".into(),
            ));
        }
        let id = core.frame(&mut self.wire, &Request::Segment { id: segment });
        let fd = self.stream.as_fd();
        io::write_all(fd, &self.wire.out)?;
        let (frame, fds) = io::read_frame_with_fds(fd)?;
        core::map_segment_reply(&frame, id, segment, fds)
    }
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        // Pipelined puts whose answers are still owed: read them (a failure is logged by
        // `read_unread`), for a bounded time. Only in the process that sent them: a forked
        // child shares the socket, and what it read would be missing in the parent.
        let ours = self
            .core
            .current
            .maps()
            .shared
            .as_ref()
            .is_some_and(|s| s.can_announce());
        if let Ok(conn) = self.conn.get_mut() {
            if ours
                && !self.closed.load(Ordering::Acquire)
                && conn.wire.unread.iter().any(|u| u.kind == UnreadKind::Put)
                && conn.stream.set_read_timeout(Some(DROP_READ_LIMIT)).is_ok()
            {
                let _ = conn.drain_unread();
            }
        }
    }
}

impl ClientInner {
    /// Sends the queued releases (the flusher thread, `Client::flush`; waits for a request in
    /// flight).
    pub(super) fn flush_deferred(&self) {
        let Ok(mut conn) = self.lock() else {
            return;
        };
        conn.send_releases(&self.core.take_deferred());
    }

    /// The flusher's send: `false` while the connection is busy with a call (queued releases
    /// then ride with the next request or a later try), or while a reply whose view was
    /// dropped is still on its way; `true` when nothing is left to do.
    pub(super) fn try_flush_deferred(&self) -> bool {
        if self.is_closed() {
            return true;
        }
        let mut conn = match self.conn.try_lock() {
            Ok(conn) => conn,
            Err(std::sync::TryLockError::WouldBlock) => return false,
            Err(std::sync::TryLockError::Poisoned(_)) => return true,
        };
        // Replies of pipelined puts whose views are gone: the references they grant go back
        // with the releases below (reading them is the only way to learn the ids).
        let owed = |c: &Conn| (c.wire.unread.iter()).any(|u| u.pending().any(|p| p.is_abandoned()));
        if owed(&conn) && conn.drain_arrived().is_err() {
            return true;
        }
        if self.core.has_deferred() {
            conn.send_releases(&self.core.take_deferred());
        }
        !owed(&conn)
    }

    /// The connection, locked, unless the client was closed.
    pub(super) fn lock(&self) -> Result<std::sync::MutexGuard<'_, Conn>, Error> {
        let conn = self
            .conn
            .lock()
            .map_err(|_| Error::Internal("client lock poisoned".into()))?;
        if self.is_closed() {
            return Err(Error::Connection("the vovp client is closed".into()));
        }
        Ok(conn)
    }

    pub(super) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    pub(super) fn call(&self, req: &Request<'_>) -> Result<Reply, Error> {
        self.call_in_session(req).map(|(r, _)| r)
    }

    /// Sends `req` and reads its reply, with the mappings and generation of the connection
    /// that answered; one reconnect and retry when the daemon went away and the client opted in.
    pub(super) fn call_in_session(&self, req: &Request<'_>) -> Result<(Reply, Answered), Error> {
        let mut conn = self.lock()?;
        let session = self.core.current.now();
        match conn.exchange(&self.core, req) {
            Err(Error::Connection(why)) if self.core.reconnect && !self.is_closed() => {
                tracing::info!("vovp: connection lost ({why}); reconnecting");
                let (stream, mut maps) = handshake(&self.core.path, self.shared_reads)?;
                maps.defer_cuda = self.defer_cuda;
                if let Ok(mut c) = self.closer.lock() {
                    *c = stream.try_clone().ok();
                }
                conn.stream = stream;
                conn.input.clear();
                // Puts sent without waiting and never answered went with the old daemon (as
                // every object it held): `sync` says so.
                let lost = (conn.wire.unread.iter())
                    .filter(|u| u.kind == UnreadKind::Put)
                    .map(|u| u.objects.len() as u64)
                    .sum::<u64>();
                if lost > 0 {
                    let e = Error::Connection(format!(
                        "{lost} puts sent without waiting were lost with the old connection"
                    ));
                    for p in conn.wire.unread.iter().flat_map(Unread::pending) {
                        p.resolve(Err(e.clone()), None);
                    }
                    conn.record_failed_puts(e, lost);
                }
                // The small lend was the old daemon's (views into it keep their mapping).
                conn.small = super::kept::SmallLendSlot::default();
                let answered = self.core.reconnected(&mut conn.wire, maps);
                let reply = conn.exchange(&self.core, req)?;
                Ok((reply, answered))
            }
            other => other.map(|r| (r, session)),
        }
    }

    /// Maps segment `segment` (SEGMENT) into `maps`, those of connection `generation`.
    pub(super) fn map_segment_of(
        &self,
        maps: &Mappings,
        generation: u64,
        segment: u32,
    ) -> Result<Arc<MappedSegment>, Error> {
        let mut conn = self.lock()?;
        if self.core.current.generation() != generation {
            return Err(Error::Connection(
                "the daemon went away while mapping a segment".into(),
            ));
        }
        let seg = Arc::new(conn.map_segment(&self.core, segment)?);
        maps.insert_segment(segment, seg.clone());
        Ok(seg)
    }
}
