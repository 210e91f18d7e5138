//! A Postgres primary and a streaming standby of one test, which the test can fail over: stop a
//! node hard, promote the other, rejoin the old primary as a standby (with `pg_rewind` when its
//! WAL went past the new primary's), or switch over under control. Like
//! [`crate::tls::PgCluster`], both nodes live in a temporary directory with their own ports,
//! listen on 127.0.0.1 only and are removed when the pair is dropped; the shared Postgres on
//! 5432 is never touched. The binaries are the newest `/usr/lib/postgresql/*/bin`
//! (`PG_BIN_DIR` overrides), run as the `postgres` user when the tests run as root.
//!
//! # Layout on disk
//! `<tmp>/intent-e2e-pgpair-<uuid>/` holds `node0/` and `node1/` (data directories), their logs
//! `node0.log` and `node1.log`, and the Unix sockets. Both data directories share one
//! `postgresql.conf` (replication settings, copied by `pg_basebackup` and `pg_rewind`), which
//! ends with `include 'node.conf'`: the node's own port, `cluster_name`, `primary_conninfo`
//! (always the other node, with `application_name` = this node's [`PgPair::name`]) and
//! `synchronous_standby_names`. The fixture rewrites `node.conf` whenever a role changes: only
//! a primary whose standby is attached names it in `synchronous_standby_names`, so a freshly
//! promoted node accepts writes before the old primary is back.
//!
//! # The synchronous guarantee
//! With [`PgPairOptions::sync`] (the default) and `synchronous_commit = on`, a commit on the
//! primary returns only once the standby has flushed its WAL. With the standby down, commits on
//! the primary block: run the commit in a spawned task, watch [`PgPair::sync_rep_waiters`] on
//! the primary become non-zero (backends waiting on `SyncRep`) while the task stays pending,
//! then [`PgPair::start_node`] the standby and the commit returns. A commit that was still
//! waiting when the primary died was never acknowledged and may be lost by a failover;
//! an acknowledged one never is. `on` means durable on the standby, not yet visible there: a
//! session that needs its commit readable on the standby at once sets `synchronous_commit =
//! remote_apply` (or start the pair with [`PgPairOptions::synchronous_commit`]).
//!
//! Every operation that waits is async (the pair's child processes run on tokio), so fixtures
//! on the test's runtime (proxies, forwarders) keep running meanwhile.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

/// The superuser of both nodes (trust auth, local and 127.0.0.1, replication included).
pub const USER: &str = "postgres";

/// How long any single wait of the fixture may take before it panics with both logs.
const WAIT: Duration = Duration::from_secs(60);

/// Options of [`PgPair::start`].
#[derive(Clone, Debug)]
pub struct PgPairOptions {
    /// Synchronous replication (`synchronous_standby_names` on the primary names the standby).
    /// `false`: asynchronous, the standby lags and a failover can lose acknowledged commits.
    pub sync: bool,
    /// `synchronous_commit` on both nodes (`on`, `remote_apply`, `remote_write`, `local`, `off`).
    pub synchronous_commit: &'static str,
}

impl Default for PgPairOptions {
    fn default() -> Self {
        PgPairOptions {
            sync: true,
            synchronous_commit: "on",
        }
    }
}

/// A primary and a streaming standby, nodes 0 and 1 (node 0 is the primary at start).
/// Stopped (`-m immediate`) and deleted when dropped, also after a panic.
pub struct PgPair {
    dir: PathBuf,
    bin: PathBuf,
    ports: [u16; 2],
    as_postgres: bool,
    opts: PgPairOptions,
}

fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to the process's effective user.
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

