# shellcheck shell=bash
# Postgres and RabbitMQ for scripts/test.sh and scripts/demo.sh: check that they answer, start
# local ones that are installed but stopped, install missing ones with apt-get when running as
# root on Debian/Ubuntu, and otherwise say exactly what to do (exit 2). Every wait has a deadline.
#
# Sourced, never run. The caller defines `say MESSAGE...` and sets, before `services_init`:
#   SERVICES_PG_URL_VAR  name of the variable holding the Postgres URL  (e.g. TEST_DATABASE_URL)
#   SERVICES_MQ_URL_VAR  name of the variable holding the RabbitMQ URL  (e.g. TEST_AMQP_URL)
# Optional: WAIT_SECS (default 60), APT_LOG (default /tmp/test-sh-apt.log).
# `services_init` sets PG_HOST PG_PORT MQ_HOST MQ_PORT; `check_services` does the rest.

WAIT_SECS=${WAIT_SECS:-60}
APT_LOG=${APT_LOG:-/tmp/test-sh-apt.log}

# url_host_port URL DEFAULT_PORT: prints "host port" of a postgres:// or amqp:// URL.
url_host_port() {
    local url=$1 default_port=$2 host port rest
    rest=${url#*://}
    rest=${rest%%[/?]*}
    rest=${rest##*@}
    if [[ $rest =~ ^\[([^]]*)\](:([0-9]+))?$ ]]; then
        host=${BASH_REMATCH[1]} port=${BASH_REMATCH[3]}
    else
        host=${rest%%:*}
        port=""
        [[ $rest == *:* ]] && port=${rest##*:}
    fi
    printf '%s %s\n' "${host:-127.0.0.1}" "${port:-$default_port}"
}

is_local() { [[ $1 == 127.* || $1 == localhost || $1 == ::1 ]]; }

tcp_open() { timeout 3 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; }

# wait_until SECONDS COMMAND...: retry COMMAND once a second.
wait_until() {
    local deadline=$((SECONDS + $1))
    shift
    until "$@"; do
        [ "$SECONDS" -ge "$deadline" ] && return 1
        sleep 1
    done
}

services_init() {
    read -r PG_HOST PG_PORT < <(url_host_port "${!SERVICES_PG_URL_VAR}" 5432)
    read -r MQ_HOST MQ_PORT < <(url_host_port "${!SERVICES_MQ_URL_VAR}" 5672)
}

is_root_with_apt() { [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; }

# apt_install PACKAGE...: installs Debian packages as root without starting their services.
apt_install() {
    if ! is_root_with_apt; then
        return 1
    fi
    say "installing Debian package(s) $*"
    # Keep the package's service from starting: policy-rc.d exit 101 forbids it.
    local made_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        made_policy=1
    fi
    local rc=0
    # Bounded: a dpkg lock held by someone else or a stalled mirror must not hang the caller.
    {
        DEBIAN_FRONTEND=noninteractive timeout 1200 apt-get install -y -qq --no-install-recommends "$@" ||
            { timeout 600 apt-get update -qq &&
                DEBIAN_FRONTEND=noninteractive timeout 1200 apt-get install -y -qq --no-install-recommends "$@"; }
    } >"$APT_LOG" 2>&1 || rc=$?
    [ "$made_policy" -eq 1 ] && rm -f /usr/sbin/policy-rc.d
    if [ "$rc" -ne 0 ]; then
        tail -n 20 "$APT_LOG" >&2
        return 1
    fi
}

postgres_ready() {
    local url=${!SERVICES_PG_URL_VAR}
    if command -v pg_isready >/dev/null 2>&1; then
        pg_isready -q -d "$url" -t 3 || return 1
    else
        tcp_open "$PG_HOST" "$PG_PORT" || return 1
    fi
    if command -v psql >/dev/null 2>&1; then
        psql "$url" -X -q -t -c 'select 1' >/dev/null 2>&1 || return 1
    fi
}

# amqp_answers: the broker answers the AMQP protocol header with a method frame (type 1) in
# time. An open port is not enough: a wedged node keeps accepting TCP and never answers.
amqp_answers() {
    local first
    first=$(timeout 10 bash -c "exec 3<>/dev/tcp/$MQ_HOST/$MQ_PORT; printf 'AMQP\x00\x00\x09\x01' >&3; head -c 1 <&3 | od -An -tx1" 2>/dev/null)
    [ "${first// /}" = 01 ]
}

rabbitmq_ready() {
    tcp_open "$MQ_HOST" "$MQ_PORT" || return 1
    amqp_answers || return 1
    # rabbitmq-diagnostics needs the node's Erlang cookie: root, or a user with its own copy.
    if is_local "$MQ_HOST" && command -v rabbitmq-diagnostics >/dev/null 2>&1 &&
        { [ "$(id -u)" -eq 0 ] || [ -r "$HOME/.erlang.cookie" ]; }; then
        timeout 20 rabbitmq-diagnostics -q ping >/dev/null 2>&1 || return 1
    fi
}

postgres_installed() { command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; }

# install_postgres: the Debian package, a `main` cluster, and trust for TCP connections from
# this machine (the tests and the demo connect as `postgres` without a password). Only a
# cluster this function just installed is changed.
install_postgres() {
    apt_install postgresql || return 1
    local version dir hba
    if ! ls -d /etc/postgresql/*/main >/dev/null 2>&1; then
        version=$(find /usr/lib/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' 2>/dev/null | sort -V | tail -n 1)
        [ -n "$version" ] || return 1
        say "creating PostgreSQL cluster $version/main"
        pg_createcluster "$version" main >>"$APT_LOG" 2>&1 || return 1
    fi
    for dir in /etc/postgresql/*/main; do
        hba=$dir/pg_hba.conf
        [ -f "$hba" ] || continue
        if ! grep -q '^host all all 127.0.0.1/32 trust' "$hba"; then
            say "trusting local TCP connections in $hba (a cluster installed just now)"
            { printf 'host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust\n'; cat "$hba"; } >"$hba.new" &&
                cat "$hba.new" >"$hba" && rm -f "$hba.new"
        fi
    done
}

start_postgres() {
    is_local "$PG_HOST" || return 1
    if ! postgres_installed; then
        install_postgres || return 1
    fi
    postgres_installed || return 1
    local dir version
    for dir in /etc/postgresql/*/; do
        version=$(basename "$dir")
        say "starting local PostgreSQL $version/main"
        pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    done
}

start_rabbitmq() {
    is_local "$MQ_HOST" || return 1
    if ! command -v rabbitmq-server >/dev/null 2>&1; then
        apt_install rabbitmq-server || return 1
    fi
    command -v rabbitmq-server >/dev/null 2>&1 || return 1
    # A local node that accepts connections but does not answer AMQP (seen once on this kind of
    # machine after hours of churn) is stopped first: `-detached` would refuse a second node.
    if tcp_open "$MQ_HOST" "$MQ_PORT" && ! amqp_answers; then
        say "local RabbitMQ accepts TCP but does not answer AMQP: stopping it"
        timeout 30 rabbitmqctl stop >/dev/null 2>&1 || pkill -KILL -f 'beam.smp.*rabbit' || true
        wait_until 30 bash -c "! exec 3<>/dev/tcp/$MQ_HOST/$MQ_PORT" 2>/dev/null || true
    fi
    say "starting local RabbitMQ (rabbitmq-server -detached)"
    rabbitmq-server -detached || true
}

# What to do when a service cannot be reached, as exact commands.
postgres_how() {
    if postgres_installed || ! is_local "$PG_HOST"; then
        echo "pg_ctlcluster --skip-systemctl-redirect \$(ls /etc/postgresql) main start"
    else
        echo "(as root) apt-get update && apt-get install -y postgresql && pg_ctlcluster --skip-systemctl-redirect \$(ls /etc/postgresql) main start" \
            "-- and let user postgres connect over TCP from 127.0.0.1 (e.g. 'host all all 127.0.0.1/32 trust' first in /etc/postgresql/*/main/pg_hba.conf)"
    fi
}

rabbitmq_how() {
    if command -v rabbitmq-server >/dev/null 2>&1 || ! is_local "$MQ_HOST"; then
        echo "rabbitmq-server -detached"
    else
        echo "(as root) apt-get update && apt-get install -y rabbitmq-server && rabbitmq-server -detached"
    fi
}

# ensure_service NAME HOST PORT READY START HOW URL_VAR: check, try to start, wait, or exit 2.
ensure_service() {
    local name=$1 host=$2 port=$3 ready=$4 start=$5 how=$6 url_var=$7
    "$ready" && { say "$name is up at $host:$port"; return 0; }
    say "$name is not reachable at $host:$port"
    if "$start" && wait_until "$WAIT_SECS" "$ready"; then
        say "$name is up at $host:$port"
        return 0
    fi
    {
        echo
        echo "ERROR: $name is not reachable at $host:$port (waited up to ${WAIT_SECS}s after trying to start it)."
        if [ "$name" = PostgreSQL ] && command -v psql >/dev/null 2>&1; then
            echo "  psql says: $(psql "${!url_var}" -X -q -t -c 'select 1' 2>&1 | head -n 1)"
        fi
        if [[ $how == *apt-get* ]]; then
            echo "  It is not installed here. Install and start it: $how"
        else
            echo "  Start it, e.g.: $how"
        fi
        echo "  or set $url_var to a reachable server (now: ${!url_var})."
    } >&2
    exit 2
}

check_services() {
    ensure_service PostgreSQL "$PG_HOST" "$PG_PORT" postgres_ready start_postgres \
        "$(postgres_how)" "$SERVICES_PG_URL_VAR"
    ensure_service RabbitMQ "$MQ_HOST" "$MQ_PORT" rabbitmq_ready start_rabbitmq \
        "$(rabbitmq_how)" "$SERVICES_MQ_URL_VAR"
}
