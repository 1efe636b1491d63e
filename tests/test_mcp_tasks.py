"""Durable MCP Tasks (SPEC section 23): a tools/call of a client that declares the Tasks extension
answers with a task that is the run; tasks/get, tasks/update, tasks/cancel and subscriptions/listen
read and move it from the store, so it outlives the client's connection and the daemon.

The official `mcp` client speaks to the daemon over streamable HTTP (the real app, on SQLite and on
PostgreSQL) and over stdio (a real `interactiond stdio` subprocess). It declares the extension as
the SDK does (`Client(extensions=[...])` puts it in each request's `_meta`), parses the task handle
through a result claim, and sends the extension's methods as requests of its own (tasks_client.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp import types as mt
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

import interactiond as itd
from daemon_kit import APPROVAL, fresh_postgres, person_token, start_daemon, until
from raw_jsonrpc import RawError, RawStdio
from tasks_client import TASKS, TasksClient, rpc

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}

ASK = {"type": "approval", "prompt": "May I ship the brief?", "to": "ana", "expires": "PT2H"}
INPUT = {"owner": "ana", "review": "Looks complete."}


@contextlib.asynccontextmanager
async def http_client(d, *, tasks: bool = True, role: str = "operator", token: str | None = None,
                      headers: dict[str, str] | None = None, elicits: bool = False, mode: str = "auto",
                      ext: TasksClient | None = None):
    auth = {"Authorization": f"Bearer {token}"} if token else d.auth(role)
    async with httpx2.AsyncClient(headers={**auth, **(headers or {})}, timeout=30) as http:
        target = streamable_http_client(str(d.client.make_url("/mcp")), http_client=http)
        async with Client(target, mode=mode, read_timeout_seconds=30,
                          extensions=[ext or TasksClient()] if tasks else None,
                          elicitation_callback=_never if elicits else None) as c:
            yield c


@contextlib.asynccontextmanager
async def stdio_client(db: str, cwd: Path, *, extra: tuple[str, ...] = (), elicits: bool = False):
    target = StdioServerParameters(command=sys.executable, args=["-m", "interactiond", "stdio", "--db", db, *extra],
                                   env=ENV, cwd=str(cwd))
    async with Client(target, mode="auto", read_timeout_seconds=30, extensions=[TasksClient()],
                      elicitation_callback=_never if elicits else None) as c:
        yield c


async def _never(ctx: Any, params: Any) -> mt.ElicitResult:
    raise AssertionError("a task asks through tasks/get, never over the session")


async def start_task(c, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    """Call a tool and return the task handle it answers with (the claimed CreateTaskResult)."""
    out = await c.session.call_tool(tool, args, allow_claimed=True)
    assert not isinstance(out, mt.CallToolResult), f"{tool} did not answer with a task: {out}"
    return out.model_dump(by_alias=True, mode="json", exclude_none=True)


# The task, over HTTP on both backends #############################################################

async def test_ask_answers_with_a_task_that_completes_with_the_run(db, aiohttp_client):
    d = await start_daemon(aiohttp_client, db)
    async with http_client(d) as c:
        task = await start_task(c, "ask", ASK)
        assert task["resultType"] == "task" and task["status"] == "working"
        run_id = task["taskId"]
        assert task["pollIntervalMs"] == 2000
        assert task["ttlMs"] == (2 + 24) * 3600 * 1000               # to the request's expiry, plus a day
        assert task["createdAt"] == itd.fmt_time(d.clock.now_ms())
        status, run = await d.call("GET", f"/runs/{run_id}")         # durable before the reply: the run
        assert status == 200 and run["status"] == "waiting"
        got = await rpc(c, "tasks/get", taskId=run_id)
        assert got["status"] == "working" and got["resultType"] == "complete"
        assert got["statusMessage"] == f"waiting for ana until {itd.fmt_time(d.clock.now_ms() + 2 * 3600 * 1000)}"
        assert "result" not in got and "inputRequests" not in got
        status, _ = await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"approved": True}})
        assert status == 200
        done = await rpc(c, "tasks/get", taskId=run_id)
        assert done["status"] == "completed", done
        result = done["result"]
        assert result["isError"] is False and result["structuredContent"]["status"] == "succeeded"
        assert result["structuredContent"]["output"] == {"approved": True}
        # the same as the blocking call returns
        blocking = await c.call_tool("wait_run", {"run_id": run_id}, meta={})
        assert blocking.structured_content == result["structuredContent"]
        assert (await c.call_tool("wait_run", {"run_id": run_id})).structured_content["status"] == "succeeded"


async def test_every_ending_is_a_completed_task_and_its_own_cancel_is_cancelled(db, aiohttp_client):
    d = await start_daemon(aiohttp_client, db)
    async with http_client(d) as c:
        await c.call_tool("create_definition", {"name": "approve", "source": APPROVAL})
        expiring = (await start_task(c, "run_definition", {"name": "approve", "input": INPUT}))["taskId"]
        others = (await start_task(c, "ask", ASK))["taskId"]
        mine = (await start_task(c, "ask", ASK))["taskId"]
        r = await c.call_tool("cancel_run", {"run_id": others})              # a cancel by other means
        assert not r.is_error
        assert await rpc(c, "tasks/cancel", taskId=mine) == {"resultType": "complete"}
        await d.advance("P3D")                                               # the request expires
        got = await rpc(c, "tasks/get", taskId=expiring)
        assert got["status"] == "completed" and got["result"]["isError"] is True
        assert got["result"]["structuredContent"]["kind"] == "expired"
        got = await rpc(c, "tasks/get", taskId=others)
        assert got["status"] == "completed" and got["result"]["structuredContent"]["kind"] == "cancelled"
        got = await rpc(c, "tasks/get", taskId=mine)
        assert got["status"] == "cancelled" and "result" not in got
        status, run = await d.call("GET", f"/runs/{mine}")
        assert run["status"] == "rejected" and run["kind"] == "cancelled"
        assert await rpc(c, "tasks/cancel", taskId=mine) == {"resultType": "complete"}   # again: still acknowledged


async def test_a_client_that_does_not_declare_gets_todays_results_and_32021(db, aiohttp_client):
    d = await start_daemon(aiohttp_client, db)
    async with http_client(d, tasks=False) as c:
        r = await c.call_tool("ask", ASK)
        assert isinstance(r, mt.CallToolResult) and r.structured_content["status"] == "started"
        run_id = r.structured_content["run_id"]
        r = await c.call_tool("wait_run", {"run_id": run_id, "timeout": 0})
        assert r.structured_content["status"] == "waiting"
        for method, extra in (("tasks/get", {}), ("tasks/cancel", {}), ("tasks/update", {"inputResponses": {}})):
            with pytest.raises(MCPError) as err:
                await rpc(c, method, taskId=run_id, **extra)
            assert err.value.error.code == -32021, method
            assert err.value.error.data == {"requiredCapabilities": {"extensions": {TASKS: {}}}}
    async with http_client(d) as c:                  # the extension is advertised
        assert TASKS in (c.server_capabilities.extensions or {})


async def test_wait_run_answers_with_the_task_at_once_and_an_ended_run_as_today(db, aiohttp_client):
    d = await start_daemon(aiohttp_client, db)
    async with http_client(d, tasks=False) as plain:
        run_id = (await plain.call_tool("ask", ASK)).structured_content["run_id"]
    async with http_client(d) as c:
        task = await start_task(c, "wait_run", {"run_id": run_id, "timeout": 3600})
        assert task["taskId"] == run_id and task["status"] == "working"
        await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"approved": False, "comment": "not yet"}})
        r = await c.session.call_tool("wait_run", {"run_id": run_id}, allow_claimed=True)
        assert isinstance(r, mt.CallToolResult) and r.structured_content["output"]["comment"] == "not yet"


async def test_scoped_to_what_the_token_may_read(db, aiohttp_client):
    d = await start_daemon(aiohttp_client, db)
    async with http_client(d, role="writer") as c:
        run_id = (await start_task(c, "ask", ASK))["taskId"]
        bob = (await start_task(c, "ask", dict(ASK, to="bob")))["taskId"]
        other_pb = (await start_task(c, "ask", dict(ASK, playbook="local/default")))["taskId"]
        assert other_pb != run_id
        with pytest.raises(MCPError) as err:
            await rpc(c, "tasks/get", taskId="no-such-run")
        assert err.value.error.code == -32602
    async with http_client(d, role="reader") as c:          # another token of the playbook may read it
        assert (await rpc(c, "tasks/get", taskId=run_id))["status"] == "working"
        with pytest.raises(MCPError) as err:
            await rpc(c, "tasks/cancel", taskId=run_id)    # but not cancel it
        assert err.value.error.code == -32602
    async with http_client(d, role="other") as c:           # another playbook's token sees nothing
        for tid in (run_id, f"local/default/{run_id}"):
            with pytest.raises(MCPError) as err:
                await rpc(c, "tasks/get", taskId=tid)
            assert err.value.error.code == -32602, tid
    async with http_client(d, role="operator") as c:        # the operator's home is local/default too
        assert (await rpc(c, "tasks/get", taskId=f"local/default/{run_id}"))["taskId"] == run_id
    token = person_token(db, "ana")
    async with http_client(d, token=token) as c:            # a person: their own run, not bob's
        assert (await rpc(c, "tasks/get", taskId=run_id))["status"] in ("working", "input_required")
        with pytest.raises(MCPError) as err:
            await rpc(c, "tasks/get", taskId=bob)
        assert err.value.error.code == -32602


# Durable: the client leaves, the daemon restarts ###################################################

async def test_a_task_outlives_the_client_and_the_daemon(db, aiohttp_client):
    d = await start_daemon(aiohttp_client, db)
    async with http_client(d) as c:
        task = await start_task(c, "ask", ASK)
    tokens = d.tokens
    await d.client.close()
    await d.engine.stop()
    d2 = await start_daemon(aiohttp_client, db, tokens=tokens, clock=itd.ManualClock(d.clock.now_ms()))
    status, _ = await d2.call("POST", f"/runs/{task['taskId']}/answer", {"answer": {"approved": True}})
    assert status == 200
    async with http_client(d2) as c:
        got = await rpc(c, "tasks/get", taskId=task["taskId"])
        assert got["status"] == "completed" and got["result"]["structuredContent"]["output"] == {"approved": True}
        assert got["createdAt"] == task["createdAt"]


async def test_over_stdio_a_task_outlives_the_process(tmp_path):
    db = str(tmp_path / "t.db")
    async with stdio_client(db, tmp_path) as c:
        task = await start_task(c, "ask", ASK)
        assert (await rpc(c, "tasks/get", taskId=task["taskId"]))["status"] == "working"
    async with stdio_client(db, tmp_path) as c:                # a new process: the client reconnects
        assert (await rpc(c, "tasks/get", taskId=task["taskId"]))["status"] == "working"
        r = await c.call_tool("answer_interaction", {"run_id": task["taskId"], "answer": {"approved": True}})
        assert not r.is_error
    async with stdio_client(db, tmp_path) as c:
        got = await rpc(c, "tasks/get", taskId=task["taskId"])
        assert got["status"] == "completed" and got["result"]["structuredContent"]["status"] == "succeeded"


async def test_through_stdios_relay_to_a_serving_daemon_the_task_is_the_daemons_run(tmp_path):
    """`stdio` beside a running `serve` relays: a declaring client's call and its tasks/* go up as they
    came, so the task is the serving daemon's run and outlives the relay."""
    import subprocess
    serve = subprocess.Popen([sys.executable, "-m", "interactiond", "serve", "--port", "0", "--clock", "manual",
                              "--host", "127.0.0.1"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=ENV)
    try:
        for line in serve.stdout:
            if line.startswith("inbox:"):
                break
        db = str(tmp_path / "interactiond.db")
        async with stdio_client(db, tmp_path) as c:
            assert TASKS in (c.server_capabilities.extensions or {})
            task = await start_task(c, "ask", ASK)
            assert task["status"] == "working"
            got = await rpc(c, "tasks/get", taskId=task["taskId"])
            assert got["status"] == "working" and got["statusMessage"].startswith("waiting for ana")
        target = StdioServerParameters(command=sys.executable, args=["-m", "interactiond", "stdio", "--db", db],
                                       env=ENV, cwd=str(tmp_path))
        async with Client(target, mode="auto", read_timeout_seconds=30) as plain:     # not declaring: as today
            r = await plain.call_tool("wait_run", {"run_id": task["taskId"], "timeout": 0.1})
            assert r.structured_content["status"] == "waiting"
        async with stdio_client(db, tmp_path) as c:                # a new relay: the same task
            r = await c.call_tool("answer_interaction", {"run_id": task["taskId"], "answer": {"approved": True}})
            assert not r.is_error, r
            got = await rpc(c, "tasks/get", taskId=task["taskId"])
            assert got["status"] == "completed" and got["result"]["structuredContent"]["output"] == {"approved": True}
            with pytest.raises(MCPError) as info:
                await rpc(c, "tasks/get", taskId="run_00000000000000000000000000")
            assert info.value.error.code == -32602
    finally:
        serve.terminate()
        serve.wait(timeout=30)


# A question for the person at the client: input_required, tasks/update ##########################

def _as_ana() -> Any:
    return itd.Config(playbooks={"local/default": (), "acme/other": ()}, mcp_as="ana")


async def test_input_required_asks_the_person_here_and_update_answers_as_them(db, aiohttp_client):
    d = await start_daemon(aiohttp_client, db, config=_as_ana())
    async with http_client(d, elicits=True) as c:
        bob = (await start_task(c, "ask", dict(ASK, to="bob")))["taskId"]
        assert (await rpc(c, "tasks/get", taskId=bob))["status"] == "working"      # not the person here
        task = await start_task(c, "ask", ASK)
        run_id = task["taskId"]
        assert task["status"] == "input_required" and "inputRequests" not in task
        got = await rpc(c, "tasks/get", taskId=run_id)
        assert got["status"] == "input_required"
        [(key, asked)] = got["inputRequests"].items()
        assert asked["method"] == "elicitation/create" and asked["params"]["mode"] == "form"
        assert asked["params"]["message"] == "May I ship the brief?"
        assert asked["params"]["requestedSchema"]["properties"]["approved"]["type"] == "boolean"
        assert asked["params"]["requestedSchema"]["required"] == ["approved"]
        assert (await rpc(c, "tasks/get", taskId=run_id))["inputRequests"] == got["inputRequests"]   # same key
        # a key not outstanding is ignored
        assert await rpc(c, "tasks/update", taskId=run_id,
                         inputResponses={"int_x.1": {"action": "accept", "content": {"approved": True}}}) \
            == {"resultType": "complete"}
        assert (await rpc(c, "tasks/get", taskId=run_id))["inputRequests"] == got["inputRequests"]
        # an answer that does not fit is asked again under a new key, with the daemon's words
        await rpc(c, "tasks/update", taskId=run_id,
                  inputResponses={key: {"action": "accept", "content": {"approved": "yes"}}})
        again = await rpc(c, "tasks/get", taskId=run_id)
        [(key2, asked2)] = again["inputRequests"].items()
        assert key2 != key and "That answer was not taken" in asked2["params"]["message"]
        assert "(ask 2 of 3)" in asked2["params"]["message"]
        await rpc(c, "tasks/update", taskId=run_id,                         # the spent key: ignored
                  inputResponses={key: {"action": "accept", "content": {"approved": True}}})
        assert (await rpc(c, "tasks/get", taskId=run_id))["status"] == "input_required"
        await rpc(c, "tasks/update", taskId=run_id,
                  inputResponses={key2: {"action": "accept", "content": {"approved": True, "comment": "go"}}})
        done = await rpc(c, "tasks/get", taskId=run_id)
        assert done["status"] == "completed", done
        run = done["result"]["structuredContent"]
        assert run["output"] == {"approved": True, "comment": "go"} and run["settled_by"] == "ana"
        events = (await c.call_tool("list_run_events", {"run_id": run_id})).structured_content["data"]
        refused = [e for e in events if e["type"] == "elicitation_refused"]
        assert len(refused) == 1 and refused[0]["by"] == "ana" and refused[0]["payload"]["key"] == key


async def test_decline_leaves_the_request_open_and_asks_no_more(db, aiohttp_client):
    d = await start_daemon(aiohttp_client, db, config=_as_ana())
    async with http_client(d, elicits=True) as c:
        run_id = (await start_task(c, "ask", ASK))["taskId"]
        [key] = (await rpc(c, "tasks/get", taskId=run_id))["inputRequests"]
        await rpc(c, "tasks/update", taskId=run_id, inputResponses={key: {"action": "decline"}})
        got = await rpc(c, "tasks/get", taskId=run_id)
        assert got["status"] == "working" and "inputRequests" not in got
        status, run = await d.call("GET", f"/runs/{run_id}")
        assert run["status"] == "waiting"
        events = (await c.call_tool("list_run_events", {"run_id": run_id})).structured_content["data"]
        assert [e["payload"]["action"] for e in events if e["type"] == "elicitation_declined"] == ["decline"]
        await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"approved": False}})
        assert (await rpc(c, "tasks/get", taskId=run_id))["status"] == "completed"
    async with http_client(d) as c:              # a client that cannot ask sees a working task
        run_id = (await start_task(c, "ask", ASK))["taskId"]
        assert (await rpc(c, "tasks/get", taskId=run_id))["status"] == "working"


