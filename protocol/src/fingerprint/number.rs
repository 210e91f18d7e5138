//! JSON numbers in the form RFC 8785 requires, ECMAScript's `Number.prototype.toString`,
//! so `4850`, `4850.0` and `4.85e3` all canonicalise to `4850` and the fingerprint does
//! not depend on how an agent's serializer happens to print a number.

use std::fmt::Write;

use serde_json::Number;

/// Appends `n` in canonical form. Integers that fit `i64`/`u64` are exact; anything else
/// (including integers too big for `u64`, which serde_json hands over as `f64`) goes
/// through the ECMAScript double formatting.
pub(super) fn write_number(out: &mut String, n: &Number) {
    if let Some(i) = n.as_i64() {
        let _ = write!(out, "{i}");
    } else if let Some(u) = n.as_u64() {
        let _ = write!(out, "{u}");
    } else if let Some(f) = n.as_f64() {
        write_f64(out, f);
    }
}

/// ECMAScript `Number::toString(x)` for a finite double (ECMA-262, 6.1.6.1.20).
fn write_f64(out: &mut String, x: f64) {
    if !x.is_finite() {
        // serde_json never holds NaN or infinities; JSON has no spelling for them.
        out.push_str("null");
        return;
    }
    if x == 0.0 {
        // Covers -0.0, which ECMAScript prints as "0".
        out.push('0');
        return;
    }
    if x < 0.0 {
        out.push('-');
    }
    let (digits, exponent) = shortest_digits(x.abs());
    // In ECMA-262 terms: x = digits × 10^(n − k), with k the digit count.
    let k = digits.len() as i32;
    let n = exponent + 1;

    if k <= n && n <= 21 {
        out.push_str(&digits);
        push_zeros(out, n - k);
    } else if 0 < n && n <= 21 {
        let (int, frac) = digits.split_at(n as usize);
        out.push_str(int);
        out.push('.');
        out.push_str(frac);
    } else if -6 < n && n <= 0 {
        out.push_str("0.");
        push_zeros(out, -n);
        out.push_str(&digits);
    } else {
        let (first, rest) = digits.split_at(1);
        out.push_str(first);
        if !rest.is_empty() {
            out.push('.');
            out.push_str(rest);
        }
        let e = n - 1;
        let _ = write!(out, "e{}{}", if e < 0 { '-' } else { '+' }, e.abs());
    }
}

/// The fewest significant digits that read back as `x` (positive, finite), and the
/// decimal exponent of the first digit, choosing like ECMAScript among equally short
/// candidates: the one closest to `x`, and on a tie the even one.
fn shortest_digits(x: f64) -> (String, i32) {
    // Rust's `{:e}` finds the shortest length, e.g. "4.85e3" or "1e21", but on a tie
    // between two candidates of that length it rounds up (1424953923781206.25 gives
    // ...206.3 where ECMAScript wants ...206.2). Rounding the exact value to that many
    // digits is ties-to-even, so it is preferred whenever it still reads back as `x`.
    let shortest = format!("{x:e}");
    let precision = split_scientific(&shortest).0.len() - 1;
    let nearest = format!("{x:.precision$e}");
    let chosen = if nearest.parse::<f64>() == Ok(x) {
        nearest
    } else {
        shortest
    };
    split_scientific(&chosen)
}

/// Splits Rust's `{:e}` output such as "4.85e3" into its digits "485" and exponent 3.
fn split_scientific(s: &str) -> (String, i32) {
    let (mantissa, exponent) = s
        .split_once('e')
        .expect("`{:e}` output always has an exponent");
    let digits = mantissa.chars().filter(|c| *c != '.').collect();
    let exponent = exponent.parse().expect("`{:e}` exponent is an integer");
    (digits, exponent)
}

fn push_zeros(out: &mut String, count: i32) {
    for _ in 0..count {
        out.push('0');
    }
}
