//! Telemetry: the tracing subscriber (text or JSON logs on stderr), Prometheus metrics and the
//! health endpoints.

pub mod health;
pub mod metrics;

/// Installs the global log subscriber. `RUST_LOG` filters (default `info`, lapin and sqlx
/// quieter); message payloads are never logged ([`kit::logs`]).
pub fn init_logs(json: bool) {
    use std::io::IsTerminal as _;
    kit::logs::init(
        json,
        std::io::stderr().is_terminal(),
        "info,lapin=warn,sqlx=warn",
    );
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
