//! W3C trace context on the agent's side with spans recorded: inside a span that an
//! OpenTelemetry layer records, a publish runs in its own `publish intents` producer span (the
//! messaging conventions' name, kind and attributes), which is exported and whose context is
//! what the message carries; an explicit context becomes that span's parent; a failed publish
//! is a failed span. Its own test binary: `tracing` caches per call site whether any subscriber
//! wants it, and the other suites' threads run without one.

mod support;

use opentelemetry::trace::{SpanKind, Status, TracerProvider as _};
use opentelemetry::KeyValue;
use std::sync::{Arc, Mutex};

use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use protocol::trace::{TraceContext, TraceParent};
use publisher::{PublishOptions, Publisher};
use support::{intent, Catcher, OTHER};
use tracing::Instrument as _;
use tracing_subscriber::layer::SubscriberExt as _;

fn context(traceparent: &str, state: Option<&str>) -> TraceContext {
    TraceContext {
        parent: TraceParent::parse(traceparent).unwrap(),
        state: state.map(str::to_owned),
    }
}

async fn publisher_for(catcher: &Catcher) -> Publisher {
    Publisher::connect(&support::amqp_url(), &catcher.exchange)
        .await
        .expect("connect")
}

/// The spans a provider exported, kept in memory. The SDK has one behind its `testing` feature,
/// but that feature (with `opentelemetry/testing`, metrics and logs) would give every crate on
/// the OpenTelemetry stack a second feature set, compiled again for the test build.
#[derive(Debug, Clone, Default)]
struct Exported(Arc<Mutex<Vec<SpanData>>>);

impl SpanExporter for Exported {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        self.0.lock().expect("not poisoned").extend(batch);
        Ok(())
    }
}

/// A `tracing` subscriber whose OpenTelemetry layer records every span into memory, installed
/// for this thread (the tests' current-thread runtime) while the guard lives.
struct Recorder {
    exporter: Exported,
    provider: SdkTracerProvider,
    _default: tracing::subscriber::DefaultGuard,
}

impl Recorder {
    fn install() -> Recorder {
        let exporter = Exported::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("trace-test")));
        Recorder {
            exporter,
            provider,
            _default: tracing::subscriber::set_default(subscriber),
        }
    }

    fn spans(&self) -> Vec<SpanData> {
        self.provider.force_flush().unwrap();
        self.exporter.0.lock().expect("not poisoned").clone()
    }
}

fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv: &&KeyValue| kv.key.as_str() == key)
        .map(|kv| kv.value.as_str().into_owned())
}

#[tokio::test]
async fn inside_a_recorded_span_the_publish_span_is_exported_and_its_context_sent() {
    let recorder = Recorder::install();
    let catcher = Catcher::new("recorded").await;
    let publisher = publisher_for(&catcher).await;

    let step = tracing::info_span!("agent step");
    let step_cx = kit::otel::context_of(&step).expect("recorded");
    publisher
        .publish(&intent("north", "in-span"))
        .instrument(step.clone())
        .await
        .unwrap();
    // An explicit context wins over the current span: it is the publish span's parent.
    let explicit = context(OTHER, Some("rojo=1"));
    publisher
        .publish_with(
            &intent("north", "explicit"),
            &PublishOptions::new().with_trace(Some(explicit.clone())),
        )
        .instrument(step.clone())
        .await
        .unwrap();
    drop(step);

    let got = catcher.take(2).await;
    let spans = recorder.spans();
    let publish_span = |action: &str| {
        spans
            .iter()
            .find(|s| {
                s.name == "publish intents"
                    && attribute(s, "intent_worker.action_id").as_deref() == Some(action)
            })
            .unwrap_or_else(|| panic!("no publish span for {action}: {spans:#?}"))
    };

    let span = publish_span("in-span");
    let sent = TraceParent::parse(got["north:in-span"].traceparent().unwrap()).unwrap();
    // Same trace as the agent's span; the parent named on the wire is the publish span.
    assert_eq!(sent.trace_id, step_cx.parent.trace_id);
    assert_eq!(sent.parent_id, span.span_context.span_id().to_bytes());
    assert_eq!(
        span.parent_span_id.to_bytes(),
        step_cx.parent.parent_id,
        "the publish span is the agent span's child"
    );
    assert_eq!(span.span_kind, SpanKind::Producer);
    for (key, value) in [
        ("messaging.system", "rabbitmq"),
        ("messaging.operation.type", "send"),
        ("messaging.operation.name", "publish"),
        ("messaging.destination.name", catcher.exchange.as_str()),
        ("messaging.rabbitmq.destination.routing_key", "north"),
        ("messaging.message.id", "north:in-span"),
        ("intent_worker.tenant", "north"),
        ("intent_worker.action_id", "in-span"),
        ("intent_worker.tool", "refund"),
    ] {
        assert_eq!(attribute(span, key).as_deref(), Some(value), "{key}");
    }

    let span = publish_span("explicit");
    let sent = TraceParent::parse(got["north:explicit"].traceparent().unwrap()).unwrap();
    assert_eq!(sent.trace_id, explicit.parent.trace_id);
    assert_eq!(sent.parent_id, span.span_context.span_id().to_bytes());
    assert_eq!(span.parent_span_id.to_bytes(), explicit.parent.parent_id);
    assert_eq!(got["north:explicit"].tracestate(), Some("rojo=1"));

    // A publish that fails is a failed span, with the reason.
    let nowhere_exchange = support::unique("nowhere");
    let nowhere = Publisher::connect(&support::amqp_url(), &nowhere_exchange)
        .await
        .unwrap();
    nowhere.declare_exchange().await.unwrap();
    let error = nowhere
        .publish(&intent("north", "unroutable"))
        .await
        .unwrap_err();
    assert!(
        matches!(error, publisher::PublishError::Unroutable { .. }),
        "{error:?}"
    );
    let spans = recorder.spans();
    let failed = spans
        .iter()
        .find(|s| attribute(s, "intent_worker.action_id").as_deref() == Some("unroutable"))
        .expect("the failed publish's span");
    assert!(matches!(failed.status, Status::Error { .. }), "{failed:?}");
    assert_eq!(
        attribute(failed, "error.type").as_deref(),
        Some("unroutable")
    );

    nowhere.close().await.ok();
    Catcher::delete_exchange(&nowhere_exchange).await;
    publisher.close().await.ok();
    catcher.delete().await;
}

