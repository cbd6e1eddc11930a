//! The holder's side: the transfer port. A thread accepts TCP connections and hands each to a
//! transfer thread, which serves one stream: it checks the stream's ticket (MAC, expiry,
//! stream number, first use of its nonce and stream), takes a reference to the object the
//! ticket names at the version it names (through a session of its own, released when the
//! stream ends), and sends the asked bytes straight from the store's memory.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;
use tokio_uring::net::TcpStream;
use vovp::Location;
use vovp_proto::transfer::{Ask, Go, Header, Open, Ticket, TransferKey, MAC_LEN, NONCE_LEN};

use super::io::{read_message, write_all_from, ObjectBytes};
use super::pool::Pool;
use super::{Counter, Counters};
use vovp::transfer::MAX_TICKET_LIFE;

/// Rows gathered into one send at a time.
const ROWS_CHUNK: usize = 4 << 20;

/// What serving a stream needs.
#[derive(Debug)]
pub(crate) struct Holder {
    pub(crate) engine: vovp::EngineHandle,
    pub(crate) key: TransferKey,
    pub(crate) counters: Arc<Counters>,
    /// A peer that leaves a send unread this long is dropped.
    pub(crate) idle: Duration,
    /// How long a peer has to send its OPEN and its ASK.
    pub(crate) handshake: Duration,
    claims: Claims,
}

impl Holder {
    pub(crate) fn new(
        engine: vovp::EngineHandle,
        key: TransferKey,
        counters: Arc<Counters>,
        idle: Duration,
        handshake: Duration,
    ) -> Holder {
        Holder {
            engine,
            key,
            counters,
            idle,
            handshake,
            claims: Claims::default(),
        }
    }
}

/// Unix time in milliseconds.
pub(crate) fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The (nonce, stream) pairs served, each kept until its ticket expires.
#[derive(Debug, Default)]
struct Claims {
    used: Mutex<HashMap<([u8; NONCE_LEN], u16), u64>>,
}

impl Claims {
    /// Claims `stream` of the ticket with `nonce` (valid until `expires`): false if it was
    /// claimed before.
    fn claim(&self, nonce: [u8; NONCE_LEN], stream: u16, expires: u64, now: u64) -> bool {
        let Ok(mut used) = self.used.lock() else {
            return false;
        };
        if used.len() >= 4096 {
            used.retain(|_, until| *until >= now);
        }
        used.insert((nonce, stream), expires).is_none()
    }
}

/// Why a stream is refused: the counter it bumps and what the peer is told.
struct Refusal(Counter, String);

/// Whether `ticket` (with `mac`) lets its bearer open `stream` now.
fn admit(h: &Holder, ticket: &Ticket, mac: &[u8; MAC_LEN], stream: u16) -> Result<(), Refusal> {
    // The MAC first: nothing of a forged ticket is remembered.
    if !ticket.verify(&h.key, mac) {
        return Err(Refusal(
            Counter::RefusedBadMac,
            "the ticket's MAC does not check (forged, altered, or minted with another key)".into(),
        ));
    }
    let now = now_unix_ms();
    if ticket.expires_unix_ms < now {
        return Err(Refusal(
            Counter::RefusedExpired,
            format!("the ticket expired {} ms ago", now - ticket.expires_unix_ms),
        ));
    }
    let life = u64::try_from(MAX_TICKET_LIFE.as_millis()).unwrap_or(u64::MAX);
    if ticket.expires_unix_ms - now > life {
        return Err(Refusal(
            Counter::RefusedMalformed,
            format!("the ticket expires more than {life} ms from now (clocks apart?)"),
        ));
    }
    if stream >= ticket.streams {
        return Err(Refusal(
            Counter::RefusedMalformed,
            format!("stream {stream} of a ticket for {} streams", ticket.streams),
        ));
    }
    if !h
        .claims
        .claim(ticket.nonce, stream, ticket.expires_unix_ms, now)
    {
        return Err(Refusal(
            Counter::RefusedReplayed,
            format!("stream {stream} of this ticket was served already (a replay)"),
        ));
    }
    Ok(())
}

