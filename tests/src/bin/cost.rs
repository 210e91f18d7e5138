//! What one intent costs the machine: CPU time per intent of each component (the worker, every
//! Postgres process, every RabbitMQ process), row versions and WAL bytes per intent, while one
//! worker drains a backlog; the drain rate as a share of what the broker alone can relay in the
//! same run; and the latency at light load (200/s) and at half the drain rate. Rates on a
//! shared machine are noise; CPU time per intent is not, so the cost targets are stated in it.
//!
//! ```sh
//! cargo build --release --workspace
//! INTENT_BIN_DIR=target/release target/release/cost [--intents 20000] [--prefetch 256] \
//!     [--runs 2] [--latency-runs 5] [--latency-secs 10] [--light-rate 200] \
//!     [--wal-roll-over off|before]
//! ```
//!
//! Needs Postgres and RabbitMQ as the e2e suites do (`TEST_DATABASE_URL`, `TEST_AMQP_URL`),
//! on this machine (CPU is read from `/proc`). Each phase waits for the broker and the worker
//! up to `--timeout-secs` (300), and ends a minute after that whatever it was waiting on, with an
//! error naming it.
//!
//! Per run:
//! 1. **relay ceiling**: N intent-sized persistent messages in a quorum queue A; a relay here
//!    consumes A with prefetch P, publishes each to quorum queue B with a confirm, and acks it
//!    on A once confirmed (batches of what has arrived, up to P/2: their confirms awaited
//!    together, one `multiple` ack): the broker work one intent needs (one delivery in and
//!    acked, one confirmed publish out) with nothing else. Rate and RabbitMQ CPU per message,
//!    and the machine's busy cores (the relay waits on confirms, so this ceiling is not the
//!    machine's: cores stay idle, and its rate moves with the broker's latency).
//! 2. **drain**: a fresh database and broker names; the migrations applied (`worker migrate`);
//!    N distinct intents published to the intents exchange (the backlog); then one worker is
//!    started and the clock runs from its start to the N-th `succeeded` result (printed too:
//!    from its start to the first result, the start-up the drain includes). CPU of every
//!    process of each component from `/proc/<pid>/stat` before and after (`e2e::bench`),
//!    the machine's busy cores, row versions (`pg_stat_user_tables`, read once the worker has
//!    been stopped and its backends have exited: a live backend reports its counters seconds
//!    late), WAL bytes (`pg_current_wal_lsn`). Verified: every operation `succeeded`, one downstream write per
//!    intent.
//!
//! Then `--latency-runs` times: a light-load run at `--light-rate` (200/s; 0 skips it), then a
//! run at half the mean drain rate (or at `--latency-rate`, to compare workers at one rate; its
//! target is then not judged and reads "not run"). Each is a fresh worker, intents published
//! open-loop for `--latency-secs`; latency from publish to the
//! `succeeded` result, p50 and p99 over the intents published after the first second (the
//! target), and apart over those of the first second, while the worker's pooled connections
//! still prepare their statements (the cold start, printed and not a target). Each latency run
//! also prints the CPU per intent of every component and of this process (it publishes,
//! follows and is the downstream) from the first publish to the last result, the machine's
//! busy cores, and per intent the time each component's threads spent runnable but waiting for
//! a core (`/proc/<pid>/task/<tid>/schedstat`; threads that exited meanwhile not counted): at
//! half the drain rate batches are small, each intent costs more, and the latency is largely
//! that waiting. Before each latency run, the **broker floor** at the
//! same rate: the same publisher and intents into a quorum queue of their own; a relay here
//! consumes it with prefetch P and, for each delivery, publishes the `succeeded` result event the
//! worker would send to a topic exchange with a confirm, acking the intents in batches; the same
//! follower reads the results. Its p50 and p99 are what the broker and its clients leave of the
//! 50 ms with no ledger and no downstream; its CPU is RabbitMQ's and this process's per message.
//!
//! RabbitMQ's quorum queues share one write-ahead log per node; left alone, the broker rolls it
//! over every 512 MiB written, wherever the bytes written before (earlier phases, other tests)
//! bring it due, and while its segment writer flushes the closed file every queue's deliveries
//! wait for tens of milliseconds: a stall that lands in one latency run and not in the next. By
//! default the benchmark leaves it alone, as every production broker does (`--wal-roll-over
//! off`); `--wal-roll-over before` rolls it over before each measured phase (`rabbitmqctl eval`,
//! which needs the node's Erlang cookie: without it the benchmark says so and leaves the WAL
//! alone), so that no phase inherits a roll-over brought due by earlier writes, and the first
//! line says which. Every phase's line says when the broker's WAL rolled over during it, and a
//! latency line how many intents took over 50 ms and when they were published.
//!
//! The targets are printed with the figures (PASS/FAIL): worker ≤ 80 µs, Postgres ≤ 200 µs and
//! RabbitMQ ≤ 120 µs per intent; at most 4 row versions per intent in the tables an intent
//! writes (every table's count, with the per-second writes of heartbeats and relay watermarks,
//! printed beside); WAL per intent at least 40 % below [`WAL_REFERENCE`]; a drain of at least
//! 0.40 of the relay ceiling; at light load p50 ≤ 5 ms and p99 ≤ 15 ms in every run; at half the
//! drain rate p99 ≤ 50 ms in every run, or, where the broker alone could not keep that (the
//! broker floor just before it over 40 ms), within 10 ms of that floor.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context as _, Result};
use e2e::bench::{
    broker_wal_files, build_messages, check_confirm, confirm_channel, consume_on, declare_quorum,
    pct, publish_all, publish_open_loop, roll_over_broker_wal, run_backends, state_counts, us_per,
    CpuSample, CpuSplit, NullDownstream, Written,
};
use e2e::{cleanup, Env, Worker, WorkerOptions};
use futures_lite::StreamExt;
use lapin::options::{BasicAckOptions, BasicPublishOptions, QueueDeleteOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use protocol::Status;
use publisher::Follower;
use tokio::time::Instant;

const TENANT: &str = "cost";
const TOOL: &str = "cost";
/// WAL bytes per intent of the design before its cost was halved, measured by this benchmark
/// (docs/benchmarks.md, "Cost per intent"); the target is at least 40 % below it.
const WAL_REFERENCE: f64 = 5080.0;

const USAGE: &str = "usage: cost [--intents N (20000)] [--prefetch P (256)] [--runs R (2)] \
[--latency-runs L (5)] [--latency-secs S (10)] [--latency-rate R (half the drain rate)] \
[--light-rate R (200; 0: none)] [--timeout-secs T (300)] [--wal-roll-over off|before (off)] \
[--worker-env K=V]...

Set INTENT_BIN_DIR to the directory holding the release `worker` binary (default: the directory
of this executable). Postgres/RabbitMQ: TEST_DATABASE_URL / TEST_AMQP_URL.";

/// When the benchmark rolls RabbitMQ's quorum-queue WAL over
/// ([`roll_over_broker_wal`]). Every phase's line says whether the broker's WAL rolled over
/// during it ([`broker_wal_files`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum WalRoll {
    /// Before every measured phase: each starts with the broker's WAL fresh, so none holds a
    /// roll-over that the bytes written before it (earlier phases, other tests) happened to
    /// bring due.
    Before,
    /// Never: the broker rolls over where its WAL fills.
    Off,
}

