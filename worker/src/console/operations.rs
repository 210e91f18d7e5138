//! The operations pages: the filtered list (unresolved by default, finished on request), the
//! same set grouped by cause, and one operation with its timeline and the actions resolve,
//! fail and recheck — each through [`crate::ops::actions`], the same guarded, audited,
//! idempotent functions as the API and `worker ops`, with the signed-in operator's name.
//!
//! An `accepted` operation (a long-running write the downstream acknowledged) shows its
//! operation id and its last poll, read from the row itself (`last_poll`): a poll writes no
//! row of its own, its lease moves the fence and its answer replaces the evidence, so the row
//! says what the last poll said and when. Its recheck polls now.

use std::collections::BTreeMap;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::{Extension, Form};
use chrono::{DateTime, Utc};
use maud::{html, Markup};

use super::filter::{ConsoleFilter, Scope};
use super::views::{self, age_of, excerpt, json, visible, Nav};
use super::{html, redirect, refuse_form, request_id, Shared, Signed};
use crate::ledger::cause;
use crate::ledger::queries::{HistoryEntry, Page};
use crate::ledger::{Operation, State as OpState};
use crate::ops::actions::{self, FailInput, OpsError, RecheckInput, ResolveInput};

/// `GET /ui/operations`.
pub async fn list(
    State(state): Shared,
    Extension(signed): Extension<Signed>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    let Ok(tenant) = super::reads(&signed) else {
        return super::approvers_elsewhere(&signed);
    };
    let filter = match ConsoleFilter::parse(&query) {
        Ok(f) => f,
        Err(e) => {
            let body = html! {
                h1 { "Operations" }
                (views::notice("error", &e))
                (filter_form(&ConsoleFilter::default(), &signed))
            };
            return html(
                StatusCode::BAD_REQUEST,
                views::page("Operations", &signed.frame(Nav::Operations), body),
            );
        }
    };
    let search = filter.search(tenant);
    let ledger = &state.ctx.ledger;
    let results = if filter.groups {
        ledger
            .search_groups(&search)
            .await
            .map(|g| groups_table(&filter, &g))
    } else {
        let page = Page {
            after: filter.after,
            descending: filter.scope != Scope::Unresolved,
            limit: filter.limit,
        };
        ledger
            .search(&search, page)
            .await
            .map(|ops| rows_table(&filter, &ops))
    };
    let results = match results {
        Ok(r) => r,
        Err(e) => return super::ledger_unavailable(&signed, &e),
    };
    let here = format!("/ui/operations?{}", filter.query(&view_pair(filter.groups)));
    let other_view = format!(
        "/ui/operations?{}",
        filter.query(&view_pair(!filter.groups))
    );
    let body = html! {
        h1 { "Operations" }
        (filter_form(&filter, &signed))
        p.links {
            a href=(here) { "Link to this view" }
            " · "
            a href=(other_view) { @if filter.groups { "List the operations" } @else { "Group by cause" } }
            @if signed.session.is_admin() && filter.scope == Scope::Unresolved {
                " · "
                a href=(format!("/ui/bulk?{}", filter.query(&[]))) { "Recheck or fail all of these…" }
            }
        }
        (results)
    };
    html(
        StatusCode::OK,
        views::page("Operations", &signed.frame(Nav::Operations), body),
    )
}

fn view_pair(groups: bool) -> Vec<(&'static str, String)> {
    if groups {
        vec![("view", "groups".into())]
    } else {
        Vec::new()
    }
}

/// The filter form (GET: the result has a URL of its own).
fn filter_form(f: &ConsoleFilter, signed: &Signed) -> Markup {
    let text = |v: &Option<String>| v.as_deref().map(visible).unwrap_or_default();
    let states: Vec<&str> = f.states.iter().map(|s| s.as_str()).collect();
    html! {
        form.filter method="get" action="/ui/operations" {
            label { "scope "
                select name="scope" {
                    @for scope in [Scope::Unresolved, Scope::Finished, Scope::All] {
                        option value=(scope.as_str()) selected[f.scope == scope] { (scope.as_str()) }
                    }
                }
            }
            label { "state " input type="text" name="state" value=(states.join(",")) placeholder="held,unknown"; }
            @if signed.session.is_admin() {
                label { "tenant " input type="text" name="tenant" value=(text(&f.tenant)); }
            }
            label { "tool " input type="text" name="tool" value=(text(&f.tool)); }
            label { "cause " input type="text" name="cause" value=(text(&f.cause)) placeholder="http_503, timeout"; }
            label { "older than " input type="text" name="min_age" value=(text(&f.min_age)) placeholder="15m"; }
            label { "newer than " input type="text" name="max_age" value=(text(&f.max_age)) placeholder="2d"; }
            label { "created after " input type="text" name="created_after" value=(text(&f.created_after)) placeholder="2026-01-31T08:00"; }
            label { "created before " input type="text" name="created_before" value=(text(&f.created_before)); }
            label { "updated after " input type="text" name="updated_after" value=(text(&f.updated_after)); }
            label { "updated before " input type="text" name="updated_before" value=(text(&f.updated_before)); }
            label { "text " input type="search" name="q" value=(text(&f.text)) placeholder="in action id or evidence"; }
            label { "page size " input type="number" name="limit" min="1" max="200" value=(f.limit); }
            @if f.groups { input type="hidden" name="view" value="groups"; }
            button type="submit" { "Filter" }
            a href="/ui/operations" { "reset" }
        }
    }
}

