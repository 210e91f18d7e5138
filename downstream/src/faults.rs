//! The in-memory fault book: what the next matching request should suffer.
//!
//! Faults live only in memory on purpose: a restart of this process must keep
//! the business data (Postgres) but forget the faults, exactly like a real
//! service whose network hiccup does not survive a redeploy. The book is a FIFO
//! list; a request consumes one use of the *first* fault that matches its
//! direction (`write`, `lookup` or `status`) and, when the fault names one, its
//! idempotency key.
//!
//! Job faults (`async_delay`, `async_fail`, `async_stuck`, `status_not_found`) are
//! apart: they shape an async job and are consumed by the write that creates it
//! (see [`FaultBook::take_job_faults`]), never by [`FaultBook::take`], so that one
//! creating write can take a transport fault such as `drop_after_commit` and
//! job faults at once. What they chose is stored with the job.

use std::collections::VecDeque;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::jobs::MAX_DELAY_MS;

/// The states a `wrong_receipt` fault may make another operation's document show.
pub const WRONG_STATES: [&str; 3] = ["running", "succeeded", "failed"];

/// What a fault does, and when (see `routes.rs` for the exact choreography).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// Do the work and commit, then close the socket without a byte (reset).
    DropAfterCommit,
    /// Read the request, then close without doing anything (reset).
    DropBeforeCommit,
    /// Commit normally, but answer with a receipt for another operation.
    WrongReceipt,
    /// Answer `status` (default 503) without touching data.
    Status,
    /// Commit, then answer `status` (default 500).
    StatusAfterCommit,
    /// Sleep `delay_ms`, then process normally.
    Slow,
    /// Commit, sleep `delay_ms`, then answer normally.
    SlowAfterCommit,
    /// On a lookup: answer 404 even if the record exists.
    LookupMiss,
    /// Job fault: the async job created by the write runs `delay_ms` before it ends.
    AsyncDelay,
    /// Job fault: the async job ends `failed`.
    AsyncFail,
    /// Job fault: the async job never ends (stays `running`).
    AsyncStuck,
    /// Job fault: the job's status URL answers 404 for `delay_ms` after its creation.
    StatusNotFound,
    /// On a status read: answer `status` (default 503) without reading the job.
    StatusError,
    /// On a status read: sleep `delay_ms`, then answer normally.
    StatusSlow,
    /// Process normally, then answer with a `memo` member holding U+0000 (legal JSON that
    /// Postgres `jsonb` refuses) added, hand-spaced, at the end of the body.
    NulInReceipt,
}

impl FaultKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::DropAfterCommit => "drop_after_commit",
            FaultKind::DropBeforeCommit => "drop_before_commit",
            FaultKind::WrongReceipt => "wrong_receipt",
            FaultKind::Status => "status",
            FaultKind::StatusAfterCommit => "status_after_commit",
            FaultKind::Slow => "slow",
            FaultKind::SlowAfterCommit => "slow_after_commit",
            FaultKind::LookupMiss => "lookup_miss",
            FaultKind::AsyncDelay => "async_delay",
            FaultKind::AsyncFail => "async_fail",
            FaultKind::AsyncStuck => "async_stuck",
            FaultKind::StatusNotFound => "status_not_found",
            FaultKind::StatusError => "status_error",
            FaultKind::StatusSlow => "status_slow",
            FaultKind::NulInReceipt => "nul_in_receipt",
        }
    }

    /// Job faults shape the async job a write creates (taken by
    /// [`FaultBook::take_job_faults`] only).
    pub fn shapes_job(self) -> bool {
        matches!(
            self,
            FaultKind::AsyncDelay
                | FaultKind::AsyncFail
                | FaultKind::AsyncStuck
                | FaultKind::StatusNotFound
        )
    }

    /// The only direction this kind makes sense on, if it is restricted to one.
    fn only_on(self) -> Option<Direction> {
        match self {
            FaultKind::LookupMiss => Some(Direction::Lookup),
            FaultKind::StatusError | FaultKind::StatusSlow => Some(Direction::Status),
            kind if kind.shapes_job() => Some(Direction::Write),
            _ => None,
        }
    }
}

