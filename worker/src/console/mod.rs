//! The operator console: server-rendered pages under `/ui` on the admin listener, for the
//! person who is paged. It reads the ledger and the dead-letter queue and acts only through
//! the operator actions the API and `worker ops` use ([`crate::ops`]), so the rules, the
//! audit (`operator:<name>`) and the idempotency are the same. It needs no JavaScript: forms
//! post, a running job's page refreshes itself.
//!
//! - [`session`]: sign-in as a signed cookie, valid on every worker, and CSRF tokens.
//! - [`filter`]: the operations filter, read from and written to the URL.
//! - [`views`]: the layout and the helpers that render hostile text as text.
//! - the pages: [`login`] (sign-in, sign-out), [`overview`], [`approvals`] (the intents that
//!   wait for a person, approve, reject), [`operations`] (list, groups by cause, one operation
//!   and its actions), [`bulk`] (dry run, jobs, progress), [`dead_letters`] (list, republish,
//!   discard).
//!
//! Who may do what: the admin token signs in as an operator (its name asked on the sign-in
//! form) who may read and act on everything but approvals, which it reads only; a tenant token
//! signs in read-only and sees its own tenant's operations, dead letters and waiting intents
//! only (another tenant's operation answers 404, like a missing one); an approver token signs
//! in as that approver, who sees the approval queue (every tenant's) and approves or rejects,
//! and nothing else: every other page and form answers it 403 ([`approver_may`]). Every
//! state-changing form carries the session's CSRF token. Every answer carries a
//! Content-Security-Policy without inline scripts or styles, `X-Frame-Options: DENY`,
//! `nosniff`, `no-referrer` and `no-store`. No token or tool header is ever shown.

pub mod approvals;
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
use session::{Keys, Reads, Session};
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
            .route("/ui/approvals", get(approvals::list))
            .route(
                "/ui/approvals/{tenant}/{action_id}",
                get(approvals::detail).post(approvals::decide),
            )
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

