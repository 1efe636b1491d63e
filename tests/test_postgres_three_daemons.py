"""Three `interactiond serve` processes on one PostgreSQL database, on the shared manual clock, asking
through the example chat server (each daemon runs its own copy of it on one chat file): clients
spread over the three, one daemon killed -9 in the middle of deliveries, answers, reads and
expiries, and an audit of the database through SQL afterwards."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import interactiond as itd
from daemon_kit import APPROVAL, fresh_postgres, make_tokens, write_chat_config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import chat_server  # noqa: E402

PB = "/v1/orgs/local/playbooks/default"
SEED_CHAT = (ROOT / "tests" / "fixtures" / "seed-chat-approval.md").read_text()
INPUT = {"owner": "ana", "review": "Clear goals; budget missing."}
ENDINGS = {s.value for s in itd.RunStatus if s.ended}


class Served:
    """One `interactiond serve` on the database, in a directory of its own (its lock and URL files)."""

    def __init__(self, name: str, db: str, config: Path, work: Path, token: str) -> None:
        self.name = name
        cwd = work / name
        cwd.mkdir()
        self.log = cwd / "daemon.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "interactiond", "serve", "--db", db, "--config", str(config), "--clock", "manual",
             "--host", "127.0.0.1", "--port", "0"], cwd=cwd, stdout=subprocess.PIPE, stderr=open(self.log, "wb"),
            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
        self.token = token
        self.url = ""
        self.http: aiohttp.ClientSession | None = None

    def ready(self) -> None:
        line = self.proc.stdout.readline().decode()
        m = re.search(r" at (http://\S+)", line)
        assert m, (line, self.log.read_text())
        self.url = m.group(1)
        self.http = aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.token}"},
                                          timeout=aiohttp.ClientTimeout(total=60))

    async def call(self, method: str, tail: str, body: Any = None) -> tuple[int, Any]:
        url = self.url + (tail if tail.startswith("/v1/admin") else PB + tail)
        async with self.http.request(method, url, json=body) as resp:
            text = await resp.text()
            return resp.status, (json.loads(text) if text else None)

    async def advance(self, duration: str) -> None:
        status, body = await self.call("POST", "/v1/admin/clock", {"advance": duration})
        assert status == 200, body

    def stop(self) -> None:
        """End the daemon and what it started (its chat server), by its process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def sql(db: str, query: str, *params: Any) -> list[Any]:
    tx = itd.open_sync(db)
    try:
        return tx.conn.execute(query, params).fetchall()
    finally:
        tx.close()


async def until(what, seconds: float = 15.0, every: float = 0.05):
    deadline = time.monotonic() + seconds
    while True:
        got = await what()
        if got or time.monotonic() > deadline:
            return got
        await asyncio.sleep(every)


@pytest.fixture
def pg():
    with fresh_postgres() as url:
        yield url


