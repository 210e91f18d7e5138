//! What the processes' connections do on the wire. Every TCP connection the worker and the
//! publisher's relay open (Postgres, RabbitMQ, the downstream) sends small writes at once
//! (`TCP_NODELAY`), from its first byte. With Nagle's algorithm on, a client that writes twice
//! before reading waits for the server's delayed ACK (at least 40 ms on Linux) each time: a TLS
//! handshake to Postgres does that twice, so every new ledger connection took about 90 ms
//! instead of a few, at start-up (the whole pool, one connection after another) and after every
//! failover.

use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::sockets::{tcp_connections, TcpConnection};
use e2e::{cleanup, host_port, procs::RelayProc, Agent, Downstream, Env, Worker, WorkerOptions};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgSslMode};

const T: Duration = Duration::from_secs(20);

fn port_of(url: &str) -> u16 {
    let hp = host_port(url);
    hp.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {hp}"))
}

/// Asserts that the connections of process `pid` include one to each of `ports` and that none
/// has Nagle on. A socket seen between the end of its connect and the client's `set_nodelay`
/// right after (the task not polled yet on a loaded machine: connected, nothing written) is
/// looked at again half a second later; only one still without `TCP_NODELAY` then counts.
async fn assert_every_connection_sends_at_once(who: &str, pid: u32, ports: &[(&str, u16)]) {
    let conns = tcp_connections(pid);
    for (what, port) in ports {
        assert!(
            conns.iter().any(|c| c.peer.port() == *port),
            "{who}: no connection to {what} (port {port}) among {conns:?}"
        );
    }
    let first: Vec<TcpConnection> = conns.into_iter().filter(|c| !c.nodelay).collect();
    if first.is_empty() {
        return;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let again = tcp_connections(pid);
    let delayed: Vec<_> = first
        .iter()
        .filter(|c| {
            again
                .iter()
                .any(|a| (a.local, a.peer) == (c.local, c.peer) && !a.nodelay)
        })
        .collect();
    assert!(
        delayed.is_empty(),
        "{who}: connections with Nagle's algorithm on (TCP_NODELAY unset): {delayed:?}"
    );
}

#[tokio::test]
async fn every_connection_of_the_worker_and_the_relay_sends_small_writes_at_once() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = env.standard_tools(ds.port, "");
    let worker = Worker::start(&env, "w1", &WorkerOptions::new(tools)).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    agent
        .request(
            "north-shop",
            "nodelay-1",
            "refund",
            json!({"order": "order-731", "amount_cents": 4850, "currency": "USD"}),
        )
        .await;
    agent.succeeded("north-shop", "nodelay-1").await;
    let pg = port_of(&env.db_url);
    let amqp = port_of(&env.amqp_url);
    // The downstream's keep-alive connection may have closed by now: checked if it is there.
    assert_every_connection_sends_at_once(
        "worker",
        worker.pid(),
        &[("Postgres", pg), ("RabbitMQ", amqp)],
    )
    .await;

    publisher::Outbox::migrate(&env.pool)
        .await
        .expect("the agent's outbox");
    let relay = RelayProc::spawn(&env, "relay", &[]);
    relay.wait_output("relay running", T).await;
    assert_every_connection_sends_at_once(
        "publisher relay",
        relay.child.id(),
        &[("Postgres", pg), ("RabbitMQ", amqp)],
    )
    .await;
    drop(relay);
    drop(worker);
    cleanup(env).await;
}

/// The worker's pooled connection to a tool probes its peer when idle (`SO_KEEPALIVE`), so a
/// downstream that vanished without a word (a host gone, a NAT entry dropped) is found before a
/// write is sent into it.
#[tokio::test]
async fn the_worker_keeps_its_tool_connections_probed_when_idle() {
    let env = Env::new().await;
    // The reference downstream closes each connection; this one keeps them.
    let (port, _) = e2e::recording::downstream().await;
    let tools = env.standard_tools(port, "");
    let worker = Worker::start(&env, "w1", &WorkerOptions::new(tools)).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    agent
        .request(
            "north-shop",
            "keepalive-1",
            "deploy",
            json!({"service": "api"}),
        )
        .await;
    agent.succeeded("north-shop", "keepalive-1").await;
    let to_tool: Vec<TcpConnection> = tcp_connections(worker.pid())
        .into_iter()
        .filter(|c| c.peer.port() == port)
        .collect();
    assert!(
        !to_tool.is_empty(),
        "the pooled connection to the tool is kept"
    );
    assert!(to_tool.iter().all(|c| c.keepalive), "{to_tool:?}");
    drop(worker);
    cleanup(env).await;
}

/// The pool the worker and the publisher build (`kit::pg::pool`), over TLS (`sslmode=require`):
/// a new connection opens and is checked in a few milliseconds. Nagle's stalls put a floor of
/// 80 ms under every one (two delayed ACKs of at least 40 ms in each handshake), while a busy
/// machine only slows some: of seven new connections, at least two must open under that floor.
/// (The median against half of it failed on a slow host running four tests beside the client
/// suites: new connections took 46 ms to 580 ms there, spread, not stacked at 90 ms.)
#[tokio::test]
async fn new_ledger_connections_over_tls_open_without_waiting_for_delayed_acks() {
    let env = Env::new().await;
    let options: PgConnectOptions = env.db_url.parse().expect("TEST_DATABASE_URL");
    let options = options.ssl_mode(PgSslMode::Require);
    let hosts = Arc::new(kit::pg::Hosts::single(worker::ledger::ROLE, options, true));
    let pool = kit::pg::pool(
        hosts,
        kit::pg::PoolSettings {
            max_connections: 8,
            min_connections: 0,
            acquire_timeout: T,
            ping_if_idle_for: Duration::from_secs(1),
        },
    )
    .await
    .expect("pool");
    let mut held = Vec::new();
    let mut took = Vec::new();
    while took.len() < 7 {
        // Only acquisitions that opened a connection count (the pool may hold one already).
        let before = pool.size();
        let t0 = Instant::now();
        let mut conn = pool.acquire().await.expect("a new connection over TLS");
        if pool.size() > before {
            took.push(t0.elapsed());
        }
        let tls: bool =
            sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
                .fetch_one(&mut *conn)
                .await
                .expect("pg_stat_ssl");
        assert!(
            tls,
            "the connection is not encrypted: the server must have ssl=on"
        );
        held.push(conn);
    }
    took.sort();
    assert!(
        took[1] < Duration::from_millis(80),
        "new TLS connections took {took:?}: Nagle's algorithm holds each handshake behind the \
         server's delayed ACKs"
    );
    drop(held);
    pool.close().await;
    cleanup(env).await;
}
