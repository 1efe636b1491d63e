"""The answer link and the inbox on a phone (SPEC section 24): Chromium's mobile emulation at 390x844
CSS pixels, where nothing scrolls sideways and every button is at least 44 px high; a coding agent's
tool call approved there with a remembered decision, and that rule revoked from the inbox's Rules
page. The picture of the answer link at phone size is docs/answer-link-phone.png, taken here."""
from __future__ import annotations

from pathlib import Path

from test_web_inbox import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, _playwright, served  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parent.parent
PHONE = {"viewport": {"width": 390, "height": 844}, "device_scale_factor": 2, "is_mobile": True, "has_touch": True,
         "user_agent": "Mozilla/5.0 (Linux; Android 14; Pixel 8) AppleWebKit/537.36 (KHTML, like Gecko)"
                       " Chrome/126.0 Mobile Safari/537.36"}
LONG = ("rm -rf build && find ./src/generated/protobuf/very/deeply/nested/package/path/that/goes/on/and/on"
        "/and/on -name '*.pyc' -delete")

#: Elements that scroll sideways (wider content than their box, where overflow lets them scroll), and
#: visible buttons lower than 44 px.
SIDEWAYS = """[...document.querySelectorAll('*')].filter(e => e.offsetParent !== null || e === document.body)
  .filter(e => e.scrollWidth > e.clientWidth + 1 && !['visible', 'hidden', 'clip'].includes(getComputedStyle(e).overflowX))
  .map(e => e.tagName + '.' + e.className)"""
LOW_BUTTONS = """[...document.querySelectorAll('button')].filter(b => b.offsetParent !== null)
  .filter(b => b.getBoundingClientRect().height < 44).map(b => b.textContent.trim() + ' ' + b.getBoundingClientRect().height)"""


def fits_a_phone(page) -> None:
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    assert page.evaluate("document.body.scrollWidth") <= 390
    assert page.evaluate(SIDEWAYS) == []
    assert page.evaluate(LOW_BUTTONS) == []


def tool_call(served, command: str) -> dict:
    status, run = served.call("POST", "/runs", {"type": "interaction", "name": "approve-tool-call", "input": {
        "tool": "Bash", "arguments": {"command": command, "description": "Clean the build"}, "cwd": "/home/ana/shop",
        "session": "5f1c2e9a-0b7d-4a53-9e61-3d2f8c1b7a40", "event": "PreToolUse", "to": "ana"}})
    assert status == 202, run
    status, page = served.call("GET", "/interactions")
    return next(r for r in page["data"] if r["run_id"] == run["run_id"])


def test_an_agent_s_call_approved_on_a_phone_and_its_rule_revoked(served):
    sync_api = _playwright()
    expect = sync_api.expect
    expect.set_options(timeout=10_000)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    asked = tool_call(served, LONG)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        ctx = browser.new_context(**PHONE)
        page = ctx.new_page()
        try:
            # The answer link: the command as code, wrapped; the buttons a thumb can press.
            page.goto(asked["answer_url"])
            expect(page.locator(".msg pre code")).to_contain_text("rm -rf build")
            assert page.evaluate("window.innerWidth") == 390
            fits_a_phone(page)
            page.screenshot(path=str(ROOT / "docs" / "answer-link-phone.png"), full_page=True)
            # Remembered by its first word: refused beside the field, since the command joins two.
            page.get_by_label("The same command, or files in the same folder, for 1 hour").check()
            page.get_by_role("button", name="Yes").click()
            expect(page.locator(".err").first).to_contain_text("remember it as exact")
            fits_a_phone(page)
            # Approved, this very call remembered for an hour.
            page.get_by_label("This very call, for 1 hour").check()
            page.get_by_role("button", name="Yes").click()
            expect(page.locator("#status")).to_contain_text("Answered by")
            fits_a_phone(page)
            status, rules = served.call("GET", "/rules")
            assert [(r["scope"], r["tool"], r["approved"]) for r in rules["data"]] == [("exact", "Bash", True)]
            status, run = served.call("GET", f"/runs/{asked['run_id']}")
            assert run["output"] == {"approved": True, "arguments": {"command": LONG, "description": "Clean the build"},
                                     "remember": {"for": "PT1H", "scope": "exact"}}

            # The inbox on the same phone: a request, then the rule, revoked.
            other = tool_call(served, "git push --force origin main")
            page.goto(served.login_url)
            expect(page.locator(f'li[data-run-id="{other["run_id"]}"]')).to_be_visible()
            expect(page.locator(f'li[data-run-id="{other["run_id"]}"] .msg')).to_contain_text("git push --force")
            fits_a_phone(page)
            page.screenshot(path=str(ARTIFACTS / "inbox-phone-390.png"), full_page=True)
            page.get_by_role("link", name="Rules").click()
            rule = page.locator(f'li[data-rule-id="{rules["data"][0]["id"]}"]')
            expect(rule).to_contain_text("Allow Bash")
            expect(rule).to_contain_text("this very input")
            fits_a_phone(page)
            rule.get_by_role("button", name="Revoke").click()
            expect(rule).to_have_count(0)
            expect(page.locator("#status")).to_contain_text("asked again")
            status, rules = served.call("GET", "/rules")
            assert rules["data"] == []
        except BaseException:
            page.screenshot(path=str(ARTIFACTS / "phone-failure.png"), full_page=True)
            raise
        finally:
            browser.close()
