//! Who may act for or read a tenant, as configured: the tools file's `[auth]` section (the
//! tenant proof, [`TenantAuth`], applied by intake), the tenant read tokens of the status API
//! (`WORKER_TENANT_TOKENS`) and the admin token's minimum length. Token values are never echoed
//! in an error.

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

/// The admin token, if set (blank counts as unset): at least 16 characters.
pub(super) fn admin_token(raw: Option<String>) -> Result<Option<String>, ConfigError> {
    let token = raw.filter(|t| !t.trim().is_empty());
    if token.as_ref().is_some_and(|t| t.len() < 16) {
        return Err(ConfigError::Invalid {
            name: "WORKER_ADMIN_TOKEN",
            value: "<redacted>".into(),
            reason: "must be at least 16 characters".into(),
        });
    }
    Ok(token)
}

/// Parses `tenant=token,tenant2=token2`.
pub(super) fn parse_tenant_tokens(
    raw: Option<String>,
) -> Result<BTreeMap<String, String>, ConfigError> {
    let mut map = BTreeMap::new();
    for pair in raw.iter().flat_map(|r| r.split(',')).map(str::trim) {
        if pair.is_empty() {
            continue;
        }
        match pair.split_once('=') {
            Some((t, tok)) if !t.trim().is_empty() && tok.trim().len() >= 8 => {
                map.insert(t.trim().to_string(), tok.trim().to_string());
            }
            _ => {
                return Err(ConfigError::Invalid {
                    name: "WORKER_TENANT_TOKENS",
                    value: "<redacted>".into(),
                    reason:
                        "expected tenant=token pairs separated by commas, tokens of 8+ characters"
                            .into(),
                })
            }
        }
    }
    Ok(map)
}
