//! `worker check-tool NAME` against the reference downstream. Each honest mode
//! passes for its capability; each broken mode (downstream/README.md, "Broken modes") fails
//! with the right message and exit code 1; without `--confirm-writes` nothing is sent.
//! Counts come from the downstream's own tables.

use std::process::Command;

use e2e::{cleanup, procs::bin_dir, Downstream, Env};
use serde_json::Value;

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// One tool `t` with the given capability lines, against `path` on the downstream.
fn tools(env: &Env, ds: &Downstream, path: &str, capability: &str) -> std::path::PathBuf {
    let base = format!("http://127.0.0.1:{}", ds.port);
    let capability = capability.replace("{base}", &base);
    env.write_tools(&format!(
        "[tools.t]\nurl = \"{base}{path}\"\nreceipt_id = \"/receipt_id\"\n\
         receipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\n\
         timeout_ms = 5000\n{capability}\n"
    ))
}

const REPLAY: &str = "recovery = \"replay\"\nreplay_window_secs = 3600";

fn lookup(mode: &str, resource: &str) -> String {
    format!("recovery = \"lookup\"\nlookup_url = \"{{base}}/{mode}/{resource}/by-key/{{key}}\"")
}

async fn check(tools: &std::path::Path, args: &[&str]) -> Run {
    let mut cmd = Command::new(bin_dir().join("worker"));
    cmd.arg("check-tool")
        .args(args)
        .env("WORKER_TOOLS", tools)
        // check-tool needs only the tools file.
        .env_remove("DATABASE_URL");
    let out = tokio::task::spawn_blocking(move || cmd.output().expect("run worker check-tool"))
        .await
        .unwrap();
    let run = Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    eprintln!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        run.code, run.stdout, run.stderr
    );
    run
}

/// The line `"<VERDICT> <probe>: ..."` of a text report.
fn line<'a>(run: &'a Run, probe: &str) -> &'a str {
    run.stdout
        .lines()
        .find(|l| {
            l.split_once(' ')
                .is_some_and(|(_, rest)| rest.starts_with(&format!("{probe}:")))
        })
        .unwrap_or_else(|| panic!("no {probe} line in:\n{}", run.stdout))
}

fn verdict<'a>(run: &'a Run, probe: &str) -> &'a str {
    line(run, probe).split(' ').next().unwrap()
}

async fn count(env: &Env, sql: &'static str, arg: &str) -> i64 {
    sqlx::query_scalar(sql)
        .bind(arg)
        .fetch_one(&env.pool)
        .await
        .unwrap()
}

/// Business changes the downstream made for one probe of a run.
async fn mutations(env: &Env, run: &str, probe: &str) -> i64 {
    count(
        env,
        "SELECT count(*) FROM downstream.mutations WHERE idem_key = $1",
        &format!("intent-worker-probe:probe-{run}-{probe}"),
    )
    .await
}

fn run_id(run: &Run) -> String {
    let first = run.stdout.lines().next().unwrap();
    first.rsplit(' ').next().unwrap().to_owned()
}

#[tokio::test]
async fn refuses_without_the_confirmation_flag_and_sends_nothing() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let path = tools(&env, &ds, "/replay/refunds", REPLAY);
    let run = check(&path, &["t"]).await;
    assert_eq!(run.code, Some(2));
    assert!(run.stderr.contains("--confirm-writes"), "{}", run.stderr);
    assert!(run.stdout.is_empty());
    let sent = count(
        &env,
        "SELECT count(*) FROM downstream.requests WHERE coalesce(idem_key, '') <> $1",
        "",
    )
    .await;
    let all: i64 = sqlx::query_scalar("SELECT count(*) FROM downstream.requests")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!((sent, all), (0, 0), "no request may reach the downstream");
    // An unknown tool is a usage error too.
    let run = check(&path, &["nope", "--confirm-writes"]).await;
    assert_eq!(run.code, Some(2));
    assert!(run.stderr.contains("no tool \"nope\""), "{}", run.stderr);
    cleanup(env).await;
}

