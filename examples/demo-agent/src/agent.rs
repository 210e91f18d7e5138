//! The two scenarios and everything they send, on the library's public API: [`Publisher`]
//! (confirmed, mandatory publishes; waiting for the worker's exchange at start),
//! [`Follower::follow_keys`] (the agent's own results queue, bound before the first intent),
//! [`Outbox`] (an intent in the same transaction as the agent's own write), and the
//! `intent_outbox` table written directly for a body that must go out exactly as written.
//! What each scenario does is in the crate's documentation ([`crate`]).

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use tracing::{info, warn, Instrument as _};

use publisher::{Follower, Outbox, PublishError, Publisher};

/// How long the demo waits for the broker and the worker's exchange at start.
const STARTUP: Duration = Duration::from_secs(60);
/// Pause between start-up attempts.
const STARTUP_PAUSE: Duration = Duration::from_secs(1);

/// Which demo `demo-agent` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Scenario {
    /// `count` intents at `interval`, every k-th sent again at once; every answer printed.
    #[default]
    Stream,
    /// Refunds, repeats answered from the ledger, one conflicting reuse, one long-running
    /// deploy (accepted, then succeeded), one lost reply held for a person, one refund above
    /// the approval limit (approved, then succeeded), one compensation of a refund; ends with
    /// a `key=value` summary.
    Full,
}

/// What `demo-agent` was asked to do.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    pub scenario: Scenario,
    /// The id in every action id; default: one unique to this run.
    pub run_id: Option<String>,
    /// `full`: the tool (declared `recovery = "none"`) of the action whose reply is lost.
    pub held_tool: String,
    /// `full`: the tool (declared `completion = "async"`) of the long-running action.
    pub async_tool: String,
    /// `full`: the tool (declared `compensation_for = [<tool>]`) of the compensation.
    pub reversal_tool: String,
    /// `full`: how the refund above the approval limit is approved.
    pub approver: Option<Approver>,
    /// `full`: the worker's status API root and a token for it (tenant or admin), asked
    /// whether the pending action is held.
    pub status: Option<(String, String)>,
    pub amqp_url: String,
    pub exchange: String,
    pub results_exchange: String,
    pub tenant: String,
    pub tool: String,
    pub count: u64,
    pub interval: Duration,
    /// Re-publish every k-th intent; 0 disables.
    pub duplicate_every: u64,
    pub set_user_id: bool,
    /// The agent's database: enqueue through its outbox instead of publishing.
    pub database_url: Option<String>,
    /// How long to wait for the last answers.
    pub answer_timeout: Duration,
}

/// How the `full` scenario approves its refund above the approval limit, standing in for a
/// person: `worker ops approve` (the `worker` binary, run as a subprocess with a clean
/// environment) on the worker's ledger and tools file, as an operator would.
#[derive(Debug, Clone)]
pub struct Approver {
    /// The `worker` binary.
    pub worker_bin: PathBuf,
    /// The worker's ledger (`DATABASE_URL` of `worker ops approve`).
    pub ledger_url: String,
    /// The worker's tools file (`WORKER_TOOLS`).
    pub tools: PathBuf,
    /// An extra CA bundle for the ledger's TLS (`WORKER_CA_FILE`).
    pub ca_file: Option<PathBuf>,
}

/// Who approves, as `worker ops approve --operator` records it (`operator:<name>` in the
/// operation's history).
pub const APPROVER: &str = "demo-approver";
/// The amount of the refund that needs approval: above the refund tool's limit in
/// deploy/tools.demo.toml (`approval_when = { "/amount_cents" = { gt = 100000 } }`); every other
/// refund of the demo is far below it.
const APPROVAL_AMOUNT_CENTS: u64 = 250_000;
/// How long `worker ops approve` may take (connect, load the tools file, one transaction).
const APPROVE_TIMEOUT: Duration = Duration::from_secs(30);

