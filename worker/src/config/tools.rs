//! The tools file: one `[tools.<name>]` entry per downstream tool (URL, method, timeouts,
//! receipt checks, recovery capability, retry and budget policies, extra headers) and the
//! optional `[auth]` section, validated into [`Tools`]; and [`check_proof`], the start-up check
//! of the tools file against the settings.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Deserialize;

use super::approval::{self, Approval, RawApproval};
use super::auth::{self, RawAuth};
use super::completion::{self, Completion, PollPolicy, RawCallback, RawCompletion};
use super::interpolate::interpolate;
use super::{ConfigError, Settings};
use crate::intake::TenantAuth;
use crate::recovery::Capability;
use crate::retry::{BudgetPolicy, RetryPolicy};

/// One `[tools.<name>]` entry as written in the file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTool {
    url: String,
    #[serde(default = "default_method")]
    method: String,
    #[serde(default = "default_idempotency_header")]
    idempotency_header: String,
    #[serde(default = "default_timeout_ms")]
    timeout_ms: u64,
    #[serde(default)]
    connect_timeout_ms: Option<u64>,
    receipt_id: String,
    /// Absent is refused; an explicit `{}` is the documented opt-out.
    #[serde(default)]
    receipt_match: Option<BTreeMap<String, String>>,
    recovery: String,
    replay_window_secs: Option<u64>,
    #[serde(alias = "replay_margin_secs")]
    replay_safety_margin_secs: Option<u64>,
    lookup_url: Option<String>,
    #[serde(default)]
    replay_final_statuses: Vec<u16>,
    #[serde(default = "default_recovery_attempts", alias = "max_recovery_attempts")]
    recovery_attempts: u32,
    #[serde(default)]
    retry: RetryPolicy,
    #[serde(default)]
    budget: BudgetPolicy,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    // The completion keys ([`super::completion`]).
    #[serde(default)]
    completion: Option<String>,
    #[serde(default)]
    accepted_statuses: Option<Vec<u16>>,
    #[serde(default)]
    operation_id: Option<String>,
    #[serde(default)]
    status_url: Option<String>,
    #[serde(default)]
    done_match: Option<BTreeMap<String, serde_json::Value>>,
    #[serde(default)]
    failed_match: Option<BTreeMap<String, serde_json::Value>>,
    #[serde(default)]
    poll: Option<PollPolicy>,
    #[serde(default)]
    callback: Option<RawCallback>,
    #[serde(default)]
    absence_proof: Option<RawAbsenceProof>,
    #[serde(default)]
    deadline_refused_statuses: Option<Vec<u16>>,
    // The approval keys ([`super::approval`]).
    #[serde(default)]
    approval: Option<String>,
    #[serde(default)]
    approval_when: Option<BTreeMap<String, BTreeMap<String, serde_json::Value>>>,
    #[serde(default)]
    approvals: Option<i64>,
    #[serde(default)]
    approval_ttl_secs: Option<i64>,
    /// The tools whose actions this tool may compensate (`compensates` in an intent).
    #[serde(default)]
    compensation_for: Option<Vec<String>>,
}

/// `absence_proof = { ... }` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAbsenceProof {
    #[serde(default = "default_deadline_header")]
    deadline_header: String,
    deadline_ms: Option<u64>,
    clock_skew_ms: Option<u64>,
    #[serde(default)]
    settle_ms: u64,
}

fn default_deadline_header() -> String {
    "Request-Deadline".into()
}

/// A tool's proof-of-absence contract (`absence_proof`, `recovery = "lookup"` only): every write
/// carries an absolute deadline in `header`, `deadline` after its send fence on the database
/// clock; the downstream refuses, with no effect and one of `refused_statuses`, a request that
/// reaches its commit point after it. A lookup that misses later than the last deadline plus
/// `clock_skew` and `settle` proves the write never happened ([`AbsenceProof::proof_at`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbsenceProof {
    pub header: String,
    pub deadline: Duration,
    /// The most the downstream's clock may differ from the database's.
    pub clock_skew: Duration,
    /// How long after a commit the downstream's lookup may still miss it.
    pub settle: Duration,
    /// Statuses the downstream answers a request refused at its deadline with: proven not applied.
    pub refused_statuses: Vec<u16>,
}

impl AbsenceProof {
    /// The first moment (database clock) at which a lookup miss proves that no request with a
    /// deadline up to `last_deadline` committed or ever will.
    pub fn proof_at(&self, last_deadline: DateTime<Utc>) -> DateTime<Utc> {
        let wait = self.clock_skew + self.settle;
        last_deadline + chrono::Duration::from_std(wait).unwrap_or(chrono::Duration::MAX)
    }
}

impl RawTool {
    fn completion_keys(&self) -> RawCompletion {
        RawCompletion {
            completion: self.completion.clone(),
            accepted_statuses: self.accepted_statuses.clone(),
            operation_id: self.operation_id.clone(),
            status_url: self.status_url.clone(),
            done_match: self.done_match.clone(),
            failed_match: self.failed_match.clone(),
            poll: self.poll,
            callback: self.callback.clone(),
        }
    }

