//! The intent fingerprint (docs/design.md section 3): SHA-256 over the RFC 8785 (JCS)
//! canonical JSON of `{"arguments": …, "tool": …}`. Canonical form makes the fingerprint
//! a property of the request rather than of the agent's serializer: key order and
//! whitespace cannot change it, so a changed fingerprint under the same key really
//! means a different request (an `intent_conflict`).
//!
//! One deliberate departure from JCS: integers that fit `i64`/`u64` are written exactly
//! instead of being rounded through an IEEE double, so two amounts that differ beyond
//! 2^53 never share a fingerprint.

mod number;

use std::fmt::Write;

use serde_json::Value;
use sha2::{Digest, Sha256};

/// `v` as RFC 8785 canonical JSON: object keys sorted by UTF-16 code units, no
/// insignificant whitespace, JCS string escaping and ECMAScript number form.
pub fn canonical_json(v: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, v);
    out
}

/// Lowercase hex SHA-256 of the canonical JSON of `{"arguments": arguments, "tool": tool}`.
pub fn fingerprint(tool: &str, arguments: &Value) -> String {
    fingerprint_canonical(tool, &canonical_json(arguments))
}

/// [`fingerprint`] of arguments already written as [`canonical_json`]: the worker stores that
/// text as the request body, so the arguments are written once per intent, not twice.
pub fn fingerprint_canonical(tool: &str, canonical_arguments: &str) -> String {
    // The wrapper object is written around the text rather than built as a value (which would
    // clone the arguments); "arguments" sorts before "tool", as canonical order requires.
    let mut tool_json = String::with_capacity(tool.len() + 2);
    write_string(&mut tool_json, tool);
    let mut sha = Sha256::new();
    sha.update(b"{\"arguments\":");
    sha.update(canonical_arguments.as_bytes());
    sha.update(b",\"tool\":");
    sha.update(tool_json.as_bytes());
    sha.update(b"}");
    to_hex(&sha.finalize())
}

/// [`fingerprint_canonical`] of a compensation: the canonical JSON of
/// `{"arguments": ..., "compensates": original, "tool": tool}`, so the same key naming another
/// original is another intent.
pub fn fingerprint_canonical_compensating(
    tool: &str,
    canonical_arguments: &str,
    original: &str,
) -> String {
    let mut tool_json = String::with_capacity(tool.len() + 2);
    write_string(&mut tool_json, tool);
    let mut original_json = String::with_capacity(original.len() + 2);
    write_string(&mut original_json, original);
    let mut sha = Sha256::new();
    sha.update(b"{\"arguments\":");
    sha.update(canonical_arguments.as_bytes());
    sha.update(b",\"compensates\":");
    sha.update(original_json.as_bytes());
    sha.update(b",\"tool\":");
    sha.update(tool_json.as_bytes());
    sha.update(b"}");
    to_hex(&sha.finalize())
}

fn write_value(out: &mut String, v: &Value) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(n) => number::write_number(out, n),
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            // JCS orders by UTF-16 code units, which differs from UTF-8 byte order for
            // characters above U+FFFF against U+E000..=U+FFFF.
            entries.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
            out.push('{');
            for (i, (key, value)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(out, key);
                out.push(':');
                write_value(out, value);
            }
            out.push('}');
        }
    }
}

/// A JSON string with exactly the escapes JCS prescribes; everything else, including
/// non-ASCII and '/', is written literally.
fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c < '\u{20}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut hex = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        hex.push(DIGITS[usize::from(byte >> 4)] as char);
        hex.push(DIGITS[usize::from(byte & 0xf)] as char);
    }
    hex
}
