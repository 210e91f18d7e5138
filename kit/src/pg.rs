//! Which Postgres server a process writes to (the worker's ledger, the publisher's agent
//! database): the hosts its URL names (libpq's multi-host form `postgres://u@h1:5432,h2:5433/db`),
//! the one that is the primary now, and leaving a server at once when it turns read-only or goes
//! away (a failover, a switchover, a stale DNS name that points at a standby).
//!
//! [`pool`] builds the pool with these rules wired in; [`Hosts::observe`] is what its users call
//! with every failed statement.
//!
//! - Every new pooled connection is checked (`SHOW transaction_read_only`) unless the URL says
//!   `target_session_attrs=any`: a connection to a standby is refused before any statement, and
//!   the pool tries again.
//! - A statement that fails because the server is read-only (SQLSTATE 25006) or is going away
//!   (57P01–57P03, class 08) retires every connection opened until then: they are closed when
//!   next taken from the pool instead of failing one statement each for as long as they live.
//! - With several hosts, such a failure (or a broken connection) starts a search: the hosts are
//!   tried in the URL's order and the first writable one becomes where new connections go.
//!
//! At start, [`waiting_at_start`] waits for a server that is not reachable yet (compose or
//! Kubernetes starting everything at once) instead of exiting.
//!
//! The statement that failed is retried by its caller (the worker's batch or outcome, the
//! relay's next step); an indeterminate commit is safe to repeat because every state change is
//! a conditional statement on a unique key (docs/design.md).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use metrics::counter;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::Connection as _;
use tokio::sync::Notify;

/// How long one host gets to accept a connection during a search.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);
/// Pause between two passes over the hosts while none is writable (a promotion takes a moment).
const SEARCH_PAUSE: Duration = Duration::from_millis(250);

/// Whose database it is, for messages and the failover counter.
#[derive(Clone, Copy, Debug)]
pub struct Role {
    /// What the database is to its user, in messages: "ledger", "agent database".
    pub what: &'static str,
    /// The setting that names it: `DATABASE_URL`, `PUBLISHER_DATABASE_URL`.
    pub var: &'static str,
    /// Counter of failovers seen (a primary that turned read-only, a move to another host).
    pub failovers: &'static str,
}

/// The hosts of one database URL and which one is in use.
pub struct Hosts {
    role: Role,
    candidates: Vec<PgConnectOptions>,
    names: Vec<String>,
    /// Only writable servers are kept (`target_session_attrs` other than `any`).
    read_write: bool,
    current: AtomicUsize,
    /// Connections opened before this are retired (see the module doc).
    retired_before: Mutex<Instant>,
    searching: AtomicBool,
    /// Why the ledger is not usable right now, while a search runs (for `/readyz`).
    trouble: Mutex<Option<String>>,
    wake: Notify,
}

/// Why a database URL cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum HostsError {
    #[error("target_session_attrs={0} is not supported: this process writes; use read-write (the default), primary or any")]
    SessionAttrs(String),
    #[error("{0}")]
    Url(#[from] sqlx::Error),
}

impl Hosts {
    /// Parses a single- or multi-host URL; `options` builds one host's connect options (TLS
    /// trust is applied there).
    pub fn from_url(
        url: &str,
        role: Role,
        options: impl Fn(&str) -> Result<PgConnectOptions, sqlx::Error>,
    ) -> Result<Hosts, HostsError> {
        const ATTRS: &str = "target_session_attrs";
        let read_write = match crate::url::query_param(url, ATTRS) {
            None | Some("read-write") | Some("primary") => true,
            Some("any") => false,
            Some(other) => return Err(HostsError::SessionAttrs(other.to_string())),
        };
        // sqlx does not know the parameter (it would warn on every connection).
        let url = crate::url::without_param(url, ATTRS);
        let mut candidates = Vec::new();
        let mut names = Vec::new();
        for one in crate::url::split_hosts(&url) {
            candidates.push(options(&one)?);
            names.push(crate::url::host_port(&one));
        }
        Ok(Hosts::new(role, candidates, names, read_write))
    }

    /// One host, checked as `read_write` says (a pool built elsewhere, tests).
    pub fn single(role: Role, options: PgConnectOptions, read_write: bool) -> Hosts {
        let name = format!("{}:{}", options.get_host(), options.get_port());
        Hosts::new(role, vec![options], vec![name], read_write)
    }

