//! Admission: the inbox. Each intent is inserted (claimed for its first dispatch, or
//! `prepared`) or, when its key exists, the stored row is loaded — many intents in one
//! statement and one commit.

use std::collections::HashMap;
use std::time::Duration;

use super::{Ledger, LedgerError, Operation, ReplayWindows, OPERATION_COLUMNS};

/// An intent ready to be recorded.
#[derive(Debug, Clone)]
pub struct NewOperation {
    pub tenant: String,
    pub action_id: String,
    pub tool: String,
    pub fingerprint: String,
    /// Canonical JSON of the arguments: the request body on every attempt.
    pub arguments: String,
    pub call_id: Option<String>,
    pub reply_to: Option<String>,
    /// The intent's trace context (stored with the row; later spans link to it).
    pub trace: Option<protocol::trace::TraceContext>,
    /// On a compensation: the action_id of the original it undoes (admitted by
    /// [`Ledger::admit_compensation`], never by the batch statements here).
    pub compensates: Option<String>,
}

/// The row an intent landed on.
#[derive(Debug, Clone)]
pub struct Admitted {
    pub operation: Operation,
    /// True when this call created the row; false when the key already existed.
    pub inserted: bool,
}

impl Ledger {
    /// Inserts each intent as `prepared` or loads its existing row, in one statement and one
    /// commit. `intents` must not repeat a key (callers fold in-batch duplicates first).
    /// `prepared_grace` delays the recovery scheduler's interest in a fresh `prepared` row.
    /// The consumer uses [`Ledger::admit_claimed`]; this is for rows meant to wait for the
    /// scheduler (and for tests that model a crash before the claim).
    pub async fn admit(
        &self,
        intents: &[NewOperation],
        worker_id: &str,
        prepared_grace: Duration,
    ) -> Result<Vec<Admitted>, LedgerError> {
        let values = "'prepared', $10, now() + make_interval(secs => $11)";
        let columns = "state, changed_by, next_attempt_at";
        let intents: Vec<&NewOperation> = intents.iter().collect();
        self.admit_with(&intents, columns, values, |q| {
            q.bind(worker_id.to_string())
                .bind(prepared_grace.as_secs_f64())
        })
        .await
    }

    /// The consumer's admission: each new intent is inserted already claimed by this worker
    /// for its first dispatch (`dispatching`, fence 1, a lease, one write authorised, the
    /// first-dispatch time and replay deadline), exactly what [`Ledger::claim_prepared`] would
    /// make of a `prepared` row, but as one row version and one history row instead of two,
    /// in one statement with the inbox check. An existing key's row is loaded unchanged.
    ///
    /// Nothing is sent on the strength of this claim alone: the send fence
    /// ([`Ledger::fence_sends`]) still runs just before the request and marks the row sent
    /// (clears `unsent_fence`). A worker that dies before that leaves a row whose lease expiry puts it
    /// back to `prepared` (nothing was sent), not `unknown`.
    pub async fn admit_claimed(
        &self,
        intents: &[&NewOperation],
        worker_id: &str,
        lease: Duration,
        windows: &ReplayWindows,
    ) -> Result<Vec<Admitted>, LedgerError> {
        // `created_by`: the row shows its first version itself, so it writes no history row
        // (migration 0011).
        let columns = "state, changed_by, created_by, fence, unsent_fence, lease_owner, \
                       lease_until, attempts, first_dispatch_at, replay_deadline";
        let values =
            "'dispatching', $10, $10, 1, 1, $10, now() + make_interval(secs => $11), 1, now(), \
                      now() + make_interval(secs => (SELECT w.secs FROM unnest($12::text[], \
                      $13::float8[]) AS w(tool, secs) WHERE w.tool = input.tool))";
        self.admit_with(intents, columns, values, |q| {
            q.bind(worker_id.to_string())
                .bind(lease.as_secs_f64())
                .bind(windows.tools.clone())
                .bind(windows.secs.clone())
        })
        .await
    }

