"""The two MCP tool servers used by demos and integration tests, driven as real subprocesses with the
official mcp client: examples/chat_server.py (a chat service) and tests/servers/flaky_server.py (failures)."""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import re
import socket
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import httpx2
import pytest
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CONNECTION_CLOSED, INTERNAL_ERROR, INVALID_PARAMS, REQUEST_TIMEOUT

ROOT = Path(__file__).resolve().parents[1]
CHAT = ROOT / "examples" / "chat_server.py"
FLAKY = ROOT / "tests" / "servers" / "flaky_server.py"
TS_RE = re.compile(r"^\d{10}\.\d{6}$")

_spec = importlib.util.spec_from_file_location("chat_server", CHAT)
chat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chat)


def chat_params(db: Path, *extra: str, env: dict | None = None) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable, args=[str(CHAT), "serve", "--db", str(db), *extra], env=env)


def flaky_params(*extra: str, env: dict | None = None) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable, args=[str(FLAKY), *extra], env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpServer:
    """`script ... --http PORT` in a child process, started at once; `url()` waits until it listens."""

    def __init__(self, script: Path, *args: str):
        self.port = free_port()
        self.name = script.name
        self.proc = subprocess.Popen([sys.executable, str(script), *args, "--http", str(self.port)])

    def url(self, timeout: float = 20) -> str:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"{self.name} exited with {self.proc.returncode}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return f"http://127.0.0.1:{self.port}/mcp"
            except OSError:
                assert time.monotonic() < deadline, f"{self.name} did not listen on {self.port}"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="module", autouse=True)
def http_servers(tmp_path_factory):
    """Both HTTP servers boot (about 2 s of imports each) while the stdio tests run; one test uses each."""
    chat_db = tmp_path_factory.mktemp("chat-http") / "chat.db"
    servers = {"chat": HttpServer(CHAT, "serve", "--db", str(chat_db), "--bot-user", "web-bot"),
               "flaky": HttpServer(FLAKY, "--http-429", "3")}
    servers["chat"].db = str(chat_db)
    yield servers
    for server in servers.values():
        server.stop()


@contextlib.asynccontextmanager
async def held_client(target, **kw):
    """`async with Client` entered and exited by its own task; yields (client, {"error": what ended it})."""
    ready: asyncio.Future = asyncio.get_running_loop().create_future()
    stop, outcome = asyncio.Event(), {}

    async def hold() -> None:
        try:
            async with Client(target, **kw) as c:
                ready.set_result(c)
                await stop.wait()
        except BaseException as e:  # noqa: BLE001 - recorded for the test to inspect
            outcome["error"] = e
            if not ready.done():
                ready.set_exception(e)

    task = asyncio.create_task(hold())
    try:
        yield await ready, outcome
    finally:
        stop.set()
        await task


