"""A NUL character (U+0000) in an input, an answer or a document is refused with 422 and where it
is, on SQLite and on PostgreSQL alike (PostgreSQL keeps no NUL in a text), through HTTP v1 and v2
and MCP, and nothing is written. Over the real aiohttp app on the manual clock; MCP with the
official client over /mcp."""
from __future__ import annotations

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from daemon_kit import APPROVAL

PROBLEM = "application/problem+json"


@pytest.fixture
async def d(d):
    await d.define("approve", APPROVAL)
    return d


async def post(d, tail: str, body: dict, **headers: str) -> tuple[int, dict]:
    resp = await d.client.post(tail if tail.startswith("/v2/") else d.url(tail), json=body,
                               headers={**d.auth(), **headers})
    assert resp.content_type == PROBLEM, await resp.text()
    return resp.status, await resp.json()


async def mcp_call(d, tool: str, args: dict) -> dict:
    url = str(d.client.make_url("/mcp"))
    async with httpx2.AsyncClient(headers=d.auth(), timeout=30) as http:
        async with Client(streamable_http_client(url, http_client=http)) as c:
            r = await c.call_tool(tool, args)
    assert r.is_error, r
    return r.structured_content


async def test_a_nul_in_an_input_is_422_at_its_pointer_and_starts_no_run(d):
    status, body = await post(d, "/runs", {"name": "approve", "input": {"owner": "ana", "review": "fine\u0000"}})
    assert (status, body["type"]) == (422, "/problems/invalid_input"), body
    assert body["errors"][0]["pointer"] == "/input/review" and "NUL" in body["errors"][0]["message"]
    deep = {"owner": "ana", "review": "r", "extra": [{"a": "x"}, {"b": ["ok", "\u0000"]}]}
    status, body = await post(d, "/runs", {"name": "approve", "input": deep})
    assert status == 422 and body["errors"][0]["pointer"] == "/input/extra/1/b/1", body
    problem = await mcp_call(d, "run_definition", {"name": "approve", "input": {"owner": "a\u0000na", "review": "r"}})
    assert problem["status"] == 422 and problem["type"] == "/problems/invalid_input", problem
    assert problem["errors"][0]["pointer"] == "/input/owner"
    assert (await d.call("GET", "/runs"))[1]["data"] == []            # nothing was started


async def test_a_nul_in_an_answer_is_422_at_its_pointer_on_every_door_and_the_request_stays_open(d):
    status, run = await d.run("approve", {"owner": "ana", "review": "r"})
    assert status == 202, run
    run_id = run["run_id"]
    status, body = await post(d, f"/runs/{run_id}/answer", {"answer": {"verdict": "approve", "note": "go\u0000"}})
    assert (status, body["type"]) == (422, "/problems/invalid_input"), body
    assert body["errors"] == [{"pointer": "/answer/note", "message": body["errors"][0]["message"]}]
    assert "NUL" in body["errors"][0]["message"]
    status, body = await post(d, f"/runs/{run_id}/answer", {"answer": {"verdict": "approve"}, "claimed_for": "b\u0000o"})
    assert status == 422 and body["errors"][0]["pointer"] == "/claimed_for", body
    # The typed API names the field its way.
    _, page = await d.call("GET", f"/v2/interactions?run_id={run_id}")
    iid = page["data"][0]["id"]
    status, body = await post(d, f"/v2/interactions/{iid}/responses",
                              {"type": "form", "answer": {"verdict": "approve", "note": "\u0000"}},
                              **{"Idempotency-Key": "k-nul"})
    assert (status, body["code"]) == (422, "validation_failed"), body
    assert body["errors"][0]["field"] == "answer.note" and "NUL" in body["errors"][0]["message"]
    problem = await mcp_call(d, "answer_interaction", {"run_id": run_id, "answer": {"verdict": "approve",
                                                                                      "note": "a\u0000b"}})
    assert problem["status"] == 422 and problem["errors"][0]["pointer"] == "/answer/note", problem
    # Still open, and a clean answer is taken.
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["status"] == "waiting"
    status, fact = await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"verdict": "approve", "note": "go"}})
    assert status == 200 and fact["answer"] == {"verdict": "approve", "note": "go"}, fact


async def test_a_nul_in_a_document_is_invalid_document_with_its_line(d):
    body_nul = APPROVAL.replace("Approve it, or", "Approve it\u0000, or")
    line = body_nul[:body_nul.index("\u0000")].count("\n") + 1
    front_nul = APPROVAL.replace("expires: P2D", "expires: P2D # \u0000")
    for source, expected in ((body_nul, line), (front_nul, 4)):
        status, body = await post(d, "/definitions", {"type": "interaction", "name": "nul", "source": source})
        assert (status, body["type"]) == (422, "/problems/invalid_document"), body
        assert body["errors"][0]["line"] == expected and "NUL" in body["errors"][0]["message"], body
    problem = await mcp_call(d, "create_definition", {"name": "nul", "source": body_nul})
    assert problem["status"] == 422 and problem["errors"][0]["line"] == line, problem
    _, defs = await d.call("GET", "/definitions")
    assert "nul" not in {x["name"] for x in defs["data"]}
