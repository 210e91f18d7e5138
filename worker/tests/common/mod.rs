//! Shared helpers for the worker's integration tests: a fresh Postgres database per test, the
//! ledger migrated into it, a tool set that needs no downstream, operations driven into held or
//! unknown through the real ledger API, and the admin API on an ephemeral port.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use worker::adapter::ToolSet;
use worker::config::Tools;
use worker::context::Context;
use worker::ledger::{
    Applied, Completion, Ledger, NewOperation, Operation, Phase, Source, State, Transition,
};
use worker::ops::api::AdminApi;

pub const ADMIN_TOKEN: &str = "admin-token-0123456789";
pub const NORTH_TOKEN: &str = "north-token-abcdef";
pub const SOUTH_TOKEN: &str = "south-token-abcdef";
pub const WORKER_ID: &str = "test-worker";

/// Two tools without recovery (no downstream is ever called); receipts must echo the key.
pub const TOOLS: &str = r#"
[tools.refund]
url = "http://127.0.0.1:9/refunds"
receipt_id = "/receipt_id"
receipt_match = { "/idempotency_key" = "{tenant}:{action_id}" }
recovery = "none"
recovery_attempts = 3

[tools.ticket]
url = "http://127.0.0.1:9/tickets"
receipt_id = "/receipt_id"
receipt_match = { "/idempotency_key" = "{tenant}:{action_id}" }
recovery = "none"
"#;

fn server_url() -> String {
    std::env::var("WORKER_TEST_PG").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
}

/// A database of its own, migrated.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub ledger: Ledger,
}

impl TestDb {
    pub async fn new() -> TestDb {
        let name = format!("worker_ops_{}", uuid::Uuid::new_v4().simple());
        let admin = admin_pool().await;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&admin)
            .await
            .expect("create test database");
        admin.close().await;
        let url = kit::url::with_database(&server_url(), &name);
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect(&url)
            .await
            .expect("connect to test database");
        let ledger = Ledger::from_pool(pool);
        ledger.migrate().await.expect("migrate");
        TestDb { name, url, ledger }
    }

    pub fn pool(&self) -> &PgPool {
        self.ledger.pool()
    }

    /// Best-effort drop.
    pub async fn drop_db(self) {
        self.ledger.pool().close().await;
        let admin = admin_pool().await;
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
            self.name
        )))
        .execute(&admin)
        .await;
        admin.close().await;
    }
}

async fn admin_pool() -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .connect(&kit::url::with_database(&server_url(), "postgres"))
        .await
        .expect("connect to the postgres database (set WORKER_TEST_PG)")
}

pub fn tool_set() -> ToolSet {
    let tools = Tools::parse(Path::new("tools.toml"), TOOLS).expect("tools parse");
    ToolSet::from_config(&tools, &worker::tls::Trust::system()).expect("tool set")
}

pub fn context(db: &TestDb) -> Arc<Context> {
    Context::new(
        db.ledger.clone(),
        tool_set(),
        WORKER_ID.to_string(),
        Duration::from_secs(30),
        Duration::from_secs(600),
        16,
        Duration::from_millis(5),
    )
}

/// Records an intent and claims it: the row is `dispatching` at its fence.
pub async fn dispatching(ctx: &Context, tenant: &str, action_id: &str, tool: &str) -> Operation {
    let admitted = ctx
        .ledger
        .admit(
            &[new_operation(tenant, action_id, tool)],
            WORKER_ID,
            Duration::from_secs(3600),
        )
        .await
        .expect("admit");
    assert!(admitted[0].inserted, "fresh key");
    let claimed = ctx
        .ledger
        .claim_prepared(
            &[admitted[0].operation.id],
            WORKER_ID,
            Duration::from_secs(30),
            &ctx.windows,
        )
        .await
        .expect("claim");
    claimed.into_iter().next().expect("claimed")
}

