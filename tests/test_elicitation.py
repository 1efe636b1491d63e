"""The MCP elicitation bridge (SPEC section 21): wait_run asks the person at the client.

Each scenario runs with the official `mcp` client and its `elicitation_callback`, in both protocol
eras (2025-11-25: `elicitation/create` over the session; 2026-07-28: `input_required` and the
client's retry), over streamable HTTP (the real app, on SQLite and on PostgreSQL, the person named
by `mcp.as`) and over stdio (a real `interactiond stdio --as ana` subprocess). The relay `stdio`
becomes when `serve` runs, a person's token, and the Interactiond-As header have their own tests.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp import types as mt
from mcp.client.streamable_http import streamable_http_client

import interactiond as itd
from daemon_kit import APPROVAL, database, start_daemon, until

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}

#: A plan whose answer nests an object: no MCP form can hold it, so the answer link asks it.
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
      budget:
        type: object
        required: [amount]
        properties: {amount: {type: integer, minimum: 1}, currency: {type: string}}
---
Set the budget of the launch, {{ input.owner }}.
"""

#: (transport, backend, client mode): HTTP on both backends, stdio on a file; both eras each.
WHERE = [("http", "sqlite", "legacy"), ("http", "sqlite", "auto"), ("http", "postgres", "legacy"),
         ("http", "postgres", "auto"), ("stdio", "sqlite", "legacy"), ("stdio", "sqlite", "auto")]


def accept(content: dict[str, Any] | None = None) -> mt.ElicitResult:
    return mt.ElicitResult(action="accept", content=content)


