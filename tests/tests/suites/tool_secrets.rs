//! A secret in a tool's URL (an API key in the query, a password in the user part, both
//! interpolated from the environment) never reaches what the worker writes or says: not the
//! evidence, the agent's result, the status API (admin or tenant), the console, or the logs,
//! whether the write could not connect, timed out after it may have been written, or its lookup
//! failed. The tool and its host are named instead.

use std::time::Duration;

use e2e::{cleanup, Agent, Env, Worker, WorkerOptions};
use protocol::Status;
use serde_json::json;
use tokio::io::AsyncReadExt;

const ADMIN: &str = "admin-token-0123456789abcdef";
const NORTH: &str = "north-token-0123456789";
const KEY: &str = "sk-live-QUERYSECRET-7f3a";
const PASS: &str = "p4ss-USERINFOSECRET";
const LOOKUP_KEY: &str = "lk-LOOKUPSECRET-91c2";
const T: Duration = Duration::from_secs(60);

/// A port that accepts connections, reads what is sent and never answers.
async fn black_hole() -> u16 {
    e2e::recording::listen(|mut s| async move {
        let mut buf = [0u8; 4096];
        while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
    })
    .await
}

fn leaks(text: &str) -> Vec<&'static str> {
    [KEY, PASS, LOOKUP_KEY, "api_key="]
        .into_iter()
        .filter(|s| text.contains(s))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn secrets_in_tool_urls_reach_no_evidence_result_api_console_or_log() {
    let env = Env::new().await;
    let hole = black_hole().await;
    let common = "receipt_id = \"/receipt_id\"\n\
                  receipt_match = { \"/idempotency_key\" = \"{tenant}:{action_id}\" }\n\
                  timeout_ms = 600\nrecovery_attempts = 2\n\
                  retry = { initial_delay_ms = 50, max_delay_ms = 100, max_attempts = 2 }\n";
    let tools = env.write_tools(&format!(
        // Nothing listens on port 9: the write cannot connect.
        "[tools.pay]\nurl = \"http://payer:${{PAY_PASS}}@127.0.0.1:9/pay?api_key=${{PAY_KEY}}&v=2\"\n\
         recovery = \"none\"\n{common}\n\
         [tools.hang]\nurl = \"http://127.0.0.1:{hole}/hang?api_key=${{PAY_KEY}}\"\n\
         recovery = \"none\"\n{common}\n\
         [tools.seek]\nurl = \"http://127.0.0.1:{hole}/seek?api_key=${{PAY_KEY}}\"\n\
         recovery = \"lookup\"\n\
         lookup_url = \"http://127.0.0.1:9/by-key/{{key}}?token=${{LOOKUP_KEY}}\"\n{common}\n"
    ));
    let opts = WorkerOptions::new(tools)
        .with_admin(ADMIN)
        .env("WORKER_TENANT_TOKENS", &format!("north-shop={NORTH}"))
        .env("PAY_KEY", KEY)
        .env("PAY_PASS", PASS)
        .env("LOOKUP_KEY", LOOKUP_KEY)
        .env("RUST_LOG", "debug,lapin=warn,sqlx=warn,hyper=warn,h2=warn");
    let w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;

    agent
        .request("north-shop", "pay-1", "pay", json!({"amount": 1}))
        .await;
    agent
        .request("north-shop", "hang-1", "hang", json!({"amount": 2}))
        .await;
    agent
        .request("north-shop", "seek-1", "seek", json!({"amount": 3}))
        .await;
    let mut said = Vec::new();
    for ev in agent.until("north-shop", "pay-1", Status::Failed, T).await {
        said.push(ev.message);
    }
    for id in ["hang-1", "seek-1"] {
        e2e::wait_for(&format!("{id} held"), T, || async {
            (env.state("north-shop", id).await == "held").then_some(())
        })
        .await;
    }
    // The pending answers of the two held ones.
    while let Some(ev) = agent.try_next("north-shop", Duration::from_secs(2)).await {
        said.push(ev.message);
    }

    let evidence: Vec<String> = sqlx::query_scalar(
        "SELECT coalesce(evidence, '') FROM operation_history UNION ALL \
         SELECT coalesce(evidence, '') FROM operations",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let evidence = evidence.join("\n");
    assert!(
        evidence.contains("pay") && evidence.contains("127.0.0.1"),
        "the evidence names the tool and its host: {evidence}"
    );

    let http = e2e::http();
    let admin = format!("http://127.0.0.1:{}", w.admin_port.unwrap());
    let mut api = String::new();
    for id in ["pay-1", "hang-1", "seek-1"] {
        for token in [ADMIN, NORTH] {
            let r = http
                .get(format!("{admin}/v1/operations/north-shop/{id}"))
                .bearer_auth(token)
                .send()
                .await
                .unwrap();
            api.push_str(&r.text().await.unwrap());
        }
    }
    let list = http
        .get(format!("{admin}/v1/operations"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();

    let cookie = e2e::console::sign_in(w.admin_port.unwrap(), ADMIN, "alice").await;
    let mut console = String::new();
    for id in ["pay-1", "hang-1", "seek-1"] {
        let op_id: i64 = sqlx::query_scalar(
            "SELECT id FROM operations WHERE tenant = 'north-shop' AND action_id = $1",
        )
        .bind(id)
        .fetch_one(&env.pool)
        .await
        .unwrap();
        let page = http
            .get(format!("{admin}/ui/operations/{op_id}"))
            .header("cookie", &cookie)
            .send()
            .await
            .unwrap();
        assert_eq!(page.status(), 200);
        console.push_str(&page.text().await.unwrap());
    }

    for (what, text) in [
        ("console", console.as_str()),
        ("evidence", evidence.as_str()),
        ("results", &said.join("\n")),
        ("status API", &api),
        ("listing", &list),
        ("logs", &w.output.text()),
    ] {
        assert!(
            leaks(text).is_empty(),
            "{what} leaks {:?}:\n{text}",
            leaks(text)
        );
    }
    drop(w);
    drop(agent);
    cleanup(env).await;
}

#[tokio::test]
async fn a_user_and_password_in_a_tool_url_are_sent_as_basic_auth_never_in_the_request() {
    let env = Env::new().await;
    let (port, heads) = e2e::recording::downstream().await;
    // The password holds an '@' (percent-encoded in the URL) and comes from the environment.
    let tools = env.write_tools(&format!(
        "[tools.pay]\nurl = \"http://payer:${{PAY_PASS}}@127.0.0.1:{port}/pay?v=2\"\n\
         recovery = \"none\"\ntimeout_ms = 2000\nreceipt_id = \"/receipt_id\"\n\
         receipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\n"
    ));
    let opts = WorkerOptions::new(tools).env("PAY_PASS", "p%40ss-word");
    let _w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    agent
        .request("north-shop", "pay-basic", "pay", json!({"amount": 1}))
        .await;
    agent.succeeded("north-shop", "pay-basic").await;
    let heads = heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 1, "{heads:?}");
    let head = &heads[0];
    // base64("payer:p@ss-word")
    assert!(
        head.lines().any(|l| l
            .split_once(':')
            .is_some_and(|(k, v)| k.eq_ignore_ascii_case("authorization")
                && v.trim() == "Basic cGF5ZXI6cEBzcy13b3Jk")),
        "{head}"
    );
    assert!(head.starts_with("POST /pay?v=2 HTTP/1.1\r\n"), "{head}");
    // reqwest's default, kept.
    assert!(
        head.lines().any(|l| l.eq_ignore_ascii_case("accept: */*")),
        "{head}"
    );
    assert!(
        !head.contains("payer"),
        "the user stays out of the request line and Host: {head}"
    );
    cleanup(env).await;
}
