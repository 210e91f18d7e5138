//! Signing in and out. The sign-in form takes a token (the admin token, a tenant's read token
//! or an approver's token) and, for the admin, the operator's name, which every action of the
//! session records as `operator:<name>` (an approver's name is the token's, recorded with each
//! decision; an approver lands on the approval queue). A good token gets the session cookie ([`super::session`]); a wrong
//! one is answered at once and spends the listener's failure budget ([`kit::guard`], shared
//! with the API's bearer tokens): past it, sign-ins are answered 429 without the token being
//! compared. Nothing is held while a failure is paid for. The form is small
//! ([`SIGN_IN_FORM_BYTES`]), carries its own CSRF token bound to a nonce cookie with the form's
//! time inside the MAC, and works once. Signing out spends the session's id in the ledger, so a
//! copy of the cookie stops working on every worker.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Form};
use maud::html;

use super::session::{self, cookie_value, set_cookie};
use super::views::{self, visible};
use super::{html, no_session, redirect, Shared, Signed};
use crate::config::auth::Principal;
use crate::ledger::console::SpentKind;

/// Longest operator name (as the operator actions allow).
const MAX_OPERATOR_CHARS: usize = crate::ops::actions::MAX_OPERATOR_CHARS;

/// The largest sign-in form accepted (bytes): a CSRF token, a token and a name fit many times
/// over; anything bigger is refused `413` before it is read.
pub const SIGN_IN_FORM_BYTES: usize = 4096;

/// The sign-in route's guard: a form announced larger than [`SIGN_IN_FORM_BYTES`] is refused
/// `413` before any of it is read (nobody is signed in yet to spend a connection on).
pub async fn small_form(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    if kit::http::announces_more_than(request.headers(), SIGN_IN_FORM_BYTES) {
        let mut response = html(
            StatusCode::PAYLOAD_TOO_LARGE,
            views::page(
                "Too large",
                &no_session(),
                views::error_body(
                    "Too large",
                    "A sign-in form is a token and a name; this one is far larger.",
                ),
            ),
        );
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return response;
    }
    next.run(request).await
}

/// `GET /ui/login`.
pub async fn form(State(state): Shared, headers: HeaderMap) -> Response {
    if state.session(&headers).await.is_some() {
        return redirect("/ui/overview");
    }
    login_page(&state, &headers, StatusCode::OK, None, "")
}

fn login_page(
    state: &super::ConsoleState,
    headers: &HeaderMap,
    status: StatusCode,
    error: Option<&str>,
    operator: &str,
) -> Response {
    let (nonce, token) = state.keys.login_form(super::now());
    let body = html! {
        section.signin {
            h1 { "Sign in" }
            p { "The operator console of the intent worker. Sign in with the admin token to act, with a tenant's token to read that tenant's operations, or with your approver token to approve or reject the intents that wait for a person." }
            @if let Some(e) = error { (views::notice("error", e)) }
            form method="post" action="/ui/login" {
                input type="hidden" name="csrf" value=(token);
                label for="token" { "Token" }
                input id="token" type="password" name="token" autocomplete="current-password" required;
                label for="operator" { "Your name (admin: recorded with every action, as in " code { "worker ops --operator" } "; an approver's is the token's)" }
                input id="operator" type="text" name="operator" value=(visible(operator)) maxlength=(MAX_OPERATOR_CHARS) autocomplete="username";
                button type="submit" { "Sign in" }
            }
        }
    };
    let mut response = html(status, views::page("Sign in", &no_session(), body));
    let cookie = set_cookie(
        session::LOGIN_COOKIE,
        &nonce,
        session::LOGIN_FORM_SECS,
        state.secure(headers),
    );
    if let Ok(v) = cookie.parse() {
        response.headers_mut().append(header::SET_COOKIE, v);
    }
    response
}

