//! The intent an agent publishes (docs/design.md section 7) and its strict decoder. The
//! worker records an intent in the ledger before any network call, so anything
//! ambiguous (repeated or unknown fields, keys that would collide once joined into the
//! idempotency key) is refused here, before it can reach the ledger.

mod numbers;
mod rules;
mod top_level;

use serde_json::Value;

use crate::fingerprint::{
    canonical_json, fingerprint, fingerprint_canonical, fingerprint_canonical_compensating,
};
use crate::DecodeError;
use rules::{ACTION_ID, CALL_ID, COMPENSATES, REPLY_TO, TENANT, TOOL};
use top_level::Entries;

/// Largest accepted intent body, in bytes.
pub const MAX_INTENT_BYTES: usize = 256 * 1024;
/// Longest `tenant`, `action_id`, `call_id` and `reply_to`, in characters.
pub const MAX_KEY_LEN: usize = 200;
/// Longest `tool`, in characters.
pub const MAX_TOOL_LEN: usize = 64;
/// Longest action key `<tenant>:<action_id>`, in bytes: it is the AMQP `message_id`, a short
/// string. Each field may be [`MAX_KEY_LEN`] characters, but the pair must fit this bound.
pub const MAX_ACTION_KEY_BYTES: usize = 255;

/// The logical action key `<tenant>:<action_id>`: the AMQP `message_id` of the intent and the
/// downstream idempotency key, the same on every send of the same action.
pub fn action_key(tenant: &str, action_id: &str) -> String {
    format!("{tenant}:{action_id}")
}

/// Whether `(tenant, action_id)` makes an action key within [`MAX_ACTION_KEY_BYTES`].
/// [`decode_intent`] checks it with the other rules; senders that build a message id from a
/// key they did not decode check it here, before anything is sent or stored.
pub fn check_action_key(tenant: &str, action_id: &str) -> Result<(), DecodeError> {
    let len = tenant.len() + 1 + action_id.len();
    if len > MAX_ACTION_KEY_BYTES {
        return Err(DecodeError::KeyTooLong {
            len,
            max: MAX_ACTION_KEY_BYTES,
        });
    }
    Ok(())
}

/// The top-level fields the contract allows; anything else is refused.
const KNOWN_FIELDS: [&str; 7] = [
    "tenant",
    "action_id",
    "tool",
    "arguments",
    "call_id",
    "reply_to",
    "compensates",
];

/// A request for one side effect. `(tenant, action_id)` is the logical action key;
/// `tool` and `arguments` are what the fingerprint covers.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Intent {
    /// The tenant that owns the action; also the results routing key.
    pub tenant: String,
    /// The application's key for this logical action, unique within the tenant.
    pub action_id: String,
    /// Which adapter performs the action.
    pub tool: String,
    /// The tool's arguments; always a JSON object.
    pub arguments: Value,
    /// The model call that produced the request; informational only, never part of
    /// identity, since a retried model call must hit the same ledger row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
    /// Where the agent expects answers; stored with the operation and informational. Result
    /// events are always routed by the tenant, so no message can direct another tenant's
    /// results.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reply_to: Option<String>,
    /// The `action_id` (same tenant) of a succeeded action this one undoes: a compensation, an
    /// operation of its own linked to the original, admitted only while the original is
    /// `succeeded`. Part of the fingerprint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compensates: Option<String>,
}

impl Intent {
    /// The intent fingerprint: SHA-256 of the canonical `{tool, arguments}`, with
    /// `compensates` among them when the intent carries it.
    pub fn fingerprint(&self) -> String {
        match &self.compensates {
            None => fingerprint(&self.tool, &self.arguments),
            Some(original) => fingerprint_canonical_compensating(
                &self.tool,
                &canonical_json(&self.arguments),
                original,
            ),
        }
    }

    /// The arguments as RFC 8785 canonical JSON.
    pub fn canonical_arguments(&self) -> String {
        canonical_json(&self.arguments)
    }

