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

/// Formats an error with its whole cause chain, each cause once: a cause whose text the message
/// already contains is skipped. Our own error types put a cause either in their message or in
/// `source()`, never both, but sqlx and lapin errors do both ("error returned from database: X"
/// with source X), which `{:#}` would print twice or three times.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !text.is_empty() && !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        source = cause.source();
    }
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn chain_prints_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let e = anyhow::Error::new(io)
            .context("cannot read tools file /x: no such file")
            .context("starting");
        assert_eq!(
            super::chain(e.as_ref()),
            "starting: cannot read tools file /x: no such file"
        );
    }
}
