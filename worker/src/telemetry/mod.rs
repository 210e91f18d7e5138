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

/// Formats an error with its whole cause chain, each cause once ([`kit::errors::chain`]).
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    kit::errors::chain(e)
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
