//! The rule tables of the dispatch path: which ledger state an adapter outcome leads to, after
//! a write ([`after_dispatch`]) and after a recovery round ([`after_recovery`]). Pure: outcome,
//! operation and tool in, transition out; recording it is [`super::finish`]'s.
//!
//! After a write: a matching receipt succeeds; proven not applied (not sent, a "not applied"
//! status) waits for a retry until `retry.max_attempts` or `retry.max_elapsed_secs` is spent,
//! then fails; this worker's own exhaustion resends with the attempt given back; a definitive
//! rejection fails; anything that may have been applied is `unknown` (at once for a tool
//! without recovery, after the first retry delay otherwise).
//!
//! After a recovery round: a matching receipt succeeds; a replay refused with a status listed in
//! `replay_final_statuses` fails; this worker's own exhaustion defers the round; anything else
//! (another rejection included: it proves nothing about the original write) stays `unknown`
//! until the tool's `recovery_attempts` are spent, then is `held`, never `failed`.

use chrono::{DateTime, Utc};

use crate::config::ToolConfig;
use crate::document::Document;
use crate::ledger::{Operation, Transition};
use crate::outcome::{Outcome, Polled};
use crate::recovery::Capability;
use crate::retry::{retry_delay, with_retry_after, RetryPolicy};

/// The next state after a write attempt.
pub fn after_dispatch(
    op: &Operation,
    tool: &ToolConfig,
    outcome: Outcome,
    now: DateTime<Utc>,
) -> Transition {
    let policy = &tool.retry;
    match outcome {
        Outcome::Succeeded {
            receipt,
            receipt_id,
        } => Transition::Succeeded {
            evidence: format!("receipt {receipt_id} from write attempt {}", op.attempts),
            receipt,
            receipt_id,
        },
        Outcome::NotSent { .. } | Outcome::NotApplied { .. } => not_applied(op, tool, outcome, now),
        // Nothing left this process: try again, the claim's attempt given back, whatever
        // max_attempts and max_elapsed_secs say (the downstream never saw it).
        Outcome::LocalExhaustion { evidence } => Transition::Resend {
            delay: local_exhaustion_delay(),
            evidence,
        },
        Outcome::Rejected { evidence, .. } | Outcome::Failed { evidence } => {
            Transition::Failed { evidence }
        }
        Outcome::Accepted {
            operation_id,
            acceptance,
        } => accepted(tool, operation_id, acceptance),
        Outcome::Unknown { .. } | Outcome::LookupMiss { .. } => {
            let delay = match tool.capability {
                // Nothing to try: the scheduler holds it at once.
                Capability::None => Default::default(),
                _ => with_retry_after(policy, retry_delay(policy, 1), outcome.retry_after()),
            };
            Transition::Unknown {
                delay,
                evidence: outcome.evidence(),
            }
        }
    }
}

/// A write proven not applied: another one after the retry delay, or `failed` once
/// `retry.max_attempts` or `retry.max_elapsed_secs` is spent.
fn not_applied(
    op: &Operation,
    tool: &ToolConfig,
    outcome: Outcome,
    now: DateTime<Utc>,
) -> Transition {
    let policy = &tool.retry;
    let attempts = op.attempts.max(1) as u32;
    let elapsed = (now - op.created_at).to_std().unwrap_or_default();
    let evidence = outcome.evidence();
    if attempts >= policy.max_attempts {
        Transition::Failed {
            evidence: format!(
                "{attempts} write attempts, none applied (retry.max_attempts reached); last: {evidence}"
            ),
        }
    } else if elapsed.as_secs() >= policy.max_elapsed_secs {
        Transition::Failed {
            evidence: format!("not applied and retry.max_elapsed_secs passed; last: {evidence}"),
        }
    } else {
        let delay = with_retry_after(policy, retry_delay(policy, attempts), outcome.retry_after());
        Transition::RetryWait { delay, evidence }
    }
}

