//! Approval before dispatch, through the built binaries against the reference downstream: an
//! intent its tool asks a person to approve is recorded `awaiting_approval`, answered `pending`
//! at once and never sent until the approvals it needs come, each naming the fingerprint of
//! the arguments the approver saw. Counts come from the downstream's tables.

use std::process::Command;
use std::time::Duration;

use e2e::{intent, metric_value, procs::bin_dir, Agent, Downstream, Env, Worker, WorkerOptions};
use protocol::{Status, Uncertainty, VerifiedBy};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(30);
const TENANT: &str = "north-shop";
const ADMIN: &str = "admin-token-0123456789abcdef";
const NORTH: &str = "north-token-123456";
const ALICE: &str = "alice-approver-token-1234";
const BOB: &str = "bob-approver-token-56789";

/// The refund tool asks for approval above 100.00; `extra` goes into every tool.
fn tools(env: &Env, port: u16, extra: &str) -> std::path::PathBuf {
    env.standard_tools(port, extra)
}

fn options(tools: std::path::PathBuf) -> WorkerOptions {
    WorkerOptions::new(tools)
        .with_metrics()
        .with_admin(ADMIN)
        .env("WORKER_TENANT_TOKENS", &format!("{TENANT}={NORTH}"))
        .env(
            "WORKER_APPROVER_TOKENS",
            &format!("alice={ALICE},bob={BOB}"),
        )
}

struct Api {
    base: String,
    http: reqwest::Client,
}

impl Api {
    fn of(w: &Worker) -> Api {
        Api {
            base: format!("http://127.0.0.1:{}/v1", w.admin_port.expect("admin port")),
            http: e2e::http(),
        }
    }

    async fn post(&self, token: &str, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(token)
            .json(&body)
            .send()
            .await
            .expect("post");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    async fn get(&self, token: &str, path: &str) -> (u16, Value) {
        let r = self
            .http
            .get(format!("{}{path}", self.base))
            .bearer_auth(token)
            .send()
            .await
            .expect("get");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// Approves or rejects `action_id` as the holder of `token`.
    async fn decide(
        &self,
        token: &str,
        what: &str,
        action_id: &str,
        fingerprint: &str,
        request_id: &str,
    ) -> (u16, Value) {
        self.post(
            token,
            &format!("/operations/{TENANT}/{action_id}/{what}"),
            json!({"fingerprint": fingerprint, "reason": "checked the order", "request_id": request_id}),
        )
        .await
    }
}

async fn fingerprint(env: &Env, action_id: &str) -> String {
    env.operation(TENANT, action_id)
        .await
        .expect("recorded")
        .fingerprint
}

async fn wait_state(env: &Env, action_id: &str, state: &str) {
    e2e::wait_for(state, T, || async {
        (env.state(TENANT, action_id).await == state).then_some(())
    })
    .await;
}

#[tokio::test]
async fn an_intent_above_the_limit_waits_for_its_approval_and_runs_once() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let rule = "approval_when = { \"/amount_cents\" = { gt = 10000 } }";
    let w = Worker::start(&env, "w", &options(tools(&env, ds.port, rule))).await;
    let api = Api::of(&w);
    let mut agent = Agent::new(&env, &[TENANT]).await;

    // Under the limit: sent at once.
    agent
        .request(TENANT, "small", "refund", json!({"amount_cents": 500}))
        .await;
    agent.succeeded(TENANT, "small").await;
    // Over it: recorded, answered pending, never sent.
    let big = intent(TENANT, "big", "refund", json!({"amount_cents": 25000}));
    agent.send(&big).await;
    let pending = agent
        .until(TENANT, "big", Status::Pending, T)
        .await
        .pop()
        .unwrap();
    assert_eq!(pending.uncertainty, Some(Uncertainty::AwaitingApproval));
    assert_eq!(pending.next_action.as_deref(), Some("check_status"));
    assert!(pending.message.contains("approve"), "{}", pending.message);
    assert_eq!(env.state(TENANT, "big").await, "awaiting_approval");
    // A string where the rule compares numbers needs approval too: a rule never fails open.
    agent
        .request(TENANT, "sly", "refund", json!({"amount_cents": "25000"}))
        .await;
    let sly = agent
        .until(TENANT, "sly", Status::Pending, T)
        .await
        .pop()
        .unwrap();
    assert_eq!(sly.uncertainty, Some(Uncertainty::AwaitingApproval));
    // A duplicate is answered from the row; other arguments under the key are a conflict.
    agent.send(&big).await;
    let again = agent
        .until(TENANT, "big", Status::Pending, T)
        .await
        .pop()
        .unwrap();
    assert_eq!(again.uncertainty, Some(Uncertainty::AwaitingApproval));
    agent
        .request(TENANT, "big", "refund", json!({"amount_cents": 99}))
        .await;
    let conflict = agent
        .until(TENANT, "big", Status::Rejected, T)
        .await
        .pop()
        .unwrap();
    assert_eq!(conflict.reason.map(|r| r.as_str()), Some("intent_conflict"));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        env.writes("north-shop:big").await,
        0,
        "sent before approval"
    );

