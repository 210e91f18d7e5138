//! The `publisher` command line: `send` (optionally `--wait`), `wait`, `follow`, `migrate`,
//! `relay` and `mcp`, and the exit codes scripts rely on.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};

use crate::wait::{Answer, AnswerConfig, StatusApi, WaitError};
use crate::{Follower, Outbox, PublishError, Publisher, Relay, RelayConfig};

/// Exit codes of `send --wait` and `wait` (docs/agents.md, "Waiting for one action's answer").
pub mod exit {
    pub const SUCCEEDED: i32 = 0;
    /// Any other error (broker, database, ...).
    pub const ERROR: i32 = 1;
    /// Bad arguments or settings.
    pub const USAGE: i32 = 2;
    /// No answer at all before the timeout (neither the queue nor the status API).
    pub const NO_ANSWER: i32 = 3;
    /// Handed to the broker, its confirm never arrived: it may or may not be queued; sending it
    /// again under the same key is safe.
    pub const IN_DOUBT: i32 = 4;
    pub const PENDING: i32 = 10;
    pub const FAILED: i32 = 11;
    pub const REJECTED: i32 = 12;
}

/// An error in the arguments or settings: exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// The error and its causes on one line, each cause once ([`kit::errors::chain`]).
pub fn error_chain(error: &anyhow::Error) -> String {
    kit::errors::chain(error.as_ref())
}

/// The exit code for an error returned by [`run`].
pub fn exit_code(error: &anyhow::Error) -> i32 {
    if error.downcast_ref::<UsageError>().is_some() {
        exit::USAGE
    } else if matches!(
        error.downcast_ref::<WaitError>(),
        Some(WaitError::NoAnswer { .. })
    ) {
        exit::NO_ANSWER
    } else if error
        .downcast_ref::<PublishError>()
        .is_some_and(PublishError::in_doubt)
        || matches!(
            error.downcast_ref::<WaitError>(),
            Some(WaitError::Publish(e)) if e.in_doubt()
        )
    {
        exit::IN_DOUBT
    } else if matches!(
        error.downcast_ref::<WaitError>(),
        Some(
            WaitError::BadReplyTo(_)
                | WaitError::KeyTooLong(_)
                | WaitError::Publish(PublishError::InvalidIntent(_) | PublishError::TooLong { .. })
        )
    ) || matches!(
        error.downcast_ref::<PublishError>(),
        Some(PublishError::InvalidIntent(_) | PublishError::TooLong { .. })
    ) {
        // Input that can never be sent (a key or a name too long for AMQP) is bad input.
        exit::USAGE
    } else {
        exit::ERROR
    }
}

/// The exit code for an answer.
pub fn answer_code(answer: &Answer) -> i32 {
    match answer.event.status {
        protocol::Status::Succeeded => exit::SUCCEEDED,
        protocol::Status::Pending => exit::PENDING,
        protocol::Status::Failed => exit::FAILED,
        protocol::Status::Rejected => exit::REJECTED,
    }
}

/// Parses `30s`, `500ms`, `2m`, `1h` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (e.g. 30s, 500ms, 2m)"))?;
    let secs = match unit.trim() {
        "" | "s" => number,
        "ms" => number / 1000.0,
        "m" => number * 60.0,
        "h" => number * 3600.0,
        other => return Err(format!("unknown duration unit {other:?} (ms, s, m, h)")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{text:?}: {e}"))
}

/// A duration of at least 1 ms (`10s`, `500ms`, ...).
fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    if d < Duration::from_millis(1) {
        return Err(format!("{text:?} must be at least 1ms"));
    }
    Ok(d)
}

/// The limits of an HTTP listener (`relay`: the metrics listener; `mcp`: the gateway).
#[derive(Debug, Clone, Args)]
pub struct HttpLimitArgs {
    /// Time a client gets to send a complete request head, from the accept or from the first
    /// byte of a later request on a keep-alive connection; then the connection is closed.
    #[arg(long, env = "PUBLISHER_HTTP_HEADER_TIMEOUT", value_name = "PUBLISHER_HTTP_HEADER_TIMEOUT",
          default_value = "10s", value_parser = parse_positive_duration)]
    pub http_header_timeout: Duration,
    /// Time a keep-alive connection may sit idle (no request in flight, no traffic) before it
    /// is closed.
    #[arg(long, env = "PUBLISHER_HTTP_IDLE_TIMEOUT", value_name = "PUBLISHER_HTTP_IDLE_TIMEOUT",
          default_value = "60s", value_parser = parse_positive_duration)]
    pub http_idle_timeout: Duration,
    /// Connections the listener keeps open at once; more wait in the kernel's backlog
    /// without taking a descriptor (at least 1).
    #[arg(long, env = "PUBLISHER_HTTP_MAX_CONNECTIONS", value_name = "PUBLISHER_HTTP_MAX_CONNECTIONS",
          default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub http_max_connections: u32,
    /// Time a client gets to send a request's whole body, from its complete head; a body still
    /// incomplete then is answered 408 and its connection closed.
    #[arg(long, env = "PUBLISHER_HTTP_BODY_TIMEOUT", value_name = "PUBLISHER_HTTP_BODY_TIMEOUT",
          default_value = "10s", value_parser = parse_positive_duration)]
    pub http_body_timeout: Duration,
}

