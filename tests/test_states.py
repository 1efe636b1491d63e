"""The States section: every (state, event) pair of the transition tables, the ENDINGS table and the
maps derived from it, and the schema's CHECK constraints agreeing with the enums."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import interactiond as itd
from interactiond import DeliveryEvent as E
from interactiond import DeliveryState as D
from interactiond import RequestStatus as R
from interactiond import RunStatus as S

ROOT = Path(__file__).resolve().parent.parent

#: What a delivery may do, written out pair by pair (SPEC section 5 and the seed's "Attempts").
DELIVERY_ALLOWED = {
    (D.TO_DELIVER, E.BEGIN): D.DELIVERING,
    (D.RETRYING, E.BEGIN): D.DELIVERING,
    (D.DELIVERING, E.SUCCEED): D.DELIVERED,
    (D.DELIVERING, E.FAIL): D.RETRYING,
    (D.DELIVERING, E.SPEND): D.UNDELIVERED,
    (D.DELIVERING, E.CANCEL): D.CANCELLING,
}


@pytest.mark.parametrize("state", list(D))
@pytest.mark.parametrize("event", list(E))
def test_every_delivery_pair(state, event):
    if (state, event) in DELIVERY_ALLOWED:
        assert itd.next_state(itd.DELIVERY_TRANSITIONS, state, event) is DELIVERY_ALLOWED[(state, event)]
    else:
        with pytest.raises(itd.InvalidTransition) as info:
            itd.next_state(itd.DELIVERY_TRANSITIONS, state, event)
        assert state.value in str(info.value) and event.value in str(info.value)


@pytest.mark.parametrize("state", list(R))
@pytest.mark.parametrize("event", list(R))
def test_every_request_pair(state, event):
    # Only an open request closes, with any status but open; nothing else moves.
    if state is R.OPEN and event is not R.OPEN:
        assert itd.next_state(itd.REQUEST_TRANSITIONS, state, event) is event
    else:
        with pytest.raises(itd.InvalidTransition):
            itd.next_state(itd.REQUEST_TRANSITIONS, state, event)


def test_allowed_from_is_what_a_guard_lists():
    assert set(itd.allowed_from(itd.DELIVERY_TRANSITIONS, E.BEGIN)) == {D.TO_DELIVER, D.RETRYING}
    assert itd.allowed_from(itd.DELIVERY_TRANSITIONS, E.CANCEL) == (D.DELIVERING,)
    assert itd.allowed_from(itd.REQUEST_TRANSITIONS, R.ANSWERED) == (R.OPEN,)


def test_every_ending_status_has_its_generic_row():
    for status in S:
        if status.ended:
            e = itd.ending_of(status, None)
            assert e.run is status and e.kind is None and e.request is None
    # A kind the table lacks (a workflow's own) falls back to its status's row.
    assert itd.ending_of(S.REJECTED, "timeout").name == "rejected"
    assert itd.ending_of(S.REJECTED, "expired").request is R.EXPIRED


@pytest.mark.parametrize("status,kind,name,http", [
    (S.INVALID_INPUT, None, "invalid_input", 422),
    (S.CONFLICT, "unworkable", "unworkable", 409),
    (S.CONFLICT, "effect_unknown", "effect_unknown", 409),
    (S.CONFLICT, "my_own_kind", "my_own_kind", 409),
    (S.CONFLICT, None, "conflict", 409),
    (S.UNAVAILABLE, "tool_not_offered", "unavailable", 503),
    (S.UNAVAILABLE, "requests_full", "unavailable", 503),
    (S.REJECTED, "expired", "unanswered", 410),
    (S.REJECTED, "undelivered", "unanswered", 410),
    (S.REJECTED, "cancelled", "cancelled", 410),
    (S.FAILED, None, "failed", 500),
])
def test_ending_problems_are_named_as_the_contract_says(status, kind, name, http):
    body = itd.ending_problem(status, kind, "detail").body()
    assert body["type"] == f"/problems/{name}" and body["status"] == http and body.get("kind") == kind
    assert name in itd.PROBLEM_TYPES or status is S.CONFLICT


def test_derived_maps():
    assert itd.RUN_HTTP_STATUS == {S.STARTED: 202, S.WAITING: 202, S.SUCCEEDED: 200, S.INVALID_INPUT: 422,
                                   S.CONFLICT: 409, S.UNAVAILABLE: 503, S.REJECTED: 410, S.FAILED: 500}
    assert itd.V2_STATUS == {"open": "pending", "answered": "answered", "expired": "expired",
                             "undelivered": "expired", "cancelled": "cancelled"}
    assert itd.CHILD_ERROR_STATUS == {"invalid_input": 400, "conflict": 409, "unavailable": 503,
                                      "rejected": 410, "failed": 500}
    assert itd.STREAM_ENDINGS == {"expired": "interaction.expired", "cancelled": "interaction.cancelled"}
    for e in itd.ENDINGS.values():
        assert e.problem is None or e.problem in itd.PROBLEM_TYPES, e
        assert (e.problem is None) == (e.run is S.SUCCEEDED), e


def _check_values(table: str, column: str) -> set[str]:
    sql = (ROOT / "schema.sql").read_text()
    body = sql[sql.index(f"CREATE TABLE IF NOT EXISTS {table} "):]
    body = body[:body.index(");\n")]
    clause = body[body.index(f"{column} "):]
    clause = clause[clause.index("CHECK"):clause.index("))") + 2]
    clause = re.sub(r"--[^\n]*", "", clause)
    return set(re.findall(r"'([a-z_]+)'", clause))


def test_the_schema_checks_agree_with_the_enums():
    assert _check_values("runs", "status") == {s.value for s in S}
    assert _check_values("requests", "status") == {s.value for s in R}
    assert _check_values("requests", "delivery_state") == {s.value for s in D}


def test_every_event_the_module_appends_is_an_event_type():
    source = (ROOT / "interactiond.py").read_text()
    used = set(re.findall(r'append_event\([^"\n]*"([a-z_]+)"', source))
    known = {t.value for t in itd.EventType}
    assert used - {"interactiond", "playbook", "run_"} <= known, used - known
    assert {f"run_{s.value}" for s in S if s.ended} <= known
