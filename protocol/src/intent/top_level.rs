//! Reads the top level of a body as an ordered list of `(key, value)` entries, keeping
//! repeated keys visible. serde_json's own `Value` silently keeps the last of a repeated
//! key, so `{"tenant":"a",…,"tenant":"b"}` could mean one tenant to us and another to a
//! first-wins reader upstream; seeing every entry lets the decoder refuse it instead.

use std::collections::HashSet;
use std::fmt;

use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use crate::DecodeError;

/// Longest field name echoed back in an error; the name comes from an untrusted body
/// and ends up in a result message, so a 200 KB key must not travel with it.
const MAX_ECHOED_NAME: usize = 64;

/// The top-level entries of a JSON object body, in document order, duplicates kept.
pub(crate) type Entries = Vec<(String, Value)>;

/// Parses `body` as JSON whose top level must be an object.
///
/// Syntax errors anywhere in the body win over [`DecodeError::NotAnObject`], because
/// the whole document is parsed before its shape is judged.
pub(crate) fn parse(body: &[u8]) -> Result<Entries, DecodeError> {
    match serde_json::from_slice::<TopLevel>(body) {
        Ok(TopLevel::Object(entries)) => Ok(entries),
        Ok(TopLevel::Other) => Err(DecodeError::NotAnObject),
        Err(e) => Err(DecodeError::NotJson(e.to_string())),
    }
}

/// The first key (in document order) that repeats an earlier one.
pub(crate) fn first_duplicate(entries: &Entries) -> Option<&str> {
    // An intent has about ten top-level keys: comparing them pairwise is cheaper than hashing
    // each. A hostile body with many keys still gets a set.
    if entries.len() <= 16 {
        return entries
            .iter()
            .enumerate()
            .find(|(i, (key, _))| entries[..*i].iter().any(|(k, _)| k == key))
            .map(|(_, (key, _))| key.as_str());
    }
    let mut seen = HashSet::with_capacity(entries.len());
    entries
        .iter()
        .map(|(key, _)| key.as_str())
        .find(|key| !seen.insert(*key))
}

/// A field name from the body, shortened to something safe to put in a message.
pub(crate) fn echo_name(name: &str) -> String {
    shortened(name, MAX_ECHOED_NAME)
}

/// Text from an untrusted body cut to `max` characters (with `…`), so what is echoed in an
/// error and a result message stays small.
pub(crate) fn shortened(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

/// What the top level turned out to be. Non-objects are a value, not a serde error, so
/// that "valid JSON of the wrong shape" stays distinguishable from "not JSON".
enum TopLevel {
    Object(Entries),
    Other,
}

impl<'de> Deserialize<'de> for TopLevel {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(TopLevelVisitor)
    }
}

struct TopLevelVisitor;

impl<'de> Visitor<'de> for TopLevelVisitor {
    type Value = TopLevel;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TopLevel, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value::<Value>()?;
            entries.push((key, value));
        }
        Ok(TopLevel::Object(entries))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TopLevel, A::Error> {
        // Drain the array so a syntax error inside it still reports as not-JSON.
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(TopLevel::Other)
    }

    fn visit_bool<E>(self, _: bool) -> Result<TopLevel, E> {
        Ok(TopLevel::Other)
    }

    fn visit_i64<E>(self, _: i64) -> Result<TopLevel, E> {
        Ok(TopLevel::Other)
    }

    fn visit_u64<E>(self, _: u64) -> Result<TopLevel, E> {
        Ok(TopLevel::Other)
    }

    fn visit_f64<E>(self, _: f64) -> Result<TopLevel, E> {
        Ok(TopLevel::Other)
    }

    fn visit_str<E>(self, _: &str) -> Result<TopLevel, E> {
        Ok(TopLevel::Other)
    }

    fn visit_unit<E>(self) -> Result<TopLevel, E> {
        Ok(TopLevel::Other)
    }

    fn visit_none<E>(self) -> Result<TopLevel, E> {
        Ok(TopLevel::Other)
    }
}