/// Which kind of business request a fault applies to (also the `kind` column of the
/// request log).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    Write,
    Lookup,
    /// A read of an async job's status URL (`GET /async/operations/{id}`).
    Status,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Write => "write",
            Direction::Lookup => "lookup",
            Direction::Status => "status",
        }
    }
}

/// The body of `POST /_control/faults`. `count` is accepted for `times` and `ms` for
/// `delay_ms`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    pub kind: FaultKind,
    #[serde(alias = "count")]
    pub times: Option<u32>,
    pub key: Option<String>,
    pub on: Option<Direction>,
    #[serde(alias = "ms")]
    pub delay_ms: Option<u64>,
    pub status: Option<u16>,
    pub retry_after: Option<String>,
    pub every: Option<u32>,
    pub state: Option<String>,
}

/// A fault as stored and listed. `times` is the number of uses left.
#[derive(Debug, Clone, Serialize)]
pub struct Fault {
    pub id: u64,
    pub kind: FaultKind,
    pub times: u32,
    pub key: Option<String>,
    pub on: Direction,
    pub delay_ms: u64,
    pub status: Option<u16>,
    pub retry_after: Option<String>,
    /// Applies to the 1st, (1+every)th, (1+2·every)th ... matching request; the others pass
    /// untouched without using up `times` (`every = 2`: shed half the requests).
    pub every: u32,
    /// Matching requests seen so far.
    pub seen: u32,
    /// `wrong_receipt` on an async answer: the state the other operation's document shows
    /// (`running`, `succeeded` or `failed`) instead of the real job's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
}

impl Fault {
    /// Validate a spec and fill in defaults. Errors are short codes for a 400.
    pub fn from_spec(id: u64, spec: FaultSpec) -> Result<Fault, String> {
        let times = spec.times.unwrap_or(1);
        if times == 0 {
            return Err("times must be at least 1".into());
        }
        let every = spec.every.unwrap_or(1);
        if every == 0 {
            return Err("every must be at least 1".into());
        }
        // A kind that makes sense in one direction only defaults to it (lookup_miss: lookup;
        // status_error, status_slow: status; job faults: the write that creates the job).
        let only_on = spec.kind.only_on();
        let on = spec.on.or(only_on).unwrap_or(Direction::Write);
        if let Some(only) = only_on.filter(|only| *only != on) {
            return Err(format!(
                "{} applies only with on={}",
                spec.kind.as_str(),
                only.as_str()
            ));
        }
        if matches!(spec.kind, FaultKind::AsyncDelay | FaultKind::StatusNotFound) {
            match spec.delay_ms {
                None => return Err(format!("{} needs delay_ms", spec.kind.as_str())),
                Some(ms) if ms > MAX_DELAY_MS => {
                    return Err(format!("delay_ms must be at most {MAX_DELAY_MS}"))
                }
                Some(_) => {}
            }
        }
        let status = match spec.kind {
            FaultKind::Status | FaultKind::StatusError => Some(spec.status.unwrap_or(503)),
            FaultKind::StatusAfterCommit => Some(spec.status.unwrap_or(500)),
            _ => spec.status,
        };
        if let Some(s) = status {
            if !(100..=599).contains(&s) {
                return Err("status must be within 100..=599".into());
            }
        }
        if let Some(state) = &spec.state {
            if spec.kind != FaultKind::WrongReceipt {
                return Err("state applies only to wrong_receipt".into());
            }
            if !WRONG_STATES.contains(&state.as_str()) {
                return Err("state must be running, succeeded or failed".into());
            }
        }
        let delay_ms = match spec.kind {
            FaultKind::Slow | FaultKind::SlowAfterCommit | FaultKind::StatusSlow => {
                spec.delay_ms.unwrap_or(1000)
            }
            _ => spec.delay_ms.unwrap_or(0),
        };
        Ok(Fault {
            id,
            kind: spec.kind,
            times,
            key: spec.key,
            on,
            delay_ms,
            status,
            retry_after: spec.retry_after,
            every,
            seen: 0,
            state: spec.state,
        })
    }

    fn matches(&self, on: Direction, key: Option<&str>) -> bool {
        self.on == on
            && !self.kind.shapes_job()
            && match &self.key {
                None => true,
                Some(wanted) => key == Some(wanted.as_str()),
            }
    }
}

