"""The store's contract, run on every backend (an SQLite file and a fresh PostgreSQL database, by
the `db` fixture): each operation does the same on both; each state change is guarded by the
states it may leave, and a move the transition tables refuse writes nothing and says so."""
from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import pytest

import interactiond as itd
from interactiond import RunStatus as S

PB = "local/default"
NOW = 1_767_225_600_000
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def tx(db):
    tx = itd.open_sync(db)
    tx.ensure_playbook(PB, now=NOW)
    yield tx
    tx.close()


# Definitions, runs and requests.


def _run_with_request(tx, run_id: str, *, deliver: bool = False, notified: bool = False) -> None:
    tx.insert_run(playbook=PB, run_id=run_id, type_="interaction", name="approve", version=1, input_text="{}",
                  input_sha="x", parent=None, now=NOW, by="tok_1")
    if not notified:
        assert tx.take_request_slot(PB, 10)
    seq = tx.open_request(request_id=f"int_{run_id}", playbook=PB, run_id=run_id, type_="interaction",
                          name="approve", version=1, party="ann", answerer="ann", message="ok?",
                          answer_schema=None if notified else '{"type":"object"}',
                          server="chat" if deliver else None, tool="send" if deliver else None,
                          delivery=itd.DeliveryState.TO_DELIVER if deliver else itd.DeliveryState.IN_INBOX,
                          asked_at=NOW, expires_at=NOW + 60_000, deliver_args="{}" if deliver else None,
                          notified=notified)
    fx = itd.Effects()
    # as the engine does next: run_seq as the run's waiting counted it (None: the event counts itself)
    tx.append_event(fx, PB, run_id, "interaction_requested", NOW, "tok_1", {}, run_seq=seq)
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


# Workflows, tokens and sessions.


def _workflow(tx, run_id, parent=None, state='{"stack": []}'):
    return tx.insert_run(playbook=PB, run_id=run_id, type_="workflow", name="flow", version=1, input_text="{}",
                                  input_sha="sha", parent=parent, state=state, now=1, by="tok_x")


def _end(tx, run_id):
    tx.end_run(itd.Effects(), PB, run_id, S.REJECTED, now=2, by="tok_x", kind="cancelled",
               problem=itd.ending_problem(S.REJECTED, "cancelled", "cancelled"))


def test_a_workflow_run_is_inserted_once(tx):
    assert _workflow(tx, "r1") is True
    assert _workflow(tx, "r1", state='{"other": 1}') is False        # taken: nothing written
    row = tx.run(PB, "r1")
    assert (row["type"], row["status"], row["state"]) == ("workflow", "started", '{"stack": []}')
    assert tx.run(PB, "nope") is None


def test_run_depth_counts_the_chain_of_parents(tx):
    _workflow(tx, "a")
    _workflow(tx, "b", parent="a")
    _workflow(tx, "c", parent="b")
    assert [tx.run_depth(PB, r) for r in ("a", "b", "c")] == [1, 2, 3]


def test_a_step_is_guarded_by_the_state_it_read(tx):
    _workflow(tx, "r1", state="s0")
    assert tx.step_workflow(PB, "r1", read="s0", state="s1", status=S.WAITING) is True
    assert (tx.run(PB, "r1")["state"], tx.run(PB, "r1")["status"]) == ("s1", "waiting")
    # A second step computed from the old state moved nothing.
    assert tx.step_workflow(PB, "r1", read="s0", state="s2", status=S.STARTED) is False
    assert tx.run(PB, "r1")["state"] == "s1"
    # An ended run takes no step, even from the state it holds.
    _end(tx, "r1")
    assert tx.step_workflow(PB, "r1", read="s1", state="s3", status=S.STARTED) is False
    assert tx.run(PB, "r1")["state"] == "s1"


def test_a_step_that_saw_its_child_live_wants_it_live_still(tx):
    _workflow(tx, "parent", state="s0")
    _workflow(tx, "child", parent="parent")
    assert tx.step_workflow(PB, "parent", read="s0", state="s1", status=S.WAITING, live_child="child") is True
    _end(tx, "child")
    assert tx.step_workflow(PB, "parent", read="s1", state="s2", status=S.WAITING, live_child="child") is False
    assert tx.run(PB, "parent")["state"] == "s1"
    assert tx.step_workflow(PB, "parent", read="s1", state="s2", status=S.STARTED) is True


def test_only_a_live_workflow_or_request_child_is_cancelled(tx):
    _workflow(tx, "wf")
    assert tx.child_to_cancel(PB, "wf")["run_id"] == "wf"
    # A run without a request (a system call in flight) ends alone.
    tx.conn.execute("INSERT INTO runs (playbook, run_id, type, name, version, input, input_sha, status, created_at,"
               " created_by) VALUES (?, 'sys', 'interaction', 'call', 1, '{}', 'sha', 'started', 1, 'tok_x')", (PB,))
    assert tx.child_to_cancel(PB, "sys") is None
    _end(tx, "wf")
    assert tx.child_to_cancel(PB, "wf") is None
    assert tx.child_to_cancel(PB, "missing") is None


def test_a_login_link_is_spent_once_and_a_session_ends_once(tx):
    _, link = itd.create_token(tx, "writer", PB, "inbox login", purpose="login", now=10)
    digest = itd.sha256_hex(link)
    assert tx.token_known(digest) and tx.caller_token(digest) is None     # a link is no caller
    row = tx.spend_login(digest, 20)
    assert (row["role"], row["playbook"]) == ("writer", PB)
    assert tx.spend_login(digest, 30) is None and not tx.token_known(digest)
    _, session = itd.create_token(tx, "writer", PB, "inbox session", purpose="session", now=20)
    sdigest = itd.sha256_hex(session)
    assert tx.caller_token(sdigest)["used_at"] == 20
    assert tx.touch_session(tx.caller_token(sdigest)["id"], 80) is True
    assert tx.touch_session(tx.caller_token(sdigest)["id"], 50) is False    # an earlier use never goes back
    assert tx.caller_token(sdigest)["used_at"] == 80
    assert tx.end_session(sdigest, 90) is True
    assert tx.end_session(sdigest, 95) is False and tx.caller_token(sdigest) is None


def test_tokens_are_revoked_once_and_login_links_all_together(tx):
    token_id, secret = itd.create_token(tx, "reader", PB, "ci", now=1)
    _, l1 = itd.create_token(tx, "operator", None, "inbox login", purpose="login", now=2)
    _, l2 = itd.create_token(tx, "operator", None, "inbox login", purpose="login", now=3)
    assert [r["id"] for r in tx.listed_tokens()] == [token_id]             # login links are not listed
    assert tx.revoke_logins(4) == 2 and tx.revoke_logins(5) == 0
    assert not tx.token_known(itd.sha256_hex(l1)) and not tx.token_known(itd.sha256_hex(l2))
    assert tx.revoke_token(token_id, 6) is True
    assert tx.revoke_token(token_id, 7) is False
    assert tx.listed_tokens()[0]["revoked_at"] == 6 and not tx.token_known(itd.sha256_hex(secret))


# Events, timers, readings and the rest of the operations, on each backend.


