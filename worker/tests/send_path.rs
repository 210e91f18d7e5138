//! The send path's ledger statements against a real Postgres, on its clock: the send fence of a
//! dispatch and of a replay and the retry token bucket.

mod common;

use std::time::Duration;

use common::*;
use worker::ledger::State;
use worker::retry::BudgetPolicy;

const LEASE: Duration = Duration::from_secs(3);
const TIMEOUT: Duration = Duration::from_secs(2);

/// Seconds from the database's now() to a timestamp column of the row.
async fn secs_ahead(db: &TestDb, id: i64, column: &str) -> f64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT extract(epoch FROM {column} - now())::float8 FROM operations WHERE id = $1"
    )))
    .bind(id)
    .fetch_one(db.pool())
    .await
    .unwrap()
}

/// The database's clock, in seconds since the epoch.
async fn db_clock(db: &TestDb) -> f64 {
    sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
        .fetch_one(db.pool())
        .await
        .unwrap()
}

/// Asserts that a statement run after `before` (the database's clock just before it) set
/// `column` to its own `now()` plus `secs`. Measured against the clocks around the statement,
/// not a later `now()`, so a busy machine pausing between the statement and this check does
/// not fail it.
async fn assert_set_ahead(db: &TestDb, id: i64, column: &str, before: f64, secs: f64) {
    let after = db_clock(db).await;
    let at: f64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT extract(epoch FROM {column})::float8 FROM operations WHERE id = $1"
    )))
    .bind(id)
    .fetch_one(db.pool())
    .await
    .unwrap();
    // Float seconds since the epoch keep about a microsecond.
    let slack = 0.001;
    assert!(
        at - before >= secs - slack && at - after <= secs + slack,
        "{column} should be {secs} s past the statement's start, which lies between {before} \
         and {after}: it is {at}"
    );
}

async fn set(db: &TestDb, id: i64, assignment: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE operations SET {assignment} WHERE id = $1"
    )))
    .bind(id)
    .execute(db.pool())
    .await
    .unwrap();
}

/// The row's stored `send_deadline`.
async fn send_deadline(db: &TestDb, id: i64) -> Option<chrono::DateTime<chrono::Utc>> {
    sqlx::query_scalar("SELECT send_deadline FROM operations WHERE id = $1")
        .bind(id)
        .fetch_one(db.pool())
        .await
        .unwrap()
}

