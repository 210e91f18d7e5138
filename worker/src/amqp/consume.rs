//! The intents consumer: manual acks, a prefetch window, and batches. Each batch goes through
//! [`crate::intake::step`]; bad messages are copied to the dead-letter exchange (with publisher
//! confirms) and only then is the batch acked; claimed operations are then dispatched.
//!
//! A redelivered message is processed alone, after counting the redelivery in Postgres: a
//! message that crashes workers is dead-lettered once it reaches the delivery limit, whatever
//! the broker version counts (RabbitMQ 4.3 no longer counts a consumer crash, and every version
//! counts returns of prefetched messages that were never started).

use std::sync::Arc;
use std::time::Duration;

use futures_lite::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection};
use metrics::counter;
use sha2::{Digest, Sha256};

use super::AmqpError;
use crate::config::{TenantAuth, Topology};
use crate::context::Context;
use crate::dispatch;
use crate::intake::{self, DeadLetter, Incoming};
use crate::shutdown::CancelToken;
use crate::telemetry::metrics as m;

/// How the consumer runs.
pub struct ConsumerConfig {
    pub topology: Topology,
    pub prefetch: u16,
    pub auth: TenantAuth,
    /// How long a fresh `prepared` row is left to its consumer before the scheduler may take it.
    pub prepared_grace: Duration,
}

/// Consumes until `stop` fires or the channel breaks. Unacked deliveries return to the queue
/// when the channel closes.
pub async fn run(
    connection: &Connection,
    ctx: Arc<Context>,
    config: ConsumerConfig,
    stop: CancelToken,
) -> Result<(), AmqpError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(AmqpError::broker("opening the consumer channel"))?;
    channel
        .basic_qos(config.prefetch, BasicQosOptions::default())
        .await
        .map_err(AmqpError::broker("basic.qos"))?;
    // Dead-letter copies go out on their own confirmed channel.
    let dlx = connection
        .create_channel()
        .await
        .map_err(AmqpError::broker("opening the dead-letter channel"))?;
    dlx.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(AmqpError::broker("confirm.select"))?;
    let tag = format!("intent-worker-{}", ctx.worker_id);
    let mut consumer = channel
        .basic_consume(
            config.topology.intents_queue.as_str().into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(AmqpError::broker("basic.consume"))?;
    tracing::info!(queue = %config.topology.intents_queue, prefetch = config.prefetch, "consuming intents");
    let max_batch = config.prefetch as usize;
    loop {
        let first = tokio::select! {
            _ = stop.cancelled() => break,
            next = consumer.next() => next,
        };
        let first = match first {
            Some(Ok(d)) => d,
            Some(Err(e)) => {
                return Err(AmqpError::Broker {
                    what: "consuming".into(),
                    source: e,
                })
            }
            None => {
                return Err(AmqpError::Topology(
                    "the broker cancelled the consumer".into(),
                ))
            }
        };
        let mut batch = vec![first];
        // A redelivered message is handled alone so a poison message cannot take others with it.
        if !batch[0].redelivered {
            while batch.len() < max_batch {
                match futures_lite::future::poll_once(consumer.next()).await {
                    Some(Some(Ok(d))) if !d.redelivered => batch.push(d),
                    Some(Some(Ok(d))) => {
                        // Keep order simple: finish this batch, then the redelivered one alone.
                        process(&channel, &dlx, &ctx, &config, batch, &stop).await?;
                        batch = vec![d];
                        break;
                    }
                    Some(Some(Err(e))) => {
                        return Err(AmqpError::Broker {
                            what: "consuming".into(),
                            source: e,
                        })
                    }
                    Some(None) => {
                        return Err(AmqpError::Topology(
                            "the broker cancelled the consumer".into(),
                        ))
                    }
                    None => break,
                }
            }
        }
        process(&channel, &dlx, &ctx, &config, batch, &stop).await?;
    }
    tracing::info!("consumer stopped; unacked deliveries return to the queue");
    let _ = channel.close(200, "shutdown".into()).await;
    Ok(())
}