#: A plan whose answer nests an object: no MCP form can hold it, so the task asks with its answer link.
PLAN = """---
to: '{{ input.owner }}'
expires: P1D
input:
  schema: {type: object, required: [owner], properties: {owner: {type: string}}}
output:
  schema:
    type: object
    required: [budget]
    properties:
      budget: {type: object, required: [amount], properties: {amount: {type: integer}}}
---
Set the budget of the launch, {{ input.owner }}.
"""


async def test_an_answer_no_form_holds_is_asked_with_its_answer_link(db, aiohttp_client):
    d = await start_daemon(aiohttp_client, db, config=_as_ana())
    async with http_client(d, elicits=True) as c:
        await c.call_tool("create_definition", {"name": "plan", "source": PLAN})
        run_id = (await start_task(c, "run_definition", {"name": "plan", "input": {"owner": "ana"}}))["taskId"]
        [item] = (await c.call_tool("list_interactions", {"to": "ana"})).structured_content["data"]
        got = await rpc(c, "tasks/get", taskId=run_id)
        [(key, asked)] = got["inputRequests"].items()
        assert asked["params"]["mode"] == "url" and asked["params"]["url"] == item["answer_url"]
        assert "Set the budget of the launch, ana." in asked["params"]["message"]
        await rpc(c, "tasks/update", taskId=run_id, inputResponses={key: {"action": "accept"}})   # she opened it
        assert (await rpc(c, "tasks/get", taskId=run_id))["inputRequests"] == got["inputRequests"]
        status, _ = await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"budget": {"amount": 5}}})
        assert status == 200
        done = await rpc(c, "tasks/get", taskId=run_id)
        assert done["status"] == "completed" and done["result"]["structuredContent"]["output"] == {"budget": {"amount": 5}}


