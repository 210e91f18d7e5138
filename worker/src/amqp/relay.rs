//! The result relay: publishes committed result events from the outbox with publisher
//! confirms (routing key: the tenant) and marks them published. Events no queue is bound for
//! are marked too and counted; they stay readable in the outbox and through the status API.
//!
//! Two sources feed it. This worker's own completions arrive in memory, already claimed for
//! it in the outbox by the commit that wrote them ([`crate::batch::completion`]); they go first
//! and cost no claim statement. Everything else (intake answers, expiries, operator events,
//! other workers' lapsed rows, hand-offs that were dropped) is claimed from the outbox with
//! `claim_unpublished`, when nothing was handed or at least every [`POLL`].

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Connection};
use lapin::{Confirmation, PublisherConfirm};
use metrics::counter;
use protocol::trace::TraceContext;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::AmqpError;
use crate::context::Context;
use crate::ledger::outbox::OutboxRow;
use crate::telemetry::metrics as m;
use crate::telemetry::spans;

/// Events published per round.
const BATCH: i64 = 256;
/// How often the relay looks in the outbox even without a wake-up (other workers' commits,
/// released rows), and at least how often it does while handed events keep it busy.
const POLL: Duration = Duration::from_millis(500);

/// A relay bound to one confirmed channel.
pub struct Relay {
    channel: Channel,
    exchange: String,
    ctx: Arc<Context>,
    /// When this relay last claimed from the outbox.
    last_claim: Mutex<Option<Instant>>,
}

impl Relay {
    pub async fn new(
        connection: &Connection,
        exchange: String,
        ctx: Arc<Context>,
    ) -> Result<Relay, AmqpError> {
        let channel = connection
            .create_channel()
            .await
            .map_err(AmqpError::broker("opening the relay channel"))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(AmqpError::broker("confirm.select"))?;
        // From now on this worker's completion events are inserted claimed for this relay.
        ctx.completions.relay_attached(true);
        Ok(Relay {
            channel,
            exchange,
            ctx,
            last_claim: Mutex::new(None),
        })
    }

    /// One relay round: take the handed events (up to a batch), claim from the outbox when
    /// nothing was handed or the last claim is [`POLL`] old (so a steady stream of hand-offs
    /// never starves intake answers or lapsed rows), publish, await confirms, mark. Returns
    /// events published.
    pub async fn step(&self) -> Result<usize, AmqpError> {
        let rows = self.gather().await;
        if rows.is_empty() {
            return Ok(0);
        }
        let traces: Vec<TraceContext> = rows.iter().filter_map(row_trace).collect();
        let span = spans::publish_results(&self.exchange, rows.len(), &traces);
        let settled = async {
            // All in flight at once: lapin resolves a publish only once its I/O thread has
            // written it, so awaiting each in turn would cost two thread switches per event.
            let sent = kit::join::in_order(rows.iter().map(|row| self.publish(row))).await;
            settle(rows.iter().zip(sent).collect()).await
        }
        .instrument(span)
        .await;
        if let Err(e) = self.ctx.ledger.mark_published(&settled.published).await {
            // They will be published again after the hold: agents dedupe by event_id.
            tracing::warn!(error = %e, "cannot mark events published");
        }
        if let Err(e) = self.ctx.ledger.release_unpublished(&settled.failed).await {
            tracing::warn!(error = %e, "cannot release unpublished events");
        }
        if let Some(e) = settled.broken {
            return Err(AmqpError::Broker {
                what: "publishing results".into(),
                error: e,
            });
        }
        Ok(settled.published.len())
    }

    /// The round's rows: the handed ones first, then (when a claim is due) rows claimed from
    /// the outbox, up to a batch in all. An outbox that cannot be read is logged and tried
    /// again next round.
    async fn gather(&self) -> Vec<OutboxRow> {
        let handed = self.ctx.completions.take_handed(BATCH as usize);
        if handed.stale > 0 {
            tracing::info!(
                events = handed.stale,
                "handed result events waited too long; left to the outbox after their hold"
            );
        }
        let mut rows = handed.rows;
        let claim_due = {
            let last = self.last_claim.lock().unwrap_or_else(|e| e.into_inner());
            rows.is_empty() || last.is_none_or(|t| t.elapsed() >= POLL)
        };
        if claim_due && (rows.len() as i64) < BATCH {
            *self.last_claim.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
            match self
                .ctx
                .ledger
                .claim_unpublished(
                    &self.ctx.worker_id,
                    BATCH - rows.len() as i64,
                    self.ctx.relay_hold,
                )
                .await
            {
                Ok(claimed) => rows.extend(claimed),
                // With nothing handed there is nothing to publish; else publish what was
                // handed. Either way the outbox is tried again next round.
                Err(e) => tracing::warn!(error = %e, "relay cannot read the outbox"),
            }
        }
        rows
    }

