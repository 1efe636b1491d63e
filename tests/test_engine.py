"""The engine on its own: no HTTP app, a temporary store (SQLite, then PostgreSQL), the manual clock.

Each test drives the engine's operations directly and checks the run object and the events its
store recorded; the system call goes to a real MCP tool server started as a subprocess."""
from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import interactiond as itd
from daemon_kit import APPROVAL, START_MS

FLAKY = str(Path(__file__).parent / "servers" / "flaky_server.py")
PB = "local/default"
OP = itd.OPERATOR_LOCAL

ECHO = """---
description: Asks the flaky server to echo a text
call:
  server: flaky
  tool: echo
  with: {text: '{{ input.text }}'}
  read: /echo
input:
  schema:
    type: object
    required: [text]
    properties:
      text: { type: string }
output:
  schema: { type: string }
---
"""


@pytest.fixture
async def engine(db, tmp_path):
    config = itd.Config(servers={"flaky": itd.ServerConfig(
                            "flaky", command=(sys.executable, FLAKY, "--calls-log", str(tmp_path / "calls.jsonl")))},
                        playbooks={PB: ("flaky",)})
    eng = itd.Engine(itd.Store(db), itd.ManualClock(START_MS), config)
    await eng.store.open()
    await eng.start()
    eng.calls_log = tmp_path / "calls.jsonl"
    yield eng
    await eng.stop()
    await eng.store.close()


async def event_types(eng: itd.Engine, run_id: str) -> list[str]:
    page = await eng.list_run_events(OP, PB, run_id)
    assert page["next_cursor"] is None
    return [e["type"] for e in page["data"]]


async def ask(eng: itd.Engine, kind: str, run_id: str | None = None, **input_: Any) -> tuple[dict[str, Any], bool]:
    return await eng.run_definition(OP, PB, "interaction", "ask-" + kind, {"prompt": "Ship it?", "to": "ana", **input_},
                                    run_id)


async def test_an_ask_function_answered(engine):
    run, fresh = await ask(engine, "approval")
    assert fresh and run["status"] == "started" and run["type"] == "interaction" and run["name"] == "ask-approval"
    assert run["input"] == {"prompt": "Ship it?", "to": "ana"} and run["output"] is None
    open_ = (await engine.list_interactions(OP, PB, to="ana"))["data"]
    assert [r["run_id"] for r in open_] == [run["run_id"]] and open_[0]["message"].strip() == "Ship it?"
    assert open_[0]["answer_schema"]["required"] == ["approved"]
    # A waiter that asks after the answer gets the ended run at once.
    fact, new = await engine.answer_interaction(OP, PB, run["run_id"], {"approved": True, "comment": "go"})
    assert new and fact["answer"] == {"approved": True, "comment": "go"} and fact["answered_by"] == "local"
    ended = await engine.wait_run(OP, PB, run["run_id"], 0.5)
    assert ended["status"] == "succeeded" and ended["output"] == {"approved": True, "comment": "go"}
    assert ended["problem"] is None and ended["ended_at"] == itd.fmt_time(START_MS)
    assert await event_types(engine, run["run_id"]) == ["interaction_requested", "request_answered", "run_succeeded"]
    assert (await engine.list_interactions(OP, PB, to="ana"))["data"] == []
    # The same answer again is the same fact, not a new one; another is refused.
    again, new = await engine.answer_interaction(OP, PB, run["run_id"], {"approved": True, "comment": "go"})
    assert not new and again == fact
    with pytest.raises(itd.Problem) as exc:
        await engine.answer_interaction(OP, PB, run["run_id"], {"approved": False})
    assert exc.value.name == "answered" and exc.value.status == 409


async def test_a_question_expires_on_the_manual_clock(engine):
    run, _ = await ask(engine, "text", expires="PT10M")
    await engine.advance(timedelta(minutes=9, seconds=59))
    assert (await engine.get_run(OP, PB, run["run_id"]))["status"] == "waiting"
    await engine.advance(timedelta(seconds=1))
    ended = await engine.get_run(OP, PB, run["run_id"])
    assert ended["status"] == "rejected" and ended["kind"] == "expired"
    assert ended["problem"]["type"] == "/problems/unanswered" and ended["problem"]["status"] == 410
    assert ended["ended_at"] == itd.fmt_time(START_MS + 600_000)
    assert await event_types(engine, run["run_id"]) == ["interaction_requested", "run_rejected"]
    with pytest.raises(itd.Problem) as exc:
        await engine.answer_interaction(OP, PB, run["run_id"], {"text": "late"})
    assert exc.value.name == "not_open" and exc.value.kind == "expired"


