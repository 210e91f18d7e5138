//! Console sessions without server-side state: a signed cookie that every worker behind one
//! address can check, and the CSRF tokens derived from it.
//!
//! The cookie is `hex(payload).hex(mac)`, the payload a small JSON object: who (`admin`,
//! `tenant:<name>` or `approver:<name>`, the approver token's name), the operator's name
//! (admins), the expiry (unix seconds), a random session id and a fingerprint of the token the
//! session was opened with; the MAC is HMAC-SHA256 under the console key. A cookie is accepted
//! only when its MAC matches (constant time), it has not expired, its expiry is no further away
//! than the session lifetime, and the token it was opened with is still the principal's token:
//! rotating a tenant's or an approver's token (or removing it) ends that principal's sessions
//! even with a fixed `WORKER_CONSOLE_SECRET`.
//!
//! The key is SHA-256 of `WORKER_CONSOLE_SECRET` when set; otherwise it is derived from the
//! admin, tenant and approver tokens, so workers with the same tokens agree and rotating any
//! token ends every session. The CSRF token of a session is HMAC(key, `csrf` + session id); the
//! sign-in form's is HMAC(key, `login` + a nonce kept in a short-lived cookie), the nonce being
//! the form's issue time and a random id, so the MAC covers the time: a form older than
//! [`LOGIN_FORM_SECS`] is refused whatever its cookie says.
//!
//! The little server-side state there is lives in the ledger
//! ([`crate::ledger::console`]): a sign-in form's nonce is spent when the form is submitted (a
//! form works once), and a session's id when it signs out (a copy of the cookie taken before
//! stops working on every worker).

use sha2::{Digest, Sha256};

use crate::config::auth::{Principal, Tokens};

/// The session cookie's name.
pub const COOKIE: &str = "iw_session";
/// The sign-in form's nonce cookie.
pub const LOGIN_COOKIE: &str = "iw_login";
/// How long a sign-in form stays usable, seconds (it is also used once only).
pub const LOGIN_FORM_SECS: i64 = 600;

pub use kit::secret::hmac_sha256;

fn hex(bytes: &[u8]) -> String {
    crate::amqp::hex(bytes)
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

/// Equality of two MACs given as text, in constant time.
fn same(a: &str, b: &str) -> bool {
    kit::secret::constant_time_eq(a.as_bytes(), b.as_bytes())
}

/// The console's signing key.
#[derive(Clone)]
pub struct Keys {
    key: [u8; 32],
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys(<redacted>)")
    }
}

/// A signed-in user, as the cookie says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub principal: Principal,
    /// The name an admin signed in with: recorded as `operator:<name>` on every action.
    pub operator: Option<String>,
    /// Unix seconds.
    pub expires: i64,
    /// Random, per sign-in; the CSRF token derives from it.
    pub id: String,
}

/// What a session may read: every tenant's operations, dead letters and counts (the admin),
/// one tenant's (a tenant), or none of them (an approver, who sees the approval queue only).
/// Every page that reads operations asks this, so an approver never falls through to what the
/// admin sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reads<'a> {
    Everything,
    Tenant(&'a str),
    Nothing,
}

impl Session {
    pub fn is_admin(&self) -> bool {
        self.principal == Principal::Admin
    }

    /// The tenant of a tenant session (None for the admin and for an approver: never a read
    /// filter on its own, see [`Session::reads`]).
    pub fn tenant(&self) -> Option<&str> {
        match &self.principal {
            Principal::Tenant(t) => Some(t),
            Principal::Admin | Principal::Approver(_) => None,
        }
    }

    /// The name of an approver session: recorded with each of its decisions.
    pub fn approver(&self) -> Option<&str> {
        match &self.principal {
            Principal::Approver(a) => Some(a),
            Principal::Admin | Principal::Tenant(_) => None,
        }
    }

