//! Configuration a user can discover. Run as a user would: the `worker` binary
//! with nothing but environment variables (no flags), its help text and exit codes, and a tools
//! file whose header value comes from the environment, seen by a real HTTP downstream.

use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use e2e::procs::bin_dir;
use e2e::{cleanup, Agent, Env, Worker, WorkerOptions};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `worker` with a cleared environment plus `vars`.
fn worker(args: &[&str], vars: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(bin_dir().join("worker"));
    cmd.args(args).env_clear();
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd.output().expect("run worker")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The variables of the worker table in docs/configuration.md, the list users read.
fn documented_variables() -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/configuration.md"
    ))
    .expect("read docs/configuration.md");
    let table: Vec<&str> = doc
        .lines()
        .skip_while(|l| !l.starts_with("## Worker (`worker` binary"))
        .skip(1)
        .take_while(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with("| `"))
        .collect();
    let mut vars = Vec::new();
    for row in table {
        let first = row.split('|').nth(1).unwrap_or("");
        for name in first.split('`').skip(1).step_by(2) {
            vars.push(name.to_string());
        }
    }
    assert!(
        vars.len() > 25,
        "worker table of docs/configuration.md not found: {vars:?}"
    );
    vars
}

#[test]
fn run_help_lists_every_documented_variable_with_its_default() {
    let out = worker(&["run", "--help"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let help = String::from_utf8_lossy(&out.stdout);
    for var in documented_variables() {
        // RUST_LOG, OpenTelemetry's standard variables (read by its SDK, named in the help's
        // closing note) and the fault-point switches belong to logging, tracing and test builds.
        if var == "RUST_LOG" || var.starts_with("OTEL_") || var.starts_with("WORKER_FAULT_") {
            continue;
        }
        assert!(
            help.contains(&format!("[env: {var}")),
            "`worker run --help` does not list {var}:\n{help}"
        );
    }
    assert!(
        help.contains("OTEL_EXPORTER_OTLP_ENDPOINT"),
        "the help names span export's variables:\n{help}"
    );
    for default in [
        "[default: 256]",
        "[default: 30]",
        "[default: tools.toml]",
        "[default: 127.0.0.1:9464]",
        "[default: intents]",
    ] {
        assert!(help.contains(default), "missing {default}:\n{help}");
    }
    // Secrets set in the environment are not echoed by --help.
    let out = worker(
        &["run", "--help"],
        &[
            ("DATABASE_URL", "postgres://u:pw-in-url@db/x"),
            ("WORKER_ADMIN_TOKEN", "admin-token-secret-123"),
        ],
    );
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        !help.contains("pw-in-url") && !help.contains("admin-token-secret"),
        "{help}"
    );
}

#[test]
fn blank_values_count_as_unset_and_a_bad_value_exits_2_naming_it() {
    // Blank WORKER_PREFETCH is unset (else it would be refused first); the bad format is named.
    let out = worker(
        &[],
        &[
            ("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none"),
            ("WORKER_PREFETCH", ""),
            ("WORKER_LEASE_SECS", "  "),
            ("WORKER_LOG_FORMAT", "xml"),
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("WORKER_LOG_FORMAT"), "{err}");
    assert!(
        !err.contains("WORKER_PREFETCH") && !err.contains("WORKER_LEASE_SECS"),
        "{err}"
    );

    let out = worker(&["run"], &[("DATABASE_URL", "")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("DATABASE_URL"), "{}", stderr(&out));

    for (var, value) in [
        ("WORKER_PREFETCH", "0"),
        ("WORKER_SHUTDOWN_GRACE_SECS", "soon"),
        ("WORKER_DECLARE_TOPOLOGY", "maybe"),
        ("METRICS_ADDR", "everywhere"),
        ("WORKER_DB_ACQUIRE_TIMEOUT_SECS", "0"),
    ] {
        let out = worker(
            &["run"],
            &[
                ("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none"),
                (var, value),
            ],
        );
        assert_eq!(
            out.status.code(),
            Some(2),
            "{var}={value}: {}",
            stderr(&out)
        );
        assert!(stderr(&out).contains(var), "{var}: {}", stderr(&out));
    }
}

#[test]
fn the_old_exchange_variable_conflicting_with_the_shared_name_stops_start_up() {
    let out = worker(
        &["run"],
        &[
            ("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none"),
            ("INTENTS_EXCHANGE", "intents"),
            ("WORKER_INTENTS_EXCHANGE", "agent-intents"),
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("INTENTS_EXCHANGE=\"intents\"")
            && err.contains("WORKER_INTENTS_EXCHANGE=\"agent-intents\""),
        "{err}"
    );
}

/// A downstream that records the request heads it gets and answers every write with a receipt
/// echoing its idempotency key.
async fn recording_downstream() -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = heads.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                // Head, then as much body as Content-Length says (bodies here are small).
                loop {
                    let Ok(n) = sock.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).to_string();
                    let Some(end) = text.find("\r\n\r\n") else {
                        continue;
                    };
                    let head = text[..end].to_ascii_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    if buf.len() < end + 4 + length {
                        continue;
                    }
                    let key = text[..end]
                        .lines()
                        .find_map(|l| {
                            l.split_once(':')
                                .filter(|(n, _)| n.eq_ignore_ascii_case("idempotency-key"))
                                .map(|(_, v)| v.trim().to_string())
                        })
                        .unwrap_or_default();
                    seen.lock().unwrap().push(text[..end].to_string());
                    let body = json!({"receipt_id": format!("r-{key}"), "idempotency_key": key})
                        .to_string();
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = sock.write_all(answer.as_bytes()).await;
                    return;
                }
            });
        }
    });
    (port, heads)
}

