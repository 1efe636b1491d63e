"""`interactiond copy`: a whole SQLite file that a daemon made, moved into an empty PostgreSQL database
(and back), then served there: the runs, requests, readings, events, timers and tokens carry on."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import interactiond as itd
import daemon_kit
from daemon_kit import APPROVAL, NOTIFY, START_MS, fresh_postgres, start_daemon

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import chat_server  # noqa: E402

PB = "local/default"
SEED_CHAT = (ROOT / "tests" / "fixtures" / "seed-chat-approval.md").read_text()
INPUT = {"owner": "ana", "review": "Clear goals; budget missing."}
WORKFLOW = """\
document: {dsl: '1.0.3', namespace: tests, name: review, version: '1.0.0'}
do:
  - ask:
      call: run_definition
      with: { type: interaction, name: approve, input: '${ $input }' }
"""


def copy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "interactiond", "copy", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def counts(db: str) -> dict[str, int]:
    tx = itd.open_sync(db)
    try:
        return {t: tx.count_rows(t) for t in itd.COPIED_TABLES}
    finally:
        tx.close()


@pytest.fixture
def pg():
    with fresh_postgres() as url:
        yield url


@pytest.fixture
def chat_config(tmp_path):
    chat_db = str(tmp_path / "chat.db")
    return daemon_kit.chat_config(chat_db, playbook=PB), chat_db


async def made_by_a_daemon(aiohttp_client, db: str, config, chat_db: str) -> dict:
    """Runs in several states, open timers, a reading with a reply seen, tokens, a session, an
    idempotency key, webhook deliveries still to be made - as a daemon on the file leaves them when it stops."""
    hook = itd.WebhookConfig("http://127.0.0.1:9/hook", frozenset({"run_ended"}), "HOOK_SECRET", "a-hook-secret")
    d = await start_daemon(aiohttp_client, db, config=dataclasses.replace(config, webhooks={PB: (hook,)}))
    await d.define("approve", APPROVAL)
    await d.define("notify", NOTIFY)
    await d.define("chat-approval", SEED_CHAT)
    status, _ = await d.call("POST", "/definitions", {"type": "workflow", "name": "review", "source": WORKFLOW})
    assert status == 201
    ids = {}
    _, run = await d.run("approve", INPUT, run_id="expires-first")
    ids["expired"] = run["run_id"]
    await d.define("approve", APPROVAL.replace("P2D", "P3D"))                  # a second version
    _, run = await d.run("approve", INPUT)
    ids["answered"] = run["run_id"]
    assert (await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "approve"}}))[0] == 200
    _, run = await d.run("approve", INPUT)
    ids["cancelled"] = run["run_id"]
    assert (await d.call("POST", f"/runs/{run['run_id']}/cancel"))[0] == 200
    await d.advance("P2D")
    _, run = await d.run("approve", INPUT)                                      # open: expires at +2 d +3 d
    ids["open"] = run["run_id"]
    _, run = await d.run("notify", {"owner": "bo"})
    ids["notified"] = run["run_id"]
    status, run = await d.call("POST", "/runs", {"type": "workflow", "name": "review", "input": INPUT})
    ids["workflow"] = run["run_id"]
    _, run = await d.run("chat-approval", {"owner": "cy", "draft": "Spring copy"})
    ids["chat"] = run["run_id"]
    await d.advance("PT0S")                                                     # delivered; the workflow asks
    ts = chat_server.messages(chat_db, "cy")[0]["ts"]
    chat_server.say(chat_db, "cy", "cy", "maybe later", thread_ts=ts)            # refused: a reply seen
    await d.advance("PT1M")
    status, run = await d.call("POST", "/runs", {"type": "interaction", "name": "ask-approval",
                                                 "input": {"prompt": "Ship?", "to": "ana"}})
    _, page = await d.call("GET", f"/v2/interactions?run_id={run['run_id']}")
    resp = await d.client.post(f"/v2/interactions/{page['data'][0]['id']}/responses",
                               json={"type": "approval", "approved": True},
                               headers={**d.auth("writer"), "Idempotency-Key": "k-1"})
    assert resp.status == 200
    ids["typed"] = run["run_id"]
    status, run = await d.call("POST", "/runs", {"type": "interaction", "name": "approve-tool-call", "input": {
        "tool": "Bash", "arguments": {"command": "make build"}, "cwd": "/repo", "to": "ana"}}, role="writer")
    assert (await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {
        "approved": True, "remember": {"for": "P7D", "scope": "prefix"}}}))[0] == 200      # a remembered decision
    ids["tool_call"] = run["run_id"]
    assert (await d.call("POST", "/deputies", {"for": "ana", "to": "ben"}))[0] == 201          # a deputy
    status, run = await d.call("POST", "/tools/chat/post_message", {"arguments": {"channel": "ops", "text": "hi"},
                                                                   "approve": {"to": ["ana", "ben"], "need": 2}})
    assert status == 202, run                                                   # a quorum: its addressees
    ids["quorum"] = run["run_id"]
    tx = itd.open_sync(db)
    itd.create_token(tx, "operator", None, "link", purpose="login")
    tx.queue_nudge(PB, ids["chat"], what="reminder", n=1, message="Still waiting for your answer")   # a reminder to send
    tx.close()
    now = d.clock.now_ms()
    await d.client.close()                                                      # the daemon stops
    return {"ids": ids, "tokens": d.tokens, "now": now}


async def test_a_file_copied_into_postgresql_is_served_there_where_it_stood(tmp_path, pg, chat_config,
                                                                             aiohttp_client):
    config, chat_db = chat_config
    src = str(tmp_path / "interactiond.db")
    made = await made_by_a_daemon(aiohttp_client, src, config, chat_db)
    ids, before = made["ids"], counts(src)
    assert all(before[t] for t in itd.COPIED_TABLES), before                   # every table holds rows

    done = copy("--from", src, "--to", pg)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)                                          # piped: a JSON summary
    assert summary["tables"] == before and summary["rows"] == sum(before.values()) and done.stderr == ""
    assert counts(pg) == before
    tx, back = itd.open_sync(src), itd.open_sync(pg)
    tx.begin_snapshot()
    back.begin_snapshot()
    try:
        for table in ("runs", "requests", "events", "timers", "definitions", "tokens", "readings"):
            cols = [c for c in tx.table_columns(table)]
            assert sorted(r for rows in tx.table_rows(table, cols, 100) for r in rows) == \
                sorted(r for rows in back.table_rows(table, cols, 100) for r in rows), table
    finally:
        tx.close()
        back.close()

    # A daemon on the copy: the same tokens, runs, timers and reading.
    d = await start_daemon(aiohttp_client, pg, config=config, tokens=made["tokens"],
                           clock=itd.ManualClock(made["now"]))
    status, run = await d.call("GET", f"/runs/{ids['answered']}")
    assert status == 200 and run["status"] == "succeeded" and run["output"] == {"verdict": "approve"}
    assert (await d.call("GET", f"/runs/{ids['expired']}"))[1]["kind"] == "expired"
    assert (await d.call("GET", f"/runs/{ids['cancelled']}"))[1]["kind"] == "cancelled"
    # The typed API's idempotency key came along: a replay returns the first response.
    _, page = await d.call("GET", f"/v2/interactions?run_id={ids['typed']}")
    resp = await d.client.post(f"/v2/interactions/{page['data'][0]['id']}/responses",
                               json={"type": "approval", "approved": True},
                               headers={**d.auth("writer"), "Idempotency-Key": "k-1"})
    assert resp.status == 200 and resp.headers.get("Idempotent-Replayed") == "true"
    status, fact = await d.call("POST", f"/runs/{ids['open']}/answer", {"answer": {"verdict": "revise"}})
    assert status == 200, fact
    run = (await d.call("GET", f"/runs/{ids['open']}"))[1]
    assert run["status"] == "succeeded" and run["version"] == 2
    events = (await d.call("GET", f"/runs/{ids['open']}/events"))[1]["data"]
    assert [e["type"] for e in events][-2:] == ["request_answered", "run_succeeded"]
    assert int(events[-1]["id"].removeprefix("evt_")) > max(
        int(e["id"].removeprefix("evt_")) for e in (await d.call("GET", f"/runs/{ids['answered']}/events"))[1]["data"])
    # The copied reading goes on reading the thread, past the reply it saw; the workflow's child expires
    # on its copied timer, and the workflow takes its path on.
    ts = chat_server.messages(chat_db, "cy")[0]["ts"]
    chat_server.say(chat_db, "cy", "cy", "approve", thread_ts=ts)
    await d.advance("PT2M")
    run = (await d.call("GET", f"/runs/{ids['chat']}"))[1]
    assert run["status"] == "succeeded" and run["output"]["verdict"] == "approve"
    refused = [e for e in (await d.call("GET", f"/runs/{ids['chat']}/events"))[1]["data"] if e["type"] == "reply_refused"]
    assert len(refused) == 1                                                   # "maybe later" is not read again
    await d.advance("P3D")
    wf = (await d.call("GET", f"/runs/{ids['workflow']}"))[1]
    assert wf["status"] == "rejected" and wf["kind"] == "expired", wf


def test_a_target_that_is_not_empty_is_refused_and_left_as_it_was(tmp_path, pg):
    src = str(tmp_path / "a.db")
    tx = itd.open_sync(src)
    tx.ensure_playbook(PB, now=START_MS)
    itd.create_token(tx, "operator", None, "ops")
    tx.close()
    tx = itd.open_sync(pg)
    tx.ensure_playbook("acme/other", now=START_MS)
    tx.close()
    before = counts(pg)
    done = copy("--from", src, "--to", pg)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [f"interactiond: {pg} is not empty (playbooks: 1); copy only into a new database"]
    assert counts(pg) == before


def test_a_copy_that_fails_half_way_writes_nothing(tmp_path, pg):
    src = str(tmp_path / "a.db")
    tx = itd.open_sync(src)
    tx.ensure_playbook(PB, now=START_MS)
    itd.create_token(tx, "operator", None, "ops")
    tx.close()
    tx = itd.open_sync(pg)                                   # the target refuses any token row
    tx.conn.execute("ALTER TABLE tokens ADD CONSTRAINT no_tokens CHECK (false)")
    tx.close()
    done = copy("--from", src, "--to", pg)
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("interactiond: the copy failed (") and f"nothing was written to {pg}" in done.stderr
    assert counts(pg)["playbooks"] == 0                       # the tables before it were rolled back too


def test_a_bad_database_is_one_line(tmp_path, pg):
    src = str(tmp_path / "a.db")
    itd.open_sync(src).close()
    done = copy("--from", src, "--to", "postgresql://itd:secret@127.0.0.1:1/nowhere")
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("interactiond: cannot reach postgresql://itd:***@127.0.0.1:1/nowhere")
    done = copy("--from", str(tmp_path / "missing.db"), "--to", pg)
    assert (done.returncode, done.stderr) == (1, f"interactiond: {tmp_path / 'missing.db'}: no such file\n")
    assert not (tmp_path / "missing.db").exists()
    (tmp_path / "notes.txt").write_text("not a database\n" * 100)
    done = copy("--from", str(tmp_path / "notes.txt"), "--to", pg)
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    done = copy("--from", src, "--to", src)
    assert (done.returncode, done.stderr) == (2, "interactiond: --from and --to name the same database\n")


def test_postgresql_copies_back_into_a_file_and_a_terminal_sees_a_line_per_table(tmp_path, pg):
    import pty

    tx = itd.open_sync(pg)
    tx.ensure_playbook(PB, now=START_MS)
    for i in range(2500):                                     # three batches of events
        tx.append_event(None, PB, None, "note", START_MS + i, "tok_x", {"i": i})
    tx.close()
    back = str(tmp_path / "back.db")
    primary, secondary = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "interactiond", "copy", "--from", pg, "--to", back],
                            stdout=secondary, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    os.close(secondary)
    out = b""
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    assert proc.wait(60) == 0, proc.stderr.read()
    os.close(primary)
    lines = [line.split("\r")[-1].strip() for line in out.decode().splitlines()]
    assert lines[0] == f"copying {pg} into {back}"
    assert "events              2,500 rows" in lines and "playbooks               1 rows" in lines
    assert "1,000 of 2,500 rows" in out.decode()                 # progress within a table, batch by batch
    assert lines[-1].startswith("copied 2,501 rows in ")
    assert counts(back)["events"] == 2500
    tx = itd.open_sync(back)
    try:
        assert tx.last_event_id() == 2500
        tx.append_event(None, PB, None, "note", START_MS, "tok_x", {})
        assert tx.last_event_id() == 2501
    finally:
        tx.close()
