//! The dead-letter page: the messages of the dead-letter queue with their reason headers,
//! original publisher and body (read without losing any: [`crate::amqp::dead_letters`]), and
//! for the admin the forms that republish one or every letter shown to the intents exchange
//! after a fix, or discard them ([`crate::ops::dead_letters`]: each step audited, idempotent by
//! its request id). A tenant sees only the letters proven to be its own, and no form.

use std::collections::BTreeMap;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::{Extension, Form};
use maud::{html, Markup};

use super::filter::query_string;
use super::views::{self, excerpt, visible, Nav};
use super::{html, refuse_form, request_id, Shared, Signed};
use crate::amqp::dead_letters::DeadLetter;
use crate::ops::dead_letters::{
    self as dl, Action, DeadLetterFilter, StepOutcome, StepRequest, DEFAULT_LIMIT,
};

/// The filter and page size of a query string or form.
fn read_filter(q: &BTreeMap<String, String>) -> Result<(DeadLetterFilter, usize), String> {
    let field = |k: &str| {
        q.get(k)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    for k in ["reason", "tenant", "message_id", "id"] {
        if field(k).is_some_and(|v| v.chars().count() > 300 || v.chars().any(char::is_control)) {
            return Err(format!(
                "{k} must be at most 300 characters without control characters"
            ));
        }
    }
    let limit = match field("limit") {
        None => DEFAULT_LIMIT,
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|l| (1..=dl::MAX_LIMIT).contains(l))
            .ok_or_else(|| format!("limit must be between 1 and {}", dl::MAX_LIMIT))?,
    };
    Ok((
        DeadLetterFilter {
            reason: field("reason"),
            tenant: field("tenant"),
            message_id: field("message_id"),
            ids: field("id").into_iter().collect(),
        },
        limit,
    ))
}

fn filter_pairs(f: &DeadLetterFilter) -> Vec<(&'static str, String)> {
    let mut pairs = Vec::new();
    for (k, v) in [
        ("reason", &f.reason),
        ("tenant", &f.tenant),
        ("message_id", &f.message_id),
    ] {
        if let Some(v) = v {
            pairs.push((k, v.clone()));
        }
    }
    pairs
}

/// The body as text: pretty JSON when it is JSON, else the bytes read as UTF-8.
fn body_text(body: &[u8]) -> String {
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(v) => views::json(&v),
        Err(_) => String::from_utf8_lossy(body).into_owned(),
    }
}

