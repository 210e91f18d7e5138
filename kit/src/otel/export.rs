//! OTLP/HTTP export of our spans (feature `otel-export`), configured by OpenTelemetry's standard
//! variables and off unless they ask for it.
//!
//! - **On** when `OTEL_TRACES_EXPORTER=otlp`, or when it is unset and `OTEL_EXPORTER_OTLP_ENDPOINT`
//!   or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set. **Off** when none is set,
//!   `OTEL_TRACES_EXPORTER=none`, or `OTEL_SDK_DISABLED=true`; off, no exporter, processor or
//!   layer exists at all.
//! - The protocol is `http/protobuf` (the only one built in); `grpc` or `http/json` in
//!   `OTEL_EXPORTER_OTLP_PROTOCOL` / `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` is refused at start-up.
//! - Endpoint, headers, timeout and compression come from the OTLP variables as the
//!   `opentelemetry-otlp` crate reads them; the sampler from `OTEL_TRACES_SAMPLER` /
//!   `OTEL_TRACES_SAMPLER_ARG`, resources from `OTEL_RESOURCE_ATTRIBUTES`, the batch processor's
//!   queue and delay from `OTEL_BSP_*`, as the SDK reads them. `OTEL_SERVICE_NAME` (or a
//!   `service.name` resource attribute) names the service, else the binary's default.
//! - The batch processor runs on a thread of its own with a blocking HTTP client that trusts
//!   the process's [`Trust`](crate::tls::Trust): spans leave the hot path as a queue push, and
//!   a full queue drops spans (the SDK counts and logs them), never blocks a worker.
//! - [`Export::shutdown`] flushes what is queued within a budget, on a blocking thread.
//! - **Sampling** is `OTEL_TRACES_SAMPLER` (default `parentbased_always_on`), with one addition:
//!   a root span linked to a sampled span is sampled (`FollowLinks`). A recovery round or an
//!   operator action, a new root in the action's trace linked to its intent, is then recorded
//!   exactly when the intent's trace is; a commit batch, when something it carried is.
//! - [`decide`] asks the same sampler **before** a span exists, so hot paths create no span at
//!   all for a trace that will not be recorded (at a 1 % ratio, 99 % of intents cost no span).

use std::cell::Cell;
use std::time::Duration;

use std::sync::OnceLock;

use opentelemetry::trace::{
    Link, SpanId, SpanKind, TraceContextExt as _, TraceId, TracerProvider as _,
};
use opentelemetry::KeyValue;
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::trace::{
    Config, IdGenerator, RandomIdGenerator, SamplingDecision, SamplingResult, SdkTracer,
    SdkTracerProvider, ShouldSample,
};
use opentelemetry_sdk::Resource;
use protocol::trace::TraceContext;

/// Why the export settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("{var}={value:?}: {reason}")]
    Setting {
        var: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("cannot build the OTLP exporter: {0}")]
    Build(String),
}

/// An installed trace exporter: its tracer (for the layer) and its provider (to flush).
pub struct Export {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    /// Where spans go, for the start-up log line.
    pub endpoint: String,
    /// `service.name` as exported.
    pub service: String,
}

