//! The admin and status HTTP API (described in `docs/openapi.yaml`).
//!
//! Authentication is `Authorization: Bearer <token>`, compared in constant time
//! ([`kit::secret`]), by a middleware that runs before any extractor: a missing or wrong token
//! is answered 401 before the request body is read, so it is never buffered. Operator routes
//! refuse a tenant token (403) the same way, before their body. Wrong tokens draw on the
//! listener's failure budget ([`kit::guard`], shared with the console's sign-in): each is
//! logged (the client's address, never the token), and once a client's or everyone's budget is
//! spent a token is answered `429` with `Retry-After` without being compared.
//!
//! Every answer carries `Cache-Control: no-store` and `X-Content-Type-Options: nosniff` (they
//! hold arguments and receipts), and every error, including a body over the size cap (`413`)
//! and a body too slow to arrive (`408`, [`kit::http`]), has the JSON shape
//! `{"error": code, "message": text}`.
//! - the admin token (`WORKER_ADMIN_TOKEN`) may use every route;
//! - a tenant token (`WORKER_TENANT_TOKENS`) may only read the status of its own tenant's
//!   operations (`GET /v1/operations/{tenant}/{action_id}`); another tenant's operation answers
//!   404, exactly like one that does not exist.
//!
//! The operator console ([`crate::console`], under `/ui`) is served beside these routes when it
//! is enabled; it has its own sign-in (a session cookie) and never accepts a bearer token.
//!
//! Routes:
//! - `GET  /v1/operations` — unresolved operations, filtered and paginated (admin)
//! - `GET  /v1/operations/{tenant}/{action_id}` — the result event now (admin adds `operation`)
//! - `POST /v1/operations/{tenant}/{action_id}/resolve` — `succeeded` with a matching receipt
//! - `POST /v1/operations/{tenant}/{action_id}/fail` — `failed` with written evidence
//! - `POST /v1/operations/{tenant}/{action_id}/recheck` — one recovery round now
//! - `POST /v1/callbacks/{tool}` — a long-running tool's signed completion callback
//!   ([`super::callback`]): no bearer token, the tool's signature instead; wrong signatures
//!   draw on the same failure budget as wrong tokens

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Path, Query, Request, State as AxumState};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::de::DeserializeOwned;

use super::actions::{self, ActionResponse, ListParams, OpsError};
use super::approvals;
use super::callback;
use crate::config::auth::{Principal, Tokens};
use crate::context::Context;
use kit::guard::FailureBudget;
use kit::http::Peer;

/// The API server: the worker context, the tokens it accepts, its listener's limits and the
/// console, when served.
pub struct AdminApi {
    state: Arc<ApiState>,
    limits: kit::http::Limits,
    console: Option<crate::console::Console>,
}

struct ApiState {
    ctx: Arc<Context>,
    tokens: Tokens,
    /// Wrong tokens taken, per client and overall (shared with the console's sign-in).
    budget: Arc<FailureBudget>,
}

impl AdminApi {
    /// An API with the admin token and tenant read tokens.
    pub fn new(
        ctx: Arc<Context>,
        token: String,
        tenant_tokens: BTreeMap<String, String>,
    ) -> AdminApi {
        AdminApi::with_tokens(ctx, Some(token), tenant_tokens)
    }

    /// An API whose admin token is optional: without one only the tenant status route can be
    /// used (admin routes answer 401 to everyone).
    pub fn with_tokens(
        ctx: Arc<Context>,
        admin_token: Option<String>,
        tenant_tokens: BTreeMap<String, String>,
    ) -> AdminApi {
        AdminApi {
            state: Arc::new(ApiState {
                ctx,
                tokens: Tokens::new(admin_token, tenant_tokens),
                budget: Arc::new(FailureBudget::default()),
            }),
            limits: kit::http::Limits::DEFAULT,
            console: None,
        }
    }

