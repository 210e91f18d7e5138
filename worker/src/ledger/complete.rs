//! Completion: recording what a dispatch or a recovery round found, with the result event
//! for the agent (built by [`crate::answers`]), many operations per commit; a lone receipt for
//! the row its dispatch holds in one statement with its event ([`Ledger::succeed_dispatched`]).
//!
//! A receipt goes through the receipt path: it may settle any unresolved row, whoever owns it,
//! because it is the downstream's proof (checked against the operation before it gets here).
//! Every other outcome must match the caller's fence and expected state, so a stale owner, a
//! late timeout or a second scheduler can never overwrite newer state.

use std::time::Duration;

use sqlx::PgConnection;

use super::admit::o_columns;
use super::claim::WithPrev;
use super::outbox::{self, NewEvent, OutboxRow};
use super::{Ledger, LedgerError, Operation, State, OPERATION_COLUMNS};
use crate::answers;
use crate::document::Document;

/// Where an operation goes next.
#[derive(Debug, Clone, PartialEq)]
pub enum Transition {
    /// A receipt that matches the operation.
    Succeeded {
        receipt: Document,
        receipt_id: String,
        evidence: String,
    },
    /// Proven not applied and not retriable (or retries exhausted).
    Failed { evidence: String },
    /// Proven not applied; try again after `delay`.
    RetryWait { delay: Duration, evidence: String },
    /// Nothing left this process: the write could not even connect because the worker ran out
    /// of a local resource. `retry_wait` after `delay` with the attempt the claim counted given
    /// back (as for an expired claim whose send fence never passed), so the worker's own
    /// exhaustion never spends the operation's `max_attempts`.
    Resend { delay: Duration, evidence: String },
    /// May have been applied; recovery after `delay`.
    Unknown { delay: Duration, evidence: String },
    /// Recovery cannot proceed automatically.
    Held { evidence: String },
    /// Nothing learned (e.g. the retry budget was empty): stay, look again after `delay`.
    Defer { delay: Duration },
    /// The downstream accepted the write as its operation `operation_id` (a long-running one):
    /// `accepted`, the acceptance kept, the first poll after `delay`, held if still not done
    /// `deadline` after this first acceptance. An acceptance naming another operation than the
    /// one already recorded is `held` with both ids as evidence.
    Accepted {
        operation_id: String,
        acceptance: Document,
        delay: Duration,
        deadline: Duration,
        evidence: String,
    },
    /// A poll proved nothing final: stay `accepted`, poll again after `delay`.
    Poll { delay: Duration, evidence: String },
}

impl Transition {
    /// The same transition with `note` added to its evidence (a `Defer` has none).
    pub fn noting(mut self, note: &str) -> Transition {
        match &mut self {
            Transition::Succeeded { evidence, .. }
            | Transition::Failed { evidence }
            | Transition::RetryWait { evidence, .. }
            | Transition::Resend { evidence, .. }
            | Transition::Unknown { evidence, .. }
            | Transition::Held { evidence }
            | Transition::Accepted { evidence, .. }
            | Transition::Poll { evidence, .. } => {
                evidence.push_str("; ");
                evidence.push_str(note);
            }
            Transition::Defer { .. } => {}
        }
        self
    }
}

/// Which call established a completion's outcome: the completion report's `verified_by`
/// ([`protocol::VerifiedBy`]). A dispatch's receipt recorded on a row that had moved on (its
/// lease ran out) is stored as `late_receipt`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Dispatch,
    Replay,
    Lookup,
    Poll,
    /// A signed completion callback from the downstream ([`crate::ops::callback`]).
    Callback,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Dispatch => "dispatch",
            Source::Replay => "replay",
            Source::Lookup => "lookup",
            Source::Poll => "poll",
            Source::Callback => "callback",
        }
    }
}

/// Which stage produced a completion: the expected current state for fenced transitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// A send authorised by a claim: the row must still be `dispatching` at this fence.
    Dispatch,
    /// A recovery round on a leased row in the given state.
    Leased(State),
    /// The downstream's own word, arriving unasked (a signed completion callback): like a
    /// receipt, it may settle any unresolved row, whoever holds it. Only `Succeeded` and
    /// `Failed` are recorded so.
    Proof,
}

