//! Why an operation is where it is, as a short class the operator console groups and filters
//! by: the HTTP status a downstream answered (`http_503`), or an outcome class (`timeout`,
//! `connection`, `receipt_mismatch`, `lookup_miss`, `not_configured`, ...), derived from the
//! stored state and evidence.
//!
//! The rules are one ordered table ([`RULES`]) read two ways: [`classify`] in Rust (for a row
//! already read) and [`sql`] (a `CASE` expression, so the ledger can group and filter by cause
//! without reading every row). Both apply the same markers in the same order with the same
//! matching (case-sensitive substring or prefix; the first `HTTP ` followed by three digits),
//! and a test compares them on the database. The markers are the texts the adapter, the
//! dispatcher, the recovery scheduler and the operator actions write as evidence; a new
//! evidence text that fits no rule is `other` until a rule is added here.

/// How a rule's markers are matched against the evidence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Match {
    /// The evidence starts with one of the markers.
    Prefix,
    /// The evidence contains one of the markers.
    Contains,
}

/// One rule: the class it gives, and the markers that select it.
#[derive(Debug)]
pub struct Rule {
    pub class: &'static str,
    matching: Match,
    markers: &'static [&'static str],
    /// What the class means, for the console.
    pub meaning: &'static str,
}

/// The class of a finished success (its evidence only names the receipt).
pub const SUCCEEDED: &str = "succeeded";
/// The class of a row without evidence (a first dispatch still in flight).
pub const NONE: &str = "none";
/// The class when no rule matched.
pub const OTHER: &str = "other";
/// The prefix of the HTTP status classes (`http_503`).
pub const HTTP_PREFIX: &str = "http_";

/// The evidence rules, in the order they are tried; the HTTP status rule comes after them and
/// before [`LATE_RULES`].
pub const RULES: &[Rule] = &[
    Rule {
        class: "operator",
        matching: Match::Prefix,
        markers: &["resolve by ", "fail by ", "recheck by "],
        meaning: "an operator's action wrote the last evidence",
    },
    Rule {
        class: "async_deadline",
        matching: Match::Prefix,
        markers: &["async_deadline"],
        meaning: "an accepted long-running operation was not done by its poll deadline",
    },
    Rule {
        class: "async_conflict",
        matching: Match::Contains,
        markers: &["but it was accepted as operation"],
        meaning: "the downstream named another operation than the one it accepted before",
    },
    Rule {
        class: "in_progress",
        matching: Match::Prefix,
        markers: &["accepted as operation", "still running"],
        meaning: "the downstream accepted the write and the operation is still running",
    },
    Rule {
        class: "not_configured",
        matching: Match::Contains,
        markers: &["is not configured"],
        meaning: "the tool is not in this worker's tools file",
    },
    Rule {
        class: "retention",
        matching: Match::Contains,
        markers: &["removed by retention"],
        meaning: "the arguments were removed by retention",
    },
    Rule {
        class: "local_resources",
        matching: Match::Contains,
        markers: &["out of local resources"],
        meaning: "the worker ran out of open files, ports or memory (not sent)",
    },
    Rule {
        class: "no_recovery",
        matching: Match::Contains,
        markers: &["offers no replay or lookup"],
        meaning: "the tool declares no recovery (recovery = \"none\")",
    },
    Rule {
        class: "replay_window",
        matching: Match::Contains,
        markers: &[
            "replay window closed",
            "replay protection cannot be established",
        ],
        meaning: "the replay window is closed or unknown",
    },
    Rule {
        class: "lookup_miss",
        matching: Match::Contains,
        markers: &["lookup miss"],
        meaning: "the downstream's lookup did not find the key (not proof of absence)",
    },
    Rule {
        class: "receipt_mismatch",
        matching: Match::Contains,
        markers: &[
            "but receipt",
            "is for another operation",
            "receipt has no id",
        ],
        meaning: "an answer carried a receipt that failed the tool's receipt check",
    },
];

/// Tried after the HTTP status rule.
pub const LATE_RULES: &[Rule] = &[
    Rule {
        class: "timeout",
        matching: Match::Contains,
        markers: &["timed out"],
        meaning: "the request timed out after it may have been written",
    },
    Rule {
        class: "connection",
        matching: Match::Contains,
        markers: &[
            "not sent:",
            "connection failed",
            "lookup failed",
            "connection refused",
        ],
        meaning: "the connection failed (before sending: not applied; after: unknown)",
    },
    Rule {
        class: "recovery_exhausted",
        matching: Match::Contains,
        markers: &["recovery attempts exhausted"],
        meaning: "recovery rounds ran out without a matching receipt",
    },
];

