//! The MCP server handler: `tools/list`, `tools/call`, and the tasks methods.
//!
//! A call is checked completely before anything is sent: known tool, action id present
//! (request `_meta` key [`ACTION_ID_META`], or the `action_id` argument in the weaker mode), a
//! compensation's original well-formed when the `_meta` key [`COMPENSATES_META`] names one,
//! arguments valid against the tool's schema, intent valid for the worker's decoder. Only then
//! is the intent published (or enqueued in the outbox) under `(tenant, action_id)`, with the
//! tenant taken from the authenticated caller, never from the arguments.
//!
//! Trace context: a call continues the W3C context of the request's `_meta.traceparent` and
//! `_meta.tracestate` (SEP-414), else of the HTTP request's `traceparent`/`tracestate` headers
//! ([`received_trace`]). A malformed one is ignored (a malformed `tracestate` dropped alone) and
//! counted, never a reason to refuse the call. Each call runs in a `tools/call <tool>` server
//! span whose parent is that context; the intent carries the span's context when spans are
//! exported, else the received context unchanged (through the outbox too).

use std::sync::Arc;
use std::time::Duration;

use protocol::trace::{TraceContext, TRACEPARENT, TRACESTATE};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, CancelTaskParams, CreateTaskResult,
    GetTaskParams, GetTaskResult, Implementation, JsonObject, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData as McpError, ServerHandler};
use serde_json::Value;
use tracing::Instrument as _;

use super::answer::{self, Check};
use super::tools::{self, ToolCatalog, STATUS_TOOL};
use crate::wait::{AnswerConfig, StatusApi, WaitError};
use crate::{Outbox, PublishOptions, Publisher};

/// The request `_meta` key that carries the application's action id.
pub const ACTION_ID_META: &str = "io.intent-worker/action_id";

/// The request `_meta` key that makes a call a compensation: the `action_id` (same tenant) of
/// the succeeded action it undoes, set as the intent's `compensates`. Like the action id it is
/// the application's, never an argument the model writes; absent, the call is an ordinary one.
pub const COMPENSATES_META: &str = "io.intent-worker/compensates";

/// The authenticated tenant of an HTTP request, put into the request's extensions by the
/// bearer-token layer (see `mod.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant(pub String);

/// Where a call's action id comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActionIdMode {
    /// The request `_meta` key [`ACTION_ID_META`], set by the host application (default).
    Meta,
    /// A required `action_id` argument in every tool's schema. Weaker: the model writes the
    /// arguments, so it can invent or change the key.
    Argument,
}

/// The agent database the gateway enqueues into, and its hosts ([`kit::pg`]), told of every
/// failed statement so a primary that went away is left at once.
pub struct OutboxDb {
    pub pool: sqlx::PgPool,
    pub hosts: Arc<kit::pg::Hosts>,
}

/// Everything a call needs; shared by every request the gateway serves.
pub struct GatewayConfig {
    pub catalog: ToolCatalog,
    pub amqp_url: String,
    pub exchange: String,
    pub set_user_id: bool,
    pub results_exchange: String,
    pub status_api: Option<StatusApi>,
    /// The agent database with `intent_outbox`; `None` publishes directly with confirms.
    pub outbox: Option<OutboxDb>,
    /// How long a call waits for its answer.
    pub budget: Duration,
    pub action_id_mode: ActionIdMode,
    /// The tenant of every call on stdio (HTTP takes it from the bearer token).
    pub fixed_tenant: Option<String>,
}

/// The gateway: cheap to clone (one per HTTP request in stateless mode).
#[derive(Clone)]
pub struct Gateway {
    config: Arc<GatewayConfig>,
    /// `reply_to` of every intent this process sends, so its results come to its own queues.
    reply_to: Arc<String>,
    publisher: Arc<tokio::sync::Mutex<Option<Arc<Publisher>>>>,
}

