//! Read-only queries: one operation, its history, and the figures the metrics report.

use chrono::{DateTime, Utc};

use super::{Ledger, LedgerError, Operation, OPERATION_COLUMNS};

/// One history entry of an operation (appended by the database on every change).
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct HistoryEntry {
    pub at: DateTime<Utc>,
    pub from_state: Option<String>,
    pub to_state: String,
    pub fence: i64,
    pub actor: String,
    pub evidence: Option<String>,
    /// Write attempts so far, and the next attempt the change scheduled (if any).
    pub attempts: Option<i32>,
    pub next_attempt_at: Option<DateTime<Utc>>,
}

/// Oldest unresolved operation of one tool in one state.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct UnresolvedAge {
    pub tool: String,
    pub state: String,
    pub count: i64,
    pub oldest_age_secs: f64,
}

impl Ledger {
    pub async fn find(
        &self,
        tenant: &str,
        action_id: &str,
    ) -> Result<Option<Operation>, LedgerError> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {OPERATION_COLUMNS} FROM operations WHERE tenant = $1 AND action_id = $2"
        )))
        .bind(tenant)
        .bind(action_id)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// The rows of these keys that exist, in one read-only statement (the intake's lookup
    /// for messages that must not be admitted but may name a key that has a row).
    pub async fn find_keys(
        &self,
        keys: &[(String, String)],
    ) -> Result<Vec<Operation>, LedgerError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let (tenants, action_ids): (Vec<&str>, Vec<&str>) =
            keys.iter().map(|(t, a)| (t.as_str(), a.as_str())).unzip();
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {cols} FROM operations o
             JOIN unnest($1::text[], $2::text[]) AS k(tenant, action_id) USING (tenant, action_id)",
            cols = super::admit::prefixed("o", OPERATION_COLUMNS)
        )))
        .bind(&tenants)
        .bind(&action_ids)
        .fetch_all(&self.pool)
        .await?)
    }

    pub async fn get(&self, id: i64) -> Result<Option<Operation>, LedgerError> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {OPERATION_COLUMNS} FROM operations WHERE id = $1"
        )))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?)
    }

    pub async fn history(&self, operation_id: i64) -> Result<Vec<HistoryEntry>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT at, from_state, to_state, fence, actor, evidence, attempts, next_attempt_at
             FROM operation_history WHERE operation_id = $1 ORDER BY id",
        )
        .bind(operation_id)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Operations per state.
    pub async fn count_by_state(&self) -> Result<Vec<(String, i64)>, LedgerError> {
        Ok(
            sqlx::query_as("SELECT state, count(*) FROM operations GROUP BY state")
                .fetch_all(&self.pool)
                .await?,
        )
    }

    /// Per tool and unresolved state: how many and how long ago the oldest was recorded. Only
    /// rows in the partial index `operations_unresolved` are read, so this stays cheap however
    /// many finished rows the table holds. A `dispatching` row counts only once its lease has
    /// expired (stuck), since a live dispatch is not unresolved work.
    pub async fn unresolved_ages(&self) -> Result<Vec<UnresolvedAge>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT tool, state, count(*) AS count,
                    extract(epoch FROM now() - min(created_at))::float8 AS oldest_age_secs
             FROM operations
             WHERE state IN ('retry_wait', 'unknown', 'held')
                OR (state = 'dispatching' AND lease_until < now())
             GROUP BY tool, state",
        )
        .fetch_all(&self.pool)
        .await?)
    }
}
