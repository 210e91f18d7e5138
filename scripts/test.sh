#!/usr/bin/env bash
# The project's one test command (README: `scripts/test.sh`; .ci/run execs it).
#
#   scripts/test.sh [extra `cargo nextest run` args, e.g. -E 'test(claim)'; filters, not cargo's -p]
#
# Steps: services (Postgres, RabbitMQ; started, or installed with apt-get as root, when missing)
# -> tools (promtool, cargo-nextest, clippy-driver) -> virtualenvs (python3 found or installed; the
# four Python steps' virtualenvs are then filled by pip in the background, alongside the steps
# that follow) -> fmt -> alert rules (check + unit tests) -> kubernetes manifests -> compose file
# -> cargo build (libraries, binaries, the decoder example) -> then, in the background on a copy
# of the binaries while cargo builds the test binaries, two chains side by side: demo
# (scripts/demo.sh --once) -> the by-hand set-up of docs/operations.md as written
# (scripts/by_hand_check.sh) -> Python client (ruff, mypy, pytest against the built worker), and API
# schema (schemathesis against a built worker) -> operator console in a browser (headless
# Chromium + Selenium against a built worker); their output is printed when they end -> MCP
# examples (ruff; exports MCP_PYTHON) -> cargo nextest (whole workspace, on the test binaries
# just built), with the publisher library alone (cargo check, no CLI crates) compiling beside it
# at the lowest CPU priority.
# Every compilation of the workspace's own crates here is also clippy's (see "lints while building"
# below): the build, the test build and the publisher check fail on any rustc or clippy warning,
# which is what `cargo clippy --workspace --all-targets -- -D warnings` checks, without a
# check-mode build of every dependency of its own.
# Each Python step first waits for the virtualenvs (and prints the pip log once).
#
# Environment:
#   TEST_DATABASE_URL  Postgres the tests use   (default postgres://postgres@127.0.0.1:5432/postgres)
#   TEST_AMQP_URL      RabbitMQ the tests use   (default amqp://guest:guest@127.0.0.1:5672/%2f)
#   SCHEMATHESIS_SEED, SCHEMATHESIS_MAX_EXAMPLES  the API schema step's seed and examples per operation
#   CONSOLE_SCREENSHOTS  where the browser step saves its screenshots (default <target>/console-screenshots);
#                        CONSOLE_README_IMAGES=1 also refreshes docs/images/console-*.png from them
# Both are exported for the tests. Exit 2 means a service could not be reached or a tool is missing.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

export TEST_DATABASE_URL="${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
export TEST_AMQP_URL="${TEST_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# Property tests (proptest) draw from a fixed seed so a run is reproducible and CI cannot fail on
# a case no earlier run saw; explore with another seed: PROPTEST_RNG_SEED=<n> scripts/test.sh.
export PROPTEST_RNG_SEED="${PROPTEST_RNG_SEED:-20261201}"

WAIT_SECS=60
started_all=$SECONDS

say() { printf '[test.sh] %s\n' "$*"; }

# step NAME COMMAND...: run one step and print its timing line.
step() {
    local name=$1 t0=$SECONDS rc=0
    shift
    say "--- $name"
    "$@" || rc=$?
    if [ "$rc" -ne 0 ]; then
        say "FAILED: $name (exit $rc, $((SECONDS - t0))s)"
        exit "$rc"
    fi
    say "ok: $name ($((SECONDS - t0))s)"
}

# ---- (a) services -------------------------------------------------------------------------------
# Check, start or (as root on Debian/Ubuntu) install Postgres and RabbitMQ: one copy for this
# script and scripts/demo.sh.
SERVICES_PG_URL_VAR=TEST_DATABASE_URL
SERVICES_MQ_URL_VAR=TEST_AMQP_URL
# shellcheck source=scripts/lib/services.sh
. scripts/lib/services.sh
services_init

# ---- (b) tools ----------------------------------------------------------------------------------
install_promtool() {
    apt_install prometheus
}

