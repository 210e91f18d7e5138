//! e2e helpers
