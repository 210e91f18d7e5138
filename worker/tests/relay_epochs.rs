//! Relay epochs against a real Postgres: a worker's own completion events are recorded
//! published by their epoch's watermark, never by a row-by-row mark; an epoch nothing advanced
//! for the hold is retired and every event above its watermark goes back to any relay; a batch
//! inserting into an epoch keeps it from being retired; a retired epoch is never written to
//! again; retention deletes what a watermark published, never what it did not; deleting a
//! tombstone unlinks its events and keeps them; a batch of receipts into a live epoch stores
//! the events its rows owe as recorded (late receipts answered as if alone); and a batch meeting
//! a retirement under way waits for it and goes into a new epoch. A lone receipt of a row its
//! dispatch still holds is stored with its event in one statement, exactly as the general path
//! stores it, and only while the row and the epoch read as the event was built from.

mod common;

use std::time::Duration;

use common::*;
use worker::document::Document;
use worker::ledger::outbox::{self, NewEvent, OutboxRow};
use worker::ledger::{Applied, Completed, Completion, Phase, Source, Transition};

/// The hold of a claim by another relay in these tests.
const HOLD: Duration = Duration::from_millis(1);

/// A `succeeded` completion of a freshly claimed operation.
async fn receipt(ctx: &worker::context::Context, action_id: &str) -> Completion {
    let op = dispatching(ctx, "north", action_id, "refund").await;
    Completion {
        operation_id: op.id,
        fence: op.fence,
        phase: Phase::Dispatch,
        by: Source::Dispatch,
        transition: Transition::Succeeded {
            receipt: Document::from_value(receipt_for("north", action_id, "r-1")),
            receipt_id: "r-1".into(),
            evidence: "receipt r-1 from write attempt 1".into(),
        },
        trace: None,
        dispatched: Some(Box::new(op)),
    }
}

/// One batch recorded the way the completion batcher records it while its relay is attached.
async fn batch(
    ctx: &worker::context::Context,
    action_id: &str,
    epoch: Option<i64>,
) -> (OutboxRow, i64) {
    let c = receipt(ctx, action_id).await;
    let Completed {
        results,
        events,
        epoch,
    } = ctx
        .ledger
        .complete_held(WORKER_ID, std::slice::from_ref(&c), epoch)
        .await;
    assert!(results[0].is_ok(), "{results:?}");
    assert_eq!(events.len(), 1, "{events:?}");
    let epoch = epoch.expect("an epoch to continue with");
    assert_eq!(events[0].relay_epoch, Some(epoch));
    (events.into_iter().next().unwrap(), epoch)
}

/// Two batches in one epoch, its watermark at the first: (first, second, epoch).
async fn watermark_between(
    ctx: &worker::context::Context,
    prefix: &str,
) -> (OutboxRow, OutboxRow, i64) {
    let (first, epoch) = batch(ctx, &format!("{prefix}-1"), None).await;
    let (second, same) = batch(ctx, &format!("{prefix}-2"), Some(epoch)).await;
    assert_eq!(same, epoch, "a batch joins the epoch it is given");
    assert!(second.id > first.id);
    assert!(ctx.ledger.advance_epoch(epoch, first.id).await.unwrap());
    (first, second, epoch)
}

/// (published, relay_epoch, relay_owner) of an outbox row, as the `result_events` view says.
async fn state(db: &TestDb, id: i64) -> (bool, Option<i64>, Option<String>) {
    sqlx::query_as("SELECT published, relay_epoch, relay_owner FROM result_events WHERE id = $1")
        .bind(id)
        .fetch_one(db.pool())
        .await
        .unwrap()
}

