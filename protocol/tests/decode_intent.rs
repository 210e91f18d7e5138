//! Strict decoding of intent bodies: the docs/design.md example decodes, and every rule of the
//! wire contract rejects a realistic bad body with its own `DecodeError` variant.

use protocol::{decode_intent, DecodeError, Intent, MAX_INTENT_BYTES, MAX_KEY_LEN, MAX_TOOL_LEN};
use serde_json::json;

const EXAMPLE: &str = r#"{"tenant":"north-shop","action_id":"refund-204","tool":"refund",
 "arguments":{"order":"order-731","amount_cents":4850,"currency":"USD"},
 "call_id":"model-call-9f2","reply_to":"north-shop"}"#;

fn decode(v: serde_json::Value) -> Result<Intent, DecodeError> {
    decode_intent(v.to_string().as_bytes())
}

fn refund_with(field: &str, value: serde_json::Value) -> serde_json::Value {
    let mut body = json!({
        "tenant": "north-shop",
        "action_id": "refund-204",
        "tool": "refund",
        "arguments": {"order": "order-731", "amount_cents": 4850, "currency": "USD"},
    });
    body[field] = value;
    body
}

#[test]
fn design_example_decodes() {
    let intent = decode_intent(EXAMPLE.as_bytes()).unwrap();
    assert_eq!(
        intent,
        Intent {
            tenant: "north-shop".into(),
            action_id: "refund-204".into(),
            tool: "refund".into(),
            arguments: json!({"order": "order-731", "amount_cents": 4850, "currency": "USD"}),
            call_id: Some("model-call-9f2".into()),
            reply_to: Some("north-shop".into()),
            compensates: None,
        }
    );
}

#[test]
fn to_json_round_trips_and_omits_absent_options() {
    let mut intent = decode_intent(EXAMPLE.as_bytes()).unwrap();
    assert_eq!(decode_intent(&intent.to_json()).unwrap(), intent);
    intent.call_id = None;
    intent.reply_to = None;
    let body = String::from_utf8(intent.to_json()).unwrap();
    assert!(
        !body.contains("call_id") && !body.contains("reply_to"),
        "{body}"
    );
    assert_eq!(decode_intent(body.as_bytes()).unwrap(), intent);
}

#[test]
fn null_optional_fields_count_as_absent() {
    let body = json!({"tenant": "t", "action_id": "a", "tool": "x", "arguments": {},
                      "call_id": null, "reply_to": null});
    let intent = decode(body).unwrap();
    assert_eq!((intent.call_id, intent.reply_to), (None, None));
}

#[test]
fn call_id_does_not_change_the_fingerprint() {
    let first = decode(refund_with("call_id", json!("model-call-1"))).unwrap();
    let second = decode(refund_with("call_id", json!("model-call-2"))).unwrap();
    let without = decode(refund_with("reply_to", json!("north-shop"))).unwrap();
    assert_eq!(first.fingerprint(), second.fingerprint());
    assert_eq!(first.fingerprint(), without.fingerprint());
}

#[test]
fn fingerprint_and_canonical_arguments_follow_the_free_functions() {
    let intent = decode_intent(EXAMPLE.as_bytes()).unwrap();
    assert_eq!(
        intent.fingerprint(),
        protocol::fingerprint("refund", &intent.arguments)
    );
    assert_eq!(
        intent.canonical_arguments(),
        r#"{"amount_cents":4850,"currency":"USD","order":"order-731"}"#
    );
}

#[test]
fn too_large() {
    let padding = " ".repeat(MAX_INTENT_BYTES);
    let body = format!("{EXAMPLE}{padding}");
    let err = decode_intent(body.as_bytes()).unwrap_err();
    assert_eq!(
        err,
        DecodeError::TooLarge {
            size: body.len(),
            limit: MAX_INTENT_BYTES
        }
    );
    assert_eq!(err.code(), "too_large");
}

#[test]
fn exactly_the_limit_is_not_too_large() {
    let padding = " ".repeat(MAX_INTENT_BYTES - EXAMPLE.len());
    let body = format!("{EXAMPLE}{padding}");
    assert_eq!(body.len(), MAX_INTENT_BYTES);
    assert!(decode_intent(body.as_bytes()).is_ok());
}

#[test]
fn not_json_reports_line_and_column() {
    let body = "{\"tenant\":\"north-shop\",\n \"action_id\":'refund-204'}";
    let err = decode_intent(body.as_bytes()).unwrap_err();
    match &err {
        DecodeError::NotJson(detail) => assert!(detail.contains("line 2 column"), "{detail}"),
        other => panic!("expected NotJson, got {other:?}"),
    }
    assert_eq!(err.code(), "not_json");
}

