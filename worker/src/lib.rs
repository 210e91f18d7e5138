//! The intent worker: a RabbitMQ consumer that records each agent intent in a Postgres ledger
//! before any network call, dispatches each logical action at most once, recovers uncertain
//! outcomes only in the ways the downstream supports, and tells the agent the truth.
//!
//! # Layout
//! - [`config`]: what start-up reads, one subject per module: environment settings, the tools
//!   file, `${VAR}` interpolation, tenant auth (the tokens and the `[auth]` section).
//! - [`ledger`]: the only writer of the operations table: admit (inbox), claim, complete,
//!   result outbox, queries; its start-up (connect, pooler probe, migrations). Every transition
//!   is one conditional statement.
//! - [`answers`]: every agent-facing answer: result-event shapes, their texts and reason codes,
//!   the dead-letter reasons (metric labels derive from them).
//! - [`document`]: a downstream's JSON document (a receipt, an acceptance) kept exactly as
//!   sent, with its parsed value.
//! - [`outcome`]: what one downstream call established ([`outcome::Outcome`]): the vocabulary
//!   the adapters classify into, the retry policy prices and dispatch maps to a next state.
//! - [`adapter`]: the `ToolAdapter` trait, outcome classification, the HTTP adapter and its
//!   client (`client`: connections, timeouts, proxies), receipt checks, and every downstream
//!   call timed and counted (`meters`).
//! - [`intake`]: one consumer step for a batch, in stages — decode, prove the tenant
//!   ([`intake::TenantAuth`]), look up the inbox, answer or claim.
//! - [`dispatch`]: sending a claimed operation and recording what happened; `next_state`, the
//!   pure rule tables from an outcome to the next state.
//! - [`batch`]: the two group-commit batchers (send fences, completions and their hand-off to
//!   the relay), tasks with handles, and the [`batch::Pace`] the intake keeps under load.
//! - [`context`]: what the consumer, dispatcher and scheduler share (ledger, tools, batchers,
//!   the in-flight bound and its tasks, wake-ups).
//! - [`recovery`]: the tool's recovery capability, the pure recovery decision and the scheduler
//!   that runs it.
//! - [`retry`]: retry and budget policies, retry delays and the shared retry budget.
//! - [`amqp`]: everything that talks to the broker: topology, consumer, result relay, link
//!   state.
//! - [`ops`]: the operator and agent HTTP API, `worker ops`, bulk jobs, dead-letter handling,
//!   retention, `worker check-tool`.
//! - [`console`]: the operator console, server-rendered pages under `/ui` on the admin
//!   listener (sessions, filters, pages), acting only through [`ops`].
//! - [`telemetry`]: logs, Prometheus metrics (the exporter, every series described and
//!   pre-registered; a lower layer keeps the names it records, as the ledger does), `/livez`
//!   and `/readyz`, `worker probe`.
//! - [`tls`]: the one trust (system roots + `WORKER_CA_FILE`) every TLS client uses.
//! - [`fault`]: named stop points for crash tests (feature `fault-points`).
//! - [`app`]: start-up ([`app::Application::build`]), the link supervisor that reconnects the
//!   consumer and the relay, and graceful shutdown ([`app::Application::run_until_stopped`]).
//! - [`shutdown`]: the stop signal (SIGTERM, Ctrl-C).

pub mod adapter;
pub mod amqp;
pub mod answers;
pub mod app;
pub mod batch;
pub mod config;
pub mod console;
pub mod context;
pub mod dispatch;
pub mod document;
pub mod fault;
pub mod intake;
pub mod ledger;
pub mod ops;
pub mod outcome;
pub mod recovery;
pub mod retry;
pub mod shutdown;
pub mod telemetry;
pub mod tls;

pub(crate) use kit::lock;
