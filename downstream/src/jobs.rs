//! Async jobs (`/async/...`): a write that does not finish inside the HTTP call.
//!
//! `POST /async/{resource}` creates a job and answers 202 with its operation id; the
//! job ends later, `succeeded` (with a deployment id, the final receipt) or `failed`,
//! or never (`stuck`). Everything about the end is chosen when the job is created and
//! stored in its row: the ending, the delay and so the time it ends (`ends_at`). The
//! state is then derived from the database clock whenever the job is read, so a
//! restart of the service neither changes the outcome nor resets the delay, and no
//! background task is needed.
//!
//! This module is pure: the job as read, its status document and the documents of the
//! `wrong_receipt` fault. The SQL is in `store.rs`, the routing in `routes.rs`.

use serde_json::{json, Map, Value};
use sqlx::types::chrono::{DateTime, Utc};

use crate::receipt;

/// The longest delay a job may have (`DOWNSTREAM_ASYNC_DELAY_MS`, `async_delay`,
/// `status_not_found`): 30 days, so that the end is always a representable timestamp.
pub const MAX_DELAY_MS: u64 = 30 * 24 * 3600 * 1000;

/// The reason a job armed with `async_fail` gives.
pub const FAILURE: &str = "deployment failed: health checks did not pass";

/// How a job ends, fixed at its creation (the `outcome` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    Succeeded,
    Failed,
    /// Never ends: the state stays `running`.
    Stuck,
}

impl Ending {
    pub fn as_str(self) -> &'static str {
        match self {
            Ending::Succeeded => "succeeded",
            Ending::Failed => "failed",
            Ending::Stuck => "stuck",
        }
    }

    pub fn parse(s: &str) -> Option<Ending> {
        match s {
            "succeeded" => Some(Ending::Succeeded),
            "failed" => Some(Ending::Failed),
            "stuck" => Some(Ending::Stuck),
            _ => None,
        }
    }
}

/// What a new job will do, from the job faults its creating write took (or the defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub ending: Ending,
    /// From creation to the end (ignored when `Stuck`).
    pub delay_ms: u64,
    /// The status URL answers 404 for this long after creation (`status_not_found`).
    pub hidden_ms: u64,
}

/// A job as read, with its state at the time of the read (database clock).
#[derive(Debug, Clone)]
pub struct Job {
    pub operation_id: String,
    pub idem_key: String,
    pub resource: String,
    pub arguments: Value,
    pub ending: Ending,
    /// The end time has passed (never for a stuck job).
    pub ended: bool,
    /// Inside the `status_not_found` window: the status URL pretends not to know it.
    pub hidden: bool,
    pub deployment_id: Option<String>,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
}

pub fn operation_id(id: i64) -> String {
    format!("op-{id}")
}

pub fn deployment_id(id: i64) -> String {
    format!("dep-{id}")
}

pub fn status_url(operation_id: &str) -> String {
    format!("/async/operations/{operation_id}")
}

impl Job {
    /// `running` until the end time, then the ending (a stuck job stays `running`).
    pub fn state(&self) -> &'static str {
        match (self.ended, self.ending) {
            (true, Ending::Succeeded) => "succeeded",
            (true, Ending::Failed) => "failed",
            _ => "running",
        }
    }

    /// The status document: what the status URL, the by-key lookup and every `POST`
    /// (first or replayed) answer.
    pub fn document(&self) -> Value {
        let mut doc = json!({
            "operation_id": self.operation_id,
            "idempotency_key": self.idem_key,
            "state": self.state(),
            "status_url": status_url(&self.operation_id),
            "mode": "async",
            "resource": self.resource,
            "arguments": self.arguments,
            "created_at": self.created_at.to_rfc3339(),
        });
        match self.state() {
            "succeeded" => {
                let id = self.deployment_id.clone().unwrap_or_default();
                doc["deployment_id"] = json!(id);
                doc["receipt_id"] = json!(id);
            }
            "failed" => {
                doc["error"] = json!(self.error.as_deref().unwrap_or(FAILURE));
            }
            _ => {}
        }
        doc
    }
}

