//! The broker managed as code. `deploy/rabbitmq/definitions.json` is imported
//! (`rabbitmqctl import_definitions`) into a fresh vhost with unique user names, and a worker
//! with `WORKER_DECLARE_TOPOLOGY=false` runs on it as its own least-privileged user while the
//! tenant's user publishes with `user_id` proof; a worker with declaration off on an empty vhost
//! stops with an error naming the missing queue.

use std::process::Command;
use std::time::Duration;

use e2e::{cleanup, rabbitmqctl, Agent, Downstream, Env, Worker, WorkerOptions};
use serde_json::{json, Value};

/// A vhost and users that exist for one test; deleted on drop.
struct Imported {
    vhost: String,
    users: Vec<String>,
}

impl Drop for Imported {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl")
            .args(["delete_vhost", &self.vhost])
            .output();
        for u in &self.users {
            let _ = Command::new("rabbitmqctl")
                .args(["delete_user", u])
                .output();
        }
    }
}

/// Imports the repository's definitions with the vhost renamed to `vhost` and every user
/// renamed to `<name>-<suffix>` (so the shared broker's own users are left alone).
fn import_definitions(env: &Env, vhost: &str, suffix: &str) -> Imported {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/rabbitmq/definitions.json"
    );
    let mut defs: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let rename = |v: &mut Value| {
        let name = v.as_str().unwrap().to_string();
        *v = json!(format!("{name}-{suffix}"));
    };
    let mut users = Vec::new();
    for u in defs["users"].as_array_mut().unwrap() {
        rename(&mut u["name"]);
        users.push(u["name"].as_str().unwrap().to_string());
    }
    for section in ["permissions", "topic_permissions"] {
        for p in defs[section].as_array_mut().unwrap() {
            rename(&mut p["user"]);
        }
    }
    defs["vhosts"] = json!([{ "name": vhost }]);
    for section in [
        "permissions",
        "topic_permissions",
        "policies",
        "queues",
        "exchanges",
        "bindings",
    ] {
        for item in defs[section].as_array_mut().unwrap() {
            item["vhost"] = json!(vhost);
        }
    }
    let file = env.dir.join("definitions.json");
    std::fs::write(&file, serde_json::to_vec_pretty(&defs).unwrap()).unwrap();
    let imported = Imported {
        vhost: vhost.to_string(),
        users,
    };
    rabbitmqctl(&["import_definitions", file.to_str().unwrap()]);
    imported
}

fn url(user: &str, password: &str, vhost: &str) -> String {
    format!("amqp://{user}:{password}@127.0.0.1:5672/{vhost}")
}

/// The names definitions.json uses (the worker's defaults). Clean-up (also on a panic) deletes
/// the test's names through `env.amqp_url`, so it is pointed at the test's vhost at once (as
/// `admin_url`), never at `/`, where `intents` may belong to someone else.
fn default_names(env: &mut Env, admin_url: String) {
    env.amqp_url = admin_url;
    let t = &mut env.topology;
    t.intents_exchange = "intents".into();
    t.intents_queue = "intents".into();
    t.results_exchange = "results".into();
    t.dead_letter_exchange = "intents.dlx".into();
    t.dead_letter_queue = "intents.dead".into();
}

