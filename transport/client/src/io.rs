//! Blocking socket I/O on any Unix stream fd, blocking or not (a non-blocking one waits in
//! `poll`): the blocking client's socket, the HELLO handshake, and the async client's socket
//! when a synchronous call (`ObjectBuffer::seal`) must use that very connection.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags};
use rustix::io::Errno;
use rustix::net::{RecvFlags, SendFlags};
use vovp_proto::{Header, Reply, Request, HEADER_LEN};
use vovp_types::Error;

use crate::core::frame_complete;
use crate::mapping::Mappings;

pub(crate) fn conn_err(e: std::io::Error) -> Error {
    use std::io::ErrorKind as K;
    match e.kind() {
        // What a dead daemon looks like from here ("failed to fill whole buffer" says nothing).
        K::UnexpectedEof | K::BrokenPipe | K::ConnectionReset | K::ConnectionAborted => {
            Error::Connection(format!(
                "the daemon closed the connection (stopped, restarted or killed?): {e}"
            ))
        }
        _ => Error::Connection(e.to_string()),
    }
}

fn errno_err(e: Errno) -> Error {
    conn_err(e.into())
}

/// Waits until `fd` is ready for `flags` (only reached on a non-blocking fd).
fn wait(fd: BorrowedFd<'_>, flags: PollFlags) -> Result<(), Error> {
    let mut fds = [PollFd::new(&fd, flags)];
    loop {
        match poll(&mut fds, None) {
            Ok(_) => return Ok(()),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(errno_err(e)),
        }
    }
}

/// Sends all of `buf` (`MSG_NOSIGNAL`: a closed peer is an error, not SIGPIPE).
pub(crate) fn write_all(fd: BorrowedFd<'_>, mut buf: &[u8]) -> Result<(), Error> {
    while !buf.is_empty() {
        match rustix::net::send(fd, buf, SendFlags::NOSIGNAL) {
            Ok(0) => return Err(conn_err(std::io::ErrorKind::WriteZero.into())),
            Ok(n) => buf = &buf[n..],
            Err(Errno::AGAIN) => wait(fd, PollFlags::OUT)?,
            Err(Errno::INTR) => {}
            Err(e) => return Err(errno_err(e)),
        }
    }
    Ok(())
}

fn read_exact(fd: BorrowedFd<'_>, mut buf: &mut [u8]) -> Result<(), Error> {
    while !buf.is_empty() {
        match rustix::net::recv(fd, &mut *buf, RecvFlags::empty()) {
            Ok((0, _)) => return Err(conn_err(std::io::ErrorKind::UnexpectedEof.into())),
            Ok((n, _)) => buf = &mut buf[n..],
            Err(Errno::AGAIN) => wait(fd, PollFlags::IN)?,
            Err(Errno::INTR) => {}
            Err(e) => return Err(errno_err(e)),
        }
    }
    Ok(())
}

/// Reads one frame: its header, and its payload into `payload`.
pub(crate) fn read_frame(fd: BorrowedFd<'_>, payload: &mut Vec<u8>) -> Result<Header, Error> {
    let mut header = [0u8; HEADER_LEN];
    read_exact(fd, &mut header)?;
    let h = Header::parse(&header)?.ok_or_else(|| Error::Protocol("short header".into()))?;
    payload.resize(h.payload_len, 0);
    read_exact(fd, payload)?;
    Ok(h)
}

