//! Admin and status HTTP API (placeholder until the operations issue lands).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::context::Context;

pub struct AdminApi {
    _ctx: Arc<Context>,
    _token: String,
    _tenant_tokens: BTreeMap<String, String>,
}

impl AdminApi {
    pub fn new(
        ctx: Arc<Context>,
        token: String,
        tenant_tokens: BTreeMap<String, String>,
    ) -> AdminApi {
        AdminApi {
            _ctx: ctx,
            _token: token,
            _tenant_tokens: tenant_tokens,
        }
    }

    pub async fn serve(
        self,
        _addr: SocketAddr,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        shutdown.await;
        Ok(())
    }
}
