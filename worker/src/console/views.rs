//! What every console page shares: the layout (navigation, sign-out, the stylesheet), the
//! helpers that show hostile text as text, times and ages, and the error page.
//!
//! Everything a page shows may come from an agent or a downstream. maud escapes every value it
//! interpolates (`<`, `>`, `&`, `"`, `'`); [`visible`] also shows control characters (an ANSI
//! escape, a NUL) as `\x1b`-style text, so nothing a terminal or a browser would interpret
//! reaches either unescaped. No page has an inline script or style (the CSP forbids both).

use chrono::{DateTime, Utc};
use maud::{html, Markup, DOCTYPE};

use super::session::{Reads, Session};

/// `s` with every control, bidirectional, zero-width or other default-ignorable character
/// (other than newline and tab) written as `\xNN` or `\u{NNNN}`, so it shows as text
/// ([`kit::text::visible`]).
pub fn visible(s: &str) -> String {
    kit::text::visible(s)
}

/// The first `max` characters of `s` (visible), with an ellipsis when cut.
pub fn excerpt(s: &str, max: usize) -> String {
    let v = visible(s);
    if v.chars().count() <= max {
        return v;
    }
    let mut cut: String = v.chars().take(max).collect();
    cut.push('…');
    cut
}

/// A JSON value, pretty, as text: serde escapes control characters in strings, and the
/// characters that are not seen are written out as by [`visible`].
pub fn json(value: &serde_json::Value) -> String {
    visible(&serde_json::to_string_pretty(value).unwrap_or_default())
}

/// A JSON text as stored, re-indented and otherwise untouched: numbers, string escapes, member
/// order and any duplicate member stay exactly as they are (parsing it into a value and
/// printing that again could round a huge number or merge duplicate members, and an approver
/// must see what would be sent), then written as by [`visible`]. A text that is not JSON (or
/// that serde cannot read) is shown as it is.
pub fn json_exact(text: &str) -> String {
    if serde_json::from_str::<serde::de::IgnoredAny>(text).is_err() {
        return visible(text);
    }
    fn newline(out: &mut String, depth: usize) {
        out.push('\n');
        for _ in 0..depth {
            out.push_str("  ");
        }
    }
    let mut out = String::with_capacity(text.len() + text.len() / 2);
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                out.push(c);
            }
            '{' | '[' => {
                // JSON's whitespace only: valid JSON has no other outside strings.
                while chars
                    .peek()
                    .is_some_and(|c| matches!(c, ' ' | '\t' | '\n' | '\r'))
                {
                    chars.next();
                }
                let close = if c == '{' { '}' } else { ']' };
                out.push(c);
                if chars.peek() == Some(&close) {
                    chars.next();
                    out.push(close);
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(c);
            }
            ',' => {
                out.push(',');
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            ' ' | '\t' | '\n' | '\r' => {}
            c => out.push(c),
        }
    }
    visible(&out)
}

/// A time in UTC, to the second.
pub fn time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// An optional time, or a dash.
pub fn time_or_dash(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "—".into(), time)
}

/// A duration in seconds as `3d 4h`, `5m 12s`, `42s`.
pub fn age(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    let (d, h, m, sec) = (s / 86_400, s / 3_600 % 24, s / 60 % 60, s % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{sec}s"),
        (0, 0, _) if sec == 0 => format!("{m}m"),
        (0, 0, _) => format!("{m}m {sec}s"),
        (0, _, _) => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

/// The age of `t` now.
pub fn age_of(t: DateTime<Utc>) -> String {
    age((Utc::now() - t).num_milliseconds() as f64 / 1000.0)
}

/// Which navigation entry a page belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nav {
    Overview,
    Approvals,
    Operations,
    Jobs,
    DeadLetters,
    None,
}

/// What the layout needs from the request.
pub struct Frame<'a> {
    pub session: Option<&'a Session>,
    /// The session's CSRF token (for the sign-out form).
    pub csrf: Option<&'a str>,
    pub nav: Nav,
    /// Refresh the page every this many seconds (a running job's progress).
    pub refresh_secs: Option<u32>,
}

/// A whole page.
pub fn page(title: &str, frame: &Frame<'_>, body: Markup) -> Markup {
    let entry = |nav: Nav, href: &str, label: &str| {
        html! {
            a href=(href) class=[(frame.nav == nav).then_some("current")] { (label) }
        }
    };
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                @if let Some(secs) = frame.refresh_secs {
                    meta http-equiv="refresh" content=(secs);
                }
                title { (title) " · intent worker" }
                link rel="stylesheet" href="/ui/static/console.css";
            }
            body {
                header {
                    span.brand { "intent worker" }
                    @if let Some(session) = frame.session {
                        nav {
                            @match session.reads() {
                                // An approver's console is the approval queue, nothing else.
                                Reads::Nothing => {
                                    (entry(Nav::Approvals, "/ui/approvals", "Approvals"))
                                }
                                reads => {
                                    (entry(Nav::Overview, "/ui/overview", "Overview"))
                                    (entry(Nav::Approvals, "/ui/approvals", "Approvals"))
                                    (entry(Nav::Operations, "/ui/operations", "Operations"))
                                    @if reads == Reads::Everything {
                                        (entry(Nav::Jobs, "/ui/jobs", "Bulk jobs"))
                                    }
                                    (entry(Nav::DeadLetters, "/ui/dead-letters", "Dead letters"))
                                }
                            }
                        }
                        span.who {
                            @match (session.reads(), session.approver()) {
                                (Reads::Tenant(t), _) => { "tenant " strong { (visible(t)) } " (read-only)" }
                                (_, Some(a)) => { "approver " strong { (visible(a)) } }
                                _ => { "admin " strong { (visible(session.operator.as_deref().unwrap_or("?"))) } }
                            }
                        }
                        form.signout method="post" action="/ui/logout" {
                            input type="hidden" name="csrf" value=(frame.csrf.unwrap_or(""));
                            button type="submit" { "Sign out" }
                        }
                    }
                }
                main { (body) }
            }
        }
    }
}

