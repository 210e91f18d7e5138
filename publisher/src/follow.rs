//! Following every result event of one tenant (a tenant-wide observer).

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

/// A consumer on a results queue bound to the results exchange for one tenant.
pub struct Follower {
    connection: Connection,
    channel: Channel,
    consumer: Consumer,
    queue: String,
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
        })
    }

    /// The name of the queue this follower consumes (server-generated for `None`).
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// Waits up to `timeout` for the next result event and acknowledges it.
    /// `Ok(None)` when none arrived in time.
    ///
    /// A message whose body is not a result event is rejected without requeue (it
    /// goes to the queue's dead-letter exchange if it has one) and reported as
    /// [`PublishError::BadResult`]; the follower can go on with the next one.
    pub async fn next(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<protocol::ResultEvent>, PublishError> {
        let delivery = match tokio::time::timeout(timeout, self.consumer.next()).await {
            Err(_elapsed) => return Ok(None),
            Ok(None) => return Err(PublishError::ConsumerClosed),
            Ok(Some(delivery)) => delivery?,
        };
        match serde_json::from_slice::<protocol::ResultEvent>(&delivery.data) {
            Ok(event) => {
                delivery.ack(BasicAckOptions::default()).await?;
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

    /// Closes the channel and the connection gracefully. Unacknowledged prefetched
    /// results go back to a named queue.
    pub async fn close(self) -> Result<(), PublishError> {
        self.channel.close(200, "OK".into()).await?;
        self.connection.close(200, "OK".into()).await?;
        Ok(())
    }
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
