//! The fault matrix (docs/recovery.md, "Crash matrix"): five worker crash points
//! plus "response dropped after the downstream committed", for each of the three capabilities,
//! and for `lookup` with `absence_proof` (the tool `ticket` again, its writes carrying deadlines).
//! Real worker processes are SIGKILLed at named points and a fresh worker recovers; counts of
//! mutations and write requests come from the reference downstream's tables.

use std::time::Duration;

use e2e::{cleanup, intent, Agent, Downstream, Env, Worker, WorkerOptions};
use protocol::Status;
use serde_json::json;

const T: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy)]
struct Expect {
    mutations: i64,
    writes: i64,
    state: &'static str,
}

const fn ok(mutations: i64, writes: i64) -> Expect {
    Expect {
        mutations,
        writes,
        state: "succeeded",
    }
}

const fn held(mutations: i64, writes: i64) -> Expect {
    Expect {
        mutations,
        writes,
        state: "held",
    }
}

/// Crash at `point` (or, for "drop_after_commit", lose the response after the downstream
/// committed), recover with a fresh worker, and check the seed's required outcome.
async fn case(point: &str, column: &str, expect: Expect) {
    let env = Env::new().await;
    let ds = Downstream::start(&env).await;
    let proven = column == "ticket-proven";
    let (tool, tools) = if proven {
        ("ticket", proven_ticket(&env, ds.port))
    } else {
        (column, env.standard_tools(ds.port, ""))
    };
    // A worker stopped after its completion committed (`after_succeeded`) holds that event
    // for its own relay; the next worker publishes it once the hold has passed. A short hold
    // (fault-point builds only) keeps that inside the wait below.
    let mut opts = WorkerOptions::new(tools).env("WORKER_FAULT_RELAY_HOLD_SECS", "4");
    if proven {
        opts.lease_secs = 5;
    }
    let tenant = "north-shop";
    let action = format!("{column}-{point}");
    let key = format!("{tenant}:{action}");
    let args = json!({"order": "order-731", "amount_cents": 4850, "currency": "USD"});

    let mut first = if point == "drop_after_commit" {
        ds.fault(json!({"kind": "drop_after_commit", "key": key}))
            .await;
        Worker::start(&env, "w1", &opts).await
    } else {
        Worker::start(&env, "w1", &opts.clone().fault(point, Some(&action))).await
    };
    let mut agent = Agent::new(&env, &[tenant]).await;
    agent.send(&intent(tenant, &action, tool, args)).await;
    let _second = if point == "drop_after_commit" {
        None
    } else {
        first
            .wait_output(&format!("fault point reached: {point}"), T)
            .await;
        first.kill();
        Some(Worker::start(&env, "w2", &opts).await)
    };

    let final_state = e2e::wait_for(&format!("{point}/{tool} to settle"), T, || async {
        let s = env.state(tenant, &action).await;
        (s == "succeeded" || s == "held" || s == "failed").then_some(s)
    })
    .await;
    assert_eq!(
        final_state, expect.state,
        "{point}/{tool}: final ledger state"
    );
    let events = match expect.state {
        "succeeded" => agent.until(tenant, &action, Status::Succeeded, T).await,
        _ => agent.until(tenant, &action, Status::Pending, T).await,
    };
    // Let any stray retry show itself before counting.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        env.mutations(&key).await,
        expect.mutations,
        "{point}/{tool}: mutations"
    );
    assert_eq!(
        env.writes(&key).await,
        expect.writes,
        "{point}/{tool}: write requests sent"
    );
    assert_eq!(
        env.state(tenant, &action).await,
        expect.state,
        "{point}/{tool}: state is stable"
    );
    let row = env.operation(tenant, &action).await.unwrap();
    let last = events.last().unwrap();
    if expect.state == "succeeded" {
        let original = env
            .downstream_receipt(&key)
            .await
            .expect("downstream receipt");
        assert_eq!(
            row.receipt.as_ref(),
            Some(&original),
            "{point}/{tool}: ledger keeps the original receipt"
        );
        assert_eq!(
            last.receipt.as_ref(),
            Some(&original),
            "{point}/{tool}: the agent gets the original receipt"
        );
    } else {
        assert!(row.receipt.is_none());
        assert!(
            events
                .iter()
                .all(|e| e.status == Status::Pending && e.receipt.is_none()),
            "{point}/{tool}: only pending answers, never a guess: {events:?}"
        );
        // Nothing more arrives that would claim success or failure.
        if let Some(extra) = agent.try_next(tenant, Duration::from_millis(500)).await {
            assert_eq!(extra.status, Status::Pending, "{point}/{tool}: {extra:?}");
        }
    }
    drop(first);
    cleanup(env).await;
}

