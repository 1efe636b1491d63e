"""Sessions and what they leave behind: MCP sessions belong to their token, are capped per token and
close when idle; inbox sessions expire and are listed and revocable; a stop ends long polls at once;
no token, link, cookie or session id reaches the log; idempotency keys and ended sessions are pruned."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import pytest
from mcp import Client
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client

import interactiond as itd
from daemon_kit import APPROVAL, START_MS, start_daemon

ROOT = Path(__file__).resolve().parent.parent
EXE = [sys.executable, "-m", "interactiond"]
HOUR_MS = 3_600_000
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                   "clientInfo": {"name": "raw", "version": "1"}}}
LIST = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
SESSIONS_PER_TOKEN = 32
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture
def backend() -> str:
    return "sqlite"                                 # sessions live in the daemon, not in the store


# -- MCP sessions ---------------------------------------------------------------------------------

async def open_session(d, role: str = "operator") -> str:
    """Open a streamable-HTTP session with a raw initialize; returns its id."""
    resp = await d.client.post("/mcp", json=INIT, headers={**MCP_HEADERS, **d.auth(role)})
    assert resp.status == 200, await resp.text()
    await resp.read()
    return resp.headers["mcp-session-id"]


async def use_session(d, sid: str, role: str = "operator") -> int:
    """tools/list in session `sid`; the HTTP status."""
    headers = {**MCP_HEADERS, **d.auth(role), "mcp-session-id": sid, "mcp-protocol-version": "2025-11-25"}
    resp = await d.client.post("/mcp", json=LIST, headers=headers)
    await resp.read()
    return resp.status


@contextlib.asynccontextmanager
async def official_session(d, role: str = "operator"):
    """The official client over streamable HTTP in the legacy era (which has sessions); yields the
    client and the session id the daemon gave it."""
    seen: list[str] = []

    async def note(response: Any) -> None:
        if "mcp-session-id" in response.headers:
            seen.append(response.headers["mcp-session-id"])
    url = str(d.client.make_url("/mcp"))
    async with httpx2.AsyncClient(headers=d.auth(role), timeout=30, event_hooks={"response": [note]}) as http:
        async with Client(streamable_http_client(url, http_client=http), mode="legacy") as c:
            assert seen, "the daemon gave no session id"
            yield c, seen[0]


async def test_an_mcp_session_answers_only_the_token_that_opened_it(d):
    async with official_session(d) as (c, sid):
        assert (await c.list_tools()).tools
        # The session id with another token (a writer of the same playbook): as if it did not exist.
        for role in ("writer", "reader"):
            assert await use_session(d, sid, role) == 404
        resp = await d.client.delete("/mcp", headers={**d.auth("writer"), "mcp-session-id": sid})
        assert resp.status == 404
        # Its own token goes on using it, and so does the client.
        assert await use_session(d, sid) == 200
        r = await c.call_tool("list_definitions", {})
        assert not r.is_error


async def test_an_sse_session_answers_only_the_token_that_opened_it(d):
    url = str(d.client.make_url("/sse"))
    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers=d.auth("operator")) as stream:
            assert stream.status == 200
            endpoint = ""
            while "session_id=" not in endpoint:
                endpoint += (await stream.content.readline()).decode()
            path = re.search(r"(/messages/\?session_id=[0-9a-f]{32})", endpoint).group(1)
            other = await d.client.post(path, json=INIT, headers=d.auth("writer"))
            assert other.status == 404

            async def send(message: dict[str, Any]) -> None:
                """POST a message in the session and read its answer off the stream."""
                resp = await d.client.post(path, json=message, headers=d.auth("operator"))
                assert resp.status == 202
                line = b""
                while not line.startswith(b"data: {"):
                    line = await asyncio.wait_for(stream.content.readline(), 10)
                assert json.loads(line[6:])["id"] == message["id"]
            await send(INIT)
            # Ten minutes of the daemon's clock with no message either way: the session is closed.
            await d.advance("PT9M")
            await send(LIST)
            await d.advance("PT9M")
            await send(LIST)
            await d.advance("PT10M")
            rest = await asyncio.wait_for(stream.content.read(), 10)          # the stream ends
            assert b"event: endpoint" not in rest
            assert (await d.client.post(path, json=LIST, headers=d.auth("operator"))).status == 404
    # The official SSE client works as before.
    async with Client(sse_client(url, headers=d.auth("operator")), mode="legacy") as c:
        assert not (await c.call_tool("list_definitions", {})).is_error


async def test_mcp_sessions_are_capped_per_token(d):
    theirs = await open_session(d, "writer")
    mine = [await open_session(d) for _ in range(SESSIONS_PER_TOKEN)]
    for sid in mine[1:] + mine[:1]:                   # the first one used last: the second is the oldest idle
        assert await use_session(d, sid) == 200
    newest = await open_session(d)
    # One more closed the token's oldest idle session; the others and another token's stay.
    assert await use_session(d, mine[1]) == 404
    for sid in [mine[0], *mine[2:], newest]:
        assert await use_session(d, sid) == 200
    assert await use_session(d, theirs, "writer") == 200


async def test_idle_mcp_sessions_close_after_ten_minutes_of_the_daemons_clock(d):
    used, abandoned = await open_session(d), await open_session(d, "writer")
    async with official_session(d) as (c, connected):
        await d.advance("PT9M")
        assert await use_session(d, used) == 200
        await d.advance("PT9M")
        assert await use_session(d, abandoned, "writer") == 404      # 18 minutes without a request
        assert await use_session(d, used) == 200                     # 9 minutes since its last one
        await d.advance("PT10M")
        assert await use_session(d, used) == 404
        # A connected client holds its stream open: its session is not idle, however long it waits.
        assert not (await c.call_tool("list_definitions", {})).is_error
        assert await use_session(d, connected) == 200


async def test_mcp_bodies_are_bounded_like_every_route(d):
    big = b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"pad": "' + b"x" * itd.MAX_BODY_BYTES + b'"}}'
    resp = await d.client.post("/mcp", data=big, headers={**MCP_HEADERS, **d.auth()})
    assert resp.status == 413 and (await resp.json())["type"] == "/problems/too_large"
    sid = await open_session(d)
    resp = await d.client.post("/mcp", data=big, headers={**MCP_HEADERS, **d.auth(), "mcp-session-id": sid})
    assert resp.status == 413
    resp = await d.client.post(f"/messages/?session_id={'0' * 32}", data=big, headers=d.auth())
    assert resp.status == 413 and (await resp.json())["type"] == "/problems/too_large"
    assert await use_session(d, sid) == 200


# -- inbox sessions -------------------------------------------------------------------------------

def login_token(db: str) -> str:
    conn = itd.open_sync(db)
    try:
        return itd.create_token(conn, "writer", "local/default", "inbox login", purpose="login")[1]
    finally:
        conn.close()


async def sign_in(d) -> str:
    resp = await d.client.get(f"/login?token={login_token(d.db)}", allow_redirects=False)
    assert resp.status == 303
    cookie = resp.cookies[itd.SESSION_COOKIE].value
    d.client.session.cookie_jar.clear()
    return cookie


async def with_cookie(d, cookie: str) -> int:
    resp = await d.client.get("/web/session", cookies={itd.SESSION_COOKIE: cookie})
    await resp.read()
    return resp.status


async def test_an_inbox_session_ends_after_twelve_hours_unused(d):
    cookie = await sign_in(d)
    await d.advance("PT11H")
    assert await with_cookie(d, cookie) == 200
    await d.advance("PT11H")
    assert await with_cookie(d, cookie) == 200        # 22 h after sign-in, 11 h after its last use
    await d.advance("PT12H")
    assert await with_cookie(d, cookie) == 401


async def test_an_inbox_session_ends_seven_days_after_sign_in_however_used(d):
    cookie = await sign_in(d)
    for _ in range(15):                               # used every 11 hours: 165 h
        await d.advance("PT11H")
        assert await with_cookie(d, cookie) == 200
    await d.advance("PT3H")                           # 168 h: seven days
    assert await with_cookie(d, cookie) == 401


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*EXE, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


async def test_token_list_shows_inbox_sessions_and_revoke_ends_one(d, tmp_path):
    first, second = await sign_in(d), await sign_in(d)
    listed = cli("token", "list", "--db", d.db, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    sessions = [line.split("\t") for line in listed.stdout.splitlines() if "\tsession, " in line]
    assert len(sessions) == 2 and all(s[1] == "writer" and s[3] == "active" for s in sessions), listed.stdout
    assert first not in listed.stdout and second not in listed.stdout
    conn = sqlite3.connect(d.db)
    [first_id] = conn.execute("SELECT id FROM tokens WHERE hash = ?", (itd.sha256_hex(first),)).fetchone()
    conn.close()
    revoked = cli("token", "revoke", "--db", d.db, first_id, cwd=tmp_path)
    assert revoked.returncode == 0 and first_id in revoked.stdout, revoked.stderr
    assert await with_cookie(d, first) == 401
    assert await with_cookie(d, second) == 200
    states = {line.split("\t")[0]: line.split("\t")[3] for line in cli("token", "list", "--db", d.db,
                                                                        cwd=tmp_path).stdout.splitlines()}
    assert states[first_id] == "revoked"


V1_SCHEMA = (Path(__file__).parent / "fixtures" / "schema-v1.sql").read_text()


def v1_file(path: str, now: int = START_MS) -> None:
    """A database as the previous version left it: user_version 1, sessions with no end."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript(V1_SCHEMA)
    conn.execute("PRAGMA user_version = 1")
    for ident, secret, purpose, created in (("tok_old", "itd_old-session", "session", now - 8 * 24 * HOUR_MS),
                                            ("tok_new", "itd_new-session", "session", now - HOUR_MS),
                                            ("tok_api", "itd_api-token", "api", now - 30 * 24 * HOUR_MS)):
        conn.execute("INSERT INTO tokens (id, hash, playbook, role, name, purpose, created_at) VALUES (?,?,?,?,?,?,?)",
                     (ident, itd.sha256_hex(secret), None, "operator", purpose, purpose, created))
    conn.close()


