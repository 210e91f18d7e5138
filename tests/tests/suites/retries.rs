//! Retries at one layer. Spacing is measured from the ledger's stored schedule
//! (operation_history.next_attempt_at), request counts from the downstream's tables.

use std::time::Duration;

use chrono::{DateTime, Utc};
use e2e::{
    cleanup, free_port, intent, metric_value, Agent, Downstream, Env, Worker, WorkerOptions,
};
use protocol::Status;
use serde_json::json;

const T: Duration = Duration::from_secs(30);
const TENANT: &str = "north-shop";

fn key(action: &str) -> String {
    format!("{TENANT}:{action}")
}

/// A replay tool `refund` at `port` with the given extra settings (timeout 2 s unless they set
/// one: a timeout at or above the lease is refused at start-up).
fn refund_tool(env: &Env, port: u16, settings: &str) -> std::path::PathBuf {
    let timeout = if settings.contains("timeout_ms") {
        ""
    } else {
        "timeout_ms = 2000\n"
    };
    env.write_tools(&format!(
        "[tools.refund]\nurl = \"http://127.0.0.1:{port}/replay/refunds\"\nrecovery = \"replay\"\nreplay_window_secs = 3600\n\
         receipt_id = \"/receipt_id\"\nreceipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\n{timeout}{settings}\n"
    ))
}

kit::pg_row! {
    #[derive(Debug)]
    struct Scheduled {
        at: DateTime<Utc>,
        attempts: Option<i32>,
        next_attempt_at: Option<DateTime<Utc>>,
    }
}

async fn retry_schedule(env: &Env, action: &str) -> Vec<Scheduled> {
    sqlx::query_as(
        "SELECT h.at, h.attempts, h.next_attempt_at FROM operation_history h
         JOIN operations o ON o.id = h.operation_id
         WHERE o.action_id = $1 AND h.to_state = 'retry_wait' AND h.from_state IS DISTINCT FROM 'retry_wait'
         ORDER BY h.id",
    )
    .bind(action)
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn refused_connections_are_retried_on_the_jittered_schedule_then_succeed_once() {
    let env = Env::new().await;
    let port = free_port();
    let tools = refund_tool(
        &env,
        port,
        "timeout_ms = 2000\nretry = { max_attempts = 8, initial_delay_ms = 300, multiplier = 2.0, max_delay_ms = 5000, jitter = 0.2 }",
    );
    let _w = Worker::start(&env, "w", &WorkerOptions::new(tools)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "refund-c", "refund", json!({"order": "o-c"}))
        .await;
    e2e::wait_for("three refused attempts", T, || async {
        (retry_schedule(&env, "refund-c").await.len() >= 3).then_some(())
    })
    .await;
    let _ds = Downstream::start_at(&env, port).await;
    let done = agent.succeeded(TENANT, "refund-c").await;
    assert!(done.receipt.is_some());
    assert_eq!(env.mutations(&key("refund-c")).await, 1);
    assert_eq!(
        env.writes(&key("refund-c")).await,
        1,
        "refused attempts never reached it"
    );
    let schedule = retry_schedule(&env, "refund-c").await;
    assert!(schedule.len() >= 3);
    for s in &schedule {
        let n = s.attempts.unwrap() as u32;
        let nominal = (300.0 * 2f64.powi(n as i32 - 1)).min(5000.0);
        let delay = (s.next_attempt_at.unwrap() - s.at).num_milliseconds() as f64;
        assert!(
            delay >= nominal * 0.8 - 20.0 && delay <= nominal * 1.2 + 20.0,
            "attempt {n}: scheduled {delay} ms, policy allows {}..{} ms",
            nominal * 0.8,
            nominal * 1.2
        );
    }
    // Each retry ran no earlier than its stored schedule.
    let dispatches: Vec<DateTime<Utc>> = sqlx::query_scalar(
        "SELECT h.at FROM operation_history h JOIN operations o ON o.id = h.operation_id
         WHERE o.action_id = 'refund-c' AND h.to_state = 'dispatching' ORDER BY h.id",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    for (s, d) in schedule.iter().zip(dispatches.iter().skip(1)) {
        assert!(
            *d >= s.next_attempt_at.unwrap(),
            "retry at {d} before its schedule {:?}",
            s.next_attempt_at
        );
    }
    cleanup(env).await;
}

#[tokio::test]
async fn retry_after_is_honoured() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = refund_tool(
        &env,
        ds.port,
        "retry = { initial_delay_ms = 100, max_delay_ms = 10000 }",
    );
    ds.fault(
        json!({"kind": "status", "status": 429, "retry_after": "2", "key": key("refund-429")}),
    )
    .await;
    let _w = Worker::start(&env, "w", &WorkerOptions::new(tools)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "refund-429", "refund", json!({"order": "o-429"}))
        .await;
    agent
        .until(TENANT, "refund-429", Status::Succeeded, T)
        .await;
    let schedule = retry_schedule(&env, "refund-429").await;
    assert_eq!(schedule.len(), 1);
    // Retry-After counts from the answer: measured from when the downstream finished writing the
    // 429, not from the history row's clock, which is read later in the recording transaction
    // (the next attempt time is taken from that transaction's start).
    let answered: DateTime<Utc> = sqlx::query_scalar(
        "SELECT replied_at FROM downstream.requests WHERE kind = 'write' AND idem_key = $1
         ORDER BY id LIMIT 1",
    )
    .bind(key("refund-429"))
    .fetch_one(&env.pool)
    .await
    .unwrap();
    let scheduled = (schedule[0].next_attempt_at.unwrap() - answered).num_milliseconds();
    assert!(
        scheduled >= 1990,
        "Retry-After: 2 scheduled only {scheduled} ms after the answer"
    );
    let ats: Vec<DateTime<Utc>> = sqlx::query_scalar(
        "SELECT at FROM downstream.requests WHERE kind = 'write' AND idem_key = $1 ORDER BY id",
    )
    .bind(key("refund-429"))
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(ats.len(), 2);
    assert!(
        (ats[1] - ats[0]).num_milliseconds() >= 1990,
        "second attempt came too early: {ats:?}"
    );
    cleanup(env).await;
}

