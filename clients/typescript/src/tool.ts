/**
 * Intent-backed tools for agent frameworks (the port of the Python client's `intent_tool`).
 * The model supplies the arguments; the application supplies the action id (from
 * {@link actionScope} around the model's turn, or an `actionId` callback), so a model that
 * "tries again" reaches the same ledger row instead of a new action. `execute` returns the
 * worker's answer worded for the model: `pending` (and silence) reads as "outcome unknown, do
 * not retry"; a `pending` that waits for a person's approval as "awaiting approval, nothing
 * sent, do not retry". Framework adapters live in their own entry points
 * (`intent-worker-client/ai`, `/langchain`, `/openai-agents`).
 */
import { AsyncLocalStorage } from "node:async_hooks";
import type { IntentClient } from "./client.js";
import { NoAnswerError } from "./errors.js";
import { fingerprint } from "./fingerprint.js";
import { type Intent, MAX_KEY_LEN } from "./intent.js";
import { canonicalJson, type JsonObject } from "./json.js";
import type { ResultEvent, Status } from "./result.js";

/** Names an intent-backed tool may not take as parameters: they are the application's to set. */
export const RESERVED_PARAMETERS = ["tenant", "action_id", "call_id", "reply_to"] as const;

/** A tool was called outside {@link actionScope} and without an `actionId` callback. The client
 * never invents an action id: a fresh id per call is how duplicates happen. */
export class MissingActionIdError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "MissingActionIdError";
  }
}

interface Scope {
  readonly actionId: string;
  readonly callId: string | undefined;
}

const SCOPE = new AsyncLocalStorage<Scope>();

/** Runs `fn` with `actionId` (and optionally the model's call id) as the action of the
 * intent-backed tool calls made inside, e.g. around one model turn:
 *
 * ```ts
 * await actionScope(`refund-${order.id}`, () => generateText({ model, tools, prompt }));
 * ```
 */
export function actionScope<T>(
  actionId: string,
  fn: () => T,
  options: { readonly callId?: string } = {},
): T {
  return SCOPE.run({ actionId, callId: options.callId }, fn);
}

/** The innermost {@link actionScope}'s action id, or undefined. */
export function currentActionId(): string | undefined {
  return SCOPE.getStore()?.actionId;
}

/** The default action id source: the innermost {@link actionScope}. */
export function actionFromScope(tool: string, _args: JsonObject): string {
  const scope = SCOPE.getStore();
  if (scope === undefined) {
    throw new MissingActionIdError(
      `tool '${tool}' called without an action id: wrap the call in actionScope(...) or pass actionId: (tool, args) => ... to intentTool`,
    );
  }
  return scope.actionId;
}

const UNKNOWN_OUTCOME =
  "OUTCOME UNKNOWN. The request for {tool} (action {action_id}) was recorded but its result " +
  "is not known yet; it may still complete. Do NOT retry or resubmit it, and do not tell the " +
  "user it failed. Its status can be checked later.";

const AWAITING_APPROVAL =
  "AWAITING APPROVAL. The request for {tool} (action {action_id}) was recorded and waits for a " +
  "person to approve these exact arguments; nothing has been sent. Do NOT retry or resubmit " +
  "it, and do not call again under another action id. Tell the user it waits for approval; " +
  "it runs once approved, or fails if it is rejected or not approved in time. Its status can " +
  "be checked later.";

const NOT_APPROVED =
  "NOT APPROVED (nothing was sent, and it will not be). A person rejected the request for " +
  "{tool} (action {action_id}).";

const APPROVAL_EXPIRED =
  "APPROVAL EXPIRED (nothing was sent, and it will not be). Nobody approved the request for " +
  "{tool} (action {action_id}) before its wait ended.";

const NOT_APPROVED_ADVICE =
  " Tell the user; do not call again under another action id to get around the decision.";

const IN_PROGRESS =
  "ACCEPTED, IN PROGRESS. The downstream accepted the request for {tool} (action {action_id})" +
  "{operation} and is still working on it; the worker checks its status until it is done. Do " +
  "NOT retry or resubmit it, and do not tell the user it failed. Its status can be checked " +
  "later.";

