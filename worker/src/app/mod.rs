//! Start-up and shutdown, zero2prod style: [`Application::build`] turns the settings into a
//! running-ready worker (tools file and its checks, metrics recorder, ledger connected and
//! migrated, shared context); [`Application::run_until_stopped`] starts the listeners, the
//! recovery scheduler, the retention sweeper and the two broker links (one supervisor for both:
//! [`supervise`](mod@supervise)), and on the stop signal shuts them down in order, each phase
//! bounded.
//!
//! Shutdown order (docs/operations.md, "Graceful shutdown"): the consumer stops taking
//! deliveries and finishes the batch it is in; in-flight work, the scheduler and the sweeper
//! get until the signal plus `WORKER_SHUTDOWN_GRACE_SECS`; then, within [`RELAY_FLUSH`], the
//! batchers record what they hold and the relay publishes what was committed. Work still
//! running after its bound is covered by its lease: the next scheduler treats it as
//! `unknown`, never as not sent.

mod checks;
pub mod supervise;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::adapter::ToolSet;
use crate::amqp::{consume::ConsumerConfig, LinkState};
use crate::config::{Settings, Tools};
use crate::context::Context;
use crate::dispatch::kept::Dropped;
use crate::ledger::{startup, Ledger};
use crate::recovery::scheduler;
use crate::telemetry::metrics as m;
use crate::tls::Trust;
use supervise::{supervise, Broker, ConsumerSession, RelaySession};

/// How long the relay's last round (publishing committed results) and its connection close
/// may take after the grace period: the second term of the shutdown budget.
pub const RELAY_FLUSH: Duration = Duration::from_secs(10);

/// Runs the worker until SIGTERM/Ctrl-C. Losing the broker is not fatal: each link reconnects.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    Application::build(settings)
        .await?
        .run_until_stopped(crate::shutdown::signal())
        .await
}

/// `worker migrate`: applies migrations and exits. It waits for Postgres as the worker's
/// start-up does, also for a link lost after the first connection, and refuses a
/// transaction-mode pooler the same way ([`startup::prepare`]).
pub async fn migrate(settings: &Settings) -> anyhow::Result<()> {
    let trust = crate::tls::load(settings.ca_file.as_deref())?;
    let ledger = connect_ledger(settings, &trust).await?;
    crate::fault::point("after_ledger_connected", "");
    startup::prepare(&ledger, true).await?;
    tracing::info!("migrations applied");
    Ok(())
}

/// Connects to the ledger the settings name, retrying while Postgres starts
/// ([`startup::connect_retrying`]).
pub async fn connect_ledger(settings: &Settings, trust: &Trust) -> anyhow::Result<Ledger> {
    startup::connect_retrying(
        &settings.database_url,
        trust,
        settings.db_pool_size,
        settings.db_acquire_timeout,
    )
    .await
}

/// A worker built from its settings, ready to run.
pub struct Application {
    settings: Settings,
    trust: Trust,
    /// The parsed tools file (the consumer applies its tenant proof).
    tools_file: Tools,
    ctx: Arc<Context>,
    metrics: PrometheusHandle,
    /// Broker link state, for `/readyz`.
    links: LinkState,
    /// The metrics and admin listeners, bound before anything else starts.
    listeners: Listeners,
}

/// The listeners a worker serves, each when enabled.
struct Listeners {
    metrics: Option<std::net::TcpListener>,
    admin: Option<std::net::TcpListener>,
}

impl Listeners {
    /// Binds `METRICS_ADDR` and, when the API is enabled, `WORKER_ADMIN_ADDR`: an address that
    /// cannot be bound stops start-up (exit 2), never a worker without `/readyz` or its API.
    fn bind(s: &Settings) -> Result<Listeners, kit::http::BindError> {
        let api_enabled = s.api_enabled();
        Ok(Listeners {
            metrics: s
                .metrics_addr
                .map(|addr| kit::http::bind("METRICS_ADDR", addr))
                .transpose()?,
            admin: s
                .admin_addr
                .filter(|_| api_enabled)
                .map(|addr| kit::http::bind("WORKER_ADMIN_ADDR", addr))
                .transpose()?,
        })
    }
}

