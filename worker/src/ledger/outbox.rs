//! The result outbox: result events written in the same commit as the state change that caused
//! them, then claimed by a relay, published with confirms and marked published. A relay that
//! dies between publishing and marking leaves the row to be published again, so agents may
//! see an event twice (same `event_id`) but never miss one.
//!
//! Events of this worker's completion batcher are inserted already claimed by this worker's
//! relay ([`insert_held_events`]) and handed to it in memory after the commit, so the hot path
//! writes two row versions per event (insert, mark) instead of three (insert, claim, mark).
//! Every other writer inserts unclaimed rows for whichever relay comes first.
//!
//! What an event says is built by [`crate::answers`]; this module only stores and addresses it.

use chrono::{DateTime, Utc};
use protocol::ResultEvent;
use sqlx::PgConnection;
use std::time::Duration;

use super::{Ledger, LedgerError};

/// How long a relay owns the events it claimed (or that were inserted claimed for it) before
/// another relay may take them: a relay that died leaves its rows to the others after this.
pub const RELAY_HOLD: Duration = Duration::from_secs(30);

/// The hold this process uses: [`RELAY_HOLD`], except that builds with the `fault-points`
/// feature (the e2e suites' worker, never a release set) read `WORKER_FAULT_RELAY_HOLD_SECS`
/// so crash tests need not wait 30 s for a dead worker's held events.
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
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct OutboxRow {
    pub id: i64,
    pub routing_key: String,
    pub status: String,
    pub payload: serde_json::Value,
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

/// The columns of one insert, in `unnest` order.
struct EventColumns {
    ids: Vec<uuid::Uuid>,
    op_ids: Vec<Option<i64>>,
    keys: Vec<String>,
    statuses: Vec<String>,
    payloads: Vec<serde_json::Value>,
    traceparents: Vec<Option<String>>,
    tracestates: Vec<Option<String>>,
}

fn columns(events: &[NewEvent]) -> EventColumns {
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
            .push(serde_json::to_value(&e.event).expect("result events serialize"));
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
         SELECT * FROM unnest($1::uuid[], $2::int8[], $3::text[], $4::text[], $5::jsonb[],
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
/// `relay_owner` for `hold` (as [`Ledger::claim_unpublished`] would claim them), and returns
/// the rows so the caller can hand them to its relay once the transaction has committed.
/// Other relays skip them while the hold lasts; if the owner dies, any relay takes them after
/// it, exactly like a claimed batch.
pub async fn insert_held_events(
    conn: &mut PgConnection,
    events: &[NewEvent],
    relay_owner: &str,
    hold: Duration,
) -> Result<Vec<OutboxRow>, LedgerError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let c = columns(events);
    let mut rows: Vec<OutboxRow> = sqlx::query_as(
        "INSERT INTO result_outbox
                (event_id, operation_id, routing_key, status, payload, traceparent, tracestate,
                 relay_owner, relay_until)
         SELECT e.*, $8, now() + make_interval(secs => $9)
         FROM unnest($1::uuid[], $2::int8[], $3::text[], $4::text[], $5::jsonb[], $6::text[],
                     $7::text[]) AS e
         RETURNING id, routing_key, status, payload, traceparent, tracestate",
    )
    .bind(&c.ids)
    .bind(&c.op_ids)
    .bind(&c.keys)
    .bind(&c.statuses)
    .bind(&c.payloads)
    .bind(&c.traceparents)
    .bind(&c.tracestates)
    .bind(relay_owner)
    .bind(hold.as_secs_f64())
    .fetch_all(conn)
    .await?;
    rows.sort_by_key(|r| r.id);
    Ok(rows)
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
                WHERE published_at IS NULL AND (relay_until IS NULL OR relay_until < now())
                ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED
             )
             UPDATE result_outbox r SET relay_owner = $1, relay_until = now() + make_interval(secs => $3)
             FROM batch WHERE r.id = batch.id
             RETURNING r.id, r.routing_key, r.status, r.payload, r.traceparent, r.tracestate",
        )
        .bind(relay_owner)
        .bind(limit)
        .bind(hold.as_secs_f64())
        .fetch_all(&self.pool)
        .await?
        .into_iter()
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

    /// Gives claimed events back (publish failed) so any relay can retry them.
    pub async fn release_unpublished(&self, ids: &[i64]) -> Result<(), LedgerError> {
        if ids.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "UPDATE result_outbox SET relay_owner = NULL, relay_until = NULL
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
    /// memory). Returns how many were held.
    pub async fn release_held(&self, operation_id: i64, owner: &str) -> Result<u64, LedgerError> {
        let done = sqlx::query(
            "UPDATE result_outbox SET relay_owner = NULL, relay_until = NULL
             WHERE operation_id = $1 AND relay_owner = $2 AND published_at IS NULL",
        )
        .bind(operation_id)
        .bind(owner)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    /// Unpublished events: the relay backlog.
    pub async fn relay_backlog(&self) -> Result<i64, LedgerError> {
        Ok(
            sqlx::query_scalar("SELECT count(*) FROM result_outbox WHERE published_at IS NULL")
                .fetch_one(&self.pool)
                .await?,
        )
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
