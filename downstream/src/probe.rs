//! `reference-downstream probe URL`: the container health check (the image has no curl). One
//! plain-HTTP GET (`http://host:port/path`, e.g. `http://127.0.0.1:9100/healthz`); success is
//! a 2xx status line within the time limit. Written on a bare socket because this service has
//! no HTTP client, and a health check needs none.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// GETs `url`; Ok on a 2xx answer within `timeout`.
pub async fn probe(url: &str, timeout: Duration) -> Result<()> {
    let rest = url
        .strip_prefix("http://")
        .with_context(|| format!("{url}: only http:// URLs are probed"))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
    let exchange = async {
        let mut socket = tokio::net::TcpStream::connect(authority)
            .await
            .with_context(|| format!("cannot connect to {authority}"))?;
        socket.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        // The status line is all that is needed; stop reading after a few KiB.
        let mut chunk = [0u8; 1024];
        while answer.len() < 4096 {
            let n = socket.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&chunk[..n]);
            if answer.windows(2).any(|w| w == b"\r\n") {
                break;
            }
        }
        anyhow::Ok(answer)
    };
    let answer = tokio::time::timeout(timeout, exchange)
        .await
        .with_context(|| format!("{url}: no answer within {timeout:?}"))??;
    let text = String::from_utf8_lossy(&answer);
    let status_line = text.lines().next().unwrap_or_default();
    match status_line.split_whitespace().nth(1) {
        Some(code) if code.starts_with('2') && code.len() == 3 => Ok(()),
        _ => bail!("{url}: {status_line:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_2xx_passes_and_anything_else_fails() {
        for (status, ok) in [("200 OK", true), ("503 Service Unavailable", false)] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let status = status.to_string();
            tokio::spawn(async move {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 512];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n").as_bytes())
                    .await;
            });
            let result = probe(&format!("http://{addr}/healthz"), Duration::from_secs(2)).await;
            assert_eq!(result.is_ok(), ok, "{result:?}");
        }
        assert!(probe("http://127.0.0.1:1/healthz", Duration::from_secs(2))
            .await
            .is_err());
    }
}
