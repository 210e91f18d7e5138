//! Test harness: a fresh database per test, the real binary as a child
//! process, and a raw HTTP/1.1 client that can tell "no bytes at all" apart
//! from any response (no HTTP client crate would let us see that cleanly).
//!
//! Postgres comes from `DOWNSTREAM_TEST_PG_URL` (default
//! `postgres://postgres@127.0.0.1:5432`, trust auth). Set `DOWNSTREAM_TEST_LOG=1`
//! to see the service's logs.
#![allow(dead_code)] // each test binary uses a different subset

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::AssertSqlSafe;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

pub fn pg_base() -> String {
    std::env::var("DOWNSTREAM_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

/// A uniquely named database, created for one test.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
}

impl TestDb {
    pub async fn create() -> TestDb {
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(&format!("{}/postgres", pg_base()))
            .await
            .expect("connect to the postgres database");
        let uuid: String = sqlx::query_scalar("SELECT replace(gen_random_uuid()::text, '-', '')")
            .fetch_one(&admin)
            .await
            .unwrap();
        let name = format!("ds_test_{uuid}");
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&admin)
            .await
            .expect("create test database");
        admin.close().await;
        let url = format!("{}/{name}", pg_base());
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await
            .unwrap();
        TestDb { name, url, pool }
    }

    /// Drop the database (call after the service has been stopped).
    pub async fn drop_db(self) {
        self.pool.close().await;
        if let Ok(admin) = PgPoolOptions::new()
            .max_connections(1)
            .connect(&format!("{}/postgres", pg_base()))
            .await
        {
            let _ = sqlx::query(AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            )))
            .execute(&admin)
            .await;
            admin.close().await;
        }
    }

    /// Business changes made for one key (the contract query).
    pub async fn mutations(&self, key: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM downstream.mutations WHERE idem_key = $1")
            .bind(key)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Write requests received for one key (the contract query).
    pub async fn write_requests(&self, key: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM downstream.requests WHERE kind = 'write' AND idem_key = $1",
        )
        .bind(key)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    /// (status, fault) of every request for one key, oldest first.
    pub async fn request_log(&self, key: &str) -> Vec<(String, Option<i32>, Option<String>)> {
        sqlx::query_as(
            "SELECT kind, status, fault FROM downstream.requests WHERE idem_key = $1 ORDER BY id",
        )
        .bind(key)
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }
}

/// (kind, traceparent, tracestate) of every request for one key, oldest first.
pub async fn trace_log(db: &TestDb, key: &str) -> Vec<(String, Option<String>, Option<String>)> {
    sqlx::query_as(
        "SELECT kind, traceparent, tracestate FROM downstream.requests
         WHERE idem_key = $1 ORDER BY id",
    )
    .bind(key)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// The service as a child process.
pub struct Downstream {
    pub child: Child,
    pub port: u16,
}

impl Downstream {
    pub async fn start(db: &TestDb) -> Downstream {
        Self::start_with(db, &[]).await
    }

    pub async fn start_with(db: &TestDb, env: &[(&str, &str)]) -> Downstream {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_reference-downstream"));
        cmd.env("DOWNSTREAM_DATABASE_URL", &db.url)
            .env("DOWNSTREAM_ADDR", "127.0.0.1:0")
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        if std::env::var_os("DOWNSTREAM_TEST_LOG").is_none() {
            cmd.stderr(Stdio::null());
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn reference-downstream");
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        tokio::time::timeout(
            Duration::from_secs(20),
            BufReader::new(stdout).read_line(&mut line),
        )
        .await
        .expect("start-up line within 20 s")
        .unwrap();
        let addr = line
            .trim()
            .strip_prefix("reference-downstream listening on ")
            .unwrap_or_else(|| panic!("unexpected start-up line {line:?}"));
        let port = addr.rsplit(':').next().unwrap().parse().unwrap();
        Downstream { child, port }
    }

    /// SIGKILL: no chance to clean up, like a crash.
    pub async fn kill(mut self) {
        self.child.kill().await.unwrap();
    }

    pub async fn post(&self, path: &str, key: Option<&str>, body: &Value) -> Reply {
        self.post_with(path, key, &[], body).await
    }

    /// [`Downstream::post`] with more headers (e.g. a deadline).
    pub async fn post_with(
        &self,
        path: &str,
        key: Option<&str>,
        extra: &[(&str, &str)],
        body: &Value,
    ) -> Reply {
        let mut headers = vec![("Content-Type", "application/json")];
        if let Some(k) = key {
            headers.push(("Idempotency-Key", k));
        }
        headers.extend_from_slice(extra);
        send(
            self.port,
            "POST",
            path,
            &headers,
            body.to_string().as_bytes(),
        )
        .await
    }

    pub async fn get(&self, path: &str) -> Reply {
        send(self.port, "GET", path, &[], b"").await
    }

    /// Arm a fault through the control API.
    pub async fn arm(&self, fault: Value) {
        let reply = send(
            self.port,
            "POST",
            "/_control/faults",
            &[],
            fault.to_string().as_bytes(),
        )
        .await
        .http();
        assert_eq!(reply.status, 201, "arming {fault}: {:?}", reply.body);
    }
}

#[derive(Debug)]
pub struct HttpReply {
    pub status: u16,
    /// Lower-cased names.
    pub headers: Vec<(String, String)>,
    pub body: Value,
}

impl HttpReply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug)]
pub enum Reply {
    Http(HttpReply),
    /// The connection closed without a single byte; `reset` if it was an RST.
    NoBytes {
        reset: bool,
    },
}

impl Reply {
    pub fn http(self) -> HttpReply {
        match self {
            Reply::Http(r) => r,
            other => panic!("expected an HTTP response, got {other:?}"),
        }
    }
}

/// One raw HTTP/1.1 exchange.
pub async fn send(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Reply {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body).await.unwrap();
    let mut buf = Vec::new();
    let reset = match stream.read_to_end(&mut buf).await {
        Ok(_) => false,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => true,
        Err(e) => panic!("reading response: {e}"),
    };
    if buf.is_empty() {
        return Reply::NoBytes { reset };
    }
    parse(&buf)
}

fn parse(buf: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(buf);
    let (head, body) = text.split_once("\r\n\r\n").expect("complete head");
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .map(|l| {
            let (k, v) = l.split_once(':').unwrap();
            (k.trim().to_ascii_lowercase(), v.trim().to_owned())
        })
        .collect();
    let body = serde_json::from_str(body).unwrap_or_else(|e| panic!("body {body:?}: {e}"));
    Reply::Http(HttpReply {
        status,
        headers,
        body,
    })
}
