//! What the benchmarks rely on besides the system under test. The cost benchmark rolls
//! RabbitMQ's quorum-queue write-ahead log over before each measured phase, so that the
//! broker's own roll-over (every 512 MiB written, wherever earlier writes bring it due) does not
//! land in one latency run and not the next, and it tells from the WAL file the broker holds
//! open whether one happened during a phase anyway.

use std::collections::BTreeMap;
use std::path::Path;

use e2e::bench::{broker_wal_files, roll_over_broker_wal};

/// The open WAL file of each node, by the node's directory: nodes of other suites' clusters may
/// come and go on this machine meanwhile, so the shared broker's node is told apart by its own.
fn by_node(files: Vec<String>) -> BTreeMap<String, String> {
    files
        .into_iter()
        .map(|f| {
            let dir = Path::new(&f)
                .parent()
                .map(|d| d.display().to_string())
                .unwrap_or_default();
            (dir, f)
        })
        .collect()
}

#[tokio::test]
async fn the_brokers_wal_rolls_over_when_asked_and_the_new_file_is_seen() {
    let before = by_node(broker_wal_files());
    assert!(
        !before.is_empty(),
        "no quorum WAL file open in any beam.smp process (is RabbitMQ on this machine, and \
         /proc/<pid>/fd readable?)"
    );
    roll_over_broker_wal()
        .await
        .expect("rabbitmqctl eval rolls the quorum WAL over");
    let after = by_node(broker_wal_files());
    let rolled: Vec<_> = before
        .iter()
        .filter(|(node, file)| after.get(*node).is_some_and(|now| now != *file))
        .collect();
    assert!(
        !rolled.is_empty(),
        "no node holds another WAL file after the roll-over: before {before:?}, after {after:?}"
    );
}
