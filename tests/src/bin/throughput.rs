//! Throughput benchmark: intents/s through real worker processes (broker → ledger → downstream
//! → outbox → results), reported as a ratio to the broker alone measured in the same run.
//!
//! ```sh
//! cargo build --release --workspace          # worker binary (fault points compiled in, inert)
//! INTENT_BIN_DIR=target/release \
//!   cargo run --release -p e2e --bin throughput -- [--intents N] [--workers 1,2] [--prefetch P] \
//!     [--cluster] [--shards 1,3] [--tracing off,0.01,1]
//! ```
//!
//! `--cluster` runs every phase on a 3-node RabbitMQ cluster of the benchmark's own
//! (`e2e::rabbit_cluster`, with the consistent-hash exchange plugin) instead of the shared
//! broker: the baseline's quorum queue and the agent's connections on node 0, the workers given
//! all three nodes. `--shards S[,S...]` runs every worker count once per shard count
//! (`WORKER_INTENT_SHARDS`): S quorum queues fed by the consistent-hash exchange, their leaders
//! spread over the nodes.
//!
//! `--tracing M[,M...]` runs every worker count once per tracing mode: `off` (no exporter, the
//! default), or a sampling ratio (`0.01`, `1`): span export over OTLP/HTTP to a receiver in this
//! process that decodes and counts the spans (`e2e::OtlpReceiver::start_counting`), with
//! `OTEL_TRACES_SAMPLER=parentbased_traceidratio` at that ratio (the benchmark's intents carry
//! no trace context, so each is a root sampled at the ratio).
//!
//! Needs Postgres and RabbitMQ as the e2e suites do (`TEST_DATABASE_URL`, `TEST_AMQP_URL`).
//! Without `INTENT_BIN_DIR` the directory of this executable is used (target/release under
//! `cargo run --release`).
//!
//! Phases:
//! 1. baseline: a durable quorum queue; N persistent messages of an intent's size published with
//!    confirms (up to 256 outstanding), consumed with prefetch P and one ack each; first publish
//!    to last ack. Run before and after the worker runs; ratios use the mean of the two.
//! 2. for each K: a fresh database and broker names, K workers, an in-process null downstream
//!    (HTTP/1.1 keep-alive, answers 201 with a receipt at once), N distinct intents published the
//!    same way to the intents exchange; first publish to the N-th distinct `succeeded` result.
//!    Verified afterwards: every operation is `succeeded`, the downstream saw exactly N writes.
//! 3. open-loop latency (`--latency-secs S`, 0 skips it), at 200/s and at half the K=1 rate:
//!    first the broker floor (publisher -> quorum queue A -> a relay here that republishes to
//!    quorum queue B with a confirm and then acks A -> a follower on B), then one worker on a
//!    fresh database. Printed: publish -> received p50/p90/p99/max for both, and for the worker a
//!    per-stage breakdown from the run's ledger timestamps (see [`Stages`]).
//!
//! Also printed: transactions committed in the run's database per intent (`pg_stat_database`,
//! read-only ones included), WAL fsyncs per intent (`pg_stat_wal`, cluster-wide), and CPU used
//! during the measured interval by the workers, all Postgres processes, RabbitMQ (`beam.smp`),
//! this process (publisher, follower, null downstream), and the busy time of the whole machine.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{anyhow, bail, ensure, Context as _, Result};
use chrono::{DateTime, Utc};
use e2e::bench::{
    build_messages, check_confirm, confirm_channel, consume_on, declare_quorum, pct, peak_rss_kib,
    publish_all, publish_open_loop, run_backends, state_counts, us_per, wal_syncs, xact_commit,
    CpuSample, CpuSplit, NullDownstream, Written,
};
use e2e::{cleanup, Env, Worker, WorkerOptions};
use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{
    Acker, BasicProperties, Channel, Connection, ConnectionProperties, Consumer, PublisherConfirm,
};
use protocol::Status;
use publisher::Follower;
use tokio::time::{sleep, timeout_at, Instant};

const TENANT: &str = "bench";
const TOOL: &str = "bench";
/// Long enough for every backend's pending statistics to reach `pg_stat_*` (flushed at most
/// once a second).
const STATS_SETTLE: Duration = Duration::from_millis(1500);

const USAGE: &str = "usage: throughput [--intents N (5000)] [--workers K[,K...] (1,2)] \
[--prefetch P (64)] [--timeout-secs S (60, per phase)] [--latency-secs S (5; 0 = skip)] \
[--large-ledger] [--statements] [--cluster] [--shards S[,S...] (1)] [--tracing M[,M...] (off)]

--large-ledger  pre-load 5,000,000 finished operations (with history and outbox rows as
                retention leaves them) into each run's ledger before measuring.
--statements    count the statements the workers send to Postgres (one round trip each) from
                the server log: sets log_min_duration_statement = 0 on the run's own database
                only; needs the log readable at PG_LOG (/var/log/postgresql/postgresql-15-main.log).
--cluster       every phase on a 3-node RabbitMQ cluster of the benchmark's own (Debian's
                rabbitmq-server binaries, see e2e::rabbit_cluster) instead of TEST_AMQP_URL.
--shards S,...  each worker count once per shard count (WORKER_INTENT_SHARDS); more than one
                shard needs the rabbitmq_consistent_hash_exchange plugin (on with --cluster).
--tracing M,... each worker count once per tracing mode: off, or a sampling ratio in (0, 1]
                (spans exported over OTLP/HTTP to a counting receiver in this process).

Set INTENT_BIN_DIR to the directory holding the release `worker` binary (default: the
directory of this executable). Postgres/RabbitMQ: TEST_DATABASE_URL / TEST_AMQP_URL.";

struct Args {
    intents: usize,
    workers: Vec<usize>,
    prefetch: u16,
    phase_timeout: Duration,
    latency_secs: u64,
    large_ledger: bool,
    statements: bool,
    cluster: bool,
    shards: Vec<u16>,
    /// Span export per run: None = off, Some(ratio).
    tracing: Vec<Option<f64>>,
}

