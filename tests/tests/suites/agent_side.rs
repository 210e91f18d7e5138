//! The agent's side. The transactional outbox and `publisher relay`, waiting for one
//! action's answer (`send_and_wait`, `publisher send --wait`, `publisher wait`), per-agent
//! result routing, and tenant proof from our own publisher. Real RabbitMQ, Postgres, worker
//! and reference downstream; counts come from the downstream's tables and the broker.

use std::collections::BTreeMap;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use e2e::procs::RelayProc;
use e2e::{
    cleanup, intent, metric_value, Agent, BrokerUser, Downstream, Env, Worker, WorkerOptions,
};
use lapin::options::BasicGetOptions;
use protocol::Status;
use publisher::relay::StepReport;
use publisher::wait::Source;
use publisher::{
    AnswerConfig, Follower, Outbox, Publisher, Relay, RelayConfig, StatusApi, WaitError,
};
use serde_json::json;

const T: Duration = Duration::from_secs(20);
const TENANT_TOKEN: &str = "north-shop-token-1";

/// A worker with the status API (tenant token for north-shop) and the reference downstream.
async fn setup(tools_extra: &str) -> (Env, Downstream, Worker) {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = env.standard_tools(ds.port, "");
    if !tools_extra.is_empty() {
        let mut text = std::fs::read_to_string(&tools).unwrap();
        text.push_str(tools_extra);
        std::fs::write(&tools, text).unwrap();
    }
    let opts = WorkerOptions::new(tools)
        .with_admin("admin-token-0123456789")
        .env(
            "WORKER_TENANT_TOKENS",
            &format!("north-shop={TENANT_TOKEN}"),
        );
    let w = Worker::start(&env, "w1", &opts).await;
    (env, ds, w)
}

fn status_url(w: &Worker) -> String {
    format!("http://127.0.0.1:{}", w.admin_port.expect("admin api"))
}

async fn publisher_for(env: &Env) -> Publisher {
    Publisher::connect(&env.amqp_url, &env.topology.intents_exchange)
        .await
        .expect("connect")
}

fn refund(tenant: &str, action_id: &str) -> protocol::Intent {
    let mut i = intent(
        tenant,
        action_id,
        "refund",
        json!({"order": action_id, "amount_cents": 4850, "currency": "USD"}),
    );
    i.reply_to = None;
    i
}

fn relay_config() -> RelayConfig {
    RelayConfig {
        batch: 500,
        lease: Duration::from_secs(2),
        idle_poll: Duration::from_millis(20),
        backoff_initial: Duration::from_secs(30),
        backoff_max: Duration::from_secs(60),
        ..RelayConfig::default()
    }
}

/// Declares the worker's intents exchange and quorum queue, as a worker would at start-up.
async fn declare_worker_topology(env: &Env) {
    let conn = worker::amqp::connect(&env.amqp_url, "e2e-setup")
        .await
        .unwrap();
    worker::amqp::topology::declare(&conn, &env.topology, Default::default())
        .await
        .expect("declare topology");
    let _ = conn.close(200, "".into()).await;
}

