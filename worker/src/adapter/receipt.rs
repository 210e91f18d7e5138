//! Receipt checks: a receipt is accepted only if it carries an id and echoes the operation's
//! identity at the JSON pointers the tool declares. A receipt for another operation is never
//! stored.

use std::collections::BTreeMap;

use super::Request;

/// Fills `{tenant}`, `{action_id}`, `{key}` and `{tool}` in a template.
pub fn fill(template: &str, request: &Request, encode: bool) -> String {
    let enc = |s: &str| {
        if encode {
            percent_encode(s)
        } else {
            s.to_string()
        }
    };
    template
        .replace("{tenant}", &enc(&request.tenant))
        .replace("{action_id}", &enc(&request.action_id))
        .replace("{key}", &enc(&request.idempotency_key))
        .replace("{tool}", &enc(&request.tool))
}

/// Percent-encodes everything but RFC 3986 unreserved characters and ':' (kept readable in
/// keys like `north-shop:refund-204`).
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b':') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Checks `receipt` against the tool's receipt id pointer and echo fields.
pub fn check(
    receipt_id_pointer: &str,
    receipt_match: &BTreeMap<String, String>,
    request: &Request,
    receipt: &serde_json::Value,
) -> Result<String, String> {
    let id = match receipt.pointer(receipt_id_pointer) {
        Some(serde_json::Value::String(s)) if !s.is_empty() => s.clone(),
        Some(serde_json::Value::Number(n)) => n.to_string(),
        Some(other) => {
            return Err(format!(
                "receipt id at {receipt_id_pointer} is not a string: {other}"
            ))
        }
        None => return Err(format!("receipt has no id at {receipt_id_pointer}")),
    };
    for (pointer, template) in receipt_match {
        let expected = fill(template, request, false);
        let found = match receipt.pointer(pointer) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Null) | None => {
                return Err(format!(
                    "receipt {id} has no {pointer} (expected {expected:?})"
                ))
            }
            Some(other) => other.to_string(),
        };
        if found != expected {
            return Err(format!(
                "receipt {id} is for another operation: {pointer} is {found:?}, expected {expected:?}"
            ));
        }
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn req() -> Request {
        Request {
            tenant: "north-shop".into(),
            action_id: "refund/204 x".into(),
            tool: "refund".into(),
            idempotency_key: "north-shop:refund/204 x".into(),
            body: "{}".into(),
        }
    }

    #[test]
    fn fills_and_encodes_templates() {
        assert_eq!(
            fill("{tenant}:{action_id}", &req(), false),
            "north-shop:refund/204 x"
        );
        assert_eq!(
            fill("/by-key/{key}", &req(), true),
            "/by-key/north-shop:refund%2F204%20x"
        );
    }

    #[test]
    fn accepts_only_matching_receipts() {
        let m = BTreeMap::from([(
            "/idempotency_key".to_string(),
            "{tenant}:{action_id}".to_string(),
        )]);
        let good = json!({"receipt_id": "rcpt-1", "idempotency_key": "north-shop:refund/204 x"});
        assert_eq!(check("/receipt_id", &m, &req(), &good), Ok("rcpt-1".into()));
        let other = json!({"receipt_id": "rcpt-2", "idempotency_key": "south:refund/204 x"});
        assert!(check("/receipt_id", &m, &req(), &other)
            .unwrap_err()
            .contains("another operation"));
        let no_id = json!({"idempotency_key": "north-shop:refund/204 x"});
        assert!(check("/receipt_id", &m, &req(), &no_id).is_err());
        let missing_echo = json!({"receipt_id": "rcpt-3"});
        assert!(check("/receipt_id", &m, &req(), &missing_echo).is_err());
    }
}
