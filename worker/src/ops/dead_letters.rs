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
//! **Who reads the queue.** Only the admin: reading takes every letter up to the one sought and
//! returns the others, which a quorum queue counts as a delivery. A tenant's listing never
//! touches the queue: it is drawn from the [`Snapshot`] of this worker's last admin read, and
//! says when that was.
//!
//! Request ids: a step on letters chosen by id uses `<request id>:<letter id>`; a step on a
//! filtered set uses `<request id>:<letter id>:<n>` (n counts identical copies).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use lapin::Connection;
use tokio::sync::Mutex;

use crate::amqp::dead_letters::{DeadLetter, DeadLetterQueue, Scan, MAX_SCAN};
use crate::amqp::AmqpError;
use crate::config::auth::Principal;
use crate::config::Topology;
use crate::intake::TenantAuth;
use crate::ledger::dead_letters::{DeadLetterAction, NewDeadLetterAction, Started};
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
        Principal::Approver(_) => false,
    }
}

/// The longest body a [`Snapshot`] keeps per letter (bytes): enough for the console's view.
pub const SNAPSHOT_BODY_BYTES: usize = 4096;

/// What this worker's last admin read of the queue saw, for tenants' listings.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub at: chrono::DateTime<chrono::Utc>,
    /// Every letter read, in queue order, bodies cut at [`SNAPSHOT_BODY_BYTES`].
    pub letters: Vec<DeadLetter>,
    pub scanned: usize,
    pub remaining: u32,
}

/// A broker connection for dead-letter work, opened on first use and reopened when lost, and
/// the snapshot of the last admin read.
pub struct Broker {
    url: String,
    name: String,
    trust: Trust,
    topology: Topology,
    /// The worker's broker user: the `user_id` of republished intents.
    pub own_user: Option<String>,
    connection: Mutex<Option<Arc<Connection>>>,
    snapshot: std::sync::Mutex<Option<Snapshot>>,
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
            snapshot: std::sync::Mutex::new(None),
        }
    }

    /// The last admin read, if any.
    pub fn snapshot(&self) -> Option<Snapshot> {
        crate::lock(&self.snapshot).clone()
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
    /// None: read now; else the time of the admin read the letters come from (a tenant's
    /// listing), or [`Listing::NEVER`] when there was none yet on this worker.
    pub as_of: Option<chrono::DateTime<chrono::Utc>>,
}

impl Listing {
    /// `as_of` of a tenant's listing before any admin read on this worker.
    pub const NEVER: chrono::DateTime<chrono::Utc> = chrono::DateTime::UNIX_EPOCH;
}

/// Up to `limit` letters `viewer` may see that `filter` matches. The admin reads them from the
/// first [`MAX_SCAN`] of the queue (every message read is returned to the queue) and leaves a
/// [`Snapshot`]; a tenant's come from that snapshot, never from the queue.
pub async fn list(
    broker: &Broker,
    viewer: &Principal,
    auth: &TenantAuth,
    filter: &DeadLetterFilter,
    limit: usize,
) -> Result<Listing, DeadLetterError> {
    check_limit(limit)?;
    if let Principal::Tenant(_) | Principal::Approver(_) = viewer {
        return Ok(from_snapshot(
            broker.snapshot(),
            viewer,
            auth,
            filter,
            limit,
        ));
    }
    let connection = broker.connection().await?;
    let queue = DeadLetterQueue::new(&connection, &broker.topology, broker.own_user.as_deref());
    let mut seen = Vec::new();
    let scan = queue
        .scan(MAX_SCAN, limit, |l| {
            seen.push(l.cut(SNAPSHOT_BODY_BYTES));
            visible_to(l, viewer, auth) && filter.matches(l)
        })
        .await?;
    let listing = Listing {
        letters: scan.letters.clone(),
        scanned: scan.scanned,
        remaining: scan.remaining,
        as_of: None,
    };
    scan.release().await;
    *crate::lock(&broker.snapshot) = Some(Snapshot {
        at: chrono::Utc::now(),
        letters: seen,
        scanned: listing.scanned,
        remaining: listing.remaining,
    });
    Ok(listing)
}

