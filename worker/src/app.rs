//! Wiring: builds the worker from its settings and runs consumer, dispatchers, recovery
//! scheduler, relay, metrics and admin API until a signal, then shuts down gracefully.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;

use crate::adapter::ToolSet;
use crate::amqp::{self, consume::ConsumerConfig, relay::Relay};
use crate::config::{Settings, Tools};
use crate::context::Context;
use crate::ledger::Ledger;
use crate::recovery::scheduler;
use crate::shutdown;
use crate::telemetry::metrics as m;

/// Connects to the ledger, retrying while it starts (compose, k8s).
pub async fn connect_ledger(settings: &Settings) -> anyhow::Result<Ledger> {
    let mut delay = Duration::from_millis(250);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        match Ledger::connect(&settings.database_url, settings.db_pool_size).await {
            Ok(l) => return Ok(l),
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::warn!(error = %e, "Postgres not reachable yet; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(e).context("cannot connect to Postgres (DATABASE_URL)"),
        }
    }
}

/// Runs the worker until SIGTERM/Ctrl-C (or a fatal broker error).
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let tools_file = Tools::load(&settings.tools_path)?;
    let tools = ToolSet::from_config(&tools_file)?;
    crate::config::check_proof(&settings, &tools_file)?;
    warn_about_risky_settings(&settings, &tools_file);
    let handle =
        m::install().map_err(|e| anyhow::anyhow!("cannot install the metrics recorder: {e}"))?;
    let ledger = connect_ledger(&settings).await?;
    if settings.migrate {
        ledger.migrate().await.context("applying migrations")?;
    } else {
        wait_for_migrations(&ledger).await?;
    }

    let connection = connect_amqp(&settings).await?;
    amqp::topology::declare(&connection, &settings.topology).await?;

    let ctx = Context::new(
        ledger.clone(),
        tools.clone(),
        settings.worker_id.clone(),
        settings.lease,
        settings.max_in_flight,
    );
    let (trigger, stop) = shutdown::channel();
    let tool_names: Vec<String> = tools.iter().map(|(n, _)| n.clone()).collect();

    if let Some(addr) = settings.metrics_addr {
        let stop = stop.clone();
        let (handle, ledger, names) = (handle.clone(), ledger.clone(), tool_names.clone());
        tokio::spawn(async move {
            if let Err(e) = m::serve(addr, handle, ledger, names, async move {
                stop.cancelled().await
            })
            .await
            {
                tracing::error!(%addr, error = %e, "metrics listener failed");
            }
        });
    }
    let api_enabled = settings.admin_token.is_some() || !settings.tenant_tokens.is_empty();
    if let Some(addr) = settings.admin_addr.filter(|_| api_enabled) {
        let api = crate::ops::api::AdminApi::with_tokens(
            ctx.clone(),
            settings.admin_token.clone(),
            settings.tenant_tokens.clone(),
        );
        let stop = stop.clone();
        tokio::spawn(async move {
            if let Err(e) = api.serve(addr, async move { stop.cancelled().await }).await {
                tracing::error!(%addr, error = %e, "admin API listener failed");
            }
        });
    } else if settings.admin_addr.is_some() {
        tracing::info!(
            "admin API disabled: neither WORKER_ADMIN_TOKEN nor WORKER_TENANT_TOKENS is set"
        );
    }
    let sched = tokio::spawn(scheduler::run(
        ctx.clone(),
        settings.recovery_interval,
        stop.clone(),
    ));
    let sweeper = tokio::spawn(crate::ops::retention::run(
        ledger.clone(),
        settings.retention,
        settings.tombstone_retention,
        stop.clone(),
    ));
    let relay = Relay::new(
        &connection,
        settings.topology.results_exchange.clone(),
        ctx.clone(),
    )
    .await?;
    // The relay stops last: after in-flight work has recorded its results.
    let (relay_trigger, relay_stop) = shutdown::channel();
    // A broken broker channel in the relay is fatal, like one in the consumer: the process
    // exits and its supervisor restarts it (the outbox keeps every result).
    let (fatal_tx, mut fatal_rx) = tokio::sync::mpsc::channel::<anyhow::Error>(1);
    let relay = tokio::spawn(async move {
        let result = relay.run(relay_stop).await;
        if let Err(e) = &result {
            let _ = fatal_tx
                .send(anyhow::anyhow!("result relay failed: {e}"))
                .await;
        }
        result
    });

    let consumer_config = ConsumerConfig {
        topology: settings.topology.clone(),
        prefetch: settings.prefetch,
        auth: tools_file.auth.clone(),
        prepared_grace: settings.lease,
    };
    tracing::info!(worker_id = %settings.worker_id, tools = ?tool_names, "worker started");
    let consumer = amqp::consume::run(&connection, ctx.clone(), consumer_config, stop.clone());
    tokio::pin!(consumer);
    // On a signal the consumer is told to stop and then awaited, so a batch it is in the middle
    // of is recorded, acked and dispatched rather than abandoned half-way (which would turn its
    // claims into false unknowns).
    let outcome = tokio::select! {
        r = &mut consumer => r.map_err(anyhow::Error::from),
        _ = shutdown::signal() => {
            tracing::info!("shutdown requested");
            trigger.fire();
            (&mut consumer).await.map_err(anyhow::Error::from)
        }
        Some(e) = fatal_rx.recv() => {
            trigger.fire();
            let _ = (&mut consumer).await;
            Err(e)
        }
    };
    if let Err(e) = &outcome {
        tracing::error!(error = %format!("{e:#}"), "fatal error; shutting down");
    }
    trigger.fire();
    drain(&ctx, settings.shutdown_grace, settings.max_in_flight).await;
    let _ = sched.await;
    let _ = sweeper.await;
    relay_trigger.fire();
    match tokio::time::timeout(Duration::from_secs(10), relay).await {
        Ok(Ok(Err(e))) => {
            tracing::warn!(error = %e, "relay stopped with an error; unpublished results stay in the outbox")
        }
        Err(_) => {
            tracing::warn!("relay did not finish in time; unpublished results stay in the outbox")
        }
        _ => {}
    }
    let _ = connection.close(200, "shutdown".into()).await;
    tracing::info!("worker stopped");
    outcome
}

