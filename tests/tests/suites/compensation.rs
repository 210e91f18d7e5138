//! Compensation through the built binaries against the reference downstream: undoing an action
//! is an action of its own (its key, attempts, recovery, receipt), linked both ways to the
//! original, which keeps its `succeeded` state and receipt; it is admitted only while the
//! original is `succeeded`, and only one live compensation per original. Counts come from the
//! downstream's tables.

use std::collections::BTreeMap;
use std::time::Duration;

use e2e::{intent, Agent, Downstream, Env, Worker, WorkerOptions};
use protocol::{Intent, RejectReason, ResultEvent, Status};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(30);
const TENANT: &str = "north-shop";
const ADMIN: &str = "admin-token-0123456789abcdef";

/// The standard tools (refund: replay, ticket: lookup, deploy: none) and two that compensate:
/// `reversal` (refunds, tickets and deploys, replayed) and `refund_reversal` (refunds only).
fn tools(env: &Env, port: u16) -> std::path::PathBuf {
    let path = env.standard_tools(port, "");
    let base = format!("http://127.0.0.1:{port}");
    let common = "receipt_id = \"/receipt_id\"\nreceipt_match = { \"/idempotency_key\" = \"{tenant}:{action_id}\" }\ntimeout_ms = 2000\nrecovery_attempts = 3\nretry = { initial_delay_ms = 100, max_delay_ms = 1000 }\nrecovery = \"replay\"\nreplay_window_secs = 3600\nreplay_safety_margin_secs = 60\n";
    let text = std::fs::read_to_string(&path).unwrap()
        + &format!(
            "\n[tools.reversal]\nurl = \"{base}/replay/reversals\"\ncompensation_for = [\"refund\", \"ticket\", \"deploy\"]\n{common}\n\
             [tools.refund_reversal]\nurl = \"{base}/replay/refund-reversals\"\ncompensation_for = [\"refund\"]\n{common}\n"
        );
    env.write_tools(&text)
}

fn compensation(action_id: &str, tool: &str, original: &str) -> Intent {
    Intent {
        compensates: Some(original.to_string()),
        ..intent(TENANT, action_id, tool, json!({"reverses": original}))
    }
}

/// Reads results until every action in `want` got the status given, keeping them all.
async fn collect(agent: &mut Agent, want: &[(&str, Status)]) -> Vec<ResultEvent> {
    let mut seen = Vec::new();
    let mut left: BTreeMap<String, Status> =
        want.iter().map(|(a, s)| (a.to_string(), *s)).collect();
    while !left.is_empty() {
        let ev = agent.next(TENANT, T).await;
        if left.get(&ev.action_id) == Some(&ev.status) {
            left.remove(&ev.action_id);
        }
        seen.push(ev);
    }
    seen
}

async fn rejected(agent: &mut Agent, action_id: &str) -> ResultEvent {
    agent
        .until(TENANT, action_id, Status::Rejected, T)
        .await
        .pop()
        .unwrap()
}

