//! An OTLP/HTTP trace receiver for tests: what a collector would be, reduced to "keep every
//! span". It owns a real HTTP server on `127.0.0.1` (a port of its own, on a thread and runtime
//! of its own, so a blocking exporter flushing on the test's thread cannot starve it) that
//! accepts `POST /v1/traces` with `Content-Type: application/x-protobuf`, decodes each
//! `ExportTraceServiceRequest` with the generated OTLP messages, keeps every span with its
//! resource and scope, and answers `200` with an empty `ExportTraceServiceResponse`.
//!
//! Everything else is refused and remembered, so a test can tell "nothing exported" from
//! "exported in a form we cannot read": `Content-Encoding` other than `identity` is `415`
//! (no decompressor is in the build; leave the exporter's compression off), a JSON or other
//! content type `415`, a body that is not a valid request, or a span with a malformed id, `400`,
//! another method `405`, another path `404`. [`OtlpReceiver::requests`] counts every request of
//! any kind, which is how a test proves an exporter that is turned off never sent anything.
//!
//! A test starts one, points the process under test at [`OtlpReceiver::endpoint`] through
//! `OTEL_EXPORTER_OTLP_ENDPOINT`, and waits with [`OtlpReceiver::wait_for_spans`] or
//! [`OtlpReceiver::wait_for`]; a timeout panics with everything received and refused.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode as HttpStatus};
use axum::response::{IntoResponse, Response};
use axum::Router;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1 as proto;
use prost::Message as _;

/// Largest request body read. Far above an SDK batch (512 spans by default), low enough that
/// a runaway sender cannot exhaust a test machine's memory.
const MAX_BODY: usize = 64 * 1024 * 1024;

/// How many spans a timeout's dump lists before it summarises the rest.
const DUMP_LIMIT: usize = 200;

/// A running receiver; the server stops when it is dropped.
pub struct OtlpReceiver {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Default)]
struct Shared {
    spans: Mutex<Vec<Span>>,
    /// Spans accepted (kept or not).
    accepted: AtomicUsize,
    /// Counting only: decoded and counted, not kept (a benchmark's long run).
    discard: bool,
    requests: AtomicUsize,
    refusals: Mutex<Vec<String>>,
}

/// One span as exported: ids in lowercase hex, attributes by key.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// 32 hex digits.
    pub trace_id: String,
    /// 16 hex digits.
    pub span_id: String,
    /// `None` for a root span.
    pub parent_span_id: Option<String>,
    /// The W3C `tracestate` of the span's context, as exported (often empty).
    pub trace_state: String,
    /// OTLP span flags: the W3C trace flags in bits 0-7 (bit 0 = sampled), bit 8 set when
    /// bit 9 says whether the parent was remote. See [`Span::parent_is_remote`].
    pub flags: u32,
    pub name: String,
    pub kind: SpanKind,
    pub start_time_unix_nano: u64,
    pub end_time_unix_nano: u64,
    pub attributes: BTreeMap<String, AttrValue>,
    pub events: Vec<Event>,
    pub links: Vec<Link>,
    pub status: Status,
    /// The resource's `service.name`; empty when the resource has none.
    pub service_name: String,
    /// Every attribute of the resource that exported the span (`service.name` included).
    pub resource: BTreeMap<String, AttrValue>,
    /// The instrumentation scope (the tracer's name).
    pub scope_name: String,
}

impl Span {
    /// An attribute of the span.
    pub fn attr(&self, key: &str) -> Option<&AttrValue> {
        self.attributes.get(key)
    }

    /// A string attribute of the span (`None` when absent or of another type).
    pub fn attr_str(&self, key: &str) -> Option<&str> {
        self.attr(key).and_then(AttrValue::as_str)
    }

    /// Whether the span's parent came from another process (a `traceparent` it received);
    /// `None` when the exporter did not say.
    pub fn parent_is_remote(&self) -> Option<bool> {
        (self.flags & proto::SpanFlags::ContextHasIsRemoteMask as u32 != 0)
            .then_some(self.flags & proto::SpanFlags::ContextIsRemoteMask as u32 != 0)
    }
}

/// A link from a span to another span's context.
#[derive(Debug, Clone, PartialEq)]
pub struct Link {
    pub trace_id: String,
    pub span_id: String,
    pub trace_state: String,
    pub attributes: BTreeMap<String, AttrValue>,
}

/// An event recorded on a span.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub name: String,
    pub time_unix_nano: u64,
    pub attributes: BTreeMap<String, AttrValue>,
}

