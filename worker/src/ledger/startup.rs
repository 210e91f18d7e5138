//! Start-up of the ledger: connecting while Postgres starts, the probe for a
//! transaction-mode pooler that would break prepared statements, and migrations (applied, or
//! awaited when another process owns them). The worker runs these before anything else.

use std::time::Duration;

use anyhow::Context as _;

use super::{Ledger, LedgerError};
use crate::tls::Trust;

/// Connects to the ledger, retrying while it starts (compose, k8s). A login Postgres refuses
/// (SQLSTATE class 28: unknown role, wrong password, no `pg_hba.conf` entry) is not retried:
/// the server answered, and waiting cannot fix the credentials. Nor is a failed TLS handshake
/// (certificate refused under `sslmode=verify-ca|verify-full`, or a server without TLS).
pub async fn connect_retrying(
    database_url: &str,
    trust: &Trust,
    pool_size: u32,
    acquire_timeout: Duration,
) -> anyhow::Result<Ledger> {
    let hosts = super::primary::Hosts::from_url(database_url, super::ROLE, |url| {
        crate::tls::postgres(url, trust)
    })
    .context("invalid DATABASE_URL")?;
    let hosts = std::sync::Arc::new(hosts);
    let options = hosts.current_options();
    kit::pg::waiting_at_start(
        LEDGER,
        || Ledger::connect_hosts(hosts.clone(), pool_size, acquire_timeout),
        |e| refusal(e, &options).is_none(),
    )
    .await
    .map_err(|e| {
        refusal(&e, &options).unwrap_or_else(|| {
            anyhow::Error::new(e).context("cannot connect to Postgres (DATABASE_URL)")
        })
    })
}

/// The error that ends start-up at once when Postgres answered and refused: the login
/// (SQLSTATE class 28) or the TLS handshake. None for anything waiting may fix.
fn refusal(e: &LedgerError, options: &sqlx::postgres::PgConnectOptions) -> Option<anyhow::Error> {
    let LedgerError::Db(e) = e else { return None };
    if kit::pg::login_refused(e) {
        return Some(anyhow::anyhow!(
            "Postgres refused the credentials of user {:?} (DATABASE_URL): {}; not retrying",
            options.get_username(),
            e.as_database_error().map_or("", |db| db.message())
        ));
    }
    kit::pg::tls_failure(e).map(|reason| {
        anyhow::anyhow!(
            "Postgres ledger (DATABASE_URL) at {}:{}: TLS handshake failed: {reason}; not retrying",
            options.get_host(),
            options.get_port(),
        )
    })
}

/// The ledger, as start-up's log lines name it.
const LEDGER: &str = "ledger (DATABASE_URL)";

/// Makes the schema ready after [`connect_retrying`]: probes for a pooler that breaks
/// prepared statements, then applies the migrations (`migrate`) or waits until another process
/// has (`WORKER_MIGRATE=false`). Errors that look like such a pooler say what to change. A link
/// lost on the way (Postgres restarting just after the first connection, a flapping network)
/// is waited for as [`connect_retrying`] waits, up to 60 s, and the whole step is run again:
/// the probe opens fresh connections, and each migration commits with its own record.
pub async fn prepare(ledger: &Ledger, migrate: bool) -> anyhow::Result<()> {
    kit::pg::waiting_at_start(LEDGER, || prepare_once(ledger, migrate), link_lost).await
}

/// Whether start-up failed because the link to Postgres was lost or could not be made, which
/// waiting can fix, rather than for an answer the server gave.
fn link_lost(e: &anyhow::Error) -> bool {
    use sqlx::migrate::MigrateError;
    e.chain().any(|c| {
        // A `LedgerError` carries its cause in its message, not as a source.
        let db = c.downcast_ref::<sqlx::Error>().or(match c.downcast_ref() {
            Some(LedgerError::Db(e)) => Some(e),
            Some(LedgerError::Migrate(
                MigrateError::Execute(e) | MigrateError::ExecuteMigration(e, _),
            )) => Some(e),
            _ => None,
        });
        matches!(db, Some(sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut))
    })
}

async fn prepare_once(ledger: &Ledger, migrate: bool) -> anyhow::Result<()> {
    // The pool's own options: the URL and trust `connect_retrying` already resolved.
    probe_pooler(&ledger.pool().connect_options())
        .await
        .map_err(pooler_hint)?;
    if migrate {
        ledger
            .migrate()
            .await
            .context("applying migrations")
            .map_err(pooler_hint)
    } else {
        wait_for_migrations(ledger).await.map_err(pooler_hint)
    }
}

