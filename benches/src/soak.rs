//! The soak: many client processes on one daemon for a bounded time, some of them SIGKILLed at
//! random, a fuzzer connection beside them, and at the end every surviving object checked byte
//! for byte and the daemon's counters, fds and memory back where they started.
//!
//! Workers are this binary re-executed (`vovp-bench --soak-worker key=value...`), using the Rust
//! client. Every object a worker writes says what it must hold: a header with the hash of its
//! name and a generation, metadata repeating both, and a body that is a pure function of
//! (name, generation). Any reader that ever sees bytes that do not match what the name promises
//! reports corruption, which fails the run. Counters live in a shared file that workers update
//! atomically, so a worker SIGKILLed mid-operation loses nothing already counted.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use vovp::{CreateOptions, Error, NotificationKind, ObjectView, Store};
use vovp_client::Client;
use vovp_proto::VERSION;

use crate::MIB;

mod harness;
mod spill_phase;

pub use harness::run;

/// First argument that turns `vovp-bench` into a soak worker.
pub const WORKER_FLAG: &str = "--soak-worker";

/// Exit status of a worker that read bytes that do not match their name.
const EXIT_CORRUPT: u8 = 3;
/// Exit status of a worker that got an error the soak does not expect (daemon gone, protocol).
const EXIT_ERROR: u8 = 4;

/// Inline puts go up to the Rust client's inline size, CREATE+SEAL above.
const INLINE_LIMIT: usize = vovp::CLIENT_INLINE_PUT;

#[derive(Clone, Debug)]
pub struct SoakConfig {
    pub duration: Duration,
    /// Worker processes in all (subscribers included).
    pub workers: usize,
    pub subscribers: usize,
    /// Memory limit of the soak's own daemon: small, so that eviction and OUT_OF_MEMORY happen.
    pub capacity: u64,
    /// Size of the shared name space (`soak/000`...).
    pub names: u64,
    pub max_size: usize,
    /// Mean time between two SIGKILLs of a random worker.
    pub kill_every: Duration,
}

impl SoakConfig {
    pub fn quick() -> SoakConfig {
        SoakConfig {
            duration: Duration::from_secs(30),
            workers: 32,
            subscribers: 4,
            capacity: 64 * MIB,
            names: 64,
            max_size: 4 * MIB as usize,
            kill_every: Duration::from_millis(300),
        }
    }

    pub fn full() -> SoakConfig {
        SoakConfig {
            duration: Duration::from_secs(600),
            kill_every: Duration::from_millis(500),
            ..SoakConfig::quick()
        }
    }
}

// --- counters shared by the workers -----------------------------------------------------------

/// Fields of a worker's slot in the counters file.
#[derive(Clone, Copy)]
enum C {
    Ops,
    PutInline,
    PutCreate,
    GetHit,
    GetMiss,
    BytesVerified,
    Delete,
    Abort,
    Ephemeral,
    Recheck,
    Notify,
    Resubscribe,
    Full,
    Exists,
    Corrupt,
}
const FIELDS: usize = 16;
const COUNTER_NAMES: [(&str, C); 15] = [
    ("ops", C::Ops),
    ("put_inline", C::PutInline),
    ("put_create_seal", C::PutCreate),
    ("get_found", C::GetHit),
    ("get_missing", C::GetMiss),
    ("bytes_verified", C::BytesVerified),
    ("delete", C::Delete),
    ("create_abort", C::Abort),
    ("ephemeral", C::Ephemeral),
    ("held_rechecked", C::Recheck),
    ("notifications", C::Notify),
    ("resubscribed", C::Resubscribe),
    ("store_full_replies", C::Full),
    ("name_taken_replies", C::Exists),
    ("corrupt", C::Corrupt),
];

/// A file of `slots × FIELDS` u64 counters mapped shared by the harness and every worker.
struct Counters {
    map: memmap2::MmapMut,
}

