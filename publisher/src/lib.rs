//! Publisher side of the intent worker: publish intents with publisher confirms (directly or
//! through a transactional outbox in the agent's own database), wait for one action's answer,
//! and follow result events.
//!
//! An agent sends an intent keyed by `(tenant, action_id)` to the intents exchange
//! (routing key = tenant, persistent, `message_id = "<tenant>:<action_id>"`, `user_id` = the
//! connection's user). Every publish is `mandatory` and awaits its confirm, so `Ok` means the
//! broker routed and accepted it; an unroutable or nacked message is an error. The publisher
//! never changes the action key: sending the same action again is the caller's decision, under
//! the same key, and the worker's inbox deduplicates it. Results come back on the results
//! exchange under `<tenant>.@.<reply_to>` (or `<tenant>` without `reply_to`).
//!
//! An agent built on this library's public API, as an example: `examples/demo-agent` (the demo
//! agent of docker compose and `scripts/demo.sh`).
//!
//! # Layout
//! - `publish.rs` ([`publish`]): [`Publisher`]: connect in confirm mode, `publish`,
//!   `publish_encoded`, pipelined `publish_batch` (each with a `*_with` form taking
//!   [`PublishOptions`]), `publish_raw`; `compensate` and [`compensating`] (an intent that undoes
//!   a succeeded action); tenant proof (`user_id`).
//! - `trace.rs` ([`trace`]): the W3C trace context every intent carries (`traceparent` and
//!   `tracestate` headers): the caller's, else the current one (feature `otel`); the
//!   `publish intents` producer span; reading and counting a received context (the
//!   `intent_publisher_trace_context_invalid_total` counter).
//! - `wait.rs` ([`wait`]): `Publisher::send_and_wait` on a queue bound to the agent's own
//!   routing key, [`StatusApi`] fallback, [`Answer`], [`WaitError`].
//! - `outbox.rs` ([`outbox`]): the agent-side `intent_outbox` table (`migrations/`) and
//!   [`Outbox::enqueue`] in the caller's transaction (with the intent's trace context).
//! - `relay.rs` ([`relay`]): [`Relay`]: claim due outbox rows, publish (each with its row's
//!   trace context), settle, sweep; the counters of the rows it publishes, fails and sweeps.
//! - `metrics.rs` ([`metrics`]): the recorder and `/metrics` listener of the relay and the MCP
//!   gateway (the outbox gauges, measured on every scrape; every series pre-registered at 0).
//! - `follow.rs` ([`follow`]): [`Follower`]: a results queue bound to the tenant (or to given
//!   keys), `next` with a timeout.
//! - `topology.rs` ([`topology`]): the only declarations this side makes (results
//!   exchange and queue; the intents exchange for tests and the demo).
//! - `tls.rs` ([`tls`]): the process's TLS trust (system roots + `PUBLISHER_CA_FILE`) and
//!   the connect helpers every broker, database and HTTP client here goes through.
//! - `error.rs` ([`error`]): [`PublishError`].
//! - `cli.rs` ([`cli`]): the `publisher` command line (`send [--wait]`, `wait`, `follow`,
//!   `migrate`, `relay`, `mcp`) and its exit codes; `main.rs` only sets up logging, parses
//!   arguments and calls [`cli::run`].
//! - `mcp/` ([`mcp`]): `publisher mcp`, the MCP gateway (tools file, bearer token → tenant,
//!   action id and trace context from the request `_meta`, answers and tasks from the ledger).
//!
//! # Features
//! - `cli` (default): the `publisher` binary, with span export over OTLP (`OTEL_*` variables).
//! - `otel` (default, implied by `cli`): the current `tracing`/OpenTelemetry context on every
//!   publish and a producer span around it. Off with `default-features = false`, where only a
//!   context passed explicitly ([`PublishOptions::with_trace`]) is sent.

#[cfg(feature = "cli")]
pub mod cli;
pub mod error;
pub mod follow;
#[cfg(feature = "cli")]
pub mod mcp;
pub mod metrics;
pub mod outbox;
pub mod publish;
pub mod relay;
pub mod tls;
pub mod topology;
pub mod trace;
pub mod wait;

/// A Postgres URL with several hosts and the primary among them (the agent database's pool:
/// [`pg::pool`], then [`Relay::following`]).
pub use kit::pg;

pub use error::PublishError;
pub use follow::Follower;
pub use outbox::{Outbox, OutboxError};
pub use protocol::trace::{TraceContext, TraceParent};
pub use publish::{action_key, compensating, PublishOptions, Publisher, Traced};
pub use relay::{Relay, RelayConfig};
pub use wait::{Answer, AnswerConfig, StatusApi, Until, WaitError};
