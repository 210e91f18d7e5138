//! The intent worker: a RabbitMQ consumer that records each agent intent in a Postgres ledger
//! before any network call, dispatches each logical action at most once, recovers uncertain
//! outcomes only in the ways the downstream supports, and tells the agent the truth.
//!
//! # Layout
//! - [`config`]: settings from the environment and the per-tool TOML file.
//! - [`ledger`]: the only writer of the operations table: admit (inbox), claim, complete,
//!   result outbox, queries. Every transition is one conditional statement.
//! - [`adapter`]: the `ToolAdapter` trait, outcome classification, the HTTP adapter.
//! - [`intake`]: one consumer step for a batch, in stages — decode, prove the tenant, look up
//!   the inbox, answer or claim.
//! - [`dispatch`]: sending a claimed operation and recording what happened.
//! - [`recovery`]: the pure recovery decision and the scheduler that runs it.
//! - [`retry`]: retry delays and the shared retry budget.
//! - [`amqp`]: everything that talks to the broker: topology, consumer, result relay, link
//!   state; `app` reconnects each link when it is lost.
//! - [`ops`]: the operator and agent HTTP API.
//! - [`telemetry`]: logs, Prometheus metrics, `/livez` and `/readyz`, `worker probe`.
//! - [`tls`]: the one trust (system roots + `WORKER_CA_FILE`) every TLS client uses.
//! - [`fault`]: named stop points for crash tests (feature `fault-points`).
//! - [`app`]: wiring and graceful shutdown.

pub mod adapter;
pub mod amqp;
pub mod app;
pub mod config;
pub mod context;
pub mod dispatch;
pub mod fault;
pub mod intake;
pub mod ledger;
pub mod ops;
pub mod recovery;
pub mod retry;
pub mod shutdown;
pub mod telemetry;
pub mod tls;
