"""The daemon on the network: connections that send nothing (or too little) cannot hold it, it keeps
answering with more idle connections than its cap, it works behind a TLS proxy, it stops within 2 s
whatever is open, and a malformed request is one line in its log."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import pytest

import interactiond as itd
from daemon_kit import APPROVAL, START_MS, start_daemon

ROOT = Path(__file__).resolve().parent.parent
OPS = str(ROOT / "tests" / "servers" / "ops_server.py")


@dataclass
class Serving:
    proc: subprocess.Popen
    url: str
    token: str
    log: Path

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.split("//")[1].rsplit(":", 1)
        return host, int(port)

    @property
    def pb(self) -> str:
        return self.url + "/v1/orgs/local/playbooks/default"

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def stop(self, timeout: float = 30) -> tuple[int, float]:
        """SIGTERM; the exit code and how long the daemon took to exit."""
        began = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        return code, time.monotonic() - began


@contextlib.contextmanager
def serving(tmp_path: Path, config: dict[str, Any] | None = None, nofile: tuple[int, int] | None = None
            ) -> Iterator[Serving]:
    """`interactiond serve` in a subprocess (its stderr in a file), optionally under an open-file limit."""
    args = [sys.executable, "-m", "interactiond", "serve", "--port", "0", "--host", "127.0.0.1", "--clock", "manual"]
    if config is not None:
        (tmp_path / "interactiond.yaml").write_text(json.dumps(config))
        args += ["--config", str(tmp_path / "interactiond.yaml")]

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
    log = tmp_path / "serve.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=limit)
    try:
        first = proc.stdout.readline()
        m = re.search(r"at (http://\S+)", first)
        assert m, f"serve printed {first!r}; its log: {log.read_text()}"
        yield Serving(proc, m.group(1), (tmp_path / "interactiond.db.token").read_text().strip(), log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def established(pid: int) -> int:
    """How many established TCP connections the process holds (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
            if m:
                inodes.add(m.group(1))
    count = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                cols = line.split()
                count += cols[3] == "01" and cols[9] in inodes
    return count


# Connections ######################################################################################

@contextlib.asynccontextmanager
async def served_in_process(tmp_path: Path, config: Any = None):
    """The real app, accepting as `serve` accepts (start_serving), on this test's loop; its address."""
    engine = itd.Engine(itd.Store(str(tmp_path / "t.db")), itd.ManualClock(START_MS), config or itd.Config())
    runner, server = await itd.start_serving(itd.build_app(engine), "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[:2]
    finally:
        await itd.stop_serving(runner, server)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> float:
    """How long until the daemon closes the connection (it sends nothing first); fails past `seconds`."""
    began = time.monotonic()
    assert await asyncio.wait_for(reader.read(1000), seconds) == b""
    return time.monotonic() - began


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


async def read_response(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    return head + await asyncio.wait_for(reader.readexactly(length), 5)


async def test_a_connection_sends_its_request_head_in_time_or_is_closed(tmp_path, monkeypatch):
    monkeypatch.setattr(itd, "HEADERS_TIMEOUT_S", 0.5)
    monkeypatch.setattr(itd, "KEEPALIVE_TIMEOUT_S", 30.0)
    async with served_in_process(tmp_path) as (host, port):
        silent = await asyncio.open_connection(host, port)
        one_byte = await asyncio.open_connection(host, port)
        one_byte[1].write(b"G")
        # A kept-alive connection: its first request is answered; its next one starts and stalls.
        stalled = await asyncio.open_connection(host, port)
        stalled[1].write(HEALTHZ)
        assert (await read_response(stalled[0])).startswith(b"HTTP/1.1 200")
        stalled[1].write(b"GET /hea")
        # Another, idle between requests: the head's deadline is not its bound, the keep-alive one is.
        idle = await asyncio.open_connection(host, port)
        idle[1].write(HEALTHZ)
        assert (await read_response(idle[0])).startswith(b"HTTP/1.1 200")
        for reader, _ in (silent, one_byte, stalled):
            await closed_within(reader, 5)
        idle[1].write(HEALTHZ)                  # still open, and answering
        assert (await read_response(idle[0])).startswith(b"HTTP/1.1 200")
        # A head sent in time, slowly, is answered.
        slow = await asyncio.open_connection(host, port)
        for part in (b"GET /hea", b"lthz HTTP/1.1\r\n", b"Host: x\r\n\r\n"):
            slow[1].write(part)
            await asyncio.sleep(0.1)
        assert (await read_response(slow[0])).startswith(b"HTTP/1.1 200")
        for _, writer in (silent, one_byte, stalled, idle, slow):
            writer.close()


async def test_an_idle_kept_alive_connection_closes_after_the_keep_alive_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(itd, "KEEPALIVE_TIMEOUT_S", 0.5)
    async with served_in_process(tmp_path) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(HEALTHZ)
        assert (await read_response(reader)).startswith(b"HTTP/1.1 200")
        await closed_within(reader, 5)
        writer.close()


def test_the_keep_alive_and_head_bounds_are_the_documented_ones():
    assert (itd.HEADERS_TIMEOUT_S, itd.KEEPALIVE_TIMEOUT_S, itd.DEFAULT_MAX_CONNECTIONS) == (10.0, 75.0, 4096)


def open_idle(address: tuple[str, int], count: int) -> list[socket.socket]:
    """`count` connections that send nothing."""
    out = []
    for _ in range(count):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.connect(address)
        out.append(s)
    return out


def timed_get(d: Serving, path: str, headers: dict[str, str] | None = None) -> tuple[int, float]:
    """GET on a new connection: the status and the seconds it took (10 s at most)."""
    import urllib.request
    began = time.monotonic()
    req = urllib.request.Request(d.url + path, headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()
        return resp.status, time.monotonic() - began


def test_more_idle_connections_than_descriptors_leave_healthz_and_the_api_answering(tmp_path):
    # 1,000 connections that send nothing, to a daemon allowed 512 descriptors: the cap (the limit
    # less a reserve) closes the idle ones first, and /healthz and a real client still get in.
    with serving(tmp_path, nofile=(512, 512)) as d:
        idle = open_idle(d.address, 1000)
        try:
            status, took = timed_get(d, "/healthz")
            assert status == 200 and took < 1, took
            status, took = timed_get(d, "/v1/orgs/local/playbooks/default/definitions", d.auth())
            assert status == 200 and took < 1, took
            assert established(d.proc.pid) <= 512
        finally:
            for s in idle:
                s.close()
        code, _ = d.stop()
    assert code == 0
    text = d.log.read_text()
    assert "open-file limit is 512" in text and "Traceback" not in text


def test_healthz_answers_within_a_second_while_connections_flood_in(tmp_path):
    # 6,000 connections that send nothing, opened as fast as one thread can: a connection attempt
    # of a real client is neither refused nor left to be tried again a second later.
    import threading
    with serving(tmp_path) as d:
        idle: list[socket.socket] = []
        flooded = threading.Event()

        def flood() -> None:
            try:
                idle.extend(open_idle(d.address, 6000))
            finally:
                flooded.set()
        threading.Thread(target=flood, daemon=True).start()
        took = []
        try:
            while not flooded.is_set():
                took.append(timed_get(d, "/healthz")[1])
                time.sleep(0.02)
            took.append(timed_get(d, "/v1/orgs/local/playbooks/default/definitions", d.auth())[1])
        finally:
            flooded.wait(60)
            for s in idle:
                s.close()
        assert len(idle) == 6000
        assert max(took) < 1, sorted(took)[-5:]
        assert d.stop()[0] == 0


def test_max_connections_caps_the_open_connections(tmp_path):
    with serving(tmp_path, {"max_connections": 50}) as d:
        idle = open_idle(d.address, 200)
        try:
            status, took = timed_get(d, "/healthz")
            assert status == 200 and took < 1, took
            assert established(d.proc.pid) <= 50
            status, took = timed_get(d, "/v1/orgs/local/playbooks/default/definitions", d.auth())
            assert status == 200 and took < 1, took
        finally:
            for s in idle:
                s.close()
        assert d.stop()[0] == 0


def test_the_open_file_limit_is_raised_to_the_hard_limit_at_start(tmp_path):
    with serving(tmp_path, nofile=(256, 4096)) as d:
        limits = Path(f"/proc/{d.proc.pid}/limits").read_text()
        soft, hard = re.search(r"Max open files\s+(\d+)\s+(\d+)", limits).groups()
        assert (soft, hard) == ("4096", "4096")
        assert d.stop()[0] == 0


@pytest.mark.parametrize("value", [0, -1, "many", True, 2.5, 10_000_000])
def test_max_connections_is_validated(tmp_path, value):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"max_connections": value}))
    with pytest.raises(itd.ConfigError) as err:
        itd.load_config(str(path))
    assert err.value.problems == ["max_connections: a whole number from 1 to 1,000,000 (default 4,096)"]


def test_max_connections_is_read(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_connections: 50\n")
    assert itd.load_config(str(path)).max_connections == 50
    assert itd.load_config(None).max_connections == 4096


# Shutdown #########################################################################################

async def test_sigterm_exits_within_two_seconds_with_polls_streams_and_tool_servers_open(tmp_path):
    # Five stdio servers, each started by a launcher that outlives the server a while after its input
    # closes (as package runners can): the daemon does not wait the SDK's 2 s for each to go.
    servers = [f"ops{i}" for i in range(5)]
    launcher = f"'{sys.executable}' '{OPS}'; sleep 30"
    config = {"servers": {name: {"command": ["sh", "-c", launcher]} for name in servers},
              "playbooks": {"local/default": {"servers": servers}}}
    with serving(tmp_path, config) as d:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(headers=d.auth(), connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=120)) as http:
            # Five tool servers, each opened by a call of its read-only tool.
            for name in servers:
                async with http.post(d.pb + f"/tools/{name}/status", json={"arguments": {"service": "web"}}) as resp:
                    assert resp.status == 200, await resp.text()
            async with http.post(d.pb + "/definitions", json={"name": "approve", "source": APPROVAL}) as resp:
                assert resp.status == 201
            runs = []
            for i in range(20):
                async with http.post(d.pb + "/runs", json={"name": "approve",
                                                           "input": {"owner": "ana", "review": f"r{i}"}}) as resp:
                    runs.append((await resp.json())["run_id"])
            streams = []
            for _ in range(500):
                resp = await http.get(d.pb + "/stream")
                assert resp.status == 200
                assert (await resp.content.readline()).startswith(b"retry:")
                streams.append(resp)

            async def poll(run_id: str) -> int:
                async with http.post(d.pb + f"/runs/{run_id}/wait?timeout=60") as resp:
                    await resp.read()
                    return resp.status
            polls = [asyncio.create_task(poll(r)) for r in runs]
            deadline = time.monotonic() + 30
            while established(d.proc.pid) < 520 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert established(d.proc.pid) >= 520
            await asyncio.sleep(0.5)            # the polls reach their waits
            loop = asyncio.get_running_loop()
            code, took = await loop.run_in_executor(None, d.stop)
            assert await asyncio.wait_for(asyncio.gather(*polls), 10) == [202] * 20
            for resp in streams:
                resp.release()
    assert code == 0
    assert took < 2, f"the stop took {took:.1f} s"
    assert "Traceback" not in d.log.read_text()


# Behind a TLS proxy ###############################################################################

PUBLIC = "https://inbox.example.org"
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}}


