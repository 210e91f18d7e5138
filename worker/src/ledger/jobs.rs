//! Bulk jobs of the operator console (`bulk_jobs`, `bulk_job_items`): create one from a search,
//! take the next items, record each item's outcome, hand a job whose worker died to another.
//!
//! A job never writes `operations` itself: each item goes through the operator action's own
//! guarded statement ([`super::operator`]); this module only keeps the job's set, its counts
//! and its owner. Every change is one conditional statement: an item's outcome is recorded
//! once (`outcome IS NULL`) together with the job's count, and only by the job's current owner
//! while the job runs, so a worker that lost the job cannot count twice.

use chrono::{DateTime, Utc};

use super::queries::{bind_search, OperationSearch};
use super::{Ledger, LedgerError};

kit::pg_row! {
    /// One bulk job, as its page shows it.
    #[derive(Debug, Clone, serde::Serialize)]
    pub struct Job {
        pub id: i64,
        pub request_id: String,
        pub action: String,
        pub filter: serde_json::Value,
        pub operator: String,
        pub reason: String,
        pub cap: i32,
        pub total: i32,
        pub done: i32,
        pub skipped: i32,
        pub refused: i32,
        /// `running`, `finished`, `cancelled` or `abandoned`.
        pub status: String,
        pub owner: Option<String>,
        pub lease_until: Option<DateTime<Utc>>,
        pub claims: i32,
        pub last_error: Option<String>,
        pub created_at: DateTime<Utc>,
        pub updated_at: DateTime<Utc>,
        pub finished_at: Option<DateTime<Utc>>,
    }
}

impl Job {
    /// Items with an outcome so far.
    pub fn processed(&self) -> i32 {
        self.done + self.skipped + self.refused
    }
}

kit::pg_row! {
    /// One item of a job.
    #[derive(Debug, Clone, serde::Serialize)]
    pub struct JobItem {
        pub operation_id: i64,
        /// None when retention deleted the operation.
        pub tenant: Option<String>,
        pub action_id: Option<String>,
        /// None until the item is processed.
        pub outcome: Option<String>,
        pub detail: Option<String>,
    }
}

/// What creating a job needs.
#[derive(Debug, Clone)]
pub struct NewJob<'a> {
    pub request_id: &'a str,
    pub action: &'a str,
    /// The console filter, kept for the job's page.
    pub filter: serde_json::Value,
    pub operator: &'a str,
    pub reason: &'a str,
    pub cap: i64,
    pub search: &'a OperationSearch,
    pub owner: &'a str,
    pub lease: std::time::Duration,
}

/// An item's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ItemOutcome {
    /// The action was applied (now, or by an earlier run of this job).
    Done,
    /// The row had moved on: the guarded statement matched nothing, nothing was written.
    Skipped,
    /// The action could not be asked for (bad input, tool not configured, row gone).
    Refused,
}

impl ItemOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            ItemOutcome::Done => "done",
            ItemOutcome::Skipped => "skipped",
            ItemOutcome::Refused => "refused",
        }
    }
}

const JOB_COLUMNS: &str = "id, request_id, action, filter, operator, reason, cap, total, done, \
     skipped, refused, status, owner, lease_until, claims, last_error, created_at, updated_at, \
     finished_at";