impl HttpLimitArgs {
    pub fn limits(&self) -> kit::http::Limits {
        kit::http::Limits {
            header_timeout: self.http_header_timeout,
            idle_timeout: self.http_idle_timeout,
            max_connections: self.http_max_connections as usize,
            body_timeout: self.http_body_timeout,
        }
    }
}

/// Publish intents to the intent worker and follow their results.
#[derive(Debug, Parser)]
#[command(name = "publisher", version, about)]
pub struct Cli {
    /// AMQP URL of the broker, or one per node of a cluster, comma-separated (tried in a random
    /// order on each connect).
    #[arg(
        long,
        global = true,
        env = "AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,

    /// Send the connection's user as AMQP `user_id` (tenant proof; `false` turns it off).
    #[arg(
        long,
        global = true,
        env = "PUBLISHER_SET_USER_ID",
        default_value_t = true,
        action = clap::ArgAction::Set,
        value_name = "BOOL"
    )]
    pub set_user_id: bool,

    /// Extra PEM bundle trusted besides the system roots for amqps://, Postgres TLS and
    /// https:// (the status API).
    #[arg(long, global = true, env = "PUBLISHER_CA_FILE", value_name = "PATH")]
    pub ca_file: Option<std::path::PathBuf>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Validate one intent as the worker would, publish it and wait for the confirm
    /// (with `--wait`, also for its answer).
    Send(SendArgs),
    /// Ask the worker's status API for one action's answer, until final or the timeout.
    Wait(WaitArgs),
    /// Create the agent-side `intent_outbox` table (idempotent).
    Migrate(DbArgs),
    /// Publish `intent_outbox` rows to the intents exchange (many relays may run).
    Relay(RelayArgs),
    /// Print the tenant's result events, one JSON object per line.
    Follow(FollowArgs),
    /// MCP gateway: serve the tools of PUBLISHER_MCP_TOOLS to MCP clients, each call an intent.
    Mcp(McpArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum McpTransport {
    Http,
    Stdio,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ActionIdSource {
    /// The request `_meta` key `io.intent-worker/action_id`, set by the host application.
    Meta,
    /// A required `action_id` argument (weaker: the model writes it).
    Argument,
}

#[derive(Debug, Args)]
pub struct McpArgs {
    /// The gateway's tools file (TOML: `[tools.<name>]` with `description`, `input_schema`).
    #[arg(long, env = "PUBLISHER_MCP_TOOLS", default_value = "mcp-tools.toml")]
    pub tools: std::path::PathBuf,
    /// `http` (streamable HTTP) or `stdio`.
    #[arg(
        long,
        env = "PUBLISHER_MCP_TRANSPORT",
        value_enum,
        default_value = "http"
    )]
    pub transport: McpTransport,
    /// Listen address of the HTTP transport.
    #[arg(long, env = "PUBLISHER_MCP_ADDR", default_value = "127.0.0.1:9470")]
    pub listen: SocketAddr,
    /// URL path of the MCP endpoint.
    #[arg(long, env = "PUBLISHER_MCP_PATH", default_value = "/mcp")]
    pub path: String,
    /// HTTP: bearer tokens, `tenant=token,...`; the token decides the tenant of a call.
    #[arg(long, env = "PUBLISHER_MCP_TOKENS", hide_env_values = true)]
    pub tokens: Option<String>,
    /// stdio: the tenant of every call.
    #[arg(long, env = "PUBLISHER_MCP_TENANT")]
    pub tenant: Option<String>,
    /// HTTP: accepted `Host` headers, comma-separated (default: localhost, 127.0.0.1, ::1).
    #[arg(long, env = "PUBLISHER_MCP_ALLOWED_HOSTS", value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// HTTP: browser origins allowed to call, comma-separated `scheme://host[:port]` (`:*` =
    /// any port, e.g. `http://localhost:*`). A request without `Origin` is always served; by
    /// default (empty) every request with an `Origin` is refused (403).
    #[arg(
        long,
        env = "PUBLISHER_MCP_ALLOWED_ORIGINS",
        value_name = "PUBLISHER_MCP_ALLOWED_ORIGINS",
        value_delimiter = ','
    )]
    pub allowed_origins: Vec<String>,
    #[command(flatten)]
    pub http: HttpLimitArgs,
    /// Where the action id comes from: `meta` or the weaker `argument`.
    #[arg(
        long,
        env = "PUBLISHER_MCP_ACTION_ID",
        value_enum,
        default_value = "meta"
    )]
    pub action_id: ActionIdSource,
    /// How long a call waits for its answer before it answers "outcome unknown".
    #[arg(long, env = "PUBLISHER_MCP_WAIT", default_value = "10s", value_parser = parse_duration)]
    pub wait: Duration,
    /// Intents exchange.
    #[arg(long, env = "INTENTS_EXCHANGE", default_value = "intents")]
    pub exchange: String,
    /// Enqueue into this agent database's `intent_outbox` (run `publisher relay` beside it)
    /// instead of publishing directly.
    #[arg(long, env = "PUBLISHER_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Prometheus `/metrics` listener of the gateway; `off` (the default) disables it.
    #[arg(long, env = "PUBLISHER_MCP_METRICS_ADDR", default_value = "off")]
    pub metrics_addr: String,
    #[command(flatten)]
    pub answers: AnswerArgs,
}

