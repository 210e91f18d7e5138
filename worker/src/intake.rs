//! The consumer step for one batch of deliveries, independent of the broker. It runs in
//! stages, each rule in one place:
//!
//! 1. **decode** ([`decode`]): the intent, or the error plus whatever key could be salvaged;
//! 2. **prove the tenant** ([`triage`]): a message whose tenant the transport did not prove
//!    is dead-lettered and answers nobody, whatever else is wrong with it;
//! 3. **look up the inbox**: admissible intents are admitted (inserted or matched to their
//!    row); refused messages' keys are looked up, read-only, in one query;
//! 4. **answer or claim** ([`refusal_answer`], `Answers`): new rows are claimed for
//!    dispatch; everything else is answered — from the key's row whenever it has one.
//!
//! The tenant proof ([`TenantAuth`], the tools file's `[auth]` section) is applied in stage 2.
//!
//! Answers to a delivery are routed to that delivery's `reply_to`. The AMQP layer
//! dead-letters what this step says, acks only after it returns, and starts the dispatches.

use std::collections::{BTreeMap, HashMap};

use metrics::counter;
use protocol::trace::TraceContext;
use protocol::{DecodeError, Intent, RejectReason};
use tracing::{Instrument as _, Span};

use crate::answers::{self, DeadLetterReason};
use crate::context::Context;
use crate::fault;
use crate::ledger::outbox::NewEvent;
use crate::ledger::{Admitted, LedgerError, NewOperation, Operation, State};
use crate::telemetry::metrics as m;

/// How the tenant of an intent is proven.
#[derive(Debug, Clone, Default)]
pub enum TenantAuth {
    /// The tenant field is trusted (single-tenant deployments, trusted publishers).
    #[default]
    Trusted,
    /// The broker-validated `user_id` property must map to the intent's tenant.
    UserId {
        users: BTreeMap<String, Vec<String>>,
    },
}

impl TenantAuth {
    /// Whether a message published by `user_id` may act for `tenant`.
    pub fn allows(&self, user_id: Option<&str>, tenant: &str) -> bool {
        match self {
            TenantAuth::Trusted => true,
            TenantAuth::UserId { users } => user_id
                .and_then(|u| users.get(u))
                .is_some_and(|ts| ts.iter().any(|t| t == tenant || t == "*")),
        }
    }
}

/// One delivery as the intake step needs it.
#[derive(Debug, Clone)]
pub struct Incoming {
    pub body: Vec<u8>,
    /// The broker says it delivered this message before (a consumer died without acking).
    pub redelivered: bool,
    /// The broker-validated AMQP `user_id` property, if the publisher set one.
    pub user_id: Option<String>,
    /// The trace context the message carried (a malformed one was dropped and counted).
    pub trace: Option<TraceContext>,
    /// The delivery's `process intents` span ([`Span::none`] when spans are not recorded):
    /// the parent of its first send, and what answers to this delivery carry.
    pub span: Span,
}

impl Incoming {
    /// The trace context answers to this delivery carry: its span's when recorded, else the
    /// one it came with.
    fn answer_trace(&self) -> Option<TraceContext> {
        kit::otel::outgoing(&self.span, self.trace.as_ref())
    }
}

/// An operation claimed for its first dispatch, with the span of the delivery it came from.
#[derive(Debug)]
pub struct Claimed {
    pub operation: Operation,
    /// The delivery's span: the parent of the send.
    pub parent: Span,
}

/// A delivery to copy to the dead-letter exchange before acking.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetter {
    /// Index into the batch.
    pub index: usize,
    /// Why (its stable code goes into a header and the metrics).
    pub reason: DeadLetterReason,
    /// Human-readable detail.
    pub detail: String,
}

/// What the AMQP layer must do after the step: dead-letter these, then ack the whole batch,
/// then dispatch the claimed operations.
#[derive(Debug, Default)]
pub struct StepOutcome {
    pub dead_letters: Vec<DeadLetter>,
    pub claimed: Vec<Claimed>,
    /// Result events committed (rejections and answers to duplicates).
    pub answered: usize,
}

/// Stage 1: what a body says.
#[derive(Debug)]
pub enum Decoded {
    Intent(Box<Intent>),
    /// Not an intent. `key` is the tenant and action id when they could be salvaged, and
    /// `reply_to` likewise; without a key nobody can be answered.
    Bad {
        error: DecodeError,
        key: Option<(String, String)>,
        reply_to: Option<String>,
    },
}

/// Stage 1.
pub fn decode(body: &[u8]) -> Decoded {
    match protocol::decode_intent(body) {
        Ok(intent) => Decoded::Intent(Box::new(intent)),
        Err(error) => Decoded::Bad {
            error,
            key: protocol::salvage_key(body),
            reply_to: protocol::salvage_reply_to(body),
        },
    }
}

