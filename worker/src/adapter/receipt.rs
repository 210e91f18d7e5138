//! Receipt checks: a receipt is accepted only if it carries an id and echoes the operation's
//! identity at the JSON pointers the tool declares. A receipt for another operation is never
//! stored.

use std::collections::BTreeMap;

use super::Request;

/// Fills `{tenant}`, `{action_id}`, `{key}` and `{tool}` in a template in ONE pass: the template
/// is scanned once, and a substituted value is never scanned again, so an action id that itself
/// contains `{tool}` stays as written. Any other brace text is kept literally.
pub fn fill(template: &str, request: &Request, encode: bool) -> String {
    let mut out = String::with_capacity(template.len() + request.idempotency_key.len());
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let value = after.find('}').and_then(|close| {
            let value = match &after[..close] {
                "tenant" => &request.tenant,
                "action_id" => &request.action_id,
                "key" => &request.idempotency_key,
                "tool" => &request.tool,
                _ => return None,
            };
            Some((value, close))
        });
        match value {
            Some((value, close)) => {
                if encode {
                    out.push_str(&percent_encode(value));
                } else {
                    out.push_str(value);
                }
                rest = &after[close + 1..];
            }
            None => {
                out.push('{');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
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
            trace: None,
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
    fn substituted_values_are_never_scanned_again() {
        let r = Request {
            tenant: "t{tool}".into(),
            action_id: "brace{tool}-1{key}".into(),
            tool: "ticket".into(),
            idempotency_key: "t{tool}:brace{tool}-1{key}".into(),
            body: "{}".into(),
            trace: None,
        };
        assert_eq!(
            fill("{tenant}:{action_id}", &r, false),
            "t{tool}:brace{tool}-1{key}"
        );
        assert_eq!(fill("{x}{{tool}}{", &r, false), "{x}{ticket}{");
        assert_eq!(
            fill("/by-key/{key}", &r, true),
            "/by-key/t%7Btool%7D:brace%7Btool%7D-1%7Bkey%7D"
        );
    }

    fn decode(s: &str) -> String {
        let bytes = s.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'%' {
                out.push(u8::from_str_radix(&s[i + 1..i + 3], 16).unwrap());
                i += 3;
            } else {
                out.push(bytes[i]);
                i += 1;
            }
        }
        String::from_utf8(out).unwrap()
    }

    proptest::proptest! {
        /// Filling then parsing a URL recovers the values exactly, whatever they contain
        /// (braces, slashes, '%', placeholders, any Unicode).
        #[test]
        fn filled_urls_parse_back_to_the_values(
            tenant in "\\PC{0,24}|[a-z{}]{0,12}",
            action_id in "\\PC{0,40}|[{}a-z_%/?#]{0,20}|\\{(tenant|action_id|key|tool)\\}",
        ) {
            let r = Request {
                idempotency_key: format!("{tenant}:{action_id}"),
                tenant,
                action_id,
                tool: "ticket".into(),
                body: "{}".into(),
                trace: None,
            };
            let url = fill("http://h/a/{tenant}/b/{action_id}/c/{key}?tool={tool}", &r, true);
            let (path, query) = url.split_once('?').unwrap();
            let parts: Vec<&str> = path.split('/').collect();
            proptest::prop_assert_eq!(parts.len(), 9, "{}", url);
            proptest::prop_assert_eq!(decode(parts[4]), r.tenant.clone());
            proptest::prop_assert_eq!(decode(parts[6]), r.action_id.clone());
            proptest::prop_assert_eq!(decode(parts[8]), r.idempotency_key.clone());
            proptest::prop_assert_eq!(query, "tool=ticket");
            // The unencoded form (receipt echo checks) is the plain concatenation.
            proptest::prop_assert_eq!(
                fill("{tenant}:{action_id}", &r, false),
                r.idempotency_key.clone()
            );
        }
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