/// What [`Application::run_until_stopped`] started and shuts down.
struct Running {
    /// Cancelled on the signal: consumer, scheduler, sweeper, listeners.
    stop: CancellationToken,
    /// Cancelled last, once in-flight work has recorded its results.
    relay_stop: CancellationToken,
    /// Every task started here.
    tasks: TaskTracker,
    scheduler: JoinHandle<()>,
    sweeper: JoinHandle<()>,
    relay: JoinHandle<()>,
}

impl Application {
    /// Loads and checks the tools file, installs the metrics recorder, connects to the ledger
    /// and makes its schema ready, and builds the shared context. Nothing runs yet.
    pub async fn build(settings: Settings) -> anyhow::Result<Application> {
        let listeners = Listeners::bind(&settings)?;
        let trust = crate::tls::load(settings.ca_file.as_deref())?;
        let tools_file = Tools::load(&settings.tools_path)?;
        let tools = ToolSet::from_config(&tools_file, &trust)?;
        crate::config::check_proof(&settings, &tools_file)?;
        checks::warn_about_risky_settings(&settings, &tools_file);
        kit::fd::prepare("worker", &checks::descriptor_budget(&settings));
        let names = tool_names(&tools);
        let metrics = m::install(&names)
            .map_err(|e| anyhow::anyhow!("cannot install the metrics recorder: {e}"))?;
        let ledger = connect_ledger(&settings, &trust).await?;
        crate::fault::point("after_ledger_connected", "");
        startup::prepare(&ledger, settings.migrate).await?;
        let ctx = Context::new(
            ledger,
            tools,
            settings.worker_id.clone(),
            settings.lease,
            settings.receipt_keep,
            settings.max_in_flight,
            settings.batch_pace,
        );
        Ok(Application {
            settings,
            trust,
            tools_file,
            ctx,
            metrics,
            links: LinkState::default(),
            listeners,
        })
    }

    /// Runs until `signal` resolves (or the consumer ends on its own), then shuts down in
    /// order (see the module doc). Err when the consumer could not start.
    pub async fn run_until_stopped(
        mut self,
        signal: impl Future<Output = ()>,
    ) -> anyhow::Result<()> {
        let running = self.start();
        // A task of the runtime, not a future of this one: awaited here, `block_on`'s thread
        // would run the consumer apart from Tokio's threads, and every wake-up between it and
        // them (each delivery, statement and ack) would cross threads.
        let mut consumer = tokio::spawn(supervise(
            ConsumerSession {
                ctx: self.ctx.clone(),
                config: ConsumerConfig {
                    topology: self.settings.topology.clone(),
                    prefetch: self.settings.prefetch,
                    max_message_bytes: self.settings.max_message_bytes,
                    auth: self.tools_file.auth.clone(),
                    shards: self.settings.shards,
                    own_user: crate::amqp::dead_letters::broker_user(&self.settings.amqp_url),
                },
                declare_topology: self.settings.declare_topology,
                nodes: crate::amqp::topology::Nodes {
                    urls: kit::url::split_list(&self.settings.amqp_url),
                    name: format!("{} (declaring shards)", self.settings.worker_id),
                    heartbeat_secs: self.settings.amqp_heartbeat_secs,
                    trust: self.trust.clone(),
                },
                ever_checked: false,
            },
            self.broker(),
            self.links.clone(),
            running.stop.clone(),
        ));
        tracing::info!(
            worker_id = %self.settings.worker_id,
            tools = ?tool_names(&self.ctx.tools),
            "worker started"
        );
        // On a signal the consumer is told to stop and then awaited, so a batch it is in the
        // middle of is recorded, acked and dispatched rather than abandoned half-way (which
        // would turn its claims into false unknowns). It also stops while the broker is
        // unreachable. A batch hung on a black-holed ledger or broker is given up at the
        // deadline: its deliveries are unacked and return, its claims are covered by leases.
        let grace = self.settings.shutdown_grace;
        let (consumed, deadline) = tokio::select! {
            r = &mut consumer => (joined(r), Instant::now() + grace),
            _ = signal => {
                let deadline = Instant::now() + grace;
                tracing::info!(grace_secs = grace.as_secs(), "shutdown requested");
                running.stop.cancel();
                match tokio::time::timeout_at(deadline, &mut consumer).await {
                    Ok(r) => (joined(r), deadline),
                    Err(_) => {
                        tracing::warn!("the consumer did not stop within the grace period; its unacked deliveries return to the queue");
                        consumer.abort();
                        (Ok(()), deadline)
                    }
                }
            }
        };
        self.shut_down(running, deadline).await;
        tracing::info!("worker stopped");
        consumed.context("the consumer could not start")?;
        Ok(())
    }

