//! Who may act for or read a tenant, as configured: the tools file's `[auth]` section (the
//! tenant proof, [`TenantAuth`], applied by intake), the tenant read tokens of the status API
//! (`WORKER_TENANT_TOKENS`), the admin token's minimum length, the console's signing secret, and
//! which [`Principal`] a presented token names ([`Tokens::identify`], shared by the API and the
//! console). Token values are never echoed in an error.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use super::ConfigError;
use crate::intake::TenantAuth;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAuth {
    /// "user_id": the broker-validated AMQP user_id must be mapped to the intent's tenant.
    mode: String,
    #[serde(default)]
    users: BTreeMap<String, Vec<String>>,
}

/// The tenant proof the `[auth]` section asks for (none: the tenant field is trusted).
pub(super) fn tenant_auth(path: &Path, raw: Option<RawAuth>) -> Result<TenantAuth, ConfigError> {
    match raw {
        None => Ok(TenantAuth::Trusted),
        Some(a) if a.mode == "trusted" => Ok(TenantAuth::Trusted),
        Some(a) if a.mode == "user_id" => Ok(TenantAuth::UserId { users: a.users }),
        Some(a) => Err(ConfigError::ToolsInvalid {
            path: path.to_path_buf(),
            reason: format!("auth.mode {:?}: expected trusted or user_id", a.mode),
        }),
    }
}

/// The admin token, if set (blank counts as unset): at least [`kit::guard::MIN_TOKEN_CHARS`]
/// characters, without whitespace.
pub(super) fn admin_token(raw: Option<String>) -> Result<Option<String>, ConfigError> {
    let token = raw.filter(|t| !t.trim().is_empty());
    if let Some(t) = &token {
        kit::guard::check_token("WORKER_ADMIN_TOKEN", t).map_err(|reason| {
            ConfigError::Invalid {
                name: "WORKER_ADMIN_TOKEN",
                value: "<redacted>".into(),
                reason,
            }
        })?;
    }
    Ok(token)
}

/// Parses `tenant=token,tenant2=token2`: tokens of at least [`kit::guard::MIN_TOKEN_CHARS`]
/// characters (guessing one is then hopeless within the failure budget, [`kit::guard`]).
pub(super) fn parse_tenant_tokens(
    raw: Option<String>,
) -> Result<BTreeMap<String, String>, ConfigError> {
    parse_named_tokens(raw, "WORKER_TENANT_TOKENS", "tenant")
}

/// Parses `name=token,name2=token2` (`WORKER_APPROVER_TOKENS`): each approver's token, whose
/// name is what the history records for their approvals, so it follows the rules of an
/// operator's name.
pub(super) fn parse_approver_tokens(
    raw: Option<String>,
) -> Result<BTreeMap<String, String>, ConfigError> {
    let map = parse_named_tokens(raw, "WORKER_APPROVER_TOKENS", "approver")?;
    for name in map.keys() {
        crate::ops::actions::check_operator_name(name).map_err(|reason| ConfigError::Invalid {
            name: "WORKER_APPROVER_TOKENS",
            value: "<redacted>".into(),
            reason: format!("approver {name:?}: {reason}"),
        })?;
    }
    Ok(map)
}

fn parse_named_tokens(
    raw: Option<String>,
    var: &'static str,
    what: &str,
) -> Result<BTreeMap<String, String>, ConfigError> {
    let mut map = BTreeMap::new();
    for pair in raw.iter().flat_map(|r| r.split(',')).map(str::trim) {
        if pair.is_empty() {
            continue;
        }
        match pair.split_once('=') {
            Some((t, tok)) if !t.trim().is_empty() => {
                let tenant = t.trim();
                kit::guard::check_token(&format!("the token of {what} {tenant:?}"), tok.trim())
                    .map_err(|reason| ConfigError::Invalid {
                        name: var,
                        value: "<redacted>".into(),
                        reason,
                    })?;
                map.insert(tenant.to_string(), tok.trim().to_string());
            }
            _ => {
                return Err(ConfigError::Invalid {
                    name: var,
                    value: "<redacted>".into(),
                    reason: format!(
                        "expected {what}=token pairs separated by commas, tokens of {}+ characters",
                        kit::guard::MIN_TOKEN_CHARS
                    ),
                })
            }
        }
    }
    Ok(map)
}