async def test_over_stdio_the_person_named_answers_through_the_task(tmp_path):
    db = str(tmp_path / "t.db")
    async with stdio_client(db, tmp_path, extra=("--as", "ana"), elicits=True) as c:
        run_id = (await start_task(c, "ask", dict(ASK, type="text", placeholder="a name")))["taskId"]
        got = await rpc(c, "tasks/get", taskId=run_id)
        [(key, asked)] = got["inputRequests"].items()
        assert asked["params"]["requestedSchema"]["properties"]["text"]["type"] == "string"
        await rpc(c, "tasks/update", taskId=run_id, inputResponses={key: {"action": "accept", "content": {"text": "Luca"}}})
        done = await rpc(c, "tasks/get", taskId=run_id)
        assert done["status"] == "completed" and done["result"]["structuredContent"]["output"] == {"text": "Luca"}


async def test_execute_of_a_gated_tool_is_a_task_until_approved_and_called(db, tmp_path, aiohttp_client):
    log = tmp_path / "ops-calls.jsonl"
    ops = (sys.executable, str(ROOT / "tests" / "servers" / "ops_server.py"), "--calls-log", str(log))
    policy = itd.ApprovalPolicy(("restart_service",), "ops-oncall", itd.parse_duration("PT1H"))
    config = itd.Config(servers={"ops": itd.ServerConfig("ops", command=ops, approve=policy)},
                        playbooks={"local/default": ("ops",), "acme/other": ()})
    d = await start_daemon(aiohttp_client, db, config=config)
    async with http_client(d, role="writer") as c:
        r = await c.session.call_tool("execute", {"server": "ops", "tool": "status", "arguments": {"service": "web"}},
                                      allow_claimed=True)
        assert isinstance(r, mt.CallToolResult) and not r.is_error          # not gated: its answer, as today
        task = await start_task(c, "execute", {"server": "ops", "tool": "restart_service",
                                               "arguments": {"service": "web"}})
        assert task["status"] == "working" and task["statusMessage"].startswith("waiting for ops-oncall until ")
        assert not log.exists() or "restart_service" not in log.read_text()
        status, _ = await d.call("POST", f"/runs/{task['taskId']}/answer", {"answer": {"approved": True}})
        assert status == 200

        async def done() -> dict[str, Any]:
            got = await rpc(c, "tasks/get", taskId=task["taskId"])
            return got if got["status"] == "completed" else {}
        got = await until(done, 20, "the approved call ends its run")
        assert got["result"]["structuredContent"]["output"]["answer"]["status"] == "restarted web"