    /// The inbox statement: insert what is new (`columns` set to `values`, whose parameters
    /// from `$10` on are bound by `bind_rest`), load what exists. The second branch names the
    /// input's key in its `NOT EXISTS`, so the planner drops the inserted keys (a hash anti
    /// join) before it looks any key up: a batch of new intents makes no index lookups there,
    /// instead of one per intent that could only find nothing (about 2.5 µs of Postgres CPU
    /// per intent).
    pub(super) async fn admit_with<'q>(
        &self,
        intents: &[&'q NewOperation],
        columns: &str,
        values: &str,
        bind_rest: impl FnOnce(AdmitQuery<'q>) -> AdmitQuery<'q>,
    ) -> Result<Vec<Admitted>, LedgerError> {
        if intents.is_empty() {
            return Ok(Vec::new());
        }
        let col =
            |f: fn(&NewOperation) -> Option<&str>| intents.iter().map(|i| f(i)).collect::<Vec<_>>();
        let sql = format!(
            "WITH input AS (
                SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[],
                                     $6::text[], $7::text[], $8::text[], $9::text[])
                    AS i(tenant, action_id, tool, fingerprint, arguments, call_id, reply_to,
                         traceparent, tracestate)
             ), inserted AS (
                INSERT INTO operations (tenant, action_id, tool, fingerprint, arguments, call_id,
                                        reply_to, traceparent, tracestate, {columns})
                SELECT tenant, action_id, tool, fingerprint, arguments, call_id, reply_to,
                       traceparent, tracestate, {values}
                FROM input
                ON CONFLICT (tenant, action_id) DO NOTHING
                RETURNING {OPERATION_COLUMNS}
             )
             SELECT {OPERATION_COLUMNS}, true AS inserted FROM inserted
             UNION ALL
             SELECT {cols}, false AS inserted
             FROM input i JOIN operations o USING (tenant, action_id)
             WHERE NOT EXISTS (SELECT 1 FROM inserted x
                               WHERE x.tenant = i.tenant AND x.action_id = i.action_id)",
            cols = o_columns()
        );
        let query = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(col(|i| Some(&i.tenant)))
            .bind(col(|i| Some(&i.action_id)))
            .bind(col(|i| Some(&i.tool)))
            .bind(col(|i| Some(&i.fingerprint)))
            .bind(col(|i| Some(&i.arguments)))
            .bind(col(|i| i.call_id.as_deref()))
            .bind(col(|i| i.reply_to.as_deref()))
            .bind(
                intents
                    .iter()
                    .map(|i| i.trace.as_ref().map(|t| t.traceparent()))
                    .collect::<Vec<_>>(),
            )
            .bind(col(|i| i.trace.as_ref().and_then(|t| t.state.as_deref())));
        let rows = bind_rest(query).fetch_all(&self.pool).await?;
        let rows = super::OperationDecoder::decode_all(&rows, |operation, row| {
            Ok(Admitted {
                operation,
                inserted: sqlx::Row::try_get(row, "inserted")?,
            })
        })?;
        // Rows come back in no particular order: each goes to its intent's place.
        let place: HashMap<(&str, &str), usize> = intents
            .iter()
            .enumerate()
            .map(|(u, i)| ((i.tenant.as_str(), i.action_id.as_str()), u))
            .collect();
        let mut found: Vec<Option<Admitted>> = intents.iter().map(|_| None).collect();
        for a in rows {
            let key = (a.operation.tenant.as_str(), a.operation.action_id.as_str());
            if let Some(&u) = place.get(&key) {
                found[u] = Some(a);
            }
        }
        let mut out = Vec::with_capacity(intents.len());
        for (intent, admitted) in intents.iter().zip(found) {
            let admitted = match admitted {
                Some(a) => a,
                // Another worker inserted this key concurrently: our INSERT waited for its
                // commit and skipped, but the statement's snapshot predates that commit. A new
                // statement sees the row.
                None => Admitted {
                    operation: self
                        .find(&intent.tenant, &intent.action_id)
                        .await?
                        .ok_or_else(|| {
                            LedgerError::NotFound(format!("{}:{}", intent.tenant, intent.action_id))
                        })?,
                    inserted: false,
                },
            };
            out.push(admitted);
        }
        Ok(out)
    }
}

type AdmitQuery<'q> =
    sqlx::query::Query<'q, sqlx::Postgres, <sqlx::Postgres as sqlx::Database>::Arguments>;

/// [`OPERATION_COLUMNS`] of the table aliased `o` ("o.id, o.tenant, ..."), written once: the
/// statements that name them are formatted for every batch.
pub(crate) fn o_columns() -> &'static str {
    static COLUMNS: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        OPERATION_COLUMNS
            .split(',')
            .map(|c| format!("o.{}", c.trim()))
            .collect::<Vec<_>>()
            .join(", ")
    });
    &COLUMNS
}
