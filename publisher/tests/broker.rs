//! Publisher and follower against the real RabbitMQ at 127.0.0.1:5672 (guest/guest),
//! or `TEST_AMQP_URL` / `AMQP_URL`. Every test uses its own exchange names and deletes them at
//! the end.

mod support;

use std::time::Duration;

use lapin::{
    options::{BasicGetOptions, ExchangeDeleteOptions},
    Connection, ConnectionProperties,
};
use publisher::{Follower, PublishError, Publisher};
use support::{amqp_url, bound_queue, unique};

async fn delete_exchanges(names: &[&str]) {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("connect for clean-up");
    let channel = connection.create_channel().await.expect("channel");
    for name in names {
        channel
            .exchange_delete((*name).into(), ExchangeDeleteOptions::default())
            .await
            .expect("delete exchange");
    }
    connection.close(200, "OK".into()).await.ok();
}

fn intent(tenant: &str, action_id: &str) -> protocol::Intent {
    let body = serde_json::json!({
        "tenant": tenant,
        "action_id": action_id,
        "tool": "refund",
        "arguments": {"order": "order-731", "amount_cents": 4850, "currency": "USD"},
        "call_id": "model-call-1",
    });
    protocol::decode_intent(&serde_json::to_vec(&body).unwrap()).expect("valid intent")
}

fn result_json(tenant: &str, action_id: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "tenant": tenant, "action_id": action_id, "tool": "refund", "status": "pending",
        "receipt": null, "next_action": "check_status", "attempts": 1,
        "message": "The refund outcome is unknown. Do not submit it again.",
        "fingerprint": "ab", "event_id": "e-1", "occurred_at": "2025-01-01T00:00:00Z"
    }))
    .unwrap()
}

#[tokio::test]
async fn publish_without_a_bound_queue_is_unroutable() {
    let exchange = unique("intents");
    let publisher = Publisher::connect(&amqp_url(), &exchange)
        .await
        .expect("connect");
    publisher.declare_exchange().await.expect("declare");
    publisher
        .declare_exchange()
        .await
        .expect("declare is idempotent");

    let error = publisher
        .publish(&intent("north-shop", "refund-204"))
        .await
        .expect_err("no queue is bound");
    match &error {
        PublishError::Unroutable {
            exchange: e,
            routing_key,
            reply_text,
        } => {
            assert_eq!(e, &exchange);
            assert_eq!(routing_key, "north-shop");
            assert_eq!(reply_text, "NO_ROUTE");
        }
        other => panic!("expected Unroutable, got {other:?}"),
    }
    assert!(error.to_string().contains("unroutable"), "{error}");

    // The channel stays usable after a return.
    let again = publisher.publish_raw("north-shop", b"x", None).await;
    assert!(
        matches!(again, Err(PublishError::Unroutable { .. })),
        "{again:?}"
    );

    publisher.close().await.expect("close");
    delete_exchanges(&[&exchange]).await;
}

#[tokio::test]
async fn publish_sets_key_properties_and_body() {
    let exchange = unique("intents");
    let publisher = Publisher::connect(&amqp_url(), &exchange)
        .await
        .expect("connect");
    publisher.declare_exchange().await.expect("declare");
    assert!(publisher.exchange_exists().await.expect("probe"));

    // A queue bound for the tenant, as the worker would have.
    let (connection, channel, queue) = bound_queue(&exchange, "north-shop").await;

    let intent = intent("north-shop", "refund-204");
    publisher
        .publish(&intent)
        .await
        .expect("routed and confirmed");
    publisher
        .publish(&intent)
        .await
        .expect("the same action again");

    let mut ids = Vec::new();
    for _ in 0..2 {
        let message = channel
            .basic_get(queue.name().clone(), BasicGetOptions { no_ack: true })
            .await
            .expect("get")
            .expect("a message");
        let properties = &message.delivery.properties;
        assert_eq!(message.delivery.routing_key.as_str(), "north-shop");
        assert_eq!(message.delivery.data, intent.to_json());
        assert_eq!(
            properties.content_type().as_ref().map(|s| s.as_str()),
            Some("application/json")
        );
        assert_eq!(*properties.delivery_mode(), Some(2));
        // Tenant proof: the connection's user, which RabbitMQ validates.
        assert_eq!(
            properties.user_id().as_ref().map(|s| s.as_str()),
            Some("guest")
        );
        ids.push(properties.message_id().as_ref().map(|s| s.to_string()));
    }
    // The logical key, never a fresh id per publish.
    assert_eq!(ids, vec![Some("north-shop:refund-204".to_string()); 2]);

    connection.close(200, "OK".into()).await.ok();
    publisher.close().await.expect("close");
    delete_exchanges(&[&exchange]).await;
}