    /// Accepts these approvers' tokens (name -> token) on the approval routes. Call before the
    /// API is served.
    pub fn with_approvers(mut self, approvers: BTreeMap<String, String>) -> AdminApi {
        match Arc::get_mut(&mut self.state) {
            Some(state) => state.tokens = state.tokens.clone().with_approvers(approvers),
            None => unreachable!("approvers are set before the API is shared"),
        }
        self
    }

    /// The failure budget of wrong tokens on this listener, for the console's sign-in to share.
    pub fn budget(&self) -> Arc<FailureBudget> {
        self.state.budget.clone()
    }

    /// Serves the operator console under `/ui` too.
    pub fn with_console(mut self, console: crate::console::Console) -> AdminApi {
        self.console = Some(console);
        self
    }

    /// The listener's header and idle timeouts and connection cap (default
    /// [`kit::http::Limits::DEFAULT`]).
    pub fn with_limits(mut self, limits: kit::http::Limits) -> AdminApi {
        self.limits = limits;
        self
    }

    /// The routes, for embedding or testing.
    pub fn router(&self) -> Router {
        let admin = || middleware::from_fn(admin_only);
        let api = Router::new()
            .route("/v1/operations", get(list).route_layer(admin()))
            .route("/v1/operations/{tenant}/{action_id}", get(status))
            .route(
                "/v1/operations/{tenant}/{action_id}/resolve",
                post(resolve).route_layer(admin()),
            )
            .route(
                "/v1/operations/{tenant}/{action_id}/fail",
                post(fail).route_layer(admin()),
            )
            .route(
                "/v1/operations/{tenant}/{action_id}/recheck",
                post(recheck).route_layer(admin()),
            )
            // Approver tokens here only; every token may list what waits (a tenant its own).
            .route("/v1/approvals", get(awaiting))
            .route("/v1/operations/{tenant}/{action_id}/approve", post(approve))
            .route("/v1/operations/{tenant}/{action_id}/reject", post(reject))
            // Every route (not the 404 fallback): who is calling is settled before any
            // extractor, so the body of an unauthenticated request is never read.
            .route_layer(middleware::from_fn_with_state(
                self.state.clone(),
                authenticate_request,
            ))
            .with_state(self.state.clone());
        // Signed by the downstream, not authenticated by a token: beside the layer above.
        let api = api.merge(
            Router::new()
                .route("/v1/callbacks/{tool}", post(callback))
                .with_state(self.state.clone()),
        );
        let api = api
            .layer(middleware::from_fn(refuse_large_bodies))
            .layer(middleware::map_response(private_answer));
        let routes = match &self.console {
            Some(console) => api.merge(console.router()),
            None => api,
        };
        routes.fallback(not_found)
    }

    /// Serves on `listener` (bound at start-up: [`kit::http::bind`]) until `shutdown` resolves.
    pub async fn serve(
        self,
        listener: std::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        self.serve_listener(listener, shutdown).await
    }

    /// Serves on a bound listener (tests bind port 0 and read the address first).
    pub async fn serve_listener(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        tracing::info!(
            addr = %listener.local_addr()?,
            admin = self.state.tokens.admin.is_some(),
            tenants = self.state.tokens.tenants.len(),
            console = self.console.is_some(),
            "admin API listening"
        );
        kit::http::serve(listener, self.router(), self.limits, shutdown).await
    }
}

