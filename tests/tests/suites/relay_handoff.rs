//! A worker's own completion events are inserted already claimed by its relay and
//! handed to it in memory after the commit, so the relay publishes them without a claim
//! `UPDATE`, and records them published with its epoch's watermark instead of a mark on each
//! row. Proven from the outside: the outbox rows (owner, publication as the `result_events`
//! view reads it, and how many times each row was updated, counted by a trigger the test
//! installs), the events the agent receives, crashes and a stalled broker link.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use e2e::{
    cleanup, host_port, via, wait_for, Agent, Downstream, Env, FaultProxy, Worker, WorkerOptions,
};
use protocol::{ResultEvent, Status};
use serde_json::json;

const T: Duration = Duration::from_secs(60);
const TENANT: &str = "north-shop";

/// The standard tools with an 8 s timeout and a 20 s lease: on a slow, shared machine a
/// (deliberately slowed) request must not time out or outlive its lease.
fn roomy_opts(env: &Env, port: u16) -> WorkerOptions {
    let mut opts = WorkerOptions::new(env.standard_tools_timed(port, 8000, "")).with_metrics();
    opts.lease_secs = 20;
    opts
}

/// The id a worker started as `name` writes into leases and relay claims.
fn worker_id(env: &Env, name: &str) -> String {
    format!("{name}-{}", env.id)
}

/// Starts a worker and waits until both of its broker links (consumer and relay) are up, so
/// its relay takes hand-offs from the first completion on.
async fn start_ready(env: &Env, name: &str, opts: &WorkerOptions) -> Worker {
    let w = Worker::start(env, name, opts).await;
    wait_for("readyz 200", T, || async {
        (w.get("/readyz").await.0 == 200).then_some(())
    })
    .await;
    w
}

/// Counts every UPDATE of a `result_outbox` row in `e2e_outbox_updates` (the worker must have
/// migrated the database already).
async fn count_outbox_updates(env: &Env) {
    for sql in [
        "CREATE TABLE e2e_outbox_updates (id int8 NOT NULL)",
        "CREATE FUNCTION e2e_count_outbox_update() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO e2e_outbox_updates VALUES (NEW.id); RETURN NEW; END $$",
        "CREATE TRIGGER e2e_count_outbox_update AFTER UPDATE ON result_outbox
         FOR EACH ROW EXECUTE FUNCTION e2e_count_outbox_update()",
    ] {
        sqlx::query(sql).execute(&env.pool).await.expect(sql);
    }
}

kit::pg_row! {
    /// The `succeeded` event row of one operation, as the outbox holds it.
    #[derive(Debug, Clone)]
    struct EventRow {
        event_id: String,
        relay_owner: Option<String>,
        relay_epoch: Option<i64>,
        published: bool,
        /// Updates of the row since the counting trigger was installed.
        updates: i64,
        /// The worker that recorded the completion.
        completed_by: Option<String>,
        /// `created_at`, `relay_until` and `published_at` as Unix seconds.
        created_at: f64,
        relay_until: Option<f64>,
        published_at: Option<f64>,
    }
}

async fn event_row(env: &Env, action_id: &str) -> Option<EventRow> {
    sqlx::query_as(
        "SELECT r.event_id::text AS event_id, r.relay_owner, r.relay_epoch, r.published,
                (SELECT count(*) FROM e2e_outbox_updates u WHERE u.id = r.id) AS updates,
                o.changed_by AS completed_by,
                extract(epoch FROM r.created_at)::float8 AS created_at,
                extract(epoch FROM r.relay_until)::float8 AS relay_until,
                extract(epoch FROM r.published_at)::float8 AS published_at
         FROM result_events r JOIN operations o ON o.id = r.operation_id
         WHERE o.tenant = $1 AND o.action_id = $2 AND r.status = 'succeeded'",
    )
    .bind(TENANT)
    .bind(action_id)
    .fetch_optional(&env.pool)
    .await
    .expect("read the outbox")
}

