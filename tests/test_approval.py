"""Approval gates on tool calls (SPEC section 20): a person approves a call before it runs, and may change
the arguments they are allowed to.

Against a real MCP tool server started as a subprocess (tests/servers/ops_server.py, which records every
call it gets), the real example chat server for a delivered approval, on the manual clock, on SQLite and
PostgreSQL; the page in a real Chromium.
"""
from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import interactiond as itd
from daemon_kit import chat_command, fresh_postgres, person_token, start_daemon, until

ROOT = Path(__file__).resolve().parent.parent
OPS = str(Path(__file__).parent / "servers" / "ops_server.py")
sys.path.insert(0, str(ROOT / "examples"))
import chat_server  # noqa: E402

RESTART = """---
description: Restarts a service once its owner approves
call: {server: ops, tool: restart_service, with: {service: '{{ input.service }}', force: false}, read: /status}
approve:
  to: '{{ input.owner }}'
  expires: PT2H
  edit: [/service, /force]
input:
  schema:
    type: object
    required: [service, owner]
    properties:
      service: { type: string }
      owner: { type: string }
output:
  schema: { type: string }
---
Restart **{{ input.service }}** now?
"""

CHAT_RESTART = """---
description: Asks in the team chat before restarting a service
call: {server: ops, tool: restart_service, with: {service: '{{ input.service }}'}, read: /status}
approve:
  to: '{{ input.owner }}'
  expires: PT2H
  deliver:
    server: chat
    tool: post_message
    with: { channel: ops, text: '{{ message }}' }
    sent: { conversation: /channel, id: /ts }
  replies:
    conversation: '{{ sent.conversation }}/{{ sent.id }}'
    tool: thread_replies
    with: { channel: '{{ sent.conversation }}', ts: '{{ sent.id }}', oldest: '{{ since | default: "0" }}' }
    read:
      list: /messages
      order: oldest_first
      each: { id: /ts, sender: /user, text: /text, to: /thread_ts }
    wait: PT30S
    tell:
      with: { channel: '{{ sent.conversation }}', thread_ts: '{{ sent.id }}', text: '{{ message }}' }
input:
  schema:
    type: object
    required: [service, owner]
    properties:
      service: { type: string }
      owner: { type: string }
output:
  schema: { type: string }
---
<@{{ input.owner }}>: may I restart {{ input.service }}? Reply approve or reject, with a note if you like.
"""

STATUS = """---
description: How a service is (its tool is gated by the operator)
call: {server: ops, tool: status, with: {service: '{{ input.service }}'}, read: /status}
input:
  schema: { type: object, required: [service], properties: { service: { type: string } } }
output:
  schema: { type: string }
---
"""


def ops_config(log: Path, *, policy: itd.ApprovalPolicy | None = None, chat_db: str | None = None) -> itd.Config:
    servers = {"ops": itd.ServerConfig("ops", command=(sys.executable, OPS, "--calls-log", str(log)), approve=policy)}
    if chat_db is not None:
        servers["chat"] = itd.ServerConfig("chat", command=chat_command(chat_db))
    return itd.Config(servers=servers, playbooks={"local/default": tuple(servers), "acme/other": ()})


@pytest.fixture
async def d(db, tmp_path, aiohttp_client):
    log = tmp_path / "ops-calls.jsonl"
    daemon = await start_daemon(aiohttp_client, db, config=ops_config(log))
    daemon.calls_log = log
    return daemon


@pytest.fixture
async def gated(db, tmp_path, aiohttp_client):
    """A daemon whose operator gates restart_service and status: ops-oncall approves, within an hour."""
    log = tmp_path / "ops-calls.jsonl"
    policy = itd.ApprovalPolicy(("restart_service", "status"), "ops-oncall", itd.parse_duration("PT1H"))
    daemon = await start_daemon(aiohttp_client, db, config=ops_config(log, policy=policy))
    daemon.calls_log = log
    return daemon


