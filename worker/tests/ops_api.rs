//! The operator layer against a real Postgres: the admin API (auth, resolve, fail, recheck,
//! listing, status), idempotent operator requests, and the retention sweeper.

mod common;

use std::time::Duration;

use common::*;
use protocol::{RejectReason, Status};
use serde_json::{json, Value};
use worker::answers::stored_result;
use worker::ledger::State;
use worker::ops::retention::sweep_once;

fn op_path(tenant: &str, action_id: &str) -> String {
    format!("/v1/operations/{tenant}/{action_id}")
}

fn operator_entries<'a>(body: &'a Value, actor: &str) -> Vec<&'a Value> {
    body["history"]
        .as_array()
        .expect("history")
        .iter()
        .filter(|h| h["actor"] == actor)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolve_refuses_a_mismatching_receipt_and_accepts_a_matching_one() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let api = start_api(ctx.clone()).await;
    let op = held(&ctx, "north", "refund-204", "refund").await;
    let events_before = outbox_events(db.pool(), op.id).await.len();
    let path = format!("{}/resolve", op_path("north", "refund-204"));

    // A receipt for another operation: refused, nothing stored.
    let r = api
        .post(
            &path,
            Some(ADMIN_TOKEN),
            &json!({
                "receipt": receipt_for("north", "refund-999", "r-1"),
                "operator": "alice", "reason": "checked the PSP dashboard",
                "request_id": "op-req-mismatch",
            }),
        )
        .await;
    assert_eq!(r.status, 422, "{}", r.body);
    assert_eq!(r.body["error"], "receipt_mismatch");
    assert!(r.body["message"]
        .as_str()
        .unwrap()
        .contains("another operation"));
    let now = db.ledger.get(op.id).await.unwrap().unwrap();
    assert_eq!(now.state(), State::Held);
    assert!(now.receipt.is_none());
    assert_eq!(outbox_events(db.pool(), op.id).await.len(), events_before);
    let requests: i64 = sqlx::query_scalar("SELECT count(*) FROM operator_requests")
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(requests, 0, "a refused request is not recorded");

    // The matching receipt: succeeded, event for the agent, history names the operator.
    let receipt = receipt_for("north", "refund-204", "r-204");
    let r = api
        .post(
            &path,
            Some(ADMIN_TOKEN),
            &json!({
                "receipt": receipt, "operator": "alice",
                "reason": "checked the PSP dashboard", "request_id": "op-req-1",
            }),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["state"], "succeeded");
    assert_eq!(r.body["receipt"], receipt);
    assert_eq!(r.body["receipt_id"], "r-204");
    let entries = operator_entries(&r.body, "operator:alice");
    assert_eq!(entries.len(), 1, "{}", r.body);
    assert_eq!(entries[0]["from_state"], "held");
    assert_eq!(entries[0]["to_state"], "succeeded");
    assert_eq!(
        entries[0]["evidence"],
        "resolve by alice: checked the PSP dashboard"
    );

    let stored = db.ledger.get(op.id).await.unwrap().unwrap();
    assert_eq!(stored.state(), State::Succeeded);
    assert_eq!(stored.receipt.as_ref().map(|r| r.value()), Some(&receipt));
    let history = db.ledger.history(op.id).await.unwrap();
    let last = history.last().unwrap();
    assert_eq!(last.actor, "operator:alice");
    assert_eq!(last.to_state, "succeeded");

    let events = outbox_events(db.pool(), op.id).await;
    let succeeded: Vec<_> = events.iter().filter(|(s, _)| s == "succeeded").collect();
    assert_eq!(succeeded.len(), 1, "one result event for the agent");
    let payload = &succeeded[0].1;
    assert_eq!(payload["status"], "succeeded");
    assert_eq!(payload["receipt"], receipt);
    assert_eq!(payload["tenant"], "north");
    assert_eq!(payload["action_id"], "refund-204");

    // A final operation cannot be resolved again under a new request id.
    let r = api
        .post(
            &path,
            Some(ADMIN_TOKEN),
            &json!({
                "receipt": receipt, "operator": "bob", "reason": "again",
                "request_id": "op-req-2",
            }),
        )
        .await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.body["state"], "succeeded");

    drop(api);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_requests_are_idempotent_by_request_id() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let api = start_api(ctx.clone()).await;
    let op = unknown(&ctx, "north", "refund-1", "refund").await;
    let path = format!("{}/resolve", op_path("north", "refund-1"));
    let body = json!({
        "receipt": receipt_for("north", "refund-1", "r-1"), "operator": "alice",
        "reason": "confirmed with the bank", "request_id": "op-req-same",
    });

    let first = api.post(&path, Some(ADMIN_TOKEN), &body).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let second = api.post(&path, Some(ADMIN_TOKEN), &body).await;
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(first.body, second.body, "the stored response is returned");

    let history = db.ledger.history(op.id).await.unwrap();
    let by_alice = history
        .iter()
        .filter(|h| h.actor == "operator:alice")
        .count();
    assert_eq!(by_alice, 1, "one history entry for one request");
    let succeeded = outbox_events(db.pool(), op.id)
        .await
        .into_iter()
        .filter(|(s, _)| s == "succeeded")
        .count();
    assert_eq!(succeeded, 1, "one result event for one request");

    // The same request id for another action is a conflict, not a replay.
    let r = api
        .post(
            &format!("{}/fail", op_path("north", "refund-1")),
            Some(ADMIN_TOKEN),
            &json!({"evidence": "the bank says it was never applied", "operator": "alice",
                    "request_id": "op-req-same"}),
        )
        .await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(r.body["message"].as_str().unwrap().contains("already used"));

    drop(api);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_a_valid_token_are_refused() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let api = start_api(ctx.clone()).await;
    let op = held(&ctx, "north", "refund-7", "refund").await;
    let resolve = format!("{}/resolve", op_path("north", "refund-7"));
    let body = json!({
        "receipt": receipt_for("north", "refund-7", "r-7"), "operator": "mallory",
        "reason": "no token", "request_id": "op-req-401",
    });

    for token in [None, Some("wrong-token-wrong-token")] {
        let r = api.get("/v1/operations", token).await;
        assert_eq!(r.status, 401, "{}", r.body);
        assert_eq!(r.body["error"], "unauthorized");
        let r = api.get(&op_path("north", "refund-7"), token).await;
        assert_eq!(r.status, 401);
        let r = api.post(&resolve, token, &body).await;
        assert_eq!(r.status, 401);
    }
    // A tenant token cannot use the operator routes.
    let r = api.get("/v1/operations", Some(NORTH_TOKEN)).await;
    assert_eq!(r.status, 403, "{}", r.body);
    let r = api.post(&resolve, Some(NORTH_TOKEN), &body).await;
    assert_eq!(r.status, 403, "{}", r.body);

    let now = db.ledger.get(op.id).await.unwrap().unwrap();
    assert_eq!(now.state(), State::Held, "nothing changed");
    drop(api);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_token_reads_only_its_own_tenant() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let api = start_api(ctx.clone()).await;
    let north = held(&ctx, "north", "refund-1", "refund").await;
    held(&ctx, "south", "refund-1", "refund").await;

    let r = api
        .get(&op_path("north", "refund-1"), Some(NORTH_TOKEN))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // Exactly the result event's fields, and the trace id of the intent (null: it had none).
    let mut expected = serde_json::to_value(stored_result(&north).event).unwrap();
    expected["trace_id"] = Value::Null;
    let keys = |v: &Value| {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    assert_eq!(keys(&r.body), keys(&expected));
    assert_eq!(r.body["status"], "pending");
    assert_eq!(r.body["next_action"], "check_status");
    assert_eq!(r.body["fingerprint"], north.fingerprint);
    assert_eq!(r.body["trace_id"], Value::Null);
    assert!(r.body.get("operation").is_none());

    // Another tenant's operation looks exactly like a missing one.
    let other = api
        .get(&op_path("south", "refund-1"), Some(NORTH_TOKEN))
        .await;
    assert_eq!(other.status, 404, "{}", other.body);
    let missing = api.get(&op_path("north", "nope"), Some(NORTH_TOKEN)).await;
    assert_eq!(missing.status, 404);
    assert_eq!(other.body, missing.body);
    let r = api
        .get(&op_path("south", "refund-1"), Some(SOUTH_TOKEN))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["tenant"], "south");

    // The admin sees the event plus the operation with its history.
    let r = api
        .get(&op_path("north", "refund-1"), Some(ADMIN_TOKEN))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["status"], "pending");
    assert_eq!(r.body["operation"]["state"], "held");
    assert_eq!(r.body["operation"]["arguments"]["order"], "refund-1");
    assert!(r.body["operation"]["history"].as_array().unwrap().len() >= 3);

    drop(api);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_needs_written_evidence_and_an_operator() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let api = start_api(ctx.clone()).await;
    let op = held(&ctx, "north", "ticket-3", "ticket").await;
    let path = format!("{}/fail", op_path("north", "ticket-3"));

    for (body, needle) in [
        (json!({"operator": "carol", "request_id": "r1"}), "evidence"),
        (
            json!({"evidence": "  ", "operator": "carol", "request_id": "r1"}),
            "evidence",
        ),
        (
            json!({"evidence": "no", "operator": "carol", "request_id": "r1"}),
            "at least 10",
        ),
        (
            json!({"evidence": "ticket system has no such ticket", "request_id": "r1"}),
            "operator",
        ),
        (
            json!({"evidence": "ticket system has no such ticket", "operator": "carol"}),
            "request_id",
        ),
        (
            json!({"evidence": "ticket system has no such ticket", "operator": "carol",
                   "request_id": "r1", "typo": 1}),
            "typo",
        ),
    ] {
        let r = api.post(&path, Some(ADMIN_TOKEN), &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert!(
            r.body["message"].as_str().unwrap().contains(needle),
            "{body}: {}",
            r.body
        );
    }
    assert_eq!(
        db.ledger.get(op.id).await.unwrap().unwrap().state(),
        State::Held
    );

    let r = api
        .post(
            &path,
            Some(ADMIN_TOKEN),
            &json!({"evidence": "ticket system has no such ticket (search by key)",
                    "operator": "carol", "request_id": "op-fail-1"}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["state"], "failed");
    let entries = operator_entries(&r.body, "operator:carol");
    assert_eq!(entries.len(), 1);
    assert_eq!(
        entries[0]["evidence"],
        "fail by carol: ticket system has no such ticket (search by key)"
    );
    let events = outbox_events(db.pool(), op.id).await;
    let (status, payload) = events.last().unwrap();
    assert_eq!(status, "failed");
    assert!(payload["message"]
        .as_str()
        .unwrap()
        .contains("no such ticket"));
    assert!(payload["receipt"].is_null());

    drop(api);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_filters_by_state_and_tool_and_paginates() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let api = start_api(ctx.clone()).await;
    for i in 0..3 {
        held(&ctx, "north", &format!("refund-h{i}"), "refund").await;
    }
    for i in 0..2 {
        unknown(&ctx, "south", &format!("ticket-u{i}"), "ticket").await;
    }
    succeeded(&ctx, "north", "refund-done", "refund").await;

    let all = api.get("/v1/operations", Some(ADMIN_TOKEN)).await;
    assert_eq!(all.status, 200, "{}", all.body);
    let ops = all.body["operations"].as_array().unwrap();
    assert_eq!(ops.len(), 5, "final operations are not listed");
    assert!(all.body["next_after"].is_null());
    let first = &ops[0];
    for field in [
        "tenant",
        "action_id",
        "state",
        "first_dispatch_at",
        "attempts",
        "replay_deadline",
        "evidence",
    ] {
        assert!(first.get(field).is_some(), "missing {field}: {first}");
    }
    // A listing stays small: arguments, receipt and history are the operation's own route's.
    for field in ["arguments", "receipt", "history"] {
        assert!(first.get(field).is_none(), "{field} listed: {first}");
    }
    assert!(first["first_dispatch_at"].is_string());

    let held_only = api
        .get("/v1/operations?state=held", Some(ADMIN_TOKEN))
        .await;
    let held_ops = held_only.body["operations"].as_array().unwrap();
    assert_eq!(held_ops.len(), 3);
    assert!(held_ops.iter().all(|o| o["state"] == "held"));

    let tickets = api
        .get("/v1/operations?tool=ticket", Some(ADMIN_TOKEN))
        .await;
    let ticket_ops = tickets.body["operations"].as_array().unwrap();
    assert_eq!(ticket_ops.len(), 2);
    assert!(ticket_ops
        .iter()
        .all(|o| o["tool"] == "ticket" && o["state"] == "unknown"));

    let none = api
        .get("/v1/operations?state=held&tool=ticket", Some(ADMIN_TOKEN))
        .await;
    assert_eq!(none.body["operations"].as_array().unwrap().len(), 0);
    let old = api
        .get("/v1/operations?older_than_secs=3600", Some(ADMIN_TOKEN))
        .await;
    assert_eq!(old.body["operations"].as_array().unwrap().len(), 0);

    // Pages of two, in id order, without gaps or repeats.
    let mut seen = Vec::new();
    let mut after: Option<i64> = None;
    for _ in 0..5 {
        let path = match after {
            Some(a) => format!("/v1/operations?limit=2&after={a}"),
            None => "/v1/operations?limit=2".to_string(),
        };
        let page = api.get(&path, Some(ADMIN_TOKEN)).await;
        assert_eq!(page.status, 200, "{}", page.body);
        let ops = page.body["operations"].as_array().unwrap();
        assert!(ops.len() <= 2);
        seen.extend(ops.iter().map(|o| o["id"].as_i64().unwrap()));
        after = page.body["next_after"].as_i64();
        if after.is_none() {
            break;
        }
    }
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(seen, sorted);
    assert_eq!(seen.len(), 5);

    let bad = api
        .get("/v1/operations?state=succeeded", Some(ADMIN_TOKEN))
        .await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    let bad = api.get("/v1/operations?limit=abc", Some(ADMIN_TOKEN)).await;
    assert_eq!(bad.status, 400, "{}", bad.body);

    drop(api);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recheck_of_a_held_tool_without_recovery_holds_it_again() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let api = start_api(ctx.clone()).await;
    let op = held(&ctx, "north", "refund-9", "refund").await;
    let before = db.ledger.history(op.id).await.unwrap().len();
    let path = format!("{}/recheck", op_path("north", "refund-9"));
    let body = json!({"operator": "dave", "reason": "downstream says it is back", "request_id": "op-recheck-1"});

    let r = api.post(&path, Some(ADMIN_TOKEN), &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["state"], "held", "{}", r.body);
    // Exactly one more round was granted and spent (the tool allows 3).
    assert_eq!(r.body["recovery_attempts"], 3);
    let history = r.body["history"].as_array().unwrap();
    assert!(history.len() > before);
    let by_dave = operator_entries(&r.body, "operator:dave");
    assert_eq!(by_dave.len(), 1);
    assert_eq!(by_dave[0]["from_state"], "held");
    assert_eq!(by_dave[0]["to_state"], "unknown");
    assert_eq!(
        by_dave[0]["evidence"],
        "recheck by dave: downstream says it is back"
    );
    let last = history.last().unwrap();
    assert_eq!(last["to_state"], "held");
    assert_eq!(last["actor"], WORKER_ID);

    // The same request again: the stored response, no new round.
    let len = db.ledger.history(op.id).await.unwrap().len();
    let again = api.post(&path, Some(ADMIN_TOKEN), &body).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.body, r.body);
    assert_eq!(db.ledger.history(op.id).await.unwrap().len(), len);

    // A final operation cannot be rechecked.
    let done = succeeded(&ctx, "north", "refund-10", "refund").await;
    let r = api
        .post(
            &format!("{}/recheck", op_path("north", "refund-10")),
            Some(ADMIN_TOKEN),
            &json!({"operator": "dave", "reason": "why not", "request_id": "op-recheck-2"}),
        )
        .await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.body["state"], "succeeded");
    assert_eq!(
        db.ledger.get(done.id).await.unwrap().unwrap().state(),
        State::Succeeded
    );

    drop(api);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_operations_and_routes_answer_404() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let api = start_api(ctx.clone()).await;
    let r = api
        .get(&op_path("north", "missing"), Some(ADMIN_TOKEN))
        .await;
    assert_eq!(r.status, 404);
    assert_eq!(r.body["error"], "not_found");
    let r = api
        .post(
            &format!("{}/resolve", op_path("north", "missing")),
            Some(ADMIN_TOKEN),
            &json!({"receipt": receipt_for("north", "missing", "r"), "operator": "a",
                    "reason": "b", "request_id": "c"}),
        )
        .await;
    assert_eq!(r.status, 404);
    let r = api.get("/v2/whatever", Some(ADMIN_TOKEN)).await;
    assert_eq!(r.status, 404);
    drop(api);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_removes_private_data_and_keeps_the_tombstone() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let api = start_api(ctx.clone()).await;
    let done = succeeded(&ctx, "north", "refund-old", "refund").await;
    let open = held(&ctx, "north", "refund-open", "refund").await;
    let polled = accepted_then_polled_to_success(&ctx, "north", "deploy-old").await;
    sqlx::query("UPDATE result_outbox SET published_at = now() - interval '1 hour'")
        .execute(db.pool())
        .await
        .unwrap();
    // Say the finished one was a compensation: its tombstone keeps the link.
    sqlx::query("UPDATE operations SET compensates = 'refund-first' WHERE id = $1")
        .bind(done.id)
        .execute(db.pool())
        .await
        .unwrap();

    // Retention 0 s: private data goes at once; tombstones are kept for a day.
    let report = sweep_once(&db.ledger, Duration::ZERO, Duration::from_secs(86_400))
        .await
        .unwrap();
    assert_eq!(report.private_data, 2, "{report:?}");
    assert_eq!(report.tombstones, 0, "{report:?}");
    assert!(report.outbox >= 2, "{report:?}");

    let swept = db.ledger.get(done.id).await.unwrap().unwrap();
    assert!(swept.arguments.is_none());
    assert!(swept.receipt.is_none());
    assert!(swept.call_id.is_none());
    assert!(swept.swept_at.is_some());
    assert_eq!(swept.tenant, "north");
    assert_eq!(swept.action_id, "refund-old");
    assert_eq!(swept.fingerprint, done.fingerprint);
    assert_eq!(swept.state(), State::Succeeded);
    assert_eq!(swept.receipt_id.as_deref(), Some("r-auto"));
    assert_eq!(swept.compensates.as_deref(), Some("refund-first"));
    assert_eq!(
        stored_result(&swept).event.compensates.as_deref(),
        Some("refund-first")
    );
    // A long-running operation's acceptance may echo its arguments: it goes with them. The
    // operation id stays, like the receipt id.
    let swept = db.ledger.get(polled.id).await.unwrap().unwrap();
    assert!(swept.arguments.is_none());
    assert!(swept.receipt.is_none());
    assert!(swept.acceptance.is_none(), "{:?}", swept.acceptance);
    assert_eq!(swept.remote_id.as_deref(), Some("op-7"));
    assert_eq!(swept.state(), State::Succeeded);

    // Unresolved rows are never touched.
    let still = db.ledger.get(open.id).await.unwrap().unwrap();
    assert_eq!(still.state(), State::Held);
    assert!(still.arguments.is_some());
    assert!(still.swept_at.is_none());

    // The tombstone answers an old retry: finished, details gone, never run again.
    let answer = stored_result(&swept).event;
    assert_eq!(answer.status, Status::Rejected);
    assert_eq!(answer.reason, Some(RejectReason::Expired));
    assert_eq!(answer.detail.as_deref(), Some("succeeded"));
    assert!(answer.receipt.is_none());
    assert!(answer.message.contains("will not run again"));
    let again = db
        .ledger
        .admit(
            &[new_operation("north", "refund-old", "refund")],
            WORKER_ID,
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert!(
        !again[0].inserted,
        "the tombstone suppresses the redelivery"
    );
    assert_eq!(again[0].operation.state(), State::Succeeded);
    let r = api
        .get(&op_path("north", "refund-old"), Some(NORTH_TOKEN))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["status"], "rejected");
    assert_eq!(r.body["reason"], "expired");
    assert!(r.body["receipt"].is_null());

    // A second sweep has nothing left to do with private data.
    let report = sweep_once(&db.ledger, Duration::ZERO, Duration::from_secs(86_400))
        .await
        .unwrap();
    assert_eq!(report.private_data, 0);

    // Tombstones older than their retention are deleted; unresolved rows stay.
    let report = sweep_once(&db.ledger, Duration::ZERO, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(report.tombstones, 2, "{report:?}");
    assert!(db.ledger.get(done.id).await.unwrap().is_none());
    assert!(db.ledger.history(done.id).await.unwrap().is_empty());
    assert!(db.ledger.get(open.id).await.unwrap().is_some());

    drop(api);
    db.drop_db().await;
}

