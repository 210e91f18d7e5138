//! `worker ops ...`: the operator actions from the command line. It connects to the ledger
//! (`DATABASE_URL`) and loads the tools file (`WORKER_TOOLS`) for receipt checks and rechecks,
//! and calls the same functions as the HTTP API ([`super::actions`]), so the rules, fences,
//! history and idempotency are identical.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use chrono::Utc;

use super::actions::{
    self, ActionResponse, FailInput, ListParams, OperationSummary, OperationView, RecheckInput,
    ResolveInput,
};
use super::approvals::{Decision, DecisionInput, Fingerprint};
use super::dead_letters::{
    self as dl, Action, DeadLetterFilter, StepOutcome, StepReport, StepRequest,
};
use crate::adapter::ToolSet;
use crate::config::{Settings, Tools};
use crate::context::Context;
use crate::ledger::Ledger;

#[derive(Debug, clap::Subcommand)]
pub enum OpsCommand {
    /// List unresolved operations (dispatching, retry_wait, unknown, held, accepted,
    /// awaiting_approval), oldest id first.
    List(ListArgs),
    /// Show one operation with its history (JSON).
    Show { tenant: String, action_id: String },
    /// Resolve as succeeded with the downstream's receipt (checked against the operation).
    Resolve(ResolveArgs),
    /// Mark failed, with written evidence that the downstream did not and will not apply it.
    Fail(FailArgs),
    /// Run one recovery round now (a held operation gets exactly one more round).
    Recheck(RecheckArgs),
    /// Approve an intent that waits for approval (awaiting_approval): the last approval its
    /// tool needs sends it. Prints the arguments approved.
    Approve(DecisionArgs),
    /// Reject an intent that waits for approval: it fails, never sent.
    Reject(DecisionArgs),
    /// The dead-letter queue: list its messages, republish them after a fix, or discard them
    /// (needs AMQP_URL; every republish and discard is audited in the ledger).
    #[command(subcommand)]
    DeadLetters(DeadLetterCommand),
}

/// `worker ops dead-letters ...`.
#[derive(Debug, clap::Subcommand)]
pub enum DeadLetterCommand {
    /// List dead letters; every message read is returned to the queue.
    List(DeadLetterSelect),
    /// Publish the chosen dead letters' intents again to the intents exchange (confirmed), then
    /// remove them. The inbox answers an intent already recorded from its row.
    Republish(DeadLetterStepArgs),
    /// Remove the chosen dead letters.
    Discard(DeadLetterStepArgs),
}

