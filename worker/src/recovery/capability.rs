//! The recovery capability of a tool: what its downstream supports when the outcome of a send
//! is unknown. Declared per tool in the tools file (`recovery = ...`), applied by
//! [`super::choose`], the dispatcher and the HTTP adapter.

use std::time::Duration;

/// How an unknown outcome of a tool may be recovered (docs/design.md section 5).
#[derive(Debug, Clone, PartialEq)]
pub enum Capability {
    /// Durable idempotency with receipt replay for `window` after the first dispatch; replay
    /// stops `margin` before the window closes.
    Replay { window: Duration, margin: Duration },
    /// Authoritative lookup by the stable key; the write is never resent.
    Lookup { url_template: String },
    /// Nothing: an unknown outcome is held for a person at once.
    None,
}

impl Capability {
    pub fn name(&self) -> &'static str {
        match self {
            Capability::Replay { .. } => "replay",
            Capability::Lookup { .. } => "lookup",
            Capability::None => "none",
        }
    }
}
