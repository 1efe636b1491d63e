"""One door for every tool call (SPEC section 22): the operator's approval gate holds whichever way a
call comes in - a function's call, execute, a workflow, a delivery, a reading, a telling, a reminder,
an escalation - and nothing else calls a tool server.

Real MCP tool servers as subprocesses, each keeping its own log of the calls it got: the ops server
(tests/servers/ops_server.py) and three copies of the example chat server, on the manual clock, on
SQLite and PostgreSQL.
"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

import interactiond as itd
from daemon_kit import chat_command, start_daemon

ROOT = Path(__file__).resolve().parent.parent
OPS = str(Path(__file__).parent / "servers" / "ops_server.py")
sys.path.insert(0, str(ROOT / "examples"))
import chat_server  # noqa: E402

#: Which tool of which server the operator gates: c1 sends with a gated tool, c2 reads with one, c3
#: tells with one; ops gates its restart.
GATES = {"ops": ("restart_service",), "c1": ("post_message",), "c2": ("thread_replies",), "c3": ("channel_history",)}


def config(tmp_path: Path, *, gated: bool) -> itd.Config:
    servers = {"ops": itd.ServerConfig("ops", command=(sys.executable, OPS, "--calls-log", str(tmp_path / "ops.jsonl")))}
    for name in ("c1", "c2", "c3"):
        servers[name] = itd.ServerConfig(name, command=chat_command(tmp_path / f"{name}.db"))
    if gated:
        servers = {name: itd.ServerConfig(sc.name, command=sc.command, approve=itd.ApprovalPolicy(
            GATES[name], "ops-oncall", itd.parse_duration("PT1H"))) for name, sc in servers.items()}
    return itd.Config(servers=servers, playbooks={"local/default": tuple(servers), "acme/other": ()})


def chat_function(server: str, *, tell: str = "post_message") -> str:
    """A question sent to ana in a chat thread, its replies read and told, reminded and escalated."""
    return f"""---
description: Asks ana in the ops channel
to: ana
expires: P1D
remind: {{after: [PT10M]}}
escalate: {{after: PT20M, to: bo}}
deliver:
  server: {server}
  tool: post_message
  with: {{ channel: ops, text: '{{{{ message }}}}' }}
  sent: {{ conversation: /channel, id: /ts }}
replies:
  conversation: '{{{{ sent.conversation }}}}/{{{{ sent.id }}}}'
  tool: thread_replies
  with: {{ channel: '{{{{ sent.conversation }}}}', ts: '{{{{ sent.id }}}}', oldest: '{{{{ since | default: "0" }}}}' }}
  read:
    list: /messages
    order: oldest_first
    each: {{ id: /ts, sender: /user, text: /text, to: /thread_ts }}
  wait: PT30S
  tell:
    tool: {tell}
    with: {{ channel: '{{{{ sent.conversation }}}}', thread_ts: '{{{{ sent.id }}}}', text: '{{{{ message }}}}' }}
output:
  schema: {{ type: object, required: [verdict], properties: {{ verdict: {{ type: string, enum: [yes, no] }} }} }}
---
Deploy now?
"""


RESTART = """---
description: Restarts a service
call: {server: ops, tool: restart_service, with: {service: '{{ input.service }}'}, read: /status}
input:
  schema: { type: object, required: [service], properties: { service: { type: string } } }
output:
  schema: { type: string }
---
"""

WORKFLOW = """document: {dsl: '1.0.3', namespace: tests, name: restarts, version: '1.0.0'}
do:
  - restart:
      call: run_definition
      with: { type: interaction, name: restart, input: { service: web } }
