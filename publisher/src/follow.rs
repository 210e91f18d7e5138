//! Following every result event of one tenant (a tenant-wide observer).
//!
//! Results are acknowledged in batches: one `multiple` ack covers every result returned so far,
//! sent when half the prefetch window has been returned, before the follower waits for more,
//! and on [`Follower::close`]. A follower that dies before acking sees those results again
//! (a named queue keeps them); results are at-least-once anyway and carry their `event_id`.

use std::time::Duration;

use futures_lite::StreamExt;
use lapin::{
    options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions},
    types::FieldTable,
    Channel, Connection, ConnectionProperties, Consumer,
};

use crate::{error::PublishError, topology};

/// Unacknowledged results the broker may push ahead of [`Follower::next`].
const PREFETCH: u16 = 32;
/// Results returned before their `multiple` ack goes out, if the stream does not pause first.
const ACK_EVERY: u16 = PREFETCH / 2;

/// A consumer on a results queue bound to the results exchange for one tenant.
pub struct Follower {
    connection: Connection,
    channel: Channel,
    consumer: Consumer,
    queue: String,
    /// The delivery tag of the last result returned and not yet acknowledged, and how many
    /// results that ack will cover.
    unacked: Option<(u64, u16)>,
}

impl Follower {
    /// Connects, declares `results_exchange` (durable topic, no arguments: the same
    /// declaration as the worker's, so it is idempotent) and a queue bound to it with the
    /// tenant-wide keys `<tenant>` and `<tenant>.@.#` (every result of the tenant, whatever
    /// its `reply_to`), and starts consuming.
    ///
    /// `queue = Some(name)`: a durable, non-exclusive queue that keeps results while no
    /// follower runs. `None`: a server-named exclusive auto-delete queue, which only
    /// sees results published after this call.
    pub async fn follow(
        amqp_url: &str,
        results_exchange: &str,
        tenant: &str,
        queue: Option<&str>,
    ) -> Result<Follower, PublishError> {
        let keys = protocol::tenant_binding_keys(tenant);
        Follower::follow_keys(amqp_url, results_exchange, &keys, queue).await
    }

    /// Like [`Follower::follow`], bound with `binding_keys` instead: one agent binds only
    /// `protocol::result_routing_key(tenant, Some(reply_to))`.
    pub async fn follow_keys(
        amqp_url: &str,
        results_exchange: &str,
        binding_keys: &[String],
        queue: Option<&str>,
    ) -> Result<Follower, PublishError> {
        let connection = crate::tls::amqp_connect_any(amqp_url, ConnectionProperties::default())
            .await?
            .0;
        let channel = connection.create_channel().await?;
        topology::ensure_topic_exchange(&connection, results_exchange).await?;
        let queue =
            topology::declare_results_queue(&channel, results_exchange, binding_keys, queue)
                .await?;
        channel
            .basic_qos(PREFETCH, BasicQosOptions::default())
            .await?;
        let consumer = channel
            .basic_consume(
                crate::error::short("queue name", &queue)?,
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(Follower {
            connection,
            channel,
            consumer,
            queue,
            unacked: None,
        })
    }

    /// The name of the queue this follower consumes (server-generated for `None`).
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// Waits up to `timeout` for the next result event. `Ok(None)` when none arrived in time.
    /// Results are acknowledged in batches (see the module doc).
    ///
    /// A message whose body is not a result event is rejected without requeue (it
    /// goes to the queue's dead-letter exchange if it has one) and reported as
    /// [`PublishError::BadResult`]; the follower can go on with the next one.
    pub async fn next(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<protocol::ResultEvent>, PublishError> {
        let next = match futures_lite::future::poll_once(self.consumer.next()).await {
            Some(next) => next,
            None => {
                // Nothing is waiting: settle what was returned before waiting for more.
                self.ack_returned().await?;
                match tokio::time::timeout(timeout, self.consumer.next()).await {
                    Err(_elapsed) => return Ok(None),
                    Ok(next) => next,
                }
            }
        };
        let delivery = match next {
            None => return Err(PublishError::ConsumerClosed),
            Some(delivery) => delivery?,
        };
        match serde_json::from_slice::<protocol::ResultEvent>(&delivery.data) {
            Ok(event) => {
                let count = self.unacked.map_or(0, |(_, n)| n) + 1;
                self.unacked = Some((delivery.delivery_tag, count));
                if count >= ACK_EVERY {
                    self.ack_returned().await?;
                }
                Ok(Some(event))
            }
            Err(error) => {
                delivery
                    .reject(BasicRejectOptions { requeue: false })
                    .await?;
                Err(PublishError::BadResult(format!(
                    "{error} (body: {})",
                    preview(&delivery.data)
                )))
            }
        }
    }

    /// Acknowledges every result returned so far with one `multiple` ack.
    async fn ack_returned(&mut self) -> Result<(), PublishError> {
        ack_through(&self.channel, &mut self.unacked).await
    }

    /// Acknowledges the results returned, then closes the channel and the connection
    /// gracefully, within [`CLOSE_WAIT`](crate::tls::CLOSE_WAIT) in all; after that the
    /// connection is dropped ([`PublishError::CloseTimedOut`]). Prefetched results not yet
    /// returned (and, after a dropped close, returned ones whose ack did not get through) go back
    /// to a named queue.
    pub async fn close(mut self) -> Result<(), PublishError> {
        let mut unacked = self.unacked.take();
        let ack = ack_through(&self.channel, &mut unacked);
        crate::tls::close_within(ack, &self.channel, &self.connection).await
    }
}

/// Acknowledges every result up to the one `unacked` names, in one `multiple` ack.
async fn ack_through(
    channel: &Channel,
    unacked: &mut Option<(u64, u16)>,
) -> Result<(), PublishError> {
    if let Some((tag, _)) = unacked.take() {
        channel
            .basic_ack(tag, BasicAckOptions { multiple: true })
            .await?;
    }
    Ok(())
}

/// The start of a body, lossily decoded, for error messages.
fn preview(body: &[u8]) -> String {
    const MAX: usize = 200;
    let text = String::from_utf8_lossy(&body[..body.len().min(MAX)]).into_owned();
    if body.len() > MAX {
        format!("{text}...")
    } else {
        text
    }
}