fn rows_table(filter: &ConsoleFilter, ops: &[Operation]) -> Markup {
    let next = (ops.len() as i64 == filter.limit)
        .then(|| ops.last().map(|o| o.id))
        .flatten();
    let now = Utc::now();
    // The downstream's operation id gets a column only on a page that has one to show.
    let remote = ops.iter().any(|o| o.remote_id.is_some());
    html! {
        @if ops.is_empty() {
            p.empty { "No operation matches." }
        } @else {
            table.operations {
                thead { tr {
                    th.num { "id" } th { "tenant" } th { "action id" } th { "tool" } th { "state" }
                    @if remote { th { "operation id" } }
                    th { "cause" } th { "age" } th { "updated" } th.num { "attempts" } th { "evidence" }
                } }
                tbody {
                    @for op in ops {
                        @let class = cause::classify(op.state().as_str(), op.evidence.as_deref());
                        @let poll = last_poll(op, now);
                        tr {
                            td.num { (op.id) }
                            td { (visible(&op.tenant)) }
                            td { a href=(format!("/ui/operations/{}", op.id)) { (visible(&op.action_id)) } }
                            td { (visible(&op.tool)) }
                            td { (views::state_badge(op.state().as_str())) }
                            @if remote {
                                td.remote {
                                    @if let Some(id) = &op.remote_id { code { (excerpt(id, 80)) } }
                                    @if let Some(next) = poll.as_ref().and_then(LastPoll::next) {
                                        br; span.when { "next poll " (views::time(next)) }
                                    }
                                }
                            }
                            td { a href=(format!("/ui/operations?{}", filter.with("cause", &class).query(&[]))) title=(cause::meaning(&class)) { (class) } }
                            td { (age_of(op.created_at)) }
                            td { (views::time(op.updated_at)) }
                            td.num { (op.attempts) }
                            td.evidence {
                                @match &poll {
                                    // An accepted row's evidence is what its last poll said.
                                    Some(p) => { span.poll { (p.headline()) (p.joiner()) } " " (excerpt(p.said(), 120)) }
                                    None => { (excerpt(op.evidence.as_deref().unwrap_or(""), 120)) }
                                }
                            }
                        }
                    }
                }
            }
            @if let Some(after) = next {
                p.pager { a rel="next" href=(format!("/ui/operations?{}", filter.query(&[("after", after.to_string())]))) { "Next page →" } }
            }
        }
    }
}

fn groups_table(filter: &ConsoleFilter, groups: &[crate::ledger::queries::CauseGroup]) -> Markup {
    let total: i64 = groups.iter().map(|g| g.count).sum();
    html! {
        @if groups.is_empty() {
            p.empty { "No operation matches." }
        } @else {
            p { (total) " operations in " (groups.len()) " groups"
                @if total >= crate::ledger::queries::MAX_GROUPED_ROWS { " (the newest " (crate::ledger::queries::MAX_GROUPED_ROWS) " only)" } "." }
            table.groups {
                thead { tr { th { "cause" } th { "meaning" } th { "tool" } th.num { "operations" } th { "oldest" } } }
                tbody {
                    @for g in groups {
                        tr {
                            td { a href=(format!("/ui/operations?{}", filter.with("cause", &g.cause).with("tool", &g.tool).query(&[]))) { (visible(&g.cause)) } }
                            td { (cause::meaning(&g.cause)) }
                            td { (visible(&g.tool)) }
                            td.num { (g.count) }
                            td { (age_of(g.oldest)) }
                        }
                    }
                }
            }
        }
    }
}

/// What an `accepted` row says about its polls. A poll leaves no row of its own: its lease
/// moves the fence (a new `updated_at`) and its answer replaces the evidence (another one, when
/// the words changed), so the row's evidence is what the last poll said and `updated_at` when
/// that poll began or answered; a live lease is a poll running now.
#[derive(Debug, Clone, PartialEq)]
enum LastPoll<'a> {
    /// A poll holds a live lease: it began at `since`; `said` is the evidence before it.
    Running { since: DateTime<Utc>, said: &'a str },
    /// No poll since the acceptance (or since an operator's recheck asked for one) at `at`.
    Waiting {
        at: DateTime<Utc>,
        said: &'a str,
        next: Option<DateTime<Utc>>,
        recheck: bool,
    },
    /// The last poll ran at `at` and said `said`; the next one is due at `next`.
    Polled {
        at: DateTime<Utc>,
        said: &'a str,
        next: Option<DateTime<Utc>>,
    },
}

