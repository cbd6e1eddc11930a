//! Arbitrary sequences of store operations from several sessions against one embedded engine
//! with a small store (1 MiB, 4 objects), so eviction, out-of-memory and the object limit are
//! reached often. Checks: nothing panics, every failure is a store error a caller can act on
//! (never Internal/ShuttingDown/Protocol...), results match what was asked, object bytes never
//! change after seal (catches overlapping allocations), the table's own invariants hold after
//! every operation, and once every view, buffer and session is dropped and every object
//! deleted, the store is back to zero: no references, holders, unsealed objects or used bytes.
use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use arbitrary::{Arbitrary, Unstructured};
use vovp::{
    Config, CreateOptions, Device, Engine, EngineHandle, Error, ObjectBuffer, ObjectView, Store,
    MAX_METADATA_LEN, MAX_NAME_LEN,
};

const CAPACITY: u64 = 1 << 20;
const MAX_OBJECTS: u32 = 4;
const SESSIONS: usize = 3;
/// Valid names n0..n5 (more than MAX_OBJECTS, so the object limit is reached); one draw in 16 is
/// an invalid name (empty, too long).
const NAMES: u8 = 6;
/// Bounds on one input, so an iteration stays in the milliseconds.
const MAX_OPS: usize = 128;
const MAX_HELD: usize = 32;

/// One engine for the whole process (starting one per input would dominate the run time); each
/// input leaves it empty again, which is itself checked.
fn engine() -> &'static EngineHandle {
    static ENGINE: OnceLock<EngineHandle> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let mut config = Config::with_capacity(CAPACITY);
        config.max_objects = MAX_OBJECTS;
        Engine::spawn(config).expect("engine starts")
    })
}

#[derive(Arbitrary, Debug, Clone, Copy)]
struct Name(u8);

impl Name {
    fn text(self) -> String {
        match self.0 % 32 {
            30 => String::new(),
            31 => "x".repeat(MAX_NAME_LEN + 1),
            n => format!("n{}", n % NAMES),
        }
    }
    fn valid(self) -> bool {
        self.0 % 32 < 30
    }
}

/// A size: mostly small, sometimes near or over the capacity, sometimes absurd (u64 range).
#[derive(Arbitrary, Debug, Clone, Copy)]
struct Size(u64);

impl Size {
    fn bytes(self) -> u64 {
        let v = self.0 >> 2;
        match self.0 & 3 {
            0 => v % 512,
            1 => v % (64 << 10),
            2 => v % (CAPACITY + CAPACITY / 2),
            _ => self.0,
        }
    }
}

/// Metadata length: none, small, the limit, one over.
#[derive(Arbitrary, Debug, Clone, Copy)]
struct Meta(u8);