/// Where the phases meet the broker.
struct Broker {
    /// The agent's side: the baseline, the benchmark's publisher and follower.
    agent_url: String,
    /// What the workers are given (`AMQP_URL`): one URL, or every node of the cluster.
    worker_url: String,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        intents: 5000,
        workers: vec![1, 2],
        prefetch: 64,
        phase_timeout: Duration::from_secs(60),
        latency_secs: 5,
        large_ledger: false,
        statements: false,
        cluster: false,
        shards: vec![1],
        tracing: vec![None],
    };
    // Switches without a value, then the `--flag value` pairs.
    let mut raw: Vec<String> = std::env::args().skip(1).collect();
    raw.retain(|a| match a.as_str() {
        "--large-ledger" => {
            args.large_ledger = true;
            false
        }
        "--statements" => {
            args.statements = true;
            false
        }
        "--cluster" => {
            args.cluster = true;
            false
        }
        _ => true,
    });
    for (flag, value) in e2e::flags::pairs_from(raw, USAGE)? {
        match flag.as_str() {
            "--latency-secs" => args.latency_secs = value.parse().context("--latency-secs")?,
            "--intents" => args.intents = value.parse().context("--intents")?,
            "--prefetch" => args.prefetch = value.parse().context("--prefetch")?,
            "--timeout-secs" => {
                args.phase_timeout = Duration::from_secs(value.parse().context("--timeout-secs")?)
            }
            "--workers" => {
                args.workers = value
                    .split(',')
                    .map(|k| k.trim().parse::<usize>())
                    .collect::<Result<_, _>>()
                    .context("--workers: comma-separated counts")?
            }
            "--shards" => {
                args.shards = value
                    .split(',')
                    .map(|s| s.trim().parse::<u16>())
                    .collect::<Result<_, _>>()
                    .context("--shards: comma-separated counts")?
            }
            "--tracing" => {
                args.tracing = value
                    .split(',')
                    .map(|m| match m.trim() {
                        "off" => Ok(None),
                        r => r
                            .parse::<f64>()
                            .ok()
                            .filter(|r| *r > 0.0 && *r <= 1.0)
                            .map(Some)
                            .with_context(|| {
                                format!("--tracing: {r:?} is not off or a ratio in (0, 1]")
                            }),
                    })
                    .collect::<Result<_>>()?
            }
            other => bail!("unknown argument {other}\n{USAGE}"),
        }
    }
    ensure!(args.intents > 0, "--intents must be at least 1");
    ensure!(args.prefetch > 0, "--prefetch must be at least 1");
    ensure!(
        !args.workers.is_empty() && args.workers.iter().all(|&k| (1..=16).contains(&k)),
        "--workers: each count between 1 and 16"
    );
    ensure!(
        !args.shards.is_empty() && args.shards.iter().all(|&s| (1..=64).contains(&s)),
        "--shards: each count between 1 and 64"
    );
    Ok(args)
}

fn main() {
    // The error chain, without the backtrace RUST_BACKTRACE would add to a returned anyhow error.
    if let Err(e) = start() {
        eprintln!("throughput: error: {e:#}");
        std::process::exit(1);
    }
}

