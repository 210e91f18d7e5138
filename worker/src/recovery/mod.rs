//! Recovery of unknown outcomes: the capability a tool declares ([`capability`]), the pure
//! decision ([`choose`]) and the scheduler that leases due rows and runs decisions, retries and
//! lease expiry ([`scheduler`]).

pub mod capability;
pub mod choose;
pub mod scheduler;

pub use capability::Capability;