impl Meta {
    /// `[1, fill, ...]` marks an object whose every data byte is `fill` (checked on every view);
    /// `[0, ...]` one whose bytes are unknown (created and sealed without writing).
    fn bytes(self, fill: Option<u8>) -> Vec<u8> {
        let len = match self.0 & 3 {
            0 => 0,
            1 => (self.0 >> 2) as usize,
            2 => MAX_METADATA_LEN,
            _ => MAX_METADATA_LEN + 1,
        };
        let mut m = vec![0u8; len];
        if len >= 2 {
            if let Some(f) = fill {
                m[0] = 1;
                m[1] = f;
            }
        }
        m
    }
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Wait {
    Now,
    Zero,
    OneMs,
}

impl Wait {
    fn timeout(self) -> Option<Duration> {
        match self {
            Wait::Now => None,
            Wait::Zero => Some(Duration::ZERO),
            Wait::OneMs => Some(Duration::from_millis(1)),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    /// Create; `fill: Some` writes every byte at once, `None` leaves the buffer unwritten.
    Create {
        session: u8,
        name: Name,
        size: Size,
        meta: Meta,
        ephemeral: bool,
        fill: Option<u8>,
        /// A replacement of the name when it is sealed (its next version at the seal).
        replace: bool,
    },
    /// Seal a held buffer through the buffer (keeps its reference as a view).
    SealBuffer {
        buffer: u8,
    },
    /// Drop a held buffer (aborts it if unsealed).
    DropBuffer {
        buffer: u8,
    },
    Seal {
        session: u8,
        name: Name,
    },
    Abort {
        session: u8,
        name: Name,
    },
    Put {
        session: u8,
        name: Name,
        len: Size,
        meta: Meta,
        ephemeral: bool,
        fill: u8,
        replace: bool,
    },
    Get {
        session: u8,
        names: Vec<Name>,
        wait: Wait,
    },
    /// Drop a held view (its release).
    DropView {
        view: u8,
    },
    Contains {
        session: u8,
        name: Name,
    },
    Delete {
        session: u8,
        name: Name,
    },
    List {
        session: u8,
    },
    Evict {
        session: u8,
        bytes: Size,
    },
    Stats {
        session: u8,
    },
    /// Replace a session (the old one's references go when its views do).
    NewSession {
        slot: u8,
    },
    DropSession {
        slot: u8,
    },
    /// Write a held buffer again, as a creator writing in pieces does: with its fill byte when
    /// its metadata has one, else with `fill`.
    Write {
        buffer: u8,
        fill: u8,
    },
    /// A GET waiting for a held buffer's name while the buffer is sealed: it must wake up with
    /// the object.
    GetWhileSealing {
        session: u8,
        buffer: u8,
    },
    /// A get of a version above `newer_than` (0: any).
    GetNewer {
        session: u8,
        name: Name,
        newer_than: u8,
        wait: Wait,
    },
}

struct Held {
    /// With the fill byte its metadata promises, if any.
    buffers: Vec<(ObjectBuffer, Option<u8>)>,
    views: Vec<ObjectView>,
    sessions: Vec<Option<EngineHandle>>,
}

impl Held {
    fn session(&mut self, i: u8) -> EngineHandle {
        self.sessions[i as usize % SESSIONS]
            .get_or_insert_with(|| engine().session())
            .clone()
    }
    fn keep_view(&mut self, v: ObjectView) {
        check_view(&v);
        if self.views.len() >= MAX_HELD {
            check_view(&self.views.remove(0));
        }
        self.views.push(v);
    }
}

/// Errors a caller of this API can get from these operations; anything else is a bug.
fn check_error(e: &Error) {
    assert!(
        matches!(
            e,
            Error::NotFound(_)
                | Error::AlreadyExists(_)
                | Error::OutOfMemory { .. }
                | Error::TooManyObjects { .. }
                | Error::NotSealed(_)
                | Error::AlreadySealed(_)
                | Error::NotCreator(_)
                | Error::InvalidName(_)
                | Error::MetadataTooLarge { .. }
                | Error::TooLarge(_)
        ),
        "unexpected error: {e:?}"
    );
}

/// Every failure is checked; successes are handed back.
fn ok<T>(r: Result<T, Error>) -> Option<T> {
    r.map_err(|e| {
        check_error(&e);
        note(&e);
    })
    .ok()
}

/// With `VOVP_FUZZ_REPORT` set, how often each error came up is printed every 10000 inputs, to
/// see that the fuzzer reaches eviction, out-of-memory and the object limit at all.
fn reporting() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("VOVP_FUZZ_REPORT").is_some())
}

static OUTCOMES: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());

fn note(e: &Error) {
    if reporting() {
        let what = format!("{e:?}");
        let what = what
            .split(['(', ' '])
            .next()
            .unwrap_or_default()
            .to_string();
        *OUTCOMES.lock().unwrap().entry(what).or_default() += 1;
    }
}

fn report(inputs: u64) {
    if reporting() && inputs.is_multiple_of(10_000) {
        let s = engine().stats().expect("stats");
        eprintln!(
            "{inputs} inputs: errors {:?}; creates {}, evicted {}",
            OUTCOMES.lock().unwrap(),
            s.creates,
            s.evicted_objects
        );
    }
}

/// A name that is not valid is refused with InvalidName, before anything else.
fn options(ephemeral: bool, replace: bool) -> CreateOptions {
    CreateOptions {
        ephemeral,
        replace,
        ..Default::default()
    }
}

/// `op` on `name`'s text, its outcome checked as a named operation's (`check_named`, `ok`).
fn by_name<T>(name: Name, op: impl FnOnce(&str) -> Result<T, Error>) -> Option<T> {
    let r = op(&name.text());
    check_named(name, &r);
    ok(r)
}

fn check_named<T>(name: Name, r: &Result<T, Error>) {
    if !name.valid() {
        assert!(
            matches!(r, Err(Error::InvalidName(_))),
            "invalid name accepted"
        );
    }
}

/// A sealed object's bytes are what was written before its seal.
fn check_view(v: &ObjectView) {
    assert_eq!(v.device(), Device::Cpu);
    assert!(v.size() <= CAPACITY);
    assert_eq!(v.bytes().len() as u64, v.size());
    if let [1, fill, ..] = *v.metadata() {
        if let Some(i) = v.bytes().iter().position(|&b| b != fill) {
            panic!("{:?}: byte {i} changed after seal (want {fill})", v);
        }
    }
}

