//! Chaos soak: real worker processes whose broker and
//! Postgres links each run through their own [`FaultProxy`]; a seeded schedule of SIGKILLs
//! (the soak restarts killed workers as a supervisor would), link cuts and black holes, and
//! downstream faults (replies lost before or after the commit, late replies, 5xx/4xx/429,
//! wrong receipts, lookup misses); an agent publishing intents for tools of all three
//! capabilities (some repeated under the same key, reordered, with other number spellings)
//! and reading its result events from queues bound to its tenants. After the faults stop and
//! a settle period (no operator acts), the invariants are checked from the downstream's own
//! tables, the ledger and the events the agent received, and the seeds' measures are
//! computed.
//!
//! Shared by the `soak` binary (long runs) and `tests/tests/soak_short.rs` (a short seeded
//! run in the test command).

use std::collections::{BTreeMap, HashMap};
use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, Result};
use protocol::{ResultEvent, Status};
use publisher::{Follower, Publisher};
use serde_json::{json, Value};
use tokio::time::{sleep, Instant};

use crate::{cleanup, via, Downstream, Env, FaultProxy, Worker, WorkerOptions};

/// The agent's tenants (one with a dot and an underscore, as the contract allows).
pub const TENANTS: [&str; 2] = ["soak-north", "soak.south_2"];
/// Worker lease: longer than a tool's whole timeout, short enough to recover quickly.
const LEASE_SECS: u64 = 5;
/// Tool request timeout; `slow` faults straddle it.
const TIMEOUT_MS: u64 = 1500;

/// What to run.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    pub seed: u64,
    /// Distinct action keys published (republished copies come on top).
    pub intents: usize,
    /// How long the agent publishes and the faults run.
    pub seconds: u64,
    pub workers: usize,
    /// Longest wait after the faults stop for every action to settle.
    pub settle_secs: u64,
}

/// A tool's recovery capability; each has one tool in the soak's tools file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Capability {
    Replay,
    Lookup,
    None,
}

impl Capability {
    pub const ALL: [Capability; 3] = [Capability::Replay, Capability::Lookup, Capability::None];

    pub fn tool(self) -> &'static str {
        match self {
            Capability::Replay => "refund",
            Capability::Lookup => "ticket",
            Capability::None => "deploy",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Capability::Replay => "replay",
            Capability::Lookup => "lookup",
            Capability::None => "none",
        }
    }
}

/// Figures per capability.
#[derive(Debug, Clone, Default)]
pub struct CapabilityFigures {
    pub actions: usize,
    pub succeeded: usize,
    pub failed: usize,
    /// `held` or still unresolved (`unknown`, `dispatching`, …) at the end.
    pub unresolved: usize,
    /// Keys with more than one downstream mutation.
    pub duplicate_keys: usize,
    pub mutations: i64,
    pub writes: i64,
    pub lookups: i64,
}

/// What the soak did and found.
#[derive(Debug, Clone, Default)]
pub struct SoakReport {
    pub config_line: String,
    pub published: usize,
    pub republished: usize,
    pub events: usize,
    pub kills: usize,
    pub link_cuts: usize,
    pub link_blackholes: usize,
    pub downstream_faults: BTreeMap<String, usize>,
    /// Worker exits the soak did not cause, with how they ended and their last log lines.
    pub unexpected_exits: Vec<String>,
    /// Restarted workers that exited before they consumed (measure, not an invariant).
    pub startup_exits: Vec<String>,
    pub per_capability: BTreeMap<Capability, CapabilityFigures>,
    /// Extra mutations beyond the first, over every key.
    pub duplicate_mutations: i64,
    /// Keys of `lookup`/`none` tools written again after an attempt that may have applied.
    pub unsafe_resends: usize,
    pub false_success: usize,
    pub false_failure: usize,
    pub false_rejection: usize,
    pub lost: usize,
    /// Keys whose row is final (`succeeded`/`failed`) but whose final answer never reached
    /// the agent.
    pub lost_answers: usize,
    pub unresolved: usize,
    /// First `pending` to the final answer, per key that had one, in milliseconds.
    pub recovery_latencies_ms: Vec<i64>,
    /// Lookups + replays (same-key writes after the first of a replay tool) per action.
    pub verification_per_action: f64,
    /// `tenant:action_id (tool) state: evidence` of every unresolved key.
    pub unresolved_keys: Vec<String>,
    pub settled: bool,
    /// From the end of the faults to settled (or to the settle cap).
    pub settle_time: Duration,
    pub elapsed: Duration,
    /// Every broken invariant, one line each.
    pub violations: Vec<String>,
}

