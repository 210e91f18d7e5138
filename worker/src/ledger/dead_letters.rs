//! The audit of dead-letter actions (`dead_letter_actions`): who republished or discarded which
//! dead letter, when and why, keyed by the request id of the step.
//!
//! A step is recorded `started` before the broker is touched and `done` (or `not_found`) after,
//! each by one conditional statement; a repeated request finds its row: a finished step is
//! not done again, an interrupted one (`started`) is finished by the repeat.

use chrono::{DateTime, Utc};

use super::{Ledger, LedgerError};

kit::pg_row! {
    /// One audited step.
    #[derive(Debug, Clone, serde::Serialize)]
    pub struct DeadLetterAction {
        pub request_id: String,
        /// `republish` or `discard`.
        pub action: String,
        pub dead_letter_id: String,
        pub message_id: Option<String>,
        pub reason: Option<String>,
        pub tenant: Option<String>,
        pub original_user: Option<String>,
        pub operator: String,
        pub note: String,
        /// `started`, `done` or `not_found`.
        pub status: String,
        pub created_at: DateTime<Utc>,
        pub finished_at: Option<DateTime<Utc>>,
    }
}

/// What a new step records.
#[derive(Debug, Clone)]
pub struct NewDeadLetterAction<'a> {
    pub request_id: &'a str,
    pub action: &'a str,
    pub dead_letter_id: &'a str,
    pub message_id: Option<&'a str>,
    pub reason: Option<&'a str>,
    pub tenant: Option<&'a str>,
    pub original_user: Option<&'a str>,
    pub operator: &'a str,
    pub note: &'a str,
}

/// What recording the start of a step found.
#[derive(Debug, Clone)]
pub enum Started {
    /// First time for this request id: go ahead.
    New,
    /// The request id was seen: its row as it stands.
    Seen(Box<DeadLetterAction>),
}

const COLUMNS: &str = "request_id, action, dead_letter_id, message_id, reason, tenant, \
     original_user, operator, note, status, created_at, finished_at";

impl Ledger {
    /// Records a step as `started`, unless its request id was seen.
    pub async fn start_dead_letter_action(
        &self,
        new: &NewDeadLetterAction<'_>,
    ) -> Result<Started, LedgerError> {
        let inserted: Option<String> = sqlx::query_scalar(
            "INSERT INTO dead_letter_actions (request_id, action, dead_letter_id, message_id,
                 reason, tenant, original_user, operator, note, status)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'started')
             ON CONFLICT (request_id) DO NOTHING RETURNING request_id",
        )
        .bind(new.request_id)
        .bind(new.action)
        .bind(new.dead_letter_id)
        .bind(new.message_id)
        .bind(new.reason)
        .bind(new.tenant)
        .bind(new.original_user)
        .bind(new.operator)
        .bind(new.note)
        .fetch_optional(&self.pool)
        .await?;
        if inserted.is_some() {
            return Ok(Started::New);
        }
        let seen = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM dead_letter_actions WHERE request_id = $1"
        )))
        .bind(new.request_id)
        .fetch_one(&self.pool)
        .await?;
        Ok(Started::Seen(Box::new(seen)))
    }

    /// The step recorded under a request id, if any.
    pub async fn dead_letter_action(
        &self,
        request_id: &str,
    ) -> Result<Option<DeadLetterAction>, LedgerError> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM dead_letter_actions WHERE request_id = $1"
        )))
        .bind(request_id)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// The steps one request made (request ids `<request id>:…`).
    pub async fn dead_letter_actions_of(
        &self,
        request_id: &str,
    ) -> Result<Vec<DeadLetterAction>, LedgerError> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM dead_letter_actions
             WHERE starts_with(request_id, $1 || ':') ORDER BY created_at"
        )))
        .bind(request_id)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Ends a started step as `done` or `not_found`.
    pub async fn finish_dead_letter_action(
        &self,
        request_id: &str,
        status: &str,
    ) -> Result<(), LedgerError> {
        sqlx::query(
            "UPDATE dead_letter_actions SET status = $2, finished_at = now()
             WHERE request_id = $1 AND status = 'started'",
        )
        .bind(request_id)
        .bind(status)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The newest steps (of one tenant's dead letters, or all).
    pub async fn recent_dead_letter_actions(
        &self,
        tenant: Option<&str>,
        limit: i64,
    ) -> Result<Vec<DeadLetterAction>, LedgerError> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM dead_letter_actions
             WHERE $1::text IS NULL OR tenant = $1 ORDER BY created_at DESC LIMIT $2"
        )))
        .bind(tenant)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }
}
