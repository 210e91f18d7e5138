//! The shutdown budget. SIGTERM under load (thousands of intents queued and
//! still being published, a slow downstream, some requests outliving the grace period) must
//! exit 0 within the documented bound (grace + relay flush), and lose nothing: a second worker
//! finishes every intent, each with a final result event and exactly one downstream mutation.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::{cleanup, host_port, intent, Agent, Downstream, Env, Worker, WorkerOptions};
use publisher::Publisher;
use serde_json::json;

const TENANT: &str = "north-shop";
const QUEUED: usize = 2000;
const DURING: usize = 1000;
const GRACE_SECS: u64 = 1;
/// `worker::app::RELAY_FLUSH`, the second term of the budget.
const RELAY_FLUSH_SECS: u64 = 10;

async fn publish_range(env: &Env, from: usize, to: usize, tasks: usize) {
    let publisher = Arc::new(
        Publisher::connect(&env.amqp_url, &env.topology.intents_exchange)
            .await
            .expect("publisher connect"),
    );
    let mut handles = Vec::new();
    for t in 0..tasks {
        let publisher = publisher.clone();
        handles.push(tokio::spawn(async move {
            for i in (from + t..to).step_by(tasks) {
                let intent = intent(
                    TENANT,
                    &format!("load-{i}"),
                    "refund",
                    json!({"order": i, "amount_cents": 100}),
                );
                publisher.publish(&intent).await.expect("publish");
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
}

async fn count(env: &Env, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(&env.pool)
        .await
        .unwrap_or(0)
}

#[tokio::test]
async fn sigterm_under_load_exits_0_within_the_budget_and_loses_nothing() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    // Every 4th write commits and then answers only after 1.3 s (below the tool's 2 s timeout
    // with room for a loaded machine: a write timed out is `unknown` and waits for recovery's
    // backoff; above the 1 s grace), so at SIGTERM some work is always cut off by the grace
    // period.
    // (A downstream request takes the first matching fault only, so this is the only one.)
    ds.fault(
        json!({"kind": "slow_after_commit", "delay_ms": 1300, "times": 1_000_000, "every": 4}),
    )
    .await;
    // A 5 s tool timeout and an 8 s lease: on a loaded machine a slow write must not time out
    // into `unknown`, whose recovery backoff (not shutdown) would then set the test's length.
    let tools = env.standard_tools_timed(ds.port, 5000, "");
    let mut opts =
        WorkerOptions::new(tools).env("WORKER_SHUTDOWN_GRACE_SECS", &GRACE_SECS.to_string());
    opts.lease_secs = 8;
    opts.prefetch = 256;
    let mut agent = Agent::new_after(&env, &[TENANT], &opts).await;
    publish_range(&env, 0, QUEUED, 8).await;

    let mut w1 = Worker::start(&env, "w1", &opts).await;
    let env_bg = Arc::new(env);
    let during = {
        let env = env_bg.clone();
        tokio::spawn(async move { publish_range(&env, QUEUED, QUEUED + DURING, 2).await })
    };
    let env = env_bg;
    e2e::wait_for(
        "300 operations succeeded",
        Duration::from_secs(60),
        || async {
            (count(
                &env,
                "SELECT count(*) FROM operations WHERE state = 'succeeded'",
            )
            .await
                >= 300)
                .then_some(())
        },
    )
    .await;
    let in_flight_at_signal = count(
        &env,
        "SELECT count(*) FROM operations WHERE state = 'dispatching'",
    )
    .await;
    let started = Instant::now();
    let code = w1
        .terminate_async(Duration::from_secs(GRACE_SECS + RELAY_FLUSH_SECS + 20))
        .await;
    let took = started.elapsed();
    let bound = Duration::from_secs(GRACE_SECS + RELAY_FLUSH_SECS + 3);
    assert_eq!(
        code,
        Some(0),
        "graceful exit; output:\n{}",
        w1.output.text()
    );
    assert!(
        took <= bound,
        "SIGTERM to exit took {took:?}, above grace + relay flush + 3 s = {bound:?}"
    );
    assert!(
        w1.output
            .contains("in-flight work still running after the grace period"),
        "the test must cut work off at the grace period; output:\n{}",
        w1.output.text()
    );
    let done_by_w1 = count(
        &env,
        "SELECT count(*) FROM operations WHERE state = 'succeeded'",
    )
    .await;
    eprintln!(
        "w1: {in_flight_at_signal} dispatching at SIGTERM, exit 0 after {took:?} (bound {bound:?}), \
         {done_by_w1} succeeded before exit"
    );
    assert!(
        (done_by_w1 as usize) < QUEUED + DURING,
        "the worker must have been stopped mid-drain"
    );
    during.await.unwrap();

    // A second worker finishes everything: what w1 left queued, unacked or cut off.
    let total = (QUEUED + DURING) as i64;
    let _w2 = Worker::start(&env, "w2", &opts).await;
    let t2 = Instant::now();
    e2e::wait_for(
        "every operation succeeded",
        Duration::from_secs(180),
        || async {
            (count(
                &env,
                "SELECT count(*) FROM operations WHERE state = 'succeeded'",
            )
            .await
                == total)
                .then_some(())
        },
    )
    .await;
    eprintln!("w2: every operation succeeded after {:?}", t2.elapsed());
    assert_eq!(count(&env, "SELECT count(*) FROM operations").await, total);

    // One business change per distinct action: nothing lost, nothing written twice.
    assert_eq!(
        count(&env, "SELECT count(*) FROM downstream.mutations").await,
        total
    );
    assert_eq!(
        count(
            &env,
            "SELECT count(DISTINCT idem_key) FROM downstream.mutations"
        )
        .await,
        total
    );

    // Every action's final answer reached the agent.
    let mut succeeded = BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while succeeded.len() < total as usize && Instant::now() < deadline {
        if let Some(ev) = agent.try_next(TENANT, Duration::from_secs(5)).await {
            if ev.status == protocol::Status::Succeeded {
                succeeded.insert(ev.action_id);
            }
        }
    }
    eprintln!("agent: every succeeded event after {:?}", t2.elapsed());
    assert_eq!(
        succeeded.len(),
        total as usize,
        "a succeeded event per action"
    );
    drop(_w2);
    drop(ds);
    let env = Arc::try_unwrap(env).unwrap_or_else(|_| panic!("env still shared"));
    cleanup(env).await;
}

/// The same with the ledger black-holed at the moment of the signal (a silent partition: no
/// reset, queries just hang): every phase must still be bounded, so the process exits 0 within
/// grace + relay flush, and what it held is finished by the next worker.
#[tokio::test]
async fn sigterm_with_a_black_holed_ledger_still_exits_within_the_budget() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    ds.fault(json!({"kind": "slow_after_commit", "delay_ms": 500, "times": 1_000_000, "every": 2}))
        .await;
    let pg = e2e::FaultProxy::start(&host_port(&env.db_url)).await;
    let direct = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .env("WORKER_SHUTDOWN_GRACE_SECS", &GRACE_SECS.to_string());
    let proxied = direct.clone().database_url(&env.db_url.replacen(
        &host_port(&env.db_url),
        &pg.addr().to_string(),
        1,
    ));
    let _agent = Agent::new_after(&env, &[TENANT], &direct).await;
    publish_range(&env, 0, 600, 4).await;
    let mut w1 = Worker::start(&env, "w1", &proxied).await;
    e2e::wait_for(
        "100 operations succeeded",
        Duration::from_secs(60),
        || async {
            (count(
                &env,
                "SELECT count(*) FROM operations WHERE state = 'succeeded'",
            )
            .await
                >= 100)
                .then_some(())
        },
    )
    .await;
    pg.blackhole();
    let started = Instant::now();
    let code = w1
        .terminate_async(Duration::from_secs(GRACE_SECS + RELAY_FLUSH_SECS + 30))
        .await;
    let took = started.elapsed();
    let bound = Duration::from_secs(GRACE_SECS + RELAY_FLUSH_SECS + 3);
    eprintln!("w1 with a black-holed ledger: exit {code:?} after {took:?} (bound {bound:?})");
    assert_eq!(
        code,
        Some(0),
        "graceful exit; output:\n{}",
        w1.output.text()
    );
    assert!(
        took <= bound,
        "took {took:?}, above {bound:?}; output:\n{}",
        w1.output.text()
    );
    pg.restore();

    let _w2 = Worker::start(&env, "w2", &direct).await;
    e2e::wait_for(
        "every operation succeeded",
        Duration::from_secs(120),
        || async {
            (count(
                &env,
                "SELECT count(*) FROM operations WHERE state = 'succeeded'",
            )
            .await
                == 600)
                .then_some(())
        },
    )
    .await;
    assert_eq!(
        count(&env, "SELECT count(*) FROM downstream.mutations").await,
        600
    );
    assert_eq!(
        count(
            &env,
            "SELECT count(DISTINCT idem_key) FROM downstream.mutations"
        )
        .await,
        600
    );
    drop(_w2);
    cleanup(env).await;
}
