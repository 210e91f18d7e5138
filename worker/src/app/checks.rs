//! What start-up says about the settings before it starts anything: the file descriptors the
//! worker may need (checked against `RLIMIT_NOFILE`) and the settings that work but weaken the
//! guarantees (a warning each).

use crate::config::{Settings, Tools};

/// What this worker may hold open at once (README, "Connections and open files"): its
/// Postgres pool (and the two connections of the start-up pooler probe), each HTTP listener's
/// connection cap, one downstream connection per dispatch or recovery round in flight, and its
/// two broker connections.
pub(super) fn descriptor_budget(settings: &Settings) -> kit::fd::Budget {
    let api_enabled = settings.api_enabled();
    let cap = settings.http_limits.max_connections as u64;
    let mut budget = kit::fd::Budget::new().add(
        "database pool (WORKER_DB_POOL_SIZE, + 2 start-up probes)",
        u64::from(settings.db_pool_size) + 2,
    );
    if settings.metrics_addr.is_some() {
        budget = budget.add("metrics listener (WORKER_HTTP_MAX_CONNECTIONS)", cap + 1);
    }
    if settings.admin_addr.is_some() && api_enabled {
        budget = budget.add("admin listener (WORKER_HTTP_MAX_CONNECTIONS)", cap + 1);
    }
    budget
        .add(
            "downstream connections (WORKER_MAX_IN_FLIGHT)",
            settings.max_in_flight as u64,
        )
        .add("broker", 2)
}

/// Settings that work but weaken the guarantees: said once at start-up (the unsafe ones were
/// refused by [`crate::config::check_proof`]).
pub(super) fn warn_about_risky_settings(settings: &Settings, tools: &Tools) {
    let api_enabled = settings.api_enabled();
    if settings.admin_addr.is_none() || !api_enabled {
        for (name, tool) in &tools.tools {
            if tool
                .completion
                .contract()
                .is_some_and(|c| c.callback.is_some())
            {
                tracing::warn!(
                    tool = %name,
                    "the tool takes completion callbacks, but the admin listener that receives \
                     them (POST /v1/callbacks/<tool>) is off: set WORKER_ADMIN_ADDR and \
                     WORKER_ADMIN_TOKEN or WORKER_TENANT_TOKENS; until then its operations \
                     complete by polling alone"
                );
            }
        }
    }
    if matches!(tools.auth, crate::intake::TenantAuth::Trusted) {
        tracing::warn!(
            "tenants are trusted as written in each intent; with more than one tenant set [auth] mode = \"user_id\" \
             in the tools file so the broker-validated AMQP user_id must prove the tenant"
        );
    }
    for (name, tool) in &tools.tools {
        if tool.receipt_match.is_empty() {
            tracing::warn!(
                tool = %name,
                "receipt_match = {{}} (explicit opt-out): any 2xx with a receipt id is taken as this operation's \
                 receipt; declare the echo fields the downstream returns"
            );
        }
    }
}