# subscriptions/listen: notifications/tasks #########################################################

async def test_listen_sends_the_whole_task_at_each_change(db, aiohttp_client):
    d = await start_daemon(aiohttp_client, db, config=_as_ana())
    ext = TasksClient()
    async with http_client(d, elicits=True, ext=ext) as c:
        run_id = (await start_task(c, "ask", ASK))["taskId"]
        other = (await start_task(c, "ask", dict(ASK, to="bob")))["taskId"]
        listening = asyncio.ensure_future(rpc(c, "subscriptions/listen",
                                              notifications={"taskIds": [run_id, other, "no-such-run"]}))
        await until(lambda: len(ext.notified) >= 2, 10, "the first notifications")
        first = {n["taskId"]: n for n in ext.notified}
        assert first[run_id]["status"] == "input_required" and first[other]["status"] == "working"
        assert first[run_id]["inputRequests"] == (await rpc(c, "tasks/get", taskId=run_id))["inputRequests"]
        [key] = first[run_id]["inputRequests"]
        await rpc(c, "tasks/update", taskId=run_id, inputResponses={key: {"action": "accept", "content": {"approved": True}}})
        await d.call("POST", f"/runs/{other}/answer", {"answer": {"approved": False}})
        await asyncio.wait_for(listening, 10)         # every task it listens to has ended: the stream ends
        last = {n["taskId"]: n for n in ext.notified}
        assert last[run_id]["status"] == "completed" and last[run_id]["result"]["structuredContent"]["output"] == {"approved": True}
        assert last[other]["status"] == "completed"
        assert len(ext.notified) == 4 and "no-such-run" not in last
    async with http_client(d, tasks=False) as c:
        with pytest.raises(MCPError) as err:
            await rpc(c, "subscriptions/listen", notifications={"taskIds": [run_id]})
        assert err.value.error.code == -32021