struct Args {
    intents: usize,
    prefetch: u16,
    runs: usize,
    latency_runs: usize,
    latency_secs: u64,
    /// Intents per second of the latency runs, instead of half the mean drain rate (the
    /// target's rate): to compare workers at one rate.
    latency_rate: Option<f64>,
    timeout: Duration,
    /// Intents per second of the light-load runs (one before each run at half the drain rate;
    /// 0: none).
    light_rate: f64,
    wal_roll: WalRoll,
    /// More environment for the workers (`--worker-env RUST_LOG=warn`), to measure a setting.
    worker_env: Vec<(String, String)>,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        intents: 20_000,
        prefetch: 256,
        runs: 2,
        latency_runs: 5,
        latency_secs: 10,
        latency_rate: None,
        timeout: Duration::from_secs(300),
        light_rate: 200.0,
        wal_roll: WalRoll::Off,
        worker_env: Vec::new(),
    };
    let raw: Vec<String> = std::env::args().skip(1).collect();
    for (flag, value) in e2e::flags::pairs_from(raw, USAGE)? {
        let n = || {
            value
                .parse::<u64>()
                .with_context(|| format!("{flag} {value:?}"))
        };
        match flag.as_str() {
            "--intents" => args.intents = n()? as usize,
            "--prefetch" => args.prefetch = n()? as u16,
            "--runs" => args.runs = n()? as usize,
            "--latency-runs" => args.latency_runs = n()? as usize,
            "--latency-secs" => args.latency_secs = n()?,
            "--latency-rate" => args.latency_rate = Some(n()? as f64),
            "--light-rate" => args.light_rate = n()? as f64,
            "--timeout-secs" => args.timeout = Duration::from_secs(n()?),
            "--wal-roll-over" => {
                args.wal_roll = match value.as_str() {
                    "before" => WalRoll::Before,
                    "off" => WalRoll::Off,
                    _ => bail!("--wal-roll-over {value:?}: expected before or off"),
                }
            }
            "--worker-env" => {
                let (k, v) = value
                    .split_once('=')
                    .with_context(|| format!("--worker-env {value:?}: expected K=V"))?;
                args.worker_env.push((k.to_string(), v.to_string()));
            }
            other => bail!("unknown argument {other}\n{USAGE}"),
        }
    }
    ensure!(
        args.intents > 0 && args.prefetch > 0 && args.runs > 0,
        "{USAGE}"
    );
    Ok(args)
}

fn main() {
    if let Err(e) = start() {
        eprintln!("cost: error: {e:#}");
        std::process::exit(1);
    }
}

