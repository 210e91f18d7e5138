//! The outbox relay: claims due `intent_outbox` rows, publishes them with confirms and marks
//! the confirmed ones sent. Many relays may run against the same table.
//!
//! Each step is three statements and never holds a transaction across the publish:
//! 1. claim: one `UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED) RETURNING`
//!    pushes `next_attempt_at` forward by the lease, so other relays skip the rows while
//!    this one publishes them, and take them over if it dies;
//! 2. publish the batch (mandatory, persistent) and await the confirms together;
//! 3. settle: confirmed rows are marked sent in one statement; nacked, returned
//!    (unroutable) or failed rows get `attempts + 1`, `last_error` and a jittered, capped
//!    back-off in another.
//!
//! A relay that dies between 2 and 3 leaves its rows unsent: they are published again when
//! the lease passes, and the worker's inbox suppresses the repeat (same action key).
//!
//! Rows may be inserted by any language with plain SQL. A claimed row that can never be
//! published ([`refusal`]: its key is over the 255 bytes of a message id, its body is not an
//! intent the worker's decoder accepts, or the body's key is not the row's) is marked failed
//! (`failed_at`, `failure`) and never claimed again, so it cannot stop the rows behind it.
//!
//! Each row is published with the trace context stored with it ([`crate::trace`]): its
//! `traceparent`/`tracestate` become the parent of the row's publish span and, unless that span
//! is exported, the message's headers. A row without one is published without a parent (never
//! under whatever span runs the relay); a malformed stored `traceparent` is ignored and counted
//! (`source="outbox"`), like any context received on the agent side.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use metrics::counter;
use sqlx::PgPool;
use tracing::{info, warn};

use crate::publish::{Encoded, Traced};
use crate::{PublishError, PublishOptions, Publisher};

/// Outbox rows whose publish failed, by `reason` (unroutable, nacked, not_confirmed, amqp).
pub const PUBLISH_FAILURES: &str = "intent_publisher_publish_failures_total";
/// Outbox rows published, confirmed and marked sent.
pub const ROWS_SENT: &str = "intent_publisher_rows_sent_total";
/// Sent outbox rows deleted after the retention.
pub const ROWS_SWEPT: &str = "intent_publisher_rows_swept_total";
/// Rows marked failed, by `reason` ([`refusal`]).
pub const ROWS_FAILED: &str = "intent_publisher_rows_failed_total";

/// Waits between reconnects to the broker: from 500 ms doubling to 10 s, ±50 % so relays that
/// lost the broker together do not return in lockstep.
const RECONNECT: kit::backoff::Backoff = kit::backoff::Backoff {
    initial: Duration::from_millis(500),
    multiplier: 2.0,
    max: Duration::from_secs(10),
    jitter: 0.5,
};

/// How a relay runs (`publisher relay` flags / `PUBLISHER_*` settings).
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Rows claimed and published per step.
    pub batch: i64,
    /// How long a claim keeps other relays off a row.
    pub lease: Duration,
    /// Pause when a step found less than a full batch.
    pub idle_poll: Duration,
    /// First retry delay after a failed publish; doubles per attempt up to `backoff_max`,
    /// with jitter (50-100 % of the delay).
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// Sent rows are deleted this long after `sent_at`.
    pub retention: Duration,
    /// How often sent rows are swept.
    pub sweep_interval: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            batch: 500,
            lease: Duration::from_secs(30),
            idle_poll: Duration::from_millis(200),
            backoff_initial: Duration::from_secs(1),
            backoff_max: Duration::from_secs(300),
            retention: Duration::from_secs(24 * 3600),
            sweep_interval: Duration::from_secs(60),
        }
    }
}

/// Why a relay step failed as a whole (rows stay unsent and are claimed again later).
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error(transparent)]
    Publish(#[from] PublishError),
}

/// A claimed row.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub id: i64,
    pub tenant: String,
    pub action_id: String,
    pub body: String,
    /// The trace context the intent was enqueued in (either may be NULL).
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    /// The body's tool once [`Relay::step`] has decoded it (named on the publish span).
    pub tool: Option<String>,
}

impl<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> for Claimed {
    fn from_row(row: &'r sqlx::postgres::PgRow) -> Result<Self, sqlx::Error> {
        use sqlx::Row as _;
        Ok(Claimed {
            id: row.try_get("id")?,
            tenant: row.try_get("tenant")?,
            action_id: row.try_get("action_id")?,
            body: row.try_get("body")?,
            traceparent: row.try_get("traceparent")?,
            tracestate: row.try_get("tracestate")?,
            tool: None,
        })
    }
}

