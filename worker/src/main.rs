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
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
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
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("worker: {e:#}");
            ExitCode::FAILURE
        }
    }
}