async fn epoch_exists(db: &TestDb, epoch: i64) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM relay_epochs WHERE id = $1)")
        .bind(epoch)
        .fetch_one(db.pool())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watermark_publishes_exactly_the_confirmed_events_of_its_epoch() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let l = &db.ledger;
    let (first, epoch) = batch(&ctx, "wm-1", None).await;
    let (second, same) = batch(&ctx, "wm-2", Some(epoch)).await;
    assert_eq!(same, epoch, "a batch joins the epoch it is given");
    assert!(second.id > first.id);
    assert!(!state(&db, first.id).await.0);
    assert_eq!(l.relay_backlog().await.unwrap(), 2);
    // Held in an epoch: no other relay claims them, even once their own hold has passed.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let claimed = l.claim_unpublished("other", 10, HOLD).await.unwrap();
    assert!(claimed.is_empty(), "{claimed:?}");

    assert!(l.advance_epoch(epoch, first.id).await.unwrap());
    assert!(state(&db, first.id).await.0, "at or below the watermark");
    assert!(!state(&db, second.id).await.0, "above it");
    assert_eq!(l.relay_backlog().await.unwrap(), 1);
    // A watermark never moves back.
    assert!(l.advance_epoch(epoch, first.id - 1).await.unwrap());
    assert!(state(&db, first.id).await.0);
    assert!(l.advance_epoch(epoch, second.id).await.unwrap());
    assert!(state(&db, second.id).await.0);
    assert_eq!(l.relay_backlog().await.unwrap(), 0);
    let rows: Vec<(bool, Option<chrono::DateTime<chrono::Utc>>)> =
        sqlx::query_as("SELECT published, published_at FROM result_events WHERE relay_epoch = $1")
            .bind(epoch)
            .fetch_all(db.pool())
            .await
            .unwrap();
    assert_eq!(rows.len(), 2);
    assert!(
        rows.iter().all(|(p, at)| *p && at.is_none()),
        "published by the watermark, no row was marked: {rows:?}"
    );
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_epoch_is_retired_and_what_its_watermark_did_not_reach_goes_to_any_relay() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let l = &db.ledger;
    let (first, second, epoch) = watermark_between(&ctx, "rt").await;
    // Advanced within the hold: kept.
    assert_eq!(l.retire_epochs(Duration::from_secs(60)).await.unwrap(), 0);
    assert!(epoch_exists(&db, epoch).await);

    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        l.retire_epochs(Duration::from_millis(10)).await.unwrap(),
        1,
        "the one event above the watermark goes back"
    );
    assert!(!epoch_exists(&db, epoch).await);
    assert_eq!(
        state(&db, first.id).await,
        (true, Some(epoch), Some(WORKER_ID.into())),
        "published by the watermark before the epoch ended: stays published"
    );
    let (published, relay_epoch, _) = state(&db, second.id).await;
    assert!(!published && relay_epoch.is_none());
    assert_eq!(l.relay_backlog().await.unwrap(), 1);
    let claimed = l.claim_unpublished("other", 10, HOLD).await.unwrap();
    assert_eq!(
        claimed.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![second.id],
        "the event the epoch's relay never confirmed, and nothing it did"
    );
    l.mark_published(&[second.id]).await.unwrap();
    assert_eq!(l.relay_backlog().await.unwrap(), 0);

    // The next batch of the worker whose epoch was retired begins a new epoch.
    assert!(!l.advance_epoch(epoch, second.id).await.unwrap());
    let (third, next) = batch(&ctx, "rt-3", Some(epoch)).await;
    assert_ne!(next, epoch);
    assert!(third.id > second.id);
    assert_eq!(state(&db, third.id).await.1, Some(next));
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_inserting_into_an_epoch_keeps_it_from_being_retired() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let l = &db.ledger;
    let (_, epoch) = batch(&ctx, "lk-1", None).await;
    let op = dispatching(&ctx, "north", "lk-2", "refund").await;
    tokio::time::sleep(Duration::from_millis(20)).await;

    // A batch's transaction, still open after its insert.
    let mut tx = db.pool().begin().await.unwrap();
    let event = NewEvent {
        operation_id: Some(op.id),
        event: serde_json::from_value(serde_json::json!({
            "event_id": "6b1f1d7e-6d3a-4f7e-9d6c-1a2b3c4d5e6f",
            "tenant": "north", "action_id": "lk-2", "tool": "refund", "status": "pending",
            "receipt": null, "next_action": "check_status", "attempts": 1,
            "message": "in flight", "fingerprint": null,
            "occurred_at": "2026-12-03T00:00:00Z"
        }))
        .unwrap(),
        reply_to: None,
        trace: None,
    };
    let mut current = Some(epoch);
    let rows = outbox::insert_held_events(&mut tx, &[event], WORKER_ID, &mut current)
        .await
        .unwrap();
    assert_eq!(current, Some(epoch));
    assert_eq!(
        l.retire_epochs(Duration::from_millis(10)).await.unwrap(),
        0,
        "in use: not retired"
    );
    assert!(epoch_exists(&db, epoch).await);
    tx.commit().await.unwrap();

    // Committed and silent: retired, and the row the batch wrote is given back with the rest.
    assert_eq!(l.retire_epochs(Duration::from_millis(10)).await.unwrap(), 2);
    assert_eq!(state(&db, rows[0].id).await.1, None);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_what_a_watermark_published_and_nothing_above_it() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let l = &db.ledger;
    let (_, second, _) = watermark_between(&ctx, "rn").await;
    let deleted = l
        .delete_published_events_batch(Duration::ZERO, 100)
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM result_outbox ORDER BY id")
        .fetch_all(db.pool())
        .await
        .unwrap();
    assert_eq!(left, vec![second.id], "the unpublished event stays");
    db.drop_db().await;
}