    fn new(
        role: Role,
        candidates: Vec<PgConnectOptions>,
        names: Vec<String>,
        read_write: bool,
    ) -> Hosts {
        Hosts {
            role,
            candidates,
            names,
            read_write,
            current: AtomicUsize::new(0),
            retired_before: Mutex::new(Instant::now() - Duration::from_secs(1)),
            searching: AtomicBool::new(false),
            trouble: Mutex::new(None),
            wake: Notify::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.candidates.len()
    }

    pub fn is_empty(&self) -> bool {
        self.candidates.is_empty()
    }

    /// Whether connections must be writable.
    pub fn read_write(&self) -> bool {
        self.read_write
    }

    /// Makes host `i` the one new connections go to.
    pub fn select(&self, i: usize) {
        self.current.store(i, Ordering::SeqCst);
    }

    /// The options new connections use now.
    pub fn current_options(&self) -> PgConnectOptions {
        self.candidates[self.current.load(Ordering::SeqCst)].clone()
    }

    /// `host:port` of the server in use.
    pub fn current_name(&self) -> String {
        self.names[self.current.load(Ordering::SeqCst)].clone()
    }

    /// Why the database cannot be used right now, while it looks for the primary.
    pub fn trouble(&self) -> Option<String> {
        crate::lock(&self.trouble).clone()
    }

    /// Whether a pooled connection of age `age` was opened before the last retirement.
    pub fn is_retired(&self, age: Duration) -> bool {
        let before = *crate::lock(&self.retired_before);
        Instant::now()
            .checked_sub(age)
            .is_some_and(|opened| opened < before)
    }

    /// Checks a fresh connection: Err when it is read-only and only writable servers will do
    /// (the pool closes it and tries again; with several hosts a search starts).
    pub async fn check_new(&self, conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
        if !self.read_write {
            return Ok(());
        }
        if read_only(conn).await? {
            let why = format!(
                "{} host {} is read-only (a standby, or a primary being demoted)",
                self.role.what,
                self.current_name()
            );
            self.set_trouble(Some(why.clone()));
            self.wake.notify_one();
            return Err(sqlx::Error::Protocol(why));
        }
        if !self.searching.load(Ordering::SeqCst) {
            self.set_trouble(None);
        }
        Ok(())
    }

    /// Reacts to a failed statement: retires the pool's connections when the server said it is
    /// read-only or going away, and starts a search among several hosts when the server may be
    /// gone. Returns whether the error was of that kind.
    pub fn observe(&self, e: &sqlx::Error) -> bool {
        let code = match e {
            sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
            _ => None,
        };
        let server_left = code.as_deref().is_some_and(server_left);
        let broken = broken(e);
        if server_left {
            *crate::lock(&self.retired_before) = Instant::now();
            if code.as_deref() == Some("25006") {
                counter!(self.role.failovers).increment(1);
                tracing::warn!(
                    host = %self.current_name(),
                    "the {} host turned read-only; its pooled connections are retired",
                    self.role.what
                );
            }
        }
        if (server_left || broken) && self.len() > 1 {
            self.wake.notify_one();
        }
        server_left || broken
    }

    fn set_trouble(&self, why: Option<String>) {
        *crate::lock(&self.trouble) = why;
    }

    /// The first host, in the URL's order, that accepts a connection (and is writable when
    /// that is asked for); Err names what every host said.
    pub async fn find(&self) -> Result<usize, String> {
        let mut said = Vec::new();
        for (i, options) in self.candidates.iter().enumerate() {
            let probe = async {
                let mut conn = sqlx::PgConnection::connect_with(options).await?;
                let ro = if self.read_write {
                    read_only(&mut conn).await?
                } else {
                    false
                };
                let _ = conn.close().await;
                Ok::<bool, sqlx::Error>(ro)
            };
            match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
                Ok(Ok(false)) => return Ok(i),
                Ok(Ok(true)) => said.push(format!("{}: read-only", self.names[i])),
                Ok(Err(e)) => said.push(format!("{}: {e}", self.names[i])),
                Err(_) => said.push(format!(
                    "{}: no answer within {} s",
                    self.names[i],
                    PROBE_TIMEOUT.as_secs()
                )),
            }
        }
        Err(said.join("; "))
    }