check_tools() {
    if ! command -v promtool >/dev/null 2>&1; then
        install_promtool || true
    fi
    if ! command -v promtool >/dev/null 2>&1; then
        echo "ERROR: promtool not found. Install it with: apt-get install prometheus (as root)" >&2
        exit 2
    fi
    say "promtool: $(promtool --version 2>&1 | head -n 1)"
    if ! cargo nextest --version >/dev/null 2>&1; then
        say "installing cargo-nextest"
        cargo install cargo-nextest --locked || return 1
    fi
    say "cargo-nextest: $(cargo nextest --version 2>/dev/null | head -n 1)"
    if ! CLIPPY_DRIVER=$(command -v clippy-driver); then
        echo "ERROR: clippy-driver not found. Install it with: rustup component add clippy" >&2
        exit 2
    fi
    say "clippy: $("$CLIPPY_DRIVER" --version 2>&1 | head -n 1)"
    # Validates docker-compose.yml without a Docker engine; optional.
    if ! command -v docker-compose >/dev/null 2>&1; then
        apt_install docker-compose || say "docker-compose not installable here; the compose file will not be validated"
    fi
    # tests/tests/suites/pgbouncer.rs runs a PgBouncer of its own; optional (the test says SKIPPED).
    if [ ! -x /usr/sbin/pgbouncer ] && ! command -v pgbouncer >/dev/null 2>&1; then
        apt_install pgbouncer || say "pgbouncer not installable here; the PgBouncer test will skip"
    fi
}

# ---- (b2) virtualenvs ----------------------------------------------------------------------------
# The Python steps (g, g2, h, h2) each run in a virtualenv of their own (never the system Python) under
# the cargo target dir, refreshed from PyPI each run (pip skips what is already installed). Filling
# them is mostly network (about a minute of pip on a cold cache) while cargo check and build are
# CPU bound, so one background job, started right after the tools step, fills all three while the
# main shell compiles; each Python step first waits for it (await_venvs), then only runs its checks.
# The job fills them one after another: pips in parallel would fight over pip's cache.

# python_usable PYTHON: a python3 >= 3.10 with venv and ensurepip.
python_usable() {
    [ -n "$1" ] && "$1" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' 2>/dev/null
}

# find_python: sets PYTHON, installing python3 and python3-venv (as root, apt-get) when missing.
find_python() {
    PYTHON=$(command -v python3 || true)
    if ! python_usable "$PYTHON"; then
        { apt_install python3 && apt_install python3-venv; } || true
        PYTHON=$(command -v python3 || true)
    fi
    if ! python_usable "$PYTHON"; then
        echo "ERROR: the Python client's tests need python3 >= 3.10 with venv/ensurepip (apt-get install python3 python3-venv)" >&2
        return 2
    fi
    say "python3: $("$PYTHON" --version 2>&1) ($PYTHON)"
}

# venv NAME PIP_ARGS...: creates $VENV_ROOT/NAME with $PYTHON unless its python runs, then pip
# installs PIP_ARGS into it.
venv() {
    local name=$1 t0=$SECONDS rc=0
    shift
    if ! "$VENV_ROOT/$name/bin/python" -c 'import sys' 2>/dev/null; then
        rm -rf "${VENV_ROOT:?}/$name"
        "$PYTHON" -m venv "$VENV_ROOT/$name" || rc=$?
    fi
    [ "$rc" -ne 0 ] || "$VENV_ROOT/$name/bin/python" -m pip install -q --disable-pip-version-check "$@" || rc=$?
    if [ "$rc" -ne 0 ]; then
        say "FAILED: $name: pip install $* (exit $rc, $((SECONDS - t0))s)"
        return 1
    fi
    say "$name: pip install $* ($((SECONDS - t0))s)"
}

