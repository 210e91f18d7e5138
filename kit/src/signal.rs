//! The stop signal of a long-running command: SIGTERM (Kubernetes, systemd, `docker stop`) or
//! Ctrl-C. What stops, and in which order, is each binary's own shutdown.

/// Resolves on SIGTERM or Ctrl-C.
pub async fn stop() {
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
