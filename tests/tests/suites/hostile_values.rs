//! Values a hostile or unlucky agent sends, met by real worker processes, RabbitMQ and
//! Postgres: a receipt never reaches the logs (not even when its result is unroutable, not even
//! at `trace`), a number is never silently changed into another one, a U+0000 that the ledger
//! could not store is refused before anything is sent, and the dead-letter queue the worker
//! declares for itself is bounded like the one the broker definitions declare.

use std::time::Duration;

use e2e::{cleanup, wait_for, Agent, Downstream, Env, Worker, WorkerOptions};
use protocol::{RejectReason, Status};
use serde_json::json;

const T: Duration = Duration::from_secs(30);

async fn start(env: &Env, rust_log: Option<&str>) -> (Downstream, Worker) {
    let ds = Downstream::start(env).await;
    let mut opts = WorkerOptions::new(env.standard_tools(ds.port, ""));
    if let Some(filter) = rust_log {
        opts = opts.env("RUST_LOG", filter);
    }
    let w = Worker::start(env, "w1", &opts).await;
    (ds, w)
}

/// The result of a refund whose receipt echoes a marker goes to a tenant nobody follows, so
/// the broker returns it (basic.return). The worker says so by key, status and reason; the
/// marker appears in no log line, at the default filter or with everything at `trace`.
#[tokio::test]
async fn an_unroutable_result_is_logged_without_its_receipt() {
    for filter in [None, Some("trace")] {
        let env = Env::new().await;
        let (_ds, w) = start(&env, filter).await;
        let agent = Agent::new(&env, &[]).await;
        let marker = format!("card-holder-{}", env.id);
        agent
            .request(
                "quiet-shop",
                "refund-1",
                "refund",
                json!({"order": "o-1", "amount_cents": 100, "holder": marker}),
            )
            .await;
        wait_for("the refund to succeed", T, || async {
            (env.state("quiet-shop", "refund-1").await == "succeeded").then_some(())
        })
        .await;
        let receipt = env
            .downstream_receipt("quiet-shop:refund-1")
            .await
            .expect("the downstream stored a receipt");
        assert!(receipt.to_string().contains(&marker), "{receipt}");
        w.wait_output("no queue is bound", T).await;
        let log = w.output.text();
        // Debug output of a body is a list of byte values: `[99, 97, 114, …]`.
        let as_bytes = format!("{:?}", marker.as_bytes());
        let as_bytes = as_bytes.trim_matches(['[', ']']);
        assert!(
            !log.contains(as_bytes),
            "RUST_LOG={filter:?}: the receipt reached the log as bytes ({} bytes of log)",
            log.len()
        );
        assert!(
            !log.contains(&marker),
            "RUST_LOG={filter:?}: the receipt's marker reached the log:\n{}",
            log.lines()
                .filter(|l| l.contains(marker.as_str()))
                .map(|l| &l[..l.len().min(300)])
                .collect::<Vec<_>>()
                .join("\n")
        );
        let returned = log
            .lines()
            .find(|l| l.contains("no queue is bound"))
            .unwrap()
            .to_string();
        for part in ["quiet-shop", "refund-1", "succeeded", "NO_ROUTE"] {
            assert!(returned.contains(part), "{part} missing from: {returned}");
        }
        drop(w);
        cleanup(env).await;
    }
}

/// The next answer for `north-shop` is `rejected` / `invalid_message` / `detail` about `id`,
/// and the action has neither a ledger row nor a downstream write.
async fn refused_unsent(
    env: &Env,
    agent: &mut Agent,
    id: &str,
    detail: &str,
) -> protocol::ResultEvent {
    let ev = agent.next("north-shop", T).await;
    assert_eq!(ev.action_id, id);
    assert_eq!(ev.status, Status::Rejected, "{id}: {ev:?}");
    assert_eq!(ev.reason, Some(RejectReason::InvalidMessage), "{id}");
    assert_eq!(ev.detail.as_deref(), Some(detail), "{id}: {ev:?}");
    assert_eq!(env.writes(&format!("north-shop:{id}")).await, 0, "{id}");
    assert!(env.operation("north-shop", id).await.is_none(), "{id}");
    ev
}

/// `1e-400` used to be stored and dispatched as `0`; an integer past `u64` was rounded. Both
/// are refused like `1e400`, and nothing reaches the downstream.
#[tokio::test]
async fn a_number_that_would_change_is_refused_and_never_sent() {
    let env = Env::new().await;
    let (_ds, _w) = start(&env, None).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    for (id, n) in [
        ("tiny", "1e-400"),
        ("huge", "1e400"),
        ("wide", "18446744073709551617"),
    ] {
        let body = format!(
            r#"{{"tenant":"north-shop","action_id":"{id}","tool":"refund","arguments":{{"order":"o","amount_cents":{n}}}}}"#
        );
        agent.send_encoded("north-shop", id, &body).await;
        refused_unsent(&env, &mut agent, id, "not_json").await;
    }
    let dead = agent.drain_dead_letters(&env).await;
    assert_eq!(dead.len(), 3, "each refused body is dead-lettered");
    cleanup(env).await;
}

