//! What the trace context suites share: broker and database names of their own, a queue that
//! catches what a test exchange receives (with its headers), a fresh agent database, and a
//! stand-in OTLP/HTTP collector that keeps what it is sent. Against the real RabbitMQ at
//! 127.0.0.1:5672 and Postgres at 127.0.0.1:5432, or `TEST_AMQP_URL` / `TEST_DATABASE_URL`.

#![allow(dead_code)] // each suite uses its own part

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::{
    options::{
        BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
        QueueDeclareOptions,
    },
    types::{AMQPValue, FieldTable},
    Channel, Connection, ConnectionProperties, ExchangeKind,
};
use sqlx::AssertSqlSafe;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// The specification's example context, and a second one of another trace.
pub const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
pub const OTHER: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

pub fn amqp_url() -> String {
    std::env::var("TEST_AMQP_URL")
        .or_else(|_| std::env::var("AMQP_URL"))
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

pub fn pg_admin_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A name no other test run uses: process id plus a nanosecond timestamp.
pub fn unique(what: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos();
    format!("publisher-test-{what}-{}-{nanos}", std::process::id())
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn intent(tenant: &str, action_id: &str) -> protocol::Intent {
    protocol::Intent {
        tenant: tenant.into(),
        action_id: action_id.into(),
        tool: "refund".into(),
        arguments: serde_json::json!({"order": "order-731", "amount_cents": 4850}),
        call_id: None,
        reply_to: None,
        compensates: None,
    }
}

/// An exclusive queue bound to `exchange` with `key` (a tenant, as the worker's queue would be,
/// or `#` for everything); the connection is returned to keep the queue alive.
pub async fn bound_queue(exchange: &str, key: &str) -> (Connection, Channel, lapin::Queue) {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    let queue = bind_exclusive(&channel, exchange, key).await;
    (connection, channel, queue)
}

/// An exclusive, auto-deleted queue declared on `channel` and bound to `exchange` with `key`.
async fn bind_exclusive(channel: &Channel, exchange: &str, key: &str) -> lapin::Queue {
    let queue = channel
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("queue");
    channel
        .queue_bind(
            queue.name().clone(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind");
    queue
}

/// One message as the catcher got it.
#[derive(Debug)]
pub struct Caught {
    pub message_id: Option<String>,
    /// The string-valued headers (AMQP long strings).
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
}

impl Caught {
    pub fn traceparent(&self) -> Option<&str> {
        self.headers.get("traceparent").map(String::as_str)
    }
    pub fn tracestate(&self) -> Option<&str> {
        self.headers.get("tracestate").map(String::as_str)
    }
}

/// A durable topic exchange of the test's own and an exclusive queue bound to it for every
/// routing key.
pub struct Catcher {
    pub exchange: String,
    connection: Connection,
    channel: Channel,
    queue: String,
}

impl Catcher {
    pub async fn new(what: &str) -> Catcher {
        let exchange = unique(what);
        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .expect("connect to RabbitMQ");
        let channel = connection.create_channel().await.expect("channel");
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare exchange");
        let queue = bind_exclusive(&channel, &exchange, "#")
            .await
            .name()
            .as_str()
            .to_owned();
        Catcher {
            exchange,
            connection,
            channel,
            queue,
        }
    }

    /// The next message, waiting up to 10 s for one.
    pub async fn next(&self) -> Caught {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let got = self
                .channel
                .basic_get(self.queue.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .expect("basic.get");
            if let Some(message) = got {
                let properties = &message.delivery.properties;
                let mut headers = BTreeMap::new();
                if let Some(table) = properties.headers() {
                    for (name, value) in table {
                        if let AMQPValue::LongString(s) = value {
                            headers.insert(
                                name.to_string(),
                                String::from_utf8_lossy(s.as_bytes()).into_owned(),
                            );
                        }
                    }
                }
                return Caught {
                    message_id: properties.message_id().as_ref().map(|s| s.to_string()),
                    headers,
                    body: message.delivery.data.clone(),
                };
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no message reached exchange {}",
                self.exchange
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The next `n` messages by message id.
    pub async fn take(&self, n: usize) -> BTreeMap<String, Caught> {
        let mut out = BTreeMap::new();
        for _ in 0..n {
            let caught = self.next().await;
            out.insert(caught.message_id.clone().expect("a message id"), caught);
        }
        out
    }

    /// Whether nothing more is queued.
    pub async fn is_empty(&self) -> bool {
        self.channel
            .basic_get(self.queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .expect("basic.get")
            .is_none()
    }

    /// Deletes another exchange a test made (e.g. a results exchange).
    pub async fn delete_exchange(name: &str) {
        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .expect("connect for clean-up");
        let channel = connection.create_channel().await.expect("channel");
        channel
            .exchange_delete(name.into(), ExchangeDeleteOptions::default())
            .await
            .ok();
        connection.close(200, "OK".into()).await.ok();
    }

    pub async fn delete(self) {
        self.channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await
            .ok();
        self.connection.close(200, "OK".into()).await.ok();
    }
}

/// A fresh database of the test's own (the agent's), dropped by [`TestDb::drop_db`].
pub struct TestDb {
    pub url: String,
    pub pool: sqlx::PgPool,
    name: String,
}

impl TestDb {
    pub async fn new() -> TestDb {
        let admin = pg_admin_url();
        let admin_pool = sqlx::PgPool::connect(&admin).await.unwrap_or_else(|e| {
            panic!("cannot reach Postgres at {admin}: {e} (start it, or set TEST_DATABASE_URL)")
        });
        let name = unique("db").replace('-', "_");
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&admin_pool)
            .await
            .expect("create test database");
        admin_pool.close().await;
        let url = kit::url::with_database(&admin, &name);
        let pool = sqlx::PgPool::connect(&url).await.expect("connect test db");
        TestDb { url, pool, name }
    }

    pub async fn drop_db(self) {
        self.pool.close().await;
        let admin_pool = sqlx::PgPool::connect(&pg_admin_url()).await.expect("admin");
        sqlx::query(AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .execute(&admin_pool)
        .await
        .ok();
        admin_pool.close().await;
    }
}

/// The requests a [`Collector`] received: path and body.
pub type Requests = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// A stand-in OTLP/HTTP collector on 127.0.0.1: answers every POST 200 with an empty
/// protobuf body (a valid `ExportTraceServiceResponse`) and keeps each request's path and body.
pub struct Collector {
    pub port: u16,
    pub received: Requests,
    task: tokio::task::JoinHandle<()>,
}

impl Collector {
    pub async fn start() -> Collector {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let received = Requests::default();
        let kept = received.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                let kept = kept.clone();
                tokio::spawn(async move {
                    while let Some((path, body)) = read_request(&mut stream).await {
                        kept.lock().unwrap().push((path, body));
                        let reply = "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                        if stream.write_all(reply.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Collector {
            port,
            received,
            task,
        }
    }

    /// `OTEL_EXPORTER_OTLP_ENDPOINT` for a process that exports here.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every body posted to `/v1/traces` so far, concatenated.
    pub fn traces(&self) -> Vec<u8> {
        self.received
            .lock()
            .unwrap()
            .iter()
            .filter(|(path, _)| path == "/v1/traces")
            .flat_map(|(_, body)| body.clone())
            .collect()
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One HTTP/1.1 request with a `content-length` body: its path and body.
async fn read_request(stream: &mut tokio::net::TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let path = head.split_whitespace().nth(1)?.to_string();
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    let mut body = buf[head_end..].to_vec();
    while body.len() < length {
        let mut chunk = vec![0u8; length - body.len()];
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Some((path, body))
}

/// Whether `haystack` contains `needle` (a span name inside an OTLP protobuf body).
pub fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}