/// The console's signing secret, if set (blank counts as unset): at least 32 characters.
pub(super) fn console_secret(raw: Option<String>) -> Result<Option<String>, ConfigError> {
    let secret = raw.filter(|t| !t.trim().is_empty());
    if secret.as_ref().is_some_and(|t| t.chars().count() < 32) {
        return Err(ConfigError::Invalid {
            name: "WORKER_CONSOLE_SECRET",
            value: "<redacted>".into(),
            reason: "must be at least 32 characters".into(),
        });
    }
    Ok(secret)
}

/// Who a token (or a console session) speaks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// `WORKER_ADMIN_TOKEN`: every route and action.
    Admin,
    /// A `WORKER_TENANT_TOKENS` token: reads of its own tenant only.
    Tenant(String),
    /// A `WORKER_APPROVER_TOKENS` token: the approval routes only (list what waits, approve,
    /// reject), every decision recorded under this name.
    Approver(String),
}

/// The tokens the admin listener accepts: the admin token and the tenant read tokens.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    pub admin: Option<String>,
    pub tenants: BTreeMap<String, String>,
    /// Approver name -> token.
    pub approvers: BTreeMap<String, String>,
}

impl Tokens {
    /// The tokens, without blank ones.
    pub fn new(admin: Option<String>, tenants: BTreeMap<String, String>) -> Tokens {
        Tokens {
            admin: admin.filter(|t| !t.is_empty()),
            tenants: tenants.into_iter().filter(|(_, t)| !t.is_empty()).collect(),
            approvers: BTreeMap::new(),
        }
    }

    /// The tokens with these approvers' (name -> token), without blank ones.
    pub fn with_approvers(mut self, approvers: BTreeMap<String, String>) -> Tokens {
        self.approvers = approvers
            .into_iter()
            .filter(|(_, t)| !t.is_empty())
            .collect();
        self
    }

    /// Who `presented` is the token of. Every configured token is compared in constant time
    /// ([`kit::secret`]), whatever matched first, so the answer time does not tell which
    /// token came close.
    pub fn identify(&self, presented: &str) -> Option<Principal> {
        let eq = |t: &str| kit::secret::constant_time_eq(t.as_bytes(), presented.as_bytes());
        let admin = self.admin.as_deref().is_some_and(eq);
        let mut tenant = None;
        for (name, token) in &self.tenants {
            if eq(token) && tenant.is_none() {
                tenant = Some(name.clone());
            }
        }
        let mut approver = None;
        for (name, token) in &self.approvers {
            if eq(token) && approver.is_none() {
                approver = Some(name.clone());
            }
        }
        match (admin, tenant, approver) {
            (true, _, _) => Some(Principal::Admin),
            (false, Some(t), _) => Some(Principal::Tenant(t)),
            (false, None, Some(a)) => Some(Principal::Approver(a)),
            (false, None, None) => None,
        }
    }

    /// The token a principal signs in with now (None once it was removed).
    pub fn token_of(&self, principal: &Principal) -> Option<&str> {
        match principal {
            Principal::Admin => self.admin.as_deref(),
            Principal::Tenant(t) => self.tenants.get(t).map(String::as_str),
            Principal::Approver(a) => self.approvers.get(a).map(String::as_str),
        }
    }

    /// Whether any token is configured (the admin listener serves only then).
    pub fn any(&self) -> bool {
        self.admin.is_some() || !self.tenants.is_empty() || !self.approvers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_identify_the_admin_or_one_tenant() {
        let tokens = Tokens::new(
            Some("admin-token-0123456789".into()),
            BTreeMap::from([
                ("north".to_string(), "north-token".to_string()),
                ("south".to_string(), String::new()),
            ]),
        );
        assert_eq!(
            tokens.identify("admin-token-0123456789"),
            Some(Principal::Admin)
        );
        assert_eq!(
            tokens.identify("north-token"),
            Some(Principal::Tenant("north".into()))
        );
        assert_eq!(
            tokens.identify(""),
            None,
            "a blank tenant token never matches"
        );
        assert_eq!(tokens.identify("north-token "), None);
        assert_eq!(tokens.token_of(&Principal::Tenant("south".into())), None);
        assert!(tokens.any());
        assert!(!Tokens::default().any());
    }

    #[test]
    fn the_console_secret_is_long_or_unset() {
        assert_eq!(console_secret(Some("  ".into())).unwrap(), None);
        assert!(console_secret(Some("x".repeat(31))).is_err());
        assert!(console_secret(Some("x".repeat(32))).unwrap().is_some());
    }
}