impl Approver {
    /// Runs `worker ops approve <tenant> <action_id> --fingerprint <fingerprint>`; returns what
    /// it printed (the arguments approved and the operation's new state). A non-zero exit is an
    /// error carrying its output.
    async fn approve(
        &self,
        tenant: &str,
        action_id: &str,
        fingerprint: &str,
    ) -> anyhow::Result<String> {
        let mut cmd = tokio::process::Command::new(&self.worker_bin);
        cmd.args(["ops", "approve", tenant, action_id, "--operator", APPROVER])
            .args([
                "--reason",
                "demo: a refund above the approval limit, checked",
            ])
            .args(["--fingerprint", fingerprint])
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("RUST_LOG", "warn")
            .env("DATABASE_URL", &self.ledger_url)
            .env("WORKER_TOOLS", &self.tools)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        if let Some(ca) = &self.ca_file {
            cmd.env("WORKER_CA_FILE", ca);
        }
        let bin = self.worker_bin.display();
        let out = tokio::time::timeout(APPROVE_TIMEOUT, cmd.output())
            .await
            .with_context(|| format!("{bin} ops approve did not end within {APPROVE_TIMEOUT:?}"))?
            .with_context(|| format!("cannot run {bin} ops approve (pass --worker-bin)"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !out.status.success() {
            bail!(
                "{bin} ops approve {tenant} {action_id} failed ({}): {} {}",
                out.status,
                stdout,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(stdout)
    }
}

/// Runs the demo agent to completion.
pub async fn run(config: DemoConfig) -> anyhow::Result<()> {
    let deadline = Instant::now() + STARTUP;
    let publisher = connect_when_ready(&config, deadline)
        .await?
        .with_user_id(config.set_user_id);
    let run_id = config.run_id.clone().unwrap_or_else(run_id);
    let reply_to = format!("demo-agent-{run_id}");
    // Bound before anything is sent, so no answer is missed.
    let mut answers = Follower::follow_keys(
        &config.amqp_url,
        &config.results_exchange,
        &[protocol::result_routing_key(
            &config.tenant,
            Some(&reply_to),
        )],
        None,
    )
    .await
    .context("cannot bind the demo agent's results queue")?;
    let outbox = match &config.database_url {
        Some(url) => Some(agent_database(url).await?),
        None => None,
    };
    info!(%run_id, tenant = %config.tenant, tool = %config.tool, count = config.count,
        %reply_to, via_outbox = outbox.is_some(), scenario = ?config.scenario, "demo starting");
    if config.scenario == Scenario::Full {
        let mut tour = Tour {
            config: &config,
            publisher: &publisher,
            outbox: outbox.as_ref(),
            answers: &mut answers,
            deadline,
            run_id: &run_id,
            reply_to: &reply_to,
            log: Vec::new(),
            seen: HashSet::new(),
            tally: Tally::default(),
        };
        let outcome = tour.run().await;
        let tally = tour.tally.clone();
        answers.close().await.ok();
        publisher.close().await.ok();
        print!("{}", tally.render());
        return outcome;
    }

    let stream = Stream {
        config: &config,
        publisher: &publisher,
        outbox: outbox.as_ref(),
        deadline,
        run_id: &run_id,
        reply_to: &reply_to,
    };
    stream.run(&mut answers).await?;
    answers.close().await.ok();
    publisher.close().await.ok();
    Ok(())
}

/// The agent's database: its outbox, and its own table of refund requests that each intent is
/// recorded with.
async fn agent_database(url: &str) -> anyhow::Result<sqlx::PgPool> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(publisher::tls::postgres(url)?)
        .await
        .context("cannot connect to the agent database")?;
    Outbox::migrate(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS demo_refund_requests (
             action_id text PRIMARY KEY, order_ref text NOT NULL,
             amount_cents bigint NOT NULL, requested_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&pool)
    .await?;
    Ok(pool)
}

/// The `stream` scenario: `count` intents, paced, every k-th sent again; prints every answer.
struct Stream<'a> {
    config: &'a DemoConfig,
    publisher: &'a Publisher,
    outbox: Option<&'a sqlx::PgPool>,
    deadline: Instant,
    run_id: &'a str,
    reply_to: &'a str,
}

impl Stream<'_> {
    async fn run(&self, answers: &mut Follower) -> anyhow::Result<()> {
        let (config, run_id, reply_to) = (self.config, self.run_id, self.reply_to);
        let mut open: BTreeMap<String, ()> = BTreeMap::new();
        let mut shown = 0u64;
        for i in 1..=config.count {
            if i > 1 {
                // Show answers while pacing the requests.
                let pause = Instant::now() + config.interval;
                while let Some(left) = pause.checked_duration_since(Instant::now()) {
                    match answers.next(left).await {
                        Ok(Some(event)) => show(&event, &mut open, &mut shown),
                        Ok(None) => break,
                        Err(error) => warn!(%error, "skipped a results message"),
                    }
                }
            }
            let action_id = format!("demo-{run_id}-{i}");
            let call_id = format!("call-{run_id}-{i}");
            let body = intent_json(config, &action_id, &call_id, reply_to, i, false);
            let fingerprint = self.send(&body, i).await?;
            open.insert(action_id.clone(), ());
            info!(tenant = %config.tenant, %action_id, %call_id, %fingerprint, "sent intent");

            if config.duplicate_every > 0 && i % config.duplicate_every == 0 {
                let call_id = format!("call-{run_id}-{i}-again");
                let body = intent_json(config, &action_id, &call_id, reply_to, i, true);
                let again = self.send(&body, i).await?;
                info!(
                    tenant = %config.tenant, %action_id, %call_id, fingerprint = %again,
                    same_fingerprint = again == fingerprint,
                    "sent the same action again (new call id): expect a duplicate"
                );
            }
        }
        let until = Instant::now() + config.answer_timeout;
        while !open.is_empty() {
            let Some(left) = until.checked_duration_since(Instant::now()) else {
                break;
            };
            match answers.next(left).await {
                Ok(Some(event)) => show(&event, &mut open, &mut shown),
                Ok(None) => break,
                Err(error) => warn!(%error, "skipped a results message"),
            }
        }
        info!(%run_id, answers = shown, without_final_answer = open.len(), "demo done");
        Ok(())
    }

    /// Enqueues through the outbox or publishes; returns the intent's fingerprint.
    async fn send(&self, body: &str, i: u64) -> anyhow::Result<String> {
        let sent = async {
            match self.outbox {
                Some(pool) => enqueue(pool, body, i).await,
                None => publish_checked(self.publisher, body, self.deadline).await,
            }
        };
        sent.instrument(agent_turn(body)).await
    }
}

/// Prints an answer (one JSON line on stdout) and closes its action when it is final.
fn show(event: &protocol::ResultEvent, open: &mut BTreeMap<String, ()>, shown: &mut u64) {
    *shown += 1;
    info!(action_id = %event.action_id, status = event.status.as_str(), message = %event.message, "answer");
    if let Ok(line) = serde_json::to_string(event) {
        println!("{line}");
    }
    if event.status != protocol::Status::Pending {
        open.remove(&event.action_id);
    }
}

/// What the `full` scenario saw, printed as `key=value` lines by [`Tally::render`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    pub run_id: String,
    /// Every intent this agent enqueued (or published): first sends, repeats and the reuse.
    pub intents_sent: u64,
    /// Distinct actions `(tenant, action_id)` among them.
    pub actions: u64,
    /// Actions whose (final) answer was `succeeded`.
    pub succeeded: u64,
    /// Actions answered `failed` or `rejected` (none expected).
    pub failed_or_rejected: u64,
    /// Repeats sent (same action, same arguments, reordered and re-spaced JSON).
    pub repeats_sent: u64,
    /// Repeats answered `succeeded` with the receipt of the action's first answer.
    pub repeats_answered_from_ledger: u64,
    /// Reuses of an action id with other arguments.
    pub conflicts_sent: u64,
    /// Reuses answered `rejected` / `intent_conflict`.
    pub conflicts_refused: u64,
    /// The long-running action (`<async tool>-<run id>`).
    pub async_action_id: String,
    /// 1 when it was answered `pending` with uncertainty `in_progress` and the downstream's
    /// operation id (accepted, being polled), else 0.
    pub async_accepted: u64,
    /// The operation id of that `pending` answer (`remote_id`).
    pub async_operation_id: String,
    /// Its final answer's status (`succeeded`, `failed`, `rejected`).
    pub async_status: String,
    /// How the final answer is known (`verified_by`: `poll` for a polled operation).
    pub async_verified_by: String,
    /// The final answer's receipt id (`remote_id`).
    pub async_receipt_id: String,
    /// Actions answered `pending` at least once: in progress (the long-running action) or
    /// with an unknown outcome (the lost reply).
    pub pending: u64,
    /// The lost reply answered `pending` and then shown held for a person by the status API.
    pub held: u64,
    /// The action whose reply is lost after commit.
    pub held_action_id: String,
    /// The refund above the approval limit.
    pub approval_action_id: String,
    /// 1 when it was answered `pending` with uncertainty `awaiting_approval` before it was
    /// approved, else 0.
    pub approval_awaiting: u64,
    /// Who approved it with `worker ops approve` (empty when it was not approved).
    pub approval_operator: String,
    /// Its final answer's status once approved.
    pub approval_status: String,
    /// The compensation (`<reversal tool>-<run id>`).
    pub compensation_action_id: String,
    /// The action it undoes (`refund-<run id>-1`).
    pub compensation_of: String,
    /// The compensation's final answer's status.
    pub compensation_status: String,
    /// The `compensates` of that answer (the original it names).
    pub compensation_compensates: String,
    /// The `compensated_by` of the `succeeded` answer about the original that followed.
    pub compensated_by: String,
    /// Result events received (distinct event ids).
    pub answers: u64,
    /// Whether every answer the scenario waits for arrived in time.
    pub complete: bool,
}

impl Tally {
    /// The summary: one `key=value` line each, in a fixed order.
    pub fn render(&self) -> String {
        let lines: [(&str, String); 30] = [
            ("run_id", self.run_id.clone()),
            ("intents_sent", self.intents_sent.to_string()),
            ("actions", self.actions.to_string()),
            ("succeeded", self.succeeded.to_string()),
            ("failed_or_rejected", self.failed_or_rejected.to_string()),
            ("repeats_sent", self.repeats_sent.to_string()),
            (
                "repeats_answered_from_ledger",
                self.repeats_answered_from_ledger.to_string(),
            ),
            ("conflicts_sent", self.conflicts_sent.to_string()),
            ("conflicts_refused", self.conflicts_refused.to_string()),
            ("async_action_id", self.async_action_id.clone()),
            ("async_accepted", self.async_accepted.to_string()),
            ("async_operation_id", self.async_operation_id.clone()),
            ("async_status", self.async_status.clone()),
            ("async_verified_by", self.async_verified_by.clone()),
            ("async_receipt_id", self.async_receipt_id.clone()),
            ("pending", self.pending.to_string()),
            ("held", self.held.to_string()),
            ("held_action_id", self.held_action_id.clone()),
            ("approval_action_id", self.approval_action_id.clone()),
            ("approval_awaiting", self.approval_awaiting.to_string()),
            ("approval_operator", self.approval_operator.clone()),
            ("approval_status", self.approval_status.clone()),
            (
                "compensation_action_id",
                self.compensation_action_id.clone(),
            ),
            ("compensation_of", self.compensation_of.clone()),
            ("compensation_status", self.compensation_status.clone()),
            (
                "compensation_compensates",
                self.compensation_compensates.clone(),
            ),
            ("compensated_by", self.compensated_by.clone()),
            ("answers", self.answers.to_string()),
            ("complete", self.complete.to_string()),
            ("summary_end", "1".to_string()),
        ];
        lines.iter().map(|(k, v)| format!("{k}={v}\n")).collect()
    }
}

/// The `full` scenario's state while it runs.
struct Tour<'a> {
    config: &'a DemoConfig,
    publisher: &'a Publisher,
    outbox: Option<&'a sqlx::PgPool>,
    answers: &'a mut Follower,
    /// End of the start-up window (an unroutable publish is retried until then).
    deadline: Instant,
    run_id: &'a str,
    reply_to: &'a str,
    /// Every distinct result event received, in arrival order.
    log: Vec<protocol::ResultEvent>,
    seen: HashSet<String>,
    tally: Tally,
}

