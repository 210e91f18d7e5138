/**
 * Strict JSON (RFC 8259) read the way the worker's parser (serde_json with `float_roundtrip`)
 * reads it, JSON written byte for byte as it is sent, and RFC 8785 canonical JSON.
 */

/** A JSON value. Integers beyond 2^53 may be given as `bigint` to be sent exactly. */
export type JsonValue = null | boolean | number | bigint | string | JsonArray | JsonObject;
/** A JSON array. */
export type JsonArray = readonly JsonValue[];
/** A JSON object. */
export interface JsonObject {
  readonly [key: string]: JsonValue;
}

/** A parse failure (the caller turns it into `not_json`). */
export class JsonSyntaxError extends Error {}

const MAX_DEPTH = 128;
const I64_MIN = -(2n ** 63n);
const U64_MAX = 2n ** 64n - 1n;
const SAFE_MAX = BigInt(Number.MAX_SAFE_INTEGER);

function shorten(literal: string): string {
  return literal.length <= 40 ? literal : `${literal.slice(0, 40)}…`;
}

/** The parsed value, the key lists of its objects (duplicates kept) and the first number whose
 * value the worker's reading would change. */
export interface Parsed {
  value: JsonValue;
  /** Keys of every parsed object in document order, repeats included. */
  keys: WeakMap<object, string[]>;
  /** Why a number cannot be taken as sent (the worker refuses it), or undefined. */
  changed: string | undefined;
}

/** Parses strict JSON text. Throws {@link JsonSyntaxError}. */
export function parseJson(text: string): Parsed {
  const keys = new WeakMap<object, string[]>();
  let changed: string | undefined;
  let i = 0;
  const n = text.length;

  const fail = (what: string): never => {
    throw new JsonSyntaxError(`${what} at character ${i}`);
  };
  const ws = (): void => {
    while (i < n) {
      const c = text.charCodeAt(i);
      if (c === 0x20 || c === 0x09 || c === 0x0a || c === 0x0d) i++;
      else break;
    }
  };
  const note = (literal: string, why: string): void => {
    if (changed === undefined) changed = `number ${shorten(literal)} ${why}; send it as a string`;
  };

  const hex4 = (at: number): number => {
    const h = text.slice(at, at + 4);
    if (!/^[0-9a-fA-F]{4}$/.test(h)) fail("invalid \\u escape");
    return Number.parseInt(h, 16);
  };

  const str = (): string => {
    // text[i] is the opening quote
    i++;
    let out = "";
    let start = i;
    while (true) {
      if (i >= n) fail("unterminated string");
      const c = text.charCodeAt(i);
      if (c === 0x22) {
        out += text.slice(start, i);
        i++;
        return out;
      }
      if (c < 0x20) fail("control character in a string");
      if (c === 0x5c) {
        out += text.slice(start, i);
        const e = text[i + 1];
        switch (e) {
          case '"':
            out += '"';
            break;
          case "\\":
            out += "\\";
            break;
          case "/":
            out += "/";
            break;
          case "b":
            out += "\b";
            break;
          case "f":
            out += "\f";
            break;
          case "n":
            out += "\n";
            break;
          case "r":
            out += "\r";
            break;
          case "t":
            out += "\t";
            break;
          case "u": {
            const u = hex4(i + 2);
            if (u >= 0xd800 && u <= 0xdbff) {
              if (text[i + 6] !== "\\" || text[i + 7] !== "u") fail("lone surrogate");
              const low = hex4(i + 8);
              if (low < 0xdc00 || low > 0xdfff) fail("lone surrogate");
              out += String.fromCharCode(u, low);
              i += 6;
            } else if (u >= 0xdc00 && u <= 0xdfff) {
              fail("lone surrogate");
            } else {
              out += String.fromCharCode(u);
            }
            i += 4;
            break;
          }
          default:
            fail("invalid escape");
        }
        i += 2;
        start = i;
        continue;
      }
      i++;
    }
  };

  const num = (): number | bigint => {
    const m = /-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/y;
    m.lastIndex = i;
    const found = m.exec(text);
    if (found === null) return fail("invalid number");
    const literal = found[0];
    i += literal.length;
    if (found[1] === undefined && found[2] === undefined) {
      const b = BigInt(literal);
      if (b >= I64_MIN && b <= U64_MAX) {
        return b >= -SAFE_MAX && b <= SAFE_MAX ? Number(b) : b;
      }
      const d = Number(literal);
      if (!Number.isFinite(d)) fail(`number out of range: ${shorten(literal)}`);
      note(literal, "is outside the 64-bit integer range (-2^63 to 2^64-1) and would be rounded");
      return d;
    }
    const d = Number(literal);
    if (!Number.isFinite(d)) fail(`number out of range: ${shorten(literal)}`);
    const mantissa = literal.split(/[eE]/)[0] ?? "";
    if (d === 0 && /[1-9]/.test(mantissa)) {
      note(literal, "is too small for a double and would become 0");
    }
    return d;
  };

  const value = (depth: number): JsonValue => {
    ws();
    if (i >= n) fail("unexpected end");
    const c = text[i];
    if (c === "{" || c === "[") {
      if (depth + 1 >= MAX_DEPTH) fail("recursion limit exceeded");
      i++;
      ws();
      if (c === "[") {
        const arr: JsonValue[] = [];
        if (text[i] === "]") {
          i++;
          return arr;
        }
        while (true) {
          arr.push(value(depth + 1));
          ws();
          if (text[i] === ",") {
            i++;
            continue;
          }
          if (text[i] === "]") {
            i++;
            return arr;
          }
          fail("expected ',' or ']'");
        }
      }
      const obj: Record<string, JsonValue> = Object.create(null) as Record<string, JsonValue>;
      const names: string[] = [];
      keys.set(obj, names);
      if (text[i] === "}") {
        i++;
        return obj;
      }
      while (true) {
        ws();
        if (text[i] !== '"') fail("expected a key");
        const k = str();
        ws();
        if (text[i] !== ":") fail("expected ':'");
        i++;
        const v = value(depth + 1);
        names.push(k);
        obj[k] = v;
        ws();
        if (text[i] === ",") {
          i++;
          continue;
        }
        if (text[i] === "}") {
          i++;
          return obj;
        }
        fail("expected ',' or '}'");
      }
    }
    if (c === '"') return str();
    if (c === "-" || (c !== undefined && c >= "0" && c <= "9")) return num();
    for (const [word, v] of [
      ["true", true],
      ["false", false],
      ["null", null],
    ] as const) {
      if (text.startsWith(word, i)) {
        i += word.length;
        return v;
      }
    }
    return fail("expected a value");
  };

  const v = value(0);
  ws();
  if (i !== n) fail("trailing characters");
  return { value: v, keys, changed };
}

