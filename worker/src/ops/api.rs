//! The admin and status HTTP API (described in `docs/openapi.yaml`).
//!
//! Authentication is `Authorization: Bearer <token>`, compared in constant time
//! ([`kit::secret`]), by a middleware that runs before any extractor: a missing or wrong token
//! is answered 401 before the request body is read, so it is never buffered. Operator routes
//! refuse a tenant token (403) the same way, before their body.
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

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, Request, State as AxumState};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::de::DeserializeOwned;

use super::actions::{self, ActionResponse, ListParams, OpsError};
use crate::config::auth::{Principal, Tokens};
use crate::context::Context;

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
            }),
            limits: kit::http::Limits::DEFAULT,
            console: None,
        }
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
            // Every route (not the 404 fallback): who is calling is settled before any
            // extractor, so the body of an unauthenticated request is never read.
            .route_layer(middleware::from_fn_with_state(
                self.state.clone(),
                authenticate_request,
            ))
            .with_state(self.state.clone());
        let routes = match &self.console {
            Some(console) => api.merge(console.router()),
            None => api,
        };
        routes.fallback(not_found)
    }

    /// Binds `addr` and serves until `shutdown` resolves.
    pub async fn serve(
        self,
        addr: SocketAddr,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
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

fn authenticate(state: &ApiState, headers: &HeaderMap) -> Result<Principal, ApiError> {
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        })
        .filter(|t| !t.is_empty())
        .ok_or_else(|| ApiError::unauthorized("missing bearer token (Authorization: Bearer …)"))?;
    state
        .tokens
        .identify(presented)
        .ok_or_else(|| ApiError::unauthorized("invalid token"))
}

/// The middleware of every route: 401 without a known token, else the [`Principal`] goes into
/// the request's extensions for the route's own rule. The body is not touched.
async fn authenticate_request(
    AxumState(state): Shared,
    mut request: Request,
    next: Next,
) -> Response {
    match authenticate(&state, request.headers()) {
        Ok(principal) => {
            request.extensions_mut().insert(principal);
            next.run(request).await
        }
        Err(e) => e.into_response(),
    }
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
        None => {
            ApiError::unauthorized("missing bearer token (Authorization: Bearer …)").into_response()
        }
    }
}

fn parse_body<T: DeserializeOwned + Default>(body: &Bytes) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "a JSON body is required",
        ));
    }
    serde_json::from_slice(body).map_err(|e| {
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
    };
    let body = actions::status(&state.ctx.ledger, &tenant, &action_id, with_operation).await?;
    Ok(Json(body).into_response())
}

async fn resolve(
    AxumState(state): Shared,
    Path((tenant, action_id)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let input = parse_body(&body)?;
    let r = actions::resolve(&state.ctx, &tenant, &action_id, input).await?;
    Ok(action_reply(r))
}

async fn fail(
    AxumState(state): Shared,
    Path((tenant, action_id)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let input = parse_body(&body)?;
    let r = actions::fail(&state.ctx, &tenant, &action_id, input).await?;
    Ok(action_reply(r))
}

async fn recheck(
    AxumState(state): Shared,
    Path((tenant, action_id)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let input = parse_body(&body)?;
    let r = actions::recheck(&state.ctx, &tenant, &action_id, input).await?;
    Ok(action_reply(r))
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
}