/// The first final answer (`succeeded`, `failed`, `rejected`) for `action_id` in `log`.
fn final_for<'e>(
    log: &'e [protocol::ResultEvent],
    action_id: &str,
) -> Option<&'e protocol::ResultEvent> {
    log.iter()
        .find(|e| e.action_id == action_id && e.status != protocol::Status::Pending)
}

/// The first answer of any status for `action_id` in `log`.
fn any_for<'e>(
    log: &'e [protocol::ResultEvent],
    action_id: &str,
) -> Option<&'e protocol::ResultEvent> {
    log.iter().find(|e| e.action_id == action_id)
}

fn receipt_id(event: &protocol::ResultEvent) -> Option<&str> {
    event
        .receipt
        .as_ref()
        .and_then(|r| r.get("receipt_id"))
        .and_then(serde_json::Value::as_str)
}

/// What the agent was told about a long-running action: its acceptance and its final answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct AsyncReport {
    /// The operation id of a `pending` / `in_progress` answer (accepted, being polled).
    accepted: Option<String>,
    /// The final answer's status, `verified_by` and receipt id (`remote_id`, else the
    /// receipt's `receipt_id`).
    status: String,
    verified_by: String,
    receipt_id: String,
}

/// The [`AsyncReport`] of `action_id` in `log`, once it has a final answer.
fn async_report(log: &[protocol::ResultEvent], action_id: &str) -> Option<AsyncReport> {
    let done = final_for(log, action_id)?;
    let accepted = log
        .iter()
        .filter(|e| e.action_id == action_id && e.status == protocol::Status::Pending)
        .filter(|e| e.uncertainty == Some(protocol::Uncertainty::InProgress))
        .find_map(|e| e.remote_id.clone());
    Some(AsyncReport {
        accepted,
        status: done.status.as_str().to_string(),
        verified_by: done
            .verified_by
            .map(|v| v.as_str().to_string())
            .unwrap_or_default(),
        receipt_id: done
            .remote_id
            .as_deref()
            .or_else(|| receipt_id(done))
            .unwrap_or_default()
            .to_string(),
    })
}

