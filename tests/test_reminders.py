"""Reminders, escalation and default answers (SPEC section 19): the save-time checks with their lines,
the overview, inbox requests on both backends (v1, v2 and the stream), a real chat tool server's
thread, `ask` over MCP, workflows, restarts, and several daemons on one PostgreSQL database.

Everything runs on the manual clock; a chat server is the example one, a subprocess speaking MCP.
"""
from __future__ import annotations

import asyncio
import re
import sys
from datetime import timedelta
from pathlib import Path

import pytest

import interactiond as itd
from daemon_kit import APPROVAL, START_MS, fresh_postgres, start_daemon, until
from test_mcp import connect
from test_typed_api import open_stream
from test_web_inbox import CHROMIUM, CHROMIUM_ARGS, _playwright, served  # noqa: F401 (served: a fixture)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import chat_server  # noqa: E402

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS

FOLLOWED = """---
description: Asks a brief's owner to approve it, and sees that nobody forgets
to: '{{ input.owner }}'
expires: P2D
remind: {after: [PT4H, P1D], message: 'Still waiting for your answer on {{ input.title }}'}
escalate: {after: P1D, to: '{{ input.manager }}', message: 'Escalated to you: {{ input.title }}'}
on_expiry: {answer: {verdict: revise, note: No answer in time}}
input:
  schema:
    type: object
    required: [owner, manager, title]
    properties:
      owner: { type: string }
      manager: { type: string }
      title: { type: string }
output:
  schema:
    type: object
    required: [verdict]
    properties:
      verdict: { type: string, enum: [approve, revise] }
      note: { type: string, maxLength: 2000 }
---
Please approve **{{ input.title }}**.
"""
INPUT = {"owner": "ana", "manager": "bo", "title": "Spring brief"}
DEFAULT = {"verdict": "revise", "note": "No answer in time"}


def only(*keep: str) -> str:
    """FOLLOWED with only the follow-up fields named (remind, escalate, on_expiry)."""
    return "".join(line for line in FOLLOWED.splitlines(keepends=True)
                   if not line.startswith(("remind:", "escalate:", "on_expiry:")) or line.startswith(keep))


def problems(source: str) -> list[tuple[int, str, str]]:
    with pytest.raises(itd.DocumentError) as info:
        itd.parse_function(source)
    return [(p["line"], p["field"], p["message"]) for p in info.value.problems]


# -- saving: the three fields, checked with their lines ----------------------------------------------

def test_the_three_fields_are_read():
    doc = itd.parse_function(FOLLOWED)
    assert doc.remind.after == (timedelta(hours=4), timedelta(days=1))
    assert doc.remind.message.source == "Still waiting for your answer on {{ input.title }}"
    assert doc.escalate.after == timedelta(days=1) and doc.escalate.to.source == "{{ input.manager }}"
    assert doc.on_expiry.answer == DEFAULT
    bare = itd.parse_function(FOLLOWED.replace(", message: 'Still waiting for your answer on {{ input.title }}'", "")
                              .replace("after: [PT4H, P1D]", "after: PT4H"))
    assert bare.remind.after == (timedelta(hours=4),) and bare.remind.message is None


def test_reminders_come_in_increasing_order_before_the_expiry():
    source = FOLLOWED.replace("remind: {after: [PT4H, P1D], message: 'Still waiting for your answer on {{ input.title }}'}",
                              "remind:\n  after:\n    - P1D\n    - PT4H\n    - P2D\n    - PT1S")
    assert problems(source) == [
        (8, "remind.after.1", "PT4H does not come after the reminder before it: list the durations in increasing order"),
        (9, "remind.after.2", "P2D is not before expires (P2D): the request has ended by then"),
        (10, "remind.after.3", "PT1S is outside PT1M to P30D (1 minute to 30 days)"),
    ]
    many = FOLLOWED.replace("[PT4H, P1D]", "[" + ", ".join(f"PT{h}H" for h in range(1, 13)) + "]")
    assert problems(many) == [(5, "remind.after", "a request is reminded at most 10 times, not 12")]


def test_an_escalation_after_the_expiry_is_refused():
    assert problems(FOLLOWED.replace("escalate: {after: P1D", "escalate: {after: P3D")) == [
        (6, "escalate.after", "P3D is not before expires (P2D): the request has ended by then")]


