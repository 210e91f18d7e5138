//! The link supervisor: one loop, shared by the consumer and the relay, that keeps a broker
//! link alive. It connects (with back-off while the broker is unreachable), lets the link's
//! [`Session`] set itself up on the connection and run, marks the link up and down for
//! `/readyz`, and when the connection is lost closes it, counts the reconnect and starts over,
//! until the link's stop token is cancelled.
//!
//! A refused login or failed TLS handshake stops the process only before the link was ever up
//! and only for a session that says so (the consumer, at start-up: a wrong password or an
//! untrusted certificate should stop the process, not look like an unreachable broker
//! forever). Later (credentials revoked, certificate rotated while running) it is logged as
//! such and retried, so the worker keeps draining and recording what it holds meanwhile.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use lapin::Connection;
use metrics::counter;
use tokio_util::sync::CancellationToken;

use crate::amqp::consume::ConsumerConfig;
use crate::amqp::relay::Relay;
use crate::amqp::{self, AmqpError, Link, LinkState};
use crate::config::Topology;
use crate::context::Context;
use crate::telemetry::metrics as m;
use crate::tls::Trust;

/// Where and how to reach the broker.
#[derive(Clone)]
pub struct Broker {
    pub url: String,
    pub heartbeat_secs: u16,
    pub trust: Trust,
}

/// Why a session could not set itself up on a fresh connection.
pub enum SetUpError {
    /// A deployment error: the supervisor stops with it.
    Fatal(AmqpError),
    /// Like a lost link: reconnect.
    Lost(AmqpError),
}

/// One broker link's work on one connection.
pub trait Session: Send {
    /// What [`Session::set_up`] made ready for [`Session::run`].
    type Ready: Send;
    /// Which link this is (logs, `/readyz`, the reconnect counter's label).
    const LINK: Link;
    /// Whether a refused login or a failed TLS handshake before the link was first up stops
    /// the supervisor with the error.
    const REFUSAL_IS_FATAL: bool;
    /// Logged when the link is lost and reconnected.
    const LOST: &'static str;
    /// Logged instead of [`Session::LOST`] when the link is lost after the stop token was
    /// cancelled; `None`: lost is lost, the supervisor logs and stops.
    const LOST_WHILE_STOPPING: Option<&'static str>;

    /// The connection's name (shown in the broker's management UI).
    fn connection_name(&self) -> String;

    /// Sets the link up on a fresh connection; the link counts as up once this returns Ok.
    fn set_up(
        &mut self,
        connection: &Connection,
    ) -> impl Future<Output = Result<Self::Ready, SetUpError>> + Send;

    /// Runs until `stop` (Ok) or the link breaks (Err).
    fn run(
        &mut self,
        ready: Self::Ready,
        connection: &Connection,
        stop: CancellationToken,
    ) -> impl Future<Output = Result<(), AmqpError>> + Send;
}

/// Keeps `session`'s link alive until `stop`; Err only with a fatal error (see the module doc).
pub async fn supervise<S: Session>(
    mut session: S,
    broker: Broker,
    links: LinkState,
    stop: CancellationToken,
) -> Result<(), AmqpError> {
    let name = session.connection_name();
    let mut attempt = 0;
    let mut ever_up = false;
    loop {
        let fatal = S::REFUSAL_IS_FATAL && !ever_up;
        let Some((connection, node)) =
            connect_until_stopped(&broker, &name, S::LINK, fatal, &stop).await?
        else {
            return Ok(());
        };
        ever_up = true;
        let result = match session.set_up(&connection).await {
            Ok(ready) => {
                links.up(S::LINK, node, &connection);
                attempt = 0;
                session.run(ready, &connection, stop.clone()).await
            }
            Err(SetUpError::Fatal(e)) => {
                close_quietly(&connection).await;
                return Err(e);
            }
            Err(SetUpError::Lost(e)) => Err(e),
        };
        links.down_now(S::LINK);
        close_quietly(&connection).await;
        let e = match (result, S::LOST_WHILE_STOPPING) {
            (Ok(()), _) => return Ok(()),
            (Err(e), Some(note)) if stop.is_cancelled() => {
                tracing::warn!(error = %e, "{note}");
                return Ok(());
            }
            (Err(e), _) => e,
        };
        attempt += 1;
        counter!(m::BROKER_RECONNECTS, "link" => link_label(S::LINK)).increment(1);
        tracing::error!(error = %e, attempt, "{}", S::LOST);
        if !pause(attempt, &stop).await {
            return Ok(());
        }
    }
}

fn link_label(link: Link) -> &'static str {
    match link {
        Link::Consumer => "consumer",
        Link::Relay => "relay",
    }
}

/// Closes a connection without waiting on a link that may be a black hole.
async fn close_quietly(connection: &Connection) {
    let _ = tokio::time::timeout(
        Duration::from_secs(2),
        connection.close(200, "shutdown".into()),
    )
    .await;
}

/// Waits out a reconnect delay; false when `stop` fired meanwhile.
async fn pause(attempt: u32, stop: &CancellationToken) -> bool {
    let delay = amqp::reconnect_delay(attempt);
    tokio::select! {
        biased;
        _ = stop.cancelled() => false,
        _ = tokio::time::sleep(delay) => true,
    }
}

