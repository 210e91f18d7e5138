//! `worker check-tool NAME`: probes a (sandbox or staging) downstream from outside to see
//! whether it really has the recovery capability the tools file declares for it.
//!
//! Every probe goes through the tool's own [`HttpAdapter`] (same client, headers, timeouts,
//! outcome classification and receipt check as the worker), so a receipt the checker accepts
//! is one the worker would accept. The probes perform real writes under the tenant
//! [`PROBE_TENANT`] with action ids `probe-<run>-<probe>`, so they are easy to find and undo.

use std::collections::BTreeSet;

use serde::Serialize;

use crate::adapter::http::{Answer, HttpAdapter};
use crate::adapter::Request;
use crate::config::{AbsenceProof, ToolConfig};
use crate::ledger::idempotency_key;
use crate::outcome::{Outcome, Polled};
use crate::recovery::Capability;

/// The tenant every probe writes as: it says it is a probe.
pub const PROBE_TENANT: &str = "intent-worker-probe";
/// Field added to the body of the "same key, another body" probe.
const VARIANT_FIELD: &str = "intent_worker_probe_variant";

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("--body must be a JSON object: {0}")]
    Body(String),
    #[error(transparent)]
    Build(#[from] crate::adapter::http::BuildError),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Verdict {
    /// The downstream behaved as the declared capability needs.
    Pass,
    /// The downstream contradicts the declared capability (or gave no usable receipt).
    Fail,
    /// Worth knowing, proves nothing either way.
    Info,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::Info => "INFO",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Probe {
    pub name: &'static str,
    pub verdict: Verdict,
    /// One line on what the answer means.
    pub message: String,
    /// What the downstream answered, as the worker's adapter classified it.
    pub evidence: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub tool: String,
    pub capability: &'static str,
    pub url: String,
    pub tenant: &'static str,
    /// The run id inside every probe action id.
    pub run: String,
    pub probes: Vec<Probe>,
    /// False when any probe is a FAIL.
    pub ok: bool,
}

impl Report {
    /// Human-readable lines: one per probe, then a summary.
    pub fn text(&self) -> String {
        let mut out = format!(
            "check-tool {} (recovery = \"{}\", {}), probes as tenant {} run {}\n",
            self.tool, self.capability, self.url, self.tenant, self.run
        );
        for p in &self.probes {
            out.push_str(&format!(
                "{} {}: {}\n",
                p.verdict.as_str(),
                p.name,
                p.message
            ));
            if !p.evidence.is_empty() {
                out.push_str(&format!("     answer: {}\n", p.evidence));
            }
        }
        let count = |v| self.probes.iter().filter(|p| p.verdict == v).count();
        let verdict = if self.ok {
            "no probe contradicts the declared capability".to_owned()
        } else {
            format!(
                "a probe FAILed: do not rely on recovery = \"{}\" for this downstream",
                self.capability
            )
        };
        out.push_str(&format!(
            "{verdict}: {} PASS, {} FAIL, {} INFO\n",
            count(Verdict::Pass),
            count(Verdict::Fail),
            count(Verdict::Info)
        ));
        out
    }
}

/// Runs every probe the tool's capability calls for. `body` is the JSON object sent as the
/// write's arguments (a probe marker by default).
pub async fn run(
    config: &ToolConfig,
    trust: &crate::tls::Trust,
    body: Option<&str>,
) -> Result<Report, CheckError> {
    let run = uuid::Uuid::new_v4().to_string();
    let body: serde_json::Value = match body {
        Some(text) => serde_json::from_str(text).map_err(|e| CheckError::Body(e.to_string()))?,
        None => serde_json::json!({"intent_worker_probe": true, "probe_run": run}),
    };
    let serde_json::Value::Object(mut variant) = body.clone() else {
        return Err(CheckError::Body("not an object".into()));
    };
    variant.insert(VARIANT_FIELD.into(), "another-body".into());
    let adapter = HttpAdapter::new(config.clone(), trust)?;
    let checker = Checker {
        adapter,
        tool: config.name.clone(),
        run: run.clone(),
        body: body.to_string(),
        variant: serde_json::Value::Object(variant).to_string(),
        seen_4xx: Vec::new(),
        absence_proof: config.absence_proof.clone(),
    };
    let asynchronous = config.completion.contract().is_some();
    let mut probes = checker.probes(&config.capability, asynchronous).await;
    probes.extend(declaration_notes(config));
    Ok(Report {
        tool: config.name.clone(),
        capability: config.capability.name(),
        // Its host only: the URL's query or user part may hold a secret.
        url: kit::url::host_port(&config.url),
        tenant: PROBE_TENANT,
        run,
        ok: probes.iter().all(|p| p.verdict != Verdict::Fail),
        probes,
    })
}

/// What the declaration itself asks for that no probe can check from outside.
fn declaration_notes(config: &ToolConfig) -> Vec<Probe> {
    let mut notes = Vec::new();
    if let Capability::Replay { window, .. } = config.capability {
        notes.push(Probe {
            name: "replay-window",
            verdict: Verdict::Info,
            message: format!(
                "the downstream must remember each key for at least replay_window_secs = {}; \
                 that cannot be checked from outside: confirm it in its documentation",
                window.as_secs()
            ),
            evidence: String::new(),
        });
    }
    if let Some(proof) = &config.absence_proof {
        notes.push(Probe {
            name: "clock-skew",
            verdict: Verdict::Info,
            message: format!(
                "the downstream's clock must stay within clock_skew_ms = {} of the ledger \
                 database's (deadline-passed probed only this machine's): confirm how both are \
                 synchronised",
                proof.clock_skew.as_millis()
            ),
            evidence: String::new(),
        });
    }
    if config.receipt_match.is_empty() {
        notes.push(Probe {
            name: "receipt-match",
            verdict: Verdict::Info,
            message: "receipt_match = {} checks only that a receipt has an id: a receipt for \
                      another operation would be accepted, here and by the worker"
                .into(),
            evidence: String::new(),
        });
    }
    notes
}

/// Whether a Content-Type names `application/problem+json` (RFC 9457), parameters ignored.
fn is_problem_json(content_type: Option<&str>) -> bool {
    content_type
        .and_then(|c| c.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/problem+json"))
}

struct Checker {
    adapter: HttpAdapter,
    tool: String,
    run: String,
    body: String,
    variant: String,
    /// (probe, status, content type) of every 4xx seen, for the problem+json probe.
    seen_4xx: Vec<(&'static str, u16, Option<String>)>,
    /// The tool's proof-of-absence contract, probed when declared.
    absence_proof: Option<AbsenceProof>,
}

fn probe(
    name: &'static str,
    verdict: Verdict,
    message: impl Into<String>,
    answer: &Answer,
) -> Probe {
    Probe {
        name,
        verdict,
        message: message.into(),
        evidence: evidence(answer),
    }
}

fn evidence(answer: &Answer) -> String {
    match &answer.outcome {
        Outcome::Succeeded { receipt, .. } => format!("receipt {}", receipt.text()),
        other => format!("{}: {}", other.label(), other.evidence()),
    }
}

fn receipt_id(answer: &Answer) -> Option<&str> {
    match &answer.outcome {
        Outcome::Succeeded { receipt_id, .. } => Some(receipt_id),
        _ => None,
    }
}

impl Checker {
    fn request(&self, probe: &str, body: &str) -> Request {
        let action_id = format!("probe-{}-{probe}", self.run);
        Request {
            idempotency_key: idempotency_key(PROBE_TENANT, &action_id),
            tenant: PROBE_TENANT.into(),
            action_id,
            tool: self.tool.clone(),
            body: body.into(),
            trace: None,
            // As the worker's writes do: a live deadline on this machine's clock.
            deadline: self.absence_proof.as_ref().map(|p| {
                chrono::Utc::now() + chrono::Duration::from_std(p.deadline).unwrap_or_default()
            }),
        }
    }

    fn note(&mut self, name: &'static str, answer: &Answer) {
        if let Some(status @ 400..=499) = answer.status {
            self.seen_4xx
                .push((name, status, answer.content_type.clone()));
        }
    }

    async fn write(&mut self, name: &'static str, request: &Request, with_key: bool) -> Answer {
        let answer = self.adapter.probe_write(request, with_key).await;
        self.note(name, &answer);
        answer
    }

    async fn probes(mut self, capability: &Capability, asynchronous: bool) -> Vec<Probe> {
        let mut out = Vec::new();
        let first = self.request("first-write", &self.body.clone());
        let answer = self.write("first-write", &first, true).await;
        if asynchronous {
            out.extend(self.async_probes(capability, &first, &answer).await);
            out.push(self.no_key().await);
            out.push(self.problem_json());
            return out;
        }
        let first_id = receipt_id(&answer).map(str::to_owned);
        out.push(match &first_id {
            Some(id) => probe(
                "first-write",
                Verdict::Pass,
                format!("receipt {id} is accepted by the tool's receipt_id and receipt_match"),
                &answer,
            ),
            None => probe(
                "first-write",
                Verdict::Fail,
                "no receipt that receipt_id and receipt_match accept: the worker could never \
                 report this tool's writes as succeeded",
                &answer,
            ),
        });
        match (capability, &first_id) {
            (Capability::Replay { .. }, Some(id)) => {
                out.push(self.replay_same(&first, id).await);
                out.push(self.replay_other_body(&first, id).await);
                out.push(self.replay_concurrent().await);
            }
            (Capability::Lookup { .. }, Some(id)) => {
                out.push(self.lookup_written(&first, id).await);
                out.push(self.lookup_never_written().await);
                if let Some(proof) = self.absence_proof.clone() {
                    out.push(self.deadline_live(&first, &proof).await);
                    out.push(self.deadline_passed(&proof).await);
                }
            }
            (Capability::None, _) => {}
            (_, None) => out.push(Probe {
                name: "capability",
                verdict: Verdict::Info,
                message: format!(
                    "the {} probes need the first write's receipt and were not run",
                    capability.name()
                ),
                evidence: String::new(),
            }),
        }
        out.push(self.no_key().await);
        out.push(self.problem_json());
        out
    }

    /// An async tool's contract: the acceptance names an operation, its status URL answers
    /// for it, and (replay) a repeat of the same key names the same operation, or (lookup) the
    /// key finds it.
    async fn async_probes(
        &mut self,
        capability: &Capability,
        first: &Request,
        answer: &Answer,
    ) -> Vec<Probe> {
        let mut out = Vec::new();
        let Outcome::Accepted { operation_id, .. } = &answer.outcome else {
            out.push(probe(
                "acceptance",
                Verdict::Fail,
                "the write was not accepted with an operation id at operation_id (an answer in \
                 accepted_statuses naming the operation): the worker could not follow it",
                answer,
            ));
            return out;
        };
        let operation_id = operation_id.clone();
        out.push(probe(
            "acceptance",
            Verdict::Pass,
            format!("the write was accepted as operation {operation_id}"),
            answer,
        ));
        out.push(self.status_probe(first, &operation_id).await);
        match capability {
            Capability::Replay { .. } => {
                const NAME: &str = "replay-same-operation";
                let again = self.write(NAME, first, true).await;
                out.push(match &again.outcome {
                    Outcome::Accepted {
                        operation_id: id, ..
                    } if *id == operation_id => probe(
                        NAME,
                        Verdict::Pass,
                        "a repeat of the same key named the same operation: a recovery replay \
                         cannot start a second one",
                        &again,
                    ),
                    Outcome::Accepted {
                        operation_id: id, ..
                    } => probe(
                        NAME,
                        Verdict::Fail,
                        format!(
                            "a repeat of the same key started another operation ({id}, first \
                             {operation_id}): this downstream does not replay; declare `none`"
                        ),
                        &again,
                    ),
                    _ => probe(
                        NAME,
                        Verdict::Fail,
                        "a repeat of the same key was not answered with the operation's \
                         acceptance: a `replay` async tool must name the same operation again",
                        &again,
                    ),
                });
            }
            Capability::Lookup { .. } => {
                const NAME: &str = "lookup-operation";
                let found = self.adapter.probe_lookup(first).await;
                self.note(NAME, &found);
                out.push(match &found.outcome {
                    Outcome::Accepted {
                        operation_id: id, ..
                    } if *id == operation_id => probe(
                        NAME,
                        Verdict::Pass,
                        "the lookup of the key found the operation in progress",
                        &found,
                    ),
                    Outcome::Succeeded { .. } | Outcome::Failed { .. } => probe(
                        NAME,
                        Verdict::Pass,
                        "the lookup of the key found the operation, already ended",
                        &found,
                    ),
                    _ => probe(
                        NAME,
                        Verdict::Fail,
                        "the lookup of the key did not find the operation: recovery by lookup \
                         could not tell it was accepted",
                        &found,
                    ),
                });
            }
            Capability::None => {}
        }
        out
    }

    /// The status URL answers for the accepted operation (a few tries over two seconds: a
    /// status may become readable a moment after the acceptance).
    async fn status_probe(&mut self, first: &Request, operation_id: &str) -> Probe {
        const NAME: &str = "status-url";
        let mut polled = self.adapter.read_status(first, operation_id).await;
        for _ in 0..4 {
            if !matches!(polled, Polled::Unproven { .. }) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            polled = self.adapter.read_status(first, operation_id).await;
        }
        let (verdict, message) = match &polled {
            Polled::Running { .. } => (
                Verdict::Pass,
                "the status URL answers: still running".to_string(),
            ),
            Polled::Done { receipt_id, .. } => (
                Verdict::Pass,
                format!("the status URL answers: done, with receipt {receipt_id} the tool accepts"),
            ),
            Polled::Failed { .. } => (Verdict::Pass, "the status URL answers: failed".to_string()),
            Polled::Unproven { .. } | Polled::LocalExhaustion { .. } => (
                Verdict::Fail,
                "the status URL did not answer for the accepted operation: the worker could \
                 never learn its end; check status_url"
                    .to_string(),
            ),
        };
        Probe {
            name: NAME,
            verdict,
            message,
            evidence: polled.evidence(),
        }
    }

    async fn replay_same(&mut self, first: &Request, first_id: &str) -> Probe {
        const NAME: &str = "replay-same-request";
        let answer = self.write(NAME, first, true).await;
        match receipt_id(&answer) {
            Some(id) if id == first_id => probe(
                NAME,
                Verdict::Pass,
                "the same request under the same key returned the original receipt: a \
                 recovery replay cannot apply twice",
                &answer,
            ),
            Some(id) => probe(
                NAME,
                Verdict::Fail,
                format!(
                    "a new receipt id ({id}, first was {first_id}): this downstream does not \
                     replay; declare `lookup` or `none`"
                ),
                &answer,
            ),
            None => probe(
                NAME,
                Verdict::Fail,
                "the same request under the same key did not return the original receipt: \
                 a `replay` tool must answer a repeat with it (2xx)",
                &answer,
            ),
        }
    }

    async fn replay_other_body(&mut self, first: &Request, first_id: &str) -> Probe {
        const NAME: &str = "replay-different-body";
        let mut request = first.clone();
        request.body = self.variant.clone();
        let answer = self.write(NAME, &request, true).await;
        match (receipt_id(&answer), answer.status) {
            (Some(id), _) if id != first_id => probe(
                NAME,
                Verdict::Fail,
                format!(
                    "the same key with another body created a new receipt ({id}, first was \
                     {first_id}): the key is ignored when the body differs; expected 409 or 422"
                ),
                &answer,
            ),
            (Some(_), _) => probe(
                NAME,
                Verdict::Info,
                "the same key with another body returned the original receipt: nothing new \
                 was applied, but the mismatch went unnoticed (the draft expects 422)",
                &answer,
            ),
            (None, Some(status @ (409 | 422))) => probe(
                NAME,
                Verdict::Pass,
                format!("the same key with another body was refused with {status}, as expected"),
                &answer,
            ),
            (None, _) => probe(
                NAME,
                Verdict::Info,
                "the same key with another body got no receipt, but not the expected 409 or 422",
                &answer,
            ),
        }
    }

    async fn replay_concurrent(&mut self) -> Probe {
        const NAME: &str = "replay-concurrent";
        let request = self.request("concurrent", &self.body.clone());
        let (a, b) = tokio::join!(
            self.adapter.probe_write(&request, true),
            self.adapter.probe_write(&request, true)
        );
        self.note(NAME, &a);
        self.note(NAME, &b);
        let ids: BTreeSet<&str> = [&a, &b].into_iter().filter_map(receipt_id).collect();
        let evidence = format!("1st: {}; 2nd: {}", evidence(&a), evidence(&b));
        let (verdict, message) = match ids.len() {
            0 => (
                Verdict::Info,
                "neither of two concurrent requests under one new key got a receipt".to_owned(),
            ),
            1 => (
                Verdict::Pass,
                "two concurrent requests under one new key got at most one receipt: a replay \
                 racing the original write cannot apply twice"
                    .to_owned(),
            ),
            _ => (
                Verdict::Fail,
                format!(
                    "two concurrent requests under one new key created {} receipts ({}): \
                     same-key requests are not serialised (expected one receipt, or 409 for \
                     the second); declare `lookup` or `none`",
                    ids.len(),
                    ids.into_iter().collect::<Vec<_>>().join(", ")
                ),
            ),
        };
        Probe {
            name: NAME,
            verdict,
            message,
            evidence,
        }
    }

    async fn lookup_written(&mut self, first: &Request, first_id: &str) -> Probe {
        const NAME: &str = "lookup-written";
        // A completed write must become visible; allow an eventually consistent read a
        // moment before calling it a miss.
        let mut answer = self.adapter.probe_lookup(first).await;
        for _ in 0..4 {
            if !matches!(answer.outcome, Outcome::LookupMiss { .. }) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            answer = self.adapter.probe_lookup(first).await;
        }
        self.note(NAME, &answer);
        match receipt_id(&answer) {
            Some(id) if id == first_id => probe(
                NAME,
                Verdict::Pass,
                "the lookup of the written key returned the original receipt, and it matches",
                &answer,
            ),
            Some(id) => probe(
                NAME,
                Verdict::Fail,
                format!(
                    "the lookup of the written key returned another receipt ({id}, the write \
                     returned {first_id})"
                ),
                &answer,
            ),
            None => probe(
                NAME,
                Verdict::Fail,
                "the lookup of the written key did not return its matching receipt (200): \
                 recovery by lookup would never find it; check lookup_url or declare `none`",
                &answer,
            ),
        }
    }

    async fn lookup_never_written(&mut self) -> Probe {
        const NAME: &str = "lookup-never-written";
        let request = self.request("never-written", &self.body.clone());
        let answer = self.adapter.probe_lookup(&request).await;
        self.note(NAME, &answer);
        match (&answer.outcome, answer.status) {
            (Outcome::LookupMiss { .. }, _) => probe(
                NAME,
                Verdict::Pass,
                "a key never written answered 404: a miss is told apart from a success",
                &answer,
            ),
            (Outcome::Succeeded { .. }, _) => probe(
                NAME,
                Verdict::Fail,
                "a key never written answered 200 with a receipt the tool accepts: a lookup \
                 miss would become a false success; declare `none`",
                &answer,
            ),
            (_, Some(200)) => probe(
                NAME,
                Verdict::Fail,
                "a key never written answered 200 (its body failed the receipt check): the \
                 endpoint does not answer 404 for unknown keys; declare `none`",
                &answer,
            ),
            _ => probe(
                NAME,
                Verdict::Info,
                "a key never written did not answer 404: the worker keeps such rows unknown",
                &answer,
            ),
        }
    }

    /// `absence_proof`: the first write (sent with a live deadline) is visible to the lookup
    /// within `settle_ms`.
    async fn deadline_live(&mut self, first: &Request, proof: &AbsenceProof) -> Probe {
        const NAME: &str = "deadline-live";
        let started = std::time::Instant::now();
        let settle = proof.settle;
        let mut answer = self.adapter.probe_lookup(first).await;
        while matches!(answer.outcome, Outcome::LookupMiss { .. }) && started.elapsed() < settle {
            tokio::time::sleep((settle / 10).max(std::time::Duration::from_millis(50))).await;
            answer = self.adapter.probe_lookup(first).await;
        }
        self.note(NAME, &answer);
        match &answer.outcome {
            Outcome::Succeeded { .. } => probe(
                NAME,
                Verdict::Pass,
                format!(
                    "a write sent with a live deadline succeeded and the lookup found it within \
                     settle_ms = {}",
                    settle.as_millis()
                ),
                &answer,
            ),
            _ => probe(
                NAME,
                Verdict::Fail,
                format!(
                    "a write sent with a live deadline was not found by the lookup within \
                     settle_ms = {}: a miss after the deadline would not prove its absence; \
                     raise settle_ms or do not declare absence_proof",
                    settle.as_millis()
                ),
                &answer,
            ),
        }
    }

    /// `absence_proof`: a write whose deadline passed (by more than the declared clock skew) is
    /// refused with a listed status and leaves nothing the lookup can find, `settle_ms` later.
    async fn deadline_passed(&mut self, proof: &AbsenceProof) -> Probe {
        const NAME: &str = "deadline-passed";
        let mut request = self.request("deadline-passed", &self.body.clone());
        let past = proof.clock_skew + std::time::Duration::from_secs(1);
        let deadline = chrono::Utc::now() - chrono::Duration::from_std(past).unwrap_or_default();
        request.deadline = Some(deadline);
        let stamp = deadline.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let answer = self.write(NAME, &request, true).await;
        let refused = matches!(answer.outcome, Outcome::NotApplied { .. })
            && answer
                .status
                .is_some_and(|s| proof.refused_statuses.contains(&s));
        if !refused {
            let what = match (&answer.outcome, answer.status) {
                (Outcome::Succeeded { .. }, _) | (_, Some(200..=299)) => {
                    "the downstream applied it: it does not check the deadline at its commit \
                     point, so a lookup miss proves nothing and absence_proof would send a \
                     write twice"
                        .to_owned()
                }
                (_, Some(s)) => format!(
                    "the downstream answered {s}, not one of deadline_refused_statuses {:?}: \
                     the worker cannot tell this refusal from another answer",
                    proof.refused_statuses
                ),
                (_, None) => "no HTTP answer: the refusal could not be seen".to_owned(),
            };
            return probe(
                NAME,
                Verdict::Fail,
                format!(
                    "a write with a deadline already passed ({stamp}, beyond clock_skew_ms = \
                     {}) was not refused: {what}",
                    proof.clock_skew.as_millis()
                ),
                &answer,
            );
        }
        tokio::time::sleep(proof.settle).await;
        let lookup = self.adapter.probe_lookup(&request).await;
        self.note(NAME, &lookup);
        match &lookup.outcome {
            Outcome::LookupMiss { .. } => probe(
                NAME,
                Verdict::Pass,
                format!(
                    "a write with a deadline already passed ({stamp}) was refused with {} and \
                     the lookup does not find it: a miss after a deadline proves absence",
                    answer.status.unwrap_or_default()
                ),
                &answer,
            ),
            _ => probe(
                NAME,
                Verdict::Fail,
                format!(
                    "a write refused for its passed deadline ({stamp}) is found by the lookup \
                     all the same: the refusal did not undo its effect; do not declare \
                     absence_proof"
                ),
                &lookup,
            ),
        }
    }

    async fn no_key(&mut self) -> Probe {
        const NAME: &str = "no-idempotency-key";
        let request = self.request("no-key", &self.body.clone());
        let answer = self.write(NAME, &request, false).await;
        let message = match answer.status {
            Some(400) => "a write without the idempotency header was refused with 400, as the \
                          draft expects"
                .to_owned(),
            Some(s) if (200..300).contains(&s) => format!(
                "a write without the idempotency header was accepted ({s}; the draft expects \
                 400): the worker always sends the key, but other clients get no protection"
            ),
            Some(s) => format!(
                "a write without the idempotency header answered {s} (the draft expects 400)"
            ),
            None => "a write without the idempotency header got no HTTP answer".to_owned(),
        };
        probe(NAME, Verdict::Info, message, &answer)
    }

    fn problem_json(&self) -> Probe {
        const NAME: &str = "problem-json";
        let evidence = self
            .seen_4xx
            .iter()
            .map(|(p, s, ct)| format!("{p}: {s} {}", ct.as_deref().unwrap_or("(no content type)")))
            .collect::<Vec<_>>()
            .join("; ");
        let message = if self.seen_4xx.is_empty() {
            "no 4xx answer was seen, so problem+json could not be checked".to_owned()
        } else if self
            .seen_4xx
            .iter()
            .all(|(_, _, ct)| is_problem_json(ct.as_deref()))
        {
            "every 4xx answer carried application/problem+json (RFC 9457)".to_owned()
        } else {
            "4xx answers do not all carry application/problem+json (RFC 9457); the worker \
             keeps their body excerpt as evidence either way"
                .to_owned()
        };
        Probe {
            name: NAME,
            verdict: Verdict::Info,
            message,
            evidence,
        }
    }
}

/// Command-line arguments of `worker check-tool`.
#[derive(Debug, clap::Args)]
pub struct CheckToolArgs {
    /// The tool to probe, as named in the tools file (`[tools.NAME]`).
    pub name: String,
    /// Required: the probes perform real writes against the tool's URL (a sandbox or staging
    /// downstream), as tenant `intent-worker-probe`.
    #[arg(long)]
    pub confirm_writes: bool,
    /// Print the report as one JSON object (for CI).
    #[arg(long)]
    pub json: bool,
    /// JSON object sent as the write's body (default: a probe marker). Use one the downstream
    /// accepts if it validates its input.
    #[arg(long)]
    pub body: Option<String>,
    /// Tools file.
    #[arg(
        long,
        env = "WORKER_TOOLS",
        value_name = "WORKER_TOOLS",
        default_value = "tools.toml"
    )]
    pub tools: std::path::PathBuf,
}

/// Exit status when a probe contradicts the declared capability.
pub const EXIT_FAIL: u8 = 1;
/// Exit status when the checker refused or could not start (no confirmation, bad tools file,
/// unknown tool, bad `--body`).
pub const EXIT_USAGE: u8 = 2;

/// Runs `worker check-tool` and returns the process exit status. Needs only the tools file.
pub async fn main(args: CheckToolArgs) -> u8 {
    if !args.confirm_writes {
        eprintln!(
            "worker check-tool: refusing to run without --confirm-writes: the probes perform \
             real writes against the tool's downstream (run it against a sandbox or staging \
             service; writes are made as tenant {PROBE_TENANT})"
        );
        return EXIT_USAGE;
    }
    let path = args.tools;
    let tools = match crate::config::Tools::load(&path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("worker check-tool: {e}");
            return EXIT_USAGE;
        }
    };
    let Some(config) = tools.tools.get(&args.name) else {
        eprintln!(
            "worker check-tool: no tool {:?} in {} (tools: {})",
            args.name,
            path.display(),
            tools.tools.keys().cloned().collect::<Vec<_>>().join(", ")
        );
        return EXIT_USAGE;
    };
    // The worker's own trust, so a probe sees the downstream as the worker would.
    let ca_file = std::env::var_os(crate::tls::CA_FILE_VAR)
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from);
    let trust = match crate::tls::load(ca_file.as_deref()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("worker check-tool: {e}");
            return EXIT_USAGE;
        }
    };
    let report = match run(config, &trust, args.body.as_deref()).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("worker check-tool: {e}");
            return EXIT_USAGE;
        }
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).expect("a report always serialises")
        );
    } else {
        print!("{}", report.text());
    }
    if report.ok {
        0
    } else {
        EXIT_FAIL
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_json_is_recognised_with_parameters_and_any_case() {
        assert!(is_problem_json(Some("application/problem+json")));
        assert!(is_problem_json(Some(
            "Application/Problem+JSON; charset=utf-8"
        )));
        assert!(!is_problem_json(Some("application/json")));
        assert!(!is_problem_json(Some(
            "text/plain; application/problem+json"
        )));
        assert!(!is_problem_json(None));
    }

    /// The text of every ordinary string literal in `source`, with the line it starts on and
    /// whether it runs over a line break that no `\\` continues (whose indentation then ends
    /// up in the text). Escapes count as one character; comments, char literals and raw
    /// strings are skipped.
    fn string_literals(source: &str) -> Vec<(usize, String, bool)> {
        let chars: Vec<char> = source.chars().collect();
        let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
        let ident = |c: char| c.is_alphanumeric() || c == '_';
        let (mut out, mut i, mut line) = (Vec::new(), 0, 1);
        while i < chars.len() {
            match at(i) {
                '\n' => line += 1,
                '/' if at(i + 1) == '/' => {
                    while i < chars.len() && at(i) != '\n' {
                        i += 1;
                    }
                    continue;
                }
                '/' if at(i + 1) == '*' => {
                    i += 2;
                    while i < chars.len() && !(at(i) == '*' && at(i + 1) == '/') {
                        line += usize::from(at(i) == '\n');
                        i += 1;
                    }
                    i += 2;
                    continue;
                }
                'r' if (at(i + 1) == '"' || at(i + 1) == '#') && (i == 0 || !ident(at(i - 1))) => {
                    let mut hashes = 0;
                    let mut j = i + 1;
                    while at(j) == '#' {
                        hashes += 1;
                        j += 1;
                    }
                    if at(j) == '"' {
                        j += 1;
                        loop {
                            if j >= chars.len() {
                                break;
                            }
                            if at(j) == '"' && (1..=hashes).all(|k| at(j + k) == '#') {
                                j += hashes + 1;
                                break;
                            }
                            line += usize::from(at(j) == '\n');
                            j += 1;
                        }
                        i = j;
                        continue;
                    }
                }
                '\'' if at(i + 1) == '\\' => {
                    i += 3;
                    while i < chars.len() && at(i) != '\'' {
                        i += 1;
                    }
                }
                '\'' if at(i + 2) == '\'' => i += 2,
                '"' => {
                    let (start, mut text, mut broken) = (line, String::new(), false);
                    i += 1;
                    while i < chars.len() && at(i) != '"' {
                        match (at(i), at(i + 1)) {
                            ('\\', '\n') => {
                                i += 1;
                                while at(i).is_whitespace() {
                                    line += usize::from(at(i) == '\n');
                                    i += 1;
                                }
                                continue;
                            }
                            ('\\', 'n') => {
                                text.push('\n');
                                i += 1;
                            }
                            ('\\', escaped) => {
                                text.push(escaped);
                                i += 1;
                            }
                            ('\n', _) => {
                                broken = true;
                                line += 1;
                                text.push('\n');
                            }
                            (c, _) => text.push(c),
                        }
                        i += 1;
                    }
                    out.push((start, text, broken));
                }
                _ => {}
            }
            i += 1;
        }
        out
    }

    #[test]
    fn literals_are_found_with_their_continuations_and_breaks() {
        let source = "// \"not a literal\"\nlet a = 'x'; let b = '\\''; fn f<'a>() {}\n\
                      let c = \"one \\\n      line\"; let d = r#\"raw \"  \"#;\n\
                      let e = \"two\n      lines\";";
        let found = string_literals(source);
        assert_eq!(
            found,
            vec![
                (3, "one line".to_string(), false),
                (5, "two\n      lines".to_string(), true),
            ]
        );
    }

    /// A message (or any other text outside the tests) reads as one sentence: no string literal
    /// breaks a line without a trailing `\`, so none carries a run of the next line's
    /// indentation. The report's answer lines are indented on purpose, after a `\n`.
    #[test]
    fn no_message_contains_a_run_of_spaces() {
        for (file, source) in [
            ("ops/check_tool.rs", include_str!("check_tool.rs")),
            ("adapter/http.rs", include_str!("../adapter/http.rs")),
        ] {
            let code = source.split("\n#[cfg(test)]\nmod tests").next().unwrap();
            let literals = string_literals(code);
            assert!(literals.len() > 20, "{file}: {}", literals.len());
            for (line, text, broken) in literals {
                assert!(!broken, "{file}:{line}: a line break inside {text:?}");
                for part in text.split('\n') {
                    assert!(
                        !part.trim_start().contains("  "),
                        "{file}:{line}: a run of spaces in {text:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn report_text_has_one_line_per_probe_and_a_summary() {
        let report = Report {
            tool: "refund".into(),
            capability: "replay",
            url: "http://x/replay/refunds".into(),
            tenant: PROBE_TENANT,
            run: "r".into(),
            probes: vec![
                Probe {
                    name: "first-write",
                    verdict: Verdict::Pass,
                    message: "ok".into(),
                    evidence: "receipt {}".into(),
                },
                Probe {
                    name: "replay-same-request",
                    verdict: Verdict::Fail,
                    message: "no".into(),
                    evidence: String::new(),
                },
            ],
            ok: false,
        };
        let text = report.text();
        assert!(text.contains("\nPASS first-write: ok\n     answer: receipt {}\n"));
        assert!(text.contains("\nFAIL replay-same-request: no\n"));
        assert!(text.ends_with("for this downstream: 1 PASS, 1 FAIL, 0 INFO\n"));
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["probes"][1]["verdict"], "FAIL");
        assert_eq!(json["ok"], false);
    }
}
