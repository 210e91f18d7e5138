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
    /// The name of the header a write's deadline comes in (matched case-insensitively).
    pub deadline_header: String,
    /// Added to the database clock at a write's commit-point deadline check only: a
    /// downstream whose clock runs ahead (+) or behind (-).
    pub clock_offset_ms: i64,
}

/// The largest `DOWNSTREAM_CLOCK_OFFSET_MS`, either way: 30 days, as for delays.
pub const MAX_CLOCK_OFFSET_MS: i64 = MAX_DELAY_MS as i64;

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
        let deadline_header =
            get("DOWNSTREAM_DEADLINE_HEADER").unwrap_or_else(|| "Request-Deadline".to_owned());
        if !is_header_name(&deadline_header) {
            bail!(
                "DOWNSTREAM_DEADLINE_HEADER={deadline_header:?} is not an HTTP header name \
                 (letters, digits and !#$%&'*+-.^_`|~)"
            );
        }
        let offset_text = get("DOWNSTREAM_CLOCK_OFFSET_MS").unwrap_or_else(|| "0".to_owned());
        let clock_offset_ms = offset_text
            .parse::<i64>()
            .ok()
            .filter(|ms| ms.abs() <= MAX_CLOCK_OFFSET_MS)
            .with_context(|| {
                format!(
                    "DOWNSTREAM_CLOCK_OFFSET_MS={offset_text:?} is not a whole number of \
                     milliseconds (signed) of at most {MAX_CLOCK_OFFSET_MS} (30 days) either way"
                )
            })?;
        Ok(Config {
            database_url,
            schema,
            addr,
            replay_retention: Duration::from_secs(secs),
            async_delay_ms,
            deadline_header,
            clock_offset_ms,
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

/// An HTTP field name: one or more `tchar`s (RFC 9110 §5.6.2).
fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c))
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
        assert_eq!(c.deadline_header, "Request-Deadline");
        assert_eq!(c.clock_offset_ms, 0);
    }

    #[test]
    fn deadline_settings_are_checked() {
        let url = ("DOWNSTREAM_DATABASE_URL", "postgres://x");
        let c = cfg(&[
            url,
            ("DOWNSTREAM_DEADLINE_HEADER", "X-Deadline"),
            ("DOWNSTREAM_CLOCK_OFFSET_MS", "+60000"),
        ])
        .unwrap();
        assert_eq!(c.deadline_header, "X-Deadline");
        assert_eq!(c.clock_offset_ms, 60000);
        let c = cfg(&[url, ("DOWNSTREAM_CLOCK_OFFSET_MS", "-60000")]).unwrap();
        assert_eq!(c.clock_offset_ms, -60000);
        for bad in ["", "1.5", "soon", "60s", "2592000001", "-2592000001"] {
            let err = cfg(&[url, ("DOWNSTREAM_CLOCK_OFFSET_MS", bad)])
                .unwrap_err()
                .to_string();
            assert!(err.contains("DOWNSTREAM_CLOCK_OFFSET_MS"), "{bad}: {err}");
        }
        for bad in ["", "Request Deadline", "Deadline:", "Déadline"] {
            let err = cfg(&[url, ("DOWNSTREAM_DEADLINE_HEADER", bad)])
                .unwrap_err()
                .to_string();
            assert!(err.contains("DOWNSTREAM_DEADLINE_HEADER"), "{bad}: {err}");
        }
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