    /// The canonical arguments and the fingerprint, the arguments written once for both.
    pub fn canonical_arguments_and_fingerprint(&self) -> (String, String) {
        let arguments = self.canonical_arguments();
        let fingerprint = match &self.compensates {
            None => fingerprint_canonical(&self.tool, &arguments),
            Some(original) => fingerprint_canonical_compensating(&self.tool, &arguments, original),
        };
        (arguments, fingerprint)
    }

    /// The intent as a JSON body that [`decode_intent`] accepts (given valid fields).
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("strings and JSON values always serialize")
    }
}

/// Decodes and validates an intent body, reporting the first broken rule in the order
/// documented on [`DecodeError`].
pub fn decode_intent(body: &[u8]) -> Result<Intent, DecodeError> {
    if body.len() > MAX_INTENT_BYTES {
        return Err(DecodeError::TooLarge {
            size: body.len(),
            limit: MAX_INTENT_BYTES,
        });
    }
    let entries = top_level::parse(body)?;
    numbers::check_range(body)?;
    if let Some(name) = top_level::first_duplicate(&entries) {
        return Err(DecodeError::DuplicateField(top_level::echo_name(name)));
    }
    if let Some((name, _)) = entries
        .iter()
        .find(|(name, _)| !KNOWN_FIELDS.contains(&name.as_str()))
    {
        return Err(DecodeError::UnknownField(top_level::echo_name(name)));
    }
    let mut raw = RawFields::new(entries);
    for name in ["tenant", "action_id", "tool", "arguments"] {
        if !raw.has(name) {
            return Err(DecodeError::MissingField(name));
        }
    }

    let tenant = required_string(raw.take("tenant"), "tenant")?;
    let action_id = required_string(raw.take("action_id"), "action_id")?;
    let tool = required_string(raw.take("tool"), "tool")?;
    let arguments = match raw.take("arguments") {
        Some(value @ Value::Object(_)) => value,
        _ => return Err(wrong_type("arguments", "a JSON object")),
    };
    let call_id = optional_string(raw.take("call_id"), "call_id")?;
    let reply_to = optional_string(raw.take("reply_to"), "reply_to")?;
    let compensates = optional_string(raw.take("compensates"), "compensates")?;

    let mut checked = vec![
        (&TENANT, tenant.as_str()),
        (&ACTION_ID, action_id.as_str()),
        (&TOOL, tool.as_str()),
    ];
    if let Some(call_id) = &call_id {
        checked.push((&CALL_ID, call_id));
    }
    if let Some(reply_to) = &reply_to {
        checked.push((&REPLY_TO, reply_to));
    }
    if let Some(compensates) = &compensates {
        checked.push((&COMPENSATES, compensates));
    }
    rules::check(&checked)?;
    check_action_key(&tenant, &action_id)?;
    if let Some(at) = nul_path(&arguments, "arguments") {
        return Err(DecodeError::NulCharacter(at));
    }

    Ok(Intent {
        tenant,
        action_id,
        tool,
        arguments,
        call_id,
        reply_to,
        compensates,
    })
}

/// Best effort for a body that failed strict decoding: if it is a JSON object (and
/// within [`MAX_INTENT_BYTES`]) whose `tenant` and `action_id` are strings that pass the
/// key rules, return them, so a `rejected` result can be addressed to the tenant.
/// Otherwise `None`.
///
/// A `tenant` or `action_id` that appears twice yields `None`: with two candidates
/// there is no honest answer to whom the rejection belongs.
pub fn salvage_key(body: &[u8]) -> Option<(String, String)> {
    if body.len() > MAX_INTENT_BYTES {
        return None;
    }
    let entries = salvage_parse(body)?;
    let tenant = sole_string(&entries, "tenant")?;
    let action_id = sole_string(&entries, "action_id")?;
    rules::check(&[(&TENANT, tenant), (&ACTION_ID, action_id)]).ok()?;
    Some((tenant.to_owned(), action_id.to_owned()))
}