impl PgPair {
    /// initdb node 0, start it, `pg_basebackup -R -X stream` node 1 from it, start node 1 and
    /// wait until node 0's `pg_stat_replication` shows node 1 `streaming`, `sync` (or `async`
    /// without [`PgPairOptions::sync`]). A few seconds.
    pub async fn start(opts: PgPairOptions) -> PgPair {
        let started = Instant::now();
        let dir = std::env::temp_dir().join(format!(
            "intent-e2e-pgpair-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).expect("create the pair's directory");
        let p0 = crate::free_port();
        let mut p1 = crate::free_port();
        while p1 == p0 {
            p1 = crate::free_port();
        }
        let pair = PgPair {
            dir: dir.clone(),
            bin: crate::tls::pg_bin(),
            ports: [p0, p1],
            // initdb and postgres refuse to run as root: run them as the `postgres` user.
            as_postgres: is_root(),
            opts,
        };
        if pair.as_postgres {
            let ok = std::process::Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .expect("chown")
                .success();
            assert!(ok, "chown of {}", dir.display());
        }

        let data0 = pair.data_dir(0);
        pair.tool(
            "initdb",
            &[
                "-D",
                path_str(&data0),
                "-U",
                USER,
                "--auth=trust",
                "--no-sync",
                "--no-instructions",
                "-E",
                "UTF8",
            ],
        )
        .await;
        pair.write(
            &data0.join("pg_hba.conf"),
            "# TYPE  DATABASE     USER  ADDRESS       METHOD\n\
             local   all          all                 trust\n\
             host    all          all   127.0.0.1/32  trust\n\
             local   replication  all                 trust\n\
             host    replication  all   127.0.0.1/32  trust\n",
        );
        let conf_path = data0.join("postgresql.conf");
        let mut conf = std::fs::read_to_string(&conf_path).expect("postgresql.conf");
        conf.push_str(&format!(
            "\n# PgPair (tests/src/pg_failover.rs): shared by both nodes.\n\
             listen_addresses = '127.0.0.1'\n\
             unix_socket_directories = '{dir}'\n\
             max_connections = 50\n\
             shared_buffers = '32MB'\n\
             wal_level = replica\n\
             max_wal_senders = 5\n\
             max_replication_slots = 5\n\
             wal_keep_size = '256MB'\n\
             hot_standby = on\n\
             wal_log_hints = on\n\
             full_page_writes = on\n\
             fsync = off\n\
             synchronous_commit = {commit}\n\
             wal_retrieve_retry_interval = '200ms'\n\
             wal_receiver_status_interval = '1s'\n\
             log_line_prefix = '%m [%p] %q%a '\n\
             include 'node.conf'\n",
            dir = dir.display(),
            commit = pair.opts.synchronous_commit,
        ));
        pair.write(&conf_path, &conf);
        pair.write_node_conf(0, false);
        pair.start_node(0).await;
        let t_primary = started.elapsed();

        // The standby: a base backup of node 0. `-R` writes standby.signal (kept) and a
        // primary_conninfo in postgresql.auto.conf (dropped: node.conf holds the node's own).
        let data1 = pair.data_dir(1);
        let port0 = p0.to_string();
        pair.tool(
            "pg_basebackup",
            &[
                "-D",
                path_str(&data1),
                "-h",
                "127.0.0.1",
                "-p",
                &port0,
                "-U",
                USER,
                "-X",
                "stream",
                "-R",
                "-c",
                "fast",
                "--no-sync",
            ],
        )
        .await;
        assert!(
            data1.join("standby.signal").exists(),
            "pg_basebackup -R wrote standby.signal"
        );
        pair.write(&data1.join("postgresql.auto.conf"), AUTO_CONF);
        pair.write_node_conf(1, false);
        pair.start_node(1).await;
        pair.attach(0, 1).await;
        eprintln!(
            "PgPair: primary :{p0} up in {} ms, standby :{p1} {} in {} ms ({})",
            ms(t_primary),
            if pair.opts.sync { "sync" } else { "async" },
            ms(started.elapsed()),
            pair.dir.display()
        );
        pair
    }

    /// The node's `application_name` (and `cluster_name`): `node0`, `node1`.
    pub fn name(&self, i: usize) -> String {
        format!("node{i}")
    }

    /// The other node.
    pub fn other(&self, i: usize) -> usize {
        assert!(i < 2, "node {i}: a pair has nodes 0 and 1");
        1 - i
    }

    pub fn port(&self, i: usize) -> u16 {
        self.ports[i]
    }

    /// The node's data directory.
    pub fn data_dir(&self, i: usize) -> PathBuf {
        self.dir.join(format!("node{i}"))
    }

    /// The node's server log so far.
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.join(format!("node{i}.log"))).unwrap_or_default()
    }

    /// `postgres://postgres@127.0.0.1:<port>/<db>`.
    pub fn url(&self, i: usize, db: &str) -> String {
        format!("postgres://{USER}@127.0.0.1:{}/{db}", self.ports[i])
    }

    /// The libpq multi-host form, `postgres://postgres@127.0.0.1:<p0>,127.0.0.1:<p1>/<db>?<params>`
    /// (`params` such as `target_session_attrs=read-write`; empty: no query). libpq (psql)
    /// reads it; sqlx does not parse multi-host URLs.
    pub fn multi_host_url(&self, db: &str, params: &str) -> String {
        let query = if params.is_empty() {
            String::new()
        } else {
            format!("?{params}")
        };
        format!(
            "postgres://{USER}@127.0.0.1:{},127.0.0.1:{}/{db}{query}",
            self.ports[0], self.ports[1]
        )
    }

