#!/usr/bin/env bash
# Runs the by-hand set-up of docs/operations.md ("By hand, without Docker"), then the README's
# `publisher mcp` command, then the teardown, as written, one after the other in one shell, and
# checks what they promise: both sends succeed, the workers are ready, the gateway lists its
# tools, and nothing logs an ERROR. The one liberty: the binaries are DIR's (the test command's
# debug build) instead of a release build, which would add minutes.
#
#   scripts/by_hand_check.sh --bin-dir DIR
#
# It needs what the steps need (Postgres and RabbitMQ on localhost, rabbitmqctl, openssl) and
# the ports they use (8080, 9100, 9464-9466, 9470). Left-overs of an interrupted run (the vhost,
# the databases) are removed first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

[ "${1:-}" = --bin-dir ] && [ -n "${2:-}" ] || { echo "usage: $0 --bin-dir DIR" >&2; exit 2; }
BIN_DIR=$(cd "$2" && pwd)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python3 - "$BIN_DIR" "$work/steps.sh" <<'PY'
import re, sys
bin_dir, out = sys.argv[1], sys.argv[2]
ops = open("docs/operations.md").read()
section = ops[ops.index("## By hand, without Docker"):]
section = section[:section.index("\n## ", 3)]
blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
assert len(blocks) == 2, f"expected the set-up and the teardown, found {len(blocks)} blocks"
readme = open("README.md").read()
mcp = [b for b in re.findall(r"```sh\n(.*?)```", readme, re.S) if "publisher mcp" in b]
assert len(mcp) == 1, "the README's publisher mcp command"
setup, teardown = blocks
# The build is the test command's: drop the release build, use its binaries.
setup = re.sub(r"cargo build --release[^\n]*\\\n[^\n]*\n", "", setup)
assert "cargo build --release --locked" not in setup, "the release build was not recognised"
check = f"""
sleep 3
curl -sf -H "Authorization: Bearer $NORTH_MCP_TOKEN" -H 'Accept: application/json, text/event-stream' \\
  -H 'Content-Type: application/json' -d '{{"jsonrpc":"2.0","id":1,"method":"tools/list"}}' \\
  http://127.0.0.1:9470/mcp | grep -q '"refund"'
curl -sf http://127.0.0.1:9464/readyz | grep -q '"ready"'
curl -sf http://127.0.0.1:9465/readyz | grep -q '"ready"'
"""
script = "set -euo pipefail\n" + setup + mcp[0] + check + teardown
script = script.replace("target/release/", bin_dir + "/")
open(out, "w").write(script)
PY

# Left-overs of an interrupted run.
rabbitmqctl delete_vhost iw-local >/dev/null 2>&1 || true
for db in iw_local_intents iw_local_downstream iw_local_agent; do
    dropdb -h 127.0.0.1 -U postgres --if-exists "$db" 2>/dev/null || true
done

if ! bash "$work/steps.sh" >"$work/out.log" 2>&1; then
    cat "$work/out.log"
    echo "by-hand steps: FAILED (above: their output)" >&2
    exit 1
fi
sends=$(grep -c '"status":"succeeded"' "$work/out.log" || true)
if [ "$sends" -lt 1 ] || ! grep -q '^published north-shop:refund-204' "$work/out.log"; then
    cat "$work/out.log"
    echo "by-hand steps: the sends did not succeed" >&2
    exit 1
fi
if grep -n ' ERROR ' "$work/out.log"; then
    echo "by-hand steps: an ERROR was logged (above)" >&2
    exit 1
fi
echo "by-hand steps: set-up, sends, gateway and teardown ran as written"