fn start() -> Result<()> {
    let args = parse_args()?;
    if std::env::var_os("INTENT_BIN_DIR").is_none_or(|d| d.is_empty()) {
        let exe = std::env::current_exe().context("current exe")?;
        let dir = exe.parent().context("directory of this executable")?;
        // Single-threaded here: no runtime has started yet.
        std::env::set_var("INTENT_BIN_DIR", dir);
    }
    let bin_dir = std::path::PathBuf::from(std::env::var_os("INTENT_BIN_DIR").unwrap_or_default());
    ensure!(
        bin_dir.join("worker").exists(),
        "{} is missing: run `cargo build --release --workspace` and set INTENT_BIN_DIR=target/release",
        bin_dir.join("worker").display()
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    runtime.block_on(run(args, bin_dir))
}

/// One measured phase.
struct Phase {
    label: String,
    elapsed: Duration,
    published: Duration,
    count: usize,
    commits: Option<i64>,
    wal_syncs: Option<i64>,
    /// What the run wrote into its own database (None for the broker baseline).
    written: Option<Written>,
    /// CPU ticks of the Postgres backends serving the run's database (other databases' work
    /// on a shared server excluded).
    run_pg_ticks: Option<u64>,
    cpu: CpuSplit,
    /// Peak resident set of the largest worker (VmHWM), KiB.
    rss_kib: Option<u64>,
}

impl Phase {
    fn rate(&self) -> f64 {
        self.count as f64 / self.elapsed.as_secs_f64()
    }
}

async fn run(args: Args, bin_dir: std::path::PathBuf) -> Result<()> {
    let n = args.intents;
    println!(
        "throughput: N={n} P={} workers={:?} shards={:?}{} worker binary={} started={}",
        args.prefetch,
        args.workers,
        args.shards,
        if args.cluster {
            " on a 3-node cluster"
        } else {
            ""
        },
        bin_dir.join("worker").display(),
        chrono::Utc::now().format("%Y-%m-%d %H:%M:%S UTC")
    );
    let messages = Arc::new(build_messages(n, TENANT, TOOL));
    let body_len = messages[0].1.len();
    println!("intent body ≈ {body_len} bytes");

    let downstream = NullDownstream::start().await?;
    let cluster = if args.cluster {
        let c =
            e2e::rabbit_cluster::RabbitCluster::start(e2e::rabbit_cluster::RabbitClusterOptions {
                plugins: &["rabbitmq_consistent_hash_exchange"],
            })
            .await;
        println!("cluster started in {:.1} s", c.start_time.as_secs_f64());
        Some(c)
    } else {
        None
    };
    let broker = match &cluster {
        Some(c) => Broker {
            agent_url: c.amqp_url(0),
            worker_url: c.amqp_urls(),
        },
        None => Broker {
            agent_url: e2e::env::amqp_url(),
            worker_url: e2e::env::amqp_url(),
        },
    };
    let amqp_url = broker.agent_url.clone();

    let mut phases = Vec::new();
    let pre = baseline(&amqp_url, &messages, args.prefetch, args.phase_timeout)
        .await
        .context("baseline (before)")?;
    report(&pre, None);
    phases.push(pre);
    let mut runs = Vec::new();
    let receiver = args
        .tracing
        .iter()
        .any(Option::is_some)
        .then(e2e::OtlpReceiver::start_counting);
    for &shards in &args.shards {
        for &k in &args.workers {
            for &tracing in &args.tracing {
                let export = tracing.zip(receiver.as_ref());
                let phase = worker_run(k, shards, export, &broker, &messages, &downstream, &args)
                    .await
                    .with_context(|| format!("worker run K={k} shards={shards}"))?;
                report(&phase, None);
                runs.push(phase);
            }
        }
    }
    let mut latencies = Vec::new();
    if args.latency_secs > 0 {
        // Light load, then half of the one-worker maximum measured above (if K=1 ran).
        let mut rates = vec![200.0];
        if let Some(p) = runs.iter().find(|p| p.label.starts_with("worker K=1")) {
            rates.push((p.rate() / 2.0).round());
        }
        for rate in rates {
            let (floor, l) = latency_run(rate, args.latency_secs, &broker, &downstream, &args)
                .await
                .with_context(|| format!("latency at {rate}/s"))?;
            floor.print();
            l.print();
            latencies.push(floor);
            latencies.push(l);
        }
    }
    let mut post = baseline(&amqp_url, &messages, args.prefetch, args.phase_timeout)
        .await
        .context("baseline (after)")?;
    post.label = "baseline (after)".into();
    report(&post, None);
    phases.push(post);

    let base = (phases[0].rate() + phases[1].rate()) / 2.0;
    println!();
    println!(
        "N={n} P={} (rates: first publish to last ack / to the N-th succeeded result)",
        args.prefetch
    );
    println!(
        "{:<18} {:>9} {:>7} {:>8} {:>8} {:>10} {:>10} {:>8}   cpu cores: {}",
        "phase",
        "per s",
        "ratio",
        "elapsed",
        "publish",
        "commits/i",
        "fsyncs/i",
        "rss MiB",
        CpuSplit::HEADER
    );
    for p in phases
        .iter()
        .take(1)
        .chain(runs.iter())
        .chain(phases.iter().skip(1))
    {
        report(p, Some(base));
    }
    println!(
        "baseline mean {base:.0} msgs/s; commits/i = transactions committed in the run's database \
         per intent (read-only ones too); fsyncs/i = pg_stat_wal.wal_sync per intent, cluster-wide; \
         rss = peak VmHWM of the largest worker"
    );
    for l in &latencies {
        l.print();
    }
    if latencies.iter().any(|l| l.stages.is_some()) {
        println!("{STAGES_LEGEND}");
    }
    println!();
    println!(
        "{:<18} {:>9} {:>6} {:>9} {:>9} {:>11} {:>11}   (per intent)",
        "phase", "rows/i", "hot%", "heap B/i", "index B/i", "worker µs", "pg(run) µs"
    );
    for p in &runs {
        if let Some(w) = &p.written {
            let per = |v: i64| v as f64 / p.count as f64;
            let us = |ticks: u64| us_per(ticks, p.count);
            println!(
                "{:<18} {:>9.2} {:>6.0} {:>9.0} {:>9.0} {:>11.0} {:>11}",
                p.label,
                per(w.versions),
                100.0 * w.hot as f64 / w.updates.max(1) as f64,
                per(w.heap_bytes),
                per(w.index_bytes),
                us(p.cpu.worker),
                p.run_pg_ticks
                    .map_or("-".into(), |t| format!("{:.0}", us(t)))
            );
        }
    }
    println!(
        "rows/i = row versions written (inserts + updates + deletes, every table); hot% = updates \
         that touched no index (HOT); heap/index B/i = growth of tables / indexes; worker µs and \
         pg(run) µs = CPU time of the worker processes and of the Postgres backends connected to \
         the run's database (shared Postgres processes such as the WAL writer not included). These \
         count work, not time: they depend far less on what else the machine runs than rates do."
    );
    Ok(())
}

fn report(p: &Phase, base: Option<f64>) {
    let ratio = base.map_or("-".to_string(), |b| format!("{:.3}", p.rate() / b));
    let per = |v: Option<i64>| {
        v.map_or("-".to_string(), |v| {
            format!("{:.2}", v as f64 / p.count as f64)
        })
    };
    println!(
        "{:<18} {:>9.0} {:>7} {:>7.2}s {:>7.2}s {:>10} {:>10} {:>8}   {}",
        p.label,
        p.rate(),
        ratio,
        p.elapsed.as_secs_f64(),
        p.published.as_secs_f64(),
        per(p.commits),
        per(p.wal_syncs),
        p.rss_kib
            .map_or("-".to_string(), |k| format!("{:.1}", k as f64 / 1024.0)),
        p.cpu.cores(p.elapsed)
    );
}

// ---------------------------------------------------------------------------------------------
// Publishing with a window of outstanding confirms (the same code for both phases)

// ---------------------------------------------------------------------------------------------
// Baseline: the broker alone

async fn baseline(
    amqp_url: &str,
    messages: &Arc<Vec<(String, Vec<u8>)>>,
    prefetch: u16,
    phase_timeout: Duration,
) -> Result<Phase> {
    let queue = format!("bench.baseline.{}", uuid::Uuid::new_v4().simple());
    let consumer_conn = Connection::connect(amqp_url, ConnectionProperties::default())
        .await
        .with_context(|| format!("connect to RabbitMQ at {amqp_url}"))?;
    let publisher_conn = Connection::connect(amqp_url, ConnectionProperties::default())
        .await
        .context("connect publisher")?;
    let result = baseline_on(
        &consumer_conn,
        &publisher_conn,
        &queue,
        messages,
        prefetch,
        phase_timeout,
    )
    .await;
    // Always delete the queue, also after a failure.
    let deleted = async {
        let ch = publisher_conn.create_channel().await?;
        ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await
    }
    .await;
    if let Err(e) = deleted {
        eprintln!("warning: could not delete baseline queue {queue}: {e}");
    }
    let _ = publisher_conn.close(200, "".into()).await;
    let _ = consumer_conn.close(200, "".into()).await;
    result
}

async fn baseline_on(
    consumer_conn: &Connection,
    publisher_conn: &Connection,
    queue: &str,
    messages: &Arc<Vec<(String, Vec<u8>)>>,
    prefetch: u16,
    phase_timeout: Duration,
) -> Result<Phase> {
    let n = messages.len();
    let ch = consumer_conn
        .create_channel()
        .await
        .context("open channel")?;
    declare_quorum(&ch, queue).await?;
    ch.basic_qos(prefetch, BasicQosOptions::default())
        .await
        .context("basic.qos")?;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "bench-baseline".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .context("basic.consume")?;
    let pub_ch = confirm_channel(publisher_conn).await?;

    let cpu_before = CpuSample::take(&[]);
    let started = Instant::now();
    let deadline = started + phase_timeout;
    let reader = tokio::spawn(async move {
        let mut acked = 0usize;
        while acked < n {
            let delivery = match timeout_at(deadline, consumer.next()).await {
                Err(_) => bail!("only {acked} of {n} messages consumed before the phase deadline"),
                Ok(None) => bail!("consumer closed after {acked} of {n} messages"),
                Ok(Some(d)) => d.context("delivery")?,
            };
            ensure!(
                !delivery.redelivered,
                "unexpected redelivery in the baseline"
            );
            delivery
                .ack(BasicAckOptions::default())
                .await
                .context("basic.ack")?;
            acked += 1;
        }
        Ok(Instant::now())
    });
    let published = publish_all(&pub_ch, "", queue, messages, deadline).await;
    let published = match published {
        Ok(()) => started.elapsed(),
        Err(e) => {
            reader.abort();
            return Err(e.context("publishing the baseline"));
        }
    };
    let last_ack = reader.await.context("baseline consumer task")??;
    let cpu = CpuSample::take(&[]).since(&cpu_before);
    Ok(Phase {
        label: "baseline (before)".into(),
        elapsed: last_ack - started,
        published,
        count: n,
        commits: None,
        wal_syncs: None,
        written: None,
        run_pg_ticks: None,
        cpu,
        rss_kib: None,
    })
}

// ---------------------------------------------------------------------------------------------
// Worker runs

async fn worker_run(
    k: usize,
    shards: u16,
    export: Option<(f64, &e2e::OtlpReceiver)>,
    broker: &Broker,
    messages: &Arc<Vec<(String, Vec<u8>)>>,
    downstream: &NullDownstream,
    args: &Args,
) -> Result<Phase> {
    let mut env = Env::new().await;
    env.amqp_url = broker.agent_url.clone();
    let result = worker_run_in(
        &env,
        k,
        shards,
        export,
        &broker.worker_url,
        messages,
        downstream,
        args,
    )
    .await;
    if shards > 1 {
        // The harness removes the single-queue layout's names; the shards and their exchange
        // are this run's own.
        delete_shards(&env.amqp_url, &env.topology, shards).await;
    }
    cleanup(env).await;
    result.map(|mut phase| {
        if shards > 1 || args.shards.len() > 1 {
            phase.label = format!("{} S={shards}", phase.label);
        }
        if args.tracing.len() > 1 || export.is_some() {
            let mode = export.map_or("off".to_string(), |(r, _)| r.to_string());
            phase.label = format!("{} tr={mode}", phase.label);
        }
        phase
    })
}

/// Deletes the shard queues and the hash exchange of a run with `shards` > 1.
async fn delete_shards(amqp_url: &str, t: &e2e::Topology, shards: u16) {
    let Ok(conn) = Connection::connect(amqp_url, ConnectionProperties::default()).await else {
        return;
    };
    if let Ok(ch) = conn.create_channel().await {
        for q in worker::amqp::topology::shard_queues(t, shards) {
            let _ = ch
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let x = worker::amqp::topology::hash_exchange(t);
        let _ = ch
            .exchange_delete(x.as_str().into(), Default::default())
            .await;
    }
    let _ = conn.close(200, "".into()).await;
}

#[allow(clippy::too_many_arguments)]
async fn worker_run_in(
    env: &Env,
    k: usize,
    shards: u16,
    export: Option<(f64, &e2e::OtlpReceiver)>,
    worker_url: &str,
    messages: &Arc<Vec<(String, Vec<u8>)>>,
    downstream: &NullDownstream,
    args: &Args,
) -> Result<Phase> {
    let n = messages.len();
    let tools = env.write_tools(&format!(
        "[tools.{TOOL}]\nurl = \"http://127.0.0.1:{}/bench\"\nreceipt_id = \"/receipt_id\"\n\
         receipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\n\
         recovery = \"none\"\ntimeout_ms = 5000\n",
        downstream.port
    ));
    let mut opts = WorkerOptions::new(tools)
        .amqp_url(worker_url)
        .env("WORKER_INTENT_SHARDS", &shards.to_string());
    if let Some((ratio, receiver)) = export {
        opts = opts
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint())
            .env("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
            .env("OTEL_TRACES_SAMPLER_ARG", &ratio.to_string());
    }
    opts.prefetch = args.prefetch;
    opts.lease_secs = 30;
    opts.recovery_interval_ms = 1000; // the production default
    let mut workers = Vec::with_capacity(k);
    for i in 0..k {
        // Sequential: each one migrates the ledger at start.
        workers.push(Worker::start(env, &format!("bench-w{i}"), &opts).await);
    }
    if args.large_ledger {
        preload_ledger(env, LARGE_LEDGER_ROWS).await?;
    }
    // Counting needs the workers' connections to start after the setting: restart them.
    let mut log = None;
    if args.statements {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE \"{}\" SET log_min_duration_statement = 0",
            env.db_name
        )))
        .execute(&env.pool)
        .await
        .context("log_min_duration_statement on the run's database")?;
        drop(workers);
        workers = Vec::with_capacity(k);
        for i in 0..k {
            workers.push(Worker::start(env, &format!("bench-w{i}"), &opts).await);
        }
    }
    let worker_pids: Vec<u32> = workers.iter().map(Worker::pid).collect();

    let mut follower =
        Follower::follow(&env.amqp_url, &env.topology.results_exchange, TENANT, None)
            .await
            .context("follow results")?;
    let publisher_conn = Connection::connect(&env.amqp_url, ConnectionProperties::default())
        .await
        .context("connect publisher")?;
    let pub_ch = confirm_channel(&publisher_conn).await?;

    // Let start-up statistics reach pg_stat_* before the first sample.
    sleep(STATS_SETTLE).await;
    let commits_before = xact_commit(env).await;
    let wal_before = wal_syncs(env).await;
    let written_before = Written::take(env).await;
    let writes_before = downstream.requests.load(Ordering::SeqCst);

    if args.statements {
        log = Some(StatementLog::open()?);
    }
    let spans_before = export.map(|(_, r)| r.span_count());
    let cpu_before = CpuSample::take(&worker_pids);
    let started = Instant::now();
    let deadline = started + args.phase_timeout;
    let reader = tokio::spawn(async move {
        let mut succeeded: HashSet<String> = HashSet::with_capacity(n);
        let mut events = 0usize;
        while succeeded.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            let event = match follower.next(left).await {
                Ok(Some(ev)) => ev,
                Ok(None) => bail!(
                    "only {} of {n} succeeded results before the phase deadline ({events} events read)",
                    succeeded.len()
                ),
                Err(e) => return Err(anyhow!(e).context("reading results")),
            };
            events += 1;
            if event.status != Status::Succeeded {
                bail!(
                    "unexpected result {} for {}: {}",
                    event.status.as_str(),
                    event.action_id,
                    event.message
                );
            }
            succeeded.insert(event.action_id);
        }
        let done = Instant::now();
        let _ = follower.close().await;
        Ok(done)
    });
    let published = publish_all(
        &pub_ch,
        &env.topology.intents_exchange,
        TENANT,
        messages,
        deadline,
    )
    .await;
    let published = match published {
        Ok(()) => started.elapsed(),
        Err(e) => {
            reader.abort();
            return Err(e.context("publishing intents"));
        }
    };
    let done = match reader.await.context("result reader task")? {
        Ok(done) => done,
        Err(e) => {
            let states = state_counts(env).await.unwrap_or_default();
            return Err(e.context(format!("ledger states now: {states:?}")));
        }
    };
    let cpu_after = CpuSample::take(&worker_pids);
    let cpu = cpu_after.since(&cpu_before);
    let run_pg_ticks = run_backends(env)
        .await
        .map(|pids| cpu_after.ticks_since(&cpu_before, &pids));
    let statements = log.map(|l| l.read());
    let _ = publisher_conn.close(200, "".into()).await;

    sleep(STATS_SETTLE).await;
    let commits = match (commits_before, xact_commit(env).await) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    let wal = match (wal_before, wal_syncs(env).await) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };

    // Verify: every operation succeeded, nothing else is left, one write per intent.
    let states = state_counts(env).await?;
    let expected: BTreeMap<String, i64> = [("succeeded".to_string(), n as i64)].into();
    ensure!(
        states == expected,
        "ledger states after the run: {states:?}, expected {expected:?}"
    );
    let writes = downstream.requests.load(Ordering::SeqCst) - writes_before;
    ensure!(
        writes == n as u64,
        "the null downstream received {writes} writes for {n} intents"
    );
    let missing_keys = downstream.missing_key.load(Ordering::SeqCst);
    ensure!(
        missing_keys == 0,
        "{missing_keys} writes arrived without Idempotency-Key"
    );
    for w in &mut workers {
        ensure!(w.is_running(), "worker {} exited during the run", w.name);
    }
    let rss_kib = worker_pids.iter().filter_map(|&p| peak_rss_kib(p)).max();
    if let (Some((ratio, receiver)), Some(before)) = (export, spans_before) {
        // Batches still queued in the workers when they stop are not counted.
        let spans = receiver.span_count() - before;
        println!(
            "  tracing at {ratio}: {spans} spans received by the end of the run ({:.2} per intent)",
            spans as f64 / n as f64
        );
    }
    drop(workers);
    if let Some(counts) = statements {
        print_statements(k, n, &counts?);
    }
    Ok(Phase {
        label: format!("worker K={k}"),
        elapsed: done - started,
        published,
        count: n,
        commits,
        wal_syncs: wal,
        written: written_before
            .zip(Written::take(env).await)
            .map(|(a, b)| b.since(&a)),
        run_pg_ticks,
        cpu,
        rss_kib,
    })
}

