//! Deduplication end to end: intents in, one dispatch per action, receipts out — over real RabbitMQ, Postgres,
//! worker processes and the reference downstream. Counts come from the downstream's tables.

use std::time::Duration;

use e2e::{
    cleanup, intent, metric_value, publish_as, Agent, Downstream, Env, Worker, WorkerOptions,
};
use protocol::{RejectReason, Status};
use serde_json::json;

const T: Duration = Duration::from_secs(20);

async fn setup(extra_tools: &str, metrics: bool) -> (Env, Downstream, Worker, WorkerOptions) {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = env.standard_tools(ds.port, extra_tools);
    let mut opts = WorkerOptions::new(tools);
    if metrics {
        opts = opts.with_metrics();
    }
    let w = Worker::start(&env, "w1", &opts).await;
    (env, ds, w, opts)
}

#[tokio::test]
async fn happy_path_per_capability() {
    let (env, _ds, _w, _) = setup("", false).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    for (tool, id) in [
        ("refund", "refund-204"),
        ("ticket", "ticket-1"),
        ("deploy", "deploy-1"),
    ] {
        agent
            .request(
                "north-shop",
                id,
                tool,
                json!({"order": "order-731", "amount_cents": 4850, "currency": "USD"}),
            )
            .await;
        let ev = agent.succeeded("north-shop", id).await;
        let key = format!("north-shop:{id}");
        let receipt = ev.receipt.expect("succeeded carries the receipt");
        assert_eq!(
            Some(&receipt),
            env.downstream_receipt(&key).await.as_ref(),
            "{tool}: the downstream's receipt"
        );
        assert_eq!(receipt["idempotency_key"], json!(key));
        assert_eq!(env.mutations(&key).await, 1, "{tool}: one mutation");
        assert_eq!(env.writes(&key).await, 1, "{tool}: one write request");
        assert_eq!(env.state("north-shop", id).await, "succeeded");
    }
    cleanup(env).await;
}

#[tokio::test]
async fn same_intent_three_times_dispatches_once() {
    let (env, _ds, w, _) = setup("", true).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    let first = intent(
        "north-shop",
        "refund-204",
        "refund",
        json!({"order": "order-731", "amount_cents": 4850, "currency": "USD"}),
    );
    agent.send(&first).await;
    let original = agent.succeeded("north-shop", "refund-204").await;
    // Again with a new call_id, then with reordered, re-spaced JSON.
    let mut again = first.clone();
    again.call_id = Some("model-call-other".into());
    agent.send(&again).await;
    let second = agent.next("north-shop", T).await;
    agent
        .send_encoded(
            "north-shop",
            "refund-204",
            r#"{ "arguments" : {"currency":"USD", "amount_cents":4850.0,"order":"order-731"},
                 "tool":"refund", "call_id":"model-call-3", "action_id":"refund-204", "tenant":"north-shop" }"#,
        )
        .await;
    let third = agent.next("north-shop", T).await;
    for ev in [&second, &third] {
        assert_eq!(ev.status, Status::Succeeded, "{ev:?}");
        assert_eq!(ev.receipt, original.receipt, "the original receipt");
        assert_eq!(ev.fingerprint, original.fingerprint);
    }
    assert_eq!(env.mutations("north-shop:refund-204").await, 1);
    assert_eq!(env.writes("north-shop:refund-204").await, 1);
    let metrics = w.metrics().await;
    assert_eq!(
        metric_value(&metrics, "intent_worker_duplicates_suppressed_total", &[]),
        2.0,
        "{metrics}"
    );
    assert_eq!(
        metric_value(
            &metrics,
            "intent_worker_duplicates_suppressed_total",
            &[("reason", "completed")]
        ),
        2.0
    );
    cleanup(env).await;
}

#[tokio::test]
async fn broker_redelivery_after_kill_before_ack_dispatches_once() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = env.standard_tools(ds.port, "");
    let opts = WorkerOptions::new(tools.clone());
    // Consumed and recorded, not acked: the worker dies at `after_prepared`.
    let mut w1 = Worker::start(&env, "w1", &opts.clone().fault("after_prepared", None)).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    agent
        .request("north-shop", "refund-9", "refund", json!({"order": "o-9"}))
        .await;
    w1.wait_output("fault point reached: after_prepared", T)
        .await;
    // Admitted already claimed for its first dispatch, but its send fence never passed.
    assert_eq!(env.state("north-shop", "refund-9").await, "dispatching");
    w1.kill();
    let _w2 = Worker::start(&env, "w2", &opts).await;
    let ev = agent.succeeded("north-shop", "refund-9").await;
    assert!(ev.receipt.is_some());
    assert_eq!(env.mutations("north-shop:refund-9").await, 1);
    assert_eq!(env.writes("north-shop:refund-9").await, 1);
    cleanup(env).await;
}