def test_a_default_that_does_not_match_the_answer_schema_is_refused():
    source = FOLLOWED.replace("on_expiry: {answer: {verdict: revise, note: No answer in time}}",
                              "on_expiry:\n  answer:\n    verdict: maybe\n    note: 5")
    assert problems(source) == [
        (9, "on_expiry.answer.verdict", "the default answer does not match output.schema at /verdict: 'maybe' is not"
                                        " one of ['approve', 'revise']"),
        (10, "on_expiry.answer.note", "the default answer does not match output.schema at /note: 5 is not of type 'string'"),
    ]
    missing = problems(FOLLOWED.replace("{verdict: revise, note: No answer in time}", "{note: nothing}"))
    assert missing == [(7, "on_expiry.answer.verdict", "the default answer does not match output.schema at /verdict:"
                                                       " 'verdict' is a required property")]


def test_unknown_keys_are_refused():
    source = (FOLLOWED.replace("remind: {after:", "remind: {every: PT1H, after:")
              .replace("escalate: {after: P1D,", "escalate: {after: P1D, cc: cy,")
              .replace("on_expiry: {answer:", "on_expiry: {answr:"))
    got = problems(source)
    assert (5, "remind.every", "'every' is not a key of remind (its keys: after, message)") in got
    assert (6, "escalate.cc", "'cc' is not a key of escalate (its keys: after, to, message)") in got
    assert (7, "on_expiry.answr", "'answr' is not a key of on_expiry (its keys: answer)") in got
    assert (7, "on_expiry.answer", "on_expiry needs 'answer'") in got
    assert len(got) == 4


def test_their_templates_read_only_what_the_message_reads():
    source = (FOLLOWED.replace("on {{ input.title }}'}", "on {{ sent.id }}'}")
              .replace("to: '{{ input.manager }}'", "to: '{{ input.boss }}'"))
    got = problems(source)
    assert [(line, field) for line, field, _ in got] == [(5, "remind.message"), (6, "escalate.to")]
    assert "`sent.id` is not a name this place reads; it reads input, now, request.answer_url, today" in got[0][2]
    assert "the input schema has no property 'boss'" in got[1][2]


def test_a_delivered_function_that_reminds_or_escalates_needs_replies_tell():
    chat = (ROOT / "tests" / "fixtures" / "seed-chat-approval.md").read_text()
    chat = chat.replace("expires: P2D\n", "expires: P2D\nremind: {after: [PT4H]}\nescalate: {after: P1D, to: boss}\n")
    doc = itd.parse_function(chat)                                      # it has replies.tell
    assert doc.replies.tell is not None and doc.shape is itd.Shape.TOOL
    assert doc.remind.after == (timedelta(hours=4),) and doc.remind.message is None
    assert doc.escalate.after == timedelta(days=1) and doc.escalate.to.source == "boss" and doc.escalate.message is None
    untold = re.sub(r"  tell:\n(    .*\n)+", "", chat)
    assert problems(untold) == [
        (5, "remind", "a function sent through a tool sends its reminders into the message's thread with"
                      " replies.tell: add replies.tell"),
        (6, "escalate", "a function sent through a tool sends its escalation into the message's thread with"
                        " replies.tell: add replies.tell"),
    ]


def test_a_notification_and_a_system_call_take_none_of_them():
    note = "---\nto: ana\nexpires: P1D\nremind: {after: PT1H}\non_expiry: {answer: {}}\n---\nShipped.\n"
    assert [(line, field) for line, field, _ in problems(note)] == [(4, "remind"), (5, "on_expiry")]
    system = ("---\ncall: {server: chat, tool: post_message}\nescalate: {after: PT1H, to: bo}\noutput:\n"
              "  schema: {type: object}\n---\n")
    assert problems(system) == [(3, "escalate", "a function with call asks a system, so it has no escalate")]


async def test_saving_over_http_lists_every_problem_with_its_line(d):
    source = FOLLOWED.replace("[PT4H, P1D]", "[P1D, PT4H]").replace("escalate: {after: P1D", "escalate: {after: P5D")
    status, body = await d.call("POST", "/definitions", {"type": "interaction", "name": "brief", "source": source})
    assert status == 422 and body["type"] == "/problems/invalid_document"
    assert [(e["line"], e["field"]) for e in body["errors"]] == [(5, "remind.after.1"), (6, "escalate.after")]