/// The job faults one creating write took: at most one of each group.
#[derive(Debug, Default)]
pub struct JobFaults {
    /// `async_fail` or `async_stuck`: how the job ends.
    pub ending: Option<Fault>,
    /// `async_delay`: when it ends.
    pub delay: Option<Fault>,
    /// `status_not_found`: how long its status URL hides it.
    pub hidden: Option<Fault>,
}

/// Thread-safe FIFO of pending faults.
#[derive(Debug, Default)]
pub struct FaultBook {
    inner: Mutex<Book>,
}

#[derive(Debug, Default)]
struct Book {
    next_id: u64,
    faults: VecDeque<Fault>,
}

impl FaultBook {
    /// Append a fault; returns it as stored (with id and defaults).
    pub fn add(&self, spec: FaultSpec) -> Result<Fault, String> {
        let mut book = self.lock();
        book.next_id += 1;
        let fault = Fault::from_spec(book.next_id, spec)?;
        book.faults.push_back(fault.clone());
        Ok(fault)
    }

    /// Consume one use of the first fault matching this request, if any.
    /// The returned copy carries the uses left *before* this one was taken.
    /// Job faults are never taken here.
    pub fn take(&self, on: Direction, key: Option<&str>) -> Option<Fault> {
        self.take_first(|f| f.matches(on, key))
    }

