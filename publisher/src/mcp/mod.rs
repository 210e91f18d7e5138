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
//! - here: the token map, the HTTP edge (`Origin` allow-list, one `Host`, bearer token) and the
//!   HTTP and stdio servers.

pub mod answer;
pub mod server;
pub mod tools;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::ServiceExt;

pub use server::{
    ActionIdMode, Gateway, GatewayConfig, OutboxDb, Tenant, ACTION_ID_META, COMPENSATES_META,
};
pub use tools::{ToolCatalog, ToolsError};

/// Why the gateway cannot start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    #[error("PUBLISHER_MCP_TOKENS: {0}")]
    Tokens(String),
    #[error("MCP server: {0}")]
    Serve(String),
}

/// Bearer token → tenant (`PUBLISHER_MCP_TOKENS=tenant=token,...`). Only the tokens' SHA-256
/// digests are kept.
#[derive(Clone)]
pub struct TokenMap(Arc<Vec<(String, [u8; 32])>>);

impl std::fmt::Debug for TokenMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tenants: Vec<&str> = self.0.iter().map(|(t, _)| t.as_str()).collect();
        write!(f, "TokenMap({tenants:?})")
    }
}

impl TokenMap {
    /// Parses `tenant=token,tenant=token`. A tenant may have several tokens (rotation); a
    /// token may not serve two tenants.
    pub fn parse(text: &str) -> Result<TokenMap, McpError> {
        let mut pairs: Vec<(String, [u8; 32])> = Vec::new();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (tenant, token) = item.split_once('=').ok_or_else(|| {
                McpError::Tokens(format!("{:?} is not tenant=token", redact(item)))
            })?;
            let (tenant, token) = (tenant.trim(), token.trim());
            if tenant.is_empty() {
                return Err(McpError::Tokens(format!(
                    "{:?}: need a tenant before '='",
                    redact(item)
                )));
            }
            // Tokens shorter than the minimum could be guessed (kit::guard).
            kit::guard::check_token(&format!("the token of tenant {tenant:?}"), token)
                .map_err(McpError::Tokens)?;
            let digest = kit::secret::digest(token.as_bytes());
            if pairs.iter().any(|(t, k)| *k == digest && t != tenant) {
                return Err(McpError::Tokens(format!(
                    "one token is given to two tenants (one of them {tenant:?})"
                )));
            }
            pairs.push((tenant.to_owned(), digest));
        }
        if pairs.is_empty() {
            return Err(McpError::Tokens("no tenant=token pair".into()));
        }
        Ok(TokenMap(Arc::new(pairs)))
    }

    /// The tenant of `token`. The presented token is hashed (SHA-256) and its digest compared
    /// in full with every configured token's, so the answer time tells neither how much of a
    /// token matched, nor its length, nor which tenant's it is.
    pub fn tenant(&self, token: &str) -> Option<&str> {
        let presented = kit::secret::digest(token.as_bytes());
        let mut found = None;
        for (tenant, known) in self.0.iter() {
            if kit::secret::digests_eq(known, &presented) && found.is_none() {
                found = Some(tenant.as_str());
            }
        }
        found
    }
}

fn redact(item: &str) -> String {
    item.chars().take(4).chain("…".chars()).collect()
}

/// The bearer-token layer: 401 without a known token, else the tenant goes into the request's
/// extensions, where the handler reads it (the MCP arguments never name the tenant).
/// What the token check needs: the tokens, and the failure budget of wrong ones.
#[derive(Clone)]
struct Auth {
    tokens: TokenMap,
    budget: Arc<kit::guard::FailureBudget>,
}