/// Whether a status API answer shows the operation held: `operation.state` with an admin
/// token; with a tenant token only the answer, whose `pending` message says it is held.
fn is_held(answer: &serde_json::Value) -> bool {
    match answer
        .pointer("/operation/state")
        .and_then(serde_json::Value::as_str)
    {
        Some(state) => state == "held",
        None => {
            answer["status"] == "pending"
                && answer["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("held for reconciliation"))
        }
    }
}

impl Tour<'_> {
    async fn run(&mut self) -> anyhow::Result<()> {
        self.tally.run_id = self.run_id.to_string();
        let outcome = self.phases().await;
        let mut pending: Vec<&str> = self
            .log
            .iter()
            .filter(|e| e.status == protocol::Status::Pending)
            .map(|e| e.action_id.as_str())
            .collect();
        pending.sort_unstable();
        pending.dedup();
        self.tally.pending = pending.len() as u64;
        self.tally.answers = self.log.len() as u64;
        self.tally.complete = outcome.is_ok();
        info!(tally = ?self.tally, "demo done");
        outcome
    }

    async fn phases(&mut self) -> anyhow::Result<()> {
        if self.config.count == 0 {
            bail!("--scenario full needs --count of at least 1");
        }
        let (refunds, first_receipts) = self.refunds().await?;
        self.repeats(&refunds, &first_receipts).await?;
        self.conflicting_reuse(&refunds[0]).await?;
        self.long_running().await?;
        self.lost_reply().await?;
        self.approval().await?;
        self.compensation(&refunds[0], &first_receipts).await
    }

    /// Step 1, refunds: each recorded with the agent's own write; waits for every answer and returns
    /// the action ids with the receipt id each was answered with.
    async fn refunds(&mut self) -> anyhow::Result<(Vec<String>, BTreeMap<String, Option<String>>)> {
        let c = self.config;
        let run = self.run_id.to_string();
        let reply_to = self.reply_to.to_string();
        let refunds: Vec<String> = (1..=c.count).map(|i| format!("refund-{run}-{i}")).collect();
        for (i, action_id) in (1..).zip(&refunds) {
            if i > 1 {
                self.pause(c.interval).await?;
            }
            let call_id = format!("call-{run}-{i}");
            let text = body(
                &c.tenant,
                action_id,
                &c.tool,
                &refund_arguments(i, 100 + i),
                &call_id,
                &reply_to,
                false,
            );
            self.send(&text, Some((i, 100 + i)), "refund").await?;
            self.tally.actions += 1;
        }
        let until = Instant::now() + c.answer_timeout;
        if !self
            .wait(until, |log| {
                refunds.iter().all(|a| final_for(log, a).is_some())
            })
            .await?
        {
            bail!(
                "not every refund was answered within {:?}",
                c.answer_timeout
            );
        }
        let mut first_receipts = BTreeMap::new();
        for action_id in &refunds {
            let event = final_for(&self.log, action_id).expect("waited for");
            if event.status == protocol::Status::Succeeded {
                self.tally.succeeded += 1;
            } else {
                self.tally.failed_or_rejected += 1;
            }
            first_receipts.insert(action_id.clone(), receipt_id(event).map(str::to_owned));
        }

        Ok((refunds, first_receipts))
    }

    /// Step 2, every k-th again: same action and arguments, reordered and re-spaced JSON, new call
    /// id. The ledger answers; the downstream sees no second write.
    async fn repeats(
        &mut self,
        refunds: &[String],
        first_receipts: &BTreeMap<String, Option<String>>,
    ) -> anyhow::Result<()> {
        let c = self.config;
        let run = self.run_id.to_string();
        let reply_to = self.reply_to.to_string();
        let from = self.log.len();
        let every = c.duplicate_every;
        let repeats: Vec<(u64, &String)> = (1..)
            .zip(refunds)
            .filter(|(i, _)| every > 0 && i % every == 0)
            .collect();
        for (i, action_id) in &repeats {
            let call_id = format!("call-{run}-{i}-again");
            let text = body(
                &c.tenant,
                action_id,
                &c.tool,
                &refund_arguments(*i, 100 + i),
                &call_id,
                &reply_to,
                true,
            );
            self.send(
                &text,
                None,
                "the same refund again (reordered, re-spaced JSON)",
            )
            .await?;
            self.tally.repeats_sent += 1;
        }
        let until = Instant::now() + c.answer_timeout;
        if !self
            .wait(until, |log| {
                repeats
                    .iter()
                    .all(|(_, a)| final_for(&log[from..], a).is_some())
            })
            .await?
        {
            bail!(
                "not every repeat was answered within {:?}",
                c.answer_timeout
            );
        }
        for (_, action_id) in &repeats {
            let event = final_for(&self.log[from..], action_id).expect("waited for");
            let first = first_receipts.get(*action_id).cloned().flatten();
            if event.status == protocol::Status::Succeeded
                && first.is_some()
                && receipt_id(event) == first.as_deref()
            {
                self.tally.repeats_answered_from_ledger += 1;
            } else {
                warn!(action_id = %event.action_id, status = event.status.as_str(),
                    "a repeat was not answered with the first answer's receipt");
            }
        }

        Ok(())
    }

    /// Step 3, the first refund's action id reused with other arguments: refused.
    async fn conflicting_reuse(&mut self, first: &str) -> anyhow::Result<()> {
        let c = self.config;
        let run = self.run_id.to_string();
        let reply_to = self.reply_to.to_string();
        let from = self.log.len();
        let reused = first.to_owned();
        let call_id = format!("call-{run}-1-reuse");
        let text = body(
            &c.tenant,
            &reused,
            &c.tool,
            &refund_arguments(1, 10_000 + 1),
            &call_id,
            &reply_to,
            false,
        );
        self.send(
            &text,
            None,
            "the same action id with other arguments: expect intent_conflict",
        )
        .await?;
        self.tally.conflicts_sent += 1;
        let until = Instant::now() + c.answer_timeout;
        if !self
            .wait(until, |log| any_for(&log[from..], &reused).is_some())
            .await?
        {
            bail!(
                "the conflicting reuse was not answered within {:?}",
                c.answer_timeout
            );
        }
        let event = any_for(&self.log[from..], &reused).expect("waited for");
        if event.status == protocol::Status::Rejected
            && event.reason == Some(protocol::RejectReason::IntentConflict)
        {
            self.tally.conflicts_refused += 1;
        }

        Ok(())
    }

    /// Step 4, a long-running deploy (a tool with `completion = "async"`): the downstream accepts
    /// it with an operation id, the worker answers `pending` (in progress, with that id), polls
    /// its status until it is done and answers `succeeded`, verified by the poll, with the
    /// deployment's receipt id.
    async fn long_running(&mut self) -> anyhow::Result<()> {
        let c = self.config;
        let run = self.run_id.to_string();
        let reply_to = self.reply_to.to_string();
        let from = self.log.len();
        let action = format!("{}-{run}", c.async_tool);
        self.tally.async_action_id = action.clone();
        let args = [
            ("service", serde_json::Value::from("checkout")),
            ("version", serde_json::Value::from("2.0.0")),
        ];
        let text = body(
            &c.tenant,
            &action,
            &c.async_tool,
            &args,
            &format!("call-{run}-async"),
            &reply_to,
            false,
        );
        self.send(
            &text,
            None,
            "a long-running action: expect pending (in progress), then succeeded",
        )
        .await?;
        self.tally.actions += 1;
        let until = Instant::now() + c.answer_timeout;
        if !self
            .wait(until, |log| final_for(&log[from..], &action).is_some())
            .await?
        {
            bail!("{action} had no final answer within {:?}", c.answer_timeout);
        }
        // The pending answer is sent when the row is accepted, before any poll, but by whichever
        // worker accepted it: it may reach this queue after the final one. A moment for it.
        let grace = until.min(Instant::now() + ACCEPTED_GRACE);
        self.wait(grace, |log| {
            async_report(&log[from..], &action).is_some_and(|r| r.accepted.is_some())
        })
        .await?;
        let report = async_report(&self.log[from..], &action).expect("waited for");
        match &report.accepted {
            Some(operation) => {
                info!(action_id = %action, %operation, status = %report.status,
                    verified_by = %report.verified_by, receipt_id = %report.receipt_id,
                    "accepted by the downstream (in progress), then a final answer");
                self.tally.async_accepted = 1;
                self.tally.async_operation_id = operation.clone();
            }
            None => warn!(action_id = %action, status = %report.status,
                "a final answer without a pending (in progress) one naming the operation: \
                 is the tool declared completion = \"async\"?"),
        }
        if report.status == protocol::Status::Succeeded.as_str() {
            self.tally.succeeded += 1;
        } else {
            self.tally.failed_or_rejected += 1;
        }
        self.tally.async_status = report.status;
        self.tally.async_verified_by = report.verified_by;
        self.tally.async_receipt_id = report.receipt_id;
        Ok(())
    }

    /// Step 5, a tool without recovery whose reply is lost after the downstream committed: pending,
    /// then held for a person (never retried, never guessed).
    async fn lost_reply(&mut self) -> anyhow::Result<()> {
        let c = self.config;
        let run = self.run_id.to_string();
        let reply_to = self.reply_to.to_string();
        let from = self.log.len();
        let held = format!("{}-{run}", c.held_tool);
        self.tally.held_action_id = held.clone();
        let args = [
            ("payee", serde_json::Value::from("supplier-7")),
            ("amount_cents", serde_json::Value::from(250_000)),
            ("currency", serde_json::Value::from("EUR")),
        ];
        let text = body(
            &c.tenant,
            &held,
            &c.held_tool,
            &args,
            &format!("call-{run}-held"),
            &reply_to,
            false,
        );
        self.send(
            &text,
            None,
            "an action whose reply will be lost after commit",
        )
        .await?;
        self.tally.actions += 1;
        let until = Instant::now() + c.answer_timeout;
        if !self
            .wait(until, |log| any_for(&log[from..], &held).is_some())
            .await?
        {
            bail!("{held} was not answered within {:?}", c.answer_timeout);
        }
        let event = any_for(&self.log[from..], &held).expect("waited for");
        match event.status {
            protocol::Status::Pending => {
                if self.held_by_status_api(&held, until).await? {
                    self.tally.held += 1;
                } else {
                    bail!(
                        "{held} is pending, but the status API did not show it held within {:?}",
                        c.answer_timeout
                    );
                }
            }
            protocol::Status::Succeeded => {
                // No lost reply (nobody armed the downstream's fault): an ordinary success.
                self.tally.succeeded += 1;
            }
            _ => self.tally.failed_or_rejected += 1,
        }
        Ok(())
    }

    /// Step 6, a refund above the refund tool's approval limit: recorded `awaiting_approval`,
    /// answered `pending` (uncertainty `awaiting_approval`), never sent until a person approves
    /// it. The agent stands in for that person: `worker ops approve`, naming the fingerprint of
    /// the intent it sent (an approval never covers other arguments); the worker's scheduler
    /// then sends it once and it is answered `succeeded`.
    async fn approval(&mut self) -> anyhow::Result<()> {
        let c = self.config;
        let run = self.run_id.to_string();
        let reply_to = self.reply_to.to_string();
        let from = self.log.len();
        let action = format!("{}-{run}-approval", c.tool);
        self.tally.approval_action_id = action.clone();
        let i = c.count + 1;
        let text = body(
            &c.tenant,
            &action,
            &c.tool,
            &refund_arguments(i, APPROVAL_AMOUNT_CENTS),
            &format!("call-{run}-approval"),
            &reply_to,
            false,
        );
        let fingerprint = self
            .send(
                &text,
                Some((i, APPROVAL_AMOUNT_CENTS)),
                "a refund above the approval limit: expect pending (awaiting approval)",
            )
            .await?;
        self.tally.actions += 1;
        let until = Instant::now() + c.answer_timeout;
        if !self
            .wait(until, |log| any_for(&log[from..], &action).is_some())
            .await?
        {
            bail!("{action} was not answered within {:?}", c.answer_timeout);
        }
        let first = any_for(&self.log[from..], &action).expect("waited for");
        if first.status == protocol::Status::Pending
            && first.uncertainty == Some(protocol::Uncertainty::AwaitingApproval)
        {
            self.tally.approval_awaiting = 1;
            let approver = self.config.approver.clone().context(
                "--scenario full approves with `worker ops approve`: no ledger given (--ledger-url)",
            )?;
            let printed = approver.approve(&c.tenant, &action, &fingerprint).await?;
            info!(action_id = %action, operator = APPROVER, %fingerprint, "approved with `worker ops approve`: {}",
                printed.lines().map(str::trim).collect::<Vec<_>>().join("; "));
            self.tally.approval_operator = APPROVER.to_string();
        } else {
            warn!(action_id = %action, status = first.status.as_str(), uncertainty = ?first.uncertainty,
                "not held for approval: does the tool declare approval_when for amount_cents \
                 {APPROVAL_AMOUNT_CENTS}?");
        }
        let until = Instant::now() + c.answer_timeout;
        if !self
            .wait(until, |log| final_for(&log[from..], &action).is_some())
            .await?
        {
            bail!(
                "{action} had no final answer within {:?} of its approval",
                c.answer_timeout
            );
        }
        let done = final_for(&self.log[from..], &action).expect("waited for");
        if done.status == protocol::Status::Succeeded {
            self.tally.succeeded += 1;
        } else {
            self.tally.failed_or_rejected += 1;
        }
        self.tally.approval_status = done.status.as_str().to_string();
        Ok(())
    }

    /// Step 7, undoing the succeeded refund `original` with the reversal tool (declared
    /// `compensation_for = [<refund tool>]`): an intent with `compensates`, an action of its own
    /// (its key, its one write), answered `succeeded` naming the original; the original is then
    /// announced `succeeded` again (same receipt) with `compensated_by` naming the compensation.
    async fn compensation(
        &mut self,
        original: &str,
        first_receipts: &BTreeMap<String, Option<String>>,
    ) -> anyhow::Result<()> {
        let c = self.config;
        let run = self.run_id.to_string();
        let reply_to = self.reply_to.to_string();
        let from = self.log.len();
        let action = format!("{}-{run}", c.reversal_tool);
        self.tally.compensation_action_id = action.clone();
        self.tally.compensation_of = original.to_string();
        let args = [
            ("refund", serde_json::Value::from(original)),
            ("order", serde_json::Value::from("order-1")),
            ("amount_cents", serde_json::Value::from(101)),
            ("currency", serde_json::Value::from("USD")),
        ];
        let text = compensation_body(
            &c.tenant,
            &action,
            &c.reversal_tool,
            &args,
            original,
            &format!("call-{run}-reversal"),
            &reply_to,
        );
        self.send(
            &text,
            None,
            "a compensation of a succeeded refund: expect succeeded, and the refund compensated_by it",
        )
        .await?;
        self.tally.actions += 1;
        let until = Instant::now() + c.answer_timeout;
        let told = |log: &[protocol::ResultEvent]| {
            log.iter()
                .find(|e| e.action_id == original && e.compensated_by.is_some())
                .cloned()
        };
        if !self
            .wait(until, |log| {
                final_for(&log[from..], &action).is_some_and(|e| {
                    e.status != protocol::Status::Succeeded || told(&log[from..]).is_some()
                })
            })
            .await?
        {
            bail!(
                "{action} (and the `compensated_by` answer about {original}) not answered within {:?}",
                c.answer_timeout
            );
        }
        let done = final_for(&self.log[from..], &action).expect("waited for");
        if done.status == protocol::Status::Succeeded {
            self.tally.succeeded += 1;
        } else {
            self.tally.failed_or_rejected += 1;
        }
        self.tally.compensation_status = done.status.as_str().to_string();
        self.tally.compensation_compensates = done.compensates.clone().unwrap_or_default();
        if let Some(event) = told(&self.log[from..]) {
            let first = first_receipts.get(original).cloned().flatten();
            if event.status != protocol::Status::Succeeded || receipt_id(&event) != first.as_deref()
            {
                warn!(action_id = %original, status = event.status.as_str(),
                    "the compensated original was not announced succeeded with its first receipt");
            }
            self.tally.compensated_by = event.compensated_by.unwrap_or_default();
        }
        Ok(())
    }

    /// Enqueues (through the agent's outbox) or publishes one intent body as written; returns
    /// its fingerprint.
    async fn send(
        &mut self,
        body: &str,
        record: Option<(u64, u64)>,
        what: &str,
    ) -> anyhow::Result<String> {
        let sent = async {
            match self.outbox {
                Some(pool) => enqueue_raw(pool, body, record).await,
                None => publish_checked(self.publisher, body, self.deadline).await,
            }
        };
        let fingerprint = sent.instrument(agent_turn(body)).await?;
        self.tally.intents_sent += 1;
        let intent = protocol::decode_intent(body.as_bytes())
            .map_err(|error| anyhow::anyhow!("demo built an invalid intent: {error}"))?;
        info!(tenant = %intent.tenant, action_id = %intent.action_id, call_id = ?intent.call_id,
            %fingerprint, "sent: {what}");
        Ok(fingerprint)
    }

    /// Receives answers until `done(log)` or `until`; false at the deadline.
    async fn wait(
        &mut self,
        until: Instant,
        done: impl Fn(&[protocol::ResultEvent]) -> bool,
    ) -> anyhow::Result<bool> {
        loop {
            if done(&self.log) {
                return Ok(true);
            }
            let Some(left) = until.checked_duration_since(Instant::now()) else {
                return Ok(false);
            };
            self.receive(left).await?;
        }
    }

    /// Receives answers for `d`.
    async fn pause(&mut self, d: Duration) -> anyhow::Result<()> {
        let until = Instant::now() + d;
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            self.receive(left).await?;
        }
        Ok(())
    }

    /// Waits up to `left` for one answer; prints and records it unless it is a repeated copy.
    async fn receive(&mut self, left: Duration) -> anyhow::Result<()> {
        match self.answers.next(left).await {
            Ok(Some(event)) => {
                if self.seen.insert(event.event_id.clone()) {
                    info!(action_id = %event.action_id, status = event.status.as_str(),
                        message = %event.message, "answer");
                    if let Ok(line) = serde_json::to_string(&event) {
                        println!("{line}");
                    }
                    self.log.push(event);
                }
            }
            Ok(None) => {}
            Err(PublishError::ConsumerClosed) => bail!("the demo agent's results queue was closed"),
            Err(error) => warn!(%error, "skipped a results message"),
        }
        Ok(())
    }

    /// Asks the status API until it shows `action_id` held, or `until`.
    async fn held_by_status_api(
        &mut self,
        action_id: &str,
        until: Instant,
    ) -> anyhow::Result<bool> {
        let Some((base, token)) = self.config.status.clone() else {
            warn!("no status API given (--status-url): cannot tell whether {action_id} is held");
            return Ok(false);
        };
        let mut url =
            reqwest::Url::parse(&base).with_context(|| format!("bad status URL {base:?}"))?;
        url.path_segments_mut()
            .map_err(|()| anyhow::anyhow!("bad status URL {base:?}"))?
            .pop_if_empty()
            .extend(["v1", "operations", &self.config.tenant, action_id]);
        let client = publisher::tls::http_client()
            .timeout(Duration::from_secs(5))
            .build()?;
        loop {
            match client.get(url.clone()).bearer_auth(&token).send().await {
                Ok(response) if response.status().is_success() => {
                    let bytes = response.bytes().await.unwrap_or_default();
                    let answer: serde_json::Value =
                        serde_json::from_slice(&bytes).unwrap_or_default();
                    if is_held(&answer) {
                        info!(%action_id, message = %answer["message"], "status API: held for a person");
                        return Ok(true);
                    }
                }
                Ok(response) => warn!(status = %response.status(), %url, "status API refused"),
                Err(error) => warn!(%error, %url, "status API did not answer"),
            }
            if Instant::now() + STATUS_POLL > until {
                return Ok(false);
            }
            self.pause(STATUS_POLL).await?;
        }
    }
}

