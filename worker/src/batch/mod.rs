//! The two group-commit batchers of the dispatch path, each a task with a handle:
//! [`fence`] (send fences, one statement per batch) and [`completion`] (outcomes, one commit
//! per batch, and the hand-off of the committed result events to this process's relay).
//!
//! Both follow one rule, and it lives here: a batcher has no timer. A request that finds it
//! idle runs at once, alone; requests that arrive while a statement is running wait for it and
//! then go together. So a lone intent never waits for a batch to fill, and a busy worker pays
//! one statement per batch.
//!
//! Each batcher runs on a [`TaskTracker`] until its [`CancellationToken`] is cancelled: then it
//! stops taking requests (callers fall back to a statement of their own), records what is
//! already queued and ends, so shutdown can await it.

pub mod completion;
pub mod fence;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The batchers' tasks and their stop signal.
#[derive(Clone, Default)]
pub struct Tasks {
    /// Where the batchers run; shutdown waits on it.
    pub tracker: TaskTracker,
    /// Cancelled when the batchers are to stop taking requests.
    pub stop: CancellationToken,
}

impl Tasks {
    /// Stops the batchers and waits until what they had queued is recorded.
    pub async fn stop(&self) {
        self.stop.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }
}

/// The batching loop both batchers share: takes whatever requests are waiting (up to `max`) and
/// hands them to `run` together; once `stop` is cancelled, closes the queue (new requests are
/// refused, so their callers go alone), runs what was queued and returns.
pub(crate) async fn run_batches<T, F, Fut>(
    mut rx: mpsc::Receiver<T>,
    max: usize,
    stop: CancellationToken,
    mut run: F,
) where
    F: FnMut(Vec<T>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut batch = Vec::with_capacity(max);
    loop {
        let n = tokio::select! {
            biased;
            n = rx.recv_many(&mut batch, max) => n,
            _ = stop.cancelled() => {
                rx.close();
                rx.recv_many(&mut batch, max).await
            }
        };
        if n == 0 {
            return;
        }
        run(std::mem::replace(&mut batch, Vec::with_capacity(max))).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// The batches the loop handed over, in order.
    type Seen = Arc<Mutex<Vec<Vec<u32>>>>;

    /// Runs the loop over a channel of numbers, recording each batch it hands over.
    fn start(max: usize) -> (mpsc::Sender<u32>, Tasks, Seen) {
        let (tx, rx) = mpsc::channel(16);
        let tasks = Tasks::default();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        tasks
            .tracker
            .spawn(run_batches(rx, max, tasks.stop.clone(), move |batch| {
                record.lock().unwrap().push(batch);
                std::future::ready(())
            }));
        (tx, tasks, seen)
    }

    #[tokio::test]
    async fn requests_waiting_together_go_together_up_to_the_batch_size() {
        let (tx, tasks, seen) = start(2);
        for n in 1..=5 {
            tx.send(n).await.unwrap();
        }
        tasks.stop().await;
        assert_eq!(*seen.lock().unwrap(), vec![vec![1, 2], vec![3, 4], vec![5]]);
    }

    #[tokio::test]
    async fn a_stopped_batcher_records_what_was_queued_and_refuses_the_rest() {
        let (tx, tasks, seen) = start(8);
        tx.send(1).await.unwrap();
        tx.send(2).await.unwrap();
        tasks.stop().await;
        assert_eq!(*seen.lock().unwrap(), vec![vec![1, 2]]);
        assert!(tx.send(3).await.is_err(), "the caller goes alone");
    }

    #[tokio::test]
    async fn a_batcher_whose_callers_are_gone_ends_by_itself() {
        let (tx, tasks, seen) = start(8);
        tx.send(1).await.unwrap();
        drop(tx);
        tasks.tracker.close();
        tasks.tracker.wait().await;
        assert_eq!(*seen.lock().unwrap(), vec![vec![1]]);
    }
}
