//! How a tool's write completes, as its tools-file entry declares it: `completion = "sync"` (the
//! default: the answer to the write is the outcome) or `completion = "async"` (a long-running
//! operation: the downstream acknowledges the write with an operation id, and the worker polls a
//! status URL, read only, until the documented completion criteria are seen). The keys of the
//! async contract, their defaults and the start-up refusals live here; what a poll's answer
//! means is [`crate::adapter::status`]'s, when to poll [`crate::dispatch::next_state`]'s.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

/// The completion keys of one `[tools.<name>]` entry, as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCompletion {
    #[serde(default)]
    pub completion: Option<String>,
    #[serde(default)]
    pub accepted_statuses: Option<Vec<u16>>,
    #[serde(default)]
    pub operation_id: Option<String>,
    #[serde(default)]
    pub status_url: Option<String>,
    #[serde(default)]
    pub done_match: Option<BTreeMap<String, serde_json::Value>>,
    #[serde(default)]
    pub failed_match: Option<BTreeMap<String, serde_json::Value>>,
    #[serde(default)]
    pub poll: Option<PollPolicy>,
    #[serde(default)]
    pub callback: Option<RawCallback>,
}

/// `callback = { ... }` as written (its secret already interpolated).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCallback {
    pub secret: String,
    #[serde(default)]
    pub signature_header: Option<String>,
    #[serde(default)]
    pub tolerance_secs: Option<u64>,
    #[serde(default)]
    pub max_body_bytes: Option<usize>,
    #[serde(default)]
    pub key: Option<String>,
}

/// How a tool's write completes.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Completion {
    /// The answer to the write is the outcome.
    #[default]
    Sync,
    /// A long-running operation, polled until done (see [`AsyncContract`]).
    Async(Box<AsyncContract>),
}

impl Completion {
    /// The async contract, for an async tool.
    pub fn contract(&self) -> Option<&AsyncContract> {
        match self {
            Completion::Sync => None,
            Completion::Async(c) => Some(c),
        }
    }
}

/// What a long-running downstream documents: which answers to the write mean "accepted", where
/// the operation id is in them, where its status is read, and what a done or failed operation
/// looks like there.
#[derive(Debug, Clone, PartialEq)]
pub struct AsyncContract {
    /// 2xx statuses that mean "accepted, not done" (default 202).
    pub accepted_statuses: Vec<u16>,
    /// JSON pointer to the operation id in the acceptance (and in a status document).
    pub operation_id: String,
    /// GET URL template of the status: `{operation_id}`, `{tenant}`, `{action_id}`, `{key}`,
    /// `{tool}` (percent-encoded when filled).
    pub status_url: String,
    /// Pointer -> value: every one equal means the operation is done.
    pub done_match: BTreeMap<String, serde_json::Value>,
    /// Pointer -> value: every one equal means the operation failed (empty: never).
    pub failed_match: BTreeMap<String, serde_json::Value>,
    pub poll: PollPolicy,
    /// Signed completion callbacks the downstream may send (`POST /v1/callbacks/<tool>`).
    pub callback: Option<Callback>,
}

/// How a tool's downstream signs the completion callbacks it sends: `<signature_header>:
/// t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<raw body>" with the secret>`, accepted within
/// `tolerance` of the worker's clock, with a body of at most `max_body_bytes`. The operation is
/// found by the document's operation id (the contract's `operation_id` pointer) or by the
/// idempotency key at `key`.
#[derive(Clone, PartialEq)]
pub struct Callback {
    pub secret: String,
    /// Lower case (header names are case-insensitive).
    pub signature_header: String,
    pub tolerance: Duration,
    pub max_body_bytes: usize,
    /// JSON pointer to `<tenant>:<action_id>` in a callback's document, when it carries it.
    pub key: Option<String>,
}

/// Never the secret.
impl std::fmt::Debug for Callback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Callback")
            .field("secret", &"<redacted>")
            .field("signature_header", &self.signature_header)
            .field("tolerance", &self.tolerance)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("key", &self.key)
            .finish()
    }
}

/// The default signature header of a callback.
pub const DEFAULT_SIGNATURE_HEADER: &str = "x-signature";
/// How far a callback's signed time may be from the worker's clock by default (its replay
/// window), and at most.
pub const DEFAULT_TOLERANCE_SECS: u64 = 300;
pub const MAX_TOLERANCE_SECS: u64 = 3_600;
/// A callback's largest body by default, and at most (the admin listener's own cap).
pub const DEFAULT_CALLBACK_BYTES: usize = 1024 * 1024;
pub const MAX_CALLBACK_BYTES: usize = 2 * 1024 * 1024;