/// A long-running operation: accepted as `op-7` (the acceptance echoes the arguments), then
/// polled to `succeeded` with its final status document.
async fn accepted_then_polled_to_success(
    ctx: &worker::context::Context,
    tenant: &str,
    action_id: &str,
) -> worker::ledger::Operation {
    use worker::document::Document;
    use worker::ledger::{Applied, Completion, Phase, Source, Transition};
    let op = dispatching(ctx, tenant, action_id, "refund").await;
    let accepted = Transition::Accepted {
        operation_id: "op-7".into(),
        acceptance: Document::from_value(json!({
            "operation_id": "op-7", "state": "running",
            "arguments": {"amount_cents": 4850, "order": action_id},
        })),
        delay: Duration::from_secs(3600),
        deadline: Duration::from_secs(3600),
        evidence: "accepted as operation op-7; polling its status".into(),
    };
    let mut receipt = receipt_for(tenant, action_id, "dep-7");
    receipt["state"] = json!("succeeded");
    let done = Transition::Succeeded {
        receipt: Document::from_value(receipt),
        receipt_id: "dep-7".into(),
        evidence: "operation op-7 done: receipt dep-7 read from its status".into(),
    };
    let mut op = op;
    for (phase, by, transition) in [
        (Phase::Dispatch, Source::Dispatch, accepted),
        (Phase::Leased(State::Accepted), Source::Poll, done),
    ] {
        let applied = ctx
            .completions
            .complete(Completion {
                operation_id: op.id,
                fence: op.fence,
                phase,
                by,
                transition,
                trace: None,
                dispatched: None,
            })
            .await;
        op = match applied.0.expect("complete") {
            Applied::Done(op) => op,
            other => panic!("completion not applied: {other:?}"),
        };
    }
    assert_eq!(op.state(), State::Succeeded);
    assert!(op.acceptance.is_some());
    op
}

