//! Long-running downstream operations (`completion = "async"`), through the built worker
//! against the reference downstream's async jobs: a write answered `202 Accepted` is polled
//! through the status URL, read only, until the job is done (`succeeded` with the final status
//! document as the receipt), failed (`failed` with it as evidence) or past the deadline
//! (`held`). A poll is never a write: the downstream counts one job and one write per key,
//! whatever the polls, crashes and restarts. The agent is told `pending` (in progress, with the
//! operation id) once, then the truth with how it was verified.

use std::time::Duration;

use e2e::{cleanup, Agent, Downstream, Env, Worker, WorkerOptions};
use protocol::{Status, Uncertainty, VerifiedBy};
use serde_json::json;

const T: Duration = Duration::from_secs(60);
const TENANT: &str = "north-shop";
const ADMIN: &str = "admin-token-0123456789abcdef";

/// An async `deploy` tool against the downstream at `port`: polled from `first_ms` up to
/// `max_ms`, held after `deadline_secs`, recovered by replay.
fn async_tools(
    env: &Env,
    port: u16,
    first_ms: u64,
    max_ms: u64,
    deadline_secs: u64,
) -> std::path::PathBuf {
    env.async_tools(
        port,
        (first_ms, max_ms, deadline_secs),
        "retry = { initial_delay_ms = 100, max_delay_ms = 500 }",
    )
}

fn key(action_id: &str) -> String {
    format!("{TENANT}:{action_id}")
}

