//! Configuration: the worker's settings from the environment and the per-tool TOML file.
//!
//! Every setting has a documented default (README, "Configuration"); a bad value is a start-up
//! error naming the variable, never a silent fallback.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Errors found while reading configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{name} is required but not set")]
    Missing { name: &'static str },
    #[error("{name}={value:?} is invalid: {reason}")]
    Invalid {
        name: &'static str,
        value: String,
        reason: String,
    },
    // The io error is part of this message and deliberately not a `source`: a chain printer
    // (`{:#}`) would otherwise print it twice.
    #[error("cannot read tools file {path}: {error}")]
    ToolsRead {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("tools file {path} is invalid: {reason}")]
    ToolsInvalid { path: PathBuf, reason: String },
}

/// Broker names the worker declares and uses.
#[derive(Debug, Clone)]
pub struct Topology {
    /// Durable topic exchange agents publish intents to.
    pub intents_exchange: String,
    /// Quorum queue the workers consume.
    pub intents_queue: String,
    /// Durable topic exchange result events go to (routing key: the tenant).
    pub results_exchange: String,
    /// Exchange dead-lettered intents go to.
    pub dead_letter_exchange: String,
    /// Queue holding dead-lettered intents for inspection.
    pub dead_letter_queue: String,
    /// Deliveries of one message the worker starts before it dead-letters the message instead
    /// (counted in Postgres; only deliveries it actually began processing count).
    pub delivery_limit: u32,
    /// The queue's `x-delivery-limit`: the broker's backstop. The broker also counts returns of
    /// messages a crashed worker had prefetched but not started, so it must be looser than
    /// `delivery_limit` or innocent neighbours of a poison message would be dead-lettered.
    pub queue_delivery_limit: u32,
}

impl Topology {
    /// Default broker backstop for a worker limit: four times it, at least 20 (RabbitMQ 4.x's
    /// own default).
    pub fn default_queue_delivery_limit(delivery_limit: u32) -> u32 {
        delivery_limit.saturating_mul(4).max(20)
    }
}

/// Everything the worker process needs to run.
#[derive(Debug, Clone)]
pub struct Settings {
    pub database_url: String,
    pub amqp_url: String,
    pub tools_path: PathBuf,
    /// Broker prefetch: unacknowledged deliveries per consumer, and the largest intake batch.
    pub prefetch: u16,
    /// Prometheus listener; None disables it.
    pub metrics_addr: Option<SocketAddr>,
    /// Admin API listener; None disables it (also disabled without a token).
    pub admin_addr: Option<SocketAddr>,
    pub admin_token: Option<String>,
    /// Tenant-scoped read tokens for the status query: tenant -> token.
    pub tenant_tokens: BTreeMap<String, String>,
    pub topology: Topology,
    /// How long a claim owns a dispatch before recovery treats it as crashed.
    pub lease: Duration,
    /// How often the recovery scheduler looks for due work.
    pub recovery_interval: Duration,
    /// Dispatches running at once in this process.
    pub max_in_flight: usize,
    /// Identity written into leases and history.
    pub worker_id: String,
    /// Grace period for in-flight work on SIGTERM.
    pub shutdown_grace: Duration,
    /// Retention of private data (arguments, receipts) of finished operations.
    pub retention: Duration,
    /// Retention of the tombstone (key, fingerprint, final state) after private data is gone.
    pub tombstone_retention: Duration,
    /// Database pool size.
    pub db_pool_size: u32,
    /// `worker run` applies migrations at start (false: another process, e.g. a Kubernetes
    /// Job running `worker migrate`, owns them and `run` only checks they are applied).
    pub migrate: bool,
    /// Log format: "text" or "json".
    pub log_json: bool,
    /// AMQP heartbeat asked of the broker, seconds (0 = off): how soon a silent link is lost.
    pub amqp_heartbeat_secs: u16,
    /// Declare the broker topology at start-up (`WORKER_DECLARE_TOPOLOGY`, default true); with
    /// false the broker is managed as code and the worker only checks, passively, that the
    /// exchanges and queues it uses exist.
    pub declare_topology: bool,
    /// Extra PEM bundle trusted besides the system roots by every TLS client of the worker
    /// (`WORKER_CA_FILE`: RabbitMQ, Postgres, HTTPS tools); see `crate::tls`.
    pub ca_file: Option<PathBuf>,
}

fn var(name: &'static str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn parse<T: std::str::FromStr>(name: &'static str, default: T) -> Result<T, ConfigError>
where
    T::Err: std::fmt::Display,
{
    match var(name) {
        None => Ok(default),
        Some(v) => v.trim().parse().map_err(|e: T::Err| ConfigError::Invalid {
            name,
            value: v,
            reason: e.to_string(),
        }),
    }
}

