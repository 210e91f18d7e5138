//! The MCP gateway's HTTP edge against browsers and confused proxies: a request whose `Origin`
//! is not on `PUBLISHER_MCP_ALLOWED_ORIGINS` is refused (403; without the setting every
//! browser origin is, while clients that send no `Origin` are served), and a request with two
//! `Host` headers, or whose absolute-form URI names another host than its `Host`, is refused
//! (400) before it reaches the MCP service. The bearer token is checked before the body is
//! read.

use std::collections::BTreeMap;
use std::time::Duration;

use e2e::{cleanup, free_port, Env, McpGateway, Worker, WorkerOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const NORTH: &str = "north-mcp-token-0123456789";

const MCP_TOOLS: &str = r#"
[tools.refund]
description = "Refund an order."
input_schema = { type = "object", properties = { order = { type = "string" } }, required = ["order"] }
"#;

const LIST: &str = r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{}}"#;

async fn gateway(env: &Env, extra: &[(&str, &str)]) -> McpGateway {
    let mcp_tools = env.dir.join("mcp-tools.toml");
    std::fs::write(&mcp_tools, MCP_TOOLS).unwrap();
    let mut settings: BTreeMap<String, String> = [
        ("AMQP_URL", env.amqp_url.clone()),
        ("INTENTS_EXCHANGE", env.topology.intents_exchange.clone()),
        ("RESULTS_EXCHANGE", env.topology.results_exchange.clone()),
        ("PUBLISHER_MCP_TOOLS", mcp_tools.display().to_string()),
        ("PUBLISHER_MCP_TOKENS", format!("north-shop={NORTH}")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    for (k, v) in extra {
        settings.insert(k.to_string(), v.to_string());
    }
    McpGateway::start(free_port(), settings).await
}

/// Sends `head` (request line and headers, each ending in CRLF, without the blank line) with
/// the tools/list body and returns the response's status code (0: no answer).
async fn raw(port: u16, head: &str) -> u16 {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let request = format!(
        "{head}Authorization: Bearer {NORTH}\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{LIST}",
        LIST.len()
    );
    s.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await;
    let text = String::from_utf8_lossy(&got);
    text.split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

/// A tools/list POST with `origin` (None: no Origin header).
async fn with_origin(port: u16, origin: Option<&str>) -> u16 {
    let origin = origin.map_or(String::new(), |o| format!("Origin: {o}\r\n"));
    raw(
        port,
        &format!("POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{origin}"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn origins_not_on_the_allow_list_are_refused() {
    let env = Env::new().await;
    // The worker declares the exchanges the gateway publishes to.
    let _w = Worker::start(
        &env,
        "w",
        &WorkerOptions::new(env.standard_tools(free_port(), "")),
    )
    .await;

    // Default: no browser origin at all; clients without Origin are served.
    let g = gateway(&env, &[]).await;
    assert_eq!(with_origin(g.port, None).await, 200);
    for origin in [
        "http://evil.example",
        "http://localhost:5173",
        "http://127.0.0.1:8080",
        "null",
    ] {
        assert_eq!(with_origin(g.port, Some(origin)).await, 403, "{origin}");
    }
    drop(g);

    // An explicit list: exact origins (default ports spelled or not) and `:*` for any port.
    let g = gateway(
        &env,
        &[(
            "PUBLISHER_MCP_ALLOWED_ORIGINS",
            "https://app.example.com, http://localhost:*",
        )],
    )
    .await;
    for (origin, expected) in [
        (None, 200),
        (Some("https://app.example.com"), 200),
        (Some("https://APP.example.com:443"), 200),
        (Some("https://app.example.com:8443"), 403),
        (Some("http://app.example.com"), 403),
        (Some("http://localhost:5173"), 200),
        (Some("http://localhost"), 200),
        (Some("https://localhost:5173"), 403),
        (Some("http://evil.example"), 403),
        (Some("null"), 403),
        (Some("not an origin"), 403),
    ] {
        assert_eq!(with_origin(g.port, origin).await, expected, "{origin:?}");
    }
    drop(g);
    cleanup(env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_host_headers_or_an_absolute_uri_for_another_host_are_refused() {
    let env = Env::new().await;
    let _w = Worker::start(
        &env,
        "w",
        &WorkerOptions::new(env.standard_tools(free_port(), "")),
    )
    .await;
    let g = gateway(&env, &[]).await;
    let port = g.port;

    let ok = format!("POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n");
    assert_eq!(raw(port, &ok).await, 200);
    let absolute_same =
        format!("POST http://127.0.0.1:{port}/mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n");
    assert_eq!(raw(port, &absolute_same).await, 200);

    for head in [
        format!("POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nHost: evil.example\r\n"),
        "POST /mcp HTTP/1.1\r\nHost: localhost\r\nHost: localhost\r\n".to_string(),
        format!("POST http://evil.example/mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"),
        format!("POST http://localhost:1/mcp HTTP/1.1\r\nHost: localhost:{port}\r\n"),
    ] {
        assert_eq!(raw(port, &head).await, 400, "{head:?}");
    }
    drop(g);
    cleanup(env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_token_is_refused_before_the_body_is_read() {
    let env = Env::new().await;
    let _w = Worker::start(
        &env,
        "w",
        &WorkerOptions::new(env.standard_tools(free_port(), "")),
    )
    .await;
    let g = gateway(&env, &[]).await;
    for auth in ["", "Authorization: Bearer not-a-known-token-000000\r\n"] {
        let mut s = TcpStream::connect(("127.0.0.1", g.port)).await.unwrap();
        let head = format!(
            "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n{auth}Content-Type: application/json\r\n\
             Content-Length: 2000000\r\n\r\n",
            g.port
        );
        s.write_all(head.as_bytes()).await.unwrap();
        let mut got = vec![0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut got))
            .await
            .expect("an answer before the body is sent")
            .unwrap();
        let text = String::from_utf8_lossy(&got[..n]);
        assert!(text.starts_with("HTTP/1.1 401"), "{auth:?}: {text:?}");
    }
    drop(g);
    cleanup(env).await;
}