#[derive(Debug, Args)]
pub struct SendArgs {
    /// Tenant (also the routing key).
    #[arg(long)]
    pub tenant: String,
    /// Logical action id chosen by the application (not the model, not a call id).
    #[arg(long)]
    pub action_id: String,
    /// Tool name.
    #[arg(long)]
    pub tool: String,
    /// Tool arguments as a JSON object.
    #[arg(long = "args", value_name = "JSON")]
    pub arguments: String,
    /// Informational model call id.
    #[arg(long)]
    pub call_id: Option<String>,
    /// Where results should go (defaults to the tenant on the worker side).
    #[arg(long)]
    pub reply_to: Option<String>,
    /// Send a compensation: the action id (same tenant) of the succeeded action this one undoes
    /// (the intent's `compensates`; the tool must list the original's tool in its
    /// `compensation_for`).
    #[arg(long, value_name = "ACTION_ID")]
    pub compensates: Option<String>,
    /// Intents exchange.
    #[arg(long, env = "INTENTS_EXCHANGE", default_value = "intents")]
    pub exchange: String,
    /// Wait for the worker's answer and exit with it (0 succeeded, 10 pending, 11 failed,
    /// 12 rejected, 3 no answer): the first answer ends the wait, a `pending` one too (the
    /// outcome is unknown for now; ask again later with `publisher wait`).
    #[arg(long)]
    pub wait: bool,
    /// With --wait: wait past a `pending` answer for a final one, until the timeout.
    #[arg(long, requires = "wait")]
    pub until_final: bool,
    /// How long `--wait` waits (e.g. 30s, 500ms, 2m).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// W3C trace context to send with the intent (`00-<trace id>-<parent id>-<flags>`), e.g.
    /// the calling script's; without it, none (or this command's own span when spans are
    /// exported). A value that does not parse is sent as given, with a warning.
    #[arg(long, value_name = "TRACEPARENT")]
    pub traceparent: Option<String>,
    /// Vendor trace state sent with `--traceparent` (`key=value,...`).
    #[arg(long, value_name = "TRACESTATE", requires = "traceparent")]
    pub tracestate: Option<String>,
    #[command(flatten)]
    pub answers: AnswerArgs,
}

/// Where answers come from.
#[derive(Debug, Args)]
pub struct AnswerArgs {
    /// Results exchange.
    #[arg(long, env = "RESULTS_EXCHANGE", default_value = "results")]
    pub results_exchange: String,
    /// The worker's status API (e.g. http://127.0.0.1:8080), asked when the queue gives
    /// no final answer in time.
    #[arg(long, env = "PUBLISHER_STATUS_URL")]
    pub status_url: Option<String>,
    /// Tenant (or admin) token for the status API.
    #[arg(long, env = "PUBLISHER_STATUS_TOKEN", hide_env_values = true)]
    pub status_token: Option<String>,
}

impl AnswerArgs {
    fn status_api(&self) -> anyhow::Result<Option<StatusApi>> {
        match (&self.status_url, &self.status_token) {
            (None, _) => Ok(None),
            (Some(_), None) => Err(UsageError(
                "PUBLISHER_STATUS_URL is set but PUBLISHER_STATUS_TOKEN is not".into(),
            )
            .into()),
            (Some(url), Some(token)) => Ok(Some(
                StatusApi::new(url, token).map_err(|e| UsageError(e.to_string()))?,
            )),
        }
    }
}