fn callback(raw: &RawCallback) -> Result<Callback, String> {
    kit::guard::check_token("callback.secret", &raw.secret)?;
    let signature_header = raw
        .signature_header
        .clone()
        .unwrap_or_else(|| DEFAULT_SIGNATURE_HEADER.into())
        .to_ascii_lowercase();
    if axum::http::HeaderName::from_bytes(signature_header.as_bytes()).is_err() {
        return Err(format!(
            "callback.signature_header {signature_header:?} is not a header name"
        ));
    }
    let tolerance_secs = raw.tolerance_secs.unwrap_or(DEFAULT_TOLERANCE_SECS);
    if !(1..=MAX_TOLERANCE_SECS).contains(&tolerance_secs) {
        return Err(format!(
            "callback.tolerance_secs = {tolerance_secs}: expected 1..={MAX_TOLERANCE_SECS}"
        ));
    }
    let max_body_bytes = raw.max_body_bytes.unwrap_or(DEFAULT_CALLBACK_BYTES);
    if !(1..=MAX_CALLBACK_BYTES).contains(&max_body_bytes) {
        return Err(format!(
            "callback.max_body_bytes = {max_body_bytes}: expected 1..={MAX_CALLBACK_BYTES}"
        ));
    }
    if let Some(key) = &raw.key {
        pointer("callback.key", key)?;
    }
    Ok(Callback {
        secret: raw.secret.clone(),
        signature_header,
        tolerance: Duration::from_secs(tolerance_secs),
        max_body_bytes,
        key: raw.key.clone(),
    })
}

/// When the status is read: the first poll about `first_ms` after the acceptance, then each one
/// about as long after the previous as the operation is old (so the gaps double), between
/// `first_ms` and `max_ms`; every delay is drawn within half of its nominal value either way,
/// never above `max_ms`, and persisted as the row's next attempt. Held for a person once
/// `deadline_secs` passed since the acceptance without an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PollPolicy {
    #[serde(default = "default_first_ms")]
    pub first_ms: u64,
    #[serde(default = "default_max_ms")]
    pub max_ms: u64,
    #[serde(default = "default_deadline_secs")]
    pub deadline_secs: u64,
}

/// The longest gap between two polls of one operation: a day.
pub const MAX_POLL_GAP_MS: u64 = 86_400_000;
/// The longest an operation may stay accepted before it is held: a year.
pub const MAX_DEADLINE_SECS: u64 = 31_536_000;

fn default_first_ms() -> u64 {
    1_000
}
fn default_max_ms() -> u64 {
    60_000
}
fn default_deadline_secs() -> u64 {
    3_600
}

impl Default for PollPolicy {
    fn default() -> PollPolicy {
        PollPolicy {
            first_ms: default_first_ms(),
            max_ms: default_max_ms(),
            deadline_secs: default_deadline_secs(),
        }
    }
}

impl PollPolicy {
    pub fn deadline(&self) -> Duration {
        Duration::from_secs(self.deadline_secs)
    }

    /// The delay before the next poll of an operation accepted `age` ago: its age, at least
    /// `first_ms` and at most `max_ms`, within half of that either way at random
    /// ([`kit::backoff`]), so many operations accepted together do not poll in step. Derived
    /// from the age alone, it needs no count of polls and survives a restart.
    pub fn delay(&self, age: Duration) -> Duration {
        let first = Duration::from_millis(self.first_ms);
        let max = Duration::from_millis(self.max_ms);
        kit::backoff::delay(
            &kit::backoff::Backoff {
                initial: age.clamp(first, max),
                multiplier: 2.0,
                max,
                jitter: 0.5,
            },
            1,
        )
    }
}

/// The tool's completion from its keys: the async contract's keys are required with
/// `completion = "async"` and refused without it. The error names the key.
pub(super) fn completion(raw: &RawCompletion) -> Result<Completion, String> {
    match raw.completion.as_deref().unwrap_or("sync") {
        "sync" => {
            let used = [
                ("accepted_statuses", raw.accepted_statuses.is_some()),
                ("operation_id", raw.operation_id.is_some()),
                ("status_url", raw.status_url.is_some()),
                ("done_match", raw.done_match.is_some()),
                ("failed_match", raw.failed_match.is_some()),
                ("poll", raw.poll.is_some()),
                ("callback", raw.callback.is_some()),
            ];
            match used.iter().find(|(_, set)| *set) {
                Some((key, _)) => Err(format!("{key} is only used with completion = \"async\"")),
                None => Ok(Completion::Sync),
            }
        }
        "async" => async_contract(raw).map(|c| Completion::Async(Box::new(c))),
        other => Err(format!("completion {other:?}: expected sync or async")),
    }
}

