//! The HTTP client of one tool: sends a request and reads its answer within the tool's
//! `timeout`, connects within its `connect_timeout`, follows no redirect and retries nothing
//! (the ledger scheduler is the only retry layer, docs/design.md section 6). It says how a
//! request failed in the terms the adapter's classification needs ([`SendError`]): no
//! connection (so nothing was written), the timeout, or a failure after the request may have
//! been written.
//!
//! Requests go through hyper-util's pooled HTTP/1.1 client over rustls (the worker's trust)
//! directly. reqwest, built on the same two, adds per-request layers the worker never uses (a
//! redirect policy that parses each request's URL again even when it follows nothing, a retry
//! policy that clones each request, proxy matching): about a twentieth of the worker's
//! instructions per intent (docs/benchmarks.md, "What bounds them"). Where the environment names
//! a proxy (`HTTP_PROXY`, `HTTPS_PROXY`, `ALL_PROXY`, any case), requests go through reqwest as
//! configured from it (its `NO_PROXY` too), which implements proxies and CONNECT tunnels.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::header::{HeaderMap, HeaderValue, AUTHORIZATION};
use hyper::{Method, StatusCode, Uri};
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use crate::config::ToolConfig;

/// Largest response body read; a longer one is an error (the evidence keeps an excerpt anyway).
const MAX_BODY: usize = 1024 * 1024;

type BoxError = Box<dyn StdError + Send + Sync>;

/// The environment variables that name a proxy (as reqwest reads them).
const PROXY_VARS: &[&str] = &[
    "HTTP_PROXY",
    "http_proxy",
    "HTTPS_PROXY",
    "https_proxy",
    "ALL_PROXY",
    "all_proxy",
];

/// Where a request goes: the URL as parsed (and normalised) by the URL standard, and the same as
/// the URI the request line carries, both made once. A user and password in the URL
/// (`https://user:secret@host/…`, percent-decoded) become the request's `Authorization: Basic`
/// header, unless the tool's `headers` set one, and leave the URL.
#[derive(Clone)]
pub struct Target {
    url: reqwest::Url,
    uri: Uri,
    basic_auth: Option<HeaderValue>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the URL: its query may hold a secret.
        f.debug_struct("Target")
            .field("host_port", &kit::url::host_port(self.url.as_str()))
            .finish_non_exhaustive()
    }
}

impl Target {
    pub fn parse(text: &str) -> Result<Target, String> {
        let mut url = reqwest::Url::parse(text).map_err(|e| format!("invalid URL: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!("unsupported URL scheme {}", url.scheme()));
        }
        let basic_auth = take_credentials(&mut url)?;
        let uri = Uri::try_from(url.as_str()).map_err(|e| format!("invalid URL: {e}"))?;
        Ok(Target {
            url,
            uri,
            basic_auth,
        })
    }
}

/// The URL's user and password as a `Basic` credential (RFC 7617: `user:password`, base64),
/// removed from the URL. A part that is not UTF-8 once percent-decoded is refused.
fn take_credentials(url: &mut reqwest::Url) -> Result<Option<HeaderValue>, String> {
    if url.username().is_empty() && url.password().is_none() {
        return Ok(None);
    }
    let decode = |part: &str, what: &str| {
        percent_encoding::percent_decode_str(part)
            .decode_utf8()
            .map(|s| s.into_owned())
            .map_err(|_| format!("the URL's {what} is not UTF-8 once percent-decoded"))
    };
    let user = decode(url.username(), "user")?;
    let password = url.password().map(|p| decode(p, "password")).transpose()?;
    // A URL with a user has a host, so neither can fail.
    let _ = url.set_username("");
    let _ = url.set_password(None);
    use base64::Engine as _;
    let plain = format!("{user}:{}", password.unwrap_or_default());
    let encoded = base64::engine::general_purpose::STANDARD.encode(plain);
    let mut value = HeaderValue::try_from(format!("Basic {encoded}"))
        .map_err(|_| "the URL's credentials do not make a header".to_string())?;
    value.set_sensitive(true);
    Ok(Some(value))
}

/// An answer: its status and headers, and its body or why it could not be read whole.
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Result<Vec<u8>, String>,
}