def test_events_take_increasing_ids_and_a_gap_free_run_seq(tx):
    _workflow(tx, "r1")
    fx = itd.Effects()
    ids = [tx.append_event(fx, PB, "r1", "step", NOW + i, "tok_x", {"i": i}) for i in range(3)]
    own = tx.append_event(fx, PB, None, "definition_saved", NOW, "tok_x", {"name": "x"})
    assert ids == sorted(ids) and own > ids[-1] and tx.last_event_id() == own
    assert [e["id"] for e in fx.published] == [*ids, own] and fx.published[0]["payload"] == {"i": 0}
    rows = tx.run_events(PB, "r1", after=0, limit=10)
    assert [(r["run_seq"], r["type"]) for r in rows] == [(1, "step"), (2, "step"), (3, "step")]
    assert tx.run(PB, "r1")["events"] == 3
    _end(tx, "r1")                                # the ending counts its own run_seq
    assert tx.run_events(PB, "r1", after=ids[-1], limit=10)[-1]["run_seq"] == 4
    assert [r["id"] for r in tx.run_events(PB, "r1", after=ids[0], limit=1)] == [ids[1]]
    assert [r["id"] for r in tx.playbook_events(PB, type_=None, after=0, limit=10)] == [own]
    assert tx.playbook_events(PB, type_="other", after=0, limit=10) == []
    after = tx.events_after(ids[0], types=["step", "definition_saved"], playbooks=[PB], limit=10)
    assert [r["id"] for r in after] == [ids[1], ids[2], own]
    assert tx.event(PB, own)["payload"] == '{"name":"x"}' and tx.event("acme/other", own) is None


def test_a_timer_is_set_moved_taken_once_and_dropped(tx):
    fx = itd.Effects()
    tx.set_timer(fx, "expire:x:r1", NOW + 10)
    tx.set_timer(fx, "expire:x:r1", NOW + 20)                 # set again: moved, not doubled
    tx.set_timer(fx, "attempt:x:r2", NOW + 5)
    assert tx.timer_due("expire:x:r1") == NOW + 20 and tx.timer_due("nope") is None
    assert sorted(tx.all_timers()) == [("attempt:x:r2", NOW + 5), ("expire:x:r1", NOW + 20)]
    assert not tx.take_timer(fx, "expire:x:r1", NOW + 19)     # not due yet
    assert tx.take_timer(fx, "expire:x:r1", NOW + 20)
    assert not tx.take_timer(fx, "expire:x:r1", NOW + 99)     # once
    tx.drop_timer(fx, "attempt:x:r2")
    assert tx.all_timers() == []
    assert fx.timers[-1] == ("attempt:x:r2", None) and ("expire:x:r1", NOW + 20) in fx.timers


def test_a_reading_is_shared_keeps_the_longest_wait_and_sees_a_reply_once(tx):
    _run_with_request(tx, "d1", deliver=True)
    _run_with_request(tx, "d2", deliver=True)
    seq1, seq2 = tx.request(PB, "d1")["seq"], tx.request(PB, "d2")["seq"]
    first = tx.join_reading(seq1, playbook=PB, server="chat", tool="read", conversation="c1", wait_ms=3000)
    assert tx.count_read(first["id"])["reads"] == 1
    again = tx.join_reading(seq2, playbook=PB, server="chat", tool="read", conversation="c1", wait_ms=1000)
    assert again["id"] == first["id"] and again["wait_ms"] == 3000     # the longer wait stays
    assert tx.reading(first["id"])["reads"] == 0                       # a join restarts the gaps
    assert tx.join_reading(seq2, playbook=PB, server="chat", tool="read", conversation="c1",
                           wait_ms=9000)["wait_ms"] == 9000
    assert [r["run_id"] for r in tx.reading_requests(first["id"])] == ["d1", "d2"]
    assert tx.see_reply(first["id"], "m1") and not tx.see_reply(first["id"], "m1")
    tx.read_up_to(first["id"], "m1")
    assert tx.reading(first["id"])["since"] == "m1" and tx.reading_waited_on(first["id"])
    assert tx.sent_ids(first["id"]) == []
    for run_id in ("d1", "d2"):
        tx.close_request(itd.Effects(), PB, run_id, itd.ENDINGS["cancelled"])
    assert not tx.reading_waited_on(first["id"])


def test_an_attempt_begins_ends_and_fails_guarded_by_its_number(tx):
    _run_with_request(tx, "d1", deliver=True)
    row = tx.begin_attempt(PB, "d1", now=NOW)
    assert (row["delivery_state"], row["attempts"], row["attempt_started_at"]) == ("delivering", 1, NOW)
    assert tx.begin_attempt(PB, "d1", now=NOW) is None                 # one in flight at a time
    assert not tx.end_attempt(row["seq"], 2, itd.DeliveryState.DELIVERED, sent_id="s")   # not that attempt
    assert tx.fail_attempt(row["seq"], spent=False)
    assert tx.request_by_seq(row["seq"])["delivery_state"] == "retrying"
    row = tx.begin_attempt(PB, "d1", now=NOW + 1)
    assert tx.end_attempt(row["seq"], 2, itd.DeliveryState.DELIVERED, sent_conversation="c", sent_id="s",
                          conversation="c")
    assert tx.request(PB, "d1")["delivery_state"] == "delivered" and not tx.fail_attempt(row["seq"], spent=True)


def test_an_answer_is_recorded_once_on_an_open_request(tx):
    _run_with_request(tx, "r1")
    req = tx.request(PB, "r1")
    fx = itd.Effects()
    tx.record_answer(fx, req, {"verdict": "approve"}, by="tok_1", now=NOW + 5, reply_id="m9")
    row = tx.request(PB, "r1")
    assert (row["answer"], row["answered_by"], row["reply_id"]) == ('{"verdict":"approve"}', "tok_1", "m9")
    assert tx.event(PB, row["answer_id"])["type"] == "request_answered"
    assert [v["run_id"] for v in tx.interactions([PB], ["open"], run_id=None, before=None, limit=5)] == ["r1"]
    tx.close_request(fx, PB, "r1", itd.ENDINGS["answered"])
    with pytest.raises(itd.Problem) as info:
        tx.record_answer(itd.Effects(), req, {"verdict": "revise"}, by="tok_2", now=NOW + 6)
    assert info.value.name == "not_open"
    assert tx.interactions([PB], ["open"], run_id=None, before=None, limit=5) == []
    v2 = tx.interaction(req["id"])
    assert v2["status"] == "answered" and v2["run_input"] == "{}"


