//! Running several futures at once on the current task, answers in order.

use std::future::Future;
use std::task::Poll;

/// Runs every future at once on this task and answers their outputs in the order given. Each is
/// first polled in that order, so work a future starts on its first poll (an AMQP publish queues
/// its frames and takes its confirm tag) starts in that order too; a finished future is not
/// polled again.
pub async fn in_order<F: Future>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut pending: Vec<_> = futures.into_iter().map(|f| Some(Box::pin(f))).collect();
    let mut outputs: Vec<Option<F::Output>> = pending.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut all_done = true;
        for (slot, output) in pending.iter_mut().zip(outputs.iter_mut()) {
            if let Some(future) = slot {
                match future.as_mut().poll(cx) {
                    Poll::Ready(v) => {
                        *output = Some(v);
                        *slot = None;
                    }
                    Poll::Pending => all_done = false,
                }
            }
        }
        if all_done {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    outputs
        .into_iter()
        .map(|o| o.expect("every future is ready"))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::in_order;

    /// Each future logs its first poll, then finishes after `waits` more wake-ups and answers
    /// how many had started by then: all start before the slowest finishes (they are in flight
    /// together), the first polls come in the order given, and the answers come in the order
    /// given whatever order they finish in.
    #[tokio::test]
    async fn every_future_starts_at_once_in_order_and_answers_in_order() {
        let started = Mutex::new(Vec::new());
        let futures = [3usize, 0, 1].into_iter().enumerate().map(|(i, waits)| {
            let started = &started;
            async move {
                started.lock().unwrap().push(i);
                for _ in 0..waits {
                    tokio::task::yield_now().await;
                }
                (i, started.lock().unwrap().len())
            }
        });
        assert_eq!(in_order(futures).await, vec![(0, 3), (1, 2), (2, 3)]);
        assert_eq!(*started.lock().unwrap(), vec![0, 1, 2]);
    }

    #[tokio::test]
    async fn no_futures_no_outputs() {
        let none = std::iter::empty::<std::future::Ready<u8>>();
        assert!(in_order(none).await.is_empty());
    }
}
