//! The result relay: publishes committed result events from the outbox with publisher
//! confirms (routing key: the tenant) and marks them published. Events no queue is bound for
//! are marked too and counted; they stay readable in the outbox and through the status API.
//!
//! Two sources feed it. This worker's own completions arrive in memory, already claimed for
//! it in the outbox by the commit that wrote them ([`Context::take_handed`]); they go first
//! and cost no claim statement. Everything else (intake answers, expiries, operator events,
//! other workers' lapsed rows, hand-offs that were dropped) is claimed from the outbox with
//! `claim_unpublished`, when nothing was handed or at least every [`POLL`].

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::Confirmation;
use lapin::{BasicProperties, Channel, Connection};
use metrics::counter;

use super::AmqpError;
use crate::context::Context;
use crate::shutdown::CancelToken;
use crate::telemetry::metrics as m;

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
        ctx.relay_attached(true);
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
        let handed = self.ctx.take_handed(BATCH as usize);
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
                Err(e) if rows.is_empty() => {
                    tracing::warn!(error = %e, "relay cannot read the outbox");
                    return Ok(0);
                }
                // Publish what was handed; the outbox is tried again next round.
                Err(e) => tracing::warn!(error = %e, "relay cannot read the outbox"),
            }
        }
        if rows.is_empty() {
            return Ok(0);
        }
        let mut pending = Vec::with_capacity(rows.len());
        for row in &rows {
            let body = serde_json::to_vec(&row.payload).expect("json values serialize");
            let event_id = row
                .payload
                .get("event_id")
                .and_then(|v| v.as_str())
                .unwrap_or_default();
            let props = BasicProperties::default()
                .with_content_type("application/json".into())
                .with_delivery_mode(2)
                .with_message_id(event_id.into())
                .with_type(row.status.as_str().into());
            let confirm = self
                .channel
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
                .await;
            pending.push((row, confirm));
        }
        let mut published = Vec::new();
        let mut failed = Vec::new();
        let mut broken = None;
        for (row, confirm) in pending {
            let result = match confirm {
                Ok(c) => c.await,
                Err(e) => Err(e),
            };
            match result {
                Ok(Confirmation::Ack(None)) | Ok(Confirmation::NotRequested) => {
                    counter!(m::RESULTS_PUBLISHED, "status" => row.status.clone()).increment(1);
                    published.push(row.id);
                }
                Ok(Confirmation::Ack(Some(returned))) => {
                    counter!(m::RESULTS_UNROUTABLE).increment(1);
                    // By key, status and the broker's reason only: the event carries the
                    // receipt and the agent's arguments, which never reach a log.
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
                    published.push(row.id);
                }
                Ok(Confirmation::Nack(_)) => failed.push(row.id),
                Err(e) => {
                    failed.push(row.id);
                    broken.get_or_insert(e);
                }
            }
        }
        if let Err(e) = self.ctx.ledger.mark_published(&published).await {
            // They will be published again after the hold: agents dedupe by event_id.
            tracing::warn!(error = %e, "cannot mark events published");
        }
        if let Err(e) = self.ctx.ledger.release_unpublished(&failed).await {
            tracing::warn!(error = %e, "cannot release unpublished events");
        }
        if let Some(e) = broken {
            return Err(AmqpError::Broker {
                what: "publishing results".into(),
                error: e,
            });
        }
        Ok(published.len())
    }

    /// Runs until `stop`, then does a last round so committed results leave before exit: what
    /// was handed first, then the outbox backlog.
    pub async fn run(self, stop: CancelToken) -> Result<(), AmqpError> {
        loop {
            let n = self.step().await?;
            if n as i64 == BATCH || self.ctx.handed_waiting() {
                continue;
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = self.ctx.relay_wake.notified() => {}
                _ = tokio::time::sleep(POLL) => {}
            }
        }
        while self.step().await? > 0 || self.ctx.handed_waiting() {}
        Ok(())
    }
}

impl Drop for Relay {
    /// A stopped relay, or one whose link is lost, takes no hand-offs: until the next one
    /// connects, completion events are inserted unclaimed and published by whichever relay
    /// reaches them first (no wait for a hold after the link comes back).
    fn drop(&mut self) {
        self.ctx.relay_attached(false);
    }
}