    // What waits, as an approver and as the tenant see it.
    let fp = fingerprint(&env, "big").await;
    let (status, listed) = api.get(ALICE, "/approvals").await;
    assert_eq!(status, 200, "{listed}");
    let item = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["action_id"] == "big")
        .cloned()
        .expect("listed");
    assert_eq!(item["fingerprint"], fp.as_str());
    assert_eq!(item["arguments"], json!({"amount_cents": 25000}));
    assert_eq!(item["approvals_needed"], 1);
    assert_eq!(item["call_id"], big.call_id.clone().unwrap().as_str());
    let (status, own) = api.get(NORTH, "/approvals").await;
    assert_eq!((status, own["items"].as_array().unwrap().len()), (200, 2));
    let (_, other) = api.get(NORTH, "/approvals?tenant=south-shop").await;
    assert_eq!(other["items"], json!([]));

    // Only an approver token acts, and only on the arguments it was shown.
    for token in [ADMIN, NORTH] {
        let (status, body) = api
            .decide(token, "approve", "big", &fp, "r-forbidden")
            .await;
        assert_eq!(status, 403, "{body}");
    }
    let (status, body) = api
        .post(
            ALICE,
            &format!("/operations/{TENANT}/big/approve"),
            json!({"fingerprint": fp, "reason": "ok", "request_id": "r-named", "operator": "bob"}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    let forged = "f".repeat(fp.len());
    let (status, body) = api
        .decide(ALICE, "approve", "big", &forged, "r-forged")
        .await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("fingerprint"),
        "{body}"
    );
    let (status, body) = api.get(ALICE, &format!("/operations/{TENANT}/big")).await;
    assert_eq!(status, 403, "an approver token reads nothing else: {body}");
    assert_eq!(env.state(TENANT, "big").await, "awaiting_approval");

    let (status, body) = api.decide(ALICE, "approve", "big", &fp, "r-1").await;
    assert_eq!(status, 200, "{body}");
    let done = agent.succeeded(TENANT, "big").await;
    assert_eq!(done.verified_by, Some(VerifiedBy::Dispatch));
    // The same request again gets the stored answer and changes nothing.
    let (status, _) = api.decide(ALICE, "approve", "big", &fp, "r-1").await;
    assert_eq!(status, 200);
    assert_eq!(env.mutations("north-shop:big").await, 1);
    assert_eq!(env.writes("north-shop:big").await, 1);
    let history: Vec<String> = sqlx::query_scalar(
        "SELECT coalesce(actor, '') FROM operation_history h JOIN operations o ON o.id = h.operation_id
         WHERE o.tenant = $1 AND o.action_id = 'big' ORDER BY h.id",
    )
    .bind(TENANT)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert!(history.iter().any(|a| a == "operator:alice"), "{history:?}");

    let m = w.metrics().await;
    for (outcome, n) in [("requested", 2.0), ("approved", 1.0), ("rejected", 0.0)] {
        let labels = [("tool", "refund"), ("outcome", outcome)];
        assert_eq!(
            metric_value(&m, "intent_worker_approvals_total", &labels),
            n,
            "{outcome}"
        );
    }
    assert_eq!(
        metric_value(
            &m,
            "intent_worker_unresolved_operations",
            &[("tool", "refund"), ("state", "awaiting_approval")]
        ),
        1.0,
        "sly still waits"
    );
}

