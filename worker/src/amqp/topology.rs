//! The broker topology the worker owns: the durable topic exchange `intents`, the quorum queue
//! `intents` (with `x-delivery-limit` and a dead-letter exchange), the dead-letter exchange and
//! queue, and the durable topic exchange `results`. Declarations are idempotent, so every
//! worker declares them at start-up; an object that already exists with other arguments is
//! used as it is, with a warning. With `WORKER_DECLARE_TOPOLOGY=false` (broker managed as code,
//! e.g. `deploy/rabbitmq/definitions.json`) [`check`] only verifies, passively, that the objects
//! the worker uses exist.
//!
//! **Shards** (`WORKER_INTENT_SHARDS=N`, [`Shards`]): one quorum queue has one leader, which
//! bounds the whole pool. With N > 1 the intents exchange is bound to a consistent-hash exchange
//! `<queue>.hash` (RabbitMQ's `rabbitmq_consistent_hash_exchange` plugin) hashing on the message
//! id, so every copy of one action key lands in the same shard, and that exchange to N quorum
//! queues `<queue>.0 … <queue>.N-1`, their leaders spread over the nodes. `balanced` alone does
//! not spread them: it puts a new queue's leader on the node that leads the fewest quorum
//! queues overall, so after a node restart (the returning node leads none) every new shard
//! would land on that one node. So when `AMQP_URL` names several nodes ([`Nodes`]), a shard that
//! does not exist yet is declared through a connection to node `i mod k` of the list with
//! `x-queue-leader-locator: client-local`; with one URL (a load balancer), or when that node
//! cannot be reached, it is declared `balanced`. Existing shards are only checked, passively:
//! their leaders stay where they are. Publishers are unchanged: topic exchange, routing key =
//! tenant. While the shard count changes, the queues of the old layout (`WORKER_DRAIN_SHARDS`)
//! are unbound, so they take no new intents, and consumed until empty.

use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, ExchangeKind};

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

/// How intents are spread over quorum queues: `count` shards now, and the old layout's shard
/// count while a change is drained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shards {
    pub count: u16,
    pub draining: Option<u16>,
}

impl Default for Shards {
    fn default() -> Self {
        Shards {
            count: 1,
            draining: None,
        }
    }
}

/// The intents queues of a layout of `n` shards: the queue itself for one, `<queue>.<i>` for
/// more.
pub fn shard_queues(t: &Topology, n: u16) -> Vec<String> {
    if n <= 1 {
        vec![t.intents_queue.clone()]
    } else {
        (0..n).map(|i| format!("{}.{i}", t.intents_queue)).collect()
    }
}

/// The consistent-hash exchange between the intents exchange and the shards.
pub fn hash_exchange(t: &Topology) -> String {
    format!("{}.hash", t.intents_queue)
}

/// Every queue the consumer reads: the shards, then the old layout's queues being drained.
pub fn consumed_queues(t: &Topology, s: Shards) -> Vec<String> {
    let mut queues = shard_queues(t, s.count);
    if let Some(old) = s.draining {
        for q in shard_queues(t, old) {
            if !queues.contains(&q) {
                queues.push(q);
            }
        }
    }
    queues
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
        AMQPValue::LongInt(t.queue_delivery_limit as i32),
    );
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(LongString::from(t.dead_letter_exchange.as_str())),
    );
    args
}

/// Most messages the dead-letter queue keeps, as the `intents-dead` policy of
/// deploy/rabbitmq/definitions.json says.
pub const DEAD_LETTER_MAX_LENGTH: i64 = 100_000;
/// How long a dead letter is kept (14 days, in milliseconds), as that policy says.
pub const DEAD_LETTER_TTL_MS: i64 = 14 * 24 * 3600 * 1000;
/// When the dead-letter queue is full, a new dead letter is refused (not the oldest dropped):
/// the worker then counts it (`intent_worker_dead_letter_refused_total`) and logs its key.
pub const DEAD_LETTER_OVERFLOW: &str = "reject-publish";

/// The dead-letter queue's delivery limit: so high that reading the queue (every read returns
/// the letters it does not act on, and a quorum queue counts each return) never drops a letter.
/// RabbitMQ 4 gives a quorum queue without one a limit of 20; `-1`, which 4 reads as "none",
/// makes RabbitMQ 3 drop a letter on its first return, so a large positive limit it is, valid on
/// both.
pub const DEAD_LETTER_DELIVERY_LIMIT: i32 = 1_000_000_000;

