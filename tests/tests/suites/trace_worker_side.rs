//! One action followed end to end: the W3C trace context an agent's intent carries (as an
//! OpenTelemetry-instrumented publisher sends it, in AMQP headers) runs through the worker to the
//! downstream's request and back into the result event, and the worker's spans reach a real
//! OTLP/HTTP receiver ([`e2e::OtlpReceiver`]) under the messaging and HTTP conventions. A
//! recovery round after a lost reply and an operator's resolve are new roots of the action's
//! trace, linked to its intent. A garbage header is ignored and counted; with export off
//! nothing is exported and the context passes through unchanged.

use std::time::Duration;

use e2e::otlp::{Span, SpanKind};
use e2e::{cleanup, metric_value, Downstream, Env, OtlpReceiver, Worker, WorkerOptions};
use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(30);
const TENANT: &str = "north-shop";
const ADMIN: &str = "admin-token-for-tracing-tests";

fn key(action: &str) -> String {
    format!("{TENANT}:{action}")
}

/// A fresh sampled W3C context, as an instrumented agent's publish span would send it.
fn agent_context() -> (String, String, String) {
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let span_id = uuid::Uuid::new_v4().simple().to_string()[..16].to_string();
    let tp = format!("00-{trace_id}-{span_id}-01");
    (tp, trace_id, span_id)
}

/// The trace id and parent id of a `traceparent` value.
fn ids(tp: &str) -> (String, String) {
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "not a traceparent: {tp:?}");
    (parts[1].to_string(), parts[2].to_string())
}

/// An agent that publishes raw intents with headers of its choosing and reads its tenant's
/// result events with their headers.
struct RawAgent {
    conn: Connection,
    channel: lapin::Channel,
    exchange: String,
    results: lapin::Consumer,
    /// Results read while waiting for another one.
    seen: Vec<Delivered>,
}

/// One result event and the AMQP headers it arrived with.
struct Delivered {
    body: Value,
    traceparent: Option<String>,
}

impl RawAgent {
    async fn new(env: &Env) -> RawAgent {
        let conn = Connection::connect(&env.amqp_url, Default::default())
            .await
            .unwrap();
        let channel = conn.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let q = channel
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        for binding in protocol::tenant_binding_keys(TENANT) {
            channel
                .queue_bind(
                    q.name().as_str().into(),
                    env.topology.results_exchange.as_str().into(),
                    binding.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
        }
        let results = channel
            .basic_consume(
                q.name().as_str().into(),
                "tracing-test".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        RawAgent {
            conn,
            channel,
            exchange: env.topology.intents_exchange.clone(),
            results,
            seen: Vec::new(),
        }
    }

    /// Publishes a refund-like intent with these trace headers (values as given, garbage too).
    async fn send(
        &self,
        action: &str,
        tool: &str,
        traceparent: Option<&str>,
        tracestate: Option<&str>,
    ) {
        let body = json!({"tenant": TENANT, "action_id": action, "tool": tool,
                          "arguments": {"order": format!("o-{action}"), "amount_cents": 4850}});
        let mut headers = FieldTable::default();
        if let Some(tp) = traceparent {
            headers.insert(
                "traceparent".into(),
                AMQPValue::LongString(LongString::from(tp)),
            );
        }
        if let Some(ts) = tracestate {
            headers.insert(
                "tracestate".into(),
                AMQPValue::LongString(LongString::from(ts)),
            );
        }
        let props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_message_id(key(action).as_str().into())
            .with_headers(headers);
        self.channel
            .basic_publish(
                self.exchange.as_str().into(),
                TENANT.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body.to_string().as_bytes(),
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// The first result about `action` with `status`, read from the queue until it comes;
    /// results about other actions are kept for later calls.
    async fn until(&mut self, action: &str, status: &str) -> Delivered {
        let wanted = |d: &Delivered| d.body["action_id"] == action && d.body["status"] == status;
        if let Some(i) = self.seen.iter().position(wanted) {
            return self.seen.remove(i);
        }
        let deadline = tokio::time::Instant::now() + T;
        loop {
            let next = tokio::time::timeout_at(deadline, self.results.next())
                .await
                .unwrap_or_else(|_| panic!("no {status} result for {action} within {T:?}"))
                .expect("results consumer ended")
                .expect("result delivery");
            next.ack(BasicAckOptions::default()).await.unwrap();
            let body: Value = serde_json::from_slice(&next.data).unwrap();
            let traceparent = next
                .properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get("traceparent").cloned())
                .map(|v| match v {
                    AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into(),
                    other => panic!("traceparent of unexpected type: {other:?}"),
                });
            let delivered = Delivered { body, traceparent };
            if wanted(&delivered) {
                return delivered;
            }
            self.seen.push(delivered);
        }
    }

    async fn close(self) {
        let _ = self.conn.close(200, "".into()).await;
    }
}

/// A worker exporting to `receiver`, flushing spans every 100 ms.
fn traced(opts: WorkerOptions, receiver: &OtlpReceiver) -> WorkerOptions {
    opts.env("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint())
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env("WORKER_LOG_FORMAT", "json")
        // A success is logged at debug.
        .env(
            "RUST_LOG",
            "info,worker::dispatch=debug,lapin=warn,sqlx=warn",
        )
        .env(
            "WORKER_TRACE_URL",
            "http://jaeger.example:16686/trace/{trace_id}",
        )
}

fn in_trace<'a>(spans: &'a [Span], trace_id: &str) -> Vec<&'a Span> {
    spans.iter().filter(|s| s.trace_id == trace_id).collect()
}

fn named<'a>(spans: &'a [Span], name: &str) -> Vec<&'a Span> {
    spans.iter().filter(|s| s.name == name).collect()
}