def test_an_answer_is_recorded_its_request_closed_and_its_run_ended_together_once(tx):
    import json

    _run_with_request(tx, "r1")
    fx = itd.Effects()
    closed = tx.answer_request(fx, tx.request(PB, "r1"), {"verdict": "approve"}, by="tok_1", now=NOW + 5,
                       claimed_for="bo", reply_id="m9")
    assert (closed["status"], closed["open"], closed["answered_by"], closed["answered_at"], closed["claimed_for"],
            closed["reply_id"], json.loads(closed["answer"])) == ("answered", 0, "tok_1", NOW + 5, "bo", "m9",
                                                                  {"verdict": "approve"})
    assert dict(closed) == dict(tx.request(PB, "r1"))
    run = tx.run(PB, "r1")
    assert (run["status"], run["kind"], json.loads(run["output"]), run["ended_at"], run["settled_by"], run["events"]) \
        == ("succeeded", None, {"verdict": "approve"}, NOW + 5, "tok_1", 3)     # interaction_requested's seq is 1
    events = tx.run_events(PB, "r1", after=1, limit=10)     # after interaction_requested
    assert [(e["type"], e["run_seq"], e["by"]) for e in events] == [("request_answered", 2, "tok_1"),
                                                                    ("run_succeeded", 3, "tok_1")]
    assert events[0]["id"] < events[1]["id"] and closed["answer_id"] == events[0]["id"]
    assert json.loads(events[0]["payload"]) == {"answer": {"verdict": "approve"}, "claimed_for": "bo",
                                                "reply": {"id": "m9"}, "digest": closed["digest"]}
    assert json.loads(events[1]["payload"]) == {"status": "succeeded", "kind": None, "output": {"verdict": "approve"}}
    assert [(e["id"], e["type"], e["by"], e["payload"]) for e in fx.published] == \
        [(e["id"], e["type"], e["by"], json.loads(e["payload"])) for e in events]
    # An inbox request with no reminders has its expiry only: that is the timer that goes.
    assert fx.timers == [(itd.timer_key("expire", PB, "r1"), None)]
    assert fx.wakes == [(PB, "r1")] and _open_count(tx) == 0 and tx.all_timers() == []
    with pytest.raises(itd.Problem) as info:                    # once
        tx.answer_request(itd.Effects(), closed, {"verdict": "revise"}, by="tok_2", now=NOW + 6)
    assert info.value.name == "conflict"                       # the run ended: its change rolls back what it wrote

    # Not while an attempt in flight is being cancelled; a workflow's child wakes its parent.
    _run_with_request(tx, "r2", deliver=True)
    assert tx.begin_attempt(PB, "r2", now=NOW) is not None and tx.cancel_delivery(PB, "r2")
    with pytest.raises(itd.Problem) as info:
        tx.answer_request(itd.Effects(), tx.request(PB, "r2"), {}, by="tok_1", now=NOW)
    assert info.value.name == "not_open"                       # (the change that tried it rolls back)
    tx.conn.execute("UPDATE runs SET parent = 'wf-1' WHERE run_id = 'r1'")
    _run_with_request(tx, "r3")
    tx.conn.execute("UPDATE runs SET parent = 'wf-1' WHERE run_id = 'r3'")
    fx = itd.Effects()
    tx.answer_request(fx, tx.request(PB, "r3"), {}, by="tok_1", now=NOW + 7)
    assert (itd.timer_key("workflow", PB, "wf-1"), NOW + 7) in fx.timers
    # A run that ended while its request stood open (it cannot, but the guard holds): conflict.
    _run_with_request(tx, "r4")
    tx.conn.execute("UPDATE runs SET status = 'rejected' WHERE run_id = 'r4'")
    with pytest.raises(itd.Problem) as info:
        tx.answer_request(itd.Effects(), tx.request(PB, "r4"), {}, by="tok_1", now=NOW)
    assert info.value.name == "conflict"


def test_an_answer_keeps_who_gave_it_in_words_beside_answered_by(tx):
    import json

    _run_with_request(tx, "r1")
    fx = itd.Effects()
    closed = tx.answer_request(fx, tx.request(PB, "r1"), {"verdict": "approve"}, by="tok_1", now=NOW + 5,
                               by_name="release bot")
    row = tx.request(PB, "r1")
    assert (closed["answered_by"], closed["answered_by_name"]) == ("tok_1", "release bot")
    assert dict(closed) == dict(row)
    fact = itd.answer_fact(row)
    assert (fact["answered_by"], fact["answered_by_name"], fact["answered_at"]) == ("tok_1", "release bot",
                                                                                    itd.fmt_time(NOW + 5))
    answered = tx.run_events(PB, "r1", after=1, limit=10)[0]
    assert json.loads(answered["payload"])["answered_by_name"] == "release bot" and answered["by"] == "tok_1"
    assert tx.run(PB, "r1")["settled_by"] == "tok_1"
    # record_answer (an approval's answer) keeps it too; a reply's sender is its name.
    _run_with_request(tx, "r2")
    tx.record_answer(itd.Effects(), tx.request(PB, "r2"), {"verdict": "approve"}, by="playbook:local/default",
                     now=NOW + 6, reply_id="m1", reply_sender="ann", by_name="ann")
    row = tx.request(PB, "r2")
    assert (row["answered_by"], row["answered_by_name"], row["reply_sender"]) == ("playbook:local/default", "ann", "ann")
    assert json.loads(tx.event(PB, row["answer_id"])["payload"])["answered_by_name"] == "ann"
    # Without a name: NULL, and the fact says null.
    _run_with_request(tx, "r3")
    closed = tx.answer_request(itd.Effects(), tx.request(PB, "r3"), {}, by="stdio", now=NOW + 7)
    assert closed["answered_by_name"] is None and itd.answer_fact(tx.request(PB, "r3"))["answered_by_name"] is None
    assert "answered_by_name" not in json.loads(tx.event(PB, closed["answer_id"])["payload"])


def _open(tx, run_id: str, **kw) -> None:
    tx.open_request(request_id=f"int_{run_id}", playbook=PB, run_id=run_id, type_="interaction", name="approve",
                    version=1, party="ann", answerer="ann", message="ok?", answer_schema='{"type":"object"}',
                    server=None, tool=None, delivery=itd.DeliveryState.IN_INBOX, asked_at=NOW, expires_at=NOW + 60_000,
                    deliver_args=None, **kw)


def test_listings_sort_as_sqlite_does(tx):
    save = dict(playbook=PB, type_="interaction", overview="o", uses=[], now=NOW, by="tok_1")
    for name in ("b-x", "a_y", "B", "ab"):
        tx.save_definition(name=name, source=name, sha=name, description=f"{name} 1", **save)
    tx.save_definition(name="ab", source="ab2", sha="ab2", description="ab 2", **save)
    listed = [(r["name"], r["version"], r["description"]) for r in tx.list_definitions(PB, "interaction")]
    assert listed == [("B", 1, "B 1"), ("a_y", 1, "a_y 1"), ("ab", 2, "ab 2"), ("b-x", 1, "b-x 1")]
    assert tx.list_definitions(PB, "workflow") == [] and len(tx.list_definitions(PB)) == 4
    assert tx.defined_names(PB) == {("interaction", n) for n in ("b-x", "a_y", "B", "ab")}
    assert tx.definition_source(PB, "interaction", "ab", 1) == "ab"
    for party in ("bob", "Ann", "ann"):
        _run_with_request(tx, f"r-{party}")
        tx.conn.execute("UPDATE requests SET party = ? WHERE run_id = ?", (party, f"r-{party}"))
    assert [(r["party"], r["n"]) for r in tx.open_counts_by_party(PB)] == [("Ann", 1), ("ann", 1), ("bob", 1)]


def test_workflows_calling_a_definition_are_found_by_their_uses(tx):
    save = dict(playbook=PB, type_="workflow", overview="o", description=None, now=NOW, by="tok_1")
    tx.save_definition(name="flow-b", source="b", sha="b", uses=[["interaction", "approve"]], **save)
    tx.save_definition(name="flow-a", source="a", sha="a", uses=[["workflow", "x"], ["interaction", "approve"]],
                       **save)
    tx.save_definition(name="flow-c", source="c", sha="c", uses=[["workflow", "approve"]], **save)
    assert [(r["name"], r["version"]) for r in tx.workflows_calling(PB, "interaction", "approve")] == [
        ("flow-a", 1), ("flow-b", 1)]
    tx.deactivate_definition(PB, "workflow", "flow-a")
    assert [r["name"] for r in tx.workflows_calling(PB, "interaction", "approve")] == ["flow-b"]


