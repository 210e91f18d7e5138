//! The wire contract of the intent worker (docs/design.md sections 3 and 7): the intent an
//! agent publishes, the strict decoder that guards the worker from malformed or
//! ambiguous bodies, the intent fingerprint that detects a key reused for a different
//! request, and the result event the worker sends back. Everything here is pure and
//! synchronous so the worker, the publisher and the tests share one definition.
//!
//! # Layout
//!
//! - [`intent`]: the [`Intent`] type, [`decode_intent`] (strict, one error per rule)
//!   and [`salvage_key`] (addressing a rejection for a body that failed decoding).
//! - [`error`]: [`DecodeError`], with a human message and a stable machine code.
//! - [`fingerprint`](mod@fingerprint): RFC 8785 canonical JSON and the SHA-256 intent fingerprint.
//! - [`result`]: [`ResultEvent`] with its [`Status`] and [`RejectReason`].
//! - [`trace`]: W3C Trace Context (`traceparent`, `tracestate`) as intents and results carry it.

pub mod error;
pub mod fingerprint;
pub mod intent;
pub mod result;
pub mod trace;

pub use error::DecodeError;
pub use fingerprint::{
    canonical_json, fingerprint, fingerprint_canonical, fingerprint_canonical_compensating,
};
pub use intent::{
    action_key, check_action_key, decode_intent, salvage_key, salvage_reply_to, Intent,
    MAX_ACTION_KEY_BYTES, MAX_INTENT_BYTES, MAX_KEY_LEN, MAX_TOOL_LEN,
};
pub use result::{
    result_routing_key, tenant_binding_keys, RejectReason, ResultEvent, Status, Uncertainty,
    VerifiedBy, MAX_ROUTING_KEY_BYTES, REPLY_WORD,
};
