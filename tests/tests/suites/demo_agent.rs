//! The Quick start's demo agent (`demo-agent --scenario full`, the example agent of
//! examples/demo-agent, run by scripts/demo.sh): with two real workers on the demo's own tools
//! file (deploy/tools.demo.toml), the reference downstream (one reply lost after commit) and the
//! agent-side relay, its `key=value` summary agrees with the downstream's own tables and the
//! ledger: downstream writes == distinct actions (never intents sent), every reordered and
//! re-spaced repeat answered from the ledger, the conflicting reuse refused, the long-running
//! `deploy` accepted (pending, in progress, with the downstream's operation id) and then
//! succeeded, verified by a poll, with the receipt of the downstream's one job, the lost `payout`
//! reply pending and then held, the refund above the refund tool's approval limit pending
//! (`awaiting_approval`) and never sent until the agent approves it with `worker ops approve`
//! (the worker binary beside it), then sent once, and the compensation of the first refund
//! (`refund_reversal`) succeeded, the refund announced again with `compensated_by` and still
//! written once. Without the fault and without an outbox, the same scenario succeeds
//! throughout. Its binary is found beside the worker's (`e2e::procs::demo_agent_bin`:
//! `cargo build --workspace` builds it).
//! The scripts themselves parse, answer --help and refuse unknown flags (shellcheck-clean where
//! shellcheck is installed); scripts/test.sh runs `scripts/demo.sh --once` for the whole thing.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use e2e::{cleanup, Downstream, Env, Worker, WorkerOptions};
use serde_json::json;

const TENANT: &str = "demo-shop";
const TENANT_TOKEN: &str = "demo-shop-token-1";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("repository root")
}

/// The demo's own tools file (deploy/tools.demo.toml), pointed at the downstream on `port`, as
/// scripts/demo.sh points it.
fn demo_tools(env: &Env, port: u16) -> PathBuf {
    let demo = std::fs::read_to_string(repo().join("deploy/tools.demo.toml"))
        .expect("deploy/tools.demo.toml");
    assert!(demo.contains("http://downstream:9100/"), "{demo}");
    env.write_tools(&demo.replace(
        "http://downstream:9100/",
        &format!("http://127.0.0.1:{port}/"),
    ))
}

/// A child killed (and reaped) on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `publisher <args>` with a clean environment, the test's broker names and `extra`.
fn publisher(env: &Env, args: &[&str], extra: &[(&str, String)]) -> Command {
    command(e2e::procs::publisher_bin(), env, args, extra)
}

/// `demo-agent <args>`, as [`publisher`].
fn demo_agent(env: &Env, args: &[&str], extra: &[(&str, String)]) -> Command {
    command(e2e::procs::demo_agent_bin(), env, args, extra)
}

fn command(bin: PathBuf, env: &Env, args: &[&str], extra: &[(&str, String)]) -> Command {
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "info,lapin=warn,sqlx=warn")
        .env("AMQP_URL", &env.amqp_url)
        .env("INTENTS_EXCHANGE", &env.topology.intents_exchange)
        .env("RESULTS_EXCHANGE", &env.topology.results_exchange);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd
}