#[derive(Debug, Args)]
pub struct WaitArgs {
    #[arg(long)]
    pub tenant: String,
    #[arg(long)]
    pub action_id: String,
    /// How long to keep asking (e.g. 30s).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Pause between two questions.
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    pub poll: Duration,
    #[command(flatten)]
    pub answers: AnswerArgs,
}

#[derive(Debug, Args)]
pub struct DbArgs {
    /// The agent's Postgres database (holds `intent_outbox`).
    #[arg(long, env = "PUBLISHER_DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
}

#[derive(Debug, Args)]
pub struct RelayArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Intents exchange.
    #[arg(long, env = "INTENTS_EXCHANGE", default_value = "intents")]
    pub exchange: String,
    /// Rows claimed and published per step.
    #[arg(long, env = "PUBLISHER_BATCH", default_value_t = 500)]
    pub batch: i64,
    /// How long a claim keeps other relays off a row (e.g. 30s).
    #[arg(long, env = "PUBLISHER_LEASE", default_value = "30s", value_parser = parse_duration)]
    pub lease: Duration,
    /// Pause when the outbox has nothing due.
    #[arg(long, env = "PUBLISHER_IDLE_POLL", default_value = "200ms", value_parser = parse_duration)]
    pub idle_poll: Duration,
    /// First retry delay after a failed publish (doubles per attempt, jittered).
    #[arg(long, env = "PUBLISHER_BACKOFF_INITIAL", default_value = "1s", value_parser = parse_duration)]
    pub backoff_initial: Duration,
    /// Longest retry delay.
    #[arg(long, env = "PUBLISHER_BACKOFF_MAX", default_value = "5m", value_parser = parse_duration)]
    pub backoff_max: Duration,
    /// Sent rows are deleted this long after they were sent.
    #[arg(long, env = "PUBLISHER_RETENTION", default_value = "24h", value_parser = parse_duration)]
    pub retention: Duration,
    /// How often sent rows are swept.
    #[arg(long, env = "PUBLISHER_SWEEP_INTERVAL", default_value = "60s", value_parser = parse_duration)]
    pub sweep_interval: Duration,
    /// Prometheus `/metrics` listener; `off` disables it.
    #[arg(long, env = "PUBLISHER_METRICS_ADDR", default_value = "127.0.0.1:9466")]
    pub metrics_addr: String,
    /// Relay loops in this process, each with its own channel (they claim disjoint rows).
    #[arg(long, env = "PUBLISHER_CONCURRENCY", default_value_t = 2)]
    pub concurrency: u32,
    #[command(flatten)]
    pub http: HttpLimitArgs,
}

#[derive(Debug, Args)]
pub struct FollowArgs {
    /// Tenant whose results to follow (the binding's routing key).
    #[arg(long)]
    pub tenant: String,
    /// Durable queue name; without it a temporary exclusive queue is used.
    #[arg(long)]
    pub queue: Option<String>,
    /// Stop after this many results.
    #[arg(long)]
    pub count: Option<u64>,
    /// Stop when this many seconds pass without a result (default: wait forever).
    #[arg(long)]
    pub timeout_secs: Option<u64>,
    /// Results exchange.
    #[arg(long, env = "RESULTS_EXCHANGE", default_value = "results")]
    pub results_exchange: String,
}

/// The process's TLS trust (`PUBLISHER_CA_FILE`, set for every client of the process) and the
/// span exporter the standard `OTEL_*` variables ask for (`None`: export is off). `main` calls
/// it before logging starts, so that the log subscriber can carry the span layer. An unusable
/// CA file or `OTEL_*` setting is a [`UsageError`] naming the variable.
pub fn prepare(cli: &Cli) -> anyhow::Result<Option<kit::otel::export::Export>> {
    let trust = load_trust(cli)?;
    let export = kit::otel::export::from_env("intent-publisher", &trust)
        .map_err(|e| UsageError(format!("trace export: {e}")))?;
    crate::tls::set_trust(trust);
    Ok(export)
}

fn load_trust(cli: &Cli) -> Result<crate::tls::Trust, UsageError> {
    crate::tls::Trust::load(crate::tls::CA_FILE_VAR, cli.ca_file.as_deref())
        .map_err(|e| UsageError(e.to_string()))
}

