//! The poll schedule survives a restart without a burst: 500 accepted long-running operations,
//! the only worker stopped past every one's next poll, and a new worker started. Their polls
//! resume spread over their gaps (counted at the downstream's status URL, in 250 ms windows),
//! not all in its first moments, and each operation is polled, never written again.

use std::time::Duration;

use e2e::{cleanup, metric_value, Agent, Downstream, Env, Worker, WorkerOptions};
use serde_json::json;

const TENANT: &str = "north-shop";
const ROWS: i64 = 500;

#[tokio::test]
async fn a_restart_with_500_accepted_operations_spreads_their_polls() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let port = ds.port;
    // Polls 1 s to 4 s apart (within half either way); never done within the test.
    let tools = env.async_tools(port, (1_000, 4_000, 600), "");
    ds.fault(json!({"kind": "async_stuck", "times": ROWS}))
        .await;
    let opts = WorkerOptions::new(tools).with_metrics();
    let mut first = Worker::start(&env, "w1", &opts).await;
    let agent = Agent::new(&env, &[TENANT]).await;
    for i in 0..ROWS {
        agent
            .request(TENANT, &format!("deploy-{i}"), "deploy", json!({"n": i}))
            .await;
    }
    e2e::wait_for(
        "500 accepted operations",
        Duration::from_secs(180),
        || async {
            let n: i64 =
                sqlx::query_scalar("SELECT count(*) FROM operations WHERE state = 'accepted'")
                    .fetch_one(&env.pool)
                    .await
                    .unwrap_or(0);
            (n == ROWS).then_some(())
        },
    )
    .await;
    assert_eq!(
        first.terminate_async(Duration::from_secs(30)).await,
        Some(0)
    );
    // Down until every operation's next poll is well past (the longest gap is 6 s).
    let latest: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM max(next_attempt_at) - now())::float8 FROM operations",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs_f64(latest.max(0.0)) + Duration::from_secs(4)).await;

    let restarted: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    let second = Worker::start(&env, "w2", &opts).await;
    tokio::time::sleep(Duration::from_secs(8)).await;

    // The operations read in each 250 ms window from the new worker's first poll on, in order.
    let windows: Vec<i64> = sqlx::query_scalar(
        "WITH reads AS (SELECT idem_key, at FROM downstream.requests
                        WHERE kind = 'status' AND at >= $1),
              first AS (SELECT min(at) AS at FROM reads),
              windowed AS (SELECT idem_key,
                                  floor(extract(epoch FROM reads.at - first.at) * 4) AS w
                           FROM reads, first)
         SELECT count(DISTINCT idem_key) FROM windowed GROUP BY w ORDER BY w",
    )
    .bind(restarted)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let first_second: i64 = sqlx::query_scalar(
        "WITH reads AS (SELECT idem_key, at FROM downstream.requests
                        WHERE kind = 'status' AND at >= $1)
         SELECT count(DISTINCT idem_key) FROM reads
         WHERE at < (SELECT min(at) FROM reads) + interval '1 second'",
    )
    .bind(restarted)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    let polled: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT idem_key) FROM downstream.requests
         WHERE kind = 'status' AND at >= $1",
    )
    .bind(restarted)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(
        polled >= ROWS - 10,
        "{polled} of {ROWS} polled within 8 s: {windows:?}"
    );
    // Spread over the 4 s gap, the first second holds about a quarter of them; all at once,
    // most (as many as the worker can read in a second).
    assert!(
        first_second <= ROWS * 2 / 5,
        "the first second after the restart polled {first_second} of {ROWS}: {windows:?}"
    );
    let spread = metric_value(
        &second.metrics().await,
        "intent_worker_polls_spread_total",
        &[("tool", "deploy")],
    );
    assert!(spread >= (ROWS - 10) as f64, "{spread} rescheduled");
    // Polls only read: after the restart no operation is written again, and each has one
    // job. (Before it, a write that outlived its 2 s timeout on a loaded machine was replayed
    // under its key, as the tool's recovery allows: the downstream kept one job for it.)
    let writes_after: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM downstream.requests WHERE kind = 'write' AND at >= $1",
    )
    .bind(restarted)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(writes_after, 0, "written again after the restart");
    let (jobs, keys): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT idem_key) FROM downstream.async_jobs")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!((jobs, keys), (ROWS, ROWS), "one job per operation");
    drop(second);
    cleanup(env).await;
}
