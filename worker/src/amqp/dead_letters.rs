//! The dead-letter queue as an operator works it: reading it without losing a message,
//! republishing one to the intents exchange after a fix, discarding one; and the rule by which
//! the consumer recognises a republished intent's original publisher ([`proven_user`]).
//!
//! **Reading.** A [`Scan`] takes messages with `basic.get` (manual ack) on a channel of its
//! own, at most a bound of them, and holds them unacked: the ones acted on are acked (after a
//! republish is confirmed, or for a discard), every other one is returned with
//! `basic.nack(multiple, requeue)` when the scan ends, and closing the channel returns them too
//! if the process dies first. This is what RabbitMQ's management UI does to show messages. A
//! message being read is invisible to other readers for that moment, and a quorum queue counts
//! each return as a delivery (`x-delivery-count`; RabbitMQ 4 drops a message past the queue's
//! delivery limit, 20 by default: give the dead-letter queue `delivery-limit` -1 by policy
//! there).
//!
//! **Republishing.** The original body goes to the intents exchange with its routing key and
//! message id, mandatory and confirmed, then the dead letter is acked; a crash in between
//! leaves both, and the inbox answers the second copy from the ledger. The copy carries
//! `user_id` = the worker's own broker user (the broker refuses any other), the original
//! publisher in `x-intent-worker-user-id` and the request id in `x-intent-worker-republished`.
//! [`proven_user`] trusts that header only on a message the broker validated as published by
//! the worker's own user: nobody else can set that `user_id`, so only a worker can vouch for
//! an original publisher, and a tenant cannot borrow another's identity through the header.

use std::time::Duration;

use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use sha2::{Digest, Sha256};

use super::AmqpError;
use crate::config::Topology;

/// The header holding a dead letter's reason code ([`crate::answers::DeadLetterReason`]).
pub const REASON_HEADER: &str = "x-intent-worker-reason";
/// The header holding the reason in words.
pub const DETAIL_HEADER: &str = "x-intent-worker-detail";
/// The header holding the original publisher's broker user.
pub const USER_HEADER: &str = "x-intent-worker-user-id";
/// The header a republished intent carries: the request id of the republish.
pub const REPUBLISHED_HEADER: &str = "x-intent-worker-republished";

/// Most messages one scan takes from the queue.
pub const MAX_SCAN: usize = 1_000;

/// The user an intent's tenant proof is checked against: the broker-validated `user_id`, except
/// for an intent the worker republished from the dead-letter queue (published by the worker's
/// own broker user `own_user` with [`REPUBLISHED_HEADER`]), whose original publisher is in
/// [`USER_HEADER`] (none there: no user, so `user_id` mode refuses it).
pub fn proven_user(properties: &BasicProperties, own_user: Option<&str>) -> Option<String> {
    let user = properties
        .user_id()
        .as_ref()
        .map(|u| u.as_str().to_string());
    let by_worker = own_user.is_some() && user.as_deref() == own_user;
    if by_worker && header_text(properties.headers().as_ref(), REPUBLISHED_HEADER).is_some() {
        return header_text(properties.headers().as_ref(), USER_HEADER);
    }
    user
}

/// The broker user of an AMQP URL (the first of a comma-separated list): the user a worker's
/// publishes are validated as. `amqp://host` without one is `guest`, as for the client.
pub fn broker_user(amqp_url: &str) -> Option<String> {
    let first = amqp_url.split(',').next()?.trim();
    let uri: lapin::uri::AMQPUri = first.parse().ok()?;
    Some(uri.authority.userinfo.username).filter(|u| !u.is_empty())
}

/// A header's value as text (strings, numbers, booleans; a table or array as its debug form).
pub fn header_text(headers: Option<&FieldTable>, name: &str) -> Option<String> {
    headers?.inner().get(name).map(field_text)
}