// ---------------------------------------------------------------------------------------------
// Open-loop latency: one worker, intents published at a steady rate whatever the answers do.
// Before each worker run, at the same rate: the broker floor, the same path with the ledger and
// the downstream taken out (publisher -> quorum queue A -> relay with confirm -> quorum queue B
// -> follower).

/// Unacknowledged deliveries a follower takes ahead (the value `publisher::Follower` uses).
const FOLLOWER_PREFETCH: u16 = 32;

/// One moment on both clocks: monotonic for latencies measured inside this process, wall clock
/// (`SystemTime`, the same machine clock Postgres stamps its timestamps with) to compare with the
/// ledger's timestamps.
#[derive(Clone, Copy)]
struct Stamp {
    mono: Instant,
    wall: SystemTime,
}

impl Stamp {
    fn now() -> Stamp {
        Stamp {
            mono: Instant::now(),
            wall: SystemTime::now(),
        }
    }
}

/// Per message index: when it was published.
type Sent = Arc<std::sync::Mutex<Vec<Option<Stamp>>>>;

struct Latency {
    /// Everything before the percentiles, e.g. "latency K=1 P=64 at 200/s open loop, …".
    head: String,
    samples: Vec<Duration>,
    /// The samples of intents published [`WARM_UP`] or later after the first (worker runs).
    steady: Vec<Duration>,
    rss_kib: Option<u64>,
    /// Per-stage breakdown from the run's ledger (worker runs only).
    stages: Option<Stages>,
}

