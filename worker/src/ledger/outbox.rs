//! The result outbox: result events written in the same commit as the state change that caused
//! them, then claimed by a relay, published with confirms and marked published. A relay that
//! dies between publishing and marking leaves the row to be published again, so agents may
//! see an event twice (same `event_id`) but never miss one.
//!
//! Events of this worker's completion batcher are inserted already claimed by this worker's
//! relay, in its current epoch ([`insert_held_events`]), and handed to it in memory after the
//! commit. The relay records them published with one watermark per epoch
//! ([`Ledger::advance_epoch`]), so the hot path writes one row version per event (the insert).
//! An epoch nothing advances for the relay hold is retired ([`Ledger::retire_epochs`]): the rows
//! above its watermark go back to the outbox in the same transaction. Every other writer inserts
//! unclaimed rows for whichever relay comes first, marked published one by one.
//! Migration 0014 and `docs/design.md` (section 2) give the invariants.
//!
//! What an event says is built by [`crate::answers`]; this module only stores and addresses it.

use chrono::{DateTime, Utc};
use protocol::ResultEvent;
use sqlx::PgConnection;
use std::time::Duration;

use super::{Ledger, LedgerError};

/// How long a relay owns the events it claimed before another relay may take them, and how
/// long a relay epoch may go without its watermark being written before any relay retires it:
/// a relay that died leaves its rows to the others after this.
pub const RELAY_HOLD: Duration = Duration::from_secs(30);

/// The hold this process uses: [`RELAY_HOLD`], except that builds with the `fault-points`
/// feature (the e2e suites' worker, never a release set) read `WORKER_FAULT_RELAY_HOLD_SECS`
/// so crash tests need not wait 30 s for a dead worker's held events (the retiring worker's
/// own hold decides when it retires another's epoch).
pub fn relay_hold() -> Duration {
    #[cfg(feature = "fault-points")]
    if let Some(secs) = std::env::var("WORKER_FAULT_RELAY_HOLD_SECS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| *s > 0)
    {
        return Duration::from_secs(secs);
    }
    RELAY_HOLD
}

/// An event to insert, with the operation it is about (None for rejections of messages that
/// never became an operation) and the `reply_to` it is addressed to.
#[derive(Debug, Clone)]
pub struct NewEvent {
    pub operation_id: Option<i64>,
    pub event: ResultEvent,
    /// Selects the routing key ([`NewEvent::routing_key`]): the operation's stored `reply_to`
    /// for events about its progress, the delivery's own for answers to a delivery.
    pub reply_to: Option<String>,
    /// Sent as the event's `traceparent`/`tracestate` headers: the context of the span that
    /// decided the event (export on), else the context of the intent it is about.
    pub trace: Option<protocol::trace::TraceContext>,
}

impl NewEvent {
    /// Addresses this event to the delivery it answers (its `reply_to`, or the tenant-wide
    /// key when it had none), not to whoever sent the operation's first intent.
    pub fn answering(mut self, reply_to: Option<&str>) -> NewEvent {
        self.reply_to = reply_to.map(str::to_string);
        self
    }

    /// Sends the event with `trace`: the context of the span that decided it
    /// ([`kit::otel::outgoing`]), or of the delivery it answers.
    pub fn with_trace(mut self, trace: Option<protocol::trace::TraceContext>) -> NewEvent {
        self.trace = trace;
        self
    }

    /// The routing key on the results topic exchange: `<tenant>` or `<tenant>.@.<reply_to>`.
    pub fn routing_key(&self) -> String {
        protocol::result_routing_key(&self.event.tenant, self.reply_to.as_deref())
    }
}

/// An outbox row claimed by a relay (or inserted claimed for it).
#[derive(Debug, Clone)]
pub struct OutboxRow {
    pub id: i64,
    /// The epoch whose watermark records this row published (held rows of a completion
    /// batch); None for rows marked one by one.
    pub relay_epoch: Option<i64>,
    pub routing_key: String,
    pub status: String,
    /// The event's JSON text, published as it is. A completion's events keep the text they
    /// were inserted with, so the hot path never reads a payload back from the database.
    pub payload: String,
    /// The event's own `event_id` (the message id it is published with).
    pub event_id: String,
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

impl OutboxRow {
    /// A string field of the event (`tenant`, `action_id`), read from its text: only for
    /// logs on rare paths, so the hot path never parses a payload.
    pub fn field(&self, name: &str) -> Option<String> {
        let value: serde_json::Value = serde_json::from_str(&self.payload).ok()?;
        string_field(&value, name).map(str::to_string)
    }
}

/// A string field of an event's JSON.
fn string_field<'a>(event: &'a serde_json::Value, name: &str) -> Option<&'a str> {
    event.get(name)?.as_str()
}

