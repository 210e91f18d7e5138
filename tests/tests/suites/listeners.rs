//! The worker's HTTP listeners (metrics/health and admin API) cannot be used to starve it:
//! idle sockets beyond the connection cap wait in the kernel's backlog instead of taking the
//! descriptors the worker needs for its downstream, half-sent headers and idle keep-alive
//! connections are closed after their timeouts, and a wrong token is answered 401 before a
//! large body is read. And when the worker does run out of descriptors, the connect error is
//! its own exhaustion, never the downstream's `failed`: the write is retried without spending
//! the attempt budget once descriptors are back, and counted.
//!
//! The descriptor limit of the running worker is lowered with `prlimit --pid` (util-linux) to
//! a few dozen above what it holds once started, so the tests exhaust it with few sockets.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use e2e::{cleanup, metric_value, Agent, Downstream, Env, Worker, WorkerOptions};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const T: Duration = Duration::from_secs(30);
const TENANT: &str = "north-shop";
const ADMIN: &str = "admin-token-0123456789abcdef";
const NORTH: &str = "north-token-123456";

/// Descriptors the process holds now.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Lowers the running process's soft and hard RLIMIT_NOFILE to `n`.
fn limit_fds(pid: u32, n: usize) {
    let status = std::process::Command::new("prlimit")
        .arg("--pid")
        .arg(pid.to_string())
        .arg(format!("--nofile={n}:{n}"))
        .status()
        .expect("run prlimit (util-linux)");
    assert!(status.success(), "prlimit --pid {pid} --nofile={n}:{n}");
}

/// Opens `n` TCP connections to `port` that send nothing. Connections beyond the listener's
/// backlog may not complete; those are skipped.
async fn idle_connections(port: u16, n: usize) -> Vec<TcpStream> {
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        if let Ok(Ok(s)) =
            tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr)).await
        {
            out.push(s);
        }
    }
    out
}

/// Waits until the peer closes `stream` (EOF or reset) and returns how long that took, or
/// None when it is still open after `within`.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(started.elapsed()),
            // A response (e.g. an error status) before the close: keep reading.
            Ok(Ok(_)) => continue,
        }
    }
}

