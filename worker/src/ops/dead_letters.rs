//! Dead letters as the operator works them, shared by the console and `worker ops
//! dead-letters`: list them (filtered, and for a tenant only its own), republish one or a
//! filtered set to the intents exchange after a fix, or discard them. Every step is audited in
//! the ledger ([`crate::ledger::dead_letters`]) under a request id, so repeating a request does
//! nothing twice; a republished intent is deduplicated by the inbox like any other.
//!
//! **Whose dead letter.** A tenant sees a dead letter only when its body names that tenant and
//! the tenant is proven the way the intake proves it: in `[auth] mode = "user_id"` the original
//! publisher must be mapped to the tenant; in `trusted` mode the body's tenant is believed. A
//! letter whose tenant is unproven (`tenant_mismatch`) or cannot be read is the admin's only.
//!
//! Request ids: a step on letters chosen by id uses `<request id>:<letter id>`; a step on a
//! filtered set uses `<request id>:<letter id>:<n>` (n counts identical copies).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use lapin::Connection;
use tokio::sync::Mutex;

use crate::amqp::dead_letters::{DeadLetter, DeadLetterQueue, MAX_SCAN};
use crate::amqp::AmqpError;
use crate::config::auth::Principal;
use crate::config::Topology;
use crate::intake::TenantAuth;
use crate::ledger::dead_letters::{NewDeadLetterAction, Started};
use crate::ledger::{Ledger, LedgerError};
use crate::tls::Trust;

/// Most letters one listing or one step returns or acts on.
pub const MAX_LIMIT: usize = 500;
/// Default number of letters listed.
pub const DEFAULT_LIMIT: usize = 50;

/// Why a dead-letter request failed.
#[derive(Debug, thiserror::Error)]
pub enum DeadLetterError {
    #[error("{0}")]
    BadRequest(String),
    #[error(transparent)]
    Broker(#[from] AmqpError),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// Which dead letters: every set field narrows.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeadLetterFilter {
    /// The reason code (`unknown_tool`, `tenant_mismatch`, `broker:rejected`, ...).
    pub reason: Option<String>,
    /// The tenant the body names.
    pub tenant: Option<String>,
    /// The AMQP message id (for intents `<tenant>:<action_id>`).
    pub message_id: Option<String>,
    /// Letter ids ([`DeadLetter::id`]); empty: any.
    pub ids: Vec<String>,
}

impl DeadLetterFilter {
    pub fn matches(&self, letter: &DeadLetter) -> bool {
        let eq = |want: &Option<String>, have: &Option<String>| {
            want.as_ref().is_none_or(|w| have.as_ref() == Some(w))
        };
        eq(&self.reason, &letter.reason)
            && eq(&self.tenant, &letter.tenant)
            && eq(&self.message_id, &letter.message_id)
            && (self.ids.is_empty() || self.ids.contains(&letter.id))
    }

