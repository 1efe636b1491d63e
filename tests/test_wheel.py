"""The wheel, as a release makes it and a user installs it: `python -m build` makes a wheel and an
sdist from a copy of the tree; the wheel goes into a fresh virtual environment outside the repository
with its dependencies (pip's own index and cache; no PYTHONPATH, no checkout beside it), and there
`interactiond serve` answers HTTP, `stdio` answers an MCP initialize, and `demo` opens its requests
with the examples the wheel carries. It takes a minute or two, and runs in the normal suite."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.wheel

#: What a source tree holds that is no part of a release.
NOT_RELEASED = shutil.ignore_patterns(".git", ".ci", ".venv", "__pycache__", "*.pyc", "*.egg-info", "build", "dist",
                                      ".pytest_cache", ".hypothesis", "*.db", "*.db-*", "*.db.*", "interactiond-*")


def _env() -> dict[str, str]:
    """The user's environment: nothing that would import the checkout instead of the installed module."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
            and not k.startswith("INTERACTIOND_")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv, outside the repository, with the wheel `python -m build` made installed in it."""
    if importlib.util.find_spec("build") is None:
        pytest.skip("the `build` package is not installed here (pip install -e '.[test]' installs it)")
    where = tmp_path_factory.mktemp("wheel")
    tree, dist, venv = where / "src", where / "dist", where / "venv"
    shutil.copytree(ROOT, tree, ignore=NOT_RELEASED)
    frontend = str(Path(importlib.util.find_spec("build").origin).parent.parent)     # where `build` is, alone
    made = subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(tree)], capture_output=True,
                          text=True, timeout=900, env={**_env(), "PYTHONPATH": frontend}, cwd=where)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    [wheel] = dist.glob("interactiond-*-py3-none-any.whl")
    [sdist] = dist.glob("interactiond-*.tar.gz")
    assert sdist.stat().st_size > 0
    names = zipfile.ZipFile(wheel).namelist()
    assert "interactiond.py" in names and any(n.endswith("entry_points.txt") for n in names)
    assert any(n.endswith("share/interactiond/examples/chat_server.py") for n in names), names
    assert any(n.endswith("share/interactiond/schema.sql") for n in names), names
    assert any(n.endswith("share/interactiond/schema-postgres.sql") for n in names), names
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)],
                         capture_output=True, text=True, timeout=1200, env=_env(), cwd=where)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    return venv


def exe(venv: Path) -> str:
    return str(venv / "bin" / "interactiond")


def test_the_installed_module_is_the_wheels(installed, tmp_path):
    out = subprocess.run([str(installed / "bin" / "python"), "-c", "import interactiond, sys; print(interactiond.__file__);"
                          " print(interactiond.data_file('examples')); print(interactiond.data_file('schema-postgres.sql'))"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path, env=_env(), check=True).stdout.splitlines()
    assert out[0].startswith(str(installed)) and not out[0].startswith(str(ROOT)), out
    assert out[1] == str(installed / "share" / "interactiond" / "examples"), out
    assert out[2] == str(installed / "share" / "interactiond" / "schema-postgres.sql"), out
    assert Path(out[2]).read_text() == (ROOT / "schema-postgres.sql").read_text()
    version = subprocess.run([exe(installed), "--version"], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                             env=_env())
    assert version.returncode == 0 and re.fullmatch(r"\d+\.\d+\.\d+\n", version.stdout), version


def test_serve_answers_http(installed, tmp_path):
    proc = subprocess.Popen([exe(installed), "serve", "--port", "0"], cwd=tmp_path, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = proc.stdout.readline()
        found = re.search(r"at (http://\S+)", first)
        assert found, first + (proc.stderr.read() if proc.poll() is not None else "")
        url = found.group(1)
        with urllib.request.urlopen(url + "/healthz", timeout=30) as resp:
            assert resp.status == 200
        with urllib.request.urlopen(url + "/", timeout=30) as resp:
            assert resp.status == 200 and "<title>Inbox · interactiond</title>" in resp.read().decode()
        token = (tmp_path / "interactiond.db.token").read_text().strip()
        ask = urllib.request.Request(url + "/v1/orgs/local/playbooks/default/runs", method="POST", data=json.dumps(
            {"type": "interaction", "name": "ask-text", "input": {"prompt": "Ship it?", "to": "ana"}}).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(ask, timeout=30) as resp:
            assert resp.status == 202 and json.loads(resp.read())["status"] in ("started", "waiting")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_stdio_answers_an_mcp_initialize(installed, tmp_path):
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "smoke", "version": "1"}}}
    listed = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
    proc = subprocess.Popen([exe(installed), "stdio"], cwd=tmp_path, env=_env(), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    replies: dict[int, dict] = {}
    try:
        # One message at a time, each answer read before the next is sent: stdin stays open until the
        # last answer is in (an end of input may stop the server before it answers what came before).
        for message, wanted in ((init, 1), ({"jsonrpc": "2.0", "method": "notifications/initialized"}, None),
                                (listed, 2)):
            proc.stdin.write(json.dumps(message) + "\n")
            proc.stdin.flush()
            while wanted is not None and wanted not in replies:
                line = proc.stdout.readline()
                assert line, proc.stderr.read()
                reply = json.loads(line)
                if "id" in reply:
                    replies[reply["id"]] = reply
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert replies[1]["result"]["serverInfo"]["name"] == "interactiond"
    assert {"run_definition", "wait_run"} <= {t["name"] for t in replies[2]["result"]["tools"]}, replies[2]


def test_demo_opens_its_requests_with_the_examples_the_wheel_carries(installed, tmp_path):
    proc = subprocess.Popen([exe(installed), "demo", "--port", "0"], cwd=tmp_path, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    shown: list[str] = []
    try:
        for line in proc.stdout:
            shown.append(line)
            if line.startswith("Stop the demo"):
                break
        text = "".join(shown)
        assert "approve-brief asks ana to sign off a draft, in the inbox" in text, text + proc.stderr.read()
        assert "posted in the chat's #ops channel, thread" in text, text
        assert "was not defined" not in text, text
        assert str(installed / "share" / "interactiond" / "examples" / "chat_server.py") in text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0
