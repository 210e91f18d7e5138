//! Service URLs as settings: shown without their password, and refused at start-up when they
//! can never work (another scheme, a port out of range), rather than retried as if the service
//! were only down.

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

#[cfg(test)]
mod tests {
    use super::{check, redact};

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
