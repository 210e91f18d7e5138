//! A tool's approval rule, as its tools-file entry declares it: whether an intent needs a
//! person's approval before it is dispatched (`approval = "required"` for every intent, or
//! `approval_when = { <JSON pointer> = { <operator> = <value>, ... }, ... }` for the intents whose
//! arguments match), how many distinct people must approve (`approvals`, default 1) and how long
//! an intent waits for them before it fails with `approval_expired` (`approval_ttl_secs`, default
//! 86400). This module owns those keys, their defaults, the start-up refusals and
//! [`Approval::needed_for`], the decision for one intent's arguments. Holding, granting and
//! expiring approvals is not this module's.
//!
//! A rule never fails open: an argument a numeric comparison cannot compare (missing, or not a
//! JSON number) counts as matching, so the intent needs approval.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;

/// Default `approvals`: one person.
const DEFAULT_APPROVALS: i64 = 1;
/// Most `approvals` a tool may ask for.
const MAX_APPROVALS: i64 = 10;
/// Default `approval_ttl_secs`: a day.
const DEFAULT_TTL_SECS: i64 = 86_400;
/// Longest `approval_ttl_secs`: a year.
const MAX_TTL_SECS: i64 = 31_536_000;
/// The operators of an `approval_when` condition, in the order error messages list them.
const OPERATORS: &str = "gt, ge, lt, le, eq, ne, in";
/// The refusal of `approval` and `approval_when` together.
const BOTH: &str = "approval and approval_when are both set: use approval = \"required\" for \
    every intent, or approval_when for the intents whose arguments match, not both";

/// A tool's approval rule, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Approval {
    /// Distinct people who must approve (>= 1).
    pub approvals: u16,
    /// How long an intent waits for its approvals before it fails with `approval_expired`.
    pub ttl: Duration,
    /// Which intents need approval.
    pub when: When,
}

/// Which intents of a tool need approval.
#[derive(Debug, Clone, PartialEq)]
pub enum When {
    /// Every intent (`approval = "required"`).
    Always,
    /// Intents whose arguments match every condition (a conjunction; `approval_when`).
    Matching(Vec<Condition>),
}

/// One condition of `approval_when`: the value at `pointer` in the intent's arguments, tested
/// with `op`. `{ "/a" = { gt = 1, lt = 10 } }` is two conditions on one pointer.
#[derive(Debug, Clone, PartialEq)]
pub struct Condition {
    /// A JSON pointer (RFC 6901) into the intent's arguments: `""` (the whole arguments) or a
    /// path starting with `/`, like `/customer/tier`.
    pub pointer: String,
    pub op: Op,
}

/// A condition's test of the value its pointer resolves to.
///
/// - `Gt`, `Ge`, `Lt`, `Le` compare a JSON number, as `f64`, with the bound. A value they cannot
///   compare (the pointer is missing, or the value is a string such as `"20000"`, a bool, null,
///   an array or an object) counts as matching: a rule never fails open.
/// - `Eq`, `Ne`, `In` compare JSON values by equality, except that numbers compare numerically
///   (`1` equals `1.0`), at any depth. A missing pointer does not match `Eq` or `In` and does
///   match `Ne` (a missing value is not equal to anything).
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// `gt`: the value is a number greater than the bound.
    Gt(f64),
    /// `ge`: the value is a number greater than or equal to the bound.
    Ge(f64),
    /// `lt`: the value is a number less than the bound.
    Lt(f64),
    /// `le`: the value is a number less than or equal to the bound.
    Le(f64),
    /// `eq`: the value equals this one.
    Eq(Value),
    /// `ne`: the value is missing or differs from this one.
    Ne(Value),
    /// `in`: the value equals one of these (never empty).
    In(Vec<Value>),
}

impl Approval {
    /// Whether an intent with these arguments needs approval: always for [`When::Always`]; for
    /// [`When::Matching`], when every condition holds ([`Condition::holds`]).
    pub fn needed_for(&self, arguments: &Value) -> bool {
        match &self.when {
            When::Always => true,
            When::Matching(conditions) => conditions.iter().all(|c| c.holds(arguments)),
        }
    }
}