impl Claimed {
    /// How to publish this row: with its stored trace context as the parent, or with none.
    fn options(&self) -> PublishOptions {
        match crate::trace::receive(
            "outbox",
            self.traceparent.as_deref(),
            self.tracestate.as_deref(),
        ) {
            Some(cx) => PublishOptions::new().with_trace(Some(cx)),
            None => PublishOptions::detached(),
        }
    }
}

/// What one step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepReport {
    pub claimed: usize,
    pub sent: usize,
    /// Publishes that failed; those rows are retried after a back-off.
    pub failed: usize,
    /// Rows that can never be published, marked failed (see [`refusal`]); never retried.
    pub refused: usize,
    /// The broker link failed during the step: the publisher must reconnect.
    pub link_failed: bool,
}

/// One relay: the agent database and a publisher for the intents exchange.
pub struct Relay {
    pool: PgPool,
    publisher: Publisher,
    config: RelayConfig,
    hosts: Option<Arc<kit::pg::Hosts>>,
}

impl Relay {
    pub fn new(pool: PgPool, publisher: Publisher, config: RelayConfig) -> Relay {
        Relay {
            pool,
            publisher,
            config,
            hosts: None,
        }
    }

    /// Tells `hosts` (the pool's, from [`kit::pg::pool`]) about every failed statement, so a
    /// primary that turned read-only or went away is left at once and, with several hosts,
    /// the new primary is looked for.
    pub fn following(mut self, hosts: Arc<kit::pg::Hosts>) -> Relay {
        self.hosts = Some(hosts);
        self
    }

    fn observe(&self, error: &RelayError) {
        if let (Some(hosts), RelayError::Db(e)) = (&self.hosts, error) {
            hosts.observe(e);
        }
    }

    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// Replaces the publisher (after a broker link failure).
    pub fn set_publisher(&mut self, publisher: Publisher) {
        self.publisher = publisher;
    }

    /// Claims up to `batch` due rows for `lease`, oldest first.
    pub async fn claim(&self) -> Result<Vec<Claimed>, RelayError> {
        let mut rows: Vec<Claimed> = sqlx::query_as(
            "UPDATE intent_outbox SET next_attempt_at = now() + make_interval(secs => $2)
             WHERE id IN (SELECT id FROM intent_outbox
                          WHERE sent_at IS NULL AND failed_at IS NULL AND next_attempt_at <= now()
                          ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)
             RETURNING id, tenant, action_id, body, traceparent, tracestate",
        )
        .bind(self.config.batch)
        .bind(self.config.lease.as_secs_f64())
        .fetch_all(&self.pool)
        .await?;
        rows.sort_by_key(|r| r.id);
        Ok(rows)
    }

    /// Publishes claimed rows as one pipelined batch, each with its own trace context; one
    /// result per row, in order.
    pub async fn publish(&self, rows: &[Claimed]) -> Vec<Result<(), PublishError>> {
        let batch: Vec<Traced<'_>> = rows
            .iter()
            .map(|r| Traced {
                intent: Encoded {
                    tenant: &r.tenant,
                    action_id: &r.action_id,
                    body: r.body.as_bytes(),
                },
                tool: r.tool.as_deref(),
                options: r.options(),
            })
            .collect();
        self.publisher.publish_batch_with(&batch).await
    }