/// A send fence of `id` at `fence` for a tool without `absence_proof`.
fn send(id: i64, fence: i64) -> worker::ledger::SendFence {
    worker::ledger::SendFence {
        id,
        fence,
        timeout: TIMEOUT,
        deadline: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dispatch_fence_needs_this_fence_and_a_live_lease_and_renews_it_past_the_timeout() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let op = dispatching(&ctx, "north", "fence-1", "refund").await;
    let l = &db.ledger;
    assert!(l
        .fence_send(send(op.id, op.fence + 1), WORKER_ID, LEASE)
        .await
        .unwrap()
        .is_none());
    assert!(l
        .fence_send(send(op.id, op.fence), "another-worker", LEASE)
        .await
        .unwrap()
        .is_none());
    let before = db_clock(&db).await;
    assert!(l
        .fence_send(send(op.id, op.fence), WORKER_ID, LEASE)
        .await
        .unwrap()
        .is_some());
    // The lease is renewed to timeout + lease ahead.
    assert_set_ahead(&db, op.id, "lease_until", before, 5.0).await;
    // The lease ran out on the database clock (a paused worker): no send.
    set(&db, op.id, "lease_until = now() - interval '1 millisecond'").await;
    assert!(l
        .fence_send(send(op.id, op.fence), WORKER_ID, LEASE)
        .await
        .unwrap()
        .is_none());
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_with_a_deadline_stores_it_on_the_database_clock_and_never_lowers_it() {
    use std::time::Duration;
    use worker::ledger::SendFence;
    let db = TestDb::new().await;
    let ctx = context(&db);
    let op = dispatching(&ctx, "north", "deadline-1", "ticket").await;
    let l = &db.ledger;
    let with = |deadline_ms: u64| SendFence {
        deadline: Some(Duration::from_millis(deadline_ms)),
        ..send(op.id, op.fence)
    };
    let before = db_clock(&db).await;
    let passed = l.fence_send(with(30_000), WORKER_ID, LEASE).await.unwrap();
    assert_set_ahead(&db, op.id, "send_deadline", before, 30.0).await;
    let stored = send_deadline(&db, op.id)
        .await
        .expect("a deadline is stored");
    assert_eq!(
        passed.unwrap().deadline,
        Some(stored),
        "the request carries what is stored"
    );
    // A later fence under a shorter deadline keeps the later one: an earlier request may still
    // be in flight until it.
    let passed = l.fence_send(with(1_000), WORKER_ID, LEASE).await.unwrap();
    assert_eq!(passed.unwrap().deadline, Some(stored));
    // A refused fence stores nothing.
    let other = SendFence {
        fence: op.fence + 1,
        ..with(60_000)
    };
    assert!(l
        .fence_send(other, WORKER_ID, LEASE)
        .await
        .unwrap()
        .is_none());
    assert!(secs_ahead(&db, op.id, "send_deadline").await < 31.0);
    // Without a deadline (the tool has no absence_proof): none carried, and none kept, since
    // that request may commit at any time.
    let plain = l
        .fence_send(send(op.id, op.fence), WORKER_ID, LEASE)
        .await
        .unwrap();
    assert_eq!(plain.unwrap().deadline, None);
    let kept = send_deadline(&db, op.id).await;
    assert_eq!(kept, None);
    // A row already sent without one (a second attempt, no deadline stored) gets none stored
    // from now on, though its requests still carry one.
    set(&db, op.id, "attempts = 2").await;
    let passed = l.fence_send(with(30_000), WORKER_ID, LEASE).await.unwrap();
    assert!(
        passed.unwrap().deadline.is_some(),
        "the request still carries a deadline"
    );
    let kept = send_deadline(&db, op.id).await;
    assert_eq!(
        kept, None,
        "no proof for a row once sent without a deadline"
    );
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replay_fence_needs_a_live_lease_and_an_answer_before_the_window_ends() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let op = unknown(&ctx, "north", "replay-1", "refund").await;
    assert_eq!(op.state(), State::Unknown);
    let l = &db.ledger;
    let (window, margin) = (Duration::from_secs(60), Duration::from_secs(1));
    // Leased by this worker, deadline 10 s away: 2 s timeout + 1 s margin fit.
    set(
        &db,
        op.id,
        &format!("lease_owner = '{WORKER_ID}', lease_until = now() + interval '30 seconds', replay_deadline = now() + interval '10 seconds'"),
    )
    .await;
    let before = db_clock(&db).await;
    assert!(l
        .begin_replay(op.id, op.fence, WORKER_ID, LEASE, TIMEOUT, window, margin)
        .await
        .unwrap());
    // The next round waits past this replay (timeout + lease).
    assert_set_ahead(&db, op.id, "next_attempt_at", before, 5.0).await;
    // 2.5 s left: a request sent now could be answered only 0.5 s before the end, inside the
    // 1 s margin.
    set(
        &db,
        op.id,
        "replay_deadline = now() + interval '2.5 seconds'",
    )
    .await;
    assert!(!l
        .begin_replay(op.id, op.fence, WORKER_ID, LEASE, TIMEOUT, window, margin)
        .await
        .unwrap());
    // No stored deadline: first dispatch + window decides (60 s ago here).
    set(
        &db,
        op.id,
        "replay_deadline = NULL, first_dispatch_at = now() - interval '60 seconds'",
    )
    .await;
    assert!(!l
        .begin_replay(op.id, op.fence, WORKER_ID, LEASE, TIMEOUT, window, margin)
        .await
        .unwrap());
    // Window open again, but the lease is gone.
    set(
        &db,
        op.id,
        "replay_deadline = now() + interval '1 hour', lease_until = now() - interval '1 millisecond'",
    )
    .await;
    assert!(!l
        .begin_replay(op.id, op.fence, WORKER_ID, LEASE, TIMEOUT, window, margin)
        .await
        .unwrap());
    let attempts: i32 = sqlx::query_scalar("SELECT attempts FROM operations WHERE id = $1")
        .bind(op.id)
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(
        attempts,
        op.attempts + 1,
        "only the one replay let out counted"
    );
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bucket_lets_retries_out_only_above_half_and_failed_ones_stay_spent() {
    let db = TestDb::new().await;
    let l = &db.ledger;
    // Capacity 2 x 6 x 100 / 60 = 20; the time refill (0.1/s) is negligible here.
    let policy = BudgetPolicy {
        ratio: 0.1,
        floor_per_minute: 6,
        window_secs: 100,
    };
    assert_eq!(l.retry_budget_available("t", &policy).await.unwrap(), 10.0);
    // A first failure is pending with the first spend: 20 - 0.5 = 19.5, then 10 retries leave
    // 9.5 (each spent above half).
    let mut sent = 0;
    while l
        .try_spend_retry("t", &policy, if sent == 0 { -0.5 } else { 0.0 })
        .await
        .unwrap()
    {
        sent += 1;
        assert!(sent <= 20, "the bucket never throttled");
    }
    assert_eq!(sent, 10);
    // Failed retries keep their tokens spent; a succeeded one earns 1 + ratio: above half again.
    l.adjust_retry_tokens("t", &policy, 1.1).await.unwrap();
    assert!(l.try_spend_retry("t", &policy, 0.0).await.unwrap());
    assert!(!l.try_spend_retry("t", &policy, 0.0).await.unwrap());
    // Failures never take the level below zero.
    l.adjust_retry_tokens("t", &policy, -1000.0).await.unwrap();
    let tokens: f64 = sqlx::query_scalar("SELECT tokens FROM retry_tokens WHERE tool = 't'")
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(tokens, 0.0);
    assert_eq!(l.retry_budget_available("t", &policy).await.unwrap(), 0.0);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_fence_checks_each_row_on_its_own() {
    use worker::ledger::SendFence;
    let db = TestDb::new().await;
    let ctx = context(&db);
    let live = dispatching(&ctx, "north", "batch-live", "refund").await;
    let stale = dispatching(&ctx, "north", "batch-stale", "refund").await;
    let expired = dispatching(&ctx, "north", "batch-expired", "refund").await;
    set(
        &db,
        expired.id,
        "lease_until = now() - interval '1 millisecond'",
    )
    .await;
    let sends = [
        SendFence {
            id: stale.id,
            fence: stale.fence + 1,
            timeout: TIMEOUT,
            deadline: None,
        },
        SendFence {
            id: live.id,
            fence: live.fence,
            timeout: TIMEOUT,
            deadline: None,
        },
        SendFence {
            id: expired.id,
            fence: expired.fence,
            timeout: TIMEOUT,
            deadline: None,
        },
    ];
    let before = db_clock(&db).await;
    let passed = db
        .ledger
        .fence_sends(&sends, WORKER_ID, LEASE)
        .await
        .unwrap();
    assert_eq!(
        passed.iter().map(Option::is_some).collect::<Vec<_>>(),
        vec![false, true, false],
        "one answer per send, in order"
    );
    // Only the live row renewed.
    assert_set_ahead(&db, live.id, "lease_until", before, 5.0).await;
    assert!(secs_ahead(&db, expired.id, "lease_until").await < 0.0);
    // Through the worker's batcher: the same answer.
    assert!(ctx
        .fences
        .fence_send(
            SendFence {
                id: live.id,
                fence: live.fence,
                timeout: TIMEOUT,
                deadline: None,
            },
            None,
            Some(ctx.fences.expect()),
        )
        .await
        .unwrap()
        .is_some());
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_batch_records_each_row_as_if_alone() {
    use worker::ledger::{Applied, Completion, Phase, Source, Transition};
    let db = TestDb::new().await;
    let ctx = context(&db);
    let a = dispatching(&ctx, "north", "done-a", "refund").await;
    let b = dispatching(&ctx, "north", "done-b", "refund").await;
    let late = succeeded(&ctx, "north", "done-late", "refund").await;
    let lost = dispatching(&ctx, "north", "done-lost", "refund").await;
    let receipt = |op: &worker::ledger::Operation, id: &str| Completion {
        operation_id: op.id,
        fence: op.fence,
        phase: Phase::Dispatch,
        by: Source::Dispatch,
        transition: Transition::Succeeded {
            receipt: worker::document::Document::from_value(receipt_for(
                "north",
                &op.action_id,
                id,
            )),
            receipt_id: id.into(),
            evidence: format!("receipt {id}"),
        },
        trace: None,
        dispatched: None,
    };
    let batch = vec![
        receipt(&a, "r-a"),
        // A stale owner's timeout: discarded, the row keeps its state.
        Completion {
            operation_id: lost.id,
            fence: lost.fence + 1,
            phase: Phase::Dispatch,
            by: Source::Dispatch,
            transition: Transition::Unknown {
                delay: Duration::ZERO,
                evidence: "timeout".into(),
            },
            trace: None,
            dispatched: None,
        },
        receipt(&late, "r-other"),
        receipt(&b, "r-b"),
    ];
    let results = db.ledger.complete(WORKER_ID, &batch).await;
    assert!(
        matches!(&results[0], Ok(Applied::Done(op)) if op.id == a.id && op.state() == State::Succeeded)
    );
    assert!(
        matches!(&results[1], Ok(Applied::Stale(Some(op))) if op.state() == State::Dispatching)
    );
    assert!(
        matches!(&results[2], Ok(Applied::LateReceiptConflict(op)) if op.receipt_id.as_deref() == Some("r-auto"))
    );
    assert!(
        matches!(&results[3], Ok(Applied::Done(op)) if op.id == b.id && op.receipt_id.as_deref() == Some("r-b"))
    );
    for (op, n) in [(&a, 1), (&b, 1), (&late, 1), (&lost, 0)] {
        let events = outbox_events(db.pool(), op.id).await;
        assert_eq!(events.len(), n, "events of {}: {events:?}", op.action_id);
        if n == 1 {
            assert_eq!(events[0].0, "succeeded");
        }
    }
    db.drop_db().await;
}

/// The consumer claims a new intent by inserting it `dispatching` (`Ledger::admit_claimed`);
/// the scheduler claims a `prepared` row by updating it (`Ledger::claim_prepared`). The two
/// statements spell the claim separately, so this holds them to the same result: every column
/// a send depends on, and the history row of the claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_by_insert_sets_what_a_claim_of_a_prepared_row_sets() {
    use worker::ledger::ReplayWindows;
    let db = TestDb::new().await;
    let l = &db.ledger;
    let windows = ReplayWindows::new([("refund".to_string(), Duration::from_secs(3600))]);
    let lease = Duration::from_secs(30);
    let admitted = l
        .admit(
            &[new_operation("north", "two-steps", "refund")],
            WORKER_ID,
            Duration::from_secs(3600),
        )
        .await
        .unwrap();
    let two_steps = l
        .claim_prepared(&[admitted[0].operation.id], WORKER_ID, lease, &windows)
        .await
        .unwrap()
        .remove(0);
    let one_step = l
        .admit_claimed(
            &[&new_operation("north", "one-step", "refund")],
            WORKER_ID,
            lease,
            &windows,
        )
        .await
        .unwrap()
        .remove(0);
    assert!(one_step.inserted);
    let pool = db.pool().clone();
    let claim = |id: i64| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, serde_json::Value>(
                "SELECT jsonb_build_object(
                'state', state, 'fence', fence, 'unsent_fence', unsent_fence,
                'lease_owner', lease_owner, 'attempts', attempts,
                'recovery_attempts', recovery_attempts, 'next_attempt_at', next_attempt_at,
                'changed_by', changed_by, 'evidence', evidence, 'receipt', receipt,
                'last_reported', last_reported, 'first_dispatch_now', first_dispatch_at = now(),
                'lease_secs', round(extract(epoch FROM lease_until - first_dispatch_at)),
                'deadline_secs', extract(epoch FROM replay_deadline - first_dispatch_at),
                'history', (SELECT jsonb_build_object('to', to_state, 'fence', h.fence,
                                'actor', actor, 'evidence', h.evidence, 'attempts', h.attempts,
                                'next_attempt_at', h.next_attempt_at)
                            FROM operation_history h WHERE h.operation_id = o.id
                            ORDER BY h.id DESC LIMIT 1))
             FROM operations o WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let expected = claim(two_steps.id).await;
    assert_eq!(claim(one_step.operation.id).await, expected);
    // And the claim is what a claim should be (not two equal mistakes).
    assert_eq!(expected["state"], "dispatching");
    assert_eq!(expected["fence"], 1);
    assert_eq!(expected["unsent_fence"], 1);
    assert_eq!(expected["attempts"], 1);
    assert_eq!(expected["deadline_secs"].as_f64(), Some(3600.0));
    assert_eq!(expected["lease_secs"].as_f64(), Some(30.0));
    db.drop_db().await;
}

/// Every column of an operation, in the order the worker's statements select them.
const COLUMNS: [&str; 33] = [
    "id",
    "tenant",
    "action_id",
    "tool",
    "fingerprint",
    "arguments",
    "call_id",
    "reply_to",
    "state",
    "fence",
    "lease_owner",
    "lease_until",
    "attempts",
    "recovery_attempts",
    "next_attempt_at",
    "first_dispatch_at",
    "replay_deadline",
    "receipt",
    "receipt_id",
    "evidence",
    "last_reported",
    "created_at",
    "updated_at",
    "state_since",
    "swept_at",
    "traceparent",
    "tracestate",
    "remote_id",
    "acceptance",
    "poll_deadline",
    "verified_by",
    "send_deadline",
    "compensates",
];

async fn read_as(
    db: &TestDb,
    id: i64,
    select: &str,
) -> Result<worker::ledger::Operation, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {select} FROM operations WHERE id = $1"
    )))
    .bind(id)
    .fetch_one(db.pool())
    .await
}

