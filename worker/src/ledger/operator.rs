//! Operator actions on unresolved operations: the listing, and resolve / fail / recheck.
//!
//! Each action is one transaction: the operator request id is recorded first (so a retried
//! request finds it and gets the stored response), then the state change is ONE conditional
//! UPDATE checked by the database (allowed source states), the result event
//! ([`crate::answers`]) is written to the outbox in the same commit, and the response is stored
//! with the request. `changed_by` and `evidence` carry who and why into the history the trigger
//! appends.

use std::collections::HashMap;

use sqlx::PgConnection;

use super::admit::o_columns;
use super::outbox;
use super::queries::HistoryEntry;
use super::{Ledger, LedgerError, Operation, State, OPERATION_COLUMNS};
use crate::answers;
use crate::document::Document;

/// Which unresolved operations to list.
#[derive(Debug, Clone)]
pub struct UnresolvedFilter {
    /// States to include; each must be unresolved. Empty: all unresolved states.
    pub states: Vec<State>,
    pub tool: Option<String>,
    /// Only rows recorded at least this long ago.
    pub older_than_secs: Option<f64>,
    /// Rows after this id (pagination cursor).
    pub after: Option<i64>,
    pub limit: i64,
}

/// What an operator asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum OperatorChange {
    /// `succeeded` with a receipt that already passed the tool's receipt check.
    Resolve {
        receipt: Document,
        receipt_id: String,
    },
    /// `failed`, with the operator's written evidence.
    Fail { evidence: String },
    /// `held` -> `unknown` due now with `recovery_attempts` set to `held_recovery_attempts`
    /// (one round left); an `unknown` or `accepted` row without a live lease becomes due now
    /// (an accepted one is polled). A held row the downstream had accepted (it has an
    /// operation id) goes back to `accepted` when `poll_deadline_secs` is given (the tool is
    /// async), polled now with a fresh deadline.
    Recheck {
        held_recovery_attempts: i32,
        poll_deadline_secs: Option<f64>,
    },
    /// One more distinct approver of an `awaiting_approval` row whose fingerprint is
    /// `fingerprint` (the arguments the approver saw), before its wait ended; the last approval
    /// needed makes it `prepared`, due now: the recovery scheduler claims it under a fence and
    /// dispatches it as any first dispatch.
    Approve { fingerprint: String },
    /// An `awaiting_approval` row whose fingerprint is `fingerprint` -> `failed`, never sent.
    Reject { fingerprint: String },
}

impl OperatorChange {
    pub fn action(&self) -> &'static str {
        match self {
            OperatorChange::Resolve { .. } => "resolve",
            OperatorChange::Fail { .. } => "fail",
            OperatorChange::Recheck { .. } => "recheck",
            OperatorChange::Approve { .. } => "approve",
            OperatorChange::Reject { .. } => "reject",
        }
    }
}

/// Who asks, why, and the idempotency key of the request.
#[derive(Debug, Clone)]
pub struct OperatorRequest {
    pub request_id: String,
    pub operator: String,
    /// The reason (resolve, recheck) or the evidence (fail).
    pub reason: String,
}

impl OperatorRequest {
    /// The history actor: `operator:<name>`.
    pub fn actor(&self) -> String {
        format!("operator:{}", self.operator)
    }
}

/// What an operator action did.
#[derive(Debug, Clone)]
pub enum OperatorOutcome {
    /// The row moved; the response was stored with the request.
    Applied {
        operation: Operation,
        response: serde_json::Value,
    },
    /// The request id was already used for this action on this operation: nothing changed,
    /// here is the response it got.
    Repeated { response: serde_json::Value },
    /// The request id was already used for another action or operation: nothing changed.
    RequestIdReused { action: String, operation_id: i64 },
    /// The row is not in a state this action may change (e.g. already final): rolled back.
    Refused { current: Operation },
}

struct HistoryRow {
    operation_id: i64,
    entry: HistoryEntry,
}

impl<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> for HistoryRow {
    fn from_row(row: &'r sqlx::postgres::PgRow) -> Result<Self, sqlx::Error> {
        Ok(HistoryRow {
            operation_id: sqlx::Row::try_get(row, "operation_id")?,
            entry: HistoryEntry::from_row(row)?,
        })
    }
}