#[tokio::test]
async fn always_not_applied_makes_exactly_max_attempts_then_fails_with_evidence() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = refund_tool(
        &env,
        ds.port,
        "retry = { max_attempts = 3, initial_delay_ms = 100, max_delay_ms = 400 }",
    );
    ds.fault(json!({"kind": "status", "status": 429, "times": 100, "key": key("refund-n")}))
        .await;
    let _w = Worker::start(&env, "w", &WorkerOptions::new(tools)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "refund-n", "refund", json!({"order": "o-n"}))
        .await;
    let events = agent.until(TENANT, "refund-n", Status::Failed, T).await;
    assert_eq!(events.first().unwrap().status, Status::Pending);
    let failed = events.last().unwrap();
    assert!(
        failed.message.contains("429"),
        "evidence in the message: {}",
        failed.message
    );
    assert_eq!(failed.receipt, None);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        env.writes(&key("refund-n")).await,
        3,
        "exactly max_attempts write requests"
    );
    assert_eq!(env.mutations(&key("refund-n")).await, 0);
    assert_eq!(env.state(TENANT, "refund-n").await, "failed");
    cleanup(env).await;
}

#[tokio::test]
async fn always_timing_out_after_writing_ends_held_never_failed() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = refund_tool(
        &env,
        ds.port,
        "timeout_ms = 700\nrecovery_attempts = 3\nretry = { max_attempts = 5, initial_delay_ms = 100, max_delay_ms = 400 }",
    );
    ds.fault(json!({"kind": "slow_after_commit", "delay_ms": 2000, "times": 100, "key": key("refund-t")})).await;
    let _w = Worker::start(&env, "w", &WorkerOptions::new(tools)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "refund-t", "refund", json!({"order": "o-t"}))
        .await;
    assert_eq!(env.final_state(TENANT, "refund-t", T).await, "held");
    let events = agent.until(TENANT, "refund-t", Status::Pending, T).await;
    assert!(events.iter().all(|e| e.status == Status::Pending));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let writes = env.writes(&key("refund-t")).await;
    assert!(
        writes <= 1 + 3,
        "at most the first send plus the recovery attempts: {writes}"
    );
    assert_eq!(env.mutations(&key("refund-t")).await, 1);
    assert_eq!(env.state(TENANT, "refund-t").await, "held", "never failed");
    cleanup(env).await;
}

