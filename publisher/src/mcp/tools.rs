//! The gateway's tools file (`PUBLISHER_MCP_TOOLS`): which worker tools MCP clients see, with
//! the description and input JSON Schema a model needs.
//!
//! It is a file of the gateway's own rather than extra keys in the worker's `WORKER_TOOLS`: the
//! worker refuses unknown keys (so a typo cannot silently change a write), and which writes a
//! model may request is a decision per gateway, not per worker (one worker pool may serve an
//! MCP gateway that exposes two tools and a back office that sends all of them).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Map, Value};

/// The tool the gateway adds itself (answers from the status API); no worker tool may use it.
pub const STATUS_TOOL: &str = "get_action_status";

/// Why the tools file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ToolsError {
    #[error("cannot read the MCP tools file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("MCP tools file {path}: {message}")]
    Invalid { path: String, message: String },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    tools: BTreeMap<String, Entry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    description: String,
    #[serde(default)]
    title: Option<String>,
    #[serde(default)]
    input_schema: Option<toml::Value>,
}

/// One exposed tool: what `tools/list` shows and the compiled schema `tools/call` checks.
pub struct ExposedTool {
    pub name: String,
    pub title: Option<String>,
    pub description: String,
    /// The operator's schema of the tool's arguments (the intent's `arguments`).
    pub schema: Value,
    validator: jsonschema::Validator,
}

impl std::fmt::Debug for ExposedTool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExposedTool")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl ExposedTool {
    /// Every way `arguments` breaks the schema, one line each (`/path: problem`); empty when
    /// they conform.
    pub fn problems(&self, arguments: &Value) -> Vec<String> {
        self.validator
            .iter_errors(arguments)
            .take(20)
            .map(|error| {
                let path = error.instance_path().to_string();
                let path = if path.is_empty() { "/".into() } else { path };
                format!("{path}: {error}")
            })
            .collect()
    }
}

/// The exposed tools by name.
#[derive(Debug, Clone, Default)]
pub struct ToolCatalog {
    pub tools: Arc<BTreeMap<String, ExposedTool>>,
}

impl ToolCatalog {
    /// Reads and checks the file: every schema must compile, be an object schema
    /// (`"type": "object"`, the MCP requirement), and no tool may be named [`STATUS_TOOL`].
    pub fn load(path: &Path) -> Result<ToolCatalog, ToolsError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ToolsError::Read {
            path: shown.clone(),
            source,
        })?;
        ToolCatalog::parse(&text).map_err(|message| ToolsError::Invalid {
            path: shown,
            message,
        })
    }

    /// Parses the TOML text (see [`ToolCatalog::load`]).
    pub fn parse(text: &str) -> Result<ToolCatalog, String> {
        let file: File = toml::from_str(text).map_err(|e| e.to_string())?;
        if file.tools.is_empty() {
            return Err("no [tools.<name>] table: expose at least one tool".into());
        }
        let mut tools = BTreeMap::new();
        for (name, entry) in file.tools {
            if name == STATUS_TOOL {
                return Err(format!(
                    "tool name {STATUS_TOOL:?} is reserved by the gateway"
                ));
            }
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            {
                return Err(format!(
                    "tool name {name:?}: use letters, digits, '-', '_' and '.' (the worker's rule)"
                ));
            }
            let schema = match entry.input_schema {
                None => serde_json::json!({"type": "object"}),
                Some(value) => serde_json::to_value(value).map_err(|e| e.to_string())?,
            };
            if schema.get("type").and_then(Value::as_str) != Some("object") {
                return Err(format!(
                    "[tools.{name}] input_schema must have \"type\" = \"object\" (MCP tool arguments are an object)"
                ));
            }
            let validator = jsonschema::validator_for(&schema).map_err(|e| {
                format!("[tools.{name}] input_schema is not a valid JSON Schema: {e}")
            })?;
            tools.insert(
                name.clone(),
                ExposedTool {
                    name,
                    title: entry.title,
                    description: entry.description,
                    schema,
                    validator,
                },
            );
        }
        Ok(ToolCatalog {
            tools: Arc::new(tools),
        })
    }

    pub fn get(&self, name: &str) -> Option<&ExposedTool> {
        self.tools.get(name)
    }
}

/// `schema` with a required string property `action_id` added: the schema a client sees in the
/// weaker argument mode. The property is removed again before validation and publishing.
pub fn with_action_id_argument(schema: &Value) -> Value {
    let mut schema = schema.clone();
    let Some(object) = schema.as_object_mut() else {
        return schema;
    };
    let properties = object
        .entry("properties")
        .or_insert_with(|| Value::Object(Map::new()));
    if let Some(properties) = properties.as_object_mut() {
        properties.insert(
            "action_id".into(),
            serde_json::json!({
                "type": "string",
                "minLength": 1,
                "description": "The application's key for this action, chosen by the application, never invented by the model. Calling again with the same action_id never repeats the action."
            }),
        );
    }
    let required = object
        .entry("required")
        .or_insert_with(|| Value::Array(Vec::new()));
    if let Some(required) = required.as_array_mut() {
        if !required.iter().any(|v| v == "action_id") {
            required.push("action_id".into());
        }
    }
    schema
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
[tools.refund]
description = "Refund an order"
input_schema = { type = "object", properties = { order = { type = "string" }, amount_cents = { type = "integer", minimum = 1 } }, required = ["order", "amount_cents"], additionalProperties = false }
"#;

    #[test]
    fn validates_arguments_against_the_schema() {
        let catalog = ToolCatalog::parse(FILE).unwrap();
        let refund = catalog.get("refund").unwrap();
        assert!(refund
            .problems(&serde_json::json!({"order": "o-1", "amount_cents": 5}))
            .is_empty());
        let problems = refund.problems(&serde_json::json!({"order": 7, "amount_cents": 0}));
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(
            problems.iter().any(|p| p.starts_with("/order")),
            "{problems:?}"
        );
    }

    #[test]
    fn refuses_reserved_names_non_object_schemas_and_unknown_keys() {
        let reserved = "[tools.get_action_status]\ndescription = \"x\"\n";
        assert!(ToolCatalog::parse(reserved)
            .unwrap_err()
            .contains("reserved"));
        let scalar = "[tools.a]\ndescription = \"x\"\ninput_schema = { type = \"string\" }\n";
        assert!(ToolCatalog::parse(scalar).unwrap_err().contains("object"));
        let unknown = "[tools.a]\ndescription = \"x\"\nurl = \"http://x\"\n";
        assert!(ToolCatalog::parse(unknown).unwrap_err().contains("url"));
        assert!(ToolCatalog::parse("").is_err());
    }

    #[test]
    fn argument_mode_adds_a_required_action_id() {
        let schema =
            with_action_id_argument(&serde_json::json!({"type": "object", "required": ["a"]}));
        assert_eq!(schema["required"], serde_json::json!(["a", "action_id"]));
        assert_eq!(schema["properties"]["action_id"]["type"], "string");
    }
}