/// Waits until the `succeeded` event of every action is recorded published.
async fn all_published(env: &Env, ids: &[String]) -> BTreeMap<String, EventRow> {
    wait_for("every succeeded event recorded published", T, || async {
        let mut rows = BTreeMap::new();
        for id in ids {
            match event_row(env, id).await {
                Some(row) if row.published => {
                    rows.insert(id.clone(), row);
                }
                _ => return None,
            }
        }
        Some(rows)
    })
    .await
}

/// Reads result events until `n` distinct `succeeded` ones arrived, then `quiet` more so a
/// duplicate would show; returns every event read.
async fn collect(agent: &mut Agent, n: usize, quiet: Duration) -> Vec<ResultEvent> {
    let mut events = Vec::new();
    let mut distinct = BTreeSet::new();
    let deadline = tokio::time::Instant::now() + T;
    while distinct.len() < n {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let Some(ev) = agent.try_next(TENANT, left).await else {
            panic!(
                "only {} of {n} succeeded events within {T:?}",
                distinct.len()
            );
        };
        if ev.status == Status::Succeeded {
            distinct.insert(ev.event_id.clone());
        }
        events.push(ev);
    }
    while let Some(ev) = agent.try_next(TENANT, quiet).await {
        events.push(ev);
    }
    events
}

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

async fn publish(agent: &Agent, ids: &[String]) {
    for id in ids {
        agent
            .request(TENANT, id, "refund", json!({"order": id}))
            .await;
    }
}

/// Waits until every action is in `state` in the ledger.
async fn all_in(env: &Env, ids: &[String], state: &str) {
    wait_for(&format!("every action {state}"), T, || async {
        for id in ids {
            if env.state(TENANT, id).await != state {
                return None;
            }
        }
        Some(())
    })
    .await;
}

/// A completed intent's event is published by the worker that recorded it, and its outbox
/// row is never updated: no relay claim, no mark (the epoch's watermark records it published).
#[tokio::test]
async fn own_completion_events_are_published_without_a_claim_update() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = roomy_opts(&env, ds.port);
    let w = start_ready(&env, "w", &opts).await;
    count_outbox_updates(&env).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    let all = ids("own", 20);
    publish(&agent, &all).await;

    let events = collect(&mut agent, all.len(), Duration::from_millis(500)).await;
    let rows = all_published(&env, &all).await;
    // Let a stray update (a claim or a mark after the watermark would be a bug) show itself.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let me = worker_id(&env, "w");
    for id in &all {
        let row = event_row(&env, id).await.unwrap();
        assert_eq!(
            row.relay_owner.as_deref(),
            Some(me.as_str()),
            "{id}: {row:?}"
        );
        assert!(row.published, "{id}: {row:?}");
        assert_eq!(
            row.updates, 0,
            "{id}: the row is never updated (not claimed, not marked): {row:?}"
        );
        assert!(
            row.published_at.is_none(),
            "{id}: published by the watermark: {row:?}"
        );
        assert_eq!(row.event_id, rows[id].event_id);
    }
    let got: BTreeSet<_> = events
        .iter()
        .filter(|e| e.status == Status::Succeeded)
        .map(|e| e.event_id.clone())
        .collect();
    let want: BTreeSet<_> = rows.values().map(|r| r.event_id.clone()).collect();
    assert_eq!(got, want, "the agent got exactly the recorded events");
    assert_eq!(events.len(), all.len(), "no duplicates: {events:?}");
    drop(w);
    cleanup(env).await;
}