/// Runs the demo agent to its end (killed after 90 s), approving with the `worker ops approve`
/// of the worker binary beside it on the test's ledger and `tools`; returns its exit code, its
/// summary and its stdout and stderr.
fn run_agent(
    env: &Env,
    run_id: &str,
    tools: &Path,
    extra: &[(&str, String)],
) -> (Option<i32>, BTreeMap<String, String>, String, String) {
    let out = env.dir.join(format!("agent-{run_id}.out"));
    let err = env.dir.join(format!("agent-{run_id}.log"));
    let worker = e2e::procs::bin_dir().join("worker");
    let mut cmd = demo_agent(
        env,
        &[
            "--scenario",
            "full",
            "--tenant",
            TENANT,
            "--tool",
            "refund",
            "--count",
            "6",
            "--interval-ms",
            "20",
            "--duplicate-every",
            "3",
            "--async-tool",
            "deploy",
            "--held-tool",
            "payout",
            "--reversal-tool",
            "refund_reversal",
            "--run-id",
            run_id,
            "--answer-timeout",
            "20s",
            "--worker-bin",
            worker.to_str().expect("a UTF-8 path"),
            "--ledger-url",
            &env.db_url,
            "--worker-tools",
            tools.to_str().expect("a UTF-8 path"),
        ],
        extra,
    );
    cmd.stdout(File::create(&out).unwrap())
        .stderr(File::create(&err).unwrap());
    let mut child = Proc(cmd.spawn().expect("spawn demo-agent"));
    let deadline = Instant::now() + Duration::from_secs(90);
    let code = loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            break status.code();
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    drop(child);
    let stdout = std::fs::read_to_string(&out).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    let summary = stdout
        .lines()
        .filter(|l| !l.starts_with('{'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    (code, summary, stdout, stderr)
}

async fn count(env: &Env, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string()))
        .fetch_one(&env.pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

fn get<'a>(summary: &'a BTreeMap<String, String>, key: &str) -> &'a str {
    summary.get(key).map(String::as_str).unwrap_or("<missing>")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_full_demo_agrees_with_the_downstreams_tables() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = demo_tools(&env, ds.port);
    let w1 = Worker::start(
        &env,
        "w1",
        &WorkerOptions::new(tools.clone())
            .with_admin("admin-token-0123456789")
            .env("WORKER_TENANT_TOKENS", &format!("{TENANT}={TENANT_TOKEN}")),
    )
    .await;
    let _w2 = Worker::start(&env, "w2", &WorkerOptions::new(tools.clone())).await;

    // The agent's outbox lives in the test's database; the relay publishes it.
    let db = [("PUBLISHER_DATABASE_URL", env.db_url.clone())];
    let migrate = publisher(&env, &["migrate"], &db)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("publisher migrate");
    assert!(migrate.success(), "publisher migrate failed");
    let relay_log = env.dir.join("relay.log");
    let _relay = Proc(
        publisher(
            &env,
            &["relay"],
            &[
                db[0].clone(),
                ("PUBLISHER_IDLE_POLL", "20ms".into()),
                ("PUBLISHER_METRICS_ADDR", "off".into()),
            ],
        )
        .stdout(Stdio::null())
        .stderr(File::create(&relay_log).unwrap())
        .spawn()
        .expect("spawn publisher relay"),
    );

    let run_id = format!("t{}", env.id);
    let deploy = format!("deploy-{run_id}");
    let held = format!("payout-{run_id}");
    ds.fault(json!({"kind": "drop_after_commit", "key": format!("{TENANT}:{held}")}))
        .await;
    let status_url = format!("http://127.0.0.1:{}", w1.admin_port.expect("admin API"));
    let (code, summary, stdout, stderr) = run_agent(
        &env,
        &run_id,
        &tools,
        &[
            db[0].clone(),
            ("PUBLISHER_STATUS_URL", status_url),
            ("PUBLISHER_STATUS_TOKEN", TENANT_TOKEN.into()),
        ],
    );
    let context = format!(
        "summary {summary:?}\n--- stderr\n{stderr}\n--- relay\n{}",
        std::fs::read_to_string(&relay_log).unwrap_or_default()
    );
    assert_eq!(code, Some(0), "{context}");

    // 6 refunds, 2 repeats (every 3rd), 1 conflicting reuse, 1 deploy, 1 payout, 1 refund
    // above the approval limit, 1 reversal; 10 distinct actions, of which the refunds, the
    // deploy, the approved refund and the reversal succeed; the deploy (in progress), the
    // payout (lost reply) and the refund awaiting approval are answered pending.
    let approval = format!("refund-{run_id}-approval");
    let reversal = format!("refund_reversal-{run_id}");
    let original = format!("refund-{run_id}-1");
    let expect = [
        ("run_id", run_id.as_str()),
        ("intents_sent", "13"),
        ("actions", "10"),
        ("succeeded", "9"),
        ("failed_or_rejected", "0"),
        ("repeats_sent", "2"),
        ("repeats_answered_from_ledger", "2"),
        ("conflicts_sent", "1"),
        ("conflicts_refused", "1"),
        ("async_action_id", deploy.as_str()),
        ("async_accepted", "1"),
        ("async_status", "succeeded"),
        ("async_verified_by", "poll"),
        ("pending", "3"),
        ("held", "1"),
        ("held_action_id", held.as_str()),
        ("approval_action_id", approval.as_str()),
        ("approval_awaiting", "1"),
        ("approval_operator", "demo-approver"),
        ("approval_status", "succeeded"),
        ("compensation_action_id", reversal.as_str()),
        ("compensation_of", original.as_str()),
        ("compensation_status", "succeeded"),
        ("compensation_compensates", original.as_str()),
        ("compensated_by", reversal.as_str()),
        ("complete", "true"),
        ("summary_end", "1"),
    ];
    for (key, value) in expect {
        assert_eq!(get(&summary, key), value, "{key}: {context}");
    }
    let answers: usize = get(&summary, "answers").parse().expect("answers");
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with('{')).count(),
        answers,
        "one JSON line per answer: {context}"
    );

    // The downstream's own tables: one write and one mutation per action, never per intent.
    let keys = format!("idem_key LIKE '{TENANT}:%'");
    let mutations = count(
        &env,
        &format!("SELECT count(*) FROM downstream.mutations WHERE {keys}"),
    )
    .await;
    let writes = count(
        &env,
        &format!("SELECT count(*) FROM downstream.requests WHERE kind = 'write' AND {keys}"),
    )
    .await;
    assert_eq!((mutations, writes), (10, 10), "{context}");
    assert_eq!(env.mutations(&format!("{TENANT}:{held}")).await, 1);
    // The approved refund: one mutation, one write, none before its approval (recorded in the
    // ledger by operator:demo-approver, the move out of awaiting_approval).
    let approval_key = format!("{TENANT}:{approval}");
    assert_eq!(env.mutations(&approval_key).await, 1, "{context}");
    assert_eq!(env.writes(&approval_key).await, 1, "{context}");
    let early: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM downstream.requests r WHERE r.idem_key = $3 AND r.at < h.at)
              + (SELECT count(*) FROM downstream.mutations m WHERE m.idem_key = $3 AND m.created_at < h.at)
         FROM operation_history h JOIN operations o ON o.id = h.operation_id
         WHERE o.tenant = $1 AND o.action_id = $2 AND h.from_state = 'awaiting_approval'
           AND h.to_state = 'prepared' AND h.actor = 'operator:demo-approver'",
    )
    .bind(TENANT)
    .bind(&approval)
    .bind(&approval_key)
    .fetch_one(&env.pool)
    .await
    .expect("the approval in the history");
    assert_eq!(early, 0, "sent before its approval: {context}");
    assert_eq!(env.state(TENANT, &approval).await, "succeeded");
    // The compensation: its own one mutation; the refund it undoes still one, still succeeded.
    assert_eq!(
        env.mutations(&format!("{TENANT}:{reversal}")).await,
        1,
        "{context}"
    );
    assert_eq!(
        env.mutations(&format!("{TENANT}:{original}")).await,
        1,
        "{context}"
    );
    let compensates: Option<String> = sqlx::query_scalar(
        "SELECT compensates FROM operations WHERE tenant = $1 AND action_id = $2",
    )
    .bind(TENANT)
    .bind(&reversal)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(compensates.as_deref(), Some(original.as_str()));
    assert_eq!(env.state(TENANT, &reversal).await, "succeeded");
    // The deploy: one job at the downstream, the one the agent was told about (its operation id
    // while in progress, its deployment id as the receipt); one write; polls only read.
    let deploy_key = format!("{TENANT}:{deploy}");
    assert_eq!(env.async_jobs(&deploy_key).await, 1, "{context}");
    assert_eq!(env.writes(&deploy_key).await, 1, "{context}");
    assert!(env.status_reads(&deploy_key).await >= 1, "{context}");
    let (operation, deployment): (String, Option<String>) = sqlx::query_as(
        "SELECT operation_id, deployment_id FROM downstream.async_jobs WHERE idem_key = $1",
    )
    .bind(&deploy_key)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(operation.starts_with("op-"), "{operation}");
    assert_eq!(get(&summary, "async_operation_id"), operation, "{context}");
    assert_eq!(
        Some(get(&summary, "async_receipt_id")),
        deployment.as_deref(),
        "{context}"
    );
    // The agent printed its answers: pending (in progress, the operation id), then succeeded
    // (verified by a poll, the deployment id).
    let answers_for_deploy: Vec<serde_json::Value> = stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("an answer line is JSON"))
        .filter(|e: &serde_json::Value| e["action_id"] == deploy.as_str())
        .collect();
    let with_status = |status: &str| -> Vec<&serde_json::Value> {
        answers_for_deploy
            .iter()
            .filter(|e| e["status"] == status)
            .collect()
    };
    let (pending, succeeded) = (with_status("pending"), with_status("succeeded"));
    assert_eq!(
        (pending.len(), succeeded.len(), answers_for_deploy.len()),
        (1, 1, 2),
        "{answers_for_deploy:?}"
    );
    assert_eq!(pending[0]["uncertainty"], "in_progress");
    assert_eq!(pending[0]["remote_id"], operation.as_str());
    assert_eq!(succeeded[0]["verified_by"], "poll");
    assert_eq!(
        succeeded[0]["remote_id"],
        deployment.as_deref().unwrap_or("?")
    );
    assert_eq!(succeeded[0]["receipt"]["state"], "succeeded");
    // The ledger: the deploy went accepted -> succeeded, keeping the operation id; the lost
    // reply is held for a person; the reused key kept its first intent.
    assert_eq!(env.state(TENANT, &deploy).await, "succeeded");
    let moves: Vec<String> = sqlx::query_scalar(
        "SELECT h.to_state FROM operation_history h JOIN operations o ON o.id = h.operation_id
         WHERE o.tenant = $1 AND o.action_id = $2 ORDER BY h.id",
    )
    .bind(TENANT)
    .bind(&deploy)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let accepted_at = moves.iter().position(|m| m == "accepted");
    assert!(
        accepted_at.is_some_and(|i| moves[i + 1..].iter().any(|m| m == "succeeded")),
        "{moves:?}"
    );
    let remote: Option<String> =
        sqlx::query_scalar("SELECT remote_id FROM operations WHERE tenant = $1 AND action_id = $2")
            .bind(TENANT)
            .bind(&deploy)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(remote.as_deref(), Some(operation.as_str()));
    assert_eq!(env.state(TENANT, &held).await, "held");
    assert_eq!(
        env.state(TENANT, &format!("refund-{run_id}-1")).await,
        "succeeded"
    );
    let operations = count(
        &env,
        &format!("SELECT count(*) FROM operations WHERE tenant = '{TENANT}'"),
    )
    .await;
    assert_eq!(operations, 10);
    cleanup(env).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_lost_reply_and_without_an_outbox_every_action_succeeds() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = demo_tools(&env, ds.port);
    let _w1 = Worker::start(&env, "w1", &WorkerOptions::new(tools.clone())).await;
    // Published directly (no PUBLISHER_DATABASE_URL), nothing armed, no status API needed.
    let run_id = format!("t{}", env.id);
    let (code, summary, _stdout, stderr) = run_agent(&env, &run_id, &tools, &[]);
    let context = format!("summary {summary:?}\n--- stderr\n{stderr}");
    assert_eq!(code, Some(0), "{context}");
    // Only the deploy (accepted, in progress) and the refund above the approval limit (awaiting
    // approval) are answered pending, before they succeed.
    for (key, value) in [
        ("intents_sent", "13"),
        ("actions", "10"),
        ("succeeded", "10"),
        ("repeats_answered_from_ledger", "2"),
        ("conflicts_refused", "1"),
        ("async_accepted", "1"),
        ("async_status", "succeeded"),
        ("async_verified_by", "poll"),
        ("pending", "2"),
        ("held", "0"),
        ("approval_awaiting", "1"),
        ("approval_status", "succeeded"),
        ("compensation_status", "succeeded"),
        ("compensated_by", &format!("refund_reversal-{run_id}")),
        ("complete", "true"),
    ] {
        assert_eq!(get(&summary, key), value, "{key}: {context}");
    }
    let writes = count(
        &env,
        "SELECT count(*) FROM downstream.requests WHERE kind = 'write'",
    )
    .await;
    assert_eq!(writes, 10, "{context}");
    cleanup(env).await;
}

