//! The completion batcher: outcomes arriving together are recorded in one transaction, each
//! caller answered with its own result; and the in-memory hand-off of the committed result
//! events to this process's relay.
//!
//! While this process's relay is connected ([`CompletionBatcher::relay_attached`]), the batch's
//! result events are inserted already claimed by this worker, in its relay epoch, and, once the
//! commit is done, handed to the relay through a bounded channel: the relay publishes them
//! without a claim `UPDATE` of its own, and records them published with the epoch's watermark.
//! An epoch its relay leaves silent for [`crate::ledger::outbox::relay_hold`] is retired and
//! its unpublished events go to any relay. Without a relay they are left in the outbox for any
//! relay, at once.
//!
//! The events of one epoch reach the relay in id order and none is skipped: when one could not
//! be handed (the channel was full), a commit's reply was lost, or the relay dropped one that
//! waited too long ([`CompletionBatcher::freeze_epoch`]), the next batch begins a new epoch.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::error::{TryRecvError, TrySendError};
use tokio::sync::{mpsc, oneshot, Notify};
use tracing::Instrument as _;

use super::{run_batches, Tasks};
use crate::ledger::outbox::OutboxRow;
use crate::ledger::{Applied, Completed, Completion, Ledger, LedgerError};
use crate::lock;

/// Largest number of completions recorded in one commit.
const COMPLETION_BATCH: usize = 256;
/// Handed events waiting for the relay at most. The relay takes up to a batch (256) per
/// round and publishes far faster than completions arrive, so this fills only while its broker
/// link is stalled; events that find it full stay claimed in their epoch, and any relay
/// publishes them once the epoch is retired (the database path).
const HANDOFF_CAPACITY: usize = 4096;

/// A recorded completion's result, with the completion given back (None only when the batcher
/// dropped it unanswered), so a caller that tries again needs no copy of it.
pub type Answer = (Result<Applied, LedgerError>, Option<Completion>);

type Request = (Completion, oneshot::Sender<Answer>);

/// A committed result event inserted claimed by this worker, on its way to the relay.
struct Handed {
    row: OutboxRow,
    /// After this the epoch may be retired soon (its relay silent for the hold, and another
    /// relay then takes the row), so the relay leaves the row to the database path rather than
    /// publishing it from here.
    fresh_until: Instant,
}

/// The completion batcher's in-memory hand-off to this process's relay.
struct Handoff {
    tx: mpsc::Sender<Handed>,
    /// One relay per process takes from it; reconnected relays take over the same channel.
    rx: Mutex<mpsc::Receiver<Handed>>,
    /// A relay is connected: only then are events inserted claimed (a process without one,
    /// e.g. `worker ops`, or a relay whose broker link is down, leaves them to any relay at
    /// once).
    attached: AtomicBool,
    /// Wakes the relay after a commit that wrote result events.
    wake: Arc<Notify>,
    /// How long the relay owns the events inserted claimed for it.
    hold: Duration,
    /// The relay epoch the next held batch inserts into (None: begin one).
    epoch: Mutex<Option<i64>>,
    /// The latest epoch the relay stopped advancing (it dropped one of its events), and with it
    /// every earlier one (epochs begin in id order): no batch joins them again. 0 when none.
    frozen: AtomicI64,
}

/// What [`CompletionBatcher::take_handed`] found.
#[derive(Debug, Default)]
pub struct HandedBatch {
    /// Fresh rows to publish, in hand-off order.
    pub rows: Vec<OutboxRow>,
    /// Rows dropped because they waited too long; their epoch is frozen, and the database path
    /// publishes them once it is retired.
    pub stale: usize,
}

/// The handle callers and the relay use; the batching task runs on [`Tasks`].
pub struct CompletionBatcher {
    ledger: Ledger,
    worker_id: String,
    tx: mpsc::Sender<Request>,
    handoff: Arc<Handoff>,
}

impl CompletionBatcher {
    /// Starts the batcher on `tasks`; `wake` is the relay's wake-up, `hold` how long the relay
    /// owns the events inserted claimed for it.
    pub fn spawn(
        ledger: Ledger,
        worker_id: String,
        wake: Arc<Notify>,
        hold: Duration,
        tasks: &Tasks,
    ) -> Self {
        let (tx, rx) = mpsc::channel(COMPLETION_BATCH * 4);
        let (handoff_tx, handoff_rx) = mpsc::channel(HANDOFF_CAPACITY);
        let handoff = Arc::new(Handoff {
            tx: handoff_tx,
            rx: Mutex::new(handoff_rx),
            attached: AtomicBool::new(false),
            wake,
            hold,
            epoch: Mutex::new(None),
            frozen: AtomicI64::new(0),
        });
        let (l, w, h) = (ledger.clone(), worker_id.clone(), handoff.clone());
        tasks.tracker.spawn(run_batches(
            rx,
            COMPLETION_BATCH,
            None,
            tasks.stop.clone(),
            move |batch| complete_batch(l.clone(), w.clone(), h.clone(), batch),
        ));
        CompletionBatcher {
            ledger,
            worker_id,
            tx,
            handoff,
        }
    }

