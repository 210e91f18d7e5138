//! Bookkeeping that is not an operation's state: the shared retry budget (a token bucket per
//! tool, see `migrations/0006_retry_tokens.sql`) and the redelivery counter of the poison
//! guard. Each spend or refill is one statement on the tool's row, which the row lock
//! serialises, so concurrent workers cannot overspend.

use std::time::Duration;

use super::{Ledger, LedgerError};
use crate::retry::BudgetPolicy;

impl Ledger {
    /// Sends one retry (or replay) of `tool` if its token bucket allows it: one conditional
    /// statement that applies the time refill and this worker's not yet recorded `pending`
    /// outcomes, then spends one token only if the level exceeds half the capacity. The row is
    /// locked for the statement, so all workers spend from one bucket. True: the retry may be
    /// sent (the token is spent and only a success earns it back).
    pub async fn try_spend_retry(
        &self,
        tool: &str,
        policy: &BudgetPolicy,
        pending: f64,
    ) -> Result<bool, LedgerError> {
        let (capacity, rate) = (capacity(policy), refill_per_sec(policy));
        for _ in 0..2 {
            let spent: Option<bool> = sqlx::query_scalar(
                "WITH cur AS (
                    SELECT tool, greatest(0, least($2, tokens + $3 * extract(epoch FROM now() - updated_at)
                                                   + $4)) AS level
                    FROM retry_tokens WHERE tool = $1 FOR UPDATE)
                 UPDATE retry_tokens b
                 SET tokens = cur.level - CASE WHEN cur.level > $2 / 2 THEN 1 ELSE 0 END,
                     updated_at = now()
                 FROM cur WHERE b.tool = cur.tool
                 RETURNING cur.level > $2 / 2",
            )
            .bind(tool)
            .bind(capacity)
            .bind(rate)
            .bind(pending)
            .fetch_optional(&self.pool)
            .await?;
            if let Some(spent) = spent {
                return Ok(spent);
            }
            // First use of this tool: a full bucket, then spend from it.
            sqlx::query(
                "INSERT INTO retry_tokens (tool, tokens) VALUES ($1, $2) ON CONFLICT (tool) DO NOTHING",
            )
            .bind(tool)
            .bind(capacity)
            .execute(&self.pool)
            .await?;
        }
        Err(LedgerError::Refused(format!(
            "retry budget row for tool {tool} vanished"
        )))
    }

    /// Records outcomes in `tool`'s bucket: `delta` tokens (negative for failures), with the
    /// time refill, clamped to `0..=capacity`. One statement.
    pub async fn adjust_retry_tokens(
        &self,
        tool: &str,
        policy: &BudgetPolicy,
        delta: f64,
    ) -> Result<(), LedgerError> {
        sqlx::query(
            "INSERT INTO retry_tokens AS b (tool, tokens) VALUES ($1, greatest(0, least($2, $2 + $4)))
             ON CONFLICT (tool) DO UPDATE
             SET tokens = greatest(0, least($2, b.tokens + $3 * extract(epoch FROM now() - b.updated_at)
                                            + $4)),
                 updated_at = now()",
        )
        .bind(tool)
        .bind(capacity(policy))
        .bind(refill_per_sec(policy))
        .bind(delta)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Retries `tool`'s bucket allows right now: whole tokens above half the capacity (a full
    /// bucket when the tool has not retried yet).
    pub async fn retry_budget_available(
        &self,
        tool: &str,
        policy: &BudgetPolicy,
    ) -> Result<f64, LedgerError> {
        let capacity = capacity(policy);
        let level: Option<f64> = sqlx::query_scalar(
            "SELECT least($2, tokens + $3 * extract(epoch FROM now() - updated_at))::float8
             FROM retry_tokens WHERE tool = $1",
        )
        .bind(tool)
        .bind(capacity)
        .bind(refill_per_sec(policy))
        .fetch_optional(&self.pool)
        .await?;
        Ok((level.unwrap_or(capacity) - capacity / 2.0).ceil().max(0.0))
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

/// The bucket's capacity: twice the floor of one window (`floor_per_minute × window_secs / 60`),
/// at least 2, so a full bucket allows a burst of one window's floor before it throttles.
pub fn capacity(policy: &BudgetPolicy) -> f64 {
    (2.0 * policy.floor_per_minute as f64 * policy.window_secs as f64 / 60.0)
        .floor()
        .max(2.0)
}

/// Tokens the bucket regains per second whatever happens (`floor_per_minute / 60`).
pub fn refill_per_sec(policy: &BudgetPolicy) -> f64 {
    policy.floor_per_minute as f64 / 60.0
}
