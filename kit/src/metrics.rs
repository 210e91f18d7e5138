//! The metrics listener both binaries run: the Prometheus exporter's upkeep, `GET /metrics` in
//! Prometheus text format, and whatever health routes the binary adds, served with the
//! listener limits of [`crate::http`].

use std::time::Duration;

use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use metrics_exporter_prometheus::PrometheusHandle;

/// The exposition of `handle` as a `GET /metrics` answer.
pub fn exposition(handle: &PrometheusHandle) -> impl IntoResponse {
    (
        [(CONTENT_TYPE, "text/plain; version=0.0.4")],
        handle.render(),
    )
}

/// Keeps the exporter's histograms and idle series tidy (upkeep every 5 s), and serves
/// `routes` on `listener` (bound at start-up: [`crate::http::bind`]) with `limits` until
/// `shutdown` resolves.
pub async fn serve(
    listener: std::net::TcpListener,
    limits: crate::http::Limits,
    handle: PrometheusHandle,
    routes: axum::Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    tracing::info!(addr = %listener.local_addr()?, "metrics listening");
    let upkeep = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            handle.run_upkeep();
        }
    });
    let served = crate::http::serve(listener, routes, limits, shutdown).await;
    upkeep.abort();
    served
}
