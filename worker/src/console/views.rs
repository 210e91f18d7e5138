//! What every console page shares: the layout (navigation, sign-out, the stylesheet), the
//! helpers that show hostile text as text, times and ages, and the error page.
//!
//! Everything a page shows may come from an agent or a downstream. maud escapes every value it
//! interpolates (`<`, `>`, `&`, `"`, `'`); [`visible`] also shows control characters (an ANSI
//! escape, a NUL) as `\x1b`-style text, so nothing a terminal or a browser would interpret
//! reaches either unescaped. No page has an inline script or style (the CSP forbids both).

use chrono::{DateTime, Utc};
use maud::{html, Markup, DOCTYPE};

use super::session::Session;

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
                            (entry(Nav::Overview, "/ui/overview", "Overview"))
                            (entry(Nav::Operations, "/ui/operations", "Operations"))
                            @if session.is_admin() {
                                (entry(Nav::Jobs, "/ui/jobs", "Bulk jobs"))
                            }
                            (entry(Nav::DeadLetters, "/ui/dead-letters", "Dead letters"))
                        }
                        span.who {
                            @match session.tenant() {
                                Some(t) => { "tenant " strong { (visible(t)) } " (read-only)" }
                                None => { "admin " strong { (visible(session.operator.as_deref().unwrap_or("?"))) } }
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
