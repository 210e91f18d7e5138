//! The environment settings: every option of `worker run` is also read from the variable shown
//! in `worker run --help`, which is how containers, the tests and the Python client configure
//! it. clap enforces each value's range (a value below a minimum exits 2 naming the variable);
//! [`Settings::from_args`] checks what needs more than one value or must not echo a secret.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::ConfigError;

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
    /// `WORKER_APPROVER_TOKENS`: approver name -> token.
    pub approver_tokens: BTreeMap<String, String>,
    pub topology: Topology,
    /// How long a claim owns a dispatch before recovery treats it as crashed.
    pub lease: Duration,
    /// The intents queues consumed (shards, and an old layout being drained).
    pub shards: crate::amqp::topology::Shards,
    /// How long a receipt the downstream returned is kept in memory while the ledger cannot
    /// record it (past the lease, through the receipt path).
    pub receipt_keep: Duration,
    /// How often the recovery scheduler looks for due work.
    pub recovery_interval: Duration,
    /// The least time between the starts of two intake batches while the intake is saturated
    /// (`WORKER_BATCH_PACE_MS`); the later stages are not paced.
    pub batch_pace: Duration,
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
    /// `WORKER_TRACE_URL`: the trace viewer template, with `{trace_id}`.
    pub trace_url: Option<String>,
    /// AMQP heartbeat asked of the broker, seconds (0 = off): how soon a silent link is lost.
    pub amqp_heartbeat_secs: u16,
    /// Declare the broker topology at start-up (`WORKER_DECLARE_TOPOLOGY`, default true); with
    /// false the broker is managed as code and the worker only checks, passively, that the
    /// exchanges and queues it uses exist.
    pub declare_topology: bool,
    /// The operator console on the admin listener.
    pub console: ConsoleSettings,
    /// Deprecation notices found while reading the settings, logged once logging is set up.
    pub warnings: Vec<String>,
}

