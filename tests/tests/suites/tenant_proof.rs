//! Tenant proof and answers (worker side): who gets an answer, and what it says.
//! A tenant the broker did not prove gets nothing; a key that has a row is answered from the
//! row; each agent of a tenant receives only the answers addressed to its `reply_to`. Real
//! worker processes, RabbitMQ (with a second broker user) and Postgres.

use std::time::Duration;

use e2e::{cleanup, intent, publish_as, Agent, BrokerUser, Downstream, Env, Worker, WorkerOptions};
use lapin::options::{BasicGetOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use protocol::{
    result_routing_key, tenant_binding_keys, Intent, RejectReason, ResultEvent, Status,
};
use serde_json::json;

/// Generous: other suites share the machine, and a slow first answer is recovered by replay.
const T: Duration = Duration::from_secs(45);

fn encode(i: &Intent) -> Vec<u8> {
    serde_json::to_vec(i).unwrap()
}

fn with_reply_to(mut i: Intent, reply_to: Option<&str>) -> Intent {
    i.reply_to = reply_to.map(str::to_string);
    i
}

/// A result queue bound to the results exchange with exactly `keys`, as an agent or an
/// observer would declare it.
struct ResultQueue {
    conn: lapin::Connection,
    channel: lapin::Channel,
    queue: String,
    seen: Vec<ResultEvent>,
}

impl ResultQueue {
    async fn bind(env: &Env, keys: &[String]) -> ResultQueue {
        let conn = lapin::Connection::connect(&env.amqp_url, Default::default())
            .await
            .unwrap();
        let channel = conn.create_channel().await.unwrap();
        let q = channel
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let queue = q.name().as_str().to_string();
        for key in keys {
            channel
                .queue_bind(
                    queue.as_str().into(),
                    env.topology.results_exchange.as_str().into(),
                    key.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
        }
        ResultQueue {
            conn,
            channel,
            queue,
            seen: Vec::new(),
        }
    }

    /// Takes everything queued now into `seen`.
    async fn poll(&mut self) {
        while let Ok(Some(m)) = self
            .channel
            .basic_get(self.queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
        {
            let ev: ResultEvent = serde_json::from_slice(&m.delivery.data).expect("result event");
            self.seen.push(ev);
        }
    }

    /// Polls until an event about `action_id` with `status` was seen (panics after `T`).
    async fn wait(&mut self, action_id: &str, status: Status) -> ResultEvent {
        let deadline = tokio::time::Instant::now() + T;
        loop {
            self.poll().await;
            if let Some(ev) = self
                .seen
                .iter()
                .find(|e| e.action_id == action_id && e.status == status)
            {
                return ev.clone();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no {status} event for {action_id}; seen: {:?}",
                self.seen
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until `n` events about `action_id` with `status` were seen; returns them.
    async fn wait_n(&mut self, action_id: &str, status: Status, n: usize) -> Vec<ResultEvent> {
        let deadline = tokio::time::Instant::now() + T;
        loop {
            self.poll().await;
            let found: Vec<ResultEvent> = self
                .about(action_id)
                .into_iter()
                .filter(|e| e.status == status)
                .collect();
            if found.len() >= n {
                return found;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "fewer than {n} {status} events for {action_id}; seen: {:?}",
                self.seen
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn about(&self, action_id: &str) -> Vec<ResultEvent> {
        self.seen
            .iter()
            .filter(|e| e.action_id == action_id)
            .cloned()
            .collect()
    }

    fn action_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.seen.iter().map(|e| e.action_id.clone()).collect();
        ids.sort();
        ids.dedup();
        ids
    }

    async fn close(self) {
        let _ = self.conn.close(200, "".into()).await;
    }
}

/// Dead-letter copies with (reason, detail) headers, collected until `n` arrived (or `T`).
async fn dead_letters(env: &Env, agent: &Agent, n: usize) -> Vec<(String, String, Vec<u8>)> {
    let mut copies = Vec::new();
    let deadline = tokio::time::Instant::now() + T;
    while copies.len() < n && tokio::time::Instant::now() < deadline {
        for m in agent.drain_dead_letters(env).await {
            let header = |name: &str| {
                m.properties
                    .headers()
                    .as_ref()
                    .and_then(|h| h.inner().get(name).cloned())
                    .map(|v| match v {
                        AMQPValue::LongString(s) => s.to_string(),
                        other => format!("{other:?}"),
                    })
                    .unwrap_or_default()
            };
            copies.push((
                header("x-intent-worker-reason"),
                header("x-intent-worker-detail"),
                m.delivery.data.clone(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    copies
}

/// Alice is proven for tenant-a only. Whatever she sends naming tenant-b — a malformed
/// body carrying one of b's keys, a malformed body with a fresh key, an unknown tool — no
/// event is routed to tenant-b; each message is dead-lettered as `tenant_mismatch` naming the
/// user and the tenant. Her proven intent in the same stream still succeeds.
#[tokio::test]
async fn an_unproven_tenant_gets_no_answer_for_malformed_bodies_or_unknown_tools() {
    let alice = BrokerUser::create("alice");
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = env.standard_tools(ds.port, "");
    let mut text = std::fs::read_to_string(&tools).unwrap();
    text.push_str(&format!(
        "\n[auth]\nmode = \"user_id\"\nusers = {{ \"{}\" = [\"tenant-a\"], guest = [\"tenant-b\"] }}\n",
        alice.name
    ));
    std::fs::write(&tools, text).unwrap();
    let mut w = Worker::start(&env, "w", &WorkerOptions::new(tools)).await;
    let agent = Agent::new(&env, &[]).await;
    let mut to_b = ResultQueue::bind(&env, &tenant_binding_keys("tenant-b")).await;
    let mut to_a = ResultQueue::bind(&env, &tenant_binding_keys("tenant-a")).await;

    // tenant-b's own action b-1, proven by guest.
    let b1 = intent("tenant-b", "b-1", "refund", json!({"order": "o-b1"}));
    publish_as(&env, &env.amqp_url, Some("guest"), "x", &[&encode(&b1)]).await;
    to_b.wait("b-1", Status::Succeeded).await;
    let before = to_b.seen.len();

    let alice_url = alice.url(&env);
    let spoofs: Vec<Vec<u8>> = vec![
        br#"{"tenant":"tenant-b","action_id":"b-1","tool":"refund","arguments":5}"#.to_vec(),
        br#"{"tenant":"tenant-b","action_id":"b-9","tool":"refund","arguments":5}"#.to_vec(),
        encode(&intent("tenant-b", "b-1", "teleport", json!({}))),
        encode(&intent("tenant-b", "b-8", "teleport", json!({}))),
    ];
    for body in &spoofs {
        publish_as(&env, &alice_url, Some(&alice.name), "x", &[body]).await;
    }
    let a1 = intent("tenant-a", "a-1", "refund", json!({"order": "o-a1"}));
    publish_as(&env, &alice_url, Some(&alice.name), "x", &[&encode(&a1)]).await;
    to_a.wait("a-1", Status::Succeeded).await;

    let copies = dead_letters(&env, &agent, spoofs.len()).await;
    assert_eq!(copies.len(), spoofs.len(), "one dead-letter copy per spoof");
    for (reason, detail, _) in &copies {
        assert_eq!(reason, "tenant_mismatch", "{detail}");
        assert!(
            detail.contains(&alice.name) && detail.contains("tenant-b"),
            "the detail names the user and the tenant: {detail}"
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    to_b.poll().await;
    assert_eq!(
        &to_b.seen[before..],
        &[],
        "nothing is routed to a tenant alice was not proven for"
    );
    assert!(
        w.is_running(),
        "the dead-letter copies did not stop the worker"
    );
    assert_eq!(env.writes("tenant-b:b-1").await, 1);
    assert_eq!(env.state("tenant-b", "b-9").await, "");
    assert_eq!(env.state("tenant-b", "b-8").await, "");
    to_a.close().await;
    to_b.close().await;
    drop(alice);
    cleanup(env).await;
}

/// Key k-1 has succeeded. An intent for k-1 naming an unknown tool, or an undecodable
/// body carrying k-1, is answered from k-1's row (`intent_conflict`, saying the key is taken),
/// never "nothing was done"; the same intent arriving after its tool was removed from the
/// pool gets the stored answer with the original receipt. Keys without a row keep today's
/// rejections. Every bad message is still dead-lettered with its own reason.
#[tokio::test]
async fn a_key_with_a_row_is_answered_from_the_row() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = env.standard_tools(ds.port, "");
    let mut w = Worker::start(&env, "w1", &WorkerOptions::new(tools.clone())).await;
    let agent = Agent::new(&env, &[]).await;
    let mut results = ResultQueue::bind(&env, &tenant_binding_keys("north-shop")).await;

    let k1 = intent("north-shop", "k-1", "refund", json!({"order": "o-1"}));
    agent.send(&k1).await;
    let done = results.wait("k-1", Status::Succeeded).await;

    // Unknown tool under a taken key.
    agent
        .send(&intent("north-shop", "k-1", "teleport", json!({})))
        .await;
    // Undecodable body under a taken key.
    agent
        .send_raw(
            "north-shop",
            br#"{"tenant":"north-shop","action_id":"k-1","tool":"refund","arguments":5}"#,
        )
        .await;
    let answers = results.wait_n("k-1", Status::Rejected, 2).await;
    for ev in &answers {
        assert_eq!(ev.reason, Some(RejectReason::IntentConflict), "{ev:?}");
        assert!(
            !ev.message.contains("nothing was done"),
            "a key with a row never reads 'nothing was done': {}",
            ev.message
        );
        assert!(
            ev.message.contains("already") && ev.message.contains("succeeded"),
            "the answer says the key is taken and by what: {}",
            ev.message
        );
    }
    // Keys without a row: today's rejections.
    agent
        .send(&intent("north-shop", "k-2", "teleport", json!({})))
        .await;
    agent
        .send_raw(
            "north-shop",
            br#"{"tenant":"north-shop","action_id":"k-3","tool":"refund","arguments":5}"#,
        )
        .await;
    let k2 = results.wait("k-2", Status::Rejected).await;
    assert_eq!(k2.reason, Some(RejectReason::UnknownTool));
    assert!(k2.message.contains("nothing was done"), "{}", k2.message);
    let k3 = results.wait("k-3", Status::Rejected).await;
    assert_eq!(k3.reason, Some(RejectReason::InvalidMessage));

    let mut reasons: Vec<String> = dead_letters(&env, &agent, 4)
        .await
        .into_iter()
        .map(|(r, _, _)| r)
        .collect();
    reasons.sort();
    assert_eq!(
        reasons,
        [
            "invalid_message",
            "invalid_message",
            "unknown_tool",
            "unknown_tool"
        ],
        "dead-letter reasons are unchanged"
    );

    // The tool is removed from the pool; k-1 arrives again, the same intent.
    assert_eq!(w.terminate(T), Some(0));
    let text = std::fs::read_to_string(&tools).unwrap();
    let start = text.find("[tools.refund]").unwrap();
    let end = text.find("[tools.ticket]").unwrap();
    let without_refund = env.write_tools(&format!("{}{}", &text[..start], &text[end..]));
    let _w2 = Worker::start(&env, "w2", &WorkerOptions::new(without_refund)).await;
    agent.send(&k1).await;
    let again = results
        .wait_n("k-1", Status::Succeeded, 2)
        .await
        .pop()
        .unwrap();
    assert_eq!(
        again.receipt, done.receipt,
        "the stored receipt, not a denial"
    );
    assert_eq!(env.writes("north-shop:k-1").await, 1);
    results.close().await;
    cleanup(env).await;
}

/// Two agents of one tenant, each bound to `<tenant>.@.<its reply_to>`,
/// receive only the answers addressed to them, including answers to their own duplicates
/// and conflicts of another agent's key; a queue bound to `<tenant>` (today's binding) still
/// gets the events of intents without `reply_to`; a tenant-wide observer gets everything;
/// tenant `north`'s wide binding never sees tenant `north.shop`.
#[tokio::test]
async fn each_agent_receives_only_the_answers_for_its_reply_to() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let _w = Worker::start(
        &env,
        "w",
        &WorkerOptions::new(env.standard_tools(ds.port, "")),
    )
    .await;
    let tenant = "north.shop";
    let agent = Agent::new(&env, &[]).await;
    let mut agent_a = ResultQueue::bind(&env, &[result_routing_key(tenant, Some("agent-a"))]).await;
    let mut agent_b = ResultQueue::bind(&env, &[result_routing_key(tenant, Some("agent-b"))]).await;
    let mut plain = ResultQueue::bind(&env, &[tenant.to_string()]).await;
    let mut observer = ResultQueue::bind(&env, &tenant_binding_keys(tenant)).await;
    let mut other_tenant = ResultQueue::bind(&env, &tenant_binding_keys("north")).await;

    let ra = with_reply_to(
        intent(tenant, "r-a", "refund", json!({"order": "a"})),
        Some("agent-a"),
    );
    let rb = with_reply_to(
        intent(tenant, "r-b", "refund", json!({"order": "b"})),
        Some("agent-b"),
    );
    let rn = with_reply_to(intent(tenant, "r-n", "refund", json!({"order": "n"})), None);
    for i in [&ra, &rb, &rn] {
        agent.send(i).await;
    }
    for id in ["r-a", "r-b", "r-n"] {
        observer.wait(id, Status::Succeeded).await;
    }
    // Agent b repeats a's intent, then reuses a's key for something else: b gets both answers.
    agent
        .send(&with_reply_to(ra.clone(), Some("agent-b")))
        .await;
    agent
        .send(&with_reply_to(
            intent(tenant, "r-a", "refund", json!({"order": "other"})),
            Some("agent-b"),
        ))
        .await;
    let dup = agent_b.wait_n("r-a", Status::Succeeded, 1).await;
    assert!(dup[0].receipt.is_some(), "{dup:?}");
    let conflict = agent_b.wait_n("r-a", Status::Rejected, 1).await;
    assert_eq!(conflict[0].reason, Some(RejectReason::IntentConflict));
    agent_b.wait("r-b", Status::Succeeded).await;
    agent_a.wait("r-a", Status::Succeeded).await;
    plain.wait("r-n", Status::Succeeded).await;
    observer.wait_n("r-a", Status::Rejected, 1).await;

    tokio::time::sleep(Duration::from_millis(500)).await;
    for q in [
        &mut agent_a,
        &mut agent_b,
        &mut plain,
        &mut observer,
        &mut other_tenant,
    ] {
        q.poll().await;
    }
    assert_eq!(agent_a.action_ids(), ["r-a"], "{:?}", agent_a.seen);
    // Every event about r-a reached exactly one of the two agents: the row's own events (its
    // first intent came from agent-a) went to a, the answers to b's deliveries to b.
    assert_eq!(
        agent_b.about("r-a").len(),
        2,
        "b gets its duplicate's answer and its conflict: {:?}",
        agent_b.seen
    );
    assert_eq!(
        agent_a.about("r-a").len() + 2,
        observer.about("r-a").len(),
        "a gets every r-a event except the answers to b's deliveries: {:?}",
        agent_a.seen
    );
    assert!(
        agent_a
            .about("r-a")
            .iter()
            .all(|e| e.status != Status::Rejected),
        "{:?}",
        agent_a.seen
    );
    assert_eq!(agent_b.action_ids(), ["r-a", "r-b"], "{:?}", agent_b.seen);
    assert_eq!(plain.action_ids(), ["r-n"], "{:?}", plain.seen);
    assert_eq!(other_tenant.seen, [], "tenant north never sees north.shop");
    assert_eq!(env.writes("north.shop:r-a").await, 1);
    for q in [agent_a, agent_b, plain, observer, other_tenant] {
        q.close().await;
    }
    cleanup(env).await;
}

/// A 200-character tenant with a 200-character `reply_to` (both allowed) would make a
/// 403-byte routing key, longer than AMQP allows: the event goes to the tenant-wide key
/// instead of jamming the relay, and later events still flow.
#[tokio::test]
async fn a_reply_to_too_long_for_a_routing_key_falls_back_to_the_tenant_key() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let mut w = Worker::start(
        &env,
        "w",
        &WorkerOptions::new(env.standard_tools(ds.port, "")),
    )
    .await;
    let tenant = "t".repeat(200);
    let agent = Agent::new(&env, &[]).await;
    let mut plain = ResultQueue::bind(&env, std::slice::from_ref(&tenant)).await;
    let long = with_reply_to(
        intent(&tenant, "long-1", "refund", json!({"order": "l"})),
        Some(&"r".repeat(200)),
    );
    agent.send(&long).await;
    plain.wait("long-1", Status::Succeeded).await;
    agent
        .send(&with_reply_to(
            intent(&tenant, "short-1", "refund", json!({"order": "s"})),
            None,
        ))
        .await;
    plain.wait("short-1", Status::Succeeded).await;
    assert!(w.is_running());
    plain.close().await;
    cleanup(env).await;
}