/// An AMQP field value as text.
pub fn field_text(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(v) => v.to_string(),
        AMQPValue::ShortShortUInt(v) => v.to_string(),
        AMQPValue::ShortInt(v) => v.to_string(),
        AMQPValue::ShortUInt(v) => v.to_string(),
        AMQPValue::LongInt(v) => v.to_string(),
        AMQPValue::LongUInt(v) => v.to_string(),
        AMQPValue::LongLongInt(v) => v.to_string(),
        AMQPValue::Float(v) => v.to_string(),
        AMQPValue::Double(v) => v.to_string(),
        AMQPValue::Timestamp(v) => v.to_string(),
        AMQPValue::FieldArray(a) => {
            let items: Vec<String> = a.as_slice().iter().map(field_text).collect();
            format!("[{}]", items.join(", "))
        }
        AMQPValue::FieldTable(t) => {
            let items: Vec<String> = t
                .inner()
                .iter()
                .map(|(k, v)| format!("{}: {}", k.as_str(), field_text(v)))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        AMQPValue::ByteArray(b) => String::from_utf8_lossy(b.as_slice()).into_owned(),
        other => format!("{other:?}"),
    }
}

/// One message of the dead-letter queue, as read.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// The console's id: a digest of message id, routing key and body (identical copies share
    /// it).
    pub id: String,
    pub message_id: Option<String>,
    pub routing_key: String,
    /// [`REASON_HEADER`]; for the broker's own dead-lettering, `broker:<its reason>`.
    pub reason: Option<String>,
    pub detail: Option<String>,
    /// The original publisher: [`USER_HEADER`] of the worker's copy, or the `user_id` the
    /// broker kept when it dead-lettered the message itself.
    pub original_user: Option<String>,
    /// The tenant and action id the body names (salvaged as the intake does), if any.
    pub tenant: Option<String>,
    pub action_id: Option<String>,
    /// Every header, as text, in name order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub properties: BasicProperties,
    /// Position in the queue when read (0 = head).
    pub position: usize,
    delivery_tag: u64,
}

impl DeadLetter {
    /// A copy with its body cut at `max` bytes (for keeping, not for acting on).
    pub fn cut(&self, max: usize) -> DeadLetter {
        let mut copy = self.clone();
        copy.body.truncate(max);
        copy
    }

    fn read(delivery: &lapin::message::Delivery, position: usize) -> DeadLetter {
        let props = &delivery.properties;
        let headers = props.headers().as_ref();
        let message_id = props.message_id().as_ref().map(|m| m.as_str().to_string());
        let routing_key = delivery.routing_key.as_str().to_string();
        let reason = header_text(headers, REASON_HEADER).or_else(|| {
            header_text(headers, "x-first-death-reason").map(|r| format!("broker:{r}"))
        });
        let original_user = header_text(headers, USER_HEADER)
            .or_else(|| props.user_id().as_ref().map(|u| u.as_str().to_string()));
        let key = protocol::salvage_key(&delivery.data);
        let mut all: Vec<(String, String)> = headers
            .map(|h| {
                h.inner()
                    .iter()
                    .map(|(k, v)| (k.as_str().to_string(), field_text(v)))
                    .collect()
            })
            .unwrap_or_default();
        all.sort();
        DeadLetter {
            id: dead_letter_id(message_id.as_deref(), &routing_key, &delivery.data),
            message_id,
            routing_key,
            reason,
            detail: header_text(headers, DETAIL_HEADER),
            original_user,
            tenant: key.as_ref().map(|(t, _)| t.clone()),
            action_id: key.map(|(_, a)| a),
            headers: all,
            body: delivery.data.clone(),
            properties: props.clone(),
            position,
            delivery_tag: delivery.delivery_tag,
        }
    }
}

/// The id of a dead letter: 16 hex characters of SHA-256 over its message id, routing key and
/// body.
pub fn dead_letter_id(message_id: Option<&str>, routing_key: &str, body: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(message_id.unwrap_or("").as_bytes());
    h.update([0]);
    h.update(routing_key.as_bytes());
    h.update([0]);
    h.update(body);
    super::hex(&h.finalize()[..8])
}

