//! Wiring: builds the worker from its settings and runs consumer, dispatchers, recovery
//! scheduler, relay, metrics and admin API until a signal, then shuts down gracefully. The
//! consumer and the relay each own one broker connection and reopen it when it is lost.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use metrics::counter;

use crate::adapter::ToolSet;
use crate::amqp::{self, consume::ConsumerConfig, relay::Relay, Link, LinkState};
use crate::config::{Settings, Tools};
use crate::context::Context;
use crate::ledger::Ledger;
use crate::recovery::scheduler;
use crate::shutdown;
use crate::telemetry::metrics as m;
use crate::tls::Trust;

/// How long the relay's last round (publishing committed results) and its connection close
/// may take after the grace period: the second term of the shutdown budget.
pub const RELAY_FLUSH: Duration = Duration::from_secs(10);

/// Connects to the ledger, retrying while it starts (compose, k8s). A login Postgres refuses
/// (SQLSTATE class 28: unknown role, wrong password, no `pg_hba.conf` entry) is not retried:
/// the server answered, and waiting cannot fix the credentials. Nor is a failed TLS handshake
/// (certificate refused under `sslmode=verify-ca|verify-full`, or a server without TLS).
pub async fn connect_ledger(settings: &Settings, trust: &Trust) -> anyhow::Result<Ledger> {
    let options =
        crate::tls::postgres(&settings.database_url, trust).context("invalid DATABASE_URL")?;
    let mut delay = Duration::from_millis(250);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        match Ledger::connect_with(
            options.clone(),
            settings.db_pool_size,
            settings.db_acquire_timeout,
        )
        .await
        {
            Ok(l) => return Ok(l),
            Err(crate::ledger::LedgerError::Db(sqlx::Error::Database(db)))
                if db.code().is_some_and(|c| c.starts_with("28")) =>
            {
                anyhow::bail!(
                    "Postgres refused the credentials of user {:?} (DATABASE_URL): {}; not retrying",
                    options.get_username(),
                    db.message()
                );
            }
            Err(crate::ledger::LedgerError::Db(e))
                if crate::tls::postgres_failure(&e).is_some() =>
            {
                anyhow::bail!(
                    "Postgres ledger (DATABASE_URL) at {}:{}: TLS handshake failed: {}; not retrying",
                    options.get_host(),
                    options.get_port(),
                    crate::tls::postgres_failure(&e).unwrap_or_default()
                );
            }
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::warn!(error = %e, "Postgres not reachable yet; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(e).context("cannot connect to Postgres (DATABASE_URL)"),
        }
    }
}