impl Condition {
    /// Whether the arguments match this condition; see [`Op`] for each operator, a missing
    /// pointer and a value a numeric comparison cannot compare (it matches: fail closed).
    pub fn holds(&self, arguments: &Value) -> bool {
        let value = arguments.pointer(&self.pointer);
        // Missing or not a number: a value the rule cannot compare needs approval.
        let number = |test: &dyn Fn(f64) -> bool| value.and_then(Value::as_f64).is_none_or(test);
        match &self.op {
            Op::Gt(bound) => number(&|n| n > *bound),
            Op::Ge(bound) => number(&|n| n >= *bound),
            Op::Lt(bound) => number(&|n| n < *bound),
            Op::Le(bound) => number(&|n| n <= *bound),
            Op::Eq(expected) => value.is_some_and(|v| json_eq(v, expected)),
            Op::Ne(expected) => !value.is_some_and(|v| json_eq(v, expected)),
            Op::In(values) => value.is_some_and(|v| values.iter().any(|e| json_eq(v, e))),
        }
    }
}

/// JSON equality where numbers compare numerically (`1 == 1.0`), at any depth. Two integers
/// compare exactly; otherwise as `f64`.
fn json_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let int = |n: &serde_json::Number| {
                n.as_i64()
                    .map(i128::from)
                    .or_else(|| n.as_u64().map(i128::from))
            };
            match (int(x), int(y)) {
                (Some(x), Some(y)) => x == y,
                _ => x.as_f64() == y.as_f64(),
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| json_eq(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| json_eq(v, w)))
        }
        _ => a == b,
    }
}

/// The four approval keys of one `[tools.<name>]` entry, as written. `RawTool` declares them
/// itself (its `deny_unknown_fields` rules out `#[serde(flatten)]`) and builds this.
#[derive(Debug, Clone, Default)]
pub struct RawApproval {
    pub approval: Option<String>,
    /// JSON pointer -> operator -> value.
    pub approval_when: Option<BTreeMap<String, BTreeMap<String, Value>>>,
    pub approvals: Option<i64>,
    pub approval_ttl_secs: Option<i64>,
}

/// Validates the approval keys: `Ok(None)` when neither `approval` nor `approval_when` is set
/// (and then `approvals` or `approval_ttl_secs` alone is refused). The error names the key and
/// the value at fault.
pub fn approval(raw: &RawApproval) -> Result<Option<Approval>, String> {
    let Some(when) = when(raw)? else {
        let alone = [
            ("approvals", raw.approvals.is_some()),
            ("approval_ttl_secs", raw.approval_ttl_secs.is_some()),
        ];
        if let Some((key, _)) = alone.into_iter().find(|(_, set)| *set) {
            return Err(format!("{key} is only used with approval or approval_when"));
        }
        return Ok(None);
    };
    let approvals = raw.approvals.unwrap_or(DEFAULT_APPROVALS);
    if !(1..=MAX_APPROVALS).contains(&approvals) {
        return Err(format!(
            "approvals = {approvals}: expected 1 to {MAX_APPROVALS} distinct people"
        ));
    }
    let ttl_secs = raw.approval_ttl_secs.unwrap_or(DEFAULT_TTL_SECS);
    if !(1..=MAX_TTL_SECS).contains(&ttl_secs) {
        return Err(format!(
            "approval_ttl_secs = {ttl_secs}: expected 1 to {MAX_TTL_SECS} (a year)"
        ));
    }
    Ok(Some(Approval {
        approvals: u16::try_from(approvals).expect("checked to be 1..=10"),
        ttl: Duration::from_secs(ttl_secs.unsigned_abs()),
        when,
    }))
}

/// Which intents need approval, from `approval` or `approval_when`; `None` when neither is set.
fn when(raw: &RawApproval) -> Result<Option<When>, String> {
    match (&raw.approval, &raw.approval_when) {
        (None, None) => Ok(None),
        (Some(_), Some(_)) => Err(BOTH.into()),
        (Some(value), None) if value == "required" => Ok(Some(When::Always)),
        (Some(value), None) => Err(format!(
            "approval = {value:?}: the only value is \"required\" (use approval_when for \
             conditional approval)"
        )),
        (None, Some(table)) => Ok(Some(When::Matching(conditions(table)?))),
    }
}

