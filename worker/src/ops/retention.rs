//! Retention sweeper (placeholder until the operations issue lands).

use std::time::Duration;

use crate::ledger::Ledger;
use crate::shutdown::CancelToken;

pub async fn run(_ledger: Ledger, _retention: Duration, _tombstones: Duration, stop: CancelToken) {
    stop.cancelled().await;
}
