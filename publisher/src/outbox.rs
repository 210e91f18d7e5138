//! The agent-side transactional outbox: the `intent_outbox` table in the agent's own
//! database, its migration, and [`Outbox::enqueue`].
//!
//! An agent records an intent in the same transaction as its own business write; the intent
//! is published later by `publisher relay` ([`crate::relay`]). Either both commit or neither
//! does: a rolled-back transaction publishes nothing, a committed one is published at least
//! once (the worker's inbox suppresses the repeats). The table is a contract: any language
//! may insert `(tenant, action_id, body)` rows (see docs/agents.md, "From a Rust agent").
//!
//! A row also keeps the trace context the intent was enqueued in (`traceparent`,
//! `tracestate`, both nullable: migration 0003): the caller's, else the current one (feature
//! `otel`). The relay sends it as the message's headers, so the worker's spans join the trace
//! of the request that enqueued the intent, however much later the relay publishes it.

use sqlx::{PgPool, Postgres, Transaction};

use crate::PublishOptions;

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

/// The outbox's migrations, embedded in the library. A new file in `migrations/` is listed here
/// too (a test fails until it is).
fn migrator() -> sqlx::migrate::Migrator {
    kit::embed_migrations!("migrations":
        "0001_intent_outbox.sql",
        "0002_outbox_failed_rows.sql",
        "0003_outbox_trace_context.sql",
    )
}

/// Enqueues intents into `intent_outbox`.
pub struct Outbox;

impl Outbox {
    /// Creates `intent_outbox` and its index if missing (idempotent; bookkeeping in
    /// [`MIGRATIONS_TABLE`]).
    pub async fn migrate(pool: &PgPool) -> Result<(), OutboxError> {
        let mut migrator = migrator();
        migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
        migrator.run(pool).await?;
        Ok(())
    }

    /// Inserts `intent` in the caller's transaction and returns the row id. The body is
    /// `intent.to_json()`, checked with the worker's own decoder first, so a row the worker
    /// would reject is never stored. The row keeps the current trace context (feature `otel`);
    /// [`Outbox::enqueue_with`] passes another.
    pub async fn enqueue(
        tx: &mut Transaction<'_, Postgres>,
        intent: &protocol::Intent,
    ) -> Result<i64, OutboxError> {
        Outbox::enqueue_with(tx, intent, &PublishOptions::default()).await
    }

    /// [`Outbox::enqueue`] with `options`: the trace context the relay is to send with the
    /// intent (e.g. the one the request that led to it carried).
    pub async fn enqueue_with(
        tx: &mut Transaction<'_, Postgres>,
        intent: &protocol::Intent,
        options: &PublishOptions,
    ) -> Result<i64, OutboxError> {
        let body = intent.to_json();
        let checked = protocol::decode_intent(&body)?;
        let body = String::from_utf8(body).expect("Intent::to_json writes UTF-8 JSON");
        let (traceparent, tracestate) = options.stored();
        let id = sqlx::query_scalar(
            "INSERT INTO intent_outbox (tenant, action_id, body, traceparent, tracestate)
             VALUES ($1, $2, $3, $4, $5) RETURNING id",
        )
        .bind(&checked.tenant)
        .bind(&checked.action_id)
        .bind(&body)
        .bind(traceparent)
        .bind(tracestate)
        .fetch_one(&mut **tx)
        .await?;
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_migration_file_is_embedded() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        let migrator = super::migrator();
        assert_eq!(
            kit::schema::unlisted(&dir, &migrator).unwrap(),
            Vec::<String>::new()
        );
        assert_eq!(migrator.iter().count(), 3);
    }
}