/// Which dead letters.
#[derive(Debug, clap::Args)]
pub struct DeadLetterSelect {
    /// Only this reason (unknown_tool, invalid_message, tenant_mismatch, delivery_limit, or the
    /// broker's own `broker:<reason>`).
    #[arg(long)]
    pub reason: Option<String>,
    /// Only letters whose body names this tenant.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only this AMQP message id (an intent's is `<tenant>:<action_id>`).
    #[arg(long)]
    pub message_id: Option<String>,
    /// Only these letter ids (as `list` prints them); repeat or comma-separate.
    #[arg(long, value_delimiter = ',')]
    pub id: Vec<String>,
    /// At most this many letters (1-500), from the first 1000 of the queue.
    #[arg(long, default_value_t = super::dead_letters::DEFAULT_LIMIT)]
    pub limit: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct DeadLetterStepArgs {
    #[command(flatten)]
    pub select: DeadLetterSelect,
    /// Act on every letter even though no filter narrows them.
    #[arg(long)]
    pub all: bool,
    /// Who does it (recorded in the audit).
    #[arg(long)]
    pub operator: Option<String>,
    /// Why, e.g. the fix that was made (recorded in the audit).
    #[arg(long)]
    pub note: Option<String>,
    /// Idempotency key of this request; default a fresh one (printed, reuse it to retry).
    #[arg(long)]
    pub request_id: Option<String>,
    /// Only print which letters would be acted on.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Debug, clap::Args)]
pub struct ListArgs {
    /// Only this state (dispatching, retry_wait, unknown, held, accepted, awaiting_approval);
    /// repeat or comma-separate.
    #[arg(long, value_delimiter = ',')]
    pub state: Vec<String>,
    /// Only this tool.
    #[arg(long)]
    pub tool: Option<String>,
    /// Only operations recorded at least this many seconds ago.
    #[arg(long)]
    pub older_than_secs: Option<u64>,
    /// Page size (1-500).
    #[arg(long, default_value_t = actions::DEFAULT_LIMIT)]
    pub limit: i64,
    /// Cursor: the last id of the previous page.
    #[arg(long)]
    pub after: Option<i64>,
    /// Print the page as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("receipt_source").required(true).args(["receipt", "receipt_file"])))]
pub struct ResolveArgs {
    pub tenant: String,
    pub action_id: String,
    /// The receipt as JSON.
    #[arg(long)]
    pub receipt: Option<String>,
    /// A file holding the receipt JSON ("-" for stdin).
    #[arg(long)]
    pub receipt_file: Option<PathBuf>,
    /// Who resolves it (recorded in the history).
    #[arg(long)]
    pub operator: String,
    /// Why (recorded in the history).
    #[arg(long)]
    pub reason: String,
    /// Idempotency key of this request; default a fresh one (printed, reuse it to retry).
    #[arg(long)]
    pub request_id: Option<String>,
    /// Print the resulting operation as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct FailArgs {
    pub tenant: String,
    pub action_id: String,
    /// The downstream's proof that it did not and will not apply (at least 10 characters).
    #[arg(long)]
    pub evidence: String,
    /// Who marks it failed (recorded in the history).
    #[arg(long)]
    pub operator: String,
    /// Idempotency key of this request; default a fresh one (printed, reuse it to retry).
    #[arg(long)]
    pub request_id: Option<String>,
    /// Print the resulting operation as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct RecheckArgs {
    pub tenant: String,
    pub action_id: String,
    /// Who asks (recorded in the history).
    #[arg(long)]
    pub operator: String,
    /// Why (recorded in the history).
    #[arg(long)]
    pub reason: String,
    /// Idempotency key of this request; default a fresh one (printed, reuse it to retry).
    #[arg(long)]
    pub request_id: Option<String>,
    /// Print the resulting operation as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct DecisionArgs {
    pub tenant: String,
    pub action_id: String,
    /// Who decides (recorded in the history; the same name cannot approve one intent twice).
    #[arg(long)]
    pub operator: String,
    /// Why (recorded in the history).
    #[arg(long)]
    pub reason: String,
    /// The fingerprint of the arguments you checked (`worker ops show`); default the stored one.
    #[arg(long)]
    pub fingerprint: Option<String>,
    /// Idempotency key of this request; default a fresh one (printed, reuse it to retry).
    #[arg(long)]
    pub request_id: Option<String>,
    /// Print the resulting operation as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs one `worker ops` command.
pub async fn run(settings: &Settings, cmd: OpsCommand) -> anyhow::Result<()> {
    let trust = crate::tls::load(settings.ca_file.as_deref())?;
    let options =
        crate::tls::postgres(&settings.database_url, &trust).context("invalid DATABASE_URL")?;
    let ledger = Ledger::connect_with(options, 2, settings.db_acquire_timeout)
        .await
        .context("cannot connect to Postgres (DATABASE_URL)")?;
    match cmd {
        OpsCommand::List(args) => list(&ledger, args).await?,
        OpsCommand::Show { tenant, action_id } => {
            let view = actions::show(&ledger, &tenant, &action_id).await?;
            println!("{}", serde_json::to_string_pretty(&view)?);
        }
        OpsCommand::Resolve(args) => resolve(settings, &trust, ledger, args).await?,
        OpsCommand::Fail(args) => {
            let request_id = request_id(args.request_id);
            let ctx = context(settings, &trust, ledger, false)?;
            let r = actions::fail(
                &ctx,
                &args.tenant,
                &args.action_id,
                FailInput {
                    evidence: Some(args.evidence),
                    operator: Some(args.operator),
                    request_id: Some(request_id),
                },
            )
            .await?;
            report(r, args.json)?;
        }
        OpsCommand::DeadLetters(cmd) => dead_letters(settings, &trust, &ledger, cmd).await?,
        OpsCommand::Approve(args) => {
            decide(settings, &trust, ledger, Decision::Approve, args).await?
        }
        OpsCommand::Reject(args) => {
            decide(settings, &trust, ledger, Decision::Reject, args).await?
        }
        OpsCommand::Recheck(args) => {
            let request_id = request_id(args.request_id);
            let ctx = context(settings, &trust, ledger, true)?;
            let r = actions::recheck(
                &ctx,
                &args.tenant,
                &args.action_id,
                RecheckInput {
                    operator: Some(args.operator),
                    reason: Some(args.reason),
                    request_id: Some(request_id),
                },
            )
            .await?;
            report(r, args.json)?;
        }
    }
    Ok(())
}

/// `worker ops approve` and `worker ops reject`.
async fn decide(
    settings: &Settings,
    trust: &crate::tls::Trust,
    ledger: Ledger,
    decision: Decision,
    args: DecisionArgs,
) -> anyhow::Result<()> {
    let request_id = request_id(args.request_id);
    let ctx = context(settings, trust, ledger, false)?;
    let r = super::approvals::decide(
        &ctx,
        &args.tenant,
        &args.action_id,
        decision,
        DecisionInput {
            fingerprint: args.fingerprint,
            operator: Some(args.operator),
            reason: Some(args.reason),
            request_id: Some(request_id),
        },
        Fingerprint::StoredWhenAbsent,
    )
    .await?;
    if !args.json {
        if let Some(arguments) = r.body.get("arguments") {
            println!("arguments: {arguments}");
        }
    }
    report(r, args.json)
}

/// `worker ops list`.
async fn list(ledger: &Ledger, args: ListArgs) -> anyhow::Result<()> {
    // The API takes exactly `a,b`; on the command line `--state "held, unknown"` is fine.
    let states: Vec<&str> = args.state.iter().map(|s| s.trim()).collect();
    let states = states.join(",");
    let page = actions::list(
        ledger,
        ListParams {
            state: (!states.is_empty()).then_some(states),
            tool: args.tool,
            older_than_secs: args.older_than_secs,
            limit: Some(args.limit),
            after: args.after,
        },
    )
    .await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&page)?);
    } else {
        print!("{}", table(&page.operations));
        match page.next_after {
            Some(id) => println!("more: --after {id}"),
            None => println!("({})", count_of(page.operations.len(), "operation")),
        }
    }
    Ok(())
}

/// `n` and the noun, plural unless `n` is 1 ("1 operation", "0 operations").
fn count_of(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// `worker ops dead-letters ...`: exit 1 when a letter could not be handled or an id asked
/// for was not found.
async fn dead_letters(
    settings: &Settings,
    trust: &crate::tls::Trust,
    ledger: &Ledger,
    cmd: DeadLetterCommand,
) -> anyhow::Result<()> {
    let broker = dl::Broker::new(
        &settings.amqp_url,
        &format!("worker-ops-{}", settings.worker_id),
        trust.clone(),
        settings.topology.clone(),
    );
    let (action, args) = match cmd {
        DeadLetterCommand::List(select) => return list_dead_letters(&broker, &select).await,
        DeadLetterCommand::Republish(args) => (Action::Republish, args),
        DeadLetterCommand::Discard(args) => (Action::Discard, args),
    };
    let request = step_request(action, &args)?;
    let reports = dl::act(&broker, ledger, &request).await?;
    if args.select.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    } else {
        for r in &reports {
            println!("{}", step_line(action, r));
        }
        if reports.is_empty() {
            println!("(no dead letter matched)");
        }
    }
    let failed = unhandled(&reports);
    if failed > 0 {
        anyhow::bail!("{failed} dead letters were not handled (see above); repeat with the same --request-id to retry");
    }
    Ok(())
}

/// `worker ops dead-letters list`: a table (or JSON) of the letters chosen, and how much of the
/// queue was read for them.
async fn list_dead_letters(broker: &dl::Broker, select: &DeadLetterSelect) -> anyhow::Result<()> {
    let listing = dl::list(
        broker,
        &crate::config::auth::Principal::Admin,
        &crate::intake::TenantAuth::Trusted,
        &dead_letter_filter(select),
        select.limit,
    )
    .await?;
    if select.json {
        let letters: Vec<serde_json::Value> = listing.letters.iter().map(dl::letter_json).collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "letters": letters,
                "scanned": listing.scanned,
                "remaining": listing.remaining,
            }))?
        );
    } else {
        print!("{}", letter_table(&listing.letters));
        println!(
            "({} shown, {} read, {} more in the queue behind them)",
            listing.letters.len(),
            listing.scanned,
            listing.remaining
        );
    }
    Ok(())
}