# The 2025-11-25 era's experimental tasks (params.task) ############################################

@contextlib.asynccontextmanager
async def legacy_stdio(db: str, cwd: Path):
    raw = await RawStdio.start(sys.executable, "-m", "interactiond", "stdio", "--db", db, env=ENV, cwd=str(cwd))
    try:
        init = await raw.initialize("2025-11-25", {"tasks": {"requests": {}}})
        raw.capabilities = init["capabilities"]
        yield raw
    finally:
        await raw.close()


async def test_the_2025_11_25_experimental_tasks_are_the_same_runs(tmp_path):
    db = str(tmp_path / "t.db")
    async with legacy_stdio(db, tmp_path) as raw:
        assert raw.capabilities["tasks"]["requests"]["tools"]["call"] == {}
        assert "list" in raw.capabilities["tasks"] and "cancel" in raw.capabilities["tasks"]
        tools = {t["name"]: t for t in (await raw.request("tools/list"))["tools"]}
        assert tools["ask"]["execution"] == {"taskSupport": "optional"} and "execution" not in tools["get_run"]
        created = await raw.request("tools/call", {"name": "ask", "arguments": ASK, "task": {"ttl": 60000}})
        task = created["task"]
        assert task["status"] == "working" and task["pollInterval"] == 2000 and task["ttl"] == 26 * 3600 * 1000
        run_id = task["taskId"]
        got = await raw.request("tasks/get", {"taskId": run_id})
        assert got["status"] == "working" and got["statusMessage"].startswith("waiting for ana until ")
        listed = await raw.request("tasks/list")
        assert [t["taskId"] for t in listed["tasks"]] == [run_id]
        plain = await raw.request("tools/call", {"name": "ask", "arguments": ASK})       # no params.task: as today
        assert plain["structuredContent"]["status"] == "started"
        with pytest.raises(RawError) as err:
            await raw.request("tasks/get", {"taskId": "no-such-run"})
        assert err.value.code == -32602
    async with legacy_stdio(db, tmp_path) as raw:        # another process: the same task
        assert (await raw.request("tasks/get", {"taskId": run_id}))["status"] == "working"
        await raw.request("tools/call", {"name": "answer_interaction",
                                         "arguments": {"run_id": run_id, "answer": {"approved": True}}})
        done = await raw.request("tasks/result", {"taskId": run_id})
        assert done["structuredContent"]["output"] == {"approved": True} and done["isError"] is False
        assert done["_meta"]["io.modelcontextprotocol/related-task"] == {"taskId": run_id}
        assert (await raw.request("tasks/get", {"taskId": run_id}))["status"] == "completed"
        second = (await raw.request("tools/call", {"name": "ask", "arguments": ASK, "task": {}}))["task"]["taskId"]
        cancelled = await raw.request("tasks/cancel", {"taskId": second})
        assert cancelled["taskId"] == second and cancelled["status"] == "cancelled"
        waited = (await raw.request("tools/call", {"name": "wait_run", "arguments": {"run_id": second}, "task": {}}))
        assert waited["structuredContent"]["kind"] == "cancelled"           # an ended run: the result at once


