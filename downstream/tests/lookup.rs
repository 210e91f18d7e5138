//! Lookup and none modes: no dedupe; lookup by key only where supported.

mod common;

use common::{Downstream, TestDb};
use serde_json::json;

#[tokio::test]
async fn lookup_mode_duplicates_writes_and_finds_the_first_receipt() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "north-shop:refund 7/a";
    let encoded = "north-shop%3Arefund%207%2Fa";

    let missing = ds
        .get(&format!("/lookup/refunds/by-key/{encoded}"))
        .await
        .http();
    assert_eq!(missing.status, 404);
    assert_eq!(missing.body, json!({"error": "not_found"}));

    let body = json!({"order": "order-731"});
    let first = ds.post("/lookup/refunds", Some(key), &body).await.http();
    let second = ds.post("/lookup/refunds", Some(key), &body).await.http();
    assert_eq!((first.status, second.status), (201, 201));
    assert_ne!(first.body["receipt_id"], second.body["receipt_id"]);
    assert_eq!(db.mutations(key).await, 2, "a resend visibly duplicates");

    let found = ds
        .get(&format!("/lookup/refunds/by-key/{encoded}"))
        .await
        .http();
    assert_eq!(found.status, 200);
    assert_eq!(found.body, first.body);
    // Another resource does not see it.
    let other = ds
        .get(&format!("/lookup/tickets/by-key/{encoded}"))
        .await
        .http();
    assert_eq!(other.status, 404);

    let log = db.request_log(key).await;
    let kinds: Vec<&str> = log.iter().map(|(k, _, _)| k.as_str()).collect();
    assert_eq!(kinds, ["lookup", "write", "write", "lookup", "lookup"]);
    assert_eq!(db.write_requests(key).await, 2);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn replay_mode_supports_lookup_none_mode_does_not() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let created = ds
        .post("/replay/refunds", Some("k1"), &json!({"a": 1}))
        .await
        .http();
    let found = ds.get("/replay/refunds/by-key/k1").await.http();
    assert_eq!((found.status, &found.body), (200, &created.body));

    let none = ds
        .post("/none/refunds", Some("k2"), &json!({"a": 1}))
        .await
        .http();
    assert_eq!(none.status, 201);
    assert_eq!(none.body["mode"], "none");
    let again = ds
        .post("/none/refunds", None, &json!({"a": 1}))
        .await
        .http();
    assert!(again.body["idempotency_key"].is_null());
    let unsupported = ds.get("/none/refunds/by-key/k2").await.http();
    assert_eq!(unsupported.status, 404);
    assert_eq!(unsupported.body, json!({"error": "lookup_not_supported"}));
    assert_eq!(
        db.request_log("k2").await[1],
        ("lookup".into(), Some(404), None)
    );

    let unknown = ds
        .post("/sometimes/refunds", Some("k3"), &json!({}))
        .await
        .http();
    assert_eq!(unknown.status, 404);
    assert_eq!(
        db.request_log("k3").await,
        vec![("write".into(), Some(404), None)]
    );
    assert_eq!(ds.get("/healthz").await.http().status, 200);
    ds.kill().await;
    db.drop_db().await;
}
