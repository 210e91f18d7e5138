//! Alert inputs and start-up errors on the real binary: a fresh worker's `/metrics` already exports every
//! counter an alert reads at 0 (so the first increment is an `increase()` the alert sees), and
//! start-up errors read once: each cause printed once, a refused login reported as refused
//! credentials (and not retried as "not reachable").

use std::path::PathBuf;
use std::time::Duration;

use e2e::{cleanup, wait_for, Downstream, Env, FaultProxy, Worker, WorkerOptions};

const T: Duration = Duration::from_secs(30);

/// The value of the one series `name{filters}` (all filters must match), or `None` when the
/// exposition has no such series. Unlike `metric_value`, absence is not 0.
fn series(text: &str, name: &str, filters: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .find(|l| {
            filters
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
}

#[tokio::test]
async fn fresh_worker_exports_alert_counters_at_zero() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, "")).with_metrics();
    let w = Worker::start(&env, "w", &opts).await;
    let text = w.metrics().await;

    let mut expected: Vec<(&str, Vec<(&str, &str)>)> = vec![
        (
            "intent_worker_late_receipts_total",
            vec![("outcome", "conflict")],
        ),
        (
            "intent_worker_late_receipts_total",
            vec![("outcome", "matches")],
        ),
        ("intent_worker_stale_writes_total", vec![]),
        ("intent_worker_results_unroutable_total", vec![]),
        (
            "intent_worker_broker_reconnects_total",
            vec![("link", "consumer")],
        ),
        (
            "intent_worker_broker_reconnects_total",
            vec![("link", "relay")],
        ),
    ];
    for op in [
        "intake",
        "send_fence",
        "complete",
        "schedule",
        "budget",
        "retention",
    ] {
        expected.push(("intent_worker_ledger_errors_total", vec![("operation", op)]));
    }
    for reason in [
        "delivery_limit",
        "invalid_message",
        "tenant_mismatch",
        "unknown_tool",
    ] {
        expected.push((
            "intent_worker_dead_letter_refused_total",
            vec![("reason", reason)],
        ));
        expected.push((
            "intent_worker_dead_lettered_total",
            vec![("reason", reason)],
        ));
    }
    for tool in ["refund", "ticket", "deploy"] {
        expected.push((
            "intent_worker_retry_budget_deferrals_total",
            vec![("tool", tool)],
        ));
        for kind in ["first", "retry", "replay"] {
            expected.push((
                "intent_worker_stale_sends_abandoned_total",
                vec![("tool", tool), ("kind", kind)],
            ));
        }
        for kind in ["write", "lookup"] {
            expected.push((
                "intent_worker_local_resource_errors_total",
                vec![("tool", tool), ("kind", kind)],
            ));
        }
        for action in ["lookup", "replay", "hold", "stored_receipt"] {
            expected.push((
                "intent_worker_recovery_actions_total",
                vec![("tool", tool), ("action", action)],
            ));
        }
        for outcome in ["done", "failed", "running", "unproven", "local_exhaustion"] {
            expected.push((
                "intent_worker_polls_total",
                vec![("tool", tool), ("outcome", outcome)],
            ));
        }
        expected.push(("intent_worker_async_deadlines_total", vec![("tool", tool)]));
        for outcome in ["requested", "approved", "rejected", "expired"] {
            expected.push((
                "intent_worker_approvals_total",
                vec![("tool", tool), ("outcome", outcome)],
            ));
        }
    }
    let missing: Vec<String> = expected
        .iter()
        .filter(|(name, labels)| series(&text, name, labels) != Some(0.0))
        .map(|(name, labels)| format!("{name}{labels:?}"))
        .collect();
    assert!(
        missing.is_empty(),
        "series not exported at 0 on a fresh worker: {missing:#?}\n{text}"
    );
    // Ready: both links up and the ledger answers.
    assert_eq!(
        series(&text, "intent_worker_ready", &[]),
        Some(1.0),
        "{text}"
    );
    drop(w);
    cleanup(env).await;
}