/// Deleting a tombstone keeps its result events (the record of what the agent was told) and
/// unlinks them in the same statement; the events of other operations keep their link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_tombstone_unlinks_its_result_events_and_keeps_them() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let l = &db.ledger;
    let (old, epoch) = batch(&ctx, "tomb-old", None).await;
    let (fresh, _) = batch(&ctx, "tomb-fresh", Some(epoch)).await;
    sqlx::query(
        "UPDATE operations SET finished_at = now() - interval '2 days' WHERE action_id = 'tomb-old'",
    )
    .execute(db.pool())
    .await
    .unwrap();
    let deleted = l
        .delete_tombstones_batch(Duration::from_secs(86_400), 100)
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    let links: Vec<(i64, Option<i64>)> =
        sqlx::query_as("SELECT id, operation_id FROM result_outbox ORDER BY id")
            .fetch_all(db.pool())
            .await
            .unwrap();
    let fresh_op: i64 =
        sqlx::query_scalar("SELECT id FROM operations WHERE action_id = 'tomb-fresh'")
            .fetch_one(db.pool())
            .await
            .unwrap();
    assert_eq!(links, vec![(old.id, None), (fresh.id, Some(fresh_op))]);
    let orphans: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM result_outbox r
         WHERE r.operation_id IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM operations o WHERE o.id = r.operation_id)",
    )
    .fetch_one(db.pool())
    .await
    .unwrap();
    assert_eq!(orphans, 0);
    db.drop_db().await;
}

/// The claim of a relay of the earlier version (before relay epochs), word for word: it knows
/// no epochs and takes every unpublished row whose hold has passed.
const EARLIER_CLAIM: &str = "WITH batch AS (
        SELECT id FROM result_outbox
        WHERE published_at IS NULL AND (relay_until IS NULL OR relay_until < now())
        ORDER BY id LIMIT 256 FOR UPDATE SKIP LOCKED
     )
     UPDATE result_outbox r SET relay_owner = 'earlier', relay_until = now() + interval '30 s'
     FROM batch WHERE r.id = batch.id
     RETURNING r.id";

/// During a rolling upgrade, relays of the earlier version run beside the new ones. An event
/// in an epoch is never recorded published row by row, so such a relay must never take it:
/// it would publish every event of the new workers again. Once the epoch is retired, the events
/// above its watermark are anyone's, at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_of_the_earlier_version_leaves_epoch_events_alone() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let l = &db.ledger;
    let (_, second, _) = watermark_between(&ctx, "up").await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let taken: Vec<i64> = sqlx::query_scalar(EARLIER_CLAIM)
        .fetch_all(db.pool())
        .await
        .unwrap();
    assert!(taken.is_empty(), "taken by an earlier relay: {taken:?}");

    assert_eq!(l.retire_epochs(Duration::from_millis(10)).await.unwrap(), 1);
    let taken: Vec<i64> = sqlx::query_scalar(EARLIER_CLAIM)
        .fetch_all(db.pool())
        .await
        .unwrap();
    assert_eq!(taken, vec![second.id], "given back: anyone's");
    db.drop_db().await;
}