# fill_venvs: the background job (its output goes to $VENVS_LOG); stops at the first failure.
# Commands are checked one by one: the job may run where `set -e` is ignored (inside `step`).
fill_venvs() {
    say "filling the virtualenvs in $VENV_ROOT with $PYTHON"
    # Python client (g): a current pip first, as for a fresh virtualenv's bundled one.
    venv pyenv --upgrade pip || return 1
    venv pyenv -e 'clients/python[test]' || return 1
    # API schema (h): SCHEMATHESIS_PINS is defined with that step.
    venv schemathesis-venv "${SCHEMATHESIS_PINS[@]}" || return 1
    # MCP examples (g2).
    venv mcp-venv -r examples/mcp/requirements.txt 'ruff>=0.5' || return 1
    # Operator console in a browser (h2).
    venv console-venv -r tests/console_browser/requirements.txt || return 1
}

VENV_ROOT='' VENVS_LOG='' VENVS_PID='' VENVS_RC=''

# start_venvs: finds python3 (in the main shell: it may apt-get install), then starts fill_venvs.
start_venvs() {
    find_python || return
    mkdir -p "${CARGO_TARGET_DIR:-target}" || return 1
    VENV_ROOT=$(cd "${CARGO_TARGET_DIR:-target}" && pwd) || return 1
    VENVS_LOG=$VENV_ROOT/venvs.log
    fill_venvs >"$VENVS_LOG" 2>&1 </dev/null &
    VENVS_PID=$!
    say "virtualenvs filling in the background (pid $VENVS_PID, log $VENVS_LOG)"
}

# await_venvs: the first call waits for the job and prints its log; every call returns 2 when the
# fill failed.
await_venvs() {
    if [ -z "$VENVS_RC" ]; then
        if [ -z "$VENVS_PID" ]; then
            echo "ERROR: the virtualenvs were never started (start_venvs)" >&2
            return 2
        fi
        local t0=$SECONDS rc=0
        wait "$VENVS_PID" || rc=$?
        VENVS_RC=$rc
        say "virtualenvs (waited $((SECONDS - t0))s), $VENVS_LOG:"
        sed 's/^/    /' "$VENVS_LOG" || true
    fi
    if [ "$VENVS_RC" -ne 0 ]; then
        echo "ERROR: filling the virtualenvs failed (exit $VENVS_RC): see the pip output above ($VENVS_LOG)" >&2
        return 2
    fi
}

# kill_tree PID: PID, then its descendants (pip and whatever pip started). Children are listed
# before their parent is killed: the parent can then not start new ones.
kill_tree() {
    local children child
    children=$(pgrep -P "$1" 2>/dev/null || true)
    kill "$1" 2>/dev/null || true
    for child in $children; do
        kill_tree "$child"
    done
}

# On any exit (a failed step exits at once) no background job (the virtualenvs' fill, the chains
# of steps on built binaries, the publisher check) may outlive the script. The trap keeps the
# script's exit status.
stop_background() {
    if [ -n "$VENVS_PID" ] && [ -z "$VENVS_RC" ] && kill -0 "$VENVS_PID" 2>/dev/null; then
        kill_tree "$VENVS_PID"
    fi
    local pid
    for pid in "${CHAIN_PIDS[@]}" "${PUBCHECK_PID:-}"; do
        if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
            kill_tree "$pid"
        fi
    done
}
trap stop_background EXIT

# ---- (f) compose file ---------------------------------------------------------------------------
check_compose() {
    if command -v docker-compose >/dev/null 2>&1; then
        docker-compose config -q
    elif command -v docker >/dev/null 2>&1 && docker compose version >/dev/null 2>&1; then
        docker compose config -q
    else
        say "docker-compose not installed: compose file not validated"
    fi
}