kit::pg_row! {
    /// An outbox row as a relay's claim reads it back.
    struct ClaimedRow {
        id: i64,
        relay_epoch: Option<i64>,
        routing_key: String,
        status: String,
        payload: serde_json::Value,
        traceparent: Option<String>,
        tracestate: Option<String>,
    }
}

impl From<ClaimedRow> for OutboxRow {
    fn from(r: ClaimedRow) -> OutboxRow {
        let event_id = string_field(&r.payload, "event_id")
            .unwrap_or_default()
            .to_string();
        OutboxRow {
            id: r.id,
            relay_epoch: r.relay_epoch,
            routing_key: r.routing_key,
            status: r.status,
            payload: r.payload.to_string(),
            event_id,
            traceparent: r.traceparent,
            tracestate: r.tracestate,
        }
    }
}

/// The columns of one insert, in `unnest` order.
pub(super) struct EventColumns {
    pub(super) ids: Vec<uuid::Uuid>,
    op_ids: Vec<Option<i64>>,
    pub(super) keys: Vec<String>,
    pub(super) statuses: Vec<String>,
    /// JSON text, cast to `json` (kept as written) by the statement.
    pub(super) payloads: Vec<String>,
    pub(super) traceparents: Vec<Option<String>>,
    pub(super) tracestates: Vec<Option<String>>,
}

pub(super) fn columns(events: &[NewEvent]) -> EventColumns {
    let mut c = EventColumns {
        ids: Vec::with_capacity(events.len()),
        op_ids: Vec::with_capacity(events.len()),
        keys: Vec::with_capacity(events.len()),
        statuses: Vec::with_capacity(events.len()),
        payloads: Vec::with_capacity(events.len()),
        traceparents: Vec::with_capacity(events.len()),
        tracestates: Vec::with_capacity(events.len()),
    };
    for e in events {
        c.ids.push(
            uuid::Uuid::parse_str(&e.event.event_id).unwrap_or_else(|_| uuid::Uuid::new_v4()),
        );
        c.op_ids.push(e.operation_id);
        c.keys.push(e.routing_key());
        c.statuses.push(e.event.status.as_str().to_string());
        c.payloads
            .push(serde_json::to_string(&e.event).expect("result events serialize"));
        c.traceparents
            .push(e.trace.as_ref().map(|t| t.traceparent()));
        c.tracestates
            .push(e.trace.as_ref().and_then(|t| t.state.clone()));
    }
    c
}

/// Inserts events in one statement inside the caller's transaction, unclaimed: the next relay
/// round of any worker takes them.
pub async fn insert_events(
    conn: &mut PgConnection,
    events: &[NewEvent],
) -> Result<(), LedgerError> {
    if events.is_empty() {
        return Ok(());
    }
    let c = columns(events);
    sqlx::query(
        "INSERT INTO result_outbox (event_id, operation_id, routing_key, status, payload,
                                    traceparent, tracestate)
         SELECT * FROM unnest($1::uuid[], $2::int8[], $3::text[], $4::text[], $5::json[],
                              $6::text[], $7::text[])",
    )
    .bind(&c.ids)
    .bind(&c.op_ids)
    .bind(&c.keys)
    .bind(&c.statuses)
    .bind(&c.payloads)
    .bind(&c.traceparents)
    .bind(&c.tracestates)
    .execute(conn)
    .await?;
    Ok(())
}

