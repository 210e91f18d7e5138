//! Compensation in the ledger: admitting an intent that undoes a succeeded action (one
//! statement that inserts it only while the original is `succeeded`, of a tool it may
//! compensate, and without another live compensation: the database decides, a unique index
//! keeps one live compensation per original), why one was not admitted, the links both ways,
//! and telling the original's agent once its compensation succeeded.

use std::time::Duration;

use super::admit::{o_columns, Admitted, NewOperation};
use super::approval::ApprovalTerms;
use super::claim::ReplayWindows;
use super::{outbox, Ledger, LedgerError, Operation, State, OPERATION_COLUMNS};
use crate::answers::{self, NotAdmitted};

/// How a compensation is recorded when admitted.
#[derive(Debug, Clone)]
pub enum Admission<'a> {
    /// Claimed by this worker for its first dispatch, as the consumer admits any intent.
    Claimed {
        worker_id: &'a str,
        lease: Duration,
        windows: &'a ReplayWindows,
    },
    /// Its tool asks a person to approve it first.
    Awaiting {
        worker_id: &'a str,
        terms: &'a ApprovalTerms,
    },
}

/// What happened to a compensation intent.
#[derive(Debug, Clone)]
pub enum CompensationAdmission {
    /// Recorded now (`inserted`), or its key already had a row (answered from it).
    Admitted(Box<Admitted>),
    Refused(NotAdmitted),
}

/// A compensation that succeeded, with the original it undid, for the original's agent.
#[derive(Debug, Clone)]
pub struct Compensated {
    pub original: Operation,
    pub by: String,
}