/// The bearer token decides the tenant. A missing token is 401; a wrong one is 401, logged
/// (the client's address, never the token) and spends the listener's failure budget
/// ([`kit::guard`]); past the budget a token is answered 429 with `Retry-After`, not compared.
async fn authenticate(State(auth): State<Auth>, mut request: Request, next: Next) -> Response {
    let unauthorized = || {
        (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            "a bearer token from PUBLISHER_MCP_TOKENS is required\n",
        )
            .into_response()
    };
    let Some(token) = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .map(|token| token.trim().to_owned())
    else {
        return unauthorized();
    };
    let client = request
        .extensions()
        .get::<kit::http::Peer>()
        .map_or(std::net::Ipv4Addr::UNSPECIFIED.into(), |p| p.0.ip());
    if let Err(refused) = auth.budget.admit(client) {
        let secs = refused.retry_after.as_secs();
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, secs.to_string())],
            format!("too many wrong tokens; try again in {secs} s\n"),
        )
            .into_response();
    }
    match auth.tokens.tenant(&token) {
        Some(tenant) => {
            auth.budget.forgive(client);
            request.extensions_mut().insert(Tenant(tenant.to_owned()));
            next.run(request).await
        }
        None => {
            tracing::warn!(%client, "MCP gateway: token refused");
            unauthorized()
        }
    }
}

/// Where and how the HTTP transport listens.
#[derive(Debug)]
pub struct HttpOptions {
    /// Bound at start-up ([`kit::http::bind`]): an address that cannot be bound stops it.
    pub listener: std::net::TcpListener,
    /// The MCP endpoint's path (e.g. `/mcp`).
    pub path: String,
    /// The `Host` header allow-list (DNS rebinding protection; empty = the SDK's loopback
    /// default).
    pub allowed_hosts: Vec<String>,
    /// Browser origins allowed to call (`PUBLISHER_MCP_ALLOWED_ORIGINS`).
    pub allowed_origins: AllowedOrigins,
    /// Header and idle timeouts and connection cap of the listener.
    pub limits: kit::http::Limits,
}

/// What the edge guard checks before the token: the `Host` and `Origin` allow-lists.
struct Edge {
    hosts: AllowedHosts,
    origins: AllowedOrigins,
}

/// The `Host` allow-list (`PUBLISHER_MCP_ALLOWED_HOSTS`; empty: the loopback names), checked
/// by the gateway itself as the MCP SDK checks it (a host, or `host:port`), so that a refusal
/// can name the setting.
struct AllowedHosts(Vec<String>);

impl AllowedHosts {
    fn new(entries: &[String]) -> AllowedHosts {
        let entries: Vec<String> = entries
            .iter()
            .map(|e| e.trim().to_ascii_lowercase())
            .filter(|e| !e.is_empty())
            .collect();
        if entries.is_empty() {
            return AllowedHosts(vec!["localhost".into(), "127.0.0.1".into(), "::1".into()]);
        }
        AllowedHosts(entries)
    }

    fn allows(&self, host_header: &str) -> bool {
        let Ok(host) = axum::http::uri::Authority::try_from(host_header) else {
            return false;
        };
        let name = host.host().trim_matches(['[', ']']).to_ascii_lowercase();
        self.0.iter().any(
            |entry| match axum::http::uri::Authority::try_from(entry.as_str()) {
                Ok(a) => {
                    a.host().trim_matches(['[', ']']) == name
                        && a.port_u16().is_none_or(|p| host.port_u16() == Some(p))
                }
                Err(_) => entry.trim_matches(['[', ']']) == name,
            },
        )
    }
}

/// The `Origin` allow-list. A request without `Origin` (a non-browser client) is always
/// served; one with an `Origin` is served only when the origin matches an entry, so an empty
/// list refuses every browser origin. Entries are `scheme://host[:port]`, where a missing port
/// means the scheme's default (80, 443) and `:*` any port (`http://localhost:*`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowedOrigins(Vec<OriginPattern>);

#[derive(Debug, Clone, PartialEq, Eq)]
struct OriginPattern {
    scheme: String,
    host: String,
    /// None: any port.
    port: Option<u16>,
}

/// An origin (`scheme://host[:port]`) as compared: lower case, the scheme's default port
/// filled in (None for a scheme without one).
fn parse_origin(text: &str) -> Option<(String, String, Option<u16>)> {
    let (scheme, rest) = text.trim().split_once("://")?;
    let scheme = scheme.to_ascii_lowercase();
    if scheme.is_empty() || rest.is_empty() || rest.contains(['/', '?', '#', '@']) {
        return None;
    }
    let authority = axum::http::uri::Authority::try_from(rest).ok()?;
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase();
    if host.is_empty() {
        return None;
    }
    let port = authority.port_u16().or(match scheme.as_str() {
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    });
    Some((scheme, host, port))
}

