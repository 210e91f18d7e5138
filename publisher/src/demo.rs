//! The demo agent used by docker compose.
//!
//! It sends `count` intents `demo-<run id>-<i>` and sends every k-th one again with a new
//! call id (and, when published directly, its JSON fields in another order). The worker must
//! treat the repeat as a duplicate of the same action (same key, same fingerprint) and never
//! dispatch it twice.
//!
//! With a database URL the agent works as a real one should: each intent is enqueued in the
//! agent's `intent_outbox` in the same transaction as its own record of the request
//! (`demo_refund_requests`), and `publisher relay` publishes it. Either way the agent binds
//! its own results queue (`<tenant>.@.<reply_to>`) first and prints every answer it gets.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use tracing::{info, warn};

use crate::{cli::redact, Follower, Outbox, PublishError, Publisher};

/// How long the demo waits for the broker and the worker's exchange at start.
const STARTUP: Duration = Duration::from_secs(60);
/// Pause between start-up attempts.
const STARTUP_PAUSE: Duration = Duration::from_secs(1);

/// What `publisher demo` was asked to do.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    pub amqp_url: String,
    pub exchange: String,
    pub results_exchange: String,
    pub tenant: String,
    pub tool: String,
    pub count: u64,
    pub interval: Duration,
    /// Re-publish every k-th intent; 0 disables.
    pub duplicate_every: u64,
    pub set_user_id: bool,
    /// The agent's database: enqueue through its outbox instead of publishing.
    pub database_url: Option<String>,
    /// How long to wait for the last answers.
    pub answer_timeout: Duration,
}

/// Runs the demo agent to completion.
pub async fn run(config: DemoConfig) -> anyhow::Result<()> {
    let deadline = Instant::now() + STARTUP;
    let publisher = connect_when_ready(&config, deadline)
        .await?
        .with_user_id(config.set_user_id);
    let run_id = run_id();
    let reply_to = format!("demo-agent-{run_id}");
    // Bound before anything is sent, so no answer is missed.
    let mut answers = Follower::follow_keys(
        &config.amqp_url,
        &config.results_exchange,
        &[protocol::result_routing_key(
            &config.tenant,
            Some(&reply_to),
        )],
        None,
    )
    .await
    .context("cannot bind the demo agent's results queue")?;
    let outbox = match &config.database_url {
        Some(url) => {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect_with(crate::tls::postgres(url)?)
                .await
                .context("cannot connect to the agent database")?;
            Outbox::migrate(&pool).await?;
            sqlx::query(
                "CREATE TABLE IF NOT EXISTS demo_refund_requests (
                     action_id text PRIMARY KEY, order_ref text NOT NULL,
                     amount_cents bigint NOT NULL, requested_at timestamptz NOT NULL DEFAULT now())",
            )
            .execute(&pool)
            .await?;
            Some(pool)
        }
        None => None,
    };
    info!(%run_id, tenant = %config.tenant, tool = %config.tool, count = config.count,
        %reply_to, via_outbox = outbox.is_some(), "demo starting");

    let mut open: BTreeMap<String, ()> = BTreeMap::new();
    let mut shown = 0u64;
    for i in 1..=config.count {
        if i > 1 {
            // Show answers while pacing the requests.
            let pause = Instant::now() + config.interval;
            while let Some(left) = pause.checked_duration_since(Instant::now()) {
                match answers.next(left).await {
                    Ok(Some(event)) => show(&event, &mut open, &mut shown),
                    Ok(None) => break,
                    Err(error) => warn!(%error, "skipped a results message"),
                }
            }
        }
        let action_id = format!("demo-{run_id}-{i}");
        let call_id = format!("call-{run_id}-{i}");
        let body = intent_json(&config, &action_id, &call_id, &reply_to, i, false);
        let fingerprint = match &outbox {
            Some(pool) => enqueue(pool, &body, i).await?,
            None => publish_checked(&publisher, &body, deadline).await?,
        };
        open.insert(action_id.clone(), ());
        info!(tenant = %config.tenant, %action_id, %call_id, %fingerprint, "sent intent");

        if config.duplicate_every > 0 && i % config.duplicate_every == 0 {
            let call_id = format!("call-{run_id}-{i}-again");
            let body = intent_json(&config, &action_id, &call_id, &reply_to, i, true);
            let again = match &outbox {
                Some(pool) => enqueue(pool, &body, i).await?,
                None => publish_checked(&publisher, &body, deadline).await?,
            };
            info!(
                tenant = %config.tenant, %action_id, %call_id, fingerprint = %again,
                same_fingerprint = again == fingerprint,
                "sent the same action again (new call id): expect a duplicate"
            );
        }
    }
    let until = Instant::now() + config.answer_timeout;
    while !open.is_empty() {
        let Some(left) = until.checked_duration_since(Instant::now()) else {
            break;
        };
        match answers.next(left).await {
            Ok(Some(event)) => show(&event, &mut open, &mut shown),
            Ok(None) => break,
            Err(error) => warn!(%error, "skipped a results message"),
        }
    }
    info!(%run_id, answers = shown, without_final_answer = open.len(), "demo done");
    answers.close().await.ok();
    publisher.close().await.ok();
    Ok(())
}