/// A well-formed status document for another operation (the `wrong_receipt` fault): the
/// real document with a foreign operation id, key and deployment id, or, when the real
/// answer was not a document (an error), a running job with these arguments. With `state`,
/// the other operation shows that state (and its fields) whatever the real job's is, so a
/// test can show a client another operation's end while its own job still runs.
pub fn wrong(
    n: u64,
    resource: &str,
    arguments: &Value,
    real: &Value,
    state: Option<&str>,
) -> Value {
    let operation_id = format!("op-wrong-{n}");
    let mut doc = match real {
        Value::Object(map) if map.contains_key("operation_id") => map.clone(),
        _ => {
            let mut map = Map::new();
            map.insert("state".into(), json!("running"));
            map.insert("mode".into(), json!("async"));
            map.insert("resource".into(), json!(resource));
            map.insert("arguments".into(), arguments.clone());
            map.insert("created_at".into(), json!(Utc::now().to_rfc3339()));
            map
        }
    };
    doc.insert("operation_id".into(), json!(operation_id));
    doc.insert("idempotency_key".into(), json!(receipt::WRONG_KEY));
    doc.insert("status_url".into(), json!(status_url(&operation_id)));
    if let Some(state) = state {
        doc.insert("state".into(), json!(state));
        for field in ["deployment_id", "receipt_id", "error"] {
            doc.remove(field);
        }
        match state {
            // Filled in with the foreign deployment id below.
            "succeeded" => {
                doc.insert("deployment_id".into(), Value::Null);
                doc.insert("receipt_id".into(), Value::Null);
            }
            "failed" => {
                doc.insert("error".into(), json!(FAILURE));
            }
            _ => {}
        }
    }
    for field in ["deployment_id", "receipt_id"] {
        if doc.contains_key(field) {
            doc.insert(field.into(), json!(format!("dep-wrong-{n}")));
        }
    }
    Value::Object(doc)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(ending: Ending, ended: bool) -> Job {
        Job {
            operation_id: operation_id(7),
            idem_key: "k".into(),
            resource: "deploys".into(),
            arguments: json!({"app": "web"}),
            ending,
            ended,
            hidden: false,
            deployment_id: (ending == Ending::Succeeded).then(|| deployment_id(7)),
            error: (ending == Ending::Failed).then(|| FAILURE.to_owned()),
            created_at: DateTime::parse_from_rfc3339("2024-01-02T03:04:05Z")
                .unwrap()
                .with_timezone(&Utc),
        }
    }

    #[test]
    fn documents_by_state() {
        let running = job(Ending::Succeeded, false).document();
        assert_eq!(running["state"], "running");
        assert_eq!(running["operation_id"], "op-7");
        assert_eq!(running["status_url"], "/async/operations/op-7");
        assert_eq!(running["created_at"], "2024-01-02T03:04:05+00:00");
        assert!(running.get("deployment_id").is_none());
        let done = job(Ending::Succeeded, true).document();
        assert_eq!(done["state"], "succeeded");
        assert_eq!(done["deployment_id"], "dep-7");
        assert_eq!(done["receipt_id"], "dep-7");
        let failed = job(Ending::Failed, true).document();
        assert_eq!(failed["state"], "failed");
        assert_eq!(failed["error"], FAILURE);
        assert!(failed.get("receipt_id").is_none());
        assert_eq!(job(Ending::Stuck, false).document()["state"], "running");
    }

    #[test]
    fn wrong_documents_name_another_operation() {
        let real = job(Ending::Succeeded, true).document();
        let w = wrong(3, "deploys", &json!({}), &real, None);
        assert_eq!(w["operation_id"], "op-wrong-3");
        assert_eq!(w["idempotency_key"], receipt::WRONG_KEY);
        assert_eq!(w["receipt_id"], "dep-wrong-3");
        assert_eq!(w["arguments"], real["arguments"]);
        let from_error = wrong(4, "deploys", &json!({"a": 1}), &json!({"error": "x"}), None);
        assert_eq!(from_error["state"], "running");
        assert_eq!(from_error["arguments"], json!({"a": 1}));
        assert!(from_error.get("error").is_none());
        // Another operation's end, shown while the real job still runs.
        let running = job(Ending::Succeeded, false).document();
        let failed = wrong(5, "deploys", &json!({}), &running, Some("failed"));
        assert_eq!(failed["state"], "failed");
        assert_eq!(failed["error"], FAILURE);
        assert_eq!(failed["operation_id"], "op-wrong-5");
        assert!(failed.get("receipt_id").is_none());
        let done = wrong(6, "deploys", &json!({}), &running, Some("succeeded"));
        assert_eq!(done["receipt_id"], "dep-wrong-6");
        assert_eq!(done["deployment_id"], "dep-wrong-6");
        let real_failed = job(Ending::Failed, true).document();
        let still = wrong(7, "deploys", &json!({}), &real_failed, Some("running"));
        assert_eq!(still["state"], "running");
        assert!(still.get("error").is_none());
        for e in [Ending::Succeeded, Ending::Failed, Ending::Stuck] {
            assert_eq!(Ending::parse(e.as_str()), Some(e));
        }
    }
}
