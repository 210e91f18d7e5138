//! Routing and the life of one business request, faults included.
//!
//! The order is the contract the crash tests rely on:
//! 1. classify and validate the request (pure: a 400/404 consumes no fault), a
//!    write's deadline header included;
//!    a status read of an async job also reads the job's key and resource here,
//!    since faults are matched by the job's key;
//! 2. take the first matching fault from the book;
//! 3. log the request in `requests` in its own committed insert, *before*
//!    anything else happens, so dropped and faulted requests are counted too
//!    (with the trace context headers it carried);
//! 4. before-commit faults: `drop_before_commit`, `status`, `slow`,
//!    `lookup_miss`, `status_error`, `status_slow`;
//! 5. do the work (the write commits, or the lookup reads); a write that creates
//!    something checks its deadline last, inside its transaction, and rolls back
//!    (422 `deadline_passed`) if it is late; an async write that
//!    creates a job takes the job faults that shape it now, and an async request
//!    records the operation it found (and `status_not_found`) in its log row;
//! 6. after-commit faults, whatever the outcome of step 5:
//!    `drop_after_commit`, `wrong_receipt`, `status_after_commit`,
//!    `slow_after_commit`, `nul_in_receipt`;
//! 7. record the status we answer with, then answer (dropped requests keep a
//!    NULL status);
//! 8. once the whole answer is written to a peer that was still there, record
//!    `replied_at` (see `server.rs`): NULL means the client never got it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{json, Value};
use sqlx::types::chrono::{DateTime, Utc};

use crate::control;
use crate::faults::{Direction, Fault, FaultBook, FaultKind};
use crate::http::{percent_decode, Request, Response};
use crate::jobs::{self, Ending, Job, Shape};
use crate::receipt;
use crate::store::{AsyncWrite, Deadline, Replay, RequestEntry, Store, TraceHeaders, Written};

/// Shared state of the running service.
#[derive(Debug)]
pub struct App {
    pub store: Store,
    pub faults: FaultBook,
    pub retention: Duration,
    /// How long an async job runs unless an `async_delay` fault says otherwise.
    pub async_delay_ms: u64,
    /// The header a write's deadline comes in (`DOWNSTREAM_DEADLINE_HEADER`).
    pub deadline_header: String,
    wrong_receipts: AtomicU64,
}

impl App {
    pub fn new(
        store: Store,
        retention: Duration,
        async_delay_ms: u64,
        deadline_header: String,
    ) -> App {
        App {
            store,
            faults: FaultBook::default(),
            retention,
            async_delay_ms,
            deadline_header,
            wrong_receipts: AtomicU64::new(0),
        }
    }
}

/// What the connection handler should do with the socket.
#[derive(Debug)]
pub enum Reply {
    Respond(Response),
    /// The answer to a logged business request: `replied_at` of `requests` row
    /// `request_id` is set once it is delivered.
    Logged {
        response: Response,
        request_id: i64,
    },
    /// Close with a reset and send nothing.
    Drop,
}

/// The three downstream capabilities, as spelled in the URL, the async jobs, and five
/// deliberately broken variants that each break one property a declared capability relies on
/// (`worker check-tool` must catch every one of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Replay,
    Lookup,
    None,
    /// Long-running writes: 202 with an operation id, then a status URL to poll
    /// (`jobs.rs`). Key required; a repeat finds the same job.
    Async,
    /// Requires a key like `replay` but never replays: every write is a new mutation.
    ReplayNewReceipt,
    /// Replays a same-body repeat, but a known key with another body makes a new mutation.
    ReplayIgnoresBody,
    /// Replays sequential repeats, but checks then inserts with no lock or unique key, so
    /// concurrent same-key requests each make a mutation.
    ReplayRacy,
    /// Lookup answers 200 for any key, with a made-up receipt echoing the key.
    LookupPhantom,
    /// Exactly `lookup`, but the deadline header is ignored: a late write commits.
    LookupIgnoresDeadline,
}

