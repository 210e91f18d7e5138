//! The deliberately broken modes: each breaks exactly one property a declared capability
//! relies on, and keeps the others, so `worker check-tool` can be shown to catch each one.

mod common;

use common::{Downstream, TestDb};
use serde_json::json;

#[tokio::test]
async fn replay_new_receipt_needs_a_key_but_never_replays() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "t:new-receipt";
    let body = json!({"order": "o-1"});
    let no_key = ds.post("/replay-new-receipt/r", None, &body).await.http();
    assert_eq!(no_key.status, 400);
    let a = ds
        .post("/replay-new-receipt/r", Some(key), &body)
        .await
        .http();
    let b = ds
        .post("/replay-new-receipt/r", Some(key), &body)
        .await
        .http();
    assert_eq!((a.status, b.status), (201, 201));
    assert_ne!(a.body["receipt_id"], b.body["receipt_id"]);
    assert_eq!(b.body["idempotency_key"], key);
    assert_eq!(db.mutations(key).await, 2);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn replay_ignores_body_replays_same_body_and_writes_another() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "t:ignores-body";
    let a = ds
        .post("/replay-ignores-body/r", Some(key), &json!({"x": 1}))
        .await
        .http();
    let same = ds
        .post("/replay-ignores-body/r", Some(key), &json!({"x": 1}))
        .await
        .http();
    assert_eq!(same.body, a.body, "a same-body repeat replays");
    let other = ds
        .post("/replay-ignores-body/r", Some(key), &json!({"x": 2}))
        .await
        .http();
    assert_eq!(other.status, 201);
    assert_ne!(other.body["receipt_id"], a.body["receipt_id"]);
    assert_eq!(db.mutations(key).await, 2);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn replay_racy_replays_in_sequence_but_not_under_concurrency() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "t:racy-seq";
    let body = json!({"x": 1});
    let a = ds.post("/replay-racy/r", Some(key), &body).await.http();
    let b = ds.post("/replay-racy/r", Some(key), &body).await.http();
    assert_eq!(a.body, b.body);
    let c = ds
        .post("/replay-racy/r", Some(key), &json!({"x": 2}))
        .await
        .http();
    assert_eq!(c.status, 422);
    assert_eq!(db.mutations(key).await, 1);

    let key = "t:racy-par";
    let (a, b) = tokio::join!(
        ds.post("/replay-racy/r", Some(key), &body),
        ds.post("/replay-racy/r", Some(key), &body)
    );
    let (a, b) = (a.http(), b.http());
    assert_eq!((a.status, b.status), (201, 201));
    assert_ne!(a.body["receipt_id"], b.body["receipt_id"]);
    assert_eq!(db.mutations(key).await, 2);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn lookup_phantom_finds_real_records_and_invents_the_rest() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "t:written";
    let written = ds
        .post("/lookup-phantom/r", Some(key), &json!({"x": 1}))
        .await
        .http();
    let found = ds.get("/lookup-phantom/r/by-key/t%3Awritten").await.http();
    assert_eq!((found.status, &found.body), (200, &written.body));
    let invented = ds.get("/lookup-phantom/r/by-key/t%3Anever").await.http();
    assert_eq!(invented.status, 200);
    assert_eq!(invented.body["idempotency_key"], "t:never");
    assert!(invented.body["receipt_id"]
        .as_str()
        .unwrap()
        .starts_with("rcpt-phantom-"));
    assert_eq!(db.mutations("t:never").await, 0);
    ds.kill().await;
    db.drop_db().await;
}
