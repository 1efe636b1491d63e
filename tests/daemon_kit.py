"""Shared pieces for the daemon's tests: a real app on a temporary database (an SQLite file, or a
fresh PostgreSQL database), on the manual clock, delivering through the example chat service where
a test needs a tool server."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import secrets
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import interactiond as itd

START_MS = 1_800_000_000_000          # 2027-01-15T08:00:00Z: far from any real date

ROOT = Path(__file__).resolve().parent.parent
#: The example chat service: a real MCP tool server, and the one most tests deliver through.
CHAT_SERVER = ROOT / "examples" / "chat_server.py"

#: The backends a test can run on; the `db` fixture (conftest.py) runs a test once on each.
BACKENDS = ("sqlite", "postgres")
#: The PostgreSQL server the tests make their databases on (default: the local unix socket).
PG_DSN = os.environ.get("INTERACTIOND_TEST_PG_DSN", "postgresql:///postgres")
#: Set in CI: a test on PostgreSQL fails, rather than skips, when no server is reachable.
REQUIRE_POSTGRES = os.environ.get("INTERACTIOND_REQUIRE_POSTGRES") == "1"

_pg_unreachable: list[str] = []          # why the server could not be reached, once known


def _pg_admin() -> Any:
    import psycopg

    return psycopg.connect(PG_DSN, autocommit=True, connect_timeout=5)


def postgres_or_skip() -> None:
    """Skip the test (fail it, in CI) when there is no PostgreSQL server to test on."""
    import pytest

    if not _pg_unreachable:
        try:
            import psycopg  # noqa: F401

            _pg_admin().close()
            _pg_unreachable.append("")
        except Exception as exc:            # the driver missing, or the server
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            _pg_unreachable.append(f"no PostgreSQL server at {itd.postgres_url_shown(PG_DSN)}"
                                   f" (INTERACTIOND_TEST_PG_DSN names it): {first}")
    if _pg_unreachable[0]:
        if REQUIRE_POSTGRES:
            pytest.fail(_pg_unreachable[0] + " and INTERACTIOND_REQUIRE_POSTGRES=1")
        pytest.skip(_pg_unreachable[0])


@contextlib.contextmanager
def fresh_postgres() -> Iterator[str]:
    """A new, empty database on the test server (its URL), dropped after."""
    postgres_or_skip()
    name = "itd_test_" + secrets.token_hex(6)
    admin = _pg_admin()
    try:
        admin.execute(f"CREATE DATABASE {name}")
        parts = urllib.parse.urlsplit(PG_DSN)      # (urlunsplit drops the empty host of postgresql:///x)
        yield f"{parts.scheme}://{parts.netloc}/{name}" + (f"?{parts.query}" if parts.query else "")
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


@contextlib.contextmanager
def database(backend: str, tmp_path: Path, name: str = "t.db") -> Iterator[str]:
    """Where a daemon keeps its data on `backend`: a file under tmp_path, or a fresh PostgreSQL database."""
    if backend == "postgres":
        with fresh_postgres() as url:
            yield url
    else:
        yield str(tmp_path / name)

APPROVAL = """---
description: Asks a brief's owner to approve it
to: '{{ input.owner }}'
expires: P2D
input:
  schema:
    type: object
    required: [owner, review]
    properties:
      owner: { type: string }
      review: { type: string }
output:
  schema:
    type: object
    required: [verdict]
    properties:
      verdict: { type: string, enum: [approve, revise] }
      note: { type: string, maxLength: 2000 }
---
Your brief was reviewed:

{{ input.review }}

Approve it, or ask for a revision.
"""

NOTIFY = """---
to: '{{ input.owner }}'
expires: PT1H
input:
  schema:
    type: object
    required: [owner]
    properties:
      owner: { type: string }
