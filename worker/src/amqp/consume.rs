//! The intents consumer: manual acks, a prefetch window, and batches. Each batch goes through
//! [`crate::intake::step`]; bad messages are copied to the dead-letter exchange (with publisher
//! confirms, the reason in the header `x-intent-worker-reason`:
//! [`crate::answers::DeadLetterReason`]); claimed operations are dispatched and the batch is
//! acked.
//!
//! Ack rule: a delivery tag is acked only after its own record committed. A batch that could not
//! be recorded when shutdown came is left unacked and the consumer takes nothing more (the
//! stop branch of its `select!` is biased), and `basic.ack(multiple)` is used only when every
//! earlier tag of the channel is already settled, so it can never cover an unrecorded one.
//!
//! A dead-letter copy that the broker refuses (a closed channel, a nack, no route) is that
//! message's problem, not the process's: the copy is retried on a fresh channel a few times,
//! then counted and logged, and the delivery is rejected without requeue so the queue's own
//! dead-letter exchange takes it. Copies never carry the publisher's `user_id` (the broker
//! refuses one the worker's connection cannot vouch for); it is kept in the header
//! `x-intent-worker-user-id`. An intent the worker itself republished from the dead-letter
//! queue is proven as its original publisher ([`super::dead_letters::proven_user`]).
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
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, BasicRejectOptions,
    ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::Confirmation;
use lapin::{BasicProperties, Channel, Connection};
use metrics::counter;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use super::dead_letters::proven_user;
use super::{hex, AmqpError};
use crate::answers::DeadLetterReason;
use crate::config::Topology;
use crate::context::Context;
use crate::dispatch;
use crate::intake::TenantAuth;
use crate::intake::{self, DeadLetter, Incoming};
use crate::telemetry::metrics as m;

/// Waits between tries to record a batch the ledger refused: from 100 ms doubling to 10 s.
const RECORD_RETRY: kit::backoff::Backoff = kit::backoff::Backoff {
    initial: Duration::from_millis(100),
    multiplier: 2.0,
    max: Duration::from_secs(10),
    jitter: 0.2,
};

/// How the consumer runs.
#[derive(Clone)]
pub struct ConsumerConfig {
    pub topology: Topology,
    /// Already lowered so that `prefetch` messages of `max_message_bytes` fit the in-flight
    /// byte bound (`Settings::prefetch`).
    pub prefetch: u16,
    /// A delivery over this is dead-lettered unread (`WORKER_MAX_MESSAGE_BYTES`).
    pub max_message_bytes: usize,
    pub auth: TenantAuth,
    /// The intents queues consumed (`WORKER_INTENT_SHARDS`, `WORKER_DRAIN_SHARDS`).
    pub shards: super::topology::Shards,
    /// The worker's own broker user (`AMQP_URL`): the only one whose republished intents may
    /// name their original publisher.
    pub own_user: Option<String>,
}

/// Whether [`process`] recorded its batch (and then acked it) or gave it up at shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Processed {
    Recorded,
    /// Shutdown came while the batch could not be recorded: nothing was acked.
    Abandoned,
}

/// Consumes until `stop` fires (Ok) or the channel or connection breaks (Err: the caller
/// reconnects). Unacked deliveries return to the queue when the channel closes.
pub async fn run(
    connection: &Connection,
    ctx: Arc<Context>,
    config: &ConsumerConfig,
    stop: CancellationToken,
) -> Result<(), AmqpError> {
    let (channel, mut dlx, mut consumer) = open(connection, &ctx, config).await?;
    let max_batch = config.prefetch as usize;
    let mut acks = Acks::default();
    let mut pace = crate::batch::Pace::new(ctx.batch_pace);
    let mut last_full = false;
    'consume: loop {
        // Once stopping, no further delivery is taken, even if one is buffered.
        if stop.is_cancelled() {
            break;
        }
        // A delivery already buffered when the last batch ended means the intake is saturated:
        // then the pace holds; otherwise the next delivery goes at once.
        let waiting = futures_lite::future::poll_once(consumer.next()).await;
        pace.ended(last_full || waiting.is_some());
        let first = match waiting {
            Some(next) => next,
            None => tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                next = consumer.next() => next,
            },
        };
        let mut batch = vec![delivered(first)?];
        // A redelivered message is handled alone so a poison message cannot take others with it.
        if !batch[0].redelivered {
            // What arrives while the pace is waited out joins this batch (the broker keeps
            // delivering up to the prefetch meanwhile).
            pace.wait(&stop).await;
            pace.started();
            while batch.len() < max_batch && !stop.is_cancelled() {
                let Some(next) = futures_lite::future::poll_once(consumer.next()).await else {
                    break;
                };
                let d = delivered(next)?;
                if !d.redelivered {
                    batch.push(d);
                    continue;
                }
                // Keep order simple: finish this batch, then the redelivered one alone.
                let done =
                    process(&channel, &mut dlx, &ctx, config, batch, &stop, &mut acks).await?;
                if done == Processed::Abandoned {
                    break 'consume;
                }
                batch = vec![d];
                break;
            }
        }
        last_full = batch.len() == max_batch;
        if process(&channel, &mut dlx, &ctx, config, batch, &stop, &mut acks).await?
            == Processed::Abandoned
        {
            break;
        }
    }
    tracing::info!("consumer stopped; unacked deliveries return to the queue");
    super::close_channel(&channel, "shutdown").await;
    super::close_channel(&dlx.channel, "shutdown").await;
    Ok(())
}

