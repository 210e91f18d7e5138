//! Prometheus metrics of `publisher relay` and `publisher mcp`: the recorder and the
//! `/metrics` listener (`PUBLISHER_METRICS_ADDR`, `PUBLISHER_MCP_METRICS_ADDR`), the names of
//! what they measure themselves (the outbox gauges, database failovers) and the label values
//! they pre-register. A module that records a counter owns its name: the relay's rows
//! ([`crate::relay`]), malformed trace context ([`crate::trace::TRACE_CONTEXT_INVALID`]).
//!
//! The backlog gauges come from the outbox table and are refreshed on every scrape, so every
//! relay reports the same global figure: alert rules aggregate them with `max()`. The gateway's
//! listener has no pool and reports the counters only.

#[cfg(feature = "cli")]
pub use exporter::{install, serve};

pub const BACKLOG: &str = "intent_publisher_outbox_backlog";
pub const OLDEST_UNSENT: &str = "intent_publisher_outbox_oldest_unsent_age_seconds";
pub const FAILED_ROWS: &str = "intent_publisher_outbox_failed_rows";
pub const DB_FAILOVERS: &str = "intent_publisher_db_failovers_total";
/// The `source` labels of [`TRACE_CONTEXT_INVALID`](crate::trace::TRACE_CONTEXT_INVALID) in
/// `publisher relay`.
pub const RELAY_TRACE_SOURCES: &[&str] = &["outbox"];
/// The `source` labels of [`TRACE_CONTEXT_INVALID`](crate::trace::TRACE_CONTEXT_INVALID) in
/// `publisher mcp`.
pub const MCP_TRACE_SOURCES: &[&str] = &["mcp_meta", "http_header"];

/// The recorder and the listener: the `publisher` binary's (feature `cli`).
#[cfg(feature = "cli")]
mod exporter {

    use metrics::{counter, describe_counter, describe_gauge, gauge};
    use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
    use sqlx::PgPool;

    use super::*;
    use crate::relay::{PUBLISH_FAILURES, ROWS_FAILED, ROWS_SENT, ROWS_SWEPT};
    use crate::trace::TRACE_CONTEXT_INVALID;

    /// Failure reasons, pre-registered at 0 so rates exist before the first failure.
    const REASONS: [&str; 4] = ["unroutable", "nacked", "not_confirmed", "amqp"];
    /// Why rows are marked failed (`relay::refusal`), pre-registered at 0 likewise.
    const REFUSALS: [&str; 3] = ["key_too_long", "invalid_intent", "key_mismatch"];

    /// Installs the global recorder; returns the handle that renders the exposition text.
    /// `trace_sources` are the [`TRACE_CONTEXT_INVALID`] sources this process can count,
    /// pre-registered at 0.
    pub fn install(trace_sources: &[&'static str]) -> Result<PrometheusHandle, String> {
        let handle = PrometheusBuilder::new()
            .install_recorder()
            .map_err(|e| e.to_string())?;
        describe_gauge!(BACKLOG, "Unsent rows in intent_outbox (all relays).");
        describe_gauge!(
            OLDEST_UNSENT,
            "Age in seconds of the oldest unsent intent_outbox row (0 when none)."
        );
        describe_counter!(
            PUBLISH_FAILURES,
            "Outbox rows whose publish failed, by reason (unroutable, nacked, not_confirmed, amqp)."
        );
        describe_counter!(
            ROWS_SENT,
            "Outbox rows published, confirmed and marked sent."
        );
        describe_counter!(ROWS_SWEPT, "Sent outbox rows deleted after the retention.");
        describe_counter!(
            ROWS_FAILED,
            "Outbox rows that can never be published, marked failed and skipped, by reason (key_too_long, invalid_intent, key_mismatch)."
        );
        describe_gauge!(
            FAILED_ROWS,
            "intent_outbox rows marked failed (all relays); they stay until repaired or deleted."
        );
        describe_counter!(
            DB_FAILOVERS,
            "Failovers of the agent database seen: its primary turned read-only, or new connections moved to another host of PUBLISHER_DATABASE_URL."
        );
        describe_counter!(
            TRACE_CONTEXT_INVALID,
            "Malformed W3C trace context received, by source and header: a traceparent is ignored, a tracestate dropped alone; never a reason to refuse an intent."
        );
        for source in trace_sources {
            for header in ["traceparent", "tracestate"] {
                counter!(TRACE_CONTEXT_INVALID, "source" => *source, "header" => header)
                    .absolute(0);
            }
        }
        for reason in REASONS {
            counter!(PUBLISH_FAILURES, "reason" => reason).absolute(0);
        }
        for reason in REFUSALS {
            counter!(ROWS_FAILED, "reason" => reason).absolute(0);
        }
        counter!(ROWS_SENT).absolute(0);
        counter!(ROWS_SWEPT).absolute(0);
        counter!(DB_FAILOVERS).absolute(0);
        Ok(handle)
    }

    /// Serves `GET /metrics` with the listener `limits` ([`kit::http`]) until `shutdown` resolves.
    /// With `pool` (the relay's), the outbox gauges are measured on every scrape.
    pub async fn serve(
        listener: std::net::TcpListener,
        limits: kit::http::Limits,
        handle: PrometheusHandle,
        pool: Option<PgPool>,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        use axum::routing::get;
        let exporter = handle.clone();
        let app = axum::Router::new().route(
            "/metrics",
            get(move || {
                let handle = handle.clone();
                let pool = pool.clone();
                async move {
                    let Some(pool) = pool else {
                        return kit::metrics::exposition(&handle);
                    };
                    match crate::relay::backlog(&pool).await {
                        Ok((count, oldest)) => {
                            gauge!(BACKLOG).set(count as f64);
                            gauge!(OLDEST_UNSENT).set(oldest.max(0.0));
                        }
                        Err(error) => tracing::warn!(%error, "cannot measure the outbox backlog"),
                    }
                    match crate::relay::failed_rows(&pool).await {
                        Ok(count) => gauge!(FAILED_ROWS).set(count as f64),
                        Err(error) => tracing::warn!(%error, "cannot count the failed outbox rows"),
                    }
                    kit::metrics::exposition(&handle)
                }
            }),
        );
        kit::metrics::serve(listener, limits, exporter, app, shutdown).await
    }
}