/// `POST /ui/login`: the form's CSRF token (fresh, unused), the failure budget, the token, the
/// operator's name; then the session.
pub async fn sign_in(
    State(state): Shared,
    peer: Option<Extension<kit::http::Peer>>,
    headers: HeaderMap,
    Form(form): Form<BTreeMap<String, String>>,
) -> Response {
    let nonce = headers
        .get(header::COOKIE)
        .and_then(|v| v.to_str().ok())
        .and_then(|c| cookie_value(c, session::LOGIN_COOKIE));
    let operator = form.get("operator").map(|o| o.trim()).unwrap_or("");
    let now = super::now();
    let expired = || {
        login_page(
            &state,
            &headers,
            StatusCode::FORBIDDEN,
            Some("The sign-in form expired, was already used, or its CSRF token is wrong (cookies must be on). Try again."),
            operator,
        )
    };
    let (Some(nonce), true) = (
        nonce,
        state
            .keys
            .check_login(nonce, form.get("csrf").map(String::as_str), now),
    ) else {
        return expired();
    };
    let client = peer.map_or(std::net::Ipv4Addr::UNSPECIFIED.into(), |p| p.0 .0.ip());
    if let Err(refused) = state.budget.admit(client) {
        return too_many(&state, &headers, refused, operator);
    }
    // One use per form, on every worker: the ledger decides.
    let until = chrono::DateTime::from_timestamp(now + session::LOGIN_FORM_SECS + 60, 0)
        .unwrap_or_else(chrono::Utc::now);
    match state
        .ctx
        .ledger
        .spend_console_id(SpentKind::LoginForm, nonce, until)
        .await
    {
        Ok(true) => {}
        Ok(false) => return expired(),
        Err(e) => {
            state.budget.forgive(client);
            tracing::error!(error = %e, "console sign-in: the ledger could not record the form");
            return login_page(
                &state,
                &headers,
                StatusCode::SERVICE_UNAVAILABLE,
                Some("The ledger could not answer; try again in a moment."),
                operator,
            );
        }
    }
    let token = form.get("token").map(|t| t.trim()).unwrap_or("");
    let Some(principal) = (!token.is_empty())
        .then(|| state.tokens.identify(token))
        .flatten()
    else {
        tracing::warn!(%client, "console sign-in refused: unknown token");
        return login_page(
            &state,
            &headers,
            StatusCode::UNAUTHORIZED,
            Some("That token is not accepted here."),
            operator,
        );
    };
    state.budget.forgive(client);
    let operator = match principal {
        Principal::Admin => match crate::ops::actions::check_operator_name(operator) {
            Ok(()) => Some(operator.to_string()),
            Err(why) => {
                return login_page(
                    &state,
                    &headers,
                    StatusCode::BAD_REQUEST,
                    Some(&format!(
                        "An admin signs in with a name: it is recorded with every action. {why}"
                    )),
                    operator,
                );
            }
        },
        // Tenants are read-only: a name would never be recorded.
        Principal::Tenant(_) => None,
        // An approver's name is the token's: it is recorded with every decision.
        Principal::Approver(_) => None,
    };
    let lifetime = state.settings.session.as_secs() as i64;
    let (session, cookie) = state.keys.issue(principal, operator, token, now, lifetime);
    tracing::info!(
        admin = session.is_admin(),
        tenant = session.tenant().unwrap_or(""),
        approver = session.approver().unwrap_or(""),
        operator = session.operator.as_deref().unwrap_or(""),
        "console sign-in"
    );
    let secure = state.secure(&headers);
    // An approver's console is the approval queue.
    let mut response = redirect(if session.approver().is_some() {
        "/ui/approvals"
    } else {
        "/ui/overview"
    });
    for c in [
        set_cookie(session::COOKIE, &cookie, lifetime, secure),
        set_cookie(session::LOGIN_COOKIE, "", 0, secure),
    ] {
        if let Ok(v) = c.parse() {
            response.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    response
}

/// The sign-in page when the failure budget is spent: 429 with `Retry-After`.
fn too_many(
    state: &super::ConsoleState,
    headers: &HeaderMap,
    refused: kit::guard::Refused,
    operator: &str,
) -> Response {
    let secs = refused.retry_after.as_secs();
    let mut response = login_page(
        state,
        headers,
        StatusCode::TOO_MANY_REQUESTS,
        Some(&format!(
            "Too many wrong tokens were tried here; sign-in is refused for {secs} s. Try again then."
        )),
        operator,
    );
    if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
        response.headers_mut().insert(header::RETRY_AFTER, v);
    }
    response
}

/// `POST /ui/logout`: ends the session on every worker (its id spent in the ledger until it
/// would have expired) and clears the cookie (CSRF-checked; tenants may sign out too).
pub async fn logout(
    State(state): Shared,
    Extension(signed): Extension<Signed>,
    headers: HeaderMap,
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
            "The form's CSRF token is missing or wrong.",
        );
    }
    let until = chrono::DateTime::from_timestamp(signed.session.expires, 0)
        .unwrap_or_else(chrono::Utc::now);
    if let Err(e) = state
        .ctx
        .ledger
        .spend_console_id(SpentKind::Session, &signed.session.id, until)
        .await
    {
        tracing::error!(error = %e, "console sign-out: the ledger could not end the session");
        return super::ledger_unavailable(&signed, &e);
    }
    let mut response = redirect("/ui/login");
    let cookie = set_cookie(session::COOKIE, "", 0, state.secure(&headers));
    if let Ok(v) = cookie.parse() {
        response.headers_mut().append(header::SET_COOKIE, v);
    }
    response.into_response()
}
