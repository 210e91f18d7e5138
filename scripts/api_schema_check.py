"""Runs schemathesis against a real worker's admin API and docs/openapi.yaml (scripts/test.sh).

    api_schema_check.py SCHEMATHESIS_BIN [extra schemathesis args]

Starts target/debug/worker (or $INTENT_BIN_DIR/worker) with the admin API on a free port, against
a fresh Postgres database and unique broker names, runs schemathesis bounded and seeded with the checks
not_a_server_error, status_code_conformance, content_type_conformance,
response_schema_conformance and negative_data_rejection, on valid and invalid requests (admin
token; every operation), and removes the worker, the
database and the broker objects afterwards, whatever the outcome. Exit code: schemathesis's, or
1 when the world could not be built. Needs psycopg and aio_pika (the Python client's
virtualenv has both)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import aio_pika
import psycopg
from psycopg import sql

REPO = Path(__file__).resolve().parents[1]
PG_ADMIN = os.environ.get("TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
AMQP_URL = os.environ.get("TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
SEED = os.environ.get("SCHEMATHESIS_SEED", "20261201")
MAX_EXAMPLES = os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "60")
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_schema_conformance,negative_data_rejection"
)

# The dispatch target is never reached: the run only talks to the admin API.
TOOLS = """\
[tools.refund]
url = "http://127.0.0.1:9/refunds"
recovery = "none"
receipt_id = "/receipt_id"
receipt_match = { "/idempotency_key" = "{tenant}:{action_id}" }
timeout_ms = 1000
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_binary() -> Path:
    explicit = os.environ.get("INTENT_BIN_DIR")
    target = Path(os.environ.get("CARGO_TARGET_DIR") or "target")
    path = (
        Path(explicit) / "worker"
        if explicit
        else (target if target.is_absolute() else REPO / target) / "debug" / "worker"
    )
    if not path.exists():
        raise SystemExit(f"{path} is missing: run `cargo build --workspace` first")
    return path


async def delete_broker_objects(prefix: str) -> None:
    connection = await aio_pika.connect(AMQP_URL)
    try:
        for queue in (f"{prefix}.intents", f"{prefix}.dead"):
            channel = await connection.channel()
            try:
                await channel.queue_delete(queue)
            except aio_pika.exceptions.AMQPError as e:
                print(f"cleanup: queue {queue}: {e}")
        for exchange in (f"{prefix}.intents", f"{prefix}.results", f"{prefix}.dlx"):
            channel = await connection.channel()
            try:
                await channel.exchange_delete(exchange)
            except aio_pika.exceptions.AMQPError as e:
                print(f"cleanup: exchange {exchange}: {e}")
    finally:
        await connection.close()


def wait_listening(url: str, worker: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            raise SystemExit(f"the worker exited with {worker.returncode} before its API listened")
        try:
            urllib.request.urlopen(url, timeout=1)
        except urllib.error.HTTPError:
            return  # 401 without a token: the API answers
        except OSError:
            time.sleep(0.2)
            continue
        return
    raise SystemExit(f"the worker's API did not answer at {url} within {timeout}s")


def main() -> int:
    schemathesis, extra = sys.argv[1], sys.argv[2:]
    wid = uuid.uuid4().hex[:12]
    db_name, prefix = f"st_{wid}", f"st{wid}"
    admin_token = f"schemathesis-admin-{wid}"
    port = free_port()
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db_name)))
    worker: subprocess.Popen[bytes] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "worker.log"
        try:
            tools = Path(tmp) / "tools.toml"
            tools.write_text(TOOLS)
            env = {
                "PATH": os.environ.get("PATH", ""),
                "RUST_LOG": "info,lapin=warn,sqlx=warn",
                "DATABASE_URL": urlsplit(PG_ADMIN)._replace(path=f"/{db_name}").geturl(),
                "AMQP_URL": AMQP_URL,
                "WORKER_TOOLS": str(tools),
                "WORKER_ID": f"schemathesis-{wid}",
                "WORKER_LEASE_SECS": "3",
                "INTENTS_EXCHANGE": f"{prefix}.intents",
                "WORKER_INTENTS_QUEUE": f"{prefix}.intents",
                "RESULTS_EXCHANGE": f"{prefix}.results",
                "WORKER_DEAD_LETTER_EXCHANGE": f"{prefix}.dlx",
                "WORKER_DEAD_LETTER_QUEUE": f"{prefix}.dead",
                "WORKER_SHUTDOWN_GRACE_SECS": "5",
                "WORKER_ADMIN_ADDR": f"127.0.0.1:{port}",
                "WORKER_ADMIN_TOKEN": admin_token,
                "METRICS_ADDR": "off",
                "WORKER_DB_POOL_SIZE": "3",
            }
            with log.open("wb") as out:
                worker = subprocess.Popen(
                    [str(worker_binary()), "run"], env=env, stdout=out, stderr=subprocess.STDOUT
                )
            base = f"http://127.0.0.1:{port}"
            wait_listening(f"{base}/v1/operations", worker)
            cmd = [
                schemathesis,
                "run",
                str(REPO / "docs" / "openapi.yaml"),
                f"--base-url={base}",
                f"--header=Authorization: Bearer {admin_token}",
                f"--checks={CHECKS}",
                # Valid and invalid requests: invalid ones must answer 4xx, never 200 or 500.
                "--data-generation-method=all",
                "--experimental-negative-data-rejection-allowed-statuses=400,401,403,404,422",
                f"--hypothesis-seed={SEED}",
                f"--hypothesis-max-examples={MAX_EXAMPLES}",
                "--hypothesis-database=none",
                "--no-color",
                *extra,
            ]
            # scripts/schemathesis_hooks.py drops the invalid requests that serialize to valid ones.
            hooks_env = {
                "SCHEMATHESIS_TELEMETRY": "false",
                "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(REPO / "scripts"), os.environ.get("PYTHONPATH", "")) if p
                ),
            }
            rc = subprocess.call(cmd, env={**os.environ, **hooks_env})
            if rc != 0 or worker.poll() is not None:
                print("---- worker log (last 40 lines)")
                print("\n".join(log.read_text(errors="replace").splitlines()[-40:]))
            return rc if rc != 0 else (1 if worker.poll() is not None else 0)
        finally:
            if worker is not None and worker.poll() is None:
                worker.terminate()
                try:
                    worker.wait(15)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait()
            asyncio.run(delete_broker_objects(prefix))
            with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        sql.Identifier(db_name)
                    )
                )


if __name__ == "__main__":
    sys.exit(main())
