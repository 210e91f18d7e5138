#!/usr/bin/env bash
# The project's one test command (README: `scripts/test.sh`; .ci/run execs it).
#
#   scripts/test.sh [extra cargo-nextest args, e.g. -E 'test(claim)']
#
# Steps: services (Postgres, RabbitMQ; started, or installed with apt-get as root, when missing)
# -> tools (promtool, cargo-nextest) -> fmt -> clippy -> alert rules (check + unit tests) ->
# compose file -> cargo build -> demo (scripts/demo.sh --once) -> Python client (virtualenv,
# ruff, mypy, pytest against the built worker) -> API schema (schemathesis against a built
# worker) -> MCP examples' virtualenv -> cargo nextest (whole workspace).
#
# Environment:
#   TEST_DATABASE_URL  Postgres the tests use   (default postgres://postgres@127.0.0.1:5432/postgres)
#   TEST_AMQP_URL      RabbitMQ the tests use   (default amqp://guest:guest@127.0.0.1:5672/%2f)
#   SCHEMATHESIS_SEED, SCHEMATHESIS_MAX_EXAMPLES  the API schema step's seed and examples per operation
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
    # Validates docker-compose.yml without a Docker engine; optional.
    if ! command -v docker-compose >/dev/null 2>&1; then
        apt_install docker-compose || say "docker-compose not installable here; the compose file will not be validated"
    fi
    # tests/tests/pgbouncer.rs runs a PgBouncer of its own; optional (the test says SKIPPED).
    if [ ! -x /usr/sbin/pgbouncer ] && ! command -v pgbouncer >/dev/null 2>&1; then
        apt_install pgbouncer || say "pgbouncer not installable here; the PgBouncer test will skip"
    fi
}

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
# clients/python's tests run in a virtualenv of their own (never the system Python), created under
# the cargo target dir and refreshed from PyPI each run (pip skips what is already installed).
python_client_tests() {
    local venv python
    mkdir -p "${CARGO_TARGET_DIR:-target}"
    venv="$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/pyenv"
    python=$(command -v python3 || true)
    if [ -z "$python" ] || ! "$python" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        apt_install python3 && apt_install python3-venv || true
        python=$(command -v python3 || true)
    fi
    if [ -z "$python" ] || ! "$python" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        echo "ERROR: the Python client's tests need python3 >= 3.10 with venv/ensurepip (apt-get install python3 python3-venv)" >&2
        return 2
    fi
    if ! "$venv/bin/python" -c 'import sys' 2>/dev/null; then
        rm -rf "$venv"
        "$python" -m venv "$venv" || return 2
    fi
    say "python: $("$venv/bin/python" --version 2>&1) in $venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip || return 2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -e 'clients/python[test]' || return 2
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

# ---- (g2) MCP examples ---------------------------------------------------------------------------
# The Python MCP examples (examples/mcp/: the `mcp` package and the OpenAI Agents SDK, pinned in
# examples/mcp/requirements.txt) get a virtualenv of their own; tests/tests/mcp_gateway.rs runs them
# against a real gateway when MCP_PYTHON names its interpreter (exported for cargo nextest).
mcp_examples_venv() {
    local venv
    mkdir -p "${CARGO_TARGET_DIR:-target}"
    venv="$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/mcp-venv"
    if ! "$venv/bin/python" -c 'import sys' 2>/dev/null; then
        rm -rf "$venv"
        python3 -m venv "$venv" || return 2
    fi
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -r examples/mcp/requirements.txt || return 2
    (cd examples/mcp && "$venv/bin/python" -m pip install -q --disable-pip-version-check 'ruff>=0.5' &&
        "$venv/bin/python" -m ruff format --check --line-length 100 . &&
        "$venv/bin/python" -m ruff check --line-length 100 --select F,E,W,B,I,UP .) || return 1
    export MCP_PYTHON="$venv/bin/python"
    say "MCP examples: $("$MCP_PYTHON" -m pip freeze 2>/dev/null | grep -E '^(mcp|openai-agents)==' | tr '\n' ' ')"
}

# ---- (h) API schema --------------------------------------------------------------------------
# schemathesis (PyPI, pinned) in a virtualenv of its own under the cargo target dir, run against a
# real worker's admin API (scripts/api_schema_check.py builds and removes the world), bounded and
# seeded. hypothesis is pinned because schemathesis 3.39 breaks with newer releases.
SCHEMATHESIS_PINS=(schemathesis==3.39.16 hypothesis==6.120.0 'psycopg[binary]>=3.1,<4' 'aio-pika>=9.4,<11')
api_schema_tests() {
    local venv
    mkdir -p "${CARGO_TARGET_DIR:-target}"
    venv="$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/schemathesis-venv"
    if ! "$venv/bin/python" -c 'import sys' 2>/dev/null; then
        rm -rf "$venv"
        python3 -m venv "$venv" || return 2
    fi
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "${SCHEMATHESIS_PINS[@]}" || return 2
    say "schemathesis: $("$venv/bin/schemathesis" --version 2>&1 | head -n 1)"
    "$venv/bin/python" scripts/api_schema_check.py "$venv/bin/schemathesis"
}

step "services (PostgreSQL $PG_HOST:$PG_PORT, RabbitMQ $MQ_HOST:$MQ_PORT)" check_services
step "tools" check_tools
step "cargo fmt --check" cargo fmt --all -- --check
step "cargo clippy" cargo clippy --workspace --all-targets --locked -- -D warnings
step "publisher library alone (no CLI crates)" cargo check --locked -p intent-publisher --no-default-features --lib
step "promtool check rules" promtool check rules deploy/prometheus/alerts.yml
step "promtool test rules" promtool test rules deploy/prometheus/alerts_test.yml
step "kubernetes manifests (offline)" scripts/validate-k8s.sh
step "compose file" check_compose
# The end-to-end suites run the built binaries (worker with fault points, reference-downstream).
step "cargo build" cargo build --workspace --locked
# The Quick start without Docker, non-interactively, on the debug binaries just built (their
# worker has fault points; the release build would add minutes): its summary against the
# downstream's own table.
step "demo (scripts/demo.sh --once)" scripts/demo.sh --once --bin-dir "${CARGO_TARGET_DIR:-target}/debug"
step "python client (virtualenv, ruff, mypy, pytest)" python_client_tests
step "API schema (schemathesis against docs/openapi.yaml)" api_schema_tests
step "MCP examples (virtualenv, ruff; exports MCP_PYTHON)" mcp_examples_venv
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

nextest_rc=0
# In a subshell: a failing step exits it, and the slowest tests are still printed.
(step "cargo nextest" cargo nextest run --workspace --locked --no-fail-fast "$@") || nextest_rc=$?
slowest_tests
[ "$nextest_rc" -eq 0 ] || exit "$nextest_rc"
say "all steps passed ($((SECONDS - started_all))s)"