#[tokio::test]
async fn an_accepted_deployment_is_polled_until_done_and_succeeds_with_its_final_status() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = async_tools(&env, ds.port, 200, 1_000, 60);
    let w = Worker::start(&env, "w", &WorkerOptions::new(tools).with_admin(ADMIN)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    ds.fault(json!({"kind": "async_delay", "key": key("deploy-1"), "ms": 1500}))
        .await;
    agent
        .request(
            TENANT,
            "deploy-1",
            "deploy",
            json!({"service": "api", "version": "7"}),
        )
        .await;
    let events = agent.until(TENANT, "deploy-1", Status::Succeeded, T).await;
    let pending: Vec<_> = events
        .iter()
        .filter(|e| e.status == Status::Pending)
        .collect();
    assert_eq!(pending.len(), 1, "one pending answer: {events:?}");
    assert_eq!(pending[0].uncertainty, Some(Uncertainty::InProgress));
    let operation = pending[0].remote_id.clone().expect("the operation id");
    assert!(operation.starts_with("op-"), "{operation}");
    assert!(
        pending[0].message.contains("accepted"),
        "{}",
        pending[0].message
    );
    let done = events.last().unwrap();
    assert_eq!(done.verified_by, Some(VerifiedBy::Poll), "{done:?}");
    let receipt = done.receipt.as_ref().expect("the final status document");
    assert_eq!(receipt["state"], "succeeded");
    assert_eq!(receipt["operation_id"], operation.as_str());
    assert_eq!(done.remote_id.as_deref(), receipt["deployment_id"].as_str());

    // One write, one job; polls only read.
    assert_eq!(env.writes(&key("deploy-1")).await, 1);
    assert_eq!(env.async_jobs(&key("deploy-1")).await, 1);
    assert!(env.status_reads(&key("deploy-1")).await >= 1);
    // The status API tells the same.
    let status: serde_json::Value = e2e::http()
        .get(format!(
            "http://127.0.0.1:{}/v1/operations/{TENANT}/deploy-1",
            w.admin_port.unwrap()
        ))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["status"], "succeeded", "{status}");
    assert_eq!(status["verified_by"], "poll", "{status}");
    assert_eq!(
        status["operation"]["remote_id"],
        operation.as_str(),
        "{status}"
    );
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn a_job_the_downstream_reports_failed_fails_with_its_status_as_evidence() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = async_tools(&env, ds.port, 200, 1_000, 60);
    let w = Worker::start(&env, "w", &WorkerOptions::new(tools)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    for fault in [
        json!({"kind": "async_fail", "key": key("deploy-2")}),
        json!({"kind": "async_delay", "key": key("deploy-2"), "ms": 800}),
    ] {
        ds.fault(fault).await;
    }
    agent
        .request(TENANT, "deploy-2", "deploy", json!({"service": "api"}))
        .await;
    let events = agent.until(TENANT, "deploy-2", Status::Failed, T).await;
    let failed = events.last().unwrap();
    assert_eq!(failed.verified_by, Some(VerifiedBy::Poll));
    assert!(
        failed.message.contains("health checks did not pass"),
        "{}",
        failed.message
    );
    assert_eq!(env.writes(&key("deploy-2")).await, 1);
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn a_stuck_job_is_held_at_its_deadline_and_a_recheck_polls_again() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = async_tools(&env, ds.port, 200, 500, 3);
    let w = Worker::start(&env, "w", &WorkerOptions::new(tools).with_admin(ADMIN)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    ds.fault(json!({"kind": "async_stuck", "key": key("deploy-3")}))
        .await;
    agent
        .request(TENANT, "deploy-3", "deploy", json!({"service": "api"}))
        .await;
    let first = agent.until(TENANT, "deploy-3", Status::Pending, T).await;
    assert_eq!(
        first.last().unwrap().uncertainty,
        Some(Uncertainty::InProgress)
    );
    e2e::wait_for("deploy-3 held at its deadline", T, || async {
        (env.state(TENANT, "deploy-3").await == "held").then_some(())
    })
    .await;
    let row = env.operation(TENANT, "deploy-3").await.unwrap();
    let evidence = row.evidence.unwrap_or_default();
    assert!(evidence.starts_with("async_deadline"), "{evidence}");
    let polls = env.status_reads(&key("deploy-3")).await;
    assert!((2..=12).contains(&polls), "{polls} polls in 3 s");
    assert_eq!(env.writes(&key("deploy-3")).await, 1);

    // The status API answers pending, held.
    let admin = format!("http://127.0.0.1:{}", w.admin_port.unwrap());
    let status: serde_json::Value = e2e::http()
        .get(format!("{admin}/v1/operations/{TENANT}/deploy-3"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["status"], "pending", "{status}");
    assert_eq!(status["uncertainty"], "held", "{status}");

    // An operator's recheck polls again (the job is still stuck: held again at the new
    // deadline), and never writes.
    let r = e2e::http()
        .post(format!("{admin}/v1/operations/{TENANT}/deploy-3/recheck"))
        .bearer_auth(ADMIN)
        .json(&json!({"operator": "alice", "reason": "is it done now?", "request_id": "rc-1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    assert!(env.status_reads(&key("deploy-3")).await > polls);
    assert_eq!(env.writes(&key("deploy-3")).await, 1);
    drop(w);
    cleanup(env).await;
}

/// A recheck answers with the row after the round it asked for, even when another worker's
/// scheduler leased the row first: the response waits for that round instead of showing the row
/// mid-poll. Worker `a` serves the recheck with one in-flight slot, held by a slow write, so its
/// own round cannot start before worker `b`'s scheduler (consuming nothing) leases the row and
/// polls it slowly; the job was done, so the round's outcome is `succeeded`.
#[tokio::test]
async fn a_recheck_whose_round_another_worker_runs_answers_after_that_round() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    // Polls a minute apart: only the recheck makes the row due.
    let tools = async_tools(&env, ds.port, 60_000, 60_000, 3_600);
    let a = Worker::start(
        &env,
        "a",
        &WorkerOptions::new(tools.clone())
            .with_admin(ADMIN)
            .env("WORKER_MAX_IN_FLIGHT", "1"),
    )
    .await;
    let agent = Agent::new(&env, &[TENANT]).await;
    ds.fault(json!({"kind": "async_delay", "key": key("deploy-9"), "ms": 100}))
        .await;
    agent
        .request(TENANT, "deploy-9", "deploy", json!({"service": "api"}))
        .await;
    e2e::wait_for("deploy-9 accepted", T, || async {
        (env.state(TENANT, "deploy-9").await == "accepted").then_some(())
    })
    .await;
    // Worker b runs a scheduler on the same ledger but consumes from an exchange no one uses.
    let idle_exchange = format!("{}.idle", env.topology.intents_exchange);
    let idle_queue = format!("{}.idle", env.topology.intents_queue);
    let mut b_opts = WorkerOptions::new(tools)
        .env("INTENTS_EXCHANGE", &idle_exchange)
        .env("WORKER_INTENTS_QUEUE", &idle_queue);
    b_opts.recovery_interval_ms = 50;
    let b = Worker::start(&env, "b", &b_opts).await;

    // A write slow enough to hold a's only slot across the recheck.
    ds.fault(json!({"kind": "slow", "key": key("deploy-10"), "ms": 1_000}))
        .await;
    agent
        .request(TENANT, "deploy-10", "deploy", json!({"service": "web"}))
        .await;
    e2e::wait_for("deploy-10's write in flight", T, || async {
        (env.writes(&key("deploy-10")).await >= 1).then_some(())
    })
    .await;
    // b's poll outlasts the rest of that write.
    ds.fault(json!({"kind": "status_slow", "key": key("deploy-9"), "ms": 1_800}))
        .await;
    let r = e2e::http()
        .post(format!(
            "http://127.0.0.1:{}/v1/operations/{TENANT}/deploy-9/recheck",
            a.admin_port.unwrap()
        ))
        .bearer_auth(ADMIN)
        .json(&json!({"operator": "alice", "reason": "done yet?", "request_id": "rc-9"}))
        .send()
        .await
        .unwrap();
    let status = r.status();
    let row: serde_json::Value = r.json().await.unwrap();
    let reads = env.status_reads(&key("deploy-9")).await;
    let writes = env.writes(&key("deploy-9")).await;
    // The idle exchange and queue are the test's own: removed before any assertion can fail.
    drop((a, b));
    let conn = lapin::Connection::connect(&env.amqp_url, Default::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.queue_delete(idle_queue.as_str().into(), Default::default())
        .await
        .unwrap();
    ch.exchange_delete(idle_exchange.as_str().into(), Default::default())
        .await
        .unwrap();
    let _ = conn.close(200, "".into()).await;
    cleanup(env).await;
    assert_eq!(status, 200, "{row}");
    assert_eq!(row["state"], "succeeded", "{row}");
    assert!(row["lease_owner"].is_null(), "{row}");
    assert_eq!(
        (reads, writes),
        (1, 1),
        "status reads and writes of deploy-9"
    );
}

#[tokio::test]
async fn status_reads_that_prove_nothing_are_polled_through() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = async_tools(&env, ds.port, 150, 400, 60);
    let w = Worker::start(&env, "w", &WorkerOptions::new(tools)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    for fault in [
        json!({"kind": "async_delay", "key": key("deploy-4"), "ms": 3500}),
        json!({"kind": "status_not_found", "key": key("deploy-4"), "ms": 2500}),
        json!({"kind": "status_error", "key": key("deploy-4"), "count": 2}),
    ] {
        ds.fault(fault).await;
    }
    agent
        .request(TENANT, "deploy-4", "deploy", json!({"service": "api"}))
        .await;
    let done = agent.until(TENANT, "deploy-4", Status::Succeeded, T).await;
    assert_eq!(done.last().unwrap().verified_by, Some(VerifiedBy::Poll));
    let evidence: Vec<String> = sqlx::query_scalar(
        "SELECT coalesce(h.evidence, '') FROM operation_history h
         JOIN operations o ON o.id = h.operation_id WHERE o.action_id = 'deploy-4' ORDER BY h.id",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let evidence = evidence.join("\n");
    assert!(evidence.contains("HTTP 404"), "{evidence}");
    assert!(evidence.contains("HTTP 503"), "{evidence}");
    assert_eq!(env.writes(&key("deploy-4")).await, 1);
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn a_lost_acceptance_is_replayed_under_the_same_key_and_polled() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = async_tools(&env, ds.port, 200, 1_000, 60);
    let w = Worker::start(&env, "w", &WorkerOptions::new(tools)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    for fault in [
        json!({"kind": "drop_after_commit", "key": key("deploy-5")}),
        json!({"kind": "async_delay", "key": key("deploy-5"), "ms": 1000}),
    ] {
        ds.fault(fault).await;
    }
    agent
        .request(TENANT, "deploy-5", "deploy", json!({"service": "api"}))
        .await;
    let events = agent.until(TENANT, "deploy-5", Status::Succeeded, T).await;
    assert_eq!(events.last().unwrap().verified_by, Some(VerifiedBy::Poll));
    // The replay found the same job: one job, the replay answered with its id.
    assert_eq!(env.async_jobs(&key("deploy-5")).await, 1);
    assert_eq!(
        env.writes(&key("deploy-5")).await,
        2,
        "the write and its replay"
    );
    let row = env.operation(TENANT, "deploy-5").await.unwrap();
    assert_eq!(row.state, "succeeded");
    drop(w);
    cleanup(env).await;
}

/// SIGKILL right after the acceptance was committed, and in the middle of a poll: a new worker
/// resumes polling and the write is never sent again.
#[tokio::test]
async fn a_worker_killed_after_the_acceptance_or_during_a_poll_never_writes_again() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = async_tools(&env, ds.port, 200, 500, 60);
    for (point, id) in [("after_accepted", "deploy-6"), ("after_poll", "deploy-7")] {
        ds.fault(json!({"kind": "async_delay", "key": key(id), "ms": 1500}))
            .await;
        let opts = WorkerOptions::new(tools.clone()).fault(point, Some(id));
        let mut w = Worker::start(&env, &format!("w-{id}"), &opts).await;
        let agent = Agent::new(&env, &[TENANT]).await;
        agent
            .request(TENANT, id, "deploy", json!({"service": "api"}))
            .await;
        w.wait_output("fault point reached", T).await;
        w.kill();
        let w2 = Worker::start(
            &env,
            &format!("w2-{id}"),
            &WorkerOptions::new(tools.clone()),
        )
        .await;
        assert_eq!(
            env.final_state(TENANT, id, T).await,
            "succeeded",
            "{point}: resumed"
        );
        assert_eq!(env.writes(&key(id)).await, 1, "{point}: one write");
        assert_eq!(env.async_jobs(&key(id)).await, 1, "{point}: one job");
        drop(w2);
        drop(agent);
    }
    cleanup(env).await;
}

/// SIGKILL just before a poll's status read: the row was leased for the poll (fence + 1) and
/// nothing was read yet. The lease runs out, a new worker polls again and the write is never
/// sent again.
#[tokio::test]
async fn a_worker_killed_before_a_poll_resumes_polling_and_never_writes_again() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = async_tools(&env, ds.port, 200, 500, 60);
    let id = "deploy-8";
    ds.fault(json!({"kind": "async_delay", "key": key(id), "ms": 1500}))
        .await;
    let opts = WorkerOptions::new(tools.clone()).fault("before_poll", Some(id));
    let mut w = Worker::start(&env, "w-before-poll", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, id, "deploy", json!({"service": "api"}))
        .await;
    w.wait_output("fault point reached: before_poll", T).await;
    // Stopped before the read: the downstream saw the write and no poll.
    assert_eq!(env.status_reads(&key(id)).await, 0);
    assert_eq!(env.state(TENANT, id).await, "accepted");
    w.kill();
    let w2 = Worker::start(&env, "w2-before-poll", &WorkerOptions::new(tools)).await;
    let events = agent.until(TENANT, id, Status::Succeeded, T).await;
    assert_eq!(events.last().unwrap().verified_by, Some(VerifiedBy::Poll));
    assert_eq!(env.writes(&key(id)).await, 1, "one write");
    assert_eq!(env.async_jobs(&key(id)).await, 1, "one job");
    assert!(env.status_reads(&key(id)).await >= 1);
    drop(w2);
    cleanup(env).await;
}

/// A status document about another operation proves nothing about this one, whatever it says:
/// the reference downstream answers two polls with another operation's failure (its own id,
/// another key) while this job still runs. The row stays accepted and succeeds by its own
/// document. An acceptance that echoes another key is no acceptance of this write either: the
/// outcome is unknown, and the replay finds the real job.
#[tokio::test]
async fn another_operations_status_never_settles_this_one() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = async_tools(&env, ds.port, 150, 400, 60);
    let w = Worker::start(&env, "w", &WorkerOptions::new(tools)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    for fault in [
        json!({"kind": "async_delay", "key": key("deploy-w1"), "ms": 2500}),
        json!({"kind": "wrong_receipt", "on": "status", "key": key("deploy-w1"),
               "state": "failed", "times": 2}),
        json!({"kind": "wrong_receipt", "key": key("deploy-w2")}),
        json!({"kind": "async_delay", "key": key("deploy-w2"), "ms": 500}),
    ] {
        ds.fault(fault).await;
    }
    agent
        .request(TENANT, "deploy-w1", "deploy", json!({"service": "api"}))
        .await;
    agent
        .request(TENANT, "deploy-w2", "deploy", json!({"service": "web"}))
        .await;

    let events = agent.until(TENANT, "deploy-w1", Status::Succeeded, T).await;
    assert!(
        events.iter().all(|e| e.status != Status::Failed),
        "{events:?}"
    );
    let done = events.last().unwrap();
    assert_eq!(done.verified_by, Some(VerifiedBy::Poll), "{done:?}");
    let receipt = done
        .receipt
        .as_ref()
        .expect("its own final status document");
    assert_eq!(receipt["idempotency_key"], key("deploy-w1").as_str());
    let evidence: Vec<String> = sqlx::query_scalar(
        "SELECT coalesce(h.evidence, '') FROM operation_history h
         JOIN operations o ON o.id = h.operation_id WHERE o.action_id = 'deploy-w1' ORDER BY h.id",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let evidence = evidence.join("\n");
    assert!(
        evidence.contains("is for another operation") && evidence.contains("op-wrong-"),
        "{evidence}"
    );
    let foreign: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM downstream.requests
         WHERE kind = 'status' AND idem_key = $1 AND fault = 'wrong_receipt'",
    )
    .bind(key("deploy-w1"))
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(foreign, 2, "both foreign answers were read");

    // Its events went by while the test waited for deploy-w1's: the ledger says it.
    assert_eq!(env.final_state(TENANT, "deploy-w2", T).await, "succeeded");
    let row = env.operation(TENANT, "deploy-w2").await.unwrap();
    assert_eq!(
        row.receipt.unwrap()["idempotency_key"],
        key("deploy-w2").as_str()
    );
    let remote: Option<String> = sqlx::query_scalar(
        "SELECT remote_id FROM operations WHERE tenant = $1 AND action_id = 'deploy-w2'",
    )
    .bind(TENANT)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    let real: String =
        sqlx::query_scalar("SELECT operation_id FROM downstream.async_jobs WHERE idem_key = $1")
            .bind(key("deploy-w2"))
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        remote.as_deref(),
        Some(real.as_str()),
        "the real job is followed"
    );
    assert_eq!(
        env.writes(&key("deploy-w2")).await,
        2,
        "the write and its replay"
    );
    assert_eq!(env.async_jobs(&key("deploy-w2")).await, 1);
    assert_eq!(env.writes(&key("deploy-w1")).await, 1);
    drop(w);
    cleanup(env).await;
}

/// An acceptance naming another operation than the one the row already records is held for a
/// person with both ids (`async_conflict`), never polled. No flow of the worker recovers a row
/// that has an operation id (an accepted row is only polled; a held one rechecked for an async
/// tool goes back to polling), so the earlier acceptance is written into the ledger here, as a
/// row left by an older worker or repaired by hand would have it, while the row waits for the
/// replay of its lost acceptance. The replay names the downstream's real job.
#[tokio::test]
async fn an_acceptance_naming_another_operation_than_the_recorded_one_is_held() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = async_tools(&env, ds.port, 200, 1_000, 60);
    // Recovery waits long enough for the test to record the earlier acceptance.
    let text = std::fs::read_to_string(&tools).unwrap().replace(
        "initial_delay_ms = 100, max_delay_ms = 500",
        "initial_delay_ms = 30000, max_delay_ms = 30000",
    );
    let tools = env.write_tools(&text);
    let w = Worker::start(&env, "w", &WorkerOptions::new(tools)).await;
    let agent = Agent::new(&env, &[TENANT]).await;
    let id = "deploy-c1";
    ds.fault(json!({"kind": "drop_after_commit", "key": key(id)}))
        .await;
    agent
        .request(TENANT, id, "deploy", json!({"service": "api"}))
        .await;
    e2e::wait_for(
        "the lost acceptance to leave the row unknown",
        T,
        || async { (env.state(TENANT, id).await == "unknown").then_some(()) },
    )
    .await;
    let recorded = sqlx::query(
        "UPDATE operations SET remote_id = 'op-earlier', next_attempt_at = now()
         WHERE tenant = $1 AND action_id = $2 AND state = 'unknown' AND lease_owner IS NULL",
    )
    .bind(TENANT)
    .bind(id)
    .execute(&env.pool)
    .await
    .unwrap();
    assert_eq!(recorded.rows_affected(), 1);
    assert_eq!(env.final_state(TENANT, id, T).await, "held");
    let real: String =
        sqlx::query_scalar("SELECT operation_id FROM downstream.async_jobs WHERE idem_key = $1")
            .bind(key(id))
            .fetch_one(&env.pool)
            .await
            .unwrap();
    let row = env.operation(TENANT, id).await.unwrap();
    let evidence = row.evidence.unwrap_or_default();
    assert!(
        evidence.contains(&format!("accepted the write as operation {real}"))
            && evidence.contains("but it was accepted as operation op-earlier before"),
        "{evidence}"
    );
    let remote: Option<String> =
        sqlx::query_scalar("SELECT remote_id FROM operations WHERE tenant = $1 AND action_id = $2")
            .bind(TENANT)
            .bind(id)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        remote.as_deref(),
        Some("op-earlier"),
        "the first id is kept"
    );
    // Never polled: neither operation's status was read.
    assert_eq!(env.status_reads(&key(id)).await, 0);
    assert_eq!(env.writes(&key(id)).await, 2, "the write and its replay");
    assert_eq!(env.async_jobs(&key(id)).await, 1);
    drop(w);
    cleanup(env).await;
}

/// An async tool recovered by lookup (`lookup_url` the downstream's by-key route) whose write
/// answer is lost: the lookup finds the job still running, an acceptance (`verified_by`
/// lookup, the job's operation id), and the row is polled to `succeeded`. One write, one job.
#[tokio::test]
async fn a_lookup_that_finds_the_job_in_progress_accepts_it_and_polls_it_to_success() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let text = std::fs::read_to_string(async_tools(&env, ds.port, 200, 500, 60))
        .unwrap()
        .replace(
            "recovery = \"replay\"\nreplay_window_secs = 3600\n",
            &format!(
                "recovery = \"lookup\"\n\
                 lookup_url = \"http://127.0.0.1:{}/async/deployments/by-key/{{key}}\"\n",
                ds.port
            ),
        );
    assert!(text.contains("recovery = \"lookup\""), "{text}");
    let tools = env.write_tools(&text);
    let w = Worker::start(&env, "w", &WorkerOptions::new(tools)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    let id = "deploy-l1";
    for fault in [
        json!({"kind": "drop_after_commit", "key": key(id)}),
        json!({"kind": "async_delay", "key": key(id), "ms": 4000}),
    ] {
        ds.fault(fault).await;
    }
    agent
        .request(TENANT, id, "deploy", json!({"service": "api"}))
        .await;
    let real: String = e2e::wait_for("the job", T, || async {
        sqlx::query_scalar("SELECT operation_id FROM downstream.async_jobs WHERE idem_key = $1")
            .bind(key(id))
            .fetch_optional(&env.pool)
            .await
            .unwrap()
    })
    .await;
    let (remote, by): (Option<String>, Option<String>) =
        e2e::wait_for("accepted by the lookup", T, || async {
            sqlx::query_as(
                "SELECT remote_id, verified_by FROM operations
                 WHERE tenant = $1 AND action_id = $2 AND state = 'accepted'",
            )
            .bind(TENANT)
            .bind(id)
            .fetch_optional(&env.pool)
            .await
            .unwrap()
        })
        .await;
    assert_eq!(remote.as_deref(), Some(real.as_str()));
    assert_eq!(by.as_deref(), Some("lookup"));
    assert!(env.lookups(&key(id)).await >= 1);
    let events = agent.until(TENANT, id, Status::Succeeded, T).await;
    let done = events.last().unwrap();
    assert_eq!(done.verified_by, Some(VerifiedBy::Poll), "{done:?}");
    let receipt = done.receipt.as_ref().unwrap();
    assert_eq!(receipt["operation_id"], real.as_str());
    assert_eq!(receipt["state"], "succeeded");
    assert_eq!(env.writes(&key(id)).await, 1, "never written again");
    assert_eq!(env.async_jobs(&key(id)).await, 1);
    assert!(env.status_reads(&key(id)).await >= 1);
    drop(w);
    cleanup(env).await;
}

/// Two workers poll the same ledger: each accepted row is polled by one owner at a time, so
/// the downstream sees no more reads than one poller would make.
#[tokio::test]
async fn two_workers_poll_each_operation_one_at_a_time() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = async_tools(&env, ds.port, 400, 400, 60);
    let w1 = Worker::start(&env, "w1", &WorkerOptions::new(tools.clone())).await;
    let w2 = Worker::start(&env, "w2", &WorkerOptions::new(tools)).await;
    let agent = Agent::new(&env, &[TENANT]).await;
    let ids: Vec<String> = (0..10).map(|i| format!("deploy-p{i}")).collect();
    for id in &ids {
        ds.fault(json!({"kind": "async_stuck", "key": key(id)}))
            .await;
        agent
            .request(TENANT, id, "deploy", json!({"service": id}))
            .await;
    }
    e2e::wait_for("every deployment accepted", T, || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM operations WHERE state = 'accepted'")
            .fetch_one(&env.pool)
            .await
            .unwrap();
        (n == 10).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    // At about one poll per 0.2-0.6 s each, a row polled by two owners at once would show
    // reads closer together than the jitter allows.
    for id in &ids {
        let gaps: Vec<Option<f64>> = sqlx::query_scalar(
            "SELECT extract(epoch FROM at - lag(at) OVER (ORDER BY at))::float8
             FROM downstream.requests WHERE kind = 'status' AND idem_key = $1",
        )
        .bind(key(id))
        .fetch_all(&env.pool)
        .await
        .unwrap();
        let gaps: Vec<f64> = gaps.into_iter().flatten().collect();
        assert!(gaps.len() >= 3, "{id}: {gaps:?}");
        assert!(
            gaps.iter().all(|g| *g >= 0.15),
            "{id}: two reads {gaps:?} s apart"
        );
        assert_eq!(env.writes(&key(id)).await, 1);
    }
    drop((w1, w2, agent));
    cleanup(env).await;
}

/// Start-up refuses an async tool that could not work, with exit 2 naming the tool and the key.
#[tokio::test]
async fn an_async_tool_that_could_not_work_stops_start_up() {
    let env = Env::new().await;
    let base = "[tools.deploy]\nurl = \"http://127.0.0.1:9/async/deployments\"\n\
                completion = \"async\"\noperation_id = \"/operation_id\"\n\
                status_url = \"http://127.0.0.1:9/async/operations/{operation_id}\"\n\
                done_match = { \"/state\" = \"succeeded\" }\nreceipt_id = \"/deployment_id\"\n\
                receipt_match = { \"/idempotency_key\" = \"{tenant}:{action_id}\" }\n\
                recovery = \"none\"\n";
    for (broken, says) in [
        (
            base.replace("operation_id = \"/operation_id\"\n", ""),
            "needs operation_id",
        ),
        (
            base.replace(
                "/async/operations/{operation_id}",
                "/async/operations/latest",
            ),
            "status_url must contain {operation_id}",
        ),
        (
            base.replace("done_match = { \"/state\" = \"succeeded\" }\n", ""),
            "needs done_match",
        ),
        (
            base.replace("completion = \"async\"\n", ""),
            "only used with completion = \"async\"",
        ),
    ] {
        let tools = env.write_tools(&broken);
        let out = std::process::Command::new(e2e::procs::bin_dir().join("worker"))
            .arg("run")
            .env_clear()
            .env("DATABASE_URL", &env.db_url)
            .env("WORKER_TOOLS", &tools)
            .env("METRICS_ADDR", "off")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{says}: {err}");
        assert!(
            err.contains("tools.deploy") && err.contains(says),
            "{says}: {err}"
        );
    }
    cleanup(env).await;
}

/// `worker check-tool` probes the async contract: an acceptance with an operation id, a status
/// URL that answers for it, and a repeat of the key that names the same operation.
#[tokio::test]
async fn check_tool_probes_the_async_contract() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = async_tools(&env, ds.port, 200, 1_000, 60);
    let out = std::process::Command::new(e2e::procs::bin_dir().join("worker"))
        .args(["check-tool", "deploy", "--confirm-writes"])
        .env("WORKER_TOOLS", &tools)
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    for probe in ["acceptance", "status-url", "replay-same-operation"] {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("PASS {probe}:"))),
            "{probe}: {text}"
        );
    }
    single_spaced(&text);
    // A synchronous endpoint declared async: its answer is no acceptance.
    let sync_as_async = std::fs::read_to_string(&tools)
        .unwrap()
        .replace("/async/deployments", "/replay/deployments");
    let tools = env.write_tools(&sync_as_async);
    let out = std::process::Command::new(e2e::procs::bin_dir().join("worker"))
        .args(["check-tool", "deploy", "--confirm-writes"])
        .env("WORKER_TOOLS", &tools)
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("FAIL acceptance:"), "{text}");
    single_spaced(&text);
    cleanup(env).await;
}

/// Every probe's verdict line reads as one sentence: no run of spaces (a string literal broken
/// across source lines without a trailing `\` leaves its indentation in the message).
fn single_spaced(report: &str) {
    for line in report.lines() {
        if ["PASS ", "FAIL ", "INFO "]
            .iter()
            .any(|v| line.starts_with(v))
        {
            assert!(!line.contains("  "), "a run of spaces: {line:?}");
        }
    }
}
