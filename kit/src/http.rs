//! The one HTTP/1 server of every listener (worker metrics/health and admin API, publisher
//! metrics and MCP gateway), in place of `axum::serve`, which has no header timeout, no idle
//! timeout and no connection cap: idle sockets could hold every descriptor of the process.
//!
//! [`serve`] runs an accept loop over hyper's HTTP/1 connection builder with [`Limits`]:
//!
//! - **Connection cap** (`max_connections`): a semaphore permit per open connection. When all
//!   are taken the loop **stops accepting**: new connections wait in the kernel's listen
//!   backlog, where they hold no descriptor of this process, and are accepted as connections
//!   close. The descriptors stay free for the process's own downstream, database and broker
//!   connections. A warning is logged (at most once a minute) while the cap is reached.
//! - **Header timeout** (`header_timeout`): a new connection must deliver a complete request
//!   head within it from the accept, and a following request on a keep-alive connection within
//!   it from its first byte; otherwise the connection is closed (a half-sent head, a client
//!   that connects and sends nothing).
//! - **Idle timeout** (`idle_timeout`): a keep-alive connection with no request in flight and
//!   no byte read or written for this long is closed. A request being handled is never cut by
//!   either timeout (its handler's own limits apply).
//! - **Body timeout** (`body_timeout`): a request's body must be received whole within it from
//!   the moment its head was. A body still incomplete then (a client sending one byte every few
//!   seconds) fails the handler's read, the answer is `408 Request Timeout` and the connection is
//!   closed, so a slow sender holds a connection for at most the header and body timeouts.
//! - **Peer**: every request carries its connection's remote address as a [`Peer`] extension,
//!   for per-client limits (e.g. [`crate::guard::FailureBudget`]).
//! - **Graceful shutdown**: once `shutdown` resolves the listener is closed (nothing more is
//!   accepted), idle connections close, and requests in flight finish before their connection
//!   closes; `serve` returns when every connection is gone, like `axum::serve`'s
//!   `with_graceful_shutdown`.
//!
//! Why the timeouts are kept here rather than by hyper's `header_read_timeout`: hyper 1.12
//! starts that timer when it begins to wait for a request head, which on a keep-alive
//! connection is as soon as the previous response was written (`proto/h1/conn.rs`: the idle
//! state sets `notify_read` when a header timeout is configured). It therefore also bounds the
//! keep-alive wait, and a 10 s header timeout would close every idle connection after 10 s. The
//! watchdog here tells the two waits apart; hyper's timer is still set, to header + idle
//! timeout, as a backstop that never fires first.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::time::Instant;

/// Limits of one listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Time for a complete request head: from the accept, or from the first byte of a later
    /// request on a keep-alive connection.
    pub header_timeout: Duration,
    /// A keep-alive connection with nothing in flight and no traffic is closed after this.
    pub idle_timeout: Duration,
    /// Connections open at once; more wait in the kernel's backlog.
    pub max_connections: usize,
    /// Time for a request's whole body, from its complete head.
    pub body_timeout: Duration,
}

impl Limits {
    /// The documented defaults: 10 s, 60 s, 256, 10 s.
    pub const DEFAULT: Limits = Limits {
        header_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(60),
        max_connections: 256,
        body_timeout: Duration::from_secs(10),
    };
}

/// The remote address of the connection a request came on (a request extension).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer(pub std::net::SocketAddr);

impl Default for Limits {
    fn default() -> Limits {
        Limits::DEFAULT
    }
}

/// Whether a request's `Content-Length` announces more than `max` bytes: such a request can be
/// refused (`413`) before any of its body is read. A body limit on the extractor alone reads
/// up to `max` bytes first, at whatever pace the client sends them.
pub fn announces_more_than(headers: &axum::http::HeaderMap, max: usize) -> bool {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_some_and(|n| n > max as u64)
}

/// How much of a refused body [`linger`] reads at most, and for how long.
pub const LINGER_BYTES: usize = 16 * 1024 * 1024;
pub const LINGER_FOR: std::time::Duration = std::time::Duration::from_secs(5);

