//! TLS to all three kinds of peer, with real handshakes on this machine. A CA
//! and server certificates are made per test (rcgen); RabbitMQ is reached as `amqps://` through
//! a TLS-terminating forwarder in front of the local broker; the ledger lives in a Postgres
//! cluster of the test's own with `ssl = on`; an HTTPS tool is the reference downstream behind
//! a TLS forwarder. Each trust failure (unknown issuer, name mismatch) must stop start-up at
//! once naming the connection and the reason, or, for a tool, be recorded as not sent.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use e2e::tls::{amqps_url, broker_addr, exit_within, PgCluster, TestCa, TlsForwarder};
use e2e::{cleanup, Agent, Downstream, Env, Worker, WorkerOptions};
use protocol::Status;
use serde_json::json;

const T: Duration = Duration::from_secs(30);
/// A certificate error is not an outage: the worker must stop well before any retry budget.
const FAST_EXIT: Duration = Duration::from_secs(15);

/// Runs `publisher send --wait` with `envs`; (exit code, stderr). Async: the TLS forwarder
/// runs on this test's runtime and must keep forwarding meanwhile.
async fn publisher_send(env: &Env, action_id: &str, envs: &[(&str, &str)]) -> (i32, String) {
    let bin = e2e::procs::bin_dir().join("publisher");
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args([
        "send",
        "--tenant",
        "north-shop",
        "--action-id",
        action_id,
        "--tool",
        "refund",
        "--args",
        r#"{"order":"o-tls","amount_cents":100}"#,
        "--wait",
        "--timeout",
        "30s",
    ])
    .env_clear()
    .env("RUST_LOG", "warn")
    .env("INTENTS_EXCHANGE", &env.topology.intents_exchange)
    .env("RESULTS_EXCHANGE", &env.topology.results_exchange)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = tokio::time::timeout(T * 2, cmd.output())
        .await
        .expect("publisher send finished")
        .expect("run publisher");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

#[tokio::test]
async fn worker_and_publisher_speak_amqps_with_the_extra_ca() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let ca = TestCa::new("e2e amqps CA");
    let ca_file = ca.write(&env.dir, "ca.pem");
    let fwd = TlsForwarder::start(&ca.server_cert(&["localhost"]), broker_addr()).await;
    let url = amqps_url(&env.amqp_url, "localhost", fwd.port);
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .amqp_url(&url)
        .env("WORKER_CA_FILE", path_str(&ca_file));
    let _w = Worker::start(&env, "w1", &opts).await;

    let (code, stderr) = publisher_send(
        &env,
        "refund-tls-1",
        &[
            ("AMQP_URL", url.as_str()),
            ("PUBLISHER_CA_FILE", path_str(&ca_file)),
        ],
    )
    .await;
    assert_eq!(code, 0, "publisher send over amqps: {stderr}");
    assert_eq!(env.mutations("north-shop:refund-tls-1").await, 1);
    assert_eq!(env.state("north-shop", "refund-tls-1").await, "succeeded");

    // Without the CA the publisher is refused, naming RabbitMQ and the reason, and sends nothing.
    let (code, stderr) = publisher_send(&env, "refund-tls-2", &[("AMQP_URL", url.as_str())]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("RabbitMQ") && stderr.contains("unknown issuer"),
        "{stderr}"
    );
    // A CA file that is not PEM is a usage error naming the variable.
    let bad = env.dir.join("bad.pem");
    std::fs::write(&bad, "hello").unwrap();
    let (code, stderr) = publisher_send(
        &env,
        "refund-tls-3",
        &[
            ("AMQP_URL", url.as_str()),
            ("PUBLISHER_CA_FILE", path_str(&bad)),
        ],
    )
    .await;
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("PUBLISHER_CA_FILE="), "{stderr}");
    assert!(env.operation("north-shop", "refund-tls-2").await.is_none());
    assert!(env.operation("north-shop", "refund-tls-3").await.is_none());
    cleanup(env).await;
}