impl Mode {
    fn parse(s: &str) -> Option<Mode> {
        match s {
            "replay" => Some(Mode::Replay),
            "lookup" => Some(Mode::Lookup),
            "none" => Some(Mode::None),
            "async" => Some(Mode::Async),
            "replay-new-receipt" => Some(Mode::ReplayNewReceipt),
            "replay-ignores-body" => Some(Mode::ReplayIgnoresBody),
            "replay-racy" => Some(Mode::ReplayRacy),
            "lookup-phantom" => Some(Mode::LookupPhantom),
            "lookup-ignores-deadline" => Some(Mode::LookupIgnoresDeadline),
            _ => None,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Mode::Replay => "replay",
            Mode::Lookup => "lookup",
            Mode::None => "none",
            Mode::Async => "async",
            Mode::ReplayNewReceipt => "replay-new-receipt",
            Mode::ReplayIgnoresBody => "replay-ignores-body",
            Mode::ReplayRacy => "replay-racy",
            Mode::LookupPhantom => "lookup-phantom",
            Mode::LookupIgnoresDeadline => "lookup-ignores-deadline",
        }
    }

    /// Modes whose writes honour the deadline header (all but the one broken for it).
    fn checks_deadline(self) -> bool {
        self != Mode::LookupIgnoresDeadline
    }

    /// Modes that, like `replay`, refuse a write without an idempotency key.
    fn requires_key(self) -> bool {
        matches!(
            self,
            Mode::Replay
                | Mode::Async
                | Mode::ReplayNewReceipt
                | Mode::ReplayIgnoresBody
                | Mode::ReplayRacy
        )
    }
}

/// A valid business operation, ready to run.
#[derive(Debug)]
enum Op {
    Write {
        mode: Mode,
        resource: String,
        key: Option<String>,
        body: Value,
        /// Checked at the commit point of a write that creates something.
        deadline: Option<Deadline>,
    },
    Lookup {
        mode: Mode,
        resource: String,
        key: String,
    },
    /// `GET /async/operations/{operation_id}`.
    Status { operation_id: String },
}

/// What gets logged about a business request, valid or not.
#[derive(Debug)]
struct Call {
    direction: Direction,
    mode: Option<String>,
    resource: Option<String>,
    key: Option<String>,
    /// The async operation a status read names.
    operation_id: Option<String>,
    trace: TraceHeaders,
}

/// What the work of an async request found out, for its log row.
#[derive(Debug, Default)]
struct Note {
    /// The job's operation id (writes and lookups; a status read logs it up front).
    operation_id: Option<String>,
    /// A fault that shaped the answer without being consumed (`status_not_found`).
    fault: Option<&'static str>,
}

/// Entry point for every parsed request. `too_large` is set when the body was
/// refused unread (over 1 MiB): business requests are still logged as 413.
pub async fn handle(app: &App, req: Request, too_large: bool) -> Reply {
    let segments: Vec<&str> = req.path.trim_start_matches('/').split('/').collect();
    match (req.method.as_str(), segments.as_slice()) {
        ("GET", ["healthz"]) => Reply::Respond(Response::json(200, json!({"status": "ok"}))),
        (_, ["_control", ..]) if too_large => {
            Reply::Respond(Response::error(413, "body_too_large"))
        }
        (_, ["_control", ..]) => Reply::Respond(control::handle(&app.faults, &req, &segments[1..])),
        _ => business(app, &req, &segments, too_large).await,
    }
}

