//! W3C trace context on the agent's side, library paths: every publish (`publish_with`,
//! `publish_encoded_with`, `publish_batch_with`, `send_and_wait_with`) carries the caller's
//! context as the `traceparent`/`tracestate` headers; OpenTelemetry's own current context is
//! passed through when nothing records spans; no context, no headers; the outbox keeps the
//! context with the row and the relay sends it. (Spans recorded by an OpenTelemetry layer:
//! `trace_spans.rs`, a process of its own.) Against the real RabbitMQ and Postgres (see
//! `support`).

mod support;

use std::time::Duration;

use opentelemetry::trace::TraceContextExt as _;
use protocol::trace::{TraceContext, TraceParent};
use publisher::publish::Encoded;
use publisher::{AnswerConfig, Outbox, PublishOptions, Publisher, Relay, RelayConfig, Traced};
use support::{intent, Catcher, TestDb, GOOD, OTHER};
use tracing::Instrument as _;

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

#[tokio::test]
async fn an_explicit_context_arrives_as_headers_on_every_publish_path() {
    let catcher = Catcher::new("explicit").await;
    let results = support::unique("results");
    let publisher = publisher_for(&catcher).await.with_answers(AnswerConfig {
        results_exchange: results.clone(),
        ..AnswerConfig::default()
    });
    let with_state = PublishOptions::new().with_trace(Some(context(GOOD, Some("rojo=1,congo=2"))));
    let plain = PublishOptions::new().with_trace(Some(context(OTHER, None)));

    publisher
        .publish_with(&intent("north", "single"), &with_state)
        .await
        .unwrap();
    let body = intent("north", "encoded").to_json();
    publisher
        .publish_encoded_with("north", "encoded", &body, &plain)
        .await
        .unwrap();
    let (b1, b2) = (
        intent("north", "batch-1").to_json(),
        intent("north", "batch-2").to_json(),
    );
    let batch = [
        Traced {
            intent: Encoded {
                tenant: "north",
                action_id: "batch-1",
                body: &b1,
            },
            tool: Some("refund"),
            options: with_state.clone(),
        },
        // The plain form of a batch item: the current context, none here.
        Traced::from(Encoded {
            tenant: "north",
            action_id: "batch-2",
            body: &b2,
        }),
    ];
    for result in publisher.publish_batch_with(&batch).await {
        result.unwrap();
    }
    // No worker answers: the intent is published, then the wait ends without an answer.
    let waited = publisher
        .send_and_wait_with(
            &intent("north", "waited"),
            Duration::from_millis(200),
            &plain,
        )
        .await;
    assert!(
        matches!(waited, Err(publisher::WaitError::NoAnswer { .. })),
        "{waited:?}"
    );

    let got = catcher.take(5).await;
    let single = &got["north:single"];
    assert_eq!(single.traceparent(), Some(GOOD));
    assert_eq!(single.tracestate(), Some("rojo=1,congo=2"));
    assert_eq!(single.body, intent("north", "single").to_json());
    assert_eq!(got["north:encoded"].traceparent(), Some(OTHER));
    assert_eq!(got["north:encoded"].tracestate(), None);
    assert_eq!(got["north:batch-1"].traceparent(), Some(GOOD));
    assert_eq!(got["north:batch-1"].tracestate(), Some("rojo=1,congo=2"));
    assert!(
        got["north:batch-2"].headers.is_empty(),
        "{:?}",
        got["north:batch-2"]
    );
    assert_eq!(got["north:waited"].traceparent(), Some(OTHER));

    publisher.close().await.ok();
    catcher.delete().await;
    Catcher::delete_exchange(&results).await;
}

#[tokio::test]
async fn without_any_context_a_publish_has_no_trace_headers() {
    let catcher = Catcher::new("none").await;
    let publisher = publisher_for(&catcher).await;
    publisher.publish(&intent("north", "plain")).await.unwrap();
    // A span with no OpenTelemetry layer recording it has no context either.
    publisher
        .publish(&intent("north", "in-span"))
        .instrument(tracing::info_span!("agent step"))
        .await
        .unwrap();
    for _ in 0..2 {
        let caught = catcher.next().await;
        assert!(caught.headers.is_empty(), "{caught:?}");
    }
    publisher.close().await.ok();
    catcher.delete().await;
}