/// `fail` on an `unknown` row races a recovery round that holds a live lease
/// (a replay may be on the wire and bring back a receipt). It is refused like `recheck`, and
/// allowed once the lease has lapsed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_refuses_an_unknown_row_under_a_live_recovery_lease() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let api = start_api(ctx.clone()).await;
    let op = unknown(&ctx, "north", "refund-11", "refund").await;
    sqlx::query("UPDATE operations SET next_attempt_at = now() WHERE id = $1")
        .bind(op.id)
        .execute(db.pool())
        .await
        .unwrap();
    let leased = ctx
        .ledger
        .lease_for_recovery(op.id, "recovering-worker", Duration::from_secs(60))
        .await
        .unwrap()
        .expect("a recovery round leased the row");
    let events_before = outbox_events(db.pool(), op.id).await.len();
    let path = format!("{}/fail", op_path("north", "refund-11"));
    let body = json!({"evidence": "the bank says it was never applied", "operator": "erin",
                      "request_id": "op-fail-leased"});
    let r = api.post(&path, Some(ADMIN_TOKEN), &body).await;
    assert_eq!(r.status, 409, "{}", r.body);
    let now = db.ledger.get(op.id).await.unwrap().unwrap();
    assert_eq!(now.state(), State::Unknown);
    assert_eq!(
        now.fence, leased.fence,
        "the round's fence still owns the row"
    );
    assert_eq!(outbox_events(db.pool(), op.id).await.len(), events_before);

    // Once the round's lease has lapsed, the operator may fail it.
    sqlx::query("UPDATE operations SET lease_until = now() - interval '1 second' WHERE id = $1")
        .bind(op.id)
        .execute(db.pool())
        .await
        .unwrap();
    let body = json!({"evidence": "the bank says it was never applied", "operator": "erin",
                      "request_id": "op-fail-lapsed"});
    let r = api.post(&path, Some(ADMIN_TOKEN), &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["state"], "failed");

    drop(api);
    db.drop_db().await;
}