/// A notice at the top of a page.
pub fn notice(kind: &str, text: &str) -> Markup {
    html! { p class=(format!("notice {kind}")) role="status" { (visible(text)) } }
}

/// A hidden CSRF field.
pub fn csrf_field(token: &str) -> Markup {
    html! { input type="hidden" name="csrf" value=(token); }
}

/// A state name as a badge.
pub fn state_badge(state: &str) -> Markup {
    html! { span class=(format!("state state-{}", visible(state))) { (visible(state)) } }
}

/// An error page body.
pub fn error_body(title: &str, message: &str) -> Markup {
    html! {
        h1 { (title) }
        (notice("error", message))
        p { a href="/ui/overview" { "Back to the overview" } }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_show_as_text() {
        assert_eq!(visible("a\u{1b}[31mred"), "a\\x1b[31mred");
        assert_eq!(visible("nul\0"), "nul\\x00");
        assert_eq!(visible("line\nnext\ttab"), "line\nnext\ttab");
        assert_eq!(visible("del\u{7f}"), "del\\x7f");
        assert_eq!(visible("c1\u{9b}"), "c1\\x9b");
        assert_eq!(visible("rtl\u{202e}txt"), "rtl\\u{202e}txt");
        assert_eq!(visible("plain <b>é</b>"), "plain <b>é</b>");
    }

    #[test]
    fn hostile_strings_render_escaped() {
        let hostile = [
            "<script>alert(1)</script>",
            "\"><img src=x onerror=alert(1)>",
            "'><svg/onload=alert(1)>",
            "\u{1b}]0;owned\u{7}",
        ];
        for h in hostile {
            let markup = html! { td title=(visible(h)) { (visible(h)) } }.into_string();
            assert!(!markup.contains("<script"), "{markup}");
            assert!(!markup.contains("<img"), "{markup}");
            assert!(!markup.contains("<svg"), "{markup}");
            assert!(!markup.contains('\u{1b}'), "{markup}");
            assert!(!markup.contains("\"><"), "{markup}");
        }
        let markup = html! { (visible(hostile[0])) }.into_string();
        assert_eq!(markup, "&lt;script&gt;alert(1)&lt;/script&gt;");
    }

    #[test]
    fn stored_json_is_shown_exactly_and_as_text() {
        // A number no f64 holds keeps its spelling.
        assert_eq!(
            json_exact("{\"amount\":1e400}"),
            "{\n  \"amount\": 1e400\n}"
        );
        let stored = concat!(
            r#"{"amount":123456789012345678901234567890,"a":{},"b":[ ],"#,
            r#""s":"<script>\"x\",{y}:</script>\u0000","n":[1,{"k":-0.0}],"s":1,"#,
            "\"rtl\":\"\u{202e}evil\"}"
        );
        let want = concat!(
            "{\n",
            "  \"amount\": 123456789012345678901234567890,\n",
            "  \"a\": {},\n",
            "  \"b\": [],\n",
            "  \"s\": \"<script>\\\"x\\\",{y}:</script>\\u0000\",\n",
            "  \"n\": [\n",
            "    1,\n",
            "    {\n",
            "      \"k\": -0.0\n",
            "    }\n",
            "  ],\n",
            "  \"s\": 1,\n",
            "  \"rtl\": \"\\u{202e}evil\"\n",
            "}"
        );
        assert_eq!(json_exact(stored), want);
        // Rendered, it is text.
        let markup = html! { pre { (json_exact(stored)) } }.into_string();
        assert!(
            markup.contains("&lt;script&gt;") && !markup.contains("<script>"),
            "{markup}"
        );
        assert!(!markup.contains('\u{202e}'), "{markup}");
        assert_eq!(json_exact("not json <b>"), "not json <b>");
        assert_eq!(json_exact("\"a\u{1b}\""), "\"a\\x1b\"");
    }

    #[test]
    fn ages_read_at_a_glance() {
        assert_eq!(age(42.4), "42s");
        assert_eq!(age(312.0), "5m 12s");
        assert_eq!(age(900.0), "15m");
        assert_eq!(age(3_700.0), "1h 1m");
        assert_eq!(age(90_000.0), "1d 1h");
        assert_eq!(age(-3.0), "0s");
        assert_eq!(excerpt("abcdef", 3), "abc…");
        assert_eq!(excerpt("ab", 3), "ab");
    }
}