    /// Records the outcome of a publish: sent rows in one statement, failed rows (with their
    /// errors and back-off) in another. A row whose publish was refused for what it is (its key
    /// or a name too long for AMQP) is marked failed instead, like a [`refusal`].
    pub async fn settle(
        &self,
        rows: &[Claimed],
        results: &[Result<(), PublishError>],
    ) -> Result<StepReport, RelayError> {
        let mut sent = Vec::new();
        let (mut failed, mut errors) = (Vec::new(), Vec::new());
        let mut refused = Vec::new();
        let mut link_failed = false;
        for (row, result) in rows.iter().zip(results) {
            match result {
                Ok(()) => sent.push(row.id),
                Err(error @ (PublishError::InvalidIntent(_) | PublishError::TooLong { .. })) => {
                    refused.push((row, Refusal::new("invalid_intent", error.to_string())));
                }
                Err(error) => {
                    let reason = failure_reason(error);
                    link_failed |= reason == "amqp";
                    counter!(PUBLISH_FAILURES, "reason" => reason).increment(1);
                    failed.push(row.id);
                    errors.push(error.to_string());
                }
            }
        }
        if !sent.is_empty() {
            sqlx::query(
                "UPDATE intent_outbox SET sent_at = now() WHERE id = ANY($1) AND sent_at IS NULL",
            )
            .bind(&sent)
            .execute(&self.pool)
            .await?;
            counter!(ROWS_SENT).increment(sent.len() as u64);
        }
        if !failed.is_empty() {
            sqlx::query(
                "UPDATE intent_outbox o
                 SET attempts = o.attempts + 1, last_error = f.error,
                     next_attempt_at = now() + make_interval(secs =>
                         least($3::float8, $4::float8 * power(2, least(o.attempts, 30)))
                         * (0.5 + random() / 2))
                 FROM unnest($1::int8[], $2::text[]) AS f(id, error)
                 WHERE o.id = f.id AND o.sent_at IS NULL",
            )
            .bind(&failed)
            .bind(&errors)
            .bind(self.config.backoff_max.as_secs_f64())
            .bind(self.config.backoff_initial.as_secs_f64())
            .execute(&self.pool)
            .await?;
            warn!(
                failed = failed.len(),
                first_error = %errors[0],
                "intents not published; they stay in the outbox and are retried"
            );
        }
        self.mark_failed(&refused).await?;
        Ok(StepReport {
            claimed: rows.len(),
            sent: sent.len(),
            failed: failed.len(),
            refused: refused.len(),
            link_failed,
        })
    }

    /// Marks rows that can never be published as failed, in one statement that skips a row
    /// already sent or failed; counts and logs each by its key (never its body).
    pub async fn mark_failed(&self, rows: &[(&Claimed, Refusal)]) -> Result<(), RelayError> {
        if rows.is_empty() {
            return Ok(());
        }
        let ids: Vec<i64> = rows.iter().map(|(row, _)| row.id).collect();
        let failures: Vec<String> = rows.iter().map(|(_, why)| why.to_string()).collect();
        sqlx::query(
            "UPDATE intent_outbox o SET failed_at = now(), failure = f.failure
             FROM unnest($1::int8[], $2::text[]) AS f(id, failure)
             WHERE o.id = f.id AND o.sent_at IS NULL AND o.failed_at IS NULL",
        )
        .bind(&ids)
        .bind(&failures)
        .execute(&self.pool)
        .await?;
        for (row, why) in rows {
            counter!(ROWS_FAILED, "reason" => why.reason).increment(1);
            warn!(
                id = row.id,
                key = %shorten(&protocol::action_key(&row.tenant, &row.action_id)),
                reason = why.reason,
                failure = %why.detail,
                "outbox row can never be published: marked failed and skipped"
            );
        }
        Ok(())
    }

    /// Claim; mark the rows that can never be published failed; publish the others; settle.
    pub async fn step(&self) -> Result<StepReport, RelayError> {
        let claimed = self.claim().await?;
        if claimed.is_empty() {
            return Ok(StepReport::default());
        }
        let (mut rows, mut refused) = (Vec::with_capacity(claimed.len()), Vec::new());
        for row in &claimed {
            match checked(row) {
                Err(why) => refused.push((row, why)),
                Ok(tool) => rows.push(Claimed {
                    tool: Some(tool),
                    ..row.clone()
                }),
            }
        }
        self.mark_failed(&refused).await?;
        let results = self.publish(&rows).await;
        fault_point("after_publish");
        let report = self.settle(&rows, &results).await?;
        Ok(StepReport {
            claimed: claimed.len(),
            refused: report.refused + refused.len(),
            ..report
        })
    }

