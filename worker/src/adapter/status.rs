//! A long-running operation's documents, read against its tool's async contract
//! ([`crate::config::AsyncContract`]): the operation id an acceptance names, whether a document
//! is about another operation ([`Contract::another_operation`]), and what a status document
//! says ([`Contract::judge`]: done, failed, or neither). Pure: documents in, verdicts out; the
//! HTTP adapter reads the documents ([`super::http`]) and the receipt check decides whether a
//! done one is this operation's receipt.

use std::collections::BTreeMap;

use super::receipt::{Pointer, ReceiptRule};
use super::Request;
use crate::config::AsyncContract;

/// The contract with its pointers parsed once.
#[derive(Debug, Clone)]
pub struct Contract {
    pub accepted_statuses: Vec<u16>,
    pub operation_id: Pointer,
    pub status_url: String,
    done: Vec<(Pointer, serde_json::Value)>,
    failed: Vec<(Pointer, serde_json::Value)>,
}

/// What a status document says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judged {
    /// Every field of `done_match` equals its value.
    Done,
    /// Every field of `failed_match` equals its value (and it is not done).
    Failed,
    /// Neither: running, or a document this contract does not recognise.
    Neither,
}

impl Contract {
    pub fn new(contract: &AsyncContract) -> Contract {
        let parse = |m: &BTreeMap<String, serde_json::Value>| {
            m.iter()
                .map(|(p, v)| (Pointer::new(p), v.clone()))
                .collect::<Vec<_>>()
        };
        Contract {
            accepted_statuses: contract.accepted_statuses.clone(),
            operation_id: Pointer::new(&contract.operation_id),
            status_url: contract.status_url.clone(),
            done: parse(&contract.done_match),
            failed: parse(&contract.failed_match),
        }
    }

    /// The operation id a document names (a string, or a number written as text); None when
    /// it names none.
    pub fn operation_id(&self, document: &serde_json::Value) -> Option<String> {
        match self.operation_id.resolve(document)? {
            serde_json::Value::String(s) if !s.trim().is_empty() => Some(s.clone()),
            serde_json::Value::Number(n) => Some(n.to_string()),
            _ => None,
        }
    }

    /// Why `document` is about another operation than `request`'s, whatever it says: it names
    /// an operation id other than `operation_id` (the one polled, when known), or an echo field
    /// of the tool's `receipt_match` is present and differs ([`ReceiptRule::contradiction`]).
    /// Such a document proves nothing about this operation, done, failed or running alike.
    /// None when nothing in it says so: an absent id or echo is no mismatch (a failure or a
    /// running operation's document may not echo the key).
    pub fn another_operation(
        &self,
        document: &serde_json::Value,
        operation_id: Option<&str>,
        rule: &ReceiptRule,
        request: &Request,
    ) -> Option<String> {
        let named = self.operation_id(document);
        match (named, operation_id) {
            (Some(named), Some(ours)) if named != ours => {
                Some(format!("it names operation {named}, not {ours}"))
            }
            _ => rule.contradiction(request, document),
        }
    }

    /// What `document` says (done is looked for first: a document matching both is done).
    pub fn judge(&self, document: &serde_json::Value) -> Judged {
        let all = |fields: &[(Pointer, serde_json::Value)]| {
            !fields.is_empty()
                && fields
                    .iter()
                    .all(|(p, want)| p.resolve(document).is_some_and(|have| same(have, want)))
        };
        if all(&self.done) {
            Judged::Done
        } else if all(&self.failed) {
            Judged::Failed
        } else {
            Judged::Neither
        }
    }
}

