//! What the consumer, the dispatcher and the recovery scheduler share: the ledger, the tools,
//! this worker's identity and lease, the two group-commit batchers (send fences and
//! completions) and the wake-up signals.
//!
//! The batchers have no timer: a request that finds the batcher idle runs at once, alone;
//! requests that arrive while a statement is running wait for it and then go together. So a
//! lone intent never waits for a batch to fill, and a busy worker pays one statement per batch.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Notify, Semaphore};

use crate::adapter::ToolSet;
use crate::ledger::{Applied, Completion, Ledger, LedgerError, ReplayWindows, SendFence};

/// Shared worker state; cheap to clone behind an `Arc`.
pub struct Context {
    pub ledger: Ledger,
    pub tools: ToolSet,
    pub windows: ReplayWindows,
    /// Written into leases and history.
    pub worker_id: String,
    /// How long a claim owns a dispatch.
    pub lease: Duration,
    /// Bounds dispatches and recovery rounds running at once in this process.
    pub in_flight: Arc<Semaphore>,
    /// Wakes the result relay after a commit that wrote result events.
    pub relay_wake: Arc<Notify>,
    /// Wakes the recovery scheduler (e.g. an unknown outcome of a tool without recovery).
    pub scheduler_wake: Arc<Notify>,
    /// Retry-budget movements of this worker's outcomes not yet written to the ledger.
    pub budget: crate::retry::BudgetTally,
    completer: mpsc::Sender<(Completion, oneshot::Sender<Result<Applied, LedgerError>>)>,
    fencer: mpsc::Sender<(SendFence, oneshot::Sender<Result<bool, FenceError>>)>,
}

/// A batched send fence that could not be checked (the statement failed for the whole batch).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct FenceError(String);

/// Largest number of completions recorded in one commit.
const COMPLETION_BATCH: usize = 256;
/// Largest number of sends fenced by one statement.
const FENCE_BATCH: usize = 256;

impl Context {
    /// Builds the context and starts the completion batcher on the current runtime.
    pub fn new(
        ledger: Ledger,
        tools: ToolSet,
        worker_id: String,
        lease: Duration,
        max_in_flight: usize,
    ) -> Arc<Context> {
        let (tx, rx) = mpsc::channel(COMPLETION_BATCH * 4);
        let windows = ReplayWindows::new(tools.replay_windows());
        tokio::spawn(run_completer(ledger.clone(), worker_id.clone(), rx));
        let (fencer, fence_rx) = mpsc::channel(FENCE_BATCH * 4);
        tokio::spawn(run_fencer(
            ledger.clone(),
            worker_id.clone(),
            lease,
            fence_rx,
        ));
        Arc::new(Context {
            ledger,
            tools,
            windows,
            worker_id,
            lease,
            in_flight: Arc::new(Semaphore::new(max_in_flight)),
            relay_wake: Arc::new(Notify::new()),
            scheduler_wake: Arc::new(Notify::new()),
            budget: Default::default(),
            completer: tx,
            fencer,
        })
    }

    /// Waits for an in-flight slot, then runs `work` in its own task; the slot is released
    /// when the task ends, so shutdown can wait for all of them.
    pub async fn spawn_bounded<F, Fut>(self: &Arc<Self>, work: F)
    where
        F: FnOnce(Arc<Context>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let permit = self
            .in_flight
            .clone()
            .acquire_owned()
            .await
            .expect("semaphore never closed");
        let task = work(self.clone());
        tokio::spawn(async move {
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

    /// The send fence of a first dispatch or retry ([`Ledger::fence_send`]); fences requested
    /// together share one statement. The request leaves right after the answer, so the time
    /// between the check and the send stays that of one statement, well inside the lease.
    pub async fn fence_send(&self, send: SendFence) -> Result<bool, FenceError> {
        let (tx, rx) = oneshot::channel();
        if self.fencer.send((send, tx)).await.is_err() {
            // The batcher is gone (shutdown): fence it alone.
            return self
                .ledger
                .fence_send(
                    send.id,
                    send.fence,
                    &self.worker_id,
                    self.lease,
                    send.timeout,
                )
                .await
                .map_err(|e| FenceError(e.to_string()));
        }
        rx.await
            .unwrap_or_else(|_| Err(FenceError("fence batcher stopped".into())))
    }

    /// Records a completion; completions arriving together share one commit.
    pub async fn complete(&self, completion: Completion) -> Result<Applied, LedgerError> {
        let (tx, rx) = oneshot::channel();
        if self.completer.send((completion.clone(), tx)).await.is_err() {
            // The batcher is gone (shutdown): record it alone.
            return self
                .ledger
                .complete(&self.worker_id, std::slice::from_ref(&completion))
                .await
                .pop()
                .expect("one result per completion");
        }
        rx.await
            .unwrap_or_else(|_| Err(LedgerError::Refused("completion batcher stopped".into())))
    }
}

/// Group fence: takes whatever send fences are waiting (up to a batch) and checks them in one
/// statement, each row against its own predicate.
async fn run_fencer(
    ledger: Ledger,
    worker_id: String,
    lease: Duration,
    mut rx: mpsc::Receiver<(SendFence, oneshot::Sender<Result<bool, FenceError>>)>,
) {
    let mut batch = Vec::with_capacity(FENCE_BATCH);
    while rx.recv_many(&mut batch, FENCE_BATCH).await > 0 {
        let (sends, replies): (Vec<_>, Vec<_>) = batch.drain(..).unzip();
        match ledger.fence_sends(&sends, &worker_id, lease).await {
            Ok(passed) => {
                for (reply, ok) in replies.into_iter().zip(passed) {
                    let _ = reply.send(Ok(ok));
                }
            }
            Err(e) => {
                let e = FenceError(e.to_string());
                for reply in replies {
                    let _ = reply.send(Err(e.clone()));
                }
            }
        }
    }
}

/// Group commit: takes whatever completions are waiting (up to a batch) and records them in
/// one transaction, answering each caller with its own result.
async fn run_completer(
    ledger: Ledger,
    worker_id: String,
    mut rx: mpsc::Receiver<(Completion, oneshot::Sender<Result<Applied, LedgerError>>)>,
) {
    let mut batch = Vec::with_capacity(COMPLETION_BATCH);
    while rx.recv_many(&mut batch, COMPLETION_BATCH).await > 0 {
        let (completions, replies): (Vec<_>, Vec<_>) = batch.drain(..).unzip();
        let results = ledger.complete(&worker_id, &completions).await;
        for (reply, result) in replies.into_iter().zip(results) {
            let _ = reply.send(result);
        }
    }
}
