/**
 * The intent (message contract version 1) and a strict decoder that mirrors the worker's
 * (Rust `protocol::decode_intent`, and the Python client's `decode_intent`): same rules, same
 * order, same error codes, run on the exact bytes that will be sent.
 */
import { type JsonObject, JsonSyntaxError, type JsonValue, parseJson, toJson } from "./json.js";

/** Largest accepted intent body, in bytes of UTF-8. */
export const MAX_INTENT_BYTES = 256 * 1024;
/** Longest tenant, action_id, call_id, reply_to and compensates, in characters. */
export const MAX_KEY_LEN = 200;
/** Longest tool, in characters. */
export const MAX_TOOL_LEN = 64;
/** Longest action key `<tenant>:<action_id>`, in bytes (the AMQP message_id). */
export const MAX_ACTION_KEY_BYTES = 255;

/** Every decode error code, in the order the worker checks the rules. */
export const CODES = [
  "too_large",
  "not_json",
  "not_an_object",
  "duplicate_field",
  "unknown_field",
  "missing_field",
  "wrong_type",
  "empty_field",
  "too_long",
  "invalid_characters",
  "key_too_long",
  "nul_character",
] as const;
/** A decode error code of the worker. */
export type InvalidIntentCode = (typeof CODES)[number];

/** A request for one side effect. */
export interface Intent {
  /** The tenant: ASCII letters, digits, `-`, `_`, `.`; at most 200 characters. */
  readonly tenant: string;
  /** The application's key of this action (never chosen by a model): visible ASCII. */
  readonly action_id: string;
  /** The tool to call: ASCII letters, digits, `-`, `_`, `.`; at most 64 characters. */
  readonly tool: string;
  /** The tool's arguments (covered by the fingerprint). */
  readonly arguments: JsonObject;
  /** The model's call id, for tracing only (not in the fingerprint). */
  readonly call_id?: string | null;
  /** The agent whose results queue gets the answer. */
  readonly reply_to?: string | null;
  /** The action_id of a succeeded action of the same tenant that this one undoes. */
  readonly compensates?: string | null;
}

/** The intent body broke a rule of the wire contract; `code` is the worker's error code. */
export class InvalidIntentError extends Error {
  readonly code: InvalidIntentCode;
  readonly field: string | undefined;
  constructor(code: InvalidIntentCode, message: string, field?: string) {
    super(message);
    this.name = "InvalidIntentError";
    this.code = code;
    this.field = field;
  }
}

const KNOWN_FIELDS = [
  "tenant",
  "action_id",
  "tool",
  "arguments",
  "call_id",
  "reply_to",
  "compensates",
];
const REQUIRED = ["tenant", "action_id", "tool", "arguments"] as const;
const OPTIONAL = ["call_id", "reply_to", "compensates"] as const;
type KeyField = "tenant" | "action_id" | "tool" | (typeof OPTIONAL)[number];

const NAME_CHARS = "ASCII letters, digits, '-', '_' and '.'";
const VISIBLE = "visible ASCII characters (0x21 to 0x7E), no spaces or control characters";
const isName = (s: string): boolean => /^[A-Za-z0-9._-]+$/.test(s);
const isVisible = (s: string): boolean => {
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (c < 0x21 || c > 0x7e) return false;
  }
  return s.length > 0;
};
// Rust's char::is_control: C0, DEL and C1.
const hasNoControl = (s: string): boolean => {
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (c <= 0x1f || (c >= 0x7f && c <= 0x9f)) return false;
  }
  return true;
};

const RULES: Record<KeyField, [number, (s: string) => boolean, string]> = {
  tenant: [MAX_KEY_LEN, isName, NAME_CHARS],
  action_id: [MAX_KEY_LEN, isVisible, VISIBLE],
  tool: [MAX_TOOL_LEN, isName, NAME_CHARS],
  call_id: [MAX_KEY_LEN, hasNoControl, "characters other than control characters"],
  reply_to: [MAX_KEY_LEN, isName, NAME_CHARS],
  compensates: [MAX_KEY_LEN, isVisible, VISIBLE],
};

const MAX_ECHOED_NAME = 64;
function codePoints(s: string): string[] {
  return Array.from(s);
}
function echo(name: string): string {
  const cps = codePoints(name);
  return cps.length <= MAX_ECHOED_NAME ? name : `${cps.slice(0, MAX_ECHOED_NAME).join("")}…`;
}

