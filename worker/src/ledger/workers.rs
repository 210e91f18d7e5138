//! The workers' heartbeats (`worker_heartbeats`): each worker says every few seconds whether it
//! is ready, so the console's overview can show every worker of the pool from any one of them.

use chrono::{DateTime, Utc};

use super::{Ledger, LedgerError};

kit::pg_row! {
    /// A worker as it last reported itself.
    #[derive(Debug, Clone, serde::Serialize)]
    pub struct Heartbeat {
        pub worker_id: String,
        pub ready: bool,
        /// Why it is not ready (empty when ready).
        pub reasons: String,
        pub started_at: DateTime<Utc>,
        pub seen_at: DateTime<Utc>,
        /// Seconds since `seen_at`, on the database clock.
        pub silent_secs: f64,
    }
}

impl Ledger {
    /// Records this worker's readiness now (and forgets workers silent for a day).
    pub async fn heartbeat(
        &self,
        worker_id: &str,
        ready: bool,
        reasons: &str,
        started_at: DateTime<Utc>,
    ) -> Result<(), LedgerError> {
        sqlx::query(
            "WITH gone AS (DELETE FROM worker_heartbeats WHERE seen_at < now() - interval '1 day')
             INSERT INTO worker_heartbeats (worker_id, ready, reasons, started_at, seen_at)
             VALUES ($1, $2, $3, $4, now())
             ON CONFLICT (worker_id) DO UPDATE
             SET ready = EXCLUDED.ready, reasons = EXCLUDED.reasons,
                 started_at = EXCLUDED.started_at, seen_at = now()",
        )
        .bind(worker_id)
        .bind(ready)
        .bind(reasons)
        .bind(started_at)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Workers heard from within `within`, most recently heard first.
    pub async fn heartbeats(
        &self,
        within: std::time::Duration,
    ) -> Result<Vec<Heartbeat>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT worker_id, ready, reasons, started_at, seen_at,
                    extract(epoch FROM now() - seen_at)::float8 AS silent_secs
             FROM worker_heartbeats
             WHERE seen_at >= now() - make_interval(secs => $1)
             ORDER BY seen_at DESC, worker_id",
        )
        .bind(within.as_secs_f64())
        .fetch_all(&self.pool)
        .await?)
    }
}
