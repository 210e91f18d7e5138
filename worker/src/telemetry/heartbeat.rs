//! The heartbeat: every few seconds each worker records in the ledger whether its broker links
//! are up ([`crate::ledger::workers`]), so the operator console of any worker can show the
//! whole pool, ready or not. A worker whose ledger is unreachable cannot say so: its row just
//! stops being renewed, and the console shows it silent.

use std::time::Duration;

use chrono::Utc;
use tokio_util::sync::CancellationToken;

use crate::amqp::LinkState;
use crate::ledger::Ledger;

/// How often a worker reports.
pub const INTERVAL: Duration = Duration::from_secs(5);

/// Reports until `stop`.
pub async fn run(ledger: Ledger, worker_id: String, links: LinkState, stop: CancellationToken) {
    let started = Utc::now();
    // The first report waits (up to one interval) for the broker links, which connect right
    // after start-up: a worker is not shown not-ready for its first seconds.
    let first = tokio::time::Instant::now() + INTERVAL;
    while !links.down().is_empty() && tokio::time::Instant::now() < first {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(std::time::Duration::from_millis(100)) => {}
        }
    }
    loop {
        let down = links.down();
        let reasons: Vec<String> = down
            .iter()
            .map(|link| format!("broker {link} link is down"))
            .collect();
        if let Err(e) = ledger
            .heartbeat(&worker_id, down.is_empty(), &reasons.join("; "), started)
            .await
        {
            tracing::debug!(error = %e, "heartbeat not recorded");
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(INTERVAL) => {}
        }
    }
}