"""


def ops_calls(tmp_path: Path) -> list[dict]:
    log = tmp_path / "ops.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def chat_calls(tmp_path: Path, server: str, tool: str) -> int:
    db = tmp_path / f"{server}.db"
    return chat_server.calls(str(db), tool) if db.exists() else 0


async def events(d, run_id: str) -> list[dict]:
    status, page = await d.call("GET", f"/runs/{run_id}/events?limit=200")
    assert status == 200, page
    return page["data"]


async def test_a_gated_tool_cannot_deliver_read_or_tell_and_the_save_says_which_line(db, tmp_path, aiohttp_client):
    d = await start_daemon(aiohttp_client, db, config=config(tmp_path, gated=True))
    def line_of(source: str, text: str, nth: int = 0) -> int:
        return [i for i, t in enumerate(source.splitlines(), 1) if t.strip() == text][nth]

    for server, tell in (("c1", "post_message"), ("c2", "post_message"), ("c3", "channel_history")):
        source = chat_function(server, tell=tell)
        if server == "c1":              # it sends and tells with the gated post_message
            expected = {("deliver.tool", line_of(source, "tool: post_message")),
                        ("replies.tell.tool", line_of(source, "tool: post_message", 1))}
        elif server == "c2":
            expected = {("replies.tool", line_of(source, "tool: thread_replies"))}
        else:
            expected = {("replies.tell.tool", line_of(source, "tool: channel_history"))}
        status, problem = await d.call("POST", "/definitions", {"type": "interaction", "name": "ask", "source": source})
        assert status == 422 and problem["type"].endswith("/invalid_document"), problem
        assert {(e["field"], e["line"]) for e in problem["errors"]} == expected, problem
        assert all(e["code"] == "gated_tool" and "gates" in e["message"] for e in problem["errors"])
    # The same documents save where nothing is gated.
    d2 = await start_daemon(aiohttp_client, db, config=config(tmp_path, gated=False), tokens=d.tokens)
    assert (await d2.call("POST", "/definitions", {"type": "interaction", "name": "ask",
                                                   "source": chat_function("c1")}))[0] == 201


async def test_no_door_calls_a_gated_tool_without_an_approval(db, tmp_path, aiohttp_client):
    # Saved while nothing was gated; then the operator gates the tools and the daemon starts again.
    before = await start_daemon(aiohttp_client, db, config=config(tmp_path, gated=False))
    for name, source in (("send", chat_function("c1")), ("read", chat_function("c2")),
                         ("tell", chat_function("c3", tell="channel_history")), ("restart", RESTART)):
        await before.define(name, source)
    assert (await before.call("POST", "/definitions", {"type": "workflow", "name": "restarts", "source": WORKFLOW}))[0] == 201
    await before.client.close()                         # the daemon stops; it starts again gated
    d = await start_daemon(aiohttp_client, db, config=config(tmp_path, gated=True),
                           clock=itd.ManualClock(before.clock.now_ms()), tokens=before.tokens)

    runs = {}
    for name in ("send", "read", "tell"):
        status, run = await d.run(name, {})
        assert status == 202, run
        runs[name] = run["run_id"]
    status, run = await d.run("restart", {"service": "web"})                       # call: waits for approval
    assert status == 202 and run["status"] == "started", run
    status, wf = await d.call("POST", "/runs", {"type": "workflow", "name": "restarts", "input": {}})
    assert status in (200, 201, 202), wf
    status, ex = await d.call("POST", "/tools/ops/restart_service", {"arguments": {"service": "db"}}, role="writer")
    assert status == 202 and ex["status"] == "started", ex                         # execute: waits too

    await d.advance("PT0S")                                   # deliveries are due at once
    [posted] = chat_server.messages(str(tmp_path / "c3.db"), "ops")
    chat_server.say(str(tmp_path / "c3.db"), "ops", "ana", "maybe", thread_ts=posted["ts"])   # refused: told
    for step in ("PT30S", "PT1M", "PT10M", "PT20M"):          # reads, the telling, the reminder, the escalation
        await d.advance(step)
    await d.engine.settle()

    assert ops_calls(tmp_path) == []
    assert chat_calls(tmp_path, "c1", "post_message") == 0
    assert chat_calls(tmp_path, "c2", "thread_replies") == 0 and chat_calls(tmp_path, "c2", "post_message") >= 1
    assert chat_calls(tmp_path, "c3", "channel_history") == 0 and chat_calls(tmp_path, "c3", "thread_replies") >= 1

    refused = [e for run_id in runs.values() for e in await events(d, run_id) if e["type"] == "tool_call_refused"]
    by_tool = {(e["payload"]["server"], e["payload"]["tool"]) for e in refused}
    assert by_tool == {("c1", "post_message"), ("c2", "thread_replies"), ("c3", "channel_history")}, refused
    assert all(e["payload"]["because"] == "gated" for e in refused)
    failed = [e for e in await events(d, runs["send"]) if e["type"] == "delivery_failed"]
    assert failed and failed[0]["payload"]["because"] == "tool_not_offered"
    # A gated reading tool is not read again: the reading stopped after its one refusal.
    assert sum(e["payload"]["tool"] == "thread_replies" for e in refused) == 1
    # The telling of the refused reply, the reminder and the escalation were each refused.
    assert sum(e["payload"]["tool"] == "channel_history" for e in refused) >= 3

    # The approved call is the one way through: not by the writer that asked for it, but by an operator.
    status, problem = await d.call("POST", f"/runs/{ex['run_id']}/answer", {"answer": {"approved": True}}, role="writer")
    assert status == 403 and problem["type"].endswith("/approval_not_yours"), problem
    assert (await d.call("POST", f"/runs/{ex['run_id']}/answer", {"answer": {"approved": True}}))[0] == 200
    await d.advance("PT0S")
    status, done = await d.call("POST", f"/runs/{ex['run_id']}/wait?timeout=10")
    assert done["status"] == "succeeded", done
    assert ops_calls(tmp_path) == [{"tool": "restart_service", "arguments": {"service": "db"}}]


async def test_the_door_refuses_a_gated_call_whose_arguments_were_not_approved(tmp_path):
    tools = itd.ToolServers(config(tmp_path, gated=True))
    try:
        gate = {"server": "ops", "tool": "restart_service", "approved": {"service": "web"}}
        for approval in (None, {**gate, "approved": {"service": "db"}}, {**gate, "tool": "status"}, {"server": "ops"}):
            with pytest.raises(itd.ToolFailure) as info:
                await tools.call("local/default", None, "ops", "restart_service", {"service": "web"}, approval=approval)
            assert info.value.because == "gated" and info.value.sent is False
        assert ops_calls(tmp_path) == []
        result = await tools.call("local/default", None, "ops", "restart_service", {"service": "web"}, approval=gate)
        assert result.structured_content["status"] == "restarted web"
        with pytest.raises(itd.ToolFailure) as info:               # the allow-list and the bounds, at the same door
            await tools.call("acme/other", None, "ops", "status", {"service": "web"})
        assert info.value.because == "tool_not_offered"
        with pytest.raises(itd.ToolFailure) as info:
            await tools.call("local/default", None, "ops", "status", {"service": "x" * (itd.MAX_ARGUMENTS_BYTES + 1)})
        assert info.value.because == "too_large"
        assert ops_calls(tmp_path) == [{"tool": "restart_service", "arguments": {"service": "web"}}]
    finally:
        await tools.close()


def test_only_the_door_calls_a_tool_session():
    """Nothing in the module calls a tool server's session but ToolServers.call, and nothing but
    ToolSession.call sends `call_tool` to a configured server (the stdio front's relay to a running
    daemon is not a configured tool server)."""
    tree = ast.parse((ROOT / "interactiond.py").read_text())
    owners: dict[str, list[str]] = {"session.call": [], "call_tool": []}
    for cls in (n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))):
        for fn in ast.walk(cls):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    target = ast.unparse(node.func.value)
                    if node.func.attr == "call" and "session" in target.lower():
                        owners["session.call"].append(f"{getattr(cls, 'name', '')}.{fn.name}")
                    if node.func.attr == "call_tool" and not target.startswith("up."):
                        owners["call_tool"].append(f"{getattr(cls, 'name', '')}.{fn.name}")
    assert set(owners["session.call"]) == {"ToolServers.call"}, owners
    assert set(owners["call_tool"]) == {"ToolSession.call"}, owners