function isPlainObject(v: object): boolean {
  const proto: unknown = Object.getPrototypeOf(v);
  return proto === Object.prototype || proto === null;
}

function write(value: unknown, sorted: boolean, seen: Set<object>): string {
  if (value === null) return "null";
  switch (typeof value) {
    case "boolean":
      return value ? "true" : "false";
    case "number":
      if (!Number.isFinite(value)) throw new TypeError(`${value} is not a JSON number`);
      // ECMAScript Number::toString: the RFC 8785 number form; -0 is "0".
      return String(value);
    case "bigint":
      return value.toString();
    case "string":
      // JSON.stringify escapes as RFC 8785 does (\b \f \n \r \t, other controls \u00xx).
      return JSON.stringify(value);
    case "object": {
      if (seen.has(value)) throw new TypeError("a cyclic value is not JSON");
      seen.add(value);
      try {
        if (Array.isArray(value)) {
          return `[${value.map((item: unknown) => write(item, sorted, seen)).join(",")}]`;
        }
        if (!isPlainObject(value)) throw new TypeError("only plain objects are JSON objects");
        const record = value as Record<string, unknown>;
        const names = Object.keys(record);
        // JS's default sort compares UTF-16 code units, the order RFC 8785 asks for.
        if (sorted) names.sort();
        return `{${names.map((k) => `${JSON.stringify(k)}:${write(record[k], sorted, seen)}`).join(",")}}`;
      } finally {
        seen.delete(value);
      }
    }
    default:
      throw new TypeError(`a ${typeof value} is not JSON`);
  }
}

/** `value` as compact JSON, keys in their own order (what is sent). Throws TypeError. */
export function toJson(value: unknown): string {
  return write(value, false, new Set());
}

/** `value` in RFC 8785 canonical form (integers beyond 2^53 exact when `bigint`). */
export function canonicalJson(value: unknown): string {
  return write(value, true, new Set());
}
