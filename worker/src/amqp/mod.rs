//! Everything that talks to RabbitMQ: the topology the worker declares, the intents consumer,
//! the result relay, the dead-letter queue as the operator works it ([`dead_letters`]), and
//! the link state the readiness probe reports. A lost connection is
//! not fatal: `app`'s link supervisor reconnects each link (consumer, relay) with a jittered,
//! capped back-off ([`reconnect_delay`]), redeclares the topology and resumes; unacked
//! deliveries come back and the inbox dedupes them. The AMQP heartbeat turns a silent black
//! hole into a lost link.

pub mod consume;
pub mod dead_letters;
pub mod relay;
pub mod topology;
pub mod trace;

use std::sync::Arc;
use std::time::Duration;

use lapin::uri::AMQPUri;
use lapin::{Connection, ConnectionProperties};

/// Errors at the broker boundary.
#[derive(Debug, thiserror::Error)]
///
/// A lapin error is part of the message and deliberately not a `source`: lapin's own error
/// already prints its cause ("protocol error: AMQP soft error: ..."), so a chain printer
/// (`{:#}`) would repeat it.
pub enum AmqpError {
    #[error("cannot connect to RabbitMQ at {url}: {error}")]
    Connect { url: String, error: lapin::Error },
    /// The broker answered and refused the login (wrong user, password or vhost permission).
    /// Retrying cannot help until someone fixes the credentials or the broker's users.
    #[error("RabbitMQ at {url} refused the credentials of user {user:?}: {reason}")]
    Refused {
        url: String,
        user: String,
        reason: String,
    },
    /// The TLS handshake failed: the broker's certificate was refused (unknown issuer, name
    /// mismatch, expired...) or the port does not speak TLS. Like a refused login, waiting
    /// cannot fix it.
    #[error("RabbitMQ at {url}: TLS handshake failed: {reason}")]
    Tls { url: String, reason: String },
    #[error("RabbitMQ {what} failed: {error}")]
    Broker { what: String, error: lapin::Error },
    #[error("invalid AMQP_URL {url}: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("{0}")]
    Topology(String),
    /// `WORKER_DECLARE_TOPOLOGY=false` and the broker lacks an object the worker uses.
    #[error(
        "RabbitMQ has no {what} {name:?} (WORKER_DECLARE_TOPOLOGY=false: the worker declares \
         nothing; create it first, e.g. from deploy/rabbitmq/definitions.json)"
    )]
    Missing { what: &'static str, name: String },
    #[error("publish to {exchange} was not confirmed: {reason}")]
    NotConfirmed { exchange: String, reason: String },
}

impl AmqpError {
    pub fn broker(what: impl Into<String>) -> impl FnOnce(lapin::Error) -> AmqpError {
        let what = what.into();
        move |error| AmqpError::Broker { what, error }
    }
}

/// Opens a connection named after the worker (visible in the management UI), with the heartbeat
/// the URL asks for (or the broker's), trusting the system roots for `amqps://`.
pub async fn connect(url: &str, name: &str) -> Result<Connection, AmqpError> {
    connect_with_heartbeat(url, name, 0, &crate::tls::Trust::system()).await
}

/// Like [`connect`], for a worker link. `heartbeat_secs`
/// (0 = off) is asked for unless the URL sets `heartbeat=` itself; the broker and lapin settle
/// on the lower of both, so a link that stops moving is declared dead after about two beats.
/// An `amqps://` URL is verified against `trust` (system roots plus `WORKER_CA_FILE`).
pub async fn connect_with_heartbeat(
    url: &str,
    name: &str,
    heartbeat_secs: u16,
    trust: &crate::tls::Trust,
) -> Result<Connection, AmqpError> {
    let mut uri: AMQPUri = url.parse().map_err(|reason: String| AmqpError::BadUrl {
        url: redact(url),
        reason,
    })?;
    kit::amqp::ask_heartbeat(&mut uri, heartbeat_secs);
    let user = uri.authority.userinfo.username.clone();
    let props = ConnectionProperties::default().with_connection_name(name.to_string().into());
    // A node that accepts and never answers must cost a time-out, not the link.
    kit::amqp::connect(uri, props, crate::tls::amqp(trust))
        .await
        .map_err(|error| {
            if let Some(reason) = login_refusal(&error) {
                return AmqpError::Refused {
                    url: redact(url),
                    user,
                    reason,
                };
            }
            if let lapin::ErrorKind::IOError(io) = error.kind() {
                if let Some(reason) = crate::tls::handshake_failure(io.as_ref()) {
                    return AmqpError::Tls {
                        url: redact(url),
                        reason,
                    };
                }
            }
            AmqpError::Connect {
                url: redact(url),
                error,
            }
        })
}

