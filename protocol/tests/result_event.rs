//! The result event's JSON shape (docs/design.md section 7): round trips, `receipt` always
//! present (as `null` when absent), `reason`/`detail` only on rejections, and lenient
//! decoding so the contract can grow.

use protocol::{RejectReason, ResultEvent, Status};
use serde_json::{json, Value};

fn pending() -> ResultEvent {
    ResultEvent {
        tenant: "north-shop".into(),
        action_id: "refund-204".into(),
        tool: "refund".into(),
        status: Status::Pending,
        receipt: None,
        next_action: Some("check_status".into()),
        attempts: 1,
        message: "The refund outcome is unknown. Do not submit it again.".into(),
        fingerprint: Some(
            "840002b2c80dba19dfe1fe1304e4f5172b66aab90a0ed95afcb441d3d83c6ff9".into(),
        ),
        reason: None,
        detail: None,
        verified_by: None,
        operator: None,
        remote_id: None,
        uncertainty: None,
        retry_after_ms: None,
        compensates: None,
        compensated_by: None,
        event_id: "5f0c6c1e-8a5c-4c2b-9d4e-1b2a3c4d5e6f".into(),
        occurred_at: "2025-11-29T21:34:00Z".into(),
    }
}

#[test]
fn pending_matches_the_design_shape() {
    let v = serde_json::to_value(pending()).unwrap();
    assert_eq!(
        v,
        json!({"tenant":"north-shop","action_id":"refund-204","tool":"refund","status":"pending",
               "receipt":null,"next_action":"check_status","attempts":1,
               "message":"The refund outcome is unknown. Do not submit it again.",
               "fingerprint":"840002b2c80dba19dfe1fe1304e4f5172b66aab90a0ed95afcb441d3d83c6ff9",
               "event_id":"5f0c6c1e-8a5c-4c2b-9d4e-1b2a3c4d5e6f",
               "occurred_at":"2025-11-29T21:34:00Z"})
    );
    let object = v.as_object().unwrap();
    assert_eq!(object.get("receipt"), Some(&Value::Null));
    assert!(!object.contains_key("reason") && !object.contains_key("detail"));
}

#[test]
fn round_trips() {
    let mut succeeded = pending();
    succeeded.status = Status::Succeeded;
    succeeded.receipt = Some(json!({"refund_id": "re_1", "amount_cents": 4850}));
    succeeded.next_action = None;
    for event in [pending(), succeeded] {
        let text = serde_json::to_string(&event).unwrap();
        assert_eq!(serde_json::from_str::<ResultEvent>(&text).unwrap(), event);
    }
}

#[test]
fn reason_and_detail_only_on_rejected() {
    let mut rejected = pending();
    rejected.status = Status::Rejected;
    rejected.next_action = None;
    rejected.fingerprint = None;
    rejected.reason = Some(RejectReason::InvalidMessage);
    rejected.detail = Some("unknown_field".into());
    let v = serde_json::to_value(&rejected).unwrap();
    assert_eq!(v["status"], "rejected");
    assert_eq!(v["reason"], "invalid_message");
    assert_eq!(v["detail"], "unknown_field");
    assert_eq!(v["fingerprint"], Value::Null);
    assert_eq!(serde_json::from_value::<ResultEvent>(v).unwrap(), rejected);
}

#[test]
fn decoding_ignores_unknown_fields_and_defaults_absent_options() {
    let v = json!({"tenant":"north-shop","action_id":"refund-204","tool":"refund",
                   "status":"failed","attempts":2,"message":"Declined: card expired.",
                   "event_id":"e","occurred_at":"2025-11-29T21:34:00Z",
                   "schema_version":2,"trace_id":"abc"});
    let event: ResultEvent = serde_json::from_value(v).unwrap();
    assert_eq!(event.status, Status::Failed);
    assert_eq!(
        (
            event.receipt,
            event.next_action,
            event.fingerprint,
            event.reason
        ),
        (None, None, None, None)
    );
}

#[test]
fn wire_names_match_as_str() {
    for status in [
        Status::Succeeded,
        Status::Pending,
        Status::Failed,
        Status::Rejected,
    ] {
        assert_eq!(serde_json::to_value(status).unwrap(), status.as_str());
        assert_eq!(status.to_string(), status.as_str());
    }
    for reason in [
        RejectReason::IntentConflict,
        RejectReason::InvalidMessage,
        RejectReason::UnknownTool,
        RejectReason::TenantMismatch,
    ] {
        assert_eq!(serde_json::to_value(reason).unwrap(), reason.as_str());
        assert_eq!(reason.to_string(), reason.as_str());
    }
}