impl Ledger {
    /// Creates a job owned by `owner` with the first `cap` operations (by id) the search
    /// matches now, in one transaction. Creating with a request id already used returns that
    /// job (false: nothing was created).
    pub async fn create_job(&self, new: &NewJob<'_>) -> Result<(Job, bool), LedgerError> {
        let mut tx = self.pool.begin().await?;
        let id: Option<i64> = sqlx::query_scalar(
            "INSERT INTO bulk_jobs (request_id, action, filter, operator, reason, cap, owner,
                                    lease_until)
             VALUES ($1, $2, $3, $4, $5, $6, $7, now() + make_interval(secs => $8))
             ON CONFLICT (request_id) DO NOTHING RETURNING id",
        )
        .bind(new.request_id)
        .bind(new.action)
        .bind(&new.filter)
        .bind(new.operator)
        .bind(new.reason)
        .bind(new.cap as i32)
        .bind(new.owner)
        .bind(new.lease.as_secs_f64())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(id) = id else {
            tx.rollback().await?;
            let job = self
                .job_by_request(new.request_id)
                .await?
                .ok_or_else(|| LedgerError::NotFound(format!("job {}", new.request_id)))?;
            return Ok((job, false));
        };
        let sql = format!(
            "INSERT INTO bulk_job_items (job_id, operation_id)
             SELECT $12, id FROM operations WHERE {} ORDER BY id LIMIT $13",
            new.search.predicate()
        );
        let query = sqlx::query(sqlx::AssertSqlSafe(sql));
        let inserted = bind_search!(query, new.search)
            .bind(id)
            .bind(new.cap)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        let job: Job = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "UPDATE bulk_jobs SET total = $2,
                    status = CASE WHEN $2 = 0 THEN 'finished' ELSE status END,
                    finished_at = CASE WHEN $2 = 0 THEN now() END
             WHERE id = $1 RETURNING {JOB_COLUMNS}"
        )))
        .bind(id)
        .bind(inserted as i32)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok((job, true))
    }

    pub async fn job(&self, id: i64) -> Result<Option<Job>, LedgerError> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {JOB_COLUMNS} FROM bulk_jobs WHERE id = $1"
        )))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?)
    }

    async fn job_by_request(&self, request_id: &str) -> Result<Option<Job>, LedgerError> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {JOB_COLUMNS} FROM bulk_jobs WHERE request_id = $1"
        )))
        .bind(request_id)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// The newest jobs.
    pub async fn recent_jobs(&self, limit: i64) -> Result<Vec<Job>, LedgerError> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {JOB_COLUMNS} FROM bulk_jobs ORDER BY id DESC LIMIT $1"
        )))
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }

    /// The next operations of a job without an outcome, in id order.
    pub async fn job_pending_items(
        &self,
        job_id: i64,
        limit: i64,
    ) -> Result<Vec<i64>, LedgerError> {
        Ok(sqlx::query_scalar(
            "SELECT operation_id FROM bulk_job_items
             WHERE job_id = $1 AND outcome IS NULL ORDER BY operation_id LIMIT $2",
        )
        .bind(job_id)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }

    /// A job's items with their outcome (skipped and refused ones first), at most `limit`.
    pub async fn job_items(&self, job_id: i64, limit: i64) -> Result<Vec<JobItem>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT i.operation_id, o.tenant, o.action_id, i.outcome, i.detail
             FROM bulk_job_items i LEFT JOIN operations o ON o.id = i.operation_id
             WHERE i.job_id = $1
             ORDER BY CASE i.outcome WHEN 'refused' THEN 0 WHEN 'skipped' THEN 1
                                     WHEN 'done' THEN 3 ELSE 2 END, i.operation_id
             LIMIT $2",
        )
        .bind(job_id)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Records one item's outcome and counts it, renewing the owner's lease: one statement,
    /// applied only while `owner` owns the running job and the item has no outcome yet. False
    /// when the job is no longer this owner's to run (cancelled, or taken over).
    pub async fn record_job_item(
        &self,
        job_id: i64,
        operation_id: i64,
        outcome: ItemOutcome,
        detail: &str,
        owner: &str,
        lease: std::time::Duration,
    ) -> Result<bool, LedgerError> {
        let still_ours: Option<i64> = sqlx::query_scalar(
            "WITH job AS (
                 SELECT id FROM bulk_jobs WHERE id = $1 AND owner = $5 AND status = 'running'),
             item AS (
                 UPDATE bulk_job_items SET outcome = $3, detail = $4
                 WHERE job_id = (SELECT id FROM job) AND operation_id = $2 AND outcome IS NULL
                 RETURNING outcome)
             UPDATE bulk_jobs j
             SET done = done + (SELECT count(*) FROM item WHERE outcome = 'done'),
                 skipped = skipped + (SELECT count(*) FROM item WHERE outcome = 'skipped'),
                 refused = refused + (SELECT count(*) FROM item WHERE outcome = 'refused'),
                 lease_until = now() + make_interval(secs => $6), updated_at = now()
             WHERE j.id = (SELECT id FROM job)
             RETURNING j.id",
        )
        .bind(job_id)
        .bind(operation_id)
        .bind(outcome.as_str())
        .bind(detail)
        .bind(owner)
        .bind(lease.as_secs_f64())
        .fetch_optional(&self.pool)
        .await?;
        Ok(still_ours.is_some())
    }

    /// Marks the owner's running job finished once no item lacks an outcome.
    pub async fn finish_job(&self, job_id: i64, owner: &str) -> Result<bool, LedgerError> {
        let done = sqlx::query(
            "UPDATE bulk_jobs SET status = 'finished', finished_at = now(), updated_at = now(),
                    owner = NULL, lease_until = NULL
             WHERE id = $1 AND owner = $2 AND status = 'running'
               AND NOT EXISTS (SELECT 1 FROM bulk_job_items
                               WHERE job_id = $1 AND outcome IS NULL)",
        )
        .bind(job_id)
        .bind(owner)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Notes why the owner's job paused (a ledger error), renewing nothing.
    pub async fn note_job_error(
        &self,
        job_id: i64,
        owner: &str,
        error: &str,
    ) -> Result<(), LedgerError> {
        sqlx::query(
            "UPDATE bulk_jobs SET last_error = $3, updated_at = now()
             WHERE id = $1 AND owner = $2 AND status = 'running'",
        )
        .bind(job_id)
        .bind(owner)
        .bind(error)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Stops a running job: items without an outcome are left as they are.
    pub async fn cancel_job(&self, job_id: i64) -> Result<Option<Job>, LedgerError> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "UPDATE bulk_jobs SET status = 'cancelled', finished_at = now(), updated_at = now(),
                    owner = NULL, lease_until = NULL
             WHERE id = $1 AND status = 'running' RETURNING {JOB_COLUMNS}"
        )))
        .bind(job_id)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Takes over one running job whose owner's lease lapsed (its worker died or stopped), for
    /// `owner`; a job already taken `max_claims` times is marked abandoned instead.
    pub async fn take_over_job(
        &self,
        owner: &str,
        lease: std::time::Duration,
        max_claims: i32,
    ) -> Result<Option<Job>, LedgerError> {
        sqlx::query(
            "UPDATE bulk_jobs SET status = 'abandoned', finished_at = now(), updated_at = now(),
                    owner = NULL, lease_until = NULL,
                    last_error = coalesce(last_error || '; ', '')
                                 || 'abandoned after ' || claims || ' workers took it'
             WHERE status = 'running' AND lease_until < now() AND claims >= $1",
        )
        .bind(max_claims)
        .execute(&self.pool)
        .await?;
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "UPDATE bulk_jobs SET owner = $1, lease_until = now() + make_interval(secs => $2),
                    claims = claims + 1, updated_at = now()
             WHERE id = (SELECT id FROM bulk_jobs
                         WHERE status = 'running' AND lease_until < now()
                         ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
               AND status = 'running' AND lease_until < now()
             RETURNING {JOB_COLUMNS}"
        )))
        .bind(owner)
        .bind(lease.as_secs_f64())
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Deletes jobs that ended longer ago than `older_than` (with their items).
    pub async fn delete_old_jobs(
        &self,
        older_than: std::time::Duration,
    ) -> Result<u64, LedgerError> {
        Ok(sqlx::query(
            "DELETE FROM bulk_jobs
             WHERE status <> 'running' AND finished_at < now() - make_interval(secs => $1)",
        )
        .bind(older_than.as_secs_f64())
        .execute(&self.pool)
        .await?
        .rows_affected())
    }
}
