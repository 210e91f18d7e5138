#!/usr/bin/env bash
# The Quick start without Docker (README, "Locally, one command"): the compose demo on this
# machine's Postgres and RabbitMQ.
#
#   scripts/demo.sh                     build the release binaries, start everything, run the
#                                       demo agent, print a summary, keep running until Ctrl-C
#   scripts/demo.sh --once              the same, then check the summary against the
#                                       downstream's own table, stop everything and exit
#                                       (0: every check passed, 1: one failed, 2: set-up)
#   scripts/demo.sh --bin-dir DIR       use the worker, publisher, reference-downstream and
#                                       demo-agent binaries in DIR instead of building (e.g.
#                                       target/debug)
#
# It creates (dropping any earlier copy) the databases intent_demo_ledger, intent_demo_agent and
# intent_demo_downstream, starts the reference downstream, two workers (worker-1 with the admin
# and status API) and the agent-side relay (`publisher relay`), then runs the demo agent
# (`demo-agent --scenario full`, examples/demo-agent): refunds through the agent's transactional
# outbox, every third one again with its JSON reordered and re-spaced (answered from the ledger),
# one action id reused with other arguments (refused: intent_conflict), one `deploy` (a
# long-running tool, completion = "async": accepted with an operation id, pending while the
# worker polls its status URL, then succeeded, verified by the poll), one `payout` (a tool
# without recovery) whose reply the downstream loses after committing (pending, then held for a
# person), one refund above the refund tool's approval limit (pending, awaiting approval, never
# sent until the agent, standing in for a person, approves it with `worker ops approve`; then
# sent once and succeeded) and one `refund_reversal` compensating the first refund (succeeded;
# the refund is announced again with compensated_by). The downstream runs a deploy for
# DOWNSTREAM_ASYNC_DELAY_MS=1000 ms.
# Broker names are its own (intent-demo.intents, intent-demo.results, intent-demo.intents.dlx,
# intent-demo.intents.dead); the admin API on worker-1 takes DEMO_ADMIN_TOKEN, the status API
# also the tenant token demo-shop-status-token.
# Everything it starts is recorded under the state directory and stopped on Ctrl-C, on exit with
# --once, and (if a previous run was killed) at the next start. Safe to run again.
#
# Postgres and RabbitMQ must be reachable; local ones that are installed but stopped are
# started, and on Debian/Ubuntu as root missing ones are installed with apt-get (scripts/lib/
# services.sh, shared with scripts/test.sh). Otherwise it prints what to install and exits 2.
#
# Environment (all optional):
#   DEMO_DATABASE_URL   Postgres server, as an admin URL (default $TEST_DATABASE_URL, else
#                       postgres://postgres@127.0.0.1:5432/postgres); the demo's databases are
#                       created next to its database
#   DEMO_AMQP_URL       RabbitMQ (default $TEST_AMQP_URL, else amqp://guest:guest@127.0.0.1:5672/%2f)
#   DEMO_BIN_DIR        as --bin-dir
#   DEMO_STATE_DIR      pid files, logs, tools file, summary (default $CARGO_TARGET_DIR/demo or
#                       target/demo)
#   DEMO_DOWNSTREAM_PORT (19100), DEMO_ADMIN_PORT (18080, worker-1's admin and status API),
#   DEMO_METRICS_PORT (19464, worker-1), DEMO_METRICS_PORT_2 (19465, worker-2),
#   DEMO_RELAY_METRICS_PORT (19466)
#   DEMO_COUNT          refunds the agent sends (default 12)
#   DEMO_ADMIN_TOKEN    worker-1's admin token (default demo-admin-token-local)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { printf '[demo] %s\n' "$*"; }
fail() {
    printf '[demo] ERROR: %s\n' "$1" >&2
    exit "${2:-1}"
}

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
}

ONCE=0
BIN_DIR=${DEMO_BIN_DIR:-}
while [ $# -gt 0 ]; do
    case $1 in
        --once) ONCE=1 ;;
        --bin-dir)
            [ $# -ge 2 ] || fail "--bin-dir needs a directory" 2
            BIN_DIR=$2
            shift
            ;;
        --bin-dir=*) BIN_DIR=${1#--bin-dir=} ;;
        -h | --help)
            usage
            exit 0
            ;;
        *) fail "unknown argument $1 (see scripts/demo.sh --help)" 2 ;;
    esac
    shift
done

TARGET=${CARGO_TARGET_DIR:-target}
STATE=${DEMO_STATE_DIR:-$TARGET/demo}
DEMO_DATABASE_URL=${DEMO_DATABASE_URL:-${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}}
DEMO_AMQP_URL=${DEMO_AMQP_URL:-${TEST_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}}
DS_PORT=${DEMO_DOWNSTREAM_PORT:-19100}
ADMIN_PORT=${DEMO_ADMIN_PORT:-18080}
METRICS_1=${DEMO_METRICS_PORT:-19464}
METRICS_2=${DEMO_METRICS_PORT_2:-19465}
RELAY_METRICS=${DEMO_RELAY_METRICS_PORT:-19466}
COUNT=${DEMO_COUNT:-12}
ADMIN_TOKEN=${DEMO_ADMIN_TOKEN:-demo-admin-token-local}
TENANT=demo-shop
TENANT_TOKEN=demo-shop-status-token
DB_LEDGER=intent_demo_ledger
DB_AGENT=intent_demo_agent
DB_DOWNSTREAM=intent_demo_downstream
# Broker names of the demo's own (the tests use per-test names, never these).
EX_INTENTS=intent-demo.intents
Q_INTENTS=intent-demo.intents
EX_RESULTS=intent-demo.results
EX_DLX=intent-demo.intents.dlx
Q_DEAD=intent-demo.intents.dead
WAIT_SECS=60
APT_LOG=/tmp/demo-sh-apt.log
# What this run started: name -> pid, in start order (stopped in reverse).
NAMES=()
declare -A PIDS=()
FG_PID=""
STOPPING=0
# Set once the demo is up and waiting for Ctrl-C: stopping then is the normal end (exit 0).
SERVING=0