    /// Publishes one event (mandatory, persistent, message id = event id, type = status).
    async fn publish(&self, row: &OutboxRow) -> lapin::Result<PublisherConfirm> {
        let body = serde_json::to_vec(&row.payload).expect("json values serialize");
        let event_id = row
            .payload
            .get("event_id")
            .and_then(|v| v.as_str())
            .unwrap_or_default();
        let mut props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_message_id(event_id.into())
            .with_type(row.status.as_str().into());
        if let Some(cx) = row_trace(row) {
            let mut headers = lapin::types::FieldTable::default();
            super::trace::write(&mut headers, &cx);
            props = props.with_headers(headers);
        }
        self.channel
            .basic_publish(
                self.exchange.as_str().into(),
                row.routing_key.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                &body,
                props,
            )
            .await
    }
    /// Runs until `stop`, then does a last round so committed results leave before exit: what
    /// was handed first, then the outbox backlog.
    pub async fn run(self, stop: CancellationToken) -> Result<(), AmqpError> {
        loop {
            let n = self.step().await?;
            if n as i64 == BATCH || self.ctx.completions.handed_waiting() {
                continue;
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = self.ctx.relay_wake.notified() => {}
                _ = tokio::time::sleep(POLL) => {}
            }
            // An idle relay publishes nothing that would fail: notice a lost link here, so
            // `/readyz` and the hand-off do not count on a relay whose node has gone.
            if !self.channel.status().connected() {
                return Err(AmqpError::Topology(
                    "the relay's channel closed (its broker node went away?)".into(),
                ));
            }
        }
        while self.step().await? > 0 || self.ctx.completions.handed_waiting() {}
        Ok(())
    }
}

/// The trace context an event is sent with (the span that decided it, or the intent's).
fn row_trace(row: &OutboxRow) -> Option<TraceContext> {
    let parent = protocol::trace::TraceParent::parse(row.traceparent.as_deref()?).ok()?;
    Some(TraceContext {
        parent,
        state: row.tracestate.clone(),
    })
}

/// What the broker's confirms said about a round's events.
struct Settled {
    /// Confirmed (or returned unroutable, which is final too): marked published.
    published: Vec<i64>,
    /// Nacked or lost with the channel: released for the next round.
    failed: Vec<i64>,
    /// The channel broke: the link is lost.
    broken: Option<lapin::Error>,
}

/// Awaits each publish's confirm, in order.
async fn settle(pending: Vec<(&OutboxRow, lapin::Result<PublisherConfirm>)>) -> Settled {
    let mut settled = Settled {
        published: Vec::new(),
        failed: Vec::new(),
        broken: None,
    };
    for (row, confirm) in pending {
        let result = match confirm {
            Ok(c) => c.await,
            Err(e) => Err(e),
        };
        match result {
            Ok(Confirmation::Ack(None)) | Ok(Confirmation::NotRequested) => {
                counter!(m::RESULTS_PUBLISHED, "status" => row.status.clone()).increment(1);
                settled.published.push(row.id);
            }
            Ok(Confirmation::Ack(Some(returned))) => {
                counter!(m::RESULTS_UNROUTABLE).increment(1);
                log_unroutable(row, &returned);
                settled.published.push(row.id);
            }
            Ok(Confirmation::Nack(_)) => settled.failed.push(row.id),
            Err(e) => {
                settled.failed.push(row.id);
                settled.broken.get_or_insert(e);
            }
        }
    }
    settled
}

/// An event no queue is bound for, by key, status and the broker's reason only: the event
/// carries the receipt and the agent's arguments, which never reach a log.
fn log_unroutable(row: &OutboxRow, returned: &lapin::message::BasicReturnMessage) {
    let field = |name: &str| {
        row.payload
            .get(name)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_owned()
    };
    tracing::warn!(
        tenant = %field("tenant"),
        action_id = %field("action_id"),
        status = %row.status,
        routing_key = %row.routing_key,
        reply_code = returned.reply_code,
        reply_text = %returned.reply_text,
        "no queue is bound for this tenant's results; the event stays in the outbox and the status API"
    );
}

impl Drop for Relay {
    /// A stopped relay, or one whose link is lost, takes no hand-offs: until the next one
    /// connects, completion events are inserted unclaimed and published by whichever relay
    /// reaches them first (no wait for a hold after the link comes back).
    fn drop(&mut self) {
        self.ctx.completions.relay_attached(false);
    }
}
