//! The length and character rules of the intent's string fields. They are strict because
//! the strings travel further: the downstream idempotency key is `<tenant>:<action_id>`
//! (so a tenant may never contain `:`), the tenant is an AMQP topic routing key (so no
//! wildcards or separators beyond `.`), and all of them land in logs and SQL rows.

use crate::intent::{MAX_KEY_LEN, MAX_TOOL_LEN};
use crate::DecodeError;

/// The rule for one string field.
pub(crate) struct FieldRule {
    pub(crate) name: &'static str,
    max: usize,
    allowed: &'static str,
    accepts: fn(char) -> bool,
}

const NAME_CHARS: &str = "ASCII letters, digits, '-', '_' and '.'";

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')
}

fn is_visible_ascii(c: char) -> bool {
    matches!(c, '\u{21}'..='\u{7e}')
}

fn is_not_control(c: char) -> bool {
    !c.is_control()
}

/// The tenant: a routing key and the prefix of the idempotency key.
pub(crate) const TENANT: FieldRule = FieldRule {
    name: "tenant",
    max: MAX_KEY_LEN,
    allowed: NAME_CHARS,
    accepts: is_name_char,
};

/// The application's action key; anything printable without spaces, so it reads and
/// logs unambiguously.
pub(crate) const ACTION_ID: FieldRule = FieldRule {
    name: "action_id",
    max: MAX_KEY_LEN,
    allowed: "visible ASCII characters (0x21 to 0x7E), no spaces or control characters",
    accepts: is_visible_ascii,
};

/// The tool name, which selects an adapter and labels metrics.
pub(crate) const TOOL: FieldRule = FieldRule {
    name: "tool",
    max: MAX_TOOL_LEN,
    allowed: NAME_CHARS,
    accepts: is_name_char,
};

/// The informational model call id.
pub(crate) const CALL_ID: FieldRule = FieldRule {
    name: "call_id",
    max: MAX_KEY_LEN,
    allowed: "characters other than control characters",
    accepts: is_not_control,
};

/// The action a compensation undoes: an `action_id` of the same tenant.
pub(crate) const COMPENSATES: FieldRule = FieldRule {
    name: "compensates",
    max: MAX_KEY_LEN,
    allowed: "visible ASCII characters (0x21 to 0x7E), no spaces or control characters",
    accepts: is_visible_ascii,
};

/// Where results go; a routing key like the tenant.
pub(crate) const REPLY_TO: FieldRule = FieldRule {
    name: "reply_to",
    max: MAX_KEY_LEN,
    allowed: NAME_CHARS,
    accepts: is_name_char,
};

/// Checks every field against its rule, one rule kind at a time (all emptiness, then
/// all lengths, then all characters) so the reported error follows the documented order.
pub(crate) fn check(fields: &[(&FieldRule, &str)]) -> Result<(), DecodeError> {
    if let Some((rule, _)) = fields.iter().find(|(_, value)| value.is_empty()) {
        return Err(DecodeError::EmptyField(rule.name));
    }
    for (rule, value) in fields {
        // Cheap byte bound first: a long value's chars are only counted when needed.
        if value.len() > rule.max {
            let len = value.chars().count();
            if len > rule.max {
                return Err(DecodeError::TooLong {
                    field: rule.name,
                    len,
                    max: rule.max,
                });
            }
        }
    }
    if let Some((rule, _)) = fields
        .iter()
        .find(|(rule, value)| !value.chars().all(rule.accepts))
    {
        return Err(DecodeError::InvalidCharacters {
            field: rule.name,
            allowed: rule.allowed,
        });
    }
    Ok(())
}