    fn broker(&self) -> Broker {
        Broker {
            url: self.settings.amqp_url.clone(),
            heartbeat_secs: self.settings.amqp_heartbeat_secs,
            trust: self.trust.clone(),
        }
    }

    /// Starts everything but the consumer: listeners, scheduler, sweeper, relay.
    fn start(&mut self) -> Running {
        let stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        self.start_listeners(&tasks, &stop);
        let s = &self.settings;
        let scheduler = tasks.spawn(scheduler::run(
            self.ctx.clone(),
            s.recovery_interval,
            stop.clone(),
        ));
        let sweeper = tasks.spawn(crate::ops::retention::run(
            self.ctx.ledger.clone(),
            s.retention,
            s.tombstone_retention,
            stop.clone(),
        ));
        tasks.spawn(crate::telemetry::heartbeat::run(
            self.ctx.ledger.clone(),
            s.worker_id.clone(),
            self.links.clone(),
            stop.clone(),
        ));
        // The relay stops last: after in-flight work has recorded its results.
        let relay_stop = CancellationToken::new();
        let relay = RelaySession {
            ctx: self.ctx.clone(),
            exchange: s.topology.results_exchange.clone(),
        };
        let relay = tasks.spawn({
            let (broker, links, stop) = (self.broker(), self.links.clone(), relay_stop.clone());
            async move {
                // Never fatal: the consumer link decides about a refused login.
                let _ = supervise(relay, broker, links, stop).await;
            }
        });
        Running {
            stop,
            relay_stop,
            tasks,
            scheduler,
            sweeper,
            relay,
        }
    }

    /// The metrics listener (with `/livez` and `/readyz`) and the admin API, each when enabled
    /// (bound in [`Application::build`]); both stop at `stop`.
    fn start_listeners(&mut self, tasks: &TaskTracker, stop: &CancellationToken) {
        let s = &self.settings;
        if let Some(listener) = self.listeners.metrics.take() {
            let (limits, handle, ledger) =
                (s.http_limits, self.metrics.clone(), self.ctx.ledger.clone());
            let (names, links, stop) = (
                tool_names(&self.ctx.tools),
                self.links.clone(),
                stop.clone(),
            );
            tasks.spawn(async move {
                let stopped = stop.cancelled_owned();
                if let Err(e) =
                    m::serve(listener, limits, handle, ledger, names, links, stopped).await
                {
                    tracing::error!(error = %e, "metrics listener failed");
                }
            });
        }
        if let Some(listener) = self.listeners.admin.take() {
            let mut api = crate::ops::api::AdminApi::with_tokens(
                self.ctx.clone(),
                s.admin_token.clone(),
                s.tenant_tokens.clone(),
            )
            .with_approvers(s.approver_tokens.clone())
            .with_limits(s.http_limits);
            if s.console.enabled {
                let console = self.console(tasks, stop, api.budget());
                api = api.with_console(console);
            }
            let stop = stop.clone();
            tasks.spawn(async move {
                if let Err(e) = api.serve(listener, stop.cancelled_owned()).await {
                    tracing::error!(error = %e, "admin API listener failed");
                }
            });
        } else if s.admin_addr.is_some() {
            tracing::info!(
                "admin API disabled: neither WORKER_ADMIN_TOKEN nor WORKER_TENANT_TOKENS is set"
            );
        }
    }

