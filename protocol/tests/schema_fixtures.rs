//! The shared fixture set in docs/schema/fixtures (also read by the Python client's tests and
//! checked there against the JSON Schemas) against the Rust decoders: every accepted intent body
//! decodes, every rejected one fails with the annotated code and field, and every result event
//! fixture decodes or not as annotated. The Rust decoder is the authority; this keeps the
//! schema, the Python validator and the worker agreeing on one set of examples.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use protocol::{decode_intent, DecodeError, ResultEvent};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/schema/fixtures")
}

fn cases(kind: &str) -> Value {
    let path = fixtures().join(kind).join("cases.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// The body of one case: a file's exact bytes, or a generated body of an exact size.
fn body(kind: &str, case: &Value) -> Vec<u8> {
    if let Some(file) = case["file"].as_str() {
        return std::fs::read(fixtures().join(kind).join(file)).unwrap();
    }
    let g = &case["generated"];
    let (prefix, fill, suffix) = (
        g["prefix"].as_str().unwrap(),
        g["fill"].as_str().unwrap(),
        g["suffix"].as_str().unwrap(),
    );
    let total = g["bytes"].as_u64().unwrap() as usize;
    let n = (total - prefix.len() - suffix.len()) / fill.len();
    let body = format!("{prefix}{}{suffix}", fill.repeat(n)).into_bytes();
    assert_eq!(body.len(), total, "{}: generated size", case["name"]);
    body
}

fn named_field(e: &DecodeError) -> Option<String> {
    match e {
        DecodeError::DuplicateField(f) | DecodeError::UnknownField(f) => Some(f.clone()),
        DecodeError::MissingField(f) | DecodeError::EmptyField(f) => Some(f.to_string()),
        DecodeError::WrongType { field, .. }
        | DecodeError::TooLong { field, .. }
        | DecodeError::InvalidCharacters { field, .. } => Some(field.to_string()),
        DecodeError::TooLarge { .. }
        | DecodeError::NotJson(_)
        | DecodeError::NotAnObject
        | DecodeError::KeyTooLong { .. }
        | DecodeError::NulCharacter(_) => None,
    }
}

/// Every file in `dir` is named by exactly one case, so no fixture is silently unused.
fn assert_all_files_listed(kind: &str, dir: &str, listed: &[Value]) {
    let on_disk: BTreeSet<String> = std::fs::read_dir(fixtures().join(kind).join(dir))
        .unwrap()
        .map(|e| format!("{dir}/{}", e.unwrap().file_name().to_string_lossy()))
        .collect();
    let named: BTreeSet<String> = listed
        .iter()
        .filter_map(|c| c["file"].as_str().map(str::to_string))
        .collect();
    assert_eq!(
        on_disk, named,
        "{kind}/{dir}: files and cases.json disagree"
    );
}

#[test]
fn accepted_intents_decode() {
    let cases = cases("intent");
    let accepted = cases["accepted"].as_array().unwrap();
    assert!(accepted.len() >= 10);
    assert_all_files_listed("intent", "accepted", accepted);
    for case in accepted {
        let body = body("intent", case);
        let intent = decode_intent(&body)
            .unwrap_or_else(|e| panic!("{} must decode: {e} ({})", case["name"], e.code()));
        // What a client serializes from the decoded intent decodes to the same intent.
        assert_eq!(decode_intent(&intent.to_json()).unwrap(), intent);
    }
}

#[test]
fn rejected_intents_fail_with_the_annotated_code() {
    let cases = cases("intent");
    let rejected = cases["rejected"].as_array().unwrap();
    assert_all_files_listed("intent", "rejected", rejected);
    let mut codes = BTreeSet::new();
    for case in rejected {
        let name = &case["name"];
        let err = match decode_intent(&body("intent", case)) {
            Ok(intent) => panic!("{name} must be rejected, decoded to {intent:?}"),
            Err(e) => e,
        };
        assert_eq!(err.code(), case["code"].as_str().unwrap(), "{name}: {err}");
        assert_eq!(
            named_field(&err).as_deref(),
            case["field"].as_str(),
            "{name}: field of {err}"
        );
        let schema = case["schema"].as_str().unwrap();
        assert!(
            ["rejects", "not_expressible", "unparseable"].contains(&schema),
            "{name}: schema marker {schema}"
        );
        codes.insert(err.code());
    }
    // Every rule of the decoder has at least one fixture.
    assert_eq!(codes, DecodeError::CODES.into_iter().collect());
}

#[test]
fn result_event_fixtures_decode_as_annotated() {
    let cases = cases("result");
    let accepted = cases["accepted"].as_array().unwrap();
    let rejected = cases["rejected"].as_array().unwrap();
    assert_all_files_listed("result", "accepted", accepted);
    assert_all_files_listed("result", "rejected", rejected);
    for case in accepted {
        let body = body("result", case);
        let event: ResultEvent = serde_json::from_slice(&body)
            .unwrap_or_else(|e| panic!("{} must decode: {e}", case["name"]));
        assert_eq!(
            serde_json::to_value(&event).unwrap()["status"],
            serde_json::from_slice::<Value>(&body).unwrap()["status"]
        );
    }
    for case in rejected {
        let decoded = serde_json::from_slice::<ResultEvent>(&body("result", case));
        match case["rust_decoder"].as_str().unwrap() {
            "rejects" => assert!(decoded.is_err(), "{} must not decode", case["name"]),
            "accepts" => assert!(decoded.is_ok(), "{} must decode leniently", case["name"]),
            other => panic!("{}: rust_decoder marker {other}", case["name"]),
        }
    }
}

#[test]
fn fingerprint_vectors_match() {
    let cases = cases("fingerprint");
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let name = &case["name"];
        let arguments: Value = serde_json::from_str(case["arguments"].as_str().unwrap()).unwrap();
        let tool = case["tool"].as_str().unwrap();
        let wrapper = serde_json::json!({"arguments": arguments, "tool": tool});
        assert_eq!(
            protocol::canonical_json(&wrapper),
            case["canonical"].as_str().unwrap(),
            "{name}"
        );
        assert_eq!(
            protocol::fingerprint(tool, &arguments),
            case["fingerprint"].as_str().unwrap(),
            "{name}"
        );
    }
}