# ---- (g) Python client -------------------------------------------------------------------------
# clients/python's tests, in $VENV_ROOT/pyenv (filled in the background: section b2).
python_client_tests() {
    await_venvs || return
    local venv=$VENV_ROOT/pyenv
    say "python: $("$venv/bin/python" --version 2>&1) in $venv"
    (cd clients/python && "$venv/bin/python" -m ruff format --check src tests &&
        "$venv/bin/python" -m ruff check src tests && "$venv/bin/python" -m mypy) || return 1
    # pytest exits 5 when it collected no tests: that must fail the step, never pass it.
    local rc=0
    "$venv/bin/python" -m pytest clients/python/tests -p no:cacheprovider || rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "ERROR: pytest collected no tests in clients/python/tests" >&2
        return 1
    fi
    return "$rc"
}

# ---- (g1) TypeScript client ---------------------------------------------------------------------
# clients/typescript: npm ci (its committed package-lock.json), lint (tsc --noEmit, biome), build,
# then node's test runner: unit tests (the shared fixtures, the decoder example as the oracle) and
# integration tests against the built worker, downstream and publisher (INTENT_BIN_DIR). Runs as a
# chain of its own beside the test build (section i).
typescript_client() {
    local t0=$SECONDS
    if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
        apt_install nodejs npm || true
    fi
    local major
    major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
    if [ "$major" -lt 20 ] || ! command -v npm >/dev/null 2>&1; then
        echo "ERROR: the TypeScript client's tests need Node.js >= 20 and npm (found node major '$major'; apt-get install nodejs npm, or install Node 20+)" >&2
        return 2
    fi
    say "--- TypeScript client (npm ci, lint, build, node --test)"
    say "node $(node --version), npm $(npm --version)"
    (cd clients/typescript && npm ci --no-audit --no-fund --loglevel=error &&
        npm run --silent lint && npm test) || {
        say "FAILED: TypeScript client ($((SECONDS - t0))s)"
        return 1
    }
    say "ok: TypeScript client ($((SECONDS - t0))s)"
}

# ---- (g2) MCP examples ---------------------------------------------------------------------------
# The Python MCP examples (examples/mcp/: the `mcp` package and the OpenAI Agents SDK, pinned in
# examples/mcp/requirements.txt) get a virtualenv of their own, $VENV_ROOT/mcp-venv (filled in the
# background: section b2); tests/tests/suites/mcp_gateway.rs runs them against a real gateway when
# MCP_PYTHON names its interpreter (exported here, in the main shell, for cargo nextest).
mcp_examples_venv() {
    await_venvs || return
    local venv=$VENV_ROOT/mcp-venv
    (cd examples/mcp && "$venv/bin/python" -m ruff format --check --line-length 100 . &&
        "$venv/bin/python" -m ruff check --line-length 100 --select F,E,W,B,I,UP .) || return 1
    export MCP_PYTHON="$venv/bin/python"
    say "MCP examples: $("$MCP_PYTHON" -m pip freeze 2>/dev/null | grep -E '^(mcp|openai-agents)==' | tr '\n' ' ')"
}

# ---- (h) API schema --------------------------------------------------------------------------
# schemathesis (PyPI, pinned) in a virtualenv of its own, $VENV_ROOT/schemathesis-venv (filled in
# the background: section b2), run against a real worker's admin API (scripts/api_schema_check.py
# builds and removes the world), bounded and seeded. hypothesis is pinned because schemathesis 3.39
# breaks with newer releases.
SCHEMATHESIS_PINS=(schemathesis==3.39.16 hypothesis==6.120.0 'psycopg[binary]>=3.1,<4' 'aio-pika>=9.4,<11')
api_schema_tests() {
    await_venvs || return
    local venv=$VENV_ROOT/schemathesis-venv
    say "schemathesis: $("$venv/bin/schemathesis" --version 2>&1 | head -n 1)"
    "$venv/bin/python" scripts/api_schema_check.py "$venv/bin/schemathesis"
}

