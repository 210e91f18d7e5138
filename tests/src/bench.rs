//! What the benchmarks share (`throughput`, `cost`): intents to publish and publishing them with a
//! window of confirms, consuming, a null downstream that answers every write with a matching
//! receipt at once, CPU time per process group read from `/proc`, what a run wrote into its
//! database, and RabbitMQ's quorum-queue WAL (rolled over between phases, a roll-over seen).
//!
//! CPU accounting counts every process of a group for the whole interval: the live processes'
//! own time (utime + stime, all threads), and the time of those that exited meanwhile, which
//! Linux adds to their parent's children time (cutime + cstime) once reaped (Postgres backends
//! and autovacuum workers are children of the postmaster).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context as _, Result};
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, Consumer, PublisherConfirm};
use protocol::Intent;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{sleep, timeout_at, Instant};

use crate::Env;

/// Publisher confirms kept outstanding by [`publish_all`].
pub const CONFIRM_WINDOW: usize = 256;
/// Linux clock ticks per second for /proc CPU times.
pub const CLK_TCK: f64 = 100.0;

/// Cumulative writes into the run's database (`pg_stat_user_tables`, sizes of its relations)
/// and the WAL the server has written (cluster-wide).
#[derive(Clone, Copy, Debug)]
pub struct Written {
    /// Row versions in every table.
    pub versions: i64,
    /// Row versions in the tables an intent writes (`operations`, `result_outbox`, the history
    /// log); the rest are written per second, not per intent (heartbeats, relay watermarks).
    pub intent_versions: i64,
    pub updates: i64,
    pub hot: i64,
    pub heap_bytes: i64,
    pub index_bytes: i64,
    pub wal_bytes: i64,
}

impl Written {
    pub async fn take(env: &Env) -> Option<Written> {
        let _ = sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&env.pool)
            .await;
        let row: Result<(i64, i64, i64, i64, i64, i64, i64), _> = sqlx::query_as(
            "SELECT (SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::int8
                     FROM pg_stat_user_tables),
                    (SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::int8
                     FROM pg_stat_user_tables
                     WHERE relname IN ('operations', 'result_outbox', 'operation_history_log')),
                    (SELECT coalesce(sum(n_tup_upd), 0)::int8 FROM pg_stat_user_tables),
                    (SELECT coalesce(sum(n_tup_hot_upd), 0)::int8 FROM pg_stat_user_tables),
                    coalesce(sum(pg_relation_size(c.oid)) FILTER (WHERE c.relkind = 'r'), 0)::int8,
                    coalesce(sum(pg_relation_size(c.oid)) FILTER (WHERE c.relkind = 'i'), 0)::int8,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = 'public'",
        )
        .fetch_one(&env.pool)
        .await;
        row.map_err(|e| eprintln!("warning: pg_stat_user_tables: {e}"))
            .ok()
            .map(
                |(versions, intent_versions, updates, hot, heap_bytes, index_bytes, wal_bytes)| {
                    Written {
                        versions,
                        intent_versions,
                        updates,
                        hot,
                        heap_bytes,
                        index_bytes,
                        wal_bytes,
                    }
                },
            )
    }

    pub fn since(&self, before: &Written) -> Written {
        Written {
            versions: self.versions - before.versions,
            intent_versions: self.intent_versions - before.intent_versions,
            updates: self.updates - before.updates,
            hot: self.hot - before.hot,
            heap_bytes: self.heap_bytes - before.heap_bytes,
            index_bytes: self.index_bytes - before.index_bytes,
            wal_bytes: self.wal_bytes - before.wal_bytes,
        }
    }
}