    /// Whose operations, dead letters and counts this session may read.
    pub fn reads(&self) -> Reads<'_> {
        match &self.principal {
            Principal::Admin => Reads::Everything,
            Principal::Tenant(t) => Reads::Tenant(t),
            Principal::Approver(_) => Reads::Nothing,
        }
    }

    /// The tenant whose intents waiting for approval this session sees: its own for a tenant,
    /// None (every tenant's) for the admin and an approver.
    pub fn approvals_of(&self) -> Option<&str> {
        self.tenant()
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Payload {
    v: u8,
    /// `admin`, the tenant's name after `tenant:` or the approver's after `approver:`.
    p: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    o: Option<String>,
    e: i64,
    s: String,
    /// Fingerprint of the token the session was opened with.
    k: String,
}

/// Why a cookie was not accepted (never shown to the user in detail).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    Malformed,
    BadSignature,
    Expired,
    TokenChanged,
}

impl Keys {
    /// The key from `WORKER_CONSOLE_SECRET`, or derived from the tokens.
    pub fn new(secret: Option<&str>, tokens: &Tokens) -> Keys {
        let mut h = Sha256::new();
        match secret {
            Some(secret) => {
                h.update(b"intent-worker console key v1 secret\0");
                h.update(secret.as_bytes());
            }
            None => {
                h.update(b"intent-worker console key v1 tokens\0");
                h.update(tokens.admin.as_deref().unwrap_or("").as_bytes());
                for (tenant, token) in &tokens.tenants {
                    h.update([0]);
                    h.update(tenant.as_bytes());
                    h.update([0]);
                    h.update(token.as_bytes());
                }
                // Approvers after a marker of their own (none: the key of a worker without
                // approvers is what it was before they existed).
                for (name, token) in &tokens.approvers {
                    h.update([1]);
                    h.update(name.as_bytes());
                    h.update([1]);
                    h.update(token.as_bytes());
                }
            }
        }
        Keys {
            key: h.finalize().into(),
        }
    }

    fn mac(&self, purpose: &str, data: &[u8]) -> String {
        let mut message = Vec::with_capacity(purpose.len() + 1 + data.len());
        message.extend_from_slice(purpose.as_bytes());
        message.push(0);
        message.extend_from_slice(data);
        hex(&hmac_sha256(&self.key, &message))
    }

    fn token_print(&self, token: &str) -> String {
        self.mac("token", token.as_bytes())[..32].to_string()
    }

    /// A new session for `principal` (signed in with `token`) and its cookie value.
    pub fn issue(
        &self,
        principal: Principal,
        operator: Option<String>,
        token: &str,
        now: i64,
        lifetime_secs: i64,
    ) -> (Session, String) {
        let id = hex(uuid::Uuid::new_v4().as_bytes());
        let payload = Payload {
            v: 1,
            p: match &principal {
                Principal::Admin => "admin".into(),
                Principal::Tenant(t) => format!("tenant:{t}"),
                Principal::Approver(a) => format!("approver:{a}"),
            },
            o: operator.clone(),
            e: now + lifetime_secs,
            s: id.clone(),
            k: self.token_print(token),
        };
        let json = serde_json::to_vec(&payload).expect("payloads serialize");
        let cookie = format!("{}.{}", hex(&json), self.mac("session", &json));
        (
            Session {
                principal,
                operator,
                expires: payload.e,
                id,
            },
            cookie,
        )
    }

    /// The session a cookie value carries, if it is valid now.
    pub fn verify(
        &self,
        cookie: &str,
        now: i64,
        lifetime_secs: i64,
        tokens: &Tokens,
    ) -> Result<Session, Refused> {
        let (payload_hex, mac) = cookie.split_once('.').ok_or(Refused::Malformed)?;
        let json = unhex(payload_hex).ok_or(Refused::Malformed)?;
        if !same(&self.mac("session", &json), mac) {
            return Err(Refused::BadSignature);
        }
        let p: Payload = serde_json::from_slice(&json).map_err(|_| Refused::Malformed)?;
        if p.v != 1 {
            return Err(Refused::Malformed);
        }
        if p.e <= now || p.e > now + lifetime_secs {
            return Err(Refused::Expired);
        }
        let principal = parse_principal(&p.p).ok_or(Refused::Malformed)?;
        let token = tokens.token_of(&principal).ok_or(Refused::TokenChanged)?;
        if !same(&self.token_print(token), &p.k) {
            return Err(Refused::TokenChanged);
        }
        Ok(Session {
            principal,
            operator: p.o,
            expires: p.e,
            id: p.s,
        })
    }

