//! The agent-side transactional outbox: the `intent_outbox` table in the agent's own
//! database, its migration, and [`Outbox::enqueue`].
//!
//! An agent records an intent in the same transaction as its own business write; the intent
//! is published later by `publisher relay` ([`crate::relay`]). Either both commit or neither
//! does: a rolled-back transaction publishes nothing, a committed one is published at least
//! once (the worker's inbox suppresses the repeats). The table is a contract: any language
//! may insert `(tenant, action_id, body)` rows (see docs/agents.md, "From a Rust agent").

use sqlx::{PgPool, Postgres, Transaction};

/// Table that records which of the publisher's migrations ran. Not `_sqlx_migrations`, so
/// the agent's own sqlx migrations in the same database are not disturbed.
pub const MIGRATIONS_TABLE: &str = "_intent_publisher_migrations";

/// Why an intent could not be enqueued or the table not migrated.
#[derive(Debug, thiserror::Error)]
pub enum OutboxError {
    /// The intent would be rejected by the worker's decoder; nothing was inserted.
    #[error("invalid intent: {0}")]
    Invalid(#[from] protocol::DecodeError),
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

/// Enqueues intents into `intent_outbox`.
pub struct Outbox;

impl Outbox {
    /// Creates `intent_outbox` and its index if missing (idempotent; bookkeeping in
    /// [`MIGRATIONS_TABLE`]).
    pub async fn migrate(pool: &PgPool) -> Result<(), OutboxError> {
        let mut migrator = sqlx::migrate!("./migrations");
        migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
        migrator.run(pool).await?;
        Ok(())
    }

    /// Inserts `intent` in the caller's transaction and returns the row id. The body is
    /// `intent.to_json()`, checked with the worker's own decoder first, so a row the worker
    /// would reject is never stored.
    pub async fn enqueue(
        tx: &mut Transaction<'_, Postgres>,
        intent: &protocol::Intent,
    ) -> Result<i64, OutboxError> {
        let body = intent.to_json();
        let checked = protocol::decode_intent(&body)?;
        let body = String::from_utf8(body).expect("Intent::to_json writes UTF-8 JSON");
        let id = sqlx::query_scalar(
            "INSERT INTO intent_outbox (tenant, action_id, body) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(&checked.tenant)
        .bind(&checked.action_id)
        .bind(&body)
        .fetch_one(&mut **tx)
        .await?;
        Ok(id)
    }
}
