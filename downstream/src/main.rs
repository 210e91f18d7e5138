//! `reference-downstream`: a small but real business service for the intent
//! worker to call, with the three recovery capabilities of docs/design.md §5 and
//! injectable faults (§9).
//!
//! URL modes: `POST /replay/{resource}` (durable idempotency keys with receipt
//! replay), `POST /lookup/{resource}` (no dedupe, but
//! `GET /lookup/{resource}/by-key/{key}` finds the receipt) and
//! `POST /none/{resource}` (neither), plus async jobs: `POST /async/{resource}`
//! answers 202 with an operation id and `GET /async/operations/{id}` tells how the
//! job ended (`jobs.rs`). Five deliberately broken modes (`replay-new-receipt`,
//! `replay-ignores-body`, `replay-racy`, `lookup-phantom`, `lookup-ignores-deadline`)
//! each break one property a capability relies on. Faults are armed through
//! `POST /_control/faults`; they live in memory, while the data is durable in
//! Postgres, so a restart keeps the data and forgets the faults. See
//! README.md for the full contract.
//!
//! # Request deadlines
//!
//! A write may carry a deadline: the header named by `DOWNSTREAM_DEADLINE_HEADER`
//! (default `Request-Deadline`, case-insensitive), an absolute RFC 3339 time. It is
//! checked inside the write's transaction as the last statement before COMMIT, on the
//! database clock plus `DOWNSTREAM_CLOCK_OFFSET_MS` (signed ms, default 0):
//! `clock_timestamp() + offset > deadline` rolls the write back (no mutation, receipt,
//! key or job) and answers 422
//! `{"error":"deadline_passed","deadline":"<as received>","at":"<clock used, ms>"}`. A
//! malformed value is 400 `bad_deadline` (validation: no fault consumed). Only a write
//! that creates something is checked: a replay from a stored receipt is answered after
//! the deadline too. Lookups and status reads ignore the header, and so does the broken
//! mode `lookup-ignores-deadline`, whose late writes commit.
//!
//! # Counting, for tests
//!
//! Tests assert on the downstream's own tables, never on logs. With `<schema>`
//! the value of `DOWNSTREAM_SCHEMA` (default `downstream`):
//!
//! ```sql
//! -- business changes (e.g. refunds) made for one key
//! SELECT count(*) FROM <schema>.mutations WHERE idem_key = $1;
//! -- write requests received for one key (replays, dropped and faulted included)
//! SELECT count(*) FROM <schema>.requests WHERE kind = 'write' AND idem_key = $1;
//! -- lookups received for one key
//! SELECT count(*) FROM <schema>.requests WHERE kind = 'lookup' AND idem_key = $1;
//! -- the W3C trace context each send for one key carried (NULL: none)
//! SELECT traceparent, tracestate FROM <schema>.requests
//!  WHERE kind = 'write' AND idem_key = $1 ORDER BY id;
//! -- async jobs started for one key, and status polls of one operation
//! SELECT count(*) FROM <schema>.async_jobs WHERE idem_key = $1;
//! SELECT count(*) FROM <schema>.requests WHERE kind = 'status' AND operation_id = $1;
//! ```
//!
//! `requests.status` is NULL for a request whose connection was dropped on
//! purpose (or that was still in flight), and `requests.fault` names the fault
//! it consumed. `requests.replied_at` is when the whole answer was written to a
//! client that had not hung up; NULL when it was dropped, or the client was gone
//! first (it timed out or died), so the client never read it.
//! `requests.deadline` is the deadline a write carried (NULL without one).
//!
//! # Layout
//!
//! `probe` (`reference-downstream probe URL`, the container health check), `config` (env),
//! `server` (accept loop, start-up line, signals), `http`
//! (one request, one response), `routes` (the life of a business request),
//! `control` (fault API), `faults` (the in-memory fault book), `store` (SQL),
//! `receipt` (receipt JSON), `jobs` (async jobs: their state and status document).

mod config;
mod control;
mod faults;
mod http;
mod jobs;
mod probe;
mod receipt;
mod routes;
mod server;
mod store;

use std::sync::Arc;

use anyhow::Result;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> Result<()> {
    // `reference-downstream probe URL`: exit 0 on a 2xx answer, 1 otherwise (health checks).
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [cmd, url] = args.as_slice() {
        if cmd == "probe" {
            if let Err(e) = probe::probe(url, std::time::Duration::from_secs(3)).await {
                eprintln!("reference-downstream probe: {e:#}");
                std::process::exit(1);
            }
            return Ok(());
        }
    }
    // stdout is reserved for the single start-up line; logs go to stderr.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn")),
        )
        .init();
    let config = config::Config::from_env()?;
    tracing::info!(schema = %config.schema, addr = %config.addr,
        retention_secs = config.replay_retention.as_secs(),
        async_delay_ms = config.async_delay_ms, deadline_header = %config.deadline_header,
        clock_offset_ms = config.clock_offset_ms, "starting");
    let store = store::Store::open(&config.database_url, &config.schema)
        .await?
        .with_clock_offset(config.clock_offset_ms);
    let app = Arc::new(routes::App::new(
        store,
        config.replay_retention,
        config.async_delay_ms,
        config.deadline_header,
    ));
    server::serve(app, config.addr).await
}
