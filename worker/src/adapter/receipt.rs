//! Receipt checks: a receipt is accepted only if it carries an id and echoes the operation's
//! identity at the JSON pointers the tool declares. A receipt for another operation is never
//! stored.

use std::collections::BTreeMap;

use super::Request;

/// Fills `{tenant}`, `{action_id}`, `{key}` and `{tool}` in a template in ONE pass: the template
/// is scanned once, and a substituted value is never scanned again, so an action id that itself
/// contains `{tool}` stays as written. Any other brace text is kept literally.
pub fn fill(template: &str, request: &Request, encode: bool) -> String {
    fill_with(template, request, None, encode)
}

/// [`fill`], with `{operation_id}` filled too (a long-running operation's status URL), in the
/// same single pass.
pub fn fill_with(
    template: &str,
    request: &Request,
    operation_id: Option<&str>,
    encode: bool,
) -> String {
    let mut out = String::with_capacity(template.len() + request.idempotency_key.len());
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let value = after.find('}').and_then(|close| {
            let value = match &after[..close] {
                "tenant" => request.tenant.as_str(),
                "action_id" => request.action_id.as_str(),
                "key" => request.idempotency_key.as_str(),
                "tool" => request.tool.as_str(),
                "operation_id" => operation_id?,
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

/// A JSON pointer (RFC 6901), split into its unescaped tokens once, when the tool is loaded:
/// `serde_json::Value::pointer` splits and unescapes the text (two copies per token) on every
/// call. Resolves exactly as that function does.
#[derive(Debug, Clone)]
pub struct Pointer {
    text: String,
    /// None when the text is not a pointer (neither empty nor starting with '/'): it
    /// resolves to nothing.
    tokens: Option<Vec<String>>,
}

impl Pointer {
    pub fn new(text: &str) -> Pointer {
        let tokens = match text {
            "" => Some(Vec::new()),
            t if t.starts_with('/') => Some(
                t.split('/')
                    .skip(1)
                    .map(|token| token.replace("~1", "/").replace("~0", "~"))
                    .collect(),
            ),
            _ => None,
        };
        Pointer {
            text: text.to_owned(),
            tokens,
        }
    }

    /// The value at this pointer in `value`, if there is one.
    pub fn resolve<'v>(&self, value: &'v serde_json::Value) -> Option<&'v serde_json::Value> {
        use serde_json::Value;
        self.tokens
            .as_ref()?
            .iter()
            .try_fold(value, |target, token| match target {
                Value::Object(map) => map.get(token),
                Value::Array(items) => array_index(token).and_then(|i| items.get(i)),
                _ => None,
            })
    }
}

impl std::fmt::Display for Pointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// An array index token: decimal digits without a sign or a leading zero.
fn array_index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() != 1) {
        return None;
    }
    token.parse().ok()
}

/// What a tool accepts as its receipt: an id at `receipt_id`, and the operation's identity
/// echoed at each pointer of `receipt_match` (pointers parsed once).
#[derive(Debug, Clone)]
pub struct ReceiptRule {
    id: Pointer,
    echoes: Vec<(Pointer, String)>,
}

impl ReceiptRule {
    pub fn new(receipt_id: &str, receipt_match: &BTreeMap<String, String>) -> ReceiptRule {
        ReceiptRule {
            id: Pointer::new(receipt_id),
            echoes: receipt_match
                .iter()
                .map(|(pointer, template)| (Pointer::new(pointer), template.clone()))
                .collect(),
        }
    }

    /// Checks `receipt` against the id pointer and echo fields; the receipt's id if it passes.
    pub fn check(&self, request: &Request, receipt: &serde_json::Value) -> Result<String, String> {
        let pointer = &self.id;
        let id = match pointer.resolve(receipt) {
            // The receipt is kept as sent, but its id is also text of its own (Postgres text
            // cannot hold U+0000): such an id proves nothing the worker could record.
            Some(serde_json::Value::String(s)) if s.contains('\0') => {
                return Err(format!(
                    "receipt id at {pointer} contains U+0000: {:?}",
                    kit::text::visible(s)
                ))
            }
            Some(serde_json::Value::String(s)) if !s.is_empty() => s.clone(),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            Some(other) => return Err(format!("receipt id at {pointer} is not a string: {other}")),
            None => return Err(format!("receipt has no id at {pointer}")),
        };
        for (pointer, template) in &self.echoes {
            let expected = fill(template, request, false);
            let other;
            let found = match pointer.resolve(receipt) {
                Some(serde_json::Value::String(s)) => s.as_str(),
                Some(serde_json::Value::Null) | None => {
                    return Err(format!(
                        "receipt {id} has no {pointer} (expected {expected:?})"
                    ))
                }
                Some(value) => {
                    other = value.to_string();
                    other.as_str()
                }
            };
            if found != expected {
                return Err(format!(
                    "receipt {id} is for another operation: {pointer} is {found:?}, expected {expected:?}"
                ));
            }
        }
        Ok(id)
    }

