"""Workflows (SPEC section 15) over the real HTTP API, on the manual clock, with real child runs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import interactiond as itd
from daemon_kit import APPROVAL, START_MS, start_daemon

ROOT = Path(__file__).resolve().parent.parent
FLAKY = str(Path(__file__).parent / "servers" / "flaky_server.py")

#: The behaviour reference's example, unchanged: its problem URI is not ours and must still match.
SEED = """\
document:
  dsl: '1.0.3'
  namespace: campaign-review-tutorial
  name: brief-approval
  version: '1.0.0'
  summary: Asks the campaign's owner to approve a review, and asks for a revision when nobody answered.
input:
  schema:
    document:
      type: object
      required: [owner, review]
do:
  - approval:
      try:
        - ask:
            call: run_definition
            with:
              type: interaction
              name: approve-campaign-brief
              input: '${ $data }'
      catch:
        errors:
          with: { type: https://on.auto/problems/unanswered, kind: expired }
        do:
          - unanswered: { set: { verdict: revise, note: No answer within two days } }
"""

INPUT = {"owner": "ana", "review": "Clear goals; budget missing."}
DEFAULT = {"verdict": "revise", "note": "No answer within two days"}


def workflow(name: str, body: str) -> str:
    return (f"document: {{dsl: '1.0.3', namespace: tests, name: {name}, version: '1.0.0'}}\n" + body)


@pytest.fixture
async def d(db, aiohttp_client):
    return await start_daemon(aiohttp_client, db)


@pytest.fixture
async def sd(db, tmp_path, aiohttp_client):
    """A daemon whose playbook may use the flaky tool server; `calls()` lists the tools it called."""
    log = tmp_path / "calls.jsonl"
    servers = {"flaky": itd.ServerConfig("flaky", command=(sys.executable, FLAKY, "--calls-log", str(log)))}
    config = itd.Config(servers=servers, playbooks={"local/default": ("flaky",), "acme/other": ()})
    daemon = await start_daemon(aiohttp_client, db, config=config)
    daemon.calls = lambda: [json.loads(x)["tool"] for x in log.read_text().splitlines()] if log.exists() else []
    return daemon


async def define_wf(d, name: str, source: str) -> tuple[int, dict]:
    return await d.call("POST", "/definitions", {"type": "workflow", "name": name, "source": source})


async def start(d, name: str, input_) -> dict:
    status, run = await d.call("POST", "/runs", {"type": "workflow", "name": name, "input": input_})
    assert status == 202 and run["status"] == "started", run
    await d.advance("PT0S")
    return run


async def get_run(d, run_id: str) -> dict:
    return (await d.call("GET", f"/runs/{run_id}"))[1]


async def history(d, run_id: str) -> list[dict]:
    return (await d.call("GET", f"/runs/{run_id}/events?limit=200"))[1]["data"]


def steps(events: list[dict]) -> list[tuple[str, str | None]]:
    return [(e["type"], e["payload"].get("task")) for e in events]


def child_of(events: list[dict], task: str) -> str:
    return next(e["payload"]["run"]["run_id"] for e in events if e["type"] == "task_started" and e["payload"]["task"] == task)


async def inbox(d) -> list[dict]:
    return (await d.call("GET", "/interactions"))[1]["data"]


# -- the behaviour reference's example, both ways ------------------------------------------------------

async def test_seed_example_answered_gives_the_answer(d):
    await d.define("approve-campaign-brief", APPROVAL)
    status, saved = await define_wf(d, "brief-approval", SEED)
    assert status == 201 and saved["media_type"] == "application/yaml" and saved["warnings"] == []
    run = await start(d, "brief-approval", INPUT)
    got = await get_run(d, run["run_id"])
    assert got["status"] == "waiting" and got["type"] == "workflow"

    events = await history(d, run["run_id"])
    child = child_of(events, "ask")
    requests = await inbox(d)
    assert [r["run_id"] for r in requests] == [child] and requests[0]["to"] == "ana"
    assert (await get_run(d, child))["input"] == INPUT          # `$data` is the workflow's input here

    answer = {"verdict": "approve"}
    status, _ = await d.call("POST", f"/runs/{child}/answer", {"answer": answer})
    assert status == 200
    await d.advance("PT0S")
    got = await get_run(d, run["run_id"])
    assert got["status"] == "succeeded" and got["output"] == answer, got
    events = await history(d, run["run_id"])
    assert steps(events) == [("task_started", "approval"), ("task_started", "ask"), ("task_completed", "ask"),
                             ("task_completed", "approval"), ("run_succeeded", None)]
    assert events[2]["payload"]["run_id"] == child and events[2]["payload"]["output"] == answer


async def test_seed_example_expired_gives_the_catch_default(d):
    await d.define("approve-campaign-brief", APPROVAL)
    await define_wf(d, "brief-approval", SEED)
    run = await start(d, "brief-approval", INPUT)
    child = child_of(await history(d, run["run_id"]), "ask")
    await d.advance("PT47H59M59S")
    assert (await get_run(d, run["run_id"]))["status"] == "waiting"
    await d.advance("PT1S")
    assert (await get_run(d, child))["kind"] == "expired"
    got = await get_run(d, run["run_id"])
    assert got["status"] == "succeeded" and got["output"] == DEFAULT, got
    assert got["ended_at"] == itd.fmt_time(START_MS + 2 * 86400_000)
    events = await history(d, run["run_id"])
    assert steps(events) == [("task_started", "approval"), ("task_started", "ask"), ("task_faulted", "ask"),
                             ("task_started", "unanswered"), ("task_completed", "unanswered"),
                             ("task_completed", "approval"), ("run_succeeded", None)]
    error = events[2]["payload"]["error"]
    assert error["type"] == "/problems/unanswered" and error["status"] == 410 and error["kind"] == "expired"
    assert error["instance"] == "/do/0/approval/try/0/ask" and error["run_id"] == child
    assert await inbox(d) == []


async def test_errors_with_fields_are_anded_and_an_uncaught_error_ends_the_run(d):
    await d.define("approve-campaign-brief", APPROVAL)
    # Right type, wrong kind: an expiry is not an undelivered notification, so nothing catches it.
    source = SEED.replace("kind: expired", "kind: undelivered")
    await define_wf(d, "brief-approval", source)
    run = await start(d, "brief-approval", INPUT)
    await d.advance("P2D")
    status, got = await d.call("POST", f"/runs/{run['run_id']}/wait?timeout=0")
    assert status == 410 and got["status"] == "rejected" and got["kind"] == "expired", got
    assert got["problem"]["type"] == "/problems/unanswered" and got["problem"]["status"] == 410
    assert [t for t, _ in steps(await history(d, run["run_id"]))][-3:] == ["task_faulted", "task_faulted", "run_rejected"]


async def test_the_example_files(d):
    await d.define("approve-brief", (ROOT / "examples" / "approve-brief.md").read_text())
    status, saved = await define_wf(d, "brief-approval", (ROOT / "examples" / "brief-approval.yaml").read_text())
    assert status == 201 and saved["warnings"] == [], saved
    run = await start(d, "brief-approval", {"editor": "eva", "title": "Q3", "draft": "Text."})
    await d.advance("P3D")
    got = await get_run(d, run["run_id"])
    assert got["output"] == {"decision": "rework", "remarks": "No answer within three days"}, got
    status, saved = await define_wf(d, "system-retry", (ROOT / "examples" / "system-retry.yaml").read_text())
    assert status == 201 and [w["field"] for w in saved["warnings"]] == ["do.0.fetch.try.0.read.with.name"]


# -- retries on 503 ------------------------------------------------------------------------------

def system_fn(tool: str, read: str | None = None) -> str:
    lines = ["---", "call:", "  server: flaky", f"  tool: {tool}", "  with: {text: '{{ input.text }}'}"]
    if read:
        lines.append(f"  read: {read}")
    output = "{type: string}" if read else "{}"
    return "\n".join(lines + ["input:", "  schema: {type: object, required: [text]}", "output:", f"  schema: {output}",
                              "---", ""])


RETRY = workflow("fetch-text", """\
do:
  - fetch:
      try:
        - look:
            call: run_definition
            with: {type: interaction, name: lookup, input: {text: '${ $workflow.input.text }'}}
      catch:
        errors:
          with: {status: 503}
        retry:
          delay: PT10S
          backoff: {BACKOFF: {}}
          limit: {attempt: {count: COUNT}}
""")


async def test_retry_on_503_runs_a_tools_unfinished_call_again(sd):
    await sd.define("lookup", system_fn("fail_ro"))
    await define_wf(sd, "fetch-text", RETRY.replace("BACKOFF", "constant").replace("COUNT", "3"))
    run = await start(sd, "fetch-text", {"text": "hi"})
    assert sd.calls() == ["fail_ro"]
    got = await get_run(sd, run["run_id"])
    assert got["status"] == "waiting"
    events = await history(sd, run["run_id"])
    assert steps(events) == [("task_started", "fetch"), ("task_started", "look"), ("task_faulted", "look"),
                             ("task_retried", "fetch")]
    error = events[2]["payload"]["error"]
    assert error["status"] == 503 and error["kind"] == "tools_unfinished"
    assert events[3]["payload"]["attempt"] == 2 and events[3]["payload"]["delay_ms"] == 10_000

    # The tool is mended before the retry comes: the second attempt is a new call under a new run id.
    await sd.define("lookup", system_fn("echo", read="/echo"))
    await sd.advance("PT9S")
    assert sd.calls() == ["fail_ro"]
    await sd.advance("PT1S")
    assert sd.calls() == ["fail_ro", "echo"]
    got = await get_run(sd, run["run_id"])
    assert got["status"] == "succeeded" and got["output"] == "hi", got
    events = await history(sd, run["run_id"])
    children = [e["payload"]["run"]["run_id"] for e in events if e["type"] == "task_started" and "run" in e["payload"]]
    assert len(set(children)) == 2


async def test_retry_on_503_leaves_effect_unknown_alone(sd):
    await sd.define("lookup", system_fn("fail_rw"))
    await define_wf(sd, "fetch-text", RETRY.replace("BACKOFF", "constant").replace("COUNT", "3"))
    run = await start(sd, "fetch-text", {"text": "hi"})
    await sd.advance("PT1M")
    assert sd.calls() == ["fail_rw"]
    status, got = await sd.call("POST", f"/runs/{run['run_id']}/wait?timeout=0")
    assert status == 409 and got["status"] == "conflict" and got["kind"] == "effect_unknown", got
    assert got["problem"]["type"] == "/problems/effect_unknown" and got["problem"]["status"] == 409
    assert "task_retried" not in [e["type"] for e in await history(sd, run["run_id"])]


async def test_retries_used_up_raise_the_last_error(sd):
    await sd.define("lookup", system_fn("fail_ro"))
    await define_wf(sd, "fetch-text", RETRY.replace("BACKOFF", "exponential").replace("COUNT", "3"))
    run = await start(sd, "fetch-text", {"text": "hi"})
    await sd.advance("PT10S")
    assert sd.calls() == ["fail_ro"] * 2
    await sd.advance("PT19S")                      # exponential: the next is 20 s after the second
    assert sd.calls() == ["fail_ro"] * 2
    await sd.advance("PT1S")
    assert sd.calls() == ["fail_ro"] * 3            # count 3: every attempt, the first included
    status, got = await sd.call("POST", f"/runs/{run['run_id']}/wait?timeout=0")
    assert status == 503 and got["status"] == "unavailable" and got["kind"] == "tools_unfinished", got
    assert [e["type"] for e in await history(sd, run["run_id"])].count("task_retried") == 2


# -- durability ------------------------------------------------------------------------------------

async def test_restart_while_waiting_on_a_person(db, aiohttp_client):
    d1 = await start_daemon(aiohttp_client, db)
    await d1.define("approve-campaign-brief", APPROVAL)
    await define_wf(d1, "brief-approval", SEED)
    run = await start(d1, "brief-approval", INPUT)
    child = child_of(await history(d1, run["run_id"]), "ask")
    await d1.advance("PT1H")
    now = d1.clock.now_ms()
    await d1.client.close()

    d2 = await start_daemon(aiohttp_client, db, clock=itd.ManualClock(now), tokens=d1.tokens)
    await d2.advance("PT0S")
    assert (await get_run(d2, run["run_id"]))["status"] == "waiting"
    assert [r["run_id"] for r in await inbox(d2)] == [child]
    await d2.call("POST", f"/runs/{child}/answer", {"answer": {"verdict": "approve", "note": "Fine."}})
    await d2.advance("PT0S")
    got = await get_run(d2, run["run_id"])
    assert got["status"] == "succeeded" and got["output"] == {"verdict": "approve", "note": "Fine."}, got


async def test_a_child_that_ended_before_its_workflow_moved_is_picked_up_at_restart(db, aiohttp_client):
    d1 = await start_daemon(aiohttp_client, db)
    await d1.define("approve-campaign-brief", APPROVAL)
    await define_wf(d1, "brief-approval", SEED)
    run = await start(d1, "brief-approval", INPUT)
    child = child_of(await history(d1, run["run_id"]), "ask")

    async def stopped(playbook, run_id):          # the daemon dies before the workflow moves on
        return None
    d1.engine.kinds["workflow"].drive = stopped
    await d1.call("POST", f"/runs/{child}/answer", {"answer": {"verdict": "approve"}})
    await d1.advance("PT0S")
    assert (await get_run(d1, run["run_id"]))["status"] == "waiting"
    now = d1.clock.now_ms()
    await d1.client.close()
    tx = itd.open_sync(db)
    due = tx.timer_due(f"workflow:local/default:{run['run_id']}")
    tx.close()
    assert due is not None and due <= now           # written with the child's ending

    d2 = await start_daemon(aiohttp_client, db, clock=itd.ManualClock(now), tokens=d1.tokens)
    await d2.advance("PT0S")
    got = await get_run(d2, run["run_id"])
    assert got["status"] == "succeeded" and got["output"] == {"verdict": "approve"}, got


async def test_an_expiry_while_the_daemon_was_down_takes_the_catch(db, aiohttp_client):
    d1 = await start_daemon(aiohttp_client, db)
    await d1.define("approve-campaign-brief", APPROVAL)
    await define_wf(d1, "brief-approval", SEED)
    run = await start(d1, "brief-approval", INPUT)
    await d1.client.close()
    d2 = await start_daemon(aiohttp_client, db, clock=itd.ManualClock(START_MS + 3 * 86400_000), tokens=d1.tokens)
    await d2.advance("PT0S")
    got = await get_run(d2, run["run_id"])
    assert got["status"] == "succeeded" and got["output"] == DEFAULT, got


# -- cancel and time ------------------------------------------------------------------------------------

async def test_cancel_a_waiting_workflow_cancels_its_request(d):
    await d.define("approve-campaign-brief", APPROVAL)
    await define_wf(d, "brief-approval", SEED)
    run = await start(d, "brief-approval", INPUT)
    child = child_of(await history(d, run["run_id"]), "ask")
    assert len(await inbox(d)) == 1
    status, got = await d.call("POST", f"/runs/{run['run_id']}/cancel")
    assert status == 200 and got["status"] == "rejected" and got["kind"] == "cancelled", got
    assert got["problem"]["type"] == "/problems/cancelled"
    assert await inbox(d) == []
    kid = await get_run(d, child)
    assert kid["status"] == "rejected" and kid["kind"] == "cancelled"
    status, _ = await d.call("POST", f"/runs/{child}/answer", {"answer": {"verdict": "approve"}})
    assert status == 409
    before = await history(d, run["run_id"])
    await d.advance("P3D")
    assert await history(d, run["run_id"]) == before
    assert before[-1]["type"] == "run_rejected"


async def test_a_task_timeout_cancels_the_request_and_raises_the_dsl_timeout(d):
    await d.define("approve-campaign-brief", APPROVAL)
    await define_wf(d, "quick", workflow("quick", """\
do:
  - approval:
      try:
        - ask:
            call: run_definition
            with: {name: approve-campaign-brief, input: '${ $input }'}
            timeout: {after: PT1H}
      catch:
        errors:
          with: {type: https://serverlessworkflow.io/spec/1.0.0/errors/timeout}
        as: late
        do:
          - fallback: {set: {verdict: revise, note: '${ $late.detail }', status: '${ $late.status }'}}
"""))
    run = await start(d, "quick", INPUT)
    child = child_of(await history(d, run["run_id"]), "ask")
    await d.advance("PT59M59S")
    assert len(await inbox(d)) == 1
    await d.advance("PT1S")
    assert await inbox(d) == []
    assert (await get_run(d, child))["kind"] == "cancelled"
    got = await get_run(d, run["run_id"])
    assert got["status"] == "succeeded" and got["output"]["status"] == 408, got
    assert "'ask' ran out of time" in got["output"]["note"]


async def test_switch_wait_context_and_output(d):
    await define_wf(d, "route", workflow("route", """\
input:
  schema:
    document: {type: object, required: [n], properties: {n: {type: integer}}}
do:
  - choose:
      switch:
        - big: {when: '${ .n > 10 }', then: pause}
        - small: {then: sum}
  - pause:
      wait: PT1H
      export: {as: '${ $context + {paused: true} }'}
  - sum:
      set:
        n: '${ $input.n }'
        paused: '${ $context.paused // false }'
        first: '${ $workflow.input.n }'
        task: '${ $task.name }'
output:
  as: '${ . + {done: true} }'
"""))
    small = await start(d, "route", {"n": 3})
    got = await get_run(d, small["run_id"])
    assert got["output"] == {"n": 3, "paused": False, "first": 3, "task": "sum", "done": True}, got
    assert "pause" not in [t for _, t in steps(await history(d, small["run_id"]))]

    big = await start(d, "route", {"n": 30})
    assert (await get_run(d, big["run_id"]))["status"] == "waiting"
    await d.advance("PT59M")
    assert (await get_run(d, big["run_id"]))["status"] == "waiting"
    await d.advance("PT1M")
    got = await get_run(d, big["run_id"])
    assert got["output"] == {"n": 30, "paused": True, "first": 30, "task": "sum", "done": True}, got

    status, bad = await d.call("POST", "/runs", {"type": "workflow", "name": "route", "input": {"n": "x"}})
    assert status == 422 and bad["status"] == "invalid_input" and bad["problem"]["errors"][0]["pointer"] == "/input/n"


async def test_a_jq_error_names_its_task(d):
    await define_wf(d, "greet", workflow("greet", """\
do:
  - prepare:
      set: {owner: '${ .owner }'}
  - shout:
      set: {text: '${ .owner | ascii_upcase }'}
"""))
    run = await start(d, "greet", {"owner": 5})
    got = await get_run(d, run["run_id"])
    assert got["status"] == "invalid_input", got
    problem = got["problem"]
    assert problem["type"] == "/problems/expression" and problem["status"] == 400
    assert "task 'shout'" in problem["detail"] and "ascii_upcase" in problem["detail"]
    assert problem["instance"] == "/do/1/shout"
    assert steps(await history(d, run["run_id"]))[-2:] == [("task_faulted", "shout"), ("run_invalid_input", None)]


async def test_expressions_cannot_read_the_environment(d):
    await define_wf(d, "peek", workflow("peek", "do:\n  - look: {set: {e: '${ env }', h: '${ $ENV.HOME }'}}\n"))
    run = await start(d, "peek", {})
    assert (await get_run(d, run["run_id"]))["output"] == {"e": {}, "h": None}


async def test_a_child_with_invalid_input_raises_400(d):
    await d.define("approve-campaign-brief", APPROVAL)
    await define_wf(d, "careless", workflow("careless", """\
do:
  - ask:
      call: run_definition
      with: {name: approve-campaign-brief, input: {owner: '${ .owner }'}}
"""))
    run = await start(d, "careless", {"owner": "ana"})
    got = await get_run(d, run["run_id"])
    assert got["status"] == "invalid_input" and got["problem"]["status"] == 400, got
    assert got["problem"]["type"] == "/problems/invalid_input" and got["problem"]["errors"]


# -- save time --------------------------------------------------------------------------------------

BROKEN = """\
document:
  dsl: '1.0.3'
  namespace: tests
  name: other-name
  version: '1.0.0'
use: {}
do:
  - ask:
      call: http
      with: {method: get}
  - pause:
      wait: PT1Q
  - shout:
      set: {text: '${ .owner | }'}
      then: nowhere
  - loop:
      for: {each: x, in: '${ . }'}
  - guard:
      try:
        - fine: {set: {a: 1}}
      catch:
        retry: {delay: PT1S}
  - pause:
      wait: PT1S
"""


async def test_save_time_refusals_come_together_with_lines(d):
    status, body = await define_wf(d, "broken", BROKEN)
    assert status == 422 and body["type"] == "/problems/invalid_document", body
    got = {(e["line"], e["field"]) for e in body["errors"]}
    assert got == {
        (4, "document.name"),                 # differs from the definition's name
        (6, "use"),                           # outside the subset
        (9, "do.0.ask.call"),                 # only run_definition
        (12, "do.1.pause.wait"),              # not a duration
        (14, "do.2.shout.set.text"),          # jq does not compile
        (15, "do.2.shout.then"),              # no such task
        (17, "do.3.loop.for"),                # a DSL task interactiond does not run
        (22, "do.4.guard.catch.retry"),       # a retry that never ends
        (23, "do.5"),                         # a task name used twice
    }, body["errors"]
    messages = {e["field"]: e["message"] for e in body["errors"]}
    assert "'other-name'" in messages["document.name"] and "'broken'" in messages["document.name"]
    assert "does not compile" in messages["do.2.shout.set.text"]
    # Duplicate keys and anchors are refused by the same reader as function documents.
    status, body = await define_wf(d, "dup", workflow("dup", "do:\n  - a: {set: {x: 1}}\ndo: []\n"))
    assert status == 422 and body["errors"][0]["line"] == 4 and "twice" in body["errors"][0]["message"]


async def test_a_missing_function_is_a_warning_then_a_clear_failure(d):
    status, saved = await define_wf(d, "lonely", workflow("lonely", """\
do:
  - ask:
      call: run_definition
      with: {type: interaction, name: nobody-here, input: '${ . }'}
"""))
    assert status == 201
    assert saved["warnings"] == [{"line": 5, "field": "do.0.ask.with.name", "message": saved["warnings"][0]["message"]}]
    assert "nobody-here" in saved["warnings"][0]["message"]
    run = await start(d, "lonely", INPUT)
    got = await get_run(d, run["run_id"])
    assert got["status"] == "failed" and got["problem"]["type"] == "/problems/not_found", got
    assert "task 'ask'" in got["problem"]["detail"] and "nobody-here" in got["problem"]["detail"]
    # Saved later, the next run gets through to the request.
    await d.define("nobody-here", APPROVAL)
    run = await start(d, "lonely", INPUT)
    assert (await get_run(d, run["run_id"]))["status"] == "waiting"


async def test_used_by_lists_the_active_workflows(d):
    await d.define("approve-campaign-brief", APPROVAL)
    _, fn = await d.call("GET", "/definitions/interaction/approve-campaign-brief")
    assert fn["used_by"] == [] and "Used by" not in fn["overview"]
    await define_wf(d, "brief-approval", SEED)
    _, fn = await d.call("GET", "/definitions/interaction/approve-campaign-brief")
    assert fn["used_by"] == [{"type": "workflow", "name": "brief-approval", "version": 1}]
    assert fn["overview"].rstrip().endswith("**Used by:** brief-approval")
    _, wf = await d.call("GET", "/definitions/workflow/brief-approval")
    assert "approve-campaign-brief" in wf["overview"] and wf["source"] == SEED
    await d.call("DELETE", "/definitions/workflow/brief-approval")
    _, fn = await d.call("GET", "/definitions/interaction/approve-campaign-brief")
    assert fn["used_by"] == []


async def test_a_workflow_calls_a_workflow_and_cancel_reaches_the_request(d):
    await d.define("approve-campaign-brief", APPROVAL)
    await define_wf(d, "brief-approval", SEED)
    await define_wf(d, "outer", workflow("outer", """\
do:
  - inner:
      call: run_definition
      with: {type: workflow, name: brief-approval, input: '${ $input }'}
      output: {as: '${ {inner: .} }'}
"""))
    first = await start(d, "outer", INPUT)
    inner = child_of(await history(d, first["run_id"]), "inner")
    assert (await get_run(d, inner))["status"] == "waiting"
    ask = child_of(await history(d, inner), "ask")
    await d.call("POST", f"/runs/{ask}/answer", {"answer": {"verdict": "approve"}})
    await d.advance("PT0S")
    assert (await get_run(d, first["run_id"]))["output"] == {"inner": {"verdict": "approve"}}

    second = await start(d, "outer", INPUT)
    inner = child_of(await history(d, second["run_id"]), "inner")
    ask = child_of(await history(d, inner), "ask")
    await d.call("POST", f"/runs/{second['run_id']}/cancel")
    assert [(await get_run(d, r))["kind"] for r in (second["run_id"], inner, ask)] == ["cancelled"] * 3
    assert await inbox(d) == []


async def test_a_runaway_expression_is_stopped_and_the_daemon_carries_on(d, monkeypatch):
    monkeypatch.setattr(itd, "JQ_TIMEOUT_S", 0.5)
    await define_wf(d, "spin", workflow("spin", "do:\n  - loop: {set: {n: '${ last(range(1e15)) }'}}\n"))
    await define_wf(d, "calm", workflow("calm", "do:\n  - add: {set: {n: '${ .n + 1 }'}}\n"))
    run = await start(d, "spin", {})
    got = await get_run(d, run["run_id"])
    assert got["status"] == "invalid_input" and "was stopped" in got["problem"]["detail"], got
    assert "task 'loop'" in got["problem"]["detail"]
    run = await start(d, "calm", {"n": 1})
    assert (await get_run(d, run["run_id"]))["output"] == {"n": 2}