/// Reads and discards, in a task of its own, what is left of a request body refused before it
/// was read (`413` on its `Content-Length`), at most [`LINGER_BYTES`] or for [`LINGER_FOR`]: a
/// client still sending it then finishes and reads the answer, where a connection closed under
/// its upload would give it a broken pipe instead (a lingering close, as web servers do). A
/// body larger or slower than that is dropped, and the connection with it.
pub fn linger(body: axum::body::Body) {
    use axum::body::HttpBody;
    tokio::spawn(async move {
        let mut body = std::pin::pin!(body);
        let mut seen = 0usize;
        let drain = async {
            while let Some(Ok(frame)) =
                std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await
            {
                seen += frame.data_ref().map_or(0, |d| d.len());
                if seen > LINGER_BYTES {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(LINGER_FOR, drain).await;
    });
}

/// A listener that could not be bound, naming the setting it came from.
#[derive(Debug, thiserror::Error)]
#[error("{var}={addr}: cannot listen there: {source} (another process may hold the port; choose another address, or `off`)")]
pub struct BindError {
    /// The variable that gave the address (e.g. `METRICS_ADDR`).
    pub var: &'static str,
    pub addr: std::net::SocketAddr,
    pub source: std::io::Error,
}

/// Binds the address `var` names, at start-up: a listener that cannot bind is a start-up
/// failure, never a process running without it. Non-blocking, ready for [`serve`] through
/// [`TcpListener::from_std`].
pub fn bind(
    var: &'static str,
    addr: std::net::SocketAddr,
) -> Result<std::net::TcpListener, BindError> {
    let fail = |source| BindError { var, addr, source };
    let listener = std::net::TcpListener::bind(addr).map_err(fail)?;
    listener.set_nonblocking(true).map_err(fail)?;
    Ok(listener)
}

/// How long the loop waits after an accept error it cannot skip (e.g. EMFILE: the pending
/// connection stays in the backlog, and accepting again at once would spin).
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(500);
/// Least time between two "connection cap reached" warnings of one listener.
const FULL_WARNING_EVERY: Duration = Duration::from_secs(60);

/// Serves `router` on `listener` with `limits` until `shutdown` resolves, then shuts down
/// gracefully (see the module documentation). Returns once every connection has closed.
pub async fn serve<F>(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: F,
) -> std::io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let local = listener.local_addr()?;
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // Each connection holds a receiver: `closed()` resolves when the last one is gone.
    let (close_tx, close_rx) = watch::channel(());
    let mut last_full_warning: Option<Instant> = None;
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            biased;
            _ = &mut shutdown => break,
            permit = permits.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
        };
        let (stream, peer) = tokio::select! {
            biased;
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) if skippable(&e) => continue,
                Err(error) => {
                    tracing::warn!(addr = %local, %error, "cannot accept a connection; retrying");
                    tokio::select! {
                        _ = &mut shutdown => break,
                        _ = tokio::time::sleep(ACCEPT_ERROR_PAUSE) => continue,
                    }
                }
            },
        };
        if permits.available_permits() == 0
            && last_full_warning.is_none_or(|at| at.elapsed() >= FULL_WARNING_EVERY)
        {
            last_full_warning = Some(Instant::now());
            tracing::warn!(
                addr = %local,
                max_connections = limits.max_connections,
                "listener reached its connection cap; further connections wait in the backlog"
            );
        }
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let close = close_rx.clone();
        tokio::spawn(async move {
            connection(stream, peer, router, limits, close).await;
            drop(permit);
        });
    }
    // Stop accepting: the socket closes, the backlog is refused.
    drop(listener);
    drop(close_rx);
    let _ = close_tx.send(());
    close_tx.closed().await;
    Ok(())
}

