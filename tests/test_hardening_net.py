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
from daemon_kit import APPROVAL, start_daemon

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