const encoder = new TextEncoder();
const strictDecoder = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true });

/** The logical action key `<tenant>:<action_id>`: the AMQP message_id. */
export function actionKey(tenant: string, actionId: string): string {
  return `${tenant}:${actionId}`;
}

function checkActionKey(tenant: string, actionId: string): void {
  const size = encoder.encode(actionKey(tenant, actionId)).length;
  if (size > MAX_ACTION_KEY_BYTES) {
    throw new InvalidIntentError(
      "key_too_long",
      `tenant and action_id make an action key ("<tenant>:<action_id>") of ${size} bytes, over the ${MAX_ACTION_KEY_BYTES}-byte limit of an AMQP message id`,
    );
  }
}

function compareUtf8(a: string, b: string): number {
  const x = encoder.encode(a);
  const y = encoder.encode(b);
  const n = Math.min(x.length, y.length);
  for (let i = 0; i < n; i++) {
    const d = (x[i] as number) - (y[i] as number);
    if (d !== 0) return d;
  }
  return x.length - y.length;
}

function nulPath(value: JsonValue, at: string): string | undefined {
  if (typeof value === "string") return value.includes("\0") ? at : undefined;
  if (Array.isArray(value)) {
    for (let i = 0; i < value.length; i++) {
      const found = nulPath(value[i] as JsonValue, `${at}[${i}]`);
      if (found !== undefined) return found;
    }
  } else if (value !== null && typeof value === "object") {
    const record = value as JsonObject;
    for (const key of Object.keys(record).sort(compareUtf8)) {
      if (key.includes("\0")) return at;
      const found = nulPath(record[key] as JsonValue, `${at}.${echo(key)}`);
      if (found !== undefined) return found;
    }
  }
  return undefined;
}

/** A decoded intent and the exact body it came from. */
export interface DecodedIntent {
  readonly intent: Intent;
  readonly body: Uint8Array;
}

/** Decodes and validates an intent body, reporting the first broken rule in the worker's order.
 * Throws {@link InvalidIntentError}. */