/// Accept errors about one connection that went away before it was accepted.
fn skippable(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// No head awaited (see [`Activity::head_since`]).
const NONE: u64 = u64::MAX;

/// What the watchdog of one connection needs to know, kept by the I/O and service wrappers.
/// Times are milliseconds since `origin` (the accept).
struct Activity {
    origin: Instant,
    /// Last successful read or write.
    last_io: AtomicU64,
    /// Requests handed to the router whose response is not yet ready.
    busy: AtomicUsize,
    /// Since when a request head is awaited and incomplete: the accept for the first request,
    /// the first byte read while idle for a later one; [`NONE`] while idle or busy.
    head_since: AtomicU64,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            origin: Instant::now(),
            last_io: AtomicU64::new(0),
            busy: AtomicUsize::new(0),
            head_since: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    fn read(&self) {
        let now = self.now();
        self.last_io.store(now, Ordering::Relaxed);
        if self.busy.load(Ordering::Relaxed) == 0 && self.head_since.load(Ordering::Relaxed) == NONE
        {
            self.head_since.store(now, Ordering::Relaxed);
        }
    }

    fn wrote(&self) {
        self.last_io.store(self.now(), Ordering::Relaxed);
    }

    fn request_started(&self) {
        self.busy.fetch_add(1, Ordering::Relaxed);
        self.head_since.store(NONE, Ordering::Relaxed);
    }

    fn request_done(&self) {
        self.last_io.store(self.now(), Ordering::Relaxed);
        self.busy.fetch_sub(1, Ordering::Relaxed);
    }

    /// When the connection is to be closed unless something happens first; None while a
    /// request is being handled.
    fn deadline(&self, limits: &Limits) -> Option<Instant> {
        if self.busy.load(Ordering::Relaxed) > 0 {
            return None;
        }
        let ms = |v: u64| Duration::from_millis(v);
        let head = self.head_since.load(Ordering::Relaxed);
        Some(if head != NONE {
            self.origin + ms(head) + limits.header_timeout
        } else {
            self.origin + ms(self.last_io.load(Ordering::Relaxed)) + limits.idle_timeout
        })
    }
}

/// Serves one connection until it ends, the watchdog closes it, or (after `close` fires) it
/// finishes its in-flight request.
async fn connection(
    stream: TcpStream,
    peer: std::net::SocketAddr,
    router: Router,
    limits: Limits,
    mut close: watch::Receiver<()>,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Tracked {
        inner: stream,
        activity: activity.clone(),
    });
    let service = Service {
        router,
        activity: activity.clone(),
        peer: Peer(peer),
        body_timeout: limits.body_timeout,
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        // The backstop (module documentation): the watchdog below closes first.
        .header_read_timeout(limits.header_timeout + limits.idle_timeout)
        .keep_alive(true);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let timer = tokio::time::sleep_until(Instant::now() + limits.header_timeout);
    tokio::pin!(timer);
    let mut closing = false;
    loop {
        // Polls the connection, then re-arms the timer from what the connection just did.
        let watched = std::future::poll_fn(|cx| {
            if let Poll::Ready(result) = conn.as_mut().poll(cx) {
                return Poll::Ready(Some(result));
            }
            if let Some(deadline) = activity.deadline(&limits) {
                if timer.deadline() != deadline {
                    timer.as_mut().reset(deadline);
                }
                if timer.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(None);
                }
            }
            Poll::Pending
        });
        tokio::select! {
            ended = watched => {
                match ended {
                    Some(Err(error)) => tracing::debug!(%error, "connection ended with an error"),
                    Some(Ok(())) => {}
                    None => tracing::debug!("closing a connection past its header or idle timeout"),
                }
                // Dropping `conn` closes the socket.
                return;
            }
            _ = close.changed(), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// The router as a hyper service that tells [`Activity`] when a request starts and its
/// response is ready, gives the request its [`Peer`] and puts its body under the body timeout.
#[derive(Clone)]
struct Service {
    router: Router,
    activity: Arc<Activity>,
    peer: Peer,
    body_timeout: Duration,
}

impl hyper::service::Service<hyper::Request<Incoming>> for Service {
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future =
        Pin<Box<dyn Future<Output = Result<Response, std::convert::Infallible>> + Send + 'static>>;

    fn call(&self, request: hyper::Request<Incoming>) -> Self::Future {
        self.activity.request_started();
        let done = Done(self.activity.clone());
        let mut router = self.router.clone();
        let expired = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let deadline = Instant::now() + self.body_timeout;
        let timed = expired.clone();
        let mut request: Request = request.map(|body| {
            Body::new(Deadline {
                inner: body,
                sleep: Box::pin(tokio::time::sleep_until(deadline)),
                expired: timed,
            })
        });
        request.extensions_mut().insert(self.peer);
        let limit = self.body_timeout;
        Box::pin(async move {
            let _done = done;
            // A Router is always ready.
            std::future::poll_fn(|cx| {
                tower_service::Service::<Request>::poll_ready(&mut router, cx)
            })
            .await?;
            let response = tower_service::Service::<Request>::call(&mut router, request).await?;
            if expired.load(Ordering::Relaxed) {
                return Ok(body_timed_out(limit));
            }
            Ok(response)
        })
    }
}

/// The answer to a request whose body did not arrive within the body timeout, whatever the
/// handler made of its failed read: `408` in the JSON error shape of the APIs, and the
/// connection closed (the rest of the body is never read).
fn body_timed_out(limit: Duration) -> Response {
    let body = format!(
        "{{\"error\":\"request_timeout\",\"message\":\"the request body was not received within {} ms\"}}",
        limit.as_millis()
    );
    let mut response = (StatusCode::REQUEST_TIMEOUT, body).into_response();
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// The error a request body's read ends with past the body timeout.
#[derive(Debug, thiserror::Error)]
#[error("request body not received within the body timeout")]
pub struct BodyTimeout;

/// A request body that fails with [`BodyTimeout`] once its deadline passes before its end,
/// and says so in `expired`.
struct Deadline {
    inner: Incoming,
    sleep: Pin<Box<tokio::time::Sleep>>,
    expired: Arc<std::sync::atomic::AtomicBool>,
}

impl hyper::body::Body for Deadline {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        if self.sleep.as_mut().poll(cx).is_ready() {
            self.expired.store(true, Ordering::Relaxed);
            return Poll::Ready(Some(Err(BodyTimeout.into())));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        hyper::body::Body::is_end_stream(&self.inner)
    }

    fn size_hint(&self) -> SizeHint {
        hyper::body::Body::size_hint(&self.inner)
    }
}

/// Marks the request done however its future ends (answered or dropped).
struct Done(Arc<Activity>);

impl Drop for Done {
    fn drop(&mut self) {
        self.0.request_done();
    }
}

/// The socket, telling [`Activity`] about every read and write.
struct Tracked {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.read();
        }
        polled
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.wrote();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.wrote();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const GET: &[u8] = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";

    fn limits(header_ms: u64, idle_ms: u64, max: usize) -> Limits {
        Limits {
            header_timeout: Duration::from_millis(header_ms),
            idle_timeout: Duration::from_millis(idle_ms),
            max_connections: max,
            body_timeout: Duration::from_secs(5),
        }
    }

    /// Serves a router whose `/` answers "ok" and `/slow` after 400 ms; returns the address and
    /// the trigger of its shutdown.
    async fn start(limits: Limits) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let router = Router::new()
            .route("/", get(|| async { "ok" }))
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    "slow"
                }),
            )
            .route(
                "/echo",
                axum::routing::post(|body: Bytes| async move { format!("got {}", body.len()) }),
            )
            .route(
                "/peer",
                get(
                    |axum::Extension(Peer(peer)): axum::Extension<Peer>| async move {
                        format!("peer {}", peer.ip())
                    },
                ),
            );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(serve(listener, router, limits, async {
            let _ = rx.await;
        }));
        (addr, tx)
    }

    /// Reads until EOF or `within`; (bytes read, closed).
    async fn read_until_closed(s: &mut TcpStream, within: Duration) -> (String, bool) {
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        let deadline = Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
                Err(_) => return (String::from_utf8_lossy(&got).into(), false),
                Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&got).into(), true),
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            }
        }
    }

    async fn read_response(s: &mut TcpStream) -> String {
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !String::from_utf8_lossy(&got).ends_with("ok") {
            let n = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf))
                .await
                .expect("a response")
                .unwrap();
            assert!(n > 0, "closed before the response");
            got.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&got).into()
    }

    #[tokio::test]
    async fn a_half_sent_head_is_closed_after_the_header_timeout() {
        let (addr, _stop) = start(limits(200, 5_000, 8)).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        let started = std::time::Instant::now();
        let (_, closed) = read_until_closed(&mut s, Duration::from_secs(2)).await;
        assert!(closed);
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(150) && took < Duration::from_millis(1000),
            "{took:?}"
        );
    }

    #[tokio::test]
    async fn keep_alive_waits_for_the_idle_timeout_not_the_header_timeout() {
        let (addr, _stop) = start(limits(150, 800, 8)).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(GET).await.unwrap();
        assert!(read_response(&mut s).await.starts_with("HTTP/1.1 200"));
        tokio::time::sleep(Duration::from_millis(400)).await;
        s.write_all(GET).await.unwrap();
        assert!(read_response(&mut s).await.starts_with("HTTP/1.1 200"));
        let started = std::time::Instant::now();
        let (_, closed) = read_until_closed(&mut s, Duration::from_secs(3)).await;
        assert!(closed);
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(600), "closed after {took:?}");
    }

    #[tokio::test]
    async fn a_request_in_flight_outlives_both_timeouts() {
        let (addr, _stop) = start(limits(100, 100, 8)).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let (text, _) = read_until_closed(&mut s, Duration::from_secs(2)).await;
        assert!(
            text.starts_with("HTTP/1.1 200") && text.ends_with("slow"),
            "{text:?}"
        );
    }

    #[tokio::test]
    async fn a_body_sent_too_slowly_is_answered_408_and_its_connection_closed() {
        let mut l = limits(5_000, 5_000, 8);
        l.body_timeout = Duration::from_millis(300);
        let (addr, _stop) = start(l).await;
        let (mut rx, mut tx) = TcpStream::connect(addr).await.unwrap().into_split();
        tx.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nab")
            .await
            .unwrap();
        let started = std::time::Instant::now();
        // One more byte now and then, as a slow sender does: it does not extend the deadline.
        let trickle = tokio::spawn(async move {
            for _ in 0..40 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                if tx.write_all(b"x").await.is_err() {
                    break;
                }
            }
        });
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        let closed = loop {
            match tokio::time::timeout(Duration::from_secs(3), rx.read(&mut buf)).await {
                Err(_) => break false,
                Ok(Ok(0)) | Ok(Err(_)) => break true,
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            }
        };
        let took = started.elapsed();
        trickle.abort();
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 408"), "{text:?}");
        assert!(text.contains("request_timeout"), "{text:?}");
        assert!(closed, "the connection is closed after the 408");
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_millis(1_800),
            "{took:?}"
        );
    }

    #[tokio::test]
    async fn a_body_that_arrives_in_time_is_read_whole() {
        let mut l = limits(5_000, 5_000, 8);
        l.body_timeout = Duration::from_millis(800);
        let (addr, _stop) = start(l).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        s.write_all(b"cd").await.unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !String::from_utf8_lossy(&got).ends_with("got 4") {
            let n = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf))
                .await
                .expect("an answer")
                .unwrap();
            assert!(n > 0, "closed: {:?}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"));
    }

    #[tokio::test]
    async fn every_request_knows_its_peer() {
        let (addr, _stop) = start(limits(5_000, 5_000, 8)).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /peer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let (text, _) = read_until_closed(&mut s, Duration::from_secs(2)).await;
        assert!(text.ends_with("peer 127.0.0.1"), "{text:?}");
    }

    #[tokio::test]
    async fn past_the_cap_connections_wait_in_the_backlog() {
        let (addr, _stop) = start(limits(600, 600, 2)).await;
        let _a = TcpStream::connect(addr).await.unwrap();
        let _b = TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        // The third is connected by the kernel but not served until a slot frees (the two
        // idle ones are closed after the header timeout).
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(GET).await.unwrap();
        let started = std::time::Instant::now();
        assert!(read_response(&mut c).await.starts_with("HTTP/1.1 200"));
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(400),
            "served after {took:?}, before a slot freed"
        );
    }

    #[tokio::test]
    async fn shutdown_stops_accepting_and_lets_the_request_in_flight_finish() {
        let (addr, stop) = start(limits(5_000, 5_000, 8)).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.send(()).unwrap();
        let (text, closed) = read_until_closed(&mut s, Duration::from_secs(2)).await;
        assert!(
            text.starts_with("HTTP/1.1 200") && text.ends_with("slow"),
            "{text:?}"
        );
        assert!(closed, "the connection closes after its last response");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "nothing accepts any more"
        );
    }
}