fn parse_bool(name: &'static str, default: bool) -> Result<bool, ConfigError> {
    match var(name) {
        None => Ok(default),
        Some(v) => match v.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" => Ok(true),
            "false" | "0" | "no" => Ok(false),
            _ => Err(ConfigError::Invalid {
                name,
                value: v,
                reason: "expected true or false".into(),
            }),
        },
    }
}

fn parse_addr(
    name: &'static str,
    default: Option<&str>,
) -> Result<Option<SocketAddr>, ConfigError> {
    let raw = var(name).or_else(|| default.map(str::to_string));
    match raw.as_deref() {
        None | Some("off") | Some("none") => Ok(None),
        Some(v) => {
            v.parse()
                .map(Some)
                .map_err(|e: std::net::AddrParseError| ConfigError::Invalid {
                    name,
                    value: v.to_string(),
                    reason: e.to_string(),
                })
        }
    }
}

fn positive_secs(name: &'static str, default: u64) -> Result<Duration, ConfigError> {
    let secs: u64 = parse(name, default)?;
    if secs == 0 {
        return Err(ConfigError::Invalid {
            name,
            value: "0".into(),
            reason: "must be at least 1".into(),
        });
    }
    Ok(Duration::from_secs(secs))
}

/// Parses `tenant=token,tenant2=token2`.
fn parse_tenant_tokens(raw: Option<String>) -> Result<BTreeMap<String, String>, ConfigError> {
    let mut map = BTreeMap::new();
    for pair in raw.iter().flat_map(|r| r.split(',')).map(str::trim) {
        if pair.is_empty() {
            continue;
        }
        match pair.split_once('=') {
            Some((t, tok)) if !t.trim().is_empty() && tok.trim().len() >= 8 => {
                map.insert(t.trim().to_string(), tok.trim().to_string());
            }
            _ => {
                return Err(ConfigError::Invalid {
                    name: "WORKER_TENANT_TOKENS",
                    value: "<redacted>".into(),
                    reason:
                        "expected tenant=token pairs separated by commas, tokens of 8+ characters"
                            .into(),
                })
            }
        }
    }
    Ok(map)
}

