//! Telemetry: the tracing subscriber (text or JSON logs on stderr, spans exported over OTLP
//! when the standard `OTEL_*` variables ask for it), Prometheus metrics, the health
//! endpoints and the heartbeat the console's overview reads.

pub mod health;
pub mod heartbeat;
pub mod metrics;
pub mod spans;

pub use kit::otel::export::{Export, ExportError};

/// How long the trace exporter may take to flush at exit, after the relay's final round.
pub const EXPORT_FLUSH: std::time::Duration = std::time::Duration::from_secs(3);

/// The span exporter the standard `OTEL_*` variables ask for (`None`: export off, the
/// default), trusting what the worker's other TLS clients trust.
pub fn trace_export(ca_file: Option<&std::path::Path>) -> anyhow::Result<Option<Export>> {
    let trust = crate::tls::load(ca_file)?;
    Ok(kit::otel::export::from_env("intent-worker", &trust)?)
}

/// Installs the global log subscriber, with `export` recording our spans when given.
/// `RUST_LOG` filters logs (default `info`, lapin and sqlx quieter); message payloads are never
/// logged ([`kit::logs`]).
pub fn init_logs(json: bool, export: Option<&Export>) {
    use std::io::IsTerminal as _;
    let traces = match export {
        Some(e) => kit::logs::Traces::Export(e),
        None => kit::logs::Traces::Off,
    };
    kit::logs::init_with(
        json,
        std::io::stderr().is_terminal(),
        "info,lapin=warn,sqlx=warn",
        traces,
    );
    if let Some(e) = export {
        tracing::info!(endpoint = %e.endpoint, service = %e.service, "exporting spans over OTLP/HTTP");
    }
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