/// The process environment, empty values counted as unset.
fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Whether the standard variables (read through `var`) turn export on, and where to;
/// `Ok(None)` when they leave it off.
fn endpoint_if_on(var: impl Fn(&str) -> Option<String>) -> Result<Option<String>, ExportError> {
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    let traces = var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    let general = var("OTEL_EXPORTER_OTLP_ENDPOINT");
    match var("OTEL_TRACES_EXPORTER").as_deref().map(str::trim) {
        Some("none") => return Ok(None),
        Some("otlp") => {}
        Some(other) => {
            return Err(ExportError::Setting {
                var: "OTEL_TRACES_EXPORTER",
                value: other.to_string(),
                reason: "only \"otlp\" (OTLP over HTTP/protobuf) or \"none\" is supported",
            })
        }
        None if traces.is_none() && general.is_none() => return Ok(None),
        None => {}
    }
    for protocol_var in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        if let Some(p) = var(protocol_var) {
            if p.trim() != "http/protobuf" {
                return Err(ExportError::Setting {
                    var: if protocol_var.contains("TRACES") {
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
                    } else {
                        "OTEL_EXPORTER_OTLP_PROTOCOL"
                    },
                    value: p,
                    reason:
                        "only http/protobuf is supported (no gRPC or JSON exporter is built in)",
                });
            }
            break;
        }
    }
    // The resolution opentelemetry-otlp applies: the signal's own URL as given, else the
    // general one with /v1/traces, else the default collector on this host.
    Ok(Some(match (traces, general) {
        (Some(t), _) => t,
        (None, Some(g)) => format!("{}/v1/traces", g.trim_end_matches('/')),
        (None, None) => "http://localhost:4318/v1/traces".to_string(),
    }))
}

/// The service name: `OTEL_SERVICE_NAME`, else `service.name` in `OTEL_RESOURCE_ATTRIBUTES`,
/// else `default`.
fn service_name(var: impl Fn(&str) -> Option<String>, default: &str) -> String {
    var("OTEL_SERVICE_NAME")
        .or_else(|| {
            var("OTEL_RESOURCE_ATTRIBUTES").and_then(|attrs| {
                attrs.split(',').find_map(|kv| {
                    let (k, v) = kv.split_once('=')?;
                    (k.trim() == "service.name" && !v.trim().is_empty())
                        .then(|| v.trim().to_string())
                })
            })
        })
        .unwrap_or_else(|| default.to_string())
}

/// Builds the exporter when the standard variables turn it on (`Ok(None)`: export off).
/// `default_service` names the service when no variable does; `trust` verifies an `https://`
/// endpoint.
pub fn from_env(
    default_service: &str,
    trust: &crate::tls::Trust,
) -> Result<Option<Export>, ExportError> {
    let Some(endpoint) = endpoint_if_on(process_env)? else {
        return Ok(None);
    };
    let config = trust.client_config();
    // reqwest's blocking client runs a runtime of its own: build it off any async context.
    let client = std::thread::spawn(move || {
        reqwest::blocking::Client::builder()
            .tls_backend_preconfigured(config)
            .build()
    })
    .join()
    .map_err(|_| ExportError::Build("building the HTTP client panicked".into()))?
    .map_err(|e| ExportError::Build(e.to_string()))?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .build()
        .map_err(|e| ExportError::Build(e.to_string()))?;
    let service = service_name(process_env, default_service);
    let resource = Resource::builder()
        .with_service_name(service.clone())
        .build();
    // The sampler OTEL_TRACES_SAMPLER names (the SDK's own reading of it), shared by the
    // provider and [`decide`].
    let never = process_env("OTEL_TRACES_SAMPLER").is_some_and(|s| s.trim() == "always_off");
    let sampler = FollowLinks {
        inner: Config::default().sampler,
        never,
    };
    let _ = SAMPLER.set(Box::new(sampler.clone()));
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_id_generator(Ids::default())
        .with_sampler(sampler)
        .with_resource(resource)
        .build();
    let tracer = provider.tracer(service.clone());
    Ok(Some(Export {
        provider,
        tracer,
        endpoint: crate::url::redact(&endpoint),
        service,
    }))
}

impl Export {
    /// The tracer the `tracing` layer records into.
    pub fn tracer(&self) -> SdkTracer {
        self.tracer.clone()
    }

    /// Exports what is queued and stops the processor, waiting at most `budget`. Spans still
    /// queued after it are lost (logged), never waited for past the budget.
    pub async fn shutdown(self, budget: Duration) {
        let provider = self.provider;
        let done = tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(budget));
        match tokio::time::timeout(budget + Duration::from_millis(500), done).await {
            Ok(Ok(Ok(()))) => tracing::debug!("trace export flushed"),
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "trace export did not flush cleanly"),
            Ok(Err(e)) => tracing::warn!(error = %e, "trace export flush failed"),
            Err(_) => tracing::warn!(
                budget_ms = budget.as_millis() as u64,
                "trace export flush ran out of time; spans still queued are lost"
            ),
        }
    }
}

