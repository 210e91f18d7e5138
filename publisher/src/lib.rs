//! Publisher side of the intent worker: publish intents with publisher confirms and
//! follow their result events.
//!
//! An agent sends an intent keyed by `(tenant, action_id)` to the intents exchange
//! (routing key = tenant, persistent, `message_id = "<tenant>:<action_id>"`). Every
//! publish is `mandatory` and awaits its confirm, so `Ok` means the broker routed and
//! accepted it; an unroutable or nacked message is an error. The publisher never
//! retries and never changes the action key: sending the same action again is the
//! caller's decision, under the same key, and the worker's inbox deduplicates it.
//! Results come back on the results exchange (routing key = tenant).
//!
//! # Layout
//! - `publish.rs` ([`publish`]): [`Publisher`]: connect in confirm mode, `publish`,
//!   `publish_encoded`, `publish_raw`.
//! - `follow.rs` ([`follow`]): [`Follower`]: a results queue bound to the tenant,
//!   `next` with a timeout.
//! - `topology.rs` ([`topology`]): the only declarations this side makes (results
//!   exchange and queue; the intents exchange for tests and the demo).
//! - `error.rs` ([`error`]): [`PublishError`].
//! - `cli.rs` ([`cli`]): the `publisher` command line (`send`, `follow`, `demo`);
//!   `main.rs` only sets up logging, parses arguments and calls [`cli::run`].
//! - `demo.rs` ([`demo`]): the demo agent for docker compose.

pub mod cli;
pub mod demo;
pub mod error;
pub mod follow;
pub mod metrics;
pub mod outbox;
pub mod publish;
pub mod relay;
pub mod topology;
pub mod wait;

pub use error::PublishError;
pub use follow::Follower;
pub use outbox::{Outbox, OutboxError};
pub use publish::{action_key, Publisher};
pub use relay::{Relay, RelayConfig};
pub use wait::{Answer, AnswerConfig, StatusApi, WaitError};