#[tokio::test]
async fn amplification_is_bounded_even_with_workers_killed_mid_flight() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let (max_attempts, recovery_attempts) = (3, 3);
    let tools = refund_tool(
        &env,
        ds.port,
        &format!(
            "recovery_attempts = {recovery_attempts}\nretry = {{ max_attempts = {max_attempts}, initial_delay_ms = 100, max_delay_ms = 300 }}\nbudget = {{ ratio = 1.0, floor_per_minute = 6000 }}"
        ),
    );
    ds.fault(json!({"kind": "status", "status": 429, "times": 100000}))
        .await;
    // Lease 3 s (the default): above the 2 s tool timeout, as start-up requires.
    let opts = WorkerOptions::new(tools);
    let agent = Agent::new_after(&env, &[TENANT], &opts).await;
    let actions: Vec<String> = (0..12).map(|i| format!("refund-a{i}")).collect();
    let mut workers = Vec::new();
    for round in 0..3 {
        let mut w = Worker::start(&env, &format!("w{round}"), &opts).await;
        for a in &actions {
            agent
                .request(TENANT, a, "refund", json!({"order": a}))
                .await;
        }
        tokio::time::sleep(Duration::from_millis(250 + 150 * round)).await;
        w.kill();
        workers.push(w);
    }
    let _last = Worker::start(&env, "w-last", &opts).await;
    for a in &actions {
        env.final_state(TENANT, a, T).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    for a in &actions {
        let writes = env.writes(&key(a)).await;
        assert!(writes >= 1, "{a}: it was tried");
        assert!(
            writes <= (max_attempts + recovery_attempts) as i64,
            "{a}: {writes} write requests, policy allows {max_attempts} attempts + {recovery_attempts} recovery replays"
        );
        assert_eq!(env.mutations(&key(a)).await, 0);
    }
    cleanup(env).await;
}

#[tokio::test]
async fn shared_budget_bounds_retries_and_deferred_retries_proceed_after_recovery() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let (ratio, floor_per_window, window) = (0.1, 20, 2);
    let tools = refund_tool(
        &env,
        ds.port,
        &format!(
            "retry = {{ max_attempts = 50, initial_delay_ms = 100, max_delay_ms = 500 }}\n\
             budget = {{ ratio = {ratio}, floor_per_minute = {}, window_secs = {window} }}",
            floor_per_window * 60 / window
        ),
    );
    ds.fault(json!({"kind": "status", "status": 429, "times": 1000000}))
        .await;
    let opts = WorkerOptions::new(tools).with_metrics();
    let w = Worker::start(&env, "w", &opts).await;
    let _w2 = Worker::start(&env, "w2", &WorkerOptions::new(opts.tools.clone())).await;
    let agent = Agent::new(&env, &[TENANT]).await;
    let n = 200;
    for i in 0..n {
        agent
            .send(&intent(
                TENANT,
                &format!("refund-b{i}"),
                "refund",
                json!({"order": i}),
            ))
            .await;
    }
    let started = std::time::Instant::now();
    e2e::wait_for("every first attempt", T, || async {
        let firsts: i64 = sqlx::query_scalar(
            "SELECT count(DISTINCT idem_key) FROM downstream.requests WHERE kind = 'write'",
        )
        .fetch_one(&env.pool)
        .await
        .unwrap();
        (firsts == n).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5).saturating_sub(started.elapsed())).await;
    // Over the failing phase, retries seen by the downstream stay within ratio x first attempts
    // plus the floor of every budget window the phase spans (one extra window for the skew
    // between the worker's budget clock and arrival at the downstream).
    let (firsts, writes, phase_ms): (i64, i64, f64) = sqlx::query_as(
        "SELECT count(DISTINCT idem_key), count(*),
                (extract(epoch FROM max(at) - min(at)) * 1000)::float8
         FROM downstream.requests WHERE kind = 'write'",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    let retries = writes - firsts;
    let windows = (phase_ms / 1000.0 / window as f64).ceil() as i64 + 1;
    let allowed = (ratio * firsts as f64).floor() as i64 + floor_per_window * windows;
    assert_eq!(firsts, n, "every operation was tried once");
    assert!(retries > 0, "some retries ran");
    assert!(
        retries <= allowed,
        "{retries} retries over {phase_ms} ms with {firsts} first attempts (allowed {allowed})"
    );
    let deferred = metric_value(
        &w.metrics().await,
        "intent_worker_retry_budget_deferrals_total",
        &[],
    );
    assert!(deferred > 0.0, "the budget deferred retries");
    // The downstream recovers: every deferred retry proceeds and every operation ends definite.
    e2e::http()
        .delete(format!("http://127.0.0.1:{}/_control/faults", ds.port))
        .send()
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM operations WHERE state NOT IN ('succeeded', 'failed', 'held')",
        )
        .fetch_one(&env.pool)
        .await
        .unwrap();
        if open == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{open} operations still unresolved"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let succeeded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM operations WHERE state = 'succeeded'")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        succeeded, n,
        "nothing was dropped or failed because of the budget"
    );
    let mutations: i64 = sqlx::query_scalar("SELECT count(*) FROM downstream.mutations")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(mutations, n);
    cleanup(env).await;
}

