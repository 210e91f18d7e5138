//! What the consumer, the dispatcher and the recovery scheduler share: the ledger, the tools,
//! this worker's identity and lease, the two group-commit batchers ([`crate::batch`]), the
//! in-flight bound and the tasks it admits, and the wake-up signals.
//!
//! Every task the context starts has a handle: the batchers run on [`Context::batchers`], the
//! bounded in-flight work (dispatches, recovery rounds) on [`Context::in_flight_tasks`], so
//! shutdown can wait for both ([`Context::drain`], [`Context::stop_batchers`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, Semaphore};
use tokio_util::task::TaskTracker;

use crate::adapter::ToolSet;
use crate::batch::completion::CompletionBatcher;
use crate::batch::fence::FenceBatcher;
use crate::ledger::{Ledger, ReplayWindows};

/// Shared worker state; cheap to clone behind an `Arc`.
pub struct Context {
    pub ledger: Ledger,
    pub tools: ToolSet,
    pub windows: ReplayWindows,
    /// Each approval tool's terms (how many people, how long the wait), for admissions.
    pub approvals: crate::ledger::approval::ApprovalTerms,
    /// Written into leases and history.
    pub worker_id: String,
    /// How long a claim owns a dispatch.
    pub lease: Duration,
    /// Receipts the downstream returned that the ledger has not taken yet.
    pub receipts: crate::dispatch::kept::KeptReceipts,
    /// Bounds dispatches and recovery rounds running at once in this process.
    pub in_flight: Arc<Semaphore>,
    /// The tasks [`Context::spawn_bounded`] started.
    pub in_flight_tasks: TaskTracker,
    /// Wakes the result relay after a commit that wrote result events.
    pub relay_wake: Arc<Notify>,
    /// How long the relay owns the events it claims or that are inserted claimed for it.
    pub relay_hold: Duration,
    /// Wakes the recovery scheduler (e.g. an unknown outcome of a tool without recovery).
    pub scheduler_wake: Arc<Notify>,
    /// Retry-budget movements of this worker's outcomes not yet written to the ledger.
    pub budget: crate::retry::BudgetTally,
    /// Send fences, batched.
    pub fences: FenceBatcher,
    /// Completions, batched, and their events' hand-off to the relay.
    pub completions: CompletionBatcher,
    /// The batchers' tasks.
    pub batchers: crate::batch::Tasks,
    /// The least time between two batches of the intake while it is saturated
    /// (`WORKER_BATCH_PACE_MS`; see [`crate::batch`]).
    pub batch_pace: Duration,
}

impl Context {
    /// Builds the context and starts the batchers on the current runtime.
    pub fn new(
        ledger: Ledger,
        tools: ToolSet,
        worker_id: String,
        lease: Duration,
        receipt_keep: Duration,
        max_in_flight: usize,
        batch_pace: Duration,
    ) -> Arc<Context> {
        let windows = ReplayWindows::new(tools.replay_windows());
        let approvals = tools
            .iter()
            .filter_map(|(name, t)| t.config.approval.as_ref().map(|a| (name, a)))
            .fold(
                Default::default(),
                |terms: crate::ledger::approval::ApprovalTerms, (name, a)| {
                    terms.with(name, a.approvals, a.ttl)
                },
            );
        let relay_wake = Arc::new(Notify::new());
        let relay_hold = crate::ledger::outbox::relay_hold();
        let batchers = crate::batch::Tasks::default();
        let completions = CompletionBatcher::spawn(
            ledger.clone(),
            worker_id.clone(),
            relay_wake.clone(),
            relay_hold,
            &batchers,
        );
        let fences = FenceBatcher::spawn(ledger.clone(), worker_id.clone(), lease, &batchers);
        Arc::new(Context {
            ledger,
            tools,
            windows,
            approvals,
            worker_id,
            lease,
            receipts: crate::dispatch::kept::KeptReceipts::new(receipt_keep),
            in_flight: Arc::new(Semaphore::new(max_in_flight)),
            in_flight_tasks: TaskTracker::new(),
            relay_wake,
            relay_hold,
            scheduler_wake: Arc::new(Notify::new()),
            budget: Default::default(),
            fences,
            completions,
            batchers,
            batch_pace,
        })
    }

    /// Waits for an in-flight slot, then runs `work` in its own task on
    /// [`Context::in_flight_tasks`]; the slot is released when the task ends.
    pub async fn spawn_bounded<F, Fut>(self: &Arc<Self>, work: F)
    where
        F: FnOnce(Arc<Context>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let permit = self.in_flight_slot().await;
        // Boxed once here: a dispatch task is kilobytes, and unboxed it would be copied whole
        // into each wrapper and into the runtime's task cell on the way to the heap.
        let task = Box::pin(work(self.clone()));
        self.in_flight_tasks.spawn(async move {
            task.await;
            drop(permit);
        });
    }

    /// Waits for an in-flight slot without spawning (for work run inline).
    pub async fn in_flight_slot(&self) -> tokio::sync::OwnedSemaphorePermit {
        self.in_flight
            .clone()
            .acquire_owned()
            .await
            .expect("semaphore never closed")
    }

    /// Waits until every task [`Context::spawn_bounded`] started has ended (tasks started
    /// meanwhile included).
    pub async fn drain(&self) {
        self.in_flight_tasks.close();
        self.in_flight_tasks.wait().await;
    }

    /// Stops the batchers once what they had queued is recorded; later requests go alone.
    pub async fn stop_batchers(&self) {
        self.batchers.stop().await;
    }
}