def test_prune_drops_old_keys_and_ended_sessions(tx):
    keep = int(itd.IDEMPOTENCY_KEEP.total_seconds() * 1000)
    tx.remember_response(caller="tok_1", key="k1", body_sha="s", response={"ok": 1}, now=NOW)
    tx.remember_response(caller="tok_1", key="k2", body_sha="s", response={"ok": 2}, now=NOW + keep)
    _, session = itd.create_token(tx, "writer", PB, "inbox session", purpose="session", now=NOW)
    assert tx.idempotent_response("tok_1", "k1")["response"] == '{"ok":1}'
    assert tx.prune(now=NOW + keep) == (1, 1)                  # the session was idle past 12 h
    assert tx.idempotent_response("tok_1", "k1") is None and tx.idempotent_response("tok_1", "k2")
    assert tx.caller_token(itd.sha256_hex(session)) is None


def test_an_event_of_a_run_that_does_not_exist_is_not_found_and_writes_nothing(tx):
    with pytest.raises(itd.Problem) as info:
        tx.append_event(itd.Effects(), PB, "nope", "marker", NOW, "tok_1", {})
    assert info.value.name == "not_found"
    assert tx.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 0


def test_the_backends_are_siblings_sharing_their_sql_through_a_dialect():
    assert issubclass(itd.SQLiteTx, itd.SqlTx) and issubclass(itd.PostgresTx, itd.SqlTx)
    assert not issubclass(itd.PostgresTx, itd.SQLiteTx)
    assert (itd.SQLiteTx.dialect, itd.PostgresTx.dialect) == (itd.SQLITE_DIALECT, itd.POSTGRES_DIALECT)
    # The daemons of a shared database are an object of their own, which a file does not carry.
    for op in ("register_daemon", "beat", "reap_daemons", "leave", "live_daemons", "refresh_statistics"):
        assert hasattr(itd.PgDaemons, op) and not hasattr(itd.SqlTx, op) and not hasattr(itd.PostgresTx, op)


def test_rows_are_read_by_name_and_by_index(tx):
    _workflow(tx, "r1")
    row = tx.run(PB, "r1")
    assert row["run_id"] == row[list(row.keys()).index("run_id")] == "r1"
    assert dict(row)["status"] == "started" and len(dict(row)) == len(row.keys())
    assert tx.conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 1


# The store's threads: group commit, effects after the commit, failures.


async def test_a_failing_change_rolls_back_alone_and_effects_follow_the_commit(db):
    store = itd.Store(db)
    assert isinstance(store, itd.PostgresStore) == itd.is_postgres_url(db)
    seen: list[itd.Effects] = []
    store.on_commit = seen.append
    await store.open()
    try:
        await store.write(lambda tx, fx: tx.ensure_playbook(PB, now=NOW))

        def good(name):
            def change(tx, fx):
                tx.set_timer(fx, f"expire:{PB}:{name}", NOW)
                return name
            return change

        def bad(tx, fx):
            tx.set_timer(fx, f"expire:{PB}:bad", NOW)
            tx.conn.execute("INSERT INTO playbooks (id, created_at) VALUES (?, 0)", (PB,))   # taken: fails

        results = await asyncio.gather(store.write(good("a")), store.write(bad), store.write(good("b")),
                                       return_exceptions=True)
        assert results[0] == "a" and results[2] == "b" and isinstance(results[1], Exception)
        keys = await store.read(lambda tx: sorted(k for k, _ in tx.all_timers()))
        assert keys == [f"expire:{PB}:a", f"expire:{PB}:b"]
        assert [fx.timers for fx in seen[-2:]] == [[(f"expire:{PB}:a", NOW)], [(f"expire:{PB}:b", NOW)]]
        with pytest.raises(itd.Problem) as info:                # a Problem raised in a change comes back as it is
            await store.write(lambda tx, fx: tx.end_run(fx, PB, "nope", S.SUCCEEDED, now=NOW, by="x"))
        assert info.value.name == "conflict"
    finally:
        await store.close()


async def test_a_file_commits_a_turns_changes_on_the_loop_and_a_failing_one_alone(tmp_path):
    """On a file, with the write lock free and the writer thread idle, a turn's changes run and commit
    on the event loop's thread, one transaction; a change that raises having written part of itself
    is undone back to its savepoint and fails alone, the others run once and commit, and each
    change's effects follow the commit."""
    store = itd.Store(str(tmp_path / "t.db"))
    seen: list[itd.Effects] = []
    store.on_commit = seen.append
    await store.open()
    try:
        await store.write(lambda tx, fx: tx.ensure_playbook(PB, now=NOW))
        threads: list[threading.Thread] = []

        ran: list[str] = []

        def good(name):
            def change(tx, fx):
                threads.append(threading.current_thread())
                ran.append(name)
                tx.set_timer(fx, f"expire:{PB}:{name}", NOW)
                return name
            return change

        def bad(tx, fx):
            threads.append(threading.current_thread())
            ran.append("bad")
            tx.set_timer(fx, f"expire:{PB}:bad", NOW)
            tx.conn.execute("INSERT INTO playbooks (id, created_at) VALUES (?, 0)", (PB,))   # taken: fails

        results = await asyncio.gather(store.write(good("a")), store.write(bad), store.write(good("b")),
                                       return_exceptions=True)
        assert results[0] == "a" and results[2] == "b" and isinstance(results[1], itd.Problem | Exception)
        assert ran == ["a", "bad", "b"]                 # its timer written, `bad` failed: each ran once
        assert threads == [threading.main_thread()] * 3
        keys = await store.read(lambda tx: sorted(k for k, _ in tx.all_timers()))
        assert keys == [f"expire:{PB}:a", f"expire:{PB}:b"]
        assert [fx.timers for fx in seen[-2:]] == [[(f"expire:{PB}:a", NOW)], [(f"expire:{PB}:b", NOW)]]
        with pytest.raises(itd.Problem) as info:                # alone in its transaction: rolled back whole
            await store.write(lambda tx, fx: (tx.set_timer(fx, f"expire:{PB}:c", NOW),
                                              tx.end_run(fx, PB, "nope", S.SUCCEEDED, now=NOW, by="x")))
        assert info.value.name == "conflict"
        assert await store.read(lambda tx: tx.timer_due(f"expire:{PB}:c")) is None
        assert await store.write(lambda tx, fx: tx.conn.in_transaction) is True
        assert not store._writer.conn.in_transaction
    finally:
        await store.close()