/// A completion batch's events reach its relay without being read back from the outbox: each
/// row handed over must be the row stored under its id (payload, event id, routing key,
/// status), also when receipts carry braces, quotes, escapes, non-ASCII text and numbers past
/// 64 bits, and when a batch mixes outcomes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handed_events_are_the_rows_stored_under_their_ids() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let hostile = serde_json::json!({
        "receipt_id": "r-{\"}",
        "note": "brace { quote \" backslash \\ tab \t nul \u{0} ünïcödé 💸",
        "amount": 123456789012345678901234567890u128 as f64,
        "nested": {"z": [1, -0.5, 1e300, null, true], "a": {"}": "{"}},
    });
    let mut completions = Vec::new();
    for i in 0..6 {
        let mut c = receipt(&ctx, &format!("handed-{{\"{i}\"}}")).await;
        if i % 3 == 1 {
            c.transition = Transition::Failed {
                evidence: format!("HTTP 422: {{\"error\": \"no {i}\"}}"),
            };
        } else if let Transition::Succeeded { receipt, .. } = &mut c.transition {
            let mut value = receipt.value().clone();
            value["extra"] = hostile.clone();
            *receipt = Document::from_value(value);
        }
        completions.push(c);
    }
    let done = ctx
        .ledger
        .complete_held(WORKER_ID, &completions, None)
        .await;
    assert!(done.results.iter().all(|r| r.is_ok()), "{:?}", done.results);
    assert_eq!(done.events.len(), completions.len());
    assert!(
        done.events.windows(2).all(|w| w[0].id < w[1].id),
        "in id order"
    );
    for row in &done.events {
        let (event_id, routing_key, status, payload): (String, String, String, serde_json::Value) =
            sqlx::query_as(
                "SELECT event_id::text, routing_key, status, payload FROM result_outbox
                 WHERE id = $1",
            )
            .bind(row.id)
            .fetch_one(db.pool())
            .await
            .unwrap();
        let handed: serde_json::Value = serde_json::from_str(&row.payload).unwrap();
        assert_eq!(handed, payload, "row {}", row.id);
        assert_eq!(row.event_id, event_id);
        assert_eq!(handed["event_id"], event_id.as_str());
        assert_eq!(row.routing_key, routing_key);
        assert_eq!(row.status, status);
        assert_eq!(handed["status"], status.as_str());
    }
    db.drop_db().await;
}

/// A receipt of `op` as its dispatch records it, from the operation as the dispatch saw it.
fn receipt_of(op: &worker::ledger::Operation, receipt: serde_json::Value) -> Completion {
    let receipt_id = receipt["receipt_id"].as_str().unwrap().to_string();
    let receipt = Document::from_value(receipt);
    Completion {
        operation_id: op.id,
        fence: op.fence,
        phase: Phase::Dispatch,
        by: Source::Dispatch,
        transition: Transition::Succeeded {
            receipt,
            evidence: format!("receipt {receipt_id} from write attempt {}", op.attempts),
            receipt_id,
        },
        trace: None,
        dispatched: Some(Box::new(op.clone())),
    }
}

/// The outbox row `id` as stored: (payload, relay_epoch, relay_owner, held until infinity).
async fn stored(db: &TestDb, id: i64) -> (serde_json::Value, Option<i64>, Option<String>, bool) {
    sqlx::query_as(
        "SELECT payload, relay_epoch, relay_owner, relay_until = 'infinity' FROM result_outbox
         WHERE id = $1",
    )
    .bind(id)
    .fetch_one(db.pool())
    .await
    .unwrap()
}

