//! Operating the worker: the admin and status HTTP API, the same actions from the command
//! line, and the retention sweeper.

pub mod api;
pub mod cli;
pub mod retention;
