"""Several daemons on one PostgreSQL database (two engines and apps in this process, each with its own
store, clock and tool sessions, as two machines behind a load balancer would have)."""
from __future__ import annotations

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
