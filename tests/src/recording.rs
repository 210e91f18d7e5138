//! Test servers with their wire in view: [`listen`] serves each connection of a port of its own
//! with a handler (a downstream that misbehaves on purpose, a proxy); [`downstream`] records the
//! head of every request (request line and headers as sent) and answers each with a receipt for
//! the key it carried, keeping its connections open (keep-alive), where the reference
//! downstream closes each one.

use std::future::Future;
use std::sync::{Arc, Mutex};

use tokio::net::TcpStream;

use serde_json::json;

/// The heads received, in order.
pub type Heads = Arc<Mutex<Vec<String>>>;

/// Starts one on a port of its own: the port, and the heads it records. A write is answered
/// `200` with `{"receipt_id": "r-basic", "idempotency_key": <its Idempotency-Key>}`.
pub async fn downstream() -> (u16, Heads) {
    use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};
    let heads = Heads::default();
    let seen = heads.clone();
    let port = listen(move |s| {
        let seen = seen.clone();
        async move {
                let mut s = tokio::io::BufReader::new(s);
                loop {
                    let mut head = String::new();
                    loop {
                        let mut line = String::new();
                        if s.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        if line == "\r\n" {
                            break;
                        }
                        head.push_str(&line);
                    }
                    let header = |name: &str| {
                        head.lines()
                            .find_map(|l| {
                                let (k, v) = l.split_once(':')?;
                                k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
                            })
                            .unwrap_or_default()
                    };
                    let length: usize = header("content-length").parse().unwrap_or(0);
                    let mut body = vec![0u8; length];
                    s.read_exact(&mut body).await.unwrap();
                    let key = header("idempotency-key");
                    seen.lock().unwrap().push(head.clone());
                    let answer =
                        json!({"receipt_id": "r-basic", "idempotency_key": key}).to_string();
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
                        answer.len()
                    );
                    s.get_mut().write_all(reply.as_bytes()).await.unwrap();
                }
        }
    })
    .await;
    (port, heads)
}

/// A port of its own on 127.0.0.1 whose every connection is served by `serve`, each on a task of
/// its own, for as long as the test runs.
pub async fn listen<F, Fut>(serve: F) -> u16
where
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(serve(stream));
        }
    });
    port
}
