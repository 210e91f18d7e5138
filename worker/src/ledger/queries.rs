//! Read-only queries: one operation, its history, and the figures the metrics report.

use chrono::{DateTime, Utc};

use super::{Ledger, LedgerError, Operation, OPERATION_COLUMNS};

kit::pg_row! {
    /// One history entry of an operation (appended by the database on every change).
    #[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
    pub struct HistoryEntry {
        pub at: DateTime<Utc>,
        pub from_state: Option<String>,
        pub to_state: String,
        pub fence: i64,
        pub actor: String,
        pub evidence: Option<String>,
        /// Write attempts so far, and the next attempt the change scheduled (if any).
        pub attempts: Option<i32>,
        pub next_attempt_at: Option<DateTime<Utc>>,
    }
}

kit::pg_row! {
    /// Oldest unresolved operation of one tool in one state.
    #[derive(Debug, Clone)]
    pub struct UnresolvedAge {
        pub tool: String,
        pub state: String,
        pub count: i64,
        pub oldest_age_secs: f64,
    }
}

impl Ledger {
    pub async fn find(
        &self,
        tenant: &str,
        action_id: &str,
    ) -> Result<Option<Operation>, LedgerError> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {OPERATION_COLUMNS} FROM operations WHERE tenant = $1 AND action_id = $2"
        )))
        .bind(tenant)
        .bind(action_id)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// The rows of these keys that exist, in one read-only statement (the intake's lookup
    /// for messages that must not be admitted but may name a key that has a row).
    pub async fn find_keys(
        &self,
        keys: &[(String, String)],
    ) -> Result<Vec<Operation>, LedgerError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let (tenants, action_ids): (Vec<&str>, Vec<&str>) =
            keys.iter().map(|(t, a)| (t.as_str(), a.as_str())).unzip();
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {cols} FROM operations o
             JOIN unnest($1::text[], $2::text[]) AS k(tenant, action_id) USING (tenant, action_id)",
            cols = super::admit::o_columns()
        )))
        .bind(&tenants)
        .bind(&action_ids)
        .fetch_all(&self.pool)
        .await?)
    }

    /// The operations of `tool` the downstream accepted as its operation `remote_id` (a
    /// completion callback names it so): one, or none; two (at most two are read) when the
    /// downstream named one operation for two writes.
    pub async fn find_remote(
        &self,
        tool: &str,
        remote_id: &str,
    ) -> Result<Vec<Operation>, LedgerError> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {OPERATION_COLUMNS} FROM operations
             WHERE tool = $1 AND remote_id = $2 AND remote_id IS NOT NULL LIMIT 2"
        )))
        .bind(tool)
        .bind(remote_id)
        .fetch_all(&self.pool)
        .await?)
    }

    pub async fn get(&self, id: i64) -> Result<Option<Operation>, LedgerError> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {OPERATION_COLUMNS} FROM operations WHERE id = $1"
        )))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?)
    }

    pub async fn history(&self, operation_id: i64) -> Result<Vec<HistoryEntry>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT at, from_state, to_state, fence, actor, evidence, attempts, next_attempt_at
             FROM operation_history WHERE operation_id = $1 ORDER BY id",
        )
        .bind(operation_id)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Operations per state.
    pub async fn count_by_state(&self) -> Result<Vec<(String, i64)>, LedgerError> {
        Ok(
            sqlx::query_as("SELECT state, count(*) FROM operations GROUP BY state")
                .fetch_all(&self.pool)
                .await?,
        )
    }

    /// Per tool and unresolved state: how many and how long ago the oldest was recorded. Only
    /// rows in the partial index `operations_unresolved` are read, so this stays cheap however
    /// many finished rows the table holds. A `dispatching` row counts only once its lease has
    /// expired (stuck), since a live dispatch is not unresolved work.
    pub async fn unresolved_ages(&self) -> Result<Vec<UnresolvedAge>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT tool, state, count(*) AS count,
                    extract(epoch FROM now() - min(created_at))::float8 AS oldest_age_secs
             FROM operations
             WHERE state IN ('retry_wait', 'unknown', 'held', 'accepted', 'awaiting_approval')
                OR (state = 'dispatching' AND lease_until < now())
             GROUP BY tool, state",
        )
        .fetch_all(&self.pool)
        .await?)
    }
}