async fn business(app: &App, req: &Request, segments: &[&str], too_large: bool) -> Reply {
    let (mut call, parsed) = classify(req, segments, &app.deadline_header);
    // The body was never read, so whatever validation said, the answer is 413.
    let parsed = if too_large {
        Err(Response::error(413, "body_too_large"))
    } else {
        parsed
    };
    // A status read is matched to faults, and logged, by its job's key.
    if let Ok(Op::Status { operation_id }) = &parsed {
        match app.store.async_job_identity(operation_id).await {
            Ok(Some((key, resource))) => {
                call.key = Some(key);
                call.resource = Some(resource);
            }
            Ok(None) => {}
            // The request log insert below most likely fails too, and says so.
            Err(err) => tracing::warn!(error = %err, "could not read the job of a status read"),
        }
    }
    let fault = match parsed {
        Ok(_) => app.faults.take(call.direction, call.key.as_deref()),
        Err(_) => None,
    };
    let logged = app
        .store
        .log_request(&RequestEntry {
            kind: call.direction.as_str(),
            mode: call.mode.as_deref(),
            resource: call.resource.as_deref(),
            idem_key: call.key.as_deref(),
            fault: fault.as_ref().map(|f| f.kind.as_str()),
            operation_id: call.operation_id.as_deref(),
            trace: &call.trace,
            deadline: match &parsed {
                Ok(Op::Write { deadline, .. }) => deadline.as_ref().map(|d| d.at),
                _ => None,
            },
        })
        .await;
    let log_id = match logged {
        Ok(id) => id,
        Err(err) => {
            // Without the log row the tests' send counts would be wrong, so
            // refuse rather than process an uncounted request.
            tracing::error!(error = %err, "could not log request; refusing it");
            return Reply::Respond(Response::error(503, "request_log_unavailable"));
        }
    };
    let op = match parsed {
        Ok(op) => op,
        Err(response) => return finish(app, log_id, response).await,
    };
    if let Some(fault) = &fault {
        tracing::info!(fault = fault.kind.as_str(), key = ?call.key, "injecting fault");
    }

    // Before the work.
    if let Some(f) = &fault {
        match f.kind {
            FaultKind::DropBeforeCommit => return Reply::Drop,
            FaultKind::Status | FaultKind::StatusError => {
                return finish(app, log_id, injected_status(f, 503)).await
            }
            FaultKind::Slow | FaultKind::StatusSlow => sleep_ms(f.delay_ms).await,
            FaultKind::LookupMiss if matches!(op, Op::Lookup { .. }) => {
                return finish(app, log_id, Response::error(404, "not_found")).await;
            }
            _ => {}
        }
    }

    let (response, note) = run(app, &op).await;
    if note.operation_id.is_some() || note.fault.is_some() {
        let noted = app
            .store
            .annotate_request(log_id, note.operation_id.as_deref(), note.fault)
            .await;
        if let Err(err) = noted {
            tracing::warn!(error = %err, log_id, "could not record the async operation");
        }
    }

    // After the work (committed, if it was a successful write).
    let response = match fault {
        Some(f) => match f.kind {
            FaultKind::DropAfterCommit => return Reply::Drop,
            FaultKind::WrongReceipt => wrong_receipt(app, &op, &response, f.state.as_deref()),
            FaultKind::StatusAfterCommit => injected_status(&f, 500),
            FaultKind::SlowAfterCommit => {
                sleep_ms(f.delay_ms).await;
                response
            }
            FaultKind::NulInReceipt => response.with_nul_memo(),
            _ => response,
        },
        None => response,
    };
    finish(app, log_id, response).await
}

/// Work out what the request is, for logging, and whether it is valid.
/// `deadline_header` names the header a write's deadline comes in.
fn classify(
    req: &Request,
    segments: &[&str],
    deadline_header: &str,
) -> (Call, Result<Op, Response>) {
    let header_key = req
        .header("idempotency-key")
        .filter(|k| !k.is_empty())
        .map(str::to_owned);
    let mode_text = segments
        .first()
        .filter(|s| !s.is_empty())
        .map(|s| s.to_string());
    let resource = segments.get(1).and_then(|s| percent_decode(s));
    let mode = mode_text.as_deref().and_then(Mode::parse);
    let is_get = req.method == "GET";
    let mut call = Call {
        direction: if is_get {
            Direction::Lookup
        } else {
            Direction::Write
        },
        mode: mode_text,
        resource: resource.clone(),
        key: if is_get { None } else { header_key.clone() },
        operation_id: None,
        trace: TraceHeaders {
            traceparent: req.combined_header("traceparent"),
            tracestate: req.combined_header("tracestate"),
        },
    };
    let resource = resource.filter(|r| !r.is_empty());

    let parsed = match (req.method.as_str(), segments.len()) {
        // The status URL of an async job. Its key and resource are filled in from the
        // job (see `business`), not from the path.
        ("GET", 3) if mode == Some(Mode::Async) && segments[1] == "operations" => {
            call.direction = Direction::Status;
            call.resource = None;
            call.operation_id = percent_decode(segments[2]).filter(|id| !id.is_empty());
            match &call.operation_id {
                Some(id) => Ok(Op::Status {
                    operation_id: id.clone(),
                }),
                None => Err(Response::error(400, "bad_status_path")),
            }
        }
        ("POST", 2) => match (mode, resource) {
            (None, _) => Err(Response::error(404, "unknown_mode")),
            (_, None) => Err(Response::error(404, "no_route")),
            (Some(mode), Some(resource)) => {
                let deadline = req.combined_header(deadline_header);
                validate_write(mode, resource, header_key, &req.body, deadline)
            }
        },
        ("GET", 4) if segments[2] == "by-key" => {
            let key = percent_decode(segments[3]).filter(|k| !k.is_empty());
            call.key = key.clone();
            match (mode, resource, key) {
                (None, _, _) => Err(Response::error(404, "unknown_mode")),
                (Some(Mode::None), _, _) => Err(Response::error(404, "lookup_not_supported")),
                (Some(mode), Some(resource), Some(key)) => Ok(Op::Lookup {
                    mode,
                    resource,
                    key,
                }),
                _ => Err(Response::error(400, "bad_lookup_path")),
            }
        }
        _ => Err(Response::error(404, "no_route")),
    };
    (call, parsed)
}