/// Processes one batch until it is recorded and acked; on a ledger error the same batch is
/// retried (never acked unrecorded, never requeued, so a database outage does not spend the
/// messages' delivery limit).
async fn process(
    channel: &Channel,
    dlx: &Channel,
    ctx: &Arc<Context>,
    config: &ConsumerConfig,
    batch: Vec<Delivery>,
    stop: &CancelToken,
) -> Result<(), AmqpError> {
    let mut backoff = Duration::from_millis(100);
    loop {
        match try_process(dlx, ctx, config, &batch).await {
            Ok(claimed) => {
                // Counted once the batch is recorded, so a batch retried in an outage counts once.
                counter!(m::INTENTS_RECEIVED).increment(batch.len() as u64);
                let last = batch
                    .iter()
                    .map(|d| d.delivery_tag)
                    .max()
                    .expect("non-empty batch");
                channel
                    .basic_ack(last, BasicAckOptions { multiple: true })
                    .await
                    .map_err(AmqpError::broker("basic.ack"))?;
                ctx.relay_wake.notify_one();
                for op in claimed {
                    ctx.spawn_bounded(|ctx| dispatch::run(ctx, op)).await;
                }
                return Ok(());
            }
            Err(Failure::Broker(e)) => return Err(e),
            Err(Failure::Ledger(e)) => {
                counter!(m::LEDGER_ERRORS, "operation" => "intake").increment(1);
                tracing::error!(error = %e, retry_in_ms = backoff.as_millis() as u64, "cannot record intents; retrying the batch");
                tokio::select! {
                    _ = stop.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
}

enum Failure {
    Ledger(crate::ledger::LedgerError),
    Broker(AmqpError),
}

async fn try_process(
    dlx: &Channel,
    ctx: &Arc<Context>,
    config: &ConsumerConfig,
    batch: &[Delivery],
) -> Result<Vec<crate::ledger::Operation>, Failure> {
    let limit = config.topology.delivery_limit;
    // Poison guard (a redelivered delivery arrives alone).
    if let [d] = batch {
        if d.redelivered {
            let sha = hex(&Sha256::digest(&d.data));
            // Only our own count: the broker's `x-delivery-count` also counts returns of
            // prefetched messages a crashed worker never started, which would condemn a poison
            // message's innocent neighbours.
            let deliveries = ctx
                .ledger
                .count_redelivery(&sha)
                .await
                .map_err(Failure::Ledger)? as u32;
            if deliveries > limit {
                let dl = DeadLetter {
                    index: 0,
                    reason: "delivery_limit",
                    detail: format!("delivered {deliveries} times (limit {limit}); workers crashed while handling it"),
                };
                tracing::error!(deliveries, limit, "poison message dead-lettered");
                dead_letter(dlx, &config.topology, d, &dl)
                    .await
                    .map_err(Failure::Broker)?;
                return Ok(Vec::new());
            }
        }
    }
    let incoming: Vec<Incoming> = batch
        .iter()
        .map(|d| Incoming {
            body: d.data.clone(),
            redelivered: d.redelivered,
            user_id: d
                .properties
                .user_id()
                .as_ref()
                .map(|u| u.as_str().to_string()),
        })
        .collect();
    let outcome = intake::step(ctx, &config.auth, config.prepared_grace, &incoming)
        .await
        .map_err(Failure::Ledger)?;
    for dl in &outcome.dead_letters {
        tracing::warn!(reason = dl.reason, detail = %dl.detail, "intent dead-lettered");
        dead_letter(dlx, &config.topology, &batch[dl.index], dl)
            .await
            .map_err(Failure::Broker)?;
    }
    Ok(outcome.claimed)
}

/// Copies a delivery to the dead-letter exchange with the reason, and waits for the confirm.
async fn dead_letter(
    dlx: &Channel,
    t: &Topology,
    d: &Delivery,
    dl: &DeadLetter,
) -> Result<(), AmqpError> {
    let mut headers = d.properties.headers().clone().unwrap_or_default();
    headers.insert(
        "x-intent-worker-reason".into(),
        AMQPValue::LongString(LongString::from(dl.reason)),
    );
    headers.insert(
        "x-intent-worker-detail".into(),
        AMQPValue::LongString(LongString::from(dl.detail.as_str())),
    );
    headers.insert(
        "x-original-routing-key".into(),
        AMQPValue::LongString(LongString::from(d.routing_key.as_str())),
    );
    if let Some(user) = d.properties.user_id() {
        headers.insert(
            "x-intent-worker-user-id".into(),
            AMQPValue::LongString(LongString::from(user.as_str())),
        );
    }
    let props = copy_without_user_id(&d.properties)
        .with_headers(headers)
        .with_delivery_mode(2);
    let confirm = dlx
        .basic_publish(
            t.dead_letter_exchange.as_str().into(),
            d.routing_key.clone(),
            BasicPublishOptions::default(),
            &d.data,
            props,
        )
        .await
        .map_err(AmqpError::broker("publishing to the dead-letter exchange"))?
        .await
        .map_err(AmqpError::broker("dead-letter confirm"))?;
    if !confirm.is_ack() {
        return Err(AmqpError::NotConfirmed {
            exchange: t.dead_letter_exchange.clone(),
            reason: "nacked".into(),
        });
    }
    counter!(m::DEAD_LETTERED, "reason" => dl.reason).increment(1);
    Ok(())
}

/// The delivery's properties minus `user_id`: the broker refuses a `user_id` other than the
/// worker's own connection user, so the publisher's stays in a header instead.
fn copy_without_user_id(p: &lapin::BasicProperties) -> lapin::BasicProperties {
    let mut out = lapin::BasicProperties::default();
    macro_rules! copy {
        ($($get:ident => $set:ident),*) => {
            $(if let Some(v) = p.$get() { out = out.$set(v.clone()); })*
        };
    }
    copy!(content_type => with_content_type, content_encoding => with_content_encoding,
          priority => with_priority, correlation_id => with_correlation_id,
          reply_to => with_reply_to, expiration => with_expiration,
          message_id => with_message_id, timestamp => with_timestamp, kind => with_type,
          app_id => with_app_id, cluster_id => with_cluster_id);
    out
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