fn start() -> Result<()> {
    let args = parse_args()?;
    if std::env::var_os("INTENT_BIN_DIR").is_none_or(|d| d.is_empty()) {
        let exe = std::env::current_exe().context("current exe")?;
        // Single-threaded here: no runtime has started yet.
        std::env::set_var("INTENT_BIN_DIR", exe.parent().context("exe directory")?);
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?
        .block_on(run(args))
}

/// One drain's figures.
struct Drain {
    rate: f64,
    /// From the worker's start to the N-th `succeeded` result.
    elapsed: Duration,
    /// From the worker's start to the first `succeeded` result.
    first_result: Duration,
    cpu: CpuSplit,
    written: Option<Written>,
    n: usize,
}

/// One relay ceiling's figures.
struct Relay {
    rate: f64,
    elapsed: Duration,
    cpu: CpuSplit,
}

async fn run(mut args: Args) -> Result<()> {
    let n = args.intents;
    println!(
        "cost: N={n} P={} runs={} worker binary={} started={}",
        args.prefetch,
        args.runs,
        e2e::procs::bin_dir().join("worker").display(),
        chrono::Utc::now().format("%Y-%m-%d %H:%M:%S UTC")
    );
    if args.wal_roll != WalRoll::Off {
        if let Err(e) = roll_over_broker_wal().await {
            println!(
                "RabbitMQ's quorum WAL cannot be rolled over from here ({e:#}); it rolls over \
                 where it fills"
            );
            args.wal_roll = WalRoll::Off;
        }
    }
    println!(
        "RabbitMQ's quorum WAL: {}",
        match args.wal_roll {
            WalRoll::Before => "rolled over before each measured phase",
            WalRoll::Off => "left to roll over where it fills",
        }
    );
    let messages = Arc::new(build_messages(n, TENANT, TOOL));
    let downstream = NullDownstream::start().await?;
    let mut drains = Vec::new();
    let mut relays = Vec::new();
    // The machine's busy cores, printed for both: the relay ceiling leaves cores idle (its relay
    // waits on confirms) where a drain does not, so the ratio moves with the ceiling.
    let cores = cores();
    for r in 1..=args.runs {
        let wal = before_phase(&args).await?;
        let relay = bounded("relay ceiling", &args, relay_ceiling(&messages, &args)).await?;
        println!(
            "run {r}: relay ceiling {:.0}/s, RabbitMQ {:.0} µs per message; machine busy {:.2} \
             of {cores} cores{}",
            relay.rate,
            us_per(relay.cpu.rabbit, n),
            relay.cpu.busy_cores(relay.elapsed),
            rolled_note(rolled_over_since(&wal))
        );
        let wal = before_phase(&args).await?;
        let drain = bounded("drain", &args, drain(&messages, &downstream, &args)).await?;
        println!(
            "run {r}: drain {:.0}/s ({:.3} of the relay ceiling), first result after {} ms; per \
             intent: worker {:.0} µs, Postgres {:.0} µs, RabbitMQ {:.0} µs; machine busy {:.2} \
             of {cores} cores{}",
            drain.rate,
            drain.rate / relay.rate,
            drain.first_result.as_millis(),
            us_per(drain.cpu.worker, n),
            us_per(drain.cpu.postgres, n),
            us_per(drain.cpu.rabbit, n),
            drain.cpu.busy_cores(drain.elapsed),
            rolled_note(rolled_over_since(&wal))
        );
        relays.push(relay);
        drains.push(drain);
    }
    let half = drains.iter().map(|d| d.rate).sum::<f64>() / drains.len() as f64 / 2.0;
    let rate = args.latency_rate.unwrap_or(half);
    let mut judged = Judged::default();
    for r in 1..=args.latency_runs {
        if args.light_rate > 0.0 {
            let (floor, run) =
                latency_pair(&format!("light {r}"), args.light_rate, &downstream, &args).await?;
            judged.light.push((run.steady, floor.steady.p99));
        }
        let (floor, run) = latency_pair(&format!("{r}"), rate, &downstream, &args).await?;
        // The target is judged at half the drain rate only.
        if args.latency_rate.is_none() {
            judged
                .half
                .push((run.steady.p99, floor.steady.p99, run.rolled));
        }
    }
    report(&drains, &relays, &judged, half, args.light_rate);
    Ok(())
}

/// The latency runs the targets judge: at light load, each run's steady percentiles and its
/// broker floor's p99; at half the drain rate, each run's p99, its broker floor's p99, and
/// whether the broker's WAL rolled over during it.
#[derive(Default)]
struct Judged {
    light: Vec<(Percentiles, Duration)>,
    half: Vec<(Duration, Duration, bool)>,
}

/// One broker floor and then one worker latency run at `rate`, each printed on its line
/// (labelled `label`); returns both.
async fn latency_pair(
    label: &str,
    rate: f64,
    downstream: &NullDownstream,
    args: &Args,
) -> Result<(LatencyRun, LatencyRun)> {
    let cores = cores();
    let wal = before_phase(args).await?;
    let mut floor = bounded(
        &format!("broker floor {label}"),
        args,
        broker_floor(rate, args),
    )
    .await?;
    floor.rolled = rolled_over_since(&wal);
    println!(
        "broker floor {label}: {} at {rate:.0}/s: p50 {:.1} ms, p99 {:.1} ms{}; per message: \
         RabbitMQ {:.0} µs, bench {:.0} µs; machine busy {:.2} of {cores} cores; waiting for \
         a core: {}{}",
        floor.steady.count,
        ms(floor.steady.p50),
        ms(floor.steady.p99),
        floor.slow_note(),
        us_per(floor.cpu.rabbit, floor.intents),
        us_per(floor.cpu.bench, floor.intents),
        floor.busy(),
        floor.cpu.waited.per(floor.intents),
        rolled_note(floor.rolled)
    );
    let wal = before_phase(args).await?;
    let mut run = bounded(
        &format!("latency run {label}"),
        args,
        latency(rate, downstream, args),
    )
    .await?;
    run.rolled = rolled_over_since(&wal);
    let (steady, cold, n) = (run.steady, run.cold, run.intents);
    println!(
        "latency run {label}: {} intents at {rate:.0}/s: p50 {:.1} ms, p99 {:.1} ms{} \
         (first second: {} intents, p50 {:.1} ms, p99 {:.1} ms); per intent: worker {:.0} µs, \
         Postgres {:.0} µs, RabbitMQ {:.0} µs, bench {:.0} µs; machine busy {:.2} of {cores} \
         cores; waiting for a core: {}{}",
        steady.count,
        ms(steady.p50),
        ms(steady.p99),
        run.slow_note(),
        cold.count,
        ms(cold.p50),
        ms(cold.p99),
        us_per(run.cpu.worker, n),
        us_per(run.cpu.postgres, n),
        us_per(run.cpu.rabbit, n),
        us_per(run.cpu.bench, n),
        run.busy(),
        run.cpu.waited.per(n),
        rolled_note(run.rolled),
    );
    Ok((floor, run))
}

/// Each phase's own waits end at `--timeout-secs`; this also ends one stuck anywhere else (a
/// publish or an ack the broker never answers, a clean-up), a minute after that, with an error
/// naming the phase, rather than leaving the benchmark hung.
async fn bounded<T>(
    phase: &str,
    args: &Args,
    run: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let limit = args.timeout + Duration::from_secs(60);
    tokio::time::timeout(limit, run)
        .await
        .map_err(|_| anyhow::anyhow!("{phase}: not over after {} s", limit.as_secs()))?
        .with_context(|| phase.to_string())
}

/// The machine's cores, as its busy cores are printed against.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Rolls the broker's WAL over before a phase when `--wal-roll-over` asks for it; returns the
/// WAL files open as the phase starts, for [`rolled_over_since`].
async fn before_phase(args: &Args) -> Result<Vec<String>> {
    if args.wal_roll == WalRoll::Before {
        roll_over_broker_wal()
            .await
            .context("roll RabbitMQ's quorum WAL over")?;
    }
    Ok(broker_wal_files())
}

/// Whether the broker's open WAL file is another than at the phase's start (never when either
/// reading is empty: the broker's `/proc` unreadable).
fn rolled_over_since(at_start: &[String]) -> bool {
    let now = broker_wal_files();
    !at_start.is_empty() && !now.is_empty() && now != at_start
}

/// The end of a phase's line: whether the broker's WAL rolled over during it.
fn rolled_note(rolled: bool) -> &'static str {
    if rolled {
        "; RabbitMQ's WAL rolled over during it"
    } else {
        ""
    }
}