def test_the_overview_says_all_three_in_plain_words():
    overview = itd.parse_function(FOLLOWED).overview
    assert ("**Until it is answered:** reminds **owner** after 4 hours and after 1 day; from 1 day on also asks"
            " **manager**; if nobody answers in 2 days, takes revise as its **verdict**, No answer in time as its"
            " **note**.") in overview
    assert "**How long it waits:** 2 days; then it takes its default answer." in overview
    assert "Until it is answered" not in itd.parse_function(only()).overview
    one = itd.parse_function(only("on_expiry").replace("note: No answer in time", "note: x").replace(", note: x", ""))
    assert "if nobody answers in 2 days, takes revise." in one.overview


# -- on both backends: the inbox, v1, v2 and the stream ---------------------------------------------

@pytest.fixture
async def d(db, aiohttp_client):
    return await start_daemon(aiohttp_client, db)


async def events(d, run_id: str, type_: str | None = None) -> list[dict]:
    data = (await d.call("GET", f"/runs/{run_id}/events?limit=200"))[1]["data"]
    return [e for e in data if type_ is None or e["type"] == type_]


async def listed(d, to: str | None = None) -> list[dict]:
    return (await d.call("GET", "/interactions" + (f"?to={to}" if to else "")))[1]["data"]


async def v2_of(d, run_id: str) -> dict:
    return (await d.call("GET", f"/v2/interactions?run_id={run_id}"))[1]["data"][0]


async def test_reminded_twice_then_answered(d):
    stream = await open_stream(d)
    await d.define("brief", only("remind"))
    _, run = await d.run("brief", INPUT)
    run_id = run["run_id"]
    requested = (await events(d, run_id, "interaction_requested"))[0]["payload"]
    assert requested["reminds_at"] == [itd.fmt_time(START_MS + 4 * HOUR_MS), itd.fmt_time(START_MS + DAY_MS)]
    await d.advance("PT3H59M59S")
    assert await events(d, run_id, "request_reminded") == [] and (await listed(d))[0]["reminded"] == 0
    await d.advance("PT1S")
    [first] = await events(d, run_id, "request_reminded")
    assert first["payload"] == {"n": 1, "message": "Still waiting for your answer on Spring brief",
                                "due_at": itd.fmt_time(START_MS + 4 * HOUR_MS)}
    assert first["at"] == itd.fmt_time(START_MS + 4 * HOUR_MS)
    assert (await listed(d))[0]["reminded"] == 1
    await d.advance("PT20H")
    assert [e["payload"]["n"] for e in await events(d, run_id, "request_reminded")] == [1, 2]
    [item] = await listed(d, "ana")
    assert item["reminded"] == 2 and item["addressees"] == ["ana"]
    assert (await v2_of(d, run_id))["reminded"] == 2
    status, fact = await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"verdict": "approve"}})
    assert status == 200 and fact["answered_by"].startswith("tok_")
    await d.advance("P3D")
    assert len(await events(d, run_id, "request_reminded")) == 2          # an answered request is not reminded
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["output"] == {"verdict": "approve"}
    got = await stream.take(5)
    assert [name for _, name, _ in got] == ["interaction.created", "interaction.reminded", "interaction.reminded",
                                            "interaction.answered", "run.ended"]
    assert [data.get("n") for _, _, data in got[1:3]] == [1, 2] and got[1][2]["run_id"] == run_id
    assert await d.engine.store.read(lambda tx: tx.all_timers()) == []