/// Rows that lead with the worker's column order are read by position; any other row by name.
/// Both read the same operation, and a value in the wrong column is never taken for another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_reads_the_same_whatever_the_order_of_its_columns() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let op = succeeded(&ctx, "north", r#"order-{"7"}\x"#, "refund").await;
    set(
        &db,
        op.id,
        "tracestate = 'vendor=\"q\"', traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'",
    )
    .await;
    let in_order = read_as(&db, op.id, &format!("{}, 1 AS extra", COLUMNS.join(", ")))
        .await
        .unwrap();
    let mut reversed = COLUMNS;
    reversed.reverse();
    let by_name = read_as(&db, op.id, &format!("2 AS extra, {}", reversed.join(", ")))
        .await
        .unwrap();
    assert_eq!(format!("{in_order:?}"), format!("{by_name:?}"));
    assert_eq!(in_order.action_id, r#"order-{"7"}\x"#);
    assert_eq!(in_order.tool, "refund");
    assert_eq!(in_order.state(), State::Succeeded);
    assert_eq!(in_order.tracestate.as_deref(), Some("vendor=\"q\""));
    assert!(in_order.receipt.is_some() && in_order.receipt_id.as_deref() == Some("r-auto"));
    // Same order but two text columns swapped by alias: read by name, each where it belongs.
    let mut swapped = COLUMNS.map(String::from);
    swapped[1] = "tool AS tenant".into();
    swapped[3] = "tenant AS tool".into();
    let renamed = read_as(&db, op.id, &swapped.join(", ")).await.unwrap();
    assert_eq!(
        (renamed.tenant.as_str(), renamed.tool.as_str()),
        ("refund", "north")
    );
    // A row without one of the columns is refused, naming it.
    let missing = read_as(&db, op.id, &COLUMNS[..26].join(", "))
        .await
        .unwrap_err();
    assert!(missing.to_string().contains("tracestate"), "{missing}");
    db.drop_db().await;
}

