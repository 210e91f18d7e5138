// The client against a real worker, RabbitMQ, Postgres and the reference downstream (as
// clients/python/tests/test_worker.py). Counts of real writes come from the downstream's own
// table, never from logs.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, test } from "node:test";
import amqp from "amqplib";
import pg from "pg";
import {
  createOutbox,
  decodeIntent,
  enqueue,
  fingerprint,
  type Intent,
  IntentClient,
  InvalidIntentError,
  NoAnswerError,
} from "../../src/index.js";
import { AMQP_URL, freePort, World } from "../support/world.js";

let world: World;
before(async () => {
  world = await World.start();
});
after(async () => {
  await world?.stop();
});

const unique = (): string => randomUUID().slice(0, 10);

function connect(options: Parameters<typeof IntentClient.connect>[1] = {}): Promise<IntentClient> {
  return IntentClient.connect(AMQP_URL, {
    intentsExchange: world.intentsExchange,
    resultsExchange: world.resultsExchange,
    bindTenant: true,
    ...options,
  });
}

function refund(actionId: string, amount = 4850, extra: Partial<Intent> = {}): Intent {
  return {
    tenant: world.tenant,
    action_id: actionId,
    tool: "refund",
    arguments: { order: "order-731", amount_cents: amount, currency: "USD" },
    ...extra,
  };
}

test("send and wait returns the receipt", async () => {
  // An action id a URL or a shell would mangle.
  const actionId = `refund/{"n":1}?%20&'${unique()}`;
  const client = await connect();
  try {
    const answer = await client.sendAndWait(refund(actionId), { timeoutMs: 20_000 });
    assert.equal(answer.status, "succeeded", JSON.stringify(answer));
    if (answer.status !== "succeeded") return;
    const receipt = answer.receipt as Record<string, unknown>;
    assert.equal(receipt.idempotency_key, `${world.tenant}:${actionId}`);
    assert.equal(answer.fingerprint, fingerprint("refund", refund(actionId).arguments));
    assert.equal(typeof answer.event_id, "string");
    assert.equal(answer.verified_by, "dispatch");
  } finally {
    await client.close();
  }
  assert.equal(await world.mutations(`${world.tenant}:${actionId}`), 1);
});

test("a repeat is answered from the ledger; a conflicting reuse is rejected", async () => {
  const actionId = `refund-${unique()}`;
  const client = await connect();
  try {
    const first = await client.sendAndWait(refund(actionId, 4850, { call_id: "model-1" }), {
      timeoutMs: 20_000,
    });
    // The model "tries again" with a new call id and reordered arguments.
    const second = await client.sendAndWait(
      {
        tenant: world.tenant,
        action_id: actionId,
        tool: "refund",
        arguments: { currency: "USD", amount_cents: 4850, order: "order-731" },
        call_id: "model-2",
      },
      { timeoutMs: 20_000 },
    );
    const conflict = await client.sendAndWait(refund(actionId, 99999), { timeoutMs: 20_000 });
    assert.equal(first.status, "succeeded");
    assert.equal(second.status, "succeeded");
    assert.deepEqual(second.receipt, first.receipt);
    assert.equal(conflict.status, "rejected", JSON.stringify(conflict));
    assert.equal(conflict.reason, "intent_conflict");
  } finally {
    await client.close();
  }
  assert.equal(await world.mutations(`${world.tenant}:${actionId}`), 1);
});

test("a lost reply is pending and is never resubmitted", async () => {
  const actionId = `deploy-${unique()}`;
  const key = `${world.tenant}:${actionId}`;
  // The downstream commits the deploy, then drops the connection: the outcome is unknown and
  // `deploy` has no recovery (none), so the worker must say pending and never resend.
  const fault = await fetch(`${world.downstreamUrl}/_control/faults`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ kind: "drop_after_commit", key }),
  });
  assert.ok(fault.ok);
  const deploy: Intent = {
    tenant: world.tenant,
    action_id: actionId,
    tool: "deploy",
    arguments: { service: "api", version: "1.2.3" },
  };
  const client = await connect({ statusUrl: world.adminUrl, statusToken: world.tenantToken });
  try {
    const answer = await client.sendAndWait(deploy, { timeoutMs: 3_000 });
    assert.equal(answer.status, "pending", JSON.stringify(answer));
    assert.ok(
      ["unknown_outcome", "held"].includes(answer.uncertainty ?? ""),
      JSON.stringify(answer),
    );
    assert.equal(answer.next_action, "check_status");
    // With no recovery, the worker holds it for a person.
    let status = await client.status(world.tenant, actionId);
    for (let i = 0; i < 100 && status?.uncertainty !== "held"; i++) {
      await new Promise((r) => setTimeout(r, 100));
      status = await client.status(world.tenant, actionId);
    }
    assert.equal(status?.status, "pending");
    assert.equal(status?.uncertainty, "held", JSON.stringify(status));
    // The model insists; the same key keeps it one action, answered from the ledger.
    const again = await client.sendAndWait({ ...deploy, call_id: "call-2" }, { timeoutMs: 2_000 });
    assert.equal(again.status, "pending");
    assert.equal(again.uncertainty, "held", JSON.stringify(again));
  } finally {
    await client.close();
  }
  assert.equal(await world.mutations(key), 1);
});

