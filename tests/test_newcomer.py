"""What put a newcomer off, each checked as they met it: a schema keyword JSON Schema does not know
(YAML's flow mapping split at a comma) refused at save with its line; the overview's Markdown printed
once; the spent sign-in link's page in the page's style; a wrong option in one line with "did you
mean"; `stdio` on a terminal saying what it waits for; `define` checking the file before it needs the
daemon; the database named once, in the configuration or INTERACTIOND_DB."""
from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

import interactiond as itd
from daemon_kit import fresh_postgres
from test_cli_first_hour import ENV, EXE, cli, one_line
from test_web_inbox import CHROMIUM, CHROMIUM_ARGS, _playwright
from test_web_inbox import served as browser_served  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parent.parent
SPLIT = (ROOT / "examples" / "approve-brief.md").read_text().replace(
    "description: 'What to change, if anything' }", "description: What to change, if anything }")


# -- a keyword JSON Schema does not know ----------------------------------------------------------------

def problems(source: str) -> list[dict]:
    with pytest.raises(itd.DocumentError) as err:
        itd.parse_function(source)
    return err.value.problems


def test_the_split_flow_mapping_is_refused_with_its_line_and_how_to_quote_it():
    assert SPLIT != (ROOT / "examples" / "approve-brief.md").read_text()     # the example as it was
    [p] = problems(SPLIT)
    assert p["line"] == 19 and p["field"] == "output.schema.properties.remarks.if anything", p
    assert "'if anything' is not a JSON Schema keyword" in p["message"]
    assert "description: 'What to change, if anything'" in p["message"], p["message"]
    # The example as it is now: its hint is the whole text.
    doc = itd.parse_function((ROOT / "examples" / "approve-brief.md").read_text())
    assert doc.output_schema["properties"]["remarks"]["description"] == "What to change, if anything"
    assert "if anything" not in doc.output_schema["properties"]["remarks"]
    assert itd.check_files([str(ROOT / "examples")], out=open(os.devnull, "w")) == 0


@pytest.mark.parametrize("schema, line, where, says", [
    ("{type: object, properties: {n: {type: string, maxlength: 3}}}", 9, "input.schema.properties.n.maxlength",
     "did you mean maxLength?"),
    ("{type: object, title: T, owner: {type: string}}", 9, "input.schema.owner", "a property of your own goes under properties"),
    ("{type: array, items: {anyOf: [{type: string}, {tpye: integer}]}}", 9, "input.schema.items.anyOf.1.tpye",
     "did you mean type?"),
    ("{$schema: 'http://json-schema.org/draft-07/schema#', type: object, prefixItems: []}", 9,
     "input.schema.prefixItems", "not a JSON Schema keyword"),          # 2020-12's, not draft 7's
])
def test_an_unknown_keyword_at_any_depth_is_refused(schema, line, where, says):
    source = f"---\nto: ana\nexpires: P1D\noutput:\n  schema: {{type: object}}\n\n\ninput:\n  schema: {schema}\n---\nHi\n"
    [p] = problems(source)
    assert (p["line"], p["field"]) == (line, where) and says in p["message"], p


def test_names_under_properties_and_values_of_keywords_are_not_keywords():
    source = ("---\nto: ana\nexpires: P1D\ninput:\n  schema:\n    type: object\n    $defs: {who: {type: string}}\n"
              "    properties:\n      maxlength: {type: string, default: {anything: 1}, examples: [{x: 1}]}\n"
              "      who: {$ref: '#/$defs/who', x-note: null, enum: [a]}\n---\nHi\n")
    [p] = problems(source)                  # `x-note` is a keyword too; `maxlength` as a name and `anything` are not
    assert p["field"] == "input.schema.properties.who.x-note" and p["line"] == 10, p
    itd.parse_function(source.replace(", x-note: null", ""))


async def test_saving_over_http_refuses_it_with_the_line(d):
    status, body = await d.call("POST", "/definitions", {"type": "interaction", "name": "brief", "source": SPLIT})
    assert status == 422, body
    assert [(e["line"], e["field"]) for e in body["errors"]] == [(19, "output.schema.properties.remarks.if anything")]


