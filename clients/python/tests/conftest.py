"""One test world against the real services: a fresh Postgres database, unique exchange and
queue names, the reference downstream and a real worker binary (target/debug, built by
scripts/test.sh before pytest runs), all removed afterwards. Mirrors tests/src/env.rs and
tests/src/procs.rs of the Rust e2e suite."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aio_pika
import psycopg
import pytest
from psycopg import sql

REPO = Path(__file__).resolve().parents[3]
PG_ADMIN = os.environ.get("TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
AMQP_URL = os.environ.get("TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")


def bin_dir() -> Path:
    explicit = os.environ.get("INTENT_BIN_DIR")
    if explicit:
        return Path(explicit)
    target = Path(os.environ.get("CARGO_TARGET_DIR") or "target")
    return (target if target.is_absolute() else REPO / target) / "debug"


def binary(name: str) -> Path:
    path = bin_dir() / name
    if not path.exists():
        pytest.fail(
            f"{path} is missing: run `cargo build --workspace` first (scripts/test.sh does)"
        )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Child:
    """A child process whose output lines are captured (printed when a test fails)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert self.proc.stdout is not None
        stream = self.proc.stdout
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.lines.append(line.rstrip("\n"))
            if os.environ.get("E2E_LOG"):
                print(f"[{self.name}] {line}", end="")

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

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@dataclass
class World:
    id: str
    db_name: str
    db_url: str
    intents_exchange: str
    results_exchange: str
    intents_queue: str
    dead_letter_exchange: str
    dead_letter_queue: str
    admin_url: str
    admin_token: str
    tenant: str
    tenant_token: str
    dir: Path
    downstream_url: str = ""
    children: list[Child] = field(default_factory=list)

    def mutations(self, key: str) -> int:
        """Writes the downstream really applied for an idempotency key (its own table)."""
        with pg_connect(self.db_url) as conn:
            row = conn.execute(
                "SELECT count(*) FROM downstream.mutations WHERE idem_key = %s", (key,)
            ).fetchone()
        assert row is not None
        return int(row[0])

    def worker_log(self) -> str:
        return "\n".join(line for c in self.children for line in c.lines)