/// `compensate` sends the intent with `compensates` set, under its own key; an original the
/// worker's decoder would refuse is refused before anything is sent.
#[tokio::test]
async fn compensate_publishes_the_intent_with_compensates() {
    let exchange = unique("intents");
    let publisher = Publisher::connect(&amqp_url(), &exchange)
        .await
        .expect("connect");
    publisher.declare_exchange().await.expect("declare");
    let (connection, channel, queue) = bound_queue(&exchange, "north-shop").await;

    let undo = intent("north-shop", "cancel-refund-204");
    let error = publisher
        .compensate("refund 204", &undo)
        .await
        .expect_err("not an action id");
    assert!(
        matches!(&error, PublishError::InvalidIntent(e) if e.code() == "invalid_characters"),
        "{error:?}"
    );
    publisher
        .compensate("refund-204", &undo)
        .await
        .expect("routed and confirmed");

    let message = channel
        .basic_get(queue.name().clone(), BasicGetOptions { no_ack: true })
        .await
        .expect("get")
        .expect("a message");
    let sent = protocol::decode_intent(&message.delivery.data).expect("a valid intent");
    assert_eq!(sent, publisher::compensating(undo, "refund-204"));
    assert_eq!(
        message
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str()),
        Some("north-shop:cancel-refund-204")
    );
    // The refused one was never sent.
    let more = channel
        .basic_get(queue.name().clone(), BasicGetOptions { no_ack: true })
        .await
        .expect("get");
    assert!(more.is_none());

    connection.close(200, "OK".into()).await.ok();
    publisher.close().await.expect("close");
    delete_exchanges(&[&exchange]).await;
}

#[tokio::test]
async fn missing_exchange_is_reported_not_created() {
    let exchange = unique("absent");
    let publisher = Publisher::connect(&amqp_url(), &exchange)
        .await
        .expect("connect");
    assert!(!publisher.exchange_exists().await.expect("probe"));
    // The probe used its own channel: publishing reports the missing exchange.
    let error = publisher
        .publish(&intent("north-shop", "refund-1"))
        .await
        .expect_err("no such exchange");
    assert!(matches!(error, PublishError::Amqp(_)), "{error:?}");
}

#[tokio::test]
async fn follower_receives_published_results() {
    let results = unique("results");
    let tenant = unique("tenant");
    let mut follower = Follower::follow(&amqp_url(), &results, &tenant, None)
        .await
        .expect("follow");
    assert!(
        follower.queue().starts_with("amq.gen-"),
        "{}",
        follower.queue()
    );

    let publisher = Publisher::connect(&amqp_url(), &results)
        .await
        .expect("connect");
    publisher
        .declare_exchange()
        .await
        .expect("same declaration as the follower");
    publisher
        .publish_raw(
            &tenant,
            &result_json(&tenant, "refund-204"),
            Some("application/json"),
        )
        .await
        .expect("routed to the follower");
    // Another tenant's result is not routed to this follower.
    let other = publisher
        .publish_raw(
            "someone-else",
            &result_json("someone-else", "x"),
            Some("application/json"),
        )
        .await;
    assert!(
        matches!(other, Err(PublishError::Unroutable { .. })),
        "{other:?}"
    );

    let event = follower
        .next(Duration::from_secs(5))
        .await
        .expect("next")
        .expect("a result");
    assert_eq!(event.tenant, tenant);
    assert_eq!(event.action_id, "refund-204");
    assert_eq!(event.status, protocol::Status::Pending);
    assert_eq!(event.attempts, 1);
    assert_eq!(event.next_action.as_deref(), Some("check_status"));
    assert!(event.receipt.is_none());

    // A body that is not a result event is an error; the follower goes on.
    publisher
        .publish_raw(&tenant, b"{not json", Some("application/json"))
        .await
        .expect("routed");
    publisher
        .publish_raw(&tenant, &result_json(&tenant, "refund-205"), None)
        .await
        .expect("routed");
    let bad = follower.next(Duration::from_secs(5)).await;
    assert!(matches!(bad, Err(PublishError::BadResult(_))), "{bad:?}");
    let event = follower
        .next(Duration::from_secs(5))
        .await
        .expect("next")
        .expect("a result");
    assert_eq!(event.action_id, "refund-205");

    // Nothing else: timeout.
    assert!(follower
        .next(Duration::from_millis(200))
        .await
        .expect("next")
        .is_none());

    publisher.close().await.expect("close");
    follower.close().await.expect("close");
    delete_exchanges(&[&results]).await;
}

#[tokio::test]
async fn follower_timeout_returns_none() {
    let results = unique("results");
    let mut follower = Follower::follow(&amqp_url(), &results, "quiet-tenant", None)
        .await
        .expect("follow");
    let started = std::time::Instant::now();
    let next = follower
        .next(Duration::from_millis(300))
        .await
        .expect("next");
    assert!(next.is_none());
    assert!(started.elapsed() >= Duration::from_millis(300));
    follower.close().await.expect("close");
    delete_exchanges(&[&results]).await;
}
