//! The failure budget of bearer tokens: how many wrong tokens a listener takes, from one client
//! and from everyone, before it stops checking them for a while. One budget is shared by every
//! route of a listener that accepts a token (the worker's admin API and its console sign-in; the
//! publisher's MCP gateway), so guessing costs the same whichever door is tried.
//!
//! Two token buckets, each holding at most `burst` failures and refilled at `per_sec`:
//! - **per client** (the connection's remote IP address, [`crate::http::Peer`]): one client
//!   guessing is refused early without slowing anyone else;
//! - **overall**: many clients guessing together are refused as well. While it is spent, every
//!   token presented on the listener is refused, good ones too: otherwise the answers would still
//!   tell a guess that is right from one that is wrong. Signed-in console sessions keep working.
//!
//! A request is [`FailureBudget::admit`]ted only while both its buckets hold a failure, and
//! admitting it spends one from both, so that many requests at once cannot all pass before any
//! has failed; it is answered `429 Too Many Requests` with `Retry-After` otherwise, before its
//! token is even compared. A good token gives its failure back ([`FailureBudget::forgive`]);
//! a wrong one keeps it spent. Nothing waits: no request, connection or form is held while a
//! failure is being paid for.
//!
//! Clients are remembered only while their bucket is not full again; at most
//! [`MAX_CLIENTS`] are tracked, and past that the ones that have refilled are forgotten first.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Most clients tracked at once (a few hundred kilobytes).
pub const MAX_CLIENTS: usize = 10_000;

/// The size and refill rate of one bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    /// Failures taken at once from a full bucket.
    pub burst: u32,
    /// Failures the bucket regains per second.
    pub per_sec: f64,
}

/// The budget's two rates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    pub per_client: Rate,
    pub overall: Rate,
}

impl Budget {
    /// The documented defaults: 10 failures at once per client, then one a second; 30 at once
    /// overall, then 5 a second. At 5 guesses a second, a token of the minimum length drawn
    /// from hex digits (16 of them, 2^64 values) would take longer than 10^11 years on average.
    pub const DEFAULT: Budget = Budget {
        per_client: Rate {
            burst: 10,
            per_sec: 1.0,
        },
        overall: Rate {
            burst: 30,
            per_sec: 5.0,
        },
    };
}

/// Why a request was refused, and when to come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    /// Whose budget is spent.
    pub scope: Scope,
    /// When the bucket holds a failure again (at least a second, rounded up).
    pub retry_after: Duration,
}

/// Which bucket refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Client,
    Overall,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Client => "client",
            Scope::Overall => "overall",
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn full(rate: Rate, now: Instant) -> Bucket {
        Bucket {
            tokens: f64::from(rate.burst),
            at: now,
        }
    }

    fn refill(&mut self, rate: Rate, now: Instant) {
        let gained = now.saturating_duration_since(self.at).as_secs_f64() * rate.per_sec;
        self.tokens = (self.tokens + gained).min(f64::from(rate.burst));
        self.at = now;
    }

    /// None while a failure is left; else how long until one is.
    fn wait(&self, rate: Rate) -> Option<Duration> {
        if self.tokens >= 1.0 {
            return None;
        }
        let secs = if rate.per_sec > 0.0 {
            ((1.0 - self.tokens) / rate.per_sec).ceil().max(1.0)
        } else {
            3600.0
        };
        Some(Duration::from_secs_f64(secs))
    }

    fn spend(&mut self) {
        self.tokens = (self.tokens - 1.0).max(0.0);
    }
}

struct State {
    overall: Bucket,
    clients: HashMap<IpAddr, Bucket>,
    /// When a refusal was last logged (one line a minute while refusing).
    logged: Option<Instant>,
}

/// The failure budget of one listener (see the module documentation).
pub struct FailureBudget {
    budget: Budget,
    state: Mutex<State>,
}

