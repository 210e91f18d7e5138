//! Operating the worker: the admin and status HTTP API ([`api`]), the same actions from the
//! command line ([`cli`]), both calling [`actions`], and the retention sweeper ([`retention`]).

pub mod actions;
pub mod api;
pub mod cli;
pub mod retention;