/// `approval_when`'s conditions: one per pointer and operator, pointers in the file's key order
/// (sorted), operators in the table's (sorted).
fn conditions(table: &BTreeMap<String, BTreeMap<String, Value>>) -> Result<Vec<Condition>, String> {
    if table.is_empty() {
        return Err(
            "approval_when = {} has no conditions: list at least one, like \
             { \"/amount_cents\" = { gt = 10000 } }, or use approval = \"required\""
                .into(),
        );
    }
    let mut conditions = Vec::new();
    for (pointer, ops) in table {
        check_pointer(pointer)?;
        if ops.is_empty() {
            return Err(format!(
                "approval_when.{pointer:?} has no operator: use one of {OPERATORS}"
            ));
        }
        for (name, value) in ops {
            let at = || format!("approval_when.{pointer:?}.{name}");
            let number = || {
                value
                    .as_f64()
                    .ok_or_else(|| format!("{} = {value}: expected a number", at()))
            };
            let op = match name.as_str() {
                "gt" => Op::Gt(number()?),
                "ge" => Op::Ge(number()?),
                "lt" => Op::Lt(number()?),
                "le" => Op::Le(number()?),
                "eq" => Op::Eq(value.clone()),
                "ne" => Op::Ne(value.clone()),
                "in" => match value {
                    Value::Array(values) if !values.is_empty() => Op::In(values.clone()),
                    Value::Array(_) => {
                        return Err(format!("{} = []: list at least one value", at()))
                    }
                    other => {
                        return Err(format!("{} = {other}: expected an array of values", at()))
                    }
                },
                other => {
                    return Err(format!(
                        "approval_when.{pointer:?}: unknown operator {other:?}; expected one of \
                         {OPERATORS}"
                    ))
                }
            };
            conditions.push(Condition {
                pointer: pointer.clone(),
                op,
            });
        }
    }
    Ok(conditions)
}