# ---- (h2) operator console in a browser ---------------------------------------------------------
# tests/console_browser: pytest + Selenium ($VENV_ROOT/console-venv, filled in the background:
# section b2) drive Debian's headless chromium through Debian's chromedriver, named explicitly
# (installed here when missing), with SE_AVOID_STATS=true: Selenium Manager never touches the
# network. One worker, the reference downstream and one browser session for the whole suite.
CHROMIUM_BIN=/usr/bin/chromium
CHROMEDRIVER_BIN=/usr/bin/chromedriver
console_browser_tests() {
    if [ ! -x "$CHROMIUM_BIN" ] || [ ! -x "$CHROMEDRIVER_BIN" ]; then
        apt_install chromium chromium-driver || true
    fi
    if [ ! -x "$CHROMIUM_BIN" ] || [ ! -x "$CHROMEDRIVER_BIN" ]; then
        echo "ERROR: the console's browser tests need $CHROMIUM_BIN and $CHROMEDRIVER_BIN (apt-get install chromium chromium-driver, as root)" >&2
        return 2
    fi
    await_venvs || return
    local venv=$VENV_ROOT/console-venv
    say "browser: $("$CHROMIUM_BIN" --version 2>/dev/null | head -n 1); $("$CHROMEDRIVER_BIN" --version | head -n 1)"
    (cd tests/console_browser && "$venv/bin/python" -m ruff format --check . &&
        "$venv/bin/python" -m ruff check .) || return 1
    local rc=0
    SE_AVOID_STATS=true CHROMIUM_BIN=$CHROMIUM_BIN CHROMEDRIVER_BIN=$CHROMEDRIVER_BIN \
        "$venv/bin/python" -m pytest tests/console_browser || rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "ERROR: pytest collected no tests in tests/console_browser" >&2
        return 1
    fi
    return "$rc"
}

step "services (PostgreSQL $PG_HOST:$PG_PORT, RabbitMQ $MQ_HOST:$MQ_PORT)" check_services
step "tools" check_tools
# Network-bound pip from here on, in the background, alongside the CPU-bound compilation.
step "virtualenvs (python3; pip fills them in the background)" start_venvs
step "cargo fmt --check" cargo fmt --all -- --check

# ---- lints while building -----------------------------------------------------------------------
# clippy-driver is rustc with clippy's lints, and cargo runs it in place of rustc for the
# workspace's own crates only (RUSTC_WORKSPACE_WRAPPER), exactly as `cargo clippy` does; CLIPPY_ARGS
# carries the lint arguments the way `cargo clippy -- -D warnings` passes them (separated by
# `__CLIPPY_HACKERY__`), so any rustc or clippy warning is an error. Every build below then also
# lints what it compiles, and the dependencies are compiled once, for the binaries, instead of a
# second time in check mode for a separate `cargo clippy`. The library, binaries and example are
# linted by cargo build, every test target by the test build: together the targets of
# `cargo clippy --workspace --all-targets`. The dependencies are built as by a plain cargo build
# (the wrapper never sees them); cargo fingerprints the wrapper, so a plain cargo command after
# this script rebuilds only the workspace's own crates.
export RUSTC_WORKSPACE_WRAPPER=$CLIPPY_DRIVER
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
step "promtool check rules" promtool check rules deploy/prometheus/alerts.yml
step "promtool test rules" promtool test rules deploy/prometheus/alerts_test.yml
step "kubernetes manifests (offline)" scripts/validate-k8s.sh
step "compose file" check_compose
# The end-to-end suites run the built binaries (worker with fault points, reference-downstream,
# publisher, the example agent demo-agent); the Python client's differential test runs the
# protocol's decoder example. One cargo build for all of them, so the example compiles while the
# binaries link.
step "cargo build (libraries, binaries, examples; clippy's lints, -D warnings)" \
    cargo build --workspace --locked --lib --bins --examples