    /// Why `document` (a long-running operation's acceptance or status, which need not carry a
    /// receipt) is about another operation than `request`'s: an echo field of `receipt_match`
    /// that is present and differs. None when every echo field is equal or absent: a running
    /// or failed operation's document may not echo the key.
    pub fn contradiction(&self, request: &Request, document: &serde_json::Value) -> Option<String> {
        self.echoes.iter().find_map(|(pointer, template)| {
            let found = match pointer.resolve(document)? {
                serde_json::Value::Null => return None,
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            let expected = fill(template, request, false);
            (found != expected).then(|| format!("{pointer} is {found:?}, expected {expected:?}"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn req() -> Request {
        Request {
            tenant: "north-shop".into(),
            action_id: "refund/204 x".into(),
            tool: "refund".into(),
            idempotency_key: "north-shop:refund/204 x".into(),
            body: "{}".into(),
            trace: None,
            deadline: None,
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
            deadline: None,
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
                deadline: None,
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
        let check = |pointer: &str, m: &BTreeMap<String, String>, r: &Request, v: &Value| {
            ReceiptRule::new(pointer, m).check(r, v)
        };
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

    #[test]
    fn only_a_present_and_different_echo_contradicts() {
        let m = BTreeMap::from([(
            "/idempotency_key".to_string(),
            "{tenant}:{action_id}".to_string(),
        )]);
        let rule = ReceiptRule::new("/receipt_id", &m);
        for (doc, contradicts) in [
            (json!({"idempotency_key": "north-shop:refund/204 x"}), None),
            (json!({"state": "failed"}), None),
            (json!({"idempotency_key": null}), None),
            (
                json!({"idempotency_key": "someone-else:other-action"}),
                Some("/idempotency_key is \"someone-else:other-action\", expected \"north-shop:refund/204 x\""),
            ),
            (
                json!({"idempotency_key": 7}),
                Some("/idempotency_key is \"7\", expected \"north-shop:refund/204 x\""),
            ),
        ] {
            assert_eq!(
                rule.contradiction(&req(), &doc).as_deref(),
                contradicts,
                "{doc}"
            );
        }
    }

    #[test]
    fn pointers_resolve_as_serde_json_does() {
        let doc = json!({
            "a": {"b": [10, {"c": "deep"}], "": "empty key"},
            "m~n": 1, "x/y": 2, "~1": 3, "0": "zero key",
            "list": ["first", "second"], "n": null, "id": 12345678901234567890u64,
        });
        let pointers = [
            "",
            "/",
            "/a",
            "/a/",
            "/a/b",
            "/a/b/0",
            "/a/b/1/c",
            "/a/b/2",
            "/a/b/01",
            "/a/b/+1",
            "/a/b/-",
            "/a/b/1/c/x",
            "/m~0n",
            "/x~1y",
            "/~01",
            "/~1",
            "/0",
            "/list/0",
            "/list/1",
            "/list/00",
            "/list/ 1",
            "/n",
            "/n/x",
            "/id",
            "a",
            "#/a",
            "/missing",
            "/a/b/18446744073709551616",
        ];
        for text in pointers {
            assert_eq!(
                Pointer::new(text).resolve(&doc),
                doc.pointer(text),
                "{text:?}"
            );
        }
        assert_eq!(Pointer::new("/a/b/1/c").to_string(), "/a/b/1/c");
    }

    #[test]
    fn echoes_of_other_types_compare_as_their_json_text() {
        let m = BTreeMap::from([("/echo".to_string(), "{tenant}".to_string())]);
        let rule = ReceiptRule::new("/id", &m);
        let number = json!({"id": 7, "echo": 12});
        let r = Request {
            tenant: "12".into(),
            ..req()
        };
        assert_eq!(rule.check(&r, &number), Ok("7".into()));
        let quoted = Request {
            tenant: "\"12\"".into(),
            ..req()
        };
        assert!(rule
            .check(&quoted, &number)
            .unwrap_err()
            .contains("is \"12\", expected \"\\\"12\\\"\""));
        assert!(rule
            .check(&r, &json!({"id": 7, "echo": null}))
            .unwrap_err()
            .contains("has no /echo"));
        assert!(rule
            .check(&r, &json!({"id": "", "echo": "12"}))
            .unwrap_err()
            .contains("not a string"));
    }
}