/// The exporter's sampler, for [`decide`]; set once an exporter is built.
static SAMPLER: OnceLock<Box<dyn ShouldSample>> = OnceLock::new();

/// `OTEL_TRACES_SAMPLER`, except that a root span (no parent) linked to a sampled span is
/// sampled: it continues a recorded trace (a recovery round linked to its intent) or carries a
/// recorded action (a commit batch). `always_off` (`never`) stays off.
#[derive(Debug, Clone)]
struct FollowLinks {
    inner: Box<dyn ShouldSample>,
    never: bool,
}

impl ShouldSample for FollowLinks {
    fn should_sample(
        &self,
        parent_context: Option<&opentelemetry::Context>,
        trace_id: TraceId,
        name: &str,
        span_kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        let is_root = parent_context.is_none_or(|cx| !cx.span().span_context().is_valid());
        if !self.never && is_root && links.iter().any(|l| l.span_context.is_sampled()) {
            return SamplingResult {
                decision: SamplingDecision::RecordAndSample,
                attributes: Vec::new(),
                trace_state: Default::default(),
            };
        }
        self.inner
            .should_sample(parent_context, trace_id, name, span_kind, attributes, links)
    }
}

/// What the exporter's sampler will make of a span about to be created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Not recorded: create no span (and send the received context on unchanged).
    Drop,
    /// Recorded, as the child of the given parent.
    Child,
    /// Recorded, as a root with this trace id (give it with [`with_trace_id`] so the SDK's
    /// decision, made again when the span starts, is the same).
    Root([u8; 16]),
}

/// Asks the exporter's sampler whether a span with remote `parent` (or, without one, a new
/// root) would be recorded. [`Decision::Drop`] when no exporter is installed.
pub fn decide(parent: Option<&TraceContext>) -> Decision {
    let Some(sampler) = SAMPLER.get() else {
        return Decision::Drop;
    };
    let sampled = |result: SamplingResult| result.decision == SamplingDecision::RecordAndSample;
    match parent {
        Some(p) => {
            let cx = opentelemetry::Context::new().with_remote_span_context(super::span_context(p));
            let trace_id = TraceId::from_bytes(p.parent.trace_id);
            let r = sampler.should_sample(Some(&cx), trace_id, "", &SpanKind::Internal, &[], &[]);
            if sampled(r) {
                Decision::Child
            } else {
                Decision::Drop
            }
        }
        None => {
            let trace_id = RandomIdGenerator::default().new_trace_id();
            let r = sampler.should_sample(None, trace_id, "", &SpanKind::Internal, &[], &[]);
            if sampled(r) {
                Decision::Root(trace_id.to_bytes())
            } else {
                Decision::Drop
            }
        }
    }
}

/// Whether a root span linked to these contexts would be recorded (`FollowLinks`): when any
/// of them is sampled, unless the sampler is `always_off`.
pub fn any_sampled<'a>(links: impl IntoIterator<Item = &'a TraceContext>) -> bool {
    let Some(sampler) = SAMPLER.get() else {
        return false;
    };
    let links: Vec<Link> = links
        .into_iter()
        .filter(|cx| cx.parent.sampled())
        .take(1)
        .map(|cx| Link::with_context(super::span_context(cx)))
        .collect();
    !links.is_empty()
        && sampler
            .should_sample(None, TraceId::INVALID, "", &SpanKind::Internal, &[], &links)
            .decision
            == SamplingDecision::RecordAndSample
}

thread_local! {
    /// A trace id the next root span started on this thread must use (see [`with_trace_id`]).
    static NEXT_TRACE_ID: Cell<Option<[u8; 16]>> = const { Cell::new(None) };
}

