//! Does the worker run behind PgBouncer in transaction pooling mode? A
//! PgBouncer of the test's own (own port, own config in the test's directory, pointing at the
//! shared Postgres, which is not reconfigured). Skipped, saying so, when `pgbouncer` is not
//! installed (`apt-get install pgbouncer`). Migrations run against Postgres directly (sqlx takes a
//! session advisory lock for them, which transaction pooling cannot keep).
//!
//! What it measures is printed and asserted: with PgBouncer < 1.21 (no
//! `max_prepared_statements`) sqlx's named prepared statements break, and the worker must refuse
//! at start-up saying so; with >= 1.21 and `max_prepared_statements` set, every intent must
//! succeed exactly once.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use e2e::procs::{bin_dir, free_port};
use e2e::{cleanup, Agent, Downstream, Env, Worker, WorkerOptions};
use serde_json::json;

struct Bouncer(Child);

impl Drop for Bouncer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn pgbouncer_binary() -> Option<String> {
    [
        "/usr/sbin/pgbouncer",
        "/usr/bin/pgbouncer",
        "/usr/local/bin/pgbouncer",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .map(str::to_string)
}

/// PgBouncer version as (major, minor).
fn version(bin: &str) -> (u32, u32) {
    let out = Command::new(bin).arg("--version").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let v = text
        .split_whitespace()
        .nth(1)
        .unwrap_or("0.0")
        .split('.')
        .map(|p| p.parse().unwrap_or(0))
        .collect::<Vec<u32>>();
    (v[0], v.get(1).copied().unwrap_or(0))
}

#[tokio::test]
async fn the_worker_behind_pgbouncer_in_transaction_mode() {
    behind_pgbouncer("transaction").await;
}

/// Session pooling keeps a server connection per client connection: it works with any version.
#[tokio::test]
async fn the_worker_behind_pgbouncer_in_session_mode() {
    behind_pgbouncer("session").await;
}

async fn behind_pgbouncer(mode: &str) {
    let Some(bin) = pgbouncer_binary() else {
        eprintln!("SKIPPED: pgbouncer is not installed");
        return;
    };
    let (major, minor) = version(&bin);
    let env = Env::new().await;
    let dir = tempdir(&env);
    let port = free_port();
    let pg = env
        .db_url
        .rsplit_once('@')
        .map(|(_, r)| r)
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_string();
    let (host, pg_port) = pg.split_once(':').unwrap();
    let prepared = if (major, minor) >= (1, 21) {
        "max_prepared_statements = 200\n"
    } else {
        ""
    };
    let ini = format!(
        "[databases]\n{db} = host={host} port={pg_port} dbname={db} user=postgres\n\
         [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
         auth_type = any\npool_mode = {mode}\ndefault_pool_size = 12\nmax_client_conn = 100\n\
         ignore_startup_parameters = extra_float_digits,options\n{prepared}\
         logfile = {dir}/pgbouncer.log\npidfile = {dir}/pgbouncer.pid\n",
        db = env.db_name,
        dir = dir.display(),
    );
    std::fs::write(dir.join("pgbouncer.ini"), ini).unwrap();
    // PgBouncer refuses to run as root: drop to `nobody` then (the directory is theirs too).
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    let mut cmd = Command::new(&bin);
    if root {
        let _ = Command::new("chmod").arg("777").arg(&dir).status();
        cmd.args(["-u", "nobody"]);
    }
    let _bouncer = Bouncer(
        cmd.arg(dir.join("pgbouncer.ini"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start pgbouncer"),
    );
    e2e::wait_for("pgbouncer to listen", Duration::from_secs(10), || async {
        std::net::TcpStream::connect(("127.0.0.1", port))
            .ok()
            .map(|_| ())
    })
    .await;

    // Migrations directly against Postgres (session advisory lock), as documented.
    let status = Command::new(bin_dir().join("worker"))
        .arg("migrate")
        .env_clear()
        .env("DATABASE_URL", &env.db_url)
        .env("RUST_LOG", "warn")
        .status()
        .unwrap();
    assert!(status.success());

    let ds = Downstream::start(&env).await;
    let via_bouncer = format!("postgres://postgres@127.0.0.1:{port}/{}", env.db_name);
    let opts = WorkerOptions::new(env.standard_tools(ds.port, ""))
        .database_url(&via_bouncer)
        .env("WORKER_MIGRATE", "false");
    let works = mode == "session" || (major, minor) >= (1, 21);
    if !works {
        // Refused loudly at start-up, naming the cause and the fix; nothing half-works.
        let mut w = Worker::spawn(&env, "w", &opts);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = w.exit_status() {
                break s;
            }
            assert!(std::time::Instant::now() < deadline, "{}", w.output.text());
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let out = w.output.text();
        eprintln!("PgBouncer {major}.{minor} {mode} mode: worker exited {status}: {out}");
        assert!(!status.success());
        assert!(
            out.contains("prepared statement") && out.contains("max_prepared_statements"),
            "{out}"
        );
        cleanup(env).await;
        return;
    }
    let w = Worker::start(&env, "w", &opts).await;
    let mut agent = Agent::new(&env, &["north-shop"]).await;
    const N: usize = 200;
    for i in 0..N {
        agent
            .request(
                "north-shop",
                &format!("b-{i}"),
                "refund",
                json!({"order": i}),
            )
            .await;
    }
    e2e::wait_for(
        "every operation succeeded",
        Duration::from_secs(60),
        || async {
            let ok = sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM operations WHERE state = 'succeeded'",
            )
            .fetch_one(&env.pool)
            .await
            .unwrap();
            (ok as usize == N).then_some(())
        },
    )
    .await;
    eprintln!("PgBouncer {major}.{minor} {mode} mode: {N}/{N} succeeded");
    let _ = agent.succeeded("north-shop", "b-0").await;
    let counts: (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT idem_key) FROM downstream.mutations")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        counts,
        (N as i64, N as i64),
        "one business change per action"
    );
    drop(w);
    cleanup(env).await;
}

fn tempdir(env: &Env) -> std::path::PathBuf {
    let dir = env.dir.join("pgbouncer");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
