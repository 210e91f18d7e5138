//! The generic HTTP adapter: one configured tool = one endpoint, its idempotency header, its
//! receipt rules and its recovery capability. No retries happen here — the ledger scheduler is
//! the only retry layer — so the client has no retry middleware and follows no redirects.

use std::time::{Duration, SystemTime};

use hyper::header::{HeaderMap, HeaderName, HeaderValue, ACCEPT, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Method, StatusCode};
use tracing::{Instrument as _, Span};

use super::client::{Client, Reply, SendError, Target};
use super::{receipt, status, BoxFuture, Request, ToolAdapter};
use crate::config::ToolConfig;
use crate::document::Document;
use crate::outcome::{Outcome, Polled};
use crate::recovery::Capability;

const EXCERPT: usize = 500;

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("tool {tool}: {reason}")]
    Invalid { tool: String, reason: String },
}

/// Adapter for one `[tools.<name>]` entry.
pub struct HttpAdapter {
    config: ToolConfig,
    client: Client,
    /// `config.url`, parsed once rather than on every write.
    target: Target,
    method: Method,
    headers: HeaderMap,
    idempotency_header: HeaderName,
    /// The header a write's deadline goes in (a tool with `absence_proof`).
    deadline_header: Option<HeaderName>,
    receipt: receipt::ReceiptRule,
    /// The async contract of a long-running tool, its pointers parsed.
    contract: Option<status::Contract>,
}

impl HttpAdapter {
    /// An adapter for one tool; `https://` URLs are verified against `trust`.
    pub fn new(config: ToolConfig, trust: &crate::tls::Trust) -> Result<HttpAdapter, BuildError> {
        let bad = |reason: String| BuildError::Invalid {
            tool: config.name.clone(),
            reason,
        };
        let client = Client::new(&config, trust).map_err(bad)?;
        let method =
            Method::from_bytes(config.method.as_bytes()).map_err(|e| bad(e.to_string()))?;
        let target = Target::parse(&config.url).map_err(|e| bad(format!("url: {e}")))?;
        let idempotency_header = HeaderName::from_bytes(config.idempotency_header.as_bytes())
            .map_err(|e| bad(format!("idempotency_header: {e}")))?;
        let deadline_header = match &config.absence_proof {
            Some(proof) => Some(
                HeaderName::from_bytes(proof.header.as_bytes())
                    .map_err(|e| bad(format!("absence_proof.deadline_header: {e}")))?,
            ),
            None => None,
        };
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        // What reqwest sent by default; a tool's own `Accept` replaces it.
        headers.insert(ACCEPT, HeaderValue::from_static("*/*"));
        for (k, v) in &config.headers {
            let name = HeaderName::from_bytes(k.as_bytes())
                .map_err(|e| bad(format!("header {k}: {e}")))?;
            let value = HeaderValue::from_str(v).map_err(|e| bad(format!("header {k}: {e}")))?;
            headers.insert(name, value);
        }
        Ok(HttpAdapter {
            receipt: receipt::ReceiptRule::new(&config.receipt_id, &config.receipt_match),
            contract: config.completion.contract().map(status::Contract::new),
            config,
            client,
            target,
            method,
            headers,
            idempotency_header,
            deadline_header,
        })
    }

    fn request_ref(&self, request: &Request) -> Result<(), String> {
        HeaderValue::from_str(&request.idempotency_key)
            .map(|_| ())
            .map_err(|e| format!("idempotency key is not a valid header value: {e}"))
    }

    async fn send_write(&self, request: &Request) -> Outcome {
        self.write(request, true).await.outcome
    }

    /// Sends the write exactly as [`ToolAdapter::execute`] does, and also returns the status
    /// and content type. `with_key = false` leaves the idempotency header out: only
    /// `worker check-tool` does that, to see how the downstream treats a keyless request.
    pub async fn probe_write(&self, request: &Request, with_key: bool) -> Answer {
        self.write(request, with_key).await
    }

    /// Looks up exactly as [`ToolAdapter::lookup`] does, and also returns the status and
    /// content type (for `worker check-tool`).
    pub async fn probe_lookup(&self, request: &Request) -> Answer {
        self.lookup_answer(request).await
    }

    /// The write in its `POST` (the tool's method) client span, whose context the request
    /// carries.
    async fn write(&self, request: &Request, with_key: bool) -> Answer {
        let span = client_span(self.method.as_str(), &self.config.url);
        let answer = self
            .write_in(request, with_key, &span)
            .instrument(span.clone())
            .await;
        record_answer(&span, &answer);
        answer
    }

