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
from daemon_kit import START_MS, fresh_postgres, start_chat_daemon, start_daemon, watching_waits

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
        (row,) = [r for r in itd.PgDaemons(tx.conn).live_daemons() if r["id"] == store.daemon_id]
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
    assert [r["id"] for r in itd.PgDaemons(tx.conn).live_daemons()] == []         # a stop leaves the table
    tx.close()


async def test_a_start_takes_over_only_the_calls_of_daemons_that_are_gone(pg, aiohttp_client):
    tx = itd.open_sync(pg)
    tx.ensure_playbook(PB, now=START_MS)
    itd.PgDaemons(tx.conn).register_daemon("dmn_live", "elsewhere", 1)
    itd.PgDaemons(tx.conn).register_daemon("dmn_dead", "elsewhere", 2)
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
        itd.PgDaemons(tx.conn).register_daemon("dmn_crashed", itd._HOST, gone.pid)
        itd.PgDaemons(tx.conn).register_daemon("dmn_other_host", "elsewhere", gone.pid)
        itd.PgDaemons(tx.conn).register_daemon("dmn_new", itd._HOST, os.getpid())
        assert {r["id"] for r in itd.PgDaemons(tx.conn).live_daemons()} == {"dmn_other_host", "dmn_new"}
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
    with watching_waits(a) as parked:
        waiter = asyncio.create_task(a.call("POST", f"/runs/{run['run_id']}/wait?timeout=30"))
        await asyncio.wait_for(parked.wait(), 5)
    assert not waiter.done()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    status, _ = await b.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "approve"}})
    assert status == 200
    status, got = await asyncio.wait_for(waiter, 5)
    assert status == 200 and got["status"] == "succeeded" and got["output"] == {"verdict": "approve"}
    assert loop.time() - t0 < 5


async def test_each_daemon_counts_in_its_metrics_what_it_did_not_what_it_heard(two):
    # Summed over the daemons (as a Prometheus server sums its instances), an answer counts once.
    from prometheus_client.parser import text_string_to_metric_families

    from daemon_kit import APPROVAL

    async def ended(d) -> float:
        resp = await d.client.get("/metrics", headers=d.auth("operator"))
        assert resp.status == 200
        return sum(s.value for f in text_string_to_metric_families(await resp.text()) for s in f.samples
                   if s.name == "interactiond_runs_ended_total" and s.labels.get("status") == "succeeded")

    a, b = two
    await a.define("approve", APPROVAL)
    _, run = await a.run("approve", INPUT)
    with watching_waits(a) as parked:
        waiter = asyncio.create_task(a.call("POST", f"/runs/{run['run_id']}/wait?timeout=30"))
        await asyncio.wait_for(parked.wait(), 5)
    status, _ = await b.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "approve"}})
    assert status == 200
    status, got = await asyncio.wait_for(waiter, 5)   # a heard of the answer...
    assert got["status"] == "succeeded"
    assert (await ended(a), await ended(b)) == (0, 1)  # ...and only b counted it


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
    with watching_waits(a) as parked:
        waiter = asyncio.create_task(a.call("POST", f"/runs/{run['run_id']}/wait?timeout=30"))
        await asyncio.wait_for(parked.wait(), 5)
    listener = a.engine.store._listener.daemons.conn.raw.info.backend_pid
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


# Leases: work one daemon does at a time, and the work of daemons that are gone.


def _as(tx, daemon: str | None):
    tx.daemon = daemon
    return tx