@dataclass
class Bridge:
    """One MCP client whose person is ana, and what its callback was asked."""

    transport: str
    mode: str
    c: Any = None
    asks: list[Any] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)          # URL elicitations the daemon said are done
    respond: Callable[[Any, int], Awaitable[mt.ElicitResult]] | None = None
    answer_elsewhere: Callable[[str, dict[str, Any]], Awaitable[Any]] | None = None
    daemon: Any = None

    @property
    def legacy(self) -> bool:
        return self.mode == "legacy"

    async def on_elicit(self, ctx: Any, params: Any) -> mt.ElicitResult:
        self.asks.append(params)
        assert self.respond is not None, "asked when nobody should be"
        return await self.respond(params, len(self.asks))

    async def on_message(self, msg: Any) -> None:
        if isinstance(msg, mt.ElicitCompleteNotification):
            self.completed.append(msg.params.elicitation_id)

    async def tool(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        r = await self.c.call_tool(name, args)
        assert not r.is_error, r
        return r.structured_content

    async def start(self, owner: str, name: str = "approve") -> str:
        input_ = {"owner": owner, "review": f"the brief of {owner}"} if name == "approve" else {"owner": owner}
        return (await self.tool("run_definition", {"name": name, "input": input_}))["run_id"]

    async def wait(self, run_id: str, timeout: float = 30) -> Any:
        return await self.c.call_tool("wait_run", {"run_id": run_id, "timeout": timeout})

    async def events(self, run_id: str) -> list[dict[str, Any]]:
        return (await self.tool("list_run_events", {"run_id": run_id}))["data"]


@pytest.fixture(params=WHERE, ids=["-".join(w) for w in WHERE])
def where(request, tmp_path, aiohttp_client):
    """Where a test's client runs; `bridge(where)` opens it in the test's own task (the MCP client's
    task groups must be left in the task that entered them)."""
    return request.param, tmp_path, aiohttp_client


@contextlib.asynccontextmanager
async def bridge(where):
    (transport, backend, mode), tmp_path, aiohttp_client = where
    b = Bridge(transport, mode)
    with database(backend, tmp_path) as db:
        async with contextlib.AsyncExitStack() as stack:
            if transport == "http":
                d = b.daemon = await start_daemon(aiohttp_client, db, config=itd.Config(mcp_as="ana"))
                http = await stack.enter_async_context(httpx2.AsyncClient(headers=d.auth(), timeout=30))
                target: Any = streamable_http_client(str(d.client.make_url("/mcp")), http_client=http)

                async def elsewhere(run_id: str, answer: dict[str, Any]) -> Any:     # the inbox's API
                    status, fact = await d.call("POST", f"/runs/{run_id}/answer", {"answer": answer}, role="writer")
                    return fact
            else:
                target = StdioServerParameters(command=sys.executable, args=["-m", "interactiond", "stdio", "--db", db,
                                                                             "--as", "ana"], env=ENV, cwd=str(tmp_path))

                async def elsewhere(run_id: str, answer: dict[str, Any]) -> Any:     # the agent's own call
                    r = await b.c.call_tool("answer_interaction", {"run_id": run_id, "answer": answer})
                    return r.structured_content
            b.answer_elsewhere = elsewhere
            b.c = await stack.enter_async_context(Client(target, mode=mode, read_timeout_seconds=30,
                                                         elicitation_callback=b.on_elicit,
                                                         message_handler=b.on_message))
            await b.tool("create_definition", {"name": "approve", "source": APPROVAL})
            await b.tool("create_definition", {"name": "plan", "source": PLAN})
            yield b


async def test_accept_answers_as_the_person_and_only_their_own(where):
    async with bridge(where) as h:
        bob = await h.start("bob")
        r = await h.wait(bob, 0.3)                      # bob's request is not here: never asked
        assert r.structured_content["status"] == "waiting" and h.asks == []
        run_id = await h.start("ana")

        async def respond(params, n):
            return accept({"verdict": "approve", "note": "ship it"})
        h.respond = respond
        r = await h.wait(run_id)
        run = r.structured_content
        assert not r.is_error and run["status"] == "succeeded", run
        assert run["output"] == {"verdict": "approve", "note": "ship it"} and run["settled_by"] == "ana"
        [asked] = h.asks
        assert isinstance(asked, mt.ElicitRequestFormParams) and "the brief of ana" in asked.message
        assert asked.requested_schema == {"type": "object", "required": ["verdict"], "properties": {
            "verdict": {"type": "string", "enum": ["approve", "revise"]},
            "note": {"type": "string", "maxLength": 2000}}}
        answered = [e for e in await h.events(run_id) if e["type"] == "request_answered"]
        assert [e["by"] for e in answered] == ["ana"]
        assert (await h.wait(bob, 0)).structured_content["status"] == "waiting" and len(h.asks) == 1


async def test_an_invalid_answer_is_asked_again_three_times_in_all(where):
    async with bridge(where) as h:
        run_id = await h.start("ana")

        async def wrong(params, n):
            return accept({"verdict": "maybe"})
        h.respond = wrong
        r = await h.wait(run_id, 1)
        assert r.structured_content["status"] == "waiting" and len(h.asks) == 3     # then the wait went on
        assert "was not taken" not in h.asks[0].message
        for n, again in ((2, h.asks[1]), (3, h.asks[2])):
            assert "That answer was not taken" in again.message and "verdict: 'maybe' is not one of" in again.message
            assert f"(ask {n} of 3)" in again.message and "the brief of ana" in again.message
        assert not any(e["type"] == "request_answered" for e in await h.events(run_id))

        async def right(params, n):
            return accept({"verdict": "revise"})
        h.respond = right                               # a new wait asks again
        r = await h.wait(run_id)
        assert r.structured_content["status"] == "succeeded" and r.structured_content["output"] == {"verdict": "revise"}
        assert len(h.asks) == 4


async def test_decline_leaves_the_request_open_and_the_wait_goes_on(where):
    async with bridge(where) as h:
        run_id = await h.start("ana")
        action = "decline" if h.legacy else "cancel"
        asked = asyncio.Event()

        async def respond(params, n):
            asked.set()
            return mt.ElicitResult(action=action)
        h.respond = respond
        waiting = asyncio.create_task(h.wait(run_id))
        await asyncio.wait_for(asked.wait(), 10)
        async def declines() -> list[dict]:             # the decline is recorded; the request stays open
            return [e for e in await h.events(run_id) if e["type"] == "elicitation_declined"]
        declined = await until(declines, what="the decline is recorded")
        assert [(e["by"], e["payload"]) for e in declined] == [("ana", {"mode": "form", "action": action})]
        assert not waiting.done()
        inbox = (await h.tool("list_interactions", {"to": "ana"}))["data"]
        assert [x["run_id"] for x in inbox] == [run_id]
        await h.answer_elsewhere(run_id, {"verdict": "approve"})
        r = await asyncio.wait_for(waiting, 10)
        run = r.structured_content
        assert run["status"] == "succeeded" and run["output"] == {"verdict": "approve"}
        assert len(h.asks) == 1                         # the same wait did not ask again


async def test_a_nested_answer_is_asked_through_the_answer_link(where):
    async with bridge(where) as h:
        run_id = await h.start("ana", "plan")
        [item] = (await h.tool("list_interactions", {"to": "ana"}))["data"]
        asked = asyncio.Event()

        async def respond(params, n):
            asked.set()
            return accept()                             # the person agreed to open the link
        h.respond = respond
        waiting = asyncio.create_task(h.wait(run_id))
        await asyncio.wait_for(asked.wait(), 10)
        [link] = h.asks
        assert isinstance(link, mt.ElicitRequestURLParams) and link.url == item["answer_url"]
        assert "Set the budget of the launch, ana." in link.message
        answer = {"budget": {"amount": 1200, "currency": "EUR"}}
        if h.transport == "http":                       # the person answers on the link's page
            path = urllib.parse.urlsplit(link.url).path
            resp = await h.daemon.client.post(path, json={"answer": answer})
            assert resp.status == 200 and (await resp.json())["answered_by"] == "ana"
        else:
            await h.answer_elsewhere(run_id, answer)
        r = await asyncio.wait_for(waiting, 10)
        assert r.structured_content["status"] == "succeeded" and r.structured_content["output"] == answer
        if h.legacy:                                    # the client hears the link's question is done
            assert h.completed == [link.elicitation_id]
        assert len(h.asks) == 1


async def test_answered_elsewhere_while_the_question_is_open(where):
    async with bridge(where) as h:
        run_id = await h.start("ana")
        if h.legacy:                                    # withdrawn: the pending elicitation/create is cancelled
            opened, cancelled = asyncio.Event(), asyncio.Event()

            async def respond(params, n):
                opened.set()
                try:
                    await asyncio.Event().wait()        # never answered: only withdrawn
                except asyncio.CancelledError:
                    cancelled.set()
                    raise
                return accept({"verdict": "revise"})
            h.respond = respond
            waiting = asyncio.create_task(h.wait(run_id))
            await asyncio.wait_for(opened.wait(), 10)
            await h.answer_elsewhere(run_id, {"verdict": "approve"})
            r = await asyncio.wait_for(waiting, 10)
            await asyncio.wait_for(cancelled.wait(), 10)
        else:                                           # not withdrawable: the late answer is refused
            async def respond(params, n):
                await h.answer_elsewhere(run_id, {"verdict": "approve"})
                return accept({"verdict": "revise"})
            h.respond = respond
            r = await h.wait(run_id)
            assert "The answer given at the client was not taken" in r.content[-1].text
        run = r.structured_content
        assert not r.is_error and run["status"] == "succeeded" and run["output"] == {"verdict": "approve"}
        assert run["settled_by"] != "ana" and len(h.asks) == 1
        answered = [e for e in await h.events(run_id) if e["type"] == "request_answered"]
        assert len(answered) == 1 and answered[0]["payload"]["answer"] == {"verdict": "approve"}


# Who is at the client ##############################################################################

@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_persons_token_and_an_operators_header_name_the_person(db, aiohttp_client, mode):
    d = await start_daemon(aiohttp_client, db)              # no mcp.as: the session names its person
    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", {"owner": "ana", "review": "R"})
    conn = itd.open_sync(db)
    try:
        ana_token = itd.create_token(conn, "writer", "local/default", "ana's", person="ana")[1]
    finally:
        conn.close()
    asks = []

    async def on_elicit(ctx, params):
        asks.append(params)
        return accept({"option_ids": ["b"]} if "option_ids" in params.requested_schema["properties"]
                      else {"verdict": "approve"})
    url = str(d.client.make_url("/mcp"))

    @contextlib.asynccontextmanager
    async def client(headers):
        async with httpx2.AsyncClient(headers=headers, timeout=30) as http:
            async with Client(streamable_http_client(url, http_client=http), mode=mode,
                              elicitation_callback=on_elicit) as c:
                yield c
    async with client(d.auth()) as c:                      # an operator's token naming nobody: not asked
        r = await c.call_tool("wait_run", {"run_id": run["run_id"], "timeout": 0.2})
        assert r.structured_content["status"] == "waiting" and asks == []
    async with client({**d.auth("writer"), "Interactiond-As": "ana"}) as c:    # only an operator may name one
        r = await c.call_tool("wait_run", {"run_id": run["run_id"], "timeout": 0.2})
        assert r.is_error and r.structured_content["status"] == 403 and asks == []
    async with client({"Authorization": f"Bearer {ana_token}"}) as c:
        [item] = (await c.call_tool("list_interactions", {})).structured_content["data"]
        r = await c.call_tool("wait_run", {"run_id": item["run_id"], "timeout": 20})
        assert r.structured_content["status"] == "succeeded" and r.structured_content["settled_by"] == "ana"
        assert "input" not in r.structured_content          # a person sees the outcome, not the run's input
    async with client({**d.auth(), "Interactiond-As": "ana"}) as c:
        r = await c.call_tool("ask", {"type": "choice", "prompt": "Which colour?", "to": "ana",
                                      "options": [{"id": "r", "label": "Red"}, {"id": "b", "label": "Blue"}]})
        r = await c.call_tool("wait_run", {"run_id": r.structured_content["run_id"], "timeout": 20})
        assert r.structured_content["status"] == "succeeded" and r.structured_content["settled_by"] == "ana"
        assert r.structured_content["output"] == {"option_ids": ["b"]}
    assert len(asks) == 2 and asks[1].requested_schema["properties"]["option_ids"] == {     # labelled choices
        "type": "array", "minItems": 1, "maxItems": 1, "description": "The ids of the options picked",
        "items": {"anyOf": [{"const": "r", "title": "Red"}, {"const": "b", "title": "Blue"}]}}


@pytest.fixture
def served(tmp_path):
    """`interactiond serve` on a fresh directory (the relay's daemon)."""
    proc = subprocess.Popen([sys.executable, "-m", "interactiond", "serve", "--port", "0", "--clock", "manual",
                             "--host", "127.0.0.1"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)
    for line in proc.stdout:
        if line.startswith("inbox:"):
            break
    yield tmp_path
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_stdio_as_a_person_relays_the_question_when_serve_runs(served, mode):
    asks = []

    async def on_elicit(ctx, params):
        asks.append(params)
        return accept({"approved": len(asks) > 1} if len(asks) > 1 else {"comment": "no choice made"})
    params = StdioServerParameters(command=sys.executable, args=["-m", "interactiond", "stdio", "--as", "ana"],
                                   cwd=str(served), env=ENV)
    async with Client(params, mode=mode, read_timeout_seconds=60, elicitation_callback=on_elicit) as c:
        r = await c.call_tool("ask", {"type": "approval", "prompt": "Ship the **launch**?", "to": "ana"})
        run_id = r.structured_content["run_id"]
        r = await c.call_tool("wait_run", {"run_id": run_id, "timeout": 30})
        assert r.structured_content["status"] == "succeeded", r
        assert r.structured_content["output"] == {"approved": True}
        assert r.structured_content["settled_by"] == "ana"
    assert [type(a) for a in asks] == [mt.ElicitRequestFormParams] * 2
    assert "Ship the **launch**?" in asks[0].message
    assert "- approved: 'approved' is a required property" in asks[1].message


# The form, and the settings ########################################################################

def test_which_answer_schemas_are_forms():
    for kind in ("approval", "text", "confirmation"):              # the canonical shapes are forms
        assert itd.elicitation_form(itd.ASK_ANSWER_SCHEMAS[kind]) is not None, kind
    assert itd.elicitation_form(itd.ASK_ANSWER_SCHEMAS["choice"]) is None    # free texts, until a run names ids
    form = itd.elicitation_form({"type": "object", "additionalProperties": False, "required": ["code"], "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}$", "format": "duration"},
        "size": {"type": "integer", "minimum": 1, "exclusiveMaximum": 9},
        "tags": {"type": "array", "items": {"anyOf": [{"const": "a", "title": "A"}]}, "uniqueItems": True},
        "pick": {"type": "string", "oneOf": [{"const": "x", "title": "Ex"}, {"const": "y"}]}}})
    assert form == {"type": "object", "required": ["code"], "properties": {   # the daemon checks the rest
        "code": {"type": "string"}, "size": {"type": "integer", "minimum": 1},
        "tags": {"type": "array", "items": {"anyOf": [{"const": "a", "title": "A"}]}},
        "pick": {"type": "string", "oneOf": [{"const": "x", "title": "Ex"}, {"const": "y"}]}}}
    for not_a_form in ({"type": "object", "properties": {"a": {"type": "object"}}},
                       {"type": "object", "properties": {"a": {"type": ["string", "null"]}}},
                       {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}},
                       {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}},
                       {"type": "object", "properties": {"a": {"type": "string"}}, "oneOf": [{"required": ["a"]}]},
                       {"type": "object", "properties": {}}, {"type": "string"}):
        assert itd.elicitation_form(not_a_form) is None, not_a_form