#[tokio::test]
async fn a_header_value_from_the_environment_reaches_the_downstream() {
    let env = Env::new().await;
    let (port, heads) = recording_downstream().await;
    let tools = env.write_tools(
        "[tools.pay]\n\
         url = \"${PAY_BASE_URL:-http://127.0.0.1:1}/pay\"\n\
         receipt_id = \"/receipt_id\"\n\
         receipt_match = { \"/idempotency_key\" = \"{tenant}:{action_id}\" }\n\
         timeout_ms = 2000\n\
         recovery = \"none\"\n\
         headers = { Authorization = \"Bearer ${PAY_API_KEY}\", X-Literal = \"$${not-a-var}\" }\n",
    );

    // Without the variable the worker refuses to start, naming it and the tool's key.
    let mut w = Worker::spawn(&env, "w0", &WorkerOptions::new(tools.clone()));
    let status = tokio::task::spawn_blocking(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = w.exit_status() {
                // Let the capture threads read the last lines.
                std::thread::sleep(Duration::from_millis(300));
                return (s, w.output.text());
            }
            assert!(std::time::Instant::now() < deadline, "worker did not exit");
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .await
    .unwrap();
    assert!(!status.0.success());
    assert!(
        status.1.contains("PAY_API_KEY") && status.1.contains("tools.pay.headers.Authorization"),
        "{}",
        status.1
    );

    let opts = WorkerOptions::new(tools)
        .env("PAY_API_KEY", "k-from-a-secret")
        .env("PAY_BASE_URL", &format!("http://127.0.0.1:{port}"));
    let w = Worker::start(&env, "w1", &opts).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    agent
        .request("north-shop", "pay-env-1", "pay", json!({"amount_cents": 5}))
        .await;
    agent.succeeded("north-shop", "pay-env-1").await;
    let heads = heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 1, "{heads:?}");
    let head = heads[0].to_ascii_lowercase();
    assert!(
        head.starts_with("post /pay ") && head.contains("authorization: bearer k-from-a-secret"),
        "{head}"
    );
    assert!(head.contains("x-literal: ${not-a-var}"), "{head}");
    drop(w);
    cleanup(env).await;
}

/// The publisher: a failing command prints each cause once.
#[test]
fn publisher_errors_print_each_cause_once() {
    let out = Command::new(bin_dir().join("publisher"))
        .arg("migrate")
        .env_clear()
        .env(
            "PUBLISHER_DATABASE_URL",
            e2e::env::pg_admin_url().replace("postgres@", "no_such_role_for_e2e@"),
        )
        .output()
        .expect("run publisher");
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("PUBLISHER_DATABASE_URL"), "{err}");
    assert_eq!(
        err.matches("no_such_role_for_e2e").count(),
        1,
        "each cause once: {err}"
    );
}

