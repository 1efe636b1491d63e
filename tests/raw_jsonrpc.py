"""A small JSON-RPC client over an MCP server's stdio, for what the official `mcp` client does not
speak: the 2025-11-25 era's experimental tasks (`params.task` on tools/call, and a result that is
not a CallToolResult), which that client neither sends nor accepts."""
from __future__ import annotations

import asyncio
import json
from typing import Any


class RawError(Exception):
    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"{error.get('code')}: {error.get('message')}")
        self.code = error.get("code")
        self.error = error


class RawStdio:
    """One server process; `request` sends a request and returns its result (RawError on an error);
    notifications the server sends meanwhile are kept in `notified`."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.next_id = 0
        self.notified: list[dict[str, Any]] = []

    @classmethod
    async def start(cls, *argv: str, env: dict[str, str], cwd: str) -> RawStdio:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, env=env, cwd=cwd)
        return cls(proc)

    async def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        await self.proc.stdin.drain()

    async def request(self, method: str, params: dict[str, Any] | None = None, timeout: float = 30) -> Any:
        self.next_id += 1
        mine = self.next_id
        await self.send({"jsonrpc": "2.0", "id": mine, "method": method, "params": params or {}})
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
            if not line:
                raise EOFError("the server closed its output")
            msg = json.loads(line)
            if "method" in msg and "id" not in msg:
                self.notified.append(msg)
            elif msg.get("id") == mine:
                if "error" in msg:
                    raise RawError(msg["error"])
                return msg["result"]

    async def initialize(self, version: str = "2025-11-25", capabilities: dict[str, Any] | None = None) -> Any:
        result = await self.request("initialize", {"protocolVersion": version, "capabilities": capabilities or {},
                                                   "clientInfo": {"name": "raw", "version": "1"}})
        await self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return result

    async def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 5)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()