/// The words an acceptance's evidence starts with (the dispatcher's and recovery's).
const ACCEPTED_AS: &str = "accepted as operation";
/// The words an operator's recheck's evidence starts with.
const RECHECK_BY: &str = "recheck by ";

/// The last poll of `op` when it is `accepted` (None for any other state).
fn last_poll(op: &Operation, now: DateTime<Utc>) -> Option<LastPoll<'_>> {
    if op.state() != OpState::Accepted {
        return None;
    }
    let said = op.evidence.as_deref().unwrap_or("");
    if op.leased(now) {
        return Some(LastPoll::Running {
            since: op.updated_at,
            said,
        });
    }
    let at = op.updated_at;
    let next = op.next_attempt_at;
    let recheck = said.starts_with(RECHECK_BY);
    Some(if said.starts_with(ACCEPTED_AS) || recheck {
        LastPoll::Waiting {
            at,
            said,
            next,
            recheck,
        }
    } else {
        LastPoll::Polled { at, said, next }
    })
}

impl LastPoll<'_> {
    /// When the last poll ran (or that none did yet), in words.
    fn headline(&self) -> String {
        let when = |t: DateTime<Utc>| format!("{} ({} ago)", views::time(t), age_of(t));
        match self {
            LastPoll::Running { since, .. } => format!("polling now (began {})", when(*since)),
            LastPoll::Waiting {
                at, recheck: true, ..
            } => format!("recheck asked {}, poll due", when(*at)),
            LastPoll::Waiting { at, .. } => {
                format!("not polled since the acceptance ({})", when(*at))
            }
            LastPoll::Polled { at, .. } => format!("last poll {}", when(*at)),
        }
    }

    /// What joins the headline to [`LastPoll::said`] in a list row: a poll's own words, or
    /// the words the row had before the poll that runs or is due.
    fn joiner(&self) -> &'static str {
        match self {
            LastPoll::Polled { .. } => ":",
            LastPoll::Waiting { recheck: false, .. } => ":",
            LastPoll::Running { .. } | LastPoll::Waiting { .. } => "; before it:",
        }
    }

    /// What the row says: the last poll's answer, or the words before it.
    fn said(&self) -> &str {
        match self {
            LastPoll::Running { said, .. }
            | LastPoll::Waiting { said, .. }
            | LastPoll::Polled { said, .. } => said,
        }
    }

    /// When the next poll is due (none while one runs: its lease, not a poll, is in the row).
    fn next(&self) -> Option<DateTime<Utc>> {
        match self {
            LastPoll::Running { .. } => None,
            LastPoll::Waiting { next, .. } | LastPoll::Polled { next, .. } => *next,
        }
    }
}

/// The notice after a recheck, in the words of what it did to `op` (the row after it).
fn recheck_notice(op: &Operation, now: DateTime<Utc>) -> &'static str {
    match last_poll(op, now) {
        Some(LastPoll::Running { .. }) => {
            "Rechecked: a poll of its status is running now; reload for what it finds."
        }
        Some(_) => "Rechecked: its status was polled now; the state below is what it found.",
        None => "Rechecked: one recovery round (or, for an accepted operation, one poll) ran; the state below is what it found.",
    }
}

/// The polls among the history entries: a worker's entry left from `accepted` is a poll
/// (its lease moved the fence; the evidence is what the row said after it), unless the next
/// entry has the same fence: then it is the poll's beginning, still showing the words before,
/// and the next entry its answer. The last one is running while the row's lease is live.
fn poll_steps(
    history: &[HistoryEntry],
    op: &Operation,
    now: DateTime<Utc>,
) -> Vec<Option<&'static str>> {
    let running = last_poll(op, now).is_some_and(|p| matches!(p, LastPoll::Running { .. }));
    history
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let by_worker = !h.actor.starts_with("operator:");
            let from_accepted = h.from_state.as_deref() == Some("accepted");
            if !by_worker {
                return None;
            }
            if !from_accepted {
                return (h.to_state == "accepted").then_some("accepted");
            }
            if h.to_state != "accepted" {
                // Out of `accepted` by a worker: a poll's answer, or something else (a late
                // receipt, a tool no longer configured) that is not labelled a poll.
                return poll_answer(h.evidence.as_deref().unwrap_or("")).then_some("poll");
            }
            match history.get(i + 1) {
                Some(n) if n.fence == h.fence && !n.actor.starts_with("operator:") => {
                    Some("poll began")
                }
                None if running => Some("poll running"),
                _ => Some("poll"),
            }
        })
        .collect()
}

/// Whether `evidence` that moved a row out of `accepted` is a poll's answer: done, failed as
/// the status says, or held at the poll deadline ([`crate::dispatch::next_state::after_poll`]).
fn poll_answer(evidence: &str) -> bool {
    evidence.starts_with(crate::dispatch::next_state::ASYNC_DEADLINE)
        || (evidence.starts_with("operation ")
            && (evidence.contains(" done: receipt ")
                || evidence.contains(" failed, as its status says")))
}

