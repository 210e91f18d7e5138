/**
 * The worker's intent fingerprint: lowercase hex SHA-256 of the RFC 8785 canonical JSON of
 * `{"arguments": ..., "tool": ...}` (with `"compensates"` between them for a compensation).
 * Integers that fit 64 bits are written exactly (give them as `bigint` beyond 2^53).
 */
import { createHash } from "node:crypto";
import { canonicalJson, type JsonObject, type JsonValue } from "./json.js";

/** The canonical text the fingerprint hashes. */
export function fingerprintCanonical(
  tool: string,
  args: JsonObject | JsonValue,
  compensates?: string | null,
): string {
  const wrapper: Record<string, unknown> = { arguments: args, tool };
  if (compensates !== undefined && compensates !== null) wrapper.compensates = compensates;
  return canonicalJson(wrapper);
}

/** The fingerprint the worker computes for `tool` and `args` (and `compensates` when given);
 * result events carry it. */
export function fingerprint(
  tool: string,
  args: JsonObject | JsonValue,
  compensates?: string | null,
): string {
  return createHash("sha256")
    .update(fingerprintCanonical(tool, args, compensates), "utf8")
    .digest("hex");
}