/// The drains' table and every target, PASS or FAIL.
fn report(drains: &[Drain], relays: &[Relay], judged: &Judged, half: f64, light_rate: f64) {
    println!();
    println!(
        "{:<6} {:>8} {:>8} {:>7} {:>10} {:>10} {:>10} {:>8} {:>8} {:>9}   relay: rabbit µs/msg",
        "run",
        "drain/s",
        "relay/s",
        "ratio",
        "worker µs",
        "pg µs",
        "rabbit µs",
        "bench µs",
        "rows/i",
        "WAL B/i",
    );
    for (i, (d, r)) in drains.iter().zip(relays).enumerate() {
        let w = d.written;
        println!(
            "{:<6} {:>8.0} {:>8.0} {:>7.3} {:>10.0} {:>10.0} {:>10.0} {:>8.0} {:>8} {:>9}   {:.0}",
            i + 1,
            d.rate,
            r.rate,
            d.rate / r.rate,
            us_per(d.cpu.worker, d.n),
            us_per(d.cpu.postgres, d.n),
            us_per(d.cpu.rabbit, d.n),
            us_per(d.cpu.bench, d.n),
            w.map_or("-".into(), |w| format!(
                "{:.3}",
                w.versions as f64 / d.n as f64
            )),
            w.map_or("-".into(), |w| format!(
                "{:.0}",
                w.wal_bytes as f64 / d.n as f64
            )),
            us_per(r.cpu.rabbit, d.n)
        );
    }
    let worst = |f: &dyn Fn(&Drain) -> f64| drains.iter().map(f).fold(f64::MIN, f64::max);
    let worst_ratio = drains
        .iter()
        .zip(relays)
        .map(|(d, r)| d.rate / r.rate)
        .fold(f64::MAX, f64::min);
    let rows = worst(&|d| {
        d.written
            .map_or(f64::MAX, |w| w.intent_versions as f64 / d.n as f64)
    });
    let all_rows = worst(&|d| {
        d.written
            .map_or(f64::MAX, |w| w.versions as f64 / d.n as f64)
    });
    let wal = worst(&|d| {
        d.written
            .map_or(f64::MAX, |w| w.wal_bytes as f64 / d.n as f64)
    });
    let light = light_target(&judged.light, light_rate);
    let half_target = half_target(&judged.half, half);
    let targets: [(&str, String, bool); 8] = [
        (
            "worker ≤ 80 µs per intent",
            format!("{:.0}", worst(&|d| us_per(d.cpu.worker, d.n))),
            worst(&|d| us_per(d.cpu.worker, d.n)) <= 80.0,
        ),
        (
            "Postgres ≤ 200 µs per intent",
            format!("{:.0}", worst(&|d| us_per(d.cpu.postgres, d.n))),
            worst(&|d| us_per(d.cpu.postgres, d.n)) <= 200.0,
        ),
        (
            "RabbitMQ ≤ 120 µs per intent",
            format!("{:.0}", worst(&|d| us_per(d.cpu.rabbit, d.n))),
            worst(&|d| us_per(d.cpu.rabbit, d.n)) <= 120.0,
        ),
        (
            "row versions ≤ 4 per intent",
            format!("{rows:.3} (every table {all_rows:.3})"),
            rows <= 4.0,
        ),
        (
            "WAL per intent ≤ 60 % of the reference",
            format!("{wal:.0} B ({:.0} %)", 100.0 * wal / WAL_REFERENCE),
            wal <= 0.6 * WAL_REFERENCE,
        ),
        (
            "drain ≥ 0.40 of the relay ceiling",
            format!("{worst_ratio:.3}"),
            worst_ratio >= 0.40,
        ),
        (
            "light load: p50 ≤ 5 ms, p99 ≤ 15 ms, every run",
            light.0,
            light.1,
        ),
        (
            "half the drain rate: p99 ≤ 50 ms, every run",
            half_target.0,
            half_target.1,
        ),
    ];
    println!();
    println!("targets (worst run):");
    for (what, value, ok) in targets {
        println!(
            "  {:<48} {:>36}  {}",
            what,
            value,
            if ok { "PASS" } else { "FAIL" }
        );
    }
}

