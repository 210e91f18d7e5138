//! Property tests for strict decoding: whatever bytes or JSON an agent, a broken
//! serializer or an attacker sends, `decode_intent` and `salvage_key` never panic; a refusal
//! is one specific `DecodeError` with a stable code; every valid intent (ids with braces,
//! quotes and every visible ASCII character, arguments with unicode and huge numbers)
//! survives its own encoding and a re-spelling with other field order and whitespace.

use proptest::prelude::*;
use protocol::{decode_intent, salvage_key, DecodeError, Intent, MAX_INTENT_BYTES};
use serde_json::{json, Map, Value};

const CODES: [&str; 12] = DecodeError::CODES;

/// A refusal must be specific: a known code and a sentence saying what to fix.
fn assert_specific(e: &DecodeError) -> Result<(), TestCaseError> {
    prop_assert!(CODES.contains(&e.code()), "unknown code {}", e.code());
    prop_assert!(!e.to_string().is_empty());
    Ok(())
}

/// Any JSON value, with keys and strings that include the contract's field names, braces,
/// quotes, escapes and non-BMP characters, and numbers of every spelling serde can hold.
fn any_json() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        Just("tenant".to_string()),
        Just("action_id".to_string()),
        Just("tool".to_string()),
        Just("arguments".to_string()),
        Just("call_id".to_string()),
        Just("reply_to".to_string()),
        "[a-z_{}\"\\\\]{0,8}",
        "\\PC{0,6}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        "\\PC{0,12}".prop_map(Value::String),
        "[ -~]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((key.clone(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn name() -> impl Strategy<Value = String> {
    "[A-Za-z0-9._-]{1,40}"
}

/// Every action id the contract allows leans on the characters that broke templates.
fn action_id() -> impl Strategy<Value = String> {
    prop_oneof![
        "[!-~]{1,60}",
        "[{}\"'\\\\:%/?#&a-z]{1,30}",
        Just("brace{tool}-1".to_string()),
        Just("{tenant}:{action_id}{key}".to_string()),
        "[!-~]{200}",
    ]
}

fn arguments() -> impl Strategy<Value = Value> {
    prop::collection::btree_map("\\PC{0,10}", any_json(), 0..5).prop_map(|m| {
        let mut m: Map<String, Value> = m.into_iter().collect();
        m.insert("huge".into(), json!(u64::MAX));
        m.insert(
            "braces".into(),
            json!("{tenant}:{action_id} \"quoted\" 東京 🚀"),
        );
        Value::Object(m)
    })
}

fn valid_intent() -> impl Strategy<Value = Intent> {
    (
        name(),
        action_id(),
        name(),
        arguments(),
        prop::option::of("[^\\p{Cc}]{1,40}"),
        prop::option::of(name()),
    )
        .prop_map(
            |(tenant, action_id, tool, arguments, call_id, reply_to)| Intent {
                tenant,
                action_id,
                tool,
                arguments,
                call_id,
                reply_to,
                compensates: None,
            },
        )
}

/// The intent's body with its fields in the given order and whitespace around every token
/// the top level has.
fn respell(intent: &Intent, order: &[usize], ws: &str) -> String {
    let s = |v: &str| serde_json::to_string(v).unwrap();
    let mut fields = vec![
        format!("{ws}\"tenant\"{ws}:{ws}{}", s(&intent.tenant)),
        format!("{ws}\"action_id\"{ws}:{ws}{}", s(&intent.action_id)),
        format!("{ws}\"tool\"{ws}:{ws}{}", s(&intent.tool)),
        format!(
            "{ws}\"arguments\"{ws}:{ws}{}",
            serde_json::to_string_pretty(&intent.arguments).unwrap()
        ),
    ];
    if let Some(c) = &intent.call_id {
        fields.push(format!("{ws}\"call_id\":{}", s(c)));
    }
    if let Some(r) = &intent.reply_to {
        fields.push(format!("\"reply_to\"{ws}:{}", s(r)));
    }
    let mut ordered: Vec<String> = Vec::new();
    for &i in order {
        if i < fields.len() && !ordered.contains(&fields[i]) {
            ordered.push(fields[i].clone());
        }
    }
    for f in fields {
        if !ordered.contains(&f) {
            ordered.push(f);
        }
    }
    format!("{ws}{{{}}}{ws}", ordered.join(","))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..512)) {
        if let Err(e) = decode_intent(&body) {
            assert_specific(&e)?;
        }
        let _ = salvage_key(&body);
    }

    #[test]
    fn arbitrary_json_never_panics_and_valid_results_round_trip(v in any_json()) {
        let body = serde_json::to_vec(&v).unwrap();
        match decode_intent(&body) {
            Ok(intent) => {
                prop_assert_eq!(decode_intent(&intent.to_json()).unwrap(), intent.clone());
                prop_assert_eq!(
                    salvage_key(&body),
                    Some((intent.tenant.clone(), intent.action_id.clone()))
                );
            }
            Err(e) => assert_specific(&e)?,
        }
        let _ = salvage_key(&body);
    }

    /// Objects shaped like intents, with each field drawn from valid and invalid values, so
    /// every rule is reached, not only `not_an_object`.
    #[test]
    fn near_intents_are_refused_with_a_specific_error(
        tenant in prop::option::of(any_json()),
        action_id in prop::option::of(prop_oneof![action_id().prop_map(Value::String), any_json()]),
        tool in prop::option::of(prop_oneof![name().prop_map(Value::String), any_json()]),
        arguments in prop::option::of(any_json()),
        extra in prop::option::of(("[a-z_-]{1,10}", any_json())),
    ) {
        let mut m = Map::new();
        for (k, v) in [("tenant", tenant), ("action_id", action_id), ("tool", tool),
                       ("arguments", arguments)] {
            if let Some(v) = v {
                m.insert(k.to_string(), v);
            }
        }
        if let Some((k, v)) = extra {
            m.insert(k, v);
        }
        let body = serde_json::to_vec(&Value::Object(m)).unwrap();
        if let Err(e) = decode_intent(&body) {
            assert_specific(&e)?;
        }
    }

    #[test]
    fn valid_intents_decode_from_any_spelling(
        intent in valid_intent(),
        order in prop::collection::vec(0usize..6, 0..6),
        ws in prop_oneof![Just(""), Just(" "), Just("\n\t "), Just("\r\n")],
    ) {
        let body = intent.to_json();
        prop_assume!(body.len() <= MAX_INTENT_BYTES);
        let decoded = decode_intent(&body).unwrap();
        prop_assert_eq!(&decoded, &intent);
        let respelled = respell(&intent, &order, ws);
        let again = decode_intent(respelled.as_bytes()).unwrap();
        prop_assert_eq!(again.fingerprint(), intent.fingerprint());
        prop_assert_eq!(&again.tenant, &intent.tenant);
        prop_assert_eq!(&again.action_id, &intent.action_id);
        prop_assert_eq!(
            salvage_key(respelled.as_bytes()),
            Some((intent.tenant.clone(), intent.action_id.clone()))
        );
    }

    /// Truncating a valid body anywhere never panics and is refused as `not_json` (a prefix
    /// of an object is never a complete JSON value).
    #[test]
    fn truncated_bodies_are_not_json(intent in valid_intent(), cut in 0.0f64..1.0) {
        let body = intent.to_json();
        let at = ((body.len() as f64) * cut) as usize;
        prop_assume!(at < body.len());
        let e = decode_intent(&body[..at]).unwrap_err();
        prop_assert_eq!(e.code(), "not_json", "{}", e);
    }
}