/// Inserts events in one statement inside the caller's transaction, already claimed by
/// `relay_owner` in the relay epoch `*epoch`, and returns the rows so the caller can hand them
/// to its relay once the transaction has committed. Their `relay_until` is infinity: no relay
/// claims them (nor one of a version before relay epochs, whose claim knows only
/// `relay_until`) until the epoch is retired and gives back those its watermark did not reach.
///
/// The insert takes a KEY SHARE lock on the epoch's row, so the epoch cannot be retired before
/// this transaction ends. When `*epoch` is None, or was retired meanwhile, a new epoch is begun
/// in this transaction and `*epoch` set to it. A caller whose transaction then fails must
/// forget the epoch (its commit may have happened), so that no later batch joins it.
pub async fn insert_held_events(
    conn: &mut PgConnection,
    events: &[NewEvent],
    relay_owner: &str,
    epoch: &mut Option<i64>,
) -> Result<Vec<OutboxRow>, LedgerError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let c = columns(events);
    for _ in 0..2 {
        let current = match *epoch {
            Some(e) => e,
            None => {
                let e = begin_epoch(conn, relay_owner).await?;
                *epoch = Some(e);
                e
            }
        };
        // Only the ids come back: the rest of each row is what this call just sent.
        let inserted: Vec<(i64, Option<i64>, uuid::Uuid)> = sqlx::query_as(
            "WITH epoch AS (SELECT id FROM relay_epochs WHERE id = $9 FOR KEY SHARE)
             INSERT INTO result_outbox
                    (event_id, operation_id, routing_key, status, payload, traceparent, tracestate,
                     relay_owner, relay_until, relay_epoch)
             SELECT e.*, $8, 'infinity', epoch.id
             FROM unnest($1::uuid[], $2::int8[], $3::text[], $4::text[], $5::json[], $6::text[],
                         $7::text[]) AS e, epoch
             RETURNING id, relay_epoch, event_id",
        )
        .bind(&c.ids)
        .bind(&c.op_ids)
        .bind(&c.keys)
        .bind(&c.statuses)
        .bind(&c.payloads)
        .bind(&c.traceparents)
        .bind(&c.tracestates)
        .bind(relay_owner)
        .bind(current)
        .fetch_all(&mut *conn)
        .await?;
        if inserted.len() == events.len() {
            return held_rows(events, c, inserted);
        }
        // The epoch was retired (its relay was silent for the hold): nothing was inserted.
        *epoch = None;
    }
    Err(LedgerError::Refused(
        "a relay epoch begun in this transaction was not found".into(),
    ))
}

/// The rows [`insert_held_events`] inserted, built from what it sent and the ids the database
/// gave them (matched by event id), in id order. An event id the database did not answer for
/// fails the caller's transaction rather than hand over a row without its id.
pub(super) fn held_rows(
    events: &[NewEvent],
    c: EventColumns,
    inserted: Vec<(i64, Option<i64>, uuid::Uuid)>,
) -> Result<Vec<OutboxRow>, LedgerError> {
    let at: std::collections::HashMap<uuid::Uuid, (i64, Option<i64>)> = inserted
        .into_iter()
        .map(|(id, epoch, event_id)| (event_id, (id, epoch)))
        .collect();
    let mut rows: Vec<OutboxRow> = events
        .iter()
        .zip(c.ids)
        .zip(c.keys)
        .zip(c.statuses)
        .zip(c.payloads)
        .zip(c.traceparents.into_iter().zip(c.tracestates))
        .map(
            |(((((e, uuid), routing_key), status), payload), (traceparent, tracestate))| {
                let (id, relay_epoch) = *at.get(&uuid).ok_or_else(|| {
                    LedgerError::Refused(format!(
                        "the outbox insert returned no row for event {uuid}"
                    ))
                })?;
                Ok(OutboxRow {
                    id,
                    relay_epoch,
                    routing_key,
                    status,
                    payload,
                    event_id: e.event.event_id.clone(),
                    traceparent,
                    tracestate,
                })
            },
        )
        .collect::<Result<_, LedgerError>>()?;
    rows.sort_by_key(|r| r.id);
    Ok(rows)
}

