//! Named stop points for crash tests (docs/design.md section 9), compiled only with the
//! `fault-points` feature; in any other build [`point`] is an empty inline function.
//!
//! `WORKER_FAULT_POINT=<name>` (optionally `WORKER_FAULT_ACTION=<action_id>`) makes the worker
//! announce `fault point reached: <name> ...` on stderr and stop its whole process with SIGSTOP
//! the first time it reaches that point, so a test can SIGKILL it there (or SIGCONT it to model
//! a paused worker). `WORKER_FAULT_POINT=crash_on_intake` with `WORKER_FAULT_ACTION` aborts the
//! process every time that action is taken from the queue: a poison message.

/// Points a test can stop at.
pub const POINTS: [&str; 13] = [
    "after_ledger_connected",
    "after_prepared",
    "after_dispatching",
    "before_send",
    "after_send_fence",
    "after_response",
    "after_succeeded",
    "after_results_confirmed",
    "crash_on_intake",
    "after_accepted",
    "before_poll",
    "after_poll",
    "after_approval",
];

#[cfg(feature = "fault-points")]
mod imp {
    use std::sync::atomic::{AtomicBool, Ordering};

    static FIRED: AtomicBool = AtomicBool::new(false);

    fn armed(name: &str, action_id: &str) -> bool {
        let point = std::env::var("WORKER_FAULT_POINT").unwrap_or_default();
        if point != name {
            return false;
        }
        match std::env::var("WORKER_FAULT_ACTION") {
            Ok(a) if !a.is_empty() => a == action_id,
            _ => true,
        }
    }

    pub fn point(name: &str, action_id: &str) {
        if !armed(name, action_id) {
            return;
        }
        if name == "crash_on_intake" {
            eprintln!("fault point reached: {name} action_id={action_id}; aborting");
            std::process::abort();
        }
        if FIRED.swap(true, Ordering::SeqCst) {
            return;
        }
        kit::fault::stop_here(&format!("{name} action_id={action_id}"));
    }
}

/// Stops here if a test armed this point for this action (no-op without the feature).
#[inline]
pub fn point(_name: &str, _action_id: &str) {
    #[cfg(feature = "fault-points")]
    imp::point(_name, _action_id);
}