/// What the consumer stream gave: a delivery, or the error that ends this link.
fn delivered(next: Option<lapin::Result<Delivery>>) -> Result<Delivery, AmqpError> {
    match next {
        Some(Ok(d)) => Ok(d),
        Some(Err(e)) => Err(AmqpError::Broker {
            what: "consuming".into(),
            error: e,
        }),
        None => Err(AmqpError::Topology(
            "the broker cancelled the consumer".into(),
        )),
    }
}

/// The deliveries of every consumed queue, in arrival order. One queue is read directly; for
/// several (shards), a task per consumer forwards into one channel, and a consumer the broker
/// ends (cancelled, or its channel closed) ends the whole stream, so the link is reopened and
/// every consumer resubscribed.
enum Deliveries {
    One(lapin::Consumer),
    Merged(tokio::sync::mpsc::Receiver<Option<lapin::Result<Delivery>>>),
}

impl Deliveries {
    fn merge(consumers: Vec<lapin::Consumer>, capacity: usize) -> Deliveries {
        let (tx, rx) = tokio::sync::mpsc::channel(capacity.max(1));
        for mut consumer in consumers {
            let tx = tx.clone();
            tokio::spawn(async move {
                loop {
                    let next = consumer.next().await;
                    let end = !matches!(next, Some(Ok(_)));
                    if tx.send(next).await.is_err() || end {
                        return;
                    }
                }
            });
        }
        Deliveries::Merged(rx)
    }

    async fn next(&mut self) -> Option<lapin::Result<Delivery>> {
        match self {
            Deliveries::One(c) => c.next().await,
            Deliveries::Merged(rx) => rx.recv().await.flatten(),
        }
    }
}

