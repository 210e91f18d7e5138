//! Publishing intents with publisher confirms.
//!
//! Every publish is `mandatory` and waits for its confirm, so `Ok(())` means the
//! broker routed the message to at least one queue and took responsibility for it.
//! The message id is the logical action key `<tenant>:<action_id>`, the same on every
//! send of the same action; the publisher never retries and never mints a new key. A key over
//! the 255 bytes of an AMQP short string is refused ([`PublishError::InvalidIntent`], code
//! `key_too_long`), as is any other short string built from input ([`PublishError::TooLong`]):
//! nothing here panics on a long name.
//!
//! Tenant proof: every message carries the AMQP `user_id` of the connection's user (taken
//! from the AMQP URL, `guest` when it names none). RabbitMQ refuses a `user_id` that is not
//! the connection's user, so a worker in `[auth] mode = "user_id"` can trust it.
//! [`Publisher::with_user_id`] turns this off (for a broker user whose name must not be sent).
//!
//! Compensation: [`Publisher::compensate`] publishes an intent that undoes a succeeded action
//! (its `compensates` set to the original's action id, checked with the worker's decoder first);
//! [`compensating`] builds such an intent for the other ways in (`send_and_wait`, the outbox).
//!
//! Trace context: every intent publish carries the `traceparent`/`tracestate` headers of the
//! context [`crate::trace`] chooses (the caller's through the `*_with` methods and
//! [`PublishOptions`], else with the feature `otel` the current one, else none) and, with
//! `otel`, runs in a `publish intents` producer span.

use std::collections::HashMap;

use lapin::{
    options::{BasicPublishOptions, ConfirmSelectOptions},
    types::ShortString,
    uri::AMQPUri,
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, PublisherConfirm,
};
use tracing::Instrument as _;

use crate::error::{short, PublishError};
use crate::topology;
pub use crate::trace::PublishOptions;
use crate::trace::{self, Names};

/// Content type of every intent.
pub const JSON: &str = "application/json";

/// AMQP `delivery_mode` for persistent messages.
const PERSISTENT: u8 = 2;

/// The logical action key `<tenant>:<action_id>`, used as the AMQP `message_id` (one home:
/// the wire contract's own function; [`protocol::check_action_key`] bounds it).
pub use protocol::action_key;

/// `intent` as the compensation of `original_action_id`: the action (same tenant) whose
/// `succeeded` effect it undoes, set as its `compensates` (replacing any). For every way in:
/// [`Publisher::send_and_wait`], [`crate::Outbox::enqueue`], [`Publisher::publish_with`].
///
/// The intent keeps its own `action_id`, chosen by the application like any other and the same
/// on every retry of this compensation. `compensates` is part of the fingerprint, so the key
/// sent again naming another original is an `intent_conflict`. The worker admits it only while
/// the original is `succeeded` and the intent's tool lists the original's tool in its
/// `compensation_for`; otherwise it is `rejected` with `original_unresolved` (`detail`: the
/// original's state), `original_not_applied`, `original_not_found`, `already_compensated`
/// (`detail`: the live compensation's action id) or `compensation_not_allowed`. Every event about
/// it carries `compensates`; when it succeeds, the original's `reply_to` also gets a `succeeded`
/// event about the original with `compensated_by` (the original keeps its state and receipt).
///
/// ```
/// let refund = protocol::Intent {
///     tenant: "north-shop".into(),
///     action_id: "cancel-refund-731".into(),
///     tool: "cancel_refund".into(),
///     arguments: serde_json::json!({"order": "order-731"}),
///     call_id: None,
///     reply_to: None,
///     compensates: None,
/// };
/// let undo = publisher::compensating(refund, "refund-order-731");
/// assert_eq!(undo.compensates.as_deref(), Some("refund-order-731"));
/// assert_ne!(undo.fingerprint(), protocol::fingerprint(&undo.tool, &undo.arguments));
/// ```
pub fn compensating(
    mut intent: protocol::Intent,
    original_action_id: impl Into<String>,
) -> protocol::Intent {
    intent.compensates = Some(original_action_id.into());
    intent
}

/// The broker user an AMQP URL connects as (`guest`, the AMQP default, when it names none).
pub fn url_user(amqp_url: &str) -> Result<String, PublishError> {
    let uri: AMQPUri = amqp_url
        .parse()
        .map_err(|error: String| PublishError::BadUrl(error))?;
    Ok(uri.authority.userinfo.username)
}