/// Stages 1 and 2 for one delivery.
#[derive(Debug)]
pub enum Triage {
    /// Nobody may be answered (no key, or a tenant the transport did not prove): only
    /// dead-lettered.
    Drop(DeadLetter),
    /// A proven key whose message is not admitted: answered (from the key's row when it has
    /// one) and dead-lettered.
    Refuse(Refusal),
    /// A proven intent for a configured tool.
    Admit(Valid),
}

/// A message refused before admission, for a key whose tenant is proven.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub index: usize,
    pub tenant: String,
    pub action_id: String,
    /// The delivery's own `reply_to`: where its answer goes.
    pub reply_to: Option<String>,
    /// The trace context its answer carries.
    pub answer_trace: Option<TraceContext>,
    pub kind: RefusalKind,
}

#[derive(Debug, Clone)]
pub enum RefusalKind {
    /// The body broke the contract; its fingerprint is unknowable.
    Invalid { code: &'static str, error: String },
    /// A well-formed intent naming a tool this pool does not have.
    UnknownTool { tool: String, fingerprint: String },
}

/// An intent that passed stages 1 and 2, with where it came from.
#[derive(Debug, Clone)]
pub struct Valid {
    /// Its index in the batch.
    pub index: usize,
    pub redelivered: bool,
    pub new: NewOperation,
    /// The trace context answers to this delivery carry.
    pub answer_trace: Option<TraceContext>,
}

/// Stages 1 and 2: decode, then prove the tenant the message names before anything about it
/// is answered — for decode failures and unknown tools too, since an answer is routed to
/// that tenant. `has_tool` says whether the pool has an adapter for a tool.
pub fn triage(
    index: usize,
    incoming: &Incoming,
    auth: &TenantAuth,
    has_tool: impl Fn(&str) -> bool,
) -> Triage {
    let user = incoming.user_id.as_deref();
    match decode(&incoming.body) {
        Decoded::Bad {
            error, key: None, ..
        } => Triage::Drop(DeadLetter {
            index,
            reason: DeadLetterReason::InvalidMessage,
            detail: format!("{}: {error}", error.code()),
        }),
        Decoded::Bad {
            error,
            key: Some((tenant, action_id)),
            reply_to,
        } => {
            if !auth.allows(user, &tenant) {
                return Triage::Drop(tenant_mismatch(
                    index,
                    user,
                    &tenant,
                    &format!("undecodable body ({})", error.code()),
                ));
            }
            Triage::Refuse(Refusal {
                index,
                tenant,
                action_id,
                reply_to,
                answer_trace: incoming.answer_trace(),
                kind: RefusalKind::Invalid {
                    code: error.code(),
                    error: error.to_string(),
                },
            })
        }
        Decoded::Intent(intent) => {
            fault::point("crash_on_intake", &intent.action_id);
            if !auth.allows(user, &intent.tenant) {
                return Triage::Drop(tenant_mismatch(
                    index,
                    user,
                    &intent.tenant,
                    &format!("intent for tool {:?}", intent.tool),
                ));
            }
            let (arguments, fingerprint) = intent.canonical_arguments_and_fingerprint();
            if !has_tool(&intent.tool) {
                return Triage::Refuse(Refusal {
                    index,
                    tenant: intent.tenant,
                    action_id: intent.action_id,
                    reply_to: intent.reply_to,
                    answer_trace: incoming.answer_trace(),
                    kind: RefusalKind::UnknownTool {
                        tool: intent.tool,
                        fingerprint,
                    },
                });
            }
            let intent = *intent;
            Triage::Admit(Valid {
                index,
                redelivered: incoming.redelivered,
                new: NewOperation {
                    arguments,
                    tenant: intent.tenant,
                    action_id: intent.action_id,
                    tool: intent.tool,
                    fingerprint,
                    call_id: intent.call_id,
                    reply_to: intent.reply_to,
                    trace: incoming.trace.clone(),
                    compensates: intent.compensates,
                },
                answer_trace: incoming.answer_trace(),
            })
        }
    }
}

/// The claimed tenant is not proven: no result goes to it (that would let one tenant address
/// another, or deny another's action); the message is kept in the dead-letter queue.
fn tenant_mismatch(index: usize, user: Option<&str>, tenant: &str, what: &str) -> DeadLetter {
    DeadLetter {
        index,
        reason: DeadLetterReason::TenantMismatch,
        detail: format!(
            "publisher user {:?} may not act for tenant {tenant:?} ({what}); nothing was answered",
            user.unwrap_or("")
        ),
    }
}

impl Refusal {
    /// The dead-letter entry; its reason does not depend on what the key's row says.
    pub fn dead_letter(&self) -> DeadLetter {
        match &self.kind {
            RefusalKind::Invalid { code, error } => DeadLetter {
                index: self.index,
                reason: DeadLetterReason::InvalidMessage,
                detail: format!("{code}: {error}"),
            },
            RefusalKind::UnknownTool { tool, .. } => DeadLetter {
                index: self.index,
                reason: DeadLetterReason::UnknownTool,
                detail: format!("unknown tool {tool:?}"),
            },
        }
    }