    /// For a write that has just created an async job under `key`: consume one use of the
    /// first matching job fault of each group (ending, delay, status window).
    pub fn take_job_faults(&self, key: &str) -> JobFaults {
        let job_fault = |kinds: &'static [FaultKind]| {
            move |f: &Fault| {
                kinds.contains(&f.kind) && f.key.as_deref().is_none_or(|wanted| wanted == key)
            }
        };
        JobFaults {
            ending: self.take_first(job_fault(&[FaultKind::AsyncFail, FaultKind::AsyncStuck])),
            delay: self.take_first(job_fault(&[FaultKind::AsyncDelay])),
            hidden: self.take_first(job_fault(&[FaultKind::StatusNotFound])),
        }
    }

    /// Consume one use of the first fault `wanted` picks, honouring its `every`.
    fn take_first(&self, wanted: impl Fn(&Fault) -> bool) -> Option<Fault> {
        let mut book = self.lock();
        let index = book.faults.iter().position(wanted)?;
        let fault = &mut book.faults[index];
        fault.seen += 1;
        if !(fault.seen - 1).is_multiple_of(fault.every) {
            return None;
        }
        let taken = book.faults[index].clone();
        if taken.times <= 1 {
            book.faults.remove(index);
        } else {
            book.faults[index].times -= 1;
        }
        Some(taken)
    }

    pub fn list(&self) -> Vec<Fault> {
        self.lock().faults.iter().cloned().collect()
    }

    /// Remove all faults; returns how many were pending.
    pub fn clear(&self) -> usize {
        let mut book = self.lock();
        let n = book.faults.len();
        book.faults.clear();
        n
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        // A panic while holding this lock cannot leave the list half-edited in
        // a harmful way, so recover from poisoning instead of failing forever.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: serde_json::Value) -> FaultSpec {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn fifo_with_key_matching_and_counted_uses() {
        let book = FaultBook::default();
        book.add(spec(
            serde_json::json!({"kind": "status", "key": "k1", "times": 2}),
        ))
        .unwrap();
        book.add(spec(serde_json::json!({"kind": "slow"}))).unwrap();
        // Key k2 skips the keyed fault and hits the catch-all.
        assert_eq!(
            book.take(Direction::Write, Some("k2")).unwrap().kind,
            FaultKind::Slow
        );
        assert_eq!(
            book.take(Direction::Write, Some("k1")).unwrap().status,
            Some(503)
        );
        assert!(book.take(Direction::Lookup, Some("k1")).is_none());
        assert!(book.take(Direction::Write, Some("k1")).is_some());
        assert!(book.take(Direction::Write, Some("k1")).is_none());
        assert!(book.list().is_empty());
    }

    #[test]
    fn every_other_request_is_shed_and_only_applied_uses_count() {
        let book = FaultBook::default();
        book.add(spec(
            serde_json::json!({"kind": "status", "status": 429, "every": 2, "times": 2}),
        ))
        .unwrap();
        let hits: Vec<bool> = (0..6)
            .map(|_| book.take(Direction::Write, None).is_some())
            .collect();
        assert_eq!(hits, [true, false, true, false, false, false]);
        assert!(book
            .add(spec(serde_json::json!({"kind": "status", "every": 0})))
            .is_err());
    }

    #[test]
    fn defaults_and_validation() {
        let book = FaultBook::default();
        let f = book
            .add(spec(serde_json::json!({"kind": "lookup_miss"})))
            .unwrap();
        assert_eq!(f.on, Direction::Lookup);
        let f = book
            .add(spec(serde_json::json!({"kind": "status_after_commit"})))
            .unwrap();
        assert_eq!(f.status, Some(500));
        assert!(book
            .add(spec(
                serde_json::json!({"kind": "lookup_miss", "on": "write"})
            ))
            .is_err());
        assert!(book
            .add(spec(serde_json::json!({"kind": "status", "times": 0})))
            .is_err());
        assert!(serde_json::from_value::<FaultSpec>(serde_json::json!({"kind": "nope"})).is_err());
        let f = book
            .add(spec(
                serde_json::json!({"kind": "wrong_receipt", "on": "status", "state": "failed"}),
            ))
            .unwrap();
        assert_eq!(f.state.as_deref(), Some("failed"));
        for bad in [
            serde_json::json!({"kind": "wrong_receipt", "state": "done"}),
            serde_json::json!({"kind": "status", "state": "failed"}),
        ] {
            assert!(book.add(spec(bad.clone())).is_err(), "{bad}");
        }
        assert_eq!(book.clear(), 3);
    }

    #[test]
    fn async_kinds_default_and_check_their_direction_and_delay() {
        let book = FaultBook::default();
        let f = book
            .add(spec(
                serde_json::json!({"kind": "status_error", "key": "k", "count": 2}),
            ))
            .unwrap();
        assert_eq!((f.on, f.times, f.status), (Direction::Status, 2, Some(503)));
        let f = book
            .add(spec(serde_json::json!({"kind": "status_slow", "ms": 250})))
            .unwrap();
        assert_eq!((f.on, f.delay_ms), (Direction::Status, 250));
        let f = book
            .add(spec(
                serde_json::json!({"kind": "status_not_found", "ms": 500}),
            ))
            .unwrap();
        assert_eq!((f.on, f.delay_ms), (Direction::Write, 500));
        for bad in [
            serde_json::json!({"kind": "status_error", "on": "write"}),
            serde_json::json!({"kind": "async_fail", "on": "status"}),
            serde_json::json!({"kind": "async_delay"}),
            serde_json::json!({"kind": "status_not_found"}),
            serde_json::json!({"kind": "async_delay", "delay_ms": MAX_DELAY_MS + 1}),
        ] {
            assert!(book.add(spec(bad.clone())).is_err(), "{bad}");
        }
        assert!(serde_json::from_value::<FaultSpec>(
            serde_json::json!({"kind": "slow", "ms": 1, "delay_ms": 2})
        )
        .is_err());
    }

    #[test]
    fn job_faults_are_taken_only_by_job_creation_one_per_group() {
        let book = FaultBook::default();
        for fault in [
            serde_json::json!({"kind": "async_fail", "key": "k"}),
            serde_json::json!({"kind": "async_stuck"}),
            serde_json::json!({"kind": "async_delay", "key": "k", "delay_ms": 50}),
            serde_json::json!({"kind": "drop_after_commit", "key": "k"}),
        ] {
            book.add(spec(fault)).unwrap();
        }
        // The transport fault is the first one an ordinary write can take.
        assert_eq!(
            book.take(Direction::Write, Some("k")).unwrap().kind,
            FaultKind::DropAfterCommit
        );
        assert!(book.take(Direction::Write, Some("k")).is_none());
        let taken = book.take_job_faults("k");
        assert_eq!(taken.ending.unwrap().kind, FaultKind::AsyncFail);
        assert_eq!(taken.delay.unwrap().delay_ms, 50);
        assert!(taken.hidden.is_none());
        // The keyless async_stuck is left for the next job, of any key.
        let taken = book.take_job_faults("other");
        assert_eq!(taken.ending.unwrap().kind, FaultKind::AsyncStuck);
        assert!(book.list().is_empty());
    }
}
