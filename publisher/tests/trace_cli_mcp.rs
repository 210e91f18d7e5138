//! W3C trace context through the `publisher` binary: `send --traceparent` (a valid value sent as
//! the intent's context, a malformed one sent as given with a warning); span export from the
//! standard `OTEL_*` variables (the publish span goes to the collector and its context on the
//! wire; a bad setting stops start-up with exit code 2); the MCP gateway taking the context
//! from the request's `_meta` (SEP-414), else from the HTTP headers, ignoring and counting a
//! malformed one, and keeping it in the outbox in outbox mode. Real RabbitMQ and Postgres (see
//! `support`); the gateway runs without a worker, so each call ends "outcome unknown" after
//! `PUBLISHER_MCP_WAIT`, its intent caught on the test's exchange.

mod support;

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use protocol::trace::TraceParent;
use serde_json::{json, Value};
use support::{contains, free_port, unique, Catcher, Collector, TestDb, GOOD, OTHER};

const TOKEN: &str = "north-token-0123456789";

/// The binary with no `OTEL_*` setting of the caller's environment (export off unless a test
/// turns it on).
fn publisher() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_publisher"));
    for (name, _) in std::env::vars() {
        if name.starts_with("OTEL_") {
            command.env_remove(name);
        }
    }
    command
        .env("AMQP_URL", support::amqp_url())
        .env("RUST_LOG", "info,lapin=off")
        .stdin(Stdio::null());
    command
}