def test_mcp_as_in_the_configuration_and_on_the_command_line(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("mcp: {as: ' ana '}\n")
    assert itd.load_config(str(good)).mcp_as == "ana"
    bad = tmp_path / "bad.yaml"
    bad.write_text("mcp: {as: '', who: x}\n")
    with pytest.raises(itd.ConfigError) as err:
        itd.load_config(str(bad))
    assert err.value.problems == ["mcp.who: unknown key", "mcp.as: the person at the MCP client, as requests name"
                                  " them (at most 256 bytes)"]
    out = subprocess.run([sys.executable, "-m", "interactiond", "stdio", "--db", str(tmp_path / "t.db"), "--as", " "],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and re.fullmatch(r"interactiond: --as: .+\n", out.stderr), out.stderr


async def test_a_client_with_only_the_url_mode_gets_the_link(db, aiohttp_client, monkeypatch):
    from mcp.client.session import ClientSession

    built = ClientSession._build_capabilities

    def url_only(self, version):                    # a client that declares elicitation's URL mode alone
        caps = built(self, version)
        return caps.model_copy(update={"elicitation": mt.ElicitationCapability(url=mt.UrlElicitationCapability())})
    monkeypatch.setattr(ClientSession, "_build_capabilities", url_only)
    d = await start_daemon(aiohttp_client, db, config=itd.Config(mcp_as="ana"))
    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", {"owner": "ana", "review": "R"})
    asks = []

    async def on_elicit(ctx, params):
        asks.append(params)
        status, _ = await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "approve"}})
        return accept()
    async with httpx2.AsyncClient(headers=d.auth(), timeout=30) as http:
        async with Client(streamable_http_client(str(d.client.make_url("/mcp")), http_client=http), mode="legacy",
                          elicitation_callback=on_elicit) as c:
            r = await c.call_tool("wait_run", {"run_id": run["run_id"], "timeout": 20})
    assert r.structured_content["status"] == "succeeded"
    [link] = asks
    assert isinstance(link, mt.ElicitRequestURLParams) and "/a/" in link.url
