//! All SQL: the schema, the request log, the three write modes, the lookup and the
//! async jobs.
//!
//! A write that creates something checks its deadline, if it has one, as the last
//! statement of its transaction, on the database clock ([`Store::past_deadline`]): a
//! late write rolls back and has no effect.
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

use crate::jobs::{self, Ending, Job, Shape};
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
-- which trace each send belonged to from here. kind 'status' is a read of an
-- async job's status URL; operation_id is the async operation the request was
-- about (the path's id for a status read, the job's for a write or lookup that
-- found one), NULL otherwise.
CREATE TABLE IF NOT EXISTS {s}.requests (
    id          bigserial PRIMARY KEY,
    kind        text NOT NULL CHECK (kind IN ('write', 'lookup', 'status')),
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
ALTER TABLE {s}.requests ADD COLUMN IF NOT EXISTS operation_id text NULL;
-- The deadline a write carried (the deadline header, parsed), NULL without one.
ALTER TABLE {s}.requests ADD COLUMN IF NOT EXISTS deadline timestamptz NULL;
CREATE INDEX IF NOT EXISTS requests_idem_key_idx ON {s}.requests (idem_key);
CREATE INDEX IF NOT EXISTS requests_operation_id_idx ON {s}.requests (operation_id);
-- Schemas created before status reads: widen the kind check (once).
DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_constraint
        WHERE conrelid = '{s}.requests'::regclass AND conname = 'requests_kind_check'
          AND pg_get_constraintdef(oid) LIKE '%status%'
    ) THEN
        ALTER TABLE {s}.requests DROP CONSTRAINT IF EXISTS requests_kind_check;
        ALTER TABLE {s}.requests ADD CONSTRAINT requests_kind_check
            CHECK (kind IN ('write', 'lookup', 'status'));
    END IF;
END $$;

-- Durable idempotency keys of replay mode. body is the request body as jsonb,
-- whose equality ignores key order and whitespace: the canonical form.
CREATE TABLE IF NOT EXISTS {s}.replay_keys (
    idem_key     text PRIMARY KEY,
    body         jsonb NOT NULL,
    mutation_id  bigint NULL REFERENCES {s}.mutations (id),
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- Async jobs: one per idempotency key, created with its mutation (same id). How and
-- when the job ends is fixed at creation: outcome, delay_ms and ends_at
-- (created_at + delay_ms; NULL for a job that never ends). The state is derived
-- from the clock when read (running before ends_at, then outcome), so a restart
-- changes neither. deployment_id (the final receipt) is set for outcome
-- 'succeeded' and shown once it has ended; error for 'failed'. The status URL
-- answers 404 until not_found_until (the status_not_found fault).
CREATE TABLE IF NOT EXISTS {s}.async_jobs (
    id               bigint PRIMARY KEY REFERENCES {s}.mutations (id),
    operation_id     text NOT NULL UNIQUE,
    idem_key         text NOT NULL UNIQUE,
    resource         text NOT NULL,
    arguments        jsonb NOT NULL,
    outcome          text NOT NULL CHECK (outcome IN ('succeeded', 'failed', 'stuck')),
    delay_ms         bigint NOT NULL,
    ends_at          timestamptz NULL,
    not_found_until  timestamptz NULL,
    deployment_id    text NULL,
    error            text NULL,
    created_at       timestamptz NOT NULL
);
"#;

/// The columns of a job as read, its state evaluated at the start of the statement.
const JOB_COLUMNS: &str = "operation_id, idem_key, resource, arguments, outcome,
    ends_at IS NOT NULL AND ends_at <= statement_timestamp(),
    not_found_until IS NOT NULL AND statement_timestamp() < not_found_until,
    deployment_id, error, created_at";

/// A row of [`JOB_COLUMNS`].
type JobRow = (
    String,
    String,
    String,
    Value,
    String,
    bool,
    bool,
    Option<String>,
    Option<String>,
    DateTime<Utc>,
);

fn job_from_row(row: JobRow) -> Result<Job> {
    let (
        operation_id,
        idem_key,
        resource,
        arguments,
        outcome,
        ended,
        hidden,
        deployment_id,
        error,
        created_at,
    ) = row;
    let ending = Ending::parse(&outcome)
        .with_context(|| format!("job {operation_id} has an unknown outcome {outcome:?}"))?;
    Ok(Job {
        operation_id,
        idem_key,
        resource,
        arguments,
        ending,
        ended,
        hidden,
        deployment_id,
        error,
        created_at,
    })
}

/// The W3C trace context headers of a request, exactly as received (not validated: a test
/// must see a malformed header too), `None` when absent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceHeaders {
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

/// One row of the request log, as inserted before the request is processed.
#[derive(Debug)]
pub struct RequestEntry<'a> {
    /// `write`, `lookup` or `status`.
    pub kind: &'a str,
    pub mode: Option<&'a str>,
    pub resource: Option<&'a str>,
    pub idem_key: Option<&'a str>,
    /// The fault the request consumed.
    pub fault: Option<&'a str>,
    /// The async operation the request names (a status read).
    pub operation_id: Option<&'a str>,
    pub trace: &'a TraceHeaders,
    /// The deadline a write carried.
    pub deadline: Option<DateTime<Utc>>,
}