/// Percentile `p` (0–100) of sorted, non-empty values: the one index rule of every figure the
/// benchmarks print.
pub fn pct<T: Copy>(sorted: &[T], p: usize) -> T {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

/// N distinct intents of `tenant` for `tool`, as (message id, body).
pub fn build_messages(n: usize, tenant: &str, tool: &str) -> Vec<(String, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let intent = Intent {
                tenant: tenant.into(),
                action_id: format!("bench-{i:07}"),
                tool: tool.into(),
                arguments: serde_json::json!({
                    "order": format!("order-{i:07}"),
                    "amount_cents": 4850,
                    "currency": "USD",
                }),
                call_id: Some(format!("call-{i:07}")),
                reply_to: Some(tenant.into()),
                compensates: None,
            };
            (
                publisher::action_key(&intent.tenant, &intent.action_id),
                intent.to_json(),
            )
        })
        .collect()
}

pub async fn confirm_channel(conn: &Connection) -> Result<Channel> {
    let ch = conn.create_channel().await.context("open channel")?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .context("confirm.select")?;
    Ok(ch)
}

/// A channel of its own consuming `queue` with `prefetch`, manual acks; the channel is returned
/// so the caller keeps it open as long as it consumes.
pub async fn consume_on(
    conn: &Connection,
    queue: &str,
    prefetch: u16,
    tag: &str,
) -> Result<(Channel, Consumer)> {
    let ch = conn.create_channel().await.context("open channel")?;
    ch.basic_qos(prefetch, BasicQosOptions::default())
        .await
        .context("basic.qos")?;
    let consumer = ch
        .basic_consume(
            queue.into(),
            tag.into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("basic.consume {queue}"))?;
    Ok((ch, consumer))
}

/// Publishes every message (persistent, mandatory, JSON, message id = action key) with up to
/// [`CONFIRM_WINDOW`] confirms outstanding; returns when all are confirmed.
pub async fn publish_all(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    messages: &[(String, Vec<u8>)],
    deadline: Instant,
) -> Result<()> {
    let mut outstanding: VecDeque<PublisherConfirm> = VecDeque::with_capacity(CONFIRM_WINDOW);
    for (message_id, body) in messages {
        if outstanding.len() >= CONFIRM_WINDOW {
            if let Some(oldest) = outstanding.pop_front() {
                check_confirm(oldest, deadline).await?;
            }
        }
        let properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_message_id(message_id.as_str().into());
        let publish = ch.basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            body,
            properties,
        );
        let confirm = timeout_at(deadline, publish)
            .await
            .map_err(|_| anyhow!("basic.publish did not return before the phase deadline"))?
            .context("basic.publish")?;
        outstanding.push_back(confirm);
    }
    while let Some(confirm) = outstanding.pop_front() {
        check_confirm(confirm, deadline).await?;
    }
    Ok(())
}

/// Publishes `messages` open loop: message i leaves at `started + i/rate`, whatever happened to
/// the others; confirms are checked by another task, so the publisher never waits for one.
/// `on_send(i)` runs just before message i is published; returns when every confirm is in.
#[allow(clippy::too_many_arguments)]
pub async fn publish_open_loop(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    messages: &[(String, Vec<u8>)],
    rate: f64,
    started: Instant,
    deadline: Instant,
    mut on_send: impl FnMut(usize),
) -> Result<()> {
    let (confirms, mut confirm_rx) = tokio::sync::mpsc::unbounded_channel::<PublisherConfirm>();
    let checker = tokio::spawn(async move {
        while let Some(c) = confirm_rx.recv().await {
            check_confirm(c, deadline).await?;
        }
        Ok::<(), anyhow::Error>(())
    });
    for (i, (message_id, body)) in messages.iter().enumerate() {
        tokio::time::sleep_until(started + Duration::from_secs_f64(i as f64 / rate)).await;
        let properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_message_id(message_id.as_str().into());
        on_send(i);
        let confirm = ch
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                body,
                properties,
            )
            .await
            .context("basic.publish")?;
        let _ = confirms.send(confirm);
    }
    drop(confirms);
    checker.await.context("confirm checker")?
}

