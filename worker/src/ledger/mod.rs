//! The operations ledger in Postgres: the inbox, the state machine and the result outbox.
//!
//! Only this module writes the `operations` and `result_outbox` tables. Every state change is
//! one conditional UPDATE whose predicate (state, fence) the database checks, so two workers, a
//! stale owner or an operator can never both win; history rows are appended by a trigger. The
//! API takes batches: many deliveries are admitted, claimed and completed per commit while each
//! keeps its own row, fence and predicate (docs/design.md section 10).
//!
//! The operator console's own tables live here too, each with its module: [`jobs`] (bulk
//! jobs), [`dead_letters`] (the audit of dead-letter actions), [`workers`] (heartbeats),
//! [`console`] (sign-in forms submitted and sessions signed out);
//! [`cause`] classifies why an operation is where it is, in Rust and in SQL.
//!
//! [`startup`] gets the ledger ready before the worker runs: connect while Postgres starts, probe
//! for a pooler that would break prepared statements, apply or await the migrations.
//! [`primary`] keeps the pool on the primary among the URL's hosts through failovers.

mod admit;
pub mod approval;
pub mod cause;
mod claim;
pub mod compensation;
mod complete;
pub mod console;
pub mod dead_letters;
mod guard;
pub mod jobs;
pub mod operator;
pub mod outbox;
/// Finding the primary among `DATABASE_URL`'s hosts: kit's, shared with the publisher.
pub use kit::pg as primary;
pub mod queries;
pub mod retention;
pub mod startup;
mod states;
pub mod workers;

pub use admit::{Admitted, NewOperation};
pub use claim::{ClaimKind, Claimed, Passed, ReplayWindows, SendFence};
pub use complete::{Applied, Completed, Completion, Phase, Source, Transition};
pub use operator::{OperatorChange, OperatorOutcome, OperatorRequest, UnresolvedFilter};
pub use retention::SweepReport;
pub use states::State;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgPool;

use crate::document::Document;

/// Errors from the ledger.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    // The cause is part of the message and deliberately not a `source` (hence the manual
    // `From` impls below): a chain printer would print it twice.
    #[error("database error: {0}")]
    Db(sqlx::Error),
    #[error("migration failed: {0}")]
    Migrate(sqlx::migrate::MigrateError),
    #[error("operation {0} not found")]
    NotFound(String),
    #[error("{0}")]
    Refused(String),
}

impl From<sqlx::Error> for LedgerError {
    fn from(e: sqlx::Error) -> Self {
        LedgerError::Db(e)
    }
}

impl From<sqlx::migrate::MigrateError> for LedgerError {
    fn from(e: sqlx::migrate::MigrateError) -> Self {
        LedgerError::Migrate(e)
    }
}

/// One row of `operations`, as the worker reads it (decoded by `decode_operation`; its fields
/// are `OPERATION_COLUMNS`, in that order).
#[derive(Debug, Clone)]
pub struct Operation {
    pub id: i64,
    pub tenant: String,
    pub action_id: String,
    pub tool: String,
    pub fingerprint: String,
    /// Canonical JSON request body; None after the retention sweep.
    pub arguments: Option<String>,
    pub call_id: Option<String>,
    pub reply_to: Option<String>,
    pub state: StateColumn,
    pub fence: i64,
    pub lease_owner: Option<String>,
    pub lease_until: Option<DateTime<Utc>>,
    pub attempts: i32,
    pub recovery_attempts: i32,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub first_dispatch_at: Option<DateTime<Utc>>,
    pub replay_deadline: Option<DateTime<Utc>>,
    /// The receipt exactly as the downstream sent it.
    pub receipt: Option<Document>,
    pub receipt_id: Option<String>,
    pub evidence: Option<String>,
    pub last_reported: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub state_since: DateTime<Utc>,
    pub swept_at: Option<DateTime<Utc>>,
    /// The W3C trace context of the intent that created the row, as it arrived (None when it
    /// had none, or a malformed one).
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    /// The downstream's operation id, once it accepted the write (a long-running operation).
    pub remote_id: Option<String>,
    /// The downstream's acceptance answer, as it sent it.
    pub acceptance: Option<Document>,
    /// When an accepted operation is held if still not done: acceptance + `poll.deadline_secs`.
    pub poll_deadline: Option<DateTime<Utc>>,
    /// How the final answer (or the acceptance) is known: `dispatch`, `replay`, `lookup`,
    /// `poll`, `late_receipt` or `operator:<name>`.
    pub verified_by: Option<String>,
    /// The deadline the last write request carried (a tool with `absence_proof`), on the
    /// database clock; the downstream refuses a request that reaches its commit point later.
    pub send_deadline: Option<DateTime<Utc>>,
    /// On a compensation: the action_id (same tenant) of the original it undoes.
    pub compensates: Option<String>,
}

