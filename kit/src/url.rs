//! Service URLs as settings: shown without their password, and refused at start-up when they
//! can never work (another scheme, a port out of range), rather than retried as if the service
//! were only down. Two list forms: a broker setting may name several nodes, as comma-separated
//! URLs ([`split_list`]); a Postgres URL may name several hosts in libpq's multi-host form
//! `postgres://u@h1:5432,h2:5433/db` ([`split_hosts`]).

/// The URL with its password replaced by `***`, for logs and error messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

/// Checks that `url` has one of `schemes` and that every port it names is a number from 1 to
/// 65535 (a libpq-style host list `h1:5432,h2:5433` is checked host by host). Says why not.
pub fn check(url: &str, schemes: &[&str]) -> Result<(), String> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(format!("is not a URL; expected {}://…", schemes[0]));
    };
    if !schemes.iter().any(|s| s.eq_ignore_ascii_case(scheme)) {
        return Err(format!(
            "has scheme {scheme:?}; expected {}",
            schemes
                .iter()
                .map(|s| format!("{s}://"))
                .collect::<Vec<_>>()
                .join(" or ")
        ));
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let hosts = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    for host in hosts.split(',') {
        let port = match host.strip_prefix('[') {
            Some(v6) => v6.split_once(']').map(|(_, p)| p).unwrap_or(""),
            None => host.rsplit_once(':').map_or("", |(_, p)| p),
        };
        let port = port.strip_prefix(':').unwrap_or(port);
        if !port.is_empty() && !matches!(port.parse::<u16>(), Ok(1..)) {
            return Err(format!(
                "names port {port:?}; a port is a number from 1 to 65535"
            ));
        }
    }
    Ok(())
}

/// The URLs of a comma-separated list (`amqp://h1/%2f,amqp://h2/%2f`), trimmed, empty items
/// left out. A single URL is a list of one.
pub fn split_list(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The URLs of a comma-separated list in a fresh random order, so that clients started together
/// spread over a cluster's nodes and none insists on a dead first node. Each (re)connect takes a
/// new order.
pub fn shuffled(value: &str) -> Vec<String> {
    use std::hash::{BuildHasher, Hasher};
    let mut urls = split_list(value);
    // A seed from the standard library's per-process random keys and a counter: no random
    // number crate for a handful of URLs.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let mut state = h.finish() | 1;
    for i in (1..urls.len()).rev() {
        // xorshift64
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        urls.swap(i, (state % (i as u64 + 1)) as usize);
    }
    urls
}

/// [`check`] for every URL of a comma-separated list; says which one is wrong.
pub fn check_list(value: &str, schemes: &[&str]) -> Result<(), String> {
    let urls = split_list(value);
    if urls.is_empty() {
        return Err(format!("is empty; expected {}://…", schemes[0]));
    }
    for (i, url) in urls.iter().enumerate() {
        check(url, schemes).map_err(|why| {
            if urls.len() == 1 {
                why
            } else {
                format!("item {} ({}) {why}", i + 1, redact(url))
            }
        })?;
    }
    Ok(())
}

/// [`redact`] for every URL of a comma-separated list.
pub fn redact_list(value: &str) -> String {
    split_list(value)
        .iter()
        .map(|u| redact(u))
        .collect::<Vec<_>>()
        .join(",")
}

/// One single-host URL per host of a libpq multi-host URL, in the URL's order, each with the
/// same user, password, database and parameters (`postgres://u@h1:5432,h2:5433/db?x=1` gives
/// `postgres://u@h1:5432/db?x=1` and `postgres://u@h2:5433/db?x=1`). A single-host URL gives
/// itself; a URL without `://` is returned as is, for the parser to refuse.
pub fn split_hosts(url: &str) -> Vec<String> {
    let Some((scheme, authority, tail)) = parts(url) else {
        return vec![url.to_owned()];
    };
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    hosts
        .split(',')
        .map(|host| match userinfo {
            Some(u) => format!("{scheme}://{u}@{host}{tail}"),
            None => format!("{scheme}://{host}{tail}"),
        })
        .collect()
}

/// `host:port` of a URL (the first host of a list), for logs and health reports: no user, no
/// password, no path.
pub fn host_port(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let hosts = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    hosts.split(',').next().unwrap_or("").to_owned()
}

/// The value of query parameter `key` in `url`, if given (not percent-decoded: the values this
/// is used for are plain words).
pub fn query_param<'a>(url: &'a str, key: &str) -> Option<&'a str> {
    let query = url.split_once('?')?.1;
    let query = query.split('#').next().unwrap_or(query);
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == key).then_some(v)
    })
}

/// `url` without query parameter `key` (a parameter a client library would not understand).
pub fn without_param(url: &str, key: &str) -> String {
    let Some((base, query)) = url.split_once('?') else {
        return url.to_owned();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| pair.split_once('=').map_or(*pair, |(k, _)| k) != key)
        .collect();
    if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    }
}

/// The Postgres URL `url` naming database `name` instead of its own (or of none): the user,
/// password, hosts and query parameters (`sslmode`, `sslrootcert`, ...) are kept. Test suites and
/// benchmarks derive the URL of each database they create from one server URL this way.
pub fn with_database(url: &str, name: &str) -> String {
    let Some((scheme, authority, tail)) = parts(url) else {
        return format!("{url}/{name}");
    };
    let suffix = tail.find(['?', '#']).map_or("", |at| &tail[at..]);
    format!("{scheme}://{authority}/{name}{suffix}")
}

