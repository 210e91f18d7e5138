//! What the worker and the publisher share at the process edge: the places where a process
//! meets clients it does not control, the operating system and its operators. The wire
//! contract stays in `protocol`, which depends on nothing of this.
//!
//! The feature `server` (on by default) adds what only a long-running binary needs: `http`,
//! `metrics` and `logs`; a library linked into an agent (the publisher's) goes without. The
//! feature `pg` adds [`pg`], for the processes that write to Postgres.
//!
//! # Layout
//! - [`tls`]: the one TLS trust (system roots plus an extra PEM bundle, one crypto provider) and
//!   the plain-words reason for a refused certificate.
//! - [`http`]: the one HTTP/1 server every listener uses (worker metrics/health and admin API,
//!   publisher metrics and MCP gateway): header timeout, idle timeout, connection cap,
//!   graceful shutdown.
//! - [`metrics`]: the metrics listener (exporter upkeep, `GET /metrics`).
//! - [`fd`]: open-file descriptors: raising `RLIMIT_NOFILE` at start-up, checking it against
//!   what the process may need, and recognising an error caused by the process's own resource
//!   exhaustion (EMFILE, ENFILE, ENOBUFS, ENOMEM, EADDRNOTAVAIL).
//! - [`logs`]: the log subscriber, and the rule that no message payload (arguments,
//!   receipts) is ever logged, whatever `RUST_LOG` says.
//! - [`cli`] (feature `cli`): a blank environment variable counts as unset for clap.
//! - [`backoff`]: the one back-off function every retry and reconnect loop uses.
//! - [`errors`]: an error and its causes on one line, each cause once.
//! - [`signal`]: the stop signal (SIGTERM or Ctrl-C).
//! - [`join`]: several futures at once on the current task, first polled and answered in order.
//! - [`fault`]: how a fault point stops the process for a crash test.
//! - [`secret`]: comparing bearer tokens in constant time.
//! - [`guard`]: the failure budget of bearer tokens (per client and overall) and the least token
//!   length the processes accept.
//! - [`text`]: characters that change how text looks without being seen (bidirectional
//!   controls, zero-width and other default-ignorable characters), written out for display.
//! - [`url`]: service URLs as settings: redacted for logs, refused when they can never work.
//! - [`otel`] (feature `otel`): W3C trace context on `tracing` spans (parents, links, what to
//!   send onward); with `otel-export`, span export over OTLP/HTTP from the standard variables.
//! - [`amqp`] (feature `amqp`): a RabbitMQ connection whose whole handshake (TCP, TLS, AMQP)
//!   is bounded, so a node that accepts and never answers costs a time-out, not the caller.
//! - [`pg`] (feature `pg`): a Postgres URL with several hosts, the primary among them, and
//!   leaving a server that turned read-only or went away.
//! - [`schema`] (feature `pg`): migrations embedded in the binary and structs read from a row by
//!   column name, without sqlx's macros.
//! - [`lock`]: a mutex taken over from a thread that panicked while holding it.

#[cfg(feature = "amqp")]
pub mod amqp;
pub mod backoff;
#[cfg(feature = "cli")]
pub mod cli;
pub mod errors;
pub mod fault;
pub mod fd;
pub mod guard;
#[cfg(feature = "server")]
pub mod http;
pub mod join;
#[cfg(feature = "server")]
pub mod logs;
#[cfg(feature = "server")]
pub mod metrics;
#[cfg(feature = "otel")]
pub mod otel;
#[cfg(feature = "pg")]
pub mod pg;
#[cfg(feature = "pg")]
pub mod schema;
pub mod secret;
pub mod signal;
pub mod text;
pub mod tls;
pub mod url;

/// Locks `m`, taking the value over from a thread that panicked while holding it: every state
/// guarded this way (hand-off bookkeeping, watermarks, timestamps, a connect's sockets) stays
/// valid between writes, so a panic elsewhere must not take the process down with it.
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
