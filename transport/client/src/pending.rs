//! The store's copy of a put, handed back before the store answered: a [`PipelinedView`].
//! Its bytes are in this client's small lend (a small put) or its lend (one of 64 KiB up to
//! the lend's largest object), written before the PUBLISH went out, so they are whole when
//! the caller sees them; its object id and version come with the PUBLISH's reply, which the
//! connection reads later (the next call that waits, [`crate::Client::sync`], a full queue of
//! owed replies, or [`PipelinedView::wait`]).
//!
//! The reply is matched to its view through a [`Pending`] slot shared by the view and the
//! connection's queue of owed replies. Either side may go first: a view dropped before the
//! reply leaves the slot *abandoned*, and the reader releases the reference the reply
//! granted; a reply read first leaves the view (an [`ObjectView`]) in the slot for the caller.
//!
//! A PUBLISH that fails leaves its range in no object. The caller's bytes stay readable
//! there, so the lend must outlive them, as long as the view lives:
//! * a small lend: the view counts itself in its lend's `pinned`, and the client takes no new
//!   small lend (which would retire this one and let the store free it) while any is counted;
//! * the lend: the put's announced write (`Reserved`, which the owed reply carried) stays
//!   with the view, so the client asks for no new lend and the store takes none back
//!   (`vovp_shm::lend`) until the view is gone.

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use vovp_types::{Error, Location, ObjectRef, ObjectSink, ObjectView};

use crate::lent::Reserved;
use crate::mapping::MappedSegment;

/// Makes the sink of a resolved view (see [`Pending`]'s `sink`).
pub(crate) type SinkMaker = Box<dyn Fn() -> Option<Arc<dyn ObjectSink>> + Send + Sync>;

enum State {
    /// No reply yet; `abandoned`: the view was dropped meanwhile.
    Waiting { abandoned: bool },
    /// The reply: the object's view (holding the reference the PUBLISH kept).
    Stored(ObjectView),
    /// Why the store refused the put (or its reply was lost); `_writing`: a put through the
    /// lend keeps its announced write into it while the view lives (see the module doc).
    Failed {
        error: Error,
        _writing: Option<Reserved>,
    },
    /// The view was taken out by [`PipelinedView::take_view`].
    Taken,
}

/// Where a pipelined put's bytes are, and its reply once read.
pub(crate) struct Pending {
    state: Mutex<State>,
    ptr: *mut u8,
    size: u64,
    location: Location,
    /// Keeps the lend's mapping while the view lives.
    segment: Arc<MappedSegment>,
    /// Where the granted reference goes back, made when the reply is read: the slot sits in
    /// its client's queue of owed replies, so it must not hold the client (a cycle that would
    /// keep a dropped client's connection open). `None`: the client is gone (and with its
    /// connection every reference it held).
    sink: SinkMaker,
    /// A small lend's count of failed puts' views still alive (see the module doc).
    pinned: Option<Arc<AtomicUsize>>,
}

// SAFETY: `ptr` points into a shared mapping that `segment` keeps alive; the range is this
// put's alone (the lend hands each range out once), and nothing writes it after the put.
unsafe impl Send for Pending {}
unsafe impl Sync for Pending {}

impl Pending {
    pub(crate) fn new(
        ptr: *mut u8,
        size: u64,
        location: Location,
        segment: Arc<MappedSegment>,
        sink: SinkMaker,
        pinned: Option<Arc<AtomicUsize>>,
    ) -> Arc<Self> {
        Arc::new(Pending {
            state: Mutex::new(State::Waiting { abandoned: false }),
            ptr,
            size,
            location,
            segment,
            sink,
            pinned,
        })
    }

