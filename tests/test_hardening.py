"""Hardening: operator tokens are global, the command line reads the configured database, the
database files are private, and replies in a conversation shared by different functions are read
by each request's own reply rule, also after a restart."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import interactiond as itd
from daemon_kit import start_chat_daemon, start_daemon

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import chat_server  # noqa: E402

EXE = [sys.executable, "-m", "interactiond"]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*EXE, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


# -- tokens -----------------------------------------------------------------------------------

def test_an_operator_token_bound_to_a_playbook_is_refused(tmp_path):
    proc = cli("token", "create", "--role", "operator", "--playbook", "local/default", "--db", "t.db", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "operator" in proc.stderr and "global" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    listed = cli("token", "list", "--db", "t.db", cwd=tmp_path)
    assert "operator" not in listed.stdout                # nothing was written
    conn = itd.open_sync(str(tmp_path / "x.db"))
    try:
        try:
            itd.create_token(conn, "operator", "local/default", "x")
        except ValueError as exc:
            assert "global" in str(exc)
        else:
            raise AssertionError("an operator token bound to a playbook was made")
        assert conn.conn.execute("SELECT COUNT(*) FROM tokens").fetchone()[0] == 0
    finally:
        conn.close()


def test_token_commands_use_the_configured_database(tmp_path):
    (tmp_path / "cfg.yaml").write_text("database: data/daemon.db\n")
    (tmp_path / "data").mkdir()
    made = cli("token", "create", "--role", "writer", "--playbook", "local/default", "--name", "ci",
               "--config", "cfg.yaml", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert not (tmp_path / "interactiond.db").exists()
    assert (tmp_path / "data" / "daemon.db").exists()
    token_id = made.stdout.split()[0]
    listed = cli("token", "list", "--config", "cfg.yaml", cwd=tmp_path)
    assert token_id in listed.stdout
    # INTERACTIOND_CONFIG is read as --config is.
    env_listed = subprocess.run([*EXE, "token", "list"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "INTERACTIOND_CONFIG": "cfg.yaml"})
    assert token_id in env_listed.stdout
    # --db still wins over the configuration.
    other = cli("token", "list", "--config", "cfg.yaml", "--db", "other.db", cwd=tmp_path)
    assert token_id not in other.stdout


def test_a_broken_configuration_is_one_line_for_token_commands(tmp_path):
    (tmp_path / "cfg.yaml").write_text("database: [1, 2\n")
    proc = cli("token", "list", "--config", "cfg.yaml", cwd=tmp_path)
    assert proc.returncode == 2 and "configuration" in proc.stderr and "Traceback" not in proc.stderr


# -- file modes -------------------------------------------------------------------------------

async def test_the_database_files_are_private(tmp_path, aiohttp_client):
    old = os.umask(0o022)
    try:
        d = await start_daemon(aiohttp_client, str(tmp_path / "t.db"))
        await d.define("approve", (ROOT / "tests" / "daemon_kit.py").read_text().split('APPROVAL = """')[1]
                       .split('"""')[0])
        status, _ = await d.run("approve", {"owner": "ana", "review": "ok"})
        assert status == 202
        for suffix in ("", "-wal", "-shm"):
            path = tmp_path / f"t.db{suffix}"
            assert path.exists(), suffix
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, (suffix, oct(path.stat().st_mode))
    finally:
        os.umask(old)


def test_files_the_command_line_makes_are_private(tmp_path):
    proc = cli("token", "create", "--role", "reader", "--playbook", "local/default", "--db", "t.db", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    made = [p for p in tmp_path.iterdir() if p.name.startswith("t.db")]
    assert made
    for path in made:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, (path.name, oct(path.stat().st_mode))


# -- a conversation shared by two functions, across a restart -----------------------------------

SHARED = """---
to: '{{ input.owner }}'
expires: P1D
deliver:
  server: chat
  tool: post_message
  with: { channel: team, text: '{{ message }}' }
  sent: { conversation: /channel, id: /ts }
replies:
  conversation: '{{ sent.conversation }}'
  tool: channel_history
  with: { channel: '{{ sent.conversation }}', oldest: '0' }
  read:
    list: /messages
    order: oldest_first
    each: { id: /ts, sender: /user, text: /text, to: /thread_ts }
  wait: PT5S
reply:
  %s
input:
  schema:
    type: object
    required: [owner, ask]
    properties:
      owner: { type: string }
      ask: { type: string }
output:
  schema:
    type: object
    required: [%s]
    properties:
      %s
---
{{ input.ask }}
"""

VERDICT = SHARED % ("verdict: { from: word, words: { approve: [yes, ok] } }", "verdict",
                    "verdict: { type: string, enum: [approve, revise] }")
COLOUR = SHARED % ("colour: { from: word }", "colour", "colour: { type: string, enum: [red, blue] }")


async def test_replies_in_a_shared_conversation_use_each_function_after_a_restart(tmp_path, aiohttp_client):
    chat_db = str(tmp_path / "chat.db")
    d = await start_chat_daemon(aiohttp_client, str(tmp_path / "t.db"), chat_db)
    await d.define("verdict", VERDICT)
    await d.define("colour", COLOUR)
    first = (await d.run("verdict", {"owner": "ana", "ask": "Ship?"}))[1]["run_id"]
    second = (await d.run("colour", {"owner": "ana", "ask": "Which colour?"}))[1]["run_id"]
    await d.advance("PT0S")
    msgs = chat_server.messages(chat_db, "team")
    ts = {m["text"].strip(): m["ts"] for m in msgs}
    now = d.clock.now_ms()
    await d.client.close()

    # A new daemon knows no document until it needs one; the oldest request is `verdict`'s.
    d2 = await start_daemon(aiohttp_client, d.db, clock=itd.ManualClock(now), config=d.config, tokens=d.tokens)
    chat_server.say(chat_db, "team", "ana", "blue", thread_ts=ts["Which colour?"])
    await d2.advance("PT5S")
    run2 = (await d2.call("GET", f"/runs/{second}"))[1]
    assert run2["status"] == "succeeded", (await d2.call("GET", f"/runs/{second}/events"))[1]
    assert run2["output"] == {"colour": "blue"}
    assert (await d2.call("GET", f"/runs/{first}"))[1]["status"] == "waiting"
    chat_server.say(chat_db, "team", "ana", "yes", thread_ts=ts["Ship?"])
    await d2.advance("PT10S")
    run1 = (await d2.call("GET", f"/runs/{first}"))[1]
    assert run1["status"] == "succeeded" and run1["output"] == {"verdict": "approve"}
