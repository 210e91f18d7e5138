//! Configuration: the worker's settings from the environment (clap, so `worker run --help`
//! lists every variable with its default) and the per-tool TOML file, whose `url`,
//! `lookup_url` and `headers` values may reference `${VAR}`.
//!
//! Every setting has a documented default (docs/configuration.md); a bad value is a start-up
//! error naming the variable, never a silent fallback.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Errors found while reading configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A value clap refused (its message names the variable).
    #[error("{0}")]
    Usage(String),
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
    #[error("{name}={value:?} and its deprecated alias {alias}={alias_value:?} are both set and differ; keep {name} only")]
    Conflict {
        name: &'static str,
        value: String,
        alias: &'static str,
        alias_value: String,
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
    /// Extra PEM CA bundle trusted in addition to the system roots (`WORKER_CA_FILE`).
    pub ca_file: Option<PathBuf>,
    /// Broker prefetch: unacknowledged deliveries per consumer, and the largest intake batch;
    /// `WORKER_PREFETCH`, lowered if need be so that this many messages of `max_message_bytes`
    /// fit `WORKER_MAX_INFLIGHT_BYTES`.
    pub prefetch: u16,
    /// Largest intent delivery read; a larger one is dead-lettered unread.
    pub max_message_bytes: usize,
    /// Prometheus listener; None disables it.
    pub metrics_addr: Option<SocketAddr>,
    /// Admin API listener; None disables it (also disabled without a token).
    pub admin_addr: Option<SocketAddr>,
    /// Header timeout, idle timeout and connection cap of each HTTP listener.
    pub http_limits: kit::http::Limits,
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
    /// How long a task waits for a free pool connection.
    pub db_acquire_timeout: Duration,
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
    /// Deprecation notices found while reading the settings, logged once logging is set up.
    pub warnings: Vec<String>,
}