/// A listing drawn from `snapshot` (none: empty, [`Listing::NEVER`]).
fn from_snapshot(
    snapshot: Option<Snapshot>,
    viewer: &Principal,
    auth: &TenantAuth,
    filter: &DeadLetterFilter,
    limit: usize,
) -> Listing {
    let Some(snapshot) = snapshot else {
        return Listing {
            letters: Vec::new(),
            scanned: 0,
            remaining: 0,
            as_of: Some(Listing::NEVER),
        };
    };
    Listing {
        letters: snapshot
            .letters
            .into_iter()
            .filter(|l| visible_to(l, viewer, auth) && filter.matches(l))
            .take(limit)
            .collect(),
        scanned: snapshot.scanned,
        remaining: snapshot.remaining,
        as_of: Some(snapshot.at),
    }
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

impl StepReport {
    /// The report of a step on `letter` under `request_id`.
    fn of(letter: &DeadLetter, request_id: String, outcome: StepOutcome) -> StepReport {
        StepReport {
            dead_letter_id: letter.id.clone(),
            request_id,
            message_id: letter.message_id.clone(),
            tenant: letter.tenant.clone(),
            reason: letter.reason.clone(),
            outcome,
        }
    }

    /// The report of a step the ledger says finished earlier: it is not done again.
    fn seen(seen: DeadLetterAction) -> StepReport {
        StepReport {
            outcome: already_done(&seen),
            dead_letter_id: seen.dead_letter_id,
            request_id: seen.request_id,
            message_id: seen.message_id,
            tenant: seen.tenant,
            reason: seen.reason,
        }
    }
}

/// What a repeat reports for a step that finished earlier.
fn already_done(seen: &DeadLetterAction) -> StepOutcome {
    StepOutcome::AlreadyDone(format!("{} {}", seen.action, seen.status))
}

/// Republishes or discards the letters the request chooses (admin only: the caller checks).
///
/// In order: the request is checked (`check_step`); letters chosen by id whose step finished
/// earlier are reported and not looked for again (`finished_by_id`); the queue is read for
/// the letters chosen, and each one's step is audited (`begin`) and taken (`step`) under its
/// own request id (`step_request_ids`); then the steps an earlier run of this request
/// finished (`earlier_unreported`) and the letters chosen by id but not found
/// (`not_found`, `record_not_found`) are reported.
pub async fn act(
    broker: &Broker,
    ledger: &Ledger,
    request: &StepRequest,
) -> Result<Vec<StepReport>, DeadLetterError> {
    check_step(request)?;
    let by_id = !request.filter.ids.is_empty();
    // What an earlier run of this request finished (a repeat reports it, and does it not again).
    let earlier = if by_id || request.dry_run {
        Vec::new()
    } else {
        ledger.dead_letter_actions_of(&request.request_id).await?
    };
    let (mut reports, wanted) = finished_by_id(ledger, request).await?;
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
    let ids = step_request_ids(
        &request.request_id,
        by_id,
        scan.letters.iter().map(|l| l.id.as_str()),
    );
    for (letter, request_id) in scan.letters.iter().zip(ids) {
        let outcome = if request.dry_run {
            StepOutcome::WouldAct
        } else {
            let stepped = match begin(ledger, request, letter, &request_id).await {
                Ok(Some(done)) => Ok(done),
                Ok(None) => step(ledger, &queue, &scan, request, letter, &request_id).await,
                Err(e) => Err(e),
            };
            match stepped {
                Ok(outcome) => outcome,
                Err(e) => {
                    // The letters still held go back to the queue now, not when the broker
                    // connection (long-lived) closes.
                    scan.release().await;
                    return Err(e.into());
                }
            }
        };
        reports.push(StepReport::of(letter, request_id, outcome));
    }
    let earlier = earlier_unreported(&reports, earlier);
    reports.extend(earlier);
    let missing = not_found(&wanted, scan.letters.iter().map(|l| l.id.as_str()));
    scan.release().await;
    reports.extend(record_not_found(ledger, request, missing).await?);
    Ok(reports)
}

/// A step request is refused before anything is read: a limit out of range, or no operator,
/// reason or request id.
fn check_step(request: &StepRequest) -> Result<(), DeadLetterError> {
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
    Ok(())
}

/// Of the letters chosen by id, the reports of those whose step already finished, and the ids
/// still wanted (each once, in the request's order).
async fn finished_by_id(
    ledger: &Ledger,
    request: &StepRequest,
) -> Result<(Vec<StepReport>, Vec<String>), LedgerError> {
    let mut reports = Vec::new();
    let mut wanted: Vec<String> = Vec::new();
    for id in &request.filter.ids {
        let request_id = format!("{}:{id}", request.request_id);
        match ledger.dead_letter_action(&request_id).await? {
            Some(seen) if seen.status != "started" => reports.push(StepReport::seen(seen)),
            _ if !wanted.contains(id) => wanted.push(id.clone()),
            _ => {}
        }
    }
    Ok((reports, wanted))
}

/// The request id of each letter's step, in the order read (see the module doc): by id
/// `<request id>:<letter id>`; on a filtered set `<request id>:<letter id>:<n>`, where n counts
/// the identical copies before it.
fn step_request_ids<'a>(
    request_id: &str,
    by_id: bool,
    letter_ids: impl IntoIterator<Item = &'a str>,
) -> Vec<String> {
    let mut copies: BTreeMap<&str, usize> = BTreeMap::new();
    letter_ids
        .into_iter()
        .map(|id| {
            if by_id {
                format!("{request_id}:{id}")
            } else {
                let n = copies.entry(id).or_default();
                *n += 1;
                format!("{request_id}:{id}:{}", *n - 1)
            }
        })
        .collect()
}

