//! The two group-commit batchers of the dispatch path, each a task with a handle:
//! [`fence`] (send fences, one statement per batch) and [`completion`] (outcomes, one commit
//! per batch, and the hand-off of the committed result events to this process's relay); and the
//! [`Pace`] the intake keeps under load.
//!
//! A batcher never waits for a batch to fill. A request that finds it idle runs at once, alone;
//! requests that arrive while a statement is running wait for it and then go together. So a
//! lone intent never waits, and a busy worker pays one statement per batch.
//!
//! Only the intake is paced: while it is saturated (its last batch was full, or deliveries were
//! already waiting when it ended) its batches start at least `WORKER_BATCH_PACE_MS` apart, so a
//! batch carries more intents: each statement, commit, wake-up and broker frame costs about the
//! same for a few as for many. The claims of one intake batch reach the send fence together, and
//! their outcomes the completion and the relay together, so the later stages batch as the intake
//! did without a timer of their own: pacing them as well held each intent up to a pace at every
//! stage (the latency at half the drain rate) for a little less Postgres time per intent.
//!
//! The send fence also gathers by [`Expected`]: the intake registers each claim it hands to a
//! dispatch task, and a fence batch that begins while registered sends have not yet asked waits
//! for them (a claim's task reaches the fence within microseconds: it already holds its slot),
//! so the claims of one intake batch are fenced by one statement, not by one for whichever task
//! ran first and another for the rest. A lone intent is the only one expected and goes at once.
//!
//! Each batcher runs on a [`TaskTracker`] until its [`CancellationToken`] is cancelled: then it
//! stops taking requests (callers fall back to a statement of their own), records what is
//! already queued and ends, so shutdown can await it.

pub mod completion;
pub mod fence;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;
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

/// The least time between the starts of two batches of the saturated intake
/// (`WORKER_BATCH_PACE_MS`). A stage is saturated when its last batch was full or work queued
/// while it ran ([`Pace::ended`]); then work that arrives sooner than the interval after the
/// last batch started waits out the rest of it, and whatever arrived meanwhile goes with it.
/// A stage that is not saturated goes at once, however recently its last batch started.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    every: Duration,
    last: Option<Instant>,
    saturated: bool,
}

impl Pace {
    /// A pace of `every` (zero: no pace).
    pub fn new(every: Duration) -> Self {
        Pace {
            every,
            last: None,
            saturated: false,
        }
    }

    /// Waits, when the stage is saturated, until the interval since the last batch's start has
    /// passed, or `stop` is cancelled; at once when it already has or the stage keeps up.
    /// Returns whether it waited.
    pub async fn wait(&self, stop: &CancellationToken) -> bool {
        if !self.saturated {
            return false;
        }
        let Some(due) = self.last.map(|last| last + self.every) else {
            return false;
        };
        if Instant::now() >= due {
            return false;
        }
        tokio::select! {
            biased;
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep_until(due) => {}
        }
        true
    }

    /// Marks the start of a batch.
    pub fn started(&mut self) {
        if !self.every.is_zero() {
            self.last = Some(Instant::now());
        }
    }

    /// Records how the last batch ended: `saturated` when it was full or more work was already
    /// waiting for the stage when it finished.
    pub fn ended(&mut self, saturated: bool) {
        self.saturated = saturated;
    }
}

/// The longest a batch waits for requests [`Expected`] to come: they are on their way within
/// microseconds unless the process is starved of CPU or paused, and then the batch goes without
/// them.
const GATHER_AT_MOST: Duration = Duration::from_millis(2);

/// Requests known to be on their way to a batcher: each registered with [`Expected::one`], the
/// count going down when its [`OnItsWay`] is dropped (once its request is queued, or when its
/// caller gave up before asking). A batch that begins while the count is above zero waits for
/// them, up to the batch's size and [`GATHER_AT_MOST`].
#[derive(Debug, Default)]
pub struct Expected {
    count: AtomicUsize,
    arrived: Notify,
}

impl Expected {
    /// Registers one request on its way.
    pub fn one(self: &Arc<Self>) -> OnItsWay {
        self.count.fetch_add(1, Ordering::SeqCst);
        OnItsWay(self.clone())
    }
}

/// A request registered with [`Expected::one`]: dropped once it is queued (or will never be).
#[derive(Debug)]
pub struct OnItsWay(Arc<Expected>);

impl Drop for OnItsWay {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::SeqCst);
        self.0.arrived.notify_one();
    }
}

