//! The retention sweeper: removes private data (arguments, receipts, call ids) of operations
//! finished longer than `retention` ago, keeping a tombstone (key, fingerprint, final state) so
//! an old retry still cannot run twice; deletes tombstones after `tombstone_retention`, published
//! result events after `retention`, stale poison-guard counters and old retry-budget spending. Unresolved operations are
//! never touched. Each statement handles at most [`SWEEP_BATCH`] rows and skips locked ones.

use std::time::Duration;

use metrics::counter;
use tokio_util::sync::CancellationToken;

use crate::ledger::retention::SWEEP_BATCH;
use crate::ledger::{Ledger, LedgerError, SweepReport};
use crate::telemetry::metrics as m;

/// Batches per kind in one sweep; the rest waits for the next pass, so a huge backlog never
/// holds one pass (or shutdown) for long.
const MAX_BATCHES_PER_PASS: usize = 100;

/// How often the sweeper runs: a tenth of the retention, at least 1 s and at most 60 s.
pub fn interval(retention: Duration) -> Duration {
    (retention / 10).clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// Repeats one batch statement until it returns a short batch (or the pass limit).
async fn drain<F, Fut>(mut batch: F) -> Result<u64, LedgerError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<u64, LedgerError>>,
{
    let mut total = 0;
    for _ in 0..MAX_BATCHES_PER_PASS {
        let n = batch().await?;
        total += n;
        if n < SWEEP_BATCH as u64 {
            break;
        }
    }
    Ok(total)
}

/// One sweep pass over all kinds.
pub async fn sweep_once(
    ledger: &Ledger,
    retention: Duration,
    tombstone_retention: Duration,
) -> Result<SweepReport, LedgerError> {
    let private_data = drain(|| ledger.sweep_private_batch(retention, SWEEP_BATCH)).await?;
    counter!(m::SWEPT, "kind" => "private_data").increment(private_data);
    let tombstones =
        drain(|| ledger.delete_tombstones_batch(tombstone_retention, SWEEP_BATCH)).await?;
    counter!(m::SWEPT, "kind" => "tombstone").increment(tombstones);
    let outbox = drain(|| ledger.delete_published_events_batch(retention, SWEEP_BATCH)).await?;
    counter!(m::SWEPT, "kind" => "outbox").increment(outbox);
    let redeliveries = ledger.prune_redeliveries(retention).await?;
    counter!(m::SWEPT, "kind" => "redelivery").increment(redeliveries);
    // Retry budget windows are at most a day (config validation), so older spending is inert.
    let spend = ledger
        .prune_retry_spend(Duration::from_secs(86_400))
        .await?;
    counter!(m::SWEPT, "kind" => "retry_spend").increment(spend);
    let console_ids = drain(|| ledger.delete_expired_console_ids(SWEEP_BATCH)).await?;
    counter!(m::SWEPT, "kind" => "console_id").increment(console_ids);
    Ok(SweepReport {
        private_data,
        tombstones,
        outbox,
        redeliveries,
    })
}

/// Runs the sweeper until `stop` fires.
pub async fn run(
    ledger: Ledger,
    retention: Duration,
    tombstone_retention: Duration,
    stop: CancellationToken,
) {
    if tombstone_retention < retention {
        tracing::warn!(
            retention_secs = retention.as_secs(),
            tombstone_retention_secs = tombstone_retention.as_secs(),
            "tombstone retention is shorter than retention: finished operations are deleted whole"
        );
    }
    let mut tick = tokio::time::interval(interval(retention));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        match sweep_once(&ledger, retention, tombstone_retention).await {
            Ok(report) if report.total() > 0 => {
                tracing::info!(
                    private_data = report.private_data,
                    tombstones = report.tombstones,
                    outbox = report.outbox,
                    redeliveries = report.redeliveries,
                    "retention sweep"
                );
            }
            Ok(_) => {}
            Err(e) => {
                ledger.failed("retention", &e);
                tracing::warn!(error = %e, "retention sweep failed; retrying next tick");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interval_is_a_tenth_of_retention_between_1_and_60_seconds() {
        assert_eq!(interval(Duration::ZERO), Duration::from_secs(1));
        assert_eq!(interval(Duration::from_secs(50)), Duration::from_secs(5));
        assert_eq!(
            interval(Duration::from_secs(86_400)),
            Duration::from_secs(60)
        );
    }
}
