"""The examples of the client's guide (clients/python/README.md), run as written against a real
worker."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import AMQP_URL, World, pg_connect

from intent_worker_client import decode_intent

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def run(code: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_readme_has_the_two_examples() -> None:
    assert len(python_blocks()) == 2


def test_readme_agent_example_runs(world: World) -> None:
    out = run(
        python_blocks()[0],
        {
            "AMQP_URL": AMQP_URL,
            "INTENTS_EXCHANGE": world.intents_exchange,
            "RESULTS_EXCHANGE": world.results_exchange,
            "STATUS_URL": world.admin_url,
            "STATUS_TOKEN": world.tenant_token,
        },
    )
    assert out.startswith("succeeded | SUCCEEDED."), out
    assert world.mutations("north-shop:refund-order-731") == 1


def test_readme_outbox_example_runs(world: World) -> None:
    env = {"AGENT_DATABASE_URL": world.db_url}
    run(python_blocks()[1], env)
    run(python_blocks()[1], env)  # idempotent DDL; a second intent row, deduped by the worker later
    with pg_connect(world.db_url) as conn:
        rows = conn.execute("SELECT tenant, action_id, body FROM intent_outbox").fetchall()
    assert len(rows) == 2
    for tenant, action_id, body in rows:
        intent = decode_intent(body.encode())
        assert (
            (tenant, action_id)
            == (intent.tenant, intent.action_id)
            == (
                "north-shop",
                "refund-order-732",
            )
        )
        assert intent.reply_to == "refund-agent-1"
