//! Two workers against a 3-node RabbitMQ cluster of the test's own (`e2e::rabbit_cluster`), the
//! intents queue (declared by the workers) a quorum queue with a member on every node, a steady
//! feed of intents for all three capabilities (refund = replay, ticket = lookup, deploy = none):
//!
//! 1. the intents queue's leader is SIGKILLed mid-feed: consumption resumes (an intent first sent
//!    after the kill is answered `succeeded`, and each worker records one) and both workers'
//!    `/readyz` are 200 on surviving nodes within 15 s; the node is started again;
//! 2. the node worker B's consumer is connected to (its `/readyz` `broker_nodes`) is SIGKILLed:
//!    the same, within 15 s; the node is started again;
//! 3. every intent has a ledger row (0 lost intents), one mutation in the downstream (0 duplicate
//!    mutations), at least one `succeeded` event carrying the downstream's own receipt and no
//!    `failed` or `rejected` one (0 lost final answers, 0 false failure / success), and every
//!    final event the worker recorded reached the agent;
//! 4. two of the three nodes are SIGKILLed: a publish with confirms to the remaining node is
//!    never confirmed (the minority node pauses, `cluster_partition_handling = pause_minority`:
//!    it resets its connections and refuses new ones), both workers' `/readyz` answer 503 naming
//!    the broker; once the two nodes are started again a fresh feed is answered by both workers,
//!    and the invariants of 3 hold for every intent of the test.
//!
//! Worker A gets the whole node list; worker B the two nodes A's consumer did not land on, so
//! the two consume through different nodes (a list is tried in a shuffled order).
//!
//! The agent publishes through `publisher::Publisher`, which takes one URL (a publisher node
//! list is not supported yet): the test's sender connects to one node and, on any publish error
//! or a confirm that does not come, sends the same intent (same key, same body) again through the
//! next node until it is confirmed ("may or may not be queued, safe to send again"). The agent
//! reads results from a quorum queue of its own bound to its tenant, so no event is lost with the
//! node the agent happens to read from. The shared broker (127.0.0.1:5672) is never used: the
//! test's `Env` names the cluster's node 0 as its broker (for the harness's clean-up), the
//! workers declare the topology on the cluster themselves. Every measured time is printed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use e2e::cluster_agent::{declare_results_queue, spawn_collector, Received};
use e2e::rabbit_cluster::{RabbitCluster, RabbitClusterOptions, NODES};
use e2e::{cleanup, host_port, intent, Downstream, Env, Worker, WorkerOptions};
use lapin::options::QueueDeleteOptions;
use lapin::Connection;
use protocol::{Intent, ResultEvent, Status};
use publisher::Publisher;
use serde_json::json;

const TENANT: &str = "north-shop";
const TOOLS: [&str; 3] = ["refund", "ticket", "deploy"];
/// How long consumption may take to resume after one node of three is lost.
const RESUME_LIMIT: Duration = Duration::from_secs(15);
/// How long a publish to the minority node is watched for a (false) confirm.
const MINORITY_WINDOW: Duration = Duration::from_secs(10);
/// The feed's pace: one intent per this (about 6 a second).
const FEED_EVERY: Duration = Duration::from_millis(150);
const T: Duration = Duration::from_secs(60);

/// The standard tools with an 8 s timeout, and a 20 s lease (as in link_loss.rs): on this
/// loaded 2-core machine (three broker nodes, two workers) a request must neither time out nor
/// outlive its lease, which is not what this test is about.
fn roomy_tools(env: &Env, port: u16) -> std::path::PathBuf {
    env.standard_tools_timed(port, 8000, "")
}

