//! Completion by callback: a long-running tool's downstream signs the document that says its
//! operation ended and posts it to the worker's admin listener (`POST /v1/callbacks/{tool}`),
//! through the built worker against the reference downstream's async jobs. A valid callback
//! settles the operation before any poll, like a poll's answer would; a forged or replayed-late
//! signature, another tool's secret, a document naming another tenant's operation or none, a
//! body over the cap: each refused with a clear status, nothing changed; a callback racing a
//! poll settles the row once.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use e2e::{cleanup, Agent, Downstream, Env, Worker, WorkerOptions};
use protocol::{Status, Uncertainty, VerifiedBy};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(60);
const TENANT: &str = "north-shop";
const OTHER: &str = "south-shop";
const ADMIN: &str = "admin-token-0123456789abcdef";
const SECRET: &str = "deploy-callback-secret-0123";
const EXPORT_SECRET: &str = "export-callback-secret-4567";

/// Two async tools against the downstream's jobs, each with its callback secret; polls from
/// `first_ms` (a large one keeps polls out of the way), held after a minute.
fn tools(env: &Env, port: u16, first_ms: u64, max_body_bytes: usize) -> std::path::PathBuf {
    let tool = |name: &str, resource: &str, secret: &str| {
        let callback = format!(
            "callback = {{ secret = \"{secret}\", signature_header = \"Deploy-Signature\", \
             max_body_bytes = {max_body_bytes}, key = \"/idempotency_key\" }}"
        );
        e2e::async_tool(name, port, resource, (first_ms, first_ms, 60), &callback)
    };
    env.write_tools(&format!(
        "{}\n{}",
        tool("deploy", "deployments", SECRET),
        tool("export", "exports", EXPORT_SECRET)
    ))
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// The signature header's value for `body` signed with `secret` at `t`.
fn sign(secret: &str, t: i64, body: &[u8]) -> String {
    let mut signed = format!("{t}.").into_bytes();
    signed.extend_from_slice(body);
    let mac = kit::secret::hmac_sha256(secret.as_bytes(), &signed);
    let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
    format!("t={t},v1={hex}")
}

/// A job's final status document, shaped as the downstream's status URL answers it.
fn done(operation_id: &str, key: &str, deployment_id: &str) -> Value {
    json!({
        "operation_id": operation_id, "idempotency_key": key, "state": "succeeded",
        "deployment_id": deployment_id, "receipt_id": deployment_id, "mode": "async",
    })
}

/// Posts `body` to the tool's callback route with `signature`; (status, answer).
async fn post(w: &Worker, tool: &str, signature: Option<&str>, body: &[u8]) -> (u16, Value) {
    let mut request = e2e::http()
        .post(format!(
            "http://127.0.0.1:{}/v1/callbacks/{tool}",
            w.admin_port.unwrap()
        ))
        .header("content-type", "application/json")
        .body(body.to_vec());
    if let Some(s) = signature {
        request = request.header("Deploy-Signature", s);
    }
    let r = request.send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// Sends an async request and waits for its `pending` (in progress) answer: the operation id.
async fn accepted(agent: &mut Agent, tenant: &str, action_id: &str, tool: &str) -> String {
    agent
        .request(tenant, action_id, tool, json!({"service": "api"}))
        .await;
    let events = agent.until(tenant, action_id, Status::Pending, T).await;
    let pending = events.last().unwrap();
    assert_eq!(
        pending.uncertainty,
        Some(Uncertainty::InProgress),
        "{pending:?}"
    );
    pending.remote_id.clone().expect("the operation id")
}

/// (state, history length) of an operation.
async fn row(env: &Env, tenant: &str, action_id: &str) -> (String, i64) {
    sqlx::query_as(
        "SELECT o.state, (SELECT count(*) FROM operation_history h WHERE h.operation_id = o.id)
         FROM operations o WHERE tenant = $1 AND action_id = $2",
    )
    .bind(tenant)
    .bind(action_id)
    .fetch_one(&env.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_signed_callback_settles_the_operation_before_any_poll() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(tools(&env, ds.port, 60_000, 65_536)).with_admin(ADMIN);
    let w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    let op = accepted(&mut agent, TENANT, "deploy-cb1", "deploy").await;

    let key = format!("{TENANT}:deploy-cb1");
    let body = serde_json::to_vec(&done(&op, &key, "dep-cb1")).unwrap();
    let (status, answer) = post(&w, "deploy", Some(&sign(SECRET, now(), &body)), &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["outcome"], "settled", "{answer}");
    assert_eq!(answer["state"], "succeeded", "{answer}");
    let events = agent
        .until(TENANT, "deploy-cb1", Status::Succeeded, T)
        .await;
    let last = events.last().unwrap();
    assert_eq!(last.verified_by, Some(VerifiedBy::Callback), "{last:?}");
    assert_eq!(last.remote_id.as_deref(), Some("dep-cb1"));
    assert_eq!(last.receipt.as_ref().unwrap()["operation_id"], op.as_str());
    // No poll was needed; one write, one job.
    assert_eq!(env.status_reads(&key).await, 0);
    assert_eq!(env.writes(&key).await, 1);

    // The same callback again (a retry of the sender, within the window): nothing to do.
    let (status, answer) = post(&w, "deploy", Some(&sign(SECRET, now(), &body)), &body).await;
    assert_eq!(
        (status, answer["outcome"].as_str()),
        (200, Some("already_final"))
    );
    // The same outcome in another document (a field the status URL does not show): the
    // same receipt id, so nothing to do either.
    let mut later = done(&op, &key, "dep-cb1");
    later["delivered_at"] = json!("2026-12-06T07:00:00Z");
    let later = serde_json::to_vec(&later).unwrap();
    let (status, answer) = post(&w, "deploy", Some(&sign(SECRET, now(), &later)), &later).await;
    assert_eq!(
        (status, answer["outcome"].as_str()),
        (200, Some("already_final")),
        "{answer}"
    );
    // Another document for the final operation: a conflict, nothing stored.
    let other = serde_json::to_vec(&done(&op, &key, "dep-other")).unwrap();
    let (status, answer) = post(&w, "deploy", Some(&sign(SECRET, now(), &other)), &other).await;
    assert_eq!(status, 409, "{answer}");
    assert!(
        answer["message"].as_str().unwrap().contains("dep-cb1"),
        "{answer}"
    );
    let extra = agent.try_next(TENANT, Duration::from_millis(500)).await;
    assert!(extra.is_none(), "{extra:?}");

    // A documented failure fails the operation, with the document as evidence.
    let op2 = accepted(&mut agent, TENANT, "deploy-cb2", "deploy").await;
    let failed = json!({"operation_id": op2, "idempotency_key": format!("{TENANT}:deploy-cb2"),
                        "state": "failed", "error": "image pull failed"});
    let body = serde_json::to_vec(&failed).unwrap();
    let (status, answer) = post(&w, "deploy", Some(&sign(SECRET, now(), &body)), &body).await;
    assert_eq!(
        (status, answer["state"].as_str()),
        (200, Some("failed")),
        "{answer}"
    );
    let events = agent.until(TENANT, "deploy-cb2", Status::Failed, T).await;
    assert_eq!(
        events.last().unwrap().verified_by,
        Some(VerifiedBy::Callback)
    );
    drop(w);
    cleanup(env).await;
}

/// (what, tool, signature header, body, expected status, what the message says).
type Case<'a> = (&'a str, &'a str, Option<String>, &'a [u8], u16, &'a str);

#[tokio::test]
async fn a_callback_that_proves_nothing_is_refused_and_changes_nothing() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(tools(&env, ds.port, 60_000, 2_048)).with_admin(ADMIN);
    let w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT, OTHER]).await;
    let op = accepted(&mut agent, TENANT, "deploy-x", "deploy").await;
    let theirs = accepted(&mut agent, OTHER, "deploy-y", "deploy").await;
    let before = row(&env, TENANT, "deploy-x").await;
    let key = format!("{TENANT}:deploy-x");
    let body = serde_json::to_vec(&done(&op, &key, "dep-x")).unwrap();

    let forged = format!("t={},v1={}", now(), "ab".repeat(32));
    let old = sign(SECRET, now() - 301, &body);
    let export = sign(EXPORT_SECRET, now(), &body);
    // Another tenant's operation id beside this tenant's key.
    let mixed = serde_json::to_vec(&done(&theirs, &key, "dep-x")).unwrap();
    let missing = serde_json::to_vec(&done("op-404", &format!("{TENANT}:nothing"), "d")).unwrap();
    let anonymous = serde_json::to_vec(&json!({"state": "succeeded"})).unwrap();
    let mut large = done(&op, &key, "dep-x");
    large["padding"] = json!("x".repeat(4_096));
    let large = serde_json::to_vec(&large).unwrap();
    let cases: Vec<Case> = vec![
        ("no signature", "deploy", None, &body, 401, "missing"),
        (
            "forged",
            "deploy",
            Some(forged),
            &body,
            401,
            "does not match",
        ),
        ("old", "deploy", Some(old), &body, 401, "within 300 s"),
        (
            "another tool's secret",
            "deploy",
            Some(export),
            &body,
            401,
            "does not match",
        ),
        (
            "signed for the other tool",
            "export",
            Some(sign(SECRET, now(), &body)),
            &body,
            401,
            "does not match",
        ),
        (
            "another tenant's operation",
            "deploy",
            Some(sign(SECRET, now(), &mixed)),
            &mixed,
            409,
            "two operations",
        ),
        (
            "no such operation",
            "deploy",
            Some(sign(SECRET, now(), &missing)),
            &missing,
            404,
            "no operation of tool deploy",
        ),
        (
            "names none",
            "deploy",
            Some(sign(SECRET, now(), &anonymous)),
            &anonymous,
            422,
            "names no operation",
        ),
        (
            "a tool without callbacks",
            "refund",
            Some(sign(SECRET, now(), &body)),
            &body,
            404,
            "takes no completion callbacks",
        ),
        (
            "over the cap",
            "deploy",
            Some(sign(SECRET, now(), &large)),
            &large,
            413,
            "at most 2048 bytes",
        ),
    ];
    for (what, tool, signature, body, status, says) in cases {
        let (got, answer) = post(&w, tool, signature.as_deref(), body).await;
        assert_eq!(got, status, "{what}: {answer}");
        assert!(
            answer["message"]
                .as_str()
                .unwrap_or_default()
                .contains(says),
            "{what}: {answer}"
        );
    }
    // Unsigned, oversized or misaddressed callbacks guess nothing: they spend none of the
    // failure budget the admin token shares.
    for _ in 0..40 {
        assert_eq!(post(&w, "deploy", None, &body).await.0, 401);
        assert_eq!(post(&w, "nothing", Some("t=1,v1=00"), &body).await.0, 404);
    }
    let listing = e2e::http()
        .get(format!(
            "http://127.0.0.1:{}/v1/operations",
            w.admin_port.unwrap()
        ))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(listing.status().as_u16(), 200);
    // Nothing changed: both still accepted, no history, no answer to the agent.
    assert_eq!(row(&env, TENANT, "deploy-x").await, before);
    assert_eq!(row(&env, OTHER, "deploy-y").await.0, "accepted");
    assert!(agent
        .try_next(TENANT, Duration::from_millis(500))
        .await
        .is_none());
    assert!(agent
        .try_next(OTHER, Duration::from_millis(100))
        .await
        .is_none());
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn a_callback_racing_a_poll_settles_the_operation_once() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    // Polled often, its job done at once: each callback lands around a poll's answer.
    let opts = WorkerOptions::new(tools(&env, ds.port, 150, 65_536)).with_admin(ADMIN);
    let w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    for i in 0..5 {
        let id = format!("race-{i}");
        let key = format!("{TENANT}:{id}");
        ds.fault(json!({"kind": "async_delay", "key": key, "ms": 0}))
            .await;
        let op = accepted(&mut agent, TENANT, &id, "deploy").await;
        // The downstream's own final document, exactly as its status URL sends it.
        let body = e2e::http()
            .get(format!(
                "http://127.0.0.1:{}/async/operations/{op}",
                ds.port
            ))
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap()
            .to_vec();
        let document: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(document["state"], "succeeded", "{document}");
        let deployment = document["deployment_id"].as_str().unwrap().to_string();
        let signature = sign(SECRET, now(), &body);
        let signed = || post(&w, "deploy", Some(&signature), &body);
        let (a, b, c) = tokio::join!(signed(), signed(), signed());
        for (status, answer) in [a, b, c] {
            assert_eq!(status, 200, "{answer}");
            assert!(
                matches!(
                    answer["outcome"].as_str(),
                    Some("settled" | "already_final")
                ),
                "{answer}"
            );
        }
        let events = agent.until(TENANT, &id, Status::Succeeded, T).await;
        assert_eq!(
            events.last().unwrap().remote_id.as_deref(),
            Some(deployment.as_str())
        );
        let succeeded: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM operation_history h JOIN operations o ON o.id = h.operation_id
             WHERE o.tenant = $1 AND o.action_id = $2 AND h.to_state = 'succeeded'",
        )
        .bind(TENANT)
        .bind(&id)
        .fetch_one(&env.pool)
        .await
        .unwrap();
        assert_eq!(succeeded, 1, "{id}: one move to succeeded");
        let answers: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM result_outbox WHERE payload->>'action_id' = $1
             AND status = 'succeeded'",
        )
        .bind(&id)
        .fetch_one(&env.pool)
        .await
        .unwrap();
        assert_eq!(answers, 1, "{id}: one succeeded answer");
        assert_eq!(env.writes(&key).await, 1);
    }
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn a_callback_found_by_key_settles_a_held_operation() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    // No recovery: a lost acceptance is held at once, and only the callback can tell.
    let tools = tools(&env, ds.port, 60_000, 65_536);
    let text = std::fs::read_to_string(&tools).unwrap().replace(
        "recovery = \"replay\"\nreplay_window_secs = 3600\n",
        "recovery = \"none\"\n",
    );
    std::fs::write(&tools, text).unwrap();
    let w = Worker::start(&env, "w", &WorkerOptions::new(tools).with_admin(ADMIN)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    let key = format!("{TENANT}:deploy-h");
    ds.fault(json!({"kind": "drop_after_commit", "key": key}))
        .await;
    agent
        .request(TENANT, "deploy-h", "deploy", json!({"service": "api"}))
        .await;
    assert_eq!(env.final_state(TENANT, "deploy-h", T).await, "held");
    let job: (String, String) = sqlx::query_as(
        "SELECT operation_id, coalesce(deployment_id, '') FROM downstream.async_jobs
         WHERE idem_key = $1",
    )
    .bind(&key)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    let body = serde_json::to_vec(&done(&job.0, &key, "dep-held")).unwrap();
    let (status, answer) = post(&w, "deploy", Some(&sign(SECRET, now(), &body)), &body).await;
    assert_eq!(
        (status, answer["outcome"].as_str()),
        (200, Some("settled")),
        "{answer}"
    );
    let events = agent.until(TENANT, "deploy-h", Status::Succeeded, T).await;
    assert_eq!(
        events.last().unwrap().verified_by,
        Some(VerifiedBy::Callback)
    );
    assert_eq!(env.writes(&key).await, 1);
    drop(w);
    cleanup(env).await;
}