/// Connects (named `name`), giving up only when `stop` fires, or with the error when the broker
/// refuses the login or the TLS handshake fails and `refusal_is_fatal`.
async fn connect_until_stopped(
    broker: &Broker,
    name: &str,
    link: Link,
    refusal_is_fatal: bool,
    stop: &CancellationToken,
) -> Result<Option<(Connection, String)>, AmqpError> {
    let mut attempt = 0;
    loop {
        // Every node of the list once, in a fresh order; the first that accepts is kept.
        let mut last = None;
        for url in kit::url::shuffled(&broker.url) {
            let connected = tokio::select! {
                biased;
                _ = stop.cancelled() => return Ok(None),
                c = amqp::connect_with_heartbeat(&url, name, broker.heartbeat_secs, &broker.trust) => c,
            };
            match connected {
                Ok(c) => {
                    let node = kit::url::host_port(&url);
                    tracing::info!(?link, node = %node, "connected to RabbitMQ");
                    return Ok(Some((c, node)));
                }
                // A cluster's nodes share their users and certificates: a refusal by one is
                // the answer of all.
                Err(e @ (AmqpError::Refused { .. } | AmqpError::Tls { .. }))
                    if refusal_is_fatal =>
                {
                    return Err(e)
                }
                // Said once per pass below, with its own words (refused, not unreachable).
                Err(e @ (AmqpError::Refused { .. } | AmqpError::Tls { .. })) => last = Some(e),
                Err(e) => {
                    tracing::warn!(?link, node = %kit::url::host_port(&url), error = %e, "RabbitMQ node not reachable; trying the next");
                    last = Some(e);
                }
            }
        }
        let Some(e) = last else {
            return Ok(None);
        };
        attempt += 1;
        match e {
            AmqpError::Tls { .. } => {
                tracing::error!(?link, attempt, error = %e, "RabbitMQ TLS handshake failed; retrying until the certificate or trust is fixed");
            }
            AmqpError::Refused { .. } => {
                tracing::error!(?link, attempt, error = %e, "RabbitMQ refused the credentials; retrying until they are fixed");
            }
            _ => tracing::warn!(?link, attempt, error = %e, "RabbitMQ not reachable; retrying"),
        }
        if !pause(attempt, stop).await {
            return Ok(None);
        }
    }
}

/// The consumer's link: declare (or check) the topology, then consume.
pub struct ConsumerSession {
    pub ctx: Arc<Context>,
    pub config: ConsumerConfig,
    /// Declare the topology (true) or only check it passively.
    pub declare_topology: bool,
    /// The broker's nodes, where new shards get their leaders one per node.
    pub nodes: amqp::topology::Nodes,
    /// The topology was once declared or found: a missing object later is an outage, not a
    /// deployment error, and a reconnect checks rather than declares.
    pub ever_checked: bool,
}

impl Session for ConsumerSession {
    type Ready = ();
    const LINK: Link = Link::Consumer;
    const REFUSAL_IS_FATAL: bool = true;
    const LOST: &'static str =
        "consumer lost its broker link; reconnecting (unacked deliveries return to the queue)";
    const LOST_WHILE_STOPPING: Option<&'static str> = None;

    fn connection_name(&self) -> String {
        self.ctx.worker_id.clone()
    }

    async fn set_up(&mut self, connection: &Connection) -> Result<(), SetUpError> {
        let topology: &Topology = &self.config.topology;
        let shards = self.config.shards;
        let declare =
            || amqp::topology::declare_placed(connection, topology, shards, Some(&self.nodes));
        let ready = match (self.declare_topology, self.ever_checked) {
            (false, _) => amqp::topology::check(connection, topology, shards).await,
            (true, false) => declare().await,
            // Declared once by this process: a reconnect only checks, passively (a read), and
            // declares again only what went missing. A declaration or binding is a transaction
            // of the broker's cluster-wide metadata store, which waits while any node is
            // unresponsive (paused, partitioned) until Erlang declares it down (`net_ticktime`,
            // 60 s by default): a worker whose link moved away from such a node would wait for
            // it before consuming again.
            (true, true) => match amqp::topology::check(connection, topology, shards).await {
                Err(AmqpError::Missing { .. }) => declare().await,
                checked => checked,
            },
        };
        match ready {
            // Missing objects at start-up are a deployment error, not an outage: stop with
            // their name. Later (deleted while running) the link retries like any broker error.
            Err(e @ AmqpError::Missing { .. }) if !self.ever_checked => Err(SetUpError::Fatal(e)),
            Err(e) => Err(SetUpError::Lost(e)),
            Ok(()) => {
                self.ever_checked = true;
                Ok(())
            }
        }
    }

    async fn run(
        &mut self,
        (): (),
        connection: &Connection,
        stop: CancellationToken,
    ) -> Result<(), AmqpError> {
        amqp::consume::run(connection, self.ctx.clone(), &self.config, stop).await
    }
}

/// The relay's link: open a confirmed channel, then publish results; after the stop token its
/// last round publishes what was committed (or, if the link is down then, results stay in the
/// outbox).
pub struct RelaySession {
    pub ctx: Arc<Context>,
    /// The results exchange.
    pub exchange: String,
}

impl Session for RelaySession {
    type Ready = Relay;
    const LINK: Link = Link::Relay;
    // The consumer link decides about a refused login at start-up (same URL).
    const REFUSAL_IS_FATAL: bool = false;
    const LOST: &'static str =
        "relay lost its broker link; reconnecting (results wait in the outbox)";
    const LOST_WHILE_STOPPING: Option<&'static str> =
        Some("relay lost its broker link while stopping; unpublished results stay in the outbox");

    fn connection_name(&self) -> String {
        format!("{}-relay", self.ctx.worker_id)
    }

    async fn set_up(&mut self, connection: &Connection) -> Result<Relay, SetUpError> {
        Relay::new(connection, self.exchange.clone(), self.ctx.clone())
            .await
            .map_err(SetUpError::Lost)
    }

    async fn run(
        &mut self,
        relay: Relay,
        _connection: &Connection,
        stop: CancellationToken,
    ) -> Result<(), AmqpError> {
        relay.run(stop).await
    }
}
