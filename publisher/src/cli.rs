//! The `publisher` command line: `send`, `follow` and `demo`.

use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};

use crate::{demo, Follower, PublishError, Publisher};

/// Publish intents to the intent worker and follow their results.
#[derive(Debug, Parser)]
#[command(name = "publisher", version, about)]
pub struct Cli {
    /// AMQP URL of the broker.
    #[arg(
        long,
        global = true,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Validate one intent as the worker would, publish it and wait for the confirm.
    Send(SendArgs),
    /// Print the tenant's result events, one JSON object per line.
    Follow(FollowArgs),
    /// Demo agent: publish a series of intents, re-sending some to show deduplication.
    Demo(DemoArgs),
}

#[derive(Debug, Args)]
pub struct SendArgs {
    /// Tenant (also the routing key).
    #[arg(long)]
    pub tenant: String,
    /// Logical action id chosen by the application (not the model, not a call id).
    #[arg(long)]
    pub action_id: String,
    /// Tool name.
    #[arg(long)]
    pub tool: String,
    /// Tool arguments as a JSON object.
    #[arg(long = "args", value_name = "JSON")]
    pub arguments: String,
    /// Informational model call id.
    #[arg(long)]
    pub call_id: Option<String>,
    /// Where results should go (defaults to the tenant on the worker side).
    #[arg(long)]
    pub reply_to: Option<String>,
    /// Intents exchange.
    #[arg(long, env = "INTENTS_EXCHANGE", default_value = "intents")]
    pub exchange: String,
}

#[derive(Debug, Args)]
pub struct FollowArgs {
    /// Tenant whose results to follow (the binding's routing key).
    #[arg(long)]
    pub tenant: String,
    /// Durable queue name; without it a temporary exclusive queue is used.
    #[arg(long)]
    pub queue: Option<String>,
    /// Stop after this many results.
    #[arg(long)]
    pub count: Option<u64>,
    /// Stop when this many seconds pass without a result (default: wait forever).
    #[arg(long)]
    pub timeout_secs: Option<u64>,
    /// Results exchange.
    #[arg(long, env = "RESULTS_EXCHANGE", default_value = "results")]
    pub results_exchange: String,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Tenant of the demo intents.
    #[arg(long)]
    pub tenant: String,
    /// Tool of the demo intents.
    #[arg(long)]
    pub tool: String,
    /// Number of distinct intents.
    #[arg(long)]
    pub count: u64,
    /// Pause between publishes, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub interval_ms: u64,
    /// Re-publish every k-th intent (new call id, reordered JSON); 0 disables.
    #[arg(long, default_value_t = 3)]
    pub duplicate_every: u64,
    /// Intents exchange.
    #[arg(long, env = "INTENTS_EXCHANGE", default_value = "intents")]
    pub exchange: String,
}

/// Runs the parsed command. An `Err` is printed by `main` and exits with 1.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Send(args) => send(&cli.amqp_url, args).await,
        Command::Follow(args) => follow(&cli.amqp_url, args).await,
        Command::Demo(args) => {
            demo::run(demo::DemoConfig {
                amqp_url: cli.amqp_url,
                exchange: args.exchange,
                tenant: args.tenant,
                tool: args.tool,
                count: args.count,
                interval: Duration::from_millis(args.interval_ms),
                duplicate_every: args.duplicate_every,
            })
            .await
        }
    }
}

async fn send(amqp_url: &str, args: SendArgs) -> anyhow::Result<()> {
    let arguments: serde_json::Value =
        serde_json::from_str(&args.arguments).context("--args is not valid JSON")?;
    let mut body = serde_json::Map::new();
    body.insert("tenant".into(), args.tenant.into());
    body.insert("action_id".into(), args.action_id.into());
    body.insert("tool".into(), args.tool.into());
    body.insert("arguments".into(), arguments);
    if let Some(call_id) = args.call_id {
        body.insert("call_id".into(), call_id.into());
    }
    if let Some(reply_to) = args.reply_to {
        body.insert("reply_to".into(), reply_to.into());
    }
    let body = serde_json::to_vec(&serde_json::Value::Object(body))?;
    let intent = protocol::decode_intent(&body)
        .map_err(|error| anyhow::anyhow!("invalid intent: {error}"))?;
    let fingerprint = protocol::fingerprint(&intent.tool, &intent.arguments);

    let publisher = Publisher::connect(amqp_url, &args.exchange)
        .await
        .with_context(|| format!("cannot connect to the broker at {}", redact(amqp_url)))?;
    publisher.publish(&intent).await.with_context(|| {
        format!(
            "publishing {}:{} to exchange {:?}",
            intent.tenant, intent.action_id, args.exchange
        )
    })?;
    println!(
        "published {}:{} fingerprint={fingerprint}",
        intent.tenant, intent.action_id
    );
    publisher.close().await.ok();
    Ok(())
}

async fn follow(amqp_url: &str, args: FollowArgs) -> anyhow::Result<()> {
    let mut follower = Follower::follow(
        amqp_url,
        &args.results_exchange,
        &args.tenant,
        args.queue.as_deref(),
    )
    .await
    .with_context(|| format!("cannot follow results at {}", redact(amqp_url)))?;
    // Without --timeout-secs, wait in long slices forever.
    let wait = Duration::from_secs(args.timeout_secs.unwrap_or(3600));
    let mut seen = 0u64;
    while args.count.is_none_or(|count| seen < count) {
        match follower.next(wait).await {
            Ok(Some(event)) => {
                seen += 1;
                println!("{}", serde_json::to_string(&event)?);
            }
            Ok(None) if args.timeout_secs.is_none() => continue,
            Ok(None) => break,
            // Already rejected by the follower; one bad message does not stop following.
            Err(error @ PublishError::BadResult(_)) => tracing::warn!(%error, "skipped"),
            Err(error) => return Err(error.into()),
        }
    }
    follower.close().await.ok();
    match args.count {
        Some(count) if seen < count => bail!(
            "timed out after {}s without a result: {seen} of {count} results received",
            wait.as_secs()
        ),
        _ => Ok(()),
    }
}

/// The URL without its password, for error messages.
pub fn redact(amqp_url: &str) -> String {
    match (amqp_url.find("://"), amqp_url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &amqp_url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &amqp_url[..scheme + 3], &amqp_url[at..])
        }
        _ => amqp_url.to_owned(),
    }
}
