// The client against RabbitMQ alone (no worker): result events are published here by hand, so
// the wait's filtering is checked whatever the worker would send; and a link that dies.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { createServer, type Server, Socket } from "node:net";
import { after, before, test } from "node:test";
import amqp from "amqplib";
import {
  IntentClient,
  NoAnswerError,
  PublishError,
  PublishInDoubtError,
  type ResultEvent,
  resultRoutingKey,
  TopologyMissingError,
} from "../../src/index.js";
import { AMQP_URL } from "../support/world.js";

const id = randomUUID().slice(0, 12);
const intents = `ts-${id}.intents`;
const results = `ts-${id}.results`;
const tenant = "north-shop";
let connection: amqp.ChannelModel;
let channel: amqp.Channel;

before(async () => {
  connection = await amqp.connect(AMQP_URL);
  channel = await connection.createChannel();
  await channel.assertExchange(intents, "topic", { durable: false });
  await channel.assertExchange(results, "topic", { durable: false });
});
after(async () => {
  await channel.deleteExchange(intents);
  await channel.deleteExchange(results);
  await connection.close();
});

function event(
  actionId: string,
  status: ResultEvent["status"],
  eventId: string,
  fingerprint: string | null,
): Buffer {
  return Buffer.from(
    JSON.stringify({
      tenant,
      action_id: actionId,
      tool: "refund",
      status,
      receipt: status === "succeeded" ? { receipt_id: eventId } : null,
      next_action: status === "pending" ? "check_status" : null,
      attempts: 1,
      message: "m",
      fingerprint,
      event_id: eventId,
      occurred_at: "2025-01-01T00:00:00.000Z",
      ...(status === "rejected" ? { reason: "intent_conflict" } : {}),
      ...(status === "pending" ? { uncertainty: "in_progress", retry_after_ms: 500 } : {}),
    }),
  );
}

test("the wait takes only this agent's events for this intent, each event once", async () => {
  const a = await IntentClient.connect(AMQP_URL, {
    intentsExchange: intents,
    resultsExchange: results,
    replyTo: `a-${id}`,
  });
  const b = await IntentClient.connect(AMQP_URL, {
    intentsExchange: intents,
    resultsExchange: results,
    replyTo: `b-${id}`,
  });
  try {
    await a.bind(tenant);
    await b.bind(tenant);
    const forA = resultRoutingKey(tenant, `a-${id}`);
    const follow = a.follow(tenant, "x1", { fingerprint: "fp-1" });
    const followed: ResultEvent[] = [];
    const following = (async () => {
      for await (const e of follow) followed.push(e);
    })();
    channel.publish(results, forA, event("x1", "pending", "e1", "fp-1"));
    // Another intent under the same key (conflict): not an answer to fp-1.
    channel.publish(results, forA, event("x1", "rejected", "e2", "fp-other"));
    channel.publish(results, forA, event("x1", "pending", "e1", "fp-1")); // a repeat
    channel.publish(results, forA, event("x1", "succeeded", "e3", "fp-1"));
    channel.publish(results, forA, event("x1", "succeeded", "e3", "fp-1")); // a repeat
    // "north-shopx" is another tenant's key space.
    channel.publish(results, `${tenant}x.@.a-${id}`, event("x2", "succeeded", "e4", null));

    const got = await a.waitFor(tenant, "x1", { fingerprint: "fp-1", timeoutMs: 5_000 });
    assert.equal(got.status, "succeeded");
    assert.equal(got.event_id, "e3");
    const other = await a.waitFor(tenant, "x1", { fingerprint: "fp-other", timeoutMs: 5_000 });
    assert.equal(other.status, "rejected");
    assert.equal(other.reason, "intent_conflict");
    await following;
    assert.deepEqual(
      followed.map((e) => e.event_id),
      ["e1", "e3"],
    );
    const heard = a.heard(tenant, "x1");
    assert.deepEqual(
      heard.map((e) => e.event_id),
      ["e1", "e2", "e3"],
    );
    const pending = heard[0] as ResultEvent;
    assert.equal(pending.uncertainty, "in_progress");
    assert.equal(pending.retry_after_ms, 500);
    await assert.rejects(b.waitFor(tenant, "x1", { timeoutMs: 500 }), NoAnswerError);
    await assert.rejects(a.waitFor(tenant, "x2", { timeoutMs: 500 }), NoAnswerError);
  } finally {
    await a.close();
    await b.close();
  }
});

test("a pending answer is returned at the timeout; nothing at all is NoAnswerError", async () => {
  const client = await IntentClient.connect(AMQP_URL, {
    intentsExchange: intents,
    resultsExchange: results,
  });
  try {
    await client.bind(tenant);
    channel.publish(
      results,
      resultRoutingKey(tenant, client.replyTo),
      event("p1", "pending", `p-${id}`, "fp"),
    );
    const got = await client.waitFor(tenant, "p1", { timeoutMs: 800 });
    assert.equal(got.status, "pending");
    await assert.rejects(client.waitFor(tenant, "none", { timeoutMs: 300 }), NoAnswerError);
  } finally {
    await client.close();
  }
});