@pytest.fixture
async def proxied(tmp_path, aiohttp_client):
    """A daemon whose public_url is https://inbox.example.org, reached as a TLS proxy reaches it."""
    config = itd.Config(playbooks={"local/default": (), "acme/other": ()}, public_url=PUBLIC)
    return await start_daemon(aiohttp_client, str(tmp_path / "t.db"), config=config)


def login_token(db: str) -> str:
    conn = itd.open_sync(db)
    try:
        return itd.create_token(conn, "writer", "local/default", "inbox login", purpose="login")[1]
    finally:
        conn.close()


async def test_behind_a_tls_proxy_the_cookie_is_secure_and_the_https_origin_is_the_pages(proxied):
    d = proxied
    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", {"owner": "ana", "review": "ok"})
    resp = await d.client.get(f"/login?token={login_token(d.db)}", allow_redirects=False,
                              headers={"Host": "inbox.example.org", "X-Forwarded-Proto": "https"})
    assert resp.status == 303
    cookie = resp.cookies[itd.SESSION_COOKIE]
    assert cookie["secure"] and cookie["httponly"] and cookie["samesite"] == "Strict"
    d.client.session.cookie_jar.clear()
    jar = {"Cookie": f"{itd.SESSION_COOKIE}={cookie.value}", "Host": "inbox.example.org"}
    path = d.url(f"/runs/{run['run_id']}/answer")
    answer = {"answer": {"verdict": "approve"}}
    for other in ("https://evil.example", "https://inbox.example.org.evil.example", "https://inbox.example.org:8443"):
        resp = await d.client.post(path, json=answer, headers={**jar, "Origin": other})
        assert resp.status == 403, other
    resp = await d.client.post(path, json=answer, headers={**jar, "Origin": PUBLIC})
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["answer"] == {"verdict": "approve"}


