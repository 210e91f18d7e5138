//! A deliberately minimal HTTP/1.1 server side: one request per connection.
//!
//! We do not use hyper/axum because the fault injection needs to own the
//! socket: "commit, then vanish without a byte" or "reset the connection" are
//! things a framework hides. So this module reads exactly one request (request
//! line, headers with case-insensitive names, a `Content-Length` body capped at
//! 1 MiB), writes exactly one response with `Connection: close`, and leaves the
//! decision of *whether* to answer to the caller. Chunked request bodies,
//! keep-alive and pipelining are intentionally unsupported.

use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest accepted request body; anything above is answered with 413.
pub const MAX_BODY: usize = 1024 * 1024;
/// Largest accepted request head (request line + headers).
const MAX_HEAD: usize = 64 * 1024;

/// One parsed request. Header names are stored lower-cased.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    /// The path without the query string, still percent-encoded.
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// First header with this (case-insensitive) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every field line with this (case-insensitive) name, joined with `,` as HTTP combines
    /// repeated fields; `None` when there is none. For headers such as `tracestate`, which a
    /// sender may split over several lines, and to keep a repeat visible where only one is
    /// allowed.
    pub fn combined_header(&self, name: &str) -> Option<String> {
        let name = name.to_ascii_lowercase();
        let values: Vec<&str> = self
            .headers
            .iter()
            .filter(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
            .collect();
        (!values.is_empty()).then(|| values.join(","))
    }
}

/// Why a request could not be read.
#[derive(Debug)]
pub enum ReadError {
    /// The peer went away or sent nothing usable; there is nobody to answer.
    Gone,
    /// Malformed request: answer with this status, nothing to log.
    Bad(u16, &'static str),
    /// The head was fine but the declared body is over [`MAX_BODY`]. The head is
    /// returned (with an empty body) so the request can still be logged.
    TooLarge(Request),
}

/// Read one request from the stream.
pub async fn read_request(stream: &mut TcpStream) -> Result<Request, ReadError> {
    let mut buf = Vec::with_capacity(4096);
    let head_end = loop {
        if let Some(pos) = find_head_end(&buf) {
            break pos;
        }
        if buf.len() > MAX_HEAD {
            return Err(ReadError::Bad(431, "request_head_too_large"));
        }
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await.map_err(|_| ReadError::Gone)?;
        if n == 0 {
            return Err(ReadError::Gone);
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head =
        std::str::from_utf8(&buf[..head_end]).map_err(|_| ReadError::Bad(400, "bad_head"))?;
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(ReadError::Bad(400, "bad_request_line"));
    };
    if !version.starts_with("HTTP/1.") || method.is_empty() || !target.starts_with('/') {
        return Err(ReadError::Bad(400, "bad_request_line"));
    }
    let mut headers = Vec::new();
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            return Err(ReadError::Bad(400, "bad_header"));
        };
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
    }
    let path = target.split(['?', '#']).next().unwrap_or("/").to_owned();
    let mut request = Request {
        method: method.to_owned(),
        path,
        headers,
        body: Vec::new(),
    };
    if request
        .header("transfer-encoding")
        .is_some_and(|te| !te.eq_ignore_ascii_case("identity"))
    {
        return Err(ReadError::Bad(411, "content_length_required"));
    }
    let length = match request.header("content-length") {
        None => 0,
        Some(v) => v
            .parse::<usize>()
            .map_err(|_| ReadError::Bad(400, "bad_content_length"))?,
    };
    if length > MAX_BODY {
        return Err(ReadError::TooLarge(request));
    }
    let mut body = buf.split_off(head_end + 4);
    body.truncate(length);
    while body.len() < length {
        let mut chunk = vec![0u8; (length - body.len()).min(64 * 1024)];
        let n = stream.read(&mut chunk).await.map_err(|_| ReadError::Gone)?;
        if n == 0 {
            return Err(ReadError::Gone);
        }
        body.extend_from_slice(&chunk[..n]);
    }
    request.body = body;
    Ok(request)
}

fn find_head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n")
}

/// A JSON response. Every response closes the connection.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Value,
    /// The exact body text to send instead of `body`'s serialisation (the `nul_in_receipt`
    /// fault's hand-spaced member).
    pub raw_body: Option<String>,
}

