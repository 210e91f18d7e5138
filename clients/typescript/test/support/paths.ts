import { existsSync } from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

/** The repository root (this file is dist/test/support/paths.js in clients/typescript). */
export const REPO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../../../../..");
export const FIXTURES = path.join(REPO, "docs/schema/fixtures");

/** Where the built binaries are: INTENT_BIN_DIR (scripts/test.sh stages them), else
 * $CARGO_TARGET_DIR/debug or target/debug. */
export function binDir(): string {
  const explicit = process.env.INTENT_BIN_DIR;
  if (explicit) return explicit;
  const target = process.env.CARGO_TARGET_DIR ?? "target";
  return path.join(path.isAbsolute(target) ? target : path.join(REPO, target), "debug");
}

/** A built binary (or the decoder example), or a clear error. */
export function binary(name: string): string {
  const candidates = [path.join(binDir(), name), path.join(binDir(), "examples", name)];
  const found = candidates.find((p) => existsSync(p));
  if (found === undefined) {
    throw new Error(
      `${candidates[0]} is missing: run \`cargo build --workspace --bins --examples\` first (scripts/test.sh does)`,
    );
  }
  return found;
}
