//! `demo-agent`: an example of an agent built on the `intent-publisher` library, and the demo
//! agent of docker compose and `scripts/demo.sh`. It is not library code: read it as a showcase
//! of how an agent uses the library, through its public API only (what an agent that depends on
//! `intent-publisher = { version = "0.1", default-features = false, features = ["otel"] }`
//! gets): [`publisher::Publisher`] to publish with confirms, [`publisher::Follower`] for its own
//! results queue, [`publisher::Outbox`] to enqueue an intent in the same transaction as its own
//! write, [`publisher::tls`] for one TLS trust shared by the broker, the database and the status
//! API. Its start-up ([`main`]) is what every agent process does: TLS trust, span export over
//! OTLP from the standard `OTEL_*` variables ([`kit::otel::export`]) and logs carrying the spans.
//!
//! `--scenario stream` for docker compose, `--scenario full` for `scripts/demo.sh` (the Quick
//! start without Docker).
//!
//! **stream** sends `count` intents `demo-<run id>-<i>` and sends every k-th one again with a
//! new call id (and, when published directly, its JSON fields in another order). The worker
//! must treat the repeat as a duplicate of the same action (same key, same fingerprint) and
//! never dispatch it twice.
//!
//! **full** walks through what the worker promises, one phase after the other, and prints a
//! machine-checkable summary (`key=value` lines on stdout, see [`agent::Tally`]):
//!
//! 1. `count` refunds `refund-<run id>-<i>`, each waited for until its final answer;
//! 2. every k-th again, fields reordered and re-spaced, new call id: answered from the ledger
//!    (`succeeded` with the first answer's receipt), never dispatched again;
//! 3. `refund-<run id>-1` reused with other arguments: refused `rejected` / `intent_conflict`;
//! 4. one `<async tool>-<run id>` intent (`deploy`, a tool with `completion = "async"`): the
//!    downstream accepts it with an operation id and runs it for a while; it is answered
//!    `pending` (uncertainty `in_progress`, `remote_id` the operation id), then `succeeded`
//!    once the worker's polls of its status URL see it done (`verified_by` `poll`, `remote_id`
//!    the deployment's receipt id);
//! 5. one `<held tool>-<run id>` intent (`payout`, a tool with `recovery = "none"`): when its
//!    reply is lost after the downstream committed (`scripts/demo.sh` arms the reference
//!    downstream's `drop_after_commit` fault for that key first), it is answered `pending`, and
//!    the status API then shows it held for a person;
//! 6. one refund `refund-<run id>-approval` above the refund tool's approval limit
//!    (`approval_when` in deploy/tools.demo.toml): recorded `awaiting_approval` and answered
//!    `pending` (uncertainty `awaiting_approval`), never sent until approved; the agent stands
//!    in for the person and approves it with `worker ops approve` (the `worker` binary run as a
//!    subprocess on the worker's ledger and tools file, naming the fingerprint of what it sent),
//!    then sees it `succeeded`, sent once by the worker's scheduler;
//! 7. one compensation `<reversal tool>-<run id>` (`refund_reversal`, a tool with
//!    `compensation_for = ["refund"]`) of `refund-<run id>-1`: an intent with `compensates`,
//!    an action of its own, answered `succeeded` naming what it `compensates`; the original is
//!    then announced `succeeded` again with `compensated_by` naming the compensation (its state
//!    and receipt unchanged).
//!
//! The agent only reports what it saw; how many writes the downstream really made is in the
//! downstream's own tables (`scripts/demo.sh` counts them and compares).
//!
//! With a database URL the agent works as a real one should: each intent is enqueued in the
//! agent's `intent_outbox` in the same transaction as its own record of the request
//! (`demo_refund_requests`), and `publisher relay` publishes it. Either way the agent binds
//! its own results queue (`<tenant>.@.<reply_to>`) first and prints every answer it gets.
//!
//! Each intent is sent from an `agent turn` span, the stand-in for the request an agent serves:
//! with span export on (the compose demo exports to Jaeger) the intent's trace starts there,
//! through the publish (or the outbox row and the relay's publish) into the worker.
//!
//! # Layout
//! - `main.rs`: the command line ([`Args`]: the flags and variables of the `publisher` binary
//!   it takes part of, `AMQP_URL`, `PUBLISHER_*`, `INTENTS_EXCHANGE`, `RESULTS_EXCHANGE`), the
//!   process's start-up and its exit codes ([`exit_code`]).
//! - `agent.rs` ([`agent`]): the two scenarios and everything they send.
//!
//! # Running it
//! `cargo run -p demo-agent -- --help`; `scripts/demo.sh` builds it with the release binaries
//! (`cargo build --release -p demo-agent`) and runs `demo-agent --scenario full`, the compose
//! stack's `agent` service runs `demo-agent` from the worker image.

