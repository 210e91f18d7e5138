//! What the consumer, the dispatcher and the recovery scheduler share: the ledger, the tools,
//! this worker's identity and lease, the two group-commit batchers (send fences and
//! completions), the completions' hand-off to the result relay and the wake-up signals.
//!
//! The batchers have no timer: a request that finds the batcher idle runs at once, alone;
//! requests that arrive while a statement is running wait for it and then go together. So a
//! lone intent never waits for a batch to fill, and a busy worker pays one statement per batch.
//!
//! While this process's relay is connected, the completion batcher inserts its result events
//! already claimed by this worker (for [`crate::ledger::outbox::relay_hold`]) and, once the
//! commit is done, hands the rows to the relay through a bounded channel: the relay publishes
//! them without a claim `UPDATE` of its own.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::error::{TryRecvError, TrySendError};
use tokio::sync::{mpsc, oneshot, Notify, Semaphore};

use crate::adapter::ToolSet;
use crate::ledger::outbox::OutboxRow;
use crate::ledger::{
    Applied, Completed, Completion, Ledger, LedgerError, ReplayWindows, SendFence,
};

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
    /// How long the relay owns the events it claims or that are inserted claimed for it.
    pub relay_hold: Duration,
    /// Committed result events of the completion batcher, claimed for this process's relay.
    handoff: Arc<Handoff>,
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
/// Handed events waiting for the relay at most. The relay takes up to a batch (256) per
/// round and publishes far faster than completions arrive, so this fills only while its broker
/// link is stalled; events that find it full stay claimed in the outbox and any relay
/// publishes them once their hold has passed (the database path).
const HANDOFF_CAPACITY: usize = 4096;

/// A committed result event inserted claimed by this worker, on its way to the relay.
struct Handed {
    row: OutboxRow,
    /// After this the hold may be close to its end (another relay could take the row soon),
    /// so the relay leaves the row to the database path rather than publishing it from here.
    fresh_until: Instant,
}

/// The completion batcher's in-memory hand-off to this process's relay.
struct Handoff {
    tx: mpsc::Sender<Handed>,
    /// One relay per process takes from it; reconnected relays take over the same channel.
    rx: Mutex<mpsc::Receiver<Handed>>,
    /// A relay is connected: only then are events inserted claimed (a process without one,
    /// e.g. `worker ops`, or a relay whose broker link is down, leaves them to any relay at
    /// once, as before).
    attached: AtomicBool,
}

/// What [`Context::take_handed`] found.
#[derive(Debug, Default)]
pub struct HandedBatch {
    /// Fresh rows to publish, in hand-off order.
    pub rows: Vec<OutboxRow>,
    /// Rows dropped because they waited too long; the database path publishes them after
    /// their hold.
    pub stale: usize,
}

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
        let relay_wake = Arc::new(Notify::new());
        let relay_hold = crate::ledger::outbox::relay_hold();
        let (handoff_tx, handoff_rx) = mpsc::channel(HANDOFF_CAPACITY);
        let handoff = Arc::new(Handoff {
            tx: handoff_tx,
            rx: Mutex::new(handoff_rx),
            attached: AtomicBool::new(false),
        });
        tokio::spawn(run_completer(
            ledger.clone(),
            worker_id.clone(),
            rx,
            Relaying {
                handoff: handoff.clone(),
                wake: relay_wake.clone(),
                hold: relay_hold,
            },
        ));
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
            relay_wake,
            relay_hold,
            handoff,
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

    /// Called by the relay when it is connected (`true`) and when it stops or loses its link
    /// (`false`): completion events are inserted claimed for it only while it is there.
    pub fn relay_attached(&self, attached: bool) {
        self.handoff.attached.store(attached, Ordering::SeqCst);
    }

    /// Takes up to `max` handed events without waiting, dropping those past their freshness.
    pub fn take_handed(&self, max: usize) -> HandedBatch {
        let mut out = HandedBatch::default();
        let mut rx = self.handoff.rx.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        while out.rows.len() < max {
            match rx.try_recv() {
                Ok(h) if h.fresh_until > now => out.rows.push(h.row),
                Ok(_) => out.stale += 1,
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        out
    }

    /// Whether handed events are waiting for the relay.
    pub fn handed_waiting(&self) -> bool {
        let rx = self.handoff.rx.lock().unwrap_or_else(|e| e.into_inner());
        !rx.is_empty()
    }

    /// Records a completion; completions arriving together share one commit.
    pub async fn complete(&self, completion: Completion) -> Result<Applied, LedgerError> {
        let (tx, rx) = oneshot::channel();
        if self.completer.send((completion.clone(), tx)).await.is_err() {
            // The batcher is gone (shutdown): record it alone.
            let result = self
                .ledger
                .complete(&self.worker_id, std::slice::from_ref(&completion))
                .await
                .pop()
                .expect("one result per completion");
            self.relay_wake.notify_one();
            return result;
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

/// How the completion batcher reaches the relay.
struct Relaying {
    handoff: Arc<Handoff>,
    wake: Arc<Notify>,
    hold: Duration,
}

/// Group commit: takes whatever completions are waiting (up to a batch) and records them in
/// one transaction, answering each caller with its own result. While a relay is attached, the
/// batch's events are inserted claimed by this worker and handed to the relay after the commit.
async fn run_completer(
    ledger: Ledger,
    worker_id: String,
    mut rx: mpsc::Receiver<(Completion, oneshot::Sender<Result<Applied, LedgerError>>)>,
    relay: Relaying,
) {
    let mut batch = Vec::with_capacity(COMPLETION_BATCH);
    while rx.recv_many(&mut batch, COMPLETION_BATCH).await > 0 {
        let (completions, replies): (Vec<_>, Vec<_>) = batch.drain(..).unzip();
        // Taken before the transaction begins, so before the database's `now()` that starts
        // the hold: the freshness limit below is conservative on either clock.
        let started = Instant::now();
        let held = relay.handoff.attached.load(Ordering::SeqCst);
        let done = if held {
            ledger
                .complete_held(&worker_id, &completions, relay.hold)
                .await
        } else {
            Completed {
                results: ledger.complete(&worker_id, &completions).await,
                events: Vec::new(),
            }
        };
        // `complete_held` returns after the commit: the relay never sees an uncommitted row.
        // Half the hold is the margin: a row the relay reaches later than that is left to the
        // database path, which takes it once the hold has passed (another relay may by then).
        let fresh_until = started + relay.hold / 2;
        let handed = !done.events.is_empty();
        for row in done.events {
            match relay.handoff.tx.try_send(Handed { row, fresh_until }) {
                Ok(()) => {}
                // Full (the relay is stalled) or gone: the row stays claimed in the outbox and
                // is published by the database path after its hold.
                Err(TrySendError::Full(_) | TrySendError::Closed(_)) => break,
            }
        }
        // Held events were handed (or wait for their hold); unheld ones are in the outbox for any
        // relay. Only those two cases have something to publish: a wake without them costs the
        // relay an empty claim statement.
        if handed || !held {
            relay.wake.notify_one();
        }
        for (reply, result) in replies.into_iter().zip(done.results) {
            let _ = reply.send(result);
        }
    }
}
