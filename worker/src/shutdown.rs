//! The stop signal of `worker run`: SIGTERM or Ctrl-C. What happens next is
//! [`crate::app::Application::run_until_stopped`]'s shutdown order; every task it started
//! listens on a `tokio_util` [`CancellationToken`](tokio_util::sync::CancellationToken) and is
//! awaited through a [`TaskTracker`](tokio_util::task::TaskTracker) or its join handle.

/// Resolves on SIGTERM or Ctrl-C ([`kit::signal::stop`]).
pub async fn signal() {
    kit::signal::stop().await
}