async def test_a_change_that_fails_having_written_nothing_leaves_the_others_to_commit_as_they_ran(db):
    """A change that raises, before it writes or having written, is undone back to its own savepoint
    and fails alone: the changes around it in its group commit run once and commit, whatever the
    backend."""
    store = itd.Store(db)
    await store.open()
    try:
        await store.write(lambda tx, fx: tx.ensure_playbook(PB, now=NOW))
        ran: list[str] = []

        def good(name):
            def change(tx, fx):
                ran.append(name)
                tx.set_timer(fx, f"expire:{PB}:{name}", NOW)
                return name
            return change

        def refuses(tx, fx):
            ran.append("refuses")
            if tx.timer_due(f"expire:{PB}:a") is not None:      # reads what `a` wrote, then refuses
                raise itd.Problem("conflict", "refused before writing")

        results = await asyncio.gather(store.write(good("a")), store.write(refuses), store.write(good("b")),
                                       return_exceptions=True)
        assert results[0] == "a" and results[2] == "b"
        assert isinstance(results[1], itd.Problem) and results[1].name == "conflict"
        assert ran == ["a", "refuses", "b"]                 # each once: nothing was undone
        assert await store.read(lambda tx: sorted(k for k, _ in tx.all_timers())) == [
            f"expire:{PB}:a", f"expire:{PB}:b"]

        def half(tx, fx):
            ran.append("half")
            tx.set_timer(fx, f"expire:{PB}:half", NOW)
            if tx.timer_due(f"expire:{PB}:half") is not None:   # read back (on a server: its write went)
                raise itd.Problem("conflict", "refused having written")

        ran.clear()
        results = await asyncio.gather(store.write(good("c")), store.write(half), store.write(good("d")),
                                       return_exceptions=True)
        assert results[0] == "c" and results[2] == "d" and results[1].name == "conflict"
        assert ran == ["c", "half", "d"]                    # undone alone; the others ran once
        assert await store.read(lambda tx: sorted(k for k, _ in tx.all_timers())) == [
            f"expire:{PB}:{k}" for k in ("a", "b", "c", "d")]
    finally:
        await store.close()


async def test_a_file_gathers_the_changes_of_the_next_turns_into_one_commit(tmp_path):
    """Changes that commit on the loop wait two more turns for the changes of the requests that arrived
    beside them, and commit together; as many as COMMIT_GATHER_MAX commit at once, in their own turn."""
    store = itd.Store(str(tmp_path / "t.db"))
    sizes: list[int] = []
    store.on_batch = lambda n, seconds: sizes.append(n)
    await store.open()
    try:
        await store.write(lambda tx, fx: tx.ensure_playbook(PB, now=NOW))
        sizes.clear()

        def timer(name):
            return lambda tx, fx: tx.set_timer(fx, f"expire:{PB}:{name}", NOW)

        first = store.write(timer("a"))
        await asyncio.sleep(0)
        second = store.write(timer("b"))            # a turn later: still in the first one's commit
        await asyncio.gather(first, second)
        assert sizes == [2]

        many = [store.write(timer(f"m{i}")) for i in range(itd.COMMIT_GATHER_MAX)]
        await asyncio.sleep(0)                      # the turn they were asked in has ended ...
        assert all(f.done() for f in many)          # ... and they committed then, together
        assert sizes == [2, itd.COMMIT_GATHER_MAX]

        last = store.write(timer("c"))
        await store.close()                         # what waits to be gathered commits at the close
        assert last.done() and last.exception() is None
        assert sizes[-1] == 1
    finally:
        await store.close()


async def test_a_file_locked_elsewhere_leaves_the_loop_free_and_the_writer_thread_commits_in_order(tmp_path):
    """Another connection holds the write lock: the loop does not wait for it (it goes on with its turns),
    the writer thread does, and commits that change and the ones asked for after it, in order; once
    they have settled, the next change commits on the loop again."""
    db = str(tmp_path / "t.db")
    store = itd.Store(db)
    await store.open()
    holder = sqlite3.connect(db, isolation_level=None)
    try:
        await store.write(lambda tx, fx: tx.ensure_playbook(PB, now=NOW))
        order: list[tuple[str, threading.Thread]] = []

        def change(name):
            def run(tx, fx):
                order.append((name, threading.current_thread()))
                tx.set_timer(fx, f"expire:{PB}:{name}", NOW)
                return name
            return run

        loop = asyncio.get_running_loop()
        holder.execute("BEGIN IMMEDIATE")
        began = loop.time()
        first = store.write(change("first"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)                      # the hand-over's turn has run
        second = store.write(change("second"))      # the first is still the thread's: this one follows it
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        # The busy timeout is 5 s: a loop that waited for the lock would have taken that long here.
        assert loop.time() - began < 2.5
        assert not first.done() and not second.done() and order == []
        loop.call_soon(holder.execute, "ROLLBACK")  # the loop, free, lets the lock go
        assert await first == "first" and await second == "second"
        assert [name for name, _ in order] == ["first", "second"]
        assert all(t is not threading.main_thread() for _, t in order)
        assert await store.write(change("third")) == "third"
        assert order[-1] == ("third", threading.main_thread())
        assert await store.read(lambda tx: sorted(k for k, _ in tx.all_timers())) == [
            f"expire:{PB}:first", f"expire:{PB}:second", f"expire:{PB}:third"]
    finally:
        holder.close()
        await store.close()


def test_the_schema_is_applied_once_and_again_without_change(db):
    for _ in range(2):
        tx = itd.open_sync(db)
        tx.ensure_playbook(PB, now=NOW)
        assert [r["id"] for r in tx.conn.execute("SELECT id FROM playbooks").fetchall()] == [PB]
        tx.close()


# PostgreSQL's own.


def test_every_migration_since_postgres_has_a_postgres_step():
    sqlite_steps = {v for v, _ in itd.MIGRATIONS if v > itd.POSTGRES_FIRST_VERSION}
    assert sqlite_steps == {v for v, _ in itd.POSTGRES_MIGRATIONS}
    assert itd.POSTGRES_FIRST_VERSION <= itd.SCHEMA_VERSION


def test_placeholders_become_psycopgs_once_per_statement():
    assert itd._pg_sql("SELECT ? WHERE x LIKE '5%' AND y = ?") == "SELECT %s WHERE x LIKE '5%%' AND y = %s"
    assert itd._pg_sql("SELECT ? WHERE x LIKE '5%' AND y = ?") is itd._pg_sql("SELECT ? WHERE x LIKE '5%' AND y = ?")


def test_a_postgres_url_is_shown_without_its_password():
    assert itd.postgres_url_shown("postgresql://ann:s3cret@db:5432/itd") == "postgresql://ann:***@db:5432/itd"
    assert itd.postgres_url_shown("postgresql:///itd") == "postgresql:///itd"
    assert not itd.is_postgres_url("interactiond.db") and itd.is_postgres_url("postgres://h/d")


@pytest.fixture
def pg_url():
    from daemon_kit import fresh_postgres

    with fresh_postgres() as url:
        yield url


def test_a_postgres_database_records_its_schema_version(pg_url):
    tx = itd.open_sync(pg_url)
    try:
        assert tx.conn.execute("SELECT version FROM schema_version").fetchall()[0][0] == itd.SCHEMA_VERSION
    finally:
        tx.close()


async def test_a_write_held_up_past_the_lock_timeout_is_unavailable_and_writes_nothing(pg_url, monkeypatch):
    import psycopg

    monkeypatch.setattr(itd, "PG_LOCK_TIMEOUT_MS", 200)
    store = itd.Store(pg_url)
    await store.open()
    other = psycopg.connect(pg_url, autocommit=True)
    try:
        with other.transaction():            # another daemon's write transaction, long
            other.execute("SELECT pg_advisory_xact_lock(%s)", (itd._PG_WRITE_LOCK,))
            with pytest.raises(itd.Problem) as info:
                await store.write(lambda tx, fx: tx.ensure_playbook(PB, now=NOW))
            # Several changes in one group commit meet the held lock too, the first of them reading
            # (so the lock's failure comes back inside a change): every one is unavailable.
            several = await asyncio.gather(*(store.write(lambda tx, fx, i=i: (tx.ensure_playbook(f"acme/p{i}", now=NOW),
                                                                                tx.clock_kept()))
                                              for i in range(3)), return_exceptions=True)
        assert (info.value.name, info.value.status, info.value.kind) == ("unavailable", 503, "database_busy")
        assert [(p.name, p.kind) for p in several] == [("unavailable", "database_busy")] * 3
        assert await store.read(lambda tx: tx.conn.execute("SELECT COUNT(*) FROM playbooks").fetchone()[0]) == 0
        # The lock gone, the writer's connection is in no failed transaction: the next writes are written.
        await store.write(lambda tx, fx: tx.ensure_playbook(PB, now=NOW))
        await asyncio.gather(store.write(lambda tx, fx: tx.ensure_playbook("acme/q1", now=NOW)),
                             store.write(lambda tx, fx: tx.ensure_playbook("acme/q2", now=NOW)))
        assert await store.read(lambda tx: tx.conn.execute("SELECT COUNT(*) FROM playbooks").fetchone()[0]) == 3
    finally:
        other.close()
        await store.close()


async def test_a_lost_connection_is_opened_again(pg_url):
    import psycopg

    store = itd.Store(pg_url)
    await store.open()
    admin = psycopg.connect(pg_url, autocommit=True)
    try:
        await store.write(lambda tx, fx: tx.ensure_playbook(PB, now=NOW))
        # The server drops both of the store's connections (a restart, a failover, an idle cut).
        killed = admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname ="
                               " current_database() AND pid <> pg_backend_pid() AND application_name = 'interactiond'"
                               ).fetchall()
        assert len(killed) == 2
        # A write finds out at BEGIN, before anything of it ran, and opens the connection again.
        await store.write(lambda tx, fx: tx.ensure_playbook("acme/other", now=NOW))
        # A reading that finds its connection gone answers unavailable; the next one reads again.
        with pytest.raises(itd.Problem) as info:
            await store.read(lambda tx: tx.conn.execute("SELECT COUNT(*) FROM playbooks").fetchone()[0])
        assert (info.value.status, info.value.kind) == (503, "database_unreachable")
        assert await store.read(lambda tx: tx.conn.execute("SELECT COUNT(*) FROM playbooks").fetchone()[0]) == 2
    finally:
        admin.close()
        await store.close()


