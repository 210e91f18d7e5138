//! Operating the worker: the admin and status HTTP API ([`api`]), the same actions from the
//! command line ([`cli`]) and the operator console ([`crate::console`]), all calling
//! [`actions`] (and [`approvals`], the decisions on intents that wait for a person); bulk jobs of those actions ([`bulk`]); the dead-letter queue's listing,
//! republish and discard ([`dead_letters`]); and the retention sweeper ([`retention`]).
//! [`check_tool`] probes a downstream against the capability its tools file declares.

pub mod actions;
pub mod api;
pub mod approvals;
pub mod bulk;
pub mod callback;
pub mod check_tool;
pub mod cli;
pub mod dead_letters;
pub mod retention;
