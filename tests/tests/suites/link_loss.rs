//! Losing a link: the broker connection and the consumer's ack rule, proven
//! with real worker processes whose broker or ledger link runs through a [`FaultProxy`].
//! Counts come from the downstream's tables and the ledger, never from logs.

use std::time::Duration;

use e2e::{
    cleanup, host_port, intent, publish_as, rabbitmqctl, via, wait_for, Agent, BrokerUser,
    Downstream, Env, FaultProxy, Worker, WorkerOptions,
};
use lapin::types::AMQPValue;
use serde_json::json;

const T: Duration = Duration::from_secs(60);

/// The test broker's host:port, from its URL.
fn broker_addr(env: &Env) -> String {
    host_port(&env.amqp_url)
}

fn header(m: &lapin::message::BasicGetMessage, key: &str) -> Option<String> {
    match m.properties.headers().as_ref()?.inner().get(key)? {
        AMQPValue::LongString(s) => Some(s.to_string()),
        other => Some(format!("{other:?}")),
    }
}

/// Waits until every key has reached `succeeded` in the ledger; on timeout, names the others.
async fn all_succeed(env: &Env, tenant: &str, ids: &[String], timeout: Duration) {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let mut others = Vec::new();
        for id in ids {
            let state = env.state(tenant, id).await;
            if state != "succeeded" {
                others.push(format!("{id}={state:?}"));
            }
        }
        if others.is_empty() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not succeeded after {timeout:?}: {others:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn one_mutation_each(env: &Env, tenant: &str, ids: &[String]) {
    for id in ids {
        let key = format!("{tenant}:{id}");
        assert_eq!(env.mutations(&key).await, 1, "{key}: one mutation");
        assert!(
            env.outbox_statuses(tenant, id)
                .await
                .contains(&"succeeded".to_string()),
            "{key}: a succeeded result was recorded"
        );
    }
}

const TOOLS: [&str; 3] = ["refund", "ticket", "deploy"];

/// The standard tools with an 8 s timeout and worker options with a 20 s lease: on a slow,
/// shared machine a request must not time out or outlive its lease (a `none` tool's dispatch
/// would end `held`), which is not what these tests are about.
fn roomy_tools(env: &Env, port: u16) -> std::path::PathBuf {
    env.standard_tools_timed(port, 8000, "")
}

fn base_opts(tools: std::path::PathBuf) -> WorkerOptions {
    let mut opts = WorkerOptions::new(tools);
    opts.lease_secs = 20;
    opts
}

/// In tenant-proof mode a second broker user publishes a malformed intent in a batch of good
/// ones. A dead-letter copy that kept `user_id = alice` would be refused by RabbitMQ on the
/// worker's `guest` connection, which would close it: the worker must stay up.
#[tokio::test]
async fn malformed_intent_from_a_second_broker_user_is_dead_lettered_not_fatal() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let alice = BrokerUser::create("alice");
    let tools = roomy_tools(&env, ds.port);
    let mut text = std::fs::read_to_string(&tools).unwrap();
    text.push_str(&format!(
        "\n[auth]\nmode = \"user_id\"\nusers = {{ \"{}\" = [\"tenant-a\"] }}\n",
        alice.name
    ));
    std::fs::write(&tools, text).unwrap();
    let opts = base_opts(tools);
    // The batch is queued before the worker starts, so the bad intent sits among good ones.
    let _agent = Agent::new_after(&env, &["tenant-a"], &opts).await;
    let good: Vec<String> = (0..10).map(|i| format!("good-{i}")).collect();
    let mut bodies: Vec<Vec<u8>> = good
        .iter()
        .enumerate()
        .map(|(i, id)| {
            serde_json::to_vec(&intent("tenant-a", id, TOOLS[i % 3], json!({"n": i}))).unwrap()
        })
        .collect();
    let bad = br#"{"tenant":"tenant-a","action_id":"bad-5","tool":"refund","arguments":5}"#;
    bodies.insert(5, bad.to_vec());
    let bodies: Vec<&[u8]> = bodies.iter().map(Vec::as_slice).collect();
    publish_as(
        &env,
        &alice.url(&env),
        Some(&alice.name),
        "tenant-a",
        &bodies,
    )
    .await;

    let mut w = Worker::start(&env, "w", &opts).await;
    all_succeed(&env, "tenant-a", &good, T).await;
    one_mutation_each(&env, "tenant-a", &good).await;
    assert!(
        w.is_running(),
        "one malformed message must not stop the worker"
    );

    let agent = Agent::new(&env, &[]).await;
    let mut dead = Vec::new();
    let deadline = tokio::time::Instant::now() + T;
    while dead.is_empty() && tokio::time::Instant::now() < deadline {
        dead.extend(agent.drain_dead_letters(&env).await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    dead.extend(agent.drain_dead_letters(&env).await);
    assert_eq!(dead.len(), 1, "exactly the bad intent is dead-lettered");
    let d = &dead[0];
    assert_eq!(d.data, bad.to_vec(), "the body is kept as published");
    assert_eq!(
        header(d, "x-intent-worker-reason").as_deref(),
        Some("invalid_message")
    );
    assert!(header(d, "x-intent-worker-detail").is_some());
    assert_eq!(
        header(d, "x-intent-worker-user-id").as_deref(),
        Some(alice.name.as_str()),
        "the original user_id is kept in a header"
    );
    assert!(
        d.properties.user_id().is_none(),
        "the copy carries no user_id"
    );

    // Still consuming: a later intent from alice succeeds.
    let later = vec!["later-1".to_string()];
    let body = serde_json::to_vec(&intent("tenant-a", "later-1", "refund", json!({}))).unwrap();
    publish_as(
        &env,
        &alice.url(&env),
        Some(&alice.name),
        "tenant-a",
        &[&body],
    )
    .await;
    all_succeed(&env, "tenant-a", &later, T).await;
    assert!(w.is_running());
    drop(w);
    drop(alice);
    cleanup(env).await;
}

/// A dead-letter copy the broker keeps refusing: the worker's own broker user may not write to the
/// dead-letter exchange. The delivery is rejected without requeue after a few attempts, so the
/// queue's own dead-letter exchange takes it (the broker needs no permission for that); the
/// worker stays up and the good intents of the batch succeed.
#[tokio::test]
async fn refused_dead_letter_copy_falls_back_to_the_queues_own_dead_lettering() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let bob = BrokerUser::create("bob");
    let dlx = env.topology.dead_letter_exchange.replace('.', "\\.");
    rabbitmqctl(&[
        "set_permissions",
        "-p",
        "/",
        &bob.name,
        ".*",
        &format!("^(?!{dlx}$).*"),
        ".*",
    ]);
    let opts = base_opts(roomy_tools(&env, ds.port))
        .amqp_url(&bob.url(&env))
        .with_metrics();
    let _agent = Agent::new_after(&env, &["north-shop"], &opts).await;
    let agent = Agent::new(&env, &["north-shop"]).await;
    let good = ids("ok", 6);
    publish(&agent, "north-shop", &good[..3]).await;
    let bad = br#"{"tenant":"north-shop","action_id":"bad-5","tool":"refund","arguments":5}"#;
    agent.send_raw("north-shop", bad).await;
    publish(&agent, "north-shop", &good[3..]).await;
    let mut w = Worker::start(&env, "w", &opts).await;
    all_succeed(&env, "north-shop", &good, T).await;
    one_mutation_each(&env, "north-shop", &good).await;
    let mut dead = Vec::new();
    let deadline = tokio::time::Instant::now() + T;
    while dead.is_empty() && tokio::time::Instant::now() < deadline {
        dead.extend(agent.drain_dead_letters(&env).await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        dead.len(),
        1,
        "the bad intent reached the dead-letter queue"
    );
    assert_eq!(dead[0].data, bad.to_vec());
    assert!(
        header(&dead[0], "x-death").is_some(),
        "dead-lettered by the broker itself"
    );
    let metrics = w.metrics().await;
    assert_eq!(
        e2e::metric_value(
            &metrics,
            "intent_worker_dead_letter_refused_total",
            &[("reason", "invalid_message")]
        ),
        1.0
    );
    assert!(w.is_running(), "a refused copy is never fatal");
    drop(w);
    drop(bob);
    cleanup(env).await;
}

/// Publishes intents for `ids` (tools round-robin) as the test's agent.
async fn publish(agent: &Agent, tenant: &str, ids: &[String]) {
    publish_with(agent, tenant, ids, &TOOLS).await;
}

async fn publish_with(agent: &Agent, tenant: &str, ids: &[String], tools: &[&str]) {
    for (i, id) in ids.iter().enumerate() {
        agent
            .request(tenant, id, tools[i % tools.len()], json!({"order": id}))
            .await;
    }
}

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// The worker's broker link is cut for ~12 s with 60 intents in flight or queued: the worker
/// reconnects by itself, and no intent waits for a restart.
#[tokio::test]
async fn broker_link_cut_for_twelve_seconds_is_survived() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let proxy = FaultProxy::start(&broker_addr(&env)).await;
    let opts = base_opts(roomy_tools(&env, ds.port))
        .amqp_url(&via(&env.amqp_url, proxy.addr()))
        .with_metrics();
    let mut w = Worker::start(&env, "w", &opts).await;
    let agent = Agent::new(&env, &["north-shop"]).await;
    let all = ids("cut", 60);
    // Some dispatches are still in flight (HTTP) when the link goes.
    for id in &all[..5] {
        ds.fault(json!({"kind": "slow", "delay_ms": 1200, "key": format!("north-shop:{id}")}))
            .await;
    }
    publish(&agent, "north-shop", &all[..20]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.cut();
    publish(&agent, "north-shop", &all[20..]).await;
    for _ in 0..24 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            w.is_running(),
            "the worker must not exit when the broker link is lost"
        );
    }
    proxy.restore();
    all_succeed(&env, "north-shop", &all, T).await;
    one_mutation_each(&env, "north-shop", &all).await;
    assert!(w.is_running());
    assert!(
        proxy.connections() >= 3,
        "the worker reconnected (connections: {})",
        proxy.connections()
    );
    let metrics = w.metrics().await;
    assert!(
        e2e::metric_value(&metrics, "intent_worker_broker_reconnects_total", &[]) >= 1.0,
        "reconnects are counted"
    );
    drop(w);
    cleanup(env).await;
}

/// A silent black hole (no reset, no FIN) is noticed through the AMQP heartbeat and the worker
/// reconnects once the path is back, instead of waiting for the stalled connection to be reset.
#[tokio::test]
async fn broker_black_hole_is_detected_by_heartbeat_and_survived() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let proxy = FaultProxy::start(&broker_addr(&env)).await;
    let opts = base_opts(roomy_tools(&env, ds.port))
        .amqp_url(&via(&env.amqp_url, proxy.addr()))
        .env("WORKER_AMQP_HEARTBEAT_SECS", "2")
        .with_metrics();
    let mut w = Worker::start(&env, "w", &opts).await;
    let agent = Agent::new(&env, &["north-shop"]).await;
    let first = ids("hole-a", 10);
    publish(&agent, "north-shop", &first).await;
    all_succeed(&env, "north-shop", &first, T).await;

    proxy.blackhole();
    let later = ids("hole-b", 10);
    publish(&agent, "north-shop", &later).await;
    // Two missed heartbeats (~4 s) declare the link dead while the path is still silent.
    wait_for(
        "readyz to report the lost broker link",
        Duration::from_secs(15),
        || async {
            let (status, body) = w.get("/readyz").await;
            (status == 503 && body.contains("broker")).then_some(())
        },
    )
    .await;
    assert!(w.is_running());
    proxy.restore();
    all_succeed(&env, "north-shop", &later, T).await;
    one_mutation_each(&env, "north-shop", &later).await;
    assert!(w.is_running(), "the worker never exits for a lost link");
    drop(w);
    cleanup(env).await;
}