/// The span one intent is sent from (the request an agent would be serving).
fn agent_turn(body: &str) -> tracing::Span {
    let key = protocol::decode_intent(body.as_bytes())
        .map(|intent| protocol::action_key(&intent.tenant, &intent.action_id))
        .unwrap_or_default();
    tracing::info_span!("agent turn", intent_worker.action_key = %key)
}

/// Pause between status API requests.
const STATUS_POLL: Duration = Duration::from_millis(250);
/// How long a long-running action's `pending` answer is waited for once its final answer came.
const ACCEPTED_GRACE: Duration = Duration::from_secs(2);

/// The agent's own write (for a first send) and its intent body exactly as written, in one
/// transaction (`intent_outbox` is a contract: any agent may insert rows; the relay publishes
/// the body unchanged, so a reordered body stays reordered on the wire).
async fn enqueue_raw(
    pool: &sqlx::PgPool,
    body: &str,
    record: Option<(u64, u64)>,
) -> anyhow::Result<String> {
    let intent = protocol::decode_intent(body.as_bytes())
        .map_err(|error| anyhow::anyhow!("demo built an invalid intent: {error}"))?;
    let mut tx = pool.begin().await?;
    if let Some((i, amount)) = record {
        sqlx::query(
            "INSERT INTO demo_refund_requests (action_id, order_ref, amount_cents)
             VALUES ($1, $2, $3) ON CONFLICT (action_id) DO NOTHING",
        )
        .bind(&intent.action_id)
        .bind(format!("order-{i}"))
        .bind(amount as i64)
        .execute(&mut *tx)
        .await?;
    }
    // The current trace context (the `agent turn` span), kept with the row as `Outbox::enqueue`
    // keeps it: the relay's publish of the row is its child.
    let (traceparent, tracestate) = match kit::otel::current() {
        Some(cx) => (Some(cx.traceparent()), cx.state),
        None => (None, None),
    };
    sqlx::query(
        "INSERT INTO intent_outbox (tenant, action_id, body, traceparent, tracestate)
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(&intent.tenant)
    .bind(&intent.action_id)
    .bind(body)
    .bind(traceparent)
    .bind(tracestate)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(intent.fingerprint())
}

/// The agent's own write and its intent, in one transaction.
async fn enqueue(pool: &sqlx::PgPool, body: &str, i: u64) -> anyhow::Result<String> {
    let intent = protocol::decode_intent(body.as_bytes())
        .map_err(|error| anyhow::anyhow!("demo built an invalid intent: {error}"))?;
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO demo_refund_requests (action_id, order_ref, amount_cents)
         VALUES ($1, $2, $3) ON CONFLICT (action_id) DO NOTHING",
    )
    .bind(&intent.action_id)
    .bind(format!("order-{i}"))
    .bind(100 + i as i64)
    .execute(&mut *tx)
    .await?;
    Outbox::enqueue(&mut tx, &intent).await?;
    tx.commit().await?;
    Ok(intent.fingerprint())
}