/// The rows of one result set share their columns, so one decoder checks each column's type
/// once, at its first value that is not NULL. A column NULL in the first row and of the wrong
/// type in a later one is still refused there, naming it; the rest read as one by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_result_sets_rows_are_type_checked_at_each_columns_first_value() {
    use sqlx::Row as _;
    let db = TestDb::new().await;
    let ctx = context(&db);
    let first = succeeded(&ctx, "north", r#"first-{"1"}"#, "refund").await;
    let second = succeeded(&ctx, "north", "second\\2", "refund").await;
    let rows = |receipt_id: String| {
        let mut columns = COLUMNS.map(String::from);
        columns[18] = receipt_id;
        let sql = format!(
            "SELECT {} FROM operations WHERE id IN ($1, $2) ORDER BY id",
            columns.join(", ")
        );
        let pool = db.pool().clone();
        async move {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(first.id)
                .bind(second.id)
                .fetch_all(&pool)
                .await
                .unwrap()
        }
    };
    let good = rows("receipt_id".into()).await;
    let mut decoder = worker::ledger::OperationDecoder::default();
    let decoded: Vec<_> = good.iter().map(|r| decoder.decode(r).unwrap()).collect();
    let alone: Vec<_> = good
        .iter()
        .map(|r| <worker::ledger::Operation as sqlx::FromRow<_>>::from_row(r).unwrap())
        .collect();
    assert_eq!(format!("{decoded:?}"), format!("{alone:?}"));
    assert_eq!(decoded[1].action_id, "second\\2");
    // receipt_id as an integer: NULL in the first row, 42 in the second.
    let bad = rows(format!(
        "CASE WHEN id = {} THEN NULL ELSE 42 END AS receipt_id",
        first.id
    ))
    .await;
    assert!(sqlx::ValueRef::is_null(&bad[0].try_get_raw(18).unwrap()));
    let mut decoder = worker::ledger::OperationDecoder::default();
    assert_eq!(decoder.decode(&bad[0]).unwrap().receipt_id, None);
    let refused = decoder.decode(&bad[1]).unwrap_err();
    assert!(
        refused.to_string().contains("receipt_id") && refused.to_string().contains("mismatched"),
        "{refused}"
    );
    db.drop_db().await;
}

