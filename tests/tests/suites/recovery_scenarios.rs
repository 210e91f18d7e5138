//! The named recovery scenarios: repeated recovery, racing workers, a paused sender
//! and a late timeout, an expired replay window, a lookup miss, a receipt for the wrong
//! operation, a ledger that refuses the receipt, a downstream restart, and the negative
//! control proving the fault injection duplicates a conventional client's write.

use std::time::Duration;

use e2e::{cleanup, Agent, Downstream, Env, Worker, WorkerOptions};
use protocol::Status;
use serde_json::json;
use worker::ledger::{Ledger, NewOperation};

const T: Duration = Duration::from_secs(30);
const TENANT: &str = "north-shop";

fn key(action: &str) -> String {
    format!("{TENANT}:{action}")
}

async fn settled(env: &Env, action: &str) -> String {
    e2e::wait_for(&format!("{action} to settle"), T, || async {
        let s = env.state(TENANT, action).await;
        matches!(s.as_str(), "succeeded" | "held" | "failed").then_some(s)
    })
    .await
}

#[tokio::test]
async fn recovery_run_twice_returns_identical_results_and_sends_nothing_more() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""));
    ds.fault(json!({"kind": "drop_after_commit", "key": key("refund-1")}))
        .await;
    let mut w1 = Worker::start(&env, "w1", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "refund-1", "refund", json!({"order": "o-1"}))
        .await;
    let first = agent.succeeded(TENANT, "refund-1").await;
    let row = env.operation(TENANT, "refund-1").await.unwrap();
    let writes = env.writes(&key("refund-1")).await;
    // A second and third recovery pass (new workers, fresh memory) change nothing.
    w1.kill();
    let _w2 = Worker::start(&env, "w2", &opts).await;
    let _w3 = Worker::start(&env, "w3", &opts).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let again = env.operation(TENANT, "refund-1").await.unwrap();
    assert_eq!(
        (again.state.as_str(), &again.receipt, again.fence),
        ("succeeded", &row.receipt, row.fence)
    );
    assert_eq!(env.writes(&key("refund-1")).await, writes);
    assert_eq!(env.mutations(&key("refund-1")).await, 1);
    // Asking again answers from the ledger with the same receipt.
    agent
        .request(TENANT, "refund-1", "refund", json!({"order": "o-1"}))
        .await;
    let second = agent.succeeded(TENANT, "refund-1").await;
    assert_eq!(second.receipt, first.receipt);
    assert_eq!(env.writes(&key("refund-1")).await, writes);
    cleanup(env).await;
}

#[tokio::test]
async fn workers_racing_on_prepared_operations_dispatch_each_once() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""));
    // Rows left `prepared` (as by a crash before the claim), due at once.
    let ledger = migrated_ledger(&env).await;
    let mut new = Vec::new();
    for tool in ["refund", "ticket", "deploy"] {
        for i in 0..10 {
            let args = json!({"order": format!("o-{i}")});
            new.push(NewOperation {
                tenant: TENANT.into(),
                action_id: format!("{tool}-{i}"),
                tool: tool.into(),
                fingerprint: protocol::fingerprint(tool, &args),
                arguments: protocol::canonical_json(&args),
                call_id: None,
                reply_to: None,
                trace: None,
                compensates: None,
            });
        }
    }
    let admitted = ledger.admit(&new, "test", Duration::ZERO).await.unwrap();
    assert!(admitted.iter().all(|a| a.inserted));
    // Three workers start together and race for them.
    let ws: Vec<Worker> = (0..3)
        .map(|i| Worker::spawn(&env, &format!("w{i}"), &opts))
        .collect();
    for w in &ws {
        w.wait_ready().await;
    }
    for n in &new {
        assert_eq!(
            settled(&env, &n.action_id).await,
            "succeeded",
            "{}",
            n.action_id
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    for n in &new {
        assert_eq!(
            env.mutations(&key(&n.action_id)).await,
            1,
            "{}",
            n.action_id
        );
        assert_eq!(
            env.writes(&key(&n.action_id)).await,
            1,
            "{}: one send",
            n.action_id
        );
    }
    drop(ws);
    cleanup(env).await;
}

#[tokio::test]
async fn paused_sender_resumes_after_recovery_and_cannot_change_the_receipt() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""));
    // A stops right after its claim committed (before sending) and stays paused past its lease.
    let a = Worker::start(
        &env,
        "a",
        &opts.clone().fault("after_dispatching", Some("refund-p")),
    )
    .await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "refund-p", "refund", json!({"order": "o-p"}))
        .await;
    a.wait_output("fault point reached: after_dispatching", T)
        .await;
    // B expires A's lease, recovers by replay with the original key.
    let b = Worker::start(&env, "b", &opts).await;
    let recovered = agent.succeeded(TENANT, "refund-p").await;
    let row = env.operation(TENANT, "refund-p").await.unwrap();
    // A resumes: its send fence finds the lease gone, so its stale request never leaves.
    let writes_by_b = env.writes(&key("refund-p")).await;
    assert!(writes_by_b >= 1, "B replayed");
    a.resume();
    a.wait_output("fault point resumed", T).await;
    a.wait_output("send abandoned, nothing was sent", T).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        env.writes(&key("refund-p")).await,
        writes_by_b,
        "only B's replays reached the downstream"
    );
    let after = env.operation(TENANT, "refund-p").await.unwrap();
    assert_eq!(env.mutations(&key("refund-p")).await, 1);
    assert_eq!(after.state, "succeeded");
    assert_eq!(
        after.receipt, row.receipt,
        "the final receipt is the original"
    );
    assert_eq!(after.receipt, recovered.receipt);
    assert_eq!(
        after.receipt,
        env.downstream_receipt(&key("refund-p")).await
    );
    drop((a, b));
    cleanup(env).await;
}