/// The ledger link cut and restored while intents flow: every replay and lookup intent
/// succeeds with one mutation.
/// A `none` tool whose outcome could not be recorded during the cut cannot be verified after
/// its lease: it may end `held`, never with a second mutation.
#[tokio::test]
async fn postgres_link_cut_and_restored_all_succeed() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let pg = FaultProxy::start(&host_port(&env.db_url)).await;
    let opts = base_opts(roomy_tools(&env, ds.port)).database_url(&via(&env.db_url, pg.addr()));
    let mut w = Worker::start(&env, "w", &opts).await;
    let agent = Agent::new(&env, &["north-shop"]).await;
    let all = ids("pg", 42);
    publish(&agent, "north-shop", &all[..21]).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    pg.cut();
    publish(&agent, "north-shop", &all[21..]).await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(w.is_running());
    pg.restore();
    // TOOLS round-robin: every third intent is the `none` tool.
    let (verifiable, none): (Vec<_>, Vec<_>) = all
        .iter()
        .cloned()
        .enumerate()
        .partition(|(i, _)| TOOLS[i % 3] != "deploy");
    let verifiable: Vec<String> = verifiable.into_iter().map(|(_, id)| id).collect();
    all_succeed(&env, "north-shop", &verifiable, T).await;
    one_mutation_each(&env, "north-shop", &verifiable).await;
    for (_, id) in none {
        let key = format!("north-shop:{id}");
        wait_for("the none tool's intent to be final or held", T, || async {
            let state = env.state("north-shop", &id).await;
            matches!(state.as_str(), "succeeded" | "held").then_some(())
        })
        .await;
        assert_eq!(env.mutations(&key).await, 1, "{key}: exactly one mutation");
    }
    assert!(w.is_running());
    drop(w);
    cleanup(env).await;
}