/// The start of an open-loop run that a worker may spend warming up (new pool connections are
/// no longer part of it, but first statements on each connection, HTTP keep-alive connections
/// and batch sizes still settle): figures over all intents and over those published after it
/// are both printed.
const WARM_UP: Duration = Duration::from_secs(1);

impl Latency {
    fn line(&self) -> String {
        let mut v = self.samples.clone();
        v.sort();
        let q = |p: usize| pct(&v, p).as_secs_f64() * 1000.0;
        let rss = self.rss_kib.map_or(String::new(), |k| {
            format!("  (worker rss {:.1} MiB)", k as f64 / 1024.0)
        });
        let mut steady = self.steady.clone();
        steady.sort();
        let steady = if steady.is_empty() {
            String::new()
        } else {
            let q = |p: usize| pct(&steady, p).as_secs_f64() * 1000.0;
            format!(
                "; published after the first {} s: p50 {:.1} ms  p99 {:.1} ms",
                WARM_UP.as_secs(),
                q(50),
                q(99)
            )
        };
        format!(
            "{}: p50 {:.1} ms  p90 {:.1} ms  p99 {:.1} ms  max {:.1} ms{steady}{rss}",
            self.head,
            q(50),
            q(90),
            q(99),
            q(100),
        )
    }

    fn print(&self) {
        println!("{}", self.line());
        if let Some(s) = &self.stages {
            s.print();
        }
    }
}

/// The broker floor, then the worker, at one rate.
async fn latency_run(
    rate: f64,
    secs: u64,
    broker: &Broker,
    downstream: &NullDownstream,
    args: &Args,
) -> Result<(Latency, Latency)> {
    let floor = broker_floor(&broker.agent_url, rate, secs, args)
        .await
        .context("broker floor")?;
    let mut env = Env::new().await;
    env.amqp_url = broker.agent_url.clone();
    let result = latency_run_in(&env, rate, secs, &broker.worker_url, downstream, args).await;
    cleanup(env).await;
    Ok((floor, result?))
}

async fn latency_run_in(
    env: &Env,
    rate: f64,
    secs: u64,
    worker_url: &str,
    downstream: &NullDownstream,
    args: &Args,
) -> Result<Latency> {
    let n = ((rate * secs as f64) as usize).max(1);
    let messages = build_messages(n, TENANT, TOOL);
    let tools = env.write_tools(&format!(
        "[tools.{TOOL}]\nurl = \"http://127.0.0.1:{}/bench\"\nreceipt_id = \"/receipt_id\"\n\
         receipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\n\
         recovery = \"none\"\ntimeout_ms = 5000\n",
        downstream.port
    ));
    let mut opts = WorkerOptions::new(tools).amqp_url(worker_url);
    opts.prefetch = args.prefetch;
    opts.lease_secs = 30;
    opts.recovery_interval_ms = 1000;
    let worker = Worker::start(env, "bench-lat", &opts).await;
    let mut follower =
        Follower::follow(&env.amqp_url, &env.topology.results_exchange, TENANT, None)
            .await
            .context("follow results")?;
    let publisher_conn = Connection::connect(&env.amqp_url, ConnectionProperties::default())
        .await
        .context("connect publisher")?;
    let pub_ch = confirm_channel(&publisher_conn).await?;
    let index: HashMap<String, usize> = (0..n).map(|i| (format!("bench-{i:07}"), i)).collect();
    let sent: Sent = Arc::new(std::sync::Mutex::new(vec![None; n]));
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs) + args.phase_timeout;
    let reader = tokio::spawn(async move {
        let mut received: Vec<Option<Stamp>> = vec![None; n];
        let mut seen = 0usize;
        while seen < n {
            let left = deadline.saturating_duration_since(Instant::now());
            let event = match follower.next(left).await {
                Ok(Some(ev)) => ev,
                Ok(None) => bail!("only {seen} of {n} results before the deadline"),
                Err(e) => return Err(anyhow!(e).context("reading results")),
            };
            let now = Stamp::now();
            ensure!(
                event.status == Status::Succeeded,
                "unexpected result {} for {}",
                event.status.as_str(),
                event.action_id
            );
            let Some(&i) = index.get(&event.action_id) else {
                continue;
            };
            if received[i].is_none() {
                received[i] = Some(now);
                seen += 1;
            }
        }
        let _ = follower.close().await;
        Ok(received)
    });
    let published = publish_open_loop(
        &pub_ch,
        &env.topology.intents_exchange,
        TENANT,
        &messages,
        rate,
        started,
        deadline,
        |i| sent.lock().expect("not poisoned")[i] = Some(Stamp::now()),
    )
    .await;
    if let Err(e) = published {
        reader.abort();
        return Err(e.context("publishing intents"));
    }
    let received = reader.await.context("latency reader")??;
    let sent: Vec<Stamp> = sent
        .lock()
        .expect("not poisoned")
        .iter()
        .map(|s| s.context("an intent never published"))
        .collect::<Result<_>>()?;
    let received: Vec<Stamp> = received.into_iter().flatten().collect();
    ensure!(received.len() == n, "a result missing");
    let samples = sent
        .iter()
        .zip(&received)
        .map(|(s, r)| r.mono.saturating_duration_since(s.mono))
        .collect();
    let steady = sent
        .iter()
        .zip(&received)
        .filter(|(s, _)| s.mono.saturating_duration_since(sent[0].mono) >= WARM_UP)
        .map(|(s, r)| r.mono.saturating_duration_since(s.mono))
        .collect();
    // The relay records events published after their confirms (at most every half second),
    // possibly after the follower got them: let the last record land before the worker stops.
    wait_marked(env).await;
    let rss_kib = peak_rss_kib(worker.pid());
    let _ = publisher_conn.close(200, "".into()).await;
    drop(worker);
    let stages = match Stages::read(env, &sent, &received).await {
        Ok(s) => Some(s),
        Err(e) => {
            eprintln!("warning: per-stage breakdown: {e:#}");
            None
        }
    };
    Ok(Latency {
        head: format!(
            "latency K=1 P={} at {rate:.0}/s open loop, publish -> succeeded result, {n} intents",
            args.prefetch
        ),
        samples,
        steady,
        rss_kib,
        stages,
    })
}

