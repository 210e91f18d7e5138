//! Claims: who may send. The consumer claims the `prepared` rows it admitted; the recovery
//! scheduler leases due rows (crash-left `prepared`, `retry_wait`, `unknown`) and expires the
//! leases of crashed owners. Every claim increments the fence, so a stale owner's later write
//! cannot match.

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::admit::o_columns;
use super::outbox;
use super::{Ledger, LedgerError, Operation, State};
use crate::answers;

/// Replay windows by tool, so the first dispatch can store its protection deadline.
#[derive(Debug, Clone, Default)]
pub struct ReplayWindows {
    pub(crate) tools: Vec<String>,
    pub(crate) secs: Vec<f64>,
}

impl ReplayWindows {
    pub fn new(windows: impl IntoIterator<Item = (String, Duration)>) -> Self {
        let (tools, secs) = windows
            .into_iter()
            .map(|(t, d)| (t, d.as_secs_f64()))
            .unzip();
        ReplayWindows { tools, secs }
    }
}

/// One ready send to fence: the row, the fence its claim took, the tool's timeout (the
/// renewed lease outlives it) and, for a tool with `absence_proof`, its `deadline_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendFence {
    pub id: i64,
    pub fence: i64,
    pub timeout: Duration,
    pub deadline: Option<Duration>,
}

/// A send fence that passed: the request may leave, carrying `deadline` when its tool declares
/// `absence_proof` (fence time + `deadline_ms` on the database clock, stored in the row as its
/// `send_deadline` in the same statement).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Passed {
    pub deadline: Option<DateTime<Utc>>,
}

/// What a leased row needs next (decided by its state when the lease was taken).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimKind {
    /// A `prepared` row left by a crash before its claim: dispatch it once.
    FirstDispatch,
    /// A `retry_wait` row whose attempt is due.
    Retry,
    /// An `unknown` row: recovery by capability.
    Recover,
    /// An `accepted` row whose next poll is due: read its status.
    Poll,
}

/// A leased row and what to do with it.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub kind: ClaimKind,
    pub operation: Operation,
}

/// The SET clause that authorises a send: one owner, a lease, one more attempt, the first
/// dispatch time and the replay deadline fixed at the first send.
const DISPATCH_SET: &str = "state = 'dispatching', lease_owner = $2, \
     lease_until = now() + make_interval(secs => $3), attempts = o.attempts + 1, \
     next_attempt_at = NULL, changed_by = $2, evidence = NULL, \
     first_dispatch_at = coalesce(o.first_dispatch_at, now()), \
     replay_deadline = coalesce(o.replay_deadline, now() + make_interval(secs => \
        (SELECT w.secs FROM unnest($4::text[], $5::float8[]) AS w(tool, secs) WHERE w.tool = o.tool)))";

impl Ledger {
    /// Claims freshly admitted rows for their first dispatch: `prepared` -> `dispatching` with
    /// a new fence and a lease, all in one statement and one commit. Rows another worker (or the
    /// scheduler) claimed first are simply not returned.
    pub async fn claim_prepared(
        &self,
        ids: &[i64],
        worker_id: &str,
        lease: Duration,
        windows: &ReplayWindows,
    ) -> Result<Vec<Operation>, LedgerError> {
        let mut conn = self.pool.acquire().await?;
        claim_prepared_in(&mut conn, ids, worker_id, lease, windows).await
    }

    /// Claims admitted rows and, in the same commit, records the result events `answers`
    /// computes from what was claimed (answers to duplicates and rejections): one fsync per
    /// batch for both.
    pub async fn claim_and_answer(
        &self,
        ids: &[i64],
        worker_id: &str,
        lease: Duration,
        windows: &ReplayWindows,
        answers: impl FnOnce(&[Operation]) -> Vec<outbox::NewEvent>,
    ) -> Result<(Vec<Operation>, usize), LedgerError> {
        let mut tx = self.pool.begin().await?;
        let claimed = claim_prepared_in(&mut tx, ids, worker_id, lease, windows).await?;
        let events = answers(&claimed);
        outbox::insert_events(&mut tx, &events).await?;
        tx.commit().await?;
        Ok((claimed, events.len()))
    }