/// Begins a relay epoch for `worker_id` inside the caller's transaction. Its watermark starts
/// at the largest outbox id so far: every row the epoch will hold takes a larger one, and the
/// retirement's scan for rows above the watermark starts there.
async fn begin_epoch(conn: &mut PgConnection, worker_id: &str) -> Result<i64, LedgerError> {
    Ok(sqlx::query_scalar(
        "INSERT INTO relay_epochs (worker_id, through_id)
         SELECT $1, coalesce(max(id), 0) FROM result_outbox
         RETURNING id",
    )
    .bind(worker_id)
    .fetch_one(conn)
    .await?)
}

impl Ledger {
    /// Inserts events in their own commit (answers to duplicates and rejections).
    pub async fn emit(&self, events: &[NewEvent]) -> Result<(), LedgerError> {
        if events.is_empty() {
            return Ok(());
        }
        let mut tx = self.pool.begin().await?;
        insert_events(&mut tx, events).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Claims up to `limit` unpublished events for this relay for `hold`; a relay that dies
    /// loses its claim when `hold` passes.
    pub async fn claim_unpublished(
        &self,
        relay_owner: &str,
        limit: i64,
        hold: Duration,
    ) -> Result<Vec<OutboxRow>, LedgerError> {
        Ok(sqlx::query_as(
            "WITH batch AS (
                SELECT id FROM result_outbox
                WHERE published_at IS NULL AND relay_epoch IS NULL
                  AND (relay_until IS NULL OR relay_until < now())
                ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED
             )
             UPDATE result_outbox r SET relay_owner = $1, relay_until = now() + make_interval(secs => $3)
             FROM batch WHERE r.id = batch.id
             RETURNING r.id, r.relay_epoch, r.routing_key, r.status, r.payload, r.traceparent,
                       r.tracestate",
        )
        .bind(relay_owner)
        .bind(limit)
        .bind(hold.as_secs_f64())
        .fetch_all(&self.pool)
        .await?
        .into_iter()
        .map(|r: ClaimedRow| OutboxRow::from(r))
        .collect::<Vec<OutboxRow>>())
        .map(|mut rows| {
            rows.sort_by_key(|r| r.id);
            rows
        })
    }