/// A NUL in the arguments would be unstorable for a downstream keeping JSON in Postgres
/// `jsonb` (the reference downstream does). It is refused at intake, with a reason naming it,
/// before any request is sent.
#[tokio::test]
async fn a_nul_in_the_arguments_is_refused_before_dispatch() {
    let env = Env::new().await;
    let (_ds, _w) = start(&env, None).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    agent
        .request(
            "north-shop",
            "nul-1",
            "refund",
            json!({"order": "o", "amount_cents": 1, "note": "x\u{0}y"}),
        )
        .await;
    let ev = refused_unsent(&env, &mut agent, "nul-1", "nul_character").await;
    assert!(ev.message.contains("U+0000"), "{ev:?}");
    // The same request without the NUL goes through.
    agent
        .request(
            "north-shop",
            "nul-2",
            "refund",
            json!({"order": "o", "amount_cents": 1, "note": "x y"}),
        )
        .await;
    agent.succeeded("north-shop", "nul-2").await;
    cleanup(env).await;
}

/// The dead-letter queue a worker declares for itself is bounded like the one the broker
/// definitions declare (length, age, overflow rule, and a delivery limit no reading reaches):
/// redeclaring it with the arguments the definitions' `intents-dead` policy implies succeeds
/// only if they are the queue's own.
#[tokio::test]
async fn the_self_declared_dead_letter_queue_is_bounded_like_the_definitions() {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::{AMQPValue, FieldTable, LongString};

    let definitions: serde_json::Value =
        serde_json::from_str(include_str!("../../../deploy/rabbitmq/definitions.json")).unwrap();
    let policy = definitions["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "intents-dead")
        .expect("the dead-letter queue's policy")["definition"]
        .clone();
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    for (key, arg) in [
        ("max-length", "x-max-length"),
        ("message-ttl", "x-message-ttl"),
    ] {
        let n = policy[key]
            .as_i64()
            .unwrap_or_else(|| panic!("policy {key}"));
        args.insert(arg.into(), AMQPValue::LongLongInt(n));
    }
    let overflow = policy["overflow"].as_str().expect("policy overflow");
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString(LongString::from(overflow)),
    );
    let limit = policy["delivery-limit"]
        .as_i64()
        .expect("policy delivery-limit");
    assert!(
        limit >= 1_000_000,
        "a delivery limit that reading the queue could reach: {limit}"
    );
    args.insert("x-delivery-limit".into(), AMQPValue::LongInt(limit as i32));

    let env = Env::new().await;
    let (_ds, _w) = start(&env, None).await;
    let conn = lapin::Connection::connect(&env.amqp_url, Default::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let declared = channel
        .queue_declare(
            env.topology.dead_letter_queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await;
    assert!(
        declared.is_ok(),
        "the worker's dead-letter queue differs from the definitions: {declared:?}"
    );
    let _ = conn.close(200, "".into()).await;
    cleanup(env).await;
}

/// Unacknowledged deliveries the broker pushed to this worker, from the broker's own count.
fn unacknowledged(queue: &str) -> u64 {
    let out = std::process::Command::new("rabbitmqctl")
        .args([
            "list_queues",
            "-q",
            "name",
            "messages_unacknowledged",
            "messages_ready",
            "consumers",
        ])
        .output()
        .expect("rabbitmqctl");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| {
            let mut cols = l.split_whitespace();
            (cols.next() == Some(queue)).then(|| cols.next()?.parse().ok())?
        })
        .unwrap_or(0)
}

/// Prefetch counts messages; the bytes a worker holds are bounded too. While the worker is
/// stopped (SIGSTOP: nothing is read, nothing acked), the broker pushes it only as many 3 KiB
/// intents as fit `WORKER_MAX_INFLIGHT_BYTES` at `WORKER_MAX_MESSAGE_BYTES` each, not the
/// prefetch of 32. A message over `WORKER_MAX_MESSAGE_BYTES` is dead-lettered as too large,
/// unread. Once the worker runs again, every intent is answered.
#[tokio::test]
async fn bytes_held_in_flight_are_bounded_not_only_messages() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .env("WORKER_MAX_MESSAGE_BYTES", "4096")
        .env("WORKER_MAX_INFLIGHT_BYTES", "16384");
    assert_eq!(opts.prefetch, 32);
    let w = Worker::start(&env, "w1", &opts).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    w.pause();
    let note = "n".repeat(3000);
    for i in 0..20 {
        agent
            .request(
                "north-shop",
                &format!("big-{i}"),
                "refund",
                json!({"order": "o", "amount_cents": i, "note": note}),
            )
            .await;
    }
    // The broker refreshes a quorum queue's counters every few seconds.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let held = unacknowledged(&env.topology.intents_queue);
    eprintln!(
        "{}",
        String::from_utf8_lossy(
            &std::process::Command::new("rabbitmqctl")
                .args([
                    "list_queues",
                    "-q",
                    "name",
                    "messages_unacknowledged",
                    "messages_ready",
                    "consumers"
                ])
                .output()
                .unwrap()
                .stdout
        )
    );
    assert!(
        (1..=4).contains(&held),
        "{held} deliveries of ~3 KiB held against a 16 KiB bound"
    );
    w.resume();
    for _ in 0..20 {
        let ev = agent.next("north-shop", T).await;
        assert_eq!(ev.status, Status::Succeeded, "{ev:?}");
    }
    // Over the per-message bound: refused unread, never dispatched.
    let oversized = "o".repeat(5000);
    agent
        .request(
            "north-shop",
            "oversized",
            "refund",
            json!({"order": "o", "amount_cents": 1, "note": oversized}),
        )
        .await;
    wait_for("the oversized intent to be dead-lettered", T, || async {
        w.output.contains("over the 4096-byte limit").then_some(())
    })
    .await;
    assert_eq!(env.writes("north-shop:oversized").await, 0);
    assert!(env.operation("north-shop", "oversized").await.is_none());
    drop(w);
    cleanup(env).await;
}