/// Connects, retrying until the broker accepts connections and the worker has
/// declared the intents exchange, or until `deadline`.
async fn connect_when_ready(config: &DemoConfig, deadline: Instant) -> anyhow::Result<Publisher> {
    let url = kit::url::redact_list(&config.amqp_url);
    loop {
        let attempt = async {
            let publisher = Publisher::connect(&config.amqp_url, &config.exchange).await?;
            let ready = publisher.exchange_exists().await?;
            Ok::<_, PublishError>(ready.then_some(publisher))
        }
        .await;
        let why = match attempt {
            Ok(Some(publisher)) => return Ok(publisher),
            Ok(None) => format!("exchange {:?} does not exist yet", config.exchange),
            Err(error) => error.to_string(),
        };
        if Instant::now() + STARTUP_PAUSE > deadline {
            bail!(
                "broker at {url} not ready after {}s: {why}",
                STARTUP.as_secs()
            );
        }
        warn!(%url, %why, "broker not ready, retrying");
        tokio::time::sleep(STARTUP_PAUSE).await;
    }
}

/// Validates `body` as the worker would, then publishes it. While the start-up window
/// lasts, an unroutable intent (the worker has declared the exchange but not yet bound
/// its queue) is sent again unchanged: same key, same body.
async fn publish_checked(
    publisher: &Publisher,
    body: &str,
    deadline: Instant,
) -> anyhow::Result<String> {
    let intent = protocol::decode_intent(body.as_bytes())
        .map_err(|error| anyhow::anyhow!("demo built an invalid intent: {error}"))?;
    let fingerprint = intent.fingerprint();
    loop {
        match publisher
            .publish_encoded(&intent.tenant, &intent.action_id, body.as_bytes())
            .await
        {
            Ok(()) => return Ok(fingerprint),
            Err(error @ PublishError::Unroutable { .. })
                if Instant::now() + STARTUP_PAUSE <= deadline =>
            {
                warn!(%error, "intent unroutable, the worker may still be starting; sending it again");
                tokio::time::sleep(STARTUP_PAUSE).await;
            }
            Err(error) => {
                return Err(error)
                    .with_context(|| format!("publishing {}:{}", intent.tenant, intent.action_id))
            }
        }
    }
}

