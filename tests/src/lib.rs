//! End-to-end test harness: each test gets a fresh Postgres database (shared by the worker's
//! ledger and the reference downstream's own schema), unique RabbitMQ names, and real child
//! processes (`worker` built with fault points, `reference-downstream`) that it can SIGKILL,
//! pause and restart. Counts come from the downstream's tables, never from logs.
//!
//! # Layout
//! - [`broker_user`]: second RabbitMQ users for tenant-proof tests, publishing as them.
//! - [`console`]: signing in to the operator console for a page or two.
//! - [`env`](mod@env): the per-test database, broker names and tools file.
//! - [`procs`]: worker and downstream child processes.
//! - [`agent`]: publishing intents and reading result events as an agent would.
//! - [`cluster_agent`]: an agent's results queue and reader that survive any node of a cluster.
//! - [`bench`](mod@bench): what the benchmarks share: publishing with confirms, a null downstream, CPU
//!   per process group from `/proc`, what a run wrote.
//! - [`flags`]: command-line flags of the e2e binaries.
//! - [`mcp_gateway`]: `publisher mcp` as a child process.
//! - [`otlp`]: an OTLP/HTTP trace receiver that keeps every span exported to it.
//! - [`proxy`]: a TCP fault proxy that cuts, black-holes or holds (then delivers) one link
//!   (broker, Postgres, a downstream).
//! - [`recording`]: a keep-alive downstream that records every request's head.
//! - [`soak`]: the seeded chaos soak (the `soak` binary and `tests/soak_short.rs`).
//! - [`wait`]: polling with deadlines.
//! - [`tls`]: a test CA, server certificates, a TLS-terminating forwarder, a Postgres cluster
//!   with TLS (tests/tls.rs).

pub mod agent;
pub mod bench;
pub mod broker_user;
pub mod cluster_agent;
pub mod console;
pub mod env;
pub mod flags;
pub mod mcp_gateway;
pub mod otlp;
pub mod pg_failover;
pub mod procs;
pub mod proxy;
pub mod rabbit_cluster;
pub mod recording;
pub mod soak;
pub mod sockets;
pub mod tls;
pub mod wait;

pub use agent::{cleanup, intent, Agent};
pub use broker_user::{publish_as, rabbitmqctl, BrokerUser};
pub use env::{async_tool, Env, Topology};
pub use mcp_gateway::McpGateway;
pub use otlp::OtlpReceiver;
pub use procs::{free_port, metric_value, Downstream, Worker, WorkerOptions};
pub use proxy::{host_port, via, FaultProxy};
pub use wait::wait_for;

/// An HTTP client builder for the tests. reqwest is built with TLS but without a crypto
/// provider of its own (worker/src/tls.rs), so the process's default (ring) is installed first.
pub fn http_builder() -> reqwest::ClientBuilder {
    worker::tls::install_default_provider();
    reqwest::Client::builder()
}

/// A default HTTP client for the tests (see [`http_builder`]).
pub fn http() -> reqwest::Client {
    http_builder().build().expect("HTTP client")
}
