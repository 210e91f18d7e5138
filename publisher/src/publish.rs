//! Publishing intents with publisher confirms.
//!
//! Every publish is `mandatory` and waits for its confirm, so `Ok(())` means the
//! broker routed the message to at least one queue and took responsibility for it.
//! The message id is the logical action key `<tenant>:<action_id>`, the same on every
//! send of the same action; the publisher never retries and never mints a new key.

use lapin::{
    options::{BasicPublishOptions, ConfirmSelectOptions},
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties,
};

use crate::{error::PublishError, topology};

/// Content type of every intent.
pub const JSON: &str = "application/json";

/// AMQP `delivery_mode` for persistent messages.
const PERSISTENT: u8 = 2;

/// The logical action key `<tenant>:<action_id>`, used as the AMQP `message_id`.
pub fn action_key(tenant: &str, action_id: &str) -> String {
    format!("{tenant}:{action_id}")
}

/// A connection and a confirm-mode channel bound to one exchange.
pub struct Publisher {
    connection: Connection,
    channel: Channel,
    exchange: String,
}

impl Publisher {
    /// Connects to `amqp_url`, opens a channel in confirm mode and remembers
    /// `exchange`. Declares nothing: the worker owns its topology.
    pub async fn connect(amqp_url: &str, exchange: &str) -> Result<Publisher, PublishError> {
        let connection = Connection::connect(amqp_url, ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Publisher {
            connection,
            channel,
            exchange: exchange.to_owned(),
        })
    }

    /// The exchange this publisher sends to.
    pub fn exchange(&self) -> &str {
        &self.exchange
    }

    /// Declares the exchange as a durable topic exchange without arguments
    /// (idempotent). For tests and the demo; the worker normally owns it.
    pub async fn declare_exchange(&self) -> Result<(), PublishError> {
        topology::declare_topic_exchange(&self.channel, &self.exchange).await?;
        Ok(())
    }

    /// Whether the exchange exists (passive declare on a throw-away channel, so a
    /// missing exchange does not close the publishing channel).
    pub async fn exchange_exists(&self) -> Result<bool, PublishError> {
        let probe = self.connection.create_channel().await?;
        let exists = topology::exchange_exists(&probe, &self.exchange).await?;
        if exists {
            probe.close(200, "OK".into()).await?;
        }
        Ok(exists)
    }

    /// Publishes `intent` (body `intent.to_json()`, routing key = tenant, persistent,
    /// `message_id` = `<tenant>:<action_id>`) and waits for the broker's confirm.
    pub async fn publish(&self, intent: &protocol::Intent) -> Result<(), PublishError> {
        self.publish_encoded(&intent.tenant, &intent.action_id, &intent.to_json())
            .await
    }

    /// Publishes an already-encoded intent body under the key `(tenant, action_id)`
    /// with the same properties as [`Publisher::publish`]. The caller is responsible
    /// for the body matching the key (the worker rejects a mismatch); this exists to
    /// send an intent whose JSON field order differs from `Intent::to_json`.
    pub async fn publish_encoded(
        &self,
        tenant: &str,
        action_id: &str,
        body: &[u8],
    ) -> Result<(), PublishError> {
        let properties = BasicProperties::default()
            .with_content_type(JSON.into())
            .with_delivery_mode(PERSISTENT)
            .with_message_id(action_key(tenant, action_id).into());
        self.send(tenant, body, properties).await
    }

    /// Publishes an arbitrary body (mandatory, persistent, with confirm) and no
    /// message id. Used by tests to send malformed messages.
    pub async fn publish_raw(
        &self,
        routing_key: &str,
        body: &[u8],
        content_type: Option<&str>,
    ) -> Result<(), PublishError> {
        let mut properties = BasicProperties::default().with_delivery_mode(PERSISTENT);
        if let Some(content_type) = content_type {
            properties = properties.with_content_type(content_type.into());
        }
        self.send(routing_key, body, properties).await
    }

    /// Closes the channel and the connection gracefully.
    pub async fn close(self) -> Result<(), PublishError> {
        self.channel.close(200, "OK".into()).await?;
        self.connection.close(200, "OK".into()).await?;
        Ok(())
    }

    async fn send(
        &self,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        let confirmation = self
            .channel
            .basic_publish(
                self.exchange.as_str().into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                body,
                properties,
            )
            .await?
            .await?;
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) => Err(PublishError::Unroutable {
                exchange: self.exchange.clone(),
                routing_key: routing_key.to_owned(),
                reply_text: returned.reply_text.to_string(),
            }),
            Confirmation::Nack(_) => Err(PublishError::Nacked),
            Confirmation::NotRequested => Err(PublishError::NotConfirmed),
        }
    }
}