/// A JSON pointer (RFC 6901): `""` or `/`-separated tokens, where `~` is only `~0` or `~1`.
fn check_pointer(pointer: &str) -> Result<(), String> {
    let bad_escape = pointer
        .split('~')
        .skip(1)
        .any(|rest| !(rest.starts_with('0') || rest.starts_with('1')));
    if !(pointer.is_empty() || pointer.starts_with('/')) || bad_escape {
        return Err(format!(
            "approval_when key {pointer:?} is not a JSON pointer: use \"\" or a path starting \
             with \"/\", like \"/amount_cents\" (\"~\" only as \"~0\" or \"~1\")"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::json;

    use super::*;
    use crate::config::Tools;

    const TOOL: &str = "[tools.refund]\nurl='http://a'\nreceipt_id='/id'\nreceipt_match={}\n\
        recovery='none'\n";

    fn parse(extra: &str) -> Result<Option<Approval>, String> {
        Tools::parse_with(Path::new("t.toml"), &format!("{TOOL}{extra}\n"), &|_| None)
            .map(|tools| tools.tools["refund"].approval.clone())
            .map_err(|e| e.to_string())
    }

    fn rule(extra: &str) -> Approval {
        parse(extra).unwrap().expect("an approval rule")
    }

    fn conditions(extra: &str) -> Vec<Condition> {
        match rule(extra).when {
            When::Matching(conditions) => conditions,
            When::Always => panic!("expected approval_when"),
        }
    }

    #[test]
    fn no_approval_keys_no_rule() {
        assert_eq!(parse("").unwrap(), None);
    }

    #[test]
    fn required_with_the_defaults() {
        assert_eq!(
            rule("approval = 'required'"),
            Approval {
                approvals: 1,
                ttl: Duration::from_secs(86_400),
                when: When::Always,
            }
        );
        let r = rule("approval = 'required'\napprovals = 3\napproval_ttl_secs = 600");
        assert_eq!(r.approvals, 3);
        assert_eq!(r.ttl, Duration::from_secs(600));
        assert!(r.needed_for(&json!({})));
        assert!(r.needed_for(&json!(null)));
    }

    #[test]
    fn approval_when_with_gt_and_the_defaults() {
        let r = rule("approval_when = { \"/amount_cents\" = { gt = 10000 } }");
        assert_eq!(r.approvals, 1);
        assert_eq!(r.ttl, Duration::from_secs(86_400));
        assert_eq!(
            r.when,
            When::Matching(vec![Condition {
                pointer: "/amount_cents".into(),
                op: Op::Gt(10_000.0),
            }])
        );
        assert!(r.needed_for(&json!({ "amount_cents": 10_001 })));
        assert!(r.needed_for(&json!({ "amount_cents": 10_000.5 })));
        assert!(!r.needed_for(&json!({ "amount_cents": 10_000 })));
        assert!(!r.needed_for(&json!({ "amount_cents": 5 })));
    }

    #[test]
    fn several_operators_on_one_pointer_are_all_conditions() {
        let c = conditions("approval_when = { \"/n\" = { gt = 1, lt = 10 } }");
        assert_eq!(c.len(), 2);
        let r = rule("approval_when = { \"/n\" = { gt = 1, lt = 10 } }");
        assert!(r.needed_for(&json!({ "n": 5 })));
        assert!(!r.needed_for(&json!({ "n": 1 })));
        assert!(!r.needed_for(&json!({ "n": 10 })));
    }

    #[test]
    fn the_table_form_and_a_conjunction_over_pointers() {
        let r = rule(
            "[tools.refund.approval_when.\"/amount_cents\"]\nge = 100\n\
             [tools.refund.approval_when.\"/customer/tier\"]\neq = 'gold'\n",
        );
        assert!(r.needed_for(&json!({ "amount_cents": 100, "customer": { "tier": "gold" } })));
        assert!(!r.needed_for(&json!({ "amount_cents": 100, "customer": { "tier": "silver" } })));
        assert!(!r.needed_for(&json!({ "amount_cents": 99, "customer": { "tier": "gold" } })));
    }

    #[test]
    fn numeric_comparisons() {
        let holds = |op: &str, n: Value| {
            rule(&format!("approval_when = {{ \"/a\" = {{ {op} }} }}"))
                .needed_for(&json!({ "a": n }))
        };
        assert!(holds("ge = 10", json!(10)));
        assert!(!holds("ge = 10", json!(9.99)));
        assert!(holds("lt = 10", json!(9)));
        assert!(!holds("lt = 10", json!(10)));
        assert!(holds("le = 10", json!(10.0)));
        assert!(!holds("le = 10", json!(11)));
        assert!(holds("gt = -1.5", json!(-1)));
        assert!(!holds("gt = -1.5", json!(-2)));
    }

    #[test]
    fn a_value_a_numeric_comparison_cannot_compare_needs_approval() {
        for op in ["gt", "ge", "lt", "le"] {
            let r = rule(&format!(
                "approval_when = {{ \"/amount_cents\" = {{ {op} = 10000 }} }}"
            ));
            for args in [
                json!({ "amount_cents": "20000" }),
                json!({ "amount_cents": "1" }),
                json!({ "amount_cents": true }),
                json!({ "amount_cents": null }),
                json!({ "amount_cents": { "value": 1 } }),
                json!({ "amount_cents": [1] }),
                json!({}),
                json!(null),
            ] {
                assert!(r.needed_for(&args), "{op}: {args}");
            }
        }
    }

    #[test]
    fn eq_ne_in_compare_numbers_numerically_and_handle_missing_pointers() {
        let r = |op: &str| rule(&format!("approval_when = {{ \"/a\" = {{ {op} }} }}"));
        let eq = r("eq = 1");
        assert!(eq.needed_for(&json!({ "a": 1 })));
        assert!(eq.needed_for(&json!({ "a": 1.0 })));
        assert!(!eq.needed_for(&json!({ "a": "1" })));
        assert!(!eq.needed_for(&json!({ "a": 2 })));
        assert!(!eq.needed_for(&json!({})));
        let eq = r("eq = 1.0");
        assert!(eq.needed_for(&json!({ "a": 1 })));
        let eq = r("eq = { x = [1, 'y'] }");
        assert!(eq.needed_for(&json!({ "a": { "x": [1.0, "y"] } })));
        assert!(!eq.needed_for(&json!({ "a": { "x": [1.0, "y"], "z": 0 } })));
        let ne = r("ne = 'closed'");
        assert!(ne.needed_for(&json!({ "a": "open" })));
        assert!(!ne.needed_for(&json!({ "a": "closed" })));
        assert!(ne.needed_for(&json!({})), "a missing value is not equal");
        let ne = r("ne = 1");
        assert!(!ne.needed_for(&json!({ "a": 1.0 })));
        let within = r("in = ['gold', 'platinum']");
        assert!(within.needed_for(&json!({ "a": "gold" })));
        assert!(within.needed_for(&json!({ "a": "platinum" })));
        assert!(!within.needed_for(&json!({ "a": "silver" })));
        assert!(!within.needed_for(&json!({ "a": ["gold"] })));
        assert!(!within.needed_for(&json!({})));
        let within = r("in = [1, 2]");
        assert!(within.needed_for(&json!({ "a": 2.0 })));
        assert!(!within.needed_for(&json!({ "a": 3 })));
    }

    #[test]
    fn nested_pointers_and_the_whole_arguments() {
        let r = rule("approval_when = { \"/customer/tier\" = { in = ['gold'] } }");
        assert!(r.needed_for(&json!({ "customer": { "tier": "gold" } })));
        assert!(!r.needed_for(&json!({ "customer": { "tier": "basic" } })));
        assert!(!r.needed_for(&json!({ "customer": "gold" })));
        assert!(!r.needed_for(&json!({ "tier": "gold" })));
        let r = rule("approval_when = { \"/items/0/qty\" = { gt = 5 } }");
        assert!(r.needed_for(&json!({ "items": [{ "qty": 6 }] })));
        assert!(!r.needed_for(&json!({ "items": [{ "qty": 5 }] })));
        let r = rule("approval_when = { \"/a~1b\" = { eq = 1 } }");
        assert!(r.needed_for(&json!({ "a/b": 1 })));
        let r = rule("approval_when = { \"\" = { eq = 'x' } }");
        assert!(r.needed_for(&json!("x")));
        assert!(!r.needed_for(&json!({ "a": "x" })));
    }

    #[test]
    fn bad_approval_keys_are_refused_naming_the_key_and_value() {
        for (extra, says) in [
            (
                "approval = 'always'",
                "approval = \"always\": the only value is \"required\"",
            ),
            ("approval = 'always'", "approval_when"),
            (
                "approval = 'required'\napproval_when = { \"/a\" = { gt = 1 } }",
                "approval and approval_when are both set",
            ),
            ("approval_when = {}", "approval_when = {} has no conditions"),
            (
                "approval_when = { amount = { gt = 1 } }",
                "approval_when key \"amount\" is not a JSON pointer",
            ),
            (
                "approval_when = { \"/a~2\" = { gt = 1 } }",
                "approval_when key \"/a~2\" is not a JSON pointer",
            ),
            (
                "approval_when = { \"/a\" = {} }",
                "approval_when.\"/a\" has no operator: use one of gt, ge, lt, le, eq, ne, in",
            ),
            (
                "approval_when = { \"/a\" = { gte = 1 } }",
                "unknown operator \"gte\"; expected one of gt, ge, lt, le, eq, ne, in",
            ),
            (
                "approval_when = { \"/a\" = { gt = '1' } }",
                "approval_when.\"/a\".gt = \"1\": expected a number",
            ),
            (
                "approval_when = { \"/a\" = { ge = true } }",
                "approval_when.\"/a\".ge = true: expected a number",
            ),
            (
                "approval_when = { \"/a\" = { lt = [1] } }",
                "approval_when.\"/a\".lt = [1]: expected a number",
            ),
            (
                "approval_when = { \"/a\" = { le = 'x' } }",
                "approval_when.\"/a\".le = \"x\": expected a number",
            ),
            (
                "approval_when = { \"/a\" = { in = 'gold' } }",
                "approval_when.\"/a\".in = \"gold\": expected an array",
            ),
            (
                "approval_when = { \"/a\" = { in = [] } }",
                "approval_when.\"/a\".in = []: list at least one value",
            ),
            (
                "approval = 'required'\napprovals = 0",
                "approvals = 0: expected 1 to 10",
            ),
            (
                "approval = 'required'\napprovals = 11",
                "approvals = 11: expected 1 to 10",
            ),
            ("approval = 'required'\napprovals = -1", "approvals = -1"),
            (
                "approval = 'required'\napproval_ttl_secs = 0",
                "approval_ttl_secs = 0: expected 1 to 31536000",
            ),
            (
                "approval = 'required'\napproval_ttl_secs = 31536001",
                "approval_ttl_secs = 31536001",
            ),
            (
                "approvals = 2",
                "approvals is only used with approval or approval_when",
            ),
            (
                "approval_ttl_secs = 60",
                "approval_ttl_secs is only used with approval or approval_when",
            ),
        ] {
            let err = parse(extra).unwrap_err();
            assert!(
                err.contains("tools.refund: ") && err.contains(says),
                "{extra}: {err}"
            );
        }
        // The limits themselves are accepted.
        let r = rule("approval = 'required'\napprovals = 10\napproval_ttl_secs = 31536000");
        assert_eq!((r.approvals, r.ttl.as_secs()), (10, 31_536_000));
        // A condition that is not a table is refused by the parser, which names the key.
        let err = parse("approval_when = { \"/a\" = 5 }").unwrap_err();
        assert!(err.contains("approval_when"), "{err}");
    }
}
