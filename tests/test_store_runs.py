"""The store's operations on definitions, runs and requests, on a real SQLite file: each state change is
guarded by the states it may leave, and a move the transition tables refuse changes nothing."""
from __future__ import annotations

import pytest

import interactiond as itd

PB = "local/default"
NOW = 1_767_225_600_000


@pytest.fixture
def tx(tmp_path):
    tx = itd.open_sync(str(tmp_path / "store.db"))
    tx.ensure_playbook(PB, now=NOW)
    yield tx
    tx.close()


def _run_with_request(tx, run_id: str, *, deliver: bool = False, notified: bool = False) -> None:
    tx.insert_run(playbook=PB, run_id=run_id, type_="interaction", name="approve", version=1, input_text="{}",
                  input_sha="x", parent=None, now=NOW, by="tok_1")
    if not notified:
        assert tx.take_request_slot(PB, 10)
    tx.open_request(request_id=f"int_{run_id}", playbook=PB, run_id=run_id, type_="interaction", name="approve",
                    version=1, party="ann", answerer="ann", message="ok?",
                    answer_schema=None if notified else '{"type":"object"}',
                    server="chat" if deliver else None, tool="send" if deliver else None,
                    delivery=itd.DeliveryState.TO_DELIVER if deliver else itd.DeliveryState.IN_INBOX,
                    asked_at=NOW, expires_at=NOW + 60_000, deliver_args="{}" if deliver else None, notified=notified)
    fx = itd.Effects()
    tx.set_timer(fx, itd.timer_key("expire", PB, run_id), NOW + 60_000)


def _open_count(tx) -> int:
    return tx.conn.execute("SELECT open_requests FROM playbooks WHERE id = ?", (PB,)).fetchone()[0]


def test_a_request_closes_once(tx):
    _run_with_request(tx, "r1")
    assert tx.run(PB, "r1")["status"] == "waiting" and _open_count(tx) == 1
    fx = itd.Effects()
    closed = tx.close_request(fx, PB, "r1", itd.ENDINGS["expired"])
    assert closed["status"] == "expired" and closed["open"] == 0
    assert _open_count(tx) == 0
    assert tx.conn.execute("SELECT COUNT(*) FROM timers").fetchone()[0] == 0
    assert (itd.timer_key("expire", PB, "r1"), None) in fx.timers
    # A closed request leaves no state a closing may leave: nothing moves, the counter stays.
    for name in ("answered", "cancelled", "expired"):
        assert tx.close_request(itd.Effects(), PB, "r1", itd.ENDINGS[name]) is None
    assert tx.conn.execute("SELECT status FROM requests WHERE run_id = 'r1'").fetchone()[0] == "expired"
    assert _open_count(tx) == 0
    assert tx.close_request(itd.Effects(), PB, "no-such-run", itd.ENDINGS["cancelled"]) is None


def test_a_notification_for_the_inbox_is_notified_at_once_and_leaves_the_run_started(tx):
    _run_with_request(tx, "n1", notified=True)
    req = tx.conn.execute("SELECT status, open FROM requests WHERE run_id = 'n1'").fetchone()
    assert (req["status"], req["open"]) == ("notified", 0)
    assert tx.run(PB, "n1")["status"] == "started"
    assert tx.close_request(itd.Effects(), PB, "n1", itd.ENDINGS["cancelled"]) is None


def test_a_request_opens_only_for_a_started_run(tx):
    _run_with_request(tx, "r1")
    tx.end_run(itd.Effects(), PB, "r1", itd.RunStatus.REJECTED, now=NOW, by="tok_1", kind="cancelled")
    tx.conn.execute("DELETE FROM requests WHERE run_id = 'r1'")
    with pytest.raises(itd.Problem) as info:
        tx.open_request(request_id="int_again", playbook=PB, run_id="r1", type_="interaction", name="approve",
                        version=1, party="ann", answerer="ann", message="ok?", answer_schema="{}", server=None,
                        tool=None, delivery=itd.DeliveryState.IN_INBOX, asked_at=NOW, expires_at=NOW + 1,
                        deliver_args=None)
    assert info.value.name == "conflict"
    assert tx.run(PB, "r1")["status"] == "rejected"


def test_cancel_moves_only_an_attempt_in_flight(tx):
    _run_with_request(tx, "d1", deliver=True)
    assert not tx.cancel_delivery(PB, "d1")                       # to_deliver: nothing in flight
    tx.conn.execute("UPDATE requests SET delivery_state = 'delivering' WHERE run_id = 'd1'")
    assert tx.cancel_delivery(PB, "d1")
    assert tx.conn.execute("SELECT delivery_state FROM requests WHERE run_id = 'd1'").fetchone()[0] == "cancelling"
    assert not tx.cancel_delivery(PB, "d1")                       # cancelling moves no more
    assert not tx.cancel_delivery(PB, "no-such-run")


def test_request_slots_stop_at_the_limit(tx):
    assert tx.take_request_slot(PB, 2) and tx.take_request_slot(PB, 2)
    assert not tx.take_request_slot(PB, 2)
    assert _open_count(tx) == 2
    tx.recount_open_requests()                                    # the counter is a cache of requests.open
    assert _open_count(tx) == 0


def test_a_definition_keeps_its_version_for_the_same_text(tx):
    save = dict(playbook=PB, type_="interaction", name="approve", overview="o", description=None, uses=[],
                now=NOW, by="tok_1")
    assert tx.save_definition(source="a", sha="sha-a", **save) == (1, True)
    assert tx.save_definition(source="a", sha="sha-a", **save) == (1, False)
    assert tx.save_definition(source="b", sha="sha-b", **save) == (2, True)
    assert tx.definition(PB, "interaction", "approve")["version"] == 2
    assert not tx.definition(PB, "interaction", "approve", 1)["active"]
    assert tx.deactivate_definition(PB, "interaction", "approve")
    assert not tx.deactivate_definition(PB, "interaction", "approve")
    assert tx.definition(PB, "interaction", "approve") is None
    assert tx.save_definition(source="b", sha="sha-b", **save) == (3, True)   # deleted: saved again, anew
    assert [r["version"] for r in tx.list_definitions(PB)] == [3]


def test_runs_are_listed_newest_first_and_paged_by_seq(tx):
    for i in range(3):
        tx.insert_run(playbook=PB, run_id=f"r{i}", type_="interaction", name="approve", version=1, input_text="{}",
                      input_sha="x", parent=None, now=NOW, by="tok_1", tools_called=i == 1)
    rows = tx.list_runs(PB, status=None, function=None, before=None, limit=2)
    assert [r["run_id"] for r in rows] == ["r2", "r1"]
    assert [r["run_id"] for r in tx.list_runs(PB, status="started", function="approve", before=rows[-1]["seq"],
                                               limit=2)] == ["r0"]
    assert tx.run(PB, "r1")["tools_called"] == 1 and tx.run(PB, "r0")["tools_called"] == 0
    assert tx.run(PB, "r9") is None