/// Waits up to 5 s until every `succeeded` event of the run is recorded published.
async fn wait_marked(env: &Env) {
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        let left: Result<i64, _> = sqlx::query_scalar(
            "SELECT count(*) FROM result_events WHERE status = 'succeeded' AND NOT published",
        )
        .fetch_one(&env.pool)
        .await;
        if matches!(left, Ok(0)) {
            return;
        }
        sleep(Duration::from_millis(50)).await;
    }
}

/// Where an intent's time goes, from the run's own ledger after the run, compared with the
/// publish and receive times this process recorded on the wall clock of the same machine.
///
/// The ledger's clocks (migrations/0001_ledger.sql) are not all the same kind:
/// - `operations.created_at` DEFAULT `now()`: the start of the admitting transaction. The admit
///   is one statement in its own transaction, so this is when that statement began.
/// - `operation_history.at` DEFAULT `clock_timestamp()`: the statement clock, when the history
///   trigger ran inside the completion `UPDATE` (before that transaction commits).
/// - `result_outbox.created_at` DEFAULT `now()`: the start of the completion transaction, so a
///   little *before* the history row of the same completion.
/// - A worker's own completion events are recorded published by their relay epoch's watermark,
///   not row by row, so the ledger has no per-event publish time: "recorded -> received" is the
///   relay, its confirm and hop 2 together.
struct Stages {
    /// Intents slower than [`SLOW_MS`] (publish -> received), per [`SLOW_BUCKET_MS`] of the
    /// run by publish time: a tail that sits in the first buckets is a warm-up, one spread
    /// evenly is the steady state.
    slow: Vec<usize>,
    matched: usize,
    of: usize,
    /// (label, per-intent milliseconds).
    rows: Vec<(&'static str, Vec<f64>)>,
}

impl Stages {
    async fn read(env: &Env, sent: &[Stamp], received: &[Stamp]) -> Result<Stages> {
        type Row = (String, DateTime<Utc>, DateTime<Utc>, DateTime<Utc>);
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT o.action_id, o.created_at, h.at, r.created_at
             FROM operations o
             JOIN operation_history h ON h.operation_id = o.id AND h.to_state = 'succeeded'
             JOIN result_outbox r ON r.operation_id = o.id AND r.status = 'succeeded'
             WHERE o.action_id LIKE 'bench-%'",
        )
        .fetch_all(&env.pool)
        .await
        .context("read the run's ledger timestamps")?;
        let ms = |from: DateTime<Utc>, to: DateTime<Utc>| {
            (to - from).num_microseconds().unwrap_or(i64::MAX) as f64 / 1000.0
        };
        let mut columns: [Vec<f64>; 5] = Default::default();
        let mut seen = HashSet::new();
        let mut slow: Vec<usize> = Vec::new();
        let t0 = DateTime::<Utc>::from(sent[0].wall);
        for (action_id, admitted, recorded, outbox_created) in rows {
            let Some(i) = action_id
                .strip_prefix("bench-")
                .and_then(|s| s.parse::<usize>().ok())
                .filter(|&i| i < sent.len())
            else {
                continue;
            };
            if !seen.insert(i) {
                continue; // one sample per intent
            }
            let publish = DateTime::<Utc>::from(sent[i].wall);
            let receive = DateTime::<Utc>::from(received[i].wall);
            let bucket = (ms(t0, publish).max(0.0) / SLOW_BUCKET_MS) as usize;
            if ms(publish, receive) > SLOW_MS {
                if slow.len() <= bucket {
                    slow.resize(bucket + 1, 0);
                }
                slow[bucket] += 1;
            }
            for (c, v) in columns.iter_mut().zip([
                ms(publish, admitted),
                ms(admitted, recorded),
                ms(recorded, receive),
                ms(publish, receive),
                ms(recorded, outbox_created),
            ]) {
                c.push(v);
            }
        }
        ensure!(!seen.is_empty(), "no intent has all its ledger timestamps");
        let [a, b, c, total, outbox] = columns;
        Ok(Stages {
            slow,
            matched: seen.len(),
            of: sent.len(),
            rows: vec![
                ("publish -> admitted (operations.created_at)", a),
                ("admitted -> succeeded recorded (history.at)", b),
                ("recorded -> received (relay, confirm, hop 2, follower)", c),
                ("publish -> received (sum of the three, wall clock)", total),
                ("(outbox.created_at - recorded: txn start vs stmt)", outbox),
            ],
        })
    }

    fn print(&self) {
        println!(
            "  per stage, {} of {} intents, ms:  {:>8} {:>8} {:>8}",
            self.matched, self.of, "mean", "p50", "p99"
        );
        for (label, values) in &self.rows {
            let mut v = values.clone();
            v.sort_by(f64::total_cmp);
            let mean = v.iter().sum::<f64>() / v.len() as f64;
            println!(
                "    {label:<52} {mean:>8.2} {:>8.2} {:>8.2}",
                pct(&v, 50),
                pct(&v, 99)
            );
        }
        println!(
            "    over {SLOW_MS} ms, per {SLOW_BUCKET_MS} ms of publishing: {:?}",
            self.slow
        );
    }
}

/// See [`Stages::slow`].
const SLOW_MS: f64 = 50.0;
const SLOW_BUCKET_MS: f64 = 500.0;

/// Legend for [`Stages::print`], printed once.
const STAGES_LEGEND: &str = "per stage: publish/received = this process's wall clock \
(SystemTime) at basic.publish / after the follower acked; admitted = operations.created_at \
(DEFAULT now(): start of the admit transaction, one statement); recorded = operation_history.at \
of the transition to succeeded (DEFAULT clock_timestamp(): statement clock, inside the completion \
transaction, before its commit); a worker's own events are recorded published by a watermark, \
with no time per event, so recorded -> received holds the relay, its confirm and hop 2; \
outbox.created_at is now() too (start of the completion transaction), so it precedes recorded. \
Means add up to the total; percentiles do not.";

