//! Child processes: the `worker` binary (built with fault points) and `reference-downstream`.
//! Both are killed when their handle drops. Worker stderr is captured so tests can wait for
//! a fault point announcement; it is printed when a test fails.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::env::Env;

/// Every process on this machine, by pid: the numeric entries of `/proc` (none when it cannot
/// be read). A process may be gone by the time its entries are read; callers skip those.
pub fn all_pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .collect()
}

/// Directory holding the workspace's built binaries: `INTENT_BIN_DIR` when set (e.g.
/// `target/release` for the throughput benchmark), else target/debug.
pub fn bin_dir() -> PathBuf {
    let dir = match std::env::var_os("INTENT_BIN_DIR").filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let exe = std::env::current_exe().expect("current exe");
            // target/debug/deps/e2e-<hash> -> target/debug
            exe.parent()
                .and_then(Path::parent)
                .expect("target dir")
                .to_path_buf()
        }
    };
    for bin in ["worker", "reference-downstream"] {
        assert!(
            dir.join(bin).exists(),
            "{} is missing: build the workspace first (cargo build --workspace, or with --release \
             for INTENT_BIN_DIR=target/release)",
            dir.join(bin).display()
        );
    }
    dir
}

/// The `publisher` binary: `PUBLISHER_BIN` when set (e.g. a release build, for the throughput
/// figure), else the one beside the worker in [`bin_dir`].
pub fn publisher_bin() -> PathBuf {
    let bin = std::env::var_os("PUBLISHER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| bin_dir().join("publisher"));
    assert!(
        bin.exists(),
        "{} missing: cargo build --workspace",
        bin.display()
    );
    bin
}

/// The example agent `demo-agent` (examples/demo-agent), beside the worker in [`bin_dir`]:
/// `cargo build --workspace` builds it (a test build of `-p e2e` alone does not).
pub fn demo_agent_bin() -> PathBuf {
    let bin = bin_dir().join("demo-agent");
    assert!(
        bin.exists(),
        "{} missing: cargo build --workspace (or -p demo-agent)",
        bin.display()
    );
    bin
}

/// `publisher relay` as a child process against the test's broker names and database
/// (`extra` overrides or adds variables); stderr goes to `<name>.log` in the test's directory.
/// Resumed (if stopped) and killed on drop.
pub struct RelayProc {
    pub child: Child,
    log: PathBuf,
}

impl RelayProc {
    pub fn spawn(env: &Env, name: &str, extra: &[(&str, &str)]) -> RelayProc {
        let log = env.dir.join(format!("{name}.log"));
        let mut cmd = Command::new(publisher_bin());
        cmd.arg("relay")
            .env_clear()
            .env("RUST_LOG", "info,lapin=warn,sqlx=warn")
            .env("AMQP_URL", &env.amqp_url)
            .env("PUBLISHER_DATABASE_URL", &env.db_url)
            .env("INTENTS_EXCHANGE", &env.topology.intents_exchange)
            .env("PUBLISHER_LEASE", "2s")
            .env("PUBLISHER_IDLE_POLL", "20ms")
            .env("PUBLISHER_METRICS_ADDR", "off")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        for (k, v) in extra {
            cmd.env(k, v);
        }
        RelayProc {
            child: cmd.spawn().expect("spawn publisher relay"),
            log,
        }
    }

    /// Everything the relay logged so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log contains `needle`; panics with the log after `timeout`.
    pub async fn wait_output(&self, needle: &str, timeout: Duration) {
        let deadline = std::time::Instant::now() + timeout;
        while !self.output().contains(needle) {
            assert!(
                std::time::Instant::now() < deadline,
                "relay did not print {needle:?}:\n{}",
                self.output()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RelayProc {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        self.kill();
    }
}

/// A port nothing listens on (yet).
pub fn free_port() -> u16 {
    free_ports(1)[0]
}

/// `n` distinct ports nothing listens on (yet), each held while the next is found, taken below
/// the kernel's ephemeral range: a port handed out by `bind(:0)` and released is in that range,
/// where any outgoing connection of a parallel test may take it as its local port before the
/// process it was meant for binds it (a RabbitMQ node then fails with `nodistribution`). Ports
/// from `bind(:0)` when the range leaves no room below it.
pub fn free_ports(n: usize) -> Vec<u16> {
    const LOWEST: u16 = 20_000;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let mut held: Vec<std::net::TcpListener> = Vec::with_capacity(n);
    let mut tries = 0;
    while held.len() < n {
        let port = if ephemeral_low > LOWEST + 1_000 && tries < 1_000 {
            tries += 1;
            fastrand::u16(LOWEST..ephemeral_low)
        } else {
            0
        };
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            held.push(l);
        }
    }
    held.iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

/// Captured output lines of a child, and how many of its streams are still open.
#[derive(Clone, Default)]
pub struct Output(Arc<Mutex<Vec<String>>>, Arc<std::sync::atomic::AtomicUsize>);

impl Output {
    pub(crate) fn capture(&self, stream: impl std::io::Read + Send + 'static, label: String) {
        let lines = self.0.clone();
        let open = self.1.clone();
        open.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if std::env::var("E2E_LOG").is_ok() {
                    eprintln!("[{label}] {line}");
                }
                lines.lock().unwrap().push(line);
            }
            open.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        });
    }

    /// Waits (up to 5 s) until every captured stream has ended: after the child exits, its
    /// last lines may still be on their way through the pipe.
    pub fn wait_closed(&self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while self.1.load(std::sync::atomic::Ordering::SeqCst) > 0
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    pub fn contains(&self, needle: &str) -> bool {
        self.0.lock().unwrap().iter().any(|l| l.contains(needle))
    }

    pub fn text(&self) -> String {
        self.0.lock().unwrap().join("\n")
    }
}

/// How to start a worker.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub tools: PathBuf,
    pub lease_secs: u64,
    pub recovery_interval_ms: u64,
    pub prefetch: u16,
    pub delivery_limit: u32,
    /// Fault point name and optional action id (see worker/src/fault.rs).
    pub fault: Option<(String, Option<String>)>,
    pub metrics: bool,
    /// Admin API bearer token; the API listens on a free port when set.
    pub admin_token: Option<String>,
    pub extra_env: BTreeMap<String, String>,
}

impl WorkerOptions {
    pub fn new(tools: PathBuf) -> WorkerOptions {
        WorkerOptions {
            tools,
            // Above the standard tools' 2 s timeout: a tool timeout at or above the lease is
            // refused at start-up.
            lease_secs: 3,
            recovery_interval_ms: 200,
            prefetch: 32,
            delivery_limit: 5,
            fault: None,
            metrics: false,
            admin_token: None,
            extra_env: BTreeMap::new(),
        }
    }

    pub fn fault(mut self, point: &str, action_id: Option<&str>) -> Self {
        self.fault = Some((point.to_string(), action_id.map(str::to_string)));
        self
    }

    pub fn with_metrics(mut self) -> Self {
        self.metrics = true;
        self
    }

    pub fn with_admin(mut self, token: &str) -> Self {
        self.admin_token = Some(token.to_string());
        self
    }

    pub fn env(mut self, k: &str, v: &str) -> Self {
        self.extra_env.insert(k.to_string(), v.to_string());
        self
    }

    /// Connects the worker to RabbitMQ through `url` (e.g. a [`crate::FaultProxy`]) instead of
    /// the test's broker URL.
    pub fn amqp_url(self, url: &str) -> Self {
        self.env("AMQP_URL", url)
    }

    /// Connects the worker's ledger through `url` instead of the test database's URL.
    pub fn database_url(self, url: &str) -> Self {
        self.env("DATABASE_URL", url)
    }
}

/// A running worker process.
pub struct Worker {
    child: Child,
    pub name: String,
    pub output: Output,
    pub metrics_port: Option<u16>,
    pub admin_port: Option<u16>,
}

impl Worker {
    /// Starts a worker and waits until it consumes.
    pub async fn start(env: &Env, name: &str, opts: &WorkerOptions) -> Worker {
        // The metrics and admin ports are picked here and bound by the worker: free when picked,
        // a test in another process may take one before the worker binds it (a port cannot be
        // held across exec). The worker then exits naming the address; it is started again on
        // fresh ports, and only for that reason.
        for _ in 0..3 {
            let w = Worker::spawn(env, name, opts);
            if w.ready_unless_port_taken().await {
                return w;
            }
        }
        panic!("worker {name}: its listening ports were taken three times in a row");
    }

    /// Waits for "consuming intents"; false when the worker stopped because an address it was
    /// given is in use.
    async fn ready_unless_port_taken(&self) -> bool {
        let timeout = Duration::from_secs(30);
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.output.contains("consuming intents") {
                return true;
            }
            let text = self.output.text();
            if text.contains("cannot listen there: Address already in use") {
                return false;
            }
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "worker {} did not print \"consuming intents\" within {timeout:?}; output:\n{text}",
                    self.name
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts a worker without waiting.
    pub fn spawn(env: &Env, name: &str, opts: &WorkerOptions) -> Worker {
        let t = &env.topology;
        let metrics_port = opts.metrics.then(free_port);
        let admin_port = opts.admin_token.as_ref().map(|_| free_port());
        let mut cmd = Command::new(bin_dir().join("worker"));
        cmd.arg("run")
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("RUST_LOG", "info,lapin=warn,sqlx=warn")
            .env("DATABASE_URL", &env.db_url)
            .env("AMQP_URL", &env.amqp_url)
            .env("WORKER_TOOLS", &opts.tools)
            .env("WORKER_ID", format!("{name}-{}", env.id))
            .env("WORKER_PREFETCH", opts.prefetch.to_string())
            .env("WORKER_LEASE_SECS", opts.lease_secs.to_string())
            .env(
                "WORKER_RECOVERY_INTERVAL_MS",
                opts.recovery_interval_ms.to_string(),
            )
            .env("WORKER_DELIVERY_LIMIT", opts.delivery_limit.to_string())
            .env("INTENTS_EXCHANGE", &t.intents_exchange)
            .env("WORKER_INTENTS_QUEUE", &t.intents_queue)
            .env("RESULTS_EXCHANGE", &t.results_exchange)
            .env("WORKER_DEAD_LETTER_EXCHANGE", &t.dead_letter_exchange)
            .env("WORKER_DEAD_LETTER_QUEUE", &t.dead_letter_queue)
            .env("WORKER_SHUTDOWN_GRACE_SECS", "5")
            // Four connections, not the default ten: tests run several at a time against one
            // shared Postgres (100 connections), and a worker opens its whole pool at start.
            .env("WORKER_DB_POOL_SIZE", "4")
            .env(
                "WORKER_ADMIN_ADDR",
                admin_port.map_or("off".to_string(), |p| format!("127.0.0.1:{p}")),
            )
            .env(
                "METRICS_ADDR",
                metrics_port.map_or("off".to_string(), |p| format!("127.0.0.1:{p}")),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some((point, action)) = &opts.fault {
            cmd.env("WORKER_FAULT_POINT", point);
            if let Some(a) = action {
                cmd.env("WORKER_FAULT_ACTION", a);
            }
        }
        if let Some(token) = &opts.admin_token {
            cmd.env("WORKER_ADMIN_TOKEN", token);
        }
        for (k, v) in &opts.extra_env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn worker");
        let output = Output::default();
        output.capture(child.stderr.take().unwrap(), name.to_string());
        output.capture(child.stdout.take().unwrap(), name.to_string());
        Worker {
            child,
            name: name.to_string(),
            output,
            metrics_port,
            admin_port,
        }
    }

    pub async fn wait_ready(&self) {
        self.wait_output("consuming intents", Duration::from_secs(30))
            .await;
    }

    /// Waits until the worker printed `needle` (e.g. "fault point reached").
    pub async fn wait_output(&self, needle: &str, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        while !self.output.contains(needle) {
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "worker {} did not print {needle:?} within {timeout:?}; output:\n{}",
                    self.name,
                    self.output.text()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// How the process ended, or `None` while it runs.
    /// The exit status once the process has ended, with its output read to the end.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.child.try_wait().ok().flatten()?;
        self.output.wait_closed();
        Some(status)
    }

    /// SIGKILL: no cleanup, no goodbye, like a crash.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGSTOP / SIGCONT.
    pub fn pause(&self) {
        signal(self.pid(), "STOP");
    }

    pub fn resume(&self) {
        signal(self.pid(), "CONT");
    }

    /// SIGTERM and wait for a graceful exit; returns the exit status code.
    pub fn terminate(&mut self, timeout: Duration) -> Option<i32> {
        signal(self.pid(), "TERM");
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.exit_status() {
                return status.code();
            }
            if std::time::Instant::now() > deadline {
                self.kill();
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM and wait for a graceful exit without blocking the test's runtime (so a
    /// [`crate::FaultProxy`] in the same runtime keeps forwarding meanwhile).
    pub async fn terminate_async(&mut self, timeout: Duration) -> Option<i32> {
        signal(self.pid(), "TERM");
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.exit_status() {
                return status.code();
            }
            if tokio::time::Instant::now() > deadline {
                self.kill();
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// GETs a path of the metrics listener (needs `with_metrics()`): (status, body); status 0
    /// when nothing answered.
    pub async fn get(&self, path: &str) -> (u16, String) {
        let port = self.metrics_port.expect("worker started without metrics");
        let client = crate::http_builder()
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        match client
            .get(format!("http://127.0.0.1:{port}{path}"))
            .send()
            .await
        {
            Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
            Err(_) => (0, String::new()),
        }
    }

    /// Scrapes `/metrics` (needs `with_metrics()`).
    pub async fn metrics(&self) -> String {
        let port = self.metrics_port.expect("worker started without metrics");
        crate::http()
            .get(format!("http://127.0.0.1:{port}/metrics"))
            .send()
            .await
            .expect("scrape metrics")
            .text()
            .await
            .unwrap()
    }
}

/// Sums a metric over all label sets matching every `label="value"` filter.
pub fn metric_value(text: &str, name: &str, filters: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| {
            filters
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

impl Drop for Worker {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- worker {} output ----\n{}",
                self.name,
                self.output.text()
            );
        }
        signal(self.pid(), "CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(pid: u32, sig: &str) {
    // Quiet: the process may already be gone (a SIGCONT on drop after SIGKILL).
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status();
}

/// The reference downstream, on its own schema of the test database.
pub struct Downstream {
    child: Child,
    pub port: u16,
    pub output: Output,
    db_url: String,
}

impl Downstream {
    pub async fn start(env: &Env) -> Downstream {
        Downstream::start_on(&env.db_url, 0, &[]).await
    }

    /// Starts with extra settings, e.g. `[("DOWNSTREAM_CLOCK_OFFSET_MS", "10000")]`.
    pub async fn start_with(env: &Env, vars: &[(&str, &str)]) -> Downstream {
        Downstream::start_on(&env.db_url, 0, vars).await
    }

    /// Starts on a given port (e.g. one a worker was already refused on).
    pub async fn start_at(env: &Env, port: u16) -> Downstream {
        Downstream::start_on(&env.db_url, port, &[]).await
    }

    async fn start_on(db_url: &str, port: u16, vars: &[(&str, &str)]) -> Downstream {
        let mut child = Command::new(bin_dir().join("reference-downstream"))
            .envs(vars.iter().copied())
            .env("DOWNSTREAM_DATABASE_URL", db_url)
            .env("DOWNSTREAM_SCHEMA", "downstream")
            .env("DOWNSTREAM_ADDR", format!("127.0.0.1:{port}"))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn reference-downstream");
        let output = Output::default();
        output.capture(child.stderr.take().unwrap(), "downstream".into());
        output.capture(child.stdout.take().unwrap(), "downstream".into());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let port = loop {
            let text = output.text();
            if let Some(line) = text
                .lines()
                .find(|l| l.contains("reference-downstream listening on"))
            {
                break line
                    .rsplit(':')
                    .next()
                    .unwrap()
                    .trim()
                    .parse::<u16>()
                    .unwrap();
            }
            if tokio::time::Instant::now() > deadline {
                panic!("reference-downstream did not start:\n{text}");
            }
            tokio::time::sleep(Duration::from_millis(30)).await;
        };
        Downstream {
            child,
            port,
            output,
            db_url: db_url.to_string(),
        }
    }

    /// Kills the downstream and starts it again on the same port with the same data.
    pub async fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let next = Downstream::start_on(&self.db_url, self.port, &[]).await;
        *self = next;
    }

    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Adds a fault (see downstream/README.md): e.g. `{"kind":"drop_after_commit"}`.
    pub async fn fault(&self, fault: serde_json::Value) {
        let r = crate::http()
            .post(format!("http://127.0.0.1:{}/_control/faults", self.port))
            .header("content-type", "application/json")
            .body(fault.to_string())
            .send()
            .await
            .expect("fault control");
        assert!(
            r.status().is_success(),
            "fault rejected: {}",
            r.text().await.unwrap_or_default()
        );
    }
}

impl Drop for Downstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