    /// The reader's side: the PUBLISH's answer (`Ok`: the object it made), and the put's
    /// announced write into the lend if it went through one (withdrawn here, or kept by a
    /// failed put's view).
    pub(crate) fn resolve(&self, answer: Result<ObjectRef, Error>, writing: Option<Reserved>) {
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        let State::Waiting { abandoned } = *state else {
            return;
        };
        let view = answer.and_then(|r| {
            let sink = (self.sink)()
                .ok_or_else(|| Error::Connection("the client that made this put is gone".into()))?;
            if r.location != self.location || r.size != self.size {
                sink.release(r.id);
                return Err(Error::Protocol(format!(
                    "PUBLISH of {} answered with an object elsewhere ({:?}, {} bytes)",
                    r.name, r.location, r.size
                )));
            }
            let owner: Arc<dyn Any + Send + Sync> = self.segment.clone();
            // SAFETY: the object's bytes are the range this put wrote (checked just above),
            // inside the mapping `owner` keeps; sealed, so never written again.
            Ok(unsafe { ObjectView::from_raw(r, self.ptr, owner, sink) })
        });
        if abandoned {
            // Nobody views it: a granted reference goes back (the view's drop), a failure
            // leaves nothing behind.
            drop(view);
            *state = State::Taken;
            return;
        }
        *state = match view {
            Ok(view) => State::Stored(view),
            Err(e) => {
                if let Some(pinned) = &self.pinned {
                    pinned.fetch_add(1, Ordering::AcqRel);
                }
                State::Failed {
                    error: e,
                    _writing: writing,
                }
            }
        };
    }

    /// Whether the view was dropped before the reply was read (the reference the reply
    /// grants is to be released when it is read).
    pub(crate) fn is_abandoned(&self) -> bool {
        self.state
            .lock()
            .map(|s| matches!(*s, State::Waiting { abandoned: true }))
            .unwrap_or(false)
    }

    /// Whether the reply was read (either way).
    pub(crate) fn is_answered(&self) -> bool {
        self.state
            .lock()
            .map(|s| !matches!(*s, State::Waiting { .. }))
            .unwrap_or(true)
    }

    /// The answer, once read: `None` while waiting.
    fn answer(&self) -> Option<Result<(), Error>> {
        let state = self.state.lock().ok()?;
        match &*state {
            State::Waiting { .. } => None,
            State::Stored(_) | State::Taken => Some(Ok(())),
            State::Failed { error, .. } => Some(Err(error.clone())),
        }
    }

    /// The view is gone; `true` when its reply is still to be read (the caller makes sure
    /// someone reads it: the reference it grants is released then).
    fn abandon(&self) -> bool {
        let Ok(mut state) = self.state.lock() else {
            return false;
        };
        match std::mem::replace(&mut *state, State::Taken) {
            State::Waiting { .. } => {
                *state = State::Waiting { abandoned: true };
                return true;
            }
            // (A lend put's announced write is withdrawn with it.)
            State::Failed { .. } => {
                if let Some(pinned) = &self.pinned {
                    pinned.fetch_sub(1, Ordering::AcqRel);
                }
            }
            // (A view's drop releases its reference.)
            State::Stored(_) | State::Taken => {}
        }
        false
    }
}

/// What waits for a pipelined put's reply on behalf of a [`PipelinedView`]: the client's
/// connection, which reads owed replies in order.
pub(crate) trait ReplyReader: Send + Sync {
    /// Reads owed replies until `pending` is answered (an error: the connection's, or it
    /// holds no such request any more).
    fn read_until_answered(&self, pending: &Arc<Pending>) -> Result<(), Error>;

    /// A view was dropped before its reply was read: have the reply read soon (without
    /// blocking the caller), so that the reference it grants goes back even if the client
    /// makes no other call.
    fn abandoned(&self);
}

/// The store's copy of a put, returned before the store answered (see
/// [`crate::Client::put_view_later`]). Its bytes are readable at once; [`PipelinedView::wait`]
/// gives the put's outcome, after which [`PipelinedView::take_view`] gives the
/// [`ObjectView`] (object id, version, the reference). Dropped before the reply, the reference
/// the reply grants is released when the reply is read.
pub struct PipelinedView {
    pending: Arc<Pending>,
    reader: Arc<dyn ReplyReader>,
}

impl std::fmt::Debug for PipelinedView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelinedView")
            .field("size", &self.pending.size)
            .field("location", &self.pending.location)
            .field("answered", &self.pending.is_answered())
            .finish()
    }
}

impl PipelinedView {
    pub(crate) fn new(pending: Arc<Pending>, reader: Arc<dyn ReplyReader>) -> Self {
        PipelinedView { pending, reader }
    }