impl Gateway {
    pub fn new(config: GatewayConfig) -> Gateway {
        Gateway {
            config: Arc::new(config),
            reply_to: Arc::new(crate::wait::generated_reply_to().replace("agent-", "mcp-")),
            publisher: Default::default(),
        }
    }

    /// Connects now, so a wrong broker URL stops start-up rather than the first call.
    pub async fn connect(&self) -> Result<(), crate::PublishError> {
        self.publisher().await.map(|_| ())
    }

    /// The shared publisher, reconnected when its connection was lost.
    async fn publisher(&self) -> Result<Arc<Publisher>, crate::PublishError> {
        let mut slot = self.publisher.lock().await;
        if let Some(publisher) = slot.as_ref().filter(|p| p.is_connected()) {
            return Ok(publisher.clone());
        }
        let publisher = Publisher::connect(&self.config.amqp_url, &self.config.exchange)
            .await?
            .with_user_id(self.config.set_user_id)
            .with_answers(AnswerConfig {
                results_exchange: self.config.results_exchange.clone(),
                reply_to: self.reply_to.to_string(),
                status_api: self.config.status_api.clone(),
                until: crate::wait::Until::Final,
            });
        tracing::info!(node = %publisher.node(), "the MCP gateway is connected to RabbitMQ");
        let publisher = Arc::new(publisher);
        *slot = Some(publisher.clone());
        Ok(publisher)
    }

    fn check(&self) -> Check {
        if self.config.status_api.is_some() {
            Check::StatusTool
        } else {
            Check::SameCall
        }
    }

    /// The caller's tenant: from the bearer token (HTTP) or the fixed setting (stdio).
    fn tenant(&self, context: &RequestContext<RoleServer>) -> Result<String, McpError> {
        let from_token = context
            .extensions
            .get::<axum::http::request::Parts>()
            .and_then(|parts| parts.extensions.get::<Tenant>())
            .map(|t| t.0.clone());
        from_token
            .or_else(|| self.config.fixed_tenant.clone())
            .ok_or_else(|| McpError::invalid_request("no authenticated tenant", None))
    }

    fn listed_tools(&self) -> Vec<Tool> {
        let mut listed: Vec<Tool> = self
            .config
            .catalog
            .tools
            .values()
            .map(|tool| {
                let schema = match self.config.action_id_mode {
                    ActionIdMode::Meta => tool.schema.clone(),
                    ActionIdMode::Argument => tools::with_action_id_argument(&tool.schema),
                };
                let mut listed =
                    Tool::new(tool.name.clone(), tool.description.clone(), object(schema));
                listed.title = tool.title.clone();
                listed
            })
            .collect();
        if self.config.status_api.is_some() {
            listed.push(Tool::new(
                STATUS_TOOL,
                "The current outcome of an action sent earlier: succeeded (with the receipt), failed, rejected, or still unknown. Reading it never repeats the action.",
                object(serde_json::json!({
                    "type": "object",
                    "properties": {"action_id": {"type": "string", "minLength": 1}},
                    "required": ["action_id"],
                    "additionalProperties": false
                })),
            ));
        }
        listed
    }

    async fn status_tool(&self, tenant: &str, arguments: &JsonObject) -> CallToolResult {
        let Some(api) = &self.config.status_api else {
            return answer::refused(format!("unknown tool {STATUS_TOOL:?}"));
        };
        let Some(action_id) = arguments.get("action_id").and_then(Value::as_str) else {
            return answer::refused("get_action_status needs the argument action_id (a string)");
        };
        match api.status(tenant, action_id).await {
            Ok(Some(event)) => answer::from_event(&event, Check::StatusTool),
            Ok(None) => answer::refused(format!(
                "No action {action_id:?} is recorded for this tenant: it was never sent, or the worker has not recorded it yet."
            )),
            Err(error) => answer::refused(format!(
                "The status could not be read ({error}); try again later."
            )),
        }
    }

