//! Receipts in hand: a matching receipt the downstream returned is never dropped because the
//! ledger could not take it at once.
//!
//! Recording an outcome is retried while the ledger is unreachable (a cut link, a failover).
//! Other outcomes give up after one lease: by then recovery may own the row and will find out
//! again. A receipt is different: it is the downstream's own proof, and the receipt path may
//! settle any unresolved row (`dispatching`, `unknown`, `held`, `retry_wait`), whoever owns it,
//! so its recording is retried for [`Settings::receipt_keep`](crate::config::Settings) instead:
//! first through the fenced completion, and once another owner has moved the row, through the
//! receipt path, by the same statement. What is kept is bounded by count ([`MAX_KEPT`]) and age,
//! counted when either is exceeded; a worker asked to stop logs every receipt it must drop with
//! its key and receipt id, so that an operator can resolve it by hand.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use metrics::{counter, gauge};

use crate::telemetry::metrics as m;

/// Receipts kept at most while their recording is retried past the lease. Each is one receipt
/// body (bounded by the adapter's response limit) held by its dispatch task, which also keeps
/// its in-flight slot: the count is bounded by `WORKER_MAX_IN_FLIGHT` as well.
pub const MAX_KEPT: usize = 10_000;

/// One receipt whose recording is late.
#[derive(Debug, Clone)]
struct Kept {
    key: String,
    receipt_id: String,
    since: Instant,
}

/// The receipts this worker holds while the ledger cannot record them.
pub struct KeptReceipts {
    keep: Duration,
    kept: Mutex<HashMap<i64, Kept>>,
}

/// Why a kept receipt was given up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// Kept for `WORKER_RECEIPT_KEEP_SECS` and still not recorded.
    Age,
    /// [`MAX_KEPT`] receipts were already kept.
    Budget,
    /// The worker stopped before the ledger took it.
    Shutdown,
}

impl Dropped {
    fn as_str(self) -> &'static str {
        match self {
            Dropped::Age => "age",
            Dropped::Budget => "budget",
            Dropped::Shutdown => "shutdown",
        }
    }
}

impl KeptReceipts {
    pub fn new(keep: Duration) -> KeptReceipts {
        KeptReceipts {
            keep,
            kept: Mutex::new(HashMap::new()),
        }
    }

    /// How long a receipt is kept.
    pub fn keep(&self) -> Duration {
        self.keep
    }

    /// Starts keeping the receipt of `operation_id`; false (counted) when the budget is full.
    pub fn hold(&self, operation_id: i64, key: &str, receipt_id: &str) -> bool {
        let mut kept = self.lock();
        if kept.contains_key(&operation_id) {
            return true;
        }
        if kept.len() >= MAX_KEPT {
            drop(kept);
            self.dropped(key, receipt_id, Dropped::Budget);
            return false;
        }
        kept.insert(
            operation_id,
            Kept {
                key: key.to_string(),
                receipt_id: receipt_id.to_string(),
                since: Instant::now(),
            },
        );
        gauge!(m::RECEIPTS_KEPT).set(kept.len() as f64);
        true
    }

    /// The receipt of `operation_id` was recorded (or given up for `why`).
    pub fn release(&self, operation_id: i64, why: Option<Dropped>) {
        let mut kept = self.lock();
        let Some(k) = kept.remove(&operation_id) else {
            return;
        };
        gauge!(m::RECEIPTS_KEPT).set(kept.len() as f64);
        drop(kept);
        if let Some(why) = why {
            self.dropped(&k.key, &k.receipt_id, why);
        }
    }

    /// Receipts still kept (at shutdown: the ones about to be dropped), oldest first.
    pub fn drop_all(&self, why: Dropped) -> usize {
        let mut all: Vec<Kept> = self.lock().drain().map(|(_, k)| k).collect();
        gauge!(m::RECEIPTS_KEPT).set(0.0);
        all.sort_by_key(|k| k.since);
        for k in &all {
            self.dropped(&k.key, &k.receipt_id, why);
        }
        all.len()
    }

    /// How many receipts are kept now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn dropped(&self, key: &str, receipt_id: &str, why: Dropped) {
        counter!(m::RECEIPTS_DROPPED, "reason" => why.as_str()).increment(1);
        tracing::error!(
            idempotency_key = %key, receipt_id = %receipt_id, reason = why.as_str(),
            keep_secs = self.keep.as_secs(),
            "a receipt the downstream returned was never recorded; the operation stays \
             unresolved until recovery or an operator settles it with this receipt id"
        );
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i64, Kept>> {
        crate::lock(&self.kept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_budget_refuses_and_a_released_receipt_frees_its_place() {
        let kept = KeptReceipts::new(Duration::from_secs(600));
        for id in 0..MAX_KEPT as i64 {
            assert!(kept.hold(id, "t:a", "r"));
        }
        assert!(!kept.hold(-1, "t:b", "r"), "over the budget");
        assert!(kept.hold(0, "t:a", "r"), "already kept");
        kept.release(0, None);
        assert!(kept.hold(-1, "t:b", "r"));
        assert_eq!(kept.drop_all(Dropped::Shutdown), MAX_KEPT);
        assert!(kept.is_empty());
    }
}