impl Settings {
    /// Reads the settings from the process environment.
    pub fn from_env() -> Result<Settings, ConfigError> {
        let database_url = var("DATABASE_URL").ok_or(ConfigError::Missing {
            name: "DATABASE_URL",
        })?;
        let amqp_url =
            var("AMQP_URL").unwrap_or_else(|| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        let tools_path = PathBuf::from(var("WORKER_TOOLS").unwrap_or_else(|| "tools.toml".into()));
        let prefetch: u16 = parse("WORKER_PREFETCH", 64)?;
        if prefetch == 0 {
            return Err(ConfigError::Invalid {
                name: "WORKER_PREFETCH",
                value: "0".into(),
                reason: "must be at least 1 (0 would mean unlimited)".into(),
            });
        }
        let delivery_limit: u32 = parse("WORKER_DELIVERY_LIMIT", 5)?;
        if delivery_limit == 0 {
            return Err(ConfigError::Invalid {
                name: "WORKER_DELIVERY_LIMIT",
                value: "0".into(),
                reason: "must be at least 1".into(),
            });
        }
        let admin_token = var("WORKER_ADMIN_TOKEN");
        if let Some(t) = &admin_token {
            if t.len() < 16 {
                return Err(ConfigError::Invalid {
                    name: "WORKER_ADMIN_TOKEN",
                    value: "<redacted>".into(),
                    reason: "must be at least 16 characters".into(),
                });
            }
        }
        let recovery_ms: u64 = parse("WORKER_RECOVERY_INTERVAL_MS", 1000)?;
        let default_id = format!(
            "{}-{}",
            var("HOSTNAME").unwrap_or_else(|| "worker".into()),
            std::process::id()
        );
        let log_format = var("WORKER_LOG_FORMAT").unwrap_or_else(|| "text".into());
        if log_format != "text" && log_format != "json" {
            return Err(ConfigError::Invalid {
                name: "WORKER_LOG_FORMAT",
                value: log_format,
                reason: "expected text or json".into(),
            });
        }
        Ok(Settings {
            database_url,
            amqp_url,
            tools_path,
            prefetch,
            metrics_addr: parse_addr("METRICS_ADDR", Some("127.0.0.1:9464"))?,
            admin_addr: parse_addr("WORKER_ADMIN_ADDR", Some("127.0.0.1:8080"))?,
            admin_token,
            tenant_tokens: parse_tenant_tokens(var("WORKER_TENANT_TOKENS"))?,
            topology: Topology {
                intents_exchange: var("WORKER_INTENTS_EXCHANGE")
                    .unwrap_or_else(|| "intents".into()),
                intents_queue: var("WORKER_INTENTS_QUEUE").unwrap_or_else(|| "intents".into()),
                results_exchange: var("WORKER_RESULTS_EXCHANGE")
                    .unwrap_or_else(|| "results".into()),
                dead_letter_exchange: var("WORKER_DEAD_LETTER_EXCHANGE")
                    .unwrap_or_else(|| "intents.dlx".into()),
                dead_letter_queue: var("WORKER_DEAD_LETTER_QUEUE")
                    .unwrap_or_else(|| "intents.dead".into()),
                delivery_limit,
                queue_delivery_limit: parse(
                    "WORKER_QUEUE_DELIVERY_LIMIT",
                    Topology::default_queue_delivery_limit(delivery_limit),
                )?,
            },
            lease: positive_secs("WORKER_LEASE_SECS", 30)?,
            recovery_interval: Duration::from_millis(recovery_ms.max(10)),
            max_in_flight: parse("WORKER_MAX_IN_FLIGHT", 256usize)?.max(1),
            worker_id: var("WORKER_ID").unwrap_or(default_id),
            shutdown_grace: positive_secs("WORKER_SHUTDOWN_GRACE_SECS", 30)?,
            retention: Duration::from_secs(parse("WORKER_RETENTION_SECS", 30 * 86_400u64)?),
            tombstone_retention: Duration::from_secs(parse(
                "WORKER_TOMBSTONE_RETENTION_SECS",
                365 * 86_400u64,
            )?),
            db_pool_size: parse("WORKER_DB_POOL_SIZE", 10u32)?.max(2),
            migrate: parse_bool("WORKER_MIGRATE", true)?,
            log_json: log_format == "json",
            amqp_heartbeat_secs: parse("WORKER_AMQP_HEARTBEAT_SECS", 10u16)?,
            declare_topology: parse_bool("WORKER_DECLARE_TOPOLOGY", true)?,
            ca_file: var("WORKER_CA_FILE").map(PathBuf::from),
        })
    }
}

/// How an unknown outcome of a tool may be recovered (docs/design.md section 5).
#[derive(Debug, Clone, PartialEq)]
pub enum Capability {
    /// Durable idempotency with receipt replay for `window` after the first dispatch; replay
    /// stops `margin` before the window closes.
    Replay { window: Duration, margin: Duration },
    /// Authoritative lookup by the stable key; the write is never resent.
    Lookup { url_template: String },
    /// Nothing: an unknown outcome is held for a person at once.
    None,
}

impl Capability {
    pub fn name(&self) -> &'static str {
        match self {
            Capability::Replay { .. } => "replay",
            Capability::Lookup { .. } => "lookup",
            Capability::None => "none",
        }
    }
}

/// Retry policy of one tool: the ledger scheduler is the only retry layer (docs/design.md section 6).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryPolicy {
    /// Write requests allowed for proven-not-applied failures, the first included.
    pub max_attempts: u32,
    pub initial_delay_ms: u64,
    pub multiplier: f64,
    pub max_delay_ms: u64,
    /// Randomisation factor: each delay lies within ±jitter of the nominal one.
    pub jitter: f64,
    /// No retry is scheduled past this long after the operation was recorded.
    pub max_elapsed_secs: u64,
    /// HTTP statuses the downstream documents as "not applied, try again".
    pub not_applied_statuses: Vec<u16>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            initial_delay_ms: 200,
            multiplier: 2.0,
            max_delay_ms: 30_000,
            jitter: 0.2,
            max_elapsed_secs: 3600,
            not_applied_statuses: vec![429],
        }
    }
}

/// Shared retry budget of one tool, kept in Postgres for all workers.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BudgetPolicy {
    /// Retries may not exceed this share of first attempts over the window.
    pub ratio: f64,
    /// Retries always allowed per minute, so a quiet tool can still retry.
    pub floor_per_minute: u32,
    /// Sliding window length.
    pub window_secs: u64,
}

impl Default for BudgetPolicy {
    fn default() -> Self {
        BudgetPolicy {
            ratio: 0.1,
            floor_per_minute: 10,
            window_secs: 60,
        }
    }
}

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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAuth {
    /// "user_id": the broker-validated AMQP user_id must be mapped to the intent's tenant.
    mode: String,
    #[serde(default)]
    users: BTreeMap<String, Vec<String>>,
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
}

