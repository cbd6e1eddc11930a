//! Small puts that keep a reference and return at once ([`Client::put_view_later`]): the
//! bytes go into this client's *small lend* (LEND with SMALL, apart from the big lend of
//! `lent`), a PUBLISH with KEEP_REFERENCE | PIPELINED goes out without waiting, and the caller
//! gets the store's copy as a [`PipelinedView`] whose reply is read later (`crate::pending`).
//! A batch's puts go out by flights of up to [`FLIGHT_PUTS`], each one PUBLISH_MANY frame with
//! one reply (a store older than PUBLISH_MANY, asked once per connection, gets PUBLISHes).
//!
//! Why this is safe without the big lend's hold-table handshake: the store never takes a
//! small lend back, and a connection's requests are carried out in order, so every PUBLISH
//! written before the next SMALL LEND is applied before that LEND retires the lend. Only a
//! PUBLISH that *failed* leaves a range in no object (the store would free it with the
//! retired lend): the next small lend is taken only after every owed reply was read and no
//! failed put's view still lives (`pinned`).
//!
//! A kept put: under the connection lock, the checks a pipelined put makes (name, metadata, a
//! name in the directory, this client's own unanswered put of it), a range of the small lend
//! (a bump pointer), `puts_sent` += 1, the bytes copied in, its PUBLISH added to the flight.
//! A flight goes out every [`FLIGHT_PUTS`] puts of a batch (the store works on one flight while
//! the client fills the next), at a new small lend and at the end of the call. A batch of 64
//! costs 8 frames and 8 replies instead of 64 of each (measured: the store's CPU per put
//! 9-10 µs → 3 µs, the client's 9-10 → 7.5 µs). A flight whose write fails is reported as not
//! sent, never as stored.
//!
//! * *A view dropped before its reply* marks its slot abandoned, and the reader releases the
//!   reference the reply grants. The release thread (`release_delay`) reads such replies
//!   itself (`try_flush_deferred`), so an idle client gives the reference back too; Python
//!   therefore pipelines only with a release thread (`release_delay=0` puts wait).
//! * *Writable results* (torch's) view the small lend through a private mapping
//!   (`crate::private`): objects up to 4 KiB get private views even in the client's own arenas;
//!   larger own objects are viewed in place.
//! * *Order:* a waiting call reads owed replies before sending its request, so the releases
//!   they cause reach the store ahead of it (a LIST right after a dropped put sees refcount 0).
//!   Releases of pipelined puts' results ride with a pipelined request only once 64 are queued
//!   (`Core::frame_pipelined`), else with the next waiting request or the release thread: a
//!   stream of dropped small puts would otherwise cost the store two messages per put.
//! * *Memory:* at most one small lend per connection is current (64 KiB, charged to the
//!   budget, never taken back); a retired one goes with its last object, so a small object
//!   that outlives its neighbours keeps at most 64 KiB.
//! * *Errors:* as for pipelined puts (`super::puts`): a refusal is returned by `sync()` (and by
//!   `PipelinedView::wait`, Python's `version_of` of the result); its bytes stay readable.
//!
//! [`Client::put_view_later`]: super::Client::put_view_later

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vovp_proto::{PublishItem, Request, LEND_SMALL};
use vovp_types::put::{self, Route};
use vovp_types::{CreateOptions, Error, Lend, Location};

use super::releases::ViewSink;
use super::{ClientInner, Conn, MAX_UNREAD};
use crate::core::{Core, Expect, OwedObject, Unread, UnreadKind};
use crate::io;
use crate::lent::block_len;
use crate::mapping::MappedSegment;
use crate::pending::{Pending, PipelinedView, ReplyReader, SinkMaker};

/// The puts of a batch written together at most (see `put_one_later`): 8 and 4 measured
/// alike, 16 no better than single calls (the store idles while the client fills a flight).
const FLIGHT_PUTS: usize = 8;

