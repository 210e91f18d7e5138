//! Chaos soak: real worker processes whose broker and
//! Postgres links each run through their own [`FaultProxy`]; a seeded schedule of SIGKILLs
//! (the soak restarts killed workers as a supervisor would), link cuts and black holes, and
//! downstream faults (replies lost before or after the commit, late replies, 5xx/4xx/429,
//! wrong receipts, lookup misses, or lookup errors where the lookup tool declares
//! `absence_proof`, whose contract a false miss would break); an agent publishing intents for tools of all three
//! capabilities (some repeated under the same key, reordered, with other number spellings)
//! and reading its result events from queues bound to its tenants. After the faults stop and
//! a settle period (no operator acts), the invariants are checked from the downstream's own
//! tables, the ledger and the events the agent received, and the seeds' measures are
//! computed.
//!
//! Two of the tools are long-running (`completion = "async"`, one recovered by replay, one by
//! lookup by key): their write is accepted (202 and an operation id) and the worker polls the
//! job's status URL. Each async action's job is planned by the seed and armed at the downstream
//! as job faults keyed by its key: a run spread around the poll schedule, some ending failed,
//! some hidden (status 404) for a while after acceptance, and a few that never end (only where
//! the poll deadline falls before the faults end, so the settle sees them held). The chaos adds
//! status-read faults (5xx, flapping, slow, dropped, another operation's document) to the rest.
//! Checked from the downstream's `async_jobs` and request log: one job per key, never
//! `succeeded` before the job ended succeeded (nor before an answer sent after its end), with
//! its final status document as the receipt; never `failed` unless it ended failed (or was
//! never applied); held only at the poll deadline of a job that never ends; none left
//! `accepted`.
//!
//! With [`SoakConfig::pg_failover`] the ledger lives on a Postgres primary and synchronous
//! standby of the soak's own ([`PgPair`]); every worker is given both hosts (libpq's multi-host
//! `DATABASE_URL`, no proxy: the Postgres link faults are left out, the others stay). At seeded
//! moments the primary is stopped hard and the standby promoted, and later the old primary
//! rejoins as the standby and a switchover brings the primary back; the soak measures how long
//! the workers take to be ready on each new primary. The downstream's tables stay on the shared
//! Postgres.
//!
//! With [`SoakConfig::cluster`] the broker is a 3-node RabbitMQ cluster of the soak's own
//! ([`RabbitCluster`]); every worker is given the three nodes' URLs (no proxy: the broker link
//! faults are left out, the others stay). At seeded moments one of the two nodes the agent does
//! not use is SIGKILLed — the leader of the intents queue when it is one of them — and started
//! again a few seconds later; the soak measures how long the live workers take to be ready again after each loss.
//! The agent publishes and reads its results through one node that is never killed (its results
//! queues are not replicated): node 2, or node 0 when node 2 leads the intents queue once the
//! workers declared it, so that the leader can be lost. One node down at a time never costs the
//! cluster its quorum.
//!
//! Shared by the `soak` binary (long runs), `tests/tests/suites/soak_short.rs` (a short seeded run in
//! the test command), `tests/tests/suites/soak_failover.rs` (the same with a failover) and
//! `tests/tests/suites/soak_cluster.rs` (the same on a cluster).

use std::collections::{BTreeMap, HashMap};
use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, Result};
use chrono::{DateTime, Utc};
use protocol::{ResultEvent, Status};
use publisher::{Follower, Publisher};
use serde_json::{json, Value};
use sqlx::postgres::{PgPool, PgPoolOptions};
use tokio::time::{sleep, Instant};

use crate::pg_failover::{PgPair, PgPairOptions};
use crate::procs::Output;
use crate::rabbit_cluster::{RabbitCluster, RabbitClusterOptions};
use crate::{cleanup, via, Downstream, Env, FaultProxy, Worker, WorkerOptions};

/// The agent's tenants (one with a dot and an underscore, as the contract allows).
pub const TENANTS: [&str; 2] = ["soak-north", "soak.south_2"];
/// Worker lease: longer than a tool's whole timeout, short enough to recover quickly.
const LEASE_SECS: u64 = 5;
/// Tool request timeout; `slow` faults straddle it.
const TIMEOUT_MS: u64 = 1500;
/// Longest wait for the workers to be ready on a new primary before it counts as a violation.
const RESUME_CAP: Duration = Duration::from_secs(60);
/// How long before a delivered answer a SIGKILL of its receiver still counts as having lost it.
const KILL_RACE: chrono::TimeDelta = chrono::TimeDelta::milliseconds(100);
/// The async tools' poll schedule: the first poll about `FIRST` after the acceptance, then
/// about as long after the previous one as the operation is old, at most `MAX` (±50 % jitter).
const ASYNC_POLL_FIRST_MS: u64 = 200;
const ASYNC_POLL_MAX_MS: u64 = 1500;
/// The async tools' poll deadline: an accepted job not seen done or failed by then is held
/// (`async_deadline`). Far above the longest planned job ([`ASYNC_MAX_DELAY_MS`], its status
/// hidden at most [`ASYNC_MAX_HIDDEN_MS`]) plus the longest outage the chaos causes (a worker
/// SIGKILLed while it leased the row: [`LEASE_SECS`]; a link cut: up to 5 s), so that only a
/// job planned stuck reaches it; stuck jobs are planned only where the settle reaches it.
pub const ASYNC_DEADLINE_SECS: u64 = 12;
/// Longest planned run of an async job (delays are spread around the poll schedule).
const ASYNC_MAX_DELAY_MS: u64 = 4000;
/// Longest planned `status_not_found` window (the status URL answers 404 after acceptance).
const ASYNC_MAX_HIDDEN_MS: u64 = 2500;
/// How far the downstream's timestamps (its clock, its process) may be compared with the
/// ledger's and the worker's (the same host clock, other processes and transactions).
const CLOCK_TOLERANCE: chrono::TimeDelta = chrono::TimeDelta::milliseconds(100);

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
    /// The ledger on a primary and synchronous standby of the soak's own, failed over and
    /// switched back during the faults (see the module doc).
    pub pg_failover: bool,
    /// The broker a 3-node cluster of the soak's own, nodes SIGKILLed and restarted during the
    /// faults (see the module doc).
    pub cluster: bool,
    /// The lookup tool `ticket` declares `absence_proof` (docs/recovery.md, "Proof of
    /// absence"): a lookup miss after its writes' deadline sends the write again instead of
    /// holding it.
    pub absence_proof: bool,
}

impl Default for SoakConfig {
    fn default() -> Self {
        SoakConfig {
            seed: 1,
            intents: 300,
            seconds: 60,
            workers: 2,
            settle_secs: 60,
            pg_failover: false,
            cluster: false,
            absence_proof: true,
        }
    }
}

/// What the failover of [`SoakConfig::pg_failover`] did and how the workers followed.
#[derive(Debug, Clone, Default)]
pub struct FailoverFigures {
    /// Seconds into the faults at which the primary was stopped hard.
    pub failed_at: Duration,
    /// `pg_ctl promote` until the standby left recovery.
    pub promote_took: Duration,
    /// From the promotion until every live worker was ready on the new primary (`None`: not
    /// within the cap).
    pub resume_after_promotion: Option<Duration>,
    /// Seconds into the faults at which the old primary began to rejoin.
    pub rejoined_at: Duration,
    /// `rejoin_as_standby` (pg_rewind, start, streaming, sync) of the old primary.
    pub rejoin_took: Duration,
    pub rewound: bool,
    /// The switchover back (clean stop, replay, promote, rejoin).
    pub switchover_took: Duration,
    /// From the end of the switchover until every live worker was ready on the primary.
    pub resume_after_switchover: Option<Duration>,
}

/// The node the agent uses in [`SoakConfig::cluster`] mode (and never killed) unless it leads
/// the intents queue once the workers declared it: then the next one.
const AGENT_NODE: usize = 2;
/// The workers' AMQP heartbeat in cluster mode: a paused node (12–16 s) is noticed after two.
const CLUSTER_HEARTBEAT_SECS: &str = "4";
/// The workers' connection timeout per node in cluster mode.
const CLUSTER_CONNECT_TIMEOUT_MS: u64 = 2000;

/// One node loss of [`SoakConfig::cluster`] mode.
#[derive(Debug, Clone)]
pub struct NodeLoss {
    /// Seconds into the faults at which the node was SIGKILLed (or SIGSTOPped).
    pub at: Duration,
    /// One of [`LOSS_KINDS`].
    pub kind: &'static str,
    pub node: usize,
    /// The other node of a two-node window.
    pub second: Option<usize>,
    /// Whether it led the intents queue then.
    pub was_leader: bool,
    /// SIGSTOPped for this long (a partitioned node, not a dead one) rather than SIGKILLed.
    pub paused: Option<Duration>,
    /// From the loss until every live worker was ready again (`None`: not within the cap).
    pub resume: Option<Duration>,
    /// From the loss until the agent received the first `succeeded` answer to an intent it
    /// first published after the loss: consumption resumed (`None`: none by the end).
    pub consumed: Option<Duration>,
    /// How long the node took to start and rejoin (0 for a pause).
    pub restart_took: Duration,
    /// When the loss began, for [`NodeLoss::consumed`].
    lost_at: Instant,
}

/// A tool's recovery capability and completion; each has one tool in the soak's tools file.
/// The async ones are long-running (`completion = "async"`): their write is accepted (202 with
/// an operation id) and the worker polls the job's status URL until it is done, failed, or past
/// the poll deadline ([`ASYNC_DEADLINE_SECS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Capability {
    Replay,
    Lookup,
    None,
    /// Async, a lost acceptance recovered by replaying the write under the same key (the
    /// downstream answers a repeat with the same operation).
    AsyncReplay,
    /// Async, a lost acceptance recovered by a lookup by key (which may find the job still
    /// running: an acceptance too).
    AsyncLookup,
}

impl Capability {
    pub const ALL: [Capability; 5] = [
        Capability::Replay,
        Capability::Lookup,
        Capability::None,
        Capability::AsyncReplay,
        Capability::AsyncLookup,
    ];