[[ $COUNT =~ ^[1-9][0-9]*$ ]] || fail "DEMO_COUNT must be a positive number (now: $COUNT)" 2
mkdir -p "$STATE"
STATE=$(cd "$STATE" && pwd)

# ---- database URLs -----------------------------------------------------------------------------
# db_url NAME: DEMO_DATABASE_URL with its database replaced by NAME (query string kept).
db_url() {
    local url=$DEMO_DATABASE_URL query="" rest
    if [[ $url == *\?* ]]; then
        query="?${url#*\?}"
        url=${url%%\?*}
    fi
    rest=${url#*://}
    if [[ $rest == */* ]]; then
        url=${url%/*}
    fi
    printf '%s/%s%s\n' "$url" "$1" "$query"
}
LEDGER_URL=$(db_url "$DB_LEDGER")
AGENT_URL=$(db_url "$DB_AGENT")
DOWNSTREAM_URL=$(db_url "$DB_DOWNSTREAM")

# ---- processes ---------------------------------------------------------------------------------
alive() { kill -0 "$1" 2>/dev/null; }
# running PID: alive and not a zombie (an exited child of ours still answers kill -0).
running() {
    local st=""
    alive "$1" || return 1
    read -r _ _ st _ <"/proc/$1/stat" 2>/dev/null || return 0
    [ "$st" != Z ]
}

# stop_pid NAME PID SECONDS: SIGTERM, wait up to SECONDS, then SIGKILL. Reaps our own children.
stop_pid() {
    local name=$1 pid=$2 secs=$3 deadline rc=0 how="SIGTERM"
    alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + secs))
    while running "$pid" && [ "$SECONDS" -lt "$deadline" ]; do
        sleep 0.2
    done
    if running "$pid"; then
        kill -KILL "$pid" 2>/dev/null || true
        how="SIGKILL after ${secs}s"
    fi
    wait "$pid" 2>/dev/null || rc=$?
    say "stopped $name (pid $pid, $how, exit $rc)"
}

# stop_all: stops what this run started, in reverse order (the relay first, the downstream last).
stop_all() {
    local i name
    [ "$STOPPING" -eq 1 ] && return 0
    STOPPING=1
    if [ -n "$FG_PID" ] && alive "$FG_PID"; then
        stop_pid "the running step" "$FG_PID" 10
    fi
    for ((i = ${#NAMES[@]} - 1; i >= 0; i--)); do
        name=${NAMES[$i]}
        case $name in
            worker-*) stop_pid "$name" "${PIDS[$name]}" 30 ;;
            *) stop_pid "$name" "${PIDS[$name]}" 15 ;;
        esac
        rm -f "$STATE/$name.pid"
    done
}

on_exit() {
    local rc=$?
    trap - EXIT INT TERM
    stop_all
    exit "$rc"
}

on_signal() {
    trap - EXIT INT TERM
    echo
    say "$1: stopping what this run started"
    stop_all
    say "stopped; the databases ($DB_LEDGER, $DB_AGENT, $DB_DOWNSTREAM) are kept for inspection"
    [ "$SERVING" -eq 1 ] && exit 0
    [ "$1" = SIGINT ] && exit 130
    exit 143
}
trap on_exit EXIT
trap 'on_signal SIGINT' INT
trap 'on_signal SIGTERM' TERM

# waited COMMAND...: runs COMMAND in the background and waits for it, so a signal is handled at
# once instead of after the command ends.
waited() {
    local rc=0
    "$@" &
    FG_PID=$!
    wait "$FG_PID" || rc=$?
    FG_PID=""
    return "$rc"
}

# start NAME COMMAND...: starts a long-running process with a clean environment (the caller
# passes `env -i ...`), output in $STATE/NAME.log, pid in $STATE/NAME.pid. setsid keeps the
# terminal's Ctrl-C away from it: this script stops it, in order. It does not inherit the lock
# (fd 9), so leftovers of a killed run never block the next one.
start() {
    local name=$1 pid
    shift
    if command -v setsid >/dev/null 2>&1; then
        setsid "$@" >"$STATE/$name.log" 2>&1 </dev/null 9>&- &
    else
        "$@" >"$STATE/$name.log" 2>&1 </dev/null 9>&- &
    fi
    pid=$!
    NAMES+=("$name")
    PIDS[$name]=$pid
    echo "$pid" >"$STATE/$name.pid"
    say "started $name (pid $pid, log $STATE/$name.log)"
}

# stop_leftovers: a previous run that was killed (SIGKILL, a closed terminal) left processes;
# stop those whose command line is still one of ours.
stop_leftovers() {
    local file name pid
    # The relay first, the downstream last, as stop_all does.
    for name in relay worker-2 worker-1 downstream; do
        file=$STATE/$name.pid
        [ -e "$file" ] || continue
        pid=$(cat "$file" 2>/dev/null || true)
        if [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" &&
            tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -Eq '(worker|publisher|reference-downstream)( |$)'; then
            say "a previous run left $name running (pid $pid): stopping it"
            kill -TERM "$pid" 2>/dev/null || true
            wait_until 30 bash -c "! kill -0 $pid 2>/dev/null" || kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$file"
    done
}

# wait_ready NAME SECONDS CHECK...: until CHECK succeeds; fails early if NAME exited.
wait_ready() {
    local name=$1 secs=$2 deadline
    shift 2
    deadline=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        if ! running "${PIDS[$name]}"; then
            tail -n 30 "$STATE/$name.log" >&2 || true
            fail "$name exited during start-up (log: $STATE/$name.log)" 2
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            tail -n 30 "$STATE/$name.log" >&2 || true
            fail "$name was not ready within ${secs}s (log: $STATE/$name.log)" 2
        fi
        sleep 0.5
    done
    say "$name is ready"
}

# http_post PORT PATH JSON: POSTs JSON to 127.0.0.1:PORT (plain HTTP/1.1); prints the status code.
http_post() {
    # shellcheck disable=SC2016 # expanded by the inner bash
    timeout 10 bash -c '
        exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
        printf "POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" \
            "$2" "${#3}" "$3" >&3
        IFS=" " read -r _ code _ <&3 && printf "%s\n" "$code"' _ "$@"
}

# ---- 1. services and tools ---------------------------------------------------------------------
SERVICES_PG_URL_VAR=DEMO_DATABASE_URL
SERVICES_MQ_URL_VAR=DEMO_AMQP_URL
# shellcheck source=scripts/lib/services.sh
. scripts/lib/services.sh
services_init

# One demo at a time per state directory.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$STATE/lock"
    flock -n 9 || fail "another scripts/demo.sh is running with the state directory $STATE" 2
fi
stop_leftovers

say "--- services (PostgreSQL $PG_HOST:$PG_PORT, RabbitMQ $MQ_HOST:$MQ_PORT)"
check_services
if ! command -v psql >/dev/null 2>&1; then
    apt_install postgresql-client ||
        fail "psql not found: install it, e.g. (as root) apt-get install -y postgresql-client" 2
fi

for port in "$DS_PORT" "$ADMIN_PORT" "$METRICS_1" "$METRICS_2" "$RELAY_METRICS"; do
    if tcp_open 127.0.0.1 "$port"; then
        fail "port $port is already in use on 127.0.0.1; free it or choose others (DEMO_DOWNSTREAM_PORT, DEMO_ADMIN_PORT, DEMO_METRICS_PORT, DEMO_METRICS_PORT_2, DEMO_RELAY_METRICS_PORT)" 2
    fi
done

# ---- 2. binaries -------------------------------------------------------------------------------
t_build=$SECONDS
if [ -z "$BIN_DIR" ]; then
    command -v cargo >/dev/null 2>&1 ||
        fail "cargo not found: install Rust (https://rustup.rs), or pass --bin-dir DIR with built binaries" 2
    say "--- building the release binaries (cargo may first wait for the build directory's lock)"
    # Never --workspace here: the e2e crate would turn on the worker's fault points. The release
    # set (README, "Development") and the example agent.
    waited cargo build --release --locked -p intent-worker -p intent-publisher -p reference-downstream \
        -p demo-agent --features intent-worker/jemalloc ||
        fail "cargo build failed" 2
    BIN_DIR=$TARGET/release
fi
BIN_DIR=$(cd "$BIN_DIR" 2>/dev/null && pwd) || fail "--bin-dir: no such directory" 2
for bin in worker publisher reference-downstream demo-agent; do
    [ -x "$BIN_DIR/$bin" ] || fail "$BIN_DIR/$bin is missing (build it, or run without --bin-dir)" 2
done
say "binaries: $BIN_DIR ($((SECONDS - t_build))s)"

# ---- 3. databases, tools file, migrations ------------------------------------------------------
t_start=$SECONDS
say "--- databases $DB_LEDGER, $DB_AGENT, $DB_DOWNSTREAM (dropped and created again)"
for db in "$DB_LEDGER" "$DB_AGENT" "$DB_DOWNSTREAM"; do
    PGOPTIONS="-c client_min_messages=warning" timeout 60 psql "$DEMO_DATABASE_URL" -X -q -v ON_ERROR_STOP=1 \
        -c "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '$db' AND pid <> pg_backend_pid()" \
        -c "DROP DATABASE IF EXISTS \"$db\"" -c "CREATE DATABASE \"$db\"" >/dev/null ||
        fail "cannot create database $db on $DEMO_DATABASE_URL" 2
done

TOOLS=$STATE/tools.toml
sed "s#http://downstream:9100#http://127.0.0.1:$DS_PORT#g" deploy/tools.demo.toml >"$TOOLS"

CLEAN_ENV=(env -i "PATH=$PATH" "HOME=${HOME:-/tmp}" "RUST_LOG=info,lapin=warn,sqlx=warn")
WORKER_ENV=("${CLEAN_ENV[@]}" "DATABASE_URL=$LEDGER_URL" "AMQP_URL=$DEMO_AMQP_URL" "WORKER_TOOLS=$TOOLS"
    "INTENTS_EXCHANGE=$EX_INTENTS" "WORKER_INTENTS_QUEUE=$Q_INTENTS" "RESULTS_EXCHANGE=$EX_RESULTS"
    "WORKER_DEAD_LETTER_EXCHANGE=$EX_DLX" "WORKER_DEAD_LETTER_QUEUE=$Q_DEAD"
    "WORKER_MIGRATE=false" "WORKER_SHUTDOWN_GRACE_SECS=5")
PUBLISHER_ENV=("${CLEAN_ENV[@]}" "AMQP_URL=$DEMO_AMQP_URL" "PUBLISHER_DATABASE_URL=$AGENT_URL"
    "INTENTS_EXCHANGE=$EX_INTENTS" "RESULTS_EXCHANGE=$EX_RESULTS")

waited timeout 120 "${WORKER_ENV[@]}" "$BIN_DIR/worker" migrate >"$STATE/migrate.log" 2>&1 ||
    { tail -n 20 "$STATE/migrate.log" >&2; fail "worker migrate failed (log: $STATE/migrate.log)" 2; }
waited timeout 120 "${PUBLISHER_ENV[@]}" "$BIN_DIR/publisher" migrate >>"$STATE/migrate.log" 2>&1 ||
    { tail -n 20 "$STATE/migrate.log" >&2; fail "publisher migrate failed (log: $STATE/migrate.log)" 2; }
say "ledger and agent outbox migrated"

# ---- 4. downstream, two workers, relay ---------------------------------------------------------
say "--- starting the reference downstream, two workers and the relay"
start downstream "${CLEAN_ENV[@]}" "DOWNSTREAM_DATABASE_URL=$DOWNSTREAM_URL" DOWNSTREAM_SCHEMA=downstream \
    "DOWNSTREAM_ADDR=127.0.0.1:$DS_PORT" DOWNSTREAM_ASYNC_DELAY_MS=1000 "$BIN_DIR/reference-downstream"
wait_ready downstream 30 "$BIN_DIR/reference-downstream" probe "http://127.0.0.1:$DS_PORT/healthz"

start worker-1 "${WORKER_ENV[@]}" WORKER_ID=demo-worker-1 "METRICS_ADDR=127.0.0.1:$METRICS_1" \
    "WORKER_ADMIN_ADDR=127.0.0.1:$ADMIN_PORT" "WORKER_ADMIN_TOKEN=$ADMIN_TOKEN" \
    "WORKER_TENANT_TOKENS=$TENANT=$TENANT_TOKEN" "$BIN_DIR/worker" run
start worker-2 "${WORKER_ENV[@]}" WORKER_ID=demo-worker-2 "METRICS_ADDR=127.0.0.1:$METRICS_2" \
    WORKER_ADMIN_ADDR=off "$BIN_DIR/worker" run
wait_ready worker-1 60 "$BIN_DIR/worker" probe "http://127.0.0.1:$METRICS_1/readyz"
wait_ready worker-2 60 "$BIN_DIR/worker" probe "http://127.0.0.1:$METRICS_2/readyz"

start relay "${PUBLISHER_ENV[@]}" "PUBLISHER_METRICS_ADDR=127.0.0.1:$RELAY_METRICS" "$BIN_DIR/publisher" relay
wait_ready relay 30 "$BIN_DIR/worker" probe "http://127.0.0.1:$RELAY_METRICS/metrics"
say "everything is up ($((SECONDS - t_start))s)"

# ---- 5. the demo agent -------------------------------------------------------------------------
RUN_ID=$(date +%s)$$
ASYNC=deploy-$RUN_ID
HELD=payout-$RUN_ID
APPROVAL=refund-$RUN_ID-approval
REVERSAL=refund_reversal-$RUN_ID
ORIGINAL=refund-$RUN_ID-1
say "--- demo agent (run $RUN_ID): $COUNT refunds, repeats, one conflicting reuse, one long-running deploy, one lost reply, one approval, one compensation"
# The downstream will commit the payout and then drop the connection: the worker cannot know
# whether it happened and the tool has no recovery, so it must hold it (never resend, never guess).
code=$(http_post "$DS_PORT" /_control/faults "{\"kind\":\"drop_after_commit\",\"key\":\"$TENANT:$HELD\"}" || true)
[ "$code" = 201 ] || fail "could not arm the downstream's drop_after_commit fault (HTTP ${code:-no answer})"
say "armed the downstream's drop_after_commit fault for $TENANT:$HELD"

t_agent=$SECONDS
agent_rc=0
waited timeout 120 "${PUBLISHER_ENV[@]}" "PUBLISHER_STATUS_URL=http://127.0.0.1:$ADMIN_PORT" \
    "PUBLISHER_STATUS_TOKEN=$TENANT_TOKEN" "$BIN_DIR/demo-agent" --scenario full \
    --tenant "$TENANT" --tool refund --count "$COUNT" --interval-ms 100 --duplicate-every 3 \
    --async-tool deploy --held-tool payout --reversal-tool refund_reversal --run-id "$RUN_ID" \
    --answer-timeout 20s --worker-bin "$BIN_DIR/worker" --ledger-url "$LEDGER_URL" --worker-tools "$TOOLS" \
    >"$STATE/agent.out" 2>"$STATE/agent.log" || agent_rc=$?
say "agent finished in $((SECONDS - t_agent))s (exit $agent_rc; answers: $STATE/agent.out, log: $STATE/agent.log)"
if [ "$agent_rc" -ne 0 ]; then
    tail -n 15 "$STATE/agent.log" >&2 || true
fi

# ---- 6. the summary, checked against the downstream's and the ledger's own tables --------------
get() { sed -n "s/^$1=//p" "$STATE/agent.out" | tail -n 1; }
num() {
    local v
    v=$(get "$1")
    [[ $v =~ ^[0-9]+$ ]] && echo "$v" || echo 0
}
sql() { timeout 30 psql "$1" -X -A -t -q -v ON_ERROR_STOP=1 -c "$2"; }

intents_sent=$(num intents_sent)
actions=$(num actions)
succeeded=$(num succeeded)
repeats_sent=$(num repeats_sent)
repeats_ledger=$(num repeats_answered_from_ledger)
conflicts_sent=$(num conflicts_sent)
conflicts_refused=$(num conflicts_refused)
pending=$(num pending)
held=$(num held)
async_accepted=$(num async_accepted)
async_op=$(get async_operation_id)
async_status=$(get async_status)
async_verified_by=$(get async_verified_by)
async_receipt=$(get async_receipt_id)
approval_awaiting=$(num approval_awaiting)
approval_operator=$(get approval_operator)
approval_status=$(get approval_status)
compensation_status=$(get compensation_status)
compensation_compensates=$(get compensation_compensates)
compensated_by=$(get compensated_by)
# Keys of this run only: <tenant>:refund-<run>-<i>, <tenant>:deploy-<run> and <tenant>:payout-<run>.
KEYS="(idem_key LIKE '$TENANT:%-$RUN_ID' OR idem_key LIKE '$TENANT:%-$RUN_ID-%')"
ACTIONS="tenant = '$TENANT' AND (action_id LIKE '%-$RUN_ID' OR action_id LIKE '%-$RUN_ID-%')"
ds_writes=$(sql "$DOWNSTREAM_URL" "SELECT count(*) FROM downstream.mutations WHERE $KEYS")
ds_requests=$(sql "$DOWNSTREAM_URL" "SELECT count(*) FROM downstream.requests WHERE kind = 'write' AND $KEYS")
ds_keys=$(sql "$DOWNSTREAM_URL" "SELECT count(DISTINCT idem_key) FROM downstream.mutations WHERE $KEYS")
ledger_ops=$(sql "$LEDGER_URL" "SELECT count(*) FROM operations WHERE $ACTIONS")
ledger_succeeded=$(sql "$LEDGER_URL" "SELECT count(*) FROM operations WHERE $ACTIONS AND state = 'succeeded'")
held_state=$(sql "$LEDGER_URL" "SELECT state FROM operations WHERE tenant = '$TENANT' AND action_id = '$HELD'")
# The long-running deploy at the downstream (its job, its one write, the polls that read its
# status) and in the ledger (its state, the operation id it kept, its moves, when it settled).
ds_jobs=$(sql "$DOWNSTREAM_URL" "SELECT count(*) FROM downstream.async_jobs WHERE idem_key = '$TENANT:$ASYNC'")
ds_job=$(sql "$DOWNSTREAM_URL" "SELECT operation_id || ' ' || coalesce(deployment_id, '-') FROM downstream.async_jobs WHERE idem_key = '$TENANT:$ASYNC'")
ds_job_ended=$(sql "$DOWNSTREAM_URL" "SELECT extract(epoch FROM ends_at) FROM downstream.async_jobs WHERE idem_key = '$TENANT:$ASYNC'")
ds_async_writes=$(sql "$DOWNSTREAM_URL" "SELECT count(*) FROM downstream.requests WHERE kind = 'write' AND idem_key = '$TENANT:$ASYNC'")
ds_status_reads=$(sql "$DOWNSTREAM_URL" "SELECT count(*) FROM downstream.requests WHERE kind = 'status' AND idem_key = '$TENANT:$ASYNC'")
async_row=$(sql "$LEDGER_URL" "SELECT state || ' ' || coalesce(remote_id, '-') || ' ' || coalesce(extract(epoch FROM finished_at)::text, '') FROM operations WHERE tenant = '$TENANT' AND action_id = '$ASYNC'")
read -r async_state async_remote async_finished <<<"${async_row:-none - }" || true
# Its moves, each state once in a row (a poll that proves nothing leaves it accepted).
async_moves=$(sql "$LEDGER_URL" "SELECT h.to_state FROM operation_history h JOIN operations o ON o.id = h.operation_id WHERE o.tenant = '$TENANT' AND o.action_id = '$ASYNC' ORDER BY h.id" |
    awk 'NF && $0 != last { printf "%s%s", (n++ ? " -> " : ""), $0; last = $0 }')
sql "$DOWNSTREAM_URL" "SELECT receipt FROM downstream.mutations WHERE idem_key = '$TENANT:$HELD' ORDER BY id LIMIT 1" \
    >"$STATE/held-receipt.json"
# The refund above the approval limit: when it was approved (its move out of awaiting_approval
# by an operator, in the ledger), by whom, its moves; at the downstream its mutations, its write
# requests, and any request or mutation of it from before the approval (same server, same clock).
approval_row=$(sql "$LEDGER_URL" "SELECT coalesce(array_to_string(o.approved_by, ','), '-') || ' ' || coalesce((SELECT extract(epoch FROM min(h.at))::text FROM operation_history h WHERE h.operation_id = o.id AND h.from_state = 'awaiting_approval' AND h.to_state = 'prepared' AND h.actor LIKE 'operator:%'), '') FROM operations o WHERE o.tenant = '$TENANT' AND o.action_id = '$APPROVAL'")
read -r approved_by approved_at <<<"${approval_row:-- }" || true
approval_state=$(sql "$LEDGER_URL" "SELECT state FROM operations WHERE tenant = '$TENANT' AND action_id = '$APPROVAL'")
approval_moves=$(sql "$LEDGER_URL" "SELECT h.to_state FROM operation_history h JOIN operations o ON o.id = h.operation_id WHERE o.tenant = '$TENANT' AND o.action_id = '$APPROVAL' ORDER BY h.id" |
    awk 'NF && $0 != last { printf "%s%s", (n++ ? " -> " : ""), $0; last = $0 }')
ds_approval_mutations=$(sql "$DOWNSTREAM_URL" "SELECT count(*) FROM downstream.mutations WHERE idem_key = '$TENANT:$APPROVAL'")
ds_approval_writes=$(sql "$DOWNSTREAM_URL" "SELECT count(*) FROM downstream.requests WHERE kind = 'write' AND idem_key = '$TENANT:$APPROVAL'")
ds_approval_early=$(sql "$DOWNSTREAM_URL" "SELECT (SELECT count(*) FROM downstream.requests WHERE idem_key = '$TENANT:$APPROVAL' AND at < to_timestamp(${approved_at:-0})) + (SELECT count(*) FROM downstream.mutations WHERE idem_key = '$TENANT:$APPROVAL' AND created_at < to_timestamp(${approved_at:-0}))")
# The compensation: its own one mutation (at /replay/refund-reversals), the refund it undoes
# still one; in the ledger it is linked to the refund, which stays succeeded.
ds_reversal_mutations=$(sql "$DOWNSTREAM_URL" "SELECT count(*) FROM downstream.mutations WHERE idem_key = '$TENANT:$REVERSAL'")
ds_original_mutations=$(sql "$DOWNSTREAM_URL" "SELECT count(*) FROM downstream.mutations WHERE idem_key = '$TENANT:$ORIGINAL'")
reversal_row=$(sql "$LEDGER_URL" "SELECT state || ' ' || coalesce(compensates, '-') FROM operations WHERE tenant = '$TENANT' AND action_id = '$REVERSAL'")
read -r reversal_state reversal_of <<<"${reversal_row:-none -}" || true
original_state=$(sql "$LEDGER_URL" "SELECT state FROM operations WHERE tenant = '$TENANT' AND action_id = '$ORIGINAL'")

check() {
    local what=$1
    shift
    if "$@"; then
        printf '   ok    %s\n' "$what"
    else
        printf '   FAIL  %s\n' "$what"
    fi
}
eq() { [ "$1" = "$2" ]; }
# all_eq EXPECTED VALUE...: every VALUE is EXPECTED.
all_eq() {
    local expected=$1 v
    shift
    for v; do [ "$v" = "$expected" ] || return 1; done
}

expected_repeats=$((COUNT / 3))
# The refund above the limit, as the agent was told: pending (awaiting approval), approved with
# `worker ops approve`, then succeeded.
approval_told() {
    [ "$approval_awaiting/$approval_status" = 1/succeeded ] && [ -n "$approval_operator" ]
}
# ... at the downstream: one mutation, one write, nothing before the approval.
approval_at_downstream() {
    [ "$ds_approval_mutations/$ds_approval_writes/$ds_approval_early" = 1/1/0 ] && [ -n "$approved_at" ]
}
# ... in the ledger: awaiting_approval, approved by the agent's operator, then succeeded.
approval_in_ledger() {
    [ "$approval_state" = succeeded ] && [ "$approved_by" = "$approval_operator" ] &&
        [[ "$approval_moves " == "awaiting_approval -> prepared "* ]]
}
# The compensation, as the agent was told: succeeded naming the refund, and the refund announced
# again with compensated_by naming the compensation.
compensation_told() {
    [ "$compensation_status/$compensation_compensates/$compensated_by" = "succeeded/$ORIGINAL/$REVERSAL" ]
}
# ... in the ledger: the compensation succeeded, linked to the refund, which stays succeeded.
compensation_in_ledger() {
    [ "$reversal_state/$reversal_of/$original_state" = "succeeded/$ORIGINAL/succeeded" ]
}
# The deploy, as the agent was told: accepted (pending, in progress, with the operation id),
# then succeeded, verified by a poll, with the deployment's receipt id.
async_told() {
    [ "$async_accepted/$async_status/$async_verified_by" = 1/succeeded/poll ] &&
        [ -n "$async_op" ] && [ -n "$async_receipt" ]
}
# ... and at the downstream: one job, the one the agent was told about; one write; polls that
# only read its status.
async_at_downstream() {
    [ "$ds_jobs/$ds_async_writes" = 1/1 ] && [ "$ds_job" = "$async_op $async_receipt" ] &&
        [ "$ds_status_reads" -ge 1 ]
}
# ... and in the ledger: accepted, then succeeded, keeping the operation id, settled only after
# the downstream's job had ended (same Postgres server, same clock).
async_in_ledger() {
    [ "$async_state" = succeeded ] && [ "$async_remote" = "$async_op" ] &&
        [[ " $async_moves " == *" accepted -> succeeded "* ]] &&
        awk -v settled="$async_finished" -v ended="$ds_job_ended" \
            'BEGIN { exit !(settled != "" && ended != "" && settled + 0 >= ended + 0) }'
}
{
    echo
    echo "=============================== demo summary (run $RUN_ID) ==============================="
    printf ' %-46s %s\n' "intents sent by the agent" "$intents_sent  ($COUNT refunds + $repeats_sent repeats + $conflicts_sent conflicting reuse + 1 deploy + 1 payout + 1 refund to approve + 1 reversal)"
    printf ' %-46s %s\n' "distinct actions" "$actions"
    printf ' %-46s %s\n' "downstream writes (its own mutations table)" "$ds_writes  (write requests it received: $ds_requests)"
    printf ' %-46s %s\n' "answered succeeded" "$succeeded  (ledger: $ledger_succeeded succeeded: the refunds, the deploy, the approved refund, the reversal)"
    printf ' %-46s %s\n' "repeats answered from the ledger" "$repeats_ledger of $repeats_sent  (JSON reordered and re-spaced, new call id)"
    printf ' %-46s %s\n' "conflicts refused (rejected / intent_conflict)" "$conflicts_refused of $conflicts_sent"
    printf ' %-46s %s\n' "long-running deploy ($ASYNC)" "accepted: pending, in_progress, operation ${async_op:-none}"
    printf ' %-46s %s\n' "  then" "${async_status:-no final answer}, verified_by=${async_verified_by:-none}, receipt ${async_receipt:-none}  (status reads at the downstream: $ds_status_reads)"
    printf ' %-46s %s\n' "  in the ledger" "${async_moves:-none}"
    printf ' %-46s %s\n' "pending, then held for a person" "$held held  ($HELD; ledger state: ${held_state:-none})"
    printf ' %-46s %s\n' "refund above the approval limit" "$APPROVAL: $([ "$approval_awaiting" = 1 ] && echo "pending (awaiting_approval)" || echo "not awaiting approval"),"
    printf ' %-46s %s\n' "  then" "approved by ${approval_operator:-nobody} (worker ops approve), then ${approval_status:-no final answer}"
    printf ' %-46s %s\n' "  in the ledger" "${approval_moves:-none}  (approved_by: ${approved_by:-none})"
    printf ' %-46s %s\n' "  at the downstream" "$ds_approval_mutations mutation(s), $ds_approval_writes write request(s), $ds_approval_early before the approval"
    printf ' %-46s %s\n' "compensation of the first refund" "$REVERSAL: ${compensation_status:-no final answer}, compensates ${compensation_compensates:-none}"
    printf ' %-46s %s\n' "  the refund told again" "$ORIGINAL: compensated_by=${compensated_by:-none}"
    printf ' %-46s %s\n' "  at the downstream" "$REVERSAL: $ds_reversal_mutations mutation(s); $ORIGINAL: still $ds_original_mutations"
    printf ' %-46s %s\n' "  in the ledger" "$REVERSAL: $reversal_state (compensates $reversal_of); $ORIGINAL: ${original_state:-none}"
    echo
    echo " checks (the agent's answers against the downstream's and the ledger's tables):"
    check "the agent got every answer it waited for (exit 0)" eq "$agent_rc" 0
    check "downstream writes ($ds_writes) == distinct actions ($actions), not intents sent ($intents_sent)" eq "$ds_writes" "$actions"
    check "one write request per action ($ds_requests), one mutation per key ($ds_keys)" \
        all_eq "$actions" "$ds_requests" "$ds_keys"
    check "ledger operations ($ledger_ops) == distinct actions" eq "$ledger_ops" "$actions"
    check "answered succeeded ($succeeded) == succeeded in the ledger == refunds + the deploy + the approved refund + the reversal ($((COUNT + 3)))" \
        all_eq $((COUNT + 3)) "$succeeded" "$ledger_succeeded"
    check "every repeat answered from the ledger ($repeats_ledger of $expected_repeats)" \
        all_eq "$expected_repeats" "$repeats_ledger" "$repeats_sent"
    check "the conflicting reuse refused ($conflicts_refused of 1)" eq "$conflicts_refused" 1
    check "the deploy: accepted (operation ${async_op:-none}), then succeeded, verified_by=poll" async_told
    check "the deploy at the downstream: one job (${ds_job:-none}), one write, status reads only ($ds_status_reads)" \
        async_at_downstream
    check "the deploy in the ledger: accepted -> succeeded after the job ended (${async_state:-none})" \
        async_in_ledger
    check "the lost reply: pending, then held ($held held; ledger: ${held_state:-none})" \
        eq "$held/$held_state" 1/held
    check "the refund above the limit: pending (awaiting approval), approved with worker ops approve, then ${approval_status:-no answer}" \
        approval_told
    check "the approved refund at the downstream: one mutation ($ds_approval_mutations), one write ($ds_approval_writes), none before the approval ($ds_approval_early)" \
        approval_at_downstream
    check "the approved refund in the ledger: awaiting_approval -> prepared (approved by ${approved_by:-nobody}) ... ${approval_state:-none}" \
        approval_in_ledger
    check "the compensation: ${compensation_status:-no answer} (compensates ${compensation_compensates:-none}), the refund told compensated_by=${compensated_by:-none}" \
        compensation_told
    check "the compensation at the downstream: the reversal one mutation ($ds_reversal_mutations), the refund still one ($ds_original_mutations)" \
        all_eq 1 "$ds_reversal_mutations" "$ds_original_mutations"
    check "the compensation in the ledger: $reversal_state, linked to the refund, which stays ${original_state:-none}" \
        compensation_in_ledger
    check "pending answers ($pending): the deploy while in progress, the payout, the refund awaiting approval" eq "$pending" 3
    check "intents sent == refunds + repeats + 1 reuse + 1 deploy + 1 payout + 1 approved refund + 1 reversal" \
        eq "$intents_sent" $((COUNT + repeats_sent + 5))
    echo "=========================================================================================="
} | tee "$STATE/summary.txt"
# (check ran in the pipeline's subshell: count its lines)
checks=$(grep -Ec '^   (ok|FAIL) ' "$STATE/summary.txt" || true)
failed=$(grep -c '^   FAIL ' "$STATE/summary.txt" || true)

OPS_ENV="DATABASE_URL=$LEDGER_URL WORKER_TOOLS=$TOOLS"
RESOLVE="$OPS_ENV $BIN_DIR/worker ops resolve $TENANT $HELD --receipt-file $STATE/held-receipt.json --operator \"\$USER\" --reason \"receipt found in the downstream's mutations table\""
cat <<EOF | tee -a "$STATE/summary.txt"

Where to look next:
  operator console       http://127.0.0.1:$ADMIN_PORT/ui (sign in with $ADMIN_TOKEN and your name, or
                         read-only with $TENANT_TOKEN); docs/console.md
  status API (worker-1)  curl -s -H 'Authorization: Bearer $ADMIN_TOKEN' http://127.0.0.1:$ADMIN_PORT/v1/operations/$TENANT/$ASYNC
                         curl -s -H 'Authorization: Bearer $ADMIN_TOKEN' http://127.0.0.1:$ADMIN_PORT/v1/operations/$TENANT/$HELD
                         curl -s -H 'Authorization: Bearer $ADMIN_TOKEN' http://127.0.0.1:$ADMIN_PORT/v1/operations/$TENANT/$ORIGINAL
                         (the refund the reversal undid: compensated_by, its compensations)
                         curl -s -H 'Authorization: Bearer $ADMIN_TOKEN' 'http://127.0.0.1:$ADMIN_PORT/v1/operations?state=held'
                         (tenant token for $TENANT: $TENANT_TOKEN; routes in docs/openapi.yaml)
  metrics                http://127.0.0.1:$METRICS_1/metrics (worker-1), http://127.0.0.1:$METRICS_2/metrics (worker-2),
                         http://127.0.0.1:$RELAY_METRICS/metrics (relay); readiness: /readyz on the workers' ports
  unresolved operations  $OPS_ENV $BIN_DIR/worker ops list
  the approval           $OPS_ENV $BIN_DIR/worker ops show $TENANT $APPROVAL
                         (its history: awaiting_approval, approved by operator:${approval_operator:-?}, then sent once)
  resolve the held one   with the downstream's own receipt (saved from its mutations table):
                         $RESOLVE
  the downstream's table psql $DOWNSTREAM_URL -c "SELECT idem_key, receipt_id FROM downstream.mutations ORDER BY id"
                         psql $DOWNSTREAM_URL -c "SELECT operation_id, idem_key, deployment_id, ends_at FROM downstream.async_jobs"
  logs                   $STATE/*.log; every answer the agent got: $STATE/agent.out
EOF

if [ "$ONCE" -eq 1 ]; then
    # The resolve command printed above must work: run it and check the ledger.
    if [ "$held_state" = held ]; then
        resolve_rc=0
        waited timeout 60 "${CLEAN_ENV[@]}" "DATABASE_URL=$LEDGER_URL" "WORKER_TOOLS=$TOOLS" "$BIN_DIR/worker" ops resolve \
            "$TENANT" "$HELD" --receipt-file "$STATE/held-receipt.json" --operator demo.sh \
            --reason "receipt found in the downstream's mutations table" >"$STATE/resolve.log" 2>&1 || resolve_rc=$?
        after=$(sql "$LEDGER_URL" "SELECT state FROM operations WHERE tenant = '$TENANT' AND action_id = '$HELD'")
        if [ "$resolve_rc" -eq 0 ] && [ "$after" = succeeded ]; then
            say "--once: ran the resolve command above: $HELD is now $after"
        else
            say "FAIL: the resolve command exited $resolve_rc and left $HELD $after (log: $STATE/resolve.log)"
            failed=$((failed + 1))
        fi
    fi
    if [ "$failed" -ne 0 ]; then
        say "FAILED: $failed check(s); logs in $STATE"
        exit 1
    fi
    say "all $checks checks passed; stopping (--once)"
    exit 0
fi

SERVING=1
say "everything keeps running; press Ctrl-C to stop it"
while :; do
    for name in "${NAMES[@]}"; do
        if ! running "${PIDS[$name]}"; then
            say "$name exited unexpectedly (log: $STATE/$name.log)"
            tail -n 15 "$STATE/$name.log" >&2 || true
            exit 1
        fi
    done
    sleep 1 &
    wait $! || true
done