    fn approval_keys(&self) -> RawApproval {
        RawApproval {
            approval: self.approval.clone(),
            approval_when: self.approval_when.clone(),
            approvals: self.approvals,
            approval_ttl_secs: self.approval_ttl_secs,
        }
    }
}

fn default_method() -> String {
    "POST".into()
}
fn default_idempotency_header() -> String {
    "Idempotency-Key".into()
}
fn default_timeout_ms() -> u64 {
    10_000
}
fn default_recovery_attempts() -> u32 {
    5
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawToolsFile {
    #[serde(default)]
    tools: BTreeMap<String, RawTool>,
    #[serde(default)]
    auth: Option<RawAuth>,
}
/// A tool as the worker uses it, validated.
#[derive(Debug, Clone)]
pub struct ToolConfig {
    pub name: String,
    pub url: String,
    pub method: String,
    pub idempotency_header: String,
    pub timeout: Duration,
    pub connect_timeout: Duration,
    /// JSON pointer to the receipt id in a 2xx body.
    pub receipt_id: String,
    /// JSON pointer -> template ("{tenant}", "{action_id}", "{key}") the receipt must echo.
    /// Empty only when the file says `receipt_match = {}` (a warned opt-out).
    pub receipt_match: BTreeMap<String, String>,
    pub capability: Capability,
    /// Statuses that, answered to a replay, are final (`failed`). Empty by default: during
    /// recovery only a matching receipt proves an outcome.
    pub replay_final_statuses: Vec<u16>,
    /// Recovery rounds (lookups or replays) before an unknown outcome is held.
    pub recovery_attempts: u32,
    pub retry: RetryPolicy,
    pub budget: BudgetPolicy,
    /// Extra static request headers (e.g. an API key for the downstream).
    pub headers: BTreeMap<String, String>,
    /// How the write completes: at once, or as a long-running operation that is polled.
    pub completion: Completion,
    /// The proof-of-absence contract of a `lookup` tool, when it declares one.
    pub absence_proof: Option<AbsenceProof>,
    /// Whether an intent needs a person's approval before it is dispatched (`approval` or
    /// `approval_when`, with `approvals` and `approval_ttl_secs`); `None` when the tool
    /// declares no approval rule.
    pub approval: Option<Approval>,
    /// The tools whose succeeded actions an intent of this tool may undo (`compensation_for`;
    /// each names a tool of the file). Empty: it compensates nothing.
    pub compensation_for: Vec<String>,
}
/// The parsed tools file.
#[derive(Debug, Clone, Default)]
pub struct Tools {
    pub tools: BTreeMap<String, ToolConfig>,
    pub auth: TenantAuth,
}

fn invalid(path: &Path, reason: impl Into<String>) -> ConfigError {
    ConfigError::ToolsInvalid {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// A tool's connect timeout: `connect_timeout_ms` (5 s when unset), never more than nine tenths
/// of `timeout_ms`. A connect that never completes then ends as a connect failure, which proves
/// nothing was sent, before the whole request's timeout could end it as an unknown outcome (the
/// two ending together left the verdict to whichever timer the worker saw first).
fn connect_timeout(connect_timeout_ms: Option<u64>, timeout_ms: u64) -> Duration {
    let cap = timeout_ms - timeout_ms / 10;
    Duration::from_millis(connect_timeout_ms.unwrap_or(5000).min(cap))
}

impl Tools {
    pub fn load(path: &Path) -> Result<Tools, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::ToolsRead {
            path: path.to_path_buf(),
            error,
        })?;
        Tools::parse(path, &text)
    }

    /// Parses a tools file, interpolating `${VAR}` from the process environment.
    pub fn parse(path: &Path, text: &str) -> Result<Tools, ConfigError> {
        Tools::parse_with(path, text, &|name| std::env::var(name).ok())
    }

    /// Parses a tools file, interpolating `${VAR}` with `env` (see [`interpolate`]).
    pub fn parse_with(
        path: &Path,
        text: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Tools, ConfigError> {
        let raw: RawToolsFile = toml::from_str(text).map_err(|e| invalid(path, e.to_string()))?;
        if raw.tools.is_empty() {
            return Err(invalid(path, "no [tools.<name>] entries"));
        }
        let mut tools = BTreeMap::new();
        for (name, mut t) in raw.tools {
            let expand = |key: &str, value: &mut String| {
                *value = interpolate(value, env)
                    .map_err(|reason| invalid(path, format!("tools.{name}.{key}: {reason}")))?;
                Ok::<_, ConfigError>(())
            };
            expand("url", &mut t.url)?;
            if let Some(url) = t.lookup_url.as_mut() {
                expand("lookup_url", url)?;
            }
            if let Some(url) = t.status_url.as_mut() {
                expand("status_url", url)?;
            }
            for (header, value) in t.headers.iter_mut() {
                expand(&format!("headers.{header}"), value)?;
            }
            if let Some(callback) = t.callback.as_mut() {
                expand("callback.secret", &mut callback.secret)?;
            }
            let tool = validate_tool(path, &name, t)?;
            tools.insert(name, tool);
        }
        for (name, tool) in &tools {
            if let Some(unknown) = tool
                .compensation_for
                .iter()
                .find(|t| !tools.contains_key(*t))
            {
                return Err(invalid(
                    path,
                    format!(
                        "tools.{name}: compensation_for names {unknown:?}, which is not a tool of this file"
                    ),
                ));
            }
        }
        let auth = auth::tenant_auth(path, raw.auth)?;
        Ok(Tools { tools, auth })
    }
}

/// Validates one entry, in the order of its parts: the request, the recovery capability and
/// the keys only a capability uses, then the retry and budget policies. The error names the
/// tool and the key.
fn validate_tool(path: &Path, name: &str, t: RawTool) -> Result<ToolConfig, ConfigError> {
    let bad = |reason: String| invalid(path, format!("tools.{name}: {reason}"));
    let (method, receipt_match) = check_request(name, &t).map_err(bad)?;
    let capability = capability(&t).map_err(bad)?;
    check_capability_keys(&t, &capability).map_err(bad)?;
    check_policies(&t).map_err(bad)?;
    let completion = completion::completion(&t.completion_keys()).map_err(bad)?;
    let absence_proof = absence_proof(&t, &capability).map_err(bad)?;
    let approval = approval::approval(&t.approval_keys()).map_err(bad)?;
    let compensation_for = match t.compensation_for {
        None => Vec::new(),
        Some(list) if list.is_empty() => {
            return Err(bad(
                "compensation_for is empty: list the tools whose actions this tool undoes, or leave it out".into(),
            ))
        }
        Some(list) => list,
    };
    Ok(ToolConfig {
        name: name.to_string(),
        url: t.url,
        method,
        idempotency_header: t.idempotency_header,
        timeout: Duration::from_millis(t.timeout_ms),
        connect_timeout: connect_timeout(t.connect_timeout_ms, t.timeout_ms),
        receipt_id: t.receipt_id,
        receipt_match,
        capability,
        replay_final_statuses: t.replay_final_statuses,
        recovery_attempts: t.recovery_attempts,
        retry: t.retry,
        budget: t.budget,
        headers: t.headers,
        completion,
        absence_proof,
        approval,
        compensation_for,
    })
}

/// `absence_proof` and `deadline_refused_statuses`: a `lookup` tool's only; the deadline outlives
/// the timeout (checked against the lease in [`check_proof`]); the header is a valid name that
/// no other header of the tool uses.
fn absence_proof(t: &RawTool, capability: &Capability) -> Result<Option<AbsenceProof>, String> {
    let Some(raw) = &t.absence_proof else {
        if t.deadline_refused_statuses.is_some() {
            return Err("deadline_refused_statuses is only used with absence_proof".into());
        }
        return Ok(None);
    };
    if !matches!(capability, Capability::Lookup { .. }) {
        return Err(format!(
            "absence_proof is only used with recovery = \"lookup\" (this tool's is {:?}): a \
             replay already proves the outcome by the key, and without a lookup a miss cannot be seen",
            capability.name()
        ));
    }
    let deadline_ms = raw.deadline_ms.ok_or(
        "absence_proof needs deadline_ms (how long after its send a write may still commit)",
    )?;
    let clock_skew_ms = raw.clock_skew_ms.ok_or(
        "absence_proof needs clock_skew_ms (the most the downstream's clock may differ from the \
         ledger database's; 0 only when both read one clock)",
    )?;
    if deadline_ms <= t.timeout_ms {
        return Err(format!(
            "absence_proof.deadline_ms = {deadline_ms} must exceed timeout_ms = {}: a request the \
             worker still waits for must not be refused for lateness",
            t.timeout_ms
        ));
    }
    let header = raw.deadline_header.trim();
    if header.is_empty()
        || !header
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
    {
        return Err(format!(
            "absence_proof.deadline_header {:?} is not an HTTP header name",
            raw.deadline_header
        ));
    }
    let taken = |name: &str| name.eq_ignore_ascii_case(header);
    if taken(&t.idempotency_header) || t.headers.keys().any(|k| taken(k)) {
        return Err(format!(
            "absence_proof.deadline_header {header:?} is already one of the tool's headers"
        ));
    }
    let refused_statuses = t.deadline_refused_statuses.clone().unwrap_or(vec![422]);
    if refused_statuses.is_empty() {
        return Err("deadline_refused_statuses must list at least one status".into());
    }
    for s in &refused_statuses {
        if !(400..=499).contains(s) || matches!(s, 408 | 409 | 429) {
            return Err(format!(
                "deadline_refused_statuses: {s} is not a 4xx status that can mean \"refused, no \
                 effect\" (408, 409 and 429 may come from a request that was applied)"
            ));
        }
    }
    Ok(Some(AbsenceProof {
        header: header.to_string(),
        deadline: Duration::from_millis(deadline_ms),
        clock_skew: Duration::from_millis(clock_skew_ms),
        settle: Duration::from_millis(raw.settle_ms),
        refused_statuses,
    }))
}

/// The request a dispatch sends and the receipt it expects: the upper-cased method and the
/// receipt match.
fn check_request(name: &str, t: &RawTool) -> Result<(String, BTreeMap<String, String>), String> {
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err("tool names use letters, digits, '-', '_', '.'".into());
    }
    if !(t.url.starts_with("http://") || t.url.starts_with("https://")) {
        // Not the URL itself: an interpolated `${VAR}` in it may be a secret.
        return Err("url must start with http:// or https://".into());
    }
    let method = t.method.to_ascii_uppercase();
    if !matches!(method.as_str(), "POST" | "PUT" | "PATCH") {
        return Err(format!("method {method}: expected POST, PUT or PATCH"));
    }
    if !t.receipt_id.starts_with('/') {
        return Err(format!(
            "receipt_id {:?} must be a JSON pointer like \"/receipt_id\"",
            t.receipt_id
        ));
    }
    let Some(receipt_match) = t.receipt_match.clone() else {
        return Err(
            "receipt_match is required: list the JSON pointers where the downstream echoes the \
             operation (e.g. { \"/idempotency_key\" = \"{tenant}:{action_id}\" }); \
             `receipt_match = {}` opts out, taking any 2xx with a receipt id as this operation's receipt"
                .into(),
        );
    };
    for pointer in receipt_match.keys() {
        if !pointer.starts_with('/') {
            return Err(format!(
                "receipt_match key {pointer:?} must be a JSON pointer"
            ));
        }
    }
    if t.timeout_ms == 0 {
        return Err("timeout_ms must be at least 1".into());
    }
    Ok((method, receipt_match))
}

/// The recovery capability `recovery = ...` declares, with the keys it needs.
fn capability(t: &RawTool) -> Result<Capability, String> {
    match t.recovery.as_str() {
        "replay" => replay_capability(t),
        "lookup" => {
            let url = t
                .lookup_url
                .clone()
                .ok_or_else(|| "recovery = \"lookup\" needs lookup_url".to_string())?;
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err("lookup_url must start with http:// or https://".into());
            }
            // A lookup must name the whole operation, or it may find another one.
            let names_key = url.contains("{key}");
            let names_both = url.contains("{tenant}") && url.contains("{action_id}");
            if !names_key && !names_both {
                return Err(
                    "lookup_url must contain {key}, or both {tenant} and {action_id}, \
                     so a lookup can only find this operation"
                        .into(),
                );
            }
            Ok(Capability::Lookup { url_template: url })
        }
        "none" => Ok(Capability::None),
        other => Err(format!(
            "recovery {other:?}: expected replay, lookup or none"
        )),
    }
}