/// What the action forms show again after a refusal (so a pasted receipt is not lost).
#[derive(Default)]
struct Prefill {
    receipt: String,
    reason: String,
    evidence: String,
}

/// The operation with this id, if the session may see it.
async fn visible_operation(
    state: &super::ConsoleState,
    signed: &Signed,
    id: &str,
) -> Result<Operation, Response> {
    let not_found = || {
        super::error_page(
            signed,
            StatusCode::NOT_FOUND,
            "Not found",
            "There is no such operation.",
        )
    };
    let tenant = super::reads(signed).map_err(|_| super::approvers_elsewhere(signed))?;
    let id: i64 = id.parse().map_err(|_| not_found())?;
    match state.ctx.ledger.get(id).await {
        Ok(Some(op)) if tenant.is_none_or(|t| t == op.tenant) => Ok(op),
        // Another tenant's operation is indistinguishable from a missing one.
        Ok(_) => Err(not_found()),
        Err(e) => Err(super::error_page(
            signed,
            StatusCode::SERVICE_UNAVAILABLE,
            "Ledger unavailable",
            &format!("The ledger could not answer: {e}"),
        )),
    }
}

/// `GET /ui/operations/{id}`.
pub async fn detail(
    State(state): Shared,
    Extension(signed): Extension<Signed>,
    Path(id): Path<String>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    let op = match visible_operation(&state, &signed, &id).await {
        Ok(op) => op,
        Err(r) => return r,
    };
    let done = query.get("done").and_then(|d| match d.as_str() {
        "resolve" => {
            Some("Resolved: the operation succeeded with the receipt you gave; the agent is told.")
        }
        "fail" => Some("Marked failed with your evidence; the agent is told."),
        "recheck" => Some(recheck_notice(&op, Utc::now())),
        "repeated" => Some("That request was already applied; nothing changed."),
        _ => None,
    });
    let notice = done.map(|d| ("ok", d.to_string()));
    detail_page(
        &state,
        &signed,
        op,
        notice,
        StatusCode::OK,
        Prefill::default(),
    )
    .await
}

