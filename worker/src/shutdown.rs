//! The stop signal of `worker run`: SIGTERM or Ctrl-C. What happens next is
//! [`crate::app::Application::run_until_stopped`]'s shutdown order; every task it started
//! listens on a `tokio_util` [`CancellationToken`](tokio_util::sync::CancellationToken) and is
//! awaited through a [`TaskTracker`](tokio_util::task::TaskTracker) or its join handle.

/// Resolves on SIGTERM or Ctrl-C.
pub async fn signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