async def test_the_timer_wheel_holds_one_window_of_due_times(engine):
    """Due times past the wheel's window stay in the store until the window reaches them; each
    still fires at its own moment, after a restart too."""
    near, _ = await ask(engine, "text", expires="PT10M")
    later, _ = await ask(engine, "text", expires="PT3H")
    far, _ = await ask(engine, "text", expires="P2D")
    held = {key.split(":", 2)[2] for key in engine.wheel._due}
    assert near["run_id"] in held and later["run_id"] not in held and far["run_id"] not in held
    assert engine.wheel.horizon == START_MS + itd.TIMER_WINDOW_MS
    await engine.advance(timedelta(hours=2, minutes=30))           # two windows on: P3H's is held now
    held = {key.split(":", 2)[2] for key in engine.wheel._due}
    assert later["run_id"] in held and far["run_id"] not in held
    assert (await engine.get_run(OP, PB, near["run_id"]))["kind"] == "expired"
    assert (await engine.get_run(OP, PB, later["run_id"]))["status"] == "waiting"
    await engine.advance(timedelta(minutes=30))
    ended = await engine.get_run(OP, PB, later["run_id"])
    assert ended["kind"] == "expired" and ended["ended_at"] == itd.fmt_time(START_MS + 3 * 3_600_000)
    # A restart reads the first window only; the far one still expires at its moment.
    await engine.stop()
    again = itd.Engine(engine.store, engine.clock, engine.config)
    await again.start()
    try:
        assert far["run_id"] not in {key.split(":", 2)[2] for key in again.wheel._due}
        await again.advance(timedelta(days=2) - timedelta(hours=3, seconds=1))
        assert (await again.get_run(OP, PB, far["run_id"]))["status"] == "waiting"
        await again.advance(timedelta(seconds=1))
        ended = await again.get_run(OP, PB, far["run_id"])
        assert ended["kind"] == "expired" and ended["ended_at"] == itd.fmt_time(START_MS + 2 * 86_400_000)
    finally:
        await again.stop()
        await engine.start()                                # the fixture stops what it started


async def test_a_cancel_ends_the_run_once(engine):
    run, _ = await ask(engine, "confirmation", run_id="to-cancel")
    cancelled = await engine.cancel_run(OP, PB, "to-cancel")
    assert cancelled["status"] == "rejected" and cancelled["kind"] == "cancelled"
    assert cancelled["problem"]["type"] == "/problems/cancelled"
    assert await engine.cancel_run(OP, PB, "to-cancel") == cancelled           # a second cancel: the same run
    assert await event_types(engine, "to-cancel") == ["interaction_requested", "run_rejected"]
    # Its expiry timer went with it: nothing more happens when the question would have expired.
    await engine.advance(timedelta(days=2))
    assert await engine.get_run(OP, PB, "to-cancel") == cancelled
    with pytest.raises(itd.Problem) as exc:
        await engine.answer_interaction(OP, PB, "to-cancel", {"confirmed": True})
    assert exc.value.name == "not_open" and exc.value.kind == "cancelled"
    with pytest.raises(itd.Problem) as exc:
        await engine.cancel_run(OP, PB, "no-such-run")
    assert exc.value.name == "not_found"


async def test_a_rerun_under_the_same_id(engine):
    await engine.create_definition(OP, PB, "interaction", "approve", APPROVAL)
    input_ = {"owner": "ana", "review": "fine"}
    first, fresh = await engine.run_definition(OP, PB, "interaction", "approve", input_, "r-1")
    assert fresh and first["status"] == "started"
    again, fresh = await engine.run_definition(OP, PB, "interaction", "approve", dict(reversed(input_.items())), "r-1")
    assert not fresh and again == dict(first, status="waiting")       # the run as it stands; no second request
    assert len((await engine.list_interactions(OP, PB))["data"]) == 1
    with pytest.raises(itd.Problem) as exc:
        await engine.run_definition(OP, PB, "interaction", "approve", {"owner": "ana", "review": "other"}, "r-1")
    assert exc.value.name == "run_id_taken" and exc.value.status == 409
    await engine.answer_interaction(OP, PB, "r-1", {"verdict": "approve"})
    done, fresh = await engine.run_definition(OP, PB, "interaction", "approve", input_, "r-1")
    assert not fresh and done["status"] == "succeeded" and done["output"] == {"verdict": "approve"}
    assert await event_types(engine, "r-1") == ["interaction_requested", "request_answered", "run_succeeded"]