/// Best effort, like [`salvage_key`], for the `reply_to` of a body that failed strict
/// decoding, so the rejection reaches the agent that sent it: the sole `reply_to` string
/// when it passes its rule, otherwise `None` (the answer then goes to the tenant-wide key).
pub fn salvage_reply_to(body: &[u8]) -> Option<String> {
    if body.len() > MAX_INTENT_BYTES {
        return None;
    }
    let entries = salvage_parse(body)?;
    let reply_to = sole_string(&entries, "reply_to")?;
    rules::check(&[(&REPLY_TO, reply_to)]).ok()?;
    Some(reply_to.to_owned())
}

/// Where the first U+0000 in `value` (a string or an object key) is, as a path such as
/// `arguments.a[1].b`. Refused: a downstream keeping JSON in Postgres `jsonb` (as many do)
/// cannot store it, nor the receipt that echoes it. (The worker keeps a receipt as sent,
/// U+0000 included.)
fn nul_path(value: &Value, at: &str) -> Option<String> {
    enum Step<'a> {
        Index(usize),
        Key(&'a str),
    }
    // The steps down to the NUL; the path text is built only when there is one (every intent
    // is searched, and almost none has one).
    fn find<'a>(value: &'a Value, steps: &mut Vec<Step<'a>>) -> bool {
        let mut down = |step, item| {
            steps.push(step);
            find(item, steps) || {
                steps.pop();
                false
            }
        };
        match value {
            Value::String(s) => s.contains('\0'),
            Value::Array(items) => items
                .iter()
                .enumerate()
                .any(|(i, item)| down(Step::Index(i), item)),
            Value::Object(map) => map
                .iter()
                .any(|(key, item)| key.contains('\0') || down(Step::Key(key), item)),
            _ => false,
        }
    }
    let mut steps = Vec::new();
    if !find(value, &mut steps) {
        return None;
    }
    let mut path = at.to_owned();
    for step in steps {
        match step {
            Step::Index(i) => path.push_str(&format!("[{i}]")),
            Step::Key(key) => {
                path.push('.');
                path.push_str(&top_level::echo_name(key));
            }
        }
    }
    Some(path)
}

/// The top level of a body for salvaging its key: parsed as it is, or, when serde refuses a
/// number beyond the double range, with its numbers replaced (the key fields are strings).
fn salvage_parse(body: &[u8]) -> Option<Entries> {
    top_level::parse(body)
        .or_else(|_| top_level::parse(&numbers::neutralized(body)))
        .ok()
}

/// The known fields of a body without duplicates, taken out one by one.
struct RawFields(Entries);

impl RawFields {
    fn new(entries: Entries) -> Self {
        RawFields(entries)
    }

    fn has(&self, name: &str) -> bool {
        self.0.iter().any(|(key, _)| key == name)
    }

    fn take(&mut self, name: &str) -> Option<Value> {
        let index = self.0.iter().position(|(key, _)| key == name)?;
        Some(self.0.swap_remove(index).1)
    }
}

fn wrong_type(field: &'static str, expected: &'static str) -> DecodeError {
    DecodeError::WrongType { field, expected }
}

fn required_string(value: Option<Value>, field: &'static str) -> Result<String, DecodeError> {
    match value {
        Some(Value::String(s)) => Ok(s),
        _ => Err(wrong_type(field, "a string")),
    }
}

/// `null` counts as absent: some serializers write every optional field.
fn optional_string(
    value: Option<Value>,
    field: &'static str,
) -> Result<Option<String>, DecodeError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(wrong_type(field, "a string or null")),
    }
}

fn sole_string<'a>(entries: &'a Entries, name: &str) -> Option<&'a str> {
    let mut matches = entries.iter().filter(|(key, _)| key == name);
    let (_, value) = matches.next()?;
    if matches.next().is_some() {
        return None;
    }
    value.as_str()
}