/// The broker's reason when `error` is a refused login (ACCESS_REFUSED while opening the
/// connection, or a failing authentication provider) or a refused virtual host (NOT_ALLOWED:
/// none of that name, or the user may not use it), else `None`.
fn login_refusal(error: &lapin::Error) -> Option<String> {
    use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
    match error.kind() {
        lapin::ErrorKind::ProtocolError(e)
            if matches!(e.kind(), AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)) =>
        {
            Some(e.get_message().to_string())
        }
        lapin::ErrorKind::ProtocolError(e)
            if matches!(e.kind(), AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)) =>
        {
            Some(format!(
                "{} (the virtual host named by AMQP_URL's path does not exist on this broker, or \
                 this user may not use it: create it and grant the user, or fix the URL; %2f is \
                 the default vhost)",
                e.get_message()
            ))
        }
        lapin::ErrorKind::AuthProviderError(reason) => Some(reason.clone()),
        _ => None,
    }
}

/// Closes `channel` and waits (at most 2 s: the link may be a black hole) for the broker's
/// answer. Every channel a link opened is closed this way before its connection is: a channel
/// dropped open closes itself in the background, and when the connection has begun to close by
/// then, lapin logs that close's failure as a connection ERROR on a clean shutdown.
pub async fn close_channel(channel: &lapin::Channel, why: &str) {
    if channel.status().connected() {
        let _ = tokio::time::timeout(Duration::from_secs(2), channel.close(200, why.into())).await;
    }
}

/// Delay before reconnect attempt `attempt` (1-based): from 250 ms doubling to a 10 s cap,
/// ±50 % jitter so a pool that lost the broker together does not return in lockstep
/// ([`kit::backoff`]).
pub fn reconnect_delay(attempt: u32) -> Duration {
    const RECONNECT: kit::backoff::Backoff = kit::backoff::Backoff {
        initial: Duration::from_millis(250),
        multiplier: 2.0,
        max: Duration::from_secs(10),
        jitter: 0.5,
    };
    kit::backoff::delay(&RECONNECT, attempt.max(1))
}

/// Whether each broker link is up, for `/readyz`. Cheap to clone.
///
/// A link counts as up while its session has set it up and its connection is still open: the
/// connection's own status answers, so a connection the broker dropped reads down at once, even
/// while the session is busy elsewhere (a relay waiting on the ledger) and has not looked yet.
#[derive(Clone, Default)]
pub struct LinkState {
    links: Arc<std::sync::Mutex<[Option<Up>; 2]>>,
}

/// A link that was set up: the node it is connected to (`host:port`) and its connection.
struct Up {
    node: String,
    status: lapin::ConnectionStatus,
}

/// One of the worker's broker links.
#[derive(Clone, Copy, Debug)]
pub enum Link {
    Consumer,
    Relay,
}

impl LinkState {
    /// `link` is set up on `connection`, to `node`.
    pub fn up(&self, link: Link, node: String, connection: &Connection) {
        let status = connection.status().clone();
        self.lock()[link as usize] = Some(Up { node, status });
    }

    /// `link` is down until it is set up again.
    pub fn down_now(&self, link: Link) {
        self.lock()[link as usize] = None;
    }