impl SoakReport {
    fn percentile(&self, p: f64) -> Option<i64> {
        let v = &self.recovery_latencies_ms;
        if v.is_empty() {
            return None;
        }
        let idx = ((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1;
        Some(v[idx])
    }
}

impl fmt::Display for SoakReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |v: Option<i64>| v.map_or("-".to_string(), |v| format!("{v} ms"));
        writeln!(f, "soak: {}", self.config_line)?;
        writeln!(
            f,
            "published {} intents ({} distinct keys + {} repeats), {} result events received, {:.1} s, settled: {} (after {:.1} s)",
            self.published + self.republished,
            self.published,
            self.republished,
            self.events,
            self.elapsed.as_secs_f64(),
            self.settled,
            self.settle_time.as_secs_f64()
        )?;
        let faults: Vec<String> = self
            .downstream_faults
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        writeln!(
            f,
            "faults: {} SIGKILLs, {} link cuts, {} link black holes; downstream: {}",
            self.kills,
            self.link_cuts,
            self.link_blackholes,
            faults.join(" ")
        )?;
        writeln!(
            f,
            "{:<8} {:>7} {:>9} {:>6} {:>10} {:>10} {:>9} {:>6} {:>7}",
            "tool",
            "actions",
            "succeeded",
            "failed",
            "unresolved",
            "dup keys",
            "mutations",
            "writes",
            "lookups"
        )?;
        for (cap, c) in &self.per_capability {
            writeln!(
                f,
                "{:<8} {:>7} {:>9} {:>6} {:>10} {:>10} {:>9} {:>6} {:>7}",
                cap.as_str(),
                c.actions,
                c.succeeded,
                c.failed,
                c.unresolved,
                c.duplicate_keys,
                c.mutations,
                c.writes,
                c.lookups
            )?;
        }
        writeln!(
            f,
            "duplicate mutations:        {}",
            self.duplicate_mutations
        )?;
        writeln!(f, "unsafe resends (no replay): {}", self.unsafe_resends)?;
        writeln!(f, "lost intents:               {}", self.lost)?;
        writeln!(f, "lost final answers:         {}", self.lost_answers)?;
        writeln!(f, "false success:              {}", self.false_success)?;
        writeln!(f, "false failure:              {}", self.false_failure)?;
        writeln!(f, "false rejection:            {}", self.false_rejection)?;
        writeln!(f, "unresolved (held/unknown):  {}", self.unresolved)?;
        for k in self.unresolved_keys.iter().take(12) {
            writeln!(f, "  {k}")?;
        }
        if self.unresolved_keys.len() > 12 {
            writeln!(f, "  … {} more", self.unresolved_keys.len() - 12)?;
        }
        writeln!(
            f,
            "recovery latency p50/p99:   {} / {} (n={}, first pending to final answer)",
            ms(self.percentile(0.50)),
            ms(self.percentile(0.99)),
            self.recovery_latencies_ms.len()
        )?;
        writeln!(
            f,
            "verification cost:          {:.3} (lookups + replays) per action",
            self.verification_per_action
        )?;
        writeln!(
            f,
            "worker exits not caused by the soak: {}",
            self.unexpected_exits.len()
        )?;
        // Grouped by the process's last words, so a run with many exits stays readable.
        let mut causes: BTreeMap<String, usize> = BTreeMap::new();
        for e in &self.unexpected_exits {
            let last = e.rsplit(" | ").next().unwrap_or(e);
            let cause = last.split_once("worker: ").map_or(last, |(_, c)| c);
            let cause: String = cause.split(": ").take(2).collect::<Vec<_>>().join(": ");
            *causes.entry(cause).or_default() += 1;
        }
        for (cause, n) in &causes {
            writeln!(f, "  {n} × {cause}")?;
        }
        for e in self.unexpected_exits.iter().take(3) {
            writeln!(f, "  e.g. {e}")?;
        }
        writeln!(
            f,
            "restarted workers that exited during start-up: {}",
            self.startup_exits.len()
        )?;
        for e in self.startup_exits.iter().take(5) {
            writeln!(f, "  {e}")?;
        }
        if self.violations.is_empty() {
            writeln!(f, "invariants: all hold")?;
        } else {
            writeln!(f, "invariants BROKEN: {} violations", self.violations.len())?;
            for v in self.violations.iter().take(40) {
                writeln!(f, "  {v}")?;
            }
            if self.violations.len() > 40 {
                writeln!(f, "  … {} more", self.violations.len() - 40)?;
            }
        }
        Ok(())
    }
}

/// One publish the agent makes.
struct Planned {
    at: Duration,
    tenant: &'static str,
    action_id: String,
    body: Vec<u8>,
    republish: bool,
}

