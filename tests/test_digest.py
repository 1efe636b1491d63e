"""Answers bound to what was shown (SPEC section 25): every request has a `digest` - sha256 over the
RFC 8785 canonical JSON of {message, answer_schema, arguments} - shown in the v1 and v2 objects, on the
answer link's page and on the inbox page; an answer naming another digest is 409 digest_mismatch; the
fact and request_answered record the digest answered; an approved call's `tool_call_started` carries
the digest of the arguments it sends, equal to approval_answered's.

End to end over HTTP on SQLite and PostgreSQL with a real MCP tool server (tests/servers/ops_server.py);
the page in a real Chromium.
"""
from __future__ import annotations

import hashlib
import json
import re
import sqlite3

import pytest
import rfc8785

import interactiond as itd
from daemon_kit import start_daemon
from test_approval import RESTART, answer, calls, ended, history, ops_config, person, request_of
from test_web_inbox import CHROMIUM, CHROMIUM_ARGS, _playwright, served  # noqa: F401  (a fixture)


def jcs_sha(value) -> str:
    return hashlib.sha256(rfc8785.dumps(value)).hexdigest()


@pytest.fixture
async def d(db, tmp_path, aiohttp_client):
    log = tmp_path / "ops-calls.jsonl"
    daemon = await start_daemon(aiohttp_client, db, config=ops_config(log))
    daemon.calls_log = log
    return daemon


async def ask_text(d, run_id: str, prompt: str = "Which **region** first?", to: str = "ana") -> dict:
    status, run = await d.call("POST", "/runs", {"type": "interaction", "name": "ask-text", "run_id": run_id,
                                                 "input": {"prompt": prompt, "to": to}})
    assert status == 202, run
    [req] = [r for r in (await d.call("GET", "/interactions"))[1]["data"] if r["run_id"] == run_id]
    return req


async def test_a_question_shows_the_digest_of_what_it_shows_everywhere(d):
    req = await ask_text(d, "q-1")
    expected = jcs_sha({"message": req["message"], "answer_schema": req["answer_schema"], "arguments": None})
    assert req["digest"] == expected and re.fullmatch(r"[0-9a-f]{64}", expected)
    other = await ask_text(d, "q-2", prompt="Which **region** last?")
    assert other["digest"] != req["digest"]
    # The v2 object, the run's request (MCP tasks and get_run use it) and the answer link's page show it.
    [v2] = (await d.call("GET", "/v2/interactions?run_id=q-1"))[1]["data"]
    assert v2["digest"] == expected
    page = await d.client.get(req["answer_url"].split("://", 1)[1].split("/", 1)[1].join(["/", ""]))
    html = await page.text()
    assert page.status == 200 and f'<code id="digest">{expected}</code>' in html
    assert f'<input type="hidden" name="digest" value="{expected}">' in html


async def test_an_answer_naming_another_digest_is_refused_and_the_request_stays_open(d):
    req = await ask_text(d, "q-1")
    other = await ask_text(d, "q-2", prompt="Which **region** second?")
    for body in ({"answer": {"text": "eu"}, "digest": other["digest"]},      # what another request showed
                 {"answer": {"text": "eu"}, "digest": "f" * 64}):
        status, problem = await d.call("POST", "/runs/q-1/answer", body)
        assert status == 409 and problem["type"] == "/problems/digest_mismatch", problem
        assert problem["digest"] == req["digest"]
    status, problem = await d.call("POST", "/runs/q-1/answer", {"answer": {"text": "eu"}, "digest": "not hex"})
    assert status == 422 and problem["errors"] == [{"pointer": "/digest", "message": "64 lowercase hex digits"}]
    # Over the typed API (beside the variant's fields) and the answer link (beside `answer`) alike.
    [v2] = (await d.call("GET", "/v2/interactions?run_id=q-1"))[1]["data"]
    resp = await d.client.post(f"/v2/interactions/{v2['id']}/responses", headers={**d.auth(), "Idempotency-Key": "k1"},
                               json={"type": "text", "text": "eu", "digest": other["digest"]})
    body = await resp.json()
    assert resp.status == 409 and body["code"] == "digest_mismatch", body
    link = "/a/" + req["answer_url"].rsplit("/a/", 1)[1]
    resp = await d.client.post(link, json={"answer": {"text": "eu"}, "digest": other["digest"]})
    assert resp.status == 409 and (await resp.json())["type"] == "/problems/digest_mismatch"
    assert (await d.call("GET", "/runs/q-1"))[1]["status"] == "waiting"
    assert [e["type"] for e in (await d.call("GET", "/runs/q-1/events"))[1]["data"]] == ["interaction_requested"]
    # The digest it shows is taken, and the fact records it.
    status, fact = await d.call("POST", "/runs/q-1/answer", {"answer": {"text": "eu"}, "digest": req["digest"]})
    assert status == 200 and fact["digest"] == req["digest"], fact
    answered = [e for e in (await d.call("GET", "/runs/q-1/events"))[1]["data"] if e["type"] == "request_answered"]
    assert answered[0]["payload"]["digest"] == req["digest"]
    # No digest at all is an answer to what the request shows, as before.
    status, fact = await d.call("POST", "/runs/q-2/answer", {"answer": {"text": "us"}})
    assert status == 200 and fact["digest"] == other["digest"]