def calls(d) -> list[dict]:
    if not d.calls_log.exists():
        return []
    return [json.loads(line) for line in d.calls_log.read_text().splitlines() if line.strip()]


async def history(d, run_id) -> list[dict]:
    return (await d.call("GET", f"/runs/{run_id}/events"))[1]["data"]


async def request_of(d, run_id) -> dict | None:
    page = (await d.call("GET", "/interactions"))[1]["data"]
    return next((r for r in page if r["run_id"] == run_id), None)


async def ask(d, service: str = "web", owner: str = "ana", source: str = RESTART) -> str:
    await d.define("restart", source)
    status, run = await d.run("restart", {"service": service, "owner": owner})
    assert status == 202 and run["status"] == "started", run
    return run["run_id"]


def person(d, name: str, role: str = "writer") -> str:
    """The key in d.tokens of a token naming person `name` (made on first use)."""
    key = f"person:{name}:{role}"
    if key not in d.tokens:
        d.tokens[key] = person_token(d.db, name, role)
    return key


async def answer(d, run_id: str, body: dict, role: str | None = None) -> tuple[int, dict]:
    """Answer as `role`, by default as the person the open approval is addressed to."""
    if role is None:
        req = await request_of(d, run_id)
        role = person(d, req["to"]) if req is not None else "writer"
    return await d.call("POST", f"/runs/{run_id}/answer", {"answer": body}, role=role)


async def ended(d, run_id: str) -> tuple[int, dict]:
    await d.advance("PT0S")                 # the approved call's timer is due at once
    return await d.call("POST", f"/runs/{run_id}/wait?timeout=10")


async def test_approved_as_proposed_the_tool_is_called_once(d):
    run_id = await ask(d)
    assert calls(d) == []                                    # nothing is sent before the approval
    req = await request_of(d, run_id)
    assert req["to"] == "ana" and req["message"] == "Restart **web** now?" and req["takes_answer"]
    assert req["approval"] == {"server": "ops", "tool": "restart_service", "read_only": False,
                               "arguments": {"service": "web", "force": False}, "edit": ["/service", "/force"]}
    assert req["answer_schema"] == itd.APPROVAL_ANSWER_SCHEMA
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["status"] == "waiting"

    status, fact = await answer(d, run_id, {"approved": True, "note": "go"})
    assert status == 200 and fact["answer"] == {"approved": True, "note": "go"}
    status, run = await ended(d, run_id)
    assert status == 200 and run["status"] == "succeeded" and run["output"] == "restarted web", run
    assert calls(d) == [{"tool": "restart_service", "arguments": {"service": "web", "force": False}}]
    assert await request_of(d, run_id) is None
    events = await history(d, run_id)
    assert [e["type"] for e in events] == ["approval_requested", "interaction_requested", "request_answered",
                                           "approval_answered", "tool_call_started", "tool_call_answered",
                                           "run_succeeded"]
    requested, answered = events[0]["payload"], events[3]["payload"]
    assert requested["arguments"] == {"service": "web", "force": False} and requested["read_only"] is False
    assert answered == {"approved": True, "by": fact["answered_by"], "patch": [], "note": "go",
                        "arguments_digest": itd.arguments_digest({"service": "web", "force": False})}
    assert events[4]["payload"]["arguments"] == {"service": "web", "force": False}
    # The same answer again is the same fact; the call is not made again.
    assert await answer(d, run_id, {"approved": True, "note": "go"}) == (200, fact)
    await d.advance("PT1M")
    assert len(calls(d)) == 1


