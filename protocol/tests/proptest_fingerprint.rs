//! Property tests for the fingerprint and RFC 8785 canonical JSON: the fingerprint
//! is a property of the request, not of its spelling (key order, whitespace, number forms
//! that RFC 8785 makes equal), and different requests never share one: the canonical form
//! parses back to the same value, so equal fingerprints imply equal values.

use proptest::prelude::*;
use protocol::{canonical_json, fingerprint, fingerprint_canonical};
use serde_json::{json, Map, Number, Value};
use sha2::{Digest, Sha256};

/// Largest integer every JSON number spelling maps to exactly (2^53): beyond it a float
/// spelling rounds, and the fingerprint keeps integers exact on purpose (docs/contract.md).
const EXACT: i64 = 1 << 53;

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        "\\PC{0,12}".prop_map(Value::String),
        "[{}\"\\\\:\u{0}-\u{1f}\u{7f}\u{2028}\u{fffd}\u{1f680}]{0,8}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec(("\\PC{0,6}|[{}\"\u{e000}\u{1f600}a-c]{0,3}", inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// `v` as JSON text with object members in a shuffled order (driven by `seed`) and
/// whitespace `ws` around every token.
fn spell(v: &Value, seed: &mut u64, ws: &str, out: &mut String) {
    let next = |seed: &mut u64| {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*seed >> 33) as usize
    };
    match v {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(ws);
                    out.push(',');
                }
                out.push_str(ws);
                spell(item, seed, ws, out);
            }
            out.push_str(ws);
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            for i in (1..entries.len()).rev() {
                let j = next(seed) % (i + 1);
                entries.swap(i, j);
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(ws);
                out.push_str(&serde_json::to_string(k).unwrap());
                out.push_str(ws);
                out.push(':');
                out.push_str(ws);
                spell(item, seed, ws, out);
            }
            out.push_str(ws);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// Equal as JSON values, numbers compared by value (serde_json tells `100` and `100.0` apart).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_i64(), y.as_i64()) {
            (Some(x), Some(y)) => x == y,
            _ => match (x.as_u64(), y.as_u64()) {
                (Some(x), Some(y)) => x == y,
                _ => {
                    // At most one is an exact integer here; compare as the doubles RFC 8785
                    // would when both are floats, the integer is exact, or one side is a float
                    // (its canonical digits, e.g. `8252941518996742000` for 8.252941518996742e18,
                    // parse back as an integer past 2^53 that denotes the same double).
                    let exact = |n: &Number| {
                        n.is_f64()
                            || n.as_i64().is_some_and(|i| i.abs() <= EXACT)
                            || n.as_u64().is_some_and(|u| u <= EXACT as u64)
                    };
                    (x.is_f64() || y.is_f64() || (exact(x) && exact(y))) && x.as_f64() == y.as_f64()
                }
            },
        },
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, a)| y.get(k).is_some_and(|b| same(a, b)))
        }
        (a, b) => a == b,
    }
}