impl Response {
    pub fn json(status: u16, body: Value) -> Self {
        Response {
            status,
            headers: Vec::new(),
            body,
            raw_body: None,
        }
    }

    /// The same answer with a `memo` member holding a U+0000 added at the end of the JSON
    /// object, spaced as no serialiser would (` , "memo" : "nul\u0000end" }`): a client that
    /// keeps the exact bytes keeps both the NUL and the spacing. Not an object: unchanged.
    pub fn with_nul_memo(mut self) -> Self {
        let text = serde_json::to_string(&self.body).unwrap_or_default();
        if let Some(open) = text.strip_suffix('}').filter(|t| t.len() > 1) {
            self.raw_body = Some(format!("{open} , {NUL_MEMO} }}"));
        }
        self
    }

    /// `{"error": code}` with the given status.
    pub fn error(status: u16, code: &str) -> Self {
        Self::json(status, serde_json::json!({ "error": code }))
    }

    pub fn with_header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }
}

/// The member [`Response::with_nul_memo`] adds, exactly as sent.
pub const NUL_MEMO: &str = r#""memo" : "nul\u0000end""#;

/// Write the response and half-close, so the client sees a clean EOF after it.
pub async fn write_response(stream: &mut TcpStream, response: &Response) -> std::io::Result<()> {
    let body = match &response.raw_body {
        Some(raw) => raw.clone().into_bytes(),
        None => serde_json::to_vec(&response.body).unwrap_or_else(|_| b"null".to_vec()),
    };
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
        response.status,
        reason(response.status),
        body.len()
    );
    for (name, value) in &response.headers {
        // Header values come from trusted control input, but never let a stray
        // newline split the response.
        let value: String = value.chars().filter(|c| *c != '\r' && *c != '\n').collect();
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str("\r\n");
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(&body);
    stream.write_all(&bytes).await?;
    stream.flush().await?;
    stream.shutdown().await
}

/// Read and discard whatever the client is still sending (bounded), so closing
/// the socket with unread data does not turn our answer into a reset. Used
/// after refusing an oversized body we never read.
pub async fn drain(stream: &mut TcpStream) {
    let deadline = Duration::from_millis(500);
    let _ = tokio::time::timeout(deadline, async {
        let mut sink = vec![0u8; 64 * 1024];
        let mut total = 0usize;
        while total < 2 * MAX_BODY {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
        }
    })
    .await;
}

/// Close so the client sees a connection reset rather than an orderly EOF:
/// `SO_LINGER` 0 makes the kernel send RST on close and drop anything unsent.
pub fn reset(stream: TcpStream) {
    if let Err(err) = stream.set_zero_linger() {
        tracing::warn!(%err, "could not set SO_LINGER 0; closing normally");
    }
    drop(stream);
}

/// Percent-decode one path segment (`%2F` -> `/`); `None` if malformed or not UTF-8.
pub fn percent_decode(segment: &str) -> Option<String> {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Payload Too Large",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("a%2Fb%20c").as_deref(), Some("a/b c"));
        assert_eq!(
            percent_decode("tenant:op-1").as_deref(),
            Some("tenant:op-1")
        );
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("%2"), None);
    }

    #[test]
    fn repeated_fields_are_combined() {
        let request = Request {
            method: "POST".into(),
            path: "/".into(),
            headers: vec![
                ("tracestate".into(), "a=1".into()),
                ("idempotency-key".into(), "k".into()),
                ("tracestate".into(), "b=2".into()),
            ],
            body: Vec::new(),
        };
        assert_eq!(
            request.combined_header("TraceState").as_deref(),
            Some("a=1,b=2")
        );
        assert_eq!(
            request.combined_header("idempotency-key").as_deref(),
            Some("k")
        );
        assert_eq!(request.combined_header("traceparent"), None);
    }

    #[test]
    fn head_end_is_found() {
        assert_eq!(find_head_end(b"GET / HTTP/1.1\r\n\r\nbody"), Some(14));
        assert_eq!(find_head_end(b"GET / HTTP/1.1\r\n"), None);
    }
}
