//! `salvage_key`: addressing a `rejected` result for a body that failed strict decoding,
//! without ever trusting a key that would itself fail the key rules.

use protocol::{decode_intent, salvage_key, MAX_INTENT_BYTES};

#[test]
fn salvages_the_key_of_a_body_with_an_unknown_field() {
    let body = br#"{"tenant":"north-shop","action_id":"refund-204","tool":"refund",
        "arguments":{"amount_cents":4850},"priority":"high"}"#;
    assert_eq!(decode_intent(body).unwrap_err().code(), "unknown_field");
    assert_eq!(
        salvage_key(body),
        Some(("north-shop".to_owned(), "refund-204".to_owned()))
    );
}

#[test]
fn salvages_when_only_tenant_and_action_id_are_usable() {
    let body = br#"{"tenant":"north-shop","action_id":"refund-204","arguments":[1]}"#;
    assert_eq!(
        salvage_key(body),
        Some(("north-shop".to_owned(), "refund-204".to_owned()))
    );
}

#[test]
fn refuses_a_bad_tenant() {
    let body =
        br#"{"tenant":"north:shop","action_id":"refund-204","tool":"refund","arguments":{}}"#;
    assert_eq!(salvage_key(body), None);
    let body = br#"{"tenant":"north.*","action_id":"refund-204"}"#;
    assert_eq!(salvage_key(body), None);
}

#[test]
fn refuses_missing_non_string_or_bad_action_id() {
    assert_eq!(salvage_key(br#"{"tenant":"north-shop"}"#), None);
    assert_eq!(
        salvage_key(br#"{"tenant":"north-shop","action_id":204}"#),
        None
    );
    assert_eq!(
        salvage_key(br#"{"tenant":"north-shop","action_id":"refund 204"}"#),
        None
    );
}

#[test]
fn refuses_an_ambiguous_tenant() {
    let body = br#"{"tenant":"north-shop","action_id":"a","tenant":"south-shop"}"#;
    assert_eq!(salvage_key(body), None);
}

#[test]
fn refuses_non_objects_non_json_and_oversized_bodies() {
    assert_eq!(salvage_key(br#"["north-shop","refund-204"]"#), None);
    assert_eq!(
        salvage_key(br#"{"tenant":"north-shop","action_id":"a""#),
        None
    );
    let padding = " ".repeat(MAX_INTENT_BYTES);
    let body = format!(r#"{{"tenant":"north-shop","action_id":"a"}}{padding}"#);
    assert_eq!(salvage_key(body.as_bytes()), None);
}

#[test]
fn salvage_reply_to_takes_only_a_sole_valid_reply_to() {
    use protocol::salvage_reply_to;
    assert_eq!(
        salvage_reply_to(br#"{"tenant":"t","action_id":"a","arguments":5,"reply_to":"agent-7"}"#),
        Some("agent-7".to_string())
    );
    assert_eq!(salvage_reply_to(br#"{"tenant":"t","arguments":5}"#), None);
    assert_eq!(
        salvage_reply_to(br#"{"reply_to":"a.*"}"#),
        None,
        "no wildcards"
    );
    assert_eq!(
        salvage_reply_to(br#"{"reply_to":"a","reply_to":"b"}"#),
        None
    );
    assert_eq!(salvage_reply_to(br#"{"reply_to":7}"#), None);
    assert_eq!(salvage_reply_to(b"not json"), None);
}

/// A number beyond the double range makes serde refuse the whole body; the key is still
/// salvaged, so the agent hears `rejected` exactly as for a number below the range.
#[test]
fn salvages_the_key_of_a_body_with_a_number_beyond_the_double_range() {
    for n in ["1e400", "-1e400", "1e-400"] {
        let body = format!(
            r#"{{"tenant":"t","action_id":"a-1","tool":"x","arguments":{{"n":{n}}},"reply_to":"r"}}"#
        );
        assert!(decode_intent(body.as_bytes()).is_err(), "{n}");
        assert_eq!(
            salvage_key(body.as_bytes()),
            Some(("t".to_string(), "a-1".to_string())),
            "{n}"
        );
        assert_eq!(
            protocol::salvage_reply_to(body.as_bytes()).as_deref(),
            Some("r")
        );
    }
}
