//! The request log keeps the W3C trace context each business request carried, so a test can
//! tell from the downstream's own table which trace every send and lookup belonged to.

mod common;

use common::{send, trace_log, Downstream, TestDb};
use serde_json::json;

const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const OTHER_PARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";

#[tokio::test]
async fn writes_and_lookups_record_their_trace_context_or_null() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "north-shop:refund-traced";
    let body = json!({"order": "order-731"}).to_string();

    let traced = send(
        ds.port,
        "POST",
        "/lookup/refunds",
        &[
            ("Content-Type", "application/json"),
            ("Idempotency-Key", key),
            ("traceparent", PARENT),
            ("tracestate", "vendor=abc,other=1"),
        ],
        body.as_bytes(),
    )
    .await
    .http();
    assert_eq!(traced.status, 201);
    let untraced = ds
        .post("/lookup/refunds", Some(key), &json!({"order": "order-731"}))
        .await
        .http();
    assert_eq!(untraced.status, 201);
    // A sender may split tracestate over several field lines; HTTP joins them with ','.
    let lookup = send(
        ds.port,
        "GET",
        "/lookup/refunds/by-key/north-shop%3Arefund-traced",
        &[
            ("TraceParent", OTHER_PARENT),
            ("tracestate", "a=1"),
            ("tracestate", "b=2"),
        ],
        b"",
    )
    .await
    .http();
    assert_eq!(lookup.status, 200);
    let bare_lookup = ds
        .get("/lookup/refunds/by-key/north-shop%3Arefund-traced")
        .await
        .http();
    assert_eq!(bare_lookup.status, 200);

    assert_eq!(
        trace_log(&db, key).await,
        vec![
            (
                "write".into(),
                Some(PARENT.into()),
                Some("vendor=abc,other=1".into())
            ),
            ("write".into(), None, None),
            (
                "lookup".into(),
                Some(OTHER_PARENT.into()),
                Some("a=1,b=2".into())
            ),
            ("lookup".into(), None, None),
        ]
    );
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn refused_and_faulted_requests_still_record_what_they_carried() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "t:refused";
    // Not validated: a malformed traceparent is kept as sent, so a test sees what went out.
    let refused = send(
        ds.port,
        "POST",
        "/replay/refunds",
        &[
            ("Idempotency-Key", key),
            ("traceparent", "not-a-traceparent"),
        ],
        b"[]",
    )
    .await
    .http();
    assert_eq!(refused.status, 400);
    ds.arm(json!({"kind": "drop_after_commit", "key": key}))
        .await;
    let dropped = send(
        ds.port,
        "POST",
        "/replay/refunds",
        &[("Idempotency-Key", key), ("traceparent", PARENT)],
        b"{}",
    )
    .await;
    assert!(
        matches!(dropped, common::Reply::NoBytes { .. }),
        "{dropped:?}"
    );
    assert_eq!(
        trace_log(&db, key).await,
        vec![
            ("write".into(), Some("not-a-traceparent".into()), None),
            ("write".into(), Some(PARENT.into()), None),
        ]
    );
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn a_request_log_from_before_trace_context_gains_the_columns_and_keeps_its_rows() {
    let db = TestDb::create().await;
    // The table as it was before the trace context columns, with a row in it.
    sqlx::raw_sql(
        "CREATE SCHEMA downstream;
         CREATE TABLE downstream.requests (
             id bigserial PRIMARY KEY,
             kind text NOT NULL CHECK (kind IN ('write', 'lookup')),
             mode text NULL, resource text NULL, idem_key text NULL,
             status int NULL, fault text NULL,
             at timestamptz NOT NULL DEFAULT now(), replied_at timestamptz NULL);
         INSERT INTO downstream.requests (kind, mode, resource, idem_key, status)
         VALUES ('write', 'none', 'deploys', 't:old', 201);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let ds = Downstream::start(&db).await;
    let created = send(
        ds.port,
        "POST",
        "/none/deploys",
        &[("Idempotency-Key", "t:old"), ("traceparent", PARENT)],
        b"{}",
    )
    .await
    .http();
    assert_eq!(created.status, 201);
    assert_eq!(
        trace_log(&db, "t:old").await,
        vec![
            ("write".into(), None, None),
            ("write".into(), Some(PARENT.into()), None),
        ]
    );
    ds.kill().await;
    db.drop_db().await;
}