/// Binds the transfer port and serves it from a thread of its own, each stream on `pool`.
/// Returns the address bound (the port the kernel chose for port 0).
pub(crate) fn listen(
    addr: SocketAddr,
    holder: Arc<Holder>,
    pool: Arc<Pool>,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let bound = listener.local_addr()?;
    std::thread::Builder::new()
        .name("vovp-transfer-accept".into())
        .spawn(move || accept_loop(listener, holder, pool))?;
    Ok(bound)
}

fn accept_loop(listener: TcpListener, holder: Arc<Holder>, pool: Arc<Pool>) {
    let mut backoff = Duration::from_millis(10);
    loop {
        match listener.accept() {
            Ok((stream, peer)) => {
                backoff = Duration::from_millis(10);
                let _ = stream.set_nodelay(true);
                let holder = holder.clone();
                // Nobody waits for the outcome: the stream's own task counts and logs it.
                drop(pool.run(move || serve(stream, peer, holder)));
            }
            Err(e) => {
                // Out of fds and the like: keep the connection in the backlog and retry.
                tracing::warn!("transfer port: accept failed: {e}");
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

async fn serve(stream: std::net::TcpStream, peer: SocketAddr, h: Arc<Holder>) {
    let stream = TcpStream::from_std(stream);
    match serve_stream(&stream, &h).await {
        Ok(bytes) => {
            h.counters.add(Counter::StreamsServed, 1);
            h.counters.add(Counter::BytesServed, bytes);
        }
        Err(e) => {
            h.counters.add(Counter::StreamsDropped, 1);
            tracing::debug!(%peer, "transfer stream ended: {e}");
        }
    }
}

/// One stream: OPEN, HEADER, ASK, GO, the bytes. Returns the bytes sent.
async fn serve_stream(stream: &TcpStream, h: &Holder) -> Result<u64, String> {
    let deadline = Instant::now() + h.handshake;
    let io = |e: std::io::Error| e.to_string();
    let open = read_message(stream, deadline).await.map_err(io)?;
    let open = match Open::decode(&open) {
        Ok(o) => o,
        Err(e) => {
            return refuse(stream, h, Refusal(Counter::RefusedMalformed, e.to_string())).await;
        }
    };
    if let Err(why) = admit(h, &open.ticket, &open.mac, open.stream) {
        return refuse(stream, h, why).await;
    }
    let ticket = &open.ticket;
    // A session of this stream's own: its reference goes when the stream ends, whatever way.
    let session = h.engine.client_session();
    let held = session
        .get(&[ticket.name.as_str()], None)
        .await
        .map_err(|e| e.to_string())?
        .pop()
        .flatten();
    let object = match held {
        Some(r) if r.version == ticket.version => r,
        other => {
            let present = other.map_or("none".to_string(), |r| r.version.to_string());
            let why = format!(
                "{}@{} is not held here (present version: {present})",
                ticket.name, ticket.version
            );
            return refuse(stream, h, Refusal(Counter::RefusedNotHeld, why)).await;
        }
    };
    let Location::Host { segment, offset } = object.location else {
        let why = format!(
            "{} is a CUDA object: transfers are of host objects",
            ticket.name
        );
        return refuse(stream, h, Refusal(Counter::RefusedNotHeld, why)).await;
    };
    let segment = session
        .segment(segment)
        .await
        .map_err(|e| e.to_string())?
        .segment;
    let header = Header::Object {
        size: object.size,
        version: object.version,
        metadata: object.metadata.to_vec(),
    };
    write_all_from(stream, header.encode(), h.idle)
        .await
        .map_err(io)?;
    let ask = read_message(stream, deadline).await.map_err(io)?;
    let ask = match Ask::decode(&ask) {
        Ok(a) => a,
        Err(e) => {
            let go = Go::Refused(format!("a bad ASK: {e}")).encode();
            let _ = write_all_from(stream, go, h.idle).await;
            return Err(e.to_string());
        }
    };
    if let Err(why) = check_ask(&ask, object.size) {
        let _ = write_all_from(stream, Go::Refused(why.clone()).encode(), h.idle).await;
        return Err(why);
    }
    let total = ask.bytes();
    write_all_from(stream, Go::Bytes(total).encode(), h.idle)
        .await
        .map_err(io)?;
    let bytes = |at: u64, len: u64| {
        ObjectBytes::new(&segment, offset + at, len)
            .ok_or_else(|| "object outside its segment".to_string())
    };
    match ask {
        Ask::Ranges(ranges) => {
            for (at, len) in ranges {
                if len > 0 {
                    write_all_from(stream, bytes(at, len)?, h.idle)
                        .await
                        .map_err(io)?;
                }
            }
        }
        Ask::Rows { row_bytes, ids } => {
            send_rows(stream, h, &segment, offset, row_bytes, &ids).await?;
        }
    }
    drop(session);
    Ok(total)
}

/// Rows `ids` of the object at `offset` of `segment`: batched through a buffer when small,
/// straight from the object when a row is large.
async fn send_rows(
    stream: &TcpStream,
    h: &Holder,
    segment: &Arc<vovp::Segment>,
    offset: u64,
    row_bytes: u64,
    ids: &[u64],
) -> Result<(), String> {
    let io = |e: std::io::Error| e.to_string();
    let row = usize::try_from(row_bytes).map_err(|_| "row too large".to_string())?;
    if row == 0 {
        return Ok(());
    }
    if row >= ROWS_CHUNK {
        for id in ids {
            let bytes = ObjectBytes::new(segment, offset + id * row_bytes, row_bytes)
                .ok_or_else(|| "row outside its segment".to_string())?;
            write_all_from(stream, bytes, h.idle).await.map_err(io)?;
        }
        return Ok(());
    }
    let per_chunk = (ROWS_CHUNK / row).max(1);
    for chunk in ids.chunks(per_chunk) {
        let mut buf = Vec::with_capacity(chunk.len() * row);
        for id in chunk {
            let src = segment
                .ptr(offset + id * row_bytes, row_bytes)
                .ok_or_else(|| "row outside its segment".to_string())?;
            // SAFETY: `src` is `row` bytes of a sealed object this stream holds (checked in
            // its segment by `ptr`); sealed bytes never change.
            buf.extend_from_slice(unsafe { std::slice::from_raw_parts(src, row) });
        }
        write_all_from(stream, buf, h.idle).await.map_err(io)?;
    }
    Ok(())
}

/// Whether an ASK stays inside an object of `size` bytes.
fn check_ask(ask: &Ask, size: u64) -> Result<(), String> {
    match ask {
        Ask::Ranges(ranges) => {
            for &(at, len) in ranges {
                if at.checked_add(len).is_none_or(|end| end > size) {
                    return Err(format!(
                        "range {at}+{len} is past the object's {size} bytes"
                    ));
                }
            }
        }
        Ask::Rows { row_bytes, ids } => {
            for &id in ids {
                let end = id.checked_add(1).and_then(|n| n.checked_mul(*row_bytes));
                if end.is_none_or(|end| end > size) {
                    return Err(format!(
                        "row {id} of {row_bytes} bytes is past the object's {size} bytes"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Tells the peer why (in place of the HEADER), counts it, and ends the stream.
async fn refuse(stream: &TcpStream, h: &Holder, why: Refusal) -> Result<u64, String> {
    let Refusal(counter, message) = why;
    h.counters.add(counter, 1);
    tracing::info!(
        reason = counter.name(),
        "refused a transfer stream: {message}"
    );
    let _ = write_all_from(stream, Header::Refused(message.clone()).encode(), h.idle).await;
    Err(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asks_stay_inside_the_object() {
        assert!(check_ask(&Ask::Ranges(vec![(0, 64), (64, 0)]), 64).is_ok());
        assert!(check_ask(&Ask::Ranges(vec![(1, 64)]), 64).is_err());
        assert!(check_ask(&Ask::Ranges(vec![(u64::MAX, 2)]), 64).is_err());
        let rows = |ids: Vec<u64>| Ask::Rows { row_bytes: 16, ids };
        assert!(check_ask(&rows(vec![3, 0, 3]), 64).is_ok());
        assert!(check_ask(&rows(vec![4]), 64).is_err());
        assert!(check_ask(&rows(vec![u64::MAX]), 64).is_err());
    }

    #[test]
    fn a_stream_of_a_ticket_is_claimed_once() {
        let c = Claims::default();
        assert!(c.claim([1; NONCE_LEN], 0, 100, 50));
        assert!(!c.claim([1; NONCE_LEN], 0, 100, 50));
        assert!(c.claim([1; NONCE_LEN], 1, 100, 50));
        assert!(c.claim([2; NONCE_LEN], 0, 100, 50));
    }
}