impl FailureBudget {
    pub fn new(budget: Budget) -> FailureBudget {
        FailureBudget {
            budget,
            state: Mutex::new(State {
                overall: Bucket::full(budget.overall, Instant::now()),
                clients: HashMap::new(),
                logged: None,
            }),
        }
    }

    /// Whether a token from `client` may be checked now; if so, one failure is spent from its
    /// bucket and the overall one until [`FailureBudget::forgive`] gives it back.
    pub fn admit(&self, client: IpAddr) -> Result<(), Refused> {
        let now = Instant::now();
        self.admit_at(client, now)?;
        self.failed_at(client, now);
        Ok(())
    }

    /// The token `client` was admitted with was good: its failure is given back.
    pub fn forgive(&self, client: IpAddr) {
        let mut s = crate::lock(&self.state);
        let (overall, per_client) = (self.budget.overall, self.budget.per_client);
        s.overall.tokens = (s.overall.tokens + 1.0).min(f64::from(overall.burst));
        if let Some(bucket) = s.clients.get_mut(&client) {
            bucket.tokens = (bucket.tokens + 1.0).min(f64::from(per_client.burst));
        }
    }

    fn admit_at(&self, client: IpAddr, now: Instant) -> Result<(), Refused> {
        let mut s = crate::lock(&self.state);
        s.overall.refill(self.budget.overall, now);
        let refused = if let Some(wait) = s.overall.wait(self.budget.overall) {
            Some(Refused {
                scope: Scope::Overall,
                retry_after: wait,
            })
        } else if let Some(bucket) = s.clients.get_mut(&client) {
            bucket.refill(self.budget.per_client, now);
            bucket.wait(self.budget.per_client).map(|wait| Refused {
                scope: Scope::Client,
                retry_after: wait,
            })
        } else {
            None
        };
        if let Some(r) = refused {
            if s.logged
                .is_none_or(|at| now.saturating_duration_since(at) >= Duration::from_secs(60))
            {
                s.logged = Some(now);
                tracing::warn!(
                    %client,
                    scope = r.scope.as_str(),
                    retry_after_secs = r.retry_after.as_secs(),
                    "token failure budget spent: tokens are refused unchecked (429) for now"
                );
            }
            return Err(r);
        }
        Ok(())
    }

    fn failed_at(&self, client: IpAddr, now: Instant) {
        let mut s = crate::lock(&self.state);
        let per_client = self.budget.per_client;
        s.overall.refill(self.budget.overall, now);
        s.overall.spend();
        if !s.clients.contains_key(&client) && s.clients.len() >= MAX_CLIENTS {
            // Forget the clients whose bucket is full again: they carry no debt.
            s.clients.retain(|_, b| {
                let mut b = *b;
                b.refill(per_client, now);
                b.tokens < f64::from(per_client.burst)
            });
            if s.clients.len() >= MAX_CLIENTS {
                // Every tracked client is in debt: the overall bucket still bounds guessing.
                s.clients.clear();
            }
        }
        let bucket = s
            .clients
            .entry(client)
            .or_insert_with(|| Bucket::full(per_client, now));
        bucket.refill(per_client, now);
        bucket.spend();
    }
}

impl Default for FailureBudget {
    fn default() -> FailureBudget {
        FailureBudget::new(Budget::DEFAULT)
    }
}

/// The least length of a bearer token the processes accept (characters). Length is what a
/// process can check; together with the failure budget it makes guessing hopeless (see
/// [`Budget::DEFAULT`]). Tokens should be random: `openssl rand -hex 24`.
pub const MIN_TOKEN_CHARS: usize = 16;

