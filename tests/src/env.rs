//! One test's world: a fresh database, unique exchange and queue names, a tools file.

use std::path::PathBuf;

use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::AssertSqlSafe;

/// Postgres server URL for tests (scripts/test.sh sets it).
pub fn pg_admin_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

pub fn amqp_url() -> String {
    std::env::var("TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// Broker names unique to one test (the worker's own type; limits are per worker, see
/// `WorkerOptions`).
pub use worker::config::Topology;

/// A test's database, names and scratch directory.
pub struct Env {
    pub id: String,
    pub db_name: String,
    pub db_url: String,
    pub pool: PgPool,
    pub amqp_url: String,
    pub topology: Topology,
    pub dir: PathBuf,
    /// Set by `cleanup`; otherwise `Drop` removes the test's objects.
    pub(crate) cleaned: bool,
}

impl Drop for Env {
    fn drop(&mut self) {
        if self.cleaned {
            return;
        }
        // A failed test: clean up on a thread with its own runtime (this one may be unwinding).
        let (id, url, t, db, dir) = (
            self.id.clone(),
            self.amqp_url.clone(),
            self.topology.clone(),
            self.db_name.clone(),
            self.dir.clone(),
        );
        let _ = std::thread::spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                rt.block_on(crate::agent::remove_test_objects(id, url, t, db, dir));
            }
        })
        .join();
    }
}

impl Env {
    pub async fn new() -> Env {
        Env::on(pg_admin_url()).await
    }

    /// [`Env::new`] on the Postgres server `admin` names: the test's database is reached with
    /// the same user, hosts and parameters (`sslmode`, `application_name`, ...).
    pub async fn on(admin: String) -> Env {
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
        let admin_pool = PgPoolOptions::new()
            .max_connections(1)
            .connect(&admin)
            .await
            .unwrap_or_else(|e| {
                panic!("cannot reach Postgres at {admin}: {e} (start it, or set TEST_DATABASE_URL)")
            });
        let db_name = format!("e2e_{id}");
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {db_name}")))
            .execute(&admin_pool)
            .await
            .expect("create test database");
        admin_pool.close().await;
        let db_url = kit::url::with_database(&admin, &db_name);
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect(&db_url)
            .await
            .expect("connect test db");
        let p = format!("t{id}");
        let topology = Topology {
            intents_exchange: format!("{p}.intents"),
            intents_queue: format!("{p}.intents"),
            results_exchange: format!("{p}.results"),
            dead_letter_exchange: format!("{p}.dlx"),
            dead_letter_queue: format!("{p}.dead"),
            delivery_limit: 5,
            queue_delivery_limit: Topology::default_queue_delivery_limit(5),
        };
        let dir = std::env::temp_dir().join(format!("intent-e2e-{id}"));
        std::fs::create_dir_all(&dir).unwrap();
        Env {
            id,
            db_name,
            db_url,
            pool,
            amqp_url: amqp_url(),
            topology,
            dir,
            cleaned: false,
        }
    }

    /// Writes a tools file and returns its path.
    pub fn write_tools(&self, toml: &str) -> PathBuf {
        let path = self.dir.join("tools.toml");
        std::fs::write(&path, toml).unwrap();
        path
    }

    /// The standard three tools (replay `refund`, lookup `ticket`, none `deploy`) against a
    /// downstream at `port`. `extra` is appended to every tool table.
    pub fn standard_tools(&self, port: u16, extra: &str) -> PathBuf {
        self.standard_tools_timed(port, 2000, extra)
    }

    /// [`Env::standard_tools`] with another request timeout (a roomier one for tests on a
    /// loaded machine, whose subject is not a timeout; the worker's lease must exceed it).
    pub fn standard_tools_timed(&self, port: u16, timeout_ms: u64, extra: &str) -> PathBuf {
        let base = format!("http://127.0.0.1:{port}");
        let common = format!(
            "receipt_id = \"/receipt_id\"\nreceipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\ntimeout_ms = {timeout_ms}\nrecovery_attempts = 3\nretry = {{ initial_delay_ms = 100, max_delay_ms = 1000 }}\n{extra}\n"
        );
        self.write_tools(&format!(
            "[tools.refund]\nurl = \"{base}/replay/refunds\"\nrecovery = \"replay\"\nreplay_window_secs = 3600\nreplay_safety_margin_secs = 60\n{common}\n\
             [tools.ticket]\nurl = \"{base}/lookup/tickets\"\nrecovery = \"lookup\"\nlookup_url = \"{base}/lookup/tickets/by-key/{{key}}\"\n{common}\n\
             [tools.deploy]\nurl = \"{base}/none/deploys\"\nrecovery = \"none\"\n{common}\n"
        ))
    }

