//! The in-memory fault book: what the next matching request should suffer.
//!
//! Faults live only in memory on purpose: a restart of this process must keep
//! the business data (Postgres) but forget the faults, exactly like a real
//! service whose network hiccup does not survive a redeploy. The book is a FIFO
//! list; a request consumes one use of the *first* fault that matches its
//! direction (`write` or `lookup`) and, when the fault names one, its
//! idempotency key.

use std::collections::VecDeque;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

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
        }
    }
}

/// Which kind of business request a fault applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    Write,
    Lookup,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Write => "write",
            Direction::Lookup => "lookup",
        }
    }
}

/// The body of `POST /_control/faults`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    pub kind: FaultKind,
    pub times: Option<u32>,
    pub key: Option<String>,
    pub on: Option<Direction>,
    pub delay_ms: Option<u64>,
    pub status: Option<u16>,
    pub retry_after: Option<String>,
    pub every: Option<u32>,
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
        // lookup_miss only makes sense on lookups, so that is its default.
        let default_on = match spec.kind {
            FaultKind::LookupMiss => Direction::Lookup,
            _ => Direction::Write,
        };
        let on = spec.on.unwrap_or(default_on);
        if spec.kind == FaultKind::LookupMiss && on != Direction::Lookup {
            return Err("lookup_miss applies only with on=lookup".into());
        }
        let status = match spec.kind {
            FaultKind::Status => Some(spec.status.unwrap_or(503)),
            FaultKind::StatusAfterCommit => Some(spec.status.unwrap_or(500)),
            _ => spec.status,
        };
        if let Some(s) = status {
            if !(100..=599).contains(&s) {
                return Err("status must be within 100..=599".into());
            }
        }
        let delay_ms = match spec.kind {
            FaultKind::Slow | FaultKind::SlowAfterCommit => spec.delay_ms.unwrap_or(1000),
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
        })
    }

    fn matches(&self, on: Direction, key: Option<&str>) -> bool {
        self.on == on
            && match &self.key {
                None => true,
                Some(wanted) => key == Some(wanted.as_str()),
            }
    }
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
    pub fn take(&self, on: Direction, key: Option<&str>) -> Option<Fault> {
        let mut book = self.lock();
        let index = book.faults.iter().position(|f| f.matches(on, key))?;
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
        assert_eq!(book.clear(), 2);
    }
}