/// Runs the parsed command and returns the process exit code. An `Err` is printed by
/// `main` and exits with [`exit_code`].
pub async fn run(cli: Cli) -> anyhow::Result<i32> {
    let set_user_id = cli.set_user_id;
    // Already set by `prepare` in the binary (then this changes nothing); a caller that runs a
    // command without it still gets PUBLISHER_CA_FILE.
    crate::tls::set_trust(load_trust(&cli)?);
    kit::url::check_list(&cli.amqp_url, &["amqp", "amqps"]).map_err(|reason| {
        UsageError(format!(
            "AMQP_URL={:?} is invalid: {reason}",
            kit::url::redact_list(&cli.amqp_url)
        ))
    })?;
    match cli.command {
        Command::Send(args) => send(&cli.amqp_url, set_user_id, args).await,
        Command::Wait(args) => wait(args).await,
        Command::Follow(args) => follow(&cli.amqp_url, args).await.map(|()| 0),
        Command::Migrate(args) => {
            let (pool, _) = connect_db(&args.database_url, 1).await?;
            Outbox::migrate(&pool).await?;
            println!("intent_outbox is ready");
            Ok(0)
        }
        Command::Relay(args) => relay(&cli.amqp_url, set_user_id, args).await.map(|()| 0),
        Command::Mcp(args) => mcp(cli.amqp_url, set_user_id, args).await.map(|()| 0),
    }
}

/// Refuses a service URL that can never work (another scheme, a port out of range) at once,
/// naming the variable, without its password: waiting would not fix it.
fn usable_url(name: &str, url: &str, schemes: &[&str]) -> Result<(), UsageError> {
    kit::url::check(url, schemes).map_err(|reason| {
        UsageError(format!(
            "{name}={:?} is invalid: {reason}",
            kit::url::redact(url)
        ))
    })
}

/// The agent database, to the host search: its name in messages, its setting, its counter.
const AGENT_DB: kit::pg::Role = kit::pg::Role {
    what: "agent database",
    var: "PUBLISHER_DATABASE_URL",
    failovers: crate::metrics::DB_FAILOVERS,
};

/// Connects to the agent database: one host, or the primary among several (libpq's
/// multi-host URL, [`kit::pg`]); the hosts are returned for the pool's users to
/// [`kit::pg::Hosts::observe`] failed statements. A database not reachable yet is waited for
/// (up to [`kit::pg::START_WAIT`]), as the worker waits for its ledger; an answer waiting cannot
/// change (a refused login, SQLSTATE class 28, or a failed TLS handshake) ends the wait at once.
async fn connect_db(url: &str, max: u32) -> anyhow::Result<(sqlx::PgPool, Arc<kit::pg::Hosts>)> {
    usable_url("PUBLISHER_DATABASE_URL", url, &["postgres", "postgresql"])?;
    let hosts = kit::pg::Hosts::from_url(url, AGENT_DB, crate::tls::postgres)
        .map_err(|e| UsageError(format!("invalid PUBLISHER_DATABASE_URL: {e}")))?;
    let hosts = Arc::new(hosts);
    let settings = kit::pg::PoolSettings {
        max_connections: max,
        min_connections: 0,
        acquire_timeout: Duration::from_secs(10),
        ping_if_idle_for: Duration::from_secs(1),
    };
    let connected = kit::pg::waiting_at_start(
        "agent database (PUBLISHER_DATABASE_URL)",
        || kit::pg::pool(hosts.clone(), settings),
        |e| !kit::pg::login_refused(e) && kit::pg::tls_failure(e).is_none(),
    )
    .await;
    match connected {
        Ok(pool) => Ok((pool, hosts)),
        Err(e) => Err(match kit::pg::tls_failure(&e) {
            Some(reason) => anyhow::anyhow!(
                "cannot connect to the agent database (PUBLISHER_DATABASE_URL): TLS handshake failed: {reason}"
            ),
            None => anyhow::Error::new(e)
                .context("cannot connect to the agent database (PUBLISHER_DATABASE_URL)"),
        }),
    }
}

/// A metrics listener address setting: `None` for `off`, `none` or empty.
fn metrics_addr(var: &str, text: &str) -> Result<Option<SocketAddr>, UsageError> {
    match text.trim() {
        "off" | "none" | "" => Ok(None),
        addr => addr
            .parse()
            .map(Some)
            .map_err(|e| UsageError(format!("{var} {addr:?}: {e}"))),
    }
}

/// Binds the listener `var` names at start-up: an address that cannot be bound is a usage
/// error (exit 2) naming the variable and the address, never a process running without it.
fn listen(var: &'static str, addr: SocketAddr) -> Result<std::net::TcpListener, UsageError> {
    kit::http::bind(var, addr).map_err(|e| UsageError(e.to_string()))
}

