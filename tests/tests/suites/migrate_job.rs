//! Schema migrations as a Kubernetes Job: workers started with `WORKER_MIGRATE=false` leave the schema to a
//! `worker migrate` Job and wait for it, instead of racing it or running on missing tables.

use std::process::Command;
use std::time::Duration;

use e2e::procs::bin_dir;
use e2e::{cleanup, Agent, Downstream, Env, Worker, WorkerOptions};
use serde_json::json;

async fn table_exists(env: &Env, name: &str) -> bool {
    sqlx::query_scalar::<_, bool>("SELECT to_regclass($1) IS NOT NULL")
        .bind(name)
        .fetch_one(&env.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn migrations_off_waits_for_the_migrate_job_then_runs() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let opts = WorkerOptions::new(env.standard_tools(ds.port, "")).env("WORKER_MIGRATE", "false");
    let mut w = Worker::spawn(&env, "w1", &opts);
    w.wait_output("waiting for `worker migrate`", Duration::from_secs(20))
        .await;
    assert!(w.is_running(), "the worker waits, it does not exit");
    assert!(
        !table_exists(&env, "operations").await,
        "a worker with WORKER_MIGRATE=false must not create the schema"
    );

    // The Job: `worker migrate` with nothing but DATABASE_URL.
    let status = Command::new(bin_dir().join("worker"))
        .arg("migrate")
        .env_clear()
        .env("DATABASE_URL", &env.db_url)
        .env("RUST_LOG", "warn")
        .status()
        .expect("run worker migrate");
    assert!(status.success(), "worker migrate: {status}");
    assert!(table_exists(&env, "operations").await);

    w.wait_ready().await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    agent
        .request(
            "north-shop",
            "refund-k8s-1",
            "refund",
            json!({"amount_cents": 100}),
        )
        .await;
    agent.succeeded("north-shop", "refund-k8s-1").await;
    assert_eq!(env.mutations("north-shop:refund-k8s-1").await, 1);
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn a_bad_worker_migrate_value_stops_start_up_naming_it() {
    let out = Command::new(bin_dir().join("worker"))
        .arg("run")
        .env_clear()
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .env("WORKER_MIGRATE", "sometimes")
        .output()
        .expect("run worker");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("WORKER_MIGRATE"), "{err}");
}

/// The tools file shipped in the Kubernetes ConfigMap must start a worker: parsed, built into
/// adapters and past the start-up refusals, with the Deployment's settings.
#[test]
fn the_k8s_tools_configmap_passes_the_workers_start_up_checks() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/k8s/base/configmap-tools.yaml");
    let yaml = std::fs::read_to_string(&path).expect("read the ConfigMap");
    // The block scalar under `tools.toml: |`, de-indented (no YAML parser in this crate).
    let mut lines = yaml
        .lines()
        .skip_while(|l| l.trim() != "tools.toml: |")
        .skip(1);
    let first = lines.next().expect("tools.toml has content");
    let indent = first.len() - first.trim_start().len();
    let toml: String = std::iter::once(first)
        .chain(
            lines.take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() >= indent),
        )
        .map(|l| format!("{}\n", l.get(indent..).unwrap_or("")))
        .collect();
    let tools = worker::config::Tools::parse(std::path::Path::new("tools.toml"), &toml)
        .unwrap_or_else(|e| panic!("{e}\n{toml}"));
    assert!(!tools.tools.is_empty());
    worker::adapter::ToolSet::from_config(&tools, &worker::tls::Trust::system())
        .expect("adapters build");
    // nextest runs each test in its own process, so setting the environment here is contained.
    std::env::set_var("DATABASE_URL", "postgres://unused@127.0.0.1/unused");
    let settings = worker::config::Settings::from_env().expect("settings");
    worker::config::check_proof(&settings, &tools).expect("start-up checks");
}

/// The Job's `worker migrate` whose link to Postgres is lost just after it connected (Postgres
/// restarting, a network settling) waits for the link as the worker's start-up does, applies
/// the migrations once it is back and exits 0: a Job that failed here would need a retry from
/// the orchestrator while the workers wait on it.
#[tokio::test]
async fn the_migrate_job_waits_out_a_link_lost_after_it_connected() {
    let env = Env::new().await;
    let pg = e2e::FaultProxy::start("127.0.0.1:5432").await;
    let via_proxy = env
        .db_url
        .replacen("127.0.0.1:5432", &pg.addr().to_string(), 1);
    assert_ne!(via_proxy, env.db_url);
    let log = env.dir.join("migrate.log");
    let mut job = Command::new(bin_dir().join("worker"))
        .arg("migrate")
        .env_clear()
        .env("DATABASE_URL", &via_proxy)
        .env("RUST_LOG", "info,sqlx=warn")
        .env("WORKER_FAULT_POINT", "after_ledger_connected")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("run worker migrate");
    let text = || std::fs::read_to_string(&log).unwrap_or_default();
    e2e::wait_for("the fault point", Duration::from_secs(20), || async {
        text()
            .contains("fault point reached: after_ledger_connected")
            .then_some(())
    })
    .await;
    pg.cut();
    let _ = Command::new("kill")
        .args(["-CONT", &job.id().to_string()])
        .status();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        job.try_wait().unwrap().is_none(),
        "worker migrate gave up on a lost link:\n{}",
        text()
    );
    assert!(
        text().contains("Postgres not reachable yet; retrying"),
        "{}",
        text()
    );
    assert!(!table_exists(&env, "operations").await);
    pg.restore();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = job.try_wait().unwrap() {
            break status;
        }
        assert!(std::time::Instant::now() < deadline, "{}", text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(status.success(), "worker migrate: {status}\n{}", text());
    assert!(table_exists(&env, "operations").await);
    cleanup(env).await;
}
