//! A JSON document a downstream sent (a receipt, a final status document, an acceptance), kept
//! exactly as it was sent: its text is what the ledger stores (a Postgres `json` column, which
//! keeps its input verbatim) and what the status API returns, byte for byte; its parsed value is
//! what the worker checks, compares and tells the agent.
//!
//! Why not `jsonb` alone: `jsonb` re-encodes a document (member order, spacing, number
//! spelling) and refuses one holding U+0000, which JSON allows. A downstream's proof is stored
//! as it came, whatever it holds. The whitespace around the document (a trailing newline) is
//! not part of it.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::Value;
use sqlx::postgres::{PgTypeInfo, PgValueRef};
use sqlx::types::Json;
use sqlx::Postgres;

/// A downstream's JSON document: the exact text and its value. Two documents are equal when
/// their values are (a late copy of a receipt re-spaced by a proxy is the same receipt).
#[derive(Debug, Clone)]
pub struct Document {
    text: Box<RawValue>,
    value: Value,
}

impl Document {
    /// The document in `bytes`, kept as sent (without the whitespace around it).
    pub fn parse(bytes: &[u8]) -> Result<Document, serde_json::Error> {
        let text: Box<RawValue> = serde_json::from_slice(bytes)?;
        Document::from_raw(text)
    }

    fn from_raw(text: Box<RawValue>) -> Result<Document, serde_json::Error> {
        let value = serde_json::from_str(text.get())?;
        Ok(Document { text, value })
    }

    /// A document the worker holds only as a value (an operator's receipt given as part of a
    /// larger request): its text is the value's serialisation.
    pub fn from_value(value: Value) -> Document {
        let text =
            serde_json::value::to_raw_value(&value).expect("a serde_json::Value always serialises");
        Document { text, value }
    }

    /// The exact text, as stored and returned (bind it as `$n::json`).
    pub fn text(&self) -> &str {
        self.text.get()
    }

    /// The parsed value.
    pub fn value(&self) -> &Value {
        &self.value
    }
}

impl PartialEq for Document {
    fn eq(&self, other: &Document) -> bool {
        self.value == other.value
    }
}

/// Serialised as the exact text (the status API returns the bytes the downstream sent).
impl Serialize for Document {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.text.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Document {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Document, D::Error> {
        let text = Box::<RawValue>::deserialize(deserializer)?;
        Document::from_raw(text).map_err(serde::de::Error::custom)
    }
}

/// Read from a `json` column (exact text) or a `jsonb` one (Postgres's re-encoding).
impl sqlx::Type<Postgres> for Document {
    fn type_info() -> PgTypeInfo {
        <Json<Box<RawValue>> as sqlx::Type<Postgres>>::type_info()
    }

    fn compatible(ty: &PgTypeInfo) -> bool {
        <Json<Box<RawValue>> as sqlx::Type<Postgres>>::compatible(ty)
    }
}

impl<'r> sqlx::Decode<'r, Postgres> for Document {
    fn decode(value: PgValueRef<'r>) -> Result<Document, sqlx::error::BoxDynError> {
        let Json(text) = <Json<Box<RawValue>> as sqlx::Decode<'r, Postgres>>::decode(value)?;
        Ok(Document::from_raw(text)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_text_and_a_nul_and_compares_by_value() {
        let sent = "{\"b\" : 1,\"a\":\"x\\u0000y\", \"n\": 1.0e3}\n";
        let d = Document::parse(sent.as_bytes()).unwrap();
        assert_eq!(d.text(), sent.trim_end());
        assert_eq!(d.value()["a"], "x\u{0}y");
        assert_eq!(serde_json::to_string(&d).unwrap(), sent.trim_end());
        let respaced = Document::parse(br#"{"a":"x\u0000y","b":1,"n":1000.0}"#).unwrap();
        assert_eq!(d, respaced);
        let back: Document = serde_json::from_str(d.text()).unwrap();
        assert_eq!(back.text(), d.text());
        assert!(Document::parse(b"{\"a\":").is_err());
        assert_eq!(
            Document::from_value(serde_json::json!({"a": 1})).text(),
            r#"{"a":1}"#
        );
    }
}
