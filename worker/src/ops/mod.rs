//! Operating the worker: the admin and status HTTP API ([`api`]), the same actions from the
//! command line ([`cli`]), both calling [`actions`], and the retention sweeper ([`retention`]).
//! [`check_tool`] probes a downstream against the capability its tools file declares.

pub mod actions;
pub mod api;
pub mod check_tool;
pub mod cli;
pub mod retention;