/// Which operations the operator console lists, groups, counts or hands to a bulk job: any
/// state, by tenant, tool, cause ([`super::cause`]), age, created and updated time, and text in
/// the action id or the evidence. Every field narrows; none set lists everything in `states`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OperationSearch {
    /// States to include (their names); empty matches nothing.
    pub states: Vec<String>,
    pub tenant: Option<String>,
    pub tool: Option<String>,
    /// A cause class ([`super::cause::classify`]).
    pub cause: Option<String>,
    /// Only rows recorded at least this many seconds ago.
    pub min_age_secs: Option<f64>,
    /// Only rows recorded at most this many seconds ago.
    pub max_age_secs: Option<f64>,
    pub created_after: Option<DateTime<Utc>>,
    pub created_before: Option<DateTime<Utc>>,
    pub updated_after: Option<DateTime<Utc>>,
    pub updated_before: Option<DateTime<Utc>>,
    /// Case-insensitive text the action id or the evidence contains.
    pub text: Option<String>,
}

/// One page of a search: rows after `after` in id order (descending: before it), at most
/// `limit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Page {
    pub after: Option<i64>,
    pub descending: bool,
    pub limit: i64,
}

kit::pg_row! {
    /// One group of a search grouped by cause: its class, tool and size.
    #[derive(Debug, Clone, serde::Serialize)]
    pub struct CauseGroup {
        pub cause: String,
        pub tool: String,
        pub count: i64,
        pub oldest: DateTime<Utc>,
    }
}

kit::pg_row! {
    /// Operations of one state and tool, for the overview.
    #[derive(Debug, Clone, serde::Serialize)]
    pub struct StateCount {
        pub state: String,
        pub tool: String,
        pub count: i64,
        /// How many of them are unresolved work: every row of an unresolved state except a
        /// `dispatching` row whose lease is still live (the same rule as the unresolved gauges).
        pub unresolved: i64,
        /// Age since recording of the oldest unresolved one.
        pub oldest_unresolved_secs: Option<f64>,
        /// Unresolved ones recorded longer ago than the threshold asked for.
        pub past_threshold: i64,
    }
}

/// Most rows a grouping reads (the newest that match): grouping every finished row of a large
/// ledger would read it all.
pub const MAX_GROUPED_ROWS: i64 = 100_000;

/// The search's predicate over `operations`: $1 states … $11 text pattern.
fn search_predicate(unresolved_only: bool) -> String {
    // The literal list lets the planner use the partial index of unresolved rows.
    let unresolved = if unresolved_only {
        "state IN ('dispatching', 'retry_wait', 'unknown', 'held', 'accepted', \
         'awaiting_approval') AND "
    } else {
        ""
    };
    format!(
        "{unresolved}state = ANY($1)
           AND ($2::text IS NULL OR tenant = $2)
           AND ($3::text IS NULL OR tool = $3)
           AND ($4::text IS NULL OR {cause} = $4)
           AND ($5::float8 IS NULL OR created_at <= now() - make_interval(secs => $5))
           AND ($6::float8 IS NULL OR created_at >= now() - make_interval(secs => $6))
           AND ($7::timestamptz IS NULL OR created_at >= $7)
           AND ($8::timestamptz IS NULL OR created_at < $8)
           AND ($9::timestamptz IS NULL OR updated_at >= $9)
           AND ($10::timestamptz IS NULL OR updated_at < $10)
           AND ($11::text IS NULL OR action_id ILIKE $11 OR evidence ILIKE $11)",
        cause = super::cause::sql()
    )
}

