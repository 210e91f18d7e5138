//! Request deadlines: a write carrying `Request-Deadline` commits only if the deadline has
//! not passed at its commit point (database clock, plus `DOWNSTREAM_CLOCK_OFFSET_MS`);
//! otherwise it rolls back and answers 422 `deadline_passed`.

mod common;

use std::time::Duration;

use common::{send, Downstream, HttpReply, TestDb};
use serde_json::{json, Value};
use sqlx::types::chrono::{DateTime, FixedOffset, Utc};

/// The database clock now: deadlines are relative to it, not to this process's clock.
async fn db_now(db: &TestDb) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// The database clock now, moved by `ms`, as an RFC 3339 deadline with milliseconds.
async fn deadline(db: &TestDb, ms: i64) -> String {
    rfc3339(shift(db_now(db).await, ms))
}

/// `t` moved by `ms` (negative: earlier).
fn shift(t: DateTime<Utc>, ms: i64) -> DateTime<Utc> {
    let by = Duration::from_millis(ms.unsigned_abs());
    if ms < 0 {
        t - by
    } else {
        t + by
    }
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string()
}

async fn post_by(
    ds: &Downstream,
    path: &str,
    key: Option<&str>,
    deadline: &str,
    body: &Value,
) -> HttpReply {
    ds.post_with(path, key, &[("Request-Deadline", deadline)], body)
        .await
        .http()
}

/// A 422 `deadline_passed` for `sent`, whose `at` is past it.
fn assert_late(reply: &HttpReply, sent: &str) {
    assert_eq!(reply.status, 422, "{:?}", reply.body);
    assert_eq!(reply.body["error"], "deadline_passed");
    assert_eq!(reply.body["deadline"], sent, "the deadline as received");
    let at = reply.body["at"].as_str().expect("at");
    assert!(
        at.ends_with('Z') && at.len() == 24,
        "RFC 3339 with ms: {at}"
    );
    let at = DateTime::parse_from_rfc3339(at).unwrap();
    assert!(
        at > DateTime::parse_from_rfc3339(sent).unwrap(),
        "{at} vs {sent}"
    );
}