    /// The node each link (consumer, relay) is connected to now.
    pub fn nodes(&self) -> [Option<String>; 2] {
        self.lock().each_ref().map(|l| {
            l.as_ref()
                .filter(|u| u.status.connected())
                .map(|u| u.node.clone())
        })
    }

    /// The links that are down now (empty when all are up).
    pub fn down(&self) -> Vec<&'static str> {
        let links = self.lock();
        ["consumer", "relay"]
            .into_iter()
            .zip(links.iter())
            .filter(|(_, l)| !l.as_ref().is_some_and(|u| u.status.connected()))
            .map(|(name, _)| name)
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, [Option<Up>; 2]> {
        crate::lock(&self.links)
    }
}

/// Hides the password of an AMQP URL for logs.
pub fn redact(url: &str) -> String {
    kit::url::redact(url)
}

/// Lower-case hex: the body digest the consumer logs, a dead letter's id, the console's cookies.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A persistent copy of a message's properties with `headers` instead of its own: what a
/// dead-letter copy and a republished dead letter are sent with. Without the original's
/// `user_id` (the broker refuses one the publishing connection cannot vouch for) and without its
/// `expiration`: a per-message TTL that bounded how long an intent may wait for a worker must not
/// make its dead letter vanish from the dead-letter queue before an operator has seen it.
pub fn persistent_copy(
    original: &lapin::BasicProperties,
    headers: lapin::types::FieldTable,
) -> lapin::BasicProperties {
    let o = original;
    let mut p = lapin::BasicProperties::default()
        .with_headers(headers)
        .with_delivery_mode(2);
    if let Some(v) = o.content_type() {
        p = p.with_content_type(v.clone());
    }
    if let Some(v) = o.content_encoding() {
        p = p.with_content_encoding(v.clone());
    }
    if let Some(v) = o.priority() {
        p = p.with_priority(*v);
    }
    if let Some(v) = o.correlation_id() {
        p = p.with_correlation_id(v.clone());
    }
    if let Some(v) = o.reply_to() {
        p = p.with_reply_to(v.clone());
    }
    if let Some(v) = o.message_id() {
        p = p.with_message_id(v.clone());
    }
    if let Some(v) = o.timestamp() {
        p = p.with_timestamp(*v);
    }
    if let Some(v) = o.kind() {
        p = p.with_type(v.clone());
    }
    if let Some(v) = o.app_id() {
        p = p.with_app_id(v.clone());
    }
    if let Some(v) = o.cluster_id() {
        p = p.with_cluster_id(v.clone());
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};

    fn protocol_error(kind: AMQPSoftError, message: &str) -> lapin::Error {
        lapin::ErrorKind::ProtocolError(AMQPError::new(AMQPErrorKind::Soft(kind), message.into()))
            .into()
    }

    #[test]
    fn a_broker_error_prints_its_protocol_error_once() {
        let e = AmqpError::broker("declaring queue \"intents\"")(protocol_error(
            AMQPSoftError::PRECONDITIONFAILED,
            "PRECONDITION_FAILED - inequivalent arg 'x-queue-type'",
        ));
        let text = crate::telemetry::chain(&e);
        assert_eq!(text.matches("protocol error").count(), 1, "{text}");
        assert_eq!(text.matches("inequivalent arg").count(), 1, "{text}");
    }

    #[test]
    fn only_access_refused_is_a_refused_login() {
        let refused = protocol_error(
            AMQPSoftError::ACCESSREFUSED,
            "ACCESS_REFUSED - Login was refused",
        );
        assert_eq!(
            login_refusal(&refused).as_deref(),
            Some("ACCESS_REFUSED - Login was refused")
        );
        let other = protocol_error(AMQPSoftError::NOTFOUND, "NOT_FOUND - no queue");
        assert_eq!(login_refusal(&other), None);
        let io: lapin::Error = std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into();
        assert_eq!(login_refusal(&io), None);
    }
}