/// `deadline` is the deadline header's value (repeated fields joined with `,`, which
/// makes them malformed), if any.
fn validate_write(
    mode: Mode,
    resource: String,
    key: Option<String>,
    body: &[u8],
    deadline: Option<String>,
) -> Result<Op, Response> {
    let body: Value = match serde_json::from_slice(body) {
        Ok(v @ Value::Object(_)) => v,
        _ => return Err(Response::error(400, "body_must_be_json_object")),
    };
    if mode.requires_key() && key.is_none() {
        return Err(Response::error(400, "idempotency_key_required"));
    }
    let deadline = match deadline.filter(|_| mode.checks_deadline()) {
        None => None,
        Some(raw) => match DateTime::parse_from_rfc3339(&raw) {
            Ok(at) => Some(Deadline {
                at: at.with_timezone(&Utc),
                raw,
            }),
            Err(_) => return Err(Response::error(400, "bad_deadline")),
        },
    };
    Ok(Op::Write {
        mode,
        resource,
        key,
        body,
        deadline,
    })
}

/// The answer to a write refused at its commit point: `deadline` as received, `at` the
/// (offset) database clock time the check used.
fn deadline_passed(deadline: Option<&Deadline>, at: DateTime<Utc>) -> Response {
    Response::json(
        422,
        json!({
            "error": "deadline_passed",
            "deadline": deadline.map(|d| d.raw.as_str()),
            "at": at.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string(),
        }),
    )
}

/// Do the actual business work.
async fn run(app: &App, op: &Op) -> (Response, Note) {
    let result = match op {
        Op::Write {
            mode: Mode::Async, ..
        }
        | Op::Lookup {
            mode: Mode::Async, ..
        }
        | Op::Status { .. } => return run_async(app, op).await,
        Op::Write {
            mode: Mode::Replay,
            resource,
            key,
            body,
            deadline,
        } => {
            let key = key
                .as_deref()
                .expect("validated: replay writes carry a key");
            app.store
                .replay_write(resource, key, body, app.retention, deadline.as_ref())
                .await
                .map(|outcome| replay_response(outcome, deadline.as_ref()))
        }
        Op::Write {
            mode: mode @ (Mode::ReplayIgnoresBody | Mode::ReplayRacy),
            resource,
            key,
            body,
            deadline,
        } => {
            let key = key
                .as_deref()
                .expect("validated: replay writes carry a key");
            app.store
                .broken_replay_write(
                    mode.as_str(),
                    resource,
                    key,
                    body,
                    *mode == Mode::ReplayRacy,
                    deadline.as_ref(),
                )
                .await
                .map(|outcome| replay_response(outcome, deadline.as_ref()))
        }
        Op::Write {
            mode,
            resource,
            key,
            body,
            deadline,
        } => app
            .store
            .plain_write(
                mode.as_str(),
                resource,
                key.as_deref(),
                body,
                deadline.as_ref(),
            )
            .await
            .map(|written| match written {
                Written::Created(r) => Response::json(201, r),
                Written::Late(at) => deadline_passed(deadline.as_ref(), at),
            }),
        Op::Lookup {
            mode,
            resource,
            key,
        } => app
            .store
            .find_receipt(resource, key)
            .await
            .map(|found| match found {
                Some(r) => Response::json(200, r),
                None if *mode == Mode::LookupPhantom => {
                    let n = app.wrong_receipts.fetch_add(1, Ordering::Relaxed) + 1;
                    Response::json(200, receipt::phantom(n, mode.as_str(), resource, key))
                }
                None => Response::error(404, "not_found"),
            }),
    };
    let response = result.unwrap_or_else(|err| {
        tracing::error!(error = %err, "request failed");
        Response::error(500, "internal")
    });
    (response, Note::default())
}