test("the outbox is relayed after the agent's commit, never after a rollback", async () => {
  const id = unique();
  const db = new pg.Client({ connectionString: world.dbUrl });
  await db.connect();
  try {
    await createOutbox(db);
    await createOutbox(db); // idempotent
    await db.query("CREATE TABLE refunds_requested (order_id text PRIMARY KEY)");
    await db.query("BEGIN");
    await db.query("INSERT INTO refunds_requested VALUES ('order-1')");
    await enqueue(db, refund(`rolled-back-${id}`, 4850, { reply_to: "agent-a" }));
    await db.query("ROLLBACK");
    await db.query("BEGIN");
    await db.query("INSERT INTO refunds_requested VALUES ('order-2')");
    const traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    await enqueue(db, refund(`committed-${id}`, 4850, { reply_to: "agent-a" }), {
      traceparent,
      tracestate: "v=1",
    });
    await db.query("COMMIT");
    await db.query("BEGIN");
    await assert.rejects(
      enqueue(db, { tenant: world.tenant, action_id: "bad id", tool: "refund", arguments: {} }),
      InvalidIntentError,
    );
    await db.query("ROLLBACK");
    const rows = await db.query(
      "SELECT body, traceparent, tracestate FROM intent_outbox WHERE sent_at IS NULL ORDER BY id",
    );
    assert.deepEqual(
      rows.rows.map((r: { body: string }) => decodeIntent(Buffer.from(r.body)).action_id),
      [`committed-${id}`],
    );
    assert.equal(rows.rows[0].traceparent, traceparent);
    assert.equal(rows.rows[0].tracestate, "v=1");
  } finally {
    await db.end();
  }
  const client = await connect({ replyTo: "agent-a" });
  try {
    await client.bind(world.tenant); // bound before the relay publishes
    const relay = world.spawnPublisher(["relay"]);
    const answer = await client.waitFor(world.tenant, `committed-${id}`, { timeoutMs: 20_000 });
    assert.equal(
      answer.status,
      "succeeded",
      `${JSON.stringify(answer)}\n${relay.lines.join("\n")}`,
    );
    await relay.stop();
  } finally {
    await client.close();
  }
  assert.equal(await world.mutations(`${world.tenant}:committed-${id}`), 1);
  assert.equal(await world.mutations(`${world.tenant}:rolled-back-${id}`), 0);
});

test("a node list with a dead node connects to the live one", async () => {
  const dead = `amqp://guest:guest@127.0.0.1:${await freePort()}/%2f`;
  // The order is random: several connects try both orders.
  for (let i = 0; i < 4; i++) {
    const client = await IntentClient.connect([dead, AMQP_URL], {
      intentsExchange: world.intentsExchange,
      resultsExchange: world.resultsExchange,
      connectTimeoutMs: 2_000,
    });
    try {
      if (i === 0) {
        const actionId = `refund-${unique()}`;
        const answer = await client.sendAndWait(refund(actionId), { timeoutMs: 20_000 });
        assert.equal(answer.status, "succeeded");
      }
    } finally {
      await client.close();
    }
  }
});

test("a restarted agent learns the answer from the status API", async () => {
  const actionId = `r/${unique()}?q=1#frag%2F{"x"}\\;+`;
  const first = await connect();
  let replyTo: string;
  try {
    const sent = await first.publish(refund(actionId));
    replyTo = sent.reply_to as string;
    await first.waitFor(world.tenant, actionId, { timeoutMs: 20_000 });
  } finally {
    await first.close();
  }
  const blind = await connect({ replyTo });
  try {
    await assert.rejects(
      blind.waitFor(world.tenant, actionId, { timeoutMs: 1_000 }),
      NoAnswerError,
    );
  } finally {
    await blind.close();
  }
  const restarted = await connect({
    replyTo,
    statusUrl: world.adminUrl,
    statusToken: world.tenantToken,
  });
  try {
    const answer = await restarted.waitFor(world.tenant, actionId, { timeoutMs: 5_000 });
    assert.equal(answer.status, "succeeded");
    assert.equal(await restarted.status(world.tenant, `never-${unique()}`), null);
  } finally {
    await restarted.close();
  }
});