/// Scans of `index` on `operations` that the statistics have counted.
async fn index_scans(pool: &sqlx::PgPool, index: &str) -> i64 {
    sqlx::query_scalar("SELECT idx_scan FROM pg_stat_user_indexes WHERE indexrelname = $1")
        .bind(index)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Inserts `n` rows `dispatching` at fence 1, leased by this worker, named `<prefix><i>`;
/// answers their ids.
async fn fill(pool: &sqlx::PgPool, prefix: &str, n: i32) -> Vec<i64> {
    sqlx::query_scalar(
        "INSERT INTO operations (tenant, action_id, tool, fingerprint, arguments, state,
                                 fence, lease_owner, lease_until, attempts)
         SELECT 'north', $1 || n, 'refund', 'f', '{}', 'dispatching', 1, $3,
                now() + interval '1 hour', 1
         FROM generate_series(1, $2) n RETURNING id",
    )
    .bind(prefix)
    .bind(n)
    .bind(WORKER_ID)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Rows named `<prefix>...` go to `succeeded` (each leaves a version behind in every index).
async fn finish(pool: &sqlx::PgPool, prefix: &str) {
    sqlx::query(
        "UPDATE operations SET state = 'succeeded', receipt = '{}', lease_owner = NULL,
                lease_until = NULL WHERE action_id LIKE $1 || '%'",
    )
    .bind(prefix)
    .execute(pool)
    .await
    .unwrap();
}

/// The send path of `ids` as the worker batches it: one send fence for all, then one
/// completion with a receipt for each; every row passes and succeeds. With `held`, the
/// completion is recorded as the worker records it while its relay is attached: the events
/// held in that relay epoch (the first batch begins one, and the epoch is updated); without,
/// the events are left to any relay.
async fn fence_and_complete(
    ledger: &worker::ledger::Ledger,
    ids: &[i64],
    held: Option<&mut Option<i64>>,
) {
    use worker::ledger::{Applied, Completion, Phase, Source, Transition};
    fence(ledger, ids).await;
    let completions: Vec<Completion> = ids
        .iter()
        .map(|&id| Completion {
            operation_id: id,
            fence: 1,
            phase: Phase::Dispatch,
            by: Source::Dispatch,
            transition: Transition::Succeeded {
                receipt: worker::document::Document::from_value(
                    serde_json::json!({"receipt_id": format!("r-{id}")}),
                ),
                receipt_id: format!("r-{id}"),
                evidence: "receipt".into(),
            },
            trace: None,
            dispatched: None,
        })
        .collect();
    let results = match held {
        None => ledger.complete(WORKER_ID, &completions).await,
        Some(epoch) => {
            let done = ledger.complete_held(WORKER_ID, &completions, *epoch).await;
            assert_eq!(done.events.len(), ids.len(), "{:?}", done.results);
            *epoch = Some(done.epoch.expect("an epoch to continue with"));
            done.results
        }
    };
    for result in results {
        assert!(matches!(result, Ok(Applied::Done(_))), "{result:?}");
    }
}

/// A ledger on one connection of its own: its statements' plans are kept per connection, and
/// closing it makes its backend report its statistics.
async fn one_connection(db: &TestDb) -> (sqlx::PgPool, worker::ledger::Ledger) {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .unwrap();
    let ledger = worker::ledger::Ledger::from_pool(pool.clone());
    (pool, ledger)
}

/// The batched send fence and the batched receipt completion find their rows by id, never
/// through the unresolved index. That index keeps an entry for every row that was unresolved
/// since the last vacuum, and a bitmap scan through it (the planner's pick when it believes
/// few rows are `dispatching`, as on a table without statistics after a burst) visits all of
/// their pages for every batch: over a 20,000-intent drain, most of Postgres's time per
/// intent. Here 3,000 rows went through `dispatching` to `succeeded` before a batch of 100.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hot_batches_find_their_rows_by_id_not_through_the_unresolved_index() {
    let db = TestDb::new().await;
    fill(db.pool(), "old-", 3000).await;
    finish(db.pool(), "old-").await;
    let ids = fill(db.pool(), "new-", 100).await;
    let before = (
        index_scans(db.pool(), "operations_unresolved").await,
        index_scans(db.pool(), "operations_pkey").await,
    );
    let (pool, ledger) = one_connection(&db).await;
    // With the events left to any relay, then held for this worker's relay, batch after batch
    // in one relay epoch.
    fence_and_complete(&ledger, &ids[..40], None).await;
    let mut epoch = None;
    for batch in ids[40..].chunks(20) {
        fence_and_complete(&ledger, batch, Some(&mut epoch)).await;
    }
    pool.close().await;

    // The primary key's count moves once the closed backend has reported.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while index_scans(db.pool(), "operations_pkey").await == before.1 {
        assert!(
            std::time::Instant::now() < deadline,
            "no statistics reported"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        index_scans(db.pool(), "operations_unresolved").await,
        before.0,
        "the unresolved index was scanned"
    );
    db.drop_db().await;
}