async fn status(w: &Worker, action_id: &str) -> Value {
    let url = format!(
        "http://127.0.0.1:{}/v1/operations/{TENANT}/{action_id}",
        w.admin_port.unwrap()
    );
    e2e::http()
        .get(url)
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_succeeded_refund_is_undone_by_its_own_operation_linked_both_ways() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let w = Worker::start(
        &env,
        "w",
        &WorkerOptions::new(tools(&env, ds.port)).with_admin(ADMIN),
    )
    .await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "refund-1", "refund", json!({"amount_cents": 700}))
        .await;
    let original = agent.succeeded(TENANT, "refund-1").await;

    agent
        .send(&compensation("undo-1", "reversal", "refund-1"))
        .await;
    let seen = collect(
        &mut agent,
        &[
            ("undo-1", Status::Succeeded),
            ("refund-1", Status::Succeeded),
        ],
    )
    .await;
    let undo = seen.iter().find(|e| e.action_id == "undo-1").unwrap();
    assert_eq!(undo.compensates.as_deref(), Some("refund-1"));
    let told = seen.iter().find(|e| e.action_id == "refund-1").unwrap();
    assert_eq!(told.compensated_by.as_deref(), Some("undo-1"));
    assert_eq!(
        told.receipt, original.receipt,
        "the original keeps its receipt"
    );
    assert_eq!(env.mutations("north-shop:undo-1").await, 1);
    assert_eq!(env.mutations("north-shop:refund-1").await, 1);
    assert_eq!(env.state(TENANT, "refund-1").await, "succeeded");

    // Both ways in the status API.
    let o = status(&w, "refund-1").await;
    assert_eq!(o["compensated_by"], "undo-1", "{o}");
    assert_eq!(o["status"], "succeeded");
    assert_eq!(
        o["operation"]["compensations"],
        json!([{"action_id": "undo-1", "state": "succeeded"}])
    );
    let c = status(&w, "undo-1").await;
    assert_eq!(c["compensates"], "refund-1", "{c}");
    assert_eq!(c["operation"]["compensates"], "refund-1");
    // And in the console: each page links the other.
    let port = w.admin_port.unwrap();
    let cookie = e2e::console::sign_in(port, ADMIN, "alice").await;
    let id = |action_id: &'static str| {
        let pool = env.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT id FROM operations WHERE tenant = $1 AND action_id = $2",
            )
            .bind(TENANT)
            .bind(action_id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let (refund_id, undo_id) = (id("refund-1").await, id("undo-1").await);
    for (page_of, links_to) in [(refund_id, undo_id), (undo_id, refund_id)] {
        let page = e2e::http()
            .get(format!("http://127.0.0.1:{port}/ui/operations/{page_of}"))
            .header("cookie", &cookie)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            page.contains(&format!("href=\"/ui/operations/{links_to}\"")),
            "page {page_of} does not link {links_to}"
        );
    }

    // A second compensation under another key is refused, naming the first; the same
    // compensation again is answered from its row.
    agent
        .send(&compensation("undo-2", "reversal", "refund-1"))
        .await;
    let second = rejected(&mut agent, "undo-2").await;
    assert_eq!(second.reason, Some(RejectReason::AlreadyCompensated));
    assert_eq!(second.detail.as_deref(), Some("undo-1"));
    agent
        .send(&compensation("undo-1", "reversal", "refund-1"))
        .await;
    agent.succeeded(TENANT, "undo-1").await;
    // Naming another original under the same key is another intent: a conflict.
    agent
        .send(&compensation("undo-1", "reversal", "refund-9"))
        .await;
    let conflict = rejected(&mut agent, "undo-1").await;
    assert_eq!(conflict.reason, Some(RejectReason::IntentConflict));
    // Another tool's action, or itself: not allowed.
    agent
        .request(TENANT, "ticket-1", "ticket", json!({"title": "t"}))
        .await;
    agent.succeeded(TENANT, "ticket-1").await;
    agent
        .send(&compensation("undo-3", "refund_reversal", "ticket-1"))
        .await;
    let wrong = rejected(&mut agent, "undo-3").await;
    assert_eq!(wrong.reason, Some(RejectReason::CompensationNotAllowed));
    agent
        .send(&compensation("undo-4", "reversal", "undo-4"))
        .await;
    let own = rejected(&mut agent, "undo-4").await;
    assert_eq!(own.reason, Some(RejectReason::CompensationNotAllowed));
    for key in ["undo-2", "undo-3", "undo-4"] {
        assert_eq!(env.writes(&format!("north-shop:{key}")).await, 0, "{key}");
        assert_eq!(env.state(TENANT, key).await, "", "{key} recorded");
    }
}

#[tokio::test]
async fn an_original_not_known_to_have_succeeded_is_never_compensated() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let _w = Worker::start(&env, "w", &WorkerOptions::new(tools(&env, ds.port))).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;

    // held: the reply to a deploy (no recovery) was lost.
    ds.fault(json!({"kind": "drop_after_commit", "key": "north-shop:deploy-1"}))
        .await;
    agent
        .request(TENANT, "deploy-1", "deploy", json!({"service": "api"}))
        .await;
    e2e::wait_for("held", T, || async {
        (env.state(TENANT, "deploy-1").await == "held").then_some(())
    })
    .await;
    // failed: the downstream refused it for good.
    ds.fault(json!({"kind": "status", "status": 422, "key": "north-shop:refund-1", "times": 10}))
        .await;
    agent
        .request(TENANT, "refund-1", "refund", json!({"amount_cents": 1}))
        .await;
    agent.until(TENANT, "refund-1", Status::Failed, T).await;

    let cases = [
        (
            "undo-held",
            "deploy-1",
            RejectReason::OriginalUnresolved,
            Some("held"),
        ),
        (
            "undo-failed",
            "refund-1",
            RejectReason::OriginalNotApplied,
            Some("failed"),
        ),
        (
            "undo-missing",
            "refund-404",
            RejectReason::OriginalNotFound,
            None,
        ),
        (
            "undo-unknown",
            "ticket-1",
            RejectReason::OriginalUnresolved,
            Some("unknown"),
        ),
    ];
    for (undo, original, reason, detail) in cases {
        if original == "ticket-1" {
            // unknown: a ticket's reply was lost and its lookup hangs past the request timeout
            // (each recovery round takes a while, the row stays unknown meanwhile).
            ds.fault(json!({"kind": "drop_after_commit", "key": "north-shop:ticket-1"}))
                .await;
            ds.fault(json!({"kind": "slow", "on": "lookup", "key": "north-shop:ticket-1", "delay_ms": 20000, "times": 5}))
                .await;
            agent
                .request(TENANT, "ticket-1", "ticket", json!({"title": "t"}))
                .await;
            e2e::wait_for("unknown", T, || async {
                (env.state(TENANT, "ticket-1").await == "unknown").then_some(())
            })
            .await;
        }
        agent.send(&compensation(undo, "reversal", original)).await;
        let ev = rejected(&mut agent, undo).await;
        assert_eq!(ev.reason, Some(reason), "{undo}: {ev:?}");
        assert_eq!(ev.detail.as_deref(), detail, "{undo}");
        assert_eq!(ev.compensates.as_deref(), Some(original));
        assert_eq!(env.writes(&format!("north-shop:{undo}")).await, 0, "{undo}");
        assert_eq!(env.state(TENANT, undo).await, "", "{undo} recorded");
    }
}