/// How the tenant of an intent is proven.
#[derive(Debug, Clone, Default)]
pub enum TenantAuth {
    /// The tenant field is trusted (single-tenant deployments, trusted publishers).
    #[default]
    Trusted,
    /// The broker-validated `user_id` property must map to the intent's tenant.
    UserId {
        users: BTreeMap<String, Vec<String>>,
    },
}

impl TenantAuth {
    /// Whether a message published by `user_id` may act for `tenant`.
    pub fn allows(&self, user_id: Option<&str>, tenant: &str) -> bool {
        match self {
            TenantAuth::Trusted => true,
            TenantAuth::UserId { users } => user_id
                .and_then(|u| users.get(u))
                .is_some_and(|ts| ts.iter().any(|t| t == tenant || t == "*")),
        }
    }
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

impl Tools {
    pub fn load(path: &Path) -> Result<Tools, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::ToolsRead {
            path: path.to_path_buf(),
            error,
        })?;
        Tools::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<Tools, ConfigError> {
        let raw: RawToolsFile = toml::from_str(text).map_err(|e| invalid(path, e.to_string()))?;
        if raw.tools.is_empty() {
            return Err(invalid(path, "no [tools.<name>] entries"));
        }
        let mut tools = BTreeMap::new();
        for (name, t) in raw.tools {
            let tool = validate_tool(path, &name, t)?;
            tools.insert(name, tool);
        }
        let auth = match raw.auth {
            None => TenantAuth::Trusted,
            Some(a) if a.mode == "trusted" => TenantAuth::Trusted,
            Some(a) if a.mode == "user_id" => TenantAuth::UserId { users: a.users },
            Some(a) => {
                return Err(invalid(
                    path,
                    format!("auth.mode {:?}: expected trusted or user_id", a.mode),
                ))
            }
        };
        Ok(Tools { tools, auth })
    }
}