async def test_the_typed_api_and_the_link_take_the_right_digest(d):
    req = await ask_text(d, "q-1")
    [v2] = (await d.call("GET", "/v2/interactions?run_id=q-1"))[1]["data"]
    resp = await d.client.post(f"/v2/interactions/{v2['id']}/responses", headers={**d.auth(), "Idempotency-Key": "k1"},
                               json={"type": "text", "text": "eu", "digest": req["digest"]})
    body = await resp.json()
    assert resp.status == 200 and body["status"] == "answered" and body["digest"] == req["digest"], body
    req2 = await ask_text(d, "q-2", prompt="And then?")
    link = "/a/" + req2["answer_url"].rsplit("/a/", 1)[1]
    resp = await d.client.post(link, json={"answer": {"text": "us"}, "digest": req2["digest"]})
    fact = await resp.json()
    assert resp.status == 200 and fact["digest"] == req2["digest"] and fact["answered_by"] == "ana"


async def test_an_approval_binds_its_arguments_and_the_call_sends_what_was_approved(d):
    await d.define("restart", RESTART)
    status, run = await d.run("restart", {"service": "web", "owner": "ana"})
    assert status == 202
    run_id = run["run_id"]
    req = await request_of(d, run_id)
    assert req["digest"] == jcs_sha({"message": "Restart **web** now?", "answer_schema": itd.APPROVAL_ANSWER_SCHEMA,
                                     "arguments": {"service": "web", "force": False}})
    status, problem = await answer(d, run_id, {"approved": True})
    assert status == 200
    status, run = await ended(d, run_id)
    assert status == 200, run
    events = {e["type"]: e["payload"] for e in await history(d, run_id)}
    assert events["approval_answered"]["arguments_digest"] == jcs_sha({"service": "web", "force": False})
    assert events["tool_call_started"]["arguments_digest"] == events["approval_answered"]["arguments_digest"]


async def test_an_edited_approval_digests_the_edited_arguments(d):
    await d.define("restart", RESTART)
    run_id = (await d.run("restart", {"service": "web", "owner": "ana"}))[1]["run_id"]
    req = await request_of(d, run_id)
    status, fact = await d.call("POST", f"/runs/{run_id}/answer",
                                {"answer": {"approved": True, "arguments": {"service": "api", "force": True}},
                                 "digest": req["digest"]}, role=person(d, "ana"))
    assert status == 200 and fact["digest"] == req["digest"]
    status, run = await ended(d, run_id)
    assert status == 200 and calls(d) == [{"tool": "restart_service", "arguments": {"service": "api", "force": True}}]
    events = {e["type"]: e["payload"] for e in await history(d, run_id)}
    edited = jcs_sha({"service": "api", "force": True})
    assert events["approval_answered"]["arguments_digest"] == edited == events["tool_call_started"]["arguments_digest"]