/// Runs `f` with the id generator handing out `trace_id` for the one root span `f` starts.
/// [`super::root_in_trace`] uses it: a span started in `f` without a parent becomes a root of
/// that trace.
pub fn with_trace_id<R>(trace_id: [u8; 16], f: impl FnOnce() -> R) -> R {
    NEXT_TRACE_ID.with(|c| c.set(Some(trace_id)));
    let out = f();
    NEXT_TRACE_ID.with(|c| c.set(None));
    out
}

/// Random ids, except a trace id asked for by [`with_trace_id`].
#[derive(Debug, Default)]
struct Ids {
    random: RandomIdGenerator,
}

impl IdGenerator for Ids {
    fn new_trace_id(&self) -> TraceId {
        match NEXT_TRACE_ID.with(|c| c.take()) {
            Some(id) => TraceId::from_bytes(id),
            None => self.random.new_trace_id(),
        }
    }

    fn new_span_id(&self) -> SpanId {
        self.random.new_span_id()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn export_is_off_unless_the_standard_variables_ask_for_it() {
        assert!(endpoint_if_on(env(&[])).unwrap().is_none());
        let on = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4318/")];
        assert_eq!(
            endpoint_if_on(env(&on)).unwrap().as_deref(),
            Some("http://jaeger:4318/v1/traces")
        );
        let traces = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://a:4318"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://b:4318/custom"),
        ];
        assert_eq!(
            endpoint_if_on(env(&traces)).unwrap().as_deref(),
            Some("http://b:4318/custom")
        );
        let otlp = [("OTEL_TRACES_EXPORTER", "otlp")];
        assert_eq!(
            endpoint_if_on(env(&otlp)).unwrap().as_deref(),
            Some("http://localhost:4318/v1/traces")
        );
        for off in [
            [("OTEL_TRACES_EXPORTER", "none"), on[0]],
            [("OTEL_SDK_DISABLED", "TRUE"), on[0]],
        ] {
            assert!(endpoint_if_on(env(&off)).unwrap().is_none(), "{off:?}");
        }
    }

    #[test]
    fn an_exporter_or_protocol_we_do_not_have_is_refused_by_name() {
        let zipkin = [("OTEL_TRACES_EXPORTER", "zipkin")];
        let e = endpoint_if_on(env(&zipkin)).unwrap_err().to_string();
        assert!(e.starts_with("OTEL_TRACES_EXPORTER=\"zipkin\""), "{e}");
        let grpc = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://a:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ];
        let e = endpoint_if_on(env(&grpc)).unwrap_err().to_string();
        assert!(e.starts_with("OTEL_EXPORTER_OTLP_PROTOCOL=\"grpc\""), "{e}");
        // The signal's own protocol wins over the general one.
        let both = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://a:4318"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ];
        assert!(endpoint_if_on(env(&both)).is_ok());
    }

    #[test]
    fn the_service_name_comes_from_the_variables_first() {
        assert_eq!(service_name(env(&[]), "intent-worker"), "intent-worker");
        let attrs = [(
            "OTEL_RESOURCE_ATTRIBUTES",
            "deployment.environment=prod,service.name=w1",
        )];
        assert_eq!(service_name(env(&attrs), "intent-worker"), "w1");
        let both = [attrs[0], ("OTEL_SERVICE_NAME", "w2")];
        assert_eq!(service_name(env(&both), "intent-worker"), "w2");
    }

    #[test]
    fn a_requested_trace_id_is_used_once_then_random_again() {
        let ids = Ids::default();
        let wanted = [7u8; 16];
        let first = with_trace_id(wanted, || ids.new_trace_id());
        assert_eq!(first.to_bytes(), wanted);
        assert_ne!(ids.new_trace_id().to_bytes(), wanted);
        // Unused inside the closure: not left behind for a later span.
        with_trace_id(wanted, || ());
        assert_ne!(ids.new_trace_id().to_bytes(), wanted);
    }
}