async fn relay(amqp_url: &str, set_user_id: bool, args: RelayArgs) -> anyhow::Result<()> {
    if args.batch < 1 {
        return Err(UsageError("--batch must be at least 1".into()).into());
    }
    let metrics_addr = metrics_addr("PUBLISHER_METRICS_ADDR", &args.metrics_addr)?;
    let metrics_listener = metrics_addr
        .map(|addr| listen("PUBLISHER_METRICS_ADDR", addr))
        .transpose()?;
    let concurrency = args.concurrency.max(1);
    let limits = args.http.limits();
    let mut budget = kit::fd::Budget::new().add(
        "database pool (PUBLISHER_CONCURRENCY + 2)",
        u64::from(concurrency) + 2,
    );
    if metrics_addr.is_some() {
        budget = budget.add(
            "metrics listener (PUBLISHER_HTTP_MAX_CONNECTIONS)",
            limits.max_connections as u64 + 1,
        );
    }
    kit::fd::prepare(
        "publisher relay",
        &budget.add("broker (PUBLISHER_CONCURRENCY)", u64::from(concurrency)),
    );
    let (pool, hosts) = connect_db(&args.db.database_url, concurrency + 2).await?;
    match crate::relay::check_table(&pool).await {
        Err(e @ crate::relay::TableError::NotMigrated(_)) => {
            return Err(UsageError(e.to_string()).into())
        }
        other => other?,
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };
    if let Some(listener) = metrics_listener {
        let handle = crate::metrics::install(crate::metrics::RELAY_TRACE_SOURCES)
            .map_err(|e| anyhow::anyhow!(e))?;
        let listener =
            crate::metrics::serve(listener, limits, handle, Some(pool.clone()), stopped());
        tokio::spawn(async move {
            if let Err(error) = listener.await {
                tracing::error!(%error, "metrics listener failed");
            }
        });
    }
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("stopping the relay");
        let _ = stop_tx.send(true);
    });
    let config = RelayConfig {
        batch: args.batch,
        lease: args.lease,
        idle_poll: args.idle_poll,
        backoff_initial: args.backoff_initial,
        backoff_max: args.backoff_max,
        retention: args.retention,
        sweep_interval: args.sweep_interval,
    };
    let mut loops = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (url, exchange) = (amqp_url.to_owned(), args.exchange.clone());
        let connect = move || {
            let (amqp_url, exchange) = (url.clone(), exchange.clone());
            async move {
                Publisher::connect(&amqp_url, &exchange)
                    .await
                    .map(|p| p.with_user_id(set_user_id))
            }
        };
        let publisher = connect()
            .await
            .with_context(|| format!("cannot connect to the broker at {}", redact(amqp_url)))?;
        let mut relay =
            Relay::new(pool.clone(), publisher, config.clone()).following(hosts.clone());
        let stop = stopped();
        loops.spawn(async move { relay.run(stop, connect).await });
    }
    while let Some(done) = loops.join_next().await {
        done.context("relay loop panicked")??;
    }
    Ok(())
}