/// Two compensations of one refund, under two keys, published at once to two workers: one
/// is admitted and sent once, the other refused naming it.
#[tokio::test]
async fn two_compensations_raced_by_two_workers_admit_one() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(tools(&env, ds.port));
    let _a = Worker::start(&env, "a", &opts).await;
    let _b = Worker::start(&env, "b", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    for round in 0..5 {
        let original = format!("refund-{round}");
        agent
            .request(TENANT, &original, "refund", json!({"amount_cents": round}))
            .await;
        agent.succeeded(TENANT, &original).await;
        let (x, y) = (format!("x-{round}"), format!("y-{round}"));
        let (cx, cy) = (
            compensation(&x, "reversal", &original),
            compensation(&y, "reversal", &original),
        );
        tokio::join!(agent.send(&cx), agent.send(&cy));
        let mut answers = BTreeMap::new();
        while answers.len() < 2 {
            let ev = agent.next(TENANT, T).await;
            if (ev.action_id == x || ev.action_id == y)
                && matches!(ev.status, Status::Succeeded | Status::Rejected)
            {
                answers.insert(ev.action_id.clone(), ev);
            }
        }
        let won: Vec<&ResultEvent> = answers
            .values()
            .filter(|e| e.status == Status::Succeeded)
            .collect();
        assert_eq!(won.len(), 1, "round {round}: {answers:?}");
        let lost = answers
            .values()
            .find(|e| e.status == Status::Rejected)
            .unwrap();
        assert_eq!(lost.reason, Some(RejectReason::AlreadyCompensated));
        assert_eq!(lost.detail.as_deref(), Some(won[0].action_id.as_str()));
        let writes = env.writes(&format!("north-shop:{x}")).await
            + env.writes(&format!("north-shop:{y}")).await;
        assert_eq!(writes, 1, "round {round}");
    }
}

/// The worker sending a compensation is SIGKILLed after its send fence: the compensation is
/// recovered by its own tool's capability (a replay) and applied once.
#[tokio::test]
async fn a_crash_mid_compensation_is_recovered_by_its_own_capability() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(tools(&env, ds.port));
    let _first = Worker::start(&env, "first", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "refund-1", "refund", json!({"amount_cents": 5}))
        .await;
    agent.succeeded(TENANT, "refund-1").await;
    drop(_first);
    let mut w = Worker::start(
        &env,
        "w",
        &opts.clone().fault("after_send_fence", Some("undo-1")),
    )
    .await;
    agent
        .send(&compensation("undo-1", "reversal", "refund-1"))
        .await;
    w.wait_output("fault point reached: after_send_fence", T)
        .await;
    w.kill();
    let _b = Worker::start(&env, "b", &opts).await;
    let seen = collect(
        &mut agent,
        &[
            ("undo-1", Status::Succeeded),
            ("refund-1", Status::Succeeded),
        ],
    )
    .await;
    assert!(
        seen.iter()
            .any(|e| e.action_id == "refund-1" && e.compensated_by.as_deref() == Some("undo-1")),
        "{seen:?}"
    );
    assert_eq!(env.mutations("north-shop:undo-1").await, 1);
}