/// The ledger link is lost just after the worker's first connection to Postgres, while it
/// still checks for a pooler and applies its migrations (a database restarting, a flapping
/// network): start-up waits for the link as it waits for a Postgres that is not up yet, and
/// the worker then runs; it does not exit for a supervisor to restart.
#[tokio::test]
async fn a_ledger_link_lost_during_start_up_is_waited_for() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let pg = FaultProxy::start(&host_port(&env.db_url)).await;
    let opts = base_opts(roomy_tools(&env, ds.port))
        .database_url(&via(&env.db_url, pg.addr()))
        .fault("after_ledger_connected", None);
    let mut w = Worker::spawn(&env, "w", &opts);
    w.wait_output("fault point reached: after_ledger_connected", T)
        .await;
    pg.cut();
    w.resume();
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            w.is_running(),
            "the worker exited while its ledger link was down at start-up:\n{}",
            w.output.text()
        );
    }
    assert!(
        w.output.contains("Postgres not reachable yet; retrying"),
        "the wait is logged:\n{}",
        w.output.text()
    );
    pg.restore();
    w.wait_ready().await;
    let agent = Agent::new(&env, &["north-shop"]).await;
    let all = ids("start", 3);
    publish_with(&agent, "north-shop", &all, &["refund"]).await;
    all_succeed(&env, "north-shop", &all, T).await;
    one_mutation_each(&env, "north-shop", &all).await;
    drop(w);
    cleanup(env).await;
}

/// SIGTERM while the broker is unreachable exits cleanly (code 0) and in time; losing the link
/// is not itself a failure exit.
#[tokio::test]
async fn sigterm_during_broker_outage_exits_cleanly() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let proxy = FaultProxy::start(&broker_addr(&env)).await;
    let opts = base_opts(roomy_tools(&env, ds.port)).amqp_url(&via(&env.amqp_url, proxy.addr()));
    let mut w = Worker::start(&env, "w", &opts).await;
    let agent = Agent::new(&env, &["north-shop"]).await;
    let all = ids("term", 5);
    publish(&agent, "north-shop", &all).await;
    all_succeed(&env, "north-shop", &all, T).await;
    proxy.cut();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(w.is_running(), "still running during the outage");
    let started = std::time::Instant::now();
    let code = w.terminate_async(Duration::from_secs(20)).await;
    assert_eq!(code, Some(0), "a clean exit during the outage");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "shutdown took {:?}",
        started.elapsed()
    );
    cleanup(env).await;
}