/// The dead-letter queue's arguments when the worker declares it: bounded in length and age
/// like the queue the broker definitions declare, so a flood of bad messages cannot fill the
/// broker's disk, and with a delivery limit no reading reaches
/// ([`DEAD_LETTER_DELIVERY_LIMIT`]). A queue that exists with other arguments (declared before,
/// or by definitions) is used as it is: its `intents-dead` policy should carry the limit.
pub fn dead_letter_queue_arguments() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    args.insert(
        "x-max-length".into(),
        AMQPValue::LongLongInt(DEAD_LETTER_MAX_LENGTH),
    );
    args.insert(
        "x-message-ttl".into(),
        AMQPValue::LongLongInt(DEAD_LETTER_TTL_MS),
    );
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString(LongString::from(DEAD_LETTER_OVERFLOW)),
    );
    args.insert(
        "x-delivery-limit".into(),
        AMQPValue::LongInt(DEAD_LETTER_DELIVERY_LIMIT),
    );
    args
}

fn is_precondition_failed(e: &lapin::Error) -> bool {
    let text = e.to_string();
    text.contains("PRECONDITION_FAILED") || text.contains("inequivalent")
}

/// Declares an exchange; one that already exists with other settings is used as it is, with a
/// warning (the failed declaration closes the channel, so the check runs on a fresh one).
async fn exchange(
    connection: &Connection,
    channel: &mut Channel,
    name: &str,
    what: &str,
) -> Result<(), AmqpError> {
    let declared = channel
        .exchange_declare(
            name.into(),
            ExchangeKind::Topic,
            durable_exchange(),
            FieldTable::default(),
        )
        .await;
    match declared {
        Ok(()) => Ok(()),
        Err(e) if is_precondition_failed(&e) => {
            *channel = connection
                .create_channel()
                .await
                .map_err(AmqpError::broker("reopening a channel"))?;
            check_exchange(channel, name)
                .await
                .map_err(AmqpError::broker(format!("checking {what} {name:?}")))?;
            tracing::warn!(exchange = name, error = %e, "{what} exists with other settings; using it as it is");
            Ok(())
        }
        Err(e) => Err(AmqpError::Broker {
            what: format!("declaring {what} {name:?}"),
            error: e,
        }),
    }
}

/// Declares a queue; one that already exists with other arguments (e.g. created by an operator
/// without our delivery limit) is used as it is, with a warning: the worker's own poison guard
/// does not depend on the queue's arguments.
async fn queue(
    connection: &Connection,
    channel: &mut Channel,
    name: &str,
    args: FieldTable,
    what: &str,
) -> Result<(), AmqpError> {
    match channel
        .queue_declare(name.into(), durable_queue(), args)
        .await
    {
        Ok(_) => Ok(()),
        Err(e) if is_precondition_failed(&e) => {
            *channel = connection
                .create_channel()
                .await
                .map_err(AmqpError::broker("reopening a channel"))?;
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            channel
                .queue_declare(name.into(), passive, FieldTable::default())
                .await
                .map_err(AmqpError::broker(format!("checking {what} {name:?}")))?;
            tracing::warn!(queue = name, error = %e, "{what} exists with other arguments; using it as it is");
            Ok(())
        }
        Err(e) => Err(AmqpError::Broker {
            what: format!("declaring {what} {name:?}"),
            error: e,
        }),
    }
}

async fn bind(channel: &Channel, queue: &str, exchange: &str) -> Result<(), AmqpError> {
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(AmqpError::broker(format!(
            "binding queue {queue:?} to {exchange:?}"
        )))
}

/// The broker's nodes, for placing new shards' leaders one per node ([`declare_placed`]).
#[derive(Clone)]
pub struct Nodes {
    /// One URL per node, in `AMQP_URL`'s order.
    pub urls: Vec<String>,
    /// The connections' name (shown in the management UI).
    pub name: String,
    pub heartbeat_secs: u16,
    pub trust: crate::tls::Trust,
}

/// Declares everything (idempotent; every worker does it at start-up); new shards declared
/// `balanced` through `connection`.
pub async fn declare(connection: &Connection, t: &Topology, s: Shards) -> Result<(), AmqpError> {
    declare_placed(connection, t, s, None).await
}

