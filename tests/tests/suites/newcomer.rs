//! What a newcomer meets following the documentation with the built binaries: a blank token
//! variable counts as unset; a listener that cannot bind stops start-up naming its variable;
//! a clean SIGTERM logs no ERROR; `publisher send --wait` returns at once on a `pending` answer;
//! a broker without the worker's exchange or without the URL's vhost is explained with the
//! next step; a refused `Host` names the setting that allows it.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use e2e::{cleanup, free_port, Agent, Downstream, Env, McpGateway, Worker, WorkerOptions};
use serde_json::json;

const ADMIN: &str = "admin-token-0123456789abcdef";
const NORTH_MCP: &str = "north-mcp-token-0123456789";

fn publisher(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(e2e::procs::publisher_bin())
        .args(args)
        .env_clear()
        .env("RUST_LOG", "info,lapin=off")
        .envs(env.iter().copied())
        .output()
        .expect("run publisher")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn mcp_tools(env: &Env) -> String {
    let path = env.dir.join("mcp-tools.toml");
    std::fs::write(
        &path,
        "[tools.refund]\ndescription = \"Refund\"\ninput_schema = { type = \"object\" }\n",
    )
    .unwrap();
    path.display().to_string()
}

#[tokio::test]
async fn a_blank_status_token_counts_as_unset() {
    let env = Env::new().await;
    // `PUBLISHER_STATUS_TOKEN=$WORKER_ADMIN_TOKEN` with the variable not exported.
    let out = publisher(
        &[
            "wait",
            "--tenant",
            "north-shop",
            "--action-id",
            "a-1",
            "--timeout",
            "1s",
        ],
        &[
            ("PUBLISHER_STATUS_URL", "http://127.0.0.1:9"),
            ("PUBLISHER_STATUS_TOKEN", ""),
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("PUBLISHER_STATUS_TOKEN"),
        "{}",
        stderr(&out)
    );

    let tools = mcp_tools(&env);
    let out = publisher(
        &["mcp"],
        &[
            ("AMQP_URL", &env.amqp_url),
            ("PUBLISHER_MCP_TOOLS", &tools),
            ("PUBLISHER_MCP_TOKENS", &format!("north-shop={NORTH_MCP}")),
            ("PUBLISHER_STATUS_URL", "http://127.0.0.1:9"),
            ("PUBLISHER_STATUS_TOKEN", " "),
            ("PUBLISHER_MCP_ADDR", &format!("127.0.0.1:{}", free_port())),
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("PUBLISHER_STATUS_TOKEN"),
        "{}",
        stderr(&out)
    );
    cleanup(env).await;
}

#[tokio::test]
async fn a_listener_that_cannot_bind_stops_start_up_naming_its_variable() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    for var in ["METRICS_ADDR", "WORKER_ADMIN_ADDR"] {
        let opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
            .with_admin(ADMIN)
            .with_metrics()
            .env(var, &addr);
        let mut w = Worker::spawn(&env, "w", &opts);
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = w.exit_status() {
                break s;
            }
            assert!(
                Instant::now() < deadline,
                "{var}={addr} taken: the worker still runs:\n{}",
                w.output.text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let text = w.output.text();
        assert_eq!(status.code(), Some(2), "{var}: {text}");
        assert!(text.contains(var) && text.contains(&addr), "{var}: {text}");
    }

    let tools = mcp_tools(&env);
    let out = publisher(
        &["mcp"],
        &[
            ("AMQP_URL", &env.amqp_url),
            ("PUBLISHER_MCP_TOOLS", &tools),
            ("PUBLISHER_MCP_TOKENS", &format!("north-shop={NORTH_MCP}")),
            ("PUBLISHER_MCP_ADDR", &addr),
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("PUBLISHER_MCP_ADDR") && stderr(&out).contains(&addr),
        "{}",
        stderr(&out)
    );
    drop(taken);
    cleanup(env).await;
}

#[tokio::test]
async fn a_clean_sigterm_logs_no_error() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let mut opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .with_admin(ADMIN)
        .with_metrics();
    if let Ok(filter) = std::env::var("SHOW_SIGTERM_LOG") {
        opts = opts.env("RUST_LOG", &filter);
    }
    let mut w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    agent
        .request("north-shop", "r-1", "refund", json!({"order": "o-1"}))
        .await;
    agent.succeeded("north-shop", "r-1").await;
    assert_eq!(w.terminate_async(Duration::from_secs(30)).await, Some(0));
    let errors: Vec<String> = w
        .output
        .text()
        .lines()
        .filter(|l| l.contains("ERROR"))
        .map(str::to_string)
        .collect();
    assert!(
        errors.is_empty(),
        "a clean shutdown logged:\n{}",
        errors.join("\n")
    );
    drop(agent);
    cleanup(env).await;
}

#[tokio::test]
async fn send_wait_answers_pending_at_once() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""));
    let w = Worker::start(&env, "w", &opts).await;
    let common = [
        ("AMQP_URL", env.amqp_url.as_str()),
        ("INTENTS_EXCHANGE", env.topology.intents_exchange.as_str()),
        ("RESULTS_EXCHANGE", env.topology.results_exchange.as_str()),
    ];
    for (id, extra) in [("d-1", None), ("d-2", Some("--until-final"))] {
        ds.fault(json!({"kind": "drop_after_commit", "key": format!("north-shop:{id}")}))
            .await;
        let mut args = vec![
            "send",
            "--wait",
            "--timeout",
            "8s",
            "--tenant",
            "north-shop",
            "--action-id",
            id,
            "--tool",
            "deploy",
            "--args",
            r#"{"service":"api"}"#,
        ];
        args.extend(extra);
        let started = Instant::now();
        let out = publisher(&args, &common);
        let took = started.elapsed();
        assert_eq!(out.status.code(), Some(10), "{id}: {}", stderr(&out));
        let event: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(event["status"], "pending");
        if extra.is_none() {
            assert!(took < Duration::from_secs(6), "pending waited {took:?}");
        } else {
            assert!(took >= Duration::from_secs(7), "--until-final: {took:?}");
        }
    }
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn a_broker_without_the_exchange_or_the_vhost_says_what_to_do() {
    let env = Env::new().await;
    // No worker ever ran: the intents exchange does not exist.
    let out = publisher(
        &[
            "send",
            "--tenant",
            "north-shop",
            "--action-id",
            "x-1",
            "--tool",
            "refund",
            "--args",
            "{}",
        ],
        &[
            ("AMQP_URL", &env.amqp_url),
            ("INTENTS_EXCHANGE", &env.topology.intents_exchange),
        ],
    );
    let err = stderr(&out);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("start a worker") && err.contains("definitions"),
        "no next step: {err}"
    );

    let base = env.amqp_url.rsplit_once('/').unwrap().0;
    let out = publisher(
        &[
            "send",
            "--tenant",
            "north-shop",
            "--action-id",
            "x-1",
            "--tool",
            "refund",
            "--args",
            "{}",
        ],
        &[("AMQP_URL", &format!("{base}/no-such-vhost"))],
    );
    let err = stderr(&out);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("vhost") && err.contains("no-such-vhost") && !err.contains("not reachable"),
        "{err}"
    );
    cleanup(env).await;
}

#[tokio::test]
async fn a_refused_host_names_the_setting_that_allows_it() {
    let env = Env::new().await;
    let tools = mcp_tools(&env);
    let settings = [
        ("AMQP_URL", env.amqp_url.clone()),
        ("PUBLISHER_MCP_TOOLS", tools),
        ("PUBLISHER_MCP_TOKENS", format!("north-shop={NORTH_MCP}")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let gateway = McpGateway::start(free_port(), settings).await;
    let r = e2e::http()
        .post(gateway.url())
        .header("host", "mcp.example.com")
        .bearer_auth(NORTH_MCP)
        .header("accept", "application/json, text/event-stream")
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "ping"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let body = r.text().await.unwrap();
    assert!(body.contains("PUBLISHER_MCP_ALLOWED_HOSTS"), "{body}");
    drop(gateway);
    cleanup(env).await;
}