/// How a request failed before an answer arrived.
#[derive(Debug)]
pub struct SendError {
    kind: Kind,
    error: BoxError,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// No connection was made (refused, unreachable, TLS handshake refused, connect timeout):
    /// the request was never written.
    Connect,
    /// The tool's `timeout` passed; the request may have been written.
    Timeout,
    /// The request could not be built (nothing was written).
    Invalid,
    /// Anything else: the request may have been written.
    Other,
}

impl SendError {
    /// Nothing was written: the connection (or its TLS handshake) was never made.
    pub fn is_connect(&self) -> bool {
        self.kind == Kind::Connect
    }

    pub fn is_timeout(&self) -> bool {
        self.kind == Kind::Timeout
    }

    pub fn is_invalid(&self) -> bool {
        self.kind == Kind::Invalid
    }

    /// The error itself, whose source chain names the cause (an OS error, a rustls error).
    pub fn source_chain(&self) -> &(dyn StdError + 'static) {
        &*self.error
    }

    /// The error and its causes on one line. Never the URL: its query, user part or an
    /// interpolated `${VAR}` may hold a secret, and this goes into evidence and logs.
    pub fn text(&self) -> String {
        match self.error.downcast_ref::<reqwest::Error>() {
            Some(e) => reqwest_text(e),
            None => chain(&*self.error),
        }
    }
}

/// The client of one tool.
pub struct Client {
    inner: Inner,
    timeout: Duration,
}

enum Inner {
    Direct(hyper_util::client::legacy::Client<Connector, Full<Bytes>>),
    Proxied(reqwest::Client),
}

impl Client {
    /// The client of `config`'s tool; `https://` is verified against `trust`.
    pub fn new(config: &ToolConfig, trust: &crate::tls::Trust) -> Result<Client, String> {
        let proxied = PROXY_VARS
            .iter()
            .any(|v| std::env::var_os(v).is_some_and(|v| !v.is_empty()));
        let inner = if proxied {
            let client = crate::tls::http_client(trust)
                .timeout(config.timeout)
                .connect_timeout(config.connect_timeout)
                .redirect(reqwest::redirect::Policy::none())
                .retry(reqwest::retry::never())
                .build()
                .map_err(|e| format!("cannot build HTTP client: {}", reqwest_text(&e)))?;
            Inner::Proxied(client)
        } else {
            // The TCP settings reqwest gives its connections: a dead peer of a pooled
            // connection is found by keepalive probes, and unacknowledged data fails it after
            // 30 s. The connect timeout is [`Connector`]'s alone, over the whole connect (every
            // address of the host, then the TLS handshake), so its error is always the same.
            let mut http = HttpConnector::new();
            http.enforce_http(false);
            http.set_nodelay(true);
            http.set_keepalive(Some(Duration::from_secs(15)));
            http.set_keepalive_interval(Some(Duration::from_secs(15)));
            http.set_keepalive_retries(Some(3));
            #[cfg(target_os = "linux")]
            http.set_tcp_user_timeout(Some(Duration::from_secs(30)));
            let https = hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(trust.client_config())
                .https_or_http()
                .enable_http1()
                .wrap_connector(http);
            let connector = Connector {
                inner: https,
                timeout: config.connect_timeout,
            };
            let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
                .timer(TokioTimer::new())
                .pool_timer(TokioTimer::new())
                .pool_idle_timeout(Duration::from_secs(90))
                .build(connector);
            Inner::Direct(client)
        };
        Ok(Client {
            inner,
            timeout: config.timeout,
        })
    }