impl AllowedOrigins {
    /// Parses the entries of `PUBLISHER_MCP_ALLOWED_ORIGINS` (blank ones are skipped).
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<AllowedOrigins, String> {
        let mut patterns = Vec::new();
        for entry in entries
            .iter()
            .map(|e| e.as_ref().trim())
            .filter(|e| !e.is_empty())
        {
            let (text, any_port) = match entry.strip_suffix(":*") {
                Some(base) => (base, true),
                None => (entry, false),
            };
            let (scheme, host, port) = parse_origin(text).ok_or_else(|| {
                format!("{entry:?} is not an origin (scheme://host[:port], or :* for any port)")
            })?;
            if any_port
                && text
                    .rsplit_once(':')
                    .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
            {
                return Err(format!("{entry:?}: a port and :* together"));
            }
            patterns.push(OriginPattern {
                scheme,
                host,
                port: if any_port { None } else { port },
            });
        }
        Ok(AllowedOrigins(patterns))
    }

    /// Whether a request with this `Origin` header value may be served.
    pub fn allows(&self, origin: &str) -> bool {
        let Some((scheme, host, port)) = parse_origin(origin) else {
            return false;
        };
        self.0
            .iter()
            .any(|p| p.scheme == scheme && p.host == host && (p.port.is_none() || p.port == port))
    }
}

/// The HTTP edge, before the token is even looked at: more than one `Host` header, or an
/// absolute-form request URI whose authority is not the `Host`, answers 400 (a proxy and this
/// gateway could disagree on which host was meant); an `Origin` not on the allow-list answers
/// 403 (the MCP streamable HTTP transport requires servers to validate it: a web page must not
/// drive a local gateway).
async fn edge_guard(State(edge): State<Arc<Edge>>, request: Request, next: Next) -> Response {
    let origins = &edge.origins;
    let bad = |why: &'static str| (StatusCode::BAD_REQUEST, why).into_response();
    let hosts: Vec<&axum::http::HeaderValue> =
        request.headers().get_all(header::HOST).iter().collect();
    if hosts.len() > 1 {
        tracing::warn!("refused a request with {} Host headers", hosts.len());
        return bad("Bad Request: more than one Host header\n");
    }
    if let Some(authority) = request.uri().authority() {
        let default = match request.uri().scheme_str() {
            Some("https") => 443,
            _ => 80,
        };
        let uri_side = (
            authority.host().to_ascii_lowercase(),
            authority.port_u16().unwrap_or(default),
        );
        let host_side = hosts
            .first()
            .and_then(|h| h.to_str().ok())
            .and_then(|h| axum::http::uri::Authority::try_from(h).ok())
            .map(|a| {
                (
                    a.host().to_ascii_lowercase(),
                    a.port_u16().unwrap_or(default),
                )
            });
        if host_side.as_ref() != Some(&uri_side) {
            tracing::warn!(uri = %request.uri(), "refused an absolute-form request for another host than its Host header");
            return bad("Bad Request: the request URI names another host than the Host header\n");
        }
    }
    let host = hosts.first().and_then(|h| h.to_str().ok()).unwrap_or("");
    if !edge.hosts.allows(host) {
        tracing::warn!(
            host,
            "refused a request for a Host not in PUBLISHER_MCP_ALLOWED_HOSTS"
        );
        return (
            StatusCode::FORBIDDEN,
            "Forbidden: this Host is not in PUBLISHER_MCP_ALLOWED_HOSTS (default: localhost, \
             127.0.0.1, ::1); add the name clients use to reach the gateway\n",
        )
            .into_response();
    }
    if let Some(origin) = request.headers().get(header::ORIGIN) {
        let allowed = origin.to_str().is_ok_and(|o| origins.allows(o));
        if !allowed {
            tracing::warn!(origin = ?origin, "refused a request from an origin not on PUBLISHER_MCP_ALLOWED_ORIGINS");
            return (
                StatusCode::FORBIDDEN,
                "Forbidden: this Origin is not in PUBLISHER_MCP_ALLOWED_ORIGINS\n",
            )
                .into_response();
        }
    }
    next.run(request).await
}

