//! All SQL: the schema, the request log, the three write modes and the lookup.
//!
//! Every statement is schema-qualified with the validated `DOWNSTREAM_SCHEMA`
//! (identifiers cannot be bind parameters, hence the `{s}` template; the name
//! was checked against `[a-z_][a-z0-9_]*` in `config.rs`). Tests count
//! mutations and requests in these tables directly, so their shape is a
//! contract: see the crate docs.

use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::types::chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, Postgres, Transaction};

use crate::receipt;

/// Created at start-up; `IF NOT EXISTS` everywhere so restarts keep the data.
const SCHEMA_DDL: &str = r#"
CREATE SCHEMA IF NOT EXISTS {s};

-- One row per business change (e.g. one refund). Never deleted.
CREATE TABLE IF NOT EXISTS {s}.mutations (
    id          bigserial PRIMARY KEY,
    mode        text NOT NULL,
    resource    text NOT NULL,
    idem_key    text NULL,
    arguments   jsonb NOT NULL,
    receipt_id  text UNIQUE,
    receipt     jsonb,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS mutations_idem_key_idx ON {s}.mutations (idem_key, resource, id);

-- Every business request, logged before it is processed. status is NULL while
-- in flight and stays NULL when the connection was dropped on purpose.
-- replied_at is set once the whole answer was written to a client that had not
-- hung up; NULL: dropped, or the client was gone (timed out, killed) first.
-- traceparent and tracestate are the W3C trace context headers as received
-- (repeated fields joined with ','), NULL when the request had none: tests read
-- which trace each send belonged to from here.
CREATE TABLE IF NOT EXISTS {s}.requests (
    id          bigserial PRIMARY KEY,
    kind        text NOT NULL CHECK (kind IN ('write', 'lookup')),
    mode        text NULL,
    resource    text NULL,
    idem_key    text NULL,
    status      int NULL,
    fault       text NULL,
    at          timestamptz NOT NULL DEFAULT now(),
    replied_at  timestamptz NULL,
    traceparent text NULL,
    tracestate  text NULL
);
-- Schemas created before these columns existed.
ALTER TABLE {s}.requests ADD COLUMN IF NOT EXISTS replied_at timestamptz NULL;
ALTER TABLE {s}.requests ADD COLUMN IF NOT EXISTS traceparent text NULL;
ALTER TABLE {s}.requests ADD COLUMN IF NOT EXISTS tracestate text NULL;
CREATE INDEX IF NOT EXISTS requests_idem_key_idx ON {s}.requests (idem_key);

-- Durable idempotency keys of replay mode. body is the request body as jsonb,
-- whose equality ignores key order and whitespace: the canonical form.
CREATE TABLE IF NOT EXISTS {s}.replay_keys (
    idem_key     text PRIMARY KEY,
    body         jsonb NOT NULL,
    mutation_id  bigint NULL REFERENCES {s}.mutations (id),
    created_at   timestamptz NOT NULL DEFAULT now()
);
"#;

/// The W3C trace context headers of a request, exactly as received (not validated: a test
/// must see a malformed header too), `None` when absent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceHeaders {
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

/// Outcome of a replay-mode write.
#[derive(Debug)]
pub enum Replay {
    /// New key: one new mutation, this is its receipt.
    Created(Value),
    /// Known key, same body: the original receipt, no new mutation.
    Replayed(Value),
    /// Known key, different body.
    KeyReused,
}

#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
    schema: String,
}

impl Store {
    /// Connect and create the schema and tables if missing.
    pub async fn open(database_url: &str, schema: &str) -> Result<Store> {
        let pool = PgPoolOptions::new()
            // Same-key replays block on the unique index while holding a
            // connection; leave room for them plus the request log.
            .max_connections(20)
            .acquire_timeout(Duration::from_secs(10))
            .connect(database_url)
            .await
            .context("connecting to DOWNSTREAM_DATABASE_URL")?;
        let store = Store {
            pool,
            schema: schema.to_owned(),
        };
        store.create_schema().await?;
        Ok(store)
    }