function fill(template: string, tool: string, actionId: string, operation = ""): string {
  return template
    .replace("{tool}", tool)
    .replace("{action_id}", actionId)
    .replace("{operation}", operation);
}

function receiptText(receipt: unknown): string {
  try {
    return canonicalJson(receipt);
  } catch {
    return JSON.stringify(receipt) ?? "null";
  }
}

/** What an intent-backed tool answers. `text` is for the model; `status` is null when nothing
 * was heard before the timeout (treated as pending). */
export interface ToolAnswer {
  readonly status: Status | null;
  readonly text: string;
  readonly event: ResultEvent | null;
  /** Not final (`pending`, or nothing heard): never submit it again, never under a new id. */
  readonly outcomeUnknown: boolean;
  /** `pending` awaiting a person's approval: recorded, nothing sent. */
  readonly awaitingApproval: boolean;
  /** `failed` because its approval did not come (`not_approved`, `approval_expired`). */
  readonly notApproved: boolean;
}

/** Words an answer (or silence: null) for the model, as the Python client does. */
export function answerFor(event: ResultEvent | null, tool: string, actionId: string): ToolAnswer {
  const make = (text: string): ToolAnswer => ({
    status: event === null ? null : event.status,
    text,
    event,
    outcomeUnknown: event === null || event.status === "pending",
    awaitingApproval: event?.status === "pending" && event.uncertainty === "awaiting_approval",
    notApproved:
      event?.status === "failed" &&
      (event.detail === "not_approved" || event.detail === "approval_expired"),
  });
  if (event === null) return make(fill(UNKNOWN_OUTCOME, tool, actionId));
  const says = ` Worker says: ${event.message}`;
  if (event.status === "pending") {
    if (event.uncertainty === "awaiting_approval") {
      return make(fill(AWAITING_APPROVAL, tool, actionId) + says);
    }
    if (event.uncertainty === "in_progress" && event.remote_id) {
      return make(fill(IN_PROGRESS, tool, actionId, ` as operation ${event.remote_id}`) + says);
    }
    return make(fill(UNKNOWN_OUTCOME, tool, actionId) + says);
  }
  if (event.status === "succeeded") {
    let text = `SUCCEEDED. ${event.message} Receipt: ${receiptText(event.receipt)}`;
    if (event.compensates) text += ` This undid action ${event.compensates}.`;
    if (event.compensated_by) {
      text += ` It has since been undone by action ${event.compensated_by}.`;
    }
    return make(text);
  }
  if (event.status === "failed") {
    if (event.detail === "not_approved") {
      return make(`${fill(NOT_APPROVED, tool, actionId)} ${event.message}${NOT_APPROVED_ADVICE}`);
    }
    if (event.detail === "approval_expired") {
      return make(
        `${fill(APPROVAL_EXPIRED, tool, actionId)} ${event.message}${NOT_APPROVED_ADVICE}`,
      );
    }
    return make(`FAILED (it was not applied and will not be). ${event.message}`);
  }
  let text = `REJECTED (${event.reason ?? "rejected"}; nothing was done). ${event.message}`;
  if (event.detail) text += ` Detail: ${event.detail}.`;
  return make(text);
}

/** A JSON Schema of a tool's arguments (an object schema). */
export interface ParametersSchema {
  readonly type: "object";
  readonly properties?: Record<string, unknown>;
  readonly required?: readonly string[];
  readonly [key: string]: unknown;
}

/** Options of {@link intentTool}. */
export interface IntentToolOptions {
  /** The client (or a function returning it, called on every execution). */
  readonly client: IntentClient | (() => IntentClient);
  readonly tenant: string | (() => string);
  /** The worker's tool name (also the tool's name for the model). */
  readonly tool: string;
  readonly description: string;
  /** A JSON Schema object of the arguments; `tenant`, `action_id`, `call_id`, `reply_to` may not
   * be among its properties. */
  readonly parameters: ParametersSchema;
  /** Supplies the action id (default: the innermost {@link actionScope}). */
  readonly actionId?: (tool: string, args: JsonObject) => string;
  /** How long `execute` waits for an answer (default 30 s); then the latest pending, or
   * "outcome unknown". */
  readonly timeoutMs?: number;
}

