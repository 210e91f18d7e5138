//! The ledger through a Postgres failover: workers given both hosts of a primary and its
//! synchronous standby (libpq's multi-host `DATABASE_URL`) keep every intent when the primary is
//! stopped hard mid-feed and the standby promoted; and a worker on one host whose server turns
//! read-only (as a demoted primary, or a standby behind a stale DNS name) leaves its pooled
//! connections at once, says so on `/readyz`, and resumes when the server takes writes again.
//! Counts come from the downstream's own tables and from the ledger on the new primary.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use e2e::pg_failover::{PgPair, PgPairOptions};
use e2e::{cleanup, wait_for, Agent, Downstream, Env, Worker, WorkerOptions};
use serde_json::json;

const T: Duration = Duration::from_secs(90);
const TENANT: &str = "north-shop";
const TOOLS: [&str; 3] = ["refund", "ticket", "deploy"];

/// The standard tools with an 8 s timeout and a 20 s lease: the failover, not a slow machine,
/// is what these tests are about.
fn opts(env: &Env, port: u16, db_url: &str) -> WorkerOptions {
    let mut o = WorkerOptions::new(env.standard_tools_timed(port, 8000, ""))
        .database_url(db_url)
        .with_metrics();
    o.lease_secs = 20;
    o
}

/// `/readyz` of `w`: its status and the ledger host it names.
async fn ledger_host(w: &Worker) -> (u16, Option<String>, String) {
    let (status, body) = w.get("/readyz").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    (status, v["ledger_host"].as_str().map(str::to_owned), body)
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn a_hard_stopped_primary_and_a_promoted_standby_lose_nothing_and_do_nothing_twice() {
    let pair = PgPair::start(PgPairOptions::default()).await;
    let db = pair.create_database("ledger").await;
    let url = pair.multi_host_url(&db, "target_session_attrs=read-write");
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let o = opts(&env, ds.port, &url);
    let w1 = Worker::start(&env, "w1", &o).await;
    let w2 = Worker::start(&env, "w2", &o).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    let (_, host, _) = ledger_host(&w1).await;
    assert_eq!(
        host,
        Some(format!("127.0.0.1:{}", pair.port(0))),
        "starts on the primary"
    );

    // A steady feed over all three capabilities, with the failover in the middle of it.
    let n = 90;
    let ids: Vec<String> = (0..n).map(|i| format!("fo-{i}")).collect();
    let mut promoted_at = None;
    for (i, id) in ids.iter().enumerate() {
        agent
            .request(TENANT, id, TOOLS[i % 3], json!({"order": i}))
            .await;
        tokio::time::sleep(Duration::from_millis(40)).await;
        if i == n / 3 {
            pair.stop_hard(0).await;
            pair.promote(1).await;
            promoted_at = Some(Instant::now());
        }
    }
    let promoted_at = promoted_at.unwrap();
    let new_host = format!("127.0.0.1:{}", pair.port(1));
    let resumed = wait_for("both workers ready on the new primary", T, || async {
        for w in [&w1, &w2] {
            let (status, host, _) = ledger_host(w).await;
            if status != 200 || host.as_deref() != Some(new_host.as_str()) {
                return None;
            }
        }
        Some(promoted_at.elapsed())
    })
    .await;

    let mut finals: BTreeMap<String, protocol::Status> = BTreeMap::new();
    let deadline = Instant::now() + T;
    while finals.len() < n && Instant::now() < deadline {
        if let Some(ev) = agent.try_next(TENANT, Duration::from_secs(5)).await {
            if ev.status != protocol::Status::Pending {
                finals.insert(ev.action_id.clone(), ev.status);
            }
        }
    }
    eprintln!(
        "failover: ready on the new primary {resumed:?} after promotion; {} of {n} answered",
        finals.len()
    );
    let not_succeeded: Vec<_> = finals
        .iter()
        .filter(|(_, s)| **s != protocol::Status::Succeeded)
        .collect();
    assert!(
        not_succeeded.is_empty(),
        "0 false failure: {not_succeeded:?}"
    );
    assert_eq!(finals.len(), n, "0 lost final answers");
    for id in &ids {
        assert_eq!(
            env.mutations(&format!("{TENANT}:{id}")).await,
            1,
            "one mutation for {id}"
        );
    }
    let rows = pair
        .psql_db(
            1,
            &db,
            "SELECT count(*) FILTER (WHERE state = 'succeeded') || '/' || count(*) FROM operations",
        )
        .await;
    assert_eq!(
        rows,
        format!("{n}/{n}"),
        "every intent has its row on the new primary"
    );
    let followed = metric(
        &w1.get("/metrics").await.1,
        "intent_worker_ledger_failovers_total",
    ) + metric(
        &w2.get("/metrics").await.1,
        "intent_worker_ledger_failovers_total",
    );
    assert!(followed >= 1.0, "the failover is counted");
    assert!(
        resumed < Duration::from_secs(15),
        "writes resume within 15 s of promotion: {resumed:?}"
    );
    drop((w1, w2));
    cleanup(env).await;
}

#[tokio::test]
async fn a_server_that_turns_read_only_is_left_at_once_and_rejoined_when_it_takes_writes() {
    let pair = PgPair::start(PgPairOptions {
        sync: false,
        ..Default::default()
    })
    .await;
    let db = pair.create_database("ledger").await;
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let w = Worker::start(&env, "w", &opts(&env, ds.port, &pair.url(0, &db))).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "ro-0", "ticket", json!({"n": 0}))
        .await;
    agent.succeeded(TENANT, "ro-0").await;

    // The server refuses writes from now on, in the sessions the worker already holds too.
    pair.psql(0, "ALTER SYSTEM SET default_transaction_read_only = on")
        .await;
    pair.psql(0, "SELECT pg_reload_conf()").await;
    let body = wait_for("readyz 503 naming a read-only ledger", T, || async {
        let (status, _, body) = ledger_host(&w).await;
        (status == 503 && body.contains("read-only")).then_some(body)
    })
    .await;
    assert!(
        body.contains(&pair.port(0).to_string()),
        "names the host: {body}"
    );
    agent
        .request(TENANT, "ro-1", "ticket", json!({"n": 1}))
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    pair.psql(0, "ALTER SYSTEM RESET default_transaction_read_only")
        .await;
    pair.psql(0, "SELECT pg_reload_conf()").await;
    agent.succeeded(TENANT, "ro-1").await;
    assert_eq!(env.mutations(&format!("{TENANT}:ro-1")).await, 1);
    wait_for("ready again", T, || async {
        (ledger_host(&w).await.0 == 200).then_some(())
    })
    .await;
    drop(w);
    cleanup(env).await;
}

