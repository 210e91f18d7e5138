//! What the benchmarks rely on besides the system under test. The cost benchmark rolls
//! RabbitMQ's quorum-queue write-ahead log over before each measured phase, so that the
//! broker's own roll-over (every 512 MiB written, wherever earlier writes bring it due) does not
//! land in one latency run and not the next, and it tells from the WAL file the broker holds
//! open whether one happened during a phase anyway.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use e2e::bench::{broker_wal_files, confirm_channel, declare_quorum, roll_over_broker_wal};
use lapin::options::{BasicPublishOptions, QueueDeleteOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};

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
    // RabbitMQ 3.10 opens the next WAL file with the next quorum-queue write, not at the
    // roll-over: on a broker nothing else writes to at that moment, no file is open until then.
    // So write one message to a quorum queue of the test's own and look again.
    let conn = Connection::connect(&e2e::env::amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let queue = format!("bench-tools-{}", uuid::Uuid::new_v4().simple());
    let ch = confirm_channel(&conn).await.unwrap();
    declare_quorum(&ch, &queue).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let rolled = loop {
        ch.basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            b"x",
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
        let after = by_node(broker_wal_files());
        let rolled: Vec<_> = before
            .iter()
            .filter(|(node, file)| after.get(*node).is_some_and(|now| now != *file))
            .map(|(node, _)| node.clone())
            .collect();
        if !rolled.is_empty() || Instant::now() >= deadline {
            break (rolled, after);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = ch
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await;
    let _ = conn.close(200, "".into()).await;
    let (rolled, after) = rolled;
    assert!(
        !rolled.is_empty(),
        "no node holds another WAL file after the roll-over and a write: before {before:?}, \
         after {after:?}"
    );
}

/// A benchmark or suite run against `TEST_DATABASE_URL=…?sslmode=disable` (or `verify-full`,
/// a client certificate, an `application_name`) reaches each database it creates with those
/// parameters, not only the server's admin database.
#[tokio::test]
async fn a_test_database_is_reached_with_the_server_urls_parameters() {
    let admin = e2e::env::pg_admin_url();
    let sep = if admin.contains('?') { '&' } else { '?' };
    let env = e2e::Env::on(format!("{admin}{sep}application_name=e2e-url-parameters")).await;
    let name: String = sqlx::query_scalar("SELECT current_setting('application_name')")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(name, "e2e-url-parameters", "database URL {}", env.db_url);
    e2e::cleanup(env).await;
}