    fn key(&self) -> (String, String) {
        (self.tenant.clone(), self.action_id.clone())
    }
}

/// Stage 4 for a refused message: the answer comes from the key's row when it has one — the
/// stored answer when this is the same intent, otherwise `intent_conflict` saying the key is
/// taken (an undecodable body's fingerprint is unknowable, so it always differs). Only a key
/// without a row reads "nothing was done". Returns the event and its metrics reason.
pub fn refusal_answer(r: &Refusal, row: Option<&Operation>) -> (NewEvent, &'static str) {
    let (event, label) = match (row, &r.kind) {
        (None, RefusalKind::Invalid { code, error }) => (
            answers::invalid_message(&r.tenant, &r.action_id, code, error),
            RejectReason::InvalidMessage.as_str(),
        ),
        (None, RefusalKind::UnknownTool { tool, fingerprint }) => (
            answers::unknown_tool(&r.tenant, &r.action_id, tool, fingerprint),
            RejectReason::UnknownTool.as_str(),
        ),
        (Some(op), RefusalKind::UnknownTool { fingerprint, .. })
            if *fingerprint == op.fingerprint =>
        {
            (answers::stored_result(op), "stored")
        }
        (Some(op), RefusalKind::Invalid { code, .. }) => (
            answers::key_taken_by_undecodable(&r.tenant, &r.action_id, code, op),
            RejectReason::IntentConflict.as_str(),
        ),
        (Some(op), RefusalKind::UnknownTool { tool, fingerprint }) => (
            answers::key_taken_by_unknown_tool(&r.tenant, &r.action_id, tool, fingerprint, op),
            RejectReason::IntentConflict.as_str(),
        ),
    };
    (
        event
            .answering(r.reply_to.as_deref())
            .with_trace(r.answer_trace.clone()),
        label,
    )
}

/// Processes one batch. On a ledger error nothing was acked and the caller retries the same
/// batch later; every write here is idempotent under retry (the inbox dedupes).
/// `max_bytes` is `WORKER_MAX_MESSAGE_BYTES`: a larger body is dead-lettered unread.
pub async fn step(
    ctx: &Context,
    auth: &TenantAuth,
    max_bytes: usize,
    batch: &[Incoming],
) -> Result<StepOutcome, LedgerError> {
    let mut out = StepOutcome::default();
    let (refusals, valid) = sort(ctx, auth, max_bytes, batch, &mut out.dead_letters);
    // Compensations are admitted one by one, each against its original's row.
    let (compensations, valid): (Vec<Valid>, Vec<Valid>) =
        valid.into_iter().partition(|v| v.new.compensates.is_some());
    if !compensations.is_empty() {
        let (events, claimed) = admit_compensations(ctx, batch, &compensations).await?;
        ctx.ledger.emit(&events).await?;
        out.answered += events.len();
        out.claimed.extend(claimed);
    }

    // Stage 3: admit, then look up the refused keys (after admitting, so a key first
    // recorded in this very batch is seen too).
    let (unique, later) = fold_duplicates(&valid);
    let recorded: Vec<TraceContext> = batch
        .iter()
        .filter_map(|d| kit::otel::context_of(&d.span))
        .collect();
    let span = crate::telemetry::spans::ledger_batch("admit", batch.len(), &recorded);
    // An intent its tool asks a person to approve is recorded awaiting that, never claimed;
    // the others are claimed by their insert. Two statements only when a batch holds both.
    let (awaiting, direct): (Vec<usize>, Vec<usize>) =
        (0..unique.len()).partition(|&u| needs_approval(ctx, &unique[u].new));
    let mut admitted: Vec<Option<Admitted>> = unique.iter().map(|_| None).collect();
    if !direct.is_empty() {
        let rows = ctx
            .ledger
            .admit_claimed(
                &direct.iter().map(|&u| &unique[u].new).collect::<Vec<_>>(),
                &ctx.worker_id,
                ctx.lease,
                &ctx.windows,
            )
            .instrument(span.clone())
            .await?;
        for (&u, a) in direct.iter().zip(rows) {
            admitted[u] = Some(a);
        }
    }
    if !awaiting.is_empty() {
        let rows = ctx
            .ledger
            .admit_awaiting(
                &awaiting.iter().map(|&u| &unique[u].new).collect::<Vec<_>>(),
                &ctx.worker_id,
                &ctx.approvals,
            )
            .instrument(span.clone())
            .await?;
        for (&u, a) in awaiting.iter().zip(rows) {
            if a.inserted {
                counter!(m::APPROVALS, "tool" => a.operation.tool.clone(), "outcome" => "requested")
                    .increment(1);
            }
            admitted[u] = Some(a);
        }
    }
    // Every intent got its row: both statements answer one row per intent, in order.
    let admitted: Vec<Admitted> = admitted.into_iter().flatten().collect();
    if let Some(a) = admitted.iter().find(|a| a.inserted) {
        fault::point("after_prepared", &a.operation.action_id);
    }
    let rows = if refusals.is_empty() {
        Vec::new()
    } else {
        let mut keys: Vec<(String, String)> = refusals.iter().map(Refusal::key).collect();
        keys.sort();
        keys.dedup();
        ctx.ledger.find_keys(&keys).instrument(span.clone()).await?
    };

    // Stage 4.
    let mut events = refusal_events(batch, &refusals, &rows);
    let answers = Answers::new(&unique, &admitted);
    events.extend(answers.before_claim());
    // New rows were claimed by their insert. Only `prepared` rows found under a known key (a
    // crash between an older admission and its claim) need a claim statement; without them the
    // answers, if any, are one insert of their own, and a batch of new intents costs one
    // statement in all.
    let (claimed, answered) = if answers.to_claim.is_empty() {
        events.extend(answers.after_claim(&[], &later));
        ctx.ledger.emit(&events).instrument(span).await?;
        (Vec::new(), events.len())
    } else {
        ctx.ledger
            .claim_and_answer(
                &answers.to_claim,
                &ctx.worker_id,
                ctx.lease,
                &ctx.windows,
                |claimed| {
                    events.extend(answers.after_claim(claimed, &later));
                    events
                },
            )
            .instrument(span)
            .await?
    };
    out.answered += answered;
    // `admitted[u]` is the row of `unique[u]`; a row claimed afterwards finds its delivery
    // by id.
    let parent = |u: usize| batch[unique[u].index].span.clone();
    let claimed: Vec<Claimed> = claimed
        .into_iter()
        .map(|operation| Claimed {
            parent: admitted
                .iter()
                .position(|a| a.operation.id == operation.id)
                .map_or_else(Span::none, parent),
            operation,
        })
        .collect();
    out.claimed.extend(
        admitted
            .into_iter()
            .enumerate()
            .filter(|(_, a)| a.inserted && a.operation.state() == State::Dispatching)
            .map(|(u, a)| Claimed {
                parent: parent(u),
                operation: a.operation,
            })
            .chain(claimed),
    );
    if let Some(c) = out.claimed.first() {
        fault::point("after_dispatching", &c.operation.action_id);
    }
    Ok(out)
}

/// Admits each compensation (the first of its key in the batch; later ones are answered like
/// it) against its original's row ([`crate::ledger::Ledger::admit_compensation`]): claimed for
/// dispatch, recorded awaiting approval when its tool asks for one, answered from the key's
/// row, or refused with the reason (nothing recorded; a later intent may find the original
/// settled). Returns the answers and the claimed rows.
async fn admit_compensations(
    ctx: &Context,
    batch: &[Incoming],
    compensations: &[Valid],
) -> Result<(Vec<NewEvent>, Vec<Claimed>), LedgerError> {
    use crate::ledger::compensation::{Admission, CompensationAdmission};
    let mut events = Vec::new();
    let mut claimed = Vec::new();
    let mut first: HashMap<(&str, &str), NewEvent> = HashMap::new();
    for v in compensations {
        let key = (v.new.tenant.as_str(), v.new.action_id.as_str());
        let answer = |e: NewEvent| {
            e.answering(v.new.reply_to.as_deref())
                .with_trace(v.answer_trace.clone())
        };
        if let Some(e) = first.get(&key) {
            // A later copy in this batch: the first's answer, to this delivery.
            duplicate(if v.redelivered {
                "redelivery"
            } else {
                "in_flight"
            });
            events.push(answer(e.clone()));
            continue;
        }
        let Some(tool) = ctx.tools.get(&v.new.tool) else {
            continue;
        };
        let how = if needs_approval(ctx, &v.new) {
            Admission::Awaiting {
                worker_id: &ctx.worker_id,
                terms: &ctx.approvals,
            }
        } else {
            Admission::Claimed {
                worker_id: &ctx.worker_id,
                lease: ctx.lease,
                windows: &ctx.windows,
            }
        };
        let event = match ctx
            .ledger
            .admit_compensation(&v.new, &tool.config.compensation_for, &how)
            .await?
        {
            CompensationAdmission::Admitted(a) if a.inserted => {
                let a = *a;
                if a.operation.state() == State::Dispatching {
                    let event = answers::pending(&a.operation);
                    claimed.push(Claimed {
                        parent: batch[v.index].span.clone(),
                        operation: a.operation,
                    });
                    first.insert(key, event);
                    continue;
                }
                counter!(m::APPROVALS, "tool" => a.operation.tool.clone(), "outcome" => "requested")
                    .increment(1);
                answers::stored_result(&a.operation)
            }
            CompensationAdmission::Admitted(a) if a.operation.fingerprint != v.new.fingerprint => {
                duplicate("conflict");
                conflict_event(&v.new, &a.operation)
            }
            CompensationAdmission::Admitted(a) => {
                duplicate(reason(v.redelivered, &a.operation));
                answers::stored_result(&a.operation)
            }
            CompensationAdmission::Refused(why) => {
                let event = answers::compensation_refused(&v.new, &why);
                if let Some(reason) = event.event.reason {
                    counter!(m::REJECTED, "reason" => reason.as_str()).increment(1);
                }
                event
            }
        };
        let event = answer(event);
        first.insert(key, event.clone());
        events.push(event);
    }
    Ok((events, claimed))
}

/// Whether the intent's tool asks a person to approve it before it is sent. Arguments the rule
/// cannot read (never the case for a decoded intent) need approval: a rule never fails open.
fn needs_approval(ctx: &Context, new: &NewOperation) -> bool {
    let Some(rule) = ctx
        .tools
        .get(&new.tool)
        .and_then(|t| t.config.approval.as_ref())
    else {
        return false;
    };
    match &rule.when {
        crate::config::approval::When::Always => true,
        crate::config::approval::When::Matching(_) => serde_json::from_str(&new.arguments)
            .map_or(true, |arguments| rule.needed_for(&arguments)),
    }
}

/// Stages 1 and 2 for every delivery: too large (dead-lettered unread), then decoded and the
/// tenant proven ([`triage`]). Returns the refusals (dead-lettered and answered) and the
/// admissible intents; `dead_letters` gets every delivery that is not admitted.
fn sort(
    ctx: &Context,
    auth: &TenantAuth,
    max_bytes: usize,
    batch: &[Incoming],
    dead_letters: &mut Vec<DeadLetter>,
) -> (Vec<Refusal>, Vec<Valid>) {
    let mut refusals: Vec<Refusal> = Vec::new();
    let mut valid: Vec<Valid> = Vec::new();
    for (index, incoming) in batch.iter().enumerate() {
        if incoming.body.len() > max_bytes {
            let error = DecodeError::TooLarge {
                size: incoming.body.len(),
                limit: max_bytes,
            };
            dead_letters.push(DeadLetter {
                index,
                reason: DeadLetterReason::InvalidMessage,
                detail: format!("{}: {error}", error.code()),
            });
            continue;
        }
        match triage(index, incoming, auth, |tool| ctx.tools.get(tool).is_some()) {
            Triage::Drop(dl) => {
                incoming
                    .span
                    .record("intent_worker.outcome", dl.reason.as_str());
                dead_letters.push(dl)
            }
            Triage::Refuse(r) => {
                let span = &incoming.span;
                span.record("intent_worker.tenant", r.tenant.as_str());
                span.record("intent_worker.action_id", r.action_id.as_str());
                span.record("intent_worker.outcome", r.dead_letter().reason.as_str());
                dead_letters.push(r.dead_letter());
                refusals.push(r);
            }
            Triage::Admit(v) => {
                let span = &incoming.span;
                span.record("intent_worker.tenant", v.new.tenant.as_str());
                span.record("intent_worker.action_id", v.new.action_id.as_str());
                span.record("intent_worker.tool", v.new.tool.as_str());
                valid.push(v)
            }
        }
    }
    (refusals, valid)
}

/// Stage 4 for the refusals: each answered from its key's row when there is one
/// ([`refusal_answer`]), counted as a duplicate or a rejection.
fn refusal_events(batch: &[Incoming], refusals: &[Refusal], rows: &[Operation]) -> Vec<NewEvent> {
    let mut events = Vec::with_capacity(refusals.len());
    for r in refusals {
        let row = rows
            .iter()
            .find(|o| o.tenant == r.tenant && o.action_id == r.action_id);
        let (event, label) = refusal_answer(r, row);
        match (label, row) {
            ("stored", Some(op)) => duplicate(reason(batch[r.index].redelivered, op)),
            _ => counter!(m::REJECTED, "reason" => label).increment(1),
        }
        events.push(event);
    }
    events
}

/// Folds duplicates inside the batch: the first of a key is admitted, each later one is
/// answered after, with the index of its first in the unique list.
fn fold_duplicates(valid: &[Valid]) -> (Vec<&Valid>, Vec<(&Valid, usize)>) {
    let mut first_of: HashMap<(&str, &str), usize> = HashMap::new();
    let mut unique: Vec<&Valid> = Vec::new();
    let mut later: Vec<(&Valid, usize)> = Vec::new();
    for v in valid {
        let key = (v.new.tenant.as_str(), v.new.action_id.as_str());
        match first_of.get(&key) {
            Some(&u) => later.push((v, u)),
            None => {
                first_of.insert(key, unique.len());
                unique.push(v);
            }
        }
    }
    (unique, later)
}

/// Stage 4 for admitted intents: which rows to claim, and the answers to deliveries whose
/// key was already recorded — each routed to that delivery's `reply_to`.
struct Answers<'a> {
    unique: &'a [&'a Valid],
    admitted: &'a [Admitted],
    to_claim: Vec<i64>,
    /// Per unique intent: the stored row it must be answered from.
    answer_from: Vec<Option<&'a Operation>>,
    conflicts: Vec<NewEvent>,
}