impl Counters {
    fn create(path: &Path, slots: usize) -> std::io::Result<Counters> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        f.set_len((slots * FIELDS * 8) as u64)?;
        Self::map(&f)
    }

    fn open(path: &Path) -> std::io::Result<Counters> {
        Self::map(&OpenOptions::new().read(true).write(true).open(path)?)
    }

    fn map(f: &File) -> std::io::Result<Counters> {
        // SAFETY: the file is only ever accessed through these atomics, in every process.
        let map = unsafe { memmap2::MmapMut::map_mut(f)? };
        Ok(Counters { map })
    }

    fn cell(&self, slot: usize, c: C) -> &AtomicU64 {
        let i = slot * FIELDS + c as usize;
        assert!((i + 1) * 8 <= self.map.len(), "counter slot out of range");
        // SAFETY: in bounds (checked), 8-byte aligned (page-aligned mapping), and only accessed
        // atomically.
        unsafe { &*(self.map.as_ptr() as *const AtomicU64).add(i) }
    }

    fn add(&self, slot: usize, c: C, n: u64) {
        self.cell(slot, c).fetch_add(n, Ordering::Relaxed);
    }

    fn total(&self, c: C) -> u64 {
        let slots = self.map.len() / (FIELDS * 8);
        (0..slots)
            .map(|s| self.cell(s, c).load(Ordering::Relaxed))
            .sum()
    }
}

// --- the object format ------------------------------------------------------------------------

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(splitmix(seed) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn name_hash(name: &str) -> u64 {
    // FNV-1a, then mixed: names differ in one or two bytes.
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    splitmix(h)
}

fn soak_name(k: u64) -> String {
    format!("soak/{k:03}")
}

const MAGIC: u64 = u64::from_le_bytes(*b"VSOAK\0v1");
const HEADER: usize = 32;
const MIN_SIZE: usize = 64;

/// The 16 bytes of metadata of an object: its name's hash and generation.
fn metadata(name: &str, generation: u64) -> [u8; 16] {
    let mut m = [0u8; 16];
    m[..8].copy_from_slice(&name_hash(name).to_le_bytes());
    m[8..].copy_from_slice(&generation.to_le_bytes());
    m
}

/// Writes the object `name` of generation `generation` into `buf` (its whole size).
fn fill(buf: &mut [u8], name: &str, generation: u64) {
    let nh = name_hash(name);
    buf[..8].copy_from_slice(&MAGIC.to_le_bytes());
    buf[8..16].copy_from_slice(&nh.to_le_bytes());
    buf[16..24].copy_from_slice(&generation.to_le_bytes());
    let len = buf.len() as u64;
    buf[24..32].copy_from_slice(&len.to_le_bytes());
    let seed = nh ^ generation.rotate_left(17);
    for (i, chunk) in buf[HEADER..].chunks_mut(8).enumerate() {
        let w = splitmix(seed ^ i as u64).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// Checks that `bytes` (with `meta`) are an intact object of `name`; returns its generation.
fn verify(bytes: &[u8], meta: &[u8], name: &str) -> Result<u64, String> {
    if bytes.len() < HEADER {
        return Err(format!(
            "{name}: {} bytes, shorter than the header",
            bytes.len()
        ));
    }
    let word = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
    let nh = name_hash(name);
    if word(0) != MAGIC || word(8) != nh {
        return Err(format!(
            "{name}: header {:016x} {:016x} is not this name's ({MAGIC:016x} {nh:016x})",
            word(0),
            word(8)
        ));
    }
    let generation = word(16);
    if word(24) != bytes.len() as u64 {
        return Err(format!(
            "{name}: header says {} bytes, the object has {}",
            word(24),
            bytes.len()
        ));
    }
    if meta != metadata(name, generation) {
        return Err(format!(
            "{name}: metadata {meta:02x?} does not match generation {generation:#x}"
        ));
    }
    let seed = nh ^ generation.rotate_left(17);
    for (i, chunk) in bytes[HEADER..].chunks(8).enumerate() {
        let w = splitmix(seed ^ i as u64).to_le_bytes();
        if chunk != &w[..chunk.len()] {
            return Err(format!(
                "{name}: generation {generation:#x}, bytes {}..{} differ",
                HEADER + i * 8,
                HEADER + i * 8 + chunk.len()
            ));
        }
    }
    Ok(generation)
}

/// 64 B to `max`, about evenly spread over the powers of two (so inline puts and CREATE+SEAL
/// into the client's arenas both happen often).
fn random_size(rng: &mut Rng, max: usize) -> usize {
    let top = usize::BITS - 1 - max.leading_zeros();
    let bits = 6 + rng.below((top - 6 + 1) as u64) as u32;
    let size = (1usize << bits) + rng.below(1 << bits) as usize;
    size.clamp(MIN_SIZE, max)
}

// --- the worker process -----------------------------------------------------------------------

struct WorkerArgs {
    socket: PathBuf,
    counters: PathBuf,
    slot: usize,
    seed: u64,
    subscriber: bool,
    until_monotonic_ms: u64,
    names: u64,
    max_size: usize,
}

fn parse_worker_args(args: &[String]) -> Result<WorkerArgs, String> {
    let get = |k: &str| {
        args.iter()
            .find_map(|a| a.strip_prefix(k)?.strip_prefix('='))
            .ok_or_else(|| format!("missing {k}="))
    };
    let num = |k: &str| get(k)?.parse::<u64>().map_err(|e| format!("{k}: {e}"));
    Ok(WorkerArgs {
        socket: get("socket")?.into(),
        counters: get("counters")?.into(),
        slot: num("slot")? as usize,
        seed: num("seed")?,
        subscriber: get("role")? == "subscriber",
        until_monotonic_ms: num("until")?,
        names: num("names")?,
        max_size: num("max_size")? as usize,
    })
}

/// Milliseconds on CLOCK_MONOTONIC, which every process of the machine shares: the workers'
/// deadline must not move with the wall clock (a stepped clock once ended every worker 3 s
/// before the harness's own deadline, a false "exited early" failure).
fn monotonic_ms() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec; CLOCK_MONOTONIC is always available on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1000 + t.tv_nsec as u64 / 1_000_000
}

enum Fail {
    Corrupt(String),
    Error(String),
}

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        Fail::Error(e.to_string())
    }
}

