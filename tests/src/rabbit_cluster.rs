//! A 3-node RabbitMQ cluster of one test, on this machine, from Debian's `rabbitmq-server`
//! (3.10): the scripts under `/usr/lib/rabbitmq/bin` called directly (the `/usr/sbin` wrappers
//! switch to the `rabbitmq` user), every node with its own name, AMQP and distribution ports,
//! data, log, config, plugin and pid files in one temporary directory, one Erlang cookie under a
//! private `HOME`, and a private `epmd` on a free port (`ERL_EPMD_PORT`), so neither the shared
//! broker (127.0.0.1:5672) nor the system epmd (4369) is ever touched. Nodes 2 and 3 join node 1
//! with `stop_app` / `join_cluster` / `start_app`.
//!
//! Nodes are indexed from 0: node `i` is `<prefix>n<i+1>@localhost`, where the prefix is unique
//! per fixture (`rabbit<pid>x<counter>`). Each node is an OS child of the test process (with
//! `RUNNING_UNDER_SYSTEMD=true` the script `exec`s into `beam.smp` instead of waiting on it
//! from a signal-forwarding shell, so the child's pid is the node's pid, as its pid file says). Dropping the fixture SIGKILLs every node and the epmd and deletes the directory;
//! a watchdog shell (its stdin is a pipe from this process) does the same if the test process
//! dies without dropping it (SIGKILL, abort). Both find leftovers by their working directory,
//! which is inside the fixture's directory for every process it starts.
//!
//! Lean for a 2-core machine: one scheduler per node (`+S 1:1`), schedulers not bound to cores
//! (three VMs bound the default way would all sit on core 0), and a plugins directory of links
//! to only the applications the node needs (rabbit's dependencies and the requested plugins).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Where Debian puts the scripts that run a node without switching user.
pub const RABBIT_BIN: &str = "/usr/lib/rabbitmq/bin";
/// How long one node may take to boot (or a CLI command to answer).
const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
/// The nodes of a cluster.
pub const NODES: usize = 3;

/// How to start a cluster.
#[derive(Debug, Clone, Copy, Default)]
pub struct RabbitClusterOptions<'a> {
    /// Plugins to enable on every node, e.g. `rabbitmq_consistent_hash_exchange`. None by
    /// default (the enabled-plugins file is `[].`; the management plugin is off).
    pub plugins: &'a [&'a str],
}

struct Node {
    name: String,
    amqp_port: u16,
    dist_port: u16,
    dir: PathBuf,
    child: Mutex<Option<Child>>,
}