async def test_a_file_of_the_previous_version_is_migrated(tmp_path, aiohttp_client):
    db = str(tmp_path / "v1.db")
    v1_file(db)
    d = await start_daemon(aiohttp_client, db)
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == itd.SCHEMA_VERSION
    rows = {r[0]: r[1:] for r in conn.execute("SELECT id, used_at, expires_at FROM tokens WHERE id LIKE 'tok____'")}
    conn.close()
    assert rows["tok_new"] == (START_MS - HOUR_MS, START_MS - HOUR_MS + 7 * 24 * HOUR_MS)
    assert rows["tok_api"] == (None, None)
    # A session older than seven days has ended; a recent one goes on; API tokens never expire.
    assert await with_cookie(d, "itd_old-session") == 401
    assert await with_cookie(d, "itd_new-session") == 200
    resp = await d.client.get("/web/session", headers={"Authorization": "Bearer itd_api-token"})
    assert resp.status == 200
    # The command line opens (and migrates) such a file too; it tells states by this machine's clock.
    other = str(tmp_path / "v1-cli.db")
    v1_file(other, int(time.time() * 1000))
    listed = cli("token", "list", "--db", other, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    states = {line.split("\t")[0]: line.split("\t")[3] for line in listed.stdout.splitlines()}
    assert states["tok_old"] == "expired" and states["tok_new"] == "active" and states["tok_api"] == "active"


# -- pruning ----------------------------------------------------------------------------------------

async def test_idempotency_keys_go_after_a_day_and_ended_sessions_at_the_next_pass(d):
    status, run = await d.call("POST", "/runs", {"type": "interaction", "name": "ask-text",
                                                 "input": {"prompt": "Name it", "to": "ana", "expires": "P7D"}})
    assert status == 202, run
    _, page = await d.call("GET", f"/v2/interactions?run_id={run['run_id']}")
    ident = page["data"][0]["id"]
    resp = await d.client.post(f"/v2/interactions/{ident}/responses", json={"type": "text", "text": "Atlas"},
                               headers={**d.auth("writer"), "Idempotency-Key": "k-1"})
    assert resp.status == 200, await resp.text()
    kept, signed_out = await sign_in(d), await sign_in(d)
    resp = await d.client.post("/logout", cookies={itd.SESSION_COOKIE: signed_out},
                               headers={"Origin": str(d.client.make_url("/")).rstrip("/")})
    assert resp.status == 204

    def count(sql: str) -> int:
        conn = sqlite3.connect(d.db)
        try:
            return conn.execute(sql).fetchone()[0]
        finally:
            conn.close()
    sessions = "SELECT COUNT(*) FROM tokens WHERE purpose = 'session'"
    spent_links = "SELECT COUNT(*) FROM tokens WHERE purpose = 'login'"
    assert count("SELECT COUNT(*) FROM idempotency") == 1 and count(sessions) == 2 and count(spent_links) == 2
    await d.advance("PT2H")
    # The pass an hour in: the signed-out session and the spent links are gone, the key stays.
    assert count(sessions) == 1 and count(spent_links) == 0
    assert count("SELECT COUNT(*) FROM idempotency") == 1
    assert await with_cookie(d, kept) == 200
    await d.advance("PT21H")
    assert count("SELECT COUNT(*) FROM idempotency") == 1          # 23 h
    await d.advance("PT2H")
    assert count("SELECT COUNT(*) FROM idempotency") == 0          # 25 h
    # The kept session was last used 23 h ago: expired, and pruned.
    assert count(sessions) == 0
    assert await with_cookie(d, kept) == 401


# -- a stop, and the log, on a real `serve` -------------------------------------------------------

@pytest.fixture
def serve(tmp_path):
    """`interactiond serve` as a subprocess, its log (stderr) kept in a file."""
    log = tmp_path / "serve.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([*EXE, "serve", "--port", "0", "--host", "127.0.0.1", "--clock", "manual"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = [proc.stdout.readline() for _ in range(2)]
    url = re.search(r"at (http://\S+)", out[0]).group(1)
    login = out[1].split("token=", 1)[1].strip()
    token = (tmp_path / "interactiond.db.token").read_text().strip()
    yield proc, url, token, login, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


async def test_a_stop_ends_twenty_long_polls_at_once(serve):
    proc, url, token, _, _ = serve
    pb = url + "/v1/orgs/local/playbooks/default"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
        resp = await http.post(pb + "/definitions", json={"name": "approve", "source": APPROVAL})
        assert resp.status == 201
        runs = []
        for i in range(20):
            resp = await http.post(pb + "/runs", json={"name": "approve", "input": {"owner": "ana", "review": f"r{i}"}})
            runs.append((await resp.json())["run_id"])

        async def poll(run_id: str) -> tuple[int, Any]:
            async with http.post(pb + f"/runs/{run_id}/wait?timeout=60") as resp:
                return resp.status, await resp.json()
        polls = [asyncio.create_task(poll(r)) for r in runs]
        # Every poll is parked (its own run still waiting) before the stop.
        deadline = time.monotonic() + 20
        while len(proc_connections(proc.pid)) < 20 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        answers = await asyncio.wait_for(asyncio.gather(*polls), 30)
        code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
        took = time.monotonic() - began
    assert code == 0
    assert [(s, a["run_id"], a["status"]) for s, a in answers] == [(202, r, "waiting") for r in runs]
    assert took < 5, f"the stop took {took:.1f} s"


def proc_connections(pid: int) -> list[str]:
    """The established TCP connections of a process (from /proc), to know the polls have arrived."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
            if m:
                inodes.add(m.group(1))
    out = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "01" and cols[9] in inodes:
                    out.append(cols[1])
    return out


async def test_no_token_link_cookie_or_session_id_reaches_the_log(serve):
    proc, url, token, login, log = serve
    host, port = url.split("//")[1].split(":")
    cookie = "itd_cookie-value-of-a-session"
    for raw in (f"GET /login?token={login} HTTP/1.1 trailing\r\nHost: x\r\n\r\n".encode(),
                f"GET /healthz HTTP/1.1\r\nAuthorization: Bearer {token}\r\nBroken Header\r\n\r\n".encode(),
                f"G\x01T /login?token={login} HTTP/1.1\r\nCookie: {itd.SESSION_COOKIE}={cookie}\r\n\r\n".encode(),
                f"GET /healthz HTTP/1.1\r\nCookie: {itd.SESSION_COOKIE}={cookie}\r\nAuthorization: Bearer {token}"
                f"\r\nX\x01: y\r\n\r\n".encode()):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(raw)
            assert s.recv(1000).startswith(b"HTTP/1.")
    # An MCP session: the SDK speaks of its id as it opens, is used and ends.
    seen: list[str] = []

    async def note(response: Any) -> None:
        seen.extend(v for k, v in response.headers.items() if k.lower() == "mcp-session-id")
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=30,
                                  event_hooks={"response": [note]}) as http:
        async with Client(streamable_http_client(url + "/mcp", http_client=http), mode="legacy") as c:
            assert not (await c.call_tool("list_definitions", {})).is_error
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/mcp", json=LIST, headers={**MCP_HEADERS, "Authorization": "Bearer itd_wrong",
                                                               "mcp-session-id": seen[0]}) as resp:
            assert resp.status == 401
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    text = log.read_text(errors="replace")
    assert "Error handling request" in text             # the bad requests were logged...
    assert seen and seen[0] not in text                 # ...but no secret of them, nor a session id
    for secret in (login, token, cookie, login[4:20], token[4:20], "itd_wrong"):
        assert secret not in text, secret
    assert "StreamableHTTP session manager" not in text and "session ID" not in text