/// What asynchronous replication loses, measured: the standby falls behind (the primary's WAL
/// sender is stopped, as a slow network or a busy standby would leave it), the workers keep acking intents
/// and writing downstream, the primary dies and the standby is promoted. Every intent acked in
/// the gap is gone from the new primary's ledger, and the downstream holds writes the ledger has
/// no record of. With synchronous replication the same gap stalls commits instead (nothing is
/// acked or sent that the standby does not have): the first test of this file.
#[tokio::test]
async fn asynchronous_replication_loses_acked_intents_and_this_measures_how_many() {
    let pair = PgPair::start(PgPairOptions {
        sync: false,
        ..Default::default()
    })
    .await;
    let db = pair.create_database("ledger").await;
    let url = pair.multi_host_url(&db, "target_session_attrs=read-write");
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let w = Worker::start(&env, "w", &opts(&env, ds.port, &url)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    agent
        .request(TENANT, "async-0", "refund", json!({"n": 0}))
        .await;
    agent.succeeded(TENANT, "async-0").await;

    // The sender, not the receiver: WAL already sent would wait in the receiver's socket
    // buffer and arrive after all.
    let sender = pair.psql(0, "SELECT pid FROM pg_stat_replication").await;
    let sender = sender.trim().to_string();
    assert!(!sender.is_empty(), "the standby streams");
    let signal = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([&format!("-{sig}"), &sender])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} {sender}");
    };
    signal("STOP");
    let gap = 20;
    for i in 1..=gap {
        let id = format!("async-{i}");
        agent.request(TENANT, &id, "refund", json!({"n": i})).await;
        agent.succeeded(TENANT, &id).await;
    }
    signal("KILL");
    pair.stop_hard(0).await;
    pair.promote(1).await;

    let mut vanished = 0;
    let mut unrecorded_writes = 0;
    for i in 1..=gap {
        let id = format!("async-{i}");
        let rows = pair
            .psql_db(
                1,
                &db,
                &format!("SELECT count(*) FROM operations WHERE action_id = '{id}'"),
            )
            .await;
        if rows == "0" {
            vanished += 1;
            if env.mutations(&format!("{TENANT}:{id}")).await == 1 {
                unrecorded_writes += 1;
            }
        }
    }
    eprintln!(
        "asynchronous replication, standby behind by {gap} acked intents: {vanished} of them \
         vanished from the ledger, {unrecorded_writes} downstream writes have no record"
    );
    assert!(
        vanished > 0,
        "a standby that had not received them cannot have them"
    );
    drop(w);
    cleanup(env).await;
}

