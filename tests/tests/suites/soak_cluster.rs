//! The chaos soak (`e2e::soak`) on a 3-node RabbitMQ cluster of its own, as part of the test
//! command: every worker given the three nodes, the agent publishing through the node list and
//! reading its results from a quorum queue through any node; during 40 s of publishing and faults
//! (SIGKILLs of workers, ledger link cuts, downstream faults) the node the agent publishes
//! through is SIGKILLed and started again, then two of the three nodes at once (quorum lost:
//! every worker must answer `/readyz` 503 naming the broker, no publish is confirmed until they
//! return). 2 workers, 150 intents, a fixed seed. Every invariant must hold (no duplicate, no lost
//! intent or answer, no false success, failure or rejection, no worker exit the soak did not
//! cause, no avoidable hold) and the live workers must be ready again after every loss within
//! the soak's cap; the report prints each loss, its resume times and their p50/p99/max.

use e2e::soak::{run, SoakConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_seeded_soak_on_a_cluster_losing_nodes_keeps_every_invariant() {
    let cfg = SoakConfig {
        seed: 20261203,
        intents: 150,
        seconds: 40,
        workers: 2,
        settle_secs: 30,
        pg_failover: false,
        cluster: true,
        absence_proof: true,
    };
    let report = run(&cfg).await.expect("the soak could not run");
    println!("{report}");
    let kinds: Vec<&str> = report.node_losses.iter().map(|l| l.kind).collect();
    assert!(
        kinds.contains(&"agent-node kill") && kinds.contains(&"two-node window"),
        "the soak did not kill the agent's node and two nodes at once: {kinds:?} (report above)"
    );
    assert!(
        report.violations.is_empty(),
        "soak invariants broken (report above):\n{:#?}",
        report.violations
    );
}