mod agent;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use publisher::PublishError;

/// What is logged unless `RUST_LOG` says otherwise.
const LOG_FILTER: &str = "info,lapin=off";
/// How long spans still queued for export may take to leave at exit.
const EXPORT_FLUSH: Duration = Duration::from_secs(5);
/// `service.name` of the exported spans unless `OTEL_SERVICE_NAME` (or `service.name` in
/// `OTEL_RESOURCE_ATTRIBUTES`) names another.
const SERVICE_NAME: &str = "demo-agent";

/// Exit codes, as the `publisher` binary's for the same failures.
mod exit {
    /// Any error (broker, database, an answer missing in the `full` scenario, ...).
    pub const ERROR: i32 = 1;
    /// Bad arguments or settings (clap exits 2 too), or an intent that can never be sent.
    pub const USAGE: i32 = 2;
    /// Handed to the broker, its confirm never arrived: it may or may not be queued; sending it
    /// again under the same key is safe.
    pub const IN_DOUBT: i32 = 4;
}

/// Demo agent: publish a series of intents through the publisher library, re-sending some to
/// show deduplication (`stream`), or walk through what the worker promises (`full`).
#[derive(Debug, Parser)]
#[command(name = "demo-agent", version, about)]
struct Args {
    /// AMQP URL of the broker, or one per node of a cluster, comma-separated (tried in a random
    /// order on each connect).
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// Send the connection's user as AMQP `user_id` (tenant proof; `false` turns it off).
    #[arg(
        long,
        env = "PUBLISHER_SET_USER_ID",
        default_value_t = true,
        action = clap::ArgAction::Set,
        value_name = "BOOL"
    )]
    set_user_id: bool,
    /// Extra PEM bundle trusted besides the system roots for amqps://, Postgres TLS and
    /// https:// (the status API).
    #[arg(long, env = "PUBLISHER_CA_FILE", value_name = "PATH")]
    ca_file: Option<std::path::PathBuf>,
    /// Tenant of the demo intents.
    #[arg(long)]
    tenant: String,
    /// Tool of the demo intents.
    #[arg(long)]
    tool: String,
    /// Number of distinct intents.
    #[arg(long)]
    count: u64,
    /// Pause between publishes, in milliseconds.
    #[arg(long, default_value_t = 500)]
    interval_ms: u64,
    /// Re-publish every k-th intent (new call id, reordered JSON); 0 disables.
    #[arg(long, default_value_t = 3)]
    duplicate_every: u64,
    /// Intents exchange.
    #[arg(long, env = "INTENTS_EXCHANGE", default_value = "intents")]
    exchange: String,
    /// Results exchange.
    #[arg(long, env = "RESULTS_EXCHANGE", default_value = "results")]
    results_exchange: String,
    /// Enqueue through this agent database's `intent_outbox` (published by `publisher
    /// relay`) instead of publishing directly.
    #[arg(long, env = "PUBLISHER_DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// How long to wait for the last answers after the last intent (`full`: for each phase's
    /// answers).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    answer_timeout: Duration,
    /// `stream`: intents at --interval-ms, every k-th again at once, every answer printed
    /// (docker compose). `full`: refunds, repeats answered from the ledger, one conflicting
    /// reuse, one long-running deploy (accepted, then succeeded), one lost reply held for a
    /// person, one refund above the approval limit (approved with `worker ops approve`, then
    /// succeeded), one compensation of a refund, then a `key=value` summary (scripts/demo.sh;
    /// needs --ledger-url and --worker-tools).
    #[arg(long, value_enum, default_value_t = agent::Scenario::Stream)]
    scenario: agent::Scenario,
    /// The id in every action id (default: one unique to this run).
    #[arg(long)]
    run_id: Option<String>,
    /// `full`: the tool, declared `recovery = "none"`, of the action `<held-tool>-<run id>`
    /// whose reply the downstream is to lose after commit.
    #[arg(long, default_value = "payout")]
    held_tool: String,
    /// `full`: the tool, declared `completion = "async"`, of the long-running action
    /// `<async-tool>-<run id>`.
    #[arg(long, default_value = "deploy")]
    async_tool: String,
    /// `full`: the tool, declared `compensation_for = ["<--tool>"]`, of the compensation
    /// `<reversal-tool>-<run id>` that undoes the first refund.
    #[arg(long, default_value = "refund_reversal")]
    reversal_tool: String,
    /// `full`: the `worker` binary whose `worker ops approve` approves the refund above the
    /// approval limit [default: `worker` beside this executable].
    #[arg(long, value_name = "PATH")]
    worker_bin: Option<PathBuf>,
    /// `full`: the worker's ledger, for `worker ops approve` (its DATABASE_URL).
    #[arg(long, value_name = "URL")]
    ledger_url: Option<String>,
    /// `full`: the worker's tools file, for `worker ops approve` (its WORKER_TOOLS).
    #[arg(long, value_name = "PATH")]
    worker_tools: Option<PathBuf>,
    /// `full`: the worker's status API root, asked whether the pending action is held.
    #[arg(long, env = "PUBLISHER_STATUS_URL")]
    status_url: Option<String>,
    /// A tenant (or admin) token for --status-url.
    #[arg(long, env = "PUBLISHER_STATUS_TOKEN", hide_env_values = true)]
    status_token: Option<String>,
}