/// `vovp-bench --soak-worker ...`: runs until its deadline (or until SIGKILLed).
pub fn worker_main(args: Vec<String>) -> ExitCode {
    let args = match parse_worker_args(&args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("soak worker: {e}");
            return ExitCode::from(2);
        }
    };
    let counters = match Counters::open(&args.counters) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("soak worker: {}: {e}", args.counters.display());
            return ExitCode::from(2);
        }
    };
    let tag = format!("soak worker {} (seed {})", args.slot, args.seed);
    // Every other writer opts out of lends (ClientOptions::no_lend_puts), so both put paths
    // and their mix in one store are soaked.
    let options = vovp_client::ClientOptions {
        no_lend_puts: args.slot % 2 == 0,
        ..Default::default()
    };
    let result = Client::connect_with(&args.socket, options)
        .map_err(Fail::from)
        .and_then(|client| {
            if args.subscriber {
                subscriber(&client, &args, &counters)
            } else {
                mixed(&client, &args, &counters)
            }
        });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Fail::Corrupt(why)) => {
            counters.add(args.slot, C::Corrupt, 1);
            eprintln!("{tag}: CORRUPT: {why}");
            ExitCode::from(EXIT_CORRUPT)
        }
        Err(Fail::Error(why)) => {
            eprintln!("{tag}: unexpected error: {why}");
            ExitCode::from(EXIT_ERROR)
        }
    }
}

/// Verifies a view of `name`; counts the bytes.
fn check_view(v: &ObjectView, name: &str, counters: &Counters, slot: usize) -> Result<u64, Fail> {
    let g = verify(v.bytes(), v.metadata(), name).map_err(Fail::Corrupt)?;
    if v.size() != v.bytes().len() as u64 {
        return Err(Fail::Corrupt(format!(
            "{name}: objref says {} bytes, the view has {}",
            v.size(),
            v.bytes().len()
        )));
    }
    counters.add(slot, C::BytesVerified, v.size());
    Ok(g)
}

/// Errors a put may get under load: the name is taken, or the store is full of held objects.
fn put_refused(e: &Error) -> Option<C> {
    match e {
        Error::AlreadyExists(_) => Some(C::Exists),
        Error::OutOfMemory { .. } | Error::TooManyObjects { .. } => Some(C::Full),
        _ => None,
    }
}

