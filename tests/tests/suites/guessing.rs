//! A guessing or greedy client against the admin listener, through the built worker: wrong
//! bearer tokens and wrong sign-ins draw on one failure budget (per client and overall) and are
//! answered at once, never held; each refused token is logged without the token; tokens too
//! short to resist guessing are refused at start by the worker and the MCP gateway; a listing
//! stays small whatever the operations carry; every API answer says `no-store` and `nosniff`,
//! and an oversized body gets the JSON error shape, read by a client still sending that body.

use std::time::{Duration, Instant};

use e2e::{cleanup, Agent, Downstream, Env, Worker, WorkerOptions};
use serde_json::json;

const ADMIN: &str = "admin-token-0123456789abcdef";
const NORTH: &str = "north-token-0123456789";

fn client() -> reqwest::Client {
    e2e::http_builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

/// Fills a sign-in form: (nonce cookie, csrf token).
async fn sign_in_form(http: &reqwest::Client, base: &str) -> (String, String) {
    let r = http.get(format!("{base}/ui/login")).send().await.unwrap();
    let cookie = r
        .headers()
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with("iw_login="))
        .expect("the form's nonce cookie")
        .split(';')
        .next()
        .unwrap()
        .to_string();
    let body = r.text().await.unwrap();
    let needle = "name=\"csrf\" value=\"";
    let start = body.find(needle).expect("a csrf input") + needle.len();
    let end = body[start..].find('"').unwrap() + start;
    (cookie, body[start..end].to_string())
}

#[tokio::test(flavor = "multi_thread")]
async fn wrong_bearer_tokens_spend_a_budget_are_logged_and_never_named() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .with_admin(ADMIN)
        .env("WORKER_TENANT_TOKENS", &format!("north-shop={NORTH}"));
    let w = Worker::start(&env, "w", &opts).await;
    let api = format!("http://127.0.0.1:{}/v1/operations", w.admin_port.unwrap());
    let http = client();

    // 60 guesses as fast as they go: a few are compared (401), the rest refused unchecked
    // (429 with Retry-After), all at once.
    let started = Instant::now();
    let mut statuses = Vec::new();
    for i in 0..60 {
        let r = http
            .get(&api)
            .bearer_auth(format!("guess-{i:04}-0123456789abcdef"))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        if status == 429 {
            let retry: u64 = r
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .expect("a 429 says when to come back");
            assert!((1..=60).contains(&retry), "Retry-After {retry}");
            let body: serde_json::Value = r.json().await.unwrap();
            assert_eq!(body["error"], "too_many_requests", "{body}");
        }
        statuses.push(status);
    }
    let took = started.elapsed();
    let compared = statuses.iter().filter(|s| **s == 401).count();
    let refused = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!(compared + refused, 60, "{statuses:?}");
    assert!(
        (5..=15).contains(&compared),
        "at most a client's burst is compared: {compared} of 60 ({statuses:?})"
    );
    assert!(took < Duration::from_secs(10), "answered in {took:?}");

    // Even the right token waits for the client's budget to refill, then works.
    let r = http.get(&api).bearer_auth(ADMIN).send().await.unwrap();
    assert_eq!(r.status(), 429, "a spent budget compares no token");
    let wait: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(wait)).await;
    let r = http.get(&api).bearer_auth(ADMIN).send().await.unwrap();
    assert_eq!(r.status(), 200);

    // One log line per compared and refused token, naming the client, never the token.
    let logs = w.output.text();
    let lines = logs.matches("token refused").count();
    assert!(
        lines >= compared,
        "{lines} log lines for {compared} refused tokens"
    );
    assert!(logs.contains("127.0.0.1"), "the client is named");
    assert!(!logs.contains("guess-0"), "a token was logged:\n{logs}");
    drop(w);
    cleanup(env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn failed_sign_ins_are_answered_at_once_and_big_forms_never_buffered() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, "")).with_admin(ADMIN);
    let w = Worker::start(&env, "w", &opts).await;
    let base = format!("http://127.0.0.1:{}", w.admin_port.unwrap());
    let http = client();

    // 30 wrong tokens at once: each answered within a second or two (401, or 429 past the
    // client's budget), none queued behind the others.
    let mut tries = Vec::new();
    for i in 0..30 {
        let (cookie, csrf) = sign_in_form(&http, &base).await;
        let http = http.clone();
        let base = base.clone();
        tries.push(tokio::spawn(async move {
            let started = Instant::now();
            let r = http
                .post(format!("{base}/ui/login"))
                .header("cookie", cookie)
                .header("content-type", "application/x-www-form-urlencoded")
                .body(format!(
                    "csrf={csrf}&token=wrong-{i:03}-0123456789abcdef&operator=mallory"
                ))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), started.elapsed())
        }));
    }
    let mut statuses = Vec::new();
    for t in tries {
        let (status, took) = t.await.unwrap();
        assert!(
            took < Duration::from_secs(3),
            "a failed sign-in was held {took:?}"
        );
        statuses.push(status);
    }
    assert!(
        statuses.iter().all(|s| *s == 401 || *s == 429),
        "{statuses:?}"
    );
    assert!(statuses.contains(&429), "the budget is spent: {statuses:?}");

    // 40 sign-in forms of 1.9 MB: refused before they are read; the worker's memory stays.
    let rss = |pid: u32| -> u64 {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    };
    let before = rss(w.pid());
    let big = format!("csrf=x&operator=y&token={}", "A".repeat(1_900_000));
    let mut sends = Vec::new();
    for _ in 0..40 {
        let (http, base, big) = (http.clone(), base.clone(), big.clone());
        sends.push(tokio::spawn(async move {
            match http
                .post(format!("{base}/ui/login"))
                .header("content-type", "application/x-www-form-urlencoded")
                .body(big)
                .send()
                .await
            {
                Ok(r) => r.status().as_u16(),
                // The listener may close before the whole body was sent: refused either way.
                Err(_) => 413,
            }
        }));
    }
    for s in sends {
        assert_eq!(s.await.unwrap(), 413);
    }
    let after = rss(w.pid());
    assert!(
        after < before + 40_000,
        "RSS rose from {before} kB to {after} kB"
    );
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn tokens_too_short_to_resist_guessing_are_refused_at_start() {
    let env = Env::new().await;
    let tools = env.standard_tools(9, "");
    for (var, value) in [
        ("WORKER_TENANT_TOKENS", "north-shop=short-12"),
        ("WORKER_ADMIN_TOKEN", "admin-15-chars!"),
    ] {
        let out = std::process::Command::new(e2e::procs::bin_dir().join("worker"))
            .arg("run")
            .env_clear()
            .env("DATABASE_URL", &env.db_url)
            .env("WORKER_TOOLS", &tools)
            .env(var, value)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}: {err}");
        assert!(err.contains(var) && err.contains("16"), "{var}: {err}");
        let secret = value.split('=').next_back().unwrap();
        assert!(!err.contains(secret), "the token is printed: {err}");
    }
    let mcp_tools = env.dir.join("mcp-tools.toml");
    std::fs::write(
        &mcp_tools,
        "[tools.refund]\ndescription = \"Refund\"\ninput_schema = { type = \"object\" }\n",
    )
    .unwrap();
    let out = std::process::Command::new(e2e::procs::publisher_bin())
        .arg("mcp")
        .env_clear()
        .env("PUBLISHER_MCP_TOOLS", &mcp_tools)
        .env("PUBLISHER_MCP_TOKENS", "north-shop=short-token-12")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("16") && !err.contains("short-token-12"),
        "{err}"
    );
    cleanup(env).await;
}