/// The old worker-only names still work (a deprecated alias, said in the log), so existing
/// deployments keep running after the rename.
#[tokio::test]
async fn the_old_exchange_variables_still_work_with_a_warning() {
    let env = Env::new().await;
    let ds = e2e::Downstream::start(&env).await;
    // Blank counts as unset: only the old names carry the test's exchanges.
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .env("INTENTS_EXCHANGE", "")
        .env("RESULTS_EXCHANGE", "")
        .env("WORKER_INTENTS_EXCHANGE", &env.topology.intents_exchange)
        .env("WORKER_RESULTS_EXCHANGE", &env.topology.results_exchange);
    let w = Worker::start(&env, "w", &opts).await;
    assert!(
        w.output
            .contains("WORKER_INTENTS_EXCHANGE is deprecated; set INTENTS_EXCHANGE"),
        "{}",
        w.output.text()
    );
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    agent
        .request("north-shop", "alias-1", "refund", json!({"order": 1}))
        .await;
    agent.succeeded("north-shop", "alias-1").await;
    assert_eq!(env.mutations("north-shop:alias-1").await, 1);
    drop(w);
    cleanup(env).await;
}

/// A URL that can never work stops start-up at once with exit 2, naming the variable and never
/// echoing the password: an AMQP port out of range is not retried forever as if the broker were
/// down, and a MySQL URL is not taken for a ledger.
#[test]
fn an_unusable_url_is_refused_at_start_up_naming_the_variable() {
    let good_db = "postgres://nobody@127.0.0.1:1/none";
    for (var, value, vars) in [
        (
            "AMQP_URL",
            "amqp://guest:s3cret-pw@127.0.0.1:99999/%2f",
            vec![("DATABASE_URL", good_db)],
        ),
        (
            "AMQP_URL",
            "http://guest:s3cret-pw@127.0.0.1:5672/",
            vec![("DATABASE_URL", good_db)],
        ),
        (
            "DATABASE_URL",
            "mysql://root:s3cret-pw@127.0.0.1:3306/test",
            vec![],
        ),
        (
            "DATABASE_URL",
            "postgres://u:s3cret-pw@127.0.0.1:70000/db",
            vec![],
        ),
    ] {
        let tools = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/tools.demo.toml");
        let mut all = vars.clone();
        all.push(("WORKER_TOOLS", tools));
        all.push((var, value));
        let started = std::time::Instant::now();
        let out = worker(&["run"], &all);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{var}={value}: {err}");
        assert!(err.contains(var), "{var}={value}: {err}");
        assert!(!err.contains("s3cret-pw"), "the password is echoed: {err}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{var}={value} took {:?}",
            started.elapsed()
        );
    }
}

/// The publisher refuses the same unusable URLs at once, exit 2, naming the variable.
#[test]
fn the_publisher_refuses_an_unusable_url_naming_the_variable() {
    for (args, var, value) in [
        (
            vec!["send", "--tenant", "t", "--action-id", "a", "--tool", "x"],
            "AMQP_URL",
            "amqp://guest:s3cret-pw@127.0.0.1:99999/%2f",
        ),
        (
            vec!["relay"],
            "PUBLISHER_DATABASE_URL",
            "mysql://root:s3cret-pw@127.0.0.1:3306/test",
        ),
        (
            vec!["migrate"],
            "PUBLISHER_DATABASE_URL",
            "postgres://u:s3cret-pw@127.0.0.1:70000/db",
        ),
    ] {
        let started = std::time::Instant::now();
        let out = Command::new(bin_dir().join("publisher"))
            .args(&args)
            .env_clear()
            .env(var, value)
            .output()
            .expect("run publisher");
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?} {var}={value}: {err}");
        assert!(err.contains(var), "{var}: {err}");
        assert!(!err.contains("s3cret-pw"), "the password is echoed: {err}");
        assert!(started.elapsed() < Duration::from_secs(10), "{args:?}");
    }
}
