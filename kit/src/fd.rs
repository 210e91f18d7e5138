//! Open-file descriptors: every socket (database pool, broker, downstream HTTP, each accepted
//! client connection) is one, and a process that runs out cannot connect anywhere: "Too many
//! open files" (EMFILE).
//!
//! At start-up a process calls [`prepare`] with its [`Budget`] (what it may hold open at once):
//! the soft `RLIMIT_NOFILE` is raised to the hard limit when lower (a plain `ulimit -n` of 1024
//! under a hard limit of 1048576 is common), and a warning names the numbers when the limit is
//! still below the budget. While running, [`local_exhaustion`] tells an error caused by this
//! process's own exhaustion (no descriptor, no buffer space, no memory, no local port) from one
//! the peer caused, so a caller never blames a downstream for it.

use std::fmt;

/// Descriptors every process needs besides its budgeted sockets: stdio, the runtime's epoll
/// and wake-up descriptors, files it reads (tools file, CA bundle), DNS lookups, a
/// connection being replaced while its successor opens.
pub const MARGIN: u64 = 64;

/// What a process may hold open at once, part by part.
#[derive(Debug, Clone, Default)]
pub struct Budget {
    parts: Vec<(String, u64)>,
}

impl Budget {
    pub fn new() -> Budget {
        Budget::default()
    }

    /// Adds `count` descriptors for `what` (e.g. "database pool", 10).
    pub fn add(mut self, what: impl Into<String>, count: u64) -> Budget {
        self.parts.push((what.into(), count));
        self
    }

    /// The parts plus [`MARGIN`]: the documented minimum for this process.
    pub fn total(&self) -> u64 {
        self.parts.iter().map(|(_, n)| n).sum::<u64>() + MARGIN
    }
}

impl fmt::Display for Budget {
    /// `database pool 10 + metrics listener 256 + ... + margin 64`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (what, n) in &self.parts {
            write!(f, "{what} {n} + ")?;
        }
        write!(f, "margin {MARGIN}")
    }
}

/// The process's `RLIMIT_NOFILE` after [`raise`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub soft: u64,
    pub hard: u64,
    /// The soft limit before it was raised, when it was.
    pub raised_from: Option<u64>,
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit when it is lower.
#[cfg(unix)]
pub fn raise() -> std::io::Result<Limit> {
    let mut rlim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rlim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // rlim_t is u64 here but not on every Unix.
    #[allow(clippy::unnecessary_cast)]
    let (soft, hard) = (rlim.rlim_cur as u64, rlim.rlim_max as u64);
    if soft >= hard {
        return Ok(Limit {
            soft,
            hard,
            raised_from: None,
        });
    }
    let raised = libc::rlimit {
        rlim_cur: rlim.rlim_max,
        rlim_max: rlim.rlim_max,
    };
    // SAFETY: setrlimit reads the struct we own.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(Limit {
        soft: hard,
        hard,
        raised_from: Some(soft),
    })
}

/// Without `RLIMIT_NOFILE` there is nothing to raise.
#[cfg(not(unix))]
pub fn raise() -> std::io::Result<Limit> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "RLIMIT_NOFILE is a Unix limit",
    ))
}

/// Start-up of `process` (e.g. "worker"): [`raise`]s the limit, logs the raise, and warns,
/// naming the limit and the budget part by part, when the limit is below `budget.total()`.
/// Returns the limit (None when it cannot be read).
pub fn prepare(process: &str, budget: &Budget) -> Option<Limit> {
    let limit = match raise() {
        Ok(limit) => limit,
        Err(error) => {
            tracing::warn!(%error, "{process}: cannot read or raise the open-file limit (RLIMIT_NOFILE)");
            return None;
        }
    };
    if let Some(from) = limit.raised_from {
        tracing::info!(
            from,
            to = limit.soft,
            "{process}: raised the open-file soft limit (RLIMIT_NOFILE) to the hard limit"
        );
    }
    let need = budget.total();
    if limit.soft < need {
        tracing::warn!(
            limit = limit.soft,
            hard = limit.hard,
            need,
            "{process}: the open-file limit (RLIMIT_NOFILE) is {}, below the {need} this process may hold \
             open ({budget}); once it runs out, connects fail with \"Too many open files\": raise the \
             hard limit (ulimit -Hn, systemd LimitNOFILE, the container's nofile ulimit) or lower the \
             pool sizes and connection caps",
            limit.soft
        );
    }
    Some(limit)
}

/// OS error codes that mean this process (or host) ran out of something, not that a peer
/// refused or failed: no descriptor left for the process (EMFILE) or the system (ENFILE), no
/// socket buffer space (ENOBUFS), no memory (ENOMEM), no free local port for the connect
/// (EADDRNOTAVAIL).
#[cfg(unix)]
pub const EXHAUSTION_ERRNOS: &[i32] = &[
    libc::EMFILE,
    libc::ENFILE,
    libc::ENOBUFS,
    libc::ENOMEM,
    libc::EADDRNOTAVAIL,
];
#[cfg(not(unix))]
pub const EXHAUSTION_ERRNOS: &[i32] = &[];

/// The OS error of `error`'s source chain that says this process ran out of a local resource
/// ([`EXHAUSTION_ERRNOS`]), if any: every `std::io::Error` in the chain (and one an io error
/// wraps) is checked with `raw_os_error()`.
pub fn local_exhaustion<'a>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a std::io::Error> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if let Some(found) = exhausted_io(io) {
                return Some(found);
            }
        }
        next = e.source();
    }
    None
}

fn exhausted_io(io: &std::io::Error) -> Option<&std::io::Error> {
    if io
        .raw_os_error()
        .is_some_and(|code| EXHAUSTION_ERRNOS.contains(&code))
    {
        return Some(io);
    }
    // A custom io error's `source()` skips the error it wraps; look at that one too.
    let inner = io.get_ref()?;
    let inner_io = inner.downcast_ref::<std::io::Error>()?;
    exhausted_io(inner_io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Wrapper(std::io::Error);
    impl fmt::Display for Wrapper {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("tcp open error")
        }
    }
    impl std::error::Error for Wrapper {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn exhaustion_is_found_anywhere_in_the_chain_and_only_for_local_errors() {
        let emfile = Wrapper(std::io::Error::from_raw_os_error(libc::EMFILE));
        let found = local_exhaustion(&emfile).expect("EMFILE is local exhaustion");
        assert_eq!(found.raw_os_error(), Some(libc::EMFILE));
        assert!(found.to_string().contains("Too many open files"), "{found}");
        let wrapped = std::io::Error::other(std::io::Error::from_raw_os_error(libc::ENOBUFS));
        assert!(local_exhaustion(&wrapped).is_some());
        for code in [libc::ECONNREFUSED, libc::ECONNRESET, libc::ETIMEDOUT] {
            let e = Wrapper(std::io::Error::from_raw_os_error(code));
            assert!(local_exhaustion(&e).is_none(), "{code}");
        }
    }

    #[test]
    fn the_budget_names_its_parts_and_adds_the_margin() {
        let b = Budget::new().add("database pool", 10).add("listener", 256);
        assert_eq!(b.total(), 10 + 256 + MARGIN);
        assert_eq!(
            b.to_string(),
            format!("database pool 10 + listener 256 + margin {MARGIN}")
        );
    }

    #[test]
    fn raise_never_lowers_the_limit() {
        let limit = raise().unwrap();
        assert_eq!(limit.soft, limit.hard);
        assert_eq!(raise().unwrap().raised_from, None);
    }
}