#[tokio::test]
async fn honest_replay_passes_and_writes_once_per_key() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let path = tools(&env, &ds, "/replay/refunds", REPLAY);
    let run = check(&path, &["t", "--confirm-writes"]).await;
    assert_eq!(run.code, Some(0));
    for p in [
        "first-write",
        "replay-same-request",
        "replay-different-body",
        "replay-concurrent",
    ] {
        assert_eq!(verdict(&run, p), "PASS", "{p}");
    }
    assert!(line(&run, "replay-different-body").contains("422"));
    assert_eq!(verdict(&run, "no-idempotency-key"), "INFO");
    assert!(line(&run, "no-idempotency-key").contains("refused with 400"));
    assert_eq!(verdict(&run, "problem-json"), "INFO");
    assert!(line(&run, "problem-json").contains("do not all carry application/problem+json"));
    assert!(run.stdout.contains("0 FAIL"));
    // Retention cannot be probed; the report says so instead of passing it.
    assert_eq!(verdict(&run, "replay-window"), "INFO");
    assert!(line(&run, "replay-window").contains("replay_window_secs = 3600"));
    let id = run_id(&run);
    assert_eq!(mutations(&env, &id, "first-write").await, 1);
    assert_eq!(mutations(&env, &id, "concurrent").await, 1);
    // Probes say they are probes: every key the downstream saw is the probe tenant's.
    let foreign = count(
        &env,
        "SELECT count(*) FROM downstream.requests WHERE idem_key NOT LIKE $1",
        "intent-worker-probe:probe-%",
    )
    .await;
    assert_eq!(foreign, 0);
    cleanup(env).await;
}

#[tokio::test]
async fn honest_lookup_and_none_pass_and_json_is_machine_readable() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let path = tools(&env, &ds, "/lookup/tickets", &lookup("lookup", "tickets"));
    let run = check(&path, &["t", "--confirm-writes", "--json"]).await;
    assert_eq!(run.code, Some(0));
    let report: Value = serde_json::from_str(run.stdout.trim()).unwrap();
    assert_eq!(report["ok"], true);
    assert_eq!(report["capability"], "lookup");
    assert_eq!(report["tenant"], "intent-worker-probe");
    let verdicts: Vec<(String, String)> = report["probes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_owned(),
                p["verdict"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let want = [
        ("first-write", "PASS"),
        ("lookup-written", "PASS"),
        ("lookup-never-written", "PASS"),
        ("no-idempotency-key", "INFO"),
        ("problem-json", "INFO"),
    ];
    assert_eq!(
        verdicts,
        want.map(|(a, b)| (a.to_owned(), b.to_owned())).to_vec()
    );
    let run_id = report["run"].as_str().unwrap();
    assert_eq!(mutations(&env, run_id, "first-write").await, 1);

    let path = tools(&env, &ds, "/none/deploys", "recovery = \"none\"");
    let run = check(&path, &["t", "--confirm-writes"]).await;
    assert_eq!(run.code, Some(0));
    assert_eq!(verdict(&run, "first-write"), "PASS");
    // The none endpoint accepts a keyless write: worth knowing, not a contradiction.
    assert!(line(&run, "no-idempotency-key").contains("accepted"));
    assert!(!run.stdout.contains("receipt-match"));

    // The warned opt-out `receipt_match = {}` is named in the report.
    let path = env.write_tools(&format!(
        "[tools.t]\nurl = \"http://127.0.0.1:{}/none/deploys\"\nreceipt_id = \"/receipt_id\"\n\
         receipt_match = {{}}\nrecovery = \"none\"\n",
        ds.port
    ));
    let run = check(&path, &["t", "--confirm-writes"]).await;
    assert_eq!(run.code, Some(0));
    assert_eq!(verdict(&run, "receipt-match"), "INFO");
    assert!(line(&run, "receipt-match").contains("another operation would be accepted"));
    cleanup(env).await;
}

#[tokio::test]
async fn a_downstream_that_does_not_replay_fails_the_replay_probe() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let path = tools(&env, &ds, "/replay-new-receipt/refunds", REPLAY);
    let run = check(&path, &["t", "--confirm-writes"]).await;
    assert_eq!(run.code, Some(1));
    assert_eq!(verdict(&run, "first-write"), "PASS");
    assert_eq!(verdict(&run, "replay-same-request"), "FAIL");
    assert!(line(&run, "replay-same-request")
        .contains("this downstream does not replay; declare `lookup` or `none`"));
    assert!(run
        .stdout
        .contains("a probe FAILed: do not rely on recovery = \"replay\" for this downstream"));
    // The probe really did apply twice: that is what it caught.
    assert!(mutations(&env, &run_id(&run), "first-write").await >= 2);

    // A `replay` tool pointed at a plain endpoint is caught the same way.
    let path = tools(&env, &ds, "/none/refunds", REPLAY);
    let run = check(&path, &["t", "--confirm-writes", "--json"]).await;
    assert_eq!(run.code, Some(1));
    let report: Value = serde_json::from_str(run.stdout.trim()).unwrap();
    assert_eq!(report["ok"], false);
    let replay = report["probes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "replay-same-request")
        .unwrap();
    assert_eq!(replay["verdict"], "FAIL");
    cleanup(env).await;
}

#[tokio::test]
async fn a_key_ignored_when_the_body_differs_fails() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let path = tools(&env, &ds, "/replay-ignores-body/refunds", REPLAY);
    let run = check(&path, &["t", "--confirm-writes"]).await;
    assert_eq!(run.code, Some(1));
    assert_eq!(verdict(&run, "replay-same-request"), "PASS");
    assert_eq!(verdict(&run, "replay-different-body"), "FAIL");
    assert!(line(&run, "replay-different-body")
        .contains("the key is ignored when the body differs; expected 409 or 422"));
    assert_eq!(mutations(&env, &run_id(&run), "first-write").await, 2);
    cleanup(env).await;
}