/// A worker with its metrics listener that reaches the broker and the ledger through a proxy
/// each: (broker proxy, ledger proxy, worker).
async fn behind_both_proxies(env: &Env, ds: &Downstream) -> (FaultProxy, FaultProxy, Worker) {
    let proxy = FaultProxy::start(&broker_addr(env)).await;
    let pg = FaultProxy::start(&host_port(&env.db_url)).await;
    let opts = base_opts(roomy_tools(env, ds.port))
        .amqp_url(&via(&env.amqp_url, proxy.addr()))
        .database_url(&via(&env.db_url, pg.addr()))
        .with_metrics();
    let w = Worker::start(env, "w", &opts).await;
    (proxy, pg, w)
}

/// `/livez` and `/readyz` on the metrics listener; readyz says why it is not ready.
#[tokio::test]
async fn readyz_reports_broker_and_ledger_loss() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let (proxy, pg, w) = behind_both_proxies(&env, &ds).await;
    let ready = || async {
        let (status, _) = w.get("/readyz").await;
        (status == 200).then_some(())
    };
    wait_for("ready", T, ready).await;
    assert_eq!(w.get("/livez").await.0, 200);

    proxy.cut();
    let body = wait_for("readyz 503 for the broker", T, || async {
        let (status, body) = w.get("/readyz").await;
        (status == 503).then_some(body)
    })
    .await;
    let v: serde_json::Value = serde_json::from_str(&body).expect("a JSON reason");
    assert_eq!(v["status"], "not_ready");
    assert!(
        v["reasons"].to_string().contains("broker"),
        "names the broker: {body}"
    );
    assert_eq!(w.get("/livez").await.0, 200, "still live");
    proxy.restore();
    wait_for("ready again after the broker returns", T, ready).await;

    pg.cut();
    let body = wait_for("readyz 503 for the ledger", T, || async {
        let (status, body) = w.get("/readyz").await;
        (status == 503).then_some(body)
    })
    .await;
    assert!(body.contains("ledger"), "names the ledger: {body}");
    pg.restore();
    wait_for("ready again after the ledger returns", T, ready).await;

    // The container probe: exit 0 when ready, 1 when not.
    let port = w.metrics_port.unwrap();
    // Async: the proxies run on this test's runtime and must keep forwarding meanwhile.
    let probe = |path: &str| {
        let url = format!("http://127.0.0.1:{port}{path}");
        async move {
            let out = tokio::process::Command::new(e2e::procs::bin_dir().join("worker"))
                .env_clear()
                .args(["probe", &url])
                .output()
                .await
                .unwrap();
            eprintln!("probe {url}: {}", String::from_utf8_lossy(&out.stderr));
            out.status.code()
        }
    };
    assert_eq!(probe("/readyz").await, Some(0));
    proxy.cut();
    wait_for("readyz 503 again", T, || async {
        (w.get("/readyz").await.0 == 503).then_some(())
    })
    .await;
    assert_eq!(
        probe("/readyz").await,
        Some(1),
        "the probe fails while not ready"
    );
    assert_eq!(probe("/livez").await, Some(0));
    proxy.restore();
    drop(w);
    cleanup(env).await;
}

/// `/readyz` names a relay link the broker dropped even while the relay is stuck in a ledger
/// call (the ledger link a black hole): readiness follows the connection, not the relay's next
/// look at it. Otherwise a worker whose relay connection is gone reads ready once the consumer
/// is back, and turns unready later.
#[tokio::test]
async fn readyz_names_a_lost_relay_link_while_the_relay_waits_on_the_ledger() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let (proxy, pg, w) = behind_both_proxies(&env, &ds).await;
    wait_for("ready", T, || async {
        (w.get("/readyz").await.0 == 200).then_some(())
    })
    .await;

    pg.blackhole();
    wait_for("readyz 503 for the ledger", T, || async {
        let (status, body) = w.get("/readyz").await;
        (status == 503 && body.contains("ledger")).then_some(())
    })
    .await;
    // The idle relay looks in the outbox every half second: by now it waits on the ledger.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    proxy.cut();
    // The relay's statement waits on a link that moves no bytes: it does not look at its
    // broker link until the ledger answers.
    let body = wait_for(
        "readyz names the relay link",
        Duration::from_secs(4),
        || async {
            let (status, body) = w.get("/readyz").await;
            (status == 503 && body.contains("relay link")).then_some(body)
        },
    )
    .await;
    let v: serde_json::Value = serde_json::from_str(&body).expect("a JSON reason");
    assert!(
        v["broker_nodes"]["relay"].is_null(),
        "a lost link has no node: {body}"
    );
    proxy.restore();
    pg.restore();
    wait_for("ready again once both return", T, || async {
        (w.get("/readyz").await.0 == 200).then_some(())
    })
    .await;
    drop(w);
    cleanup(env).await;
}

/// Replay and lookup tools only: a later round cuts the ledger while an earlier round's
/// redelivered intents may be in flight, and only these capabilities recover an outcome that
/// could not be recorded (a `none` tool's would rightly end `held`).
const VERIFIABLE: [&str; 2] = ["refund", "ticket"];