async def test_escalated_then_answered_by_the_manager(d):
    stream = await open_stream(d)
    await d.define("brief", only("escalate"))
    _, run = await d.run("brief", INPUT)
    run_id = run["run_id"]
    await d.advance("PT23H59M59S")
    assert await listed(d, "bo") == []
    await d.advance("PT1S")
    [escalated] = await events(d, run_id, "request_escalated")
    assert escalated["payload"] == {"to": "bo", "message": "Escalated to you: Spring brief"}
    for to in ("bo", "ana"):                             # listed under both parties
        [item] = await listed(d, to)
        assert item["run_id"] == run_id and item["addressees"] == ["ana", "bo"] and item["to"] == "ana"
    assert (await v2_of(d, run_id))["addressees"] == ["ana", "bo"]
    status, fact = await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"verdict": "approve"},
                                                                      "claimed_for": "bo"}, role="writer")
    assert status == 200 and fact["claimed_for"] == "bo"
    run = (await d.call("GET", f"/runs/{run_id}"))[1]
    assert run["status"] == "succeeded" and run["settled_by"] == fact["answered_by"]
    assert await listed(d, "bo") == [] and await listed(d, "ana") == []
    assert [name for _, name, _ in await stream.take(4)] == ["interaction.created", "interaction.escalated",
                                                             "interaction.answered", "run.ended"]


async def test_defaulted_at_the_exact_expiry_with_the_default_as_output(d):
    stream = await open_stream(d)
    await d.define("brief", only("on_expiry"))
    await d.define("plain", APPROVAL)
    _, run = await d.run("brief", INPUT)
    _, plain = await d.run("plain", {"owner": "ana", "review": "ok"})
    run_id = run["run_id"]
    ident = (await v2_of(d, run_id))["id"]
    await d.advance("PT47H59M59S")
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["status"] == "waiting"
    await d.advance("PT1S")
    expiry = itd.fmt_time(START_MS + 2 * DAY_MS)
    got = (await d.call("GET", f"/runs/{run_id}"))[1]
    assert (got["status"], got["kind"], got["output"], got["problem"]) == ("succeeded", "defaulted", DEFAULT, None)
    assert got["ended_at"] == expiry and got["settled_by"] == "interactiond"
    defaulted, ended = (await events(d, run_id))[-2:]
    assert defaulted["type"] == "request_defaulted" and ended["type"] == "run_succeeded"
    assert defaulted["payload"] == {"run_id": run_id, "answer": DEFAULT, "claimed_for": None, "answered_by": None,
                                    "answered_by_name": None, "answered_at": expiry, "defaulted": True}
    assert ended["payload"] == {"status": "succeeded", "kind": "defaulted", "output": DEFAULT}
    status, refused = await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"verdict": "approve"}})
    assert status == 409 and refused["kind"] == "expired"
    status, typed = await d.call("GET", f"/v2/interactions/{ident}")
    assert status == 200 and typed["status"] == "expired" and typed["defaulted"] is True
    assert typed["response"] == {"type": "form", "answer": DEFAULT, "submitted_at": expiry}
    assert typed["answered_at"] is None
    expired = (await d.call("GET", "/v2/interactions?status=expired"))[1]["data"]
    assert {x["run_id"]: x["defaulted"] for x in expired} == {run_id: True, plain["run_id"]: False}
    # Without on_expiry the run ends unanswered, as before.
    other = (await d.call("GET", f"/runs/{plain['run_id']}"))[1]
    assert (other["status"], other["kind"]) == ("rejected", "expired")
    got = await stream.take(6)
    mine = [(name, data) for _, name, data in got if data["run_id"] == run_id]
    assert [name for name, _ in mine] == ["interaction.created", "interaction.expired", "run.ended"]
    assert mine[1][1]["defaulted"] is True and mine[1][1]["interaction_id"] == ident
    assert mine[1][1]["response"] == {"type": "form", "answer": DEFAULT, "submitted_at": expiry}
    assert (mine[2][1]["status"], mine[2][1]["kind"]) == ("succeeded", "defaulted")