/// Runs the worker until SIGTERM/Ctrl-C. Losing the broker is not fatal: each link reconnects.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let trust = crate::tls::load(settings.ca_file.as_deref())?;
    let tools_file = Tools::load(&settings.tools_path)?;
    let tools = ToolSet::from_config(&tools_file, &trust)?;
    crate::config::check_proof(&settings, &tools_file)?;
    warn_about_risky_settings(&settings, &tools_file);
    kit::fd::prepare("worker", &descriptor_budget(&settings));
    let names: Vec<String> = tools.iter().map(|(n, _)| n.clone()).collect();
    let handle = m::install(&names)
        .map_err(|e| anyhow::anyhow!("cannot install the metrics recorder: {e}"))?;
    let ledger = connect_ledger(&settings, &trust).await?;
    // The pool's own options: the URL and trust connect_ledger already resolved.
    probe_pooler(&ledger.pool().connect_options())
        .await
        .map_err(pooler_hint)?;
    let started = if settings.migrate {
        ledger
            .migrate()
            .await
            .context("applying migrations")
            .map_err(pooler_hint)
    } else {
        wait_for_migrations(&ledger).await.map_err(pooler_hint)
    };
    started?;

    let ctx = Context::new(
        ledger.clone(),
        tools.clone(),
        settings.worker_id.clone(),
        settings.lease,
        settings.max_in_flight,
    );
    let (trigger, stop) = shutdown::channel();
    let tool_names: Vec<String> = tools.iter().map(|(n, _)| n.clone()).collect();
    let links = LinkState::default();

    if let Some(addr) = settings.metrics_addr {
        let stop = stop.clone();
        let limits = settings.http_limits;
        let (handle, ledger, names) = (handle.clone(), ledger.clone(), tool_names.clone());
        let links = links.clone();
        tokio::spawn(async move {
            if let Err(e) = m::serve(addr, limits, handle, ledger, names, links, async move {
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
        )
        .with_limits(settings.http_limits);
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
    // The relay stops last: after in-flight work has recorded its results.
    let (relay_trigger, relay_stop) = shutdown::channel();
    let relay = tokio::spawn(relay_link(
        settings.clone(),
        trust.clone(),
        ctx.clone(),
        links.clone(),
        relay_stop,
    ));

    let consumer_config = ConsumerConfig {
        topology: settings.topology.clone(),
        prefetch: settings.prefetch,
        max_message_bytes: settings.max_message_bytes,
        auth: tools_file.auth.clone(),
    };
    tracing::info!(worker_id = %settings.worker_id, tools = ?tool_names, "worker started");
    let consumer = consumer_link(
        &settings,
        &trust,
        ctx.clone(),
        consumer_config,
        links,
        stop.clone(),
    );
    tokio::pin!(consumer);
    // On a signal the consumer is told to stop and then awaited, so a batch it is in the middle
    // of is recorded, acked and dispatched rather than abandoned half-way (which would turn its
    // claims into false unknowns). It also stops while the broker is unreachable.
    //
    // Every phase after the signal is bounded (docs/operations.md): the consumer's last
    // batch, in-flight work and the scheduler's last pass share one deadline, the signal plus
    // WORKER_SHUTDOWN_GRACE_SECS (a batch hung on a black-holed ledger or broker is given up
    // there: its deliveries are unacked and return, its claims are covered by their leases);
    // then the relay gets RELAY_FLUSH for its last round and the connection close.
    let (consumed, deadline) = tokio::select! {
        r = &mut consumer => (r, tokio::time::Instant::now() + settings.shutdown_grace),
        _ = shutdown::signal() => {
            let deadline = tokio::time::Instant::now() + settings.shutdown_grace;
            tracing::info!(grace_secs = settings.shutdown_grace.as_secs(), "shutdown requested");
            trigger.fire();
            match tokio::time::timeout_at(deadline, &mut consumer).await {
                Ok(r) => (r, deadline),
                Err(_) => {
                    tracing::warn!("the consumer did not stop within the grace period; its unacked deliveries return to the queue");
                    (Ok(()), deadline)
                }
            }
        }
    };
    trigger.fire();
    drain(&ctx, deadline, settings.max_in_flight).await;
    for (name, mut task) in [
        ("recovery scheduler", sched),
        ("retention sweeper", sweeper),
    ] {
        // A pass caught on a hung ledger is cut off: its leases cover what it had claimed.
        if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
            tracing::warn!(task = name, "still running after the grace period; stopped");
            task.abort();
        }
    }
    relay_trigger.fire();
    let mut relay = relay;
    if tokio::time::timeout(RELAY_FLUSH, &mut relay).await.is_err() {
        relay.abort();
        tracing::warn!("relay did not finish in time; unpublished results stay in the outbox");
    }
    tracing::info!("worker stopped");
    consumed.context("the consumer could not start")?;
    Ok(())
}

/// Closes a connection without waiting on a link that may be a black hole.
async fn close_quietly(connection: &lapin::Connection) {
    let _ = tokio::time::timeout(
        Duration::from_secs(2),
        connection.close(200, "shutdown".into()),
    )
    .await;
}

/// Waits out a reconnect delay; false when `stop` fired meanwhile.
async fn pause(attempt: u32, stop: &shutdown::CancelToken) -> bool {
    let delay = amqp::reconnect_delay(attempt);
    tokio::select! {
        biased;
        _ = stop.cancelled() => false,
        _ = tokio::time::sleep(delay) => true,
    }
}

/// Connects (named `name`), giving up only when `stop` fires, or with the error when the broker
/// refuses the login or the TLS handshake fails and `refusal_is_fatal` (the consumer's first
/// connection at start-up: a wrong password or an untrusted certificate should stop the
/// process, not look like an unreachable broker forever). A refusal later on (credentials
/// revoked, certificate rotated while running) is logged as such and retried, so the worker
/// keeps draining and recording what it holds while someone fixes it.
async fn connect_until_stopped(
    settings: &Settings,
    trust: &Trust,
    name: &str,
    link: Link,
    refusal_is_fatal: bool,
    stop: &shutdown::CancelToken,
) -> Result<Option<lapin::Connection>, amqp::AmqpError> {
    let mut attempt = 0;
    loop {
        let connected = tokio::select! {
            biased;
            _ = stop.cancelled() => return Ok(None),
            c = amqp::connect_with_heartbeat(&settings.amqp_url, name, settings.amqp_heartbeat_secs, trust) => c,
        };
        match connected {
            Ok(c) => return Ok(Some(c)),
            Err(e @ (amqp::AmqpError::Refused { .. } | amqp::AmqpError::Tls { .. }))
                if refusal_is_fatal =>
            {
                return Err(e)
            }
            Err(e @ amqp::AmqpError::Tls { .. }) => {
                attempt += 1;
                tracing::error!(?link, attempt, error = %e, "RabbitMQ TLS handshake failed; retrying until the certificate or trust is fixed");
                if !pause(attempt, stop).await {
                    return Ok(None);
                }
            }
            Err(e @ amqp::AmqpError::Refused { .. }) => {
                attempt += 1;
                tracing::error!(?link, attempt, error = %e, "RabbitMQ refused the credentials; retrying until they are fixed");
                if !pause(attempt, stop).await {
                    return Ok(None);
                }
            }
            Err(e) => {
                attempt += 1;
                tracing::warn!(?link, attempt, error = %e, "RabbitMQ not reachable; retrying");
                if !pause(attempt, stop).await {
                    return Ok(None);
                }
            }
        }
    }
}

/// The consumer's broker link: connect, declare the topology, consume; when the link breaks,
/// reconnect with back-off and start again. Returns once `stop` fired, or with the error when
/// the broker refused the login before the link was ever up.
async fn consumer_link(
    settings: &Settings,
    trust: &Trust,
    ctx: Arc<Context>,
    config: ConsumerConfig,
    links: LinkState,
    stop: shutdown::CancelToken,
) -> Result<(), amqp::AmqpError> {
    let mut attempt = 0;
    let mut ever_up = false;
    let mut ever_checked = false;
    loop {
        let Some(connection) = connect_until_stopped(
            settings,
            trust,
            &settings.worker_id,
            Link::Consumer,
            !ever_up,
            &stop,
        )
        .await?
        else {
            return Ok(());
        };
        ever_up = true;
        let ready = if settings.declare_topology {
            amqp::topology::declare(&connection, &settings.topology).await
        } else {
            amqp::topology::check(&connection, &settings.topology).await
        };
        let result = match ready {
            // Missing objects at start-up are a deployment error, not an outage: stop with
            // their name. Later (deleted while running) the link retries like any broker error.
            Err(e @ amqp::AmqpError::Missing { .. }) if !ever_checked => {
                close_quietly(&connection).await;
                return Err(e);
            }
            Ok(()) => {
                ever_checked = true;
                links.set(Link::Consumer, true);
                attempt = 0;
                amqp::consume::run(&connection, ctx.clone(), &config, stop.clone()).await
            }
            Err(e) => Err(e),
        };
        links.set(Link::Consumer, false);
        close_quietly(&connection).await;
        match result {
            Ok(()) => return Ok(()),
            Err(e) => {
                attempt += 1;
                counter!(m::BROKER_RECONNECTS, "link" => "consumer").increment(1);
                tracing::error!(error = %e, attempt, "consumer lost its broker link; reconnecting (unacked deliveries return to the queue)");
                if !pause(attempt, &stop).await {
                    return Ok(());
                }
            }
        }
    }
}

/// The relay's broker link, like [`consumer_link`]; runs until `stop` fired and the relay's
/// last round is done (or the link is down at that moment: results stay in the outbox).
async fn relay_link(
    settings: Settings,
    trust: Trust,
    ctx: Arc<Context>,
    links: LinkState,
    stop: shutdown::CancelToken,
) {
    let name = format!("{}-relay", settings.worker_id);
    let mut attempt = 0;
    loop {
        // The consumer link decides about a refused login at start-up (same URL).
        let Ok(Some(connection)) =
            connect_until_stopped(&settings, &trust, &name, Link::Relay, false, &stop).await
        else {
            return;
        };
        let exchange = settings.topology.results_exchange.clone();
        let result = match Relay::new(&connection, exchange, ctx.clone()).await {
            Ok(relay) => {
                links.set(Link::Relay, true);
                attempt = 0;
                relay.run(stop.clone()).await
            }
            Err(e) => Err(e),
        };
        links.set(Link::Relay, false);
        close_quietly(&connection).await;
        match result {
            Ok(()) => return,
            Err(e) if stop.is_cancelled() => {
                tracing::warn!(error = %e, "relay lost its broker link while stopping; unpublished results stay in the outbox");
                return;
            }
            Err(e) => {
                attempt += 1;
                counter!(m::BROKER_RECONNECTS, "link" => "relay").increment(1);
                tracing::error!(error = %e, attempt, "relay lost its broker link; reconnecting (results wait in the outbox)");
                if !pause(attempt, &stop).await {
                    return;
                }
            }
        }
    }
}

/// Waits for in-flight dispatches to record their outcomes, until `deadline`.
async fn drain(ctx: &Arc<Context>, deadline: tokio::time::Instant, max_in_flight: usize) {
    let all = ctx
        .in_flight
        .clone()
        .acquire_many_owned(max_in_flight as u32);
    match tokio::time::timeout_at(deadline, all).await {
        Ok(_) => tracing::info!("in-flight work finished"),
        Err(_) => tracing::warn!(
            "in-flight work still running after the grace period; its leases will expire into unknown and be recovered"
        ),
    }
}

/// What this worker may hold open at once (README, "Connections and open files"): its
/// Postgres pool (and the two connections of the start-up pooler probe), each HTTP listener's
/// connection cap, one downstream connection per dispatch or recovery round in flight, and its
/// two broker connections.
fn descriptor_budget(settings: &Settings) -> kit::fd::Budget {
    let api_enabled = settings.admin_token.is_some() || !settings.tenant_tokens.is_empty();
    let cap = settings.http_limits.max_connections as u64;
    let mut budget = kit::fd::Budget::new().add(
        "database pool (WORKER_DB_POOL_SIZE, + 2 start-up probes)",
        u64::from(settings.db_pool_size) + 2,
    );
    if settings.metrics_addr.is_some() {
        budget = budget.add("metrics listener (WORKER_HTTP_MAX_CONNECTIONS)", cap + 1);
    }
    if settings.admin_addr.is_some() && api_enabled {
        budget = budget.add("admin listener (WORKER_HTTP_MAX_CONNECTIONS)", cap + 1);
    }
    budget
        .add(
            "downstream connections (WORKER_MAX_IN_FLIGHT)",
            settings.max_in_flight as u64,
        )
        .add("broker", 2)
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

/// Makes a transaction-mode pooler without prepared-statement support fail at start-up, every
/// time, instead of in whichever statements happen to collide later (where a reused statement
/// name could even run another statement with the same parameter count). Two fresh client
/// connections each prepare the same first statement (sqlx names it `sqlx_s_1` on both) while
/// the second holds a transaction: with Postgres itself, session pooling, or PgBouncer >= 1.21
/// with `max_prepared_statements`, nothing collides; PgBouncer < 1.21 in transaction mode hands
/// the second client the server connection the first one just prepared on (its default LIFO
/// reuse), and the prepare fails with "already exists".
async fn probe_pooler(options: &sqlx::postgres::PgConnectOptions) -> anyhow::Result<()> {
    use sqlx::Connection as _;
    let probe = async {
        let mut a = sqlx::PgConnection::connect_with(options).await?;
        let mut b = sqlx::PgConnection::connect_with(options).await?;
        let q = "SELECT pg_backend_pid()";
        let _: i32 = sqlx::query_scalar(q).fetch_one(&mut a).await?;
        let mut tx = b.begin().await?;
        let _: i32 = sqlx::query_scalar(q).fetch_one(&mut *tx).await?;
        let _: i32 = sqlx::query_scalar(q).fetch_one(&mut a).await?;
        tx.rollback().await?;
        let _ = a.close().await;
        let _ = b.close().await;
        Ok::<_, sqlx::Error>(())
    };
    match tokio::time::timeout(Duration::from_secs(15), probe).await {
        Ok(r) => r.context("checking the Postgres connection for a transaction-mode pooler"),
        Err(_) => Err(anyhow::anyhow!(
            "a second connection to Postgres did not answer within 15 s while the first held a \
             transaction: a pooler with a single server connection? (README, \"Postgres \
             connections and PgBouncer\")"
        )),
    }
}

/// The first queries of a worker behind PgBouncer in transaction mode without
/// `max_prepared_statements` (PgBouncer < 1.21, or the setting left at 0) fail on sqlx's named
/// prepared statements: say what to change instead of leaving a bare SQL error.
fn pooler_hint(e: anyhow::Error) -> anyhow::Error {
    let text = format!("{e:#}");
    if text.contains("prepared statement \"sqlx_s_") {
        e.context(
            "DATABASE_URL looks like a connection pooler in transaction mode that does not keep \
             prepared statements (PgBouncer < 1.21 or max_prepared_statements = 0); use \
             PgBouncer >= 1.21 with max_prepared_statements > 0, session pooling, or Postgres \
             directly (README, \"Postgres connections and PgBouncer\")",
        )
    } else {
        e
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
    let trust = crate::tls::load(settings.ca_file.as_deref())?;
    let ledger = connect_ledger(settings, &trust).await?;
    ledger.migrate().await.context("applying migrations")?;
    tracing::info!("migrations applied");
    Ok(())
}
