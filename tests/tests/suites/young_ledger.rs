//! A young ledger and the plans Postgres keeps per connection (migration 0024). A foreign-key
//! check, and the generic plan of a statement prepared on a connection, is planned once for the
//! table's size at the time and kept until the table's next vacuum or analysis. Autovacuum run on
//! a table of a few pages would leave every plan made after it a sequential scan, kept while the
//! table grows; the ledger's tables hold autovacuum off until they have seen a few thousand
//! changes, and these tests check that what is planned after autovacuum's visit to a young
//! ledger still finds rows by key once the table has grown.
//!
//! Each test runs a Postgres of its own ([`PgCluster`]) with `autovacuum_naptime = 1s`: the
//! shared one visits each database once a minute. The table grows in one transaction, so that
//! autovacuum, which counts changes only once they commit, cannot plan anew in the middle of the
//! measurement as it would a naptime later in production.

use std::time::Duration;

use e2e::tls::{PgCluster, PgClusterOptions};
use e2e::wait_for;
use sqlx::postgres::{PgPool, PgPoolOptions};
use worker::ledger::Ledger;

/// Rows written to each table while it is young: more than autovacuum's default threshold of
/// 50 changes, a few pages.
const YOUNG: i64 = 60;
/// Rows the table grows by afterwards.
const GROWN: i64 = 3000;
/// Sequential scans tolerated while the table grows (none are expected).
const SCANS: i64 = 5;

/// A migrated ledger on a Postgres of its own, with `YOUNG` rows in `operations` and in
/// `result_outbox`, after autovacuum's first visit.
struct YoungLedger {
    /// Stopped and deleted with the ledger.
    _cluster: PgCluster,
    url: String,
    /// Reads statistics; writes what the test writes outside the connection it measures.
    admin: PgPool,
    /// Autovacuum's runs on each table during the visit: `[operations, result_outbox]`, each
    /// `(analyses, vacuums)`.
    visited: [(i64, i64); 2],
}

/// Migrates a ledger with the worker's own migrations, writes `YOUNG` rows to `operations`,
/// `result_outbox` and a table with autovacuum's default settings (the witness) in one
/// transaction, and waits until autovacuum has analysed the witness and left the database:
/// it has then seen the ledger's tables with the same changes.
async fn young_ledger() -> YoungLedger {
    let cluster = PgCluster::start_with(PgClusterOptions {
        settings: &["autovacuum_naptime = 1s"],
        ..PgClusterOptions::default()
    });
    let db = cluster.create_database("ledger").await;
    let url = cluster.url("127.0.0.1", &db, "sslmode=disable");
    let ledger = Ledger::connect(&url, 1, Duration::from_secs(10))
        .await
        .expect("connect the ledger");
    ledger.migrate().await.expect("migrate the ledger");
    ledger.pool().close().await;
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .expect("connect to the test cluster");

    let young = format!(
        "BEGIN;
         CREATE TABLE witness (id bigint);
         INSERT INTO witness SELECT g FROM generate_series(1, {YOUNG}) g;
         INSERT INTO operations (tenant, action_id, tool, fingerprint, arguments)
         SELECT 'north-shop', 'young-' || g, 'refund', repeat('a', 64), '{{\"amount_cents\": 100}}'
           FROM generate_series(1, {YOUNG}) g;
         INSERT INTO result_outbox (routing_key, status, payload)
         SELECT 'results.north-shop', 'succeeded', '{{\"action_id\": \"young\"}}'
           FROM generate_series(1, {YOUNG}) g;
         COMMIT;"
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(young))
        .execute(&admin)
        .await
        .expect("write the young rows");
    wait_for(
        "autovacuum to analyse the witness and leave the database",
        Duration::from_secs(20),
        || async {
            let (analysed, busy): (i64, i64) = sqlx::query_as(
                "SELECT (SELECT autoanalyze_count FROM pg_stat_user_tables
                         WHERE relname = 'witness'),
                        (SELECT count(*) FROM pg_stat_activity
                         WHERE backend_type = 'autovacuum worker'
                           AND datname = current_database())",
            )
            .fetch_one(&admin)
            .await
            .unwrap();
            (analysed > 0 && busy == 0).then_some(())
        },
    )
    .await;
    let visited = [
        autovacuum_runs(&admin, "operations").await,
        autovacuum_runs(&admin, "result_outbox").await,
    ];
    eprintln!(
        "autovacuum's runs on the young tables (analyses, vacuums): operations {:?}, \
         result_outbox {:?}",
        visited[0], visited[1]
    );
    YoungLedger {
        _cluster: cluster,
        url,
        admin,
        visited,
    }
}

/// Autovacuum's runs on `table` so far: (analyses, vacuums).
async fn autovacuum_runs(admin: &PgPool, table: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT autoanalyze_count, autovacuum_count FROM pg_stat_user_tables WHERE relname = $1",
    )
    .bind(table)
    .fetch_one(admin)
    .await
    .unwrap()
}