async def test_approved_with_an_edit_the_tool_gets_the_edited_arguments(d):
    run_id = await ask(d)
    status, _ = await answer(d, run_id, {"approved": True, "arguments": {"service": "api", "force": True}})
    assert status == 200
    status, run = await ended(d, run_id)
    assert status == 200 and run["output"] == "restarted api"
    assert calls(d) == [{"tool": "restart_service", "arguments": {"service": "api", "force": True}}]
    [answered] = [e for e in await history(d, run_id) if e["type"] == "approval_answered"]
    assert answered["payload"]["approved"] is True
    assert answered["payload"]["patch"] == [{"op": "replace", "path": "/service", "value": "api"},
                                            {"op": "replace", "path": "/force", "value": True}]


async def test_an_edit_outside_edit_or_off_the_tools_schema_is_refused_and_the_request_stays_open(d):
    run_id = await ask(d, source=RESTART.replace("edit: [/service, /force]", "edit: [/service]"))
    status, problem = await answer(d, run_id, {"approved": True, "arguments": {"service": "web", "force": True}})
    assert status == 422 and [e["pointer"] for e in problem["errors"]] == ["/answer/arguments/force"], problem
    assert "/service" in problem["errors"][0]["message"]
    status, problem = await answer(d, run_id, {"approved": True, "arguments": {"force": False}})     # a removal
    assert status == 422 and [e["pointer"] for e in problem["errors"]] == ["/answer/arguments/service"]
    status, problem = await answer(d, run_id, {"approved": True, "arguments": {"service": "Not A Name!", "force": False}})
    assert status == 422 and [e["pointer"] for e in problem["errors"]] == ["/answer/arguments/service"], problem
    assert "input schema of restart_service" in problem["detail"]
    status, problem = await answer(d, run_id, {"approved": "yes"})
    assert status == 422 and problem["errors"][0]["pointer"] == "/answer/approved"
    assert (await request_of(d, run_id)) is not None
    assert [e["type"] for e in await history(d, run_id)] == ["approval_requested", "interaction_requested"]
    await d.advance("PT1M")
    assert calls(d) == []
    # A fitting edit is taken after all that.
    assert (await answer(d, run_id, {"approved": True, "arguments": {"service": "db", "force": False}}))[0] == 200
    status, run = await ended(d, run_id)
    assert status == 200 and calls(d) == [{"tool": "restart_service", "arguments": {"service": "db", "force": False}}]


async def test_a_refusal_with_a_note_ends_the_run_declined(d):
    run_id = await ask(d)
    status, fact = await answer(d, run_id, {"approved": False, "note": "not during the sale"})
    assert status == 200
    status, run = await d.call("POST", f"/runs/{run_id}/wait?timeout=5")
    assert status == 410 and run["status"] == "rejected" and run["kind"] == "declined", run
    assert run["problem"]["type"] == "/problems/declined" and run["problem"]["status"] == 410
    assert "not during the sale" in run["problem"]["detail"]
    page = await d.client.get("/problems/declined")
    assert page.status == 200 and "Declined (410)" in await page.text()
    await d.advance("PT1M")
    assert calls(d) == []
    events = await history(d, run_id)
    assert [e["type"] for e in events][-3:] == ["request_answered", "approval_answered", "run_rejected"]
    assert events[-2]["payload"]["approved"] is False and events[-2]["payload"]["note"] == "not during the sale"
    status, problem = await answer(d, run_id, {"approved": True})
    assert status == 409 and problem["kind"] == "answered"


async def test_an_approval_nobody_gives_expires_unanswered(d):
    run_id = await ask(d)
    await d.advance("PT1H59M")
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["status"] == "waiting"
    await d.advance("PT1M")
    run = (await d.call("GET", f"/runs/{run_id}"))[1]
    assert run["status"] == "rejected" and run["kind"] == "expired"
    assert run["problem"]["type"] == "/problems/unanswered"
    assert calls(d) == []
    assert (await answer(d, run_id, {"approved": True}))[0] == 409


async def test_a_cancelled_approval_calls_nothing(d):
    run_id = await ask(d)
    status, run = await d.call("POST", f"/runs/{run_id}/cancel")
    assert status == 200 and run["kind"] == "cancelled"
    assert (await answer(d, run_id, {"approved": True}))[0] == 409
    await d.advance("PT1M")
    assert calls(d) == []


