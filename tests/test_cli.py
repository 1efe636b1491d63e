"""The command line, run as a user runs it: serve, check, token, define/run/inbox/answer, and stdio
as a thin front over a running engine."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters

ROOT = Path(__file__).resolve().parent.parent
EXE = [sys.executable, "-m", "interactiond"]


def cli(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*EXE, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if check:
        assert proc.returncode == 0, proc.stderr + proc.stdout
    return proc


@pytest.fixture
def served(tmp_path):
    """`interactiond serve` on a fresh directory, as the README's first command starts it."""
    proc = subprocess.Popen([*EXE, "serve", "--port", "0", "--clock", "manual", "--host", "127.0.0.1"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("inbox:"):
            break
    url = re.search(r"at (http://\S+)", lines[0]).group(1)
    yield proc, url, tmp_path, lines
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_serve_on_a_fresh_directory_and_the_client_commands(served):
    proc, url, cwd, lines = served
    assert (cwd / "interactiond.db").exists()
    token_file = cwd / "interactiond.db.token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert re.match(rf"inbox: {re.escape(url)}/login\?token=itd_", lines[1])
    out = json.loads(cli("define", str(ROOT / "examples" / "approve-brief.md"), cwd=cwd).stdout)
    assert out["name"] == "approve-brief" and out["version"] == 1
    run = json.loads(cli("run", "interaction", "approve-brief", "--input",
                         json.dumps({"editor": "ana", "title": "T", "draft": "D"}), cwd=cwd).stdout)
    assert run["status"] == "started"
    inbox = json.loads(cli("inbox", "--to", "ana", cwd=cwd).stdout)
    assert [r["run_id"] for r in inbox["data"]] == [run["run_id"]]
    bad = cli("answer", run["run_id"], '{"decision": "maybe"}', cwd=cwd, check=False)
    assert bad.returncode == 1 and "/answer/decision" in bad.stderr and len(bad.stderr.splitlines()) == 1
    fact = json.loads(cli("answer", run["run_id"], '{"decision": "publish"}', cwd=cwd).stdout)
    assert fact["answer"] == {"decision": "publish"}
    # A second engine on the same file refuses to start and names the first.
    second = cli("serve", "--port", "0", cwd=cwd, check=False)
    assert second.returncode == 1 and str(proc.pid) in second.stderr
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not (cwd / "interactiond.db.url").exists()


async def test_stdio_is_a_thin_front_when_serve_runs(served):
    proc, url, cwd, _ = served
    params = StdioServerParameters(command=sys.executable, args=["-m", "interactiond", "stdio"], cwd=str(cwd),
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    async with Client(params, read_timeout_seconds=60) as c:
        r = await c.call_tool("ask", {"type": "text", "prompt": "Name it", "to": "bo"})
        assert not r.is_error, r.structured_content
        run_id = r.structured_content["run_id"]
    # The request lives in the running engine: the HTTP side sees it and answers it.
    inbox = json.loads(cli("inbox", "--to", "bo", cwd=cwd).stdout)
    assert [x["run_id"] for x in inbox["data"]] == [run_id]
    json.loads(cli("answer", run_id, '{"text": "Atlas"}', cwd=cwd).stdout)
    async with Client(params, read_timeout_seconds=60) as c:
        r = await c.call_tool("get_run", {"run_id": run_id})
        assert r.structured_content["output"] == {"text": "Atlas"}


def test_check(tmp_path):
    docs = sorted((ROOT / "examples").glob("*.md")) + sorted((ROOT / "examples").glob("*.yaml"))
    ok = cli("check", *[str(p) for p in docs if p.name != "interactiond.yaml"], cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.count(": ok") >= 6
    flow = tmp_path / "flow.yaml"
    flow.write_text("document: {dsl: '1.0.3', namespace: t, name: flow, version: '1.0.0'}\ndo:\n  - a: {bogus: 1}\n")
    out = cli("check", str(flow), cwd=tmp_path, check=False)
    assert out.returncode == 1 and f"{flow}:3:" in out.stdout
    broken = tmp_path / "broken.md"
    broken.write_text("---\nto: '{{ input.owner }}'\nexpires: P90D\nmodel: gpt\n---\nHi\n")
    out = cli("check", str(broken), cwd=tmp_path, check=False)
    assert out.returncode == 1
    assert f"{broken}:3: expires:" in out.stdout and f"{broken}:4: model:" in out.stdout


def test_tokens(tmp_path):
    db = str(tmp_path / "t.db")
    created = cli("token", "create", "--db", db, "--playbook", "acme/ops", "--role", "reader", "--name", "dash",
                  cwd=tmp_path).stdout.split()
    assert created[0].startswith("tok_") and created[1].startswith("itd_")
    listed = cli("token", "list", "--db", db, cwd=tmp_path).stdout
    assert created[0] in listed and "reader" in listed and "acme/ops" in listed and created[1] not in listed
    cli("token", "revoke", "--db", db, created[0], cwd=tmp_path)
    assert "revoked" in cli("token", "list", "--db", db, cwd=tmp_path).stdout
    assert cli("token", "revoke", "--db", db, created[0], cwd=tmp_path, check=False).returncode == 1
    bad = cli("token", "create", "--db", db, "--playbook", "Not A Playbook", "--role", "reader", cwd=tmp_path,
              check=False)
    assert bad.returncode == 2


def test_configuration_errors_stop_the_start(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("listen: {port: 99999}\nservers:\n  Chat: {command: [x]}\nplaybooks:\n  local/default: {servers: [nope]}\n")
    out = cli("serve", "--config", str(cfg), cwd=tmp_path, check=False)
    assert out.returncode == 2
    for path in ("listen.port", "servers.Chat", "playbooks.local/default.servers[0]"):
        assert path in out.stderr, out.stderr


async def test_stdio_with_http_serves_the_same_engine(tmp_path):
    import urllib.request
    params = StdioServerParameters(command=sys.executable, args=["-m", "interactiond", "stdio", "--http", "0"],
                                   cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": str(ROOT)})
    async with Client(params, read_timeout_seconds=60) as c:
        r = await c.call_tool("ask", {"type": "confirmation", "prompt": "Ship?", "to": "cy"})
        run_id = r.structured_content["run_id"]
        url = (tmp_path / "interactiond.db.url").read_text().strip()
        token = (tmp_path / "interactiond.db.token").read_text().strip()
        req = urllib.request.Request(f"{url}/v1/orgs/local/playbooks/default/interactions?to=cy",
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert [x["run_id"] for x in json.loads(resp.read())["data"]] == [run_id]
    assert not (tmp_path / "interactiond.db.url").exists()       # removed when the agent went away


def test_load_config_reads_the_example_and_names_every_problem(tmp_path):
    import interactiond as itd
    config = itd.load_config(str(ROOT / "examples" / "interactiond.yaml"), environ={})
    assert config.servers["chat"].command[:2] == ("python", "examples/chat_server.py")
    assert config.servers["chat"].tools == ("post_message", "thread_replies", "channel_history")
    assert config.playbooks == {"local/default": ("chat",)}
    assert itd.load_config(None, environ={"INTERACTION_OPEN_REQUESTS": "7"}).open_requests == 7
    bad = tmp_path / "bad.yaml"
    bad.write_text("servers:\n  web: {url: 'ftp://x', env: [1], record_content: 3, extra: 1}\n"
                   "  ok: {url: 'http://127.0.0.1:1/sse'}\n"
                   "playbooks:\n  acme/ops: {servers: [web, ghost], other: 1}\n  Bad: {}\nnope: 1\n")
    with pytest.raises(itd.ConfigError) as err:
        itd.load_config(str(bad), environ={})
    problems = err.value.problems
    for path in ("servers.web.url", "servers.web.env", "servers.web.record_content", "servers.web.extra",
                 "playbooks.acme/ops.servers[1]", "playbooks.acme/ops.other", "playbooks.Bad", "nope"):
        assert any(p.startswith(path + ":") for p in problems), (path, problems)
    assert not any(p.startswith("servers.ok") for p in problems)


def test_serve_and_token_commands_on_postgres_through_the_environment(tmp_path):
    from daemon_kit import fresh_postgres

    with fresh_postgres() as url:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "INTERACTIOND_DB": url}
        name = url.rsplit("/", 1)[1]
        proc = subprocess.Popen([*EXE, "serve", "--port", "0", "--clock", "manual", "--host", "127.0.0.1"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            first = proc.stdout.readline()
            assert f"serving {url} at http://" in first, first + proc.stderr.read() if proc.poll() else first
            token_file = tmp_path / f"interactiond-{name}.token"
            assert token_file.stat().st_mode & 0o777 == 0o600 and not list(tmp_path.glob("*.db*"))
            # The client commands find the daemon by the database's name, as beside an SQLite file.
            run = subprocess.run([*EXE, "run", "interaction", "ask-text", "--input",
                                  json.dumps({"prompt": "Name it", "to": "bo"})],
                                 cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
            assert run.returncode == 0, run.stderr
            inbox = subprocess.run([*EXE, "inbox", "--to", "bo", "--db", url], cwd=tmp_path, capture_output=True,
                                   text=True, timeout=60, env={**env, "INTERACTIOND_DB": ""})
            assert [r["run_id"] for r in json.loads(inbox.stdout)["data"]] == [json.loads(run.stdout)["run_id"]]
            created = subprocess.run([*EXE, "token", "create", "--role", "reader", "--playbook", "local/default"],
                                     cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
            assert created.returncode == 0 and created.stdout.startswith("tok_"), created.stderr
            listed = subprocess.run([*EXE, "token", "list"], cwd=tmp_path, capture_output=True, text=True,
                                    timeout=60, env=env).stdout
            assert created.stdout.split()[0] in listed
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0


def test_a_postgres_url_without_its_driver_or_its_server_is_one_line(tmp_path):
    unreachable = cli("token", "list", "--db", "postgresql://itd:s3cret@127.0.0.1:1/itd", cwd=tmp_path, check=False)
    assert unreachable.returncode == 1 and unreachable.stderr.count("\n") == 1, unreachable.stderr
    assert "cannot reach postgresql://itd:***@127.0.0.1:1/itd" in unreachable.stderr
    assert "s3cret" not in unreachable.stderr and "Traceback" not in unreachable.stderr
    # Without psycopg installed (the default install), the same command says how to get it.
    code = ("import sys; sys.modules['psycopg'] = None; import interactiond;"
            " sys.exit(interactiond.main(['token', 'list', '--db', 'postgresql:///itd']))")
    missing = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert missing.returncode == 1 and "pip install 'interactiond[postgres]'" in missing.stderr
    assert missing.stderr.count("\n") == 1 and "Traceback" not in missing.stderr, missing.stderr


def test_answer_get_and_wait_say_who_answered_in_words_and_when(served):
    import urllib.request

    proc, url, cwd, _ = served
    cli("define", str(ROOT / "examples" / "approve-brief.md"), cwd=cwd)
    brief = json.dumps({"editor": "ana", "title": "T", "draft": "D"})
    run_id = json.loads(cli("run", "interaction", "approve-brief", "--input", brief, cwd=cwd).stdout)["run_id"]
    answered = cli("answer", run_id, '{"decision": "publish"}', cwd=cwd)
    fact = json.loads(answered.stdout)
    assert fact["answered_by"].startswith("tok_") and fact["answered_by_name"] == "first start"
    when = f"{fact['answered_at'][:10]} {fact['answered_at'][11:16]} UTC"
    assert answered.stderr.strip() == f"answered by first start on {when}"
    for cmd in ("get", "wait"):
        shown = cli(cmd, run_id, cwd=cwd)
        assert json.loads(shown.stdout)["status"] == "succeeded"
        assert f"answered by first start on {when}" in shown.stderr and "tok_" not in shown.stderr, shown.stderr
    # A person's answer (her own token): the person's name, not the token's.
    run_id = json.loads(cli("run", "interaction", "approve-brief", "--input", brief, cwd=cwd).stdout)["run_id"]
    secret = cli("token", "create", "--for", "ana", "--role", "writer", "--playbook", "local/default",
                 "--name", "ana's laptop", cwd=cwd).stdout.split()[1]
    req = urllib.request.Request(f"{url}/v1/orgs/local/playbooks/default/runs/{run_id}/answer", method="POST",
                                 data=json.dumps({"answer": {"decision": "publish"}}).encode(),
                                 headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert json.loads(resp.read())["answered_by_name"] == "ana"
    shown = cli("get", run_id, cwd=cwd)
    assert f"answered by ana on {when}" in shown.stderr, shown.stderr