/// The send fence, alone (every send at light load) and in batches, keeps finding its rows by
/// primary key after the table grew past the one its plan was made on. Postgres plans a prepared
/// statement for its parameters five times, then keeps a generic plan until the table's next
/// analysis: made on a young table that autovacuum had analysed while it held a page or two,
/// that plan is a sequential scan (or a join reading all of the primary key), and it would read
/// the whole grown table for every batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_send_fence_finds_its_rows_by_id_after_the_table_grew() {
    keeps_finding_rows_by_id_after_growth("send fence", async |ledger, ids| {
        fence(ledger, ids).await
    })
    .await;
}

/// The batch's receipts, `succeed_receipts` (the statement a completion batch with more than one
/// receipt runs), keep finding their rows by primary key after the table grew past the one its
/// plan was made on, as the send fence does. Called here directly, as the ledger calls it, so
/// that only its own plan is counted: the ledger's batch also writes result events, whose
/// statements keep plans of their own, made on the young table after this test's `ANALYZE`
/// (migration 0024 keeps autovacuum from analysing a young ledger).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_receipts_find_their_rows_by_id_after_the_table_grew() {
    keeps_finding_rows_by_id_after_growth("batch of receipts", async |ledger, ids| {
        succeed(ledger.pool(), ids).await
    })
    .await;
}

