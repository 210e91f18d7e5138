//! How a named fault point stops a process for a crash test: it says so on stderr, then the
//! whole process stops with SIGSTOP, so the test can SIGKILL it exactly there (a crash) or
//! SIGCONT it (a pause). Which points exist and when they are armed (`WORKER_FAULT_POINT`,
//! `PUBLISHER_FAULT_POINT`) is each binary's own, compiled only with its `fault-points` feature.

/// Announces `fault point reached: <what>; stopping (SIGSTOP)`, stops the process, and
/// announces `fault point resumed: <what>` once it is continued.
pub fn stop_here(what: &str) {
    eprintln!("fault point reached: {what}; stopping (SIGSTOP)");
    // SAFETY: raise(3) with a valid signal number has no memory-safety preconditions.
    unsafe {
        libc::raise(libc::SIGSTOP);
    }
    eprintln!("fault point resumed: {what}");
}