async fn connect_amqp(settings: &Settings) -> anyhow::Result<lapin::Connection> {
    let mut delay = Duration::from_millis(250);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        match amqp::connect(&settings.amqp_url, &settings.worker_id).await {
            Ok(c) => return Ok(c),
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::warn!(error = %e, "RabbitMQ not reachable yet; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Waits for in-flight dispatches to record their outcomes, up to `grace`.
async fn drain(ctx: &Arc<Context>, grace: Duration, max_in_flight: usize) {
    let all = ctx
        .in_flight
        .clone()
        .acquire_many_owned(max_in_flight as u32);
    match tokio::time::timeout(grace, all).await {
        Ok(_) => tracing::info!("in-flight work finished"),
        Err(_) => tracing::warn!(
            "in-flight work still running after the grace period; its leases will expire into unknown and be recovered"
        ),
    }
}

/// Settings that work but weaken the guarantees: said once at start-up (the unsafe ones were
/// refused by [`crate::config::check_proof`]).
fn warn_about_risky_settings(_settings: &Settings, tools: &Tools) {
    if matches!(tools.auth, crate::config::TenantAuth::Trusted) {
        tracing::warn!(
            "tenants are trusted as written in each intent; with more than one tenant set [auth] mode = \"user_id\" \
             in the tools file so the broker-validated AMQP user_id must prove the tenant"
        );
    }
    for (name, tool) in &tools.tools {
        if tool.receipt_match.is_empty() {
            tracing::warn!(
                tool = %name,
                "receipt_match = {{}} (explicit opt-out): any 2xx with a receipt id is taken as this operation's \
                 receipt; declare the echo fields the downstream returns"
            );
        }
    }
}

/// With `WORKER_MIGRATE=false` the schema belongs to someone else (a `worker migrate` Job):
/// wait for it to be current rather than run against tables this build does not know.
async fn wait_for_migrations(ledger: &Ledger) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let missing = ledger
            .missing_migrations()
            .await
            .context("checking applied migrations (WORKER_MIGRATE=false)")?;
        if missing.is_empty() {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!(
                "WORKER_MIGRATE=false but migrations {missing:?} are not applied (or differ from this build's); \
                 run `worker migrate` with this version first"
            );
        }
        tracing::warn!(
            ?missing,
            "WORKER_MIGRATE=false: waiting for `worker migrate` to apply migrations"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// `worker migrate`: applies migrations and exits.
pub async fn migrate(settings: &Settings) -> anyhow::Result<()> {
    let ledger = connect_ledger(settings).await?;
    ledger.migrate().await.context("applying migrations")?;
    tracing::info!("migrations applied");
    Ok(())
}