impl<'a> Answers<'a> {
    fn new(unique: &'a [&'a Valid], admitted: &'a [Admitted]) -> Answers<'a> {
        let mut a = Answers {
            unique,
            admitted,
            to_claim: Vec::new(),
            answer_from: vec![None; unique.len()],
            conflicts: Vec::new(),
        };
        for (u, (v, adm)) in unique.iter().zip(admitted).enumerate() {
            let op = &adm.operation;
            if adm.inserted && op.state() == State::AwaitingApproval {
                // Recorded to wait for approval: answered `pending` at once, not dispatched.
                a.answer_from[u] = Some(op);
            } else if adm.inserted {
                // Claimed by its own insert: dispatched, not answered.
            } else if op.fingerprint != v.new.fingerprint {
                a.conflicts
                    .push(conflict_event(&v.new, op).with_trace(v.answer_trace.clone()));
                duplicate("conflict");
            } else if op.state() == State::Prepared {
                a.to_claim.push(op.id);
            } else {
                duplicate(reason(v.redelivered, op));
                a.answer_from[u] = Some(op);
            }
        }
        a
    }

    /// Answers known before claiming (conflicts with stored rows).
    fn before_claim(&self) -> Vec<NewEvent> {
        self.conflicts.clone()
    }

    /// Answers written in the claim's commit, once it is known which rows this worker won.
    fn after_claim(&self, claimed: &[Operation], later: &[(&Valid, usize)]) -> Vec<NewEvent> {
        let mut events = Vec::new();
        for (u, a) in self.admitted.iter().enumerate() {
            let op = &a.operation;
            let delivery = self.unique[u];
            let answer = |e: NewEvent| {
                e.answering(delivery.new.reply_to.as_deref())
                    .with_trace(delivery.answer_trace.clone())
            };
            if self.to_claim.contains(&op.id) && !claimed.iter().any(|c| c.id == op.id) {
                // A prepared row someone else claimed first: it is in flight.
                duplicate(reason(delivery.redelivered, op));
                events.push(answer(answers::pending(op)));
            } else if let Some(op) = self.answer_from[u] {
                events.push(answer(answers::stored_result(op)));
            }
        }
        for (v, u) in later {
            let first = &self.admitted[*u].operation;
            if first.fingerprint != v.new.fingerprint {
                events.push(conflict_event(&v.new, first).with_trace(v.answer_trace.clone()));
                duplicate("conflict");
            } else {
                let current = claimed.iter().find(|c| c.id == first.id).unwrap_or(first);
                duplicate(reason(v.redelivered, current));
                events.push(
                    answers::stored_result(current)
                        .answering(v.new.reply_to.as_deref())
                        .with_trace(v.answer_trace.clone()),
                );
            }
        }
        events
    }
}