    /// Marks confirmed events published, in one statement.
    pub async fn mark_published(&self, ids: &[i64]) -> Result<(), LedgerError> {
        if ids.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "UPDATE result_outbox SET published_at = now(), relay_until = NULL WHERE id = ANY($1)",
        )
        .bind(ids)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Gives claimed events back (publish failed) so any relay can retry them; rows of an
    /// epoch leave it, so no watermark of the epoch covers them.
    pub async fn release_unpublished(&self, ids: &[i64]) -> Result<(), LedgerError> {
        if ids.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "UPDATE result_outbox SET relay_owner = NULL, relay_until = NULL, relay_epoch = NULL
             WHERE id = ANY($1) AND published_at IS NULL",
        )
        .bind(ids)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Gives back the unpublished events of `operation_id` held for `owner`'s relay, so a relay
    /// takes them at its next poll instead of after the hold: for a completion this worker
    /// committed without seeing the commit's reply (the events were never handed over in
    /// memory). Rows an epoch's watermark already covers are published and stay as they are.
    /// Returns how many were held.
    pub async fn release_held(&self, operation_id: i64, owner: &str) -> Result<u64, LedgerError> {
        let done = sqlx::query(
            "UPDATE result_outbox r SET relay_owner = NULL, relay_until = NULL, relay_epoch = NULL
             WHERE r.operation_id = $1 AND r.relay_owner = $2 AND r.published_at IS NULL
               AND (r.relay_epoch IS NULL
                    OR EXISTS (SELECT 1 FROM relay_epochs e
                               WHERE e.id = r.relay_epoch AND r.id > e.through_id))",
        )
        .bind(operation_id)
        .bind(owner)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    /// Records every row of `epoch` with an id at most `through` as published (the relay has
    /// their confirms), and that the epoch's relay is alive. False when the epoch was retired:
    /// its rows above the old watermark were given back to the outbox and are published again
    /// by whichever relay takes them (agents dedupe by `event_id`).
    pub async fn advance_epoch(&self, epoch: i64, through: i64) -> Result<bool, LedgerError> {
        let done = sqlx::query(
            "UPDATE relay_epochs SET through_id = greatest(through_id, $2), advanced_at = now()
             WHERE id = $1",
        )
        .bind(epoch)
        .bind(through)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Retires every epoch that nothing advanced for `hold` (its worker died, or its relay was
    /// stalled that long) and that no batch is inserting into: in one transaction, the epoch's
    /// rows above its watermark go back to the outbox (unclaimed: any relay takes them at its
    /// next round) and the epoch row is deleted. Returns how many rows went back.
    pub async fn retire_epochs(&self, hold: Duration) -> Result<u64, LedgerError> {
        let due: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM relay_epochs
                            WHERE advanced_at < now() - make_interval(secs => $1))",
        )
        .bind(hold.as_secs_f64())
        .fetch_one(&self.pool)
        .await?;
        if !due {
            return Ok(0);
        }
        let mut tx = self.pool.begin().await?;
        // Row locks first: a batch inserting into an epoch holds its KEY SHARE lock (skipped
        // here), and a batch that comes later waits for this commit and then finds no epoch.
        let gone: Vec<(i64, i64)> = sqlx::query_as(
            "DELETE FROM relay_epochs
             WHERE id IN (SELECT id FROM relay_epochs
                          WHERE advanced_at < now() - make_interval(secs => $1)
                          FOR UPDATE SKIP LOCKED)
             RETURNING id, through_id",
        )
        .bind(hold.as_secs_f64())
        .fetch_all(&mut *tx)
        .await?;
        let Some(from) = gone.iter().map(|(_, through)| *through).min() else {
            return Ok(0);
        };
        let (ids, throughs): (Vec<i64>, Vec<i64>) = gone.into_iter().unzip();
        // A statement of its own, so its snapshot includes every batch committed into these
        // epochs before the locks above were taken.
        let back = sqlx::query(
            "UPDATE result_outbox r SET relay_epoch = NULL, relay_until = NULL
             FROM unnest($1::int8[], $2::int8[]) AS g(id, through_id)
             WHERE r.id > $3 AND r.relay_epoch = g.id AND r.id > g.through_id
               AND r.published_at IS NULL",
        )
        .bind(&ids)
        .bind(&throughs)
        .bind(from)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(back)
    }

    /// Unpublished events: the relay backlog (rows no epoch covers, and the rows of live epochs
    /// above their watermarks).
    pub async fn relay_backlog(&self) -> Result<i64, LedgerError> {
        Ok(sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM result_outbox
                     WHERE published_at IS NULL AND relay_epoch IS NULL)
                  + (SELECT count(*) FROM relay_epochs e
                     JOIN LATERAL (SELECT 1 FROM result_outbox r
                                   WHERE r.id > e.through_id AND r.relay_epoch = e.id
                                     AND r.published_at IS NULL) x ON true)",
        )
        .fetch_one(&self.pool)
        .await?)
    }

    /// The latest event recorded for an operation (used by the status query).
    pub async fn latest_event(
        &self,
        operation_id: i64,
    ) -> Result<Option<(serde_json::Value, DateTime<Utc>)>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT payload, created_at FROM result_outbox WHERE operation_id = $1 ORDER BY id DESC LIMIT 1",
        )
        .bind(operation_id)
        .fetch_optional(&self.pool)
        .await?)
    }
}
