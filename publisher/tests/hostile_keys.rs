//! An action key `<tenant>:<action_id>` over the 255 bytes of an AMQP short string (each field
//! may be 200 characters), and any other name or value too long for one (routing key, exchange,
//! queue, content type), is refused by every publishing call with a typed error, never a panic
//! (lapin's `From<String> for ShortString` panics above 255 bytes); the other intents of a
//! batch are still sent. Against the real RabbitMQ at 127.0.0.1:5672, or `TEST_AMQP_URL` /
//! `AMQP_URL`.

mod support;

use std::time::Duration;

use lapin::{
    options::{BasicGetOptions, ExchangeDeleteOptions},
    Connection, ConnectionProperties,
};
use protocol::DecodeError;
use publisher::publish::Encoded;
use publisher::{Follower, PublishError, Publisher, WaitError};
use support::{amqp_url, bound_queue, unique};

/// An intent built by hand, as an agent would, never through the decoder.
fn intent(tenant: &str, action_id: &str) -> protocol::Intent {
    protocol::Intent {
        tenant: tenant.into(),
        action_id: action_id.into(),
        tool: "refund".into(),
        arguments: serde_json::json!({"order": "order-731"}),
        call_id: None,
        reply_to: None,
        compensates: None,
    }
}

/// The longest tenant: 200 characters.
fn tenant() -> String {
    "T".repeat(200)
}

fn key_too_long(error: &PublishError, len: usize) -> bool {
    matches!(
        error,
        PublishError::InvalidIntent(DecodeError::KeyTooLong { len: l, max: 255 }) if *l == len
    )
}

async fn message_ids(connection: &Connection, queue: &str) -> Vec<String> {
    let channel = connection.create_channel().await.expect("channel");
    let mut ids = Vec::new();
    while let Some(m) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .expect("get")
    {
        ids.push(
            m.delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string())
                .unwrap_or_default(),
        );
    }
    ids
}

#[tokio::test]
async fn every_publish_call_refuses_a_key_over_255_bytes() {
    let tenant = tenant();
    let exchange = unique("intents");
    let publisher = Publisher::connect(&amqp_url(), &exchange)
        .await
        .expect("connect");
    publisher.declare_exchange().await.expect("declare");
    let (connection, _channel, queue) = bound_queue(&exchange, "#").await;
    let queue = queue.name().as_str().to_owned();

    let fits = intent(&tenant, &"b".repeat(54));
    let over = intent(&tenant, &"b".repeat(55));
    let far_over = intent(&tenant, &"b".repeat(200));

    let error = publisher.publish(&over).await.expect_err("256 bytes");
    assert!(key_too_long(&error, 256), "{error:?}");
    assert!(error.to_string().contains("256 bytes"), "{error}");
    let error = publisher
        .publish_encoded(&far_over.tenant, &far_over.action_id, &far_over.to_json())
        .await
        .expect_err("401 bytes");
    assert!(key_too_long(&error, 401), "{error:?}");
    let error = publisher
        .send_and_wait(&over, Duration::from_secs(5))
        .await
        .expect_err("refused before anything is bound or sent");
    assert!(
        matches!(&error, WaitError::Publish(e) if key_too_long(e, 256)),
        "{error:?}"
    );

    // One bad intent in a batch fails alone; the others are published.
    let (a, b, c) = (fits.to_json(), over.to_json(), fits.to_json());
    let batch = [
        Encoded {
            tenant: &fits.tenant,
            action_id: &fits.action_id,
            body: &a,
        },
        Encoded {
            tenant: &over.tenant,
            action_id: &over.action_id,
            body: &b,
        },
        Encoded {
            tenant: &fits.tenant,
            action_id: &fits.action_id,
            body: &c,
        },
    ];
    let results = publisher.publish_batch(&batch).await;
    assert!(results[0].is_ok(), "{:?}", results[0]);
    assert!(
        matches!(&results[1], Err(e) if key_too_long(e, 256)),
        "{:?}",
        results[1]
    );
    assert!(results[2].is_ok(), "{:?}", results[2]);

    // The longest key that fits goes out intact, and the publisher still works.
    publisher.publish(&fits).await.expect("255 bytes fit");
    assert!(publisher.is_connected());
    let key = format!("{tenant}:{}", "b".repeat(54));
    assert_eq!(key.len(), 255);
    assert_eq!(message_ids(&connection, &queue).await, vec![key; 3]);

    connection.close(200, "OK".into()).await.ok();
    publisher.close().await.ok();
    delete(&exchange).await;
}

#[tokio::test]
async fn names_over_255_bytes_are_errors_not_panics() {
    let exchange = unique("intents");
    let long = "x".repeat(256);

    let error = Publisher::connect(&amqp_url(), &format!("{exchange}-{long}"))
        .await
        .err()
        .expect("an exchange name of 256 bytes or more");
    assert!(matches!(error, PublishError::TooLong { .. }), "{error:?}");

    let publisher = Publisher::connect(&amqp_url(), &exchange)
        .await
        .expect("connect");
    publisher.declare_exchange().await.expect("declare");
    let error = publisher
        .publish_raw(&long, b"{}", Some("application/json"))
        .await
        .expect_err("routing key of 256 bytes");
    assert!(matches!(error, PublishError::TooLong { .. }), "{error:?}");
    assert!(error.to_string().contains("256 bytes"), "{error}");
    let error = publisher
        .publish_raw("north-shop", b"{}", Some(&long))
        .await
        .expect_err("content type of 256 bytes");
    assert!(matches!(error, PublishError::TooLong { .. }), "{error:?}");
    assert!(publisher.is_connected(), "nothing reached the channel");

    // A follower for a tenant whose binding key `<tenant>.@.#` is too long, or on a queue name
    // that is, is refused the same way.
    let results = unique("results");
    let error = Follower::follow(&amqp_url(), &results, &"t".repeat(253), None)
        .await
        .err()
        .expect("binding key of 257 bytes");
    assert!(matches!(error, PublishError::TooLong { .. }), "{error:?}");
    let error = Follower::follow(&amqp_url(), &results, "north-shop", Some(&long))
        .await
        .err()
        .expect("queue name of 256 bytes");
    assert!(matches!(error, PublishError::TooLong { .. }), "{error:?}");

    publisher.close().await.ok();
    delete(&exchange).await;
    delete(&results).await;
}

async fn delete(exchange: &str) {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("connect for clean-up");
    let channel = connection.create_channel().await.expect("channel");
    channel
        .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
        .await
        .ok();
    connection.close(200, "OK".into()).await.ok();
}
