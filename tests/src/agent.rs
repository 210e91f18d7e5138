//! An agent as users run one: publishes intents with confirms and reads result events from a
//! queue bound to its tenant. Also the broker clean-up of a test's names.

use std::collections::BTreeMap;
use std::time::Duration;

use lapin::options::{BasicGetOptions, ExchangeDeleteOptions, QueueDeleteOptions};
use protocol::{Intent, ResultEvent};
use publisher::{Follower, Publisher};
use serde_json::Value;

use crate::env::Env;

/// Publisher plus one follower per tenant.
pub struct Agent {
    pub publisher: Publisher,
    followers: BTreeMap<String, Follower>,
    results_exchange: String,
    amqp_url: String,
}

/// Builds an intent.
pub fn intent(tenant: &str, action_id: &str, tool: &str, arguments: Value) -> Intent {
    Intent {
        tenant: tenant.into(),
        action_id: action_id.into(),
        tool: tool.into(),
        arguments,
        call_id: Some(format!("call-{}", uuid::Uuid::new_v4().simple())),
        reply_to: Some(tenant.into()),
        compensates: None,
    }
}

impl Agent {
    /// Connects and starts following `tenants` (before publishing, so no result is missed).
    /// The worker must have declared the topology already.
    pub async fn new(env: &Env, tenants: &[&str]) -> Agent {
        let publisher = Publisher::connect(&env.amqp_url, &env.topology.intents_exchange)
            .await
            .expect("publisher connect");
        let mut followers = BTreeMap::new();
        for t in tenants {
            let f = Follower::follow(&env.amqp_url, &env.topology.results_exchange, t, None)
                .await
                .expect("follow results");
            followers.insert(t.to_string(), f);
        }
        Agent {
            publisher,
            followers,
            results_exchange: env.topology.results_exchange.clone(),
            amqp_url: env.amqp_url.clone(),
        }
    }

    /// Declares the worker's topology (as a worker would at start-up) and then connects, for
    /// tests that publish before any worker runs.
    pub async fn new_after(
        env: &Env,
        tenants: &[&str],
        opts: &crate::procs::WorkerOptions,
    ) -> Agent {
        let topology = worker::config::Topology {
            delivery_limit: opts.delivery_limit,
            queue_delivery_limit: worker::config::Topology::default_queue_delivery_limit(
                opts.delivery_limit,
            ),
            ..env.topology.clone()
        };
        let conn = worker::amqp::connect(&env.amqp_url, "e2e-setup")
            .await
            .expect("connect");
        worker::amqp::topology::declare(&conn, &topology, Default::default())
            .await
            .expect("declare topology");
        let _ = conn.close(200, "".into()).await;
        Agent::new(env, tenants).await
    }

    /// Sends a new intent (fresh call id) for `tenant`/`action_id`.
    pub async fn request(&self, tenant: &str, action_id: &str, tool: &str, arguments: Value) {
        self.send(&intent(tenant, action_id, tool, arguments)).await;
    }

    /// Waits for the `succeeded` result of `action_id` (30 s) and returns it.
    pub async fn succeeded(&mut self, tenant: &str, action_id: &str) -> ResultEvent {
        self.until(
            tenant,
            action_id,
            protocol::Status::Succeeded,
            Duration::from_secs(30),
        )
        .await
        .pop()
        .expect("until returns the matching event last")
    }

    pub async fn send(&self, intent: &Intent) {
        self.publisher
            .publish(intent)
            .await
            .expect("publish intent");
    }

    /// Sends a body as-is under a key (for reordered JSON).
    pub async fn send_encoded(&self, tenant: &str, action_id: &str, body: &str) {
        self.publisher
            .publish_encoded(tenant, action_id, body.as_bytes())
            .await
            .expect("publish encoded");
    }

    pub async fn send_raw(&self, routing_key: &str, body: &[u8]) {
        self.publisher
            .publish_raw(routing_key, body, Some("application/json"))
            .await
            .expect("publish raw");
    }

