//! Bulk pages (admin only): the dry run of a recheck or fail of every unresolved operation a
//! filter matches (how many, in which states, which the action accepts; a recheck of an
//! `accepted` operation polls its status now), the job it starts
//! ([`crate::ops::bulk`]), the list of jobs and one job's progress (done / skipped /
//! refused), read from the ledger so it survives a reload and any worker can show it. A
//! running job's page refreshes itself every second.

use std::collections::BTreeMap;

use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, Uri};
use axum::response::Response;
use axum::{Extension, Form};
use maud::{html, Markup};

use super::filter::{ConsoleFilter, Scope};
use super::views::{self, visible, Nav};
use super::{html, redirect, refuse_form, request_id, Shared, Signed};
use crate::ledger::jobs::Job;
use crate::ops::actions::OpsError;
use crate::ops::bulk::{BulkAction, BulkRequest, DEFAULT_CAP, MAX_CAP};

/// The refusal page for a tenant or an approver session (bulk pages are the admin's).
fn refuse_tenant(signed: &Signed) -> Option<Response> {
    if signed.session.approver().is_some() {
        return Some(super::approvers_elsewhere(signed));
    }
    (!signed.session.is_admin()).then(|| {
        super::error_page(
            signed,
            StatusCode::FORBIDDEN,
            "Read-only",
            "Bulk actions are for the admin; a tenant session is read-only.",
        )
    })
}

/// The filter of a bulk request: the operations filter, unresolved states only.
fn bulk_filter(query: &BTreeMap<String, String>) -> Result<(ConsoleFilter, bool), String> {
    let mut filter = ConsoleFilter::parse(query)?;
    let narrowed = filter.scope != Scope::Unresolved;
    filter.scope = Scope::Unresolved;
    filter.groups = false;
    filter.after = None;
    Ok((filter, narrowed))
}

/// `GET /ui/bulk?<filter>`: the dry run and the form that starts the job.
pub async fn dry_run(
    State(state): Shared,
    Extension(signed): Extension<Signed>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    if let Some(r) = refuse_tenant(&signed) {
        return r;
    }
    let (filter, narrowed) = match bulk_filter(&query) {
        Ok(f) => f,
        Err(e) => return super::error_page(&signed, StatusCode::BAD_REQUEST, "Bad filter", &e),
    };
    let counts = match state
        .ctx
        .ledger
        .search_count(&filter.search(None), MAX_CAP + 1)
        .await
    {
        Ok(c) => c,
        Err(e) => return super::ledger_unavailable(&signed, &e),
    };
    let total: i64 = counts.iter().map(|(_, n)| n).sum();
    let count_of = |state: &str| {
        counts
            .iter()
            .find(|(s, _)| s == state)
            .map_or(0, |(_, n)| *n)
    };
    let body = html! {
        h1 { "Bulk action: dry run" }
        @if narrowed { (views::notice("info", "Bulk actions take unresolved operations only: the scope is unresolved.")) }
        p { "Filter: " a href=(format!("/ui/operations?{}", filter.query(&[]))) { code { (visible(&describe(&filter))) } } }
        p.figure-line {
            strong { @if total > MAX_CAP { "more than " (MAX_CAP) } @else { (total) } }
            " unresolved operations match now."
        }
        table {
            thead { tr { th { "state" } th.num { "now" } th { "recheck" } th { "fail" } } }
            tbody {
                @for (state, recheck, fail) in [
                    ("held", "yes: one more round (one the downstream had accepted is polled again, with a fresh deadline)", "yes"),
                    ("unknown", "yes, unless a round is running", "yes, unless a round is running"),
                    ("accepted", "yes: polls its status now, unless a poll is running", "yes, unless a poll is running (polling stops)"),
                    ("retry_wait", "no (skipped)", "yes"),
                    ("dispatching", "no (skipped)", "no (skipped)"),
                ] {
                    tr { td { (views::state_badge(state)) } td.num { (count_of(state)) } td { (recheck) } td { (fail) } }
                }
            }
        }
        p { "The job takes the operations matching when it starts (at most the cap, oldest first) and applies the action to each through the same guarded statement as a single action: a row that moved meanwhile is skipped, never overwritten." }
        @if total == 0 {
            p { "Nothing to do." }
        } @else {
            form.bulk method="post" action="/ui/bulk" {
                (views::csrf_field(&signed.csrf))
                input type="hidden" name="request_id" value=(request_id());
                input type="hidden" name="filter" value=(filter.query(&[]));
                label for="action" { "Action" }
                select id="action" name="action" {
                    option value="recheck" { "recheck (one recovery round each; a poll for accepted ones)" }
                    option value="fail" { "fail (with the evidence below)" }
                }
                label for="reason" { "Reason (recheck) or evidence (fail, at least 10 characters)" }
                textarea id="reason" name="reason" rows="3" required {}
                label for="cap" { "Cap: at most this many operations (1 to " (MAX_CAP) ")" }
                input id="cap" type="number" name="cap" min="1" max=(MAX_CAP) value=(DEFAULT_CAP.min(total.max(1)));
                button type="submit" { "Start the job" }
            }
        }
    };
    html(
        StatusCode::OK,
        views::page("Bulk action", &signed.frame(Nav::Jobs), body),
    )
}