/// The properties of a republished intent (see the module doc): the original ones without the
/// dead-lettering headers, `user_id` the worker's own user, the original publisher and the
/// request id in headers.
pub fn republish_properties(
    letter: &DeadLetter,
    own_user: Option<&str>,
    request_id: &str,
) -> BasicProperties {
    const DROPPED: [&str; 4] = [
        REASON_HEADER,
        DETAIL_HEADER,
        "x-original-routing-key",
        "x-death",
    ];
    let mut headers = FieldTable::default();
    if let Some(original) = letter.properties.headers() {
        for (k, v) in original.inner() {
            let name = k.as_str();
            let broker_made = name.starts_with("x-first-death-")
                || name.starts_with("x-last-death-")
                || name == "x-delivery-count";
            if !DROPPED.contains(&name) && !broker_made && name != USER_HEADER {
                headers.insert(k.clone(), v.clone());
            }
        }
    }
    let mut text = |k: &str, v: &str| {
        headers.insert(k.into(), AMQPValue::LongString(LongString::from(v)));
    };
    text(REPUBLISHED_HEADER, request_id);
    if let Some(user) = &letter.original_user {
        text(USER_HEADER, user);
    }
    let p = super::persistent_copy(&letter.properties, headers);
    match own_user {
        Some(user) => p.with_user_id(user.into()),
        None => p,
    }
}

/// The dead-letter queue on one broker connection.
pub struct DeadLetterQueue<'c> {
    connection: &'c Connection,
    topology: &'c Topology,
    /// The worker's broker user: the `user_id` of republished intents.
    own_user: Option<&'c str>,
}

/// Messages taken from the queue and held unacked until [`Scan::release`].
pub struct Scan {
    channel: Channel,
    /// The messages kept, in queue order.
    pub letters: Vec<DeadLetter>,
    /// Messages read (kept or not).
    pub scanned: usize,
    /// Messages left in the queue behind the last one read (the broker's count then).
    pub remaining: u32,
}