    /// Searches for the primary whenever asked ([`Hosts::observe`], [`Hosts::check_new`]) and
    /// points the pool's new connections at it. Runs for the process's life (several hosts
    /// only).
    pub async fn follow(self: Arc<Self>, pool: PgPool) {
        loop {
            self.wake.notified().await;
            if self.searching.swap(true, Ordering::SeqCst) {
                continue;
            }
            let before = self.current.load(Ordering::SeqCst);
            let started = Instant::now();
            loop {
                match self.find().await {
                    Ok(i) => {
                        self.current.store(i, Ordering::SeqCst);
                        pool.set_connect_options(self.candidates[i].clone());
                        if i != before {
                            // Connections to the old host are of no use any more.
                            *crate::lock(&self.retired_before) = Instant::now();
                            counter!(self.role.failovers).increment(1);
                            tracing::warn!(
                                from = %self.names[before], to = %self.names[i],
                                after_ms = started.elapsed().as_millis() as u64,
                                "the {}'s primary moved; new connections go to it",
                                self.role.what
                            );
                        }
                        self.set_trouble(None);
                        break;
                    }
                    Err(said) => {
                        self.set_trouble(Some(format!(
                            "looking for a writable {} host among {}: {said}",
                            self.role.what,
                            self.len()
                        )));
                        tokio::time::sleep(SEARCH_PAUSE).await;
                    }
                }
            }
            self.searching.store(false, Ordering::SeqCst);
        }
    }
}

/// SQLSTATEs that say the server refuses writes or is going away: 25006 (read-only: a standby,
/// a demoted primary), 57P01–57P03 (shutting down or restarting), class 08 (connection
/// exception).
fn server_left(code: &str) -> bool {
    code == "25006" || code.starts_with("57P") || code.starts_with("08")
}

/// A connection that broke, or none to be had, as opposed to an answer from the server.
fn broken(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::PoolTimedOut
    )
}

/// Whether `e` says the database could not be reached or left mid-statement (the kinds
/// [`Hosts::observe`] reacts to), as opposed to a statement the database refused: worth another
/// try on a fresh connection.
pub fn unreachable(e: &sqlx::Error) -> bool {
    broken(e)
        || matches!(e, sqlx::Error::Database(db) if db.code().is_some_and(|c| server_left(&c)))
}

/// Why a Postgres connection failed TLS, if it did: a refused handshake, or a TLS set-up sqlx
/// refused before it (`sslmode=require`/`verify-*` against a server without TLS, an unusable
/// root file). Both are configuration, not an outage.
pub fn tls_failure(error: &sqlx::Error) -> Option<String> {
    crate::tls::handshake_failure(error).or_else(|| match error {
        sqlx::Error::Tls(e) => Some(e.to_string()),
        _ => None,
    })
}

/// Whether Postgres refused the login (SQLSTATE class 28: unknown role, wrong password, no
/// `pg_hba.conf` entry): the server answered, and waiting cannot fix the credentials.
pub fn login_refused(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().is_some_and(|c| c.starts_with("28")))
}

/// Waits between tries to reach Postgres at start: from 250 ms doubling to 5 s.
const START_RETRY: crate::backoff::Backoff = crate::backoff::Backoff {
    initial: Duration::from_millis(250),
    multiplier: 2.0,
    max: Duration::from_secs(5),
    jitter: 0.2,
};

/// How long each start-up step waits for Postgres before the process gives up.
pub const START_WAIT: Duration = Duration::from_secs(60);

/// Runs `step` until it succeeds, fails in a way `wait` does not accept (an answer the server
/// gave, which waiting cannot change), or has failed for [`START_WAIT`], logging each failure it
/// waits out with `database` (which one, and its setting).
pub async fn waiting_at_start<T, E, F, Fut>(
    database: &str,
    mut step: F,
    wait: impl Fn(&E) -> bool,
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    let deadline = tokio::time::Instant::now() + START_WAIT;
    let mut attempt = 0u32;
    loop {
        match step().await {
            Err(e) if wait(&e) && tokio::time::Instant::now() < deadline => {
                tracing::warn!(database, error = %format!("{e:#}"), "Postgres not reachable yet; retrying");
                attempt += 1;
                tokio::time::sleep(crate::backoff::delay(&START_RETRY, attempt)).await;
            }
            r => return r,
        }
    }
}

/// The pool's size and how it hands out connections.
#[derive(Clone, Copy, Debug)]
pub struct PoolSettings {
    pub max_connections: u32,
    /// Opened at start and kept.
    pub min_connections: u32,
    /// How long a task waits for a free connection before its call fails.
    pub acquire_timeout: Duration,
    /// A pooled connection idle for less than this is handed out without a ping.
    pub ping_if_idle_for: Duration,
}