def test_a_lease_is_held_by_one_daemon_until_released_or_its_holder_is_gone(pg):
    tx = itd.open_sync(pg)
    try:
        for d in ("dmn_a", "dmn_b", "dmn_c"):
            itd.PgDaemons(tx.conn).register_daemon(d, "elsewhere", 1)
        key = f"read:{PB}:1"
        assert _as(tx, "dmn_a").claim_lease(key) is True
        assert _as(tx, "dmn_a").claim_lease(key) is False          # not twice, not even by its holder
        assert _as(tx, "dmn_b").claim_lease(key) is False          # b is refused, and a is told
        assert _as(tx, "dmn_b").release_lease(key) is False        # only the holder releases
        assert _as(tx, "dmn_a").release_lease(key) is True         # b asked meanwhile: a's to do again
        assert _as(tx, "dmn_b").claim_lease(key) is True
        assert _as(tx, "dmn_b").release_lease(key) is False        # nobody asked
        assert tx.conn.execute("SELECT COUNT(*) FROM leases").fetchone()[0] == 0
        # A holder that stops beating loses its lease when the lease ends; one that left, at once.
        assert _as(tx, "dmn_a").claim_lease(key) is True
        tx.conn.execute("UPDATE leases SET until_ms = until_ms - ? WHERE key = ?", (itd._lease_ms() + 1, key))
        assert _as(tx, "dmn_c").claim_lease(key) is True
        itd.PgDaemons(tx.conn).leave("dmn_c")
        assert _as(tx, "dmn_b").claim_lease(key) is True
        # With a due time, only a due timer is claimed.
        fx = itd.Effects()
        wkey = f"read:{PB}:2"
        tx.set_timer(fx, wkey, START_MS + 1000)
        assert _as(tx, "dmn_a").claim_lease(wkey, due_by=START_MS) is False
        assert _as(tx, "dmn_a").claim_lease(f"read:{PB}:3", due_by=START_MS + 1000) is False   # no timer at all
        assert _as(tx, "dmn_a").claim_lease(wkey, due_by=START_MS + 1000) is True
    finally:
        tx.close()


def test_the_heartbeat_renews_the_leases_of_its_daemon_and_finds_the_daemons_that_are_gone(pg):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    tx = itd.open_sync(pg)
    try:
        itd.PgDaemons(tx.conn).register_daemon("dmn_a", "elsewhere", 1)
        itd.PgDaemons(tx.conn).register_daemon("dmn_late", "elsewhere", 2)
        itd.PgDaemons(tx.conn).register_daemon("dmn_here", itd._HOST, os.getpid())
        itd.PgDaemons(tx.conn).register_daemon("dmn_crashed", itd._HOST, gone.pid)          # (its process ends after)
        _as(tx, "dmn_a").claim_lease("workflow:x:1")
        tx.conn.execute("UPDATE leases SET until_ms = 0")
        assert itd.PgDaemons(tx.conn).beat("dmn_a")
        assert tx.conn.execute("SELECT until_ms FROM leases").fetchone()[0] > time.time() * 1000   # the server's clock
        tx.conn.execute("UPDATE daemons SET seen_at = seen_at - ? WHERE id = 'dmn_late'", (itd._lease_ms() + 1,))
        assert sorted(itd.PgDaemons(tx.conn).reap_daemons(itd._HOST, os.getpid())) == ["dmn_crashed", "dmn_late"]
        assert itd.PgDaemons(tx.conn).reap_daemons(itd._HOST, os.getpid()) == []         # each is found gone once
        assert {r["id"] for r in itd.PgDaemons(tx.conn).live_daemons()} == {"dmn_a", "dmn_here"}
    finally:
        tx.close()


def test_the_schema_applied_while_a_daemon_writes_waits_for_the_write_and_ends_neither(pg):
    # A start (another daemon's, or the command line's) applies the schema while daemons write. Its
    # CREATE INDEX IF NOT EXISTS lock each indexed table (SHARE) in the schema's order, a write its
    # tables (ROW EXCLUSIVE) in its own: taken in between, the server ends one of the two as a
    # deadlock. Here a write holds events and goes on to runs once the schema waits.
    import threading

    import psycopg

    itd.open_sync(pg).close()
    other = psycopg.connect(pg, autocommit=True)
    watch = psycopg.connect(pg, autocommit=True)
    failed: list[BaseException] = []

    def apply() -> None:
        try:
            itd.open_sync(pg).close()
        except BaseException as exc:
            failed.append(exc)
    applying = threading.Thread(target=apply)
    try:
        other.execute("BEGIN")
        other.execute("SELECT pg_advisory_xact_lock(%s)", (itd._PG_WRITE_LOCK,))
        other.execute("INSERT INTO events (playbook, type, at, payload, size) VALUES (%s, 'x', 0, '{}', 2)", (PB,))
        applying.start()
        for _ in range(500):                            # until the schema waits on the write
            if watch.execute("SELECT COUNT(*) FROM pg_locks WHERE NOT granted").fetchone()[0]:
                break
            time.sleep(0.01)
        else:
            pytest.fail("the schema never waited on the write")
        other.execute("UPDATE runs SET events = events WHERE playbook = %s", (PB,))
        other.execute("COMMIT")
        applying.join(30)
        assert not applying.is_alive() and failed == []
    finally:
        other.close()
        watch.close()
        applying.join(30)