/// `intent_worker_ready` (what IntentWorkerNotReady reads) follows readiness on every scrape:
/// 0 while the broker link is cut, 1 again once it is back.
#[tokio::test]
async fn ready_gauge_follows_a_cut_broker_link() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let broker = env
        .amqp_url
        .rsplit_once('@')
        .map_or(env.amqp_url.as_str(), |(_, r)| r)
        .split('/')
        .next()
        .unwrap()
        .to_string();
    let proxy = FaultProxy::start(&broker).await;
    let url = env.amqp_url.replacen(&broker, &proxy.addr().to_string(), 1);
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .with_metrics()
        .amqp_url(&url);
    let w = Worker::start(&env, "w", &opts).await;
    let ready = |want: f64| {
        let w = &w;
        async move {
            let text = w.metrics().await;
            (series(&text, "intent_worker_ready", &[]) == Some(want)).then_some(())
        }
    };
    wait_for("intent_worker_ready 1", T, || ready(1.0)).await;
    proxy.cut();
    wait_for("intent_worker_ready 0 while the broker is cut", T, || {
        ready(0.0)
    })
    .await;
    proxy.restore();
    wait_for("intent_worker_ready 1 once the broker is back", T, || {
        ready(1.0)
    })
    .await;
    drop(w);
    cleanup(env).await;
}