/// Two operations claimed for `<prefix>-a` and `<prefix>-b`, and their receipts.
async fn two_receipts(
    ctx: &worker::context::Context,
    prefix: &str,
) -> ([worker::ledger::Operation; 2], Vec<Completion>) {
    let a = dispatching(ctx, "north", &format!("{prefix}-a"), "refund").await;
    let b = dispatching(ctx, "north", &format!("{prefix}-b"), "refund").await;
    let completions = vec![
        receipt_of(&a, receipt_for("north", &a.action_id, "r-a")),
        receipt_of(&b, receipt_for("north", &b.action_id, "r-b")),
    ];
    ([a, b], completions)
}

fn assert_all_done(done: &Completed) {
    assert!(
        done.results
            .iter()
            .all(|r| matches!(r, Ok(worker::ledger::Applied::Done(_)))),
        "{:?}",
        done.results
    );
}

/// The event of `action_id` among those a batch handed to the relay.
fn handed<'a>(done: &'a Completed, action_id: &str) -> &'a OutboxRow {
    done.events
        .iter()
        .find(|e| e.field("action_id").as_deref() == Some(action_id))
        .unwrap_or_else(|| panic!("no event of {action_id} handed: {:?}", done.events))
}

/// Checks that `handed` is the row stored under its id, held for this worker's relay in `epoch`,
/// and says what operation `op_id`, as recorded, owes the agent; answers the stored payload.
async fn held_as_owed(
    ctx: &worker::context::Context,
    db: &TestDb,
    handed: &OutboxRow,
    op_id: i64,
    epoch: i64,
) -> serde_json::Value {
    let (payload, relay_epoch, owner, held) = stored(db, handed.id).await;
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&handed.payload).unwrap(),
        payload,
        "handed as stored"
    );
    assert_eq!(
        (relay_epoch, owner.as_deref(), held),
        (Some(epoch), Some(WORKER_ID), true)
    );
    assert_eq!(handed.relay_epoch, Some(epoch));
    assert_eq!(handed.event_id, payload["event_id"].as_str().unwrap());
    let row = ctx.ledger.get(op_id).await.unwrap().unwrap();
    let owed = serde_json::to_value(worker::answers::succeeded(&row).event).unwrap();
    assert_eq!(said(&payload), said(&owed), "what the row as recorded owes");
    payload
}