/// `publisher send` of one refund to `exchange`, with `extra` arguments; waits for it.
fn send(exchange: &str, action_id: &str, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = publisher();
    command.args([
        "send",
        "--exchange",
        exchange,
        "--tenant",
        "north",
        "--action-id",
        action_id,
        "--tool",
        "refund",
        "--args",
        r#"{"order":"o-1"}"#,
    ]);
    command.args(extra).envs(env.iter().copied());
    command.output().expect("run publisher send")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[tokio::test]
async fn send_sends_a_valid_traceparent_and_a_garbage_one_verbatim_with_a_warning() {
    let catcher = Catcher::new("cli").await;

    let valid = send(
        &catcher.exchange,
        "valid",
        &["--traceparent", GOOD, "--tracestate", "rojo=1"],
        &[],
    );
    assert!(valid.status.success(), "{}", stderr(&valid));
    assert!(!stderr(&valid).contains("warning"), "{}", stderr(&valid));
    let caught = catcher.next().await;
    assert_eq!(caught.traceparent(), Some(GOOD));
    assert_eq!(caught.tracestate(), Some("rojo=1"));

    // Not refused: sent exactly as given (so a test can deliver a malformed header), with a
    // warning that receivers ignore it.
    let garbage = send(
        &catcher.exchange,
        "garbage",
        &["--traceparent", "garbage-not-a-traceparent"],
        &[],
    );
    assert!(garbage.status.success(), "{}", stderr(&garbage));
    assert!(
        stderr(&garbage)
            .contains("not a valid W3C traceparent; sent as given, receivers ignore it"),
        "{}",
        stderr(&garbage)
    );
    let caught = catcher.next().await;
    assert_eq!(caught.message_id.as_deref(), Some("north:garbage"));
    assert_eq!(caught.traceparent(), Some("garbage-not-a-traceparent"));
    assert_eq!(caught.tracestate(), None);

    // Without --traceparent: no headers; --tracestate alone is a usage error.
    let plain = send(&catcher.exchange, "plain", &[], &[]);
    assert!(plain.status.success(), "{}", stderr(&plain));
    assert!(catcher.next().await.headers.is_empty());
    let alone = send(&catcher.exchange, "alone", &["--tracestate", "a=b"], &[]);
    assert_eq!(alone.status.code(), Some(2), "{}", stderr(&alone));
    assert!(catcher.is_empty().await);

    catcher.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_otlp_export_on_send_exports_its_span_and_sends_its_context() {
    let catcher = Catcher::new("cli-export").await;
    let collector = Collector::start().await;
    let endpoint = collector.endpoint();
    let output = send(
        &catcher.exchange,
        "exported",
        &["--traceparent", GOOD],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_SERVICE_NAME", "agent-cli-test"),
        ],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("exporting spans over OTLP/HTTP")
            && stderr(&output).contains(&format!("{endpoint}/v1/traces")),
        "{}",
        stderr(&output)
    );
    let sent = TraceParent::parse(catcher.next().await.traceparent().unwrap()).unwrap();
    let given = TraceParent::parse(GOOD).unwrap();
    // The agent's trace, continued by the publish span, which is the parent on the wire.
    assert_eq!(sent.trace_id, given.trace_id);
    assert_ne!(sent.parent_id, given.parent_id);
    // Flushed before the process exited.
    let traces = collector.traces();
    assert!(contains(&traces, "publish intents"), "{traces:?}");
    assert!(contains(&traces, "agent-cli-test"));
    assert!(contains_bytes(&traces, &sent.parent_id));
    catcher.delete().await;
}

fn contains_bytes(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test]
async fn a_bad_otel_setting_stops_start_up_with_exit_code_2_naming_it() {
    for (var, value) in [
        ("OTEL_TRACES_EXPORTER", "zipkin"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
    ] {
        let output = send(
            "never-used",
            "bad-otel",
            &[],
            &[
                (var, value),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9"),
            ],
        );
        assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
        assert!(stderr(&output).contains(var), "{}", stderr(&output));
    }
}

/// A running `publisher mcp` over HTTP for tenant `north`, publishing to a test exchange.
struct Gateway {
    child: Child,
    url: String,
    metrics: String,
    log: Arc<Mutex<String>>,
}

impl Gateway {
    fn start(exchange: &str, env: &[(&str, &str)]) -> Gateway {
        let dir = std::env::temp_dir().join(unique("mcp"));
        std::fs::create_dir_all(&dir).unwrap();
        let tools = dir.join("mcp-tools.toml");
        std::fs::write(
            &tools,
            "[tools.refund]\ndescription = \"Refund an order.\"\n",
        )
        .unwrap();
        let (port, metrics_port) = (free_port(), free_port());
        let mut child = publisher()
            .arg("mcp")
            .env("PUBLISHER_MCP_TOOLS", &tools)
            .env("PUBLISHER_MCP_TOKENS", format!("north={TOKEN}"))
            .env("PUBLISHER_MCP_ADDR", format!("127.0.0.1:{port}"))
            .env(
                "PUBLISHER_MCP_METRICS_ADDR",
                format!("127.0.0.1:{metrics_port}"),
            )
            .env("PUBLISHER_MCP_WAIT", "100ms")
            .env("INTENTS_EXCHANGE", exchange)
            .env("RESULTS_EXCHANGE", format!("{exchange}-results"))
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn publisher mcp");
        let log = Arc::new(Mutex::new(String::new()));
        let lines = BufReader::new(child.stderr.take().unwrap());
        let kept = log.clone();
        std::thread::spawn(move || {
            for line in lines.lines().map_while(Result::ok) {
                let mut log = kept.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let text = log.lock().unwrap().clone();
            if text.contains("publisher mcp listening on") && text.contains("metrics listening") {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("publisher mcp exited ({status}):\n{text}");
            }
            assert!(
                std::time::Instant::now() < deadline,
                "publisher mcp did not start:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(30));
        }
        Gateway {
            child,
            url: format!("http://127.0.0.1:{port}/mcp"),
            metrics: format!("http://127.0.0.1:{metrics_port}/metrics"),
            log,
        }
    }

    /// One `tools/call` of `refund` with `meta` as its `_meta` and `headers` on the HTTP
    /// request; the JSON-RPC result.
    async fn call(&self, meta: Value, headers: &[(&str, &str)]) -> Value {
        let mut request = http()
            .post(&self.url)
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(
                json!({
                    "jsonrpc": "2.0", "id": 1, "method": "tools/call",
                    "params": {"name": "refund", "arguments": {"order": "o-1"}, "_meta": meta}
                })
                .to_string(),
            );
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = request.send().await.expect("POST tools/call");
        assert!(response.status().is_success(), "{response:?}");
        let body: Value =
            serde_json::from_slice(&response.bytes().await.unwrap()).expect("a JSON-RPC answer");
        body["result"].clone()
    }

    /// `intent_publisher_trace_context_invalid_total` for `source` and `header`.
    async fn invalid(&self, source: &str, header: &str) -> u64 {
        let text = http()
            .get(&self.metrics)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find(|l| {
                l.starts_with("intent_publisher_trace_context_invalid_total{")
                    && l.contains(&format!("source=\"{source}\""))
                    && l.contains(&format!("header=\"{header}\""))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no counter for {source}/{header}:\n{text}"))
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP client (reqwest's TLS needs the process's crypto provider, even for http://).
fn http() -> reqwest::Client {
    publisher::tls::install_default_provider();
    reqwest::Client::new()
}

fn meta(action_id: &str, extra: Value) -> Value {
    let mut meta = json!({"io.intent-worker/action_id": action_id});
    if let Value::Object(extra) = extra {
        meta.as_object_mut().unwrap().extend(extra);
    }
    meta
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_takes_the_context_from_meta_else_from_the_http_headers() {
    let catcher = Catcher::new("mcp").await;
    let gateway = Gateway::start(&catcher.exchange, &[]);

    // _meta (SEP-414) wins over the HTTP header.
    let result = gateway
        .call(
            meta(
                "from-meta",
                json!({"traceparent": GOOD, "tracestate": "rojo=1"}),
            ),
            &[("traceparent", OTHER)],
        )
        .await;
    assert!(result.to_string().contains("OUTCOME UNKNOWN"), "{result}");
    let caught = catcher.next().await;
    assert_eq!(caught.message_id.as_deref(), Some("north:from-meta"));
    assert_eq!(caught.traceparent(), Some(GOOD));
    assert_eq!(caught.tracestate(), Some("rojo=1"));

    // No context in _meta: the HTTP headers'.
    gateway
        .call(
            meta("from-header", json!({})),
            &[("traceparent", OTHER), ("tracestate", "congo=2")],
        )
        .await;
    let caught = catcher.next().await;
    assert_eq!(caught.traceparent(), Some(OTHER));
    assert_eq!(caught.tracestate(), Some("congo=2"));

    // A malformed _meta.traceparent is ignored (a valid header still counts) and counted; it
    // never refuses the call.
    gateway
        .call(meta("bad-meta", json!({"traceparent": "garbage"})), &[])
        .await;
    assert!(catcher.next().await.headers.is_empty());
    gateway
        .call(
            meta("bad-meta-good-header", json!({"traceparent": 42})),
            &[("traceparent", OTHER)],
        )
        .await;
    assert_eq!(catcher.next().await.traceparent(), Some(OTHER));
    assert_eq!(gateway.invalid("mcp_meta", "traceparent").await, 2);

    // A malformed header likewise; a malformed tracestate is dropped alone.
    gateway
        .call(meta("bad-header", json!({})), &[("traceparent", "00-zz")])
        .await;
    assert!(catcher.next().await.headers.is_empty());
    assert_eq!(gateway.invalid("http_header", "traceparent").await, 1);
    gateway
        .call(
            meta(
                "bad-state",
                json!({"traceparent": GOOD, "tracestate": "Bad State"}),
            ),
            &[],
        )
        .await;
    let caught = catcher.next().await;
    assert_eq!(caught.traceparent(), Some(GOOD));
    assert_eq!(caught.tracestate(), None);
    assert_eq!(gateway.invalid("mcp_meta", "tracestate").await, 1);
    assert_eq!(gateway.invalid("http_header", "tracestate").await, 0);

    // Nothing at all: no headers.
    gateway.call(meta("none", json!({})), &[]).await;
    assert!(catcher.next().await.headers.is_empty());

    drop(gateway);
    cleanup(catcher).await;
}

/// Deletes the test's exchange and the results exchange the gateway declared beside it.
async fn cleanup(catcher: Catcher) {
    let results = format!("{}-results", catcher.exchange);
    catcher.delete().await;
    Catcher::delete_exchange(&results).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_export_on_the_call_span_parents_the_publish_span() {
    let catcher = Catcher::new("mcp-export").await;
    let collector = Collector::start().await;
    let endpoint = collector.endpoint();
    let gateway = Gateway::start(
        &catcher.exchange,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    assert!(
        gateway
            .log
            .lock()
            .unwrap()
            .contains("exporting spans over OTLP/HTTP"),
        "{}",
        gateway.log.lock().unwrap()
    );
    gateway
        .call(meta("exported", json!({"traceparent": GOOD})), &[])
        .await;
    let sent = TraceParent::parse(catcher.next().await.traceparent().unwrap()).unwrap();
    let given = TraceParent::parse(GOOD).unwrap();
    assert_eq!(sent.trace_id, given.trace_id);
    assert_ne!(sent.parent_id, given.parent_id);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let traces = collector.traces();
        if contains(&traces, "tools/call refund") && contains(&traces, "publish intents") {
            // The publish span (the parent named on the wire) is in the export.
            assert!(contains_bytes(&traces, &sent.parent_id));
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "spans not exported: {traces:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(gateway);
    cleanup(catcher).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_outbox_mode_the_gateway_stores_the_received_context_with_the_row() {
    let db = TestDb::new().await;
    let catcher = Catcher::new("mcp-outbox").await;
    let gateway = Gateway::start(
        &catcher.exchange,
        &[("PUBLISHER_DATABASE_URL", db.url.as_str())],
    );
    gateway
        .call(
            meta(
                "queued",
                json!({"traceparent": GOOD, "tracestate": "rojo=1"}),
            ),
            &[],
        )
        .await;
    gateway.call(meta("queued-plain", json!({})), &[]).await;
    let rows: Vec<(String, Option<String>, Option<String>)> =
        sqlx::query_as("SELECT action_id, traceparent, tracestate FROM intent_outbox ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        rows,
        [
            ("queued".into(), Some(GOOD.into()), Some("rojo=1".into())),
            ("queued-plain".into(), None, None),
        ]
    );
    drop(gateway);
    cleanup(catcher).await;
    db.drop_db().await;
}