/// Two workers on one queue, 200 intents: every event reaches the results queue exactly once
/// (no crash, so no duplicate), each published by the worker that completed it, no row
/// updated.
#[tokio::test]
async fn two_workers_publish_every_event_once() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = roomy_opts(&env, ds.port);
    let a = start_ready(&env, "a", &opts).await;
    let b = start_ready(&env, "b", &opts).await;
    count_outbox_updates(&env).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    let all = ids("pair", 200);
    publish(&agent, &all).await;

    let events = collect(&mut agent, all.len(), Duration::from_secs(2)).await;
    let rows = all_published(&env, &all).await;
    let distinct: BTreeSet<_> = events.iter().map(|e| e.event_id.clone()).collect();
    assert!(events.iter().all(|e| e.status == Status::Succeeded));
    assert_eq!(distinct.len(), all.len(), "one event per intent");
    assert_eq!(events.len(), all.len(), "and no duplicates");
    let want: BTreeSet<_> = rows.values().map(|r| r.event_id.clone()).collect();
    assert_eq!(distinct, want);
    let workers = [worker_id(&env, "a"), worker_id(&env, "b")];
    let mut by_worker = BTreeMap::new();
    for (id, row) in &rows {
        assert!(
            row.relay_owner.is_some() && row.relay_owner == row.completed_by,
            "{id}: published by the worker that completed it: {row:?}"
        );
        assert!(workers.contains(row.relay_owner.as_ref().unwrap()));
        assert_eq!(row.updates, 0, "{id}: no claim, no mark: {row:?}");
        *by_worker
            .entry(row.relay_owner.clone().unwrap())
            .or_insert(0) += 1;
    }
    eprintln!("events per worker: {by_worker:?}");
    drop((a, b));
    cleanup(env).await;
}

/// A worker stopped for good right after its completion committed (fault point
/// `after_succeeded`; its broker link black-holed first, so nothing it publishes can arrive)
/// leaves the event claimed by itself, in its relay epoch: another worker's relay does not
/// take it while the hold lasts, then retires the silent epoch, publishes the event and marks
/// it, and the agent gets exactly that event.
#[tokio::test]
async fn crash_after_commit_leaves_the_event_to_another_relay_after_the_hold() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let proxy = FaultProxy::start(&host_port(&env.amqp_url)).await;
    let action = "crash-0";
    // The dead worker's hold, shortened for this test (fault-point builds only).
    let hold = Duration::from_secs(10);
    let opts = roomy_opts(&env, ds.port);
    let a_opts = opts
        .clone()
        .amqp_url(&via(&env.amqp_url, proxy.addr()))
        .fault("after_succeeded", Some(action))
        .env("WORKER_FAULT_RELAY_HOLD_SECS", &hold.as_secs().to_string());
    let mut a = start_ready(&env, "a", &a_opts).await;
    count_outbox_updates(&env).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    ds.fault(json!({"kind": "slow", "delay_ms": 3000, "key": format!("{TENANT}:{action}")}))
        .await;
    publish(&agent, &[action.to_string()]).await;
    // Claimed and acked; the request waits at the downstream. Nothing worker A publishes from
    // now on reaches the broker.
    all_in(&env, &[action.to_string()], "dispatching").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.blackhole();
    a.wait_output("fault point reached: after_succeeded", T)
        .await;
    a.kill();
    let a_id = worker_id(&env, "a");
    let row = event_row(&env, action)
        .await
        .expect("the event was recorded");
    assert_eq!(
        row.relay_owner.as_deref(),
        Some(a_id.as_str()),
        "inserted claimed by the worker that completed it: {row:?}"
    );
    assert!(!row.published, "{row:?}");
    assert_eq!(row.updates, 0, "no claim update: {row:?}");

    assert_eq!(
        row.relay_until,
        Some(f64::INFINITY),
        "held by its epoch, not until a time: {row:?}"
    );
    // The epoch began with this event's commit and was never advanced: it is retired once
    // the hold has passed since then.
    let a_until = row.created_at + hold.as_secs_f64();

    // The hold a relay waits before it retires another's silent epoch is its own (the same
    // constant in every release build).
    let b_opts = opts
        .clone()
        .env("WORKER_FAULT_RELAY_HOLD_SECS", &hold.as_secs().to_string());
    let b = start_ready(&env, "b", &b_opts).await;
    // Worker B's relay polls every 500 ms but leaves the row alone while A's epoch lives.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let during = event_row(&env, action).await.unwrap();
    assert!(
        during.published_at.is_none() || during.published_at >= Some(a_until),
        "{during:?}"
    );
    let ev = agent.next(TENANT, hold + Duration::from_secs(20)).await;
    assert_eq!(ev.action_id, action);
    assert_eq!(ev.status, Status::Succeeded);
    assert_eq!(
        ev.event_id, row.event_id,
        "the event A recorded, not a new one"
    );
    let after = all_published(&env, &[action.to_string()]).await[action].clone();
    assert_eq!(
        after.relay_owner.as_deref(),
        Some(worker_id(&env, "b").as_str()),
        "published by the surviving worker: {after:?}"
    );
    assert!(
        after.published_at >= Some(a_until),
        "only after A's hold ended ({a_until}): {after:?}"
    );
    assert!(
        agent
            .try_next(TENANT, Duration::from_millis(1500))
            .await
            .is_none(),
        "exactly one event"
    );
    drop(b);
    drop(proxy);
    cleanup(env).await;
}

