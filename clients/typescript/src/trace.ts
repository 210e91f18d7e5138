/** W3C trace context headers sent with an intent (the worker's spans join the agent's trace). */
export const TRACEPARENT = "traceparent";
export const TRACESTATE = "tracestate";

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
