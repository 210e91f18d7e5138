//! The action key `<tenant>:<action_id>` is the AMQP `message_id` and the downstream
//! idempotency key, at most 255 bytes, while `tenant` and `action_id` may each be 200
//! characters. Through every entry point, against real worker processes, RabbitMQ, Postgres and
//! the reference downstream, this proves that the longest pair that fits (a 200-character tenant
//! and a 54-character action id: 255 bytes) is carried out once, and that one byte more is
//! refused with a clear error and never panics anything:
//! - `publisher send` exits with the usage code and the decoder's message;
//! - `Outbox::enqueue` refuses it and inserts nothing;
//! - a row inserted with plain SQL (bypassing `Outbox::enqueue`) is marked failed with its
//!   reason by a running `publisher relay`, which goes on publishing the rows behind it;
//! - the MCP gateway answers the call with a tool error and keeps serving;
//! - a body published straight to the intents exchange is dead-lettered by the worker as
//!   `invalid_message` and answered `rejected` with detail `key_too_long`.
//!
//! Counts come from the downstream's own tables.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use e2e::{
    cleanup, free_port, metric_value, wait_for, Agent, Downstream, Env, McpGateway, Worker,
    WorkerOptions,
};
use lapin::types::AMQPValue;
use protocol::{DecodeError, RejectReason, Status};
use publisher::{Outbox, OutboxError};
use rmcp::model::{
    CallToolRequestParams, CallToolResult, ClientCapabilities, ClientConfig, Implementation,
    JsonObject, MetaObject, RequestMetaObject,
};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::ServiceExt;
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(45);

/// The longest tenant.
fn tenant() -> String {
    "T".repeat(200)
}

/// An action id of exactly `len` characters, unique to `what`.
fn action_id(what: &str, len: usize) -> String {
    let id = format!("{what}-{}", "b".repeat(len));
    id[..len].to_owned()
}

fn key(tenant: &str, action_id: &str) -> String {
    format!("{tenant}:{action_id}")
}

fn refund(tenant: &str, action_id: &str) -> protocol::Intent {
    protocol::Intent {
        tenant: tenant.into(),
        action_id: action_id.into(),
        tool: "refund".into(),
        arguments: json!({"order": action_id, "amount_cents": 4850}),
        call_id: None,
        reply_to: None,
        compensates: None,
    }
}

async fn world() -> (Env, Downstream, Worker) {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let w = Worker::start(
        &env,
        "w1",
        &WorkerOptions::new(env.standard_tools(ds.port, "")),
    )
    .await;
    (env, ds, w)
}