#[tokio::test]
async fn no_conflict_under_concurrency_fails() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let path = tools(&env, &ds, "/replay-racy/refunds", REPLAY);
    let run = check(&path, &["t", "--confirm-writes"]).await;
    assert_eq!(run.code, Some(1));
    // Sequential replays and body checks look fine: only concurrency gives it away.
    assert_eq!(verdict(&run, "replay-same-request"), "PASS");
    assert_eq!(verdict(&run, "replay-different-body"), "PASS");
    assert_eq!(verdict(&run, "replay-concurrent"), "FAIL");
    assert!(line(&run, "replay-concurrent").contains("same-key requests are not serialised"));
    assert_eq!(mutations(&env, &run_id(&run), "concurrent").await, 2);
    cleanup(env).await;
}

#[tokio::test]
async fn a_lookup_that_answers_200_for_unknown_keys_fails() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let path = tools(
        &env,
        &ds,
        "/lookup-phantom/tickets",
        &lookup("lookup-phantom", "tickets"),
    );
    let run = check(&path, &["t", "--confirm-writes"]).await;
    assert_eq!(run.code, Some(1));
    assert_eq!(verdict(&run, "lookup-written"), "PASS");
    assert_eq!(verdict(&run, "lookup-never-written"), "FAIL");
    assert!(
        line(&run, "lookup-never-written").contains("a lookup miss would become a false success")
    );
    assert_eq!(mutations(&env, &run_id(&run), "never-written").await, 0);
    cleanup(env).await;
}