impl<'c> DeadLetterQueue<'c> {
    pub fn new(
        connection: &'c Connection,
        topology: &'c Topology,
        own_user: Option<&'c str>,
    ) -> DeadLetterQueue<'c> {
        DeadLetterQueue {
            connection,
            topology,
            own_user,
        }
    }

    async fn channel(&self, what: &str) -> Result<Channel, AmqpError> {
        self.connection
            .create_channel()
            .await
            .map_err(AmqpError::broker(format!("opening a channel for {what}")))
    }

    /// Messages in the queue now (a passive declare).
    pub async fn depth(&self) -> Result<u32, AmqpError> {
        let channel = self.channel("the dead-letter depth").await?;
        let queue = &self.topology.dead_letter_queue;
        let q = channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(AmqpError::broker(format!("checking queue {queue:?}")))?;
        let _ = channel.close(200, "done".into()).await;
        Ok(q.message_count())
    }

    /// Reads up to `max_scan` messages from the head of the queue, keeping (unacked) the first
    /// `limit` that `keep` accepts; the others are returned to the queue when the scan is
    /// released.
    pub async fn scan(
        &self,
        max_scan: usize,
        limit: usize,
        mut keep: impl FnMut(&DeadLetter) -> bool,
    ) -> Result<Scan, AmqpError> {
        let channel = self.channel("reading dead letters").await?;
        let queue = &self.topology.dead_letter_queue;
        let mut scan = Scan {
            channel,
            letters: Vec::new(),
            scanned: 0,
            remaining: 0,
        };
        while scan.scanned < max_scan.min(MAX_SCAN) && scan.letters.len() < limit {
            let got = scan
                .channel
                .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
                .await;
            let got = match got {
                Ok(got) => got,
                Err(e) => {
                    scan.release().await;
                    return Err(AmqpError::broker(format!("basic.get from {queue:?}"))(e));
                }
            };
            let Some(message) = got else {
                scan.remaining = 0;
                break;
            };
            scan.remaining = message.message_count;
            let letter = DeadLetter::read(&message.delivery, scan.scanned);
            scan.scanned += 1;
            if keep(&letter) {
                scan.letters.push(letter);
            }
        }
        Ok(scan)
    }

    /// Publishes the letter's intent to the intents exchange (mandatory, confirmed), then acks
    /// the dead letter.
    pub async fn republish(
        &self,
        scan: &Scan,
        letter: &DeadLetter,
        request_id: &str,
    ) -> Result<(), AmqpError> {
        let exchange = &self.topology.intents_exchange;
        let channel = self.channel("republishing a dead letter").await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(AmqpError::broker("confirm.select"))?;
        let properties = republish_properties(letter, self.own_user, request_id);
        let confirm = channel
            .basic_publish(
                exchange.as_str().into(),
                letter.routing_key.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                &letter.body,
                properties,
            )
            .await
            .map_err(AmqpError::broker(format!("publishing to {exchange:?}")))?
            .await
            .map_err(AmqpError::broker("the republish confirm"))?;
        let _ = channel.close(200, "done".into()).await;
        match confirm {
            Confirmation::Ack(None) | Confirmation::NotRequested => {}
            Confirmation::Ack(Some(_)) => {
                return Err(AmqpError::NotConfirmed {
                    exchange: exchange.clone(),
                    reason: format!(
                        "unroutable with routing key {:?} (no queue bound)",
                        letter.routing_key
                    ),
                })
            }
            Confirmation::Nack(_) => {
                return Err(AmqpError::NotConfirmed {
                    exchange: exchange.clone(),
                    reason: "nacked".into(),
                })
            }
        }
        self.ack(scan, letter).await
    }

    /// Acks (removes) the dead letter.
    pub async fn ack(&self, scan: &Scan, letter: &DeadLetter) -> Result<(), AmqpError> {
        scan.channel
            .basic_ack(letter.delivery_tag, BasicAckOptions { multiple: false })
            .await
            .map_err(AmqpError::broker("basic.ack of a dead letter"))
    }
}

impl Scan {
    /// Returns every message still held to the queue and closes the channel.
    pub async fn release(self) {
        if self.scanned > 0 {
            let _ = self
                .channel
                .basic_nack(
                    0,
                    BasicNackOptions {
                        multiple: true,
                        requeue: true,
                    },
                )
                .await;
        }
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            self.channel.close(200, "done".into()),
        )
        .await;
    }
}

/// Letters for unit tests elsewhere (a real one needs a broker delivery).
#[cfg(test)]
pub(crate) mod tests_support {
    use super::*;

