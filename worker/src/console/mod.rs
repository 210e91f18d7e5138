//! The operator console: server-rendered pages under `/ui` on the admin listener, for the
//! person who is paged. It reads the ledger and the dead-letter queue and acts only through
//! the operator actions the API and `worker ops` use ([`crate::ops`]), so the rules, the
//! audit (`operator:<name>`) and the idempotency are the same. It needs no JavaScript: forms
//! post, a running job's page refreshes itself.
//!
//! - [`session`]: sign-in as a signed cookie, valid on every worker, and CSRF tokens.
//! - [`filter`]: the operations filter, read from and written to the URL.
//! - [`views`]: the layout and the helpers that render hostile text as text.
//! - the pages: [`login`] (sign-in, sign-out), [`overview`], [`operations`] (list, groups by
//!   cause, one operation and its actions), [`bulk`] (dry run, jobs, progress),
//!   [`dead_letters`] (list, republish, discard).
//!
//! Who may do what: the admin token signs in as an operator (its name asked on the sign-in
//! form) who may read and act on everything; a tenant token signs in read-only and sees its
//! own tenant's operations and dead letters only (another tenant's operation answers 404, like
//! a missing one). Every state-changing form carries the session's CSRF token. Every answer
//! carries a Content-Security-Policy without inline scripts or styles, `X-Frame-Options:
//! DENY`, `nosniff`, `no-referrer` and `no-store`. No token or tool header is ever shown.

pub mod bulk;
pub mod dead_letters;
pub mod filter;
pub mod login;
pub mod operations;
pub mod overview;
pub mod session;
pub mod views;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use maud::Markup;

use crate::config::auth::Tokens;
use crate::config::ConsoleSettings;
use crate::context::Context;
use crate::intake::TenantAuth;
use crate::ops::bulk::Runner;
use crate::ops::dead_letters::Broker;
use session::{Keys, Session};
use views::{Frame, Nav};

/// The Content-Security-Policy of every console answer: only this origin's stylesheet, no
/// script at all, no framing, forms only to this origin.
pub const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; \
     frame-ancestors 'none'; form-action 'self'; base-uri 'none'";

/// The stylesheet, served from `/ui/static/console.css`.
const CSS: &str = include_str!("static/console.css");

/// The console and what it reads and acts on.
pub struct Console {
    state: Arc<ConsoleState>,
}

/// What every console handler shares.
pub struct ConsoleState {
    pub ctx: Arc<Context>,
    pub tokens: Tokens,
    pub keys: Keys,
    pub settings: ConsoleSettings,
    /// The dead-letter queue's broker link.
    pub broker: Broker,
    /// The tenant proof of the tools file (whose dead letters a tenant sees).
    pub auth: TenantAuth,
    pub runner: Runner,
    /// Wrong tokens taken at sign-in, per client and overall (the admin API's budget).
    pub budget: Arc<kit::guard::FailureBudget>,
}

/// The session of a signed-in request and its CSRF token.
#[derive(Clone)]
pub struct Signed {
    pub session: Session,
    pub csrf: String,
}

impl Signed {
    pub fn frame(&self, nav: Nav) -> Frame<'_> {
        Frame {
            session: Some(&self.session),
            csrf: Some(&self.csrf),
            nav,
            refresh_secs: None,
        }
    }
}

type Shared = State<Arc<ConsoleState>>;

impl Console {
    pub fn new(
        ctx: Arc<Context>,
        tokens: Tokens,
        settings: ConsoleSettings,
        broker: Broker,
        auth: TenantAuth,
        runner: Runner,
        budget: Arc<kit::guard::FailureBudget>,
    ) -> Console {
        let keys = Keys::new(settings.secret.as_deref(), &tokens);
        Console {
            state: Arc::new(ConsoleState {
                ctx,
                tokens,
                keys,
                settings,
                broker,
                auth,
                runner,
                budget,
            }),
        }
    }

    /// The console's routes (all under `/ui`), with its security headers.
    pub fn router(&self) -> Router {
        let signed_in = Router::new()
            .route("/ui/logout", post(login::logout))
            .route("/ui/overview", get(overview::page))
            .route("/ui/operations", get(operations::list))
            .route("/ui/operations/{id}", get(operations::detail))
            .route("/ui/operations/{id}/{action}", post(operations::act))
            .route("/ui/bulk", get(bulk::dry_run).post(bulk::start))
            .route("/ui/jobs", get(bulk::jobs))
            .route("/ui/jobs/{id}", get(bulk::job))
            .route("/ui/jobs/{id}/cancel", post(bulk::cancel))
            .route(
                "/ui/dead-letters",
                get(dead_letters::list).post(dead_letters::act),
            )
            .route_layer(middleware::from_fn_with_state(
                self.state.clone(),
                require_session,
            ));
        Router::new()
            .route("/ui", get(|| async { redirect("/ui/overview") }))
            .route("/ui/", get(|| async { redirect("/ui/overview") }))
            .route("/ui/static/console.css", get(stylesheet))
            .route(
                "/ui/login",
                get(login::form)
                    .post(login::sign_in)
                    .layer(DefaultBodyLimit::max(login::SIGN_IN_FORM_BYTES))
                    .layer(middleware::from_fn(login::small_form)),
            )
            .merge(signed_in)
            .route("/ui/{*rest}", get(not_found).post(not_found))
            .layer(middleware::from_fn(security_headers))
            .with_state(self.state.clone())
    }
}