async def test_three_daemons_one_killed_in_the_middle_leave_every_run_ended_once(pg, tmp_path):
    t_start = time.monotonic()
    chat_db = str(tmp_path / "chat.db")
    config = write_chat_config(tmp_path / "config.yaml", chat_db)
    token = make_tokens(pg)["operator"]
    daemons = [Served(name, pg, config, tmp_path, token) for name in ("a", "b", "c")]
    try:
        for d in daemons:
            d.ready()
        a, b, c = daemons
        assert (await a.call("POST", "/definitions", {"type": "interaction", "name": "approve",
                                                      "source": APPROVAL}))[0] == 201
        assert (await b.call("POST", "/definitions", {"type": "interaction", "name": "chat-approval",
                                                      "source": SEED_CHAT}))[0] == 201

        # A stream on a: it hears what the others commit.
        seen: list[dict[str, Any]] = []

        async def stream() -> None:
            async with a.http.get(a.url + PB + "/stream", timeout=aiohttp.ClientTimeout(total=None)) as resp:
                assert resp.status == 200
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if line.startswith("data: "):
                        seen.append(json.loads(line[6:]))
        streaming = asyncio.create_task(stream())

        # Inbox requests, asked on all three.
        inbox = [(await daemons[i % 3].call("POST", "/runs", {"type": "interaction", "name": "approve",
                                                               "input": INPUT}))[1]["run_id"] for i in range(24)]
        acknowledged: dict[str, Any] = {}

        # A long poll on a, woken by an answer given on c.
        waiting = asyncio.create_task(a.call("POST", f"/runs/{inbox[0]}/wait?timeout=30"))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        t0 = time.monotonic()
        status, fact = await c.call("POST", f"/runs/{inbox[0]}/answer", {"answer": {"verdict": "approve"}})
        assert status == 200
        acknowledged[inbox[0]] = ({"verdict": "approve"}, fact["answer_id"])
        status, woken = await asyncio.wait_for(waiting, 10)
        assert status == 200 and woken["status"] == "succeeded" and time.monotonic() - t0 < 3
        ended = await until(lambda: asyncio.sleep(0, [e for e in seen if e.get("run_id") == inbox[0] and "status" in e]), 5)
        assert ended and ended[-1]["status"] == "succeeded"                 # a's stream, c's commit

        # A delivery that hangs in the chat tool: the daemon it runs on is the one to kill.
        chat_server.inject_fault(chat_db, "post_message", 1, mode="hang")
        hung = (await c.call("POST", "/runs", {"type": "interaction", "name": "chat-approval",
                                               "input": {"owner": "hana", "draft": "x"}}))[1]["run_id"]
        assert await until(lambda: asyncio.sleep(0, chat_server.calls(chat_db, "post_message") == 1))
        (owner,) = sql(pg, "SELECT d.id, d.pid FROM events e JOIN daemons d ON d.id = e.daemon"
                           " WHERE e.run_id = ? AND e.type = 'delivery_started'", hung)
        victim = next(d for d in daemons if d.proc.pid == owner["pid"])
        survivors = [d for d in daemons if d is not victim]

        # Chat requests on all three, delivered; some replied to and read.
        chats = [(await daemons[i % 3].call("POST", "/runs", {"type": "interaction", "name": "chat-approval",
                                                               "input": {"owner": f"u{i}", "draft": f"d{i}"}}))[1]["run_id"]
                 for i in range(9)]

        async def delivered() -> bool:
            return sql(pg, "SELECT COUNT(*) FROM requests WHERE run_id = ANY(?) AND delivery_state = 'delivered'",
                       chats)[0][0] == len(chats)
        assert await until(delivered)
        for i in range(0, 9, 2):
            ts = chat_server.messages(chat_db, f"u{i}")[0]["ts"]
            chat_server.say(chat_db, f"u{i}", f"u{i}", "approve, ship it", thread_ts=ts)

        # The burst: answers on all three, more chat requests, reads (the clock moves), and the kill.
        async def answer(i: int, run_id: str) -> None:
            await asyncio.sleep(0.01 * i)
            try:
                status, fact = await daemons[i % 3].call("POST", f"/runs/{run_id}/answer",
                                                         {"answer": {"verdict": "revise", "note": f"n{i}"}})
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return                                       # the daemon died under it: not acknowledged
            if status == 200:
                acknowledged[run_id] = ({"verdict": "revise", "note": f"n{i}"}, fact["answer_id"])

        async def ask(i: int) -> None:
            await asyncio.sleep(0.01 * i)
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                status, run = await daemons[i % 3].call("POST", "/runs", {
                    "type": "interaction", "name": "chat-approval", "input": {"owner": f"v{i}", "draft": "late"}})

        async def kill() -> None:
            await asyncio.sleep(0.08)
            victim.proc.send_signal(signal.SIGKILL)          # the daemon only: its chat server sees it go

        await asyncio.gather(*(answer(i, r) for i, r in enumerate(inbox[1:17])), *(ask(i) for i in range(6)),
                             survivors[0].advance("PT1M"), kill())
        victim.proc.wait(10)
        held_at_kill = sql(pg, "SELECT COUNT(*) FROM leases WHERE daemon = ? AND key LIKE 'read:%'", owner["id"])[0][0]

        # A survivor's heartbeat finds the victim gone and takes its work over: the hung attempt is lost.
        async def lost() -> bool:
            return bool(sql(pg, "SELECT 1 FROM events WHERE run_id = ? AND type = 'delivery_failed'", hung))
        assert await until(lost, 20), "nobody took the dead daemon's attempt over"
        assert not sql(pg, "SELECT 1 FROM daemons WHERE id = ?", owner["id"])

        # Time moves on the survivors: retries deliver, replies are read, the rest expire.
        s, t = survivors
        await s.advance("PT2M")
        await asyncio.sleep(0.2)
        for row in sql(pg, "SELECT sent_conversation, sent_id, party FROM requests WHERE open = 1"
                           " AND delivery_state = 'delivered' AND party NOT LIKE 'u%'"):
            chat_server.say(chat_db, row["sent_conversation"], row["party"], "approve", thread_ts=row["sent_id"])
        await t.advance("PT2M")
        await asyncio.sleep(0.2)
        await s.advance("PT5M")
        await asyncio.sleep(0.2)
        # What is still read (replies nobody gave) is cancelled: the rest expires, with no read between.
        for (run_id,) in sql(pg, "SELECT run_id FROM requests WHERE open = 1 AND reading IS NOT NULL"):
            status, _ = await t.call("POST", f"/runs/{run_id}/cancel")
            assert status == 200
        await s.advance("P3D")

        async def settled() -> bool:
            await t.advance("PT0S")
            return sql(pg, "SELECT COUNT(*) FROM runs WHERE status IN ('started', 'waiting')")[0][0] == 0
        assert await until(settled, 15), sql(pg, "SELECT run_id, status FROM runs WHERE status IN ('started', 'waiting')")
        streaming.cancel()

        # The audit.
        runs = {r["run_id"]: r for r in sql(pg, "SELECT * FROM runs")}
        reqs = {r["run_id"]: r for r in sql(pg, "SELECT * FROM requests")}
        events: dict[str, list[Any]] = {}
        for e in sql(pg, "SELECT * FROM events WHERE run_id IS NOT NULL ORDER BY id"):
            events.setdefault(e["run_id"], []).append(e)
        assert len(runs) >= 24 + 1 + 9
        for run_id, run in runs.items():
            evs = events[run_id]
            assert [e["run_seq"] for e in evs] == list(range(1, len(evs) + 1)) == list(range(1, run["events"] + 1))
            endings = [e for e in evs if e["type"].startswith("run_")]
            assert [e["type"] for e in endings] == ["run_" + run["status"]] and endings[0]["id"] == evs[-1]["id"], run_id
            assert len([e for e in evs if e["type"] == "request_answered"]) <= 1, run_id
            attempts = [json.loads(e["payload"])["attempt"] for e in evs if e["type"] == "delivery_started"]
            assert attempts == list(range(1, len(attempts) + 1)), (run_id, attempts)     # each attempt's timer once
            lost_ = [json.loads(e["payload"])["attempt"] for e in evs if e["type"] == "delivery_failed"
                     and json.loads(e["payload"])["because"] == "lost"]
            assert len(lost_) == len(set(lost_)), run_id
        for run_id, req in reqs.items():
            assert not req["open"], run_id                                   # no request stuck
            answered = [e for e in events[run_id] if e["type"] == "request_answered"]
            if req["status"] == "answered":
                assert len(answered) == 1 and req["answer_id"] == answered[0]["id"]
                assert runs[run_id]["status"] == "succeeded"
            else:
                assert answered == []
        for run_id, (answer, answer_id) in acknowledged.items():
            req = reqs[run_id]
            assert req["status"] == "answered" and json.loads(req["answer"]) == answer, run_id
            assert f"evt_{req['answer_id']}" == answer_id or req["answer_id"] == answer_id, run_id
        assert reqs[hung]["status"] in ("answered", "expired") and reqs[hung]["attempts"] == 2
        assert [json.loads(e["payload"])["because"] for e in events[hung] if e["type"] == "delivery_failed"] == ["lost"]
        assert all(runs[r]["status"] == "succeeded" for r in chats[0:9:2])     # the replies were read and taken
        assert all(reqs[r]["status"] == "expired" for r in inbox[17:])
        # Every timer fired once: none is left due, and each read was one call of the reading tool
        # (but for reads the victim was making when it died, which it never recorded).
        now = sql(pg, "SELECT now_ms FROM clock")[0][0]
        assert sql(pg, "SELECT key FROM timers WHERE due_at <= ?", now) == []
        reads = sql(pg, "SELECT COALESCE(SUM(reads), 0) FROM readings")[0][0]
        assert 0 <= chat_server.calls(chat_db, "thread_replies") - reads <= held_at_kill
        taken = [r["reply_id"] for r in reqs.values() if r["reply_id"] is not None]
        assert len(taken) == len(set(taken)) >= 5
        assert time.monotonic() - t_start < 60
    finally:
        for d in daemons:
            if d.http is not None:
                await d.http.close()
            d.stop()