impl Rule {
    fn matches(&self, evidence: &str) -> bool {
        match self.matching {
            Match::Prefix => self.markers.iter().any(|m| evidence.starts_with(m)),
            Match::Contains => self.markers.iter().any(|m| evidence.contains(m)),
        }
    }

    fn sql(&self) -> String {
        let tests: Vec<String> = self
            .markers
            .iter()
            .map(|m| match self.matching {
                Match::Prefix => format!("starts_with(evidence, {})", literal(m)),
                Match::Contains => format!("strpos(evidence, {}) > 0", literal(m)),
            })
            .collect();
        format!("WHEN {} THEN '{}'", tests.join(" OR "), self.class)
    }
}

/// A SQL string literal of a marker (markers are constants; quotes are doubled anyway).
fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The first `HTTP ` followed by three ASCII digits: the status, as Postgres's
/// `substring(evidence from 'HTTP ([0-9]{3})')` finds it.
fn http_status(evidence: &str) -> Option<&str> {
    evidence.match_indices("HTTP ").find_map(|(at, _)| {
        let digits = evidence.get(at + 5..at + 8)?;
        digits.bytes().all(|b| b.is_ascii_digit()).then_some(digits)
    })
}

/// The cause class of a row in `state` with `evidence`.
pub fn classify(state: &str, evidence: Option<&str>) -> String {
    if state == "succeeded" {
        return SUCCEEDED.into();
    }
    let Some(evidence) = evidence.filter(|e| !e.is_empty()) else {
        return NONE.into();
    };
    if let Some(rule) = RULES.iter().find(|r| r.matches(evidence)) {
        return rule.class.into();
    }
    if let Some(status) = http_status(evidence) {
        return format!("{HTTP_PREFIX}{status}");
    }
    LATE_RULES
        .iter()
        .find(|r| r.matches(evidence))
        .map_or_else(|| OTHER.into(), |r| r.class.into())
}

/// The same classification as a SQL expression over the columns `state` and `evidence`.
pub fn sql() -> String {
    let early: Vec<String> = RULES.iter().map(Rule::sql).collect();
    let late: Vec<String> = LATE_RULES.iter().map(Rule::sql).collect();
    format!(
        "(CASE WHEN state = 'succeeded' THEN '{SUCCEEDED}' \
         WHEN evidence IS NULL OR evidence = '' THEN '{NONE}' {} \
         WHEN evidence ~ 'HTTP [0-9]{{3}}' THEN '{HTTP_PREFIX}' || substring(evidence from 'HTTP ([0-9]{{3}})') \
         {} ELSE '{OTHER}' END)",
        early.join(" "),
        late.join(" ")
    )
}

/// Whether `class` is one this module can give (a filter naming another matches nothing, and
/// is refused as a typo instead).
pub fn is_known(class: &str) -> bool {
    if let Some(status) = class.strip_prefix(HTTP_PREFIX) {
        return status.len() == 3 && status.bytes().all(|b| b.is_ascii_digit());
    }
    [SUCCEEDED, NONE, OTHER].contains(&class)
        || RULES.iter().chain(LATE_RULES).any(|r| r.class == class)
}

/// What a class means, for the console.
pub fn meaning(class: &str) -> String {
    if let Some(status) = class.strip_prefix(HTTP_PREFIX) {
        return format!("the downstream answered HTTP {status}");
    }
    match class {
        SUCCEEDED => "succeeded with a matching receipt".into(),
        NONE => "no evidence yet (a first dispatch in flight)".into(),
        OTHER => "evidence no rule recognises".into(),
        c => RULES
            .iter()
            .chain(LATE_RULES)
            .find(|r| r.class == c)
            .map_or_else(String::new, |r| r.meaning.into()),
    }
}

