"""A newcomer's first hour on the command line, run as a user runs it (the real CLI as a subprocess,
against a real daemon): one line and an exit code for every failure, help for every option, the
client commands with their tables, `wait`, `check` on configurations, `demo`, and JSON logs."""
from __future__ import annotations

import json
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

import interactiond as itd

ROOT = Path(__file__).resolve().parent.parent
EXE = [sys.executable, "-m", "interactiond"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
BRIEF = json.dumps({"editor": "ana", "title": "Q3", "draft": "We launch on Monday."})


def cli(*args: str, cwd: Path, code: int | None = 0, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([*EXE, *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=ENV, **kw)
    if code is not None:
        assert proc.returncode == code, (args, proc.returncode, proc.stderr, proc.stdout)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def on_a_terminal(*args: str, cwd: Path) -> tuple[int, str]:
    """Run the CLI with stdout and stderr on a pseudo-terminal; (exit code, what the terminal showed)."""
    main, child = pty.openpty()
    proc = subprocess.Popen([*EXE, *args], cwd=cwd, env=ENV, stdin=subprocess.DEVNULL, stdout=child, stderr=child)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 4096)
        except OSError:                     # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    return proc.wait(timeout=60), b"".join(chunks).decode().replace("\r\n", "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(cwd: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([*EXE, "serve", "--port", "0", *extra], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    first = proc.stdout.readline()
    for line in proc.stdout:
        if line.startswith("operator token:"):
            break
    return proc, re.search(r"at (http://\S+)", first).group(1)


@pytest.fixture
def served(tmp_path):
    proc, url = start_serve(tmp_path, "--clock", "manual", "--host", "127.0.0.1")
    yield proc, url, tmp_path
    if proc.poll() is None:
        proc.kill()
        proc.wait()


CLIENT_CALLS = (("define", str(ROOT / "examples" / "approve-brief.md")), ("run", "interaction", "approve-brief"),
                ("get", "run_x"), ("wait", "run_x"), ("cancel", "run_x"), ("inbox",),
                ("answer", "run_x", '{"decision": "publish"}'), ("runs",), ("definitions",),
                ("definitions", "approve-brief"))


def test_every_client_command_against_a_stopped_daemon_prints_one_line_and_exits_3(served, tmp_path):
    proc, url, cwd = served
    proc.kill()                             # gone without cleaning up: its .url still names it
    proc.wait()
    assert (cwd / "interactiond.db.url").exists()
    for call in CLIENT_CALLS:
        line = one_line(cli(*call, cwd=cwd, code=3))
        assert line == (f"interactiond: cannot reach the daemon at {url} (from interactiond.db.url): is "
                        "`interactiond serve` running?"), line
    # A fresh directory: no file beside the database; the configuration's address is the one tried.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    port = free_port()
    (fresh / "c.yaml").write_text(f"listen: {{port: {port}}}\n")
    line = one_line(cli("inbox", "--config", "c.yaml", cwd=fresh, code=3))
    assert f"cannot reach the daemon at http://127.0.0.1:{port} (from the default; no interactiond.db.url" in line
    line = one_line(cli("runs", "--url", f"http://127.0.0.1:{port}", "--token", "itd_x", cwd=fresh, code=3))
    assert f"at http://127.0.0.1:{port} (from --url)" in line


def test_a_listener_that_does_not_answer_in_http_is_a_daemon_not_reached(tmp_path):
    import threading
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def answer_in_prose() -> None:
            for _ in range(2):
                conn, _ = listener.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(b"hello, this is not a daemon\n")

        threading.Thread(target=answer_in_prose, daemon=True).start()
        for call in (("runs",), ("answer", "run_x", "{}")):
            line = one_line(cli(*call, "--url", f"http://127.0.0.1:{port}", "--token", "itd_x", cwd=tmp_path, code=3))
            assert line == (f"interactiond: cannot reach the daemon at http://127.0.0.1:{port} (from --url): is "
                            "`interactiond serve` running?"), line


def test_help_describes_every_command_and_option():
    import argparse

    def walk(parser, path):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help != argparse.SUPPRESS, (path, action.dest)
            for option in action.option_strings:
                assert option in text, (path, option)
        for sub in subs:
            described = {c.dest: c.help for c in sub._choices_actions}
            for name, child in sub.choices.items():
                assert described.get(name), (path, name)         # the one line in its parent's --help
                assert child.description, (path, name)
                walk(child, path + [name])
        return len(subs)

    parser = itd.build_parser()
    assert walk(parser, ["interactiond"])
    top = parser.format_help()
    for name, line in itd.COMMANDS:
        assert name in top
    assert "exit codes" in top and "3  the daemon could not be reached" in top
    # Defaults are shown; the help a user sees is the same from the real command.
    demo = subprocess.run([*EXE, "demo", "--help"], capture_output=True, text=True, env=ENV, timeout=60).stdout
    assert "(default: 8765)" in demo
    inbox = subprocess.run([*EXE, "inbox", "--help"], capture_output=True, text=True, env=ENV, timeout=60).stdout
    assert "(default: 50)" in inbox and "(default: local/default)" in inbox and "(default: None)" not in inbox
    run = subprocess.run([*EXE, "run", "--help"], capture_output=True, text=True, env=ENV, timeout=60).stdout
    assert "the run's input, a JSON object (default: {})" in " ".join(run.split())


def test_check_reads_each_file_as_what_it_is(tmp_path):
    out = cli("check", str(ROOT / "examples"), cwd=tmp_path)
    assert f"{ROOT / 'examples' / 'interactiond.yaml'}: ok (configuration)" in out.stdout
    assert f"{ROOT / 'examples' / 'brief-approval.yaml'}: ok (workflow)" in out.stdout
    assert f"{ROOT / 'examples' / 'approve-brief.md'}: ok (function document)" in out.stdout
    files = [str(p) for p in sorted((ROOT / "examples").glob("*.md")) + sorted((ROOT / "examples").glob("*.yaml"))]
    assert cli("check", *files, cwd=tmp_path).stdout.count(": ok (") == len(files)
    bad = tmp_path / "team.yaml"
    bad.write_text("listen: {port: 99999}\nservers:\n  chat: {command: [x], colour: red}\n")
    out = cli("check", str(bad), cwd=tmp_path, code=1)
    assert out.stdout.splitlines() == [f"{bad}: listen.port: a port number from 0 to 65535",
                                       f"{bad}: servers.chat.colour: unknown key",
                                       f"{bad}: 2 problems (read as a configuration)"]
    flow = tmp_path / "flow.yaml"
    flow.write_text("document: {dsl: '1.0.3', namespace: t, name: flow, version: '1.0.0'}\ndo:\n  - a: {bogus: 1}\n")
    out = cli("check", str(flow), cwd=tmp_path, code=1)
    assert out.stdout.startswith(f"{flow}:3:") and out.stdout.rstrip().endswith("(read as a workflow)")


def test_the_client_commands_with_tables_on_a_terminal_and_json_when_piped(served):
    proc, url, cwd = served
    cli("define", str(ROOT / "examples" / "approve-brief.md"), cwd=cwd)
    run = json.loads(cli("run", "interaction", "approve-brief", "--input", BRIEF, cwd=cwd).stdout)
    rid = run["run_id"]
    code, shown = on_a_terminal("inbox", cwd=cwd)
    header, row = shown.splitlines()[:2]
    assert code == 0 and header.split() == ["RUN", "TO", "FUNCTION", "ASKED", "EXPIRES", "DELIVERY", "MESSAGE"]
    assert row.split()[:3] == [rid, "ana", "approve-brief"] and "in_inbox" in row
    code, shown = on_a_terminal("inbox", "--json", cwd=cwd)
    assert code == 0 and json.loads(shown)["data"][0]["run_id"] == rid
    assert json.loads(cli("inbox", "--to", "ana", cwd=cwd).stdout)["data"][0]["run_id"] == rid   # piped: JSON
    assert json.loads(cli("inbox", "--to", "bo", cwd=cwd).stdout)["data"] == []
    code, shown = on_a_terminal("runs", "--status", "waiting", cwd=cwd)
    assert code == 0 and shown.splitlines()[0].split() == ["RUN", "FUNCTION", "STATUS", "CREATED", "ENDED"]
    assert shown.splitlines()[1].split()[:4] == [rid, "approve-brief", "v1", "waiting"]
    code, shown = on_a_terminal("definitions", cwd=cwd)
    assert code == 0 and re.search(r"interaction\s+approve-brief\s+1\s+Ask an article's editor", shown)
    code, shown = on_a_terminal("definitions", "approve-brief", cwd=cwd)
    assert code == 0 and "sign off" in shown and not shown.lstrip().startswith("{")
    assert json.loads(cli("get", rid, cwd=cwd).stdout)["status"] == "waiting"
    broken = cwd / "broken.md"
    broken.write_text("---\nto: ana\nexpires: P90D\nmodel: gpt\n---\nHi\n")
    out = cli("define", str(broken), cwd=cwd, code=1)
    lines = out.stderr.splitlines()                    # a document's problems: one line each, with its line
    assert len(lines) == 2 and lines[0].startswith(f"{broken}:3: expires: ") and lines[1].startswith(f"{broken}:4: model: ")
    # Refusals: one line, exit 1; usage: exit 2. Nothing speaks of an MCP tool to a command-line user.
    line = one_line(cli("run", "interaction", "nope", cwd=cwd, code=1))
    assert "no interaction named 'nope' in local/default" in line and "list_definitions" not in line
    line = one_line(cli("answer", rid, "publish", cwd=cwd, code=2))
    assert line.startswith("interactiond: the answer is not JSON (malformed JSON")
    line = one_line(cli("run", "interaction", "approve-brief", "--input", "{", cwd=cwd, code=2))
    assert line.startswith("interactiond: --input is not JSON")
    line = one_line(cli("inbox", "--token", "itd_wrong", cwd=cwd, code=1))
    assert line == "interactiond: Unauthorized: the token is unknown or revoked"
    assert cli("inbox", "--playbook", "Bad", cwd=cwd, code=2).stderr.count("\n") == 1
    assert "invalid choice" in cli("runs", "--status", "done", cwd=cwd, code=2).stderr
    # A run that ends other than succeeded: the run on stdout, its ending on one line, exit 1.
    out = cli("run", "interaction", "approve-brief", "--input", "{}", cwd=cwd, code=1)
    assert json.loads(out.stdout)["status"] == "invalid_input" and "ended invalid_input" in one_line(out)
    cancelled = json.loads(cli("cancel", rid, cwd=cwd).stdout)
    assert cancelled["status"] == "rejected" and cancelled["kind"] == "cancelled"


def test_wait_shows_that_it_waits_and_exits_by_the_ending(served):
    proc, url, cwd = served
    cli("define", str(ROOT / "examples" / "approve-brief.md"), cwd=cwd)
    rid = json.loads(cli("run", "interaction", "approve-brief", "--input", BRIEF, cwd=cwd).stdout)["run_id"]
    still = cli("wait", rid, "--timeout", "0.2", cwd=cwd, code=4)
    assert json.loads(still.stdout)["status"] == "waiting"
    assert still.stderr.splitlines() == [f"waiting for run {rid} to end",
                                         f"interactiond: run {rid} is still waiting after 0.2 s"]
    code, shown = on_a_terminal("wait", rid, "--timeout", "1.5", cwd=cwd)
    assert code == 4 and f"waiting for run {rid} to end: 1 s" in shown
    waiter = subprocess.Popen([*EXE, "wait", rid], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=ENV)
    assert waiter.stderr.readline() == f"waiting for run {rid} to end\n"
    cli("answer", rid, '{"decision": "publish"}', cwd=cwd)
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0 and json.loads(out)["output"] == {"decision": "publish"}
    assert re.fullmatch(r"answered by first start on \d{4}-\d\d-\d\d \d\d:\d\d UTC\n", err), err   # who, in words
    rid2 = json.loads(cli("run", "interaction", "approve-brief", "--input", BRIEF, cwd=cwd).stdout)["run_id"]
    cli("cancel", rid2, cwd=cwd)
    ended = cli("wait", rid2, cwd=cwd, code=1)
    assert ended.stderr.splitlines()[-1] == f"interactiond: run {rid2} ended rejected/cancelled: the run was cancelled"
    assert one_line(cli("wait", "run_nope", cwd=cwd, code=1)).startswith("interactiond: Not found: ")


def test_no_traceback_for_files_and_ports(served, tmp_path):
    proc, url, cwd = served
    port = url.rsplit(":", 1)[1]
    other = tmp_path / "other"
    other.mkdir()
    line = one_line(cli("serve", "--port", port, cwd=other, code=1))
    assert line.startswith(f"interactiond: cannot listen on 127.0.0.1:{port}") and "--port" in line
    line = one_line(cli("token", "list", "--db", str(tmp_path / "no" / "such" / "dir.db"), cwd=tmp_path, code=1))
    assert line.startswith("interactiond: ")
    line = one_line(cli("define", str(tmp_path / "missing.md"), cwd=cwd, code=2))
    assert "missing.md: cannot read it" in line


def test_json_logs_carry_the_request_id(tmp_path):
    proc, url = start_serve(tmp_path, "--log-format", "json", "--access-log")
    try:
        token = (tmp_path / "interactiond.db.token").read_text().strip()
        req = urllib.request.Request(url + "/v1/orgs/local/playbooks/default/runs",
                                     headers={"Authorization": f"Bearer {token}", "X-Request-Id": "trace-42"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.headers["X-Request-Id"] == "trace-42"
        with urllib.request.urlopen(url + "/healthz", timeout=30) as resp:
            generated = resp.headers["X-Request-Id"]
        assert re.fullmatch(r"[0-9a-f]{16}", generated)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    lines = [json.loads(line) for line in err.splitlines()]           # every line is JSON
    by_id = {line.get("request_id"): line for line in lines}
    assert by_id["trace-42"]["message"].startswith("GET /v1/orgs/local/playbooks/default/runs 200")
    assert by_id[generated]["logger"] == "interactiond.access"
    assert {"time", "level", "logger", "message"} <= set(lines[-1])


def test_demo_starts_a_daemon_with_requests_open_and_says_what_to_try(tmp_path):
    proc = subprocess.Popen([*EXE, "demo", "--port", "0"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        shown = []
        for line in proc.stdout:
            shown.append(line)
            if line.startswith("Stop the demo"):
                break
        text = "".join(shown)
        assert re.search(r"^inbox: http://127\.0\.0\.1:\d+/login\?token=itd_", text, re.M), text
        where = Path(re.search(r"a fresh database in (\S+)", text).group(1))
        db = str(where / "interactiond.db")
        assert "Three things to try:" in text and all(f"  {n}. " in text for n in (1, 2, 3))
        inbox = json.loads(cli("inbox", "--db", db, cwd=tmp_path).stdout)["data"]
        by_name = {r["name"]: r for r in inbox}
        assert by_name["approve-brief"]["delivery_state"] == "in_inbox"
        assert by_name["chat-approval"]["delivery_state"] == "delivered"
        ts = by_name["chat-approval"]["conversation"].rsplit("/", 1)[1]
        assert f"--thread {ts} go looks safe" in text
        names = {d["name"] for d in json.loads(cli("definitions", "--db", db, cwd=tmp_path).stdout)["data"]}
        assert {"approve-brief", "chat-approval", "notify-owner", "thread-replies", "brief-approval"} <= names
        posted = subprocess.run([sys.executable, str(ROOT / "examples" / "chat_server.py"), "show", "--db",
                                 str(where / "chat.db"), "--channel", "ops", "--json"], capture_output=True, text=True,
                                timeout=60)
        assert "Raise the cache size to 2 GB" in posted.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0 and not where.exists()          # the temporary directory went with it