async def test_the_built_in_questions_take_them_over_mcp(d):
    async with connect(d, "http") as c:
        r = await c.call_tool("ask", {"type": "approval", "prompt": "Ship it?", "to": "ana", "expires": "PT3H",
                                      "remind_after": ["PT1H"], "escalate_to": "bo", "escalate_after": "PT2H",
                                      "default": {"approved": False, "comment": "Nobody said yes"}})
        assert not r.is_error, r.structured_content
        run_id = r.structured_content["run_id"]
        await d.advance("PT1H")
        [item] = (await c.call_tool("list_interactions", {"to": "ana"})).structured_content["data"]
        assert item["reminded"] == 1
        await d.advance("PT1H")
        [item] = (await c.call_tool("list_interactions", {"to": "bo"})).structured_content["data"]
        assert item["run_id"] == run_id and item["addressees"] == ["ana", "bo"]
        await d.advance("PT1H")
        r = await c.call_tool("get_run", {"run_id": run_id})
        assert (r.structured_content["status"], r.structured_content["kind"]) == ("succeeded", "defaulted")
        assert r.structured_content["output"] == {"approved": False, "comment": "Nobody said yes"}

        r = await c.call_tool("ask", {"type": "approval", "prompt": "Ship it?", "to": "ana", "expires": "PT3H",
                                      "remind_after": ["PT2H", "PT1H", "PT4H"], "escalate_to": "bo",
                                      "default": {"approved": "no"}})
        assert r.is_error and r.structured_content["status"] == "invalid_input"    # the run object, ended
        problem = r.structured_content["problem"]
        assert problem["type"] == "/problems/invalid_input"
        assert [e["pointer"] for e in problem["errors"]] == [
            "/input/default/approved", "/input/escalate_after", "/input/remind_after/1", "/input/remind_after/2"]
        r = await c.call_tool("ask", {"type": "choice", "prompt": "Which?", "to": "ana",
                                      "options": [{"id": "a", "label": "A"}], "default": {"option_ids": ["b"]}})
        assert r.is_error and r.structured_content["problem"]["errors"][0]["pointer"] == "/input/default/option_ids/0"
    # The same over HTTP: run_definition of a built-in with the same input.
    status, run = await d.call("POST", "/runs", {"type": "interaction", "name": "ask-text", "input": {
        "prompt": "Name it", "to": "ana", "expires": "PT1H", "default": {"text": "Atlas"}}})
    assert status == 202, run
    await d.advance("PT1H")
    got = (await d.call("GET", f"/runs/{run['run_id']}"))[1]
    assert (got["kind"], got["output"]) == ("defaulted", {"text": "Atlas"})


async def test_a_workflow_sees_a_defaulted_child_as_succeeded_with_its_answer(d):
    await d.define("brief", only("on_expiry"))
    source = ("document: {dsl: '1.0.3', namespace: tests, name: review, version: '1.0.0'}\n"
              "do:\n  - ask:\n      call: run_definition\n      with: {type: interaction, name: brief, input: '${ $data }'}\n")
    status, body = await d.call("POST", "/definitions", {"type": "workflow", "name": "review", "source": source})
    assert status == 201, body
    status, run = await d.call("POST", "/runs", {"type": "workflow", "name": "review", "input": INPUT})
    assert status == 202, run
    await d.advance("P2D")
    await d.advance("PT0S")
    got = (await d.call("GET", f"/runs/{run['run_id']}"))[1]
    assert got["status"] == "succeeded" and got["output"] == DEFAULT, got


async def test_a_restart_between_two_reminders_sends_one_for_the_times_it_missed(db, aiohttp_client):
    d = await start_daemon(aiohttp_client, db)
    await d.define("brief", only("remind").replace("[PT4H, P1D]", "[PT4H, PT6H, P1D, PT36H]"))
    _, run = await d.run("brief", INPUT)
    run_id = run["run_id"]
    await d.advance("PT4H")
    assert [e["payload"]["n"] for e in await events(d, run_id, "request_reminded")] == [1]
    await d.client.close()
    # Down from 4 hours to 26: the reminders due at 6 and 24 hours are one reminder at the start.
    d2 = await start_daemon(aiohttp_client, db, clock=itd.ManualClock(START_MS + 26 * HOUR_MS), tokens=d.tokens)
    await d2.advance("PT0S")
    reminded = await events(d2, run_id, "request_reminded")
    assert [e["payload"]["n"] for e in reminded] == [1, 2]
    assert reminded[1]["at"] == itd.fmt_time(START_MS + 26 * HOUR_MS)
    assert reminded[1]["payload"]["missed"] == 1 and reminded[1]["payload"]["due_at"] == itd.fmt_time(START_MS + DAY_MS)
    await d2.advance("PT9H59M59S")
    assert len(await events(d2, run_id, "request_reminded")) == 2
    await d2.advance("PT1S")                                              # the next one keeps its own time
    assert [e["payload"] for e in await events(d2, run_id, "request_reminded")][2] == {
        "n": 3, "message": "Still waiting for your answer on Spring brief", "due_at": itd.fmt_time(START_MS + 36 * HOUR_MS)}
    assert (await listed(d2))[0]["reminded"] == 3


