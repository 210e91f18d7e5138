//! TLS for the publisher's peers, in every build: RabbitMQ (`amqps://`), the agent database
//! (`sslmode=...` in `PUBLISHER_DATABASE_URL`) and the status API (`https://`). The trust is
//! the worker's ([`kit::tls::Trust`]: system roots plus an optional PEM bundle), set once
//! per process: the CLI sets it from `PUBLISHER_CA_FILE`; an agent using this library may call
//! [`set_trust`] before connecting, else the system roots apply. Process-wide rather than a
//! parameter of every connect entry point (`Publisher::connect`, `Follower::follow`, ...),
//! because one agent process has one trust.
//!
//! The AMQP link is opened here ([`amqp_connect`]) and closed here too (`close_within`), each
//! bounded, so a broker that goes silent costs a bounded wait, not the agent.

use std::sync::OnceLock;

use lapin::{Connection, ConnectionProperties};
use sqlx::postgres::PgConnectOptions;

use crate::PublishError;
pub use kit::tls::{handshake_failure, install_default_provider, CaFileError, Trust};

/// The variable naming the publisher CLI's extra CA bundle.
pub const CA_FILE_VAR: &str = "PUBLISHER_CA_FILE";

static TRUST: OnceLock<Trust> = OnceLock::new();

/// Sets the process's trust; false when it was already set (or already used), in which case
/// the first one stays.
pub fn set_trust(trust: Trust) -> bool {
    TRUST.set(trust).is_ok()
}

/// The process's trust (the system roots unless [`set_trust`] came first).
pub fn trust() -> &'static Trust {
    TRUST.get_or_init(Trust::system)
}

/// Opens a broker connection, asking for the worker's heartbeat
/// ([`kit::amqp::DEFAULT_HEARTBEAT_SECS`]) unless the URL sets `?heartbeat=`, so a publish over a
/// link that went silent is in doubt after about 20 s; an `amqps://` URL is verified against
/// [`trust`]. A failed TLS handshake is [`PublishError::Tls`], naming RabbitMQ and the reason.
pub async fn amqp_connect(
    url: &str,
    properties: ConnectionProperties,
) -> Result<Connection, PublishError> {
    let config = lapin::tcp::OwnedTLSConfig {
        identity: None,
        cert_chain: trust().extra_pem().map(str::to_owned),
    };
    let mut uri: lapin::uri::AMQPUri = url.parse().map_err(PublishError::BadUrl)?;
    kit::amqp::ask_heartbeat(&mut uri, kit::amqp::DEFAULT_HEARTBEAT_SECS);
    kit::amqp::connect(uri, properties, config)
        .await
        .map_err(|error| match error.kind() {
            lapin::ErrorKind::IOError(io) => match handshake_failure(io.as_ref()) {
                Some(reason) => PublishError::Tls {
                    peer: "RabbitMQ",
                    reason,
                },
                None => PublishError::Amqp(error),
            },
            _ => crate::error::connection_refusal(&error).unwrap_or(PublishError::Amqp(error)),
        })
}

/// How long a graceful close may wait for the broker before the connection is dropped: over a
/// link that went silent, lapin's close would wait until heartbeats notice, or for ever.
pub const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Closes `channel` (after `before`, which settles what the channel owes) and `connection`
/// gracefully, within [`CLOSE_WAIT`] in all; after that the connection is dropped
/// ([`PublishError::CloseTimedOut`]).
pub(crate) async fn close_within(
    before: impl std::future::Future<Output = Result<(), PublishError>>,
    channel: &lapin::Channel,
    connection: &Connection,
) -> Result<(), PublishError> {
    let close = async {
        before.await?;
        channel.close(200, "OK".into()).await?;
        connection.close(200, "OK".into()).await?;
        Ok(())
    };
    tokio::time::timeout(CLOSE_WAIT, close)
        .await
        .unwrap_or(Err(PublishError::CloseTimedOut(CLOSE_WAIT)))
}

/// [`amqp_connect`] to the first node of a comma-separated list that accepts, tried in a random
/// order ([`kit::url::shuffled`]); returns the connection and the URL it used. A refused login
/// or TLS handshake is the answer of every node and ends the attempt.
pub async fn amqp_connect_any(
    urls: &str,
    properties: ConnectionProperties,
) -> Result<(Connection, String), PublishError> {
    let mut last = PublishError::BadUrl("no URL given".into());
    for url in kit::url::shuffled(urls) {
        match amqp_connect(&url, properties.clone()).await {
            Ok(connection) => {
                tracing::debug!(node = %kit::url::host_port(&url), "connected to RabbitMQ");
                return Ok((connection, url));
            }
            // A cluster's nodes share their users, vhosts and certificates: a refusal by one is
            // the answer of all.
            Err(e @ (PublishError::Tls { .. } | PublishError::Refused { .. })) => return Err(e),
            Err(e) => {
                tracing::warn!(node = %kit::url::host_port(&url), error = %e, "RabbitMQ node not reachable; trying the next");
                last = e;
            }
        }
    }
    Err(last)
}

/// Options for a Postgres URL: the URL's `sslrootcert` (or `PGSSLROOTCERT`) when given, else
/// the extra bundle, on top of the system roots; `sslmode` decides what is checked.
pub fn postgres(url: &str) -> Result<PgConnectOptions, sqlx::Error> {
    let options: PgConnectOptions = url.parse()?;
    let named = url.split_once('?').is_some_and(|(_, query)| {
        query.split('&').any(|pair| {
            let key = pair.split_once('=').map_or(pair, |(k, _)| k);
            key == "sslrootcert" || key == "ssl-root-cert"
        })
    }) || std::env::var_os("PGSSLROOTCERT").is_some_and(|v| !v.is_empty());
    Ok(match trust().extra_pem() {
        Some(pem) if !named => options.ssl_root_cert_from_pem(pem.as_bytes().to_vec()),
        _ => options,
    })
}

/// A reqwest client builder trusting [`trust`].
pub fn http_client() -> reqwest::ClientBuilder {
    reqwest::Client::builder().tls_backend_preconfigured(trust().client_config())
}