/// The operator console's settings (docs/console.md).
#[derive(Debug, Clone)]
pub struct ConsoleSettings {
    /// Serve `/ui` on the admin listener (`WORKER_CONSOLE`).
    pub enabled: bool,
    /// `WORKER_CONSOLE_SECRET`: the key sessions are signed with; None derives it from the
    /// tokens.
    pub secret: Option<String>,
    /// How long a sign-in lasts.
    pub session: Duration,
    /// Mark the session cookie `Secure` on every answer (the console is behind TLS).
    pub secure_cookie: bool,
    /// Unresolved operations older than this are counted as past the alert threshold.
    pub alert_age: Duration,
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
    /// RabbitMQ URL (`amqp://` or `amqps://`; `?heartbeat=` overrides WORKER_AMQP_HEARTBEAT_SECS),
    /// or one per node of a cluster, comma-separated: each (re)connect tries them in a fresh
    /// random order and keeps the first that accepts.
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
    /// Quorum queues the intents are spread over (1 to 64): 1 is the single queue
    /// WORKER_INTENTS_QUEUE; N > 1 declares `<queue>.0 … <queue>.N-1` behind a consistent-hash
    /// exchange on the message id (RabbitMQ's rabbitmq_consistent_hash_exchange plugin). Every
    /// worker consumes every shard, with WORKER_PREFETCH per shard.
    #[arg(long, env = "WORKER_INTENT_SHARDS", value_name = "WORKER_INTENT_SHARDS",
          default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub intent_shards: u16,
    /// While changing WORKER_INTENT_SHARDS: the old shard count, whose queues are unbound (no
    /// new intents reach them) and consumed until empty. Unset when no change is under way.
    #[arg(long, env = "WORKER_DRAIN_SHARDS", value_name = "WORKER_DRAIN_SHARDS",
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub drain_shards: Option<u16>,
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
    /// Seconds a receipt the downstream returned is kept, and its recording retried, while the
    /// ledger cannot take it (an outage, a failover); at least the lease.
    #[arg(long, env = "WORKER_RECEIPT_KEEP_SECS", value_name = "WORKER_RECEIPT_KEEP_SECS",
          default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    pub receipt_keep_secs: u64,
    /// Recovery scheduler tick in milliseconds (at least 10).
    #[arg(long, env = "WORKER_RECOVERY_INTERVAL_MS", value_name = "WORKER_RECOVERY_INTERVAL_MS",
          default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..))]
    pub recovery_interval_ms: u64,
    /// Milliseconds (0 to 100) between the starts of two intake batches while the intake is
    /// saturated (its last batch was full, or deliveries waited while it ran); 0 starts each
    /// batch as soon as the last one ended. An intake that keeps up goes at once; the send
    /// fence, the completion and the result relay are not paced.
    #[arg(long, env = "WORKER_BATCH_PACE_MS", value_name = "WORKER_BATCH_PACE_MS",
          default_value_t = 5, value_parser = clap::value_parser!(u64).range(0..=100))]
    pub batch_pace_ms: u64,
    /// Dispatches and recovery rounds running at once in this process (at least 1).
    // 1024, not 256: a backlog drains about a tenth faster with bigger send-fence and
    // completion batches (docs/benchmarks.md, "Defaults the figures depend on"); connections
    // to a fast downstream are reused, so far fewer than this are open at once.
    #[arg(long, env = "WORKER_MAX_IN_FLIGHT", value_name = "WORKER_MAX_IN_FLIGHT",
          default_value_t = 1024,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_in_flight: usize,
    /// Identity in leases, history and the AMQP connection name; must differ per process
    /// [default: $HOSTNAME-<pid>].
    // The text is `--help`'s, where <pid> is a placeholder, not an HTML tag.
    #[allow(rustdoc::invalid_html_tags)]
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
    /// Postgres pool size (at least 2). Replicas x this (+ admin connections) must stay under
    /// the server's max_connections.
    #[arg(long, env = "WORKER_DB_POOL_SIZE", value_name = "WORKER_DB_POOL_SIZE",
          default_value_t = 10, value_parser = clap::value_parser!(u32).range(2..))]
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
        default_value_t = kit::amqp::DEFAULT_HEARTBEAT_SECS
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
    /// Milliseconds a client of each HTTP listener gets to send a request's whole body, from its
    /// complete head; a body still incomplete then is answered 408 and its connection closed
    /// (at least 1).
    #[arg(long, env = "WORKER_HTTP_BODY_TIMEOUT_MS", value_name = "WORKER_HTTP_BODY_TIMEOUT_MS",
          default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub http_body_timeout_ms: u64,
    /// Bearer token for every admin API route (at least 16 characters).
    #[arg(
        long,
        env = "WORKER_ADMIN_TOKEN",
        value_name = "WORKER_ADMIN_TOKEN",
        hide_env_values = true
    )]
    pub admin_token: Option<String>,
    /// `tenant=token,tenant2=token2` (tokens of 16+ characters): read-only status of that
    /// tenant's operations.
    #[arg(
        long,
        env = "WORKER_TENANT_TOKENS",
        value_name = "WORKER_TENANT_TOKENS",
        hide_env_values = true
    )]
    pub tenant_tokens: Option<String>,
    /// `name=token,name2=token2` (tokens of 16+ characters): the people who may approve or
    /// reject intents that wait for approval (the API's approval routes only); each approval
    /// is recorded under the token's name.
    #[arg(
        long,
        env = "WORKER_APPROVER_TOKENS",
        value_name = "WORKER_APPROVER_TOKENS",
        hide_env_values = true
    )]
    pub approver_tokens: Option<String>,
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
    /// The trace viewer's address for one trace, with `{trace_id}` where the id goes (e.g.
    /// `http://jaeger:16686/trace/{trace_id}`): the status and admin API and `worker ops` then
    /// give a link beside each operation's `trace_id`. Unset: the id alone.
    #[arg(long, env = "WORKER_TRACE_URL", value_name = "WORKER_TRACE_URL",
          value_parser = parse_trace_url)]
    pub trace_url: Option<String>,
    /// Serve the operator console under /ui on the admin listener (true/false, 1/0, yes/no);
    /// it needs WORKER_ADMIN_TOKEN or WORKER_TENANT_TOKENS, like the API.
    #[arg(long, env = "WORKER_CONSOLE", value_name = "WORKER_CONSOLE", default_value = "true",
          action = clap::ArgAction::Set, value_parser = parse_bool)]
    pub console: bool,
    /// Key the console's session cookies are signed with (at least 32 characters; the same on
    /// every worker behind one address). Unset: derived from WORKER_ADMIN_TOKEN and
    /// WORKER_TENANT_TOKENS, so rotating a token ends every session.
    #[arg(
        long,
        env = "WORKER_CONSOLE_SECRET",
        value_name = "WORKER_CONSOLE_SECRET",
        hide_env_values = true
    )]
    pub console_secret: Option<String>,
    /// Seconds a console sign-in lasts (60 to 604800).
    #[arg(long, env = "WORKER_CONSOLE_SESSION_SECS", value_name = "WORKER_CONSOLE_SESSION_SECS",
          default_value_t = 8 * 3600, value_parser = clap::value_parser!(u64).range(60..=604_800))]
    pub console_session_secs: u64,
    /// Mark the console's cookies Secure on every answer (true when a TLS proxy is in front;
    /// a request with `X-Forwarded-Proto: https` gets Secure cookies anyway).
    #[arg(long, env = "WORKER_CONSOLE_SECURE_COOKIE", value_name = "WORKER_CONSOLE_SECURE_COOKIE",
          default_value = "false", action = clap::ArgAction::Set, value_parser = parse_bool)]
    pub console_secure_cookie: bool,
    /// The console's overview counts unresolved operations older than this many seconds as
    /// past the alert threshold (IntentUnresolvedTooLong's 15 minutes).
    #[arg(long, env = "WORKER_CONSOLE_ALERT_AGE_SECS", value_name = "WORKER_CONSOLE_ALERT_AGE_SECS",
          default_value_t = 900, value_parser = clap::value_parser!(u64).range(1..))]
    pub console_alert_age_secs: u64,
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

