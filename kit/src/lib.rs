//! What the worker and the publisher share at the process edge: the places where a process
//! meets clients it does not control and the operating system's limits. More of the shared edge
//! (TLS trust, signal handling) will move here later.
//!
//! # Layout
//! - [`http`]: the one HTTP/1 server every listener uses (worker metrics/health and admin API,
//!   publisher metrics and MCP gateway): header timeout, idle timeout, connection cap,
//!   graceful shutdown.
//! - [`fd`]: open-file descriptors: raising `RLIMIT_NOFILE` at start-up, checking it against
//!   what the process may need, and recognising an error caused by the process's own resource
//!   exhaustion (EMFILE, ENFILE, ENOBUFS, ENOMEM, EADDRNOTAVAIL).
//! - [`logs`]: the log subscriber, and the rule that no message payload (arguments,
//!   receipts) is ever logged, whatever `RUST_LOG` says.
//! - [`secret`]: comparing bearer tokens in constant time.
//! - [`url`]: service URLs as settings: redacted for logs, refused when they can never work.

pub mod fd;
pub mod http;
pub mod logs;
pub mod secret;
pub mod url;