async fn mcp(amqp_url: String, set_user_id: bool, args: McpArgs) -> anyhow::Result<()> {
    use crate::mcp;
    let catalog = mcp::ToolCatalog::load(&args.tools).map_err(|e| UsageError(e.to_string()))?;
    let allowed_origins = mcp::AllowedOrigins::parse(&args.allowed_origins)
        .map_err(|e| UsageError(format!("PUBLISHER_MCP_ALLOWED_ORIGINS: {e}")))?;
    let limits = args.http.limits();
    let metrics_addr = metrics_addr("PUBLISHER_MCP_METRICS_ADDR", &args.metrics_addr)?;
    let metrics_listener = metrics_addr
        .map(|addr| listen("PUBLISHER_MCP_METRICS_ADDR", addr))
        .transpose()?;
    let gateway_listener = (args.transport == McpTransport::Http)
        .then(|| listen("PUBLISHER_MCP_ADDR", args.listen))
        .transpose()?;
    let mut budget = kit::fd::Budget::new();
    if args.database_url.is_some() {
        budget = budget.add("database pool", 8);
    }
    if metrics_addr.is_some() {
        budget = budget.add(
            "metrics listener (PUBLISHER_HTTP_MAX_CONNECTIONS)",
            limits.max_connections as u64 + 1,
        );
    }
    if args.transport == McpTransport::Http {
        let cap = limits.max_connections as u64;
        budget = budget
            .add("gateway listener (PUBLISHER_HTTP_MAX_CONNECTIONS)", cap + 1)
            .add("status API connections (one per call in flight)", cap);
    }
    kit::fd::prepare("publisher mcp", &budget.add("broker", 2));
    let outbox = match &args.database_url {
        Some(url) => {
            let (pool, hosts) = connect_db(url, 8).await?;
            Outbox::migrate(&pool).await?;
            Some(mcp::OutboxDb { pool, hosts })
        }
        None => None,
    };
    let (tokens, fixed_tenant) = match args.transport {
        McpTransport::Http => {
            let Some(tokens) = &args.tokens else {
                return Err(UsageError(
                    "publisher mcp over HTTP needs PUBLISHER_MCP_TOKENS (tenant=token,...)".into(),
                )
                .into());
            };
            let tokens = mcp::TokenMap::parse(tokens).map_err(|e| UsageError(e.to_string()))?;
            (Some(tokens), None)
        }
        McpTransport::Stdio => match &args.tenant {
            Some(tenant) if !tenant.trim().is_empty() => (None, Some(tenant.trim().to_owned())),
            _ => {
                return Err(UsageError(
                    "publisher mcp over stdio needs PUBLISHER_MCP_TENANT".into(),
                )
                .into())
            }
        },
    };
    let gateway = mcp::Gateway::new(mcp::GatewayConfig {
        catalog,
        amqp_url: amqp_url.clone(),
        exchange: args.exchange.clone(),
        set_user_id,
        results_exchange: args.answers.results_exchange.clone(),
        status_api: args.answers.status_api()?,
        outbox,
        budget: args.wait,
        action_id_mode: match args.action_id {
            ActionIdSource::Meta => mcp::ActionIdMode::Meta,
            ActionIdSource::Argument => mcp::ActionIdMode::Argument,
        },
        fixed_tenant,
    });
    gateway
        .connect()
        .await
        .with_context(|| format!("cannot connect to the broker at {}", redact(&amqp_url)))?;
    if let Some(listener) = metrics_listener {
        let handle = crate::metrics::install(crate::metrics::MCP_TRACE_SOURCES)
            .map_err(|e| anyhow::anyhow!(e))?;
        let listener = crate::metrics::serve(listener, limits, handle, None, shutdown_signal());
        tokio::spawn(async move {
            if let Err(error) = listener.await {
                tracing::error!(%error, "metrics listener failed");
            }
        });
    }
    match (tokens, gateway_listener) {
        (Some(tokens), Some(listener)) => {
            let options = mcp::HttpOptions {
                listener,
                path: args.path.clone(),
                allowed_hosts: args.allowed_hosts,
                allowed_origins,
                limits,
            };
            mcp::serve_http(gateway, tokens, options, shutdown_signal()).await?
        }
        _ => mcp::serve_stdio(gateway).await?,
    }
    Ok(())
}

/// SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    kit::signal::stop().await
}

async fn wait(args: WaitArgs) -> anyhow::Result<i32> {
    let Some(api) = args.answers.status_api()? else {
        return Err(UsageError(
            "publisher wait needs PUBLISHER_STATUS_URL and PUBLISHER_STATUS_TOKEN".into(),
        )
        .into());
    };
    let answer = api
        .wait(&args.tenant, &args.action_id, args.timeout, args.poll)
        .await?;
    println!("{}", serde_json::to_string(&answer.event)?);
    Ok(answer_code(&answer))
}

async fn send(amqp_url: &str, set_user_id: bool, args: SendArgs) -> anyhow::Result<i32> {
    let arguments: serde_json::Value = serde_json::from_str(&args.arguments)
        .map_err(|e| UsageError(format!("--args is not valid JSON: {e}")))?;
    let mut body = serde_json::Map::new();
    body.insert("tenant".into(), args.tenant.into());
    body.insert("action_id".into(), args.action_id.into());
    body.insert("tool".into(), args.tool.into());
    body.insert("arguments".into(), arguments);
    if let Some(call_id) = args.call_id {
        body.insert("call_id".into(), call_id.into());
    }
    if let Some(reply_to) = args.reply_to {
        body.insert("reply_to".into(), reply_to.into());
    }
    if let Some(compensates) = args.compensates {
        body.insert("compensates".into(), compensates.into());
    }
    let body = serde_json::to_vec(&serde_json::Value::Object(body))?;
    let intent = protocol::decode_intent(&body)
        .map_err(|error| UsageError(format!("invalid intent: {error}")))?;
    let fingerprint = intent.fingerprint();
    let options = send_trace(args.traceparent.as_deref(), args.tracestate.as_deref());

    let publisher = Publisher::connect(amqp_url, &args.exchange)
        .await
        .with_context(|| format!("cannot connect to the broker at {}", redact(amqp_url)))?
        .with_user_id(set_user_id);
    if args.wait {
        let answers = AnswerConfig {
            results_exchange: args.answers.results_exchange.clone(),
            status_api: args.answers.status_api()?,
            until: if args.until_final {
                crate::wait::Until::Final
            } else {
                crate::wait::Until::First
            },
            ..AnswerConfig::default()
        };
        let publisher = publisher.with_answers(answers);
        let answer = publisher
            .send_and_wait_with(&intent, args.timeout, &options)
            .await;
        publisher.close().await.ok();
        let answer = answer?;
        println!("{}", serde_json::to_string(&answer.event)?);
        return Ok(answer_code(&answer));
    }
    publisher
        .publish_with(&intent, &options)
        .await
        .with_context(|| {
            format!(
                "publishing {}:{} to exchange {:?}",
                intent.tenant, intent.action_id, args.exchange
            )
        })?;
    println!(
        "published {}:{} fingerprint={fingerprint}",
        intent.tenant, intent.action_id
    );
    publisher.close().await.ok();
    Ok(0)
}

