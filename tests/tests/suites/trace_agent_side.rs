//! The agent's trace context through the whole system, from each agent-side way in: an MCP
//! call's `_meta.traceparent` through the gateway, `publisher send --traceparent`, and an outbox
//! row through `publisher relay`, each to a real worker and the reference downstream. With span
//! export off everywhere the downstream's request carries the agent's own context unchanged;
//! with it on, the agent side's spans (`tools/call <tool>`, `publish intents`) and the worker's
//! (`process intents`) form one chain in the agent's trace at an OTLP receiver.

use std::collections::BTreeMap;
use std::time::Duration;

use e2e::otlp::{Span, SpanKind};
use e2e::{cleanup, free_port, Downstream, Env, McpGateway, OtlpReceiver, Worker, WorkerOptions};
use publisher::{Outbox, PublishOptions};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(30);
const TENANT: &str = "north-shop";
const TOKEN: &str = "north-token-for-trace-tests";
const MCP_TOOLS: &str = r#"
[tools.refund]
description = "Refund an order."
input_schema = { type = "object", properties = { order = { type = "string" }, amount_cents = { type = "integer" } }, required = ["order", "amount_cents"] }
"#;

/// A fresh sampled context, as an instrumented agent would send it: (traceparent, trace id,
/// span id).
fn agent_context() -> (String, String, String) {
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let span_id = uuid::Uuid::new_v4().simple().to_string()[..16].to_string();
    (format!("00-{trace_id}-{span_id}-01"), trace_id, span_id)
}

fn key(action: &str) -> String {
    format!("{TENANT}:{action}")
}

/// A gateway for north-shop in front of `env`'s exchanges, with `extra` settings.
async fn gateway(env: &Env, extra: &[(&str, &str)]) -> McpGateway {
    let tools = env.dir.join(format!("mcp-tools-{}.toml", free_port()));
    std::fs::write(&tools, MCP_TOOLS).unwrap();
    let mut settings: BTreeMap<String, String> = [
        ("AMQP_URL", env.amqp_url.clone()),
        ("INTENTS_EXCHANGE", env.topology.intents_exchange.clone()),
        ("RESULTS_EXCHANGE", env.topology.results_exchange.clone()),
        ("PUBLISHER_MCP_TOOLS", tools.display().to_string()),
        ("PUBLISHER_MCP_TOKENS", format!("{TENANT}={TOKEN}")),
        ("PUBLISHER_MCP_WAIT", "15s".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    for (k, v) in extra {
        settings.insert(k.to_string(), v.to_string());
    }
    McpGateway::start(free_port(), settings).await
}

/// One `tools/call` of `refund` with these `_meta` entries besides the action id; the result.
async fn call(gateway: &McpGateway, action: &str, meta: Value) -> Value {
    let mut meta_object = json!({"io.intent-worker/action_id": action});
    if let Value::Object(extra) = meta {
        meta_object.as_object_mut().unwrap().extend(extra);
    }
    let body = json!({
        "jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "refund", "arguments": {"order": format!("o-{action}"), "amount_cents": 4850},
                   "_meta": meta_object}
    });
    let response: Value = e2e::http()
        .post(gateway.url())
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(body.to_string())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    response["result"].clone()
}

fn ids(traceparent: &str) -> (String, String) {
    let parts: Vec<&str> = traceparent.split('-').collect();
    (parts[1].to_string(), parts[2].to_string())
}

fn one<'a>(spans: &'a [Span], name: &str, trace_id: &str) -> &'a Span {
    let found: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == name && s.trace_id == trace_id)
        .collect();
    assert_eq!(found.len(), 1, "{name} in {trace_id}: {found:#?}");
    found[0]
}