impl Ledger {
    /// Admits one compensation (`new.compensates` names the original; `allowed` the tools it
    /// may compensate). One statement inserts it only if the original is `succeeded` and of an
    /// allowed tool, and no other live compensation of it exists (the unique index
    /// `operations_live_compensation`; `ON CONFLICT DO NOTHING` covers it and the key). When
    /// nothing was inserted, what stood in the way is read afterwards, to answer the agent.
    pub async fn admit_compensation(
        &self,
        new: &NewOperation,
        allowed: &[String],
        how: &Admission<'_>,
    ) -> Result<CompensationAdmission, LedgerError> {
        let original = new.compensates.as_deref().unwrap_or_default();
        let (columns, values) = match how {
            Admission::Claimed { .. } => (
                "state, changed_by, created_by, fence, unsent_fence, lease_owner, lease_until, \
                 attempts, first_dispatch_at, replay_deadline",
                "'dispatching', $12, $12, 1, 1, $12, now() + make_interval(secs => $13), 1, now(), \
                 now() + make_interval(secs => (SELECT w.secs FROM unnest($14::text[], \
                 $15::float8[]) AS w(tool, secs) WHERE w.tool = $3))",
            ),
            Admission::Awaiting { .. } => (
                "state, changed_by, next_attempt_at, approvals_needed, last_reported",
                "'awaiting_approval', $12, now() + make_interval(secs => (SELECT t.secs FROM \
                 unnest($13::text[], $14::float8[]) AS t(tool, secs) WHERE t.tool = $3)), \
                 (SELECT t.needed FROM unnest($13::text[], $15::int2[]) AS t(tool, needed) \
                 WHERE t.tool = $3), 'pending'",
            ),
        };
        let sql = format!(
            "INSERT INTO operations (tenant, action_id, tool, fingerprint, arguments, call_id,
                                     reply_to, traceparent, tracestate, compensates, {columns})
             SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, {values}
             FROM operations orig
             WHERE orig.tenant = $1 AND orig.action_id = $10 AND orig.action_id <> $2
               AND orig.state = 'succeeded' AND orig.tool = ANY($11::text[])
             ON CONFLICT DO NOTHING
             RETURNING {OPERATION_COLUMNS}"
        );
        let query = sqlx::query_as::<_, Operation>(sqlx::AssertSqlSafe(sql))
            .bind(&new.tenant)
            .bind(&new.action_id)
            .bind(&new.tool)
            .bind(&new.fingerprint)
            .bind(&new.arguments)
            .bind(new.call_id.as_deref())
            .bind(new.reply_to.as_deref())
            .bind(new.trace.as_ref().map(|t| t.traceparent()))
            .bind(new.trace.as_ref().and_then(|t| t.state.as_deref()))
            .bind(original)
            .bind(allowed);
        let query = match how {
            Admission::Claimed {
                worker_id,
                lease,
                windows,
            } => query
                .bind(worker_id.to_string())
                .bind(lease.as_secs_f64())
                .bind(windows.tools.clone())
                .bind(windows.secs.clone()),
            Admission::Awaiting { worker_id, terms } => query
                .bind(worker_id.to_string())
                .bind(terms.tools.clone())
                .bind(terms.ttl_secs.clone())
                .bind(terms.needed.clone()),
        };
        if let Some(operation) = query.fetch_optional(&self.pool).await? {
            return Ok(CompensationAdmission::Admitted(Box::new(Admitted {
                operation,
                inserted: true,
            })));
        }
        // Nothing inserted: the key's own row first (a duplicate, answered from it).
        if let Some(operation) = self.find(&new.tenant, &new.action_id).await? {
            return Ok(CompensationAdmission::Admitted(Box::new(Admitted {
                operation,
                inserted: false,
            })));
        }
        let why = match self.find(&new.tenant, original).await? {
            _ if original == new.action_id => NotAdmitted::ToolNotAllowed {
                original_tool: new.tool.clone(),
            },
            None => NotAdmitted::OriginalNotFound,
            Some(o) if !allowed.contains(&o.tool) => NotAdmitted::ToolNotAllowed {
                original_tool: o.tool,
            },
            Some(o) if o.state() == State::Failed => NotAdmitted::OriginalNotApplied,
            Some(o) if o.state() != State::Succeeded => NotAdmitted::OriginalUnresolved(o.state()),
            Some(_) => match self.live_compensation(&new.tenant, original).await? {
                Some(by) => NotAdmitted::AlreadyCompensated { by },
                // The live one failed in between: it is no longer in the way.
                None => return Box::pin(self.admit_compensation(new, allowed, how)).await,
            },
        };
        Ok(CompensationAdmission::Refused(why))
    }

    /// The action_id of the original's live compensation (any state but `failed`), if any.
    pub async fn live_compensation(
        &self,
        tenant: &str,
        original: &str,
    ) -> Result<Option<String>, LedgerError> {
        Ok(sqlx::query_scalar(
            "SELECT action_id FROM operations
             WHERE tenant = $1 AND compensates = $2 AND state <> 'failed'
             LIMIT 1",
        )
        .bind(tenant)
        .bind(original)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Every compensation of `original` (ids and action ids, oldest first, with their states).
    pub async fn compensations_of(
        &self,
        tenant: &str,
        original: &str,
    ) -> Result<Vec<(i64, String, String)>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT id, action_id, state FROM operations
             WHERE tenant = $1 AND compensates = $2 AND compensates IS NOT NULL
             ORDER BY id",
        )
        .bind(tenant)
        .bind(original)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Up to `limit` compensations that succeeded and whose original's agent was not told yet:
    /// each is marked told and the original's `succeeded` event naming `compensated_by` is
    /// written, in one commit. An original whose receipt retention removed gets no event (an
    /// event never says `succeeded` without the receipt); its compensation's own events
    /// name it.
    pub async fn tell_compensations(&self, limit: i64) -> Result<Vec<Compensated>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let sql = format!(
            "WITH done AS (
                SELECT id FROM operations
                WHERE compensates IS NOT NULL AND state = 'succeeded'
                  AND compensation_told IS NULL
                LIMIT $1
                FOR UPDATE SKIP LOCKED
             ), told AS (
                UPDATE operations c SET compensation_told = now()
                FROM done WHERE c.id = done.id
                RETURNING c.tenant, c.compensates, c.action_id
             )
             SELECT {}, told.action_id AS compensated_by
             FROM told JOIN operations o
               ON o.tenant = told.tenant AND o.action_id = told.compensates",
            o_columns()
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        let told = super::OperationDecoder::decode_all(&rows, |original, row| {
            Ok(Compensated {
                original,
                by: sqlx::Row::try_get(row, "compensated_by")?,
            })
        })?;
        let events: Vec<_> = told
            .iter()
            .filter(|c| c.original.state() == State::Succeeded && c.original.receipt.is_some())
            .map(|c| answers::compensated(&c.original, &c.by))
            .collect();
        outbox::insert_events(&mut tx, &events).await?;
        tx.commit().await?;
        Ok(told)
    }
}
