//! The operator console over HTTP, on real worker processes, RabbitMQ, Postgres and the
//! reference downstream: signing in (cookie flags, CSRF, a slow wrong token), the security
//! headers, tenant isolation, hostile strings shown as text, resolving a held operation from
//! its page, bulk jobs (progress, a row that moved is skipped, a dead worker's job taken
//! over), dead letters (list, republish after a fix, discard; each once, from the console and
//! `worker ops dead-letters`), a republished intent proven as its original publisher in
//! `user_id` mode, the cause classes the same in Rust and in SQL, and accepted long-running
//! operations (listed with their operation id and last poll, their polls in the timeline,
//! polled now from their page and in bulk, counted at the downstream's async jobs).

use std::process::Command;
use std::time::{Duration, Instant};

use e2e::{cleanup, intent, procs::bin_dir, publish_as, Agent, BrokerUser, Downstream, Env};
use e2e::{Worker, WorkerOptions};
use protocol::Status;
use reqwest::header::{HeaderMap, COOKIE, SET_COOKIE};
use serde_json::json;
use worker::ledger::jobs::NewJob;
use worker::ledger::queries::OperationSearch;
use worker::ledger::Ledger;

const T: Duration = Duration::from_secs(45);
const ADMIN: &str = "console-admin-token-0123456789";
const NORTH_TOKEN: &str = "north-token-123456";
const SOUTH_TOKEN: &str = "south-token-654321";
const XSS_ID: &str = "\"><img/src=x/onerror=alert(1)>";
const SCRIPT_ID: &str = "<script>alert(1)</script>";

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

fn form_body(fields: &[(&str, &str)]) -> String {
    fields
        .iter()
        .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// The value of the first `<input … name="NAME" value="…">` in a page, unescaped as a browser
/// reads it (a bulk form's filter holds `&amp;`).
fn input(html: &str, name: &str) -> String {
    let needle = format!("name=\"{name}\" value=\"");
    let start = html
        .find(&needle)
        .unwrap_or_else(|| panic!("no input {name} in:\n{html}"))
        + needle.len();
    let end = html[start..].find('"').unwrap() + start;
    html[start..end]
        .replace("&quot;", "\"")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
}

/// A cookie's `Set-Cookie` line among the headers.
fn set_cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with(&format!("{name}=")))
        .map(str::to_string)
}

fn cookie_value(line: &str) -> String {
    line.split(';').next().unwrap().to_string()
}

struct Answer {
    status: u16,
    headers: HeaderMap,
    body: String,
}

/// A browser without JavaScript: follows no redirect, keeps the session cookie by hand.
struct Browser {
    base: String,
    http: reqwest::Client,
    cookies: Vec<String>,
}

impl Browser {
    fn new(port: u16) -> Browser {
        Browser {
            base: format!("http://127.0.0.1:{port}"),
            http: e2e::http_builder()
                .redirect(reqwest::redirect::Policy::none())
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap(),
            cookies: Vec::new(),
        }
    }

    fn keep(&mut self, headers: &HeaderMap) {
        for line in headers
            .get_all(SET_COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
        {
            let pair = cookie_value(line);
            let name = pair.split('=').next().unwrap().to_string();
            self.cookies.retain(|c| !c.starts_with(&format!("{name}=")));
            if !line.contains("Max-Age=0") {
                self.cookies.push(pair);
            }
        }
    }

    async fn send(&mut self, request: reqwest::RequestBuilder) -> Answer {
        let request = if self.cookies.is_empty() {
            request
        } else {
            request.header(COOKIE, self.cookies.join("; "))
        };
        let r = request.send().await.expect("console request");
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        self.keep(&headers);
        Answer {
            status,
            headers,
            body: r.text().await.unwrap(),
        }
    }

    async fn get(&mut self, path: &str) -> Answer {
        let url = format!("{}{path}", self.base);
        let request = self.http.get(url);
        self.send(request).await
    }

    async fn post(&mut self, path: &str, fields: &[(&str, &str)]) -> Answer {
        let url = format!("{}{path}", self.base);
        let request = self
            .http
            .post(url)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form_body(fields));
        self.send(request).await
    }

    /// Signs in through the form; panics unless it succeeds.
    async fn sign_in(port: u16, token: &str, operator: &str) -> Browser {
        let mut b = Browser::new(port);
        let form = b.get("/ui/login").await;
        let csrf = input(&form.body, "csrf");
        let r = b
            .post(
                "/ui/login",
                &[("csrf", &csrf), ("token", token), ("operator", operator)],
            )
            .await;
        assert_eq!(r.status, 303, "{}", r.body);
        b
    }

    /// The session's CSRF token, read from a page.
    async fn csrf(&mut self) -> String {
        let page = self.get("/ui/overview").await;
        input(&page.body, "csrf")
    }
}