fn replay_response(outcome: Replay, deadline: Option<&Deadline>) -> Response {
    match outcome {
        Replay::Created(r) | Replay::Replayed(r) => Response::json(201, r),
        Replay::KeyReused => Response::error(422, "idempotency_key_reused"),
        Replay::Late(at) => deadline_passed(deadline, at),
    }
}

/// The async requests: create or find a job, look one up by key, read its status.
async fn run_async(app: &App, op: &Op) -> (Response, Note) {
    let result = match op {
        Op::Write {
            resource,
            key,
            body,
            deadline,
            ..
        } => {
            let key = key.as_deref().expect("validated: async writes carry a key");
            app.store
                .async_write(resource, key, body, deadline.as_ref(), || {
                    job_shape(app, key)
                })
                .await
                .map(|outcome| match outcome {
                    AsyncWrite::Created(job) | AsyncWrite::Replayed(job) => {
                        let url = jobs::status_url(&job.operation_id);
                        let response =
                            Response::json(202, job.document()).with_header("Location", &url);
                        (response, noted(&job))
                    }
                    AsyncWrite::KeyReused => (
                        Response::error(422, "idempotency_key_reused"),
                        Note::default(),
                    ),
                    AsyncWrite::Late(at) => {
                        (deadline_passed(deadline.as_ref(), at), Note::default())
                    }
                })
        }
        Op::Lookup { resource, key, .. } => {
            app.store
                .async_job_by_key(resource, key)
                .await
                .map(|found| match found {
                    Some(job) => (Response::json(200, job.document()), noted(&job)),
                    None => (Response::error(404, "not_found"), Note::default()),
                })
        }
        Op::Status { operation_id } => {
            app.store
                .async_job(operation_id)
                .await
                .map(|found| match found {
                    Some(job) if job.hidden => (
                        Response::error(404, "not_found"),
                        Note {
                            operation_id: None,
                            fault: Some(FaultKind::StatusNotFound.as_str()),
                        },
                    ),
                    Some(job) => (Response::json(200, job.document()), Note::default()),
                    None => (Response::error(404, "not_found"), Note::default()),
                })
        }
    };
    result.unwrap_or_else(|err| {
        tracing::error!(error = %err, "async request failed");
        (Response::error(500, "internal"), Note::default())
    })
}

fn noted(job: &Job) -> Note {
    Note {
        operation_id: Some(job.operation_id.clone()),
        fault: None,
    }
}

/// The shape of a job being created under `key`: the job faults armed for it (one use of
/// each group), or the defaults (succeeds after `DOWNSTREAM_ASYNC_DELAY_MS`).
fn job_shape(app: &App, key: &str) -> Shape {
    let taken = app.faults.take_job_faults(key);
    for fault in [&taken.ending, &taken.delay, &taken.hidden]
        .into_iter()
        .flatten()
    {
        tracing::info!(fault = fault.kind.as_str(), key, "shaping async job");
    }
    Shape {
        ending: match taken.ending.map(|f| f.kind) {
            Some(FaultKind::AsyncFail) => Ending::Failed,
            Some(FaultKind::AsyncStuck) => Ending::Stuck,
            _ => Ending::Succeeded,
        },
        delay_ms: taken.delay.map_or(app.async_delay_ms, |f| f.delay_ms),
        hidden_ms: taken.hidden.map_or(0, |f| f.delay_ms),
    }
}

/// A success answer carrying someone else's receipt. For a lookup, the
/// arguments are copied from the real record when there is one, so only the
/// identity gives the lie away. An async answer gets another operation's
/// status document (`jobs::wrong`).
fn wrong_receipt(app: &App, op: &Op, real: &Response, state: Option<&str>) -> Response {
    let n = app.wrong_receipts.fetch_add(1, Ordering::Relaxed) + 1;
    let real_arguments = || real.body.get("arguments").cloned().unwrap_or(json!({}));
    match op {
        Op::Write {
            mode: Mode::Async,
            resource,
            body,
            ..
        } => Response::json(202, jobs::wrong(n, resource, body, &real.body, state)),
        Op::Lookup {
            mode: Mode::Async,
            resource,
            ..
        } => Response::json(
            200,
            jobs::wrong(n, resource, &real_arguments(), &real.body, state),
        ),
        Op::Status { .. } => {
            let resource = real.body["resource"].as_str().unwrap_or_default();
            Response::json(
                200,
                jobs::wrong(n, resource, &real_arguments(), &real.body, state),
            )
        }
        Op::Write {
            mode,
            resource,
            body,
            ..
        } => Response::json(201, receipt::wrong(n, mode.as_str(), resource, body)),
        Op::Lookup { mode, resource, .. } => Response::json(
            200,
            receipt::wrong(n, mode.as_str(), resource, &real_arguments()),
        ),
    }
}

