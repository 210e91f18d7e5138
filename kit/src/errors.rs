//! Error messages on one line: the error and its causes, each cause once.

/// Formats an error with its whole cause chain, each cause once: a cause whose text the message
/// already contains is skipped. Our own error types put a cause either in their message or in
/// `source()`, never both, but sqlx and lapin errors do both ("error returned from database: X"
/// with source X), which `{:#}` would print twice or three times.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !text.is_empty() && !s.contains(&text) {
            if !s.is_empty() {
                s.push_str(": ");
            }
            s.push_str(&text);
        }
        source = cause.source();
    }
    s
}

#[cfg(test)]
mod tests {
    #[derive(Debug)]
    struct Wrapped(&'static str, std::io::Error);

    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Wrapped {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.1)
        }
    }

    #[test]
    fn each_cause_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let repeats = Wrapped("cannot read tools file /x: no such file", io());
        assert_eq!(
            super::chain(&repeats),
            "cannot read tools file /x: no such file"
        );
        let adds = Wrapped("starting", io());
        assert_eq!(super::chain(&adds), "starting: no such file");
    }
}