/// The letters the flags choose (blank ids ignored).
fn dead_letter_filter(select: &DeadLetterSelect) -> DeadLetterFilter {
    DeadLetterFilter {
        reason: select.reason.clone(),
        tenant: select.tenant.clone(),
        message_id: select.message_id.clone(),
        ids: select
            .id
            .iter()
            .map(|i| i.trim().to_string())
            .filter(|i| !i.is_empty())
            .collect(),
    }
}

/// The step `republish` or `discard` asks for, or why it is refused: no filter without
/// `--all`; no `--operator` and `--note` unless a dry run (recorded as `dry-run`, `dry run`).
/// The request id is the given one; a dry run's default is `dry-run`, a real step's a fresh
/// one, printed ([`request_id`]).
fn step_request(action: Action, args: &DeadLetterStepArgs) -> anyhow::Result<StepRequest> {
    let chosen = dead_letter_filter(&args.select);
    if chosen.is_empty() && !args.all {
        anyhow::bail!(
            "no filter given: narrow with --reason, --tenant, --message-id or --id, or pass --all"
        );
    }
    let (operator, note) = match (&args.operator, &args.note) {
        (Some(o), Some(n)) => (o.clone(), n.clone()),
        _ if args.dry_run => (String::from("dry-run"), String::from("dry run")),
        _ => anyhow::bail!("--operator and --note are required (they are recorded in the audit)"),
    };
    Ok(StepRequest {
        action,
        filter: chosen,
        limit: args.select.limit,
        operator,
        note,
        request_id: if args.dry_run {
            args.request_id.clone().unwrap_or_else(|| "dry-run".into())
        } else {
            request_id(args.request_id.clone())
        },
        dry_run: args.dry_run,
    })
}