    /// The CSRF token every state-changing form of `session` carries.
    pub fn csrf(&self, session: &Session) -> String {
        self.mac("csrf", session.id.as_bytes())
    }

    pub fn check_csrf(&self, session: &Session, presented: Option<&str>) -> bool {
        presented.is_some_and(|p| same(&self.csrf(session), p))
    }

    /// A fresh nonce for a sign-in form issued at `now` (kept in [`LOGIN_COOKIE`]: the time and
    /// a random id) and the form's token.
    pub fn login_form(&self, now: i64) -> (String, String) {
        let nonce = format!("{now}-{}", hex(uuid::Uuid::new_v4().as_bytes()));
        let token = self.mac("login", nonce.as_bytes());
        (nonce, token)
    }

    /// Whether a sign-in form's token matches its nonce and the form is not older than
    /// [`LOGIN_FORM_SECS`] at `now` (nor issued in the future, past a minute of clock skew
    /// between workers). Whether it was already used is the ledger's to say.
    pub fn check_login(&self, nonce: Option<&str>, presented: Option<&str>, now: i64) -> bool {
        let (Some(n), Some(p)) = (nonce, presented) else {
            return false;
        };
        let Some(issued) = n.split_once('-').and_then(|(t, _)| t.parse::<i64>().ok()) else {
            return false;
        };
        same(&self.mac("login", n.as_bytes()), p)
            && issued <= now + 60
            && now - issued <= LOGIN_FORM_SECS
    }
}

/// The principal a payload names: `admin`, `tenant:<name>` or `approver:<name>` (a name never
/// empty).
fn parse_principal(p: &str) -> Option<Principal> {
    if p == "admin" {
        return Some(Principal::Admin);
    }
    let named = |prefix: &str| {
        p.strip_prefix(prefix)
            .filter(|n| !n.is_empty())
            .map(str::to_string)
    };
    named("tenant:")
        .map(Principal::Tenant)
        .or_else(|| named("approver:").map(Principal::Approver))
}

/// The value of cookie `name` in a `Cookie` header.
pub fn cookie_value<'h>(header: &'h str, name: &str) -> Option<&'h str> {
    header
        .split(';')
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.trim())
}