/// What an event says apart from its own id and time.
fn said(event: &serde_json::Value) -> serde_json::Value {
    let mut said = event.clone();
    let map = said.as_object_mut().unwrap();
    map.remove("event_id");
    map.remove("occurred_at");
    said
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipts_into_a_live_epoch_are_stored_with_the_events_their_rows_owe() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let (first, epoch) = batch(&ctx, "live-0", None).await;
    let mut completions = Vec::new();
    for i in 1..=3 {
        let op = dispatching(&ctx, "north", &format!("live-{{\"{i}\"}}"), "refund").await;
        let mut receipt = receipt_for("north", &op.action_id, &format!("r-{{\"{i}\"}}"));
        receipt["note"] = serde_json::json!("brace { quote \" backslash \\ 💸");
        receipt["huge"] = serde_json::json!(123456789012345678u64);
        completions.push(receipt_of(&op, receipt));
    }
    let done = ctx
        .ledger
        .complete_held(WORKER_ID, &completions, Some(epoch))
        .await;
    assert_eq!(done.epoch, Some(epoch), "the batch stays in the live epoch");
    assert_eq!(done.events.len(), 3);
    assert!(
        done.events.windows(2).all(|w| w[0].id < w[1].id),
        "in id order"
    );
    assert!(done.events[0].id > first.id);
    for (c, result) in completions.iter().zip(&done.results) {
        let Ok(worker::ledger::Applied::Done(op)) = result else {
            panic!("not recorded: {result:?}");
        };
        let Transition::Succeeded { receipt, .. } = &c.transition else {
            unreachable!()
        };
        assert_eq!(op.state(), worker::ledger::State::Succeeded);
        assert_eq!(op.receipt.as_ref(), Some(receipt));
        assert_eq!(
            (op.lease_owner.as_deref(), op.last_reported.as_deref()),
            (None, Some("succeeded"))
        );
        let events = outbox_events(db.pool(), op.id).await;
        assert_eq!(events.len(), 1, "one event for {}", op.action_id);
        held_as_owed(&ctx, &db, handed(&done, &op.action_id), op.id, epoch).await;
    }
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receipt_whose_row_moved_since_it_was_built_gets_the_event_of_the_row_as_it_is() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let (_, epoch) = batch(&ctx, "moved-0", None).await;
    let ([a, b], completions) = two_receipts(&ctx, "moved").await;
    // Meanwhile a replay of `a` counted a write (as `Ledger::begin_replay` does).
    sqlx::query("UPDATE operations SET attempts = attempts + 1 WHERE id = $1")
        .bind(a.id)
        .execute(db.pool())
        .await
        .unwrap();
    let done = ctx
        .ledger
        .complete_held(WORKER_ID, &completions, Some(epoch))
        .await;
    assert_all_done(&done);
    assert_eq!(done.epoch, Some(epoch));
    assert_eq!(done.events.len(), 2);
    for (op, attempts) in [(&a, 2), (&b, 1)] {
        let events = outbox_events(db.pool(), op.id).await;
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(
            events[0].1["attempts"], attempts,
            "{}: {events:?}",
            op.action_id
        );
        let handed = handed(&done, &op.action_id);
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&handed.payload).unwrap(),
            events[0].1
        );
        assert_eq!(handed.relay_epoch, Some(epoch));
    }
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_receipts_in_a_batch_into_a_live_epoch_are_answered_as_if_alone() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let (_, epoch) = batch(&ctx, "late-0", None).await;
    let fresh = dispatching(&ctx, "north", "late-fresh", "refund").await;
    let same = succeeded(&ctx, "north", "late-same", "refund").await;
    let other = succeeded(&ctx, "north", "late-other", "refund").await;
    let completions = vec![
        receipt_of(&fresh, receipt_for("north", "late-fresh", "r-f")),
        receipt_of(&same, receipt_for("north", "late-same", "r-auto")),
        receipt_of(&other, receipt_for("north", "late-other", "r-other")),
    ];
    let done = ctx
        .ledger
        .complete_held(WORKER_ID, &completions, Some(epoch))
        .await;
    assert!(matches!(&done.results[0], Ok(Applied::Done(op)) if op.id == fresh.id));
    assert!(matches!(&done.results[1], Ok(Applied::LateReceiptMatches(op)) if op.id == same.id));
    assert!(
        matches!(&done.results[2], Ok(Applied::LateReceiptConflict(op)) if op.receipt_id.as_deref() == Some("r-auto"))
    );
    assert_eq!(done.events.len(), 1, "{:?}", done.events);
    assert_eq!(
        done.events[0].field("action_id").as_deref(),
        Some("late-fresh")
    );
    assert_eq!(done.epoch, Some(epoch));
    for (op, n) in [(&fresh, 1), (&same, 1), (&other, 1)] {
        assert_eq!(
            outbox_events(db.pool(), op.id).await.len(),
            n,
            "{}",
            op.action_id
        );
    }
    db.drop_db().await;
}

