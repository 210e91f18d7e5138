//! Opening a RabbitMQ connection with the whole of it bounded: the TCP connect, the TLS
//! handshake and the AMQP handshake up to `Connection.Open-Ok`, all within the URL's
//! `connection_timeout`.
//!
//! lapin's own `connection_timeout` covers the TCP connect only. A node that accepts TCP and
//! never answers the protocol header (a broker stuck booting, a port forwarded to nothing, a
//! load balancer with no backend) would otherwise hold the caller forever, and a caller with a
//! list of nodes would never try the next one. Dropping lapin's connect future is not enough:
//! lapin drives the socket from its own I/O thread, which would sit on the silent socket for
//! good. So each socket lapin is given is remembered (a duplicate of its descriptor), and on
//! time-out it is shut down: lapin's thread reads the end of the stream, gives up the
//! connection and exits, and later attempts of the same connect are refused.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::tcp::{AMQPUriTcpExt, AsyncTcpStream, OwnedTLSConfig};
use lapin::uri::AMQPUri;
use lapin::{Connection, ConnectionProperties};

use crate::lock;

/// The bound on a whole connect when the URL sets no `connection_timeout`, in milliseconds.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 10_000;

/// The AMQP heartbeat the worker and the publisher ask for unless told otherwise, in seconds: a
/// link that goes silent without a reset (a partition, a dropped NAT entry) is declared lost
/// after about two missed beats, about 20 s, instead of two of RabbitMQ's default 60 s.
pub const DEFAULT_HEARTBEAT_SECS: u16 = 10;

/// Asks for a `secs` heartbeat on `uri` unless the URL sets `?heartbeat=` itself (`secs` 0:
/// leave it to the broker); the broker and lapin settle on the lower of both.
pub fn ask_heartbeat(uri: &mut AMQPUri, secs: u16) {
    if uri.query.heartbeat.is_none() && secs > 0 {
        uri.query.heartbeat = Some(secs);
    }
}

/// Where one connect stands, as the socket closure and the caller share it.
enum Phase {
    /// Still connecting: the sockets handed to lapin so far (duplicated descriptors).
    Connecting(Vec<OwnedFd>),
    /// Over (connected or failed in time): later sockets, from lapin's own reconnects, are
    /// lapin's business.
    Settled,
    /// Timed out: the sockets were shut down and no new one is opened.
    Abandoned,
}

/// Opens a connection to `uri` (`amqps://` verified with `tls`), the whole handshake within
/// the URL's `connection_timeout` ([`DEFAULT_CONNECT_TIMEOUT_MS`] when absent, and then set on
/// the URL, so that it bounds the TCP connect too). A node that does not finish in time is an
/// I/O error of kind `TimedOut` naming the bound.
pub async fn connect(
    mut uri: AMQPUri,
    properties: ConnectionProperties,
    tls: OwnedTLSConfig,
) -> lapin::Result<Connection> {
    let within = Duration::from_millis(
        *uri.query
            .connection_timeout
            .get_or_insert(DEFAULT_CONNECT_TIMEOUT_MS),
    );
    let runtime = lapin::runtime::default_runtime()?;
    let phase = Arc::new(Mutex::new(Phase::Connecting(Vec::new())));
    let shared = phase.clone();
    // Written in the call, so that lapin's signature gives the stream its type.
    let connecting = Connection::connector(
        uri,
        runtime,
        async move |uri, runtime| {
            if matches!(*lock(&shared), Phase::Abandoned) {
                return Err(timed_out(within));
            }
            // lapin runs this on its I/O thread; the bound here covers a TLS handshake that
            // stalls before a socket could be handed over (and remembered).
            let stream = tokio::time::timeout(
                within,
                uri.connect_with_config_async(tls.as_ref(), &runtime),
            )
            .await
            .map_err(|_| timed_out(within))??;
            let socket = match &stream {
                AsyncTcpStream::Plain(tcp) => Some(tcp.get_ref().as_fd().try_clone_to_owned()?),
                AsyncTcpStream::Rustls(tls) => {
                    Some(tls.get_ref().0.get_ref().as_fd().try_clone_to_owned()?)
                }
                _ => None,
            };
            match &mut *lock(&shared) {
                // Dropping the stream closes the socket.
                Phase::Abandoned => return Err(timed_out(within)),
                Phase::Connecting(sockets) => sockets.extend(socket),
                Phase::Settled => {}
            }
            Ok(stream)
        },
        properties,
    );
    let outcome = tokio::time::timeout(within, connecting).await;
    let mut phase = lock(&phase);
    let next = if outcome.is_ok() {
        Phase::Settled
    } else {
        Phase::Abandoned
    };
    if let Phase::Connecting(sockets) = std::mem::replace(&mut *phase, next) {
        if outcome.is_err() {
            for socket in sockets {
                // Shutting down a duplicate ends the connection lapin holds; closing it alone
                // would not. An error here means the socket is already gone.
                let _ = std::net::TcpStream::from(socket).shutdown(std::net::Shutdown::Both);
            }
        }
    }
    outcome.unwrap_or_else(|_| Err(timed_out(within)))
}