/// The consumer channel (with the prefetch), the dead-letter channel and the consumers.
async fn open<'c>(
    connection: &'c Connection,
    ctx: &Context,
    config: &'c ConsumerConfig,
) -> Result<(Channel, DeadLetters<'c>, Deliveries), AmqpError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(AmqpError::broker("opening the consumer channel"))?;
    channel
        .basic_qos(config.prefetch, BasicQosOptions::default())
        .await
        .map_err(AmqpError::broker("basic.qos"))?;
    // Dead-letter copies go out on their own confirmed channel.
    let dlx = DeadLetters::open(connection, config).await?;
    let queues = super::topology::consumed_queues(&config.topology, config.shards);
    let mut consumers = Vec::with_capacity(queues.len());
    for (i, queue) in queues.iter().enumerate() {
        let tag = if queues.len() == 1 {
            format!("intent-worker-{}", ctx.worker_id)
        } else {
            format!("intent-worker-{}-{i}", ctx.worker_id)
        };
        let consumer = channel
            .basic_consume(
                queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(AmqpError::broker(format!("basic.consume of {queue:?}")))?;
        consumers.push(consumer);
    }
    tracing::info!(queues = ?queues, prefetch = config.prefetch, "consuming intents");
    let deliveries = if consumers.len() == 1 {
        Deliveries::One(consumers.pop().expect("one consumer"))
    } else {
        Deliveries::merge(consumers, config.prefetch as usize * queues.len())
    };
    Ok((channel, dlx, deliveries))
}

/// Which delivery tags of the consumer channel are settled, so that `multiple` acks are used
/// only when they cannot cover an unrecorded tag.
#[derive(Debug, Default)]
struct Acks {
    /// Every tag up to this one is acked or rejected.
    settled_through: u64,
}

/// How to ack a recorded batch.
#[derive(Debug, PartialEq, Eq)]
enum AckPlan {
    /// One `multiple` ack up to this tag (None: every tag was already rejected), after which
    /// every tag up to the batch's last is settled.
    Through { ack: Option<u64>, settled: u64 },
    /// One ack per tag: an earlier tag is unsettled, so `multiple` could cover it.
    Each(Vec<u64>),
}

impl Acks {
    /// `tags` were all recorded; `rejected` among them are already settled. A `multiple` ack
    /// only when they continue the settled prefix without a gap.
    fn plan(&self, tags: &[u64], rejected: &[u64]) -> AckPlan {
        let mut sorted = tags.to_vec();
        sorted.sort_unstable();
        let contiguous = sorted
            .iter()
            .enumerate()
            .all(|(i, t)| *t == self.settled_through + 1 + i as u64);
        let last = *sorted.last().expect("non-empty batch");
        let to_ack: Vec<u64> = sorted
            .into_iter()
            .filter(|t| !rejected.contains(t))
            .collect();
        if contiguous {
            AckPlan::Through {
                ack: (!to_ack.is_empty()).then_some(last),
                settled: last,
            }
        } else {
            AckPlan::Each(to_ack)
        }
    }

    async fn ack(
        &mut self,
        channel: &Channel,
        tags: &[u64],
        rejected: &[u64],
    ) -> Result<(), lapin::Error> {
        match self.plan(tags, rejected) {
            AckPlan::Through { ack, settled } => {
                if let Some(tag) = ack {
                    channel
                        .basic_ack(tag, BasicAckOptions { multiple: true })
                        .await?;
                }
                self.settled_through = settled;
            }
            AckPlan::Each(tags) => {
                for t in tags {
                    channel
                        .basic_ack(t, BasicAckOptions { multiple: false })
                        .await?;
                }
            }
        }
        Ok(())
    }
}

/// Processes one batch until it is recorded and acked; on a ledger error the same batch is
/// retried (never acked unrecorded, never requeued, so a database outage does not spend the
/// messages' delivery limit) until it records or shutdown comes.
async fn process(
    channel: &Channel,
    dlx: &mut DeadLetters<'_>,
    ctx: &Arc<Context>,
    config: &ConsumerConfig,
    batch: Vec<Delivery>,
    stop: &CancellationToken,
    acks: &mut Acks,
) -> Result<Processed, AmqpError> {
    let mut failures = 0u32;
    // The poison guard's count for a redelivered delivery, taken once: retrying the batch through
    // a ledger outage is still one delivery, not one per attempt.
    let mut counted: Option<u32> = None;
    // Read once per delivery: a batch retried through an outage is still one delivery (one span).
    let received: Vec<Received> = batch.iter().map(Received::of).collect();
    loop {
        match try_process(dlx, ctx, config, &batch, &received, &mut counted).await {
            Ok(Recorded {
                claimed,
                broken: Some(e),
                ..
            }) => {
                // The claims are committed; the link broke while dead-lettering. Dispatch them
                // (they need no broker) and leave the deliveries unacked: they come back
                // redelivered and the inbox answers them from their rows.
                for c in claimed {
                    ctx.spawn_bounded(|ctx| dispatch_claim(ctx, c)).await;
                }
                return Err(e);
            }
            Ok(Recorded {
                claimed,
                answered,
                refused,
                broken: None,
            }) => {
                // Counted once the batch is recorded, so a batch retried in an outage counts once.
                counter!(m::INTENTS_RECEIVED).increment(batch.len() as u64);
                // The claims are committed: they are dispatched first, so no send waits on the
                // broker (if the link has just gone, the ack is lost and the redelivery is
                // answered from the inbox).
                for c in claimed {
                    ctx.spawn_bounded(|ctx| dispatch_claim(ctx, c)).await;
                }
                let mut settled = Ok(());
                let mut rejected = Vec::new();
                for tag in refused.iter().map(|&i| batch[i].delivery_tag) {
                    // The queue's own dead-letter exchange takes it: nothing is lost.
                    settled = channel
                        .basic_reject(tag, BasicRejectOptions { requeue: false })
                        .await;
                    if settled.is_err() {
                        break;
                    }
                    rejected.push(tag);
                }
                if settled.is_ok() {
                    let tags: Vec<u64> = batch.iter().map(|d| d.delivery_tag).collect();
                    settled = acks.ack(channel, &tags, &rejected).await;
                }
                if answered > 0 {
                    // A wake with nothing new costs the relay an empty outbox claim.
                    ctx.relay_wake.notify_one();
                }
                settled.map_err(AmqpError::broker("basic.ack"))?;
                return Ok(Processed::Recorded);
            }
            Err(Failure::Broker(e)) => return Err(e),
            Err(Failure::Ledger(e)) => {
                ctx.ledger.failed("intake", &e);
                failures += 1;
                let backoff = kit::backoff::delay(&RECORD_RETRY, failures);
                tracing::error!(error = %e, retry_in_ms = backoff.as_millis() as u64, "cannot record intents; retrying the batch");
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => {
                        tracing::warn!(
                            deliveries = batch.len(),
                            "shutting down with a batch that could not be recorded; it stays unacked and returns to the queue"
                        );
                        return Ok(Processed::Abandoned);
                    }
                    _ = tokio::time::sleep(backoff) => {}
                }
            }
        }
    }
}

