//! The overview: the approval queue first when anything waits for a person (how many, the
//! oldest wait; an approver's overview is only that), then operations per state and tool, how
//! many are unresolved and how old the oldest is, how many are past the alert age, and (admin)
//! the dead-letter queue's depth and the workers heard from. A tenant's overview counts its own
//! operations and waiting intents only and shows nothing of other tenants, the queue or the
//! workers.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::Extension;
use maud::{html, Markup};

use super::filter::{query_string, ConsoleFilter};
use super::session::Reads;
use super::views::{self, age, visible, Nav};
use super::{html, Shared, Signed};
use crate::ledger::queries::StateCount;
use crate::ledger::workers::Heartbeat;
use crate::ops::approvals::{self, MAX_AWAITING_LIMIT};

/// Workers heard from within this long are listed.
const WORKERS_WITHIN: std::time::Duration = std::time::Duration::from_secs(3_600);
/// A worker silent for longer than this is shown as gone.
const SILENT_SECS: f64 = 30.0;

/// `GET /ui/overview`.
pub async fn page(State(state): Shared, Extension(signed): Extension<Signed>) -> Response {
    // The approval queue first: every tenant's for the admin and approvers, a tenant's own.
    let waiting = approvals::awaiting(
        &state.ctx,
        signed.session.approvals_of(),
        Some(MAX_AWAITING_LIMIT),
    )
    .await;
    let queue = html! {
        @match &waiting {
            Ok(w) => (super::approvals::overview_cards(w, signed.session.approver().is_some())),
            Err(e) => (views::notice("error", &format!("The approval queue could not be read: {e}"))),
        }
    };
    // An approver's overview is its queue: it reads no operation.
    let tenant = match signed.session.reads() {
        Reads::Nothing => {
            let body = html! { h1 { "Overview" } (queue) };
            return html(
                StatusCode::OK,
                views::page("Overview", &signed.frame(Nav::Overview), body),
            );
        }
        Reads::Everything => None,
        Reads::Tenant(t) => Some(t),
    };
    let threshold = state.settings.alert_age.as_secs_f64();
    let counts = match state.ctx.ledger.state_counts(tenant, threshold).await {
        Ok(c) => c,
        Err(e) => return super::ledger_unavailable(&signed, &e),
    };
    let admin = signed.session.is_admin();
    let depth = if admin {
        Some(state.broker.depth().await.map_err(|e| e.to_string()))
    } else {
        None
    };
    let workers = if admin {
        state.ctx.ledger.heartbeats(WORKERS_WITHIN).await.ok()
    } else {
        None
    };
    let dead_letters = state.broker.topology().dead_letter_queue.as_str();
    let body = html! {
        h1 { "Overview" }
        @if let Some(t) = tenant { p { "Tenant " strong { (visible(t)) } " only." } }
        (queue)
        @if waiting.as_ref().is_ok_and(|w| !w.is_empty()) { h2 { "Operations" } }
        (cards(&Totals::of(&counts), threshold, depth.as_ref(), dead_letters, workers.as_deref()))
        @if let Some(Err(e)) = &depth {
            (views::notice("error", &format!("The dead-letter queue could not be read: {e}")))
        }
        h2 { "Operations by state and tool" }
        (counts_table(&counts, threshold))
        @if let Some(workers) = &workers {
            h2 { "Workers (heard from in the last hour)" }
            (workers_table(workers))
        }
    };
    html(
        StatusCode::OK,
        views::page("Overview", &signed.frame(Nav::Overview), body),
    )
}

/// The figures of the cards, summed over every state and tool.
#[derive(Debug, PartialEq)]
struct Totals {
    unresolved: i64,
    held: i64,
    past_threshold: i64,
    /// Seconds; None when nothing is unresolved.
    oldest_unresolved: Option<f64>,
}

impl Totals {
    fn of(counts: &[StateCount]) -> Totals {
        Totals {
            unresolved: counts.iter().map(|c| c.unresolved).sum(),
            held: counts
                .iter()
                .filter(|c| c.state == "held")
                .map(|c| c.count)
                .sum(),
            past_threshold: counts.iter().map(|c| c.past_threshold).sum(),
            oldest_unresolved: counts
                .iter()
                .filter_map(|c| c.oldest_unresolved_secs)
                .fold(None, |m: Option<f64>, a| Some(m.map_or(a, |m| m.max(a)))),
        }
    }
}

