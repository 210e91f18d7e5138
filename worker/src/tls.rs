//! TLS for every peer of the worker, in every build: RabbitMQ (`amqps://`), the Postgres ledger
//! (`sslmode=require|verify-ca|verify-full`) and HTTPS tools. One trust for all three: the
//! system roots plus the optional PEM bundle `WORKER_CA_FILE` ([`kit::tls::Trust`], shared
//! with the publisher). This module only hands that trust to each client library.

use std::path::Path;

use lapin::tcp::OwnedTLSConfig;
use sqlx::postgres::PgConnectOptions;

pub use kit::tls::{handshake_failure, install_default_provider, CaFileError, Trust};

/// The variable naming the worker's extra CA bundle.
pub const CA_FILE_VAR: &str = "WORKER_CA_FILE";

/// Loads the worker's trust: system roots plus `WORKER_CA_FILE` when set.
pub fn load(ca_file: Option<&Path>) -> Result<Trust, CaFileError> {
    Trust::load(CA_FILE_VAR, ca_file)
}

/// A reqwest client builder that trusts `trust` (ring, system roots plus the CA file).
pub fn http_client(trust: &Trust) -> reqwest::ClientBuilder {
    reqwest::Client::builder().tls_backend_preconfigured(trust.client_config())
}

/// lapin's TLS settings for an `amqps://` URL: it loads the system roots itself and adds the
/// extra bundle (ignored for `amqp://`).
pub fn amqp(trust: &Trust) -> OwnedTLSConfig {
    OwnedTLSConfig {
        identity: None,
        cert_chain: trust.extra_pem().map(str::to_owned),
    }
}

/// Connection options for a Postgres URL. sqlx trusts the system roots plus one root file:
/// the URL's `sslrootcert` (or `PGSSLROOTCERT`) when given, else the extra bundle. Which
/// checks run is the URL's `sslmode` (`verify-full` checks CA and host name).
pub fn postgres(url: &str, trust: &Trust) -> Result<PgConnectOptions, sqlx::Error> {
    let options: PgConnectOptions = url.parse()?;
    let named_in_url = url
        .split_once('?')
        .map(|(_, query)| {
            query.split('&').any(|pair| {
                let key = pair.split_once('=').map_or(pair, |(k, _)| k);
                key == "sslrootcert" || key == "ssl-root-cert"
            })
        })
        .unwrap_or(false);
    let named_in_env = std::env::var_os("PGSSLROOTCERT").is_some_and(|v| !v.is_empty());
    Ok(match trust.extra_pem() {
        Some(pem) if !named_in_url && !named_in_env => {
            options.ssl_root_cert_from_pem(pem.as_bytes().to_vec())
        }
        _ => options,
    })
}