/// A filter in words, for the pages.
fn describe(filter: &ConsoleFilter) -> String {
    let pairs = filter.pairs();
    if pairs.is_empty() {
        return "every unresolved operation".into();
    }
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `POST /ui/bulk`: starts the job (or finds the one this form already started).
pub async fn start(
    State(state): Shared,
    Extension(signed): Extension<Signed>,
    Form(form): Form<BTreeMap<String, String>>,
) -> Response {
    if let Some(refused) = refuse_form(&state, &signed, form.get("csrf").map(String::as_str)) {
        return refused;
    }
    let raw = form.get("filter").cloned().unwrap_or_default();
    // A filter that does not read back is refused: never widened to "everything".
    let Some(query) = format!("/?{raw}")
        .parse::<Uri>()
        .ok()
        .and_then(|uri| Query::<BTreeMap<String, String>>::try_from_uri(&uri).ok())
        .map(|Query(q)| q)
    else {
        return super::error_page(
            &signed,
            StatusCode::BAD_REQUEST,
            "Bad filter",
            "The form's filter could not be read; start again from the operations page.",
        );
    };
    if let Some(name) = super::filter::unknown_field(&query) {
        return super::error_page(
            &signed,
            StatusCode::BAD_REQUEST,
            "Bad filter",
            &format!("The form's filter has a field {name:?} that no filter has; nothing was started. Start again from the operations page."),
        );
    }
    let (filter, _) = match bulk_filter(&query) {
        Ok(f) => f,
        Err(e) => return super::error_page(&signed, StatusCode::BAD_REQUEST, "Bad filter", &e),
    };
    let Some(action) = form.get("action").and_then(|a| BulkAction::parse(a)) else {
        return super::error_page(
            &signed,
            StatusCode::BAD_REQUEST,
            "Bad request",
            "The action must be recheck or fail.",
        );
    };
    let cap = match form.get("cap").map(|c| c.trim()).filter(|c| !c.is_empty()) {
        None => DEFAULT_CAP,
        Some(c) => match c.parse::<i64>() {
            Ok(c) => c,
            Err(_) => {
                return super::error_page(
                    &signed,
                    StatusCode::BAD_REQUEST,
                    "Bad request",
                    &format!("The cap must be a number between 1 and {MAX_CAP}."),
                )
            }
        },
    };
    let mut shown: serde_json::Map<String, serde_json::Value> = serde_json::Map::new();
    for (k, v) in filter.pairs() {
        shown.insert(k.to_string(), v.into());
    }
    let request = BulkRequest {
        action,
        search: filter.search(None),
        filter: serde_json::Value::Object(shown),
        cap,
        operator: super::operator(&signed),
        reason: form.get("reason").cloned().unwrap_or_default(),
        request_id: form.get("request_id").cloned().unwrap_or_default(),
    };
    match state.runner.start(&request).await {
        Ok(job) => redirect(&format!("/ui/jobs/{}", job.id)),
        Err(e @ OpsError::BadRequest(_)) => {
            super::error_page(&signed, StatusCode::BAD_REQUEST, "Refused", &e.to_string())
        }
        Err(e) => super::error_page(
            &signed,
            StatusCode::SERVICE_UNAVAILABLE,
            "Not started",
            &e.to_string(),
        ),
    }
}

fn progress(job: &Job) -> Markup {
    html! {
        progress value=(job.processed()) max=(job.total.max(1)) { (job.processed()) " / " (job.total) }
        " " (job.processed()) " / " (job.total)
    }
}

/// `GET /ui/jobs`.
pub async fn jobs(State(state): Shared, Extension(signed): Extension<Signed>) -> Response {
    if let Some(r) = refuse_tenant(&signed) {
        return r;
    }
    let jobs = match state.ctx.ledger.recent_jobs(50).await {
        Ok(j) => j,
        Err(e) => return super::ledger_unavailable(&signed, &e),
    };
    let body = html! {
        h1 { "Bulk jobs" }
        p { "Start one from " a href="/ui/operations" { "Operations" } ": filter, then “Recheck or fail all of these…”." }
        @if jobs.is_empty() {
            p.empty { "No bulk job yet." }
        } @else {
            table {
                thead { tr { th.num { "job" } th { "action" } th { "status" } th { "progress" } th.num { "done" } th.num { "skipped" } th.num { "refused" } th { "by" } th { "started" } } }
                tbody {
                    @for j in &jobs {
                        tr {
                            td.num { a href=(format!("/ui/jobs/{}", j.id)) { (j.id) } }
                            td { (visible(&j.action)) }
                            td { (visible(&j.status)) }
                            td { (progress(j)) }
                            td.num { (j.done) } td.num { (j.skipped) } td.num { (j.refused) }
                            td { (visible(&j.operator)) }
                            td { (views::time(j.created_at)) }
                        }
                    }
                }
            }
        }
    };
    html(
        StatusCode::OK,
        views::page("Bulk jobs", &signed.frame(Nav::Jobs), body),
    )
}

/// `GET /ui/jobs/{id}`: the job's progress (refreshing while it runs).
pub async fn job(
    State(state): Shared,
    Extension(signed): Extension<Signed>,
    Path(id): Path<String>,
) -> Response {
    if let Some(r) = refuse_tenant(&signed) {
        return r;
    }
    let not_found = || {
        super::error_page(
            &signed,
            StatusCode::NOT_FOUND,
            "Not found",
            "There is no such job.",
        )
    };
    let Ok(id) = id.parse::<i64>() else {
        return not_found();
    };
    let ledger = &state.ctx.ledger;
    let (job, items) = match (ledger.job(id).await, ledger.job_items(id, 200).await) {
        (Ok(Some(job)), Ok(items)) => (job, items),
        (Ok(None), _) => return not_found(),
        (Err(e), _) | (_, Err(e)) => return super::ledger_unavailable(&signed, &e),
    };
    let running = job.status == "running";
    let filter = job
        .filter
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "every unresolved operation".into());
    let body = html! {
        p.crumbs { a href="/ui/jobs" { "Bulk jobs" } " / " (job.id) }
        h1 { "Job " (job.id) ": " (visible(&job.action)) }
        p.job-status data-status=(job.status) {
            "Status: " strong { (visible(&job.status)) }
            @if running { " — this page refreshes itself." }
        }
        p { (progress(&job)) }
        table.facts {
            tr { th { "done" } td.num #done { (job.done) } }
            tr { th { "skipped (moved on)" } td.num #skipped { (job.skipped) } }
            tr { th { "refused" } td.num #refused { (job.refused) } }
            tr { th { "total" } td.num #total { (job.total) } }
            tr { th { "cap" } td.num { (job.cap) } }
            tr { th { "filter" } td { code { (visible(&filter)) } } }
            tr { th { "by" } td { (visible(&job.operator)) } }
            tr { th { @if job.action == "fail" { "evidence" } @else { "reason" } } td { (visible(&job.reason)) } }
            tr { th { "started" } td { (views::time(job.created_at)) } }
            tr { th { "worker" } td { (job.owner.as_deref().map(visible).unwrap_or_else(|| "—".into())) " (taken " (job.claims) "×)" } }
            tr { th { "finished" } td { (views::time_or_dash(job.finished_at)) } }
            @if let Some(e) = &job.last_error { tr { th { "last error" } td { (visible(e)) } } }
        }
        @if running {
            form method="post" action=(format!("/ui/jobs/{}/cancel", job.id)) {
                (views::csrf_field(&signed.csrf))
                button type="submit" { "Cancel the job" }
            }
        }
        h2 { "Items" }
        table {
            thead { tr { th.num { "operation" } th { "key" } th { "outcome" } th { "detail" } } }
            tbody {
                @for i in &items {
                    tr {
                        td.num { a href=(format!("/ui/operations/{}", i.operation_id)) { (i.operation_id) } }
                        td { (i.tenant.as_deref().map(visible).unwrap_or_default()) "/" (i.action_id.as_deref().map(visible).unwrap_or_default()) }
                        td { (i.outcome.as_deref().unwrap_or("pending")) }
                        td { (visible(i.detail.as_deref().unwrap_or(""))) }
                    }
                }
            }
        }
    };
    let mut frame = signed.frame(Nav::Jobs);
    frame.refresh_secs = running.then_some(1);
    html(
        StatusCode::OK,
        views::page(&format!("Job {}", job.id), &frame, body),
    )
}

/// `POST /ui/jobs/{id}/cancel`.
pub async fn cancel(
    State(state): Shared,
    Extension(signed): Extension<Signed>,
    Path(id): Path<String>,
    Form(form): Form<BTreeMap<String, String>>,
) -> Response {
    if let Some(refused) = refuse_form(&state, &signed, form.get("csrf").map(String::as_str)) {
        return refused;
    }
    let Ok(id) = id.parse::<i64>() else {
        return super::error_page(
            &signed,
            StatusCode::NOT_FOUND,
            "Not found",
            "There is no such job.",
        );
    };
    if let Err(e) = state.ctx.ledger.cancel_job(id).await {
        return super::ledger_unavailable(&signed, &e);
    }
    tracing::info!(job = id, operator = %super::operator(&signed), "bulk job cancelled");
    redirect(&format!("/ui/jobs/{id}"))
}