/// Evidence texts as the worker writes them, with the class each must get: the corpus the unit
/// test and the database comparison share.
pub const SAMPLES: &[(&str, Option<&str>, &str)] = &[
    ("succeeded", Some("receipt r-1 from write attempt 1"), "succeeded"),
    ("dispatching", None, "none"),
    ("held", Some(""), "none"),
    ("held", Some("resolve by alice: checked the ledger, HTTP 503"), "operator"),
    ("unknown", Some("recheck by bob: downstream fixed"), "operator"),
    ("failed", Some("fail by carol: the refund was never made"), "operator"),
    ("held", Some("tool refund is not configured on this worker; held for a person"), "not_configured"),
    ("held", Some("arguments were removed by retention; recovery needs a person"), "retention"),
    (
        "retry_wait",
        Some("not sent: worker out of local resources (Too many open files) before the write to tool refund could connect"),
        "local_resources",
    ),
    ("held", Some("the downstream offers no replay or lookup; a person must reconcile"), "no_recovery"),
    ("held", Some("replay window closed: protection ends 2026-01-01T00:00:00Z and the safety margin is 60s"), "replay_window"),
    (
        "held",
        Some("recovery attempts exhausted (3) without a matching receipt; last: lookup miss (HTTP 404: not found); a miss is not proof of absence"),
        "lookup_miss",
    ),
    ("unknown", Some("HTTP 200 but receipt r-9 is for another operation: /idempotency_key is \"x\""), "receipt_mismatch"),
    ("unknown", Some("HTTP 200 but receipt has no id at /receipt_id"), "receipt_mismatch"),
    ("unknown", Some("HTTP 503: service unavailable"), "http_503"),
    ("failed", Some("HTTP 422: {\"error\":\"bad amount\"}"), "http_422"),
    ("held", Some("recovery attempts exhausted (3) without a matching receipt; last: HTTP 502: bad gateway"), "http_502"),
    ("unknown", Some("lookup answered HTTP 500: boom"), "http_500"),
    ("retry_wait", Some("3 write attempts, none applied (retry.max_attempts reached); last: HTTP 429"), "http_429"),
    ("unknown", Some("HTTP 5034 x"), "http_503"),
    ("unknown", Some("HTTP 50: short"), "other"),
    ("unknown", Some("timed out after the request may have been written: operation timed out"), "timeout"),
    ("retry_wait", Some("not sent: error sending request: connection refused"), "connection"),
    ("unknown", Some("connection failed after the request may have been written: reset"), "connection"),
    ("unknown", Some("lookup failed: dns error"), "connection"),
    ("held", Some("recovery attempts exhausted without a matching receipt"), "recovery_exhausted"),
    ("held", Some("\u{1b}[31m<script>alert(1)</script>"), "other"),
    ("held", Some("it's 'quoted' % _ \\ text"), "other"),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sample_gets_its_class() {
        for (state, evidence, want) in SAMPLES {
            assert_eq!(classify(state, *evidence), *want, "{state} {evidence:?}");
            assert!(is_known(want), "{want}");
            assert!(!meaning(want).is_empty(), "{want}");
        }
    }

    #[test]
    fn the_http_status_is_the_first_http_followed_by_three_digits() {
        assert_eq!(http_status("HTTP 50 then HTTP 503: x"), Some("503"));
        assert_eq!(http_status("HTTP/1.1 503"), None);
        assert_eq!(http_status("HTTP 4é5"), None);
        assert_eq!(http_status("ends with HTTP 5"), None);
    }

    #[test]
    fn known_classes_are_the_rules_and_three_digit_statuses() {
        for class in [
            "timeout",
            "connection",
            "operator",
            "http_200",
            "other",
            "none",
        ] {
            assert!(is_known(class), "{class}");
        }
        for class in ["http_20", "http_abc", "Timeout", "", "http_2000"] {
            assert!(!is_known(class), "{class}");
        }
    }

    #[test]
    fn the_sql_expression_names_every_rule_in_order() {
        let sql = sql();
        let mut last = 0;
        for rule in RULES {
            let at = sql.find(&format!("THEN '{}'", rule.class)).unwrap();
            assert!(at > last, "{} out of order", rule.class);
            last = at;
        }
        let http = sql.find("HTTP [0-9]{3}").unwrap();
        assert!(http > last);
        for rule in LATE_RULES {
            assert!(sql.find(&format!("THEN '{}'", rule.class)).unwrap() > http);
        }
        assert!(literal("it's").contains("it''s"));
    }
}
