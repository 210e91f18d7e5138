#!/usr/bin/env bash
# The worker's user-space instructions per intent, counted by valgrind's callgrind during the
# `cost` benchmark's drain: a figure that does not move with the machine's other load, for changes
# too small to see in CPU time on a shared machine (docs/benchmarks.md, "Cost per intent").
#
#   scripts/instructions-per-intent.sh <dir with worker and reference-downstream> [N1 (2000)] [N2 (6000)]
#
# Runs `target/release/cost` twice, draining N1 and then N2 intents, with the worker under
# callgrind (about 50 times slower, so the drains are small); `worker migrate` runs natively. A
# helper dumps the counters every second (the benchmark ends the worker with SIGKILL, which
# callgrind cannot dump on), and the dumps' totals are summed. The helper asks with
# `vgdb --max-invoke-ms=0`, never through ptrace (what `callgrind_control -d` falls back to when
# the worker waits in a system call): a SIGKILL that lands while vgdb holds the worker stopped
# leaves it a zombie that its parent's wait never reaps, and the benchmark hangs. The start-up
# (loading certificates, connecting, warming statements) costs the same in both runs, so
#   (Ir(N2) - Ir(N1)) / (N2 - N1)
# is what one more intent costs. Instructions are not time: a kernel call counts as one, and a
# `rep movsb` copy (glibc's memcpy for large blocks) counts once per byte, so large copies weigh
# more here than on the CPU. Needs valgrind and the release `cost` binary:
#   cargo build --release -p intent-worker -p reference-downstream --features intent-worker/jemalloc
#   cargo build --release -p e2e --bin cost
set -euo pipefail

bin=$(cd "${1:?usage: $0 <bin dir> [N1] [N2]}" && pwd)
n1=${2:-2000}
n2=${3:-6000}
root=$(cd "$(dirname "$0")/.." && pwd)
command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 2; }
[ -x "$root/target/release/cost" ] || { echo "build target/release/cost first" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$bin/reference-downstream" "$work/"
cat > "$work/worker" <<EOF
#!/usr/bin/env bash
for a in "\$@"; do [ "\$a" = migrate ] && exec "$bin/worker" "\$@"; done
me=\$\$
( sleep 2; while kill -0 \$me 2>/dev/null; do timeout 10 vgdb --max-invoke-ms=0 --pid=\$me dump >/dev/null 2>&1; sleep 1; done ) &
exec valgrind --tool=callgrind --callgrind-out-file="$work/cg.%p" "$bin/worker" "\$@"
EOF
chmod +x "$work/worker"

# Total instructions of one drain of $1 intents.
instructions() {
    rm -f "$work"/cg.*
    INTENT_BIN_DIR="$work" timeout 900 "$root/target/release/cost" --intents "$1" --runs 1 \
        --latency-runs 0 >"$work/cost.log" 2>&1 || { cat "$work/cost.log" >&2; exit 1; }
    sleep 3 # the last dump
    cat "$work"/cg.* | awk '/^totals:/ { s += $2 } END { printf "%d", s }'
}

i1=$(instructions "$n1")
i2=$(instructions "$n2")
echo "worker $bin/worker: $i1 instructions for $n1 intents, $i2 for $n2"
awk -v a="$i1" -v b="$i2" -v n1="$n1" -v n2="$n2" \
    'BEGIN { printf "instructions per intent: %.0f\n", (b - a) / (n2 - n1) }'