/// [`declare`], new shards placed one per node of `nodes` when it names more than one.
pub async fn declare_placed(
    connection: &Connection,
    t: &Topology,
    s: Shards,
    nodes: Option<&Nodes>,
) -> Result<(), AmqpError> {
    let mut channel = connection
        .create_channel()
        .await
        .map_err(AmqpError::broker("opening a channel"))?;
    exchange(
        connection,
        &mut channel,
        &t.intents_exchange,
        "intents exchange",
    )
    .await?;
    exchange(
        connection,
        &mut channel,
        &t.results_exchange,
        "results exchange",
    )
    .await?;
    exchange(
        connection,
        &mut channel,
        &t.dead_letter_exchange,
        "dead-letter exchange",
    )
    .await?;
    queue(
        connection,
        &mut channel,
        &t.dead_letter_queue,
        dead_letter_queue_arguments(),
        "dead-letter queue",
    )
    .await?;
    bind(&channel, &t.dead_letter_queue, &t.dead_letter_exchange).await?;
    if s.count <= 1 {
        queue(
            connection,
            &mut channel,
            &t.intents_queue,
            intents_queue_arguments(t),
            "intents queue",
        )
        .await?;
        bind(&channel, &t.intents_queue, &t.intents_exchange).await?;
    } else {
        declare_shards(connection, &mut channel, t, s.count, nodes).await?;
    }
    if let Some(old) = s.draining.filter(|old| *old != s.count) {
        unbind_old_layout(connection, t, s.count, old).await?;
    }
    let _ = channel.close(200, "topology declared".into()).await;
    Ok(())
}