/// `completions` recorded into `epoch` while a retirement of it is under way (it holds the
/// epoch's row and deletes it, as `Ledger::retire_epochs` does): they wait for it, then all go
/// into a new epoch, which is returned with what was recorded.
async fn recorded_during_a_retirement(
    ctx: &worker::context::Context,
    db: &TestDb,
    completions: Vec<Completion>,
    epoch: i64,
) -> (Completed, i64) {
    let mut retiring = db.pool().begin().await.unwrap();
    sqlx::query("DELETE FROM relay_epochs WHERE id = $1")
        .bind(epoch)
        .execute(&mut *retiring)
        .await
        .unwrap();
    let ledger = ctx.ledger.clone();
    let recording = tokio::spawn(async move {
        ledger
            .complete_held(WORKER_ID, &completions, Some(epoch))
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !recording.is_finished(),
        "the receipts wait for the retirement"
    );
    retiring.commit().await.unwrap();
    let done = recording.await.unwrap();
    assert_all_done(&done);
    let new = done.epoch.expect("a new epoch");
    assert_ne!(new, epoch);
    (done, new)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipts_wait_for_an_epoch_being_retired_and_then_go_into_a_new_one() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let (first, epoch) = batch(&ctx, "retiring-0", None).await;
    let (_, completions) = two_receipts(&ctx, "retiring").await;
    let (done, new) = recorded_during_a_retirement(&ctx, &db, completions, epoch).await;
    assert!(
        !epoch_exists(&db, epoch).await,
        "a retired epoch is never begun again"
    );
    assert_eq!(done.events.len(), 2);
    for row in &done.events {
        assert_eq!(row.relay_epoch, Some(new));
        assert_eq!(stored(&db, row.id).await.1, Some(new));
    }
    let in_old: i64 =
        sqlx::query_scalar("SELECT count(*) FROM result_outbox WHERE relay_epoch = $1")
            .bind(epoch)
            .fetch_one(db.pool())
            .await
            .unwrap();
    assert_eq!(
        in_old, 1,
        "only the event written before the retirement ({})",
        first.id
    );
    db.drop_db().await;
}

/// What a completion wrote on a row: state, verified_by, last_reported, lease released, nothing
/// scheduled, finished when its state began, touched then, history rows.
type Recorded = (
    String,
    Option<String>,
    Option<String>,
    bool,
    bool,
    bool,
    bool,
    i64,
);

/// The row's columns a completion writes, for comparing two rows recorded by different paths.
async fn recorded(db: &TestDb, id: i64) -> Recorded {
    sqlx::query_as(
        "SELECT state, verified_by, last_reported, lease_owner IS NULL AND lease_until IS NULL,
                next_attempt_at IS NULL, finished_at IS NOT NULL AND finished_at = state_since,
                updated_at = state_since,
                (SELECT count(*) FROM operation_history h WHERE h.operation_id = o.id)
         FROM operations o WHERE id = $1",
    )
    .bind(id)
    .fetch_one(db.pool())
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_receipt_is_stored_in_one_statement_as_the_general_path_stores_it() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let (first, epoch) = batch(&ctx, "lone-0", None).await;
    let mut twins = Vec::new();
    for name in ["lone-{\"fast\"}", "lone-{\"general\"}"] {
        let op = dispatching(&ctx, "north", name, "refund").await;
        let mut receipt = receipt_for("north", &op.action_id, "r-{\"1\"}");
        receipt["note"] = serde_json::json!("brace { quote \" backslash \\ 💸");
        receipt["huge"] = serde_json::json!(123456789012345678u64);
        twins.push((op.clone(), receipt_of(&op, receipt)));
    }
    let (fast, c) = &twins[0];
    let (Applied::Done(op), events) = ctx
        .ledger
        .succeed_dispatched(WORKER_ID, c, epoch)
        .await
        .unwrap()
        .expect("recorded in one statement")
    else {
        panic!("not recorded")
    };
    assert_eq!(op.id, fast.id);
    assert_eq!(op.state(), worker::ledger::State::Succeeded);
    assert_eq!(events.len(), 1);
    let handed = &events[0];
    assert!(handed.id > first.id);
    let payload = held_as_owed(&ctx, &db, handed, op.id, epoch).await;

    // The twin, recorded by the general path (no row held by a dispatch): the same row and the
    // same event, but for its own key.
    let (general, mut c) = twins[1].clone();
    c.dispatched = None;
    let done = ctx
        .ledger
        .complete_held(WORKER_ID, std::slice::from_ref(&c), Some(epoch))
        .await;
    assert_all_done(&done);
    assert_eq!(
        recorded(&db, fast.id).await,
        recorded(&db, general.id).await
    );
    assert_eq!(
        recorded(&db, fast.id).await.0,
        "succeeded",
        "{:?}",
        recorded(&db, fast.id).await
    );
    let twin = stored(&db, done.events[0].id).await.0;
    let without_key = |e: &serde_json::Value| {
        let mut e = said(e);
        let map = e.as_object_mut().unwrap();
        map.remove("action_id");
        map.remove("fingerprint"); // the fixture's names the key
        map["receipt"]
            .as_object_mut()
            .unwrap()
            .remove("idempotency_key");
        e
    };
    assert_eq!(without_key(&payload), without_key(&twin));
    db.drop_db().await;
}

/// A lone receipt of a freshly claimed `action_id`, after `change` (its `$1` the row's id) moved
/// the row or the epoch: the one-statement path writes nothing, and the row stays `state`.
async fn drifted(
    ctx: &worker::context::Context,
    db: &TestDb,
    epoch: i64,
    action_id: &str,
    change: &str,
    state: &str,
) -> Completion {
    let op = dispatching(ctx, "north", action_id, "refund").await;
    let c = receipt_of(&op, receipt_for("north", &op.action_id, "r-1"));
    sqlx::query(sqlx::AssertSqlSafe(change.to_string()))
        .bind(op.id)
        .execute(db.pool())
        .await
        .unwrap();
    let fast = ctx.ledger.succeed_dispatched(WORKER_ID, &c, epoch).await;
    assert!(matches!(fast, Ok(None)), "{action_id}: {fast:?}");
    let written: (String, i64) = sqlx::query_as(
        "SELECT state, (SELECT count(*) FROM result_outbox WHERE operation_id = $1)
         FROM operations WHERE id = $1",
    )
    .bind(op.id)
    .fetch_one(db.pool())
    .await
    .unwrap();
    assert_eq!(written, (state.to_string(), 0), "{action_id}");
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_receipt_whose_row_or_epoch_moved_is_left_to_the_general_path() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let (_, epoch) = batch(&ctx, "drift-0", None).await;
    let general = |c: Completion, epoch: Option<i64>| {
        let ledger = ctx.ledger.clone();
        async move {
            let done = ledger
                .complete_held(WORKER_ID, std::slice::from_ref(&c), epoch)
                .await;
            assert_all_done(&done);
            let event: serde_json::Value = serde_json::from_str(&done.events[0].payload).unwrap();
            (done, event)
        }
    };
    // A replay counted a write meanwhile: the event the dispatch built says one attempt.
    let attempts = "UPDATE operations SET attempts = attempts + 1 WHERE id = $1";
    let c = drifted(&ctx, &db, epoch, "drift-attempts", attempts, "dispatching").await;
    assert_eq!(general(c, Some(epoch)).await.1["attempts"], 2);
    // The lease ran out and recovery took the row: the receipt is a late one.
    let expired = "UPDATE operations SET state = 'unknown', lease_owner = NULL, lease_until = NULL
                   WHERE id = $1";
    let c = drifted(&ctx, &db, epoch, "drift-lease", expired, "unknown").await;
    assert_eq!(
        general(c, Some(epoch)).await.1["verified_by"],
        "late_receipt"
    );
    // Another worker's fence: the row is no longer this dispatch's.
    let fenced = "UPDATE operations SET fence = fence + 1 WHERE id = $1";
    drifted(&ctx, &db, epoch, "drift-fence", fenced, "dispatching").await;
    // The epoch was retired: nothing is written into it, and the general path begins a new one.
    let retired = format!("DELETE FROM relay_epochs WHERE id = {epoch} AND $1::int8 IS NOT NULL");
    let c = drifted(&ctx, &db, epoch, "drift-epoch", &retired, "dispatching").await;
    let (done, _) = general(c, Some(epoch)).await;
    let new = done.epoch.expect("a new epoch");
    assert_ne!(new, epoch);
    assert_eq!(done.events[0].relay_epoch, Some(new));
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_receipt_waits_for_an_epoch_being_retired_and_then_goes_into_a_new_one() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let (_, epoch) = batch(&ctx, "lone-retiring-0", None).await;
    let op = dispatching(&ctx, "north", "lone-retiring", "refund").await;
    let c = receipt_of(&op, receipt_for("north", &op.action_id, "r-1"));
    let (done, new) = recorded_during_a_retirement(&ctx, &db, vec![c], epoch).await;
    assert_eq!(done.events.len(), 1);
    assert_eq!(done.events[0].relay_epoch, Some(new));
    assert_eq!(stored(&db, done.events[0].id).await.1, Some(new));
    assert_eq!(outbox_events(db.pool(), op.id).await.len(), 1);
    db.drop_db().await;
}
