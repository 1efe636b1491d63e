"""Start-up: a command loads only the libraries it uses (SPEC section 13). A client command talks to a
daemon over HTTP with the standard library; the daemon's libraries (aiohttp, the MCP SDK,
python-liquid, jsonschema, psycopg) load only in the commands that serve, render or check."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXE = [sys.executable, "-m", "interactiond"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

#: The command line as `interactiond` runs it, writing the names of the modules it loaded to the
#: file named in INTERACTIOND_TEST_MODULES when it exits.
LOADED = ("import atexit, json, os, sys\n"
          "atexit.register(lambda: open(os.environ['INTERACTIOND_TEST_MODULES'], 'w').write(json.dumps(sorted(sys.modules))))\n"
          "import interactiond\n"
          "sys.exit(interactiond.main(sys.argv[1:]))\n")

DAEMON_LIBRARIES = ("aiohttp", "mcp", "liquid", "jsonschema", "psycopg")


def loaded(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `interactiond ARGS` in `tmp_path`; what it printed, and the top-level packages it loaded."""
    out = tmp_path / "modules.json"
    proc = subprocess.run([sys.executable, "-c", LOADED, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**ENV, "INTERACTIOND_TEST_MODULES": str(out)})
    return proc, {name.split(".")[0] for name in json.loads(out.read_text())}


def cli(*args: str, cwd: Path) -> str:
    proc = subprocess.run([*EXE, *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return proc.stdout


@pytest.fixture
def served(tmp_path):
    """`interactiond serve` on a fresh directory, on the manual clock."""
    proc = subprocess.Popen([*EXE, "serve", "--port", "0", "--clock", "manual", "--host", "127.0.0.1"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("inbox:"):
            break
    assert re.search(r"at (http://\S+)", lines[0]), lines
    yield tmp_path
    proc.kill()
    proc.wait()


def test_version_loads_none_of_the_daemon_libraries(tmp_path):
    proc, modules = loaded(tmp_path, "--version")
    assert proc.returncode == 0 and proc.stdout.strip() == __import__("interactiond").__version__
    assert modules.isdisjoint(DAEMON_LIBRARIES), sorted(modules & set(DAEMON_LIBRARIES))
    assert "yaml" not in modules and "re2" not in modules


def test_client_commands_load_none_of_the_daemon_libraries(served):
    cwd = served
    cli("define", str(ROOT / "examples" / "approve-brief.md"), cwd=cwd)
    run = json.loads(cli("run", "interaction", "approve-brief", "--input",
                         json.dumps({"editor": "ana", "title": "T", "draft": "D"}), cwd=cwd))
    for args, says in ((["inbox", "--to", "ana"], run["run_id"]), (["runs"], run["run_id"]),
                       (["get", run["run_id"]], run["run_id"]),
                       (["answer", run["run_id"], '{"decision": "publish"}'], '"publish"')):
        proc, modules = loaded(cwd, *args)
        assert proc.returncode == 0 and says in proc.stdout, (args, proc.stderr + proc.stdout)
        assert modules.isdisjoint(DAEMON_LIBRARIES), (args, sorted(modules & set(DAEMON_LIBRARIES)))


def test_check_loads_what_documents_need_and_no_server(tmp_path):
    docs = sorted(str(p) for p in (ROOT / "examples").glob("*.md"))
    proc, modules = loaded(tmp_path, "check", *docs)
    assert proc.returncode == 0 and proc.stdout.count(": ok") == len(docs), proc.stdout + proc.stderr
    assert {"liquid", "jsonschema", "yaml"} <= modules
    assert modules.isdisjoint({"aiohttp", "mcp", "psycopg"}), sorted(modules & {"aiohttp", "mcp", "psycopg"})


def test_the_hook_loads_none_of_the_daemon_libraries(served):
    """A coding agent runs the hook before every tool call: it starts as a client command does."""
    cwd = served
    out = cwd / "modules.json"
    event = json.dumps({"session_id": "s", "cwd": str(cwd), "hook_event_name": "PreToolUse", "tool_name": "Bash",
                        "tool_input": {"command": "rm -rf build"}})
    proc = subprocess.run([sys.executable, "-c", LOADED, "hook", "claude-code", "--to", "ana", "--timeout", "0.2"],
                          cwd=cwd, input=event, capture_output=True, text=True, timeout=120,
                          env={**ENV, "INTERACTIOND_TEST_MODULES": str(out)})
    assert proc.returncode == 0 and '"permissionDecision": "ask"' in proc.stdout, proc.stderr + proc.stdout
    assert "cancelled" in proc.stdout          # it reached the daemon, opened the request and withdrew it
    modules = {name.split(".")[0] for name in json.loads(out.read_text())}
    assert modules.isdisjoint(DAEMON_LIBRARIES), sorted(modules & set(DAEMON_LIBRARIES))
    assert "yaml" not in modules and "re2" not in modules