fn async_contract(raw: &RawCompletion) -> Result<AsyncContract, String> {
    let needs = |key: &str| format!("completion = \"async\" needs {key}");
    let operation_id = raw
        .operation_id
        .clone()
        .ok_or_else(|| needs("operation_id"))?;
    pointer("operation_id", &operation_id)?;
    let status_url = raw.status_url.clone().ok_or_else(|| needs("status_url"))?;
    if !(status_url.starts_with("http://") || status_url.starts_with("https://")) {
        return Err("status_url must start with http:// or https://".into());
    }
    // It must find exactly this operation: by the downstream's id, or by the stable key.
    let finds_one = status_url.contains("{operation_id}")
        || status_url.contains("{key}")
        || (status_url.contains("{tenant}") && status_url.contains("{action_id}"));
    if !finds_one {
        return Err(
            "status_url must contain {operation_id}, {key}, or both {tenant} and {action_id}, \
             so a poll can only read this operation"
                .into(),
        );
    }
    let done_match = raw.done_match.clone().unwrap_or_default();
    if done_match.is_empty() {
        return Err(needs("done_match (the fields a done operation shows)"));
    }
    let failed_match = raw.failed_match.clone().unwrap_or_default();
    for (key, map) in [("done_match", &done_match), ("failed_match", &failed_match)] {
        for (p, value) in map {
            pointer(key, p)?;
            if value.is_object() || value.is_array() || value.is_null() {
                return Err(format!(
                    "{key} {p:?}: expected a string, number or boolean to compare with"
                ));
            }
        }
    }
    if !failed_match.is_empty() && failed_match == done_match {
        return Err("failed_match must differ from done_match".into());
    }
    let accepted_statuses = raw.accepted_statuses.clone().unwrap_or_else(|| vec![202]);
    if accepted_statuses.is_empty() {
        return Err("accepted_statuses must list at least one 2xx status".into());
    }
    if let Some(s) = accepted_statuses.iter().find(|s| !(200..=299).contains(*s)) {
        return Err(format!("accepted_statuses: {s} is not a 2xx status"));
    }
    let poll = raw.poll.unwrap_or_default();
    if poll.first_ms == 0 || poll.max_ms < poll.first_ms || poll.deadline_secs == 0 {
        return Err("poll: first_ms >= 1, max_ms >= first_ms and deadline_secs >= 1".into());
    }
    if poll.max_ms > MAX_POLL_GAP_MS || poll.deadline_secs > MAX_DEADLINE_SECS {
        return Err(format!(
            "poll: max_ms <= {MAX_POLL_GAP_MS} (a day) and deadline_secs <= {MAX_DEADLINE_SECS} \
             (a year)"
        ));
    }
    let callback = raw.callback.as_ref().map(callback).transpose()?;
    Ok(AsyncContract {
        accepted_statuses,
        operation_id,
        status_url,
        done_match,
        failed_match,
        poll,
        callback,
    })
}

