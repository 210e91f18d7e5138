//! Bookkeeping that is not an operation's state: the shared retry budget and the redelivery
//! counter of the poison guard. Each check-and-spend is one transaction serialised per tool by
//! an advisory lock, so concurrent workers cannot overspend.

use std::time::Duration;

use super::{Ledger, LedgerError};
use crate::config::BudgetPolicy;

impl Ledger {
    /// Spends one retry of `operation_id` from `tool`'s budget if the window allows it. The
    /// spending is given back if the operation then succeeds (see `complete`).
    pub async fn try_spend_retry(
        &self,
        tool: &str,
        operation_id: i64,
        policy: &BudgetPolicy,
    ) -> Result<bool, LedgerError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('intent-worker:retry-budget:' || $1))")
            .bind(tool)
            .execute(&mut *tx)
            .await?;
        let spent: Option<i64> = sqlx::query_scalar(
            "INSERT INTO retry_spend (tool, operation_id)
             SELECT $1, $5 WHERE (SELECT count(*) FROM retry_spend
                              WHERE tool = $1 AND at > now() - make_interval(secs => $2))
                           < floor($3 * (SELECT count(*) FROM operations
                                         WHERE tool = $1 AND first_dispatch_at > now() - make_interval(secs => $2)))
                             + $4
             RETURNING id",
        )
        .bind(tool)
        .bind(policy.window_secs as f64)
        .bind(policy.ratio)
        .bind(floor(policy))
        .bind(operation_id)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(spent.is_some())
    }

    /// Retries `tool`'s budget still allows in the current window.
    pub async fn retry_budget_available(
        &self,
        tool: &str,
        policy: &BudgetPolicy,
    ) -> Result<f64, LedgerError> {
        Ok(sqlx::query_scalar(
            "SELECT (floor($3 * (SELECT count(*) FROM operations
                                 WHERE tool = $1 AND first_dispatch_at > now() - make_interval(secs => $2)))
                     + $4 - (SELECT count(*) FROM retry_spend
                             WHERE tool = $1 AND at > now() - make_interval(secs => $2)))::float8",
        )
        .bind(tool)
        .bind(policy.window_secs as f64)
        .bind(policy.ratio)
        .bind(floor(policy))
        .fetch_one(&self.pool)
        .await?)
    }

    /// Counts one more processing start of a redelivered message; returns the deliveries seen
    /// so far (the first, uncounted delivery included).
    pub async fn count_redelivery(&self, body_sha: &str) -> Result<i32, LedgerError> {
        let n: i32 = sqlx::query_scalar(
            "INSERT INTO intake_redeliveries (body_sha, deliveries) VALUES ($1, 2)
             ON CONFLICT (body_sha) DO UPDATE
                SET deliveries = intake_redeliveries.deliveries + 1, last_at = now()
             RETURNING deliveries",
        )
        .bind(body_sha)
        .fetch_one(&self.pool)
        .await?;
        Ok(n)
    }

    /// Forgets retry spending older than `age` (budget windows are at most a day).
    pub async fn prune_retry_spend(&self, age: Duration) -> Result<u64, LedgerError> {
        Ok(
            sqlx::query("DELETE FROM retry_spend WHERE at < now() - make_interval(secs => $1)")
                .bind(age.as_secs_f64())
                .execute(&self.pool)
                .await?
                .rows_affected(),
        )
    }

    /// Forgets redelivery counts older than `age`.
    pub async fn prune_redeliveries(&self, age: Duration) -> Result<u64, LedgerError> {
        Ok(sqlx::query(
            "DELETE FROM intake_redeliveries WHERE last_at < now() - make_interval(secs => $1)",
        )
        .bind(age.as_secs_f64())
        .execute(&self.pool)
        .await?
        .rows_affected())
    }
}

/// The floor for the window: `floor_per_minute` scaled to the window length.
fn floor(policy: &BudgetPolicy) -> f64 {
    (policy.floor_per_minute as f64 * policy.window_secs as f64 / 60.0).floor()
}
