"""People (SPEC section 18): a person's sign-in links, sessions and tokens, and answer links.

Over the real aiohttp app on the manual clock, on SQLite and on PostgreSQL; MCP with the official
client; the command line as a subprocess. The page itself is driven in Chromium by
tests/test_people_page.py.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.parse
from pathlib import Path

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

import interactiond as itd
from daemon_kit import APPROVAL, START_MS, fresh_postgres, person_token, start_chat_daemon

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
EXE = [sys.executable, "-m", "interactiond"]


@pytest.fixture
async def d(d):
    await d.define("approve", APPROVAL)
    return d


async def ask(d, owner: str) -> str:
    status, run = await d.run("approve", {"owner": owner, "review": f"the brief of {owner}"})
    assert status == 202, run
    return run["run_id"]


def path_of(url: str) -> str:
    """A link's path and query: the test client speaks to the app, not to the link's host."""
    parts = urllib.parse.urlsplit(url)
    return parts.path + (f"?{parts.query}" if parts.query else "")


async def sign_in(d, url: str) -> None:
    resp = await d.client.get(path_of(url), allow_redirects=False)
    assert resp.status == 303 and resp.headers["Location"] == "/", await resp.text()


def origin(d) -> dict[str, str]:
    return {"Origin": str(d.client.make_url("/")).rstrip("/")}


# A person's sign-in ###############################################################################

async def test_a_persons_link_signs_in_to_their_own_requests_only(d):
    ana_run, bob_run = await ask(d, "ana"), await ask(d, "bob")
    status, link = await d.call("POST", "/links", {"for": "ana"})
    assert status == 201 and link["for"] == "ana" and link["playbook"] == "local/default"
    assert link["expires_at"] == itd.fmt_time(START_MS + 7 * 86_400_000)           # P7D on the daemon's clock
    assert re.fullmatch(r"http://[^/]+/login\?token=\S+", link["url"])
    await sign_in(d, link["url"])

    session = await (await d.client.get("/web/session")).json()
    assert session["person"] == "ana" and session["role"] == "writer" and session["stream"] is False
    listing = await (await d.client.get(d.url("/interactions"))).json()
    assert [r["run_id"] for r in listing["data"]] == [ana_run]
    assert (await d.client.get(d.url("/interactions?to=ana"))).status == 200
    assert (await d.client.get(d.url("/interactions?to=bob"))).status == 404
    counts = await (await d.client.get("/web/orgs/local/playbooks/default/counts")).json()
    assert counts["to"] == [{"to": "ana", "count": 1}] and counts["total"] == 1
    # Runs, definitions, events and other people's requests are not there for her.
    for path in (f"/runs/{ana_run}", f"/runs/{bob_run}", "/runs", "/definitions", "/definitions/interaction/approve",
                 f"/runs/{ana_run}/events", "/events", "/stream", "/tools"):
        resp = await d.client.get(d.url(path))
        assert resp.status == 404, path
    assert (await d.client.get("/v2/events")).status == 404
    refused = await d.client.post(d.url(f"/runs/{bob_run}/answer"), json={"answer": {"verdict": "approve"}},
                                  headers=origin(d))
    assert refused.status == 404
    for tail in ("/runs", f"/runs/{ana_run}/cancel", "/definitions", "/links"):
        resp = await d.client.post(d.url(tail), json={}, headers=origin(d))
        assert resp.status == 404, tail
    v2 = await (await d.client.get("/v2/interactions")).json()
    assert [x["run_id"] for x in v2["data"]] == [ana_run] and v2["data"][0]["answer_url"]
    _, op_v2 = await d.call("GET", "/v2/interactions")
    bob_id = next(x["id"] for x in op_v2["data"] if x["run_id"] == bob_run)
    assert (await d.client.get(f"/v2/interactions/{bob_id}")).status == 404

    answered = await d.client.post(d.url(f"/runs/{ana_run}/answer"), json={"answer": {"verdict": "approve"}},
                                   headers=origin(d))
    fact = await answered.json()
    assert answered.status == 200 and fact["answered_by"] == "ana"
    _, run = await d.call("GET", f"/runs/{ana_run}")
    assert run["status"] == "succeeded" and run["settled_by"] == "ana"
    _, history = await d.call("GET", f"/runs/{ana_run}/events")
    assert [e["by"] for e in history["data"] if e["type"] in ("request_answered", "run_succeeded")] == ["ana", "ana"]
    # Her session is listed with her name, and revoking it signs her out.
    tx = itd.open_sync(d.db)
    try:
        [mine] = [r for r in tx.listed_tokens() if r["person"] == "ana"]
        assert mine["purpose"] == "session" and mine["playbook"] == "local/default"
        assert tx.revoke_token(mine["id"], START_MS)
    finally:
        tx.close()
    d.client.app[itd.tokens_key()].clear()             # the token cache: a revocation counts within 2 s
    assert (await d.client.get("/web/session")).status == 401


async def test_sign_in_links_work_once_until_they_expire(d):
    status, short = await d.call("POST", "/links", {"for": "ana", "expires": "PT1H"})
    assert status == 201 and short["expires_at"] == itd.fmt_time(START_MS + 3_600_000)
    status, spare = await d.call("POST", "/links", {"for": "ana"})
    await d.advance("PT2H")
    assert (await d.client.get(path_of(short["url"]), allow_redirects=False)).status == 401
    await sign_in(d, spare["url"])
    d.client.session.cookie_jar.clear()
    assert (await d.client.get(path_of(spare["url"]), allow_redirects=False)).status == 401   # spent
    # Without `for`: an operator's link, at any time (no restart).
    status, op = await d.call("POST", "/links", {})
    assert status == 201 and op["for"] is None and op["playbook"] is None
    await sign_in(d, op["url"])
    assert (await (await d.client.get("/web/session")).json())["person"] is None
    assert (await d.client.get(d.url("/runs"))).status == 200
    # Refusals: who may make one, and what it takes.
    assert (await d.call("POST", "/links", {"for": "ana"}, role="writer"))[0] == 403
    for body, pointer in (({"for": " "}, "/for"), ({"for": "a\nb"}, "/for"), ({"for": "ana", "expires": "P90D"}, "/expires"),
                          ({"for": "ana", "expires": "soon"}, "/expires"), ({"for": 5}, "/for")):
        status, problem = await d.call("POST", "/links", body)
        assert status == 422 and problem["errors"][0]["pointer"] == pointer, body
    assert (await d.call("POST", "/links", {"for": "ana"}, playbook="acme/nope"))[0] == 404


def test_a_start_revokes_only_the_link_it_printed(tmp_path):
    tx = itd.open_sync(str(tmp_path / "t.db"))
    try:
        _, printed = itd.create_token(tx, "operator", None, itd.START_LOGIN_NAME, purpose="login", now=1)
        _, ana = itd.create_token(tx, "writer", "local/default", itd.login_link_name("ana"), purpose="login", now=1,
                                  person="ana", expires_at=10_000)
        assert tx.revoke_logins(2) == 1
        assert not tx.token_known(itd.sha256_hex(printed)) and tx.token_known(itd.sha256_hex(ana))
        assert tx.spend_login(itd.sha256_hex(ana), 10_000) is None              # expired: not spent, not a session
        with pytest.raises(ValueError, match="operator"):
            itd.create_token(tx, "operator", None, "x", person="ana")
        with pytest.raises(ValueError, match="playbook"):
            itd.create_token(tx, "writer", None, "x", person="ana")
    finally:
        tx.close()


async def test_a_persons_token_has_the_scope_of_her_session(d):
    ana_run, bob_run = await ask(d, "ana"), await ask(d, "bob")
    auth = {"Authorization": f"Bearer {person_token(d.db, 'ana')}"}

    async def call(method, path, body=None, **kw):
        resp = await d.client.request(method, path if path.startswith("/v2") else d.url(path), json=body,
                                      headers={**auth, **kw.pop("headers", {})})
        return resp.status, await resp.json()
    status, listing = await call("GET", "/interactions")
    assert status == 200 and [r["run_id"] for r in listing["data"]] == [ana_run]
    for path in (f"/runs/{ana_run}", "/runs", "/definitions", "/events", f"/runs/{ana_run}/events"):
        assert (await call("GET", path))[0] == 404, path
    assert (await call("POST", f"/runs/{bob_run}/answer", {"answer": {"verdict": "approve"}}))[0] == 404
    status, page = await call("GET", "/v2/interactions")
    [mine] = page["data"]
    assert mine["run_id"] == ana_run
    status, obj = await call("POST", f"/v2/interactions/{mine['id']}/responses", {"type": "form", "answer": {
        "verdict": "revise", "note": "shorter"}}, headers={"Idempotency-Key": "k1"})
    assert status == 200 and obj["status"] == "answered"
    status, fact_run = await d.call("GET", f"/runs/{ana_run}")
    assert fact_run["settled_by"] == "ana" and fact_run["output"] == {"verdict": "revise", "note": "shorter"}


async def test_a_persons_token_over_mcp(d):
    ana_run, bob_run = await ask(d, "ana"), await ask(d, "bob")
    url = str(d.client.make_url("/mcp"))
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {person_token(d.db, 'ana')}"}, timeout=30) as http:
        async with Client(streamable_http_client(url, http_client=http)) as c:
            assert {t.name for t in (await c.list_tools()).tools} == {"list_interactions", "answer_interaction",
                                                                      "wait_run"}
            r = await c.call_tool("list_interactions", {})
            assert not r.is_error and [x["run_id"] for x in r.structured_content["data"]] == [ana_run]
            assert r.structured_content["data"][0]["answer_url"]
            for name, args in (("get_run", {"run_id": ana_run}), ("list_definitions", {}),
                               ("run_definition", {"name": "approve"}), ("list_run_events", {"run_id": ana_run})):
                r = await c.call_tool(name, args)
                assert r.is_error and r.structured_content["status"] == 404, name
            r = await c.call_tool("answer_interaction", {"run_id": bob_run, "answer": {"verdict": "approve"}})
            assert r.is_error and r.structured_content["status"] == 404
            r = await c.call_tool("wait_run", {"run_id": bob_run, "timeout": 0})     # only runs that ask her
            assert r.is_error and r.structured_content["status"] == 404
            r = await c.call_tool("wait_run", {"run_id": ana_run, "timeout": 0})
            assert not r.is_error and r.structured_content["status"] == "waiting" and "input" not in r.structured_content
            r = await c.call_tool("answer_interaction", {"run_id": ana_run, "answer": {"verdict": "approve"}})
            assert not r.is_error and r.structured_content["answered_by"] == "ana"
    assert (await d.call("GET", f"/runs/{bob_run}"))[1]["status"] == "waiting"


# Answer links #####################################################################################

async def answer_url(d, run_id: str) -> str:
    _, page = await d.call("GET", "/interactions")
    return next(r["answer_url"] for r in page["data"] if r["run_id"] == run_id)


async def test_answer_urls_are_shown_to_writers_only(d):
    run_id = await ask(d, "ana")
    url = await answer_url(d, run_id)
    assert re.fullmatch(r"http://127\.0\.0\.1:8765/a/int_[0-9A-Z]{26}\.[A-Za-z0-9_-]{32}", url)
    _, writer = await d.call("GET", "/interactions", role="writer")
    assert writer["data"][0]["answer_url"] == url
    _, reader = await d.call("GET", "/interactions", role="reader")
    assert "answer_url" not in reader["data"][0]
    _, run = await d.call("GET", f"/runs/{run_id}")
    assert run["status"] == "waiting" and run["answer_url"] == url
    assert "answer_url" not in (await d.call("GET", f"/runs/{run_id}", role="reader"))[1]
    _, v2 = await d.call("GET", f"/v2/interactions?run_id={run_id}")
    assert v2["data"][0]["answer_url"] == url
    # The key is the database's: another start (another daemon, on PostgreSQL) signs alike.
    other = itd.Engine(itd.Store(d.db), itd.ManualClock(START_MS), itd.Config(public_url="https://inbox.example.org"))
    await other.store.open()
    try:
        await other.start()
        page = await other.list_interactions(itd.OPERATOR_LOCAL, "local/default")
        assert page["data"][0]["answer_url"] == "https://inbox.example.org" + path_of(url)
    finally:
        await other.stop()
        await other.store.close()


async def test_an_answer_link_answers_once_as_the_addressee(d):
    run_id = await ask(d, "ana")
    link = path_of(await answer_url(d, run_id))
    d.client.session.cookie_jar.clear()
    before = (await d.call("GET", f"/runs/{run_id}/events"))[1]["data"]
    for _ in range(2):                          # a GET (or a HEAD) changes nothing
        page = await d.client.get(link)
        assert page.status == 200 and page.headers["Referrer-Policy"] == "no-referrer"
        assert "script-src" not in page.headers["Content-Security-Policy"]
        html = await page.text()
        assert "the brief of ana" in html and "<form" in html and "for ana" in html
        assert (await d.client.head(link)).status == 200
    assert (await d.call("GET", f"/runs/{run_id}/events"))[1]["data"] == before
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["status"] == "waiting"

    token = re.search(r'name="form" value="([^"]+)"', html).group(1)
    # The form needs its token; a wrong answer comes back in words beside its field.
    refused = await d.client.post(link, data={"choice": "0"})
    assert refused.status == 403
    wrong = await d.client.post(link, data={"form": token, "f0": "x" * 2001, "choice": "1"})
    assert wrong.status == 422 and "Note takes at most 2000 characters" in await wrong.text()
    done = await d.client.post(link, data={"form": token, "f0": "Tighter, please.", "choice": "1"},
                               allow_redirects=False)
    assert done.status == 303 and link.endswith("/" + done.headers["Location"])
    _, run = await d.call("GET", f"/runs/{run_id}")
    assert run["output"] == {"verdict": "revise", "note": "Tighter, please."} and run["settled_by"] == "ana"
    shown = await (await d.client.get(link)).text()
    assert "Answered by <strong>ana</strong>" in shown and "<form" not in shown and "Tighter, please." in shown
    # Once: a second form shows the first answer; JSON: the same answer is the same fact, another 409.
    again = await d.client.post(link, data={"form": token, "f0": "", "choice": "0"})
    assert again.status == 409 and "Answered by <strong>ana</strong>" in await again.text()
    same = await d.client.post(link, json={"answer": {"verdict": "revise", "note": "Tighter, please."}})
    assert same.status == 200 and (await same.json())["answered_by"] == "ana"
    other = await d.client.post(link, json={"answer": {"verdict": "approve"}})
    assert other.status == 409 and (await other.json())["type"] == "/problems/answered"
    assert "answer_url" not in (await d.call("GET", f"/runs/{run_id}"))[1]        # ended: no link to show


async def test_a_program_answers_through_the_link_with_json(d):
    run_id = await ask(d, "ana")
    link = path_of(await answer_url(d, run_id))
    bad = await d.client.post(link, json={"answer": {"verdict": "maybe"}})
    body = await bad.json()
    assert bad.status == 422 and [e["pointer"] for e in body["errors"]] == ["/answer/verdict"]
    ok = await d.client.post(link, json={"answer": {"verdict": "approve"}})
    assert ok.status == 200 and (await ok.json())["answered_by"] == "ana"


async def test_a_tampered_or_foreign_link_is_a_plain_404(d):
    run_id = await ask(d, "ana")
    link = path_of(await answer_url(d, run_id))
    mac = link.rsplit(".", 1)[1]
    flipped = link[:-1] + ("A" if link[-1] != "A" else "B")
    other_id = link.replace("/a/int_", "/a/int_0").split(".")[0] + "." + mac
    for bad in (flipped, other_id, "/a/nonsense", link.split(".")[0] + ".", link + "x"):
        resp = await d.client.get(bad)
        assert resp.status == 404 and "This link does not work" in await resp.text(), bad
        assert (await d.client.post(bad, data={"choice": "0"})).status == 404
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["status"] == "waiting"
    # A link signed with another daemon's key (another database) does not open this one's request.
    _, v2 = await d.call("GET", f"/v2/interactions?run_id={run_id}")
    foreign = itd.AnswerLinks("http://elsewhere")
    foreign.key = bytes(32)
    row = {"id": v2["data"][0]["id"], "playbook": "local/default", "run_id": run_id, "party": "ana"}
    assert foreign.url(row) != await answer_url(d, run_id)
    assert (await d.client.get(path_of(foreign.url(row)))).status == 404


async def test_after_the_end_the_link_says_how_it_ended(d):
    answered = await ask(d, "bob")
    answered_link = path_of(await answer_url(d, answered))
    assert (await d.call("POST", f"/runs/{answered}/answer", {"answer": {"verdict": "approve"}}, role="writer"))[0] == 200
    shown = await (await d.client.get(answered_link)).text()
    assert "Answered by <strong>writer (an API token)</strong> on 2027-01-15 08:00 UTC" in shown
    run_id = await ask(d, "ana")
    link = path_of(await answer_url(d, run_id))
    await d.advance("P3D")
    page = await d.client.get(link)
    text = await page.text()
    assert page.status == 200 and "it expired on" in text and "<form" not in text
    post = await d.client.post(link, json={"answer": {"verdict": "approve"}})
    assert post.status == 409


CHOICE_INPUT = {"prompt": "Which plan?", "to": "ana", "options": [{"id": "a", "label": "Alpha plan"},
                                                                   {"id": "b", "label": "Beta plan"}]}


async def test_an_ask_choice_is_radios_with_its_labels(d):
    status, run = await d.call("POST", "/runs", {"type": "interaction", "name": "ask-choice", "input": CHOICE_INPUT})
    link = path_of(await answer_url(d, run["run_id"]))
    html = await (await d.client.get(link)).text()
    assert html.count('type="radio"') == 2 and "Alpha plan" in html and "Beta plan" in html
    token = re.search(r'name="form" value="([^"]+)"', html).group(1)
    empty = await d.client.post(link, data={"form": token})
    assert empty.status == 422 and "Your choice is required" in await empty.text()
    assert (await d.client.post(link, data={"form": token, "f0": "1"}, allow_redirects=False)).status == 303
    assert (await d.call("GET", f"/runs/{run['run_id']}"))[1]["output"] == {"option_ids": ["b"]}
    # The page's render helper labels the options too, for the runs the caller may answer.
    _, run2 = await d.call("POST", "/runs", {"type": "interaction", "name": "ask-choice", "input": CHOICE_INPUT})
    _, page = await d.call("GET", "/interactions")
    schema = page["data"][0]["answer_schema"]
    resp = await d.client.post("/web/render", json={"items": [
        {"schema": schema, "playbook": "local/default", "run_id": run2["run_id"]}, {"schema": schema}]}, headers=d.auth())
    out = await resp.json()
    assert out["items"][1]["form"]["fields"][0]["labels"] == ["a", "b"]          # no run named: its ids
    assert out["items"][0]["form"]["fields"][0]["labels"] == ["Alpha plan", "Beta plan"]


async def test_the_pages_answer_route_words_its_errors(d):
    run_id = await ask(d, "ana")
    path = f"/web/orgs/local/playbooks/default/runs/{run_id}/answer"
    resp = await d.client.post(path, json={"answer": {"note": 5}}, headers=d.auth())
    status, problem = resp.status, await resp.json()
    assert status == 422 and problem["errors"] == [{"pointer": "/answer/note", "message": "Note must be text"},
                                                   {"pointer": "/answer/verdict", "message": "Verdict is required"}]
    resp = await d.client.post(path, json={"answer": {"verdict": "approve"}}, headers=d.auth("writer"))
    assert resp.status == 200 and (await resp.json())["answer"] == {"verdict": "approve"}
    # The page's route keeps every rule of answer_interaction: the role, the Origin of a cookie.
    assert (await d.client.post(path, json={"answer": {"verdict": "approve"}}, headers=d.auth("reader"))).status == 403


def test_an_answer_links_signature_never_reaches_the_log():
    line = itd.redact("GET /a/int_01M8QRS6ZJ7QKTW67VHF54AXEC.0Uzpml5InhwDxGaYw0V3xzeOSn7RBsiY 200 1.2 ms")
    assert line == "GET /a/int_01M8QRS6ZJ7QKTW67VHF54AXEC.[redacted] 200 1.2 ms"


def test_errors_in_words():
    schema = {"type": "object", "required": ["text", "n"], "additionalProperties": False, "properties": {
        "text": {"type": "string", "maxLength": 3}, "n": {"type": "integer", "minimum": 1, "maximum": 12},
        "pick": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 1, "uniqueItems": True},
        "when": {"type": "string", "format": "date"}}}
    words = itd.answer_error_words(schema, {"text": "long", "pick": ["a", "c"], "extra": 1, "when": "soon"})
    assert words == [
        {"pointer": "/answer/extra", "message": "extra is not a field of this answer"},
        {"pointer": "/answer/n", "message": "N is required"},
        {"pointer": "/answer/pick", "message": "Pick: pick only one"},
        {"pointer": "/answer/pick/1", "message": "Pick: pick one of the options"},
        {"pointer": "/answer/text", "message": "Text takes at most 3 characters"},
        {"pointer": "/answer/when", "message": "When must be a date such as 2026-05-01"}]
    assert itd.answer_error_words(schema, {"text": "ok", "n": 40})[0]["message"] == "N must be at most 12"
    assert itd.answer_error_words(schema, {"text": "ok", "n": 4}, {"/n": "Boxes"}) == []
    assert itd.answer_error_words({"type": "integer"}, "x") == [{"pointer": "/answer", "message": "The answer must be a whole number"}]


def test_a_forms_fields_become_the_answer():
    form = itd.answer_form({"type": "object", "required": ["n"], "properties": {
        "n": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["x", "y"]}},
        "one": {"type": "array", "items": {"enum": ["p", "q"]}, "maxItems": 1}, "note": {"type": "string"},
        "meta": {"type": "object"}}})
    answer, bad = itd.form_answer(form, {"f0": ["7"], "f1": ["0", "1"], "f2": ["1"], "f3": [""], "f4": ['{"k": 1}']})
    assert bad == [] and answer == {"n": 7, "tags": ["x", "y"], "one": ["q"], "meta": {"k": 1}}
    answer, bad = itd.form_answer(form, {"f0": ["seven"], "f4": ["{"]})
    assert [e["pointer"] for e in bad] == ["/answer/n", "/answer/meta"]
    buttons = itd.answer_form({"type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}, "why": {"type": "string"}}})
    assert itd.form_answer(buttons, {"choice": ["1"], "f0": ["because"]}) == ({"verdict": "no", "why": "because"}, [])
    assert itd.form_answer(buttons, {})[1][0]["pointer"] == "/answer/verdict"


LINKED_CHAT = """---
to: '{{ input.owner }}'
expires: P1D
deliver:
  server: chat
  tool: post_message
  with: { channel: '{{ to }}', text: '{{ message }} Or answer here: {{ request.answer_url }}' }