/// The worker's settings as the command line and the environment give them: every option is
/// also read from the variable shown in `worker run --help`, which is how containers, the tests
/// and the Python client configure it. Validation that needs more than one value, or must not
/// echo a secret, happens in [`Settings::from_args`].
#[derive(Debug, Clone, clap::Args)]
#[command(
    next_help_heading = "Settings (each is also read from the environment variable shown; empty values count as unset)"
)]
pub struct EnvArgs {
    /// Postgres URL of the ledger (required). `sslmode` and `sslrootcert` go in the URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        value_name = "DATABASE_URL",
        hide_env_values = true
    )]
    pub database_url: String,
    /// RabbitMQ URL (`amqp://` or `amqps://`; `?heartbeat=` overrides WORKER_AMQP_HEARTBEAT_SECS).
    #[arg(
        long,
        env = "AMQP_URL",
        value_name = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        hide_env_values = true
    )]
    pub amqp_url: String,
    /// Path of the tools file (relative to the working directory).
    #[arg(
        long,
        env = "WORKER_TOOLS",
        value_name = "WORKER_TOOLS",
        default_value = "tools.toml"
    )]
    pub tools: PathBuf,
    /// Extra PEM CA bundle trusted for AMQP, Postgres and HTTPS tools, in addition to the
    /// system roots.
    #[arg(long, env = "WORKER_CA_FILE", value_name = "WORKER_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// Broker prefetch per consumer and the largest intake batch (at least 1).
    #[arg(long, env = "WORKER_PREFETCH", value_name = "WORKER_PREFETCH", default_value_t = 256,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub prefetch: u16,
    /// Largest intent delivery the worker reads, in bytes (1024 to 262144, the contract's
    /// limit); a larger one is dead-lettered unread as `too_large`.
    #[arg(long, env = "WORKER_MAX_MESSAGE_BYTES", value_name = "WORKER_MAX_MESSAGE_BYTES",
          default_value_t = protocol::MAX_INTENT_BYTES as u64,
          value_parser = clap::value_parser!(u64).range(1024..=protocol::MAX_INTENT_BYTES as u64))]
    pub max_message_bytes: u64,
    /// Bytes of intent deliveries the broker may push to this worker before they are acked:
    /// the prefetch is lowered to WORKER_MAX_INFLIGHT_BYTES / WORKER_MAX_MESSAGE_BYTES when
    /// that is smaller (with a warning). At least WORKER_MAX_MESSAGE_BYTES.
    #[arg(long, env = "WORKER_MAX_INFLIGHT_BYTES", value_name = "WORKER_MAX_INFLIGHT_BYTES",
          default_value_t = 64 * 1024 * 1024, value_parser = clap::value_parser!(u64).range(1024..))]
    pub max_inflight_bytes: u64,
    /// Deliveries the worker starts processing before it dead-letters the message itself (its
    /// own count in Postgres; at least 1).
    #[arg(long, env = "WORKER_DELIVERY_LIMIT", value_name = "WORKER_DELIVERY_LIMIT",
          default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub delivery_limit: u32,
    /// The intents queue's x-delivery-limit, the broker's looser backstop [default: max(4 x
    /// WORKER_DELIVERY_LIMIT, 20)].
    #[arg(
        long,
        env = "WORKER_QUEUE_DELIVERY_LIMIT",
        value_name = "WORKER_QUEUE_DELIVERY_LIMIT"
    )]
    pub queue_delivery_limit: Option<u32>,
    /// Seconds a claim owns a dispatch or recovery round before other workers treat its owner
    /// as crashed (at least 1).
    #[arg(long, env = "WORKER_LEASE_SECS", value_name = "WORKER_LEASE_SECS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub lease_secs: u64,
    /// Recovery scheduler tick in milliseconds (minimum 10).
    #[arg(
        long,
        env = "WORKER_RECOVERY_INTERVAL_MS",
        value_name = "WORKER_RECOVERY_INTERVAL_MS",
        default_value_t = 1000
    )]
    pub recovery_interval_ms: u64,
    /// Dispatches and recovery rounds running at once in this process (minimum 1).
    #[arg(
        long,
        env = "WORKER_MAX_IN_FLIGHT",
        value_name = "WORKER_MAX_IN_FLIGHT",
        default_value_t = 256
    )]
    pub max_in_flight: usize,
    /// Identity in leases, history and the AMQP connection name; must differ per process
    /// [default: $HOSTNAME-<pid>].
    #[arg(long, env = "WORKER_ID", value_name = "WORKER_ID")]
    pub worker_id: Option<String>,
    /// Seconds in-flight work gets to record its outcome after SIGTERM (at least 1; see
    /// "Graceful shutdown" in docs/operations.md for the whole budget).
    #[arg(long, env = "WORKER_SHUTDOWN_GRACE_SECS", value_name = "WORKER_SHUTDOWN_GRACE_SECS",
          default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub shutdown_grace_secs: u64,
    /// Seconds private data (arguments, receipts) of finished operations is kept (30 days).
    #[arg(long, env = "WORKER_RETENTION_SECS", value_name = "WORKER_RETENTION_SECS",
          default_value_t = 30 * 86_400)]
    pub retention_secs: u64,
    /// Seconds tombstones (key, fingerprint, final state) are kept (365 days); must not be
    /// shorter than any tool's replay_window_secs.
    #[arg(long, env = "WORKER_TOMBSTONE_RETENTION_SECS",
          value_name = "WORKER_TOMBSTONE_RETENTION_SECS", default_value_t = 365 * 86_400)]
    pub tombstone_retention_secs: u64,
    /// Postgres pool size (minimum 2). Replicas x this (+ admin connections) must stay under
    /// the server's max_connections.
    #[arg(
        long,
        env = "WORKER_DB_POOL_SIZE",
        value_name = "WORKER_DB_POOL_SIZE",
        default_value_t = 10
    )]
    pub db_pool_size: u32,
    /// Seconds a task waits for a free pool connection before the call fails (at least 1).
    #[arg(long, env = "WORKER_DB_ACQUIRE_TIMEOUT_SECS",
          value_name = "WORKER_DB_ACQUIRE_TIMEOUT_SECS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub db_acquire_timeout_secs: u64,
    /// `worker run` applies the migrations at start (true/false, 1/0, yes/no); false only
    /// checks they are applied (a separate `worker migrate` owns them).
    #[arg(long, env = "WORKER_MIGRATE", value_name = "WORKER_MIGRATE", default_value = "true",
          action = clap::ArgAction::Set, value_parser = parse_bool)]
    pub migrate: bool,
    /// AMQP heartbeat in seconds asked for on both broker connections (0 = the broker's).
    #[arg(
        long,
        env = "WORKER_AMQP_HEARTBEAT_SECS",
        value_name = "WORKER_AMQP_HEARTBEAT_SECS",
        default_value_t = 10
    )]
    pub amqp_heartbeat_secs: u16,
    /// Prometheus listener (`/metrics`, `/livez`, `/readyz`); `off` or `none` disables it.
    #[arg(long, env = "METRICS_ADDR", value_name = "METRICS_ADDR", default_value = "127.0.0.1:9464",
          value_parser = parse_listen)]
    pub metrics_addr: Listen,
    /// Admin/status API listener; `off` or `none` disables it. It only starts with
    /// WORKER_ADMIN_TOKEN or WORKER_TENANT_TOKENS.
    #[arg(long, env = "WORKER_ADMIN_ADDR", value_name = "WORKER_ADMIN_ADDR",
          default_value = "127.0.0.1:8080", value_parser = parse_listen)]
    pub admin_addr: Listen,
    /// Milliseconds a client of each HTTP listener (metrics/health, admin API) gets to send a
    /// complete request head, from the accept or from the first byte of a later request on a
    /// keep-alive connection; then the connection is closed (at least 1).
    #[arg(long, env = "WORKER_HTTP_HEADER_TIMEOUT_MS", value_name = "WORKER_HTTP_HEADER_TIMEOUT_MS",
          default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub http_header_timeout_ms: u64,
    /// Milliseconds a keep-alive connection of each HTTP listener may sit idle (no request in
    /// flight, no traffic) before it is closed (at least 1).
    #[arg(long, env = "WORKER_HTTP_IDLE_TIMEOUT_MS", value_name = "WORKER_HTTP_IDLE_TIMEOUT_MS",
          default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub http_idle_timeout_ms: u64,
    /// Connections each HTTP listener (metrics/health, admin API) keeps open at once; more wait
    /// in the kernel's backlog without taking a descriptor (at least 1).
    #[arg(long, env = "WORKER_HTTP_MAX_CONNECTIONS", value_name = "WORKER_HTTP_MAX_CONNECTIONS",
          default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub http_max_connections: u32,
    /// Bearer token for every admin API route (at least 16 characters).
    #[arg(
        long,
        env = "WORKER_ADMIN_TOKEN",
        value_name = "WORKER_ADMIN_TOKEN",
        hide_env_values = true
    )]
    pub admin_token: Option<String>,
    /// `tenant=token,tenant2=token2` (tokens of 8+ characters): read-only status of that
    /// tenant's operations.
    #[arg(
        long,
        env = "WORKER_TENANT_TOKENS",
        value_name = "WORKER_TENANT_TOKENS",
        hide_env_values = true
    )]
    pub tenant_tokens: Option<String>,
    /// Topic exchange agents publish intents to (the publisher reads the same variable)
    /// [default: intents].
    #[arg(long, env = "INTENTS_EXCHANGE", value_name = "INTENTS_EXCHANGE")]
    pub intents_exchange: Option<String>,
    /// Deprecated alias of INTENTS_EXCHANGE (a warning is logged; both set differently is an
    /// error).
    #[arg(
        long,
        env = "WORKER_INTENTS_EXCHANGE",
        value_name = "WORKER_INTENTS_EXCHANGE"
    )]
    pub worker_intents_exchange: Option<String>,
    /// Quorum queue the workers consume.
    #[arg(
        long,
        env = "WORKER_INTENTS_QUEUE",
        value_name = "WORKER_INTENTS_QUEUE",
        default_value = "intents"
    )]
    pub intents_queue: String,
    /// Topic exchange result events go to (the publisher reads the same variable)
    /// [default: results].
    #[arg(long, env = "RESULTS_EXCHANGE", value_name = "RESULTS_EXCHANGE")]
    pub results_exchange: Option<String>,
    /// Deprecated alias of RESULTS_EXCHANGE (a warning is logged; both set differently is an
    /// error).
    #[arg(
        long,
        env = "WORKER_RESULTS_EXCHANGE",
        value_name = "WORKER_RESULTS_EXCHANGE"
    )]
    pub worker_results_exchange: Option<String>,
    /// Dead-letter exchange (topic).
    #[arg(
        long,
        env = "WORKER_DEAD_LETTER_EXCHANGE",
        value_name = "WORKER_DEAD_LETTER_EXCHANGE",
        default_value = "intents.dlx"
    )]
    pub dead_letter_exchange: String,
    /// Quorum queue bound `#` to the dead-letter exchange.
    #[arg(
        long,
        env = "WORKER_DEAD_LETTER_QUEUE",
        value_name = "WORKER_DEAD_LETTER_QUEUE",
        default_value = "intents.dead"
    )]
    pub dead_letter_queue: String,
    /// Declare the exchanges and queues at start (true/false, 1/0, yes/no); false only checks
    /// them passively (broker managed as code).
    #[arg(long, env = "WORKER_DECLARE_TOPOLOGY", value_name = "WORKER_DECLARE_TOPOLOGY",
          default_value = "true", action = clap::ArgAction::Set, value_parser = parse_bool)]
    pub declare_topology: bool,
    /// Log format on stderr (the filter is RUST_LOG, default info,lapin=warn,sqlx=warn).
    #[arg(long, env = "WORKER_LOG_FORMAT", value_name = "WORKER_LOG_FORMAT", default_value = "text",
          value_parser = ["text", "json"])]
    pub log_format: String,
}