#[tokio::test]
async fn two_approvals_need_two_people_and_a_rejection_or_the_end_of_the_wait_fails_unsent() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let w = Worker::start(
        &env,
        "w",
        &options(tools(
            &env,
            ds.port,
            "approval = \"required\"\napprovals = 2",
        )),
    )
    .await;
    let api = Api::of(&w);
    let mut agent = Agent::new(&env, &[TENANT]).await;
    for id in ["two", "no"] {
        agent
            .request(TENANT, id, "ticket", json!({"title": id}))
            .await;
        agent.until(TENANT, id, Status::Pending, T).await;
    }
    let fp = fingerprint(&env, "two").await;
    let (status, body) = api.decide(ALICE, "approve", "two", &fp, "a-1").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["state"], "awaiting_approval", "one of two: {body}");
    let (status, body) = api.decide(ALICE, "approve", "two", &fp, "a-2").await;
    assert_eq!(status, 409, "the same person twice: {body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("already approved"),
        "{body}"
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(env.writes("north-shop:two").await, 0);
    let (status, body) = api.decide(BOB, "approve", "two", &fp, "b-1").await;
    assert_eq!(status, 200, "{body}");
    agent.succeeded(TENANT, "two").await;
    assert_eq!(env.mutations("north-shop:two").await, 1);

    // Rejected: failed, never sent, and said so.
    let fp = fingerprint(&env, "no").await;
    let (status, body) = api.decide(BOB, "reject", "no", &fp, "b-2").await;
    assert_eq!(status, 200, "{body}");
    let failed = agent
        .until(TENANT, "no", Status::Failed, T)
        .await
        .pop()
        .unwrap();
    assert_eq!(failed.detail.as_deref(), Some("not_approved"));
    assert_eq!(failed.verified_by, Some(VerifiedBy::Operator));
    assert_eq!(failed.operator.as_deref(), Some("bob"));
    let (status, body) = api.decide(ALICE, "approve", "no", &fp, "a-3").await;
    assert_eq!(status, 409, "approving a rejected one: {body}");
    // Its duplicate is answered the same way.
    agent
        .request(TENANT, "no", "ticket", json!({"title": "no"}))
        .await;
    let again = agent
        .until(TENANT, "no", Status::Failed, T)
        .await
        .pop()
        .unwrap();
    assert_eq!(again.detail.as_deref(), Some("not_approved"));
    assert_eq!(env.writes("north-shop:no").await, 0);
    assert_eq!(env.lookups("north-shop:no").await, 0);
    drop(w);

    // A one-second wait: failed by the scheduler, never sent.
    let w = Worker::start(
        &env,
        "w2",
        &options(tools(
            &env,
            ds.port,
            "approval = \"required\"\napproval_ttl_secs = 1",
        )),
    )
    .await;
    agent
        .request(TENANT, "late", "deploy", json!({"service": "api"}))
        .await;
    let seen = agent.until(TENANT, "late", Status::Failed, T).await;
    assert_eq!(seen[0].status, Status::Pending, "{seen:?}");
    let expired = seen.last().unwrap();
    assert_eq!(expired.detail.as_deref(), Some("approval_expired"));
    assert_eq!(expired.verified_by, Some(VerifiedBy::Expiry));
    assert_eq!(env.writes("north-shop:late").await, 0);
    let m = w.metrics().await;
    assert_eq!(
        metric_value(
            &m,
            "intent_worker_approvals_total",
            &[("tool", "deploy"), ("outcome", "expired")]
        ),
        1.0
    );
}