/** Options of one execution. */
export interface ExecuteOptions {
  /** The model's id of this tool call (the adapters pass the framework's), sent as `call_id`
   * (tracing only, not in the fingerprint); else the {@link actionScope}'s `callId`. Ignored
   * when the worker would refuse it (empty, over 200 characters, control characters). */
  readonly callId?: string | undefined;
}

function usableCallId(callId: string | undefined): string | undefined {
  if (callId === undefined || callId.length === 0 || callId.length > MAX_KEY_LEN) return undefined;
  // biome-ignore lint/suspicious/noControlCharactersInRegex: refusing them is the point
  return /[\u0000-\u001f\u007f-\u009f]/.test(callId) ? undefined : callId;
}

/** A framework-neutral intent-backed tool. */
export interface IntentTool {
  readonly name: string;
  readonly description: string;
  readonly parameters: ParametersSchema;
  /** Publishes the intent and waits; the answer's text for the model. Never throws for a
   * pending answer or silence; throws `InvalidIntentError` (nothing sent), `PublishError` /
   * `PublishInDoubtError`, or {@link MissingActionIdError}. */
  execute(args: unknown, options?: ExecuteOptions): Promise<string>;
  /** As {@link execute}, with the whole answer. */
  answer(args: unknown, options?: ExecuteOptions): Promise<ToolAnswer>;
}

/** An intent-backed tool: calling it publishes an intent (tool = `tool`, arguments = the
 * model's) under the application's action id and returns the worker's answer for the model. */
export function intentTool(options: IntentToolOptions): IntentTool {
  const { tool, description, parameters } = options;
  if (parameters === null || typeof parameters !== "object" || parameters.type !== "object") {
    throw new TypeError(`${tool}: parameters must be a JSON Schema of type "object"`);
  }
  for (const name of RESERVED_PARAMETERS) {
    if (parameters.properties !== undefined && Object.hasOwn(parameters.properties, name)) {
      throw new TypeError(
        `${tool}: parameter '${name}' is set by the application, never by the model; remove it from the tool's parameters`,
      );
    }
  }
  const source = options.actionId ?? actionFromScope;
  const timeoutMs = options.timeoutMs ?? 30_000;

  async function answer(args: unknown, execution: ExecuteOptions = {}): Promise<ToolAnswer> {
    if (args === null || typeof args !== "object" || Array.isArray(args)) {
      throw new TypeError(`${tool}: the arguments must be a JSON object`);
    }
    const argumentsObject = args as JsonObject;
    const actionId = source(tool, argumentsObject);
    const scope = SCOPE.getStore();
    const callId =
      usableCallId(execution.callId) ??
      (scope !== undefined && scope.actionId === actionId ? scope.callId : undefined);
    const client = typeof options.client === "function" ? options.client() : options.client;
    const intent: Intent = {
      tenant: typeof options.tenant === "string" ? options.tenant : options.tenant(),
      action_id: actionId,
      tool,
      arguments: argumentsObject,
      ...(callId === undefined ? {} : { call_id: callId }),
    };
    const sent = await client.publish(intent);
    let event: ResultEvent | null;
    try {
      event = await client.waitFor(sent.tenant, sent.action_id, {
        fingerprint: fingerprint(sent.tool, sent.arguments, sent.compensates),
        timeoutMs,
      });
    } catch (e) {
      if (!(e instanceof NoAnswerError)) throw e;
      event = null;
    }
    return answerFor(event, tool, actionId);
  }

  return {
    name: tool,
    description,
    parameters,
    answer,
    async execute(args: unknown, execution?: ExecuteOptions): Promise<string> {
      return (await answer(args, execution)).text;
    },
  };
}