/// A span's status.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Status {
    pub code: StatusCode,
    /// Set only with [`StatusCode::Error`], by convention.
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StatusCode {
    #[default]
    Unset,
    Ok,
    Error,
}

/// The OTLP span kind; `Unspecified` is what a sender that set none exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    Unspecified,
    Internal,
    Server,
    Client,
    Producer,
    Consumer,
}

impl SpanKind {
    /// Lowercase name: `internal`, `server`, `client`, `producer`, `consumer`, `unspecified`.
    pub fn as_str(self) -> &'static str {
        match self {
            SpanKind::Unspecified => "unspecified",
            SpanKind::Internal => "internal",
            SpanKind::Server => "server",
            SpanKind::Client => "client",
            SpanKind::Producer => "producer",
            SpanKind::Consumer => "consumer",
        }
    }
}

impl fmt::Display for SpanKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An attribute value, with OTLP's types kept apart (an `Int` 1 is not a `Double` 1.0).
#[derive(Debug, Clone, PartialEq)]
pub enum AttrValue {
    String(String),
    Bool(bool),
    Int(i64),
    Double(f64),
    Bytes(Vec<u8>),
    Array(Vec<AttrValue>),
    Map(BTreeMap<String, AttrValue>),
    /// A key sent without a value.
    Empty,
}

impl AttrValue {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            AttrValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match self {
            AttrValue::Int(i) => Some(*i),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            AttrValue::Bool(b) => Some(*b),
            _ => None,
        }
    }
}

impl From<&str> for AttrValue {
    fn from(s: &str) -> Self {
        AttrValue::String(s.to_string())
    }
}

impl From<String> for AttrValue {
    fn from(s: String) -> Self {
        AttrValue::String(s)
    }
}

impl From<i64> for AttrValue {
    fn from(i: i64) -> Self {
        AttrValue::Int(i)
    }
}

impl From<bool> for AttrValue {
    fn from(b: bool) -> Self {
        AttrValue::Bool(b)
    }
}

impl From<f64> for AttrValue {
    fn from(d: f64) -> Self {
        AttrValue::Double(d)
    }
}

impl fmt::Display for AttrValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttrValue::String(s) => write!(f, "{s:?}"),
            AttrValue::Bool(b) => write!(f, "{b}"),
            AttrValue::Int(i) => write!(f, "{i}"),
            AttrValue::Double(d) => write!(f, "{d:?}"),
            AttrValue::Bytes(b) => write!(f, "0x{}", hex(b)),
            AttrValue::Array(items) => {
                f.write_str("[")?;
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{item}")?;
                }
                f.write_str("]")
            }
            AttrValue::Map(map) => write!(f, "{{{}}}", attrs_text(map)),
            AttrValue::Empty => f.write_str("(empty)"),
        }
    }
}

impl OtlpReceiver {
    /// Binds a free port on 127.0.0.1 and serves until dropped. Needs no runtime: it runs
    /// its own, so it may be started from a plain `#[test]` as well as from `#[tokio::test]`.
    pub fn start() -> OtlpReceiver {
        OtlpReceiver::serve(Shared::default())
    }

    /// A receiver that decodes and counts spans but keeps none ([`OtlpReceiver::spans`] stays
    /// empty): a collector stand-in for benchmarks that export hundreds of thousands of spans.
    pub fn start_counting() -> OtlpReceiver {
        OtlpReceiver::serve(Shared {
            discard: true,
            ..Shared::default()
        })
    }

