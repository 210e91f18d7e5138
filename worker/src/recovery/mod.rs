//! Recovery of unknown outcomes: the pure decision ([`choose`]) and the scheduler that leases
//! due rows and runs decisions, retries and lease expiry ([`scheduler`]).

pub mod choose;
pub mod scheduler;