/// The lookup tool `ticket` with `absence_proof`: a 2.5 s deadline past a 1.5 s timeout, 300 ms
/// of clock skew (the worker's lease is 5 s).
fn proven_ticket(env: &Env, port: u16) -> std::path::PathBuf {
    let base = format!("http://127.0.0.1:{port}");
    env.write_tools(&format!(
        "[tools.ticket]\nurl = \"{base}/lookup/tickets\"\nrecovery = \"lookup\"\n\
         lookup_url = \"{base}/lookup/tickets/by-key/{{key}}\"\nreceipt_id = \"/receipt_id\"\n\
         receipt_match = {{ \"/idempotency_key\" = \"{{tenant}}:{{action_id}}\" }}\n\
         timeout_ms = 1500\nrecovery_attempts = 3\nretry = {{ initial_delay_ms = 100, max_delay_ms = 1000 }}\n\
         absence_proof = {{ deadline_ms = 2500, clock_skew_ms = 300 }}\n"
    ))
}

macro_rules! matrix {
    ($($name:ident: $point:literal, $tool:literal => $expect:expr;)*) => {
        $(
            #[tokio::test]
            async fn $name() {
                case($point, $tool, $expect).await;
            }
        )*
    };
}

// refund = replay, ticket = lookup, deploy = none (tests/src/env.rs); ticket-proven = lookup
// with absence_proof.
matrix! {
    after_prepared_replay: "after_prepared", "refund" => ok(1, 1);
    after_prepared_lookup: "after_prepared", "ticket" => ok(1, 1);
    after_prepared_none: "after_prepared", "deploy" => ok(1, 1);
    after_dispatching_replay: "after_dispatching", "refund" => ok(1, 1);
    after_dispatching_lookup: "after_dispatching", "ticket" => ok(1, 1);
    after_dispatching_none: "after_dispatching", "deploy" => ok(1, 1);
    after_send_fence_replay: "after_send_fence", "refund" => ok(1, 1);
    after_send_fence_lookup: "after_send_fence", "ticket" => held(0, 0);
    after_send_fence_none: "after_send_fence", "deploy" => held(0, 0);
    after_response_replay: "after_response", "refund" => ok(1, 2);
    after_response_lookup: "after_response", "ticket" => ok(1, 1);
    after_response_none: "after_response", "deploy" => held(1, 1);
    after_succeeded_replay: "after_succeeded", "refund" => ok(1, 1);
    after_succeeded_lookup: "after_succeeded", "ticket" => ok(1, 1);
    after_succeeded_none: "after_succeeded", "deploy" => ok(1, 1);
    response_dropped_replay: "drop_after_commit", "refund" => ok(1, 2);
    response_dropped_lookup: "drop_after_commit", "ticket" => ok(1, 1);
    response_dropped_none: "drop_after_commit", "deploy" => held(1, 1);
    after_prepared_proven: "after_prepared", "ticket-proven" => ok(1, 1);
    after_dispatching_proven: "after_dispatching", "ticket-proven" => ok(1, 1);
    after_send_fence_proven: "after_send_fence", "ticket-proven" => ok(1, 1);
    after_response_proven: "after_response", "ticket-proven" => ok(1, 1);
    after_succeeded_proven: "after_succeeded", "ticket-proven" => ok(1, 1);
    response_dropped_proven: "drop_after_commit", "ticket-proven" => ok(1, 1);
}