#[tokio::test]
async fn a_poison_message_ends_in_the_dead_letter_queue_and_the_others_are_served() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions {
        delivery_limit: 3,
        ..WorkerOptions::new(env.standard_tools(ds.port, ""))
    }
    .fault("crash_on_intake", Some("poison-1"));
    let mut agent = Agent::new_after(&env, &[TENANT], &opts).await;
    agent
        .request(TENANT, "poison-1", "refund", json!({"order": "p"}))
        .await;
    for i in 0..5 {
        agent
            .send(&intent(
                TENANT,
                &format!("good-{i}"),
                "refund",
                json!({"order": i}),
            ))
            .await;
    }
    // A supervisor: restart the worker whenever the poison message kills it.
    let mut crashes = 0;
    let mut dead = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut w = Worker::spawn(&env, &format!("w{crashes}"), &opts);
    loop {
        if !w.is_running() {
            crashes += 1;
            assert!(crashes <= 10, "the poison message was never set aside");
            w = Worker::spawn(&env, &format!("w{crashes}"), &opts);
        }
        dead.extend(agent.drain_dead_letters(&env).await);
        let mut good = 0;
        for i in 0..5 {
            if env.state(TENANT, &format!("good-{i}")).await == "succeeded" {
                good += 1;
            }
        }
        if good == 5 && !dead.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "crashes={crashes} good={good} dead={}",
            dead.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(crashes >= 1, "the fault point really crashed the worker");
    assert_eq!(dead.len(), 1);
    assert!(String::from_utf8_lossy(&dead[0].delivery.data).contains("poison-1"));
    assert_eq!(
        env.state(TENANT, "poison-1").await,
        "",
        "never recorded, never dispatched"
    );
    assert_eq!(env.writes(&key("poison-1")).await, 0);
    let mut served = std::collections::BTreeSet::new();
    while served.len() < 5 {
        let ev = agent.next(TENANT, T).await;
        assert_ne!(
            ev.action_id, "poison-1",
            "the poison message never produced a result"
        );
        if ev.status == Status::Succeeded {
            served.insert(ev.action_id);
        }
    }
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn budget_with_the_issue_syntax_and_defaults_holds_during_an_outage() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    // Exactly the issue's syntax; window_secs keeps its default (60 s).
    let tools = refund_tool(
        &env,
        ds.port,
        "retry = { max_attempts = 20, initial_delay_ms = 100, max_delay_ms = 1000 }\nbudget = { ratio = 0.1, floor_per_minute = 10 }",
    );
    ds.fault(json!({"kind": "status", "status": 429, "times": 1000000}))
        .await;
    let w = Worker::start(&env, "w", &WorkerOptions::new(tools).with_metrics()).await;
    let agent = Agent::new(&env, &[TENANT]).await;
    let n = 200;
    for i in 0..n {
        agent
            .request(
                TENANT,
                &format!("refund-d{i}"),
                "refund",
                json!({"order": i}),
            )
            .await;
    }
    let started = std::time::Instant::now();
    e2e::wait_for("every first attempt", T, || async {
        let firsts: i64 = sqlx::query_scalar(
            "SELECT count(DISTINCT idem_key) FROM downstream.requests WHERE kind = 'write'",
        )
        .fetch_one(&env.pool)
        .await
        .unwrap();
        (firsts == n).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5).saturating_sub(started.elapsed())).await;
    let (firsts, writes, phase_secs): (i64, i64, f64) = sqlx::query_as(
        "SELECT count(DISTINCT idem_key), count(*), extract(epoch FROM max(at) - min(at))::float8
         FROM downstream.requests WHERE kind = 'write'",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(firsts, n);
    // The bucket holds 2 x 10 x 60 / 60 = 20 tokens and retries only above 10; every failed
    // attempt costs one and nothing succeeds, so at most 10 retries (the part of a full bucket
    // above half, +1 for rounding) plus the refill of 10 per minute over the phase.
    let allowed = 10 + 1 + (10.0 * (phase_secs + 1.0) / 60.0).ceil() as i64;
    assert!(
        writes - firsts <= allowed,
        "{} retries during the outage, budget allows {allowed}",
        writes - firsts
    );
    let deferred = metric_value(
        &w.metrics().await,
        "intent_worker_retry_budget_deferrals_total",
        &[],
    );
    assert!(deferred > 0.0, "the budget deferred retries");
    // Draining after the outage is covered (with a short window) by
    // shared_budget_bounds_retries_and_deferred_retries_proceed_after_recovery and
    // fenced_sends::retries_against_a_half_shedding_downstream_stay_within_the_budget: with
    // the defaults it starts once the time refill lifts the bucket above half (about a minute),
    // and then runs as fast as retries succeed.
    cleanup(env).await;
}

/// A listener whose accept queue is full: the kernel drops every further SYN, so a connect to it
/// neither succeeds nor fails until the client gives up. Returns the port and what holds it.
async fn unanswered_port() -> (u16, Vec<std::net::TcpStream>, tokio::net::TcpListener) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    // Backlog 0: one connection waits to be accepted, then the queue is full.
    let listener = socket.listen(0).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut fillers = Vec::new();
    for _ in 0..8 {
        match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(300)) {
            Ok(s) => fillers.push(s),
            Err(_) => return (addr.port(), fillers, listener),
        }
    }
    panic!("the accept queue of {addr} never filled");
}

