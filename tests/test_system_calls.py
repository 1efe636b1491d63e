"""Functions that ask a system, against a real misbehaving MCP tool server started as a subprocess."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

import interactiond as itd
from daemon_kit import start_daemon, until

FLAKY = str(Path(__file__).parent / "servers" / "flaky_server.py")
SECRET = "s3cr3t-flaky-value"


def call_doc(tool: str, with_: str = "{}", read: str | None = None, output: str = "{}", server: str = "flaky") -> str:
    lines = ["---", "description: Asks the flaky server", "call:", f"  server: {server}", f"  tool: {tool}",
             f"  with: {with_}"]
    if read:
        lines.append(f"  read: {read}")
    lines += ["input:", "  schema:", "    type: object", "    additionalProperties: true",
              f"output:", f"  schema: {output}", "---", ""]
    return "\n".join(lines)


@pytest.fixture
async def d(db, tmp_path, aiohttp_client):
    log = tmp_path / "calls.jsonl"
    servers = {
        "flaky": itd.ServerConfig("flaky", command=(sys.executable, FLAKY, "--calls-log", str(log)),
                                  env={"FLAKY_SECRET": SECRET}),
        "quiet": itd.ServerConfig("quiet", command=(sys.executable, FLAKY), record_content=False),
        "limited": itd.ServerConfig("limited", command=(sys.executable, FLAKY), tools=("echo",)),
        "ghost": itd.ServerConfig("ghost", command=(sys.executable, FLAKY, "--exit-at-start")),
        "unused": itd.ServerConfig("unused", command=(sys.executable, FLAKY)),
    }
    config = itd.Config(servers=servers, playbooks={"local/default": ("flaky", "quiet", "limited", "ghost"),
                                                    "acme/other": ()})
    daemon = await start_daemon(aiohttp_client, db, config=config)
    daemon.calls_log = log
    return daemon


def calls(d) -> list[dict]:
    if not d.calls_log.exists():
        return []
    return [json.loads(line) for line in d.calls_log.read_text().splitlines() if line.strip()]


async def run_fn(d, name: str, source: str, input_=None, run_id=None):
    await d.define(name, source)
    return await d.run(name, input_ or {}, run_id=run_id)


async def history(d, run_id):
    return (await d.call("GET", f"/runs/{run_id}/events"))[1]["data"]


async def test_success_reads_structured_content(d):
    status, run = await run_fn(d, "echo", call_doc("echo", "{text: '{{ input.text }}', n: '{{ input.n }}'}",
                                                   read="/echo", output="{type: string}"), {"text": "hi", "n": 3})
    assert status == 201 and run["status"] == "succeeded" and run["output"] == "hi"
    assert calls(d) == [{"tool": "echo", "arguments": {"text": "hi", "n": 3}}]   # n stays a number
    events = await history(d, run["run_id"])
    assert [e["type"] for e in events] == ["tool_call_started", "tool_call_answered", "run_succeeded"]
    assert events[0]["payload"]["arguments"] == {"text": "hi", "n": 3}
    assert events[0]["payload"]["arguments_sha256"] == itd.sha256_hex(itd.dumps({"text": "hi", "n": 3}))


async def test_text_json_and_plain_text_answers(d):
    status, run = await run_fn(d, "tj", call_doc("text_json", output="{type: object}"))
    assert status == 201 and isinstance(run["output"], dict)
    status, run = await run_fn(d, "pt", call_doc("plain_text", output="{type: string}"))
    assert status == 201 and isinstance(run["output"], str)


@pytest.mark.parametrize("tool,read,output,why", [
    ("empty", None, "{}", "nothing to read"),
    ("echo", "/missing", "{}", "nothing at /missing"),
    ("echo", "/echo", "{type: integer}", "does not match"),
    ("big", None, "{}", "1 MiB"),
])
async def test_unusable_answers_are_unworkable(d, tool, read, output, why):
    with_ = "{text: x}" if tool == "echo" else "{}"
    status, run = await run_fn(d, "u", call_doc(tool, with_, read=read, output=output))
    assert status == 409 and run["kind"] == "unworkable", run
    assert why in run["problem"]["detail"]
    assert [c["tool"] for c in calls(d)] == [tool]


@pytest.mark.parametrize("tool,status_,kind,because,event", [
    ("fail_ro", 503, "tools_unfinished", "tool_error", "tool_call_answered"),
    ("fail_rw", 409, "effect_unknown", "tool_error", "tool_call_answered"),
    ("crash_ro", 503, "tools_unfinished", "server_failed", "tool_call_failed"),
    ("crash_rw", 409, "effect_unknown", "server_failed", "tool_call_failed"),
])
async def test_failed_calls(d, tool, status_, kind, because, event):
    status, run = await run_fn(d, "f", call_doc(tool, "{text: x}"), run_id="once")
    assert status == status_ and run["kind"] == kind and run["problem"]["because"] == because, run
    types = [e["type"] for e in await history(d, run["run_id"])]
    assert types == ["tool_call_started", event, "run_" + run["status"]]
    # A run that called its tool and failed is never run again under its id.
    status, again = await d.run("f", {}, run_id="once")
    assert status == 409 and again["kind"] == "tools_called"
    assert len(calls(d)) == 1
    # After a crash the session is reopened for the next run.
    status, ok = await run_fn(d, "echo", call_doc("echo", "{text: back}", read="/echo", output="{type: string}"))
    assert status == 201 and ok["output"] == "back"


async def test_hung_call_times_out_and_blocks_nobody(d, monkeypatch):
    monkeypatch.setattr(itd, "CALL_TIMEOUT_S", 2.0)
    await d.define("hang", call_doc("hang_ro"))
    await d.define("echo", call_doc("echo", "{text: meanwhile}", read="/echo", output="{type: string}"))
    hung = asyncio.create_task(d.run("hang", {}))
    await until(lambda: calls(d), what="the hanging tool is called")
    status, ok = await d.run("echo", {})
    assert status == 201 and ok["output"] == "meanwhile" and not hung.done()
    status, run = await hung
    assert status == 503 and run["kind"] == "tools_unfinished" and run["problem"]["because"] == "server_failed"


async def test_refused_arguments_are_unworkable(d):
    status, run = await run_fn(d, "extra", call_doc("echo", "{text: x, bogus: 1}"))
    assert status == 409 and run["kind"] == "unworkable" and run["problem"]["errors"][0]["pointer"] == "/arguments"
    assert calls(d) == []                                 # checked before sending
    assert [e["type"] for e in await history(d, run["run_id"])] == ["run_conflict"]
    status, run = await run_fn(d, "inv", call_doc("invalid_params", "{x: 1}"))
    assert status == 409 and run["kind"] == "unworkable" and "refused the arguments" in run["problem"]["detail"]


@pytest.mark.parametrize("server,tool,kind", [
    ("flaky", "no_such_tool", "tool_not_offered"),
    ("unused", "echo", "tool_not_offered"),
    ("limited", "write", "tool_not_offered"),
    ("ghost", "echo", "tool_server_failed"),
])
async def test_nothing_sent_endings(d, server, tool, kind):
    status, run = await run_fn(d, "n", call_doc(tool, "{text: x}", server=server))
    assert status == 503 and run["kind"] == kind, run
    assert "search" in run["problem"]["detail"]
    assert calls(d) == []


async def test_secrets_never_recorded(d):
    status, run = await run_fn(d, "sec", call_doc("secret_echo", "{text: 'key {{ input.k }}'}", output="{type: object}"),
                               {"k": SECRET})
    assert status == 201
    # The secret came back from the tool; the run's output is the caller's, but no event holds it.
    events = await history(d, run["run_id"])
    for e in events[:-1]:
        whole = (await d.call("GET", f"/events/{e['id']}"))[1]
        assert SECRET not in json.dumps(whole), e["type"]
    status, res = await d.call("POST", "/tools/flaky/secret_echo", {"arguments": {"text": SECRET, "api_key": "k-123456"}})
    # secret_echo takes only text, so the extra key is refused before sending
    assert status == 409
    status, res = await d.call("POST", "/tools/flaky/secret_echo", {"arguments": {"text": "t"}})
    assert status == 200
    _, evs = await d.call("GET", "/events?type=tool_call_answered")
    assert evs["data"] and all(SECRET not in json.dumps(e) for e in evs["data"])


async def test_record_content_false_keeps_sizes_and_digests(d):
    status, run = await run_fn(d, "q", call_doc("echo", "{text: private}", read="/echo", output="{type: string}",
                                                server="quiet"))
    assert status == 201
    events = await history(d, run["run_id"])
    assert "private" not in json.dumps(events[:2])
    assert set(events[0]["payload"]["arguments"]) == {"size", "sha256"}


async def test_search_introspect_execute_over_http(d):
    status, found = await d.call("GET", "/tools")
    assert status == 200
    servers = {s["name"]: s for s in found["servers"]}
    assert set(servers) == {"flaky", "quiet", "limited", "ghost"}
    assert servers["ghost"]["available"] is False
    assert [t["name"] for t in servers["limited"]["tools"]] == ["echo"]
    flaky = {t["name"]: t for t in servers["flaky"]["tools"]}
    assert flaky["echo"]["read_only"] is True and flaky["write"]["read_only"] is False
    status, info = await d.call("GET", "/tools/flaky/echo")
    assert status == 200 and info["input_schema"]["required"] == ["text"]
    status, out = await d.call("POST", "/tools/flaky/echo", {"arguments": {"text": "yo"}})
    assert status == 200 and out["answer"]["echo"] == "yo" and out["is_error"] is False
    _, evs = await d.call("GET", "/events?type=tool_call_answered")
    assert evs["data"][-1]["payload"]["tool"] == "echo"
    assert (await d.call("GET", "/tools", playbook="acme/other", role="other"))[1] == {"servers": []}
    assert (await d.call("GET", "/tools/unused/echo"))[0] == 503
    assert (await d.call("POST", "/tools/flaky/echo", {"arguments": {}}, role="reader"))[0] == 403


@pytest.mark.parametrize("tool,status_,kind", [("hang_rw", "conflict", "effect_unknown"),
                                                ("hang_ro", "unavailable", "tools_unfinished")])
async def test_a_call_cut_off_by_a_stop_ends_at_restart(d, aiohttp_client, tool, status_, kind):
    await d.define("hang", call_doc(tool))
    pending = asyncio.create_task(d.run("hang", {}, run_id="cut"))
    await until(lambda: calls(d), what="the hanging tool is called")
    assert [c["tool"] for c in calls(d)] == [tool]
    status, run = await d.call("GET", "/runs/cut")
    assert run["status"] == "started"
    pending.cancel()
    await d.client.close()
    d2 = await start_daemon(aiohttp_client, d.db, clock=itd.ManualClock(d.clock.now_ms()), tokens=d.tokens,
                            config=d.engine.config)
    status, run = await d2.call("GET", "/runs/cut")
    assert run["status"] == status_ and run["kind"] == kind and run["problem"]["because"] == "lost"
    status, again = await d2.run("hang", {}, run_id="cut")
    assert status == 409 and again["kind"] == "tools_called"


async def test_search_introspect_execute_over_mcp(d):
    from mcp import Client
    server = itd.make_mcp_server(d.engine, caller=itd.Caller("stdio", itd.Role.OPERATOR))
    async with Client(server) as c:
        found = (await c.call_tool("search", {"query": "echo"})).structured_content
        flaky = next(s for s in found["servers"] if s["name"] == "flaky")
        names = [t["name"] for t in flaky["tools"]]
        assert "echo" in names and "write" not in names          # the query keeps matching tools only
        info = (await c.call_tool("introspect", {"server": "flaky", "tool": "write"})).structured_content
        assert info["read_only"] is False and "text" in info["input_schema"]["properties"]
        r = await c.call_tool("execute", {"server": "flaky", "tool": "echo", "arguments": {"text": "via mcp"}})
        assert not r.is_error and r.structured_content["answer"]["echo"] == "via mcp"
        r = await c.call_tool("execute", {"server": "unused", "tool": "echo", "arguments": {"text": "x"}})
        assert r.is_error and r.structured_content["kind"] == "tool_not_offered"
    assert calls(d)[-1] == {"tool": "echo", "arguments": {"text": "via mcp"}}