/// Connects a pool to the primary among `hosts` with the rules of this module: new connections
/// checked ([`Hosts::check_new`]), retired ones closed when taken ([`Hosts::is_retired`]), and,
/// with several hosts, the first writable host found first and then followed for the pool's life
/// ([`Hosts::follow`]).
pub async fn pool(hosts: Arc<Hosts>, settings: PoolSettings) -> Result<PgPool, sqlx::Error> {
    if hosts.len() > 1 {
        let i = hosts.find().await.map_err(|said| {
            sqlx::Error::Configuration(
                format!("no writable host in {}: {said}", hosts.role.var).into(),
            )
        })?;
        hosts.select(i);
    }
    // sqlx pings every connection it hands out by default: one more round trip (and a wake-up
    // of the backend) before each statement. A connection used within `ping_if_idle_for` has
    // just proven itself; only longer-idle ones are pinged. A connection that broke since its
    // last use fails its statement, which every caller already survives.
    let (on_connect, on_acquire) = (hosts.clone(), hosts.clone());
    let ping_if_idle_for = settings.ping_if_idle_for;
    let pool = PgPoolOptions::new()
        .after_connect(move |conn, _meta| {
            let hosts = on_connect.clone();
            Box::pin(async move { hosts.check_new(conn).await })
        })
        .max_connections(settings.max_connections)
        .min_connections(settings.min_connections)
        .acquire_timeout(settings.acquire_timeout)
        .test_before_acquire(false)
        .before_acquire(move |conn, meta| {
            let retired = on_acquire.is_retired(meta.age);
            Box::pin(async move {
                if retired {
                    return Ok(false);
                }
                if meta.idle_for < ping_if_idle_for {
                    return Ok(true);
                }
                sqlx::Connection::ping(conn).await.map(|()| true)
            })
        })
        .connect_with(hosts.current_options())
        .await?;
    if hosts.len() > 1 {
        tokio::spawn(hosts.clone().follow(pool.clone()));
    }
    Ok(pool)
}

/// Whether the server this connection is on refuses writes. Sent as a simple query: a named
/// prepared statement here would run before the start-up probe for a transaction-mode pooler
/// (PgBouncer < 1.21), collide there, and turn its clear refusal into reconnecting until the
/// start-up deadline.
pub async fn read_only<'c, E>(conn: E) -> Result<bool, sqlx::Error>
where
    E: sqlx::Executor<'c, Database = sqlx::Postgres>,
{
    use sqlx::Row as _;
    let row = sqlx::raw_sql("SHOW transaction_read_only")
        .fetch_one(conn)
        .await?;
    Ok(row.try_get::<String, _>(0)? == "on")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str) -> Result<Hosts, HostsError> {
        const ROLE: Role = Role {
            what: "ledger",
            var: "DATABASE_URL",
            failovers: "failovers_total",
        };
        Hosts::from_url(url, ROLE, |u| u.parse())
    }

    #[test]
    fn single_and_multi_host_urls() {
        let h = parse("postgres://u:p@h1:5432,h2:5433/db?sslmode=disable").unwrap();
        assert_eq!(h.len(), 2);
        assert!(h.read_write());
        assert_eq!(h.current_name(), "h1:5432");
        h.select(1);
        assert_eq!(h.current_name(), "h2:5433");
        let h = parse("postgres://u@h/db?target_session_attrs=any").unwrap();
        assert_eq!(h.len(), 1);
        assert!(!h.read_write());
        assert!(parse("postgres://u@h/db?target_session_attrs=read-write").is_ok());
        assert!(parse("postgres://u@h/db?target_session_attrs=primary").is_ok());
        let e = parse("postgres://u@h/db?target_session_attrs=standby")
            .err()
            .unwrap();
        assert!(e.to_string().contains("standby"), "{e}");
    }

    #[test]
    fn a_server_that_left_retires_older_connections_only() {
        let h = parse("postgres://u@h1,h2/db").unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert!(!h.is_retired(Duration::from_millis(1)));
        let err = sqlx::Error::Protocol("x".into());
        assert!(h.observe(&err), "a broken connection counts");
        assert!(
            !h.is_retired(Duration::from_secs(1)),
            "a broken one alone retires nothing"
        );
    }
}
