"""Deputies (SPEC section 25): while a window is open on the daemon's clock, what is addressed to ana is
addressed to ben too - listing, answering, answer links, the page - and ben's answer records
`answered_by: ben`, `on_behalf_of: ana`. The operator's routes and `interactiond deputy` manage them.

End to end over HTTP on SQLite and PostgreSQL, on the manual clock; the command line against a real
`interactiond serve`; the page in a real Chromium.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from daemon_kit import start_daemon
from test_approval import RESTART, calls, ended, history
from test_quorum import d, who  # noqa: F401  (a fixture: the daemon with the ops tool server)
from test_web_inbox import CHROMIUM, CHROMIUM_ARGS, _playwright, served  # noqa: F401  (a fixture)

DEPUTIES = "/deputies"


async def ask(d, run_id: str, to: str = "ana", prompt: str = "Ship the release?") -> None:
    status, run = await d.call("POST", "/runs", {"type": "interaction", "name": "ask-text", "run_id": run_id,
                                                 "input": {"prompt": prompt, "to": to}})
    assert status == 202, run


async def listed(d, role: str, **query) -> list[str]:
    q = "&".join(f"{k}={v}" for k, v in query.items())
    status, page = await d.call("GET", "/interactions" + (f"?{q}" if q else ""), role=role)
    assert status == 200, page
    return [r["run_id"] for r in page["data"]]


async def counts(d, role: str) -> tuple[int, list[dict]]:
    """The inbox page's counts as `role` sees them: (total, by addressee)."""
    resp = await d.client.get("/web/orgs/local/playbooks/default/counts", headers=d.auth(role))
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    return body["total"], body["to"]


async def test_the_operator_adds_lists_and_removes_deputies_and_bad_ones_are_refused(d):
    status, dep = await d.call("POST", DEPUTIES, {"for": "ana", "to": "ben", "from": "2026-12-01T00:00:00Z",
                                                  "until": "2099-12-02T00:00:00+01:00"})
    assert status == 201 and dep["id"].startswith("dep_"), dep
    assert (dep["for"], dep["to"], dep["from"], dep["until"]) == ("ana", "ben", "2026-12-01T00:00:00.000Z",
                                                                  "2099-12-01T23:00:00.000Z")
    status, page = await d.call("GET", DEPUTIES)
    assert status == 200 and [x["id"] for x in page["data"]] == [dep["id"]] and "page" in page
    for body, pointer in (({"for": "ana"}, "/to"), ({"for": "ana", "to": "ana"}, "/to"),
                          ({"for": "ana", "to": "ben", "from": "tomorrow"}, "/from"),
                          ({"for": "ana", "to": "ben", "from": "2026-12-02T00:00:00Z", "until": "2026-12-01T00:00:00Z"},
                           "/until"),
                          ({"for": "ana", "to": "ben", "when": "now"}, "/when")):
        status, problem = await d.call("POST", DEPUTIES, body)
        assert status == 422 and pointer in [e["pointer"] for e in problem["errors"]], (body, problem)
    # Operators only: a writer's token and a person's are refused.
    assert (await d.call("POST", DEPUTIES, {"for": "ana", "to": "cy"}, role="writer"))[0] == 403
    assert (await d.call("GET", DEPUTIES, role=who(d, "ben")))[0] == 404
    status, gone = await d.call("DELETE", f"{DEPUTIES}/{dep['id']}")
    assert status == 200 and gone["id"] == dep["id"]
    assert (await d.call("DELETE", f"{DEPUTIES}/{dep['id']}"))[0] == 404
    assert (await d.call("GET", DEPUTIES))[1]["data"] == []
    events = (await d.call("GET", "/events"))[1]["data"]
    assert [e["type"] for e in events if e["type"].startswith("deputy_")] == ["deputy_added", "deputy_removed"]


