//! The result relay: publishes committed result events from the outbox with publisher
//! confirms (routing key: the tenant) and marks them published. Events no queue is bound for
//! are marked too and counted; they stay readable in the outbox and through the status API.

use std::sync::Arc;
use std::time::Duration;

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
/// How long a relay owns claimed events before another relay may take them.
const HOLD: Duration = Duration::from_secs(30);
/// How often the relay looks even without a wake-up (other workers' commits, released rows).
const POLL: Duration = Duration::from_millis(500);

/// A relay bound to one confirmed channel.
pub struct Relay {
    channel: Channel,
    exchange: String,
    ctx: Arc<Context>,
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
        Ok(Relay {
            channel,
            exchange,
            ctx,
        })
    }

    /// One relay round: claim, publish, await confirms, mark. Returns events published.
    pub async fn step(&self) -> Result<usize, AmqpError> {
        let rows = match self
            .ctx
            .ledger
            .claim_unpublished(&self.ctx.worker_id, BATCH, HOLD)
            .await
        {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = %e, "relay cannot read the outbox");
                return Ok(0);
            }
        };
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
                Ok(Confirmation::Ack(Some(_returned))) => {
                    counter!(m::RESULTS_UNROUTABLE).increment(1);
                    tracing::warn!(
                        routing_key = %row.routing_key,
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
            // They will be published again after HOLD: agents dedupe by event_id.
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

    /// Runs until `stop`, then does a last round so committed results leave before exit.
    pub async fn run(self, stop: CancelToken) -> Result<(), AmqpError> {
        loop {
            let n = self.step().await?;
            if n as i64 == BATCH {
                continue;
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = self.ctx.relay_wake.notified() => {}
                _ = tokio::time::sleep(POLL) => {}
            }
        }
        while self.step().await? > 0 {}
        Ok(())
    }
}