/// SIGTERM while a batch cannot be recorded (ledger link cut) with more deliveries buffered
/// behind it, the ledger coming back at that moment. The consumer must not take the buffered
/// batch, record it and ack it with `multiple`, covering the unrecorded one (acked but never
/// recorded). Six rounds, as that race is a coin flip per round.
#[tokio::test]
async fn sigterm_with_ledger_down_never_acks_an_unrecorded_delivery() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let pg = FaultProxy::start(&host_port(&env.db_url)).await;
    let tools = roomy_tools(&env, ds.port);
    let mut opts = base_opts(tools.clone())
        .database_url(&via(&env.db_url, pg.addr()))
        .env("WORKER_SHUTDOWN_GRACE_SECS", "2");
    // A batch given up at SIGTERM comes back redelivered in the next round, and the poison
    // guard counts each such delivery: when the cut wins the race in every round (a loaded
    // machine), a round-0 intent reaches six deliveries and is rightly dead-lettered as poison
    // under the default limit of 5. That is not what this test is about.
    opts.delivery_limit = 50;
    let agent = Agent::new_after(&env, &["north-shop"], &opts).await;
    let mut published = Vec::new();
    for round in 0..6 {
        let mut w = Worker::start(&env, &format!("w{round}"), &opts).await;
        pg.cut();
        let first = vec![format!("r{round}-first")];
        publish_with(&agent, "north-shop", &first, &VERIFIABLE).await;
        // The first batch fails to record six times (its back-off grows to 3.2 s).
        wait_for("the first batch to fail three times", T, || async {
            (w.output.text().matches("cannot record intents").count() >= 6).then_some(())
        })
        .await;
        let buffered = ids(&format!("r{round}-buffered"), 8);
        publish_with(&agent, "north-shop", &buffered, &VERIFIABLE).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        // The ledger is back (and its pool healed) while the first batch still sleeps in its
        // 3.2 s back-off; SIGTERM then finds it unrecorded with a recordable batch buffered.
        pg.restore();
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let code = w.terminate_async(Duration::from_secs(30)).await;
        assert!(code.is_some(), "round {round}: the worker exits on SIGTERM");
        published.extend(first);
        published.extend(buffered);
    }
    // A worker with a healthy ledger link takes whatever was left unacked, under the same
    // poison limit (a round-0 intent given up in all six rounds was delivered six times).
    let mut last = base_opts(tools);
    last.delivery_limit = opts.delivery_limit;
    let _w = Worker::start(&env, "final", &last).await;
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let mut missing = Vec::new();
        for id in &published {
            if env.state("north-shop", id).await.is_empty()
                || env.outbox_statuses("north-shop", id).await.is_empty()
            {
                missing.push(id.clone());
            }
        }
        if missing.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "acked but never recorded (no row or no result): {missing:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Whatever the cuts did to outcomes (a claim whose commit the worker never heard of ends
    // `held` by design), no action was performed twice.
    for id in &published {
        let key = format!("north-shop:{id}");
        assert!(
            env.mutations(&key).await <= 1,
            "{key}: at most one mutation"
        );
    }
    cleanup(env).await;
}

/// A write whose answer arrives while the ledger link is down is recorded once the link is
/// back (within its lease) instead of being dropped: a `none` tool's write ends `succeeded`
/// with its receipt, not dropped ("cannot record outcome") until the lease runs out and the row
/// ends `held` although the downstream answered with a receipt.
#[tokio::test]
async fn an_answer_that_arrives_during_a_ledger_outage_is_recorded_after_it() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let pg = FaultProxy::start(&host_port(&env.db_url)).await;
    let opts = base_opts(roomy_tools(&env, ds.port)).database_url(&via(&env.db_url, pg.addr()));
    let w = Worker::start(&env, "w", &opts).await;
    let agent = Agent::new(&env, &["north-shop"]).await;
    let id = "late-record-1";
    let key = format!("north-shop:{id}");
    ds.fault(json!({"kind": "slow_after_commit", "delay_ms": 2500, "key": key}))
        .await;
    agent
        .request("north-shop", id, "deploy", json!({"order": id}))
        .await;
    wait_for("the write to reach the downstream", T, || async {
        (env.writes(&key).await == 1).then_some(())
    })
    .await;
    // The downstream has committed and answers in ~2.5 s: the answer lands in the outage.
    pg.cut();
    tokio::time::sleep(Duration::from_secs(5)).await;
    pg.restore();
    let state = wait_for("the operation to be final or held", T, || async {
        let state = env.state("north-shop", id).await;
        matches!(state.as_str(), "succeeded" | "held" | "failed").then_some(state)
    })
    .await;
    assert_eq!(
        state, "succeeded",
        "the receipt that arrived in the outage was recorded"
    );
    assert_eq!(env.mutations(&key).await, 1);
    assert_eq!(env.writes(&key).await, 1, "never sent twice");
    drop(w);
    cleanup(env).await;
}

