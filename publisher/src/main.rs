//! `publisher`: send intents (and wait for answers), relay the outbox, follow results, run
//! the demo agent.

use std::io::IsTerminal;

use clap::Parser;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() {
    // One crypto provider (ring) for every TLS client of the process.
    publisher::tls::install_default_provider();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,lapin=off")),
        )
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    let cli = publisher::cli::Cli::parse();
    match publisher::cli::run(cli).await {
        Ok(code) => std::process::exit(code),
        Err(error) => {
            eprintln!("error: {}", publisher::cli::error_chain(&error));
            std::process::exit(publisher::cli::exit_code(&error));
        }
    }
}