/// A key the agent published, with its tool.
struct Action {
    tenant: &'static str,
    action_id: String,
    cap: Capability,
}

impl Action {
    fn key(&self) -> String {
        format!("{}:{}", self.tenant, self.action_id)
    }
}

/// The soak's tools file: one tool per capability against the reference downstream.
pub fn tools_toml(port: u16) -> String {
    let base = format!("http://127.0.0.1:{port}");
    let common = format!(
        "receipt_id = \"/receipt_id\"\n\
         receipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\n\
         timeout_ms = {TIMEOUT_MS}\n\
         recovery_attempts = 6\n\
         retry = {{ initial_delay_ms = 100, max_delay_ms = 1000, not_applied_statuses = [429] }}\n\
         budget = {{ ratio = 0.5, floor_per_minute = 60 }}\n"
    );
    format!(
        "[tools.refund]\nurl = \"{base}/replay/refunds\"\nrecovery = \"replay\"\n\
         replay_window_secs = 3600\nreplay_safety_margin_secs = 60\n{common}\n\
         [tools.ticket]\nurl = \"{base}/lookup/tickets\"\nrecovery = \"lookup\"\n\
         lookup_url = \"{base}/lookup/tickets/by-key/{{key}}\"\n{common}\n\
         [tools.deploy]\nurl = \"{base}/none/deploys\"\nrecovery = \"none\"\n{common}\n"
    )
}

/// Action ids as the contract allows them, hostile ones included.
fn action_id(rng: &mut fastrand::Rng, i: usize) -> String {
    match rng.u8(..16) {
        0 => format!("brace{{tool}}-{i}"),
        1 => format!("q\"uote'{{key}}-{i}"),
        2 => format!("n-18446744073709551616-{i}"),
        3 => format!("pct%2F/slash?x=1&y=[2]-{i}"),
        _ => format!("act-{i:06}"),
    }
}

fn note(rng: &mut fastrand::Rng) -> &'static str {
    const NOTES: [&str; 5] = [
        "",
        "braces {tenant}:{action_id} and \"quotes\"",
        "unicode: Zürich — 東京 🚀",
        "backslash \\ and \u{2028} separator",
        "plain",
    ];
    NOTES[rng.usize(..NOTES.len())]
}

/// The agent's publishes for one seed, sorted by time.
fn plan(cfg: &SoakConfig, rng: &mut fastrand::Rng) -> (Vec<Action>, Vec<Planned>) {
    let mut actions = Vec::with_capacity(cfg.intents);
    let mut planned = Vec::new();
    let span = cfg.seconds as f64;
    for i in 0..cfg.intents {
        let at = Duration::from_secs_f64(span * i as f64 / cfg.intents as f64);
        let tenant = TENANTS[rng.usize(..TENANTS.len())];
        let cap = Capability::ALL[rng.usize(..3)];
        let action_id = action_id(rng, i);
        let amount = rng.u64(1..1_000_000);
        let note = note(rng);
        let big = rng.u8(..8) == 0;
        let mut arguments =
            json!({"order": format!("order-{i}"), "amount_cents": amount, "note": note});
        if big {
            arguments["big"] = json!(u64::MAX);
        }
        let intent = crate::intent(tenant, &action_id, cap.tool(), arguments);
        planned.push(Planned {
            at,
            tenant,
            action_id: action_id.clone(),
            body: intent.to_json(),
            republish: false,
        });
        // A model repeating itself: same key and meaning, new call id, fields in another
        // order, the amount spelled as a float (equal under RFC 8785).
        if rng.u8(..100) < 15 {
            let s = |v: &str| serde_json::to_string(v).unwrap();
            let big = if big {
                ",\"big\":18446744073709551615"
            } else {
                ""
            };
            let body = format!(
                "{{ \"call_id\": \"again-{i}\", \"arguments\": {{\"note\":{}{big}, \"order\": {}, \"amount_cents\": {amount}.0}}, \"tool\": \"{}\", \"action_id\": {}, \"tenant\": \"{tenant}\" }}",
                s(note),
                s(&format!("order-{i}")),
                cap.tool(),
                s(&action_id)
            );
            planned.push(Planned {
                at: at + Duration::from_millis(rng.u64(100..4000)),
                tenant,
                action_id: action_id.clone(),
                body: body.into_bytes(),
                republish: true,
            });
        }
        actions.push(Action {
            tenant,
            action_id,
            cap,
        });
    }
    planned.sort_by_key(|p| p.at);
    (actions, planned)
}

/// One worker slot: its links and its current process.
struct Slot {
    amqp: FaultProxy,
    pg: FaultProxy,
}