    fn serve(shared: Shared) -> OtlpReceiver {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the OTLP receiver");
        listener
            .set_nonblocking(true)
            .expect("non-blocking OTLP listener");
        let addr = listener.local_addr().expect("OTLP receiver address");
        let shared = Arc::new(shared);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let app = Router::new()
            .route("/v1/traces", axum::routing::any(export))
            .fallback(elsewhere)
            .with_state(shared.clone());
        let thread = std::thread::Builder::new()
            .name("otlp-receiver".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("OTLP receiver runtime");
                runtime.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(listener).expect("OTLP listener");
                    // Not a graceful shutdown: an exporter's idle keep-alive connection must
                    // not hold a dropped receiver open. Dropping the runtime ends every
                    // connection task.
                    tokio::select! {
                        _ = axum::serve(listener, app) => {}
                        _ = stopped => {}
                    }
                });
            })
            .expect("spawn the OTLP receiver thread");
        OtlpReceiver {
            addr,
            shared,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// The base URL, `http://127.0.0.1:PORT`, for `OTEL_EXPORTER_OTLP_ENDPOINT` (to which the
    /// exporter appends `/v1/traces`).
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The full traces URL, for `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or an exporter's
    /// programmatic endpoint (both used as given, with no path appended).
    pub fn traces_url(&self) -> String {
        format!("{}/v1/traces", self.endpoint())
    }

    /// Every span received so far, in arrival order.
    pub fn spans(&self) -> Vec<Span> {
        self.shared.spans.lock().unwrap().clone()
    }

    /// Spans accepted so far (kept, or only counted by [`OtlpReceiver::start_counting`]).
    pub fn span_count(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Every HTTP request received so far, accepted or refused, on any path.
    pub fn requests(&self) -> usize {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// Why each refused request was refused, in arrival order.
    pub fn refusals(&self) -> Vec<String> {
        self.shared.refusals.lock().unwrap().clone()
    }

    /// Polls every 50 ms until `check` finds what it wants in the spans received so far
    /// (`Some`), and returns it; panics after `timeout` with `what` and a dump of everything
    /// received and refused. Needs a tokio runtime (it sleeps on it).
    pub async fn wait_for<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut(&[Span]) -> Option<T>,
    ) -> T {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(found) = check(&self.spans()) {
                return found;
            }
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "timed out after {timeout:?} waiting for {what}; the OTLP receiver has:\n{}",
                    self.dump()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until at least `at_least` spans (and at least one) match `matching` and returns
    /// all that match, in arrival order (see [`OtlpReceiver::wait_for`]).
    pub async fn wait_for_spans(
        &self,
        what: &str,
        timeout: Duration,
        at_least: usize,
        matching: impl Fn(&Span) -> bool,
    ) -> Vec<Span> {
        self.wait_for(what, timeout, |spans| {
            let found: Vec<Span> = spans.iter().filter(|s| matching(s)).cloned().collect();
            (found.len() >= at_least.max(1)).then_some(found)
        })
        .await
    }

    /// Everything received, one span a line, and every refusal: what a failing test prints.
    pub fn dump(&self) -> String {
        let spans = self.spans();
        let refusals = self.refusals();
        let mut out = format!(
            "{} request(s), {} span(s), {} refused\n",
            self.requests(),
            spans.len(),
            refusals.len()
        );
        for span in spans.iter().take(DUMP_LIMIT) {
            out.push_str(&format!("  {}\n", span_line(span)));
        }
        if spans.len() > DUMP_LIMIT {
            out.push_str(&format!("  ... and {} more\n", spans.len() - DUMP_LIMIT));
        }
        for refusal in refusals {
            out.push_str(&format!("  refused: {refusal}\n"));
        }
        out
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn span_line(s: &Span) -> String {
    let mut line = format!(
        "[{}] {:?} {} trace={} span={} parent={}",
        s.service_name,
        s.name,
        s.kind,
        s.trace_id,
        s.span_id,
        s.parent_span_id.as_deref().unwrap_or("-"),
    );
    if s.status.code != StatusCode::Unset {
        line.push_str(&format!(" status={:?}", s.status.code));
        if !s.status.message.is_empty() {
            line.push_str(&format!("({:?})", s.status.message));
        }
    }
    if !s.attributes.is_empty() {
        line.push_str(&format!(" {{{}}}", attrs_text(&s.attributes)));
    }
    for link in &s.links {
        line.push_str(&format!(" link={}/{}", link.trace_id, link.span_id));
        if !link.attributes.is_empty() {
            line.push_str(&format!("{{{}}}", attrs_text(&link.attributes)));
        }
    }
    for event in &s.events {
        line.push_str(&format!(" event={:?}", event.name));
        if !event.attributes.is_empty() {
            line.push_str(&format!("{{{}}}", attrs_text(&event.attributes)));
        }
    }
    line
}

fn attrs_text(attrs: &BTreeMap<String, AttrValue>) -> String {
    attrs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn refuse(shared: &Shared, status: HttpStatus, reason: String) -> Response {
    shared.refusals.lock().unwrap().push(reason.clone());
    (status, reason).into_response()
}

async fn elsewhere(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    shared.requests.fetch_add(1, Ordering::SeqCst);
    let reason = format!(
        "{} {}: not an OTLP traces endpoint",
        req.method(),
        req.uri()
    );
    refuse(&shared, HttpStatus::NOT_FOUND, reason)
}

async fn export(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    shared.requests.fetch_add(1, Ordering::SeqCst);
    if req.method() != Method::POST {
        let reason = format!("{} /v1/traces: only POST is accepted", req.method());
        return refuse(&shared, HttpStatus::METHOD_NOT_ALLOWED, reason);
    }
    let headers = req.headers();
    let encoding = header_text(headers, header::CONTENT_ENCODING);
    if !encoding.is_empty() && !encoding.eq_ignore_ascii_case("identity") {
        let reason = format!(
            "Content-Encoding {encoding:?}: this receiver has no decompressor; turn the \
             exporter's compression off (OTEL_EXPORTER_OTLP_COMPRESSION unset)"
        );
        return refuse(&shared, HttpStatus::UNSUPPORTED_MEDIA_TYPE, reason);
    }
    let content_type = header_text(headers, header::CONTENT_TYPE);
    let media_type = content_type.split(';').next().unwrap_or_default().trim();
    if !media_type.eq_ignore_ascii_case("application/x-protobuf") {
        let reason = format!(
            "Content-Type {content_type:?}: only application/x-protobuf (OTLP/HTTP binary) \
             is accepted"
        );
        return refuse(&shared, HttpStatus::UNSUPPORTED_MEDIA_TYPE, reason);
    }
    let body = match axum::body::to_bytes(req.into_body(), MAX_BODY).await {
        Ok(body) => body,
        Err(e) => {
            let reason = format!("reading the body (at most {MAX_BODY} bytes): {e}");
            return refuse(&shared, HttpStatus::PAYLOAD_TOO_LARGE, reason);
        }
    };
    let spans = match ExportTraceServiceRequest::decode(body.as_ref())
        .map_err(|e| format!("not an ExportTraceServiceRequest: {e}"))
        .and_then(spans_of)
    {
        Ok(spans) => spans,
        Err(reason) => return refuse(&shared, HttpStatus::BAD_REQUEST, reason),
    };
    shared.accepted.fetch_add(spans.len(), Ordering::SeqCst);
    if !shared.discard {
        shared.spans.lock().unwrap().extend(spans);
    }
    Response::builder()
        .status(HttpStatus::OK)
        .header(header::CONTENT_TYPE, "application/x-protobuf")
        .body(Body::from(
            ExportTraceServiceResponse::default().encode_to_vec(),
        ))
        .expect("a static response")
}

fn header_text(headers: &axum::http::HeaderMap, name: header::HeaderName) -> String {
    headers
        .get(name)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).trim().to_string())
        .unwrap_or_default()
}

/// Every span of a request, or why the request is unusable. Strict about ids: a zero or
/// wrongly sized id is a bug in the sender, and the test should see it rather than a span
/// that matches nothing.
fn spans_of(request: ExportTraceServiceRequest) -> Result<Vec<Span>, String> {
    let mut out = Vec::new();
    for resource_spans in request.resource_spans {
        let resource = attributes(
            resource_spans
                .resource
                .map(|r| r.attributes)
                .unwrap_or_default(),
        );
        let service_name = resource
            .get("service.name")
            .and_then(AttrValue::as_str)
            .unwrap_or_default()
            .to_string();
        for scope_spans in resource_spans.scope_spans {
            let scope_name = scope_spans.scope.map(|s| s.name).unwrap_or_default();
            for span in scope_spans.spans {
                out.push(convert(span, &service_name, &resource, &scope_name)?);
            }
        }
    }
    Ok(out)
}

fn convert(
    span: proto::Span,
    service_name: &str,
    resource: &BTreeMap<String, AttrValue>,
    scope_name: &str,
) -> Result<Span, String> {
    let what = format!("span {:?}", span.name);
    let trace_id = id(&span.trace_id, 16, &what, "trace_id")?;
    let span_id = id(&span.span_id, 8, &what, "span_id")?;
    let parent_span_id = if span.parent_span_id.is_empty() {
        None
    } else {
        Some(id(&span.parent_span_id, 8, &what, "parent_span_id")?)
    };
    let kind = match proto::span::SpanKind::try_from(span.kind) {
        Ok(proto::span::SpanKind::Unspecified) => SpanKind::Unspecified,
        Ok(proto::span::SpanKind::Internal) => SpanKind::Internal,
        Ok(proto::span::SpanKind::Server) => SpanKind::Server,
        Ok(proto::span::SpanKind::Client) => SpanKind::Client,
        Ok(proto::span::SpanKind::Producer) => SpanKind::Producer,
        Ok(proto::span::SpanKind::Consumer) => SpanKind::Consumer,
        Err(_) => return Err(format!("{what}: unknown kind {}", span.kind)),
    };
    let status = match span.status {
        None => Status::default(),
        Some(status) => Status {
            code: match proto::status::StatusCode::try_from(status.code) {
                Ok(proto::status::StatusCode::Unset) => StatusCode::Unset,
                Ok(proto::status::StatusCode::Ok) => StatusCode::Ok,
                Ok(proto::status::StatusCode::Error) => StatusCode::Error,
                Err(_) => return Err(format!("{what}: unknown status code {}", status.code)),
            },
            message: status.message,
        },
    };
    let mut links = Vec::with_capacity(span.links.len());
    for link in span.links {
        links.push(Link {
            trace_id: id(&link.trace_id, 16, &what, "a link's trace_id")?,
            span_id: id(&link.span_id, 8, &what, "a link's span_id")?,
            trace_state: link.trace_state,
            attributes: attributes(link.attributes),
        });
    }
    let events = span
        .events
        .into_iter()
        .map(|e| Event {
            name: e.name,
            time_unix_nano: e.time_unix_nano,
            attributes: attributes(e.attributes),
        })
        .collect();
    Ok(Span {
        trace_id,
        span_id,
        parent_span_id,
        trace_state: span.trace_state,
        flags: span.flags,
        name: span.name,
        kind,
        start_time_unix_nano: span.start_time_unix_nano,
        end_time_unix_nano: span.end_time_unix_nano,
        attributes: attributes(span.attributes),
        events,
        links,
        status,
        service_name: service_name.to_string(),
        resource: resource.clone(),
        scope_name: scope_name.to_string(),
    })
}

/// A non-zero id of `len` bytes as lowercase hex.
fn id(bytes: &[u8], len: usize, what: &str, field: &str) -> Result<String, String> {
    if bytes.len() != len {
        return Err(format!(
            "{what}: {field} has {} bytes, not {len}",
            bytes.len()
        ));
    }
    if bytes.iter().all(|b| *b == 0) {
        return Err(format!("{what}: {field} is all zeros (invalid)"));
    }
    Ok(hex(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attributes(kvs: Vec<KeyValue>) -> BTreeMap<String, AttrValue> {
    kvs.into_iter()
        .map(|kv| (kv.key, value(kv.value)))
        .collect()
}

fn value(v: Option<AnyValue>) -> AttrValue {
    match v.and_then(|v| v.value) {
        None => AttrValue::Empty,
        Some(any_value::Value::StringValue(s)) => AttrValue::String(s),
        Some(any_value::Value::BoolValue(b)) => AttrValue::Bool(b),
        Some(any_value::Value::IntValue(i)) => AttrValue::Int(i),
        Some(any_value::Value::DoubleValue(d)) => AttrValue::Double(d),
        Some(any_value::Value::BytesValue(b)) => AttrValue::Bytes(b),
        Some(any_value::Value::ArrayValue(a)) => {
            AttrValue::Array(a.values.into_iter().map(|v| value(Some(v))).collect())
        }
        Some(any_value::Value::KvlistValue(kv)) => AttrValue::Map(attributes(kv.values)),
        // An index into the profiles signal's string table: meaningless for traces, and the
        // OTLP spec says to treat it as absent.
        Some(any_value::Value::StringValueStrindex(_)) => AttrValue::Empty,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use opentelemetry_proto::tonic::common::v1::{ArrayValue, InstrumentationScope};
    use opentelemetry_proto::tonic::resource::v1::Resource;

    fn kv(key: &str, v: any_value::Value) -> KeyValue {
        KeyValue {
            key: key.into(),
            value: Some(AnyValue { value: Some(v) }),
            ..Default::default()
        }
    }

    fn s(text: &str) -> any_value::Value {
        any_value::Value::StringValue(text.into())
    }

    fn request(spans: Vec<proto::Span>) -> ExportTraceServiceRequest {
        ExportTraceServiceRequest {
            resource_spans: vec![proto::ResourceSpans {
                resource: Some(Resource {
                    attributes: vec![
                        kv("service.name", s("intent-worker")),
                        kv("host.name", s("test-host")),
                    ],
                    ..Default::default()
                }),
                scope_spans: vec![proto::ScopeSpans {
                    scope: Some(InstrumentationScope {
                        name: "intent-worker".into(),
                        ..Default::default()
                    }),
                    spans,
                    ..Default::default()
                }],
                ..Default::default()
            }],
        }
    }

    fn bytes(hex_text: &str) -> Vec<u8> {
        (0..hex_text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex_text[i..i + 2], 16).unwrap())
            .collect()
    }

    async fn post(
        receiver: &OtlpReceiver,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) -> reqwest::Response {
        let mut req = crate::http().post(receiver.traces_url()).body(body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.send().await.expect("POST to the OTLP receiver")
    }

    const PROTOBUF: (&str, &str) = ("content-type", "application/x-protobuf");

    #[tokio::test]
    async fn a_posted_request_is_decoded_span_by_span() {
        let receiver = OtlpReceiver::start();
        let consumer = proto::Span {
            trace_id: bytes("4bf92f3577b34da6a3ce929d0e0e4736"),
            span_id: bytes("00f067aa0ba902b7"),
            parent_span_id: bytes("b7ad6b7169203331"),
            trace_state: "vendor=abc".into(),
            flags: 0x301,
            name: "intent.receive".into(),
            kind: proto::span::SpanKind::Consumer as i32,
            start_time_unix_nano: 1_000,
            end_time_unix_nano: 2_000,
            attributes: vec![
                kv("intent.tenant", s("north-shop")),
                kv("intent.attempt", any_value::Value::IntValue(2)),
                kv("intent.ratio", any_value::Value::DoubleValue(0.5)),
                kv("intent.replay", any_value::Value::BoolValue(true)),
                kv(
                    "intent.tags",
                    any_value::Value::ArrayValue(ArrayValue {
                        values: vec![AnyValue {
                            value: Some(s("a")),
                        }],
                    }),
                ),
            ],
            events: vec![proto::span::Event {
                time_unix_nano: 1_500,
                name: "recorded".into(),
                attributes: vec![kv("state", s("dispatching"))],
                ..Default::default()
            }],
            links: vec![proto::span::Link {
                trace_id: bytes("0af7651916cd43dd8448eb211c80319c"),
                span_id: bytes("00000000000000aa"),
                trace_state: String::new(),
                attributes: vec![kv("link.kind", s("earlier-delivery"))],
                ..Default::default()
            }],
            status: Some(proto::Status {
                message: "downstream said 503".into(),
                code: proto::status::StatusCode::Error as i32,
            }),
            ..Default::default()
        };
        let root = proto::Span {
            trace_id: bytes("4bf92f3577b34da6a3ce929d0e0e4736"),
            span_id: bytes("b7ad6b7169203331"),
            name: "root".into(),
            ..Default::default()
        };
        let response = post(
            &receiver,
            &[PROTOBUF],
            request(vec![consumer, root]).encode_to_vec(),
        )
        .await;
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["content-type"], "application/x-protobuf");
        let body = response.bytes().await.unwrap();
        assert_eq!(
            ExportTraceServiceResponse::decode(body.as_ref()).unwrap(),
            ExportTraceServiceResponse::default()
        );

        let resource: BTreeMap<String, AttrValue> = [
            ("service.name".to_string(), "intent-worker".into()),
            ("host.name".to_string(), "test-host".into()),
        ]
        .into();
        let spans = receiver.spans();
        assert_eq!(
            spans[0],
            Span {
                trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
                span_id: "00f067aa0ba902b7".into(),
                parent_span_id: Some("b7ad6b7169203331".into()),
                trace_state: "vendor=abc".into(),
                flags: 0x301,
                name: "intent.receive".into(),
                kind: SpanKind::Consumer,
                start_time_unix_nano: 1_000,
                end_time_unix_nano: 2_000,
                attributes: [
                    ("intent.tenant".to_string(), "north-shop".into()),
                    ("intent.attempt".to_string(), 2i64.into()),
                    ("intent.ratio".to_string(), 0.5.into()),
                    ("intent.replay".to_string(), true.into()),
                    (
                        "intent.tags".to_string(),
                        AttrValue::Array(vec!["a".into()])
                    ),
                ]
                .into(),
                events: vec![Event {
                    name: "recorded".into(),
                    time_unix_nano: 1_500,
                    attributes: [("state".to_string(), "dispatching".into())].into(),
                }],
                links: vec![Link {
                    trace_id: "0af7651916cd43dd8448eb211c80319c".into(),
                    span_id: "00000000000000aa".into(),
                    trace_state: String::new(),
                    attributes: [("link.kind".to_string(), "earlier-delivery".into())].into(),
                }],
                status: Status {
                    code: StatusCode::Error,
                    message: "downstream said 503".into(),
                },
                service_name: "intent-worker".into(),
                resource: resource.clone(),
                scope_name: "intent-worker".into(),
            }
        );
        assert_eq!(spans[0].parent_is_remote(), Some(true));
        assert_eq!(spans[0].attr_str("intent.tenant"), Some("north-shop"));
        assert_eq!(spans[1].parent_span_id, None);
        assert_eq!(spans[1].kind, SpanKind::Unspecified);
        assert_eq!(spans[1].status, Status::default());
        assert_eq!(spans[1].parent_is_remote(), None);
        assert_eq!(spans[1].resource, resource);
        assert_eq!(receiver.requests(), 1);
        assert!(receiver.refusals().is_empty());

        let found = receiver
            .wait_for_spans("the root span", Duration::from_secs(1), 1, |s| {
                s.name == "root"
            })
            .await;
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].span_id, "b7ad6b7169203331");
    }

    #[tokio::test]
    async fn what_it_cannot_read_is_refused_counted_and_kept_out() {
        let receiver = OtlpReceiver::start();
        let valid = request(vec![proto::Span {
            trace_id: bytes("4bf92f3577b34da6a3ce929d0e0e4736"),
            span_id: bytes("00f067aa0ba902b7"),
            name: "x".into(),
            ..Default::default()
        }])
        .encode_to_vec();
        let gzip = post(
            &receiver,
            &[PROTOBUF, ("content-encoding", "gzip")],
            valid.clone(),
        )
        .await;
        assert_eq!(gzip.status(), 415);
        let json = post(
            &receiver,
            &[("content-type", "application/json")],
            b"{}".to_vec(),
        )
        .await;
        assert_eq!(json.status(), 415);
        let garbage = post(&receiver, &[PROTOBUF], vec![0xff, 0xff, 0xff]).await;
        assert_eq!(garbage.status(), 400);
        let short_id = request(vec![proto::Span {
            trace_id: bytes("4bf92f35"),
            span_id: bytes("00f067aa0ba902b7"),
            name: "short".into(),
            ..Default::default()
        }]);
        let short = post(&receiver, &[PROTOBUF], short_id.encode_to_vec()).await;
        assert_eq!(short.status(), 400);
        let get = crate::http()
            .get(receiver.traces_url())
            .send()
            .await
            .unwrap();
        assert_eq!(get.status(), 405);
        let metrics = crate::http()
            .post(format!("{}/v1/metrics", receiver.endpoint()))
            .header(PROTOBUF.0, PROTOBUF.1)
            .body(valid)
            .send()
            .await
            .unwrap();
        assert_eq!(metrics.status(), 404);

        assert!(receiver.spans().is_empty(), "{}", receiver.dump());
        assert_eq!(receiver.requests(), 6);
        let refusals = receiver.refusals();
        assert_eq!(refusals.len(), 6, "{refusals:?}");
        assert!(refusals[0].contains("gzip"), "{refusals:?}");
        assert!(refusals[3].contains("trace_id has 4 bytes"), "{refusals:?}");
    }

    #[tokio::test]
    async fn a_timeout_names_what_was_awaited_and_dumps_what_arrived() {
        let receiver = OtlpReceiver::start();
        let one = request(vec![proto::Span {
            trace_id: bytes("4bf92f3577b34da6a3ce929d0e0e4736"),
            span_id: bytes("00f067aa0ba902b7"),
            name: "intent.receive".into(),
            attributes: vec![kv("intent.tenant", s("north-shop"))],
            ..Default::default()
        }]);
        post(&receiver, &[PROTOBUF], one.encode_to_vec()).await;
        let waited = tokio::spawn(async move {
            receiver
                .wait_for_spans("a dispatch span", Duration::from_millis(200), 1, |s| {
                    s.name == "intent.dispatch"
                })
                .await
        })
        .await;
        let panic = waited.expect_err("no such span arrived");
        let message = panic
            .into_panic()
            .downcast::<String>()
            .map(|m| *m)
            .unwrap_or_default();
        assert!(message.contains("waiting for a dispatch span"), "{message}");
        assert!(
            message.contains(
                "[intent-worker] \"intent.receive\" unspecified \
                 trace=4bf92f3577b34da6a3ce929d0e0e4736 span=00f067aa0ba902b7 parent=- \
                 {intent.tenant=\"north-shop\"}"
            ),
            "{message}"
        );
    }

    /// The real exporter the worker uses (the SDK's batch processor, OTLP/HTTP protobuf over
    /// reqwest's blocking client) against the receiver: what it sends is decoded exactly.
    #[test]
    fn the_sdk_exporter_is_decoded_exactly() {
        use opentelemetry::trace::{
            Span as _, SpanContext, SpanId, Status as OtelStatus, TraceContextExt as _, TraceFlags,
            TraceId, TraceState, Tracer as _, TracerProvider as _,
        };
        use opentelemetry::{Context, KeyValue as OtelKeyValue};
        use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
        use std::time::{SystemTime, UNIX_EPOCH};

        let receiver = OtlpReceiver::start();
        // reqwest is built without a crypto provider of its own (see crate::http_builder).
        worker::tls::install_default_provider();
        let client = reqwest::blocking::Client::builder()
            .build()
            .expect("blocking client");
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(client)
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(receiver.traces_url())
            .build()
            .expect("OTLP exporter");
        // An empty builder: no detector reads this process's OTEL_* variables.
        let resource = opentelemetry_sdk::Resource::builder_empty()
            .with_service_name("otlp-receiver-test")
            .with_attribute(OtelKeyValue::new("deployment.environment", "test"))
            .build();
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("e2e-otlp");

        let remote_parent = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
            SpanId::from_hex("00f067aa0ba902b7").unwrap(),
            TraceFlags::SAMPLED,
            true,
            TraceState::from_key_value([("vendor", "abc")]).unwrap(),
        );
        let linked = SpanContext::new(
            TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap(),
            SpanId::from_hex("b7ad6b7169203331").unwrap(),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        let start = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
        let event_at = start + Duration::from_millis(3);
        let end = start + Duration::from_millis(7);
        let parent_cx = Context::new().with_remote_span_context(remote_parent);
        let mut span = tracer
            .span_builder("refund send")
            .with_kind(opentelemetry::trace::SpanKind::Client)
            .with_start_time(start)
            .with_attributes([
                OtelKeyValue::new("intent.tenant", "north-shop"),
                OtelKeyValue::new("intent.attempt", 2i64),
                OtelKeyValue::new("intent.replay", false),
            ])
            .with_links(vec![opentelemetry::trace::Link::new(
                linked,
                vec![OtelKeyValue::new("link.reason", "redelivery")],
                0,
            )])
            .start_with_context(&tracer, &parent_cx);
        span.add_event_with_timestamp(
            "response",
            event_at,
            vec![OtelKeyValue::new("http.status", 503i64)],
        );
        span.set_status(OtelStatus::error("downstream said 503"));
        let span_id = format!("{}", span.span_context().span_id());
        span.end_with_timestamp(end);
        provider.shutdown().expect("flush and stop the exporter");

        let nanos = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64;
        let spans = receiver.spans();
        assert_eq!(
            spans,
            vec![Span {
                trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
                span_id,
                parent_span_id: Some("00f067aa0ba902b7".into()),
                trace_state: "vendor=abc".into(),
                // Sampled, and "the parent is remote" said and set.
                flags: 0x301,
                name: "refund send".into(),
                kind: SpanKind::Client,
                start_time_unix_nano: nanos(start),
                end_time_unix_nano: nanos(end),
                attributes: [
                    ("intent.tenant".to_string(), "north-shop".into()),
                    ("intent.attempt".to_string(), 2i64.into()),
                    ("intent.replay".to_string(), false.into()),
                ]
                .into(),
                events: vec![Event {
                    name: "response".into(),
                    time_unix_nano: nanos(event_at),
                    attributes: [("http.status".to_string(), 503i64.into())].into(),
                }],
                links: vec![Link {
                    trace_id: "0af7651916cd43dd8448eb211c80319c".into(),
                    span_id: "b7ad6b7169203331".into(),
                    trace_state: String::new(),
                    attributes: [("link.reason".to_string(), "redelivery".into())].into(),
                }],
                status: Status {
                    code: StatusCode::Error,
                    message: "downstream said 503".into(),
                },
                service_name: "otlp-receiver-test".into(),
                resource: [
                    ("service.name".to_string(), "otlp-receiver-test".into()),
                    ("deployment.environment".to_string(), "test".into()),
                ]
                .into(),
                scope_name: "e2e-otlp".into(),
            }],
            "{}",
            receiver.dump()
        );
        assert_eq!(spans[0].parent_is_remote(), Some(true));
        assert_eq!(receiver.requests(), 1);
    }
}