    /// The object's bytes (in this client's own arena).
    pub fn as_ptr(&self) -> *const u8 {
        self.pending.ptr
    }

    pub fn size(&self) -> u64 {
        self.pending.size
    }

    pub fn location(&self) -> Location {
        self.pending.location
    }

    /// Whether [`PipelinedView::private_view`] answers without mapping the segment again (as
    /// `Client::private_view_ready`).
    pub fn private_view_ready(&self) -> bool {
        self.pending.segment.private_ready(self.pending.size)
    }

    /// A writable address of the bytes, private to this process, and what keeps it: for
    /// callers that hand out writable views (torch tensors), as `Client::private_view`.
    pub fn private_view(&self) -> Result<vovp_types::Mapped, Error> {
        let Location::Host { offset, .. } = self.pending.location else {
            return Err(Error::Internal("a pipelined put of a device object".into()));
        };
        self.pending.segment.private_view(offset, self.pending.size)
    }

    /// Waits for the put's reply: `Ok` once the object is stored, or the store's refusal (a
    /// name taken meanwhile, full memory; also reported by [`crate::Client::sync`]).
    pub fn wait(&self) -> Result<(), Error> {
        if let Some(answer) = self.pending.answer() {
            return answer;
        }
        self.reader.read_until_answered(&self.pending)?;
        self.pending.answer().unwrap_or_else(|| {
            Err(Error::Connection(
                "the reply to a pipelined put never came".into(),
            ))
        })
    }

    /// The object's view (id, version, the reference) once [`PipelinedView::wait`] said it is
    /// stored; `None` before, after a failure, or when taken already.
    pub fn take_view(&self) -> Option<ObjectView> {
        let mut state = self.pending.state.lock().ok()?;
        match std::mem::replace(&mut *state, State::Taken) {
            State::Stored(v) => Some(v),
            other => {
                *state = other;
                None
            }
        }
    }
}