/// One outcome to record.
#[derive(Debug, Clone)]
pub struct Completion {
    pub operation_id: i64,
    pub fence: i64,
    pub phase: Phase,
    pub transition: Transition,
    /// Which call established it.
    pub by: Source,
    /// The context of the span that decided it, when recorded: the result event carries it
    /// (else the intent's own), and the commit's span links to it.
    pub trace: Option<protocol::trace::TraceContext>,
    /// The row as the dispatch that sent this request holds it (its claim), when there is
    /// one: a receipt arriving alone for it is then recorded with its result event in one
    /// statement ([`Ledger::succeed_dispatched`]), the event built from this row beforehand and the
    /// statement changing nothing unless the row still reads so.
    pub dispatched: Option<Box<Operation>>,
}

/// What recording a completion did.
#[derive(Debug, Clone)]
pub enum Applied {
    /// The row moved; here it is now.
    Done(Operation),
    /// The row had moved on (stale fence, other state); nothing was written.
    Stale(Option<Operation>),
    /// A receipt for a row that was already `succeeded` with the same receipt.
    LateReceiptMatches(Operation),
    /// A receipt for a row already final with something else: rejected, nothing written.
    LateReceiptConflict(Operation),
}

/// What [`Ledger::complete_held`] recorded: one result per completion, in order, and the
/// result events it inserted claimed for the caller's relay (all committed).
#[derive(Debug, Default)]
pub struct Completed {
    pub results: Vec<Result<Applied, LedgerError>>,
    pub events: Vec<OutboxRow>,
    /// The relay epoch the next batch may insert into: the one these events are in, or None
    /// when a transaction failed (its commit may have happened with events never returned, so
    /// no later batch may join that epoch).
    pub epoch: Option<i64>,
}

impl Ledger {
    /// Records many completions in one transaction: every receipt of the batch in one
    /// statement (each row still checked against its own predicate), the rare other outcomes
    /// one statement each, then every result event in one insert. If the batch fails (e.g. the
    /// database refuses one row), each completion is retried alone so one bad row cannot hold
    /// up the others; a completion that still fails is returned as an error in its slot, and its
    /// row stays as it was (a `dispatching` lease then expires into `unknown`).
    ///
    /// The events are inserted unclaimed, for any relay.
    pub async fn complete(
        &self,
        worker_id: &str,
        completions: &[Completion],
    ) -> Vec<Result<Applied, LedgerError>> {
        self.record(worker_id, completions, false, &mut None)
            .await
            .results
    }

    /// [`Ledger::complete`], with the result events inserted already claimed by `worker_id`'s
    /// relay and returned, so the caller can hand them to that relay after the
    /// commit instead of the relay claiming them with an `UPDATE`. The events go into relay
    /// epoch `epoch` (a new one when None or retired); [`Completed::epoch`] says which epoch the
    /// next batch may use.
    pub async fn complete_held(
        &self,
        worker_id: &str,
        completions: &[Completion],
        epoch: Option<i64>,
    ) -> Completed {
        let mut epoch = epoch;
        self.record(worker_id, completions, true, &mut epoch).await
    }

    async fn record(
        &self,
        worker_id: &str,
        completions: &[Completion],
        held: bool,
        epoch: &mut Option<i64>,
    ) -> Completed {
        if completions.is_empty() {
            return Completed::default();
        }
        let batch: Result<(Vec<Applied>, Vec<OutboxRow>), LedgerError> = async {
            // A lone receipt its dispatch holds goes in one statement when the row and the
            // epoch still read as its event was built from; anything else, the general path.
            if let ([c], true, Some(current)) = (completions, held, *epoch) {
                if let Some((applied, events)) =
                    self.succeed_dispatched(worker_id, c, current).await?
                {
                    return Ok((vec![applied], events));
                }
            }
            let mut tx = self.pool.begin().await?;
            let out = apply_batch(&mut tx, worker_id, completions, held, epoch).await?;
            tx.commit().await?;
            Ok(out)
        }
        .await;
        let mut done = match batch {
            Ok((applied, events)) => Completed {
                results: applied.into_iter().map(Ok).collect(),
                events,
                epoch: None,
            },
            Err(_) if completions.len() > 1 => {
                *epoch = None;
                let mut out = Completed::default();
                for c in completions {
                    match self.complete_one(worker_id, c, held, epoch).await {
                        Ok((applied, events)) => {
                            out.results.push(Ok(applied));
                            out.events.extend(events);
                        }
                        Err(e) => {
                            *epoch = None;
                            out.results.push(Err(e));
                        }
                    }
                }
                out
            }
            Err(e) => {
                *epoch = None;
                Completed {
                    results: vec![Err(e)],
                    events: Vec::new(),
                    epoch: None,
                }
            }
        };
        done.epoch = *epoch;
        done
    }