/// Spellings of the integer `i` that RFC 8785 reads as one number: digits, a fraction of
/// zeros, exponents of every kind.
fn integer_spellings(i: i64) -> Vec<String> {
    let mut forms = vec![
        format!("{i}"),
        format!("{i}.0"),
        format!("{i}.000"),
        format!("{i}e0"),
        format!("{i}E+0"),
        format!("{i}0e-1"),
    ];
    // m × 10^k with the trailing zeros moved into the exponent.
    let (mut m, mut k) = (i, 0);
    while m != 0 && m % 10 == 0 {
        m /= 10;
        k += 1;
    }
    if k > 0 {
        forms.push(format!("{m}e{k}"));
        forms.push(format!("{m}.0E+{k}"));
    }
    forms
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn stable_under_key_order_and_whitespace(
        args in any_json(),
        tool in "[a-z._-]{1,20}",
        seed in any::<u64>(),
        ws in prop_oneof![Just(""), Just(" "), Just("\n\t"), Just(" \r\n  ")],
    ) {
        let mut text = String::new();
        let mut s = seed;
        spell(&args, &mut s, ws, &mut text);
        let parsed: Value = serde_json::from_str(&text).unwrap();
        prop_assert_eq!(fingerprint(&tool, &parsed), fingerprint(&tool, &args), "{}", text);
        prop_assert_eq!(canonical_json(&parsed), canonical_json(&args));
    }

    /// Canonical JSON is itself JSON that parses back to the same value, so it is
    /// injective: two values with one canonical form (one fingerprint) are the same value.
    #[test]
    fn canonical_form_parses_back_to_the_same_value(v in any_json()) {
        let c = canonical_json(&v);
        let back: Value = serde_json::from_str(&c).unwrap();
        prop_assert!(same(&back, &v), "{} -> {}", v, c);
        // And it is a fixpoint.
        prop_assert_eq!(canonical_json(&back), c);
    }

    #[test]
    fn equal_number_forms_give_equal_fingerprints(i in -EXACT..=EXACT, shift in 0u32..6) {
        let i = i / 10i64.pow(shift) * 10i64.pow(shift);
        let forms = integer_spellings(i);
        let expected = fingerprint("refund", &json!({"amount": i}));
        for form in forms {
            let v: Value = serde_json::from_str(&format!("{{\"amount\": {form}}}")).unwrap();
            prop_assert_eq!(fingerprint("refund", &v), expected.clone(), "{}", form);
        }
    }

    #[test]
    fn equal_decimal_forms_give_equal_fingerprints(m in -99_999_999i64..99_999_999, k in 1u32..8) {
        // m / 10^k spelled as a decimal fraction, with trailing zeros and in exponent form.
        let neg = if m < 0 { "-" } else { "" };
        let digits = format!("{:0>width$}", m.unsigned_abs(), width = k as usize + 1);
        let (int, frac) = digits.split_at(digits.len() - k as usize);
        let forms = [
            format!("{neg}{int}.{frac}"),
            format!("{neg}{int}.{frac}000"),
            format!("{m}e-{k}"),
            format!("{m}0E-{}", k + 1),
        ];
        let first: Value = serde_json::from_str(&format!("[{}]", forms[0])).unwrap();
        for form in &forms[1..] {
            let v: Value = serde_json::from_str(&format!("[{form}]")).unwrap();
            prop_assert_eq!(fingerprint("t", &v), fingerprint("t", &first), "{} vs {}", form, forms[0]);
        }
    }

    #[test]
    fn different_numbers_give_different_fingerprints(a in any::<i64>(), b in any::<i64>()) {
        prop_assume!(a != b);
        prop_assert_ne!(fingerprint("t", &json!({"n": a})), fingerprint("t", &json!({"n": b})));
    }

    #[test]
    fn different_huge_integers_differ_even_past_2_pow_53(u in (1u64 << 53)..u64::MAX) {
        // RFC 8785 proper would round both to one double; the documented departure keeps
        // integers that fit u64 exact, so two amounts one apart never collide.
        prop_assert_ne!(
            fingerprint("t", &json!({"n": u})),
            fingerprint("t", &json!({"n": u + 1}))
        );
    }

    #[test]
    fn any_change_of_a_leaf_changes_the_fingerprint(
        args in prop::collection::btree_map("\\PC{0,8}", any_json(), 1..6),
        pick in any::<prop::sample::Index>(),
        replacement in any_json(),
        tool in "[a-z]{1,10}",
    ) {
        let args: Map<String, Value> = args.into_iter().collect();
        let key = args.keys().nth(pick.index(args.len())).unwrap().clone();
        let before = Value::Object(args.clone());
        let mut changed = args;
        changed.insert(key, replacement);
        let after = Value::Object(changed);
        prop_assume!(!same(&before, &after));
        prop_assert_ne!(fingerprint(&tool, &before), fingerprint(&tool, &after));
    }

    #[test]
    fn tool_and_arguments_cannot_trade_characters(
        tool in "[a-z]{1,10}",
        s in "\\PC{0,10}",
    ) {
        // {"arguments":{"x":"<s>"},"tool":"<tool>"} — nothing can be moved from the tool name
        // into the arguments and keep the fingerprint (the wrapper is canonical JSON too).
        let a = fingerprint(&tool, &json!({"x": s}));
        let b = fingerprint(&format!("{tool}x"), &json!({"x": s}));
        prop_assert_ne!(a, b);
    }

    #[test]
    fn fingerprint_is_the_sha256_of_the_canonical_wrapper(
        tool in "\\PC{0,8}|[\"\\\\\u{0}-\u{1f}\u{1f680}a]{0,4}",
        v in any_json(),
    ) {
        // The definition, built the slow way: the wrapper object as a value, canonicalized
        // whole. The fingerprint writes the wrapper around the arguments' canonical text.
        let wrapper = json!({"tool": tool, "arguments": v});
        let expected: String = Sha256::digest(canonical_json(&wrapper).as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        prop_assert_eq!(fingerprint(&tool, &v), expected.clone());
        prop_assert_eq!(fingerprint_canonical(&tool, &canonical_json(&v)), expected);
    }
}

/// Found by `canonical_form_parses_back_to_the_same_value`: an integral double past 2^53 is
/// written as its shortest digits and parses back as an integer that denotes the same double.
#[test]
fn an_integral_float_past_2_pow_53_parses_back_as_the_same_double() {
    let v = serde_json::json!({ "": 8.252941518996742e18 });
    let c = canonical_json(&v);
    assert_eq!(c, r#"{"":8252941518996742000}"#);
    let back: Value = serde_json::from_str(&c).unwrap();
    assert!(same(&back, &v), "{v} -> {c}");
    assert_eq!(canonical_json(&back), c);
}