#[tokio::test]
async fn no_accepted_receipt_on_the_first_write_fails_and_skips_the_capability_probes() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    // The downstream commits but answers with someone else's receipt: the worker's own receipt
    // check refuses it, and so does the checker.
    ds.fault(serde_json::json!({"kind": "wrong_receipt"})).await;
    let path = tools(&env, &ds, "/replay/refunds", REPLAY);
    let run = check(&path, &["t", "--confirm-writes"]).await;
    assert_eq!(run.code, Some(1));
    assert_eq!(verdict(&run, "first-write"), "FAIL");
    assert!(line(&run, "first-write").contains("no receipt that receipt_id and receipt_match"));
    assert!(
        run.stdout.contains("is for another operation"),
        "the evidence says why"
    );
    assert_eq!(verdict(&run, "capability"), "INFO");
    assert!(!run.stdout.contains("replay-same-request"));

    // Nothing listening: still a FAIL with exit 1, not a crash.
    let port = e2e::free_port();
    let path = env.write_tools(&format!(
        "[tools.t]\nurl = \"http://127.0.0.1:{port}/replay/refunds\"\nreceipt_id = \"/receipt_id\"\n\
         receipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\n{REPLAY}\n"
    ));
    let run = check(&path, &["t", "--confirm-writes"]).await;
    assert_eq!(run.code, Some(1));
    assert!(line(&run, "first-write").starts_with("FAIL"));
    assert!(run.stdout.contains("not_sent"), "{}", run.stdout);

    // A --body that is not a JSON object is refused before anything is sent.
    let run = check(&path, &["t", "--confirm-writes", "--body", "[1,2]"]).await;
    assert_eq!(run.code, Some(2));
    assert!(run.stderr.contains("--body must be a JSON object"));
    cleanup(env).await;
}

const PROOF: &str = "absence_proof = { deadline_ms = 8000, clock_skew_ms = 500, settle_ms = 200 }";

#[tokio::test]
async fn a_lookup_that_honours_deadlines_passes_the_absence_proof_probes() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let capability = format!("{}\n{PROOF}", lookup("lookup", "tickets"));
    let path = tools(&env, &ds, "/lookup/tickets", &capability);
    let run = check(&path, &["t", "--confirm-writes"]).await;
    assert_eq!(run.code, Some(0));
    assert_eq!(verdict(&run, "deadline-live"), "PASS");
    assert_eq!(verdict(&run, "deadline-passed"), "PASS");
    assert!(line(&run, "deadline-passed").contains("refused with 422"));
    assert_eq!(verdict(&run, "clock-skew"), "INFO");
    let id = run_id(&run);
    assert_eq!(mutations(&env, &id, "first-write").await, 1);
    assert_eq!(mutations(&env, &id, "deadline-passed").await, 0);
    // The refused write did reach the downstream, with the deadline header, and was answered 422.
    let refused = count(
        &env,
        "SELECT count(*) FROM downstream.requests WHERE kind = 'write' AND status = 422 AND idem_key = $1",
        &format!("intent-worker-probe:probe-{id}-deadline-passed"),
    )
    .await;
    assert_eq!(refused, 1);
    cleanup(env).await;
}

#[tokio::test]
async fn a_lookup_that_ignores_deadlines_fails_the_absence_proof_probe() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let capability = format!("{}\n{PROOF}", lookup("lookup-ignores-deadline", "tickets"));
    let path = tools(&env, &ds, "/lookup-ignores-deadline/tickets", &capability);
    let run = check(&path, &["t", "--confirm-writes"]).await;
    assert_eq!(run.code, Some(1));
    // Everything a lookup tool needs holds; only the deadline is ignored.
    assert_eq!(verdict(&run, "lookup-written"), "PASS");
    assert_eq!(verdict(&run, "lookup-never-written"), "PASS");
    assert_eq!(verdict(&run, "deadline-live"), "PASS");
    assert_eq!(verdict(&run, "deadline-passed"), "FAIL");
    assert!(
        line(&run, "deadline-passed").contains("the downstream applied it"),
        "{}",
        run.stdout
    );
    assert_eq!(mutations(&env, &run_id(&run), "deadline-passed").await, 1);
    cleanup(env).await;
}