export function decodeIntent(body: Uint8Array): Intent {
  if (body.length > MAX_INTENT_BYTES) {
    throw new InvalidIntentError(
      "too_large",
      `intent is ${body.length} bytes, over the ${MAX_INTENT_BYTES}-byte limit`,
    );
  }
  let first = 0;
  while (first < body.length && WS.has(body[first] as number)) first++;
  if (body[first] === 0x5b) {
    // The worker only skips over an array's contents before refusing it.
    if (arraySyntaxOk(body)) {
      throw new InvalidIntentError("not_an_object", "intent must be a JSON object");
    }
    throw new InvalidIntentError("not_json", "intent is not valid JSON");
  }
  let parsed: ReturnType<typeof parseJson>;
  try {
    parsed = parseJson(strictDecoder.decode(body));
  } catch (e) {
    const why = e instanceof JsonSyntaxError || e instanceof TypeError ? e.message : String(e);
    throw new InvalidIntentError("not_json", `intent is not valid JSON: ${why}`);
  }
  const value = parsed.value;
  if (value === null || typeof value !== "object" || Array.isArray(value)) {
    throw new InvalidIntentError("not_an_object", "intent must be a JSON object");
  }
  if (parsed.changed !== undefined) {
    throw new InvalidIntentError("not_json", `intent is not valid JSON: ${parsed.changed}`);
  }
  const obj = value as JsonObject;
  const names = parsed.keys.get(obj) ?? [];
  const seen = new Set<string>();
  for (const name of names) {
    if (seen.has(name)) {
      throw new InvalidIntentError(
        "duplicate_field",
        `field ${JSON.stringify(echo(name))} appears more than once`,
        echo(name),
      );
    }
    seen.add(name);
  }
  for (const name of names) {
    if (!KNOWN_FIELDS.includes(name)) {
      throw new InvalidIntentError(
        "unknown_field",
        `unknown field ${JSON.stringify(echo(name))}; allowed fields are tenant, action_id, tool, arguments, call_id, reply_to and compensates`,
        echo(name),
      );
    }
  }
  for (const name of REQUIRED) {
    if (!seen.has(name)) {
      throw new InvalidIntentError("missing_field", `required field '${name}' is missing`, name);
    }
  }
  for (const name of ["tenant", "action_id", "tool"] as const) {
    if (typeof obj[name] !== "string") {
      throw new InvalidIntentError("wrong_type", `field '${name}' must be a string`, name);
    }
  }
  const args = obj.arguments;
  if (args === null || typeof args !== "object" || Array.isArray(args)) {
    throw new InvalidIntentError(
      "wrong_type",
      "field 'arguments' must be a JSON object",
      "arguments",
    );
  }
  for (const name of OPTIONAL) {
    const v = obj[name];
    if (v !== undefined && v !== null && typeof v !== "string") {
      throw new InvalidIntentError("wrong_type", `field '${name}' must be a string or null`, name);
    }
  }
  const checked: [KeyField, string][] = [
    ["tenant", obj.tenant as string],
    ["action_id", obj.action_id as string],
    ["tool", obj.tool as string],
  ];
  for (const name of OPTIONAL) {
    const v = obj[name];
    if (typeof v === "string") checked.push([name, v]);
  }
  checkRules(checked);
  checkActionKey(obj.tenant as string, obj.action_id as string);
  const at = nulPath(args, "arguments");
  if (at !== undefined) {
    throw new InvalidIntentError(
      "nul_character",
      `${at} contains U+0000 (NUL), which a downstream keeping JSON in Postgres jsonb cannot store; remove it or encode the value (e.g. base64)`,
    );
  }
  const optional = (name: (typeof OPTIONAL)[number]): string | undefined => {
    const v = obj[name];
    return typeof v === "string" ? v : undefined;
  };
  const intent: {
    -readonly [K in keyof Intent]: Intent[K];
  } = {
    tenant: obj.tenant as string,
    action_id: obj.action_id as string,
    tool: obj.tool as string,
    arguments: args as JsonObject,
  };
  const callId = optional("call_id");
  const replyTo = optional("reply_to");
  const compensates = optional("compensates");
  if (callId !== undefined) intent.call_id = callId;
  if (replyTo !== undefined) intent.reply_to = replyTo;
  if (compensates !== undefined) intent.compensates = compensates;
  return intent;
}

function checkRules(fields: [KeyField, string][]): void {
  // One rule kind at a time across all fields, as the worker does.
  for (const [name, text] of fields) {
    if (text.length === 0) {
      throw new InvalidIntentError("empty_field", `field '${name}' must not be empty`, name);
    }
  }
  for (const [name, text] of fields) {
    const limit = RULES[name][0];
    const len = codePoints(text).length;
    if (len > limit) {
      throw new InvalidIntentError(
        "too_long",
        `field '${name}' is ${len} characters long, over the ${limit}-character limit`,
        name,
      );
    }
  }
  for (const [name, text] of fields) {
    const [, accepts, allowed] = RULES[name];
    if (!accepts(text)) {
      throw new InvalidIntentError(
        "invalid_characters",
        `field '${name}' may contain only ${allowed}`,
        name,
      );
    }
  }
}

/** The body to send for `intent` (fields in contract order, absent optionals left out). */
export function intentBody(intent: Intent): Uint8Array {
  const body: Record<string, unknown> = {
    tenant: intent.tenant,
    action_id: intent.action_id,
    tool: intent.tool,
    arguments: intent.arguments,
  };
  for (const name of OPTIONAL) {
    const v = intent[name];
    if (v !== undefined && v !== null) body[name] = v;
  }
  let text: string;
  try {
    text = toJson(body);
  } catch (e) {
    throw new InvalidIntentError(
      "not_json",
      `intent is not valid JSON: ${e instanceof Error ? e.message : String(e)}`,
    );
  }
  return encoder.encode(text);
}

/** Validates `intent` on the exact bytes that will be sent, as the worker will decode them;
 * returns the decoded intent and those bytes. Throws {@link InvalidIntentError}. */
export function validateIntent(intent: Intent): DecodedIntent {
  const body = intentBody(intent);
  return { intent: decodeIntent(body), body };
}