/// A write's deadline (the `DOWNSTREAM_DEADLINE_HEADER` header): an absolute time the
/// write must commit before, or not at all.
#[derive(Debug, Clone)]
pub struct Deadline {
    /// The header value as received, echoed in the `deadline_passed` answer.
    pub raw: String,
    pub at: DateTime<Utc>,
}

/// Outcome of a write in a mode with no replay (lookup, none, the broken ones).
#[derive(Debug)]
pub enum Written {
    /// One new mutation, this is its receipt.
    Created(Value),
    /// The deadline had passed at the commit point, at this (database clock + offset)
    /// time: rolled back, nothing was written.
    Late(DateTime<Utc>),
}

/// Outcome of an async-mode write.
#[derive(Debug)]
pub enum AsyncWrite {
    /// New key: a new job (and its mutation).
    Created(Job),
    /// Known key, same resource and body: that job, as it is now.
    Replayed(Job),
    /// Known key, another resource or body.
    KeyReused,
    /// New key, but the deadline had passed at the commit point: no job.
    Late(DateTime<Utc>),
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
    /// New key, but the deadline had passed at the commit point: nothing was written.
    Late(DateTime<Utc>),
}

#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
    schema: String,
    /// `DOWNSTREAM_CLOCK_OFFSET_MS`: added to the database clock at the deadline check.
    clock_offset_ms: i64,
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
            clock_offset_ms: 0,
        };
        store.create_schema().await?;
        Ok(store)
    }

    /// The same store, with its deadline checks run on a clock `ms` ahead (or behind,
    /// when negative) of the database's.
    pub fn with_clock_offset(mut self, ms: i64) -> Store {
        self.clock_offset_ms = ms;
        self
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
    pub async fn log_request(&self, entry: &RequestEntry<'_>) -> Result<i64> {
        let id = sqlx::query_scalar(self.sql(
            "INSERT INTO {s}.requests
                 (kind, mode, resource, idem_key, fault, operation_id, traceparent, tracestate,
                  deadline)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING id",
        ))
        .bind(entry.kind)
        .bind(entry.mode)
        .bind(entry.resource)
        .bind(entry.idem_key)
        .bind(entry.fault)
        .bind(entry.operation_id)
        .bind(entry.trace.traceparent.as_deref())
        .bind(entry.trace.tracestate.as_deref())
        .bind(entry.deadline)
        .fetch_one(&self.pool)
        .await?;
        Ok(id)
    }

    /// Complete a logged request with what its work found out: the async operation it
    /// was about and, when it consumed none, the fault that shaped its answer
    /// (`status_not_found`). Values already set are kept.
    pub async fn annotate_request(
        &self,
        request_id: i64,
        operation_id: Option<&str>,
        fault: Option<&str>,
    ) -> Result<()> {
        sqlx::query(self.sql(
            "UPDATE {s}.requests
             SET operation_id = coalesce(operation_id, $2), fault = coalesce(fault, $3)
             WHERE id = $1",
        ))
        .bind(request_id)
        .bind(operation_id)
        .bind(fault)
        .execute(&self.pool)
        .await?;
        Ok(())
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

    /// The commit point of a write: the last statement of its transaction, run just before
    /// COMMIT. With a deadline, reads the database clock as it is now (`clock_timestamp()`,
    /// not the transaction's start) plus `DOWNSTREAM_CLOCK_OFFSET_MS` and returns that time
    /// if the deadline has passed, in which case the caller rolls back. No deadline: no
    /// statement, `None`.
    async fn past_deadline(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        deadline: Option<&Deadline>,
    ) -> Result<Option<DateTime<Utc>>> {
        let Some(deadline) = deadline else {
            return Ok(None);
        };
        let (at, passed): (DateTime<Utc>, bool) = sqlx::query_as(
            "SELECT t, t > $2 FROM (SELECT clock_timestamp() + make_interval(secs => $1) AS t) c",
        )
        .bind(self.clock_offset_ms as f64 / 1000.0)
        .bind(deadline.at)
        .fetch_one(&mut **tx)
        .await?;
        Ok(passed.then_some(at))
    }

    /// Durable key replay, in one transaction. A concurrent request with the
    /// same key blocks on the primary key until this one commits, then sees the
    /// committed key and replays: no double mutation under concurrency. Only a new key
    /// checks the deadline (a replay creates nothing); a late one rolls back.
    pub async fn replay_write(
        &self,
        resource: &str,
        idem_key: &str,
        body: &Value,
        retention: Duration,
        deadline: Option<&Deadline>,
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
            if let Some(at) = self.past_deadline(&mut tx, deadline).await? {
                tx.rollback().await?;
                return Ok(Replay::Late(at));
            }
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
    /// concurrent requests under one new key both miss the check and both write. A write
    /// checks its deadline as [`Store::plain_write`] does; a replay does not.
    pub async fn broken_replay_write(
        &self,
        mode: &str,
        resource: &str,
        idem_key: &str,
        body: &Value,
        racy: bool,
        deadline: Option<&Deadline>,
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
        let written = self
            .plain_write(mode, resource, Some(idem_key), body, deadline)
            .await?;
        Ok(match written {
            Written::Created(receipt) => Replay::Created(receipt),
            Written::Late(at) => Replay::Late(at),
        })
    }

    /// Lookup and none modes: every write is a new mutation, no dedupe. With a deadline
    /// that has passed at the commit point, the mutation is rolled back.
    pub async fn plain_write(
        &self,
        mode: &str,
        resource: &str,
        idem_key: Option<&str>,
        body: &Value,
        deadline: Option<&Deadline>,
    ) -> Result<Written> {
        let mut tx = self.pool.begin().await?;
        let (_, receipt) = self
            .insert_mutation(&mut tx, mode, resource, idem_key, body)
            .await?;
        if let Some(at) = self.past_deadline(&mut tx, deadline).await? {
            tx.rollback().await?;
            return Ok(Written::Late(at));
        }
        tx.commit().await?;
        Ok(Written::Created(receipt))
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

    /// Async mode: create the job for a new key, or find the job of a known one. Same-key
    /// writes are serialised on an advisory lock, so a concurrent repeat waits for the
    /// first one to commit and then finds its job. `shape` is called only when a job is
    /// created (it consumes the job faults), inside the transaction that stores it. A new
    /// job checks the deadline last and is rolled back if it is late.
    pub async fn async_write(
        &self,
        resource: &str,
        idem_key: &str,
        body: &Value,
        deadline: Option<&Deadline>,
        shape: impl FnOnce() -> Shape,
    ) -> Result<AsyncWrite> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(format!(
                "reference-downstream:{}:async:{idem_key}",
                self.schema
            ))
            .execute(&mut *tx)
            .await?;
        let known: Option<(bool, String)> = sqlx::query_as(self.sql(
            "SELECT resource = $2 AND arguments = $3, operation_id
             FROM {s}.async_jobs WHERE idem_key = $1",
        ))
        .bind(idem_key)
        .bind(resource)
        .bind(body)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((same, operation_id)) = known {
            tx.commit().await?;
            if !same {
                return Ok(AsyncWrite::KeyReused);
            }
            return match self.async_job(&operation_id).await? {
                Some(job) => Ok(AsyncWrite::Replayed(job)),
                None => anyhow::bail!("async job {operation_id} vanished"),
            };
        }

        let shape = shape();
        let (id, at): (i64, DateTime<Utc>) = sqlx::query_as(self.sql(
            "SELECT nextval(pg_get_serial_sequence('{s}.mutations', 'id')), statement_timestamp()",
        ))
        .fetch_one(&mut *tx)
        .await?;
        // Delays are at most jobs::MAX_DELAY_MS (checked in config and faults).
        let after = |ms: u64| at + Duration::from_millis(ms.min(jobs::MAX_DELAY_MS));
        let ends_at = match shape.ending {
            Ending::Stuck => None,
            _ => Some(after(shape.delay_ms)),
        };
        let not_found_until = match shape.hidden_ms {
            0 => None,
            ms => Some(after(ms)),
        };
        let job = Job {
            operation_id: jobs::operation_id(id),
            idem_key: idem_key.to_owned(),
            resource: resource.to_owned(),
            arguments: body.clone(),
            ending: shape.ending,
            ended: ends_at.is_some_and(|end| end <= at),
            hidden: false,
            deployment_id: (shape.ending == Ending::Succeeded).then(|| jobs::deployment_id(id)),
            error: (shape.ending == Ending::Failed).then(|| jobs::FAILURE.to_owned()),
            created_at: at,
        };
        // The mutation is the business change (the job was started), counted like any
        // other; its receipt is the acceptance, the final receipt is the job's.
        sqlx::query(self.sql(
            "INSERT INTO {s}.mutations
                 (id, mode, resource, idem_key, arguments, receipt_id, receipt, created_at)
             VALUES ($1, 'async', $2, $3, $4, $5, $6, $7)",
        ))
        .bind(id)
        .bind(resource)
        .bind(idem_key)
        .bind(body)
        .bind(&job.operation_id)
        .bind(job.document())
        .bind(at)
        .execute(&mut *tx)
        .await?;
        sqlx::query(self.sql(
            "INSERT INTO {s}.async_jobs
                 (id, operation_id, idem_key, resource, arguments, outcome, delay_ms, ends_at,
                  not_found_until, deployment_id, error, created_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
        ))
        .bind(id)
        .bind(&job.operation_id)
        .bind(idem_key)
        .bind(resource)
        .bind(body)
        .bind(shape.ending.as_str())
        .bind(i64::try_from(shape.delay_ms).unwrap_or(i64::MAX))
        .bind(ends_at)
        .bind(not_found_until)
        .bind(&job.deployment_id)
        .bind(&job.error)
        .bind(at)
        .execute(&mut *tx)
        .await?;
        if let Some(late) = self.past_deadline(&mut tx, deadline).await? {
            tx.rollback().await?;
            return Ok(AsyncWrite::Late(late));
        }
        tx.commit().await?;
        Ok(AsyncWrite::Created(job))
    }

    /// The job with this operation id, as it is now.
    pub async fn async_job(&self, operation_id: &str) -> Result<Option<Job>> {
        let row: Option<JobRow> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT {JOB_COLUMNS} FROM {}.async_jobs WHERE operation_id = $1",
            self.schema
        )))
        .bind(operation_id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(job_from_row).transpose()
    }

    /// The job created under this key on this resource, as it is now.
    pub async fn async_job_by_key(&self, resource: &str, idem_key: &str) -> Result<Option<Job>> {
        let row: Option<JobRow> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT {JOB_COLUMNS} FROM {}.async_jobs WHERE idem_key = $1 AND resource = $2",
            self.schema
        )))
        .bind(idem_key)
        .bind(resource)
        .fetch_optional(&self.pool)
        .await?;
        row.map(job_from_row).transpose()
    }

    /// (idempotency key, resource) of the job with this operation id: what a status read
    /// is matched to faults and logged by.
    pub async fn async_job_identity(&self, operation_id: &str) -> Result<Option<(String, String)>> {
        let found = sqlx::query_as(
            self.sql("SELECT idem_key, resource FROM {s}.async_jobs WHERE operation_id = $1"),
        )
        .bind(operation_id)
        .fetch_optional(&self.pool)
        .await?;
        Ok(found)
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