fn worker_opts(tools: &std::path::Path, amqp_urls: &str) -> WorkerOptions {
    let mut opts = WorkerOptions::new(tools.to_path_buf())
        .amqp_url(amqp_urls)
        .with_metrics();
    opts.lease_secs = 20;
    opts
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

// ---- the agent's sender: one node at a time, the same intent again until confirmed ----

/// Publishes through one node's URL at a time (`Publisher::connect` takes one URL); on an error
/// or a confirm that does not come it drops the connection, moves to the next node and sends
/// the same intent again.
struct Sender {
    urls: Vec<String>,
    exchange: String,
    next: usize,
    publisher: Option<Publisher>,
    /// Every failed attempt: (when, node index, what happened).
    errors: Vec<(Instant, usize, String)>,
}

impl Sender {
    fn new(urls: &[String], exchange: &str, start: usize) -> Sender {
        Sender {
            urls: urls.to_vec(),
            exchange: exchange.to_string(),
            next: start % urls.len(),
            publisher: None,
            errors: Vec::new(),
        }
    }

    /// Connects to the current node unless connected.
    async fn connect(&mut self) -> Result<(), String> {
        if self.publisher.is_none() {
            let url = &self.urls[self.next];
            let p = tokio::time::timeout(
                Duration::from_secs(5),
                Publisher::connect(url, &self.exchange),
            )
            .await
            .map_err(|_| "connect timed out".to_string())?
            .map_err(|e| format!("connect: {e}"))?;
            self.publisher = Some(p);
        }
        Ok(())
    }

    /// One attempt through the current node: Ok only when the broker confirmed (ack, routed).
    async fn try_once(&mut self, intent: &Intent, confirm_within: Duration) -> Result<(), String> {
        self.connect().await?;
        let p = self.publisher.as_ref().expect("connected");
        tokio::time::timeout(confirm_within, p.publish(intent))
            .await
            .map_err(|_| format!("no confirm within {confirm_within:?}"))?
            .map_err(|e| format!("publish: {e}"))
    }

    /// Sends `intent` until it is confirmed; returns the number of attempts.
    async fn send(&mut self, intent: &Intent) -> u32 {
        let deadline = Instant::now() + Duration::from_secs(90);
        let mut attempts = 0;
        loop {
            attempts += 1;
            match self.try_once(intent, Duration::from_secs(8)).await {
                Ok(()) => return attempts,
                Err(e) => {
                    self.errors.push((
                        Instant::now(),
                        self.next,
                        format!("{}: {e}", intent.action_id),
                    ));
                    // The connection may be half-dead: never reuse it after an error.
                    self.publisher = None;
                    self.next = (self.next + 1) % self.urls.len();
                    assert!(
                        Instant::now() < deadline,
                        "{} not confirmed by any node within 90 s (last: {e})",
                        intent.action_id
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}

/// One intent the agent sent.
#[derive(Clone)]
struct Sent {
    id: String,
    first_attempt: Instant,
    /// When the broker confirmed it (None while the sender is still at it).
    confirmed: Option<Instant>,
    attempts: u32,
}

type Log<T> = Arc<Mutex<Vec<T>>>;

/// Sends `<prefix>-<n>` intents (tools round-robin) until `stop`; returns its sender.
fn spawn_feed(
    prefix: &'static str,
    mut sender: Sender,
    sent: Log<Sent>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Sender> {
    tokio::spawn(async move {
        let mut n = 0usize;
        while !stop.load(Ordering::SeqCst) {
            let id = format!("{prefix}-{n}");
            let it = intent(TENANT, &id, TOOLS[n % 3], json!({"order": id, "n": n}));
            let index = {
                let mut s = sent.lock().unwrap();
                s.push(Sent {
                    id: id.clone(),
                    first_attempt: Instant::now(),
                    confirmed: None,
                    attempts: 0,
                });
                s.len() - 1
            };
            let attempts = sender.send(&it).await;
            {
                let mut s = sent.lock().unwrap();
                s[index].confirmed = Some(Instant::now());
                s[index].attempts = attempts;
            }
            n += 1;
            tokio::time::sleep(FEED_EVERY).await;
        }
        sender
    })
}

// ---- the agent's results: a quorum queue of its own, read through any live node ----

/// Distinct events (by `event_id`) about `id`, in arrival order.
fn events_of(got: &[Received], id: &str) -> Vec<ResultEvent> {
    let mut seen = BTreeSet::new();
    got.iter()
        .filter(|r| r.event.action_id == id && seen.insert(r.event.event_id.clone()))
        .map(|r| r.event.clone())
        .collect()
}

// ---- the workers' readiness ----

/// `/readyz`: (status, consumer node, relay node, body).
async fn readyz(w: &Worker) -> (u16, Option<String>, Option<String>, String) {
    let (status, body) = w.get("/readyz").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let node = |link: &str| v["broker_nodes"][link].as_str().map(str::to_owned);
    (status, node("consumer"), node("relay"), body)
}

/// The cluster node index of `host:port`.
fn node_index(cluster: &RabbitCluster, addr: &str) -> Option<usize> {
    (0..NODES).find(|&i| host_port(&cluster.amqp_url(i)) == addr)
}

/// Waits until every worker answers `/readyz` 200 with neither link on a node of `gone`;
/// returns how long that took from `since`, and whether any answered 503 meanwhile (with its
/// body).
async fn ready_again(
    workers: &[&Worker],
    gone: &[String],
    since: Instant,
) -> (Duration, Vec<String>) {
    let mut not_ready = Vec::new();
    loop {
        let mut all = true;
        for w in workers {
            let (status, consumer, relay, body) = readyz(w).await;
            let on_gone = [&consumer, &relay]
                .iter()
                .any(|n| n.as_ref().is_some_and(|n| gone.contains(n)));
            if status != 200 || on_gone {
                all = false;
            }
            if status == 503 && not_ready.len() < 4 {
                not_ready.push(format!("{}: {body}", w.name));
            }
        }
        if all {
            return (since.elapsed(), not_ready);
        }
        assert!(
            since.elapsed() < T,
            "the workers were not ready again within {T:?}: {not_ready:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until each of `workers` has recorded (the ledger row's `changed_by`) an intent whose
/// first send began after `since` and the agent has its `succeeded` event; returns, per worker,
/// the time from `since` to the first such event. A worker whose consumer never came back would
/// make this time out while the other worker takes the whole feed.
async fn consumption_resumed(
    env: &Env,
    workers: &[&Worker],
    since: Instant,
    sent: &Log<Sent>,
    got: &Log<Received>,
) -> BTreeMap<String, Duration> {
    loop {
        let after: BTreeSet<String> = sent
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.first_attempt >= since)
            .map(|s| s.id.clone())
            .collect();
        let answered: BTreeMap<String, Duration> = {
            let mut first = BTreeMap::new();
            for r in got.lock().unwrap().iter() {
                if r.event.status == Status::Succeeded && after.contains(&r.event.action_id) {
                    let d = r.at.duration_since(since);
                    first
                        .entry(r.event.action_id.clone())
                        .and_modify(|e: &mut Duration| *e = (*e).min(d))
                        .or_insert(d);
                }
            }
            first
        };
        let ids: Vec<String> = answered.keys().cloned().collect();
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT action_id, changed_by FROM operations WHERE tenant = $1 AND action_id = ANY($2)",
        )
        .bind(TENANT)
        .bind(&ids)
        .fetch_all(&env.pool)
        .await
        .expect("read the ledger");
        let mut per_worker: BTreeMap<String, Duration> = BTreeMap::new();
        for (id, by) in rows {
            let Some(w) = workers
                .iter()
                .find(|w| by == format!("{}-{}", w.name, env.id))
            else {
                continue;
            };
            let d = answered[&id];
            per_worker
                .entry(w.name.clone())
                .and_modify(|e| *e = (*e).min(d))
                .or_insert(d);
        }
        if per_worker.len() == workers.len() {
            return per_worker;
        }
        assert!(
            since.elapsed() < T,
            "within {T:?} of {since:?}, intents sent since were answered succeeded only by \
             {per_worker:?} ({} answered): a worker's consumer did not come back",
            answered.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Which worker links are on node `i`, for the log.
async fn links_on(cluster: &RabbitCluster, workers: &[&Worker], i: usize) -> Vec<String> {
    let addr = host_port(&cluster.amqp_url(i));
    let mut on = Vec::new();
    for w in workers {
        let (_, consumer, relay, _) = readyz(w).await;
        if consumer.as_deref() == Some(addr.as_str()) {
            on.push(format!("{} consumer", w.name));
        }
        if relay.as_deref() == Some(addr.as_str()) {
            on.push(format!("{} relay", w.name));
        }
    }
    on
}

/// Kills node `victim` mid-feed and measures the resumption; then starts it again.
#[allow(clippy::too_many_arguments)]
async fn lose_one_node(
    what: &str,
    env: &Env,
    cluster: &RabbitCluster,
    queue: &str,
    victim: usize,
    workers: &[&Worker],
    sent: &Log<Sent>,
    got: &Log<Received>,
    times: &mut Vec<(String, Duration)>,
) {
    let on = links_on(cluster, workers, victim).await;
    let leader = cluster.try_leader_of(queue).await;
    println!(
        "{what}: killing node {victim} ({}, the intents queue's {}); worker links on it: {on:?}",
        host_port(&cluster.amqp_url(victim)),
        if leader == Some(victim) {
            "leader"
        } else {
            "follower"
        }
    );
    let gone = vec![host_port(&cluster.amqp_url(victim))];
    let killed_at = Instant::now();
    cluster.kill(victim);
    let (per_worker, (ready, not_ready)) = tokio::join!(
        consumption_resumed(env, workers, killed_at, sent, got),
        ready_again(workers, &gone, killed_at)
    );
    let resumed = per_worker.values().min().copied().unwrap_or_default();
    let both = per_worker.values().max().copied().unwrap_or_default();
    println!(
        "{what}: an intent sent after the kill succeeded after {}, one recorded by each worker \
         after {} ({per_worker:?}); both workers ready on other nodes after {} (503 answers \
         seen meanwhile: {not_ready:?})",
        secs(resumed),
        secs(both),
        secs(ready)
    );
    times.push((format!("{what}: consumption resumed"), resumed));
    times.push((format!("{what}: both workers consuming"), both));
    times.push((format!("{what}: both workers ready"), ready));
    assert!(
        both < RESUME_LIMIT,
        "{what}: consumption resumed in both workers only after {per_worker:?}"
    );
    assert!(
        ready < RESUME_LIMIT,
        "{what}: the workers were ready again only after {ready:?}"
    );
    let leader = cluster
        .try_leader_of(queue)
        .await
        .map_or("?".into(), |l| l.to_string());
    println!("{what}: leader of the intents queue now: node {leader}");
    let restart = Instant::now();
    cluster.start_node(victim).await;
    let restarted = restart.elapsed();
    println!("{what}: node {victim} started again in {}", secs(restarted));
    times.push((format!("{what}: node restart"), restarted));
}

// ---- the invariants ----

/// Checks every key of `ids` against the downstream, the ledger, the outbox and the agent's
/// events; returns a one-line summary. Waits (up to `T`) for the last events to arrive.
async fn check_invariants(
    env: &Env,
    ids: &[String],
    sent: &BTreeMap<String, u32>,
    got: &Log<Received>,
) -> String {
    // Every succeeded/failed event the worker recorded has reached the agent.
    let deadline = Instant::now() + T;
    loop {
        let mut missing = Vec::new();
        for id in ids {
            let recorded = env
                .outbox_statuses(TENANT, id)
                .await
                .iter()
                .filter(|s| *s == "succeeded" || *s == "failed")
                .count();
            let snapshot = got.lock().unwrap().clone();
            let received = events_of(&snapshot, id)
                .iter()
                .filter(|e| matches!(e.status, Status::Succeeded | Status::Failed))
                .count();
            if recorded == 0 || received < recorded {
                missing.push(format!("{id} (recorded {recorded}, received {received})"));
            }
        }
        if missing.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "lost final answers (no final event recorded, or recorded but never received by the \
             agent) after {T:?}: {missing:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let got = got.lock().unwrap().clone();
    let mut extra_answers = Vec::new();
    let mut pending = 0;
    for id in ids {
        let key = format!("{TENANT}:{id}");
        // 0 lost intents: the ledger has the row, and it is final.
        let op = env
            .operation(TENANT, id)
            .await
            .unwrap_or_else(|| panic!("{key}: lost intent (no ledger row)"));
        assert_eq!(op.state, "succeeded", "{key}: ledger state");
        // 0 duplicate mutations.
        assert_eq!(env.mutations(&key).await, 1, "{key}: exactly one mutation");
        let receipt = env
            .downstream_receipt(&key)
            .await
            .unwrap_or_else(|| panic!("{key}: no downstream receipt"));
        let events = events_of(&got, id);
        let succeeded: Vec<&ResultEvent> = events
            .iter()
            .filter(|e| e.status == Status::Succeeded)
            .collect();
        // 0 false failure, 0 false rejection.
        let wrong: Vec<&ResultEvent> = events
            .iter()
            .filter(|e| matches!(e.status, Status::Failed | Status::Rejected))
            .collect();
        assert!(
            wrong.is_empty(),
            "{key}: false failure/rejection: {wrong:?}"
        );
        pending += events
            .iter()
            .filter(|e| e.status == Status::Pending)
            .count();
        // One final answer: at least one succeeded event, every one with the downstream's own
        // receipt (0 false success). More than one succeeded event is the contract's answer to
        // a repeated delivery (the agent's own re-send after an unconfirmed publish, or the
        // broker's redelivery of a delivery whose ack was lost with its node): the same outcome
        // again under a new event id, never a second outcome.
        assert!(!succeeded.is_empty(), "{key}: no succeeded event");
        for e in &succeeded {
            assert_eq!(
                e.receipt.as_ref(),
                Some(&receipt),
                "{key}: a succeeded event with another receipt than the downstream's"
            );
        }
        if succeeded.len() > 1 {
            extra_answers.push(format!(
                "{id} ({} succeeded events, sent {} time(s))",
                succeeded.len(),
                sent.get(id).copied().unwrap_or(0)
            ));
        }
    }
    format!(
        "{} keys: 0 lost intents, 0 lost final answers, 0 duplicate mutations, 0 false \
         failure/success; {pending} pending event(s); {} key(s) answered more than once (same \
         receipt, as the contract says for a repeated delivery): {extra_answers:?}",
        ids.len(),
        extra_answers.len()
    )
}

// ---- the test ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_ride_out_node_losses_of_a_three_node_cluster() {
    let t0 = Instant::now();
    let mut times: Vec<(String, Duration)> = Vec::new();
    let (cluster, mut env) = tokio::join!(
        RabbitCluster::start(RabbitClusterOptions::default()),
        Env::new()
    );
    times.push(("cluster start".into(), cluster.start_time));
    // The test's broker is the cluster (node 0 for the harness's clean-up of its names); each
    // worker and the agent get their own URLs below.
    env.amqp_url = cluster.amqp_url(0);
    let urls: Vec<String> = (0..NODES).map(|i| cluster.amqp_url(i)).collect();
    let ds = Downstream::start(&env).await;
    let tools = roomy_tools(&env, ds.port);
    let intents_queue = env.topology.intents_queue.clone();

    // The agent's results queue exists before any worker publishes a result.
    let results_queue = format!("{}.agent", env.topology.results_exchange);
    declare_results_queue(
        &urls[2],
        &env.topology.results_exchange,
        &results_queue,
        &[TENANT],
    )
    .await;
    let got: Log<Received> = Arc::default();
    let stop_reader = Arc::new(AtomicBool::new(false));
    let reader = spawn_collector(
        urls.clone(),
        results_queue.clone(),
        got.clone(),
        stop_reader.clone(),
    );

    // Worker A gets the whole node list; worker B the two nodes A's consumer is not on, so the
    // two consume through different nodes (the list is tried in a shuffled order).
    let started = Instant::now();
    let mut wa = Worker::start(&env, "wa", &worker_opts(&tools, &cluster.amqp_urls())).await;
    let (_, a_consumer, a_relay) = e2e::wait_for("worker A ready", T, || async {
        let (status, c, r, _) = readyz(&wa).await;
        (status == 200).then_some(((), c, r))
    })
    .await;
    let a_node = node_index(&cluster, a_consumer.as_deref().unwrap_or(""))
        .expect("worker A names a cluster node");
    let b_list: Vec<String> = (0..NODES)
        .filter(|&i| i != a_node)
        .map(|i| urls[i].clone())
        .collect();
    let mut wb = Worker::start(&env, "wb", &worker_opts(&tools, &b_list.join(","))).await;
    let (_, b_consumer, b_relay) = e2e::wait_for("worker B ready", T, || async {
        let (status, c, r, _) = readyz(&wb).await;
        (status == 200).then_some(((), c, r))
    })
    .await;
    times.push(("both workers started".into(), started.elapsed()));
    println!(
        "worker A (all 3 nodes): consumer {a_consumer:?}, relay {a_relay:?}; worker B (nodes \
         other than {a_node}): consumer {b_consumer:?}, relay {b_relay:?}"
    );
    assert_ne!(
        a_consumer, b_consumer,
        "the workers consume on different nodes"
    );

    // The intents queue the workers declared is a quorum queue with a member on every node
    // (the worker sets no initial group size: RabbitMQ 3.10 puts one on each cluster node).
    let members = cluster
        .quorum_status(0, &intents_queue)
        .await
        .expect("quorum_status of the intents queue");
    println!("intents queue members: {members:?}");
    assert_eq!(
        members.len(),
        NODES,
        "the intents queue has a member on each node: {members:?}"
    );

    let workers = [&wa, &wb];
    let sent: Log<Sent> = Arc::default();
    let stop_feed = Arc::new(AtomicBool::new(false));
    let feed = spawn_feed(
        "feed",
        Sender::new(&urls, &env.topology.intents_exchange, 0),
        sent.clone(),
        stop_feed.clone(),
    );
    // Warm up: the feed is answered before anything breaks.
    let warm = Instant::now();
    let first = consumption_resumed(&env, &workers, warm, &sent, &got).await;
    println!("warm-up: first feed intent per worker answered after {first:?}");
    tokio::time::sleep(Duration::from_secs(2)).await;

    // 1. The intents queue's leader dies mid-feed.
    let leader = cluster.leader_of(&intents_queue).await;
    lose_one_node(
        "leader loss",
        &env,
        &cluster,
        &intents_queue,
        leader,
        &workers,
        &sent,
        &got,
        &mut times,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    // 2. The node worker B consumes through dies mid-feed (the leader's loss above took worker
    // A's consumer node: A declared the queue, and a quorum queue's leader starts on the
    // declaring node).
    let (_, b_consumer, _, _) = readyz(&wb).await;
    let victim = node_index(&cluster, b_consumer.as_deref().unwrap_or(""))
        .expect("worker B's consumer names a cluster node");
    lose_one_node(
        "consumer node loss",
        &env,
        &cluster,
        &intents_queue,
        victim,
        &workers,
        &sent,
        &got,
        &mut times,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    // The feed stops; everything it sent is settled and checked.
    stop_feed.store(true, Ordering::SeqCst);
    let feed_sender = feed.await.expect("the feed task");
    let sent_now = sent.lock().unwrap().clone();
    let publish_errors = feed_sender.errors.clone();
    println!(
        "feed: {} intents sent, {} publish attempts failed and were sent again (same key): {:?}",
        sent_now.len(),
        publish_errors.len(),
        publish_errors
            .iter()
            .map(|(at, node, e)| format!("+{:.1}s node {node}: {e}", (*at - t0).as_secs_f64()))
            .collect::<Vec<_>>()
    );
    if let Some((slowest, took)) = sent_now
        .iter()
        .filter_map(|s| Some((&s.id, s.confirmed?.duration_since(s.first_attempt))))
        .max_by_key(|(_, d)| *d)
    {
        println!(
            "feed: the longest from first send to confirm was {} ({slowest})",
            secs(took)
        );
        times.push(("feed: longest send-to-confirm".into(), took));
    }
    let mut sends: BTreeMap<String, u32> = sent_now
        .iter()
        .map(|s| (s.id.clone(), s.attempts))
        .collect();
    let ids: Vec<String> = sent_now.iter().map(|s| s.id.clone()).collect();
    assert!(ids.len() > 50, "a steady feed: {} intents", ids.len());
    let settle = Instant::now();
    println!(
        "after two single-node losses: {}",
        check_invariants(&env, &ids, &sends, &got).await
    );
    times.push(("settle and check".into(), settle.elapsed()));

    // 3. Two of three nodes die: the one left is a minority.
    let survivor = cluster.leader_of(&intents_queue).await;
    let dead: Vec<usize> = (0..NODES).filter(|&i| i != survivor).collect();
    println!(
        "majority loss: killing nodes {dead:?}, node {survivor} (the intents queue's leader) is \
         left alone"
    );
    let probe = intent(
        TENANT,
        "minority-probe",
        "refund",
        json!({"order": "minority"}),
    );
    // Connected to the node that is left before the others die, so the first publish goes out
    // on a channel that was open and in confirm mode.
    let mut minority = Sender::new(&[urls[survivor].clone()], &env.topology.intents_exchange, 0);
    minority
        .connect()
        .await
        .expect("connect to the future survivor");
    let killed_at = Instant::now();
    for &i in &dead {
        cluster.kill(i);
    }
    let watch_minority = async {
        // Publishes with confirms through the node that is left, again and again, for
        // MINORITY_WINDOW: no attempt may be confirmed.
        let mut outcomes = Vec::new();
        while killed_at.elapsed() < MINORITY_WINDOW {
            let left = MINORITY_WINDOW.saturating_sub(killed_at.elapsed());
            let at = killed_at.elapsed();
            let outcome = minority
                .try_once(&probe, left.max(Duration::from_millis(100)))
                .await;
            if outcome.is_err() {
                minority.publisher = None;
            }
            outcomes.push((at, killed_at.elapsed(), outcome));
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        outcomes
    };
    let watch_workers = async {
        let mut answers: Vec<(Duration, String)> = Vec::new();
        loop {
            let mut all = true;
            for w in workers {
                let (status, _, _, body) = readyz(w).await;
                if status == 503 && body.contains("broker") {
                    if !answers.iter().any(|(_, a)| a.starts_with(&w.name)) {
                        answers.push((killed_at.elapsed(), format!("{}: {status} {body}", w.name)));
                    }
                } else {
                    all = false;
                }
            }
            if all {
                return answers;
            }
            assert!(
                killed_at.elapsed() < Duration::from_secs(30),
                "the workers' /readyz did not answer 503 naming the broker within 30 s of the \
                 majority loss: {answers:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    // What the node that is left does meanwhile (pause_minority stops its rabbit application).
    let watch_survivor = async {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let at = killed_at.elapsed();
        let out = cluster
            .ctl(survivor, &["-q", "eval", "rabbit:is_running()."])
            .await;
        (
            at,
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        )
    };
    let (outcomes, not_ready, (asked_at, running, ctl_err)) =
        tokio::join!(watch_minority, watch_workers, watch_survivor);
    println!(
        "majority loss: node {survivor} at +{}: rabbit:is_running() = {running:?} {ctl_err}",
        secs(asked_at)
    );
    // Runs of the same outcome, printed once each.
    let mut runs: Vec<(Duration, Duration, usize, String)> = Vec::new();
    for (at, end, outcome) in &outcomes {
        let text = match outcome {
            Ok(()) => "CONFIRMED".to_string(),
            Err(e) => e.clone(),
        };
        match runs.last_mut() {
            Some(run) if run.3 == text => {
                run.1 = *end;
                run.2 += 1;
            }
            _ => runs.push((*at, *end, 1, text)),
        }
    }
    for (from, to, n, text) in &runs {
        println!(
            "majority loss: publish to node {survivor}, attempts from +{} to +{} ({n} \
             attempt(s)): {text}",
            secs(*from),
            secs(*to)
        );
    }
    for (at, answer) in &not_ready {
        println!(
            "majority loss: /readyz first 503 at +{}: {answer}",
            secs(*at)
        );
    }
    // Never a false confirm: every attempt was refused, failed or went unconfirmed.
    assert!(
        outcomes.iter().all(|(_, _, o)| o.is_err()),
        "a publish to the minority node was confirmed: {outcomes:?}"
    );
    assert!(!outcomes.is_empty());
    // The workers' 503 still holds at the end of the window (not a blip), naming the broker.
    for w in workers {
        let (status, consumer, relay, body) = readyz(w).await;
        println!(
            "majority loss: {} /readyz at +{}: {status} {body}",
            w.name,
            secs(killed_at.elapsed())
        );
        assert_eq!(
            status, 503,
            "{}: not ready while 2 of 3 nodes are down: {body}",
            w.name
        );
        assert!(
            body.contains("broker"),
            "{}: the reason names the broker: {body}",
            w.name
        );
        assert_eq!(
            consumer, None,
            "{}: the consumer link is on no node while the cluster has no majority: {body}",
            w.name
        );
        // An idle relay notices its lost link too (it checks its channel on every idle
        // wake), so it names no node either.
        assert_eq!(
            relay, None,
            "{}: the relay link is on no node while the cluster has no majority: {body}",
            w.name
        );
    }
    let down_for = killed_at.elapsed();

    // Both nodes start again (together: each waits for the other's tables).
    let restart = Instant::now();
    tokio::join!(cluster.start_node(dead[0]), cluster.start_node(dead[1]));
    let restarted = restart.elapsed();
    println!(
        "majority loss: nodes {dead:?} started again in {} (all three were down or paused for \
         {} before)",
        secs(restarted),
        secs(down_for)
    );
    times.push(("majority loss: two nodes restarted".into(), restarted));
    // A fresh feed from the moment the restart began; the workers may still be in their
    // reconnect back-off (up to 10 s ± 50 % after a long outage).
    let post_sent: Log<Sent> = Arc::default();
    let stop_post = Arc::new(AtomicBool::new(false));
    let post = spawn_feed(
        "post",
        Sender::new(&urls, &env.topology.intents_exchange, survivor),
        post_sent.clone(),
        stop_post.clone(),
    );
    let (per_worker, (ready, _)) = tokio::join!(
        consumption_resumed(&env, &workers, restart, &post_sent, &got),
        ready_again(&workers, &[], restart)
    );
    let resumed = per_worker.values().min().copied().unwrap_or_default();
    let both = per_worker.values().max().copied().unwrap_or_default();
    println!(
        "majority loss: after the restart began, both workers ready after {}, a new intent \
         succeeded after {}, one recorded by each worker after {} ({per_worker:?}); that is {} \
         after the nodes were up",
        secs(ready),
        secs(resumed),
        secs(both),
        secs(both.saturating_sub(restarted))
    );
    times.push((
        "majority loss: both workers ready after restart".into(),
        ready,
    ));
    times.push((
        "majority loss: new intent succeeded after restart".into(),
        resumed,
    ));
    times.push((
        "majority loss: both workers consuming after restart".into(),
        both,
    ));
    // The nodes' boot plus the workers' reconnect back-off (capped at 10 s, ± 50 %) after a
    // long outage: slower than one node's loss, but bounded.
    assert!(
        both < Duration::from_secs(30),
        "after the majority came back, both workers consumed again only after {per_worker:?}"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop_post.store(true, Ordering::SeqCst);
    let mut post_sender = post.await.expect("the post feed");
    // The probe may or may not have been queued: sent again under the same key until confirmed.
    let probe_attempts = post_sender.send(&probe).await;
    sends.insert(
        probe.action_id.clone(),
        probe_attempts + outcomes.len() as u32,
    );
    let post_now = post_sent.lock().unwrap().clone();
    println!(
        "majority loss: {} intents sent after the restart, {} publish attempt(s) sent again; \
         probe confirmed after {probe_attempts} more attempt(s)",
        post_now.len(),
        post_sender.errors.len()
    );
    let mut all_ids = ids.clone();
    for s in &post_now {
        sends.insert(s.id.clone(), s.attempts);
        all_ids.push(s.id.clone());
    }
    all_ids.push(probe.action_id.clone());
    println!(
        "at the end: {}",
        check_invariants(&env, &all_ids, &sends, &got).await
    );
    assert!(wa.is_running() && wb.is_running(), "no worker exited");

    // Clean-up: the agent's queue, then the harness's (workers first), then the cluster.
    stop_reader.store(true, Ordering::SeqCst);
    let _ = reader.await;
    if let Ok(conn) = Connection::connect(&urls[0], Default::default()).await {
        if let Ok(ch) = conn.create_channel().await {
            let _ = ch
                .queue_delete(results_queue.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = conn.close(200, "".into()).await;
    }
    drop(wa);
    drop(wb);
    drop(ds);
    cleanup(env).await;
    drop(cluster);
    times.push(("whole test".into(), t0.elapsed()));
    println!("---- measured times ----");
    for (what, d) in &times {
        println!("{what}: {}", secs(*d));
    }
}

/// How long the paused node stays stopped: long past the workers' heartbeat, and below Erlang's
/// default `net_ticktime` (60 s), so the other nodes never declare it down.
const PAUSE: Duration = Duration::from_secs(25);
/// The paused-node test's AMQP heartbeat and connection timeout: a silent link is declared dead
/// after two beats, and a node that accepts and never answers costs one timeout.
const PAUSE_HEARTBEAT_SECS: &str = "3";
const PAUSE_CONNECT_TIMEOUT_MS: u64 = 2000;

/// A partitioned node, not a dead one: the node worker B consumes through (a follower of the
/// intents queue: its leader, the agent's results queue and worker A stay on node 0) is
/// SIGSTOPped mid-feed, its
/// sockets open and silent, for 25 s. Worker B notices within two heartbeats and consumes
/// through the node left; consumption by both workers of intents sent after the pause resumes
/// within 15 s. (A worker that declared its topology again on that reconnect waited on the
/// broker's metadata store, which waits for the paused node until Erlang declares it down,
/// `net_ticktime`: about a minute.) Once the node goes on, every intent of the test keeps the
/// invariants of the node-loss test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_rides_out_a_paused_node_within_two_heartbeats() {
    let (cluster, mut env) = tokio::join!(
        RabbitCluster::start(RabbitClusterOptions::default()),
        Env::new()
    );
    env.amqp_url = cluster.amqp_url(0);
    let urls: Vec<String> = (0..NODES)
        .map(|i| {
            format!(
                "{}?connection_timeout={PAUSE_CONNECT_TIMEOUT_MS}",
                cluster.amqp_url(i)
            )
        })
        .collect();
    let ds = Downstream::start(&env).await;
    let tools = roomy_tools(&env, ds.port);
    let intents_queue = env.topology.intents_queue.clone();
    let results_queue = format!("{}.agent", env.topology.results_exchange);
    declare_results_queue(
        &urls[0],
        &env.topology.results_exchange,
        &results_queue,
        &[TENANT],
    )
    .await;
    let got: Log<Received> = Arc::default();
    let stop_reader = Arc::new(AtomicBool::new(false));
    let reader = spawn_collector(
        urls.clone(),
        results_queue.clone(),
        got.clone(),
        stop_reader.clone(),
    );
    let opts = |list: &[String]| {
        worker_opts(&tools, &list.join(",")).env("WORKER_AMQP_HEARTBEAT_SECS", PAUSE_HEARTBEAT_SECS)
    };
    // Worker A, on node 0 only, declares the intents queue: node 0 leads both queues, and no
    // queue the test uses has its leader on the node that is paused (a quorum queue whose
    // leader is paused waits for the broker's own failure detection, which this test is not
    // about).
    let wa = Worker::start(&env, "wa", &opts(&urls[..1])).await;
    let (_, a_consumer) = e2e::wait_for("worker A ready", T, || async {
        let (status, c, _, _) = readyz(&wa).await;
        (status == 200).then_some(((), c))
    })
    .await;
    let leader = cluster.leader_of(&intents_queue).await;
    assert_eq!(
        (
            node_index(&cluster, a_consumer.as_deref().unwrap_or("")),
            leader
        ),
        (Some(0), 0),
        "worker A declared the queue through node 0, so node 0 leads it"
    );
    let followers: Vec<String> = (0..NODES)
        .filter(|&i| i != leader)
        .map(|i| urls[i].clone())
        .collect();
    let wb = Worker::start(&env, "wb", &opts(&followers)).await;
    let (_, b_consumer) = e2e::wait_for("worker B ready", T, || async {
        let (status, c, _, _) = readyz(&wb).await;
        (status == 200).then_some(((), c))
    })
    .await;
    let victim = node_index(&cluster, b_consumer.as_deref().unwrap_or(""))
        .expect("worker B names a cluster node");
    let workers = [&wa, &wb];
    let sent: Log<Sent> = Arc::default();
    let stop_feed = Arc::new(AtomicBool::new(false));
    let feed = spawn_feed(
        "paused",
        Sender::new(&urls, &env.topology.intents_exchange, leader),
        sent.clone(),
        stop_feed.clone(),
    );
    let warm = Instant::now();
    consumption_resumed(&env, &workers, warm, &sent, &got).await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    let on = links_on(&cluster, &workers, victim).await;
    println!("pausing node {victim} (a follower; node {leader} leads); worker links on it: {on:?}");
    let paused_at = Instant::now();
    cluster.pause(victim);
    let resumed = tokio::time::timeout(
        PAUSE,
        consumption_resumed(&env, &workers, paused_at, &sent, &got),
    )
    .await;
    println!("paused node: consumption per worker after the pause: {resumed:?}");
    tokio::time::sleep_until((paused_at + PAUSE).into()).await;
    cluster.resume(victim);
    println!("node {victim} goes on after {}", secs(paused_at.elapsed()));
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop_feed.store(true, Ordering::SeqCst);
    let feed_sender = feed.await.expect("the feed task");
    let sent_now = sent.lock().unwrap().clone();
    println!(
        "feed: {} intents sent, {} attempts failed and were sent again",
        sent_now.len(),
        feed_sender.errors.len()
    );
    let sends: BTreeMap<String, u32> = sent_now
        .iter()
        .map(|s| (s.id.clone(), s.attempts))
        .collect();
    let ids: Vec<String> = sent_now.iter().map(|s| s.id.clone()).collect();
    println!(
        "at the end: {}",
        check_invariants(&env, &ids, &sends, &got).await
    );
    let per_worker = resumed.unwrap_or_else(|_| {
        panic!("both workers were not consuming again within {PAUSE:?} of the pause")
    });
    let both = per_worker.values().max().copied().unwrap_or_default();
    assert!(
        both < RESUME_LIMIT,
        "consumption resumed in both workers only after {per_worker:?}"
    );
    stop_reader.store(true, Ordering::SeqCst);
    let _ = reader.await;
    drop(wa);
    drop(wb);
    drop(ds);
    cleanup(env).await;
    drop(cluster);
}