#[tokio::test]
async fn intent_conflict_is_rejected_before_any_network_activity() {
    let (env, _ds, _w, _) = setup("", false).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    agent
        .request(
            "north-shop",
            "refund-204",
            "refund",
            json!({"order": "order-731", "amount_cents": 4850}),
        )
        .await;
    let ok = agent.succeeded("north-shop", "refund-204").await;
    let before = env.operation("north-shop", "refund-204").await.unwrap();
    agent
        .request(
            "north-shop",
            "refund-204",
            "refund",
            json!({"order": "order-731", "amount_cents": 9999}),
        )
        .await;
    let ev = agent.next("north-shop", T).await;
    assert_eq!(ev.status, Status::Rejected);
    assert_eq!(ev.reason, Some(RejectReason::IntentConflict));
    assert_eq!(
        ev.receipt, None,
        "the stored result is never returned for a conflict"
    );
    assert_ne!(ev.fingerprint, ok.fingerprint);
    assert_eq!(
        env.writes("north-shop:refund-204").await,
        1,
        "no extra send"
    );
    let after = env.operation("north-shop", "refund-204").await.unwrap();
    assert_eq!(
        (after.state, after.receipt, after.fingerprint, after.fence),
        (
            before.state,
            before.receipt,
            before.fingerprint,
            before.fence
        )
    );
    cleanup(env).await;
}

#[tokio::test]
async fn equal_arguments_under_two_keys_and_one_key_under_two_tenants_are_separate_actions() {
    let (env, _ds, _w, _) = setup("", false).await;
    let mut agent = Agent::new(&env, &["north-shop", "south-shop"]).await;
    let args = json!({"order": "order-731", "amount_cents": 4850, "currency": "USD"});
    agent
        .send(&intent("north-shop", "refund-a", "refund", args.clone()))
        .await;
    agent
        .send(&intent("north-shop", "refund-b", "refund", args.clone()))
        .await;
    agent
        .send(&intent("south-shop", "refund-a", "refund", args.clone()))
        .await;
    let mut north = Vec::new();
    while north.len() < 2 {
        let ev = agent.next("north-shop", T).await;
        assert_eq!(
            ev.tenant, "north-shop",
            "a tenant only sees its own results"
        );
        if ev.status == Status::Succeeded {
            north.push(ev);
        }
    }
    let south = agent.succeeded("south-shop", "refund-a").await;
    assert_eq!(south.tenant, "south-shop");
    for key in [
        "north-shop:refund-a",
        "north-shop:refund-b",
        "south-shop:refund-a",
    ] {
        assert_eq!(env.mutations(key).await, 1, "{key}");
    }
    let north_a = north.iter().find(|e| e.action_id == "refund-a").unwrap();
    assert_ne!(
        north_a.receipt, south.receipt,
        "neither tenant sees the other's receipt"
    );
    assert_eq!(
        south.receipt.as_ref().unwrap()["idempotency_key"],
        json!("south-shop:refund-a")
    );
    cleanup(env).await;
}