/// Reads one whole frame that may carry fds (HELLO's and SEGMENT's replies).
pub(crate) fn read_frame_with_fds(fd: BorrowedFd<'_>) -> Result<(Vec<u8>, Vec<OwnedFd>), Error> {
    let mut frame = vec![0u8; 4096];
    let mut got = 0;
    let mut fds = Vec::new();
    loop {
        if frame_complete(&mut frame, got)? {
            return Ok((frame, fds));
        }
        match vovp_shm::fdpass::recv_with_fds(fd, &mut frame[got..], &mut fds) {
            Ok(0) => return Err(conn_err(std::io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => wait(fd, PollFlags::IN)?,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(conn_err(e)),
        }
    }
}

/// How long a blocking call polls for its reply before sleeping in `recv`.
const REPLY_SPIN: Duration = Duration::from_micros(50);

/// Polls (yielding the CPU between polls) until the reply starts to arrive or `REPLY_SPIN`
/// passes. A small request is answered in a few microseconds of daemon work, but waking a
/// sleeping reader on another CPU costs tens of microseconds on virtual machines (measured
/// 45-65 µs here, vovp-bench "machine limits"); polling skips that wake-up. `sched_yield`
/// keeps the poll from starving the daemon when both share a CPU.
pub(crate) fn spin_until_readable(fd: BorrowedFd<'_>) {
    let start = Instant::now();
    while start.elapsed() < REPLY_SPIN && !readable_now(fd) {
        rustix::thread::sched_yield();
    }
}

/// Whether a byte can be read now without blocking (or the stream ended or failed: the read
/// then says why).
pub(crate) fn readable_now(fd: BorrowedFd<'_>) -> bool {
    let mut probe = [0u8; 1];
    !matches!(
        rustix::net::recv(fd, &mut probe, RecvFlags::PEEK | RecvFlags::DONTWAIT),
        Err(Errno::AGAIN)
    )
}

/// Connects and performs the HELLO handshake (receiving and mapping the segment fds); with
/// `shared`, also maps the store's shared directory and this connection's hold table (SHARED).
pub(crate) fn handshake(path: &Path, shared: bool) -> Result<(UnixStream, Mappings), Error> {
    let stream = UnixStream::connect(path)
        .map_err(|e| Error::Connection(format!("cannot connect to {}: {e}", path.display())))?;
    let mut hello = Vec::new();
    Request::Hello {
        pid: std::process::id(),
    }
    .encode(0, 0, &mut hello);
    // A daemon that refuses our uid closes at once: say so, whichever way the close shows up.
    let refused = |e: Error| {
        Error::Connection(format!(
            "the daemon closed the connection during the handshake ({e}); is this uid allowed \
             (vovp-engine --allow-uid)?"
        ))
    };
    // A daemon that refuses us (too many connections) may have answered and closed before our
    // HELLO went out: read its reply even when the write failed; it says why.
    let sent = write_all(stream.as_fd(), &hello);
    let (frame, fds) = match read_frame_with_fds(stream.as_fd()) {
        Ok(got) => got,
        Err(e) => return Err(refused(sent.err().unwrap_or(e))),
    };
    let request = Request::Hello { pid: 0 };
    match Reply::decode_for(&request, &frame[HEADER_LEN..])? {
        Reply::Hello {
            capacity,
            max_inline,
            segments,
        } => {
            let mut maps = Mappings::from_hello(capacity, max_inline, segments, fds)?;
            if shared {
                maps.shared = attach_shared(stream.as_fd())?.map(std::sync::Arc::new);
            }
            Ok((stream, maps))
        }
        Reply::Failure(f) => Err(f.into()),
        other => Err(crate::core::unexpected(&other)),
    }
}

/// SHARED, right after HELLO (request id 0, before any numbered request): the directory and
/// the hold table mapped, or `None` when the store does not publish or they cannot be mapped
/// here (then every get is a message, which is always correct).
fn attach_shared(fd: BorrowedFd<'_>) -> Result<Option<vovp_shm::SharedReader>, Error> {
    let mut frame = Vec::new();
    Request::Shared.encode(0, 0, &mut frame);
    write_all(fd, &frame)?;
    let (frame, fds) = read_frame_with_fds(fd)?;
    match Reply::decode_for(&Request::Shared, &frame[HEADER_LEN..])? {
        Reply::Shared { published: true } => match crate::shared::map(fds) {
            Ok(s) => Ok(Some(s)),
            Err(e) => {
                tracing::warn!("vovp: not using the shared directory: {e}");
                Ok(None)
            }
        },
        Reply::Shared { published: false } | Reply::Failure(_) => Ok(None),
        other => Err(crate::core::unexpected(&other)),
    }
}