    pub(crate) fn letter(tenant: Option<&str>, user: Option<&str>, reason: &str) -> DeadLetter {
        let body = format!("{{\"tenant\":{tenant:?},\"action_id\":\"a-1\"}}");
        DeadLetter {
            id: dead_letter_id(Some("m-1"), tenant.unwrap_or(""), body.as_bytes()),
            message_id: Some("m-1".into()),
            routing_key: tenant.unwrap_or("").into(),
            reason: Some(reason.into()),
            detail: None,
            original_user: user.map(str::to_string),
            tenant: tenant.map(str::to_string),
            action_id: Some("a-1".into()),
            headers: Vec::new(),
            body: body.into_bytes(),
            properties: BasicProperties::default(),
            position: 0,
            delivery_tag: 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(user: Option<&str>, headers: &[(&str, &str)]) -> BasicProperties {
        let mut table = FieldTable::default();
        for (k, v) in headers {
            table.insert((*k).into(), AMQPValue::LongString((*v).into()));
        }
        let p = BasicProperties::default().with_headers(table);
        match user {
            Some(u) => p.with_user_id(u.into()),
            None => p,
        }
    }

    #[test]
    fn only_the_workers_own_republish_vouches_for_an_original_user() {
        let worker = Some("intent-worker");
        let republished = [(REPUBLISHED_HEADER, "r-1"), (USER_HEADER, "alice")];
        // The worker republished alice's intent: alice is the publisher to prove.
        assert_eq!(
            proven_user(&props(Some("intent-worker"), &republished), worker).as_deref(),
            Some("alice")
        );
        // Anybody else setting the headers proves only themselves.
        assert_eq!(
            proven_user(&props(Some("mallory"), &republished), worker).as_deref(),
            Some("mallory")
        );
        assert_eq!(proven_user(&props(None, &republished), worker), None);
        // The worker's own message without the republish header is the worker's.
        assert_eq!(
            proven_user(
                &props(Some("intent-worker"), &[(USER_HEADER, "alice")]),
                worker
            )
            .as_deref(),
            Some("intent-worker")
        );
        // A republish of a message that had no user proves no user.
        assert_eq!(
            proven_user(
                &props(Some("intent-worker"), &[(REPUBLISHED_HEADER, "r")]),
                worker
            ),
            None
        );
        // No own user known: the header is never trusted.
        assert_eq!(
            proven_user(&props(Some("intent-worker"), &republished), None).as_deref(),
            Some("intent-worker")
        );
    }

    #[test]
    fn the_broker_user_comes_from_the_first_url() {
        assert_eq!(
            broker_user("amqp://worker:pw@rabbit:5672/%2f").as_deref(),
            Some("worker")
        );
        assert_eq!(
            broker_user("amqp://a:x@r1/%2f,amqp://b:y@r2/%2f").as_deref(),
            Some("a")
        );
        assert_eq!(broker_user("amqp://rabbit/%2f").as_deref(), Some("guest"));
    }

    #[test]
    fn a_republish_carries_the_body_key_and_original_user_without_dead_letter_headers() {
        let original = props(
            None,
            &[
                (REASON_HEADER, "unknown_tool"),
                (DETAIL_HEADER, "no tool x"),
                (USER_HEADER, "alice"),
                ("x-original-routing-key", "north"),
                ("x-first-death-reason", "rejected"),
                (
                    "traceparent",
                    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                ),
            ],
        )
        .with_message_id("north:a-1".into())
        .with_content_type("application/json".into());
        let delivery_like = DeadLetter {
            id: "x".into(),
            message_id: Some("north:a-1".into()),
            routing_key: "north".into(),
            reason: Some("unknown_tool".into()),
            detail: None,
            original_user: Some("alice".into()),
            tenant: Some("north".into()),
            action_id: Some("a-1".into()),
            headers: Vec::new(),
            body: b"{}".to_vec(),
            properties: original,
            position: 0,
            delivery_tag: 1,
        };
        let p = republish_properties(&delivery_like, Some("intent-worker"), "req-1");
        assert_eq!(p.user_id().as_ref().unwrap().as_str(), "intent-worker");
        assert_eq!(p.message_id().as_ref().unwrap().as_str(), "north:a-1");
        let h = p.headers().as_ref();
        assert_eq!(header_text(h, REPUBLISHED_HEADER).as_deref(), Some("req-1"));
        assert_eq!(header_text(h, USER_HEADER).as_deref(), Some("alice"));
        assert!(header_text(h, "traceparent").is_some());
        for gone in [
            REASON_HEADER,
            DETAIL_HEADER,
            "x-original-routing-key",
            "x-first-death-reason",
        ] {
            assert_eq!(header_text(h, gone), None, "{gone}");
        }
        assert_eq!(
            proven_user(&p, Some("intent-worker")).as_deref(),
            Some("alice")
        );
    }

    #[test]
    fn ids_differ_by_message_id_routing_key_and_body() {
        let a = dead_letter_id(Some("m"), "k", b"body");
        assert_eq!(a.len(), 16);
        assert_eq!(a, dead_letter_id(Some("m"), "k", b"body"));
        assert_ne!(a, dead_letter_id(None, "k", b"body"));
        assert_ne!(a, dead_letter_id(Some("m"), "k2", b"body"));
        assert_ne!(a, dead_letter_id(Some("m"), "k", b"body2"));
    }
}