def leaf_errors(e: BaseException) -> list[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        return [x for sub in e.exceptions for x in leaf_errors(sub)]
    return [e]


def by_value(ts: str) -> Decimal:
    return Decimal(ts)


# ---------------------------------------------------------------- chat_server

async def test_chat_tools_and_a_thread_round_trip_with_a_person_replying(tmp_path):
    db = tmp_path / "chat.db"
    # --db and the bot's name come from the child's env here (a stdio child gets only what `env=` passes).
    params = StdioServerParameters(command=sys.executable, args=[str(CHAT)], cwd=str(tmp_path),
                                   env={"CHAT_DB": str(db), "CHAT_BOT_USER": "robot"})
    async with Client(params, read_timeout_seconds=10) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        assert set(tools) == {"post_message", "thread_replies", "channel_history"}
        for spec in chat.TOOL_SPECS:
            t = tools[spec["name"]]
            assert t.input_schema == spec["input_schema"] and t.output_schema == spec["output_schema"]
            assert t.input_schema["additionalProperties"] is False and t.description
            assert all(p.get("description") for p in t.input_schema["properties"].values())
        assert tools["post_message"].input_schema["required"] == ["channel", "text"]
        assert set(tools["post_message"].input_schema["properties"]) == {"channel", "text", "thread_ts"}
        assert tools["thread_replies"].input_schema["required"] == ["channel", "ts"]
        limit = tools["thread_replies"].input_schema["properties"]["limit"]
        assert (limit["minimum"], limit["maximum"], limit["default"]) == (1, 200, 15)
        assert tools["thread_replies"].input_schema["properties"]["oldest"]["default"] == "0"
        assert [tools[n].annotations.read_only_hint for n in ("post_message", "thread_replies", "channel_history")
                ] == [False, True, True]

        posted = await c.call_tool("post_message", {"channel": "ops", "text": "Deploy v2?"})
        assert not posted.is_error
        parent = posted.structured_content["ts"]
        assert posted.structured_content == {"channel": "ops", "ts": parent} and TS_RE.match(parent)
        assert json.loads(posted.content[0].text) == posted.structured_content

        reply = chat.say(str(db), "ops", "alice", "approve", thread_ts=parent)
        other = chat.say(str(db), "ops", "bob", "unrelated top-level")
        assert by_value(parent) < by_value(reply) < by_value(other)

        r = await c.call_tool("thread_replies", {"channel": "ops", "ts": parent})
        assert not r.is_error and json.loads(r.content[0].text) == r.structured_content
        assert r.structured_content == {"has_more": False, "messages": [
            {"ts": parent, "user": "robot", "text": "Deploy v2?", "thread_ts": None},
            {"ts": reply, "user": "alice", "text": "approve", "thread_ts": parent}]}

        async def thread(**kw) -> list[str]:
            res = await c.call_tool("thread_replies", {"channel": "ops", "ts": parent, **kw})
            assert not res.is_error, res.content
            return [m["ts"] for m in res.structured_content["messages"]]

        assert await thread(oldest=parent) == [reply]
        assert await thread(oldest=reply) == []
        assert await thread(oldest=parent.split(".")[0]) == [parent, reply]      # fewer digits compare by value
        limited = await c.call_tool("thread_replies", {"channel": "ops", "ts": parent, "limit": 1})
        assert [m["ts"] for m in limited.structured_content["messages"]] == [parent]
        assert limited.structured_content["has_more"] is True

        # The bot answering a reply lands in the same thread.
        again = await c.call_tool("post_message", {"channel": "ops", "text": "done", "thread_ts": reply})
        assert await thread(oldest=reply) == [again.structured_content["ts"]]

        hist = await c.call_tool("channel_history", {"channel": "ops"})
        assert [m["ts"] for m in hist.structured_content["messages"]] == [
            parent, reply, other, again.structured_content["ts"]]
        assert (await c.call_tool("channel_history", {"channel": "ops", "oldest": other})).structured_content == {
            "has_more": False, "messages": [{"ts": again.structured_content["ts"], "user": "robot", "text": "done",
                                             "thread_ts": parent}]}
        empty = await c.call_tool("channel_history", {"channel": "nobody-posted-here"})
        assert empty.structured_content == {"messages": [], "has_more": False}

        # Refusals are tool errors and store nothing.
        before = len(chat.messages(str(db), "ops"))
        for bad in ({"channel": "ops", "text": ""}, {"channel": "ops", "text": "   "},
                    {"channel": "ops", "text": "x", "thread_ts": "123.000001"},
                    {"channel": "ops", "text": "x", "extra": 1}, {"channel": "ops"}):
            res = await c.call_tool("post_message", bad)
            assert res.is_error and res.structured_content is None, bad
        assert len(chat.messages(str(db), "ops")) == before
        res = await c.call_tool("thread_replies", {"channel": "ops", "ts": parent, "limit": 0})
        assert res.is_error and "limit" in res.content[0].text
        res = await c.call_tool("thread_replies", {"channel": "ops", "ts": "1.000001"})
        assert res.is_error
        with pytest.raises(MCPError) as err:
            await c.call_tool("no_such_tool", {})
        assert err.value.code == INVALID_PARAMS

    assert chat.calls(str(db), "thread_replies") == 8
    assert chat.calls(str(db), "channel_history") == 3
    assert chat.calls(str(db), "post_message") == 7
    assert [m["user"] for m in chat.messages(str(db), "ops")] == ["robot", "alice", "bob", "robot"]


async def test_chat_injected_errors_retry_after_hang_and_crash(tmp_path):
    db = str(tmp_path / "chat.db")
    parent = chat.say(db, "ops", "alice", "hello")
    args = {"channel": "ops", "ts": parent}
    async with Client(chat_params(tmp_path / "chat.db"), read_timeout_seconds=10) as c:
        assert not (await c.call_tool("thread_replies", args)).is_error

        chat.inject_fault(db, "thread_replies", 1)
        r = await c.call_tool("thread_replies", args)
        assert r.is_error and "injected" in r.content[0].text
        assert "retry_after_ms" not in (r.meta or {}) and r.structured_content is None

        chat.inject_fault(db, "thread_replies", 2, retry_after_ms=1500)
        for _ in range(2):
            r = await c.call_tool("thread_replies", args)
            assert r.is_error
            assert r.meta["retry_after_ms"] == 1500                      # wire `_meta`, attribute `meta`
            assert r.structured_content["retry_after_ms"] == 1500
            assert json.loads(r.content[0].text)["retry_after_ms"] == 1500
        r = await c.call_tool("thread_replies", args)
        assert not r.is_error and r.structured_content["messages"][0]["ts"] == parent
        assert chat.calls(db, "thread_replies") == 5                      # faulted calls count too

        # A fault is for one tool only.
        chat.inject_fault(db, "post_message", 1)
        assert not (await c.call_tool("channel_history", {"channel": "ops"})).is_error
        assert (await c.call_tool("post_message", {"channel": "ops", "text": "x"})).is_error
        assert len(chat.messages(db, "ops")) == 1

        chat.inject_fault(db, "channel_history", 1, mode="hang")
        with pytest.raises(MCPError) as err:
            await c.call_tool("channel_history", {"channel": "ops"}, read_timeout_seconds=0.5)
        assert err.value.code == REQUEST_TIMEOUT
        assert not (await c.call_tool("channel_history", {"channel": "ops"})).is_error  # consumed once

        chat.inject_fault(db, "post_message", 1, mode="crash")
        with pytest.raises(MCPError) as err:
            await c.call_tool("post_message", {"channel": "ops", "text": "lost"})
        assert err.value.code == CONNECTION_CLOSED
        with pytest.raises(MCPError):
            await c.call_tool("channel_history", {"channel": "ops"})
    assert chat.calls(db, "post_message") == 2 and len(chat.messages(db, "ops")) == 1
    assert chat._begin_call(db, "post_message") is None                 # the crash consumed its fault


async def test_chat_over_streamable_http(http_servers):
    db, url = http_servers["chat"].db, http_servers["chat"].url()
    async with Client(url, read_timeout_seconds=10) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        assert tools["thread_replies"].annotations.read_only_hint is True
        posted = await c.call_tool("post_message", {"channel": "ops", "text": "via http"})
        parent = posted.structured_content["ts"]
        reply = chat.say(db, "ops", "alice", "seen", parent)
        r = await c.call_tool("thread_replies", {"channel": "ops", "ts": parent, "oldest": parent})
        assert r.structured_content["messages"] == [
            {"ts": reply, "user": "alice", "text": "seen", "thread_ts": parent}]
        chat.inject_fault(db, "thread_replies", 1, retry_after_ms=250)
        r = await c.call_tool("thread_replies", {"channel": "ops", "ts": parent})
        assert r.is_error and r.meta["retry_after_ms"] == 250
    async with Client(streamable_http_client(url), mode="legacy", read_timeout_seconds=10) as c:
        r = await c.call_tool("channel_history", {"channel": "ops"})
        assert [m["user"] for m in r.structured_content["messages"]] == ["web-bot", "alice"]
    assert chat.calls(db, "thread_replies") == 2


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHAT), *args], capture_output=True, text=True, timeout=30, check=check)