/// One letter's line of a step's report: id, message id, reason, what happened.
fn step_line(action: Action, r: &StepReport) -> String {
    let outcome = match &r.outcome {
        StepOutcome::Done => format!("{}: done", action.as_str()),
        StepOutcome::WouldAct => format!("would {}", action.as_str()),
        StepOutcome::AlreadyDone(s) => format!("already done by this request id ({s})"),
        StepOutcome::NotFound => "not found in the queue".into(),
        StepOutcome::Failed(e) => format!("FAILED (the letter stays): {e}"),
    };
    format!(
        "{}  {}  {}  {}",
        r.dead_letter_id,
        r.message_id.as_deref().unwrap_or("-"),
        r.reason.as_deref().unwrap_or("-"),
        outcome
    )
}

/// Letters the step did not handle (failed, or asked for by id and not found): the command
/// then exits 1.
fn unhandled(reports: &[StepReport]) -> usize {
    reports
        .iter()
        .filter(|r| matches!(r.outcome, StepOutcome::Failed(_) | StepOutcome::NotFound))
        .count()
}

/// A plain text table of dead letters (control characters escaped).
fn letter_table(letters: &[crate::amqp::dead_letters::DeadLetter]) -> String {
    let clean = |s: Option<&str>, max: usize| -> String {
        let s: String = s
            .unwrap_or("-")
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .take(max)
            .collect();
        if s.is_empty() {
            "-".into()
        } else {
            s
        }
    };
    let mut out = String::from("ID                REASON            TENANT        ACTION_ID                 USER          DETAIL\n");
    for l in letters {
        out.push_str(&format!(
            "{:<17} {:<17} {:<13} {:<25} {:<13} {}\n",
            l.id,
            clean(l.reason.as_deref(), 17),
            clean(l.tenant.as_deref(), 13),
            clean(l.action_id.as_deref(), 25),
            clean(l.original_user.as_deref(), 13),
            clean(l.detail.as_deref(), 80),
        ));
    }
    out
}