    /// Sends one request with `headers` as given (the adapter's, made once: `Accept: */*`
    /// among them unless the tool sets its own, as reqwest sent) and reads its answer, the whole
    /// within the tool's `timeout` (a body still arriving then is an unread body, not a failed
    /// request).
    pub async fn send(
        &self,
        method: Method,
        target: &Target,
        mut headers: HeaderMap,
        body: Option<String>,
    ) -> Result<Reply, SendError> {
        if let Some(auth) = &target.basic_auth {
            if !headers.contains_key(AUTHORIZATION) {
                headers.insert(AUTHORIZATION, auth.clone());
            }
        }
        match &self.inner {
            Inner::Direct(client) => {
                let deadline = tokio::time::Instant::now() + self.timeout;
                let mut request =
                    hyper::Request::new(Full::new(body.map(Bytes::from).unwrap_or_default()));
                *request.method_mut() = method;
                *request.uri_mut() = target.uri.clone();
                *request.headers_mut() = headers;
                let response = match within(deadline, client.request(request)).await {
                    Ok(Ok(response)) => response,
                    Ok(Err(e)) => {
                        let kind = if e.is_connect() {
                            Kind::Connect
                        } else {
                            Kind::Other
                        };
                        return Err(SendError {
                            kind,
                            error: Box::new(e),
                        });
                    }
                    Err(_) => {
                        return Err(SendError {
                            kind: Kind::Timeout,
                            error: Box::new(timed_out(self.timeout)),
                        })
                    }
                };
                let (parts, incoming) = response.into_parts();
                let body = match within(deadline, read_limited(incoming)).await {
                    Ok(body) => body,
                    Err(_) => Err(timed_out(self.timeout).to_string()),
                };
                Ok(Reply {
                    status: parts.status,
                    headers: parts.headers,
                    body,
                })
            }
            Inner::Proxied(client) => {
                let mut builder = client.request(method, target.url.clone()).headers(headers);
                if let Some(body) = body {
                    builder = builder.body(body);
                }
                let response = builder.send().await.map_err(|e| SendError {
                    kind: if e.is_connect() {
                        Kind::Connect
                    } else if e.is_builder() {
                        Kind::Invalid
                    } else if e.is_timeout() {
                        Kind::Timeout
                    } else {
                        Kind::Other
                    },
                    error: Box::new(e),
                })?;
                let status = response.status();
                let headers = response.headers().clone();
                let body = read_reqwest(response).await;
                Ok(Reply {
                    status,
                    headers,
                    body,
                })
            }
        }
    }
}

/// `work`'s answer if it is read before `deadline`, judged when it is read: an answer read only
/// after the deadline (the process was stopped, the runtime starved) is a timeout, as with
/// reqwest, which looks at its deadline before the answer, and not left to whichever of the
/// answer and the timer the runtime happens to see first. A failure stands as it came: a connect
/// failure seen late still proves that nothing was sent.
async fn within<T, E>(
    deadline: tokio::time::Instant,
    work: impl Future<Output = Result<T, E>>,
) -> Result<Result<T, E>, ()> {
    match tokio::time::timeout_at(deadline, work).await {
        Err(_) => Err(()),
        Ok(Ok(_)) if tokio::time::Instant::now() >= deadline => Err(()),
        Ok(done) => Ok(done),
    }
}

fn timed_out(timeout: Duration) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("operation timed out (timeout {} ms)", timeout.as_millis()),
    )
}

/// The TLS-or-plain connector under a connect timeout: the TCP connect and the TLS handshake
/// together within the tool's `connect_timeout`, failing as a connect error (nothing written).
#[derive(Clone)]
struct Connector {
    inner: HttpsConnector<HttpConnector>,
    timeout: Duration,
}

type Stream = MaybeHttpsStream<TokioIo<tokio::net::TcpStream>>;