/// After a SMALL LEND the store could not grant (short of memory), small puts wait for their
/// reply this long before asking again.
const SMALL_LEND_RETRY: Duration = Duration::from_millis(100);

/// The connection's small lend (guarded by the connection's lock, as everything it does is a
/// request on that connection).
#[derive(Default)]
pub(super) struct SmallLendSlot {
    current: Option<SmallLend>,
    /// The store lends nothing here (a small store, `--prefault`, no hold table): for good.
    refused: bool,
    /// Whether the store knows PUBLISH_MANY (asked once, with the first small lend; a store
    /// older than it gets one PUBLISH per put).
    pub(super) publish_many: Option<bool>,
    /// No SMALL LEND before this (the last one failed for want of memory).
    retry_after: Option<Instant>,
}

struct SmallLend {
    lend: Lend,
    segment: Arc<MappedSegment>,
    /// Next free offset (absolute in the segment).
    cursor: u64,
    /// Views of failed puts into it that still live (see the module doc).
    pinned: Arc<AtomicUsize>,
}

/// A range of the small lend for one put.
struct Range {
    lend: u64,
    segment_id: u32,
    offset: u64,
    ptr: *mut u8,
    segment: Arc<MappedSegment>,
    pinned: Arc<AtomicUsize>,
}

impl SmallLend {
    fn take(&mut self, need: u64) -> Option<Range> {
        let end = self.lend.offset + self.lend.size;
        if self.cursor + need > end {
            return None;
        }
        let base = self.segment.own_base().ok()?;
        let offset = self.cursor;
        self.cursor += need;
        Some(Range {
            lend: self.lend.id,
            segment_id: self.lend.segment,
            offset,
            // SAFETY: inside the lend, which lies inside the mapped segment (`lent::check`).
            ptr: unsafe { base.add(offset as usize) },
            segment: self.segment.clone(),
            pinned: self.pinned.clone(),
        })
    }
}

impl ReplyReader for ClientInner {
    fn read_until_answered(&self, pending: &Arc<Pending>) -> Result<(), Error> {
        let mut conn = self.lock()?;
        while !pending.is_answered() {
            let owed = conn
                .wire
                .unread
                .iter()
                .any(|u| u.pending().any(|p| Arc::ptr_eq(p, pending)));
            if !owed {
                return Err(Error::Connection(
                    "the connection that carried this put is gone; its outcome is unknown".into(),
                ));
            }
            conn.read_unread()?;
        }
        Ok(())
    }

    fn abandoned(&self) {
        match &self.flusher {
            // The release thread reads it (`try_flush_deferred`), after its delay.
            Some(flusher) => flusher.wake(true),
            // Never block in a drop: what the release thread would do, once, now (the replies
            // that came; the others are read by the next call).
            None => {
                self.try_flush_deferred();
            }
        }
    }
}

/// One kept small put: name, data, metadata, options.
pub(super) type KeptPut<'a> = (&'a str, &'a [u8], &'a [u8], CreateOptions);

/// What [`ClientInner::put_views_later`] answers per put: the view, the put's error, or `None`
/// (not this way: the caller puts the waiting way).
pub(super) type KeptAnswer = Option<Result<PipelinedView, Error>>;

/// The puts of a batch not written yet, all into one small lend: written together as one
/// PUBLISH_MANY (a PUBLISH when alone), one reply owed for them all, queued only once written
/// (the queue's order is the wire's).
#[derive(Default)]
struct Flight<'a> {
    lend: u64,
    items: Vec<PublishItem<'a>>,
    owed: Vec<OwedObject>,
}

impl<'a> Flight<'a> {
    /// Adds a put of `item` from lend `lend` (the flight holds puts into one lend only).
    fn add(&mut self, lend: u64, item: PublishItem<'a>, owed: OwedObject) {
        debug_assert!(self.items.is_empty() || self.lend == lend);
        self.lend = lend;
        self.items.push(item);
        self.owed.push(owed);
    }