/// `worker ops resolve`: the receipt from the flag, a file or stdin.
async fn resolve(
    settings: &Settings,
    trust: &crate::tls::Trust,
    ledger: Ledger,
    args: ResolveArgs,
) -> anyhow::Result<()> {
    let receipt_text = match (&args.receipt, &args.receipt_file) {
        (Some(r), _) => r.clone(),
        (None, Some(p)) if p.as_os_str() == "-" => {
            std::io::read_to_string(std::io::stdin()).context("reading the receipt")?
        }
        (None, Some(p)) => std::fs::read_to_string(p)
            .with_context(|| format!("reading the receipt from {}", p.display()))?,
        (None, None) => anyhow::bail!("--receipt or --receipt-file is required"),
    };
    let receipt = crate::document::Document::parse(receipt_text.as_bytes())
        .context("the receipt is not valid JSON")?;
    let request_id = request_id(args.request_id);
    let ctx = context(settings, trust, ledger, true)?;
    let r = actions::resolve(
        &ctx,
        &args.tenant,
        &args.action_id,
        ResolveInput {
            receipt: Some(receipt),
            operator: Some(args.operator),
            reason: Some(args.reason),
            request_id: Some(request_id),
        },
    )
    .await?;
    report(r, args.json)
}

/// The given request id, or a fresh one printed so the operator can retry with it.
fn request_id(given: Option<String>) -> String {
    given.unwrap_or_else(|| {
        let id = uuid::Uuid::new_v4().to_string();
        eprintln!("request id: {id} (pass --request-id {id} to retry this request safely)");
        id
    })
}

/// A context like the worker's, for receipt checks and recovery rounds run from here.
fn context(
    settings: &Settings,
    trust: &crate::tls::Trust,
    ledger: Ledger,
    need_tools: bool,
) -> anyhow::Result<Arc<Context>> {
    let tools = match Tools::load(&settings.tools_path) {
        Ok(file) => ToolSet::from_config(&file, trust)?,
        Err(e) if need_tools => {
            return Err(
                anyhow::Error::new(e).context("this command needs the tools file (WORKER_TOOLS)")
            )
        }
        Err(_) => ToolSet::default(),
    };
    Ok(Context::new(
        ledger,
        tools,
        format!("ops-cli:{}", settings.worker_id),
        settings.lease,
        settings.receipt_keep,
        settings.max_in_flight,
        settings.batch_pace,
    ))
}

fn report(r: ActionResponse, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(&r.body)?);
        return Ok(());
    }
    let view: OperationView =
        serde_json::from_value(r.body).context("unexpected response shape")?;
    let last = view.history.last();
    println!(
        "{}/{}: {}{}",
        view.tenant,
        view.action_id,
        view.state,
        if r.repeated {
            " (request already applied; nothing changed)"
        } else {
            ""
        }
    );
    if let Some(h) = last {
        println!(
            "  last change {} by {}: {}",
            h.at.to_rfc3339(),
            h.actor,
            h.evidence.as_deref().unwrap_or("")
        );
    }
    Ok(())
}