fn check_invariants() {
    futures_executor::block_on(engine().check_invariants())
        .unwrap_or_else(|e| panic!("table invariants: {e}"));
}

fn apply(op: Op, held: &mut Held) {
    match op {
        Op::Create {
            session,
            name,
            size,
            meta,
            ephemeral,
            fill,
            replace,
        } => {
            let (size, metadata) = (size.bytes(), meta.bytes(fill));
            let options = options(ephemeral, replace);
            let created = by_name(name, |n| {
                held.session(session).create(n, size, &metadata, options)
            });
            if let Some(mut buf) = created {
                assert!(size <= CAPACITY && metadata.len() <= MAX_METADATA_LEN);
                assert_eq!((buf.size(), buf.name().as_str()), (size, &*name.text()));
                assert_eq!(buf.as_mut_slice().len() as u64, size);
                if let Some(f) = fill {
                    buf.as_mut_slice().fill(f);
                }
                if held.buffers.len() >= MAX_HELD {
                    held.buffers.remove(0);
                }
                let marked = matches!(metadata[..], [1, ..]);
                held.buffers.push((buf, fill.filter(|_| marked)));
            }
        }
        Op::SealBuffer { buffer } => {
            if !held.buffers.is_empty() {
                let i = buffer as usize % held.buffers.len();
                if let Some(v) = ok(held.buffers.swap_remove(i).0.seal()) {
                    held.keep_view(v);
                }
            }
        }
        Op::DropBuffer { buffer } => {
            if !held.buffers.is_empty() {
                let i = buffer as usize % held.buffers.len();
                held.buffers.swap_remove(i);
            }
        }
        Op::Seal { session, name } => {
            by_name(name, |n| held.session(session).seal(n));
        }
        Op::Abort { session, name } => {
            by_name(name, |n| held.session(session).abort(n));
        }
        Op::Put {
            session,
            name,
            len,
            meta,
            ephemeral,
            fill,
            replace,
        } => {
            let len = len.bytes().min(2 * CAPACITY) as usize;
            let (data, metadata) = (vec![fill; len], meta.bytes(Some(fill)));
            let options = options(ephemeral, replace);
            if by_name(name, |n| {
                held.session(session).put(n, &data, &metadata, options)
            })
            .is_some()
            {
                assert!(len as u64 <= CAPACITY && metadata.len() <= MAX_METADATA_LEN);
            }
        }
        Op::Get {
            session,
            names,
            wait,
        } => {
            let texts: Vec<String> = names.iter().take(8).map(|n| n.text()).collect();
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            let r = held.session(session).get(&refs, wait.timeout());
            if names.iter().take(8).any(|n| !n.valid()) {
                assert!(matches!(r, Err(Error::InvalidName(_))), "invalid name got");
            }
            if let Some(views) = ok(r) {
                assert_eq!(views.len(), refs.len());
                for (v, n) in views.into_iter().zip(&refs) {
                    if let Some(v) = v {
                        assert_eq!(v.name().as_str(), *n);
                        held.keep_view(v);
                    }
                }
            }
        }
        Op::GetNewer {
            session,
            name,
            newer_than,
            wait,
        } => {
            let newer_than = u64::from(newer_than);
            let r = held
                .session(session)
                .get_newer(&name.text(), newer_than, wait.timeout());
            if !name.valid() {
                assert!(matches!(r, Err(Error::InvalidName(_))), "invalid name got");
            }
            if let Some(v) = ok(r) {
                assert!(v.version() > newer_than, "{} <= {newer_than}", v.version());
                assert_eq!(v.name().as_str(), name.text());
                held.keep_view(v);
            }
        }
        Op::DropView { view } => {
            if !held.views.is_empty() {
                let i = view as usize % held.views.len();
                check_view(&held.views.swap_remove(i));
            }
        }
        Op::Contains { session, name } => {
            by_name(name, |n| held.session(session).contains(n));
        }
        Op::Delete { session, name } => {
            by_name(name, |n| held.session(session).delete(n));
        }
        Op::List { session } => {
            if let Some(list) = ok(held.session(session).list()) {
                assert!(list.len() <= MAX_OBJECTS as usize);
                let bytes: u64 = list.iter().map(|i| i.size).sum();
                assert!(bytes <= CAPACITY, "listed {bytes} bytes");
            }
        }
        Op::Evict { session, bytes } => {
            ok(held.session(session).evict(bytes.bytes()));
        }
        Op::Stats { session } => {
            if let Some(s) = ok(held.session(session).stats()) {
                assert_eq!(s.capacity, CAPACITY);
                assert!(s.used_bytes <= CAPACITY);
                assert_eq!(s.objects, s.sealed + s.unsealed, "{s:?}");
                assert!(s.objects + s.pending_delete <= MAX_OBJECTS as u64, "{s:?}");
            }
        }
        Op::NewSession { slot } => {
            held.sessions[slot as usize % SESSIONS] = Some(engine().session());
        }
        Op::DropSession { slot } => {
            held.sessions[slot as usize % SESSIONS] = None;
        }
        Op::Write { buffer, fill } => {
            if !held.buffers.is_empty() {
                let i = buffer as usize % held.buffers.len();
                let (b, marked) = &mut held.buffers[i];
                b.as_mut_slice().fill(marked.unwrap_or(fill));
            }
        }
        Op::GetWhileSealing { session, buffer } => {
            if !held.buffers.is_empty() {
                let i = buffer as usize % held.buffers.len();
                let (buf, _) = held.buffers.swap_remove(i);
                let name = buf.name().as_str().to_owned();
                let s = held.session(session);
                let names = [name.as_str()];
                // Polled once, the GET is in the table's mailbox before the seal (or, if not,
                // it finds the object sealed): either way it answers with the object as soon as
                // the seal lands. The timeout is long only so that a loaded machine cannot fire
                // it first (the seal is sent from this thread right after the poll).
                let mut get = std::pin::pin!(vovp::AsyncStore::get(
                    &s,
                    &names,
                    Some(Duration::from_secs(10))
                ));
                let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                let polled = std::future::Future::poll(get.as_mut(), &mut cx);
                let Some(sealed) = ok(buf.seal()) else {
                    // Nothing to wait for: abandon the GET (its waiter stays in the table until
                    // the timeout or the session goes, and must not leak what it then gets).
                    return;
                };
                let got = match polled {
                    std::task::Poll::Ready(r) => r,
                    std::task::Poll::Pending => futures_executor::block_on(get),
                };
                let got = ok(got).expect("GET of a valid name");
                assert_eq!(got.len(), 1);
                let got = got.into_iter().next().unwrap();
                let v = got.unwrap_or_else(|| panic!("{name}: sealed during a GET, not got"));
                // The GET got the object, or, when the buffer was a replacement of a sealed
                // name, the version the name had before its seal (a get that started first).
                assert!(
                    v.id() == sealed.id() || v.version() < sealed.version(),
                    "{name}: got version {} ({:?}), sealed version {} ({:?})",
                    v.version(),
                    v.id(),
                    sealed.version(),
                    sealed.id()
                );
                held.keep_view(v);
                held.keep_view(sealed);
            }
        }
    }
}

