//! `${VAR}` interpolation of the tools file's string values.

/// Expands `${VAR}` and `${VAR:-default}` in one string value of the tools file (values, not
/// the file text, so a variable cannot inject TOML). `$$` is a literal `$` (write `$${` for a
/// literal `${`); any other `$` stays as it is. A variable that is unset or empty takes the
/// default; without one it is an error naming the variable, so a missing secret stops
/// start-up instead of sending an empty API key.
pub fn interpolate(value: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(body) = after.strip_prefix('{') {
            let end = body.find('}').ok_or_else(|| {
                format!("unterminated ${{ in {value:?} (write $${{ for a literal ${{)")
            })?;
            let (name, default) = match body[..end].split_once(":-") {
                Some((n, d)) => (n, Some(d)),
                None => (&body[..end], None),
            };
            let valid = !name.is_empty()
                && !name.starts_with(|c: char| c.is_ascii_digit())
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(format!(
                    "${{{}}} is not a variable reference (names use letters, digits and _; \
                     write $${{ for a literal ${{)",
                    &body[..end]
                ));
            }
            match (env(name).filter(|v| !v.is_empty()), default) {
                (Some(v), _) => out.push_str(&v),
                (None, Some(d)) => out.push_str(d),
                (None, None) => {
                    return Err(format!(
                        "environment variable {name} is not set (or empty) and ${{{name}}} has \
                         no default (write ${{{name}:-default}} for one)"
                    ))
                }
            }
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpolation_expands_defaults_and_escapes() {
        let env = |name: &str| match name {
            "KEY" => Some("s3cret".to_string()),
            "EMPTY" => Some(String::new()),
            _ => None,
        };
        let ok = |v: &str| interpolate(v, &env).unwrap();
        assert_eq!(ok("Bearer ${KEY}"), "Bearer s3cret");
        assert_eq!(ok("${KEY}${KEY}"), "s3crets3cret");
        assert_eq!(ok("${MISSING:-http://a:1}/x"), "http://a:1/x");
        assert_eq!(ok("${EMPTY:-fallback}"), "fallback");
        assert_eq!(ok("${KEY:-unused}"), "s3cret");
        assert_eq!(ok("${MISSING:-}"), "");
        assert_eq!(ok("$${KEY} costs $5 or $$5"), "${KEY} costs $5 or $5");
        assert_eq!(ok("{tenant}:{action_id}"), "{tenant}:{action_id}");
        let err = interpolate("Bearer ${MISSING}", &env).unwrap_err();
        assert!(err.contains("MISSING is not set"), "{err}");
        let err = interpolate("${EMPTY}", &env).unwrap_err();
        assert!(err.contains("EMPTY is not set (or empty)"), "{err}");
        assert!(interpolate("${KEY", &env)
            .unwrap_err()
            .contains("unterminated"));
        assert!(interpolate("${1X}", &env)
            .unwrap_err()
            .contains("not a variable"));
        // A value cannot inject TOML or another reference: it is inserted as text.
        let env2 = |_: &str| Some("\"\nurl = \"x\" ${KEY}".to_string());
        assert_eq!(
            interpolate("${A}", &env2).unwrap(),
            "\"\nurl = \"x\" ${KEY}"
        );
    }
}
