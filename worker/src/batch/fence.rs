//! The send-fence batcher: the fence of a first dispatch or retry ([`Ledger::fence_send`]) is
//! checked together with the fences requested at the same time, in one statement, each row
//! against its own predicate. The request leaves right after the answer, so the time between
//! the check and the send stays that of one statement, well inside the lease. The intake's
//! claims are registered as they are handed to their dispatch tasks
//! ([`FenceBatcher::expect`]), so one intake batch's sends are fenced together
//! ([`super::Expected`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tracing::Instrument as _;

use super::{run_batches, Expected, OnItsWay, Tasks};
use crate::ledger::{Ledger, Passed, SendFence};

/// Largest number of sends fenced by one statement.
const FENCE_BATCH: usize = 256;

/// A batched send fence that could not be checked (the statement failed for the whole batch).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct FenceError(String);

/// A fence, the context of the send it guards (for the batch span's links) and the reply.
type Request = (
    SendFence,
    Option<protocol::trace::TraceContext>,
    oneshot::Sender<Result<Option<Passed>, FenceError>>,
);

/// The handle callers use; the batching task runs on [`Tasks`].
pub struct FenceBatcher {
    ledger: Ledger,
    worker_id: String,
    lease: Duration,
    tx: mpsc::Sender<Request>,
    expected: Arc<Expected>,
}

impl FenceBatcher {
    /// Starts the batcher on `tasks`.
    pub fn spawn(ledger: Ledger, worker_id: String, lease: Duration, tasks: &Tasks) -> Self {
        let (tx, rx) = mpsc::channel(FENCE_BATCH * 4);
        let (l, w) = (ledger.clone(), worker_id.clone());
        let expected = Arc::new(Expected::default());
        tasks.tracker.spawn(run_batches(
            rx,
            FENCE_BATCH,
            Some(expected.clone()),
            tasks.stop.clone(),
            move |batch| fence_batch(l.clone(), w.clone(), lease, batch),
        ));
        FenceBatcher {
            ledger,
            worker_id,
            lease,
            tx,
            expected,
        }
    }

    /// Registers a send on its way to [`FenceBatcher::fence_send`]: a batch that begins before
    /// it asks waits for it (briefly). Taken by a dispatch task that holds its slot and will
    /// ask at once; dropped when it asks or gives up.
    pub fn expect(&self) -> OnItsWay {
        self.expected.one()
    }

    /// Whether `send` may leave (and the deadline it carries): batched with the fences
    /// requested meanwhile, or alone once the batcher has stopped (shutdown). `trace` is the
    /// context of the send's span, linked from the batch's span; `expected` its registration
    /// ([`FenceBatcher::expect`]), if it has one, given up once the request is queued.
    pub async fn fence_send(
        &self,
        send: SendFence,
        trace: Option<protocol::trace::TraceContext>,
        expected: Option<OnItsWay>,
    ) -> Result<Option<Passed>, FenceError> {
        let (tx, rx) = oneshot::channel();
        let queued = self.tx.send((send, trace, tx)).await;
        drop(expected);
        if queued.is_err() {
            // Boxed for the same reason as the completion batcher's own statement.
            return Box::pin(self.ledger.fence_send(send, &self.worker_id, self.lease))
                .await
                .map_err(|e| {
                    self.ledger.observe(&e);
                    FenceError(e.to_string())
                });
        }
        rx.await
            .unwrap_or_else(|_| Err(FenceError("fence batcher stopped".into())))
    }
}

/// One group fence: every row checked against its own predicate in one statement.
async fn fence_batch(ledger: Ledger, worker_id: String, lease: Duration, batch: Vec<Request>) {
    let mut sends = Vec::with_capacity(batch.len());
    let mut traces = Vec::new();
    let mut replies = Vec::with_capacity(batch.len());
    for (send, trace, reply) in batch {
        sends.push(send);
        traces.extend(trace);
        replies.push(reply);
    }
    let span = crate::telemetry::spans::ledger_batch("fence", sends.len(), &traces);
    match ledger
        .fence_sends(&sends, &worker_id, lease)
        .instrument(span)
        .await
    {
        Ok(passed) => {
            for (reply, ok) in replies.into_iter().zip(passed) {
                let _ = reply.send(Ok(ok));
            }
        }
        Err(e) => {
            ledger.observe(&e);
            let e = FenceError(e.to_string());
            for reply in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}
