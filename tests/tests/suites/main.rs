//! The end-to-end suites, one module per subject, in one test binary: built and linked once
//! rather than once per subject. Each test still runs in a process of its own under
//! `cargo nextest`; pick a subject with its module path, e.g.
//! `cargo nextest run -p e2e -E 'test(/^dedupe::/)'`.

mod absence_proof;
mod agent_side;
mod alert_metrics;
mod approvals;
mod bench_tools;
mod callbacks;
mod check_tool;
mod cluster_failover;
mod compensation;
mod config;
mod console;
mod crate_boundaries;
mod dedupe;
mod definitions;
mod demo_agent;
mod docs;
mod fenced_sends;
mod guessing;
mod honest_recovery;
mod hostile_keys;
mod hostile_values;
mod link_loss;
mod listeners;
mod long_running;
mod mcp_gateway;
mod mcp_origin;
mod migrate_job;
mod newcomer;
mod operations;
mod pg_failover;
mod pg_failover_fixture;
mod pgbouncer;
mod poll_schedule;
mod rabbit_cluster;
mod receipts_as_sent;
mod recovery_matrix;
mod recovery_scenarios;
mod relay_handoff;
mod retries;
mod shards;
mod shutdown;
mod soak_cluster;
mod soak_failover;
mod soak_short;
mod sockets;
mod tenant_proof;
mod tls;
mod tool_secrets;
mod trace_agent_side;
mod trace_worker_side;
mod young_ledger;