impl Ledger {
    /// Unresolved operations (`dispatching`, `retry_wait`, `unknown`, `held`) by id, through the
    /// partial index that holds only them.
    /// Unresolved operations matching `filter`, without their arguments and receipt (None).
    pub async fn list_unresolved(
        &self,
        filter: &UnresolvedFilter,
    ) -> Result<Vec<Operation>, LedgerError> {
        let states: Vec<String> = if filter.states.is_empty() {
            State::UNRESOLVED
                .iter()
                .map(|s| s.as_str().to_string())
                .collect()
        } else {
            filter
                .states
                .iter()
                .map(|s| s.as_str().to_string())
                .collect()
        };
        // The literal state list matches the partial indexes' predicate. A listing never reads
        // arguments or receipts (each may be hundreds of kilobytes): one operation's route does.
        let columns = OPERATION_COLUMNS
            .replace("arguments,", "NULL::text AS arguments,")
            .replace("receipt,", "NULL::json AS receipt,")
            .replace("acceptance,", "NULL::json AS acceptance,");
        let sql = format!(
            "SELECT {columns} FROM operations
             WHERE state IN ('dispatching', 'retry_wait', 'unknown', 'held', 'accepted',
                            'awaiting_approval')
               AND state = ANY($1)
               AND ($2::text IS NULL OR tool = $2)
               AND ($3::float8 IS NULL OR created_at <= now() - make_interval(secs => $3))
               AND id > $4
             ORDER BY id
             LIMIT $5"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(&states)
            .bind(filter.tool.as_deref())
            .bind(filter.older_than_secs)
            .bind(filter.after.unwrap_or(0))
            .bind(filter.limit)
            .fetch_all(&self.pool)
            .await?)
    }

    /// The history of many operations in one query.
    pub async fn histories(
        &self,
        ids: &[i64],
    ) -> Result<HashMap<i64, Vec<HistoryEntry>>, LedgerError> {
        let mut out: HashMap<i64, Vec<HistoryEntry>> = HashMap::new();
        if ids.is_empty() {
            return Ok(out);
        }
        let rows: Vec<HistoryRow> = sqlx::query_as(
            "SELECT operation_id, at, from_state, to_state, fence, actor, evidence, attempts, next_attempt_at
             FROM operation_history WHERE operation_id = ANY($1) ORDER BY operation_id, id",
        )
        .bind(ids)
        .fetch_all(&self.pool)
        .await?;
        for r in rows {
            out.entry(r.operation_id).or_default().push(r.entry);
        }
        Ok(out)
    }

    /// Applies one operator action idempotently (see the module docs). `respond` builds the
    /// response stored with the request from the new row and its history (read in the same
    /// transaction).
    pub async fn operator_apply(
        &self,
        operation_id: i64,
        request: &OperatorRequest,
        change: &OperatorChange,
        respond: impl FnOnce(&Operation, Vec<HistoryEntry>) -> serde_json::Value,
    ) -> Result<OperatorOutcome, LedgerError> {
        let action = change.action();
        let mut tx = self.pool.begin().await?;
        let claimed: Option<String> = sqlx::query_scalar(
            "INSERT INTO operator_requests (request_id, operation_id, action, operator, reason)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (request_id) DO NOTHING
             RETURNING request_id",
        )
        .bind(&request.request_id)
        .bind(operation_id)
        .bind(action)
        .bind(&request.operator)
        .bind(&request.reason)
        .fetch_optional(&mut *tx)
        .await?;
        if claimed.is_none() {
            let (prev_op, prev_action, response): (i64, String, Option<serde_json::Value>) =
                sqlx::query_as(
                    "SELECT operation_id, action, response FROM operator_requests
                     WHERE request_id = $1",
                )
                .bind(&request.request_id)
                .fetch_one(&mut *tx)
                .await?;
            tx.rollback().await?;
            if prev_op != operation_id || prev_action != action {
                return Ok(OperatorOutcome::RequestIdReused {
                    action: prev_action,
                    operation_id: prev_op,
                });
            }
            return Ok(OperatorOutcome::Repeated {
                response: response.unwrap_or(serde_json::Value::Null),
            });
        }

        let Some(op) = transition(&mut tx, operation_id, request, change).await? else {
            tx.rollback().await?;
            return match self.get(operation_id).await? {
                Some(current) => Ok(OperatorOutcome::Refused { current }),
                None => Err(LedgerError::NotFound(format!("operation {operation_id}"))),
            };
        };
        let event = match change {
            OperatorChange::Resolve { receipt_id, .. } => {
                Some(answers::succeeded_by_operator(&op, receipt_id))
            }
            OperatorChange::Fail { .. } => Some(answers::failed(&op)),
            OperatorChange::Recheck { .. } | OperatorChange::Approve { .. } => None,
            OperatorChange::Reject { .. } => {
                Some(answers::not_approved(&op, answers::NotApproved::Rejected))
            }
        };
        if let Some(event) = event {
            // The operator's span (current here) decided it, when spans are recorded.
            let trace = kit::otel::outgoing(&tracing::Span::current(), op.trace().as_ref());
            outbox::insert_events(&mut tx, &[event.with_trace(trace)]).await?;
        }
        let history: Vec<HistoryEntry> = sqlx::query_as(
            "SELECT at, from_state, to_state, fence, actor, evidence, attempts, next_attempt_at
             FROM operation_history WHERE operation_id = $1 ORDER BY id",
        )
        .bind(operation_id)
        .fetch_all(&mut *tx)
        .await?;
        let response = respond(&op, history);
        sqlx::query("UPDATE operator_requests SET response = $2::json WHERE request_id = $1")
            .bind(&request.request_id)
            .bind(response.to_string())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(OperatorOutcome::Applied {
            operation: op,
            response,
        })
    }

