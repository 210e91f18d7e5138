//! Downstream request metrics: every adapter call timed and counted by tool, kind (`write`,
//! `lookup`) and outcome ([`timed`]), each tool's series held by its [`RequestMeters`], and a
//! call that could not leave for want of a local resource counted and logged apart.

use std::sync::OnceLock;
use std::time::Instant;

use metrics::{counter, histogram, Counter, Histogram};

use super::Tool;
use crate::outcome::Outcome;
use crate::telemetry::metrics as m;

/// One tool's downstream request metrics, by kind (`write`, `lookup`) and outcome, each set
/// registered on its first use: a `counter!` or `histogram!` with labels builds, hashes and
/// looks up its key on every call, three times per request.
#[derive(Default)]
pub struct RequestMeters {
    sets: [[OnceLock<MeterSet>; Outcome::LABELS.len()]; 2],
}

struct MeterSet {
    duration: Histogram,
    requests: Counter,
    /// `intent_worker_dispatch_attempts_total`, for writes only.
    attempts: Option<Counter>,
}

impl RequestMeters {
    /// Records one request of `tool` that took `seconds`.
    fn record(&self, tool: &str, kind: &'static str, outcome: &Outcome, seconds: f64) {
        let register = || {
            let label = outcome.label();
            MeterSet {
                duration: histogram!(m::DOWNSTREAM_DURATION, "tool" => tool.to_owned(), "kind" => kind, "outcome" => label),
                requests: counter!(m::DOWNSTREAM_REQUESTS, "tool" => tool.to_owned(), "kind" => kind, "outcome" => label),
                attempts: (kind == "write").then(|| {
                    counter!(m::DISPATCH_ATTEMPTS, "tool" => tool.to_owned(), "outcome" => label)
                }),
            }
        };
        let record = |set: &MeterSet| {
            set.duration.record(seconds);
            set.requests.increment(1);
            if let Some(attempts) = &set.attempts {
                attempts.increment(1);
            }
        };
        match kind {
            "write" => record(self.sets[0][outcome.index()].get_or_init(register)),
            "lookup" => record(self.sets[1][outcome.index()].get_or_init(register)),
            _ => record(&register()),
        }
    }
}

/// Calls the adapter and records latency and outcome.
pub async fn timed(
    tool: &Tool,
    kind: &'static str,
    fut: impl std::future::Future<Output = Outcome>,
) -> Outcome {
    let started = Instant::now();
    let outcome = fut.await;
    let name = &tool.config.name;
    tool.meters
        .record(name, kind, &outcome, started.elapsed().as_secs_f64());
    if let Outcome::LocalExhaustion { evidence } = &outcome {
        counter!(m::LOCAL_RESOURCE_ERRORS, "tool" => name.clone(), "kind" => kind).increment(1);
        tracing::warn!(
            tool = %name, kind,
            "this worker ran out of a local resource before it could reach the downstream; \
             nothing was sent, it is tried again later without spending an attempt (raise the \
             open-file limit, or lower WORKER_MAX_IN_FLIGHT, WORKER_DB_POOL_SIZE, \
             WORKER_HTTP_MAX_CONNECTIONS): {evidence}"
        );
    }
    outcome
}