async def test_the_operators_gate_holds_an_execute_until_approved(gated):
    d = gated
    status, run = await d.call("POST", "/tools/ops/restart_service", {"arguments": {"service": "web"}})
    assert status == 202 and run["status"] == "started" and run["type"] == "execute", run
    assert run["name"] == "ops/restart_service" and run["input"]["arguments"] == {"service": "web"}
    assert calls(d) == []
    [req] = (await d.call("GET", "/interactions?to=ops-oncall"))[1]["data"]
    assert req["run_id"] == run["run_id"] and req["approval"]["edit"] == [] and "restart_service" in req["message"]
    assert req["expires_at"] == itd.fmt_time(d.clock.now_ms() + 3600_000)
    # Nothing may be changed without `edit`.
    status, problem = await answer(d, run["run_id"], {"approved": True, "arguments": {"service": "api"}})
    assert status == 422 and problem["errors"][0]["pointer"] == "/answer/arguments/service"
    assert (await answer(d, run["run_id"], {"approved": True}))[0] == 200
    status, done = await ended(d, run["run_id"])
    assert status == 200 and done["status"] == "succeeded"
    assert done["output"]["answer"] == {"status": "restarted web", "force": False}
    assert done["output"]["is_error"] is False and done["output"]["tool"] == "restart_service"
    assert calls(d) == [{"tool": "restart_service", "arguments": {"service": "web"}}]
    # A function calling a gated tool waits too; its own caller cannot route the approval elsewhere.
    await d.define("status", STATUS)
    status, run = await d.run("status", {"service": "db"})
    assert status == 202
    req = await request_of(d, run["run_id"])
    assert req["to"] == "ops-oncall" and req["approval"]["read_only"] is True
    assert "status" in req["message"] and "function" in req["message"]
    status, run = await d.call("POST", "/tools/ops/restart_service",
                               {"arguments": {"service": "x"}, "approve": {"to": "me", "edit": ["/service"]}})
    assert status == 202 and (await request_of(d, run["run_id"]))["to"] == "ops-oncall"
    assert len(calls(d)) == 1


async def test_execute_takes_its_own_approve(d):
    status, run = await d.call("POST", "/tools/ops/restart_service",
                               {"arguments": {"service": "web", "force": False},
                                "approve": {"to": "bo", "expires": "PT10M", "edit": ["/force"]}})
    assert status == 202, run
    req = await request_of(d, run["run_id"])
    assert req["to"] == "bo" and req["approval"]["edit"] == ["/force"]
    assert (await answer(d, run["run_id"], {"approved": True, "arguments": {"service": "web", "force": True}}))[0] == 200
    status, done = await ended(d, run["run_id"])
    assert status == 200 and calls(d) == [{"tool": "restart_service", "arguments": {"service": "web", "force": True}}]
    for approve, pointer in (({"expires": "PT10M"}, "/approve/to"), ({"to": "bo", "expires": "P90D"}, "/approve/expires"),
                             ({"to": "bo", "edit": ["/nope"]}, "/approve/edit/0"), ("bo", "/approve"),
                             ({"to": "bo", "why": 1}, "/approve/why")):
        status, problem = await d.call("POST", "/tools/ops/restart_service",
                                       {"arguments": {"service": "web"}, "approve": approve})
        assert status == 422 and problem["errors"][0]["pointer"] == pointer, (approve, problem)
    # Arguments the tool refuses end nothing and ask nobody: unworkable, as an execute is today.
    status, problem = await d.call("POST", "/tools/ops/restart_service",
                                   {"arguments": {"service": 3}, "approve": {"to": "bo"}})
    assert status == 409 and problem["kind"] == "unworkable"
    assert len((await d.call("GET", "/interactions"))[1]["data"]) == 0 and len(calls(d)) == 1