    /// Replaces the stored response of a request (a recheck stores what its recovery round
    /// found, so a retried request gets the final picture).
    pub async fn update_operator_response(
        &self,
        request_id: &str,
        response: &serde_json::Value,
    ) -> Result<(), LedgerError> {
        // As text: a receipt in the response is kept as sent (a U+0000 included), like the
        // operation's own.
        sqlx::query("UPDATE operator_requests SET response = $2::json WHERE request_id = $1")
            .bind(request_id)
            .bind(response.to_string())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Leases one specific `unknown` or `accepted` row that is due, for a recovery round or a
    /// poll run now (an operator recheck): the same lease as the scheduler's (fence + 1, owner,
    /// lease, one more recovery round counted for an unknown row). None when it is not due or
    /// another worker leased it first.
    pub async fn lease_for_recovery(
        &self,
        operation_id: i64,
        worker_id: &str,
        lease: std::time::Duration,
    ) -> Result<Option<Operation>, LedgerError> {
        let sql = format!(
            "UPDATE operations o
             SET fence = o.fence + 1, lease_owner = $2,
                 recovery_attempts = o.recovery_attempts + (o.state = 'unknown')::int,
                 lease_until = now() + make_interval(secs => $3),
                 next_attempt_at = now() + make_interval(secs => $3), changed_by = $2
             WHERE o.id = $1 AND o.state IN ('unknown', 'accepted')
               AND o.next_attempt_at <= now()
             RETURNING {}",
            o_columns()
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(operation_id)
            .bind(worker_id)
            .bind(lease.as_secs_f64())
            .fetch_optional(&self.pool)
            .await?)
    }
}

/// The one conditional UPDATE of an operator action. None when the row is not in an allowed
/// source state (nothing written).
async fn transition(
    conn: &mut PgConnection,
    operation_id: i64,
    request: &OperatorRequest,
    change: &OperatorChange,
) -> Result<Option<Operation>, LedgerError> {
    let actor = request.actor();
    let evidence = format!(
        "{} by {}: {}",
        change.action(),
        request.operator,
        request.reason
    );
    let returning = OPERATION_COLUMNS;
    let row = match change {
        OperatorChange::Resolve {
            receipt,
            receipt_id,
        } => {
            // The receipt path: the downstream's proof may settle any unresolved row, whoever
            // owns it; the owner's later fenced write then finds the row moved on.
            let sql = format!(
                "UPDATE operations SET state = 'succeeded', receipt = $4::json, receipt_id = $5,
                        evidence = $3, changed_by = $2, lease_owner = NULL, lease_until = NULL,
                        next_attempt_at = NULL, last_reported = 'succeeded', verified_by = $2
                 WHERE id = $1
                   AND state IN ('dispatching', 'retry_wait', 'unknown', 'held', 'accepted')
                 RETURNING {returning}"
            );
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(operation_id)
                .bind(&actor)
                .bind(&evidence)
                .bind(receipt.text())
                .bind(receipt_id)
                .fetch_optional(&mut *conn)
                .await?
        }
        OperatorChange::Fail { .. } => {
            // Like recheck, an `unknown` row under a live recovery lease is refused: that
            // round's replay or lookup may be on the wire and bring back the receipt.
            let sql = format!(
                "UPDATE operations SET state = 'failed', evidence = $3, changed_by = $2,
                        lease_owner = NULL, lease_until = NULL, next_attempt_at = NULL,
                        last_reported = 'failed', verified_by = $2
                 WHERE id = $1
                   AND (state IN ('retry_wait', 'held')
                        OR (state IN ('unknown', 'accepted')
                            AND (lease_until IS NULL OR lease_until < now())))
                 RETURNING {returning}"
            );
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(operation_id)
                .bind(&actor)
                .bind(&evidence)
                .fetch_optional(&mut *conn)
                .await?
        }
        OperatorChange::Recheck {
            held_recovery_attempts,
            poll_deadline_secs,
        } => {
            // A held row gets exactly one more round, or, once accepted by an async tool's
            // downstream, polls again with a fresh deadline; an unknown or accepted row becomes
            // due now unless a round holds a live lease on it (that round is the recheck).
            let sql = format!(
                "UPDATE operations SET
                        state = CASE WHEN state = 'accepted'
                                       OR (state = 'held' AND remote_id IS NOT NULL
                                           AND $5::float8 IS NOT NULL)
                                     THEN 'accepted' ELSE 'unknown' END,
                        poll_deadline = CASE WHEN state = 'held' AND remote_id IS NOT NULL
                                                  AND $5::float8 IS NOT NULL
                                             THEN now() + make_interval(secs => $5)
                                             ELSE poll_deadline END,
                        next_attempt_at = now(),
                        recovery_attempts = CASE WHEN state = 'held' THEN $4
                                                 ELSE recovery_attempts END,
                        evidence = $3, changed_by = $2, lease_owner = NULL, lease_until = NULL,
                        last_reported = 'pending'
                 WHERE id = $1
                   AND (state = 'held'
                        OR (state IN ('unknown', 'accepted')
                            AND (lease_until IS NULL OR lease_until < now())))
                 RETURNING {returning}"
            );
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(operation_id)
                .bind(&actor)
                .bind(&evidence)
                .bind(*held_recovery_attempts)
                .bind(*poll_deadline_secs)
                .fetch_optional(&mut *conn)
                .await?
        }
        OperatorChange::Approve { fingerprint } => {
            // The approver is counted on the row itself, so two approvals at once serialize on
            // its lock and the second sees the first (a count read from another table would
            // see the snapshot taken before the wait). The state predicate, the fingerprint, the
            // wait and "not this person again" are all checked on the row this statement
            // changes.
            let sql = format!(
                "UPDATE operations SET
                        approved_by = coalesce(approved_by, '{{}}') || $4::text,
                        state = CASE WHEN cardinality(coalesce(approved_by, '{{}}')) + 1
                                          >= approvals_needed
                                     THEN 'prepared' ELSE 'awaiting_approval' END,
                        next_attempt_at = CASE WHEN cardinality(coalesce(approved_by, '{{}}')) + 1
                                                    >= approvals_needed
                                               THEN now() ELSE next_attempt_at END,
                        evidence = $3 || ' (' || cardinality(coalesce(approved_by, '{{}}')) + 1
                                   || ' of ' || approvals_needed || ')',
                        changed_by = $2
                 WHERE id = $1 AND state = 'awaiting_approval' AND fingerprint = $5
                   AND next_attempt_at > now()
                   AND NOT ($4 = ANY(coalesce(approved_by, '{{}}')))
                 RETURNING {returning}"
            );
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(operation_id)
                .bind(&actor)
                .bind(&evidence)
                .bind(&request.operator)
                .bind(fingerprint)
                .fetch_optional(&mut *conn)
                .await?
        }
        OperatorChange::Reject { fingerprint } => {
            let sql = format!(
                "UPDATE operations SET state = 'failed', evidence = $3, changed_by = $2,
                        next_attempt_at = NULL, last_reported = 'failed', verified_by = $2
                 WHERE id = $1 AND state = 'awaiting_approval' AND fingerprint = $4
                 RETURNING {returning}"
            );
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(operation_id)
                .bind(&actor)
                .bind(&evidence)
                .bind(fingerprint)
                .fetch_optional(&mut *conn)
                .await?
        }
    };
    Ok(row)
}
