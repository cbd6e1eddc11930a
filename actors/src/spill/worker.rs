//! The IO worker: the one thread that touches spill files, so that no actor ever waits on a
//! disk. It runs a tokio-uring runtime: every read, write, open and unlink is an io_uring
//! operation, each job a task of its own, so several objects move at once and each moves
//! several chunks at once ([`DEPTH`] in flight per object, [`BUFFERS`] in all).
//!
//! Transfers go through a pool of [`CHUNK`]-sized buffers aligned to [`BLOCK`], opened with
//! `O_DIRECT` when the file system takes it (ext4, xfs, btrfs do; a file system that refuses
//! makes the worker fall back to buffered IO for good, logged once): a spill then does not
//! push the disk's worth of page cache out of the machine's memory (the store's `-m` is memory
//! the operator gave to objects, the cache is everyone's). Bytes are copied between the
//! object's block and a buffer on this thread, and the data's CRC-32C is computed here too,
//! while writing, and over each restored chunk as it is copied into the block (the chunks'
//! CRCs combined in order).
//!
//! Completions go back to the table actor through the sink given at start ([`Done`]); a job
//! never reports before its last IO finished, so the memory it reads or writes stays the
//! object's until then (the actor frees nothing a job still uses).
//!
//! When the job channel closes (the actor stopped), the worker finishes the jobs it has,
//! removes the spill files left in the directory (a stopped store has no objects) and exits,
//! releasing the directory's lock last.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_uring::buf::{BoundedBuf, IoBuf, IoBufMut};
use tokio_uring::fs::{File, OpenOptions};

use super::dir::{remove_spill_files, SpillDir};
use super::file::{blocks, file_len, path_of, Damage, Header, BLOCK};

/// Bytes moved by one IO (2 MiB: large enough that a virtual disk streams at its sequential
/// rate with a few in flight, small enough that the pool stays 16 MiB).
pub(crate) const CHUNK: usize = 2 << 20;
/// IOs in flight for one object.
pub(crate) const DEPTH: usize = 4;
/// Buffers in all: IOs in flight across every object, and the heap the worker may use.
pub(crate) const BUFFERS: usize = 8;

/// A range of an object's block, which a job reads (spill) or writes (restore). The owner keeps
/// the mapping alive; the table keeps the range the object's until the job reports.
pub(crate) struct Memory {
    /// Keeps the mapping alive (never read).
    #[allow(dead_code)]
    pub owner: Arc<dyn Send + Sync>,
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: the pointer is into a shared mapping kept alive by `owner`, and the table hands the
// range to this one job until it reports (see the module doc).
unsafe impl Send for Memory {}

impl std::fmt::Debug for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Memory").field("len", &self.len).finish()
    }
}

/// What the worker is asked to do.
#[derive(Debug)]
pub(crate) enum Job {
    /// Write `src` as the file of `header`'s object (whose `crc` is computed here).
    Write { header: Header, src: Memory },
    /// Read the file of `expect`'s object into `dst`, checking it is that object, whole and
    /// unchanged.
    Read { expect: Header, dst: Memory },
    /// Remove the file of object `id` (gone or back in memory).
    Remove { id: u64 },
}

/// What a job did.
#[derive(Debug)]
pub(crate) enum Done {
    /// The file of object `id` is written (its data's CRC-32C), or why not (nothing is left
    /// on disk then).
    Written {
        id: u64,
        result: Result<u32, String>,
    },
    /// `dst` holds the object's bytes, checked, or the file's damage.
    Read { id: u64, result: Result<(), Damage> },
}

/// Where completions go (the table actor's mailbox).
pub(crate) type Sink = Box<dyn Fn(Done) + Send + Sync>;

/// The worker thread, fed through a channel.
pub(crate) struct Worker {
    jobs: Option<mpsc::UnboundedSender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").finish_non_exhaustive()
    }
}

impl Worker {
    /// Starts the worker on `dir` (whose lock it holds until it exits).
    pub(crate) fn start(dir: SpillDir, sink: Sink) -> std::io::Result<Worker> {
        let (tx, rx) = mpsc::unbounded_channel();
        let thread = std::thread::Builder::new()
            .name("vovp-spill".into())
            .spawn(move || run(dir, rx, sink))?;
        Ok(Worker {
            jobs: Some(tx),
            thread: Some(thread),
        })
    }