/// `publisher <args>` against the test's broker names: (exit code, stdout, stderr).
fn publisher(env: &Env, args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(e2e::procs::publisher_bin())
        .args(args)
        .env_clear()
        .env("RUST_LOG", "warn")
        .env("AMQP_URL", &env.amqp_url)
        .env("INTENTS_EXCHANGE", &env.topology.intents_exchange)
        .env("RESULTS_EXCHANGE", &env.topology.results_exchange)
        .output()
        .expect("run publisher");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn succeeded_once(env: &Env, tenant: &str, action_id: &str) {
    let k = key(tenant, action_id);
    wait_for(&format!("{k} to succeed"), T, || async {
        (env.state(tenant, action_id).await == "succeeded").then_some(())
    })
    .await;
    assert_eq!(env.writes(&k).await, 1, "{k}");
    assert_eq!(env.mutations(&k).await, 1, "{k}");
}

#[tokio::test]
async fn publisher_send_refuses_one_byte_more_and_sends_the_longest_pair() {
    let (env, _ds, _w) = world().await;
    let tenant = tenant();
    let send = |action_id: &str, wait: bool| {
        let mut args = vec![
            "send",
            "--tenant",
            tenant.as_str(),
            "--action-id",
            action_id,
            "--tool",
            "refund",
            "--args",
            r#"{"order":"o-1","amount_cents":4850}"#,
        ];
        if wait {
            args.extend(["--wait", "--timeout", "30s"]);
        }
        publisher(&env, &args)
    };

    for (len, bytes) in [(55, 256), (200, 401)] {
        let id = action_id("send", len);
        let (code, _, err) = send(&id, false);
        assert_eq!(code, Some(2), "bad input, not a panic (101): {err}");
        assert!(
            err.contains(&format!("{bytes} bytes")) && err.contains("255-byte limit"),
            "the decoder's message: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
        assert_eq!(env.writes(&key(&tenant, &id)).await, 0);
    }

    let fits = action_id("send", 54);
    assert_eq!(key(&tenant, &fits).len(), 255);
    let (code, out, err) = send(&fits, true);
    assert_eq!(code, Some(0), "{out}{err}");
    let event: Value = serde_json::from_str(out.trim()).expect("the answer as JSON");
    assert_eq!(event["status"], "succeeded", "{event}");
    assert_eq!(event["tenant"], tenant.as_str());
    succeeded_once(&env, &tenant, &fits).await;
    cleanup(env).await;
}

/// `publisher relay` as a child process; its stderr goes to a file.
struct RelayProc {
    child: Child,
    log: PathBuf,
}

impl RelayProc {
    fn spawn(env: &Env, metrics_addr: &str) -> RelayProc {
        let log = env.dir.join("relay.log");
        let child = Command::new(e2e::procs::publisher_bin())
            .arg("relay")
            .env_clear()
            .env("RUST_LOG", "info,lapin=warn,sqlx=warn")
            .env("AMQP_URL", &env.amqp_url)
            .env("PUBLISHER_DATABASE_URL", &env.db_url)
            .env("INTENTS_EXCHANGE", &env.topology.intents_exchange)
            .env("PUBLISHER_LEASE", "2s")
            .env("PUBLISHER_IDLE_POLL", "20ms")
            // Small batches, one loop: the bad rows come first, the good ones in later steps.
            .env("PUBLISHER_BATCH", "2")
            .env("PUBLISHER_CONCURRENCY", "1")
            .env("PUBLISHER_METRICS_ADDR", metrics_addr)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn publisher relay");
        RelayProc { child, log }
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for RelayProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

kit::pg_row! {
    #[derive(Debug)]
    struct OutboxRow {
        failed: bool,
        failure: Option<String>,
        sent: bool,
        attempts: i32,
    }
}

async fn outbox_row(env: &Env, id: i64) -> OutboxRow {
    sqlx::query_as(
        "SELECT failed_at IS NOT NULL AS failed, failure, sent_at IS NOT NULL AS sent, attempts
         FROM intent_outbox WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&env.pool)
    .await
    .expect("outbox row")
}

/// A plain SQL insert, as any language may do, bypassing `Outbox::enqueue`.
async fn insert(env: &Env, tenant: &str, action_id: &str, body: &str) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO intent_outbox (tenant, action_id, body) VALUES ($1, $2, $3) RETURNING id",
    )
    .bind(tenant)
    .bind(action_id)
    .bind(body)
    .fetch_one(&env.pool)
    .await
    .expect("insert")
}

fn body(tenant: &str, action_id: &str, arguments: Value) -> String {
    json!({"tenant": tenant, "action_id": action_id, "tool": "refund", "arguments": arguments})
        .to_string()
}

#[tokio::test]
async fn the_outbox_refuses_it_and_the_relay_marks_a_raw_row_failed_and_goes_on() {
    let (env, _ds, _w) = world().await;
    Outbox::migrate(&env.pool).await.expect("migrate");
    let tenant = tenant();
    let marker = format!("secret-body-{}", env.id);

    // Outbox::enqueue refuses one byte more, and inserts nothing.
    let mut tx = env.pool.begin().await.unwrap();
    let error = Outbox::enqueue(&mut tx, &refund(&tenant, &action_id("enqueue", 55)))
        .await
        .expect_err("256 bytes");
    assert!(
        matches!(
            error,
            OutboxError::Invalid(DecodeError::KeyTooLong { len: 256, max: 255 })
        ),
        "{error:?}"
    );
    tx.rollback().await.unwrap();

    // Rows that can never be published, inserted with plain SQL: the 401-byte key that used
    // to stop the relay on every start, a body the worker's decoder refuses, a body whose key
    // is not the row's, and no JSON at all.
    let long = action_id("raw", 200);
    let bad = [
        (
            insert(
                &env,
                &tenant,
                &long,
                &body(&tenant, &long, json!({"m": marker})),
            )
            .await,
            "key_too_long",
            "401 bytes",
        ),
        (
            insert(
                &env,
                "north-shop",
                "nul-1",
                &body(
                    "north-shop",
                    "nul-1",
                    json!({"m": format!("{marker}\u{0}")}),
                ),
            )
            .await,
            "invalid_intent",
            "nul_character",
        ),
        (
            insert(
                &env,
                "north-shop",
                "mismatch-1",
                &body("north-shop", "other-1", json!({"m": marker})),
            )
            .await,
            "key_mismatch",
            "north-shop:other-1",
        ),
        (
            insert(
                &env,
                "north-shop",
                "garbage-1",
                &format!("{marker} not json"),
            )
            .await,
            "invalid_intent",
            "not_json",
        ),
    ];
    // The rows behind them: the longest pair through Outbox::enqueue and through plain SQL,
    // and two ordinary ones.
    let by_enqueue = action_id("enqueue", 54);
    let mut tx = env.pool.begin().await.unwrap();
    Outbox::enqueue(&mut tx, &refund(&tenant, &by_enqueue))
        .await
        .expect("255 bytes fit");
    tx.commit().await.unwrap();
    let by_sql = action_id("sql", 54);
    insert(
        &env,
        &tenant,
        &by_sql,
        &body(&tenant, &by_sql, json!({"order": "o-2"})),
    )
    .await;
    for id in ["after-1", "after-2"] {
        insert(
            &env,
            "north-shop",
            id,
            &body("north-shop", id, json!({"order": id})),
        )
        .await;
    }

    let metrics = format!("127.0.0.1:{}", free_port());
    let mut relay = RelayProc::spawn(&env, &metrics);
    for (t, a) in [
        (tenant.as_str(), by_enqueue.as_str()),
        (tenant.as_str(), by_sql.as_str()),
        ("north-shop", "after-1"),
        ("north-shop", "after-2"),
    ] {
        succeeded_once(&env, t, a).await;
    }
    assert!(
        relay.child.try_wait().unwrap().is_none(),
        "the relay keeps running:\n{}",
        relay.output()
    );

    for (id, reason, detail) in bad {
        let row = outbox_row(&env, id).await;
        assert!(row.failed && !row.sent, "row {id}: {row:?}");
        assert_eq!(row.attempts, 0, "never published: {row:?}");
        let failure = row.failure.unwrap_or_default();
        assert!(
            failure.starts_with(&format!("{reason}: ")) && failure.contains(detail),
            "row {id}: {failure}"
        );
        assert!(
            !failure.contains(&marker),
            "the body is not copied: {failure}"
        );
    }
    assert_eq!(env.writes(&key(&tenant, &long)).await, 0);
    assert_eq!(env.state("north-shop", "nul-1").await, "");
    assert_eq!(env.state("north-shop", "other-1").await, "");

    // Counted and logged by key, never with the body.
    let text = wait_for("the failed rows in the relay's metrics", T, || async {
        let text = e2e::http()
            .get(format!("http://{metrics}/metrics"))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        (metric_value(&text, "intent_publisher_outbox_failed_rows", &[]) == 4.0).then_some(text)
    })
    .await;
    let failed = |reason| {
        metric_value(
            &text,
            "intent_publisher_rows_failed_total",
            &[("reason", reason)],
        )
    };
    assert_eq!(failed("key_too_long"), 1.0, "{text}");
    assert_eq!(failed("invalid_intent"), 2.0, "{text}");
    assert_eq!(failed("key_mismatch"), 1.0, "{text}");
    assert_eq!(
        metric_value(&text, "intent_publisher_outbox_backlog", &[]),
        0.0,
        "failed rows are not waiting for the relay"
    );
    assert_eq!(
        metric_value(&text, "intent_publisher_rows_sent_total", &[]),
        4.0
    );
    let log = relay.output();
    assert!(log.contains("marked failed"), "{log}");
    assert!(
        log.contains(&key(&tenant, &long)[..300]),
        "logged by key (the first 300 characters): {log}"
    );
    assert!(
        !log.contains(&marker),
        "the body never reaches the log:\n{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
    let _ = relay.child.kill();
    cleanup(env).await;
}

const MCP_TOOLS: &str = r#"
[tools.refund]
description = "Refund an order. Idempotent per action id."
input_schema = { type = "object", properties = { order = { type = "string" }, amount_cents = { type = "integer" } }, required = ["order"] }
"#;

fn mcp_call(action_id: &str) -> CallToolRequestParams {
    let Value::Object(arguments) = json!({"order": action_id, "amount_cents": 4850}) else {
        unreachable!()
    };
    let mut meta = JsonObject::new();
    meta.insert("io.intent-worker/action_id".into(), action_id.into());
    let mut params = CallToolRequestParams::new("refund".to_string()).with_arguments(arguments);
    params.meta = Some(RequestMetaObject::from(MetaObject::from(meta)));
    params
}

fn text(result: &CallToolResult) -> String {
    result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread")]
async fn the_mcp_gateway_answers_a_key_one_byte_too_long_with_a_tool_error() {
    let (env, _ds, _w) = world().await;
    let tenant = tenant();
    let tools = env.dir.join("mcp-tools.toml");
    std::fs::write(&tools, MCP_TOOLS).unwrap();
    let token = "long-tenant-token-0123456789";
    let settings: BTreeMap<String, String> = [
        ("AMQP_URL", env.amqp_url.clone()),
        ("INTENTS_EXCHANGE", env.topology.intents_exchange.clone()),
        ("RESULTS_EXCHANGE", env.topology.results_exchange.clone()),
        ("PUBLISHER_MCP_TOOLS", tools.display().to_string()),
        ("PUBLISHER_MCP_TOKENS", format!("{tenant}={token}")),
        ("PUBLISHER_MCP_WAIT", "20s".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let mut gateway = McpGateway::start(free_port(), settings).await;
    worker::tls::install_default_provider();
    let client = ClientConfig::new(
        ClientCapabilities::default(),
        Implementation::new("e2e-hostile-keys", "1"),
    )
    .serve(StreamableHttpClientTransport::from_config(
        StreamableHttpClientTransportConfig::with_uri(gateway.url()).auth_header(token),
    ))
    .await
    .expect("MCP client connects");

    for len in [55, 200] {
        let id = action_id("mcp", len);
        // A gateway task that panics leaves the client without an answer: bounded, so that
        // is a failure here, not a hang.
        let refused = tokio::time::timeout(T, client.call_tool(mcp_call(&id)))
            .await
            .expect("the gateway answers in time")
            .expect("an answer");
        let said = text(&refused);
        assert_eq!(refused.is_error, Some(true), "{said}");
        assert!(said.contains("nothing was sent"), "{said}");
        assert!(
            said.contains(&format!("{} bytes", 200 + 1 + len)) && said.contains("255-byte limit"),
            "{said}"
        );
    }

    // The gateway goes on serving: the longest pair is carried out.
    let fits = action_id("mcp", 54);
    let ok = tokio::time::timeout(T, client.call_tool(mcp_call(&fits)))
        .await
        .expect("the gateway answers in time")
        .expect("an answer");
    assert_ne!(ok.is_error, Some(true), "{}", text(&ok));
    let event = ok.structured_content.expect("structuredContent");
    assert_eq!(event["status"], "succeeded", "{event}");
    succeeded_once(&env, &tenant, &fits).await;
    assert_eq!(env.writes(&key(&tenant, &action_id("mcp", 55))).await, 0);
    assert!(
        !gateway.output.contains("panicked"),
        "{}",
        gateway.output.text()
    );
    client.cancel().await.ok();
    gateway.kill();
    cleanup(env).await;
}

#[tokio::test]
async fn a_raw_publish_of_the_long_pair_is_dead_lettered_and_answered_rejected() {
    let (env, _ds, mut w) = world().await;
    let tenant = tenant();
    let mut agent = Agent::new(&env, &[tenant.as_str()]).await;
    let over = action_id("raw", 55);
    let raw = body(&tenant, &over, json!({"order": "o-1"}));
    // Straight to the intents exchange, as any AMQP client can: no message id at all.
    agent.send_raw(&tenant, raw.as_bytes()).await;

    let answers = agent.until(&tenant, &over, Status::Rejected, T).await;
    let rejected = answers.last().unwrap();
    assert_eq!(
        rejected.reason,
        Some(RejectReason::InvalidMessage),
        "{rejected:?}"
    );
    assert_eq!(
        rejected.detail.as_deref(),
        Some("key_too_long"),
        "{rejected:?}"
    );
    assert!(
        rejected.message.contains("256 bytes"),
        "{}",
        rejected.message
    );

    let copies = wait_for("the dead-letter copy", T, || async {
        let copies = agent.drain_dead_letters(&env).await;
        (!copies.is_empty()).then_some(copies)
    })
    .await;
    assert_eq!(copies.len(), 1);
    let header = |name: &str| {
        copies[0]
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(name).cloned())
            .map(|v| match v {
                AMQPValue::LongString(s) => s.to_string(),
                other => format!("{other:?}"),
            })
            .unwrap_or_default()
    };
    assert_eq!(header("x-intent-worker-reason"), "invalid_message");
    let detail = header("x-intent-worker-detail");
    assert!(detail.starts_with("key_too_long"), "{detail}");
    assert_eq!(copies[0].delivery.data, raw.as_bytes(), "the original body");

    // Nothing was recorded or sent, and the worker goes on: the longest pair succeeds.
    assert_eq!(env.state(&tenant, &over).await, "");
    assert_eq!(env.writes(&key(&tenant, &over)).await, 0);
    let fits = action_id("raw", 54);
    agent
        .send_raw(
            &tenant,
            body(&tenant, &fits, json!({"order": "o-2"})).as_bytes(),
        )
        .await;
    agent.until(&tenant, &fits, Status::Succeeded, T).await;
    succeeded_once(&env, &tenant, &fits).await;
    assert!(w.is_running());
    cleanup(env).await;
}

/// The relay reads `failed_at` and `failure` (migration 0002). On a table an application made
/// from 0001 alone it stops at start-up with the usage code and a hint, instead of failing every
/// claim; `publisher migrate` adds the columns to that table and the relay then runs.
#[tokio::test]
async fn a_relay_on_a_table_without_the_failure_columns_stops_with_a_hint() {
    let env = Env::new().await;
    let first = include_str!("../../../publisher/migrations/0001_intent_outbox.sql");
    sqlx::raw_sql(first)
        .execute(&env.pool)
        .await
        .expect("0001 only");
    let relay = |args: &[&str]| {
        Command::new(e2e::procs::publisher_bin())
            .args(args)
            .env_clear()
            .env("RUST_LOG", "info,lapin=warn,sqlx=warn")
            .env("AMQP_URL", &env.amqp_url)
            .env("PUBLISHER_DATABASE_URL", &env.db_url)
            .env("INTENTS_EXCHANGE", &env.topology.intents_exchange)
            .env("PUBLISHER_METRICS_ADDR", "off")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn publisher")
    };
    let mut refused = relay(&["relay"]);
    let exited = wait_for("the relay to stop", T, || {
        let status = refused.try_wait().unwrap();
        async move { status }
    })
    .await;
    let out = refused.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(exited.code(), Some(2), "{err}");
    assert!(
        err.contains("publisher migrate") && err.contains("failed_at"),
        "{err}"
    );

    let migrate = relay(&["migrate"]).wait_with_output().unwrap();
    assert!(migrate.status.success(), "{:?}", migrate);
    let mut running = relay(&["relay"]);
    let stderr = running.stderr.take().unwrap();
    let started = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains("relay running"))
    });
    let started = tokio::time::timeout(T, started).await;
    let _ = running.kill();
    let _ = running.wait();
    assert!(
        matches!(started, Ok(Ok(true))),
        "the relay runs after the migration"
    );
    cleanup(env).await;
}