/// Operations whose writes cannot be sent (nothing listens at the tool's port) wait in
/// `retry_wait`: unresolved, with their arguments.
fn unsendable_tools(env: &Env) -> std::path::PathBuf {
    env.write_tools(
        "[tools.bulky]\nurl = \"http://127.0.0.1:9/bulky\"\nrecovery = \"none\"\n\
         receipt_id = \"/receipt_id\"\n\
         receipt_match = { \"/idempotency_key\" = \"{tenant}:{action_id}\" }\n\
         timeout_ms = 2000\nretry = { initial_delay_ms = 600000, max_delay_ms = 600000 }\n",
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_listing_stays_small_whatever_the_operations_carry() {
    let env = Env::new().await;
    let opts = WorkerOptions::new(unsendable_tools(&env)).with_admin(ADMIN);
    let w = Worker::start(&env, "w", &opts).await;
    let agent = Agent::new(&env, &["north-shop"]).await;
    let blob = "x".repeat(200_000);
    for i in 0..30 {
        agent
            .request(
                "north-shop",
                &format!("bulky-{i}"),
                "bulky",
                json!({ "blob": blob, "n": i }),
            )
            .await;
    }
    e2e::wait_for("30 operations waiting", Duration::from_secs(60), || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM operations WHERE state = 'retry_wait'")
                .fetch_one(&env.pool)
                .await
                .unwrap();
        (n == 30).then_some(())
    })
    .await;

    let http = client();
    let base = format!("http://127.0.0.1:{}/v1/operations", w.admin_port.unwrap());
    let r = http
        .get(format!("{base}?limit=500"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(
        text.len() < 100_000,
        "a page of 30 operations is {} bytes",
        text.len()
    );
    let page: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ops = page["operations"].as_array().unwrap();
    assert_eq!(ops.len(), 30);
    assert!(
        ops.iter().all(|o| o.get("arguments").is_none()),
        "{}",
        ops[0]
    );

    // One operation's route returns the whole row.
    let r = http
        .get(format!("{base}/north-shop/bulky-7"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    let one: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        one["operation"]["arguments"]["blob"].as_str().map(str::len),
        Some(200_000)
    );
    drop(w);
    drop(agent);
    cleanup(env).await;
}

#[tokio::test]
async fn api_answers_are_private_and_every_error_is_json() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .with_admin(ADMIN)
        .env("WORKER_TENANT_TOKENS", &format!("north-shop={NORTH}"));
    let w = Worker::start(&env, "w", &opts).await;
    let base = format!("http://127.0.0.1:{}/v1/operations", w.admin_port.unwrap());
    let http = client();
    let answers = [
        http.get(&base).bearer_auth(ADMIN).send().await.unwrap(),
        http.get(&base).send().await.unwrap(),
        http.get(format!("{base}/north-shop/none"))
            .bearer_auth(NORTH)
            .send()
            .await
            .unwrap(),
    ];
    for r in answers {
        let h = r.headers();
        assert_eq!(h["cache-control"], "no-store", "{}: {h:?}", r.status());
        assert_eq!(h["x-content-type-options"], "nosniff", "{}", r.status());
    }
    // A body over the cap (2 MiB): 413 in the JSON error shape.
    let r = http
        .post(format!("{base}/north-shop/a-1/resolve"))
        .bearer_auth(ADMIN)
        .header("content-type", "application/json")
        .body(format!("{{\"reason\":\"{}\"}}", "r".repeat(3_000_000)))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(r.headers()["content-type"], "application/json");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"], "payload_too_large", "{body}");
    drop(w);
    cleanup(env).await;
}

/// A client that sends a body over the cap at its own pace, then reads the answer: the `413`
/// comes as soon as the headers are read, and the rest of the upload is read and discarded, so
/// the client finishes sending and reads it, instead of writing into a closed connection.
#[tokio::test]
async fn a_client_still_sending_a_body_over_the_cap_reads_the_413() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, "")).with_admin(ADMIN);
    let w = Worker::start(&env, "w", &opts).await;
    let port = w.admin_port.unwrap();
    let len = 3_000_000;
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let head = format!(
        "POST /v1/operations/north-shop/a-1/resolve HTTP/1.1\r\nhost: 127.0.0.1\r\n\
         authorization: Bearer {ADMIN}\r\ncontent-type: application/json\r\n\
         content-length: {len}\r\nconnection: close\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    // 3 MB in 64 KiB pieces over about half a second: the answer is long written by the end.
    let piece = vec![b'r'; 64 * 1024];
    let mut sent = 0;
    while sent < len {
        let n = piece.len().min(len - sent);
        s.write_all(&piece[..n])
            .await
            .unwrap_or_else(|e| panic!("the upload was cut after {sent} bytes: {e}"));
        sent += n;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 413"),
        "the client reads the 413: {answer:?}"
    );
    assert!(answer.contains("payload_too_large"), "{answer}");
    drop(w);
    cleanup(env).await;
}

/// The MCP gateway's bearer tokens have the same budget and the same log line.
#[tokio::test(flavor = "multi_thread")]
async fn the_mcp_gateway_budgets_wrong_tokens_too() {
    let env = Env::new().await;
    let tools = env.dir.join("mcp-tools.toml");
    std::fs::write(
        &tools,
        "[tools.refund]\ndescription = \"Refund\"\ninput_schema = { type = \"object\" }\n",
    )
    .unwrap();
    let token = "north-mcp-token-0123456789";
    let settings = [
        ("AMQP_URL", env.amqp_url.clone()),
        ("PUBLISHER_MCP_TOOLS", tools.display().to_string()),
        ("PUBLISHER_MCP_TOKENS", format!("north-shop={token}")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let gateway = e2e::McpGateway::start(e2e::free_port(), settings).await;
    let http = client();
    let ping = |bearer: String| {
        http.post(gateway.url())
            .bearer_auth(bearer)
            .header("accept", "application/json, text/event-stream")
            .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "ping"}))
            .send()
    };
    let mut statuses = Vec::new();
    for i in 0..40 {
        let r = ping(format!("guess-{i:04}-0123456789abcdef"))
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
    }
    let compared = statuses.iter().filter(|s| **s == 401).count();
    assert!((5..=15).contains(&compared), "{statuses:?}");
    assert_eq!(
        compared + statuses.iter().filter(|s| **s == 429).count(),
        40
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let r = ping(token.to_string()).await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let logs = gateway.output.text();
    assert!(logs.matches("token refused").count() >= compared, "{logs}");
    assert!(!logs.contains("guess-0"), "{logs}");
    drop(gateway);
    cleanup(env).await;
}
