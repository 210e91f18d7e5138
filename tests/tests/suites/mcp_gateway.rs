//! The MCP gateway (`publisher mcp`). An rmcp client over streamable HTTP against a
//! real gateway process, worker, broker, Postgres and reference downstream; counts come from
//! the downstream's tables and the worker's ledger.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use e2e::{cleanup, free_port, Downstream, Env, McpGateway, Worker, WorkerOptions};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, CancelTaskParams, ClientCapabilities,
    ClientConfig, GetTaskParams, Implementation, JsonObject, MetaObject, ProtocolVersion,
    RequestMetaObject, TaskPayload, TaskStatus,
};
use rmcp::service::{ClientLifecycleMode, ClientServiceExt, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{RoleClient, ServiceExt};
use serde_json::{json, Value};

const ADMIN: &str = "admin-token-0123456789";
const NORTH: &str = "north-mcp-token-0123456789";
const SOUTH: &str = "south-mcp-token-0123456789";

const MCP_TOOLS: &str = r#"
[tools.refund]
description = "Refund an order. Idempotent per action id."
input_schema = { type = "object", properties = { order = { type = "string" }, amount_cents = { type = "integer", minimum = 1 }, currency = { type = "string" } }, required = ["order", "amount_cents"], additionalProperties = false }

[tools.deploy]
description = "Deploy a version (no recovery: an unknown outcome stays unknown)."
input_schema = { type = "object", properties = { v = { type = "integer" } }, required = ["v"] }
"#;

struct World {
    env: Env,
    ds: Downstream,
    _worker: Worker,
    gateway: McpGateway,
}

/// A worker with the status API, the reference downstream, and a gateway for north-shop and
/// south-shop waiting `wait` per call.
async fn world(wait: &str, extra: &[(&str, &str)]) -> World {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = env.standard_tools(ds.port, "");
    let worker = Worker::start(&env, "w1", &WorkerOptions::new(tools).with_admin(ADMIN)).await;
    let mcp_tools = env.dir.join("mcp-tools.toml");
    std::fs::write(&mcp_tools, MCP_TOOLS).unwrap();
    let mut settings: BTreeMap<String, String> = [
        ("AMQP_URL", env.amqp_url.clone()),
        ("INTENTS_EXCHANGE", env.topology.intents_exchange.clone()),
        ("RESULTS_EXCHANGE", env.topology.results_exchange.clone()),
        ("PUBLISHER_MCP_TOOLS", mcp_tools.display().to_string()),
        (
            "PUBLISHER_MCP_TOKENS",
            format!("north-shop={NORTH},south-shop={SOUTH}"),
        ),
        (
            "PUBLISHER_STATUS_URL",
            format!("http://127.0.0.1:{}", worker.admin_port.unwrap()),
        ),
        ("PUBLISHER_STATUS_TOKEN", ADMIN.to_string()),
        ("PUBLISHER_MCP_WAIT", wait.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    for (k, v) in extra {
        settings.insert(k.to_string(), v.to_string());
    }
    let gateway = McpGateway::start(free_port(), settings).await;
    World {
        env,
        ds,
        _worker: worker,
        gateway,
    }
}

type Client = RunningService<RoleClient, ClientConfig>;

async fn client(url: &str, token: &str, tasks: bool) -> Client {
    // rmcp builds its own reqwest client, whose TLS needs the process's crypto provider.
    worker::tls::install_default_provider();
    let transport = StreamableHttpClientTransport::from_config(
        StreamableHttpClientTransportConfig::with_uri(url).auth_header(token),
    );
    if tasks {
        // The tasks extension is declared per request (2026-07-28 lifecycle): the gateway is
        // stateless, so capabilities given once at `initialize` would not reach later requests.
        let capabilities = ClientCapabilities::builder().enable_tasks().build();
        ClientConfig::new(capabilities, Implementation::new("e2e-mcp", "1"))
            .serve_with_lifecycle(
                transport,
                ClientLifecycleMode::Discover {
                    preferred_versions: vec![ProtocolVersion::V_2026_07_28],
                },
            )
            .await
            .expect("MCP client connects")
    } else {
        ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("e2e-mcp", "1"),
        )
        .serve(transport)
        .await
        .expect("MCP client connects")
    }
}

fn call(tool: &str, action_id: Option<&str>, arguments: Value) -> CallToolRequestParams {
    let Value::Object(arguments) = arguments else {
        panic!("arguments must be an object")
    };
    let mut params = CallToolRequestParams::new(tool.to_string()).with_arguments(arguments);
    if let Some(action_id) = action_id {
        let mut meta = JsonObject::new();
        meta.insert("io.intent-worker/action_id".into(), action_id.into());
        params.meta = Some(RequestMetaObject::from(MetaObject::from(meta)));
    }
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

fn refund_args(order: &str) -> Value {
    json!({"order": order, "amount_cents": 4850, "currency": "USD"})
}

#[tokio::test(flavor = "multi_thread")]
async fn lists_tools_and_a_repeated_call_gets_the_same_receipt_with_one_write() {
    let w = world("15s", &[]).await;
    let c = client(&w.gateway.url(), NORTH, false).await;

    let tools = c.list_all_tools().await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(
        names,
        ["deploy", "refund", "get_action_status"],
        "{names:?}"
    );
    let refund = tools.iter().find(|t| t.name == "refund").unwrap();
    assert_eq!(
        refund.description.as_deref(),
        Some("Refund an order. Idempotent per action id.")
    );
    assert_eq!(
        refund.input_schema["required"],
        json!(["order", "amount_cents"])
    );

    let first = c
        .call_tool(call("refund", Some("r-1"), refund_args("o-1")))
        .await
        .unwrap();
    assert_ne!(first.is_error, Some(true), "{}", text(&first));
    let event = first.structured_content.clone().expect("structuredContent");
    assert_eq!(event["status"], "succeeded", "{event}");
    assert_eq!(event["tenant"], "north-shop");
    assert_eq!(event["action_id"], "r-1");
    let receipt = event["receipt"].clone();
    assert!(receipt["receipt_id"].is_string(), "{receipt}");
    assert_eq!(receipt["idempotency_key"], "north-shop:r-1");

    // The same call again (a retry after a broken stream, a model repeating itself).
    let again = c
        .call_tool(call("refund", Some("r-1"), refund_args("o-1")))
        .await
        .unwrap();
    assert_eq!(again.structured_content.unwrap()["receipt"], receipt);
    assert_eq!(w.env.mutations("north-shop:r-1").await, 1);

    // The status tool reads the same answer; nothing is sent.
    let status = c
        .call_tool(call("get_action_status", None, json!({"action_id": "r-1"})))
        .await
        .unwrap();
    assert_eq!(status.structured_content.unwrap()["receipt"], receipt);
    assert_eq!(w.env.mutations("north-shop:r-1").await, 1);

    // Same key, other arguments: refused by the worker, shown as an error with the evidence.
    let conflict = c
        .call_tool(call("refund", Some("r-1"), refund_args("o-2")))
        .await
        .unwrap();
    assert_eq!(conflict.is_error, Some(true), "{}", text(&conflict));
    assert_eq!(conflict.structured_content.unwrap()["status"], "rejected");
    assert_eq!(w.env.mutations("north-shop:r-1").await, 1);
    c.cancel().await.ok();
    drop(w.gateway);
    cleanup(w.env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reply_dropped_after_commit_answers_outcome_unknown_and_never_writes_twice() {
    let w = world("4s", &[]).await;
    // `deploy` has no recovery: a dropped response leaves the outcome unknown.
    w.ds.fault(json!({"kind": "drop_after_commit", "key": "north-shop:d-1"}))
        .await;
    let c = client(&w.gateway.url(), NORTH, false).await;
    let result = c
        .call_tool(call("deploy", Some("d-1"), json!({"v": 7})))
        .await
        .unwrap();
    let said = text(&result);
    assert_ne!(result.is_error, Some(true), "{said}");
    assert!(result.structured_content.is_none(), "{result:?}");
    assert!(said.contains("OUTCOME UNKNOWN"), "{said}");
    assert!(said.contains("Do not retry"), "{said}");
    assert!(said.contains("another action id"), "{said}");
    assert!(said.contains("get_action_status"), "{said}");
    assert_eq!(w.env.mutations("north-shop:d-1").await, 1);

    // The model calls again anyway: still unknown, still one write.
    let again = c
        .call_tool(call("deploy", Some("d-1"), json!({"v": 7})))
        .await
        .unwrap();
    assert!(text(&again).contains("OUTCOME UNKNOWN"), "{}", text(&again));
    assert_eq!(w.env.mutations("north-shop:d-1").await, 1);
    assert_eq!(w.env.writes("north-shop:d-1").await, 1);
    c.cancel().await.ok();
    drop(w.gateway);
    cleanup(w.env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_calls_are_refused_before_anything_is_published() {
    let w = world("15s", &[]).await;
    let c = client(&w.gateway.url(), NORTH, false).await;

    let no_key = c
        .call_tool(call("refund", None, refund_args("o-1")))
        .await
        .unwrap();
    assert_eq!(no_key.is_error, Some(true));
    let said = text(&no_key);
    assert!(said.contains("io.intent-worker/action_id"), "{said}");
    assert!(said.contains("tool_meta_resolver"), "{said}");

    let invalid = c
        .call_tool(call(
            "refund",
            Some("r-bad"),
            json!({"order": 17, "amount_cents": 0, "extra": true}),
        ))
        .await
        .unwrap();
    assert_eq!(invalid.is_error, Some(true));
    let said = text(&invalid);
    assert!(said.contains("/order"), "{said}");
    assert!(said.contains("/amount_cents"), "{said}");
    assert!(said.contains("nothing was sent"), "{said}");

    let unknown = c
        .call_tool(call("drop_tables", Some("x-1"), json!({})))
        .await
        .unwrap();
    assert_eq!(unknown.is_error, Some(true));

    // A good call afterwards is the only thing that ever reached the worker (one queue, one
    // consumer: anything published before it would have been recorded before it).
    let ok = c
        .call_tool(call("refund", Some("r-good"), refund_args("o-1")))
        .await
        .unwrap();
    assert_eq!(ok.structured_content.unwrap()["status"], "succeeded");
    let recorded: Vec<String> = sqlx::query_scalar("SELECT action_id FROM operations ORDER BY id")
        .fetch_all(&w.env.pool)
        .await
        .unwrap();
    assert_eq!(recorded, ["r-good"]);
    assert_eq!(w.env.writes("north-shop:r-bad").await, 0);

    // Without a token, or with a wrong one: 401, no MCP at all.
    let http = e2e::http();
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}});
    for auth in [None, Some("Bearer not-a-known-token-000000")] {
        let mut request = http
            .post(w.gateway.url())
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(body.to_string());
        if let Some(auth) = auth {
            request = request.header("authorization", auth);
        }
        assert_eq!(request.send().await.unwrap().status().as_u16(), 401);
    }
    c.cancel().await.ok();
    drop(w.gateway);
    cleanup(w.env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_token_for_one_tenant_cannot_reach_another_tenants_action() {
    let w = world("15s", &[]).await;
    let north = client(&w.gateway.url(), NORTH, true).await;
    let south = client(&w.gateway.url(), SOUTH, true).await;
    let plain_south = client(&w.gateway.url(), SOUTH, false).await;

    // North's task: its id is north's action key.
    let created = north
        .call_tool_once(call("refund", Some("shared-1"), refund_args("o-n")))
        .await
        .unwrap();
    let CallToolResponse::Task(created) = created else {
        panic!("expected a task, got {created:?}")
    };
    assert_eq!(created.task.task_id, "north-shop:shared-1");
    e2e::wait_for("north's refund", Duration::from_secs(20), || async {
        (w.env.state("north-shop", "shared-1").await == "succeeded").then_some(())
    })
    .await;

    // South asks for north's task and for the same action id: nothing of north's.
    let err = south
        .get_task(GetTaskParams::new("north-shop:shared-1".to_string()))
        .await
        .expect_err("another tenant's task is unknown");
    assert!(format!("{err:?}").contains("unknown task"), "{err:?}");
    assert!(south
        .cancel_task(CancelTaskParams::new("north-shop:shared-1".to_string()))
        .await
        .is_err());
    let status = plain_south
        .call_tool(call(
            "get_action_status",
            None,
            json!({"action_id": "shared-1"}),
        ))
        .await
        .unwrap();
    assert!(text(&status).contains("No action"), "{}", text(&status));
    assert!(status.structured_content.is_none());

    // The same action id under south's token is south's own action: its own write.
    let own = plain_south
        .call_tool(call("refund", Some("shared-1"), refund_args("o-s")))
        .await
        .unwrap();
    let event = own.structured_content.unwrap();
    assert_eq!(event["tenant"], "south-shop");
    assert_eq!(w.env.mutations("north-shop:shared-1").await, 1);
    assert_eq!(w.env.mutations("south-shop:shared-1").await, 1);
    for c in [north, south, plain_south] {
        c.cancel().await.ok();
    }
    drop(w.gateway);
    cleanup(w.env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_goes_from_working_to_completed_across_a_gateway_restart() {
    let mut w = world("15s", &[]).await;
    // A slow downstream keeps the task working long enough to restart the gateway.
    w.ds.fault(json!({"kind": "slow", "delay_ms": 1500, "key": "north-shop:t-1"}))
        .await;
    let c = client(&w.gateway.url(), NORTH, true).await;
    let created = c
        .call_tool_once(call("refund", Some("t-1"), refund_args("o-t")))
        .await
        .unwrap();
    let CallToolResponse::Task(created) = created else {
        panic!("expected a task, got {created:?}")
    };
    assert_eq!(created.task.task_id, "north-shop:t-1");
    assert_eq!(created.task.status, TaskStatus::Working);
    let working = c
        .get_task(GetTaskParams::new("north-shop:t-1".to_string()))
        .await
        .unwrap();
    assert_eq!(working.task.status(), TaskStatus::Working, "{working:?}");
    assert!(working
        .task
        .task
        .status_message
        .as_deref()
        .unwrap_or_default()
        .contains("cannot undo"));
    c.cancel_task(CancelTaskParams::new("north-shop:t-1".to_string()))
        .await
        .expect("cancel is acknowledged");
    c.cancel().await.ok();

    // SIGKILL the gateway; a new process knows nothing but the ledger.
    w.gateway.restart().await;
    let c = client(&w.gateway.url(), NORTH, true).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let done = loop {
        let task = c
            .get_task(GetTaskParams::new("north-shop:t-1".to_string()))
            .await
            .unwrap();
        if task.task.status().is_terminal() {
            break task;
        }
        assert!(Instant::now() < deadline, "task never completed: {task:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let TaskPayload::Completed { result } = done.task.payload else {
        panic!("expected completed, got {done:?}")
    };
    let result: CallToolResult = serde_json::from_value(Value::Object(result)).unwrap();
    let event = result.structured_content.expect("structuredContent");
    assert_eq!(event["status"], "succeeded");
    assert_eq!(event["receipt"]["idempotency_key"], "north-shop:t-1");
    // Cancelled or not, the write happened once and the task says so.
    assert_eq!(w.env.mutations("north-shop:t-1").await, 1);
    c.cancel().await.ok();
    drop(w.gateway);
    cleanup(w.env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn outbox_mode_with_the_action_id_as_an_argument() {
    // The agent's database here is a separate fresh one, as an application's would be.
    let agent_db = Env::new().await;
    let w = world(
        "15s",
        &[
            ("PUBLISHER_DATABASE_URL", agent_db.db_url.as_str()),
            ("PUBLISHER_MCP_ACTION_ID", "argument"),
        ],
    )
    .await;
    let relay = std::process::Command::new(e2e::procs::bin_dir().join("publisher"))
        .arg("relay")
        .env("AMQP_URL", &w.env.amqp_url)
        .env("INTENTS_EXCHANGE", &w.env.topology.intents_exchange)
        .env("PUBLISHER_DATABASE_URL", &agent_db.db_url)
        .env("PUBLISHER_METRICS_ADDR", "off")
        .env("PUBLISHER_IDLE_POLL", "20ms")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn publisher relay");
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _relay = Kill(relay);

    let c = client(&w.gateway.url(), NORTH, false).await;
    let tools = c.list_all_tools().await.unwrap();
    let refund = tools.iter().find(|t| t.name == "refund").unwrap();
    assert_eq!(
        refund.input_schema["required"],
        json!(["order", "amount_cents", "action_id"])
    );

    let mut args = refund_args("o-9");
    args["action_id"] = "arg-1".into();
    let result = c
        .call_tool(call("refund", None, args.clone()))
        .await
        .unwrap();
    let event = result.structured_content.expect("succeeded");
    assert_eq!(event["status"], "succeeded", "{event}");
    // The key is the argument, and the argument is not part of the tool's arguments.
    assert_eq!(event["receipt"]["idempotency_key"], "north-shop:arg-1");
    assert!(
        event["receipt"]["arguments"].get("action_id").is_none(),
        "{event}"
    );
    let sent: Vec<(String, bool)> =
        sqlx::query_as("SELECT action_id, sent_at IS NOT NULL FROM intent_outbox ORDER BY id")
            .fetch_all(&agent_db.pool)
            .await
            .unwrap();
    assert_eq!(sent, [("arg-1".to_string(), true)]);

    let again = c.call_tool(call("refund", None, args)).await.unwrap();
    assert_eq!(
        again.structured_content.unwrap()["receipt"],
        event["receipt"]
    );
    assert_eq!(w.env.mutations("north-shop:arg-1").await, 1);

    let missing = c
        .call_tool(call(
            "refund",
            Some("meta-is-not-read-here"),
            refund_args("o-9"),
        ))
        .await
        .unwrap();
    assert_eq!(missing.is_error, Some(true));
    assert!(text(&missing).contains("action_id"), "{}", text(&missing));
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM intent_outbox")
        .fetch_one(&agent_db.pool)
        .await
        .unwrap();
    assert_eq!(rows, 2, "the refused call enqueued nothing");
    c.cancel().await.ok();
    drop(w.gateway);
    cleanup(w.env).await;
    cleanup(agent_db).await;
}

/// stdio: one JSON-RPC message per line, the tenant fixed by `PUBLISHER_MCP_TENANT`.
#[tokio::test(flavor = "multi_thread")]
async fn stdio_serves_a_fixed_tenant() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let w = world("15s", &[]).await;
    let mut child = tokio::process::Command::new(e2e::procs::bin_dir().join("publisher"))
        .args(["mcp", "--transport", "stdio"])
        .env("AMQP_URL", &w.env.amqp_url)
        .env("INTENTS_EXCHANGE", &w.env.topology.intents_exchange)
        .env("RESULTS_EXCHANGE", &w.env.topology.results_exchange)
        .env("PUBLISHER_MCP_TOOLS", w.env.dir.join("mcp-tools.toml"))
        .env("PUBLISHER_MCP_TENANT", "south-shop")
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn publisher mcp --transport stdio");
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let messages = [
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "e2e", "version": "1"}}}),
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "refund", "arguments": {"order": "o-s", "amount_cents": 100}, "_meta": {"io.intent-worker/action_id": "stdio-1"}}}),
    ];
    let mut answer = None;
    for message in messages {
        stdin
            .write_all(format!("{message}\n").as_bytes())
            .await
            .unwrap();
        stdin.flush().await.unwrap();
        if message.get("id").is_none() {
            continue;
        }
        let id = message["id"].clone();
        let reply = loop {
            let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
                .await
                .expect("a reply in time")
                .unwrap()
                .expect("stdout open");
            let reply: Value = serde_json::from_str(&line).unwrap();
            if reply["id"] == id {
                break reply;
            }
        };
        answer = Some(reply);
    }
    let answer = answer.unwrap();
    let event = &answer["result"]["structuredContent"];
    assert_eq!(event["status"], "succeeded", "{answer}");
    assert_eq!(event["tenant"], "south-shop");
    assert_eq!(w.env.mutations("south-shop:stdio-1").await, 1);
    drop(stdin);
    let _ = child.kill().await;
    drop(w.gateway);
    cleanup(w.env).await;
}

/// The Python examples (`examples/mcp/`: the `mcp` package, and the OpenAI Agents SDK without a
/// model) against a real gateway. `scripts/test.sh` sets `MCP_PYTHON` to its virtualenv with the
/// pinned packages (`examples/mcp/requirements.txt`); without it this test only says so.
#[tokio::test(flavor = "multi_thread")]
async fn the_python_examples_run_against_a_real_gateway() {
    let Some(python) = std::env::var_os("MCP_PYTHON") else {
        eprintln!("MCP_PYTHON is not set: the Python MCP examples did not run (scripts/test.sh runs them)");
        return;
    };
    let w = world("15s", &[]).await;
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mcp");
    for (script, key) in [
        ("mcp_client.py", "north-shop:py-1"),
        ("agents_sdk.py", "north-shop:case-py:refund:order-731"),
    ] {
        let out = tokio::process::Command::new(&python)
            .arg(examples.join(script))
            .env("MCP_URL", w.gateway.url())
            .env("MCP_TOKEN", NORTH)
            .env("ACTION_ID", "py-1")
            .env("CASE_ID", "case-py")
            .output()
            .await
            .expect("run python");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{script} failed:\n{said}");
        assert!(said.contains("ok"), "{script}:\n{said}");
        assert_eq!(w.env.mutations(key).await, 1, "{script}");
    }

    // The Agents SDK example of docs/agents.md needs a model to run; everything up to the final
    // `asyncio.run(main())` runs here (its imports and objects against the pinned SDK), and its
    // host configuration is JSON.
    let guide = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/agents.md"),
    )
    .unwrap();
    let section = guide
        .split("\n## From an MCP agent\n")
        .nth(1)
        .expect("docs/agents.md section From an MCP agent")
        .split("\n## ")
        .next()
        .unwrap();
    let block = |lang: &str| -> String {
        let start = section.find(&format!("```{lang}\n")).expect("code block") + lang.len() + 4;
        let len = section[start..].find("```").unwrap();
        section[start..start + len].to_string()
    };
    let example = block("python");
    let (definitions, last) = example.trim_end().rsplit_once('\n').unwrap();
    assert_eq!(last, "asyncio.run(main())");
    let out = tokio::process::Command::new(&python)
        .args(["-c", definitions])
        .env("MCP_TOKEN", NORTH)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "docs/agents.md Agents SDK example: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let host_config: Value =
        serde_json::from_str(&block("json")).expect("docs/agents.md host JSON");
    assert!(host_config["mcpServers"]["intent-worker"]["url"].is_string());
    drop(w.gateway);
    cleanup(w.env).await;
}

/// Call latency through the gateway (sequential succeeded calls, each a new action), for the
/// figure in docs/benchmarks.md: `cargo nextest run -p e2e -E 'test(/^mcp_gateway::/)' --run-ignored only`.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "measurement"]
async fn call_latency_through_the_gateway() {
    let n: usize = std::env::var("MCP_LATENCY_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let w = world("15s", &[]).await;
    let c = client(&w.gateway.url(), NORTH, false).await;
    let mut took = Vec::with_capacity(n);
    for i in 0..n {
        let started = Instant::now();
        let result = c
            .call_tool(call("refund", Some(&format!("lat-{i}")), refund_args("o")))
            .await
            .unwrap();
        took.push(started.elapsed());
        assert_eq!(result.structured_content.unwrap()["status"], "succeeded");
    }
    took.sort();
    let pct = |p: f64| took[((took.len() as f64 * p).ceil() as usize).clamp(1, took.len()) - 1];
    eprintln!(
        "MCP call latency over {n} sequential calls: p50 {:?}, p99 {:?}, max {:?}",
        pct(0.50),
        pct(0.99),
        took[took.len() - 1]
    );
    c.cancel().await.ok();
    drop(w.gateway);
    cleanup(w.env).await;
}