/// A listener address, or none (`off`, `none`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Listen(pub Option<SocketAddr>);

fn parse_listen(raw: &str) -> Result<Listen, String> {
    match raw.trim() {
        "off" | "none" => Ok(Listen(None)),
        v => v
            .parse()
            .map(|a| Listen(Some(a)))
            .map_err(|e: std::net::AddrParseError| {
                format!("{e} (expected host:port, off or none)")
            }),
    }
}

fn parse_bool(raw: &str) -> Result<bool, String> {
    match raw.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        _ => Err("expected true or false (also 1/0, yes/no)".into()),
    }
}

/// Makes an environment variable that is set but blank count as unset for every argument of
/// `cmd` and its subcommands, as the documentation promises (compose files and Helm values
/// often render `FOO=`). clap itself would hand the empty string to the value parser.
pub fn blank_env_is_unset(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|arg| {
        let blank = arg
            .get_env()
            .and_then(std::env::var_os)
            .is_some_and(|v| v.to_string_lossy().trim().is_empty());
        if blank {
            arg.env(None::<&'static str>)
        } else {
            arg
        }
    })
    .mut_subcommands(blank_env_is_unset)
}

/// Resolves a shared name and its deprecated worker-only alias.
fn aliased(
    name: &'static str,
    value: Option<String>,
    alias: &'static str,
    alias_value: Option<String>,
    default: &str,
    warnings: &mut Vec<String>,
) -> Result<String, ConfigError> {
    match (value, alias_value) {
        (Some(v), Some(a)) if v != a => Err(ConfigError::Conflict {
            name,
            value: v,
            alias,
            alias_value: a,
        }),
        (v, Some(a)) => {
            warnings.push(format!(
                "{alias} is deprecated; set {name} (read by the worker and the publisher) instead"
            ));
            Ok(v.unwrap_or(a))
        }
        (Some(v), None) => Ok(v),
        (None, None) => Ok(default.to_string()),
    }
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

/// The prefetch that keeps the bytes the broker may push to this worker unacked within
/// `inflight` (prefetch counts messages, RabbitMQ ignores a byte prefetch): `prefetch` messages
/// of `message` bytes each, or fewer. `inflight` below `message` is refused.
fn bounded_prefetch(
    prefetch: u16,
    message: u64,
    inflight: u64,
    warnings: &mut Vec<String>,
) -> Result<u16, ConfigError> {
    if inflight < message {
        return Err(ConfigError::Invalid {
            name: "WORKER_MAX_INFLIGHT_BYTES",
            value: inflight.to_string(),
            reason: format!("must be at least WORKER_MAX_MESSAGE_BYTES ({message})"),
        });
    }
    let fits = u16::try_from(inflight / message).unwrap_or(u16::MAX);
    if fits < prefetch {
        warnings.push(format!(
            "WORKER_PREFETCH={prefetch} lowered to {fits}: {fits} messages of WORKER_MAX_MESSAGE_BYTES={message} fit WORKER_MAX_INFLIGHT_BYTES={inflight}"
        ));
        return Ok(fits);
    }
    Ok(prefetch)
}

/// Refuses a service URL that can never work, naming the variable, without its password.
fn check_url(name: &'static str, url: &str, schemes: &[&str]) -> Result<(), ConfigError> {
    kit::url::check(url, schemes).map_err(|reason| ConfigError::Invalid {
        name,
        value: kit::url::redact(url),
        reason,
    })
}

/// `EnvArgs` alone as a command, for [`Settings::from_env`].
#[derive(clap::Parser)]
#[command(name = "worker")]
struct EnvOnly {
    #[command(flatten)]
    env: EnvArgs,
}

impl Settings {
    /// Reads the settings from the process environment alone (no flags), as `worker run` does
    /// when it is given none.
    pub fn from_env() -> Result<Settings, ConfigError> {
        use clap::{CommandFactory as _, FromArgMatches as _};
        let usage = |e: clap::Error| ConfigError::Usage(e.to_string());
        let matches = blank_env_is_unset(EnvOnly::command())
            .try_get_matches_from(["worker"])
            .map_err(usage)?;
        Settings::from_args(EnvOnly::from_arg_matches(&matches).map_err(usage)?.env)
    }

    /// Builds the settings from parsed arguments, checking what clap cannot: secrets (whose
    /// values must not be echoed in an error) and the exchange aliases.
    pub fn from_args(a: EnvArgs) -> Result<Settings, ConfigError> {
        let admin_token = a.admin_token.filter(|t| !t.trim().is_empty());
        if let Some(t) = &admin_token {
            if t.len() < 16 {
                return Err(ConfigError::Invalid {
                    name: "WORKER_ADMIN_TOKEN",
                    value: "<redacted>".into(),
                    reason: "must be at least 16 characters".into(),
                });
            }
        }
        check_url("DATABASE_URL", &a.database_url, &["postgres", "postgresql"])?;
        check_url("AMQP_URL", &a.amqp_url, &["amqp", "amqps"])?;
        let mut warnings = Vec::new();
        let intents_exchange = aliased(
            "INTENTS_EXCHANGE",
            a.intents_exchange,
            "WORKER_INTENTS_EXCHANGE",
            a.worker_intents_exchange,
            "intents",
            &mut warnings,
        )?;
        let results_exchange = aliased(
            "RESULTS_EXCHANGE",
            a.results_exchange,
            "WORKER_RESULTS_EXCHANGE",
            a.worker_results_exchange,
            "results",
            &mut warnings,
        )?;
        let prefetch = bounded_prefetch(
            a.prefetch,
            a.max_message_bytes,
            a.max_inflight_bytes,
            &mut warnings,
        )?;
        let worker_id = a.worker_id.unwrap_or_else(|| {
            let host = std::env::var("HOSTNAME")
                .ok()
                .filter(|h| !h.trim().is_empty())
                .unwrap_or_else(|| "worker".into());
            format!("{host}-{}", std::process::id())
        });
        Ok(Settings {
            database_url: a.database_url,
            amqp_url: a.amqp_url,
            tools_path: a.tools,
            ca_file: a.ca_file,
            prefetch,
            max_message_bytes: a.max_message_bytes as usize,
            metrics_addr: a.metrics_addr.0,
            admin_addr: a.admin_addr.0,
            http_limits: kit::http::Limits {
                header_timeout: Duration::from_millis(a.http_header_timeout_ms),
                idle_timeout: Duration::from_millis(a.http_idle_timeout_ms),
                max_connections: a.http_max_connections as usize,
            },
            admin_token,
            tenant_tokens: parse_tenant_tokens(a.tenant_tokens)?,
            topology: Topology {
                intents_exchange,
                intents_queue: a.intents_queue,
                results_exchange,
                dead_letter_exchange: a.dead_letter_exchange,
                dead_letter_queue: a.dead_letter_queue,
                delivery_limit: a.delivery_limit,
                queue_delivery_limit: a
                    .queue_delivery_limit
                    .unwrap_or_else(|| Topology::default_queue_delivery_limit(a.delivery_limit)),
            },
            lease: Duration::from_secs(a.lease_secs),
            recovery_interval: Duration::from_millis(a.recovery_interval_ms.max(10)),
            max_in_flight: a.max_in_flight.max(1),
            worker_id,
            shutdown_grace: Duration::from_secs(a.shutdown_grace_secs),
            retention: Duration::from_secs(a.retention_secs),
            tombstone_retention: Duration::from_secs(a.tombstone_retention_secs),
            db_pool_size: a.db_pool_size.max(2),
            db_acquire_timeout: Duration::from_secs(a.db_acquire_timeout_secs),
            migrate: a.migrate,
            log_json: a.log_format == "json",
            amqp_heartbeat_secs: a.amqp_heartbeat_secs,
            declare_topology: a.declare_topology,
            warnings,
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
            for (header, value) in t.headers.iter_mut() {
                expand(&format!("headers.{header}"), value)?;
            }
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

/// Expands `${VAR}` and `${VAR:-default}` in one string value of the tools file (values, not
/// the file text, so a variable cannot inject TOML). `$$` is a literal `$` (write `$${` for a
/// literal `${`); any other `$` stays as it is. A variable that is unset or empty takes the
/// default; without one it is an error naming the variable, so a missing secret stops
/// start-up instead of sending an empty API key.
pub fn interpolate(value: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(body) = after.strip_prefix('{') {
            let end = body.find('}').ok_or_else(|| {
                format!("unterminated ${{ in {value:?} (write $${{ for a literal ${{)")
            })?;
            let (name, default) = match body[..end].split_once(":-") {
                Some((n, d)) => (n, Some(d)),
                None => (&body[..end], None),
            };
            let valid = !name.is_empty()
                && !name.starts_with(|c: char| c.is_ascii_digit())
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(format!(
                    "${{{}}} is not a variable reference (names use letters, digits and _; \
                     write $${{ for a literal ${{)",
                    &body[..end]
                ));
            }
            match (env(name).filter(|v| !v.is_empty()), default) {
                (Some(v), _) => out.push_str(&v),
                (None, Some(d)) => out.push_str(d),
                (None, None) => {
                    return Err(format!(
                        "environment variable {name} is not set (or empty) and ${{{name}}} has \
                         no default (write ${{{name}:-default}} for one)"
                    ))
                }
            }
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok(out)
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
    fn interpolation_expands_defaults_and_escapes() {
        let env = |name: &str| match name {
            "KEY" => Some("s3cret".to_string()),
            "EMPTY" => Some(String::new()),
            _ => None,
        };
        let ok = |v: &str| interpolate(v, &env).unwrap();
        assert_eq!(ok("Bearer ${KEY}"), "Bearer s3cret");
        assert_eq!(ok("${KEY}${KEY}"), "s3crets3cret");
        assert_eq!(ok("${MISSING:-http://a:1}/x"), "http://a:1/x");
        assert_eq!(ok("${EMPTY:-fallback}"), "fallback");
        assert_eq!(ok("${KEY:-unused}"), "s3cret");
        assert_eq!(ok("${MISSING:-}"), "");
        assert_eq!(ok("$${KEY} costs $5 or $$5"), "${KEY} costs $5 or $5");
        assert_eq!(ok("{tenant}:{action_id}"), "{tenant}:{action_id}");
        let err = interpolate("Bearer ${MISSING}", &env).unwrap_err();
        assert!(err.contains("MISSING is not set"), "{err}");
        let err = interpolate("${EMPTY}", &env).unwrap_err();
        assert!(err.contains("EMPTY is not set (or empty)"), "{err}");
        assert!(interpolate("${KEY", &env)
            .unwrap_err()
            .contains("unterminated"));
        assert!(interpolate("${1X}", &env)
            .unwrap_err()
            .contains("not a variable"));
        // A value cannot inject TOML or another reference: it is inserted as text.
        let env2 = |_: &str| Some("\"\nurl = \"x\" ${KEY}".to_string());
        assert_eq!(
            interpolate("${A}", &env2).unwrap(),
            "\"\nurl = \"x\" ${KEY}"
        );
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

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        env: EnvArgs,
    }

    fn from_flags(flags: &[&str]) -> Result<Settings, String> {
        use clap::Parser as _;
        let args = std::iter::once("worker").chain(flags.iter().copied());
        let cli = Cli::try_parse_from(args).map_err(|e| e.to_string())?;
        Settings::from_args(cli.env).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_match_the_documented_ones() {
        let s = from_flags(&["--database-url", "postgres://x"]).unwrap();
        assert_eq!(s.prefetch, 256);
        assert_eq!(s.topology.intents_exchange, "intents");
        assert_eq!(s.topology.results_exchange, "results");
        assert_eq!(s.topology.queue_delivery_limit, 20);
        assert_eq!(s.lease, Duration::from_secs(30));
        assert_eq!(s.shutdown_grace, Duration::from_secs(30));
        assert_eq!(s.db_pool_size, 10);
        assert_eq!(s.db_acquire_timeout, Duration::from_secs(10));
        assert_eq!(s.metrics_addr, Some("127.0.0.1:9464".parse().unwrap()));
        assert_eq!(s.http_limits.header_timeout, Duration::from_secs(10));
        assert_eq!(s.http_limits.idle_timeout, Duration::from_secs(60));
        assert_eq!(s.http_limits.max_connections, 256);
        assert!(s.migrate && s.declare_topology && !s.log_json);
        assert!(s.warnings.is_empty());
        let s = from_flags(&[
            "--database-url=postgres://x",
            "--migrate=no",
            "--declare-topology=1",
            "--metrics-addr=off",
        ])
        .unwrap();
        assert!(!s.migrate && s.declare_topology && s.metrics_addr.is_none());
    }

    #[test]
    fn bad_values_are_refused_naming_the_variable() {
        for (flag, var) in [
            ("--prefetch=0", "WORKER_PREFETCH"),
            ("--lease-secs=0", "WORKER_LEASE_SECS"),
            ("--migrate=sometimes", "WORKER_MIGRATE"),
            ("--admin-addr=nowhere", "WORKER_ADMIN_ADDR"),
            ("--log-format=xml", "WORKER_LOG_FORMAT"),
            (
                "--http-header-timeout-ms=0",
                "WORKER_HTTP_HEADER_TIMEOUT_MS",
            ),
            ("--http-idle-timeout-ms=soon", "WORKER_HTTP_IDLE_TIMEOUT_MS"),
            ("--http-max-connections=0", "WORKER_HTTP_MAX_CONNECTIONS"),
            ("--admin-token=short", "WORKER_ADMIN_TOKEN"),
            ("--tenant-tokens=north", "WORKER_TENANT_TOKENS"),
        ] {
            let err = from_flags(&["--database-url=postgres://x", flag]).unwrap_err();
            assert!(err.contains(var), "{flag}: {err}");
        }
        let err = from_flags(&["--admin-token=short-secret"]).unwrap_err();
        assert!(err.contains("DATABASE_URL"), "{err}");
        let err =
            from_flags(&["--database-url=postgres://x", "--admin-token=short-secret"]).unwrap_err();
        assert!(
            !err.contains("short-secret"),
            "a secret is never echoed: {err}"
        );
    }

    #[test]
    fn the_prefetch_is_lowered_to_what_the_in_flight_bytes_allow() {
        let s = from_flags(&["--database-url=postgres://x"]).unwrap();
        assert_eq!((s.prefetch, s.max_message_bytes), (256, 262144));
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
        let s = from_flags(&[
            "--database-url=postgres://x",
            "--max-message-bytes=4096",
            "--max-inflight-bytes=16384",
        ])
        .unwrap();
        assert_eq!(s.prefetch, 4);
        assert!(
            s.warnings[0].contains("WORKER_PREFETCH=256 lowered to 4"),
            "{:?}",
            s.warnings
        );
        let err = from_flags(&[
            "--database-url=postgres://x",
            "--max-message-bytes=4096",
            "--max-inflight-bytes=2048",
        ])
        .unwrap_err();
        assert!(err.contains("WORKER_MAX_INFLIGHT_BYTES"), "{err}");
        let err =
            from_flags(&["--database-url=postgres://x", "--max-message-bytes=300000"]).unwrap_err();
        assert!(err.contains("WORKER_MAX_MESSAGE_BYTES"), "{err}");
    }

    #[test]
    fn the_old_exchange_names_are_deprecated_aliases() {
        let s =
            from_flags(&["--database-url=postgres://x", "--worker-intents-exchange=a"]).unwrap();
        assert_eq!(s.topology.intents_exchange, "a");
        assert!(s.warnings[0].contains("WORKER_INTENTS_EXCHANGE is deprecated"));
        let s = from_flags(&[
            "--database-url=postgres://x",
            "--results-exchange=r",
            "--worker-results-exchange=r",
        ])
        .unwrap();
        assert_eq!(s.topology.results_exchange, "r");
        let err = from_flags(&[
            "--database-url=postgres://x",
            "--intents-exchange=a",
            "--worker-intents-exchange=b",
        ])
        .unwrap_err();
        assert!(
            err.contains("INTENTS_EXCHANGE=\"a\"") && err.contains("WORKER_INTENTS_EXCHANGE=\"b\""),
            "{err}"
        );
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
            max_message_bytes: protocol::MAX_INTENT_BYTES,
            metrics_addr: None,
            admin_addr: None,
            http_limits: kit::http::Limits::DEFAULT,
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
            db_acquire_timeout: Duration::from_secs(10),
            ca_file: None,
            warnings: Vec::new(),
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