#[tokio::test]
async fn opentelemetrys_current_context_is_passed_through_when_nothing_records() {
    let catcher = Catcher::new("otel-api").await;
    let publisher = publisher_for(&catcher).await;
    let cx = context(GOOD, Some("vendor=x"));
    // An application that uses the OpenTelemetry API directly (no `tracing` layer).
    let attached = opentelemetry::Context::new()
        .with_remote_span_context(kit::otel::span_context(&cx))
        .attach();
    publisher.publish(&intent("north", "api")).await.unwrap();
    drop(attached);
    let caught = catcher.next().await;
    assert_eq!(caught.traceparent(), Some(GOOD));
    assert_eq!(caught.tracestate(), Some("vendor=x"));
    publisher.close().await.ok();
    catcher.delete().await;
}

#[tokio::test]
async fn the_outbox_keeps_the_context_and_the_relay_sends_it() {
    let db = TestDb::new().await;
    Outbox::migrate(&db.pool).await.unwrap();
    publisher::relay::check_table(&db.pool).await.unwrap();
    let catcher = Catcher::new("outbox").await;

    let mut tx = db.pool.begin().await.unwrap();
    let explicit = PublishOptions::new().with_trace(Some(context(GOOD, Some("rojo=1"))));
    Outbox::enqueue_with(&mut tx, &intent("north", "explicit"), &explicit)
        .await
        .unwrap();
    Outbox::enqueue(&mut tx, &intent("north", "none"))
        .await
        .unwrap();
    {
        // The current context (OpenTelemetry's, here) is what a plain enqueue keeps.
        let _attached = opentelemetry::Context::new()
            .with_remote_span_context(kit::otel::span_context(&context(OTHER, None)))
            .attach();
        Outbox::enqueue(&mut tx, &intent("north", "current"))
            .await
            .unwrap();
    }
    // Rows written by another language with plain SQL: a malformed traceparent is ignored, a
    // malformed tracestate dropped alone.
    for (action, traceparent, tracestate) in [
        ("garbage", "garbage", None),
        ("bad-state", GOOD, Some("Not=Valid=State")),
    ] {
        sqlx::query(
            "INSERT INTO intent_outbox (tenant, action_id, body, traceparent, tracestate)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind("north")
        .bind(action)
        .bind(String::from_utf8(intent("north", action).to_json()).unwrap())
        .bind(traceparent)
        .bind(tracestate)
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();

    let stored: Vec<(String, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT action_id, traceparent, tracestate FROM intent_outbox ORDER BY id LIMIT 3",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        stored,
        [
            ("explicit".into(), Some(GOOD.into()), Some("rojo=1".into())),
            ("none".into(), None, None),
            ("current".into(), Some(OTHER.into()), None),
        ]
    );

    let relay = Relay::new(
        db.pool.clone(),
        publisher_for(&catcher).await,
        RelayConfig::default(),
    );
    let report = relay.step().await.unwrap();
    assert_eq!((report.claimed, report.sent), (5, 5), "{report:?}");
    let got = catcher.take(5).await;
    assert_eq!(got["north:explicit"].traceparent(), Some(GOOD));
    assert_eq!(got["north:explicit"].tracestate(), Some("rojo=1"));
    assert!(
        got["north:none"].headers.is_empty(),
        "{:?}",
        got["north:none"]
    );
    assert_eq!(got["north:current"].traceparent(), Some(OTHER));
    assert!(
        got["north:garbage"].headers.is_empty(),
        "{:?}",
        got["north:garbage"]
    );
    assert_eq!(got["north:bad-state"].traceparent(), Some(GOOD));
    assert_eq!(got["north:bad-state"].tracestate(), None);

    catcher.delete().await;
    db.drop_db().await;
}
