//! The demo agent used by docker compose.
//!
//! It publishes `count` intents `demo-<run id>-<i>` and re-publishes every k-th one
//! with a new call id and its JSON fields in another order. The worker must treat the
//! re-publish as a duplicate of the same action (same key, same fingerprint) and never
//! dispatch it twice.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use tracing::{info, warn};

use crate::{cli::redact, PublishError, Publisher};

/// How long the demo waits for the broker and the worker's exchange at start.
const STARTUP: Duration = Duration::from_secs(60);
/// Pause between start-up attempts.
const STARTUP_PAUSE: Duration = Duration::from_secs(1);

/// What `publisher demo` was asked to do.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    pub amqp_url: String,
    pub exchange: String,
    pub tenant: String,
    pub tool: String,
    pub count: u64,
    pub interval: Duration,
    /// Re-publish every k-th intent; 0 disables.
    pub duplicate_every: u64,
}

/// Runs the demo agent to completion.
pub async fn run(config: DemoConfig) -> anyhow::Result<()> {
    let deadline = Instant::now() + STARTUP;
    let publisher = connect_when_ready(&config, deadline).await?;
    let run_id = run_id();
    info!(%run_id, tenant = %config.tenant, tool = %config.tool, count = config.count, "demo starting");

    for i in 1..=config.count {
        if i > 1 {
            tokio::time::sleep(config.interval).await;
        }
        let action_id = format!("demo-{run_id}-{i}");
        let call_id = format!("call-{run_id}-{i}");
        let body = intent_json(&config, &action_id, &call_id, i, false);
        let fingerprint = publish_checked(&publisher, &body, deadline).await?;
        info!(tenant = %config.tenant, %action_id, %call_id, %fingerprint, "published intent");

        if config.duplicate_every > 0 && i % config.duplicate_every == 0 {
            let call_id = format!("call-{run_id}-{i}-again");
            let body = intent_json(&config, &action_id, &call_id, i, true);
            let again = publish_checked(&publisher, &body, deadline).await?;
            info!(
                tenant = %config.tenant, %action_id, %call_id, fingerprint = %again,
                same_fingerprint = again == fingerprint,
                "re-published the same action (reordered JSON, new call id): expect a duplicate"
            );
        }
    }
    info!(%run_id, "demo done");
    publisher.close().await.ok();
    Ok(())
}

/// Connects, retrying until the broker accepts connections and the worker has
/// declared the intents exchange, or until `deadline`.
async fn connect_when_ready(config: &DemoConfig, deadline: Instant) -> anyhow::Result<Publisher> {
    let url = redact(&config.amqp_url);
    loop {
        let attempt = async {
            let publisher = Publisher::connect(&config.amqp_url, &config.exchange).await?;
            let ready = publisher.exchange_exists().await?;
            Ok::<_, PublishError>(ready.then_some(publisher))
        }
        .await;
        let why = match attempt {
            Ok(Some(publisher)) => return Ok(publisher),
            Ok(None) => format!("exchange {:?} does not exist yet", config.exchange),
            Err(error) => error.to_string(),
        };
        if Instant::now() + STARTUP_PAUSE > deadline {
            bail!(
                "broker at {url} not ready after {}s: {why}",
                STARTUP.as_secs()
            );
        }
        warn!(%url, %why, "broker not ready, retrying");
        tokio::time::sleep(STARTUP_PAUSE).await;
    }
}

/// Validates `body` as the worker would, then publishes it. While the start-up window
/// lasts, an unroutable intent (the worker has declared the exchange but not yet bound
/// its queue) is sent again unchanged: same key, same body.
async fn publish_checked(
    publisher: &Publisher,
    body: &str,
    deadline: Instant,
) -> anyhow::Result<String> {
    let intent = protocol::decode_intent(body.as_bytes())
        .map_err(|error| anyhow::anyhow!("demo built an invalid intent: {error}"))?;
    let fingerprint = protocol::fingerprint(&intent.tool, &intent.arguments);
    loop {
        match publisher
            .publish_encoded(&intent.tenant, &intent.action_id, body.as_bytes())
            .await
        {
            Ok(()) => return Ok(fingerprint),
            Err(error @ PublishError::Unroutable { .. })
                if Instant::now() + STARTUP_PAUSE <= deadline =>
            {
                warn!(%error, "intent unroutable, the worker may still be starting; sending it again");
                tokio::time::sleep(STARTUP_PAUSE).await;
            }
            Err(error) => {
                return Err(error)
                    .with_context(|| format!("publishing {}:{}", intent.tenant, intent.action_id))
            }
        }
    }
}

/// The intent body. `reordered` writes the fields (top-level and in `arguments`) in
/// another order, which must not change the action key or the fingerprint.
fn intent_json(
    config: &DemoConfig,
    action_id: &str,
    call_id: &str,
    i: u64,
    reordered: bool,
) -> String {
    let q = |s: &str| serde_json::Value::from(s).to_string();
    let (tenant, action_id, tool, call_id) =
        (q(&config.tenant), q(action_id), q(&config.tool), q(call_id));
    let order = q(&format!("order-{i}"));
    let amount = 100 + i;
    if reordered {
        format!(
            r#"{{"call_id":{call_id},"arguments":{{"currency":"USD","amount_cents":{amount},"order":{order}}},"tool":{tool},"reply_to":{tenant},"action_id":{action_id},"tenant":{tenant}}}"#
        )
    } else {
        format!(
            r#"{{"tenant":{tenant},"action_id":{action_id},"tool":{tool},"arguments":{{"order":{order},"amount_cents":{amount},"currency":"USD"}},"call_id":{call_id},"reply_to":{tenant}}}"#
        )
    }
}

/// A short id unique to this run: process id and start time.
fn run_id() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{:x}{:x}", std::process::id(), nanos % (1 << 40))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> DemoConfig {
        DemoConfig {
            amqp_url: String::new(),
            exchange: "intents".into(),
            tenant: "north-shop".into(),
            tool: "refund".into(),
            count: 3,
            interval: Duration::ZERO,
            duplicate_every: 3,
        }
    }

    #[test]
    fn reordered_duplicate_is_the_same_action_and_fingerprint() {
        let plain = intent_json(&config(), "demo-x-3", "call-1", 3, false);
        let again = intent_json(&config(), "demo-x-3", "call-2", 3, true);
        assert_ne!(plain, again);
        let a = protocol::decode_intent(plain.as_bytes()).expect("plain decodes");
        let b = protocol::decode_intent(again.as_bytes()).expect("reordered decodes");
        assert_eq!(
            (a.tenant.as_str(), a.action_id.as_str()),
            ("north-shop", "demo-x-3")
        );
        assert_eq!((&a.tenant, &a.action_id), (&b.tenant, &b.action_id));
        assert_ne!(a.call_id, b.call_id);
        assert_eq!(
            protocol::fingerprint(&a.tool, &a.arguments),
            protocol::fingerprint(&b.tool, &b.arguments)
        );
        assert_eq!(a.arguments["amount_cents"], 103);
    }
}