#[tokio::test]
async fn a_connect_that_never_completes_is_not_sent_and_its_cause_is_the_connection() {
    connect_never_completes("timeout_ms = 2000\nconnect_timeout_ms = 300", "refund-ct").await;
}

/// With the default connect timeout, which was the whole timeout for a tool whose `timeout_ms` is
/// at most 5 s, the two ended together and the request's won: a connect that never completed
/// was recorded `unknown`. It must be `not sent`, as with a connect timeout of its own.
#[tokio::test]
async fn a_connect_ended_by_the_default_connect_timeout_is_not_sent() {
    connect_never_completes("timeout_ms = 1000", "refund-cd").await;
}

/// A refund whose tool (`timing`: its timeout settings) connects to a port that never completes
/// a connect: its attempt is `not sent`, with evidence naming `connect_timeout` and cause class
/// `connection`, and it is `failed` after its attempts, never held for recovery.
async fn connect_never_completes(timing: &str, action_id: &str) {
    let env = Env::new().await;
    let (port, _fillers, _listener) = unanswered_port().await;
    let tools = refund_tool(
        &env,
        port,
        &format!(
            "{timing}\nretry = {{ max_attempts = 2, initial_delay_ms = 100, max_delay_ms = 200 }}"
        ),
    );
    let _w = Worker::start(&env, "w", &WorkerOptions::new(tools)).await;
    let agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, action_id, "refund", json!({"order": "o-ct"}))
        .await;
    let op = e2e::wait_for("the first attempt's outcome", T, || async {
        env.operation(TENANT, action_id)
            .await
            .filter(|o| o.evidence.as_deref().is_some_and(|e| !e.is_empty()))
    })
    .await;
    let evidence = op.evidence.unwrap();
    assert!(evidence.starts_with("not sent:"), "{evidence}");
    assert!(evidence.contains("connect_timeout"), "{evidence}");
    // A write that was never sent is not a timeout after a write, whatever the words.
    assert_eq!(
        worker::ledger::cause::classify(&op.state, Some(&evidence)),
        "connection",
        "{evidence}"
    );
    // Never sent, so it fails after its attempts rather than being held for recovery.
    assert_eq!(env.final_state(TENANT, action_id, T).await, "failed");
    cleanup(env).await;
}