/// With span export on (as the compose demo exports to Jaeger), each intent's trace starts at the
/// agent's `agent turn` span, exported as service `demo-agent`, and goes on through the outbox
/// row (written as is, with that span's context) and the relay into the worker and the
/// downstream's request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_export_on_each_intents_trace_starts_at_the_agents_turn() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let receiver = e2e::OtlpReceiver::start();
    let tools = demo_tools(&env, ds.port);
    let _w1 = Worker::start(&env, "w1", &WorkerOptions::new(tools.clone())).await;
    let db = ("PUBLISHER_DATABASE_URL", env.db_url.clone());
    let migrate = publisher(&env, &["migrate"], std::slice::from_ref(&db))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("publisher migrate");
    assert!(migrate.success(), "publisher migrate failed");
    let _relay = Proc(
        publisher(
            &env,
            &["relay"],
            &[
                db.clone(),
                ("PUBLISHER_IDLE_POLL", "20ms".into()),
                ("PUBLISHER_METRICS_ADDR", "off".into()),
            ],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn publisher relay"),
    );

    // Nothing armed: every action succeeds.
    let run_id = format!("x{}", env.id);
    let (code, summary, _stdout, stderr) = run_agent(
        &env,
        &run_id,
        &tools,
        &[
            db,
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
        ],
    );
    let context = format!("summary {summary:?}\n--- stderr\n{stderr}");
    assert_eq!(code, Some(0), "{context}");
    assert_eq!(get(&summary, "complete"), "true", "{context}");
    assert!(
        stderr.contains("exporting spans over OTLP/HTTP") && stderr.contains("service=demo-agent"),
        "{context}"
    );

    // One turn per intent sent; refund 2, the deploy and the payout are sent once each (the
    // deploy's polls only read: its one write carries the turn's trace).
    let turns = receiver
        .wait_for_spans("the agent's turns", Duration::from_secs(20), 13, |s| {
            s.name == "agent turn" && s.service_name == "demo-agent"
        })
        .await;
    for action in [
        format!("refund-{run_id}-2"),
        format!("deploy-{run_id}"),
        format!("payout-{run_id}"),
    ] {
        let key = format!("{TENANT}:{action}");
        let turn: Vec<_> = turns
            .iter()
            .filter(|s| s.attr_str("intent_worker.action_key") == Some(key.as_str()))
            .collect();
        assert_eq!(turn.len(), 1, "{key}: {}", receiver.dump());
        let seen = env.traceparents_for(&key).await;
        assert_eq!(seen.len(), 1, "{key}: {seen:?}");
        let traceparent = seen[0]
            .as_deref()
            .expect("the downstream got a trace context");
        assert_eq!(
            traceparent.split('-').nth(1),
            Some(turn[0].trace_id.as_str()),
            "{key}: {traceparent} is not in the agent turn's trace"
        );
    }
    cleanup(env).await;
}