    async fn write_in(&self, request: &Request, with_key: bool, span: &Span) -> Answer {
        if let Err(evidence) = self.request_ref(request) {
            return Answer::bare(Outcome::Rejected {
                status: 0,
                evidence,
            });
        }
        let mut headers = self.headers.clone();
        if with_key {
            headers.insert(
                self.idempotency_header.clone(),
                HeaderValue::from_str(&request.idempotency_key).expect("checked above"),
            );
        }
        let deadline = match (&self.deadline_header, request.deadline) {
            (Some(name), Some(deadline)) => {
                let value = deadline.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
                headers.insert(
                    name.clone(),
                    HeaderValue::from_str(&value).expect("an RFC 3339 time is a header value"),
                );
                Some(value)
            }
            _ => None,
        };
        trace_headers(&mut headers, span, request);
        let sent = self
            .client
            .send(
                self.method.clone(),
                &self.target,
                headers,
                Some(request.body.clone()),
            )
            .await;
        let Reply {
            status,
            headers,
            body,
        } = match sent {
            Ok(r) => r,
            Err(e) => return Answer::bare(classify_error(&e, &self.config, &self.config.url)),
        };
        let content_type = content_type(&headers);
        let retry_after = parse_retry_after(headers.get(RETRY_AFTER), SystemTime::now());
        let answer = |outcome| Answer {
            outcome,
            status: Some(status.as_u16()),
            content_type: content_type.clone(),
        };
        if status.is_success() {
            return answer(match body {
                Ok(bytes) if self.accepts(status) => self.acceptance(request, &bytes, status),
                Ok(bytes) => self.receipt_outcome(request, &bytes, status),
                Err(e) => Outcome::Unknown {
                    evidence: format!("HTTP {status} but the body could not be read: {e}"),
                    retry_after: None,
                },
            });
        }
        let excerpt = body.as_deref().map(excerpt).unwrap_or_default();
        let evidence = format!("HTTP {}: {excerpt}", status.as_u16());
        // The downstream's promise: a request refused at its deadline had no effect.
        if let (Some(deadline), Some(proof)) = (&deadline, &self.config.absence_proof) {
            if proof.refused_statuses.contains(&status.as_u16()) {
                return answer(Outcome::NotApplied {
                    evidence: format!(
                        "refused at its deadline {deadline} (deadline_refused_statuses), not \
                         applied: {evidence}"
                    ),
                    retry_after,
                });
            }
        }
        if self
            .config
            .retry
            .not_applied_statuses
            .contains(&status.as_u16())
        {
            return answer(Outcome::NotApplied {
                evidence,
                retry_after,
            });
        }
        answer(classify_status(status, evidence, retry_after))
    }

    fn receipt_outcome(&self, request: &Request, bytes: &[u8], status: StatusCode) -> Outcome {
        let receipt = match Document::parse(bytes) {
            Ok(d) => d,
            Err(e) => {
                return Outcome::Unknown {
                    evidence: format!(
                        "HTTP {status} with a body that is not JSON ({e}): {}",
                        excerpt(bytes)
                    ),
                    retry_after: None,
                }
            }
        };
        self.checked_receipt(request, receipt, status)
    }

    /// A parsed answer that passes the receipt check is this operation's receipt; one that
    /// does not proves nothing (it may be another operation's).
    fn checked_receipt(&self, request: &Request, receipt: Document, status: StatusCode) -> Outcome {
        match self.check_receipt(request, receipt.value()) {
            Ok(receipt_id) => Outcome::Succeeded {
                receipt,
                receipt_id,
            },
            Err(why) => Outcome::Unknown {
                evidence: format!("HTTP {status} but {why}"),
                retry_after: None,
            },
        }
    }

    /// Whether `status` answered to a write means "accepted, not done" (an async tool's
    /// `accepted_statuses`).
    fn accepts(&self, status: StatusCode) -> bool {
        self.contract
            .as_ref()
            .is_some_and(|c| c.accepted_statuses.contains(&status.as_u16()))
    }