/// Approved with no worker running (`worker ops approve`), then two workers race for the
/// approved row: it is sent once.
#[tokio::test]
async fn approved_from_the_cli_while_no_worker_runs_then_sent_once_by_two_racing_workers() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = options(tools(&env, ds.port, "approval = \"required\""));
    let mut w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    for i in 0..5 {
        agent
            .request(
                TENANT,
                &format!("r-{i}"),
                "refund",
                json!({"amount_cents": i}),
            )
            .await;
        agent
            .until(TENANT, &format!("r-{i}"), Status::Pending, T)
            .await;
    }
    w.kill();
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
    // A wrong fingerprint is refused by the CLI too.
    let out = ops(&[
        "approve",
        TENANT,
        "r-0",
        "--operator",
        "carol",
        "--reason",
        "ok",
        "--fingerprint",
        "abc",
    ]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for i in 0..5 {
        let out = ops(&[
            "approve",
            TENANT,
            &format!("r-{i}"),
            "--operator",
            "carol",
            "--reason",
            "checked",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("amount_cents"),
            "prints what it approved"
        );
        assert_eq!(env.state(TENANT, &format!("r-{i}")).await, "prepared");
    }
    // Started together: both schedulers find the approved rows due at once.
    let a = Worker::spawn(&env, "a", &opts);
    let b = Worker::spawn(&env, "b", &opts);
    let mut told = std::collections::BTreeSet::new();
    while told.len() < 5 {
        let ev = agent.next(TENANT, T).await;
        if ev.status == Status::Succeeded {
            told.insert(ev.action_id);
        }
    }
    for i in 0..5 {
        let key = format!("north-shop:r-{i}");
        assert_eq!(env.writes(&key).await, 1, "{key}");
        assert_eq!(env.mutations(&key).await, 1, "{key}");
    }
    drop((a, b));
}

/// The worker that committed the approval is SIGKILLed right after it, before any dispatch:
/// another worker sends the action once.
#[tokio::test]
async fn a_worker_killed_right_after_the_approval_commit_loses_nothing() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = options(tools(&env, ds.port, "approval = \"required\""));
    let mut w = Worker::start(
        &env,
        "w",
        &opts.clone().fault("after_approval", Some("k-1")),
    )
    .await;
    let api = Api::of(&w);
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "k-1", "refund", json!({"amount_cents": 1}))
        .await;
    agent.until(TENANT, "k-1", Status::Pending, T).await;
    let fp = fingerprint(&env, "k-1").await;
    let call = tokio::spawn(async move { api.decide(ALICE, "approve", "k-1", &fp, "k-r").await });
    w.wait_output("fault point reached: after_approval", T)
        .await;
    w.kill();
    let _ = call.await;
    wait_state(&env, "k-1", "prepared").await;
    assert_eq!(env.writes("north-shop:k-1").await, 0);
    let _b = Worker::start(&env, "b", &opts).await;
    agent.succeeded(TENANT, "k-1").await;
    assert_eq!(env.writes("north-shop:k-1").await, 1);
    assert_eq!(env.mutations("north-shop:k-1").await, 1);
}

#[tokio::test]
async fn a_bad_approval_rule_stops_the_worker_naming_the_tool_and_key() {
    let env = Env::new().await;
    for (extra, said) in [
        ("approval_when = { \"/amount\" = { gte = 5 } }", "gte"),
        ("approval_when = { \"amount\" = { gt = 5 } }", "amount"),
        ("approval = \"maybe\"", "maybe"),
        ("approvals = 2", "approvals"),
    ] {
        let tools = env.standard_tools(1, extra);
        let out = Command::new(bin_dir().join("worker"))
            .env("DATABASE_URL", &env.db_url)
            .env("AMQP_URL", &env.amqp_url)
            .env("WORKER_TOOLS", &tools)
            .env("RUST_LOG", "warn")
            .output()
            .expect("run worker");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra}: {stderr}");
        assert!(
            stderr.contains("tools.") && stderr.contains(said),
            "{extra}: {stderr}"
        );
    }
}