/// The relay's broker link stalls while it waits for a confirm; completions that commit
/// meanwhile are handed to it and wait in memory. When the link is reset and the relay
/// reconnects, the new relay publishes them from memory (no update: the watermark) and no
/// event is lost; the row that was in flight is released and published again through the
/// outbox.
#[tokio::test]
async fn handed_events_survive_a_broker_link_loss() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let proxy = FaultProxy::start(&host_port(&env.amqp_url)).await;
    let opts = roomy_opts(&env, ds.port)
        .amqp_url(&via(&env.amqp_url, proxy.addr()))
        // The stall must last until the test ends it, not end by a missed heartbeat.
        .env("WORKER_AMQP_HEARTBEAT_SECS", "120");
    let w = start_ready(&env, "w", &opts).await;
    count_outbox_updates(&env).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    let first = ids("stall-a", 1);
    let waiting = ids("stall-b", 5);
    for id in &first {
        ds.fault(json!({"kind": "slow", "delay_ms": 2500, "key": format!("{TENANT}:{id}")}))
            .await;
    }
    for id in &waiting {
        ds.fault(json!({"kind": "slow", "delay_ms": 5000, "key": format!("{TENANT}:{id}")}))
            .await;
    }
    let all: Vec<String> = first.iter().chain(&waiting).cloned().collect();
    publish(&agent, &all).await;
    all_in(&env, &all, "dispatching").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.blackhole();
    // The first event goes into the black hole (the relay waits for its confirm); the others
    // commit while it waits and are handed to it.
    all_in(&env, &all, "succeeded").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let me = worker_id(&env, "w");
    for id in &waiting {
        let row = event_row(&env, id).await.unwrap();
        assert_eq!(
            row.relay_owner.as_deref(),
            Some(me.as_str()),
            "{id}: {row:?}"
        );
        assert!(!row.published, "{id}: {row:?}");
        assert_eq!(row.updates, 0, "{id}: handed, not claimed: {row:?}");
    }
    // Resets the stalled connections: the relay loses its link and reconnects.
    proxy.restore();
    let events = collect(&mut agent, all.len(), Duration::from_millis(1500)).await;
    let rows = all_published(&env, &all).await;
    let got: BTreeSet<_> = events
        .iter()
        .filter(|e| e.status == Status::Succeeded)
        .map(|e| e.event_id.clone())
        .collect();
    let want: BTreeSet<_> = rows.values().map(|r| r.event_id.clone()).collect();
    assert_eq!(got, want, "every recorded event arrived, none lost");
    for id in &waiting {
        let row = &rows[id];
        assert_eq!(
            row.relay_owner.as_deref(),
            Some(me.as_str()),
            "{id}: {row:?}"
        );
        assert_eq!(
            row.updates, 0,
            "{id}: published from memory after the reconnect (the watermark): {row:?}"
        );
    }
    assert!(proxy.connections() >= 3, "the worker reconnected");
    drop(w);
    drop(proxy);
    cleanup(env).await;
}