    /// Writes what the flight holds (one frame, with the releases due; one PUBLISH per put
    /// to a store that has no PUBLISH_MANY). The flight is emptied only once written: after a
    /// failed write its puts are still here, for `put_views_later` to report as not sent.
    fn flush(&mut self, core: &Core, conn: &mut Conn) -> Result<(), Error> {
        if self.items.is_empty() {
            return Ok(());
        }
        let ids: Vec<u64> = if self.items.len() == 1 || conn.small.publish_many != Some(true) {
            let publish = |item: &PublishItem<'a>| Request::Publish {
                lend: self.lend,
                offset: item.offset,
                name: item.name.clone(),
                flags: item.flags,
                version: item.version,
                metadata: item.metadata.clone(),
                size: item.size,
            };
            let mut ids = Vec::with_capacity(self.items.len());
            for item in &self.items {
                // (The first frame takes along the releases due, as a pipelined request does.)
                ids.push(if ids.is_empty() {
                    core.frame_pipelined(&mut conn.wire, &publish(item))
                } else {
                    conn.wire.push(&publish(item), 0)
                });
            }
            ids
        } else {
            let req = Request::PublishMany {
                lend: self.lend,
                items: self.items.clone(),
            };
            vec![core.frame_pipelined(&mut conn.wire, &req)]
        };
        io::write_all(conn.stream.as_fd(), &conn.wire.out)?;
        self.items.clear();
        let objects = std::mem::take(&mut self.owed);
        if ids.len() == 1 {
            conn.wire.unread.push_back(Unread {
                id: ids[0],
                kind: UnreadKind::Put,
                objects,
            });
        } else {
            for (id, object) in ids.into_iter().zip(objects) {
                conn.wire.unread.push_back(Unread {
                    id,
                    kind: UnreadKind::Put,
                    objects: vec![object],
                });
            }
        }
        Ok(())
    }
}