async fn detail_page(
    state: &super::ConsoleState,
    signed: &Signed,
    op: Operation,
    notice: Option<(&str, String)>,
    status: StatusCode,
    prefill: Prefill,
) -> Response {
    let history = match state.ctx.ledger.history(op.id).await {
        Ok(h) => h,
        Err(e) => {
            return super::error_page(
                signed,
                StatusCode::SERVICE_UNAVAILABLE,
                "Ledger unavailable",
                &format!("The ledger could not answer: {e}"),
            )
        }
    };
    let view = actions::OperationView::new(&op, Vec::new());
    // The links both ways: the original this one undoes, the compensations of this one.
    let ledger = &state.ctx.ledger;
    let original = match &op.compensates {
        Some(o) => ledger.find(&op.tenant, o).await.ok().flatten(),
        None => None,
    };
    let compensations = ledger
        .compensations_of(&op.tenant, &op.action_id)
        .await
        .unwrap_or_default();
    let now = Utc::now();
    let poll = last_poll(&op, now);
    let class = cause::classify(op.state().as_str(), op.evidence.as_deref());
    let unresolved = !op.state().is_final();
    let title = format!("{}/{}", visible(&op.tenant), visible(&op.action_id));
    let fact = |name: &str, value: String| html! { tr { th { (name) } td { (value) } } };
    let body = html! {
        p.crumbs { a href="/ui/operations" { "Operations" } " / " (op.id) }
        h1 { (title) " " (views::state_badge(op.state().as_str())) }
        @if let Some((kind, text)) = &notice { (views::notice(kind, text)) }
        p { "Cause: " strong { (class) } " — " (cause::meaning(&class)) }
        div.columns {
            section {
                h2 { "Operation" }
                table.facts {
                    (fact("id", op.id.to_string()))
                    (fact("tenant", visible(&op.tenant)))
                    (fact("action id", visible(&op.action_id)))
                    (fact("idempotency key", visible(&view.idempotency_key)))
                    (fact("tool", visible(&op.tool)))
                    (fact("state since", views::time(op.state_since)))
                    (fact("recorded", format!("{} ({} ago)", views::time(op.created_at), age_of(op.created_at))))
                    (fact("updated", views::time(op.updated_at)))
                    (fact("write attempts", op.attempts.to_string()))
                    (fact("recovery rounds", op.recovery_attempts.to_string()))
                    (fact("fence", op.fence.to_string()))
                    (fact("lease", match (&op.lease_owner, op.lease_until) {
                        (Some(o), Some(u)) => format!("{} until {}", visible(o), views::time(u)),
                        _ => "—".into(),
                    }))
                    (fact("next attempt", views::time_or_dash(op.next_attempt_at)))
                    (fact("first dispatch", views::time_or_dash(op.first_dispatch_at)))
                    (fact("replay deadline", views::time_or_dash(op.replay_deadline)))
                    @if op.send_deadline.is_some() {
                        (fact("request deadline", views::time_or_dash(op.send_deadline)))
                    }
                    (fact("receipt id", op.receipt_id.as_deref().map(visible).unwrap_or_else(|| "—".into())))
                    (fact("operation id", op.remote_id.as_deref().map(visible).unwrap_or_else(|| "—".into())))
                    (fact("poll deadline", match op.poll_deadline {
                        Some(d) if d > now => format!("{} (in {})", views::time(d), views::age((d - now).num_milliseconds() as f64 / 1000.0)),
                        Some(d) => format!("{} (passed)", views::time(d)),
                        None => "—".into(),
                    }))
                    @if let Some(p) = &poll {
                        tr { th { "last poll" } td { span.poll { (p.headline()) } } }
                    }
                    (fact("verified by", op.verified_by.as_deref().map(visible).unwrap_or_else(|| "—".into())))
                    @if let Some(o) = &op.compensates {
                        tr { th { "compensates" } td {
                            @match &original {
                                Some(orig) => { a href=(format!("/ui/operations/{}", orig.id)) { (visible(o)) } " " (views::state_badge(orig.state().as_str())) }
                                None => { (visible(o)) " (no longer in the ledger)" }
                            }
                        } }
                    }
                    @if !compensations.is_empty() {
                        tr { th { "compensated by" } td {
                            @for (id, action_id, st) in &compensations {
                                a href=(format!("/ui/operations/{id}")) { (visible(action_id)) } " " (views::state_badge(st)) " "
                            }
                        } }
                    }
                    (fact("call id", op.call_id.as_deref().map(visible).unwrap_or_else(|| "—".into())))
                    (fact("reply to", op.reply_to.as_deref().map(visible).unwrap_or_else(|| "—".into())))
                    (fact("fingerprint", op.fingerprint.clone()))
                    tr { th { "trace" } td {
                        @match (&view.trace_id, &view.trace_url) {
                            (Some(id), Some(url)) => { a href=(url) rel="noreferrer noopener" target="_blank" { (id) } }
                            (Some(id), None) => { code { (id) } }
                            _ => { "—" }
                        }
                    } }
                }
            }
            section {
                h2 { "Request" }
                @match &view.arguments {
                    Some(args) => { pre.json { (visible(&json(args))) } }
                    None => { p { "The arguments were removed by retention." } }
                }
                h2 { "Evidence" }
                pre.evidence { (visible(op.evidence.as_deref().unwrap_or("—"))) }
                h2 { "Receipt" }
                @match &op.receipt {
                    Some(r) => { pre.json { (visible(&json(r.value()))) } }
                    None => { p { "No receipt." } }
                }
                @if let Some(a) = &op.acceptance {
                    h2 { "Acceptance" }
                    p { "The downstream's answer when it accepted the write as a long-running operation." }
                    pre.json.acceptance { (visible(&json(a.value()))) }
                }
            }
        }
        h2 { "Timeline" }
        (timeline(&history, &op, now))
        @if signed.session.is_admin() && unresolved {
            (action_forms(signed, &op, &prefill))
        }
    };
    html(
        status,
        views::page(
            &format!("Operation {}", op.id),
            &signed.frame(Nav::Operations),
            body,
        ),
    )
}

fn timeline(history: &[HistoryEntry], op: &Operation, now: DateTime<Utc>) -> Markup {
    let steps = poll_steps(history, op, now);
    html! {
        table.timeline {
            thead { tr { th { "when" } th { "change" } th { "who" } th { "why" } th.num { "fence" } th.num { "attempts" } th { "next attempt" } } }
            tbody {
                @for (h, step) in history.iter().zip(steps) {
                    tr {
                        td { (views::time(h.at)) }
                        td {
                            @if let Some(from) = &h.from_state { (views::state_badge(from)) " → " }
                            (views::state_badge(&h.to_state))
                            @if let Some(step) = step { " " span.step { (step) } }
                        }
                        td { (visible(&h.actor)) }
                        td.evidence { (visible(h.evidence.as_deref().unwrap_or(""))) }
                        td.num { (h.fence) }
                        td.num { (h.attempts.map(|a| a.to_string()).unwrap_or_default()) }
                        td { (views::time_or_dash(h.next_attempt_at)) }
                    }
                }
            }
        }
    }
}

