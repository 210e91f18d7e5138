/**
 * W3C trace context on the intents this client sends: the `traceparent` and `tracestate`
 * message headers the worker reads, so its spans join the agent's trace.
 *
 * - With `@opentelemetry/api` installed (an optional peer dependency), every publish runs in a
 *   producer span `publish intents` (the OpenTelemetry messaging conventions' name, kind and
 *   attributes), and the headers carry that span's context: with an SDK registered the span
 *   records and is the parent named on the wire; with the API alone nothing records and the
 *   active context (if any) passes through unchanged.
 * - An explicit `traceparent`/`tracestate` wins over the active context: it is the span's
 *   parent, and when the span does not record (or the value does not parse) it is sent exactly
 *   as given. The worker ignores a malformed one; it never refuses the intent.
 * - Without the package: no span, no headers but explicit ones, and no import error.
 *
 * The headers are written here from the span context (W3C format), not by the application's
 * propagator: the worker reads W3C whatever propagator the agent registered, and a `baggage`
 * header may carry application data, which is not the broker's to keep.
 */
import type * as Otel from "@opentelemetry/api";

export const TRACEPARENT = "traceparent";
export const TRACESTATE = "tracestate";
/** The producer span's name, as the Python client names it. */
export const SPAN_NAME = "publish intents";
const TRACER_NAME = "intent-worker-client";

/** Trace context to send with an intent. */
export interface TraceContext {
  /** A W3C `traceparent`, sent as given (the worker ignores a malformed one). */
  readonly traceparent?: string;
  /** A W3C `tracestate`; only sent with a `traceparent`. */
  readonly tracestate?: string;
}

/** The headers of an explicit context, as given. A `tracestate` alone is a TypeError. */
export function traceHeaders(context: TraceContext): Record<string, string> {
  const { traceparent, tracestate } = context;
  if (traceparent === undefined) {
    if (tracestate !== undefined) throw new TypeError("tracestate is only sent with a traceparent");
    return {};
  }
  const headers: Record<string, string> = { [TRACEPARENT]: traceparent };
  if (tracestate) headers[TRACESTATE] = tracestate;
  return headers;
}

// Loaded once, on first use; `undefined` when the package is not installed.
let api: Promise<typeof Otel | undefined> | undefined;
function otel(): Promise<typeof Otel | undefined> {
  api ??= import("@opentelemetry/api").then(
    (m) => m,
    () => undefined,
  );
  return api;
}

const TRACEPARENT_RE = /^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$/;

/** The span context of a W3C header pair, or undefined when it does not parse (version ff, a
 * version 00 with extra fields, all-zero ids). */
function parse(o: typeof Otel, headers: Record<string, string>): Otel.SpanContext | undefined {
  const m = TRACEPARENT_RE.exec(headers[TRACEPARENT]?.trim() ?? "");
  if (m === null || m[1] === "ff" || (m[1] === "00" && m[5] !== undefined)) return undefined;
  const context: Otel.SpanContext = {
    traceId: m[2] as string,
    spanId: m[3] as string,
    traceFlags: Number.parseInt(m[4] as string, 16) & 1,
    isRemote: true,
    ...(headers[TRACESTATE] ? { traceState: o.createTraceState(headers[TRACESTATE]) } : {}),
  };
  return o.isSpanContextValid(context) ? context : undefined;
}

/** The W3C headers of a span context; none for an invalid one. */
function format(o: typeof Otel, context: Otel.SpanContext | undefined): Record<string, string> {
  if (context === undefined || !o.isSpanContextValid(context)) return {};
  const flags = (context.traceFlags & 0xff).toString(16).padStart(2, "0");
  const headers: Record<string, string> = {
    [TRACEPARENT]: `00-${context.traceId}-${context.spanId}-${flags}`,
  };
  const state = context.traceState?.serialize();
  if (state) headers[TRACESTATE] = state;
  return headers;
}

/** What a publish span describes. */
export interface PublishTarget {
  readonly exchange: string;
  readonly tenant: string;
  readonly actionId: string;
  readonly tool?: string | undefined;
}

/** Runs `send` in the publish's producer span (when `@opentelemetry/api` is installed) with the
 * headers that carry the context: the span's own when it records, else the explicit ones (from
 * {@link traceHeaders}) or the active context unchanged, else none. A rejection marks the span
 * failed. */
export async function inPublishSpan<T>(
  target: PublishTarget,
  explicit: Record<string, string>,
  send: (headers: Record<string, string>) => Promise<T>,
): Promise<T> {
  const o = await otel();
  if (o === undefined) return send(explicit);
  const given = Object.keys(explicit).length > 0;
  const parsed = given ? parse(o, explicit) : undefined;
  const parent = !given
    ? o.context.active()
    : parsed === undefined
      ? o.ROOT_CONTEXT // a value that does not parse: no parent, and it is sent as given
      : o.trace.setSpanContext(o.ROOT_CONTEXT, parsed);
  const attributes: Otel.Attributes = {
    "messaging.system": "rabbitmq",
    "messaging.operation.type": "send",
    "messaging.operation.name": "publish",
    "messaging.destination.name": target.exchange,
    "messaging.rabbitmq.destination.routing_key": target.tenant,
    "messaging.message.id": `${target.tenant}:${target.actionId}`,
    "intent_worker.tenant": target.tenant,
    "intent_worker.action_id": target.actionId,
    ...(target.tool === undefined ? {} : { "intent_worker.tool": target.tool }),
  };
  const span = o.trace
    .getTracer(TRACER_NAME)
    .startSpan(SPAN_NAME, { kind: o.SpanKind.PRODUCER, attributes }, parent);
  const headers =
    given && (parsed === undefined || !span.isRecording())
      ? explicit
      : format(o, span.spanContext());
  try {
    return await o.context.with(o.trace.setSpan(parent, span), () => send(headers));
  } catch (e) {
    span.recordException(e instanceof Error ? e : String(e));
    span.setStatus({
      code: o.SpanStatusCode.ERROR,
      message: e instanceof Error ? e.message : String(e),
    });
    throw e;
  } finally {
    span.end();
  }
}

/** The context to keep with an outbox row: the explicit headers (from {@link traceHeaders}) as
 * given, else the active context (when `@opentelemetry/api` is installed), else none. The relay's
 * publish span, later, is its child. */
export async function currentTraceHeaders(
  explicit: Record<string, string>,
): Promise<Record<string, string>> {
  if (Object.keys(explicit).length > 0) return explicit;
  const o = await otel();
  return o === undefined ? {} : format(o, o.trace.getSpanContext(o.context.active()));
}