    /// An acceptance: the operation it names, else unknown (it may have been applied, and
    /// without an id it cannot be followed). One that echoes another operation's identity is
    /// no acceptance of this write: unknown too, and recovery finds the real one.
    fn acceptance(&self, request: &Request, bytes: &[u8], status: StatusCode) -> Outcome {
        let contract = self.contract.as_ref().expect("only async tools accept");
        let document = Document::parse(bytes).ok();
        let Some((operation_id, acceptance)) =
            document.and_then(|d| contract.operation_id(d.value()).map(|id| (id, d)))
        else {
            return Outcome::Unknown {
                evidence: format!(
                    "HTTP {status} (accepted) without an operation id at {}: {}",
                    contract.operation_id,
                    excerpt(bytes)
                ),
                retry_after: None,
            };
        };
        match contract.another_operation(acceptance.value(), None, &self.receipt, request) {
            Some(why) => Outcome::Unknown {
                evidence: format!(
                    "HTTP {status} (accepted) but the acceptance is for another operation: \
                     {why}: {}",
                    excerpt(bytes)
                ),
                retry_after: None,
            },
            None => Outcome::Accepted {
                operation_id,
                acceptance,
            },
        }
    }

    /// What a long-running operation's document (a lookup's answer) says: done with this
    /// operation's receipt, failed as the downstream documents it, or in progress (an
    /// acceptance, when it names the operation); anything else proves nothing, and so does a
    /// document about another operation, whatever it says.
    fn document_outcome(
        &self,
        contract: &status::Contract,
        request: &Request,
        bytes: &[u8],
        status: StatusCode,
    ) -> Outcome {
        let Ok(document) = Document::parse(bytes) else {
            return self.receipt_outcome(request, bytes, status);
        };
        if let Some(why) =
            contract.another_operation(document.value(), None, &self.receipt, request)
        {
            return Outcome::Unknown {
                evidence: format!(
                    "HTTP {status} but the document is for another operation: {why}: {}",
                    excerpt(bytes)
                ),
                retry_after: None,
            };
        }
        match contract.judge(document.value()) {
            status::Judged::Done => self.checked_receipt(request, document, status),
            status::Judged::Failed => Outcome::Failed {
                evidence: format!("HTTP {status}: {}", excerpt(bytes)),
            },
            status::Judged::Neither => match contract.operation_id(document.value()) {
                Some(operation_id) => Outcome::Accepted {
                    operation_id,
                    acceptance: document,
                },
                None => Outcome::Unknown {
                    evidence: format!(
                        "HTTP {status}: neither done nor failed, and no operation id at {}: {}",
                        contract.operation_id,
                        excerpt(bytes)
                    ),
                    retry_after: None,
                },
            },
        }
    }

    /// Reads the status of operation `operation_id` (read only: a GET of the tool's
    /// `status_url`) and says what it established ([`Polled`]).
    pub async fn read_status(&self, request: &Request, operation_id: &str) -> Polled {
        let Some(contract) = &self.contract else {
            return Polled::Unproven {
                evidence: format!("tool {} has no async contract", self.config.name),
            };
        };
        let url = receipt::fill_with(&contract.status_url, request, Some(operation_id), true);
        let span = client_span("GET", &url);
        let polled = self
            .status_in(contract, request, operation_id, &url, &span)
            .instrument(span.clone())
            .await;
        // A read that proved nothing is the request's failure; done, failed and running are
        // answers.
        if !span.is_none()
            && matches!(
                polled,
                Polled::Unproven { .. } | Polled::LocalExhaustion { .. }
            )
        {
            span.record("error.type", polled.label());
            span.record("otel.status_code", "ERROR");
        }
        polled
    }

    async fn status_in(
        &self,
        contract: &status::Contract,
        request: &Request,
        operation_id: &str,
        url: &str,
        span: &Span,
    ) -> Polled {
        let target = match Target::parse(url) {
            Ok(t) => t,
            Err(why) => {
                return Polled::Unproven {
                    evidence: format!("status read failed: {}: {why}", where_is(&self.config, url)),
                }
            }
        };
        let mut headers = self.headers.clone();
        headers.remove(CONTENT_TYPE);
        trace_headers(&mut headers, span, request);
        let Reply { status, body, .. } = match self
            .client
            .send(Method::GET, &target, headers, None)
            .await
        {
            Ok(r) => r,
            Err(e) if e.is_connect() && kit::fd::local_exhaustion(e.source_chain()).is_some() => {
                return Polled::LocalExhaustion {
                    evidence: local_exhaustion(&e, &self.config, "status read", url).evidence(),
                };
            }
            Err(e) => {
                return Polled::Unproven {
                    evidence: format!("status read failed: {}", error_chain(&e, &self.config, url)),
                }
            }
        };
        if !span.is_none() {
            span.record("http.response.status_code", i64::from(status.as_u16()));
        }
        let bytes = match (status, body) {
            (StatusCode::OK, Ok(bytes)) => bytes,
            (status, body) => {
                return Polled::Unproven {
                    evidence: format!(
                        "status read answered HTTP {}: {}",
                        status.as_u16(),
                        body.as_deref().map(excerpt).unwrap_or_else(|e| e.clone())
                    ),
                }
            }
        };
        let Ok(document) = Document::parse(&bytes) else {
            return Polled::Unproven {
                evidence: format!("status document is not JSON: {}", excerpt(&bytes)),
            };
        };
        self.decide(contract, request, Some(operation_id), document)
    }

