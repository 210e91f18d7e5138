"""The console's browser suite: one world for the whole run (a fresh Postgres database, unique
broker names, the reference downstream and one real worker with the console on, whose tokens are
the admin's, two tenants' and an approver's, and whose `payout` tool asks for approval), and one
headless Chromium driven by Selenium through Debian's chromedriver, named explicitly so that
Selenium Manager never reaches for the network. Screenshots of each page go to
$CONSOLE_SCREENSHOTS (default <target>/console-screenshots). Mirrors clients/python/tests/
conftest.py and tests/src/procs.rs."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql

# Before selenium is imported: no usage statistics, no network.
os.environ["SE_AVOID_STATS"] = "true"

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PG_ADMIN = os.environ.get("TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
AMQP_URL = os.environ.get("TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
CHROMIUM = os.environ.get("CHROMIUM_BIN", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER_BIN", "/usr/bin/chromedriver")


def target_dir() -> Path:
    target = Path(os.environ.get("CARGO_TARGET_DIR") or "target")
    return target if target.is_absolute() else REPO / target


def binary(name: str) -> Path:
    path = Path(os.environ.get("INTENT_BIN_DIR") or target_dir() / "debug") / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `cargo build --workspace` first")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Child:
    """A child process whose output lines are kept (printed when the run fails)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert self.proc.stdout is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def wait_for_line(self, needle: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if needle in line:
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{self.name} did not print {needle!r}:\n" + "\n".join(self.lines))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


TOOLS = """\
[tools.refund]
url = "{base}/replay/refunds"
recovery = "replay"
replay_window_secs = 3600
replay_safety_margin_secs = 60
{common}
[tools.tickets]
url = "{base}/lookup/tickets"
recovery = "lookup"
lookup_url = "{base}/lookup/tickets/by-key/{{key}}"
{common}
[tools.deploy]
url = "{base}/none/deploys"
recovery = "none"
{common}
[tools.payout]
url = "{base}/replay/payouts"
recovery = "replay"
replay_window_secs = 3600
replay_safety_margin_secs = 60
approval = "required"
{common}
"""
COMMON = """\
receipt_id = "/receipt_id"
receipt_match = { "/idempotency_key" = "{tenant}:{action_id}" }
timeout_ms = 2000
recovery_attempts = 1
retry = { initial_delay_ms = 100, max_delay_ms = 500 }
"""
# The tool the "fix" adds: dead letters for it are republished once it exists.
FIXED_TOOL = """
[tools.ticket2]
url = "{base}/replay/tickets"
recovery = "replay"
replay_window_secs = 3600
replay_safety_margin_secs = 60
{common}
"""


@dataclass
class World:
    id: str
    db_name: str
    db_url: str
    prefix: str
    admin_port: int
    admin_token: str
    tenant_tokens: dict[str, str]
    approver_tokens: dict[str, str]
    dir: Path
    downstream_url: str = ""
    worker: Child | None = None
    children: list[Child] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def names(self) -> dict[str, str]:
        p = self.prefix
        return {
            "INTENTS_EXCHANGE": f"{p}.intents",
            "WORKER_INTENTS_QUEUE": f"{p}.intents",
            "RESULTS_EXCHANGE": f"{p}.results",
            "WORKER_DEAD_LETTER_EXCHANGE": f"{p}.dlx",
            "WORKER_DEAD_LETTER_QUEUE": f"{p}.dead",
        }

    def write_tools(self, fixed: bool) -> Path:
        text = TOOLS.format(base=self.downstream_url, common=COMMON)
        if fixed:
            text += FIXED_TOOL.format(base=self.downstream_url, common=COMMON)
        path = self.dir / "tools.toml"
        path.write_text(text)
        return path

    def start_worker(self, fixed: bool = False) -> None:
        tools = self.write_tools(fixed)
        env = {
            "PATH": os.environ.get("PATH", ""),
            "RUST_LOG": "info,lapin=warn,sqlx=warn",
            "DATABASE_URL": self.db_url,
            "AMQP_URL": AMQP_URL,
            "WORKER_TOOLS": str(tools),
            "WORKER_ID": f"browser-{self.id}",
            "WORKER_LEASE_SECS": "3",
            "WORKER_RECOVERY_INTERVAL_MS": "200",
            "WORKER_SHUTDOWN_GRACE_SECS": "2",
            "WORKER_ADMIN_ADDR": f"127.0.0.1:{self.admin_port}",
            "WORKER_ADMIN_TOKEN": self.admin_token,
            "WORKER_TENANT_TOKENS": ",".join(f"{t}={k}" for t, k in self.tenant_tokens.items()),
            "WORKER_APPROVER_TOKENS": ",".join(f"{a}={k}" for a, k in self.approver_tokens.items()),
            "METRICS_ADDR": "off",
            "WORKER_DB_POOL_SIZE": "4",
            **self.names(),
        }
        self.worker = Child("worker", [str(binary("worker")), "run"], env)
        self.children.append(self.worker)
        self.worker.wait_for_line("consuming intents", 30)

    def restart_worker(self, fixed: bool) -> None:
        """Kills the worker (nothing it holds is lost: leases, unacked deliveries) and starts
        it again on the same ports and database."""
        assert self.worker is not None
        self.worker.kill()
        self.start_worker(fixed)

    def publish(self, tenant: str, action_id: str, tool: str, args: dict[str, Any]) -> None:
        self.publish_many([(tenant, action_id, tool, args)])

    def publish_many(self, intents: list[tuple[str, str, str, dict[str, Any]]]) -> None:
        """Publishes intents as an agent does (persistent, mandatory, confirmed, message id
        `<tenant>:<action_id>`, routing key the tenant), on one connection."""
        asyncio.run(self._publish(intents))

    async def _publish(self, intents: list[tuple[str, str, str, dict[str, Any]]]) -> None:
        import aio_pika

        connection = await aio_pika.connect(AMQP_URL)
        try:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange(self.names()["INTENTS_EXCHANGE"], ensure=False)
            for tenant, action_id, tool, args in intents:
                body = {"tenant": tenant, "action_id": action_id, "tool": tool, "arguments": args}
                message = aio_pika.Message(
                    json.dumps(body).encode(),
                    content_type="application/json",
                    message_id=f"{tenant}:{action_id}",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                )
                await exchange.publish(message, routing_key=tenant, mandatory=True)
        finally:
            await connection.close()

    def fault(self, spec: dict[str, Any]) -> None:
        request = urllib.request.Request(
            f"{self.downstream_url}/_control/faults", data=json.dumps(spec).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            assert r.status == 201

    def clear_faults(self) -> None:
        request = urllib.request.Request(f"{self.downstream_url}/_control/faults", method="DELETE")
        urllib.request.urlopen(request, timeout=10).close()

    def query(self, statement: str, *args: object) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            return list(conn.execute(statement, args).fetchall())  # type: ignore[arg-type]

    def wait_until(self, what: str, check: Any, timeout: float = 45.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                log = "\n".join(self.worker.lines[-60:]) if self.worker else ""
                raise AssertionError(f"timed out waiting for {what}\n{log}")
            time.sleep(0.1)

    def state(self, tenant: str, action_id: str) -> str:
        rows = self.query(
            "SELECT state FROM operations WHERE tenant = %s AND action_id = %s", tenant, action_id
        )
        return str(rows[0][0]) if rows else ""

    def op_id(self, tenant: str, action_id: str) -> int:
        rows = self.query(
            "SELECT id FROM operations WHERE tenant = %s AND action_id = %s", tenant, action_id
        )
        return int(rows[0][0])

    def api(self, method: str, path: str, body: dict[str, Any] | None = None) -> int:
        request = urllib.request.Request(
            f"{self.base}{path}",
            data=json.dumps(body).encode() if body is not None else None,
            method=method,
            headers={
                "Authorization": f"Bearer {self.admin_token}",
                "Content-Type": "application/json",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)


def _create_database(name: str) -> str:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    # The server URL's parameters (sslmode, sslrootcert, ...) apply to the new database too.
    return urlsplit(PG_ADMIN)._replace(path=f"/{name}").geturl()


def _drop_database(name: str) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


async def _delete_broker_objects(world: World) -> None:
    import aio_pika

    names = world.names()
    connection = await aio_pika.connect(AMQP_URL)
    try:
        for queue in (names["WORKER_INTENTS_QUEUE"], names["WORKER_DEAD_LETTER_QUEUE"]):
            channel = await connection.channel()
            try:
                await channel.queue_delete(queue)
            except Exception:
                pass
        for exchange in (
            names["INTENTS_EXCHANGE"],
            names["RESULTS_EXCHANGE"],
            names["WORKER_DEAD_LETTER_EXCHANGE"],
        ):
            channel = await connection.channel()
            try:
                await channel.exchange_delete(exchange)
            except Exception:
                pass
    finally:
        await connection.close()


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    wid = uuid.uuid4().hex[:12]
    db_name = f"ui_{wid}"
    w = World(
        id=wid,
        db_name=db_name,
        db_url=_create_database(db_name),
        prefix=f"ui{wid}",
        admin_port=free_port(),
        admin_token=f"console-admin-{wid}",
        tenant_tokens={"north-shop": f"north-{wid}", "south-shop": f"south-{wid}"},
        approver_tokens={"alice": f"approver-alice-{wid}"},
        dir=tmp_path_factory.mktemp("console"),
    )
    try:
        downstream = Child(
            "downstream",
            [str(binary("reference-downstream"))],
            {
                "PATH": os.environ.get("PATH", ""),
                "DOWNSTREAM_DATABASE_URL": w.db_url,
                "DOWNSTREAM_SCHEMA": "downstream",
                "DOWNSTREAM_ADDR": "127.0.0.1:0",
                "RUST_LOG": "warn",
            },
        )
        w.children.append(downstream)
        line = downstream.wait_for_line("reference-downstream listening on", 20)
        w.downstream_url = f"http://127.0.0.1:{line.rsplit(':', 1)[1].strip()}"
        w.start_worker()
        yield w
    finally:
        for child in reversed(w.children):
            child.stop()
        if os.environ.get("CONSOLE_BROWSER_LOG"):
            for child in w.children:
                print(f"---- {child.name} ----\n" + "\n".join(child.lines))
        asyncio.run(_delete_broker_objects(w))
        _drop_database(w.db_name)


class Shots:
    """Numbered screenshots of each page, in the order taken."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.count = 0
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)

    def take(self, driver: webdriver.Chrome, name: str, full: bool = False) -> Path:
        """The window, or with `full` the whole page (Chromium's DevTools capture)."""
        self.count += 1
        path = self.dir / f"{self.count:02d}-{name}.png"
        if full:
            size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
            clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
            shot = driver.execute_cdp_cmd(
                "Page.captureScreenshot",
                {"format": "png", "captureBeyondViewport": True, "clip": clip},
            )
            path.write_bytes(base64.b64decode(shot["data"]))
        else:
            assert driver.save_screenshot(str(path)), path
        return path


@pytest.fixture(scope="session")
def shots() -> Shots:
    return Shots(
        Path(os.environ.get("CONSOLE_SCREENSHOTS") or target_dir() / "console-screenshots")
    )


@pytest.fixture(scope="session")
def driver() -> Iterator[webdriver.Chrome]:
    profile = tempfile.mkdtemp(prefix="console-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    chrome = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    chrome.implicitly_wait(0)
    try:
        yield chrome
    finally:
        chrome.quit()
        shutil.rmtree(profile, ignore_errors=True)