/// Reads one HTTP response head (up to the blank line) within `within`; "" on timeout/EOF.
async fn response_head(stream: &mut TcpStream, within: Duration) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// Reads one whole response with a `Content-Length` body.
async fn whole_response(stream: &mut TcpStream, within: Duration) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if body.len() >= length {
                return text;
            }
        }
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            _ => return text,
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_sockets_beyond_the_cap_leave_descriptors_for_the_downstream() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .with_metrics()
        .with_admin(ADMIN)
        .env("WORKER_HTTP_MAX_CONNECTIONS", "20")
        .env("WORKER_HTTP_HEADER_TIMEOUT_MS", "2000")
        .env("WORKER_HTTP_IDLE_TIMEOUT_MS", "60000");
    let w = Worker::start(&env, "w", &opts).await;
    let agent = Agent::new(&env, &[TENANT]).await;
    // Room for both listeners' caps (2 x 20) and 16 more: the downstream, readiness.
    let held = open_fds(w.pid());
    limit_fds(w.pid(), held + 56);

    // 30 idle sockets on each listener: 60, more than the worker has left.
    let mut idle = idle_connections(w.metrics_port.unwrap(), 30).await;
    idle.extend(idle_connections(w.admin_port.unwrap(), 30).await);
    assert!(idle.len() >= 56, "only {} connections opened", idle.len());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        open_fds(w.pid()) < held + 56,
        "the caps keep descriptors free: {} of {}",
        open_fds(w.pid()),
        held + 56
    );

    // While they are held: an intent is sent and succeeds, /readyz answers.
    agent
        .request(TENANT, "refund-idle", "refund", json!({"order": "o-1"}))
        .await;
    let ready = e2e::wait_for("/readyz to answer", Duration::from_secs(20), || async {
        let (status, _) = w.get("/readyz").await;
        (status != 0).then_some(status)
    })
    .await;
    assert_eq!(ready, 200, "/readyz answers while idle sockets are held");
    assert_eq!(env.final_state(TENANT, "refund-idle", T).await, "succeeded");
    assert_eq!(env.mutations("north-shop:refund-idle").await, 1);

    drop(idle);
    drop(agent);
    drop(w);
    cleanup(env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn half_sent_headers_and_idle_keep_alive_connections_are_closed() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .with_metrics()
        .with_admin(ADMIN)
        .env("WORKER_HTTP_HEADER_TIMEOUT_MS", "600")
        .env("WORKER_HTTP_IDLE_TIMEOUT_MS", "2500");
    let w = Worker::start(&env, "w", &opts).await;
    let metrics: SocketAddr = format!("127.0.0.1:{}", w.metrics_port.unwrap())
        .parse()
        .unwrap();
    let admin: SocketAddr = format!("127.0.0.1:{}", w.admin_port.unwrap())
        .parse()
        .unwrap();

    for addr in [metrics, admin] {
        // Half a request head: closed after the header timeout, not before.
        let mut half = TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            .await
            .unwrap();
        let took = closed_within(&mut half, Duration::from_secs(5))
            .await
            .unwrap_or_else(|| panic!("{addr}: a half-sent head is still open after 5 s"));
        assert!(
            took >= Duration::from_millis(400) && took < Duration::from_millis(2200),
            "{addr}: closed after {took:?}, expected about the 600 ms header timeout"
        );

        // A connection that never sends a byte: the header timeout too.
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let took = closed_within(&mut silent, Duration::from_secs(5))
            .await
            .unwrap_or_else(|| panic!("{addr}: a silent connection is still open after 5 s"));
        assert!(took < Duration::from_millis(2200), "{addr}: {took:?}");
    }

    // A keep-alive connection between requests waits for the idle timeout, not the header
    // timeout: a second request after 1.2 s (twice the header timeout) is served on it, then it
    // is closed once idle for the idle timeout.
    let mut keep = TcpStream::connect(metrics).await.unwrap();
    let get = b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    keep.write_all(get).await.unwrap();
    let first = whole_response(&mut keep, Duration::from_secs(5)).await;
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    keep.write_all(get).await.unwrap();
    let second = whole_response(&mut keep, Duration::from_secs(5)).await;
    assert!(
        second.starts_with("HTTP/1.1 200"),
        "the idle keep-alive connection was kept past the header timeout: {second:?}"
    );
    let took = closed_within(&mut keep, Duration::from_secs(8))
        .await
        .expect("an idle keep-alive connection is closed after the idle timeout");
    assert!(
        took >= Duration::from_millis(2000) && took < Duration::from_millis(5000),
        "closed after {took:?}, expected about the 2.5 s idle timeout"
    );

    drop(w);
    cleanup(env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_token_is_refused_before_the_body_is_sent() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .with_admin(ADMIN)
        .env("WORKER_TENANT_TOKENS", &format!("north-shop={NORTH}"));
    let w = Worker::start(&env, "w", &opts).await;
    let admin = format!("127.0.0.1:{}", w.admin_port.unwrap());

    // (authorization header, expected status): nothing, a wrong token, a tenant token on an
    // operator route. The body (2 MB announced) is never sent.
    for (auth, expected) in [
        ("", "401"),
        ("Authorization: Bearer not-the-token-0123456789\r\n", "401"),
        (&*format!("Authorization: Bearer {NORTH}\r\n"), "403"),
    ] {
        let mut s = TcpStream::connect(&admin).await.unwrap();
        let head = format!(
            "POST /v1/operations/north-shop/a-1/resolve HTTP/1.1\r\nHost: {admin}\r\n{auth}\
             Content-Type: application/json\r\nContent-Length: 2000000\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.unwrap();
        let answer = response_head(&mut s, Duration::from_secs(5)).await;
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {expected}")),
            "{auth:?}: expected {expected} before the body was sent, got {answer:?}"
        );
    }

    // The rules per route are unchanged: the tenant reads its own status, the admin lists.
    let http = e2e::http();
    let api = format!("http://{admin}/v1/operations");
    let r = http.get(&api).bearer_auth(ADMIN).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = http.get(&api).bearer_auth(NORTH).send().await.unwrap();
    assert_eq!(r.status(), 403);
    let r = http
        .get(format!("{api}/north-shop/none-such"))
        .bearer_auth(NORTH)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = http
        .get(format!("http://{admin}/nowhere"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404, "an unknown route is 404 without a token");

    drop(w);
    cleanup(env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn running_out_of_descriptors_is_retried_never_the_downstreams_failure() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    // Caps and timeouts far away: here the sockets do exhaust the worker.
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .with_metrics()
        .env("WORKER_HTTP_MAX_CONNECTIONS", "1000")
        .env("WORKER_HTTP_HEADER_TIMEOUT_MS", "120000")
        .env("WORKER_HTTP_IDLE_TIMEOUT_MS", "120000");
    let w = Worker::start(&env, "w", &opts).await;
    let agent = Agent::new(&env, &[TENANT]).await;
    let limit = open_fds(w.pid()) + 20;
    limit_fds(w.pid(), limit);
    let idle = idle_connections(w.metrics_port.unwrap(), 40).await;
    e2e::wait_for("the worker's descriptors to run out", T, || async {
        (open_fds(w.pid()) >= limit).then_some(())
    })
    .await;

    // Sent while no descriptor is left: never sent, and not failed (the tool allows 5
    // attempts; they would all be spent within these 4 s).
    agent
        .request(TENANT, "refund-emfile", "refund", json!({"order": "o-1"}))
        .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let row = env
        .operation(TENANT, "refund-emfile")
        .await
        .expect("recorded");
    assert!(
        matches!(row.state.as_str(), "retry_wait" | "dispatching"),
        "not sent, waiting to be tried again: {row:?}"
    );
    assert!(
        row.evidence
            .as_deref()
            .unwrap_or("")
            .contains("Too many open files")
            || row.state == "dispatching",
        "{row:?}"
    );
    assert_eq!(env.writes("north-shop:refund-emfile").await, 0);

    // Descriptors back: the next try succeeds.
    drop(idle);
    assert_eq!(
        env.final_state(TENANT, "refund-emfile", T).await,
        "succeeded"
    );
    assert_eq!(env.mutations("north-shop:refund-emfile").await, 1);
    let row = env.operation(TENANT, "refund-emfile").await.unwrap();
    assert_eq!(
        row.attempts, 1,
        "no attempt was spent on the exhaustion: {row:?}"
    );
    assert!(!env
        .outbox_statuses(TENANT, "refund-emfile")
        .await
        .contains(&"failed".to_string()));
    let text = e2e::wait_for("/metrics", T, || async {
        let (status, body) = w.get("/metrics").await;
        (status == 200).then_some(body)
    })
    .await;
    assert!(
        metric_value(
            &text,
            "intent_worker_local_resource_errors_total",
            &[("tool", "refund")]
        ) >= 1.0,
        "{text}"
    );
    assert!(w.output.contains("Too many open files"));

    drop(agent);
    drop(w);
    cleanup(env).await;
}

/// Sends a request head announcing `length` body bytes, then one body byte every `every`
/// until the peer answers or closes; returns (the answer read, how long it took from the end
/// of the head, whether the connection was closed). Gives up after `within`.
async fn slow_body(
    addr: &str,
    head: &str,
    every: Duration,
    within: Duration,
) -> (String, Duration, bool) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut rx, mut tx) = stream.into_split();
    tx.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let trickle = tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            if tx.write_all(b"x").await.is_err() {
                break;
            }
        }
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    let closed = loop {
        match tokio::time::timeout_at(deadline, rx.read(&mut buf)).await {
            Err(_) => break false,
            Ok(Ok(0)) | Ok(Err(_)) => break true,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    };
    trickle.abort();
    (
        String::from_utf8_lossy(&got).into_owned(),
        started.elapsed(),
        closed,
    )
}

/// A body sent a byte at a time is cut at the body timeout on every listener route that takes
/// one, authenticated or not; the unauthenticated sign-in refuses a large body at once; and a
/// crowd of slow senders past the connection cap does not keep an operator's request waiting
/// longer than one body timeout.
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_body_is_cut_at_the_body_timeout_and_cannot_starve_the_listener() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .with_metrics()
        .with_admin(ADMIN)
        .env("WORKER_HTTP_BODY_TIMEOUT_MS", "1500")
        .env("WORKER_HTTP_MAX_CONNECTIONS", "24");
    let w = Worker::start(&env, "w", &opts).await;
    let admin = format!("127.0.0.1:{}", w.admin_port.unwrap());
    let metrics = format!("127.0.0.1:{}", w.metrics_port.unwrap());

    // The unauthenticated sign-in form takes a small body only: refused before it is sent.
    let mut s = TcpStream::connect(&admin).await.unwrap();
    s.write_all(
        format!(
            "POST /ui/login HTTP/1.1\r\nHost: {admin}\r\n\
             Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 100000\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let answer = response_head(&mut s, Duration::from_secs(3)).await;
    assert!(
        answer.starts_with("HTTP/1.1 413"),
        "a 100 kB sign-in form: {answer:?}"
    );

    // A small sign-in form, an operator's resolve and the metrics listener's POST: each body
    // sent a byte every 300 ms is cut at the 1.5 s body timeout.
    for (addr, head) in [
        (
            &admin,
            format!(
                "POST /ui/login HTTP/1.1\r\nHost: {admin}\r\n\
                 Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 900\r\n\r\n"
            ),
        ),
        (
            &admin,
            format!(
                "POST /v1/operations/north-shop/a-1/resolve HTTP/1.1\r\nHost: {admin}\r\n\
                 Authorization: Bearer {ADMIN}\r\nContent-Type: application/json\r\n\
                 Content-Length: 5000\r\n\r\n{{"
            ),
        ),
        (
            &metrics,
            format!("POST /metrics HTTP/1.1\r\nHost: {metrics}\r\nContent-Length: 5000\r\n\r\n"),
        ),
    ] {
        let (text, took, closed) = slow_body(
            addr,
            &head,
            Duration::from_millis(300),
            Duration::from_secs(8),
        )
        .await;
        let first = head.lines().next().unwrap();
        assert!(
            closed && took < Duration::from_secs(5),
            "{first}: the slow body was still being read after {took:?} (closed: {closed}): {text:?}"
        );
        if addr == &admin {
            assert!(
                text.starts_with("HTTP/1.1 408") && text.contains("request_timeout"),
                "{first}: {text:?}"
            );
        }
    }

    // 40 slow senders (past the cap of 24) on the sign-in form: an operator's listing is
    // answered within a body timeout or two, not after the slow senders give up.
    let mut crowd = Vec::new();
    for _ in 0..40 {
        let head = format!(
            "POST /ui/login HTTP/1.1\r\nHost: {admin}\r\n\
             Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 900\r\n\r\n"
        );
        let addr = admin.clone();
        crowd.push(tokio::spawn(async move {
            slow_body(
                &addr,
                &head,
                Duration::from_millis(500),
                Duration::from_secs(30),
            )
            .await
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let r = e2e::http_builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
        .get(format!("http://{admin}/v1/operations"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .expect("the operator's listing is answered");
    assert_eq!(r.status(), 200);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(6),
        "the operator waited {took:?} behind slow senders"
    );
    for c in crowd {
        let (_, took, closed) = c.await.unwrap();
        assert!(closed && took < Duration::from_secs(8), "{took:?} {closed}");
    }

    drop(w);
    cleanup(env).await;
}

/// The MCP gateway's listener has the same body timeout: a slow POST to /mcp is cut.
#[tokio::test(flavor = "multi_thread")]
async fn the_mcp_gateway_cuts_a_slow_body_too() {
    let env = Env::new().await;
    let tools = env.dir.join("mcp-tools.toml");
    std::fs::write(
        &tools,
        "[tools.refund]\ndescription = \"Refund\"\ninput_schema = { type = \"object\" }\n",
    )
    .unwrap();
    let settings = [
        ("AMQP_URL", env.amqp_url.clone()),
        ("INTENTS_EXCHANGE", env.topology.intents_exchange.clone()),
        ("RESULTS_EXCHANGE", env.topology.results_exchange.clone()),
        ("PUBLISHER_MCP_TOOLS", tools.display().to_string()),
        (
            "PUBLISHER_MCP_TOKENS",
            "north-shop=north-mcp-token-0123456789".to_string(),
        ),
        ("PUBLISHER_HTTP_BODY_TIMEOUT", "1500ms".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let gateway = e2e::McpGateway::start(e2e::free_port(), settings).await;
    let addr = format!("127.0.0.1:{}", gateway.port);
    let head = format!(
        "POST /mcp HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer north-mcp-token-0123456789\r\n\
         Accept: application/json, text/event-stream\r\nContent-Type: application/json\r\n\
         Content-Length: 5000\r\n\r\n{{"
    );
    let (text, took, closed) = slow_body(
        &addr,
        &head,
        Duration::from_millis(300),
        Duration::from_secs(8),
    )
    .await;
    assert!(
        closed && took < Duration::from_secs(5),
        "the slow body was still being read after {took:?}: {text:?}"
    );
    drop(gateway);
    cleanup(env).await;
}
