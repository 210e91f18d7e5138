//! Tool adapters: how the worker talks to a downstream service.
//!
//! An adapter sends the write, looks an operation up by its stable key, checks receipts, and
//! classifies every answer into an [`Outcome`] (the vocabulary of [`crate::outcome`], which the
//! retry policy and dispatch speak too). The classification is the safety boundary: only
//! [`Outcome::NotSent`], [`Outcome::LocalExhaustion`] and [`Outcome::NotApplied`] may lead to
//! another write; anything that may have been applied is [`Outcome::Unknown`]. Library users
//! plug in their own adapters by implementing [`ToolAdapter`]; the generic
//! [`http::HttpAdapter`] is configured per tool. Every call is timed and counted per tool
//! ([`meters`]).

pub mod client;
pub mod http;
pub mod meters;
pub mod receipt;
pub mod status;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{ToolConfig, Tools};
use crate::outcome::{Outcome, Polled};
use crate::recovery::Capability;

/// A boxed future, so adapters can be trait objects.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Everything an adapter needs to send or look up one operation.
#[derive(Debug, Clone)]
pub struct Request {
    pub tenant: String,
    pub action_id: String,
    pub tool: String,
    /// `<tenant>:<action_id>`: the same on every attempt, replay and recovery.
    pub idempotency_key: String,
    /// The canonical JSON arguments, byte for byte as first recorded.
    pub body: String,
    /// The trace context of the intent. An adapter sends the context of its own request span
    /// when spans are recorded ([`kit::otel::outgoing`]), else this one unchanged.
    pub trace: Option<protocol::trace::TraceContext>,
    /// The absolute deadline a write carries (a tool with `absence_proof`), from its send fence.
    pub deadline: Option<chrono::DateTime<chrono::Utc>>,
}

/// A downstream the worker can drive.
pub trait ToolAdapter: Send + Sync {
    /// How unknown outcomes of this tool may be recovered.
    fn capability(&self) -> &Capability;
    /// Sends the write with the operation's idempotency key.
    fn execute<'a>(&'a self, request: &'a Request) -> BoxFuture<'a, Outcome>;
    /// Reads the operation by its stable key; never writes. Only called for `lookup` tools.
    fn lookup<'a>(&'a self, request: &'a Request) -> BoxFuture<'a, Outcome>;
    /// Reads the status of the long-running operation `operation_id` the downstream accepted
    /// this request as; never writes. Only called for `completion = "async"` tools; an adapter
    /// without long-running operations proves nothing.
    fn poll<'a>(&'a self, request: &'a Request, operation_id: &'a str) -> BoxFuture<'a, Polled> {
        let _ = (request, operation_id);
        Box::pin(async {
            Polled::Unproven {
                evidence: "this adapter reads no long-running operation's status".into(),
            }
        })
    }
    /// What a long-running operation's status document that arrived unasked (a completion
    /// callback's body) proves about the operation of `request`, accepted as `operation_id`
    /// when known: the same decision as for a poll's answer. An adapter without long-running
    /// operations proves nothing.
    fn judge_status(
        &self,
        request: &Request,
        operation_id: Option<&str>,
        document: crate::document::Document,
    ) -> Polled {
        let _ = (request, operation_id, document);
        Polled::Unproven {
            evidence: "this adapter reads no long-running operation's status".into(),
        }
    }
    /// Checks that `receipt` belongs to this operation; returns its receipt id. Used for every
    /// receipt, including one an operator submits.
    fn check_receipt(
        &self,
        request: &Request,
        receipt: &serde_json::Value,
    ) -> Result<String, String>;
}

/// A configured tool: its settings and its adapter.
#[derive(Clone)]
pub struct Tool {
    pub config: ToolConfig,
    pub adapter: Arc<dyn ToolAdapter>,
    /// Its downstream request metrics ([`meters::timed`]).
    pub meters: Arc<meters::RequestMeters>,
}

/// The tools this worker serves, by name.
#[derive(Clone, Default)]
pub struct ToolSet {
    tools: BTreeMap<String, Tool>,
}

impl ToolSet {
    /// Builds HTTP adapters for every tool of the file; `https://` tools trust `trust`.
    pub fn from_config(
        tools: &Tools,
        trust: &crate::tls::Trust,
    ) -> Result<ToolSet, http::BuildError> {
        let mut set = ToolSet::default();
        for (name, config) in &tools.tools {
            let adapter = Arc::new(http::HttpAdapter::new(config.clone(), trust)?);
            set.insert(name.clone(), config.clone(), adapter);
        }
        Ok(set)
    }

    /// Adds (or replaces) a tool with a custom adapter.
    pub fn insert(&mut self, name: String, config: ToolConfig, adapter: Arc<dyn ToolAdapter>) {
        let meters = Default::default();
        self.tools.insert(
            name,
            Tool {
                config,
                adapter,
                meters,
            },
        );
    }

    pub fn get(&self, name: &str) -> Option<&Tool> {
        self.tools.get(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Tool)> {
        self.tools.iter()
    }

    /// Replay windows of replay-capable tools (tool name, window), from which the ledger
    /// stores each first dispatch's protection deadline. Plain values: adapters do not depend
    /// on the ledger.
    pub fn replay_windows(&self) -> Vec<(String, Duration)> {
        self.tools
            .iter()
            .filter_map(|(n, t)| match t.config.capability {
                Capability::Replay { window, .. } => Some((n.clone(), window)),
                _ => None,
            })
            .collect()
    }
}