    /// Queues a job (never blocks).
    pub(crate) fn submit(&self, job: Job) -> bool {
        self.jobs.as_ref().is_some_and(|j| j.send(job).is_ok())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // The worker finishes what it has, cleans the directory and exits.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(dir: SpillDir, mut rx: mpsc::UnboundedReceiver<Job>, sink: Sink) {
    let path = dir.path().to_owned();
    let root = path.clone();
    tokio_uring::builder().entries(256).start(async move {
        let io = Rc::new(Io {
            dir: root,
            pool: Rc::new(Pool::new()),
            direct: Cell::new(true),
        });
        let sink = Rc::new(sink);
        let mut running = Vec::new();
        while let Some(job) = rx.recv().await {
            running.retain(|t: &tokio::task::JoinHandle<()>| !t.is_finished());
            let (io, sink) = (io.clone(), sink.clone());
            running.push(tokio_uring::spawn(async move {
                if let Some(done) = io.run(job).await {
                    sink(done);
                }
            }));
        }
        for t in running {
            let _ = t.await;
        }
    });
    if let Err(e) = remove_spill_files(&path) {
        tracing::warn!("cleaning the spill directory {}: {e}", path.display());
    }
    drop(dir);
}

/// The worker's state, shared by its tasks (one thread).
struct Io {
    dir: PathBuf,
    /// Each IO gives its buffer back when it completes, whatever its job does meanwhile, so
    /// jobs waiting for buffers never wait on each other.
    pool: Rc<Pool>,
    /// `O_DIRECT` works here (until a file system refuses it).
    direct: Cell<bool>,
}

/// A job's failure: an IO error, or `O_DIRECT` refused (the job runs again without it).
enum Failed {
    Io(std::io::Error),
    NotDirect,
}

impl From<std::io::Error> for Failed {
    fn from(e: std::io::Error) -> Self {
        Failed::Io(e)
    }
}

impl Io {
    async fn run(&self, job: Job) -> Option<Done> {
        match job {
            Job::Write { header, src } => {
                let id = header.id;
                let result = loop {
                    match self.write(&header, &src).await {
                        Ok(crc) => break Ok(crc),
                        Err(Failed::NotDirect) => self.no_direct(),
                        Err(Failed::Io(e)) => {
                            let _ = tokio_uring::fs::remove_file(path_of(&self.dir, id)).await;
                            break Err(e.to_string());
                        }
                    }
                };
                Some(Done::Written { id, result })
            }
            Job::Read { expect, dst } => {
                let id = expect.id;
                let result = loop {
                    match self.read(&expect, &dst).await {
                        Ok(r) => break r,
                        Err(Failed::NotDirect) => self.no_direct(),
                        Err(Failed::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                            break Err(Damage::Missing)
                        }
                        Err(Failed::Io(e)) => break Err(Damage::Io(e.to_string())),
                    }
                };
                Some(Done::Read { id, result })
            }
            Job::Remove { id } => {
                match tokio_uring::fs::remove_file(path_of(&self.dir, id)).await {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        tracing::warn!("removing spill file of object {id:#x}: {e}")
                    }
                    _ => {}
                }
                None
            }
        }
    }

    fn no_direct(&self) {
        if self.direct.replace(false) {
            tracing::warn!(
                "the spill directory {} refuses O_DIRECT: spilling through the page cache",
                self.dir.display()
            );
        }
    }

    async fn open(&self, path: &Path, write: bool) -> Result<File, Failed> {
        let mut o = OpenOptions::new();
        if write {
            o.write(true).create(true).truncate(true);
        } else {
            o.read(true);
        }
        let direct = self.direct.get();
        if direct {
            use std::os::unix::fs::OpenOptionsExt;
            o.custom_flags(libc::O_DIRECT);
        }
        match o.open(path).await {
            Ok(f) => Ok(f),
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => Err(Failed::NotDirect),
            Err(e) => Err(e.into()),
        }
    }

    /// Writes the object's file: data chunks (up to [`DEPTH`] in flight), then the header
    /// with the data's checksum. The CRC-32C of what was written.
    async fn write(&self, header: &Header, src: &Memory) -> Result<u32, Failed> {
        let file = Rc::new(self.open(&path_of(&self.dir, header.id), true).await?);
        let direct = self.direct.get();
        let mut crc = 0u32;
        let mut in_flight = InFlight::new(direct);
        let mut at = 0usize;
        while at < src.len {
            let n = CHUNK.min(src.len - at);
            let mut buf = self.pool.take().await;
            // SAFETY: `src` is the object's block, which stays its own until this job reports.
            let bytes = unsafe { std::slice::from_raw_parts(src.ptr.add(at), n) };
            buf.fill_from(bytes, blocks(n as u64) as usize);
            crc = crc32c::crc32c_append(crc, bytes);
            let (f, pool) = (file.clone(), self.pool.clone());
            let pos = BLOCK + at as u64;
            in_flight
                .push(tokio_uring::spawn(async move {
                    let (r, buf) = f.write_all_at(buf, pos).await;
                    pool.give(buf);
                    r
                }))
                .await?;
            at += n;
        }
        in_flight.finish().await?;
        let mut buf = self.pool.take().await;
        let header = Header {
            crc,
            ..header.clone()
        };
        buf.set_len(BLOCK as usize);
        header.encode_into(buf.as_mut_slice());
        let (r, buf) = file.write_all_at(buf, 0).await;
        self.pool.give(buf);
        check(r, direct)?;
        Ok(crc)
    }