/// One already-encoded intent of a [`Publisher::publish_batch`].
#[derive(Debug, Clone, Copy)]
pub struct Encoded<'a> {
    pub tenant: &'a str,
    pub action_id: &'a str,
    pub body: &'a [u8],
}

/// One intent of a [`Publisher::publish_batch_with`]: an encoded intent and what to send with
/// it (each intent of a batch may continue another trace, as outbox rows do).
#[derive(Debug, Clone)]
pub struct Traced<'a> {
    pub intent: Encoded<'a>,
    /// The intent's tool, named on its publish span (`None`: not named).
    pub tool: Option<&'a str>,
    pub options: PublishOptions,
}

impl<'a> From<Encoded<'a>> for Traced<'a> {
    /// The default options: the current context (feature `otel`).
    fn from(intent: Encoded<'a>) -> Traced<'a> {
        Traced {
            intent,
            tool: None,
            options: PublishOptions::default(),
        }
    }
}

/// A connection and a confirm-mode channel bound to one exchange.
pub struct Publisher {
    pub(crate) connection: Connection,
    channel: Channel,
    exchange: String,
    /// `exchange` as the short string every publish names (checked once, at connect).
    exchange_name: ShortString,
    /// The connection's user, sent as AMQP `user_id`; `None` when turned off.
    user_id: Option<ShortString>,
    /// Settings of `send_and_wait` (wait.rs).
    pub(crate) answers: crate::wait::AnswerConfig,
    /// Held while a publish (or a batch) awaits its confirms, so returns are attributed right.
    in_flight: tokio::sync::Mutex<()>,
    /// `host:port` of the broker node this publisher is connected to.
    node: String,
}

