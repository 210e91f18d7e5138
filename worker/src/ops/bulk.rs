//! Bulk operator actions: recheck or fail every operation a console filter matches, as a job
//! kept in the ledger ([`crate::ledger::jobs`]) so that its progress survives a page reload
//! and is the same whichever worker serves the page.
//!
//! A job is created with the operations the filter matched then (at most its cap: default
//! [`DEFAULT_CAP`], never above [`MAX_CAP`]), owned by the worker that created it, and worked
//! through by that worker in id order. Each item goes through the same operator action as a
//! single one ([`super::actions::recheck`], [`super::actions::fail`]: one guarded statement,
//! audited as `operator:<name>`) with the request id `bulk:<job>:<operation>`, so a job
//! resumed after a crash repeats nothing. An item whose row moved meanwhile (the statement
//! matched nothing: already resolved, or recovering right now) is counted **skipped** and left
//! as it is; one the action cannot be asked for (its tool is not configured here, the row is
//! gone) is **refused**; the others are **done**.
//!
//! The owner renews its lease ([`JOB_LEASE`]) with every item it records. Every worker with
//! the console looks every few seconds for a running job whose lease lapsed (its worker died)
//! and takes it over; a job taken over [`MAX_CLAIMS`] times is marked abandoned instead.
//! Finished jobs are deleted after the retention of finished operations.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::actions::{self, FailInput, OpsError, RecheckInput};
use crate::context::Context;
use crate::ledger::jobs::{ItemOutcome, Job, NewJob};
use crate::ledger::queries::OperationSearch;
use crate::ledger::LedgerError;

/// Operations a job takes when the form does not say.
pub const DEFAULT_CAP: i64 = 1_000;
/// Most operations one job may take.
pub const MAX_CAP: i64 = 10_000;
/// How long a job's owner may go without recording an item before another worker takes it.
pub const JOB_LEASE: Duration = Duration::from_secs(30);
/// Takeovers after which a job is abandoned rather than taken again.
pub const MAX_CLAIMS: i32 = 5;
/// How often a worker looks for jobs to take over.
const SWEEP_INTERVAL: Duration = Duration::from_secs(5);
/// Items applied at once.
const CONCURRENCY: usize = 8;

/// Which operator action a job applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BulkAction {
    Recheck,
    Fail,
}

impl BulkAction {
    pub fn as_str(self) -> &'static str {
        match self {
            BulkAction::Recheck => "recheck",
            BulkAction::Fail => "fail",
        }
    }

    pub fn parse(s: &str) -> Option<BulkAction> {
        match s {
            "recheck" => Some(BulkAction::Recheck),
            "fail" => Some(BulkAction::Fail),
            _ => None,
        }
    }
}

/// A request for a job.
#[derive(Debug, Clone)]
pub struct BulkRequest {
    pub action: BulkAction,
    pub search: OperationSearch,
    /// The console filter as it will be shown on the job's page.
    pub filter: serde_json::Value,
    pub cap: i64,
    pub operator: String,
    /// The reason (recheck) or the evidence (fail) each item is given.
    pub reason: String,
    pub request_id: String,
}

/// Starts, runs and takes over bulk jobs for one worker.
#[derive(Clone)]
pub struct Runner {
    ctx: Arc<Context>,
    stop: CancellationToken,
    tasks: TaskTracker,
    /// How long finished jobs are kept.
    retention: Duration,
}

impl Runner {
    pub fn new(
        ctx: Arc<Context>,
        stop: CancellationToken,
        tasks: TaskTracker,
        retention: Duration,
    ) -> Runner {
        Runner {
            ctx,
            stop,
            tasks,
            retention,
        }
    }

    fn owner(&self) -> &str {
        &self.ctx.worker_id
    }

    /// Creates the job (or finds the one this request id created) and, if new, starts it.
    pub async fn start(&self, request: &BulkRequest) -> Result<Job, OpsError> {
        let bad = |m: String| Err(OpsError::BadRequest(m));
        if !(1..=MAX_CAP).contains(&request.cap) {
            return bad(format!("the cap must be between 1 and {MAX_CAP}"));
        }
        actions::check_operator_name(&request.operator).map_err(OpsError::BadRequest)?;
        if request.request_id.trim().is_empty()
            || request.request_id.chars().any(kit::text::is_unseen)
        {
            return bad("request_id is required, without control or invisible characters".into());
        }
        // The same rules as each item's own action, so no job is made whose every item would be
        // refused.
        let reason = match request.action {
            BulkAction::Fail => actions::evidence_text(Some(request.reason.clone()))?,
            BulkAction::Recheck => actions::reason_text(Some(request.reason.clone()))?,
        };
        let reason = reason.as_str();
        let (job, created) = self
            .ctx
            .ledger
            .create_job(&NewJob {
                request_id: &request.request_id,
                action: request.action.as_str(),
                filter: request.filter.clone(),
                operator: request.operator.trim(),
                reason,
                cap: request.cap,
                search: &request.search,
                owner: self.owner(),
                lease: JOB_LEASE,
            })
            .await?;
        if created && job.status == "running" {
            tracing::info!(job = job.id, action = %job.action, total = job.total, operator = %job.operator, "bulk job started");
            let runner = self.clone();
            let id = job.id;
            self.tasks.spawn(async move { runner.run(id).await });
        }
        Ok(job)
    }