/// An error in the arguments or settings: exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct UsageError(String);

#[tokio::main]
async fn main() {
    // One crypto provider (ring) for every TLS client of the process.
    publisher::tls::install_default_provider();
    let args = Args::parse();
    let ansi = std::io::stderr().is_terminal();
    // Trust and span export before logging starts, so the log subscriber carries the span layer.
    let export = match prepare(&args) {
        Ok(export) => export,
        Err(error) => {
            kit::logs::init(false, ansi, LOG_FILTER);
            eprintln!("error: {}", kit::errors::chain(error.as_ref()));
            std::process::exit(exit_code(&error));
        }
    };
    // The span layer records the workspace's own spans (this crate's `agent turn` among them)
    // and the publisher library's `publish intents`; `RUST_LOG` selects the log lines only.
    let traces = match &export {
        Some(export) => kit::logs::Traces::Export(export),
        None => kit::logs::Traces::Off,
    };
    kit::logs::init_with(false, ansi, LOG_FILTER, traces);
    if let Some(export) = &export {
        tracing::info!(endpoint = %export.endpoint, service = %export.service, "exporting spans over OTLP/HTTP");
    }
    let outcome = run(args).await;
    if let Some(export) = export {
        export.shutdown(EXPORT_FLUSH).await;
    }
    if let Err(error) = outcome {
        eprintln!("error: {}", kit::errors::chain(error.as_ref()));
        std::process::exit(exit_code(&error));
    }
}

/// The process's TLS trust (the system roots and `PUBLISHER_CA_FILE`, set for every client of
/// the process: broker, database, status API, span export) and the span exporter the standard
/// `OTEL_*` variables ask for (`None`: export is off). An unusable CA file or `OTEL_*` setting
/// is a [`UsageError`] naming the variable.
fn prepare(args: &Args) -> anyhow::Result<Option<kit::otel::export::Export>> {
    let trust = publisher::tls::Trust::load(publisher::tls::CA_FILE_VAR, args.ca_file.as_deref())
        .map_err(|e| UsageError(e.to_string()))?;
    let export = kit::otel::export::from_env(SERVICE_NAME, &trust)
        .map_err(|e| UsageError(format!("trace export: {e}")))?;
    publisher::tls::set_trust(trust);
    Ok(export)
}

