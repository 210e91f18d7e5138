//! TLS fixtures for tests/tls.rs, all made per test: a CA and server certificates (rcgen), a
//! TLS-terminating TCP forwarder in front of a plain service (AMQPS is TLS around AMQP; HTTPS
//! is TLS around HTTP), and a throwaway Postgres cluster of the test's own, with `ssl = on` or
//! with server settings the shared cluster must not have (initdb into a temp dir, its own port
//! and socket directory; the shared cluster is never touched). Real handshakes with real
//! certificates: nothing here disables verification.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;
use tokio_rustls::TlsAcceptor;

/// A certificate authority made for one test.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A server certificate and its key, PEM.
#[derive(Clone)]
pub struct ServerCert {
    pub cert_pem: String,
    pub key_pem: String,
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("CA key");
        TestCa {
            issuer: CertifiedIssuer::self_signed(params, key).expect("CA certificate"),
        }
    }

    /// The CA certificate, PEM.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// Writes the CA certificate to `dir/<file>` (a `WORKER_CA_FILE`) and returns the path.
    pub fn write(&self, dir: &Path, file: &str) -> PathBuf {
        let path = dir.join(file);
        std::fs::write(&path, self.pem()).expect("write CA file");
        path
    }

    /// A server certificate for `names` (DNS names or IP addresses), signed by this CA.
    pub fn server_cert(&self, names: &[&str]) -> ServerCert {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names.clone()).expect("server params");
        params
            .distinguished_name
            .push(DnType::CommonName, names[0].clone());
        let key = KeyPair::generate().expect("server key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        ServerCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

impl ServerCert {
    /// A rustls acceptor presenting this certificate.
    pub fn acceptor(&self) -> TlsAcceptor {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs = CertificateDer::pem_slice_iter(self.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .expect("cert PEM");
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).expect("key PEM");
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("server config");
        TlsAcceptor::from(Arc::new(config))
    }
}

/// Accepts TLS on a local port and forwards the plaintext to `upstream`. Stops (with every
/// forwarded connection) when dropped.
pub struct TlsForwarder {
    pub port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl TlsForwarder {
    pub async fn start(cert: &ServerCert, upstream: SocketAddr) -> TlsForwarder {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let acceptor = cert.acceptor();
        let task = tokio::spawn(async move {
            // Connection tasks live in the set, so aborting this task ends them too.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    continue;
                };
                let acceptor = acceptor.clone();
                connections.spawn(async move {
                    // A client that refuses the certificate ends the handshake: nothing to do.
                    let Ok(mut tls) = acceptor.accept(socket).await else {
                        return;
                    };
                    let Ok(mut plain) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
                while connections.try_join_next().is_some() {}
            }
        });
        TlsForwarder { port, task }
    }
}

impl Drop for TlsForwarder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The local RabbitMQ's plain AMQP address (from `TEST_AMQP_URL`).
pub fn broker_addr() -> SocketAddr {
    let url = crate::env::amqp_url();
    let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let hostport = rest.split(['/', '?']).next().unwrap_or("127.0.0.1:5672");
    let hostport = if hostport.contains(':') {
        hostport.to_string()
    } else {
        format!("{hostport}:5672")
    };
    std::net::ToSocketAddrs::to_socket_addrs(&hostport)
        .ok()
        .and_then(|mut a| a.next())
        .unwrap_or_else(|| "127.0.0.1:5672".parse().unwrap())
}

/// `url` (an `amqp://` URL of the test broker) as `amqps://` through a forwarder on `port`,
/// addressed by `host` (the name the client verifies).
pub fn amqps_url(url: &str, host: &str, port: u16) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let (userinfo, after) = match rest.rsplit_once('@') {
        Some((u, a)) => (format!("{u}@"), a),
        None => (String::new(), rest),
    };
    let path = after.find(['/', '?']).map_or("", |i| &after[i..]);
    format!("amqps://{userinfo}{host}:{port}{path}")
}

/// A Postgres cluster of one test, listening on 127.0.0.1 only, with TLS on
/// ([`PgCluster::start`]) or with settings of its own ([`PgCluster::start_with`]). Stopped and
/// deleted when dropped.
pub struct PgCluster {
    dir: PathBuf,
    bin: PathBuf,
    pub port: u16,
    as_postgres: bool,
}

/// The directory of initdb/pg_ctl (`PG_BIN_DIR`, else the newest /usr/lib/postgresql/*/bin).
pub fn pg_bin() -> PathBuf {
    if let Some(dir) = std::env::var_os("PG_BIN_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path().join("bin"))
                .filter(|p| p.join("initdb").exists())
                .collect()
        })
        .unwrap_or_default();
    found.sort_by_key(|p| {
        p.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    found
        .pop()
        .expect("no initdb under /usr/lib/postgresql/*/bin (set PG_BIN_DIR)")
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Options of [`PgCluster::start_with`].
#[derive(Clone, Copy, Default)]
pub struct PgClusterOptions<'a> {
    /// `ssl = on` with this certificate; `None`: plain connections only.
    pub cert: Option<&'a ServerCert>,
    /// Lines added to `postgresql.conf` after the fixture's own, e.g. `autovacuum_naptime = 1s`.
    pub settings: &'a [&'a str],
}

impl PgCluster {
    /// initdb + `ssl = on` with `cert` + start; blocks a few seconds.
    pub fn start(cert: &ServerCert) -> PgCluster {
        PgCluster::start_with(PgClusterOptions {
            cert: Some(cert),
            ..PgClusterOptions::default()
        })
    }

    /// initdb + `opts` + start; blocks a few seconds.
    pub fn start_with(opts: PgClusterOptions<'_>) -> PgCluster {
        let dir =
            std::env::temp_dir().join(format!("intent-e2e-pg-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let port = crate::free_port();
        let cluster = PgCluster {
            dir: dir.clone(),
            bin: pg_bin(),
            port,
            // initdb and postgres refuse to run as root: run them as the `postgres` user.
            as_postgres: is_root(),
        };
        let data = dir.join("data");
        if let Some(cert) = opts.cert {
            std::fs::write(dir.join("server.crt"), &cert.cert_pem).unwrap();
            std::fs::write(dir.join("server.key"), &cert.key_pem).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(
                dir.join("server.key"),
                std::fs::Permissions::from_mode(0o600),
            )
            .unwrap();
        }
        if cluster.as_postgres {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .expect("chown")
                .success();
            assert!(ok, "chown of {}", dir.display());
        }
        cluster.run(
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        );
        let mut conf = format!(
            "\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{dir}'\n\
             fsync = off\nmax_connections = 50\n",
            dir = dir.display()
        );
        if opts.cert.is_some() {
            conf.push_str(&format!(
                "ssl = on\nssl_cert_file = '{dir}/server.crt'\nssl_key_file = '{dir}/server.key'\n",
                dir = dir.display()
            ));
        }
        for line in opts.settings {
            conf.push_str(line);
            conf.push('\n');
        }
        let conf_path = data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf_path).expect("postgresql.conf");
        text.push_str(&conf);
        std::fs::write(&conf_path, text).unwrap();
        cluster.run(
            "pg_ctl",
            &[
                "-D",
                data.to_str().unwrap(),
                "-l",
                dir.join("log").to_str().unwrap(),
                "-w",
                "-t",
                "60",
                "start",
            ],
        );
        cluster
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let exe = self.bin.join(tool);
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        let out = cmd.args(args).output().expect("run a Postgres tool");
        assert!(
            out.status.success(),
            "{tool} failed: {}\n{}\nlog: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
        );
    }

    /// A URL of database `db` as user postgres at `host` (the name TLS verifies), with
    /// `params` as the query (e.g. `sslmode=verify-full`).
    pub fn url(&self, host: &str, db: &str, params: &str) -> String {
        format!(
            "postgres://postgres@{host}:{port}/{db}?{params}",
            port = self.port
        )
    }

    /// Creates a database (over a plain connection) and returns its name.
    pub async fn create_database(&self, name: &str) -> String {
        let admin = sqlx::PgPool::connect(&self.url("127.0.0.1", "postgres", "sslmode=disable"))
            .await
            .expect("connect to the test cluster");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&admin)
            .await
            .expect("create database");
        admin.close().await;
        name.to_string()
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let data = self.dir.join("data");
        let exe = self.bin.join("pg_ctl");
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        let _ = cmd
            .arg("-D")
            .arg(&data)
            .args(["-m", "immediate", "-w", "-t", "20", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Waits up to `timeout` for a child to exit; its status code, or `None` while it runs.
pub async fn exit_within(worker: &mut crate::Worker, timeout: Duration) -> Option<i32> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(status) = worker.exit_status() {
            return Some(status.code().unwrap_or(-1));
        }
        if tokio::time::Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
