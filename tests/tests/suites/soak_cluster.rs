//! The chaos soak (`e2e::soak`) on a 3-node RabbitMQ cluster of its own, as part of the test
//! command: every worker given the three nodes; during 20 s of publishing and faults (SIGKILLs
//! of workers, ledger link cuts, downstream faults) one node at a time is SIGKILLed — the intents
//! queue's leader when the seed's moment finds it on a node the agent does not use — and started
//! again. 2 workers, 100 intents, a fixed seed. Every invariant must hold (no duplicate, no lost
//! intent or answer, no false success, failure or rejection, no worker exit the soak did not
//! cause, no avoidable hold) and the live workers must be ready again after every node loss
//! within the soak's cap; the report prints each loss and its resume time.

use e2e::soak::{run, SoakConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_seeded_soak_on_a_cluster_losing_nodes_keeps_every_invariant() {
    let cfg = SoakConfig {
        seed: 20261203,
        intents: 100,
        seconds: 20,
        workers: 2,
        settle_secs: 30,
        pg_failover: false,
        cluster: true,
        absence_proof: true,
    };
    let report = run(&cfg).await.expect("the soak could not run");
    println!("{report}");
    assert!(
        !report.node_losses.is_empty(),
        "the soak lost no node (report above)"
    );
    assert!(
        report.violations.is_empty(),
        "soak invariants broken (report above):\n{:#?}",
        report.violations
    );
}