async def test_behind_a_tls_proxy_mcp_and_sse_accept_the_public_host_and_no_other(proxied):
    d = proxied
    public = {**d.auth(), "Host": "inbox.example.org"}
    resp = await d.client.post("/mcp", json=INIT, headers={**MCP_HEADERS, **public, "Origin": PUBLIC})
    assert resp.status == 200, await resp.text()
    await resp.read()
    async with d.client.get("/sse", headers=public) as resp:
        assert resp.status == 200
        assert (await resp.content.readline()).startswith(b"event: endpoint")
    # The DNS-rebinding protection is still on: another host, or another origin, is refused.
    resp = await d.client.post("/mcp", json=INIT, headers={**MCP_HEADERS, **d.auth(), "Host": "evil.example"})
    assert resp.status == 421
    await resp.read()
    resp = await d.client.post("/mcp", json=INIT, headers={**MCP_HEADERS, **public, "Origin": "https://evil.example"})
    assert resp.status == 403
    await resp.read()
    async with d.client.get("/sse", headers={**d.auth(), "Host": "evil.example"}) as resp:
        assert resp.status == 421


def test_public_origin_leaves_out_a_default_port():
    assert itd.public_origin("https://Inbox.Example.org:443/base") == ("https://inbox.example.org", "inbox.example.org")
    assert itd.public_origin("https://inbox.example.org:8443") == ("https://inbox.example.org:8443",
                                                                    "inbox.example.org:8443")
    assert itd.public_origin("http://10.0.0.5") == ("http://10.0.0.5", "10.0.0.5")
    assert itd.public_origin(None) is None


