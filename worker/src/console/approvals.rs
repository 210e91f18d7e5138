//! The approval pages: the queue of intents that wait for a person's approval
//! (`awaiting_approval`), the wait ending soonest first, and one waiting intent with the exact
//! arguments that run once it is approved, their fingerprint, the approvals so far, and for an
//! approver the form that approves or rejects it through [`crate::ops::approvals::decide`] —
//! the same conditional, idempotent statement as the API and `worker ops approve`, recorded
//! under the approver token's name.
//!
//! Who sees what: an approver sees every tenant's waiting intents and decides; the admin sees
//! them read-only (an approval takes an approver token: the decision is recorded under a
//! person's name, and the admin may not approve for someone); a tenant sees its own read-only
//! (another tenant's intent answers 404, like a missing one). The form carries the fingerprint
//! of the arguments it showed, so an approval never covers arguments the approver did not
//! see, the session's CSRF token, and a fresh request id (the same form posted twice decides
//! once). Every refusal (the fingerprint is not the row's, you already approved, the wait
//! ended, it is not waiting any more) is shown on the page with its reason.

use std::collections::BTreeMap;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::{Extension, Form};
use chrono::{DateTime, Utc};
use maud::{html, Markup};

use super::filter::encode;
use super::views::{self, age, age_of, visible, Nav};
use super::{html, redirect, request_id, Shared, Signed};
use crate::ledger::approval::ApprovalStatus;
use crate::ledger::{Operation, State as OpState};
use crate::ops::approvals::{
    self, AwaitingView, Decision, DecisionInput, Fingerprint, MAX_AWAITING_LIMIT,
};

/// The page of one waiting intent.
pub fn intent_url(tenant: &str, action_id: &str) -> String {
    format!("/ui/approvals/{}/{}", encode(tenant), encode(action_id))
}

/// `GET /ui/approvals`: the queue (every tenant's, or a tenant's own).
pub async fn list(State(state): Shared, Extension(signed): Extension<Signed>) -> Response {
    let tenant = signed.session.approvals_of();
    let waiting = match approvals::awaiting(&state.ctx, tenant, Some(MAX_AWAITING_LIMIT)).await {
        Ok(w) => w,
        Err(e) => {
            let (status, text) = super::operations::refusal(&e);
            return super::error_page(&signed, status, "Approvals unavailable", &text);
        }
    };
    let now = Utc::now();
    let body = html! {
        h1 { "Approvals" }
        (role_line(&signed))
        @if waiting.is_empty() {
            p.empty { "Nothing waits for approval." }
        } @else {
            p { (count_text(waiting.len())) " waiting, the wait ending soonest first. Open one to see the exact arguments that would run." }
            (queue_table(&waiting, now))
        }
    };
    html(
        StatusCode::OK,
        views::page("Approvals", &signed.frame(Nav::Approvals), body),
    )
}

/// What the signed-in person may do here, in a sentence.
fn role_line(signed: &Signed) -> Markup {
    html! {
        @if let Some(name) = signed.session.approver() {
            p { "You approve or reject as " strong { (visible(name)) } "; each decision is recorded as " code { "operator:" (visible(name)) } "." }
        } @else if let Some(t) = signed.session.tenant() {
            p { "Tenant " strong { (visible(t)) } " only, read-only: an approver decides." }
        } @else {
            p { "Every tenant's, read-only: approving or rejecting takes an approver's token (" code { "WORKER_APPROVER_TOKENS" } "), in this console or through the API, so that each decision names the person who took it." }
        }
    }
}

/// `N`, or `N+` when the page is full.
fn count_text(n: usize) -> String {
    if n as i64 >= MAX_AWAITING_LIMIT {
        format!("{n}+")
    } else {
        n.to_string()
    }
}

/// When a wait ends, relative to `now`.
fn ends(expires: Option<DateTime<Utc>>, now: DateTime<Utc>) -> String {
    match expires {
        Some(t) if t > now => format!(
            "{} (in {})",
            views::time(t),
            age((t - now).num_milliseconds() as f64 / 1000.0)
        ),
        Some(t) => format!("{} (ended)", views::time(t)),
        None => "—".into(),
    }
}

fn approvers(by: &[String]) -> String {
    if by.is_empty() {
        "—".into()
    } else {
        by.iter().map(|a| visible(a)).collect::<Vec<_>>().join(", ")
    }
}