pub fn new_operation(tenant: &str, action_id: &str, tool: &str) -> NewOperation {
    NewOperation {
        tenant: tenant.to_string(),
        action_id: action_id.to_string(),
        tool: tool.to_string(),
        fingerprint: format!("fp-{tenant}-{action_id}"),
        arguments: format!(r#"{{"amount_cents":4850,"order":"{action_id}"}}"#),
        call_id: Some("model-call-1".into()),
        reply_to: Some(tenant.to_string()),
        trace: None,
        compensates: None,
    }
}

async fn complete(ctx: &Context, op: &Operation, transition: Transition) -> Operation {
    match ctx
        .completions
        .complete(Completion {
            operation_id: op.id,
            fence: op.fence,
            phase: Phase::Dispatch,
            by: Source::Dispatch,
            transition,
            trace: None,
            dispatched: Some(Box::new(op.clone())),
        })
        .await
        .0
        .expect("complete")
    {
        Applied::Done(op) => op,
        other => panic!("completion not applied: {other:?}"),
    }
}

/// An operation whose outcome is unknown (recovery not due for an hour).
pub async fn unknown(ctx: &Context, tenant: &str, action_id: &str, tool: &str) -> Operation {
    let op = dispatching(ctx, tenant, action_id, tool).await;
    let op = complete(
        ctx,
        &op,
        Transition::Unknown {
            delay: Duration::from_secs(3600),
            evidence: "timed out after the request may have been written".into(),
        },
    )
    .await;
    assert_eq!(op.state(), State::Unknown);
    op
}

/// An operation held for a person.
pub async fn held(ctx: &Context, tenant: &str, action_id: &str, tool: &str) -> Operation {
    let op = dispatching(ctx, tenant, action_id, tool).await;
    let op = complete(
        ctx,
        &op,
        Transition::Held {
            evidence: "the downstream offers no replay or lookup; a person must reconcile".into(),
        },
    )
    .await;
    assert_eq!(op.state(), State::Held);
    op
}

/// An operation that succeeded with a matching receipt.
pub async fn succeeded(ctx: &Context, tenant: &str, action_id: &str, tool: &str) -> Operation {
    let op = dispatching(ctx, tenant, action_id, tool).await;
    let op = complete(
        ctx,
        &op,
        Transition::Succeeded {
            receipt: worker::document::Document::from_value(receipt_for(
                tenant, action_id, "r-auto",
            )),
            receipt_id: "r-auto".into(),
            evidence: "receipt r-auto from write attempt 1".into(),
        },
    )
    .await;
    assert_eq!(op.state(), State::Succeeded);
    op
}

pub fn receipt_for(tenant: &str, action_id: &str, id: &str) -> serde_json::Value {
    serde_json::json!({
        "receipt_id": id,
        "idempotency_key": format!("{tenant}:{action_id}"),
        "amount_cents": 4850,
    })
}

/// The admin API on 127.0.0.1 with an ephemeral port; stopped when dropped.
pub struct Api {
    pub addr: SocketAddr,
    pub client: reqwest::Client,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Drop for Api {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn start_api(ctx: Arc<Context>) -> Api {
    let tenants = BTreeMap::from([
        ("north".to_string(), NORTH_TOKEN.to_string()),
        ("south".to_string(), SOUTH_TOKEN.to_string()),
    ]);
    let api = AdminApi::new(ctx, ADMIN_TOKEN.to_string(), tenants);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let task = tokio::spawn(api.serve_listener(listener, std::future::pending()));
    Api {
        addr,
        client: {
            worker::tls::install_default_provider();
            reqwest::Client::new()
        },
        task,
    }
}

/// A status code and the JSON body (Null when empty or not JSON).
pub struct Reply {
    pub status: u16,
    pub body: serde_json::Value,
}

impl Api {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub async fn get(&self, path: &str, token: Option<&str>) -> Reply {
        let mut req = self.client.get(self.url(path));
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        reply(req.send().await.expect("request")).await
    }

    pub async fn post(&self, path: &str, token: Option<&str>, body: &serde_json::Value) -> Reply {
        let mut req = self
            .client
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(serde_json::to_vec(body).unwrap());
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        reply(req.send().await.expect("request")).await
    }
}

async fn reply(resp: reqwest::Response) -> Reply {
    let status = resp.status().as_u16();
    let bytes = resp.bytes().await.expect("body");
    Reply {
        status,
        body: serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    }
}

/// Result events in the outbox for an operation: (status, payload), oldest first.
pub async fn outbox_events(pool: &PgPool, operation_id: i64) -> Vec<(String, serde_json::Value)> {
    sqlx::query_as("SELECT status, payload FROM result_outbox WHERE operation_id = $1 ORDER BY id")
        .bind(operation_id)
        .fetch_all(pool)
        .await
        .expect("outbox")
}