/// Sequential scans of `table` so far, once the statistics count `written` (inserted, updated)
/// rows: `session` (one connection) reports what it did when it next goes idle.
async fn seq_scans(admin: &PgPool, session: &PgPool, table: &str, written: (i64, i64)) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(session)
        .await
        .unwrap();
    wait_for(
        &format!("the statistics of {table} to count {written:?} rows written"),
        Duration::from_secs(20),
        || async {
            let (ins, upd, scans): (i64, i64, i64) = sqlx::query_as(
                "SELECT n_tup_ins, n_tup_upd, seq_scan FROM pg_stat_user_tables
                 WHERE relname = $1",
            )
            .bind(table)
            .fetch_one(admin)
            .await
            .unwrap();
            ((ins, upd) == written).then_some(scans)
        },
    )
    .await
}

/// Every row born `prepared` is logged by the history triggers at its insert and at each change
/// of state, and each log row's foreign key looks its operation up: by key, on a connection
/// that made that check's plan after autovacuum's visit, while the table grows from 60 rows to
/// 3,060.
#[tokio::test]
async fn history_rows_of_a_young_ledger_check_their_operation_by_key_as_the_table_grows() {
    let y = young_ledger().await;
    let session = PgPoolOptions::new()
        .max_connections(1)
        .connect(&y.url)
        .await
        .unwrap();
    let before = seq_scans(&y.admin, &session, "operations", (YOUNG, 0)).await;
    // Each insert and each state change its own statement, so that each history row is checked
    // on its own (row triggers run at the end of their statement); the change is planned for
    // each run, so that its own plan reads by key whatever the statistics.
    let grow = format!(
        "DO $$
         DECLARE
             op bigint;
         BEGIN
             FOR g IN 1..{GROWN} LOOP
                 INSERT INTO operations (tenant, action_id, tool, fingerprint, arguments)
                 VALUES ('north-shop', 'grown-' || g, 'refund', repeat('a', 64),
                         '{{\"amount_cents\": 100}}')
                 RETURNING id INTO op;
                 EXECUTE format('UPDATE operations SET state = %L WHERE id = %s', 'held', op);
             END LOOP;
         END
         $$"
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(grow))
        .execute(&session)
        .await
        .expect("grow the table");
    let after = seq_scans(&y.admin, &session, "operations", (YOUNG + GROWN, GROWN)).await;
    let logged: i64 = sqlx::query_scalar("SELECT count(*) FROM operation_history_log")
        .fetch_one(&y.admin)
        .await
        .unwrap();
    eprintln!(
        "{} sequential scans of operations for {logged} history rows",
        after - before
    );
    assert_eq!(
        logged,
        YOUNG + 2 * GROWN,
        "every insert and change is logged"
    );
    assert!(
        after - before <= SCANS,
        "{} sequential scans of operations while it grew by {GROWN} rows and {GROWN} changes \
         (autovacuum's runs on the young table, analyses and vacuums: {:?})",
        after - before,
        y.visited[0]
    );
    assert_eq!(
        y.visited[0],
        (0, 0),
        "autovacuum left the young operations alone"
    );
}

/// The relay marks confirmed events published through a statement prepared on its connection,
/// which Postgres plans once for good after five runs: made after autovacuum's visit to a young
/// outbox, that plan still finds the events by key once the outbox has grown.
#[tokio::test]
async fn the_relay_marks_events_of_a_young_ledger_by_key_as_the_outbox_grows() {
    let y = young_ledger().await;
    let events: Vec<i64> = sqlx::query_scalar("SELECT id FROM result_outbox ORDER BY id")
        .fetch_all(&y.admin)
        .await
        .unwrap();
    let (early, late) = events.split_at(10);
    let late = &late[..30];
    let ledger = Ledger::connect(&y.url, 1, Duration::from_secs(10))
        .await
        .unwrap();
    // Ten marks while the outbox is young: the plan is made and kept.
    for &id in early {
        ledger.mark_published(&[id]).await.unwrap();
    }
    // The outbox grows in a transaction left open: its rows are on the pages a sequential scan
    // reads, and autovacuum does not count them. Forty marks in all stay under autovacuum's
    // default threshold, so that it does not analyse the outbox again meanwhile.
    let mut growth = y.admin.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO result_outbox (routing_key, status, payload)
         SELECT 'results.north-shop', 'succeeded', '{\"action_id\": \"grown\"}'
           FROM generate_series(1, $1) g",
    )
    .bind(GROWN)
    .execute(&mut *growth)
    .await
    .unwrap();
    let before = seq_scans(&y.admin, ledger.pool(), "result_outbox", (YOUNG, 10)).await;
    for &id in late {
        ledger.mark_published(&[id]).await.unwrap();
    }
    let after = seq_scans(&y.admin, ledger.pool(), "result_outbox", (YOUNG, 40)).await;
    growth.rollback().await.unwrap();
    eprintln!(
        "{} sequential scans of result_outbox for {} marks",
        after - before,
        late.len()
    );
    assert!(
        after - before <= SCANS,
        "{} sequential scans of result_outbox for {} marks once it had grown by {GROWN} rows \
         (autovacuum's runs on the young outbox, analyses and vacuums: {:?})",
        after - before,
        late.len(),
        y.visited[1]
    );
    assert_eq!(
        y.visited[1],
        (0, 0),
        "autovacuum left the young outbox alone"
    );
}
