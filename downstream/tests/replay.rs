//! Replay mode: durable idempotency keys that return the original receipt.

mod common;

use common::{Downstream, TestDb};
use serde_json::json;

#[tokio::test]
async fn same_key_replays_the_original_receipt_and_changed_body_is_422() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "north-shop:refund-204";
    let body = json!({"order": "order-731", "amount": "48.50", "currency": "USD"});

    let first = ds.post("/replay/refunds", Some(key), &body).await.http();
    assert_eq!(first.status, 201);
    assert_eq!(first.header("content-type"), Some("application/json"));
    assert_eq!(first.header("connection"), Some("close"));
    assert_eq!(first.body["idempotency_key"], key);
    assert_eq!(first.body["mode"], "replay");
    assert_eq!(first.body["resource"], "refunds");
    assert_eq!(first.body["arguments"], body);
    assert!(first.body["receipt_id"]
        .as_str()
        .unwrap()
        .starts_with("rcpt-"));

    // Same arguments in another key order: still the same body.
    let reordered = json!({"currency": "USD", "amount": "48.50", "order": "order-731"});
    let second = ds
        .post("/replay/refunds", Some(key), &reordered)
        .await
        .http();
    assert_eq!(second.status, 201);
    assert_eq!(
        second.body, first.body,
        "the original receipt, byte for byte"
    );

    assert_eq!(db.mutations(key).await, 1);
    assert_eq!(db.write_requests(key).await, 2);

    let changed = json!({"order": "order-731", "amount": "99.00", "currency": "USD"});
    let reused = ds.post("/replay/refunds", Some(key), &changed).await.http();
    assert_eq!(reused.status, 422);
    assert_eq!(reused.body, json!({"error": "idempotency_key_reused"}));
    assert_eq!(db.mutations(key).await, 1);
    assert_eq!(db.write_requests(key).await, 3);

    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn replay_requires_a_key_and_a_json_object() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let no_key = ds
        .post("/replay/refunds", None, &json!({"a": 1}))
        .await
        .http();
    assert_eq!(no_key.status, 400);
    assert_eq!(no_key.body["error"], "idempotency_key_required");
    let not_object = ds
        .post("/replay/refunds", Some("k-array"), &json!([1]))
        .await
        .http();
    assert_eq!(not_object.status, 400);
    // Rejected requests are still logged, with their status.
    assert_eq!(
        db.request_log("k-array").await,
        vec![("write".into(), Some(400), None)]
    );
    assert_eq!(db.mutations("k-array").await, 0);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn concurrent_same_key_writes_make_one_mutation() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "t:concurrent";
    let body = json!({"amount": 1});
    let port = ds.port;
    let mut handles = Vec::new();
    for _ in 0..8 {
        let body = body.to_string();
        handles.push(tokio::spawn(async move {
            common::send(
                port,
                "POST",
                "/replay/refunds",
                &[("Idempotency-Key", key)],
                body.as_bytes(),
            )
            .await
            .http()
        }));
    }
    let mut receipts = Vec::new();
    for h in handles {
        let r = h.await.unwrap();
        assert_eq!(r.status, 201);
        receipts.push(r.body);
    }
    assert!(receipts.iter().all(|r| *r == receipts[0]));
    assert_eq!(db.mutations(key).await, 1);
    assert_eq!(db.write_requests(key).await, 8);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn expired_keys_are_forgotten() {
    let db = TestDb::create().await;
    // Zero retention: any key from an earlier transaction has expired.
    let ds = Downstream::start_with(&db, &[("DOWNSTREAM_REPLAY_RETENTION_SECS", "0")]).await;
    let key = "t:expired";
    let body = json!({"amount": 1});
    let first = ds.post("/replay/refunds", Some(key), &body).await.http();
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let second = ds.post("/replay/refunds", Some(key), &body).await.http();
    assert_eq!((first.status, second.status), (201, 201));
    assert_ne!(first.body["receipt_id"], second.body["receipt_id"]);
    assert_eq!(
        db.mutations(key).await,
        2,
        "a replay after expiry duplicates"
    );
    ds.kill().await;
    db.drop_db().await;
}