# ---- (i) the steps on built binaries, beside the test build ------------------------------------
# The demo and the Python steps run on the binaries just built while cargo builds the test
# binaries: they mostly wait on the services, the test build is CPU bound, and together they
# take the time of the longest. They run on a copy of the binaries ($STAGED_BIN), which the test
# build cannot relink under them, in two background chains side by side (each world has its own
# database, broker names and ports; the demo's fixed ports are outside the range free ports are
# drawn from), each chain's output printed when it ends. The virtualenvs are awaited here first
# (the chains are not the fill job's parent).
STAGED_BIN='' CHAIN_NAMES=() CHAIN_PIDS=()

stage_binaries() {
    local target
    target=$(cd "${CARGO_TARGET_DIR:-target}" && pwd) || return 1
    STAGED_BIN=$target/staged-bin
    rm -rf "$STAGED_BIN" && mkdir -p "$STAGED_BIN" || return 1
    cp "$target/debug/worker" "$target/debug/publisher" "$target/debug/reference-downstream" \
        "$target/debug/demo-agent" "$target/debug/examples/decode_hex" "$STAGED_BIN/" || return 1
    await_venvs
}

# The demo (the Quick start without Docker, non-interactively, on the debug binaries: their
# worker has fault points; the release build would add minutes): its summary against the
# downstream's own table. Then the Python client.
demo_and_python_client() {
    step "demo (scripts/demo.sh --once)" scripts/demo.sh --once --bin-dir "$STAGED_BIN"
    step "by-hand set-up as docs/operations.md writes it" scripts/by_hand_check.sh --bin-dir "$STAGED_BIN"
    step "python client (ruff, mypy, pytest)" python_client_tests
}

# The API schema, then the console in a browser.
api_schema_and_browser() {
    step "API schema (schemathesis against docs/openapi.yaml)" api_schema_tests
    step "operator console in a browser (chromium, selenium)" console_browser_tests
}

start_binary_steps() {
    local chain
    for chain in demo_and_python_client api_schema_and_browser typescript_client; do
        (export INTENT_BIN_DIR=$STAGED_BIN && "$chain") >"$STAGED_BIN/$chain.log" 2>&1 </dev/null &
        CHAIN_NAMES+=("$chain")
        CHAIN_PIDS+=("$!")
    done
    say "demo, Python client, API schema, browser and TypeScript client steps running beside the test build (logs $STAGED_BIN/*.log)"
}

# Prints each chain's log when it ends; fails when either failed.
await_binary_steps() {
    local rc=0 i chain_rc
    for i in "${!CHAIN_PIDS[@]}"; do
        chain_rc=0
        wait "${CHAIN_PIDS[$i]}" || chain_rc=$?
        cat "$STAGED_BIN/${CHAIN_NAMES[$i]}.log"
        [ "$chain_rc" -eq 0 ] || rc=$chain_rc
    done
    CHAIN_PIDS=()
    return "$rc"
}

# ---- (j) the test binaries, then the run beside the publisher check -----------------------------
# The test build lists the binaries it built (nextest's binaries metadata) and the package graph
# (cargo metadata), so that the run reuses them instead of calling cargo itself: cargo would
# wait on the build directory's lock, which the publisher check holds while it compiles.
NEXTEST_META=''

build_test_binaries() {
    local host
    NEXTEST_META=$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/nextest || return 1
    mkdir -p "$NEXTEST_META" || return 1
    host=$(rustc -vV | sed -n 's/^host: //p')
    cargo nextest list --workspace --locked --list-type binaries-only --message-format json \
        >"$NEXTEST_META/binaries-metadata.json" || return 1
    cargo metadata --format-version 1 --locked --filter-platform "$host" \
        >"$NEXTEST_META/cargo-metadata.json"
}

# The publisher library as an agent links it (no CLI crates: `cargo check -p intent-publisher
# --no-default-features --lib`, with clippy's lints) compiles its dependencies a second time,
# with the publisher's own features only. It runs beside the test run at the lowest CPU priority:
# the suites mostly wait on timers and leave a third of the two cores idle, and nice 19 gives the
# tests the CPU whenever they want it.
PUBCHECK_PID='' PUBCHECK_LOG='' PUBCHECK_T0=0
PUBCHECK_NAME="publisher library alone (no CLI crates; clippy's lints)"

