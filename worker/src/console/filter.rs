//! The operations page's filter: read from the query string (so every view has a URL to share),
//! checked, turned into a ledger search ([`OperationSearch`]) and written back into links
//! (pagination, groups, bulk actions).
//!
//! Fields: `scope` (`unresolved`, the default; `finished`; `all`), `state` (names, commas),
//! `tenant`, `tool`, `cause` (a class of [`crate::ledger::cause`]), `min_age` / `max_age` (since
//! recording: seconds, or with `s`, `m`, `h`, `d`), `created_after` / `created_before` /
//! `updated_after` / `updated_before` (RFC 3339, or `YYYY-MM-DDTHH:MM[:SS]` in UTC, as a
//! browser's date-time field sends it), `q` (text in the action id or the evidence), `view`
//! (`list` or `groups`), `after` (the page cursor) and `limit` (1 to 200).

use std::collections::BTreeMap;

use chrono::{DateTime, NaiveDateTime, Utc};

use crate::ledger::queries::OperationSearch;
use crate::ledger::State;

/// Default page size.
pub const DEFAULT_LIMIT: i64 = 50;
/// Largest page size.
pub const MAX_LIMIT: i64 = 200;
/// Longest text filter, in characters.
const MAX_TEXT: usize = 200;

/// Which rows a listing starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scope {
    #[default]
    Unresolved,
    Finished,
    All,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Unresolved => "unresolved",
            Scope::Finished => "finished",
            Scope::All => "all",
        }
    }

    fn states(self) -> Vec<State> {
        match self {
            Scope::Unresolved => State::UNRESOLVED.to_vec(),
            Scope::Finished => vec![State::Succeeded, State::Failed],
            Scope::All => State::ALL.to_vec(),
        }
    }
}

/// The filter as given (each field as typed, for the form) and as understood.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsoleFilter {
    pub scope: Scope,
    pub states: Vec<State>,
    pub tenant: Option<String>,
    pub tool: Option<String>,
    pub cause: Option<String>,
    pub min_age: Option<String>,
    pub max_age: Option<String>,
    pub created_after: Option<String>,
    pub created_before: Option<String>,
    pub updated_after: Option<String>,
    pub updated_before: Option<String>,
    pub text: Option<String>,
    /// Show groups by cause instead of rows.
    pub groups: bool,
    pub after: Option<i64>,
    pub limit: i64,
    /// The parsed values of the fields above.
    parsed: Parsed,
}