    /// Turns a leased `prepared` or `retry_wait` row into `dispatching` for the owner of
    /// `fence`, not yet sent (`unsent_fence`). None when the lease was lost meanwhile.
    pub async fn start_dispatch(
        &self,
        id: i64,
        fence: i64,
        from: State,
        worker_id: &str,
        lease: Duration,
        windows: &ReplayWindows,
    ) -> Result<Option<Operation>, LedgerError> {
        let sql = format!(
            "UPDATE operations o SET {DISPATCH_SET}, unsent_fence = o.fence
             WHERE o.id = $1 AND o.fence = $6 AND o.state = $7
             RETURNING {}",
            o_columns()
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .bind(worker_id)
            .bind(lease.as_secs_f64())
            .bind(&windows.tools)
            .bind(&windows.secs)
            .bind(fence)
            .bind(from.as_str())
            .fetch_optional(&self.pool)
            .await?)
    }

    /// The send fence of a first dispatch or a retry, run just before the request leaves: one
    /// conditional statement on the database clock that succeeds only while this worker's fence
    /// still owns the row in `dispatching` with a live lease, and renews that lease to outlive
    /// the tool's whole `timeout` plus one `lease` (for recording the answer). False means the
    /// row moved on (its lease expired and recovery may own it): the send must be abandoned.
    pub async fn fence_send(
        &self,
        send: SendFence,
        worker_id: &str,
        lease: Duration,
    ) -> Result<Option<Passed>, LedgerError> {
        let passed = self.fence_sends(&[send], worker_id, lease).await?;
        Ok(passed[0])
    }

    /// [`Ledger::fence_send`] for many ready sends in one statement (the dispatcher's fence
    /// batcher): each row's own predicate (fence, state, owner, `lease_until > now()`) is
    /// checked as if alone. Answers one entry per send, in order: None where the fence did not
    /// pass. A send with a `deadline` stores fence time + deadline as the row's `send_deadline`
    /// (never lowering it: a request sent earlier under a longer deadline is still covered) and
    /// carries what is stored. A row that was ever sent without a deadline (its tool declared
    /// none then) keeps none: that request may commit at any time, so no lookup miss can prove
    /// its absence; its later requests still carry a deadline of their own.
    pub async fn fence_sends(
        &self,
        sends: &[SendFence],
        worker_id: &str,
        lease: Duration,
    ) -> Result<Vec<Option<Passed>>, LedgerError> {
        if sends.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<i64> = sends.iter().map(|s| s.id).collect();
        let fences: Vec<i64> = sends.iter().map(|s| s.fence).collect();
        let timeouts: Vec<f64> = sends.iter().map(|s| s.timeout.as_secs_f64()).collect();
        let deadlines: Vec<Option<f64>> = sends
            .iter()
            .map(|s| s.deadline.map(|d| d.as_secs_f64()))
            .collect();
        // The rule is the function `fence_sends` (migration 0022): called through a prepared
        // statement, its plan is kept per connection and finds each row by primary key, where
        // the statement itself would be parsed, described and planned for every batch.
        let passed: Vec<(i64, i64, Option<DateTime<Utc>>)> = sqlx::query_as(
            "SELECT sent_id, sent_fence, sent_deadline FROM fence_sends($1, $2, $3, $4, $5, $6)",
        )
        .bind(&ids)
        .bind(&fences)
        .bind(&timeouts)
        .bind(worker_id)
        .bind(lease.as_secs_f64())
        .bind(&deadlines)
        .fetch_all(&self.pool)
        .await?;
        Ok(sends
            .iter()
            .map(|s| {
                passed
                    .iter()
                    .find(|(id, fence, _)| (*id, *fence) == (s.id, s.fence))
                    .map(|&(_, _, deadline)| Passed { deadline })
            })
            .collect())
    }

