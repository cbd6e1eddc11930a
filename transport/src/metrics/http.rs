//! The `--metrics` endpoint: `GET /metrics` over HTTP/1 (hyper), on a thread of its own with
//! its own small tokio runtime, so a scrape never runs on the daemon's io_uring thread. The
//! only work it asks of that thread is a [`Snapshot`] (the engine's STATS and a load of the
//! counters), through [`Snapshots`]; the text is encoded here.
//!
//! What a scraper (or anyone who can reach the port) can cost the store is bounded: a request
//! head over [`MAX_REQUEST_HEAD`] is refused (431) and the connection closed, as is a
//! malformed one (400); a head not complete within [`HEAD_TIMEOUT`] closes the connection; a
//! connection lives at most [`CONNECTION_LIFETIME`]; at most [`MAX_CONNECTIONS`] are served at
//! once (more are closed at accept). Only `GET /metrics` is answered (other paths 404, other
//! methods 405), and one store snapshot is asked per answer, however many scrapers there are.

use std::convert::Infallible;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::{mpsc, oneshot};

use super::{encode_text, Snapshot, CONTENT_TYPE as EXPOSITION};

/// hyper's smallest read buffer: a request line and headers longer than this are refused.
pub const MAX_REQUEST_HEAD: usize = 8 * 1024;
/// A request's head must arrive whole within this long.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection is closed after this long, kept alive or not (scrapers reconnect).
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);
/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 16;
/// How long a scrape waits for the daemon's snapshot before answering 503.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the metrics thread asks the daemon's thread for a snapshot: each request carries the
/// channel its snapshot comes back on.
pub type Snapshots = mpsc::Sender<oneshot::Sender<Snapshot>>;

/// Binds `addr` (so that a taken port fails the daemon's start) and serves it on a new
/// thread; the address bound (a port 0 chosen by the kernel) comes back.
pub fn start(addr: SocketAddr, snapshots: Snapshots) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let bound = listener.local_addr()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()?;
    std::thread::Builder::new()
        .name("vovp-metrics".into())
        .spawn(move || runtime.block_on(serve(listener, snapshots)))?;
    Ok(bound)
}

async fn serve(listener: TcpListener, snapshots: Snapshots) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("metrics endpoint: {e}; not serving metrics");
            return;
        }
    };
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of fds, most likely: the store's clients matter more; wait and retry.
                tracing::debug!("metrics endpoint: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(
                "metrics endpoint: {MAX_CONNECTIONS} connections already; closing {peer}"
            );
            continue;
        };
        let snapshots = snapshots.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let service = service_fn(move |req| answer(req, snapshots.clone()));
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .max_buf_size(MAX_REQUEST_HEAD)
                .serve_connection(TokioIo::new(stream), service);
            // Past its lifetime the connection is simply dropped (closed).
            if let Ok(Err(e)) = tokio::time::timeout(CONNECTION_LIFETIME, connection).await {
                tracing::debug!("metrics endpoint: {peer}: {e}");
            }
        });
    }
}

/// One request's response: the exposition for `GET /metrics`, an error status otherwise.
async fn answer(
    req: Request<Incoming>,
    snapshots: Snapshots,
) -> Result<Response<Full<Bytes>>, Infallible> {
    if req.uri().path() != "/metrics" {
        return Ok(plain(
            StatusCode::NOT_FOUND,
            "not found: the metrics are at /metrics\n",
        ));
    }
    if req.method() != Method::GET {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET"));
        return Ok(r);
    }
    let Some(snapshot) = ask(&snapshots).await else {
        return Ok(plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "the store did not answer in time\n",
        ));
    };
    let mut r = Response::new(Full::new(Bytes::from(encode_text(snapshot))));
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(EXPOSITION));
    Ok(r)
}

/// The daemon's snapshot, or `None` when it is stopping or did not answer in time.
async fn ask(snapshots: &Snapshots) -> Option<Snapshot> {
    let (tx, rx) = oneshot::channel();
    snapshots.send(tx).await.ok()?;
    tokio::time::timeout(SNAPSHOT_TIMEOUT, rx).await.ok()?.ok()
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}
