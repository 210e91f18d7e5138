//! The broker topology the worker owns: the durable topic exchange `intents`, the quorum queue
//! `intents` (with `x-delivery-limit` and a dead-letter exchange), the dead-letter exchange and
//! queue, and the durable topic exchange `results`. Declarations are idempotent, so every
//! worker declares them at start-up.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, ExchangeKind};

use super::AmqpError;
use crate::config::Topology;

fn durable_exchange() -> ExchangeDeclareOptions {
    ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

fn durable_queue() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

/// The intents queue's arguments.
pub fn intents_queue_arguments(t: &Topology) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    args.insert(
        "x-delivery-limit".into(),
        AMQPValue::LongInt(t.delivery_limit as i32),
    );
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(LongString::from(t.dead_letter_exchange.as_str())),
    );
    args
}

fn explain(what: String, hint: &str) -> impl FnOnce(lapin::Error) -> AmqpError + '_ {
    move |e| {
        let text = e.to_string();
        if text.contains("PRECONDITION_FAILED") || text.contains("inequivalent") {
            AmqpError::Topology(format!(
                "{what} already exists with different settings ({text}); {hint}"
            ))
        } else {
            AmqpError::Broker { what, source: e }
        }
    }
}

/// Declares everything. A queue or exchange that exists with other arguments is reported with
/// its name and what to do, instead of a bare channel error.
pub async fn declare(channel: &Channel, t: &Topology) -> Result<(), AmqpError> {
    let hint = "delete it, or point the worker at other names with the WORKER_* topology variables";
    for (name, what) in [
        (&t.intents_exchange, "intents exchange"),
        (&t.results_exchange, "results exchange"),
        (&t.dead_letter_exchange, "dead-letter exchange"),
    ] {
        channel
            .exchange_declare(
                name.as_str().into(),
                ExchangeKind::Topic,
                durable_exchange(),
                FieldTable::default(),
            )
            .await
            .map_err(explain(format!("{what} {name:?}"), hint))?;
    }
    let mut dlq_args = FieldTable::default();
    dlq_args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    channel
        .queue_declare(
            t.dead_letter_queue.as_str().into(),
            durable_queue(),
            dlq_args,
        )
        .await
        .map_err(explain(
            format!("dead-letter queue {:?}", t.dead_letter_queue),
            hint,
        ))?;
    channel
        .queue_bind(
            t.dead_letter_queue.as_str().into(),
            t.dead_letter_exchange.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(AmqpError::broker("binding the dead-letter queue"))?;
    channel
        .queue_declare(
            t.intents_queue.as_str().into(),
            durable_queue(),
            intents_queue_arguments(t),
        )
        .await
        .map_err(explain(
            format!("intents queue {:?}", t.intents_queue),
            hint,
        ))?;
    channel
        .queue_bind(
            t.intents_queue.as_str().into(),
            t.intents_exchange.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(AmqpError::broker("binding the intents queue"))?;
    Ok(())
}