#[tokio::test]
async fn bad_messages_are_rejected_or_dead_lettered_and_the_worker_keeps_serving() {
    let (env, _ds, mut w, _) = setup("", false).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    let cases: Vec<(&str, Vec<u8>, Option<&str>)> = vec![
        ("not json", b"this is not json".to_vec(), None),
        ("unknown field", br#"{"tenant":"north-shop","action_id":"bad-1","tool":"refund","arguments":{},"amount":1}"#.to_vec(), Some("unknown_field")),
        ("missing field", br#"{"tenant":"north-shop","action_id":"bad-2","tool":"refund"}"#.to_vec(), Some("missing_field")),
        ("wrong type", br#"{"tenant":"north-shop","action_id":"bad-3","tool":"refund","arguments":[1]}"#.to_vec(), Some("wrong_type")),
        ("empty tenant", br#"{"tenant":"","action_id":"bad-4","tool":"refund","arguments":{}}"#.to_vec(), None),
        ("oversized", format!(r#"{{"tenant":"north-shop","action_id":"bad-5","tool":"refund","arguments":{{"x":"{}"}}}}"#, "a".repeat(300 * 1024)).into_bytes(), None),
    ];
    for (_, body, _) in &cases {
        agent.send_raw("north-shop", body).await;
    }
    agent
        .request("north-shop", "bad-6", "teleport", json!({}))
        .await;
    // Readable keys get a rejected result with a specific detail.
    let mut rejected = Vec::new();
    while rejected.len() < 4 {
        let ev = agent.next("north-shop", T).await;
        assert_eq!(ev.status, Status::Rejected, "{ev:?}");
        rejected.push(ev);
    }
    for (_, _, code) in cases.iter().filter(|c| c.2.is_some()) {
        assert!(
            rejected
                .iter()
                .any(|e| e.reason == Some(RejectReason::InvalidMessage)
                    && e.detail.as_deref() == Some(code.unwrap())),
            "no rejection with detail {code:?}: {rejected:?}"
        );
    }
    assert!(rejected
        .iter()
        .any(|e| e.reason == Some(RejectReason::UnknownTool) && e.action_id == "bad-6"));
    // Every bad message has a copy in the dead-letter queue, with the reason.
    let mut copies = Vec::new();
    let deadline = tokio::time::Instant::now() + T;
    while copies.len() < 7 && tokio::time::Instant::now() < deadline {
        copies.extend(agent.drain_dead_letters(&env).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(copies.len(), 7, "one dead-letter copy per bad message");
    for c in &copies {
        let reason = c
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get("x-intent-worker-reason").cloned());
        assert!(reason.is_some(), "dead letter without a reason header");
    }
    // Still serving.
    assert!(w.is_running());
    agent
        .request("north-shop", "good-1", "refund", json!({"order": "o-1"}))
        .await;
    agent
        .until("north-shop", "good-1", Status::Succeeded, T)
        .await;
    assert_eq!(
        env.state("north-shop", "bad-1").await,
        "",
        "bad messages never became operations"
    );
    cleanup(env).await;
}

#[tokio::test]
async fn response_dropped_after_commit_is_pending_with_one_mutation_and_no_second_send() {
    let (env, ds, _w, _) = setup("", false).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    ds.fault(json!({"kind": "drop_after_commit", "key": "north-shop:deploy-7"}))
        .await;
    agent
        .request(
            "north-shop",
            "deploy-7",
            "deploy",
            json!({"service": "api", "version": "1.2.3"}),
        )
        .await;
    let ev = agent.next("north-shop", T).await;
    assert_eq!(ev.status, Status::Pending);
    assert_eq!(ev.receipt, None);
    assert_eq!(ev.next_action.as_deref(), Some("check_status"));
    // `none` capability: unknown, then held for a person at once; never sent again.
    let state = env.state("north-shop", "deploy-7").await;
    assert!(state == "unknown" || state == "held", "{state}");
    e2e::wait_for("held", T, || async {
        (env.state("north-shop", "deploy-7").await == "held").then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(env.mutations("north-shop:deploy-7").await, 1);
    assert_eq!(env.writes("north-shop:deploy-7").await, 1);
    cleanup(env).await;
}

#[tokio::test]
async fn tenant_must_be_proven_by_the_broker_validated_user_id() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = env.standard_tools(ds.port, "");
    let mut text = std::fs::read_to_string(&tools).unwrap();
    text.push_str("\n[auth]\nmode = \"user_id\"\nusers = { guest = [\"north-shop\"] }\n");
    std::fs::write(&tools, text).unwrap();
    let _w = Worker::start(&env, "w", &WorkerOptions::new(tools)).await;
    let mut agent = Agent::new(&env, &["north-shop", "south-shop"]).await;
    let body = |tenant: &str, id: &str| {
        serde_json::to_vec(&intent(tenant, id, "refund", json!({"order": id}))).unwrap()
    };
    publish_as(
        &env,
        &env.amqp_url,
        Some("guest"),
        "x",
        &[&body("north-shop", "r-ok")],
    )
    .await;
    publish_as(
        &env,
        &env.amqp_url,
        Some("guest"),
        "x",
        &[&body("south-shop", "r-spoof")],
    )
    .await;
    publish_as(
        &env,
        &env.amqp_url,
        None,
        "x",
        &[&body("north-shop", "r-anon")],
    )
    .await;
    agent
        .until("north-shop", "r-ok", Status::Succeeded, T)
        .await;
    let mut dead = Vec::new();
    let deadline = tokio::time::Instant::now() + T;
    while dead.len() < 2 && tokio::time::Instant::now() < deadline {
        dead.extend(agent.drain_dead_letters(&env).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        dead.len(),
        2,
        "the unproven intents are kept in the dead-letter queue"
    );
    for d in &dead {
        let reason = d
            .properties
            .headers()
            .as_ref()
            .unwrap()
            .inner()
            .get("x-intent-worker-reason")
            .cloned();
        assert_eq!(
            format!("{reason:?}"),
            format!(
                "{:?}",
                Some(lapin::types::AMQPValue::LongString(
                    "tenant_mismatch".into()
                ))
            )
        );
    }
    assert_eq!(
        env.state("south-shop", "r-spoof").await,
        "",
        "never recorded"
    );
    assert_eq!(env.writes("south-shop:r-spoof").await, 0);
    assert!(
        agent
            .try_next("south-shop", Duration::from_millis(500))
            .await
            .is_none(),
        "nothing is sent to the claimed tenant"
    );
    cleanup(env).await;
}

#[tokio::test]
async fn sigterm_lets_in_flight_work_finish_and_publish() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    // A roomy request timeout and lease: the answer takes 1.5 s, and on a loaded machine
    // more; the subject here is shutdown, not a timeout.
    let mut opts = WorkerOptions::new(env.standard_tools_timed(ds.port, 8000, ""));
    opts.lease_secs = 20;
    ds.fault(json!({"kind": "slow", "delay_ms": 1500, "key": "north-shop:refund-g"}))
        .await;
    let mut w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    agent
        .request("north-shop", "refund-g", "refund", json!({"order": "o-g"}))
        .await;
    e2e::wait_for("dispatching", T, || async {
        (env.state("north-shop", "refund-g").await == "dispatching").then_some(())
    })
    .await;
    let code = w.terminate(Duration::from_secs(15));
    assert_eq!(code, Some(0), "graceful exit");
    assert_eq!(
        env.state("north-shop", "refund-g").await,
        "succeeded",
        "in-flight work finished"
    );
    let ev = agent.succeeded("north-shop", "refund-g").await;
    assert!(ev.receipt.is_some(), "its result was published before exit");
    assert_eq!(env.writes("north-shop:refund-g").await, 1);
    cleanup(env).await;
}

#[tokio::test]
async fn an_existing_intents_queue_with_other_arguments_is_used_with_a_warning() {
    use lapin::options::QueueDeclareOptions;
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    // An operator created the queue as a plain classic queue.
    let conn = lapin::Connection::connect(&env.amqp_url, Default::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        env.topology.intents_queue.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        Default::default(),
    )
    .await
    .unwrap();
    let _ = conn.close(200, "".into()).await;
    let w = Worker::start(
        &env,
        "w",
        &WorkerOptions::new(env.standard_tools(ds.port, "")),
    )
    .await;
    assert!(
        w.output
            .contains("exists with other arguments; using it as it is"),
        "{}",
        w.output.text()
    );
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    agent
        .request("north-shop", "refund-q", "refund", json!({"order": "o-q"}))
        .await;
    agent
        .until("north-shop", "refund-q", Status::Succeeded, T)
        .await;
    cleanup(env).await;
}

/// The harness itself: a test's `cleanup` deletes its queues while its workers may still run.
/// A running worker sees its queue deleted, reconnects (within ~250 ms) and declares it again,
/// which left ~100 queues behind per full run until cleanup stopped the test's workers first.
#[tokio::test]
async fn cleanup_leaves_no_queue_behind_while_a_worker_still_runs() {
    let (env, _ds, mut w, _) = setup("", false).await;
    let (url, queues) = (
        env.amqp_url.clone(),
        [
            env.topology.intents_queue.clone(),
            env.topology.dead_letter_queue.clone(),
        ],
    );
    cleanup(env).await;
    // Longer than the worker's first reconnect delays (250 ms, 500 ms, jittered).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let conn = lapin::Connection::connect(&url, Default::default())
        .await
        .unwrap();
    let mut left = Vec::new();
    for q in queues {
        // A passive declare of a missing queue closes the channel with 404: use one per queue.
        let ch = conn.create_channel().await.unwrap();
        let found = ch
            .queue_declare(
                q.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await;
        if found.is_ok() {
            // Leave nothing behind even when the assertion fails.
            let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
            left.push(q);
        }
    }
    let _ = conn.close(200, "".into()).await;
    assert!(left.is_empty(), "queues left after cleanup: {left:?}");
    assert!(!w.is_running(), "cleanup stopped the test's worker");
}

/// An agent may bound how long an intent waits for a worker with a per-message TTL. Once the
/// worker has taken it and dead-lettered it, that TTL must not make the copy vanish from the
/// dead-letter queue before an operator has looked.
#[tokio::test]
async fn a_dead_letter_outlives_the_ttl_its_intent_was_published_with() {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
    let (env, _ds, mut w, _) = setup("", false).await;
    let conn = lapin::Connection::connect(&env.amqp_url, Default::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let props = lapin::BasicProperties::default()
        .with_content_type("application/json".into())
        .with_expiration("1500".into())
        .with_message_id("ttl-{\"quoted\"}".into());
    let confirm = ch
        .basic_publish(
            env.topology.intents_exchange.as_str().into(),
            "north-shop".into(),
            BasicPublishOptions::default(),
            b"{ not json, short-lived",
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack());
    let depth = || async {
        ch.queue_declare(
            env.topology.dead_letter_queue.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await
        .map(|q| q.message_count())
        .unwrap_or(0)
    };
    let deadline = tokio::time::Instant::now() + T;
    while depth().await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the bad intent was never dead-lettered"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Well past the TTL: the copy is still there, with no expiration of its own.
    tokio::time::sleep(Duration::from_millis(3000)).await;
    assert_eq!(
        depth().await,
        1,
        "the dead letter expired with its intent's TTL"
    );
    let agent = Agent::new(&env, &["north-shop"]).await;
    let copies = agent.drain_dead_letters(&env).await;
    assert_eq!(copies.len(), 1);
    assert_eq!(copies[0].properties.expiration(), &None);
    assert_eq!(
        copies[0]
            .properties
            .message_id()
            .as_ref()
            .map(|m| m.as_str()),
        Some("ttl-{\"quoted\"}"),
        "the rest of the original's properties travel with the copy"
    );
    assert!(w.is_running());
    let _ = conn.close(200, "".into()).await;
    cleanup(env).await;
}

/// The pace holds a stage only while it is saturated: intents 50 ms apart, each done with a
/// stage well before the next arrives, cross every stage at once even with a pace of 100 ms.
/// Counted on the ledger's own clock, where an operation's `created_at` and `finished_at` are
/// the starts of the admission's and the completion's transactions: a pace that held every
/// batch would start them 100 ms apart, two intents each. A few may still share a batch where
/// one took longer than 50 ms on a busy machine (then the stage is saturated). (Batches paced
/// under saturation: `batch::tests` in the worker.)
#[tokio::test]
async fn a_stream_the_worker_keeps_up_with_is_not_held_by_the_pace() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts =
        WorkerOptions::new(env.standard_tools(ds.port, "")).env("WORKER_BATCH_PACE_MS", "100");
    let _w = Worker::start(&env, "w1", &opts).await;
    let agent = Agent::new(&env, &["north-shop"]).await;
    let ids: Vec<String> = (0..20).map(|i| format!("paced-{i}")).collect();
    for id in &ids {
        agent
            .request(
                "north-shop",
                id,
                "ticket",
                json!({"order": id, "amount_cents": 100, "currency": "USD"}),
            )
            .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for id in &ids {
        assert_eq!(env.final_state("north-shop", id, T).await, "succeeded");
        assert_eq!(env.mutations(&format!("north-shop:{id}")).await, 1);
    }
    let (admissions, completions): (i64, i64) = sqlx::query_as(
        "SELECT count(DISTINCT created_at), count(DISTINCT finished_at) FROM operations
         WHERE tenant = 'north-shop' AND action_id LIKE 'paced-%'",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(
        admissions >= 16 && completions >= 16,
        "{admissions} admissions and {completions} completions for 20 intents 50 ms apart: \
         held by the pace"
    );
    cleanup(env).await;
}
