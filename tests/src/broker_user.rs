//! Second broker users for tenant-proof tests: a RabbitMQ user that exists for one test
//! (created with `rabbitmqctl`, so the broker must run on this machine; deleted on drop), and
//! publishing as that user with the broker-validated AMQP `user_id` property.

use std::process::Command;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};

use crate::env::Env;

/// A RabbitMQ user with a unique name and full permissions on vhost `/`.
pub struct BrokerUser {
    pub name: String,
    pub password: String,
}

impl BrokerUser {
    /// Creates `<prefix>-<unique>` with a random password.
    pub fn create(prefix: &str) -> BrokerUser {
        let name = format!("{prefix}-{}", uuid::Uuid::new_v4().simple());
        let password = uuid::Uuid::new_v4().simple().to_string();
        rabbitmqctl(&["add_user", &name, &password]);
        let user = BrokerUser { name, password };
        rabbitmqctl(&["set_permissions", "-p", "/", &user.name, ".*", ".*", ".*"]);
        user
    }

    /// The test broker's URL with this user's credentials instead of the test's own.
    pub fn url(&self, env: &Env) -> String {
        let (scheme, rest) = env.amqp_url.split_once("://").expect("amqp URL");
        let host_and_path = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
        format!("{scheme}://{}:{}@{host_and_path}", self.name, self.password)
    }
}

impl Drop for BrokerUser {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl")
            .args(["delete_user", &self.name])
            .output();
    }
}

/// Runs `rabbitmqctl` and fails the test if it fails.
pub fn rabbitmqctl(args: &[&str]) {
    let out = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("rabbitmqctl (run the tests as a user that may use it)");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Publishes `bodies` to the test's intents exchange on one confirmed connection to `url` (as
/// that URL's user), with the AMQP `user_id` property set to `user_id` when given (RabbitMQ
/// refuses a `user_id` other than the connection's user, which is what makes it proof).
pub async fn publish_as(
    env: &Env,
    url: &str,
    user_id: Option<&str>,
    routing_key: &str,
    bodies: &[&[u8]],
) {
    let conn = lapin::Connection::connect(url, Default::default())
        .await
        .expect("connect as publisher");
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for body in bodies {
        let mut props =
            lapin::BasicProperties::default().with_content_type("application/json".into());
        if let Some(u) = user_id {
            props = props.with_user_id(u.into());
        }
        let confirm = ch
            .basic_publish(
                env.topology.intents_exchange.as_str().into(),
                routing_key.into(),
                BasicPublishOptions::default(),
                body,
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack(), "the broker confirmed the publish");
    }
    let _ = conn.close(200, "".into()).await;
}