/// A trace viewer template: an http(s) URL naming `{trace_id}`.
fn parse_trace_url(v: &str) -> Result<String, String> {
    let v = v.trim();
    if !(v.starts_with("http://") || v.starts_with("https://")) {
        return Err("must be an http:// or https:// URL".into());
    }
    if !v.contains("{trace_id}") {
        return Err("must contain {trace_id}, where the trace id goes".into());
    }
    Ok(v.to_string())
}

fn parse_bool(raw: &str) -> Result<bool, String> {
    match raw.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        _ => Err("expected true or false (also 1/0, yes/no)".into()),
    }
}

pub use kit::cli::blank_env_is_unset;

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
    /// Whether the admin API serves: some token can use it.
    pub fn api_enabled(&self) -> bool {
        self.admin_token.is_some()
            || !self.tenant_tokens.is_empty()
            || !self.approver_tokens.is_empty()
    }
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
    ///
    /// The first failure is returned, checked in this order: the admin token, the service URLs
    /// (`check_urls`), the exchange names and their aliases (`topology`), the in-flight
    /// bytes (`bounded_prefetch`), the receipt keep against the lease
    /// (`check_receipt_keep`), the tenant tokens, the console secret.
    pub fn from_args(mut a: EnvArgs) -> Result<Settings, ConfigError> {
        let admin_token = super::auth::admin_token(a.admin_token.take())?;
        check_urls(&a.database_url, &a.amqp_url)?;
        let mut warnings = Vec::new();
        let topology = topology(&a, &mut warnings)?;
        let shards = crate::amqp::topology::Shards {
            count: a.intent_shards,
            draining: a.drain_shards.filter(|old| *old != a.intent_shards),
        };
        let prefetch = bounded_prefetch(
            a.prefetch,
            a.max_message_bytes,
            inflight_per_queue(a.max_inflight_bytes, a.max_message_bytes, &shards),
            &mut warnings,
        )?;
        check_receipt_keep(a.receipt_keep_secs, a.lease_secs)?;
        let worker_id = a.worker_id.take().unwrap_or_else(default_worker_id);
        let tenant_tokens = super::auth::parse_tenant_tokens(a.tenant_tokens.take())?;
        let approver_tokens = super::auth::parse_approver_tokens(a.approver_tokens.take())?;
        let console = ConsoleSettings {
            enabled: a.console,
            secret: super::auth::console_secret(a.console_secret.take())?,
            session: Duration::from_secs(a.console_session_secs),
            secure_cookie: a.console_secure_cookie,
            alert_age: Duration::from_secs(a.console_alert_age_secs),
        };
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
                body_timeout: Duration::from_millis(a.http_body_timeout_ms),
            },
            admin_token,
            tenant_tokens,
            approver_tokens,
            topology,
            lease: Duration::from_secs(a.lease_secs),
            shards,
            receipt_keep: Duration::from_secs(a.receipt_keep_secs),
            recovery_interval: Duration::from_millis(a.recovery_interval_ms),
            batch_pace: Duration::from_millis(a.batch_pace_ms),
            max_in_flight: a.max_in_flight,
            worker_id,
            shutdown_grace: Duration::from_secs(a.shutdown_grace_secs),
            retention: Duration::from_secs(a.retention_secs),
            tombstone_retention: Duration::from_secs(a.tombstone_retention_secs),
            db_pool_size: a.db_pool_size,
            db_acquire_timeout: Duration::from_secs(a.db_acquire_timeout_secs),
            migrate: a.migrate,
            log_json: a.log_format == "json",
            trace_url: a.trace_url,
            amqp_heartbeat_secs: a.amqp_heartbeat_secs,
            declare_topology: a.declare_topology,
            console,
            warnings,
        })
    }
}

