//! `worker ops ...` (placeholder until the operations issue lands).

use crate::config::Settings;

#[derive(Debug, clap::Subcommand)]
pub enum OpsCommand {
    /// List unresolved operations.
    List,
}

pub async fn run(_settings: &Settings, _cmd: OpsCommand) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