    /// Checks a call and builds its intent, or says why it is refused (nothing is sent).
    fn intent(
        &self,
        tenant: &str,
        request: &CallToolRequestParams,
        context: &RequestContext<RoleServer>,
    ) -> Result<protocol::Intent, CallToolResult> {
        let Some(tool) = self.config.catalog.get(&request.name) else {
            return Err(answer::refused(format!(
                "Unknown tool {:?}; tools/list shows the tools this gateway offers.",
                request.name
            )));
        };
        let mut arguments = request.arguments.clone().unwrap_or_default();
        let from_meta = |key: &str| {
            request
                .meta
                .as_ref()
                .and_then(|meta| meta.get(key))
                .or_else(|| context.meta.get(key))
        };
        let action_id = match self.config.action_id_mode {
            ActionIdMode::Meta => {
                match from_meta(ACTION_ID_META) {
                    Some(Value::String(id)) if !id.is_empty() => id.clone(),
                    _ => return Err(answer::refused(format!(
                        "Refused, nothing was sent: this gateway needs the action id in the request's _meta under the key {ACTION_ID_META:?} (a non-empty string chosen by the application, the same on every retry of this action). The host application sets it, e.g. with the OpenAI Agents SDK's tool_meta_resolver; the model cannot supply it."
                    ))),
                }
            }
            ActionIdMode::Argument => match arguments.remove("action_id") {
                Some(Value::String(id)) if !id.is_empty() => id,
                _ => {
                    return Err(answer::refused(
                        "Refused, nothing was sent: the argument action_id (a non-empty string) is required; use the same action_id on every retry of this action.",
                    ))
                }
            },
        };
        let compensates = compensates(from_meta(COMPENSATES_META))?;
        let arguments = Value::Object(arguments);
        let problems = tool.problems(&arguments);
        if !problems.is_empty() {
            return Err(answer::refused(format!(
                "Refused, nothing was sent: the arguments do not match the tool's input schema:\n{}",
                problems.join("\n")
            )));
        }
        let intent = protocol::Intent {
            tenant: tenant.to_owned(),
            action_id,
            tool: tool.name.clone(),
            arguments,
            call_id: None,
            reply_to: Some(self.reply_to.to_string()),
            compensates,
        };
        // The worker's own decoder: an intent it would reject is refused here instead.
        protocol::decode_intent(&intent.to_json()).map_err(|error| {
            answer::refused(format!(
                "Refused, nothing was sent: invalid intent: {error}"
            ))
        })
    }

    /// Hands the intent to the broker (confirmed) or to the outbox (committed), with the trace
    /// context in `options`.
    async fn send(
        &self,
        publisher: &Publisher,
        intent: protocol::Intent,
        options: &PublishOptions,
    ) -> Result<(), WaitError> {
        match &self.config.outbox {
            Some(db) => {
                let done = enqueue(&db.pool, &intent, options).await;
                if let Err(WaitError::Outbox(crate::OutboxError::Db(e))) = &done {
                    db.hosts.observe(e);
                }
                done
            }
            None => Ok(publisher.publish_with(&intent, options).await?),
        }
    }

    /// The server span of one `tools/call`. The tool is named only when it is one this
    /// gateway offers: the name comes from the client, and an unknown one is refused anyway.
    fn call_span(&self, tool: &str, tenant: &str) -> tracing::Span {
        let known = self.config.catalog.get(tool).is_some()
            || (tool == STATUS_TOOL && self.config.status_api.is_some());
        let tool = known.then_some(tool);
        let name = match tool {
            Some(tool) => format!("tools/call {tool}"),
            None => "tools/call".to_owned(),
        };
        // No parent from whatever span rmcp runs the handler in: the call's parent is the
        // context the client sent, set by the caller.
        tracing::info_span!(
            parent: None,
            "tools/call",
            otel.name = %name,
            otel.kind = "server",
            mcp.method.name = "tools/call",
            gen_ai.operation.name = "execute_tool",
            gen_ai.tool.name = tool,
            intent_worker.tenant = %tenant,
            error.type = tracing::field::Empty,
        )
    }