    pub async fn close(&self) {
        self.pool.close().await;
    }

    fn sql(&self, template: &'static str) -> AssertSqlSafe<String> {
        AssertSqlSafe(template.replace("{s}", &self.schema))
    }

    async fn create_schema(&self) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        // Two processes starting on one database would race on CREATE ... IF
        // NOT EXISTS (it is not atomic against concurrent creators); serialise.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(format!("reference-downstream:{}", self.schema))
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(self.sql(SCHEMA_DDL))
            .execute(&mut *tx)
            .await
            .context("creating downstream schema")?;
        tx.commit().await?;
        Ok(())
    }

    /// Log a business request in its own committed insert, before processing,
    /// so that even requests we then drop or that crash us are counted.
    pub async fn log_request(
        &self,
        kind: &str,
        mode: Option<&str>,
        resource: Option<&str>,
        idem_key: Option<&str>,
        fault: Option<&str>,
        trace: &TraceHeaders,
    ) -> Result<i64> {
        let id = sqlx::query_scalar(self.sql(
            "INSERT INTO {s}.requests
                 (kind, mode, resource, idem_key, fault, traceparent, tracestate)
             VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id",
        ))
        .bind(kind)
        .bind(mode)
        .bind(resource)
        .bind(idem_key)
        .bind(fault)
        .bind(trace.traceparent.as_deref())
        .bind(trace.tracestate.as_deref())
        .fetch_one(&self.pool)
        .await?;
        Ok(id)
    }

    /// Record the status we answered with (never called for dropped requests).
    pub async fn set_status(&self, request_id: i64, status: u16) -> Result<()> {
        sqlx::query(self.sql("UPDATE {s}.requests SET status = $2 WHERE id = $1"))
            .bind(request_id)
            .bind(i32::from(status))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Record that the answer was delivered at `at`: written whole to a client that
    /// was still connected (see `server.rs`).
    pub async fn set_replied(&self, request_id: i64, at: std::time::SystemTime) -> Result<()> {
        let secs = at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        sqlx::query(
            self.sql("UPDATE {s}.requests SET replied_at = to_timestamp($2) WHERE id = $1"),
        )
        .bind(request_id)
        .bind(secs)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Durable key replay, in one transaction. A concurrent request with the
    /// same key blocks on the primary key until this one commits, then sees the
    /// committed key and replays: no double mutation under concurrency.
    pub async fn replay_write(
        &self,
        resource: &str,
        idem_key: &str,
        body: &Value,
        retention: Duration,
    ) -> Result<Replay> {
        let mut tx = self.pool.begin().await?;
        // Forget an expired key first, so the write below is a fresh one: this
        // is what a real service does after its retention window (the worker
        // must stop replaying before then).
        sqlx::query(self.sql(
            "DELETE FROM {s}.replay_keys
             WHERE idem_key = $1 AND created_at < now() - make_interval(secs => $2)",
        ))
        .bind(idem_key)
        .bind(retention.as_secs_f64())
        .execute(&mut *tx)
        .await?;
        let inserted: Option<String> = sqlx::query_scalar(self.sql(
            "INSERT INTO {s}.replay_keys (idem_key, body) VALUES ($1, $2)
             ON CONFLICT (idem_key) DO NOTHING RETURNING idem_key",
        ))
        .bind(idem_key)
        .bind(body)
        .fetch_optional(&mut *tx)
        .await?;
        if inserted.is_some() {
            let (id, receipt) = self
                .insert_mutation(&mut tx, "replay", resource, Some(idem_key), body)
                .await?;
            sqlx::query(
                self.sql("UPDATE {s}.replay_keys SET mutation_id = $2 WHERE idem_key = $1"),
            )
            .bind(idem_key)
            .bind(id)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            return Ok(Replay::Created(receipt));
        }
        let row: Option<(bool, Option<Value>)> = sqlx::query_as(self.sql(
            "SELECT k.body = $2, m.receipt
             FROM {s}.replay_keys k LEFT JOIN {s}.mutations m ON m.id = k.mutation_id
             WHERE k.idem_key = $1",
        ))
        .bind(idem_key)
        .bind(body)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        match row {
            Some((false, _)) => Ok(Replay::KeyReused),
            Some((true, Some(receipt))) => Ok(Replay::Replayed(receipt)),
            // Only possible if the key expired and was deleted by a concurrent
            // request between our insert and select; the client may retry.
            _ => anyhow::bail!("replay key {idem_key:?} vanished concurrently"),
        }
    }

    /// The broken replay modes. Looks the key up among this resource's mutations, with no
    /// lock and no unique key: a same-body repeat replays the first receipt; another body is
    /// a new mutation (`racy` = false, "key ignored when the body differs") or 422 (`racy`
    /// = true). With `racy`, the gap between the check and the insert is widened so two
    /// concurrent requests under one new key both miss the check and both write.
    pub async fn broken_replay_write(
        &self,
        mode: &str,
        resource: &str,
        idem_key: &str,
        body: &Value,
        racy: bool,
    ) -> Result<Replay> {
        let found: Option<(Value, bool)> = sqlx::query_as(self.sql(
            "SELECT receipt, arguments = $3 FROM {s}.mutations
             WHERE idem_key = $1 AND resource = $2
             ORDER BY id LIMIT 1",
        ))
        .bind(idem_key)
        .bind(resource)
        .bind(body)
        .fetch_optional(&self.pool)
        .await?;
        match found {
            Some((receipt, true)) => return Ok(Replay::Replayed(receipt)),
            Some((_, false)) if racy => return Ok(Replay::KeyReused),
            Some((_, false)) => {}
            None if racy => tokio::time::sleep(Duration::from_millis(300)).await,
            None => {}
        }
        self.plain_write(mode, resource, Some(idem_key), body)
            .await
            .map(Replay::Created)
    }

    /// Lookup and none modes: every write is a new mutation, no dedupe.
    pub async fn plain_write(
        &self,
        mode: &str,
        resource: &str,
        idem_key: Option<&str>,
        body: &Value,
    ) -> Result<Value> {
        let mut tx = self.pool.begin().await?;
        let (_, receipt) = self
            .insert_mutation(&mut tx, mode, resource, idem_key, body)
            .await?;
        tx.commit().await?;
        Ok(receipt)
    }

    /// Insert one mutation with its receipt. The id and timestamp are taken
    /// first so the receipt can be stored in the same row it describes.
    async fn insert_mutation(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        mode: &str,
        resource: &str,
        idem_key: Option<&str>,
        body: &Value,
    ) -> Result<(i64, Value)> {
        let (id, at): (i64, DateTime<Utc>) = sqlx::query_as(
            self.sql("SELECT nextval(pg_get_serial_sequence('{s}.mutations', 'id')), now()"),
        )
        .fetch_one(&mut **tx)
        .await?;
        let receipt = receipt::build(id, idem_key, mode, resource, body, at);
        // Return the stored jsonb rather than our local value, so the first
        // answer and every later replay/lookup are byte-identical.
        let stored: Value = sqlx::query_scalar(self.sql(
            "INSERT INTO {s}.mutations
                 (id, mode, resource, idem_key, arguments, receipt_id, receipt, created_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             RETURNING receipt",
        ))
        .bind(id)
        .bind(mode)
        .bind(resource)
        .bind(idem_key)
        .bind(body)
        .bind(receipt::receipt_id(id))
        .bind(&receipt)
        .bind(at)
        .fetch_one(&mut **tx)
        .await?;
        Ok((id, stored))
    }

    /// Receipt of the first mutation with this key on this resource.
    pub async fn find_receipt(&self, resource: &str, idem_key: &str) -> Result<Option<Value>> {
        let receipt = sqlx::query_scalar(self.sql(
            "SELECT receipt FROM {s}.mutations
             WHERE idem_key = $1 AND resource = $2
             ORDER BY id LIMIT 1",
        ))
        .bind(idem_key)
        .bind(resource)
        .fetch_optional(&self.pool)
        .await?;
        Ok(receipt)
    }
}
