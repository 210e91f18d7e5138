//! W3C Trace Context (<https://www.w3.org/TR/trace-context/>) as it travels with intents and
//! result events: the `traceparent` and `tracestate` AMQP headers (the same names an HTTP request
//! uses, and the ones OpenTelemetry's messaging instrumentations read and write).
//!
//! The context is optional and advisory: a header that breaks the format is ignored (the caller
//! counts it), never a reason to refuse an intent. Parsing follows the specification's rules
//! for a receiver: lowercase hex only, an all-zero trace id or parent id is invalid, version
//! `ff` is invalid, version `00` is exactly 55 characters, and a later version may carry more
//! fields after the flags, which are ignored. `tracestate` is passed on as received when it
//! looks like a list of `key=value` members within the specification's 512 characters;
//! otherwise it is dropped and the `traceparent` kept.

use std::fmt;

/// AMQP header (and HTTP header) carrying the trace parent.
pub const TRACEPARENT: &str = "traceparent";
/// AMQP header (and HTTP header) carrying vendor trace state.
pub const TRACESTATE: &str = "tracestate";
/// Longest `tracestate` kept (the specification's limit for a propagated value).
pub const MAX_TRACESTATE_LEN: usize = 512;

/// A parsed `traceparent`: which trace, which span is the parent, and whether it was sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub parent_id: [u8; 8],
    /// Trace flags; bit 0 is `sampled`.
    pub flags: u8,
}

/// Why a `traceparent` was ignored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceParentError {
    #[error("traceparent is not of the form version-traceid-parentid-flags")]
    Shape,
    #[error("traceparent has a field that is not lowercase hex of the right length")]
    Hex,
    #[error("traceparent version ff is invalid")]
    Version,
    #[error("traceparent has an all-zero trace id or parent id")]
    Zero,
}

impl TraceParent {
    /// Parses a `traceparent` header value.
    pub fn parse(value: &str) -> Result<TraceParent, TraceParentError> {
        let value = value.trim_matches(|c| c == ' ' || c == '\t');
        let mut parts = value.split('-');
        let (Some(version), Some(trace), Some(parent), Some(flags)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(TraceParentError::Shape);
        };
        let version = hex_byte(version)?;
        if version == 0xff {
            return Err(TraceParentError::Version);
        }
        // Version 00 has exactly four fields; a later one may append more.
        if version == 0 && parts.next().is_some() {
            return Err(TraceParentError::Shape);
        }
        let trace_id: [u8; 16] = hex_array(trace)?;
        let parent_id: [u8; 8] = hex_array(parent)?;
        let flags = hex_byte(flags)?;
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return Err(TraceParentError::Zero);
        }
        Ok(TraceParent {
            trace_id,
            parent_id,
            // A receiver of a later version keeps only the flags it knows.
            flags: if version == 0 { flags } else { flags & 1 },
        })
    }

    /// Whether the sender recorded (sampled) the parent span.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The trace id as 32 lowercase hex characters.
    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }

    /// The parent span id as 16 lowercase hex characters.
    pub fn parent_id_hex(&self) -> String {
        hex(&self.parent_id)
    }
}

impl fmt::Display for TraceParent {
    /// Always written as version `00`, the only version this code emits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            hex(&self.trace_id),
            hex(&self.parent_id),
            self.flags
        )
    }
}

impl std::str::FromStr for TraceParent {
    type Err = TraceParentError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TraceParent::parse(s)
    }
}

/// A trace context as carried by a message: the parent and the vendor state that goes with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    pub parent: TraceParent,
    /// Passed on unchanged; `None` when absent or dropped as malformed.
    pub state: Option<String>,
}

/// What reading the two headers found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Incoming {
    /// No `traceparent` header.
    Absent,
    /// A usable context. `state_dropped` says a `tracestate` was present but malformed.
    Context {
        context: TraceContext,
        state_dropped: bool,
    },
    /// A `traceparent` that breaks the format (also: not a string): ignored.
    Malformed(TraceParentError),
}

impl TraceContext {
    /// Reads the header values as a receiver must: a malformed `traceparent` makes the whole
    /// context absent; a malformed `tracestate` is dropped alone.
    pub fn read(traceparent: Option<&str>, tracestate: Option<&str>) -> Incoming {
        let Some(tp) = traceparent else {
            return Incoming::Absent;
        };
        match TraceParent::parse(tp) {
            Err(e) => Incoming::Malformed(e),
            Ok(parent) => {
                let (state, state_dropped) = match tracestate.map(str::trim) {
                    None | Some("") => (None, false),
                    Some(s) if tracestate_ok(s) => (Some(s.to_string()), false),
                    Some(_) => (None, true),
                };
                Incoming::Context {
                    context: TraceContext { parent, state },
                    state_dropped,
                }
            }
        }
    }