pub async fn check_confirm(confirm: PublisherConfirm, deadline: Instant) -> Result<()> {
    match timeout_at(deadline, confirm).await {
        Err(_) => bail!("no publisher confirm before the phase deadline"),
        Ok(Err(e)) => Err(e).context("publisher confirm"),
        Ok(Ok(Confirmation::Ack(None))) => Ok(()),
        Ok(Ok(Confirmation::Ack(Some(returned)))) => {
            bail!("message returned as unroutable: {}", returned.reply_text)
        }
        Ok(Ok(Confirmation::Nack(_))) => bail!("the broker nacked a message"),
        Ok(Ok(Confirmation::NotRequested)) => bail!("channel not in confirm mode"),
    }
}

pub async fn declare_quorum(ch: &Channel, queue: &str) -> Result<()> {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        args,
    )
    .await
    .with_context(|| format!("declare quorum queue {queue}"))?;
    Ok(())
}

/// Peak resident set (VmHWM) of a process, KiB.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

pub async fn state_counts(env: &Env) -> Result<BTreeMap<String, i64>> {
    let rows: Vec<(String, i64)> =
        // `--large-ledger` rows (`old-…`) are not the run's.
        sqlx::query_as(
            "SELECT state, count(*) FROM operations WHERE action_id NOT LIKE 'old-%' GROUP BY state",
        )
            .fetch_all(&env.pool)
            .await
            .context("count operations by state")?;
    Ok(rows.into_iter().collect())
}

/// Backends connected to the run's database (the benchmark's own few, which only read
/// statistics, included).
pub async fn run_backends(env: &Env) -> Option<Vec<u32>> {
    sqlx::query_scalar::<_, i32>(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()",
    )
    .fetch_all(&env.pool)
    .await
    .map_err(|e| eprintln!("warning: pg_stat_activity: {e}"))
    .ok()
    .map(|pids| pids.into_iter().map(|p| p as u32).collect())
}

pub async fn xact_commit(env: &Env) -> Option<i64> {
    let _ = sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&env.pool)
        .await;
    sqlx::query_scalar(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&env.pool)
    .await
    .map_err(|e| eprintln!("warning: pg_stat_database: {e}"))
    .ok()
}

pub async fn wal_syncs(env: &Env) -> Option<i64> {
    sqlx::query_scalar("SELECT wal_sync FROM pg_stat_wal")
        .fetch_one(&env.pool)
        .await
        .map_err(|e| eprintln!("warning: pg_stat_wal: {e}"))
        .ok()
}

pub struct NullDownstream {
    pub port: u16,
    pub requests: Arc<AtomicU64>,
    pub missing_key: Arc<AtomicU64>,
}

impl NullDownstream {
    pub async fn start() -> Result<NullDownstream> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("bind the null downstream")?;
        let port = listener.local_addr()?.port();
        let requests = Arc::new(AtomicU64::new(0));
        let missing_key = Arc::new(AtomicU64::new(0));
        let (req, missing) = (requests.clone(), missing_key.clone());
        tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        let _ = stream.set_nodelay(true);
                        let (req, missing) = (req.clone(), missing.clone());
                        tokio::spawn(async move {
                            if let Err(e) = serve(stream, &req, &missing).await {
                                eprintln!("null downstream: connection error: {e}");
                            }
                        });
                    }
                    Err(e) => {
                        eprintln!("null downstream: accept: {e}");
                        sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
        Ok(NullDownstream {
            port,
            requests,
            missing_key,
        })
    }
}

const MAX_LINE: u64 = 16 * 1024;

const MAX_HEADERS: usize = 100;

const MAX_BODY: usize = 1 << 20;

