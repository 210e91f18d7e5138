//! Signing in and out. The sign-in form takes a token (the admin token, or a tenant's read
//! token) and, for the admin, the operator's name, which every action of the session records
//! as `operator:<name>`. A good token gets the session cookie ([`super::session`]); a wrong
//! one is answered after [`super::SIGN_IN_FAILURE_DELAY`], one failure at a time per worker.
//! The form carries its own CSRF token, bound to a short-lived nonce cookie.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Form};
use maud::html;

use super::session::{self, cookie_value, set_cookie};
use super::views::{self, visible};
use super::{html, no_session, redirect, Shared, Signed};
use crate::config::auth::Principal;

/// Longest operator name (as the operator actions allow).
const MAX_OPERATOR_CHARS: usize = 100;

/// `GET /ui/login`.
pub async fn form(State(state): Shared, headers: HeaderMap) -> Response {
    if state.session(&headers).is_some() {
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
    let (nonce, token) = state.keys.login_form();
    let body = html! {
        section.signin {
            h1 { "Sign in" }
            p { "The operator console of the intent worker. Sign in with the admin token to act, or with a tenant's token to read that tenant's operations." }
            @if let Some(e) = error { (views::notice("error", e)) }
            form method="post" action="/ui/login" {
                input type="hidden" name="csrf" value=(token);
                label for="token" { "Token" }
                input id="token" type="password" name="token" autocomplete="current-password" required;
                label for="operator" { "Your name (admin: recorded with every action, as in " code { "worker ops --operator" } ")" }
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

/// `POST /ui/login`.
pub async fn sign_in(
    State(state): Shared,
    headers: HeaderMap,
    Form(form): Form<BTreeMap<String, String>>,
) -> Response {
    let nonce = headers
        .get(header::COOKIE)
        .and_then(|v| v.to_str().ok())
        .and_then(|c| cookie_value(c, session::LOGIN_COOKIE));
    let operator = form.get("operator").map(|o| o.trim()).unwrap_or("");
    if !state
        .keys
        .check_login(nonce, form.get("csrf").map(String::as_str))
    {
        return login_page(
            &state,
            &headers,
            StatusCode::FORBIDDEN,
            Some("The sign-in form expired or its CSRF token is wrong (cookies must be on). Try again."),
            operator,
        );
    }
    let token = form.get("token").map(|t| t.trim()).unwrap_or("");
    let Some(principal) = (!token.is_empty())
        .then(|| state.tokens.identify(token))
        .flatten()
    else {
        // One failure at a time, each held: guessing costs time, whatever the parallelism.
        let _held = state.failed_sign_ins.lock().await;
        tokio::time::sleep(super::SIGN_IN_FAILURE_DELAY).await;
        tracing::warn!("console sign-in refused: unknown token");
        return login_page(
            &state,
            &headers,
            StatusCode::UNAUTHORIZED,
            Some("That token is not accepted here."),
            operator,
        );
    };
    let operator = match principal {
        Principal::Admin => {
            if operator.is_empty()
                || operator.chars().count() > MAX_OPERATOR_CHARS
                || operator.chars().any(char::is_control)
            {
                return login_page(
                    &state,
                    &headers,
                    StatusCode::BAD_REQUEST,
                    Some("An admin signs in with a name (up to 100 characters, no control characters): it is recorded with every action."),
                    operator,
                );
            }
            Some(operator.to_string())
        }
        // Tenants are read-only: a name would never be recorded.
        Principal::Tenant(_) => None,
    };
    let lifetime = state.settings.session.as_secs() as i64;
    let (session, cookie) = state
        .keys
        .issue(principal, operator, token, super::now(), lifetime);
    tracing::info!(
        admin = session.is_admin(),
        tenant = session.tenant().unwrap_or(""),
        operator = session.operator.as_deref().unwrap_or(""),
        "console sign-in"
    );
    let secure = state.secure(&headers);
    let mut response = redirect("/ui/overview");
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

/// `POST /ui/logout`: clears the session cookie (CSRF-checked; tenants may sign out too).
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
    let mut response = redirect("/ui/login");
    let cookie = set_cookie(session::COOKIE, "", 0, state.secure(&headers));
    if let Ok(v) = cookie.parse() {
        response.headers_mut().append(header::SET_COOKIE, v);
    }
    response.into_response()
}
