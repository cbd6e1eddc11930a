//! One connection's socket: the io_uring read/write loop that cuts frames, hands each request
//! to the connection's actor and writes the replies (those carrying fds through `sendmsg`),
//! the read deadlines, and noticing a client that went away. It counts what it sees for the
//! metrics ([`ServerCounters`]: each request's latency by opcode, error replies, bytes).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kameo::actor::{ActorRef, Spawn};
use vovp::{EngineHandle, Session};
use vovp_proto::{Header, Reply, Request, Status, FLAG_NO_REPLY, HEADER_LEN};

use crate::metrics::ServerCounters;

use super::actor::{ConnectionActor, Disconnect, Incoming, SegmentFds};
use super::notify::notify_loop;
use super::{ConnectionLimits, Shared};
use crate::response::{Response, TransportError};

const READ_CHUNK: usize = 256 * 1024;

/// Input buffers above this size are given back once the big frame that grew them is done, so
/// idle connections that once sent a large frame do not pin it.
const KEPT_BUFFER: usize = 2 * READ_CHUNK;

/// Serves one connection until it ends; `pid`: its client's (0 if unknown), for the metrics.
pub(super) async fn serve_connection(
    stream: StdUnixStream,
    pid: i32,
    engine: EngineHandle,
    shared: Arc<Shared>,
    limits: &ConnectionLimits,
) -> Result<(), TransportError> {
    // Non-blocking: io_uring does not care, and the raw sendmsg of HELLO's fds must never
    // block the event loop (it waits for writability there instead).
    stream.set_nonblocking(true)?;
    // A client of the daemon's own uid (`--allow-uid` lets others in).
    let own_uid = rustix::net::sockopt::socket_peercred(&stream)
        .is_ok_and(|c| c.uid == rustix::process::getuid());
    let stream = tokio_uring::net::UnixStream::from_std(stream);
    // The connection's holder: every reference it takes is recorded under it.
    let session = engine.client_session();
    shared.pids().insert(session.holder(), pid);
    let counters = shared.clone();
    let conn = ConnectionActor::spawn(ConnectionActor::new(session.clone(), shared, own_uid));
    let io = ConnIo {
        stream: &stream,
        limits,
        peer_closed: std::cell::Cell::new(false),
        half_closed: &counters.half_closed,
        counters: &counters.counters,
    };
    let result = connection_loop(&io, &conn, &session).await;
    // Whatever the reason the connection ended, everything it held goes back.
    let _ = conn.ask(Disconnect).await;
    let _ = conn.stop_gracefully().await;
    counters.pids().remove(&session.holder());
    result
}

/// The socket of one connection and its limits.
pub(super) struct ConnIo<'a> {
    pub(super) stream: &'a tokio_uring::net::UnixStream,
    limits: &'a ConnectionLimits,
    /// The peer closed its socket while requests of it were still to be read: they are still
    /// carried out (a put sent without waiting must not be lost because its client exited
    /// right after), their replies dropped.
    peer_closed: std::cell::Cell<bool>,
    /// The daemon's count of half-closed connections (STATS `half_closed`).
    half_closed: &'a AtomicU64,
    /// The daemon's request, error and byte counters.
    pub(super) counters: &'a ServerCounters,
}

impl ConnIo<'_> {
    /// The socket as a plain fd, for what io_uring's stream lacks (SCM_RIGHTS, polls).
    /// Borrowed, not dup'd: a connection costs one fd, so more connections fit the fd limit.
    fn raw(&self) -> BorrowedFd<'_> {
        // SAFETY: the stream owns this fd and outlives the borrow.
        unsafe { BorrowedFd::borrow_raw(self.stream.as_raw_fd()) }
    }

    /// Writes `out` whole within the write timeout; gives the buffer back cleared.
    pub(super) async fn flush(&self, mut out: Vec<u8>) -> (Result<(), TransportError>, Vec<u8>) {
        if out.is_empty() || self.peer_closed.get() {
            out.clear();
            return (Ok(()), out);
        }
        self.counters.sent(out.len());
        match tokio::time::timeout(self.limits.write_timeout, self.stream.write_all(out)).await {
            Ok((res, mut back)) => {
                back.clear();
                // Closed, not merely shut for reading (which keeps the write timeout's
                // backpressure): carry on without replies.
                let gone = res.as_ref().err().and_then(std::io::Error::raw_os_error);
                if matches!(gone, Some(libc::EPIPE | libc::ECONNRESET)) && peer_hung_up(self.raw())
                {
                    self.peer_closed.set(true);
                    return (Ok(()), back);
                }
                (res.map_err(TransportError::from), back)
            }
            Err(_) => (Err(self.stalled()), Vec::new()),
        }
    }

    fn stalled(&self) -> TransportError {
        TransportError::Setup(format!(
            "the client left its replies unread for {:?}; disconnected",
            self.limits.write_timeout
        ))
    }

    /// Best effort: an error reply before closing (never waits long for a peer that does not
    /// read).
    async fn last_words(&self, status: Status, message: String) {
        let mut out = Vec::new();
        Response::error(status, message).encode(0, 0, &mut out);
        self.counters.error(status);
        self.counters.sent(out.len());
        let _ = tokio::time::timeout(Duration::from_secs(1), self.stream.write_all(out)).await;
    }
}