/// The hash exchange, its binding from the intents exchange and `n` shard queues bound to it.
async fn declare_shards(
    connection: &Connection,
    channel: &mut Channel,
    t: &Topology,
    n: u16,
    nodes: Option<&Nodes>,
) -> Result<(), AmqpError> {
    let hash = hash_exchange(t);
    let mut args = FieldTable::default();
    args.insert(
        "hash-property".into(),
        AMQPValue::LongString(LongString::from("message_id")),
    );
    channel
        .exchange_declare(
            hash.as_str().into(),
            ExchangeKind::Custom("x-consistent-hash".into()),
            durable_exchange(),
            args,
        )
        .await
        .map_err(|e| AmqpError::Broker {
            what: format!(
                "declaring the shards' consistent-hash exchange {hash:?} (WORKER_INTENT_SHARDS > 1 \
                 needs the rabbitmq_consistent_hash_exchange plugin)"
            ),
            error: e,
        })?;
    channel
        .exchange_bind(
            hash.as_str().into(),
            t.intents_exchange.as_str().into(),
            "#".into(),
            ExchangeBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(AmqpError::broker(format!(
            "binding {hash:?} to {:?}",
            t.intents_exchange
        )))?;
    let nodes = nodes.filter(|nodes| nodes.urls.len() > 1);
    for (i, name) in shard_queues(t, n).into_iter().enumerate() {
        let placed = match nodes {
            Some(nodes) => match queue_exists(connection, &name).await? {
                true => true,
                false => declare_on_node(nodes, i, &name, t).await,
            },
            None => false,
        };
        if !placed {
            queue(
                connection,
                channel,
                &name,
                shard_arguments(t, "balanced"),
                "intents shard",
            )
            .await?;
        }
        channel
            .queue_bind(
                name.as_str().into(),
                hash.as_str().into(),
                // The binding key of a consistent-hash exchange is the shard's weight.
                "1".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(AmqpError::broker(format!(
                "binding shard {name:?} to {hash:?}"
            )))?;
    }
    Ok(())
}

/// A shard queue's arguments: the intents queue's, and where its leader goes.
fn shard_arguments(t: &Topology, leader_locator: &str) -> FieldTable {
    let mut args = intents_queue_arguments(t);
    args.insert(
        "x-queue-leader-locator".into(),
        AMQPValue::LongString(LongString::from(leader_locator)),
    );
    args
}

/// Passively declares queue `name` on a channel of its own (a failed passive declaration closes
/// its channel): Err when no channel opens, else the declaration's result.
async fn declare_passively(
    connection: &Connection,
    name: &str,
) -> Result<Result<(), lapin::Error>, AmqpError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(AmqpError::broker("opening a channel"))?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let declared = channel
        .queue_declare(name.into(), passive, FieldTable::default())
        .await
        .map(|_| ());
    if declared.is_ok() {
        let _ = channel.close(200, "checked".into()).await;
    }
    Ok(declared)
}

/// Whether queue `name` exists.
async fn queue_exists(connection: &Connection, name: &str) -> Result<bool, AmqpError> {
    match declare_passively(connection, name).await? {
        Ok(()) => Ok(true),
        Err(e) if e.to_string().contains("NOT_FOUND") => Ok(false),
        Err(e) => Err(AmqpError::Broker {
            what: format!("checking intents shard {name:?}"),
            error: e,
        }),
    }
}

/// Declares shard `i` (`name`) through a connection of its own to node `i mod k` of `nodes`,
/// its leader on that node (`client-local`). False when that node cannot be reached or refuses
/// the declaration: the caller declares it `balanced` instead.
async fn declare_on_node(nodes: &Nodes, i: usize, name: &str, t: &Topology) -> bool {
    let url = &nodes.urls[i % nodes.urls.len()];
    let node = kit::url::host_port(url);
    let declared = async {
        let connection =
            super::connect_with_heartbeat(url, &nodes.name, nodes.heartbeat_secs, &nodes.trust)
                .await?;
        let result = async {
            let channel = connection
                .create_channel()
                .await
                .map_err(AmqpError::broker("opening a channel"))?;
            channel
                .queue_declare(
                    name.into(),
                    durable_queue(),
                    shard_arguments(t, "client-local"),
                )
                .await
                .map_err(AmqpError::broker(format!(
                    "declaring intents shard {name:?}"
                )))?;
            let _ = channel.close(200, "shard declared".into()).await;
            Ok::<_, AmqpError>(())
        }
        .await;
        let _ = connection.close(200, "shard declared".into()).await;
        result
    }
    .await;
    match declared {
        Ok(()) => {
            tracing::info!(queue = name, %node, "intents shard declared with its leader on this node");
            true
        }
        Err(e) => {
            tracing::warn!(queue = name, %node, error = %e, "intents shard not placed on its node; declaring it balanced");
            false
        }
    }
}

/// Unbinds the queues of the old layout of `old` shards that the layout of `n` does not use, so
/// they take no new intents while they are drained. A queue already gone is skipped.
async fn unbind_old_layout(
    connection: &Connection,
    t: &Topology,
    n: u16,
    old: u16,
) -> Result<(), AmqpError> {
    let current = shard_queues(t, n);
    let (exchange, key) = if old <= 1 {
        (t.intents_exchange.clone(), "#")
    } else {
        (hash_exchange(t), "1")
    };
    for name in shard_queues(t, old) {
        if current.contains(&name) {
            continue;
        }
        // On its own channel: unbinding from an exchange that is gone closes the channel.
        let channel = connection
            .create_channel()
            .await
            .map_err(AmqpError::broker("opening a channel"))?;
        match channel
            .queue_unbind(
                name.as_str().into(),
                exchange.as_str().into(),
                key.into(),
                FieldTable::default(),
            )
            .await
        {
            Ok(()) => {
                tracing::info!(queue = %name, "old intents queue unbound; draining it");
                let _ = channel.close(200, "unbound".into()).await;
            }
            Err(e) => {
                tracing::info!(queue = %name, error = %e, "old intents queue not unbound (gone already?)")
            }
        }
    }
    Ok(())
}

/// Passively checks that the exchanges and the queue the worker uses exist, declaring nothing
/// (`WORKER_DECLARE_TOPOLOGY=false`). A missing one is [`AmqpError::Missing`], naming it; each
/// check runs on its own channel because a failed passive declaration closes the channel.
pub async fn check(connection: &Connection, t: &Topology, s: Shards) -> Result<(), AmqpError> {
    // The queues first: they are what the worker consumes, the most telling names to report.
    for name in shard_queues(t, s.count) {
        declare_passively(connection, &name)
            .await?
            .map_err(|e| missing_or(e, "intents queue", &name))?;
    }
    let hash = hash_exchange(t);
    let mut exchanges = vec![
        (t.intents_exchange.as_str(), "intents exchange"),
        (t.results_exchange.as_str(), "results exchange"),
        (t.dead_letter_exchange.as_str(), "dead-letter exchange"),
    ];
    if s.count > 1 {
        exchanges.push((hash.as_str(), "shards' consistent-hash exchange"));
    }
    for (name, what) in exchanges {
        let channel = connection
            .create_channel()
            .await
            .map_err(AmqpError::broker("opening a channel"))?;
        check_exchange(&channel, name)
            .await
            .map_err(|e| missing_or(e, what, name))?;
        let _ = channel.close(200, "checked".into()).await;
    }
    Ok(())
}

/// A passive declare: succeeds only when the exchange exists (the broker closes the channel
/// otherwise).
async fn check_exchange(channel: &Channel, name: &str) -> Result<(), lapin::Error> {
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    channel
        .exchange_declare(
            name.into(),
            ExchangeKind::Topic,
            passive,
            FieldTable::default(),
        )
        .await
}

fn missing_or(e: lapin::Error, what: &'static str, name: &str) -> AmqpError {
    if e.to_string().contains("NOT_FOUND") {
        AmqpError::Missing {
            what,
            name: name.to_string(),
        }
    } else {
        AmqpError::Broker {
            what: format!("checking {what} {name:?}"),
            error: e,
        }
    }
}