/// Checks the settings that can never work (at once, naming the variable, without its
/// password), then runs the scenario to its end.
async fn run(args: Args) -> anyhow::Result<()> {
    kit::url::check_list(&args.amqp_url, &["amqp", "amqps"]).map_err(|reason| {
        UsageError(format!(
            "AMQP_URL={:?} is invalid: {reason}",
            kit::url::redact_list(&args.amqp_url)
        ))
    })?;
    if let Some(url) = &args.database_url {
        kit::url::check(url, &["postgres", "postgresql"]).map_err(|reason| {
            UsageError(format!(
                "PUBLISHER_DATABASE_URL={:?} is invalid: {reason}",
                kit::url::redact(url)
            ))
        })?;
    }
    let status = match (args.status_url, args.status_token) {
        (Some(url), Some(token)) => Some((url, token)),
        (Some(_), None) => {
            return Err(UsageError("--status-url needs --status-token".into()).into())
        }
        _ => None,
    };
    let approver = match args.scenario {
        agent::Scenario::Full => Some(approver(
            args.worker_bin,
            args.ledger_url,
            args.worker_tools,
            args.ca_file,
        )?),
        agent::Scenario::Stream => None,
    };
    agent::run(agent::DemoConfig {
        scenario: args.scenario,
        run_id: args.run_id,
        held_tool: args.held_tool,
        async_tool: args.async_tool,
        reversal_tool: args.reversal_tool,
        approver,
        status,
        amqp_url: args.amqp_url,
        exchange: args.exchange,
        results_exchange: args.results_exchange,
        tenant: args.tenant,
        tool: args.tool,
        count: args.count,
        interval: Duration::from_millis(args.interval_ms),
        duplicate_every: args.duplicate_every,
        set_user_id: args.set_user_id,
        database_url: args.database_url,
        answer_timeout: args.answer_timeout,
    })
    .await
}

/// How `--scenario full` approves its refund above the approval limit: `worker ops approve` on
/// the worker's ledger and tools file, both required; the `worker` binary beside this one unless
/// named. The worker is given this process's extra CA file (as `WORKER_CA_FILE`), if any.
fn approver(
    worker_bin: Option<PathBuf>,
    ledger_url: Option<String>,
    tools: Option<PathBuf>,
    ca_file: Option<PathBuf>,
) -> anyhow::Result<agent::Approver> {
    let (Some(ledger_url), Some(tools)) = (ledger_url, tools) else {
        return Err(UsageError(
            "--scenario full approves one refund with `worker ops approve`: it needs \
             --ledger-url (the worker's DATABASE_URL) and --worker-tools (its WORKER_TOOLS)"
                .into(),
        )
        .into());
    };
    kit::url::check(&ledger_url, &["postgres", "postgresql"]).map_err(|reason| {
        UsageError(format!(
            "--ledger-url {:?} is invalid: {reason}",
            kit::url::redact(&ledger_url)
        ))
    })?;
    let worker_bin = match worker_bin {
        Some(bin) => bin,
        None => std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|dir| dir.join("worker")))
            .ok_or_else(|| {
                UsageError("cannot locate the worker binary: pass --worker-bin".into())
            })?,
    };
    Ok(agent::Approver {
        worker_bin,
        ledger_url,
        tools,
        ca_file,
    })
}

/// The exit code for an error returned by [`prepare`] or [`run`]: 2 for bad settings and for an
/// intent that can never be sent (a key or a name too long for AMQP), 4 for a publish in doubt,
/// 1 for anything else.
fn exit_code(error: &anyhow::Error) -> i32 {
    if error.downcast_ref::<UsageError>().is_some() {
        return exit::USAGE;
    }
    match error.downcast_ref::<PublishError>() {
        Some(e) if e.in_doubt() => exit::IN_DOUBT,
        Some(PublishError::InvalidIntent(_) | PublishError::TooLong { .. }) => exit::USAGE,
        _ => exit::ERROR,
    }
}

/// Parses `30s`, `500ms`, `2m`, `1h` or a bare number of seconds.
fn parse_duration(text: &str) -> Result<Duration, String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory;
        Args::command().debug_assert();
    }

    #[test]
    fn durations_read_as_the_publishers() {
        assert_eq!(parse_duration("20s"), Ok(Duration::from_secs(20)));
        assert_eq!(parse_duration("100ms"), Ok(Duration::from_millis(100)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("5 parsecs").is_err());
    }

    #[test]
    fn a_publish_in_doubt_has_its_own_exit_code() {
        let lost = || lapin::Error::from(lapin::ErrorKind::ChannelsLimitReached);
        let doubt = anyhow::Error::new(PublishError::InDoubt(lost())).context("publishing");
        assert_eq!(exit_code(&doubt), exit::IN_DOUBT);
        assert_eq!(
            exit_code(&anyhow::Error::new(PublishError::Nacked)),
            exit::ERROR
        );
        let usage = anyhow::Error::new(UsageError("bad".into()));
        assert_eq!(exit_code(&usage), exit::USAGE);
        let long = anyhow::Error::new(PublishError::TooLong {
            what: "routing key",
            len: 300,
        });
        assert_eq!(exit_code(&long), exit::USAGE);
    }
}
