// Trace context with an OpenTelemetry SDK registered (this file's process only: node's test
// runner gives each file its own): a publish runs in a recorded producer span that is the parent
// named on the wire, an explicit traceparent wins, a failure marks the span, and the outbox keeps
// the active context. Against RabbitMQ and Postgres; no worker needed.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, beforeEach, test } from "node:test";
import { type Span, SpanKind, SpanStatusCode, trace } from "@opentelemetry/api";
import {
  InMemorySpanExporter,
  NodeTracerProvider,
  type ReadableSpan,
  SimpleSpanProcessor,
} from "@opentelemetry/sdk-trace-node";
import amqp from "amqplib";
import pg from "pg";
import {
  createOutbox,
  enqueue,
  type Intent,
  IntentClient,
  PublishError,
  SPAN_NAME,
} from "../../src/index.js";
import { AMQP_URL, admin, databaseUrl } from "../support/world.js";

const exporter = new InMemorySpanExporter();
new NodeTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] }).register();
const tracer = trace.getTracer("agent");

const id = randomUUID().replaceAll("-", "").slice(0, 12);
const intents = `tstrace-${id}.intents`;
const results = `tstrace-${id}.results`;
const tenant = "north-shop";
const dbName = `tstrace_${id}`;
const dbUrl = databaseUrl(dbName);
let connection: amqp.ChannelModel;
let channel: amqp.Channel;
let probe: string;
let client: IntentClient;

before(async () => {
  connection = await amqp.connect(AMQP_URL);
  channel = await connection.createChannel();
  await channel.assertExchange(intents, "topic", { durable: false });
  await channel.assertExchange(results, "topic", { durable: false });
  probe = (await channel.assertQueue("", { exclusive: true })).queue;
  await channel.bindQueue(probe, intents, tenant);
  client = await IntentClient.connect(AMQP_URL, {
    intentsExchange: intents,
    resultsExchange: results,
    replyTo: `agent-${id}`,
  });
  await admin((c) => c.query(`CREATE DATABASE "${dbName}"`));
});
after(async () => {
  await client.close();
  await channel.deleteExchange(intents);
  await channel.deleteExchange(results);
  await connection.close();
  await admin((c) => c.query(`DROP DATABASE IF EXISTS "${dbName}" WITH (FORCE)`));
});
beforeEach(() => exporter.reset());

function refund(actionId: string, who = tenant): Intent {
  return { tenant: who, action_id: actionId, tool: "refund", arguments: { amount: 1 } };
}

/** The headers of the next message on the probe queue. */
async function nextHeaders(): Promise<Record<string, unknown>> {
  for (let i = 0; i < 100; i++) {
    const m = await channel.get(probe, { noAck: true });
    if (m !== false) return m.properties.headers ?? {};
    await new Promise((r) => setTimeout(r, 50));
  }
  throw new Error("nothing arrived on the probe queue");
}

function publishSpans(): ReadableSpan[] {
  return exporter.getFinishedSpans().filter((s) => s.name === SPAN_NAME);
}

function inStep<T>(run: (step: Span) => Promise<T>): Promise<T> {
  return tracer.startActiveSpan("agent step", async (step) => {
    try {
      return await run(step);
    } finally {
      step.end();
    }
  });
}

test("a publish inside a span carries its trace, through a recorded producer span", async () => {
  const step = await inStep(async (s) => {
    await client.publish(refund(`in-span-${id}`));
    return s.spanContext();
  });
  const headers = await nextHeaders();
  const [publish] = publishSpans();
  assert.ok(publish, "the publish span was recorded");
  assert.equal(publish.kind, SpanKind.PRODUCER);
  assert.equal(publish.spanContext().traceId, step.traceId);
  assert.equal(publish.parentSpanContext?.spanId, step.spanId);
  // The parent named on the wire is the publish span, the step's child.
  assert.equal(headers.traceparent, `00-${step.traceId}-${publish.spanContext().spanId}-01`);
  assert.equal(headers.tracestate, undefined);
  assert.deepEqual(
    {
      system: publish.attributes["messaging.system"],
      destination: publish.attributes["messaging.destination.name"],
      routingKey: publish.attributes["messaging.rabbitmq.destination.routing_key"],
      messageId: publish.attributes["messaging.message.id"],
      tool: publish.attributes["intent_worker.tool"],
    },
    {
      system: "rabbitmq",
      destination: intents,
      routingKey: tenant,
      messageId: `${tenant}:in-span-${id}`,
      tool: "refund",
    },
  );
  assert.equal(publish.status.code, SpanStatusCode.UNSET);
});

test("an explicit traceparent wins over the active span; a malformed one is sent as given", async () => {
  const given = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
  await inStep(() =>
    client.publish(refund(`explicit-${id}`), { traceparent: given, tracestate: "rojo=1" }),
  );
  const headers = await nextHeaders();
  const [publish] = publishSpans();
  assert.ok(publish);
  assert.equal(publish.spanContext().traceId, "0af7651916cd43dd8448eb211c80319c");
  assert.equal(publish.parentSpanContext?.spanId, "b7ad6b7169203331");
  assert.equal(
    headers.traceparent,
    `00-0af7651916cd43dd8448eb211c80319c-${publish.spanContext().spanId}-01`,
  );
  assert.equal(headers.tracestate, "rojo=1");

  exporter.reset();
  const malformed = '00-{not-a-trace}-"quoted"-01';
  await inStep(() => client.publish(refund(`malformed-${id}`), { traceparent: malformed }));
  const sent = await nextHeaders();
  assert.equal(sent.traceparent, malformed);
  const [root] = publishSpans();
  assert.ok(root);
  assert.equal(root.parentSpanContext, undefined, "no parent: neither the value nor the step");
});

test("a refused publish marks its span failed", async () => {
  await assert.rejects(client.publish(refund(`unroutable-${id}`, "nobody-here")), PublishError);
  const [publish] = publishSpans();
  assert.ok(publish);
  assert.equal(publish.status.code, SpanStatusCode.ERROR);
  assert.match(publish.status.message ?? "", /unroutable/);
});

test("the outbox keeps the active context with the row; an explicit one wins", async () => {
  const db = new pg.Client({ connectionString: dbUrl });
  await db.connect();
  try {
    await createOutbox(db);
    const step = await inStep(async (s) => {
      await db.query("BEGIN");
      await enqueue(db, refund(`outbox-${id}`));
      await db.query("COMMIT");
      return s.spanContext();
    });
    await enqueue(db, refund(`outbox-explicit-${id}`), {
      traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
    });
    await enqueue(db, refund(`outbox-none-${id}`));
    const rows = await db.query<{ traceparent: string | null }>(
      "SELECT traceparent FROM intent_outbox ORDER BY id",
    );
    assert.deepEqual(
      rows.rows.map((r) => r.traceparent),
      [
        `00-${step.traceId}-${step.spanId}-01`,
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
        null,
      ],
    );
    assert.equal(publishSpans().length, 0, "enqueueing publishes nothing");
  } finally {
    await db.end();
  }
});