/// Records the start of one letter's step: `Some` with what to report when this step id
/// already finished (nothing is done again), `None` when it is this run's to take.
async fn begin(
    ledger: &Ledger,
    request: &StepRequest,
    letter: &DeadLetter,
    request_id: &str,
) -> Result<Option<StepOutcome>, LedgerError> {
    let started = ledger
        .start_dead_letter_action(&NewDeadLetterAction {
            request_id,
            action: request.action.as_str(),
            dead_letter_id: &letter.id,
            message_id: letter.message_id.as_deref(),
            reason: letter.reason.as_deref(),
            tenant: letter.tenant.as_deref(),
            original_user: letter.original_user.as_deref(),
            operator: &request.operator,
            note: &request.note,
        })
        .await?;
    Ok(match started {
        Started::Seen(seen) if seen.status != "started" => Some(already_done(&seen)),
        _ => None,
    })
}

/// Republishes or discards one letter whose step [`begin`] recorded, and finishes its audit
/// when the broker did it; a broker failure is reported and leaves the letter (and the step
/// `started`, for a repeat to finish).
async fn step(
    ledger: &Ledger,
    queue: &DeadLetterQueue<'_>,
    scan: &Scan,
    request: &StepRequest,
    letter: &DeadLetter,
    request_id: &str,
) -> Result<StepOutcome, LedgerError> {
    let result = match request.action {
        Action::Republish => queue.republish(scan, letter, request_id).await,
        Action::Discard => queue.ack(scan, letter).await,
    };
    match result {
        Ok(()) => {
            tracing::info!(
                action = request.action.as_str(), dead_letter = %letter.id,
                message_id = letter.message_id.as_deref().unwrap_or(""),
                operator = %request.operator, request_id = %request_id,
                "dead letter handled"
            );
            ledger.finish_dead_letter_action(request_id, "done").await?;
            Ok(StepOutcome::Done)
        }
        Err(e) => {
            tracing::warn!(dead_letter = %letter.id, error = %e, "dead-letter step failed");
            Ok(StepOutcome::Failed(e.to_string()))
        }
    }
}

/// The steps an earlier run of this request finished that this run did not report, in the
/// ledger's order (a step still `started` is this run's to finish, not a report).
fn earlier_unreported(reports: &[StepReport], earlier: Vec<DeadLetterAction>) -> Vec<StepReport> {
    let reported: HashSet<&str> = reports.iter().map(|r| r.request_id.as_str()).collect();
    earlier
        .into_iter()
        .filter(|seen| seen.status != "started" && !reported.contains(seen.request_id.as_str()))
        .map(StepReport::seen)
        .collect()
}

/// The ids `wanted` that are not among the letters found, in the order wanted.
fn not_found<'a>(wanted: &[String], found: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let found: HashSet<&str> = found.into_iter().collect();
    wanted
        .iter()
        .filter(|id| !found.contains(id.as_str()))
        .cloned()
        .collect()
}

