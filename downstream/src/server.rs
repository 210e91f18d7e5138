//! The accept loop: one task per connection, one request per connection.
//!
//! It also owns the start-up announcement that test harnesses parse
//! (`reference-downstream listening on <ip:port>`, the only line ever written
//! to stdout) and the shutdown on SIGTERM / ctrl-c, which stops accepting and
//! gives in-flight requests a short grace period.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::http::{self, ReadError, Response};
use crate::routes::{self, App, Reply};

/// A client that has not sent its whole request by then is dropped.
const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long in-flight requests may finish after a shutdown signal.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

pub async fn serve(app: Arc<App>, addr: std::net::SocketAddr) -> Result<()> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding DOWNSTREAM_ADDR {addr}"))?;
    let local = listener.local_addr()?;
    let shutdown = shutdown_signal()?;
    announce(local)?;
    tracing::info!(%local, "accepting connections");

    let mut tasks = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let app = app.clone();
                    tasks.spawn(async move {
                        if let Err(err) = connection(&app, stream).await {
                            tracing::debug!(%peer, error = %err, "connection ended with an error");
                        }
                    });
                }
                // Typically EMFILE; back off briefly instead of spinning.
                Err(err) => {
                    tracing::warn!(error = %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
        // Reap finished connection tasks so the set does not grow unbounded.
        while tasks.try_join_next().is_some() {}
    }

    while tasks.try_join_next().is_some() {}
    tracing::info!(in_flight = tasks.len(), "shutting down");
    drop(listener);
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tasks.abort_all();
    }
    app.store.close().await;
    Ok(())
}

/// The one stdout line tests wait for; flushed because stdout is a pipe there.
fn announce(local: std::net::SocketAddr) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "reference-downstream listening on {local}")?;
    out.flush()?;
    Ok(())
}

async fn connection(app: &App, mut stream: TcpStream) -> std::io::Result<()> {
    let (request, too_large) =
        match tokio::time::timeout(READ_TIMEOUT, http::read_request(&mut stream)).await {
            Err(_) | Ok(Err(ReadError::Gone)) => return Ok(()),
            Ok(Err(ReadError::Bad(status, code))) => {
                return http::write_response(&mut stream, &Response::error(status, code)).await;
            }
            Ok(Err(ReadError::TooLarge(head))) => (head, true),
            Ok(Ok(request)) => (request, false),
        };
    match routes::handle(app, request, too_large).await {
        Reply::Drop => {
            http::reset(stream);
            Ok(())
        }
        Reply::Respond(response) => {
            http::write_response(&mut stream, &response).await?;
            if too_large {
                http::drain(&mut stream).await;
            }
            Ok(())
        }
        Reply::Logged {
            response,
            request_id,
        } => {
            // A client that hung up first (it timed out, or its process died) never reads the
            // answer, although the write below may still succeed into the closed socket.
            let gone = peer_gone(&stream);
            http::write_response(&mut stream, &response).await?;
            // The moment it was written, not when the update below runs.
            let written = std::time::SystemTime::now();
            if !gone {
                if let Err(err) = app.store.set_replied(request_id, written).await {
                    tracing::warn!(error = %err, request_id, "could not record the delivered answer");
                }
            }
            if too_large {
                http::drain(&mut stream).await;
            }
            Ok(())
        }
    }
}

/// Whether the client has closed its side or reset the connection, without waiting: a
/// request is one whole read and the client sends nothing after it, so anything readable
/// now is its end of stream (or, if bytes, a client still there).
fn peer_gone(stream: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    let mut buf = tokio::io::ReadBuf::new(&mut byte);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match stream.poll_peek(&mut cx, &mut buf) {
        std::task::Poll::Pending => false,
        std::task::Poll::Ready(Ok(n)) => n == 0,
        std::task::Poll::Ready(Err(_)) => true,
    }
}

/// Install the signal handlers now (before the start-up line is printed, so a
/// harness that signals right after reading it cannot kill us uncleanly) and
/// return a future that resolves on the first SIGTERM or SIGINT/ctrl-c.
#[cfg(unix)]
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
        }
    })
}

#[cfg(not(unix))]
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}