    /// True when nothing narrows it (a step then needs an explicit "all").
    pub fn is_empty(&self) -> bool {
        self.reason.is_none()
            && self.tenant.is_none()
            && self.message_id.is_none()
            && self.ids.is_empty()
    }
}

/// Whether `viewer` may see `letter` (see the module doc).
pub fn visible_to(letter: &DeadLetter, viewer: &Principal, auth: &TenantAuth) -> bool {
    match viewer {
        Principal::Admin => true,
        Principal::Tenant(own) => {
            letter.tenant.as_deref() == Some(own.as_str())
                && auth.allows(letter.original_user.as_deref(), own)
        }
    }
}

/// A broker connection for dead-letter work, opened on first use and reopened when lost.
pub struct Broker {
    url: String,
    name: String,
    trust: Trust,
    topology: Topology,
    /// The worker's broker user: the `user_id` of republished intents.
    pub own_user: Option<String>,
    connection: Mutex<Option<Arc<Connection>>>,
}

impl Broker {
    pub fn new(url: &str, name: &str, trust: Trust, topology: Topology) -> Broker {
        Broker {
            url: url.to_string(),
            name: name.to_string(),
            trust,
            topology,
            own_user: crate::amqp::dead_letters::broker_user(url),
            connection: Mutex::new(None),
        }
    }

    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The open connection, or a new one (each node of the URL list in turn).
    pub async fn connection(&self) -> Result<Arc<Connection>, AmqpError> {
        let mut held = self.connection.lock().await;
        if let Some(c) = held.as_ref().filter(|c| c.status().connected()) {
            return Ok(c.clone());
        }
        let mut last = None;
        for url in kit::url::split_list(&self.url) {
            match crate::amqp::connect_with_heartbeat(&url, &self.name, 30, &self.trust).await {
                Ok(c) => {
                    let c = Arc::new(c);
                    *held = Some(c.clone());
                    return Ok(c);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| AmqpError::BadUrl {
            url: kit::url::redact_list(&self.url),
            reason: "no URL".into(),
        }))
    }

    /// Messages in the dead-letter queue now.
    pub async fn depth(&self) -> Result<u32, AmqpError> {
        let connection = self.connection().await?;
        DeadLetterQueue::new(&connection, &self.topology, self.own_user.as_deref())
            .depth()
            .await
    }
}

/// A letter as JSON (`worker ops dead-letters list --json`): its fields, headers and body (as
/// JSON when it is JSON, else as text).
pub fn letter_json(letter: &DeadLetter) -> serde_json::Value {
    let body = serde_json::from_slice::<serde_json::Value>(&letter.body)
        .unwrap_or_else(|_| String::from_utf8_lossy(&letter.body).into_owned().into());
    let headers: serde_json::Map<String, serde_json::Value> = letter
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), v.clone().into()))
        .collect();
    serde_json::json!({
        "id": letter.id,
        "reason": letter.reason,
        "detail": letter.detail,
        "original_user": letter.original_user,
        "tenant": letter.tenant,
        "action_id": letter.action_id,
        "message_id": letter.message_id,
        "routing_key": letter.routing_key,
        "position": letter.position,
        "headers": headers,
        "body": body,
    })
}

/// A listing: the letters shown, and how much of the queue was read for them.
#[derive(Debug)]
pub struct Listing {
    pub letters: Vec<DeadLetter>,
    pub scanned: usize,
    /// Messages behind the last one read.
    pub remaining: u32,
}

/// Up to `limit` letters `viewer` may see that `filter` matches, from the first [`MAX_SCAN`]
/// of the queue; every message read is returned to the queue.
pub async fn list(
    broker: &Broker,
    viewer: &Principal,
    auth: &TenantAuth,
    filter: &DeadLetterFilter,
    limit: usize,
) -> Result<Listing, DeadLetterError> {
    check_limit(limit)?;
    let connection = broker.connection().await?;
    let queue = DeadLetterQueue::new(&connection, &broker.topology, broker.own_user.as_deref());
    let scan = queue
        .scan(MAX_SCAN, limit, |l| {
            visible_to(l, viewer, auth) && filter.matches(l)
        })
        .await?;
    let listing = Listing {
        letters: scan.letters.clone(),
        scanned: scan.scanned,
        remaining: scan.remaining,
    };
    scan.release().await;
    Ok(listing)
}

fn check_limit(limit: usize) -> Result<(), DeadLetterError> {
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(DeadLetterError::BadRequest(format!(
            "limit must be between 1 and {MAX_LIMIT}"
        )));
    }
    Ok(())
}

/// What to do with the chosen letters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Publish the intent again to the intents exchange, then remove the dead letter.
    Republish,
    /// Remove the dead letter.
    Discard,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Republish => "republish",
            Action::Discard => "discard",
        }
    }

    pub fn parse(s: &str) -> Option<Action> {
        match s {
            "republish" => Some(Action::Republish),
            "discard" => Some(Action::Discard),
            _ => None,
        }
    }
}

/// One step request.
#[derive(Debug, Clone)]
pub struct StepRequest {
    pub action: Action,
    pub filter: DeadLetterFilter,
    /// Most letters acted on.
    pub limit: usize,
    pub operator: String,
    /// Why (the fix that was made), recorded with each step.
    pub note: String,
    pub request_id: String,
    /// Only say what would be done.
    pub dry_run: bool,
}

/// What happened to one letter.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome", content = "detail")]
pub enum StepOutcome {
    /// Republished (confirmed) and removed, or removed.
    Done,
    /// A dry run: this letter would be acted on.
    WouldAct,
    /// This request id already did it (or found nothing): nothing was done again.
    AlreadyDone(String),
    /// No such letter in the part of the queue read.
    NotFound,
    /// The broker refused; the letter stays (repeat the request to try again).
    Failed(String),
}

