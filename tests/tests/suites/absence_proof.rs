//! Proof of absence (docs/recovery.md, "Proof of absence"): a `lookup` tool that declares
//! `absence_proof` against the reference downstream, which checks each write's deadline at its
//! commit point. Through the built binaries, counted in the downstream's own tables:
//!
//! - a request dropped before the downstream committed: the lookup misses before the proof
//!   point (the row stays `unknown`), misses after it, and the write is sent again under the
//!   same key, once: one mutation, two write requests, the second after the first's deadline;
//! - the same with one recovery round: the miss before the proof point proves nothing, held;
//! - a request a proxy holds in flight past its deadline and then delivers: the downstream
//!   refuses it (422, no effect), the resend is the only mutation;
//! - a downstream whose clock runs ahead of the database's by more than the deadline: every
//!   write is refused at its deadline, proven not applied, and the action fails after
//!   `max_attempts` with no mutation;
//! - a lost reply after the commit: the lookup finds it, one write, as without the contract.

use std::time::Duration;

use e2e::{cleanup, intent, Agent, Downstream, Env, FaultProxy, Worker, WorkerOptions};
use protocol::Status;
use serde_json::json;

const T: Duration = Duration::from_secs(40);
const TENANT: &str = "north-shop";
/// The tool's timeout; the deadline outlives it and stays below the lease.
const TIMEOUT_MS: u64 = 1500;
const DEADLINE_MS: u64 = 2500;
const SKEW_MS: u64 = 300;
const LEASE_SECS: u64 = 5;

/// The standard recovery rounds and retry policy of these tests.
const ROUNDS: u32 = 3;
const RETRY: &str = "{ initial_delay_ms = 100, max_delay_ms = 1000 }";

/// A `ticket` tool (lookup mode) whose writes go to `write_base` and lookups to `lookup_base`,
/// with `absence_proof` (`settle_ms`), `rounds` recovery rounds and the `retry` policy.
fn tools(
    env: &Env,
    (write_base, lookup_base): (&str, &str),
    settle_ms: u64,
    rounds: u32,
    retry: &str,
) -> WorkerOptions {
    let path = env.write_tools(&format!(
        "[tools.ticket]\nurl = \"{write_base}/lookup/tickets\"\nrecovery = \"lookup\"\n\
         lookup_url = \"{lookup_base}/lookup/tickets/by-key/{{key}}\"\n\
         receipt_id = \"/receipt_id\"\n\
         receipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\n\
         timeout_ms = {TIMEOUT_MS}\nrecovery_attempts = {rounds}\nretry = {retry}\n\
         absence_proof = {{ deadline_ms = {DEADLINE_MS}, clock_skew_ms = {SKEW_MS}, settle_ms = {settle_ms} }}\n"
    ));
    let mut opts = WorkerOptions::new(path);
    opts.lease_secs = LEASE_SECS;
    opts
}

fn base(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}

/// The operation's history: (state entered, evidence), oldest first.
async fn history(env: &Env, action_id: &str) -> Vec<(String, String)> {
    env.history(TENANT, action_id)
        .await
        .into_iter()
        .map(|(state, evidence)| (state, evidence.unwrap_or_default()))
        .collect()
}

/// The downstream's log of write requests for `key`: (answered status, seconds since the first).
async fn writes_logged(env: &Env, key: &str) -> Vec<(Option<i32>, f64)> {
    sqlx::query_as(
        "SELECT status, extract(epoch FROM at - first_value(at) OVER (ORDER BY id))::float8
         FROM downstream.requests WHERE kind = 'write' AND idem_key = $1 ORDER BY id",
    )
    .bind(key)
    .fetch_all(&env.pool)
    .await
    .expect("read the downstream's requests")
}

fn stamp_after<'a>(evidence: &'a str, words: &str) -> Option<&'a str> {
    let at = evidence.find(words)? + words.len();
    evidence.get(at..at + 24)
}