/// The light-load target over `runs` (steady percentiles, broker floor p99): its figure and
/// whether every run met it.
fn light_target(runs: &[(Percentiles, Duration)], rate: f64) -> (String, bool) {
    if runs.is_empty() {
        return ("not run".into(), false);
    }
    let p50 = runs.iter().map(|(p, _)| p.p50).max().unwrap_or_default();
    let p99 = runs.iter().map(|(p, _)| p.p99).max().unwrap_or_default();
    let floor = runs.iter().map(|&(_, f)| f).max().unwrap_or_default();
    let ok = runs
        .iter()
        .all(|(p, _)| p.p50 <= Duration::from_millis(5) && p.p99 <= Duration::from_millis(15));
    (
        format!(
            "{:.1} / {:.1} ms worst of {} at {rate:.0}/s (floor p99 ≤ {:.1})",
            ms(p50),
            ms(p99),
            runs.len(),
            ms(floor)
        ),
        ok,
    )
}

/// The target at half the drain rate over `runs` (p99, the broker floor's p99 just before,
/// whether the broker's WAL rolled over during the run): each run's p99 ≤ 50 ms, or, where the
/// broker alone could not keep that (its floor's p99 over 40 ms), within 10 ms of the floor.
fn half_target(runs: &[(Duration, Duration, bool)], half: f64) -> (String, bool) {
    if runs.is_empty() {
        return ("not run".into(), false);
    }
    let met = |&(p99, floor, _): &(Duration, Duration, bool)| {
        p99 <= SLOW.max(floor + Duration::from_millis(10))
    };
    let worst = runs.iter().map(|&(p, _, _)| p).max().unwrap_or_default();
    let rolled = runs.iter().filter(|r| r.2).count();
    let by_floor = runs.iter().filter(|r| met(r) && r.0 > SLOW).count();
    let mut notes = String::new();
    if rolled > 0 {
        notes += &format!(", {rolled} with a WAL roll-over");
    }
    if by_floor > 0 {
        notes += &format!(", {by_floor} within 10 ms of a stalled floor");
    }
    (
        format!(
            "{:.1} ms worst of {}{notes} at {half:.0}/s",
            ms(worst),
            runs.len()
        ),
        runs.iter().all(met),
    )
}