impl ConsoleState {
    /// Whether cookies must be `Secure`: the setting, or a TLS proxy saying the request came
    /// over HTTPS.
    pub fn secure(&self, headers: &HeaderMap) -> bool {
        self.settings.secure_cookie
            || headers
                .get("x-forwarded-proto")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.trim().eq_ignore_ascii_case("https"))
    }

    fn lifetime_secs(&self) -> i64 {
        self.settings.session.as_secs() as i64
    }

    /// The session a request's cookie carries, if valid and not signed out. A ledger that
    /// cannot say whether it was signed out counts as signed out.
    pub async fn session(&self, headers: &HeaderMap) -> Option<Session> {
        let cookies = headers.get(header::COOKIE)?.to_str().ok()?;
        let value = session::cookie_value(cookies, session::COOKIE)?;
        let session = self
            .keys
            .verify(value, now(), self.lifetime_secs(), &self.tokens)
            .ok()?;
        match self.ctx.ledger.console_id_spent(&session.id).await {
            Ok(false) => Some(session),
            Ok(true) => None,
            Err(e) => {
                tracing::warn!(error = %e, "console: cannot tell whether a session signed out; treating it as signed out");
                None
            }
        }
    }
}

/// Unix seconds now.
pub fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

/// Every console answer's security headers.
async fn security_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// The signed-in routes' gate: a valid session cookie, or the sign-in page (a GET) or 401.
async fn require_session(State(state): Shared, mut request: Request, next: Next) -> Response {
    match state.session(request.headers()).await {
        Some(session) => {
            let csrf = state.keys.csrf(&session);
            request.extensions_mut().insert(Signed { session, csrf });
            next.run(request).await
        }
        None if request.method() == Method::GET => redirect("/ui/login"),
        None => html(
            StatusCode::UNAUTHORIZED,
            views::page(
                "Signed out",
                &no_session(),
                views::error_body(
                    "Signed out",
                    "Your session has ended (or never began): sign in again, then repeat.",
                ),
            ),
        ),
    }
}

/// The frame of a page shown without a session.
pub fn no_session() -> Frame<'static> {
    Frame {
        session: None,
        csrf: None,
        nav: Nav::None,
        refresh_secs: None,
    }
}

/// An HTML answer.
pub fn html(status: StatusCode, markup: Markup) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        markup.into_string(),
    )
        .into_response()
}

/// 303 See Other to `location` (a path this console built).
pub fn redirect(location: &str) -> Response {
    let value = HeaderValue::from_str(location).unwrap_or(HeaderValue::from_static("/ui"));
    (StatusCode::SEE_OTHER, [(header::LOCATION, value)]).into_response()
}

/// An error page for a signed-in user.
pub fn error_page(signed: &Signed, status: StatusCode, title: &str, message: &str) -> Response {
    html(
        status,
        views::page(
            title,
            &signed.frame(Nav::None),
            views::error_body(title, message),
        ),
    )
}

/// The page for a ledger that did not answer.
pub fn ledger_unavailable(signed: &Signed, e: &dyn std::fmt::Display) -> Response {
    error_page(
        signed,
        StatusCode::SERVICE_UNAVAILABLE,
        "Ledger unavailable",
        &format!("The ledger could not answer: {e}"),
    )
}

/// The checks of every state-changing form: the session's CSRF token, and an admin session
/// (tenants are read-only). The refusal page when one fails.
pub fn refuse_form(state: &ConsoleState, signed: &Signed, csrf: Option<&str>) -> Option<Response> {
    if !state.keys.check_csrf(&signed.session, csrf) {
        return Some(error_page(
            signed,
            StatusCode::FORBIDDEN,
            "Refused",
            "The form's CSRF token is missing or wrong; nothing was changed. Reload the page and try again.",
        ));
    }
    if !signed.session.is_admin() {
        return Some(error_page(
            signed,
            StatusCode::FORBIDDEN,
            "Read-only",
            "A tenant session is read-only; nothing was changed.",
        ));
    }
    None
}

/// The operator name of an admin session (for the audit).
pub fn operator(signed: &Signed) -> String {
    signed.session.operator.clone().unwrap_or_default()
}

/// A fresh request id for a form: submitting the same form twice does the action once.
pub fn request_id() -> String {
    format!("console:{}", uuid::Uuid::new_v4())
}

async fn stylesheet() -> Response {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], CSS).into_response()
}

async fn not_found(State(state): Shared, headers: HeaderMap) -> Response {
    let session = state.session(&headers).await;
    let csrf = session.as_ref().map(|s| state.keys.csrf(s));
    let frame = Frame {
        session: session.as_ref(),
        csrf: csrf.as_deref(),
        nav: Nav::None,
        refresh_secs: None,
    };
    html(
        StatusCode::NOT_FOUND,
        views::page(
            "Not found",
            &frame,
            views::error_body("Not found", "There is no such page."),
        ),
    )
}