fn queue_table(waiting: &[AwaitingView], now: DateTime<Utc>) -> Markup {
    html! {
        table.approvals {
            thead { tr {
                th { "tenant" } th { "action id" } th { "tool" } th { "asked by (call id)" }
                th { "recorded" } th { "wait ends" } th.num { "approvals" } th { "approved by" }
            } }
            tbody {
                @for w in waiting {
                    tr {
                        td { (visible(&w.tenant)) }
                        td { a href=(intent_url(&w.tenant, &w.action_id)) { (visible(&w.action_id)) } }
                        td { (visible(&w.tool)) }
                        td { (w.call_id.as_deref().map(visible).unwrap_or_else(|| "—".into())) }
                        td { (views::time(w.created_at)) " (" (age_of(w.created_at)) " ago)" }
                        td { (ends(w.expires_at, now)) }
                        td.num { (w.approved_by.len()) " / " (w.approvals_needed) }
                        td { (approvers(&w.approved_by)) }
                    }
                }
            }
        }
    }
}

/// The approval queue at the top of the overview: how many wait, the oldest wait, the wait
/// that ends first (nothing when none waits, unless `always`).
pub fn overview_cards(waiting: &[AwaitingView], always: bool) -> Markup {
    let now = Utc::now();
    let oldest = waiting.iter().map(|w| w.created_at).min();
    let first_end = waiting.iter().filter_map(|w| w.expires_at).min();
    html! {
        @if always || !waiting.is_empty() {
            h2 { "Waiting for approval" }
            section.cards.approvals {
                a.card class=[(!waiting.is_empty()).then_some("alert")] href="/ui/approvals" {
                    span.figure { (count_text(waiting.len())) } span.label { "waiting for approval" }
                }
                div.card { span.figure { (oldest.map_or("—".to_string(), age_of)) } span.label { "oldest wait" } }
                div.card {
                    span.figure { (first_end.map_or("—".to_string(), |t| age((t - now).num_milliseconds() as f64 / 1000.0))) }
                    span.label { "until the first wait ends" }
                }
            }
            p { a href="/ui/approvals" { "The approval queue →" } }
        }
    }
}

/// What the decision form shows again after a refusal.
#[derive(Default)]
struct Prefill {
    reason: String,
}

/// `GET /ui/approvals/{tenant}/{action_id}`.
pub async fn detail(
    State(state): Shared,
    Extension(signed): Extension<Signed>,
    Path((tenant, action_id)): Path<(String, String)>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    let done = query.get("done").and_then(|d| match d.as_str() {
        "approve" => Some("Approved: your approval is recorded."),
        "reject" => Some("Rejected: the intent fails without being sent; its agent is told."),
        "repeated" => Some("That form was already submitted; nothing changed."),
        _ => None,
    });
    let notice = done.map(|d| ("ok", d.to_string()));
    page(
        &state,
        &signed,
        &tenant,
        &action_id,
        notice,
        StatusCode::OK,
        Prefill::default(),
    )
    .await
}

/// The intent `tenant`/`action_id` if the session may see it and it waited (or waits) for
/// approval: anything else is "not found", so the page shows no other operation.
async fn visible_intent(
    state: &super::ConsoleState,
    signed: &Signed,
    tenant: &str,
    action_id: &str,
) -> Result<(Operation, ApprovalStatus), Response> {
    let not_found = || {
        super::error_page(
            signed,
            StatusCode::NOT_FOUND,
            "Not found",
            "No such intent waits, or waited, for approval.",
        )
    };
    // Postgres text cannot hold NUL: no such row (and asking would fail).
    if tenant.contains('\0') || action_id.contains('\0') {
        return Err(not_found());
    }
    if signed.session.approvals_of().is_some_and(|t| t != tenant) {
        return Err(not_found());
    }
    let ledger = &state.ctx.ledger;
    let op = match ledger.find(tenant, action_id).await {
        Ok(Some(op)) => op,
        Ok(None) => return Err(not_found()),
        Err(e) => return Err(super::ledger_unavailable(signed, &e)),
    };
    match ledger.approval_status(op.id).await {
        Ok(Some(status)) => Ok((op, status)),
        Ok(None) => Err(not_found()),
        Err(e) => Err(super::ledger_unavailable(signed, &e)),
    }
}