    /// A lone receipt for a row its dispatch still holds, with its result event, in one autocommit
    /// statement (one round trip, where the general path takes four: `BEGIN`, the update,
    /// the event's insert, `COMMIT`). The event is built before the statement from the row as the
    /// dispatch holds it ([`Completion::dispatched`]) moved to `succeeded` as the statement moves
    /// it, and the statement changes nothing unless every column the event reads is still what it
    /// was built from (state `dispatching` at this fence, the attempts, the key, tool, fingerprint,
    /// address, trace and compensated action) and relay epoch `epoch` is live (held `FOR KEY
    /// SHARE`, as [`outbox::insert_held_events`] does). None: not such a completion, or the row or
    /// the epoch read otherwise; nothing was written and the general path records it.
    pub async fn succeed_dispatched(
        &self,
        worker_id: &str,
        c: &Completion,
        epoch: i64,
    ) -> Result<Option<(Applied, Vec<OutboxRow>)>, LedgerError> {
        let (
            Some(op),
            Phase::Dispatch,
            Transition::Succeeded {
                receipt,
                receipt_id,
                evidence,
            },
        ) = (c.dispatched.as_deref(), c.phase, &c.transition)
        else {
            return Ok(None);
        };
        if op.id != c.operation_id || op.fence != c.fence || op.state() != State::Dispatching {
            return Ok(None);
        }
        let mut expected = op.clone();
        expected.state = super::StateColumn(State::Succeeded);
        expected.receipt = Some(receipt.clone());
        expected.receipt_id = Some(receipt_id.clone());
        expected.evidence = Some(evidence.clone());
        expected.verified_by = Some(c.by.as_str().to_string());
        expected.last_reported = Some(State::Succeeded.as_str().to_string());
        let Some(event) = event_for(&expected, None, c) else {
            return Ok(None);
        };
        let events = [event];
        let e = outbox::columns(&events);
        let cols = o_columns();
        let sql = format!(
            "WITH epoch AS (SELECT id FROM relay_epochs WHERE id = $17 FOR KEY SHARE),
             moved AS (
                UPDATE operations o SET state = 'succeeded', receipt = $4::json, receipt_id = $5,
                       evidence = $3, changed_by = $2, lease_owner = NULL, lease_until = NULL,
                       next_attempt_at = NULL, last_reported = 'succeeded', verified_by = $6
                FROM epoch
                WHERE o.id = $1 AND o.fence = $7 AND o.state = 'dispatching' AND o.attempts = $8
                  AND o.tenant = $9 AND o.action_id = $10 AND o.tool = $11 AND o.fingerprint = $12
                  AND o.reply_to IS NOT DISTINCT FROM $13 AND o.compensates IS NOT DISTINCT FROM $14
                  AND o.traceparent IS NOT DISTINCT FROM $15 AND o.tracestate IS NOT DISTINCT FROM $16
                RETURNING {cols}, epoch.id AS held_in
             ), event AS (
                INSERT INTO result_outbox
                       (event_id, operation_id, routing_key, status, payload, traceparent, tracestate,
                        relay_owner, relay_until, relay_epoch)
                SELECT $18, moved.id, $19, $20, $21::json, $22, $23, $2, 'infinity', moved.held_in
                FROM moved
                RETURNING id
             )
             SELECT moved.*, event.id AS event_row FROM moved, event"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            // Prepared, as the general path's lone receipt is: planning this statement at each
            // run costs more than the three round trips it saves. Its row is found by primary
            // key; its generic plan, made after an analysis of a ten-row table, was seen to stay
            // there (`auto_explain`), where a plain one-row UPDATE's is a sequential scan.
            .bind(c.operation_id)
            .bind(worker_id)
            .bind(evidence)
            .bind(receipt.text())
            .bind(receipt_id)
            .bind(c.by.as_str())
            .bind(c.fence)
            .bind(op.attempts)
            .bind(&op.tenant)
            .bind(&op.action_id)
            .bind(&op.tool)
            .bind(&op.fingerprint)
            .bind(&op.reply_to)
            .bind(&op.compensates)
            .bind(&op.traceparent)
            .bind(&op.tracestate)
            .bind(epoch)
            .bind(e.ids[0])
            .bind(&e.keys[0])
            .bind(&e.statuses[0])
            .bind(&e.payloads[0])
            .bind(&e.traceparents[0])
            .bind(&e.tracestates[0])
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let mut moved =
            super::OperationDecoder::decode_all(std::slice::from_ref(&row), |op, row| {
                Ok((op, sqlx::Row::try_get::<i64, _>(row, "event_row")?))
            })?;
        let (now, event_row) = moved.pop().expect("one row decoded from one");
        let event_id = e.ids[0];
        let held = outbox::held_rows(&events, e, vec![(event_row, Some(epoch), event_id)])?;
        Ok(Some((Applied::Done(now), held)))
    }

    async fn complete_one(
        &self,
        worker_id: &str,
        c: &Completion,
        held: bool,
        epoch: &mut Option<i64>,
    ) -> Result<(Applied, Vec<OutboxRow>), LedgerError> {
        let mut tx = self.pool.begin().await?;
        let (applied, events) =
            apply_batch(&mut tx, worker_id, std::slice::from_ref(c), held, epoch).await?;
        tx.commit().await?;
        let applied = applied
            .into_iter()
            .next()
            .expect("one result per completion");
        Ok((applied, events))
    }
}

/// The statements of one batch inside the caller's transaction; one `Applied` per completion,
/// in order. When `held`, the events are inserted claimed by `worker_id`, in relay epoch
/// `epoch`, and returned.
async fn apply_batch(
    conn: &mut PgConnection,
    worker_id: &str,
    completions: &[Completion],
    held: bool,
    epoch: &mut Option<i64>,
) -> Result<(Vec<Applied>, Vec<OutboxRow>), LedgerError> {
    let mut out: Vec<Option<Applied>> = vec![None; completions.len()];
    let mut events = Vec::new();
    // Receipts go together when every row of the batch is named once. A row named twice (a
    // dispatch and a recovery round answering at once) sends the whole batch down the
    // one-by-one path, which applies them in arrival order as before.
    let mut seen = std::collections::HashSet::new();
    let distinct = completions.iter().all(|c| seen.insert(c.operation_id));
    let receipts: Vec<usize> = completions
        .iter()
        .enumerate()
        .filter(|(_, c)| matches!(c.transition, Transition::Succeeded { .. }))
        .map(|(i, _)| i)
        .collect();
    if distinct && receipts.len() > 1 {
        let mut rows: std::collections::HashMap<i64, WithPrev> =
            succeed_many(conn, worker_id, completions, &receipts)
                .await?
                .into_iter()
                .map(|r| (r.op.id, r))
                .collect();
        for &i in &receipts {
            if let Some(row) = rows.remove(&completions[i].operation_id) {
                events.extend(event_for(
                    &row.op,
                    row.prev_reported.as_deref(),
                    &completions[i],
                ));
                out[i] = Some(Applied::Done(row.op));
            }
        }
    }
    for (i, c) in completions.iter().enumerate() {
        if out[i].is_none() {
            let (applied, event) = apply(conn, worker_id, c).await?;
            events.extend(event);
            out[i] = Some(applied);
        }
    }
    let held = if held {
        outbox::insert_held_events(conn, &events, worker_id, epoch).await?
    } else {
        outbox::insert_events(conn, &events).await?;
        Vec::new()
    };
    let applied = out
        .into_iter()
        .map(|a| a.expect("every slot filled"))
        .collect();
    Ok((applied, held))
}

/// The `verified_by` a receipt is stored with: its source (`prev.by`), except a dispatch's
/// answer arriving for a row that is no longer `dispatching` (its lease ran out meanwhile).
/// `succeed_receipts` (migration 0023), the batch's receipts, writes the same rule.
const VERIFIED_BY: &str = "CASE WHEN prev.by = 'dispatch' AND o.state <> 'dispatching' \
     THEN 'late_receipt' ELSE prev.by END";

/// The call to `succeed_receipts`: the row's columns by the names of `OPERATION_COLUMNS`, in
/// its order, then what the agent was told before.
static SUCCEED_RECEIPTS: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let columns = super::OPERATION_COLUMN_NAMES
        .iter()
        .map(|c| format!("(r.op).{c} AS {c}"))
        .collect::<Vec<_>>()
        .join(", ");
    format!("SELECT {columns}, r.prev_reported FROM succeed_receipts($1, $2, $3, $4, $5, $6) r")
});