    /// Writes a tools file of one long-running tool: [`async_tool`]`("deploy", port,
    /// "deployments", poll, extra)`.
    pub fn async_tools(&self, port: u16, poll: (u64, u64, u64), extra: &str) -> PathBuf {
        self.write_tools(&async_tool("deploy", port, "deployments", poll, extra))
    }

    /// One operation's row: (state, receipt, attempts, fence).
    pub async fn operation(&self, tenant: &str, action_id: &str) -> Option<OpRow> {
        sqlx::query_as(
            "SELECT state, receipt, attempts, fence, fingerprint, recovery_attempts, evidence
             FROM operations WHERE tenant = $1 AND action_id = $2",
        )
        .bind(tenant)
        .bind(action_id)
        .fetch_optional(&self.pool)
        .await
        // Before the first worker migrated, there is no ledger yet: nothing recorded.
        .unwrap_or(None)
    }

    /// State of an operation, or "" when absent.
    /// Waits until the operation is final or held (`succeeded`, `failed` or `held`) and returns
    /// that state; panics after `timeout`.
    pub async fn final_state(
        &self,
        tenant: &str,
        action_id: &str,
        timeout: std::time::Duration,
    ) -> String {
        crate::wait_for(
            &format!("{tenant}/{action_id} to settle"),
            timeout,
            || async {
                let s = self.state(tenant, action_id).await;
                matches!(s.as_str(), "succeeded" | "failed" | "held").then_some(s)
            },
        )
        .await
    }

    /// An operation's history, oldest first: each change's new state and its evidence.
    pub async fn history(&self, tenant: &str, action_id: &str) -> Vec<(String, Option<String>)> {
        sqlx::query_as(
            "SELECT h.to_state, h.evidence FROM operation_history h
             JOIN operations o ON o.id = h.operation_id
             WHERE o.tenant = $1 AND o.action_id = $2 ORDER BY h.id",
        )
        .bind(tenant)
        .bind(action_id)
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }

    pub async fn state(&self, tenant: &str, action_id: &str) -> String {
        self.operation(tenant, action_id)
            .await
            .map(|o| o.state)
            .unwrap_or_default()
    }

    /// Downstream business changes for a key.
    pub async fn mutations(&self, key: &str) -> i64 {
        self.count(
            "SELECT count(*) FROM downstream.mutations WHERE idem_key = $1",
            key,
        )
        .await
    }

    /// Write requests the downstream received for a key (every one, dropped ones included).
    pub async fn writes(&self, key: &str) -> i64 {
        self.count(
            "SELECT count(*) FROM downstream.requests WHERE kind = 'write' AND idem_key = $1",
            key,
        )
        .await
    }

    /// Jobs the downstream's async mode created for a key (a long-running write: never more
    /// than one per key).
    pub async fn async_jobs(&self, key: &str) -> i64 {
        self.count(
            "SELECT count(*) FROM downstream.async_jobs WHERE idem_key = $1",
            key,
        )
        .await
    }

    /// Status reads (polls) of the async job of a key.
    pub async fn status_reads(&self, key: &str) -> i64 {
        self.count(
            "SELECT count(*) FROM downstream.requests WHERE kind = 'status' AND idem_key = $1",
            key,
        )
        .await
    }

    pub async fn lookups(&self, key: &str) -> i64 {
        self.count(
            "SELECT count(*) FROM downstream.requests WHERE kind = 'lookup' AND idem_key = $1",
            key,
        )
        .await
    }