async def test_execute_over_mcp_with_approve(d):
    from mcp import Client
    server = itd.make_mcp_server(d.engine, caller=itd.Caller("stdio", itd.Role.OPERATOR))
    async with Client(server) as c:
        r = await c.call_tool("execute", {"server": "ops", "tool": "restart_service", "arguments": {"service": "web"},
                                          "approve": {"to": "ana"}})
        run = r.structured_content
        assert not r.is_error and run["status"] == "started", run
        listed = (await c.call_tool("list_interactions", {"to": "ana"})).structured_content["data"]
        assert listed[0]["approval"]["tool"] == "restart_service"
        # The agent that started the call cannot approve it: four eyes.
        r = await c.call_tool("answer_interaction", {"run_id": run["run_id"], "answer": {"approved": True}})
        assert r.is_error and "approval_not_yours" in r.content[0].text and calls(d) == []
        assert (await answer(d, run["run_id"], {"approved": True}))[0] == 200          # ana approves it
        await d.engine.advance(itd.parse_duration("PT0S"))
        r = await c.call_tool("wait_run", {"run_id": run["run_id"], "timeout": 10})
        assert r.structured_content["status"] == "succeeded"
    assert calls(d) == [{"tool": "restart_service", "arguments": {"service": "web"}}]


async def restart(d, aiohttp_client):
    return await start_daemon(aiohttp_client, d.db, clock=itd.ManualClock(d.clock.now_ms()), tokens=d.tokens,
                              config=d.engine.config)


async def test_a_restart_between_the_approval_and_the_call_calls_once(d, aiohttp_client):
    run_id = await ask(d)
    await d.engine.stop()                   # the daemon stops: its timer task with it
    fact, fresh = await d.engine.answer_interaction(itd.OPERATOR_LOCAL, "local/default", run_id,
                                                    {"approved": True, "arguments": {"service": "api", "force": True}})
    assert fresh
    await d.client.close()
    assert calls(d) == []                   # approved and stored; not called yet
    d2 = await restart(d, aiohttp_client)
    d2.calls_log = d.calls_log
    status, run = await ended(d2, run_id)
    assert status == 200 and run["output"] == "restarted api", run
    assert calls(d2) == [{"tool": "restart_service", "arguments": {"service": "api", "force": True}}]
    await d2.client.close()
    d3 = await restart(d2, aiohttp_client)
    d3.calls_log = d.calls_log
    await d3.advance("PT5M")
    assert len(calls(d3)) == 1
    assert [e["type"] for e in await history(d3, run_id)].count("tool_call_started") == 1


async def test_an_approved_call_cut_off_in_flight_ends_effect_unknown(d, aiohttp_client):
    status, run = await d.call("POST", "/tools/ops/restart_slowly",
                               {"arguments": {"service": "web"}, "approve": {"to": "ana"}})
    assert status == 202
    assert (await answer(d, run["run_id"], {"approved": True}))[0] == 200
    await until(lambda: calls(d), what="the ops server is called")   # (an advance would wait for the call)
    assert [c["tool"] for c in calls(d)] == ["restart_slowly"]
    assert (await d.call("GET", f"/runs/{run['run_id']}"))[1]["status"] == "started"
    for task in list(d.engine._tasks):      # the stop cuts the call off (as a kill would)
        task.cancel()
    await d.client.close()
    d2 = await restart(d, aiohttp_client)
    run = (await d2.call("GET", f"/runs/{run['run_id']}"))[1]
    assert run["status"] == "conflict" and run["kind"] == "effect_unknown" and run["problem"]["because"] == "lost"
    assert len(calls(d)) == 1