/// The broker alone relaying the same messages: A (backlog) → here → B (confirmed) → ack A.
async fn relay_ceiling(messages: &Arc<Vec<(String, Vec<u8>)>>, args: &Args) -> Result<Relay> {
    let url = e2e::env::amqp_url();
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .context("connect")?;
    let id = uuid::Uuid::new_v4().simple().to_string();
    let (a, b) = (format!("cost.relay.a.{id}"), format!("cost.relay.b.{id}"));
    let result = async {
        let ch = confirm_channel(&conn).await?;
        declare_quorum(&ch, &a).await?;
        declare_quorum(&ch, &b).await?;
        let deadline = Instant::now() + args.timeout;
        publish_all(&ch, "", &a, messages, deadline).await?;
        let out = confirm_channel(&conn).await?;
        let (_consume_ch, mut consumer) = consume_on(&conn, &a, args.prefetch, "relay").await?;
        let before = CpuSample::take(&[]);
        let started = Instant::now();
        relay_batches(
            &mut consumer,
            &out,
            messages.len(),
            args.prefetch,
            deadline,
            ("", b.as_str()),
            |_| None,
        )
        .await?;
        let elapsed = started.elapsed();
        let after = CpuSample::take(&[]);
        Ok(Relay {
            rate: messages.len() as f64 / elapsed.as_secs_f64(),
            elapsed,
            cpu: after.since(&before),
        })
    }
    .await;
    if let Ok(ch) = conn.create_channel().await {
        for q in [&a, &b] {
            let _ = ch
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
    }
    let _ = conn.close(200, "".into()).await;
    result
}

/// Relays `n` deliveries as a careful relay does: takes what has arrived (up to half the
/// prefetch, so the broker keeps delivering meanwhile), publishes each (persistent, mandatory)
/// to `(exchange, routing key)` with the body `body_for` gives (else the delivery's own),
/// awaits those confirms together, then acks the lot with one `multiple` ack.
async fn relay_batches<'a>(
    consumer: &mut lapin::Consumer,
    out: &lapin::Channel,
    n: usize,
    prefetch: u16,
    deadline: Instant,
    (exchange, key): (&str, &str),
    body_for: impl Fn(&lapin::message::Delivery) -> Option<&'a [u8]>,
) -> Result<()> {
    let batch = (prefetch as usize / 2).max(1);
    let mut relayed = 0usize;
    while relayed < n {
        let mut deliveries = Vec::with_capacity(batch);
        let first = tokio::time::timeout_at(deadline, consumer.next())
            .await
            .context("relay: no delivery before the deadline")?
            .context("relay consumer ended")?
            .context("relay delivery")?;
        deliveries.push(first);
        while deliveries.len() < batch {
            match futures_lite::future::poll_once(consumer.next()).await {
                Some(Some(d)) => deliveries.push(d.context("relay delivery")?),
                _ => break,
            }
        }
        let mut confirms = Vec::with_capacity(deliveries.len());
        for d in &deliveries {
            confirms.push(
                out.basic_publish(
                    exchange.into(),
                    key.into(),
                    BasicPublishOptions::default(),
                    body_for(d).unwrap_or(&d.data),
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .context("relay publish")?,
            );
        }
        for c in confirms {
            check_confirm(c, deadline).await?;
        }
        let last = deliveries.last().expect("at least one delivery");
        last.acker
            .ack(BasicAckOptions { multiple: true })
            .await
            .context("relay ack")?;
        relayed += deliveries.len();
    }
    Ok(())
}

/// The tools file of the runs: one `none` tool on the null downstream.
fn tools(env: &Env, downstream: &NullDownstream) -> std::path::PathBuf {
    env.write_tools(&format!(
        "[tools.{TOOL}]\nurl = \"http://127.0.0.1:{}/cost\"\nreceipt_id = \"/receipt_id\"\n\
         receipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\n\
         recovery = \"none\"\ntimeout_ms = 5000\n",
        downstream.port
    ))
}

/// Applies the migrations and declares the topology, so a worker starting later does neither.
async fn prepare(env: &Env, opts: &WorkerOptions) -> Result<()> {
    let status = std::process::Command::new(e2e::procs::bin_dir().join("worker"))
        .arg("migrate")
        .env_clear()
        .env("DATABASE_URL", &env.db_url)
        .env("RUST_LOG", "warn")
        .status()
        .context("run worker migrate")?;
    ensure!(status.success(), "worker migrate failed: {status}");
    let topology = worker::config::Topology {
        delivery_limit: opts.delivery_limit,
        queue_delivery_limit: worker::config::Topology::default_queue_delivery_limit(
            opts.delivery_limit,
        ),
        ..env.topology.clone()
    };
    let conn = worker::amqp::connect(&env.amqp_url, "cost-setup")
        .await
        .context("connect")?;
    worker::amqp::topology::declare(&conn, &topology, Default::default())
        .await
        .context("declare topology")?;
    let _ = conn.close(200, "".into()).await;
    Ok(())
}

fn worker_options(env: &Env, downstream: &NullDownstream, args: &Args) -> WorkerOptions {
    let mut opts = WorkerOptions::new(tools(env, downstream)).env("WORKER_MIGRATE", "false");
    opts.prefetch = args.prefetch;
    opts.lease_secs = 30;
    opts.recovery_interval_ms = 1000;
    for (k, v) in &args.worker_env {
        opts = opts.env(k, v);
    }
    opts
}

/// One worker draining a backlog of every message.
async fn drain(
    messages: &Arc<Vec<(String, Vec<u8>)>>,
    downstream: &NullDownstream,
    args: &Args,
) -> Result<Drain> {
    let env = Env::new().await;
    let result = drain_in(&env, messages, downstream, args).await;
    cleanup(env).await;
    result
}

async fn drain_in(
    env: &Env,
    messages: &Arc<Vec<(String, Vec<u8>)>>,
    downstream: &NullDownstream,
    args: &Args,
) -> Result<Drain> {
    let n = messages.len();
    let opts = worker_options(env, downstream, args);
    prepare(env, &opts).await?;
    let conn = Connection::connect(&env.amqp_url, ConnectionProperties::default())
        .await
        .context("connect publisher")?;
    let ch = confirm_channel(&conn).await?;
    let deadline = Instant::now() + args.timeout;
    publish_all(
        &ch,
        &env.topology.intents_exchange,
        TENANT,
        messages,
        deadline,
    )
    .await?;
    let _ = conn.close(200, "".into()).await;
    let mut follower =
        Follower::follow(&env.amqp_url, &env.topology.results_exchange, TENANT, None)
            .await
            .context("follow results")?;
    let writes_before = downstream.requests.load(Ordering::SeqCst);
    // Settle the statistics of the set-up, then sample and start the worker.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let written_before = Written::take(env).await;
    let own_backends = run_backends(env).await.unwrap_or_default();
    let before = CpuSample::take(&[]);
    let started = Instant::now();
    let mut worker = Worker::spawn(env, "cost-w", &opts);
    let pid = worker.pid();
    let mut succeeded: HashSet<String> = HashSet::with_capacity(n);
    let mut first_result = None;
    while succeeded.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        match follower.next(left).await.context("read results")? {
            Some(ev) if ev.status == Status::Succeeded => {
                first_result.get_or_insert_with(|| started.elapsed());
                succeeded.insert(ev.action_id);
            }
            Some(ev) => bail!("unexpected result {:?} for {}", ev.status, ev.action_id),
            None => bail!(
                "only {} of {n} succeeded before the deadline",
                succeeded.len()
            ),
        }
    }
    let elapsed = started.elapsed();
    let after = CpuSample::take(&[pid]);
    // The worker's pid was unknown at the first sample: it started from zero.
    let cpu = after.since(&before);
    ensure!(worker.is_running(), "the worker exited during the drain");
    // A live backend hands its table counters to the statistics only now and then (up to
    // seconds late once it is idle); one that exits hands them over as it goes. So the rows
    // are counted once the worker's backends are gone.
    drop(worker);
    backends_gone(env, &own_backends).await;
    let written = written_before
        .zip(Written::take(env).await)
        .map(|(a, b)| b.since(&a));
    let _ = follower.close().await;
    let states = state_counts(env).await?;
    ensure!(
        states.get("succeeded").copied() == Some(n as i64) && states.len() == 1,
        "ledger states after the drain: {states:?}"
    );
    let writes = downstream.requests.load(Ordering::SeqCst) - writes_before;
    ensure!(
        writes == n as u64,
        "{writes} downstream writes for {n} intents"
    );
    Ok(Drain {
        rate: n as f64 / elapsed.as_secs_f64(),
        elapsed,
        first_result: first_result.unwrap_or(elapsed),
        cpu,
        written,
        n,
    })
}

