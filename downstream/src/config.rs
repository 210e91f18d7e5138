//! Start-up configuration, read once from the environment.
//!
//! Every knob is an environment variable so that test harnesses can start the
//! binary with nothing but `Command::env`. Values are validated here, before
//! anything touches the network or the database, so a typo fails loudly at
//! start-up instead of surfacing later as odd behaviour.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::jobs::MAX_DELAY_MS;

/// Validated settings for one process.
#[derive(Debug, Clone)]
pub struct Config {
    pub database_url: String,
    /// Postgres schema holding all tables; validated so it can be spliced into SQL.
    pub schema: String,
    pub addr: SocketAddr,
    /// Replay keys older than this are forgotten (like Stripe pruning its keys).
    pub replay_retention: Duration,
    /// How long an async job runs before it ends, unless an `async_delay` fault says otherwise.
    pub async_delay_ms: u64,
}

impl Config {
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Same as [`Config::from_env`] with an injectable lookup, so tests need not
    /// mutate the process environment.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let database_url = get("DOWNSTREAM_DATABASE_URL")
            .filter(|v| !v.trim().is_empty())
            .context(
                "DOWNSTREAM_DATABASE_URL is required (e.g. postgres://postgres@127.0.0.1:5432/downstream)",
            )?;
        let schema = get("DOWNSTREAM_SCHEMA").unwrap_or_else(|| "downstream".to_owned());
        validate_schema(&schema)?;
        let addr_text = get("DOWNSTREAM_ADDR").unwrap_or_else(|| "127.0.0.1:9100".to_owned());
        let addr = addr_text
            .parse()
            .with_context(|| format!("DOWNSTREAM_ADDR={addr_text:?} is not an ip:port"))?;
        let retention_text =
            get("DOWNSTREAM_REPLAY_RETENTION_SECS").unwrap_or_else(|| "86400".to_owned());
        let secs: u64 = retention_text.parse().with_context(|| {
            format!("DOWNSTREAM_REPLAY_RETENTION_SECS={retention_text:?} is not a whole number of seconds")
        })?;
        let delay_text = get("DOWNSTREAM_ASYNC_DELAY_MS").unwrap_or_else(|| "1000".to_owned());
        let async_delay_ms = delay_text
            .parse::<u64>()
            .ok()
            .filter(|ms| *ms <= MAX_DELAY_MS)
            .with_context(|| {
                format!(
                    "DOWNSTREAM_ASYNC_DELAY_MS={delay_text:?} is not a whole number of milliseconds \
                     of at most {MAX_DELAY_MS} (30 days)"
                )
            })?;
        Ok(Config {
            database_url,
            schema,
            addr,
            replay_retention: Duration::from_secs(secs),
            async_delay_ms,
        })
    }
}

/// The schema name is interpolated into SQL text (identifiers cannot be bound
/// as parameters), so only a conservative unquoted-identifier shape is allowed.
fn validate_schema(schema: &str) -> Result<()> {
    let mut chars = schema.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !first_ok || !rest_ok || schema.len() > 63 {
        bail!("DOWNSTREAM_SCHEMA={schema:?} must match [a-z_][a-z0-9_]* (at most 63 chars)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn database_url_is_required() {
        let err = cfg(&[]).unwrap_err().to_string();
        assert!(err.contains("DOWNSTREAM_DATABASE_URL"), "{err}");
    }

    #[test]
    fn defaults_apply() {
        let c = cfg(&[("DOWNSTREAM_DATABASE_URL", "postgres://x")]).unwrap();
        assert_eq!(c.schema, "downstream");
        assert_eq!(c.addr.to_string(), "127.0.0.1:9100");
        assert_eq!(c.replay_retention, Duration::from_secs(86400));
        assert_eq!(c.async_delay_ms, 1000);
    }

    #[test]
    fn async_delay_is_checked() {
        let url = ("DOWNSTREAM_DATABASE_URL", "postgres://x");
        let c = cfg(&[url, ("DOWNSTREAM_ASYNC_DELAY_MS", "0")]).unwrap();
        assert_eq!(c.async_delay_ms, 0);
        for bad in ["-1", "1.5", "soon", "2592000001"] {
            let err = cfg(&[url, ("DOWNSTREAM_ASYNC_DELAY_MS", bad)])
                .unwrap_err()
                .to_string();
            assert!(err.contains("DOWNSTREAM_ASYNC_DELAY_MS"), "{bad}: {err}");
        }
    }

    #[test]
    fn schema_names_are_checked() {
        for ok in ["downstream", "_x", "a1_b"] {
            assert!(validate_schema(ok).is_ok(), "{ok}");
        }
        for bad in ["", "1a", "Ds", "a-b", "a;drop", "a b", "\"x\""] {
            assert!(validate_schema(bad).is_err(), "{bad}");
        }
    }
}