async fn async_jobs(db: &TestDb, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM downstream.async_jobs WHERE idem_key = $1")
        .bind(key)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_live_deadline_commits() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let body = json!({"amount": 5});
    for mode in ["lookup", "replay"] {
        let key = format!("t:live-{mode}");
        let live = deadline(&db, 60_000).await;
        let reply = post_by(&ds, &format!("/{mode}/r"), Some(&key), &live, &body).await;
        assert_eq!(reply.status, 201, "{mode}: {:?}", reply.body);
        assert_eq!(db.mutations(&key).await, 1, "{mode}");
        let found = ds.get(&format!("/{mode}/r/by-key/{key}")).await.http();
        assert_eq!((found.status, &found.body), (200, &reply.body), "{mode}");
    }
    // Any RFC 3339 offset.
    let key = "t:live-offset";
    let plus_two = FixedOffset::east_opt(2 * 3600).unwrap();
    let live = shift(db_now(&db).await, 60_000)
        .with_timezone(&plus_two)
        .to_rfc3339();
    assert!(live.ends_with("+02:00"), "{live}");
    let reply = post_by(&ds, "/none/r", Some(key), &live, &body).await;
    assert_eq!(reply.status, 201);
    assert_eq!(db.mutations(key).await, 1);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn a_past_deadline_writes_nothing() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let body = json!({"amount": 5});
    for mode in ["lookup", "replay", "none", "replay-racy", "lookup-phantom"] {
        let key = format!("t:late-{mode}");
        let past = deadline(&db, -1_000).await;
        let reply = post_by(&ds, &format!("/{mode}/r"), Some(&key), &past, &body).await;
        assert_late(&reply, &past);
        assert_eq!(db.mutations(&key).await, 0, "{mode}");
        assert_eq!(
            db.request_log(&key).await,
            vec![("write".into(), Some(422), None)],
            "{mode}"
        );
        if mode == "lookup" || mode == "replay" {
            let found = ds.get(&format!("/{mode}/r/by-key/{key}")).await.http();
            assert_eq!(found.status, 404, "{mode}: {:?}", found.body);
        }
    }
    // The key was not kept either: the same key without a deadline is a new write.
    let retry = ds
        .post("/replay/r", Some("t:late-replay"), &body)
        .await
        .http();
    assert_eq!(retry.status, 201);
    assert_eq!(db.mutations("t:late-replay").await, 1);

    // Async: no job, no mutation, and the by-key lookup does not find one.
    let key = "t:late-async";
    let past = deadline(&db, -1_000).await;
    let reply = post_by(&ds, "/async/deployments", Some(key), &past, &body).await;
    assert_late(&reply, &past);
    assert_eq!(db.mutations(key).await, 0);
    assert_eq!(async_jobs(&db, key).await, 0);
    let found = ds
        .get(&format!("/async/deployments/by-key/{key}"))
        .await
        .http();
    assert_eq!(found.status, 404);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn a_replay_after_the_deadline_is_answered_from_the_receipt() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "t:replayed-late";
    let body = json!({"amount": 5});
    let live = deadline(&db, 60_000).await;
    let first = post_by(&ds, "/replay/r", Some(key), &live, &body).await;
    assert_eq!(first.status, 201);
    let past = deadline(&db, -1_000).await;
    let repeat = post_by(&ds, "/replay/r", Some(key), &past, &body).await;
    assert_eq!((repeat.status, &repeat.body), (201, &first.body));
    let other = post_by(&ds, "/replay/r", Some(key), &past, &json!({"amount": 6})).await;
    assert_eq!(other.status, 422);
    assert_eq!(other.body, json!({"error": "idempotency_key_reused"}));
    assert_eq!(db.mutations(key).await, 1);

    // Async likewise: a repeat finds the job it created.
    let key = "t:async-replayed-late";
    let accepted = post_by(&ds, "/async/deployments", Some(key), &live, &body).await;
    assert_eq!(accepted.status, 202);
    let repeat = post_by(&ds, "/async/deployments", Some(key), &past, &body).await;
    assert_eq!(repeat.status, 202);
    assert_eq!(repeat.body["operation_id"], accepted.body["operation_id"]);
    assert_eq!(async_jobs(&db, key).await, 1);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn a_malformed_deadline_is_refused_before_anything() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "t:malformed";
    ds.arm(json!({"kind": "status", "key": key})).await;
    for bad in [
        "tomorrow",
        "2026-12-06",
        "2026-12-06T11:30:00",
        "1765020600",
    ] {
        let reply = post_by(&ds, "/lookup/r", Some(key), bad, &json!({})).await;
        assert_eq!(reply.status, 400, "{bad}");
        assert_eq!(reply.body, json!({"error": "bad_deadline"}), "{bad}");
    }
    assert_eq!(db.mutations(key).await, 0);
    let log = db.request_log(key).await;
    assert_eq!(log.len(), 4);
    assert!(log
        .iter()
        .all(|row| *row == ("write".into(), Some(400), None)));
    // The fault is still armed: validation consumed none.
    let faults = send(ds.port, "GET", "/_control/faults", &[], b"")
        .await
        .http();
    assert_eq!(faults.body["faults"].as_array().unwrap().len(), 1);
    // Lookups ignore the header.
    let found = send(
        ds.port,
        "GET",
        "/lookup/r/by-key/t%3Amalformed",
        &[("Request-Deadline", "tomorrow")],
        b"",
    )
    .await
    .http();
    assert_eq!(found.status, 404);
    assert_eq!(found.body, json!({"error": "not_found"}));
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn a_slow_fault_past_the_deadline_ends_in_422() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "t:slow";
    ds.arm(json!({"kind": "slow", "key": key, "delay_ms": 1500}))
        .await;
    let soon = deadline(&db, 500).await;
    let started = std::time::Instant::now();
    let reply = post_by(&ds, "/lookup/r", Some(key), &soon, &json!({})).await;
    assert!(started.elapsed() >= Duration::from_millis(1500));
    assert_late(&reply, &soon);
    assert_eq!(db.mutations(key).await, 0);
    assert_eq!(
        db.request_log(key).await,
        vec![("write".into(), Some(422), Some("slow".into()))]
    );
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn the_clock_offset_moves_the_commit_point() {
    let db = TestDb::create().await;
    let body = json!({});

    let ahead = Downstream::start_with(&db, &[("DOWNSTREAM_CLOCK_OFFSET_MS", "+60000")]).await;
    let key = "t:ahead";
    let in_30s = deadline(&db, 30_000).await;
    let reply = post_by(&ahead, "/lookup/r", Some(key), &in_30s, &body).await;
    assert_late(&reply, &in_30s);
    let at = DateTime::parse_from_rfc3339(reply.body["at"].as_str().unwrap()).unwrap();
    assert!(at >= shift(db_now(&db).await, 50_000), "at {at} is ahead");
    assert_eq!(db.mutations(key).await, 0);
    ahead.kill().await;

    let behind = Downstream::start_with(&db, &[("DOWNSTREAM_CLOCK_OFFSET_MS", "-60000")]).await;
    let key = "t:behind";
    let ago_30s = deadline(&db, -30_000).await;
    let reply = post_by(&behind, "/lookup/r", Some(key), &ago_30s, &body).await;
    assert_eq!(reply.status, 201, "{:?}", reply.body);
    assert_eq!(db.mutations(key).await, 1);
    behind.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn lookup_ignores_deadline_commits_late_writes() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "t:ignored";
    let past = deadline(&db, -60_000).await;
    let written = post_by(
        &ds,
        "/lookup-ignores-deadline/r",
        Some(key),
        &past,
        &json!({"x": 1}),
    )
    .await;
    assert_eq!(written.status, 201, "{:?}", written.body);
    assert_eq!(written.body["mode"], "lookup-ignores-deadline");
    assert_eq!(db.mutations(key).await, 1);
    let found = ds
        .get("/lookup-ignores-deadline/r/by-key/t%3Aignored")
        .await
        .http();
    assert_eq!((found.status, &found.body), (200, &written.body));
    let missing = ds
        .get("/lookup-ignores-deadline/r/by-key/t%3Anever")
        .await
        .http();
    assert_eq!(missing.status, 404);
    // It does not even read the header.
    let unread = post_by(
        &ds,
        "/lookup-ignores-deadline/r",
        Some(key),
        "not a time",
        &json!({"x": 1}),
    )
    .await;
    assert_eq!(unread.status, 201);
    assert_eq!(db.mutations(key).await, 2, "no dedupe, as lookup");
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn the_deadline_header_name_is_configurable() {
    let db = TestDb::create().await;
    let ds = Downstream::start_with(&db, &[("DOWNSTREAM_DEADLINE_HEADER", "X-Commit-By")]).await;
    let past = deadline(&db, -1_000).await;
    // Header names are case-insensitive.
    let key = "t:custom";
    let reply = ds
        .post_with(
            "/lookup/r",
            Some(key),
            &[("x-commit-by", &past)],
            &json!({}),
        )
        .await
        .http();
    assert_late(&reply, &past);
    assert_eq!(db.mutations(key).await, 0);
    // The default name means nothing now.
    let key = "t:default-name";
    let reply = post_by(&ds, "/lookup/r", Some(key), &past, &json!({})).await;
    assert_eq!(reply.status, 201);
    assert_eq!(db.mutations(key).await, 1);
    ds.kill().await;
    db.drop_db().await;
}