async def test_a_definition_an_older_version_saved_still_runs(d):
    """Saved before the rule (as an older version saved it, in the store): its runs are not refused."""
    import yaml
    front = yaml.safe_load(SPLIT.split("---\n")[1])
    assert front["output"]["schema"]["properties"]["remarks"]["if anything"] is None

    def change(tx, fx):
        return tx.save_definition(playbook="local/default", type_="interaction", name="brief", source=SPLIT,
                                  sha=itd.sha256_hex(SPLIT), overview="", description=front["description"], uses=[],
                                  now=d.clock.now_ms(), by="tok_older", answer_schema=itd.dumps(front["output"]["schema"]))
    assert await d.engine.store.write(change) == (1, True)
    status, run = await d.run("brief", {"editor": "ana", "title": "T", "draft": "D"})
    assert status == 202, run
    status, fact = await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"decision": "publish"}})
    assert status == 200, fact
    status, ended = await d.call("GET", f"/runs/{run['run_id']}")
    assert ended["status"] == "succeeded" and ended["output"] == {"decision": "publish"}, ended
    # Saved again now, the same text is refused with its line.
    status, body = await d.call("POST", "/definitions", {"type": "interaction", "name": "brief", "source": SPLIT})
    assert status == 422 and body["errors"][0]["line"] == 19, body


# -- the overview ---------------------------------------------------------------------------------------

def test_the_overview_prints_a_bold_value_once():
    text = itd.overview(itd.parse_function((ROOT / "examples" / "approve-brief.md").read_text()))
    assert "sign-off: **title**\n" in text and "****" not in text, text
    assert "> **draft**" in text                        # a value unmarked in the template is bold
    assert itd.template_words("`{{ input.id }}` and __{{ input.who }}__ and {{ 'plain' }}") == "`id` and __who__ and plain"


# -- the spent sign-in link's page ----------------------------------------------------------------------

def test_the_spent_link_page_has_the_page_style_in_a_real_browser(browser_served):
    sync_api = _playwright()
    login = browser_served.login_url
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            first = browser.new_context().new_page()
            first.goto(login)                           # spends it
            assert first.url == browser_served.url + "/"
            page = browser.new_context().new_page()     # someone else, not signed in, opens it again
            blocked: list[str] = []
            page.on("console", lambda m: blocked.append(m.text) if "Content Security Policy" in m.text else None)
            resp = page.goto(login)
            assert resp.status == 401
            sync_api.expect(page.get_by_role("heading", level=1)).to_have_text("This sign-in link does not work")
            style = page.evaluate("""() => { const b = getComputedStyle(document.body),
                                                   s = getComputedStyle(document.querySelector('#spent'));
                                             return [b.fontFamily, s.borderTopStyle,
                                                     getComputedStyle(document.querySelector('header.top')).display] }""")
            assert "serif" not in style[0].replace("sans-serif", ""), style     # the page's font, not Times
            assert style[1] == "solid" and style[2] != "inline", style           # the card and the header bar
            assert page.title() == "Sign-in link spent · interactiond"
            assert not blocked, blocked
        finally:
            browser.close()


# -- the command line -----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["serve", "--prot", "1"], "interactiond serve: unrecognized arguments: --prot 1; did you mean --port?"),
    (["serv"], "interactiond: argument COMMAND: invalid choice: serv; did you mean serve?"),
    (["--verison"], "interactiond: unrecognized arguments: --verison; did you mean --version?"),
    (["token", "create", "--rle", "reader"], "interactiond token create: unrecognized arguments: --rle;"
                                             " did you mean --role?"),
    (["runs", "--status", "succeded"], "interactiond runs: argument --status: invalid choice: succeded;"
                                       " did you mean succeeded?"),
    (["run", "interaction"], "interactiond run: the following arguments are required: name"),
])
def test_a_wrong_option_is_one_line_with_did_you_mean(tmp_path, args, says):
    line = one_line(cli(*args, cwd=tmp_path, code=2))
    assert line.startswith(says) and line.endswith("--help)"), line
    assert "usage:" not in line