fn injected_status(fault: &Fault, default: u16) -> Response {
    let status = fault.status.unwrap_or(default);
    let response = Response::json(
        status,
        json!({"error": "injected_fault", "fault": fault.kind.as_str()}),
    );
    match &fault.retry_after {
        Some(v) => response.with_header("Retry-After", v),
        None => response,
    }
}

async fn sleep_ms(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

/// Record the status, then hand the response to the connection.
async fn finish(app: &App, log_id: i64, response: Response) -> Reply {
    if let Err(err) = app.store.set_status(log_id, response.status).await {
        tracing::warn!(error = %err, log_id, "could not record response status");
    }
    Reply::Logged {
        response,
        request_id: log_id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(mode: Mode, deadline: Option<&str>) -> Result<Op, Response> {
        validate_write(
            mode,
            "r".into(),
            Some("k".into()),
            b"{}",
            deadline.map(str::to_owned),
        )
    }

    fn deadline_of(op: Result<Op, Response>) -> Option<Deadline> {
        match op {
            Ok(Op::Write { deadline, .. }) => deadline,
            other => panic!("not a write: {other:?}"),
        }
    }

    #[test]
    fn deadlines_are_parsed_as_rfc3339() {
        assert!(deadline_of(write(Mode::Lookup, None)).is_none());
        let utc = deadline_of(write(Mode::Replay, Some("2026-12-06T11:30:00.123Z"))).unwrap();
        let offset = deadline_of(write(Mode::None, Some("2026-12-06T13:30:00.123+02:00"))).unwrap();
        assert_eq!(utc.at, offset.at);
        assert_eq!(offset.raw, "2026-12-06T13:30:00.123+02:00");
        for bad in [
            "",
            "tomorrow",
            "2026-12-06",
            "2026-12-06T11:30:00",
            "1765020600",
        ] {
            let refused = write(Mode::Async, Some(bad)).unwrap_err();
            assert_eq!(
                (refused.status, &refused.body),
                (400, &json!({"error": "bad_deadline"}))
            );
        }
        // Two fields are joined with `,`: malformed.
        let two = "2026-12-06T11:30:00Z,2026-12-06T11:31:00Z";
        assert_eq!(write(Mode::Lookup, Some(two)).unwrap_err().status, 400);
    }

    #[test]
    fn lookup_ignores_deadline_never_reads_the_header() {
        assert!(deadline_of(write(Mode::LookupIgnoresDeadline, Some("garbage"))).is_none());
        assert!(deadline_of(write(
            Mode::LookupIgnoresDeadline,
            Some("2020-01-01T00:00:00Z")
        ))
        .is_none());
        assert_eq!(
            Mode::parse("lookup-ignores-deadline"),
            Some(Mode::LookupIgnoresDeadline)
        );
        assert_eq!(
            Mode::LookupIgnoresDeadline.as_str(),
            "lookup-ignores-deadline"
        );
        assert!(!Mode::LookupIgnoresDeadline.requires_key());
    }

    #[test]
    fn deadline_passed_names_both_times() {
        let d = deadline_of(write(Mode::Lookup, Some("2026-12-06T13:30:00+02:00"))).unwrap();
        let at = DateTime::parse_from_rfc3339("2026-12-06T11:30:00.5Z")
            .unwrap()
            .with_timezone(&Utc);
        let r = deadline_passed(Some(&d), at);
        assert_eq!(r.status, 422);
        assert_eq!(
            r.body,
            json!({"error": "deadline_passed", "deadline": "2026-12-06T13:30:00+02:00",
                   "at": "2026-12-06T11:30:00.500Z"})
        );
    }
}