async def test_while_the_window_is_open_the_deputy_sees_and_answers_as_themselves_for_the_person(d):
    await ask(d, "for-ana")
    await ask(d, "for-cy", to="cy")
    now = (await d.call("GET", "/runs/for-ana"))[1]["created_at"]
    # A window from an hour on, for a day, on the daemon's clock.
    status, dep = await d.call("POST", DEPUTIES, {"for": "ana", "to": "ben", "from": _plus(now, hours=1),
                                                  "until": _plus(now, hours=25)})
    assert status == 201 and dep["open"] is False
    ben = who(d, "ben")
    assert await listed(d, ben) == [] and await counts(d, ben) == (0, [])
    assert (await d.call("POST", "/runs/for-ana/answer", {"answer": {"text": "yes"}}, role=ben))[0] == 404
    await d.advance("PT1H")
    assert (await d.call("GET", DEPUTIES))[1]["data"][0]["open"] is True
    assert await listed(d, ben) == ["for-ana"]                       # ana's, not cy's
    assert await counts(d, ben) == (1, [{"to": "ana", "count": 1}])   # the page's counts too
    assert await listed(d, ben, to="ana") == ["for-ana"]
    assert await listed(d, "operator", to="ben") == []              # the request stays ana's
    assert (await d.call("GET", "/interactions?to=cy", role=ben))[0] == 404
    status, fact = await d.call("POST", "/runs/for-ana/answer", {"answer": {"text": "ship it"}}, role=ben)
    assert status == 200, fact
    assert fact["answered_by"] == "ben" and fact["on_behalf_of"] == "ana" and fact["answered_by_name"] == "ben"
    [answered] = [e for e in (await d.call("GET", "/runs/for-ana/events"))[1]["data"] if e["type"] == "request_answered"]
    assert answered["by"] == "ben" and answered["payload"]["on_behalf_of"] == "ana"
    # ana's own answer records no one she stood for.
    await ask(d, "again")
    status, fact = await d.call("POST", "/runs/again/answer", {"answer": {"text": "mine"}}, role=who(d, "ana"))
    assert status == 200 and fact["answered_by"] == "ana" and "on_behalf_of" not in fact
    # Once the window closes, ana's requests are hers alone again.
    await ask(d, "later")
    await d.advance("PT24H")
    assert await listed(d, ben) == []
    assert (await d.call("POST", "/runs/later/answer", {"answer": {"text": "x"}}, role=ben))[0] == 404


async def test_a_deputy_answer_link_names_the_deputy_and_closes_with_the_window(d):
    await ask(d, "q")
    status, dep = await d.call("POST", DEPUTIES, {"for": "ana", "to": "ben"})
    assert status == 201 and dep["open"] is True
    [ana_item] = (await d.call("GET", "/interactions", role=who(d, "ana")))[1]["data"]
    [ben_item] = (await d.call("GET", "/interactions", role=who(d, "ben")))[1]["data"]
    assert ana_item["answer_url"] != ben_item["answer_url"]
    ben_link = "/a/" + ben_item["answer_url"].rsplit("/a/", 1)[1]
    page = await d.client.get(ben_link)
    assert page.status == 200 and "Ship the release?" in await page.text()
    forged = ben_link[:-3] + ("AAA" if not ben_link.endswith("AAA") else "BBB")
    assert (await d.client.get(forged)).status == 404
    resp = await d.client.post(ben_link, json={"answer": {"text": "go"}})
    fact = await resp.json()
    assert resp.status == 200 and fact["answered_by"] == "ben" and fact["on_behalf_of"] == "ana", fact
    # A link made while the window was open stops working when it is removed.
    await ask(d, "q2", prompt="And the hotfix?")
    [item] = [i for i in (await d.call("GET", "/interactions", role=who(d, "ben")))[1]["data"] if i["run_id"] == "q2"]
    assert (await d.call("DELETE", f"{DEPUTIES}/{dep['id']}"))[0] == 200
    assert (await d.client.get("/a/" + item["answer_url"].rsplit("/a/", 1)[1])).status == 404


async def test_a_deputy_approves_a_gated_call_for_the_person(d):
    await d.define("restart", RESTART)
    status, run = await d.run("restart", {"service": "web", "owner": "ana"})
    run_id = run["run_id"]
    assert (await d.call("POST", DEPUTIES, {"for": "ana", "to": "ben"}))[0] == 201
    status, fact = await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"approved": True}}, role=who(d, "ben"))
    assert status == 200 and fact["on_behalf_of"] == "ana", fact
    status, run = await ended(d, run_id)
    assert status == 200 and calls(d) == [{"tool": "restart_service", "arguments": {"service": "web", "force": False}}]
    assert [e["payload"]["by"] for e in await history(d, run_id) if e["type"] == "approval_answered"] == ["ben"]


def _plus(stamp: str, *, hours: int) -> str:
    from datetime import datetime, timedelta
    t = datetime.fromisoformat(stamp.replace("Z", "+00:00")) + timedelta(hours=hours)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def test_the_deputy_commands_against_a_running_daemon(served, tmp_path):
    db = str(tmp_path / "inbox.db")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "interactiond", "deputy", *args, "--db", db],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
    added = cli("add", "--for", "ana", "--to", "ben", "--until", "2099-01-02T00:00:00Z")
    assert added.returncode == 0, added.stderr
    dep_id = added.stdout.split()[0]
    assert dep_id.startswith("dep_") and "ben for ana" in added.stdout and "open now" in added.stdout
    listed_ = cli("list")
    assert listed_.returncode == 0 and dep_id in listed_.stdout
    bad = cli("add", "--for", "ana", "--to", "ben", "--from", "soon")
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1 and "/from" in bad.stderr, bad.stderr
    assert cli("add", "--for", "ana", "--to", "cy", "--playbook", "acme/ops").returncode == 0
    assert dep_id not in cli("list", "--playbook", "acme/ops").stdout
    removed = cli("remove", dep_id)
    assert removed.returncode == 0 and dep_id in removed.stdout
    assert dep_id not in cli("list").stdout
    again = cli("remove", dep_id)
    assert again.returncode != 0 and "Not found" in again.stderr
    assert served.call("GET", "/deputies")[1]["data"] == []


