//! The primary + standby fixture of tests/src/pg_failover.rs does what failover tests rely on:
//! a synchronous commit is on the standby (visible at once under `remote_apply`) and a commit
//! blocks while the standby is down; a promoted standby holds every acknowledged commit and
//! takes writes, and libpq's multi-host URL with `target_session_attrs=read-write` finds it; an
//! old primary whose WAL went past the failover point is rewound, rejoins as the synchronous
//! standby and a switchover makes it primary again; without `sync` the standby is `async` and
//! commits never wait. Each test runs a pair of its own; the shared Postgres is not used.
//! Timings are printed (`--no-capture` shows them).

use std::time::{Duration, Instant};

use e2e::pg_failover::{PgPair, PgPairOptions};
use e2e::wait_for;
use sqlx::{Connection, PgConnection};

const T: Duration = Duration::from_secs(30);

async fn connect(url: &str) -> PgConnection {
    PgConnection::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

/// Starts a pair (timed) with database `app` and table `t` on the primary.
async fn pair_with_table(opts: PgPairOptions) -> (PgPair, String) {
    let started = Instant::now();
    let pair = PgPair::start(opts).await;
    eprintln!("start: {} ms", started.elapsed().as_millis());
    let db = pair.create_database("app").await;
    let mut conn = connect(&pair.url(0, &db)).await;
    sqlx::query("CREATE TABLE t (v text PRIMARY KEY)")
        .execute(&mut conn)
        .await
        .expect("create table");
    conn.close().await.ok();
    (pair, db)
}

async fn insert(conn: &mut PgConnection, v: &str) {
    sqlx::query("INSERT INTO t (v) VALUES ($1)")
        .bind(v)
        .execute(conn)
        .await
        .unwrap_or_else(|e| panic!("insert {v}: {e}"));
}

/// The rows of `t` on node `i`, sorted.
async fn rows(pair: &PgPair, i: usize, db: &str) -> Vec<String> {
    let out = pair.psql_db(i, db, "SELECT v FROM t ORDER BY v").await;
    out.lines().map(str::to_string).collect()
}

fn streaming(sync: &str) -> Option<(String, String)> {
    Some(("streaming".to_string(), sync.to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_commit_is_on_the_standby_and_waits_for_it() {
    let (pair, db) = pair_with_table(PgPairOptions::default()).await;
    assert_eq!(pair.primary().await, 0);
    assert_eq!(pair.replication_state(0, 1).await, streaming("sync"));

    // remote_apply: the commit returns once the standby has replayed it.
    let mut primary = connect(&pair.url(0, &db)).await;
    sqlx::query("SET synchronous_commit = remote_apply")
        .execute(&mut primary)
        .await
        .unwrap();
    insert(&mut primary, "one").await;
    let mut standby = connect(&pair.url(1, &db)).await;
    let seen: Vec<String> = sqlx::query_scalar("SELECT v FROM t")
        .fetch_all(&mut standby)
        .await
        .unwrap();
    assert_eq!(seen, ["one"], "visible on the standby at once");
    standby.close().await.ok();

    // The standby down: a commit (synchronous_commit = on) waits on SyncRep.
    pair.stop_hard(1).await;
    let blocked_at = Instant::now();
    let mut conn = connect(&pair.url(0, &db)).await;
    let commit = tokio::spawn(async move {
        insert(&mut conn, "two").await;
        blocked_at.elapsed()
    });
    wait_for("a backend waiting on SyncRep", T, || async {
        (pair.sync_rep_waiters(0).await >= 1).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !commit.is_finished(),
        "the commit must wait for the standby"
    );

    // The standby back: the commit returns and the row is on the standby.
    let restarted = Instant::now();
    pair.start_node(1).await;
    let waited = tokio::time::timeout(T, commit)
        .await
        .expect("the commit returns once the standby is back")
        .expect("commit task");
    eprintln!(
        "standby restart: {} ms; the commit waited {} ms",
        restarted.elapsed().as_millis(),
        waited.as_millis()
    );
    pair.wait_streaming(0, 1).await;
    wait_for("row two on the standby", T, || async {
        (rows(&pair, 1, &db).await == ["one", "two"]).then_some(())
    })
    .await;
    assert_eq!(pair.sync_rep_waiters(0).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_standby_has_every_acknowledged_commit() {
    let (pair, db) = pair_with_table(PgPairOptions::default()).await;
    let mut primary = connect(&pair.url(0, &db)).await;
    insert(&mut primary, "before").await;
    drop(primary);

    let crashed = Instant::now();
    pair.stop_hard(0).await;
    assert!(!pair.is_running(0));
    let promoting = Instant::now();
    pair.promote(1).await;
    let promote = promoting.elapsed();
    assert_eq!(pair.primary().await, 1);
    assert_eq!(rows(&pair, 1, &db).await, ["before"]);

    // Writes succeed at once: the new primary waits for no standby.
    let mut new_primary = connect(&pair.url(1, &db)).await;
    tokio::time::timeout(Duration::from_secs(10), insert(&mut new_primary, "after"))
        .await
        .expect("a write on the new primary does not wait");
    eprintln!(
        "promote: {} ms; crash to first write on the new primary: {} ms",
        promote.as_millis(),
        crashed.elapsed().as_millis()
    );
    assert_eq!(rows(&pair, 1, &db).await, ["after", "before"]);

    // A fresh libpq client with both hosts finds the writable one.
    let url = pair.multi_host_url(&db, "target_session_attrs=read-write");
    let connected = Instant::now();
    let port = pair
        .psql_url(&url, "SELECT inet_server_port()")
        .await
        .expect("psql through the multi-host URL");
    eprintln!(
        "multi-host psql connected in {} ms",
        connected.elapsed().as_millis()
    );
    assert_eq!(port, pair.port(1).to_string(), "{url}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewound_old_primary_rejoins_and_switches_back() {
    let (pair, db) = pair_with_table(PgPairOptions::default()).await;
    let mut primary = connect(&pair.url(0, &db)).await;
    insert(&mut primary, "acked").await;

    // Standby down, then a commit that waits on it: in node 0's WAL, never acknowledged.
    pair.stop_hard(1).await;
    let commit = tokio::spawn(async move {
        sqlx::query("INSERT INTO t (v) VALUES ('unacked')")
            .execute(&mut primary)
            .await
    });
    wait_for(
        "the unacknowledged commit waiting on SyncRep",
        T,
        || async { (pair.sync_rep_waiters(0).await >= 1).then_some(()) },
    )
    .await;
    pair.stop_hard(0).await;
    let lost = tokio::time::timeout(T, commit).await.expect("commit task");
    assert!(
        matches!(lost, Ok(Err(_))),
        "the waiting commit was never acknowledged: {lost:?}"
    );

    // Fail over to node 1 (restarted, it has node 0's WAL up to "acked").
    pair.start_node(1).await;
    pair.promote(1).await;
    let mut new_primary = connect(&pair.url(1, &db)).await;
    insert(&mut new_primary, "after").await;
    drop(new_primary);

    // Node 0's WAL went past the failover point (the unacknowledged commit, and the
    // checkpoint of its own crash recovery, which pg_rewind runs first): it is rewound.
    let rejoining = Instant::now();
    let rewound = pair.rejoin_as_standby(0).await;
    let rejoin = rejoining.elapsed();
    assert!(rewound, "pg_rewind rewinds node 0");
    assert_eq!(pair.primary().await, 1);
    assert_eq!(pair.replication_state(1, 0).await, streaming("sync"));
    wait_for("row after on the rejoined standby", T, || async {
        (rows(&pair, 0, &db).await == ["acked", "after"]).then_some(())
    })
    .await;

    // Both up, node 0 (a standby) first in the list: libpq skips it for read-write.
    let rw = pair.multi_host_url(&db, "target_session_attrs=read-write");
    let ro = pair.multi_host_url(&db, "target_session_attrs=standby");
    let port_sql = "SELECT inet_server_port()";
    assert_eq!(
        pair.psql_url(&rw, port_sql).await,
        Ok(pair.port(1).to_string())
    );
    assert_eq!(
        pair.psql_url(&ro, port_sql).await,
        Ok(pair.port(0).to_string())
    );

    let switching = Instant::now();
    pair.switchover().await;
    let switchover = switching.elapsed();
    eprintln!(
        "rejoin with pg_rewind: {} ms; switchover: {} ms",
        rejoin.as_millis(),
        switchover.as_millis()
    );
    assert_eq!(
        pair.primary().await,
        0,
        "the original node is primary again"
    );
    assert!(pair.is_running(1));
    assert_eq!(pair.replication_state(0, 1).await, streaming("sync"));
    let mut back = connect(&pair.url(0, &db)).await;
    sqlx::query("SET synchronous_commit = remote_apply")
        .execute(&mut back)
        .await
        .unwrap();
    insert(&mut back, "switched").await;
    assert_eq!(rows(&pair, 1, &db).await, ["acked", "after", "switched"]);
    assert_eq!(
        pair.psql_url(&rw, port_sql).await,
        Ok(pair.port(0).to_string())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_sync_the_standby_is_async_and_commits_do_not_wait() {
    let (pair, db) = pair_with_table(PgPairOptions {
        sync: false,
        ..PgPairOptions::default()
    })
    .await;
    assert_eq!(pair.replication_state(0, 1).await, streaming("async"));
    pair.stop_hard(1).await;
    let mut primary = connect(&pair.url(0, &db)).await;
    tokio::time::timeout(Duration::from_secs(5), insert(&mut primary, "alone"))
        .await
        .expect("an async primary commits without its standby");
    assert_eq!(pair.sync_rep_waiters(0).await, 0);
}