/// Every receipt at `indices` (distinct rows) in one statement: the receipt path, as in
/// [`apply`]. Rows it did not move (already final, or gone) are absent from the answer and
/// are then handled one by one.
async fn succeed_many(
    conn: &mut PgConnection,
    worker_id: &str,
    completions: &[Completion],
    indices: &[usize],
) -> Result<Vec<WithPrev>, LedgerError> {
    let mut ids = Vec::with_capacity(indices.len());
    let mut evidences = Vec::with_capacity(indices.len());
    let mut receipts = Vec::with_capacity(indices.len());
    let mut receipt_ids = Vec::with_capacity(indices.len());
    let mut sources = Vec::with_capacity(indices.len());
    for &i in indices {
        if let Transition::Succeeded {
            receipt,
            receipt_id,
            evidence,
        } = &completions[i].transition
        {
            ids.push(completions[i].operation_id);
            evidences.push(evidence.as_str());
            receipts.push(receipt.text());
            receipt_ids.push(receipt_id.as_str());
            sources.push(completions[i].by.as_str());
        }
    }
    // The statement is the function `succeed_receipts` (migration 0023), whose one plan per
    // connection walks the batch's ids through the primary key; this call to it is prepared.
    let rows = sqlx::query(sqlx::AssertSqlSafe(SUCCEED_RECEIPTS.as_str()))
        .bind(&ids)
        .bind(worker_id)
        .bind(&evidences)
        .bind(&receipts)
        .bind(&receipt_ids)
        .bind(&sources)
        .fetch_all(&mut *conn)
        .await?;
    Ok(super::OperationDecoder::decode_all(&rows, |op, row| {
        Ok(WithPrev {
            op,
            prev_reported: sqlx::Row::try_get(row, "prev_reported")?,
        })
    })?)
}

