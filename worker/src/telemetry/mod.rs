//! Telemetry: the tracing subscriber (text or JSON logs on stderr), Prometheus metrics and the
//! health endpoints.

pub mod health;
pub mod metrics;

use tracing_subscriber::EnvFilter;

/// Installs the global log subscriber. `RUST_LOG` filters (default `info`, lapin quieter).
pub fn init_logs(json: bool) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,lapin=warn,sqlx=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = if json {
        builder.json().flatten_event(true).try_init()
    } else {
        builder.try_init()
    };
    // A second init (tests, library users with their own subscriber) is not an error.
    let _ = result;
}

/// Formats an error with its whole cause chain, for logs.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}
