//! More than one intents queue (`WORKER_INTENT_SHARDS`), on a 3-node RabbitMQ cluster of the
//! test's own with the consistent-hash exchange plugin: the shards' leaders are spread over the
//! nodes, every copy of one action key lands in the same shard, every intent is done once, and a
//! change of the shard count (3 to 2, with `WORKER_DRAIN_SHARDS=3`) loses none of the intents
//! still queued in the shard that goes away, which takes no new ones; and shards declared right
//! after a node restart still get their leaders on more than one node.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use e2e::rabbit_cluster::{RabbitCluster, RabbitClusterOptions};
use e2e::{cleanup, intent, wait_for, Downstream, Env, Worker, WorkerOptions};
use serde_json::json;

const T: Duration = Duration::from_secs(90);
const TENANT: &str = "north-shop";

/// Messages (ready and unacked) per queue whose name starts with `prefix`, from node 0; the
/// broker refreshes these counts every few seconds.
async fn depths(cluster: &RabbitCluster, prefix: &str) -> BTreeMap<String, u64> {
    let out = cluster
        .ctl(
            0,
            &["list_queues", "name", "messages", "--formatter", "json"],
        )
        .await;
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap_or_default();
    rows.iter()
        .filter_map(|r| {
            let name = r["name"].as_str()?;
            name.starts_with(prefix)
                .then(|| (name.to_string(), r["messages"].as_u64().unwrap_or(0)))
        })
        .collect()
}

/// The leaders of shards `<queue>.0..2` are on at least two nodes.
async fn assert_leaders_spread(cluster: &RabbitCluster, queue: &str, when: &str) {
    let mut leaders = BTreeSet::new();
    for i in 0..3 {
        leaders.insert(cluster.leader_of(&format!("{queue}.{i}")).await);
    }
    eprintln!("shard leaders {when}: nodes {leaders:?}");
    assert!(
        leaders.len() >= 2,
        "shard leaders {when} spread over the nodes: {leaders:?}"
    );
}

async fn all_succeeded(env: &Env, ids: &[String]) {
    for id in ids {
        let state = env.final_state(TENANT, id, T).await;
        assert_eq!(state, "succeeded", "{id}");
        assert_eq!(
            env.mutations(&format!("{TENANT}:{id}")).await,
            1,
            "{id} done once"
        );
    }
}