/// Reports the letters chosen by id that the queue did not hold, each audited `not_found`
/// (unless a dry run).
async fn record_not_found(
    ledger: &Ledger,
    request: &StepRequest,
    missing: Vec<String>,
) -> Result<Vec<StepReport>, LedgerError> {
    let mut reports = Vec::new();
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

    fn step_request(limit: usize, operator: &str, note: &str, request_id: &str) -> StepRequest {
        StepRequest {
            action: Action::Discard,
            filter: DeadLetterFilter::default(),
            limit,
            operator: operator.into(),
            note: note.into(),
            request_id: request_id.into(),
            dry_run: false,
        }
    }

    #[test]
    fn a_step_needs_a_limit_in_range_an_operator_a_reason_and_a_request_id() {
        let cases: &[(StepRequest, Option<&str>)] = &[
            (step_request(1, "ops", "fixed", "r1"), None),
            (step_request(MAX_LIMIT, "ops", "fixed", "r1"), None),
            (
                step_request(0, "ops", "fixed", "r1"),
                Some("limit must be between 1 and 500"),
            ),
            (
                step_request(MAX_LIMIT + 1, "ops", "fixed", "r1"),
                Some("limit must be between 1 and 500"),
            ),
            (
                step_request(10, " ", "fixed", "r1"),
                Some("operator is required"),
            ),
            (
                step_request(10, "ops", "", "r1"),
                Some("reason is required"),
            ),
            (
                step_request(10, "ops", "fixed", "\t"),
                Some("request_id is required"),
            ),
            // The first missing field is named.
            (step_request(10, "", "", ""), Some("operator is required")),
        ];
        for (request, refused) in cases {
            let got = check_step(request).err().map(|e| e.to_string());
            assert_eq!(got.as_deref(), *refused, "{request:?}");
        }
    }

    #[test]
    fn each_step_has_its_own_request_id_and_identical_copies_are_counted() {
        let cases: &[(bool, &[&str], &[&str])] = &[
            (true, &["a", "b"], &["r:a", "r:b"]),
            (false, &["a", "b"], &["r:a:0", "r:b:0"]),
            (
                false,
                &["a", "b", "a", "a"],
                &["r:a:0", "r:b:0", "r:a:1", "r:a:2"],
            ),
            (false, &[], &[]),
        ];
        for (by_id, ids, want) in cases {
            let got = step_request_ids("r", *by_id, ids.iter().copied());
            assert_eq!(got, *want, "by_id {by_id}, letters {ids:?}");
        }
    }

    #[test]
    fn letters_wanted_by_id_and_not_read_are_not_found_in_the_order_asked() {
        let wanted: Vec<String> = ["c", "a", "b"].map(String::from).into();
        assert_eq!(not_found(&wanted, ["a"]), ["c", "b"]);
        assert_eq!(not_found(&wanted, ["b", "a", "c"]), Vec::<String>::new());
        assert_eq!(not_found(&[], ["a"]), Vec::<String>::new());
    }

    #[test]
    fn a_repeat_reports_the_steps_an_earlier_run_finished_and_this_one_did_not() {
        let seen = |request_id: &str, status: &str| DeadLetterAction {
            request_id: request_id.into(),
            action: "discard".into(),
            dead_letter_id: "d".into(),
            message_id: None,
            reason: None,
            tenant: None,
            original_user: None,
            operator: "ops".into(),
            note: "fixed".into(),
            status: status.into(),
            created_at: chrono::Utc::now(),
            finished_at: None,
        };
        let reported = [StepReport::seen(seen("r:d:0", "done"))];
        let earlier = vec![
            seen("r:d:0", "done"),
            seen("r:d:1", "started"),
            seen("r:d:2", "not_found"),
            seen("r:d:3", "done"),
        ];
        let got: Vec<(String, StepOutcome)> = earlier_unreported(&reported, earlier)
            .into_iter()
            .map(|r| (r.request_id, r.outcome))
            .collect();
        assert_eq!(
            got,
            [
                (
                    "r:d:2".to_string(),
                    StepOutcome::AlreadyDone("discard not_found".into())
                ),
                (
                    "r:d:3".to_string(),
                    StepOutcome::AlreadyDone("discard done".into())
                ),
            ]
        );
    }
}