#[tokio::test]
async fn an_untrusted_or_misnamed_broker_certificate_stops_the_worker_at_once() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = env.standard_tools(ds.port, "");
    let ca = TestCa::new("e2e broker CA");
    let other_ca = TestCa::new("e2e some other CA");
    let other_file = other_ca.write(&env.dir, "other.pem");
    let ca_file = ca.write(&env.dir, "ca.pem");

    let right_name = TlsForwarder::start(&ca.server_cert(&["localhost"]), broker_addr()).await;
    let wrong_name = TlsForwarder::start(&ca.server_cert(&["wrong.example"]), broker_addr()).await;
    let cases = [
        (
            "unknown issuer",
            amqps_url(&env.amqp_url, "localhost", right_name.port),
            other_file.clone(),
        ),
        (
            "name mismatch",
            amqps_url(&env.amqp_url, "localhost", wrong_name.port),
            ca_file.clone(),
        ),
    ];
    for (reason, url, trusted) in cases {
        let opts = WorkerOptions::new(tools.clone())
            .amqp_url(&url)
            .env("WORKER_CA_FILE", path_str(&trusted));
        let mut w = Worker::spawn(&env, "w-refused", &opts);
        let code = exit_within(&mut w, FAST_EXIT).await;
        let out = w.output.text();
        assert!(
            matches!(code, Some(c) if c != 0),
            "{reason}: the worker must exit non-zero at once, got {code:?}:\n{out}"
        );
        assert!(
            out.contains("RabbitMQ at amqps://") && out.contains(reason),
            "{reason}: the error names RabbitMQ and the reason:\n{out}"
        );
        assert!(
            !out.contains("not reachable"),
            "{reason}: not an outage:\n{out}"
        );
    }

    // A WORKER_CA_FILE that does not exist stops start-up naming the variable.
    let opts = WorkerOptions::new(tools)
        .amqp_url(&amqps_url(&env.amqp_url, "localhost", right_name.port))
        .env("WORKER_CA_FILE", "/nonexistent/ca.pem");
    let mut w = Worker::spawn(&env, "w-bad-ca", &opts);
    let code = exit_within(&mut w, FAST_EXIT).await;
    let out = w.output.text();
    assert!(matches!(code, Some(c) if c != 0), "{code:?}:\n{out}");
    assert!(out.contains("WORKER_CA_FILE=/nonexistent/ca.pem"), "{out}");
    cleanup(env).await;
}

#[tokio::test]
async fn the_ledger_over_postgres_tls_verify_full() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = env.standard_tools(ds.port, "");
    let ca = TestCa::new("e2e postgres CA");
    let ca_file = ca.write(&env.dir, "ca.pem");
    let cluster = PgCluster::start(&ca.server_cert(&["localhost"]));
    let db = cluster.create_database(&format!("ledger_{}", env.id)).await;

    // A certificate for another name (the URL says 127.0.0.1, the certificate localhost) and
    // a certificate from an unknown CA are refused at once, naming the ledger connection.
    for (reason, url, ca) in [
        (
            "name mismatch",
            cluster.url("127.0.0.1", &db, "sslmode=verify-full"),
            Some(&ca_file),
        ),
        (
            "unknown issuer",
            cluster.url("localhost", &db, "sslmode=verify-full"),
            None,
        ),
    ] {
        let mut opts = WorkerOptions::new(tools.clone()).database_url(&url);
        if let Some(ca) = ca {
            opts = opts.env("WORKER_CA_FILE", path_str(ca));
        }
        let mut w = Worker::spawn(&env, "w-refused", &opts);
        let code = exit_within(&mut w, FAST_EXIT).await;
        let out = w.output.text();
        assert!(
            matches!(code, Some(c) if c != 0),
            "{reason}: the worker must exit non-zero at once, got {code:?}:\n{out}"
        );
        assert!(
            out.contains("Postgres ledger (DATABASE_URL)") && out.contains(reason),
            "{reason}: the error names the ledger connection and the reason:\n{out}"
        );
    }

    // verify-full with the extra CA: an intent goes end to end with its ledger in this cluster.
    let url = cluster.url("localhost", &db, "sslmode=verify-full");
    let opts = WorkerOptions::new(tools)
        .database_url(&url)
        .env("WORKER_CA_FILE", path_str(&ca_file));
    let _w = Worker::start(&env, "w1", &opts).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    agent
        .request(
            "north-shop",
            "refund-pg-tls",
            "refund",
            json!({"order": "o-1"}),
        )
        .await;
    agent.succeeded("north-shop", "refund-pg-tls").await;
    assert_eq!(env.mutations("north-shop:refund-pg-tls").await, 1);

    // The ledger row is in the TLS cluster, and every connection to it is encrypted.
    let check = sqlx::PgPool::connect(&cluster.url("localhost", &db, "sslmode=require"))
        .await
        .expect("connect to the ledger");
    let state: String = sqlx::query_scalar(
        "SELECT state FROM operations WHERE tenant = 'north-shop' AND action_id = 'refund-pg-tls'",
    )
    .fetch_one(&check)
    .await
    .expect("ledger row");
    assert_eq!(state, "succeeded");
    let (plain, encrypted): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE NOT s.ssl), count(*) FILTER (WHERE s.ssl)
           FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE a.datname = $1",
    )
    .bind(&db)
    .fetch_one(&check)
    .await
    .unwrap();
    assert_eq!(plain, 0, "no plaintext connection to the ledger");
    assert!(
        encrypted >= 2,
        "the worker's pool and this check: {encrypted}"
    );
    check.close().await;
    drop(cluster);
    cleanup(env).await;
}