fn action_forms(signed: &Signed, op: &Operation, prefill: &Prefill) -> Markup {
    let action = |name: &str| format!("/ui/operations/{}/{name}", op.id);
    let operator = visible(signed.session.operator.as_deref().unwrap_or(""));
    let accepted = op.state() == OpState::Accepted;
    let remote = op.remote_id.as_deref().map(visible);
    let remote = remote.as_deref();
    html! {
        h2 { "Act" }
        p { "Each action is recorded as " code { "operator:" (operator) } " and is refused if the operation moved on meanwhile." }
        div.actions {
            form.action method="post" action=(action("resolve")) {
                h3 { "Resolve" }
                p { "Paste the downstream's receipt for " code { (visible(&op.tenant)) ":" (visible(&op.action_id)) }
                    @if let Some(id) = remote { " (for operation " code { (id) } ", its final status document)" }
                    "; it must pass the tool's receipt check." }
                (views::csrf_field(&signed.csrf))
                input type="hidden" name="request_id" value=(request_id());
                label for="receipt" { "Receipt (JSON)" }
                textarea id="receipt" name="receipt" rows="6" required { (prefill.receipt) }
                label for="resolve-reason" { "Reason" }
                input id="resolve-reason" type="text" name="reason" required value=(prefill.reason);
                button type="submit" name="go" value="resolve" { "Resolve as succeeded" }
            }
            form.action method="post" action=(action("fail")) {
                h3 { "Fail" }
                @if accepted {
                    p { "Only with the downstream's proof that operation " code { (remote.unwrap_or_default()) } " failed or will never complete: polling stops and the agent is told failed. Refused while a poll is running." }
                } @else {
                    p { "Only with the downstream's proof that it did not and will not apply it." }
                }
                (views::csrf_field(&signed.csrf))
                input type="hidden" name="request_id" value=(request_id());
                label for="evidence" { "Evidence (at least " (actions::MIN_EVIDENCE_CHARS) " characters)" }
                textarea id="evidence" name="evidence" rows="4" required { (prefill.evidence) }
                button type="submit" name="go" value="fail" { "Mark failed" }
            }
            form.action method="post" action=(action("recheck")) {
                h3 { @if accepted { "Recheck (poll now)" } @else { "Recheck" } }
                @if accepted {
                    p { "Read the status of operation " code { (remote.unwrap_or_default()) } " now (read only, never the write); the next poll is then scheduled as usual. Refused while a poll is running." }
                } @else if let Some(id) = remote.filter(|_| op.state() == OpState::Held) {
                    p { "The downstream accepted it as operation " code { (id) } ": if the tool is still async, it is polled now with a fresh deadline (" code { "poll.deadline_secs" } "); otherwise one more recovery round (replay or lookup, as the tool allows)." }
                } @else {
                    p { "One more recovery round now (replay or lookup, as the tool allows)." }
                }
                (views::csrf_field(&signed.csrf))
                input type="hidden" name="request_id" value=(request_id());
                label for="recheck-reason" { "Reason" }
                input id="recheck-reason" type="text" name="reason" required;
                button type="submit" name="go" value="recheck" { @if accepted { "Poll now" } @else { "Recheck now" } }
            }
        }
    }
}

/// `POST /ui/operations/{id}/{action}`: resolve, fail or recheck.
pub async fn act(
    State(state): Shared,
    Extension(signed): Extension<Signed>,
    Path((id, action)): Path<(String, String)>,
    Form(form): Form<BTreeMap<String, String>>,
) -> Response {
    if let Some(refused) = refuse_form(&state, &signed, form.get("csrf").map(String::as_str)) {
        return refused;
    }
    let op = match visible_operation(&state, &signed, &id).await {
        Ok(op) => op,
        Err(r) => return r,
    };
    let mut prefill = Prefill::default();
    let operator = super::operator(&signed);
    let Some(result) = run_action(&state.ctx, &op, &action, &form, operator, &mut prefill).await
    else {
        return super::error_page(
            &signed,
            StatusCode::NOT_FOUND,
            "Not found",
            "There is no such action.",
        );
    };
    match result {
        Ok(r) => {
            let done = if r.repeated {
                "repeated"
            } else {
                action.as_str()
            };
            redirect(&format!("/ui/operations/{}?done={done}", op.id))
        }
        Err(e) => {
            let (status, text) = refusal(&e);
            // The row as it is now (a refusal may mean it moved).
            let op = match state.ctx.ledger.get(op.id).await {
                Ok(Some(now)) => now,
                _ => op,
            };
            detail_page(
                &state,
                &signed,
                op,
                Some(("error", format!("{action} refused: {text}"))),
                status,
                prefill,
            )
            .await
        }
    }
}

/// Runs the form's `action` on `op` as `operator` (None: no such action), keeping in `prefill`
/// what the form shows again after a refusal.
async fn run_action(
    ctx: &std::sync::Arc<crate::context::Context>,
    op: &Operation,
    action: &str,
    form: &BTreeMap<String, String>,
    operator: String,
    prefill: &mut Prefill,
) -> Option<Result<actions::ActionResponse, OpsError>> {
    let get = |k: &str| form.get(k).cloned();
    let operator = Some(operator);
    let request_id = get("request_id");
    let result = match action {
        "resolve" => {
            prefill.receipt = get("receipt").unwrap_or_default();
            prefill.reason = get("reason").unwrap_or_default();
            match crate::document::Document::parse(prefill.receipt.as_bytes()) {
                Err(e) => Err(OpsError::BadRequest(format!(
                    "the receipt is not valid JSON: {e}"
                ))),
                Ok(receipt) => {
                    let input = ResolveInput {
                        receipt: Some(receipt),
                        operator,
                        reason: get("reason"),
                        request_id,
                    };
                    actions::resolve(ctx, &op.tenant, &op.action_id, input).await
                }
            }
        }
        "fail" => {
            prefill.evidence = get("evidence").unwrap_or_default();
            let input = FailInput {
                evidence: get("evidence"),
                operator,
                request_id,
            };
            actions::fail(ctx, &op.tenant, &op.action_id, input).await
        }
        "recheck" => {
            let input = RecheckInput {
                operator,
                reason: get("reason"),
                request_id,
            };
            actions::recheck(ctx, &op.tenant, &op.action_id, input).await
        }
        _ => return None,
    };
    Some(result)
}