fn assert_security_headers(a: &Answer) {
    let h = |name: &str| {
        a.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let csp = h("content-security-policy");
    assert!(
        csp.contains("script-src 'self'")
            && csp.contains("frame-ancestors 'none'")
            && !csp.contains("unsafe-inline"),
        "{csp}"
    );
    assert_eq!(h("x-frame-options"), "DENY");
    assert_eq!(h("x-content-type-options"), "nosniff");
    assert_eq!(h("referrer-policy"), "no-referrer");
    assert_eq!(h("cache-control"), "no-store");
}

/// A held operation of the `deploy` tool (no recovery): the downstream commits and drops the
/// reply.
async fn held(agent: &mut Agent, ds: &Downstream, env: &Env, tenant: &str, action_id: &str) {
    ds.fault(json!({"kind": "drop_after_commit", "key": format!("{tenant}:{action_id}")}))
        .await;
    agent
        .request(tenant, action_id, "deploy", json!({"service": "api"}))
        .await;
    e2e::wait_for(&format!("{action_id} held"), T, || async {
        (env.state(tenant, action_id).await == "held").then_some(())
    })
    .await;
}

async fn operation_id(env: &Env, tenant: &str, action_id: &str) -> i64 {
    sqlx::query_scalar("SELECT id FROM operations WHERE tenant = $1 AND action_id = $2")
        .bind(tenant)
        .bind(action_id)
        .fetch_one(&env.pool)
        .await
        .unwrap()
}

fn console_worker(tools: std::path::PathBuf) -> WorkerOptions {
    WorkerOptions::new(tools).with_admin(ADMIN).env(
        "WORKER_TENANT_TOKENS",
        &format!("north={NORTH_TOKEN},south={SOUTH_TOKEN}"),
    )
}

#[tokio::test]
async fn signing_in_gives_a_strict_session_cookie_and_every_answer_the_security_headers() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let w = Worker::start(&env, "w", &console_worker(env.standard_tools(ds.port, ""))).await;
    let port = w.admin_port.unwrap();
    let mut b = Browser::new(port);

    let r = b.get("/ui/overview").await;
    assert_eq!(r.status, 303);
    assert_eq!(r.headers.get("location").unwrap(), "/ui/login");
    assert_security_headers(&r);
    let form = b.get("/ui/login").await;
    assert_eq!(form.status, 200);
    assert_security_headers(&form);
    let nonce = set_cookie(&form.headers, "iw_login").expect("the form's nonce cookie");
    assert!(
        nonce.contains("HttpOnly") && nonce.contains("SameSite=Strict"),
        "{nonce}"
    );
    let csrf = input(&form.body, "csrf");

    // The sign-in form's own CSRF token is required.
    let r = b
        .post("/ui/login", &[("token", ADMIN), ("operator", "alice")])
        .await;
    assert_eq!(r.status, 403, "{}", r.body);
    let form = b.get("/ui/login").await;
    let csrf2 = input(&form.body, "csrf");
    assert_ne!(csrf, csrf2);
    // A wrong token is answered slowly and sets no session.
    let started = Instant::now();
    let r = b
        .post(
            "/ui/login",
            &[
                ("csrf", &csrf2),
                ("token", "guess-guess-guess"),
                ("operator", "x"),
            ],
        )
        .await;
    assert_eq!(r.status, 401, "{}", r.body);
    // Answered at once: a failure spends the listener's budget instead of holding the client.
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
    assert!(set_cookie(&r.headers, "iw_session").is_none());
    // The admin names themself.
    let csrf3 = input(&r.body, "csrf");
    let r = b
        .post("/ui/login", &[("csrf", &csrf3), ("token", ADMIN)])
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    let csrf4 = input(&r.body, "csrf");
    let r = b
        .post(
            "/ui/login",
            &[("csrf", &csrf4), ("token", ADMIN), ("operator", "alice")],
        )
        .await;
    assert_eq!(r.status, 303, "{}", r.body);
    let session = set_cookie(&r.headers, "iw_session").expect("a session cookie");
    for flag in ["HttpOnly", "SameSite=Strict", "Path=/ui", "Max-Age=28800"] {
        assert!(session.contains(flag), "{flag}: {session}");
    }
    assert!(!session.contains("Secure"), "plain HTTP: {session}");
    let page = b.get("/ui/overview").await;
    assert_eq!(page.status, 200);
    assert_security_headers(&page);
    assert!(page.body.contains("alice"), "{}", page.body);
    assert!(!page.body.contains(ADMIN), "no token is ever shown");

    // Behind a TLS proxy the cookie is Secure.
    let mut tls = Browser::new(port);
    let form = tls
        .send(
            tls.http
                .get(format!("{}/ui/login", tls.base))
                .header("x-forwarded-proto", "https"),
        )
        .await;
    let csrf = input(&form.body, "csrf");
    let r = tls
        .send(
            tls.http
                .post(format!("{}/ui/login", tls.base))
                .header("x-forwarded-proto", "https")
                .header("content-type", "application/x-www-form-urlencoded")
                .body(form_body(&[("csrf", &csrf), ("token", NORTH_TOKEN)])),
        )
        .await;
    let secure = set_cookie(&r.headers, "iw_session").expect("tenant session");
    assert!(secure.contains("; Secure"), "{secure}");

    // A tampered cookie is no session.
    let mut forged = Browser::new(port);
    let value = cookie_value(&session);
    let flipped = if value.ends_with('0') {
        format!("{}1", &value[..value.len() - 1])
    } else {
        format!("{}0", &value[..value.len() - 1])
    };
    forged.cookies.push(flipped);
    assert_eq!(forged.get("/ui/overview").await.status, 303);

    // Bearer tokens keep working for the API; the cookie does not open it.
    let api = format!("http://127.0.0.1:{port}/v1/operations");
    let r = e2e::http()
        .get(&api)
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = e2e::http()
        .get(&api)
        .header(COOKIE, cookie_value(&session))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);

    let css = b.get("/ui/static/console.css").await;
    assert_eq!(css.status, 200);
    assert!(css.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/css"));
    assert_eq!(b.get("/ui/nothing-here").await.status, 404);

    // Signing out needs the CSRF token, then clears the cookie.
    let csrf = b.csrf().await;
    assert_eq!(b.post("/ui/logout", &[]).await.status, 403);
    let r = b.post("/ui/logout", &[("csrf", &csrf)]).await;
    assert_eq!(r.status, 303);
    assert!(set_cookie(&r.headers, "iw_session")
        .unwrap()
        .contains("Max-Age=0"));
    assert_eq!(b.get("/ui/overview").await.status, 303);
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn a_tenant_sees_only_its_own_rows_and_nobody_acts_without_the_csrf_token() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let w = Worker::start(&env, "w", &console_worker(env.standard_tools(ds.port, ""))).await;
    let port = w.admin_port.unwrap();
    let mut agent = Agent::new(&env, &["north", "south"]).await;
    // Hostile strings where agents and downstreams put them.
    let hostile = json!({"note": "\u{1b}[31mred\u{1b}[0m <script>alert(2)</script>", "x": "\"><img src=x onerror=alert(3)>"});
    agent
        .send(&intent("north", XSS_ID, "refund", hostile.clone()))
        .await;
    agent.until("north", XSS_ID, Status::Succeeded, T).await;
    agent
        .send(&intent("north", SCRIPT_ID, "refund", hostile))
        .await;
    agent.until("north", SCRIPT_ID, Status::Succeeded, T).await;
    held(&mut agent, &ds, &env, "north", "deploy-north").await;
    held(&mut agent, &ds, &env, "south", "deploy-south").await;
    let south_id = operation_id(&env, "south", "deploy-south").await;
    let north_held = operation_id(&env, "north", "deploy-north").await;
    let mut north = Browser::sign_in(port, NORTH_TOKEN, "").await;
    let all = north.get("/ui/operations?scope=all&tenant=south").await;
    assert_eq!(all.status, 200);
    assert!(all.body.contains("deploy-north"), "{}", all.body);
    assert!(
        !all.body.contains("deploy-south"),
        "another tenant's row: {}",
        all.body
    );
    assert!(!all.body.contains(">south<"));
    // Hostile ids render as text.
    assert!(
        !all.body.contains(SCRIPT_ID) && !all.body.contains("<img/src"),
        "{}",
        all.body
    );
    assert!(
        all.body.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{}",
        all.body
    );
    assert!(
        all.body
            .contains("&quot;&gt;&lt;img/src=x/onerror=alert(1)&gt;"),
        "{}",
        all.body
    );
    let groups = north.get("/ui/operations?scope=all&view=groups").await;
    assert!(
        groups.body.contains("no_recovery") && groups.body.contains("succeeded"),
        "{}",
        groups.body
    );
    let overview = north.get("/ui/overview").await;
    assert!(
        !overview.body.contains("workers ready"),
        "{}",
        overview.body
    );
    assert!(!overview.body.contains(&env.topology.dead_letter_queue));
    let other = north.get(&format!("/ui/operations/{south_id}")).await;
    assert_eq!(
        other.status, 404,
        "another tenant's operation is a missing one"
    );
    let own = north.get(&format!("/ui/operations/{north_held}")).await;
    assert_eq!(own.status, 200);
    assert!(
        !own.body.contains("/resolve\""),
        "no action forms for a tenant: {}",
        own.body
    );
    let xss_page = north
        .get(&format!(
            "/ui/operations/{}",
            operation_id(&env, "north", XSS_ID).await
        ))
        .await;
    assert!(
        xss_page.body.contains("\\u001b[31mred"),
        "{}",
        xss_page.body
    );
    assert!(!xss_page.body.contains('\u{1b}'));
    assert!(!xss_page.body.contains("<script>alert(2)") && !xss_page.body.contains("<img src=x"));
    // Read-only, whatever the form says.
    let csrf = north.csrf().await;
    let r = north
        .post(
            &format!("/ui/operations/{north_held}/recheck"),
            &[("csrf", &csrf), ("reason", "try"), ("request_id", "t-1")],
        )
        .await;
    assert_eq!(r.status, 403, "{}", r.body);
    assert_eq!(north.get("/ui/jobs").await.status, 403);
    assert_eq!(north.get("/ui/bulk").await.status, 403);

    // The admin without the form's CSRF token changes nothing.
    let mut admin = Browser::sign_in(port, ADMIN, "alice").await;
    let r = admin
        .post(
            &format!("/ui/operations/{north_held}/fail"),
            &[
                ("evidence", "forged request without a token"),
                ("request_id", "f-1"),
            ],
        )
        .await;
    assert_eq!(r.status, 403, "{}", r.body);
    let r = admin
        .post(
            &format!("/ui/operations/{north_held}/fail"),
            &[
                ("csrf", &csrf),
                ("evidence", "another session's token"),
                ("request_id", "f-2"),
            ],
        )
        .await;
    assert_eq!(r.status, 403, "{}", r.body);
    assert_eq!(env.state("north", "deploy-north").await, "held");
    // The admin sees both tenants, and filters by text and cause.
    let both = admin.get("/ui/operations?state=held").await;
    assert!(both.body.contains("deploy-north") && both.body.contains("deploy-south"));
    let text = admin.get("/ui/operations?scope=all&q=%3Cscript").await;
    assert!(
        text.body.contains("&lt;script&gt;") && !text.body.contains("deploy-north"),
        "{}",
        text.body
    );
    let cause = admin
        .get("/ui/operations?cause=no_recovery&tenant=south")
        .await;
    assert!(cause.body.contains("deploy-south") && !cause.body.contains("deploy-north"));
    assert_eq!(admin.get("/ui/operations?cause=gremlins").await.status, 400);
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn a_held_operation_is_resolved_from_its_page_with_the_downstreams_receipt() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let w = Worker::start(&env, "w", &console_worker(env.standard_tools(ds.port, ""))).await;
    let port = w.admin_port.unwrap();
    let mut agent = Agent::new(&env, &["north"]).await;
    held(&mut agent, &ds, &env, "north", "deploy-1").await;
    let id = operation_id(&env, "north", "deploy-1").await;
    let mut b = Browser::sign_in(port, ADMIN, "alice").await;
    let page = b.get(&format!("/ui/operations/{id}")).await;
    assert!(page.body.contains("no_recovery"), "{}", page.body);
    let csrf = input(&page.body, "csrf");
    let request_id = input(&page.body, "request_id");
    let path = format!("/ui/operations/{id}/resolve");
    let wrong = json!({"receipt_id": "rcpt-x", "idempotency_key": "north:other"}).to_string();
    let r = b
        .post(
            &path,
            &[
                ("csrf", &csrf),
                ("request_id", &request_id),
                ("receipt", &wrong),
                ("reason", "pasted"),
            ],
        )
        .await;
    assert_eq!(r.status, 422, "{}", r.body);
    assert!(r.body.contains("is for another operation"), "{}", r.body);
    assert_eq!(env.state("north", "deploy-1").await, "held");
    let receipt = env
        .downstream_receipt("north:deploy-1")
        .await
        .unwrap()
        .to_string();
    let fields = [
        ("csrf", csrf.as_str()),
        ("request_id", "resolve-1"),
        ("receipt", &receipt),
        ("reason", "the downstream shows it"),
    ];
    let r = b.post(&path, &fields).await;
    assert_eq!(r.status, 303, "{}", r.body);
    assert!(r.headers["location"]
        .to_str()
        .unwrap()
        .ends_with("done=resolve"));
    agent.until("north", "deploy-1", Status::Succeeded, T).await;
    let r = b.post(&path, &fields).await;
    assert!(r.headers["location"]
        .to_str()
        .unwrap()
        .ends_with("done=repeated"));
    let actor: String = sqlx::query_scalar(
        "SELECT actor FROM operation_history WHERE operation_id = $1 ORDER BY id DESC LIMIT 1",
    )
    .bind(id)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(actor, "operator:alice");
    let list = b.get("/ui/operations").await;
    assert!(
        !list.body.contains("deploy-1"),
        "resolved: no longer unresolved"
    );
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn a_bulk_job_skips_a_row_that_moved_and_is_taken_over_when_its_worker_is_gone() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let w = Worker::start(&env, "w", &console_worker(env.standard_tools(ds.port, ""))).await;
    let port = w.admin_port.unwrap();
    let mut agent = Agent::new(&env, &["north"]).await;
    for i in 0..4 {
        held(&mut agent, &ds, &env, "north", &format!("deploy-{i}")).await;
    }
    // A job created by a worker that died at once (its lease already lapsed).
    let ledger = Ledger::from_pool(env.pool.clone());
    let search = OperationSearch {
        states: vec!["held".into()],
        tenant: Some("north".into()),
        text: Some("deploy-".into()),
        ..Default::default()
    };
    let (job, created) = ledger
        .create_job(&NewJob {
            request_id: "orphan-1",
            action: "recheck",
            filter: json!({"state": "held"}),
            operator: "alice",
            reason: "downstream is back",
            cap: 3,
            search: &search,
            owner: "a-worker-that-died",
            lease: Duration::ZERO,
        })
        .await
        .unwrap();
    assert!(created);
    assert_eq!((job.total, job.status.as_str()), (3, "running"));
    // One of its rows moves before anyone works on it.
    let moved = "deploy-0";
    let receipt = env.downstream_receipt("north:deploy-0").await.unwrap();
    let r = e2e::http()
        .post(format!("http://127.0.0.1:{port}/v1/operations/north/{moved}/resolve"))
        .bearer_auth(ADMIN)
        .json(&json!({"receipt": receipt, "operator": "bob", "reason": "by hand", "request_id": "by-hand"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let done = e2e::wait_for(
        "the orphaned job finished by the living worker",
        T,
        || async {
            ledger
                .job(job.id)
                .await
                .unwrap()
                .filter(|j| j.status == "finished")
        },
    )
    .await;
    assert_eq!(
        (done.done, done.skipped, done.refused),
        (2, 1, 0),
        "{done:?}"
    );
    assert_eq!(done.claims, 2, "taken over once");
    assert_eq!(
        env.state("north", moved).await,
        "succeeded",
        "the moved row was not overwritten"
    );
    assert_eq!(env.state("north", "deploy-3").await, "held", "past the cap");
    let actors: Vec<String> = sqlx::query_scalar(
        "SELECT request_id FROM operator_requests WHERE request_id LIKE 'bulk:%' ORDER BY request_id",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(actors.len(), 2, "{actors:?}");
    assert!(actors
        .iter()
        .all(|r| r.starts_with(&format!("bulk:{}:", job.id))));
    let mut b = Browser::sign_in(port, ADMIN, "alice").await;
    let page = b.get(&format!("/ui/jobs/{}", job.id)).await;
    assert!(page.body.contains("id=\"skipped\">1<"), "{}", page.body);
    assert!(page.body.contains("moved on: succeeded"), "{}", page.body);

    // A job from the console's form: a dry run, a cap, then progress; the form twice is one job.
    let dry = b.get("/ui/bulk?state=held&tenant=north").await;
    assert!(dry.body.contains("3"), "{}", dry.body);
    let csrf = input(&dry.body, "csrf");
    let filter = input(&dry.body, "filter");
    let fields = [
        ("csrf", csrf.as_str()),
        ("request_id", "form-1"),
        ("filter", &filter),
        ("action", "fail"),
        ("reason", "the service owner confirmed no deploy ran"),
        ("cap", "2"),
    ];
    let r = b.post("/ui/bulk", &fields).await;
    assert_eq!(r.status, 303, "{}", r.body);
    let location = r.headers["location"].to_str().unwrap().to_string();
    let again = b.post("/ui/bulk", &fields).await;
    assert_eq!(again.headers["location"].to_str().unwrap(), location);
    let job_id: i64 = location.rsplit('/').next().unwrap().parse().unwrap();
    let finished = e2e::wait_for("the console's job", T, || async {
        ledger
            .job(job_id)
            .await
            .unwrap()
            .filter(|j| j.status == "finished")
    })
    .await;
    assert_eq!((finished.total, finished.done), (2, 2), "{finished:?}");
    let failed: i64 = sqlx::query_scalar("SELECT count(*) FROM operations WHERE state = 'failed'")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(failed, 2);
    let over = [
        ("cap", "10001"),
        ("request_id", "form-2"),
        ("csrf", &csrf),
        ("filter", &filter),
        ("action", "recheck"),
        ("reason", "x"),
    ];
    assert_eq!(b.post("/ui/bulk", &over).await.status, 400);
    drop(w);
    cleanup(env).await;
}

/// `worker ops …` against the test's database and broker.
fn ops(env: &Env, tools: &std::path::Path, args: &[&str]) -> std::process::Output {
    let t = &env.topology;
    Command::new(bin_dir().join("worker"))
        .arg("ops")
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("DATABASE_URL", &env.db_url)
        .env("AMQP_URL", &env.amqp_url)
        .env("WORKER_TOOLS", tools)
        .env("INTENTS_EXCHANGE", &t.intents_exchange)
        .env("WORKER_DEAD_LETTER_QUEUE", &t.dead_letter_queue)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run worker ops")
}

/// Waits until the dead-letter queue holds `n` messages (a listing's returns reach a quorum
/// queue's count a moment after the listing ends).
async fn depth_becomes(env: &Env, n: u32) {
    e2e::wait_for(&format!("{n} dead letters"), T, || async {
        (dead_letter_depth(env).await == n).then_some(())
    })
    .await;
}

async fn dead_letter_depth(env: &Env) -> u32 {
    let conn = lapin::Connection::connect(&env.amqp_url, Default::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare(
            env.topology.dead_letter_queue.as_str().into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await
        .unwrap();
    let _ = conn.close(200, "".into()).await;
    q.message_count()
}

#[tokio::test]
async fn dead_letters_are_listed_republished_after_a_fix_and_discarded_once_each() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = env.standard_tools(ds.port, "");
    let mut w = Worker::start(&env, "w1", &console_worker(tools.clone())).await;
    let mut agent = Agent::new(&env, &["north", "south"]).await;
    // A tool this pool does not have yet, and a body that is not an intent.
    agent
        .request("north", "refund-9", "refunds-v2", json!({"order": "o-9"}))
        .await;
    agent.until("north", "refund-9", Status::Rejected, T).await;
    agent
        .request("south", "refund-8", "refunds-v2", json!({"order": "o-8"}))
        .await;
    agent.until("south", "refund-8", Status::Rejected, T).await;
    agent.send_raw("north", b"{\"not\": \"an intent\"}").await;
    e2e::wait_for("three dead letters", T, || async {
        (dead_letter_depth(&env).await == 3).then_some(())
    })
    .await;

    // Listing returns every message to the queue.
    let listed = ops(&env, &tools, &["dead-letters", "list", "--json"]);
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    let listing: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(listing["letters"].as_array().unwrap().len(), 3, "{listing}");
    depth_becomes(&env, 3).await;
    let north_letter = listing["letters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["message_id"] == "north:refund-9")
        .unwrap()
        .clone();
    assert_eq!(north_letter["reason"], "unknown_tool");
    assert_eq!(north_letter["headers"]["x-intent-worker-user-id"], "guest");
    let id = north_letter["id"].as_str().unwrap().to_string();

    // A tenant session sees its own letter only, and no form, from the last operator read of
    // this worker (a tenant never reads the queue itself).
    let port = w.admin_port.unwrap();
    let mut south = Browser::sign_in(port, SOUTH_TOKEN, "").await;
    let page = south.get("/ui/dead-letters").await;
    assert!(
        page.body.contains("once an operator has read the queue"),
        "{}",
        page.body
    );
    let mut reader = Browser::sign_in(port, ADMIN, "carol").await;
    assert_eq!(reader.get("/ui/dead-letters").await.status, 200);
    let page = south.get("/ui/dead-letters").await;
    assert!(
        page.body.contains("south:refund-8") && !page.body.contains("north:refund-9"),
        "{}",
        page.body
    );
    assert!(!page.body.contains("invalid_message") && !page.body.contains("name=\"action\""));
    assert!(
        !page.body.contains("shown, "),
        "no count of the whole queue: {}",
        page.body
    );

    // The fix: the tool is configured (a restart), then the letter is republished.
    std::fs::write(
        &tools,
        std::fs::read_to_string(&tools).unwrap().replace("[tools.refund]", "[tools.\"refunds-v2\"]\nurl = \"http://127.0.0.1:PORT/replay/refunds\"\nrecovery = \"replay\"\nreplay_window_secs = 3600\nreplay_safety_margin_secs = 60\nreceipt_id = \"/receipt_id\"\nreceipt_match = { \"/idempotency_key\" = \"{tenant}:{action_id}\" }\ntimeout_ms = 2000\n\n[tools.refund]").replace("PORT", &ds.port.to_string()),
    )
    .unwrap();
    w.kill();
    let w = Worker::start(&env, "w2", &console_worker(tools.clone())).await;
    let port = w.admin_port.unwrap();
    let mut admin = Browser::sign_in(port, ADMIN, "alice").await;
    let page = admin.get("/ui/dead-letters?reason=unknown_tool").await;
    assert_eq!(page.status, 200);
    assert!(
        page.body.contains("north:refund-9") && page.body.contains("unknown tool"),
        "{}",
        page.body
    );
    let csrf = input(&page.body, "csrf");
    let fields = [
        ("csrf", csrf.as_str()),
        ("request_id", "republish-1"),
        ("action", "republish"),
        ("id", &id),
        ("note", "refunds-v2 is configured now"),
    ];
    let r = admin.post("/ui/dead-letters", &fields).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("republished"), "{}", r.body);
    agent.until("north", "refund-9", Status::Succeeded, T).await;
    assert_eq!(env.mutations("north:refund-9").await, 1);
    // The same request again does nothing.
    let r = admin.post("/ui/dead-letters", &fields).await;
    assert!(r.body.contains("already done"), "{}", r.body);
    depth_becomes(&env, 2).await;

    // The CLI discards the garbage, once, idempotent by its request id.
    let discard = [
        "dead-letters",
        "discard",
        "--reason",
        "invalid_message",
        "--operator",
        "bob",
        "--note",
        "not an intent",
        "--request-id",
        "discard-1",
    ];
    let dry = ops(&env, &tools, &[&discard[..4], &["--dry-run"]].concat());
    assert!(dry.status.success());
    assert!(String::from_utf8_lossy(&dry.stdout).contains("would discard"));
    depth_becomes(&env, 2).await;
    let out = ops(&env, &tools, &discard);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("discard: done"));
    let out = ops(&env, &tools, &discard);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("already done"));
    depth_becomes(&env, 1).await;
    // An id that is not there: exit 1.
    let out = ops(
        &env,
        &tools,
        &[
            "dead-letters",
            "discard",
            "--id",
            "0000000000000000",
            "--operator",
            "bob",
            "--note",
            "x",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let audit: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT action, status, operator FROM dead_letter_actions ORDER BY created_at",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        audit,
        vec![
            ("republish".into(), "done".into(), "alice".into()),
            ("discard".into(), "done".into(), "bob".into()),
            ("discard".into(), "not_found".into(), "bob".into()),
        ]
    );
    let overview = admin.get("/ui/overview").await;
    assert!(overview.body.contains("workers ready"), "{}", overview.body);
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn a_republished_intent_is_proven_as_its_original_publisher_in_user_id_mode() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let alice = BrokerUser::create("alice");
    let mallory = BrokerUser::create("mallory");
    let auth = |fixed: bool| {
        let extra = if fixed {
            format!("[tools.ticket2]\nurl = \"http://127.0.0.1:{}/replay/tickets\"\nrecovery = \"replay\"\nreplay_window_secs = 3600\nreplay_safety_margin_secs = 60\nreceipt_id = \"/receipt_id\"\nreceipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\ntimeout_ms = 2000\n", ds.port)
        } else {
            String::new()
        };
        format!(
            "{extra}\n[auth]\nmode = \"user_id\"\nusers = {{ \"{}\" = [\"north\"], \"{}\" = [\"south\"] }}\n",
            alice.name, mallory.name
        )
    };
    let tools = env.standard_tools(ds.port, "");
    let base = std::fs::read_to_string(&tools).unwrap();
    std::fs::write(&tools, format!("{base}{}", auth(false))).unwrap();
    let mut w = Worker::start(&env, "w1", &console_worker(tools.clone())).await;
    let mut agent = Agent::new(&env, &["north"]).await;
    let body = |action: &str| {
        serde_json::to_vec(&intent("north", action, "ticket2", json!({"title": "x"}))).unwrap()
    };
    // Alice for her own tenant (the tool is missing), mallory claiming alice's tenant.
    publish_as(
        &env,
        &alice.url(&env),
        Some(&alice.name),
        "north",
        &[&body("t-1")],
    )
    .await;
    publish_as(
        &env,
        &mallory.url(&env),
        Some(&mallory.name),
        "north",
        &[&body("t-2")],
    )
    .await;
    e2e::wait_for("two dead letters", T, || async {
        (dead_letter_depth(&env).await == 2).then_some(())
    })
    .await;
    // North's session sees alice's letter, not mallory's claim (from an operator's read).
    let mut reader = Browser::sign_in(w.admin_port.unwrap(), ADMIN, "carol").await;
    assert_eq!(reader.get("/ui/dead-letters").await.status, 200);
    let mut north = Browser::sign_in(w.admin_port.unwrap(), NORTH_TOKEN, "").await;
    let page = north.get("/ui/dead-letters").await;
    assert!(
        page.body.contains("north/t-1") && !page.body.contains("north/t-2"),
        "{}",
        page.body
    );

    std::fs::write(&tools, format!("{base}{}", auth(true))).unwrap();
    w.kill();
    let w = Worker::start(&env, "w2", &console_worker(tools.clone())).await;
    let out = ops(
        &env,
        &tools,
        &[
            "dead-letters",
            "republish",
            "--all",
            "--operator",
            "alice-admin",
            "--note",
            "ticket2 configured",
            "--request-id",
            "rp-1",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Alice's intent is proven for north through the worker's republish.
    agent.until("north", "t-1", Status::Succeeded, T).await;
    // Mallory's is still unproven: dead-lettered again, never admitted.
    e2e::wait_for(
        "mallory's claim back in the dead-letter queue",
        T,
        || async { (dead_letter_depth(&env).await == 1).then_some(()) },
    )
    .await;
    assert_eq!(env.state("north", "t-2").await, "");
    let letters: serde_json::Value =
        serde_json::from_slice(&ops(&env, &tools, &["dead-letters", "list", "--json"]).stdout)
            .unwrap();
    let again = &letters["letters"][0];
    assert_eq!(again["reason"], "tenant_mismatch");
    assert_eq!(
        again["original_user"],
        mallory.name.as_str(),
        "the original publisher is kept, not the worker"
    );
    // Setting the republish headers oneself proves nothing but oneself.
    let forged = intent("north", "t-3", "ticket2", json!({"title": "x"}));
    {
        let conn = lapin::Connection::connect(&mallory.url(&env), Default::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(Default::default()).await.unwrap();
        let mut headers = lapin::types::FieldTable::default();
        for (k, v) in [
            ("x-intent-worker-republished", "x"),
            ("x-intent-worker-user-id", alice.name.as_str()),
        ] {
            headers.insert(k.into(), lapin::types::AMQPValue::LongString(v.into()));
        }
        let props = lapin::BasicProperties::default()
            .with_user_id(mallory.name.as_str().into())
            .with_headers(headers);
        ch.basic_publish(
            env.topology.intents_exchange.as_str().into(),
            "north".into(),
            Default::default(),
            &serde_json::to_vec(&forged).unwrap(),
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
        let _ = conn.close(200, "".into()).await;
    }
    e2e::wait_for("the forged claim dead-lettered", T, || async {
        (dead_letter_depth(&env).await == 2).then_some(())
    })
    .await;
    assert_eq!(env.state("north", "t-3").await, "");
    drop(w);
    cleanup(env).await;
}

#[tokio::test]
async fn cause_classes_are_the_same_in_rust_and_in_sql() {
    let env = Env::new().await;
    let ledger = Ledger::from_pool(env.pool.clone());
    let samples = worker::ledger::cause::SAMPLES;
    let rows: Vec<(String, Option<String>)> = samples
        .iter()
        .map(|(s, e, _)| (s.to_string(), e.map(str::to_string)))
        .collect();
    let in_sql = ledger.classify_in_sql(&rows).await.unwrap();
    for ((state, evidence, want), sql) in samples.iter().zip(&in_sql) {
        assert_eq!(worker::ledger::cause::classify(state, *evidence), *want);
        assert_eq!(sql, want, "{state} {evidence:?}");
    }
    cleanup(env).await;
}

/// A sign-in form works once (its CSRF pair is spent on use, on every worker), and signing out
/// ends the session: a copy of the cookie taken before is refused by every worker after.
#[tokio::test]
async fn a_sign_in_form_works_once_and_signing_out_ends_the_session_everywhere() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = env.standard_tools(ds.port, "");
    let w1 = Worker::start(&env, "w1", &console_worker(tools.clone())).await;
    let w2 = Worker::start(&env, "w2", &console_worker(tools)).await;
    let (p1, p2) = (w1.admin_port.unwrap(), w2.admin_port.unwrap());

    let mut b = Browser::new(p1);
    let form = b.get("/ui/login").await;
    let csrf = input(&form.body, "csrf");
    let nonce = b.cookies.clone();
    let fields = [
        ("csrf", csrf.as_str()),
        ("token", ADMIN),
        ("operator", "alice"),
    ];
    let r = b.post("/ui/login", &fields).await;
    assert_eq!(r.status, 303, "{}", r.body);
    let session = b.cookies.clone();
    // The same form again, with its nonce cookie, on this worker and the other: refused.
    for port in [p1, p2] {
        let mut replay = Browser::new(port);
        replay.cookies = nonce.clone();
        let r = replay.post("/ui/login", &fields).await;
        assert_eq!(
            r.status, 403,
            "a second use of one form on :{port}: {}",
            r.body
        );
        assert!(set_cookie(&r.headers, "iw_session").is_none());
    }

    // The session works on both workers until it signs out.
    for port in [p1, p2] {
        let mut other = Browser::new(port);
        other.cookies = session.clone();
        assert_eq!(other.get("/ui/overview").await.status, 200);
    }
    let csrf = b.csrf().await;
    let r = b.post("/ui/logout", &[("csrf", &csrf)]).await;
    assert_eq!(r.status, 303, "{}", r.body);
    for port in [p1, p2] {
        let mut copy = Browser::new(port);
        copy.cookies = session.clone();
        let r = copy.get("/ui/overview").await;
        assert_eq!(r.status, 303, "a signed-out session on :{port}");
        assert_eq!(r.headers.get("location").unwrap(), "/ui/login");
        let r = copy.post("/ui/logout", &[("csrf", &csrf)]).await;
        assert_eq!(r.status, 401, "{}", r.body);
    }
    drop((w1, w2));
    cleanup(env).await;
}

/// Invisible and direction-changing characters (bidirectional controls, zero-width and other
/// default-ignorable characters, line separators) are written out wherever the console shows
/// text, and an operator's name that holds one is refused, on the sign-in form and the API.
#[tokio::test]
async fn invisible_characters_are_written_out_and_kept_out_of_operator_names() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let w = Worker::start(&env, "w", &console_worker(env.standard_tools(ds.port, ""))).await;
    let port = w.admin_port.unwrap();
    let mut agent = Agent::new(&env, &["north"]).await;
    let unseen = [
        '\u{061c}',
        '\u{2060}',
        '\u{feff}',
        '\u{00ad}',
        '\u{2028}',
        '\u{e0041}',
        '\u{3164}',
    ];
    let hidden: String = unseen.iter().collect();
    // Keys are visible ASCII (the contract); what an agent sends in its arguments is anything.
    let action_id = "deploy-unseen-1";
    ds.fault(json!({"kind": "drop_after_commit", "key": format!("north:{action_id}")}))
        .await;
    agent
        .request(
            "north",
            action_id,
            "deploy",
            json!({"note": format!("a{hidden}b")}),
        )
        .await;
    e2e::wait_for("the operation held", T, || async {
        (env.state("north", action_id).await == "held").then_some(())
    })
    .await;
    // And a dead letter with the same in its body (a tool this pool does not have).
    agent
        .request("north", "unseen-2", "refunds-v7", json!({"note": hidden}))
        .await;
    agent.until("north", "unseen-2", Status::Rejected, T).await;
    let id = operation_id(&env, "north", action_id).await;

    let mut admin = Browser::sign_in(port, ADMIN, "alice").await;
    for path in [
        format!("/ui/operations/{id}"),
        "/ui/dead-letters".to_string(),
    ] {
        let page = admin.get(&path).await;
        assert_eq!(page.status, 200, "{path}");
        for c in unseen {
            assert!(
                !page.body.contains(c),
                "{path}: U+{:04X} raw in the page",
                c as u32
            );
        }
        assert!(page.body.contains("\\u{2060}"), "{path}: {}", page.body);
    }

    let mut b = Browser::new(port);
    let form = b.get("/ui/login").await;
    let csrf = input(&form.body, "csrf");
    let r = b
        .post(
            "/ui/login",
            &[
                ("csrf", &csrf),
                ("token", ADMIN),
                ("operator", "ali\u{061c}ce"),
            ],
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(set_cookie(&r.headers, "iw_session").is_none());

    let r = e2e::http()
        .post(format!(
            "http://127.0.0.1:{port}/v1/operations/north/{action_id}/recheck"
        ))
        .bearer_auth(ADMIN)
        .json(&json!({"operator": "bob\u{2060}", "reason": "look again", "request_id": "r-1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(
        body["message"].as_str().unwrap().contains("invisible"),
        "{body}"
    );
    drop(w);
    cleanup(env).await;
}

/// A bulk `fail` whose evidence is longer than any one `fail` takes is refused before a job
/// exists, as a too-short one is.
#[tokio::test]
async fn a_bulk_fail_with_evidence_past_the_limit_makes_no_job() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let w = Worker::start(&env, "w", &console_worker(env.standard_tools(ds.port, ""))).await;
    let mut agent = Agent::new(&env, &["north"]).await;
    held(&mut agent, &ds, &env, "north", "deploy-1").await;
    let mut admin = Browser::sign_in(w.admin_port.unwrap(), ADMIN, "alice").await;
    let csrf = admin.csrf().await;
    let evidence = "e".repeat(5_000);
    let r = admin
        .post(
            "/ui/bulk",
            &[
                ("csrf", &csrf),
                ("filter", "state=held"),
                ("action", "fail"),
                ("cap", "10"),
                ("reason", &evidence),
                ("request_id", "bulk-long-1"),
            ],
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("4000"), "{}", r.body);
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM bulk_jobs")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(jobs, 0);
    drop(w);
    cleanup(env).await;
}

/// The delivery count a quorum queue gives each message now (read with `basic.get` and returned):
/// by message id.
async fn delivery_counts(env: &Env) -> Vec<(String, i64)> {
    let conn = lapin::Connection::connect(&env.amqp_url, Default::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(
            env.topology.dead_letter_queue.as_str().into(),
            lapin::options::BasicGetOptions { no_ack: false },
        )
        .await
        .unwrap()
    {
        let count = m
            .delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get("x-delivery-count").cloned())
            .map(|v| match v {
                lapin::types::AMQPValue::LongLongInt(n) => n,
                lapin::types::AMQPValue::LongInt(n) => n as i64,
                lapin::types::AMQPValue::ShortInt(n) => n as i64,
                other => panic!("x-delivery-count {other:?}"),
            })
            .unwrap_or(0);
        let id = m
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_string())
            .unwrap_or_default();
        out.push((id, count));
    }
    let _ = conn.close(200, "".into()).await;
    out.sort();
    out
}

/// A tenant's view of the dead letters reads nothing from the queue: however often it looks,
/// no letter's delivery count moves (RabbitMQ 4 drops a message past its delivery limit), its
/// own included, and another tenant's letter is never taken from the queue for it.
#[tokio::test]
async fn a_tenant_reading_dead_letters_ages_no_letter() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let w = Worker::start(&env, "w", &console_worker(env.standard_tools(ds.port, ""))).await;
    let port = w.admin_port.unwrap();
    let mut agent = Agent::new(&env, &["north", "south"]).await;
    for (tenant, id) in [("north", "refund-1"), ("south", "refund-2")] {
        agent
            .request(tenant, id, "refunds-v9", json!({"order": id}))
            .await;
        agent.until(tenant, id, Status::Rejected, T).await;
    }
    depth_becomes(&env, 2).await;
    let mut admin = Browser::sign_in(port, ADMIN, "alice").await;
    assert_eq!(admin.get("/ui/dead-letters").await.status, 200);
    depth_becomes(&env, 2).await;

    let mut south = Browser::sign_in(port, SOUTH_TOKEN, "").await;
    for _ in 0..6 {
        let page = south.get("/ui/dead-letters").await;
        assert!(
            page.body.contains("south:refund-2") && !page.body.contains("north:refund-1"),
            "{}",
            page.body
        );
    }
    depth_becomes(&env, 2).await;
    let counts = delivery_counts(&env).await;
    assert_eq!(counts.len(), 2, "{counts:?}");
    for (id, n) in &counts {
        assert!(*n <= 1, "{id} was delivered {n} times by reading");
    }
    drop(w);
    cleanup(env).await;
}

/// An async `deploy` tool against the reference downstream's long-running jobs. Its polls are
/// 30 to 60 s apart (`first_ms` = `max_ms` = 60 s, drawn within half of that), so a poll seen
/// within a few seconds of a recheck is the console's doing, not the schedule's.
fn async_tools(env: &Env, port: u16) -> std::path::PathBuf {
    env.async_tools(port, (60_000, 60_000, 3_600), "")
}

/// Sends a deploy the downstream accepts and never finishes (`async_stuck`), and waits until
/// its row is `accepted`; returns its operation id at the downstream.
async fn stuck(
    agent: &mut Agent,
    ds: &Downstream,
    env: &Env,
    tenant: &str,
    action_id: &str,
) -> String {
    let key = format!("{tenant}:{action_id}");
    ds.fault(json!({"kind": "async_stuck", "key": key})).await;
    agent
        .request(
            tenant,
            action_id,
            "deploy",
            json!({"service": "<script>alert(7)</script>"}),
        )
        .await;
    e2e::wait_for(&format!("{action_id} accepted"), T, || async {
        (env.state(tenant, action_id).await == "accepted").then_some(())
    })
    .await;
    remote_id(env, tenant, action_id).await
}

async fn remote_id(env: &Env, tenant: &str, action_id: &str) -> String {
    sqlx::query_scalar(
        "SELECT remote_id FROM operations WHERE tenant = $1 AND action_id = $2 AND remote_id IS NOT NULL",
    )
    .bind(tenant)
    .bind(action_id)
    .fetch_one(&env.pool)
    .await
    .unwrap()
}

/// Whether the row has a poll running (a live lease).
async fn leased(env: &Env, tenant: &str, action_id: &str) -> bool {
    sqlx::query_scalar(
        "SELECT lease_until IS NOT NULL AND lease_until > now() FROM operations
         WHERE tenant = $1 AND action_id = $2",
    )
    .bind(tenant)
    .bind(action_id)
    .fetch_one(&env.pool)
    .await
    .unwrap()
}

/// Reloads `path` until its body contains every one of `wanted`; returns that page.
async fn page_with(b: &mut Browser, path: &str, wanted: &[&str]) -> String {
    let deadline = Instant::now() + T;
    loop {
        let page = b.get(path).await;
        assert_eq!(page.status, 200, "{}", page.body);
        if wanted.iter().all(|w| page.body.contains(w)) {
            return page.body;
        }
        assert!(
            Instant::now() < deadline,
            "{path} never showed {wanted:?}:\n{}",
            page.body
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// An accepted long-running operation is listed with its operation id and its last poll; its
/// page shows the operation id, the poll deadline, the acceptance (as text), how it is known
/// and the polls in the timeline; "Poll now" reads its status at once, read only.
#[tokio::test]
async fn an_accepted_operation_shows_its_polls_and_is_polled_now_from_its_page() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let w = Worker::start(&env, "w", &console_worker(async_tools(&env, ds.port))).await;
    let port = w.admin_port.unwrap();
    let mut agent = Agent::new(&env, &["north"]).await;
    let remote = stuck(&mut agent, &ds, &env, "north", "lr-1").await;
    let key = "north:lr-1";
    let id = operation_id(&env, "north", "lr-1").await;
    let mut b = Browser::sign_in(port, ADMIN, "alice").await;

    // The list, filtered to accepted rows: the row, its operation id and its poll schedule.
    let list = b.get("/ui/operations?state=accepted").await;
    assert_eq!(list.status, 200, "{}", list.body);
    assert_security_headers(&list);
    for wanted in [
        "lr-1",
        "<th>operation id</th>",
        remote.as_str(),
        "state-accepted",
        "next poll ",
    ] {
        assert!(list.body.contains(wanted), "{wanted}: {}", list.body);
    }
    let cause = b.get("/ui/operations?cause=in_progress").await;
    assert!(cause.body.contains("lr-1"), "{}", cause.body);

    // Its page: the operation id, the deadline, the acceptance as text, how it is known.
    let page = b.get(&format!("/ui/operations/{id}")).await;
    assert_eq!(page.status, 200, "{}", page.body);
    assert_security_headers(&page);
    for wanted in [
        "<th>operation id</th>",
        remote.as_str(),
        "<th>poll deadline</th>",
        "<th>verified by</th><td>dispatch</td>",
        "<h2>Acceptance</h2>",
        "&quot;status_url&quot;",
        "&lt;script&gt;alert(7)&lt;/script&gt;",
        "Recheck (poll now)",
        "Poll now",
    ] {
        assert!(page.body.contains(wanted), "{wanted}: {}", page.body);
    }
    assert!(!page.body.contains("<script>alert(7)"), "{}", page.body);

    // "Poll now": the status is read at once (the schedule's next poll is 30 s away or more).
    let before = env.status_reads(key).await;
    let csrf = input(&page.body, "csrf");
    let form = &page.body[page.body.find("/recheck\"").expect("the recheck form")..];
    let request_id = input(form, "request_id");
    let r = b
        .post(
            &format!("/ui/operations/{id}/recheck"),
            &[
                ("csrf", &csrf),
                ("request_id", &request_id),
                ("reason", "is the deploy done?"),
            ],
        )
        .await;
    assert_eq!(r.status, 303, "{}", r.body);
    assert_eq!(
        r.headers["location"].to_str().unwrap(),
        format!("/ui/operations/{id}?done=recheck")
    );
    e2e::wait_for(
        "the recheck's status read",
        Duration::from_secs(10),
        || async { (env.status_reads(key).await > before).then_some(()) },
    )
    .await;
    let after = page_with(
        &mut b,
        &format!("/ui/operations/{id}?done=recheck"),
        &["still running", "last poll ", "poll</span>"],
    )
    .await;
    assert!(after.contains("Rechecked"), "{after}");
    assert!(
        after.contains("recheck by alice: is the deploy done?"),
        "{after}"
    );
    assert!(after.contains("operator:alice"), "{after}");
    // The timeline marks the acceptance and the poll.
    assert!(
        after.contains("<span class=\"step\">accepted</span>"),
        "{after}"
    );
    assert!(
        after.contains("<span class=\"step\">poll</span>"),
        "{after}"
    );
    // Still accepted (the job is stuck); the list says what the last poll said, and when.
    assert_eq!(env.state("north", "lr-1").await, "accepted");
    let list = b.get("/ui/operations?state=accepted&tool=deploy").await;
    assert!(
        list.body.contains("last poll ") && list.body.contains("still running"),
        "{}",
        list.body
    );
    // A poll is a read: one write, one job.
    assert_eq!(env.writes(key).await, 1);
    assert_eq!(env.async_jobs(key).await, 1);
    drop(w);
    cleanup(env).await;
}

/// A bulk recheck of a filtered set of accepted operations polls each of them now (and only
/// them); a bulk fail of an accepted one stops its polling, as the dry run says.
#[tokio::test]
async fn a_bulk_recheck_of_accepted_operations_polls_each_of_them() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let w = Worker::start(&env, "w", &console_worker(async_tools(&env, ds.port))).await;
    let port = w.admin_port.unwrap();
    let mut agent = Agent::new(&env, &["north"]).await;
    let ids = ["bulk-1", "bulk-2", "bulk-3"];
    for action_id in ids.iter().chain(&["other-1"]) {
        stuck(&mut agent, &ds, &env, "north", action_id).await;
    }
    let mut before = Vec::new();
    for action_id in ids.iter().chain(&["other-1"]) {
        before.push(env.status_reads(&format!("north:{action_id}")).await);
    }
    let ledger = Ledger::from_pool(env.pool.clone());
    let mut b = Browser::sign_in(port, ADMIN, "alice").await;

    let list = b.get("/ui/operations?state=accepted").await;
    assert!(
        list.body.contains("Recheck or fail all of these"),
        "{}",
        list.body
    );
    let dry = b.get("/ui/bulk?state=accepted&q=bulk-").await;
    assert_eq!(dry.status, 200, "{}", dry.body);
    assert!(
        dry.body.contains(
            "<td><span class=\"state state-accepted\">accepted</span></td><td class=\"num\">3</td>"
        ),
        "{}",
        dry.body
    );
    assert!(dry.body.contains("polls its status now"), "{}", dry.body);
    let csrf = input(&dry.body, "csrf");
    let filter = input(&dry.body, "filter");
    assert_eq!(filter, "state=accepted&q=bulk-");
    let request_id = input(&dry.body, "request_id");
    // A filter that lost a field on the way (`&amp;` left unread) is refused, not widened.
    let mangled = b
        .post(
            "/ui/bulk",
            &[
                ("csrf", csrf.as_str()),
                ("request_id", "mangled-1"),
                ("filter", "state=accepted&amp;q=bulk-"),
                ("action", "fail"),
                ("reason", "this must never fail other-1"),
            ],
        )
        .await;
    assert_eq!(mangled.status, 400, "{}", mangled.body);
    assert!(mangled.body.contains("amp;q"), "{}", mangled.body);
    assert!(ledger.recent_jobs(10).await.unwrap().is_empty());
    let r = b
        .post(
            "/ui/bulk",
            &[
                ("csrf", csrf.as_str()),
                ("request_id", &request_id),
                ("filter", &filter),
                ("action", "recheck"),
                ("reason", "are the deploys done?"),
                ("cap", "10"),
            ],
        )
        .await;
    assert_eq!(r.status, 303, "{}", r.body);
    let location = r.headers["location"].to_str().unwrap().to_string();
    let job_id: i64 = location.rsplit('/').next().unwrap().parse().unwrap();
    let job = e2e::wait_for("the bulk recheck", T, || async {
        ledger
            .job(job_id)
            .await
            .unwrap()
            .filter(|j| j.status == "finished")
    })
    .await;
    assert_eq!(
        (job.total, job.done, job.skipped, job.refused),
        (3, 3, 0, 0),
        "{job:?}"
    );
    for (i, action_id) in ids.iter().enumerate() {
        let key = format!("north:{action_id}");
        e2e::wait_for(
            &format!("{action_id} polled"),
            Duration::from_secs(10),
            || async { (env.status_reads(&key).await > before[i]).then_some(()) },
        )
        .await;
        assert_eq!(env.state("north", action_id).await, "accepted");
        assert_eq!(env.writes(&key).await, 1);
    }
    assert_eq!(
        env.status_reads("north:other-1").await,
        before[3],
        "outside the filter: not polled"
    );
    let page = b.get(&location).await;
    assert!(page.body.contains("now accepted"), "{}", page.body);

    // A bulk fail of one accepted operation (its poll over): failed, never written again.
    e2e::wait_for("bulk-3's poll over", T, || async {
        (!leased(&env, "north", "bulk-3").await).then_some(())
    })
    .await;
    let dry = b.get("/ui/bulk?state=accepted&q=bulk-3").await;
    let r = b
        .post(
            "/ui/bulk",
            &[
                ("csrf", csrf.as_str()),
                ("request_id", &input(&dry.body, "request_id")),
                ("filter", &input(&dry.body, "filter")),
                ("action", "fail"),
                ("reason", "the deploy team cancelled operation by hand"),
                ("cap", "10"),
            ],
        )
        .await;
    assert_eq!(r.status, 303, "{}", r.body);
    let job_id: i64 = r.headers["location"]
        .to_str()
        .unwrap()
        .rsplit('/')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let job = e2e::wait_for("the bulk fail", T, || async {
        ledger
            .job(job_id)
            .await
            .unwrap()
            .filter(|j| j.status == "finished")
    })
    .await;
    assert_eq!((job.total, job.done), (1, 1), "{job:?}");
    assert_eq!(env.state("north", "bulk-3").await, "failed");
    assert_eq!(env.state("north", "bulk-2").await, "accepted");
    assert_eq!(env.writes("north:bulk-3").await, 1);
    drop(w);
    cleanup(env).await;
}

const ALICE_TOKEN: &str = "alice-approver-token-1234";

/// Approval in the console: an approver signs in with their token (its name is theirs), sees
/// the queue and a waiting intent's exact arguments and fingerprint (hostile strings as text),
/// and approves it through the page's form: it runs once. A forged fingerprint and a form
/// without the CSRF token change nothing; the admin and a tenant read (the tenant its own) and
/// cannot decide; an approver's session opens no other page.
#[tokio::test]
async fn an_approver_approves_from_the_console_and_nobody_else_can() {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let tools = env.standard_tools(ds.port, "approval = \"required\"\n");
    let options =
        console_worker(tools).env("WORKER_APPROVER_TOKENS", &format!("alice={ALICE_TOKEN}"));
    let w = Worker::start(&env, "w", &options).await;
    let port = w.admin_port.unwrap();
    let mut agent = Agent::new(&env, &["north", "south"]).await;
    let hostile = json!({
        "amount_cents": 25000,
        "note": "<script>alert(1)</script>\"'{}",
        "rtl": "\u{202e}lave",
        "big": 12345678901234567890u64,
    });
    agent.request("north", "pay-1", "refund", hostile).await;
    agent
        .request("south", "pay-s1", "refund", json!({"amount_cents": 1}))
        .await;
    agent.until("north", "pay-1", Status::Pending, T).await;
    agent.until("south", "pay-s1", Status::Pending, T).await;
    assert_eq!(env.state("north", "pay-1").await, "awaiting_approval");
    let fp = env.operation("north", "pay-1").await.unwrap().fingerprint;
    let id = operation_id(&env, "north", "pay-1").await;
    let detail = "/ui/approvals/north/pay-1";

    // The approver lands on the queue; its nav is the queue only.
    let mut alice = Browser::new(port);
    let form = alice.get("/ui/login").await;
    let csrf = input(&form.body, "csrf");
    let r = alice
        .post("/ui/login", &[("csrf", &csrf), ("token", ALICE_TOKEN)])
        .await;
    assert_eq!(r.status, 303, "{}", r.body);
    assert_eq!(r.headers["location"], "/ui/approvals");
    let queue = alice.get("/ui/approvals").await;
    assert_eq!(queue.status, 200, "{}", queue.body);
    assert_security_headers(&queue);
    assert!(
        queue.body.contains("pay-1") && queue.body.contains("pay-s1"),
        "{}",
        queue.body
    );
    assert!(
        queue.body.contains("approver <strong>alice</strong>"),
        "{}",
        queue.body
    );
    assert!(
        !queue.body.contains("href=\"/ui/operations\""),
        "{}",
        queue.body
    );
    assert!(!queue.body.contains(ALICE_TOKEN));
    let overview = alice.get("/ui/overview").await;
    assert_eq!(overview.status, 200, "{}", overview.body);
    assert!(
        overview.body.contains("waiting for approval"),
        "{}",
        overview.body
    );
    assert!(
        !overview.body.contains("unresolved"),
        "an approver reads no operation"
    );

    // The exact arguments, as text, and the fingerprint the form will name.
    let page = alice.get(detail).await;
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(page.body.contains(&fp), "{}", page.body);
    assert_eq!(input(&page.body, "fingerprint"), fp);
    assert!(
        page.body.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{}",
        page.body
    );
    assert!(!page.body.contains("<script>"), "{}", page.body);
    assert!(page.body.contains("\\u{202e}lave") && !page.body.contains('\u{202e}'));
    assert!(page.body.contains("12345678901234567890"), "{}", page.body);
    let csrf = input(&page.body, "csrf");
    let request_id = input(&page.body, "request_id");

    // An approver's session opens nothing else, and acts on nothing else.
    for path in [
        "/ui/operations".to_string(),
        format!("/ui/operations/{id}"),
        "/ui/jobs".to_string(),
        "/ui/bulk".to_string(),
        "/ui/dead-letters".to_string(),
    ] {
        let r = alice.get(&path).await;
        assert_eq!(r.status, 403, "{path}: {}", r.body);
        assert!(!r.body.contains("pay-s1"), "{path}");
    }
    for (path, fields) in [
        (
            format!("/ui/operations/{id}/fail"),
            vec![("evidence", "by the approver's session")],
        ),
        (
            format!("/ui/operations/{id}/recheck"),
            vec![("reason", "x")],
        ),
        (
            "/ui/bulk".to_string(),
            vec![("action", "fail"), ("reason", "everything at once")],
        ),
        ("/ui/dead-letters".to_string(), vec![("action", "discard")]),
    ] {
        let mut fields = fields;
        fields.extend([
            ("csrf", csrf.as_str()),
            ("request_id", "approver-elsewhere"),
        ]);
        let r = alice.post(&path, &fields).await;
        assert_eq!(r.status, 403, "{path}: {}", r.body);
    }

    // A forged fingerprint is refused with its reason, and nothing changes.
    let forged = "f".repeat(fp.len());
    let r = alice
        .post(
            detail,
            &[
                ("csrf", &csrf),
                ("request_id", "forged-1"),
                ("fingerprint", &forged),
                ("reason", "looks right"),
                ("decision", "approve"),
            ],
        )
        .await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(
        r.body.contains("approve refused") && r.body.contains("fingerprint"),
        "{}",
        r.body
    );
    // Without the CSRF token: refused.
    let r = alice
        .post(
            detail,
            &[
                ("request_id", "no-csrf-1"),
                ("fingerprint", &fp),
                ("reason", "looks right"),
                ("decision", "approve"),
            ],
        )
        .await;
    assert_eq!(r.status, 403, "{}", r.body);
    assert_eq!(env.state("north", "pay-1").await, "awaiting_approval");

    // The admin reads every tenant's queue and cannot decide.
    let mut admin = Browser::sign_in(port, ADMIN, "root").await;
    let overview = admin.get("/ui/overview").await;
    assert!(
        overview.body.contains("waiting for approval"),
        "{}",
        overview.body
    );
    assert!(
        overview.body.contains("href=\"/ui/approvals\""),
        "{}",
        overview.body
    );
    let queue = admin.get("/ui/approvals").await;
    assert!(
        queue.body.contains("pay-1") && queue.body.contains("pay-s1"),
        "{}",
        queue.body
    );
    let page = admin.get(detail).await;
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(
        page.body.contains(&fp) && !page.body.contains("name=\"fingerprint\""),
        "{}",
        page.body
    );
    let admin_csrf = input(&page.body, "csrf");
    let r = admin
        .post(
            detail,
            &[
                ("csrf", &admin_csrf),
                ("request_id", "admin-1"),
                ("fingerprint", &fp),
                ("reason", "I am the admin"),
                ("decision", "approve"),
            ],
        )
        .await;
    assert_eq!(r.status, 403, "{}", r.body);

    // A tenant reads its own only and cannot decide.
    let mut south = Browser::sign_in(port, SOUTH_TOKEN, "").await;
    let queue = south.get("/ui/approvals").await;
    assert!(
        queue.body.contains("pay-s1") && !queue.body.contains("pay-1<"),
        "{}",
        queue.body
    );
    assert!(
        !queue.body.contains("/ui/approvals/north/"),
        "{}",
        queue.body
    );
    assert_eq!(south.get(detail).await.status, 404);
    let page = south.get("/ui/approvals/south/pay-s1").await;
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(!page.body.contains("name=\"fingerprint\""), "{}", page.body);
    let south_csrf = input(&page.body, "csrf");
    let south_fp = env.operation("south", "pay-s1").await.unwrap().fingerprint;
    for path in [detail, "/ui/approvals/south/pay-s1"] {
        let r = south
            .post(
                path,
                &[
                    ("csrf", &south_csrf),
                    ("request_id", "tenant-1"),
                    ("fingerprint", &south_fp),
                    ("reason", "my own"),
                    ("decision", "approve"),
                ],
            )
            .await;
        assert_eq!(r.status, 403, "{path}: {}", r.body);
    }
    assert_eq!(env.state("north", "pay-1").await, "awaiting_approval");
    assert_eq!(env.state("south", "pay-s1").await, "awaiting_approval");
    assert_eq!(
        env.mutations("north:pay-1").await,
        0,
        "sent before approval"
    );

    // The approver approves through the form: it runs, once.
    let fields = [
        ("csrf", csrf.as_str()),
        ("request_id", request_id.as_str()),
        ("fingerprint", fp.as_str()),
        ("reason", "checked the order"),
        ("decision", "approve"),
    ];
    let r = alice.post(detail, &fields).await;
    assert_eq!(r.status, 303, "{}", r.body);
    assert_eq!(r.headers["location"], format!("{detail}?done=approve"));
    agent.succeeded("north", "pay-1").await;
    assert_eq!(env.mutations("north:pay-1").await, 1);
    let r = alice.post(detail, &fields).await;
    assert_eq!(r.headers["location"], format!("{detail}?done=repeated"));
    let page = alice.get(&format!("{detail}?done=approve")).await;
    assert!(page.body.contains("Approved"), "{}", page.body);
    assert!(page.body.contains("state-succeeded"), "{}", page.body);
    assert!(
        !page.body.contains("name=\"fingerprint\""),
        "no form once decided"
    );
    let actors: Vec<String> = sqlx::query_scalar(
        "SELECT coalesce(actor, '') FROM operation_history WHERE operation_id = $1 ORDER BY id",
    )
    .bind(id)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert!(actors.iter().any(|a| a == "operator:alice"), "{actors:?}");
    // Approving again (a new form) is refused with its reason.
    let r = alice
        .post(
            detail,
            &[
                ("csrf", &csrf),
                ("request_id", "again-1"),
                ("fingerprint", &fp),
                ("reason", "again"),
                ("decision", "approve"),
            ],
        )
        .await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(r.body.contains("awaiting_approval"), "{}", r.body);
    assert_eq!(env.mutations("north:pay-1").await, 1);

    // A rejection fails the other one without sending it.
    let page = alice.get("/ui/approvals/south/pay-s1").await;
    let r = alice
        .post(
            "/ui/approvals/south/pay-s1",
            &[
                ("csrf", &csrf),
                ("request_id", &input(&page.body, "request_id")),
                ("fingerprint", &south_fp),
                ("reason", "not this one"),
                ("decision", "reject"),
            ],
        )
        .await;
    assert_eq!(r.status, 303, "{}", r.body);
    agent.until("south", "pay-s1", Status::Failed, T).await;
    assert_eq!(env.mutations("south:pay-s1").await, 0);
    let queue = alice.get("/ui/approvals").await;
    assert!(
        queue.body.contains("Nothing waits for approval"),
        "{}",
        queue.body
    );

    // Signing out works from an approver's session.
    let r = alice.post("/ui/logout", &[("csrf", &csrf)]).await;
    assert_eq!(r.status, 303, "{}", r.body);
    assert_eq!(alice.get("/ui/approvals").await.status, 303);
    drop(w);
    cleanup(env).await;
}