impl ClientInner {
    /// See [`super::Client::put_view_later`]; several at once: one lock, one write (a new
    /// small lend or the cap on owed replies may split it). Answers per put: `None` when not
    /// this way (too big for the small lend, opted out of pipelining, no hold table, a store
    /// that lends nothing, the lend pinned by a failed put's view, this client's own
    /// unanswered put of the name, a broken connection that a waiting call may reconnect).
    pub(super) fn put_views_later(self: &Arc<Self>, puts: &[KeptPut<'_>]) -> Vec<KeptAnswer> {
        let none = || puts.iter().map(|_| None).collect();
        if !self.pipelined_puts {
            return none();
        }
        let mut conn = match self.lock() {
            Ok(c) => c,
            Err(e) => return puts.iter().map(|_| Some(Err(e.clone()))).collect(),
        };
        if conn.small.refused {
            return none();
        }
        // The mappings and generation of the connection this lock guards (a reconnect
        // replaces them under it).
        let (maps, generation) = self.core.current.now();
        if !maps.shared.as_ref().is_some_and(|s| s.can_announce()) {
            return none();
        }
        // (Which puts go into the small lend; the others are not this batch's.)
        let paths = crate::core::put_paths(0, maps.max_inline, true, true, || None);
        let mut flight = Flight::default();
        let mut answers: Vec<KeptAnswer> = Vec::with_capacity(puts.len());
        let mut broken = None;
        for put in puts {
            if let Some(e) = &broken {
                answers.push(self.after_broken(e));
                continue;
            }
            let answer = self.put_one_later(&mut conn, &mut flight, put, &paths, &maps, generation);
            let answer = match answer {
                Ok(view) => view.map(Ok),
                Err(e @ Error::Connection(_)) => {
                    // A flush that failed left its puts in the flight: not sent either.
                    self.not_sent(&mut answers, &mut flight, &e);
                    let answer = self.after_broken(&e);
                    broken = Some(e);
                    answer
                }
                Err(e) => Some(Err(e)),
            };
            answers.push(answer);
        }
        if broken.is_none() {
            if let Err(e) = flight.flush(&self.core, &mut conn) {
                self.not_sent(&mut answers, &mut flight, &e);
            }
        }
        answers
    }

    /// The puts left in `flight` did not go out: their answers (the last ones with a view)
    /// become the broken connection's (their views are not the store's).
    fn not_sent(&self, answers: &mut [KeptAnswer], flight: &mut Flight<'_>, e: &Error) {
        let viewed = answers
            .iter_mut()
            .rev()
            .filter(|a| matches!(a, Some(Ok(_))));
        for a in viewed.take(flight.owed.len()) {
            *a = self.after_broken(e);
        }
        flight.items.clear();
        flight.owed.clear();
    }

    /// The answer for a put the connection broke under: the waiting way reconnects when it
    /// may, else the error.
    fn after_broken(&self, e: &Error) -> KeptAnswer {
        (!self.core.reconnect).then(|| Err(e.clone()))
    }

    /// One put of [`ClientInner::put_views_later`]: its frame added to `flight`.
    fn put_one_later<'a>(
        self: &Arc<Self>,
        conn: &mut Conn,
        flight: &mut Flight<'a>,
        &(name, data, metadata, options): &KeptPut<'a>,
        paths: &vovp_types::PutPaths,
        maps: &Arc<crate::mapping::Mappings>,
        generation: u64,
    ) -> Result<Option<PipelinedView>, Error> {
        let options = options.with(true, true);
        let route = put::route(data.len(), metadata.len(), &options, paths);
        let (Ok(Route::SmallLend), Some(need)) = (route, block_len(data.len(), metadata.len()))
        else {
            return Ok(None);
        };
        let Some(shared) = maps.shared.as_ref() else {
            return Ok(None);
        };
        // Refused here, now, as a waiting put's would be.
        crate::core::check_put(name, metadata)?;
        // Replies owed stay few: read those that came, and wait for them past the cap. A
        // batch goes out every few puts, so the store works on them while this thread
        // prepares the next (one write per batch would leave it idle until the cap, and
        // then this thread idle waiting for it).
        if conn.owed_objects() + flight.owed.len() >= MAX_UNREAD {
            flight.flush(&self.core, conn)?;
            while conn.owed_objects() + FLIGHT_PUTS > MAX_UNREAD {
                conn.read_unread()?;
            }
        } else if flight.owed.len() >= FLIGHT_PUTS {
            flight.flush(&self.core, conn)?;
            conn.drain_arrived()?;
        } else if flight.owed.is_empty() {
            conn.drain_arrived()?;
        }
        let framed = flight.owed.iter().map(|o| o.name.as_str());
        if !conn.may_pipeline(shared, name, &options, framed)? {
            return Ok(None);
        }
        let range = match conn.small.current.as_mut().and_then(|c| c.take(need)) {
            Some(r) => r,
            None => {
                // A new small lend: what the batch holds goes out first (LEND reads every
                // owed reply before it).
                flight.flush(&self.core, conn)?;
                match self.new_small_range(conn, need, maps)? {
                    Some(r) => r,
                    None => return Ok(None),
                }
            }
        };
        // Counted before it goes out: another client told the name is missing waits for it
        // (vovp-shm's `sent`).
        if !shared.count_sent_put() {
            return Ok(None);
        }
        // SAFETY: this put's range of the small lend (`need` >= data.len() bytes), mapped
        // writable and kept mapped by `range.segment`; nothing else writes it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), range.ptr, data.len()) };
        let pending = Pending::new(
            range.ptr,
            data.len() as u64,
            Location::Host {
                segment: range.segment_id,
                offset: range.offset,
            },
            range.segment,
            self.sink_maker(generation),
            Some(range.pinned),
        );
        let item = PublishItem {
            offset: range.offset,
            name: name.into(),
            flags: vovp_proto::put_flags(&options),
            version: options.version,
            metadata: metadata.into(),
            size: data.len() as u64,
        };
        let owed = OwedObject {
            name: name.to_owned(),
            pending: Some(pending.clone()),
            writing: None,
        };
        flight.add(range.lend, item, owed);
        let reader: Arc<dyn ReplyReader> = self.clone();
        Ok(Some(PipelinedView::new(pending, reader)))
    }