impl Drop for PipelinedView {
    fn drop(&mut self) {
        if self.pending.abandon() {
            self.reader.abandoned();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{object, own_segment, Counted};

    /// A reader that counts what it is asked, resolving the slot with `answer` when asked to
    /// wait.
    #[derive(Default)]
    struct Reader {
        waits: AtomicUsize,
        abandoned: AtomicUsize,
        answer: Mutex<Option<Result<ObjectRef, Error>>>,
    }

    impl ReplyReader for Reader {
        fn read_until_answered(&self, pending: &Arc<Pending>) -> Result<(), Error> {
            self.waits.fetch_add(1, Ordering::SeqCst);
            match self.answer.lock().unwrap().take() {
                Some(answer) => {
                    pending.resolve(answer, None);
                    Ok(())
                }
                None => Err(Error::Connection("no such request".into())),
            }
        }

        fn abandoned(&self) {
            self.abandoned.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A put of 64 bytes at offset 128 of an arena (segment 1), its view, and what counts.
    fn put(
        pinned: Option<Arc<AtomicUsize>>,
    ) -> (Arc<Pending>, PipelinedView, Arc<Reader>, Arc<Counted>) {
        let segment = own_segment(4096);
        let sink = Arc::new(Counted::default());
        let maker = {
            let sink = sink.clone();
            Box::new(move || Some(sink.clone() as Arc<dyn ObjectSink>)) as SinkMaker
        };
        // SAFETY: offset 128 of a 4096-byte mapping kept by `segment`.
        let ptr = unsafe { segment.own_base().unwrap().add(128) };
        let location = Location::Host {
            segment: 1,
            offset: 128,
        };
        let pending = Pending::new(ptr, 64, location, segment, maker, pinned);
        let reader = Arc::new(Reader::default());
        let view = PipelinedView::new(pending.clone(), reader.clone());
        (pending, view, reader, sink)
    }

    fn stored() -> ObjectRef {
        object("x", 1, 128, 64)
    }

    #[test]
    fn a_reply_read_first_leaves_the_view_for_the_caller() {
        let (pending, view, reader, sink) = put(None);
        assert!(!pending.is_answered());
        pending.resolve(Ok(stored()), None);
        assert!(pending.is_answered());
        view.wait().unwrap();
        assert_eq!(reader.waits.load(Ordering::SeqCst), 0, "answered already");
        let taken = view.take_view().expect("the view");
        assert_eq!((taken.id(), taken.size()), (stored().id, 64));
        assert!(view.take_view().is_none(), "taken once");
        drop(view);
        assert!(sink.released().is_empty());
        drop(taken);
        assert_eq!(sink.released(), [stored().id.get()]);
        assert_eq!(reader.abandoned.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_view_dropped_before_its_reply_gives_back_the_reference_the_reply_grants() {
        let (pending, view, reader, sink) = put(None);
        drop(view);
        assert!(pending.is_abandoned());
        assert_eq!(reader.abandoned.load(Ordering::SeqCst), 1);
        pending.resolve(Ok(stored()), None);
        assert_eq!(sink.released(), [stored().id.get()]);
        assert!(!pending.is_abandoned());
    }

    #[test]
    fn waiting_reads_replies_until_this_one_is_answered() {
        let (_pending, view, reader, _sink) = put(None);
        *reader.answer.lock().unwrap() = Some(Ok(stored()));
        view.wait().unwrap();
        view.wait().unwrap();
        assert_eq!(reader.waits.load(Ordering::SeqCst), 1);
        // A connection that no longer owes the reply: its error.
        let (_pending, lost, _reader, _sink) = put(None);
        assert!(matches!(lost.wait(), Err(Error::Connection(_))));
    }

    #[test]
    fn an_answer_that_places_the_object_elsewhere_is_refused_and_its_reference_given_back() {
        let (pending, view, _reader, sink) = put(None);
        pending.resolve(Ok(object("x", 1, 0, 64)), None);
        assert!(matches!(view.wait(), Err(Error::Protocol(_))));
        assert_eq!(sink.released(), [object("x", 1, 0, 64).id.get()]);
        assert!(view.take_view().is_none());
    }

    #[test]
    fn a_failed_put_pins_its_small_lend_while_its_view_lives() {
        let pinned = Arc::new(AtomicUsize::new(0));
        let (pending, view, _reader, sink) = put(Some(pinned.clone()));
        pending.resolve(Err(Error::AlreadyExists("x".into())), None);
        assert_eq!(pinned.load(Ordering::SeqCst), 1);
        assert!(matches!(view.wait(), Err(Error::AlreadyExists(_))));
        // Its bytes stay readable meanwhile.
        // SAFETY: the put's 64 bytes, kept mapped by the view.
        let bytes = unsafe { std::slice::from_raw_parts(view.as_ptr(), 64) };
        assert_eq!(bytes, [0u8; 64]);
        drop(view);
        assert_eq!(pinned.load(Ordering::SeqCst), 0);
        assert!(sink.released().is_empty(), "no reference was granted");
    }

    #[test]
    fn a_reply_after_its_client_went_is_a_connection_error() {
        let segment = own_segment(4096);
        let location = Location::Host {
            segment: 1,
            offset: 0,
        };
        let ptr = segment.own_base().unwrap();
        let gone: SinkMaker = Box::new(|| None);
        let pending = Pending::new(ptr, 64, location, segment, gone, None);
        let view = PipelinedView::new(pending.clone(), Arc::new(Reader::default()));
        pending.resolve(Ok(object("x", 1, 0, 64)), None);
        assert!(matches!(view.wait(), Err(Error::Connection(_))));
    }

    #[test]
    fn a_small_puts_writable_view_is_private_to_this_process() {
        let (_pending, view, _reader, _sink) = put(None);
        assert_eq!((view.size(), view.location()), (64, stored().location));
        let mine = view.private_view().unwrap();
        assert_ne!(mine.ptr.cast_const(), view.as_ptr());
        // SAFETY: the private view's 64 bytes, kept by `mine`.
        unsafe { mine.ptr.write(9) };
        // SAFETY: the put's bytes, kept mapped by the view.
        assert_eq!(unsafe { view.as_ptr().read() }, 0);
        assert!(view.private_view_ready());
    }
}
