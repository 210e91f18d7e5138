//! `publisher`: send intents (and wait for answers), relay the outbox, follow results, run
//! the MCP gateway. Here: TLS trust and span export (before logging starts, so the log
//! subscriber carries the span layer), logging, the command, the export's flush.

use std::io::IsTerminal;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches};

/// What is logged unless `RUST_LOG` says otherwise.
const LOG_FILTER: &str = "info,lapin=off";
/// How long spans still queued for export may take to leave at exit.
const EXPORT_FLUSH: Duration = Duration::from_secs(5);

#[tokio::main]
async fn main() {
    // One crypto provider (ring) for every TLS client of the process.
    publisher::tls::install_default_provider();
    // A blank variable (`PUBLISHER_STATUS_TOKEN=` when the token was not exported) is unset.
    let matches = kit::cli::blank_env_is_unset(publisher::cli::Cli::command()).get_matches();
    let cli = publisher::cli::Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let ansi = std::io::stderr().is_terminal();
    let export = match publisher::cli::prepare(&cli) {
        Ok(export) => export,
        Err(error) => {
            kit::logs::init(false, ansi, LOG_FILTER);
            eprintln!("error: {}", publisher::cli::error_chain(&error));
            std::process::exit(publisher::cli::exit_code(&error));
        }
    };
    let traces = match &export {
        Some(export) => kit::logs::Traces::Export(export),
        None => kit::logs::Traces::Off,
    };
    kit::logs::init_with(false, ansi, LOG_FILTER, traces);
    if let Some(export) = &export {
        tracing::info!(endpoint = %export.endpoint, service = %export.service, "exporting spans over OTLP/HTTP");
    }
    let outcome = publisher::cli::run(cli).await;
    if let Some(export) = export {
        export.shutdown(EXPORT_FLUSH).await;
    }
    match outcome {
        Ok(code) => std::process::exit(code),
        Err(error) => {
            eprintln!("error: {}", publisher::cli::error_chain(&error));
            std::process::exit(publisher::cli::exit_code(&error));
        }
    }
}