    /// Next result for `tenant`, panicking after `timeout`.
    pub async fn next(&mut self, tenant: &str, timeout: Duration) -> ResultEvent {
        self.try_next(tenant, timeout)
            .await
            .unwrap_or_else(|| panic!("no result for tenant {tenant} within {timeout:?}"))
    }

    pub async fn try_next(&mut self, tenant: &str, timeout: Duration) -> Option<ResultEvent> {
        let f = self.followers.get_mut(tenant).expect("tenant not followed");
        f.next(timeout).await.expect("read result")
    }

    /// Reads results for `tenant` until one about `action_id` has `status` (others about the
    /// same action are returned too, in order).
    pub async fn until(
        &mut self,
        tenant: &str,
        action_id: &str,
        status: protocol::Status,
        timeout: Duration,
    ) -> Vec<ResultEvent> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let Some(ev) = self.try_next(tenant, left).await else {
                panic!("no {status:?} result for {tenant}/{action_id} within {timeout:?}; saw {seen:?}");
            };
            if ev.action_id == action_id {
                let done = ev.status == status;
                seen.push(ev);
                if done {
                    return seen;
                }
            }
        }
    }

    /// Messages now in the test's dead-letter queue (drained).
    pub async fn drain_dead_letters(&self, env: &Env) -> Vec<lapin::message::BasicGetMessage> {
        let conn = lapin::Connection::connect(&self.amqp_url, Default::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        let mut out = Vec::new();
        while let Ok(Some(m)) = ch
            .basic_get(
                env.topology.dead_letter_queue.as_str().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
        {
            out.push(m);
        }
        let _ = conn.close(200, "".into()).await;
        let _ = &self.results_exchange;
        out
    }
}

/// Deletes a test's queues and exchanges and drops its database (best effort). A test that
/// panics before calling this is cleaned up by `Env`'s `Drop`.
pub async fn cleanup(mut env: Env) {
    env.cleaned = true;
    env.pool.close().await;
    remove_test_objects(
        env.id.clone(),
        env.amqp_url.clone(),
        env.topology.clone(),
        env.db_name.clone(),
        env.dir.clone(),
    )
    .await;
}

pub(crate) async fn remove_test_objects(
    id: String,
    amqp_url: String,
    t: crate::env::Topology,
    db_name: String,
    dir: std::path::PathBuf,
) {
    // A worker still running would see its queue go, reconnect and declare it again (the
    // reconnect logic), leaving the queue behind: stop the test's workers first.
    kill_workers_of(&id);
    if let Ok(conn) = lapin::Connection::connect(&amqp_url, Default::default()).await {
        if let Ok(ch) = conn.create_channel().await {
            for q in [&t.intents_queue, &t.dead_letter_queue] {
                let _ = ch
                    .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
            for x in [
                &t.intents_exchange,
                &t.results_exchange,
                &t.dead_letter_exchange,
            ] {
                let _ = ch
                    .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
                    .await;
            }
        }
        let _ = conn.close(200, "".into()).await;
    }
    if let Ok(admin) = sqlx::PgPool::connect(&crate::env::pg_admin_url()).await {
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {db_name} WITH (FORCE)"
        )))
        .execute(&admin)
        .await;
        admin.close().await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGKILLs every worker of test `id` still running (`WORKER_ID` is `<name>-<id>`, see
/// `Worker::spawn`; ids are unique per test, so neither another test's worker nor a stranger
/// that reused a pid is hit).
fn kill_workers_of(id: &str) {
    let suffix = format!("-{id}");
    for pid in crate::procs::all_pids() {
        let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let ours = environ.split(|&b| b == 0).any(|var| {
            var.strip_prefix(b"WORKER_ID=")
                .is_some_and(|v| v.ends_with(suffix.as_bytes()))
        });
        if ours {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}