fn links_to(span: &Span, trace_id: &str, span_id: &str) -> bool {
    span.links
        .iter()
        .any(|l| l.trace_id == trace_id && l.span_id == span_id)
}

async fn admin_get(worker: &Worker, path: &str) -> Value {
    let port = worker.admin_port.expect("admin API");
    e2e::http()
        .get(format!("http://127.0.0.1:{port}{path}"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test]
async fn an_intents_trace_runs_through_the_worker_to_the_downstream_and_back() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let receiver = OtlpReceiver::start();
    let opts = traced(
        WorkerOptions::new(env.standard_tools(ds.port, "")),
        &receiver,
    )
    .with_metrics()
    .with_admin(ADMIN);
    let w = Worker::start(&env, "w", &opts).await;
    let mut agent = RawAgent::new(&env).await;
    let (tp, trace_id, agent_span) = agent_context();
    agent
        .send(
            "refund-traced",
            "refund",
            Some(&tp),
            Some("vendor=opaque-1"),
        )
        .await;
    let result = agent.until("refund-traced", "succeeded").await;

    // The spans of the action, by the conventions.
    let spans = receiver
        .wait_for("the consume and dispatch spans of the trace", T, |all| {
            let t = in_trace(all, &trace_id);
            (t.iter().any(|s| s.name == "process intents")
                && t.iter().any(|s| s.kind == SpanKind::Client))
            .then(|| all.to_vec())
        })
        .await;
    let trace = in_trace(&spans, &trace_id);
    let process = *named(&spans, "process intents")
        .iter()
        .find(|s| s.trace_id == trace_id)
        .unwrap();
    assert_eq!(process.kind, SpanKind::Consumer);
    assert_eq!(process.parent_span_id.as_deref(), Some(agent_span.as_str()));
    assert_eq!(process.service_name, "intent-worker");
    for (k, v) in [
        ("messaging.system", "rabbitmq"),
        ("messaging.operation.type", "process"),
        (
            "messaging.destination.name",
            env.topology.intents_exchange.as_str(),
        ),
        ("messaging.rabbitmq.destination.routing_key", TENANT),
        ("messaging.message.id", key("refund-traced").as_str()),
        ("intent_worker.tenant", TENANT),
        ("intent_worker.action_id", "refund-traced"),
        ("intent_worker.tool", "refund"),
    ] {
        assert_eq!(process.attr_str(k), Some(v), "{k} on {process:?}");
    }
    // One dispatch span per send attempt: an HTTP client span with the action's attributes.
    let send = *trace.iter().find(|s| s.kind == SpanKind::Client).unwrap();
    let client = send;
    assert_eq!(send.name, "POST");
    assert_eq!(
        send.parent_span_id.as_deref(),
        Some(process.span_id.as_str())
    );
    assert_eq!(send.attr_str("intent_worker.outcome"), Some("succeeded"));
    assert_eq!(
        send.attr_str("intent_worker.action_id"),
        Some("refund-traced")
    );
    assert_eq!(
        send.attr("intent_worker.attempt").and_then(|a| a.as_i64()),
        Some(1)
    );
    assert_eq!(
        trace.iter().filter(|s| s.kind == SpanKind::Client).count(),
        1,
        "one send attempt, one dispatch span"
    );
    assert_eq!(client.attr_str("http.request.method"), Some("POST"));
    assert_eq!(client.attr_str("server.address"), Some("127.0.0.1"));
    assert_eq!(
        client.attr("server.port").and_then(|a| a.as_i64()),
        Some(i64::from(ds.port))
    );
    let status = client
        .attr("http.response.status_code")
        .and_then(|a| a.as_i64())
        .expect("status code");
    assert!((200..300).contains(&status), "{client:?}");
    assert!(client.attr("error.type").is_none(), "{client:?}");
    assert!(
        client
            .attr_str("url.full")
            .is_some_and(|u| u.ends_with("/replay/refunds")),
        "{client:?}"
    );

    // The downstream's request carried the client span's context, in the same trace.
    let seen = env.trace_contexts(&key("refund-traced")).await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    let sent = seen[0].traceparent.as_deref().expect("a traceparent");
    assert_eq!(ids(sent), (trace_id.clone(), client.span_id.clone()));
    assert_eq!(seen[0].tracestate.as_deref(), Some("vendor=opaque-1"));

    // The result event carries the context of the span that decided it: the send.
    let answered = result
        .traceparent
        .expect("the result carries a traceparent");
    assert_eq!(ids(&answered), (trace_id.clone(), send.span_id.clone()));

    // The commit batches and the relay round are linked to what they carried.
    let spans = receiver
        .wait_for("ledger and relay spans linked to the action", T, |all| {
            let linked = |name: &str, target: &Span| {
                all.iter()
                    .any(|s| s.name == name && links_to(s, &trace_id, &target.span_id))
            };
            (linked("ledger admit", process)
                && linked("ledger fence", send)
                && linked("ledger complete", send)
                && linked("publish results", send))
            .then(|| all.to_vec())
        })
        .await;
    let relay = spans
        .iter()
        .find(|s| s.name == "publish results" && links_to(s, &trace_id, &send.span_id))
        .unwrap();
    assert_eq!(relay.kind, SpanKind::Producer);
    assert_eq!(relay.attr_str("messaging.system"), Some("rabbitmq"));

    // Log lines written inside the action's spans name them.
    let logs = w.output.text();
    assert!(
        logs.lines().any(|l| l.contains("operation succeeded")
            && l.contains(&format!("\"trace_id\":\"{trace_id}\""))
            && l.contains(&format!("\"span_id\":\"{}\"", send.span_id))),
        "no log line names the send span:\n{logs}"
    );

    // The status API returns the trace id, and the viewer's link.
    let status = admin_get(&w, &format!("/v1/operations/{TENANT}/refund-traced")).await;
    assert_eq!(status["trace_id"], trace_id.as_str());
    assert_eq!(
        status["trace_url"],
        format!("http://jaeger.example:16686/trace/{trace_id}").as_str()
    );
    assert_eq!(status["operation"]["trace_id"], trace_id.as_str());

    // A garbage traceparent is ignored and counted: the intent is served as if it had none.
    agent
        .send(
            "refund-garbage",
            "refund",
            Some("00-{\"}-<script>-zz"),
            None,
        )
        .await;
    let garbage = agent.until("refund-garbage", "succeeded").await;
    assert_eq!(garbage.body["status"], "succeeded");
    let metrics = w.metrics().await;
    assert_eq!(
        metric_value(
            &metrics,
            "intent_worker_trace_context_invalid_total",
            &[("header", "traceparent")]
        ),
        1.0
    );
    let status = admin_get(&w, &format!("/v1/operations/{TENANT}/refund-garbage")).await;
    assert_eq!(status["trace_id"], Value::Null);
    let root = receiver
        .wait_for("the garbage intent's consume span", T, |all| {
            all.iter()
                .find(|s| {
                    s.name == "process intents"
                        && s.attr_str("intent_worker.action_id") == Some("refund-garbage")
                })
                .cloned()
        })
        .await;
    assert_eq!(root.parent_span_id, None, "a new trace: {root:?}");
    assert_eq!(env.mutations(&key("refund-garbage")).await, 1);
    agent.close().await;
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn a_recovery_round_and_an_operator_resolve_are_linked_roots_of_the_actions_trace() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let receiver = OtlpReceiver::start();
    // The ticket (lookup) and the deploy (none) commit, then their replies are lost.
    for action in ["ticket-lost", "deploy-lost"] {
        ds.fault(json!({"kind": "drop_after_commit", "key": key(action)}))
            .await;
    }
    let opts = traced(
        WorkerOptions::new(env.standard_tools(ds.port, "")),
        &receiver,
    )
    .with_admin(ADMIN);
    let w = Worker::start(&env, "w", &opts).await;
    let mut agent = RawAgent::new(&env).await;
    let (tp, trace_id, agent_span) = agent_context();
    agent.send("ticket-lost", "ticket", Some(&tp), None).await;

    let pending = agent.until("ticket-lost", "pending").await;
    let succeeded = agent.until("ticket-lost", "succeeded").await;
    let recover = receiver
        .wait_for("the recovery round's span", T, |all| {
            all.iter()
                .find(|s| s.name == "recover ticket" && s.trace_id == trace_id)
                .cloned()
        })
        .await;
    // A root of the action's trace, linked to the intent: never the child of a finished span.
    assert_eq!(recover.parent_span_id, None, "{recover:?}");
    assert!(links_to(&recover, &trace_id, &agent_span), "{recover:?}");
    assert_eq!(recover.attr_str("intent_worker.recovery"), Some("lookup"));
    assert_eq!(recover.attr_str("intent_worker.outcome"), Some("succeeded"));
    let spans = receiver
        .wait_for("the lookup's client span", T, |all| {
            all.iter()
                .find(|s| s.parent_span_id.as_deref() == Some(recover.span_id.as_str()))
                .map(|_| all.to_vec())
        })
        .await;
    let lookup = spans
        .iter()
        .find(|s| s.parent_span_id.as_deref() == Some(recover.span_id.as_str()))
        .unwrap();
    assert_eq!(
        (lookup.name.as_str(), lookup.kind),
        ("GET", SpanKind::Client)
    );
    let send = spans
        .iter()
        .find(|s| {
            s.kind == SpanKind::Client
                && s.trace_id == trace_id
                && s.attr_str("intent_worker.tool") == Some("ticket")
        })
        .expect("the first send's dispatch span");
    assert_eq!(send.name, "POST");
    assert_eq!(send.attr_str("intent_worker.outcome"), Some("unknown"));
    // Each answer carries the context of the span that decided it, all in the agent's trace.
    assert_eq!(
        ids(&pending.traceparent.expect("pending has a traceparent")),
        (trace_id.clone(), send.span_id.clone())
    );
    assert_eq!(
        ids(&succeeded.traceparent.expect("succeeded has a traceparent")),
        (trace_id.clone(), recover.span_id.clone())
    );
    // The lookup itself carried the recovery's context to the downstream.
    let seen = env.trace_contexts(&key("ticket-lost")).await;
    let lookups: Vec<_> = seen.iter().filter(|r| r.kind == "lookup").collect();
    assert!(!lookups.is_empty(), "{seen:?}");
    let (lookup_trace, lookup_parent) = ids(lookups[0].traceparent.as_deref().unwrap());
    assert_eq!(lookup_trace, trace_id);
    assert!(
        spans
            .iter()
            .any(|s| s.span_id == lookup_parent && s.kind == SpanKind::Client),
        "the lookup's traceparent names a client span of ours"
    );

    // A `none` tool's lost reply is held; the operator resolves it with the downstream's
    // receipt, in a span of the action's trace.
    let (tp, deploy_trace, deploy_agent_span) = agent_context();
    agent.send("deploy-lost", "deploy", Some(&tp), None).await;
    assert_eq!(env.final_state(TENANT, "deploy-lost", T).await, "held");
    let receipt = env
        .downstream_receipt(&key("deploy-lost"))
        .await
        .expect("the downstream committed the deploy");
    let port = w.admin_port.unwrap();
    let r = e2e::http()
        .post(format!(
            "http://127.0.0.1:{port}/v1/operations/{TENANT}/deploy-lost/resolve"
        ))
        .bearer_auth(ADMIN)
        .json(
            &json!({"receipt": receipt, "operator": "ana", "reason": "checked the deploy log",
                      "request_id": "resolve-deploy-lost-1"}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let resolved = agent.until("deploy-lost", "succeeded").await;
    let operator = receiver
        .wait_for("the operator's span", T, |all| {
            all.iter()
                .find(|s| s.name == "operator resolve" && s.trace_id == deploy_trace)
                .cloned()
        })
        .await;
    assert_eq!(operator.parent_span_id, None);
    assert!(links_to(&operator, &deploy_trace, &deploy_agent_span));
    assert_eq!(operator.attr_str("intent_worker.operator"), Some("ana"));
    assert_eq!(
        ids(&resolved.traceparent.expect("traceparent")),
        (deploy_trace, operator.span_id.clone())
    );
    agent.close().await;
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn with_export_off_nothing_is_exported_and_the_context_passes_through_unchanged() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let receiver = OtlpReceiver::start();
    // The endpoint is configured, but OTEL_TRACES_EXPORTER=none turns export off.
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint())
        .env("OTEL_TRACES_EXPORTER", "none")
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .with_metrics()
        .with_admin(ADMIN);
    let w = Worker::start(&env, "w", &opts).await;
    let mut agent = RawAgent::new(&env).await;
    let (tp, trace_id, _) = agent_context();
    agent
        .send(
            "refund-plain",
            "refund",
            Some(&tp),
            Some("congo=t61rcWkgMzE"),
        )
        .await;
    let result = agent.until("refund-plain", "succeeded").await;
    // Nothing of ours is recorded, so the agent's own context goes on as it came.
    let seen = env.trace_contexts(&key("refund-plain")).await;
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].traceparent.as_deref(), Some(tp.as_str()));
    assert_eq!(seen[0].tracestate.as_deref(), Some("congo=t61rcWkgMzE"));
    assert_eq!(result.traceparent.as_deref(), Some(tp.as_str()));
    let status = admin_get(&w, &format!("/v1/operations/{TENANT}/refund-plain")).await;
    assert_eq!(status["trace_id"], trace_id.as_str());
    assert!(
        status.get("trace_url").is_none(),
        "no WORKER_TRACE_URL: no link"
    );

    // A malformed tracestate is dropped alone; a traceparent that is not a string at all is
    // ignored; both counted.
    agent
        .send(
            "refund-bad-state",
            "refund",
            Some(&tp),
            Some("UPPER=case,{\"}"),
        )
        .await;
    let bad_state = agent.until("refund-bad-state", "succeeded").await;
    assert_eq!(bad_state.traceparent.as_deref(), Some(tp.as_str()));
    let seen = env.trace_contexts(&key("refund-bad-state")).await;
    assert_eq!(seen[0].tracestate, None);
    agent.send("refund-none", "refund", None, None).await;
    let plain = agent.until("refund-none", "succeeded").await;
    assert_eq!(plain.traceparent, None, "no context in, none out");
    assert_eq!(
        env.traceparents_for(&key("refund-none")).await,
        vec![None::<String>]
    );
    let metrics = w.metrics().await;
    assert_eq!(
        metric_value(
            &metrics,
            "intent_worker_trace_context_invalid_total",
            &[("header", "tracestate")]
        ),
        1.0
    );
    // Give a batch processor, had one been running, several flush periods.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(receiver.requests(), 0, "{}", receiver.dump());
    agent.close().await;
    drop(w);
    cleanup(env).await;
}