def pg_connect(url: str, autocommit: bool = False) -> psycopg.Connection[tuple[object, ...]]:
    """Connects, waiting out a shared server that is briefly at max_connections (other
    suites run against the same Postgres)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return psycopg.connect(url, autocommit=autocommit)
        except psycopg.OperationalError as e:
            if "too many clients" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _create_database(name: str) -> str:
    with pg_connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    # The server URL's parameters (sslmode, sslrootcert, ...) apply to the new database too.
    return urlsplit(PG_ADMIN)._replace(path=f"/{name}").geturl()


def _drop_database(name: str) -> None:
    with pg_connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


async def _delete_broker_objects(world: World) -> None:
    connection = await aio_pika.connect(AMQP_URL)
    try:
        for queue in (world.intents_queue, world.dead_letter_queue):
            channel = await connection.channel()
            try:
                await channel.queue_delete(queue)
            except Exception:
                pass
        for exchange in (
            world.intents_exchange,
            world.results_exchange,
            world.dead_letter_exchange,
        ):
            channel = await connection.channel()
            try:
                await channel.exchange_delete(exchange)
            except Exception:
                pass
    finally:
        await connection.close()


TOOLS = """\
[tools.refund]
url = "{base}/replay/refunds"
recovery = "replay"
replay_window_secs = 3600
replay_safety_margin_secs = 60
{common}
[tools.deploy]
url = "{base}/none/deploys"
recovery = "none"
{common}
"""
COMMON = """\
receipt_id = "/receipt_id"
receipt_match = {{ "/idempotency_key" = "{{tenant}}:{{action_id}}" }}
timeout_ms = 2000
recovery_attempts = 3
retry = {{ initial_delay_ms = 100, max_delay_ms = 1000 }}
"""


WorldFactory = Callable[..., Awaitable[World]]


@pytest.fixture
async def make_world(tmp_path: Path) -> AsyncIterator[WorldFactory]:
    """Builds worlds (a database, a downstream and one worker, unique to the test);
    ``auth`` is appended to the tools file (e.g. an ``[auth]`` table); ``tools``, more tool
    tables, is too after filling in ``{base}`` (the downstream's URL) and ``{common}`` (the
    settings every tool here shares); ``env`` adds to the worker's environment. All are removed
    after the test, whatever its outcome."""
    worlds: list[World] = []

    async def build(auth: str = "", tools: str = "", env: dict[str, str] | None = None) -> World:
        wid = uuid.uuid4().hex[:12]
        db_name = f"py_{wid}"
        db_url = _create_database(db_name)
        prefix = f"py{wid}"
        admin_port = free_port()
        w = World(
            id=wid,
            db_name=db_name,
            db_url=db_url,
            intents_exchange=f"{prefix}.intents",
            results_exchange=f"{prefix}.results",
            intents_queue=f"{prefix}.intents",
            dead_letter_exchange=f"{prefix}.dlx",
            dead_letter_queue=f"{prefix}.dead",
            admin_url=f"http://127.0.0.1:{admin_port}",
            admin_token=f"admin-token-{wid}",
            tenant="north-shop",
            tenant_token=f"tenant-token-{wid}",
            dir=tmp_path / wid,
        )
        w.dir.mkdir()
        worlds.append(w)
        downstream = Child(
            "downstream",
            [str(binary("reference-downstream"))],
            {
                "PATH": os.environ.get("PATH", ""),
                "DOWNSTREAM_DATABASE_URL": db_url,
                "DOWNSTREAM_SCHEMA": "downstream",
                "DOWNSTREAM_ADDR": "127.0.0.1:0",
                "RUST_LOG": "warn",
            },
        )
        w.children.append(downstream)
        line = downstream.wait_for_line("reference-downstream listening on", 20)
        w.downstream_url = f"http://127.0.0.1:{line.rsplit(':', 1)[1].strip()}"
        tools_file = w.dir / "tools.toml"
        filled = {"base": w.downstream_url, "common": COMMON.format()}
        tools_file.write_text(TOOLS.format(**filled) + tools.format(**filled) + auth)
        worker = Child(
            "worker",
            [str(binary("worker")), "run"],
            {
                "PATH": os.environ.get("PATH", ""),
                "RUST_LOG": "info,lapin=warn,sqlx=warn",
                "DATABASE_URL": db_url,
                "AMQP_URL": AMQP_URL,
                "WORKER_TOOLS": str(tools_file),
                "WORKER_ID": f"py-worker-{wid}",
                # Above every tool's timeout_ms: the worker refuses a lease it does not exceed.
                "WORKER_LEASE_SECS": "3",
                "WORKER_RECOVERY_INTERVAL_MS": "200",
                "INTENTS_EXCHANGE": w.intents_exchange,
                "WORKER_INTENTS_QUEUE": w.intents_queue,
                "RESULTS_EXCHANGE": w.results_exchange,
                "WORKER_DEAD_LETTER_EXCHANGE": w.dead_letter_exchange,
                "WORKER_DEAD_LETTER_QUEUE": w.dead_letter_queue,
                "WORKER_SHUTDOWN_GRACE_SECS": "5",
                "WORKER_ADMIN_ADDR": f"127.0.0.1:{admin_port}",
                "WORKER_ADMIN_TOKEN": w.admin_token,
                "WORKER_TENANT_TOKENS": f"{w.tenant}={w.tenant_token}",
                "METRICS_ADDR": "off",
                "WORKER_DB_POOL_SIZE": "3",
                **(env or {}),
            },
        )
        w.children.append(worker)
        worker.wait_for_line("consuming intents", 30)
        return w

    try:
        yield build
    finally:
        for w in worlds:
            for child in reversed(w.children):
                child.stop()
            await _delete_broker_objects(w)
            _drop_database(w.db_name)


@pytest.fixture
async def world(make_world: WorldFactory) -> World:
    """The default world: tools refund (replay) and deploy (none), trusted tenants."""
    return await make_world()


@pytest.fixture
def unique() -> Iterator[str]:
    yield uuid.uuid4().hex[:10]


class FaultProxy:
    """A TCP proxy in front of one upstream (the broker) whose link can be cut: ``cut()``
    resets live connections and refuses new ones until ``restore()``. The Python twin of
    tests/src/proxy.rs, so a client can lose its broker without touching the shared broker."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.cut_off = False
        self.stalled = False
        self.links: set[asyncio.StreamWriter] = set()
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self) -> FaultProxy:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self.links.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    if self.stalled:
                        continue  # a silent partition: bytes go nowhere
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self.links.difference_update((writer, up_writer))

    def cut(self) -> None:
        self.cut_off = True
        for link in list(self.links):
            link.transport.abort()
        self.links.clear()

    def stall(self) -> None:
        """Live connections stop moving bytes without closing (only timeouts notice)."""
        self.stalled = True

    def restore(self) -> None:
        self.cut_off = False
        self.stalled = False

    def amqp_url(self) -> str:
        return AMQP_URL.replace(
            f"@{self.upstream[0]}:{self.upstream[1]}", f"@127.0.0.1:{self.port}"
        )

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