async fn page(
    state: &super::ConsoleState,
    signed: &Signed,
    tenant: &str,
    action_id: &str,
    notice: Option<(&str, String)>,
    status: StatusCode,
    prefill: Prefill,
) -> Response {
    let (op, approval) = match visible_intent(state, signed, tenant, action_id).await {
        Ok(found) => found,
        Err(r) => return r,
    };
    let now = Utc::now();
    let waiting = op.state() == OpState::AwaitingApproval;
    let me = signed.session.approver();
    let mine = me.is_some_and(|m| approval.approved_by.iter().any(|a| a == m));
    let fact = |name: &str, value: String| html! { tr { th { (name) } td { (value) } } };
    let body = html! {
        p.crumbs { a href="/ui/approvals" { "Approvals" } " / " (visible(&op.tenant)) "/" (visible(&op.action_id)) }
        h1 { (visible(&op.tenant)) "/" (visible(&op.action_id)) " " (views::state_badge(op.state().as_str())) }
        @if let Some((kind, text)) = &notice { (views::notice(kind, text)) }
        p.approval-status data-state=(op.state().as_str()) { (status_line(&op, &approval, now)) }
        div.columns {
            section {
                h2 { "Intent" }
                table.facts {
                    (fact("tenant", visible(&op.tenant)))
                    (fact("action id", visible(&op.action_id)))
                    (fact("tool", visible(&op.tool)))
                    (fact("asked by (call id)", op.call_id.as_deref().map(visible).unwrap_or_else(|| "—".into())))
                    (fact("recorded", format!("{} ({} ago)", views::time(op.created_at), age_of(op.created_at))))
                    @if waiting { (fact("wait ends", ends(op.next_attempt_at, now))) }
                    (fact("approvals", format!("{} / {}", approval.approved_by.len(), approval.needed)))
                    (fact("approved by", approvers(&approval.approved_by)))
                    tr { th { "fingerprint" } td { code #fingerprint { (visible(&op.fingerprint)) } } }
                }
                @if signed.session.approver().is_none() {
                    p { a href=(format!("/ui/operations/{}", op.id)) { "The operation's page (timeline, evidence)" } }
                }
            }
            section {
                h2 { "Arguments (exactly as they would be sent)" }
                @match &op.arguments {
                    Some(args) => { pre.json #arguments { (views::json_exact(args)) } }
                    None => { p { "The arguments were removed by retention." } }
                }
            }
        }
        @if waiting {
            @match me {
                Some(_) if mine => {
                    (views::notice("info", &format!(
                        "You approved this intent; it needs {} approvals from different people ({} so far).",
                        approval.needed, approval.approved_by.len()
                    )))
                }
                Some(name) => { (decision_form(signed, &op, name, &prefill)) }
                None => {
                    p.read-only { "Read-only: an approver signed in with their own token approves or rejects it." }
                }
            }
        }
    };
    html(
        status,
        views::page(
            &format!(
                "Approval {}/{}",
                visible(&op.tenant),
                visible(&op.action_id)
            ),
            &signed.frame(Nav::Approvals),
            body,
        ),
    )
}

/// Where the intent stands, in a sentence.
fn status_line(op: &Operation, approval: &ApprovalStatus, now: DateTime<Utc>) -> String {
    let approved = approval.approved_by.len() >= approval.needed.max(1) as usize;
    match op.state() {
        OpState::AwaitingApproval => {
            let more = (approval.needed as usize).saturating_sub(approval.approved_by.len());
            format!(
                "Waiting for approval: {more} more needed (of {}); the wait ends {}. Until then it is not sent.",
                approval.needed,
                ends(op.next_attempt_at, now)
            )
        }
        OpState::Failed if !approved => {
            "Not approved: rejected, or its wait ended. It failed without being sent.".into()
        }
        OpState::Succeeded => "Approved, sent and succeeded.".into(),
        OpState::Failed => "Approved and sent; it failed.".into(),
        other => format!("Approved: it is sent now ({other})."),
    }
}

fn decision_form(signed: &Signed, op: &Operation, name: &str, prefill: &Prefill) -> Markup {
    html! {
        h2 { "Decide" }
        form.decision method="post" action=(intent_url(&op.tenant, &op.action_id)) {
            p { "You decide on the arguments shown above, fingerprint " code { (visible(&op.fingerprint)) } ": if they changed, the decision is refused. Recorded as " code { "operator:" (visible(name)) } "." }
            (views::csrf_field(&signed.csrf))
            input type="hidden" name="request_id" value=(request_id());
            input type="hidden" name="fingerprint" value=(op.fingerprint);
            label for="reason" { "Reason" }
            textarea id="reason" name="reason" rows="3" required { (prefill.reason) }
            button.approve type="submit" name="decision" value="approve" { "Approve" }
            " "
            button.reject type="submit" name="decision" value="reject" { "Reject" }
        }
    }
}

/// `POST /ui/approvals/{tenant}/{action_id}`: an approver's decision (CSRF-checked; any other
/// session is refused 403).
pub async fn decide(
    State(state): Shared,
    Extension(signed): Extension<Signed>,
    Path((tenant, action_id)): Path<(String, String)>,
    Form(form): Form<BTreeMap<String, String>>,
) -> Response {
    if !state
        .keys
        .check_csrf(&signed.session, form.get("csrf").map(String::as_str))
    {
        return super::error_page(
            &signed,
            StatusCode::FORBIDDEN,
            "Refused",
            "The form's CSRF token is missing or wrong; nothing was changed. Reload the page and try again.",
        );
    }
    let Some(name) = signed.session.approver() else {
        return super::error_page(
            &signed,
            StatusCode::FORBIDDEN,
            "Read-only",
            "Only an approver, signed in with their own approver token, approves or rejects; nothing was changed.",
        );
    };
    let decision = match form.get("decision").map(String::as_str) {
        Some("approve") => Decision::Approve,
        Some("reject") => Decision::Reject,
        _ => {
            return super::error_page(
                &signed,
                StatusCode::BAD_REQUEST,
                "Bad request",
                "The decision must be approve or reject; nothing was changed.",
            )
        }
    };
    // Another tenant's session never reaches here (approvers see every tenant's); the page's
    // own check still answers 404 for what the session may not see.
    if let Err(r) = visible_intent(&state, &signed, &tenant, &action_id).await {
        return r;
    }
    let input = DecisionInput {
        fingerprint: form.get("fingerprint").cloned(),
        operator: Some(name.to_string()),
        reason: form.get("reason").cloned(),
        request_id: form.get("request_id").cloned(),
    };
    let word = match decision {
        Decision::Approve => "approve",
        Decision::Reject => "reject",
    };
    match approvals::decide(
        &state.ctx,
        &tenant,
        &action_id,
        decision,
        input,
        Fingerprint::Required,
    )
    .await
    {
        Ok(r) => {
            let done = if r.repeated { "repeated" } else { word };
            redirect(&format!("{}?done={done}", intent_url(&tenant, &action_id)))
        }
        Err(e) => {
            let (status, text) = super::operations::refusal(&e);
            let prefill = Prefill {
                reason: form.get("reason").cloned().unwrap_or_default(),
            };
            page(
                &state,
                &signed,
                &tenant,
                &action_id,
                Some(("error", format!("{word} refused: {text}"))),
                status,
                prefill,
            )
            .await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(tenant: &str, action_id: &str, args: serde_json::Value) -> AwaitingView {
        AwaitingView {
            tenant: tenant.into(),
            action_id: action_id.into(),
            tool: "refund".into(),
            fingerprint: "f".repeat(64),
            arguments: Some(args),
            approvals_needed: 2,
            approved_by: vec!["bob".into()],
            call_id: Some("<call>".into()),
            created_at: Utc::now() - chrono::Duration::seconds(90),
            expires_at: Some(Utc::now() + chrono::Duration::seconds(3_600)),
        }
    }

    #[test]
    fn an_intent_url_keeps_each_key_in_its_own_segment() {
        assert_eq!(intent_url("north", "a-1"), "/ui/approvals/north/a-1");
        assert_eq!(
            intent_url("n/s", "<a b>?x#"),
            "/ui/approvals/n%2Fs/%3Ca%20b%3E%3Fx%23"
        );
        // The route guard lets an approver reach every such page.
        let get = axum::http::Method::GET;
        assert!(super::super::approver_may(
            &get,
            &intent_url("n/s", "../operations")
        ));
    }

    #[test]
    fn the_queue_shows_hostile_keys_as_text() {
        let hostile = "<script>alert(1)</script>\u{202e}\"'";
        let markup =
            queue_table(&[view(hostile, hostile, serde_json::json!({}))], Utc::now()).into_string();
        assert!(!markup.contains("<script>"), "{markup}");
        assert!(!markup.contains('\u{202e}'), "{markup}");
        assert!(markup.contains("&lt;script&gt;"), "{markup}");
        assert!(markup.contains("\\u{202e}"), "{markup}");
        assert!(markup.contains("1 / 2"), "{markup}");
        assert!(markup.contains("&lt;call&gt;"), "{markup}");
        let cards = overview_cards(&[view("n", "a", serde_json::json!({}))], false).into_string();
        assert!(cards.contains("waiting for approval") && cards.contains("/ui/approvals"));
        assert_eq!(overview_cards(&[], false).into_string(), "");
    }
}