/// The next state after a lookup round on an `unknown` row whose lookup was sent after
/// `looked_at` (database clock). For a tool with `absence_proof` and a row whose every write
/// carried a deadline (`send_deadline`), a miss at or after [`AbsenceProof::proof_at`] proves
/// that no write committed or ever will: the write is not applied, and is sent again under the
/// same key like any proven-not-applied retry (or fails once its attempts are spent). A miss
/// before that point proves nothing: the row stays `unknown` and its next round is not due
/// before the proof point. Anything else is [`after_recovery`]'s.
///
/// [`AbsenceProof::proof_at`]: crate::config::AbsenceProof::proof_at
pub fn after_lookup(
    op: &Operation,
    tool: &ToolConfig,
    outcome: Outcome,
    looked_at: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> Transition {
    let (Outcome::LookupMiss { .. }, Some(proof), Some(deadline), Some(looked_at)) =
        (&outcome, &tool.absence_proof, op.send_deadline, looked_at)
    else {
        return after_recovery(op, tool, outcome);
    };
    let proof_at = proof.proof_at(deadline);
    let stamp = |t: DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    if looked_at >= proof_at {
        let evidence = format!(
            "{PROOF_OF_ABSENCE}: the lookup sent after {} missed, and the last request's deadline \
             {} plus clock_skew_ms = {} and settle_ms = {} had passed; not applied ({})",
            stamp(looked_at),
            stamp(deadline),
            proof.clock_skew.as_millis(),
            proof.settle.as_millis(),
            outcome.evidence()
        );
        return not_applied(
            op,
            tool,
            Outcome::NotApplied {
                evidence,
                retry_after: None,
            },
            now,
        );
    }
    let early = Outcome::Unknown {
        evidence: format!(
            "{}; before {}, the last request's deadline {} plus clock skew and settle time, a \
             miss proves nothing",
            outcome.evidence(),
            stamp(proof_at),
            stamp(deadline)
        ),
        retry_after: None,
    };
    match recovery_unproven(op, tool, early) {
        Transition::Unknown { delay, evidence } => {
            let until_proof = (proof_at - looked_at).to_std().unwrap_or_default();
            Transition::Unknown {
                delay: delay.max(until_proof),
                evidence,
            }
        }
        held => held,
    }
}

/// The next state after a recovery round (lookup or replay) on an `unknown` row in round
/// `op.recovery_attempts`.
pub fn after_recovery(op: &Operation, tool: &ToolConfig, outcome: Outcome) -> Transition {
    match outcome {
        Outcome::Succeeded {
            receipt,
            receipt_id,
        } => Transition::Succeeded {
            evidence: format!(
                "receipt {receipt_id} recovered in round {}",
                op.recovery_attempts
            ),
            receipt,
            receipt_id,
        },
        // A status answered to a replay proves nothing about the original write (a rotated API
        // key, a WAF, a deploy serving 404): only the statuses the tool lists are final.
        Outcome::Rejected { status, evidence } if tool.replay_final_statuses.contains(&status) => {
            Transition::Failed {
                evidence: format!(
                    "the downstream refused the original request on replay with HTTP {status}, \
                     listed in replay_final_statuses: {evidence}"
                ),
            }
        }
        // The lookup or replay never left this worker: the round did not happen, so it is
        // deferred and given back (the row stays unknown).
        Outcome::LocalExhaustion { .. } => Transition::Defer {
            delay: local_exhaustion_delay(),
        },
        Outcome::Rejected { status, evidence } => recovery_unproven(
            op,
            tool,
            Outcome::Unknown {
                evidence: format!(
                    "replay answered HTTP {status}, which proves nothing about the original \
                     request (not in replay_final_statuses): {evidence}"
                ),
                retry_after: None,
            },
        ),
        // A replay answered with the acceptance, or a lookup that found the operation in
        // progress: polled from now on (the ledger holds one naming another operation).
        Outcome::Accepted {
            operation_id,
            acceptance,
        } => accepted(tool, operation_id, acceptance),
        Outcome::Failed { evidence } => Transition::Failed { evidence },
        other => recovery_unproven(op, tool, other),
    }
}

/// `accepted`, the first poll due after the tool's first delay. A tool without an async
/// contract cannot have produced an acceptance; if one did, the outcome is unknown.
fn accepted(tool: &ToolConfig, operation_id: String, acceptance: Document) -> Transition {
    match tool.completion.contract() {
        Some(contract) => Transition::Accepted {
            evidence: format!("accepted as operation {operation_id}; polling its status"),
            operation_id,
            acceptance,
            delay: contract.poll.delay(std::time::Duration::ZERO),
            deadline: contract.poll.deadline(),
        },
        None => Transition::Unknown {
            delay: retry_delay(&tool.retry, 1),
            evidence: format!(
                "accepted as operation {operation_id}, but tool {} declares no async contract",
                tool.name
            ),
        },
    }
}

/// The next state after a poll of an `accepted` operation at `now`: done with a matching
/// receipt succeeds; the downstream's documented failure fails; anything else (still running,
/// or nothing proven: no answer, 404, 5xx, an unreadable document) polls again after a delay
/// that grows with the operation's age, until the deadline passes: then `held`, a person
/// decides. This worker's own exhaustion defers the poll. Pure.
pub fn after_poll(
    op: &Operation,
    tool: &ToolConfig,
    polled: Polled,
    now: DateTime<Utc>,
) -> Transition {
    let remote = op.remote_id.as_deref().unwrap_or("?");
    match polled {
        Polled::Done {
            receipt,
            receipt_id,
        } => Transition::Succeeded {
            evidence: format!("operation {remote} done: receipt {receipt_id} read from its status"),
            receipt,
            receipt_id,
        },
        Polled::Failed { evidence } => Transition::Failed {
            evidence: format!("operation {remote} failed, as its status says: {evidence}"),
        },
        Polled::LocalExhaustion { .. } => Transition::Defer {
            delay: local_exhaustion_delay(),
        },
        Polled::Running { evidence } | Polled::Unproven { evidence } => {
            let Some(contract) = tool.completion.contract() else {
                return Transition::Held {
                    evidence: format!(
                        "tool {} is no longer async; operation {remote} needs a person",
                        tool.name
                    ),
                };
            };
            let deadline = op.poll_deadline.unwrap_or(now);
            if now >= deadline {
                return Transition::Held {
                    evidence: format!(
                        "{ASYNC_DEADLINE}: operation {remote} was not done {} s after it was \
                         accepted (poll.deadline_secs); last: {evidence}",
                        contract.poll.deadline_secs
                    ),
                };
            }
            let deadline_span = chrono::Duration::from_std(contract.poll.deadline())
                .unwrap_or(chrono::Duration::MAX);
            let age = (now - (deadline - deadline_span))
                .to_std()
                .unwrap_or_default();
            Transition::Poll {
                delay: contract.poll.delay(age),
                evidence,
            }
        }
    }
}

/// The words the evidence of a write proven absent by a lookup miss ([`after_lookup`]) carries.
pub const PROOF_OF_ABSENCE: &str = "proof of absence";

/// The words a row held at its poll deadline starts its evidence with: the cause class
/// `async_deadline` ([`crate::ledger::cause`]).
pub const ASYNC_DEADLINE: &str = "async_deadline";

/// A recovery round that brought no matching receipt: unknown again, or held once the tool's
/// recovery rounds are spent. The answer is kept as evidence.
fn recovery_unproven(op: &Operation, tool: &ToolConfig, other: Outcome) -> Transition {
    let round = op.recovery_attempts.max(1) as u32;
    if round >= tool.recovery_attempts {
        Transition::Held {
            evidence: format!(
                "recovery attempts exhausted ({round}) without a matching receipt; last: {}",
                other.evidence()
            ),
        }
    } else {
        let delay = with_retry_after(
            &tool.retry,
            retry_delay(&tool.retry, round),
            other.retry_after(),
        );
        Transition::Unknown {
            delay,
            evidence: other.evidence(),
        }
    }
}

/// How long a write or recovery round stopped by this worker's own exhaustion waits before it
/// is tried again: about a second (±50 %), long enough for descriptors to come back, short
/// enough that the action is not held up once they have.
pub fn local_exhaustion_delay() -> std::time::Duration {
    retry_delay(
        &RetryPolicy {
            initial_delay_ms: 1_000,
            multiplier: 1.0,
            max_delay_ms: 1_000,
            jitter: 0.5,
            ..RetryPolicy::default()
        },
        1,
    )
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use serde_json::json;

    use super::*;
    use crate::ledger::{State, StateColumn};
    use crate::retry::BudgetPolicy;

    /// A retry policy without jitter, so every delay in the tables is exact: 100 ms doubling,
    /// at most 1 s, three write attempts, an hour.
    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 3,
            initial_delay_ms: 100,
            multiplier: 2.0,
            max_delay_ms: 1_000,
            jitter: 0.0,
            max_elapsed_secs: 3_600,
            not_applied_statuses: vec![429],
        }
    }

    fn tool(capability: Capability) -> ToolConfig {
        ToolConfig {
            name: "refund".into(),
            url: "http://127.0.0.1:9/refunds".into(),
            method: "POST".into(),
            idempotency_header: "Idempotency-Key".into(),
            timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
            receipt_id: "/receipt_id".into(),
            receipt_match: BTreeMap::new(),
            capability,
            replay_final_statuses: vec![422],
            recovery_attempts: 3,
            retry: policy(),
            budget: BudgetPolicy::default(),
            headers: BTreeMap::new(),
            completion: Default::default(),
            absence_proof: None,
            approval: None,
            compensation_for: Vec::new(),
        }
    }

    fn replay() -> Capability {
        Capability::Replay {
            window: Duration::from_secs(600),
            margin: Duration::from_secs(60),
        }
    }

    /// An operation after `attempts` writes and `rounds` recovery rounds, recorded `age` ago.
    fn op(attempts: i32, rounds: i32, age: chrono::Duration) -> Operation {
        let now = Utc::now();
        Operation {
            id: 7,
            tenant: "tenant-a".into(),
            action_id: "k-1".into(),
            tool: "refund".into(),
            fingerprint: "f".into(),
            arguments: Some("{}".into()),
            call_id: None,
            reply_to: None,
            state: StateColumn(State::Dispatching),
            fence: 1,
            lease_owner: None,
            lease_until: None,
            attempts,
            recovery_attempts: rounds,
            next_attempt_at: None,
            first_dispatch_at: Some(now - age),
            replay_deadline: None,
            receipt: None,
            receipt_id: None,
            evidence: None,
            last_reported: None,
            created_at: now - age,
            updated_at: now,
            state_since: now,
            swept_at: None,
            traceparent: None,
            tracestate: None,
            remote_id: None,
            acceptance: None,
            poll_deadline: None,
            verified_by: None,
            send_deadline: None,
            compensates: None,
        }
    }

    fn succeeded() -> Outcome {
        Outcome::Succeeded {
            receipt: Document::from_value(json!({"receipt_id": "r-1"})),
            receipt_id: "r-1".into(),
        }
    }
    fn not_sent() -> Outcome {
        Outcome::NotSent {
            evidence: "connection refused".into(),
        }
    }
    fn not_applied(retry_after: Option<u64>) -> Outcome {
        Outcome::NotApplied {
            evidence: "HTTP 429".into(),
            retry_after: retry_after.map(Duration::from_millis),
        }
    }
    fn exhausted() -> Outcome {
        Outcome::LocalExhaustion {
            evidence: "EMFILE".into(),
        }
    }
    fn rejected(status: u16) -> Outcome {
        Outcome::Rejected {
            status,
            evidence: format!("HTTP {status}"),
        }
    }
    fn unknown(retry_after: Option<u64>) -> Outcome {
        Outcome::Unknown {
            evidence: "timed out".into(),
            retry_after: retry_after.map(Duration::from_millis),
        }
    }
    fn miss() -> Outcome {
        Outcome::LookupMiss {
            evidence: "lookup: 404".into(),
        }
    }

    /// What a row of a table expects: the transition's kind, its delay when it has an exact
    /// one, and a piece of its evidence.
    #[derive(Debug, PartialEq)]
    enum Next {
        Succeeded,
        Failed,
        RetryWait(u64),
        Resend,
        Unknown(u64),
        Held,
        Defer,
        Accepted(String),
        Poll,
    }

    /// The kind, the exact delay in ms (for the jitter-free ones) and the evidence.
    fn seen(t: &Transition) -> (Next, String) {
        let ms = |d: &Duration| d.as_millis() as u64;
        match t {
            Transition::Succeeded { evidence, .. } => (Next::Succeeded, evidence.clone()),
            Transition::Failed { evidence } => (Next::Failed, evidence.clone()),
            Transition::RetryWait { delay, evidence } => {
                (Next::RetryWait(ms(delay)), evidence.clone())
            }
            Transition::Resend { delay, evidence } => {
                // About a second, ±50 %.
                assert!((500..=1_500).contains(&ms(delay)), "{delay:?}");
                (Next::Resend, evidence.clone())
            }
            Transition::Unknown { delay, evidence } => (Next::Unknown(ms(delay)), evidence.clone()),
            Transition::Held { evidence } => (Next::Held, evidence.clone()),
            Transition::Defer { delay } => {
                assert!((500..=1_500).contains(&ms(delay)), "{delay:?}");
                (Next::Defer, String::new())
            }
            Transition::Accepted {
                operation_id,
                evidence,
                ..
            } => (Next::Accepted(operation_id.clone()), evidence.clone()),
            Transition::Poll { evidence, .. } => (Next::Poll, evidence.clone()),
        }
    }

    #[test]
    fn after_a_write_every_outcome_leads_where_the_table_says() {
        let fresh = chrono::Duration::seconds(1);
        let old = chrono::Duration::seconds(3_600);
        #[rustfmt::skip]
        let table: Vec<(&str, Capability, Operation, Outcome, Next, &str)> = vec![
            ("a matching receipt succeeds", replay(), op(1, 0, fresh), succeeded(),
             Next::Succeeded, "receipt r-1 from write attempt 1"),
            ("not sent, attempts left: retry after the policy's delay", replay(), op(1, 0, fresh), not_sent(),
             Next::RetryWait(100), "connection refused"),
            ("the delay grows with the attempts", replay(), op(2, 0, fresh), not_sent(),
             Next::RetryWait(200), "connection refused"),
            ("not applied: a longer Retry-After wins", replay(), op(1, 0, fresh), not_applied(Some(700)),
             Next::RetryWait(700), "HTTP 429"),
            ("a Retry-After never exceeds max_delay_ms", replay(), op(1, 0, fresh), not_applied(Some(60_000)),
             Next::RetryWait(1_000), "HTTP 429"),
            ("a shorter Retry-After loses to the policy", replay(), op(2, 0, fresh), not_applied(Some(10)),
             Next::RetryWait(200), "HTTP 429"),
            ("not sent with max_attempts spent fails", replay(), op(3, 0, fresh), not_sent(),
             Next::Failed, "3 write attempts, none applied (retry.max_attempts reached); last: connection refused"),
            ("not applied with max_attempts spent fails", replay(), op(3, 0, fresh), not_applied(None),
             Next::Failed, "retry.max_attempts reached"),
            ("not applied past max_elapsed_secs fails", replay(), op(1, 0, old), not_applied(None),
             Next::Failed, "not applied and retry.max_elapsed_secs passed; last: HTTP 429"),
            ("local exhaustion resends, whatever the attempts", replay(), op(3, 0, old), exhausted(),
             Next::Resend, "EMFILE"),
            ("a definitive rejection fails", replay(), op(1, 0, fresh), rejected(400),
             Next::Failed, "HTTP 400"),
            ("may have applied, with recovery: unknown after the first delay", replay(), op(2, 0, fresh), unknown(None),
             Next::Unknown(100), "timed out"),
            ("may have applied: a Retry-After delays recovery", replay(), op(1, 0, fresh), unknown(Some(400)),
             Next::Unknown(400), "timed out"),
            ("may have applied, without recovery: unknown at once", Capability::None, op(1, 0, fresh), unknown(Some(400)),
             Next::Unknown(0), "timed out"),
            ("a lookup miss is unknown, never failed", Capability::Lookup { url_template: "http://a/{key}".into() },
             op(1, 0, fresh), miss(), Next::Unknown(100), "lookup: 404"),
        ];
        for (row, capability, op, outcome, want, evidence) in table {
            let (next, said) = seen(&after_dispatch(&op, &tool(capability), outcome, Utc::now()));
            assert_eq!(next, want, "{row}");
            assert!(said.contains(evidence), "{row}: {said}");
        }
    }

    #[test]
    fn after_a_recovery_round_every_outcome_leads_where_the_table_says() {
        let t = chrono::Duration::seconds(1);
        #[rustfmt::skip]
        let table: Vec<(&str, Operation, Outcome, Next, &str)> = vec![
            ("a matching receipt succeeds", op(1, 2, t), succeeded(),
             Next::Succeeded, "receipt r-1 recovered in round 2"),
            ("a replay refused with a listed status fails", op(1, 1, t), rejected(422),
             Next::Failed, "HTTP 422, listed in replay_final_statuses"),
            ("another refusal proves nothing: unknown, rounds left", op(1, 1, t), rejected(404),
             Next::Unknown(100), "replay answered HTTP 404, which proves nothing"),
            ("another refusal with the rounds spent is held", op(1, 3, t), rejected(404),
             Next::Held, "recovery attempts exhausted (3)"),
            ("local exhaustion defers the round", op(1, 3, t), exhausted(),
             Next::Defer, ""),
            ("unknown with rounds left waits the round's delay", op(1, 2, t), unknown(None),
             Next::Unknown(200), "timed out"),
            ("a Retry-After delays the next round", op(1, 1, t), unknown(Some(800)),
             Next::Unknown(800), "timed out"),
            ("unknown with the rounds spent is held, never failed", op(1, 3, t), unknown(None),
             Next::Held, "without a matching receipt; last: timed out"),
            ("a lookup miss with rounds left stays unknown", op(1, 1, t), miss(),
             Next::Unknown(100), "lookup: 404"),
            ("a lookup miss with the rounds spent is held", op(1, 3, t), miss(),
             Next::Held, "last: lookup: 404"),
            ("not sent on replay stays unknown", op(1, 1, t), not_sent(),
             Next::Unknown(100), "connection refused"),
            ("not applied on replay stays unknown", op(1, 1, t), not_applied(None),
             Next::Unknown(100), "HTTP 429"),
            ("round 0 counts as the first", op(1, 0, t), unknown(None),
             Next::Unknown(100), "timed out"),
        ];
        for (row, op, outcome, want, evidence) in table {
            let (next, said) = seen(&after_recovery(&op, &tool(replay()), outcome));
            assert_eq!(next, want, "{row}");
            assert!(said.contains(evidence), "{row}: {said}");
        }
    }

    /// An async tool: polls from 1 s up to 8 s, held after a minute.
    fn async_tool() -> ToolConfig {
        ToolConfig {
            completion: crate::config::Completion::Async(Box::new(crate::config::AsyncContract {
                accepted_statuses: vec![202],
                operation_id: "/operation_id".into(),
                status_url: "http://d/ops/{operation_id}".into(),
                done_match: [("/state".to_string(), json!("succeeded"))].into(),
                failed_match: [("/state".to_string(), json!("failed"))].into(),
                poll: crate::config::PollPolicy {
                    first_ms: 1_000,
                    max_ms: 8_000,
                    deadline_secs: 60,
                },
                callback: None,
            })),
            ..tool(replay())
        }
    }

    fn accepted_outcome(id: &str) -> Outcome {
        Outcome::Accepted {
            operation_id: id.into(),
            acceptance: Document::from_value(json!({"operation_id": id, "state": "running"})),
        }
    }

    #[test]
    fn an_acceptance_is_accepted_with_the_first_poll_and_the_deadline() {
        let t = chrono::Duration::seconds(1);
        for (row, transition) in [
            (
                "after a write",
                after_dispatch(
                    &op(1, 0, t),
                    &async_tool(),
                    accepted_outcome("op-1"),
                    Utc::now(),
                ),
            ),
            (
                "after a replay",
                after_recovery(&op(1, 1, t), &async_tool(), accepted_outcome("op-1")),
            ),
        ] {
            let Transition::Accepted {
                operation_id,
                delay,
                deadline,
                evidence,
                ..
            } = transition
            else {
                panic!("{row}: {transition:?}")
            };
            assert_eq!(operation_id, "op-1", "{row}");
            assert!(
                (500..=1_500).contains(&(delay.as_millis() as u64)),
                "{row}: {delay:?}"
            );
            assert_eq!(deadline, Duration::from_secs(60), "{row}");
            assert!(
                evidence.contains("accepted as operation op-1"),
                "{row}: {evidence}"
            );
        }
        // The downstream's documented failure of an accepted operation fails it.
        let failed = Outcome::Failed {
            evidence: "state failed".into(),
        };
        let (next, _) = seen(&after_recovery(&op(1, 1, t), &async_tool(), failed));
        assert_eq!(next, Next::Failed);
        // A sync tool never polls: an acceptance it somehow produced proves nothing.
        let (next, said) = seen(&after_dispatch(
            &op(1, 0, t),
            &tool(replay()),
            accepted_outcome("op-1"),
            Utc::now(),
        ));
        assert_eq!(next, Next::Unknown(100));
        assert!(said.contains("declares no async contract"), "{said}");
    }

    /// An accepted operation, accepted `age` ago (its deadline a minute after).
    fn accepted_op(age: chrono::Duration) -> Operation {
        let now = Utc::now();
        Operation {
            state: StateColumn(State::Accepted),
            remote_id: Some("op-9".into()),
            poll_deadline: Some(now - age + chrono::Duration::seconds(60)),
            ..op(1, 0, age)
        }
    }

    #[test]
    fn after_a_poll_every_answer_leads_where_the_table_says() {
        let early = chrono::Duration::seconds(2);
        let late = chrono::Duration::seconds(61);
        let run = |e: &str| Polled::Running { evidence: e.into() };
        let unproven = |e: &str| Polled::Unproven { evidence: e.into() };
        #[rustfmt::skip]
        let table: Vec<(&str, Operation, Polled, Next, &str)> = vec![
            ("done with the receipt succeeds", accepted_op(early),
             Polled::Done { receipt: Document::from_value(json!({"deployment_id": "d-1"})), receipt_id: "d-1".into() },
             Next::Succeeded, "operation op-9 done: receipt d-1"),
            ("the documented failure fails", accepted_op(early),
             Polled::Failed { evidence: "{\"state\":\"failed\"}".into() },
             Next::Failed, "operation op-9 failed, as its status says"),
            ("still running polls again", accepted_op(early), run("still running"),
             Next::Poll, "still running"),
            ("a 404 proves nothing: poll again", accepted_op(early), unproven("HTTP 404"),
             Next::Poll, "HTTP 404"),
            ("running past the deadline is held", accepted_op(late), run("still running"),
             Next::Held, "async_deadline: operation op-9 was not done 60 s after"),
            ("nothing proven past the deadline is held", accepted_op(late), unproven("HTTP 503"),
             Next::Held, "last: HTTP 503"),
            ("done past the deadline still succeeds", accepted_op(late),
             Polled::Done { receipt: Document::from_value(json!({"deployment_id": "d-1"})), receipt_id: "d-1".into() },
             Next::Succeeded, "receipt d-1"),
            ("local exhaustion defers the poll", accepted_op(early),
             Polled::LocalExhaustion { evidence: "EMFILE".into() }, Next::Defer, ""),
        ];
        for (row, op, polled, want, evidence) in table {
            let (next, said) = seen(&after_poll(&op, &async_tool(), polled, Utc::now()));
            assert_eq!(next, want, "{row}");
            assert!(said.contains(evidence), "{row}: {said}");
        }
    }

    #[test]
    fn the_next_poll_waits_about_as_long_as_the_operation_is_old() {
        for (age_s, lo_ms, hi_ms) in [(2, 1_000, 3_000), (6, 3_000, 8_000), (40, 4_000, 8_000)] {
            let op = accepted_op(chrono::Duration::seconds(age_s));
            let t = after_poll(
                &op,
                &async_tool(),
                Polled::Running {
                    evidence: String::new(),
                },
                Utc::now(),
            );
            let Transition::Poll { delay, .. } = t else {
                panic!("{t:?}")
            };
            let ms = delay.as_millis() as u64;
            assert!((lo_ms..=hi_ms).contains(&ms), "age {age_s} s: {ms} ms");
        }
    }

    fn proof_tool() -> ToolConfig {
        ToolConfig {
            absence_proof: Some(crate::config::AbsenceProof {
                header: "Request-Deadline".into(),
                deadline: Duration::from_secs(30),
                clock_skew: Duration::from_secs(5),
                settle: Duration::from_secs(1),
                refused_statuses: vec![422],
            }),
            ..tool(Capability::Lookup {
                url_template: "http://a/{key}".into(),
            })
        }
    }

    #[test]
    fn a_miss_proves_absence_only_after_the_deadline_with_skew_and_settle_time() {
        let tool = proof_tool();
        let now = Utc::now();
        let deadline = now - chrono::Duration::seconds(10);
        let mut row = op(1, 1, chrono::Duration::seconds(40));
        row.send_deadline = Some(deadline);
        let ms = chrono::Duration::milliseconds;
        // Proof point: the deadline + 5 s skew + 1 s settle.
        let at_proof = deadline + ms(6_000);
        match after_lookup(&row, &tool, miss(), Some(at_proof), now) {
            Transition::RetryWait { delay, evidence } => {
                assert_eq!(delay, Duration::from_millis(100));
                assert!(evidence.contains("proof of absence"), "{evidence}");
                assert!(
                    evidence
                        .contains(&deadline.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)),
                    "{evidence}"
                );
            }
            other => panic!("{other:?}"),
        }
        // A millisecond earlier proves nothing: unknown, next round not before the proof point.
        match after_lookup(&row, &tool, miss(), Some(at_proof - ms(1)), now) {
            Transition::Unknown { delay, evidence } => {
                assert_eq!(
                    delay,
                    Duration::from_millis(100).max(Duration::from_millis(1))
                );
                assert!(evidence.contains("proves nothing"), "{evidence}");
            }
            other => panic!("{other:?}"),
        }
        match after_lookup(&row, &tool, miss(), Some(at_proof - ms(4_000)), now) {
            Transition::Unknown { delay, .. } => assert_eq!(delay, Duration::from_secs(4)),
            other => panic!("{other:?}"),
        }
        // Early with the rounds spent: held, never resent.
        let spent = Operation {
            recovery_attempts: 3,
            ..row.clone()
        };
        assert!(matches!(
            after_lookup(&spent, &tool, miss(), Some(at_proof - ms(1)), now),
            Transition::Held { .. }
        ));
        // Proven with the write attempts spent: failed (nothing was applied).
        let tried = Operation {
            attempts: 3,
            ..row.clone()
        };
        match after_lookup(&tried, &tool, miss(), Some(at_proof), now) {
            Transition::Failed { evidence } => {
                assert!(
                    evidence.contains("max_attempts") && evidence.contains("proof of absence"),
                    "{evidence}"
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn without_a_stored_deadline_or_the_contract_a_miss_is_what_it_always_was() {
        let now = Utc::now();
        let later = Some(now + chrono::Duration::days(1));
        let mut row = op(1, 1, chrono::Duration::seconds(40));
        // Sent without a deadline (or before the tool declared absence_proof).
        let transition = after_lookup(&row, &proof_tool(), miss(), later, now);
        assert!(
            matches!(transition, Transition::Unknown { .. }),
            "{transition:?}"
        );
        // A tool without the contract, whatever the row says.
        row.send_deadline = Some(now - chrono::Duration::days(1));
        let plain = tool(Capability::Lookup {
            url_template: "http://a/{key}".into(),
        });
        let transition = after_lookup(&row, &plain, miss(), later, now);
        assert!(
            matches!(transition, Transition::Unknown { .. }),
            "{transition:?}"
        );
        // Not a miss: an error proves nothing, a receipt succeeds, as in any lookup.
        let transition = after_lookup(&row, &proof_tool(), unknown(None), later, now);
        assert!(
            matches!(transition, Transition::Unknown { .. }),
            "{transition:?}"
        );
        let transition = after_lookup(&row, &proof_tool(), succeeded(), later, now);
        assert!(
            matches!(transition, Transition::Succeeded { .. }),
            "{transition:?}"
        );
        // No lease time known: no proof.
        let transition = after_lookup(&row, &proof_tool(), miss(), None, now);
        assert!(
            matches!(transition, Transition::Unknown { .. }),
            "{transition:?}"
        );
    }
}
