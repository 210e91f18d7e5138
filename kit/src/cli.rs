//! Command lines configured from the environment (feature `cli`): what both binaries' clap
//! parsers share.

/// Makes an environment variable that is set but blank count as unset for every argument of
/// `cmd` and its subcommands, as the documentation promises (compose files and Helm values
/// often render `FOO=`, and `FOO=$BAR` gives `FOO=` when `BAR` is not exported). clap itself
/// would hand the empty string to the value parser.
pub fn blank_env_is_unset(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|arg| {
        let blank = arg
            .get_env()
            .and_then(std::env::var_os)
            .is_some_and(|v| v.to_string_lossy().trim().is_empty());
        if blank {
            arg.env(None::<&'static str>)
        } else {
            arg
        }
    })
    .mut_subcommands(blank_env_is_unset)
}
