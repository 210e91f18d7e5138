//! A TCP fault proxy for one link (worker → RabbitMQ, worker → Postgres, worker → a
//! downstream): it forwards connections to an upstream address and can lose the link without
//! restarting the shared service:
//!
//! - [`FaultProxy::cut`] resets every live connection and refuses new ones until
//!   [`FaultProxy::restore`]; [`FaultProxy::blackhole`] stalls them silently instead.
//! - [`FaultProxy::hold`] keeps every byte clients send (on live and new connections) in the
//!   proxy instead of forwarding it, while upstream → client keeps flowing;
//!   [`FaultProxy::release`] forwards all of it, in order, and resumes plain forwarding. A
//!   client's close or reset is held too: the upstream connection stays open and still gets
//!   the held bytes on release, then a half-close. That is a request delayed in flight that
//!   reaches the server after the client gave up. [`FaultProxy::held_bytes`] tells a test
//!   when the bytes are in the proxy.
//!
//! ```no_run
//! # async fn demo() {
//! let proxy = e2e::FaultProxy::start("127.0.0.1:5672").await;
//! let url = format!("amqp://guest:guest@{}/%2f", proxy.addr());
//! // ... start a worker with `url` ...
//! proxy.cut();                 // live connections are reset; new ones are refused
//! proxy.restore();             // connections are accepted again
//! proxy.hold();                // what clients send stays in the proxy
//! // ... wait until proxy.held_bytes() > 0, let the client time out and hang up ...
//! proxy.release();             // the server gets it all anyway
//! # }
//! ```

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
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
    /// While true, bytes from clients are kept in the proxy ([`FaultProxy::hold`]).
    hold: watch::Sender<bool>,
    /// Client bytes held in the proxy now, over all connections.
    held_bytes: AtomicU64,
}

