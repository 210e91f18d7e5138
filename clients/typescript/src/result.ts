/**
 * The result event the worker sends back (message contract version 1). Reading is lenient
 * where the worker's own reader is (unknown fields ignored, absent optional fields read as
 * null) and strict where it is not (status, reason, attempts).
 */

/** Why an intent was rejected (the worker's reader refuses any other value). */
export type RejectReason =
  | "intent_conflict"
  | "invalid_message"
  | "unknown_tool"
  | "tenant_mismatch"
  | "expired"
  | "original_unresolved"
  | "original_not_applied"
  | "original_not_found"
  | "already_compensated"
  | "compensation_not_allowed";

const REASONS: readonly string[] = [
  "intent_conflict",
  "invalid_message",
  "unknown_tool",
  "tenant_mismatch",
  "expired",
  "original_unresolved",
  "original_not_applied",
  "original_not_found",
  "already_compensated",
  "compensation_not_allowed",
];

/** Why a pending answer is pending (a newer worker may add values). */
export type Uncertainty =
  | "unknown_outcome"
  | "in_progress"
  | "held"
  | "awaiting_approval"
  | (string & {});

/** A JSON value as read from the wire (receipts). */
export type Receipt = unknown;

interface EventBase {
  readonly tenant: string;
  readonly action_id: string;
  readonly tool: string;
  /** The downstream's proof on `succeeded`; null otherwise. */
  readonly receipt: Receipt;
  readonly next_action: string | null;
  readonly attempts: number;
  readonly message: string;
  /** The fingerprint of the intent this answers (null when the worker could not read it). */
  readonly fingerprint: string | null;
  /** Unique per event: repeats of one event are dropped by it. */
  readonly event_id: string;
  readonly occurred_at: string;
  readonly reason: RejectReason | null;
  /** See the contract: decode error code, final state, not_approved, approval_expired... */
  readonly detail: string | null;
  /** How the answer is known (dispatch, replay, lookup, poll, callback, operator...). */
  readonly verified_by: string | null;
  /** The operator who settled the action, when verified_by is "operator". */
  readonly operator: string | null;
  /** The downstream's identifier (receipt id, or its operation id). */
  readonly remote_id: string | null;
  readonly uncertainty: Uncertainty | null;
  /** On pending: when the worker looks again, in ms from occurred_at. */
  readonly retry_after_ms: number | null;
  /** On every event about a compensation: the original's action_id. */
  readonly compensates: string | null;
  /** On a succeeded original whose compensation succeeded: the compensation's action_id. */
  readonly compensated_by: string | null;
}

/** Done; `receipt` is the downstream's original proof. */
export interface SucceededEvent extends EventBase {
  readonly status: "succeeded";
}
/** Not final: unknown, in progress, held, or awaiting approval. Do NOT resubmit the action. */
export interface PendingEvent extends EventBase {
  readonly status: "pending";
}
/** The downstream proved it did not and will not apply it (or approval never came). */
export interface FailedEvent extends EventBase {
  readonly status: "failed";
}
/** Refused before any dispatch; see `reason` and `detail`. */
export interface RejectedEvent extends EventBase {
  readonly status: "rejected";
}
/** A result event, discriminated on `status`. */
export type ResultEvent = SucceededEvent | PendingEvent | FailedEvent | RejectedEvent;
/** The four statuses. */
export type Status = ResultEvent["status"];

/** Whether the answer will not change (succeeded, failed, rejected). */
export function isFinal(event: ResultEvent): boolean {
  return event.status !== "pending";
}

/** A message that is not a result event. */
export class InvalidResultEventError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "InvalidResultEventError";
  }
}

const STATUSES: readonly string[] = ["succeeded", "pending", "failed", "rejected"];

function required(value: Record<string, unknown>, name: string): string {
  if (!(name in value)) throw new InvalidResultEventError(`result event has no '${name}'`);
  const item = value[name];
  if (typeof item !== "string") {
    throw new InvalidResultEventError(`result event field '${name}' must be a string`);
  }
  return item;
}

function optional(value: Record<string, unknown>, name: string): string | null {
  const item = value[name];
  if (item === undefined || item === null) return null;
  if (typeof item !== "string") {
    throw new InvalidResultEventError(`result event field '${name}' must be a string or null`);
  }
  return item;
}

/** Reads an event from the results exchange or the status API (bytes, text or parsed JSON). */
export function parseResultEvent(body: Uint8Array | string | object): ResultEvent {
  let value: unknown = body;
  if (typeof body === "string" || body instanceof Uint8Array) {
    const text = typeof body === "string" ? body : new TextDecoder().decode(body);
    try {
      value = JSON.parse(text);
    } catch (e) {
      throw new InvalidResultEventError(`result event is not JSON: ${String(e)}`);
    }
  }
  if (value === null || typeof value !== "object" || Array.isArray(value)) {
    throw new InvalidResultEventError("result event must be a JSON object");
  }
  const v = value as Record<string, unknown>;
  const status = required(v, "status");
  if (!STATUSES.includes(status)) {
    throw new InvalidResultEventError(`unknown status ${JSON.stringify(status)}`);
  }
  const reason = optional(v, "reason");
  if (reason !== null && !REASONS.includes(reason)) {
    throw new InvalidResultEventError(`unknown reason ${JSON.stringify(reason)}`);
  }
  const attempts = v.attempts;
  if (
    typeof attempts !== "number" ||
    !Number.isInteger(attempts) ||
    attempts < 0 ||
    attempts > 0xffffffff
  ) {
    throw new InvalidResultEventError("attempts must be an unsigned 32-bit integer");
  }
  const retry = v.retry_after_ms;
  if (
    retry !== undefined &&
    retry !== null &&
    (typeof retry !== "number" || !Number.isInteger(retry) || retry < 0)
  ) {
    throw new InvalidResultEventError("retry_after_ms must be a count of milliseconds");
  }
  return {
    tenant: required(v, "tenant"),
    action_id: required(v, "action_id"),
    tool: required(v, "tool"),
    status: status as Status,
    receipt: v.receipt ?? null,
    next_action: optional(v, "next_action"),
    attempts,
    message: required(v, "message"),
    fingerprint: optional(v, "fingerprint"),
    event_id: required(v, "event_id"),
    occurred_at: required(v, "occurred_at"),
    reason,
    detail: optional(v, "detail"),
    verified_by: optional(v, "verified_by"),
    operator: optional(v, "operator"),
    remote_id: optional(v, "remote_id"),
    uncertainty: optional(v, "uncertainty"),
    retry_after_ms: typeof retry === "number" ? retry : null,
    compensates: optional(v, "compensates"),
    compensated_by: optional(v, "compensated_by"),
  } as ResultEvent;
}

/** Whether `event` answers the intent with `fingerprint` (any, when undefined). An `expired`
 * rejection answers every intent of its key: the action is gone. */
export function answersIntent(event: ResultEvent, fingerprint: string | undefined): boolean {
  return (
    fingerprint === undefined || event.fingerprint === fingerprint || event.reason === "expired"
  );
}