fn duplicate(reason: &'static str) {
    counter!(m::DUPLICATES, "reason" => reason).increment(1);
}

/// Why a known key was not dispatched again.
fn reason(redelivered: bool, op: &Operation) -> &'static str {
    if redelivered {
        "redelivery"
    } else if op.state().is_final() {
        "completed"
    } else {
        "in_flight"
    }
}

/// Same key, other intent: rejected before any network activity; the stored result is never
/// returned for it. Routed to the delivery that reused the key.
fn conflict_event(new: &NewOperation, _stored: &Operation) -> NewEvent {
    counter!(m::REJECTED, "reason" => RejectReason::IntentConflict.as_str()).increment(1);
    answers::conflict(new)
}

#[cfg(test)]
mod tests {
    use chrono::Utc;
    use protocol::Status;
    use serde_json::json;

    use super::*;
    use crate::ledger::StateColumn;

    fn alice_for_a() -> TenantAuth {
        TenantAuth::UserId {
            users: BTreeMap::from([("alice".to_string(), vec!["tenant-a".to_string()])]),
        }
    }

    fn incoming(body: &str, user: Option<&str>) -> Incoming {
        Incoming {
            body: body.as_bytes().to_vec(),
            redelivered: false,
            user_id: user.map(str::to_string),
            trace: None,
            span: Span::none(),
        }
    }

