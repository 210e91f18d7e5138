//! Fault injection: each kind, its effect on the data and on the wire.

mod common;

use std::time::Duration;

use common::{Downstream, Reply, TestDb};
use serde_json::json;

#[tokio::test]
async fn drop_after_commit_commits_then_sends_nothing() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "t:dropped";
    ds.arm(json!({"kind": "drop_after_commit", "key": key}))
        .await;
    let body = json!({"amount": 1});

    let reply = ds.post("/replay/refunds", Some(key), &body).await;
    // SO_LINGER 0: the client sees a reset, not a polite EOF.
    assert!(matches!(reply, Reply::NoBytes { reset: true }), "{reply:?}");
    assert_eq!(db.mutations(key).await, 1, "the write committed");
    assert_eq!(
        db.request_log(key).await,
        vec![("write".into(), None, Some("drop_after_commit".into()))]
    );

    // Recovery by replay gets the committed receipt; the fault was used up.
    let replayed = ds.post("/replay/refunds", Some(key), &body).await.http();
    assert_eq!(replayed.status, 201);
    assert_eq!(db.mutations(key).await, 1);
    let looked_up = ds
        .get(&format!("/replay/refunds/by-key/{key}"))
        .await
        .http();
    assert_eq!(looked_up.body, replayed.body);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn drop_before_commit_does_nothing() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    ds.arm(json!({"kind": "drop_before_commit"})).await;
    let reply = ds.post("/none/refunds", Some("t:before"), &json!({})).await;
    assert!(matches!(reply, Reply::NoBytes { .. }), "{reply:?}");
    assert_eq!(db.mutations("t:before").await, 0);
    assert_eq!(db.write_requests("t:before").await, 1);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn wrong_receipt_commits_but_names_another_operation() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "t:wrong";
    ds.arm(json!({"kind": "wrong_receipt"})).await;
    let reply = ds
        .post("/lookup/refunds", Some(key), &json!({"a": 1}))
        .await
        .http();
    assert_eq!(reply.status, 201);
    assert_eq!(reply.body["idempotency_key"], "someone-else:other-action");
    assert!(reply.body["receipt_id"]
        .as_str()
        .unwrap()
        .starts_with("rcpt-wrong-"));
    assert_eq!(db.mutations(key).await, 1);
    // The real receipt is still there to look up.
    let real = ds
        .get(&format!("/lookup/refunds/by-key/{key}"))
        .await
        .http();
    assert_eq!(real.body["idempotency_key"], key);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn status_fault_answers_without_touching_data() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "t:limited";
    ds.arm(json!({"kind": "status", "status": 429, "retry_after": "2", "times": 2, "key": key}))
        .await;
    // Another key is not affected by a keyed fault.
    let other = ds
        .post("/none/refunds", Some("t:other"), &json!({}))
        .await
        .http();
    assert_eq!(other.status, 201);
    for _ in 0..2 {
        let r = ds
            .post("/replay/refunds", Some(key), &json!({}))
            .await
            .http();
        assert_eq!(r.status, 429);
        assert_eq!(r.header("retry-after"), Some("2"));
    }
    assert_eq!(db.mutations(key).await, 0);
    let ok = ds
        .post("/replay/refunds", Some(key), &json!({}))
        .await
        .http();
    assert_eq!(ok.status, 201);
    assert_eq!(db.mutations(key).await, 1);
    let statuses: Vec<_> = db
        .request_log(key)
        .await
        .into_iter()
        .map(|(_, s, f)| (s, f))
        .collect();
    assert_eq!(
        statuses,
        vec![
            (Some(429), Some("status".into())),
            (Some(429), Some("status".into())),
            (Some(201), None)
        ]
    );
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn after_commit_faults_commit_first() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    ds.arm(json!({"kind": "status_after_commit", "key": "t:500"}))
        .await;
    let r = ds
        .post("/none/refunds", Some("t:500"), &json!({}))
        .await
        .http();
    assert_eq!(r.status, 500);
    assert_eq!(db.mutations("t:500").await, 1);

    // The client gives up before the slow answer arrives: the write is done.
    ds.arm(json!({"kind": "slow_after_commit", "delay_ms": 1500, "key": "t:slow"}))
        .await;
    let timed_out = tokio::time::timeout(
        Duration::from_millis(300),
        ds.post("/none/refunds", Some("t:slow"), &json!({})),
    )
    .await;
    assert!(timed_out.is_err());
    assert_eq!(db.mutations("t:slow").await, 1);

    ds.arm(json!({"kind": "slow", "delay_ms": 200})).await;
    let started = std::time::Instant::now();
    let r = ds
        .post("/none/refunds", Some("t:slow2"), &json!({}))
        .await
        .http();
    assert_eq!(r.status, 201);
    assert!(started.elapsed() >= Duration::from_millis(200));
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn lookup_miss_hides_an_existing_record_once() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    ds.post("/lookup/refunds", Some("t:miss"), &json!({}))
        .await
        .http();
    ds.arm(json!({"kind": "lookup_miss"})).await;
    let miss = ds.get("/lookup/refunds/by-key/t:miss").await.http();
    assert_eq!(miss.status, 404);
    let hit = ds.get("/lookup/refunds/by-key/t:miss").await.http();
    assert_eq!(hit.status, 200);
    let log = db.request_log("t:miss").await;
    assert_eq!(
        log[1],
        ("lookup".into(), Some(404), Some("lookup_miss".into()))
    );
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn control_api_lists_and_clears() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    ds.arm(json!({"kind": "slow", "delay_ms": 10, "times": 3}))
        .await;
    ds.arm(json!({"kind": "lookup_miss"})).await;
    let listed = common::send(ds.port, "GET", "/_control/faults", &[], b"")
        .await
        .http();
    let faults = listed.body["faults"].as_array().unwrap();
    assert_eq!(faults.len(), 2);
    assert_eq!(faults[0]["times"], 3);
    assert_eq!(faults[1]["on"], "lookup");
    let bad = common::send(
        ds.port,
        "POST",
        "/_control/faults",
        &[],
        br#"{"kind":"explode"}"#,
    )
    .await
    .http();
    assert_eq!(bad.status, 400);
    let cleared = common::send(ds.port, "DELETE", "/_control/faults", &[], b"")
        .await
        .http();
    assert_eq!(cleared.body, json!({"cleared": 2}));
    // Control requests are not business requests.
    let logged: i64 = sqlx::query_scalar("SELECT count(*) FROM downstream.requests")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(logged, 0);
    ds.kill().await;
    db.drop_db().await;
}
