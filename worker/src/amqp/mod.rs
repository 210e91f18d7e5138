//! Everything that talks to RabbitMQ: the topology the worker declares, the intents consumer
//! and the result relay. A broken connection or channel is fatal for the process: the worker
//! exits non-zero and its supervisor restarts it; leases and the inbox make that safe.

pub mod consume;
pub mod relay;
pub mod topology;

use lapin::{Connection, ConnectionProperties};

/// Errors at the broker boundary.
#[derive(Debug, thiserror::Error)]
pub enum AmqpError {
    #[error("cannot connect to RabbitMQ at {url}: {source}")]
    Connect { url: String, source: lapin::Error },
    #[error("RabbitMQ {what} failed: {source}")]
    Broker { what: String, source: lapin::Error },
    #[error("{0}")]
    Topology(String),
    #[error("publish to {exchange} was not confirmed: {reason}")]
    NotConfirmed { exchange: String, reason: String },
}

impl AmqpError {
    pub fn broker(what: impl Into<String>) -> impl FnOnce(lapin::Error) -> AmqpError {
        let what = what.into();
        move |source| AmqpError::Broker { what, source }
    }
}

/// Opens a connection named after the worker (visible in the management UI).
pub async fn connect(url: &str, name: &str) -> Result<Connection, AmqpError> {
    let props = ConnectionProperties::default().with_connection_name(name.to_string().into());
    Connection::connect(url, props)
        .await
        .map_err(|source| AmqpError::Connect {
            url: redact(url),
            source,
        })
}

/// Hides the password of an AMQP URL for logs.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            let user = creds.split(':').next().unwrap_or("");
            format!("{}{}:***{}", &url[..s + 3], user, &url[at..])
        }
        _ => url.to_string(),
    }
}
