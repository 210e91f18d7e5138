//! Honest recovery: a refused replay is never a false failure, action ids with
//! template braces recover their receipt, and settings that silently weaken proof stop the
//! worker at start-up with the tool and key named.

use std::process::{Command, Stdio};
use std::time::Duration;

use e2e::procs::bin_dir;
use e2e::{cleanup, Agent, Downstream, Env, Worker, WorkerOptions};
use protocol::Status;
use serde_json::json;

const T: Duration = Duration::from_secs(30);
const TENANT: &str = "north-shop";

fn key(action: &str) -> String {
    format!("{TENANT}:{action}")
}

/// The refund committed, its reply was lost, and every replay is answered 403 (a rotated API
/// key, a WAF): the status says nothing about the original write, so the row stays unknown and
/// is held after its recovery rounds, never reported failed.
#[tokio::test]
async fn a_replay_refused_with_403_keeps_the_row_unknown_then_held_never_failed() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""));
    ds.fault(json!({"kind": "drop_after_commit", "key": key("refund-403")}))
        .await;
    ds.fault(json!({"kind": "status", "status": 403, "times": 100, "key": key("refund-403")}))
        .await;
    let _w = Worker::start(&env, "w", &opts).await;
    let agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "refund-403", "refund", json!({"order": "o-403"}))
        .await;
    assert_eq!(env.final_state(TENANT, "refund-403", T).await, "held");
    let statuses = env.outbox_statuses(TENANT, "refund-403").await;
    assert!(
        !statuses.iter().any(|s| s == "failed"),
        "no false failure: {statuses:?}"
    );
    let history = env.history(TENANT, "refund-403").await;
    let refused_rounds = history
        .iter()
        .filter(|(_, e)| e.as_deref().unwrap_or("").contains("HTTP 403"))
        .count();
    assert!(
        refused_rounds >= 1,
        "the 403 is kept as evidence: {history:?}"
    );
    assert!(
        history.iter().all(|(s, _)| s != "failed"),
        "never failed: {history:?}"
    );
    assert_eq!(
        env.mutations(&key("refund-403")).await,
        1,
        "the refund exists"
    );
    cleanup(env).await;
}

/// A tool that documents a replayed 422 as final may list it: then (and only then) the replayed
/// answer ends the operation `failed`.
#[tokio::test]
async fn a_replayed_status_listed_in_replay_final_statuses_is_final() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let base = format!("http://127.0.0.1:{}", ds.port);
    let tools = env.write_tools(&format!(
        "[tools.refund]\nurl = \"{base}/replay/refunds\"\nrecovery = \"replay\"\nreplay_window_secs = 3600\n\
         replay_safety_margin_secs = 60\nreplay_final_statuses = [422]\ntimeout_ms = 2000\nrecovery_attempts = 3\n\
         receipt_id = \"/receipt_id\"\nreceipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\n\
         retry = {{ initial_delay_ms = 100, max_delay_ms = 1000 }}\n"
    ));
    ds.fault(json!({"kind": "drop_before_commit", "key": key("refund-422")}))
        .await;
    ds.fault(json!({"kind": "status", "status": 422, "times": 100, "key": key("refund-422")}))
        .await;
    let _w = Worker::start(&env, "w", &WorkerOptions::new(tools)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "refund-422", "refund", json!({"order": "o-422"}))
        .await;
    let events = agent.until(TENANT, "refund-422", Status::Failed, T).await;
    assert_eq!(events.first().unwrap().status, Status::Pending);
    let row = env.operation(TENANT, "refund-422").await.unwrap();
    assert_eq!(row.state, "failed");
    assert!(
        row.evidence
            .as_deref()
            .unwrap_or("")
            .contains("replay_final_statuses"),
        "{row:?}"
    );
    assert_eq!(env.mutations(&key("refund-422")).await, 0);
    cleanup(env).await;
}

/// Action ids may contain template placeholders. Filling the receipt template must not
/// substitute inside the substituted value, or the original receipt never matches.
#[tokio::test]
async fn action_ids_with_braces_recover_their_receipt_on_a_lookup_tool() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""));
    let ids = ["brace{tool}-1", "brace{key}{tenant}-2", "{action_id}}{-3"];
    for id in ids {
        ds.fault(json!({"kind": "drop_after_commit", "key": key(id)}))
            .await;
    }
    let _w = Worker::start(&env, "w", &opts).await;
    let agent = Agent::new(&env, &[TENANT]).await;
    for id in ids {
        agent
            .request(TENANT, id, "ticket", json!({"title": id}))
            .await;
    }
    for id in ids {
        assert_eq!(env.final_state(TENANT, id, T).await, "succeeded", "{id}");
        assert_eq!(
            env.outbox_statuses(TENANT, id).await,
            ["pending", "succeeded"],
            "{id}"
        );
        let row = env.operation(TENANT, id).await.unwrap();
        assert_eq!(row.receipt, env.downstream_receipt(&key(id)).await, "{id}");
        assert_eq!(env.writes(&key(id)).await, 1, "{id}: never resent");
        assert_eq!(env.mutations(&key(id)).await, 1, "{id}");
    }
    cleanup(env).await;
}