async def test_a_delivered_approval_takes_a_reply(db, tmp_path, aiohttp_client):
    log, chat_db = tmp_path / "ops-calls.jsonl", str(tmp_path / "chat.db")
    d = await start_daemon(aiohttp_client, db, config=ops_config(log, chat_db=chat_db))
    d.calls_log = log
    run_id = await ask(d, source=CHAT_RESTART)
    await d.advance("PT0S")                                  # the delivery is due at once
    [posted] = chat_server.messages(chat_db, "ops")
    assert "may I restart web" in posted["text"]
    req = await request_of(d, run_id)
    assert req["delivery_state"] == "delivered" and req["delivery"] == {"server": "chat", "tool": "post_message"}
    chat_server.say(chat_db, "ops", "bo", "approve", thread_ts=posted["ts"])         # not the approver
    chat_server.say(chat_db, "ops", "ana", "maybe later", thread_ts=posted["ts"])    # not an answer: told so
    await d.advance("PT30S")
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["status"] == "waiting" and calls(d) == []
    told = [m for m in chat_server.messages(chat_db, "ops") if m["user"] == "interactiond" and m["thread_ts"]]
    assert told and "approve or reject" in told[-1]["text"]
    chat_server.say(chat_db, "ops", "ana", "approve looks fine", thread_ts=posted["ts"])
    await d.advance("PT1M")
    status, run = await ended(d, run_id)
    assert status == 200 and run["output"] == "restarted web", run
    assert calls(d) == [{"tool": "restart_service", "arguments": {"service": "web"}}]
    [answered] = [e for e in await history(d, run_id) if e["type"] == "approval_answered"]
    assert answered["payload"]["approved"] is True and answered["payload"]["note"] == "looks fine"


async def test_a_reply_can_refuse(db, tmp_path, aiohttp_client):
    log, chat_db = tmp_path / "ops-calls.jsonl", str(tmp_path / "chat.db")
    d = await start_daemon(aiohttp_client, db, config=ops_config(log, chat_db=chat_db))
    d.calls_log = log
    run_id = await ask(d, source=CHAT_RESTART)
    await d.advance("PT0S")
    [posted] = chat_server.messages(chat_db, "ops")
    chat_server.say(chat_db, "ops", "ana", "Reject: wait for the deploy", thread_ts=posted["ts"])
    await d.advance("PT1M")
    run = (await d.call("GET", f"/runs/{run_id}"))[1]
    assert run["kind"] == "declined" and "wait for the deploy" in run["problem"]["detail"]
    assert calls(d) == []


# Saving a document with approve ###################################################################

def problems(source: str) -> list[tuple[int, str, str]]:
    with pytest.raises(itd.DocumentError) as info:
        itd.parse_function(source)
    return [(p["line"], p["field"], p["message"]) for p in info.value.problems]


def test_approve_is_checked_when_saved_with_lines():
    doc = itd.parse_function(RESTART)
    assert doc.approve.edit == ("/service", "/force") and doc.approve.expires == itd.parse_duration("PT2H")
    assert "**Who approves:**" in doc.overview
    chat = itd.parse_function(CHAT_RESTART)
    assert chat.reply_rule is itd.APPROVAL_RULE and chat.deliver.tool == "post_message"
    found = problems(RESTART.replace("edit: [/service, /force]", "edit: [/sevice, '', service]\n  colour: red")
                     .replace("expires: PT2H", "expires: P60D"))
    assert (6, "approve.expires", "P60D is outside PT1M to P30D (1 minute to 30 days)") in found
    fields = {(line, field) for line, field, _ in found}
    assert {(7, "approve.edit.0"), (7, "approve.edit.1"), (7, "approve.edit.2"), (8, "approve.colour")} <= fields
    assert any("call.with writes no /sevice" in m for _, _, m in found)
    found = problems(CHAT_RESTART.replace("    sent: { conversation: /channel, id: /ts }\n", "")
                     .replace("    tool: thread_replies\n", ""))
    assert {f for _, f, _ in found} >= {"approve.replies", "approve.replies.tool"}
    inbox = problems("---\nto: ana\nexpires: P1D\napprove: {to: ana, expires: PT1H}\n---\nHi\n")
    assert inbox == [(4, "approve", "approve gates a call of a tool: only a function with call has it")]
    body = problems(RESTART.replace("approve:\n  to: '{{ input.owner }}'\n  expires: PT2H\n  edit: [/service, /force]\n", ""))
    assert any(f == "body" for _, f, _ in body)          # without approve, a call still sends no message


