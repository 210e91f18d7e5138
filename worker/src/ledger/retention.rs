//! Retention: private data (arguments, receipts, call ids, and a long-running operation's
//! acceptance, which may echo the arguments) of finished operations is removed
//! after the retention period, leaving a tombstone (key, fingerprint, final state, receipt id,
//! evidence) that still suppresses an old retry; tombstones are deleted after the longer
//! tombstone retention. Every pass works in small batches (`LIMIT` + `FOR UPDATE SKIP LOCKED`)
//! through partial indexes, so it stays cheap on a large table and never blocks the workers.
//! Unresolved rows are never touched.

use std::time::Duration;

use super::{Ledger, LedgerError};

/// Rows per statement.
pub const SWEEP_BATCH: i64 = 1000;

/// What one sweep removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Finished operations whose arguments, receipt and acceptance were removed.
    pub private_data: u64,
    /// Tombstones deleted.
    pub tombstones: u64,
    /// Published result events deleted.
    pub outbox: u64,
    /// Poison-guard redelivery counters forgotten.
    pub redeliveries: u64,
}

impl SweepReport {
    pub fn total(&self) -> u64 {
        self.private_data + self.tombstones + self.outbox + self.redeliveries
    }
}

impl Ledger {
    /// Removes private data from up to `limit` operations finished before `retention` ago.
    pub async fn sweep_private_batch(
        &self,
        retention: Duration,
        limit: i64,
    ) -> Result<u64, LedgerError> {
        Ok(sqlx::query(
            "UPDATE operations
             SET arguments = NULL, receipt = NULL, call_id = NULL, acceptance = NULL,
                 swept_at = now(),
                 changed_by = 'retention'
             WHERE id IN (
                SELECT id FROM operations
                WHERE finished_at < now() - make_interval(secs => $1)
                  AND swept_at IS NULL
                  AND state IN ('succeeded', 'failed')
                ORDER BY finished_at
                LIMIT $2
                FOR UPDATE SKIP LOCKED
             )
             AND state IN ('succeeded', 'failed')",
        )
        .bind(retention.as_secs_f64())
        .bind(limit)
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    /// Deletes up to `limit` tombstones of operations finished before `tombstone_retention`
    /// ago (their history and operator requests go with them). Their result events stay, the
    /// record of what the agent was told, unlinked in the same statement (the outbox has no
    /// foreign key to do it: migration 0015).
    pub async fn delete_tombstones_batch(
        &self,
        tombstone_retention: Duration,
        limit: i64,
    ) -> Result<u64, LedgerError> {
        let deleted: i64 = sqlx::query_scalar(
            "WITH gone AS (
                DELETE FROM operations
                WHERE id IN (
                    SELECT id FROM operations
                    WHERE finished_at < now() - make_interval(secs => $1)
                      AND state IN ('succeeded', 'failed')
                    ORDER BY finished_at
                    LIMIT $2
                    FOR UPDATE SKIP LOCKED
                )
                AND state IN ('succeeded', 'failed')
                RETURNING id
             ), unlinked AS (
                UPDATE result_outbox SET operation_id = NULL
                WHERE operation_id IN (SELECT id FROM gone)
             )
             SELECT count(*) FROM gone",
        )
        .bind(tombstone_retention.as_secs_f64())
        .bind(limit)
        .fetch_one(&self.pool)
        .await?;
        Ok(deleted as u64)
    }

    /// Deletes up to `limit` result events published before `retention` ago (their payloads
    /// carry receipts): marked published that long ago, or recorded published through their
    /// relay epoch's watermark and written that long ago.
    pub async fn delete_published_events_batch(
        &self,
        retention: Duration,
        limit: i64,
    ) -> Result<u64, LedgerError> {
        let marked = sqlx::query(
            "DELETE FROM result_outbox
             WHERE id IN (
                SELECT id FROM result_outbox
                WHERE published_at < now() - make_interval(secs => $1)
                ORDER BY published_at
                LIMIT $2
                FOR UPDATE SKIP LOCKED
             )",
        )
        .bind(retention.as_secs_f64())
        .bind(limit)
        .execute(&self.pool)
        .await?
        .rows_affected();
        if marked as i64 >= limit {
            return Ok(marked);
        }
        let covered = sqlx::query(
            "DELETE FROM result_outbox
             WHERE id IN (
                SELECT r.id FROM result_outbox r
                WHERE r.created_at < now() - make_interval(secs => $1)
                  AND r.published_at IS NULL AND r.relay_epoch IS NOT NULL
                  AND NOT EXISTS (SELECT 1 FROM relay_epochs e
                                  WHERE e.id = r.relay_epoch AND r.id > e.through_id)
                ORDER BY r.created_at
                LIMIT $2
                FOR UPDATE SKIP LOCKED
             )",
        )
        .bind(retention.as_secs_f64())
        .bind(limit - marked as i64)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(marked + covered)
    }
}