/// The signed-in routes' gate: a valid session cookie, or the sign-in page (a GET) or 401; an
/// approver's session only where [`approver_may`] lets it.
async fn require_session(State(state): Shared, mut request: Request, next: Next) -> Response {
    match state.session(request.headers()).await {
        Some(session) => {
            let csrf = state.keys.csrf(&session);
            let signed = Signed { session, csrf };
            if signed.session.approver().is_some()
                && !approver_may(request.method(), request.uri().path())
            {
                return approvers_elsewhere(&signed);
            }
            request.extensions_mut().insert(signed);
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

/// Where an approver's session may go: the approval queue, one waiting intent (to read it and
/// to post a decision), the overview (its approval queue only) and sign-out. Nothing else: not
/// the operations, bulk jobs or dead letters, nor any of their forms.
pub fn approver_may(method: &Method, path: &str) -> bool {
    let one_intent = path
        .strip_prefix("/ui/approvals/")
        .and_then(|rest| rest.split_once('/'))
        .is_some_and(|(tenant, action)| {
            !tenant.is_empty() && !action.is_empty() && !action.contains('/')
        });
    match *method {
        Method::GET | Method::HEAD => {
            matches!(path, "/ui/overview" | "/ui/approvals") || one_intent
        }
        Method::POST => path == "/ui/logout" || one_intent,
        _ => false,
    }
}

/// The answer to an approver's session anywhere [`approver_may`] does not let it go.
pub fn approvers_elsewhere(signed: &Signed) -> Response {
    let body = maud::html! {
        h1 { "Approvers only approve" }
        (views::notice("error", "An approver's session shows the intents that wait for approval, and nothing else; nothing was read or changed."))
        p { a href="/ui/approvals" { "The approval queue" } }
    };
    html(
        StatusCode::FORBIDDEN,
        views::page(
            "Approvers only approve",
            &signed.frame(Nav::Approvals),
            body,
        ),
    )
}

/// Whose operations, dead letters and counts `signed` may read: None for every tenant's (the
/// admin), one tenant's, or [`ApproversOnly`] for an approver (who reads the approval queue
/// only; answer it [`approvers_elsewhere`]). Every page that reads operations starts here, so
/// no session falls through to the admin's view.
pub fn reads(signed: &Signed) -> Result<Option<&str>, ApproversOnly> {
    match signed.session.reads() {
        Reads::Everything => Ok(None),
        Reads::Tenant(t) => Ok(Some(t)),
        Reads::Nothing => Err(ApproversOnly),
    }
}

/// An approver's session where it reads nothing: the approval pages are all it may open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApproversOnly;

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

/// The checks of every state-changing form but an approval's: the session's CSRF token, and an
/// admin session (tenants are read-only, approvers only approve). The refusal page when one
/// fails.
pub fn refuse_form(state: &ConsoleState, signed: &Signed, csrf: Option<&str>) -> Option<Response> {
    refuse_form_with(&state.keys, signed, csrf)
}

fn refuse_form_with(keys: &Keys, signed: &Signed, csrf: Option<&str>) -> Option<Response> {
    if !keys.check_csrf(&signed.session, csrf) {
        return Some(error_page(
            signed,
            StatusCode::FORBIDDEN,
            "Refused",
            "The form's CSRF token is missing or wrong; nothing was changed. Reload the page and try again.",
        ));
    }
    if signed.session.approver().is_some() {
        return Some(approvers_elsewhere(signed));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::auth::Principal;

    fn signed(principal: Principal) -> Signed {
        Signed {
            session: Session {
                principal,
                operator: Some("op".into()),
                expires: 0,
                id: "s".into(),
            },
            csrf: "c".into(),
        }
    }

    /// Every signed-in route of [`Console::router`], with a sample path.
    const ROUTES: &[(&str, &str)] = &[
        ("POST", "/ui/logout"),
        ("GET", "/ui/overview"),
        ("GET", "/ui/approvals"),
        ("GET", "/ui/approvals/north/a-1"),
        ("POST", "/ui/approvals/north/a-1"),
        ("GET", "/ui/operations"),
        ("GET", "/ui/operations/7"),
        ("POST", "/ui/operations/7/fail"),
        ("POST", "/ui/operations/7/recheck"),
        ("POST", "/ui/operations/7/resolve"),
        ("GET", "/ui/bulk"),
        ("POST", "/ui/bulk"),
        ("GET", "/ui/jobs"),
        ("GET", "/ui/jobs/3"),
        ("POST", "/ui/jobs/3/cancel"),
        ("GET", "/ui/dead-letters"),
        ("POST", "/ui/dead-letters"),
    ];

    #[test]
    fn an_approver_goes_nowhere_but_the_approval_pages() {
        let allowed = [
            ("POST", "/ui/logout"),
            ("GET", "/ui/overview"),
            ("GET", "/ui/approvals"),
            ("GET", "/ui/approvals/north/a-1"),
            ("POST", "/ui/approvals/north/a-1"),
        ];
        for (method, path) in ROUTES {
            let m = Method::from_bytes(method.as_bytes()).unwrap();
            assert_eq!(
                approver_may(&m, path),
                allowed.contains(&(*method, *path)),
                "{method} {path}"
            );
        }
        for (method, path) in [
            ("POST", "/ui/approvals"),
            ("POST", "/ui/overview"),
            ("GET", "/ui/logout"),
            ("PUT", "/ui/approvals/north/a-1"),
            ("DELETE", "/ui/approvals/north/a-1"),
            ("GET", "/ui/approvals/north"),
            ("GET", "/ui/approvals//a-1"),
            ("GET", "/ui/approvals/north/"),
            ("GET", "/ui/approvals/north/a-1/approve"),
            ("GET", "/ui/approvalsx/north/a-1"),
            ("GET", "/ui/operations?x=/ui/approvals/a/b"),
            ("GET", "/ui/jobs"),
        ] {
            let m = Method::from_bytes(method.as_bytes()).unwrap();
            assert!(!approver_may(&m, path), "{method} {path}");
        }
        // Encoded slashes stay inside one segment, as the router reads them.
        assert!(approver_may(&Method::GET, "/ui/approvals/n%2Fs/a%2F1"));
    }

    #[test]
    fn an_approver_reads_no_operation_and_passes_no_other_form() {
        let approver = signed(Principal::Approver("alice".into()));
        assert_eq!(reads(&approver), Err(ApproversOnly));
        assert_eq!(
            approvers_elsewhere(&approver).status(),
            StatusCode::FORBIDDEN
        );
        assert!(reads(&signed(Principal::Admin)).unwrap().is_none());
        let north = signed(Principal::Tenant("north".into()));
        assert_eq!(reads(&north).unwrap(), Some("north"));

        let keys = Keys::new(Some(&"k".repeat(32)), &Tokens::default());
        let (session, _) = keys.issue(Principal::Approver("alice".into()), None, "t", 0, 60);
        let csrf = keys.csrf(&session);
        let approver = Signed {
            session,
            csrf: csrf.clone(),
        };
        let state_keys = keys.clone();
        // With its own, valid CSRF token, an approver's form elsewhere is still refused.
        assert!(state_keys.check_csrf(&approver.session, Some(&csrf)));
        let refused = refuse_form_with(&state_keys, &approver, Some(&csrf)).unwrap();
        assert_eq!(refused.status(), StatusCode::FORBIDDEN);
        let (admin, _) = keys.issue(Principal::Admin, Some("a".into()), "t", 0, 60);
        let admin_csrf = keys.csrf(&admin);
        let admin = Signed {
            session: admin,
            csrf: admin_csrf.clone(),
        };
        assert!(refuse_form_with(&state_keys, &admin, Some(&admin_csrf)).is_none());
        assert!(refuse_form_with(&state_keys, &admin, None).is_some());
    }

    #[test]
    fn an_approvers_nav_shows_only_approvals() {
        let frame =
            |s: &Signed| views::page("t", &s.frame(Nav::Approvals), maud::html! {}).into_string();
        let approver = frame(&signed(Principal::Approver("<alice>".into())));
        assert!(approver.contains("href=\"/ui/approvals\""), "{approver}");
        for other in [
            "/ui/overview",
            "/ui/operations",
            "/ui/jobs",
            "/ui/dead-letters",
        ] {
            assert!(
                !approver.contains(&format!("href=\"{other}\"")),
                "{other}: {approver}"
            );
        }
        assert!(
            approver.contains("approver <strong>&lt;alice&gt;</strong>"),
            "{approver}"
        );
        assert!(approver.contains("action=\"/ui/logout\""), "{approver}");
        let admin = frame(&signed(Principal::Admin));
        for entry in [
            "/ui/overview",
            "/ui/approvals",
            "/ui/operations",
            "/ui/jobs",
            "/ui/dead-letters",
        ] {
            assert!(
                admin.contains(&format!("href=\"{entry}\"")),
                "{entry}: {admin}"
            );
        }
        let tenant = frame(&signed(Principal::Tenant("north".into())));
        assert!(tenant.contains("href=\"/ui/approvals\"") && !tenant.contains("href=\"/ui/jobs\""));
    }
}