start_publisher_check() {
    PUBCHECK_LOG=$NEXTEST_META/publisher-alone.log
    PUBCHECK_T0=$SECONDS
    nice -n 19 cargo check --locked -p intent-publisher --no-default-features --lib \
        >"$PUBCHECK_LOG" 2>&1 </dev/null &
    PUBCHECK_PID=$!
    say "$PUBCHECK_NAME compiling beside the tests (log $PUBCHECK_LOG)"
}

await_publisher_check() {
    local rc=0
    wait "$PUBCHECK_PID" || rc=$?
    PUBCHECK_PID=''
    if [ "$rc" -ne 0 ]; then
        cat "$PUBCHECK_LOG"
        say "FAILED: $PUBCHECK_NAME (exit $rc)"
        return "$rc"
    fi
    say "ok: $PUBCHECK_NAME ($((SECONDS - PUBCHECK_T0))s beside the tests)"
}

step "stage the built binaries (and await the virtualenvs)" stage_binaries
start_binary_steps
step "cargo nextest (build the test binaries; clippy's lints, -D warnings)" build_test_binaries
step "demo, Python client, API schema, console in a browser" await_binary_steps
step "MCP examples (ruff; exports MCP_PYTHON)" mcp_examples_venv
# slowest_tests: the ten slowest tests of the last nextest run, from its JUnit report.
slowest_tests() {
    local report="${CARGO_TARGET_DIR:-target}/nextest/default/junit.xml"
    [ -f "$report" ] || return 0
    say "ten slowest tests:"
    python3 - "$report" <<'PY' || true
import sys
import xml.etree.ElementTree as ET

cases = [
    (float(c.get("time", 0)), f"{c.get('classname')} {c.get('name')}")
    for c in ET.parse(sys.argv[1]).getroot().iter("testcase")
]
for seconds, name in sorted(cases, reverse=True)[:10]:
    print(f"  {seconds:7.1f}s  {name}")
PY
}

# failed_tests: why each test of the last nextest run failed (its panic message, from the
# JUnit report), printed last, so the tail of a CI log says it without the full output.
failed_tests() {
    local report="${CARGO_TARGET_DIR:-target}/nextest/default/junit.xml"
    [ -f "$report" ] || return 0
    python3 - "$report" <<'PY' || true
import sys
import xml.etree.ElementTree as ET

failed = []
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    failure = case.find("failure")
    if failure is None:
        continue
    text = "\n".join(
        (node.text or "")
        for node in [failure, case.find("system-err"), case.find("rerun")]
        if node is not None
    )
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if "panicked at" in l), None)
    why = lines[start : start + 25] if start is not None else lines[-25:]
    failed.append((f"{case.get('classname')} {case.get('name')}", why))
if failed:
    print(f"[test.sh] why the {len(failed)} failed test(s) failed:")
    for name, why in failed:
        print(f"  --- {name}")
        for line in why:
            if line.strip().startswith(("stack backtrace", "note: run with")):
                break
            print(f"      {line[:400]}")
PY
}

nextest_rc=0 pubcheck_rc=0
start_publisher_check
# In a subshell: a failing step exits it, and the slowest tests are still printed.
(step "cargo nextest" cargo nextest run --binaries-metadata "$NEXTEST_META/binaries-metadata.json" \
    --cargo-metadata "$NEXTEST_META/cargo-metadata.json" --no-fail-fast "$@") || nextest_rc=$?
slowest_tests
failed_tests
await_publisher_check || pubcheck_rc=$?
[ "$nextest_rc" -eq 0 ] || exit "$nextest_rc"
[ "$pubcheck_rc" -eq 0 ] || exit "$pubcheck_rc"
say "all steps passed ($((SECONDS - started_all))s)"