/// Prints an answer (one JSON line on stdout) and closes its action when it is final.
fn show(event: &protocol::ResultEvent, open: &mut BTreeMap<String, ()>, shown: &mut u64) {
    *shown += 1;
    info!(action_id = %event.action_id, status = event.status.as_str(), message = %event.message, "answer");
    if let Ok(line) = serde_json::to_string(event) {
        println!("{line}");
    }
    if event.status != protocol::Status::Pending {
        open.remove(&event.action_id);
    }
}

/// The agent's own write and its intent, in one transaction.
async fn enqueue(pool: &sqlx::PgPool, body: &str, i: u64) -> anyhow::Result<String> {
    let intent = protocol::decode_intent(body.as_bytes())
        .map_err(|error| anyhow::anyhow!("demo built an invalid intent: {error}"))?;
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO demo_refund_requests (action_id, order_ref, amount_cents)
         VALUES ($1, $2, $3) ON CONFLICT (action_id) DO NOTHING",
    )
    .bind(&intent.action_id)
    .bind(format!("order-{i}"))
    .bind(100 + i as i64)
    .execute(&mut *tx)
    .await?;
    Outbox::enqueue(&mut tx, &intent).await?;
    tx.commit().await?;
    Ok(intent.fingerprint())
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
    reply_to: &str,
    i: u64,
    reordered: bool,
) -> String {
    let q = |s: &str| serde_json::Value::from(s).to_string();
    let (tenant, action_id, tool, call_id, reply_to) = (
        q(&config.tenant),
        q(action_id),
        q(&config.tool),
        q(call_id),
        q(reply_to),
    );
    let order = q(&format!("order-{i}"));
    let amount = 100 + i;
    if reordered {
        format!(
            r#"{{"call_id":{call_id},"arguments":{{"currency":"USD","amount_cents":{amount},"order":{order}}},"tool":{tool},"reply_to":{reply_to},"action_id":{action_id},"tenant":{tenant}}}"#
        )
    } else {
        format!(
            r#"{{"tenant":{tenant},"action_id":{action_id},"tool":{tool},"arguments":{{"order":{order},"amount_cents":{amount},"currency":"USD"}},"call_id":{call_id},"reply_to":{reply_to}}}"#
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
            results_exchange: "results".into(),
            set_user_id: true,
            database_url: None,
            answer_timeout: Duration::ZERO,
            tenant: "north-shop".into(),
            tool: "refund".into(),
            count: 3,
            interval: Duration::ZERO,
            duplicate_every: 3,
        }
    }

    #[test]
    fn reordered_duplicate_is_the_same_action_and_fingerprint() {
        let plain = intent_json(&config(), "demo-x-3", "call-1", "agent-1", 3, false);
        let again = intent_json(&config(), "demo-x-3", "call-2", "agent-1", 3, true);
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