/// An error answer: `{"error": code, "message": text, "state": current state or absent}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    state: Option<String>,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            state: None,
        }
    }

    fn unauthorized(message: &str) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    /// A token not compared because the failure budget is spent.
    fn too_many(refused: kit::guard::Refused) -> Response {
        let who = match refused.scope {
            kit::guard::Scope::Client => "from this client",
            kit::guard::Scope::Overall => "on this listener",
        };
        let mut response = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_requests",
            format!(
                "too many wrong tokens {who}; try again in {} s",
                refused.retry_after.as_secs()
            ),
        )
        .into_response();
        if let Ok(v) = HeaderValue::from_str(&refused.retry_after.as_secs().to_string()) {
            response.headers_mut().insert(header::RETRY_AFTER, v);
        }
        response
    }

    fn not_found() -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such operation")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = serde_json::json!({ "error": self.code, "message": self.message });
        if let Some(state) = self.state {
            body["state"] = serde_json::Value::String(state);
        }
        let mut response = (self.status, Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<OpsError> for ApiError {
    fn from(e: OpsError) -> ApiError {
        match e {
            OpsError::BadRequest(m) => ApiError::new(StatusCode::BAD_REQUEST, "bad_request", m),
            OpsError::NotFound { .. } => ApiError::not_found(),
            OpsError::Conflict { message, state } => ApiError {
                status: StatusCode::CONFLICT,
                code: "conflict",
                message,
                state: state.map(|s| s.as_str().to_string()),
            },
            e @ OpsError::ReceiptMismatch(_) => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "receipt_mismatch",
                e.to_string(),
            ),
            e @ OpsError::ToolNotConfigured(_) => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "tool_not_configured",
                e.to_string(),
            ),
            OpsError::Ledger(e) => {
                tracing::error!(error = %e, "admin API: ledger error");
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "the ledger could not answer; see the worker logs",
                )
            }
        }
    }
}

/// The bearer token of a request, if it has one.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        })
        .filter(|t| !t.is_empty())
}

/// Who the request's token speaks for, drawing on the failure budget: a missing token is 401
/// (not a guess), a spent budget 429 before the token is compared, a wrong token 401 and
/// logged, its failure kept spent (a good one gives it back).
fn authenticate(state: &ApiState, request: &Request) -> Result<Principal, Box<Response>> {
    let Some(presented) = bearer(request.headers()) else {
        return Err(Box::new(
            ApiError::unauthorized("missing bearer token (Authorization: Bearer …)")
                .into_response(),
        ));
    };
    let client = request
        .extensions()
        .get::<Peer>()
        .map(|p| p.0.ip())
        .unwrap_or(std::net::Ipv4Addr::UNSPECIFIED.into());
    state
        .budget
        .admit(client)
        .map_err(|r| Box::new(ApiError::too_many(r)))?;
    match state.tokens.identify(presented) {
        Some(principal) => {
            state.budget.forgive(client);
            Ok(principal)
        }
        None => {
            tracing::warn!(%client, path = request.uri().path(), "admin API: token refused");
            Err(Box::new(
                ApiError::unauthorized("invalid token").into_response(),
            ))
        }
    }
}

/// The middleware of every route: 401 without a known token, else the [`Principal`] goes into
/// the request's extensions for the route's own rule. The body is not touched.
async fn authenticate_request(
    AxumState(state): Shared,
    mut request: Request,
    next: Next,
) -> Response {
    match authenticate(&state, &request) {
        Ok(principal) => {
            request.extensions_mut().insert(principal);
            next.run(request).await
        }
        Err(refused) => *refused,
    }
}

/// The largest request body the API reads (axum's default body limit).
const MAX_BODY_BYTES: usize = 2 * 1024 * 1024;

/// A body announced larger than [`MAX_BODY_BYTES`] is refused `413` before any of it is kept
/// (after the token, which comes first); what the client still sends is read and discarded
/// ([`kit::http::linger`]), so it reads the `413`.
async fn refuse_large_bodies(request: Request, next: Next) -> Response {
    if kit::http::announces_more_than(request.headers(), MAX_BODY_BYTES) {
        kit::http::linger(request.into_body());
        return ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("the request body is over {MAX_BODY_BYTES} bytes"),
        )
        .into_response();
    }
    next.run(request).await
}

/// Every API answer: not to be cached or sniffed (they hold arguments and receipts).
async fn private_answer(mut response: Response) -> Response {
    let h = response.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
}