fn validate_tool(path: &Path, name: &str, t: RawTool) -> Result<ToolConfig, ConfigError> {
    let bad = |reason: String| invalid(path, format!("tools.{name}: {reason}"));
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(bad("tool names use letters, digits, '-', '_', '.'".into()));
    }
    if !(t.url.starts_with("http://") || t.url.starts_with("https://")) {
        return Err(bad(format!(
            "url {:?} must start with http:// or https://",
            t.url
        )));
    }
    let method = t.method.to_ascii_uppercase();
    if !matches!(method.as_str(), "POST" | "PUT" | "PATCH") {
        return Err(bad(format!("method {method}: expected POST, PUT or PATCH")));
    }
    if !t.receipt_id.starts_with('/') {
        return Err(bad(format!(
            "receipt_id {:?} must be a JSON pointer like \"/receipt_id\"",
            t.receipt_id
        )));
    }
    let Some(receipt_match) = t.receipt_match.clone() else {
        return Err(bad(
            "receipt_match is required: list the JSON pointers where the downstream echoes the \
             operation (e.g. { \"/idempotency_key\" = \"{tenant}:{action_id}\" }); \
             `receipt_match = {}` opts out, taking any 2xx with a receipt id as this operation's receipt"
                .into(),
        ));
    };
    for pointer in receipt_match.keys() {
        if !pointer.starts_with('/') {
            return Err(bad(format!(
                "receipt_match key {pointer:?} must be a JSON pointer"
            )));
        }
    }
    if t.timeout_ms == 0 {
        return Err(bad("timeout_ms must be at least 1".into()));
    }
    let capability = match t.recovery.as_str() {
        "replay" => {
            let window = t
                .replay_window_secs
                .ok_or_else(|| bad("recovery = \"replay\" needs replay_window_secs".into()))?;
            if window == 0 {
                return Err(bad("replay_window_secs must be at least 1".into()));
            }
            // Default margin: a tenth of the window, between 1 s and five minutes, so a request
            // still in flight cannot reach the downstream after its key has been pruned.
            let margin = t
                .replay_safety_margin_secs
                .unwrap_or((window / 10).clamp(1, 300));
            if margin == 0 {
                return Err(bad(
                    "replay_safety_margin_secs = 0: a replay sent just before the window closes \
                     could reach the downstream after it forgot the key; use at least 1"
                        .into(),
                ));
            }
            if margin >= window {
                return Err(bad(
                    "replay_safety_margin_secs must be below replay_window_secs".into(),
                ));
            }
            Capability::Replay {
                window: Duration::from_secs(window),
                margin: Duration::from_secs(margin),
            }
        }
        "lookup" => {
            let url = t
                .lookup_url
                .clone()
                .ok_or_else(|| bad("recovery = \"lookup\" needs lookup_url".into()))?;
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(bad(format!(
                    "lookup_url {url:?} must start with http:// or https://"
                )));
            }
            // A lookup must name the whole operation, or it may find another one.
            let names_key = url.contains("{key}");
            let names_both = url.contains("{tenant}") && url.contains("{action_id}");
            if !names_key && !names_both {
                return Err(bad(format!(
                    "lookup_url {url:?} must contain {{key}}, or both {{tenant}} and {{action_id}}, \
                     so a lookup can only find this operation"
                )));
            }
            Capability::Lookup { url_template: url }
        }
        "none" => Capability::None,
        other => {
            return Err(bad(format!(
                "recovery {other:?}: expected replay, lookup or none"
            )))
        }
    };
    if t.lookup_url.is_some() && !matches!(capability, Capability::Lookup { .. }) {
        return Err(bad(
            "lookup_url is only used with recovery = \"lookup\"".into()
        ));
    }
    if !t.replay_final_statuses.is_empty() && !matches!(capability, Capability::Replay { .. }) {
        return Err(bad(
            "replay_final_statuses is only used with recovery = \"replay\"".into(),
        ));
    }
    for s in &t.replay_final_statuses {
        if !(400..=499).contains(s) {
            return Err(bad(format!(
                "replay_final_statuses: {s} is not an HTTP 4xx status"
            )));
        }
    }
    if t.replay_window_secs.is_some() && !matches!(capability, Capability::Replay { .. }) {
        return Err(bad(
            "replay_window_secs is only used with recovery = \"replay\"".into(),
        ));
    }
    let r = &t.retry;
    if r.max_attempts == 0 {
        return Err(bad("retry.max_attempts must be at least 1".into()));
    }
    if r.multiplier.is_nan()
        || r.multiplier < 1.0
        || !(0.0..=1.0).contains(&r.jitter)
        || r.max_delay_ms < r.initial_delay_ms
    {
        return Err(bad(
            "retry: multiplier >= 1, 0 <= jitter <= 1 and max_delay_ms >= initial_delay_ms".into(),
        ));
    }
    if t.budget.ratio.is_nan()
        || t.budget.ratio < 0.0
        || !(1..=86_400).contains(&t.budget.window_secs)
    {
        return Err(bad(
            "budget: ratio >= 0 and 1 <= window_secs <= 86400".into()
        ));
    }
    for s in &r.not_applied_statuses {
        if !(400..=599).contains(s) {
            return Err(bad(format!(
                "retry.not_applied_statuses: {s} is not an HTTP error status"
            )));
        }
    }
    Ok(ToolConfig {
        name: name.to_string(),
        url: t.url,
        method,
        idempotency_header: t.idempotency_header,
        timeout: Duration::from_millis(t.timeout_ms),
        connect_timeout: Duration::from_millis(
            t.connect_timeout_ms.unwrap_or(t.timeout_ms.min(5000)),
        ),
        receipt_id: t.receipt_id,
        receipt_match,
        capability,
        replay_final_statuses: t.replay_final_statuses,
        recovery_attempts: t.recovery_attempts.max(1),
        retry: t.retry,
        budget: t.budget,
        headers: t.headers,
    })
}

/// Refuses settings that, together, would silently weaken the proof of an outcome (issue 8
/// items 9 and 11). The error names the tool and the keys involved.
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
    use super::*;

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
    fn parses_the_issue_example_with_defaults() {
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
    fn user_id_auth_maps_users_to_tenants() {
        let auth = TenantAuth::UserId {
            users: BTreeMap::from([("agent-n".to_string(), vec!["north".to_string()])]),
        };
        assert!(auth.allows(Some("agent-n"), "north"));
        assert!(!auth.allows(Some("agent-n"), "south"));
        assert!(!auth.allows(None, "north"));
        assert!(TenantAuth::Trusted.allows(None, "any"));
    }

    const MATCH: &str = "receipt_match = { \"/idempotency_key\" = \"{tenant}:{action_id}\" }";

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
            metrics_addr: None,
            admin_addr: None,
            admin_token: None,
            tenant_tokens: BTreeMap::new(),
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
            recovery_interval: Duration::from_secs(1),
            max_in_flight: 1,
            worker_id: "w".into(),
            shutdown_grace: Duration::from_secs(1),
            retention: Duration::from_secs(86_400),
            tombstone_retention: Duration::from_secs(tombstone_secs),
            db_pool_size: 2,
            ca_file: None,
            migrate: true,
            amqp_heartbeat_secs: 10,
            declare_topology: true,
            log_json: false,
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
}