/// Refuses a `DATABASE_URL`, then an `AMQP_URL` (a comma-separated list), that can never work.
fn check_urls(database_url: &str, amqp_url: &str) -> Result<(), ConfigError> {
    check_url("DATABASE_URL", database_url, &["postgres", "postgresql"])?;
    kit::url::check_list(amqp_url, &["amqp", "amqps"]).map_err(|reason| ConfigError::Invalid {
        name: "AMQP_URL",
        value: kit::url::redact_list(amqp_url),
        reason,
    })
}

/// The broker names: the two shared exchange names, each resolved against its deprecated
/// worker-only alias ([`aliased`]; intents first), and the worker's own queues and limits.
fn topology(a: &EnvArgs, warnings: &mut Vec<String>) -> Result<Topology, ConfigError> {
    let intents_exchange = aliased(
        "INTENTS_EXCHANGE",
        a.intents_exchange.clone(),
        "WORKER_INTENTS_EXCHANGE",
        a.worker_intents_exchange.clone(),
        "intents",
        warnings,
    )?;
    let results_exchange = aliased(
        "RESULTS_EXCHANGE",
        a.results_exchange.clone(),
        "WORKER_RESULTS_EXCHANGE",
        a.worker_results_exchange.clone(),
        "results",
        warnings,
    )?;
    Ok(Topology {
        intents_exchange,
        intents_queue: a.intents_queue.clone(),
        results_exchange,
        dead_letter_exchange: a.dead_letter_exchange.clone(),
        dead_letter_queue: a.dead_letter_queue.clone(),
        delivery_limit: a.delivery_limit,
        queue_delivery_limit: a
            .queue_delivery_limit
            .unwrap_or_else(|| Topology::default_queue_delivery_limit(a.delivery_limit)),
    })
}