def test_the_patch_is_rfc_6902_and_applies_back():
    before = {"service": "web", "force": False, "tags": ["a", "b"], "opts": {"x": 1, "y": {"z": True}}}
    after = {"service": "api", "force": False, "tags": ["a", "c"], "opts": {"x": 1.0, "y": {}, "w": None}}
    patch = itd.json_patch(before, after)
    assert patch == [{"op": "replace", "path": "/service", "value": "api"},
                     {"op": "replace", "path": "/tags/1", "value": "c"},
                     {"op": "remove", "path": "/opts/y/z"},
                     {"op": "add", "path": "/opts/w", "value": None}]
    assert itd.json_patch_apply(before, patch) == after
    assert itd.json_patch({"a": 1}, {"a": True}) == [{"op": "replace", "path": "/a", "value": True}]
    assert itd.json_patch({"a/b": [1]}, {"a/b": [1, 2]}) == [{"op": "replace", "path": "/a~1b", "value": [1, 2]}]


def test_the_declined_ending_and_the_policy_in_the_configuration(tmp_path):
    body = itd.ending_problem(itd.RunStatus.REJECTED, "declined", "no").body()
    assert body["type"] == "/problems/declined" and body["status"] == 410 and body["kind"] == "declined"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("servers:\n  ops:\n    command: [python, ops.py]\n    approve: {tools: [restart_service], to: ops-oncall,"
                   " expires: PT1H}\nplaybooks:\n  local/default: {servers: [ops]}\n")
    policy = itd.load_config(str(cfg)).servers["ops"].approve
    assert policy == itd.ApprovalPolicy(("restart_service",), "ops-oncall", itd.parse_duration("PT1H"))
    cfg.write_text("servers:\n  ops:\n    command: [python, ops.py]\n    approve: {tools: [], to: '', expires: P99D, x: 1}\n")
    with pytest.raises(itd.ConfigError) as info:
        itd.load_config(str(cfg))
    keys = {p.split(":")[0] for p in info.value.problems}
    assert keys == {"servers.ops.approve.tools", "servers.ops.approve.to", "servers.ops.approve.expires",
                    "servers.ops.approve.x"}


# Migrations #####################################################################################

FIXTURES = Path(__file__).parent / "fixtures"      # schema-v2.sql: a file as version 2 made it


async def test_a_file_of_version_2_is_migrated(tmp_path, aiohttp_client):
    db = str(tmp_path / "v2.db")
    conn = sqlite3.connect(db, isolation_level=None)
    conn.executescript((FIXTURES / "schema-v2.sql").read_text())
    conn.execute("PRAGMA user_version = 2")
    conn.close()
    log = tmp_path / "ops-calls.jsonl"
    d = await start_daemon(aiohttp_client, db, config=ops_config(log))
    d.calls_log = log
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == itd.SCHEMA_VERSION >= 3
    assert "approval" in [r[1] for r in conn.execute("PRAGMA table_info(requests)")]
    conn.close()
    run_id = await ask(d)
    assert (await request_of(d, run_id))["approval"]["tool"] == "restart_service"


def test_a_postgres_database_of_version_2_is_migrated():
    import psycopg
    with fresh_postgres() as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute((FIXTURES / "schema-postgres-v2.sql").read_text())
            conn.execute("INSERT INTO schema_version (version) VALUES (2)")
        tx = itd.open_sync(url)
        try:
            assert tx.conn.execute("SELECT version FROM schema_version").fetchone()[0] == itd.SCHEMA_VERSION
            cols = [r[0] for r in tx.conn.execute("SELECT column_name FROM information_schema.columns"
                                                  " WHERE table_name = 'requests'").fetchall()]
            assert "approval" in cols
        finally:
            tx.close()