/// A state read from the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateColumn(pub State);

impl Operation {
    pub fn state(&self) -> State {
        self.state.0
    }

    /// Whether a live lease holds the row at `now` (a dispatch, recovery round or poll is
    /// running on it somewhere), as the row last read says.
    pub fn leased(&self, now: DateTime<Utc>) -> bool {
        self.lease_owner.is_some() && self.lease_until.is_some_and(|until| until > now)
    }

    /// The trace context of the intent that created the row. A stored value that no longer
    /// parses (written by hand) counts as none.
    pub fn trace(&self) -> Option<protocol::trace::TraceContext> {
        let parent = protocol::trace::TraceParent::parse(self.traceparent.as_deref()?).ok()?;
        Some(protocol::trace::TraceContext {
            parent,
            state: self.tracestate.clone(),
        })
    }

    /// The downstream idempotency key: derived from the stable key, the same on every
    /// attempt, replay and recovery (docs/design.md section 3).
    pub fn idempotency_key(&self) -> String {
        idempotency_key(&self.tenant, &self.action_id)
    }
}

/// `<tenant>:<action_id>`; tenants cannot contain ':' (protocol rule), so the key is unambiguous.
pub fn idempotency_key(tenant: &str, action_id: &str) -> String {
    format!("{tenant}:{action_id}")
}

/// The column list every query returning `Operation` selects.
pub(crate) const OPERATION_COLUMNS: &str = "id, tenant, action_id, tool, fingerprint, arguments, call_id, \
     reply_to, state, fence, lease_owner, lease_until, attempts, recovery_attempts, next_attempt_at, \
     first_dispatch_at, replay_deadline, receipt, receipt_id, evidence, last_reported, created_at, \
     updated_at, state_since, swept_at, traceparent, tracestate, remote_id, acceptance, poll_deadline, \
     verified_by, send_deadline, compensates";

/// How many columns `OPERATION_COLUMNS` names: one per field of [`Operation`].
const OPERATION_FIELDS: usize = 33;
// [`OperationDecoder`] keeps a bit per field.
const _: () = assert!(OPERATION_FIELDS <= u64::BITS as usize);

/// The names in `OPERATION_COLUMNS`, in order.
static OPERATION_COLUMN_NAMES: std::sync::LazyLock<Vec<&'static str>> =
    std::sync::LazyLock::new(|| OPERATION_COLUMNS.split(',').map(str::trim).collect());

impl<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> for Operation {
    fn from_row(row: &'r sqlx::postgres::PgRow) -> Result<Self, sqlx::Error> {
        OperationDecoder::default().decode(row)
    }
}

/// Decodes [`Operation`]s from rows that have every column of `OPERATION_COLUMNS`. The
/// statements of the hot path select them first and in that order: those rows are read by
/// position once their leading column names are seen to match, because a lookup by name hashes
/// the name for every column of every row (about a third of the decoding). Any other row is
/// read by name.
///
/// One decoder kept across the rows of one result set (which share their column list) finds
/// the positions once, and checks each column's type against its field once, at the first
/// value that is not NULL, as `Row::try_get` does on every call (about a fifth of the
/// decoding). A row with another column list starts over.
pub struct OperationDecoder<'r> {
    columns: Option<&'r [sqlx::postgres::PgColumn]>,
    at: [usize; OPERATION_FIELDS],
    /// Bit `i`: column `at[i]`'s type was checked against field `i`.
    checked: u64,
}

