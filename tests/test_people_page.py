"""People in a real Chromium (SPEC section 18): a teammate's own sign-in link, and answer links that
need no sign-in. `interactiond serve --clock manual` runs as a subprocess (tests/test_web_inbox.py's
`served`); `interactiond link` asks it for the link, as a user would.
"""
from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

from daemon_kit import APPROVAL
from test_web_inbox import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, _playwright, served  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parent.parent
CHOICE = {"prompt": "Which **plan** do we launch with?", "to": "ana",
          "options": [{"id": "basic", "label": "Basic, 9 EUR"}, {"id": "team", "label": "Team, 29 EUR"}]}


def link_for(db: Path, person: str) -> str:
    """`interactiond link --for PERSON`, against the running daemon (found beside its database)."""
    proc = subprocess.run([sys.executable, "-m", "interactiond", "link", "--for", person, "--db", str(db)],
                          capture_output=True, text=True, timeout=60, cwd=db.parent)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def open_requests(served) -> dict[str, dict]:
    status, page = served.call("GET", "/interactions")
    assert status == 200, page
    return {r["run_id"]: r for r in page["data"]}


class Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.hrefs += [v for k, v in attrs if k in ("href", "src") and v]


def test_a_teammate_and_an_answer_link_in_a_real_browser(served, tmp_path):
    sync_api = _playwright()
    expect = sync_api.expect
    expect.set_options(timeout=10_000)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    served.define("approve", APPROVAL)
    ana_brief = served.run("approve", {"owner": "ana", "review": "Clear goals; the budget is missing."})
    bob_brief = served.run("approve", {"owner": "bob", "review": "Fine as it is."})
    status, choice = served.call("POST", "/runs", {"type": "interaction", "name": "ask-choice", "input": CHOICE})
    assert status == 202, choice
    ana_choice = choice["run_id"]
    cy_brief = served.run("approve", {"owner": "cy", "review": "Short."})

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = None
        try:
            # Ana signs in with her own link: her requests only, her name, no runs or definitions.
            ctx = browser.new_context(viewport={"width": 900, "height": 760}, locale="en-GB")
            page = ctx.new_page()
            broken: list[str] = []
            page.on("pageerror", lambda exc: broken.append(str(exc)))
            page.goto(link_for(tmp_path / "inbox.db", "ana"))
            expect(page).to_have_url(served.url + "/")
            expect(page.locator("#who")).to_have_text("Signed in as ana")
            expect(page.locator("li.req")).to_have_count(2)
            assert sorted(page.locator("li.req").evaluate_all("els => els.map(e => e.dataset.runId)")) == \
                sorted([ana_brief, ana_choice])
            expect(page.locator("#nav")).to_be_hidden()
            expect(page.get_by_label("Addressed to")).to_be_hidden()
            expect(page.locator("#count")).to_have_text("2 pending")

            # The choice: one may be picked, so radios with the options' labels; nothing picked is
            # refused in words beside the group.
            ask = page.locator(f'li[data-run-id="{ana_choice}"]')
            group = ask.get_by_role("group", name="Your choice")
            expect(group.get_by_role("radio")).to_have_count(2)
            expect(group.get_by_role("radio", name="Team, 29 EUR")).to_be_visible()
            ask.get_by_role("button", name="Send the answer").click()
            expect(ask.locator(".field .err")).to_have_text("Your choice is required")
            expect(group).to_have_attribute("aria-invalid", "true")
            page.screenshot(path=str(ARTIFACTS / "person-inbox.png"))
            group.get_by_role("radio", name="Team, 29 EUR").check()
            ask.get_by_role("button", name="Send the answer").click()
            expect(ask).to_have_count(0)
            assert served.call("GET", f"/runs/{ana_choice}")[1]["output"] == {"option_ids": ["team"]}

            # Her answer is recorded as hers.
            brief = page.locator(f'li[data-run-id="{ana_brief}"]')
            brief.get_by_role("button", name="approve").click()
            expect(brief).to_have_count(0)
            expect(page.locator("#status")).to_contain_text("Answered approve for ana")
            expect(page.locator("#status a")).to_have_count(0)            # no history: runs are not hers
            run = served.call("GET", f"/runs/{ana_brief}")[1]
            assert run["output"] == {"verdict": "approve"} and run["settled_by"] == "ana"
            events = served.call("GET", f"/runs/{ana_brief}/events")[1]["data"]
            assert [e["by"] for e in events if e["type"] == "request_answered"] == ["ana"]
            assert served.call("GET", f"/runs/{bob_brief}")[1]["status"] == "waiting"
            ctx.close()

            # A script that follows every link (an unfurler, a mail scanner) changes nothing.
            links = {rid: r["answer_url"] for rid, r in open_requests(served).items()}
            assert set(links) == {bob_brief, cy_brief}
            before = served.call("GET", f"/runs/{cy_brief}/events")[1]["data"]
            with urllib.request.urlopen(links[cy_brief], timeout=10) as resp:
                html = resp.read().decode()
            found = Links()
            found.feed(html)
            for href in found.hrefs + [links[cy_brief]]:
                if href.startswith(("http://", "https://", "/")) and not href.startswith("//"):
                    target = href if href.startswith("http") else served.url + href
                    urllib.request.urlopen(urllib.request.Request(target, method="GET"), timeout=10).close()
            assert served.call("GET", f"/runs/{cy_brief}/events")[1]["data"] == before
            assert served.call("GET", f"/runs/{cy_brief}")[1]["status"] == "waiting"

            # Bob answers through his link, signed in nowhere; the same form sent again later shows
            # the first answer.
            fresh = browser.new_context(viewport={"width": 720, "height": 640}, locale="en-GB")
            bob = fresh.new_page()
            late = fresh.new_page()
            bob.goto(links[bob_brief])
            late.goto(links[bob_brief])
            expect(bob.get_by_role("heading", level=1)).to_contain_text("approve for bob")
            expect(bob.locator(".msg")).to_contain_text("Fine as it is.")
            bob.get_by_label("Note (optional)").fill("Add the launch date.")
            bob.screenshot(path=str(ARTIFACTS / "answer-link.png"))        # docs/answer-link.png is one of these
            bob.get_by_role("button", name="revise").click()
            expect(bob.locator("#status")).to_contain_text("Answered by bob")
            expect(bob).to_have_url(links[bob_brief])
            run = served.call("GET", f"/runs/{bob_brief}")[1]
            assert run["output"] == {"verdict": "revise", "note": "Add the launch date."} and run["settled_by"] == "bob"
            late.get_by_role("button", name="approve").click()
            expect(late.locator("#status")).to_contain_text("Answered by bob")
            expect(late.locator("#status pre")).to_contain_text("Add the launch date.")
            assert served.call("GET", f"/runs/{bob_brief}")[1]["output"]["verdict"] == "revise"

            # A tampered link is a plain 404 page.
            tampered = re.sub(r".$", lambda m: "A" if m.group(0) != "A" else "B", links[cy_brief])
            resp = bob.goto(tampered)
            assert resp.status == 404
            expect(bob.get_by_role("heading", level=1)).to_have_text("This link does not work")
            assert broken == []
        except BaseException:
            if page is not None and not page.is_closed():
                page.screenshot(path=str(ARTIFACTS / "people-failure.png"), full_page=True)
            raise
        finally:
            browser.close()