#[tokio::test]
async fn the_relay_publishes_each_row_in_its_own_trace_never_under_its_callers_span() {
    let recorder = Recorder::install();
    let db = support::TestDb::new().await;
    publisher::Outbox::migrate(&db.pool).await.unwrap();
    let catcher = Catcher::new("relay-spans").await;
    let mut tx = db.pool.begin().await.unwrap();
    let stored = context(support::GOOD, None);
    publisher::Outbox::enqueue_with(
        &mut tx,
        &intent("north", "traced"),
        &PublishOptions::new().with_trace(Some(stored.clone())),
    )
    .await
    .unwrap();
    // Enqueued outside any span: the row has no context.
    publisher::Outbox::enqueue(&mut tx, &intent("north", "untraced"))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let relay = publisher::Relay::new(
        db.pool.clone(),
        publisher_for(&catcher).await,
        publisher::RelayConfig::default(),
    );
    // Whatever span runs the relay, no row becomes its child.
    let runner = tracing::info_span!("relay runner");
    let runner_cx = kit::otel::context_of(&runner).unwrap();
    let report = relay.step().instrument(runner.clone()).await.unwrap();
    assert_eq!(report.sent, 2, "{report:?}");
    drop(runner);

    let got = catcher.take(2).await;
    let spans = recorder.spans();
    let publish_span = |action: &str| {
        spans
            .iter()
            .find(|s| {
                s.name == "publish intents"
                    && attribute(s, "intent_worker.action_id").as_deref() == Some(action)
            })
            .unwrap_or_else(|| panic!("no publish span for {action}: {spans:#?}"))
    };
    let traced = publish_span("traced");
    assert_eq!(traced.parent_span_id.to_bytes(), stored.parent.parent_id);
    assert_eq!(
        attribute(traced, "intent_worker.tool").as_deref(),
        Some("refund")
    );
    let sent = TraceParent::parse(got["north:traced"].traceparent().unwrap()).unwrap();
    assert_eq!(sent.trace_id, stored.parent.trace_id);
    assert_eq!(sent.parent_id, traced.span_context.span_id().to_bytes());

    let untraced = publish_span("untraced");
    assert_eq!(
        untraced.parent_span_id,
        opentelemetry::trace::SpanId::INVALID
    );
    assert_ne!(
        untraced.span_context.trace_id().to_bytes(),
        runner_cx.parent.trace_id
    );
    let sent = TraceParent::parse(got["north:untraced"].traceparent().unwrap()).unwrap();
    assert_eq!(sent.parent_id, untraced.span_context.span_id().to_bytes());

    catcher.delete().await;
    db.drop_db().await;
}