/// One completion alone; its event (if any) is returned for the batch's insert.
async fn apply(
    conn: &mut PgConnection,
    worker_id: &str,
    c: &Completion,
) -> Result<(Applied, Option<NewEvent>), LedgerError> {
    let Some(row) = update_one(conn, worker_id, c).await? else {
        return Ok((refused(conn, c).await?, None));
    };
    let event = event_for(&row.op, row.prev_reported.as_deref(), c);
    Ok((Applied::Done(row.op), event))
}

/// The one conditional statement of a completion's transition; None when its predicate (fence,
/// expected state) did not hold.
async fn update_one(
    conn: &mut PgConnection,
    worker_id: &str,
    c: &Completion,
) -> Result<Option<WithPrev>, LedgerError> {
    let cols = o_columns();
    let expected = match c.phase {
        Phase::Dispatch => State::Dispatching,
        Phase::Leased(s) => s,
        // Unfenced: only `Succeeded` (the receipt path) and `Failed` (below) are recorded so;
        // anything else finds no row in this state at this fence unless it was leased so.
        Phase::Proof => State::Accepted,
    };
    let row: Option<WithPrev> = match &c.transition {
        Transition::Succeeded {
            receipt,
            receipt_id,
            evidence,
        } => {
            let sql = format!(
                "WITH prev AS (SELECT id, last_reported, $6::text AS by FROM operations
                               WHERE id = $1 FOR UPDATE)
                 UPDATE operations o SET state = 'succeeded', receipt = $4::json, receipt_id = $5,
                        evidence = $3, changed_by = $2, lease_owner = NULL, lease_until = NULL,
                        next_attempt_at = NULL, last_reported = 'succeeded',
                        verified_by = {VERIFIED_BY}
                 FROM prev WHERE o.id = prev.id
                   AND o.state IN ('dispatching', 'unknown', 'held', 'retry_wait', 'accepted')
                 RETURNING {cols}, prev.last_reported AS prev_reported"
            );
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(c.operation_id)
                .bind(worker_id)
                .bind(evidence)
                .bind(receipt.text())
                .bind(receipt_id)
                .bind(c.by.as_str())
                .fetch_optional(&mut *conn)
                .await?
        }
        Transition::Accepted {
            operation_id,
            acceptance,
            delay,
            deadline,
            evidence,
        } => {
            // One statement: an acceptance of the recorded operation (or a first one) moves the
            // row to `accepted`; one naming another operation holds it, keeping what was
            // recorded and saying both.
            let sql = format!(
                "WITH prev AS (SELECT id, last_reported, remote_id IS NULL OR remote_id = $6 AS same
                               FROM operations WHERE id = $1 FOR UPDATE)
                 UPDATE operations o SET
                        state = CASE WHEN prev.same THEN 'accepted' ELSE 'held' END,
                        remote_id = coalesce(o.remote_id, $6),
                        acceptance = CASE WHEN prev.same THEN $7::json ELSE o.acceptance END,
                        poll_deadline = coalesce(o.poll_deadline, now() + make_interval(secs => $9)),
                        next_attempt_at = CASE WHEN prev.same
                                          THEN now() + make_interval(secs => $8) END,
                        evidence = CASE WHEN prev.same THEN $3
                                   ELSE 'the downstream accepted the write as operation ' || $6 ||
                                        ', but it was accepted as operation ' || o.remote_id ||
                                        ' before; held for a person' END,
                        verified_by = $10, last_reported = 'pending', changed_by = $2,
                        lease_owner = NULL, lease_until = NULL
                 FROM prev WHERE o.id = prev.id AND o.fence = $4 AND o.state = $5
                 RETURNING {cols}, prev.last_reported AS prev_reported"
            );
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(c.operation_id)
                .bind(worker_id)
                .bind(evidence)
                .bind(c.fence)
                .bind(expected.as_str())
                .bind(operation_id)
                .bind(acceptance.text())
                .bind(delay.as_secs_f64())
                .bind(deadline.as_secs_f64())
                .bind(c.by.as_str())
                .fetch_optional(&mut *conn)
                .await?
        }
        Transition::Defer { delay } => {
            let sql = format!(
                "WITH prev AS (SELECT id, last_reported FROM operations WHERE id = $1 FOR UPDATE)
                 UPDATE operations o SET next_attempt_at = now() + make_interval(secs => $5),
                        lease_owner = NULL, lease_until = NULL, changed_by = $2,
                        -- a deferral is not a recovery round: give back the one the lease counted
                        recovery_attempts = o.recovery_attempts - (o.state = 'unknown')::int
                 FROM prev WHERE o.id = prev.id AND o.fence = $3 AND o.state = $4
                 RETURNING {cols}, prev.last_reported AS prev_reported"
            );
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(c.operation_id)
                .bind(worker_id)
                .bind(c.fence)
                .bind(expected.as_str())
                .bind(delay.as_secs_f64())
                .fetch_optional(&mut *conn)
                .await?
        }
        Transition::Failed { evidence } if c.phase == Phase::Proof => {
            // The downstream's documented failure, sent unasked: like a receipt, it settles any
            // unresolved row; a final one is left as it is.
            let sql = format!(
                "WITH prev AS (SELECT id, last_reported FROM operations WHERE id = $1 FOR UPDATE)
                 UPDATE operations o SET state = 'failed', next_attempt_at = NULL,
                        last_reported = 'failed', verified_by = $4, evidence = $3,
                        changed_by = $2, lease_owner = NULL, lease_until = NULL
                 FROM prev WHERE o.id = prev.id
                   AND o.state IN ('dispatching', 'unknown', 'held', 'retry_wait', 'accepted')
                 RETURNING {cols}, prev.last_reported AS prev_reported"
            );
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(c.operation_id)
                .bind(worker_id)
                .bind(evidence)
                .bind(c.by.as_str())
                .fetch_optional(&mut *conn)
                .await?
        }
        Transition::Failed { evidence } | Transition::Held { evidence } => {
            let set = if matches!(c.transition, Transition::Failed { .. }) {
                "state = 'failed', next_attempt_at = NULL, last_reported = 'failed', \
                 verified_by = $6"
            } else {
                "state = 'held', next_attempt_at = NULL, last_reported = 'pending', \
                 verified_by = coalesce($6, o.verified_by)"
            };
            let by = matches!(c.transition, Transition::Failed { .. }).then(|| c.by.as_str());
            sqlx::query_as(sqlx::AssertSqlSafe(fenced(cols, set)))
                .bind(c.operation_id)
                .bind(worker_id)
                .bind(evidence)
                .bind(c.fence)
                .bind(expected.as_str())
                .bind(by)
                .fetch_optional(&mut *conn)
                .await?
        }
        Transition::RetryWait { delay, evidence }
        | Transition::Resend { delay, evidence }
        | Transition::Unknown { delay, evidence }
        | Transition::Poll { delay, evidence } => {
            let set = match c.transition {
                Transition::Poll { .. } => {
                    "state = 'accepted', next_attempt_at = now() + make_interval(secs => $6)"
                }
                Transition::RetryWait { .. } => {
                    // A new write starts new recovery rounds (a retry after a proof of absence).
                    "state = 'retry_wait', recovery_attempts = 0, \
                     next_attempt_at = now() + make_interval(secs => $6), last_reported = 'pending'"
                }
                Transition::Resend { .. } => {
                    "state = 'retry_wait', attempts = greatest(o.attempts - 1, 0), \
                     next_attempt_at = now() + make_interval(secs => $6), last_reported = 'pending'"
                }
                _ => {
                    "state = 'unknown', next_attempt_at = now() + make_interval(secs => $6), last_reported = 'pending'"
                }
            };
            sqlx::query_as(sqlx::AssertSqlSafe(fenced(cols, set)))
                .bind(c.operation_id)
                .bind(worker_id)
                .bind(evidence)
                .bind(c.fence)
                .bind(expected.as_str())
                .bind(delay.as_secs_f64())
                .fetch_optional(&mut *conn)
                .await?
        }
    };
    Ok(row)
}