#[test]
fn not_utf8_is_not_json() {
    let body = b"{\"tenant\":\"north-\xff-shop\"}";
    assert_eq!(decode_intent(body).unwrap_err().code(), "not_json");
}

#[test]
fn trailing_garbage_is_not_json() {
    let body = format!("{EXAMPLE} {{}}");
    assert_eq!(
        decode_intent(body.as_bytes()).unwrap_err().code(),
        "not_json"
    );
}

#[test]
fn not_an_object() {
    let body = format!("[{EXAMPLE}]");
    assert_eq!(
        decode_intent(body.as_bytes()).unwrap_err(),
        DecodeError::NotAnObject
    );
    for scalar in ["\"refund\"", "42", "null", "true"] {
        assert_eq!(
            decode_intent(scalar.as_bytes()).unwrap_err(),
            DecodeError::NotAnObject,
            "{scalar}"
        );
    }
}

#[test]
fn duplicate_field() {
    let body = r#"{"tenant":"north-shop","action_id":"refund-204","tool":"refund",
        "arguments":{"amount_cents":4850},"tenant":"south-shop"}"#;
    let err = decode_intent(body.as_bytes()).unwrap_err();
    assert_eq!(err, DecodeError::DuplicateField("tenant".into()));
    assert_eq!(err.code(), "duplicate_field");
}

#[test]
fn duplicate_wins_over_unknown() {
    let body = r#"{"priority":1,"tool":"a","tool":"a"}"#;
    assert_eq!(
        decode_intent(body.as_bytes()).unwrap_err(),
        DecodeError::DuplicateField("tool".into())
    );
}

