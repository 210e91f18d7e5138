//! The 3-node RabbitMQ cluster fixture (`e2e::rabbit_cluster`) works: the nodes form one
//! cluster, a quorum queue declared on one node has a member on each and carries confirmed
//! messages published on a second node to a consumer on the third; after a SIGKILL of the
//! queue's leader the two others elect a new one within 15 s, a publish on a survivor is still
//! confirmed (and nothing confirmed before is lost), and the killed node, started again, rejoins.
//! Needs `rabbitmq-server` installed, not the shared broker (never touched).

use std::time::{Duration, Instant};

use e2e::rabbit_cluster::{RabbitCluster, RabbitClusterOptions, NODES};
use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection};

const FAILOVER_LIMIT: Duration = Duration::from_secs(15);

async fn connect(url: &str) -> Connection {
    Connection::connect(url, Default::default())
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

/// Declares durable quorum queue `name` with a member on each of the three nodes; returns the
/// number of messages in it.
async fn declare_quorum(url: &str, name: &str, passive: bool) -> u32 {
    let conn = connect(url).await;
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    args.insert("x-quorum-initial-group-size".into(), AMQPValue::LongInt(3));
    let q = ch
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable: true,
                passive,
                ..Default::default()
            },
            if passive { FieldTable::default() } else { args },
        )
        .await
        .expect("declare the quorum queue");
    let _ = conn.close(200, "".into()).await;
    q.message_count()
}

/// Publishes `bodies` to `queue` on one connection to `url`, each confirmed by the broker.
async fn publish_confirmed(url: &str, queue: &str, bodies: &[String]) {
    let conn = connect(url).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for body in bodies {
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body.as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
        assert!(confirm.is_ack(), "the broker confirmed {body}");
        assert!(confirm.take_message().is_none(), "{body} was routed");
    }
    let _ = conn.close(200, "".into()).await;
}

fn expected_nodes(cluster: &RabbitCluster) -> Vec<String> {
    let mut names: Vec<String> = (0..NODES).map(|i| cluster.node_name(i)).collect();
    names.sort();
    names
}

fn queue_name(what: &str) -> String {
    format!("e2e-{what}-{}", uuid::Uuid::new_v4().simple())
}

// One test, one cluster: starting three nodes is most of the cost (17-19 s here).
#[tokio::test]
async fn three_nodes_carry_a_quorum_queue_and_survive_the_loss_of_its_leader() {
    let t0 = Instant::now();
    let cluster = RabbitCluster::start(RabbitClusterOptions::default()).await;
    println!(
        "cluster started in {:.1} s",
        cluster.start_time.as_secs_f64()
    );
    forms_a_cluster_and_carries_a_quorum_queue(&cluster).await;
    a_killed_leader_is_replaced_and_the_node_rejoins(&cluster).await;
    println!("whole test {:.1} s", t0.elapsed().as_secs_f64());
}

async fn forms_a_cluster_and_carries_a_quorum_queue(cluster: &RabbitCluster) {
    assert_eq!(cluster.amqp_urls().split(',').count(), 3);

    assert_eq!(cluster.running_nodes(0).await, expected_nodes(cluster));

    let queue = queue_name("formed");
    declare_quorum(&cluster.amqp_url(0), &queue, false).await;
    let members = cluster
        .quorum_status(0, &queue)
        .await
        .expect("quorum_status");
    let mut member_names: Vec<String> = members.iter().map(|(n, _)| n.clone()).collect();
    member_names.sort();
    assert_eq!(member_names, expected_nodes(cluster), "{members:?}");
    let leaders = members.iter().filter(|(_, s)| s == "leader").count();
    assert_eq!(leaders, 1, "{members:?}");

    let bodies: Vec<String> = (0..10).map(|n| format!("m-{n}")).collect();
    publish_confirmed(&cluster.amqp_url(1), &queue, &bodies).await;

    let conn = connect(&cluster.amqp_url(2)).await;
    let ch = conn.create_channel().await.unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.as_str().into(),
            "e2e".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut got = Vec::new();
    while got.len() < bodies.len() {
        let delivery = tokio::time::timeout(Duration::from_secs(15), consumer.next())
            .await
            .expect("a delivery on node 3 within 15 s")
            .expect("consumer open")
            .expect("delivery");
        got.push(String::from_utf8(delivery.data.clone()).unwrap());
        delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(
        got, bodies,
        "published on node 2, consumed in order on node 3"
    );
    let _ = conn.close(200, "".into()).await;
}

async fn a_killed_leader_is_replaced_and_the_node_rejoins(cluster: &RabbitCluster) {
    let queue = queue_name("failover");
    declare_quorum(&cluster.amqp_url(0), &queue, false).await;
    publish_confirmed(&cluster.amqp_url(0), &queue, &["before".to_string()]).await;

    let leader = cluster.leader_of(&queue).await;
    let pid = cluster.os_pid(leader).expect("the leader runs");
    println!(
        "leader: node {leader} ({}, pid {pid})",
        cluster.node_name(leader)
    );

    let killed_at = Instant::now();
    cluster.kill(leader);
    assert!(!cluster.is_running(leader));
    let new_leader = e2e::wait_for(
        "a new leader among the surviving nodes",
        FAILOVER_LIMIT,
        || async {
            cluster
                .try_leader_of(&queue)
                .await
                .filter(|&l| l != leader && cluster.is_running(l))
        },
    )
    .await;
    let failover = killed_at.elapsed();
    println!(
        "new leader: node {new_leader} after {:.2} s",
        failover.as_secs_f64()
    );
    assert!(failover < FAILOVER_LIMIT);

    let survivor = (0..NODES).find(|&i| i != leader).expect("a surviving node");
    publish_confirmed(&cluster.amqp_url(survivor), &queue, &["after".to_string()]).await;
    assert_eq!(
        declare_quorum(&cluster.amqp_url(survivor), &queue, true).await,
        2,
        "both confirmed messages are in the queue"
    );

    let restarted_at = Instant::now();
    cluster.start_node(leader).await;
    println!(
        "node {leader} started again in {:.1} s",
        restarted_at.elapsed().as_secs_f64()
    );
    assert!(cluster.is_running(leader));
    assert_eq!(cluster.running_nodes(leader).await, expected_nodes(cluster));
    assert_eq!(
        cluster.running_nodes(survivor).await,
        expected_nodes(cluster)
    );
}