    async fn call(
        &self,
        tenant: &str,
        request: CallToolRequestParams,
        context: &RequestContext<RoleServer>,
        trace: Option<TraceContext>,
    ) -> Result<CallToolResponse, McpError> {
        let options = PublishOptions::new().with_trace(trace);
        if request.name == STATUS_TOOL {
            let arguments = request.arguments.unwrap_or_default();
            return Ok(self.status_tool(tenant, &arguments).await.into());
        }
        let intent = match self.intent(tenant, &request, context) {
            Ok(intent) => intent,
            Err(refused) => return Ok(refused.into()),
        };
        let publisher = match self.publisher().await {
            Ok(publisher) => publisher,
            Err(error) => {
                return Ok(answer::refused(format!(
                    "Nothing was sent: the gateway cannot reach the broker ({error}). Calling again later with the same action id is safe."
                ))
                .into())
            }
        };
        let tasks = self.config.status_api.is_some()
            && context
                .client_capabilities()
                .is_some_and(|caps| caps.supports_tasks());
        if tasks {
            let (tenant, action_id) = (intent.tenant.clone(), intent.action_id.clone());
            if let Err(error) = self.send(&publisher, intent, &options).await {
                return Ok(not_sent(&action_id, &error).into());
            }
            let now = chrono::Utc::now().to_rfc3339();
            let task = answer::task(&tenant, &action_id, None, &now);
            return Ok(CallToolResponse::Task(CreateTaskResult::new(task.task)));
        }
        let action_id = intent.action_id.clone();
        let answer = publisher
            .send_and_wait_via(&intent, self.config.budget, |intent| {
                self.send(&publisher, intent, &options)
            })
            .await;
        Ok(match answer {
            Ok(answer) => answer::from_event(&answer.event, self.check()),
            Err(WaitError::NoAnswer { .. }) => answer::no_answer(&action_id, self.check()),
            Err(error) => not_sent(&action_id, &error),
        }
        .into())
    }
}

/// The `compensates` of a call, from the request `_meta` key [`COMPENSATES_META`]: absent (or
/// `null`) is an ordinary call; otherwise a non-empty string, checked with the intent's other
/// fields by the worker's decoder (the rule of an action id). Anything else refuses the call.
pub fn compensates(from_meta: Option<&Value>) -> Result<Option<String>, CallToolResult> {
    match from_meta {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(original)) if !original.is_empty() => Ok(Some(original.clone())),
        Some(_) => Err(answer::refused(format!(
            "Refused, nothing was sent: the request's _meta key {COMPENSATES_META:?} must be the action id (a non-empty string) of the succeeded action this call undoes, set by the application."
        ))),
    }
}

/// A send whose success is not proven: the model may call again with the same key.
fn not_sent(action_id: &str, error: &WaitError) -> CallToolResult {
    tracing::warn!(%error, action_id, "an MCP call could not be sent");
    answer::refused(format!(
        "The request for action {action_id:?} could not be confirmed as sent ({error}). It may or may not have been queued; calling this tool again with the same action id is safe (it is never carried out twice), a new action id is not."
    ))
}

async fn enqueue(
    pool: &sqlx::PgPool,
    intent: &protocol::Intent,
    options: &PublishOptions,
) -> Result<(), WaitError> {
    let mut tx = pool.begin().await.map_err(crate::OutboxError::Db)?;
    Outbox::enqueue_with(&mut tx, intent, options).await?;
    tx.commit().await.map_err(crate::OutboxError::Db)?;
    Ok(())
}

