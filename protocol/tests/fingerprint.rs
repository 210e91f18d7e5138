//! The intent fingerprint: equal for every spelling of the same `{tool, arguments}`,
//! different for any change in meaning, and pinned to a literal so an accidental change
//! to canonicalisation (which would turn every in-flight retry into an
//! `intent_conflict`) fails here first.

use protocol::{canonical_json, decode_intent, fingerprint};
use serde_json::{json, Value};

fn parse(text: &str) -> Value {
    serde_json::from_str(text).unwrap()
}

#[test]
fn design_example_fingerprint_is_pinned() {
    let arguments = json!({"order": "order-731", "amount_cents": 4850, "currency": "USD"});
    assert_eq!(
        fingerprint("refund", &arguments),
        "840002b2c80dba19dfe1fe1304e4f5172b66aab90a0ed95afcb441d3d83c6ff9"
    );
}

#[test]
fn equals_sha256_of_the_canonical_wrapper_object() {
    let arguments = json!({"b": [1, 2.5, "x"], "a": {"d": null, "c": true}});
    let wrapper = json!({"tool": "refund", "arguments": arguments.clone()});
    let canonical = canonical_json(&wrapper);
    assert_eq!(
        canonical,
        r#"{"arguments":{"a":{"c":true,"d":null},"b":[1,2.5,"x"]},"tool":"refund"}"#
    );
    // Same digest as the docs/design.md example when fed the same canonical text.
    let example = json!({"tool": "refund",
        "arguments": {"order": "order-731", "amount_cents": 4850, "currency": "USD"}});
    assert_eq!(
        canonical_json(&example),
        r#"{"arguments":{"amount_cents":4850,"currency":"USD","order":"order-731"},"tool":"refund"}"#
    );
    let fp = fingerprint("refund", &arguments);
    assert_eq!(fp.len(), 64);
    assert!(fp
        .bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
}

#[test]
fn key_order_and_whitespace_do_not_matter() {
    let a = parse(r#"{"order":"order-731","amount_cents":4850,"currency":"USD"}"#);
    let b =
        parse("{\n  \"currency\" : \"USD\",\n\t\"amount_cents\":4850 ,\"order\": \"order-731\"\n}");
    assert_eq!(fingerprint("refund", &a), fingerprint("refund", &b));

    let body_a = br#"{"tenant":"t","action_id":"a","tool":"refund","arguments":{"x":1,"y":2}}"#;
    let body_b = b"{ \"arguments\" : { \"y\" : 2 , \"x\" : 1 } , \"tool\" : \"refund\",\n \"action_id\":\"a\",\"tenant\":\"t\" }";
    assert_eq!(
        decode_intent(body_a).unwrap().fingerprint(),
        decode_intent(body_b).unwrap().fingerprint()
    );
}

#[test]
fn nested_objects_are_canonical_but_array_order_matters() {
    let a = parse(
        r#"{"lines":[{"sku":"a","qty":1},{"sku":"b","qty":2}],"meta":{"z":1,"y":{"k":2,"j":3}}}"#,
    );
    let b = parse(
        r#"{"meta":{"y":{"j":3,"k":2},"z":1},"lines":[{"qty":1,"sku":"a"},{"qty":2,"sku":"b"}]}"#,
    );
    let swapped = parse(
        r#"{"meta":{"y":{"j":3,"k":2},"z":1},"lines":[{"qty":2,"sku":"b"},{"qty":1,"sku":"a"}]}"#,
    );
    assert_eq!(fingerprint("ship", &a), fingerprint("ship", &b));
    assert_ne!(fingerprint("ship", &a), fingerprint("ship", &swapped));
}

#[test]
fn number_spellings_of_the_same_value_are_equal() {
    let fps: Vec<String> = ["4850", "4850.0", "4.85e3", "485e1", "48500e-1"]
        .iter()
        .map(|n| fingerprint("refund", &parse(&format!(r#"{{"amount_cents":{n}}}"#))))
        .collect();
    assert!(fps.windows(2).all(|w| w[0] == w[1]), "{fps:?}");
}

#[test]
fn a_number_and_its_string_differ() {
    assert_ne!(
        fingerprint("refund", &json!({"amount_cents": 1})),
        fingerprint("refund", &json!({"amount_cents": "1"}))
    );
}

#[test]
fn a_different_tool_or_value_differs() {
    let arguments = json!({"order": "order-731", "amount_cents": 4850});
    assert_ne!(
        fingerprint("refund", &arguments),
        fingerprint("charge", &arguments)
    );
    assert_ne!(
        fingerprint("refund", &arguments),
        fingerprint(
            "refund",
            &json!({"order": "order-731", "amount_cents": 4851})
        )
    );
}

#[test]
fn a_compensation_fingerprints_the_original_it_names_with_its_arguments() {
    use sha2::{Digest, Sha256};
    let body = br#"{"tenant":"t","action_id":"undo-1","tool":"refund_reversal",
        "arguments":{"refund_id":"r-9\"}"},"compensates":"refund-1"}"#;
    let intent = decode_intent(body).unwrap();
    assert_eq!(intent.compensates.as_deref(), Some("refund-1"));
    let wrapper = json!({"tool": "refund_reversal", "compensates": "refund-1",
        "arguments": {"refund_id": "r-9\"}"}});
    let digest = Sha256::digest(canonical_json(&wrapper).as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(intent.fingerprint(), hex);
    assert_eq!(intent.canonical_arguments_and_fingerprint().1, hex);
    // Another original, or none, is another intent.
    let other = protocol::Intent {
        compensates: Some("refund-2".into()),
        ..intent.clone()
    };
    assert_ne!(other.fingerprint(), hex);
    let plain = protocol::Intent {
        compensates: None,
        ..intent
    };
    assert_eq!(
        plain.fingerprint(),
        fingerprint("refund_reversal", &plain.arguments)
    );
}