    /// The send fence of a replay of an `unknown` row leased by `fence`, run just before the
    /// replay leaves; counts one more write request. One conditional statement on the database
    /// clock: the lease is still live, and a request sent now, waited on for the tool's whole
    /// `timeout`, still lands `margin` before the replay deadline (`window` after the first
    /// dispatch when no deadline was stored). The lease (and the row's next round) is renewed
    /// past the timeout. False: abandon the replay, nothing was counted.
    #[allow(clippy::too_many_arguments)]
    pub async fn begin_replay(
        &self,
        id: i64,
        fence: i64,
        worker_id: &str,
        lease: Duration,
        timeout: Duration,
        window: Duration,
        margin: Duration,
    ) -> Result<bool, LedgerError> {
        let r = sqlx::query(
            "UPDATE operations SET attempts = attempts + 1, changed_by = $3,
                    lease_until = now() + make_interval(secs => $4 + $5),
                    next_attempt_at = now() + make_interval(secs => $4 + $5)
             WHERE id = $1 AND fence = $2 AND state = 'unknown' AND lease_owner = $3
               AND lease_until > now()
               AND now() + make_interval(secs => $4 + $7)
                   < coalesce(replay_deadline, first_dispatch_at + make_interval(secs => $6))",
        )
        .bind(id)
        .bind(fence)
        .bind(worker_id)
        .bind(timeout.as_secs_f64())
        .bind(lease.as_secs_f64())
        .bind(window.as_secs_f64())
        .bind(margin.as_secs_f64())
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() == 1)
    }

    /// Leases up to `limit` due rows (`prepared` past its grace, `retry_wait`, `unknown` and
    /// `accepted` whose `next_attempt_at` has come). Rows stay in their state; the lease (the
    /// fence raised by one, owner, `next_attempt_at` pushed past the lease) keeps others away, and
    /// lapses by itself if this worker dies. `SKIP LOCKED` lets many schedulers run at once.
    pub async fn lease_due(
        &self,
        limit: i64,
        worker_id: &str,
        lease: Duration,
    ) -> Result<Vec<Claimed>, LedgerError> {
        let sql = format!(
            "WITH due AS (
                SELECT id FROM operations
                WHERE state IN ('prepared', 'retry_wait', 'unknown', 'accepted')
                  AND next_attempt_at <= now()
                ORDER BY next_attempt_at
                LIMIT $1
                FOR UPDATE SKIP LOCKED
             )
             UPDATE operations o
             SET fence = o.fence + 1, lease_owner = $2,
                 recovery_attempts = o.recovery_attempts + (o.state = 'unknown')::int,
                 lease_until = now() + make_interval(secs => $3),
                 next_attempt_at = now() + make_interval(secs => $3), changed_by = $2
             FROM due WHERE o.id = due.id
             RETURNING {}",
            o_columns()
        );
        let rows: Vec<Operation> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(limit)
            .bind(worker_id)
            .bind(lease.as_secs_f64())
            .fetch_all(&self.pool)
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|operation| {
                let kind = match operation.state() {
                    State::Prepared => ClaimKind::FirstDispatch,
                    State::RetryWait => ClaimKind::Retry,
                    State::Unknown => ClaimKind::Recover,
                    State::Accepted => ClaimKind::Poll,
                    _ => return None,
                };
                Some(Claimed { kind, operation })
            })
            .collect())
    }

    /// Accepted rows of `tool` whose poll is more than `late` overdue (no worker could poll
    /// them on time: every worker was down, or saturated) get a new time at random within
    /// their poll gap (their age in `accepted`, between `first` and `max`), so that polls
    /// resume spread out rather than all at once, and the downstream's status URL never sees
    /// a burst after an outage. At most `limit` rows per call; locked rows are left to their
    /// holder. The schedule is all that changes (no state, no fence: no history).
    pub async fn spread_late_polls(
        &self,
        tool: &str,
        first: Duration,
        max: Duration,
        late: Duration,
        limit: i64,
    ) -> Result<u64, LedgerError> {
        let r = sqlx::query(
            "WITH late AS (
                SELECT id FROM operations
                WHERE state = 'accepted' AND tool = $1
                  AND next_attempt_at < now() - make_interval(secs => $4)
                  -- Past its deadline it is due now: the poll holds it.
                  AND (poll_deadline IS NULL OR poll_deadline > now())
                ORDER BY next_attempt_at
                LIMIT $5
                FOR UPDATE SKIP LOCKED
             )
             UPDATE operations o
             SET next_attempt_at = now() + random() * least(
                     greatest(now() - o.state_since, make_interval(secs => $2)),
                     make_interval(secs => $3))
             FROM late WHERE o.id = late.id AND o.state = 'accepted'",
        )
        .bind(tool)
        .bind(first.as_secs_f64())
        .bind(max.as_secs_f64())
        .bind(late.as_secs_f64())
        .bind(limit)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected())
    }

    /// `dispatching` rows whose lease ran out (owner crashed, hung or was paused). One whose
    /// send fence passed under this claim (`unsent_fence` no longer equals `fence`; NULL too, as
    /// an earlier version's claim leaves it) becomes `unknown`: the request
    /// may have left, so it is never dispatched afresh, and an agent that was told nothing yet
    /// gets a `pending` result in the same commit. One whose fence never passed sent nothing
    /// (the fence is the only way to a send, and it now fails for the stale owner): it goes
    /// back to `prepared` (or `retry_wait` after earlier attempts), due at once, and the write
    /// its claim counted is given back.
    pub async fn expire_leases(
        &self,
        worker_id: &str,
        limit: i64,
    ) -> Result<Vec<Operation>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let sql = format!(
            "WITH expired AS (
                SELECT id, last_reported, unsent_fence IS DISTINCT FROM fence AS sent
                FROM operations
                WHERE state = 'dispatching' AND lease_until < now()
                ORDER BY lease_until
                LIMIT $2
                FOR UPDATE SKIP LOCKED
             )
             UPDATE operations o
             SET state = CASE WHEN expired.sent THEN 'unknown'
                              WHEN o.attempts > 1 THEN 'retry_wait' ELSE 'prepared' END,
                 attempts = o.attempts - (NOT expired.sent)::int,
                 next_attempt_at = now(), changed_by = $1,
                 evidence = 'lease of ' || coalesce(o.lease_owner, 'unknown owner') ||
                            CASE WHEN expired.sent
                                 THEN ' expired while dispatching; the request may have been sent'
                                 ELSE ' expired before its send fence passed; nothing was sent'
                            END,
                 lease_owner = NULL, lease_until = NULL,
                 last_reported = CASE WHEN expired.sent THEN 'pending' ELSE o.last_reported END
             FROM expired WHERE o.id = expired.id
             RETURNING {}, expired.last_reported AS prev_reported",
            o_columns()
        );
        let rows: Vec<WithPrev> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(worker_id)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        let events: Vec<_> = rows
            .iter()
            .filter(|r| {
                r.op.state() == State::Unknown && r.prev_reported.as_deref() != Some("pending")
            })
            .map(|r| answers::pending(&r.op))
            .collect();
        outbox::insert_events(&mut tx, &events).await?;
        tx.commit().await?;
        Ok(rows.into_iter().map(|r| r.op).collect())
    }
}

pub(crate) struct WithPrev {
    pub op: Operation,
    pub prev_reported: Option<String>,
}

impl<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> for WithPrev {
    fn from_row(row: &'r sqlx::postgres::PgRow) -> Result<Self, sqlx::Error> {
        Ok(WithPrev {
            op: Operation::from_row(row)?,
            prev_reported: sqlx::Row::try_get(row, "prev_reported")?,
        })
    }
}

/// The claim statement of [`Ledger::claim_prepared`], on a caller's connection or transaction.
async fn claim_prepared_in(
    conn: &mut sqlx::PgConnection,
    ids: &[i64],
    worker_id: &str,
    lease: Duration,
    windows: &ReplayWindows,
) -> Result<Vec<Operation>, LedgerError> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let sql = format!(
        "UPDATE operations o SET {DISPATCH_SET}, fence = o.fence + 1, unsent_fence = o.fence + 1
             WHERE o.id = ANY($1) AND o.state = 'prepared'
             RETURNING {}",
        o_columns()
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(ids)
        .bind(worker_id)
        .bind(lease.as_secs_f64())
        .bind(&windows.tools)
        .bind(&windows.secs)
        .fetch_all(conn)
        .await?)
}