/// A URL's scheme, its authority (user, password, hosts) and the rest from the path on
/// (possibly empty); None without `://`.
fn parts(url: &str) -> Option<(&str, &str, &str)> {
    let (scheme, rest) = url.split_once("://")?;
    let (authority, tail) = rest.split_at(rest.find(['/', '?', '#']).unwrap_or(rest.len()));
    Some((scheme, authority, tail))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_database_keeps_hosts_and_parameters() {
        for (url, want) in [
            ("postgres://u@h:5432/postgres", "postgres://u@h:5432/t1"),
            ("postgres://u@h:5432", "postgres://u@h:5432/t1"),
            ("postgres://u@h:5432/", "postgres://u@h:5432/t1"),
            (
                "postgres://u:p%2Fq@h:5432/postgres?sslmode=verify-full&sslrootcert=/etc/ca.pem",
                "postgres://u:p%2Fq@h:5432/t1?sslmode=verify-full&sslrootcert=/etc/ca.pem",
            ),
            (
                "postgres://u@h:5432?sslmode=require",
                "postgres://u@h:5432/t1?sslmode=require",
            ),
            (
                "postgres://u@h1:5432,[::1]:5433/db?target_session_attrs=read-write",
                "postgres://u@h1:5432,[::1]:5433/t1?target_session_attrs=read-write",
            ),
        ] {
            assert_eq!(with_database(url, "t1"), want, "{url}");
        }
    }

    #[test]
    fn lists_of_urls_and_of_hosts() {
        assert_eq!(
            split_list(" amqp://a:1/%2f, amqp://b:2/%2f ,"),
            vec!["amqp://a:1/%2f", "amqp://b:2/%2f"]
        );
        assert!(check_list("amqp://a/%2f,amqp://b:0/%2f", &["amqp"])
            .unwrap_err()
            .contains("item 2"));
        assert!(check_list(" , ", &["amqp"]).is_err());
        let list = "amqp://a/%2f,amqp://b/%2f,amqp://c/%2f";
        let mut firsts = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let mut s = shuffled(list);
            firsts.insert(s[0].clone());
            s.sort();
            assert_eq!(s, split_list(list), "the same URLs, reordered");
        }
        assert_eq!(firsts.len(), 3, "every node comes first sometimes");
        assert_eq!(
            redact_list("amqp://u:p@a/%2f,amqp://u:q@b/%2f"),
            "amqp://u:***@a/%2f,amqp://u:***@b/%2f"
        );
        assert_eq!(
            split_hosts("postgres://u:p@h1:5432,h2:5433/db?sslmode=require"),
            vec![
                "postgres://u:p@h1:5432/db?sslmode=require",
                "postgres://u:p@h2:5433/db?sslmode=require"
            ]
        );
        assert_eq!(split_hosts("postgres://h/db"), vec!["postgres://h/db"]);
        assert_eq!(
            split_hosts("postgres://[::1]:1,[::2]:2"),
            vec!["postgres://[::1]:1", "postgres://[::2]:2"]
        );
        assert_eq!(host_port("postgres://u:p@h1:5432,h2:5433/db"), "h1:5432");
        let url = "postgres://h/db?a=1&target_session_attrs=read-write&b=2";
        assert_eq!(query_param(url, "target_session_attrs"), Some("read-write"));
        assert_eq!(
            without_param(url, "target_session_attrs"),
            "postgres://h/db?a=1&b=2"
        );
        assert_eq!(
            without_param(
                "postgres://h/db?target_session_attrs=any",
                "target_session_attrs"
            ),
            "postgres://h/db"
        );
    }

    #[test]
    fn the_password_is_hidden() {
        assert_eq!(
            redact("amqp://guest:secret@h:5672/%2f"),
            "amqp://guest:***@h:5672/%2f"
        );
        assert_eq!(redact("postgres://h/db"), "postgres://h/db");
    }

    #[test]
    fn schemes_and_ports() {
        let pg = &["postgres", "postgresql"];
        assert!(check("postgres://u:p@h:5432/db", pg).is_ok());
        assert!(check("postgresql://h/db?sslmode=require", pg).is_ok());
        assert!(check("postgres://u@h1:5432,h2:5433/db", pg).is_ok());
        assert!(check("postgres://u@[::1]:5432/db", pg).is_ok());
        assert!(check("mysql://root@h:3306/test", pg)
            .unwrap_err()
            .contains("mysql"));
        assert!(check("postgres://u@h:70000/db", pg)
            .unwrap_err()
            .contains("70000"));
        assert!(check("postgres://u@h1:5432,h2:0/db", pg).is_err());
        assert!(check("x", pg).is_err());
        let amqp = &["amqp", "amqps"];
        assert!(check("amqps://u:p@h/%2f", amqp).is_ok());
        assert!(check("amqp://u:p@h:99999/%2f", amqp).is_err());
        assert!(check("amqp://u:p@h:port/%2f", amqp).is_err());
        assert!(check("http://h:5672/", amqp).is_err());
    }
}