impl Default for ConsoleFilter {
    /// Every unresolved operation, the default page size.
    fn default() -> ConsoleFilter {
        ConsoleFilter {
            scope: Scope::Unresolved,
            states: Vec::new(),
            tenant: None,
            tool: None,
            cause: None,
            min_age: None,
            max_age: None,
            created_after: None,
            created_before: None,
            updated_after: None,
            updated_before: None,
            text: None,
            groups: false,
            after: None,
            limit: DEFAULT_LIMIT,
            parsed: Parsed::default(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
struct Parsed {
    min_age_secs: Option<f64>,
    max_age_secs: Option<f64>,
    created_after: Option<DateTime<Utc>>,
    created_before: Option<DateTime<Utc>>,
    updated_after: Option<DateTime<Utc>>,
    updated_before: Option<DateTime<Utc>>,
}

/// A duration as typed: `900`, `90s`, `15m`, `2h`, `7d`.
pub fn parse_age(raw: &str) -> Result<f64, String> {
    let raw = raw.trim();
    let (number, unit) = match raw.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&raw[..i], c.to_ascii_lowercase()),
        _ => (raw, 's'),
    };
    let n: u64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{raw:?} is not an age (e.g. 900, 15m, 2h, 7d)"))?;
    let factor = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3_600,
        'd' => 86_400,
        _ => return Err(format!("{raw:?}: the unit must be s, m, h or d")),
    };
    let secs = n
        .checked_mul(factor)
        .filter(|s| *s <= crate::ops::actions::MAX_OLDER_THAN_SECS)
        .ok_or_else(|| format!("{raw:?} is longer than 100 years"))?;
    Ok(secs as f64)
}

/// A time as typed: RFC 3339, or a browser's `YYYY-MM-DDTHH:MM[:SS]` read as UTC.
pub fn parse_time(raw: &str) -> Result<DateTime<Utc>, String> {
    let raw = raw.trim();
    if let Ok(t) = DateTime::parse_from_rfc3339(raw) {
        return Ok(t.with_timezone(&Utc));
    }
    for format in [
        "%Y-%m-%dT%H:%M:%S",
        "%Y-%m-%dT%H:%M",
        "%Y-%m-%d %H:%M:%S",
        "%Y-%m-%d %H:%M",
    ] {
        if let Ok(t) = NaiveDateTime::parse_from_str(raw, format) {
            return Ok(t.and_utc());
        }
    }
    if let Ok(d) = chrono::NaiveDate::parse_from_str(raw, "%Y-%m-%d") {
        return Ok(d.and_hms_opt(0, 0, 0).expect("midnight").and_utc());
    }
    Err(format!(
        "{raw:?} is not a time (RFC 3339, or YYYY-MM-DDTHH:MM in UTC)"
    ))
}

/// A query-string value with its surrounding blanks removed; blank counts as absent.
fn field(query: &BTreeMap<String, String>, name: &str) -> Option<String> {
    query
        .get(name)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// A name-like value (tenant, tool): no control characters, at most 200 characters.
fn name_field(query: &BTreeMap<String, String>, name: &str) -> Result<Option<String>, String> {
    match field(query, name) {
        Some(v) if v.chars().count() > MAX_TEXT || v.chars().any(char::is_control) => Err(format!(
            "{name} must be at most {MAX_TEXT} characters without control characters"
        )),
        v => Ok(v),
    }
}

/// A field read with `read` (an age, a time): as typed and as understood, an error naming it.
fn typed_field<T>(
    query: &BTreeMap<String, String>,
    name: &str,
    read: impl Fn(&str) -> Result<T, String>,
) -> Result<(Option<String>, Option<T>), String> {
    match field(query, name) {
        Some(raw) => {
            let value = read(&raw).map_err(|e| format!("{name}: {e}"))?;
            Ok((Some(raw), Some(value)))
        }
        None => Ok((None, None)),
    }
}

/// `scope`: `unresolved` (the default), `finished` or `all`.
fn scope_field(query: &BTreeMap<String, String>) -> Result<Scope, String> {
    match field(query, "scope").as_deref() {
        None | Some("unresolved") => Ok(Scope::Unresolved),
        Some("finished") => Ok(Scope::Finished),
        Some("all") => Ok(Scope::All),
        Some(other) => Err(format!(
            "scope {other:?}: expected unresolved, finished or all"
        )),
    }
}

/// `state`: state names, comma-separated; blanks and repeats ignored, the order kept.
fn states_field(query: &BTreeMap<String, String>) -> Result<Vec<State>, String> {
    let mut states = Vec::new();
    for part in field(query, "state").iter().flat_map(|s| s.split(',')) {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        let state = State::parse(part).ok_or_else(|| {
            format!("state {part:?}: expected one of prepared, dispatching, retry_wait, unknown, held, accepted, awaiting_approval, succeeded, failed")
        })?;
        if !states.contains(&state) {
            states.push(state);
        }
    }
    Ok(states)
}

/// `cause`: a cause class of [`crate::ledger::cause`].
fn cause_field(query: &BTreeMap<String, String>) -> Result<Option<String>, String> {
    let cause = name_field(query, "cause")?;
    if let Some(c) = cause.as_deref() {
        if !crate::ledger::cause::is_known(c) {
            return Err(format!(
                "cause {c:?} is not a cause class (e.g. http_503, timeout, connection)"
            ));
        }
    }
    Ok(cause)
}

/// `q`: at most [`MAX_TEXT`] characters, no NUL.
fn text_field(query: &BTreeMap<String, String>) -> Result<Option<String>, String> {
    let text = field(query, "q");
    if text
        .as_ref()
        .is_some_and(|t| t.chars().count() > MAX_TEXT || t.contains('\0'))
    {
        return Err(format!("q must be at most {MAX_TEXT} characters"));
    }
    Ok(text)
}

/// `view`: `list` (the default) or `groups` (true).
fn groups_field(query: &BTreeMap<String, String>) -> Result<bool, String> {
    match field(query, "view").as_deref() {
        None | Some("list") => Ok(false),
        Some("groups") => Ok(true),
        Some(other) => Err(format!("view {other:?}: expected list or groups")),
    }
}

/// `after`: the page cursor, an operation id.
fn after_field(query: &BTreeMap<String, String>) -> Result<Option<i64>, String> {
    match field(query, "after") {
        Some(a) => Ok(Some(
            a.parse::<i64>()
                .ok()
                .filter(|a| *a >= 0)
                .ok_or("after must be an operation id")?,
        )),
        None => Ok(None),
    }
}

/// `limit`: 1 to [`MAX_LIMIT`], default [`DEFAULT_LIMIT`].
fn limit_field(query: &BTreeMap<String, String>) -> Result<i64, String> {
    match field(query, "limit") {
        Some(l) => l
            .parse::<i64>()
            .ok()
            .filter(|l| (1..=MAX_LIMIT).contains(l))
            .ok_or_else(|| format!("limit must be between 1 and {MAX_LIMIT}")),
        None => Ok(DEFAULT_LIMIT),
    }
}

impl ConsoleFilter {
    /// Reads and checks the query string. The message names the first field that is wrong, in
    /// this order: scope, state, cause, q, min_age, max_age, created_after, created_before,
    /// updated_after, updated_before, view, after, limit, tenant, tool.
    pub fn parse(query: &BTreeMap<String, String>) -> Result<ConsoleFilter, String> {
        let scope = scope_field(query)?;
        let states = states_field(query)?;
        let cause = cause_field(query)?;
        let text = text_field(query)?;
        let (min_age, min_age_secs) = typed_field(query, "min_age", parse_age)?;
        let (max_age, max_age_secs) = typed_field(query, "max_age", parse_age)?;
        let (created_after, created_after_t) = typed_field(query, "created_after", parse_time)?;
        let (created_before, created_before_t) = typed_field(query, "created_before", parse_time)?;
        let (updated_after, updated_after_t) = typed_field(query, "updated_after", parse_time)?;
        let (updated_before, updated_before_t) = typed_field(query, "updated_before", parse_time)?;
        let groups = groups_field(query)?;
        let after = after_field(query)?;
        let limit = limit_field(query)?;
        Ok(ConsoleFilter {
            scope,
            states,
            tenant: name_field(query, "tenant")?,
            tool: name_field(query, "tool")?,
            cause,
            min_age,
            max_age,
            created_after,
            created_before,
            updated_after,
            updated_before,
            text,
            groups,
            after,
            limit,
            parsed: Parsed {
                min_age_secs,
                max_age_secs,
                created_after: created_after_t,
                created_before: created_before_t,
                updated_after: updated_after_t,
                updated_before: updated_before_t,
            },
        })
    }

    /// The states searched: those asked for within the scope (none asked: the scope's).
    pub fn states(&self) -> Vec<State> {
        let scope = self.scope.states();
        if self.states.is_empty() {
            scope
        } else {
            self.states
                .iter()
                .copied()
                .filter(|s| scope.contains(s))
                .collect()
        }
    }

    /// The ledger search; a tenant session's own tenant replaces any tenant asked for.
    pub fn search(&self, tenant_only: Option<&str>) -> OperationSearch {
        OperationSearch {
            states: self
                .states()
                .iter()
                .map(|s| s.as_str().to_string())
                .collect(),
            tenant: tenant_only.map(str::to_string).or(self.tenant.clone()),
            tool: self.tool.clone(),
            cause: self.cause.clone(),
            min_age_secs: self.parsed.min_age_secs,
            max_age_secs: self.parsed.max_age_secs,
            created_after: self.parsed.created_after,
            created_before: self.parsed.created_before,
            updated_after: self.parsed.updated_after,
            updated_before: self.parsed.updated_before,
            text: self.text.clone(),
        }
    }

    /// The filter's fields as query pairs (no cursor, no view), in a fixed order.
    pub fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if self.scope != Scope::Unresolved {
            out.push(("scope", self.scope.as_str().to_string()));
        }
        if !self.states.is_empty() {
            let names: Vec<&str> = self.states.iter().map(|s| s.as_str()).collect();
            out.push(("state", names.join(",")));
        }
        let optional = [
            ("tenant", &self.tenant),
            ("tool", &self.tool),
            ("cause", &self.cause),
            ("min_age", &self.min_age),
            ("max_age", &self.max_age),
            ("created_after", &self.created_after),
            ("created_before", &self.created_before),
            ("updated_after", &self.updated_after),
            ("updated_before", &self.updated_before),
            ("q", &self.text),
        ];
        for (name, value) in optional {
            if let Some(v) = value {
                out.push((name, v.clone()));
            }
        }
        if self.limit != DEFAULT_LIMIT {
            out.push(("limit", self.limit.to_string()));
        }
        out
    }

    /// The filter as a query string, with `extra` pairs after it.
    pub fn query(&self, extra: &[(&str, String)]) -> String {
        let mut pairs: Vec<(&str, String)> = self.pairs();
        pairs.extend(extra.iter().cloned());
        query_string(&pairs)
    }

    /// This filter with other values (for links to a group, a state, a tool).
    pub fn with(&self, name: &str, value: &str) -> ConsoleFilter {
        let mut f = self.clone();
        match name {
            "cause" => f.cause = Some(value.to_string()),
            "tool" => f.tool = Some(value.to_string()),
            "tenant" => f.tenant = Some(value.to_string()),
            "state" => f.states = State::parse(value).into_iter().collect(),
            _ => {}
        }
        f.after = None;
        f
    }
}

/// Every field a filter reads from a URL ([`ConsoleFilter::parse`]).
pub const FIELDS: &[&str] = &[
    "scope",
    "state",
    "tenant",
    "tool",
    "cause",
    "min_age",
    "max_age",
    "created_after",
    "created_before",
    "updated_after",
    "updated_before",
    "q",
    "view",
    "after",
    "limit",
];

/// The first field of `query` that no filter has. [`ConsoleFilter::parse`] ignores such a
/// field, which for a page only shows more rows; a bulk job refuses it, since a field lost on
/// the way (misspelt, or mangled by a client) would widen what the job acts on.
pub fn unknown_field(query: &BTreeMap<String, String>) -> Option<&str> {
    query
        .keys()
        .map(String::as_str)
        .find(|k| !FIELDS.contains(k))
}

/// `a=1&b=x%20y`: each value percent-encoded (everything but unreserved characters).
pub fn query_string(pairs: &[(&str, String)]) -> String {
    pairs
        .iter()
        .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_default_is_every_unresolved_row_a_page_at_a_time() {
        let f = ConsoleFilter::parse(&BTreeMap::new()).unwrap();
        assert_eq!(f, ConsoleFilter::default());
        assert_eq!(f.scope, Scope::Unresolved);
        assert_eq!(f.states(), State::UNRESOLVED.to_vec());
        assert_eq!(f.limit, DEFAULT_LIMIT);
        assert!(!f.groups && f.pairs().is_empty());
        let s = f.search(None);
        assert_eq!(
            s.states,
            [
                "dispatching",
                "retry_wait",
                "unknown",
                "held",
                "accepted",
                "awaiting_approval"
            ]
        );
        assert_eq!(s.tenant, None);
    }

    #[test]
    fn every_field_is_read_checked_and_written_back() {
        let f = ConsoleFilter::parse(&q(&[
            ("scope", "all"),
            ("state", "held, failed,held"),
            ("tenant", "north"),
            ("tool", "refund"),
            ("cause", "http_503"),
            ("min_age", "15m"),
            ("max_age", "2d"),
            ("created_after", "2026-01-02T03:04"),
            ("updated_before", "2026-01-02T03:04:05Z"),
            ("q", "50%_off"),
            ("view", "groups"),
            ("after", "42"),
            ("limit", "10"),
        ]))
        .unwrap();
        assert_eq!(f.states(), vec![State::Held, State::Failed]);
        let s = f.search(None);
        assert_eq!(s.min_age_secs, Some(900.0));
        assert_eq!(s.max_age_secs, Some(172_800.0));
        assert_eq!(
            s.created_after.unwrap().to_rfc3339(),
            "2026-01-02T03:04:00+00:00"
        );
        assert_eq!(s.text.as_deref(), Some("50%_off"));
        assert!(f.groups);
        assert_eq!(f.after, Some(42));
        let query = f.query(&[]);
        assert!(
            query.contains("q=50%25_off") && query.contains("state=held%2Cfailed"),
            "{query}"
        );
        // Written back and read again, the same filter (the cursor and the view aside).
        let again: BTreeMap<String, String> = f
            .pairs()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let g = ConsoleFilter::parse(&again).unwrap();
        assert_eq!(g.search(None), f.search(None));
    }

    #[test]
    fn a_tenant_session_searches_its_own_tenant_only() {
        let f = ConsoleFilter::parse(&q(&[("tenant", "south")])).unwrap();
        assert_eq!(f.search(Some("north")).tenant.as_deref(), Some("north"));
    }

    #[test]
    fn accepted_is_an_unresolved_state_to_filter_by() {
        let f = ConsoleFilter::parse(&q(&[("state", "accepted")])).unwrap();
        assert_eq!(f.states(), vec![State::Accepted]);
        assert_eq!(f.search(None).states, ["accepted"]);
        assert_eq!(f.query(&[]), "state=accepted");
        let f = ConsoleFilter::parse(&q(&[("state", "accepted"), ("scope", "finished")])).unwrap();
        assert!(f.states().is_empty(), "accepted is not finished");
        let err = ConsoleFilter::parse(&q(&[("state", "polling")])).unwrap_err();
        assert!(
            err.contains("held, accepted, awaiting_approval, succeeded"),
            "{err}"
        );
    }

    #[test]
    fn asked_states_outside_the_scope_match_nothing() {
        let f = ConsoleFilter::parse(&q(&[("state", "succeeded")])).unwrap();
        assert!(f.states().is_empty());
        let f = ConsoleFilter::parse(&q(&[("state", "succeeded"), ("scope", "finished")])).unwrap();
        assert_eq!(f.states(), vec![State::Succeeded]);
    }

    #[test]
    fn bad_values_name_their_field() {
        for (k, v) in [
            ("scope", "everything"),
            ("state", "lost"),
            ("cause", "gremlins"),
            ("min_age", "soon"),
            ("max_age", "5y"),
            ("created_after", "yesterday"),
            ("view", "table"),
            ("after", "-1"),
            ("limit", "0"),
            ("limit", "201"),
            ("tenant", "a\u{1b}b"),
        ] {
            let err = ConsoleFilter::parse(&q(&[(k, v)])).unwrap_err();
            assert!(err.contains(k), "{k}={v}: {err}");
        }
        assert!(ConsoleFilter::parse(&q(&[("q", &"x".repeat(201))])).is_err());
        assert!(ConsoleFilter::parse(&q(&[("min_age", "99999999999999d")])).is_err());
    }

    #[test]
    fn of_two_bad_fields_the_first_in_the_documented_order_is_named() {
        let order = [
            ("scope", "everything"),
            ("state", "lost"),
            ("cause", "gremlins"),
            ("q", "a\0b"),
            ("min_age", "soon"),
            ("max_age", "5y"),
            ("created_after", "yesterday"),
            ("created_before", "tomorrow"),
            ("updated_after", "then"),
            ("updated_before", "now"),
            ("view", "table"),
            ("after", "-1"),
            ("limit", "0"),
            ("tenant", "a\u{1b}b"),
            ("tool", "a\u{7}b"),
        ];
        for (i, first) in order.iter().enumerate() {
            for later in &order[i + 1..] {
                let err = ConsoleFilter::parse(&q(&[*later, *first])).unwrap_err();
                assert!(
                    err.starts_with(first.0),
                    "{first:?} before {later:?}: {err}"
                );
            }
        }
    }

    #[test]
    fn ages_and_times_accept_what_people_type() {
        assert_eq!(parse_age("900").unwrap(), 900.0);
        assert_eq!(parse_age(" 2H ").unwrap(), 7_200.0);
        assert_eq!(parse_age("1d").unwrap(), 86_400.0);
        assert!(parse_age("-5").is_err() && parse_age("m").is_err());
        assert_eq!(
            parse_time("2026-03-01").unwrap().to_rfc3339(),
            "2026-03-01T00:00:00+00:00"
        );
        assert_eq!(
            parse_time("2026-03-01T10:00:00+02:00")
                .unwrap()
                .to_rfc3339(),
            "2026-03-01T08:00:00+00:00"
        );
    }

    #[test]
    fn a_field_no_filter_has_is_named() {
        let f = ConsoleFilter::parse(&q(&[("state", "held"), ("tenant", "north")])).unwrap();
        let written: BTreeMap<String, String> = f
            .pairs()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        assert_eq!(unknown_field(&written), None);
        // `&amp;` left unread by a client: the tenant is lost, and named.
        let mangled = q(&[("state", "held"), ("amp;tenant", "north")]);
        assert_eq!(unknown_field(&mangled), Some("amp;tenant"));
    }

    #[test]
    fn encoding_leaves_only_unreserved_characters() {
        assert_eq!(encode("a b&c=<d>/é"), "a%20b%26c%3D%3Cd%3E%2F%C3%A9");
        assert_eq!(
            query_string(&[("q", "x y".into()), ("tool", "refund".into())]),
            "q=x%20y&tool=refund"
        );
    }
}
