"""The README and docs/ as a reader uses them: every shell block (```sh) runs, and the pictures in
docs/ are taken from the page as it is.

How a block runs: in a fresh directory holding a copy of examples/, with `interactiond` meaning this
checkout's module, under `bash` with `set -eo pipefail` (a failing command fails the block) and
`curl` failing on an HTTP error (`--fail-with-body`). A block that starts `interactiond serve ... &`
itself gets `--port 0` where it names no port, and waits for the daemon before its next line; any
other block runs against an `interactiond serve --port 0` started in that directory first, with
`127.0.0.1:8765` in the block read as that daemon's address. A block that cannot run here says why
in the comment right above it, `<!-- test: skip REASON -->`, and is skipped with that reason.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_web_inbox import CHROMIUM, CHROMIUM_ARGS, _playwright
from test_web_inbox import served as browser_served  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:^<!-- test: (?P<directive>.*?) -->\n)?^```sh\n(?P<body>.*?)^```$", re.S | re.M)

PRELUDE = """set -eo pipefail
curl() { command curl --fail-with-body "$@"; }
__ready() {
  for _ in $(seq 300); do interactiond runs >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "the daemon the block started did not answer within 30 s" >&2; return 1
}
trap 'kill $(jobs -p) 2>/dev/null || true; wait' EXIT
"""


def blocks() -> list:
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("body"))
            found.append(pytest.param(page, m.group("directive"), m.group("body"),
                                      id=f"{page.relative_to(ROOT)}:{line}"))
    return found


def test_the_pages_hold_shell_blocks_and_every_skip_says_why():
    found = blocks()
    assert len(found) >= 10, [p.id for p in found]
    for p in found:
        page, directive, body = p.values
        if directive is not None:
            assert directive.startswith("skip ") and len(directive) > 30, (p.id, directive)


def test_the_readme_is_a_quick_start():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for part in ("## The two commands", "## A first request", "## The page", "## MCP", "## Where to read on"):
        assert part in readme, part
    assert "pip install -e . && interactiond serve" in readme
    assert "pip install -e '.[test]' && python -m pytest -q" in readme       # what .ci/run runs
    assert "pip install -e '.[test]' && python -m pytest -q" in (ROOT / ".ci" / "run").read_text()
    assert "pipx install" in readme
    # The function the README shows is the example as it is.
    shown = re.search(r"```markdown\n(.*?)```", readme, re.S).group(1)
    assert shown == (ROOT / "examples" / "approve-brief.md").read_text()
    # The map names every guide in docs/, and the guides of the parts that add theirs.
    for guide in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{guide.name})" in readme, guide.name
    for guide in ("webhooks", "email", "python", "mcp-tasks", "coding-agents"):
        assert f"(docs/{guide}.md)" in readme, guide
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    for word in ("Playbook", "Function", "Run", "Request", "Reading", "Telling"):
        assert f"**{word}**" in glossary, word


def test_links_between_the_pages_lead_somewhere():
    written = {"webhooks.md", "email.md", "python.md", "mcp-tasks.md", "coding-agents.md"}   # added with their parts
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            where = (page.parent / target).resolve()
            assert where.exists() or where.name in written, (page.name, target)


def _shim(bin_dir: Path) -> Path:
    bin_dir.mkdir()
    shim = bin_dir / "interactiond"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m interactiond "$@"\n')
    shim.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("page, directive, body", blocks())
def test_every_shell_block_runs(page, directive, body, tmp_path):
    if directive is not None:
        pytest.skip(directive.removeprefix("skip ").strip())
    work = tmp_path / "work"
    shutil.copytree(ROOT / "examples", work / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTIOND_")}
    env.update(PYTHONPATH=str(ROOT), PATH=os.pathsep.join([str(_shim(tmp_path / "bin")),
                                                           str(Path(sys.executable).parent), env.get("PATH", "")]))
    daemon = None
    if re.search(r"^interactiond serve\b", body, re.M):
        def own(m: re.Match) -> str:
            line = m.group(0)
            if "--port" not in line:
                line = line.replace("interactiond serve", "interactiond serve --port 0", 1)
            return line + "\n__ready"
        body = re.sub(r"^interactiond serve\b[^\n]*&[^\n]*", own, body, flags=re.M)
    else:
        daemon = subprocess.Popen([str(tmp_path / "bin" / "interactiond"), "serve", "--port", "0"], cwd=work, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = daemon.stdout.readline()
        found = re.search(r"at http://(127\.0\.0\.1:\d+)", first)
        assert found, first + (daemon.stderr.read() if daemon.poll() is not None else "")
        for line in daemon.stdout:
            if line.startswith("operator token:"):
                break
        body = body.replace("127.0.0.1:8765", found.group(1))
    try:
        done = subprocess.run(["bash", "-c", PRELUDE + body], cwd=work, env=env, capture_output=True, text=True,
                              timeout=240)
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.communicate(timeout=60)
    assert done.returncode == 0, f"exit {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    assert "Traceback" not in done.stderr, done.stderr


# -- the pictures in docs/ --------------------------------------------------------------------------------

def test_the_pictures_in_docs_are_taken_from_the_page(browser_served):
    sync_api = _playwright()
    expect = sync_api.expect
    expect.set_options(timeout=10_000)
    served = browser_served
    served.define("approve-brief", (ROOT / "examples" / "approve-brief.md").read_text())
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            ctx = browser.new_context(viewport={"width": 1000, "height": 900}, locale="en-GB")
            page = ctx.new_page()
            page.goto(served.login_url)
            expect(page).to_have_url(served.url + "/")
            served.run("approve-brief", {"editor": "ana", "title": "Q3 launch post",
                                         "draft": "We launch the new plans on Monday; prices stay as they are."})
            status, choice = served.call("POST", "/runs", {"type": "interaction", "name": "ask-choice", "input": {
                "prompt": "Which **plan** do we launch with?", "to": "ana",
                "options": [{"id": "basic", "label": "Basic, 9 EUR"}, {"id": "team", "label": "Team, 29 EUR"}]}})
            assert status == 202, choice
            status, text = served.call("POST", "/runs", {"type": "interaction", "name": "ask-text", "input": {
                "prompt": "What should the launch mail's subject line say?", "to": "bob"}})
            assert status == 202, text
            expect(page.locator("li.req")).to_have_count(3)
            expect(page.locator("#count")).to_have_text("3 pending")
            page.screenshot(path=str(ROOT / "docs" / "inbox.png"), full_page=True)

            # An answer link, opened by its addressee, signed in nowhere.
            items = served.call("GET", "/interactions?function=approve-brief")[1]["data"]
            link = browser.new_context(viewport={"width": 720, "height": 640}, locale="en-GB").new_page()
            link.goto(items[0]["answer_url"])
            expect(link.get_by_role("heading", level=1)).to_be_visible()
            expect(link.locator("form")).to_be_visible()
            link.screenshot(path=str(ROOT / "docs" / "answer-link.png"))

            # The sign-in link, spent above, opened again by someone else.
            spent = browser.new_context(viewport={"width": 720, "height": 420}, locale="en-GB").new_page()
            spent.goto(served.login_url)
            expect(spent.get_by_role("heading", level=1)).to_have_text("This sign-in link does not work")
            spent.screenshot(path=str(ROOT / "docs" / "spent-link.png"))
        finally:
            browser.close()
    for name in ("inbox.png", "answer-link.png", "spent-link.png"):
        data = (ROOT / "docs" / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name