    /// The `traceparent` header each write request (send) for a key carried, in arrival
    /// order; `None` for a send without one.
    pub async fn traceparents_for(&self, key: &str) -> Vec<Option<String>> {
        self.trace_contexts(key)
            .await
            .into_iter()
            .filter(|r| r.kind == "write")
            .map(|r| r.traceparent)
            .collect()
    }

    /// The trace context headers of every request (writes and lookups) the downstream got for
    /// a key, in arrival order.
    pub async fn trace_contexts(&self, key: &str) -> Vec<SeenTraceContext> {
        match sqlx::query_as(
            "SELECT kind, traceparent, tracestate FROM downstream.requests
             WHERE idem_key = $1 ORDER BY id",
        )
        .bind(key)
        .fetch_all(&self.pool)
        .await
        {
            Ok(rows) => rows,
            // Before the downstream created its schema, nothing was received; any other error
            // (a downstream binary without these columns) must not read as "no trace context".
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => Vec::new(),
            Err(e) => panic!("reading the downstream's request log for {key:?}: {e}"),
        }
    }

    /// The receipt the downstream stored for a key's first mutation.
    pub async fn downstream_receipt(&self, key: &str) -> Option<serde_json::Value> {
        sqlx::query_scalar(
            "SELECT receipt FROM downstream.mutations WHERE idem_key = $1 ORDER BY id LIMIT 1",
        )
        .bind(key)
        .fetch_optional(&self.pool)
        .await
        .unwrap_or(None)
    }

    async fn count(&self, sql: &'static str, key: &str) -> i64 {
        // The downstream creates its schema at start-up; before that nothing was counted.
        sqlx::query_scalar(sql)
            .bind(key)
            .fetch_one(&self.pool)
            .await
            .unwrap_or(0)
    }

    /// Result events recorded in the outbox for an operation key, oldest first.
    pub async fn outbox_statuses(&self, tenant: &str, action_id: &str) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT status FROM result_outbox
             WHERE payload->>'tenant' = $1 AND payload->>'action_id' = $2 ORDER BY id",
        )
        .bind(tenant)
        .bind(action_id)
        .fetch_all(&self.pool)
        .await
        .unwrap_or_default()
    }
}

kit::pg_row! {
    /// The trace context headers one request to the downstream carried (`downstream.requests`).
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct SeenTraceContext {
        /// `write` or `lookup`.
        pub kind: String,
        pub traceparent: Option<String>,
        pub tracestate: Option<String>,
    }
}

kit::pg_row! {
    /// A row of `operations`, as tests read it.
    #[derive(Debug, Clone)]
    pub struct OpRow {
        pub state: String,
        pub receipt: Option<serde_json::Value>,
        pub attempts: i32,
        pub fence: i64,
        pub fingerprint: String,
        pub recovery_attempts: i32,
        pub evidence: Option<String>,
    }
}

/// The tools-file entry of a long-running tool `name` against the reference downstream's async
/// jobs at `port` (`POST /async/<resource>`, its status read by operation id, done or failed by
/// `/state`, the final document's `/deployment_id` as the receipt id, echoing the action key),
/// polled per `poll` = (`first_ms`, `max_ms`, `deadline_secs`), recovered by replay, with
/// `extra` lines (other keys of the same table) appended.
pub fn async_tool(
    name: &str,
    port: u16,
    resource: &str,
    (first_ms, max_ms, deadline_secs): (u64, u64, u64),
    extra: &str,
) -> String {
    format!(
        "[tools.{name}]\n\
         url = \"http://127.0.0.1:{port}/async/{resource}\"\n\
         completion = \"async\"\n\
         operation_id = \"/operation_id\"\n\
         status_url = \"http://127.0.0.1:{port}/async/operations/{{operation_id}}\"\n\
         done_match = {{ \"/state\" = \"succeeded\" }}\n\
         failed_match = {{ \"/state\" = \"failed\" }}\n\
         receipt_id = \"/deployment_id\"\n\
         receipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\n\
         poll = {{ first_ms = {first_ms}, max_ms = {max_ms}, deadline_secs = {deadline_secs} }}\n\
         recovery = \"replay\"\n\
         replay_window_secs = 3600\n\
         timeout_ms = 2000\n\
         {extra}\n"
    )
}