/// Why a completion's statement changed nothing: a late receipt for an operation already
/// final (matching or in conflict), or a stale owner.
async fn refused(conn: &mut PgConnection, c: &Completion) -> Result<Applied, LedgerError> {
    let current = current(conn, c.operation_id).await?;
    Ok(match (&c.transition, current) {
        (
            Transition::Succeeded {
                receipt,
                receipt_id,
                ..
            },
            Some(op),
        ) if op.state() == State::Succeeded => {
            // A callback's document may differ from the one a poll stored (a delivery time,
            // say): the same receipt id is the same outcome.
            let same_id = c.by == Source::Callback && op.receipt_id.as_ref() == Some(receipt_id);
            if same_id || op.receipt.as_ref() == Some(receipt) {
                Applied::LateReceiptMatches(op)
            } else {
                Applied::LateReceiptConflict(op)
            }
        }
        (Transition::Succeeded { .. }, Some(op)) if op.state().is_final() => {
            Applied::LateReceiptConflict(op)
        }
        // The downstream's word that it failed, for a row already final otherwise.
        (Transition::Failed { .. }, Some(op))
            if c.phase == Phase::Proof && op.state() == State::Succeeded =>
        {
            Applied::LateReceiptConflict(op)
        }
        (_, current) => Applied::Stale(current),
    })
}