# Reminders, escalation and default answers (SPEC section 19).


def test_a_reminder_is_counted_once_and_only_on_an_open_request(tx):
    _run_with_request(tx, "r1")
    row = tx.remind_request(PB, "r1", 0)
    assert row["reminded"] == 1
    assert tx.remind_request(PB, "r1", 0) is None                      # counted meanwhile: moves nothing
    assert tx.remind_request(PB, "r1", 1)["reminded"] == 2
    tx.close_request(itd.Effects(), PB, "r1", itd.ENDINGS["expired"])
    assert tx.remind_request(PB, "r1", 2) is None
    assert tx.request(PB, "r1")["reminded"] == 2


def test_an_escalation_happens_once_and_listing_by_to_finds_both_parties(tx):
    for run_id in ("r1", "r2", "r3"):
        _run_with_request(tx, run_id)
    tx.conn.execute("UPDATE requests SET party = 'bo' WHERE run_id = 'r2'")
    assert tx.escalate_request(PB, "r1", "bo")["escalated_to"] == "bo"
    assert tx.escalate_request(PB, "r1", "cy") is None                 # escalated already
    page = dict(type_=None, name=None, before=None, limit=10)
    assert [r["run_id"] for r in tx.open_requests(PB, to="bo", **page)] == ["r2", "r1"]       # newest first
    assert [r["run_id"] for r in tx.open_requests(PB, to="ann", **page)] == ["r3", "r1"]
    assert [r["run_id"] for r in tx.open_requests(PB, to="bo", **{**page, "limit": 1})] == ["r2"]
    seq_r2 = tx.request(PB, "r2")["seq"]
    assert [r["run_id"] for r in tx.open_requests(PB, to="bo", **{**page, "before": seq_r2})] == ["r1"]
    tx.close_request(itd.Effects(), PB, "r1", itd.ENDINGS["answered"])
    assert [r["run_id"] for r in tx.open_requests(PB, to="bo", **page)] == ["r2"]
    assert tx.escalate_request(PB, "r3", "bo") is not None and tx.escalate_request(PB, "r1", "bo") is None


def test_a_default_answer_is_recorded_as_a_fact_answered_by_nobody(tx):
    _run_with_request(tx, "r1")
    fx = itd.Effects()
    tx.record_default(fx, tx.request(PB, "r1"), {"verdict": "revise"}, now=NOW + 60_000)
    closed = tx.close_request(fx, PB, "r1", itd.ENDINGS["defaulted"])
    assert (closed["status"], closed["answer"], closed["answered_by"]) == ("expired", '{"verdict":"revise"}', None)
    event = tx.event(PB, closed["answer_id"])
    assert event["type"] == "request_defaulted"
    assert itd.json.loads(event["payload"]) == {
        "run_id": "r1", "answer": {"verdict": "revise"}, "claimed_for": None, "answered_by": None,
        "answered_by_name": None, "answered_at": itd.fmt_time(NOW + 60_000), "defaulted": True}
    assert closed["answered_by_name"] is None
    with pytest.raises(itd.Problem) as info:
        tx.record_default(itd.Effects(), closed, {"verdict": "revise"}, now=NOW + 60_001)
    assert info.value.name == "not_open"


def test_a_nudge_is_attempted_as_a_delivery_is_while_its_request_is_open(tx):
    _run_with_request(tx, "d1", deliver=True)
    nudge = tx.queue_nudge(PB, "d1", what="reminder", n=1, message="Still there?")
    row = tx.begin_nudge(nudge, now=NOW)
    assert (row["state"], row["attempts"], row["started_at"]) == ("delivering", 1, NOW)
    assert tx.begin_nudge(nudge, now=NOW) is None                      # one attempt in flight at a time
    assert not tx.end_nudge(nudge, 2, itd.DeliveryEvent.SUCCEED)       # not that attempt
    assert tx.end_nudge(nudge, 1, itd.DeliveryEvent.FAIL)
    assert tx.nudge(nudge)["state"] == "retrying"
    assert tx.begin_nudge(nudge, now=NOW + 60_000)["attempts"] == 2
    assert tx.end_nudge(nudge, 2, itd.DeliveryEvent.SUCCEED) and not tx.end_nudge(nudge, 2, itd.DeliveryEvent.FAIL)
    shown = tx.nudge(nudge)
    assert (shown["state"], shown["server"], shown["party"], shown["request_status"]) == ("delivered", "chat", "ann", "open")
    other = tx.queue_nudge(PB, "d1", what="escalation", n=1, message="Over to you")
    tx.close_request(itd.Effects(), PB, "d1", itd.ENDINGS["answered"])
    assert tx.begin_nudge(other, now=NOW) is None                      # the request closed: nothing is sent
    assert tx.nudge(other)["state"] == "to_deliver"
    _run_with_request(tx, "d2", deliver=True)
    spent = tx.queue_nudge(PB, "d2", what="reminder", n=1, message="x")
    tx.conn.execute("UPDATE nudges SET attempts = ?, state = 'retrying' WHERE id = ?", (itd.MAX_ATTEMPTS, spent))
    assert tx.begin_nudge(spent, now=NOW) is None                      # attempts stop at five


