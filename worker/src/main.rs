//! The `worker` binary: parses the command line and hands over to the library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The intent worker: records agent intents in a Postgres ledger, dispatches each logical
/// action at most once, and tells agents the truth (succeeded, pending, failed, rejected).
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the worker (the default). Configured from the environment; see the README.
    Run,
    /// Apply database migrations and exit.
    Migrate,
    /// Operator actions on held and unresolved operations.
    #[command(subcommand)]
    Ops(worker::ops::cli::OpsCommand),
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

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // One crypto provider (ring) for every TLS client of the process.
    worker::tls::install_default_provider();
    if let Some(Command::Probe { url, timeout_ms }) = &cli.command {
        let timeout = std::time::Duration::from_millis(*timeout_ms);
        return match worker::telemetry::health::probe(url, timeout).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("worker probe: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if let Some(Command::CheckTool(args)) = cli.command {
        return ExitCode::from(worker::ops::check_tool::main(args).await);
    }
    let settings = match worker::config::Settings::from_env() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("worker: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    worker::telemetry::init_logs(settings.log_json);
    let result = match cli.command.unwrap_or(Command::Run) {
        Command::Run => worker::app::run(settings).await,
        Command::Migrate => worker::app::migrate(&settings).await,
        Command::Ops(cmd) => worker::ops::cli::run(&settings, cmd).await,
        Command::Probe { .. } | Command::CheckTool(_) => {
            unreachable!("handled before the settings are read")
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("worker: {}", worker::telemetry::chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}