/// The intent body. `reordered` writes the fields (top-level and in `arguments`) in
/// another order, which must not change the action key or the fingerprint.
fn intent_json(
    config: &DemoConfig,
    action_id: &str,
    call_id: &str,
    reply_to: &str,
    i: u64,
    reordered: bool,
) -> String {
    body(
        &config.tenant,
        action_id,
        &config.tool,
        &refund_arguments(i, 100 + i),
        call_id,
        reply_to,
        reordered,
    )
}

/// A refund's arguments, in their usual order.
fn refund_arguments(i: u64, amount_cents: u64) -> Vec<(&'static str, serde_json::Value)> {
    vec![
        ("order", format!("order-{i}").into()),
        ("amount_cents", amount_cents.into()),
        ("currency", "USD".into()),
    ]
}

/// An intent body written by hand, as an agent in any language might. `reordered` reverses
/// the order of the fields (top-level and in `arguments`) and adds white space: the same
/// action and the same fingerprint.
fn body(
    tenant: &str,
    action_id: &str,
    tool: &str,
    arguments: &[(&str, serde_json::Value)],
    call_id: &str,
    reply_to: &str,
    reordered: bool,
) -> String {
    let q = |s: &str| serde_json::Value::from(s).to_string();
    let (tenant, action_id, tool, call_id, reply_to) =
        (q(tenant), q(action_id), q(tool), q(call_id), q(reply_to));
    if reordered {
        let args: Vec<String> = arguments
            .iter()
            .rev()
            .map(|(k, v)| format!("{} : {v}", q(k)))
            .collect();
        format!(
            "{{ \"call_id\" : {call_id},\n  \"arguments\" : {{ {} }},\n  \"tool\" : {tool} , \"reply_to\" : {reply_to},\n\t\"action_id\" : {action_id}, \"tenant\" : {tenant} }}\n",
            args.join(" ,\t")
        )
    } else {
        let args: Vec<String> = arguments
            .iter()
            .map(|(k, v)| format!("{}:{v}", q(k)))
            .collect();
        format!(
            r#"{{"tenant":{tenant},"action_id":{action_id},"tool":{tool},"arguments":{{{}}},"call_id":{call_id},"reply_to":{reply_to}}}"#,
            args.join(",")
        )
    }
}

/// A compensation's intent body: `compensates` names the action (same tenant) it undoes, and is
/// part of its fingerprint.
fn compensation_body(
    tenant: &str,
    action_id: &str,
    tool: &str,
    arguments: &[(&str, serde_json::Value)],
    original: &str,
    call_id: &str,
    reply_to: &str,
) -> String {
    let arguments: serde_json::Map<String, serde_json::Value> = arguments
        .iter()
        .map(|(k, v)| ((*k).to_string(), v.clone()))
        .collect();
    serde_json::json!({
        "tenant": tenant,
        "action_id": action_id,
        "tool": tool,
        "arguments": arguments,
        "compensates": original,
        "call_id": call_id,
        "reply_to": reply_to,
    })
    .to_string()
}