/// Requests that violate docs/openapi.yaml are refused with 400 (never 200 or 500), and the
/// limits the spec states are the ones the code applies (schemathesis found each of these).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_outside_the_spec_are_refused_with_400() {
    let db = TestDb::new().await;
    let ctx = context(&db);
    let api = start_api(ctx.clone()).await;
    let op = held(&ctx, "north", "refund-77", "refund").await;

    // The spec says older_than_secs ≤ 3153600000 and limit ≤ 500.
    for query in [
        "older_than_secs=232487493472",
        "older_than_secs=18446744073709551615",
        "limit=501",
        "limit=0",
        "state=held,",
        "state=,held",
        "state=held,%20unknown",
        "state=",
    ] {
        let r = api
            .get(&format!("/v1/operations?{query}"), Some(ADMIN_TOKEN))
            .await;
        assert_eq!(r.status, 400, "{query}: {}", r.body);
        assert_eq!(r.body["error"], "bad_request", "{query}");
    }
    let r = api
        .get(
            "/v1/operations?older_than_secs=3153600000",
            Some(ADMIN_TOKEN),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);

    // maxLength counts the characters sent, whitespace included.
    let path = format!("{}/fail", op_path("north", "refund-77"));
    let path_fail = path.clone();
    let padded = format!("{}{}", " ".repeat(60), "a".repeat(100));
    let body = json!({
        "evidence": "PSP support confirmed it was never created",
        "operator": padded, "request_id": "op-fail-pad",
    });
    let r = api.post(&path, Some(ADMIN_TOKEN), &body).await;
    assert_eq!(r.status, 400, "{}", r.body);
    let long_evidence = format!("PSP says no{}", " ".repeat(4000));
    let body = json!({
        "evidence": long_evidence, "operator": "alice", "request_id": "op-fail-long",
    });
    let r = api.post(&path, Some(ADMIN_TOKEN), &body).await;
    assert_eq!(r.status, 400, "{}", r.body);
    // A receipt that is not an object.
    let path = format!("{}/resolve", op_path("north", "refund-77"));
    let body = json!({
        "receipt": ["r-1"], "operator": "alice", "reason": "x", "request_id": "op-res-arr",
    });
    let r = api.post(&path, Some(ADMIN_TOKEN), &body).await;
    assert_eq!(r.status, 400, "{}", r.body);
    // NUL cannot be stored in Postgres text: refused (or no such operation), never a 500.
    let r = api
        .get("/v1/operations?tool=re%00fund", Some(ADMIN_TOKEN))
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    let r = api
        .get("/v1/operations/north%00/refund-77", Some(ADMIN_TOKEN))
        .await;
    assert_eq!(r.status, 404, "{}", r.body);
    let r = api
        .post(
            "/v1/operations/%00/0/fail",
            Some(ADMIN_TOKEN),
            &json!({"evidence": "0000000000", "operator": "0", "request_id": "0"}),
        )
        .await;
    assert_eq!(r.status, 404, "{}", r.body);
    let body = json!({
        "evidence": "PSP says no\u{0}, never created", "operator": "alice", "request_id": "op-nul-1",
    });
    let r = api.post(&path_fail, Some(ADMIN_TOKEN), &body).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(
        db.ledger.get(op.id).await.unwrap().unwrap().state(),
        State::Held
    );
    // A receipt is a document, not text: one holding U+0000 is kept as sent.
    let body = json!({
        "receipt": {"receipt_id": "r\u{0}1", "idempotency_key": "north:refund-77"},
        "operator": "alice", "reason": "x", "request_id": "op-nul-2",
    });
    let r = api.post(&path, Some(ADMIN_TOKEN), &body).await;
    // Its id is text the ledger keeps apart: one holding U+0000 is refused (422), never a 500.
    assert_eq!(r.status, 422, "{}", r.body);
    assert!(r.body.to_string().contains("U+0000"), "{}", r.body);
    let body = json!({
        "receipt": {"receipt_id": "r-1", "idempotency_key": "north:refund-77", "memo": "a\u{0}b"},
        "operator": "alice", "reason": "x", "request_id": "op-nul-3",
    });
    let r = api.post(&path, Some(ADMIN_TOKEN), &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let stored: String = sqlx::query_scalar("SELECT receipt::text FROM operations WHERE id = $1")
        .bind(op.id)
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert!(stored.contains(r#""memo":"a\u0000b""#), "{stored}");

    drop(api);
    db.drop_db().await;
}