/// Refuses a token shorter than [`MIN_TOKEN_CHARS`] or with whitespace or control characters,
/// naming `what` (e.g. "WORKER_ADMIN_TOKEN") but never the token.
pub fn check_token(what: &str, token: &str) -> Result<(), String> {
    let chars = token.chars().count();
    if chars < MIN_TOKEN_CHARS {
        return Err(format!(
            "{what} is {chars} characters long; tokens need at least {MIN_TOKEN_CHARS} (a random \
             one: openssl rand -hex 24)"
        ));
    }
    if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("{what} contains whitespace or control characters"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    fn budget(client: (u32, f64), overall: (u32, f64)) -> FailureBudget {
        FailureBudget::new(Budget {
            per_client: Rate {
                burst: client.0,
                per_sec: client.1,
            },
            overall: Rate {
                burst: overall.0,
                per_sec: overall.1,
            },
        })
    }

    #[test]
    fn one_client_spends_its_own_burst_then_waits_for_the_refill() {
        let b = budget((3, 1.0), (100, 10.0));
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(b.admit_at(ip(1), t0), Ok(()));
            b.failed_at(ip(1), t0);
        }
        let refused = b.admit_at(ip(1), t0).unwrap_err();
        assert_eq!(refused.scope, Scope::Client);
        assert_eq!(refused.retry_after, Duration::from_secs(1));
        // Someone else is not slowed.
        assert_eq!(b.admit_at(ip(2), t0), Ok(()));
        // A second later the client has one failure again, and only one.
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(b.admit_at(ip(1), t1), Ok(()));
        b.failed_at(ip(1), t1);
        assert!(b.admit_at(ip(1), t1).is_err());
    }

    #[test]
    fn many_clients_together_spend_the_overall_bucket_and_everyone_waits() {
        let b = budget((10, 1.0), (4, 2.0));
        let t0 = Instant::now();
        for i in 0..4 {
            assert_eq!(b.admit_at(ip(i), t0), Ok(()));
            b.failed_at(ip(i), t0);
        }
        let refused = b.admit_at(ip(200), t0).unwrap_err();
        assert_eq!(refused.scope, Scope::Overall);
        assert_eq!(refused.retry_after, Duration::from_secs(1));
        assert_eq!(b.admit_at(ip(200), t0 + Duration::from_millis(500)), Ok(()));
    }

    #[test]
    fn admitting_spends_and_a_good_token_gives_it_back() {
        let b = budget((2, 0.0), (100, 0.0));
        // Two admitted at once, before either was checked: the third waits.
        assert!(b.admit(ip(1)).is_ok());
        assert!(b.admit(ip(1)).is_ok());
        assert!(b.admit(ip(1)).is_err());
        // Both were good tokens.
        b.forgive(ip(1));
        b.forgive(ip(1));
        assert!(b.admit(ip(1)).is_ok());
        assert!(b.admit(ip(1)).is_ok());
        // Forgiving never fills past the burst.
        for _ in 0..5 {
            b.forgive(ip(1));
        }
        assert!(b.admit(ip(1)).is_ok());
        assert!(b.admit(ip(1)).is_ok());
        assert!(b.admit(ip(1)).is_err());
    }

    #[test]
    fn the_clients_remembered_stay_bounded() {
        let b = budget((2, 1.0), (u32::MAX, 1e9));
        let t0 = Instant::now();
        for i in 0..(MAX_CLIENTS as u32 + 50) {
            let addr = IpAddr::from(std::net::Ipv4Addr::from(i));
            b.failed_at(addr, t0);
        }
        assert!(crate::lock(&b.state).clients.len() <= MAX_CLIENTS);
        // Refilled clients are forgotten first.
        let later = t0 + Duration::from_secs(10);
        b.failed_at(ip(250), later);
        assert!(crate::lock(&b.state).clients.len() <= MAX_CLIENTS);
    }

    #[test]
    fn short_or_blank_tokens_are_refused_without_being_named() {
        assert!(check_token("T", &"a".repeat(MIN_TOKEN_CHARS)).is_ok());
        let short = check_token("WORKER_ADMIN_TOKEN", "s3cret-short").unwrap_err();
        assert!(
            short.contains("WORKER_ADMIN_TOKEN is 12 characters"),
            "{short}"
        );
        assert!(!short.contains("s3cret"), "{short}");
        let spaced = check_token("T", "a token with spaces in it").unwrap_err();
        assert!(spaced.contains("whitespace"), "{spaced}");
    }
}