enum Failure {
    Ledger(crate::ledger::LedgerError),
    Broker(AmqpError),
}

/// A recorded batch: the operations to dispatch, the deliveries (batch indices) whose
/// dead-letter copy the broker refused, to be rejected without requeue, and whether the broker
/// connection broke while dead-lettering (then nothing is acked).
struct Recorded {
    claimed: Vec<intake::Claimed>,
    /// Result events the step committed (answers to duplicates and rejections).
    answered: usize,
    refused: Vec<usize>,
    broken: Option<AmqpError>,
}

/// What a delivery carried for tracing: its trace context and its `process intents` span.
struct Received {
    trace: Option<protocol::trace::TraceContext>,
    span: tracing::Span,
}

impl Received {
    fn of(d: &Delivery) -> Received {
        let trace = super::trace::received(d.properties.headers().as_ref());
        let span = super::trace::process_span(d, trace.as_ref());
        Received { trace, span }
    }
}

async fn try_process(
    dlx: &mut DeadLetters<'_>,
    ctx: &Arc<Context>,
    config: &ConsumerConfig,
    batch: &[Delivery],
    received: &[Received],
    counted: &mut Option<u32>,
) -> Result<Recorded, Failure> {
    let limit = config.topology.delivery_limit;
    // Poison guard (a redelivered delivery arrives alone).
    if let [d] = batch {
        if d.redelivered {
            let sha = hex(&Sha256::digest(&d.data));
            // Only our own count: the broker's `x-delivery-count` also counts returns of
            // prefetched messages a crashed worker never started, which would condemn a poison
            // message's innocent neighbours.
            let deliveries = match *counted {
                Some(n) => n,
                None => {
                    let n = ctx
                        .ledger
                        .count_redelivery(&sha)
                        .await
                        .map_err(Failure::Ledger)? as u32;
                    *counted = Some(n);
                    n
                }
            };
            if deliveries > limit {
                let dl = DeadLetter {
                    index: 0,
                    reason: DeadLetterReason::DeliveryLimit,
                    detail: format!("delivered {deliveries} times (limit {limit}); workers crashed while handling it"),
                };
                tracing::error!(deliveries, limit, "poison message dead-lettered");
                let copied = dlx.send(d, &dl).await.map_err(Failure::Broker)?;
                return Ok(Recorded {
                    claimed: Vec::new(),
                    answered: 0,
                    refused: if copied { Vec::new() } else { vec![0] },
                    broken: None,
                });
            }
        }
    }
    let incoming: Vec<Incoming> = batch
        .iter()
        .zip(received)
        .map(|(d, r)| Incoming {
            body: d.data.clone(),
            redelivered: d.redelivered,
            user_id: proven_user(&d.properties, config.own_user.as_deref()),
            trace: r.trace.clone(),
            span: r.span.clone(),
        })
        .collect();
    let outcome = intake::step(ctx, &config.auth, config.max_message_bytes, &incoming)
        .await
        .map_err(Failure::Ledger)?;
    let mut refused = Vec::new();
    let mut broken = None;
    for dl in &outcome.dead_letters {
        tracing::warn!(reason = dl.reason.as_str(), detail = %dl.detail, "intent dead-lettered");
        match dlx.send(&batch[dl.index], dl).await {
            Ok(true) => {}
            Ok(false) => refused.push(dl.index),
            Err(e) => {
                broken = Some(e);
                break;
            }
        }
    }
    Ok(Recorded {
        claimed: outcome.claimed,
        answered: outcome.answered,
        refused,
        broken,
    })
}