impl Publisher {
    /// Connects to `amqp_url`, opens a channel in confirm mode and remembers
    /// `exchange`. Declares nothing: the worker owns its topology. Messages carry the
    /// connection's user as `user_id` (see [`Publisher::with_user_id`]).
    ///
    /// `amqp_url` may name several nodes of a cluster, comma-separated: they are tried in a
    /// random order and the first that accepts is used (the user of that URL is `user_id`).
    pub async fn connect(amqp_url: &str, exchange: &str) -> Result<Publisher, PublishError> {
        let exchange_name = short("exchange name", exchange)?;
        let (connection, url) =
            crate::tls::amqp_connect_any(amqp_url, ConnectionProperties::default()).await?;
        let user_id = short("AMQP user (sent as user_id)", &url_user(&url)?)?;
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Publisher {
            connection,
            channel,
            exchange: exchange.to_owned(),
            exchange_name,
            user_id: Some(user_id),
            answers: crate::wait::AnswerConfig::default(),
            in_flight: tokio::sync::Mutex::new(()),
            node: kit::url::host_port(&url),
        })
    }

    /// `host:port` of the broker node in use (one of a comma-separated `AMQP_URL`'s nodes).
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Whether messages carry the connection's user as AMQP `user_id` (on by default).
    /// Turn it off only when no worker checks tenant proof: a worker in
    /// `[auth] mode = "user_id"` dead-letters intents without it as `tenant_mismatch`.
    pub fn with_user_id(mut self, on: bool) -> Publisher {
        if !on {
            self.user_id = None;
        }
        self
    }

    /// Whether the connection and the publishing channel are still open.
    pub fn is_connected(&self) -> bool {
        self.connection.status().connected() && self.channel.status().connected()
    }

    /// The `user_id` sent with every message, if any.
    pub fn user_id(&self) -> Option<&str> {
        self.user_id.as_ref().map(ShortString::as_str)
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
    /// `message_id` = `<tenant>:<action_id>`) and waits for the broker's confirm. A key over
    /// 255 bytes is [`PublishError::InvalidIntent`] (`key_too_long`), and nothing is sent. The
    /// trace context is the current one (feature `otel`); [`Publisher::publish_with`] passes
    /// another.
    pub async fn publish(&self, intent: &protocol::Intent) -> Result<(), PublishError> {
        self.publish_with(intent, &PublishOptions::default()).await
    }

    /// [`Publisher::publish`] with `options`: the trace context to send (the caller's, e.g. the
    /// one an incoming request carried), see [`PublishOptions`].
    pub async fn publish_with(
        &self,
        intent: &protocol::Intent,
        options: &PublishOptions,
    ) -> Result<(), PublishError> {
        self.publish_one(
            &intent.tenant,
            &intent.action_id,
            Some(&intent.tool),
            &intent.to_json(),
            options,
        )
        .await
    }

    /// Publishes `intent` as the compensation of the succeeded action `original_action_id` of
    /// the same tenant ([`compensating`], which describes what the worker answers), like
    /// [`Publisher::publish`]. The intent, `compensates` included, is checked with the worker's
    /// decoder first: one it would refuse is [`PublishError::InvalidIntent`] and nothing is sent.
    /// To wait for the answer, or to go through the outbox, pass [`compensating`]`(intent,
    /// original)` to [`Publisher::send_and_wait`] or [`crate::Outbox::enqueue`].
    pub async fn compensate(
        &self,
        original_action_id: &str,
        intent: &protocol::Intent,
    ) -> Result<(), PublishError> {
        let intent = compensating(intent.clone(), original_action_id);
        let body = intent.to_json();
        protocol::decode_intent(&body)?;
        self.publish_one(
            &intent.tenant,
            &intent.action_id,
            Some(&intent.tool),
            &body,
            &PublishOptions::default(),
        )
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
        self.publish_encoded_with(tenant, action_id, body, &PublishOptions::default())
            .await
    }

    /// [`Publisher::publish_encoded`] with `options` (the trace context to send).
    pub async fn publish_encoded_with(
        &self,
        tenant: &str,
        action_id: &str,
        body: &[u8],
        options: &PublishOptions,
    ) -> Result<(), PublishError> {
        self.publish_one(tenant, action_id, None, body, options)
            .await
    }

    /// One intent: its properties, its span and trace headers, the publish and its confirm.
    async fn publish_one(
        &self,
        tenant: &str,
        action_id: &str,
        tool: Option<&str>,
        body: &[u8],
        options: &PublishOptions,
    ) -> Result<(), PublishError> {
        let (properties, message_id) = self.intent_properties(tenant, action_id)?;
        let out = trace::outgoing(&self.names(tenant, action_id, &message_id, tool), options);
        let properties = with_headers(properties, out.headers);
        let sent = self
            .send(tenant, body, properties)
            .instrument(out.span.clone())
            .await;
        if let Err(error) = &sent {
            trace::failed(&out.span, error);
        }
        sent
    }

    fn names<'a>(
        &'a self,
        tenant: &'a str,
        action_id: &'a str,
        message_id: &'a str,
        tool: Option<&'a str>,
    ) -> Names<'a> {
        Names {
            exchange: &self.exchange,
            tenant,
            action_id,
            message_id,
            tool,
        }
    }

    /// Publishes every intent of `batch` (same properties as [`Publisher::publish_encoded`])
    /// and only then awaits the confirms, so the broker confirms the batch as a pipeline
    /// rather than one round trip per message. Returns one result per intent, in order; a
    /// channel error fails the intents not yet sent or confirmed. An intent whose key does not
    /// fit a message id fails alone ([`PublishError::InvalidIntent`]) and is never sent. Each
    /// intent carries the current trace context (feature `otel`).
    pub async fn publish_batch(&self, batch: &[Encoded<'_>]) -> Vec<Result<(), PublishError>> {
        let batch: Vec<Traced<'_>> = batch.iter().map(|e| Traced::from(*e)).collect();
        self.publish_batch_with(&batch).await
    }

    /// [`Publisher::publish_batch`] with options per intent: each its own trace context and
    /// publish span (outbox rows were enqueued in different traces).
    pub async fn publish_batch_with(&self, batch: &[Traced<'_>]) -> Vec<Result<(), PublishError>> {
        let _one_at_a_time = self.in_flight.lock().await;
        let mut pending = Vec::with_capacity(batch.len());
        // Each intent's span lives until its confirm is known (a failure is recorded on it).
        let mut spans = Vec::with_capacity(batch.len());
        for traced in batch {
            let intent = &traced.intent;
            let (properties, message_id) =
                match self.intent_properties(intent.tenant, intent.action_id) {
                    Ok(properties) => properties,
                    Err(error) => {
                        pending.push(Err(error));
                        spans.push(tracing::Span::none());
                        continue;
                    }
                };
            let names = self.names(intent.tenant, intent.action_id, &message_id, traced.tool);
            let out = trace::outgoing(&names, &traced.options);
            let properties = with_headers(properties, out.headers);
            pending.push(
                self.start(intent.tenant, intent.body, properties)
                    .instrument(out.span.clone())
                    .await,
            );
            spans.push(out.span);
        }
        let mut confirmations = Vec::with_capacity(batch.len());
        for started in pending {
            confirmations.push(match started {
                Ok(confirm) => confirm.await.map_err(PublishError::confirm_lost),
                Err(error) => Err(error),
            });
        }
        // lapin hands each basic.return to whichever confirm it completes next, and completes a
        // multiple-ack's confirms in no particular order, so a return may sit on another
        // message's confirm. Attribute returns by the message's own key instead: messages with
        // the same key have the same routing key, so they are routable or not alike.
        let mut returned: HashMap<String, Vec<String>> = HashMap::new();
        for confirmation in confirmations.iter_mut().flatten() {
            let taken = match confirmation {
                Confirmation::Ack(message) | Confirmation::Nack(message) => message.take(),
                Confirmation::NotRequested => None,
            };
            if let Some(message) = taken {
                let key = message
                    .delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|id| id.to_string())
                    .unwrap_or_default();
                returned
                    .entry(key)
                    .or_default()
                    .push(message.reply_text.to_string());
            }
        }
        batch
            .iter()
            .zip(confirmations)
            .zip(spans)
            .map(|((traced, confirmation), span)| {
                let intent = &traced.intent;
                let result = confirmation.and_then(|confirmation| match confirmation {
                    Confirmation::Ack(_) => {
                        let key = action_key(intent.tenant, intent.action_id);
                        match returned.get_mut(&key).and_then(Vec::pop) {
                            Some(reply_text) => Err(PublishError::Unroutable {
                                exchange: self.exchange.clone(),
                                routing_key: intent.tenant.to_owned(),
                                reply_text,
                            }),
                            None => Ok(()),
                        }
                    }
                    Confirmation::Nack(_) => Err(PublishError::Nacked),
                    Confirmation::NotRequested => Err(PublishError::NotConfirmed),
                });
                if let Err(error) = &result {
                    trace::failed(&span, error);
                }
                result
            })
            .collect()
    }

    /// The properties of an intent message, and its message id (the action key).
    fn intent_properties(
        &self,
        tenant: &str,
        action_id: &str,
    ) -> Result<(BasicProperties, String), PublishError> {
        protocol::check_action_key(tenant, action_id)?;
        let message_id = action_key(tenant, action_id);
        let properties = BasicProperties::default()
            .with_content_type(JSON.into())
            .with_delivery_mode(PERSISTENT)
            .with_message_id(short("message id", &message_id)?);
        let properties = match &self.user_id {
            Some(user) => properties.with_user_id(user.clone()),
            None => properties,
        };
        Ok((properties, message_id))
    }

    /// Publishes an arbitrary body (mandatory, persistent, with confirm) and no
    /// message id, and no trace context: exactly what it is given. Used by tests to send
    /// malformed messages.
    pub async fn publish_raw(
        &self,
        routing_key: &str,
        body: &[u8],
        content_type: Option<&str>,
    ) -> Result<(), PublishError> {
        let mut properties = BasicProperties::default().with_delivery_mode(PERSISTENT);
        if let Some(content_type) = content_type {
            properties = properties.with_content_type(short("content type", content_type)?);
        }
        self.send(routing_key, body, properties).await
    }

    /// Closes the channel and the connection gracefully, within
    /// [`CLOSE_WAIT`](crate::tls::CLOSE_WAIT); after that the connection is dropped
    /// ([`PublishError::CloseTimedOut`]).
    pub async fn close(self) -> Result<(), PublishError> {
        crate::tls::close_within(async { Ok(()) }, &self.channel, &self.connection).await
    }

    async fn send(
        &self,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        // One publish in flight per channel: lapin attaches a basic.return to the next confirm
        // it completes, which is this publish's only while nothing else is in flight.
        let _one_at_a_time = self.in_flight.lock().await;
        let confirm = self.start(routing_key, body, properties).await?;
        self.confirmed(routing_key, confirm).await
    }

    /// Sends one mandatory publish; the confirm is awaited separately.
    async fn start(
        &self,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<PublisherConfirm, PublishError> {
        Ok(self
            .channel
            .basic_publish(
                self.exchange_name.clone(),
                short("routing key", routing_key)?,
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                body,
                properties,
            )
            .await?)
    }

    /// Awaits a publish's confirm and maps it: routed and acked is the only success.
    async fn confirmed(
        &self,
        routing_key: &str,
        confirm: PublisherConfirm,
    ) -> Result<(), PublishError> {
        match confirm.await.map_err(PublishError::confirm_lost)? {
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

/// `properties` with the trace headers, when there are any.
fn with_headers(
    properties: BasicProperties,
    headers: Option<lapin::types::FieldTable>,
) -> BasicProperties {
    match headers {
        Some(headers) => properties.with_headers(headers),
        None => properties,
    }
}