#[tokio::test]
async fn shards_spread_leaders_keep_a_key_in_one_shard_and_survive_a_change_of_count() {
    let cluster = RabbitCluster::start(RabbitClusterOptions {
        plugins: &["rabbitmq_consistent_hash_exchange"],
    })
    .await;
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let q = env.topology.intents_queue.clone();
    let shards = |n: u16| {
        WorkerOptions::new(env.standard_tools(ds.port, ""))
            .amqp_url(&cluster.amqp_urls())
            .env("WORKER_INTENT_SHARDS", &n.to_string())
    };
    let w = Worker::start(&env, "w3", &shards(3)).await;

    assert_leaders_spread(&cluster, &q, "on a fresh cluster").await;

    let publisher =
        publisher::Publisher::connect(&cluster.amqp_urls(), &env.topology.intents_exchange)
            .await
            .expect("publisher on the cluster");
    // Copies of one key, with the worker stopped: all in one shard.
    w.pause();
    for key in ["same-a", "same-b"] {
        for _ in 0..3 {
            publisher
                .publish(&intent(TENANT, key, "ticket", json!({"k": key})))
                .await
                .unwrap();
        }
    }
    let seen = wait_for("six messages in the shards", T, || async {
        let d = depths(&cluster, &format!("{q}.")).await;
        (d.values().sum::<u64>() == 6).then_some(d)
    })
    .await;
    assert!(
        seen.values().all(|n| n % 3 == 0),
        "each key's three copies in one shard: {seen:?}"
    );
    w.resume();
    all_succeeded(&env, &["same-a".into(), "same-b".into()]).await;

    let first: Vec<String> = (0..30).map(|i| format!("s-{i}")).collect();
    for (i, id) in first.iter().enumerate() {
        publisher
            .publish(&intent(
                TENANT,
                id,
                ["refund", "ticket", "deploy"][i % 3],
                json!({"i": i}),
            ))
            .await
            .unwrap();
    }
    all_succeeded(&env, &first).await;

    // 3 shards to 2: intents queued while no worker runs, some in the shard that goes away.
    drop(w);
    let queued: Vec<String> = (0..30).map(|i| format!("q-{i}")).collect();
    for id in &queued {
        publisher
            .publish(&intent(TENANT, id, "ticket", json!({"id": id})))
            .await
            .unwrap();
    }
    let before = wait_for("the 30 queued intents counted in the shards", T, || async {
        let d = depths(&cluster, &format!("{q}.")).await;
        (d.values().sum::<u64>() == 30).then_some(d)
    })
    .await;
    assert!(
        before.get(&format!("{q}.2")).copied().unwrap_or(0) > 0,
        "the shard that goes away holds queued intents: {before:?}"
    );
    let w = Worker::start(&env, "w2", &shards(2).env("WORKER_DRAIN_SHARDS", "3")).await;
    all_succeeded(&env, &queued).await;
    let after: Vec<String> = (0..20).map(|i| format!("a-{i}")).collect();
    for id in &after {
        publisher
            .publish(&intent(TENANT, id, "ticket", json!({"id": id})))
            .await
            .unwrap();
    }
    all_succeeded(&env, &after).await;
    // The broker's counts lag a few seconds behind the acks.
    wait_for("the old shard drained", T, || async {
        let d = depths(&cluster, &format!("{q}.2")).await;
        (d.get(&format!("{q}.2")) == Some(&0)).then_some(())
    })
    .await;
    // Messages reach a shard only through its binding: the drained one has none left.
    let out = cluster
        .ctl(
            0,
            &[
                "list_bindings",
                "source_name",
                "destination_name",
                "--formatter",
                "json",
            ],
        )
        .await;
    let bindings: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let to = |dest: String| {
        bindings
            .iter()
            .filter(|b| b["destination_name"] == dest.as_str() && b["source_name"] != "")
            .count()
    };
    assert_eq!(to(format!("{q}.2")), 0, "the old shard is unbound");
    assert_eq!(to(format!("{q}.0")), 1, "a current shard is bound");
    assert!(
        w.output.contains("old intents queue unbound"),
        "the worker says it unbound the old shard"
    );
    drop(w);

    // Right after a node restart the returning node leads no quorum queue, while the others
    // lead three more each here: `balanced` alone would give it every new shard's leader.
    for node in [1, 2] {
        let conn = lapin::Connection::connect(
            &cluster.amqp_url(node),
            lapin::ConnectionProperties::default(),
        )
        .await
        .unwrap();
        let ch = conn.create_channel().await.unwrap();
        for k in 0..3 {
            let mut args = lapin::types::FieldTable::default();
            for (k, v) in [
                ("x-queue-type", "quorum"),
                ("x-queue-leader-locator", "client-local"),
            ] {
                args.insert(
                    k.into(),
                    lapin::types::AMQPValue::LongString(lapin::types::LongString::from(v)),
                );
            }
            ch.queue_declare(
                format!("{q}-led-by-{node}-{k}").as_str().into(),
                lapin::options::QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
            )
            .await
            .unwrap();
        }
        let _ = conn.close(200, "".into()).await;
    }
    cluster.kill(0);
    cluster.start_node(0).await;
    let q2 = format!("{q}-after-restart");
    let w = Worker::start(&env, "w4", &shards(3).env("WORKER_INTENTS_QUEUE", &q2)).await;
    assert_leaders_spread(&cluster, &q2, "declared right after a restart of node 0").await;
    drop(w);
    cleanup(env).await;
}
