"""The web inbox: sign-in, its helpers, the schema -> form mapping, and the page in a real Chromium.

The browser test runs `interactiond serve --clock manual` as a subprocess, signs in from the URL it
prints, and drives Debian's Chromium with Playwright for Python. It skips when either is missing,
unless INTERACTIOND_REQUIRE_BROWSER=1 (CI sets it), which makes a missing browser a failure.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import interactiond as itd
from daemon_kit import APPROVAL, start_daemon

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / ".ci" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

BOXES = """---
description: Asks how many boxes to order
to: '{{ input.owner }}'
expires: P1D
input:
  schema:
    type: object
    required: [owner]
    properties:
      owner: { type: string }
output:
  schema:
    type: object
    required: [boxes]
    properties:
      boxes: { type: integer, minimum: 1, maximum: 12, description: Full boxes only }
---
How many boxes should we order for **{{ input.owner }}**?
"""

VERDICT = {"type": "object", "required": ["verdict"], "properties": {
    "verdict": {"type": "string", "enum": ["approve", "revise"]}, "note": {"type": "string", "maxLength": 2000}}}


# The schema -> form mapping ###################################################################

def test_enum_is_one_button_per_value_with_the_note_beside_it():
    form = itd.answer_form(VERDICT)
    assert form["mode"] == "choice"
    assert form["choice"]["pointer"] == "/verdict" and form["choice"]["values"] == ["approve", "revise"]
    [note] = form["fields"]
    assert note["kind"] == "text" and note["maxLength"] == 2000 and note["note"] is True and note["pointer"] == "/note"
    assert note["required"] is False and note["bounds"] == "at most 2000 characters"
    noted = [f.get("note", False) for f in itd.answer_form({"type": "object", "properties": {
        "verdict": {"enum": ["a", "b"]}, "reviewerNote": {"type": "string"}, "why_not": {"type": "string"},
        "notebook": {"type": "string"}, "title": {"type": "string"}}})["fields"]]
    assert noted == [True, True, False, False]


def test_the_canonical_ask_schemas():
    approval = itd.answer_form({"type": "object", "required": ["approved"], "additionalProperties": False,
                                "properties": {"approved": {"type": "boolean"},
                                               "comment": {"type": "string", "maxLength": 2000}}})
    assert approval["mode"] == "choice" and approval["choice"]["values"] == [True, False]
    assert approval["choice"]["labels"] == ["Yes", "No"] and approval["fields"][0]["note"] is True
    text = itd.answer_form({"type": "object", "required": ["text"], "properties": {"text": {"type": "string", "maxLength": 8000}}})
    assert text["mode"] == "fields" and text["fields"][0]["kind"] == "text" and text["fields"][0]["maxLength"] == 8000
    choice = itd.answer_form({"type": "object", "required": ["option_ids"], "properties": {"option_ids": {
        "type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "minItems": 1, "maxItems": 1, "uniqueItems": True}}})
    # One pick: radios (never the buttons), whose answer is a list of the one; labels from the ask's options.
    [ids] = choice["fields"]
    assert choice["mode"] == "fields" and ids["kind"] == "choice" and ids["array"] is True and ids["values"] == ["a", "b"]
    assert ids["labels"] == ["a", "b"]
    [named] = itd.answer_form(choice_schema := {"type": "object", "required": ["option_ids"], "properties": {"option_ids": {
        "type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "minItems": 1, "maxItems": 1}}},
        {"a": "Alpha", "b": "Beta"})["fields"]
    assert named["labels"] == ["Alpha", "Beta"] and named["label"] == "Your choice"
    choice_schema["properties"]["option_ids"]["maxItems"] = 2           # several: checkboxes
    [several] = itd.answer_form(choice_schema, {"a": "Alpha", "b": "Beta"})["fields"]
    assert several["kind"] == "checkboxes" and several["labels"] == ["Alpha", "Beta"] and several["maxItems"] == 2


def test_numbers_carry_their_bounds():
    [boxes] = itd.answer_form({"type": "object", "properties": {"boxes": {"type": "integer", "minimum": 1, "maximum": 12}}})["fields"]
    assert boxes["kind"] == "number" and boxes["integer"] is True and (boxes["min"], boxes["max"]) == (1, 12)
    assert boxes["bounds"] == "a whole number from 1 to 12"
    exclusive = itd.form_field("n", "/n", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}, True)
    assert (exclusive["min"], exclusive["max"]) == (1, 9)
    ratio = itd.form_field("r", "/r", {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, True)
    assert ratio["integer"] is False and ratio["bounds"] == "a number more than 0 and at most 1"
    assert itd.form_field("x", "/x", {"type": ["number", "null"]}, False)["kind"] == "number"


def test_whole_answers_and_everything_else():
    assert itd.answer_form(None) == {"mode": "none", "fields": []}
    yes_no = itd.answer_form({"type": "boolean"})
    assert yes_no["mode"] == "choice" and yes_no["choice"]["pointer"] == "" and yes_no["choice"]["labels"] == ["Yes", "No"]
    labelled = itd.answer_form({"oneOf": [{"const": "a", "title": "Alpha"}, {"const": "b", "title": "Beta"}]})
    assert labelled["choice"]["values"] == ["a", "b"] and labelled["choice"]["labels"] == ["Alpha", "Beta"]
    words = itd.answer_form({"type": "string", "maxLength": 5})
    assert words["mode"] == "fields" and words["fields"][0]["pointer"] == "" and words["fields"][0]["kind"] == "text"
    assert itd.answer_form({"type": "array", "items": {"type": "object"}})["mode"] == "json"
    mixed = itd.answer_form({"type": "object", "properties": {"where": {"type": "object"}, "a/b": {"type": "string"},
                                                              "when": {"type": "string", "format": "date"}}})
    assert [(f["kind"], f["pointer"]) for f in mixed["fields"]] == [("json", "/where"), ("text", "/a~1b"), ("text", "/when")]
    assert mixed["fields"][0]["example"] == "{}"
    two = itd.answer_form({"type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"type": "boolean"}}})
    assert two["mode"] == "fields" and [f["kind"] for f in two["fields"]] == ["choice", "choice"]


def test_markdown_is_rendered_without_raw_html():
    html = itd.render_markdown("**Ship** it? <script>alert(1)</script> <img src=x onerror=alert(1)>\n\n"
                               "[site](javascript:alert(1)) [ok](https://example.org)")
    assert "<strong>Ship</strong>" in html
    assert "<script" not in html and "<img" not in html and "&lt;script&gt;" in html
    assert 'href="javascript' not in html and 'href="https://example.org"' in html


# Sign-in and the helpers, over the app in-process ###############################################

@pytest.fixture
async def d(tmp_path, aiohttp_client):
    return await start_daemon(aiohttp_client, str(tmp_path / "t.db"))


def login_token(db: str, role: str = "writer", playbook: str | None = "local/default") -> str:
    conn = itd.open_sync(db)
    try:
        return itd.create_token(conn, role, playbook, "inbox login", purpose="login")[1]
    finally:
        conn.close()


async def web_call(d, method: str, path: str, body: Any = None, role: str = "operator") -> tuple[int, Any]:
    resp = await d.client.request(method, path, json=body, headers=d.auth(role))
    return resp.status, await resp.json()


def origin(d) -> dict[str, str]:
    return {"Origin": str(d.client.make_url("/")).rstrip("/")}


async def sign_in(d, role: str = "writer", playbook: str | None = "local/default") -> str:
    resp = await d.client.get(f"/login?token={login_token(d.db, role, playbook)}", allow_redirects=False)
    assert resp.status == 303 and resp.headers["Location"] == "/"
    return resp.cookies[itd.SESSION_COOKIE].value


async def test_login_trades_the_token_once_for_a_cookie(d):
    secret = login_token(d.db)
    resp = await d.client.get(f"/login?token={secret}", allow_redirects=False)
    assert resp.status == 303 and resp.headers["Location"] == "/"
    cookie = resp.cookies[itd.SESSION_COOKIE]
    assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/"
    conn = itd.open_sync(d.db)
    rows = {r["purpose"]: r for r in conn.conn.execute("SELECT * FROM tokens WHERE name = 'inbox login' OR name = 'inbox session'")}
    conn.close()
    assert rows["login"]["revoked_at"] is not None
    assert rows["session"]["role"] == "writer" and rows["session"]["playbook"] == "local/default"
    assert rows["session"]["revoked_at"] is None and rows["session"]["hash"] == itd.sha256_hex(cookie.value)
    # Spent: a second use signs nobody in (but someone signed in is sent on to the page).
    again = await d.client.get(f"/login?token={secret}", allow_redirects=False)
    assert again.status == 303
    d.client.session.cookie_jar.clear()
    again = await d.client.get(f"/login?token={secret}", allow_redirects=False)
    assert again.status == 401 and "does not work" in await again.text()
    assert (await d.client.get("/login?token=nonsense", allow_redirects=False)).status == 401
    assert (await d.client.get("/login", allow_redirects=False)).status == 401


async def test_the_cookie_calls_the_api_and_state_changes_need_the_origin(d):
    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", {"owner": "ana", "review": "ok"})
    await sign_in(d)
    status = (await d.client.get(d.url("/interactions"))).status
    assert status == 200
    answer = {"answer": {"verdict": "approve"}}
    path = d.url(f"/runs/{run['run_id']}/answer")
    resp = await d.client.post(path, json=answer)
    assert resp.status == 403 and (await resp.json())["type"] == "/problems/forbidden"
    resp = await d.client.post(path, json=answer, headers={"Origin": "http://evil.example"})
    assert resp.status == 403
    resp = await d.client.post(path, json=answer, headers=origin(d))
    assert resp.status == 200 and (await resp.json())["answer"] == {"verdict": "approve"}
    # The session sees what its login token saw: not another playbook.
    assert (await d.client.get(d.url("/interactions", "acme/other"))).status == 404


async def test_a_reader_session_keeps_the_readers_role(d):
    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", {"owner": "ana", "review": "ok"})
    await sign_in(d, "reader")
    assert (await d.client.get(d.url("/interactions"))).status == 200
    resp = await d.client.post(d.url(f"/runs/{run['run_id']}/answer"), json={"answer": {"verdict": "approve"}},
                               headers=origin(d))
    assert resp.status == 403


async def test_logout_revokes_the_session(d):
    session = await sign_in(d)
    assert (await d.client.post("/logout")).status == 403                 # no Origin: not the page
    assert (await d.client.get(d.url("/interactions"))).status == 200
    resp = await d.client.post("/logout", headers=origin(d))
    assert resp.status == 204
    assert resp.cookies[itd.SESSION_COOKIE].value == ""
    d.client.session.cookie_jar.clear()
    stale = await d.client.get(d.url("/interactions"), headers={"Cookie": f"{itd.SESSION_COOKIE}={session}"})
    assert stale.status == 401


async def test_the_session_helper_says_who_and_what(d):
    assert (await d.client.get("/web/session")).status == 401
    await sign_in(d, "operator", None)
    body = await (await d.client.get("/web/session")).json()
    assert body["role"] == "operator" and body["playbooks"] == ["acme/other", "local/default"]
    assert body["playbook"] == "local/default" and body["stream"] is True and body["poll_ms"] == itd.WEB_POLL_MS
    assert body["now"] == itd.fmt_time(d.clock.now_ms())
    bound = await d.client.get("/web/session", headers={"Authorization": f"Bearer {d.tokens['other']}"})
    assert (await bound.json())["playbooks"] == ["acme/other"]


async def test_render_and_counts(d):
    await d.define("approve", APPROVAL)
    for owner in ("ana", "ana", "bob"):
        await d.run("approve", {"owner": owner, "review": "ok"})
    status, counts = await web_call(d, "GET", "/web/orgs/local/playbooks/default/counts")
    assert status == 200 and counts["total"] == 3
    assert counts["to"] == [{"to": "ana", "count": 2}, {"to": "bob", "count": 1}]
    status, _ = await web_call(d, "GET", "/web/orgs/local/playbooks/default/counts", role="other")
    assert status == 404
    status, out = await web_call(d, "POST", "/web/render", {"items": [{"markdown": "*hi* <b>x</b>", "schema": VERDICT},
                                                                 {"markdown": "plain"}, {"schema": None}]})
    assert status == 200
    assert out["items"][0]["html"] == "<p><em>hi</em> &lt;b&gt;x&lt;/b&gt;</p>\n"
    assert out["items"][0]["form"] == itd.answer_form(VERDICT)
    assert "form" not in out["items"][1] and out["items"][2] == {"form": {"mode": "none", "fields": []}}
    status, too_many = await web_call(d, "POST", "/web/render", {"items": [{}] * (itd.WEB_RENDER_ITEMS + 1)})
    assert status == 422 and too_many["errors"][0]["pointer"] == "/items"
    status, _ = await web_call(d, "POST", "/web/render", {"items": []}, role="reader")
    assert status == 200


async def test_the_page_is_self_contained(d):
    resp = await d.client.get("/")
    assert resp.status == 200 and resp.content_type == "text/html"
    html = await resp.text()
    assert "http://" not in html and "https://" not in html          # no external assets: it runs offline
    csp = resp.headers["Content-Security-Policy"]
    for tag in ("script", "style"):
        [inline] = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)
        digest = base64.b64encode(hashlib.sha256(inline.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in csp
    assert "default-src 'none'" in csp and resp.headers["X-Content-Type-Options"] == "nosniff"


# The page in a real browser #####################################################################

def _playwright() -> Any:
    """playwright.sync_api, or a skip (a failure when INTERACTIOND_REQUIRE_BROWSER=1) saying what is missing."""
    missing = []
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"Chromium ({CHROMIUM}; apt-get install chromium)")
    try:
        from playwright import sync_api
    except ImportError:
        sync_api = None
        missing.append("playwright for Python (pip install -e '.[browser]')")
    if missing:
        reason = "the browser test needs " + " and ".join(missing)
        if os.environ.get("INTERACTIOND_REQUIRE_BROWSER") == "1":
            pytest.fail(reason + " (INTERACTIOND_REQUIRE_BROWSER=1)")
        pytest.skip(reason)
    return sync_api


@dataclass
class Served:
    """`interactiond serve` in a subprocess, and a small client of its API."""
    proc: subprocess.Popen
    url: str
    login_url: str
    token: str

    def call(self, method: str, tail: str, body: Any = None, playbook: str = "local/default") -> tuple[int, Any]:
        org, name = playbook.split("/")
        url = self.url + (tail if tail.startswith("/v1/") else f"/v1/orgs/{org}/playbooks/{name}{tail}")
        req = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def define(self, name: str, source: str, playbook: str = "local/default") -> None:
        status, body = self.call("POST", "/definitions", {"type": "interaction", "name": name, "source": source}, playbook)
        assert status in (200, 201), body

    def run(self, name: str, input_: Any, playbook: str = "local/default") -> str:
        status, body = self.call("POST", "/runs", {"type": "interaction", "name": name, "input": input_}, playbook)
        assert status == 202, body
        return body["run_id"]


@pytest.fixture
def served(tmp_path):
    (tmp_path / "interactiond.yaml").write_text("playbooks:\n  acme/ops: {}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "interactiond", "serve", "--db", str(tmp_path / "inbox.db"), "--config",
         str(tmp_path / "interactiond.yaml"), "--host", "127.0.0.1", "--port", "0", "--clock", "manual"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
        assert ready.wait(30) and "login" in printed, f"serve printed no inbox URL: {proc.stderr.read() if proc.poll() is not None else ''}"
        login = printed["login"]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/login\?token=\S+", login), login
        token = (tmp_path / "inbox.db.token").read_text().strip()
        yield Served(proc, login.split("/login", 1)[0], login, token)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_inbox_in_a_real_browser(served):
    sync_api = _playwright()
    expect = sync_api.expect
    expect.set_options(timeout=10_000)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    served.define("approve", APPROVAL)
    served.define("boxes", BOXES)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            ctx = browser.new_context(viewport={"width": 1000, "height": 900}, locale="en-GB")
            page = ctx.new_page()
            broken: list[str] = []             # script errors and CSP refusals (not the 4xx answers it reads)
            page.on("pageerror", lambda exc: broken.append(str(exc)))
            page.on("console", lambda m: m.type == "error" and not m.text.startswith("Failed to load resource")
                    and broken.append(m.text))

            # Sign in from the URL serve printed: the token leaves the address bar for an HttpOnly cookie.
            page.goto(served.login_url)
            expect(page).to_have_url(served.url + "/")
            [cookie] = [c for c in ctx.cookies() if c["name"] == itd.SESSION_COOKIE]
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
            expect(page.locator("#empty")).to_be_visible()
            expect(page.locator("#live")).to_have_text("Live: event stream")
            expect(page.get_by_label("Playbook")).to_have_value("local/default")

            # Requests raised over the API appear without a reload, newest first, as safe Markdown.
            run_a = served.run("approve", {"owner": "ana", "review": "Clear goals; the **budget** is missing. <b>raw</b>"})
            ask_a = page.locator(f'li[data-run-id="{run_a}"]')
            expect(ask_a).to_be_visible()
            expect(ask_a.locator(".msg strong")).to_have_text("budget")
            expect(ask_a.locator(".msg")).to_contain_text("<b>raw</b>")
            expect(ask_a.locator(".meta time").nth(1)).to_have_text("in 2 days")
            run_b = served.run("boxes", {"owner": "ana"})
            run_c = served.run("approve", {"owner": "bob", "review": "Fine as it is."})
            expect(page.locator("li.req")).to_have_count(3)
            assert page.locator("li.req").evaluate_all("els => els.map(e => e.dataset.runId)") == [run_c, run_b, run_a]
            expect(page.locator("#count")).to_have_text("3 pending")

            # Filter by addressee, with counts.
            page.get_by_label("Addressed to").select_option("ana")
            expect(page.locator("li.req")).to_have_count(2)
            expect(page.locator("#to option:checked")).to_have_text("ana (2)")
            page.get_by_label("Addressed to").select_option("")
            expect(page.locator("li.req")).to_have_count(3)

            # A number out of bounds: the daemon's error shows next to its field.
            ask_b = page.locator(f'li[data-run-id="{run_b}"]')
            boxes = ask_b.get_by_label("Boxes", exact=True)
            expect(boxes).to_have_attribute("max", "12")
            boxes.fill("40")
            ask_b.get_by_role("button", name="Send the answer").click()
            expect(ask_b.locator(".field .err")).to_have_text("Boxes must be at most 12")
            expect(boxes).to_have_attribute("aria-invalid", "true")
            expect(boxes).to_be_focused()
            page.screenshot(path=str(ARTIFACTS / "inbox.png"), full_page=True)
            boxes.fill("6")
            ask_b.get_by_role("button", name="Send the answer").click()
            expect(ask_b).to_have_count(0)

            # An enum button with a note beside it, by keyboard: type the note, Tab to a choice, Enter.
            ask_a.get_by_label("Note (optional)", exact=True).fill("Ship it.")
            page.keyboard.press("Tab")
            expect(ask_a.get_by_role("button", name="approve")).to_be_focused()
            page.keyboard.press("Enter")
            expect(ask_a).to_have_count(0)
            expect(page.locator("#status")).to_contain_text("Answered approve for ana")
            assert served.call("GET", f"/runs/{run_a}")[1]["output"] == {"verdict": "approve", "note": "Ship it."}
            assert served.call("GET", f"/runs/{run_b}")[1]["output"] == {"boxes": 6}

            # An expired request leaves too, when the daemon's clock passes its expiry. The clock moves
            # in steps shorter than an inbox session's 12 h idle limit, the page's session used between.
            for _ in range(7):
                assert served.call("POST", "/v1/admin/clock", {"advance": "PT11H"})[0] == 200
                assert page.request.get(served.url + "/web/session").status == 200
            expect(page.locator(f'li[data-run-id="{run_c}"]')).to_have_count(0)
            expect(page.locator("#empty")).to_be_visible()
            expect(page.locator("#count")).to_have_text("0 pending")

            # The history of the answered request: each event with its time; the whole one on click.
            page.locator("#status").get_by_role("link", name="Open its history").click()
            expect(page).to_have_url(re.compile(r"#/runs/"))
            expect(page.locator("dl.run")).to_contain_text("succeeded")
            expect(page.locator("dl.run")).to_contain_text("approve (interaction, version 1)")
            # Who answered, in words, and when: the session's name, not a token id.
            expect(page.locator("dl.run .answered-by")).to_contain_text("inbox session on")
            expect(page.locator("dl.run .answered-by time")).not_to_be_empty()
            assert "tok_" not in page.locator("dl.run").inner_text()
            events = page.locator("ol.timeline > li")
            expect(events.locator("strong")).to_have_text(["interaction_requested", "request_answered", "run_succeeded"])
            expect(events.first.locator("time")).not_to_be_empty()
            expect(events.nth(1).locator("button .muted")).to_have_text("by inbox session")
            answered = events.nth(1).locator("button")
            answered.click()
            expect(answered).to_have_attribute("aria-expanded", "true")
            expect(events.nth(1).locator("pre")).to_contain_text('"note": "Ship it."')
            page.screenshot(path=str(ARTIFACTS / "history.png"), full_page=True)

            # The definitions: each one's overview and source.
            page.get_by_role("link", name="Definitions").click()
            boxes_def = page.locator('details[data-name="boxes"]')
            boxes_def.locator("summary").click()
            expect(boxes_def.locator("pre")).to_contain_text("maximum: 12")
            expect(boxes_def.locator(".msg")).not_to_be_empty()

            # Another playbook, from the selector an operator sees.
            page.get_by_role("link", name="Inbox").click()
            served.define("boxes", BOXES, "acme/ops")
            run_ops = served.run("boxes", {"owner": "dee"}, "acme/ops")
            page.get_by_label("Playbook").select_option("acme/ops")
            expect(page.locator(f'li[data-run-id="{run_ops}"]')).to_be_visible()
            page.get_by_label("Playbook").select_option("local/default")
            expect(page.locator("#empty")).to_be_visible()

            # Without the stream (as behind a proxy that breaks SSE) the page polls.
            polling = ctx.new_page()
            polling.goto(served.url + "/?live=poll")
            expect(polling.locator("#live")).to_have_text("Live: checks every 2 s")
            run_d = served.run("boxes", {"owner": "cy"})
            expect(polling.locator(f'li[data-run-id="{run_d}"]')).to_be_visible()
            polling.close()

            # Phone width: nothing scrolls sideways, and every field has a label.
            page.set_viewport_size({"width": 360, "height": 780})
            expect(page.locator(f'li[data-run-id="{run_d}"]')).to_be_visible()
            assert page.evaluate("document.documentElement.scrollWidth") <= 360
            page.screenshot(path=str(ARTIFACTS / "inbox-phone.png"))
            unlabelled = page.evaluate("""[...document.querySelectorAll('input, textarea, select, button')]
                .filter(e => e.offsetParent !== null)
                .filter(e => e.tagName === 'BUTTON' ? !e.textContent.trim() : !e.labels.length && !e.getAttribute('aria-label'))
                .map(e => e.outerHTML)""")
            assert unlabelled == []

            # Log out: the session ends on the daemon, not only in this browser.
            page.get_by_role("button", name="Log out").click()
            expect(page.locator("#signin")).to_be_visible()
            assert not [c for c in ctx.cookies() if c["name"] == itd.SESSION_COOKIE]
            req = urllib.request.Request(served.url + "/web/session", headers={"Cookie": f"{itd.SESSION_COOKIE}={cookie['value']}"})
            with pytest.raises(urllib.error.HTTPError) as stale:
                urllib.request.urlopen(req, timeout=10)
            assert stale.value.code == 401
            assert broken == []
        except BaseException:
            page.screenshot(path=str(ARTIFACTS / "inbox-failure.png"), full_page=True)
            print("script errors:", broken, "\nlast page:", page.content()[-4000:])
            raise
        finally:
            browser.close()