# -- through a chat tool server: the thread -----------------------------------------------------------

CHAT = (ROOT / "tests" / "fixtures" / "seed-chat-approval.md").read_text() \
    .replace("expires: P2D\n", "expires: P2D\nremind: {after: [PT4H], message: 'Still waiting on the draft'}\n"
                               "escalate: {after: P1D, to: '{{ input.manager }}', message: 'Over to you,"
                               " {{ input.manager }}: approve or revise the draft'}\n") \
    .replace("required: [owner, draft]", "required: [owner, manager, draft]") \
    .replace("      owner: { type: string }\n", "      owner: { type: string }\n      manager: { type: string }\n")
CHAT_INPUT = {"owner": "ana", "manager": "bo", "draft": "Spring campaign copy"}


@pytest.fixture
async def chat(chat_d):
    await chat_d.define("chat-brief", CHAT)
    return chat_d


async def start_chat(d) -> tuple[str, str]:
    status, run = await d.run("chat-brief", CHAT_INPUT)
    assert status == 202, run
    await d.advance("PT0S")                                             # delivered at once
    [posted] = chat_server.messages(d.chat, "ana")
    return run["run_id"], posted["ts"]


def thread(d, ts: str) -> list[str]:
    return [m["text"] for m in chat_server.messages(d.chat, "ana") if m["thread_ts"] == ts]


async def test_reminders_and_the_escalation_arrive_in_the_thread_and_the_manager_answers(chat):
    d = chat
    run_id, ts = await start_chat(d)
    await d.advance("PT4H")
    assert thread(d, ts) == ["Still waiting on the draft"]
    types = [e["type"] for e in await events(d, run_id)]
    assert types[-3:] == ["request_reminded", "telling_started", "telling_succeeded"]
    reminded, started, sent = (await events(d, run_id))[-3:]
    assert reminded["payload"]["in_thread"] is True
    assert started["payload"]["for"] == "reminder" and started["payload"]["attempt"] == 1
    assert started["payload"]["tool"] == "post_message" and started["payload"]["arguments_size"] > 0
    assert sent["payload"]["n"] == 1
    # A reply from the manager before the escalation is not theirs to give: passed over.
    chat_server.say(d.chat, "ana", "bo", "approve", thread_ts=ts)
    await d.advance("PT20H")
    assert thread(d, ts)[-1] == "Over to you, bo: approve or revise the draft"
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["status"] == "waiting"
    [escalated] = await events(d, run_id, "request_escalated")
    assert escalated["payload"]["to"] == "bo" and escalated["payload"]["in_thread"] is True
    reply_ts = chat_server.say(d.chat, "ana", "bo", "approve Fine by me", thread_ts=ts)
    await d.advance("PT5M")
    got = (await d.call("GET", f"/runs/{run_id}"))[1]
    assert got["status"] == "succeeded" and got["output"] == {"verdict": "approve", "note": "Fine by me"}
    [answered] = await events(d, run_id, "request_answered")
    assert answered["payload"]["reply"] == {"id": reply_ts, "sender": "bo"}
    assert answered["by"] == "playbook:local/default"


async def test_a_reminders_telling_keeps_the_attempt_rules(chat):
    d = chat
    run_id, ts = await start_chat(d)
    chat_server.inject_fault(d.chat, "post_message", 1, retry_after_ms=180_000)
    await d.advance("PT4H")
    failed = (await events(d, run_id, "telling_failed"))
    assert [(e["payload"]["because"], e["payload"]["retry_after_ms"]) for e in failed] == [("tool_error", 180_000)]
    assert thread(d, ts) == []
    await d.advance("PT2M59S")
    assert thread(d, ts) == []
    await d.advance("PT1S")
    assert thread(d, ts) == ["Still waiting on the draft"]
    [sent] = await events(d, run_id, "telling_succeeded")
    assert sent["payload"]["attempt"] == 2
    # Five attempts at most; then it is given up, and the request stays open.
    chat_server.inject_fault(d.chat, "post_message", 5)
    await d.advance("PT20H")
    await d.advance("PT20M")
    escalation = [e for e in await events(d, run_id, "telling_failed") if e["payload"]["for"] == "escalation"]
    assert [e["payload"]["attempt"] for e in escalation] == [1, 2, 3, 4, 5]
    assert [e["at"] for e in escalation][1:] == [itd.fmt_time(START_MS + DAY_MS + m * 60_000) for m in (1, 3, 7, 15)]
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["status"] == "waiting"