/// `%text%` for ILIKE, with the pattern characters of `text` taken literally.
pub fn contains_pattern(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('%');
    for c in text.chars() {
        if matches!(c, '%' | '_' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('%');
    out
}

impl OperationSearch {
    /// True when every state searched is unresolved (the partial index holds them all).
    fn unresolved_only(&self) -> bool {
        self.states.iter().all(|s| {
            super::State::parse(s).is_some_and(|st| super::State::UNRESOLVED.contains(&st))
        })
    }

    pub(super) fn predicate(&self) -> String {
        search_predicate(self.unresolved_only())
    }
}

/// Binds an [`OperationSearch`] as $1 … $11 of [`search_predicate`].
macro_rules! bind_search {
    ($query:expr, $s:expr) => {
        $query
            .bind(&$s.states)
            .bind($s.tenant.as_deref())
            .bind($s.tool.as_deref())
            .bind($s.cause.as_deref())
            .bind($s.min_age_secs)
            .bind($s.max_age_secs)
            .bind($s.created_after)
            .bind($s.created_before)
            .bind($s.updated_after)
            .bind($s.updated_before)
            .bind(
                $s.text
                    .as_deref()
                    .map($crate::ledger::queries::contains_pattern),
            )
    };
}
pub(crate) use bind_search;

impl Ledger {
    /// One page of the operations `search` matches, in id order (read-only).
    pub async fn search(
        &self,
        search: &OperationSearch,
        page: Page,
    ) -> Result<Vec<Operation>, LedgerError> {
        let (cmp, order) = if page.descending {
            ("<", "DESC")
        } else {
            (">", "ASC")
        };
        let sql = format!(
            "SELECT {OPERATION_COLUMNS} FROM operations
             WHERE {} AND ($12::bigint IS NULL OR id {cmp} $12)
             ORDER BY id {order} LIMIT $13",
            search.predicate()
        );
        let query = sqlx::query_as(sqlx::AssertSqlSafe(sql));
        Ok(bind_search!(query, search)
            .bind(page.after)
            .bind(page.limit)
            .fetch_all(&self.pool)
            .await?)
    }

    /// The operations `search` matches grouped by cause class and tool, largest group first;
    /// at most the newest [`MAX_GROUPED_ROWS`] matching rows are read.
    pub async fn search_groups(
        &self,
        search: &OperationSearch,
    ) -> Result<Vec<CauseGroup>, LedgerError> {
        let sql = format!(
            "SELECT {cause} AS cause, tool, count(*) AS count, min(created_at) AS oldest
             FROM (SELECT state, evidence, tool, created_at FROM operations
                   WHERE {predicate} ORDER BY id DESC LIMIT $12) AS matched
             GROUP BY 1, 2 ORDER BY count DESC, cause, tool",
            cause = super::cause::sql(),
            predicate = search.predicate()
        );
        let query = sqlx::query_as(sqlx::AssertSqlSafe(sql));
        Ok(bind_search!(query, search)
            .bind(MAX_GROUPED_ROWS)
            .fetch_all(&self.pool)
            .await?)
    }

    /// How many operations `search` matches, per state, counting at most `bound` rows (a dry
    /// run of a bulk action).
    pub async fn search_count(
        &self,
        search: &OperationSearch,
        bound: i64,
    ) -> Result<Vec<(String, i64)>, LedgerError> {
        let sql = format!(
            "SELECT state, count(*) FROM (SELECT state FROM operations WHERE {}
                                          ORDER BY id LIMIT $12) AS matched
             GROUP BY state ORDER BY state",
            search.predicate()
        );
        let query = sqlx::query_as(sqlx::AssertSqlSafe(sql));
        Ok(bind_search!(query, search)
            .bind(bound)
            .fetch_all(&self.pool)
            .await?)
    }

    /// The cause class of each sample row, as the database computes it ([`super::cause::sql`]);
    /// for the test that keeps it equal to [`super::cause::classify`].
    pub async fn classify_in_sql(
        &self,
        rows: &[(String, Option<String>)],
    ) -> Result<Vec<String>, LedgerError> {
        let (states, evidence): (Vec<String>, Vec<Option<String>>) = rows.iter().cloned().unzip();
        let sql = format!(
            "SELECT {} FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS s(state, evidence, n)
             ORDER BY n",
            super::cause::sql()
        );
        Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(&states)
            .bind(&evidence)
            .fetch_all(&self.pool)
            .await?)
    }

    /// Operations per state and tool (of one tenant, or all), with the unresolved ones' age and
    /// how many are older than `threshold_secs`: the console's overview.
    pub async fn state_counts(
        &self,
        tenant: Option<&str>,
        threshold_secs: f64,
    ) -> Result<Vec<StateCount>, LedgerError> {
        Ok(sqlx::query_as(
            "WITH rows AS (
                 SELECT state, tool, created_at,
                        state IN ('retry_wait', 'unknown', 'held', 'accepted', 'awaiting_approval')
                        OR (state = 'dispatching' AND lease_until < now()) AS open
                 FROM operations WHERE $1::text IS NULL OR tenant = $1)
             SELECT state, tool, count(*) AS count,
                    count(*) FILTER (WHERE open) AS unresolved,
                    extract(epoch FROM now() - min(created_at) FILTER (WHERE open))::float8
                        AS oldest_unresolved_secs,
                    count(*) FILTER (WHERE open AND created_at <= now() - make_interval(secs => $2))
                        AS past_threshold
             FROM rows GROUP BY state, tool ORDER BY state, tool",
        )
        .bind(tenant)
        .bind(threshold_secs)
        .fetch_all(&self.pool)
        .await?)
    }
}
