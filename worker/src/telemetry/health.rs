//! Health endpoints on the metrics listener and the `worker probe` client that container
//! health checks run (the runtime image has no curl).
//!
//! - `GET /livez`: 200 while the process serves HTTP at all.
//! - `GET /readyz`: 200 only while both broker links (consumer, relay) are up and the ledger
//!   answers (and takes writes) within [`LEDGER_TIMEOUT`]; otherwise 503 with a JSON body naming why.
//!   Both answers name the broker node each link is connected to (`broker_nodes`, `host:port`,
//!   null while down) and the ledger host in use (`ledger_host`); a read-only ledger host (a
//!   standby) is not ready.
//!   Each check also sets the `intent_worker_ready` gauge (1/0), which `/metrics` refreshes on
//!   every scrape, so a worker that stays unready can be alerted on.

use std::time::Duration;

use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};

use crate::amqp::LinkState;
use crate::ledger::Ledger;

/// 1 while this worker is ready (as `/readyz` answers), else 0: set by every check.
pub const READY: &str = "intent_worker_ready";

/// How long `/readyz` waits for the ledger before calling it unreachable.
pub const LEDGER_TIMEOUT: Duration = Duration::from_secs(2);

/// `GET /livez`.
pub async fn livez() -> (StatusCode, Json<Value>) {
    (StatusCode::OK, Json(json!({ "status": "live" })))
}

/// `GET /readyz`.
pub async fn readyz(links: &LinkState, ledger: &Ledger) -> (StatusCode, Json<Value>) {
    let mut reasons: Vec<String> = links
        .down()
        .into_iter()
        .map(|link| format!("broker {link} link is down (reconnecting)"))
        .collect();
    // A standby answers `SELECT 1` too: the question is whether the ledger takes writes.
    let hosts = ledger.hosts();
    let ping = crate::ledger::primary::read_only(ledger.pool());
    match tokio::time::timeout(LEDGER_TIMEOUT, ping).await {
        Ok(Ok(true)) if hosts.read_write() => reasons.push(format!(
            "ledger host {} is read-only (a standby, or a primary being demoted)",
            hosts.current_name()
        )),
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            hosts.observe(&e);
            reasons.push(
                hosts
                    .trouble()
                    .unwrap_or_else(|| format!("ledger does not answer: {e}")),
            );
        }
        Err(_) => reasons.push(hosts.trouble().unwrap_or_else(|| {
            format!(
                "ledger does not answer within {} ms",
                LEDGER_TIMEOUT.as_millis()
            )
        })),
    }
    metrics::gauge!(READY).set(if reasons.is_empty() { 1.0 } else { 0.0 });
    let [consumer, relay] = links.nodes();
    let nodes = json!({ "consumer": consumer, "relay": relay });
    let host = hosts.current_name();
    if reasons.is_empty() {
        (
            StatusCode::OK,
            Json(json!({ "status": "ready", "broker_nodes": nodes, "ledger_host": host })),
        )
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({
                "status": "not_ready", "reasons": reasons,
                "broker_nodes": nodes, "ledger_host": host,
            })),
        )
    }
}

/// Errors of `worker probe`.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("cannot reach {url}: {error}")]
    Request { url: String, error: reqwest::Error },
    #[error("{url} answered {status}: {body}")]
    NotOk {
        url: String,
        status: u16,
        body: String,
    },
}

/// `worker probe URL`: GETs `url` (e.g. `http://127.0.0.1:9464/readyz`) and succeeds only on a
/// 2xx answer within `timeout`.
pub async fn probe(url: &str, timeout: Duration) -> Result<(), ProbeError> {
    let request = |error| ProbeError::Request {
        url: url.to_string(),
        error,
    };
    // System roots only: the probe needs no configuration (an https:// health URL is rare).
    let client = crate::tls::http_client(&crate::tls::Trust::system())
        .timeout(timeout)
        .build()
        .map_err(request)?;
    let response = client.get(url).send().await.map_err(request)?;
    let status = response.status();
    if status.is_success() {
        return Ok(());
    }
    let body = response.text().await.unwrap_or_default();
    Err(ProbeError::NotOk {
        url: url.to_string(),
        status: status.as_u16(),
        body: body.chars().take(500).collect(),
    })
}