    /// What a long-running operation's status document (a poll's answer, or a completion
    /// callback's body) proves about the operation of `request`, accepted as `operation_id`
    /// when known: nothing when it is about another operation; done with this operation's
    /// receipt; failed as the downstream documents it; or still running.
    fn decide(
        &self,
        contract: &status::Contract,
        request: &Request,
        operation_id: Option<&str>,
        document: Document,
    ) -> Polled {
        let bytes = document.text().as_bytes();
        // Done, failed or running: about another operation, it says nothing about this one.
        if let Some(why) =
            contract.another_operation(document.value(), operation_id, &self.receipt, request)
        {
            return Polled::Unproven {
                evidence: format!(
                    "the status document is for another operation: {why}: {}",
                    excerpt(bytes)
                ),
            };
        }
        match contract.judge(document.value()) {
            status::Judged::Done => match self.check_receipt(request, document.value()) {
                Ok(receipt_id) => Polled::Done {
                    receipt: document,
                    receipt_id,
                },
                Err(why) => Polled::Unproven {
                    evidence: format!("the status says done, but {why}: {}", excerpt(bytes)),
                },
            },
            status::Judged::Failed => Polled::Failed {
                evidence: excerpt(bytes),
            },
            status::Judged::Neither => Polled::Running {
                evidence: format!("still running: {}", excerpt(bytes)),
            },
        }
    }

    async fn send_lookup(&self, request: &Request) -> Outcome {
        self.lookup_answer(request).await.outcome
    }

    async fn lookup_answer(&self, request: &Request) -> Answer {
        let Capability::Lookup { url_template } = &self.config.capability else {
            return Answer::bare(Outcome::LookupMiss {
                evidence: format!("tool {} has no lookup", self.config.name),
            });
        };
        let url = receipt::fill(url_template, request, true);
        let span = client_span("GET", &url);
        let answer = self
            .lookup_in(request, &url, &span)
            .instrument(span.clone())
            .await;
        record_answer(&span, &answer);
        answer
    }

    async fn lookup_in(&self, request: &Request, url: &str, span: &Span) -> Answer {
        let target = match Target::parse(url) {
            Ok(t) => t,
            Err(why) => {
                return Answer::bare(Outcome::Unknown {
                    evidence: format!("lookup failed: {}: {why}", where_is(&self.config, url)),
                    retry_after: None,
                })
            }
        };
        let mut headers = self.headers.clone();
        headers.remove(CONTENT_TYPE);
        trace_headers(&mut headers, span, request);
        let Reply {
            status,
            headers,
            body,
        } = match self.client.send(Method::GET, &target, headers, None).await {
            Ok(r) => r,
            Err(e) if e.is_connect() && kit::fd::local_exhaustion(e.source_chain()).is_some() => {
                return Answer::bare(local_exhaustion(&e, &self.config, "lookup", url));
            }
            Err(e) => {
                let why = match crate::tls::handshake_failure(e.source_chain()) {
                    Some(reason) => format!(
                        "TLS handshake with {} failed: {reason}",
                        where_is(&self.config, url)
                    ),
                    None => error_chain(&e, &self.config, url),
                };
                return Answer::bare(Outcome::Unknown {
                    evidence: format!("lookup failed: {why}"),
                    retry_after: None,
                });
            }
        };
        let content_type = content_type(&headers);
        let retry_after = parse_retry_after(headers.get(RETRY_AFTER), SystemTime::now());
        let outcome = match (status, body) {
            (StatusCode::OK, Ok(bytes)) => match &self.contract {
                Some(contract) => self.document_outcome(contract, request, &bytes, status),
                None => self.receipt_outcome(request, &bytes, status),
            },
            (StatusCode::NOT_FOUND, body) => Outcome::LookupMiss {
                evidence: format!(
                    "lookup miss (HTTP 404: {}); a miss is not proof of absence",
                    body.as_deref().map(excerpt).unwrap_or_default()
                ),
            },
            (status, body) => Outcome::Unknown {
                evidence: format!(
                    "lookup answered HTTP {}: {}",
                    status.as_u16(),
                    body.as_deref().map(excerpt).unwrap_or_default()
                ),
                retry_after,
            },
        };
        Answer {
            outcome,
            status: Some(status.as_u16()),
            content_type,
        }
    }
}