/// Puts, gets (verified, some held), deletes, aborted creates, ephemeral objects, rechecks of
/// held views, on the shared names.
fn mixed(client: &Client, a: &WorkerArgs, counters: &Counters) -> Result<(), Fail> {
    let mut rng = Rng::new(a.seed);
    // Views held for a while, with the generation they had when got: they must never change,
    // whatever happens to their names meanwhile.
    let mut held: Vec<(String, u64, ObjectView)> = Vec::new();
    let slot = a.slot;
    let mut scratch = Vec::new();
    while monotonic_ms() < a.until_monotonic_ms {
        let name = soak_name(rng.below(a.names));
        let op = rng.below(100);
        match op {
            // Put: inline up to 256 KiB (64 KiB and more through the lend for lend_puts
            // workers), else CREATE, write into the arena, SEAL (sometimes
            // slowly, so that kills land mid-create).
            0..=24 => {
                let size = random_size(&mut rng, a.max_size);
                let generation = rng.next();
                let meta = metadata(&name, generation);
                if size <= INLINE_LIMIT {
                    scratch.resize(size, 0);
                    fill(&mut scratch, &name, generation);
                    match client.put(&name, &scratch, &meta, CreateOptions::default()) {
                        Ok(()) => counters.add(slot, C::PutInline, 1),
                        Err(e) => counters.add(slot, put_refused(&e).ok_or(e)?, 1),
                    }
                } else {
                    match client.create(&name, size as u64, &meta, CreateOptions::default()) {
                        Ok(mut b) => {
                            fill(b.as_mut_slice(), &name, generation);
                            if rng.chance(8) {
                                std::thread::sleep(Duration::from_millis(20));
                            }
                            let v = b.seal()?;
                            check_view(&v, &name, counters, slot)?;
                            counters.add(slot, C::PutCreate, 1);
                            if held.len() < 6 && rng.chance(2) {
                                held.push((name, generation, v));
                            }
                        }
                        Err(e) => counters.add(slot, put_refused(&e).ok_or(e)?, 1),
                    }
                }
            }
            // A create dropped before its seal: aborted, the name free again.
            25..=29 => {
                let size = random_size(&mut rng, a.max_size) as u64;
                match client.create(&name, size, &metadata(&name, 0), CreateOptions::default()) {
                    Ok(mut b) => {
                        let half = b.as_mut_slice().len() / 2;
                        b.as_mut_slice()[..half].fill(0xAB);
                        drop(b);
                        counters.add(slot, C::Abort, 1);
                    }
                    Err(e) => counters.add(slot, put_refused(&e).ok_or(e)?, 1),
                }
            }
            // Get one or several names, verify, keep some.
            30..=64 => {
                let mut names = vec![name];
                for _ in 0..rng.below(3) {
                    names.push(soak_name(rng.below(a.names)));
                }
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                let timeout = Duration::from_millis(rng.below(3) * 10);
                let views = client.get(&refs, Some(timeout))?;
                for (n, v) in names.iter().zip(views) {
                    match v {
                        Some(v) => {
                            let g = check_view(&v, n, counters, slot)?;
                            counters.add(slot, C::GetHit, 1);
                            if held.len() < 6 && rng.chance(3) {
                                held.push((n.clone(), g, v));
                            }
                        }
                        None => counters.add(slot, C::GetMiss, 1),
                    }
                }
            }
            65..=74 => match client.delete(&name) {
                Ok(()) => counters.add(slot, C::Delete, 1),
                Err(Error::NotFound(_) | Error::NotSealed(_)) => {}
                Err(e) => return Err(e.into()),
            },
            75..=79 => {
                client.contains(&name)?;
            }
            // Ephemeral: gone with its last reference.
            80..=84 => {
                let size = random_size(&mut rng, a.max_size.min(INLINE_LIMIT));
                let generation = rng.next();
                scratch.resize(size, 0);
                fill(&mut scratch, &name, generation);
                let opts = CreateOptions {
                    ephemeral: true,
                    ..CreateOptions::default()
                };
                match client.put_and_view(&name, &scratch, &metadata(&name, generation), opts) {
                    Ok(v) => {
                        check_view(&v, &name, counters, slot)?;
                        counters.add(slot, C::Ephemeral, 1);
                        if held.len() < 6 {
                            held.push((name, generation, v));
                        }
                    }
                    Err(e) => counters.add(slot, put_refused(&e).ok_or(e)?, 1),
                }
            }
            // Release a held view, or recheck one: its bytes are what they were.
            _ => {
                if !held.is_empty() {
                    let i = rng.below(held.len() as u64) as usize;
                    let (n, g, v) = &held[i];
                    let now = check_view(v, n, counters, slot)?;
                    if now != *g {
                        return Err(Fail::Corrupt(format!(
                            "{n}: a held view changed from generation {g:#x} to {now:#x}"
                        )));
                    }
                    counters.add(slot, C::Recheck, 1);
                    if op < 93 {
                        held.swap_remove(i);
                    }
                }
            }
        }
        counters.add(slot, C::Ops, 1);
    }
    drop(held);
    // Queued releases reach the daemon before the exit.
    client.stats()?;
    Ok(())
}