# Taking over what a daemon that is gone held, on a live daemon's heartbeat.

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
SEED_CHAT = (ROOT / "tests" / "fixtures" / "seed-chat-approval.md").read_text()


@pytest.fixture
async def chat(pg, tmp_path, aiohttp_client, monkeypatch):
    """A daemon whose playbook delivers through the example chat server, beating every 50 ms."""
    sys.path.insert(0, str(ROOT / "examples"))
    import chat_server

    monkeypatch.setattr(itd, "DAEMON_BEAT_S", 0.05)
    d = await start_chat_daemon(aiohttp_client, pg, tmp_path / "chat.db", playbook=PB)
    d.chat_server = chat_server
    await d.define("chat-approval", SEED_CHAT)
    return d


async def _until(what, seconds: float = 10.0):
    """Poll `what()` (async) in real time until it is truthy: another daemon's heartbeat acts on its own."""
    for _ in range(int(seconds / 0.02)):
        got = await what()
        if got:
            return got
        await asyncio.sleep(0.02)
    return await what()


def _other_daemon(db: str, daemon: str) -> None:
    tx = itd.open_sync(db)
    itd.PgDaemons(tx.conn).register_daemon(daemon, "elsewhere", 1)
    tx.close()


def _gone(db: str, daemon: str) -> None:
    """The daemon stopped beating a lease ago (a crash on another machine)."""
    tx = itd.open_sync(db)
    tx.conn.execute("UPDATE daemons SET seen_at = seen_at - ? WHERE id = ?", (itd._lease_ms() + 1, daemon))
    tx.close()


async def test_an_attempt_in_flight_on_a_live_daemon_is_its_own_and_counts_lost_once_that_daemon_is_gone(chat):
    d = chat
    _other_daemon(d.db, "dmn_x")
    # A run whose first attempt dmn_x began (its delivery_started event) and never ended.
    _, run = await d.run("chat-approval", {"owner": "ana", "draft": "x"})
    run_id = run["run_id"]
    await d.advance("PT0S")
    tx = itd.open_sync(d.db)
    tx.conn.execute("UPDATE requests SET delivery_state = 'delivering', sent_conversation = NULL, sent_id = NULL,"
                    " conversation = NULL, reading = NULL WHERE run_id = ?", (run_id,))
    tx.conn.execute("UPDATE events SET daemon = 'dmn_x' WHERE run_id = ? AND type = 'delivery_started'", (run_id,))
    tx.conn.execute("DELETE FROM events WHERE run_id = ? AND type = 'delivery_succeeded'", (run_id,))
    tx.conn.execute("UPDATE runs SET events = events - 1 WHERE run_id = ?", (run_id,))
    tx.set_timer(itd.Effects(), itd.timer_key("lost", PB, run_id), d.clock.now_ms() + 60_000)
    tx.close()
    d.engine.wheel.set(itd.timer_key("lost", PB, run_id), d.clock.now_ms() + 60_000)

    async def request():
        return (await d.call("GET", "/interactions"))[1]["data"][0]
    await d.advance("PT2M")                        # its `lost` timer fires here: dmn_x is alive, it is dmn_x's
    assert (await request())["delivery_state"] == "delivering"
    types = [e["type"] for e in (await d.call("GET", f"/runs/{run_id}/events"))[1]["data"]]
    assert "delivery_failed" not in types
    _gone(d.db, "dmn_x")                           # ... until dmn_x is gone: this daemon's heartbeat notices
    got = await _until(lambda: _delivered(d, run_id))
    assert got["delivery_state"] == "delivered" and got["attempts"] == 2, got
    failed = [e for e in (await d.call("GET", f"/runs/{run_id}/events"))[1]["data"] if e["type"] == "delivery_failed"]
    assert [e["payload"]["because"] for e in failed] == ["lost"]