/// The status and the text of a refused action's page.
pub(super) fn refusal(e: &OpsError) -> (StatusCode, String) {
    match e {
        OpsError::ReceiptMismatch(_) | OpsError::ToolNotConfigured(_) => {
            (StatusCode::UNPROCESSABLE_ENTITY, e.to_string())
        }
        OpsError::Conflict { .. } => (StatusCode::CONFLICT, e.to_string()),
        OpsError::BadRequest(_) => (StatusCode::BAD_REQUEST, e.to_string()),
        OpsError::NotFound { .. } => (StatusCode::NOT_FOUND, e.to_string()),
        OpsError::Ledger(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("The ledger could not answer: {e}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{LedgerError, StateColumn};
    use chrono::Duration;

    fn accepted(evidence: &str) -> Operation {
        let now = Utc::now();
        Operation {
            id: 7,
            tenant: "north".into(),
            action_id: "deploy-1".into(),
            tool: "deploy".into(),
            fingerprint: "f".into(),
            arguments: Some("{}".into()),
            call_id: None,
            reply_to: None,
            state: StateColumn(OpState::Accepted),
            fence: 2,
            lease_owner: None,
            lease_until: None,
            attempts: 1,
            recovery_attempts: 0,
            next_attempt_at: Some(now + Duration::seconds(30)),
            first_dispatch_at: Some(now),
            replay_deadline: None,
            receipt: None,
            receipt_id: None,
            evidence: Some(evidence.into()),
            last_reported: Some("pending".into()),
            created_at: now - Duration::seconds(60),
            updated_at: now - Duration::seconds(5),
            state_since: now - Duration::seconds(50),
            swept_at: None,
            traceparent: None,
            tracestate: None,
            remote_id: Some("op-1".into()),
            acceptance: Some(crate::document::Document::from_value(
                serde_json::json!({"operation_id": "op-1"}),
            )),
            poll_deadline: Some(now + Duration::seconds(3600)),
            verified_by: Some("dispatch".into()),
            send_deadline: None,
            compensates: None,
        }
    }

    fn entry(
        from: Option<&str>,
        to: &str,
        fence: i64,
        actor: &str,
        evidence: &str,
    ) -> HistoryEntry {
        HistoryEntry {
            at: Utc::now(),
            from_state: from.map(str::to_string),
            to_state: to.into(),
            fence,
            actor: actor.into(),
            evidence: (!evidence.is_empty()).then(|| evidence.to_string()),
            attempts: Some(1),
            next_attempt_at: None,
        }
    }

    #[test]
    fn an_accepted_rows_last_poll_is_read_from_the_row() {
        let now = Utc::now();
        let running = "still running: {\"state\":\"running\"}";
        let op = accepted(running);
        let poll = last_poll(&op, now).unwrap();
        assert!(matches!(poll, LastPoll::Polled { .. }), "{poll:?}");
        assert!(
            poll.headline().starts_with("last poll "),
            "{}",
            poll.headline()
        );
        assert_eq!(poll.said(), running);
        assert_eq!(poll.next(), op.next_attempt_at);

        let fresh = accepted("accepted as operation op-1; polling its status");
        let poll = last_poll(&fresh, now).unwrap();
        assert!(
            poll.headline()
                .starts_with("not polled since the acceptance"),
            "{poll:?}"
        );

        let asked = accepted("recheck by alice: is it done?");
        let poll = last_poll(&asked, now).unwrap();
        assert!(poll.headline().starts_with("recheck asked"), "{poll:?}");

        let mut leased = accepted("status read answered HTTP 503: busy");
        leased.lease_owner = Some("w-1".into());
        leased.lease_until = Some(now + Duration::seconds(10));
        let poll = last_poll(&leased, now).unwrap();
        assert!(poll.headline().starts_with("polling now"), "{poll:?}");
        assert_eq!(poll.next(), None, "the lease is not the next poll");
        assert!(recheck_notice(&leased, now).contains("running now"));
        // A lapsed lease is no poll running.
        leased.lease_until = Some(now - Duration::seconds(1));
        assert!(matches!(
            last_poll(&leased, now),
            Some(LastPoll::Polled { .. })
        ));

        let mut held = accepted("async_deadline: operation op-1 was not done");
        held.state = StateColumn(OpState::Held);
        assert_eq!(last_poll(&held, now), None);
        assert!(recheck_notice(&held, now).contains("recovery round"));
    }

    #[test]
    fn polls_are_marked_in_the_timeline() {
        let now = Utc::now();
        let history = [
            entry(None, "dispatching", 1, "w-1", ""),
            entry(
                Some("dispatching"),
                "accepted",
                1,
                "w-1",
                "accepted as operation op-1; polling its status",
            ),
            entry(
                Some("accepted"),
                "accepted",
                1,
                "operator:alice",
                "recheck by alice: now?",
            ),
            // The recheck's poll: its lease (the words before), then its answer.
            entry(
                Some("accepted"),
                "accepted",
                2,
                "w-1",
                "recheck by alice: now?",
            ),
            entry(
                Some("accepted"),
                "accepted",
                2,
                "w-1",
                "status read answered HTTP 503: busy",
            ),
            // A poll whose answer changed nothing but the fence.
            entry(
                Some("accepted"),
                "accepted",
                3,
                "w-2",
                "status read answered HTTP 503: busy",
            ),
            entry(
                Some("accepted"),
                "accepted",
                4,
                "w-2",
                "status read answered HTTP 503: busy",
            ),
            entry(
                Some("accepted"),
                "held",
                4,
                "w-2",
                "async_deadline: operation op-1 was not done 60 s after it was accepted",
            ),
        ];
        let mut op = accepted("");
        op.state = StateColumn(OpState::Held);
        assert_eq!(
            poll_steps(&history, &op, now),
            [
                None,
                Some("accepted"),
                None,
                Some("poll began"),
                Some("poll"),
                Some("poll"),
                Some("poll began"),
                Some("poll"),
            ]
        );
        // A late receipt out of `accepted` is no poll; a poll's answer of done is.
        let out = [
            entry(
                Some("dispatching"),
                "accepted",
                1,
                "w-1",
                "accepted as operation op-1",
            ),
            entry(
                Some("accepted"),
                "succeeded",
                1,
                "w-1",
                "late receipt r-1 matches",
            ),
        ];
        assert_eq!(poll_steps(&out, &op, now), [Some("accepted"), None]);
        let done = [entry(
            Some("accepted"),
            "succeeded",
            2,
            "w-1",
            "operation op-1 done: receipt d-1 read from its status",
        )];
        assert_eq!(poll_steps(&done, &op, now), [Some("poll")]);
        // The current version of a row whose poll holds a live lease is that poll, running.
        let mut leased = accepted("status read answered HTTP 503: busy");
        leased.lease_owner = Some("w-1".into());
        leased.lease_until = Some(now + Duration::seconds(10));
        assert_eq!(
            poll_steps(&history[..6], &leased, now)[5],
            Some("poll running")
        );
    }

    #[test]
    fn an_accepted_row_lists_its_operation_id_and_last_poll_as_text() {
        let hostile = "<script>alert(1)</script>\u{1b}[31m";
        let mut op = accepted(&format!("still running: {hostile}"));
        op.remote_id = Some(format!("op-{hostile}"));
        let mut other = accepted("timed out");
        other.state = StateColumn(OpState::Unknown);
        other.remote_id = None;
        let markup = rows_table(&ConsoleFilter::default(), &[op, other]).into_string();
        assert!(markup.contains("<th>operation id</th>"), "{markup}");
        assert!(markup.contains("op-&lt;script&gt;"), "{markup}");
        assert!(markup.contains("last poll "), "{markup}");
        assert!(markup.contains("next poll "), "{markup}");
        assert!(
            !markup.contains("<script>") && !markup.contains('\u{1b}'),
            "{markup}"
        );
        assert!(markup.contains("\\x1b[31m"), "{markup}");
        // A page without any operation id has no such column.
        let plain = rows_table(&ConsoleFilter::default(), &[accepted_without_id()]).into_string();
        assert!(!plain.contains("operation id"), "{plain}");
    }

    fn accepted_without_id() -> Operation {
        let mut op = accepted("timed out");
        op.state = StateColumn(OpState::Unknown);
        op.remote_id = None;
        op
    }

    #[test]
    fn a_refused_action_answers_with_the_status_of_its_cause() {
        let cases = [
            (OpsError::BadRequest("no reason".into()), 400, "no reason"),
            (
                OpsError::NotFound {
                    tenant: "north".into(),
                    action_id: "a".into(),
                },
                404,
                "",
            ),
            (
                OpsError::Conflict {
                    message: "it is succeeded".into(),
                    state: None,
                },
                409,
                "it is succeeded",
            ),
            (OpsError::ReceiptMismatch("other id".into()), 422, ""),
            (OpsError::ToolNotConfigured("refund".into()), 422, ""),
            (
                OpsError::Ledger(LedgerError::Refused("down".into())),
                503,
                "The ledger could not answer: down",
            ),
        ];
        for (e, status, text) in cases {
            // No text given: the error's own message.
            let want = if text.is_empty() {
                e.to_string()
            } else {
                text.to_string()
            };
            assert_eq!(refusal(&e), (StatusCode::from_u16(status).unwrap(), want));
        }
    }
}