fn pointer(key: &str, p: &str) -> Result<(), String> {
    if p.starts_with('/') {
        Ok(())
    } else {
        Err(format!(
            "{key} {p:?} must be a JSON pointer like \"/state\""
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(extra: &str) -> RawCompletion {
        toml::from_str(extra).unwrap()
    }

    const ASYNC: &str = "completion = \"async\"\noperation_id = \"/operation_id\"\n\
        status_url = \"http://d/ops/{operation_id}\"\ndone_match = { \"/state\" = \"succeeded\" }\n";

    #[test]
    fn sync_is_the_default_and_refuses_the_async_keys() {
        assert_eq!(completion(&raw("")).unwrap(), Completion::Sync);
        let e = completion(&raw("status_url = \"http://d/{key}\"")).unwrap_err();
        assert!(
            e.contains("status_url is only used with completion = \"async\""),
            "{e}"
        );
        let e = completion(&raw("completion = \"eventually\"")).unwrap_err();
        assert!(e.contains("expected sync or async"), "{e}");
    }

    #[test]
    fn an_async_contract_has_its_defaults() {
        let Completion::Async(c) = completion(&raw(ASYNC)).unwrap() else {
            panic!("async")
        };
        assert_eq!(c.accepted_statuses, vec![202]);
        assert_eq!(c.poll, PollPolicy::default());
        assert!(c.failed_match.is_empty());
    }

    #[test]
    fn an_async_contract_refuses_what_could_not_work() {
        for (text, says) in [
            (
                ASYNC.replace("operation_id = \"/operation_id\"\n", ""),
                "needs operation_id",
            ),
            (
                ASYNC.replace("/operation_id\"", "operation_id\""),
                "JSON pointer",
            ),
            (
                ASYNC.replace("http://d/ops/{operation_id}", "http://d/ops/latest"),
                "so a poll can only read this operation",
            ),
            (
                ASYNC.replace("http://d/ops/{operation_id}", "http://d/{tenant}/ops"),
                "so a poll can only read this operation",
            ),
            (
                ASYNC.replace("done_match = { \"/state\" = \"succeeded\" }\n", ""),
                "needs done_match",
            ),
            (format!("{ASYNC}accepted_statuses = [302]\n"), "not a 2xx"),
            (
                format!("{ASYNC}poll = {{ first_ms = 0 }}\n"),
                "first_ms >= 1",
            ),
            (
                format!("{ASYNC}poll = {{ first_ms = 5000, max_ms = 10 }}\n"),
                "max_ms >= first_ms",
            ),
            (
                format!("{ASYNC}failed_match = {{ \"/state\" = \"succeeded\" }}\n"),
                "must differ",
            ),
            (
                format!("{ASYNC}poll = {{ max_ms = 86400001 }}\n"),
                "max_ms <= 86400000",
            ),
            (
                format!("{ASYNC}poll = {{ deadline_secs = 18446744073709551615 }}\n"),
                "deadline_secs <= 31536000",
            ),
            (
                ASYNC.replace("\"succeeded\" }", "{ a = 1 } }"),
                "string, number or boolean",
            ),
        ] {
            let e = completion(&raw(&text)).unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
        // The stable key finds the operation too.
        let by_key = ASYNC.replace("http://d/ops/{operation_id}", "http://d/by-key/{key}");
        assert!(completion(&raw(&by_key)).is_ok());
    }

    #[test]
    fn a_callback_has_its_defaults_hides_its_secret_and_refuses_what_could_not_work() {
        let with = |cb: &str| format!("{ASYNC}callback = {{ {cb} }}\n");
        let Completion::Async(c) =
            completion(&raw(&with("secret = \"0123456789abcdef-secret\""))).unwrap()
        else {
            panic!("async")
        };
        let cb = c.callback.expect("a callback");
        assert_eq!(cb.signature_header, "x-signature");
        assert_eq!(cb.tolerance, Duration::from_secs(300));
        assert_eq!(cb.max_body_bytes, 1024 * 1024);
        assert!(!format!("{cb:?}").contains("0123456789abcdef"), "{cb:?}");
        let Completion::Async(c) = completion(&raw(&with(
            "secret = \"0123456789abcdef-secret\", signature_header = \"Deploy-Signature\", \
             tolerance_secs = 60, max_body_bytes = 4096, key = \"/idempotency_key\"",
        )))
        .unwrap() else {
            panic!("async")
        };
        let cb = c.callback.unwrap();
        assert_eq!(cb.signature_header, "deploy-signature");
        assert_eq!(cb.key.as_deref(), Some("/idempotency_key"));
        for (cb, says) in [
            ("secret = \"short\"", "at least 16"),
            (
                "secret = \"0123456789abcdef\", signature_header = \"a b\"",
                "not a header name",
            ),
            (
                "secret = \"0123456789abcdef\", tolerance_secs = 0",
                "1..=3600",
            ),
            (
                "secret = \"0123456789abcdef\", max_body_bytes = 3000000",
                "1..=2097152",
            ),
            (
                "secret = \"0123456789abcdef\", key = \"key\"",
                "JSON pointer",
            ),
            (
                "secret = \"0123456789abcdef\", sign = \"x\"",
                "unknown field",
            ),
        ] {
            let e = match toml::from_str::<RawCompletion>(&with(cb)) {
                Ok(r) => completion(&r).unwrap_err(),
                Err(e) => e.to_string(),
            };
            assert!(e.contains(says), "{cb}: {e}");
        }
        let e = completion(&raw("callback = { secret = \"0123456789abcdef\" }")).unwrap_err();
        assert!(e.contains("callback is only used with completion"), "{e}");
    }

    #[test]
    fn poll_delays_follow_the_age_between_first_and_max_within_the_jitter() {
        let p = PollPolicy {
            first_ms: 1_000,
            max_ms: 8_000,
            deadline_secs: 60,
        };
        for (age_ms, nominal) in [
            (0, 1_000),
            (500, 1_000),
            (3_000, 3_000),
            (7_000, 7_000),
            (60_000, 8_000),
        ] {
            for _ in 0..20 {
                let d = p.delay(Duration::from_millis(age_ms)).as_millis() as u64;
                assert!(
                    d >= nominal / 2 && d <= (nominal * 3 / 2).min(8_000),
                    "age {age_ms} ms: {d} ms, nominal {nominal}"
                );
            }
        }
    }
}
