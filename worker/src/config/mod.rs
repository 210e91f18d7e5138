//! Configuration: what the worker reads at start-up, one subject per module, and the errors
//! reading it can give. Every setting has a documented default (docs/configuration.md); a bad
//! value is a start-up error naming the variable or the tools-file key, never a silent
//! fallback or a silent clamp.
//!
//! - [`settings`]: the environment settings (clap, so `worker run --help` lists every variable
//!   with its default) and the broker names ([`Topology`]).
//! - [`tools`]: the per-tool TOML file and the checks that need it and the settings together.
//! - [`completion`]: how a tool's write completes (at once, or a long-running operation that is
//!   polled: the async contract and its poll policy).
//! - [`interpolate`]: `${VAR}` expansion of the tools file's `url`, `lookup_url`, `status_url`
//!   and `headers`.
//! - [`auth`]: who may act for or read a tenant: the tools file's `[auth]` section and the
//!   admin and tenant tokens.
//!
//! The policies the tools file carries are defined where they are applied: the recovery
//! capability in [`crate::recovery`], the retry and budget policies in [`crate::retry`], the
//! tenant proof in [`crate::intake`].

use std::path::PathBuf;

pub mod approval;
pub mod auth;
pub mod completion;
pub mod interpolate;
pub mod settings;
pub mod tools;

pub use completion::{AsyncContract, Callback, Completion, PollPolicy};
pub use settings::{blank_env_is_unset, ConsoleSettings, EnvArgs, Listen, Settings, Topology};
pub use tools::{check_proof, AbsenceProof, ToolConfig, Tools};

/// Errors found while reading configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A value clap refused (its message names the variable).
    #[error("{0}")]
    Usage(String),
    #[error("{name}={value:?} is invalid: {reason}")]
    Invalid {
        name: &'static str,
        value: String,
        reason: String,
    },
    // The io error is part of this message and deliberately not a `source`: a chain printer
    // (`{:#}`) would otherwise print it twice.
    #[error("cannot read tools file {path}: {error}")]
    ToolsRead {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{name}={value:?} and its deprecated alias {alias}={alias_value:?} are both set and differ; keep {name} only")]
    Conflict {
        name: &'static str,
        value: String,
        alias: &'static str,
        alias_value: String,
    },
    #[error("tools file {path} is invalid: {reason}")]
    ToolsInvalid { path: PathBuf, reason: String },
}
