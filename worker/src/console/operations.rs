//! The operations pages: the filtered list (unresolved by default, finished on request), the
//! same set grouped by cause, and one operation with its timeline and the actions resolve,
//! fail and recheck — each through [`crate::ops::actions`], the same guarded, audited,
//! idempotent functions as the API and `worker ops`, with the signed-in operator's name.

use std::collections::BTreeMap;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::{Extension, Form};
use maud::{html, Markup};

use super::filter::{ConsoleFilter, Scope};
use super::views::{self, age_of, excerpt, json, visible, Nav};
use super::{html, redirect, refuse_form, request_id, Shared, Signed};
use crate::ledger::cause;
use crate::ledger::queries::{HistoryEntry, Page};
use crate::ledger::Operation;
use crate::ops::actions::{self, FailInput, OpsError, RecheckInput, ResolveInput};

/// `GET /ui/operations`.
pub async fn list(
    State(state): Shared,
    Extension(signed): Extension<Signed>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
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
    let tenant = signed.session.tenant();
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
    html! {
        @if ops.is_empty() {
            p.empty { "No operation matches." }
        } @else {
            table.operations {
                thead { tr {
                    th.num { "id" } th { "tenant" } th { "action id" } th { "tool" } th { "state" }
                    th { "cause" } th { "age" } th { "updated" } th.num { "attempts" } th { "evidence" }
                } }
                tbody {
                    @for op in ops {
                        @let class = cause::classify(op.state().as_str(), op.evidence.as_deref());
                        tr {
                            td.num { (op.id) }
                            td { (visible(&op.tenant)) }
                            td { a href=(format!("/ui/operations/{}", op.id)) { (visible(&op.action_id)) } }
                            td { (visible(&op.tool)) }
                            td { (views::state_badge(op.state().as_str())) }
                            td { a href=(format!("/ui/operations?{}", filter.with("cause", &class).query(&[]))) title=(cause::meaning(&class)) { (class) } }
                            td { (age_of(op.created_at)) }
                            td { (views::time(op.updated_at)) }
                            td.num { (op.attempts) }
                            td.evidence { (excerpt(op.evidence.as_deref().unwrap_or(""), 120)) }
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
    let id: i64 = id.parse().map_err(|_| not_found())?;
    match state.ctx.ledger.get(id).await {
        Ok(Some(op)) if signed.session.tenant().is_none_or(|t| t == op.tenant) => Ok(op),
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
        "recheck" => Some("Rechecked: one recovery round ran; the state below is what it found."),
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
                    (fact("receipt id", op.receipt_id.as_deref().map(visible).unwrap_or_else(|| "—".into())))
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
                    Some(r) => { pre.json { (visible(&json(r))) } }
                    None => { p { "No receipt." } }
                }
            }
        }
        h2 { "Timeline" }
        (timeline(&history))
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

fn timeline(history: &[HistoryEntry]) -> Markup {
    html! {
        table.timeline {
            thead { tr { th { "when" } th { "change" } th { "who" } th { "why" } th.num { "fence" } th.num { "attempts" } th { "next attempt" } } }
            tbody {
                @for h in history {
                    tr {
                        td { (views::time(h.at)) }
                        td {
                            @if let Some(from) = &h.from_state { (views::state_badge(from)) " → " }
                            (views::state_badge(&h.to_state))
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
    html! {
        h2 { "Act" }
        p { "Each action is recorded as " code { "operator:" (operator) } " and is refused if the operation moved on meanwhile." }
        div.actions {
            form.action method="post" action=(action("resolve")) {
                h3 { "Resolve" }
                p { "Paste the downstream's receipt for " code { (visible(&op.tenant)) ":" (visible(&op.action_id)) } "; it must pass the tool's receipt check." }
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
                p { "Only with the downstream's proof that it did not and will not apply it." }
                (views::csrf_field(&signed.csrf))
                input type="hidden" name="request_id" value=(request_id());
                label for="evidence" { "Evidence (at least " (actions::MIN_EVIDENCE_CHARS) " characters)" }
                textarea id="evidence" name="evidence" rows="4" required { (prefill.evidence) }
                button type="submit" name="go" value="fail" { "Mark failed" }
            }
            form.action method="post" action=(action("recheck")) {
                h3 { "Recheck" }
                p { "One more recovery round now (replay or lookup, as the tool allows)." }
                (views::csrf_field(&signed.csrf))
                input type="hidden" name="request_id" value=(request_id());
                label for="recheck-reason" { "Reason" }
                input id="recheck-reason" type="text" name="reason" required;
                button type="submit" name="go" value="recheck" { "Recheck now" }
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
            match serde_json::from_str::<serde_json::Value>(&prefill.receipt) {
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
fn refusal(e: &OpsError) -> (StatusCode, String) {
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
    use crate::ledger::LedgerError;

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