/// A running 3-node cluster; see the module documentation.
pub struct RabbitCluster {
    dir: PathBuf,
    epmd_port: u16,
    epmd: Mutex<Option<Child>>,
    watchdog: Mutex<Option<Child>>,
    nodes: Vec<Node>,
    /// The trimmed plugins directory, when the server's own was found.
    plugins_dir: Option<PathBuf>,
    /// How long [`RabbitCluster::start`] took.
    pub start_time: Duration,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

impl RabbitCluster {
    /// Starts 3 nodes, clusters them and waits for `await_startup` on each. Panics, with the
    /// failing node's log tail, if a node does not boot or a step fails.
    pub async fn start(opts: RabbitClusterOptions<'_>) -> RabbitCluster {
        let t0 = Instant::now();
        let prefix = format!(
            "rabbit{}x{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let dir = std::env::temp_dir().join(format!(
            "intent-e2e-rabbit-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(dir.join("home")).expect("fixture dir");
        // First, so that a panic from here on leaves nothing behind either: dropping it closes
        // its stdin, and it cleans up.
        let watchdog = spawn_watchdog(&dir);
        std::fs::create_dir_all(dir.join("conf.d")).unwrap();
        write_cookie(&dir.join("home/.erlang.cookie"));
        // Sourced by the scripts instead of /etc/rabbitmq/rabbitmq-env.conf (which names the
        // shared node).
        std::fs::write(dir.join("rabbitmq-env.conf"), "").unwrap();
        let enabled = format!("[{}].\n", opts.plugins.join(","));
        std::fs::write(dir.join("enabled_plugins"), enabled).unwrap();
        let plugins_dir = trimmed_plugins_dir(&dir.join("plugins"), opts.plugins);

        // All ports at once, each held while the next is found, so none repeats.
        let ports = crate::procs::free_ports(1 + 2 * NODES);
        let epmd_port = ports[0];
        let nodes: Vec<Node> = (0..NODES)
            .map(|i| {
                let node_dir = dir.join(format!("n{}", i + 1));
                std::fs::create_dir_all(node_dir.join("log")).unwrap();
                std::fs::create_dir_all(node_dir.join("mnesia")).unwrap();
                let amqp_port = ports[1 + 2 * i];
                std::fs::write(
                    node_dir.join("rabbitmq.conf"),
                    format!(
                        "loopback_users = none\n\
                         listeners.tcp.default = 127.0.0.1:{amqp_port}\n\
                         cluster_partition_handling = pause_minority\n"
                    ),
                )
                .unwrap();
                Node {
                    name: format!("{prefix}n{}@localhost", i + 1),
                    amqp_port,
                    dist_port: ports[2 + 2 * i],
                    dir: node_dir,
                    child: Mutex::new(None),
                }
            })
            .collect();

        let mut cluster = RabbitCluster {
            watchdog: Mutex::new(Some(watchdog)),
            dir,
            epmd_port,
            epmd: Mutex::new(None),
            nodes,
            plugins_dir,
            start_time: Duration::ZERO,
        };
        cluster.start_epmd().await;
        for i in 0..NODES {
            cluster.spawn_node(i);
        }
        kit::join::in_order((0..NODES).map(|i| cluster.await_node(i))).await;
        let booted = t0.elapsed();

        let seed = cluster.node_name(0);
        let others: Vec<usize> = (1..NODES).collect();
        // stop_app and start_app on nodes 2 and 3 together; the joins one at a time.
        kit::join::in_order(others.iter().map(|&i| cluster.ctl_ok(i, &["stop_app"]))).await;
        for &i in &others {
            cluster.ctl_ok(i, &["join_cluster", &seed]).await;
        }
        let joined = t0.elapsed();
        kit::join::in_order(others.iter().map(|&i| cluster.ctl_ok(i, &["start_app"]))).await;
        kit::join::in_order((0..NODES).map(|i| cluster.await_node(i))).await;
        cluster.start_time = t0.elapsed();
        eprintln!(
            "rabbit cluster {prefix}: {NODES} nodes booted in {:.1} s, joined in {:.1} s, \
             clustered and started in {:.1} s (epmd port {epmd_port}, AMQP ports {:?})",
            booted.as_secs_f64(),
            joined.as_secs_f64(),
            cluster.start_time.as_secs_f64(),
            cluster
                .nodes
                .iter()
                .map(|n| n.amqp_port)
                .collect::<Vec<_>>()
        );
        cluster
    }

    /// `amqp://guest:guest@127.0.0.1:<port>/%2f` of node `i`.
    pub fn amqp_url(&self, i: usize) -> String {
        format!(
            "amqp://guest:guest@127.0.0.1:{}/%2f",
            self.nodes[i].amqp_port
        )
    }

    /// The three nodes' AMQP URLs, comma-separated, node 0 first.
    pub fn amqp_urls(&self) -> String {
        (0..NODES)
            .map(|i| self.amqp_url(i))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The Erlang node name of node `i` (`<prefix>n<i+1>@localhost`).
    pub fn node_name(&self, i: usize) -> String {
        self.nodes[i].name.clone()
    }

    /// The index of the node named `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == name)
    }

    /// The node's OS pid (its `beam.smp`) while it runs.
    pub fn os_pid(&self, i: usize) -> Option<u32> {
        let mut child = self.nodes[i].child.lock().unwrap();
        let c = child.as_mut()?;
        matches!(c.try_wait(), Ok(None)).then(|| c.id())
    }

    /// Whether node `i`'s process is alive (it may still be booting: see
    /// [`RabbitCluster::running_nodes`] for what the cluster thinks).
    pub fn is_running(&self, i: usize) -> bool {
        self.os_pid(i).is_some()
    }

    /// `kill -STOP` of node `i`'s `beam.smp`: a partitioned node, not a dead one. Its sockets
    /// stay open and say nothing, so its peers and clients notice only through their own
    /// heartbeats (the other nodes through Erlang's `net_ticktime`). [`RabbitCluster::resume`]
    /// lets it go on. Drop and [`RabbitCluster::kill`] work on a paused node.
    pub fn pause(&self, i: usize) {
        self.signal(i, libc::SIGSTOP);
    }

    /// `kill -CONT` of a node [`RabbitCluster::pause`] stopped.
    pub fn resume(&self, i: usize) {
        self.signal(i, libc::SIGCONT);
    }

    fn signal(&self, i: usize, signal: libc::c_int) {
        let pid = self
            .os_pid(i)
            .unwrap_or_else(|| panic!("node {i} is not running"));
        // SAFETY: kill(2) with the pid of a child this fixture started and has not reaped.
        let rc = unsafe { libc::kill(pid as libc::pid_t, signal) };
        assert_eq!(
            rc,
            0,
            "signal {signal} to node {i}: {}",
            std::io::Error::last_os_error()
        );
    }

    /// `kill -9` of node `i`'s `beam.smp` (reaped; its pid file removed). No-op if not running.
    pub fn kill(&self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.lock().unwrap().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_file(self.nodes[i].dir.join("pid"));
    }

    /// Starts node `i` again (after [`RabbitCluster::kill`]) and waits for `await_startup`. Its
    /// data directory is kept, so it rejoins the cluster by itself.
    pub async fn start_node(&self, i: usize) {
        assert!(!self.is_running(i), "node {i} is already running");
        self.spawn_node(i);
        self.await_node(i).await;
    }

    /// Runs `rabbitmqctl -n <node i> <args>` with the fixture's environment.
    pub async fn ctl(&self, i: usize, args: &[&str]) -> Output {
        self.cli("rabbitmqctl", i, args).await
    }

    /// Runs `rabbitmq-queues -n <node i> <args>` with the fixture's environment.
    pub async fn queues(&self, i: usize, args: &[&str]) -> Output {
        self.cli("rabbitmq-queues", i, args).await
    }

    /// The running nodes as node `i` sees them (`cluster_status`).
    pub async fn running_nodes(&self, i: usize) -> Vec<String> {
        let out = self
            .ctl_ok(i, &["-q", "cluster_status", "--formatter", "json"])
            .await;
        let status = json_of(&out);
        let mut nodes: Vec<String> = status["running_nodes"]
            .as_array()
            .unwrap_or_else(|| panic!("no running_nodes in {status}"))
            .iter()
            .filter_map(|n| n.as_str().map(str::to_string))
            .collect();
        nodes.sort();
        nodes
    }

    /// `rabbitmq-queues quorum_status <queue>` asked of running node `i`: one row per member,
    /// (node name, Raft state: `leader`, `follower`, or the error for a member that is down).
    pub async fn quorum_status(&self, i: usize, queue: &str) -> Option<Vec<(String, String)>> {
        let out = self
            .queues(i, &["-q", "quorum_status", queue, "--formatter", "json"])
            .await;
        if !out.status.success() {
            return None;
        }
        let rows = json_of(&out);
        Some(
            rows.as_array()?
                .iter()
                .map(|r| {
                    let state = match &r["Raft State"] {
                        serde_json::Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    (r["Node Name"].as_str().unwrap_or("").to_string(), state)
                })
                .collect(),
        )
    }

    /// The node that leads quorum queue `queue` now, asked of the first running node; `None`
    /// while no member says it is the leader (an election) or no node answers.
    pub async fn try_leader_of(&self, queue: &str) -> Option<usize> {
        for i in (0..NODES).filter(|&i| self.is_running(i)) {
            if let Some(rows) = self.quorum_status(i, queue).await {
                return rows
                    .iter()
                    .find(|(_, state)| state == "leader")
                    .and_then(|(name, _)| self.index_of(name));
            }
        }
        None
    }

    /// The leader of quorum queue `queue` (waits up to 30 s for one; panics otherwise).
    pub async fn leader_of(&self, queue: &str) -> usize {
        crate::wait_for(
            &format!("a leader of quorum queue {queue}"),
            Duration::from_secs(30),
            || self.try_leader_of(queue),
        )
        .await
    }

    /// The last lines of node `i`'s log and console output.
    pub fn log_tail(&self, i: usize) -> String {
        let node = &self.nodes[i];
        let log = node.dir.join("log").join(format!("{}.log", node.name));
        format!(
            "--- {} log (last 60 lines) ---\n{}\n--- console (last 30 lines) ---\n{}",
            node.name,
            tail(&log, 60),
            tail(&node.dir.join("console.log"), 30)
        )
    }

    // ---- internals ----

    /// The environment every process of node `i` (server and CLI) gets; nothing else from
    /// this process's environment reaches them.
    fn env(&self, i: usize) -> Vec<(String, String)> {
        let node = &self.nodes[i];
        let d = |p: &Path| p.display().to_string();
        let mnesia_base = node.dir.join("mnesia");
        let mnesia_dir = mnesia_base.join(&node.name);
        let mut env = vec![
            (
                "PATH",
                std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into()),
            ),
            ("LANG", "C.UTF-8".into()),
            ("HOME", d(&self.dir.join("home"))),
            ("ERL_EPMD_PORT", self.epmd_port.to_string()),
            ("ERL_EPMD_ADDRESS", "127.0.0.1".into()),
            ("ERL_CRASH_DUMP", d(&node.dir.join("erl_crash.dump"))),
            // Makes the script `exec` the VM instead of running it as a child of a shell
            // that forwards signals: the process we spawn is then the node itself.
            ("RUNNING_UNDER_SYSTEMD", "true".into()),
            (
                "RABBITMQ_CONF_ENV_FILE",
                d(&self.dir.join("rabbitmq-env.conf")),
            ),
            ("RABBITMQ_NODENAME", node.name.clone()),
            ("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1".into()),
            ("RABBITMQ_NODE_PORT", node.amqp_port.to_string()),
            ("RABBITMQ_DIST_PORT", node.dist_port.to_string()),
            ("RABBITMQ_CONFIG_FILE", d(&node.dir.join("rabbitmq.conf"))),
            // The defaults are /etc/rabbitmq/conf.d and /etc/rabbitmq/advanced.config.
            ("RABBITMQ_CONFIG_FILES", d(&self.dir.join("conf.d"))),
            (
                "RABBITMQ_ADVANCED_CONFIG_FILE",
                d(&self.dir.join("advanced.config")),
            ),
            ("RABBITMQ_MOTD_FILE", d(&self.dir.join("motd"))),
            ("RABBITMQ_MNESIA_BASE", d(&mnesia_base)),
            ("RABBITMQ_MNESIA_DIR", d(&mnesia_dir)),
            ("RABBITMQ_QUORUM_DIR", d(&mnesia_dir.join("quorum"))),
            ("RABBITMQ_STREAM_DIR", d(&mnesia_dir.join("stream"))),
            ("RABBITMQ_LOG_BASE", d(&node.dir.join("log"))),
            ("RABBITMQ_PID_FILE", d(&node.dir.join("pid"))),
            (
                "RABBITMQ_FEATURE_FLAGS_FILE",
                d(&node.dir.join("feature_flags")),
            ),
            (
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                d(&self.dir.join("enabled_plugins")),
            ),
            (
                "RABBITMQ_PLUGINS_EXPAND_DIR",
                d(&node.dir.join("plugins-expand")),
            ),
            ("RABBITMQ_SCHEDULER_BIND_TYPE", "u".into()),
            (
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "+S 1:1 +A 8 -start_epmd false -kernel inet_dist_use_interface {127,0,0,1}".into(),
            ),
            // The CLI: never start an epmd; any free distribution port (the default range,
            // 35672-35682, is shared with every other CLI on the machine).
            ("RABBITMQ_CTL_ERL_ARGS", "-start_epmd false".into()),
            ("RABBITMQ_CTL_DIST_PORT_MIN", "0".into()),
            ("RABBITMQ_CTL_DIST_PORT_MAX", "0".into()),
        ];
        if let Some(p) = &self.plugins_dir {
            env.push(("RABBITMQ_PLUGINS_DIR", d(p)));
        }
        env.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    async fn start_epmd(&self) {
        let log = std::fs::File::create(self.dir.join("epmd.log")).unwrap();
        let child = Command::new("epmd")
            .args([
                "-port",
                &self.epmd_port.to_string(),
                "-address",
                "127.0.0.1",
            ])
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("epmd (erlang-base) on PATH");
        *self.epmd.lock().unwrap() = Some(child);
        let port = self.epmd_port;
        crate::wait_for("the private epmd", Duration::from_secs(10), || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
                .map(|_| ())
        })
        .await;
    }

    fn spawn_node(&self, i: usize) {
        let node = &self.nodes[i];
        let _ = std::fs::remove_file(node.dir.join("pid"));
        let console = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(node.dir.join("console.log"))
            .unwrap();
        let child = Command::new(Path::new(RABBIT_BIN).join("rabbitmq-server"))
            .env_clear()
            .envs(self.env(i))
            .current_dir(&node.dir)
            .stdin(Stdio::null())
            .stdout(console.try_clone().unwrap())
            .stderr(console)
            .spawn()
            .unwrap_or_else(|e| panic!("{RABBIT_BIN}/rabbitmq-server (rabbitmq-server): {e}"));
        *node.child.lock().unwrap() = Some(child);
    }

    /// Waits until node `i` is registered with the epmd, then for `await_startup`; panics with
    /// its log tail if the process exits or the deadline passes.
    async fn await_node(&self, i: usize) {
        let deadline = Instant::now() + BOOT_TIMEOUT;
        let short = self.nodes[i].name.split('@').next().unwrap().to_string();
        loop {
            if !self.is_running(i) {
                panic!(
                    "RabbitMQ node {} exited during start-up\n{}",
                    self.nodes[i].name,
                    self.log_tail(i)
                );
            }
            if Instant::now() > deadline {
                panic!(
                    "RabbitMQ node {} did not start within {BOOT_TIMEOUT:?}\n{}",
                    self.nodes[i].name,
                    self.log_tail(i)
                );
            }
            if epmd_names(self.epmd_port)
                .await
                .is_some_and(|names| names.contains(&format!("name {short} at port")))
            {
                // Blocks while the node boots; fails at once if it is not reachable yet.
                let out = self
                    .ctl(i, &["-q", "await_startup", "--timeout", "120"])
                    .await;
                if out.status.success() {
                    let recorded =
                        std::fs::read_to_string(self.nodes[i].dir.join("pid")).unwrap_or_default();
                    assert_eq!(
                        recorded.trim().parse::<u32>().ok(),
                        self.os_pid(i),
                        "node {}'s pid file names another process than the one started",
                        self.nodes[i].name
                    );
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn cli(&self, tool: &str, i: usize, args: &[&str]) -> Output {
        let run = tokio::process::Command::new(Path::new(RABBIT_BIN).join(tool))
            .arg("-n")
            .arg(&self.nodes[i].name)
            .args(args)
            .env_clear()
            .envs(self.env(i))
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        match tokio::time::timeout(BOOT_TIMEOUT + Duration::from_secs(10), run).await {
            Ok(out) => out.unwrap_or_else(|e| panic!("{RABBIT_BIN}/{tool}: {e}")),
            Err(_) => panic!("{tool} {args:?} on node {i} did not answer"),
        }
    }

    /// [`RabbitCluster::ctl`] that panics, with the node's log tail, when the command fails.
    async fn ctl_ok(&self, i: usize, args: &[&str]) -> Output {
        let out = self.ctl(i, args).await;
        assert!(
            out.status.success(),
            "rabbitmqctl -n {} {args:?} failed: {}{}\n{}",
            self.nodes[i].name,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.log_tail(i)
        );
        out
    }
}

impl Drop for RabbitCluster {
    fn drop(&mut self) {
        for i in 0..NODES {
            self.kill(i);
        }
        if let Some(mut epmd) = self.epmd.lock().unwrap().take() {
            let _ = epmd.kill();
            let _ = epmd.wait();
        }
        // Anything else started in the fixture's directory (a CLI left by a cancelled call).
        kill_processes_under(&self.dir);
        let _ = std::fs::remove_dir_all(&self.dir);
        if let Some(mut watchdog) = self.watchdog.lock().unwrap().take() {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
        }
    }
}

/// A shell that waits for EOF on its stdin (a pipe from this process, closed however this
/// process ends), then SIGKILLs every process whose working directory is inside `dir` and
/// removes `dir`. Ignores SIGINT/SIGTERM/SIGHUP so a signal to the whole process group cannot
/// stop it before it has cleaned up.
fn spawn_watchdog(dir: &Path) -> Child {
    let script = r#"trap '' INT TERM HUP
cat >/dev/null
for p in /proc/[0-9]*; do
  case "$(readlink "$p/cwd" 2>/dev/null)" in
    "$DIR"|"$DIR"/*) kill -9 "${p#/proc/}" 2>/dev/null ;;
  esac
done
rm -rf "$DIR""#;
    Command::new("sh")
        .args(["-c", script])
        .env("DIR", dir)
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("sh")
}

/// SIGKILLs every process (but this one) whose working directory is `dir` or inside it.
fn kill_processes_under(dir: &Path) {
    let me = std::process::id();
    for pid in crate::procs::all_pids() {
        if pid == me {
            continue;
        }
        if std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd.starts_with(dir)) {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// The epmd's `NAMES` answer (one `name <n> at port <p>` line per registered node).
async fn epmd_names(port: u16) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ask = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        // Length 1, NAMES_REQ (110); the answer is the epmd's port (4 bytes) and the lines.
        s.write_all(&[0, 1, 110]).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        (buf.len() >= 4).then(|| String::from_utf8_lossy(&buf[4..]).to_string())
    };
    tokio::time::timeout(Duration::from_secs(2), ask)
        .await
        .ok()
        .flatten()
}

fn write_cookie(path: &Path) {
    let cookie: String = (0..20).map(|_| fastrand::uppercase()).collect();
    std::fs::write(path, cookie).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o400)).unwrap();
}

/// The server's own plugins directory (`/usr/lib/rabbitmq/lib/rabbitmq_server-*/plugins`).
fn server_plugins_dir() -> Option<PathBuf> {
    let lib = Path::new(RABBIT_BIN).join("../lib").canonicalize().ok()?;
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(lib)
        .ok()?
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("rabbitmq_server-")
        })
        .map(|e| e.path().join("plugins"))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs.pop()
}

/// A directory at `into` of links to the applications rabbit and `plugins` need (the
/// closure of their `.app` files' `applications`), so that a node does not scan ~70
/// applications at boot. `None` (the server's own directory is used) if that is not found.
fn trimmed_plugins_dir(into: &Path, plugins: &[&str]) -> Option<PathBuf> {
    let source = server_plugins_dir()?;
    // application name -> its directory (`<name>-<version>`)
    let apps: std::collections::HashMap<String, PathBuf> = std::fs::read_dir(&source)
        .ok()?
        .flatten()
        .filter(|e| e.path().join("ebin").is_dir())
        .filter_map(|e| {
            let file = e.file_name().to_string_lossy().to_string();
            let (name, _version) = file.rsplit_once('-')?;
            Some((name.to_string(), e.path()))
        })
        .collect();
    std::fs::create_dir_all(into).ok()?;
    let mut todo: Vec<String> = std::iter::once("rabbit")
        .chain(plugins.iter().copied())
        .map(str::to_string)
        .collect();
    let mut done = std::collections::HashSet::new();
    while let Some(app) = todo.pop() {
        if !done.insert(app.clone()) {
            continue;
        }
        // Applications not in the plugins directory are Erlang/OTP's own.
        let Some(path) = apps.get(&app) else {
            assert!(
                !plugins.contains(&app.as_str()),
                "plugin {app} is not in {}",
                source.display()
            );
            continue;
        };
        std::os::unix::fs::symlink(path, into.join(path.file_name()?)).ok()?;
        let spec = std::fs::read_to_string(path.join("ebin").join(format!("{app}.app")))
            .unwrap_or_default();
        todo.extend(app_dependencies(&spec));
    }
    Some(into.to_path_buf())
}

/// The `applications` list of an `.app` file's text.
fn app_dependencies(spec: &str) -> Vec<String> {
    let Some(start) = spec.find("{applications") else {
        return Vec::new();
    };
    let rest = &spec[start..];
    let (Some(open), Some(close)) = (rest.find('['), rest.find(']')) else {
        return Vec::new();
    };
    rest[open + 1..close]
        .split(',')
        .map(|a| a.trim().trim_matches('\'').to_string())
        .filter(|a| !a.is_empty())
        .collect()
}

fn json_of(out: &Output) -> serde_json::Value {
    let text = String::from_utf8_lossy(&out.stdout);
    let start = text.find(['[', '{']).unwrap_or(0);
    serde_json::from_str(text[start..].trim())
        .unwrap_or_else(|e| panic!("CLI output is not JSON ({e}): {text}"))
}

fn tail(path: &Path, lines: usize) -> String {
    let mut text = String::new();
    if let Ok(mut f) = std::fs::File::open(path) {
        let _ = f.read_to_string(&mut text);
    }
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