/// Serves streamable HTTP as `options` say until `shutdown` completes.
pub async fn serve_http(
    gateway: Gateway,
    tokens: TokenMap,
    options: HttpOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), McpError> {
    let HttpOptions {
        listener,
        path,
        allowed_hosts,
        allowed_origins,
        limits,
    } = options;
    let path = path.as_str();
    let mut config = StreamableHttpServerConfig::default()
        // Stateless: every request stands alone, so a restarted gateway (or another replica)
        // serves the same client without a new handshake.
        .with_legacy_session_mode(false)
        .with_json_response(true);
    let edge = Edge {
        hosts: AllowedHosts::new(&allowed_hosts),
        origins: allowed_origins,
    };
    if !allowed_hosts.is_empty() {
        config = config.with_allowed_hosts(allowed_hosts);
    }
    let service = StreamableHttpService::new(
        move || Ok(gateway.clone()),
        Arc::new(NeverSessionManager::default()),
        config,
    );
    // The token is checked before the body is read (the service reads it), and the edge
    // guard runs before both (the outer layer).
    let router = axum::Router::new()
        .route_service(path, service)
        .layer(axum::middleware::from_fn_with_state(
            Auth {
                tokens,
                budget: Arc::new(kit::guard::FailureBudget::default()),
            },
            authenticate,
        ))
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(edge),
            edge_guard,
        ));
    let listener = tokio::net::TcpListener::from_std(listener)
        .map_err(|e| McpError::Serve(format!("cannot serve the bound listener: {e}")))?;
    let local = listener
        .local_addr()
        .map_err(|e| McpError::Serve(e.to_string()))?;
    tracing::info!("publisher mcp listening on http://{local}{path}");
    kit::http::serve(listener, router, limits, shutdown)
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
    fn hosts_are_allowed_as_the_sdk_allows_them() {
        let loopback = AllowedHosts::new(&[]);
        for host in ["localhost", "127.0.0.1:9470", "[::1]:9470", "LOCALHOST:1"] {
            assert!(loopback.allows(host), "{host}");
        }
        for host in ["mcp.example.com", "127.0.0.2", "", "a b"] {
            assert!(!loopback.allows(host), "{host}");
        }
        let listed = AllowedHosts::new(&["mcp.example.com".into(), "gw.internal:8443".into()]);
        assert!(listed.allows("mcp.example.com:443"));
        assert!(listed.allows("gw.internal:8443"));
        assert!(!listed.allows("gw.internal:9000"));
        assert!(!listed.allows("localhost"));
    }

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

    #[test]
    fn tokens_are_kept_and_compared_as_sha256_digests() {
        let map = TokenMap::parse("north=north-token-0123456789").unwrap();
        // Only the digest is stored.
        assert_eq!(map.0[0].1, kit::secret::digest(b"north-token-0123456789"));
        // Longer, shorter, a prefix, a different last byte, empty: no match, and none of them
        // is rejected by a length check first (the digests have one length).
        for guess in [
            "north-token-0123456789-and-more",
            "north-token",
            "north-token-012345678",
            "north-token-012345678X",
            "",
        ] {
            assert_eq!(map.tenant(guess), None, "{guess:?}");
        }
        assert_eq!(map.tenant("north-token-0123456789"), Some("north"));
    }

    #[test]
    fn origins_match_scheme_host_and_port() {
        let list = AllowedOrigins::parse(&["https://app.example.com", " http://localhost:* ", ""])
            .unwrap();
        assert!(list.allows("https://app.example.com"));
        assert!(list.allows("https://APP.example.com:443"));
        assert!(!list.allows("https://app.example.com:8443"));
        assert!(!list.allows("http://app.example.com"));
        assert!(list.allows("http://localhost:5173"));
        assert!(list.allows("http://localhost"));
        assert!(!list.allows("https://localhost:5173"));
        assert!(!list.allows("null"));
        assert!(!list.allows("http://localhost.evil.example"));
        assert!(!AllowedOrigins::default().allows("http://localhost:5173"));
        let list = AllowedOrigins::parse(&["http://[::1]:*"]).unwrap();
        assert!(list.allows("http://[::1]:3000"));
        for bad in ["localhost", "http://", "http://a/b", "http://a:1:*", "*"] {
            assert!(AllowedOrigins::parse(&[bad]).is_err(), "{bad}");
        }
    }
}