/// The standard tools, but the refund tool at `https://localhost:<port>` (a TLS forwarder in
/// front of the reference downstream).
fn https_tools(env: &Env, ds_port: u16, tls_port: u16) -> std::path::PathBuf {
    let path = env.standard_tools(ds_port, "");
    let text = std::fs::read_to_string(&path).unwrap().replace(
        &format!("http://127.0.0.1:{ds_port}/replay"),
        &format!("https://localhost:{tls_port}/replay"),
    );
    assert!(text.contains("https://localhost"), "{text}");
    env.write_tools(&text)
}

#[tokio::test]
async fn an_https_tool_is_verified_and_a_refused_certificate_is_not_sent() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let ca = TestCa::new("e2e downstream CA");
    let ca_file = ca.write(&env.dir, "ca.pem");
    let fwd = TlsForwarder::start(
        &ca.server_cert(&["localhost"]),
        format!("127.0.0.1:{}", ds.port).parse().unwrap(),
    )
    .await;
    let tools = https_tools(&env, ds.port, fwd.port);

    // Without the CA: the call is refused in the handshake, so nothing was sent; the
    // operation fails as not applied (never succeeded, never unknown) and says why.
    let mut w = Worker::start(&env, "w-no-ca", &WorkerOptions::new(tools.clone())).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    agent
        .request(
            "north-shop",
            "refund-untrusted",
            "refund",
            json!({"order": "o-2"}),
        )
        .await;
    let events = agent
        .until("north-shop", "refund-untrusted", Status::Failed, T)
        .await;
    assert!(
        events.iter().all(|e| e.status != Status::Succeeded),
        "{events:?}"
    );
    let row = env
        .operation("north-shop", "refund-untrusted")
        .await
        .expect("ledger row");
    assert_eq!(row.state, "failed", "{row:?}");
    let evidence = row.evidence.clone().unwrap_or_default();
    assert!(
        evidence.contains("TLS handshake with tool refund at localhost:")
            && evidence.contains("unknown issuer")
            && evidence.contains("none applied"),
        "{evidence}"
    );
    assert_eq!(env.writes("north-shop:refund-untrusted").await, 0);
    assert_eq!(env.mutations("north-shop:refund-untrusted").await, 0);
    w.kill();

    // With WORKER_CA_FILE the same tool works end to end.
    let opts = WorkerOptions::new(tools).env("WORKER_CA_FILE", path_str(&ca_file));
    let _w = Worker::start(&env, "w-ca", &opts).await;
    agent
        .request(
            "north-shop",
            "refund-https",
            "refund",
            json!({"order": "o-3"}),
        )
        .await;
    agent.succeeded("north-shop", "refund-https").await;
    assert_eq!(env.mutations("north-shop:refund-https").await, 1);
    assert_eq!(env.writes("north-shop:refund-https").await, 1);
    cleanup(env).await;
}