/// Broker-only floor at `rate`: the same open-loop publisher into a durable quorum queue A; a
/// relay here consumes A (prefetch P), publishes each body to a durable quorum queue B with a
/// confirm, and acks on A once confirmed; a follower consumes B (prefetch 32, one ack each, like
/// `publisher::Follower`). Latency is publish -> received on B. The worker's path with no ledger
/// and no downstream: both hops, the relay's confirm, three client processes' worth of I/O.
async fn broker_floor(amqp_url: &str, rate: f64, secs: u64, args: &Args) -> Result<Latency> {
    let id = uuid::Uuid::new_v4().simple();
    let queues = (format!("bench.floor.a.{id}"), format!("bench.floor.b.{id}"));
    let connect = || async {
        Connection::connect(amqp_url, ConnectionProperties::default())
            .await
            .with_context(|| format!("connect to RabbitMQ at {amqp_url}"))
    };
    let (publisher_conn, relay_conn, follower_conn) =
        (connect().await?, connect().await?, connect().await?);
    let result = broker_floor_on(
        [&publisher_conn, &relay_conn, &follower_conn],
        &queues,
        rate,
        secs,
        args,
    )
    .await;
    // Always delete both queues, also after a failure.
    for queue in [&queues.0, &queues.1] {
        let deleted = async {
            let ch = publisher_conn.create_channel().await?;
            ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await
        }
        .await;
        if let Err(e) = deleted {
            eprintln!("warning: could not delete broker floor queue {queue}: {e}");
        }
    }
    for conn in [&publisher_conn, &relay_conn, &follower_conn] {
        let _ = conn.close(200, "".into()).await;
    }
    result
}

async fn broker_floor_on(
    [publisher_conn, relay_conn, follower_conn]: [&Connection; 3],
    (queue_a, queue_b): &(String, String),
    rate: f64,
    secs: u64,
    args: &Args,
) -> Result<Latency> {
    let n = ((rate * secs as f64) as usize).max(1);
    let messages = build_messages(n, TENANT, TOOL);
    let setup = relay_conn.create_channel().await.context("open channel")?;
    declare_quorum(&setup, queue_a).await?;
    declare_quorum(&setup, queue_b).await?;

    let (_relay_in, from_a) =
        consume_on(relay_conn, queue_a, args.prefetch, "bench-floor-relay").await?;
    let relay_out = confirm_channel(relay_conn).await?;
    let (_follow_ch, mut from_b) = consume_on(
        follower_conn,
        queue_b,
        FOLLOWER_PREFETCH,
        "bench-floor-follower",
    )
    .await?;
    let pub_ch = confirm_channel(publisher_conn).await?;

    let index: HashMap<String, usize> = messages
        .iter()
        .enumerate()
        .map(|(i, (id, _))| (id.clone(), i))
        .collect();
    let sent: Sent = Arc::new(std::sync::Mutex::new(vec![None; n]));
    let cpu_before = CpuSample::take(&[]);
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs) + args.phase_timeout;
    let relay = tokio::spawn(floor_relay(from_a, relay_out, queue_b.clone(), n, deadline));
    let follower = tokio::spawn(async move {
        let mut received: Vec<Option<Stamp>> = vec![None; n];
        let mut seen = 0usize;
        while seen < n {
            let delivery = match timeout_at(deadline, from_b.next()).await {
                Err(_) => bail!("only {seen} of {n} messages on B before the deadline"),
                Ok(None) => bail!("consumer on B closed after {seen} of {n} messages"),
                Ok(Some(d)) => d.context("delivery on B")?,
            };
            delivery
                .ack(BasicAckOptions::default())
                .await
                .context("basic.ack on B")?;
            let now = Stamp::now();
            let i = delivery
                .properties
                .message_id()
                .as_ref()
                .and_then(|id| index.get(id.as_str()));
            if let Some(&i) = i {
                if received[i].is_none() {
                    received[i] = Some(now);
                    seen += 1;
                }
            }
        }
        Ok(received)
    });
    let published = publish_open_loop(
        &pub_ch,
        "",
        queue_a,
        &messages,
        rate,
        started,
        deadline,
        |i| sent.lock().expect("not poisoned")[i] = Some(Stamp::now()),
    )
    .await;
    if let Err(e) = published {
        relay.abort();
        follower.abort();
        return Err(e.context("publishing to A"));
    }
    let received = follower.await.context("follower on B")??;
    relay.await.context("relay")??;
    let (elapsed, cpu) = (started.elapsed(), CpuSample::take(&[]).since(&cpu_before));
    let sent = sent.lock().expect("not poisoned");
    let samples = sent
        .iter()
        .zip(&received)
        .map(|(s, r)| match (s, r) {
            (Some(s), Some(r)) => Ok(r.mono.saturating_duration_since(s.mono)),
            _ => Err(anyhow!("a message without its publish or receive time")),
        })
        .collect::<Result<_>>()?;
    Ok(Latency {
        head: format!(
            "broker floor (2 quorum hops + relay with confirm) P={} at {rate:.0}/s open loop, \
             publish -> received on B, {n} messages (RabbitMQ {:.0} µs and this process {:.0} µs \
             per message, machine busy {:.2} cores)",
            args.prefetch,
            us_per(cpu.rabbit, n),
            us_per(cpu.bench, n),
            cpu.busy_cores(elapsed),
        ),
        samples,
        steady: Vec::new(),
        rss_kib: None,
        stages: None,
    })
}

/// The floor's relay: for each delivery from A, publish its body to B (persistent, mandatory,
/// same message id) on a confirm channel; another task awaits each confirm in order and then
/// acks the delivery on A. Up to P deliveries are in flight, as in the worker.
async fn floor_relay(
    mut from_a: Consumer,
    out: Channel,
    queue_b: String,
    n: usize,
    deadline: Instant,
) -> Result<()> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Acker, PublisherConfirm)>();
    let acks = tokio::spawn(async move {
        while let Some((acker, confirm)) = rx.recv().await {
            check_confirm(confirm, deadline).await?;
            acker
                .ack(BasicAckOptions::default())
                .await
                .context("basic.ack on A")?;
        }
        Ok::<(), anyhow::Error>(())
    });
    for relayed in 0..n {
        let delivery = match timeout_at(deadline, from_a.next()).await {
            Err(_) => bail!("the relay got only {relayed} of {n} messages before the deadline"),
            Ok(None) => bail!("consumer on A closed after {relayed} of {n} messages"),
            Ok(Some(d)) => d.context("delivery on A")?,
        };
        let mut properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2);
        if let Some(id) = delivery.properties.message_id() {
            properties = properties.with_message_id(id.clone());
        }
        let confirm = out
            .basic_publish(
                "".into(),
                queue_b.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &delivery.data,
                properties,
            )
            .await
            .context("basic.publish to B")?;
        if tx.send((delivery.acker, confirm)).is_err() {
            break; // the ack task failed: its error is returned below
        }
    }
    drop(tx);
    acks.await.context("relay ack task")?
}