test("what is published: user_id, message_id, persistent, JSON, trace headers", async () => {
  const connection = await amqp.connect(AMQP_URL);
  const channel = await connection.createChannel();
  const probe = await channel.assertQueue("", { exclusive: true });
  await channel.bindQueue(probe.queue, world.intentsExchange, world.tenant);
  const seen = new Promise<amqp.ConsumeMessage>((resolve) => {
    void channel.consume(probe.queue, (m) => m && resolve(m), { noAck: true });
  });
  const client = await connect();
  const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  try {
    const actionId = `uid-${unique()}`;
    const sent = await client.publish(refund(actionId), { traceparent, tracestate: "k=v" });
    const message = await seen;
    assert.equal(message.properties.userId, "guest");
    assert.equal(message.properties.messageId, `${world.tenant}:${actionId}`);
    assert.equal(message.properties.deliveryMode, 2);
    assert.equal(message.properties.contentType, "application/json");
    assert.equal(message.fields.routingKey, world.tenant);
    assert.equal(message.properties.headers?.traceparent, traceparent);
    assert.equal(message.properties.headers?.tracestate, "k=v");
    assert.deepEqual(decodeIntent(message.content), sent);
    assert.equal(sent.reply_to, client.replyTo);
  } finally {
    await client.close();
    await connection.close();
  }
});

test("a succeeded refund is compensated once, linked both ways", async () => {
  const original = `refund-${unique()}`;
  const undo = `rev-${unique()}`;
  const reversal = (actionId: string): Omit<Intent, "compensates"> => ({
    tenant: world.tenant,
    action_id: actionId,
    tool: "reversal",
    arguments: { order: "order-731", amount_cents: 4850, refund: original },
  });
  const client = await connect({ statusUrl: world.adminUrl, statusToken: world.tenantToken });
  try {
    // Not yet applied: nothing is recorded for the compensation.
    const early = await client.compensate(`never-${unique()}`, reversal(`rev-${unique()}`), {
      timeoutMs: 20_000,
    });
    assert.equal(early.status, "rejected", JSON.stringify(early));
    if (early.status === "rejected") assert.equal(early.reason, "original_not_found");

    const done = await client.sendAndWait(refund(original), { timeoutMs: 20_000 });
    assert.equal(done.status, "succeeded", JSON.stringify(done));
    const answer = await client.compensate(original, reversal(undo), { timeoutMs: 20_000 });
    assert.equal(answer.status, "succeeded", JSON.stringify(answer));
    assert.equal(answer.compensates, original);
    assert.equal(
      answer.fingerprint,
      fingerprint("reversal", reversal(undo).arguments, original),
      "the fingerprint covers the original",
    );
    // The original's agent is told, with the original's receipt.
    const deadline = Date.now() + 15_000;
    let told = client.heard(world.tenant, original).find((e) => e.compensated_by === undo);
    while (told === undefined && Date.now() < deadline) {
      await new Promise((r) => setTimeout(r, 100));
      told = client.heard(world.tenant, original).find((e) => e.compensated_by === undo);
    }
    assert.ok(told, "an event about the original names its compensation");
    assert.equal(told.status, "succeeded");
    if (told.status === "succeeded" && done.status === "succeeded") {
      assert.deepEqual(told.receipt, done.receipt);
    }
    assert.equal((await client.status(world.tenant, original))?.compensated_by, undo);
    // A second compensation under another key is refused, naming the first.
    const again = await client.compensate(original, reversal(`rev-${unique()}`), {
      timeoutMs: 20_000,
    });
    assert.equal(again.status, "rejected", JSON.stringify(again));
    if (again.status === "rejected") {
      assert.equal(again.reason, "already_compensated");
      assert.equal(again.detail, undo);
    }
    // The same compensation again is a duplicate, answered from the ledger.
    const repeat = await client.compensate(original, reversal(undo), { timeoutMs: 20_000 });
    assert.equal(repeat.status, "succeeded");
  } finally {
    await client.close();
  }
  assert.equal(await world.mutations(`${world.tenant}:${original}`), 1);
  assert.equal(await world.mutations(`${world.tenant}:${undo}`), 1);
});