/// `recovery = "replay"`: the window and its safety margin.
fn replay_capability(t: &RawTool) -> Result<Capability, String> {
    let window = t
        .replay_window_secs
        .ok_or_else(|| "recovery = \"replay\" needs replay_window_secs".to_string())?;
    if window == 0 {
        return Err("replay_window_secs must be at least 1".into());
    }
    // Default margin: a tenth of the window, between 1 s and five minutes, so a request
    // still in flight cannot reach the downstream after its key has been pruned.
    let margin = t
        .replay_safety_margin_secs
        .unwrap_or((window / 10).clamp(1, 300));
    if margin == 0 {
        return Err(
            "replay_safety_margin_secs = 0: a replay sent just before the window closes \
             could reach the downstream after it forgot the key; use at least 1"
                .into(),
        );
    }
    if margin >= window {
        return Err("replay_safety_margin_secs must be below replay_window_secs".into());
    }
    Ok(Capability::Replay {
        window: Duration::from_secs(window),
        margin: Duration::from_secs(margin),
    })
}

/// Keys that only one capability uses are refused with the others, and the recovery rounds
/// have their minimum.
fn check_capability_keys(t: &RawTool, capability: &Capability) -> Result<(), String> {
    if t.lookup_url.is_some() && !matches!(capability, Capability::Lookup { .. }) {
        return Err("lookup_url is only used with recovery = \"lookup\"".into());
    }
    if !t.replay_final_statuses.is_empty() && !matches!(capability, Capability::Replay { .. }) {
        return Err("replay_final_statuses is only used with recovery = \"replay\"".into());
    }
    for s in &t.replay_final_statuses {
        if !(400..=499).contains(s) {
            return Err(format!(
                "replay_final_statuses: {s} is not an HTTP 4xx status"
            ));
        }
    }
    if t.replay_window_secs.is_some() && !matches!(capability, Capability::Replay { .. }) {
        return Err("replay_window_secs is only used with recovery = \"replay\"".into());
    }
    if t.recovery_attempts == 0 {
        return Err("recovery_attempts must be at least 1".into());
    }
    Ok(())
}