---
Heads up, {{ input.owner }}: the brief shipped.
"""


@dataclass
class Daemon:
    client: Any
    engine: Any
    clock: Any
    db: str
    tokens: dict[str, str] = field(default_factory=dict)
    playbook: str = "local/default"
    config: Any = None
    chat: str = ""                      # the chat service's database, where the daemon delivers through one

    def url(self, tail: str = "", playbook: str | None = None) -> str:
        org, name = (playbook or self.playbook).split("/")
        return f"/v1/orgs/{org}/playbooks/{name}{tail}"

    def auth(self, role: str = "operator") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}"}

    async def call(self, method: str, tail: str, body: Any = None, role: str = "operator",
                   playbook: str | None = None, **kw: Any) -> tuple[int, Any]:
        absolute = tail.startswith(("/v1/", "/v2/", "/healthz", "/openapi.json", "/problems/", "/mcp", "/sse"))
        path = tail if absolute else self.url(tail, playbook)
        resp = await self.client.request(method, path, json=body, headers=self.auth(role), **kw)
        text = await resp.text()
        return resp.status, (json.loads(text) if text else None)

    async def define(self, name: str, source: str) -> dict[str, Any]:
        status, body = await self.call("POST", "/definitions", {"type": "interaction", "name": name, "source": source})
        assert status in (200, 201), body
        return body

    async def run(self, name: str, input_: Any, run_id: str | None = None) -> tuple[int, dict[str, Any]]:
        body = {"type": "interaction", "name": name, "input": input_}
        if run_id:
            body["run_id"] = run_id
        return await self.call("POST", "/runs", body)

    async def advance(self, duration: str) -> None:
        status, body = await self.call("POST", "/v1/admin/clock", {"advance": duration})
        assert status == 200, body


def person_token(db: str, person: str, role: str = "writer", playbook: str = "local/default") -> str:
    """A new token naming person `person` (a reader's or a writer's, bound to one playbook)."""
    tx = itd.open_sync(db)
    try:
        return itd.create_token(tx, role, playbook, f"{person}'s", person=person)[1]
    finally:
        tx.close()


def make_tokens(db: str) -> dict[str, str]:
    conn = itd.open_sync(db)
    try:
        out = {}
        for key, role, pb in (("operator", "operator", None), ("writer", "writer", "local/default"),
                              ("reader", "reader", "local/default"), ("other", "writer", "acme/other")):
            out[key] = itd.create_token(conn, role, pb, key)[1]
        return out
    finally:
        conn.close()


async def start_daemon(aiohttp_client: Any, db: str, *, clock: Any = None, config: Any = None,
                       tokens: dict[str, str] | None = None) -> Daemon:
    clock = clock or itd.ManualClock(START_MS)
    config = config or itd.Config(playbooks={"local/default": (), "acme/other": ()})
    tokens = tokens or make_tokens(db)
    engine = itd.Engine(itd.Store(db), clock, config)
    client = await aiohttp_client(itd.build_app(engine))
    return Daemon(client, engine, clock, db, tokens, config=config)


def chat_command(chat_db: str | Path) -> tuple[str, ...]:
    """The command line that serves the example chat service, over stdio, on the database `chat_db`."""
    return (sys.executable, str(CHAT_SERVER), "serve", "--db", str(chat_db))


def chat_config(chat_db: str | Path, *, playbook: str = "local/default", servers: dict[str, Any] | None = None) -> Any:
    """A Config whose `playbook` may use the example chat service (as `chat`) and `servers`, if any;
    acme/other uses none."""
    servers = {"chat": itd.ServerConfig("chat", command=chat_command(chat_db)), **(servers or {})}
    return itd.Config(servers=servers, playbooks={playbook: tuple(servers), "acme/other": ()})


def write_chat_config(path: Path, chat_db: str | Path) -> Path:
    """A configuration file at `path` whose playbook local/default delivers through the example chat
    service on `chat_db`: for daemons started as `interactiond serve --config`."""
    path.write_text(json.dumps({"servers": {"chat": {"command": list(chat_command(chat_db))}},
                                "playbooks": {"local/default": {"servers": ["chat"]}}}))
    return path


async def start_chat_daemon(aiohttp_client: Any, db: str, chat_db: str | Path, *, playbook: str = "local/default",
                            servers: dict[str, Any] | None = None, clock: Any = None) -> Daemon:
    """A daemon whose `playbook` delivers through the example chat service, keeping its messages in
    `chat_db` (read them with examples/chat_server.py's `messages`); `servers` are added beside it."""
    daemon = await start_daemon(aiohttp_client, db, clock=clock,
                                config=chat_config(chat_db, playbook=playbook, servers=servers))
    daemon.chat = str(chat_db)
    return daemon


# Waiting without guessing how long ######################################################################

async def until(check: Callable[[], Any], seconds: float = 10.0, what: str = "") -> Any:
    """Ask `check()` (awaited when it returns an awaitable) again and again until it is truthy, and
    return what it gave; fail after `seconds` of real time. For what happens outside the daemon's
    event loop: a tool server's subprocess, another process, a thread of the store."""
    deadline = time.monotonic() + seconds
    while True:
        got = check()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {seconds} s: {what or check}"
        await asyncio.sleep(0.02)


@contextlib.contextmanager
def watching_waits(daemon: Daemon) -> Iterator[asyncio.Event]:
    """An event set when a long poll (`/wait`, MCP `wait_run`) parks on the daemon's bus: once set, an
    answer committed after it wakes that wait. The bus's own `waiter` does the work; this only sees it."""
    bus, parked = daemon.engine.bus, asyncio.Event()
    real = bus.waiter

    def waiter(key: Any) -> Any:
        fut = real(key)
        parked.set()
        return fut
    bus.waiter = waiter
    try:
        yield parked
    finally:
        del bus.waiter