/// An HTTP proxy in front of the downstream: it records the request line of each connection,
/// passes it on in origin form (`POST /path HTTP/1.1`, as a proxy does) and relays the rest both
/// ways.
async fn recording_proxy(downstream: u16) -> (u16, e2e::recording::Heads) {
    use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _};
    let seen = e2e::recording::Heads::default();
    let lines = seen.clone();
    let port = e2e::recording::listen(move |client| {
        let lines = lines.clone();
        async move {
            let mut client = tokio::io::BufReader::new(client);
            let mut first = String::new();
            if client.read_line(&mut first).await.is_err() {
                return;
            }
            lines.lock().unwrap().push(first.trim_end().to_string());
            let mut upstream = tokio::net::TcpStream::connect(("127.0.0.1", downstream))
                .await
                .unwrap();
            let origin_form = match first.split_once("://") {
                Some((method_and_scheme, rest)) => {
                    let method = method_and_scheme.split(' ').next().unwrap_or_default();
                    let path = rest.find('/').map_or(" / HTTP/1.1\r\n", |at| &rest[at..]);
                    format!("{method} {path}")
                }
                None => first.clone(),
            };
            upstream.write_all(origin_form.as_bytes()).await.unwrap();
            let pending = client.buffer().to_vec();
            upstream.write_all(&pending).await.unwrap();
            let mut client = client.into_inner();
            let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
        }
    })
    .await;
    (port, seen)
}

#[tokio::test]
async fn a_proxy_named_by_the_environment_carries_the_writes() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let (proxy, seen) = recording_proxy(ds.port).await;
    let tools = refund_tool(&env, ds.port, "");
    let opts = WorkerOptions::new(tools).env("HTTP_PROXY", &format!("http://127.0.0.1:{proxy}"));
    let _w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "refund-px", "refund", json!({"order": "o-px"}))
        .await;
    assert!(agent.succeeded(TENANT, "refund-px").await.receipt.is_some());
    assert_eq!(env.mutations(&key("refund-px")).await, 1);
    let seen = seen.lock().unwrap().clone();
    let want = format!("POST http://127.0.0.1:{}/replay/refunds HTTP/1.1", ds.port);
    assert!(seen.contains(&want), "the proxy saw {seen:?}, not {want:?}");
    cleanup(env).await;
}

/// A downstream that answers `200` at once with the first bytes of its body and then holds the
/// rest forever.
async fn stalling_body() -> u16 {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    e2e::recording::listen(|mut s| async move {
        let mut buf = [0u8; 8192];
        let _ = s.read(&mut buf).await;
        let head =
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 200\r\n\r\n";
        let _ = s
            .write_all(format!("{head}{{\"receipt_id\":").as_bytes())
            .await;
        tokio::time::sleep(Duration::from_secs(600)).await;
    })
    .await
}

#[tokio::test]
async fn a_success_whose_body_stalls_past_the_timeout_is_unknown_never_succeeded() {
    let env = Env::new().await;
    let port = stalling_body().await;
    let tools = env.write_tools(&format!(
        "[tools.deploy]\nurl = \"http://127.0.0.1:{port}/deploys\"\nrecovery = \"none\"\n\
         timeout_ms = 800\nreceipt_id = \"/receipt_id\"\n\
         receipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\n"
    ));
    let _w = Worker::start(&env, "w", &WorkerOptions::new(tools)).await;
    let agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "deploy-stall", "deploy", json!({"service": "api"}))
        .await;
    // Sent and answered 200, but no whole answer: it may have been applied, and nothing proves
    // which operation it was. A `none` tool holds it for a person.
    assert_eq!(env.final_state(TENANT, "deploy-stall", T).await, "held");
    let history = env.history(TENANT, "deploy-stall").await;
    let evidence: Vec<&String> = history.iter().filter_map(|(_, e)| e.as_ref()).collect();
    assert!(
        evidence
            .iter()
            .any(|e| e.contains("but the body could not be read") && e.contains("timed out")),
        "{evidence:?}"
    );
    cleanup(env).await;
}