struct Proc {
    worker: Option<Worker>,
    generation: u32,
    restart_at: Instant,
}

struct Fleet {
    env_db_url: String,
    slots: Vec<Slot>,
    procs: Mutex<Vec<Proc>>,
    opts: WorkerOptions,
    unexpected: Mutex<Vec<String>>,
    startup_exits: Mutex<Vec<String>>,
}

impl Fleet {
    fn spawn(&self, env: &Env, i: usize, generation: u32) -> Worker {
        let slot = &self.slots[i];
        let opts = self
            .opts
            .clone()
            .env("DATABASE_URL", &via(&self.env_db_url, slot.pg.addr()))
            .env("AMQP_URL", &via(&env.amqp_url, slot.amqp.addr()));
        Worker::spawn(env, &format!("w{i}g{generation}"), &opts)
    }

    /// Notices exits the soak did not cause and restarts every worker that is down.
    fn supervise(&self, env: &Env) {
        let now = Instant::now();
        let mut procs = self.procs.lock().unwrap();
        for (i, p) in procs.iter_mut().enumerate() {
            if let Some(w) = p.worker.as_mut() {
                if let Some(status) = w.exit_status() {
                    let text = strip_ansi(&w.output.text());
                    let tail: Vec<&str> = text.lines().rev().take(3).collect();
                    let line = format!(
                        "worker {} exited by itself ({status}); last lines: {}",
                        w.name,
                        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                    );
                    // A process that never got going (e.g. restarted while its Postgres link
                    // was cut) fails fast by design; one that was serving must survive a lost
                    // link.
                    if w.output.contains("consuming intents") {
                        self.unexpected.lock().unwrap().push(line);
                    } else {
                        self.startup_exits.lock().unwrap().push(line);
                    }
                    p.worker = None;
                    p.restart_at = now + Duration::from_secs(1);
                }
            }
            if p.worker.is_none() && now >= p.restart_at {
                p.generation += 1;
                p.worker = Some(self.spawn(env, i, p.generation));
            }
        }
    }

    /// SIGKILL; the supervisor restarts it after `down`.
    fn kill(&self, i: usize, down: Duration) -> bool {
        let mut procs = self.procs.lock().unwrap();
        let p = &mut procs[i];
        match p.worker.take() {
            Some(mut w) => {
                w.kill();
                p.restart_at = Instant::now() + down;
                true
            }
            None => false,
        }
    }
}