/// A fenced transition: only the owner of `fence` ($4) may make it, from the expected state
/// ($5). The lease is released and the evidence ($3) recorded (history copies it).
fn fenced(cols: &str, set: &str) -> String {
    format!(
        "WITH prev AS (SELECT id, last_reported FROM operations WHERE id = $1 FOR UPDATE)
         UPDATE operations o SET {set}, evidence = $3, changed_by = $2,
                lease_owner = NULL, lease_until = NULL
         FROM prev WHERE o.id = prev.id AND o.fence = $4 AND o.state = $5
         RETURNING {cols}, prev.last_reported AS prev_reported"
    )
}

/// The event a new state owes the agent: the truth once final, `pending` once per unresolved
/// stretch (so an agent never waits without an answer, and is not told `pending` repeatedly).
fn event_for(op: &Operation, prev_reported: Option<&str>, c: &Completion) -> Option<NewEvent> {
    let event = match op.state() {
        State::Succeeded => Some(answers::succeeded(op)),
        State::Failed => Some(answers::failed(op)),
        State::RetryWait | State::Unknown | State::Held | State::Accepted
            if prev_reported != Some("pending") =>
        {
            Some(answers::pending(op))
        }
        _ => None,
    }?;
    Some(event.with_trace(c.trace.clone().or_else(|| op.trace())))
}

async fn current(conn: &mut PgConnection, id: i64) -> Result<Option<Operation>, LedgerError> {
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {OPERATION_COLUMNS} FROM operations WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(conn)
    .await?)
}
