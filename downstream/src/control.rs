//! The control API under `/_control/`: how tests arm and inspect faults.
//!
//! These requests are about the test harness, not the business, so they are
//! never written to the `requests` table and never consume faults.
//!
//! - `POST /_control/faults` appends one fault (body: see `faults::FaultSpec`),
//!   answers 201 with the stored fault (defaults filled in);
//! - `GET /_control/faults` answers 200 `{"faults": [...]}` (uses left);
//! - `DELETE /_control/faults` clears them, answers 200 `{"cleared": n}`.

use serde_json::json;

use crate::faults::{FaultBook, FaultSpec};
use crate::http::{Request, Response};

/// `segments` is the path after `_control`; `faults` is the service's fault book.
pub fn handle(faults: &FaultBook, req: &Request, segments: &[&str]) -> Response {
    if segments != ["faults"] {
        return Response::error(404, "no_route");
    }
    match req.method.as_str() {
        "GET" => Response::json(200, json!({ "faults": faults.list() })),
        "DELETE" => Response::json(200, json!({ "cleared": faults.clear() })),
        "POST" => add(faults, &req.body),
        _ => Response::error(405, "method_not_allowed"),
    }
}

fn add(faults: &FaultBook, body: &[u8]) -> Response {
    let spec: FaultSpec = match serde_json::from_slice(body) {
        Ok(spec) => spec,
        Err(err) => {
            return Response::json(
                400,
                json!({"error": "bad_fault", "detail": err.to_string()}),
            )
        }
    };
    match faults.add(spec) {
        Ok(fault) => {
            tracing::info!(?fault, "fault armed");
            Response::json(201, json!(fault))
        }
        Err(detail) => Response::json(400, json!({"error": "bad_fault", "detail": detail})),
    }
}