/// `act` (every row it is given passes) on 30 rows of a table just analysed, ten alone and ten in
/// pairs, on one connection, so that its plans are made there; then, once the table grew to
/// 5,000 rows, on 20 more, ten alone and ten at once: no sequential scan of `operations`, and at
/// most 100 primary-key entries read (each row is read through the key a few times: found,
/// updated, and by its history row's foreign-key check).
async fn keeps_finding_rows_by_id_after_growth(
    what: &str,
    act: impl AsyncFn(&worker::ledger::Ledger, &[i64]),
) {
    let db = TestDb::new().await;
    let (pool, ledger) = one_connection(&db).await;
    let early = fill(&pool, "early-", 30).await;
    sqlx::query("ANALYZE operations")
        .execute(&pool)
        .await
        .unwrap();
    for &id in &early[..10] {
        act(&ledger, &[id]).await;
    }
    for pair in early[10..].chunks(2) {
        act(&ledger, pair).await;
    }
    fill(&pool, "old-", 5000).await;
    finish(&pool, "old-").await;
    let late = fill(&pool, "late-", 20).await;
    // Each early row was written twice (inserted, then by `act`), each old one twice.
    let before = seq_rows_read(&db, &pool, 5050, 5030).await;
    let keys_read = pkey_tuples_read(db.pool()).await;
    for &id in &late[..10] {
        act(&ledger, &[id]).await;
    }
    act(&ledger, &late[10..]).await;
    assert_eq!(
        seq_rows_read(&db, &pool, 5050, 5050).await,
        before,
        "a {what} read the whole table"
    );
    let read = pkey_tuples_read(db.pool()).await - keys_read;
    assert!(
        read <= 100,
        "the {what} calls read {read} primary key entries for 20 rows"
    );
    pool.close().await;
    db.drop_db().await;
}

