//! Chaos soak: real worker processes under seeded SIGKILLs, broker and Postgres link cuts
//! (each worker's links run through its own fault proxy) and downstream faults, with tools of
//! all three capabilities; prints the invariants and the seeds' measures (see `e2e::soak`).
//!
//! ```sh
//! cargo build --workspace       # the worker (with fault points) and reference-downstream
//! cargo run -p e2e --bin soak -- --seed 7 --intents 2000 --seconds 300 [--workers 3] [--settle-secs 90]
//! ```
//!
//! Exit code 0 when every invariant holds, 1 when one is broken, 2 when the soak could not run.
//! Needs Postgres and RabbitMQ as the e2e suites do (`TEST_DATABASE_URL`, `TEST_AMQP_URL`).

use anyhow::{bail, Context as _, Result};
use e2e::soak::{run, SoakConfig};

const USAGE: &str = "usage: soak [--seed S (time-based)] [--intents N (300)] [--seconds T (60)] \
[--workers W (2)] [--settle-secs S (60)]

The worker and reference-downstream binaries are taken from INTENT_BIN_DIR, default the directory
of this executable (run `cargo build --workspace` first).";

fn parse_args() -> Result<SoakConfig> {
    let mut cfg = SoakConfig {
        seed: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_secs()),
        intents: 300,
        seconds: 60,
        workers: 2,
        settle_secs: 60,
    };
    for (flag, value) in e2e::flags::pairs(USAGE)? {
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
