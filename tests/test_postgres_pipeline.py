"""The PostgreSQL store's group commit: one transaction in psycopg's pipeline mode, each change in a
savepoint of its own. What a change does stays its own: a failed guard or a refused statement fails
that change alone, the others of its group commit keep what they wrote, no change runs twice, and
every published event carries its id once the change commits."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

import interactiond as itd
from daemon_kit import START_MS, fresh_postgres

PB = "local/default"


@pytest.fixture
def pg():
    with fresh_postgres() as url:
        yield url


@contextlib.contextmanager
def _playbook(url: str):
    """The database with the playbook entered, outside any daemon (each operation commits on its own)."""
    tx = itd.open_sync(url)
    try:
        tx.ensure_playbook(PB, now=START_MS)
        yield tx
    finally:
        tx.close()


def _runs(url: str, *run_ids: str) -> None:
    with _playbook(url) as tx:
        for run_id in run_ids:
            assert tx.insert_run(playbook=PB, run_id=run_id, type_="interaction", name="approve", version=1,
                                 input_text="{}", input_sha="x", parent=None, now=START_MS, by="tok_x")


async def _store(url: str, committed: list[itd.Effects], batches: list[int]) -> itd.Store:
    store = itd.Store(url, on_commit=committed.append)
    store.on_batch = lambda n, seconds: batches.append(n)
    await store.open()
    return store


def _end(run_id: str):
    def change(tx, fx):
        tx.end_run(fx, PB, run_id, itd.RunStatus.SUCCEEDED, now=START_MS + 1, by="tok_x", output={"ok": run_id})
        return run_id
    return change


async def test_a_failed_guard_fails_its_own_change_and_no_other_of_its_commit(pg):
    _runs(pg, "r1", "r2", "r3")
    committed: list[itd.Effects] = []
    batches: list[int] = []
    store = await _store(pg, committed, batches)
    try:
        await store.write(_end("r2"))                       # r2 has ended: ending it again is a conflict
        committed.clear()
        batches.clear()
        # Asked for in one turn of the loop: one group commit of three changes.
        got = await asyncio.gather(store.write(_end("r1")), store.write(_end("r2")), store.write(_end("r3")),
                                   return_exceptions=True)
        assert batches == [3]
        assert got[0] == "r1" and got[2] == "r3"
        assert isinstance(got[1], itd.Problem) and (got[1].name, got[1].status) == ("conflict", 409)
        rows = await store.read(lambda tx: [dict(r) for r in tx.conn.execute(
            "SELECT id, run_id, type, run_seq FROM events ORDER BY id").fetchall()])
        assert [(r["run_id"], r["type"], r["run_seq"]) for r in rows] == [
            ("r2", "run_succeeded", 1), ("r1", "run_succeeded", 1), ("r3", "run_succeeded", 1)]
        runs = await store.read(lambda tx: {r: tx.run(PB, r)["events"] for r in ("r1", "r2", "r3")})
        assert runs == {"r1": 1, "r2": 1, "r3": 1}          # the refused change counted nothing
        # Only the changes that committed publish, and each event with the id the table gave it.
        assert [(e["run_id"], e["id"]) for fx in committed for e in fx.published] == \
            [(r["run_id"], r["id"]) for r in rows[1:]]
    finally:
        await store.close()


async def test_a_statement_refused_after_its_change_returned_fails_that_change_alone(pg):
    _runs(pg)
    committed: list[itd.Effects] = []
    batches: list[int] = []
    store = await _store(pg, committed, batches)

    def daemon_row(name: str):
        def change(tx, fx):             # no result is read: the statement goes with the change's end
            tx.conn.execute("INSERT INTO daemons (id, host, pid, started_at, seen_at) VALUES (?, 'h', 1, 0, 0)",
                            (name,))
            return name
        return change

    try:
        got = await asyncio.gather(store.write(daemon_row("dmn_a")), store.write(daemon_row("dmn_a")),
                                   store.write(daemon_row("dmn_b")), return_exceptions=True)
        assert batches == [3]
        assert got[0] == "dmn_a" and got[2] == "dmn_b"
        assert not isinstance(got[1], str)                  # the second dmn_a: a unique key refused it
        names = await store.read(lambda tx: sorted(r[0] for r in tx.conn.execute(
            "SELECT id FROM daemons WHERE host = 'h'").fetchall()))
        assert names == ["dmn_a", "dmn_b"]
    finally:
        await store.close()


async def test_a_change_that_fails_before_anything_was_sent_leaves_the_rest_of_its_commit(pg):
    _runs(pg, "r1", "r2")
    committed: list[itd.Effects] = []
    batches: list[int] = []
    store = await _store(pg, committed, batches)

    def refuses(tx, fx):
        tx.set_timer(fx, "expire:x:y", START_MS)          # queued, never sent: dropped with the change
        raise itd.Problem("invalid_input", "no")

    try:
        got = await asyncio.gather(store.write(refuses), store.write(_end("r1")), store.write(_end("r2")),
                                   return_exceptions=True)
        assert batches == [3]
        assert isinstance(got[0], itd.Problem) and got[1:] == ["r1", "r2"]
        timers = await store.read(lambda tx: tx.all_timers())
        assert timers == []
        ended = await store.read(lambda tx: [tx.run(PB, r)["status"] for r in ("r1", "r2")])
        assert ended == ["succeeded", "succeeded"]
        assert all(type(e["id"]) is int for fx in committed for e in fx.published)
    finally:
        await store.close()


async def test_a_change_that_reads_a_refused_statement_is_undone_alone_and_the_next_one_commits(pg):
    # The server refuses a statement whose result the change reads (the pipeline aborts there): the
    # change fails, its earlier write is undone with its savepoint, and the change after it in the
    # same transaction runs once and commits.
    _runs(pg, "r1")
    committed: list[itd.Effects] = []
    batches: list[int] = []
    store = await _store(pg, committed, batches)
    ran: list[str] = []

    def divides(tx, fx):
        ran.append("divides")
        tx.set_timer(fx, "expire:x:divides", START_MS)
        return tx.conn.execute("SELECT 1 / (COUNT(*) - COUNT(*)) FROM runs").fetchone()[0]

    def ends(tx, fx):
        ran.append("ends")
        return _end("r1")(tx, fx)

    try:
        got = await asyncio.gather(store.write(divides), store.write(ends), return_exceptions=True)
        assert batches == [2] and ran == ["divides", "ends"]
        assert isinstance(got[0], Exception) and got[1] == "r1"
        assert await store.read(lambda tx: tx.all_timers()) == []
        assert await store.read(lambda tx: tx.run(PB, "r1")["status"]) == "succeeded"
        assert [e["type"] for fx in committed for e in fx.published] == ["run_succeeded"]
    finally:
        await store.close()


async def test_the_event_loop_runs_while_a_write_waits_on_the_server(pg):
    # Another daemon's write holds the database's write lock. Ours waits for it in its round trip,
    # and the event loop meanwhile goes on serving: here it is the loop itself that ends the other
    # write. A wait that held the loop (the GIL) would run into the lock timeout instead.
    import psycopg

    _runs(pg)
    store = await _store(pg, [], [])
    other = psycopg.connect(pg, autocommit=True)
    try:
        other.execute("BEGIN")
        other.execute("SELECT pg_advisory_xact_lock(%s)", (itd._PG_WRITE_LOCK,))
        write = asyncio.ensure_future(store.write(lambda tx, fx: tx.ensure_playbook("acme/other", now=START_MS)))
        turns = 0
        while turns < 20 and not write.done():
            await asyncio.sleep(0.01)
            turns += 1
        assert not write.done()                 # still waiting for the lock, and the loop turned meanwhile
        other.execute("COMMIT")
        await asyncio.wait_for(write, 30)
        assert await store.read(lambda tx: tx.conn.execute("SELECT COUNT(*) FROM playbooks").fetchone()[0]) == 2
    finally:
        other.close()
        await store.close()


def _marked_then_guarded(tx, fx):
    """Writes a marker event, then a guarded statement whose guard fails (no run `nope`) and whose
    result nobody reads in the change: the marker must not stay."""
    tx.append_event(fx, PB, None, "marker", START_MS, "tok_x", {})
    moved = tx.conn.execute("UPDATE runs SET status = 'cancelled' WHERE run_id = ? RETURNING 1", ("nope",))
    if moved.fetchone() is None:
        raise itd.Problem("conflict", "no run nope")
    return "marked"


def _markers(tx) -> int:
    return tx.conn.execute("SELECT COUNT(*) FROM events WHERE type = 'marker'").fetchone()[0]


async def test_a_change_alone_whose_guard_fails_leaves_nothing_written(pg):
    # The guard's result comes back after the change has returned; the commit must not go with it.
    _runs(pg)
    committed: list[itd.Effects] = []
    store = await _store(pg, committed, [])
    try:
        with pytest.raises(itd.Problem) as got:
            await store.write(_marked_then_guarded)
        assert got.value.name == "conflict"
        assert await store.read(_markers) == 0
        assert committed == []
    finally:
        await store.close()


async def test_a_change_whose_guard_fails_is_undone_alone_and_the_next_runs_once_without_its_writes(pg):
    # Change 1 writes a marker, then its guard fails: it is rolled back to its savepoint, and change 2,
    # next in the same transaction, runs once and finds no marker.
    _runs(pg, "r1")
    committed: list[itd.Effects] = []
    batches: list[int] = []
    store = await _store(pg, committed, batches)
    runs: list[str] = []

    def counts(tx, fx):
        runs.append("counts")
        n = _markers(tx)
        tx.append_event(fx, PB, "r1", "counted", START_MS, "tok_x", {"markers": n})
        return n

    try:
        got = await asyncio.gather(store.write(_end("r1")), store.write(_marked_then_guarded), store.write(counts),
                                   return_exceptions=True)
        assert batches == [3]
        assert got[0] == "r1"
        assert isinstance(got[1], itd.Problem) and got[1].name == "conflict"
        assert got[2] == 0 and runs == ["counts"]               # once, after change 1 was undone
        rows = await store.read(lambda tx: [(r[0], r[1], r[2]) for r in tx.conn.execute(
            "SELECT id, type, payload FROM events ORDER BY id").fetchall()])
        assert [t for _, t, _ in rows] == ["run_succeeded", "counted"]
        assert '"markers":0' in rows[1][2].replace(" ", "")
        # Only what committed is published, once, with the ids the table gave.
        assert [(e["id"], e["type"]) for fx in committed for e in fx.published] == [(i, t) for i, t, _ in rows]
    finally:
        await store.close()


# A change reads what the changes before it in its group commit wrote, and what other daemons
# committed before its transaction took the write lock.


def _open(tx, run_id: str) -> None:
    """An inbox request opened (and its run started and counted) in `tx`."""
    assert tx.insert_asking_run(playbook=PB, run_id=run_id, type_="interaction", name="approve", version=1,
                                input_text="{}", input_sha="x", parent=None, now=START_MS, by="tok_x",
                                limit=10) == (True, True)
    tx.open_request(request_id=f"int_{run_id}", playbook=PB, run_id=run_id, type_="interaction",
                    name="approve", version=1, party="ann", answerer="ann", message="ok?",
                    answer_schema='{"type":"object"}', server=None, tool=None,
                    delivery=itd.DeliveryState.IN_INBOX, asked_at=START_MS, expires_at=START_MS + 60_000,
                    deliver_args=None)


def _requests(url: str, *run_ids: str) -> None:
    with _playbook(url) as tx:
        for run_id in run_ids:
            _open(tx, run_id)


def _answers(run_id: str, runs: list[str]):
    def change(tx, fx):
        runs.append(run_id)
        row = tx.request(PB, run_id)
        if row["status"] != "open":
            raise itd.Problem("not_open", f"the request has ended ({row['status']})")
        tx.answer_request(fx, row, {"ok": run_id}, by="tok_x", now=START_MS + 2)
        return row["status"], row["message"]
    return change


async def test_a_request_closed_earlier_in_the_group_commit_refuses_its_answer_which_runs_once(pg):
    _requests(pg, "r1", "r2")
    committed: list[itd.Effects] = []
    batches: list[int] = []
    store = await _store(pg, committed, batches)
    runs: list[str] = []

    def expires(tx, fx):
        return tx.close_request(fx, PB, "r1", itd.ENDINGS["expired"])["status"]

    try:
        got = await asyncio.gather(store.write(expires),
                                   store.write(_answers("r1", runs)),
                                   store.write(_answers("r2", runs)),
                                   return_exceptions=True)
        assert batches == [3]
        assert got[0] == "expired"
        # r1's answer read the row as the expiry left it; r2's stood.
        assert isinstance(got[1], itd.Problem) and got[1].name == "not_open"
        assert got[2] == ("open", "ok?")
        assert runs == ["r1", "r2"]
        state = await store.read(lambda tx: {r: (tx.request(PB, r)["status"], tx.run(PB, r)["status"])
                                             for r in ("r1", "r2")})
        assert state == {"r1": ("expired", "waiting"), "r2": ("answered", "succeeded")}
        answered = [e["run_id"] for fx in committed for e in fx.published if e["type"] == "request_answered"]
        assert answered == ["r2"]
    finally:
        await store.close()


async def test_a_run_inserted_and_counted_says_so_once_each(pg):
    _requests(pg, "taken")
    store = await _store(pg, [], [])
    runs: list[str] = []

    def asks(run_id: str, limit: int):
        def change(tx, fx):
            runs.append(run_id)
            return tx.insert_asking_run(playbook=PB, run_id=run_id, type_="interaction", name="approve", version=1,
                                        input_text="{}", input_sha="x", parent=None, now=START_MS, by="tok_x",
                                        limit=limit)
        return change

    try:
        got = await asyncio.gather(store.write(asks("taken", 10)), store.write(asks("fresh", 10)),
                                   store.write(asks("full", 2)))
        assert got == [(False, False), (True, True), (True, False)]     # run id taken; new; no slot left
        assert runs == ["taken", "fresh", "full"]
        counted = await store.read(lambda tx: tx.conn.execute(
            "SELECT open_requests FROM playbooks WHERE id = ?", (PB,)).fetchone()[0])
        assert counted == 2
    finally:
        await store.close()


async def test_a_daemon_refreshes_its_tables_statistics_as_its_writes_grow_them(pg):
    # Statements are planned once from the statistics of the moment; a daemon on a new database
    # has them refreshed after its first PG_ANALYZE_FIRST changes rather than wait for autovacuum.
    import time

    _runs(pg)
    store = await _store(pg, [], [])

    def analyzed(tx) -> int:
        return tx.conn.execute("SELECT COALESCE(SUM(analyze_count), 0) FROM pg_stat_user_tables"
                               " WHERE relname = 'runs'").fetchone()[0]

    try:
        before = await store.read(analyzed)
        def twelve_runs(tx, fx, n: int) -> None:     # a table the size where a key's lookup and a scan differ
            for k in range(12):
                tx.insert_run(playbook=PB, run_id=f"r{n}.{k}", type_="interaction", name="approve", version=1,
                              input_text="{}", input_sha="x", parent=None, now=START_MS, by="tok_x")
        for n in range(itd.PG_ANALYZE_FIRST):
            await store.write(lambda tx, fx, n=n: twelve_runs(tx, fx, n))
        deadline = time.monotonic() + 30
        while await store.read(analyzed) == before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)          # the listener's thread runs it; the statistics reach the view within ~1 s
        assert await store.read(analyzed) > before

        def generic_plan(tx) -> str:           # as a prepared statement's plan is made past its fifth run
            c = tx.conn
            c.execute("SET plan_cache_mode = force_generic_plan")
            c.execute("PREPARE numbered (text, text) AS SELECT events FROM runs WHERE playbook = $1 AND run_id = $2")
            try:
                return "\n".join(r[0] for r in c.execute("EXPLAIN EXECUTE numbered ('local/default', 'r7.1')").fetchall())
            finally:
                c.execute("DEALLOCATE numbered")
                c.execute("RESET plan_cache_mode")
        assert "runs_playbook_run_id_key" in await store.read(generic_plan)
        # Analyzed and barely changed since: a refresh leaves it to autovacuum.
        counted = await store.read(analyzed)
        tx = itd.open_sync(pg)
        try:
            itd.PgDaemons(tx.conn).refresh_statistics()
        finally:
            tx.close()
        assert await store.read(analyzed) == counted
    finally:
        await store.close()


async def test_a_request_closed_by_another_daemon_while_the_writer_waits_for_the_lock_refuses_its_answer(pg):
    # The writer takes the database's write lock before any change runs; another daemon's write,
    # holding the lock meanwhile, closes the request: the answer reads it closed, once.
    import time

    import psycopg

    _requests(pg, "r1")
    committed: list[itd.Effects] = []
    store = await _store(pg, committed, [])
    runs: list[str] = []
    other = psycopg.connect(pg, autocommit=True)
    try:
        other.execute("BEGIN")
        other.execute("SELECT pg_advisory_xact_lock(%s)", (itd._PG_WRITE_LOCK,))
        answer = asyncio.ensure_future(store.write(_answers("r1", runs)))
        watch = psycopg.connect(pg, autocommit=True)
        deadline = time.monotonic() + 20
        while not watch.execute("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event = 'advisory'"
                                " AND application_name = 'interactiond')").fetchone()[0]:
            assert time.monotonic() < deadline, "the writer never waited for the lock"
            await asyncio.sleep(0.01)
        watch.close()
        assert runs == [] and not answer.done()         # nothing of the change ran before the lock
        other.execute("UPDATE requests SET status = 'expired', open = 0 WHERE run_id = 'r1'")
        other.execute("COMMIT")
        with pytest.raises(itd.Problem) as got:
            await asyncio.wait_for(answer, 30)
        assert got.value.name == "not_open" and runs == ["r1"]
        assert await store.read(lambda tx: tx.request(PB, "r1")["status"]) == "expired"
        assert [e for fx in committed for e in fx.published] == []
    finally:
        other.close()
        await store.close()


async def test_a_request_this_writer_opened_then_closed_elsewhere_refuses_its_answer(pg):
    # Another daemon (here, another connection) expires the request this writer opened: the answer
    # reads the request's real state, once.
    import psycopg

    _runs(pg)
    committed: list[itd.Effects] = []
    store = await _store(pg, committed, [])
    runs: list[str] = []
    other = psycopg.connect(pg, autocommit=True)
    try:
        await store.write(lambda tx, fx: _open(tx, "r1"))
        committed.clear()
        other.execute("UPDATE requests SET status = 'expired', open = 0 WHERE run_id = 'r1'")
        with pytest.raises(itd.Problem) as got:
            await store.write(_answers("r1", runs))
        assert got.value.name == "not_open" and runs == ["r1"]
        assert await store.read(lambda tx: (tx.request(PB, "r1")["status"], tx.run(PB, "r1")["status"])) == \
            ("expired", "waiting")
        assert [e for fx in committed for e in fx.published] == []
    finally:
        other.close()
        await store.close()


async def test_a_round_trip_larger_each_way_than_the_socket_holds_completes(pg):
    # A change sends many statements before it reads any result: when what is sent and what comes
    # back are both larger than the socket holds, the pipeline must read while it sends, or each
    # side waits for the other to read, for ever.
    _runs(pg)
    store = await _store(pg, [], [])
    sent = "x" * 1_000

    def echoes(tx, fx) -> int:
        results = []
        for i in range(3000):           # each read after all are sent: a cursor each (as a guard has)
            results.append(tx.conn.raw.cursor())
            results[-1].execute("SELECT repeat(CAST(%s AS TEXT), 2)", (f"{i:04}{sent}",))
        return sum(len(r.fetchone()[0]) for r in results)       # the first look sends them all, in one round trip

    try:
        assert await asyncio.wait_for(store.write(echoes), 30) == 3000 * 2 * len(f"0000{sent}")
    finally:
        await store.close()


async def test_a_daemon_alone_on_its_database_notifies_nobody_and_one_with_company_notifies_it(pg):
    import os
    import time

    import psycopg

    _runs(pg)
    store = await _store(pg, [], [])
    ear = psycopg.connect(pg, autocommit=True)
    ear.execute(f"LISTEN {itd.PG_CHANNEL}")

    def heard() -> list[str]:
        ear.execute("SELECT 1")                 # a round trip brings what was sent meanwhile
        return [n.payload for n in ear.notifies(timeout=0.2, stop_after=10)]

    def timer(key: str):
        return lambda tx, fx: tx.set_timer(fx, key, START_MS)

    try:
        await store.write(timer("expire:local/default:r1"))
        assert heard() == []                    # nobody else entered: nothing sent
        other = itd.open_sync(pg)
        try:
            itd.PgDaemons(other.conn).register_daemon("dmn_other", "elsewhere", os.getpid())
        finally:
            other.close()
        await store.write(timer("expire:local/default:r2"))
        deadline = time.monotonic() + 10
        got: list[str] = []
        while not got and time.monotonic() < deadline:
            got = heard()
        assert len(got) == 1 and "expire:local/default:r2" in got[0] and store.daemon_id in got[0]
    finally:
        ear.close()
        await store.close()


async def test_a_table_held_locked_elsewhere_is_skipped_by_the_statistics_not_waited_for(pg):
    # The listener's thread refreshes them, and it also beats the daemon's heartbeat: a VACUUM FULL
    # or another daemon's ANALYZE holding a table must not stop it.
    import psycopg

    _runs(pg)
    holder = psycopg.connect(pg, autocommit=True)
    tx = itd.open_sync(pg)

    def analyzed(table: str) -> int:
        return holder.execute("SELECT COALESCE(SUM(analyze_count), 0) FROM pg_stat_user_tables WHERE relname = %s",
                              (table,)).fetchone()[0]

    try:
        before = {t: analyzed(t) for t in ("runs", "requests")}
        holder.execute("BEGIN")
        holder.execute("LOCK TABLE runs IN SHARE UPDATE EXCLUSIVE MODE")
        statistics = itd.PgDaemons(tx.conn).refresh_statistics
        await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, statistics), 20)
        holder.execute("COMMIT")
        assert analyzed("runs") == before["runs"] and analyzed("requests") > before["requests"]
    finally:
        holder.close()
        tx.close()