/// Makes a transaction-mode pooler without prepared-statement support fail at start-up, every
/// time, instead of in whichever statements happen to collide later (where a reused statement
/// name could even run another statement with the same parameter count). Two fresh client
/// connections each prepare the same first statement (sqlx names it `sqlx_s_1` on both) while
/// the second holds a transaction: with Postgres itself, session pooling, or PgBouncer >= 1.21
/// with `max_prepared_statements`, nothing collides; PgBouncer < 1.21 in transaction mode hands
/// the second client the server connection the first one just prepared on (its default LIFO
/// reuse), and the prepare fails with "already exists".
async fn probe_pooler(options: &sqlx::postgres::PgConnectOptions) -> anyhow::Result<()> {
    use sqlx::Connection as _;
    let probe = async {
        let mut a = sqlx::PgConnection::connect_with(options).await?;
        let mut b = sqlx::PgConnection::connect_with(options).await?;
        let q = "SELECT pg_backend_pid()";
        let _: i32 = sqlx::query_scalar(q).fetch_one(&mut a).await?;
        let mut tx = b.begin().await?;
        let _: i32 = sqlx::query_scalar(q).fetch_one(&mut *tx).await?;
        let _: i32 = sqlx::query_scalar(q).fetch_one(&mut a).await?;
        tx.rollback().await?;
        let _ = a.close().await;
        let _ = b.close().await;
        Ok::<_, sqlx::Error>(())
    };
    match tokio::time::timeout(Duration::from_secs(15), probe).await {
        Ok(r) => r.context("checking the Postgres connection for a transaction-mode pooler"),
        Err(_) => Err(anyhow::anyhow!(
            "a second connection to Postgres did not answer within 15 s while the first held a \
             transaction: a pooler with a single server connection? (README, \"Postgres \
             connections and PgBouncer\")"
        )),
    }
}

/// The first queries of a worker behind PgBouncer in transaction mode without
/// `max_prepared_statements` (PgBouncer < 1.21, or the setting left at 0) fail on sqlx's named
/// prepared statements: say what to change instead of leaving a bare SQL error.
fn pooler_hint(e: anyhow::Error) -> anyhow::Error {
    let text = format!("{e:#}");
    if text.contains("prepared statement \"sqlx_s_") {
        e.context(
            "DATABASE_URL looks like a connection pooler in transaction mode that does not keep \
             prepared statements (PgBouncer < 1.21 or max_prepared_statements = 0); use \
             PgBouncer >= 1.21 with max_prepared_statements > 0, session pooling, or Postgres \
             directly (README, \"Postgres connections and PgBouncer\")",
        )
    } else {
        e
    }
}

/// With `WORKER_MIGRATE=false` the schema belongs to someone else (a `worker migrate` Job):
/// wait for it to be current rather than run against tables this build does not know.
async fn wait_for_migrations(ledger: &Ledger) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let missing = ledger
            .missing_migrations()
            .await
            .context("checking applied migrations (WORKER_MIGRATE=false)")?;
        if missing.is_empty() {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!(
                "WORKER_MIGRATE=false but migrations {missing:?} are not applied (or differ from this build's); \
                 run `worker migrate` with this version first"
            );
        }
        tracing::warn!(
            ?missing,
            "WORKER_MIGRATE=false: waiting for `worker migrate` to apply migrations"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reset() -> sqlx::Error {
        sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset))
    }

    #[test]
    fn a_lost_link_is_waited_for_wherever_start_up_met_it() {
        let probe = anyhow::Error::from(reset()).context("checking for a pooler");
        let migrating = anyhow::Error::from(LedgerError::Migrate(
            sqlx::migrate::MigrateError::Execute(reset()),
        ))
        .context("applying migrations");
        let in_a_migration = anyhow::Error::from(LedgerError::Migrate(
            sqlx::migrate::MigrateError::ExecuteMigration(reset(), 3),
        ));
        let awaiting = anyhow::Error::from(LedgerError::Db(sqlx::Error::PoolTimedOut))
            .context("checking applied migrations");
        for e in [probe, migrating, in_a_migration, awaiting] {
            assert!(link_lost(&e), "{e:#}");
        }
    }

    #[test]
    fn an_answer_from_the_server_is_not_waited_for() {
        let refused = anyhow::Error::from(LedgerError::Db(sqlx::Error::Protocol(
            "prepared statement \"sqlx_s_1\" already exists".into(),
        )));
        let dirty =
            anyhow::Error::from(LedgerError::Migrate(sqlx::migrate::MigrateError::Dirty(4)));
        let plain = anyhow::anyhow!("a second connection did not answer within 15 s");
        for e in [refused, dirty, plain] {
            assert!(!link_lost(&e), "{e:#}");
        }
    }
}