/// A receipt in hand is never dropped: a `none` tool's answer arrives, then the ledger link is
/// down for more than twice the lease. The worker keeps the receipt past its lease and records
/// it through the receipt path once the ledger is back, whoever has moved the row meanwhile.
/// Before receipts were kept, recording gave up after one lease ("cannot record outcome") and
/// the action ended `held` although the downstream had answered.
#[tokio::test]
async fn a_receipt_in_hand_outlives_a_ledger_outage_of_twice_the_lease() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let pg = FaultProxy::start(&host_port(&env.db_url)).await;
    let mut opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .database_url(&via(&env.db_url, pg.addr()));
    opts.lease_secs = 5;
    opts.recovery_interval_ms = 200;
    let w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    let id = "kept-receipt-{1}";
    let key = format!("north-shop:{id}");
    ds.fault(json!({"kind": "slow_after_commit", "delay_ms": 1500, "key": key}))
        .await;
    agent
        .request("north-shop", id, "deploy", json!({"order": id}))
        .await;
    wait_for("the write to reach the downstream", T, || async {
        (env.writes(&key).await == 1).then_some(())
    })
    .await;
    // The downstream has committed and answers in ~1.5 s: the answer lands in the outage,
    // which lasts 12 s against a 5 s lease.
    pg.cut();
    tokio::time::sleep(Duration::from_secs(12)).await;
    pg.restore();
    let events = agent
        .until("north-shop", id, protocol::Status::Succeeded, T)
        .await;
    let (last, before) = events.split_last().expect("one event at least");
    assert!(
        before.iter().all(|e| e.status == protocol::Status::Pending),
        "only pending may come before the answer: {events:?}"
    );
    let receipt = env
        .downstream_receipt(&key)
        .await
        .expect("the downstream stored its receipt");
    assert_eq!(
        last.receipt.as_ref(),
        Some(&receipt),
        "the downstream's own receipt"
    );
    assert_eq!(env.state("north-shop", id).await, "succeeded");
    assert_eq!(env.mutations(&key).await, 1);
    assert_eq!(env.writes(&key).await, 1, "never sent twice");
    assert!(
        w.output.contains("keeping it and trying on"),
        "the worker said it kept the receipt past the lease"
    );
    drop(w);
    cleanup(env).await;
}

/// `AMQP_URL` with one URL per node: a worker started with a list whose first node is dead
/// connects to another, `/readyz` names the node each link uses, and when that node goes away
/// both links move to one that is left, and intents keep being answered. Two proxies in front
/// of the test broker stand for two nodes. Before node lists, the worker took the whole value as
/// one URL and never became ready.
#[tokio::test]
async fn a_node_list_survives_the_loss_of_the_node_in_use() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let a = FaultProxy::start(&broker_addr(&env)).await;
    let b = FaultProxy::start(&broker_addr(&env)).await;
    let dead = format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f",
        e2e::procs::free_port()
    );
    let list = format!(
        "{dead},{},{}",
        via(&env.amqp_url, a.addr()),
        via(&env.amqp_url, b.addr())
    );
    let opts = base_opts(roomy_tools(&env, ds.port))
        .amqp_url(&list)
        .with_metrics();
    let w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    let nodes = || async {
        let (status, body) = w.get("/readyz").await;
        let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        let node = |link: &str| v["broker_nodes"][link].as_str().map(str::to_owned);
        (status == 200).then(|| (node("consumer"), node("relay")))
    };
    let (consumer, relay) = wait_for("ready on a live node", T, nodes).await;
    let live = [a.addr().to_string(), b.addr().to_string()];
    for node in [&consumer, &relay] {
        assert!(
            node.as_ref().is_some_and(|n| live.contains(n)),
            "a live node is named: {node:?} of {live:?}"
        );
    }
    assert!(!body_has_password(&w).await, "credentials redacted");
    agent
        .request("north-shop", "node-1", "ticket", json!({"n": 1}))
        .await;
    agent.succeeded("north-shop", "node-1").await;

    // The node the consumer uses goes away: the consumer moves to the live node that is left.
    let (gone, left) = if consumer.as_deref() == Some(&live[0]) {
        (&a, &live[1])
    } else {
        (&b, &live[0])
    };
    gone.cut();
    wait_for("the consumer on the node that is left", T, || async {
        let (c, _) = nodes().await?;
        (c.as_deref() == Some(left.as_str())).then_some(())
    })
    .await;
    agent
        .request("north-shop", "node-2", "ticket", json!({"n": 2}))
        .await;
    agent.succeeded("north-shop", "node-2").await;
    assert_eq!(env.mutations("north-shop:node-2").await, 1);
    gone.restore();
    drop(w);
    cleanup(env).await;
}

/// Whether `/readyz` shows a password (the test URLs use guest:guest).
async fn body_has_password(w: &Worker) -> bool {
    w.get("/readyz").await.1.contains("guest:guest")
}

/// A worker and its downstream, an agent on a direct link, and a publisher whose link goes
/// through a proxy the test can silence or cut.
async fn publisher_behind_a_proxy(
    env: &Env,
) -> (Downstream, Worker, Agent, FaultProxy, publisher::Publisher) {
    let ds = Downstream::start(env).await;
    let w = Worker::start(env, "w", &base_opts(roomy_tools(env, ds.port))).await;
    let agent = Agent::new(env, &["north-shop"]).await;
    let proxy = FaultProxy::start(&broker_addr(env)).await;
    let publisher = publisher::Publisher::connect(
        &via(&env.amqp_url, proxy.addr()),
        &env.topology.intents_exchange,
    )
    .await
    .expect("connect through the proxy");
    (ds, w, agent, proxy, publisher)
}

/// The intent of a publish that ended in doubt, sent again under the same key: done once.
async fn sent_again_is_done_once(env: &Env, agent: &mut Agent, action: &str) {
    agent
        .request("north-shop", action, "ticket", json!({"n": 1}))
        .await;
    agent.succeeded("north-shop", action).await;
    assert_eq!(env.mutations(&format!("north-shop:{action}")).await, 1);
}