/// Runs the worker until it exits (or `T`), returning its exit code and output.
async fn run_until_exit(env: &Env, opts: &WorkerOptions) -> (Option<i32>, String) {
    let mut w = Worker::spawn(env, "w", opts);
    let deadline = tokio::time::Instant::now() + T;
    let code = loop {
        if let Some(status) = w.exit_status() {
            break status.code();
        }
        if tokio::time::Instant::now() > deadline {
            panic!(
                "worker still running after {T:?}; output:\n{}",
                w.output.text()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    (code, w.output.text())
}

/// The final `worker: ...` line the binary prints on a fatal error.
fn fatal_line(output: &str) -> String {
    output
        .lines()
        .rev()
        .find_map(|l| l.split_once("worker: ").map(|(_, m)| m.to_string()))
        .unwrap_or_else(|| panic!("no fatal error line in:\n{output}"))
}

#[tokio::test]
async fn missing_tools_file_names_the_cause_once() {
    let env = Env::new().await;
    let opts = WorkerOptions::new(PathBuf::from("/nonexistent/tools.toml"));
    let (code, output) = run_until_exit(&env, &opts).await;
    assert_eq!(code, Some(2), "a configuration error: {output}");
    let line = fatal_line(&output);
    assert!(
        line.starts_with("configuration error: cannot read tools file /nonexistent/tools.toml: "),
        "{line}"
    );
    assert_eq!(
        line.matches("No such file or directory").count(),
        1,
        "{line}"
    );
    cleanup(env).await;
}

#[tokio::test]
async fn wrong_rabbitmq_password_is_refused_credentials_not_unreachable() {
    let env = Env::new().await;
    let url = env.amqp_url.clone();
    let (scheme, rest) = url.split_once("://").unwrap();
    let host = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let wrong = format!("{scheme}://guest:not-the-password@{host}");
    let opts = WorkerOptions::new(env.standard_tools(1, "")).amqp_url(&wrong);
    let (code, output) = run_until_exit(&env, &opts).await;
    assert_eq!(code, Some(1), "{output}");
    let line = fatal_line(&output);
    assert!(
        line.contains("refused the credentials of user \"guest\""),
        "{line}"
    );
    assert_eq!(
        line.matches("ACCESS_REFUSED - Login was refused").count(),
        1,
        "{line}"
    );
    assert!(
        !line.contains("not-the-password"),
        "password leaked: {line}"
    );
    assert!(!output.contains("not reachable"), "{output}");
    cleanup(env).await;
}

#[tokio::test]
async fn wrong_postgres_user_is_refused_credentials_not_unreachable() {
    let env = Env::new().await;
    let db = env
        .db_url
        .replacen("postgres://postgres@", "postgres://no_such_role_e2e@", 1);
    assert_ne!(
        db, env.db_url,
        "unexpected test database URL {}",
        env.db_url
    );
    let opts = WorkerOptions::new(env.standard_tools(1, "")).database_url(&db);
    let (code, output) = run_until_exit(&env, &opts).await;
    assert_eq!(code, Some(1), "{output}");
    let line = fatal_line(&output);
    assert!(
        line.contains("Postgres refused the credentials of user \"no_such_role_e2e\""),
        "{line}"
    );
    assert_eq!(
        line.matches("no_such_role_e2e\" does not exist").count(),
        1,
        "{line}"
    );
    assert!(!output.contains("not reachable"), "{output}");
    cleanup(env).await;
}

fn repo_file(path: &str) -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// Every alert links to a runbook section that exists (`## AlertName` in deploy/RUNBOOK.md).
#[test]
fn every_alert_has_a_runbook_url_into_the_runbook() {
    let alerts = repo_file("deploy/prometheus/alerts.yml");
    let runbook = repo_file("deploy/RUNBOOK.md");
    let anchors: Vec<String> = runbook
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(|h| h.trim().to_lowercase())
        .collect();
    let rules = alerts.matches("- alert: ").count();
    let urls: Vec<&str> = alerts
        .lines()
        .filter_map(|l| l.trim().strip_prefix("runbook_url: "))
        .collect();
    assert!(rules > 0);
    assert_eq!(urls.len(), rules, "an alert without runbook_url");
    for url in urls {
        let anchor = url
            .trim_matches('"')
            .strip_prefix("deploy/RUNBOOK.md#")
            .unwrap_or_else(|| panic!("runbook_url {url} does not point into deploy/RUNBOOK.md"));
        assert!(
            anchors.iter().any(|a| a == anchor),
            "deploy/RUNBOOK.md has no section for #{anchor}"
        );
    }
}

/// The dashboard is portable: datasource variables used by every panel (Prometheus, and the
/// ledger for the held operations' table), job, instance and tool variables, and the trace
/// viewer's address; the panels for what an alert reads exist, and held operations link to
/// their traces.
#[test]
fn dashboard_has_variables_and_the_alert_panels() {
    let d: serde_json::Value = serde_json::from_str(&repo_file("deploy/grafana/dashboard.json"))
        .expect("dashboard.json is JSON");
    let vars: Vec<&str> = d["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(
        vars,
        [
            "datasource",
            "job",
            "instance",
            "tool",
            "ledger",
            "trace_viewer"
        ]
    );
    let panels = d["panels"].as_array().unwrap();
    let mut exprs = String::new();
    let mut sql = String::new();
    for p in panels.iter().filter(|p| p["type"] != "row") {
        let uid = p["datasource"]["uid"].as_str().unwrap_or_default();
        assert!(
            uid == "${datasource}" || uid == "${ledger}",
            "panel {} does not use a datasource variable",
            p["title"]
        );
        for t in p["targets"].as_array().unwrap() {
            if uid == "${ledger}" {
                sql.push_str(t["rawSql"].as_str().unwrap());
            } else {
                exprs.push_str(t["expr"].as_str().unwrap());
            }
            exprs.push('\n');
        }
    }
    // The ledger is read through a role granted only these columns (docker-compose.yml).
    for private in ["arguments", "receipt", "evidence", "call_id"] {
        assert!(!sql.contains(private), "the ledger panel reads {private}");
    }
    let held = panels
        .iter()
        .find(|p| p["title"] == "Held and unknown operations")
        .expect("the held operations table");
    let links = held["fieldConfig"]["overrides"].to_string();
    assert!(links.contains("${trace_viewer}${__value.raw}"), "{links}");
    for metric in [
        "intent_worker_ledger_errors_total",
        "intent_worker_late_receipts_total",
        "intent_worker_stale_writes_total",
        "intent_worker_stale_sends_abandoned_total",
        "intent_worker_recovery_actions_total",
        "intent_worker_results_unroutable_total",
        "intent_worker_ready",
        "intent_worker_polls_total",
        "intent_worker_async_deadlines_total",
        "intent_worker_approvals_total",
        "rabbitmq_detailed_queue_messages",
        "rabbitmq_detailed_queue_consumers",
    ] {
        assert!(exprs.contains(metric), "no panel reads {metric}");
    }
}
