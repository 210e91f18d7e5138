//! What the benchmarks rely on besides the system under test. The cost benchmark rolls
//! RabbitMQ's quorum-queue write-ahead log over before each measured phase, so that the
//! broker's own roll-over (every 512 MiB written, wherever earlier writes bring it due) does not
//! land in one latency run and not the next, and it tells from the WAL file the broker holds
//! open whether one happened during a phase anyway.

use e2e::bench::{broker_wal_files, roll_over_broker_wal};

#[tokio::test]
async fn the_brokers_wal_rolls_over_when_asked_and_the_new_file_is_seen() {
    let before = broker_wal_files();
    assert!(
        !before.is_empty(),
        "no quorum WAL file open in any beam.smp process (is RabbitMQ on this machine, and \
         /proc/<pid>/fd readable?)"
    );
    assert_eq!(
        broker_wal_files(),
        before,
        "two readings with nothing between"
    );
    roll_over_broker_wal()
        .await
        .expect("rabbitmqctl eval rolls the quorum WAL over");
    let after = broker_wal_files();
    assert!(!after.is_empty(), "no quorum WAL open after the roll-over");
    assert_ne!(after, before, "the broker still holds the same WAL file");
}