/// The in-flight bytes one consumed queue may hold unacked: the prefetch is per queue, and
/// `inflight` is shared among the queues consumed (the shards, and an old layout being
/// drained: a sharded old layout's queues are the new one's, a single old queue is one more).
/// Never below one message of `message` bytes, unless `inflight` itself is
/// ([`bounded_prefetch`] refuses that).
fn inflight_per_queue(inflight: u64, message: u64, shards: &crate::amqp::topology::Shards) -> u64 {
    let queues = match shards.draining {
        Some(old) if old > 1 && shards.count > 1 => shards.count.max(old),
        Some(old) => shards.count + old,
        None => shards.count,
    } as u64;
    (inflight / queues).max(message.min(inflight))
}

/// A receipt must be kept in memory at least as long as a claim lasts.
fn check_receipt_keep(receipt_keep_secs: u64, lease_secs: u64) -> Result<(), ConfigError> {
    if receipt_keep_secs < lease_secs {
        return Err(ConfigError::Invalid {
            name: "WORKER_RECEIPT_KEEP_SECS",
            value: receipt_keep_secs.to_string(),
            reason: format!("must be at least WORKER_LEASE_SECS ({lease_secs})"),
        });
    }
    Ok(())
}

/// `WORKER_ID` unset: `HOSTNAME` (else `worker`) and the process id.
fn default_worker_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.trim().is_empty())
        .unwrap_or_else(|| "worker".into());
    format!("{host}-{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(s.max_in_flight, 1024);
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
        assert!(s.console.enabled && s.console.secret.is_none() && !s.console.secure_cookie);
        assert_eq!(s.console.session, Duration::from_secs(8 * 3600));
        assert_eq!(s.console.alert_age, Duration::from_secs(900));
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
            ("--recovery-interval-ms=9", "WORKER_RECOVERY_INTERVAL_MS"),
            ("--max-in-flight=0", "WORKER_MAX_IN_FLIGHT"),
            ("--batch-pace-ms=101", "WORKER_BATCH_PACE_MS"),
            ("--batch-pace-ms=5ms", "WORKER_BATCH_PACE_MS"),
            ("--db-pool-size=1", "WORKER_DB_POOL_SIZE"),
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
            ("--receipt-keep-secs=29", "WORKER_RECEIPT_KEEP_SECS"),
            ("--console-secret=too-short", "WORKER_CONSOLE_SECRET"),
            ("--console-session-secs=59", "WORKER_CONSOLE_SESSION_SECS"),
            ("--console=maybe", "WORKER_CONSOLE"),
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
    fn the_in_flight_bytes_are_shared_among_the_queues_consumed() {
        use crate::amqp::topology::Shards;
        const MB: u64 = 1 << 20;
        // (shards, draining, in-flight bytes, message bytes, bytes per queue)
        let cases: &[(u16, Option<u16>, u64, u64, u64)] = &[
            (1, None, 64 * MB, MB, 64 * MB),
            (4, None, 64 * MB, MB, 16 * MB),
            // Draining one old queue into shards: one queue more.
            (4, Some(1), 64 * MB, MB, 64 * MB / 5),
            // Sharded into sharded: the same queues, the larger count.
            (4, Some(8), 64 * MB, MB, 8 * MB),
            (8, Some(4), 64 * MB, MB, 8 * MB),
            // Back to one queue from shards: the old ones and the new one.
            (1, Some(4), 64 * MB, MB, 64 * MB / 5),
            // Never below one message, unless the in-flight bytes are (refused later).
            (100, None, 64 * MB, MB, MB),
            (1, None, MB / 2, MB, MB / 2),
        ];
        for &(count, draining, inflight, message, want) in cases {
            let shards = Shards { count, draining };
            assert_eq!(
                inflight_per_queue(inflight, message, &shards),
                want,
                "{shards:?}, {inflight} in flight, {message} per message"
            );
        }
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
}