/// The middleware of the operator routes (after [`authenticate_request`]): 403 for a tenant
/// token, before the body is read.
async fn admin_only(request: Request, next: Next) -> Response {
    match request.extensions().get::<Principal>() {
        Some(Principal::Admin) => next.run(request).await,
        Some(Principal::Tenant(_)) => ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "a tenant token may only read its own operations' status",
        )
        .into_response(),
        Some(Principal::Approver(_)) => approver_elsewhere().into_response(),
        None => {
            ApiError::unauthorized("missing bearer token (Authorization: Bearer …)").into_response()
        }
    }
}

/// An approver token on a route that is not an approval route.
fn approver_elsewhere() -> ApiError {
    ApiError::new(
        StatusCode::FORBIDDEN,
        "forbidden",
        "an approver token may only list, approve and reject intents that wait for approval",
    )
}

/// The request body, or its rejection in the JSON error shape (413 over the size cap).
fn body_of(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let status = e.status();
        let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "payload_too_large"
        } else {
            "bad_request"
        };
        ApiError::new(status, code, e.body_text())
    })
}

fn parse_body<T: DeserializeOwned + Default>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let body = body_of(body)?;
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "a JSON body is required",
        ));
    }
    serde_json::from_slice(&body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("invalid JSON body: {e}"),
        )
    })
}

fn action_reply(r: ActionResponse) -> Response {
    (StatusCode::OK, Json(r.body)).into_response()
}

type Shared = AxumState<Arc<ApiState>>;

async fn list(
    AxumState(state): Shared,
    query: Result<Query<ListParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(params) = query.map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("invalid query: {}", e.body_text()),
        )
    })?;
    let page = actions::list(&state.ctx.ledger, params).await?;
    Ok(Json(page).into_response())
}

async fn status(
    AxumState(state): Shared,
    Extension(principal): Extension<Principal>,
    Path((tenant, action_id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let with_operation = match principal {
        Principal::Admin => true,
        // Another tenant's operation is indistinguishable from a missing one.
        Principal::Tenant(own) if own == tenant => false,
        Principal::Tenant(_) => return Err(ApiError::not_found()),
        Principal::Approver(_) => return Err(approver_elsewhere()),
    };
    let body = actions::status(&state.ctx.ledger, &tenant, &action_id, with_operation).await?;
    Ok(Json(body).into_response())
}

async fn resolve(
    AxumState(state): Shared,
    Path((tenant, action_id)): Path<(String, String)>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let input = parse_body(body)?;
    let r = actions::resolve(&state.ctx, &tenant, &action_id, input).await?;
    Ok(action_reply(r))
}

async fn fail(
    AxumState(state): Shared,
    Path((tenant, action_id)): Path<(String, String)>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let input = parse_body(body)?;
    let r = actions::fail(&state.ctx, &tenant, &action_id, input).await?;
    Ok(action_reply(r))
}

async fn recheck(
    AxumState(state): Shared,
    Path((tenant, action_id)): Path<(String, String)>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let input = parse_body(body)?;
    let r = actions::recheck(&state.ctx, &tenant, &action_id, input).await?;
    Ok(action_reply(r))
}

/// Query of `GET /v1/approvals`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct AwaitingParams {
    tenant: Option<String>,
    limit: Option<i64>,
}

/// The intents waiting for approval: every tenant's for an approver or the admin token, its
/// own for a tenant token (another tenant asked for is an empty list, as if none waited).
async fn awaiting(
    AxumState(state): Shared,
    Extension(caller): Extension<Principal>,
    query: Result<Query<AwaitingParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(params) = query.map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("invalid query: {}", e.body_text()),
        )
    })?;
    let tenant = match &caller {
        Principal::Tenant(own) => {
            if params.tenant.as_ref().is_some_and(|t| t != own) {
                return Ok(Json(serde_json::json!({ "items": [] })).into_response());
            }
            Some(own.clone())
        }
        _ => params.tenant,
    };
    let items = approvals::awaiting(&state.ctx, tenant.as_deref(), params.limit).await?;
    Ok(Json(serde_json::json!({ "items": items })).into_response())
}