    /// A context with this parent and no vendor state.
    pub fn new(parent: TraceParent) -> TraceContext {
        TraceContext {
            parent,
            state: None,
        }
    }

    /// The `traceparent` header value.
    pub fn traceparent(&self) -> String {
        self.parent.to_string()
    }
}

/// A plausible `tracestate`: at most 512 characters, at most 32 comma-separated members, each
/// `key=value` with printable ASCII (no `,` or `=` in the value), empty members allowed.
pub fn tracestate_ok(s: &str) -> bool {
    if s.len() > MAX_TRACESTATE_LEN || !s.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return false;
    }
    let mut members = 0;
    for member in s.split(',') {
        let member = member.trim_matches(|c| c == ' ' || c == '\t');
        if member.is_empty() {
            continue;
        }
        members += 1;
        let Some((key, value)) = member.split_once('=') else {
            return false;
        };
        let key_ok = !key.is_empty()
            && key.len() <= 256
            && key.bytes().all(|b| {
                b.is_ascii_lowercase()
                    || b.is_ascii_digit()
                    || matches!(b, b'_' | b'-' | b'*' | b'/' | b'@')
            });
        let value_ok = !value.is_empty()
            && value.len() <= 256
            && !value.contains('=')
            && !value.ends_with(' ');
        if !key_ok || !value_ok {
            return false;
        }
    }
    members <= 32
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

fn hex_byte(s: &str) -> Result<u8, TraceParentError> {
    let [a] = hex_array::<1>(s)?;
    Ok(a)
}

fn hex_array<const N: usize>(s: &str) -> Result<[u8; N], TraceParentError> {
    let bytes = s.as_bytes();
    if bytes.len() != 2 * N {
        return Err(TraceParentError::Hex);
    }
    let mut out = [0u8; N];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        let (Some(hi), Some(lo)) = (hex_value(pair[0]), hex_value(pair[1])) else {
            return Err(TraceParentError::Hex);
        };
        out[i] = hi << 4 | lo;
    }
    Ok(out)
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn the_specification_example_round_trips() {
        let tp = TraceParent::parse(GOOD).unwrap();
        assert_eq!(tp.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(tp.parent_id_hex(), "00f067aa0ba902b7");
        assert!(tp.sampled());
        assert_eq!(tp.to_string(), GOOD);
        let unsampled = GOOD.replace("-01", "-00");
        assert!(!TraceParent::parse(&unsampled).unwrap().sampled());
    }

    #[test]
    fn malformed_values_are_refused_with_their_reason() {
        let cases: &[(&str, TraceParentError)] = &[
            ("", TraceParentError::Shape),
            ("garbage", TraceParentError::Shape),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
                TraceParentError::Shape,
            ),
            (&format!("{GOOD}-extra"), TraceParentError::Shape),
            (&GOOD.to_uppercase(), TraceParentError::Hex),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
                TraceParentError::Hex,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-701",
                TraceParentError::Hex,
            ),
            (
                "0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                TraceParentError::Hex,
            ),
            (
                "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                TraceParentError::Version,
            ),
            (
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                TraceParentError::Zero,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                TraceParentError::Zero,
            ),
            ("00-{\"}-\u{1b}[31m-01", TraceParentError::Hex),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",
                TraceParentError::Hex,
            ),
        ];
        for (value, want) in cases {
            assert_eq!(TraceParent::parse(value).as_ref(), Err(want), "{value:?}");
        }
    }

    #[test]
    fn a_later_version_keeps_the_known_fields_only() {
        let v = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09-what-the-future-holds";
        let tp = TraceParent::parse(v).unwrap();
        assert_eq!(tp.flags, 1);
        assert_eq!(tp.to_string(), GOOD);
    }

    #[test]
    fn a_bad_tracestate_is_dropped_and_the_parent_kept() {
        match TraceContext::read(Some(GOOD), Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")) {
            Incoming::Context {
                context,
                state_dropped: false,
            } => assert_eq!(
                context.state.as_deref(),
                Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")
            ),
            other => panic!("{other:?}"),
        }
        for bad in [
            "no-equals",
            "Upper=1",
            &"a=b,".repeat(40),
            "k=\u{7f}",
            &"k=".repeat(300),
        ] {
            match TraceContext::read(Some(GOOD), Some(bad)) {
                Incoming::Context {
                    context,
                    state_dropped: true,
                } => assert_eq!(context.state, None),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        assert_eq!(TraceContext::read(None, Some("a=b")), Incoming::Absent);
        assert!(matches!(
            TraceContext::read(Some("nope"), None),
            Incoming::Malformed(TraceParentError::Shape)
        ));
    }
}