/// Settings that can never work end the agent at once with exit code 2, naming the setting,
/// before it connects to anything (as `publisher demo` did).
#[test]
fn the_demo_agent_refuses_settings_that_can_never_work() {
    let base = ["--tenant", TENANT, "--tool", "refund", "--count", "1"];
    /// Extra arguments, extra environment, what the error must name.
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case; 6] = [
        (&[], &[("AMQP_URL", "http://nowhere:5672")], "AMQP_URL="),
        (
            &[],
            &[("PUBLISHER_DATABASE_URL", "mysql://u:secret@h/db")],
            "PUBLISHER_DATABASE_URL=",
        ),
        (
            &["--status-url", "http://127.0.0.1:1"],
            &[],
            "--status-url needs --status-token",
        ),
        (&["--answer-timeout", "soon"], &[], "--answer-timeout"),
        // The full scenario approves with `worker ops approve`: it needs the worker's ledger
        // and tools file, and a ledger URL that can work.
        (&["--scenario", "full"], &[], "--ledger-url"),
        (
            &[
                "--scenario",
                "full",
                "--ledger-url",
                "mysql://u:secret@h/db",
                "--worker-tools",
                "tools.toml",
            ],
            &[],
            "--ledger-url",
        ),
    ];
    for (args, vars, needle) in cases {
        let out = Command::new(e2e::procs::demo_agent_bin())
            .args(base)
            .args(args)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(vars.iter().copied())
            .output()
            .expect("run demo-agent");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?} {vars:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?} {vars:?}: {stderr}");
        assert!(!stderr.contains("secret"), "a password in {stderr}");
    }
    let missing = Command::new(e2e::procs::demo_agent_bin())
        .env_clear()
        .output()
        .expect("run demo-agent");
    assert_eq!(missing.status.code(), Some(2));
    let help = Command::new(e2e::procs::demo_agent_bin())
        .arg("--help")
        .env_clear()
        .output()
        .expect("demo-agent --help");
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(help.status.success(), "{text}");
    for flag in [
        "--scenario",
        "--held-tool",
        "--async-tool",
        "--reversal-tool",
        "--ledger-url",
        "--worker-tools",
        "--worker-bin",
        "--set-user-id",
        "--ca-file",
        "PUBLISHER_STATUS_TOKEN",
        "INTENTS_EXCHANGE",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}: {text}");
    }
}