async fn approve(
    state: Shared,
    caller: Extension<Principal>,
    path: Path<(String, String)>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    decide(state, caller, path, body, approvals::Decision::Approve).await
}

async fn reject(
    state: Shared,
    caller: Extension<Principal>,
    path: Path<(String, String)>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    decide(state, caller, path, body, approvals::Decision::Reject).await
}

/// Approve or reject: an approver token only, whose name is the decider's (a name in the body
/// is refused); the body names the fingerprint the approver was shown.
async fn decide(
    AxumState(state): Shared,
    Extension(caller): Extension<Principal>,
    Path((tenant, action_id)): Path<(String, String)>,
    body: Result<Bytes, BytesRejection>,
    decision: approvals::Decision,
) -> Result<Response, ApiError> {
    let Principal::Approver(name) = caller else {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "approving or rejecting takes an approver token (WORKER_APPROVER_TOKENS): the decision is recorded under the token's name",
        ));
    };
    let mut input: approvals::DecisionInput = parse_body(body)?;
    if input.operator.is_some() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "operator is the approver token's name; leave it out of the body",
        ));
    }
    input.operator = Some(name);
    let r = approvals::decide(
        &state.ctx,
        &tenant,
        &action_id,
        decision,
        input,
        approvals::Fingerprint::Required,
    )
    .await?;
    Ok(action_reply(r))
}

/// A completion callback: the failure budget first (a wrong signature is a guess like a wrong
/// token), the tool's body cap before the body is read, the signature before the body is
/// believed; then [`callback::receive`]. Every refusal is logged with the client's address.
async fn callback(
    AxumState(state): Shared,
    Path(tool): Path<String>,
    peer: Option<Extension<Peer>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let client = peer
        .map(|Extension(p)| p.0.ip())
        .unwrap_or(std::net::Ipv4Addr::UNSPECIFIED.into());
    let refuse = |e: callback::CallbackError| {
        callback::refused(&tool, &e);
        tracing::warn!(
            %client, tool = %kit::text::visible(&tool), reason = %e,
            "completion callback refused"
        );
        callback_error(&e)
    };
    // What is not a guess at the secret (no such tool, too large, unsigned) spends nothing of
    // the failure budget.
    let settings = match callback::settings(&state.ctx, &tool) {
        Ok(s) => s,
        Err(e) => return refuse(e),
    };
    let too_large = || callback::CallbackError::TooLarge {
        tool: tool.clone(),
        max: settings.max_body_bytes,
    };
    if kit::http::announces_more_than(&headers, settings.max_body_bytes) {
        kit::http::linger(body);
        return refuse(too_large());
    }
    if !headers.contains_key(settings.signature_header.as_str()) {
        return refuse(callback::CallbackError::MissingSignature(
            settings.signature_header.clone(),
        ));
    }
    if let Err(refused) = state.budget.admit(client) {
        callback::throttled(&tool);
        tracing::warn!(
            %client, tool = %kit::text::visible(&tool),
            "completion callback refused: too many wrong signatures"
        );
        return ApiError::too_many(refused);
    }
    let body = match axum::body::to_bytes(body, settings.max_body_bytes).await {
        Ok(b) => b,
        Err(_) => {
            state.budget.forgive(client);
            return refuse(too_large());
        }
    };
    if let Err(e) = callback::verify(
        &tool,
        settings,
        &headers,
        &body,
        std::time::SystemTime::now(),
    ) {
        return refuse(e);
    }
    state.budget.forgive(client);
    match callback::receive(&state.ctx, &tool, &body).await {
        Ok(answer) => (StatusCode::OK, Json(answer)).into_response(),
        Err(e) => {
            tracing::warn!(tool = %tool, reason = %e, "completion callback changed nothing");
            callback_error(&e)
        }
    }
}

/// A refused callback's answer: the JSON error shape, without the bearer challenge.
fn callback_error(e: &callback::CallbackError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_REQUEST);
    let body = serde_json::json!({ "error": e.code(), "message": e.to_string() });
    (status, Json(body)).into_response()
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
}