def test_chat_cli_say_show_fail_calls(tmp_path):
    db = str(tmp_path / "chat.db")
    parent = run_cli("say", "--db", db, "--channel", "ops", "--user", "alice", "ship", "it?").stdout.strip()
    assert TS_RE.match(parent)
    reply = run_cli("say", "--db", db, "--channel", "ops", "--user", "bob", "--thread", parent, "yes").stdout.strip()
    assert chat.messages(db, "ops") == [
        {"ts": parent, "user": "alice", "text": "ship it?", "thread_ts": None},
        {"ts": reply, "user": "bob", "text": "yes", "thread_ts": parent}]
    shown = run_cli("show", "--db", db, "--channel", "ops").stdout
    assert "alice: ship it?" in shown and "bob: yes" in shown and shown.index(parent) < shown.index(reply)
    shown_json = run_cli("show", "--db", db, "--channel", "ops", "--json").stdout
    as_json = [json.loads(line) for line in shown_json.splitlines()]
    assert as_json == chat.messages(db, "ops")

    bad = run_cli("say", "--db", db, "--channel", "ops", "--user", "bob", "--thread", "1.000001", "x", check=False)
    assert bad.returncode == 2 and "no message" in bad.stderr
    assert len(chat.messages(db, "ops")) == 2

    run_cli("fail", "--db", db, "--tool", "thread_replies", "--times", "2", "--retry-after-ms", "900")
    assert chat._begin_call(db, "thread_replies") == ("error", 900)
    assert chat._begin_call(db, "thread_replies") == ("error", 900)
    assert chat._begin_call(db, "thread_replies") is None
    assert run_cli("calls", "--db", db, "--tool", "thread_replies").stdout.strip() == "3"
    assert run_cli("fail", "--db", db, "--tool", "x", "--mode", "explode", check=False).returncode == 2
    with pytest.raises(ValueError):
        chat.inject_fault(db, "x", 1, mode="explode")


