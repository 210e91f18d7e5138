//! The chaos soak (`e2e::soak`, also the `soak` binary) with small fixed numbers, as part of
//! the test command: 2 workers, 150 intents over 20 s, a fixed seed. Every invariant must hold:
//! no duplicate mutation (or async job) for any capability, no lost intent, no false success or
//! failure, no rejection of a valid intent, and no worker exit the soak did not cause; for the
//! async tools, no success before the downstream's job ended, no hold but at the poll deadline
//! of a job that never ends, and none left accepted. The async jobs are exercised: some
//! succeed, some fail and one at least never ends and is held at its deadline.

use e2e::soak::{run, SoakConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_seeded_soak_keeps_every_invariant() {
    let cfg = SoakConfig {
        seed: 20261201,
        intents: 150,
        seconds: 20,
        workers: 2,
        settle_secs: 30,
        pg_failover: false,
        cluster: false,
        absence_proof: true,
    };
    let report = run(&cfg).await.expect("the soak could not run");
    println!("{report}");
    let jobs = &report.async_figures.jobs;
    assert!(
        ["succeeded", "failed", "stuck"]
            .iter()
            .all(|ending| jobs.get(*ending).is_some_and(|n| *n > 0))
            && report.async_figures.polls > 0,
        "the async jobs were not all exercised (report above): {jobs:?}"
    );
    assert!(
        report.violations.is_empty(),
        "soak invariants broken (report above):\n{:#?}",
        report.violations
    );
}
