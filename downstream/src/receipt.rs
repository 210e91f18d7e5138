//! The receipt: the downstream's durable proof that one business change happened.
//!
//! A receipt is built once, when its mutation is inserted, and stored with it;
//! replays and lookups return the stored JSON, never a rebuilt one, so a client
//! can compare receipts byte for byte. The deliberately wrong receipt used by
//! the `wrong_receipt` fault lives here too, so both shapes stay in step.

use serde_json::{json, Value};
use sqlx::types::chrono::{DateTime, Utc};

/// The idempotency key a `wrong_receipt` answer claims: clearly someone else's.
pub const WRONG_KEY: &str = "someone-else:other-action";

/// Receipt for mutation `id`.
pub fn build(
    id: i64,
    idem_key: Option<&str>,
    mode: &str,
    resource: &str,
    arguments: &Value,
    created_at: DateTime<Utc>,
) -> Value {
    json!({
        "receipt_id": receipt_id(id),
        "idempotency_key": idem_key,
        "mode": mode,
        "resource": resource,
        "arguments": arguments,
        "created_at": created_at.to_rfc3339(),
    })
}

pub fn receipt_id(id: i64) -> String {
    format!("rcpt-{id}")
}

/// A well-formed receipt for a different operation: same shape and arguments,
/// foreign idempotency key and receipt id. A client that only checks the shape
/// (or only the arguments) will wrongly accept it; that is what it tests.
pub fn wrong(n: u64, mode: &str, resource: &str, arguments: &Value) -> Value {
    json!({
        "receipt_id": format!("rcpt-wrong-{n}"),
        "idempotency_key": WRONG_KEY,
        "mode": mode,
        "resource": resource,
        "arguments": arguments,
        "created_at": Utc::now().to_rfc3339(),
    })
}

/// A made-up receipt for a key that was never written, echoing the key: what a lookup that
/// "answers 200 for anything" returns. It passes a receipt check that compares the key, which
/// is why `lookup-phantom` mode turns a lookup miss into a false success.
pub fn phantom(n: u64, mode: &str, resource: &str, key: &str) -> Value {
    json!({
        "receipt_id": format!("rcpt-phantom-{n}"),
        "idempotency_key": key,
        "mode": mode,
        "resource": resource,
        "arguments": {},
        "created_at": Utc::now().to_rfc3339(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receipt_shape() {
        let at = DateTime::parse_from_rfc3339("2024-01-02T03:04:05Z")
            .unwrap()
            .with_timezone(&Utc);
        let r = build(7, Some("k"), "replay", "refunds", &json!({"a": 1}), at);
        assert_eq!(r["receipt_id"], "rcpt-7");
        assert_eq!(r["idempotency_key"], "k");
        assert_eq!(r["created_at"], "2024-01-02T03:04:05+00:00");
        let r = build(8, None, "none", "refunds", &json!({}), at);
        assert!(r["idempotency_key"].is_null());
        assert_eq!(
            wrong(3, "none", "x", &json!({}))["idempotency_key"],
            WRONG_KEY
        );
    }
}