async def test_one_run_is_the_task_of_both_eras_and_tasks_result_waits_for_it(db, aiohttp_client):
    d = await start_daemon(aiohttp_client, db)
    async with http_client(d) as modern:
        run_id = (await start_task(modern, "ask", ASK))["taskId"]
    async with http_client(d, mode="legacy", tasks=False) as legacy:
        got = await rpc(legacy, "tasks/get", taskId=run_id)
        assert got["taskId"] == run_id and got["status"] == "working" and got["pollInterval"] == 2000
        result = asyncio.ensure_future(rpc(legacy, "tasks/result", taskId=run_id))
        await asyncio.sleep(0.3)
        assert not result.done()                         # it waits for the run to end
        await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"approved": True}})
        done = await asyncio.wait_for(result, 10)
        assert done["structuredContent"]["output"] == {"approved": True}
        assert (await rpc(legacy, "tasks/list"))["tasks"] == []          # it lists the open ones


async def test_on_postgresql_another_daemon_serves_the_task(tmp_path, aiohttp_client):
    with fresh_postgres() as pg:
        a = await start_daemon(aiohttp_client, pg, config=_as_ana())
        b = await start_daemon(aiohttp_client, pg, tokens=a.tokens, config=_as_ana())
        async with http_client(a, elicits=True) as c:
            run_id = (await start_task(c, "ask", ASK))["taskId"]
        async with http_client(b, elicits=True) as c:
            got = await rpc(c, "tasks/get", taskId=run_id)
            [key] = got["inputRequests"]
            await rpc(c, "tasks/update", taskId=run_id,
                      inputResponses={key: {"action": "accept", "content": {"approved": True}}})
        async with http_client(a) as c:
            got = await rpc(c, "tasks/get", taskId=run_id)
            assert got["status"] == "completed" and got["result"]["structuredContent"]["settled_by"] == "ana"