/// The batching loop both batchers share: takes whatever requests are waiting (up to `max`),
/// and those `expected` to come, and hands them to `run` together; once `stop` is cancelled,
/// closes the queue (new requests are refused, so their callers go alone), runs what was queued
/// and returns.
pub(crate) async fn run_batches<T, F, Fut>(
    mut rx: mpsc::Receiver<T>,
    max: usize,
    expected: Option<Arc<Expected>>,
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
        if let Some(expected) = &expected {
            gather(&mut rx, &mut batch, max, expected, &stop).await;
        }
        run(std::mem::replace(&mut batch, Vec::with_capacity(max))).await;
    }
}

/// Adds to `batch` the requests `expected` to come, as they are queued, until none is on its
/// way, the batch is full, [`GATHER_AT_MOST`] has passed or `stop` is cancelled.
async fn gather<T>(
    rx: &mut mpsc::Receiver<T>,
    batch: &mut Vec<T>,
    max: usize,
    expected: &Expected,
    stop: &CancellationToken,
) {
    let until = Instant::now() + GATHER_AT_MOST;
    while batch.len() < max {
        let arrived = expected.arrived.notified();
        tokio::pin!(arrived);
        arrived.as_mut().enable();
        // Read before taking what is queued: a request is queued before its count goes down,
        // so at zero every one of them is in the channel by now.
        let coming = expected.count.load(Ordering::SeqCst);
        while batch.len() < max {
            match rx.try_recv() {
                Ok(request) => batch.push(request),
                Err(_) => break,
            }
        }
        if coming == 0 || batch.len() >= max {
            return;
        }
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = &mut arrived => {}
            _ = tokio::time::sleep_until(until) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// The batches the loop handed over, in order, each with when it was handed over.
    type Seen = Arc<Mutex<Vec<(Instant, Vec<u32>)>>>;

    /// Runs the loop over a channel of numbers, recording each batch it hands over.
    fn start(max: usize) -> (mpsc::Sender<u32>, Tasks, Seen) {
        start_taking(max, Duration::ZERO)
    }

    /// [`start`], each batch taking `takes` to run (a statement's time).
    fn start_taking(max: usize, takes: Duration) -> (mpsc::Sender<u32>, Tasks, Seen) {
        start_with(max, takes, None)
    }

    /// [`start`] with requests registered as expected.
    fn start_expecting(max: usize) -> (mpsc::Sender<u32>, Tasks, Seen, Arc<Expected>) {
        let expected = Arc::new(Expected::default());
        let (tx, tasks, seen) = start_with(max, Duration::ZERO, Some(expected.clone()));
        (tx, tasks, seen, expected)
    }

    /// The loop over a channel of numbers, recording each batch it hands over; each batch takes
    /// `takes` (none: it ends at once, without a timer).
    fn start_with(
        max: usize,
        takes: Duration,
        expected: Option<Arc<Expected>>,
    ) -> (mpsc::Sender<u32>, Tasks, Seen) {
        let (tx, rx) = mpsc::channel(16);
        let tasks = Tasks::default();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        tasks.tracker.spawn(run_batches(
            rx,
            max,
            expected,
            tasks.stop.clone(),
            move |batch| {
                record.lock().unwrap().push((Instant::now(), batch));
                async move {
                    if !takes.is_zero() {
                        tokio::time::sleep(takes).await;
                    }
                }
            },
        ));
        (tx, tasks, seen)
    }

    /// Lets the batcher's task run until it waits (the tests run on one thread).
    async fn let_run() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_batch_waits_for_the_requests_expected_and_goes_when_none_is_left() {
        let (tx, tasks, seen, expected) = start_expecting(8);
        let (first, second, third) = (expected.one(), expected.one(), expected.one());
        tx.send(1).await.unwrap();
        drop(first);
        let_run().await;
        assert!(batches(&seen).is_empty(), "two more are on their way");
        tx.send(2).await.unwrap();
        drop(second);
        let_run().await;
        // The third gave up without asking: nothing is left to wait for.
        drop(third);
        let_run().await;
        assert_eq!(batches(&seen), vec![vec![1, 2]]);
        // A lone request, nothing expected: at once.
        let lone = expected.one();
        tx.send(3).await.unwrap();
        drop(lone);
        let_run().await;
        assert_eq!(batches(&seen), vec![vec![1, 2], vec![3]]);
        tasks.stop().await;
    }

    #[tokio::test]
    async fn a_batch_goes_without_an_expected_request_that_does_not_come() {
        let (tx, tasks, seen, expected) = start_expecting(8);
        let _stuck = expected.one();
        let started = Instant::now();
        tx.send(1).await.unwrap();
        while batches(&seen).is_empty() {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "the batch never went"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(batches(&seen), vec![vec![1]]);
        tasks.stop().await;
    }

    fn batches(seen: &Seen) -> Vec<Vec<u32>> {
        seen.lock()
            .unwrap()
            .iter()
            .map(|(_, b)| b.clone())
            .collect()
    }

    #[tokio::test]
    async fn requests_waiting_together_go_together_up_to_the_batch_size() {
        let (tx, tasks, seen) = start(2);
        for n in 1..=5 {
            tx.send(n).await.unwrap();
        }
        tasks.stop().await;
        assert_eq!(batches(&seen), vec![vec![1, 2], vec![3, 4], vec![5]]);
    }

    #[tokio::test]
    async fn a_stopped_batcher_records_what_was_queued_and_refuses_the_rest() {
        let (tx, tasks, seen) = start(8);
        tx.send(1).await.unwrap();
        tx.send(2).await.unwrap();
        tasks.stop().await;
        assert_eq!(batches(&seen), vec![vec![1, 2]]);
        assert!(tx.send(3).await.is_err(), "the caller goes alone");
    }

    #[tokio::test]
    async fn a_batcher_whose_callers_are_gone_ends_by_itself() {
        let (tx, tasks, seen) = start(8);
        tx.send(1).await.unwrap();
        drop(tx);
        tasks.tracker.close();
        tasks.tracker.wait().await;
        assert_eq!(batches(&seen), vec![vec![1]]);
    }

    #[tokio::test]
    async fn a_lone_request_goes_at_once_and_what_queued_meanwhile_goes_right_after() {
        // Each batch takes 100 ms: requests that arrive meanwhile wait for it, no longer.
        let (tx, tasks, seen) = start_taking(8, Duration::from_millis(100));
        let ms = |n| tokio::time::sleep(Duration::from_millis(n));
        let first = Instant::now();
        tx.send(1).await.unwrap();
        ms(20).await;
        tx.send(2).await.unwrap();
        ms(20).await;
        tx.send(3).await.unwrap();
        ms(300).await;
        tasks.stop().await;
        let seen = seen.lock().unwrap().clone();
        let got: Vec<_> = seen.iter().map(|(_, b)| b.clone()).collect();
        assert_eq!(got, vec![vec![1], vec![2, 3]]);
        let (lone, apart) = (seen[0].0 - first, seen[1].0 - seen[0].0);
        assert!(
            lone < Duration::from_millis(50),
            "a lone request goes at once: {lone:?}"
        );
        assert!(
            apart < Duration::from_millis(200),
            "the queued requests go when the batch before them ends: {apart:?} apart"
        );
    }

    /// A pace whose last batch started now and ended `saturated`.
    fn after_a_batch(every: Duration, saturated: bool) -> Pace {
        let mut pace = Pace::new(every);
        pace.started();
        pace.ended(saturated);
        pace
    }

    #[tokio::test]
    async fn a_stage_that_keeps_up_never_waits_on_the_pace() {
        let pace = after_a_batch(Duration::from_millis(300), false);
        let started = Instant::now();
        assert!(!pace.wait(&CancellationToken::new()).await);
        assert!(started.elapsed() < Duration::from_millis(50));
        // No pace at all, saturated or not.
        let none = after_a_batch(Duration::ZERO, true);
        assert!(!none.wait(&CancellationToken::new()).await);
    }

    #[tokio::test]
    async fn a_saturated_stage_waits_out_the_pace_from_the_start_of_its_last_batch() {
        let started = Instant::now();
        let pace = after_a_batch(Duration::from_millis(300), true);
        assert!(pace.wait(&CancellationToken::new()).await);
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(290) && waited < Duration::from_millis(1000),
            "work queued while a batch ran waits out the pace: {waited:?}"
        );
        // A batch that took longer than the pace (a backlog's) is followed at once.
        let mut long = Pace::new(Duration::from_millis(100));
        long.started();
        tokio::time::sleep(Duration::from_millis(150)).await;
        long.ended(true);
        let after = Instant::now();
        assert!(!long.wait(&CancellationToken::new()).await);
        assert!(after.elapsed() < Duration::from_millis(50));
    }

    #[tokio::test]
    async fn a_stop_ends_the_wait_for_the_pace() {
        let started = Instant::now();
        let pace = after_a_batch(Duration::from_secs(120), true);
        let stop = CancellationToken::new();
        let cancel = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            cancel.cancel();
        });
        assert!(pace.wait(&stop).await);
        assert!(started.elapsed() < Duration::from_secs(60));
    }
}