/// Reads the notification stream; gets and verifies some of the sealed objects it announces.
fn subscriber(client: &Client, a: &WorkerArgs, counters: &Counters) -> Result<(), Fail> {
    let mut rng = Rng::new(a.seed);
    let slot = a.slot;
    let mut sub = client.subscribe()?;
    while monotonic_ms() < a.until_monotonic_ms {
        let n = match sub.next(Some(Duration::from_millis(200))) {
            Ok(Some(n)) => n,
            Ok(None) => {
                // A quiet store: the daemon must still be there.
                client.stats()?;
                continue;
            }
            Err(_) => {
                // Dropped as too slow: the daemon must still be there (stats), then subscribe
                // again.
                client.stats()?;
                sub = client.subscribe()?;
                counters.add(slot, C::Resubscribe, 1);
                continue;
            }
        };
        counters.add(slot, C::Notify, 1);
        let name = n.name.as_str().to_string();
        if !name.starts_with("soak/") {
            continue;
        }
        if n.kind == NotificationKind::Sealed {
            // Every soak object's metadata starts with its name's hash.
            if n.metadata.len() != 16 || n.metadata[..8] != name_hash(&name).to_le_bytes() {
                return Err(Fail::Corrupt(format!(
                    "{name}: notification metadata {:02x?} is not this name's",
                    n.metadata
                )));
            }
            if rng.chance(4) {
                match client.get(&[&name], Some(Duration::ZERO))?.pop().flatten() {
                    Some(v) => {
                        check_view(&v, &name, counters, slot)?;
                        counters.add(slot, C::GetHit, 1);
                    }
                    None => counters.add(slot, C::GetMiss, 1),
                }
            }
        }
        counters.add(slot, C::Ops, 1);
    }
    client.stats()?;
    Ok(())
}

// --- the fuzzer connection --------------------------------------------------------------------

#[derive(Default, Debug)]
struct FuzzStats {
    frames: u64,
    connections: u64,
    replies: u64,
    /// Replies with status 0: frames the daemon took as valid requests.
    ok_replies: u64,
    closed_by_daemon: u64,
    /// Writes that did not go through within 2 s (the connection waits behind a GET).
    write_stalls: u64,
    /// Frames from the daemon that are not a well-formed reply or notification.
    bad_replies: u64,
    first_bad: Option<String>,
}

fn str_field(out: &mut Vec<u8>, s: &[u8]) {
    out.extend((s.len() as u16).to_le_bytes());
    out.extend(s);
}

fn frame(version: u8, opcode: u8, flags: u16, id: u64, payload: &[u8]) -> Vec<u8> {
    let mut f = ((12 + payload.len()) as u32).to_le_bytes().to_vec();
    f.push(version);
    f.push(opcode);
    f.extend(flags.to_le_bytes());
    f.extend(id.to_le_bytes());
    f.extend(payload);
    f
}

/// A name of the fuzzer's own (never one of the workers': a mutation flips bytes, it cannot
/// turn `fuzz-NN` into `soak/NNN`), sometimes an invalid one.
fn fuzz_name(rng: &mut Rng) -> Vec<u8> {
    match rng.below(10) {
        0 => Vec::new(),
        1 => vec![b'x'; 257 + rng.below(100) as usize],
        2 => vec![0xff, 0xfe, b'f'],
        _ => format!("fuzz-{}", rng.below(32)).into_bytes(),
    }
}

