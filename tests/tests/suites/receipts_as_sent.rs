//! No receipt is ever unstorable: a downstream's proof is kept exactly as it was sent. A
//! receipt holding U+0000 (legal JSON that Postgres `jsonb` refuses) settles its operation like
//! any other, for a write's answer, a lookup's and an async job's final status document, and
//! the status API returns the bytes the downstream sent, spacing and member order included.

use std::time::Duration;

use e2e::{cleanup, Agent, Downstream, Env, Worker, WorkerOptions};
use protocol::Status;
use serde_json::json;

const T: Duration = Duration::from_secs(60);
const TENANT: &str = "north-shop";
const ADMIN: &str = "admin-token-0123456789abcdef";
/// What the downstream's `nul_in_receipt` fault puts in place of the body's closing brace.
const MEMO_TAIL: &str = r#" , "memo" : "nul\u0000end" }"#;

fn key(action_id: &str) -> String {
    format!("{TENANT}:{action_id}")
}

/// The status API's answer for one operation, as text.
async fn status_text(w: &Worker, action_id: &str) -> String {
    e2e::http()
        .get(format!(
            "http://127.0.0.1:{}/v1/operations/{TENANT}/{action_id}",
            w.admin_port.unwrap()
        ))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The receipt as the ledger holds it, as text.
async fn ledger_receipt(env: &Env, action_id: &str) -> String {
    sqlx::query_scalar("SELECT receipt::text FROM operations WHERE tenant = $1 AND action_id = $2")
        .bind(TENANT)
        .bind(action_id)
        .fetch_one(&env.pool)
        .await
        .unwrap()
}

/// The operation settled `succeeded` with the memo, kept byte for byte in the ledger and in
/// the status API, and the agent was told so with the same document.
async fn assert_kept(env: &Env, w: &Worker, agent: &mut Agent, action_id: &str) {
    let events = agent.until(TENANT, action_id, Status::Succeeded, T).await;
    let done = events.last().unwrap();
    let receipt = done.receipt.as_ref().expect("the receipt");
    assert_eq!(receipt["memo"], "nul\u{0}end", "{done:?}");
    let stored = ledger_receipt(env, action_id).await;
    assert!(stored.ends_with(MEMO_TAIL), "stored as sent: {stored}");
    let text = status_text(w, action_id).await;
    assert!(
        text.contains(MEMO_TAIL),
        "the status API returns the bytes sent: {text}"
    );
    let status: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(status["status"], "succeeded", "{text}");
    assert_eq!(
        status["operation"]["receipt"]["memo"], "nul\u{0}end",
        "{text}"
    );
}

#[tokio::test]
async fn a_receipt_holding_a_nul_settles_the_write_with_the_bytes_sent() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = env.standard_tools(ds.port, "");
    let w = Worker::start(&env, "w", &WorkerOptions::new(tools).with_admin(ADMIN)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;

    // The write's own answer.
    ds.fault(json!({"kind": "nul_in_receipt", "key": key("refund-nul")}))
        .await;
    agent
        .request(TENANT, "refund-nul", "refund", json!({"amount": 5}))
        .await;
    assert_kept(&env, &w, &mut agent, "refund-nul").await;
    assert_eq!(env.writes(&key("refund-nul")).await, 1);

    // A lookup's answer, after the write's answer was lost.
    ds.fault(json!({"kind": "drop_after_commit", "key": key("ticket-nul")}))
        .await;
    ds.fault(json!({"kind": "nul_in_receipt", "key": key("ticket-nul"), "on": "lookup"}))
        .await;
    agent
        .request(TENANT, "ticket-nul", "ticket", json!({"title": "printer"}))
        .await;
    assert_kept(&env, &w, &mut agent, "ticket-nul").await;
    assert_eq!(env.writes(&key("ticket-nul")).await, 1);
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn a_final_status_document_holding_a_nul_settles_the_long_running_write() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let port = ds.port;
    let tools = env.async_tools(port, (200, 1_000, 60), "");
    let w = Worker::start(&env, "w", &WorkerOptions::new(tools).with_admin(ADMIN)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    ds.fault(json!({"kind": "async_delay", "key": key("deploy-nul"), "ms": 0}))
        .await;
    ds.fault(json!({"kind": "nul_in_receipt", "key": key("deploy-nul"), "on": "status"}))
        .await;
    agent
        .request(TENANT, "deploy-nul", "deploy", json!({"service": "api"}))
        .await;
    assert_kept(&env, &w, &mut agent, "deploy-nul").await;
    assert_eq!(env.async_jobs(&key("deploy-nul")).await, 1);
    drop(w);
    cleanup(env).await;
}