impl FaultProxy {
    /// Starts forwarding `127.0.0.1:<ephemeral>` to `upstream` (host:port).
    pub async fn start(upstream: &str) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let (generation, _) = watch::channel(0u64);
        let (hold, _) = watch::channel(false);
        let state = Arc::new(State {
            cut: AtomicBool::new(false),
            generation,
            accepted: AtomicU64::new(0),
            hold,
            held_bytes: AtomicU64::new(0),
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
                let st = st.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(&upstream).await else {
                        let _ = client.shutdown().await;
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let silent = tokio::select! {
                        _ = forward(&mut client, &mut server, &st) => return,
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
    /// Held bytes of live connections are lost with them.
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

    /// Accepts connections again (and resets connections stalled by a black hole). Does not
    /// release a [`FaultProxy::hold`].
    pub fn restore(&self) {
        self.state.cut.store(false, Ordering::SeqCst);
        self.state.generation.send_modify(|g| *g += 2 - *g % 2);
    }

    /// From now on, bytes read from clients, on live and new connections, stay in the proxy
    /// instead of going upstream, until [`FaultProxy::release`]; upstream → client keeps
    /// flowing. A client that closes or resets its side meanwhile leaves its upstream
    /// connection open: its held bytes are still delivered on release.
    pub fn hold(&self) {
        self.state.hold.send_replace(true);
    }

    /// Forwards everything held, in order, and resumes plain forwarding. A connection whose
    /// client has gone meanwhile is then half-closed toward upstream (and kept until the
    /// server closes it, its answer discarded).
    pub fn release(&self) {
        self.state.hold.send_replace(false);
    }

    /// Client bytes held in the proxy now, over all connections (0 once released and
    /// forwarded, or when the connections holding them were cut).
    pub fn held_bytes(&self) -> u64 {
        self.state.held_bytes.load(Ordering::SeqCst)
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

/// Forwards one connection both ways until both directions have ended. Returns early, and
/// the caller drops both sockets, when a read fails (a reset), except a client's while held
/// (see [`client_to_upstream`]).
async fn forward(client: &mut TcpStream, server: &mut TcpStream, state: &State) {
    let (mut client_read, mut client_write) = client.split();
    let (mut server_read, mut server_write) = server.split();
    let _ = tokio::try_join!(
        client_to_upstream(&mut client_read, &mut server_write, state),
        upstream_to_client(&mut server_read, &mut client_write),
    );
}

/// Client bytes kept while the link is held, counted in [`State::held_bytes`] while here.
struct Held<'a> {
    bytes: Vec<u8>,
    total: &'a AtomicU64,
}

impl Held<'_> {
    fn push(&mut self, bytes: &[u8]) {
        self.bytes.extend_from_slice(bytes);
        self.total.fetch_add(bytes.len() as u64, Ordering::SeqCst);
    }

    async fn flush(&mut self, to: &mut (impl AsyncWrite + Unpin)) -> io::Result<()> {
        if self.bytes.is_empty() {
            return Ok(());
        }
        to.write_all(&self.bytes).await?;
        self.total
            .fetch_sub(self.bytes.len() as u64, Ordering::SeqCst);
        self.bytes.clear();
        Ok(())
    }
}

impl Drop for Held<'_> {
    /// A connection torn down while holding bytes (a cut) loses them.
    fn drop(&mut self) {
        self.total
            .fetch_sub(self.bytes.len() as u64, Ordering::SeqCst);
    }
}

/// Client → upstream, holding bytes while [`State::hold`] is set. The client's end (EOF, or
/// a reset while held or with bytes still held) is delivered after its bytes, as a
/// half-close. Any other read or write error is returned: the connection is torn down.
async fn client_to_upstream(
    from: &mut (impl AsyncRead + Unpin),
    to: &mut (impl AsyncWrite + Unpin),
    state: &State,
) -> io::Result<()> {
    let mut hold = state.hold.subscribe();
    let mut held = Held {
        bytes: Vec::new(),
        total: &state.held_bytes,
    };
    let mut chunk = vec![0u8; 16 * 1024];
    let mut client_ended = false;
    loop {
        if !*hold.borrow_and_update() {
            held.flush(to).await?;
            if client_ended {
                break;
            }
        } else if client_ended {
            // Held with the client gone: wait for the release.
            if hold.changed().await.is_err() {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            continue;
        }
        tokio::select! {
            read = from.read(&mut chunk) => match read {
                Ok(0) => client_ended = true,
                Ok(n) if *hold.borrow() => held.push(&chunk[..n]),
                Ok(n) => {
                    held.flush(to).await?;
                    to.write_all(&chunk[..n]).await?;
                }
                // A client that resets while its bytes are held does not take them along.
                Err(_) if *hold.borrow() || !held.bytes.is_empty() => client_ended = true,
                Err(e) => return Err(e),
            },
            changed = hold.changed() => {
                if changed.is_err() {
                    return Err(io::ErrorKind::BrokenPipe.into());
                }
            }
        }
    }
    to.shutdown().await
}

/// Upstream → client. Once the client cannot be written to (it has gone), the rest is read
/// and discarded, so the server can still answer a request released after the client left.
/// A read error (an upstream reset) is returned.
async fn upstream_to_client(
    from: &mut (impl AsyncRead + Unpin),
    to: &mut (impl AsyncWrite + Unpin),
) -> io::Result<()> {
    let mut chunk = vec![0u8; 16 * 1024];
    let mut client_gone = false;
    loop {
        let n = from.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        if !client_gone && to.write_all(&chunk[..n]).await.is_err() {
            client_gone = true;
        }
    }
    if !client_gone {
        let _ = to.shutdown().await;
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::sync::mpsc;

    /// What the upstream saw on its connection number `n` (in accept order).
    #[derive(Debug, PartialEq)]
    enum Seen {
        Bytes(usize, Vec<u8>),
        End(usize),
    }

    /// An upstream that greets each connection with `hi`, reports what it reads, and answers
    /// `bye` and closes once the client's side has ended.
    async fn upstream() -> (String, mpsc::UnboundedReceiver<Seen>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            for n in 0.. {
                let (mut socket, _) = listener.accept().await.unwrap();
                let tx = tx.clone();
                tokio::spawn(async move {
                    socket.write_all(b"hi").await.unwrap();
                    let mut buf = [0u8; 1024];
                    loop {
                        match socket.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(k) => {
                                let _ = tx.send(Seen::Bytes(n, buf[..k].to_vec()));
                            }
                        }
                    }
                    let _ = tx.send(Seen::End(n));
                    let _ = socket.write_all(b"bye").await;
                });
            }
        });
        (addr, rx)
    }

    async fn until(what: &str, mut ok: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !ok() {
            assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Everything connection `n` received, up to its end, within 5 s.
    async fn received(rx: &mut mpsc::UnboundedReceiver<Seen>, n: usize) -> Vec<u8> {
        let mut all = Vec::new();
        loop {
            let seen = tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .expect("the upstream hears within 5 s")
                .unwrap();
            match seen {
                Seen::Bytes(m, bytes) if m == n => all.extend(bytes),
                Seen::End(m) if m == n => return all,
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    async fn read_exactly(stream: &mut TcpStream, n: usize) -> Vec<u8> {
        let mut buf = vec![0u8; n];
        tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut buf))
            .await
            .expect("read within 5 s")
            .unwrap();
        buf
    }

    #[tokio::test]
    async fn held_bytes_reach_the_server_after_the_client_gave_up() {
        let (up, mut seen) = upstream().await;
        let proxy = FaultProxy::start(&up).await;
        proxy.hold();
        let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
        // Upstream → client still flows while held.
        assert_eq!(read_exactly(&mut client, 2).await, b"hi");
        client.write_all(b"POST /refunds").await.unwrap();
        client.write_all(b" HTTP/1.1").await.unwrap();
        until("22 bytes held", || proxy.held_bytes() == 22).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(seen.try_recv().is_err(), "nothing delivered while held");

        // The client gives up with a reset; the upstream connection stays open.
        client.set_zero_linger().unwrap();
        drop(client);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(seen.try_recv().is_err(), "no bytes and no end upstream");
        assert_eq!(proxy.held_bytes(), 22);

        proxy.release();
        assert_eq!(received(&mut seen, 0).await, b"POST /refunds HTTP/1.1");
        assert_eq!(proxy.held_bytes(), 0);
    }

    #[tokio::test]
    async fn a_held_close_follows_the_bytes_and_plain_forwarding_resumes() {
        let (up, mut seen) = upstream().await;
        let proxy = FaultProxy::start(&up).await;
        // Held on a connection made while held; the client half-closes and keeps reading.
        proxy.hold();
        let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
        client.write_all(b"abc").await.unwrap();
        client.shutdown().await.unwrap();
        until("3 bytes held", || proxy.held_bytes() == 3).await;
        assert_eq!(read_exactly(&mut client, 2).await, b"hi");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(seen.try_recv().is_err(), "nothing delivered while held");
        proxy.release();
        assert_eq!(received(&mut seen, 0).await, b"abc");
        // The server's answer to the released request reaches a client still reading.
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut rest))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(rest, b"bye");

        // Not held: bytes go straight through, and a client reset closes the upstream.
        let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
        client.write_all(b"xyz").await.unwrap();
        assert_eq!(read_exactly(&mut client, 2).await, b"hi");
        until("bytes delivered", || !seen.is_empty()).await;
        client.set_zero_linger().unwrap();
        drop(client);
        assert_eq!(received(&mut seen, 1).await, b"xyz");
        assert_eq!(proxy.held_bytes(), 0);
        assert_eq!(proxy.connections(), 2);
    }
}
