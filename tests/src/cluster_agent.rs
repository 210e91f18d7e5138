//! The agent side of the cluster suites: a results queue that survives the loss of any node (a
//! quorum queue with a member on each) and a reader that follows it through whichever node
//! answers, so no result event is lost with the node the agent happened to read from.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Connection, ExchangeKind};
use protocol::ResultEvent;

use crate::host_port;
use crate::rabbit_cluster::NODES;

/// One result event the agent received, and when.
#[derive(Debug, Clone)]
pub struct Received {
    pub event: ResultEvent,
    pub at: Instant,
}

/// Declares the results exchange (as the worker does: durable topic, no arguments) and a durable
/// quorum queue with a member on each node, bound with the tenant-wide keys of `tenants`.
pub async fn declare_results_queue(url: &str, exchange: &str, queue: &str, tenants: &[&str]) {
    let conn = Connection::connect(url, Default::default())
        .await
        .expect("connect to the cluster");
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declare the results exchange");
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    args.insert(
        "x-quorum-initial-group-size".into(),
        AMQPValue::LongInt(NODES as i32),
    );
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .expect("declare the agent's results queue");
    for key in tenants
        .iter()
        .flat_map(|t| protocol::tenant_binding_keys(t))
    {
        ch.queue_bind(
            queue.into(),
            exchange.into(),
            key.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind the agent's results queue");
    }
    let _ = conn.close(200, "".into()).await;
}

/// Reads the agent's results queue through any node that answers (the next one on each loss)
/// until `stop`, recording every event (redelivered copies too: they are dropped by `event_id`
/// when counted).
pub fn spawn_collector(
    urls: Vec<String>,
    queue: String,
    got: Arc<Mutex<Vec<Received>>>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut next = 0usize;
        // Failed sessions since the last good one (only the first of an outage is printed).
        let mut failures = 0u32;
        while !stop.load(Ordering::SeqCst) {
            let url = urls[next % urls.len()].clone();
            next += 1;
            let session = async {
                let conn = tokio::time::timeout(
                    Duration::from_secs(5),
                    Connection::connect(&url, Default::default()),
                )
                .await
                .map_err(|_| "connect timed out".to_string())?
                .map_err(|e| e.to_string())?;
                let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
                ch.basic_qos(64, BasicQosOptions::default())
                    .await
                    .map_err(|e| e.to_string())?;
                let mut consumer = ch
                    .basic_consume(
                        queue.as_str().into(),
                        "agent".into(),
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                if failures > 0 {
                    eprintln!(
                        "agent results reader: consuming through {} again after {failures} \
                         failed attempt(s)",
                        host_port(&url)
                    );
                    failures = 0;
                }
                while !stop.load(Ordering::SeqCst) {
                    let d = match tokio::time::timeout(Duration::from_millis(300), consumer.next())
                        .await
                    {
                        Err(_) => continue,
                        Ok(None) => return Err("consumer ended".to_string()),
                        Ok(Some(d)) => d.map_err(|e| e.to_string())?,
                    };
                    let event: ResultEvent =
                        serde_json::from_slice(&d.data).expect("a result event");
                    got.lock().unwrap().push(Received {
                        event,
                        at: Instant::now(),
                    });
                    d.ack(BasicAckOptions::default())
                        .await
                        .map_err(|e| e.to_string())?;
                }
                let _ = conn.close(200, "".into()).await;
                Ok::<(), String>(())
            };
            if let Err(e) = session.await {
                if failures == 0 {
                    eprintln!("agent results reader ({}): {e}; next node", host_port(&url));
                }
                failures += 1;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    })
}