/// A publish whose confirm never arrives because the link died is reported as in doubt ("may
/// or may not be queued; sending it again under the same key is safe"), never as a plain
/// failure an agent might answer with a new key, and never as success. Sent again, it is done
/// once. Before, the library returned a generic AMQP error.
#[tokio::test]
async fn a_publish_cut_off_before_its_confirm_is_in_doubt_and_safe_to_send_again() {
    let env = Env::new().await;
    let (_ds, w, mut agent, proxy, publisher) = publisher_behind_a_proxy(&env).await;
    let sent = intent("north-shop", "doubt-1", "ticket", json!({"n": 1}));
    // The link goes silent, then dies, while the publish waits for its confirm.
    proxy.blackhole();
    let pending = tokio::spawn(async move { publisher.publish(&sent).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.cut();
    let result = tokio::time::timeout(T, pending)
        .await
        .expect("the publish ends")
        .unwrap();
    let err = result.expect_err("no confirm, no success");
    assert!(err.in_doubt(), "in doubt, not a plain failure: {err}");
    assert!(
        err.to_string().contains("safe"),
        "says that sending again is safe: {err}"
    );
    sent_again_is_done_once(&env, &mut agent, "doubt-1").await;
    drop(w);
    cleanup(env).await;
}

/// A publish whose link goes silent and stays silent (no reset: a partition, a dead NAT entry)
/// is reported in doubt once two heartbeats are missed, about 20 s with the publisher's own
/// heartbeat, not after two of the broker's default (two minutes). Sent again over a good
/// link, it is done once.
#[tokio::test]
async fn a_publish_over_a_link_that_went_silent_is_in_doubt_within_two_heartbeats() {
    let env = Env::new().await;
    let (_ds, w, mut agent, proxy, publisher) = publisher_behind_a_proxy(&env).await;
    let sent = intent("north-shop", "silent-1", "ticket", json!({"n": 1}));
    proxy.blackhole();
    let started = std::time::Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(150), publisher.publish(&sent))
        .await
        .expect("the publish ends within two of the broker's default heartbeats");
    let took = started.elapsed();
    let err = result.expect_err("no confirm, no success");
    assert!(err.in_doubt(), "in doubt, not a plain failure: {err}");
    assert!(
        took < Duration::from_secs(40),
        "in doubt only after {took:?}"
    );
    sent_again_is_done_once(&env, &mut agent, "silent-1").await;
    drop(w);
    cleanup(env).await;
}

/// `close` (of the `what`) returns within 10 s, saying plainly that the close was not answered
/// and the connection was dropped.
async fn closes_within_its_bound(
    what: &str,
    close: impl std::future::Future<Output = Result<(), publisher::PublishError>>,
) {
    let started = std::time::Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(30), close).await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "closing the {what} over a silent link took {took:?} ({closed:?})"
    );
    let err = closed
        .unwrap()
        .expect_err("a close nobody answered is not a clean close")
        .to_string();
    assert!(
        err.contains("did not answer the close") && err.contains("dropped"),
        "{what}: {err}"
    );
}

/// An agent's link that goes silent (no reset, no bytes) does not hold up the end of its
/// session: closing a publisher or a follower returns within the close bound, not after the
/// broker's heartbeat would have noticed (a minute with RabbitMQ's default) or never. Whatever
/// the close could not settle is the broker's once the socket is gone: unacked results go back
/// to a named queue, an exclusive one is deleted.
#[tokio::test]
async fn closing_an_agent_link_that_went_silent_returns_within_the_close_bound() {
    let env = Env::new().await;
    let proxy = FaultProxy::start(&broker_addr(&env)).await;
    let url = via(&env.amqp_url, proxy.addr());
    let publisher = publisher::Publisher::connect(&url, &env.topology.intents_exchange)
        .await
        .expect("connect through the proxy");
    let follower =
        publisher::Follower::follow(&url, &env.topology.results_exchange, "north-shop", None)
            .await
            .expect("follow through the proxy");
    proxy.blackhole();
    closes_within_its_bound("publisher", publisher.close()).await;
    closes_within_its_bound("follower", follower.close()).await;
    drop(proxy);
    cleanup(env).await;
}

/// Backends of the test's database asleep in `pg_sleep` (a commit held by the trigger below).
async fn sleeping_commits(env: &Env) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event = 'PgSleep'",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap()
}