#[tokio::test]
async fn a_late_timeout_never_overwrites_succeeded() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    // The downstream commits and answers only after 4 s; the tool times out at 2 s, below the
    // 3 s lease (start-up refuses otherwise). A is paused while its request waits, past its
    // lease; B recovers by replay; A's timeout then arrives with a stale fence.
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""));
    ds.fault(json!({"kind": "slow_after_commit", "key": key("refund-s"), "delay_ms": 4000}))
        .await;
    let a = Worker::start(&env, "a", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "refund-s", "refund", json!({"order": "o-s"}))
        .await;
    e2e::wait_for("A's request to reach the downstream", T, || async {
        (env.writes(&key("refund-s")).await >= 1).then_some(())
    })
    .await;
    a.pause();
    let b = Worker::start(&env, "b", &opts).await;
    agent.until(TENANT, "refund-s", Status::Succeeded, T).await;
    let row = env.operation(TENANT, "refund-s").await.unwrap();
    a.resume();
    // Its answer arrived while A was stopped, after its deadline: read late, it is a timeout
    // (never a late receipt, which would depend on what A's runtime happened to poll first).
    let seen = e2e::wait_for("A's outcome", T, || async {
        ["outcome discarded: the operation moved on", "late receipt"]
            .into_iter()
            .find(|line| a.output.contains(line))
    })
    .await;
    assert_eq!(
        seen, "outcome discarded: the operation moved on",
        "A took its late answer"
    );
    let after = env.operation(TENANT, "refund-s").await.unwrap();
    assert_eq!(after.state, "succeeded");
    assert_eq!(after.receipt, row.receipt);
    assert_eq!(env.mutations(&key("refund-s")).await, 1);
    drop((a, b));
    cleanup(env).await;
}

#[tokio::test]
async fn expired_replay_window_holds_without_a_new_send() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let base = format!("http://127.0.0.1:{}", ds.port);
    let tools = env.write_tools(&format!(
        "[tools.refund]\nurl = \"{base}/replay/refunds\"\nrecovery = \"replay\"\nreplay_window_secs = 2\nreplay_safety_margin_secs = 1\n\
         receipt_id = \"/receipt_id\"\nreceipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\ntimeout_ms = 2000\n\
         retry = {{ initial_delay_ms = 2500, max_delay_ms = 5000 }}\n"
    ));
    ds.fault(json!({"kind": "drop_after_commit", "key": key("refund-w")}))
        .await;
    let _w = Worker::start(&env, "w", &WorkerOptions::new(tools)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "refund-w", "refund", json!({"order": "o-w"}))
        .await;
    let pending = agent.next(TENANT, T).await;
    assert_eq!(pending.status, Status::Pending);
    assert_eq!(settled(&env, "refund-w").await, "held");
    let row = env.operation(TENANT, "refund-w").await.unwrap();
    assert!(row
        .evidence
        .unwrap_or_default()
        .contains("replay window closed"));
    assert_eq!(
        env.writes(&key("refund-w")).await,
        1,
        "no replay after the window"
    );
    assert_eq!(env.mutations(&key("refund-w")).await, 1);
    cleanup(env).await;
}