async def _delivered(d, run_id):
    await d.advance("PT0S")
    got = (await d.call("GET", "/interactions"))[1]["data"][0]
    return got if got["delivery_state"] == "delivered" else None


async def test_a_conversation_is_read_by_the_daemon_that_holds_its_lease(chat):
    d = chat
    _, run = await d.run("chat-approval", {"owner": "ana", "draft": "x"})
    run_id = run["run_id"]
    await d.advance("PT0S")
    tx = itd.open_sync(d.db)
    reading = tx.request(PB, run_id)["reading"]
    key = itd.timer_key("read", PB, str(reading))
    itd.PgDaemons(tx.conn).register_daemon("dmn_x", "elsewhere", 1)
    assert _as(tx, "dmn_x").claim_lease(key)       # another daemon reads this conversation now
    tx.close()
    ts = d.chat_server.messages(d.chat, "ana")[0]["ts"]
    d.chat_server.say(d.chat, "ana", "ana", "approve", thread_ts=ts)
    await d.advance("PT2M")
    assert d.chat_server.calls(d.chat, "thread_replies") == 0
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["status"] == "waiting"
    _gone(d.db, "dmn_x")                           # the holder is gone: its reading is this daemon's now

    async def succeeded():
        await d.advance("PT0S")
        run = (await d.call("GET", f"/runs/{run_id}"))[1]
        return run if run["status"] == "succeeded" else None
    got = await _until(succeeded)
    assert got is not None and got["output"]["verdict"] == "approve"
    assert d.chat_server.calls(d.chat, "thread_replies") == 1
    tx = itd.open_sync(d.db)
    assert tx.conn.execute("SELECT COUNT(*) FROM leases").fetchone()[0] == 0      # released after the read
    tx.close()


WORKFLOW = """\
document: {dsl: '1.0.3', namespace: tests, name: ask-twice, version: '1.0.0'}
do:
  - first:
      call: run_definition
      with: { type: interaction, name: approve, input: '${ $data }' }
  - second:
      call: run_definition
      with: { type: interaction, name: approve, input: '${ $workflow.input }' }
"""


async def test_a_workflow_run_is_driven_by_the_daemon_that_holds_its_lease(pg, aiohttp_client, monkeypatch):
    from daemon_kit import APPROVAL

    monkeypatch.setattr(itd, "DAEMON_BEAT_S", 0.05)
    d = await start_daemon(aiohttp_client, pg)
    await d.define("approve", APPROVAL)
    status, _ = await d.call("POST", "/definitions", {"type": "workflow", "name": "ask-twice", "source": WORKFLOW})
    assert status == 201
    _other_daemon(pg, "dmn_x")
    tx = itd.open_sync(pg)
    _as(tx, "dmn_x").claim_lease(itd.timer_key("workflow", PB, "wf-1"))   # dmn_x drives this run
    tx.close()
    status, run = await d.call("POST", "/runs", {"type": "workflow", "name": "ask-twice", "input": INPUT,
                                                 "run_id": "wf-1"})
    assert status == 202
    await d.advance("PT0S")
    assert (await d.call("GET", "/runs/wf-1"))[1]["status"] == "started"       # not this daemon's to drive
    assert (await d.call("GET", "/interactions"))[1]["data"] == []
    tx = itd.open_sync(pg)
    assert _as(tx, "dmn_x").release_lease(itd.timer_key("workflow", PB, "wf-1")) is True   # asked meanwhile
    tx.close()
    _gone(pg, "dmn_x")
    # dmn_x "released" without driving (as a crash would leave it): the take-over arms the run again.
    tx = itd.open_sync(pg)
    _as(tx, "dmn_x").claim_lease(itd.timer_key("workflow", PB, "wf-1"))
    tx.close()

    async def asked():
        await d.advance("PT0S")
        return (await d.call("GET", "/interactions"))[1]["data"]
    first = await _until(asked)
    assert len(first) == 1
    status, _ = await d.call("POST", f"/runs/{first[0]['run_id']}/answer", {"answer": {"verdict": "approve"}})
    await d.advance("PT0S")
    second = (await d.call("GET", "/interactions"))[1]["data"]
    assert len(second) == 1 and second[0]["run_id"] != first[0]["run_id"]
