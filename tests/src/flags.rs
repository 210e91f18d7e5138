//! Command-line flags of the e2e binaries (`soak`, `throughput`): `--flag value` or
//! `--flag=value`, and `-h`/`--help` printing the usage. Each binary matches the flags it knows.

use anyhow::{anyhow, Result};

/// The `(flag, value)` pairs of this process's arguments, in order. Prints `usage` and exits 0
/// on `-h`/`--help`; a flag without its value is an error that shows `usage`.
pub fn pairs(usage: &str) -> Result<Vec<(String, String)>> {
    pairs_from(std::env::args().skip(1), usage)
}

/// [`pairs`] over given arguments (a binary that takes value-less switches removes them
/// first).
pub fn pairs_from(
    args: impl IntoIterator<Item = String>,
    usage: &str,
) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (arg.clone(), None),
        };
        if flag == "--help" || flag == "-h" {
            println!("{usage}");
            std::process::exit(0);
        }
        let value = match inline {
            Some(v) => v,
            None => it
                .next()
                .ok_or_else(|| anyhow!("{flag} needs a value\n{usage}"))?,
        };
        out.push((flag, value));
    }
    Ok(out)
}