    /// Where a pipelined put's view sends its reference back, made when its reply is read:
    /// weakly, since the slot sits in this client's queue of owed replies (the view holds the
    /// client strongly, as every view does).
    pub(super) fn sink_maker(self: &Arc<Self>, generation: u64) -> SinkMaker {
        let client = Arc::downgrade(self);
        Box::new(move || {
            let inner = client.upgrade()?;
            Some(Arc::new(ViewSink { inner, generation }) as Arc<dyn vovp_types::ObjectSink>)
        })
    }

    /// `need` bytes of a new small lend (SMALL LEND), the current one being full; `None`:
    /// not now (see [`ClientInner::put_views_later`]).
    fn new_small_range(
        &self,
        conn: &mut Conn,
        need: u64,
        maps: &crate::mapping::Mappings,
    ) -> Result<Option<Range>, Error> {
        if conn.small.retry_after.is_some_and(|t| Instant::now() < t) {
            return Ok(None);
        }
        // Every owed reply read first: a PUBLISH into the old lend that failed pins it.
        conn.drain_unread()?;
        let pinned = |c: &SmallLend| c.pinned.load(Ordering::Acquire) > 0;
        if conn.small.current.as_ref().is_some_and(pinned) {
            return Ok(None);
        }
        let asked = Request::Lend {
            at_least: need,
            flags: LEND_SMALL,
        };
        let lend = match conn.exchange(&self.core, &asked).and_then(|r| r.lent()) {
            Ok(lend) => lend,
            Err(e @ Error::Connection(_)) => return Err(e),
            Err(e) => {
                // The store's answer that it lends nothing (MALFORMED, or a daemon without
                // small lends): for good. Anything else (memory): maybe later.
                let refusal = match &e {
                    Error::Protocol(m) => {
                        m.starts_with("MALFORMED") || m.starts_with("UNKNOWN_OPCODE")
                    }
                    Error::Config(_) | Error::TooLarge(_) => true,
                    _ => false,
                };
                if refusal {
                    conn.small.refused = true;
                } else {
                    tracing::debug!("vovp: no small lend ({e}); putting the waiting way");
                    conn.small.retry_after = Some(Instant::now() + SMALL_LEND_RETRY);
                }
                conn.small.current = None;
                return Ok(None);
            }
        };
        let segment = match maps.segment(lend.segment) {
            Some(s) => s,
            None => {
                let s = Arc::new(conn.map_segment(&self.core, lend.segment)?);
                maps.insert_segment(lend.segment, s.clone());
                s
            }
        };
        crate::lent::check(&lend, &segment)?;
        if conn.small.publish_many.is_none() {
            // Whether batches may go out as PUBLISH_MANY: an empty one is answered with no
            // results by a store that knows it, UNKNOWN_OPCODE by one older (asked once per
            // connection, not learnt from a batch's refusal, which would lose its puts).
            let probe = Request::PublishMany {
                lend: lend.id,
                items: Vec::new(),
            };
            conn.small.publish_many = match conn.exchange(&self.core, &probe) {
                Ok(_) => Some(true),
                Err(e @ Error::Connection(_)) => return Err(e),
                Err(_) => Some(false),
            };
        }
        // A lend handed back again (nothing from it alive) is used from its start.
        conn.small.retry_after = None;
        let current = conn.small.current.insert(SmallLend {
            cursor: lend.offset,
            lend,
            segment,
            pinned: Arc::new(AtomicUsize::new(0)),
        });
        Ok(current.take(need))
    }
}