/// One answer as the worker classifies it, with the HTTP details a probe reports.
#[derive(Debug, Clone)]
pub struct Answer {
    pub outcome: Outcome,
    /// `None` when no HTTP answer arrived.
    pub status: Option<u16>,
    pub content_type: Option<String>,
}

impl Answer {
    fn bare(outcome: Outcome) -> Answer {
        Answer {
            outcome,
            status: None,
            content_type: None,
        }
    }
}

/// The client span of a request to `url`: the dispatch span when the request is a send, else
/// a span of its own ([`crate::telemetry::spans::http_client`]).
fn client_span(method: &str, url: &str) -> Span {
    crate::telemetry::spans::http_client(method, url)
}

/// `traceparent` / `tracestate` of the request: the client span's context when it is
/// recorded, else the intent's own, unchanged.
fn trace_headers(headers: &mut HeaderMap, span: &Span, request: &Request) {
    let Some(cx) = kit::otel::outgoing(span, request.trace.as_ref()) else {
        return;
    };
    if let Ok(v) = HeaderValue::from_str(&cx.traceparent()) {
        headers.insert(HeaderName::from_static(protocol::trace::TRACEPARENT), v);
    }
    if let Some(v) = cx
        .state
        .as_deref()
        .and_then(|s| HeaderValue::from_str(s).ok())
    {
        headers.insert(HeaderName::from_static(protocol::trace::TRACESTATE), v);
    }
}

/// The HTTP conventions' answer attributes: the status, and `error.type` (the status for 4xx
/// and 5xx, else what went wrong when no answer came).
fn record_answer(span: &Span, answer: &Answer) {
    if span.is_none() {
        return;
    }
    if let Some(status) = answer.status {
        span.record("http.response.status_code", i64::from(status));
        if status >= 400 {
            span.record("error.type", status.to_string().as_str());
            span.record("otel.status_code", "ERROR");
        }
    } else {
        span.record("error.type", answer.outcome.label());
        span.record("otel.status_code", "ERROR");
    }
}

fn content_type(headers: &HeaderMap) -> Option<String> {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

impl ToolAdapter for HttpAdapter {
    fn capability(&self) -> &Capability {
        &self.config.capability
    }

    fn execute<'a>(&'a self, request: &'a Request) -> BoxFuture<'a, Outcome> {
        Box::pin(self.send_write(request))
    }

    fn lookup<'a>(&'a self, request: &'a Request) -> BoxFuture<'a, Outcome> {
        Box::pin(self.send_lookup(request))
    }

    fn poll<'a>(&'a self, request: &'a Request, operation_id: &'a str) -> BoxFuture<'a, Polled> {
        Box::pin(self.read_status(request, operation_id))
    }

    fn judge_status(
        &self,
        request: &Request,
        operation_id: Option<&str>,
        document: Document,
    ) -> Polled {
        match &self.contract {
            Some(contract) => self.decide(contract, request, operation_id, document),
            None => Polled::Unproven {
                evidence: format!("tool {} has no async contract", self.config.name),
            },
        }
    }

    fn check_receipt(
        &self,
        request: &Request,
        receipt: &serde_json::Value,
    ) -> Result<String, String> {
        self.receipt.check(request, receipt)
    }
}

