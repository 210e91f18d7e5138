//! Async mode: `POST /async/{resource}` answers 202 with an operation id, the job ends
//! later, and its status URL (`GET /async/operations/{id}`) tells how.

mod common;

use std::time::{Duration, Instant};

use common::{Downstream, HttpReply, Reply, TestDb};
use serde_json::{json, Value};

/// Jobs that must not end during a test.
const FOREVER: (&str, &str) = ("DOWNSTREAM_ASYNC_DELAY_MS", "600000");

fn op_id(reply: &HttpReply) -> String {
    reply.body["operation_id"].as_str().unwrap().to_owned()
}

async fn status(ds: &Downstream, operation_id: &str) -> HttpReply {
    ds.get(&format!("/async/operations/{operation_id}"))
        .await
        .http()
}

/// Poll the status URL until the job has ended (or `timeout`); returns the last answer.
async fn wait_ended(ds: &Downstream, operation_id: &str, timeout: Duration) -> HttpReply {
    let deadline = Instant::now() + timeout;
    loop {
        let reply = status(ds, operation_id).await;
        if reply.status == 200 && reply.body["state"] != "running" || Instant::now() > deadline {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Status reads (polls) logged for one operation.
async fn polls(db: &TestDb, operation_id: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM downstream.requests WHERE kind = 'status' AND operation_id = $1",
    )
    .bind(operation_id)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// (kind, status, fault, operation_id) of every request for one key, oldest first.
async fn async_log(
    db: &TestDb,
    key: &str,
) -> Vec<(String, Option<i32>, Option<String>, Option<String>)> {
    sqlx::query_as(
        "SELECT kind, status, fault, operation_id FROM downstream.requests
         WHERE idem_key = $1 ORDER BY id",
    )
    .bind(key)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

async fn jobs_for(db: &TestDb, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM downstream.async_jobs WHERE idem_key = $1")
        .bind(key)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_write_is_accepted_with_an_operation_id_and_a_replay_finds_the_same_job() {
    let db = TestDb::create().await;
    let ds = Downstream::start_with(&db, &[FOREVER]).await;
    let key = "north-shop:deploy-17";
    let body = json!({"app": "web", "version": "2.4.1", "region": "eu-west"});

    let first = ds.post("/async/deployments", Some(key), &body).await.http();
    assert_eq!(first.status, 202, "{:?}", first.body);
    let op = op_id(&first);
    assert!(op.starts_with("op-"), "{op}");
    assert_eq!(first.body["idempotency_key"], key);
    assert_eq!(first.body["state"], "running");
    assert_eq!(
        first.body["status_url"],
        format!("/async/operations/{op}").as_str()
    );
    assert_eq!(first.header("location"), first.body["status_url"].as_str());
    assert_eq!(first.body["arguments"], body);
    assert!(first.body.get("deployment_id").is_none());

    // The same body in another key order is the same request: the same job.
    let reordered = json!({"region": "eu-west", "version": "2.4.1", "app": "web"});
    let replay = ds
        .post("/async/deployments", Some(key), &reordered)
        .await
        .http();
    assert_eq!(replay.status, 202);
    assert_eq!(replay.body, first.body, "the same job, still running");

    let read = status(&ds, &op).await;
    assert_eq!(read.status, 200);
    for field in ["operation_id", "idempotency_key", "state", "arguments"] {
        assert_eq!(read.body[field], first.body[field], "{field}");
    }
    assert!(read.body["created_at"].as_str().unwrap().contains('T'));

    // One job and one business change; two sends, each naming the operation.
    assert_eq!(jobs_for(&db, key).await, 1);
    assert_eq!(db.mutations(key).await, 1);
    assert_eq!(db.write_requests(key).await, 2);
    assert_eq!(polls(&db, &op).await, 1);
    assert_eq!(
        async_log(&db, key).await,
        vec![
            ("write".into(), Some(202), None, Some(op.clone())),
            ("write".into(), Some(202), None, Some(op.clone())),
            ("status".into(), Some(200), None, Some(op.clone())),
        ]
    );
    let modes: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT mode FROM downstream.requests WHERE idem_key = $1")
            .bind(key)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(modes, ["async"]);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn a_job_succeeds_after_the_delay_and_a_replay_then_shows_the_ending() {
    let db = TestDb::create().await;
    let ds = Downstream::start_with(&db, &[("DOWNSTREAM_ASYNC_DELAY_MS", "400")]).await;
    let key = "t:done";
    let body = json!({"app": "web"});
    let started = Instant::now();
    let accepted = ds.post("/async/deployments", Some(key), &body).await.http();
    assert_eq!(accepted.status, 202);
    let op = op_id(&accepted);

    let done = wait_ended(&ds, &op, Duration::from_secs(10)).await;
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert_eq!(done.status, 200);
    assert_eq!(done.body["state"], "succeeded", "{:?}", done.body);
    let deployment = done.body["deployment_id"].as_str().unwrap();
    assert!(deployment.starts_with("dep-"), "{deployment}");
    assert_eq!(done.body["receipt_id"], deployment);
    assert!(done.body.get("error").is_none());
    // Stable once ended.
    assert_eq!(status(&ds, &op).await.body, done.body);

    // A replay after the end still answers 202 with the same operation and its state.
    let replay = ds.post("/async/deployments", Some(key), &body).await.http();
    assert_eq!(replay.status, 202);
    assert_eq!(replay.body, done.body);

    let reads: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM downstream.requests WHERE kind = 'status' AND idem_key = $1",
    )
    .bind(key)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(reads >= 2);
    assert_eq!(polls(&db, &op).await, reads);
    assert_eq!(db.write_requests(key).await, 2);
    assert_eq!(db.mutations(key).await, 1);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn async_fail_ends_the_job_failed_after_a_per_key_delay() {
    let db = TestDb::create().await;
    let ds = Downstream::start_with(&db, &[FOREVER]).await;
    let key = "t:fail";
    ds.arm(json!({"kind": "async_fail", "key": key})).await;
    ds.arm(json!({"kind": "async_delay", "key": key, "ms": 300}))
        .await;
    // Another key gets neither (the global delay: it stays running).
    let other = ds
        .post("/async/deployments", Some("t:other"), &json!({}))
        .await
        .http();
    let started = Instant::now();
    let accepted = ds
        .post("/async/deployments", Some(key), &json!({"app": "api"}))
        .await
        .http();
    assert_eq!(accepted.body["state"], "running");
    let failed = wait_ended(&ds, &op_id(&accepted), Duration::from_secs(10)).await;
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(failed.body["state"], "failed", "{:?}", failed.body);
    assert_eq!(
        failed.body["error"],
        "deployment failed: health checks did not pass"
    );
    assert!(failed.body.get("deployment_id").is_none());
    assert!(failed.body.get("receipt_id").is_none());
    assert_eq!(status(&ds, &op_id(&other)).await.body["state"], "running");
    // Both job faults were used up by the job they shaped.
    let listed = common::send(ds.port, "GET", "/_control/faults", &[], b"")
        .await
        .http();
    assert_eq!(listed.body["faults"], json!([]));
    // The request log names no consumed fault: job faults shape the job, not the answer.
    assert_eq!(async_log(&db, key).await[0].2, None);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn async_stuck_never_ends() {
    let db = TestDb::create().await;
    let ds = Downstream::start_with(&db, &[("DOWNSTREAM_ASYNC_DELAY_MS", "50")]).await;
    let key = "t:stuck";
    ds.arm(json!({"kind": "async_stuck", "key": key})).await;
    let accepted = ds
        .post("/async/deployments", Some(key), &json!({}))
        .await
        .http();
    let op = op_id(&accepted);
    // A job without a fault ends after 50 ms.
    let normal = ds
        .post("/async/deployments", Some("t:normal"), &json!({}))
        .await
        .http();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        status(&ds, &op_id(&normal)).await.body["state"],
        "succeeded"
    );
    let read = status(&ds, &op).await;
    assert_eq!(read.status, 200);
    assert_eq!(read.body["state"], "running");
    assert!(read.body.get("deployment_id").is_none());
    let ends_at: Option<String> = sqlx::query_scalar(
        "SELECT ends_at::text FROM downstream.async_jobs WHERE operation_id = $1",
    )
    .bind(&op)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(ends_at, None);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn status_not_found_hides_a_new_job_from_its_status_url_for_a_while() {
    let db = TestDb::create().await;
    let ds = Downstream::start_with(&db, &[FOREVER]).await;
    let key = "t:eventual";
    ds.arm(json!({"kind": "status_not_found", "key": key, "ms": 700}))
        .await;
    let started = Instant::now();
    let accepted = ds
        .post("/async/deployments", Some(key), &json!({}))
        .await
        .http();
    assert_eq!(accepted.status, 202);
    let op = op_id(&accepted);

    let hidden = status(&ds, &op).await;
    assert_eq!(hidden.status, 404);
    assert_eq!(hidden.body, json!({"error": "not_found"}));
    // Only the status URL: the by-key lookup sees the job.
    let by_key = ds
        .get(&format!("/async/deployments/by-key/{key}"))
        .await
        .http();
    assert_eq!(by_key.status, 200);
    assert_eq!(by_key.body["operation_id"], op.as_str());

    let visible = loop {
        let read = status(&ds, &op).await;
        if read.status == 200 || started.elapsed() > Duration::from_secs(10) {
            break read;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert!(started.elapsed() >= Duration::from_millis(700));
    assert_eq!(visible.status, 200);
    assert_eq!(visible.body["state"], "running");
    let log = async_log(&db, key).await;
    assert_eq!(
        log[1],
        (
            "status".into(),
            Some(404),
            Some("status_not_found".into()),
            Some(op.clone())
        )
    );
    assert_eq!(
        log.last().unwrap(),
        &("status".into(), Some(200), None, Some(op.clone()))
    );
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn status_error_answers_503_to_the_next_reads_of_that_job() {
    let db = TestDb::create().await;
    let ds = Downstream::start_with(&db, &[FOREVER]).await;
    let key = "t:flaky-status";
    let accepted = ds
        .post("/async/deployments", Some(key), &json!({}))
        .await
        .http();
    let other = ds
        .post("/async/deployments", Some("t:steady"), &json!({}))
        .await
        .http();
    let op = op_id(&accepted);
    ds.arm(json!({"kind": "status_error", "key": key, "count": 2}))
        .await;
    // Matched by the job's key: another job's status is untouched.
    assert_eq!(status(&ds, &op_id(&other)).await.status, 200);
    for _ in 0..2 {
        let read = status(&ds, &op).await;
        assert_eq!(read.status, 503);
        assert_eq!(read.body["error"], "injected_fault");
        assert_eq!(read.body["fault"], "status_error");
    }
    assert_eq!(status(&ds, &op).await.status, 200);
    let reads: Vec<_> = async_log(&db, key)
        .await
        .into_iter()
        .filter(|(kind, ..)| kind == "status")
        .map(|(_, status, fault, _)| (status, fault))
        .collect();
    assert_eq!(
        reads,
        vec![
            (Some(503), Some("status_error".into())),
            (Some(503), Some("status_error".into())),
            (Some(200), None),
        ]
    );
    assert_eq!(polls(&db, &op).await, 3);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn status_slow_delays_a_status_read() {
    let db = TestDb::create().await;
    let ds = Downstream::start_with(&db, &[FOREVER]).await;
    let key = "t:slow-status";
    let op = op_id(
        &ds.post("/async/deployments", Some(key), &json!({}))
            .await
            .http(),
    );
    ds.arm(json!({"kind": "status_slow", "key": key, "ms": 400}))
        .await;
    // A client that gives up first sees nothing; the read is still logged.
    let gave_up = tokio::time::timeout(Duration::from_millis(100), status(&ds, &op)).await;
    assert!(gave_up.is_err());
    // times defaults to 1: the next read is not delayed.
    let started = Instant::now();
    assert_eq!(status(&ds, &op).await.status, 200);
    assert!(started.elapsed() < Duration::from_millis(400));

    ds.arm(json!({"kind": "status_slow", "key": key, "delay_ms": 300}))
        .await;
    let started = Instant::now();
    let slow = status(&ds, &op).await;
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(slow.status, 200);
    assert_eq!(slow.body["state"], "running");
    let faults: Vec<Option<String>> = async_log(&db, key)
        .await
        .into_iter()
        .filter(|(kind, ..)| kind == "status")
        .map(|(_, _, fault, _)| fault)
        .collect();
    assert_eq!(
        faults,
        [Some("status_slow".into()), None, Some("status_slow".into())]
    );
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn drop_after_commit_keeps_the_job_and_a_replay_returns_its_operation_id() {
    let db = TestDb::create().await;
    let ds = Downstream::start_with(&db, &[FOREVER]).await;
    let key = "t:lost-acceptance";
    let body = json!({"app": "web"});
    ds.arm(json!({"kind": "drop_after_commit", "key": key}))
        .await;
    // A job fault for the same key is taken by the same write.
    ds.arm(json!({"kind": "async_fail", "key": key})).await;

    let lost = ds.post("/async/deployments", Some(key), &body).await;
    assert!(matches!(lost, Reply::NoBytes { reset: true }), "{lost:?}");
    assert_eq!(jobs_for(&db, key).await, 1, "the job committed");

    let found = ds
        .get(&format!("/async/deployments/by-key/{key}"))
        .await
        .http();
    assert_eq!(found.status, 200);
    let op = op_id(&found);
    assert_eq!(status(&ds, &op).await.body["state"], "running");

    let replay = ds.post("/async/deployments", Some(key), &body).await.http();
    assert_eq!(replay.status, 202);
    assert_eq!(op_id(&replay), op);
    assert_eq!(db.mutations(key).await, 1);
    assert_eq!(db.write_requests(key).await, 2);
    let outcome: String =
        sqlx::query_scalar("SELECT outcome FROM downstream.async_jobs WHERE idem_key = $1")
            .bind(key)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(outcome, "failed");
    let log = async_log(&db, key).await;
    assert_eq!(
        log[0],
        (
            "write".into(),
            None,
            Some("drop_after_commit".into()),
            Some(op.clone())
        ),
        "the dropped send still names the operation it created"
    );
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn other_write_faults_apply_to_async_writes() {
    let db = TestDb::create().await;
    let ds = Downstream::start_with(&db, &[FOREVER]).await;
    let key = "t:faulted";
    ds.arm(json!({"kind": "status", "key": key, "status": 429, "retry_after": "1"}))
        .await;
    ds.arm(json!({"kind": "drop_before_commit", "key": key}))
        .await;
    let limited = ds
        .post("/async/deployments", Some(key), &json!({}))
        .await
        .http();
    assert_eq!(limited.status, 429);
    assert_eq!(limited.header("retry-after"), Some("1"));
    let dropped = ds.post("/async/deployments", Some(key), &json!({})).await;
    assert!(matches!(dropped, Reply::NoBytes { .. }), "{dropped:?}");
    assert_eq!(jobs_for(&db, key).await, 0, "neither touched any data");

    ds.arm(json!({"kind": "wrong_receipt", "key": key})).await;
    let wrong = ds
        .post("/async/deployments", Some(key), &json!({}))
        .await
        .http();
    assert_eq!(wrong.status, 202);
    assert_eq!(wrong.body["idempotency_key"], "someone-else:other-action");
    assert!(op_id(&wrong).starts_with("op-wrong-"));
    assert_eq!(jobs_for(&db, key).await, 1, "committed all the same");
    let real = ds
        .get(&format!("/async/deployments/by-key/{key}"))
        .await
        .http();
    assert_eq!(real.body["idempotency_key"], key);

    // A status read can be answered for the wrong operation too (on=status).
    ds.arm(json!({"kind": "wrong_receipt", "on": "status", "key": key}))
        .await;
    let misread = status(&ds, &op_id(&real)).await;
    assert_eq!(misread.status, 200);
    assert!(op_id(&misread).starts_with("op-wrong-"));
    assert_eq!(misread.body["arguments"], real.body["arguments"]);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn a_restart_keeps_the_jobs_their_endings_and_their_clocks() {
    let db = TestDb::create().await;
    let ds = Downstream::start_with(&db, &[FOREVER]).await;
    let failing = "t:restart-fail";
    ds.arm(json!({"kind": "async_fail", "key": failing})).await;
    ds.arm(json!({"kind": "async_delay", "key": failing, "ms": 1500}))
        .await;
    ds.arm(json!({"kind": "async_stuck", "key": "t:restart-stuck"}))
        .await;
    let started = Instant::now();
    let fail_op = op_id(
        &ds.post("/async/deployments", Some(failing), &json!({"n": 1}))
            .await
            .http(),
    );
    let stuck_op = op_id(
        &ds.post("/async/deployments", Some("t:restart-stuck"), &json!({}))
            .await
            .http(),
    );
    let running_op = op_id(
        &ds.post("/async/deployments", Some("t:restart-run"), &json!({}))
            .await
            .http(),
    );
    ds.arm(json!({"kind": "status_error", "times": 100})).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    ds.kill().await;

    // Restarted with a short global delay: jobs keep the delay they were created with.
    let ds = Downstream::start_with(&db, &[("DOWNSTREAM_ASYNC_DELAY_MS", "1")]).await;
    // The end is 1.5 s after creation, not after the restart (which came 1 s later).
    let until = Duration::from_millis(1700);
    if let Some(rest) = until.checked_sub(started.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    let failed = status(&ds, &fail_op).await;
    assert_eq!(failed.status, 200, "the status_error fault was forgotten");
    assert_eq!(failed.body["state"], "failed", "{:?}", failed.body);
    assert_eq!(
        failed.body["error"],
        "deployment failed: health checks did not pass"
    );
    assert_eq!(status(&ds, &stuck_op).await.body["state"], "running");
    assert_eq!(status(&ds, &running_op).await.body["state"], "running");

    let replay = ds
        .post("/async/deployments", Some(failing), &json!({"n": 1}))
        .await
        .http();
    assert_eq!((replay.status, op_id(&replay)), (202, fail_op));
    assert_eq!(db.mutations(failing).await, 1);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn another_body_or_resource_under_a_known_key_is_422() {
    let db = TestDb::create().await;
    let ds = Downstream::start_with(&db, &[FOREVER]).await;
    let key = "t:reused";
    let first = ds
        .post("/async/deployments", Some(key), &json!({"version": "1"}))
        .await
        .http();
    assert_eq!(first.status, 202);
    let changed = ds
        .post("/async/deployments", Some(key), &json!({"version": "2"}))
        .await
        .http();
    assert_eq!(changed.status, 422);
    assert_eq!(changed.body, json!({"error": "idempotency_key_reused"}));
    let elsewhere = ds
        .post("/async/exports", Some(key), &json!({"version": "1"}))
        .await
        .http();
    assert_eq!(elsewhere.status, 422);
    assert_eq!(jobs_for(&db, key).await, 1);
    assert_eq!(db.mutations(key).await, 1);
    assert_eq!(db.write_requests(key).await, 3);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn lookup_by_key_finds_the_job_on_its_resource() {
    let db = TestDb::create().await;
    let ds = Downstream::start_with(&db, &[FOREVER]).await;
    let key = "tenant:payout-9";
    let accepted = ds
        .post("/async/payouts", Some(key), &json!({"amount": "10.00"}))
        .await
        .http();
    let op = op_id(&accepted);
    let found = ds
        .get("/async/payouts/by-key/tenant%3Apayout-9")
        .await
        .http();
    assert_eq!(found.status, 200);
    assert_eq!(found.body, status(&ds, &op).await.body);
    assert_eq!(found.body["state"], "running");

    let missing = ds.get("/async/payouts/by-key/tenant%3Anone").await.http();
    assert_eq!(missing.status, 404);
    assert_eq!(missing.body, json!({"error": "not_found"}));
    let other_resource = ds
        .get("/async/refunds/by-key/tenant%3Apayout-9")
        .await
        .http();
    assert_eq!(other_resource.status, 404);

    ds.arm(json!({"kind": "lookup_miss"})).await;
    assert_eq!(
        ds.get("/async/payouts/by-key/tenant%3Apayout-9")
            .await
            .http()
            .status,
        404
    );
    let lookups: Vec<(Option<i32>, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT status, fault, operation_id FROM downstream.requests
         WHERE kind = 'lookup' AND mode = 'async' AND idem_key = $1 ORDER BY id",
    )
    .bind(key)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        lookups,
        vec![
            (Some(200), None, Some(op.clone())),
            (Some(404), None, None),
            (Some(404), Some("lookup_miss".into()), None),
        ]
    );
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn bad_async_requests_are_refused_and_logged() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let no_key = ds
        .post("/async/deployments", None, &json!({"a": 1}))
        .await
        .http();
    assert_eq!(no_key.status, 400);
    assert_eq!(no_key.body["error"], "idempotency_key_required");
    let not_object = ds
        .post("/async/deployments", Some("t:array"), &json!([1]))
        .await
        .http();
    assert_eq!(not_object.status, 400);
    assert_eq!(not_object.body["error"], "body_must_be_json_object");
    assert_eq!(jobs_for(&db, "t:array").await, 0);

    let unknown = status(&ds, "op-999999").await;
    assert_eq!(unknown.status, 404);
    assert_eq!(unknown.body, json!({"error": "not_found"}));
    assert_eq!(polls(&db, "op-999999").await, 1);
    let empty = ds.get("/async/operations/").await.http();
    assert_eq!(empty.status, 400);
    assert_eq!(empty.body["error"], "bad_status_path");

    let kinds: Vec<(String, Option<i32>)> =
        sqlx::query_as("SELECT kind, status FROM downstream.requests ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        kinds,
        vec![
            ("write".into(), Some(400)),
            ("write".into(), Some(400)),
            ("status".into(), Some(404)),
            ("status".into(), Some(400)),
        ]
    );
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn concurrent_same_key_writes_start_one_job() {
    let db = TestDb::create().await;
    let ds = Downstream::start_with(&db, &[FOREVER]).await;
    let key = "t:concurrent-async";
    let port = ds.port;
    let mut handles = Vec::new();
    for _ in 0..8 {
        handles.push(tokio::spawn(async move {
            common::send(
                port,
                "POST",
                "/async/deployments",
                &[("Idempotency-Key", key)],
                br#"{"app": "web"}"#,
            )
            .await
            .http()
        }));
    }
    let mut ids = Vec::new();
    for handle in handles {
        let reply = handle.await.unwrap();
        assert_eq!(reply.status, 202);
        ids.push(op_id(&reply));
    }
    assert!(ids.iter().all(|id| *id == ids[0]), "{ids:?}");
    assert_eq!(jobs_for(&db, key).await, 1);
    assert_eq!(db.mutations(key).await, 1);
    assert_eq!(db.write_requests(key).await, 8);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn a_request_log_from_before_status_reads_accepts_them() {
    let db = TestDb::create().await;
    // The request log as it was before status reads and operation ids.
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
    let ds = Downstream::start_with(&db, &[FOREVER]).await;
    let op = op_id(
        &ds.post("/async/deploys", Some("t:new"), &json!({}))
            .await
            .http(),
    );
    assert_eq!(status(&ds, &op).await.status, 200);
    assert_eq!(polls(&db, &op).await, 1);
    assert_eq!(db.write_requests("t:old").await, 1);
    ds.kill().await;
    // A second start finds the schema as it left it.
    let ds = Downstream::start(&db).await;
    assert_eq!(status(&ds, &op).await.status, 200);
    assert_eq!(polls(&db, &op).await, 2);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn bad_job_faults_are_refused() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    for bad in [
        json!({"kind": "async_delay", "key": "k"}),
        json!({"kind": "status_not_found", "key": "k"}),
        json!({"kind": "status_error", "on": "write"}),
        json!({"kind": "async_stuck", "on": "status"}),
    ] {
        let reply = common::send(
            ds.port,
            "POST",
            "/_control/faults",
            &[],
            bad.to_string().as_bytes(),
        )
        .await
        .http();
        assert_eq!(reply.status, 400, "{bad}");
        assert_eq!(reply.body["error"], "bad_fault");
    }
    let armed: Value = common::send(
        ds.port,
        "POST",
        "/_control/faults",
        &[],
        br#"{"kind": "status_error", "key": "k", "count": 3}"#,
    )
    .await
    .http()
    .body;
    assert_eq!(
        (&armed["on"], &armed["times"], &armed["status"]),
        (&json!("status"), &json!(3), &json!(503))
    );
    ds.kill().await;
    db.drop_db().await;
}