# The page #########################################################################################

@pytest.fixture
def served_ops(tmp_path):
    """`interactiond serve --clock manual` with the ops server, signed in from the URL it prints."""
    from test_web_inbox import Served

    log = tmp_path / "ops-calls.jsonl"
    (tmp_path / "interactiond.yaml").write_text(json.dumps({
        "servers": {"ops": {"command": [sys.executable, OPS, "--calls-log", str(log)]}},
        "playbooks": {"local/default": {"servers": ["ops"]}}}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "interactiond", "serve", "--db", str(tmp_path / "inbox.db"), "--config",
         str(tmp_path / "interactiond.yaml"), "--host", "127.0.0.1", "--port", "0", "--clock", "manual"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    printed: dict[str, str] = {}
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("inbox: "):
                printed["login"] = line.split(" ", 1)[1].strip()
                ready.set()
        ready.set()
    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(30) and "login" in printed, "serve printed no inbox URL"
        login = printed["login"]
        served = Served(proc, login.split("/login", 1)[0], login, (tmp_path / "inbox.db.token").read_text().strip())
        served.calls_log = log
        yield served
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_page_shows_an_approval_with_its_editable_arguments(served_ops):
    from test_web_inbox import CHROMIUM, CHROMIUM_ARGS, _playwright
    served = served_ops
    sync_api = _playwright()
    expect = sync_api.expect
    expect.set_options(timeout=10_000)
    served.define("restart", RESTART.replace("edit: [/service, /force]", "edit: [/service]"))
    first = served.run("restart", {"service": "web", "owner": "ana"})
    second = served.run("restart", {"service": "db", "owner": "ana"})
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            broken: list[str] = []
            page.on("pageerror", lambda exc: broken.append(str(exc)))
            page.goto(served.login_url)
            item = page.locator(f'li[data-run-id="{first}"]')
            expect(item.locator(".msg strong")).to_have_text("web")
            expect(item.locator(".meta").nth(1)).to_contain_text("restart_service")
            expect(item.locator(".meta").nth(1)).to_contain_text("may change something")
            rows = item.locator("table.arguments tbody tr")
            expect(rows).to_have_count(2)
            expect(rows.nth(1)).to_contain_text("force")
            expect(rows.nth(1).locator("input, select")).to_have_count(0)      # not editable: shown only
            service = item.get_by_label("service (may change)")
            expect(service).to_have_value("web")
            # An edit the tool's schema refuses: the daemon's error lands at its field, nothing is called.
            service.fill("Not A Name!")
            item.get_by_role("button", name="Approve").click()
            expect(item.locator("td .err")).to_contain_text("does not match")
            expect(service).to_have_attribute("aria-invalid", "true")
            assert not served.calls_log.exists()
            service.fill("api")
            item.get_by_label("Note (optional)").fill("after the deploy")
            item.get_by_role("button", name="Approve").click()
            expect(item).to_have_count(0)
            status, run = served.call("POST", f"/runs/{first}/wait?timeout=10")
            assert status == 200 and run["output"] == "restarted api", run
            assert [json.loads(x) for x in served.calls_log.read_text().splitlines()] == [
                {"tool": "restart_service", "arguments": {"service": "api", "force": False}}]
            # Reject, with a note.
            other = page.locator(f'li[data-run-id="{second}"]')
            other.get_by_label("Note (optional)").fill("not today")
            other.get_by_role("button", name="Reject").click()
            expect(other).to_have_count(0)
            run = served.call("GET", f"/runs/{second}")[1]
            assert run["kind"] == "declined" and "not today" in run["problem"]["detail"]
            assert broken == []
        finally:
            browser.close()