impl Default for OperationDecoder<'_> {
    fn default() -> Self {
        OperationDecoder {
            columns: None,
            at: [0; OPERATION_FIELDS],
            checked: 0,
        }
    }
}

impl<'r> OperationDecoder<'r> {
    pub fn decode(&mut self, row: &'r sqlx::postgres::PgRow) -> Result<Operation, sqlx::Error> {
        use sqlx::{Column as _, Row as _};
        let names = &*OPERATION_COLUMN_NAMES;
        let columns = row.columns();
        if !self.columns.is_some_and(|seen| std::ptr::eq(seen, columns)) {
            let in_order = columns.len() >= names.len()
                && names.iter().zip(columns).all(|(n, c)| c.name() == *n);
            for (i, (slot, name)) in self.at.iter_mut().zip(names).enumerate() {
                *slot = if in_order {
                    i
                } else {
                    sqlx::ColumnIndex::index(name, row)?
                };
            }
            self.checked = 0;
            self.columns = Some(columns);
        }
        decode_operation(row, &self.at, &mut self.checked)
    }

    /// Decodes every row of one result set with one decoder, each operation handed to `with`
    /// beside its row (for the columns a statement returns after the operation's).
    pub fn decode_all<T>(
        rows: &'r [sqlx::postgres::PgRow],
        mut with: impl FnMut(Operation, &'r sqlx::postgres::PgRow) -> Result<T, sqlx::Error>,
    ) -> Result<Vec<T>, sqlx::Error> {
        let mut decoder = OperationDecoder::default();
        rows.iter()
            .map(|row| with(decoder.decode(row)?, row))
            .collect()
    }
}

/// One column of an operation row: its type checked against `T` unless `checked` says it was
/// (and then marked), as `Row::try_get` checks it; an error names the column, as a lookup by
/// name would.
fn column<'r, T>(
    row: &'r sqlx::postgres::PgRow,
    at: usize,
    field: usize,
    checked: &mut u64,
) -> Result<T, sqlx::Error>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    use sqlx::{Row as _, TypeInfo as _, ValueRef as _};
    let named = |source| sqlx::Error::ColumnDecode {
        index: format!("{:?}", OPERATION_COLUMN_NAMES[field]),
        source,
    };
    let value = row.try_get_raw(at)?;
    if *checked & (1 << field) == 0 && !value.is_null() {
        let ty = value.type_info();
        if !ty.is_null() && !T::compatible(&ty) {
            return Err(named(sqlx::error::mismatched_types::<sqlx::Postgres, T>(
                &ty,
            )));
        }
        *checked |= 1 << field;
    }
    T::decode(value).map_err(named)
}

fn decode_operation(
    row: &sqlx::postgres::PgRow,
    at: &[usize; OPERATION_FIELDS],
    checked: &mut u64,
) -> Result<Operation, sqlx::Error> {
    let names = &*OPERATION_COLUMN_NAMES;
    // `col!(i)`: column `i` of OPERATION_COLUMNS, which must be the field being set.
    macro_rules! col {
        ($i:literal) => {
            column(row, at[$i], $i, checked)?
        };
    }
    let state: &str = col!(8);
    Ok(Operation {
        id: col!(0),
        tenant: col!(1),
        action_id: col!(2),
        tool: col!(3),
        fingerprint: col!(4),
        arguments: col!(5),
        call_id: col!(6),
        reply_to: col!(7),
        state: State::parse(state)
            .map(StateColumn)
            .ok_or_else(|| sqlx::Error::ColumnDecode {
                index: format!("{:?}", names[8]),
                source: format!("unknown state {state:?} in operations.state").into(),
            })?,
        fence: col!(9),
        lease_owner: col!(10),
        lease_until: col!(11),
        attempts: col!(12),
        recovery_attempts: col!(13),
        next_attempt_at: col!(14),
        first_dispatch_at: col!(15),
        replay_deadline: col!(16),
        receipt: col!(17),
        receipt_id: col!(18),
        evidence: col!(19),
        last_reported: col!(20),
        created_at: col!(21),
        updated_at: col!(22),
        state_since: col!(23),
        swept_at: col!(24),
        traceparent: col!(25),
        tracestate: col!(26),
        remote_id: col!(27),
        acceptance: col!(28),
        poll_deadline: col!(29),
        verified_by: col!(30),
        send_deadline: col!(31),
        compensates: col!(32),
    })
}