#[tokio::test]
async fn worker_runs_on_imported_definitions_without_declaring() {
    let mut env = Env::new().await;
    let suffix = env.id.clone();
    let vhost = format!("defs-{suffix}");
    default_names(&mut env, url(&format!("guest-{suffix}"), "guest", &vhost));
    let imported = import_definitions(&env, &vhost, &suffix);
    let worker_user = format!("intent-worker-{suffix}");
    let tenant_user = format!("demo-shop-{suffix}");

    // Delivery limit, dead-lettering and the dead-letter queue's bounds come from policies.
    let out = Command::new("rabbitmqctl")
        .args(["list_queues", "-q", "-p", &vhost, "name", "type", "policy"])
        .output()
        .unwrap();
    let queues = String::from_utf8_lossy(&out.stdout);
    for expected in [
        "intents\tquorum\tintents",
        "intents.dead\tquorum\tintents-dead",
    ] {
        assert!(
            queues.lines().any(|l| l.trim() == expected),
            "{expected:?} in:\n{queues}"
        );
    }

    let ds = Downstream::start(&env).await;
    let tools = env.standard_tools(ds.port, "");
    let mut toml = std::fs::read_to_string(&tools).unwrap();
    toml.push_str(&format!(
        "\n[auth]\nmode = \"user_id\"\nusers = {{ \"{tenant_user}\" = [\"demo-shop\"] }}\n"
    ));
    let tools = env.write_tools(&toml);
    let opts = WorkerOptions::new(tools)
        .amqp_url(&url(&worker_user, "intent-worker-demo", &vhost))
        .env("WORKER_DECLARE_TOPOLOGY", "false");
    let mut w = Worker::start(&env, "w1", &opts).await;

    // The agent is the tenant's own broker user: its permissions (write on `intents` with
    // routing key `demo-shop`, its own result queues) come from the definitions alone.
    let admin_url = std::mem::replace(
        &mut env.amqp_url,
        url(&tenant_user, "demo-shop-demo", &vhost),
    );
    let mut agent = Agent::new(&env, &["demo-shop"]).await;
    agent
        .request(
            "demo-shop",
            "refund-{1}",
            "refund",
            json!({"order": "order-1", "amount_cents": 100}),
        )
        .await;
    let ev = agent.succeeded("demo-shop", "refund-{1}").await;
    assert!(ev.receipt.is_some(), "succeeded carries the receipt");
    assert_eq!(
        env.mutations("demo-shop:refund-{1}").await,
        1,
        "one mutation"
    );
    assert!(
        !w.output.contains("exists with other"),
        "the worker declared nothing"
    );

    // The topic permission keeps the tenant's user to its own routing key: a publish addressed
    // to another tenant is refused by the broker itself.
    let conn = lapin::Connection::connect(&env.amqp_url, Default::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let refused = async {
        ch.basic_publish(
            "intents".into(),
            "north-shop".into(),
            Default::default(),
            b"{}",
            lapin::BasicProperties::default(),
        )
        .await?
        .await
    }
    .await;
    let text = format!("{refused:?}");
    assert!(text.contains("ACCESS_REFUSED"), "refused: {text}");
    let _ = conn.close(200, "".into()).await;

    drop(agent);
    assert_eq!(w.terminate_async(Duration::from_secs(15)).await, Some(0));
    env.amqp_url = admin_url;
    drop(ds);
    cleanup(env).await;
    drop(imported);
}

#[tokio::test]
async fn worker_without_declaration_on_an_empty_vhost_exits_naming_the_queue() {
    let mut env = Env::new().await;
    let vhost = format!("defs-empty-{}", env.id);
    default_names(&mut env, url("guest", "guest", &vhost));
    rabbitmqctl(&["add_vhost", &vhost]);
    let imported = Imported {
        vhost: vhost.clone(),
        users: vec![],
    };
    rabbitmqctl(&["set_permissions", "-p", &vhost, "guest", ".*", ".*", ".*"]);
    let tools = env.standard_tools(9, "");
    let opts = WorkerOptions::new(tools)
        .amqp_url(&url("guest", "guest", &vhost))
        .env("WORKER_DECLARE_TOPOLOGY", "false");
    let mut w = Worker::spawn(&env, "w1", &opts);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = w.exit_status() {
            break s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the worker still runs on an empty vhost; output:\n{}",
            w.output.text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(!status.success(), "exits with an error");
    let text = w.output.text();
    assert!(
        text.contains(r#"RabbitMQ has no intents queue "intents""#),
        "names the missing queue; output:\n{text}"
    );
    assert!(!text.contains("consuming intents"));
    cleanup(env).await;
    drop(imported);
}
