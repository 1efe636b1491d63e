"""The MCP server over streamable HTTP and SSE (the real app) and over stdio (a real subprocess)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys

import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client

import interactiond as itd
from daemon_kit import APPROVAL, watching_waits

INPUT = {"owner": "ana", "review": "Looks complete."}


@contextlib.asynccontextmanager
async def connect(d, transport: str, role: str = "operator", mode: str = "auto"):
    url = str(d.client.make_url("/mcp" if transport == "http" else "/sse"))
    headers = d.auth(role) if role else {}
    if transport == "http":
        async with httpx2.AsyncClient(headers=headers, timeout=30) as http:
            async with Client(streamable_http_client(url, http_client=http), mode=mode) as c:
                yield c
    else:
        async with Client(sse_client(url, headers=headers), mode="legacy") as c:
            yield c


async def inbox_life(c):
    r = await c.call_tool("create_definition", {"name": "approve", "source": APPROVAL})
    assert not r.is_error, r
    assert r.structured_content["version"] == 1
    r = await c.call_tool("run_definition", {"name": "approve", "input": INPUT})
    assert not r.is_error and r.structured_content["status"] == "started"
    run_id = r.structured_content["run_id"]
    r = await c.call_tool("list_interactions", {"to": "ana"})
    assert [x["run_id"] for x in r.structured_content["data"]] == [run_id]
    r = await c.call_tool("answer_interaction", {"run_id": run_id, "answer": {"verdict": "maybe"}})
    assert r.is_error and r.structured_content["type"] == "/problems/invalid_input"
    assert [e["pointer"] for e in r.structured_content["errors"]] == ["/answer/verdict"]
    r = await c.call_tool("answer_interaction", {"run_id": run_id, "answer": {"verdict": "approve"}})
    assert not r.is_error and r.structured_content["answer"] == {"verdict": "approve"}
    r = await c.call_tool("get_run", {"run_id": run_id})
    assert r.structured_content["status"] == "succeeded"
    assert r.structured_content["output"] == {"verdict": "approve"}
    assert json.loads(r.content[0].text) == r.structured_content


@pytest.mark.parametrize("transport,mode", [("http", "auto"), ("http", "legacy"), ("sse", "legacy")])
async def test_inbox_life_over_http_transports(d, transport, mode):
    async with connect(d, transport, mode=mode) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        assert {"create_definition", "run_definition", "wait_run", "ask", "search", "execute"} <= set(tools)
        assert tools["get_run"].annotations.read_only_hint is True
        assert "playbook" in tools["run_definition"].input_schema["properties"]
        assert all(t.description and len(t.description) > 40 for t in tools.values())
        await inbox_life(c)


async def test_arguments_are_checked(d):
    async with connect(d, "http") as c:
        r = await c.call_tool("get_run", {"run_id": 5, "bogus": True})
        assert r.is_error and r.structured_content["type"] == "/problems/invalid_request"
        assert {e["pointer"] for e in r.structured_content["errors"]} >= {"/run_id"}
        r = await c.call_tool("get_run", {"run_id": "nope"})
        assert r.is_error and r.structured_content["status"] == 404


async def test_http_transports_need_a_token(d):
    resp = await d.client.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert resp.status == 401
    resp = await d.client.get("/sse")
    assert resp.status == 401
    with pytest.raises(Exception):
        async with connect(d, "http", role=None) as c:
            await c.list_tools()


async def test_token_bound_to_another_playbook_sees_nothing(d):
    async with connect(d, "http") as c:
        r = await c.call_tool("create_definition", {"name": "approve", "source": APPROVAL})
        run = (await c.call_tool("run_definition", {"name": "approve", "input": INPUT})).structured_content
    async with connect(d, "http", role="other") as c:
        r = await c.call_tool("get_run", {"run_id": run["run_id"]})
        assert r.is_error and r.structured_content["status"] == 404
        r = await c.call_tool("get_run", {"run_id": run["run_id"], "playbook": "local/default"})
        assert r.is_error and r.structured_content["status"] == 404


async def test_ask_and_wait_run(d):
    async with connect(d, "http") as c:
        names = {x["name"] for x in (await c.call_tool("list_definitions", {})).structured_content["data"]}
        assert {"ask-approval", "ask-text", "ask-choice", "ask-confirmation"} <= names
        r = await c.call_tool("ask", {"type": "choice", "prompt": "Which **colour**?", "to": "bo",
                                      "options": [{"id": "red", "label": "Red"}, {"id": "blue", "label": "Blue"}]})
        assert not r.is_error, r.structured_content
        run_id = r.structured_content["run_id"]
        req = (await c.call_tool("list_interactions", {"to": "bo"})).structured_content["data"][0]
        assert req["answer_schema"]["properties"]["option_ids"]["items"]["enum"] == ["red", "blue"]
        assert req["answer_schema"]["properties"]["option_ids"]["maxItems"] == 1
        bad = await c.call_tool("answer_interaction", {"run_id": run_id, "answer": {"option_ids": ["green"]}})
        assert bad.is_error

        progress = []

        async def on_progress(p, total, message):
            progress.append(message)

        with watching_waits(d) as parked:
            waiting = asyncio.create_task(c.call_tool("wait_run", {"run_id": run_id, "max_wait": 30},
                                                      progress_callback=on_progress))
            await asyncio.wait_for(parked.wait(), 10)
        assert not waiting.done()
        ok = await c.call_tool("answer_interaction", {"run_id": run_id, "answer": {"option_ids": ["blue"]}})
        assert not ok.is_error
        r = await asyncio.wait_for(waiting, 10)
        assert r.structured_content["status"] == "succeeded"
        assert r.structured_content["output"] == {"option_ids": ["blue"]}

        r = await c.call_tool("wait_run", {"run_id": run_id, "max_wait": -1})
        assert r.is_error and r.structured_content["errors"][0]["pointer"] == "/max_wait"
        # Longer than one call waits is cut to the longest, and the result says so (an ended run: at once).
        r = await c.call_tool("wait_run", {"run_id": run_id, "timeout": 3601})
        assert not r.is_error and r.structured_content["status"] == "succeeded"
        assert "cut to 3600 s" in r.content[-1].text


async def test_wait_run_returns_the_run_as_it_stands_and_reports_progress(d, monkeypatch):
    monkeypatch.setattr(itd, "MCP_HEARTBEAT_S", 1.0)          # 15 s of real time in the product
    async with connect(d, "http") as c:
        r = await c.call_tool("ask", {"type": "confirmation", "prompt": "Deploy?", "to": "ana"})
        run_id = r.structured_content["run_id"]
        progress = []

        async def on_progress(p, total, message):
            progress.append((p, total, message))
        r = await c.call_tool("wait_run", {"run_id": run_id, "max_wait": 2.5}, progress_callback=on_progress)
        assert r.structured_content["status"] == "waiting"
        assert len(progress) >= 2, "a long wait sends a heartbeat every MCP_HEARTBEAT_S"
        waited, total, message = progress[0]
        assert 0.9 <= waited <= total <= 3 and progress[1][0] > waited
        until = itd.fmt_time(d.clock.now_ms() + 24 * 3600 * 1000)
        assert message.startswith(f"waiting for ana until {until}; ")


def _stdio_params(db: str, cwd, *extra: str) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable, args=["-m", "interactiond", "stdio", "--db", db, *extra],
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=str(cwd))


async def test_stdio_as_a_desktop_agent_starts_it(db, tmp_path):
    async with Client(_stdio_params(db, tmp_path), read_timeout_seconds=30) as c:
        tools = {t.name for t in (await c.list_tools()).tools}
        assert "answer_interaction" in tools
        await inbox_life(c)


async def test_stdio_scoped_to_a_playbook(db, tmp_path):
    async with Client(_stdio_params(db, tmp_path, "--playbook", "local/default"), read_timeout_seconds=30) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        assert "playbook" not in tools["run_definition"].input_schema["properties"]
        await inbox_life(c)