/// `GET /ui/dead-letters`.
pub async fn list(
    State(state): Shared,
    Extension(signed): Extension<Signed>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    let Ok(tenant) = super::reads(&signed) else {
        return super::approvers_elsewhere(&signed);
    };
    let (filter, limit) = match read_filter(&query) {
        Ok(f) => f,
        Err(e) => return super::error_page(&signed, StatusCode::BAD_REQUEST, "Bad filter", &e),
    };
    let viewer = &signed.session.principal;
    // Before the listing: its messages are unacked (not counted) until it returns them.
    let depth = if signed.session.is_admin() {
        state.broker.depth().await.ok()
    } else {
        None
    };
    let listing = dl::list(&state.broker, viewer, &state.auth, &filter, limit).await;
    let audit = state
        .ctx
        .ledger
        .recent_dead_letter_actions(tenant, 20)
        .await
        .unwrap_or_default();
    let listing = match listing {
        Ok(l) => l,
        Err(e) => {
            return super::error_page(
                &signed,
                StatusCode::SERVICE_UNAVAILABLE,
                "Dead letters unavailable",
                &format!("The dead-letter queue could not be read: {e}"),
            )
        }
    };
    let text = |v: &Option<String>| v.as_deref().map(visible).unwrap_or_default();
    let admin = signed.session.is_admin();
    let body = html! {
        h1 { "Dead letters" }
        p {
            "Queue " code { (visible(&state.broker.topology().dead_letter_queue)) }
            @if let Some(d) = depth { ": " strong #depth { (d) } " messages" }
            ". Reading returns every message to the queue; only republish and discard remove one."
        }
        form.filter method="get" action="/ui/dead-letters" {
            label { "reason " input type="text" name="reason" value=(text(&filter.reason)) placeholder="unknown_tool"; }
            @if admin { label { "tenant " input type="text" name="tenant" value=(text(&filter.tenant)); } }
            label { "message id " input type="text" name="message_id" value=(text(&filter.message_id)); }
            label { "show " input type="number" name="limit" min="1" max=(dl::MAX_LIMIT) value=(limit); }
            button type="submit" { "Filter" }
            a href="/ui/dead-letters" { "reset" }
        }
        // How much of the queue was read counts other tenants' letters: the admin's only.
        @if admin {
            p { (listing.letters.len()) " shown, " (listing.scanned) " read"
                @if listing.remaining > 0 { ", " (listing.remaining) " more behind them" } "." }
        } @else {
            @match listing.as_of {
                Some(at) if at == dl::Listing::NEVER => p.notice {
                    "Your tenant's dead letters show here once an operator has read the queue on this worker: reading it is the operator's, so that nobody else's letters are touched."
                },
                Some(at) => p {
                    (listing.letters.len()) " of your tenant's dead letters, as of "
                    (views::time(at)) ", when an operator last read the queue."
                },
                None => p { (listing.letters.len()) " of your tenant's dead letters." },
            }
        }
        @if admin && !listing.letters.is_empty() {
            (bulk_forms(&signed, &filter, listing.letters.len()))
        }
        @for letter in &listing.letters {
            (letter_view(&signed, letter))
        }
        h2 { "Recent dead-letter actions" }
        @if audit.is_empty() { p.empty { "None yet." } } @else {
            table.audit {
                thead { tr { th { "when" } th { "action" } th { "status" } th { "letter" } th { "message id" } th { "reason" } th { "by" } th { "why" } } }
                tbody {
                    @for a in &audit {
                        tr {
                            td { (views::time(a.created_at)) }
                            td { (visible(&a.action)) }
                            td { (visible(&a.status)) }
                            td { code { (visible(&a.dead_letter_id)) } }
                            td { (text(&a.message_id)) }
                            td { (text(&a.reason)) }
                            td { (visible(&a.operator)) }
                            td { (visible(&a.note)) }
                        }
                    }
                }
            }
        }
    };
    html(
        StatusCode::OK,
        views::page("Dead letters", &signed.frame(Nav::DeadLetters), body),
    )
}

fn letter_view(signed: &Signed, letter: &DeadLetter) -> Markup {
    let text = |v: &Option<String>| v.as_deref().map(visible).unwrap_or_else(|| "—".into());
    html! {
        details.letter id=(format!("letter-{}", letter.id)) {
            summary {
                code { (letter.id) } " "
                span.reason { (text(&letter.reason)) } " "
                (text(&letter.tenant)) "/" (text(&letter.action_id))
            }
            table.facts {
                tr { th { "reason" } td { (text(&letter.reason)) } }
                tr { th { "detail" } td { (text(&letter.detail)) } }
                tr { th { "original user" } td { (text(&letter.original_user)) } }
                tr { th { "message id" } td { (text(&letter.message_id)) } }
                tr { th { "routing key" } td { (visible(&letter.routing_key)) } }
                tr { th { "position" } td { (letter.position) } }
            }
            h3 { "Headers" }
            table.headers {
                @for (k, v) in &letter.headers {
                    tr { th { (visible(k)) } td { (excerpt(v, 500)) } }
                }
            }
            h3 { "Body" }
            pre.body { (visible(&body_text(&letter.body))) }
            @if signed.session.is_admin() {
                @for (action, label) in [("republish", "Republish to the intents exchange"), ("discard", "Discard")] {
                    form.inline method="post" action="/ui/dead-letters" {
                        (views::csrf_field(&signed.csrf))
                        input type="hidden" name="request_id" value=(request_id());
                        input type="hidden" name="action" value=(action);
                        input type="hidden" name="id" value=(letter.id);
                        input type="text" name="note" required placeholder="why (e.g. the tool is configured now)";
                        button type="submit" class=(format!("{action}-one")) { (label) }
                    }
                }
            }
        }
    }
}

fn bulk_forms(signed: &Signed, filter: &DeadLetterFilter, shown: usize) -> Markup {
    html! {
        div.bulk-letters {
            @for (action, label) in [("republish", "Republish"), ("discard", "Discard")] {
                form.inline method="post" action="/ui/dead-letters" {
                    (views::csrf_field(&signed.csrf))
                    input type="hidden" name="request_id" value=(request_id());
                    input type="hidden" name="action" value=(action);
                    input type="hidden" name="limit" value=(shown);
                    @for (k, v) in filter_pairs(filter) { input type="hidden" name=(k) value=(v); }
                    input type="text" name="note" required placeholder="why";
                    button type="submit" class=(format!("{action}-all")) { (label) " all " (shown) " matching" }
                }
            }
        }
    }
}

/// `POST /ui/dead-letters`: republish or discard one letter (`id`) or every letter the filter
/// matches (up to `limit`).
pub async fn act(
    State(state): Shared,
    Extension(signed): Extension<Signed>,
    Form(form): Form<BTreeMap<String, String>>,
) -> Response {
    if let Some(refused) = refuse_form(&state, &signed, form.get("csrf").map(String::as_str)) {
        return refused;
    }
    let (filter, limit) = match read_filter(&form) {
        Ok(f) => f,
        Err(e) => return super::error_page(&signed, StatusCode::BAD_REQUEST, "Bad request", &e),
    };
    let Some(action) = form.get("action").and_then(|a| Action::parse(a)) else {
        return super::error_page(
            &signed,
            StatusCode::BAD_REQUEST,
            "Bad request",
            "The action must be republish or discard.",
        );
    };
    let request = StepRequest {
        action,
        filter: filter.clone(),
        limit,
        operator: super::operator(&signed),
        note: form
            .get("note")
            .map(|n| n.trim().to_string())
            .unwrap_or_default(),
        request_id: form.get("request_id").cloned().unwrap_or_default(),
        dry_run: false,
    };
    let reports = match dl::act(&state.broker, &state.ctx.ledger, &request).await {
        Ok(r) => r,
        Err(e @ dl::DeadLetterError::BadRequest(_)) => {
            return super::error_page(&signed, StatusCode::BAD_REQUEST, "Refused", &e.to_string())
        }
        Err(e) => {
            return super::error_page(
                &signed,
                StatusCode::SERVICE_UNAVAILABLE,
                "Not done",
                &format!("{e} (repeat the request to finish it: it is idempotent)"),
            )
        }
    };
    let back = format!("/ui/dead-letters?{}", query_string(&filter_pairs(&filter)));
    let body = html! {
        h1 { "Dead letters: " (action.as_str()) }
        table.steps {
            thead { tr { th { "letter" } th { "message id" } th { "tenant" } th { "reason" } th { "outcome" } } }
            tbody {
                @for r in &reports {
                    tr {
                        td { code { (visible(&r.dead_letter_id)) } }
                        td { (r.message_id.as_deref().map(visible).unwrap_or_default()) }
                        td { (r.tenant.as_deref().map(visible).unwrap_or_default()) }
                        td { (r.reason.as_deref().map(visible).unwrap_or_default()) }
                        td.outcome { (match &r.outcome {
                            StepOutcome::Done => format!("{}ed", action.as_str().trim_end_matches('e')),
                            StepOutcome::WouldAct => "would act".into(),
                            StepOutcome::AlreadyDone(s) => format!("already done earlier ({s}); nothing done again"),
                            StepOutcome::NotFound => "not in the queue (already handled?)".into(),
                            StepOutcome::Failed(e) => format!("failed, the letter stays: {}", visible(e)),
                        }) }
                    }
                }
            }
        }
        @if reports.is_empty() { p.empty { "No dead letter matched." } }
        p { a href=(back) { "Back to the dead letters" } }
    };
    html(
        StatusCode::OK,
        views::page("Dead letters", &signed.frame(Nav::DeadLetters), body),
    )
}