def test_chat_ts_never_repeats_or_goes_back_with_the_clock(tmp_path, monkeypatch):
    db = str(tmp_path / "chat.db")
    clock = iter([1_700_000_000_000_000_000] * 3 + [1_600_000_000_000_000_000] + [1_800_000_000_000_000_000])
    monkeypatch.setattr(chat.time, "time_ns", lambda: next(clock))
    got = [chat.say(db, "c", "u", str(i)) for i in range(5)]
    assert got == ["1700000000.000000", "1700000000.000001", "1700000000.000002", "1700000000.000003",
                   "1800000000.000000"]


def test_chat_ts_strictly_increasing_across_processes(tmp_path):
    db = str(tmp_path / "chat.db")
    chat.say(db, "c", "setup", "create the db")
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('c', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "print(' '.join(m.say(sys.argv[2], 'c', sys.argv[3], str(i)) for i in range(40)))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(CHAT), db, f"w{k}"], stdout=subprocess.PIPE, text=True)
             for k in range(3)]
    outs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    every = [ts for out in outs for ts in out]
    assert len(every) == 120 and len(set(every)) == 120 and all(TS_RE.match(t) for t in every)
    for out in outs:                                   # each writer sees its own posts strictly increasing
        assert [by_value(t) for t in out] == sorted(by_value(t) for t in out)
    stored = [m["ts"] for m in chat.messages(db, "c")][1:]
    assert stored == sorted(every, key=by_value)       # the channel's order is the ts order
    assert chat.parse_ts("0") == 0 and chat.parse_ts("12.5") == 12_500_000 and chat.parse_ts("1.000001") == 1_000_001
    for bad in ("", "abc", "1.1234567", "-1", "1e3"):
        with pytest.raises(ValueError):
            chat.parse_ts(bad)


# ---------------------------------------------------------------- flaky_server

READ_ONLY = {"echo", "text_json", "plain_text", "empty", "fail_ro", "hang_ro", "crash_ro", "invalid_params", "big",
             "secret_echo", "retry_after"}
READ_WRITE = {"write", "fail_rw", "hang_rw", "crash_rw"}


async def test_flaky_tools_behave_as_named_over_stdio(tmp_path):
    log = tmp_path / "calls.jsonl"

    async def open_slow_starter() -> None:
        async with Client(flaky_params("--slow-start", "30"), read_timeout_seconds=10):
            raise AssertionError("opened despite --slow-start 30")

    slow = asyncio.create_task(open_slow_starter())     # started alongside the child below
    params = flaky_params("--calls-log", str(log), env={"FLAKY_SECRET": "hunter2-secret"})
    async with Client(params, read_timeout_seconds=10) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        assert set(tools) == READ_ONLY | READ_WRITE
        for name, t in tools.items():
            assert t.annotations.read_only_hint is (name in READ_ONLY), name
            assert t.input_schema["type"] == "object" and t.input_schema["additionalProperties"] is False
        assert tools["echo"].input_schema["required"] == ["text"]
        assert tools["invalid_params"].input_schema["required"] == ["x"]
        assert tools["retry_after"].input_schema["required"] == ["ms"]

        r = await c.call_tool("echo", {"text": "hi", "n": 3})
        assert (r.is_error, r.structured_content) == (False, {"echo": "hi", "n": 3})
        assert (await c.call_tool("echo", {"text": "hi"})).structured_content == {"echo": "hi", "n": None}
        assert (await c.call_tool("write", {"text": "w"})).structured_content == {"written": "w"}

        r = await c.call_tool("text_json", {"text": "t"})
        assert r.structured_content is None and json.loads(r.content[0].text)["text"] == "t"
        r = await c.call_tool("plain_text", {})
        assert r.structured_content is None and len(r.content) == 1
        with pytest.raises(json.JSONDecodeError):
            json.loads(r.content[0].text)
        r = await c.call_tool("empty", {})
        assert (r.is_error, r.content, r.structured_content) == (False, [], None)

        for name in ("fail_ro", "fail_rw"):
            r = await c.call_tool(name, {"text": "why"})
            assert r.is_error and "why" in r.content[0].text

        with pytest.raises(MCPError) as err:
            await c.call_tool("invalid_params", {"x": 42})
        assert err.value.code == INVALID_PARAMS and err.value.data == {"field": "x"} and "42" in err.value.message

        r = await c.call_tool("big", {})
        assert len(json.dumps(r.structured_content)) > 1.2 * 1024 * 1024
        assert r.structured_content["size"] == len(r.structured_content["data"])

        r = await c.call_tool("secret_echo", {"text": "show me"})
        assert r.structured_content == {"args": {"text": "show me"}, "secret": "hunter2-secret"}
        assert "hunter2-secret" in r.content[0].text

        r = await c.call_tool("retry_after", {"ms": 1234})
        assert r.is_error and r.meta["retry_after_ms"] == 1234 and r.structured_content["retry_after_ms"] == 1234

        # No server-side argument validation: the client's own checks are what a test observes.
        assert (await c.call_tool("write", {"text": "w", "bogus": True})).structured_content == {"written": "w"}

        with pytest.raises(MCPError) as err:
            await c.call_tool("hang_rw", {}, read_timeout_seconds=0.3)
        assert err.value.code == REQUEST_TIMEOUT
        assert (await c.call_tool("echo", {"text": "still alive"})).structured_content["echo"] == "still alive"
        with pytest.raises(MCPError) as err:
            await c.call_tool("crash_rw", {"text": "once"})
        assert err.value.code == CONNECTION_CLOSED
        with pytest.raises(MCPError) as err:
            await c.call_tool("echo", {"text": "after the crash"})
        assert err.value.code == CONNECTION_CLOSED

    # The child started at the same moment answered everything above; the slow starter is still asleep.
    assert not slow.done()
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow

    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert logged[0] == {"tool": "echo", "arguments": {"text": "hi", "n": 3}}
    assert logged[-4:] == [{"tool": "write", "arguments": {"text": "w", "bogus": True}},
                           {"tool": "hang_rw", "arguments": {}}, {"tool": "echo", "arguments": {"text": "still alive"}},
                           {"tool": "crash_rw", "arguments": {"text": "once"}}]           # logged before it acts
    assert [e["tool"] for e in logged].count("fail_rw") == 1 and len(logged) == 16