/// The W3C trace context a call continues (SEP-414): the request's `_meta.traceparent` and
/// `_meta.tracestate`, else (streamable HTTP) the HTTP request's `traceparent` and `tracestate`
/// headers. A malformed `traceparent` is ignored as if absent (so a valid header still counts),
/// a malformed `tracestate` dropped alone; each is counted in
/// `intent_publisher_trace_context_invalid_total` (`source` = `mcp_meta` or `http_header`).
pub fn received_trace(
    request: &CallToolRequestParams,
    context: &RequestContext<RoleServer>,
) -> Option<TraceContext> {
    let meta = request
        .meta
        .iter()
        .map(|meta| &meta.0 .0)
        .chain(std::iter::once(&context.meta.0 .0))
        .find(|meta| meta.contains_key(TRACEPARENT));
    if let Some(meta) = meta {
        let state = match meta.get(TRACESTATE) {
            None => None,
            Some(Value::String(state)) => Some(state.as_str()),
            Some(_) => {
                crate::trace::invalid("mcp_meta", TRACESTATE);
                None
            }
        };
        match meta.get(TRACEPARENT) {
            Some(Value::String(parent)) => {
                if let Some(cx) = crate::trace::receive("mcp_meta", Some(parent), state) {
                    return Some(cx);
                }
            }
            _ => crate::trace::invalid("mcp_meta", TRACEPARENT),
        }
    }
    let headers = &context
        .extensions
        .get::<axum::http::request::Parts>()?
        .headers;
    let mut parents = headers.get_all(TRACEPARENT).iter();
    let parent = parents.next()?;
    // Two traceparent headers cannot be told apart: the specification ignores both.
    let parent = match (parents.next(), parent.to_str()) {
        (None, Ok(parent)) => parent,
        _ => {
            crate::trace::invalid("http_header", TRACEPARENT);
            return None;
        }
    };
    // Several tracestate headers are one list, joined in order.
    let states: Result<Vec<&str>, _> = headers
        .get_all(TRACESTATE)
        .iter()
        .map(|v| v.to_str())
        .collect();
    let state = match states {
        Ok(states) if states.is_empty() => None,
        Ok(states) => Some(states.join(",")),
        Err(_) => {
            crate::trace::invalid("http_header", TRACESTATE);
            None
        }
    };
    crate::trace::receive("http_header", Some(parent), state.as_deref())
}

fn object(schema: Value) -> Arc<JsonObject> {
    match schema {
        Value::Object(object) => Arc::new(object),
        _ => Arc::new(JsonObject::new()),
    }
}

