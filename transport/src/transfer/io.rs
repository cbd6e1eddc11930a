//! Stream I/O for transfers on tokio-uring: whole messages, and bytes read into or written
//! from an object's memory in place ([`ObjectBytes`]), each under a deadline.
//!
//! io_uring owns a buffer until its operation completes, even after the future waiting for
//! it is dropped, so a timeout must not simply drop a read or a write into an object's memory:
//! the kernel could still write there after the object was aborted and its memory reused. A
//! deadline here therefore shuts the socket down (which completes the pending operation at
//! once) and waits for the operation before returning: when these functions return, nothing is
//! in flight on the memory they were given.

use std::io;
use std::net::Shutdown;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_uring::buf::{IoBuf, IoBufMut};
use tokio_uring::net::TcpStream;
use vovp::Segment;
use vovp_proto::transfer::message_len;

/// Bytes of an object in the engine's own mapping of its segment, lent to io_uring. The
/// pointer stays valid while `_segment` lives (the mapping) and the object is held by the
/// transfer's session, which outlives every operation (see the module doc).
pub(crate) struct ObjectBytes {
    ptr: *mut u8,
    len: usize,
    init: usize,
    _segment: Arc<Segment>,
}

impl ObjectBytes {
    /// `len` bytes at `offset` of `segment`, or `None` past its end.
    pub(crate) fn new(segment: &Arc<Segment>, offset: u64, len: u64) -> Option<ObjectBytes> {
        let ptr = segment.ptr(offset, len)?;
        Some(ObjectBytes {
            ptr,
            len: usize::try_from(len).ok()?,
            // Written: the object's bytes are there (a send); a receive counts from 0 anyway.
            init: usize::try_from(len).ok()?,
            _segment: segment.clone(),
        })
    }

    /// The first `n` bytes of this range skipped (what was sent or received already).
    fn advance(self, n: usize) -> ObjectBytes {
        let n = n.min(self.len);
        ObjectBytes {
            // SAFETY: `n <= len`: still inside the range.
            ptr: unsafe { self.ptr.add(n) },
            len: self.len - n,
            init: self.init.saturating_sub(n),
            _segment: self._segment,
        }
    }
}

// SAFETY: the pointer and length name memory that stays mapped (the segment) and allocated
// (the transfer's reference) for as long as io_uring may use it (see the module doc); nothing
// else writes it during a transfer (a send reads a sealed object; a receive writes the
// receiver's own unsealed object, each stream its own range).
unsafe impl IoBuf for ObjectBytes {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr
    }
    fn bytes_init(&self) -> usize {
        self.init
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
}

// SAFETY: as for `IoBuf`.
unsafe impl IoBufMut for ObjectBytes {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    unsafe fn set_init(&mut self, pos: usize) {
        self.init = self.init.max(pos);
    }
}

/// Why a stream ended early.
fn timed_out(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, format!("{what} timed out"))
}

/// Runs `op` (a read or write of `stream`) until `deadline`; past it, shuts the socket down and
/// waits for `op` to complete before failing, so nothing stays in flight.
async fn until<T>(
    stream: &TcpStream,
    deadline: Instant,
    what: &str,
    op: impl std::future::Future<Output = (io::Result<usize>, T)>,
) -> (io::Result<usize>, T) {
    let mut op = std::pin::pin!(op);
    tokio::select! {
        done = &mut op => done,
        _ = tokio::time::sleep_until(deadline) => {
            let _ = stream.shutdown(Shutdown::Both);
            let (_, buf) = op.await;
            (Err(timed_out(what)), buf)
        }
    }
}

/// Reads exactly `buf.len()` bytes into `buf`, each read within `idle` and all before
/// `deadline`.
pub(crate) async fn read_exact_into(
    stream: &TcpStream,
    mut buf: ObjectBytes,
    idle: Duration,
    deadline: Instant,
) -> io::Result<()> {
    while buf.len > 0 {
        buf.init = 0;
        let by = (Instant::now() + idle).min(deadline);
        let (got, back) = until(stream, by, "receiving", stream.read(buf)).await;
        match got? {
            0 => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the holder closed the stream with {} bytes to go", back.len),
                ))
            }
            n => buf = back.advance(n),
        }
    }
    Ok(())
}

/// Writes all of `buf`, each write within `idle` (a peer that stops reading is dropped then).
pub(crate) async fn write_all_from<B: IoBuf>(
    stream: &TcpStream,
    buf: B,
    idle: Duration,
) -> io::Result<()> {
    use tokio_uring::buf::BoundedBuf;
    let total = buf.bytes_init();
    let mut slice = buf.slice(..);
    let mut done = 0;
    while done < total {
        let by = Instant::now() + idle;
        let write = async {
            let (r, s) = stream.write(slice).submit().await;
            (r, s)
        };
        let (wrote, back) = until(stream, by, "sending", write).await;
        let n = wrote?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "the peer closed the stream",
            ));
        }
        done += n;
        if done < total {
            slice = back.into_inner().slice(done..);
        } else {
            break;
        }
    }
    Ok(())
}

/// Reads one message (a `u32` length, then that many bytes) before `deadline`.
pub(crate) async fn read_message(stream: &TcpStream, deadline: Instant) -> io::Result<Vec<u8>> {
    let prefix = read_vec(stream, 4, deadline).await?;
    let mut len = [0u8; 4];
    len.copy_from_slice(&prefix);
    let n = message_len(len).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    read_vec(stream, n, deadline).await
}

/// Exactly `n` bytes into a new vector.
async fn read_vec(stream: &TcpStream, n: usize, deadline: Instant) -> io::Result<Vec<u8>> {
    use tokio_uring::buf::BoundedBuf;
    let mut have: Vec<u8> = Vec::with_capacity(n);
    while have.len() < n {
        let want = n - have.len();
        // Never more than the message: raw bytes may follow it (into an object's memory).
        let chunk = Vec::with_capacity(want).slice(0..want);
        let (got, chunk) = until(stream, deadline, "reading a message", stream.read(chunk)).await;
        let chunk = chunk.into_inner();
        match got? {
            0 => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the stream",
                ))
            }
            _ => have.extend_from_slice(&chunk),
        }
    }
    Ok(have)
}
