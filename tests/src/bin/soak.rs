//! Chaos soak: real worker processes under seeded SIGKILLs, broker and Postgres link cuts
//! (each worker's links run through its own fault proxy) and downstream faults, with tools of
//! all three capabilities and two long-running (async) tools whose jobs are planned by the seed
//! (delays around the poll schedule, failures, status 404 windows, jobs that never end) under
//! status-read faults; prints the invariants and the seeds' measures, the async jobs' polls and
//! latencies among them (see `e2e::soak`).
//! `--pg-failover` puts the ledger on a primary and synchronous standby of the soak's own and
//! fails it over (and switches it back) during the faults, printing how soon the workers
//! resumed on each new primary. `--cluster` puts the broker on a 3-node RabbitMQ cluster of the
//! soak's own and SIGKILLs (and restarts) nodes during the faults, printing how soon the workers
//! were ready again after each loss. The lookup tool declares `absence_proof` unless
//! `--no-absence-proof`.
//!
//! ```sh
//! cargo build --workspace       # the worker (with fault points) and reference-downstream
//! cargo run -p e2e --bin soak -- --seed 7 --intents 2000 --seconds 300 [--workers 3] [--settle-secs 90] [--pg-failover] [--cluster] [--no-absence-proof]
//! ```
//!
//! Exit code 0 when every invariant holds, 1 when one is broken, 2 when the soak could not run.
//! Needs Postgres and RabbitMQ as the e2e suites do (`TEST_DATABASE_URL`, `TEST_AMQP_URL`).

use anyhow::{bail, Context as _, Result};
use e2e::soak::{run, SoakConfig};

const USAGE: &str = "usage: soak [--seed S (time-based)] [--intents N (300)] [--seconds T (60)] \
[--workers W (2)] [--settle-secs S (60)] [--pg-failover] [--cluster] [--no-absence-proof]

--pg-failover: the ledger on a Postgres primary and synchronous standby of the soak's own
(initdb, pg_ctl, pg_rewind from the newest /usr/lib/postgresql/*/bin, PG_BIN_DIR overrides),
stopped hard and promoted, then switched back, during the faults.

--cluster: the broker a 3-node RabbitMQ cluster of the soak's own (Debian's rabbitmq-server,
see e2e::rabbit_cluster); one of the two nodes the agent does not use at a time (the intents
queue's leader when it is one of them) SIGKILLed and restarted during the faults; the agent uses
a node that does not lead the intents queue.

--no-absence-proof: the lookup tool `ticket` without `absence_proof`, so a lookup miss is held
as before (compare its unresolved count for one seed with and without).

The worker and reference-downstream binaries are taken from INTENT_BIN_DIR, default the directory
of this executable (run `cargo build --workspace` first).";

fn parse_args() -> Result<SoakConfig> {
    let mut cfg = SoakConfig {
        seed: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_secs()),
        ..SoakConfig::default()
    };
    // The flags without a value.
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == "--pg-failover") {
        args.remove(i);
        cfg.pg_failover = true;
    }
    if let Some(i) = args.iter().position(|a| a == "--cluster") {
        args.remove(i);
        cfg.cluster = true;
    }
    if let Some(i) = args.iter().position(|a| a == "--no-absence-proof") {
        args.remove(i);
        cfg.absence_proof = false;
    }
    for (flag, value) in e2e::flags::pairs_from(args, USAGE)? {
        match flag.as_str() {
            "--seed" => cfg.seed = value.parse().context("--seed")?,
            "--intents" => cfg.intents = value.parse().context("--intents")?,
            "--seconds" => cfg.seconds = value.parse().context("--seconds")?,
            "--workers" => cfg.workers = value.parse().context("--workers")?,
            "--settle-secs" => cfg.settle_secs = value.parse().context("--settle-secs")?,
            other => bail!("unknown argument {other}\n{USAGE}"),
        }
    }
    if cfg.intents == 0 || cfg.seconds == 0 || !(1..=16).contains(&cfg.workers) {
        bail!("--intents and --seconds must be at least 1, --workers between 1 and 16\n{USAGE}");
    }
    Ok(cfg)
}

fn main() {
    let code = match start() {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("soak: error: {e:#}");
            2
        }
    };
    std::process::exit(code);
}

fn start() -> Result<bool> {
    let cfg = parse_args()?;
    if std::env::var_os("INTENT_BIN_DIR").is_none_or(|d| d.is_empty()) {
        let exe = std::env::current_exe().context("current exe")?;
        let dir = exe.parent().context("directory of this executable")?;
        // Single-threaded here: no runtime has started yet.
        std::env::set_var("INTENT_BIN_DIR", dir);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    let report = runtime.block_on(run(&cfg))?;
    print!("{report}");
    Ok(report.violations.is_empty())
}