async def test_flaky_exit_at_start_fails_the_open():
    started = time.monotonic()
    with pytest.raises(BaseException) as err:
        async with Client(flaky_params("--exit-at-start"), read_timeout_seconds=10):
            pass
    assert any(isinstance(e, MCPError) and e.code == CONNECTION_CLOSED for e in leaf_errors(err.value))
    assert time.monotonic() - started < 5


async def test_flaky_over_streamable_http_with_429_and_crash(http_servers):
    url = http_servers["flaky"].url()
    seen: list[tuple[int, str | None]] = []

    async def on_response(resp: httpx2.Response) -> None:
        seen.append((resp.status_code, resp.headers.get("retry-after")))

    async with httpx2.AsyncClient(event_hooks={"response": [on_response]}) as http:
        # Pinned to 2026-07-28 there is no handshake: the first POST is call_tool's implicit tools/list.
        async with Client(streamable_http_client(url, http_client=http), mode="2026-07-28",
                          read_timeout_seconds=10) as c:
            for n in (1, 2):
                with pytest.raises(MCPError) as err:
                    await c.call_tool("echo", {"text": "a"})
                assert err.value.code == INTERNAL_ERROR               # a 429 becomes a generic -32603 ...
                assert seen == [(429, "2")] * n                       # ... Retry-After only via the HTTP client
        # mode="auto": a 429 on the server/discover probe silently falls back to the legacy handshake.
        async with Client(streamable_http_client(url, http_client=http), read_timeout_seconds=10) as c:
            assert seen[:3] == [(429, "2")] * 3 and seen[3][0] == 200 and c.protocol_version == "2025-11-25"
            r = await c.call_tool("echo", {"text": "c"})
            assert r.structured_content == {"echo": "c", "n": None} and seen[-1] == (200, None)
            assert (await c.call_tool("fail_rw", {"text": "x"})).is_error
            with pytest.raises(MCPError) as err:
                await c.call_tool("invalid_params", {"x": 1})
            assert err.value.code == INVALID_PARAMS

    # A crash mid-call, with the client held open by its own task (as a long-lived caller does):
    # the caller gets "connection closed", the holder's task group ends with the HTTP error.
    async with held_client(url, mode="2026-07-28", read_timeout_seconds=10) as (c, holder):
        assert (await c.call_tool("echo", {"text": "x"})).structured_content["echo"] == "x"
        with pytest.raises(MCPError) as err:
            await c.call_tool("crash_ro", {})
        assert err.value.code == CONNECTION_CLOSED
    assert any(isinstance(e, httpx2.RemoteProtocolError) for e in leaf_errors(holder["error"]))