/// Copy attempts per dead letter before the delivery is handed to the queue's own DLX.
const DEAD_LETTER_ATTEMPTS: u32 = 3;

/// The confirmed channel dead-letter copies go out on, reopened when the broker closes it.
struct DeadLetters<'c> {
    connection: &'c Connection,
    channel: Channel,
    topology: &'c Topology,
    own_user: Option<&'c str>,
}

impl<'c> DeadLetters<'c> {
    async fn open(
        connection: &'c Connection,
        config: &'c ConsumerConfig,
    ) -> Result<DeadLetters<'c>, AmqpError> {
        Ok(DeadLetters {
            connection,
            channel: confirmed_channel(connection).await?,
            topology: &config.topology,
            own_user: config.own_user.as_deref(),
        })
    }

    /// Copies `d` to the dead-letter exchange. Ok(true): confirmed. Ok(false): the broker kept
    /// refusing this copy (counted and logged; the caller rejects the delivery so the queue's
    /// DLX takes it). Err: the connection itself is gone.
    async fn send(&mut self, d: &Delivery, dl: &DeadLetter) -> Result<bool, AmqpError> {
        let mut delay = Duration::from_millis(100);
        let mut last = String::new();
        for attempt in 1..=DEAD_LETTER_ATTEMPTS {
            match self.publish(d, dl).await {
                Ok(()) => {
                    counter!(m::DEAD_LETTERED, "reason" => dl.reason.as_str()).increment(1);
                    return Ok(true);
                }
                Err(e) => {
                    if !self.connection.status().connected() {
                        return Err(e);
                    }
                    tracing::warn!(attempt, reason = dl.reason.as_str(), error = %e, "dead-letter copy refused; retrying on a fresh channel");
                    last = e.to_string();
                }
            }
            if attempt < DEAD_LETTER_ATTEMPTS {
                tokio::time::sleep(delay).await;
                delay *= 4;
            }
            if self.channel.status().connected() {
                let _ = tokio::time::timeout(
                    Duration::from_secs(1),
                    self.channel.close(200, "reopening".into()),
                )
                .await;
            }
            self.channel = confirmed_channel(self.connection).await?;
        }
        counter!(m::DEAD_LETTER_REFUSED, "reason" => dl.reason.as_str()).increment(1);
        tracing::error!(
            reason = dl.reason.as_str(), detail = %dl.detail, error = %last,
            "the broker refused the dead-letter copy {DEAD_LETTER_ATTEMPTS} times; rejecting the delivery so the queue's own dead-letter exchange takes it"
        );
        Ok(false)
    }

    /// One confirmed, routed copy with the reason headers.
    async fn publish(&self, d: &Delivery, dl: &DeadLetter) -> Result<(), AmqpError> {
        let t = self.topology;
        let user = proven_user(&d.properties, self.own_user);
        let props = dead_letter_properties(&d.properties, dl, d.routing_key.as_str(), user);
        let confirm = self
            .channel
            .basic_publish(
                t.dead_letter_exchange.as_str().into(),
                d.routing_key.clone(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                &d.data,
                props,
            )
            .await
            .map_err(AmqpError::broker("publishing to the dead-letter exchange"))?
            .await
            .map_err(AmqpError::broker("dead-letter confirm"))?;
        match confirm {
            Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
            Confirmation::Ack(Some(_)) => Err(AmqpError::NotConfirmed {
                exchange: t.dead_letter_exchange.clone(),
                reason: "unroutable (no queue bound)".into(),
            }),
            Confirmation::Nack(_) => Err(AmqpError::NotConfirmed {
                exchange: t.dead_letter_exchange.clone(),
                reason: "nacked".into(),
            }),
        }
    }
}