/// The sampler decides before any span exists: an intent whose agent did not sample its trace
/// (flags 00), or a root the ratio drops, gets no span of the worker's, and its context goes on
/// to the downstream and back unchanged, as with export off.
#[tokio::test]
async fn an_unsampled_trace_gets_no_span_and_its_context_passes_through() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let receiver = OtlpReceiver::start();
    let opts = traced(
        WorkerOptions::new(env.standard_tools(ds.port, "")),
        &receiver,
    )
    .env("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    .env("OTEL_TRACES_SAMPLER_ARG", "0");
    let w = Worker::start(&env, "w", &opts).await;
    let mut agent = RawAgent::new(&env).await;
    let (sampled, sampled_trace, _) = agent_context();
    let unsampled = sampled.replace("-01", "-00");
    agent
        .send("refund-unsampled", "refund", Some(&unsampled), None)
        .await;
    agent.send("refund-root", "refund", None, None).await;
    agent
        .send("refund-sampled", "refund", Some(&sampled), None)
        .await;
    let quiet = agent.until("refund-unsampled", "succeeded").await;
    assert_eq!(quiet.traceparent.as_deref(), Some(unsampled.as_str()));
    assert_eq!(
        env.traceparents_for(&key("refund-unsampled")).await,
        vec![Some(unsampled.clone())]
    );
    let root = agent.until("refund-root", "succeeded").await;
    assert_eq!(root.traceparent, None, "a dropped root sends no context");
    // The agent's sampled trace is still recorded (parent-based), with the commit batches that
    // carried it.
    agent.until("refund-sampled", "succeeded").await;
    receiver
        .wait_for("the sampled intent's spans", T, |all| {
            let t = in_trace(all, &sampled_trace);
            (t.iter().any(|s| s.name == "process intents")
                && t.iter().any(|s| s.kind == SpanKind::Client))
            .then_some(())
        })
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let spans = receiver.spans();
    let stray: Vec<&Span> = spans
        .iter()
        .filter(|s| s.trace_id != sampled_trace && !links_to_trace(s, &sampled_trace))
        .collect();
    assert!(stray.is_empty(), "spans of unsampled traces: {stray:#?}");
    agent.close().await;
    drop(w);
    cleanup(env).await;
}

fn links_to_trace(span: &Span, trace_id: &str) -> bool {
    span.links.iter().any(|l| l.trace_id == trace_id)
}
