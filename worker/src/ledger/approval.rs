//! Approval before dispatch, in the ledger: intents recorded `awaiting_approval` (never
//! claimed), what an awaiting row's approvals stand at, and the expiry of the rows whose wait
//! ended. The approve and reject statements are operator actions ([`super::operator`]). Every
//! change is one conditional statement; the database refuses a second approval by the same
//! person, an approval of other arguments (the fingerprint), and one after the wait.

use std::time::Duration;

use super::admit::{o_columns, Admitted, NewOperation};
use super::claim::WithPrev;
use super::{outbox, Ledger, LedgerError, Operation};
use crate::answers::{self, NotApproved};

/// Each tool's approval terms (how many people, how long the wait), built once with the
/// worker's context and bound to each admission that records intents awaiting approval.
#[derive(Debug, Clone, Default)]
pub struct ApprovalTerms {
    pub(super) tools: Vec<String>,
    pub(super) ttl_secs: Vec<f64>,
    pub(super) needed: Vec<i16>,
}

impl ApprovalTerms {
    /// Adds `tool`'s terms.
    pub fn with(mut self, tool: &str, approvals: u16, ttl: Duration) -> ApprovalTerms {
        self.tools.push(tool.to_string());
        self.ttl_secs.push(ttl.as_secs_f64());
        self.needed
            .push(i16::try_from(approvals).unwrap_or(i16::MAX));
        self
    }
}

/// What an awaiting (or approved) row's approvals stand at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApprovalStatus {
    /// Distinct people the tool asked for when the intent was recorded.
    pub needed: i16,
    /// Who approved so far, in order.
    pub approved_by: Vec<String>,
}

impl Ledger {
    /// Inserts each intent as `awaiting_approval` (its wait ending `ttl` after now, the number
    /// of approvals its tool asks for kept with it, `pending` reported: the caller answers it) or
    /// loads its existing row, in one statement, like [`Ledger::admit_claimed`]. Nothing is
    /// claimed: no fence, no lease, no attempt.
    pub async fn admit_awaiting(
        &self,
        intents: &[&NewOperation],
        worker_id: &str,
        terms: &ApprovalTerms,
    ) -> Result<Vec<Admitted>, LedgerError> {
        let columns = "state, changed_by, next_attempt_at, approvals_needed, last_reported";
        let values = "'awaiting_approval', $10, \
             now() + make_interval(secs => (SELECT t.secs FROM unnest($11::text[], $12::float8[]) \
                                           AS t(tool, secs) WHERE t.tool = input.tool)), \
             (SELECT t.needed FROM unnest($11::text[], $13::int2[]) AS t(tool, needed) \
              WHERE t.tool = input.tool), 'pending'";
        self.admit_with(intents, columns, values, |q| {
            q.bind(worker_id.to_string())
                .bind(terms.tools.clone())
                .bind(terms.ttl_secs.clone())
                .bind(terms.needed.clone())
        })
        .await
    }

    /// How many approvals `operation_id` needs and who gave them; None for a row that never
    /// waited for approval (or does not exist).
    pub async fn approval_status(
        &self,
        operation_id: i64,
    ) -> Result<Option<ApprovalStatus>, LedgerError> {
        let row: Option<(i16, Vec<String>)> = sqlx::query_as(
            "SELECT approvals_needed, coalesce(approved_by, '{}')
             FROM operations WHERE id = $1 AND approvals_needed IS NOT NULL",
        )
        .bind(operation_id)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|(needed, approved_by)| ApprovalStatus {
            needed,
            approved_by,
        }))
    }

    /// Up to `limit` awaiting rows whose wait ended become `failed` (verified by `expiry`: never
    /// sent), each with its `failed` event (`detail` `approval_expired`) in the same commit.
    /// Rows another worker is changing are skipped (`SKIP LOCKED`), as is a row approved in the
    /// meantime (the state predicate).
    pub async fn expire_approvals(
        &self,
        worker_id: &str,
        limit: i64,
    ) -> Result<Vec<Operation>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let sql = format!(
            "WITH due AS (
                SELECT id, last_reported FROM operations
                WHERE state = 'awaiting_approval' AND next_attempt_at <= now()
                ORDER BY next_attempt_at
                LIMIT $2
                FOR UPDATE SKIP LOCKED
             )
             UPDATE operations o
             SET state = 'failed', changed_by = $1, verified_by = 'expiry',
                 evidence = 'approval expired: ' || cardinality(coalesce(o.approved_by, '{{}}'))
                            || ' of ' || o.approvals_needed
                            || ' approvals came before the wait ended; nothing was sent',
                 next_attempt_at = NULL, last_reported = 'failed'
             FROM due WHERE o.id = due.id AND o.state = 'awaiting_approval'
             RETURNING {}, due.last_reported AS prev_reported",
            o_columns()
        );
        let rows: Vec<WithPrev> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(worker_id)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        let events: Vec<_> = rows
            .iter()
            .map(|r| answers::not_approved(&r.op, NotApproved::Expired))
            .collect();
        outbox::insert_events(&mut tx, &events).await?;
        tx.commit().await?;
        Ok(rows.into_iter().map(|r| r.op).collect())
    }
}

/// One row that waits for approval, as [`Ledger::awaiting`] lists it.
#[derive(Debug, Clone)]
pub struct AwaitingRow {
    pub tenant: String,
    pub action_id: String,
    pub tool: String,
    pub fingerprint: String,
    pub arguments: Option<String>,
    pub needed: i16,
    pub approved_by: Vec<String>,
    pub call_id: Option<String>,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub expires_at: Option<chrono::DateTime<chrono::Utc>>,
}

type AwaitingTuple = (
    String,
    String,
    String,
    String,
    Option<String>,
    i16,
    Vec<String>,
    Option<String>,
    chrono::DateTime<chrono::Utc>,
    Option<chrono::DateTime<chrono::Utc>>,
);

impl Ledger {
    /// The rows waiting for approval (of `tenant`, or all), oldest first, at most `limit`,
    /// through the partial index of their expiry.
    pub async fn awaiting(
        &self,
        tenant: Option<&str>,
        limit: i64,
    ) -> Result<Vec<AwaitingRow>, LedgerError> {
        let rows: Vec<AwaitingTuple> = sqlx::query_as(
            "SELECT tenant, action_id, tool, fingerprint, arguments, approvals_needed,
                    coalesce(approved_by, '{}'), call_id, created_at, next_attempt_at
             FROM operations
             WHERE state = 'awaiting_approval' AND ($1::text IS NULL OR tenant = $1)
             ORDER BY next_attempt_at, id
             LIMIT $2",
        )
        .bind(tenant)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| AwaitingRow {
                tenant: r.0,
                action_id: r.1,
                tool: r.2,
                fingerprint: r.3,
                arguments: r.4,
                needed: r.5,
                approved_by: r.6,
                call_id: r.7,
                created_at: r.8,
                expires_at: r.9,
            })
            .collect())
    }
}