/// Runs one soak and checks it. `Err` only when the harness itself could not run.
pub async fn run(cfg: &SoakConfig) -> Result<SoakReport> {
    let started = Instant::now();
    let mut rng = fastrand::Rng::with_seed(cfg.seed);
    let (actions, planned) = plan(cfg, &mut rng);
    let mut report = SoakReport {
        config_line: format!(
            "--seed {} --intents {} --seconds {} --workers {} (settle up to {} s)",
            cfg.seed, cfg.intents, cfg.seconds, cfg.workers, cfg.settle_secs
        ),
        ..SoakReport::default()
    };

    let env = Arc::new(Env::new().await);
    let downstream = Downstream::start(&env).await;
    let tools = env.write_tools(&tools_toml(downstream.port));
    let mut opts = WorkerOptions::new(tools);
    opts.lease_secs = LEASE_SECS;
    opts.recovery_interval_ms = 200;
    opts.prefetch = 16;
    let pg_upstream = authority(&env.db_url);
    let amqp_upstream = authority(&env.amqp_url);
    let mut slots = Vec::new();
    for _ in 0..cfg.workers {
        slots.push(Slot {
            amqp: FaultProxy::start(&amqp_upstream).await,
            pg: FaultProxy::start(&pg_upstream).await,
        });
    }
    let fleet = Arc::new(Fleet {
        env_db_url: env.db_url.clone(),
        slots,
        procs: Mutex::new(Vec::new()),
        opts,
        unexpected: Mutex::new(Vec::new()),
        startup_exits: Mutex::new(Vec::new()),
    });
    for i in 0..cfg.workers {
        let w = fleet.spawn(&env, i, 0);
        w.wait_ready().await;
        fleet.procs.lock().unwrap().push(Proc {
            worker: Some(w),
            generation: 0,
            restart_at: Instant::now(),
        });
    }

    // The agent: results first, so no event is missed.
    let events: Arc<Mutex<Vec<ResultEvent>>> = Arc::default();
    let follow_errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let stop_following = Arc::new(AtomicBool::new(false));
    let mut followers = Vec::new();
    for tenant in TENANTS {
        let mut f = Follower::follow(&env.amqp_url, &env.topology.results_exchange, tenant, None)
            .await
            .context("follow results")?;
        let (events, errors, stop) = (
            events.clone(),
            follow_errors.clone(),
            stop_following.clone(),
        );
        followers.push(tokio::spawn(async move {
            loop {
                match f.next(Duration::from_millis(300)).await {
                    Ok(Some(ev)) => events.lock().unwrap().push(ev),
                    Ok(None) if stop.load(Ordering::SeqCst) => break,
                    Ok(None) => {}
                    Err(e) => {
                        errors.lock().unwrap().push(format!("{tenant}: {e}"));
                        if matches!(e, publisher::PublishError::ConsumerClosed) {
                            break;
                        }
                    }
                }
            }
            let _ = f.close().await;
        }));
    }
    let publisher = Publisher::connect(&env.amqp_url, &env.topology.intents_exchange)
        .await
        .context("publisher connect")?;

    // Supervisor.
    let stop_supervising = Arc::new(AtomicBool::new(false));
    let supervisor = {
        let (fleet, stop) = (fleet.clone(), stop_supervising.clone());
        let env = env.clone();
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                fleet.supervise(&env);
                sleep(Duration::from_millis(200)).await;
            }
        })
    };

    // Publishing and chaos run side by side for `seconds`.
    let t0 = Instant::now();
    let publishing = async {
        let mut errors = Vec::new();
        let mut counts = (0usize, 0usize);
        for p in &planned {
            tokio::time::sleep_until(t0 + p.at).await;
            let mut sent = false;
            for _ in 0..5 {
                match publisher
                    .publish_encoded(p.tenant, &p.action_id, &p.body)
                    .await
                {
                    Ok(()) => {
                        sent = true;
                        break;
                    }
                    Err(e) => {
                        errors.push(format!("{}:{}: {e}", p.tenant, p.action_id));
                        sleep(Duration::from_millis(200)).await;
                    }
                }
            }
            if sent {
                if p.republish {
                    counts.1 += 1;
                } else {
                    counts.0 += 1;
                }
            }
        }
        (counts, errors)
    };
    let chaos = chaos(
        cfg,
        fastrand::Rng::with_seed(cfg.seed ^ 0x9e37_79b9_7f4a_7c15),
        &fleet,
        &downstream,
        t0,
        &mut report,
    );
    let (((published, republished), publish_errors), ()) = tokio::join!(publishing, chaos);
    report.published = published;
    report.republished = republished;

    // Faults stop: links restored, the fault book emptied; the supervisor keeps every worker
    // up.
    for s in &fleet.slots {
        s.amqp.restore();
        s.pg.restore();
    }
    let _ = crate::http()
        .delete(format!(
            "http://127.0.0.1:{}/_control/faults",
            downstream.port
        ))
        .send()
        .await;

    let settle_started = Instant::now();
    report.settled = settle(&env, &actions, &events, cfg.settle_secs).await;
    report.settle_time = settle_started.elapsed();
    stop_supervising.store(true, Ordering::SeqCst);
    let _ = supervisor.await;
    stop_following.store(true, Ordering::SeqCst);
    for f in followers {
        let _ = f.await;
    }
    let _ = publisher.close().await;

    let events = std::mem::take(&mut *events.lock().unwrap());
    report.unexpected_exits = std::mem::take(&mut *fleet.unexpected.lock().unwrap());
    report.startup_exits = std::mem::take(&mut *fleet.startup_exits.lock().unwrap());
    check(&env, &actions, &events, &mut report).await?;
    for e in publish_errors.iter().take(5) {
        report
            .violations
            .push(format!("agent could not publish: {e}"));
    }
    for e in follow_errors.lock().unwrap().iter().take(5) {
        report
            .violations
            .push(format!("agent could not read results: {e}"));
    }

    // Workers go before the database they use.
    for p in fleet.procs.lock().unwrap().iter_mut() {
        if let Some(mut w) = p.worker.take() {
            w.kill();
        }
    }
    drop(downstream);
    drop(fleet);
    match Arc::try_unwrap(env) {
        Ok(env) => cleanup(env).await,
        // Still shared (cannot happen once the supervisor ended): `Env`'s drop cleans up.
        Err(env) => drop(env),
    }
    report.elapsed = started.elapsed();
    Ok(report)
}

/// `host:port` of a URL.
fn authority(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let hostpath = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    hostpath.split('/').next().unwrap_or(hostpath).to_string()
}