    /// Whether the node's postmaster runs (`pg_ctl status`).
    pub fn is_running(&self, i: usize) -> bool {
        let mut cmd = self.command_std("pg_ctl");
        cmd.arg("status").arg("-D").arg(self.data_dir(i));
        cmd.output().is_ok_and(|o| o.status.success())
    }

    /// `pg_is_in_recovery()` of the node; `None` when it does not answer.
    pub async fn in_recovery(&self, i: usize) -> Option<bool> {
        if !self.is_running(i) {
            return None;
        }
        match self
            .try_psql(i, "postgres", "SELECT pg_is_in_recovery()")
            .await
        {
            Ok(v) if v == "t" => Some(true),
            Ok(v) if v == "f" => Some(false),
            _ => None,
        }
    }

    /// The node that is not in recovery. Panics when neither or both are.
    pub async fn primary(&self) -> usize {
        let states = [self.in_recovery(0).await, self.in_recovery(1).await];
        match states {
            [Some(false), Some(false)] => panic!("both nodes are primaries (split brain)"),
            [Some(false), _] => 0,
            [_, Some(false)] => 1,
            _ => panic!("no primary: pg_is_in_recovery() per node {states:?}"),
        }
    }

    /// Starts a stopped node as it is configured (a standby comes back as a standby of the
    /// other node) and waits until it accepts connections.
    pub async fn start_node(&self, i: usize) {
        let data = self.data_dir(i);
        let log = self.dir.join(format!("node{i}.log"));
        self.tool(
            "pg_ctl",
            &[
                "-D",
                path_str(&data),
                "-l",
                path_str(&log),
                "-w",
                "-t",
                "60",
                "start",
            ],
        )
        .await;
    }

    /// `pg_ctl stop -m immediate`: the node dies as in a crash (no shutdown checkpoint, the
    /// standby is not told). No-op when it is not running.
    pub async fn stop_hard(&self, i: usize) {
        self.stop(i, "immediate").await;
    }

    /// `pg_ctl stop -m fast`: a clean shutdown; a primary first sends all its WAL, the shutdown
    /// checkpoint included, to its standby. No-op when it is not running.
    pub async fn stop_fast(&self, i: usize) {
        self.stop(i, "fast").await;
    }

    async fn stop(&self, i: usize, mode: &str) {
        if !self.is_running(i) {
            return;
        }
        let data = self.data_dir(i);
        self.tool(
            "pg_ctl",
            &["-D", path_str(&data), "-m", mode, "-w", "-t", "60", "stop"],
        )
        .await;
    }

    /// `pg_ctl promote` and waits until `pg_is_in_recovery()` is false. The promoted node names
    /// no synchronous standby (its peer is usually down): writes succeed at once.
    pub async fn promote(&self, i: usize) {
        self.write_node_conf(i, false);
        let data = self.data_dir(i);
        self.tool(
            "pg_ctl",
            &["-D", path_str(&data), "-w", "-t", "60", "promote"],
        )
        .await;
        self.wait_until("the promoted node to leave recovery", || async {
            (self.in_recovery(i).await == Some(false)).then_some(())
        })
        .await;
    }

    /// Makes node `i` (an old primary, stopped or not) a standby of the other node, which must
    /// be the primary: stops it (`-m fast`) if it runs, `pg_rewind`s it from the new primary
    /// (which says when no rewind is needed), writes standby.signal and its node.conf
    /// (`primary_conninfo` to the new primary), starts it, waits until it streams, then, with
    /// [`PgPairOptions::sync`], names it in the new primary's `synchronous_standby_names`
    /// (`pg_reload_conf()`) and waits for `sync`. Returns whether pg_rewind had to rewind.
    pub async fn rejoin_as_standby(&self, i: usize) -> bool {
        let p = self.other(i);
        assert_eq!(
            self.in_recovery(p).await,
            Some(false),
            "node {i} can rejoin only a running primary (node {p})"
        );
        self.stop_fast(i).await;
        let data = self.data_dir(i);
        let source = format!(
            "host=127.0.0.1 port={} user={USER} dbname=postgres",
            self.ports[p]
        );
        // A promoted node's control file names its new timeline only after the checkpoint
        // that promotion requests in the background; before it, pg_rewind compares against the
        // old timeline and says "no rewind required" for a node whose WAL went past the
        // failover point.
        self.psql(p, "CHECKPOINT").await;
        // pg_rewind runs crash recovery first when the node was stopped hard, then copies the
        // blocks changed since the timelines diverged, and the source's configuration files.
        let out = self
            .tool(
                "pg_rewind",
                &[
                    "-D",
                    path_str(&data),
                    &format!("--source-server={source}"),
                    "--no-sync",
                ],
            )
            .await;
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let rewound = !said.contains("no rewind required");
        let summary: Vec<&str> = said
            .lines()
            .filter(|l| l.starts_with("pg_rewind:"))
            .collect();
        eprintln!("PgPair: pg_rewind of node {i}: {}", summary.join(" | "));
        self.write(&data.join("postgresql.auto.conf"), AUTO_CONF);
        self.write(&data.join("standby.signal"), "");
        self.write_node_conf(i, false);
        self.start_node(i).await;
        self.attach(p, i).await;
        rewound
    }