    /// Looks for jobs to take over until stopped, and deletes old finished ones.
    pub async fn sweep(self) {
        let mut ticks: u64 = 0;
        loop {
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep(SWEEP_INTERVAL) => {}
            }
            ticks += 1;
            match self
                .ctx
                .ledger
                .take_over_job(self.owner(), JOB_LEASE, MAX_CLAIMS)
                .await
            {
                Ok(Some(job)) => {
                    tracing::warn!(
                        job = job.id,
                        claims = job.claims,
                        "taking over a bulk job whose worker stopped"
                    );
                    self.clone().run(job.id).await;
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "cannot look for bulk jobs to take over"),
            }
            // About once a minute.
            if ticks.is_multiple_of(12) {
                if let Err(e) = self.ctx.ledger.delete_old_jobs(self.retention).await {
                    tracing::warn!(error = %e, "cannot delete old bulk jobs");
                }
            }
        }
    }

    /// Works through the job's items until none is left, the job is no longer this worker's
    /// (cancelled, taken over) or the worker stops.
    async fn run(self, job_id: i64) {
        let mut backoff = Duration::from_millis(200);
        loop {
            if self.stop.is_cancelled() {
                return;
            }
            match self.step(job_id).await {
                Ok(Step::More) => backoff = Duration::from_millis(200),
                Ok(Step::Finished) => {
                    tracing::info!(job = job_id, "bulk job finished");
                    return;
                }
                Ok(Step::NotOurs) => {
                    tracing::info!(job = job_id, "bulk job stopped (cancelled or taken over)");
                    return;
                }
                Err(e) => {
                    tracing::warn!(job = job_id, error = %e, "bulk job paused by a ledger error");
                    let _ = self
                        .ctx
                        .ledger
                        .note_job_error(job_id, self.owner(), &e.to_string())
                        .await;
                    tokio::select! {
                        _ = self.stop.cancelled() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// One round: the next items, applied together, each outcome recorded.
    async fn step(&self, job_id: i64) -> Result<Step, LedgerError> {
        let ledger = &self.ctx.ledger;
        let Some(job) = ledger.job(job_id).await? else {
            return Ok(Step::NotOurs);
        };
        if job.status != "running" || job.owner.as_deref() != Some(self.owner()) {
            return Ok(Step::NotOurs);
        }
        let items = ledger.job_pending_items(job_id, CONCURRENCY as i64).await?;
        if items.is_empty() {
            return Ok(if ledger.finish_job(job_id, self.owner()).await? {
                Step::Finished
            } else {
                Step::NotOurs
            });
        }
        let job = Arc::new(job);
        let mut running = JoinSet::new();
        for operation_id in items {
            let (ctx, job) = (self.ctx.clone(), job.clone());
            running.spawn(async move { (operation_id, apply(&ctx, &job, operation_id).await) });
        }
        let mut ours = true;
        let mut failed = None;
        while let Some(joined) = running.join_next().await {
            let Ok((operation_id, applied)) = joined else {
                continue;
            };
            match applied {
                Ok((outcome, detail)) if ours => {
                    ours = ledger
                        .record_job_item(
                            job_id,
                            operation_id,
                            outcome,
                            &detail,
                            self.owner(),
                            JOB_LEASE,
                        )
                        .await?;
                }
                Ok(_) => {}
                Err(e) => failed = Some(e),
            }
        }
        match (ours, failed) {
            (false, _) => Ok(Step::NotOurs),
            (true, Some(e)) => Err(e),
            (true, None) => Ok(Step::More),
        }
    }
}

enum Step {
    More,
    Finished,
    NotOurs,
}

/// Applies the job's action to one operation; Err only for a ledger error (the item is tried
/// again).
async fn apply(
    ctx: &Arc<Context>,
    job: &Job,
    operation_id: i64,
) -> Result<(ItemOutcome, String), LedgerError> {
    let Some(op) = ctx.ledger.get(operation_id).await? else {
        return Ok((
            ItemOutcome::Refused,
            "the operation no longer exists".into(),
        ));
    };
    let request_id = Some(format!("bulk:{}:{operation_id}", job.id));
    let operator = Some(job.operator.clone());
    let result = match job.action.as_str() {
        "fail" => {
            actions::fail(
                ctx,
                &op.tenant,
                &op.action_id,
                FailInput {
                    evidence: Some(job.reason.clone()),
                    operator,
                    request_id,
                },
            )
            .await
        }
        _ => {
            actions::recheck(
                ctx,
                &op.tenant,
                &op.action_id,
                RecheckInput {
                    operator,
                    reason: Some(job.reason.clone()),
                    request_id,
                },
            )
            .await
        }
    };
    Ok(match result {
        Ok(r) => {
            let state = r.body["state"].as_str().unwrap_or("?").to_string();
            let detail = if r.repeated {
                format!("already applied by this job; {state}")
            } else {
                format!("now {state}")
            };
            (ItemOutcome::Done, detail)
        }
        Err(OpsError::Conflict {
            state: Some(state), ..
        }) => (
            ItemOutcome::Skipped,
            format!("moved on: {} (nothing written)", state.as_str()),
        ),
        Err(OpsError::Ledger(e)) => return Err(e),
        Err(e) => (ItemOutcome::Refused, e.to_string()),
    })
}
