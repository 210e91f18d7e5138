//! Process lifecycle: restart keeps the data, signals exit cleanly, bad
//! configuration fails loudly, odd requests are refused and still logged.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{Downstream, Reply, TestDb};
use serde_json::json;

#[tokio::test]
async fn restart_keeps_replay_data_and_forgets_faults() {
    let db = TestDb::create().await;
    let ds = Downstream::start(&db).await;
    let key = "t:restart";
    let body = json!({"amount": "48.50"});
    let original = ds.post("/replay/refunds", Some(key), &body).await.http();
    ds.arm(json!({"kind": "status"})).await;
    ds.kill().await;

    let ds = Downstream::start(&db).await;
    let replayed = ds.post("/replay/refunds", Some(key), &body).await.http();
    assert_eq!(
        replayed.status, 201,
        "the fault did not survive the restart"
    );
    assert_eq!(replayed.body, original.body);
    assert_eq!(db.mutations(key).await, 1);
    assert_eq!(db.write_requests(key).await, 2);
    ds.kill().await;
    db.drop_db().await;
}

#[tokio::test]
async fn sigterm_exits_cleanly() {
    let db = TestDb::create().await;
    let mut ds = Downstream::start(&db).await;
    let pid = ds.child.id().unwrap().to_string();
    let killed = tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .unwrap();
    assert!(killed.success());
    let status = tokio::time::timeout(Duration::from_secs(10), ds.child.wait())
        .await
        .expect("exit within 10 s")
        .unwrap();
    assert!(status.success(), "{status:?}");
    db.drop_db().await;
}

#[tokio::test]
async fn missing_database_url_is_a_clear_error() {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_reference-downstream"))
        .env_remove("DOWNSTREAM_DATABASE_URL")
        .stdout(Stdio::null())
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("DOWNSTREAM_DATABASE_URL"));
}

#[tokio::test]
async fn custom_schema_and_refused_requests() {
    let db = TestDb::create().await;
    let ds = Downstream::start_with(&db, &[("DOWNSTREAM_SCHEMA", "shop_2")]).await;
    let r = ds.post("/none/refunds", Some("k"), &json!({})).await.http();
    assert_eq!(r.status, 201);
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM shop_2.mutations WHERE idem_key = $1")
        .bind("k")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 1);

    let big = vec![b'x'; 1024 * 1024 + 1];
    let r = common::send(
        ds.port,
        "POST",
        "/none/refunds",
        &[("Idempotency-Key", "big")],
        &big,
    )
    .await;
    match r {
        Reply::Http(r) => assert_eq!(r.status, 413),
        other => panic!("expected 413, got {other:?}"),
    }
    let status: Option<i32> =
        sqlx::query_scalar("SELECT status FROM shop_2.requests WHERE idem_key = 'big'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(status, Some(413));

    let r = common::send(ds.port, "POST", "/none/refunds", &[], b"not json")
        .await
        .http();
    assert_eq!(r.status, 400);
    ds.kill().await;
    db.drop_db().await;
}