/// A plain text table of operations.
fn table(ops: &[OperationSummary]) -> String {
    let now = Utc::now();
    let header = [
        "ID",
        "TENANT",
        "ACTION_ID",
        "TOOL",
        "STATE",
        "AGE_S",
        "ATTEMPTS",
        "RECOVERY",
        "FIRST_DISPATCH",
        "REPLAY_DEADLINE",
        "EVIDENCE",
    ];
    let fmt_time = |t: Option<chrono::DateTime<Utc>>| {
        t.map(|t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string())
            .unwrap_or_else(|| "-".into())
    };
    let rows: Vec<Vec<String>> = ops
        .iter()
        .map(|o| {
            let evidence: String = o
                .evidence
                .as_deref()
                .unwrap_or("-")
                .chars()
                .take(60)
                .collect();
            vec![
                o.id.to_string(),
                o.tenant.clone(),
                o.action_id.clone(),
                o.tool.clone(),
                o.state.clone(),
                (now - o.created_at).num_seconds().to_string(),
                o.attempts.to_string(),
                o.recovery_attempts.to_string(),
                fmt_time(o.first_dispatch_at),
                fmt_time(o.replay_deadline),
                evidence.replace(['\n', '\t'], " "),
            ]
        })
        .collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ");
        s.truncate(s.trim_end().len());
        s.push('\n');
        s
    };
    let mut out = line(header.iter().map(|h| h.to_string()).collect());
    for row in rows {
        out.push_str(&line(row));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        cmd: OpsCommand,
    }

    fn parse(args: &[&str]) -> Result<OpsCommand, clap::Error> {
        Cli::try_parse_from(std::iter::once("ops").chain(args.iter().copied())).map(|c| c.cmd)
    }

    #[test]
    fn parses_every_action() {
        match parse(&[
            "list",
            "--state",
            "held,unknown",
            "--tool",
            "refund",
            "--json",
        ])
        .unwrap()
        {
            OpsCommand::List(a) => {
                assert_eq!(a.state, vec!["held", "unknown"]);
                assert_eq!(a.limit, actions::DEFAULT_LIMIT);
                assert!(a.json);
            }
            other => panic!("{other:?}"),
        }
        let resolve = parse(&[
            "resolve",
            "north",
            "refund-1",
            "--receipt",
            "{}",
            "--operator",
            "alice",
            "--reason",
            "checked",
        ])
        .unwrap();
        assert!(matches!(
            resolve,
            OpsCommand::Resolve(ResolveArgs {
                request_id: None,
                ..
            })
        ));
        assert!(parse(&[
            "fail",
            "north",
            "r",
            "--evidence",
            "proof here",
            "--operator",
            "a"
        ])
        .is_ok());
        assert!(parse(&["recheck", "north", "r", "--operator", "a", "--reason", "b"]).is_ok());
        assert!(parse(&["show", "north", "r"]).is_ok());
    }

    #[test]
    fn parses_the_dead_letter_commands() {
        match parse(&[
            "dead-letters",
            "list",
            "--reason",
            "unknown_tool",
            "--limit",
            "5",
        ])
        .unwrap()
        {
            OpsCommand::DeadLetters(DeadLetterCommand::List(s)) => {
                assert_eq!(s.reason.as_deref(), Some("unknown_tool"));
                assert_eq!(s.limit, 5);
            }
            other => panic!("{other:?}"),
        }
        match parse(&[
            "dead-letters",
            "republish",
            "--id",
            "a,b",
            "--operator",
            "alice",
            "--note",
            "tool added",
            "--request-id",
            "r-1",
        ])
        .unwrap()
        {
            OpsCommand::DeadLetters(DeadLetterCommand::Republish(a)) => {
                assert_eq!(a.select.id, vec!["a", "b"]);
                assert_eq!(a.request_id.as_deref(), Some("r-1"));
                assert!(!a.dry_run && !a.all);
            }
            other => panic!("{other:?}"),
        }
        assert!(parse(&["dead-letters", "discard", "--all", "--dry-run"]).is_ok());
        assert!(parse(&["dead-letters", "purge"]).is_err());
    }

    fn step_args(flags: &str) -> DeadLetterStepArgs {
        let argv: Vec<&str> = ["dead-letters", "discard"]
            .into_iter()
            .chain(flags.split_whitespace())
            .collect();
        match parse(&argv).unwrap() {
            OpsCommand::DeadLetters(DeadLetterCommand::Discard(a)) => a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_dead_letter_step_needs_a_filter_or_all_and_an_audit_unless_a_dry_run() {
        // (flags, Ok([operator, note, request id]) or the start of the refusal)
        let cases: &[(&str, Result<[&str; 3], &str>)] = &[
            (
                "--id a --operator al --note fix --request-id r",
                Ok(["al", "fix", "r"]),
            ),
            (
                "--all --operator al --note fix --request-id r",
                Ok(["al", "fix", "r"]),
            ),
            ("--all --dry-run", Ok(["dry-run", "dry run", "dry-run"])),
            (
                "--reason x --dry-run --request-id r",
                Ok(["dry-run", "dry run", "r"]),
            ),
            // A dry run keeps the audit fields it is given.
            (
                "--all --dry-run --operator al --note fix",
                Ok(["al", "fix", "dry-run"]),
            ),
            ("--operator al --note fix", Err("no filter given")),
            // Blank ids narrow nothing.
            ("--id , --dry-run", Err("no filter given")),
            (
                "--all --operator al",
                Err("--operator and --note are required"),
            ),
            (
                "--tenant north --note fix",
                Err("--operator and --note are required"),
            ),
        ];
        for (flags, want) in cases {
            match (step_request(Action::Discard, &step_args(flags)), want) {
                (Ok(r), Ok(audit)) => {
                    let got = [r.operator.as_str(), r.note.as_str(), r.request_id.as_str()];
                    assert_eq!(got, *audit, "{flags}");
                    assert_eq!(r.dry_run, flags.contains("--dry-run"), "{flags}");
                    assert_eq!(r.action, Action::Discard);
                }
                (Err(e), Err(start)) => assert!(e.to_string().starts_with(start), "{flags}: {e}"),
                (got, want) => panic!("{flags}: got {got:?}, want {want:?}"),
            }
        }
        let r = step_request(Action::Discard, &step_args("--id a,,b --all --dry-run")).unwrap();
        assert_eq!(r.filter.ids, ["a", "b"]);
    }

    #[test]
    fn a_step_report_line_says_what_happened_and_failures_and_misses_count_as_unhandled() {
        let report = |outcome| StepReport {
            dead_letter_id: "d1".into(),
            request_id: "r:d1".into(),
            message_id: Some("north:a".into()),
            tenant: Some("north".into()),
            reason: None,
            outcome,
        };
        let cases = [
            (StepOutcome::Done, "d1  north:a  -  republish: done", false),
            (
                StepOutcome::WouldAct,
                "d1  north:a  -  would republish",
                false,
            ),
            (
                StepOutcome::AlreadyDone("republish done".into()),
                "d1  north:a  -  already done by this request id (republish done)",
                false,
            ),
            (
                StepOutcome::NotFound,
                "d1  north:a  -  not found in the queue",
                true,
            ),
            (
                StepOutcome::Failed("nacked".into()),
                "d1  north:a  -  FAILED (the letter stays): nacked",
                true,
            ),
        ];
        for (outcome, line, counted) in cases {
            let r = report(outcome);
            assert_eq!(step_line(Action::Republish, &r), line);
            assert_eq!(
                unhandled(std::slice::from_ref(&r)),
                usize::from(counted),
                "{line}"
            );
        }
    }

    #[test]
    fn resolve_needs_a_receipt_and_an_operator() {
        assert!(parse(&["resolve", "north", "r", "--operator", "a", "--reason", "b"]).is_err());
        assert!(parse(&["resolve", "north", "r", "--receipt", "{}", "--reason", "b"]).is_err());
        assert!(parse(&[
            "resolve",
            "north",
            "r",
            "--receipt",
            "{}",
            "--receipt-file",
            "x",
            "--operator",
            "a",
            "--reason",
            "b"
        ])
        .is_err());
    }

    #[test]
    fn counts_read_as_english() {
        assert_eq!(count_of(0, "operation"), "0 operations");
        assert_eq!(count_of(1, "operation"), "1 operation");
        assert_eq!(count_of(2, "letter"), "2 letters");
    }

    #[test]
    fn table_has_a_header_and_a_row_per_operation() {
        let view: OperationSummary = serde_json::from_value(serde_json::json!({
            "id": 7, "tenant": "north", "action_id": "refund-1", "idempotency_key": "north:refund-1",
            "tool": "refund", "state": "held", "fingerprint": "f", "arguments": null, "fence": 1,
            "attempts": 1, "recovery_attempts": 0, "first_dispatch_at": null,
            "replay_deadline": null, "next_attempt_at": null, "lease_owner": null,
            "lease_until": null, "evidence": "line\nbreak", "receipt": null, "receipt_id": null,
            "created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-01T00:00:00Z",
            "state_since": "2026-01-01T00:00:00Z", "swept_at": null, "history": []
        }))
        .unwrap();
        let out = table(&[view]);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with("ID"));
        assert!(lines[1].contains("refund-1") && lines[1].contains("line break"));
    }
}
