//! Signing in to the operator console as a browser without JavaScript would, for suites that
//! only need a signed-in page or two (the console suite has its own fuller browser).

/// Signs in at the console on `port` with `token` (and `operator`, for the admin) and returns
/// the `Cookie` header value that carries the session.
pub async fn sign_in(port: u16, token: &str, operator: &str) -> String {
    let http = crate::http_builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let form = http.get(format!("{base}/ui/login")).send().await.unwrap();
    let nonce = cookie(&form, "iw_login").expect("the form's nonce cookie");
    let page = form.text().await.unwrap();
    let needle = "name=\"csrf\" value=\"";
    let start = page.find(needle).expect("a csrf input") + needle.len();
    let csrf = &page[start..start + page[start..].find('"').unwrap()];
    let r = http
        .post(format!("{base}/ui/login"))
        .header("cookie", nonce)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!(
            "csrf={csrf}&token={}&operator={}",
            encode(token),
            encode(operator)
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        303,
        "sign-in refused: {}",
        r.text().await.unwrap()
    );
    cookie(&r, "iw_session").expect("a session cookie")
}

/// `name=value` of a cookie an answer sets.
fn cookie(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers()
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with(&format!("{name}=")))
        .map(|v| v.split(';').next().unwrap().to_string())
}

/// Percent-encodes a form value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}