fn timed_out(within: Duration) -> lapin::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "no AMQP handshake within {} ms (connection_timeout)",
            within.as_millis()
        ),
    )
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// The tests count the process's threads and descriptors: one at a time.
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    /// lapin's I/O threads alive in this process.
    fn io_threads() -> usize {
        std::fs::read_dir("/proc/self/task")
            .expect("/proc/self/task")
            .filter(|task| {
                let comm = task.as_ref().unwrap().path().join("comm");
                std::fs::read_to_string(comm).is_ok_and(|name| name.trim() == "lapin-io-loop")
            })
            .count()
    }

    /// This process's descriptors of TCP sockets whose peer is at `port` (a socket held
    /// twice counts twice).
    fn descriptors_to(port: u16) -> usize {
        let peer = format!(":{port:04X}");
        let mut inodes = std::collections::HashSet::new();
        for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
            for line in std::fs::read_to_string(table).unwrap().lines().skip(1) {
                let fields: Vec<&str> = line.split_whitespace().collect();
                if fields[2].ends_with(&peer) {
                    inodes.insert(format!("socket:[{}]", fields[9]));
                }
            }
        }
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
            .filter(|link| inodes.contains(link.to_str().unwrap_or_default()))
            .count()
    }

    async fn settle<T: PartialOrd + std::fmt::Debug>(what: &str, limit: T, read: impl Fn() -> T) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while read() > limit {
            assert!(
                Instant::now() < deadline,
                "{what}: {:?}, more than {limit:?}",
                read()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A node that accepts TCP and never says a word: each connect, plain or TLS, fails with
    /// `TimedOut` at about the URL's bound, and lapin's thread for it ends rather than waiting
    /// on the socket.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_node_that_never_answers_costs_the_bound_and_leaves_no_thread() {
        let _alone = ONE_AT_A_TIME.lock().await;
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = silent.local_addr().unwrap();
        let held = Arc::new(Mutex::new(Vec::new()));
        let keep = held.clone();
        std::thread::spawn(move || {
            for socket in silent.incoming().flatten() {
                keep.lock().unwrap().push(socket);
            }
        });
        let before = io_threads();
        for attempt in 0..10 {
            // Half of them as TLS, which the node leaves waiting for its ServerHello.
            let scheme = if attempt % 2 == 0 { "amqp" } else { "amqps" };
            let uri: AMQPUri = format!("{scheme}://guest:guest@{addr}/%2f?connection_timeout=300")
                .parse()
                .unwrap();
            let started = Instant::now();
            let error = connect(
                uri,
                ConnectionProperties::default(),
                OwnedTLSConfig::default(),
            )
            .await
            .expect_err("a node that never answers");
            let took = started.elapsed();
            assert!(
                matches!(error.kind(), lapin::ErrorKind::IOError(io) if io.kind() == std::io::ErrorKind::TimedOut),
                "attempt {attempt}: {error}"
            );
            assert!(error.to_string().contains("within 300 ms"), "{error}");
            assert!(
                took >= Duration::from_millis(290) && took < Duration::from_secs(5),
                "attempt {attempt} took {took:?}"
            );
        }
        assert_eq!(held.lock().unwrap().len(), 10, "one socket per attempt");
        settle("lapin I/O threads left behind", before, io_threads).await;
        held.lock().unwrap().clear();
    }

    /// A connection that opened keeps no second descriptor of its socket, so closing it
    /// closes the socket.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_that_opens_holds_its_socket_once() {
        let _alone = ONE_AT_A_TIME.lock().await;
        let url = std::env::var("TEST_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        let port = url.parse::<AMQPUri>().unwrap().authority.port;
        let connection = connect(
            url.parse().unwrap(),
            ConnectionProperties::default(),
            OwnedTLSConfig::default(),
        )
        .await
        .expect("the test broker");
        assert!(connection.status().connected());
        assert_eq!(descriptors_to(port), 1, "the socket, once");
        connection.close(200, "done".into()).await.unwrap();
        drop(connection);
        settle("descriptors of the closed socket", 0, || {
            descriptors_to(port)
        })
        .await;
    }
}