    /// Reads the object's file into `dst`: the header (it must be this object's), the data
    /// chunks (up to [`DEPTH`] in flight), then the checksum over `dst`. `Ok(Err(damage))`:
    /// the file is not the object's, whole and unchanged.
    async fn read(&self, expect: &Header, dst: &Memory) -> Result<Result<(), Damage>, Failed> {
        let file = Rc::new(self.open(&path_of(&self.dir, expect.id), false).await?);
        let direct = self.direct.get();
        let need = file_len(expect.size);
        let buf = self.pool.take().await;
        let (r, buf) = file.read_at(buf.slice(..BLOCK as usize), 0).await;
        let buf = buf.into_inner();
        let got = check(r, direct);
        let header = Header::decode(&buf.as_slice()[..IoBuf::bytes_init(&buf)]);
        self.pool.give(buf);
        let got = got?;
        if got < BLOCK as usize {
            return Ok(Err(Damage::Truncated {
                have: got as u64,
                need,
            }));
        }
        let header = match header {
            Ok(h) if expect.same_object(&h) => h,
            Ok(_) => return Ok(Err(Damage::NotThisObject)),
            Err(d) => return Ok(Err(d)),
        };
        let truncated = Rc::new(Cell::new(None::<u64>));
        // Each chunk's CRC, computed while its bytes are in cache, combined in order after.
        let crcs = Rc::new(RefCell::new(vec![0u32; dst.len.div_ceil(CHUNK)]));
        let mut in_flight = InFlight::new(direct);
        let mut at = 0usize;
        while at < dst.len {
            let n = CHUNK.min(dst.len - at);
            let want = blocks(n as u64) as usize;
            let buf = self.pool.take().await;
            let (f, pool) = (file.clone(), self.pool.clone());
            let pos = BLOCK + at as u64;
            // SAFETY: `dst` is the object's new block, which stays its own until this job
            // reports; chunks do not overlap.
            let out = unsafe { dst.ptr.add(at) };
            let (truncated, crcs) = (truncated.clone(), crcs.clone());
            let chunk = at / CHUNK;
            let task = tokio_uring::spawn(async move {
                let (r, buf) = f.read_at(buf.slice(..want), pos).await;
                let buf = buf.into_inner();
                if let Ok(got) = &r {
                    if *got < n {
                        if truncated.get().is_none() {
                            truncated.set(Some(pos + *got as u64));
                        }
                    } else {
                        // SAFETY: see above; `n` bytes of this chunk (the task runs on the
                        // worker's one thread, before the job reports).
                        unsafe { std::ptr::copy_nonoverlapping(buf.as_slice().as_ptr(), out, n) };
                        // The copy's bytes, as the block holds them now.
                        // SAFETY: the `n` bytes just written.
                        let copied = unsafe { std::slice::from_raw_parts(out, n) };
                        crcs.borrow_mut()[chunk] = crc32c::crc32c(copied);
                    }
                }
                pool.give(buf);
                r.map(drop)
            });
            in_flight.push(task).await?;
            at += n;
        }
        in_flight.finish().await?;
        if let Some(have) = truncated.get() {
            return Ok(Err(Damage::Truncated { have, need }));
        }
        let found = crcs.borrow().iter().enumerate().fold(0u32, |crc, (i, &c)| {
            let len = CHUNK.min(dst.len - i * CHUNK);
            crc32c::crc32c_combine(crc, c, len)
        });
        if found != header.crc {
            return Ok(Err(Damage::Checksum {
                expected: header.crc,
                found,
            }));
        }
        Ok(Ok(()))
    }
}

/// One job's IOs in flight, at most [`DEPTH`]. A job never reports (and the actor never frees
/// its memory) while one of its IOs may still touch the block: after a failure the others are
/// waited for too.
struct InFlight {
    tasks: VecDeque<tokio::task::JoinHandle<std::io::Result<()>>>,
    direct: bool,
}