/// Runs `worker run` with `tools` and extra environment; returns (exit code, output) or None
/// when it is still running after `wait` (then it is killed).
fn run_worker(env: &Env, tools: &std::path::Path, extra: &[(&str, &str)]) -> Option<(i32, String)> {
    let mut cmd = Command::new(bin_dir().join("worker"));
    cmd.arg("run")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("DATABASE_URL", &env.db_url)
        .env("AMQP_URL", &env.amqp_url)
        .env("WORKER_TOOLS", tools)
        .env("METRICS_ADDR", "off")
        .env("WORKER_ADMIN_ADDR", "off")
        .env("WORKER_LEASE_SECS", "3")
        .env("INTENTS_EXCHANGE", &env.topology.intents_exchange)
        .env("WORKER_INTENTS_QUEUE", &env.topology.intents_queue)
        .env("RESULTS_EXCHANGE", &env.topology.results_exchange)
        .env(
            "WORKER_DEAD_LETTER_EXCHANGE",
            &env.topology.dead_letter_exchange,
        )
        .env("WORKER_DEAD_LETTER_QUEUE", &env.topology.dead_letter_queue)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn worker");
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let out = child.wait_with_output().expect("output");
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            return Some((status.code().unwrap_or(-1), text));
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Settings that silently weaken the proof of an outcome stop the worker at start-up, with an
/// error naming the tool and the key.
#[tokio::test]
async fn settings_that_weaken_proof_are_refused_at_start_up() {
    let env = Env::new().await;
    let base = "http://127.0.0.1:9";
    let matching = "receipt_match = { \"/idempotency_key\" = \"{tenant}:{action_id}\" }";
    // (tools file, extra environment, what the error must name)
    type Case<'a> = (String, Vec<(&'a str, &'a str)>, Vec<&'a str>);
    let cases: Vec<Case> = vec![
        (
            format!("[tools.refund]\nurl = \"{base}/r\"\nreceipt_id = \"/receipt_id\"\nrecovery = \"none\"\ntimeout_ms = 1000\n"),
            vec![],
            vec!["tools.refund", "receipt_match"],
        ),
        (
            format!(
                "[tools.ticket]\nurl = \"{base}/t\"\nreceipt_id = \"/receipt_id\"\n{matching}\nrecovery = \"lookup\"\n\
                 lookup_url = \"{base}/t/by-action/{{action_id}}\"\ntimeout_ms = 1000\n"
            ),
            vec![],
            vec!["tools.ticket", "lookup_url"],
        ),
        (
            format!("[tools.deploy]\nurl = \"{base}/d\"\nreceipt_id = \"/receipt_id\"\n{matching}\nrecovery = \"none\"\ntimeout_ms = 3000\n"),
            vec![],
            vec!["tools.deploy", "timeout_ms", "WORKER_LEASE_SECS"],
        ),
        (
            format!(
                "[tools.refund]\nurl = \"{base}/r\"\nreceipt_id = \"/receipt_id\"\n{matching}\nrecovery = \"replay\"\n\
                 replay_window_secs = 600\nreplay_safety_margin_secs = 0\ntimeout_ms = 1000\n"
            ),
            vec![],
            vec!["tools.refund", "replay_safety_margin_secs"],
        ),
        (
            format!(
                "[tools.refund]\nurl = \"{base}/r\"\nreceipt_id = \"/receipt_id\"\n{matching}\nrecovery = \"replay\"\n\
                 replay_window_secs = 86400\ntimeout_ms = 1000\n"
            ),
            vec![("WORKER_TOMBSTONE_RETENTION_SECS", "3600")],
            vec!["tools.refund", "WORKER_TOMBSTONE_RETENTION_SECS", "replay_window_secs"],
        ),
    ];
    for (toml, extra, needles) in cases {
        let tools = env.write_tools(&toml);
        let Some((code, output)) = run_worker(&env, &tools, &extra) else {
            panic!("the worker started with weakened proof ({needles:?}):\n{toml}");
        };
        assert_ne!(code, 0, "{output}");
        for needle in needles {
            assert!(
                output.contains(needle),
                "{needle:?} not named in:\n{output}"
            );
        }
    }
    cleanup(env).await;
}