impl ServerHandler for Gateway {
    fn get_info(&self) -> ServerConfig {
        let capabilities = ServerCapabilities::builder().enable_tools();
        let capabilities = if self.config.status_api.is_some() {
            capabilities.enable_tasks().build()
        } else {
            capabilities.build()
        };
        ServerConfig::new(capabilities)
            .with_server_info(Implementation::new("intent-worker-mcp", env!("CARGO_PKG_VERSION")))
            .with_instructions(format!(
                "Every tool call is a write performed at most once per action id. The application supplies the action id in the request _meta key {ACTION_ID_META:?} (and, for a call that undoes an earlier action, that action's id in {COMPENSATES_META:?}). An answer that says OUTCOME UNKNOWN means exactly that, and one that says AWAITING APPROVAL waits for a person with nothing sent: in both cases do not retry and do not call again under another action id."
            ))
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        self.tenant(&context)?;
        Ok(ListToolsResult::with_all_items(self.listed_tools()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let tenant = self.tenant(&context)?;
        let received = received_trace(&request, &context);
        let span = self.call_span(&request.name, &tenant);
        if let Some(cx) = &received {
            kit::otel::set_remote_parent(&span, cx);
        }
        // The call span's own context when exported, else the received one unchanged.
        let trace = kit::otel::outgoing(&span, received.as_ref());
        let response = self
            .call(&tenant, request, &context, trace)
            .instrument(span.clone())
            .await;
        if let Ok(CallToolResponse::Complete(result)) = &response {
            if result.is_error == Some(true) {
                span.record("error.type", "tool_error");
            }
        }
        response
    }

    async fn get_task(
        &self,
        request: GetTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, McpError> {
        let tenant = self.tenant(&context)?;
        let Some(api) = &self.config.status_api else {
            return Err(McpError::invalid_params("tasks need a status API", None));
        };
        // Another tenant's task is "not found", like a missing one: nothing reveals it exists.
        let not_found =
            || McpError::invalid_params(format!("unknown task {:?}", request.task_id), None);
        let (task_tenant, action_id) =
            answer::parse_task_id(&request.task_id).ok_or_else(not_found)?;
        if task_tenant != tenant {
            return Err(not_found());
        }
        let event = api
            .status(&tenant, action_id)
            .await
            .map_err(|e| McpError::internal_error(format!("status API: {e}"), None))?;
        let now = chrono::Utc::now().to_rfc3339();
        Ok(GetTaskResult::new(answer::task(
            &tenant,
            action_id,
            event.as_ref(),
            &now,
        )))
    }

    async fn cancel_task(
        &self,
        request: CancelTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        let tenant = self.tenant(&context)?;
        match answer::parse_task_id(&request.task_id) {
            Some((task_tenant, _)) if task_tenant == tenant => {
                // Acknowledged, but nothing is stopped: a dispatched write cannot be undone, and
                // the task goes on reporting the ledger's state (its status message says so).
                tracing::info!(task = %request.task_id, "tasks/cancel acknowledged; a dispatched write cannot be undone");
                Ok(())
            }
            _ => Err(McpError::invalid_params(
                format!("unknown task {:?}", request.task_id),
                None,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(result: CallToolResult) -> String {
        assert_eq!(result.is_error, Some(true));
        serde_json::to_value(&result.content).unwrap().to_string()
    }

    #[test]
    fn compensates_comes_from_meta_as_a_non_empty_string() {
        assert_eq!(compensates(None).unwrap(), None);
        assert_eq!(compensates(Some(&Value::Null)).unwrap(), None);
        let original = Value::String("refund-731".into());
        assert_eq!(
            compensates(Some(&original)).unwrap(),
            Some("refund-731".to_string())
        );
        for bad in [
            serde_json::json!(""),
            serde_json::json!(7),
            serde_json::json!(["refund-731"]),
            serde_json::json!({"action_id": "refund-731"}),
        ] {
            let said = refusal(compensates(Some(&bad)).unwrap_err());
            assert!(said.contains(COMPENSATES_META), "{bad}: {said}");
            assert!(said.contains("nothing was sent"), "{bad}: {said}");
        }
    }

    /// A string the worker's decoder would refuse (the rule of an action id) is refused by the
    /// same check the gateway runs on every intent before sending it.
    #[test]
    fn a_compensated_action_id_follows_the_action_id_rule() {
        let intent = |original: &str| protocol::Intent {
            tenant: "north-shop".into(),
            action_id: "undo-731".into(),
            tool: "cancel_refund".into(),
            arguments: serde_json::json!({}),
            call_id: None,
            reply_to: Some("mcp-1".into()),
            compensates: compensates(Some(&Value::String(original.into()))).unwrap(),
        };
        let sent = intent("refund-731");
        let decoded = protocol::decode_intent(&sent.to_json()).unwrap();
        assert_eq!(decoded.compensates.as_deref(), Some("refund-731"));
        assert_ne!(
            decoded.fingerprint(),
            protocol::fingerprint(&decoded.tool, &decoded.arguments)
        );
        for bad in ["refund 731", "r\u{e9}fund", &"r".repeat(201)] {
            let error = protocol::decode_intent(&intent(bad).to_json()).unwrap_err();
            assert!(error.to_string().contains("compensates"), "{bad}: {error}");
        }
    }
}