/// Ledger statements that failed, by `operation` (counted by [`Ledger::failed`], and by a
/// caller that handles a failure itself under its own operation label).
pub const LEDGER_ERRORS: &str = "intent_worker_ledger_errors_total";
/// Failovers this worker followed: its ledger host turned read-only, or the primary moved to
/// another host of `DATABASE_URL` (counted by the host search, [`ROLE`]).
pub const LEDGER_FAILOVERS: &str = "intent_worker_ledger_failovers_total";

/// The ledger, to the host search: its name in messages, its setting, its failover counter.
pub const ROLE: primary::Role = primary::Role {
    what: "ledger",
    var: "DATABASE_URL",
    failovers: LEDGER_FAILOVERS,
};

/// A pooled connection idle for less than this is handed out without a ping
/// ([`Ledger::connect_hosts`]).
const PING_IF_IDLE_FOR: std::time::Duration = std::time::Duration::from_secs(1);

/// Handle on the ledger database.
#[derive(Clone)]
pub struct Ledger {
    pool: PgPool,
    hosts: std::sync::Arc<primary::Hosts>,
}

/// The ledger's migrations, embedded in the binary. A new file in `migrations/` is listed here
/// too (a test fails until it is).
static MIGRATOR: std::sync::LazyLock<sqlx::migrate::Migrator> = std::sync::LazyLock::new(|| {
    kit::embed_migrations!("../migrations":
        "0001_ledger.sql",
        "0002_retry_budget_and_poison_guard.sql",
        "0003_operator_requests.sql",
        "0004_history_schedule.sql",
        "0005_retry_spend_operation.sql",
        "0006_retry_tokens.sql",
        "0007_send_marker_hot_fence.sql",
        "0008_history_per_statement.sql",
        "0009_trace_context.sql",
        "0010_operator_console.sql",
        "0011_history_of_left_versions.sql",
        "0012_fewer_index_entries.sql",
        "0013_room_for_hot_updates.sql",
        "0014_published_watermark.sql",
        "0015_outbox_link_without_trigger.sql",
        "0016_console_spent_ids.sql",
        "0017_accepted_operations.sql",
        "0018_documents_as_sent.sql",
        "0019_request_deadlines.sql",
        "0020_approvals.sql",
        "0021_compensations.sql",
        "0022_send_fence_function.sql",
        "0023_receipts_function.sql",
        "0024_no_young_statistics.sql",
    )
});

impl Ledger {
    /// Connects with the URL alone (TLS trusts the system roots and the URL's `sslrootcert`).
    pub async fn connect(
        url: &str,
        pool_size: u32,
        acquire_timeout: std::time::Duration,
    ) -> Result<Ledger, LedgerError> {
        Ledger::connect_with(url.parse()?, pool_size, acquire_timeout).await
    }

    /// Connects with prepared options, one host, connections checked writable.
    pub async fn connect_with(
        options: sqlx::postgres::PgConnectOptions,
        pool_size: u32,
        acquire_timeout: std::time::Duration,
    ) -> Result<Ledger, LedgerError> {
        let hosts = primary::Hosts::single(ROLE, options, true);
        Ledger::connect_hosts(std::sync::Arc::new(hosts), pool_size, acquire_timeout).await
    }

