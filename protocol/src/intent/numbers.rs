//! Numbers whose value a double or a 64-bit integer cannot hold. serde_json turns a decimal
//! below the double range (`1e-400`) into `0.0` and an integer beyond `u64` into the nearest
//! double, silently: the worker would then store and dispatch another value than the agent
//! sent. Decimals are read as IEEE 754 doubles, the nearest one (I-JSON, RFC 7493), so only a
//! value outside the range changes; that, and an integer that would be rounded, is refused.

use crate::DecodeError;

/// Longest number literal echoed in an error (a 100 KB run of zeros must not travel in a
/// result).
const MAX_ECHOED_LITERAL: usize = 40;

/// Scans the number literals of a body that already parsed as JSON (so its syntax is valid)
/// and reports the first one outside the range.
pub(crate) fn check_range(body: &[u8]) -> Result<(), DecodeError> {
    let mut first = None;
    for_each_number(body, |literal, _| {
        if first.is_none() {
            first = out_of_range(literal).map(|why| {
                DecodeError::NotJson(format!(
                    "number {} {why}; send it as a string",
                    super::top_level::shortened(literal, MAX_ECHOED_LITERAL)
                ))
            });
        }
    });
    first.map_or(Ok(()), Err)
}

/// `body` with every number literal outside strings replaced by `0`, so a body that serde
/// refuses only for a number beyond the double range (`1e400`) still parses for
/// [`crate::salvage_key`]: its rejection can then be addressed like any other.
pub(crate) fn neutralized(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len());
    let mut copied = 0;
    for_each_number(body, |_, range| {
        out.extend_from_slice(&body[copied..range.start]);
        out.push(b'0');
        copied = range.end;
    });
    out.extend_from_slice(&body[copied..]);
    out
}

/// Calls `f` with each number token outside strings and its byte range.
fn for_each_number(body: &[u8], mut f: impl FnMut(&str, std::ops::Range<usize>)) {
    let mut i = 0;
    while i < body.len() {
        match body[i] {
            b'"' => i = skip_string(body, i + 1),
            b'-' | b'0'..=b'9' => {
                let end = body[i..]
                    .iter()
                    .position(|b| !matches!(b, b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'))
                    .map_or(body.len(), |n| i + n);
                // Number tokens are ASCII; in a body that is not JSON this may be garbage,
                // which the caller's parse then refuses.
                let literal = std::str::from_utf8(&body[i..end]).unwrap_or_default();
                f(literal, i..end);
                i = end;
            }
            _ => i += 1,
        }
    }
}

/// The index just past the closing quote of a string whose content starts at `i`.
fn skip_string(body: &[u8], mut i: usize) -> usize {
    while i < body.len() {
        match body[i] {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    i
}

fn out_of_range(literal: &str) -> Option<&'static str> {
    let is_integer = !literal.contains(['.', 'e', 'E']);
    if is_integer {
        if literal.parse::<i64>().is_ok() || literal.parse::<u64>().is_ok() {
            return None;
        }
        return Some("is outside the 64-bit integer range (-2^63 to 2^64-1) and would be rounded");
    }
    let value: f64 = literal.parse().ok()?;
    if value.is_infinite() {
        return Some("is beyond the range of a double");
    }
    let mantissa = literal.split(['e', 'E']).next().unwrap_or(literal);
    if value == 0.0 && mantissa.bytes().any(|b| matches!(b, b'1'..=b'9')) {
        return Some("is too small for a double and would become 0");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::check_range;

    #[test]
    fn neutralized_replaces_numbers_only() {
        assert_eq!(
            super::neutralized(br#"{"a":1e400,"b":"1e400","c":[-2.5e-3]}"#),
            br#"{"a":0,"b":"1e400","c":[0]}"#
        );
    }

    #[test]
    fn numbers_inside_strings_and_keys_are_text() {
        assert!(check_range(br#"{"1e-400":"2e-400 \" 3e-400"}"#).is_ok());
        assert!(check_range(br#"{"a":"\\","b":1e-400}"#).is_err());
    }
}