/// Serves requests on one connection until the peer closes it.
async fn serve(stream: TcpStream, requests: &AtomicU64, missing_key: &AtomicU64) -> Result<()> {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    let mut line = String::new();
    loop {
        line.clear();
        if (&mut reader).take(MAX_LINE).read_line(&mut line).await? == 0 {
            return Ok(()); // closed between requests
        }
        let mut content_length = 0usize;
        let mut key: Option<String> = None;
        let mut ended = false;
        for _ in 0..MAX_HEADERS {
            line.clear();
            if (&mut reader).take(MAX_LINE).read_line(&mut line).await? == 0 {
                bail!("connection closed inside a request head");
            }
            let header = line.trim_end_matches(['\r', '\n']);
            if header.is_empty() {
                ended = true;
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                let value = value.trim();
                if name.eq_ignore_ascii_case("content-length") {
                    content_length = value.parse().context("Content-Length")?;
                } else if name.eq_ignore_ascii_case("idempotency-key") {
                    key = Some(value.to_string());
                } else if name.eq_ignore_ascii_case("transfer-encoding") {
                    bail!("chunked request bodies are not supported");
                }
            }
        }
        ensure!(ended, "more than {MAX_HEADERS} header lines");
        ensure!(content_length <= MAX_BODY, "request body too large");
        let mut body = vec![0u8; content_length];
        reader.read_exact(&mut body).await?;
        let n = requests.fetch_add(1, Ordering::SeqCst) + 1;
        if key.is_none() {
            missing_key.fetch_add(1, Ordering::SeqCst);
        }
        let answer = serde_json::json!({
            "receipt_id": format!("r-{n}"),
            "idempotency_key": key.unwrap_or_default(),
        })
        .to_string();
        let response = format!(
            "HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{answer}",
            answer.len()
        );
        write.write_all(response.as_bytes()).await?;
    }
}

/// CPU ticks per process group at one moment, and how long their threads have waited for a
/// core.
pub struct CpuSample {
    /// Per live process of a group: its group, its own ticks, the ticks of its children that
    /// exited and were reaped, and the time its live threads have spent runnable but waiting
    /// for a core (ns, [`run_queue_wait`]).
    pub per_pid: HashMap<u32, (Group, u64, u64, u64)>,
    pub bench: u64,
    /// This process's threads' time waiting for a core (ns).
    pub bench_waited: u64,
    pub machine_busy: u64,
}

/// Which component a process belongs to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Group {
    Worker,
    Postgres,
    Rabbit,
}

/// CPU ticks used between two samples, and the time each component's threads waited for a
/// core meanwhile.
#[derive(Default, Debug, Clone, Copy)]
pub struct CpuSplit {
    pub worker: u64,
    pub postgres: u64,
    pub rabbit: u64,
    pub bench: u64,
    pub machine: u64,
    pub waited: Waited,
}

/// Time runnable threads spent waiting for a core between two samples, per component (ns):
/// on a busy machine, what a latency is made of beside the work itself. Threads that exited
/// between the samples are not counted (their time is gone with them), so these are at least.
#[derive(Default, Debug, Clone, Copy)]
pub struct Waited {
    pub worker: u64,
    pub postgres: u64,
    pub rabbit: u64,
    pub bench: u64,
}

impl Waited {
    /// The wait of `group`'s processes.
    fn of(&mut self, group: Group) -> &mut u64 {
        match group {
            Group::Worker => &mut self.worker,
            Group::Postgres => &mut self.postgres,
            Group::Rabbit => &mut self.rabbit,
        }
    }

    /// "worker A µs, Postgres B µs, RabbitMQ C µs, bench D µs" per one of `n` intents.
    pub fn per(&self, n: usize) -> String {
        let us = |ns: u64| ns as f64 / 1e3 / n.max(1) as f64;
        format!(
            "worker {:.0} µs, Postgres {:.0} µs, RabbitMQ {:.0} µs, bench {:.0} µs",
            us(self.worker),
            us(self.postgres),
            us(self.rabbit),
            us(self.bench)
        )
    }
}