    /// A controlled switchover: stops the primary `-m fast`, waits until the standby has
    /// replayed past the old primary's shutdown checkpoint (its LSN from `pg_controldata`),
    /// promotes the standby and rejoins the old primary as its standby. No commit is lost.
    pub async fn switchover(&self) {
        let p = self.primary().await;
        let s = self.other(p);
        self.stop_fast(p).await;
        let control = self
            .tool("pg_controldata", &[path_str(&self.data_dir(p))])
            .await;
        let control = String::from_utf8_lossy(&control.stdout).into_owned();
        let lsn = control
            .lines()
            .find_map(|l| l.strip_prefix("Latest checkpoint location:"))
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| panic!("no checkpoint location in pg_controldata:\n{control}"));
        let sql = format!("SELECT pg_last_wal_replay_lsn() > '{lsn}'::pg_lsn");
        self.wait_until(
            "the standby to replay the old primary's last WAL",
            || async { (self.try_psql(s, "postgres", &sql).await.ok()? == "t").then_some(()) },
        )
        .await;
        self.promote(s).await;
        self.rejoin_as_standby(p).await;
    }

    /// `state` and `sync_state` of `standby` in `primary`'s `pg_stat_replication`.
    pub async fn replication_state(
        &self,
        primary: usize,
        standby: usize,
    ) -> Option<(String, String)> {
        let sql = format!(
            "SELECT state || ' ' || sync_state FROM pg_stat_replication \
             WHERE application_name = '{}'",
            self.name(standby)
        );
        let row = self.try_psql(primary, "postgres", &sql).await.ok()?;
        let (state, sync) = row.lines().next()?.split_once(' ')?;
        Some((state.to_string(), sync.to_string()))
    }

    /// Waits until `primary` shows `standby` streaming in the expected sync state.
    pub async fn wait_streaming(&self, primary: usize, standby: usize) {
        let want = if self.opts.sync { "sync" } else { "async" };
        self.wait_until(
            &format!("node {standby} streaming ({want}) from node {primary} (pg_stat_replication)"),
            || async {
                let (state, sync) = self.replication_state(primary, standby).await?;
                (state == "streaming" && sync == want).then_some(())
            },
        )
        .await;
    }

    /// Backends of the node waiting for the synchronous standby (`wait_event = 'SyncRep'`):
    /// commits that have not returned.
    pub async fn sync_rep_waiters(&self, i: usize) -> i64 {
        self.psql(
            i,
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
        )
        .await
        .parse()
        .expect("a count")
    }

    /// Creates database `name` on the current primary (replicated to the standby) and
    /// returns the name.
    pub async fn create_database(&self, name: &str) -> String {
        let p = self.primary().await;
        self.psql(p, &format!("CREATE DATABASE \"{name}\"")).await;
        name.to_string()
    }

    /// Runs `sql` with psql on the node's `postgres` database; its output (unaligned, tuples
    /// only, trimmed). Panics on an error.
    pub async fn psql(&self, i: usize, sql: &str) -> String {
        self.psql_db(i, "postgres", sql).await
    }

    /// [`PgPair::psql`] on database `db`.
    pub async fn psql_db(&self, i: usize, db: &str, sql: &str) -> String {
        match self.try_psql(i, db, sql).await {
            Ok(out) => out,
            Err(e) => panic!("psql on node {i} failed: {e}\nSQL: {sql}"),
        }
    }

    /// psql on the node; `Err` with psql's message when it fails or takes over 30 s (a
    /// commit waiting for a synchronous standby that is down blocks).
    pub async fn try_psql(&self, i: usize, db: &str, sql: &str) -> Result<String, String> {
        self.psql_url(&self.url(i, db), sql).await
    }

    /// Runs `sql` with a fresh psql against a libpq URL (the multi-host form of
    /// [`PgPair::multi_host_url`] included); its output (unaligned, tuples only, trimmed), or
    /// psql's message.
    pub async fn psql_url(&self, url: &str, sql: &str) -> Result<String, String> {
        let mut cmd = tokio::process::Command::new(self.bin.join("psql"));
        cmd.args([
            "-X",
            "-q",
            "-A",
            "-t",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            url,
            "-c",
            sql,
        ])
        .env("PGCONNECT_TIMEOUT", "5")
        .kill_on_drop(true);
        let out = tokio::time::timeout(Duration::from_secs(30), cmd.output())
            .await
            .map_err(|_| "psql still running after 30 s".to_string())?
            .map_err(|e| format!("run psql: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
        }
    }

    /// Names the standby in the primary's `synchronous_standby_names` (when sync) once it
    /// streams, and waits for the expected `sync_state`.
    async fn attach(&self, primary: usize, standby: usize) {
        if self.opts.sync {
            // Streaming (async) first, then sync: commits never wait for a standby that is
            // still catching up.
            self.wait_until(
                &format!("node {standby} streaming from node {primary}"),
                || async {
                    let (state, _) = self.replication_state(primary, standby).await?;
                    (state == "streaming").then_some(())
                },
            )
            .await;
            self.write_node_conf(primary, true);
            self.psql(primary, "SELECT pg_reload_conf()").await;
        }
        self.wait_streaming(primary, standby).await;
    }

    /// Writes node `i`'s node.conf: its port and name, `primary_conninfo` to the other node,
    /// and `synchronous_standby_names` naming the other node when `names_standby`.
    fn write_node_conf(&self, i: usize, names_standby: bool) {
        let other = self.other(i);
        let sync_names = if names_standby && self.opts.sync {
            self.name(other)
        } else {
            String::new()
        };
        let text = format!(
            "# PgPair: node {i}'s own settings (rewritten by the fixture).\n\
             port = {port}\n\
             cluster_name = '{name}'\n\
             primary_conninfo = 'host=127.0.0.1 port={other_port} user={USER} \
             application_name={name}'\n\
             synchronous_standby_names = '{sync_names}'\n",
            port = self.ports[i],
            name = self.name(i),
            other_port = self.ports[other],
        );
        self.write(&self.data_dir(i).join("node.conf"), &text);
    }

    /// Writes a file the server reads or pg_rewind overwrites, owned like the pair's directory.
    fn write(&self, path: &Path, text: &str) {
        std::fs::write(path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        if self.as_postgres {
            use std::os::unix::fs::MetadataExt;
            let owner = std::fs::metadata(&self.dir).expect("the pair's directory");
            std::os::unix::fs::chown(path, Some(owner.uid()), Some(owner.gid()))
                .unwrap_or_else(|e| panic!("chown {}: {e}", path.display()));
        }
    }

    fn command_std(&self, tool: &str) -> std::process::Command {
        let exe = self.bin.join(tool);
        let mut cmd = if self.as_postgres {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(exe);
            c
        } else {
            std::process::Command::new(exe)
        };
        // The postgres user may not be allowed into the test's working directory.
        cmd.current_dir(&self.dir);
        cmd
    }

    /// Runs a server tool (as `postgres` under root) and panics with both logs if it fails.
    async fn tool(&self, tool: &str, args: &[&str]) -> Output {
        let mut cmd = tokio::process::Command::from(self.command_std(tool));
        cmd.args(args).kill_on_drop(true);
        let out = tokio::time::timeout(WAIT * 2, cmd.output())
            .await
            .unwrap_or_else(|_| panic!("{tool} {args:?} still running after {:?}", WAIT * 2))
            .expect("run a Postgres tool");
        assert!(
            out.status.success(),
            "{tool} {args:?} failed: {}\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.logs()
        );
        out
    }

    fn logs(&self) -> String {
        (0..2)
            .map(|i| format!("--- node{i}.log ---\n{}", tail(&self.log(i), 40)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Polls `check` every 50 ms for up to a minute; panics with both logs.
    async fn wait_until<T, F, Fut>(&self, what: &str, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Some(v) = check().await {
                return v;
            }
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "timed out after {WAIT:?} waiting for {what}\n{}",
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for PgPair {
    fn drop(&mut self) {
        for i in 0..2 {
            let mut cmd = self.command_std("pg_ctl");
            let _ = cmd
                .arg("-D")
                .arg(self.data_dir(i))
                .args(["-m", "immediate", "-w", "-t", "20", "stop"])
                .output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// postgresql.auto.conf as initdb leaves it (`ALTER SYSTEM` would write below).
const AUTO_CONF: &str = "# Do not edit this file manually!\n\
                         # It will be overwritten by the ALTER SYSTEM command.\n";

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
