//! `publisher`: send intents (and wait for answers), relay the outbox, follow results, run
//! the demo agent.

use std::io::IsTerminal;

use clap::Parser;

#[tokio::main]
async fn main() {
    // One crypto provider (ring) for every TLS client of the process.
    publisher::tls::install_default_provider();
    kit::logs::init(false, std::io::stderr().is_terminal(), "info,lapin=off");
    let cli = publisher::cli::Cli::parse();
    match publisher::cli::run(cli).await {
        Ok(code) => std::process::exit(code),
        Err(error) => {
            eprintln!("error: {}", publisher::cli::error_chain(&error));
            std::process::exit(publisher::cli::exit_code(&error));
        }
    }
}