/// CPU `ticks` spread over `n` intents (or messages), in µs each.
pub fn us_per(ticks: u64, n: usize) -> f64 {
    ticks as f64 / CLK_TCK * 1e6 / n as f64
}

impl CpuSplit {
    pub const HEADER: &'static str = "worker  pg  rabbit  bench  | machine";

    /// The machine's busy cores over `elapsed`.
    pub fn busy_cores(&self, elapsed: Duration) -> f64 {
        self.machine as f64 / CLK_TCK / elapsed.as_secs_f64().max(1e-9)
    }

    /// Cores used per group over `elapsed`, and the whole machine's busy cores.
    pub fn cores(&self, elapsed: Duration) -> String {
        let secs = elapsed.as_secs_f64().max(1e-9);
        let c = |ticks: u64| ticks as f64 / CLK_TCK / secs;
        format!(
            "{:.2}  {:.2}  {:.2}  {:.2}  | {:.2}",
            c(self.worker),
            c(self.postgres),
            c(self.rabbit),
            c(self.bench),
            c(self.machine)
        )
    }
}

/// The component of a process named `comm` (not a worker): Postgres is every `postgres`
/// process (postmaster, backends, WAL writer, checkpointer, autovacuum...), RabbitMQ the Erlang
/// VM and its helpers.
/// The command name of process `pid` (`/proc/<pid>/comm`), if it still runs.
fn comm(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|c| c.trim().to_string())
}

fn group_of(comm: &str) -> Option<Group> {
    match comm {
        "postgres" => Some(Group::Postgres),
        "beam.smp" | "epmd" | "erl_child_setup" | "inet_gethost" => Some(Group::Rabbit),
        _ => None,
    }
}

impl CpuSample {
    pub fn take(worker_pids: &[u32]) -> CpuSample {
        let mut per_pid = HashMap::new();
        for pid in crate::procs::all_pids() {
            let group = if worker_pids.contains(&pid) {
                Group::Worker
            } else {
                match comm(pid).as_deref().and_then(group_of) {
                    Some(g) => g,
                    None => continue,
                }
            };
            if let Some((own, children)) = proc_times(&format!("/proc/{pid}/stat")) {
                per_pid.insert(pid, (group, own, children, run_queue_wait(pid)));
            }
        }
        CpuSample {
            per_pid,
            bench: proc_times("/proc/self/stat").map_or(0, |(own, _)| own),
            bench_waited: run_queue_wait(std::process::id()),
            machine_busy: machine_busy(),
        }
    }

    /// Own ticks used by `pids` since `before` (a pid that did not exist then counts from zero).
    pub fn ticks_since(&self, before: &CpuSample, pids: &[u32]) -> u64 {
        pids.iter()
            .filter_map(|pid| {
                let now = self.per_pid.get(pid)?.1;
                let start = before.per_pid.get(pid).map_or(0, |(_, t, _, _)| *t);
                Some(now.saturating_sub(start))
            })
            .sum()
    }

    /// Ticks per group since `before`: each live process's own time since then (from zero for
    /// one started meanwhile), plus what its exited children used (their reaped time since
    /// then), minus the share of those children `before` had already counted as live.
    pub fn since(&self, before: &CpuSample) -> CpuSplit {
        let mut split = CpuSplit {
            bench: self.bench.saturating_sub(before.bench),
            machine: self.machine_busy.saturating_sub(before.machine_busy),
            ..CpuSplit::default()
        };
        split.waited.bench = self.bench_waited.saturating_sub(before.bench_waited);
        let mut add = |group: Group, ticks: i64| {
            let slot = match group {
                Group::Worker => &mut split.worker,
                Group::Postgres => &mut split.postgres,
                Group::Rabbit => &mut split.rabbit,
            };
            *slot = (*slot as i64 + ticks).max(0) as u64;
        };
        for (pid, &(group, own, children, waited)) in &self.per_pid {
            let (own0, children0, waited0) = before
                .per_pid
                .get(pid)
                .map_or((0, 0, 0), |&(_, o, c, w)| (o, c, w));
            add(group, own.saturating_sub(own0) as i64);
            if group != Group::Worker {
                add(group, children.saturating_sub(children0) as i64);
            }
            // A thread that exited meanwhile takes its time with it: never below zero.
            *split.waited.of(group) += waited.saturating_sub(waited0);
        }
        for (pid, (group, own, _, _)) in &before.per_pid {
            if *group != Group::Worker && !self.per_pid.contains_key(pid) {
                add(*group, -(*own as i64));
            }
        }
        split
    }
}

