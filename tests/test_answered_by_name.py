"""Who answered, in words: the answer fact keeps `answered_by` as it was and gains `answered_by_name`
(the token's name for a token, the person's for a person, the sender for a reply), which the answer
link's page shows with the time. Over the real aiohttp app on the manual clock, on SQLite and on
PostgreSQL; MCP with the official client; replies from the real example chat server (MCP over stdio)."""
from __future__ import annotations

import sys
import urllib.parse
from pathlib import Path

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

import interactiond as itd
from daemon_kit import APPROVAL, START_MS, person_token

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import chat_server  # noqa: E402

SEED_CHAT = (Path(__file__).parent / "fixtures" / "seed-chat-approval.md").read_text()
WHEN = "2027-01-15 08:00 UTC"                       # START_MS as the answer link's page says it


@pytest.fixture
async def d(chat_d):
    await chat_d.define("approve", APPROVAL)
    return chat_d


async def ask(d, owner: str) -> tuple[str, str]:
    """A waiting run that asks `owner`, and the path of its answer link."""
    status, run = await d.run("approve", {"owner": owner, "review": "r"})
    assert status == 202, run
    _, page = await d.call("GET", "/interactions")
    url = next(r["answer_url"] for r in page["data"] if r["run_id"] == run["run_id"])
    return run["run_id"], urllib.parse.urlsplit(url).path


async def answered_event(d, run_id: str) -> dict:
    _, page = await d.call("GET", f"/runs/{run_id}/events")
    return next(e for e in page["data"] if e["type"] == "request_answered")


async def test_a_tokens_answer_names_the_token_and_a_persons_names_the_person(d):
    # An operator's token (named "operator"): answered_by stays its id, the name is the token's.
    run_id, link = await ask(d, "bob")
    status, fact = await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"verdict": "approve"}})
    assert status == 200, fact
    assert fact["answered_by"].startswith("tok_") and fact["answered_by_name"] == "operator"
    assert fact["answered_at"] == itd.fmt_time(START_MS)
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["settled_by"] == fact["answered_by"]       # as it was
    assert (await answered_event(d, run_id))["payload"]["answered_by_name"] == "operator"
    again = (await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"verdict": "approve"}}, role="writer"))[1]
    assert again == fact                            # the same answer: the same fact, names and all
    page = await (await d.client.get(link)).text()
    assert f"Answered by <strong>operator (an API token)</strong> on {WHEN}" in page and "tok_" not in page

    # A person's token: both name the person, not the token.
    run_id, link = await ask(d, "ana")
    ana = {"Authorization": f"Bearer {person_token(d.db, 'ana')}"}
    resp = await d.client.post(d.url(f"/runs/{run_id}/answer"), json={"answer": {"verdict": "revise"}}, headers=ana)
    fact = await resp.json()
    assert resp.status == 200 and (fact["answered_by"], fact["answered_by_name"]) == ("ana", "ana"), fact
    assert f"Answered by <strong>ana</strong> on {WHEN}" in await (await d.client.get(link)).text()

    # The answer link answers as its addressee; MCP and the typed API as their token.
    run_id, link = await ask(d, "cy")
    resp = await d.client.post(link, json={"answer": {"verdict": "approve"}})
    fact = await resp.json()
    assert resp.status == 200 and (fact["answered_by"], fact["answered_by_name"]) == ("cy", "cy"), fact
    run_id, _ = await ask(d, "dee")
    url = str(d.client.make_url("/mcp"))
    async with httpx2.AsyncClient(headers=d.auth("writer"), timeout=30) as http:
        async with Client(streamable_http_client(url, http_client=http)) as c:
            r = await c.call_tool("answer_interaction", {"run_id": run_id, "answer": {"verdict": "approve"}})
    assert not r.is_error and r.structured_content["answered_by_name"] == "writer", r.structured_content
    run_id, _ = await ask(d, "eve")
    _, v2 = await d.call("GET", f"/v2/interactions?run_id={run_id}")
    resp = await d.client.post(f"/v2/interactions/{v2['data'][0]['id']}/responses",
                               json={"type": "form", "answer": {"verdict": "approve"}},
                               headers={**d.auth("writer"), "Idempotency-Key": "k-eve"})
    assert resp.status == 200, await resp.text()
    assert (await answered_event(d, run_id))["payload"]["answered_by_name"] == "writer"


async def test_a_replys_answer_names_its_sender(d):
    await d.define("chat-approval", SEED_CHAT)
    status, run = await d.run("chat-approval", {"owner": "ana", "draft": "Spring campaign copy"})
    assert status == 202, run
    run_id = run["run_id"]
    _, page = await d.call("GET", "/interactions")
    link = urllib.parse.urlsplit(next(r["answer_url"] for r in page["data"] if r["run_id"] == run_id)).path
    await d.advance("PT0S")                          # delivered
    ts = chat_server.messages(d.chat, "ana")[0]["ts"]
    chat_server.say(d.chat, "ana", "ana", "Approve! Looks good", thread_ts=ts)
    await d.advance("PT1M")                          # read, and taken
    _, ended = await d.call("GET", f"/runs/{run_id}")
    assert ended["status"] == "succeeded" and ended["settled_by"] == "playbook:local/default"
    event = await answered_event(d, run_id)
    assert event["by"] == "playbook:local/default" and event["payload"]["answered_by_name"] == "ana"
    shown = await (await d.client.get(link)).text()
    assert "Answered by <strong>ana</strong> on 2027-01-15 08:01 UTC" in shown, shown
    # The fact, as the same answer again gives it back.
    status, fact = await d.call("POST", f"/runs/{run_id}/answer", {"answer": ended["output"]})
    assert status == 200 and (fact["answered_by"], fact["answered_by_name"]) == ("playbook:local/default", "ana")