    /// Connects to the primary among `hosts` (the worker's: `crate::tls::postgres` adds the CA
    /// file to each). A pool of at most `pool_size` connections; a task waits up to
    /// `acquire_timeout` for a free one before its call fails (and is handled like any ledger
    /// error). With several hosts, a task follows the primary for the pool's life.
    pub async fn connect_hosts(
        hosts: std::sync::Arc<primary::Hosts>,
        pool_size: u32,
        acquire_timeout: std::time::Duration,
    ) -> Result<Ledger, LedgerError> {
        let pool = primary::pool(
            hosts.clone(),
            primary::PoolSettings {
                max_connections: pool_size,
                // Opened at start (and kept): a connection opened on demand costs a TLS
                // handshake, authentication and fresh statement preparation in the middle of
                // the first burst of load, which showed as a ~100 ms stall when a burst met a
                // freshly started worker.
                min_connections: pool_size,
                acquire_timeout,
                ping_if_idle_for: PING_IF_IDLE_FOR,
            },
        )
        .await?;
        Ok(Ledger { pool, hosts })
    }

    /// Which hosts the ledger may use and which one it uses now.
    pub fn hosts(&self) -> &primary::Hosts {
        &self.hosts
    }

    /// Counts a failed statement (`operation`, for `intent_worker_ledger_errors_total`) and lets
    /// [`primary::Hosts::observe`] react to a server that turned read-only or went away.
    pub fn failed(&self, operation: &'static str, e: &LedgerError) {
        metrics::counter!(LEDGER_ERRORS, "operation" => operation).increment(1);
        self.observe(e);
    }

    /// [`primary::Hosts::observe`] for a ledger error that came from the database.
    pub fn observe(&self, e: &LedgerError) {
        if let LedgerError::Db(e) = e {
            self.hosts.observe(e);
        }
    }

    /// A ledger on a pool built elsewhere (tests); its connections are not checked writable.
    pub fn from_pool(pool: PgPool) -> Ledger {
        let hosts = primary::Hosts::single(ROLE, (*pool.connect_options()).clone(), false);
        Ledger {
            pool,
            hosts: std::sync::Arc::new(hosts),
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies pending migrations (idempotent; safe with several workers starting at once,
    /// sqlx takes an advisory lock).
    pub async fn migrate(&self) -> Result<(), LedgerError> {
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    /// Versions of this build's migrations that the database has not applied successfully
    /// with the same checksum (all of them if the migrations table does not exist yet). Used
    /// by workers started with `WORKER_MIGRATE=false`, which must not run against an older
    /// schema than they were built for.
    pub async fn missing_migrations(&self) -> Result<Vec<i64>, LedgerError> {
        let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
            .fetch_one(&self.pool)
            .await?;
        let applied: Vec<(i64, Vec<u8>)> = if exists {
            sqlx::query_as("SELECT version, checksum FROM _sqlx_migrations WHERE success")
                .fetch_all(&self.pool)
                .await?
        } else {
            Vec::new()
        };
        Ok(MIGRATOR
            .iter()
            .filter(|m| !m.migration_type.is_down_migration())
            .filter(|m| {
                !applied
                    .iter()
                    .any(|(v, c)| *v == m.version && c.as_slice() == &*m.checksum)
            })
            .map(|m| m.version)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_migration_file_is_embedded() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations");
        assert_eq!(
            kit::schema::unlisted(&dir, &MIGRATOR).unwrap(),
            Vec::<String>::new()
        );
        assert_eq!(MIGRATOR.iter().count(), 24);
    }

    #[test]
    fn every_operation_column_has_its_field() {
        assert_eq!(OPERATION_COLUMN_NAMES.len(), OPERATION_FIELDS);
        assert_eq!(OPERATION_COLUMN_NAMES[8], "state");
        assert_eq!(OPERATION_COLUMN_NAMES[OPERATION_FIELDS - 1], "compensates");
    }
}