/// The time the live threads of process `pid` have spent runnable but waiting for a core, in
/// ns (0 if it is gone).
fn run_queue_wait(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

/// (utime + stime, cutime + cstime) of a process (all threads) in clock ticks.
fn proc_times(path: &str) -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string(path).ok()?;
    // Fields after the parenthesised command: state is field 3, utime 14, stime 15, cutime 16,
    // cstime 17.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| fields.get(i)?.parse::<u64>().ok();
    Some((field(11)? + field(12)?, field(13)? + field(14)?))
}

/// Busy ticks of all CPUs (user, nice, system, irq, softirq, steal) from /proc/stat.
pub fn machine_busy() -> u64 {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return 0;
    };
    let Some(line) = stat.lines().next() else {
        return 0;
    };
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal
    [0usize, 1, 2, 5, 6, 7]
        .iter()
        .filter_map(|&i| v.get(i))
        .sum()
}

/// The Erlang expression that rolls the local node's quorum-queue WAL over and returns once its
/// segment writer has flushed the closed file: names from the `quorum_queues` Ra system, so it
/// holds on 3.10 and 4.x alike.
const WAL_ROLL_OVER: &str = "#{wal := W, segment_writer := S} = \
maps:get(names, ra_system:fetch(quorum_queues)), ok = ra_log_wal:force_roll_over(W), \
_ = sys:get_state(W), ra_log_segment_writer:await(S).";

/// Rolls the quorum-queue write-ahead log of the RabbitMQ node on this machine over now
/// (`rabbitmqctl eval`; `RABBITMQCTL` names another `rabbitmqctl`), and returns once the closed
/// file's entries are in their queues' segments. The tool is an Erlang VM of its own (about
/// 0.3 s of CPU): call it between measurements, not in one. Every quorum queue of a node
/// appends to one WAL; at `raft.wal_max_size_bytes` (512 MiB by default) the node rolls it over
/// by itself, and for tens of milliseconds while the segment writer flushes, every queue's
/// deliveries wait. Where that falls depends on everything written before, so a benchmark that
/// compares runs rolls it over between them. Needs the node's Erlang cookie (root or the
/// `rabbitmq` user).
pub async fn roll_over_broker_wal() -> Result<()> {
    let ctl = std::env::var("RABBITMQCTL").unwrap_or_else(|_| "rabbitmqctl".into());
    let out = tokio::process::Command::new(&ctl)
        .args(["eval", WAL_ROLL_OVER])
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("run {ctl}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success() && stdout.trim() == "ok",
        "{ctl} eval (roll the quorum WAL over): {}: {}{}",
        out.status,
        stdout.trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// The quorum-queue WAL files the RabbitMQ processes on this machine hold open, sorted (empty
/// when `/proc/<pid>/fd` of the broker cannot be read: another user without privileges). Two
/// readings that differ mean the broker rolled its WAL over between them.
pub fn broker_wal_files() -> Vec<String> {
    let mut files = Vec::new();
    for pid in crate::procs::all_pids() {
        if comm(pid).as_deref() != Some("beam.smp") {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path()) {
                let target = target.to_string_lossy().into_owned();
                if target.contains("/quorum/") && target.ends_with(".wal") {
                    files.push(target);
                }
            }
        }
    }
    files.sort();
    files
}