    /// Records a completion: batched with those arriving meanwhile, or alone once the batcher
    /// has stopped (shutdown).
    pub async fn complete(&self, completion: Completion) -> Answer {
        let (tx, rx) = oneshot::channel();
        if let Err(mpsc::error::SendError((completion, _))) = self.tx.send((completion, tx)).await {
            // Boxed: a statement's future is large, and inline it would make every dispatch
            // task that large for a path taken only at shutdown.
            let result = Box::pin(
                self.ledger
                    .complete(&self.worker_id, std::slice::from_ref(&completion)),
            )
            .await
            .pop()
            .expect("one result per completion");
            self.handoff.wake.notify_one();
            return (result, Some(completion));
        }
        rx.await.unwrap_or_else(|_| {
            (
                Err(LedgerError::Refused("completion batcher stopped".into())),
                None,
            )
        })
    }

    /// Called by the relay when it is connected (`true`) and when it stops or loses its link
    /// (`false`): completion events are inserted claimed for it only while it is there.
    pub fn relay_attached(&self, attached: bool) {
        self.handoff.attached.store(attached, Ordering::SeqCst);
    }

    /// Takes up to `max` handed events without waiting, dropping those past their freshness.
    pub fn take_handed(&self, max: usize) -> HandedBatch {
        let mut out = HandedBatch::default();
        let mut rx = lock(&self.handoff.rx);
        let now = Instant::now();
        while out.rows.len() < max {
            match rx.try_recv() {
                Ok(h) if h.fresh_until > now => out.rows.push(h.row),
                Ok(h) => {
                    out.stale += 1;
                    if let Some(epoch) = h.row.relay_epoch {
                        self.freeze_epoch(epoch);
                    }
                }
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        out
    }

    /// Called by the relay when it dropped an event of `epoch` without publishing it: the
    /// epoch's watermark must not pass that event, so no later batch joins the epoch.
    /// Earlier epochs are done with and freeze with it.
    pub fn freeze_epoch(&self, epoch: i64) {
        self.handoff.frozen.fetch_max(epoch, Ordering::SeqCst);
    }

    /// Whether the relay stopped advancing `epoch` ([`CompletionBatcher::freeze_epoch`]).
    pub fn is_frozen(&self, epoch: i64) -> bool {
        epoch <= self.handoff.frozen.load(Ordering::SeqCst)
    }

    /// The epoch the next held batch inserts into, if the batcher has one: the only epoch the
    /// relay keeps alive while idle. An epoch the batcher left (an event it could not hand over,
    /// a commit whose reply was lost) must be retired, so its events reach any relay.
    pub fn current_epoch(&self) -> Option<i64> {
        *lock(&self.handoff.epoch)
    }

    /// Whether handed events are waiting for the relay.
    pub fn handed_waiting(&self) -> bool {
        let rx = lock(&self.handoff.rx);
        !rx.is_empty()
    }
}

/// One group commit. While a relay is attached, the batch's events are inserted claimed by
/// this worker and handed to the relay after the commit.
async fn complete_batch(
    ledger: Ledger,
    worker_id: String,
    handoff: Arc<Handoff>,
    batch: Vec<Request>,
) {
    let (completions, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
    // Taken before the transaction begins: the freshness limit below is conservative.
    let started = Instant::now();
    let held = handoff.attached.load(Ordering::SeqCst);
    let recorded: Vec<_> = completions.iter().filter_map(|c| c.trace.clone()).collect();
    let span = crate::telemetry::spans::ledger_batch("complete", completions.len(), &recorded);
    let done = async {
        if held {
            let frozen = handoff.frozen.load(Ordering::SeqCst);
            let epoch = (*lock(&handoff.epoch)).filter(|e| *e > frozen);
            ledger.complete_held(&worker_id, &completions, epoch).await
        } else {
            Completed {
                results: ledger.complete(&worker_id, &completions).await,
                ..Completed::default()
            }
        }
    }
    .instrument(span)
    .await;
    // `complete_held` returns after the commit: the relay never sees an uncommitted row.
    // Half the hold is the margin: a row the relay reaches later than that is left to the
    // database path, which takes it once its epoch is retired (another relay may by then).
    let fresh_until = started + handoff.hold / 2;
    let handed = !done.events.is_empty();
    let mut next_epoch = done.epoch;
    for row in done.events {
        match handoff.tx.try_send(Handed { row, fresh_until }) {
            Ok(()) => {}
            // Full (the relay is stalled) or gone: the row stays claimed in its epoch, which
            // no later batch joins, so its watermark never passes the row. The epoch is retired
            // after the hold and the row published by the database path.
            Err(TrySendError::Full(_) | TrySendError::Closed(_)) => {
                next_epoch = None;
                break;
            }
        }
    }
    if held {
        *lock(&handoff.epoch) = next_epoch;
    }
    // Held events were handed (or wait for their epoch's retirement); unheld ones are in the
    // outbox for any relay. Only those two cases have something to publish: a wake without
    // them costs the relay an empty claim statement.
    if handed || !held {
        handoff.wake.notify_one();
    }
    for ((reply, result), completion) in replies.into_iter().zip(done.results).zip(completions) {
        let _ = reply.send((result, Some(completion)));
    }
}