async def test_a_stop_in_the_middle_of_a_reminders_attempt_recovers_as_a_delivery_does(chat, aiohttp_client,
                                                                                     monkeypatch):
    monkeypatch.setattr(itd, "SHUTDOWN_GRACE_S", 0.5)
    d = chat
    run_id, ts = await start_chat(d)
    await d.advance("PT3H59M59S")
    chat_server.inject_fault(d.chat, "post_message", 1, mode="hang")
    calls = chat_server.calls(d.chat, "post_message")
    d.clock.advance(1)                      # the reminder falls due; its telling hangs in the tool
    await until(lambda: chat_server.calls(d.chat, "post_message") > calls, what="the telling reaches the chat server")
    assert [e["type"] for e in await events(d, run_id)][-2:] == ["request_reminded", "telling_started"]
    now = d.clock.now_ms()
    await d.client.close()                  # gone with the attempt in flight: no end recorded

    d2 = await start_daemon(aiohttp_client, d.db, clock=itd.ManualClock(now), config=d.config, tokens=d.tokens)
    await d2.advance("PT59S")
    assert [e["type"] for e in await events(d2, run_id)][-1] == "telling_started"
    await d2.advance("PT1S")
    failed = await events(d2, run_id, "telling_failed")
    assert [e["payload"]["because"] for e in failed] == ["lost"]
    [sent] = await events(d2, run_id, "telling_succeeded")
    assert sent["payload"]["attempt"] == 2
    assert thread(d, ts) == ["Still waiting on the draft"]
    assert len(await events(d2, run_id, "request_reminded")) == 1        # one reminder, told once


# -- several daemons on one PostgreSQL database -------------------------------------------------------

@pytest.fixture
async def two(aiohttp_client):
    with fresh_postgres() as url:
        a = await start_daemon(aiohttp_client, url)
        b = await start_daemon(aiohttp_client, url, tokens=a.tokens)
        yield a, b


async def test_two_daemons_advancing_together_remind_escalate_and_default_once(two):
    a, b = two
    await a.define("brief", only("remind", "escalate", "on_expiry"))
    run_ids = [(await (a if i % 2 else b).run("brief", INPUT))[1]["run_id"] for i in range(4)]
    await asyncio.gather(a.advance("P2D"), b.advance("P2D"))
    for run_id in run_ids:
        types = [e["type"] for e in await events(a, run_id)]
        assert types.count("request_reminded") == 2 and types.count("request_escalated") == 1, types
        assert types[-2:] == ["request_defaulted", "run_succeeded"] and types.count("run_succeeded") == 1
        got = (await a.call("GET", f"/runs/{run_id}"))[1]
        assert (got["kind"], got["output"]) == ("defaulted", DEFAULT)
    assert await a.engine.store.read(lambda tx: tx.all_timers()) == []


# -- the page --------------------------------------------------------------------------------------

def test_the_page_shows_reminders_and_the_escalation(served):
    sync_api = _playwright()
    expect = sync_api.expect
    expect.set_options(timeout=10_000)
    served.define("brief", only("remind", "escalate"))
    run_id = served.run("brief", INPUT)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(served.login_url)
            item = page.locator(f'li[data-run-id="{run_id}"]')
            expect(item.locator(".meta")).not_to_contain_text("reminded")
            expect(item.locator("h2 .to")).to_have_text("for ana")
            assert served.call("POST", "/v1/admin/clock", {"advance": "PT4H"})[0] == 200
            expect(item.locator(".nudged")).to_have_text(" · reminded 1 time")
            for _ in range(2):                  # in steps shorter than a session's 12 h idle limit, the page used
                assert page.request.get(served.url + "/web/session").status == 200
                assert served.call("POST", "/v1/admin/clock", {"advance": "PT10H"})[0] == 200
            expect(item.locator(".nudged")).to_have_text(" · reminded 2 times")
            expect(item.locator("h2 .to")).to_have_text("for ana and bo")
        finally:
            browser.close()