input:
  schema: { type: object, required: [owner], properties: { owner: { type: string } } }
output:
  schema: { type: object, required: [ok], properties: { ok: { type: boolean } } }
---
Ship it? Your link: {{ request.answer_url }}
"""


async def test_a_chat_message_carries_the_answer_link(db, tmp_path, aiohttp_client):
    sys.path.insert(0, str(ROOT / "examples"))
    import chat_server

    chat_db = str(tmp_path / "chat.db")
    d = await start_chat_daemon(aiohttp_client, db, chat_db)
    await d.define("linked", LINKED_CHAT)
    _, run = await d.run("linked", {"owner": "ana"})
    await d.advance("PT0S")
    url = await answer_url(d, run["run_id"])
    _, page = await d.call("GET", "/interactions")
    assert page["data"][0]["message"] == f"Ship it? Your link: {url}"
    [posted] = chat_server.messages(chat_db, "ana")
    assert posted["text"] == f"Ship it? Your link: {url} Or answer here: {url}"
    ok = await d.client.post(path_of(url), json={"answer": {"ok": True}})
    assert ok.status == 200 and (await ok.json())["answered_by"] == "ana"


# The store: the new columns and table, on each backend ###########################################

def test_a_version_2_file_is_migrated(tmp_path):
    import sqlite3

    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript((FIXTURES / "schema-v2.sql").read_text())
    conn.execute("PRAGMA user_version = 2")
    conn.execute("INSERT INTO tokens (id, hash, role, purpose, created_at) VALUES ('tok_old', 'h', 'reader', 'api', 1)")
    conn.commit()
    conn.close()
    tx = itd.open_sync(str(path))
    try:
        assert tx.conn.execute("PRAGMA user_version").fetchone()[0] == itd.SCHEMA_VERSION
        assert [(r["id"], r["person"]) for r in tx.listed_tokens()] == [("tok_old", None)]
        key = tx.daemon_key("answer_links", "aa" * 32, 5)
        assert key == "aa" * 32 and tx.daemon_key("answer_links", "bb" * 32, 6) == key     # made once, kept
    finally:
        tx.close()


def test_a_version_2_postgres_database_is_migrated():
    with fresh_postgres() as url:
        import psycopg

        with psycopg.connect(url, autocommit=True) as raw:
            raw.execute((FIXTURES / "schema-postgres-v2.sql").read_text())
            raw.execute("INSERT INTO schema_version (version) VALUES (2)")
            raw.execute("INSERT INTO tokens (id, hash, role, purpose, created_at) VALUES ('tok_old', 'h', 'reader', 'api', 1)")
        tx = itd.open_sync(url)
        try:
            assert tx.conn.execute("SELECT version FROM schema_version").fetchone()[0] == itd.SCHEMA_VERSION
            assert [(r["id"], r["person"]) for r in tx.listed_tokens()] == [("tok_old", None)]
            assert tx.daemon_key("answer_links", "cc" * 32, 5) == "cc" * 32
        finally:
            tx.close()


# The command line ##################################################################################

def cli(*args: str, cwd: Path, code: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([*EXE, *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    return proc


def test_link_and_a_persons_token_from_the_command_line(tmp_path):
    db = str(tmp_path / "t.db")
    # No daemon runs: the link is written to the database, pointing at the configured address.
    (tmp_path / "c.yaml").write_text("public_url: https://inbox.example.org/\n")
    url = cli("link", "--for", "ana", "--db", db, "--config", "c.yaml", cwd=tmp_path).stdout.strip()
    assert re.fullmatch(r"https://inbox\.example\.org/login\?token=\S+", url)
    secret = url.split("token=")[1]
    tx = itd.open_sync(db)
    try:
        row = tx.spend_login(itd.sha256_hex(secret), itd.WALL.now_ms())
        assert (row["role"], row["playbook"], row["person"]) == ("writer", "local/default", "ana")
    finally:
        tx.close()
    op = cli("link", "--db", db, cwd=tmp_path)
    assert op.stdout.startswith("http://127.0.0.1:8765/login?token=") and "an operator's" in op.stderr
    assert "--expires" in cli("link", "--for", "ana", "--expires", "P90D", "--db", db, cwd=tmp_path, code=2).stderr
    assert "no playbook" in cli("link", "--for", "ana", "--playbook", "acme/x", "--db", db, cwd=tmp_path, code=2).stderr
    (tmp_path / "bad.yaml").write_text("public_url: ftp://x\n")
    assert "public_url" in cli("link", "--db", db, "--config", "bad.yaml", cwd=tmp_path, code=2).stderr

    made = cli("token", "create", "--for", "ana", "--role", "writer", "--db", db, cwd=tmp_path).stdout.split()
    assert made[0].startswith("tok_")
    listed = cli("token", "list", "--db", db, cwd=tmp_path).stdout
    [line] = [x for x in listed.splitlines() if x.startswith(made[0])]
    assert line.split("\t")[1:4] == ["writer", "local/default", "active"] and line.endswith("(for ana)")
    refused = cli("token", "create", "--for", "ana", "--role", "operator", "--db", db, cwd=tmp_path, code=2)
    assert "operator" in refused.stderr


def test_stdio_with_http_prints_a_sign_in_link(tmp_path):
    import urllib.request

    proc = subprocess.Popen([*EXE, "stdio", "--http", "0"], cwd=tmp_path, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    try:
        link = None
        for line in proc.stderr:
            if line.startswith("interactiond: inbox: "):
                link = line.split("inbox: ", 1)[1].strip()
                break
        assert link and re.fullmatch(r"http://127\.0\.0\.1:\d+/login\?token=\S+", link), link
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
        with opener.open(link, timeout=30) as resp:          # signed in: sent on to the page
            assert resp.status == 200 and resp.url.endswith("/")
        base = link.split("/login")[0]
        with opener.open(base + "/web/session", timeout=30) as resp:
            assert json.loads(resp.read())["role"] == "operator"
    finally:
        proc.stdin.close()
        proc.wait(30)