/// A commit whose reply never arrives: Postgres committed, the worker cannot know. A deferred
/// constraint trigger holds the commit of one admission (a `replay` tool) and of one recorded
/// outcome (a `none` tool, which can never be sent again) for 3 s; the ledger link is cut while
/// it sleeps, so the commit lands and its reply is lost, then restored. The worker's retry of
/// the same conditional statements on a fresh connection must find its own work done: each
/// action is carried out once downstream and answered `succeeded`. What the worker did not see
/// commit waits for its lease (a 6 s one here) to run out: the admitted row for the recovery
/// scheduler; the result events held for the worker's own relay are released when its retry
/// finds the outcome already stored, instead of waiting out the relay hold.
#[tokio::test]
async fn a_commit_whose_reply_was_lost_is_retried_safely() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let pg = FaultProxy::start(&host_port(&env.db_url)).await;
    let mut opts = WorkerOptions::new(env.standard_tools_timed(ds.port, 3000, ""))
        .database_url(&via(&env.db_url, pg.addr()));
    opts.lease_secs = 6;
    let mut w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    for sql in [
        "CREATE FUNCTION e2e_slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_sleep(3); RETURN NULL; END $$",
        "CREATE CONSTRAINT TRIGGER e2e_slow_admission AFTER INSERT ON operations
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
         WHEN (NEW.action_id = 'lost-admission') EXECUTE FUNCTION e2e_slow_commit()",
        "CREATE CONSTRAINT TRIGGER e2e_slow_outcome AFTER UPDATE ON operations
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
         WHEN (NEW.action_id = 'lost-outcome' AND NEW.state = 'succeeded'
               AND OLD.state IS DISTINCT FROM 'succeeded')
         EXECUTE FUNCTION e2e_slow_commit()",
    ] {
        sqlx::query(sql).execute(&env.pool).await.expect(sql);
    }
    for (id, tool) in [("lost-admission", "refund"), ("lost-outcome", "deploy")] {
        agent
            .request("north-shop", id, tool, json!({"order": id}))
            .await;
        wait_for("the commit held by the trigger", T, || async {
            (sleeping_commits(&env).await > 0).then_some(())
        })
        .await;
        pg.cut();
        wait_for("the held commit to finish", T, || async {
            (sleeping_commits(&env).await == 0).then_some(())
        })
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        pg.restore();
        let restored = std::time::Instant::now();
        let ev = agent.succeeded("north-shop", id).await;
        let took = restored.elapsed();
        eprintln!("{id}: answered {took:?} after the link came back");
        // The lease is 6 s; a held result event would wait out the 30 s relay hold.
        assert!(
            took < Duration::from_secs(15),
            "{id}: answered after {took:?}"
        );
        assert_eq!(ev.status, protocol::Status::Succeeded, "{id}");
        assert_eq!(
            env.mutations(&format!("north-shop:{id}")).await,
            1,
            "{id}: one mutation"
        );
        assert_eq!(env.state("north-shop", id).await, "succeeded", "{id}");
    }
    // Nothing more arrives for either (a second dispatch would show as a second mutation).
    tokio::time::sleep(Duration::from_secs(2)).await;
    for id in ["lost-admission", "lost-outcome"] {
        assert_eq!(env.mutations(&format!("north-shop:{id}")).await, 1, "{id}");
    }
    assert!(w.is_running());
    drop(w);
    cleanup(env).await;
}

/// A listener that accepts TCP connections and never says a word, as a broker stuck booting or
/// a port forwarded to nothing does; counts the connections it was offered.
struct SilentNode {
    addr: std::net::SocketAddr,
    accepted: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl SilentNode {
    fn start() -> SilentNode {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().unwrap();
        let accepted = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let held = accepted.clone();
        std::thread::spawn(move || {
            for socket in listener.incoming().flatten() {
                held.lock().unwrap().push(socket);
            }
        });
        SilentNode { addr, accepted }
    }

    fn url(&self) -> String {
        format!(
            "amqp://guest:guest@{}/%2f?connection_timeout=1000",
            self.addr
        )
    }

    fn connections(&self) -> usize {
        self.accepted.lock().unwrap().len()
    }
}

/// A node that accepts and never answers the AMQP handshake costs each attempt the URL's
/// `connection_timeout`, not the link: alone in the list, both links keep trying it (each
/// attempt a new connection); listed before a live node, the worker is ready on the live one
/// and answers intents; the publisher gives up on it with an error instead of waiting. lapin's
/// own `connection_timeout` bounds only the TCP connect, which this node accepts at once.
#[tokio::test]
async fn a_node_that_never_answers_the_handshake_costs_a_timeout_not_the_link() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let silent = SilentNode::start();

    let alone = base_opts(roomy_tools(&env, ds.port)).amqp_url(&silent.url());
    let w = Worker::spawn(&env, "alone", &alone);
    wait_for(
        "both links to try the silent node again and again",
        T,
        || async { (silent.connections() >= 6).then_some(()) },
    )
    .await;
    drop(w);

    let list = format!("{},{}", silent.url(), env.amqp_url);
    let opts = base_opts(roomy_tools(&env, ds.port)).amqp_url(&list);
    let w = Worker::start(&env, "listed", &opts).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    agent
        .request("north-shop", "silent-1", "ticket", json!({"n": 1}))
        .await;
    agent.succeeded("north-shop", "silent-1").await;
    assert_eq!(env.mutations("north-shop:silent-1").await, 1);
    drop(w);

    let offered = silent.connections();
    let started = std::time::Instant::now();
    let out = tokio::process::Command::new(e2e::procs::publisher_bin())
        .args(["send", "--tenant", "north-shop", "--action-id", "silent-2"])
        .args(["--tool", "ticket", "--args", r#"{"n":2}"#])
        .env_clear()
        .env("RUST_LOG", "warn")
        .env("AMQP_URL", silent.url())
        .env("INTENTS_EXCHANGE", &env.topology.intents_exchange)
        .env("RESULTS_EXCHANGE", &env.topology.results_exchange)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(T, out)
        .await
        .expect("the publisher gives up on a silent node")
        .expect("run publisher");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("within 1000 ms"),
        "names the bound: {stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    assert!(silent.connections() > offered, "the publisher tried it");
    assert_eq!(env.writes("north-shop:silent-2").await, 0);
    cleanup(env).await;
}