/// One request frame: a plausible one of each opcode, often mutated, sometimes plain garbage.
/// Returns the frame and whether the daemon is expected to close the connection after it.
fn fuzz_frame(rng: &mut Rng, id: u64) -> (Vec<u8>, bool) {
    let mut p = Vec::new();
    let opcode = match rng.below(16) {
        0 => rng.next() as u8,
        n => n as u8,
    };
    match opcode {
        0x01 => p.extend((rng.next() as u32).to_le_bytes()),
        0x02 => {
            str_field(&mut p, &fuzz_name(rng));
            let size = match rng.below(6) {
                0 => u64::MAX - rng.below(1 << 20),
                1 => 1 << (20 + rng.below(12)),
                _ => rng.below(1 << 16),
            };
            p.extend(size.to_le_bytes());
            p.extend((rng.below(4) as u32).to_le_bytes());
            p.push([1, 1, 1, 2, 0, 255][rng.below(6) as usize]);
            p.extend((rng.below(3) as u32).to_le_bytes());
            let meta = rng.below(64) as usize;
            p.extend((meta as u32).to_le_bytes());
            p.extend(std::iter::repeat_n(7u8, meta));
        }
        0x03 | 0x04 | 0x08 | 0x09 => str_field(&mut p, &fuzz_name(rng)),
        0x05 => {
            str_field(&mut p, &fuzz_name(rng));
            p.extend((rng.below(4) as u32).to_le_bytes());
            p.extend(0u32.to_le_bytes());
            let data = if rng.chance(50) {
                MIB as usize
            } else {
                rng.below(2048) as usize
            };
            p.extend((data as u64).to_le_bytes());
            p.extend(std::iter::repeat_n(0x5Au8, data));
        }
        0x06 => {
            let timeout: i64 = match rng.below(20) {
                0 => -1,
                1 => -(rng.below(1000) as i64) - 2,
                n => (n as i64 - 2) * 5,
            };
            p.extend(timeout.to_le_bytes());
            let n = 1 + rng.below(3);
            p.extend((n as u32).to_le_bytes());
            for _ in 0..n {
                str_field(&mut p, &fuzz_name(rng));
            }
        }
        0x07 => {
            let n = rng.below(4);
            p.extend((n as u32).to_le_bytes());
            for _ in 0..n {
                p.extend(rng.below(4096).to_le_bytes());
            }
        }
        0x0A => {
            p.extend(rng.below(1 << 20).to_le_bytes());
            p.extend((rng.below(100_000) as u32).to_le_bytes());
        }
        // EVICT: small amounts, so the workers' objects mostly stay (big ones now and then).
        0x0B => p.extend(
            if rng.chance(100) {
                u64::MAX
            } else {
                rng.below(MIB)
            }
            .to_le_bytes(),
        ),
        0x0F => p.extend((rng.below(8) as u32).to_le_bytes()),
        _ => p.extend((0..rng.below(48)).map(|_| rng.next() as u8)),
    }
    // Mutations: flipped bytes, a cut, trailing junk.
    if !p.is_empty() && rng.chance(3) {
        for _ in 0..1 + rng.below(3) {
            let i = rng.below(p.len() as u64) as usize;
            p[i] ^= 1 << rng.below(8);
        }
    }
    if !p.is_empty() && rng.chance(8) {
        p.truncate(rng.below(p.len() as u64) as usize);
    }
    if rng.chance(10) {
        p.extend((0..1 + rng.below(16)).map(|_| rng.next() as u8));
    }
    let flags = if opcode == 0x07 && rng.chance(2) || rng.chance(40) {
        1
    } else {
        0
    };
    match rng.below(200) {
        // A wrong version (any other, older ones included) or an impossible length: an error
        // reply, then the connection closes.
        0 => {
            let version = VERSION.wrapping_add(1 + rng.below(255) as u8);
            (frame(version, opcode, flags, id, &p), true)
        }
        1 => {
            let mut f = frame(VERSION, opcode, flags, id, &p);
            let len: u32 = if rng.chance(2) {
                rng.below(12) as u32
            } else {
                u32::MAX - rng.below(1000) as u32
            };
            f[..4].copy_from_slice(&len.to_le_bytes());
            (f, true)
        }
        // SUBSCRIBE turns the connection into a notification stream; the fuzzer moves on.
        _ if opcode == 0x0D => (frame(VERSION, opcode, flags, id, &p), true),
        _ => (frame(VERSION, opcode, flags, id, &p), false),
    }
}