def test_the_page_shows_the_deputy_the_persons_requests(served, tmp_path):
    sync_api = _playwright()
    expect = sync_api.expect
    expect.set_options(timeout=10_000)
    assert served.call("POST", "/deputies", {"for": "ana", "to": "ben"})[0] == 201
    status, run = served.call("POST", "/runs", {"type": "interaction", "name": "ask-text",
                                               "input": {"prompt": "Which region?", "to": "ana"}})
    assert status == 202
    out = subprocess.run([sys.executable, "-m", "interactiond", "link", "--for", "ben", "--db", str(tmp_path / "inbox.db")],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(viewport={"width": 1000, "height": 900}).new_page()
            page.goto(out.stdout.split()[0])
            item = page.locator(f'li[data-run-id="{run["run_id"]}"]')
            expect(item).to_be_visible()
            item.get_by_role("textbox", name="Text").fill("eu-west")
            item.get_by_role("button", name="Send the answer").click()
            expect(item).to_have_count(0)
        finally:
            browser.close()
    [answered] = [e for e in served.call("GET", f"/runs/{run['run_id']}/events")[1]["data"]
                  if e["type"] == "request_answered"]
    assert answered["by"] == "ben" and answered["payload"]["on_behalf_of"] == "ana"


async def test_the_typed_api_lists_and_answers_for_the_person_too(d):
    await ask(d, "q")
    ben = who(d, "ben")
    assert (await d.call("GET", "/v2/interactions", role=ben))[1]["data"] == []
    assert (await d.call("POST", DEPUTIES, {"for": "ana", "to": "ben"}))[0] == 201
    [item] = (await d.call("GET", "/v2/interactions", role=ben))[1]["data"]
    assert item["run_id"] == "q" and "/a/" in item["answer_url"]
    resp = await d.client.post(f"/v2/interactions/{item['id']}/responses", json={"type": "text", "text": "go",
                                                                                "digest": item["digest"]},
                               headers={"Authorization": f"Bearer {d.tokens[ben]}", "Idempotency-Key": "k1"})
    body = await resp.json()
    assert resp.status == 200 and body["status"] == "answered", body
    [answered] = [e for e in (await d.call("GET", "/runs/q/events"))[1]["data"] if e["type"] == "request_answered"]
    assert answered["by"] == "ben" and answered["payload"]["on_behalf_of"] == "ana"


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_the_deputys_mcp_client_is_asked_the_persons_question(db, aiohttp_client, mode):
    import contextlib

    import httpx2
    from mcp import Client
    from mcp import types as mt
    from mcp.client.streamable_http import streamable_http_client

    from daemon_kit import APPROVAL
    d = await start_daemon(aiohttp_client, db)
    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", {"owner": "ana", "review": "R"})
    asks = []

    async def on_elicit(ctx, params):
        asks.append(params)
        return mt.ElicitResult(action="accept", content={"verdict": "approve"})
    url = str(d.client.make_url("/mcp"))

    @contextlib.asynccontextmanager
    async def client():
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {d.tokens[who(d, 'ben')]}"}, timeout=30) as http:
            async with Client(streamable_http_client(url, http_client=http), mode=mode,
                              elicitation_callback=on_elicit) as c:
                yield c
    async with client() as c:                              # no window: ben is not asked ana's question
        r = await c.call_tool("wait_run", {"run_id": run["run_id"], "timeout": 0.2})
        assert r.is_error or r.structured_content["status"] == "waiting"
        assert asks == []
    assert (await d.call("POST", DEPUTIES, {"for": "ana", "to": "ben"}))[0] == 201
    async with client() as c:
        r = await c.call_tool("wait_run", {"run_id": run["run_id"], "timeout": 20})
        assert r.structured_content["status"] == "succeeded" and r.structured_content["settled_by"] == "ben", r
    assert len(asks) == 1
    [answered] = [e for e in (await d.call("GET", f"/runs/{run['run_id']}/events"))[1]["data"]
                  if e["type"] == "request_answered"]
    assert answered["by"] == "ben" and answered["payload"]["on_behalf_of"] == "ana"
