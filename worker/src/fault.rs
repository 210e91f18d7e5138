//! Named stop points for crash tests (docs/design.md section 9), compiled only with the
//! `fault-points` feature; in any other build [`point`] is an empty inline function.
//!
//! `WORKER_FAULT_POINT=<name>` (optionally `WORKER_FAULT_ACTION=<action_id>`) makes the worker
//! announce `fault point reached: <name> ...` on stderr and stop its whole process with SIGSTOP
//! the first time it reaches that point, so a test can SIGKILL it there (or SIGCONT it to model
//! a paused worker). `WORKER_FAULT_POINT=crash_on_intake` with `WORKER_FAULT_ACTION` aborts the
//! process every time that action is taken from the queue: a poison message.

/// Points a test can stop at.
pub const POINTS: [&str; 7] = [
    "after_prepared",
    "after_dispatching",
    "before_send",
    "after_send_fence",
    "after_response",
    "after_succeeded",
    "crash_on_intake",
];

#[cfg(feature = "fault-points")]
mod imp {
    use std::sync::atomic::{AtomicBool, Ordering};

    static FIRED: AtomicBool = AtomicBool::new(false);

    extern "C" {
        fn raise(sig: i32) -> i32;
    }
    const SIGSTOP: i32 = 19;

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
        eprintln!("fault point reached: {name} action_id={action_id}; stopping (SIGSTOP)");
        // SAFETY: raise(3) with a valid signal number has no memory-safety preconditions.
        unsafe {
            raise(SIGSTOP);
        }
        eprintln!("fault point resumed: {name} action_id={action_id}");
    }
}

/// Stops here if a test armed this point for this action (no-op without the feature).
#[inline]
pub fn point(_name: &str, _action_id: &str) {
    #[cfg(feature = "fault-points")]
    imp::point(_name, _action_id);
}