    /// The operator console, and its bulk-job runner's takeover loop (stops at `stop`).
    fn console(
        &self,
        tasks: &TaskTracker,
        stop: &CancellationToken,
        budget: Arc<kit::guard::FailureBudget>,
    ) -> crate::console::Console {
        let s = &self.settings;
        let runner = crate::ops::bulk::Runner::new(
            self.ctx.clone(),
            stop.clone(),
            tasks.clone(),
            s.retention,
        );
        tasks.spawn(runner.clone().sweep());
        let broker = crate::ops::dead_letters::Broker::new(
            &s.amqp_url,
            &format!("intent-worker-console-{}", s.worker_id),
            self.trust.clone(),
            s.topology.clone(),
        );
        crate::console::Console::new(
            self.ctx.clone(),
            crate::config::auth::Tokens::new(s.admin_token.clone(), s.tenant_tokens.clone())
                .with_approvers(s.approver_tokens.clone()),
            s.console.clone(),
            broker,
            self.tools_file.auth.clone(),
            runner,
            budget,
        )
    }

    /// After the consumer: in-flight work, scheduler and sweeper until `deadline`; then the
    /// batchers and the relay's last round within [`RELAY_FLUSH`].
    async fn shut_down(&self, running: Running, deadline: Instant) {
        running.stop.cancel();
        match tokio::time::timeout_at(deadline, self.ctx.drain()).await {
            Ok(()) => tracing::info!("in-flight work finished"),
            Err(_) => {
                tracing::warn!(
                    "in-flight work still running after the grace period; its leases will expire into unknown and be recovered"
                );
                // Each is logged with its key and receipt id: the proof an operator needs.
                let dropped = self.ctx.receipts.drop_all(Dropped::Shutdown);
                if dropped > 0 {
                    tracing::error!(
                        dropped,
                        "stopping with receipts the ledger never took (logged above)"
                    );
                }
            }
        }
        for (name, mut task) in [
            ("recovery scheduler", running.scheduler),
            ("retention sweeper", running.sweeper),
        ] {
            // A pass caught on a hung ledger is cut off: its leases cover what it had claimed.
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                tracing::warn!(task = name, "still running after the grace period; stopped");
                task.abort();
            }
        }
        let flush_deadline = Instant::now() + RELAY_FLUSH;
        if tokio::time::timeout_at(flush_deadline, self.ctx.stop_batchers())
            .await
            .is_err()
        {
            tracing::warn!("the batchers did not finish in time; their callers' leases cover them");
        }
        running.relay_stop.cancel();
        let mut relay = running.relay;
        if tokio::time::timeout_at(flush_deadline, &mut relay)
            .await
            .is_err()
        {
            relay.abort();
            tracing::warn!("relay did not finish in time; unpublished results stay in the outbox");
        }
        running.tasks.close();
        if tokio::time::timeout_at(flush_deadline, running.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!("a listener did not stop in time; it ends with the process");
        }
    }
}

/// The consumer task's result; its panic goes on as this thread's, as it did when the consumer
/// was a future of `main` (a cancellation is only ever this module's abort after the grace).
fn joined(
    r: Result<Result<(), crate::amqp::AmqpError>, tokio::task::JoinError>,
) -> Result<(), crate::amqp::AmqpError> {
    match r {
        Ok(r) => r,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Ok(()),
    }
}

fn tool_names(tools: &ToolSet) -> Vec<String> {
    tools.iter().map(|(n, _)| n.clone()).collect()
}