impl tower_service::Service<Uri> for Connector {
    type Response = Stream;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Stream, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let connecting = self.inner.call(dst);
        let timeout = self.timeout;
        Box::pin(async move {
            match tokio::time::timeout(timeout, connecting).await {
                Ok(connected) => connected,
                // Worded without "timed out": the evidence's cause class of a connect that never
                // happened is the connection, not a timeout after a write.
                Err(_) => Err(format!(
                    "no connection within {} ms (connect_timeout)",
                    timeout.as_millis()
                )
                .into()),
            }
        })
    }
}

async fn read_limited(mut body: hyper::body::Incoming) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| chain(&e))?;
        if let Ok(data) = frame.into_data() {
            append_capped(&mut out, &data)?;
        }
    }
    Ok(out)
}

async fn read_reqwest(mut response: reqwest::Response) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => append_capped(&mut out, &chunk)?,
            Ok(None) => return Ok(out),
            Err(e) => return Err(reqwest_text(&e)),
        }
    }
}

/// Appends a piece of a body read so far, refusing a body over [`MAX_BODY`] (both readers).
fn append_capped(out: &mut Vec<u8>, data: &[u8]) -> Result<(), String> {
    if out.len() + data.len() > MAX_BODY {
        return Err(format!("response body over {MAX_BODY} bytes"));
    }
    out.extend_from_slice(data);
    Ok(())
}