/// The trace context of `publisher send --traceparent [--tracestate]`. A value that does not
/// parse is sent as given, with a warning on stderr: receivers ignore it, and a test needs a
/// way to deliver one.
fn send_trace(traceparent: Option<&str>, tracestate: Option<&str>) -> crate::PublishOptions {
    let options = crate::PublishOptions::new();
    let Some(traceparent) = traceparent else {
        return options;
    };
    match protocol::trace::TraceContext::read(Some(traceparent), tracestate) {
        protocol::trace::Incoming::Context {
            context,
            state_dropped: false,
        } => options.with_trace(Some(context)),
        protocol::trace::Incoming::Context { .. } => {
            eprintln!(
                "warning: --tracestate {tracestate:?} is not a valid W3C tracestate; sent as given, receivers drop it"
            );
            options.with_verbatim_trace(traceparent, tracestate.map(str::to_owned))
        }
        protocol::trace::Incoming::Malformed(reason) => {
            eprintln!(
                "warning: --traceparent {traceparent:?} is not a valid W3C traceparent; sent as given, receivers ignore it ({reason})"
            );
            options.with_verbatim_trace(traceparent, tracestate.map(str::to_owned))
        }
        // Only without a traceparent, which returned above.
        protocol::trace::Incoming::Absent => options,
    }
}

async fn follow(amqp_url: &str, args: FollowArgs) -> anyhow::Result<()> {
    let mut follower = Follower::follow(
        amqp_url,
        &args.results_exchange,
        &args.tenant,
        args.queue.as_deref(),
    )
    .await
    .with_context(|| format!("cannot follow results at {}", redact(amqp_url)))?;
    // Without --timeout-secs, wait in long slices forever.
    let wait = Duration::from_secs(args.timeout_secs.unwrap_or(3600));
    let mut seen = 0u64;
    while args.count.is_none_or(|count| seen < count) {
        match follower.next(wait).await {
            Ok(Some(event)) => {
                seen += 1;
                println!("{}", serde_json::to_string(&event)?);
            }
            Ok(None) if args.timeout_secs.is_none() => continue,
            Ok(None) => break,
            // Already rejected by the follower; one bad message does not stop following.
            Err(error @ PublishError::BadResult(_)) => tracing::warn!(%error, "skipped"),
            Err(error) => return Err(error.into()),
        }
    }
    follower.close().await.ok();
    match args.count {
        Some(count) if seen < count => bail!(
            "timed out after {}s without a result: {seen} of {count} results received",
            wait.as_secs()
        ),
        _ => Ok(()),
    }
}

/// The URL (or each URL of a list) without its password, for error messages.
pub fn redact(amqp_url: &str) -> String {
    kit::url::redact_list(amqp_url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_publish_in_doubt_has_its_own_exit_code() {
        let lost = || lapin::Error::from(lapin::ErrorKind::ChannelsLimitReached);
        let doubt = anyhow::Error::new(PublishError::InDoubt(lost())).context("publishing");
        assert_eq!(exit_code(&doubt), exit::IN_DOUBT);
        let waited = anyhow::Error::new(WaitError::Publish(PublishError::InDoubt(lost())));
        assert_eq!(exit_code(&waited), exit::IN_DOUBT);
        let plain = anyhow::Error::new(PublishError::Amqp(lost()));
        assert_eq!(exit_code(&plain), exit::ERROR);
        assert_eq!(
            exit_code(&anyhow::Error::new(PublishError::Nacked)),
            exit::ERROR
        );
    }
}
