//! The few broker declarations the publisher side makes.
//!
//! The worker owns its topology (the intents exchange, the quorum intents queue, its
//! dead-letter exchange). The publisher side only declares:
//! - the results exchange, with exactly the arguments the worker uses (durable topic,
//!   no extra arguments) so either side may declare it first;
//! - its own results queue, bound to the tenant's keys (`<tenant>`, `<tenant>.@.#`) or to one
//!   agent's key (`<tenant>.@.<reply_to>`);
//! - for tests and the demo, the intents exchange itself (same arguments).
//!
//! Names and binding keys are AMQP short strings: one over 255 bytes is
//! [`PublishError::TooLong`], never a panic.

use lapin::{
    options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions},
    protocol::{AMQPErrorKind, AMQPSoftError},
    types::FieldTable,
    Channel, ErrorKind, ExchangeKind,
};

use crate::error::{short, PublishError};

/// Declares `name` as a durable topic exchange with no arguments (idempotent).
pub async fn declare_topic_exchange(channel: &Channel, name: &str) -> Result<(), PublishError> {
    channel
        .exchange_declare(
            short("exchange name", name)?,
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok(())
}

/// Declares the results exchange only when it is missing: a passive check on a throw-away
/// channel first, so an agent user without `configure` permission on it (a broker managed as
/// code, `deploy/rabbitmq/definitions.json`) can still follow its results.
pub async fn ensure_topic_exchange(
    connection: &lapin::Connection,
    name: &str,
) -> Result<(), PublishError> {
    let probe = connection.create_channel().await?;
    let exists = exchange_exists(&probe, name).await?;
    if probe.status().connected() {
        let _ = probe.close(200, "checked".into()).await;
    }
    if exists {
        return Ok(());
    }
    let channel = connection.create_channel().await?;
    declare_topic_exchange(&channel, name).await?;
    let _ = channel.close(200, "declared".into()).await;
    Ok(())
}

/// Checks that exchange `name` exists without creating it (passive declare).
///
/// A missing exchange makes the broker close the channel, so pass a channel that may
/// be thrown away. Returns `Ok(false)` on NOT_FOUND.
pub async fn exchange_exists(channel: &Channel, name: &str) -> Result<bool, PublishError> {
    let name = short("exchange name", name)?;
    let passive = ExchangeDeclareOptions {
        passive: true,
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    match channel
        .exchange_declare(name, ExchangeKind::Topic, passive, FieldTable::default())
        .await
    {
        Ok(()) => Ok(true),
        Err(error) if is_not_found(&error) => Ok(false),
        Err(error) => Err(error.into()),
    }
}

/// Whether a broker error is a 404 NOT_FOUND channel error.
pub fn is_not_found(error: &lapin::Error) -> bool {
    matches!(
        error.kind(),
        ErrorKind::ProtocolError(amqp) if *amqp.kind() == AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)
    )
}

/// Declares a results queue and binds it to `exchange` with each of `binding_keys`.
/// Returns the queue name (server-generated when `queue` is `None`).
///
/// - `Some(name)`: durable, non-exclusive, not auto-deleted: results wait there while
///   no follower runs, and several followers may share it.
/// - `None`: a server-named exclusive auto-delete queue, gone with the connection.
///
/// A tenant-wide follower binds `protocol::tenant_binding_keys(tenant)` (`<tenant>` and
/// `<tenant>.@.#`); one agent binds only `<tenant>.@.<its reply_to>`.
pub async fn declare_results_queue(
    channel: &Channel,
    exchange: &str,
    binding_keys: &[String],
    queue: Option<&str>,
) -> Result<String, PublishError> {
    // Every name is checked before anything is declared.
    let exchange = short("exchange name", exchange)?;
    let keys = binding_keys
        .iter()
        .map(|key| short("binding key", key))
        .collect::<Result<Vec<_>, _>>()?;
    let (name, options) = match queue {
        Some(name) => (
            name,
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
        ),
        None => (
            "",
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..QueueDeclareOptions::default()
            },
        ),
    };
    let declared = channel
        .queue_declare(short("queue name", name)?, options, FieldTable::default())
        .await?;
    let name = declared.name().clone();
    for key in keys {
        channel
            .queue_bind(
                name.clone(),
                exchange.clone(),
                key,
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    Ok(name.as_str().to_owned())
}