def test_runs_page_filters_and_pages_past_200(served, tmp_path):
    sync_api = _playwright()
    expect = sync_api.expect
    expect.set_options(timeout=15_000)
    served.define("approve", APPROVAL)
    first = served.run("approve", {"owner": "ana", "review": "the oldest"})
    for i in range(200):
        served.run("approve", {"owner": "bob", "review": f"#{i}"})
    status, _ = served.call("POST", f"/runs/{first}/cancel")
    assert status == 200
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(served.login_url)
            page.get_by_role("link", name="Runs").click()
            rows = page.locator("#page tbody tr")
            expect(rows).to_have_count(200)
            expect(page.locator(f'tr[data-run-id="{first}"]')).to_have_count(0)
            page.get_by_role("button", name="Show older runs").click()
            expect(rows).to_have_count(201)
            expect(page.locator(f'tr[data-run-id="{first}"]')).to_be_visible()
            expect(page.get_by_role("button", name="Show older runs")).to_be_hidden()
            page.get_by_label("Status").select_option("rejected")
            expect(rows).to_have_count(1)
            expect(rows.first).to_contain_text("rejected (cancelled)")
            page.get_by_label("Status").select_option("")
            page.get_by_label("Function").select_option("ask-text")
            expect(page.locator("#runs-none")).to_be_visible()
            page.get_by_label("Function").select_option("approve")
            expect(rows).to_have_count(200)
        finally:
            browser.close()