    /// Deletes rows sent longer than `retention` ago (at most 10,000 per call).
    pub async fn sweep(&self) -> Result<u64, RelayError> {
        let done = sqlx::query(
            "DELETE FROM intent_outbox WHERE id IN (
                 SELECT id FROM intent_outbox
                 WHERE sent_at IS NOT NULL AND sent_at < now() - make_interval(secs => $1)
                 LIMIT 10000)",
        )
        .bind(self.config.retention.as_secs_f64())
        .execute(&self.pool)
        .await?;
        counter!(ROWS_SWEPT).increment(done.rows_affected());
        Ok(done.rows_affected())
    }

    /// Runs steps until `shutdown` resolves. `reconnect` builds a new publisher when the
    /// broker link failed; database errors are logged and retried after `idle_poll`.
    pub async fn run<R, F>(
        &mut self,
        shutdown: impl Future<Output = ()>,
        mut reconnect: R,
    ) -> Result<(), RelayError>
    where
        R: FnMut() -> F,
        F: Future<Output = Result<Publisher, PublishError>>,
    {
        tokio::pin!(shutdown);
        let mut last_sweep = tokio::time::Instant::now() - self.config.sweep_interval;
        info!(batch = self.config.batch, node = %self.publisher.node(), "relay running");
        loop {
            if last_sweep.elapsed() >= self.config.sweep_interval {
                last_sweep = tokio::time::Instant::now();
                match self.sweep().await {
                    Ok(0) => {}
                    Ok(n) => info!(swept = n, "swept sent outbox rows"),
                    Err(error) => {
                        self.observe(&error);
                        warn!(%error, "outbox sweep failed");
                    }
                }
            }
            let report = match self.step().await {
                Ok(report) => report,
                Err(error) => {
                    self.observe(&error);
                    warn!(%error, "relay step failed; retrying");
                    StepReport::default()
                }
            };
            if report.link_failed || !self.publisher.is_connected() {
                warn!("broker link lost; reconnecting");
                let mut attempt = 0;
                loop {
                    tokio::select! {
                        _ = &mut shutdown => return Ok(()),
                        next = reconnect() => match next {
                            Ok(publisher) => {
                                self.publisher = publisher;
                                info!(node = %self.publisher.node(), "relay reconnected");
                                break;
                            }
                            Err(error) => {
                                attempt += 1;
                                let wait = kit::backoff::delay(&RECONNECT, attempt);
                                warn!(%error, retry_in_ms = wait.as_millis() as u64, "cannot reconnect to the broker");
                                tokio::select! {
                                    _ = &mut shutdown => return Ok(()),
                                    _ = tokio::time::sleep(wait) => {}
                                }
                            }
                        }
                    }
                }
            }
            if report.claimed < self.config.batch as usize {
                tokio::select! {
                    _ = &mut shutdown => return Ok(()),
                    _ = tokio::time::sleep(self.config.idle_poll) => {}
                }
            } else if futures_lite::future::poll_once(&mut shutdown)
                .await
                .is_some()
            {
                return Ok(());
            }
        }
    }
}

/// Why [`check_table`] refused to start.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// The table, or a column the relay reads, is missing (a table made from migration 0001
    /// alone lacks `failed_at` and `failure`; one older than migration 0003 lacks
    /// `traceparent` and `tracestate`).
    #[error(
        "intent_outbox is not ready for this relay ({0}): run `publisher migrate` (it creates the table, or adds the columns of later migrations: failed_at and failure of 0002, traceparent and tracestate of 0003)"
    )]
    NotMigrated(sqlx::Error),
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
}

/// Checks that `intent_outbox` has every column the relay reads, so a table that was not
/// migrated stops start-up with a hint instead of failing every claim.
pub async fn check_table(pool: &PgPool) -> Result<(), TableError> {
    let probe = "SELECT id, tenant, action_id, body, failed_at, failure, traceparent, tracestate
                 FROM intent_outbox LIMIT 0";
    match sqlx::query(probe).execute(pool).await {
        Ok(_) => Ok(()),
        // undefined_column, undefined_table
        Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("42703" | "42P01")) => {
            Err(TableError::NotMigrated(sqlx::Error::Database(e)))
        }
        Err(e) => Err(e.into()),
    }
}

/// Backlog figures for metrics and the alert: unsent rows still to publish (failed rows are
/// not waiting for the relay) and the age of the oldest.
pub async fn backlog(pool: &PgPool) -> Result<(i64, f64), sqlx::Error> {
    sqlx::query_as(
        "SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(created_at))::float8, 0)
         FROM intent_outbox WHERE sent_at IS NULL AND failed_at IS NULL",
    )
    .fetch_one(pool)
    .await
}

/// Rows marked failed (they stay in the table until an operator deletes or repairs them).
pub async fn failed_rows(pool: &PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM intent_outbox WHERE failed_at IS NOT NULL")
        .fetch_one(pool)
        .await
}