/// An error and its causes on one line.
fn chain(e: &(dyn StdError + 'static)) -> String {
    with_causes(e.to_string(), e.source())
}

/// `s`, then each error of the chain from `source` on, after a `: `.
fn with_causes(mut s: String, mut source: Option<&(dyn StdError + 'static)>) -> String {
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

/// A reqwest error and its causes on one line, without the URL reqwest puts in its text.
fn reqwest_text(e: &reqwest::Error) -> String {
    let mut s = e.to_string();
    if let Some(url) = e.url() {
        s = s.replace(&format!(" for url ({url})"), "");
        // Anywhere else it would be quoted, e.g. by a redirect error.
        s = s.replace(url.as_str(), &kit::url::host_port(url.as_str()));
    }
    with_causes(s, StdError::source(e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    #[test]
    fn a_user_and_password_leave_the_url_as_a_basic_credential() {
        let t = Target::parse("https://payer:p%40ss@pay.example:8443/pay?v=2").unwrap();
        assert_eq!(t.uri.to_string(), "https://pay.example:8443/pay?v=2");
        let auth = t.basic_auth.unwrap();
        // base64("payer:p@ss")
        assert_eq!(auth, "Basic cGF5ZXI6cEBzcw==");
        assert!(auth.is_sensitive());
        // A user alone is `user:`.
        let t = Target::parse("http://payer@pay.example/pay").unwrap();
        assert_eq!(t.basic_auth.unwrap(), "Basic cGF5ZXI6");
        assert!(Target::parse("http://pay.example/pay")
            .unwrap()
            .basic_auth
            .is_none());
        // Never the URL in its debug form.
        let t = Target::parse("https://payer:secret@pay.example/pay?key=k").unwrap();
        let debug = format!("{t:?}");
        assert!(
            !debug.contains("secret") && !debug.contains("key=k"),
            "{debug}"
        );
    }

    /// A worker stopped while its request waits (SIGSTOP, a VM paused, a swap storm) resumes
    /// with the answer in its socket and its deadline past. The deadline wins, as it did with
    /// reqwest: an answer read after the tool's timeout is a timeout, never a success that
    /// depends on which of the two the runtime happened to see first.
    #[test]
    fn an_answer_read_only_after_the_deadline_is_a_timeout() {
        let (client, target, server) = tool_answering(200, |mut peer| {
            // Errors ignored: on a host too loaded to write the request within 50 ms the
            // client gives up first (a timeout as well) and this peer finds it gone.
            std::thread::sleep(Duration::from_millis(300));
            let _ = peer.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}");
            std::thread::sleep(Duration::from_millis(1500));
        });
        let result = runtime().block_on(async {
            let mut send = std::pin::pin!(client.send(
                Method::POST,
                &target,
                HeaderMap::new(),
                Some("{}".into())
            ));
            // Polled until the request is written, then not at all, as a stopped process's
            // task is not, while the answer arrives and the deadline passes; then resumed.
            let written = tokio::time::timeout(Duration::from_millis(50), &mut send).await;
            assert!(written.is_err(), "no answer within 50 ms");
            tokio::time::sleep(Duration::from_millis(700)).await;
            send.await
        });
        match result {
            Err(e) => assert!(e.is_timeout(), "{}", e.text()),
            Ok(reply) => panic!(
                "an answer read after the deadline was taken: {} {:?}",
                reply.status, reply.body
            ),
        }
        server.join().unwrap();
    }

    /// An answer whose body is over the cap is read as far as the cap, then refused: the reply
    /// keeps its status and says why its body is missing.
    #[test]
    fn a_body_over_the_cap_is_refused_not_read_whole() {
        let (client, target, server) = tool_answering(5000, |mut peer| {
            let len = MAX_BODY + 1;
            let _ = peer
                .write_all(format!("HTTP/1.1 200 OK\r\ncontent-length: {len}\r\n\r\n").as_bytes());
            // The client may stop reading at the cap and close.
            let _ = peer.write_all(&vec![b'x'; len]);
        });
        let reply = runtime()
            .block_on(client.send(Method::POST, &target, HeaderMap::new(), Some("{}".into())))
            .unwrap_or_else(|e| panic!("{}", e.text()));
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(
            reply.body.unwrap_err(),
            format!("response body over {MAX_BODY} bytes")
        );
        drop(client);
        server.join().unwrap();
    }

    /// A tool with `timeout_ms` whose downstream, a thread, takes one connection, reads the
    /// request and hands the connection to `answer`; the tool's client and target, and the
    /// thread.
    fn tool_answering(
        timeout_ms: u64,
        answer: impl FnOnce(std::net::TcpStream) + Send + 'static,
    ) -> (Client, Target, std::thread::JoinHandle<()>) {
        use std::io::Read as _;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut peer, _) = listener.accept().unwrap();
            let mut buf = [0u8; 4096];
            let _ = peer.read(&mut buf);
            answer(peer);
        });
        let url = format!("http://127.0.0.1:{port}/w");
        let tools = crate::config::Tools::parse(
            std::path::Path::new("t.toml"),
            &format!(
                "[tools.t]\nurl = '{url}'\nrecovery = 'none'\nreceipt_id = '/id'\n\
                 receipt_match = {{}}\ntimeout_ms = {timeout_ms}\n"
            ),
        )
        .unwrap();
        let client = Client::new(&tools.tools["t"], &crate::tls::load(None).unwrap()).unwrap();
        (client, Target::parse(&url).unwrap(), server)
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// What reqwest sent for such URLs: an IPv6 host in brackets, no fragment, the path and
    /// query percent-encoded by the URL standard.
    #[test]
    fn urls_reqwest_took_make_the_same_request_line() {
        let t = Target::parse("http://[::1]:8080/pay?v=2#section").unwrap();
        assert_eq!(t.uri.host(), Some("[::1]"));
        assert_eq!(t.uri.port_u16(), Some(8080));
        assert_eq!(t.uri.path_and_query().unwrap().as_str(), "/pay?v=2");
        let t = Target::parse("https://pay.example/ré sumé?q=a b&k=\"x\"").unwrap();
        assert_eq!(
            t.uri.path_and_query().unwrap().as_str(),
            "/r%C3%A9%20sum%C3%A9?q=a%20b&k=%22x%22"
        );
        assert_eq!(t.uri.port_u16(), None);
    }

    #[test]
    fn only_http_and_https_are_targets() {
        assert!(Target::parse("ftp://pay.example/x")
            .unwrap_err()
            .contains("scheme"));
        assert!(Target::parse("not a url").is_err());
    }
}
