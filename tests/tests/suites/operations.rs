//! Operations end to end: metrics after a scripted scenario (duplicates, a held operation, a
//! success), the oldest-unresolved gauge growing while held and dropping once resolved, the
//! admin API and tenant status query on a real worker process, and the `worker ops` CLI.

use std::process::Command;
use std::time::Duration;

use e2e::{
    cleanup, intent, metric_value, procs::bin_dir, Agent, Downstream, Env, Worker, WorkerOptions,
};
use protocol::Status;
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(30);
const TENANT: &str = "north-shop";
const ADMIN: &str = "admin-token-0123456789abcdef";
const NORTH: &str = "north-token-123456";
const SOUTH: &str = "south-token-654321";

fn gauge(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric_value(text, name, labels)
}

#[tokio::test]
async fn metrics_admin_api_and_held_operation_resolution() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .with_metrics()
        .with_admin(ADMIN)
        .env(
            "WORKER_TENANT_TOKENS",
            &format!("north-shop={NORTH},south-shop={SOUTH}"),
        );
    let w = Worker::start(&env, "w", &opts).await;
    let api = format!("http://127.0.0.1:{}/v1/operations", w.admin_port.unwrap());
    let http = e2e::http();
    let mut agent = Agent::new(&env, &[TENANT]).await;

    // A success and a duplicate of it.
    let refund = intent(TENANT, "refund-1", "refund", json!({"order": "o-1"}));
    agent.send(&refund).await;
    agent.until(TENANT, "refund-1", Status::Succeeded, T).await;
    agent.send(&refund).await;
    agent.until(TENANT, "refund-1", Status::Succeeded, T).await;
    // A held one: the response is lost and the tool has no recovery.
    ds.fault(json!({"kind": "drop_after_commit", "key": "north-shop:deploy-1"}))
        .await;
    agent
        .request(TENANT, "deploy-1", "deploy", json!({"service": "api"}))
        .await;
    agent.until(TENANT, "deploy-1", Status::Pending, T).await;
    e2e::wait_for("held", T, || async {
        (env.state(TENANT, "deploy-1").await == "held").then_some(())
    })
    .await;

    let m1 = w.metrics().await;
    assert_eq!(
        gauge(&m1, "intent_worker_intents_received_total", &[]),
        3.0,
        "{m1}"
    );
    assert_eq!(
        gauge(&m1, "intent_worker_duplicates_suppressed_total", &[]),
        1.0
    );
    assert_eq!(
        gauge(
            &m1,
            "intent_worker_duplicates_suppressed_total",
            &[("reason", "completed")]
        ),
        1.0
    );
    assert_eq!(
        gauge(&m1, "intent_worker_operations", &[("state", "held")]),
        1.0
    );
    assert_eq!(
        gauge(&m1, "intent_worker_operations", &[("state", "succeeded")]),
        1.0
    );
    assert_eq!(
        gauge(&m1, "intent_worker_held_operations", &[("tool", "deploy")]),
        1.0
    );
    assert!(
        gauge(
            &m1,
            "intent_worker_results_published_total",
            &[("status", "succeeded")]
        ) >= 2.0
    );
    // One write each: the refund's answered, the deploy's lost after the commit (the duplicate
    // was answered from the row, and a `none` tool is not sent again).
    for (tool, outcome) in [("refund", "succeeded"), ("deploy", "unknown")] {
        let labels = [("tool", tool), ("kind", "write"), ("outcome", outcome)];
        for name in [
            "intent_worker_downstream_request_duration_seconds_count",
            "intent_worker_downstream_requests_total",
        ] {
            assert_eq!(gauge(&m1, name, &labels), 1.0, "{name} {labels:?}\n{m1}");
            assert_eq!(gauge(&m1, name, &[("tool", tool)]), 1.0, "{name} {tool}");
        }
        let attempts = [("tool", tool), ("outcome", outcome)];
        assert_eq!(
            gauge(&m1, "intent_worker_dispatch_attempts_total", &attempts),
            1.0,
            "{attempts:?}"
        );
    }
    let age1 = gauge(
        &m1,
        "intent_worker_oldest_unresolved_age_seconds",
        &[("tool", "deploy"), ("state", "held")],
    );
    assert!(age1 > 0.0, "{m1}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let m2 = w.metrics().await;
    let age2 = gauge(
        &m2,
        "intent_worker_oldest_unresolved_age_seconds",
        &[("tool", "deploy"), ("state", "held")],
    );
    assert!(age2 >= age1 + 1.0, "the held age grows: {age1} -> {age2}");

    // Auth: no token, a wrong tenant, the right tenant.
    let r = http.get(&api).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = http
        .get(format!("{api}/north-shop/deploy-1"))
        .bearer_auth(SOUTH)
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        404,
        "another tenant's credential cannot read it"
    );
    let r = http
        .get(format!("{api}/north-shop/deploy-1"))
        .bearer_auth(NORTH)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let status: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(status["status"], "pending");
    assert_eq!(status["receipt"], Value::Null);
    assert!(
        status.get("operation").is_none(),
        "tenants see the result shape only"
    );
    let r = http
        .get(format!("{api}?state=held"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    let list: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(list["operations"].as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list["operations"][0]["action_id"], "deploy-1");

    // Resolve: a receipt for another operation is refused; the downstream's one is accepted.
    let resolve = format!("{api}/north-shop/deploy-1/resolve");
    let wrong = json!({"receipt_id": "rcpt-x", "idempotency_key": "north-shop:other"});
    let r = http
        .post(&resolve)
        .bearer_auth(ADMIN)
        .header("content-type", "application/json")
        .body(json!({"receipt": wrong, "operator": "alice", "reason": "checked", "request_id": "req-1"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422, "{}", r.text().await.unwrap());
    assert_eq!(env.state(TENANT, "deploy-1").await, "held");
    let receipt = env.downstream_receipt("north-shop:deploy-1").await.unwrap();
    let r = http
        .post(&resolve)
        .bearer_auth(ADMIN)
        .header("content-type", "application/json")
        .body(json!({"receipt": receipt, "operator": "alice", "reason": "found it in the deploy log", "request_id": "req-2"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let done = agent.succeeded(TENANT, "deploy-1").await;
    assert_eq!(
        done.receipt.as_ref(),
        Some(&receipt),
        "the agent gets the result event"
    );
    let actors: Vec<String> = sqlx::query_scalar(
        "SELECT h.actor FROM operation_history h JOIN operations o ON o.id = h.operation_id
         WHERE o.action_id = 'deploy-1' AND h.to_state = 'succeeded'",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(actors, vec!["operator:alice".to_string()]);
    let m3 = w.metrics().await;
    assert_eq!(
        gauge(
            &m3,
            "intent_worker_oldest_unresolved_age_seconds",
            &[("tool", "deploy"), ("state", "held")]
        ),
        0.0
    );
    assert_eq!(
        gauge(&m3, "intent_worker_held_operations", &[("tool", "deploy")]),
        0.0
    );
    assert_eq!(
        env.writes("north-shop:deploy-1").await,
        1,
        "resolution sent nothing downstream"
    );
    cleanup(env).await;
}

#[tokio::test]
async fn worker_ops_cli_lists_and_resolves_held_operations() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""));
    let _w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    ds.fault(json!({"kind": "drop_after_commit", "key": "north-shop:deploy-2"}))
        .await;
    agent
        .request(TENANT, "deploy-2", "deploy", json!({"service": "web"}))
        .await;
    e2e::wait_for("held", T, || async {
        (env.state(TENANT, "deploy-2").await == "held").then_some(())
    })
    .await;
    let ops = |args: &[&str]| {
        Command::new(bin_dir().join("worker"))
            .arg("ops")
            .args(args)
            .env("DATABASE_URL", &env.db_url)
            .env("WORKER_TOOLS", &opts.tools)
            .env("RUST_LOG", "warn")
            .output()
            .expect("run worker ops")
    };
    let out = ops(&["list", "--state", "held", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed["operations"][0]["action_id"], "deploy-2", "{listed}");
    let out = ops(&[
        "fail",
        TENANT,
        "deploy-2",
        "--evidence",
        "",
        "--operator",
        "bob",
    ]);
    assert!(!out.status.success(), "failing without evidence is refused");
    let receipt = env
        .downstream_receipt("north-shop:deploy-2")
        .await
        .unwrap()
        .to_string();
    let resolve = [
        "resolve",
        TENANT,
        "deploy-2",
        "--receipt",
        &receipt,
        "--operator",
        "bob",
        "--reason",
        "seen in the deploy log",
        "--request-id",
        "cli-1",
    ];
    let out = ops(&resolve);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(env.state(TENANT, "deploy-2").await, "succeeded");
    // The same request again is idempotent.
    let again = ops(&resolve);
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    let ev = agent.succeeded(TENANT, "deploy-2").await;
    assert_eq!(ev.receipt.unwrap().to_string(), receipt);
    cleanup(env).await;
}

#[tokio::test]
async fn after_the_retention_sweep_an_old_intent_is_still_suppressed() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts =
        WorkerOptions::new(env.standard_tools(ds.port, "")).env("WORKER_RETENTION_SECS", "1");
    let _w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    let old = intent(
        TENANT,
        "refund-old",
        "refund",
        json!({"order": "o-old", "card": "4111-private"}),
    );
    agent.send(&old).await;
    agent
        .until(TENANT, "refund-old", Status::Succeeded, T)
        .await;
    e2e::wait_for("the sweep", T, || async {
        let swept: Option<(Option<String>, Option<Value>)> =
            sqlx::query_as("SELECT arguments, receipt FROM operations WHERE action_id = 'refund-old' AND swept_at IS NOT NULL")
                .fetch_optional(&env.pool)
                .await
                .unwrap();
        swept
    })
    .await;
    let (args, receipt): (Option<String>, Option<Value>) =
        sqlx::query_as("SELECT arguments, receipt FROM operations WHERE action_id = 'refund-old'")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!((args, receipt), (None, None), "private data removed");
    let row = env.operation(TENANT, "refund-old").await.unwrap();
    assert_eq!(
        row.state, "succeeded",
        "the tombstone keeps key, fingerprint and final state"
    );
    // The old intent arrives again: suppressed, never dispatched, never a receipt-less success.
    agent.send(&old).await;
    let ev = agent.next(TENANT, T).await;
    assert_eq!(ev.status, Status::Rejected, "{ev:?}");
    assert_eq!(ev.reason, Some(protocol::RejectReason::Expired));
    assert_eq!(env.writes("north-shop:refund-old").await, 1);
    cleanup(env).await;
}
