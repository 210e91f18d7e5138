//! Graceful shutdown, mini-redis style: one trigger, many listeners. On SIGTERM or Ctrl-C the
//! consumer stops taking deliveries (unacked ones go back to the broker), in-flight dispatches
//! get a grace period to record their outcomes, the relay publishes what was committed, and the
//! process exits. Anything still running after the grace period is covered by its lease: the
//! next scheduler treats it as `unknown`, never as not sent.

use tokio::sync::watch;

/// Fires the shutdown.
#[derive(Clone)]
pub struct Trigger(watch::Sender<bool>);

/// Listens for the shutdown; cheap to clone.
#[derive(Clone)]
pub struct CancelToken(watch::Receiver<bool>);

/// A new trigger and its token.
pub fn channel() -> (Trigger, CancelToken) {
    let (tx, rx) = watch::channel(false);
    (Trigger(tx), CancelToken(rx))
}

impl Trigger {
    pub fn fire(&self) {
        let _ = self.0.send(true);
    }

    pub fn token(&self) -> CancelToken {
        CancelToken(self.0.subscribe())
    }
}

impl CancelToken {
    /// Resolves once shutdown has been triggered (immediately if it already was).
    pub async fn cancelled(&self) {
        let mut rx = self.0.clone();
        let _ = rx.wait_for(|fired| *fired).await;
    }

    pub fn is_cancelled(&self) -> bool {
        *self.0.borrow()
    }
}

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
