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
from daemon_kit import APPROVAL

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