/// The cards: unresolved, held, oldest, past the alert age (`threshold` seconds), and for the
/// admin the dead-letter queue's `depth` and the `workers` ready.
fn cards(
    totals: &Totals,
    threshold: f64,
    depth: Option<&Result<u32, String>>,
    queue: &str,
    workers: Option<&[Heartbeat]>,
) -> Markup {
    let list = |pairs: &[(&str, String)]| format!("/ui/operations?{}", query_string(pairs));
    let past = totals.past_threshold;
    html! {
        section.cards {
            a.card href=(list(&[])) { span.figure { (totals.unresolved) } span.label { "unresolved" } }
            a.card href=(list(&[("state", "held".into())])) { span.figure { (totals.held) } span.label { "held (a person must act)" } }
            div.card { span.figure { (totals.oldest_unresolved.map_or("—".to_string(), age)) } span.label { "oldest unresolved" } }
            a.card class=[(past > 0).then_some("alert")] href=(list(&[("min_age", format!("{}", threshold as u64))])) {
                span.figure { (past) } span.label { "past the alert age (" (age(threshold)) ")" }
            }
            @if let Some(depth) = depth {
                a.card class=[depth.as_ref().is_ok_and(|d| *d > 0).then_some("alert")] href="/ui/dead-letters" {
                    span.figure { @match depth { Ok(d) => (d), Err(_) => "?" } }
                    span.label { "dead letters in " (visible(queue)) }
                }
            }
            @if let Some(workers) = workers {
                @let ready = workers.iter().filter(|w| w.ready && w.silent_secs <= SILENT_SECS).count();
                @let seen = workers.iter().filter(|w| w.silent_secs <= SILENT_SECS).count();
                div.card class=[(ready < seen).then_some("alert")] {
                    span.figure { (ready) " / " (seen) }
                    span.label { "workers ready / running" }
                }
            }
        }
    }
}

/// Operations per state and tool, each count a link to its list.
fn counts_table(counts: &[StateCount], threshold: f64) -> Markup {
    html! {
        @if counts.is_empty() {
            p { "No operations recorded." }
        } @else {
            table {
                thead { tr {
                    th { "state" } th { "tool" } th.num { "operations" } th.num { "unresolved" }
                    th { "oldest unresolved" } th.num { "past " (age(threshold)) }
                } }
                tbody {
                    @for c in counts {
                        @let filter = ConsoleFilter::default().with("state", &c.state).with("tool", &c.tool);
                        @let scope = if matches!(c.state.as_str(), "succeeded" | "failed" | "prepared") { "all" } else { "unresolved" };
                        tr {
                            td { (views::state_badge(&c.state)) }
                            td { (visible(&c.tool)) }
                            td.num { a href=(format!("/ui/operations?{}", filter.query(&[("scope", scope.into())]))) { (c.count) } }
                            td.num { (c.unresolved) }
                            td { (c.oldest_unresolved_secs.map_or("—".to_string(), age)) }
                            td.num class=[(c.past_threshold > 0).then_some("alert")] { (c.past_threshold) }
                        }
                    }
                }
            }
        }
    }
}

/// The workers heard from, each ready, not ready or silent.
fn workers_table(workers: &[Heartbeat]) -> Markup {
    html! {
        @if workers.is_empty() {
            p { "No worker has reported yet." }
        } @else {
            table {
                thead { tr { th { "worker" } th { "status" } th { "last heard" } th { "started" } th { "why not ready" } } }
                tbody {
                    @for w in workers {
                        tr {
                            td { code { (visible(&w.worker_id)) } }
                            td {
                                @if w.silent_secs > SILENT_SECS { span.state.state-failed { "silent" } }
                                @else if w.ready { span.state.state-succeeded { "ready" } }
                                @else { span.state.state-held { "not ready" } }
                            }
                            td { (age(w.silent_secs)) " ago" }
                            td { (views::time(w.started_at)) }
                            td { (visible(&w.reasons)) }
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(
        state: &str,
        count: i64,
        unresolved: i64,
        oldest: Option<f64>,
        past: i64,
    ) -> StateCount {
        StateCount {
            state: state.into(),
            tool: "refund".into(),
            count,
            unresolved,
            oldest_unresolved_secs: oldest,
            past_threshold: past,
        }
    }

    #[test]
    fn the_cards_sum_every_state_and_tool_and_take_the_oldest() {
        let cases = [
            (
                vec![],
                Totals {
                    unresolved: 0,
                    held: 0,
                    past_threshold: 0,
                    oldest_unresolved: None,
                },
            ),
            (
                vec![
                    count("held", 3, 3, Some(50.0), 1),
                    count("unknown", 2, 2, Some(900.0), 2),
                    count("dispatching", 4, 1, Some(5.0), 0),
                    count("succeeded", 10, 0, None, 0),
                    count("held", 1, 1, None, 0),
                ],
                Totals {
                    unresolved: 7,
                    held: 4,
                    past_threshold: 3,
                    oldest_unresolved: Some(900.0),
                },
            ),
        ];
        for (counts, want) in cases {
            assert_eq!(Totals::of(&counts), want, "{counts:?}");
        }
    }
}