# One line a malformed request ####################################################################

LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR) ")


def test_a_malformed_request_is_one_line_in_the_log_without_a_traceback(tmp_path):
    with serving(tmp_path) as d:
        host, port = d.address
        garbage = [b"GET /healthz HTTP/1.1\r\nHost: x\r\nBroken Header\r\n\r\n",        # a bad header
                   b"GET /healthz HTTP/1.1 trailing\r\nHost: x\r\n\r\n",               # a bad request line
                   b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
                   b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"]          # a line too long
        for raw in garbage:
            with socket.create_connection((host, port), timeout=10) as s:
                s.sendall(raw)
                assert s.recv(1000).startswith(b"HTTP/1.0 400")
        # /sse with a Host or an Origin the DNS-rebinding protection refuses.
        auth = f"Authorization: Bearer {d.token}\r\n"
        for raw, status in ((f"GET /sse HTTP/1.1\r\nHost: evil.example\r\n{auth}\r\n", b"421"),
                            (f"GET /sse HTTP/1.1\r\nHost: {host}:{port}\r\nOrigin: http://evil.example\r\n{auth}\r\n",
                             b"403")):
            with socket.create_connection((host, port), timeout=10) as s:
                s.sendall(raw.encode())
                assert s.recv(1000).split(b" ")[1] == status
        assert d.stop()[0] == 0
    lines = d.log.read_text().splitlines()
    assert "Traceback" not in "\n".join(lines)
    assert [line for line in lines if not LOG_LINE.match(line)] == []          # no line runs on
    bad = [line for line in lines if "Error handling request" in line]
    assert len(bad) == len(garbage), bad
    assert all(" WARNING " in line and ": 400 " in line for line in bad), bad
    assert not any("a" * 100 in line for line in lines)                         # what was sent is not quoted
    assert len([line for line in lines if "Invalid Host header" in line]) == 1
    assert len([line for line in lines if "Invalid Origin header" in line]) == 1
    assert not any("/sse failed" in line for line in lines)