def test_an_answer_drops_every_timer_a_delivered_request_with_reminders_may_have(tx):
    _run_with_request(tx, "d1", deliver=True)
    tx.conn.execute("UPDATE requests SET follow_up = ? WHERE run_id = 'd1'", ('{"remind": {"at": [1]}}',))
    kinds = ("expire", "attempt", "lost", "remind", "escalate")
    fx = itd.Effects()
    for k in kinds:
        tx.set_timer(fx, itd.timer_key(k, PB, "d1"), NOW + 1_000)
    fx = itd.Effects()
    tx.answer_request(fx, tx.request(PB, "d1"), {}, by="tok_1", now=NOW + 5)
    assert sorted(k for k, due in fx.timers if due is None) == sorted(itd.timer_key(k, PB, "d1") for k in kinds)
    assert tx.all_timers() == []


def test_closing_a_request_drops_its_reminder_and_escalation_timers(tx):
    _run_with_request(tx, "r1")
    fx = itd.Effects()
    for kind in ("remind", "escalate"):
        tx.set_timer(fx, itd.timer_key(kind, PB, "r1"), NOW + 1)
    tx.close_request(fx, PB, "r1", itd.ENDINGS["answered"])
    assert tx.all_timers() == []


def _previous_version_file(path: Path) -> None:
    """A file as version 2 left it, with an open request."""
    import sqlite3

    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript((ROOT / "tests" / "fixtures" / "schema-v2.sql").read_text())
    conn.execute("PRAGMA user_version = 2")
    conn.execute("INSERT INTO playbooks (id, created_at) VALUES (?, ?)", (PB, NOW))
    conn.execute("INSERT INTO requests (id, playbook, run_id, type, name, version, party, answerer, message, status,"
                 " delivery_state, asked_at, expires_at) VALUES ('int_1', ?, 'r1', 'interaction', 'approve', 1, 'ann',"
                 " 'ann', 'ok?', 'open', 'in_inbox', ?, ?)", (PB, NOW, NOW + 60_000))
    conn.close()