/// `succeed_receipts` for `ids`, each a dispatch's receipt; every row succeeds.
async fn succeed(pool: &sqlx::PgPool, ids: &[i64]) {
    let texts = |f: &dyn Fn(i64) -> String| ids.iter().map(|&id| f(id)).collect::<Vec<_>>();
    let succeeded: Vec<i64> =
        sqlx::query_scalar("SELECT (r.op).id FROM succeed_receipts($1, $2, $3, $4, $5, $6) r")
            .bind(ids)
            .bind(WORKER_ID)
            .bind(texts(&|_| "receipt".into()))
            .bind(texts(&|id| format!(r#"{{"receipt_id": "r-{id}"}}"#)))
            .bind(texts(&|id| format!("r-{id}")))
            .bind(texts(&|_| "dispatch".into()))
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(succeeded.len(), ids.len(), "every receipt is recorded");
}

/// Entries of the primary key of `operations` that index scans have read, as counted so far.
async fn pkey_tuples_read(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = 'operations_pkey'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The send fence of `ids` in one batch, as the worker runs it; every row passes.
async fn fence(ledger: &worker::ledger::Ledger, ids: &[i64]) {
    let sends: Vec<worker::ledger::SendFence> = ids
        .iter()
        .map(|&id| worker::ledger::SendFence {
            id,
            fence: 1,
            timeout: TIMEOUT,
            deadline: None,
        })
        .collect();
    let passed = ledger.fence_sends(&sends, WORKER_ID, LEASE).await.unwrap();
    assert!(passed.iter().all(Option::is_some), "every fence passes");
}

/// Rows of `operations` that sequential scans have read, as the statistics count them once they
/// count the `inserted` and `updated` rows that the backend behind `pool` (one connection) wrote.
/// Rows, not scans: the migrations scan the empty table 29 times (building its indexes, checking
/// its constraints), and the connection that applied them may report those scans only when it
/// is next used after a second has passed (Postgres defers a backend's report that soon after
/// its last), which can fall between two readings; they read no row.
async fn seq_rows_read(db: &TestDb, pool: &sqlx::PgPool, inserted: i64, updated: i64) -> i64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        // The backend reports when it goes idle, right after this call.
        sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(pool)
            .await
            .unwrap();
        let (ins, upd, rows): (i64, i64, i64) = sqlx::query_as(
            "SELECT n_tup_ins, n_tup_upd, seq_tup_read FROM pg_stat_user_tables
             WHERE relname = 'operations'",
        )
        .fetch_one(db.pool())
        .await
        .unwrap();
        if (ins, upd) == (inserted, updated) {
            return rows;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "statistics count {ins} inserts and {upd} updates, not {inserted} and {updated}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The batched send fence and receipt completion are planned for the table they meet. A plan
/// kept from when the table was small (Postgres keeps a generic plan after five executions of
/// a prepared statement, until the next ANALYZE) reads the whole table for every batch once it
/// has grown: over a long run without a fresh analysis, a fence that costs more with every
/// intent ever recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hot_batches_are_planned_for_the_table_they_meet_not_the_one_they_first_met() {
    let db = TestDb::new().await;
    let (pool, ledger) = one_connection(&db).await;
    // Batches of two while the table holds forty rows, ten each way: with the events left to
    // any relay, and held in a relay epoch.
    let mut epoch = None;
    for pair in fill(&pool, "early-", 40).await.chunks(4) {
        fence_and_complete(&ledger, &pair[..2], None).await;
        fence_and_complete(&ledger, &pair[2..], Some(&mut epoch)).await;
    }
    // The table grows to 5,000 rows, then a batch of ten each way.
    fill(&pool, "old-", 5000).await;
    finish(&pool, "old-").await;
    let late = fill(&pool, "late-", 20).await;
    // Each early row was written three times (inserted, fenced, completed), each old one twice.
    let before = seq_rows_read(&db, &pool, 5060, 5080).await;
    fence_and_complete(&ledger, &late[..10], None).await;
    fence_and_complete(&ledger, &late[10..], Some(&mut epoch)).await;
    assert_eq!(
        seq_rows_read(&db, &pool, 5060, 5120).await,
        before,
        "a batch read the whole table"
    );
    pool.close().await;
    db.drop_db().await;
}