#[tokio::test]
async fn a_write_lost_before_the_commit_is_sent_again_once_its_deadline_has_passed() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = tools(&env, (&base(ds.port), &base(ds.port)), 0, ROUNDS, RETRY);
    let action = "ticket-dropped";
    let key = format!("{TENANT}:{action}");
    ds.fault(json!({"kind": "drop_before_commit", "key": key}))
        .await;
    let _w = Worker::start(&env, "w1", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .send(&intent(
            TENANT,
            action,
            "ticket",
            json!({"title": "printer {on fire}"}),
        ))
        .await;
    let events = agent.until(TENANT, action, Status::Succeeded, T).await;
    let receipt = events.last().unwrap().receipt.clone();
    assert_eq!(
        receipt,
        env.downstream_receipt(&key).await,
        "the agent gets the downstream's receipt"
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(env.mutations(&key).await, 1, "one mutation");
    let writes = writes_logged(&env, &key).await;
    assert_eq!(
        writes.len(),
        2,
        "the dropped write and one resend: {writes:?}"
    );
    assert_eq!(writes[0].0, None, "the first write was dropped: {writes:?}");
    // The resend left after the first write's deadline plus the declared skew.
    let gap = writes[1].1;
    assert!(
        gap >= (DEADLINE_MS + SKEW_MS) as f64 / 1000.0 - 0.1,
        "the resend came {gap:.2} s after the first write, before its deadline + skew"
    );
    let history = history(&env, action).await;
    let text = format!("{history:#?}");
    // Every send's deadline is in the history, and the proof names the one it relied on.
    let first = history
        .iter()
        .find(|(s, e)| s == "unknown" && e.contains("request deadline "))
        .unwrap_or_else(|| panic!("the first write's deadline in its outcome: {text}"));
    let deadline = stamp_after(&first.1, "request deadline ").expect("a deadline stamp");
    assert!(
        history
            .iter()
            .any(|(s, e)| s == "unknown" && e.contains("proves nothing")),
        "a miss before the proof point stayed unknown: {text}"
    );
    let proof = history
        .iter()
        .find(|(s, _)| s == "retry_wait")
        .unwrap_or_else(|| panic!("a retry_wait on the proof: {text}"));
    assert!(
        proof.1.contains("proof of absence") && proof.1.contains(deadline),
        "the proof names the deadline it relied on ({deadline}): {text}"
    );
    let row = env.operation(TENANT, action).await.unwrap();
    assert_eq!((row.state.as_str(), row.attempts), ("succeeded", 2));
    cleanup(env).await;
}

#[tokio::test]
async fn a_miss_before_the_proof_point_proves_nothing_and_the_row_is_held() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = tools(&env, (&base(ds.port), &base(ds.port)), 0, 1, RETRY);
    let action = "ticket-early-miss";
    let key = format!("{TENANT}:{action}");
    ds.fault(json!({"kind": "drop_before_commit", "key": key}))
        .await;
    let _w = Worker::start(&env, "w1", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .send(&intent(TENANT, action, "ticket", json!({"n": 1})))
        .await;
    assert_eq!(env.final_state(TENANT, action, T).await, "held");
    // Past the proof point, nothing more happens on its own.
    tokio::time::sleep(Duration::from_millis(DEADLINE_MS + SKEW_MS + 1000)).await;
    assert_eq!(env.state(TENANT, action).await, "held");
    assert_eq!((env.mutations(&key).await, env.writes(&key).await), (0, 1));
    let events = agent.until(TENANT, action, Status::Pending, T).await;
    assert!(events.iter().all(|e| e.status == Status::Pending));
    let row = env.operation(TENANT, action).await.unwrap();
    let evidence = row.evidence.unwrap_or_default();
    assert!(evidence.contains("proves nothing"), "{evidence}");
    cleanup(env).await;
}

#[tokio::test]
async fn a_write_held_in_flight_past_its_deadline_is_refused_and_the_resend_is_the_only_mutation() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let proxy = FaultProxy::start(&format!("127.0.0.1:{}", ds.port)).await;
    // Writes cross the proxy, lookups go straight to the downstream; a settle time of 2 s
    // puts the resend well after the moment the held write is let go.
    let through = format!("http://{}", proxy.addr());
    let opts = tools(&env, (&through, &base(ds.port)), 2000, ROUNDS, RETRY);
    let action = "ticket-delayed";
    let key = format!("{TENANT}:{action}");
    let _w = Worker::start(&env, "w1", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    proxy.hold();
    agent
        .send(&intent(TENANT, action, "ticket", json!({"n": 2})))
        .await;
    // The worker gave up on the write (its timeout) while the proxy still holds it.
    e2e::wait_for("the write held and the row unknown", T, || async {
        (proxy.held_bytes() > 0 && env.state(TENANT, action).await == "unknown").then_some(())
    })
    .await;
    assert_eq!(env.writes(&key).await, 0, "the held write has not arrived");
    // Let it go once its deadline (on the database clock) has passed.
    e2e::wait_for("the first deadline to pass", T, || async {
        let passed: bool = sqlx::query_scalar(
            "SELECT send_deadline + interval '200 milliseconds' < now() FROM operations
             WHERE tenant = $1 AND action_id = $2",
        )
        .bind(TENANT)
        .bind(action)
        .fetch_one(&env.pool)
        .await
        .expect("read send_deadline");
        passed.then_some(())
    })
    .await;
    assert_ne!(
        env.state(TENANT, action).await,
        "retry_wait",
        "not resent before the settle time"
    );
    proxy.release();
    e2e::wait_for("the late write to be refused", T, || async {
        let w = writes_logged(&env, &key).await;
        (w.first().is_some_and(|(s, _)| s.is_some())).then_some(())
    })
    .await;
    agent.until(TENANT, action, Status::Succeeded, T).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let writes = writes_logged(&env, &key).await;
    assert_eq!(writes.len(), 2, "{writes:?}");
    assert_eq!(
        writes[0].0,
        Some(422),
        "the late write was refused at its deadline: {writes:?}"
    );
    assert_eq!(writes[1].0, Some(201), "the resend applied: {writes:?}");
    assert_eq!(
        env.mutations(&key).await,
        1,
        "the resend is the only mutation"
    );
    cleanup(env).await;
}

#[tokio::test]
async fn a_downstream_clock_far_ahead_refuses_every_write_and_the_action_fails_unapplied() {
    let env = Env::new().await;
    let ds = Downstream::start_with(&env, &[("DOWNSTREAM_CLOCK_OFFSET_MS", "60000")]).await;
    let opts = tools(
        &env,
        (&base(ds.port), &base(ds.port)),
        0,
        ROUNDS,
        "{ max_attempts = 3, initial_delay_ms = 100, max_delay_ms = 200 }",
    );
    let action = "ticket-clock-ahead";
    let key = format!("{TENANT}:{action}");
    let _w = Worker::start(&env, "w1", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .send(&intent(TENANT, action, "ticket", json!({"n": 3})))
        .await;
    let events = agent.until(TENANT, action, Status::Failed, T).await;
    let failed = events.last().unwrap();
    assert!(failed.receipt.is_none());
    assert_eq!(env.state(TENANT, action).await, "failed");
    assert_eq!((env.mutations(&key).await, env.writes(&key).await), (0, 3));
    let writes = writes_logged(&env, &key).await;
    assert!(writes.iter().all(|(s, _)| *s == Some(422)), "{writes:?}");
    let evidence = env
        .operation(TENANT, action)
        .await
        .unwrap()
        .evidence
        .unwrap_or_default();
    assert!(
        evidence.contains("max_attempts") && evidence.contains("refused at its deadline"),
        "{evidence}"
    );
    cleanup(env).await;
}

#[tokio::test]
async fn a_reply_lost_after_the_commit_is_found_by_the_lookup_and_never_resent() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = tools(&env, (&base(ds.port), &base(ds.port)), 0, ROUNDS, RETRY);
    let action = "ticket-lost-reply";
    let key = format!("{TENANT}:{action}");
    ds.fault(json!({"kind": "drop_after_commit", "key": key}))
        .await;
    let _w = Worker::start(&env, "w1", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .send(&intent(TENANT, action, "ticket", json!({"n": 4})))
        .await;
    agent.until(TENANT, action, Status::Succeeded, T).await;
    // Past the proof point: the found receipt stays the answer, nothing is resent.
    tokio::time::sleep(Duration::from_millis(DEADLINE_MS + SKEW_MS)).await;
    assert_eq!((env.mutations(&key).await, env.writes(&key).await), (1, 1));
    cleanup(env).await;
}