/// The retry and budget policies' ranges.
fn check_policies(t: &RawTool) -> Result<(), String> {
    let r = &t.retry;
    if r.max_attempts == 0 {
        return Err("retry.max_attempts must be at least 1".into());
    }
    if r.multiplier.is_nan()
        || r.multiplier < 1.0
        || !(0.0..=1.0).contains(&r.jitter)
        || r.max_delay_ms < r.initial_delay_ms
    {
        return Err(
            "retry: multiplier >= 1, 0 <= jitter <= 1 and max_delay_ms >= initial_delay_ms".into(),
        );
    }
    if t.budget.ratio.is_nan()
        || t.budget.ratio < 0.0
        || !(1..=86_400).contains(&t.budget.window_secs)
    {
        return Err("budget: ratio >= 0 and 1 <= window_secs <= 86400".into());
    }
    for s in &r.not_applied_statuses {
        if !(400..=599).contains(s) {
            return Err(format!(
                "retry.not_applied_statuses: {s} is not an HTTP error status"
            ));
        }
    }
    Ok(())
}

/// Refuses settings that, together, would silently weaken the proof of an outcome: a tool
/// timeout not shorter than the lease, a tombstone retention shorter than a replay window. The
/// error names the tool and the keys involved.
pub fn check_proof(settings: &Settings, tools: &Tools) -> Result<(), ConfigError> {
    let bad = |name: &str, reason: String| {
        invalid(&settings.tools_path, format!("tools.{name}: {reason}"))
    };
    for (name, tool) in &tools.tools {
        // A request still in flight when its lease ends turns into a needless unknown outcome,
        // and a send must leave while the lease outlives the whole timeout.
        if tool.timeout >= settings.lease {
            return Err(bad(
                name,
                format!(
                    "timeout_ms = {} is not shorter than WORKER_LEASE_SECS = {}; a request could \
                     still be in flight when its lease ends and recovery starts",
                    tool.timeout.as_millis(),
                    settings.lease.as_secs()
                ),
            ));
        }
        // A write's deadline passes before its owner's lease can lapse, so whoever recovers a
        // crashed owner's send finds its deadline already behind it, and a slow downstream
        // cannot hold a row's proof back by more than one lease.
        if let Some(proof) = &tool.absence_proof {
            if proof.deadline >= settings.lease {
                return Err(bad(
                    name,
                    format!(
                        "absence_proof.deadline_ms = {} is not shorter than WORKER_LEASE_SECS = {}; \
                         a write could still commit after its lease ended",
                        proof.deadline.as_millis(),
                        settings.lease.as_secs()
                    ),
                ));
            }
        }
        // The tombstone (key, fingerprint, final answer) must outlive the downstream's memory
        // of the key; else a redelivered intent is admitted as new while the key is remembered.
        if let Capability::Replay { window, .. } = tool.capability {
            if settings.tombstone_retention < window {
                return Err(bad(
                    name,
                    format!(
                        "WORKER_TOMBSTONE_RETENTION_SECS = {} is shorter than replay_window_secs = {}; \
                         a forgotten key could be admitted and sent again while the downstream \
                         still remembers it",
                        settings.tombstone_retention.as_secs(),
                        window.as_secs()
                    ),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::config::Topology;

    const MATCH: &str = "receipt_match = { \"/idempotency_key\" = \"{tenant}:{action_id}\" }";

    const EXAMPLE: &str = r#"
[tools.refund]
url = "http://127.0.0.1:9100/refunds"
idempotency_header = "Idempotency-Key"
timeout_ms = 2000
receipt_id = "/receipt_id"
receipt_match = { "/idempotency_key" = "{tenant}:{action_id}" }
recovery = "replay"
replay_window_secs = 86400

[tools.ticket]
url = "http://127.0.0.1:9100/lookup/tickets"
receipt_id = "/receipt_id"
receipt_match = { "/idempotency_key" = "{tenant}:{action_id}" }
recovery = "lookup"
lookup_url = "http://127.0.0.1:9100/lookup/tickets/by-key/{tenant}:{action_id}"
retry = { max_attempts = 3, not_applied_statuses = [429, 503] }
budget = { ratio = 0.2 }
"#;

    #[test]
    fn parses_the_example_with_defaults() {
        let tools = Tools::parse(Path::new("t.toml"), EXAMPLE).unwrap();
        let refund = &tools.tools["refund"];
        assert_eq!(refund.timeout, Duration::from_millis(2000));
        assert_eq!(
            refund.capability,
            Capability::Replay {
                window: Duration::from_secs(86400),
                margin: Duration::from_secs(300)
            }
        );
        assert_eq!(refund.retry, RetryPolicy::default());
        let ticket = &tools.tools["ticket"];
        assert_eq!(ticket.retry.max_attempts, 3);
        assert_eq!(ticket.retry.not_applied_statuses, vec![429, 503]);
        assert_eq!(ticket.retry.initial_delay_ms, 200);
        assert_eq!(ticket.budget.ratio, 0.2);
        assert_eq!(ticket.budget.floor_per_minute, 10);
    }

    #[test]
    fn a_connect_always_ends_before_the_whole_request_does() {
        let ms = |c: Option<u64>, t: u64| connect_timeout(c, t).as_millis();
        assert_eq!(ms(None, 10_000), 5_000);
        assert_eq!(ms(None, 60_000), 5_000);
        assert_eq!(ms(None, 2_000), 1_800);
        assert_eq!(ms(Some(300), 2_000), 300);
        assert_eq!(ms(Some(2_000), 2_000), 1_800);
        assert_eq!(ms(Some(9_000), 3_000), 2_700);
        assert_eq!(ms(None, 1), 1);
    }

    #[test]
    fn rejects_missing_capability_settings_with_the_tool_name() {
        let err = Tools::parse(
            Path::new("t.toml"),
            "[tools.x]\nurl='http://a'\nreceipt_id='/id'\nreceipt_match={}\nrecovery='lookup'\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("tools.x") && err.contains("lookup_url"),
            "{err}"
        );
        let err = Tools::parse(
            Path::new("t.toml"),
            "[tools.x]\nurl='http://a'\nreceipt_id='/id'\nreceipt_match={}\nrecovery='maybe'\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("expected replay, lookup or none"), "{err}");
        let err = Tools::parse(
            Path::new("t.toml"),
            "[tools.x]\nurl='http://a'\nreceipt_id='/id'\nrecovery='none'\ntypo=1\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("typo"), "{err}");
    }

    #[test]
    fn the_tools_file_interpolates_url_lookup_url_and_headers_naming_tool_and_key() {
        let text = format!(
            "[tools.pay]\nurl='${{PAY_URL:-http://127.0.0.1:9}}/pay'\nreceipt_id='/id'\n{MATCH}\n\
             recovery='lookup'\nlookup_url='${{PAY_URL:-http://127.0.0.1:9}}/by-key/{{key}}'\n\
             headers = {{ Authorization = 'Bearer ${{PAY_KEY}}' }}\n"
        );
        let env = |n: &str| (n == "PAY_KEY").then(|| "k-123".to_string());
        let tools = Tools::parse_with(Path::new("t.toml"), &text, &env).unwrap();
        let pay = &tools.tools["pay"];
        assert_eq!(pay.url, "http://127.0.0.1:9/pay");
        assert_eq!(pay.headers["Authorization"], "Bearer k-123");
        assert_eq!(
            pay.capability,
            Capability::Lookup {
                url_template: "http://127.0.0.1:9/by-key/{key}".into()
            }
        );
        let err = Tools::parse_with(Path::new("t.toml"), &text, &|_| None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tools.pay.headers.Authorization") && err.contains("PAY_KEY is not set"),
            "{err}"
        );
    }

    fn parse_err(toml: &str) -> String {
        Tools::parse(Path::new("t.toml"), toml)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn receipt_match_must_be_written_and_an_explicit_empty_table_opts_out() {
        let err = parse_err("[tools.pay]\nurl='http://a'\nreceipt_id='/id'\nrecovery='none'\n");
        assert!(
            err.contains("tools.pay") && err.contains("receipt_match is required"),
            "{err}"
        );
        let tools = Tools::parse(
            Path::new("t.toml"),
            "[tools.pay]\nurl='http://a'\nreceipt_id='/id'\nreceipt_match = {}\nrecovery='none'\n",
        )
        .unwrap();
        assert!(tools.tools["pay"].receipt_match.is_empty());
    }

    #[test]
    fn a_lookup_url_must_name_the_whole_operation() {
        let tool = |url: &str| {
            format!("[tools.t]\nurl='http://a'\nreceipt_id='/id'\n{MATCH}\nrecovery='lookup'\nlookup_url='{url}'\n")
        };
        for url in [
            "http://a/by-action/{action_id}",
            "http://a/by-tenant/{tenant}",
            "http://a/all",
            "http://a/{tool}/{action_id}",
        ] {
            let err = parse_err(&tool(url));
            assert!(
                err.contains("tools.t") && err.contains("lookup_url") && err.contains("{key}"),
                "{url}: {err}"
            );
        }
        for url in ["http://a/by-key/{key}", "http://a/{tenant}/x/{action_id}"] {
            Tools::parse(Path::new("t.toml"), &tool(url)).unwrap();
        }
    }

    #[test]
    fn a_zero_replay_margin_is_refused_and_the_default_is_at_least_one_second() {
        let tool = |extra: &str| {
            format!("[tools.r]\nurl='http://a'\nreceipt_id='/id'\n{MATCH}\nrecovery='replay'\n{extra}\n")
        };
        let err = parse_err(&tool(
            "replay_window_secs = 600\nreplay_safety_margin_secs = 0",
        ));
        assert!(
            err.contains("tools.r") && err.contains("replay_safety_margin_secs = 0"),
            "{err}"
        );
        let tools = Tools::parse(Path::new("t.toml"), &tool("replay_window_secs = 5")).unwrap();
        assert_eq!(
            tools.tools["r"].capability,
            Capability::Replay {
                window: Duration::from_secs(5),
                margin: Duration::from_secs(1)
            }
        );
    }

    #[test]
    fn zero_recovery_attempts_are_refused_not_raised() {
        let err = parse_err(&format!(
            "[tools.n]\nurl='http://a'\nreceipt_id='/id'\n{MATCH}\nrecovery='none'\nrecovery_attempts = 0\n"
        ));
        assert!(
            err.contains("tools.n") && err.contains("recovery_attempts must be at least 1"),
            "{err}"
        );
    }

    #[test]
    fn replay_final_statuses_are_4xx_and_only_for_replay_tools() {
        let tool = |recovery: &str, statuses: &str| {
            format!("[tools.r]\nurl='http://a'\nreceipt_id='/id'\n{MATCH}\n{recovery}\nreplay_final_statuses = {statuses}\n")
        };
        let replay = "recovery='replay'\nreplay_window_secs = 600";
        let tools = Tools::parse(Path::new("t.toml"), &tool(replay, "[422, 409]")).unwrap();
        assert_eq!(tools.tools["r"].replay_final_statuses, vec![422, 409]);
        let err = parse_err(&tool(replay, "[503]"));
        assert!(err.contains("replay_final_statuses: 503"), "{err}");
        let err = parse_err(&tool("recovery='none'", "[422]"));
        assert!(
            err.contains("tools.r") && err.contains("replay_final_statuses is only used"),
            "{err}"
        );
        let none = Tools::parse(
            Path::new("t.toml"),
            &format!("[tools.r]\nurl='http://a'\nreceipt_id='/id'\n{MATCH}\n{replay}\n"),
        )
        .unwrap();
        assert!(none.tools["r"].replay_final_statuses.is_empty());
    }

    fn settings(lease_secs: u64, tombstone_secs: u64) -> Settings {
        Settings {
            database_url: "postgres://x".into(),
            amqp_url: "amqp://x".into(),
            tools_path: PathBuf::from("t.toml"),
            prefetch: 1,
            batch_pace: Duration::ZERO,
            max_message_bytes: protocol::MAX_INTENT_BYTES,
            metrics_addr: None,
            admin_addr: None,
            http_limits: kit::http::Limits::DEFAULT,
            admin_token: None,
            tenant_tokens: BTreeMap::new(),
            approver_tokens: BTreeMap::new(),
            topology: Topology {
                intents_exchange: "i".into(),
                intents_queue: "i".into(),
                results_exchange: "r".into(),
                dead_letter_exchange: "d".into(),
                dead_letter_queue: "d".into(),
                delivery_limit: 5,
                queue_delivery_limit: 20,
            },
            lease: Duration::from_secs(lease_secs),
            receipt_keep: Duration::from_secs(600),
            shards: Default::default(),
            recovery_interval: Duration::from_secs(1),
            max_in_flight: 1,
            worker_id: "w".into(),
            shutdown_grace: Duration::from_secs(1),
            retention: Duration::from_secs(86_400),
            tombstone_retention: Duration::from_secs(tombstone_secs),
            db_pool_size: 2,
            db_acquire_timeout: Duration::from_secs(10),
            ca_file: None,
            warnings: Vec::new(),
            migrate: true,
            amqp_heartbeat_secs: 10,
            declare_topology: true,
            log_json: false,
            trace_url: None,
            console: crate::config::ConsoleSettings {
                enabled: false,
                secret: None,
                session: Duration::from_secs(3_600),
                secure_cookie: false,
                alert_age: Duration::from_secs(900),
            },
        }
    }

    #[test]
    fn a_timeout_at_or_above_the_lease_is_refused_naming_the_tool() {
        let tools = Tools::parse(
            Path::new("t.toml"),
            &format!("[tools.slow]\nurl='http://a'\nreceipt_id='/id'\n{MATCH}\nrecovery='none'\ntimeout_ms = 30000\n"),
        )
        .unwrap();
        let err = check_proof(&settings(30, 365 * 86_400), &tools)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tools.slow")
                && err.contains("timeout_ms = 30000")
                && err.contains("WORKER_LEASE_SECS = 30"),
            "{err}"
        );
        check_proof(&settings(31, 365 * 86_400), &tools).unwrap();
    }

    #[test]
    fn a_tombstone_retention_shorter_than_a_replay_window_is_refused() {
        let tools = Tools::parse(Path::new("t.toml"), EXAMPLE).unwrap();
        let err = check_proof(&settings(30, 3600), &tools)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tools.refund")
                && err.contains("WORKER_TOMBSTONE_RETENTION_SECS = 3600")
                && err.contains("replay_window_secs = 86400"),
            "{err}"
        );
        check_proof(&settings(30, 86_400), &tools).unwrap();
    }

    const LOOKUP: &str = "[tools.ticket]\nurl='http://a'\nreceipt_id='/id'\nreceipt_match={}\n\
        timeout_ms = 2000\nrecovery='lookup'\nlookup_url='http://a/{key}'\n";

    fn proof_tool(extra: &str) -> Result<Tools, String> {
        Tools::parse(Path::new("t.toml"), &format!("{LOOKUP}{extra}\n")).map_err(|e| e.to_string())
    }

    #[test]
    fn absence_proof_is_read_with_its_defaults() {
        let tools =
            proof_tool("absence_proof = { deadline_ms = 5000, clock_skew_ms = 250 }").unwrap();
        let proof = tools.tools["ticket"].absence_proof.clone().unwrap();
        assert_eq!(
            proof,
            AbsenceProof {
                header: "Request-Deadline".into(),
                deadline: Duration::from_secs(5),
                clock_skew: Duration::from_millis(250),
                settle: Duration::ZERO,
                refused_statuses: vec![422],
            }
        );
        let deadline = Utc::now();
        assert_eq!(
            proof.proof_at(deadline),
            deadline + chrono::Duration::milliseconds(250)
        );
        let tools = proof_tool(
            "absence_proof = { deadline_header = 'X-Deadline', deadline_ms = 5000, \
             clock_skew_ms = 0, settle_ms = 700 }\ndeadline_refused_statuses = [410, 422]",
        )
        .unwrap();
        let proof = tools.tools["ticket"].absence_proof.clone().unwrap();
        assert_eq!(proof.header, "X-Deadline");
        assert_eq!(proof.settle, Duration::from_millis(700));
        assert_eq!(proof.refused_statuses, vec![410, 422]);
    }

    #[test]
    fn absence_proof_is_refused_where_it_cannot_hold_naming_the_tool_and_key() {
        for (extra, says) in [
            ("absence_proof = { clock_skew_ms = 0 }", "needs deadline_ms"),
            ("absence_proof = { deadline_ms = 5000 }", "needs clock_skew_ms"),
            ("absence_proof = { deadline_ms = 2000, clock_skew_ms = 0 }", "must exceed timeout_ms = 2000"),
            ("absence_proof = { deadline_ms = 5000, clock_skew_ms = 0, deadline_header = 'A B' }", "not an HTTP header name"),
            ("absence_proof = { deadline_ms = 5000, clock_skew_ms = 0, deadline_header = 'idempotency-key' }", "already one of the tool's headers"),
            ("absence_proof = { deadline_ms = 5000, clock_skew_ms = 0 }\ndeadline_refused_statuses = [409]", "deadline_refused_statuses: 409"),
            ("absence_proof = { deadline_ms = 5000, clock_skew_ms = 0 }\ndeadline_refused_statuses = [500]", "deadline_refused_statuses: 500"),
            ("absence_proof = { deadline_ms = 5000, clock_skew_ms = 0 }\ndeadline_refused_statuses = []", "at least one status"),
            ("deadline_refused_statuses = [422]", "only used with absence_proof"),
        ] {
            let err = proof_tool(extra).unwrap_err();
            assert!(err.contains("tools.ticket") && err.contains(says), "{extra}: {err}");
        }
        // A misspelt key is refused by the parser, which names the line.
        let err = proof_tool("absence_proof = { deadline_ms = 5000, clock_skew_ms = 0, typo = 1 }")
            .unwrap_err();
        assert!(err.contains("unknown field `typo`"), "{err}");
        for recovery in [
            "recovery='none'",
            "recovery='replay'\nreplay_window_secs=60",
        ] {
            let err = Tools::parse(
                Path::new("t.toml"),
                &format!(
                    "[tools.x]\nurl='http://a'\nreceipt_id='/id'\nreceipt_match={{}}\n{recovery}\n\
                     absence_proof = {{ deadline_ms = 20000, clock_skew_ms = 0 }}\n"
                ),
            )
            .unwrap_err()
            .to_string();
            assert!(
                err.contains("tools.x") && err.contains("only used with recovery = \"lookup\""),
                "{recovery}: {err}"
            );
        }
    }

    #[test]
    fn a_deadline_at_or_above_the_lease_is_refused() {
        let tools =
            proof_tool("absence_proof = { deadline_ms = 30000, clock_skew_ms = 0 }").unwrap();
        let err = check_proof(&settings(30, 365 * 86_400), &tools)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tools.ticket")
                && err.contains("absence_proof.deadline_ms = 30000")
                && err.contains("WORKER_LEASE_SECS = 30"),
            "{err}"
        );
        check_proof(&settings(31, 365 * 86_400), &tools).unwrap();
    }
}