/// The agent side through the same failover: `publisher relay` given both hosts of the agent
/// database (`PUBLISHER_DATABASE_URL`) keeps publishing outbox rows when the primary is stopped
/// hard and the standby promoted, rows enqueued before and after alike; each is carried out
/// once downstream and its row is marked sent on the new primary.
#[tokio::test]
async fn the_outbox_relay_follows_the_agent_databases_primary() {
    use publisher::Outbox;
    use sqlx::Connection as _;

    let pair = PgPair::start(PgPairOptions::default()).await;
    let db = pair.create_database("agent").await;
    let url = pair.multi_host_url(&db, "target_session_attrs=read-write");
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let w = Worker::start(&env, "w", &opts(&env, ds.port, &env.db_url)).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    let pool = sqlx::PgPool::connect(&pair.url(0, &db)).await.unwrap();
    Outbox::migrate(&pool).await.unwrap();
    pool.close().await;
    let enqueue = |node: usize, id: String, tool: &'static str| {
        let url = pair.url(node, &db);
        async move {
            let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
            let mut tx = conn.begin().await.unwrap();
            let intent = e2e::intent(TENANT, &id, tool, json!({"id": id}));
            Outbox::enqueue(&mut tx, &intent).await.unwrap();
            tx.commit().await.unwrap();
        }
    };
    let relay = e2e::procs::RelayProc::spawn(
        &env,
        "relay",
        &[
            ("PUBLISHER_DATABASE_URL", url.as_str()),
            ("PUBLISHER_LEASE", "3s"),
            ("PUBLISHER_IDLE_POLL", "50ms"),
        ],
    );

    let n = 30;
    let ids: Vec<String> = (0..n).map(|i| format!("relay-fo-{i}")).collect();
    for (i, id) in ids[..n / 2].iter().enumerate() {
        enqueue(0, id.clone(), TOOLS[i % 3]).await;
    }
    // The relay is publishing (a first answer came back) when the primary dies.
    let mut finals = BTreeMap::new();
    let deadline = Instant::now() + T;
    let mut failed_over = None;
    while finals.len() < n && Instant::now() < deadline {
        if failed_over.is_none() && !finals.is_empty() {
            pair.stop_hard(0).await;
            pair.promote(1).await;
            failed_over = Some(Instant::now());
            for (i, id) in ids.iter().enumerate().skip(n / 2) {
                enqueue(1, id.clone(), TOOLS[i % 3]).await;
            }
        }
        if let Some(ev) = agent.try_next(TENANT, Duration::from_secs(5)).await {
            if ev.status != protocol::Status::Pending {
                finals.insert(ev.action_id.clone(), ev.status);
            }
        }
    }
    let answered_after = failed_over.map(|t| t.elapsed());
    assert!(failed_over.is_some(), "no first answer before the failover");
    let missing: Vec<_> = ids.iter().filter(|id| !finals.contains_key(*id)).collect();
    assert!(
        missing.is_empty(),
        "every outbox row reaches the worker; unanswered: {missing:?}\nrelay log:\n{}",
        relay.output()
    );
    assert!(
        finals.values().all(|s| *s == protocol::Status::Succeeded),
        "{finals:?}"
    );
    for id in &ids {
        assert_eq!(
            env.mutations(&format!("{TENANT}:{id}")).await,
            1,
            "one mutation for {id}"
        );
    }
    // The relay keeps running until then: a row it published on the old primary whose mark the
    // failover lost is published again once its lease has passed (the worker answers the repeat
    // from the ledger, so the agent may have every answer before that).
    let unsent = wait_for("every row marked sent on the new primary", T, || async {
        let unsent = pair
            .psql_db(
                1,
                &db,
                "SELECT count(*) FROM intent_outbox WHERE sent_at IS NULL",
            )
            .await;
        (unsent == "0").then_some(unsent)
    })
    .await;
    assert_eq!(unsent, "0");
    let output = relay.output();
    drop(relay);
    assert!(
        output.contains("primary moved"),
        "the relay says where it went:\n{output}"
    );
    eprintln!(
        "relay through a failover: {n} of {n} answered, the last {:?} after promotion",
        answered_after
    );
    drop(w);
    cleanup(env).await;
}
