//! The chaos soak (`e2e::soak`) with the ledger failed over, as part of the test command: the
//! ledger on a Postgres primary and synchronous standby of the soak's own, every worker given
//! both hosts; during 15 s of publishing and faults (SIGKILLs, broker link cuts, downstream
//! faults) the primary is stopped hard and the standby promoted, then the old primary rejoins
//! and a switchover brings it back. 2 workers, 100 intents, a fixed seed. Every invariant must
//! hold (no duplicate, no lost intent or answer, no false success, failure or rejection, no
//! worker exit the soak did not cause, no avoidable hold) and the live workers must be ready on
//! each new primary within the soak's cap; the report prints the resume times.

use e2e::soak::{run, SoakConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_seeded_soak_through_a_failover_and_a_switchover_keeps_every_invariant() {
    let cfg = SoakConfig {
        seed: 20261202,
        intents: 100,
        seconds: 15,
        workers: 2,
        settle_secs: 30,
        pg_failover: true,
        cluster: false,
        absence_proof: true,
    };
    let report = run(&cfg).await.expect("the soak could not run");
    println!("{report}");
    let fo = report.failover.as_ref().expect("failover figures");
    assert!(
        fo.resume_after_promotion.is_some() && fo.resume_after_switchover.is_some(),
        "the workers followed both switches: {fo:?}"
    );
    assert!(
        report.violations.is_empty(),
        "soak invariants broken (report above):\n{:#?}",
        report.violations
    );
}