/// Waits (up to 10 s, then warns) until the only backends of the run's database are `own`, the
/// benchmark's.
async fn backends_gone(env: &Env, own: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left: Vec<u32> = run_backends(env)
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|pid| !own.contains(pid))
            .collect();
        if left.is_empty() {
            return;
        }
        if Instant::now() >= deadline {
            eprintln!("warning: backends {left:?} still connected; rows counted without them");
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Latency percentiles over a set of intents.
#[derive(Debug, Clone, Copy)]
struct Percentiles {
    p50: Duration,
    p99: Duration,
    count: usize,
}

impl Percentiles {
    /// Zero durations when there are none.
    fn of(mut latencies: Vec<Duration>) -> Percentiles {
        latencies.sort();
        let at = |p: usize| {
            if latencies.is_empty() {
                Duration::ZERO
            } else {
                pct(&latencies, p)
            }
        };
        Percentiles {
            p50: at(50),
            p99: at(99),
            count: latencies.len(),
        }
    }
}

/// A latency run: percentiles after the first second and of the first second, and the CPU
/// every component used from the first publish to the last result.
struct LatencyRun {
    steady: Percentiles,
    cold: Percentiles,
    /// Of the intents after the first second, those over the target's 50 ms: how many, and
    /// when the first and the last of them were published (from the run's start): a stall
    /// shows as many in a short span.
    slow: Option<(usize, Duration, Duration)>,
    cpu: CpuSplit,
    intents: usize,
    elapsed: Duration,
    /// Whether the broker's WAL rolled over during the run.
    rolled: bool,
}

/// The latency target of one intent.
const SLOW: Duration = Duration::from_millis(50);

impl LatencyRun {
    /// ", N over 50 ms published between a and b s in", or nothing.
    fn slow_note(&self) -> String {
        self.slow.map_or(String::new(), |(n, first, last)| {
            format!(
                ", {n} over 50 ms published {:.2}–{:.2} s in",
                first.as_secs_f64(),
                last.as_secs_f64()
            )
        })
    }

    /// Cores of the machine busy over the run.
    fn busy(&self) -> f64 {
        self.cpu.busy_cores(self.elapsed)
    }
}

/// Open-loop latency at `rate`: over the intents published after the first second, and over
/// those of the first second.
async fn latency(rate: f64, downstream: &NullDownstream, args: &Args) -> Result<LatencyRun> {
    let env = Env::new().await;
    let result = latency_in(&env, rate, downstream, args).await;
    cleanup(env).await;
    result
}

async fn latency_in(
    env: &Env,
    rate: f64,
    downstream: &NullDownstream,
    args: &Args,
) -> Result<LatencyRun> {
    let opts = worker_options(env, downstream, args);
    prepare(env, &opts).await?;
    let worker = Worker::start(env, "cost-lat", &opts).await;
    let pid = worker.pid();
    let count = (rate * args.latency_secs as f64).ceil() as usize;
    let messages = build_messages(count, TENANT, TOOL);
    let follower = Follower::follow(&env.amqp_url, &env.topology.results_exchange, TENANT, None)
        .await
        .context("follow results")?;
    let target = (
        env.amqp_url.as_str(),
        env.topology.intents_exchange.as_str(),
        TENANT,
    );
    open_loop(target, messages, follower, &[pid], rate, args).await
}

/// Publishes `messages` open-loop at `rate` to `(url, exchange, routing key)` and reads a
/// `succeeded` result for each from `follower`: publish → result, apart for the first second;
/// the CPU of every component (`pids` the worker's) from the first publish to the last result.
async fn open_loop(
    (url, exchange, routing_key): (&str, &str, &str),
    messages: Vec<(String, Vec<u8>)>,
    mut follower: Follower,
    pids: &[u32],
    rate: f64,
    args: &Args,
) -> Result<LatencyRun> {
    let count = messages.len();
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .context("connect publisher")?;
    let ch = confirm_channel(&conn).await?;
    let index: std::collections::HashMap<String, usize> = messages
        .iter()
        .enumerate()
        .map(|(i, (key, _))| {
            let action = key.split_once(':').map_or(key.as_str(), |(_, a)| a);
            (action.to_string(), i)
        })
        .collect();
    let before = CpuSample::take(pids);
    let started = Instant::now();
    let deadline = started + args.timeout;
    let sent: Arc<std::sync::Mutex<Vec<Option<Instant>>>> =
        Arc::new(std::sync::Mutex::new(vec![None; count]));
    let publisher = {
        let sent = sent.clone();
        let (exchange, routing_key) = (exchange.to_string(), routing_key.to_string());
        tokio::spawn(async move {
            publish_open_loop(
                &ch,
                &exchange,
                &routing_key,
                &messages,
                rate,
                started,
                deadline,
                |i| sent.lock().expect("not poisoned")[i] = Some(Instant::now()),
            )
            .await?;
            Ok::<_, anyhow::Error>(ch)
        })
    };
    let mut latencies = Vec::with_capacity(count);
    let mut slow: Option<(usize, Duration, Duration)> = None;
    let mut cold = Vec::new();
    let warm = started + Duration::from_secs(1);
    let mut done = 0usize;
    while done < count {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(ev) = follower.next(left).await.context("read results")? else {
            bail!("only {done} of {count} answered before the deadline");
        };
        if ev.status != Status::Succeeded {
            bail!("unexpected result {:?} for {}", ev.status, ev.action_id);
        }
        let now = Instant::now();
        done += 1;
        let at = index
            .get(&ev.action_id)
            .and_then(|&i| sent.lock().expect("not poisoned")[i]);
        match at {
            Some(at) if at >= warm => {
                let took = now - at;
                if took > SLOW {
                    let since = at - started;
                    let (n, first, last) = slow.get_or_insert((0, since, since));
                    *n += 1;
                    *first = (*first).min(since);
                    *last = (*last).max(since);
                }
                latencies.push(took);
            }
            Some(at) => cold.push(now - at),
            None => {}
        }
    }
    let elapsed = started.elapsed();
    let cpu = CpuSample::take(pids).since(&before);
    let _ = publisher.await.context("publisher task")??;
    let _ = conn.close(200, "".into()).await;
    let _ = follower.close().await;
    ensure!(!latencies.is_empty(), "no intent after the first second");
    Ok(LatencyRun {
        steady: Percentiles::of(latencies),
        cold: Percentiles::of(cold),
        slow,
        cpu,
        intents: count,
        elapsed,
        rolled: false,
    })
}

/// The broker's part of a latency run at `rate`, with no worker: the same publisher sends the
/// same intents to a quorum queue; a relay here consumes it with the worker's prefetch and, for
/// each delivery, publishes the `succeeded` result event the worker would send (its size, its
/// routing key) to a topic exchange with a confirm, then acks the intents with one `multiple`
/// ack; the same follower reads the results. What the broker and its clients cost at that rate
/// on this machine, and the latency they leave the worker.
async fn broker_floor(rate: f64, args: &Args) -> Result<LatencyRun> {
    let url = e2e::env::amqp_url();
    let id = uuid::Uuid::new_v4().simple().to_string();
    let (queue, exchange) = (
        format!("cost.floor.{id}"),
        format!("cost.floor.results.{id}"),
    );
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .context("connect")?;
    let result = async {
        declare_quorum(&conn.create_channel().await?, &queue).await?;
        let follower = Follower::follow(&url, &exchange, TENANT, None)
            .await
            .context("follow results")?;
        let count = (rate * args.latency_secs as f64).ceil() as usize;
        let messages = build_messages(count, TENANT, TOOL);
        let ids: std::collections::HashMap<String, usize> = messages
            .iter()
            .enumerate()
            .map(|(i, (key, _))| (key.clone(), i))
            .collect();
        let results: Vec<Vec<u8>> = messages
            .iter()
            .map(|(key, _)| result_event(key))
            .collect::<Result<_>>()?;
        let out = confirm_channel(&conn).await?;
        let (consume_ch, mut consumer) = consume_on(&conn, &queue, args.prefetch, "floor").await?;
        let key = protocol::result_routing_key(TENANT, Some(TENANT));
        let deadline = Instant::now() + args.timeout;
        let (prefetch, exchange_out) = (args.prefetch, exchange.clone());
        let relay = tokio::spawn(async move {
            let body_for = |d: &lapin::message::Delivery| {
                let id = d.properties.message_id().as_ref()?;
                ids.get(id.as_str()).map(|&i| results[i].as_slice())
            };
            let relayed = relay_batches(
                &mut consumer,
                &out,
                count,
                prefetch,
                deadline,
                (&exchange_out, &key),
                body_for,
            )
            .await;
            drop(consume_ch);
            relayed
        });
        let run = open_loop((&url, "", &queue), messages, follower, &[], rate, args).await;
        if run.is_err() {
            relay.abort();
        }
        let run = run?;
        relay.await.context("floor relay")??;
        Ok(run)
    }
    .await;
    if let Ok(ch) = conn.create_channel().await {
        let _ = ch
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        let _ = ch
            .exchange_delete(exchange.as_str().into(), Default::default())
            .await;
    }
    let _ = conn.close(200, "".into()).await;
    result
}

/// The `succeeded` event the worker publishes for the intent with `key` (`<tenant>:<action>`),
/// as JSON.
fn result_event(key: &str) -> Result<Vec<u8>> {
    let action_id = key.split_once(':').map_or(key, |(_, a)| a);
    let event = protocol::ResultEvent {
        tenant: TENANT.into(),
        action_id: action_id.into(),
        tool: TOOL.into(),
        status: Status::Succeeded,
        receipt: Some(serde_json::json!({
            "receipt_id": format!("r-{action_id}"),
            "idempotency_key": key,
        })),
        next_action: None,
        attempts: 1,
        message: "The action succeeded; the receipt is attached.".into(),
        fingerprint: Some("0".repeat(64)),
        reason: None,
        detail: None,
        verified_by: None,
        operator: None,
        remote_id: None,
        uncertainty: None,
        retry_after_ms: None,
        compensates: None,
        compensated_by: None,
        event_id: uuid::Uuid::new_v4().to_string(),
        occurred_at: chrono::Utc::now().to_rfc3339(),
    };
    Ok(serde_json::to_vec(&event)?)
}