/// A short id unique to this run: process id and start time.
fn run_id() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{:x}{:x}", std::process::id(), nanos % (1 << 40))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> DemoConfig {
        DemoConfig {
            scenario: Scenario::Stream,
            run_id: None,
            held_tool: "payout".into(),
            async_tool: "deploy".into(),
            reversal_tool: "refund_reversal".into(),
            approver: None,
            status: None,
            amqp_url: String::new(),
            exchange: "intents".into(),
            results_exchange: "results".into(),
            set_user_id: true,
            database_url: None,
            answer_timeout: Duration::ZERO,
            tenant: "north-shop".into(),
            tool: "refund".into(),
            count: 3,
            interval: Duration::ZERO,
            duplicate_every: 3,
        }
    }

    #[test]
    fn reordered_duplicate_is_the_same_action_and_fingerprint() {
        let plain = intent_json(&config(), "demo-x-3", "call-1", "agent-1", 3, false);
        let again = intent_json(&config(), "demo-x-3", "call-2", "agent-1", 3, true);
        assert_ne!(plain, again);
        let a = protocol::decode_intent(plain.as_bytes()).expect("plain decodes");
        let b = protocol::decode_intent(again.as_bytes()).expect("reordered decodes");
        assert_eq!(
            (a.tenant.as_str(), a.action_id.as_str()),
            ("north-shop", "demo-x-3")
        );
        assert_eq!((&a.tenant, &a.action_id), (&b.tenant, &b.action_id));
        assert_ne!(a.call_id, b.call_id);
        assert_eq!(
            protocol::fingerprint(&a.tool, &a.arguments),
            protocol::fingerprint(&b.tool, &b.arguments)
        );
        assert_eq!(a.arguments["amount_cents"], 103);
    }

    #[test]
    fn a_hand_written_body_reordered_and_respaced_keeps_key_and_fingerprint() {
        let args = refund_arguments(7, 4850);
        let plain = body(
            "demo-shop",
            "refund-r-7",
            "refund",
            &args,
            "c1",
            "agent-1",
            false,
        );
        let again = body(
            "demo-shop",
            "refund-r-7",
            "refund",
            &args,
            "c2",
            "agent-1",
            true,
        );
        assert!(again.contains('\n') && again.contains('\t') && again.contains(" : "));
        let a = protocol::decode_intent(plain.as_bytes()).expect("plain decodes");
        let b = protocol::decode_intent(again.as_bytes()).expect("reordered decodes");
        assert_eq!(
            (&a.tenant, &a.action_id, &a.tool),
            (&b.tenant, &b.action_id, &b.tool)
        );
        assert_eq!(a.fingerprint(), b.fingerprint());
        assert_eq!(b.call_id.as_deref(), Some("c2"));
        let other = body(
            "demo-shop",
            "refund-r-7",
            "refund",
            &refund_arguments(7, 4851),
            "c3",
            "agent-1",
            false,
        );
        let c = protocol::decode_intent(other.as_bytes()).expect("decodes");
        assert_ne!(a.fingerprint(), c.fingerprint());
    }

    #[test]
    fn a_compensation_names_its_original_in_the_body_and_the_fingerprint() {
        let args = [("refund", serde_json::Value::from("refund-r-1"))];
        let text = compensation_body(
            "demo-shop",
            "refund_reversal-r",
            "refund_reversal",
            &args,
            "refund-r-1",
            "c9",
            "agent-1",
        );
        let intent = protocol::decode_intent(text.as_bytes()).expect("decodes");
        assert_eq!(intent.compensates.as_deref(), Some("refund-r-1"));
        assert_eq!(
            (intent.action_id.as_str(), intent.tool.as_str()),
            ("refund_reversal-r", "refund_reversal")
        );
        assert_eq!(intent.arguments["refund"], "refund-r-1");
        let plain = body(
            "demo-shop",
            "refund_reversal-r",
            "refund_reversal",
            &args,
            "c9",
            "agent-1",
            false,
        );
        let plain = protocol::decode_intent(plain.as_bytes()).expect("decodes");
        assert_eq!(plain.compensates, None);
        assert_ne!(intent.fingerprint(), plain.fingerprint());
    }

    #[test]
    fn held_is_read_from_the_state_or_the_pending_message() {
        use serde_json::json;
        assert!(is_held(
            &json!({"status": "pending", "operation": {"state": "held"}})
        ));
        assert!(!is_held(
            &json!({"status": "pending", "operation": {"state": "unknown"}})
        ));
        assert!(is_held(&json!({"status": "pending",
            "message": "The payout outcome is unknown and is held for reconciliation by a person. Do not submit it again."})));
        assert!(!is_held(
            &json!({"status": "pending", "message": "The payout outcome is unknown. Do not submit it again."})
        ));
    }

    fn event(action_id: &str, status: protocol::Status) -> protocol::ResultEvent {
        protocol::ResultEvent {
            tenant: "demo-shop".into(),
            action_id: action_id.into(),
            tool: "deploy".into(),
            status,
            receipt: None,
            next_action: None,
            attempts: 1,
            message: String::new(),
            fingerprint: None,
            reason: None,
            detail: None,
            verified_by: None,
            operator: None,
            remote_id: None,
            uncertainty: None,
            retry_after_ms: None,
            compensates: None,
            compensated_by: None,
            event_id: format!("{action_id}-{}", status.as_str()),
            occurred_at: "2026-01-01T00:00:00Z".into(),
        }
    }

    #[test]
    fn a_long_running_action_reports_its_acceptance_and_its_final_answer() {
        use protocol::{Status, Uncertainty, VerifiedBy};
        let accepted = protocol::ResultEvent {
            uncertainty: Some(Uncertainty::InProgress),
            remote_id: Some("op-14".into()),
            next_action: Some("check_status".into()),
            retry_after_ms: Some(500),
            compensates: None,
            compensated_by: None,
            ..event("deploy-r1", Status::Pending)
        };
        let done = protocol::ResultEvent {
            verified_by: Some(VerifiedBy::Poll),
            remote_id: Some("dep-14".into()),
            receipt: Some(serde_json::json!({"state": "succeeded", "deployment_id": "dep-14"})),
            ..event("deploy-r1", Status::Succeeded)
        };
        let other = event("refund-r1-1", Status::Succeeded);
        // No final answer yet: nothing to report.
        assert_eq!(
            async_report(std::slice::from_ref(&accepted), "deploy-r1"),
            None
        );
        let log = [accepted, other, done.clone()];
        assert_eq!(
            async_report(&log, "deploy-r1"),
            Some(AsyncReport {
                accepted: Some("op-14".into()),
                status: "succeeded".into(),
                verified_by: "poll".into(),
                receipt_id: "dep-14".into(),
            })
        );
        // A pending answer of another kind (an unknown outcome) is no acceptance.
        let unknown = protocol::ResultEvent {
            uncertainty: Some(Uncertainty::UnknownOutcome),
            ..event("deploy-r1", Status::Pending)
        };
        let report = async_report(&[unknown, done.clone()], "deploy-r1").unwrap();
        assert_eq!(report.accepted, None);
        // A final answer without remote_id (an older worker): the receipt's own id.
        let older = protocol::ResultEvent {
            receipt: Some(serde_json::json!({"receipt_id": "rcpt-3"})),
            ..event("deploy-r1", Status::Succeeded)
        };
        let report = async_report(&[older], "deploy-r1").unwrap();
        assert_eq!(
            (report.verified_by.as_str(), report.receipt_id.as_str()),
            ("", "rcpt-3")
        );
    }

    #[test]
    fn the_summary_is_key_value_lines_in_a_fixed_order() {
        let tally = Tally {
            run_id: "r1".into(),
            intents_sent: 18,
            held_action_id: "payout-r1".into(),
            async_action_id: "deploy-r1".into(),
            async_accepted: 1,
            async_operation_id: "op-14".into(),
            async_status: "succeeded".into(),
            async_verified_by: "poll".into(),
            async_receipt_id: "dep-14".into(),
            approval_action_id: "refund-r1-approval".into(),
            approval_awaiting: 1,
            approval_operator: APPROVER.into(),
            approval_status: "succeeded".into(),
            compensation_action_id: "refund_reversal-r1".into(),
            compensation_of: "refund-r1-1".into(),
            compensation_status: "succeeded".into(),
            compensation_compensates: "refund-r1-1".into(),
            compensated_by: "refund_reversal-r1".into(),
            complete: true,
            ..Tally::default()
        };
        let text = tally.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "run_id=r1");
        assert_eq!(lines[1], "intents_sent=18");
        for line in [
            "held_action_id=payout-r1",
            "async_action_id=deploy-r1",
            "async_accepted=1",
            "async_operation_id=op-14",
            "async_status=succeeded",
            "async_verified_by=poll",
            "async_receipt_id=dep-14",
            "approval_action_id=refund-r1-approval",
            "approval_awaiting=1",
            "approval_operator=demo-approver",
            "approval_status=succeeded",
            "compensation_action_id=refund_reversal-r1",
            "compensation_of=refund-r1-1",
            "compensation_status=succeeded",
            "compensation_compensates=refund-r1-1",
            "compensated_by=refund_reversal-r1",
        ] {
            assert!(lines.contains(&line), "{line}: {text}");
        }
        // Empty values stay `key=` lines, so a shell reads every key.
        assert!(Tally::default()
            .render()
            .contains("\nasync_operation_id=\n"));
        assert!(lines.contains(&"complete=true"));
        assert_eq!(lines.last(), Some(&"summary_end=1"));
        assert!(lines.iter().all(|l| l.split_once('=').is_some_and(
            |(k, _)| !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_')
        )));
    }
}