impl InFlight {
    fn new(direct: bool) -> InFlight {
        InFlight {
            tasks: VecDeque::new(),
            direct,
        }
    }

    /// Adds an IO, waiting for the oldest first when [`DEPTH`] are in flight.
    async fn push(
        &mut self,
        task: tokio::task::JoinHandle<std::io::Result<()>>,
    ) -> Result<(), Failed> {
        self.tasks.push_back(task);
        if self.tasks.len() < DEPTH {
            return Ok(());
        }
        let oldest = self.tasks.pop_front();
        match self.settle(oldest).await {
            Ok(()) => Ok(()),
            Err(e) => {
                let _ = self.drain().await;
                Err(e)
            }
        }
    }

    /// Waits for every IO: the first failure.
    async fn finish(mut self) -> Result<(), Failed> {
        self.drain().await
    }

    async fn drain(&mut self) -> Result<(), Failed> {
        let mut first = Ok(());
        while let Some(t) = self.tasks.pop_front() {
            if let Err(e) = self.settle(Some(t)).await {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    /// Waits for one IO (its buffer is back in the pool already).
    async fn settle(
        &self,
        task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    ) -> Result<(), Failed> {
        let Some(task) = task else {
            return Ok(());
        };
        let r = task
            .await
            .map_err(|e| Failed::Io(std::io::Error::other(e.to_string())))?;
        check(r, self.direct)
    }
}

/// An IO's result, with `EINVAL` under `O_DIRECT` as "not direct here".
fn check<T>(r: std::io::Result<T>, direct: bool) -> Result<T, Failed> {
    match r {
        Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => Err(Failed::NotDirect),
        Err(e) => Err(e.into()),
        Ok(v) => Ok(v),
    }
}

/// The worker's transfer buffers: [`BUFFERS`] of [`CHUNK`] bytes, taken in turn.
struct Pool {
    free: RefCell<Vec<Buffer>>,
    permits: tokio::sync::Semaphore,
}

impl Pool {
    fn new() -> Pool {
        Pool {
            free: RefCell::new(Vec::new()),
            permits: tokio::sync::Semaphore::new(BUFFERS),
        }
    }

    /// A buffer, waiting for one while all are in use.
    async fn take(&self) -> Buffer {
        if let Ok(p) = self.permits.acquire().await {
            p.forget();
        }
        self.free.borrow_mut().pop().unwrap_or_else(Buffer::new)
    }

    fn give(&self, mut buf: Buffer) {
        buf.set_len(0);
        self.free.borrow_mut().push(buf);
        self.permits.add_permits(1);
    }
}

/// [`CHUNK`] bytes aligned to [`BLOCK`] (what `O_DIRECT` needs), with a length of initialised
/// bytes as tokio-uring's buffers have.
struct Buffer {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

const LAYOUT: std::alloc::Layout = match std::alloc::Layout::from_size_align(CHUNK, BLOCK as usize)
{
    Ok(l) => l,
    Err(_) => panic!("chunk layout"),
};

impl Buffer {
    fn new() -> Buffer {
        // SAFETY: LAYOUT has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(LAYOUT) };
        let ptr =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(LAYOUT));
        Buffer { ptr, len: 0 }
    }

    fn set_len(&mut self, len: usize) {
        self.len = len.min(CHUNK);
    }

    /// `bytes`, then zeros up to `len` (a whole number of blocks).
    fn fill_from(&mut self, bytes: &[u8], len: usize) {
        let s = self.as_mut_slice_full();
        s[..bytes.len()].copy_from_slice(bytes);
        s[bytes.len()..len].fill(0);
        self.set_len(len);
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: CHUNK bytes allocated (zeroed, so initialised) and owned.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), CHUNK) }
    }

    fn as_mut_slice_full(&mut self) -> &mut [u8] {
        // SAFETY: as above, and borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), CHUNK) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.as_mut_slice_full()[..len]
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated with LAYOUT in `new`.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), LAYOUT) }
    }
}

// SAFETY: the buffer owns its allocation; the pointer does not move while tokio-uring holds it.
unsafe impl IoBuf for Buffer {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
    fn bytes_total(&self) -> usize {
        CHUNK
    }
}

// SAFETY: as above; `set_init` only records how much the kernel wrote.
unsafe impl IoBufMut for Buffer {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    unsafe fn set_init(&mut self, pos: usize) {
        if pos > self.len {
            self.len = pos.min(CHUNK);
        }
    }
}