/// Drops everything the input holds, deletes every object, and waits (briefly) for the store to
/// be empty: releases travel as one-way messages, so they may land just after.
fn clean_up(held: Held) {
    let Held {
        buffers,
        views,
        sessions,
    } = held;
    drop(buffers);
    for v in &views {
        check_view(v);
    }
    drop(views);
    drop(sessions);
    let e = engine();
    for info in e.list().expect("list") {
        match e.delete(info.name.as_str()) {
            Ok(()) | Err(Error::NotFound(_)) => {}
            Err(other) => panic!("cleaning up {:?}: {other:?}", info.name),
        }
    }
    let start = Instant::now();
    loop {
        let s = e.stats().expect("stats");
        let empty = s.objects == 0
            && s.unsealed == 0
            && s.pending_delete == 0
            && s.references == 0
            && s.holders == 0
            && s.used_bytes == 0;
        if empty {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "store not empty after everything was dropped and deleted: {s:?}"
        );
        std::thread::sleep(Duration::from_micros(100));
    }
    check_invariants();
}

/// The input: up to [`MAX_OPS`] operations, as many as the bytes make (`cargo fuzz fmt` prints
/// them).
#[derive(Debug)]
struct Ops(Vec<Op>);

impl<'a> Arbitrary<'a> for Ops {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let mut ops = Vec::new();
        while !u.is_empty() && ops.len() < MAX_OPS {
            match Op::arbitrary(u) {
                Ok(op) => ops.push(op),
                Err(_) => break,
            }
        }
        Ok(Ops(ops))
    }
}

/// The target's body: the input decoded as libFuzzer's typed targets decode it (`arbitrary`,
/// taking the rest), then run; panics on a finding.
pub fn run(data: &[u8]) {
    let Ok(ops) = Ops::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    let mut held = Held {
        buffers: Vec::new(),
        views: Vec::new(),
        sessions: (0..SESSIONS).map(|_| None).collect(),
    };
    for op in ops.0 {
        apply(op, &mut held);
        check_invariants();
    }
    clean_up(held);
    static INPUTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    report(INPUTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1);
}