    fn refund(tenant: &str, action_id: &str, reply_to: Option<&str>) -> String {
        let mut v = json!({"tenant": tenant, "action_id": action_id, "tool": "refund",
                           "arguments": {"order": "o-1"}});
        if let Some(r) = reply_to {
            v["reply_to"] = json!(r);
        }
        v.to_string()
    }

    fn op(state: State, fingerprint: &str, reply_to: Option<&str>) -> Operation {
        let now = Utc::now();
        Operation {
            id: 7,
            tenant: "tenant-a".into(),
            action_id: "k-1".into(),
            tool: "refund".into(),
            fingerprint: fingerprint.into(),
            arguments: Some("{}".into()),
            call_id: None,
            reply_to: reply_to.map(str::to_string),
            state: StateColumn(state),
            fence: 1,
            lease_owner: None,
            lease_until: None,
            attempts: 1,
            recovery_attempts: 0,
            next_attempt_at: None,
            first_dispatch_at: Some(now),
            replay_deadline: None,
            receipt: Some(crate::document::Document::from_value(
                json!({"receipt_id": "r-1"}),
            )),
            receipt_id: Some("r-1".into()),
            evidence: None,
            last_reported: None,
            created_at: now,
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

    fn refused(t: Triage) -> Refusal {
        match t {
            Triage::Refuse(r) => r,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn an_unproven_tenant_is_dropped_whatever_else_is_wrong() {
        let auth = alice_for_a();
        let bodies = [
            r#"{"tenant":"tenant-b","action_id":"b-1","tool":"refund","arguments":5}"#.to_string(),
            refund("tenant-b", "b-1", None).replace("refund", "teleport"),
            refund("tenant-b", "b-1", None),
        ];
        for body in &bodies {
            match triage(3, &incoming(body, Some("alice")), &auth, |t| t == "refund") {
                Triage::Drop(dl) => {
                    assert_eq!(dl.index, 3);
                    assert_eq!(dl.reason, "tenant_mismatch");
                    assert!(dl.detail.contains("alice") && dl.detail.contains("tenant-b"));
                }
                other => panic!("{body}: expected a drop, got {other:?}"),
            }
        }
        // No user at all proves nothing either.
        let t = triage(0, &incoming(&bodies[0], None), &auth, |_| true);
        assert!(matches!(
            t,
            Triage::Drop(DeadLetter {
                reason: DeadLetterReason::TenantMismatch,
                ..
            })
        ));
    }

    #[test]
    fn proven_tenants_are_refused_or_admitted_and_unsalvageable_bodies_dropped() {
        let auth = alice_for_a();
        let bad = r#"{"tenant":"tenant-a","action_id":"k-1","tool":"refund","arguments":5,"reply_to":"ag-1"}"#;
        let r = refused(triage(0, &incoming(bad, Some("alice")), &auth, |_| true));
        assert_eq!(r.reply_to.as_deref(), Some("ag-1"));
        assert!(matches!(
            r.kind,
            RefusalKind::Invalid {
                code: "wrong_type",
                ..
            }
        ));
        assert_eq!(r.dead_letter().reason, "invalid_message");

        let unknown = refund("tenant-a", "k-1", None);
        let r = refused(triage(0, &incoming(&unknown, Some("alice")), &auth, |_| {
            false
        }));
        assert_eq!(r.dead_letter().reason, "unknown_tool");

        let t = triage(0, &incoming(&unknown, Some("alice")), &auth, |_| true);
        assert!(matches!(t, Triage::Admit(_)));

        let t = triage(0, &incoming("not json", Some("alice")), &auth, |_| true);
        assert!(matches!(
            t,
            Triage::Drop(DeadLetter {
                reason: DeadLetterReason::InvalidMessage,
                ..
            })
        ));
        // Trusted mode proves every tenant.
        let t = triage(0, &incoming(&unknown, None), &TenantAuth::Trusted, |_| true);
        assert!(matches!(t, Triage::Admit(_)));
    }

    #[test]
    fn a_key_with_a_row_is_answered_from_the_row() {
        let auth = TenantAuth::Trusted;
        let body = refund("tenant-a", "k-1", Some("agent-2"));
        let r = refused(triage(0, &incoming(&body, None), &auth, |_| false));
        let RefusalKind::UnknownTool { fingerprint, .. } = &r.kind else {
            unreachable!()
        };

        // No row: "nothing was done".
        let (ev, label) = refusal_answer(&r, None);
        assert_eq!(label, "unknown_tool");
        assert!(ev.event.message.contains("nothing was done"));
        assert_eq!(ev.routing_key(), "tenant-a.@.agent-2");

        // Same intent, row succeeded: the stored answer, to this delivery's reply_to.
        let row = op(State::Succeeded, fingerprint, Some("agent-1"));
        let (ev, label) = refusal_answer(&r, Some(&row));
        assert_eq!(label, "stored");
        assert_eq!(ev.event.status, Status::Succeeded);
        assert_eq!(
            ev.event.receipt.as_ref(),
            row.receipt.as_ref().map(|r| r.value())
        );
        assert_eq!(ev.routing_key(), "tenant-a.@.agent-2");

        // Another intent under the key: intent_conflict naming the row's state.
        let row = op(State::Unknown, "other", None);
        let (ev, label) = refusal_answer(&r, Some(&row));
        assert_eq!(label, "intent_conflict");
        assert_eq!(ev.event.reason, Some(RejectReason::IntentConflict));
        assert!(!ev.event.message.contains("nothing was done"));
        assert!(ev
            .event
            .message
            .contains("already has an operation (refund unknown)"));

        // An undecodable body's fingerprint is unknowable: always a conflict, never stored.
        let bad = r#"{"tenant":"tenant-a","action_id":"k-1","tool":"refund","arguments":5}"#;
        let r = refused(triage(0, &incoming(bad, None), &auth, |_| true));
        let row = op(State::Succeeded, fingerprint, Some("agent-1"));
        let (ev, label) = refusal_answer(&r, Some(&row));
        assert_eq!(label, "intent_conflict");
        assert_eq!(ev.event.fingerprint, None);
        assert_eq!(
            ev.routing_key(),
            "tenant-a",
            "no reply_to: the tenant-wide key"
        );
        let (ev, _) = refusal_answer(&r, None);
        assert_eq!(ev.event.reason, Some(RejectReason::InvalidMessage));
        assert_eq!(ev.event.detail.as_deref(), Some("wrong_type"));
    }

    fn valid(action_id: &str, fingerprint: &str, reply_to: Option<&str>) -> Valid {
        Valid {
            index: 0,
            redelivered: false,
            new: NewOperation {
                tenant: "tenant-a".into(),
                action_id: action_id.into(),
                tool: "refund".into(),
                fingerprint: fingerprint.into(),
                arguments: "{}".into(),
                call_id: None,
                reply_to: reply_to.map(str::to_string),
                trace: None,
                compensates: None,
            },
            answer_trace: None,
        }
    }

    #[test]
    fn answers_to_deliveries_go_to_their_own_reply_to_not_the_rows() {
        // The row was recorded by agent-1; agent-2 repeats the intent, agent-3 reuses the key.
        let row = op(State::Succeeded, "f", Some("agent-1"));
        let batch = [
            valid("k-1", "f", Some("agent-2")),
            valid("k-1", "other", Some("agent-3")),
            valid("k-1", "f", None),
        ];
        let (unique, later) = fold_duplicates(&batch);
        let admitted = [Admitted {
            operation: row.clone(),
            inserted: false,
        }];
        let answers = Answers::new(&unique, &admitted);
        assert!(answers.to_claim.is_empty());
        assert!(answers.before_claim().is_empty());
        let events = answers.after_claim(&[], &later);
        let keys: Vec<(String, Status)> = events
            .iter()
            .map(|e| (e.routing_key(), e.event.status))
            .collect();
        assert_eq!(
            keys,
            [
                ("tenant-a.@.agent-2".to_string(), Status::Succeeded),
                ("tenant-a.@.agent-3".to_string(), Status::Rejected),
                ("tenant-a".to_string(), Status::Succeeded),
            ]
        );
        // Events about the operation itself keep the row's reply_to.
        assert_eq!(
            answers::stored_result(&row).routing_key(),
            "tenant-a.@.agent-1"
        );
    }

    #[test]
    fn in_batch_duplicates_fold_onto_the_first_of_their_key() {
        let v = |id: &str| Valid {
            index: 0,
            redelivered: false,
            new: NewOperation {
                tenant: "t".into(),
                action_id: id.into(),
                tool: "refund".into(),
                fingerprint: "f".into(),
                arguments: "{}".into(),
                call_id: None,
                reply_to: None,
                trace: None,
                compensates: None,
            },
            answer_trace: None,
        };
        let batch = [v("a"), v("b"), v("a"), v("a")];
        let (unique, later) = fold_duplicates(&batch);
        assert_eq!(unique.len(), 2);
        assert_eq!(later.iter().map(|(_, u)| *u).collect::<Vec<_>>(), [0, 0]);
    }

    #[test]
    fn user_id_auth_maps_users_to_tenants() {
        let auth = TenantAuth::UserId {
            users: BTreeMap::from([("agent-n".to_string(), vec!["north".to_string()])]),
        };
        assert!(auth.allows(Some("agent-n"), "north"));
        assert!(!auth.allows(Some("agent-n"), "south"));
        assert!(!auth.allows(None, "north"));
        assert!(TenantAuth::Trusted.allows(None, "any"));
    }
}