#[tokio::test]
async fn lookup_miss_after_a_committed_write_stays_unknown_then_recovers_the_original() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""));
    ds.fault(json!({"kind": "drop_after_commit", "key": key("ticket-m")}))
        .await;
    ds.fault(json!({"kind": "lookup_miss", "on": "lookup", "key": key("ticket-m"), "times": 2}))
        .await;
    let _w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(
            TENANT,
            "ticket-m",
            "ticket",
            json!({"title": "printer on fire"}),
        )
        .await;
    let events = agent.until(TENANT, "ticket-m", Status::Succeeded, T).await;
    assert_eq!(events.first().unwrap().status, Status::Pending);
    let history = env.history(TENANT, "ticket-m").await;
    let misses = history
        .iter()
        .filter(|(s, e)| s == "unknown" && e.as_deref().unwrap_or("").contains("lookup miss"))
        .count();
    assert!(misses >= 1, "a miss left it unknown: {history:?}");
    assert_eq!(
        env.writes(&key("ticket-m")).await,
        1,
        "a lookup never resends the write"
    );
    assert_eq!(env.lookups(&key("ticket-m")).await, 3);
    assert_eq!(env.mutations(&key("ticket-m")).await, 1);
    assert_eq!(
        events.last().unwrap().receipt,
        env.downstream_receipt(&key("ticket-m")).await
    );
    cleanup(env).await;
}

#[tokio::test]
async fn receipt_for_the_wrong_operation_is_rejected_and_recovery_returns_the_original() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""));
    ds.fault(json!({"kind": "wrong_receipt", "key": key("refund-x")}))
        .await;
    let _w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "refund-x", "refund", json!({"order": "o-x"}))
        .await;
    let events = agent.until(TENANT, "refund-x", Status::Succeeded, T).await;
    assert_eq!(
        events.first().unwrap().status,
        Status::Pending,
        "the wrong receipt was not taken"
    );
    let evidence: Vec<Option<String>> = env
        .history(TENANT, "refund-x")
        .await
        .into_iter()
        .map(|(_, e)| e)
        .collect();
    assert!(
        evidence
            .iter()
            .flatten()
            .any(|e| e.contains("another operation")),
        "{evidence:?}"
    );
    let original = env.downstream_receipt(&key("refund-x")).await.unwrap();
    let row = env.operation(TENANT, "refund-x").await.unwrap();
    assert_eq!(row.receipt.as_ref(), Some(&original));
    assert_eq!(events.last().unwrap().receipt.as_ref(), Some(&original));
    assert_ne!(
        original["idempotency_key"],
        json!("someone-else:other-action")
    );
    assert_eq!(env.mutations(&key("refund-x")).await, 1);
    cleanup(env).await;
}

#[tokio::test]
async fn ledger_refusing_the_receipt_leaves_pending_until_repaired() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = env.standard_tools(ds.port, "");
    let text = std::fs::read_to_string(&tools)
        .unwrap()
        .replace("recovery_attempts = 3", "recovery_attempts = 50");
    std::fs::write(&tools, text).unwrap();
    let opts = WorkerOptions::new(tools);
    let _w = Worker::start(&env, "w", &opts).await;
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_success() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'ledger refuses succeeded (test)'; END $$;
         CREATE TRIGGER refuse_success BEFORE UPDATE ON operations FOR EACH ROW
         WHEN (NEW.state = 'succeeded') EXECUTE FUNCTION refuse_success();",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "refund-l", "refund", json!({"order": "o-l"}))
        .await;
    let pending = agent.next(TENANT, T).await;
    assert_eq!(pending.status, Status::Pending);
    assert_eq!(env.state(TENANT, "refund-l").await, "unknown");
    assert_eq!(env.mutations(&key("refund-l")).await, 1);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_ne!(env.state(TENANT, "refund-l").await, "succeeded");
    // Repair: recovery now stores the original receipt.
    sqlx::raw_sql("DROP TRIGGER refuse_success ON operations")
        .execute(&env.pool)
        .await
        .unwrap();
    let done = agent.succeeded(TENANT, "refund-l").await;
    assert_eq!(done.receipt, env.downstream_receipt(&key("refund-l")).await);
    assert_eq!(env.mutations(&key("refund-l")).await, 1);
    cleanup(env).await;
}

