//! `publisher mcp`: the MCP gateway. MCP clients (agent runtimes, desktop and IDE hosts) call
//! the operator's tools; every call becomes an intent keyed by `(tenant, action_id)` and waits
//! for its answer, so an MCP agent gets the worker's guarantees (one dispatch per action, an
//! honest "outcome unknown").
//!
//! Built on the official SDK (`rmcp`): streamable HTTP served statelessly (no session state in
//! the process, so a restarted gateway answers the same clients) behind a bearer-token layer
//! that maps the token to the tenant, or stdio with a fixed tenant. MCP has no idempotency key,
//! so the application supplies the action id in the request `_meta`
//! ([`server::ACTION_ID_META`]); tasks (SEP-2663, `io.modelcontextprotocol/tasks`) use the action
//! key as task id and read their state from the worker's status API, never from memory.
//!
//! # Layout
//! - `tools.rs` ([`tools`]): the gateway's tools file and argument validation.
//! - `server.rs` ([`server`]): the `ServerHandler` ([`Gateway`]).
//! - `answer.rs` ([`answer`]): result events as tool results and task states.
//! - here: the token map, the HTTP and stdio servers.

pub mod answer;
pub mod server;
pub mod tools;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::ServiceExt;

pub use server::{ActionIdMode, Gateway, GatewayConfig, Tenant, ACTION_ID_META};
pub use tools::{ToolCatalog, ToolsError};

/// Why the gateway cannot start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    #[error("PUBLISHER_MCP_TOKENS: {0}")]
    Tokens(String),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("MCP server: {0}")]
    Serve(String),
}

/// Bearer token → tenant (`PUBLISHER_MCP_TOKENS=tenant=token,...`).
#[derive(Clone)]
pub struct TokenMap(Arc<Vec<(String, String)>>);

impl std::fmt::Debug for TokenMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tenants: Vec<&str> = self.0.iter().map(|(t, _)| t.as_str()).collect();
        write!(f, "TokenMap({tenants:?})")
    }
}

/// Tokens shorter than this are refused: they could be guessed.
const MIN_TOKEN_LEN: usize = 16;

impl TokenMap {
    /// Parses `tenant=token,tenant=token`. A tenant may have several tokens (rotation); a
    /// token may not serve two tenants.
    pub fn parse(text: &str) -> Result<TokenMap, McpError> {
        let mut pairs: Vec<(String, String)> = Vec::new();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (tenant, token) = item.split_once('=').ok_or_else(|| {
                McpError::Tokens(format!("{:?} is not tenant=token", redact(item)))
            })?;
            let (tenant, token) = (tenant.trim(), token.trim());
            if tenant.is_empty() || token.len() < MIN_TOKEN_LEN {
                return Err(McpError::Tokens(format!(
                    "tenant {tenant:?}: need a tenant and a token of at least {MIN_TOKEN_LEN} characters"
                )));
            }
            if pairs.iter().any(|(t, k)| k == token && t != tenant) {
                return Err(McpError::Tokens(format!(
                    "one token is given to two tenants (one of them {tenant:?})"
                )));
            }
            pairs.push((tenant.to_owned(), token.to_owned()));
        }
        if pairs.is_empty() {
            return Err(McpError::Tokens("no tenant=token pair".into()));
        }
        Ok(TokenMap(Arc::new(pairs)))
    }

    /// The tenant of `token`. Every configured token is compared, in constant time, so the
    /// answer time does not tell how much of a token matched or which tenant's it is.
    pub fn tenant(&self, token: &str) -> Option<&str> {
        let mut found = None;
        for (tenant, known) in self.0.iter() {
            if constant_time_eq(known.as_bytes(), token.as_bytes()) {
                found = Some(tenant.as_str());
            }
        }
        found
    }
}

fn redact(item: &str) -> String {
    item.chars().take(4).chain("…".chars()).collect()
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The bearer-token layer: 401 without a known token, else the tenant goes into the request's
/// extensions, where the handler reads it (the MCP arguments never name the tenant).
async fn authenticate(
    State(tokens): State<TokenMap>,
    mut request: Request,
    next: Next,
) -> Response {
    let tenant = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .and_then(|token| tokens.tenant(token.trim()))
        .map(|tenant| Tenant(tenant.to_owned()));
    match tenant {
        Some(tenant) => {
            request.extensions_mut().insert(tenant);
            next.run(request).await
        }
        None => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            "a bearer token from PUBLISHER_MCP_TOKENS is required\n",
        )
            .into_response(),
    }
}

/// Serves streamable HTTP on `addr` at `path` (e.g. `/mcp`) until `shutdown` completes.
/// `allowed_hosts` is the `Host` header allow-list (DNS rebinding protection; empty = the
/// SDK's loopback default).
pub async fn serve_http(
    gateway: Gateway,
    tokens: TokenMap,
    addr: SocketAddr,
    path: &str,
    allowed_hosts: Vec<String>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), McpError> {
    let mut config = StreamableHttpServerConfig::default()
        // Stateless: every request stands alone, so a restarted gateway (or another replica)
        // serves the same client without a new handshake.
        .with_legacy_session_mode(false)
        .with_json_response(true);
    if !allowed_hosts.is_empty() {
        config = config.with_allowed_hosts(allowed_hosts);
    }
    let service = StreamableHttpService::new(
        move || Ok(gateway.clone()),
        Arc::new(NeverSessionManager::default()),
        config,
    );
    let router = axum::Router::new()
        .route_service(path, service)
        .layer(axum::middleware::from_fn_with_state(tokens, authenticate));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| McpError::Listen { addr, source })?;
    let local = listener.local_addr().unwrap_or(addr);
    tracing::info!("publisher mcp listening on http://{local}{path}");
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|e| McpError::Serve(e.to_string()))
}

/// Serves one client on stdin/stdout (a local host starts the gateway as a child process).
pub async fn serve_stdio(gateway: Gateway) -> Result<(), McpError> {
    let running = gateway
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| McpError::Serve(e.to_string()))?;
    running
        .waiting()
        .await
        .map_err(|e| McpError::Serve(e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_map() {
        let map =
            TokenMap::parse("north=north-token-0123456789, south=south-token-0123456789").unwrap();
        assert_eq!(map.tenant("north-token-0123456789"), Some("north"));
        assert_eq!(map.tenant("south-token-0123456789"), Some("south"));
        assert_eq!(map.tenant("north-token-012345678"), None);
        assert!(TokenMap::parse("north=short").is_err());
        assert!(TokenMap::parse("a=same-token-0123456789,b=same-token-0123456789").is_err());
        assert!(TokenMap::parse("").is_err());
        assert!(!format!("{map:?}").contains("token-0123"));
    }
}