test("an unroutable publish is a PublishError; a missing exchange is TopologyMissing", async () => {
  const client = await IntentClient.connect(AMQP_URL, {
    intentsExchange: intents,
    resultsExchange: results,
  });
  try {
    await assert.rejects(
      client.publish(
        { tenant, action_id: `lost-${id}`, tool: "refund", arguments: {} },
        { timeoutMs: 5_000 },
      ),
      (e: unknown) => e instanceof PublishError && !(e instanceof PublishInDoubtError),
    );
  } finally {
    await client.close();
  }
  await assert.rejects(
    IntentClient.connect(AMQP_URL, { intentsExchange: `nope-${id}`, resultsExchange: results }),
    TopologyMissingError,
  );
});

/** A TCP proxy to the broker whose links can be stalled (bytes go nowhere, nothing closes). */
class StallProxy {
  stalled = false;
  cutOff = false;
  readonly sockets = new Set<Socket>();
  server: Server | undefined;
  port = 0;
  async start(host: string, port: number): Promise<void> {
    this.server = createServer((downstream) => {
      if (this.cutOff) {
        downstream.destroy();
        return;
      }
      const upstream = new Socket();
      upstream.connect(port, host);
      for (const [from, to] of [
        [downstream, upstream],
        [upstream, downstream],
      ] as const) {
        from.on("data", (chunk) => {
          if (!this.stalled) to.write(chunk);
        });
        from.on("error", () => to.destroy());
        from.on("close", () => to.destroy());
        this.sockets.add(from);
      }
    });
    await new Promise<void>((r) => this.server?.listen(0, "127.0.0.1", r));
    const address = this.server.address();
    this.port = typeof address === "object" && address !== null ? address.port : 0;
  }
  /** Resets every live link and refuses new ones until `cutOff` is false again. */
  cut(): void {
    this.cutOff = true;
    for (const s of this.sockets) s.destroy();
    this.sockets.clear();
  }
  async stop(): Promise<void> {
    for (const s of this.sockets) s.destroy();
    await new Promise<void>((r) => this.server?.close(() => r()));
  }
}

/** A client connected through a new proxy, and a queue bound for the tenant: somewhere to route
 * to, so that only the link can fail. */
async function throughProxy(): Promise<{
  proxy: StallProxy;
  client: IntentClient;
  q: { queue: string };
}> {
  const url = new URL(AMQP_URL);
  const proxy = new StallProxy();
  await proxy.start(url.hostname, Number(url.port || 5672));
  const via = new URL(AMQP_URL);
  via.hostname = "127.0.0.1";
  via.port = String(proxy.port);
  const client = await IntentClient.connect(via.toString(), {
    intentsExchange: intents,
    resultsExchange: results,
  });
  const q = await channel.assertQueue("", { exclusive: true });
  await channel.bindQueue(q.queue, intents, tenant);
  return { proxy, client, q };
}

test("over a stalled link: the publish is in doubt and close is still bounded", async () => {
  const { proxy, client, q } = await throughProxy();
  try {
    await client.bind(tenant);
    proxy.stalled = true;
    const started = Date.now();
    await assert.rejects(
      client.publish(
        { tenant, action_id: `doubt-${id}`, tool: "refund", arguments: {} },
        { timeoutMs: 1_000 },
      ),
      PublishInDoubtError,
    );
    assert.ok(Date.now() - started < 3_000);
    const closing = Date.now();
    await client.close(1_000);
    assert.ok(Date.now() - closing < 3_000, "close was not bounded");
  } finally {
    await channel.deleteQueue(q.queue);
    await proxy.stop();
  }
});

test("after a lost link the client connects again, rebinds, and publishes", async () => {
  const { proxy, client, q } = await throughProxy();
  try {
    await client.bind(tenant);
    proxy.cut();
    setTimeout(() => {
      proxy.cutOff = false;
    }, 1_000);
    // (An intent handed over in the instant the link dies is in doubt: PublishInDoubtError.)
    await new Promise((r) => setTimeout(r, 300));
    // Waits for the link, then is sent once.
    const sent = await client.publish(
      { tenant, action_id: `again-${id}`, tool: "refund", arguments: {} },
      { timeoutMs: 15_000 },
    );
    const got = await channel.get(q.queue, { noAck: true });
    assert.ok(got !== false, "the intent did not arrive");
    assert.equal(got.properties.messageId, `${tenant}:again-${id}`);
    // The new results queue is bound to this agent's key.
    channel.publish(
      results,
      resultRoutingKey(tenant, client.replyTo),
      event(sent.action_id, "succeeded", `r-${id}`, null),
    );
    const answer = await client.waitFor(tenant, sent.action_id, { timeoutMs: 5_000 });
    assert.equal(answer.status, "succeeded");
  } finally {
    await client.close(1_000);
    await channel.deleteQueue(q.queue);
    await proxy.stop();
  }
});