/// Transport errors: only a failure to connect proves the request was never written. A failed
/// TLS handshake is one (the request is written only after the handshake; no early data is
/// enabled), and its evidence says which tool and why (unknown issuer, name mismatch...). A
/// connect that failed because this worker ran out of a local resource (EMFILE "Too many open
/// files", ENFILE, ENOBUFS, ENOMEM, EADDRNOTAVAIL anywhere in the error's source chain) is
/// [`Outcome::LocalExhaustion`]: not sent, and not the downstream's doing.
pub fn classify_error(e: &SendError, config: &ToolConfig, url: &str) -> Outcome {
    let chain = error_chain(e, config, url);
    if e.is_connect() && kit::fd::local_exhaustion(e.source_chain()).is_some() {
        local_exhaustion(e, config, "write", url)
    } else if e.is_connect() {
        let evidence = match crate::tls::handshake_failure(e.source_chain()) {
            Some(reason) => format!(
                "not sent: TLS handshake with {} failed: {reason}",
                where_is(config, url)
            ),
            None => format!("not sent: {chain}"),
        };
        Outcome::NotSent { evidence }
    } else if e.is_invalid() {
        Outcome::Rejected {
            status: 0,
            evidence: format!("request could not be built: {chain}"),
        }
    } else if e.is_timeout() {
        Outcome::Unknown {
            evidence: format!("timed out after the request may have been written: {chain}"),
            retry_after: None,
        }
    } else {
        Outcome::Unknown {
            evidence: format!("connection failed after the request may have been written: {chain}"),
            retry_after: None,
        }
    }
}

/// "tool <name> at <host:port>": how evidence and logs name a tool's downstream. Never the URL
/// itself: its query, user part or an interpolated `${VAR}` may hold a secret.
fn where_is(config: &ToolConfig, url: &str) -> String {
    format!("tool {} at {}", config.name, kit::url::host_port(url))
}

/// The evidence of a connect this worker's own exhaustion stopped.
fn local_exhaustion(e: &SendError, config: &ToolConfig, kind: &str, url: &str) -> Outcome {
    let cause =
        kit::fd::local_exhaustion(e.source_chain()).map_or_else(String::new, |io| io.to_string());
    Outcome::LocalExhaustion {
        evidence: format!(
            "not sent: worker out of local resources ({cause}) before the {kind} to tool {} could \
             connect; retried without spending an attempt: {}",
            config.name,
            error_chain(e, config, url)
        ),
    }
}

/// Non-2xx statuses: 408, 409, 429 (unless declared not-applied) and 5xx may have been
/// applied; other 4xx are definitive rejections.
pub fn classify_status(
    status: StatusCode,
    evidence: String,
    retry_after: Option<Duration>,
) -> Outcome {
    let code = status.as_u16();
    if status.is_client_error() && !matches!(code, 408 | 409 | 429) {
        Outcome::Rejected {
            status: code,
            evidence,
        }
    } else {
        Outcome::Unknown {
            evidence,
            retry_after,
        }
    }
}

fn excerpt(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let mut s: String = text.chars().take(EXCERPT).collect();
    if text.chars().count() > EXCERPT {
        s.push('…');
    }
    s
}

/// An HTTP client error and its causes on one line, naming the tool and its host first and
/// without the URL the client puts in its text: the URL's query, user part or an interpolated
/// `${VAR}` may hold a secret, and the chain goes into evidence, results and logs.
fn error_chain(e: &SendError, config: &ToolConfig, url: &str) -> String {
    format!("{}: {}", where_is(config, url), e.text())
}

/// `Retry-After` as delay-seconds or an HTTP date (RFC 9110 section 10.2.3).
pub fn parse_retry_after(value: Option<&HeaderValue>, now: SystemTime) -> Option<Duration> {
    let text = value?.to_str().ok()?.trim();
    if let Ok(secs) = text.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = chrono::DateTime::parse_from_rfc2822(text).ok()?;
    let at = SystemTime::UNIX_EPOCH + Duration::from_secs(at.timestamp().max(0) as u64);
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_takes_seconds_and_http_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_480); // Wed, 21 Oct 2015 07:28:00 GMT
        let v = HeaderValue::from_static("2");
        assert_eq!(
            parse_retry_after(Some(&v), now),
            Some(Duration::from_secs(2))
        );
        let v = HeaderValue::from_static("Wed, 21 Oct 2015 07:28:30 GMT");
        assert_eq!(
            parse_retry_after(Some(&v), now),
            Some(Duration::from_secs(30))
        );
        let v = HeaderValue::from_static("soon");
        assert_eq!(parse_retry_after(Some(&v), now), None);
        assert_eq!(parse_retry_after(None, now), None);
    }

    #[test]
    fn statuses_are_classified_conservatively() {
        let e = String::new;
        for code in [400u16, 401, 403, 404, 410, 422] {
            assert!(matches!(
                classify_status(StatusCode::from_u16(code).unwrap(), e(), None),
                Outcome::Rejected { .. }
            ));
        }
        for code in [408u16, 409, 429, 500, 502, 503, 504] {
            assert!(matches!(
                classify_status(StatusCode::from_u16(code).unwrap(), e(), None),
                Outcome::Unknown { .. }
            ));
        }
    }
}