/// Why a row can never be published: a metrics label and the text stored in `failure`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// `key_too_long`, `invalid_intent` or `key_mismatch`.
    pub reason: &'static str,
    pub detail: String,
}

impl Refusal {
    fn new(reason: &'static str, detail: String) -> Refusal {
        Refusal { reason, detail }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.reason, self.detail)
    }
}

/// Whether `row` can never be published, checked in this order:
/// - `key_too_long`: the columns' `<tenant>:<action_id>`, the message id, is over 255 bytes;
/// - `invalid_intent`: the body is not an intent the worker's decoder accepts (the worker
///   would dead-letter it); the decoder's code and message;
/// - `key_mismatch`: the body's `tenant`/`action_id` are not the row's, so the message id
///   would name another action than the body.
pub fn refusal(row: &Claimed) -> Option<Refusal> {
    checked(row).err()
}

/// [`refusal`], and the body's tool when the row can be published.
fn checked(row: &Claimed) -> Result<String, Refusal> {
    if let Err(error) = protocol::check_action_key(&row.tenant, &row.action_id) {
        return Err(Refusal::new("key_too_long", error.to_string()));
    }
    let intent = match protocol::decode_intent(row.body.as_bytes()) {
        Ok(intent) => intent,
        Err(error) => {
            return Err(Refusal::new(
                "invalid_intent",
                format!("{} ({error})", error.code()),
            ))
        }
    };
    if intent.tenant != row.tenant || intent.action_id != row.action_id {
        return Err(Refusal::new(
            "key_mismatch",
            format!(
                "the body's key {:?} is not the row's {:?}",
                shorten(&protocol::action_key(&intent.tenant, &intent.action_id)),
                shorten(&protocol::action_key(&row.tenant, &row.action_id)),
            ),
        ));
    }
    Ok(intent.tool)
}

/// A key short enough to log (a row's columns are unbounded text).
fn shorten(key: &str) -> String {
    const MAX: usize = 300;
    match key.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}…", &key[..cut]),
        None => key.to_owned(),
    }
}

/// The metrics label of a failed publish.
fn failure_reason(error: &PublishError) -> &'static str {
    match error {
        PublishError::Unroutable { .. } => "unroutable",
        PublishError::Nacked => "nacked",
        PublishError::NotConfirmed => "not_confirmed",
        _ => "amqp",
    }
}

/// `PUBLISHER_FAULT_POINT=<name>` (builds with the `fault-points` feature only): announce on
/// stderr and stop the process with SIGSTOP, so a test can SIGKILL it exactly there.
#[inline]
fn fault_point(_name: &str) {
    #[cfg(feature = "fault-points")]
    if std::env::var("PUBLISHER_FAULT_POINT").as_deref() == Ok(_name) {
        kit::fault::stop_here(_name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(tenant: &str, action_id: &str, body: &str) -> Claimed {
        Claimed {
            id: 1,
            tenant: tenant.into(),
            action_id: action_id.into(),
            body: body.into(),
            traceparent: None,
            tracestate: None,
            tool: None,
        }
    }

    fn body(tenant: &str, action_id: &str) -> String {
        format!(
            r#"{{"tenant":"{tenant}","action_id":"{action_id}","tool":"refund","arguments":{{}}}}"#
        )
    }

    #[test]
    fn rows_that_can_never_be_published_are_refused_by_reason() {
        let (t200, b54, b200) = ("T".repeat(200), "b".repeat(54), "b".repeat(200));
        assert_eq!(refusal(&row(&t200, &b54, &body(&t200, &b54))), None);

        let why = refusal(&row(&t200, &b200, &body(&t200, &b200))).unwrap();
        assert_eq!(why.reason, "key_too_long");
        assert!(why.to_string().contains("401 bytes"), "{why}");

        let nul = r#"{"tenant":"t","action_id":"a","tool":"refund","arguments":{"s":"\u0000"}}"#;
        let why = refusal(&row("t", "a", nul)).unwrap();
        assert_eq!(why.reason, "invalid_intent");
        assert!(why.detail.starts_with("nul_character ("), "{why}");
        let why = refusal(&row("t", "a", "not json")).unwrap();
        assert!(why.detail.starts_with("not_json ("), "{why}");

        let why = refusal(&row("t", "a", &body("t", "other"))).unwrap();
        assert_eq!(why.reason, "key_mismatch");
        assert!(
            why.detail.contains("t:other") && why.detail.contains("t:a"),
            "{why}"
        );
    }
}
