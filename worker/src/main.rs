//! The `worker` binary: parses the command line and hands over to the library.

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use worker::config::EnvArgs;

/// jemalloc with the `jemalloc` feature (release builds): glibc's malloc and free were about a
/// quarter of the worker's instructions per intent (docs/benchmarks.md, "Cost per intent").
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The intent worker: records agent intents in a Postgres ledger, dispatches each logical
/// action at most once, and tells agents the truth (succeeded, pending, failed, rejected).
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// Always present: without arguments `main` supplies `run`.
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the worker (the default without a subcommand). Every setting is an environment
    /// variable (listed below with its default) and also a flag; a bad value stops start-up
    /// naming the variable, with exit code 2.
    #[command(
        after_help = "Span export over OTLP/HTTP is off unless OpenTelemetry's standard \
        variables turn it on: OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, \
        OTEL_TRACES_EXPORTER=otlp), with OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, \
        OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG, OTEL_EXPORTER_OTLP_HEADERS and OTEL_BSP_*. \
        See docs/tracing.md."
    )]
    Run(EnvArgs),
    /// Apply database migrations and exit (same settings as `run`; it needs DATABASE_URL).
    Migrate(EnvArgs),
    /// Operator actions on held and unresolved operations (same settings as `run`; they need
    /// DATABASE_URL and, for receipt checks and rechecks, WORKER_TOOLS).
    Ops {
        #[command(flatten)]
        settings: EnvArgs,
        #[command(subcommand)]
        command: worker::ops::cli::OpsCommand,
    },
    /// Health check for containers: GET the URL (e.g. http://127.0.0.1:9464/readyz); exit 0
    /// on a 2xx answer, 1 otherwise. Needs no other configuration.
    Probe {
        url: String,
        /// Give up after this many milliseconds.
        #[arg(long, default_value_t = 3000)]
        timeout_ms: u64,
    },
    /// Probe a tool's downstream (sandbox or staging: it WRITES) against the capability the
    /// tools file declares. Exit 0: nothing contradicts it; 1: a probe FAILed; 2: refused or
    /// not started. Needs only the tools file (`WORKER_TOOLS`).
    CheckTool(worker::ops::check_tool::CheckToolArgs),
}

/// What runs once the settings are read.
enum Job {
    Run,
    Migrate,
    Ops(worker::ops::cli::OpsCommand),
}

#[tokio::main]
async fn main() -> ExitCode {
    // No subcommand means `run`, configured from the environment alone (containers, tests).
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args.len() == 1 {
        args.push("run".into());
    }
    let matches = worker::config::blank_env_is_unset(Cli::command()).get_matches_from(args);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // One crypto provider (ring) for every TLS client of the process.
    worker::tls::install_default_provider();
    if let Command::Probe { url, timeout_ms } = &cli.command {
        let timeout = std::time::Duration::from_millis(*timeout_ms);
        return match worker::telemetry::health::probe(url, timeout).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("worker probe: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let (env_args, job) = match cli.command {
        Command::CheckTool(args) => {
            return ExitCode::from(worker::ops::check_tool::main(args).await)
        }
        Command::Run(a) => (a, Job::Run),
        Command::Migrate(a) => (a, Job::Migrate),
        Command::Ops { settings, command } => (settings, Job::Ops(command)),
        Command::Probe { .. } => unreachable!("probe returned above"),
    };
    let settings = match worker::config::Settings::from_args(env_args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("worker: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    let export = match worker::telemetry::trace_export(settings.ca_file.as_deref()) {
        Ok(e) => e,
        Err(e) => {
            eprintln!(
                "worker: configuration error: {}",
                worker::telemetry::chain(e.as_ref())
            );
            return ExitCode::from(2);
        }
    };
    worker::telemetry::init_logs(settings.log_json, export.as_ref());
    if let Some(template) = &settings.trace_url {
        worker::ops::actions::set_trace_url_template(template);
    }
    for warning in &settings.warnings {
        tracing::warn!("{warning}");
    }
    let result = match job {
        Job::Run => worker::app::run(settings).await,
        Job::Migrate => worker::app::migrate(&settings).await,
        Job::Ops(cmd) => worker::ops::cli::run(&settings, cmd).await,
    };
    if let Some(export) = export {
        export.shutdown(worker::telemetry::EXPORT_FLUSH).await;
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // A listener that cannot bind, or a tools file that is invalid, is a setting to
        // change, like any other bad value.
        Err(e)
            if e.downcast_ref::<kit::http::BindError>().is_some()
                || e.downcast_ref::<worker::config::ConfigError>().is_some() =>
        {
            eprintln!("worker: configuration error: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("worker: {}", worker::telemetry::chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}