/// Finished operations `--large-ledger` puts in the ledger.
const LARGE_LEDGER_ROWS: i64 = 5_000_000;
/// The newest tenth (finished within the last 29 days) still has its receipt, arguments and
/// published event; the rest (finished 31 to 360 days ago) are tombstones, as the default
/// retention leaves them (`WORKER_RETENTION_SECS` of 30 days passed: arguments and receipt
/// removed, published events deleted; tombstones kept for 365 days). Every row keeps its three
/// history rows (prepared, dispatching, succeeded).
const LARGE_LEDGER_SQL: [&str; 4] = [
    // Triggers off for the load only (this session): history is written below in bulk, as
    // the trigger would have, with one statement per table.
    "SET session_replication_role = replica",
    "INSERT INTO operations (tenant, action_id, tool, fingerprint, arguments, call_id, reply_to,
        state, fence, attempts, first_dispatch_at, receipt, receipt_id, evidence, changed_by,
        last_reported, created_at, updated_at, state_since, finished_at, swept_at)
     SELECT 'bench', 'old-' || g, 'bench', md5(g::text),
        CASE WHEN recent THEN '{\"order\":\"old\"}' END, NULL, 'bench', 'succeeded', 1, 1, t,
        CASE WHEN recent THEN jsonb_build_object('receipt_id', 'r-old-' || g) END,
        'r-old-' || g, 'receipt r-old-' || g || ' from write attempt 1', 'bench-loader',
        'succeeded', t, t, t, t, CASE WHEN NOT recent THEN t END
     FROM generate_series(1, $1::int8) g,
          LATERAL (SELECT g > $1 * 9 / 10) r(recent),
          -- tombstones finished 360 to 31 days ago, the rest within the default 30-day retention
          LATERAL (SELECT CASE WHEN recent
                THEN now() - interval '29 days' * (1 - (g - $1 * 9 / 10)::float8 / ($1 / 10 + 1))
                ELSE now() - interval '360 days' + interval '329 days' * (g::float8 / ($1 * 9 / 10))
              END) x(t)",
    "INSERT INTO operation_history (operation_id, at, from_state, to_state, fence, actor,
        evidence, attempts)
     SELECT o.id, o.created_at, s.f, s.t, s.fence, 'bench-loader', NULL, s.attempts
     FROM operations o,
          (VALUES (NULL, 'prepared', 0, 0), ('prepared', 'dispatching', 1, 1),
                  ('dispatching', 'succeeded', 1, 1)) s(f, t, fence, attempts)
     WHERE o.action_id LIKE 'old-%'",
    "INSERT INTO result_outbox (operation_id, routing_key, status, payload, created_at,
        published_at)
     SELECT id, 'bench', 'succeeded', jsonb_build_object('action_id', action_id,
        'status', 'succeeded'), created_at, created_at
     FROM operations WHERE action_id LIKE 'old-%' AND swept_at IS NULL",
];

/// `--large-ledger`: fills the run's ledger, then analyzes it, before the measured interval.
async fn preload_ledger(env: &Env, rows: i64) -> Result<()> {
    let started = Instant::now();
    let mut conn = env.pool.acquire().await?;
    for sql in LARGE_LEDGER_SQL {
        let q = sqlx::query(sqlx::AssertSqlSafe(sql));
        let q = if sql.contains("$1") { q.bind(rows) } else { q };
        q.execute(&mut *conn)
            .await
            .with_context(|| format!("large ledger: {}", &sql[..40.min(sql.len())]))?;
    }
    sqlx::query("RESET session_replication_role")
        .execute(&mut *conn)
        .await?;
    sqlx::query("ANALYZE").execute(&mut *conn).await?;
    let size: String =
        sqlx::query_scalar("SELECT pg_size_pretty(pg_database_size(current_database()))")
            .fetch_one(&mut *conn)
            .await?;
    println!(
        "large ledger: {rows} finished operations, history and outbox loaded in {:.1}s (database {size})",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `--statements`: the server log from a starting offset. Every statement a worker runs is
/// one round trip (sqlx sends parse/bind/execute/sync together), logged as `execute` (extended
/// protocol) or `statement` (simple protocol: BEGIN, COMMIT).
struct StatementLog {
    path: String,
    offset: u64,
}

impl StatementLog {
    fn open() -> Result<StatementLog> {
        let path = std::env::var("PG_LOG")
            .unwrap_or_else(|_| "/var/log/postgresql/postgresql-15-main.log".into());
        let offset = std::fs::metadata(&path)
            .with_context(|| format!("--statements needs the Postgres log at {path} (PG_LOG)"))?
            .len();
        Ok(StatementLog { path, offset })
    }

    /// Statements logged since `open`, by kind (the first words of the SQL): how many, and
    /// the server time they took (parse, bind and execute).
    fn read(self) -> Result<BTreeMap<String, (u64, f64)>> {
        use std::io::{Read, Seek};
        let mut f = std::fs::File::open(&self.path)?;
        f.seek(std::io::SeekFrom::Start(self.offset))?;
        let mut text = String::new();
        f.read_to_string(&mut text)?;
        let mut counts = BTreeMap::new();
        let mut lines = text.lines().peekable();
        while let Some(line) = lines.next() {
            let Some(rest) = line.split_once("duration: ").map(|(_, r)| r) else {
                continue;
            };
            let ms: f64 = rest
                .split_once(" ms")
                .and_then(|(v, _)| v.trim().parse().ok())
                .unwrap_or(0.0);
            let (sql, counted) = if let Some((_, sql)) = rest.split_once(" statement: ") {
                (sql.to_string(), true)
            } else if let Some((_, sql)) = rest.split_once(" execute ") {
                (
                    sql.split_once(": ").map_or("", |(_, s)| s).to_string(),
                    true,
                )
            } else if let Some((_, sql)) = rest
                .split_once(" parse ")
                .or_else(|| rest.split_once(" bind "))
            {
                // Parse and bind of the same round trip: time, not a statement.
                (
                    sql.split_once(": ").map_or("", |(_, s)| s).to_string(),
                    false,
                )
            } else {
                continue;
            };
            // Continuation lines of a multi-line statement start with a tab.
            let mut full = sql;
            while let Some(next) = lines.peek() {
                if !next.starts_with('\t') {
                    break;
                }
                full.push(' ');
                full.push_str(next.trim());
                lines.next();
            }
            let entry: &mut (u64, f64) = counts.entry(statement_kind(&full)).or_default();
            entry.0 += u64::from(counted);
            entry.1 += ms;
        }
        Ok(counts)
    }
}

/// A short name for a statement: its first words, whitespace collapsed.
fn statement_kind(sql: &str) -> String {
    let words: Vec<&str> = sql.split_whitespace().collect();
    let mut kind = words.join(" ");
    kind.truncate(kind.char_indices().nth(72).map_or(kind.len(), |(i, _)| i));
    kind
}

fn print_statements(k: usize, n: usize, counts: &BTreeMap<String, (u64, f64)>) {
    let total: u64 = counts.values().map(|c| c.0).sum();
    let ms: f64 = counts.values().map(|c| c.1).sum();
    println!(
        "statements sent by K={k} worker(s) (one round trip each): {total} = {:.2} per intent; \
         server time {:.1} µs per intent (parse + bind + execute, as logged)",
        total as f64 / n as f64,
        ms * 1000.0 / n as f64
    );
    let mut rows: Vec<_> = counts.iter().collect();
    rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
    for (kind, (c, ms)) in rows {
        println!(
            "  {:>8.3}/i  {c:>7}  {:>7.1} µs/i  {kind}",
            *c as f64 / n as f64,
            ms * 1000.0 / n as f64
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Null downstream: HTTP/1.1 keep-alive, 201 with a matching receipt, no storage

// ---------------------------------------------------------------------------------------------
// CPU accounting from /proc (Linux; zeros elsewhere)