const WS = new Set([0x20, 0x09, 0x0a, 0x0d]);
const ESCAPES_OK = new Set(Array.from('"\\/bfnrtu', (c) => c.charCodeAt(0)));
const isHex = (b: number | undefined): boolean =>
  b !== undefined &&
  ((b >= 0x30 && b <= 0x39) || (b >= 0x41 && b <= 0x46) || (b >= 0x61 && b <= 0x66));
const isDigit = (b: number | undefined): boolean => b !== undefined && b >= 0x30 && b <= 0x39;

/** Whether `data` is a syntactically valid JSON array, judged like serde_json skips a value it
 * ignores: syntax only, without UTF-8, lone-surrogate, number-range or depth checks. */
function arraySyntaxOk(data: Uint8Array): boolean {
  const n = data.length;
  const skipWs = (j: number): number => {
    let i = j;
    while (i < n && WS.has(data[i] as number)) i++;
    return i;
  };
  const startsWith = (word: string, at: number): boolean => {
    for (let k = 0; k < word.length; k++) if (data[at + k] !== word.charCodeAt(k)) return false;
    return true;
  };
  const scalar = (j: number): number => {
    let i = j;
    const c = data[i] as number;
    if (c === 0x22) {
      i++;
      while (i < n) {
        const b = data[i] as number;
        if (b === 0x22) return i + 1;
        if (b === 0x5c) {
          if (i + 1 >= n || !ESCAPES_OK.has(data[i + 1] as number)) return -1;
          if (data[i + 1] === 0x75) {
            if (i + 6 > n) return -1;
            for (let k = i + 2; k < i + 6; k++) if (!isHex(data[k])) return -1;
            i += 6;
          } else {
            i += 2;
          }
        } else if (b < 0x20) {
          return -1;
        } else {
          i++;
        }
      }
      return -1;
    }
    if (c === 0x2d || isDigit(c)) {
      if (c === 0x2d) i++;
      if (i >= n || !isDigit(data[i])) return -1;
      if (data[i] === 0x30) i++;
      else while (i < n && isDigit(data[i])) i++;
      if (i < n && data[i] === 0x2e) {
        i++;
        const start = i;
        while (i < n && isDigit(data[i])) i++;
        if (i === start) return -1;
      }
      if (i < n && (data[i] === 0x65 || data[i] === 0x45)) {
        i++;
        if (i < n && (data[i] === 0x2b || data[i] === 0x2d)) i++;
        const start = i;
        while (i < n && isDigit(data[i])) i++;
        if (i === start) return -1;
      }
      if (i < n && isDigit(data[i])) return -1;
      return i;
    }
    for (const word of ["true", "false", "null"]) {
      if (startsWith(word, i)) return i + word.length;
    }
    return -1;
  };
  const member = (j: number): number => {
    // An object member's key and ':'; the index of its value, or -1.
    let i = j;
    if (i >= n || data[i] !== 0x22) return -1;
    i = scalar(i);
    if (i < 0) return -1;
    i = skipWs(i);
    if (i >= n || data[i] !== 0x3a) return -1;
    return i + 1;
  };

  let i = skipWs(0);
  if (i >= n || data[i] !== 0x5b) return false;
  const stack: number[] = [];
  let expectValue = true;
  while (true) {
    i = skipWs(i);
    if (i >= n) return false;
    const c = data[i] as number;
    if (expectValue) {
      if (c === 0x5b || c === 0x7b) {
        stack.push(c);
        i = skipWs(i + 1);
        if (i < n && data[i] === (c === 0x5b ? 0x5d : 0x7d)) {
          stack.pop();
          i++;
          expectValue = false;
          if (stack.length === 0) break;
          continue;
        }
        if (c === 0x7b) {
          i = member(i);
          if (i < 0) return false;
        }
        continue;
      }
      i = scalar(i);
      if (i < 0) return false;
      expectValue = false;
      if (stack.length === 0) break;
      continue;
    }
    const top = stack[stack.length - 1];
    if (c === 0x2c) {
      i = skipWs(i + 1);
      if (top === 0x7b) {
        i = member(i);
        if (i < 0) return false;
      }
      expectValue = true;
    } else if (c === (top === 0x5b ? 0x5d : 0x7d)) {
      stack.pop();
      i++;
      if (stack.length === 0) break;
    } else {
      return false;
    }
  }
  return skipWs(i) === n;
}