def test_stdio_on_a_terminal_says_on_stderr_what_it_waits_for(tmp_path):
    main, child = pty.openpty()
    proc = subprocess.Popen([*EXE, "stdio", "--db", str(tmp_path / "t.db")], cwd=tmp_path, env=ENV,
                            stdin=child, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(child)
    try:
        ready, _, _ = select.select([proc.stderr], [], [], 60)
        assert ready, "stdio said nothing on a terminal"
        line = proc.stderr.readline()
        assert line.startswith("interactiond stdio: waiting for an MCP client's JSON-RPC messages on stdin"), line
        assert "Ctrl-D" in line
        os.write(main, b"\x04")                         # Ctrl-D: the end of its input
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out == "", (out, err)
    finally:
        os.close(main)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Not on a terminal (an agent started it): stderr stays quiet and stdout is MCP's alone.
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    piped = subprocess.run([*EXE, "stdio", "--db", str(tmp_path / "t.db")], cwd=tmp_path, env=ENV,
                           input=json.dumps(init) + "\n", capture_output=True, text=True, timeout=60)
    assert "waiting for" not in piped.stderr
    assert json.loads(piped.stdout.splitlines()[0])["result"]["serverInfo"]["name"]


def test_define_checks_the_file_before_it_needs_the_daemon(tmp_path):
    bad = tmp_path / "brief.md"
    bad.write_text(SPLIT)
    started = time.monotonic()
    out = cli("define", str(bad), cwd=tmp_path, code=1)  # no daemon runs here, nor ever did
    assert out.stderr.splitlines() == [
        f"{bad}:19: output.schema.properties.remarks.if anything: 'if anything' is not a JSON Schema keyword: in a"
        " { ... } mapping a comma ends the text before it, so quote text that holds one:"
        " description: 'What to change, if anything'"], out.stderr
    assert time.monotonic() - started < 30
    flow = tmp_path / "flow.yaml"
    flow.write_text("steps: 3\n")
    lines = cli("define", str(flow), cwd=tmp_path, code=1).stderr.splitlines()
    assert lines and all(line.startswith(f"{flow}:1: ") for line in lines), lines
    # A good file goes on to the daemon, and then it is the daemon that is missing.
    good = one_line(cli("define", str(ROOT / "examples" / "approve-brief.md"), cwd=tmp_path, code=3))
    assert "cannot reach the daemon" in good


# -- the database, named once ---------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["configuration", "environment"])
def test_the_database_is_named_once_for_every_command(tmp_path, where):
    with fresh_postgres() as url:
        env = {**ENV, "INTERACTIOND_DB": ""}
        if where == "configuration":
            (tmp_path / "interactiond.yaml").write_text(f"database: {url}\n")
            env["INTERACTIOND_CONFIG"] = str(tmp_path / "interactiond.yaml")
        else:
            env["INTERACTIOND_DB"] = url
        proc = subprocess.Popen([*EXE, "serve", "--port", "0"], cwd=tmp_path, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            first = proc.stdout.readline()
            assert f"serving {url} at http://" in first, first + (proc.stderr.read() if proc.poll() else "")

            def run(*args: str) -> subprocess.CompletedProcess:
                done = subprocess.run([*EXE, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                                      timeout=60)
                assert done.returncode == 0, (args, done.stderr)
                return done
            run("define", str(ROOT / "examples" / "approve-brief.md"))
            rid = json.loads(run("run", "interaction", "approve-brief", "--input", json.dumps(
                {"editor": "ana", "title": "T", "draft": "D"})).stdout)["run_id"]
            assert [r["run_id"] for r in json.loads(run("inbox").stdout)["data"]] == [rid]
            assert run("link", "--for", "ana").stdout.startswith("http://127.0.0.1:")
            run("answer", rid, '{"decision": "publish"}')
            assert json.loads(run("get", rid).stdout)["status"] == "succeeded"
            assert not list(tmp_path.glob("*.db*"))      # nothing fell back to ./interactiond.db
        finally:
            proc.terminate()
            proc.wait(timeout=30)