/// A committed claim's dispatch, registered with the send fence's batcher as it starts: it
/// holds its slot and asks for its fence at once, so a fence batch that begins meanwhile waits
/// for it and the claims of one intake batch are fenced together.
fn dispatch_claim(ctx: Arc<Context>, c: intake::Claimed) -> impl std::future::Future<Output = ()> {
    let expected = ctx.fences.expect();
    dispatch::run(ctx, c.operation, Some(c.parent), Some(expected))
}

async fn confirmed_channel(connection: &Connection) -> Result<Channel, AmqpError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(AmqpError::broker("opening the dead-letter channel"))?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(AmqpError::broker("confirm.select"))?;
    Ok(channel)
}

/// The copy's properties: the original ones with the reason headers, persistent, and without
/// `user_id`, which RabbitMQ accepts only when it names the publishing connection's own user
/// (the proven publisher, `user`, is kept in `x-intent-worker-user-id`: for a republished
/// intent that is its original publisher, not the worker).
pub fn dead_letter_properties(
    original: &BasicProperties,
    dl: &DeadLetter,
    routing_key: &str,
    user: Option<String>,
) -> BasicProperties {
    // A stale original-publisher header (a republished intent's) is replaced, never kept.
    let mut kept = original
        .headers()
        .clone()
        .unwrap_or_default()
        .inner()
        .clone();
    kept.remove("x-intent-worker-user-id");
    let mut headers = FieldTable::from(kept);
    let mut text = |k: &str, v: &str| {
        headers.insert(k.into(), AMQPValue::LongString(LongString::from(v)));
    };
    text("x-intent-worker-reason", dl.reason.as_str());
    text("x-intent-worker-detail", &dl.detail);
    text("x-original-routing-key", routing_key);
    if let Some(user) = user {
        text("x-intent-worker-user-id", &user);
    }
    super::persistent_copy(original, headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multiple_ack_only_continues_a_settled_prefix() {
        let acks = Acks::default();
        assert_eq!(
            acks.plan(&[2, 1, 3], &[]),
            AckPlan::Through {
                ack: Some(3),
                settled: 3
            }
        );
        assert_eq!(
            acks.plan(&[1], &[1]),
            AckPlan::Through {
                ack: None,
                settled: 1
            }
        );
        let acks = Acks { settled_through: 3 };
        // Tag 4 was never recorded: 5 and 6 are acked one by one, 4 is not covered.
        assert_eq!(acks.plan(&[5, 6], &[]), AckPlan::Each(vec![5, 6]));
        assert_eq!(acks.plan(&[5, 6, 7], &[6]), AckPlan::Each(vec![5, 7]));
        assert_eq!(
            acks.plan(&[4, 5], &[5]),
            AckPlan::Through {
                ack: Some(5),
                settled: 5
            }
        );
    }

    #[test]
    fn dead_letter_copy_drops_user_id_and_keeps_it_in_a_header() {
        let mut h = FieldTable::default();
        h.insert("trace".into(), AMQPValue::LongString("t-1".into()));
        let original = BasicProperties::default()
            .with_user_id("alice".into())
            .with_content_type("application/json".into())
            .with_message_id("m-1".into())
            .with_headers(h);
        let dl = DeadLetter {
            index: 0,
            reason: DeadLetterReason::InvalidMessage,
            detail: "wrong_type: arguments".into(),
        };
        let p = dead_letter_properties(&original, &dl, "tenant-a", Some("alice".into()));
        assert!(p.user_id().is_none());
        assert_eq!(
            p.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        assert_eq!(p.message_id().as_ref().unwrap().as_str(), "m-1");
        assert_eq!(*p.delivery_mode(), Some(2));
        let headers = p.headers().as_ref().unwrap().inner();
        let text = |k: &str| match headers.get(k) {
            Some(AMQPValue::LongString(s)) => s.to_string(),
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!(text("x-intent-worker-user-id"), "alice");
        assert_eq!(text("x-intent-worker-reason"), "invalid_message");
        assert_eq!(text("x-original-routing-key"), "tenant-a");
        assert_eq!(text("trace"), "t-1");
        let anonymous = dead_letter_properties(&BasicProperties::default(), &dl, "k", None);
        assert!(!anonymous
            .headers()
            .as_ref()
            .unwrap()
            .inner()
            .contains_key("x-intent-worker-user-id"));
    }
}
