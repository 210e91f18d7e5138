//! `publisher mcp` as a child process (the MCP suite): started on a given port with a tools
//! file, killed when the handle drops, restartable on the same port.

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::procs::Output;

/// A running `publisher mcp --transport http`.
pub struct McpGateway {
    child: Child,
    pub port: u16,
    pub output: Output,
    env: BTreeMap<String, String>,
}

impl McpGateway {
    /// The MCP endpoint URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }

    /// Starts `publisher mcp` with `env` (AMQP_URL, PUBLISHER_MCP_TOOLS, ... ) on `port`, and
    /// waits until it listens.
    pub async fn start(port: u16, env: BTreeMap<String, String>) -> McpGateway {
        let bin = crate::procs::publisher_bin();
        let mut child = Command::new(&bin)
            .arg("mcp")
            .envs(&env)
            .env("PUBLISHER_MCP_ADDR", format!("127.0.0.1:{port}"))
            .env("RUST_LOG", "info,lapin=off")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
        let output = Output::default();
        output.capture(child.stderr.take().unwrap(), format!("mcp:{port}"));
        output.capture(child.stdout.take().unwrap(), format!("mcp:{port}"));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !output.contains("publisher mcp listening on") {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("publisher mcp exited ({status}):\n{}", output.text());
            }
            if tokio::time::Instant::now() > deadline {
                panic!("publisher mcp did not start:\n{}", output.text());
            }
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        McpGateway {
            child,
            port,
            output,
            env,
        }
    }

    /// Kills the gateway (SIGKILL: nothing is saved on the way out) and starts it again on the
    /// same port with the same settings.
    pub async fn restart(&mut self) {
        self.kill();
        let next = McpGateway::start(self.port, self.env.clone()).await;
        *self = next;
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for McpGateway {
    fn drop(&mut self) {
        self.kill();
    }
}