    pub fn tool(self) -> &'static str {
        match self {
            Capability::Replay => "refund",
            Capability::Lookup => "ticket",
            Capability::None => "deploy",
            Capability::AsyncReplay => "rollout",
            Capability::AsyncLookup => "export",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Capability::Replay => "replay",
            Capability::Lookup => "lookup",
            Capability::None => "none",
            Capability::AsyncReplay => "async-replay",
            Capability::AsyncLookup => "async-lookup",
        }
    }

    /// A long-running tool (`completion = "async"`).
    pub fn is_async(self) -> bool {
        matches!(self, Capability::AsyncReplay | Capability::AsyncLookup)
    }

    /// Recovered by replaying the write: a second write under the key is allowed.
    pub fn replays(self) -> bool {
        matches!(self, Capability::Replay | Capability::AsyncReplay)
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

/// What the async tools' jobs did, as the downstream's `async_jobs` and request log have it,
/// and how the worker followed them (ledger, `operation_history`, result events).
#[derive(Debug, Clone, Default)]
pub struct AsyncFigures {
    /// Async actions published (distinct keys).
    pub actions: usize,
    /// Job faults armed per kind (`async_delay`, `async_fail`, `async_stuck`,
    /// `status_not_found`), keyed by the action's key.
    pub planned: BTreeMap<String, usize>,
    /// Jobs the downstream created, by how they end (`succeeded`, `failed`, `stuck`).
    pub jobs: BTreeMap<String, usize>,
    /// Jobs whose status URL answered 404 for a while after creation.
    pub hidden: usize,
    /// Keys with more than one job (target 0). The downstream keeps one job per key (a repeat
    /// finds the first one), so a second job-creating write would show here only if that
    /// guard broke; the worker's repeated writes are counted as writes and mutations.
    pub duplicate_jobs: usize,
    /// Status reads (polls) of every job, and the most any one job had.
    pub polls: i64,
    pub max_polls: i64,
    /// First acceptance in the ledger to the final state, per async action that got both (ms).
    pub accepted_to_final_ms: Vec<i64>,
    /// The job's end at the downstream to the worker's final state (succeeded or failed), per
    /// ended job (ms): how soon the poll schedule noticed.
    pub end_to_final_ms: Vec<i64>,
    /// `verified_by` of the final answers the agent received for async actions.
    pub verified_by: BTreeMap<String, usize>,
    /// Rows held at the poll deadline for a job that never ends (expected, checked).
    pub held_at_deadline: usize,
    /// Rows held at the poll deadline for a job that ended, where the worker kept reading its
    /// status after the end and no read got a true answer before the hold (every one refused or
    /// dropped by a fault): nobody could know the end, so the hold is honest (checked).
    pub held_end_unanswered: usize,
    /// Async rows held at the poll deadline for a job that ended and whose end a status read
    /// answered before the hold, or held before the deadline (violations).
    pub held_not_planned: usize,
    /// Async rows still `accepted` after the settle (violations).
    pub still_accepted: usize,
    /// Async actions settled `succeeded` or `failed` (ledger or event) in agreement with their
    /// job, but before any true answer sent after the job's end had been delivered: read from
    /// another operation's document (violations).
    pub unproven: usize,
    /// Async actions whose agent was told (a `pending` event's `remote_id`) an operation id
    /// that is not its job's.
    pub misdirected: usize,
}

/// The `p` percentile of sorted `v`.
fn percentile(v: &[i64], p: f64) -> Option<i64> {
    if v.is_empty() {
        return None;
    }
    let idx = ((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1;
    Some(v[idx])
}

/// What the soak did and found.
#[derive(Debug, Clone, Default)]
pub struct SoakReport {
    pub config_line: String,
    pub published: usize,
    pub republished: usize,
    /// Publish attempts that failed and were sent again, same key, through another node
    /// (cluster mode: a node loss, or a confirm lost with its node).
    pub publish_retries: usize,
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
    /// `held`/`unknown` keys with a committed mutation whose true answer (a 2xx with the
    /// stored receipt) the downstream delivered to a worker that was not killed before it
    /// recorded it: the worker had the proof and still did not settle (target 0).
    pub avoidable_holds: usize,
    /// The same, but every such answer went to a worker the soak SIGKILLed before that worker
    /// wrote anything more to the row: the proof died with the process (not a violation).
    pub holds_lost_with_a_killed_worker: usize,
    /// `key (tool) state: receivers` of every hold above, avoidable or not.
    pub held_with_answer_keys: Vec<String>,
    /// Set in [`SoakConfig::pg_failover`] mode.
    pub failover: Option<FailoverFigures>,
    /// Set in [`SoakConfig::cluster`] mode.
    pub node_losses: Vec<NodeLoss>,
    /// Long-running operations of the async tools.
    pub async_figures: AsyncFigures,
    pub settled: bool,
    /// What was still outstanding at the settle cap, when it did not settle.
    pub settle_outstanding: Option<String>,
    /// From the end of the faults to settled (or to the settle cap).
    pub settle_time: Duration,
    pub elapsed: Duration,
    /// Every broken invariant, one line each.
    pub violations: Vec<String>,
}

impl SoakReport {
    fn percentile(&self, p: f64) -> Option<i64> {
        percentile(&self.recovery_latencies_ms, p)
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
        if self.publish_retries > 0 {
            writeln!(
                f,
                "  publish attempts that failed and were sent again (same key, next node): {}",
                self.publish_retries
            )?;
        }
        if let Some(outstanding) = &self.settle_outstanding {
            writeln!(f, "  not settled: {outstanding}")?;
        }
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
            "{:<12} {:>7} {:>9} {:>6} {:>10} {:>10} {:>9} {:>6} {:>7}",
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
                "{:<12} {:>7} {:>9} {:>6} {:>10} {:>10} {:>9} {:>6} {:>7}",
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
        let a = &self.async_figures;
        if a.actions > 0 {
            let list = |m: &BTreeMap<String, usize>| {
                m.iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            let jobs: usize = a.jobs.values().sum();
            writeln!(
                f,
                "async: {} actions, {jobs} jobs ({}; {} with a 404 window), duplicate jobs {}; armed: {}",
                a.actions,
                list(&a.jobs),
                a.hidden,
                a.duplicate_jobs,
                list(&a.planned)
            )?;
            writeln!(
                f,
                "  polls (status reads): {}, {:.1} per job (most {}); verified by: {}",
                a.polls,
                a.polls as f64 / jobs.max(1) as f64,
                a.max_polls,
                list(&a.verified_by)
            )?;
            let mut acc = a.accepted_to_final_ms.clone();
            acc.sort_unstable();
            let mut end = a.end_to_final_ms.clone();
            end.sort_unstable();
            writeln!(
                f,
                "  accepted → final p50/p99: {} / {} (n={}); job end → worker's final p50/p99: {} / {} (n={})",
                ms(percentile(&acc, 0.50)),
                ms(percentile(&acc, 0.99)),
                acc.len(),
                ms(percentile(&end, 0.50)),
                ms(percentile(&end, 0.99)),
                end.len()
            )?;
            writeln!(
                f,
                "  held at the poll deadline: {} (jobs that never end: {}); of a job that ended, every status read after its end refused: {}; held otherwise at a deadline: {}; still accepted after the settle: {}; agent told another operation id: {}",
                a.held_at_deadline,
                a.jobs.get("stuck").copied().unwrap_or(0),
                a.held_end_unanswered,
                a.held_not_planned,
                a.still_accepted,
                a.misdirected
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
        writeln!(
            f,
            "unproven async verdicts:    {} (true, but read before any true answer after the job's end)",
            self.async_figures.unproven
        )?;
        writeln!(f, "false rejection:            {}", self.false_rejection)?;
        writeln!(
            f,
            "unresolved (held/unknown):  {} ({} of them held at the poll deadline of a job that never ends, as planned)",
            self.unresolved, self.async_figures.held_at_deadline
        )?;
        for k in self.unresolved_keys.iter().take(12) {
            writeln!(f, "  {k}")?;
        }
        if self.unresolved_keys.len() > 12 {
            writeln!(f, "  … {} more", self.unresolved_keys.len() - 12)?;
        }
        writeln!(
            f,
            "avoidable holds:            {} (answer delivered, still held/unknown; {} more whose answer went to a worker SIGKILLed before it recorded it)",
            self.avoidable_holds, self.holds_lost_with_a_killed_worker
        )?;
        for k in self.held_with_answer_keys.iter().take(12) {
            writeln!(f, "  {k}")?;
        }
        if let Some(fo) = &self.failover {
            let dur = |d: Option<Duration>| {
                d.map_or(format!("not within {} s", RESUME_CAP.as_secs()), |d| {
                    format!("{} ms", d.as_millis())
                })
            };
            writeln!(
                f,
                "pg failover: resume after promotion {}, after switchover {}",
                dur(fo.resume_after_promotion),
                dur(fo.resume_after_switchover)
            )?;
            writeln!(
                f,
                "  primary stopped hard at {:.1} s, promote {} ms; rejoin at {:.1} s took {} ms ({}); switchover {} ms",
                fo.failed_at.as_secs_f64(),
                fo.promote_took.as_millis(),
                fo.rejoined_at.as_secs_f64(),
                fo.rejoin_took.as_millis(),
                if fo.rewound { "pg_rewind rewound" } else { "no rewind needed" },
                fo.switchover_took.as_millis()
            )?;
        }
        for loss in &self.node_losses {
            writeln!(
                f,
                "{} at {:.1} s: node {}{}, live workers ready again {}, first success of an intent published after it {}; {}",
                loss.kind,
                loss.at.as_secs_f64(),
                match loss.second {
                    Some(second) => format!("{} and {second}", loss.node),
                    None => loss.node.to_string(),
                },
                if loss.was_leader {
                    " (the intents queue's leader)"
                } else {
                    ""
                },
                loss.resume.map_or(
                    format!("not within {} s", RESUME_CAP.as_secs()),
                    |d| format!("after {} ms", d.as_millis())
                ),
                loss.consumed
                    .map_or("never".to_string(), |d| format!("after {} ms", d.as_millis())),
                match loss.paused {
                    Some(p) => format!("SIGCONT after {} ms", p.as_millis()),
                    None => format!("restarted in {} ms", loss.restart_took.as_millis()),
                }
            )?;
        }
        if !self.node_losses.is_empty() {
            let mut consumed: Vec<i64> = self
                .node_losses
                .iter()
                .filter_map(|l| l.consumed.map(|d| d.as_millis() as i64))
                .collect();
            consumed.sort_unstable();
            writeln!(
                f,
                "resume (first success after a loss) p50/p99/max: {} / {} / {} (n={} of {} losses)",
                ms(percentile(&consumed, 0.50)),
                ms(percentile(&consumed, 0.99)),
                ms(consumed.last().copied()),
                consumed.len(),
                self.node_losses.len()
            )?;
        }
        writeln!(
            f,
            "recovery latency p50/p99:   {} / {} (n={}, first pending to final answer, sync tools)",
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

/// A key the agent published, with its tool (and the job planned for an async one).
struct Action {
    tenant: &'static str,
    action_id: String,
    cap: Capability,
    job: Option<JobPlan>,
}

/// How an async action's job is to run, armed at the downstream as job faults keyed by the
/// action's key before the agent publishes (`async_delay`, `async_fail`, `async_stuck`,
/// `status_not_found`); a job created after the faults stopped runs the downstream's default
/// (succeeds after 1 s). The checks read what the job did from the downstream's `async_jobs`,
/// never from this plan.
#[derive(Debug, Clone, Copy)]
struct JobPlan {
    /// From creation to the end (spread around the poll schedule).
    delay_ms: u64,
    /// `succeeded`, `failed` or `stuck` (never ends: held at the poll deadline).
    ending: &'static str,
    /// The status URL answers 404 this long after creation (0: not at all).
    hidden_ms: u64,
}

impl Action {
    fn key(&self) -> String {
        format!("{}:{}", self.tenant, self.action_id)
    }
}

/// The soak's tools file: one tool per capability against the reference downstream; the async
/// ones on its `/async/...` jobs, polled through `/async/operations/{operation_id}`; the lookup
/// tool with `absence_proof` when `absence_proof` (the downstream reads the ledger's clock: one
/// Postgres, so the declared skew is a margin).
pub fn tools_toml(port: u16, absence_proof: bool) -> String {
    let base = format!("http://127.0.0.1:{port}");
    let limits = format!(
        "timeout_ms = {TIMEOUT_MS}\n\
         recovery_attempts = 6\n\
         retry = {{ initial_delay_ms = 100, max_delay_ms = 1000, not_applied_statuses = [429] }}\n\
         budget = {{ ratio = 0.5, floor_per_minute = 60 }}\n"
    );
    let common = format!(
        "receipt_id = \"/receipt_id\"\n\
         receipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\n{limits}"
    );
    let long_running = format!(
        "completion = \"async\"\n\
         operation_id = \"/operation_id\"\n\
         status_url = \"{base}/async/operations/{{operation_id}}\"\n\
         done_match = {{ \"/state\" = \"succeeded\" }}\n\
         failed_match = {{ \"/state\" = \"failed\" }}\n\
         receipt_id = \"/deployment_id\"\n\
         receipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\n\
         poll = {{ first_ms = {ASYNC_POLL_FIRST_MS}, max_ms = {ASYNC_POLL_MAX_MS}, \
         deadline_secs = {ASYNC_DEADLINE_SECS} }}\n{limits}"
    );
    let proof = if absence_proof {
        format!(
            "absence_proof = {{ deadline_ms = {}, clock_skew_ms = 200 }}\n",
            TIMEOUT_MS * 2
        )
    } else {
        String::new()
    };
    format!(
        "[tools.refund]\nurl = \"{base}/replay/refunds\"\nrecovery = \"replay\"\n\
         replay_window_secs = 3600\nreplay_safety_margin_secs = 60\n{common}\n\
         [tools.ticket]\nurl = \"{base}/lookup/tickets\"\nrecovery = \"lookup\"\n\
         lookup_url = \"{base}/lookup/tickets/by-key/{{key}}\"\n{common}{proof}\n\
         [tools.deploy]\nurl = \"{base}/none/deploys\"\nrecovery = \"none\"\n{common}\n\
         [tools.rollout]\nurl = \"{base}/async/rollouts\"\nrecovery = \"replay\"\n\
         replay_window_secs = 3600\nreplay_safety_margin_secs = 60\n{long_running}\n\
         [tools.export]\nurl = \"{base}/async/exports\"\nrecovery = \"lookup\"\n\
         lookup_url = \"{base}/async/exports/by-key/{{key}}\"\n{long_running}\n"
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
        let cap = Capability::ALL[rng.usize(..Capability::ALL.len())];
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
        // An async job: its run spread around the poll schedule (done before the first
        // poll, around it, between polls, over several), some failing, some hidden for a
        // while after acceptance; stuck only early enough that the settle sees it held.
        let job = cap.is_async().then(|| {
            let delay_ms = match rng.u8(..8) {
                0 => 0,
                1 | 2 => rng.u64(50..400),
                3..=5 => rng.u64(400..1500),
                _ => rng.u64(1500..=ASYNC_MAX_DELAY_MS),
            };
            let ending = match rng.u8(..100) {
                n if n < 8 && stuck_allowed(cfg, at) => "stuck",
                n if n < 8 => "succeeded",
                n if n < 22 => "failed",
                _ => "succeeded",
            };
            let hidden_ms = match rng.u8(..5) {
                0 => rng.u64(100..=ASYNC_MAX_HIDDEN_MS),
                _ => 0,
            };
            JobPlan {
                delay_ms,
                ending,
                hidden_ms,
            }
        });
        actions.push(Action {
            tenant,
            action_id,
            cap,
            job,
        });
    }
    // At least one stuck job where one may be (the deadline hold is a checked outcome).
    let stuck = actions
        .iter()
        .any(|a| a.job.is_some_and(|j| j.ending == "stuck"));
    if !stuck {
        let span = cfg.seconds as f64;
        let first = actions.iter_mut().enumerate().find(|(i, a)| {
            let at = Duration::from_secs_f64(span * *i as f64 / cfg.intents as f64);
            a.job.is_some() && stuck_allowed(cfg, at)
        });
        if let Some((_, a)) = first {
            if let Some(job) = a.job.as_mut() {
                job.ending = "stuck";
            }
        }
    }
    planned.sort_by_key(|p| p.at);
    (actions, planned)
}

/// Whether a job published `at` into the faults may be planned stuck: its poll deadline (after
/// some slack for the acceptance itself) comes before the faults end, so the settle sees it
/// held.
fn stuck_allowed(cfg: &SoakConfig, at: Duration) -> bool {
    at + Duration::from_secs(ASYNC_DEADLINE_SECS + 3) <= Duration::from_secs(cfg.seconds)
}

/// Arms every async action's planned job faults, keyed by its key (taken only by the write
/// that creates its job).
async fn arm_jobs(downstream: &Downstream, actions: &[Action], report: &mut SoakReport) {
    let http = crate::http();
    let faults_url = format!("http://127.0.0.1:{}/_control/faults", downstream.port);
    for a in actions {
        let Some(job) = a.job else { continue };
        let key = a.key();
        let mut specs = vec![json!({"kind": "async_delay", "key": key, "delay_ms": job.delay_ms})];
        match job.ending {
            "failed" => specs.push(json!({"kind": "async_fail", "key": key})),
            "stuck" => specs.push(json!({"kind": "async_stuck", "key": key})),
            _ => {}
        }
        if job.hidden_ms > 0 {
            specs.push(json!({"kind": "status_not_found", "key": key, "delay_ms": job.hidden_ms}));
        }
        for spec in specs {
            let label = spec["kind"].as_str().unwrap_or("?").to_string();
            let ok = http
                .post(&faults_url)
                .header("content-type", "application/json")
                .body(spec.to_string())
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                *report.async_figures.planned.entry(label).or_default() += 1;
            } else {
                report
                    .violations
                    .push(format!("harness: could not arm the job faults of {key}"));
            }
        }
    }
}

/// One worker slot: its links and its current process. No Postgres proxy in
/// [`SoakConfig::pg_failover`] mode (the workers are given both hosts directly).
struct Slot {
    amqp: Option<FaultProxy>,
    pg: Option<FaultProxy>,
}

struct Proc {
    worker: Option<Worker>,
    generation: u32,
    restart_at: Instant,
}

struct Fleet {
    /// The ledger's URL (the shared test database, or the pair's multi-host URL).
    ledger_url: String,
    /// The cluster's node list, for workers without a broker proxy ([`SoakConfig::cluster`]).
    broker_urls: String,
    slots: Vec<Slot>,
    procs: Mutex<Vec<Proc>>,
    opts: WorkerOptions,
    unexpected: Mutex<Vec<String>>,
    startup_exits: Mutex<Vec<String>>,
    /// `WORKER_ID` of every worker the soak SIGKILLed, and when.
    kills: Mutex<Vec<(String, DateTime<Utc>)>>,
    /// Every worker's output by `WORKER_ID`, kept after it is gone (for the evidence of an
    /// avoidable hold).
    logs: Mutex<HashMap<String, Output>>,
}

impl Fleet {
    fn spawn(&self, env: &Env, i: usize, generation: u32) -> Worker {
        let slot = &self.slots[i];
        let ledger = match &slot.pg {
            Some(pg) => via(&self.ledger_url, pg.addr()),
            None => self.ledger_url.clone(),
        };
        let broker = match &slot.amqp {
            Some(amqp) => via(&env.amqp_url, amqp.addr()),
            None => self.broker_urls.clone(),
        };
        let opts = self
            .opts
            .clone()
            .env("DATABASE_URL", &ledger)
            .env("AMQP_URL", &broker);
        let w = Worker::spawn(env, &format!("w{i}g{generation}"), &opts);
        self.logs
            .lock()
            .unwrap()
            .insert(format!("{}-{}", w.name, env.id), w.output.clone());
        w
    }

    /// Metrics ports of the workers that run and have started consuming.
    fn live_metrics_ports(&self) -> Vec<(String, u16)> {
        let mut procs = self.procs.lock().unwrap();
        procs
            .iter_mut()
            .filter_map(|p| p.worker.as_mut())
            .filter_map(|w| {
                let live = w.is_running() && w.output.contains("consuming intents");
                Some((w.name.clone(), w.metrics_port.filter(|_| live)?))
            })
            .collect()
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
    fn kill(&self, env: &Env, i: usize, down: Duration) -> bool {
        let mut procs = self.procs.lock().unwrap();
        let p = &mut procs[i];
        match p.worker.take() {
            Some(mut w) => {
                w.kill();
                self.kills
                    .lock()
                    .unwrap()
                    .push((format!("{}-{}", w.name, env.id), Utc::now()));
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
            "--seed {} --intents {} --seconds {} --workers {} (settle up to {} s){}{}",
            cfg.seed,
            cfg.intents,
            cfg.seconds,
            cfg.workers,
            cfg.settle_secs,
            if cfg.pg_failover {
                " --pg-failover"
            } else {
                ""
            },
            if cfg.cluster { " --cluster" } else { "" }
        ),
        ..SoakReport::default()
    };

    // The ledger's own primary and synchronous standby, before anything uses it.
    let pair = if cfg.pg_failover {
        let pair = PgPair::start(PgPairOptions::default()).await;
        let db = pair.create_database("ledger").await;
        Some((pair, db))
    } else {
        None
    };
    // The broker's own cluster likewise (the soak's names are declared on it by the workers
    // and the agent; the harness cleans them up through the agent's node).
    let cluster = if cfg.cluster {
        Some(RabbitCluster::start(RabbitClusterOptions::default()).await)
    } else {
        None
    };
    let mut env = Env::new().await;
    if let Some(cluster) = &cluster {
        env.amqp_url = cluster.amqp_url(AGENT_NODE);
    }
    let env = Arc::new(env);
    let downstream = Downstream::start(&env).await;
    arm_jobs(&downstream, &actions, &mut report).await;
    let tools = env.write_tools(&tools_toml(downstream.port, cfg.absence_proof));
    let mut opts = WorkerOptions::new(tools);
    opts.lease_secs = LEASE_SECS;
    opts.recovery_interval_ms = 200;
    opts.prefetch = 16;
    if pair.is_some() || cluster.is_some() {
        // `/readyz` names the ledger host and the broker nodes in use: how the soak sees a
        // worker follow.
        opts = opts.with_metrics();
    }
    if cluster.is_some() {
        // A paused node is noticed after two heartbeats; one that accepts and never answers
        // costs a connection timeout (the URLs below).
        opts = opts.env("WORKER_AMQP_HEARTBEAT_SECS", CLUSTER_HEARTBEAT_SECS);
    }
    let ledger_url = match &pair {
        Some((pair, db)) => pair.multi_host_url(db, "target_session_attrs=read-write"),
        None => env.db_url.clone(),
    };
    let pg_upstream = authority(&env.db_url);
    let amqp_upstream = authority(&env.amqp_url);
    let mut slots = Vec::new();
    for _ in 0..cfg.workers {
        slots.push(Slot {
            amqp: match cluster {
                Some(_) => None,
                None => Some(FaultProxy::start(&amqp_upstream).await),
            },
            pg: match pair {
                Some(_) => None,
                None => Some(FaultProxy::start(&pg_upstream).await),
            },
        });
    }
    let fleet = Arc::new(Fleet {
        ledger_url,
        broker_urls: cluster.as_ref().map_or_else(String::new, |c| {
            (0..crate::rabbit_cluster::NODES)
                .map(|i| {
                    format!(
                        "{}?connection_timeout={CLUSTER_CONNECT_TIMEOUT_MS}",
                        c.amqp_url(i)
                    )
                })
                .collect::<Vec<_>>()
                .join(",")
        }),
        slots,
        procs: Mutex::new(Vec::new()),
        opts,
        unexpected: Mutex::new(Vec::new()),
        startup_exits: Mutex::new(Vec::new()),
        kills: Mutex::new(Vec::new()),
        logs: Mutex::new(HashMap::new()),
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

    // In cluster mode the agent keeps off the intents queue's leader, so that losing the leader
    // is among the node losses.
    let agent_node = match &cluster {
        Some(c) => match c.try_leader_of(&env.topology.intents_queue).await {
            Some(leader) if leader == AGENT_NODE => (AGENT_NODE + 1) % crate::rabbit_cluster::NODES,
            _ => AGENT_NODE,
        },
        None => AGENT_NODE,
    };
    let agent_url = match &cluster {
        Some(c) => c.amqp_url(agent_node),
        None => env.amqp_url.clone(),
    };
    // The agent: results first, so no event is missed.
    let events: Arc<Mutex<Vec<ResultEvent>>> = Arc::default();
    // When each `succeeded` answer arrived (`tenant:action_id`), for the resume after a loss.
    let arrivals: Arc<Mutex<Vec<(Instant, String)>>> = Arc::default();
    let follow_errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let stop_following = Arc::new(AtomicBool::new(false));
    let mut followers = Vec::new();
    // In cluster mode the agent's node may die, or lose its quorum: its results queue is a
    // quorum queue with a member on each node, read through whichever node answers, and it
    // publishes through the node list ([`AgentPublisher`]).
    let agent_urls: Vec<String> = match &fleet.broker_urls {
        urls if cluster.is_some() => {
            let mut list: Vec<String> = urls.split(',').map(str::to_owned).collect();
            list.rotate_left(agent_node);
            list
        }
        _ => vec![agent_url.clone()],
    };
    if cluster.is_some() {
        let queue = format!("{}.soak-agent", env.topology.results_exchange);
        crate::cluster_agent::declare_results_queue(
            &agent_urls[0],
            &env.topology.results_exchange,
            &queue,
            &TENANTS,
        )
        .await;
        let got: Arc<Mutex<Vec<crate::cluster_agent::Received>>> = Arc::default();
        let collector = crate::cluster_agent::spawn_collector(
            agent_urls.clone(),
            queue,
            got.clone(),
            stop_following.clone(),
        );
        let (events, arrivals, stop) = (events.clone(), arrivals.clone(), stop_following.clone());
        followers.push(tokio::spawn(async move {
            let drain = || {
                for r in std::mem::take(&mut *got.lock().unwrap()) {
                    if r.event.status == Status::Succeeded {
                        let key = format!("{}:{}", r.event.tenant, r.event.action_id);
                        arrivals.lock().unwrap().push((r.at.into(), key));
                    }
                    events.lock().unwrap().push(r.event);
                }
            };
            while !stop.load(Ordering::SeqCst) {
                drain();
                sleep(Duration::from_millis(100)).await;
            }
            let _ = collector.await;
            drain();
        }));
    }
    for tenant in TENANTS.iter().filter(|_| cluster.is_none()) {
        let mut f = Follower::follow(&agent_url, &env.topology.results_exchange, tenant, None)
            .await
            .context("follow results")?;
        let (events, errors, stop) = (
            events.clone(),
            follow_errors.clone(),
            stop_following.clone(),
        );
        let arrivals = arrivals.clone();
        followers.push(tokio::spawn(async move {
            loop {
                match f.next(Duration::from_millis(300)).await {
                    Ok(Some(ev)) => {
                        if ev.status == Status::Succeeded {
                            let key = format!("{}:{}", ev.tenant, ev.action_id);
                            arrivals.lock().unwrap().push((Instant::now(), key));
                        }
                        events.lock().unwrap().push(ev)
                    }
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
    let mut publisher =
        AgentPublisher::connect(agent_urls, &env.topology.intents_exchange, agent_node)
            .await
            .context("publisher connect")?;
    let agent_on = publisher.node.clone();

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

    // Publishing, chaos and the failover run side by side for `seconds` (a switchover still
    // under way then is finished first).
    let t0 = Instant::now();
    let mut first_published: HashMap<String, Instant> = HashMap::new();
    let mut resent = 0usize;
    let publishing = async {
        let mut errors = Vec::new();
        let mut counts = (0usize, 0usize);
        for p in &planned {
            tokio::time::sleep_until(t0 + p.at).await;
            first_published
                .entry(format!("{}:{}", p.tenant, p.action_id))
                .or_insert_with(Instant::now);
            let mut failed = Vec::new();
            let sent = publisher
                .publish(p.tenant, &p.action_id, &p.body, &mut failed)
                .await;
            // Through a node list (cluster mode) a failed attempt is sent again through the
            // next node: only an intent given up on is an error; through one broker, every
            // failure is.
            if !sent || cluster.is_none() {
                errors.extend(failed.iter().cloned());
            }
            resent += failed.len();
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
        &env,
        &fleet,
        &downstream,
        t0,
        &mut report,
    );
    let failing_over = async {
        match &pair {
            Some((pair, _)) => Some(
                failover(
                    cfg,
                    fastrand::Rng::with_seed(cfg.seed ^ 0x5851_f42d_4c95_7f2d),
                    pair,
                    &fleet,
                    t0,
                )
                .await,
            ),
            None => None,
        }
    };
    let loss_violations = Mutex::new(Vec::new());
    let losing_nodes = async {
        match &cluster {
            Some(cluster) => {
                node_losses(
                    cfg,
                    fastrand::Rng::with_seed(cfg.seed ^ 0x2545_f491_4f6c_dd1d),
                    cluster,
                    &agent_on,
                    &env.topology.intents_queue,
                    &fleet,
                    t0,
                    &loss_violations,
                )
                .await
            }
            None => Vec::new(),
        }
    };
    let (((published, republished), publish_errors), (), failover, node_losses) =
        tokio::join!(publishing, chaos, failing_over, losing_nodes);
    report
        .violations
        .extend(loss_violations.into_inner().unwrap());
    report.publish_retries = resent;
    for loss in &node_losses {
        if loss.resume.is_none() {
            report.violations.push(format!(
                "cluster: the live workers were not all ready within {} s of losing node {} at {:.1} s",
                RESUME_CAP.as_secs(),
                loss.node,
                loss.at.as_secs_f64()
            ));
        }
    }
    report.node_losses = node_losses;
    report.published = published;
    report.republished = republished;
    if let Some(fo) = &failover {
        for (what, resumed) in [
            ("promotion", fo.resume_after_promotion),
            ("switchover", fo.resume_after_switchover),
        ] {
            if resumed.is_none() {
                report.violations.push(format!(
                    "pg failover: the live workers were not all ready on the new primary within {} s of the {what}",
                    RESUME_CAP.as_secs()
                ));
            }
        }
    }
    report.failover = failover;

    // Faults stop: links restored, the fault book emptied; the supervisor keeps every worker
    // up.
    for s in &fleet.slots {
        if let Some(amqp) = &s.amqp {
            amqp.restore();
        }
        if let Some(pg) = &s.pg {
            pg.restore();
        }
    }
    let _ = crate::http()
        .delete(format!(
            "http://127.0.0.1:{}/_control/faults",
            downstream.port
        ))
        .send()
        .await;

    // The ledger as the invariants read it: the test database, or the pair's primary now
    // (sqlx does not take the multi-host URL).
    let ledger = match &pair {
        Some((pair, db)) => PgPoolOptions::new()
            .max_connections(2)
            .connect(&pair.url(pair.primary().await, db))
            .await
            .context("connect to the ledger's primary")?,
        None => env.pool.clone(),
    };
    let settle_started = Instant::now();
    let outstanding = settle(&ledger, &actions, &events, &fleet.kills, cfg.settle_secs).await;
    report.settled = outstanding.is_none();
    report.settle_outstanding = outstanding;
    report.settle_time = settle_started.elapsed();
    stop_supervising.store(true, Ordering::SeqCst);
    let _ = supervisor.await;
    stop_following.store(true, Ordering::SeqCst);
    for f in followers {
        let _ = f.await;
    }
    publisher.close().await;

    let events = std::mem::take(&mut *events.lock().unwrap());
    let arrivals = std::mem::take(&mut *arrivals.lock().unwrap());
    for loss in &mut report.node_losses {
        loss.consumed = arrivals
            .iter()
            .filter(|(_, key)| first_published.get(key).is_some_and(|t| *t >= loss.lost_at))
            .map(|(at, _)| at.saturating_duration_since(loss.lost_at))
            .min();
    }
    report.unexpected_exits = std::mem::take(&mut *fleet.unexpected.lock().unwrap());
    report.startup_exits = std::mem::take(&mut *fleet.startup_exits.lock().unwrap());
    let kills = std::mem::take(&mut *fleet.kills.lock().unwrap());
    let logs = std::mem::take(&mut *fleet.logs.lock().unwrap());
    let seen = Seen {
        events: &events,
        kills: &kills,
        logs: &logs,
    };
    check(&env.pool, &ledger, &actions, &seen, &mut report).await?;
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
    if pair.is_some() {
        ledger.close().await;
    }
    drop(downstream);
    drop(fleet);
    match Arc::try_unwrap(env) {
        Ok(env) => cleanup(env).await,
        // Still shared (cannot happen once the supervisor ended): `Env`'s drop cleans up.
        Err(env) => drop(env),
    }
    drop(pair);
    drop(cluster);
    report.elapsed = started.elapsed();
    Ok(report)
}

/// The seeded failover: at 15–35 % of the fault period the primary is stopped hard and the
/// standby promoted; at 55–75 % (and not before the workers followed) the old primary rejoins
/// as the synchronous standby and a switchover makes it the primary again. After each switch,
/// how long until the live workers are ready on the new primary.
async fn failover(
    cfg: &SoakConfig,
    mut rng: fastrand::Rng,
    pair: &PgPair,
    fleet: &Fleet,
    t0: Instant,
) -> FailoverFigures {
    let span = cfg.seconds as f64;
    let fail_at = Duration::from_secs_f64(span * (0.15 + 0.2 * rng.f64()));
    let back_at = Duration::from_secs_f64(span * (0.55 + 0.2 * rng.f64()));
    let mut fo = FailoverFigures::default();

    tokio::time::sleep_until(t0 + fail_at).await;
    fo.failed_at = t0.elapsed();
    let old = pair.primary().await;
    let new = pair.other(old);
    pair.stop_hard(old).await;
    let promoting = Instant::now();
    pair.promote(new).await;
    let promoted = Instant::now();
    fo.promote_took = promoted - promoting;
    fo.resume_after_promotion = resumed_on(fleet, pair.port(new), promoted).await;

    tokio::time::sleep_until((t0 + back_at).max(Instant::now() + Duration::from_secs(1))).await;
    fo.rejoined_at = t0.elapsed();
    let rejoining = Instant::now();
    fo.rewound = pair.rejoin_as_standby(old).await;
    fo.rejoin_took = rejoining.elapsed();
    let switching = Instant::now();
    pair.switchover().await;
    let switched = Instant::now();
    fo.switchover_took = switched - switching;
    fo.resume_after_switchover = resumed_on(fleet, pair.port(old), switched).await;
    fo
}

/// Polls every live worker's `/readyz` until each names `127.0.0.1:<port>` as its ledger host
/// and is ready, or unready only for a broker link the chaos cut (the ledger is what this
/// measures); the time since `since`, or `None` after [`RESUME_CAP`]. Workers that are down or
/// still starting are not waited for (they connect to whichever host is writable then).
async fn resumed_on(fleet: &Fleet, port: u16, since: Instant) -> Option<Duration> {
    let want = format!("127.0.0.1:{port}");
    until_all_ready(fleet, since, |status, body| {
        let on_it = body["ledger_host"].as_str() == Some(want.as_str());
        on_it
            && (status == 200 || (status == 503 && all_reasons(body, |r| r.starts_with("broker "))))
    })
    .await
}

/// Whether `/readyz` answered with every reason in `reasons` matching `what`.
fn all_reasons(body: &Value, what: impl Fn(&str) -> bool) -> bool {
    body["reasons"]
        .as_array()
        .is_some_and(|r| r.iter().all(|r| r.as_str().is_some_and(&what)))
}

/// Polls every live worker's `/readyz` (status and body) until `ready` holds for each; the time
/// since `since`, or `None` after [`RESUME_CAP`]. Workers that are down or still starting are not
/// waited for.
async fn until_all_ready(
    fleet: &Fleet,
    since: Instant,
    ready: impl Fn(u16, &Value) -> bool,
) -> Option<Duration> {
    let http = crate::http_builder()
        .timeout(Duration::from_secs(3))
        .build()
        .expect("HTTP client");
    loop {
        let live = fleet.live_metrics_ports();
        let mut all = !live.is_empty();
        for (_, metrics) in &live {
            let url = format!("http://127.0.0.1:{metrics}/readyz");
            let answer = match http.get(&url).send().await {
                Ok(r) => {
                    let status = r.status().as_u16();
                    let body: Value = r.json().await.unwrap_or_default();
                    Some((status, body))
                }
                Err(_) => None,
            };
            if !answer.is_some_and(|(status, body)| ready(status, &body)) {
                all = false;
                break;
            }
        }
        if all {
            return Some(since.elapsed());
        }
        if since.elapsed() > RESUME_CAP {
            return None;
        }
        sleep(Duration::from_millis(100)).await;
    }
}

/// The kinds of node loss of [`SoakConfig::cluster`] mode, taken in this order.
const LOSS_KINDS: [&str; 4] = ["agent-node kill", "two-node window", "leader kill", "pause"];

/// The seeded node losses of [`SoakConfig::cluster`] mode: a first at 10–25 % of the fault
/// period, then one every 25–35 % (at most [`LOSS_GAP_MAX_SECS`]) while time is left, of the
/// kinds of [`LOSS_KINDS`] in turn:
/// the node the agent publishes through (`agent_on`) SIGKILLed; two of the three nodes SIGKILLed
/// for 6–10 s (the one left is a minority and pauses: every live worker must answer `/readyz`
/// 503 naming the broker meanwhile); the intents queue's leader SIGKILLed (another node when the
/// agent uses it); a node that leads nothing SIGSTOPped for 12–16 s (longer than two worker
/// heartbeats). Killed nodes are started again 2–5 s later and waited for before the next loss.
/// After each, how long until the live workers are ready again.
#[allow(clippy::too_many_arguments)]
async fn node_losses(
    cfg: &SoakConfig,
    mut rng: fastrand::Rng,
    cluster: &RabbitCluster,
    agent_on: &AtomicUsize,
    intents_queue: &str,
    fleet: &Fleet,
    t0: Instant,
    violations: &Mutex<Vec<String>>,
) -> Vec<NodeLoss> {
    let nodes = crate::rabbit_cluster::NODES;
    let span = cfg.seconds as f64;
    let end = t0 + Duration::from_secs(cfg.seconds);
    let mut next = t0 + Duration::from_secs_f64(span * (0.10 + 0.15 * rng.f64()));
    let mut losses = Vec::new();
    let mut turn = 0;
    while next < end {
        tokio::time::sleep_until(next).await;
        let kind = LOSS_KINDS[turn % LOSS_KINDS.len()];
        turn += 1;
        let leader = cluster.try_leader_of(intents_queue).await;
        let agent = agent_on.load(Ordering::SeqCst);
        let other = |not: &[Option<usize>], rng: &mut fastrand::Rng| {
            let pick: Vec<usize> = (0..nodes).filter(|n| !not.contains(&Some(*n))).collect();
            pick[rng.usize(..pick.len())]
        };
        let at = t0.elapsed();
        let lost_at = Instant::now();
        let mut loss = NodeLoss {
            at,
            kind,
            node: agent,
            second: None,
            was_leader: false,
            paused: None,
            resume: None,
            consumed: None,
            restart_took: Duration::ZERO,
            lost_at,
        };
        match kind {
            "pause" => {
                loss.node = other(&[leader, Some(agent)], &mut rng);
                let length = Duration::from_secs_f64(12.0 + 4.0 * rng.f64());
                cluster.pause(loss.node);
                loss.resume = ready_again(fleet, lost_at).await;
                tokio::time::sleep_until(lost_at + length).await;
                cluster.resume(loss.node);
                loss.paused = Some(lost_at.elapsed());
            }
            "two-node window" => {
                let survivor = rng.usize(..nodes);
                let dead: Vec<usize> = (0..nodes).filter(|&n| n != survivor).collect();
                loss.node = dead[0];
                loss.second = Some(dead[1]);
                loss.was_leader = leader.is_some_and(|l| dead.contains(&l));
                for &n in &dead {
                    cluster.kill(n);
                }
                let window = Duration::from_secs_f64(6.0 + 4.0 * rng.f64());
                let refused = until_all_ready(fleet, lost_at, |status, body| {
                    status == 503
                        && body["reasons"].as_array().is_some_and(|r| {
                            r.iter()
                                .any(|r| r.as_str().is_some_and(|r| r.starts_with("broker ")))
                        })
                })
                .await;
                if refused.is_none_or(|d| d > window) {
                    violations.lock().unwrap().push(format!(
                        "cluster: with nodes {dead:?} down (quorum lost) the live workers did not all answer /readyz 503 naming the broker within the {:.1} s window",
                        window.as_secs_f64()
                    ));
                }
                tokio::time::sleep_until(lost_at + window).await;
                let restarting = Instant::now();
                let (_, _, resume) = tokio::join!(
                    cluster.start_node(dead[0]),
                    cluster.start_node(dead[1]),
                    ready_again(fleet, lost_at)
                );
                loss.resume = resume;
                loss.restart_took = restarting.elapsed();
            }
            _ => {
                loss.node = match (kind, leader) {
                    ("agent-node kill", _) => agent,
                    (_, Some(l)) if l != agent => l,
                    _ => other(&[Some(agent)], &mut rng),
                };
                loss.was_leader = leader == Some(loss.node);
                cluster.kill(loss.node);
                loss.resume = ready_again(fleet, lost_at).await;
                tokio::time::sleep_until(lost_at + Duration::from_secs_f64(2.0 + 3.0 * rng.f64()))
                    .await;
                let restarting = Instant::now();
                cluster.start_node(loss.node).await;
                loss.restart_took = restarting.elapsed();
            }
        }
        losses.push(loss);
        // At most two minutes apart, so a long run goes through every kind several times.
        let gap = (span * (0.25 + 0.10 * rng.f64())).min(LOSS_GAP_MAX_SECS);
        next = Instant::now().max(next) + Duration::from_secs_f64(gap);
    }
    losses
}

/// The longest gap between two node losses of [`SoakConfig::cluster`] mode, seconds.
const LOSS_GAP_MAX_SECS: f64 = 120.0;

/// The soak agent's publisher. With a node list (cluster mode), through the first node that
/// accepts, the agent's own first; on any error (a refused or lost connection, a confirm that
/// does not come) the connection is dropped and the same intent is sent again, same key and
/// body, through the next node ("may or may not be queued, safe to send again": the inbox
/// answers a copy), until it is confirmed or two minutes have passed. With one URL it tries
/// five times on one connection, as before.
struct AgentPublisher {
    urls: Vec<String>,
    exchange: String,
    publisher: Option<Publisher>,
    /// The index in `urls` of the node in use (or to try next).
    next: usize,
    /// The cluster node index the publisher is on (`urls` is the node list rotated so that the
    /// agent's own node comes first, `offset`).
    node: Arc<AtomicUsize>,
    offset: usize,
}

impl AgentPublisher {
    async fn connect(urls: Vec<String>, exchange: &str, offset: usize) -> Result<AgentPublisher> {
        let mut p = AgentPublisher {
            urls,
            exchange: exchange.to_string(),
            publisher: None,
            next: 0,
            node: Arc::new(AtomicUsize::new(offset)),
            offset,
        };
        p.connected().await.map_err(|e| anyhow::anyhow!(e))?;
        Ok(p)
    }

    async fn connected(&mut self) -> Result<&Publisher, String> {
        if self.publisher.is_none() {
            let url = &self.urls[self.next];
            let p = tokio::time::timeout(
                Duration::from_secs(5),
                Publisher::connect(url, &self.exchange),
            )
            .await
            .map_err(|_| "connect: timed out".to_string())?
            .map_err(|e| format!("connect: {e}"))?;
            self.node.store(
                (self.next + self.offset) % crate::rabbit_cluster::NODES,
                Ordering::SeqCst,
            );
            self.publisher = Some(p);
        }
        Ok(self.publisher.as_ref().expect("connected"))
    }

    /// Publishes until confirmed; every failed attempt is added to `errors`. False: given up.
    async fn publish(
        &mut self,
        tenant: &str,
        action_id: &str,
        body: &[u8],
        errors: &mut Vec<String>,
    ) -> bool {
        let list = self.urls.len() > 1;
        let give_up = Instant::now() + Duration::from_secs(120);
        let mut tries = 0;
        loop {
            tries += 1;
            let outcome = match self.connected().await {
                Ok(p) => tokio::time::timeout(
                    Duration::from_secs(10),
                    p.publish_encoded(tenant, action_id, body),
                )
                .await
                .map_err(|_| "no confirm within 10 s".to_string())
                .and_then(|r| r.map_err(|e| e.to_string())),
                Err(e) => Err(e),
            };
            let Err(e) = outcome else {
                return true;
            };
            errors.push(format!("{tenant}:{action_id}: {e}"));
            if list {
                if let Some(p) = self.publisher.take() {
                    tokio::spawn(async move {
                        let _ = tokio::time::timeout(Duration::from_secs(2), p.close()).await;
                    });
                }
                self.next = (self.next + 1) % self.urls.len();
            }
            if (!list && tries >= 5) || Instant::now() > give_up {
                return false;
            }
            sleep(Duration::from_millis(200)).await;
        }
    }

    async fn close(self) {
        if let Some(p) = self.publisher {
            let _ = tokio::time::timeout(Duration::from_secs(2), p.close()).await;
        }
    }
}

/// Polls every live worker's `/readyz` until each is ready, or unready only for a ledger link
/// the chaos cut (the broker is what this measures); the time since `since`, or `None` after
/// [`RESUME_CAP`]. A worker ready on a node that was just killed has not noticed yet, so the
/// first 500 ms are not looked at.
async fn ready_again(fleet: &Fleet, since: Instant) -> Option<Duration> {
    sleep(Duration::from_millis(500)).await;
    until_all_ready(fleet, since, |status, body| {
        status == 200 || (status == 503 && all_reasons(body, |r| !r.starts_with("broker ")))
    })
    .await
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
    env: &Env,
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
                if fleet.kill(env, i, secs(&mut rng, 0.3, 2.0)) {
                    report.kills += 1;
                }
            }
            2..=4 => {
                let slot = &fleet.slots[i];
                let (link, blackhole) = (rng.bool(), rng.u8(..4) == 0);
                // `true`: the broker link (always, when there is no Postgres proxy; never
                // without a broker proxy).
                let link = (link || slot.pg.is_none()) && slot.amqp.is_some();
                let proxy = match (&slot.pg, &slot.amqp) {
                    (Some(pg), _) if !link => pg,
                    (_, Some(amqp)) => amqp,
                    // Neither link has a proxy (cluster and ledger failover together).
                    _ => continue,
                };
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
                    match (&slot.pg, &slot.amqp) {
                        (Some(pg), _) if !link => pg.restore(),
                        (_, Some(amqp)) => amqp.restore(),
                        _ => {}
                    }
                });
            }
            _ => {
                let times = rng.u32(1..4);
                let spec = match rng.u8(..15) {
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
                    // A false miss breaks a lookup's contract (authoritative by key), which
                    // `absence_proof` relies on: then the lookups fail instead (down, or 5xx).
                    10 if cfg.absence_proof => {
                        json!({"kind": "status", "on": "lookup", "times": times, "status": 503})
                    }
                    10 => json!({"kind": "lookup_miss", "times": times}),
                    // The async jobs' status URL: 5xx, flapping (every other read), slow
                    // (straddling the timeout), or another operation's document.
                    11 => {
                        let status = [500, 502, 503][rng.usize(..3)];
                        json!({"kind": "status_error", "times": times, "status": status,
                               "every": rng.u32(1..3)})
                    }
                    12 => json!({"kind": "status_slow", "times": times,
                                 "delay_ms": rng.u64(200..2500)}),
                    13 => json!({"kind": "drop_before_commit", "on": "status", "times": times}),
                    _ => json!({"kind": "wrong_receipt", "on": "status", "times": 1}),
                };
                let label = match (spec["kind"].as_str(), spec["on"].as_str()) {
                    (Some("status"), _) => format!("status_{}", spec["status"]),
                    (Some("status_error"), _) => format!("status_error_{}", spec["status"]),
                    (Some(k), Some("status")) => format!("{k}(status read)"),
                    (Some(k), _) => k.to_string(),
                    (None, _) => "?".into(),
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

/// When the result events a worker SIGKILLed at `killed_at` had committed but not published
/// have surely gone to another relay: its relay epoch was last advanced before the kill, is
/// retired once silent for the relay hold, by a live relay that looks at most every quarter
/// hold, and the events are then published at its next round (a second of slack). Before this
/// an event of a worker killed just after its commit may still, by design, be waiting.
fn held_events_released_by(killed_at: DateTime<Utc>) -> Instant {
    let hold = worker::ledger::outbox::RELAY_HOLD;
    let released = killed_at
        + chrono::Duration::from_std(hold + hold / 4).expect("a short hold")
        + chrono::Duration::seconds(1);
    let wait = (released - Utc::now()).to_std().unwrap_or_default();
    Instant::now() + wait
}

/// Waits until every key has a row, none is still moving (`prepared`, `dispatching`,
/// `retry_wait`, `unknown`, `accepted`), the outbox is published and the agent holds an event
/// for every key; or until `settle_secs` passed, and at least until the events a SIGKILLed
/// worker held may have gone to another relay ([`held_events_released_by`]). Returns `None`
/// once settled, else what was still outstanding at the cap.
async fn settle(
    ledger: &PgPool,
    actions: &[Action],
    events: &Mutex<Vec<ResultEvent>>,
    kills: &Mutex<Vec<(String, DateTime<Utc>)>>,
    settle_secs: u64,
) -> Option<String> {
    let cap = Instant::now() + Duration::from_secs(settle_secs);
    let last_kill = kills.lock().unwrap().iter().map(|(_, at)| *at).max();
    let deadline = match last_kill {
        Some(at) => cap.max(held_events_released_by(at)),
        None => cap,
    };
    loop {
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM operations")
            .fetch_one(ledger)
            .await
            .unwrap_or(0);
        let moving: Vec<(String, i64)> = sqlx::query_as(
            "SELECT state, count(*) FROM operations
             WHERE state IN ('prepared', 'dispatching', 'retry_wait', 'unknown', 'accepted')
             GROUP BY state ORDER BY state",
        )
        .fetch_all(ledger)
        .await
        .unwrap_or_else(|_| vec![("?".into(), 1)]);
        let unpublished: i64 =
            sqlx::query_scalar("SELECT count(*) FROM result_events WHERE NOT published")
                .fetch_one(ledger)
                .await
                .unwrap_or(1);
        let unanswered: Vec<String> = {
            let ev = events.lock().unwrap();
            let keys: std::collections::HashSet<(&str, &str)> = ev
                .iter()
                .map(|e| (e.tenant.as_str(), e.action_id.as_str()))
                .collect();
            actions
                .iter()
                .filter(|a| !keys.contains(&(a.tenant, a.action_id.as_str())))
                .map(Action::key)
                .collect()
        };
        if rows as usize >= actions.len()
            && moving.is_empty()
            && unpublished == 0
            && unanswered.is_empty()
        {
            // Events already published may still be on their way to the agent.
            sleep(Duration::from_secs(1)).await;
            return None;
        }
        if Instant::now() > deadline {
            let moving: Vec<String> = moving.iter().map(|(s, n)| format!("{s}={n}")).collect();
            let unpublished_detail = if unpublished > 0 {
                unpublished_events(ledger, events, kills).await
            } else {
                String::new()
            };
            return Some(format!(
                "{rows} of {} rows; moving: {}; {unpublished} result events not published{unpublished_detail}; {} keys without an event{}",
                actions.len(),
                if moving.is_empty() { "none".to_string() } else { moving.join(" ") },
                unanswered.len(),
                if unanswered.is_empty() {
                    String::new()
                } else {
                    format!(" (e.g. {})", unanswered.iter().take(3).cloned().collect::<Vec<_>>().join(", "))
                }
            ));
        }
        sleep(Duration::from_millis(500)).await;
    }
}

/// The result events the ledger still counts unpublished (at most 5): their relay epoch, its
/// watermark and its worker (and when the soak SIGKILLed it: a dead relay's epoch is retired,
/// and its rows above the watermark published again, only once nothing advanced it for the
/// relay hold, 30 s), and whether the agent received them all the same.
async fn unpublished_events(
    ledger: &PgPool,
    events: &Mutex<Vec<ResultEvent>>,
    kills: &Mutex<Vec<(String, DateTime<Utc>)>>,
) -> String {
    let kills = kills.lock().unwrap().clone();
    type Row = (
        i64,
        String,
        String,
        Option<i64>,
        Option<String>,
        Option<i64>,
        Option<DateTime<Utc>>,
        DateTime<Utc>,
    );
    let rows: Result<Vec<Row>, _> = sqlx::query_as(
        "SELECT r.id, r.event_id::text, r.status, r.relay_epoch, e.worker_id, e.through_id,
                e.advanced_at, r.created_at
         FROM result_events r LEFT JOIN relay_epochs e ON e.id = r.relay_epoch
         WHERE NOT r.published ORDER BY r.id LIMIT 5",
    )
    .fetch_all(ledger)
    .await;
    let rows = match rows {
        Ok(rows) => rows,
        Err(e) => return format!(" [could not read them: {e}]"),
    };
    let received: std::collections::HashSet<String> = events
        .lock()
        .unwrap()
        .iter()
        .map(|e| e.event_id.clone())
        .collect();
    let rows: Vec<String> = rows
        .iter()
        .map(
            |(id, event_id, status, epoch, worker, through, advanced, created)| {
                format!(
                "outbox id {id} ({status}, created {}) epoch {} of {}{} through {} advanced {}, {}",
                created.format("%H:%M:%S%.3f"),
                epoch.map_or("none".into(), |e| e.to_string()),
                worker.as_deref().unwrap_or("-"),
                kills
                    .iter()
                    .find(|(id, _)| Some(id.as_str()) == worker.as_deref())
                    .map_or(String::new(), |(_, at)| format!(
                        " (SIGKILLed at {})",
                        at.format("%H:%M:%S%.3f")
                    )),
                through.map_or("-".into(), |t| t.to_string()),
                advanced.map_or("-".into(), |t| t.format("%H:%M:%S%.3f").to_string()),
                if received.contains(event_id) {
                    "received by the agent"
                } else {
                    "not received"
                }
            )
            },
        )
        .collect();
    format!(" [{}]", rows.join("; "))
}

kit::pg_row! {
    struct LedgerRow {
        tenant: String,
        action_id: String,
        state: String,
        receipt: Option<Value>,
        evidence: Option<String>,
        /// The downstream's operation id, once it accepted the write (async tools).
        remote_id: Option<String>,
        /// The acceptance + the tool's poll deadline (async tools).
        poll_deadline: Option<DateTime<Utc>>,
        /// When the row first became `accepted` (`operation_history`).
        accepted_at: Option<DateTime<Utc>>,
        /// When the row first entered its current state (`operation_history`).
        state_at: Option<DateTime<Utc>>,
    }
}

kit::pg_row! {
    struct DownstreamKey {
        idem_key: String,
        mutations: i64,
        first_receipt: Option<Value>,
        writes: i64,
        lookups: i64,
        /// HTTP status of each write request in arrival order (`None`: dropped on purpose).
        write_statuses: Vec<Option<i32>>,
        /// When each write request arrived, and the deadline it carried (`absence_proof`).
        write_times: Vec<DateTime<Utc>>,
        write_deadlines: Vec<Option<DateTime<Utc>>>,
        /// When the downstream finished sending each true answer to a write or lookup for the
        /// key (a 2xx that is not a `wrong_receipt` fault) to a client that was still
        /// connected (`requests.replied_at`).
        delivered: Vec<DateTime<Utc>>,
        /// Async jobs created under the key (`async_jobs`; at most one).
        jobs: i64,
        /// Status reads (polls) of the key's job, and when each arrived.
        status_reads: i64,
        status_times: Vec<DateTime<Utc>>,
        job_operation_id: Option<String>,
        /// `succeeded`, `failed` or `stuck`.
        job_outcome: Option<String>,
        /// When the job ended (`None`: never, a stuck job).
        job_ends_at: Option<DateTime<Utc>>,
        job_deployment_id: Option<String>,
        job_arguments: Option<Value>,
        /// The status URL was planned to answer 404 for a while (`status_not_found`).
        job_hidden: bool,
        /// The first true answer (a 2xx, not `wrong_receipt`: a write's, a lookup's or a status
        /// read's) the downstream finished sending after the job had ended: no one can have
        /// known the job's end before it.
        end_reply: Option<DateTime<Utc>>,
    }
}

kit::pg_row! {
    /// A change of a ledger row, as `operation_history` has it.
    struct HistoryRow {
        at: DateTime<Utc>,
        from_state: Option<String>,
        to_state: String,
        fence: i64,
        actor: String,
    }
}

/// An unresolved key whose downstream delivered a true answer.
struct HeldWithAnswer<'a> {
    action: &'a Action,
    state: String,
    delivered: Vec<DateTime<Utc>>,
}

/// What the soak saw besides the tables: the agent's events, its SIGKILLs (`WORKER_ID`, when)
/// and the workers' output by `WORKER_ID`.
struct Seen<'a> {
    events: &'a [ResultEvent],
    kills: &'a [(String, DateTime<Utc>)],
    logs: &'a HashMap<String, Output>,
}

/// The invariants and measures, from the downstream's tables (`downstream`), the ledger
/// (`ledger`), the events and the soak's SIGKILLs.
async fn check(
    downstream: &PgPool,
    ledger: &PgPool,
    actions: &[Action],
    seen: &Seen<'_>,
    report: &mut SoakReport,
) -> Result<()> {
    let events = seen.events;
    let ledger_pool = ledger;
    let downstream_pool = downstream;
    let ledger: Vec<LedgerRow> = sqlx::query_as(
        "SELECT o.tenant, o.action_id, o.state, o.receipt, o.evidence, o.remote_id,
                o.poll_deadline,
                (SELECT min(h.at) FROM operation_history h
                 WHERE h.operation_id = o.id AND h.to_state = 'accepted') AS accepted_at,
                (SELECT min(h.at) FROM operation_history h
                 WHERE h.operation_id = o.id AND h.to_state = o.state) AS state_at
         FROM operations o",
    )
    .fetch_all(ledger_pool)
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
                    array_agg(at ORDER BY id) FILTER (WHERE kind = 'write') AS write_times,
                    array_agg(deadline ORDER BY id) FILTER (WHERE kind = 'write')
                        AS write_deadlines,
                    count(*) FILTER (WHERE kind = 'lookup') AS lookups,
                    count(*) FILTER (WHERE kind = 'status') AS status_reads,
                    array_agg(at ORDER BY id) FILTER (WHERE kind = 'status') AS status_times,
                    array_agg(replied_at ORDER BY id) FILTER (
                        WHERE kind IN ('write', 'lookup')
                          AND replied_at IS NOT NULL AND status BETWEEN 200 AND 299
                          AND fault IS DISTINCT FROM 'wrong_receipt') AS delivered
             FROM downstream.requests WHERE idem_key IS NOT NULL GROUP BY idem_key),
         j AS (
             SELECT idem_key, count(*) AS jobs, min(operation_id) AS job_operation_id,
                    min(outcome) AS job_outcome, min(ends_at) AS job_ends_at,
                    min(deployment_id) AS job_deployment_id,
                    (array_agg(arguments ORDER BY id))[1] AS job_arguments,
                    bool_or(not_found_until IS NOT NULL) AS job_hidden
             FROM downstream.async_jobs GROUP BY idem_key),
         e AS (
             SELECT q.idem_key, min(q.replied_at) AS end_reply
             FROM downstream.requests q JOIN downstream.async_jobs a ON a.idem_key = q.idem_key
             WHERE a.ends_at IS NOT NULL AND q.replied_at >= a.ends_at
               AND q.status BETWEEN 200 AND 299 AND q.fault IS DISTINCT FROM 'wrong_receipt'
             GROUP BY q.idem_key)
         SELECT coalesce(m.idem_key, r.idem_key) AS idem_key,
                coalesce(m.mutations, 0) AS mutations, m.first_receipt,
                coalesce(r.writes, 0) AS writes, coalesce(r.lookups, 0) AS lookups,
                coalesce(r.write_statuses, '{}') AS write_statuses,
                coalesce(r.write_times, '{}') AS write_times,
                coalesce(r.write_deadlines, '{}') AS write_deadlines,
                coalesce(r.delivered, '{}') AS delivered,
                coalesce(j.jobs, 0) AS jobs, coalesce(r.status_reads, 0) AS status_reads,
                coalesce(r.status_times, '{}') AS status_times,
                j.job_operation_id, j.job_outcome, j.job_ends_at, j.job_deployment_id,
                j.job_arguments, coalesce(j.job_hidden, false) AS job_hidden, e.end_reply
         FROM m FULL JOIN r ON m.idem_key = r.idem_key
         LEFT JOIN j ON j.idem_key = coalesce(m.idem_key, r.idem_key)
         LEFT JOIN e ON e.idem_key = coalesce(m.idem_key, r.idem_key)",
    )
    .fetch_all(downstream)
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
    let mut held_with_answer = Vec::new();
    let mut async_violations = Vec::new();
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
        if a.cap.replays() {
            verification += ds.map_or(0, |d| (d.writes - 1).max(0));
        }
        if a.cap.is_async() {
            async_job_figures(&key, ds, report);
        }
        let figures = report.per_capability.entry(a.cap).or_default();
        // Without replay, a write may follow another only if that one was proven not applied
        // (here: 429, the tools' only `not_applied_statuses`) or can no longer apply (it carried
        // a deadline, `absence_proof`, that had passed when the next one arrived: the
        // downstream refuses it at its commit point); after anything else (a dropped reply, a
        // 5xx, an answer the worker no longer waited for) a second send is unsafe even when it
        // happened not to duplicate.
        if !a.cap.replays() {
            let statuses = ds.map_or(&[][..], |d| &d.write_statuses[..]);
            let times = ds.map_or(&[][..], |d| &d.write_times[..]);
            let deadlines = ds.map_or(&[][..], |d| &d.write_deadlines[..]);
            // Write `j` could still apply when write `i` arrived.
            let still_open = |j: usize, i: usize| match (deadlines.get(j), times.get(i)) {
                (Some(Some(deadline)), Some(at)) => at <= deadline,
                _ => true,
            };
            let unsafe_resend = (1..statuses.len())
                .any(|i| (0..i).any(|j| statuses[j] != Some(429) && still_open(j, i)));
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
        let mut unproven = false;
        if let Some(row) = row {
            match row.state.as_str() {
                "succeeded" if a.cap.is_async() => {
                    figures.succeeded += 1;
                    let remote = row.remote_id.as_deref().unwrap_or("none");
                    match async_success_untrue(&key, ds, row.receipt.as_ref(), row.state_at) {
                        Some(Untrue::False(why)) => {
                            false_success = true;
                            async_violations.push((a, format!(
                                "false success: ledger row {key} ({}) is succeeded (remote id {remote}) but {why}",
                                a.cap.as_str()
                            )));
                        }
                        Some(Untrue::Unproven(why)) => {
                            unproven = true;
                            async_violations.push((a, format!(
                                "unproven success: ledger row {key} ({}) is succeeded (remote id {remote}); {why}",
                                a.cap.as_str()
                            )));
                        }
                        None => {}
                    }
                }
                "failed" if a.cap.is_async() => {
                    figures.failed += 1;
                    let remote = row.remote_id.as_deref().unwrap_or("none");
                    match async_failure_untrue(ds, row.state_at) {
                        Some(Untrue::False(why)) => {
                            false_failure = true;
                            async_violations.push((a, format!(
                                "false failure: ledger row {key} ({}) is failed (remote id {remote}) but {why}",
                                a.cap.as_str()
                            )));
                        }
                        Some(Untrue::Unproven(why)) => {
                            unproven = true;
                            async_violations.push((a, format!(
                                "unproven failure: ledger row {key} ({}) is failed (remote id {remote}); {why}",
                                a.cap.as_str()
                            )));
                        }
                        None => {}
                    }
                }
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
                    let at_deadline = a.cap.is_async() && evidence.starts_with("async_deadline");
                    if a.cap.is_async() {
                        if let Some(line) =
                            async_unsettled(&key, a.cap, row, ds, at_deadline, report)
                        {
                            async_violations.push((a, line));
                        }
                    }
                    // A hold at the poll deadline is judged by the async rules above: the
                    // acceptance delivered is no proof of the end.
                    let with_answer = ds.filter(|d| d.mutations > 0 && !d.delivered.is_empty());
                    if let Some(d) = with_answer.filter(|_| !at_deadline) {
                        held_with_answer.push(HeldWithAnswer {
                            action: a,
                            state: other.to_string(),
                            delivered: d.delivered.clone(),
                        });
                    }
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
            let occurred = DateTime::parse_from_rfc3339(&e.occurred_at)
                .ok()
                .map(|t| t.with_timezone(&Utc));
            match e.status {
                Status::Succeeded if a.cap.is_async() => {
                    let what = match async_success_untrue(&key, ds, e.receipt.as_ref(), occurred) {
                        Some(Untrue::False(why)) => {
                            false_success = true;
                            Some(("false success", why))
                        }
                        Some(Untrue::Unproven(why)) => {
                            unproven = true;
                            Some(("unproven success", why))
                        }
                        None => None,
                    };
                    if let Some((what, why)) = what {
                        report.violations.push(format!(
                            "{what}: event {} for {key} ({}) says succeeded (verified by {:?}, remote id {:?}); {why}",
                            e.event_id,
                            a.cap.as_str(),
                            e.verified_by,
                            e.remote_id
                        ));
                    }
                }
                Status::Failed if a.cap.is_async() => {
                    let what = match async_failure_untrue(ds, occurred) {
                        Some(Untrue::False(why)) => {
                            false_failure = true;
                            Some(("false failure", why))
                        }
                        Some(Untrue::Unproven(why)) => {
                            unproven = true;
                            Some(("unproven failure", why))
                        }
                        None => None,
                    };
                    if let Some((what, why)) = what {
                        report.violations.push(format!(
                            "{what}: event {} for {key} ({}) says failed ({:?}); {why}",
                            e.event_id,
                            a.cap.as_str(),
                            e.message.chars().take(300).collect::<String>()
                        ));
                    }
                }
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
        report.async_figures.unproven += usize::from(unproven);
        if a.cap.is_async() {
            async_latencies(row, ds, &sorted, &mut report.async_figures);
            continue;
        }
        // Recovery latency (sync tools; an async one's pending is its acceptance): the first
        // `pending` to the first final answer after it.
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
    avoidable_holds(ledger_pool, &held_with_answer, seen, report).await?;
    for (a, line) in async_violations {
        let remote = ledger
            .get(&(a.tenant.to_string(), a.action_id.clone()))
            .and_then(|r| r.remote_id.as_deref());
        let timeline = timeline(ledger_pool, downstream_pool, a, remote).await?;
        report.violations.push(format!("{line}; {timeline}"));
    }
    for e in &report.unexpected_exits {
        report
            .violations
            .push(format!("worker exit not caused by the soak: {e}"));
    }
    Ok(())
}

/// Of the unresolved keys whose true answer was delivered: the ones some worker received and
/// kept living after (avoidable holds, violations), and the ones whose every answer went to a
/// worker the soak SIGKILLed before that worker changed the row again (the proof died with
/// it). A delivered answer's receiver is the worker whose claim (the latest fence) the row
/// had when the downstream finished sending it (`operation_history`, same clock); a kill from
/// [`KILL_RACE`] before that moment on counts.
async fn avoidable_holds(
    ledger: &PgPool,
    held: &[HeldWithAnswer<'_>],
    seen: &Seen<'_>,
    report: &mut SoakReport,
) -> Result<()> {
    let kills = seen.kills;
    for h in held {
        let a = h.action;
        let history: Vec<HistoryRow> = sqlx::query_as(
            "SELECT h.at, h.from_state, h.to_state, h.fence, h.actor FROM operation_history h
             JOIN operations o ON o.id = h.operation_id
             WHERE o.tenant = $1 AND o.action_id = $2 ORDER BY h.id",
        )
        .bind(a.tenant)
        .bind(&a.action_id)
        .fetch_all(ledger)
        .await
        .context("read a row's history")?;
        let mut receivers = Vec::new();
        let mut avoidable = None;
        for r in &h.delivered {
            // The claim in force at `r`: the first change with the latest fence before it.
            let mut claim: Option<&HistoryRow> = None;
            for row in history.iter().take_while(|row| row.at <= *r) {
                if claim.is_none_or(|c| c.fence != row.fence) {
                    claim = Some(row);
                }
            }
            let receiver = claim.map_or("?", |c| c.actor.as_str());
            let killed_at = kills
                .iter()
                .find(|(id, _)| id == receiver)
                .map(|(_, at)| at);
            // A kill just before `r` counts too: the answer was written into a socket whose
            // process was already going (the downstream checks for a closed peer first, but
            // the kill can land between that check and the write).
            let killed = killed_at.is_some_and(|at| *at >= *r - KILL_RACE);
            let wrote_after = history
                .iter()
                .any(|row| row.actor == receiver && row.at > *r);
            receivers.push(format!(
                "{receiver} at {}{}",
                r.format("%H:%M:%S%.3f"),
                match (killed_at, wrote_after) {
                    (Some(k), false) => format!(", SIGKILLed at {}", k.format("%H:%M:%S%.3f")),
                    (Some(k), true) => format!(
                        ", which changed the row after it (SIGKILLed at {})",
                        k.format("%H:%M:%S%.3f")
                    ),
                    (None, _) => String::new(),
                }
            ));
            if !killed || wrote_after {
                avoidable.get_or_insert(receiver.to_string());
            }
        }
        let line = format!(
            "{} ({}) {}, answer delivered to {}",
            a.key(),
            a.cap.as_str(),
            h.state,
            receivers.join(", ")
        );
        report.held_with_answer_keys.push(line.clone());
        if let Some(receiver) = avoidable {
            report.avoidable_holds += 1;
            // The receiver's own words about the key, and the row's history.
            let text = seen
                .logs
                .get(&receiver)
                .map(|o| strip_ansi(&o.text()))
                .unwrap_or_default();
            let said: Vec<&str> = text
                .lines()
                .filter(|l| l.contains(a.action_id.as_str()))
                .take(8)
                .collect();
            let changes: Vec<String> = history
                .iter()
                .map(|h| {
                    format!(
                        "{} {}→{} fence {} by {}",
                        h.at.format("%H:%M:%S%.3f"),
                        h.from_state.as_deref().unwrap_or("-"),
                        h.to_state,
                        h.fence,
                        h.actor
                    )
                })
                .collect();
            report.violations.push(format!(
                "avoidable hold: the downstream committed and delivered its answer: {line}; history: {}; {receiver} logged: {}",
                changes.join(" | "),
                if said.is_empty() { "nothing about the key".to_string() } else { said.join(" | ") }
            ));
        } else {
            report.holds_lost_with_a_killed_worker += 1;
        }
    }
    Ok(())
}

/// Counts an async action's job: how it ends, its polls, a second job under its key.
fn async_job_figures(key: &str, ds: Option<&DownstreamKey>, report: &mut SoakReport) {
    let figures = &mut report.async_figures;
    figures.actions += 1;
    let Some(d) = ds.filter(|d| d.jobs > 0) else {
        return;
    };
    let outcome = d.job_outcome.clone().unwrap_or_else(|| "?".into());
    *figures.jobs.entry(outcome).or_default() += 1;
    figures.hidden += usize::from(d.job_hidden);
    figures.polls += d.status_reads;
    figures.max_polls = figures.max_polls.max(d.status_reads);
    if d.jobs > 1 {
        figures.duplicate_jobs += 1;
        report.violations.push(format!(
            "duplicate: {key} has {} async jobs at the downstream",
            d.jobs
        ));
    }
}

/// What is wrong with a verdict (`succeeded` or `failed`) on an async action.
enum Untrue {
    /// Not the truth: the job did not end so, or not yet when the verdict was recorded, or
    /// the receipt is not its final status document.
    False(String),
    /// The truth, but when it was recorded no true answer sent after the job's end had been
    /// delivered to anyone: the worker read it from something else (another operation's
    /// document), and was right by luck.
    Unproven(String),
}

/// Whether a verdict recorded at `at` about job `op` that ended at `end` came after the job's
/// end and after a true answer sent since then.
fn async_proof(
    d: &DownstreamKey,
    op: &str,
    end: DateTime<Utc>,
    at: DateTime<Utc>,
) -> Option<Untrue> {
    let t = |t: DateTime<Utc>| t.format("%H:%M:%S%.3f").to_string();
    if at + CLOCK_TOLERANCE < end {
        return Some(Untrue::False(format!(
            "it was recorded at {} while the job {op} ended only at {}",
            t(at),
            t(end)
        )));
    }
    match d.end_reply {
        None => Some(Untrue::Unproven(format!(
            "it was recorded at {} after the job {op} ended at {}, but no true answer (a 2xx that is \
             not another operation's document) was delivered after that end",
            t(at),
            t(end)
        ))),
        Some(r) if at + CLOCK_TOLERANCE < r => Some(Untrue::Unproven(format!(
            "it was recorded at {} after the job {op} ended at {}, but before the first true answer \
             delivered after that end ({})",
            t(at),
            t(end),
            t(r)
        ))),
        Some(_) => None,
    }
}

/// What is wrong with a success of an async action, recorded at `at` with `receipt` (the
/// ledger row's, or a result event's); `None` when nothing is: the job ended `succeeded` no
/// later than `at`, the receipt is the job's final status document (its operation, key,
/// deployment and arguments), and an answer sent after the job's end reached someone no later
/// than `at`.
fn async_success_untrue(
    key: &str,
    ds: Option<&DownstreamKey>,
    receipt: Option<&Value>,
    at: Option<DateTime<Utc>>,
) -> Option<Untrue> {
    let untrue = |why: String| Some(Untrue::False(why));
    let Some(d) = ds.filter(|d| d.jobs > 0) else {
        return untrue("the downstream has no job for the key".into());
    };
    let op = d.job_operation_id.as_deref().unwrap_or("?");
    let outcome = d.job_outcome.as_deref().unwrap_or("?");
    if outcome != "succeeded" {
        return untrue(format!("the downstream's job {op} ends {outcome}"));
    }
    let Some(end) = d.job_ends_at else {
        return untrue(format!("the downstream's job {op} has no end"));
    };
    let Some(at) = at else {
        return untrue("the success has no time".into());
    };
    let Some(receipt) = receipt else {
        return untrue("it carries no receipt".into());
    };
    let want = [
        ("/operation_id", json!(op)),
        ("/idempotency_key", json!(key)),
        ("/state", json!("succeeded")),
        ("/deployment_id", json!(d.job_deployment_id)),
        ("/arguments", d.job_arguments.clone().unwrap_or(Value::Null)),
    ];
    for (pointer, value) in want {
        if receipt.pointer(pointer) != Some(&value) {
            return untrue(format!(
                "its receipt's {pointer} is {} where the job's is {}",
                short(receipt.pointer(pointer)),
                short(Some(&value))
            ));
        }
    }
    async_proof(d, op, end, at)
}

/// What is wrong with a failure of an async action recorded at `at`; `None` when nothing is:
/// nothing was applied (no mutation: a write refused), or the job ended `failed` no later than
/// `at` and an answer sent after its end reached someone no later than `at`.
fn async_failure_untrue(ds: Option<&DownstreamKey>, at: Option<DateTime<Utc>>) -> Option<Untrue> {
    let d = ds.filter(|d| d.mutations > 0)?;
    let op = d.job_operation_id.as_deref().unwrap_or("?");
    let outcome = d.job_outcome.as_deref().unwrap_or("no job");
    if d.jobs == 0 || outcome != "failed" {
        return Some(Untrue::False(format!(
            "the downstream applied it ({} mutations) and its job {op} ends {outcome}",
            d.mutations
        )));
    }
    let (Some(end), Some(at)) = (d.job_ends_at, at) else {
        return Some(Untrue::False(format!(
            "the job {op} has no end or the failure no time"
        )));
    };
    async_proof(d, op, end, at)
}

/// An async action left unresolved. Held at the poll deadline: expected for a job that never
/// ends, once the deadline passed; for a job that ended, honest only when the worker kept
/// reading its status after the end and no read got a true answer before the hold (a lost
/// lease, a cut ledger link and a run of status faults together can outlast the 12 s: the
/// downstream never said the job was done); otherwise a violation (the worker did not see an
/// end it was told). Still `accepted` after the settle: a violation. Other holds (recovery
/// spent before any acceptance) are unresolved as for the sync tools.
fn async_unsettled(
    key: &str,
    cap: Capability,
    row: &LedgerRow,
    ds: Option<&DownstreamKey>,
    at_deadline: bool,
    report: &mut SoakReport,
) -> Option<String> {
    let time = |t: Option<DateTime<Utc>>| {
        t.map_or("-".to_string(), |t| t.format("%H:%M:%S%.3f").to_string())
    };
    let job = ds.filter(|d| d.jobs > 0).map_or("no job".to_string(), |d| {
        format!(
            "job {} ends {} at {}",
            d.job_operation_id.as_deref().unwrap_or("?"),
            d.job_outcome.as_deref().unwrap_or("?"),
            time(d.job_ends_at)
        )
    });
    let remote = row.remote_id.as_deref().unwrap_or("none");
    let evidence: String = row
        .evidence
        .as_deref()
        .unwrap_or("")
        .chars()
        .take(200)
        .collect();
    let stuck = ds.is_some_and(|d| d.job_outcome.as_deref() == Some("stuck"));
    if at_deadline {
        let on_time = match (row.state_at, row.poll_deadline) {
            (Some(held), Some(deadline)) => held + CLOCK_TOLERANCE >= deadline,
            _ => false,
        };
        // Read after the job's end, before the hold, and never truly answered by then.
        let end_unanswered = ds.is_some_and(|d| match (d.job_ends_at, row.state_at) {
            (Some(end), Some(held)) => {
                d.end_reply.is_none_or(|reply| reply > held)
                    && d.status_times.iter().any(|&t| t >= end && t <= held)
            }
            _ => false,
        });
        if stuck && on_time {
            report.async_figures.held_at_deadline += 1;
            None
        } else if on_time && end_unanswered {
            report.async_figures.held_end_unanswered += 1;
            None
        } else {
            report.async_figures.held_not_planned += 1;
            Some(format!(
                "async hold: {key} ({}) held at {} (deadline {}) following operation {remote}, but the downstream's {job}{}: {evidence}",
                cap.as_str(),
                time(row.state_at),
                time(row.poll_deadline),
                if on_time { "" } else { " (held before its deadline)" }
            ))
        }
    } else if row.state == "accepted" {
        report.async_figures.still_accepted += 1;
        Some(format!(
            "async unsettled: {key} ({}) still accepted (operation {remote}, deadline {}) after the settle; the downstream's {job}: {evidence}",
            cap.as_str(),
            time(row.poll_deadline)
        ))
    } else {
        None
    }
}

/// An action's timeline for a violation's evidence: its ledger history (time, move, fence,
/// actor, evidence excerpt) and the downstream's requests for its key or for the operation the
/// row follows (time, kind, status, fault, operation).
async fn timeline(
    ledger: &PgPool,
    downstream: &PgPool,
    a: &Action,
    remote_id: Option<&str>,
) -> Result<String> {
    /// `operation_history`: at, from, to, fence, actor, evidence.
    type Change = (
        DateTime<Utc>,
        Option<String>,
        String,
        i64,
        String,
        Option<String>,
    );
    /// `downstream.requests`: at, kind, status, fault, operation id.
    type Request = (
        DateTime<Utc>,
        String,
        Option<i32>,
        Option<String>,
        Option<String>,
    );
    let history: Vec<Change> = sqlx::query_as(
        "SELECT h.at, h.from_state, h.to_state, h.fence, h.actor, h.evidence
             FROM operation_history h JOIN operations o ON o.id = h.operation_id
             WHERE o.tenant = $1 AND o.action_id = $2 ORDER BY h.id",
    )
    .bind(a.tenant)
    .bind(&a.action_id)
    .fetch_all(ledger)
    .await
    .context("read a row's history")?;
    let requests: Vec<Request> = sqlx::query_as(
        "SELECT at, kind, status, fault, operation_id FROM downstream.requests
             WHERE idem_key = $1 OR operation_id = $2 ORDER BY id",
    )
    .bind(a.key())
    .bind(remote_id)
    .fetch_all(downstream)
    .await
    .context("read the downstream's requests for a key")?;
    let history: Vec<String> = history
        .iter()
        .map(|(at, from, to, fence, actor, evidence)| {
            format!(
                "{} {}→{to} fence {fence} by {actor}{}",
                at.format("%H:%M:%S%.3f"),
                from.as_deref().unwrap_or("-"),
                evidence.as_deref().map_or(String::new(), |e| format!(
                    " ({})",
                    e.chars().take(90).collect::<String>()
                ))
            )
        })
        .collect();
    let requests: Vec<String> = requests
        .iter()
        .map(|(at, kind, status, fault, op)| {
            format!(
                "{} {kind} {}{}{}",
                at.format("%H:%M:%S%.3f"),
                status.map_or("dropped".to_string(), |s| s.to_string()),
                fault
                    .as_deref()
                    .map_or(String::new(), |f| format!(" [{f}]")),
                op.as_deref().map_or(String::new(), |o| format!(" {o}"))
            )
        })
        .collect();
    Ok(format!(
        "history: {}; downstream requests: {}",
        history.join(" | "),
        requests.join(" | ")
    ))
}

/// An async action's acceptance → final and job end → final, from the ledger's history and
/// the downstream's job; and how the agent was told the final answer was verified.
fn async_latencies(
    row: Option<&LedgerRow>,
    ds: Option<&DownstreamKey>,
    events: &[&ResultEvent],
    figures: &mut AsyncFigures,
) {
    let job = ds.and_then(|d| d.job_operation_id.as_deref());
    let misdirected = events.iter().any(|e| {
        e.status == Status::Pending && e.remote_id.is_some() && e.remote_id.as_deref() != job
    });
    figures.misdirected += usize::from(misdirected);
    if let Some(e) = events
        .iter()
        .rev()
        .find(|e| matches!(e.status, Status::Succeeded | Status::Failed))
    {
        let by = e.verified_by.as_ref().map_or("none", |v| v.as_str());
        *figures.verified_by.entry(by.to_string()).or_default() += 1;
    }
    let Some(row) = row.filter(|r| matches!(r.state.as_str(), "succeeded" | "failed")) else {
        return;
    };
    let Some(done) = row.state_at else { return };
    if let Some(accepted) = row.accepted_at {
        figures
            .accepted_to_final_ms
            .push((done - accepted).num_milliseconds());
        if let Some(end) = ds.and_then(|d| d.job_ends_at) {
            figures
                .end_to_final_ms
                .push((done - end.max(accepted)).num_milliseconds());
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A short soak's settle once ended 0.9 s before a worker SIGKILLed just after a commit had
    /// its held event retired to another relay (a "lost answer"): the settle now lasts until the
    /// hold and the retiring relay's look have passed since the last kill.
    #[test]
    fn the_settle_outlasts_the_relay_hold_after_the_last_kill() {
        let hold = worker::ledger::outbox::RELAY_HOLD;
        let now = Instant::now();
        let recent = held_events_released_by(Utc::now() - chrono::Duration::seconds(5));
        let waits = recent.duration_since(now);
        assert!(
            waits >= hold + hold / 4 + Duration::from_millis(500) - Duration::from_secs(5)
                && waits <= hold + hold / 4 + Duration::from_secs(1),
            "{waits:?}"
        );
        let long_ago = held_events_released_by(Utc::now() - chrono::Duration::seconds(120));
        assert!(long_ago.duration_since(now) < Duration::from_millis(100));
    }

    fn at(hms: &str) -> DateTime<Utc> {
        format!("2026-12-06T{hms}Z").parse().unwrap()
    }

    /// A row held at its poll deadline (accepted 36.119, deadline 48.119, held 49.191) for a job
    /// that ended succeeded at 37.471: a lost lease and a run of status faults, as a cluster soak
    /// once met them.
    fn held() -> LedgerRow {
        LedgerRow {
            tenant: "t".into(),
            action_id: "a".into(),
            state: "held".into(),
            receipt: None,
            evidence: Some("async_deadline".into()),
            remote_id: Some("op-78".into()),
            poll_deadline: Some(at("17:46:48.119")),
            accepted_at: Some(at("17:46:36.119")),
            state_at: Some(at("17:46:49.191")),
        }
    }

    fn job(status_times: &[&str], end_reply: Option<&str>) -> DownstreamKey {
        DownstreamKey {
            idem_key: "t:a".into(),
            mutations: 1,
            first_receipt: None,
            writes: 1,
            lookups: 0,
            write_statuses: vec![Some(202)],
            write_times: vec![at("17:46:36.117")],
            write_deadlines: vec![None],
            delivered: vec![at("17:46:36.118")],
            jobs: 1,
            status_reads: status_times.len() as i64,
            status_times: status_times.iter().map(|t| at(t)).collect(),
            job_operation_id: Some("op-78".into()),
            job_outcome: Some("succeeded".into()),
            job_ends_at: Some(at("17:46:37.471")),
            job_deployment_id: None,
            job_arguments: None,
            job_hidden: false,
            end_reply: end_reply.map(at),
        }
    }

    fn judge(ds: &DownstreamKey) -> (Option<String>, SoakReport) {
        let mut report = SoakReport::default();
        let found = async_unsettled(
            "t:a",
            Capability::AsyncLookup,
            &held(),
            Some(ds),
            true,
            &mut report,
        );
        (found, report)
    }

    #[test]
    fn a_deadline_hold_is_honest_only_when_no_read_after_the_end_was_answered_truly() {
        // Read after the end, every read refused by a fault: nobody could know the end.
        let refused = job(
            &[
                "17:46:36.447",
                "17:46:37.447",
                "17:46:43.850",
                "17:46:49.189",
            ],
            None,
        );
        let (found, report) = judge(&refused);
        assert_eq!(found, None);
        assert_eq!(report.async_figures.held_end_unanswered, 1);
        assert_eq!(report.async_figures.held_not_planned, 0);
        // A true answer after the end, before the hold: the worker was told and held anyway.
        let told = job(&["17:46:37.447", "17:46:40.000"], Some("17:46:40.002"));
        let (found, report) = judge(&told);
        assert!(found.is_some_and(|v| v.starts_with("async hold")));
        assert_eq!(report.async_figures.held_not_planned, 1);
        // No read at all after the end: the worker stopped polling.
        let silent = job(&["17:46:36.447", "17:46:37.447"], None);
        assert!(judge(&silent).0.is_some());
    }
}
