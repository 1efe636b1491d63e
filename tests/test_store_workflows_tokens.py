"""The store's operations for workflows, tokens and sessions, on a real SQLite file: each state
change is one guarded statement, and a move it does not allow writes nothing and says so."""
from __future__ import annotations

import pytest

import interactiond as itd
from interactiond import RunStatus as S

PB = "local/default"


@pytest.fixture
def tx(tmp_path):
    tx = itd.open_sync(str(tmp_path / "x.db"))
    tx.conn.execute("INSERT INTO playbooks (id, created_at) VALUES (?, 0)", (PB,))
    yield tx
    tx.close()


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