/// The seeded fault schedule, until `seconds` after `t0`.
async fn chaos(
    cfg: &SoakConfig,
    mut rng: fastrand::Rng,
    fleet: &Arc<Fleet>,
    downstream: &Downstream,
    t0: Instant,
    report: &mut SoakReport,
) {
    let end = t0 + Duration::from_secs(cfg.seconds);
    let http = crate::http();
    let faults_url = format!("http://127.0.0.1:{}/_control/faults", downstream.port);
    let secs = |rng: &mut fastrand::Rng, lo: f64, hi: f64| {
        Duration::from_secs_f64(lo + rng.f64() * (hi - lo))
    };
    loop {
        let gap = secs(&mut rng, 0.3, 1.8);
        if Instant::now() + gap >= end {
            break;
        }
        sleep(gap).await;
        let i = rng.usize(..cfg.workers);
        match rng.u8(..12) {
            0 | 1 => {
                if fleet.kill(i, secs(&mut rng, 0.3, 2.0)) {
                    report.kills += 1;
                }
            }
            2..=4 => {
                let slot = &fleet.slots[i];
                let (link, blackhole) = (rng.bool(), rng.u8(..4) == 0);
                let proxy = if link { &slot.amqp } else { &slot.pg };
                if blackhole {
                    proxy.blackhole();
                    report.link_blackholes += 1;
                } else {
                    proxy.cut();
                    report.link_cuts += 1;
                }
                let hold = secs(&mut rng, 1.0, 5.0);
                let fleet = fleet.clone();
                tokio::spawn(async move {
                    sleep(hold).await;
                    let slot = &fleet.slots[i];
                    if link {
                        slot.amqp.restore();
                    } else {
                        slot.pg.restore();
                    }
                });
            }
            _ => {
                let times = rng.u32(1..4);
                let spec = match rng.u8(..11) {
                    0 | 1 => json!({"kind": "drop_after_commit", "times": times}),
                    2 => json!({"kind": "drop_before_commit", "times": times}),
                    3 => json!({"kind": "slow", "times": times, "delay_ms": rng.u64(200..2500)}),
                    4 => json!({"kind": "slow_after_commit", "times": times,
                                "delay_ms": rng.u64(500..3000)}),
                    5 => json!({"kind": "status", "times": times, "status": 503}),
                    6 => json!({"kind": "status", "times": times, "status": 429,
                                "retry_after": "1"}),
                    7 => json!({"kind": "status_after_commit", "times": times, "status": 500}),
                    8 => json!({"kind": "status", "times": 1, "status": 403}),
                    9 => json!({"kind": "wrong_receipt", "times": 1}),
                    _ => json!({"kind": "lookup_miss", "times": times}),
                };
                let label = match spec["kind"].as_str() {
                    Some("status") => format!("status_{}", spec["status"]),
                    Some(k) => k.to_string(),
                    None => "?".into(),
                };
                let ok = http
                    .post(&faults_url)
                    .header("content-type", "application/json")
                    .body(spec.to_string())
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                if ok {
                    *report.downstream_faults.entry(label).or_default() += 1;
                }
            }
        }
    }
}

/// Waits until every key has a row, none is still moving (`prepared`, `dispatching`,
/// `retry_wait`, `unknown`), the outbox is published and the agent holds an event for every
/// key; or until `settle_secs` passed. Returns whether it settled.
async fn settle(
    env: &Env,
    actions: &[Action],
    events: &Mutex<Vec<ResultEvent>>,
    settle_secs: u64,
) -> bool {
    let deadline = Instant::now() + Duration::from_secs(settle_secs);
    loop {
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM operations")
            .fetch_one(&env.pool)
            .await
            .unwrap_or(0);
        let moving: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM operations
             WHERE state IN ('prepared', 'dispatching', 'retry_wait', 'unknown')",
        )
        .fetch_one(&env.pool)
        .await
        .unwrap_or(1);
        let unpublished: i64 =
            sqlx::query_scalar("SELECT count(*) FROM result_outbox WHERE published_at IS NULL")
                .fetch_one(&env.pool)
                .await
                .unwrap_or(1);
        let answered = {
            let ev = events.lock().unwrap();
            let keys: std::collections::HashSet<(&str, &str)> = ev
                .iter()
                .map(|e| (e.tenant.as_str(), e.action_id.as_str()))
                .collect();
            actions
                .iter()
                .filter(|a| keys.contains(&(a.tenant, a.action_id.as_str())))
                .count()
        };
        if rows as usize >= actions.len()
            && moving == 0
            && unpublished == 0
            && answered == actions.len()
        {
            // Events already published may still be on their way to the agent.
            sleep(Duration::from_secs(1)).await;
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        sleep(Duration::from_millis(500)).await;
    }
}

#[derive(sqlx::FromRow)]
struct LedgerRow {
    tenant: String,
    action_id: String,
    state: String,
    receipt: Option<Value>,
    evidence: Option<String>,
}