async def test_a_system_call_against_a_real_tool_server(engine):
    await engine.create_definition(OP, PB, "interaction", "echo", ECHO)
    run, fresh = await engine.run_definition(OP, PB, "interaction", "echo", {"text": "hello"}, "call-1")
    assert fresh and run["status"] == "succeeded" and run["output"] == "hello" and run["kind"] is None
    calls = [json.loads(line) for line in engine.calls_log.read_text().splitlines()]
    assert calls == [{"tool": "echo", "arguments": {"text": "hello"}}]
    events = (await engine.list_run_events(OP, PB, "call-1"))["data"]
    assert [e["type"] for e in events] == ["tool_call_started", "tool_call_answered", "run_succeeded"]
    assert events[0]["payload"]["arguments"] == {"text": "hello"} and events[0]["payload"]["read_only"] is True
    assert events[1]["payload"]["is_error"] is False
    # Run again under its id: the same run, and the tool is not called again.
    again, fresh = await engine.run_definition(OP, PB, "interaction", "echo", {"text": "hello"}, "call-1")
    assert not fresh and again == run
    assert len(engine.calls_log.read_text().splitlines()) == 1


async def test_a_timer_kind_registered_with_the_engine_fires_on_the_manual_clock(engine, caplog):
    fired: list[tuple[str, str, str, int]] = []

    async def probe(playbook: str, ref: str, key: str) -> None:
        fired.append((playbook, ref, key, engine.clock.now_ms()))

    engine.on_timer("probe", probe)
    engine.on_timer("aside", probe, side=True)                 # fired as a task of its own
    engine.wheel.set("probe:-:one", START_MS + 5_000)
    engine.wheel.set("aside:acme/x:two", START_MS + 6_000)
    engine.wheel.set("nobody:-:three", START_MS + 1_000)       # a kind nobody registered is dropped
    await engine.advance(timedelta(seconds=4))
    assert fired == []
    assert "timer of unknown kind nobody dropped" in caplog.text
    await engine.advance(timedelta(seconds=2))
    assert fired == [("-", "one", "probe:-:one", START_MS + 5_000), ("acme/x", "two", "aside:acme/x:two", START_MS + 6_000)]


async def test_the_parts_work_without_the_facade(db):
    """A part is built with only what it uses: definitions and runs over a bare store and clock."""
    clock = itd.ManualClock(START_MS)
    store = itd.Store(db)
    bus = store.make_bus(clock)
    store.on_commit = bus.deliver
    await store.open()
    try:
        await store.write(lambda tx, fx: tx.ensure_playbook(PB, now=START_MS))
        config = itd.Config(playbooks={PB: ()})
        definitions = itd.Definitions(store, clock, {})
        tools = itd.ToolServers(config, store, clock)
        calls = itd.ToolCalls(store, clock, tools)
        approvals = itd.Approvals(store, clock, tools, calls, 1, definitions.document)
        system_calls = itd.SystemCalls(store, clock, tools, config, calls, approvals)
        runs = itd.Runs(store, clock, bus, definitions, system_calls, {}, open_limit=1)
        saved, created = await definitions.create_definition(OP, PB, "interaction", "approve", APPROVAL)
        assert created and saved["version"] == 1
        run, fresh = await runs.run_definition(OP, PB, "interaction", "approve", {"owner": "ana", "review": "x"})
        assert fresh and run["status"] == "started"
        full, _ = await runs.run_definition(OP, PB, "interaction", "approve", {"owner": "bo", "review": "x"})
        assert full["status"] == "unavailable" and full["kind"] == "requests_full"       # its open_limit of 1
        assert (await runs.cancel_run(OP, PB, run["run_id"]))["kind"] == "cancelled"
    finally:
        await store.close()