def test_a_file_of_version_2_gains_reminders_escalation_and_defaults(tmp_path):
    path = tmp_path / "v2.db"
    _previous_version_file(path)
    tx = itd.open_sync(str(path))
    try:
        assert tx.conn.execute("PRAGMA user_version").fetchone()[0] == itd.SCHEMA_VERSION >= 3
        row = tx.request(PB, "r1")
        assert (row["follow_up"], row["reminded"], row["escalated_to"], row["reply_sender"]) == (None, 0, None, None)
        assert tx.escalate_request(PB, "r1", "bo")["escalated_to"] == "bo"
        assert tx.queue_nudge(PB, "r1", what="escalation", n=1, message="x") == 1
        names = {r[0] for r in tx.conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert "requests_open_escalated" in names
    finally:
        tx.close()


def test_a_postgres_database_of_version_2_gains_them_too(pg_url):
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute((ROOT / "tests" / "fixtures" / "schema-postgres-v2.sql").read_text())
        conn.execute("INSERT INTO schema_version (version) VALUES (2)")
        conn.execute("INSERT INTO playbooks (id, created_at) VALUES (%s, %s)", (PB, NOW))
        conn.execute("INSERT INTO requests (id, playbook, run_id, type, name, version, party, answerer, message,"
                     " status, delivery_state, asked_at, expires_at) VALUES ('int_1', %s, 'r1', 'interaction',"
                     " 'approve', 1, 'ann', 'ann', 'ok?', 'open', 'in_inbox', %s, %s)", (PB, NOW, NOW + 60_000))
    tx = itd.open_sync(pg_url)
    try:
        assert tx.conn.execute("SELECT version FROM schema_version").fetchone()[0] == itd.SCHEMA_VERSION
        row = tx.request(PB, "r1")
        assert (row["follow_up"], row["reminded"], row["escalated_to"]) == (None, 0, None)
        assert tx.remind_request(PB, "r1", 0)["reminded"] == 1
        assert tx.queue_nudge(PB, "r1", what="reminder", n=1, message="x") >= 1
    finally:
        tx.close()


# Migrations.


def _database_of_version_2(db: str) -> None:
    """A database as version 2 made it (tests/fixtures/schema*-v2.sql), holding a function with an
    answer schema, a notification and requests of both, one with an answer schema of its own."""
    if itd.is_postgres_url(db):
        import psycopg

        conn = psycopg.connect(db, autocommit=True)
        conn.execute((ROOT / "tests" / "fixtures" / "schema-postgres-v2.sql").read_text())
        conn.execute("INSERT INTO schema_version (version) VALUES (2)")
        run = lambda sql, params=(): conn.execute(sql.replace("?", "%s"), params)   # noqa: E731
    else:
        import sqlite3

        conn = sqlite3.connect(db, isolation_level=None)
        conn.executescript((ROOT / "tests" / "fixtures" / "schema-v2.sql").read_text())
        conn.execute("PRAGMA user_version = 2")
        run = conn.execute
    from daemon_kit import APPROVAL
    import json

    schema = json.dumps(itd.parse_function(APPROVAL).output_schema, ensure_ascii=False, separators=(",", ":"))
    note = "---\ndescription: Tells the owner\nto: '{{ input.owner }}'\n---\nDone.\n"
    run("INSERT INTO playbooks (id, open_requests, created_at) VALUES (?, 3, ?)", (PB, NOW))
    for name, source in (("approve", APPROVAL), ("note", note)):
        run("INSERT INTO definitions (playbook, type, name, version, source, source_sha, overview, created_at,"
            " created_by) VALUES (?, 'interaction', ?, 1, ?, 'sha', '', ?, 'tok_1')", (PB, name, source, NOW))
    for run_id, name, answer_schema in (("r1", "approve", schema), ("r2", "approve", '{"type":"object"}'),
                                        ("r3", "note", None)):
        run("INSERT INTO runs (playbook, run_id, type, name, version, input, input_sha, status, created_at, created_by)"
            " VALUES (?, ?, 'interaction', ?, 1, '{}', 'x', 'waiting', ?, 'tok_1')", (PB, run_id, name, NOW))
        run("INSERT INTO requests (id, playbook, run_id, type, name, version, party, answerer, message, answer_schema,"
            " status, delivery_state, asked_at, expires_at) VALUES (?, ?, ?, 'interaction', ?, 1, 'ann', 'ann', 'ok',"
            " ?, 'open', 'in_inbox', ?, ?)", (f"int_{run_id}", PB, run_id, name, answer_schema, NOW, NOW + 60_000))
        run("INSERT INTO timers (key, due_at) VALUES (?, ?)", (itd.timer_key("expire", PB, run_id), NOW + 60_000))
    conn.close()


def test_a_version_2_database_migrates_with_nothing_lost(db):
    _database_of_version_2(db)
    tx = itd.open_sync(db)
    try:
        if itd.is_postgres_url(db):
            assert tx.conn.execute("SELECT version FROM schema_version").fetchone()[0] == itd.SCHEMA_VERSION
        else:
            assert tx.conn.execute("PRAGMA user_version").fetchone()[0] == itd.SCHEMA_VERSION
            assert "WITHOUT ROWID" in tx.conn.execute("SELECT sql FROM sqlite_master WHERE name = 'timers'").fetchone()[0]
        shared = tx.definition(PB, "interaction", "approve", 1)["answer_schema"]
        assert shared == itd.dumps(itd.parse_function(tx.definition(PB, "interaction", "approve", 1)["source"]).output_schema)
        assert tx.definition(PB, "interaction", "note", 1)["answer_schema"] is None
        # Each request reads as it did; the shared schema is kept once, the request's own stays its own.
        r1, r2, r3 = (tx.request(PB, r) for r in ("r1", "r2", "r3"))
        assert (r1["answer_schema"], r1["own_schema"]) == (shared, None)
        assert (r2["answer_schema"], r2["own_schema"]) == ('{"type":"object"}', '{"type":"object"}')
        assert (r3["answer_schema"], r3["own_schema"]) == (None, None)
        assert [r["run_id"] for r in tx.open_requests(PB, to="ann", type_=None, name=None, before=None, limit=10)] == [
            "r3", "r2", "r1"]
        assert [r["answer_schema"] for r in tx.interactions([PB], ["open"], run_id=None, before=None, limit=10)] == [
            '{"type":"object"}', shared]
        assert sorted(tx.all_timers()) == sorted((itd.timer_key("expire", PB, r), NOW + 60_000) for r in ("r1", "r2", "r3"))
        # A new request of the same version keeps no copy; one of another schema keeps its own.
        tx.insert_run(playbook=PB, run_id="r4", type_="interaction", name="approve", version=1, input_text="{}",
                      input_sha="x", parent=None, now=NOW, by="tok_1")
        tx.open_request(request_id="int_r4", playbook=PB, run_id="r4", type_="interaction", name="approve", version=1,
                        party="ann", answerer="ann", message="ok?", answer_schema=shared, server=None, tool=None,
                        delivery=itd.DeliveryState.IN_INBOX, asked_at=NOW, expires_at=NOW + 60_000, deliver_args=None)
        r4 = tx.request(PB, "r4")
        assert (r4["answer_schema"], r4["own_schema"]) == (shared, None)
    finally:
        tx.close()
    again = itd.open_sync(db)                       # opened again: nothing to migrate, nothing changes
    try:
        assert again.request(PB, "r2")["answer_schema"] == '{"type":"object"}'
    finally:
        again.close()


def _database_of_version_6(db: str) -> None:
    """A database as version 6 made it (tests/fixtures/schema*-v6.sql), holding an answered request
    and an open one."""
    if itd.is_postgres_url(db):
        import psycopg

        conn = psycopg.connect(db, autocommit=True)
        conn.execute((ROOT / "tests" / "fixtures" / "schema-postgres-v6.sql").read_text())
        conn.execute("INSERT INTO schema_version (version) VALUES (6)")
        run = lambda sql, params=(): conn.execute(sql.replace("?", "%s"), params)   # noqa: E731
    else:
        conn = sqlite3.connect(db, isolation_level=None)
        conn.executescript((ROOT / "tests" / "fixtures" / "schema-v6.sql").read_text())
        conn.execute("PRAGMA user_version = 6")
        run = conn.execute
    run("INSERT INTO playbooks (id, open_requests, created_at) VALUES (?, 1, ?)", (PB, NOW))
    for run_id, status, open_ in (("r1", "answered", 0), ("r2", "open", 1)):
        run("INSERT INTO runs (playbook, run_id, type, name, version, input, input_sha, status, created_at, created_by)"
            " VALUES (?, ?, 'interaction', 'approve', 1, '{}', 'x', ?, ?, 'tok_1')",
            (PB, run_id, "succeeded" if open_ == 0 else "waiting", NOW))
        run("INSERT INTO requests (id, playbook, run_id, type, name, version, party, answerer, message, own_schema,"
            " status, open, delivery_state, asked_at, expires_at, answer, answered_by, answered_at) VALUES (?, ?, ?,"
            " 'interaction', 'approve', 1, 'ann', 'ann', 'ok', '{\"type\":\"object\"}', ?, ?, 'in_inbox', ?, ?, ?, ?, ?)",
            (f"int_{run_id}", PB, run_id, status, open_, NOW, NOW + 60_000, '{}' if open_ == 0 else None,
             "tok_1" if open_ == 0 else None, NOW + 1 if open_ == 0 else None))
    conn.close()


def test_a_version_6_database_gains_answered_by_name(db):
    _database_of_version_6(db)
    tx = itd.open_sync(db)
    try:
        if itd.is_postgres_url(db):
            assert tx.conn.execute("SELECT version FROM schema_version").fetchone()[0] == itd.SCHEMA_VERSION >= 7
        else:
            assert tx.conn.execute("PRAGMA user_version").fetchone()[0] == itd.SCHEMA_VERSION >= 7
        old = tx.request(PB, "r1")
        assert (old["answered_by"], old["answered_by_name"]) == ("tok_1", None)       # kept as it was, no name
        closed = tx.answer_request(itd.Effects(), tx.request(PB, "r2"), {"verdict": "approve"}, by="tok_1",
                                   now=NOW + 5, by_name="ops")
        assert closed["answered_by_name"] == tx.request(PB, "r2")["answered_by_name"] == "ops"
    finally:
        tx.close()


def test_deputies_are_added_listed_open_in_their_window_and_removed(tx):
    tx.add_deputy(deputy_id="dep_1", playbook=PB, for_person="ann", to_person="ben", starts_at=NOW + 10,
                  ends_at=NOW + 20, now=NOW, by="local")
    tx.add_deputy(deputy_id="dep_2", playbook="acme/other", for_person="cy", to_person="ben", starts_at=None,
                  ends_at=None, now=NOW + 1, by="local")
    assert [r["id"] for r in tx.deputies(PB)] == ["dep_1"]
    assert [r["id"] for r in tx.deputies(None)] == ["dep_1", "dep_2"]
    assert [tx.standing_for(PB, "ben", t) for t in (NOW + 9, NOW + 10, NOW + 19, NOW + 20)] == [[], ["ann"], ["ann"], []]
    assert tx.standing_for("acme/other", "ben", NOW) == ["cy"] and tx.standing_for(PB, "ann", NOW + 15) == []
    assert tx.remove_deputy("acme/other", "dep_1") is None                  # another playbook's: not removed
    assert tx.remove_deputy(PB, "dep_1")["for_person"] == "ann"
    assert tx.remove_deputy(PB, "dep_1") is None and tx.deputies(PB) == []


def test_a_requests_digest_is_kept_changed_only_while_open_and_its_addressees_list_it(tx):
    _run_with_request(tx, "r1")
    req = tx.request(PB, "r1")
    assert req["digest"] == itd.request_digest("ok?", {"type": "object"})
    tx.set_digest(PB, "r1", "a" * 64)
    assert tx.request(PB, "r1")["digest"] == "a" * 64
    tx.add_addressees(PB, "r1", ["bo", "cy"])
    tx.add_addressees(PB, "r1", ["cy"])                                      # once each
    for who in ("ann", "bo", "cy"):
        assert [r["run_id"] for r in tx.open_requests(PB, to=who, type_=None, name=None, before=None, limit=10)] == ["r1"]
    assert tx.open_requests(PB, to="dan", type_=None, name=None, before=None, limit=10) == []
    assert [r["run_id"] for r in tx.open_requests(PB, to="dan", type_=None, name=None, before=None, limit=10,
                                                  also=("bo",))] == ["r1"]
    tx.close_request(itd.Effects(), PB, "r1", itd.ENDINGS["cancelled"])
    tx.set_digest(PB, "r1", "b" * 64)                                        # a closed request keeps its digest
    assert tx.request(PB, "r1")["digest"] == "a" * 64
    assert tx.open_requests(PB, to="bo", type_=None, name=None, before=None, limit=10) == []