#[tokio::test(flavor = "multi_thread")]
async fn with_export_off_the_agents_context_reaches_the_downstream_unchanged() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let _worker = Worker::start(
        &env,
        "w",
        &WorkerOptions::new(env.standard_tools(ds.port, "")),
    )
    .await;

    // MCP: _meta.traceparent, through the gateway and the worker, neither exporting.
    let mcp = gateway(&env, &[]).await;
    let (tp, _, _) = agent_context();
    let result = call(
        &mcp,
        "mcp-meta",
        json!({"traceparent": tp, "tracestate": "vendor=agent"}),
    )
    .await;
    assert_eq!(
        result["structuredContent"]["status"], "succeeded",
        "{result}"
    );
    let seen = env.trace_contexts(&key("mcp-meta")).await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].traceparent.as_deref(), Some(tp.as_str()));
    assert_eq!(seen[0].tracestate.as_deref(), Some("vendor=agent"));

    // A garbage _meta.traceparent is dropped at the gateway: the call succeeds, no context.
    let result = call(&mcp, "mcp-garbage", json!({"traceparent": "garbage"})).await;
    assert_eq!(
        result["structuredContent"]["status"], "succeeded",
        "{result}"
    );
    assert_eq!(env.traceparents_for(&key("mcp-garbage")).await, vec![None]);
    drop(mcp);

    // The command line.
    let (tp, _, _) = agent_context();
    let sent = std::process::Command::new(e2e::procs::publisher_bin())
        .args([
            "send",
            "--tenant",
            TENANT,
            "--action-id",
            "cli",
            "--tool",
            "refund",
        ])
        .args(["--args", r#"{"order":"o-cli","amount_cents":4850}"#])
        .args(["--traceparent", &tp])
        .env("AMQP_URL", &env.amqp_url)
        .env("INTENTS_EXCHANGE", &env.topology.intents_exchange)
        .output()
        .unwrap();
    assert!(sent.status.success(), "{sent:?}");
    assert_eq!(env.final_state(TENANT, "cli", T).await, "succeeded");
    assert_eq!(env.traceparents_for(&key("cli")).await, vec![Some(tp)]);

    cleanup(env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn with_export_on_the_agent_sides_spans_and_the_workers_form_one_chain() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let receiver = OtlpReceiver::start();
    let endpoint = receiver.endpoint();
    let otel = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let mut options = WorkerOptions::new(env.standard_tools(ds.port, ""));
    for (k, v) in otel {
        options = options.env(k, v);
    }
    let _worker = Worker::start(&env, "w", &options).await;

    // MCP: the call's server span is the agent span's child, the publish span the call's, the
    // worker's delivery span the publish's.
    let mcp = gateway(&env, &otel).await;
    let (tp, trace_id, agent_span) = agent_context();
    let result = call(&mcp, "mcp-exported", json!({"traceparent": tp})).await;
    assert_eq!(
        result["structuredContent"]["status"], "succeeded",
        "{result}"
    );
    let spans = receiver
        .wait_for("the MCP call's chain", T, |spans| {
            let names = ["tools/call refund", "publish intents", "process intents"];
            names
                .iter()
                .all(|n| spans.iter().any(|s| s.name == *n && s.trace_id == trace_id))
                .then(|| spans.to_vec())
        })
        .await;
    let call_span = one(&spans, "tools/call refund", &trace_id);
    assert_eq!(call_span.kind, SpanKind::Server);
    assert_eq!(
        call_span.parent_span_id.as_deref(),
        Some(agent_span.as_str())
    );
    assert_eq!(call_span.service_name, "intent-publisher");
    assert_eq!(call_span.attr_str("mcp.method.name"), Some("tools/call"));
    assert_eq!(call_span.attr_str("gen_ai.tool.name"), Some("refund"));
    let publish = one(&spans, "publish intents", &trace_id);
    assert_eq!(publish.kind, SpanKind::Producer);
    assert_eq!(publish.parent_span_id.as_ref(), Some(&call_span.span_id));
    assert_eq!(
        publish.attr_str("messaging.message.id"),
        Some(key("mcp-exported").as_str())
    );
    let process = one(&spans, "process intents", &trace_id);
    assert_eq!(process.parent_span_id.as_ref(), Some(&publish.span_id));
    drop(mcp);

    // The outbox: a row enqueued in the agent's trace, published by a relay that exports; its
    // publish span is the row context's child and the worker's delivery span the publish's.
    Outbox::migrate(&env.pool).await.unwrap();
    let (tp, trace_id, agent_span) = agent_context();
    let cx = match protocol::trace::TraceContext::read(Some(&tp), None) {
        protocol::trace::Incoming::Context { context, .. } => context,
        other => panic!("{other:?}"),
    };
    let mut tx = env.pool.begin().await.unwrap();
    Outbox::enqueue_with(
        &mut tx,
        &e2e::intent(
            TENANT,
            "outboxed",
            "refund",
            json!({"order": "o-outboxed", "amount_cents": 4850}),
        ),
        &PublishOptions::new().with_trace(Some(cx)),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let _relay = e2e::procs::RelayProc::spawn(&env, "relay", &otel);
    assert_eq!(env.final_state(TENANT, "outboxed", T).await, "succeeded");
    let spans = receiver
        .wait_for("the outbox row's chain", T, |spans| {
            ["publish intents", "process intents"]
                .iter()
                .all(|n| spans.iter().any(|s| s.name == *n && s.trace_id == trace_id))
                .then(|| spans.to_vec())
        })
        .await;
    let publish = one(&spans, "publish intents", &trace_id);
    assert_eq!(publish.parent_span_id.as_deref(), Some(agent_span.as_str()));
    assert_eq!(publish.service_name, "intent-publisher");
    let process = one(&spans, "process intents", &trace_id);
    assert_eq!(process.parent_span_id.as_ref(), Some(&publish.span_id));
    // The downstream's request is in the same trace.
    let seen = env.traceparents_for(&key("outboxed")).await;
    assert_eq!(ids(seen[0].as_deref().unwrap()).0, trace_id);

    cleanup(env).await;
}