#[tokio::test]
async fn downstream_restart_between_dropped_response_and_recovery_replays_the_original() {
    let env = Env::new().await;
    let mut ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, "").clone()).env("RUST_LOG", "info");
    // Slow first recovery round so the restart happens in between.
    let tools = env.standard_tools(ds.port, "");
    let text = std::fs::read_to_string(&tools).unwrap().replace(
        "initial_delay_ms = 100, max_delay_ms = 1000",
        "initial_delay_ms = 2000, max_delay_ms = 4000",
    );
    std::fs::write(&tools, text).unwrap();
    ds.fault(json!({"kind": "drop_after_commit", "key": key("refund-r")}))
        .await;
    let _w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "refund-r", "refund", json!({"order": "o-r"}))
        .await;
    assert_eq!(agent.next(TENANT, T).await.status, Status::Pending);
    ds.restart().await;
    let done = agent.succeeded(TENANT, "refund-r").await;
    assert_eq!(done.receipt, env.downstream_receipt(&key("refund-r")).await);
    assert_eq!(env.mutations(&key("refund-r")).await, 1);
    assert_eq!(env.writes(&key("refund-r")).await, 2);
    cleanup(env).await;
}

#[tokio::test]
async fn negative_control_a_fresh_key_retry_duplicates_the_write() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    ds.fault(json!({"kind": "drop_after_commit", "key": "conventional-1"}))
        .await;
    let client = e2e::http();
    let url = format!("http://127.0.0.1:{}/replay/refunds", ds.port);
    let body = r#"{"order":"order-731","amount_cents":4850}"#;
    let first = client
        .post(&url)
        .header("Idempotency-Key", "conventional-1")
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await;
    assert!(first.is_err(), "the response was dropped");
    // What a conventional client does next: retry with a fresh key.
    let second = client
        .post(&url)
        .header("Idempotency-Key", "conventional-2")
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert!(second.status().is_success());
    let mutations: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM downstream.mutations WHERE arguments->>'order' = 'order-731'",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        mutations, 2,
        "the fault injection is real: a fresh key duplicates the refund"
    );
    cleanup(env).await;
}

/// Rolling upgrade: a worker of the version before `unsent_fence` claimed a row (fence moved,
/// `unsent_fence` left NULL), may have sent it, and died. A current worker must expire that lease
/// to `unknown` like any possibly-sent claim, never to `prepared` (that would send it again): a
/// `none` tool ends `held` with nothing written by the current worker.
#[tokio::test]
async fn a_claim_by_an_earlier_version_without_the_unsent_marker_counts_as_possibly_sent() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""));
    // The schema the old worker's row is written into.
    migrated_ledger(&env).await;
    let args = json!({"service": "api"});
    // What the earlier version's consumer left: inserted `prepared`, claimed (fence 1, one
    // attempt), its lease long gone; it never knew the column.
    sqlx::query(
        "INSERT INTO operations (tenant, action_id, tool, fingerprint, arguments, state, fence,
                                 lease_owner, lease_until, attempts, first_dispatch_at, changed_by)
         VALUES ($1, 'deploy-old', 'deploy', $2, $3, 'dispatching', 1, 'old-worker',
                 now() - interval '1 minute', 1, now() - interval '2 minutes', 'old-worker')",
    )
    .bind(TENANT)
    .bind(protocol::fingerprint("deploy", &args))
    .bind(protocol::canonical_json(&args))
    .execute(&env.pool)
    .await
    .unwrap();
    let _w = Worker::start(&env, "new", &opts).await;
    assert_eq!(settled(&env, "deploy-old").await, "held");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        env.writes(&key("deploy-old")).await,
        0,
        "nothing sent again"
    );
    let history: Vec<String> = sqlx::query_scalar(
        "SELECT coalesce(h.from_state, '-') || '>' || h.to_state FROM operation_history h
         JOIN operations o ON o.id = h.operation_id WHERE o.action_id = 'deploy-old' ORDER BY h.id",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert!(
        !history.iter().any(|h| h.ends_with(">prepared")),
        "never back to prepared: {history:?}"
    );
    cleanup(env).await;
}

/// The test's own connection to the ledger, migrated (no worker has run yet), for writing rows
/// as a crash or an earlier version would have left them.
async fn migrated_ledger(env: &Env) -> Ledger {
    let ledger = Ledger::connect(&env.db_url, 2, std::time::Duration::from_secs(10))
        .await
        .unwrap();
    ledger.migrate().await.unwrap();
    ledger
}