/// Equality of a document's value and a contract's: JSON equality, numbers by value (`1` and
/// `1.0` alike).
fn same(have: &serde_json::Value, want: &serde_json::Value) -> bool {
    match (have.as_f64(), want.as_f64()) {
        (Some(a), Some(b)) if have.is_number() && want.is_number() => a == b,
        _ => have == want,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn contract(done: serde_json::Value, failed: serde_json::Value) -> Contract {
        let map = |v: serde_json::Value| {
            v.as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        Contract::new(&AsyncContract {
            accepted_statuses: vec![202],
            operation_id: "/operation_id".into(),
            status_url: "http://d/ops/{operation_id}".into(),
            done_match: map(done),
            failed_match: map(failed),
            poll: Default::default(),
            callback: None,
        })
    }

    #[test]
    fn documents_are_judged_done_failed_or_neither() {
        let c = contract(
            json!({"/state": "succeeded", "/checks/ok": true}),
            json!({"/state": "failed"}),
        );
        for (doc, want) in [
            (
                json!({"state": "succeeded", "checks": {"ok": true}}),
                Judged::Done,
            ),
            (
                json!({"state": "succeeded", "checks": {"ok": false}}),
                Judged::Neither,
            ),
            (json!({"state": "succeeded"}), Judged::Neither),
            (json!({"state": "failed"}), Judged::Failed),
            (json!({"state": "running"}), Judged::Neither),
            (
                json!({"state": "SUCCEEDED", "checks": {"ok": true}}),
                Judged::Neither,
            ),
            (json!([1, 2]), Judged::Neither),
            (json!("succeeded"), Judged::Neither),
        ] {
            assert_eq!(c.judge(&doc), want, "{doc}");
        }
        // Without a failed_match, nothing is ever judged failed.
        let c = contract(json!({"/state": "done"}), json!({}));
        assert_eq!(c.judge(&json!({"state": "failed"})), Judged::Neither);
        // Numbers by value.
        let c = contract(json!({"/progress": 100}), json!({}));
        assert_eq!(c.judge(&json!({"progress": 100.0})), Judged::Done);
        assert_eq!(c.judge(&json!({"progress": "100"})), Judged::Neither);
    }

    #[test]
    fn a_document_naming_another_operation_or_echoing_another_key_is_anothers() {
        let c = contract(json!({"/state": "succeeded"}), json!({"/state": "failed"}));
        let rule = ReceiptRule::new(
            "/deployment_id",
            &[(
                "/idempotency_key".to_string(),
                "{tenant}:{action_id}".to_string(),
            )]
            .into(),
        );
        let request = Request {
            tenant: "north-shop".into(),
            action_id: "deploy-1".into(),
            tool: "deploy".into(),
            idempotency_key: "north-shop:deploy-1".into(),
            body: String::new(),
            trace: None,
            deadline: None,
        };
        let ours = "north-shop:deploy-1";
        for (doc, polled, says) in [
            // Failed, running or done: another id or another key, present, is another's.
            (
                json!({"operation_id": "op-9", "idempotency_key": ours, "state": "failed"}),
                Some("op-7"),
                Some("it names operation op-9, not op-7"),
            ),
            (
                json!({"operation_id": 9, "state": "running"}),
                Some("op-7"),
                Some("it names operation 9, not op-7"),
            ),
            (
                json!({"operation_id": "op-7", "idempotency_key": "a:b", "state": "running"}),
                Some("op-7"),
                Some("/idempotency_key is \"a:b\""),
            ),
            (
                json!({"idempotency_key": "a:b", "state": "failed"}),
                None,
                Some("/idempotency_key is \"a:b\""),
            ),
            // Absent fields are no mismatch; equal ones agree.
            (json!({"state": "failed"}), Some("op-7"), None),
            (
                json!({"operation_id": "op-7", "idempotency_key": ours, "state": "succeeded"}),
                Some("op-7"),
                None,
            ),
            (
                json!({"operation_id": "op-9", "state": "running"}),
                None,
                None,
            ),
        ] {
            let found = c.another_operation(&doc, polled, &rule, &request);
            match says {
                Some(says) => assert!(
                    found.as_deref().is_some_and(|f| f.contains(says)),
                    "{doc}: {found:?}"
                ),
                None => assert_eq!(found, None, "{doc}"),
            }
        }
    }

    #[test]
    fn the_operation_id_is_a_non_blank_string_or_a_number() {
        let c = contract(json!({"/state": "done"}), json!({}));
        assert_eq!(
            c.operation_id(&json!({"operation_id": "op-7"})).as_deref(),
            Some("op-7")
        );
        assert_eq!(
            c.operation_id(&json!({"operation_id": 7})).as_deref(),
            Some("7")
        );
        for doc in [
            json!({"operation_id": " "}),
            json!({"operation_id": null}),
            json!({"operation_id": {"id": 1}}),
            json!({}),
        ] {
            assert_eq!(c.operation_id(&doc), None, "{doc}");
        }
    }
}