/// One letter's report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepReport {
    pub dead_letter_id: String,
    pub request_id: String,
    pub message_id: Option<String>,
    pub tenant: Option<String>,
    pub reason: Option<String>,
    #[serde(flatten)]
    pub outcome: StepOutcome,
}

/// Republishes or discards the letters the request chooses (admin only: the caller checks).
pub async fn act(
    broker: &Broker,
    ledger: &Ledger,
    request: &StepRequest,
) -> Result<Vec<StepReport>, DeadLetterError> {
    check_limit(request.limit)?;
    for (field, value) in [
        ("operator", &request.operator),
        ("reason", &request.note),
        ("request_id", &request.request_id),
    ] {
        if value.trim().is_empty() {
            return Err(DeadLetterError::BadRequest(format!("{field} is required")));
        }
    }
    let by_id = !request.filter.ids.is_empty();
    let mut reports = Vec::new();
    // What an earlier run of this request finished (a repeat reports it, and does it not again).
    let earlier = if by_id || request.dry_run {
        Vec::new()
    } else {
        ledger.dead_letter_actions_of(&request.request_id).await?
    };
    // Letters chosen by id whose step already finished are not looked for again.
    let mut wanted: Vec<String> = Vec::new();
    for id in &request.filter.ids {
        let request_id = format!("{}:{id}", request.request_id);
        match ledger.dead_letter_action(&request_id).await? {
            Some(seen) if seen.status != "started" => reports.push(StepReport {
                dead_letter_id: id.clone(),
                request_id,
                message_id: seen.message_id,
                tenant: seen.tenant,
                reason: seen.reason,
                outcome: StepOutcome::AlreadyDone(format!("{} {}", seen.action, seen.status)),
            }),
            _ if !wanted.contains(id) => wanted.push(id.clone()),
            _ => {}
        }
    }
    if by_id && wanted.is_empty() {
        return Ok(reports);
    }
    let connection = broker.connection().await?;
    let queue = DeadLetterQueue::new(&connection, &broker.topology, broker.own_user.as_deref());
    let mut taken: HashSet<String> = HashSet::new();
    let scan = queue
        .scan(MAX_SCAN, request.limit, |l| {
            // By id: one copy of each letter still wanted (identical copies share an id).
            request.filter.matches(l)
                && (!by_id || (wanted.contains(&l.id) && taken.insert(l.id.clone())))
        })
        .await?;
    let mut copies: BTreeMap<String, usize> = BTreeMap::new();
    for letter in &scan.letters {
        let request_id = if by_id {
            format!("{}:{}", request.request_id, letter.id)
        } else {
            let n = copies.entry(letter.id.clone()).or_default();
            *n += 1;
            format!("{}:{}:{}", request.request_id, letter.id, *n - 1)
        };
        let report = |outcome| StepReport {
            dead_letter_id: letter.id.clone(),
            request_id: request_id.clone(),
            message_id: letter.message_id.clone(),
            tenant: letter.tenant.clone(),
            reason: letter.reason.clone(),
            outcome,
        };
        if request.dry_run {
            reports.push(report(StepOutcome::WouldAct));
            continue;
        }
        let started = ledger
            .start_dead_letter_action(&NewDeadLetterAction {
                request_id: &request_id,
                action: request.action.as_str(),
                dead_letter_id: &letter.id,
                message_id: letter.message_id.as_deref(),
                reason: letter.reason.as_deref(),
                tenant: letter.tenant.as_deref(),
                original_user: letter.original_user.as_deref(),
                operator: &request.operator,
                note: &request.note,
            })
            .await;
        match started {
            Ok(Started::Seen(seen)) if seen.status != "started" => {
                reports.push(report(StepOutcome::AlreadyDone(format!(
                    "{} {}",
                    seen.action, seen.status
                ))));
                continue;
            }
            Ok(_) => {}
            Err(e) => {
                scan.release().await;
                return Err(e.into());
            }
        }
        let result = match request.action {
            Action::Republish => queue.republish(&scan, letter, &request_id).await,
            Action::Discard => queue.ack(&scan, letter).await,
        };
        match result {
            Ok(()) => {
                tracing::info!(
                    action = request.action.as_str(), dead_letter = %letter.id,
                    message_id = letter.message_id.as_deref().unwrap_or(""),
                    operator = %request.operator, request_id = %request_id,
                    "dead letter handled"
                );
                ledger
                    .finish_dead_letter_action(&request_id, "done")
                    .await?;
                reports.push(report(StepOutcome::Done));
            }
            Err(e) => {
                tracing::warn!(dead_letter = %letter.id, error = %e, "dead-letter step failed");
                reports.push(report(StepOutcome::Failed(e.to_string())));
            }
        }
    }
    let reported: HashSet<String> = reports.iter().map(|r| r.request_id.clone()).collect();
    for seen in earlier {
        if seen.status != "started" && !reported.contains(&seen.request_id) {
            reports.push(StepReport {
                dead_letter_id: seen.dead_letter_id,
                request_id: seen.request_id,
                message_id: seen.message_id,
                tenant: seen.tenant,
                reason: seen.reason,
                outcome: StepOutcome::AlreadyDone(format!("{} {}", seen.action, seen.status)),
            });
        }
    }
    let found: HashSet<&str> = scan.letters.iter().map(|l| l.id.as_str()).collect();
    let missing: Vec<String> = wanted
        .iter()
        .filter(|id| !found.contains(id.as_str()))
        .cloned()
        .collect();
    scan.release().await;
    for id in missing {
        let request_id = format!("{}:{id}", request.request_id);
        if !request.dry_run {
            ledger
                .start_dead_letter_action(&NewDeadLetterAction {
                    request_id: &request_id,
                    action: request.action.as_str(),
                    dead_letter_id: &id,
                    message_id: None,
                    reason: None,
                    tenant: None,
                    original_user: None,
                    operator: &request.operator,
                    note: &request.note,
                })
                .await?;
            ledger
                .finish_dead_letter_action(&request_id, "not_found")
                .await?;
        }
        reports.push(StepReport {
            dead_letter_id: id,
            request_id,
            message_id: None,
            tenant: None,
            reason: None,
            outcome: StepOutcome::NotFound,
        });
    }
    Ok(reports)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter(tenant: Option<&str>, user: Option<&str>, reason: &str) -> DeadLetter {
        // Built through the public reading path would need a broker; the fields are public
        // except the delivery tag, so the test goes through the republish test's shape.
        crate::amqp::dead_letters::tests_support::letter(tenant, user, reason)
    }

    #[test]
    fn a_tenant_sees_only_letters_proven_for_it() {
        let auth = TenantAuth::UserId {
            users: BTreeMap::from([
                ("alice".to_string(), vec!["north".to_string()]),
                ("bob".to_string(), vec!["south".to_string()]),
            ]),
        };
        let north = Principal::Tenant("north".into());
        assert!(visible_to(
            &letter(Some("north"), Some("alice"), "unknown_tool"),
            &north,
            &auth
        ));
        // bob claimed north: unproven, the admin's only.
        let claimed = letter(Some("north"), Some("bob"), "tenant_mismatch");
        assert!(!visible_to(&claimed, &north, &auth));
        assert!(visible_to(&claimed, &Principal::Admin, &auth));
        assert!(!visible_to(
            &letter(None, Some("alice"), "invalid_message"),
            &north,
            &auth
        ));
        assert!(!visible_to(
            &letter(Some("south"), Some("bob"), "unknown_tool"),
            &north,
            &auth
        ));
        // Trusted mode believes the body.
        assert!(visible_to(
            &letter(Some("north"), None, "unknown_tool"),
            &north,
            &TenantAuth::Trusted
        ));
    }

    #[test]
    fn filters_narrow_by_every_field_set() {
        let l = letter(Some("north"), Some("alice"), "unknown_tool");
        assert!(DeadLetterFilter::default().matches(&l));
        assert!(DeadLetterFilter::default().is_empty());
        let f = DeadLetterFilter {
            reason: Some("unknown_tool".into()),
            tenant: Some("north".into()),
            ..Default::default()
        };
        assert!(f.matches(&l) && !f.is_empty());
        let f = DeadLetterFilter {
            reason: Some("invalid_message".into()),
            ..Default::default()
        };
        assert!(!f.matches(&l));
        let f = DeadLetterFilter {
            ids: vec!["nope".into()],
            ..Default::default()
        };
        assert!(!f.matches(&l));
        let f = DeadLetterFilter {
            ids: vec![l.id.clone()],
            ..Default::default()
        };
        assert!(f.matches(&l));
    }
}
