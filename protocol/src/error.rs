//! Why a message body is not a valid intent. Each rule of the strict decoder has its own
//! variant so the worker can tell the agent exactly what to fix, and each variant has a
//! stable snake_case [`DecodeError::code`] for machines (the `detail` of a `rejected`
//! result, metric labels) that does not change when the human wording does.

use thiserror::Error;

/// A rule of the intent wire contract that a body broke, in the order the decoder
/// checks them.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum DecodeError {
    /// The body is over [`crate::MAX_INTENT_BYTES`]; checked before parsing so an
    /// oversized body costs no parsing work.
    #[error("intent is {size} bytes, over the {limit}-byte limit")]
    TooLarge {
        /// Size of the body in bytes.
        size: usize,
        /// The limit it exceeded.
        limit: usize,
    },
    /// The body is not UTF-8 JSON; carries serde_json's message with line and column.
    #[error("intent is not valid JSON: {0}")]
    NotJson(String),
    /// The body is JSON but its top level is not an object.
    #[error("intent must be a JSON object")]
    NotAnObject,
    /// A top-level field appears more than once, which readers would resolve
    /// differently (first wins or last wins), so it is refused.
    #[error("field {0:?} appears more than once")]
    DuplicateField(String),
    /// A top-level field outside the contract; refused rather than ignored so a typo
    /// (say `action-id`) cannot silently drop meaning.
    #[error(
        "unknown field {0:?}; allowed fields are tenant, action_id, tool, arguments, call_id, reply_to and compensates"
    )]
    UnknownField(String),
    /// A required field is absent.
    #[error("required field {0:?} is missing")]
    MissingField(&'static str),
    /// A field holds the wrong JSON type.
    #[error("field {field:?} must be {expected}")]
    WrongType {
        /// The field.
        field: &'static str,
        /// What it must be, e.g. "a string".
        expected: &'static str,
    },
    /// A string field is empty.
    #[error("field {0:?} must not be empty")]
    EmptyField(&'static str),
    /// A string field is over its length limit (counted in characters).
    #[error("field {field:?} is {len} characters long, over the {max}-character limit")]
    TooLong {
        /// The field.
        field: &'static str,
        /// Its length in characters.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A string field contains a character outside its allowed set.
    #[error("field {field:?} may contain only {allowed}")]
    InvalidCharacters {
        /// The field.
        field: &'static str,
        /// The allowed set, in words.
        allowed: &'static str,
    },
    /// `tenant` and `action_id` are each within their limits, but `<tenant>:<action_id>`, the
    /// AMQP `message_id` and the downstream idempotency key, is over
    /// [`crate::MAX_ACTION_KEY_BYTES`].
    #[error(
        "tenant and action_id make an action key (\"<tenant>:<action_id>\") of {len} bytes, over the {max}-byte limit of an AMQP message id"
    )]
    KeyTooLong {
        /// The key's length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A string or key in `arguments` contains U+0000 (NUL), which a downstream keeping JSON in
    /// Postgres `jsonb` cannot store; carries the path of the first one, e.g. `arguments.note`.
    #[error(
        "{0} contains U+0000 (NUL), which a downstream keeping JSON in Postgres jsonb cannot store; remove it or encode the value (e.g. base64)"
    )]
    NulCharacter(String),
}

impl DecodeError {
    /// Every [`DecodeError::code`], in the order the decoder checks the rules.
    pub const CODES: [&'static str; 12] = [
        "too_large",
        "not_json",
        "not_an_object",
        "duplicate_field",
        "unknown_field",
        "missing_field",
        "wrong_type",
        "empty_field",
        "too_long",
        "invalid_characters",
        "key_too_long",
        "nul_character",
    ];

    /// A stable snake_case code for this kind of error, one per variant.
    pub fn code(&self) -> &'static str {
        match self {
            DecodeError::TooLarge { .. } => "too_large",
            DecodeError::NotJson(_) => "not_json",
            DecodeError::NotAnObject => "not_an_object",
            DecodeError::DuplicateField(_) => "duplicate_field",
            DecodeError::UnknownField(_) => "unknown_field",
            DecodeError::MissingField(_) => "missing_field",
            DecodeError::WrongType { .. } => "wrong_type",
            DecodeError::EmptyField(_) => "empty_field",
            DecodeError::TooLong { .. } => "too_long",
            DecodeError::InvalidCharacters { .. } => "invalid_characters",
            DecodeError::KeyTooLong { .. } => "key_too_long",
            DecodeError::NulCharacter(_) => "nul_character",
        }
    }
}