/// A worker whose relay had the broker's confirm for an event but had not yet written its
/// epoch's watermark (fault point `after_results_confirmed`) is killed: the event is not
/// recorded published, so once the dead worker's hold has passed another worker retires the
/// epoch and publishes the event again, with the same `event_id`. Agents may see an event
/// twice, never zero times.
#[tokio::test]
async fn crash_between_confirm_and_watermark_publishes_the_event_again() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let action = "confirmed-0";
    let hold = Duration::from_secs(4);
    let opts =
        roomy_opts(&env, ds.port).env("WORKER_FAULT_RELAY_HOLD_SECS", &hold.as_secs().to_string());
    let mut a = start_ready(
        &env,
        "a",
        &opts.clone().fault("after_results_confirmed", Some(action)),
    )
    .await;
    count_outbox_updates(&env).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    publish(&agent, &[action.to_string()]).await;
    a.wait_output("fault point reached: after_results_confirmed", T)
        .await;
    let first = agent.next(TENANT, T).await;
    assert_eq!(
        (first.action_id.as_str(), first.status),
        (action, Status::Succeeded)
    );
    a.kill();
    let row = event_row(&env, action).await.expect("recorded");
    assert!(
        !row.published && row.relay_epoch.is_some(),
        "confirmed but not recorded published: {row:?}"
    );

    let b = start_ready(&env, "b", &opts).await;
    let again = agent.next(TENANT, hold * 3 + T).await;
    assert_eq!(again.event_id, first.event_id, "the same event, again");
    assert_eq!(again.status, Status::Succeeded);
    let after = all_published(&env, &[action.to_string()]).await[action].clone();
    assert_eq!(
        after.relay_owner.as_deref(),
        Some(worker_id(&env, "b").as_str()),
        "given back by the retired epoch and marked by the survivor: {after:?}"
    );
    assert!(
        after.relay_epoch.is_none() && after.published_at.is_some(),
        "{after:?}"
    );
    assert!(
        agent
            .try_next(TENANT, Duration::from_millis(1500))
            .await
            .is_none(),
        "twice, not more"
    );
    drop(b);
    cleanup(env).await;
}

/// A worker idle for longer than the relay hold keeps its epoch (its relay writes the
/// watermark again every third of the hold, and its own relay retires silent epochs too): the
/// event after the pause joins the same epoch, no event is given back or published twice, and
/// no row is ever updated.
#[tokio::test]
async fn an_idle_workers_epoch_is_not_retired() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let hold = Duration::from_secs(3);
    let opts =
        roomy_opts(&env, ds.port).env("WORKER_FAULT_RELAY_HOLD_SECS", &hold.as_secs().to_string());
    let w = start_ready(&env, "w", &opts).await;
    count_outbox_updates(&env).await;
    let mut agent = Agent::new(&env, &[TENANT]).await;
    let before = ids("idle-a", 1);
    let after = ids("idle-b", 1);
    publish(&agent, &before).await;
    let mut events = collect(&mut agent, 1, Duration::from_millis(200)).await;
    tokio::time::sleep(hold * 3).await;
    publish(&agent, &after).await;
    events.extend(collect(&mut agent, 1, Duration::from_millis(1500)).await);
    let all: Vec<String> = before.iter().chain(&after).cloned().collect();
    let rows = all_published(&env, &all).await;
    assert_eq!(events.len(), 2, "no event published twice: {events:?}");
    assert!(rows.values().all(|r| r.updates == 0), "{rows:?}");
    let epochs: BTreeSet<_> = rows.values().map(|r| r.relay_epoch).collect();
    assert_eq!(epochs.len(), 1, "one epoch across the pause: {rows:?}");
    assert!(epochs.iter().all(Option::is_some), "{rows:?}");
    drop(w);
    cleanup(env).await;
}