async fn connection_loop(
    io: &ConnIo<'_>,
    conn: &ActorRef<ConnectionActor>,
    session: &Session,
) -> Result<(), TransportError> {
    let stream = io.stream;
    let connected = tokio::time::Instant::now();
    let mut greeted = false;
    // When the first byte of the frame now incomplete in `inbuf` arrived.
    let mut partial_since: Option<tokio::time::Instant> = None;
    let mut inbuf: Vec<u8> = Vec::with_capacity(READ_CHUNK);
    let mut rbuf: Vec<u8> = Vec::with_capacity(READ_CHUNK);
    let mut out: Vec<u8> = Vec::with_capacity(4096);
    loop {
        let mut consumed = 0;
        loop {
            let header = match Header::parse(&inbuf[consumed..]) {
                Ok(Some(h)) => h,
                Ok(None) => break,
                Err(e) => {
                    // The stream cannot be resynchronised: say why, then close.
                    let _ = io.flush(out).await;
                    io.last_words(e.status(), e.to_string()).await;
                    return Err(e.into());
                }
            };
            if inbuf.len() - consumed < header.frame_len() {
                break;
            }
            let payload = &inbuf[consumed + HEADER_LEN..consumed + header.frame_len()];
            consumed += header.frame_len();
            let started = std::time::Instant::now();
            let response = respond(io, conn, session, header, payload).await?;
            io.counters
                .answered(header.opcode, started.elapsed(), failed(&response));
            match deliver(io, conn, header, response, &mut out).await? {
                Delivered::Queued => {}
                Delivered::Greeted => greeted = true,
                Delivered::Subscribed(rx) => {
                    let (res, back) = io.flush(out).await;
                    res?;
                    return notify_loop(io, rx, back).await;
                }
            }
        }
        inbuf.drain(..consumed);
        if inbuf.capacity() > KEPT_BUFFER && inbuf.len() < READ_CHUNK {
            inbuf.shrink_to(READ_CHUNK);
        }
        if out.capacity() > KEPT_BUFFER {
            out.shrink_to(4096);
        }
        partial_since = match (inbuf.is_empty(), consumed > 0) {
            (true, _) => None,
            // What is left is the start of a new frame.
            (false, true) => Some(tokio::time::Instant::now()),
            (false, false) => partial_since.or_else(|| Some(tokio::time::Instant::now())),
        };
        let deadline = [
            (!greeted).then(|| (connected + io.limits.handshake_timeout, Deadline::Handshake)),
            partial_since.map(|t| (t + io.limits.frame_timeout, Deadline::Frame)),
        ]
        .into_iter()
        .flatten()
        .min_by_key(|d| d.0);
        rbuf.clear();
        // The replies and the next read go to the kernel together (one io_uring_enter):
        // waiting for the write before submitting the read costs a context switch per request.
        let read = async {
            match deadline {
                None => Ok(stream.read(rbuf).await),
                Some((at, why)) => tokio::time::timeout_at(at, stream.read(rbuf))
                    .await
                    .map_err(|_| LoopStop::Deadline(why)),
            }
        };
        let write = async {
            let (res, back) = io.flush(out).await;
            res.map(|()| back).map_err(LoopStop::Write)
        };
        // A write that fails or stalls ends the connection even while the read still waits
        // (try_join drops the read), and a read deadline ends it even while the write waits.
        let (back, (res, back_r)) = match tokio::try_join!(write, read) {
            Ok(both) => both,
            Err(LoopStop::Write(e)) => return Err(e),
            Err(LoopStop::Deadline(why)) => {
                let message = why.message(io.limits);
                io.last_words(Status::ProtocolState, message.clone()).await;
                return Err(TransportError::Setup(message));
            }
        };
        out = back;
        rbuf = back_r;
        match res {
            // The peer shut down its sending side. Only a closed connection is a dead peer: a
            // half-closed one may still read replies and still holds its references.
            Ok(0) => {
                // Counted once this end was read: a test sees that the daemon knows before it
                // checks that the references stayed.
                io.half_closed.fetch_add(1, Ordering::Relaxed);
                let hung_up = wait_for_hangup(io.raw()).await;
                io.half_closed.fetch_sub(1, Ordering::Relaxed);
                return hung_up;
            }
            Ok(n) => {
                io.counters.received(n);
                inbuf.extend_from_slice(&rbuf);
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// The response to one frame: its request decoded, checked and answered by the connection's
/// actor. An error here (the store stopping) ends the connection.
async fn respond(
    io: &ConnIo<'_>,
    conn: &ActorRef<ConnectionActor>,
    session: &Session,
    header: Header,
    payload: &[u8],
) -> Result<Response, TransportError> {
    let no_reply = header.flags & FLAG_NO_REPLY != 0;
    Ok(
        match Request::decode(header.opcode, payload).map(Request::into_owned) {
            // A silenced error is a lost error: NO_REPLY is for RELEASE only, and refused (with
            // a reply) anywhere else.
            Ok(ref request) if no_reply && !matches!(request, Request::Release { .. }) => {
                Response::error(
                    Status::Malformed,
                    "the NO_REPLY flag is only allowed on RELEASE",
                )
            }
            // One-way releases are told, not asked: nothing waits for them, and the mailboxes'
            // FIFO order still puts them before the next request's work.
            Ok(request @ Request::Release { .. }) if no_reply => {
                // Waits only when the mailbox is full: backpressure on release floods.
                conn.tell(Incoming { request, no_reply })
                    .send()
                    .await
                    .map_err(|_| TransportError::Setup("store stopping".into()))?;
                Response::NoReply
            }
            Ok(request) => answer(conn, Incoming { request, no_reply }, io, session).await,
            Err(e) => Response::error(e.status(), e.to_string()),
        },
    )
}

/// The status of an error reply, for the error counters.
fn failed(response: &Response) -> Option<Status> {
    match response {
        Response::Reply(Reply::Failure(f)) => Some(f.status),
        _ => None,
    }
}

/// What delivering one response did to the connection.
enum Delivered {
    /// Encoded into the output buffer (written with the next read), or sent.
    Queued,
    /// HELLO's reply went out: the handshake deadline no longer applies.
    Greeted,
    /// SUBSCRIBE's reply is queued: the connection becomes a notification stream.
    Subscribed(tokio::sync::mpsc::Receiver<vovp::Notification>),
}

/// Writes one response. Most are encoded into `out`; those that carry fds (HELLO's, SEGMENT's,
/// SHARED's) first flush `out`, keeping the replies in order, then go out through `sendmsg`.
async fn deliver(
    io: &ConnIo<'_>,
    conn: &ActorRef<ConnectionActor>,
    header: Header,
    response: Response,
    out: &mut Vec<u8>,
) -> Result<Delivered, TransportError> {
    let carries_fds = matches!(
        response,
        Response::Reply(Reply::Hello { .. }) | Response::Segment { .. } | Response::Shared(_)
    );
    if carries_fds {
        let (res, back) = io.flush(std::mem::take(out)).await;
        *out = back;
        res?;
    }
    let mut reply = Vec::new();
    match response {
        Response::Reply(Reply::Hello { .. }) => {
            response.encode(header.opcode, header.request_id, &mut reply);
            send_hello(io, conn, reply).await?;
            return Ok(Delivered::Greeted);
        }
        Response::Segment {
            ref segment,
            writable,
        } => {
            let fd = if writable {
                segment.fd()
            } else {
                segment.read_only_fd()
            };
            response.encode(header.opcode, header.request_id, &mut reply);
            send_with_fd(io, reply, &[fd]).await?;
        }
        Response::Shared(ref fds) => {
            response.encode(header.opcode, header.request_id, &mut reply);
            match fds {
                Some(f) => send_with_fd(io, reply, &[f.directory.as_fd(), f.holds.as_fd()]).await?,
                None => send_with_fd(io, reply, &[]).await?,
            }
        }
        Response::Subscribed(rx) => {
            Reply::Empty.encode(header.opcode, header.request_id, out);
            return Ok(Delivered::Subscribed(rx));
        }
        other => other.encode(header.opcode, header.request_id, out),
    }
    Ok(Delivered::Queued)
}

/// Why one turn of the connection loop ends the connection.
enum LoopStop {
    Write(TransportError),
    Deadline(Deadline),
}

/// Which read deadline fired.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Deadline {
    Handshake,
    Frame,
}

impl Deadline {
    fn message(self, limits: &ConnectionLimits) -> String {
        match self {
            Deadline::Handshake => format!(
                "no HELLO within {:?} of connecting; closing",
                limits.handshake_timeout
            ),
            Deadline::Frame => format!(
                "a frame stayed incomplete for {:?}; closing",
                limits.frame_timeout
            ),
        }
    }
}

/// How often a long request (a GET waiting for a seal) checks that its client is still there.
const LIVENESS_CHECK: Duration = Duration::from_millis(100);

/// Asks the connection actor and waits for its response. While a request waits (a GET with a
/// timeout), the loop does not read the socket, so it would not notice the client dying: every
/// `LIVENESS_CHECK` it looks at the socket, and once the peer has closed it releases everything
/// the session held at once (which also cancels the waiting GET) instead of when the wait ends.
async fn answer(
    conn: &ActorRef<ConnectionActor>,
    incoming: Incoming,
    io: &ConnIo<'_>,
    session: &Session,
) -> Response {
    let stopping = |_| Response::error(Status::ShuttingDown, "store stopping");
    // Only a GET with a timeout can wait; every other request is answered at once and needs no
    // timer on the hot path.
    let may_wait = matches!(
        &incoming.request,
        Request::Get { timeout_ms, .. } | Request::GetNewer { timeout_ms, .. } if *timeout_ms != 0
    );
    if !may_wait {
        return conn.ask(incoming).await.unwrap_or_else(stopping);
    }
    let ask = conn.ask(incoming).send();
    tokio::pin!(ask);
    let mut released = false;
    loop {
        tokio::select! {
            r = &mut ask => {
                return r.unwrap_or_else(stopping);
            }
            _ = tokio::time::sleep(LIVENESS_CHECK), if !released => {
                if peer_hung_up(io.raw()) {
                    released = true;
                    session.release_all();
                }
            }
        }
    }
}

/// True when the peer has closed the connection: both directions (POLLHUP) or with an error.
/// A peer that only shut down its writing side (`shutdown(SHUT_WR)`: POLLRDHUP without
/// POLLHUP) is alive and still reads its replies.
fn peer_hung_up(raw: BorrowedFd<'_>) -> bool {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut fds = [PollFd::new(&raw, PollFlags::empty())];
    match poll(&mut fds, Some(&rustix::event::Timespec::default())) {
        Ok(_) => fds[0]
            .revents()
            .intersects(PollFlags::HUP | PollFlags::ERR | PollFlags::NVAL),
        Err(rustix::io::Errno::INTR) => false,
        Err(_) => true,
    }
}

/// After the peer shut down its writing side: keep its references until it closes the
/// connection entirely (it may still be using the objects it got).
async fn wait_for_hangup(raw: BorrowedFd<'_>) -> Result<(), TransportError> {
    while !peer_hung_up(raw) {
        tokio::time::sleep(LIVENESS_CHECK).await;
    }
    Ok(())
}

/// Sends HELLO's reply with segment 0's fd attached: every client may read the store's own
/// segment; none may write it (the store copies inline puts in itself) unless the store has
/// no client arenas (`--prefault`), where every object lives there and its creator writes it
/// (read-write for clients of the daemon's own uid, as Plasma's store was; see `SegmentFds`).
/// The client tells by the fd's access mode.
async fn send_hello(
    io: &ConnIo<'_>,
    conn: &ActorRef<ConnectionActor>,
    reply: Vec<u8>,
) -> Result<(), TransportError> {
    let (segments, writable) = conn
        .ask(SegmentFds)
        .await
        .map_err(|_| TransportError::Setup("store stopping".into()))?;
    let fds: Vec<_> = segments
        .iter()
        .map(|s| if writable { s.fd() } else { s.read_only_fd() })
        .collect();
    send_with_fd(io, reply, &fds).await
}

/// Sends a reply with fds attached (SCM_RIGHTS through a raw `sendmsg`, which tokio-uring
/// lacks). The socket is non-blocking: while its buffer is full (a client that pipelined
/// requests and reads nothing), this waits for writability on the event loop, up to the write
/// timeout, instead of blocking the daemon's one thread.
async fn send_with_fd(
    io: &ConnIo<'_>,
    reply: Vec<u8>,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> Result<(), TransportError> {
    let sent = match vovp_shm::fdpass::send_with_fds(io.raw(), &reply, fds) {
        Ok(n) => n,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
            // SAFETY: the AsyncFd owns its own dup of the socket, open for its whole life.
            let waiter = unsafe {
                tokio::io::unix::AsyncFd::register_with_interest(
                    io.raw().try_clone_to_owned()?,
                    tokio::io::Interest::WRITABLE,
                )
            }
            .map_err(|e| TransportError::Io(e.into()))?;
            let send = async {
                loop {
                    let mut ready = waiter.writable().await?;
                    match ready
                        .try_io(|fd| vovp_shm::fdpass::send_with_fds(fd.as_fd(), &reply, fds))
                    {
                        Ok(res) => return res,
                        Err(_would_block) => continue,
                    }
                }
            };
            tokio::time::timeout(io.limits.write_timeout, send)
                .await
                .map_err(|_| io.stalled())??
        }
        Err(e) => return Err(e.into()),
    };
    io.counters.sent(sent);
    if sent < reply.len() {
        let rest = reply[sent..].to_vec();
        let (res, _) = io.flush(rest).await;
        res?;
    }
    Ok(())
}