#[test]
fn the_demo_scripts_parse_and_answer_help() {
    let root = repo();
    for script in [
        "scripts/demo.sh",
        "scripts/lib/services.sh",
        "scripts/test.sh",
    ] {
        let out = Command::new("bash")
            .arg("-n")
            .arg(root.join(script))
            .output()
            .expect("bash");
        assert!(
            out.status.success(),
            "bash -n {script}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    if Command::new("shellcheck")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        // Every finding in the demo's scripts; warnings and errors only in scripts/test.sh,
        // which has one old `info` finding (SC2015).
        for args in [
            &["-x", "scripts/demo.sh", "scripts/lib/services.sh"][..],
            &["-x", "-S", "warning", "scripts/test.sh"][..],
        ] {
            let out = Command::new("shellcheck")
                .current_dir(&root)
                .args(args)
                .output()
                .expect("shellcheck");
            assert!(
                out.status.success(),
                "shellcheck {args:?}: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
    }
    let help = Command::new(root.join("scripts/demo.sh"))
        .arg("--help")
        .output()
        .expect("demo.sh --help");
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(help.status.success(), "{text}");
    for needle in [
        "--once",
        "--bin-dir",
        "DEMO_DATABASE_URL",
        "DEMO_ADMIN_PORT",
    ] {
        assert!(text.contains(needle), "--help lacks {needle}: {text}");
    }
    let bad = Command::new(root.join("scripts/demo.sh"))
        .arg("--no-such-flag")
        .output()
        .expect("demo.sh --no-such-flag");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown argument"));
}