/// Reads what the daemon sent so far (non-blocking) and checks each frame's shape.
fn drain(stream: &mut UnixStream, buf: &mut Vec<u8>, stats: &mut FuzzStats) -> bool {
    let mut chunk = [0u8; 64 * 1024];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return false,
        }
    }
    loop {
        if buf.len() < 4 {
            return true;
        }
        let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
        let bad = if !(12..=12 + 64 * MIB as usize).contains(&len) {
            Some(format!("reply frame length {len}"))
        } else if buf.len() < 4 + len {
            return true;
        } else if buf[4] != VERSION {
            Some(format!("reply version {}", buf[4]))
        } else if buf[5] & 0x80 == 0 && buf[5] != 0x0E {
            Some(format!("reply opcode {:#x}", buf[5]))
        } else if buf[5] & 0x80 != 0 && len < 13 {
            Some("reply without a status".to_string())
        } else {
            None
        };
        if let Some(why) = bad {
            stats.bad_replies += 1;
            stats.first_bad.get_or_insert(why);
            buf.clear();
            return false;
        }
        stats.replies += 1;
        if buf[5] & 0x80 != 0 && buf[16] == 0 {
            stats.ok_replies += 1;
        }
        buf.drain(..4 + len);
    }
}

/// Sends mutated and random frames on one connection after another until `stop`.
fn fuzz(socket: &Path, seed: u64, stop: &AtomicBool) -> FuzzStats {
    let mut rng = Rng::new(seed);
    let mut stats = FuzzStats::default();
    let mut buf = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut s) = UnixStream::connect(socket) else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        stats.connections += 1;
        buf.clear();
        let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
        let mut id = 1u64;
        // Mostly a proper HELLO first; sometimes anything before it (PROTOCOL_STATE replies).
        if !rng.chance(10) {
            let _ = s.write_all(&frame(VERSION, 0x01, 0, id, &7u32.to_le_bytes()));
            stats.frames += 1;
        }
        let _ = s.set_nonblocking(true);
        let mut alive = true;
        for _ in 0..1 + rng.below(300) {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            id += 1;
            let (f, closes) = fuzz_frame(&mut rng, id);
            // A partial frame, then goodbye.
            let (f, closes) = if rng.chance(150) {
                let cut = rng.below(f.len() as u64) as usize;
                (f[..cut].to_vec(), true)
            } else {
                (f, closes)
            };
            let _ = s.set_nonblocking(false);
            let sent = s.write_all(&f);
            let _ = s.set_nonblocking(true);
            stats.frames += 1;
            if let Err(e) = sent {
                alive = false;
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) {
                    stats.write_stalls += 1;
                } else {
                    stats.closed_by_daemon += 1;
                }
                break;
            }
            if !drain(&mut s, &mut buf, &mut stats) {
                alive = false;
                stats.closed_by_daemon += 1;
                break;
            }
            if closes {
                break;
            }
            // Leave the CPUs to the workers: a few thousand frames a second are plenty.
            std::thread::sleep(Duration::from_micros(300));
        }
        if alive {
            std::thread::sleep(Duration::from_millis(5));
            drain(&mut s, &mut buf, &mut stats);
            if rng.chance(4) {
                let _ = s.shutdown(std::net::Shutdown::Write);
            }
        }
    }
    stats
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_verify_and_any_change_is_caught() {
        for size in [64, 65, 71, 4096, 300_001] {
            let mut b = vec![0u8; size];
            fill(&mut b, "soak/007", 42);
            let m = metadata("soak/007", 42);
            assert_eq!(verify(&b, &m, "soak/007"), Ok(42));
            assert!(verify(&b, &m, "soak/008").is_err());
            assert!(verify(&b, &metadata("soak/007", 43), "soak/007").is_err());
            assert!(verify(&b[..size - 1], &m, "soak/007").is_err());
            let mut c = b.clone();
            c[size - 1] ^= 1;
            assert!(verify(&c, &m, "soak/007").is_err());
        }
    }

    #[test]
    fn sizes_cover_inline_and_create() {
        let mut rng = Rng::new(1);
        let sizes: Vec<usize> = (0..2000).map(|_| random_size(&mut rng, 4 << 20)).collect();
        assert!(sizes.iter().all(|&s| (MIN_SIZE..=4 << 20).contains(&s)));
        assert!(sizes.iter().any(|&s| s <= 1024));
        assert!(sizes.iter().any(|&s| s > INLINE_LIMIT));
    }

    #[test]
    fn fuzz_frames_have_a_header() {
        let mut rng = Rng::new(3);
        for id in 0..1000 {
            let (f, _) = fuzz_frame(&mut rng, id);
            assert!(f.len() >= 16);
        }
    }
}