#[test]
fn duplicate_among_many_fields_is_the_first_that_repeats() {
    // Small and large objects take different paths; both name the first repeat in document
    // order, not the first key that has a twin later.
    for extra in [3usize, 40] {
        let mut body = String::from(r#"{"tenant":"t","action_id":"a","tool":"x""#);
        for i in 0..extra {
            body.push_str(&format!(r#","k{i}":1"#));
        }
        body.push_str(r#","k1":2,"tool":"y","k0":3}"#);
        assert_eq!(
            decode_intent(body.as_bytes()).unwrap_err(),
            DecodeError::DuplicateField("k1".into()),
            "{extra} extra keys"
        );
    }
}

#[test]
fn unknown_field() {
    let err = decode(refund_with("idempotency_key", json!("abc"))).unwrap_err();
    assert_eq!(err, DecodeError::UnknownField("idempotency_key".into()));
    assert_eq!(err.code(), "unknown_field");
}

#[test]
fn unknown_field_name_is_shortened_in_the_error() {
    let long = "x".repeat(10_000);
    let err = decode(refund_with(&long, json!(1))).unwrap_err();
    match err {
        DecodeError::UnknownField(name) => assert!(name.chars().count() <= 65, "{name}"),
        other => panic!("expected UnknownField, got {other:?}"),
    }
}

#[test]
fn missing_field() {
    let body = json!({"tenant": "north-shop", "action_id": "refund-204", "tool": "refund"});
    let err = decode(body).unwrap_err();
    assert_eq!(err, DecodeError::MissingField("arguments"));
    assert_eq!(err.code(), "missing_field");
}

#[test]
fn wrong_type() {
    let err = decode(refund_with("action_id", json!(204))).unwrap_err();
    assert_eq!(
        err,
        DecodeError::WrongType {
            field: "action_id",
            expected: "a string"
        }
    );
    assert_eq!(err.code(), "wrong_type");
}

#[test]
fn arguments_must_be_an_object() {
    let err = decode(refund_with("arguments", json!(["order-731", 4850]))).unwrap_err();
    assert_eq!(
        err,
        DecodeError::WrongType {
            field: "arguments",
            expected: "a JSON object"
        }
    );
}

#[test]
fn required_null_is_wrong_type_and_optional_number_too() {
    assert_eq!(
        decode(refund_with("tenant", json!(null)))
            .unwrap_err()
            .code(),
        "wrong_type"
    );
    assert_eq!(
        decode(refund_with("call_id", json!(9))).unwrap_err(),
        DecodeError::WrongType {
            field: "call_id",
            expected: "a string or null"
        }
    );
}

#[test]
fn empty_field() {
    let err = decode(refund_with("action_id", json!(""))).unwrap_err();
    assert_eq!(err, DecodeError::EmptyField("action_id"));
    assert_eq!(err.code(), "empty_field");
    assert_eq!(
        decode(refund_with("reply_to", json!(""))).unwrap_err(),
        DecodeError::EmptyField("reply_to")
    );
}

#[test]
fn too_long() {
    let err = decode(refund_with("tool", json!("r".repeat(MAX_TOOL_LEN + 1)))).unwrap_err();
    assert_eq!(
        err,
        DecodeError::TooLong {
            field: "tool",
            len: MAX_TOOL_LEN + 1,
            max: MAX_TOOL_LEN
        }
    );
    assert_eq!(err.code(), "too_long");
}

#[test]
fn key_length_limit_is_inclusive_and_counts_characters() {
    assert!(decode(refund_with("action_id", json!("a".repeat(MAX_KEY_LEN)))).is_ok());
    // 200 two-byte characters: over 200 bytes but within 200 characters.
    assert!(decode(refund_with("call_id", json!("é".repeat(MAX_KEY_LEN)))).is_ok());
    assert_eq!(
        decode(refund_with("call_id", json!("é".repeat(MAX_KEY_LEN + 1)))).unwrap_err(),
        DecodeError::TooLong {
            field: "call_id",
            len: MAX_KEY_LEN + 1,
            max: MAX_KEY_LEN
        }
    );
}

#[test]
fn invalid_characters() {
    // A ':' in the tenant would make "<tenant>:<action_id>" ambiguous.
    let err = decode(refund_with("tenant", json!("north:shop"))).unwrap_err();
    assert!(matches!(
        err,
        DecodeError::InvalidCharacters {
            field: "tenant",
            ..
        }
    ));
    assert_eq!(err.code(), "invalid_characters");
}

#[test]
fn character_rules_per_field() {
    let rejects = [
        ("tenant", "north shop"),
        ("tenant", "north*shop"),
        ("tenant", "north#"),
        ("tenant", "nörth"),
        ("action_id", "refund 204"),
        ("action_id", "refund\t204"),
        ("action_id", "refund-204é"),
        ("tool", "refund/v2"),
        ("call_id", "call\n9f2"),
        ("call_id", "call\u{7f}"),
        ("reply_to", "north:shop"),
    ];
    for (field, value) in rejects {
        assert_eq!(
            decode(refund_with(field, json!(value))).unwrap_err().code(),
            "invalid_characters",
            "{field} = {value:?}"
        );
    }
    let accepts = [
        ("tenant", "North_shop-2.eu"),
        ("action_id", "refund:order-731/#2~"),
        ("tool", "billing.refund_v2"),
        ("call_id", "call 9f2 — é 😀"),
    ];
    for (field, value) in accepts {
        assert!(
            decode(refund_with(field, json!(value))).is_ok(),
            "{field} = {value:?}"
        );
    }
}

#[test]
fn checks_run_in_the_documented_order() {
    // Wrong type beats empty, empty beats too long, too long beats bad characters,
    // regardless of which field each problem is in.
    let body = json!({"tenant": "", "action_id": "a", "tool": 7, "arguments": {}});
    assert_eq!(decode(body).unwrap_err().code(), "wrong_type");
    let body = json!({"tenant": "a:b", "action_id": "a".repeat(MAX_KEY_LEN + 1),
                      "tool": "", "arguments": {}});
    assert_eq!(decode(body).unwrap_err().code(), "empty_field");
    let body = json!({"tenant": "a:b", "action_id": "a".repeat(MAX_KEY_LEN + 1),
                      "tool": "x", "arguments": {}});
    assert_eq!(decode(body).unwrap_err().code(), "too_long");
}

#[test]
fn messages_are_human_readable() {
    let err = DecodeError::TooLarge {
        size: 300_000,
        limit: 262_144,
    };
    assert_eq!(
        err.to_string(),
        "intent is 300000 bytes, over the 262144-byte limit"
    );
    assert_eq!(
        DecodeError::MissingField("tool").to_string(),
        "required field \"tool\" is missing"
    );
}

/// `<tenant>:<action_id>` is the AMQP `message_id`, a short string of at most 255 bytes, and
/// the downstream idempotency key: the pair is bounded, not only each field.
#[test]
fn the_action_key_fits_an_amqp_short_string() {
    let longest_tenant = "T".repeat(MAX_KEY_LEN);
    let fits = "b".repeat(protocol::MAX_ACTION_KEY_BYTES - MAX_KEY_LEN - 1);
    let mut body = refund_with("tenant", json!(longest_tenant));
    body["action_id"] = json!(fits);
    let intent = decode(body.clone()).expect("a 255-byte key is allowed");
    assert_eq!(
        protocol::action_key(&intent.tenant, &intent.action_id).len(),
        protocol::MAX_ACTION_KEY_BYTES
    );

    body["action_id"] = json!(format!("{fits}b"));
    let err = decode(body).unwrap_err();
    assert_eq!(
        err,
        DecodeError::KeyTooLong {
            len: protocol::MAX_ACTION_KEY_BYTES + 1,
            max: protocol::MAX_ACTION_KEY_BYTES
        }
    );
    assert_eq!(err.code(), "key_too_long");
    assert!(err.to_string().contains("256 bytes"), "{err}");

    // Each field alone within its limit, the pair far over: the probe's 200 + 200.
    let mut body = refund_with("tenant", json!("T".repeat(MAX_KEY_LEN)));
    body["action_id"] = json!("b".repeat(MAX_KEY_LEN));
    assert_eq!(decode(body).unwrap_err().code(), "key_too_long");
    assert!(protocol::check_action_key(&"T".repeat(200), &"b".repeat(200)).is_err());
    assert!(protocol::check_action_key("north-shop", "refund-204").is_ok());
}

/// A number is never silently changed: one that underflows a double to zero is refused like
/// one that overflows it, and an integer outside the 64-bit range is refused rather than
/// rounded.
#[test]
fn numbers_outside_the_double_and_integer_ranges_are_refused() {
    let with_n = |n: &str| {
        format!(
            r#"{{"tenant":"north-shop","action_id":"refund-204","tool":"refund","arguments":{{"n":{n}}}}}"#
        )
    };
    let underflow_spelled_out = format!("0.{}1", "0".repeat(400));
    for refused in [
        underflow_spelled_out.as_str(),
        "1e-400",
        "-1e-400",
        "1e400",
        "18446744073709551616",
        "-9223372036854775809",
        "123456789012345678901234567890",
    ] {
        let err = decode_intent(with_n(refused).as_bytes()).unwrap_err();
        assert_eq!(err.code(), "not_json", "{refused}: {err}");
    }
    let nested = r#"{"tenant":"north-shop","action_id":"refund-204","tool":"refund","arguments":{"a":[1,{"b":"1e-400 in a string is text","c":[2e-400]}]}}"#;
    let err = decode_intent(nested.as_bytes()).unwrap_err();
    assert!(err.to_string().contains("2e-400"), "{err}");

    for kept in [
        "0",
        "-0",
        "0.0",
        "0e-400",
        "-0.0e10",
        "5e-324",
        "2.2250738585072014e-308",
        "1.7976931348623157e308",
        "18446744073709551615",
        "-9223372036854775808",
        "4850",
        "48.50",
    ] {
        let intent = decode_intent(with_n(kept).as_bytes())
            .unwrap_or_else(|e| panic!("{kept} must be accepted: {e}"));
        assert!(intent.arguments["n"].is_number(), "{kept}");
    }
    // A non-zero value is never stored as zero.
    let tiny = decode_intent(with_n("5e-324").as_bytes()).unwrap();
    assert_ne!(tiny.arguments["n"].as_f64(), Some(0.0));
}

/// Postgres `jsonb` cannot hold U+0000, so a receipt echoing such an argument could never be
/// stored: the intent is refused at intake, naming the character and where it is.
#[test]
fn a_nul_character_in_the_arguments_is_refused_at_intake() {
    for (arguments, at) in [
        (json!({"s": "x\u{0}y"}), "arguments.s"),
        (json!({"a": [1, {"b\u{0}": 2}]}), "arguments.a[1]"),
        (json!({"a": {"b": ["ok", "\u{0}"]}}), "arguments.a.b[1]"),
    ] {
        let err = decode(refund_with("arguments", arguments.clone())).unwrap_err();
        assert_eq!(err.code(), "nul_character", "{arguments}");
        assert!(err.to_string().contains("U+0000"), "{err}");
        assert!(err.to_string().contains(at), "{err} should name {at}");
    }
    // The escaped text "\\u0000" (a backslash, then u0000) is an ordinary string.
    assert!(decode(refund_with("arguments", json!({"s": "\\u0000"}))).is_ok());
}
