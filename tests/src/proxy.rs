//! A TCP fault proxy for one link (worker → RabbitMQ, worker → Postgres): it forwards
//! connections to an upstream address and can cut every live connection and refuse new ones
//! until restored, so a test can lose a link without restarting the shared service.
//!
//! ```no_run
//! # async fn demo() {
//! let proxy = e2e::FaultProxy::start("127.0.0.1:5672").await;
//! let url = format!("amqp://guest:guest@{}/%2f", proxy.addr());
//! // ... start a worker with `url` ...
//! proxy.cut();                 // live connections are reset; new ones are refused
//! proxy.restore();             // connections are accepted again
//! # }
//! ```

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A forwarding proxy on an ephemeral loopback port. Dropping it stops it and closes every
/// connection it carries.
pub struct FaultProxy {
    addr: SocketAddr,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

struct State {
    /// While set, new connections are closed at once and live ones are torn down.
    cut: AtomicBool,
    /// Bumped by every cut, black hole and restore (odd = stall, even = reset); each
    /// forwarded connection watches it.
    generation: watch::Sender<u64>,
    accepted: AtomicU64,
}

impl FaultProxy {
    /// Starts forwarding `127.0.0.1:<ephemeral>` to `upstream` (host:port).
    pub async fn start(upstream: &str) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let (generation, _) = watch::channel(0u64);
        let state = Arc::new(State {
            cut: AtomicBool::new(false),
            generation,
            accepted: AtomicU64::new(0),
        });
        let upstream = upstream.to_string();
        let st = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                if st.cut.load(Ordering::SeqCst) {
                    // Refused while cut: the peer sees the connection closed at once.
                    let _ = client.set_zero_linger();
                    drop(client);
                    continue;
                }
                st.accepted.fetch_add(1, Ordering::SeqCst);
                let mut cut_seen = st.generation.subscribe();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(&upstream).await else {
                        let _ = client.shutdown().await;
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let silent = tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => return,
                        _ = cut_seen.changed() => *cut_seen.borrow_and_update() % 2 == 1,
                    };
                    if silent {
                        // A black hole: both sockets stay open and nothing moves until the
                        // link is restored (then they are reset, as a peer that timed out).
                        let _ = cut_seen.changed().await;
                    }
                    // Reset rather than close gracefully: a lost link, not a goodbye.
                    let _ = client.set_zero_linger();
                    let _ = server.set_zero_linger();
                });
            }
        });
        FaultProxy { addr, state, task }
    }

    /// The proxy's own address (`127.0.0.1:<port>`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Resets every live connection and refuses new ones until [`FaultProxy::restore`].
    pub fn cut(&self) {
        self.state.cut.store(true, Ordering::SeqCst);
        // Even generations mean "reset".
        self.state.generation.send_modify(|g| *g += 2 - *g % 2);
    }

    /// Stops moving bytes on live connections without closing them (a silent network
    /// partition: only heartbeats or timeouts notice) and refuses new ones, until
    /// [`FaultProxy::restore`], which then resets the stalled connections.
    pub fn blackhole(&self) {
        self.state.cut.store(true, Ordering::SeqCst);
        // Odd generations mean "stall".
        self.state.generation.send_modify(|g| *g += 1 + *g % 2);
    }

    /// Accepts connections again (and resets connections stalled by a black hole).
    pub fn restore(&self) {
        self.state.cut.store(false, Ordering::SeqCst);
        self.state.generation.send_modify(|g| *g += 2 - *g % 2);
    }

    /// Whether the link is cut now.
    pub fn is_cut(&self) -> bool {
        self.state.cut.load(Ordering::SeqCst)
    }

    /// Connections forwarded so far (a reconnect shows up as one more).
    pub fn connections(&self) -> u64 {
        self.state.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.state.generation.send_modify(|g| *g += 2 - *g % 2);
    }
}

/// The `host:port` of a service URL (`amqp://u:p@h:5672/%2f` gives `h:5672`).
pub fn host_port(url: &str) -> String {
    let after_at = url.rsplit_once('@').map_or(url, |(_, r)| r);
    let after_scheme = after_at.split_once("://").map_or(after_at, |(_, r)| r);
    after_scheme
        .split(['/', '?'])
        .next()
        .unwrap_or(after_scheme)
        .to_string()
}

/// `url` with its `host:port` replaced by `addr` (a [`FaultProxy`] in front of the service).
pub fn via(url: &str, addr: std::net::SocketAddr) -> String {
    url.replacen(&host_port(url), &addr.to_string(), 1)
}