def test_a_message_of_any_characters_digests_as_rfc8785_writes_it():
    schema = '{"type":"object","properties":{"b":{"type":"number","maximum":1.0},"a":{"enum":["x"]}}}'
    for message in ("", "plain", 'quotes " and \\ backslash', "".join(map(chr, range(32))) + "\x7f",
                    "é € 😀 \u2028 \u2029 \ufeff", "line\r\nnext\ttab\b\f"):
        assert itd.request_digest(message, schema) == jcs_sha({"message": message, "answer_schema": json.loads(schema),
                                                               "arguments": None}), repr(message)
    with pytest.raises(ValueError):                 # a lone surrogate is no UTF-8: refused, as rfc8785 refuses it
        itd.request_digest("half \ud800 a pair", schema)


def test_a_file_of_version_7_gains_the_digests_of_its_open_requests(tmp_path):
    db = str(tmp_path / "old.db")
    tx = itd.open_sync(db)
    now = 1_700_000_000_000
    tx.ensure_playbook("local/default", now=now)
    tx.insert_run(playbook="local/default", run_id="r1", type_="interaction", name="ask-text", version=1,
                  input_text="{}", input_sha="x", parent=None, now=now, by="local")
    schema = {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}
    tx.open_request(request_id="int_1", playbook="local/default", run_id="r1", type_="interaction", name="ask-text",
                    version=1, party="ana", answerer="ana", message="Hello?", answer_schema=json.dumps(schema),
                    server=None, tool=None, delivery=itd.DeliveryState.IN_INBOX, asked_at=now, expires_at=now + 1,
                    deliver_args=None)
    tx.conn.commit()
    tx.conn.close()
    conn = sqlite3.connect(db)
    conn.execute("ALTER TABLE requests DROP COLUMN digest")          # as version 7 made it
    conn.execute("ALTER TABLE requests DROP COLUMN on_behalf_of")
    conn.execute("PRAGMA user_version = 7")
    conn.commit()
    conn.close()
    tx = itd.open_sync(db)
    assert tx.conn.execute("PRAGMA user_version").fetchone()[0] == itd.SCHEMA_VERSION
    assert tx.request("local/default", "r1")["digest"] == jcs_sha({"message": "Hello?", "answer_schema": schema,
                                                                    "arguments": None})


def test_the_page_shows_the_digest_and_sends_it_back(served):
    sync_api = _playwright()
    expect = sync_api.expect
    expect.set_options(timeout=10_000)
    status, run = served.call("POST", "/runs", {"type": "interaction", "name": "ask-text",
                                               "input": {"prompt": "Which region?", "to": "ana"}})
    assert status == 202
    run_id = run["run_id"]
    [req] = [r for r in served.call("GET", "/interactions")[1]["data"] if r["run_id"] == run_id]
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(viewport={"width": 1000, "height": 900}).new_page()
            sent: list[dict] = []
            page.on("request", lambda r: r.method == "POST" and r.url.endswith("/answer")
                    and sent.append(json.loads(r.post_data or "null")))
            page.goto(served.login_url)
            item = page.locator(f'li[data-run-id="{run_id}"]')
            expect(item.locator("code.digest")).to_have_attribute("data-digest", req["digest"])
            expect(item.locator("code.digest")).to_have_text(req["digest"][:12])
            item.get_by_role("textbox", name="Text").fill("eu-west")
            item.get_by_role("button", name="Send the answer").click()
            expect(item).to_have_count(0)
            assert sent == [{"answer": {"text": "eu-west"}, "digest": req["digest"]}]
            # The answer link's page shows it too, and its form sends it back.
            status, run = served.call("POST", "/runs", {"type": "interaction", "name": "ask-text",
                                                       "input": {"prompt": "Which zone?", "to": "ben"}})
            [req2] = [r for r in served.call("GET", "/interactions")[1]["data"] if r["run_id"] == run["run_id"]]
            page.goto(req2["answer_url"])
            expect(page.locator("#digest")).to_have_text(req2["digest"])
            page.get_by_role("textbox", name="Text").fill("b")
            page.get_by_role("button", name="Send the answer").click()
            expect(page.locator("#status")).to_contain_text("Answered by")
            events = served.call("GET", f"/runs/{run['run_id']}/events")[1]["data"]
            assert [e["payload"].get("digest") for e in events if e["type"] == "request_answered"] == [req2["digest"]]
        finally:
            browser.close()