#[derive(sqlx::FromRow)]
struct DownstreamKey {
    idem_key: String,
    mutations: i64,
    first_receipt: Option<Value>,
    writes: i64,
    lookups: i64,
    /// HTTP status of each write request in arrival order (`None`: dropped on purpose).
    write_statuses: Vec<Option<i32>>,
}

/// The invariants and measures, from the downstream's tables, the ledger and the events.
async fn check(
    env: &Env,
    actions: &[Action],
    events: &[ResultEvent],
    report: &mut SoakReport,
) -> Result<()> {
    let ledger: Vec<LedgerRow> =
        sqlx::query_as("SELECT tenant, action_id, state, receipt, evidence FROM operations")
            .fetch_all(&env.pool)
            .await
            .context("read the ledger")?;
    let ledger: HashMap<(String, String), LedgerRow> = ledger
        .into_iter()
        .map(|r| ((r.tenant.clone(), r.action_id.clone()), r))
        .collect();
    let downstream: Vec<DownstreamKey> = sqlx::query_as(
        "WITH m AS (
             SELECT idem_key, count(*) AS mutations,
                    (array_agg(receipt ORDER BY id))[1] AS first_receipt
             FROM downstream.mutations WHERE idem_key IS NOT NULL GROUP BY idem_key),
         r AS (
             SELECT idem_key, count(*) FILTER (WHERE kind = 'write') AS writes,
                    coalesce(array_agg(status ORDER BY id) FILTER (WHERE kind = 'write'),
                             '{}') AS write_statuses,
                    count(*) FILTER (WHERE kind = 'lookup') AS lookups
             FROM downstream.requests WHERE idem_key IS NOT NULL GROUP BY idem_key)
         SELECT coalesce(m.idem_key, r.idem_key) AS idem_key,
                coalesce(m.mutations, 0) AS mutations, m.first_receipt,
                coalesce(r.writes, 0) AS writes, coalesce(r.lookups, 0) AS lookups,
                coalesce(r.write_statuses, '{}') AS write_statuses
         FROM m FULL JOIN r ON m.idem_key = r.idem_key",
    )
    .fetch_all(&env.pool)
    .await
    .context("read the downstream's tables")?;
    let downstream: HashMap<String, DownstreamKey> = downstream
        .into_iter()
        .map(|d| (d.idem_key.clone(), d))
        .collect();
    let mut by_key: HashMap<(&str, &str), Vec<&ResultEvent>> = HashMap::new();
    for e in events {
        by_key
            .entry((e.tenant.as_str(), e.action_id.as_str()))
            .or_default()
            .push(e);
    }
    report.events = events.len();

    let mut verification = 0i64;
    for a in actions {
        let key = a.key();
        let figures = report.per_capability.entry(a.cap).or_default();
        figures.actions += 1;
        let ds = downstream.get(&key);
        let mutations = ds.map_or(0, |d| d.mutations);
        let stored = ds.and_then(|d| d.first_receipt.as_ref());
        figures.mutations += mutations;
        figures.writes += ds.map_or(0, |d| d.writes);
        figures.lookups += ds.map_or(0, |d| d.lookups);
        verification += ds.map_or(0, |d| d.lookups);
        if a.cap == Capability::Replay {
            verification += ds.map_or(0, |d| (d.writes - 1).max(0));
        }
        // Without replay, a write may follow another only if that one was proven not applied
        // (here: 429, the tools' only `not_applied_statuses`); after anything else (a dropped
        // reply, a 5xx, an answer the worker no longer waited for) a second send is unsafe even
        // when it happened not to duplicate.
        if a.cap != Capability::Replay {
            let statuses = ds.map_or(&[][..], |d| &d.write_statuses[..]);
            let unsafe_resend = statuses
                .split_last()
                .is_some_and(|(_, before)| before.iter().any(|s| *s != Some(429)));
            if unsafe_resend {
                report.unsafe_resends += 1;
                report.violations.push(format!(
                    "unsafe resend: {key} ({}) was written again after an attempt not proven unapplied; statuses in order: {:?}",
                    a.cap.as_str(),
                    statuses
                ));
            }
        }
        if mutations > 1 {
            figures.duplicate_keys += 1;
            report.duplicate_mutations += mutations - 1;
            report.violations.push(format!(
                "duplicate: {key} ({}) has {mutations} mutations",
                a.cap.as_str()
            ));
        }
        let row = ledger.get(&(a.tenant.to_string(), a.action_id.clone()));
        let evs = by_key
            .get(&(a.tenant, a.action_id.as_str()))
            .cloned()
            .unwrap_or_default();
        match row {
            None => {
                report.lost += 1;
                report
                    .violations
                    .push(format!("lost: {key} has no ledger row"));
            }
            Some(_) if evs.is_empty() => {
                report.lost += 1;
                report
                    .violations
                    .push(format!("lost: {key} has no result event"));
            }
            Some(_) => {}
        }
        // Each key counts once per broken invariant; every piece of evidence is listed.
        let (mut false_success, mut false_failure, mut false_rejection) = (false, false, false);
        if let Some(row) = row {
            match row.state.as_str() {
                "succeeded" => {
                    figures.succeeded += 1;
                    if mutations == 0 || row.receipt.as_ref() != stored {
                        false_success = true;
                        report.violations.push(format!(
                            "false success: ledger row {key} is succeeded with receipt {} but the downstream stored {} ({mutations} mutations)",
                            short(row.receipt.as_ref()),
                            short(stored)
                        ));
                    }
                }
                "failed" => {
                    figures.failed += 1;
                    if mutations > 0 {
                        false_failure = true;
                        report.violations.push(format!(
                            "false failure: ledger row {key} ({}) is failed but the downstream applied it ({mutations} mutations)",
                            a.cap.as_str()
                        ));
                    }
                }
                other => {
                    figures.unresolved += 1;
                    report.unresolved += 1;
                    let evidence = row.evidence.as_deref().unwrap_or("");
                    report.unresolved_keys.push(format!(
                        "{key} ({}) {other}: {}",
                        a.cap.as_str(),
                        evidence.chars().take(160).collect::<String>()
                    ));
                }
            }
        }
        let mut sorted = evs.clone();
        sorted.sort_by(|x, y| x.occurred_at.cmp(&y.occurred_at));
        for e in &sorted {
            match e.status {
                Status::Succeeded if mutations == 0 || e.receipt.as_ref() != stored => {
                    false_success = true;
                    report.violations.push(format!(
                        "false success: event {} for {key} carries receipt {} but the downstream stored {} ({mutations} mutations)",
                        e.event_id,
                        short(e.receipt.as_ref()),
                        short(stored)
                    ));
                }
                Status::Failed if mutations > 0 => {
                    false_failure = true;
                    report.violations.push(format!(
                        "false failure: event {} for {key} ({}) says failed ({:?}) but the downstream applied it",
                        e.event_id,
                        a.cap.as_str(),
                        e.message
                    ));
                }
                Status::Rejected => {
                    false_rejection = true;
                    report.violations.push(format!(
                        "false rejection: event {} for valid intent {key}: {:?} {:?}",
                        e.event_id, e.reason, e.message
                    ));
                }
                _ => {}
            }
        }
        if let Some(row) = row.filter(|r| matches!(r.state.as_str(), "succeeded" | "failed")) {
            let told = sorted.iter().any(|e| e.status.as_str() == row.state);
            if !told {
                report.lost_answers += 1;
                report.violations.push(format!(
                    "lost answer: {key} is {} in the ledger but the agent never received that answer (it got {:?})",
                    row.state,
                    sorted.iter().map(|e| e.status.as_str()).collect::<Vec<_>>()
                ));
            }
        }
        report.false_success += usize::from(false_success);
        report.false_failure += usize::from(false_failure);
        report.false_rejection += usize::from(false_rejection);
        // Recovery latency: the first `pending` to the first final answer after it.
        let pending = sorted.iter().find(|e| e.status == Status::Pending);
        let answer = pending.and_then(|p| {
            sorted.iter().find(|e| {
                matches!(e.status, Status::Succeeded | Status::Failed)
                    && e.occurred_at >= p.occurred_at
            })
        });
        if let (Some(p), Some(f)) = (pending, answer) {
            if let (Ok(p), Ok(f)) = (
                chrono::DateTime::parse_from_rfc3339(&p.occurred_at),
                chrono::DateTime::parse_from_rfc3339(&f.occurred_at),
            ) {
                report
                    .recovery_latencies_ms
                    .push((f - p).num_milliseconds());
            }
        }
    }
    report.recovery_latencies_ms.sort_unstable();
    report.verification_per_action = verification as f64 / actions.len().max(1) as f64;
    for e in &report.unexpected_exits {
        report
            .violations
            .push(format!("worker exit not caused by the soak: {e}"));
    }
    Ok(())
}

fn short(v: Option<&Value>) -> String {
    let mut s = String::new();
    match v {
        None => s.push_str("none"),
        Some(v) => {
            let text = v.to_string();
            let _ = write!(s, "{}", text.chars().take(120).collect::<String>());
        }
    }
    s
}

/// `text` without terminal colour sequences (`ESC [ … letter`).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
