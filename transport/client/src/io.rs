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

/// How long a blocking call polls for its reply before sleeping in `recv`. A small request is
/// answered in a few microseconds of daemon work, but waking a sleeping reader on another CPU
/// costs tens of microseconds on virtual machines (measured 45-65 µs here, vovp-bench "machine
/// limits"); polling skips that wake-up. `sched_yield` between polls keeps them from starving
/// the daemon when both share a CPU.
const REPLY_SPIN: Duration = Duration::from_micros(50);

/// Replies read ahead, for a connection with pipelined requests: one `recv` takes whatever has
/// arrived (many replies of pipelined puts in one system call, where reading each header and
/// payload exactly cost two, and asking whether one had come a third), and frames are parsed
/// out of the buffer. Never for a reply that carries fds (HELLO, SHARED, SEGMENT: a plain
/// `recv` would drop them): those are asked for only when nothing is owed, so nothing is read
/// ahead of them ([`ReadAhead::is_empty`] says so).
pub(crate) struct ReadAhead {
    /// Received bytes are `buf[start..end]`; `buf` keeps its length (zeroed once, grown only
    /// for a frame larger than it).
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

/// Bytes one `recv` may take at most, unless a larger frame is being read.
const READ_AHEAD: usize = 64 << 10;

impl ReadAhead {
    pub(crate) fn new() -> Self {
        ReadAhead {
            buf: Vec::new(),
            start: 0,
            end: 0,
        }
    }

    /// Whether nothing received is left unparsed.
    pub(crate) fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Forgets what was received (a new stream).
    pub(crate) fn clear(&mut self) {
        (self.start, self.end) = (0, 0);
    }

    /// The header of the whole frame at the front, if it has arrived whole.
    fn whole(&self) -> Result<Option<Header>, Error> {
        let got = &self.buf[self.start..self.end];
        Ok(Header::parse(got)?.filter(|h| got.len() >= h.frame_len()))
    }

    /// Whether a whole frame has arrived, reading what has without waiting.
    pub(crate) fn frame_arrived(&mut self, fd: BorrowedFd<'_>) -> Result<bool, Error> {
        if self.whole()?.is_some() {
            return Ok(true);
        }
        self.fill(fd, false)?;
        Ok(self.whole()?.is_some())
    }

    /// Waits for the next frame (on a blocking socket) and hands its header and payload to
    /// `parse`. Polls (yielding the CPU) for [`REPLY_SPIN`] before it sleeps in `recv`. A read
    /// timeout on the socket (`SO_RCVTIMEO`) ends the wait with an error.
    pub(crate) fn next_frame<R>(
        &mut self,
        fd: BorrowedFd<'_>,
        parse: impl FnOnce(&Header, &[u8]) -> R,
    ) -> Result<R, Error> {
        let began = Instant::now();
        loop {
            if let Some(h) = self.whole()? {
                let frame = &self.buf[self.start..self.start + h.frame_len()];
                let parsed = parse(&h, &frame[HEADER_LEN..]);
                self.start += h.frame_len();
                if self.is_empty() {
                    self.clear();
                    if self.buf.len() > 16 * READ_AHEAD {
                        self.buf = Vec::new(); // after a rare large reply (a LIST page)
                    }
                }
                return Ok(parsed);
            }
            let spinning = began.elapsed() < REPLY_SPIN;
            if !self.fill(fd, !spinning)? && spinning {
                rustix::thread::sched_yield();
            }
        }
    }

    /// One `recv` into the buffer (`wait`: block until something arrives); whether anything
    /// came.
    fn fill(&mut self, fd: BorrowedFd<'_>, wait: bool) -> Result<bool, Error> {
        // Room at the back: the unparsed bytes moved to the front, and the buffer grown to
        // hold the frame being read whole (or one read-ahead chunk).
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        let frame = Header::parse(&self.buf[..self.end])?.map_or(0, |h| h.frame_len());
        let want = frame.max(self.end + READ_AHEAD);
        if self.buf.len() < want {
            self.buf.resize(want, 0);
        }
        let flags = if wait {
            RecvFlags::empty()
        } else {
            RecvFlags::DONTWAIT
        };
        loop {
            match rustix::net::recv(fd, &mut self.buf[self.end..], flags) {
                Ok((0, _)) => return Err(conn_err(std::io::ErrorKind::UnexpectedEof.into())),
                Ok((n, _)) => {
                    self.end += n;
                    return Ok(true);
                }
                Err(Errno::AGAIN) if !wait => return Ok(false),
                Err(Errno::AGAIN) => {
                    return Err(Error::Connection(
                        "no reply from the daemon within the socket's read timeout".into(),
                    ))
                }
                Err(Errno::INTR) => {}
                Err(e) => return Err(errno_err(e)),
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A reply frame of `n` payload bytes of value `id as u8`, as request `id`'s.
    fn frame(id: u64, n: usize) -> Vec<u8> {
        let mut buf = Vec::new();
        let mut w = vovp_proto::FrameWriter::begin(&mut buf, 0x85, 0, id);
        w.raw(&vec![id as u8; n]);
        w.finish();
        buf
    }

    #[test]
    fn read_ahead_parses_many_replies_from_one_recv_and_waits_for_split_ones() {
        let (mut daemon, client) = UnixStream::pair().unwrap();
        let mut input = ReadAhead::new();
        let fd = client.as_fd();
        assert!(!input.frame_arrived(fd).unwrap(), "nothing yet");
        // Three replies at once, then one that comes in two parts, then one larger than a
        // read-ahead chunk.
        let mut bytes: Vec<u8> = [frame(1, 5), frame(2, 0), frame(3, 70)].concat();
        let split = frame(4, 100);
        bytes.extend_from_slice(&split[..20]);
        std::io::Write::write_all(&mut daemon, &bytes).unwrap();
        let read = |input: &mut ReadAhead| {
            input
                .next_frame(fd, |h, p| (h.request_id, p.to_vec()))
                .unwrap()
        };
        for (id, n) in [(1, 5), (2, 0), (3, 70)] {
            assert!(input.frame_arrived(fd).unwrap());
            assert_eq!(read(&mut input), (id, vec![id as u8; n]));
        }
        assert!(
            !input.frame_arrived(fd).unwrap(),
            "only a part of the fourth"
        );
        let rest = split[20..].to_vec();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20)); // past the poll: `recv` waits
            std::io::Write::write_all(&mut daemon, &rest).unwrap();
            std::io::Write::write_all(&mut daemon, &frame(5, 3 * READ_AHEAD)).unwrap();
            daemon
        });
        assert_eq!(read(&mut input), (4, vec![4; 100]));
        assert_eq!(read(&mut input), (5, vec![5; 3 * READ_AHEAD]));
        assert!(input.is_empty());
        // The stream ends inside a frame: an error naming the closed connection.
        let mut daemon = writer.join().unwrap();
        std::io::Write::write_all(&mut daemon, &frame(6, 10)[..12]).unwrap();
        drop(daemon);
        let e = input.next_frame(fd, |_, _| ()).unwrap_err();
        assert!(e.to_string().contains("closed the connection"), "{e}");
    }

    #[test]
    fn a_read_timeout_ends_the_wait_with_an_error() {
        let (_daemon, client) = UnixStream::pair().unwrap();
        client
            .set_read_timeout(Some(Duration::from_millis(10)))
            .unwrap();
        let mut input = ReadAhead::new();
        let e = input.next_frame(client.as_fd(), |_, _| ()).unwrap_err();
        assert!(e.to_string().contains("read timeout"), "{e}");
    }
}