/// A `Set-Cookie` value: HttpOnly, SameSite=Strict, path `/ui`, `Secure` when asked.
pub fn set_cookie(name: &str, value: &str, max_age_secs: i64, secure: bool) -> String {
    format!(
        "{name}={value}; Path=/ui; Max-Age={max_age_secs}; HttpOnly; SameSite=Strict{}",
        if secure { "; Secure" } else { "" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn tokens() -> Tokens {
        Tokens::new(
            Some("admin-token-0123456789".into()),
            BTreeMap::from([("north".to_string(), "north-token".to_string())]),
        )
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test case 1.
        let mac = hmac_sha256(&[0x0b; 20], b"Hi There");
        assert_eq!(
            hex(&mac),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        // Test case 2.
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(
            hex(&mac),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Test case 6: a key longer than the block.
        let mac = hmac_sha256(
            &[0xaa; 131],
            b"Test Using Larger Than Block-Size Key - Hash Key First",
        );
        assert_eq!(
            hex(&mac),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn a_session_round_trips_until_it_expires() {
        let t = tokens();
        let keys = Keys::new(None, &t);
        let (session, cookie) = keys.issue(
            Principal::Admin,
            Some("alice".into()),
            "admin-token-0123456789",
            1_000,
            3_600,
        );
        assert!(session.is_admin());
        assert_eq!(keys.verify(&cookie, 1_001, 3_600, &t), Ok(session.clone()));
        assert_eq!(
            keys.verify(&cookie, 4_600, 3_600, &t),
            Err(Refused::Expired)
        );
        // A lifetime shortened since the cookie was issued shortens it too.
        assert_eq!(keys.verify(&cookie, 1_001, 60, &t), Err(Refused::Expired));
        // Another worker with the same tokens accepts it.
        assert!(Keys::new(None, &tokens())
            .verify(&cookie, 1_001, 3_600, &t)
            .is_ok());
    }

    #[test]
    fn a_tampered_or_foreign_cookie_is_refused() {
        let t = tokens();
        let keys = Keys::new(None, &t);
        let (_, cookie) = keys.issue(
            Principal::Tenant("north".into()),
            None,
            "north-token",
            1_000,
            3_600,
        );
        let (payload, mac) = cookie.split_once('.').unwrap();
        // Rewrite the principal to admin, keep the MAC.
        let json = String::from_utf8(unhex(payload).unwrap()).unwrap();
        let forged = json.replace("tenant:north", "admin");
        let forged = format!("{}.{mac}", hex(forged.as_bytes()));
        assert_eq!(
            keys.verify(&forged, 1_001, 3_600, &t),
            Err(Refused::BadSignature)
        );
        let mut flipped = cookie.clone().into_bytes();
        let last = flipped.len() - 1;
        flipped[last] = if flipped[last] == b'0' { b'1' } else { b'0' };
        let flipped = String::from_utf8(flipped).unwrap();
        assert_eq!(
            keys.verify(&flipped, 1_001, 3_600, &t),
            Err(Refused::BadSignature)
        );
        for junk in ["", ".", "zz.zz", "abc", "00.00"] {
            assert!(keys.verify(junk, 1_001, 3_600, &t).is_err(), "{junk}");
        }
        let other = Keys::new(Some(&"s".repeat(32)), &t);
        assert_eq!(
            other.verify(&cookie, 1_001, 3_600, &t),
            Err(Refused::BadSignature)
        );
    }

    #[test]
    fn rotating_a_token_ends_its_sessions() {
        let t = tokens();
        let secret = "a-console-secret-of-32-characters!";
        let keys = Keys::new(Some(secret), &t);
        let (_, north) = keys.issue(
            Principal::Tenant("north".into()),
            None,
            "north-token",
            0,
            60,
        );
        let (_, admin) = keys.issue(
            Principal::Admin,
            Some("a".into()),
            "admin-token-0123456789",
            0,
            60,
        );
        let rotated = Tokens::new(
            t.admin.clone(),
            BTreeMap::from([("north".to_string(), "north-token-2".to_string())]),
        );
        // With a fixed secret, only the rotated token's sessions end.
        let keys = Keys::new(Some(secret), &rotated);
        assert_eq!(
            keys.verify(&north, 1, 60, &rotated),
            Err(Refused::TokenChanged)
        );
        assert!(keys.verify(&admin, 1, 60, &rotated).is_ok());
        // Without one, the key itself changes: every session ends.
        let derived = Keys::new(None, &t)
            .issue(Principal::Admin, None, "admin-token-0123456789", 0, 60)
            .1;
        assert_eq!(
            Keys::new(None, &rotated).verify(&derived, 1, 60, &rotated),
            Err(Refused::BadSignature)
        );
        // A removed tenant's session ends.
        let gone = Tokens::new(t.admin.clone(), BTreeMap::new());
        let keys = Keys::new(Some(secret), &gone);
        assert_eq!(
            keys.verify(&north, 1, 60, &gone),
            Err(Refused::TokenChanged)
        );
    }

    fn with_alice() -> Tokens {
        tokens().with_approvers(BTreeMap::from([(
            "alice".to_string(),
            "alice-approver-token-1234".to_string(),
        )]))
    }

    #[test]
    fn an_approver_session_round_trips_and_reads_nothing_but_the_approval_queue() {
        let t = with_alice();
        for secret in [None, Some("a-console-secret-of-32-characters!")] {
            let keys = Keys::new(secret, &t);
            let principal = t.identify("alice-approver-token-1234").unwrap();
            assert_eq!(principal, Principal::Approver("alice".into()));
            let (session, cookie) =
                keys.issue(principal, None, "alice-approver-token-1234", 1_000, 3_600);
            let back = keys.verify(&cookie, 1_001, 3_600, &t).unwrap();
            assert_eq!(back, session);
            assert_eq!(back.approver(), Some("alice"));
            assert!(!back.is_admin());
            assert_eq!(back.tenant(), None);
            assert_eq!(back.reads(), Reads::Nothing);
            assert_eq!(back.approvals_of(), None);
            assert_ne!(keys.csrf(&back), "");
        }
        // The other principals' models.
        let keys = Keys::new(None, &t);
        let (admin, _) = keys.issue(
            Principal::Admin,
            Some("a".into()),
            "admin-token-0123456789",
            0,
            60,
        );
        assert_eq!(
            (admin.reads(), admin.approver(), admin.tenant()),
            (Reads::Everything, None, None)
        );
        let (north, _) = keys.issue(
            Principal::Tenant("north".into()),
            None,
            "north-token",
            0,
            60,
        );
        assert_eq!(
            (north.reads(), north.approver(), north.approvals_of()),
            (Reads::Tenant("north"), None, Some("north"))
        );
    }

    #[test]
    fn a_payload_names_one_principal_or_is_malformed() {
        assert_eq!(parse_principal("admin"), Some(Principal::Admin));
        assert_eq!(
            parse_principal("tenant:north"),
            Some(Principal::Tenant("north".into()))
        );
        assert_eq!(
            parse_principal("approver:alice"),
            Some(Principal::Approver("alice".into()))
        );
        // A tenant named like an approver stays a tenant.
        assert_eq!(
            parse_principal("tenant:approver:alice"),
            Some(Principal::Tenant("approver:alice".into()))
        );
        for bad in [
            "",
            "approver:",
            "tenant:",
            "approver",
            "Admin",
            "operator:alice",
        ] {
            assert_eq!(parse_principal(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn rotating_or_removing_an_approver_token_ends_its_sessions() {
        let t = with_alice();
        let secret = "a-console-secret-of-32-characters!";
        let keys = Keys::new(Some(secret), &t);
        let (_, alice) = keys.issue(
            Principal::Approver("alice".into()),
            None,
            "alice-approver-token-1234",
            0,
            60,
        );
        let (_, admin) = keys.issue(
            Principal::Admin,
            Some("a".into()),
            "admin-token-0123456789",
            0,
            60,
        );
        let rotated = tokens().with_approvers(BTreeMap::from([(
            "alice".to_string(),
            "alice-approver-token-5678".to_string(),
        )]));
        let keys = Keys::new(Some(secret), &rotated);
        assert_eq!(
            keys.verify(&alice, 1, 60, &rotated),
            Err(Refused::TokenChanged)
        );
        assert!(keys.verify(&admin, 1, 60, &rotated).is_ok());
        let removed = tokens();
        let keys = Keys::new(Some(secret), &removed);
        assert_eq!(
            keys.verify(&alice, 1, 60, &removed),
            Err(Refused::TokenChanged)
        );
        // Alice's token given to bob: the session names alice, who has no token any more.
        let renamed = tokens().with_approvers(BTreeMap::from([(
            "bob".to_string(),
            "alice-approver-token-1234".to_string(),
        )]));
        let keys = Keys::new(Some(secret), &renamed);
        assert_eq!(
            keys.verify(&alice, 1, 60, &renamed),
            Err(Refused::TokenChanged)
        );
        // Without a secret, the key itself changes with the approvers' tokens.
        let derived = Keys::new(None, &t)
            .issue(
                Principal::Approver("alice".into()),
                None,
                "alice-approver-token-1234",
                0,
                60,
            )
            .1;
        assert_eq!(
            Keys::new(None, &rotated).verify(&derived, 1, 60, &rotated),
            Err(Refused::BadSignature)
        );
        // An approver name forged into a tenant's cookie breaks the MAC.
        let keys = Keys::new(Some(secret), &t);
        let (_, north) = keys.issue(
            Principal::Tenant("north".into()),
            None,
            "north-token",
            0,
            60,
        );
        let (payload, mac) = north.split_once('.').unwrap();
        let json = String::from_utf8(unhex(payload).unwrap()).unwrap();
        let forged = json.replace("tenant:north", "approver:alice");
        let forged = format!("{}.{mac}", hex(forged.as_bytes()));
        assert_eq!(keys.verify(&forged, 1, 60, &t), Err(Refused::BadSignature));
    }

    #[test]
    fn csrf_tokens_belong_to_one_session() {
        let t = tokens();
        let keys = Keys::new(None, &t);
        let (a, _) = keys.issue(Principal::Admin, None, "admin-token-0123456789", 0, 60);
        let (b, _) = keys.issue(Principal::Admin, None, "admin-token-0123456789", 0, 60);
        assert_ne!(a.id, b.id);
        assert!(keys.check_csrf(&a, Some(&keys.csrf(&a))));
        assert!(!keys.check_csrf(&a, Some(&keys.csrf(&b))));
        assert!(!keys.check_csrf(&a, None));
        assert!(!keys.check_csrf(&a, Some("")));
        let (nonce, form) = keys.login_form(1_000);
        assert!(keys.check_login(Some(&nonce), Some(&form), 1_000));
        assert!(!keys.check_login(None, Some(&form), 1_000));
        assert!(!keys.check_login(Some(&nonce), Some(&keys.csrf(&a)), 1_000));
        assert!(!keys.check_login(Some(""), Some(&keys.mac("login", b"")), 1_000));
    }

    #[test]
    fn a_sign_in_form_expires_and_its_time_is_signed() {
        let keys = Keys::new(None, &tokens());
        let (nonce, form) = keys.login_form(1_000);
        assert!(keys.check_login(Some(&nonce), Some(&form), 1_000 + LOGIN_FORM_SECS));
        assert!(!keys.check_login(Some(&nonce), Some(&form), 1_001 + LOGIN_FORM_SECS));
        // Issued in the future (past the skew allowed between workers).
        assert!(!keys.check_login(Some(&nonce), Some(&form), 900));
        // A fresher time put into the cookie breaks the MAC.
        let (_, id) = nonce.split_once('-').unwrap();
        let younger = format!("{}-{id}", 1_000 + LOGIN_FORM_SECS);
        assert!(!keys.check_login(Some(&younger), Some(&form), 1_000 + LOGIN_FORM_SECS + 5));
        // A nonce without a time is refused even with its MAC.
        let bare = "abcdef";
        assert!(!keys.check_login(Some(bare), Some(&keys.mac("login", bare.as_bytes())), 1_000));
    }

    #[test]
    fn cookies_are_read_and_written_with_their_flags() {
        let h = "a=1; iw_session=abc.def ; b=2";
        assert_eq!(cookie_value(h, COOKIE), Some("abc.def"));
        assert_eq!(cookie_value(h, "c"), None);
        let c = set_cookie(COOKIE, "v", 60, false);
        assert!(
            c.contains("HttpOnly") && c.contains("SameSite=Strict") && c.contains("Max-Age=60")
        );
        assert!(!c.contains("Secure"));
        assert!(set_cookie(COOKIE, "v", 60, true).ends_with("; Secure"));
    }
}