/// All messages now in a queue (drained), as (message_id, body).
async fn drain(env: &Env, queue: &str) -> Vec<(String, Vec<u8>)> {
    let conn = lapin::Connection::connect(&env.amqp_url, Default::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let mut out = Vec::new();
    while let Ok(Some(m)) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
    {
        let id = m
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
            .unwrap_or_default();
        out.push((id, m.delivery.data));
    }
    let _ = conn.close(200, "".into()).await;
    out
}

/// Message ids of everything in a queue, consumed until it stays idle for a second.
async fn consume_all(env: &Env, queue: &str) -> Vec<String> {
    use futures_lite::StreamExt;
    let conn = lapin::Connection::connect(&env.amqp_url, Default::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(1000, Default::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "".into(),
            lapin::options::BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await
        .unwrap();
    let mut ids = Vec::new();
    while let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::from_secs(1), consumer.next()).await
    {
        ids.push(
            d.properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default(),
        );
    }
    let _ = conn.close(200, "".into()).await;
    ids
}

kit::pg_row! {
    #[derive(Debug)]
    struct Row {
        attempts: i32,
        last_error: Option<String>,
        sent: bool,
        due_in_secs: f64,
    }
}

async fn outbox_row(env: &Env, id: i64) -> Row {
    sqlx::query_as(
        "SELECT attempts, last_error, sent_at IS NOT NULL AS sent,
                EXTRACT(EPOCH FROM next_attempt_at - now())::float8 AS due_in_secs
         FROM intent_outbox WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&env.pool)
    .await
    .expect("outbox row")
}

async fn enqueue(env: &Env, intent: &protocol::Intent) -> i64 {
    let mut tx = env.pool.begin().await.unwrap();
    let id = Outbox::enqueue(&mut tx, intent).await.expect("enqueue");
    tx.commit().await.unwrap();
    id
}

// ---------------------------------------------------------------------------------------------
// Transactional outbox and relay
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn rolled_back_agent_transaction_publishes_nothing() {
    let env = Env::new().await;
    declare_worker_topology(&env).await;
    Outbox::migrate(&env.pool).await.expect("migrate");
    Outbox::migrate(&env.pool)
        .await
        .expect("migrate is idempotent");

    // The agent's own write and its intent in one transaction, rolled back.
    sqlx::query("CREATE TABLE refunds_requested (action_id text PRIMARY KEY)")
        .execute(&env.pool)
        .await
        .unwrap();
    let mut tx = env.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO refunds_requested VALUES ('r-rolled-back')")
        .execute(&mut *tx)
        .await
        .unwrap();
    Outbox::enqueue(&mut tx, &refund("north-shop", "r-rolled-back"))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    // And one committed.
    let mut tx = env.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO refunds_requested VALUES ('r-committed')")
        .execute(&mut *tx)
        .await
        .unwrap();
    Outbox::enqueue(&mut tx, &refund("north-shop", "r-committed"))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // An intent the worker would reject is refused before anything is stored.
    let mut bad = refund("north-shop", "r-bad");
    bad.tenant = "north:shop".into();
    let mut tx = env.pool.begin().await.unwrap();
    let err = Outbox::enqueue(&mut tx, &bad).await.expect_err("invalid");
    assert!(matches!(err, publisher::OutboxError::Invalid(_)), "{err:?}");
    tx.rollback().await.unwrap();

    let relay = Relay::new(env.pool.clone(), publisher_for(&env).await, relay_config());
    let report = relay.step().await.expect("step");
    assert_eq!((report.claimed, report.sent, report.failed), (1, 1, 0));
    assert_eq!(relay.step().await.unwrap(), StepReport::default());

    let got = drain(&env, &env.topology.intents_queue).await;
    let ids: Vec<&str> = got.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        ids,
        vec!["north-shop:r-committed"],
        "only the committed intent"
    );
    let body = protocol::decode_intent(&got[0].1).expect("the worker's decoder accepts it");
    assert_eq!(body.action_id, "r-committed");
    cleanup(env).await;
}

#[tokio::test]
async fn sent_rows_are_swept_after_the_retention_and_unsent_rows_never() {
    let env = Env::new().await;
    declare_worker_topology(&env).await;
    Outbox::migrate(&env.pool).await.unwrap();
    let old = enqueue(&env, &refund("north-shop", "sweep-old")).await;
    let recent = enqueue(&env, &refund("north-shop", "sweep-recent")).await;
    let relay = Relay::new(
        env.pool.clone(),
        publisher_for(&env).await,
        RelayConfig {
            retention: Duration::from_secs(3600),
            ..relay_config()
        },
    );
    assert_eq!(relay.step().await.unwrap().sent, 2);
    // An unsent row older than the retention, and a sent one.
    let unsent = enqueue(&env, &refund("north-shop", "sweep-unsent")).await;
    sqlx::query("UPDATE intent_outbox SET sent_at = now() - interval '2 hours' WHERE id = $1;")
        .bind(old)
        .execute(&env.pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE intent_outbox SET created_at = now() - interval '3 hours',
                next_attempt_at = now() + interval '1 hour' WHERE id = $1",
    )
    .bind(unsent)
    .execute(&env.pool)
    .await
    .unwrap();
    assert_eq!(relay.sweep().await.unwrap(), 1);
    let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM intent_outbox ORDER BY id")
        .fetch_all(&env.pool)
        .await
        .unwrap();
    assert_eq!(left, vec![recent, unsent]);
    let (backlog, oldest) = publisher::relay::backlog(&env.pool).await.unwrap();
    assert_eq!(backlog, 1);
    assert!(oldest >= 3.0 * 3600.0 - 60.0, "{oldest}");
    cleanup(env).await;
}

#[tokio::test]
async fn unroutable_row_stays_unsent_with_backoff_and_is_counted() {
    let env = Env::new().await;
    // The exchange exists but no queue is bound: every publish is returned.
    let p = publisher_for(&env).await;
    p.declare_exchange().await.unwrap();
    Outbox::migrate(&env.pool).await.unwrap();
    let id = enqueue(&env, &refund("north-shop", "r-nowhere")).await;

    let relay = Relay::new(env.pool.clone(), p, relay_config());
    let report = relay.step().await.expect("step");
    assert_eq!((report.claimed, report.sent, report.failed), (1, 0, 1));
    let row = outbox_row(&env, id).await;
    assert!(!row.sent, "an unroutable intent is not sent");
    assert_eq!(row.attempts, 1);
    assert!(
        row.last_error
            .as_deref()
            .unwrap_or("")
            .contains("unroutable"),
        "{:?}",
        row.last_error
    );
    assert!(
        row.due_in_secs > 10.0,
        "retried after a back-off: {}",
        row.due_in_secs
    );
    assert_eq!(
        relay.step().await.unwrap().claimed,
        0,
        "not retried before its back-off"
    );

    // The relay binary counts it and reports the backlog on its own listener.
    sqlx::query("UPDATE intent_outbox SET next_attempt_at = now()")
        .execute(&env.pool)
        .await
        .unwrap();
    let port = e2e::free_port();
    let addr = format!("127.0.0.1:{port}");
    let proc = RelayProc::spawn(&env, "relay", &[("PUBLISHER_METRICS_ADDR", addr.as_str())]);
    let deadline = Instant::now() + T;
    let text = loop {
        let text = match e2e::http()
            .get(format!("http://{addr}/metrics"))
            .send()
            .await
        {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        if metric_value(
            &text,
            "intent_publisher_publish_failures_total",
            &[("reason", "unroutable")],
        ) >= 1.0
        {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "no failure counted:\n{text}\n{}",
            proc.output()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        metric_value(&text, "intent_publisher_outbox_backlog", &[]),
        1.0
    );
    assert!(
        metric_value(
            &text,
            "intent_publisher_outbox_oldest_unsent_age_seconds",
            &[]
        ) >= 0.0
    );
    assert_eq!(
        metric_value(&text, "intent_publisher_rows_sent_total", &[]),
        0.0
    );
    e2e::wait_for("the second attempt recorded", T, || async {
        let row = outbox_row(&env, id).await;
        (row.attempts == 2).then_some(row)
    })
    .await;
    assert!(!outbox_row(&env, id).await.sent);
    drop(proc);
    cleanup(env).await;
}

#[tokio::test]
async fn a_pipelined_batch_marks_exactly_the_routed_rows_sent() {
    let env = Env::new().await;
    let p = publisher_for(&env).await;
    p.declare_exchange().await.unwrap();
    // A queue for north-shop only: south-shop's intents in the same batch are returned.
    let conn = lapin::Connection::connect(&env.amqp_url, Default::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        env.topology.intents_queue.as_str().into(),
        lapin::options::QueueDeclareOptions::default(),
        Default::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        env.topology.intents_queue.as_str().into(),
        env.topology.intents_exchange.as_str().into(),
        "north-shop".into(),
        Default::default(),
        Default::default(),
    )
    .await
    .unwrap();
    Outbox::migrate(&env.pool).await.unwrap();
    let mut expected = Vec::new();
    for k in 0..40 {
        let tenant = if k % 3 == 0 {
            "south-shop"
        } else {
            "north-shop"
        };
        let id = enqueue(&env, &refund(tenant, &format!("mix-{k}"))).await;
        if tenant == "north-shop" {
            expected.push((id, format!("north-shop:mix-{k}")));
        }
    }
    let relay = Relay::new(env.pool.clone(), p, relay_config());
    let report = relay.step().await.unwrap();
    assert_eq!((report.claimed, report.sent, report.failed), (40, 26, 14));
    let sent: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM intent_outbox WHERE sent_at IS NOT NULL ORDER BY id")
            .fetch_all(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        sent,
        expected.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        "exactly the routed rows are marked sent"
    );
    let unsent_errors: Vec<String> = sqlx::query_scalar(
        "SELECT last_error FROM intent_outbox WHERE sent_at IS NULL AND tenant = 'south-shop'",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(unsent_errors.len(), 14);
    assert!(unsent_errors.iter().all(|e| e.contains("unroutable")));
    let mut got: Vec<String> = drain(&env, &env.topology.intents_queue)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    got.sort();
    let mut want: Vec<String> = expected.into_iter().map(|(_, key)| key).collect();
    want.sort();
    assert_eq!(got, want);
    let _ = conn.close(200, "".into()).await;
    cleanup(env).await;
}

/// `AMQP_URL` as a node list with a dead node in it: the relay connects to the live one (the
/// list is tried in a shuffled order, so sometimes after the dead one) and its log names the
/// node in use, never the password.
#[tokio::test]
async fn relay_on_a_node_list_names_the_node_it_uses() {
    let env = Env::new().await;
    declare_worker_topology(&env).await;
    Outbox::migrate(&env.pool).await.unwrap();
    let live = e2e::host_port(&env.amqp_url);
    let dead_port = e2e::free_port();
    let dead = env
        .amqp_url
        .replacen(&live, &format!("127.0.0.1:{dead_port}"), 1);
    for (name, list) in [
        ("relay-a", format!("{dead},{}", env.amqp_url)),
        ("relay-b", format!("{},{dead}", env.amqp_url)),
    ] {
        let mut relay = RelayProc::spawn(&env, name, &[("AMQP_URL", list.as_str())]);
        relay.wait_output("relay running", T).await;
        let out = relay.output();
        let line = out.lines().find(|l| l.contains("relay running")).unwrap();
        assert!(line.contains(&format!("node={live}")), "{line}");
        assert!(
            !out.contains("guest:guest"),
            "no credentials in the log:\n{out}"
        );
        relay.kill();
    }
    cleanup(env).await;
}

#[tokio::test]
async fn relay_survives_a_cut_broker_link_and_stops_on_sigterm_mid_outage() {
    let env = Env::new().await;
    declare_worker_topology(&env).await;
    Outbox::migrate(&env.pool).await.unwrap();
    let proxy = e2e::FaultProxy::start("127.0.0.1:5672").await;
    let via_proxy = env
        .amqp_url
        .replacen("127.0.0.1:5672", &proxy.addr().to_string(), 1);
    assert_ne!(via_proxy, env.amqp_url);
    let mut relay = RelayProc::spawn(
        &env,
        "relay",
        &[
            ("AMQP_URL", via_proxy.as_str()),
            ("PUBLISHER_BACKOFF_INITIAL", "200ms"),
        ],
    );
    relay.wait_output("relay running", T).await;
    let first = enqueue(&env, &refund("north-shop", "cut-0")).await;
    e2e::wait_for("the first row sent", T, || async {
        outbox_row(&env, first).await.sent.then_some(())
    })
    .await;

    proxy.cut();
    let mut ids = Vec::new();
    for k in 1..=20 {
        ids.push(enqueue(&env, &refund("north-shop", &format!("cut-{k}"))).await);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    for id in &ids {
        assert!(
            !outbox_row(&env, *id).await.sent,
            "nothing is sent while the link is cut"
        );
    }
    proxy.restore();
    e2e::wait_for("all rows sent after the link is back", T, || async {
        let unsent: i64 =
            sqlx::query_scalar("SELECT count(*) FROM intent_outbox WHERE sent_at IS NULL")
                .fetch_one(&env.pool)
                .await
                .unwrap();
        (unsent == 0).then_some(())
    })
    .await;
    let mut got = consume_all(&env, &env.topology.intents_queue).await;
    got.sort();
    got.dedup();
    assert_eq!(got.len(), 21, "every intent arrived at least once");
    assert!(
        relay.output().contains("relay reconnected"),
        "{}",
        relay.output()
    );

    // SIGTERM while the broker is unreachable: the relay stops promptly; its rows stay unsent.
    proxy.cut();
    let last = enqueue(&env, &refund("north-shop", "cut-last")).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = Command::new("kill")
        .args(["-TERM", &relay.child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = relay.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "relay ignored SIGTERM:\n{}",
            relay.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status:?}\n{}", relay.output());
    assert!(
        !outbox_row(&env, last).await.sent,
        "kept for the next relay"
    );
    proxy.restore();
    cleanup(env).await;
}

/// A relay started before its database can be reached (compose or Kubernetes bringing both up,
/// a network not there yet) waits for it, as the worker waits for its ledger, and then relays.
#[tokio::test]
async fn a_relay_started_while_its_database_is_unreachable_waits_for_it() {
    let env = Env::new().await;
    declare_worker_topology(&env).await;
    Outbox::migrate(&env.pool).await.unwrap();
    let proxy = e2e::FaultProxy::start("127.0.0.1:5432").await;
    let via_proxy = env
        .db_url
        .replacen("127.0.0.1:5432", &proxy.addr().to_string(), 1);
    assert_ne!(via_proxy, env.db_url);
    proxy.cut();
    let mut relay = RelayProc::spawn(&env, "relay", &[("PUBLISHER_DATABASE_URL", &via_proxy)]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        relay.child.try_wait().unwrap().is_none(),
        "the relay gave up on an unreachable database:\n{}",
        relay.output()
    );
    assert!(
        relay.output().contains("not reachable yet"),
        "the wait is logged:\n{}",
        relay.output()
    );
    let id = enqueue(&env, &refund("north-shop", "late-db")).await;
    proxy.restore();
    relay.wait_output("relay running", T).await;
    e2e::wait_for("the row sent once the database is reachable", T, || async {
        outbox_row(&env, id).await.sent.then_some(())
    })
    .await;
    assert_eq!(
        consume_all(&env, &env.topology.intents_queue).await.len(),
        1
    );
    relay.kill();
    cleanup(env).await;
}

#[tokio::test]
async fn relay_killed_between_publish_and_mark_publishes_again_and_the_inbox_suppresses_it() {
    let (env, _ds, _w) = setup("").await;
    Outbox::migrate(&env.pool).await.unwrap();
    let mut i = refund("north-shop", "r-crash");
    i.reply_to = Some("agent-crash".into());
    let id = enqueue(&env, &i).await;

    let mut first = RelayProc::spawn(
        &env,
        "relay1",
        &[("PUBLISHER_FAULT_POINT", "after_publish")],
    );
    first
        .wait_output("fault point reached: after_publish", T)
        .await;
    first.kill(); // SIGKILL after the confirm, before the row was marked sent
    assert!(!outbox_row(&env, id).await.sent, "never marked sent");

    let _second = RelayProc::spawn(&env, "relay2", &[]);
    let deadline = Instant::now() + T;
    while !(outbox_row(&env, id).await.sent
        && env.outbox_statuses("north-shop", "r-crash").await.len() >= 2)
    {
        assert!(
            Instant::now() < deadline,
            "not published again and answered"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    e2e::wait_for("r-crash succeeded", T, || async {
        (env.state("north-shop", "r-crash").await == "succeeded").then_some(())
    })
    .await;
    let statuses = env.outbox_statuses("north-shop", "r-crash").await;
    assert!(
        statuses.len() >= 2,
        "the worker saw the intent twice: {statuses:?}"
    );
    assert_eq!(env.mutations("north-shop:r-crash").await, 1, "one mutation");
    assert_eq!(env.writes("north-shop:r-crash").await, 1, "one dispatch");
    cleanup(env).await;
}

/// `RELAY_BENCH_ROWS` (default 10,000) rows, `RELAY_BENCH_RELAYS` (default 2) relay processes.
#[tokio::test]
async fn ten_thousand_rows_relayed_by_two_relays_none_lost() {
    let env_number = |name: &str, default: i64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let n: i64 = env_number("RELAY_BENCH_ROWS", 10_000);
    let relay_count = env_number("RELAY_BENCH_RELAYS", 2);
    let env = Env::new().await;
    declare_worker_topology(&env).await;
    Outbox::migrate(&env.pool).await.unwrap();
    // Rows as any language would insert them (the table is the contract).
    sqlx::query(
        "INSERT INTO intent_outbox (tenant, action_id, body)
         SELECT 'north-shop', 'bulk-' || g,
                json_build_object('tenant', 'north-shop', 'action_id', 'bulk-' || g,
                                  'tool', 'refund', 'arguments', json_build_object('n', g))::text
         FROM generate_series(1, $1) g",
    )
    .bind(n)
    .execute(&env.pool)
    .await
    .unwrap();

    let started = Instant::now();
    let relays: Vec<RelayProc> = (0..relay_count)
        .map(|r| RelayProc::spawn(&env, &format!("relay-{r}"), &[]))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let unsent: i64 =
            sqlx::query_scalar("SELECT count(*) FROM intent_outbox WHERE sent_at IS NULL")
                .fetch_one(&env.pool)
                .await
                .unwrap();
        if unsent == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{unsent} rows unsent; relay-0:\n{}",
            relays[0].output()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed();
    let span: f64 = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM max(sent_at) - min(sent_at))::float8 FROM intent_outbox",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    eprintln!(
        "relayed {n} rows with {relay_count} relay processes: {:.0} rows/s between the first and \
         the last row marked sent ({span:.2}s); {:.2}s including relay start-up",
        n as f64 / span.max(0.001),
        elapsed.as_secs_f64()
    );
    drop(relays);

    let mut seen: BTreeMap<String, u32> = BTreeMap::new();
    for id in consume_all(&env, &env.topology.intents_queue).await {
        *seen.entry(id).or_default() += 1;
    }
    let missing: Vec<i64> = (1..=n)
        .filter(|g| !seen.contains_key(&format!("north-shop:bulk-{g}")))
        .take(10)
        .collect();
    assert!(missing.is_empty(), "lost: {missing:?}");
    assert_eq!(seen.len() as i64, n, "nothing but the outbox's intents");
    cleanup(env).await;
}

// ---------------------------------------------------------------------------------------------
// One action's answer, per-agent routing
// ---------------------------------------------------------------------------------------------

fn answers(env: &Env, w: Option<&Worker>, reply_to: &str) -> AnswerConfig {
    AnswerConfig {
        results_exchange: env.topology.results_exchange.clone(),
        reply_to: reply_to.to_string(),
        status_api: w.map(|w| StatusApi::new(&status_url(w), TENANT_TOKEN).unwrap()),
        ..AnswerConfig::default()
    }
}

#[tokio::test]
async fn send_and_wait_returns_the_final_answer_and_only_this_agent_gets_it() {
    let (env, ds, w) = setup("").await;
    // A second agent of the same tenant and a tenant-wide observer.
    let mut other_agent = Follower::follow_keys(
        &env.amqp_url,
        &env.topology.results_exchange,
        &[protocol::result_routing_key("north-shop", Some("agent-b"))],
        None,
    )
    .await
    .unwrap();
    let mut observer = Follower::follow(
        &env.amqp_url,
        &env.topology.results_exchange,
        "north-shop",
        None,
    )
    .await
    .unwrap();
    let agent = publisher_for(&env)
        .await
        .with_answers(answers(&env, None, "agent-a"));

    let answer = agent
        .send_and_wait(&refund("north-shop", "r-wait-1"), T)
        .await
        .expect("answer");
    assert_eq!(answer.event.status, Status::Succeeded);
    assert_eq!(answer.source, Source::Queue);
    assert_eq!(answer.event.action_id, "r-wait-1");
    assert!(answer.event.receipt.is_some());

    // Same action again: the stored answer, no second dispatch.
    let again = agent
        .send_and_wait(&refund("north-shop", "r-wait-1"), T)
        .await
        .unwrap();
    assert_eq!(again.event.status, Status::Succeeded);
    assert_eq!(env.writes("north-shop:r-wait-1").await, 1);

    // A refused write is `failed`; an unknown tool and a conflict are `rejected`, all to agent-a.
    ds.fault(json!({"kind": "status", "status": 422, "key": "north-shop:r-wait-422"}))
        .await;
    let failed = agent
        .send_and_wait(&refund("north-shop", "r-wait-422"), T)
        .await
        .unwrap();
    assert_eq!(failed.event.status, Status::Failed, "{:?}", failed.event);
    let mut unknown = refund("north-shop", "r-wait-unknown");
    unknown.tool = "no-such-tool".into();
    let rejected = agent.send_and_wait(&unknown, T).await.unwrap();
    assert_eq!(rejected.event.status, Status::Rejected);
    let mut conflict = refund("north-shop", "r-wait-1");
    conflict.arguments = json!({"order": "another"});
    let rejected = agent.send_and_wait(&conflict, T).await.unwrap();
    assert_eq!(rejected.event.status, Status::Rejected);
    assert_eq!(
        rejected.event.reason,
        Some(protocol::RejectReason::IntentConflict)
    );

    // The other agent of the tenant received none of agent-a's results; the observer all.
    assert!(
        other_agent
            .next(Duration::from_millis(500))
            .await
            .unwrap()
            .is_none(),
        "another agent's queue must not receive agent-a's results"
    );
    let mut observed = 0;
    while let Some(e) = observer.next(Duration::from_millis(500)).await.unwrap() {
        assert_eq!(e.tenant, "north-shop");
        observed += 1;
    }
    assert!(observed >= 5, "observer saw {observed}");
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn send_and_wait_returns_pending_at_the_timeout_and_falls_back_to_the_status_api() {
    let (env, ds, w) = setup("").await;
    // `deploy` has no recovery: a dropped response leaves the outcome unknown (pending).
    ds.fault(json!({"kind": "drop_after_commit", "key": "north-shop:d-unknown"}))
        .await;
    let agent = publisher_for(&env)
        .await
        .with_answers(answers(&env, Some(&w), "agent-p"));
    let mut deploy = intent("north-shop", "d-unknown", "deploy", json!({"v": 1}));
    deploy.reply_to = None;
    let started = Instant::now();
    let answer = agent
        .send_and_wait(&deploy, Duration::from_secs(4))
        .await
        .unwrap();
    assert_eq!(answer.event.status, Status::Pending, "{:?}", answer.event);
    assert_eq!(answer.event.next_action.as_deref(), Some("check_status"));
    assert!(started.elapsed() >= Duration::from_secs(4));
    assert_eq!(env.mutations("north-shop:d-unknown").await, 1);

    // The queue misses the event (results go to an exchange nobody bound here): the status
    // API still gives the answer.
    let blind = AnswerConfig {
        results_exchange: format!("{}-unbound", env.topology.results_exchange),
        ..answers(&env, Some(&w), "agent-q")
    };
    let agent = publisher_for(&env).await.with_answers(blind);
    let answer = agent
        .send_and_wait(&refund("north-shop", "r-fallback"), Duration::from_secs(3))
        .await
        .unwrap();
    assert_eq!(answer.source, Source::StatusApi);
    assert_eq!(answer.event.status, Status::Succeeded, "{:?}", answer.event);

    // Without a status API and without any answer: NoAnswer.
    let agent = publisher_for(&env).await.with_answers(AnswerConfig {
        results_exchange: format!("{}-unbound", env.topology.results_exchange),
        ..answers(&env, None, "agent-r")
    });
    let err = agent
        .send_and_wait(&refund("north-shop", "r-silent"), Duration::from_secs(1))
        .await
        .expect_err("no answer");
    assert!(matches!(err, WaitError::NoAnswer { .. }), "{err:?}");

    // Another tenant's operation is not visible with north-shop's token.
    let api = StatusApi::new(&status_url(&w), TENANT_TOKEN).unwrap();
    assert!(api
        .status("south-shop", "r-fallback")
        .await
        .unwrap()
        .is_none());
    cleanup(env).await;
}

fn run_cli(env: &Env, w: &Worker, args: &[&str]) -> Output {
    Command::new(e2e::procs::publisher_bin())
        .args(args)
        .env_clear()
        .env("RUST_LOG", "warn")
        .env("AMQP_URL", &env.amqp_url)
        .env("INTENTS_EXCHANGE", &env.topology.intents_exchange)
        .env("RESULTS_EXCHANGE", &env.topology.results_exchange)
        .env("PUBLISHER_STATUS_URL", status_url(w))
        .env("PUBLISHER_STATUS_TOKEN", TENANT_TOKEN)
        .output()
        .expect("run publisher")
}

#[tokio::test]
async fn cli_send_wait_and_wait_exit_with_the_answer_status() {
    let (env, ds, w) = setup("").await;
    let send = |id: &str, tool: &str, timeout: &str| {
        let args = vec![
            "send".to_string(),
            "--wait".into(),
            "--timeout".into(),
            timeout.into(),
            "--tenant".into(),
            "north-shop".into(),
            "--action-id".into(),
            id.into(),
            "--tool".into(),
            tool.into(),
            "--args".into(),
            r#"{"order":"o-{1}\"q","amount_cents":18446744073709551615}"#.into(),
        ];
        let out = Command::new(e2e::procs::publisher_bin())
            .args(&args)
            .env_clear()
            .env("RUST_LOG", "warn")
            .env("AMQP_URL", &env.amqp_url)
            .env("INTENTS_EXCHANGE", &env.topology.intents_exchange)
            .env("RESULTS_EXCHANGE", &env.topology.results_exchange)
            .output()
            .expect("run publisher");
        let event: Option<serde_json::Value> = serde_json::from_slice(&out.stdout).ok();
        (
            out.status.code(),
            event,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, event, err) = send("cli-ok-{1}", "refund", "30s");
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(event.unwrap()["status"], "succeeded");
    ds.fault(json!({"kind": "status", "status": 422, "key": "north-shop:cli-422"}))
        .await;
    let (code, _, err) = send("cli-422", "refund", "30s");
    assert_eq!(code, Some(11), "failed: {err}");
    let (code, _, err) = send("cli-unknown", "nope", "30s");
    assert_eq!(code, Some(12), "rejected: {err}");
    ds.fault(json!({"kind": "drop_after_commit", "key": "north-shop:cli-pending"}))
        .await;
    let (code, event, err) = send("cli-pending", "deploy", "3s");
    assert_eq!(code, Some(10), "pending: {err}");
    assert_eq!(event.unwrap()["next_action"], "check_status");

    // `publisher wait` only asks the status API.
    let out = run_cli(
        &env,
        &w,
        &[
            "wait",
            "--tenant",
            "north-shop",
            "--action-id",
            "cli-ok-{1}",
            "--timeout",
            "5s",
        ],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run_cli(
        &env,
        &w,
        &[
            "wait",
            "--tenant",
            "north-shop",
            "--action-id",
            "never-sent",
            "--timeout",
            "1s",
        ],
    );
    assert_eq!(out.status.code(), Some(3), "no answer at all");
    // Usage errors.
    let out = run_cli(
        &env,
        &w,
        &[
            "send",
            "--wait",
            "--tenant",
            "north-shop",
            "--action-id",
            "x",
            "--tool",
            "refund",
            "--args",
            "{bad",
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    let out = Command::new(e2e::procs::publisher_bin())
        .args(["wait", "--tenant", "t", "--action-id", "a"])
        .env_clear()
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "wait without a status API");
    assert_eq!(env.writes("north-shop:cli-ok-{1}").await, 1);
    cleanup(env).await;
}

// ---------------------------------------------------------------------------------------------
// Tenant proof from our own publisher
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn publisher_proves_its_tenant_with_the_connection_user() {
    let env = Env::new().await;
    let broker_user = BrokerUser::create("agent");
    let user = broker_user.name.clone();
    let (env, _ds, _w) = {
        let ds = Downstream::start(&env).await;
        let tools = env.standard_tools(ds.port, "");
        let mut text = std::fs::read_to_string(&tools).unwrap();
        text.push_str(&format!(
            "\n[auth]\nmode = \"user_id\"\nusers = {{ \"{user}\" = [\"north-shop\"] }}\n"
        ));
        std::fs::write(&tools, text).unwrap();
        let w = Worker::start(&env, "w1", &WorkerOptions::new(tools)).await;
        (env, ds, w)
    };
    let url = broker_user.url(&env);

    let agent = Publisher::connect(&url, &env.topology.intents_exchange)
        .await
        .expect("connect as the second user")
        .with_answers(answers(&env, None, "proof-agent"));
    assert_eq!(agent.user_id(), Some(user.as_str()));
    let answer = agent
        .send_and_wait(&refund("north-shop", "r-proven"), T)
        .await
        .expect("answer");
    assert_eq!(answer.event.status, Status::Succeeded);
    assert_eq!(env.mutations("north-shop:r-proven").await, 1);

    // The same user may not act for another tenant, and without user_id nothing is proven.
    let spoof = agent
        .send_and_wait(&refund("south-shop", "r-spoof"), Duration::from_secs(2))
        .await;
    assert!(
        matches!(spoof, Err(WaitError::NoAnswer { .. })),
        "{spoof:?}"
    );
    let anonymous = Publisher::connect(&url, &env.topology.intents_exchange)
        .await
        .unwrap()
        .with_user_id(false)
        .with_answers(answers(&env, None, "proof-agent"));
    assert_eq!(anonymous.user_id(), None);
    let anon = anonymous
        .send_and_wait(&refund("north-shop", "r-anon"), Duration::from_secs(2))
        .await;
    assert!(matches!(anon, Err(WaitError::NoAnswer { .. })), "{anon:?}");

    // A user_id that is not the connection's user is refused by the broker itself.
    let agent_again = Publisher::connect(&env.amqp_url, &env.topology.intents_exchange)
        .await
        .unwrap();
    assert_eq!(agent_again.user_id(), Some("guest"));

    let probe = Agent::new(&env, &[]).await;
    let mut dead = Vec::new();
    let deadline = Instant::now() + T;
    while dead.len() < 2 && Instant::now() < deadline {
        dead.extend(probe.drain_dead_letters(&env).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reasons: Vec<String> = dead
        .iter()
        .map(|d| {
            format!(
                "{:?}",
                d.properties
                    .headers()
                    .as_ref()
                    .and_then(|h| h.inner().get("x-intent-worker-reason").cloned())
            )
        })
        .collect();
    assert_eq!(dead.len(), 2, "{reasons:?}");
    let mismatch = format!(
        "{:?}",
        Some(lapin::types::AMQPValue::LongString(
            "tenant_mismatch".into()
        ))
    );
    assert!(reasons.iter().all(|r| *r == mismatch), "{reasons:?}");
    assert_eq!(env.writes("south-shop:r-spoof").await, 0);
    assert_eq!(env.writes("north-shop:r-anon").await, 0);
    cleanup(env).await;
}

// ---------------------------------------------------------------------------------------------
// Measurement (not part of the suite): `send_and_wait` and `publisher send --wait` latency.
// cargo nextest run -p e2e --run-ignored only -E 'test(/^agent_side::/) & test(latency)' --no-capture
// ---------------------------------------------------------------------------------------------

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[tokio::test]
#[ignore = "measurement; run explicitly"]
async fn send_and_wait_latency() {
    let n: usize = std::env::var("LATENCY_SAMPLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let (env, _ds, w) = setup("").await;
    let agent = publisher_for(&env)
        .await
        .with_answers(answers(&env, None, "latency-agent"));
    agent
        .send_and_wait(&refund("north-shop", "warm-up"), T)
        .await
        .unwrap();
    let mut library = Vec::with_capacity(n);
    for k in 0..n {
        let started = Instant::now();
        let a = agent
            .send_and_wait(&refund("north-shop", &format!("lat-{k}")), T)
            .await
            .unwrap();
        library.push(started.elapsed());
        assert_eq!(a.event.status, Status::Succeeded);
    }
    library.sort();
    let cli_n = (n / 5).max(10);
    let mut cli = Vec::with_capacity(cli_n);
    for k in 0..cli_n {
        let started = Instant::now();
        let out = run_cli(
            &env,
            &w,
            &[
                "send",
                "--wait",
                "--tenant",
                "north-shop",
                "--action-id",
                &format!("cli-lat-{k}"),
                "--tool",
                "refund",
                "--args",
                r#"{"order":"o-1"}"#,
            ],
        );
        cli.push(started.elapsed());
        assert_eq!(out.status.code(), Some(0));
    }
    cli.sort();
    eprintln!(
        "send_and_wait (library, {n} samples): p50 {:?} p99 {:?} max {:?}",
        percentile(&library, 50.0),
        percentile(&library, 99.0),
        library[library.len() - 1]
    );
    eprintln!(
        "publisher send --wait (process, {cli_n} samples): p50 {:?} p99 {:?} max {:?}",
        percentile(&cli, 50.0),
        percentile(&cli, 99.0),
        cli[cli.len() - 1]
    );
    cleanup(env).await;
}
