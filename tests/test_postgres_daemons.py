"""Several daemons on one PostgreSQL database (two engines and apps in this process, each with its own
store, clock and tool sessions, as two machines behind a load balancer would have)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

import interactiond as itd
from daemon_kit import START_MS, fresh_postgres, start_daemon

PB = "local/default"


@pytest.fixture
def pg():
    with fresh_postgres() as url:
        yield url


def _call_in_flight(tx, run_id: str, daemon: str | None) -> None:
    """A system call sent under `run_id` by `daemon` that has not ended (no answer recorded)."""
    tx.insert_run(playbook=PB, run_id=run_id, type_="interaction", name="lookup", version=1, input_text="{}",
                  input_sha="x", parent=None, now=START_MS, by="tok_x", tools_called=True)
    tx.daemon = daemon
    tx.append_event(None, PB, run_id, "tool_call_started", START_MS, "tok_x", {"read_only": True})
    tx.daemon = None


async def test_a_daemon_registers_beats_and_leaves(pg, monkeypatch):
    monkeypatch.setattr(itd, "DAEMON_BEAT_S", 0.05)
    store = itd.Store(pg)
    await store.open()
    tx = itd.open_sync(pg)
    try:
        (row,) = [r for r in tx.live_daemons() if r["id"] == store.daemon_id]
        assert row["host"] == itd._HOST and row["pid"] == os.getpid()
        first = row["seen_at"]
        for _ in range(200):                          # the heartbeat thread moves seen_at on (real time)
            seen = tx.conn.execute("SELECT seen_at FROM daemons WHERE id = ?", (store.daemon_id,)).fetchone()[0]
            if seen > first:
                break
            time.sleep(0.02)
        assert seen > first
    finally:
        await store.close()
    assert [r["id"] for r in tx.live_daemons()] == []         # a stop leaves the table
    tx.close()


async def test_a_start_takes_over_only_the_calls_of_daemons_that_are_gone(pg, aiohttp_client):
    tx = itd.open_sync(pg)
    tx.ensure_playbook(PB, now=START_MS)
    tx.register_daemon("dmn_live", "elsewhere", 1)
    tx.register_daemon("dmn_dead", "elsewhere", 2)
    tx.conn.execute("UPDATE daemons SET seen_at = seen_at - ? WHERE id = 'dmn_dead'",
                    (int(itd.DAEMON_LEASE_S * 1000) + 1,))
    _call_in_flight(tx, "r-live", "dmn_live")
    _call_in_flight(tx, "r-dead", "dmn_dead")
    _call_in_flight(tx, "r-unknown", None)
    tx.close()
    d = await start_daemon(aiohttp_client, pg)
    status = {r: (await d.call("GET", f"/runs/{r}"))[1] for r in ("r-live", "r-dead", "r-unknown")}
    assert status["r-live"]["status"] == "started"              # a live daemon's call is its own to end
    for r in ("r-dead", "r-unknown"):
        assert (status[r]["status"], status[r]["kind"]) == ("unavailable", "tools_unfinished"), status[r]


def test_a_daemon_of_this_host_whose_process_is_gone_leaves_at_the_next_start(pg):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    tx = itd.open_sync(pg)
    try:
        tx.register_daemon("dmn_crashed", itd._HOST, gone.pid)
        tx.register_daemon("dmn_other_host", "elsewhere", gone.pid)
        tx.register_daemon("dmn_new", itd._HOST, os.getpid())
        assert {r["id"] for r in tx.live_daemons()} == {"dmn_other_host", "dmn_new"}
    finally:
        tx.close()


# Two daemons on one database: each hears the other's commits (LISTEN/NOTIFY).

INPUT = {"owner": "ana", "review": "Clear goals; budget missing."}


@pytest.fixture
async def two(pg, aiohttp_client):
    a = await start_daemon(aiohttp_client, pg)
    b = await start_daemon(aiohttp_client, pg, tokens=a.tokens)
    return a, b


async def test_a_wait_on_one_daemon_is_woken_by_an_answer_on_the_other(two):
    from daemon_kit import APPROVAL

    a, b = two
    await a.define("approve", APPROVAL)
    _, run = await a.run("approve", INPUT)
    waiter = asyncio.create_task(a.call("POST", f"/runs/{run['run_id']}/wait?timeout=30"))
    await asyncio.sleep(0.05)          # let the long poll park (real time; not the daemon's clock)
    assert not waiter.done()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    status, _ = await b.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "approve"}})
    assert status == 200
    status, got = await asyncio.wait_for(waiter, 5)
    assert status == 200 and got["status"] == "succeeded" and got["output"] == {"verdict": "approve"}
    assert loop.time() - t0 < 5


async def test_a_definition_saved_on_one_daemon_is_the_current_one_on_the_other(two):
    from daemon_kit import APPROVAL

    a, b = two
    await a.define("approve", APPROVAL)
    _, first = await b.run("approve", INPUT)                  # b reads version 1 and keeps it
    assert (await b.call("GET", f"/runs/{first['run_id']}"))[1]["version"] == 1
    await a.define("approve", APPROVAL.replace("P2D", "P3D"))
    for _ in range(100):                                       # the notification arrives after a's commit
        _, again = await b.run("approve", INPUT)
        if (await b.call("GET", f"/runs/{again['run_id']}"))[1]["version"] == 2:
            break
        await asyncio.sleep(0.02)
    assert (await b.call("GET", f"/runs/{again['run_id']}"))[1]["version"] == 2


async def test_a_timer_set_on_one_daemon_fires_once_on_the_other(two):
    from daemon_kit import APPROVAL

    a, b = two
    await a.define("approve", APPROVAL)
    _, run = await a.run("approve", INPUT)                     # expires in 2 days, a timer a has set
    run_id = run["run_id"]
    for _ in range(100):                                       # b's timer task learns of it from a's commit
        if b.engine.wheel.next_due() is not None and b.engine.wheel.next_due() < START_MS + 3 * 86_400_000:
            break
        await asyncio.sleep(0.02)
    await b.advance("P2D")                                     # only b's clock moves: b fires the expiry
    got = (await a.call("GET", f"/runs/{run_id}"))[1]
    assert (got["status"], got["kind"]) == ("rejected", "expired")
    await a.advance("P2D")                                     # a's timer is due too: it finds it taken
    _, page = await a.call("GET", f"/runs/{run_id}/events")
    endings = [e for e in page["data"] if e["type"].startswith("run_")]
    assert [e["type"] for e in endings] == ["run_rejected"]
    tx = itd.open_sync(a.db)
    seqs = [r[0] for r in tx.conn.execute("SELECT run_seq FROM events WHERE run_id = ? ORDER BY id", (run_id,))]
    tx.close()
    assert seqs == list(range(1, len(page["data"]) + 1))      # gap-free, each event once


async def test_a_daemon_whose_listening_connection_drops_looks_again_at_everything(two):
    import psycopg

    from daemon_kit import APPROVAL

    a, b = two
    await a.define("approve", APPROVAL)
    _, run = await a.run("approve", INPUT)
    waiter = asyncio.create_task(a.call("POST", f"/runs/{run['run_id']}/wait?timeout=30"))
    await asyncio.sleep(0.05)
    listener = a.engine.store._listener.tx.conn.raw.info.backend_pid
    with psycopg.connect(a.db, autocommit=True) as admin:     # a's listener is cut off ...
        assert admin.execute("SELECT pg_terminate_backend(%s)", (listener,)).fetchone()[0] is True
    # ... and b's answer is committed while it is: its notification may never reach a.
    status, _ = await b.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "approve"}})
    assert status == 200
    status, got = await asyncio.wait_for(waiter, 10)
    assert status == 200 and got["status"] == "succeeded"


def test_effects_are_notified_in_payloads_under_the_limit():
    fx = itd.Effects()
    fx.timers.extend((f"expire:{PB}:run_{i:04}", START_MS + i) for i in range(400))
    fx.wakes.append((PB, "run_0001"))
    fx.invalidated.append(("definition", PB, "interaction", "approve"))
    fx.published.append({"id": 7, "playbook": PB, "run_id": "run_0001", "type": "run_succeeded", "at": START_MS,
                         "payload": {"output": "x" * 10_000}})          # the payload stays in the table
    payloads = itd._bus_payloads("dmn_a", [fx, itd.Effects()])
    assert len(payloads) > 1 and all(len(p.encode()) <= itd.PG_NOTIFY_BYTES for p in payloads)
    items = [item for p in payloads for item in __import__("json").loads(p)["x"]]
    assert items[:400] == [["t", f"expire:{PB}:run_{i:04}", START_MS + i] for i in range(400)]
    assert items[400:] == [["w", PB, "run_0001"], ["e", 7, PB, "run_0001", "run_succeeded", START_MS],
                           ["i", "definition", PB, "interaction", "approve"]]
    assert itd._bus_payloads("dmn_a", [itd.Effects()]) == []


# The manual clock's time lives in the database.


async def _clock_reaches(d, ms: int) -> int:
    for _ in range(250):                                      # the other daemon's notification, in real time
        if d.engine.clock.now_ms() >= ms:
            break
        await asyncio.sleep(0.02)
    return d.engine.clock.now_ms()


async def test_advancing_the_manual_clock_on_one_daemon_moves_it_for_all(two, aiohttp_client):
    a, b = two
    status, body = await a.call("POST", "/v1/admin/clock", {"advance": "PT1H"})
    assert status == 200
    assert await _clock_reaches(b, START_MS + 3_600_000) == START_MS + 3_600_000
    status, body = await b.call("POST", "/v1/admin/clock", {"advance": "PT1M"})    # from the shared time on
    assert body["now"] == itd.fmt_time(START_MS + 3_660_000)
    assert await _clock_reaches(a, START_MS + 3_660_000) == START_MS + 3_660_000
    # A daemon that starts later, on a clock of its own, takes the shared time.
    c = await start_daemon(aiohttp_client, a.db, tokens=a.tokens)
    assert c.engine.clock.now_ms() == START_MS + 3_660_000


async def test_an_expiry_due_on_two_daemons_advancing_together_fires_once(two):
    from daemon_kit import APPROVAL

    a, b = two
    await a.define("approve", APPROVAL)
    run_ids = [(await (a if i % 2 else b).run("approve", INPUT))[1]["run_id"] for i in range(6)]
    await asyncio.gather(a.advance("P2D"), b.advance("P2D"))
    tx = itd.open_sync(a.db)
    try:
        for run_id in run_ids:
            rows = tx.conn.execute("SELECT type, run_seq FROM events WHERE run_id = ? ORDER BY id", (run_id,)).fetchall()
            assert [r["type"] for r in rows if r["type"].startswith("run_")] == ["run_rejected"], rows
            assert [r["run_seq"] for r in rows] == list(range(1, len(rows) + 1))
            assert tx.run(PB, run_id)["kind"] == "expired"
        assert tx.all_timers() == []
    finally:
        tx.close()
