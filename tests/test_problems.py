"""The problem envelope of every problem type the daemon can answer with.

PROBLEM_TYPES (the Problems section) is the registry: every problem name the module raises must be
in it, and each has the documented envelope - `{type: /problems/<name>, title, status, detail,
kind?, errors?}`, served as application/problem+json with the HTTP status of its body, `code` beside
them on /v2, and a `type` that resolves on the daemon. Most are triggered for real through the app;
the few only a workflow or a breakdown reaches are checked as the function that renders every
problem over HTTP renders them."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

import interactiond as itd
from daemon_kit import NOTIFY, person_token, start_daemon

ROOT = Path(__file__).resolve().parent.parent
FLAKY = str(Path(__file__).parent / "servers" / "flaky_server.py")
MIB = 1024 * 1024

#: Raised for real below only as a run's recorded problem, by a workflow, or by a breakdown; `declined`
#: (a refused approval) is raised for real in tests/test_approval.py.
RENDERED_ONLY = {"unanswered", "cancelled", "failed", "timeout", "expression", "declined"}

SYSTEM_RW = """---
description: Writes through the flaky server, which fails
call:
  server: flaky
  tool: fail_rw
  with: {text: x}
input:
  schema: {type: object}
output:
  schema: {}
---
"""


def names_raised_in_the_module() -> dict[str, set[str]]:
    """Every problem name the module's source raises by a literal name, by how it raises it."""
    src = (ROOT / "interactiond.py").read_text()
    return {
        "Problem": set(re.findall(r'\bProblem\(\s*"([a-z_]+)"', src)),
        "_v2_problem": set(re.findall(r'\b_v2_problem\(\s*"([a-z_]+)"', src)),
        # a conflict's problem is named by its kind
        "ending_problem(CONFLICT)": set(re.findall(r'ending_problem\(RunStatus\.CONFLICT,\s*"([a-z_]+)"', src)),
        "ENDINGS": {e.problem for e in itd.ENDINGS.values() if e.problem is not None},
        "HTTP errors": set(re.findall(r'"([a-z_]+)"', re.search(r"name = (\{4\d\d: [^}]*\})", src).group(1))),
    }


def test_every_problem_the_module_raises_is_registered():
    raised = names_raised_in_the_module()
    assert raised["Problem"] >= {"not_found", "invalid_request", "run_id_taken"}       # the search finds them
    assert raised["_v2_problem"] >= {"validation_failed", "idempotency_key_required"}
    for how, names in raised.items():
        assert names - set(itd.PROBLEM_TYPES) == set(), f"{how} raises problems PROBLEM_TYPES does not know"
    catalogue = (ROOT / "docs" / "http.md").read_text()      # the problem catalogue of the HTTP guide
    for name, (status, title, text) in itd.PROBLEM_TYPES.items():
        assert re.fullmatch(r"[a-z_]+", name) and 400 <= status <= 599 and title and text.endswith("."), name
        assert re.search(rf"`(\d{{3}}\s+)?{name}`", catalogue), f"docs/http.md does not name the problem {name}"


def check_envelope(name: str, status: int, content_type: str, body: dict[str, Any], *, v2: bool) -> None:
    """The documented shape of a problem answered over HTTP."""
    want_status, title, _ = itd.PROBLEM_TYPES[name]
    assert content_type == "application/problem+json", (name, content_type)
    assert body["type"] == f"/problems/{name}", (name, body)
    assert body["title"] == title and body["status"] == want_status == status, (name, body)
    assert isinstance(body["detail"], str) and body["detail"], (name, body)
    assert isinstance(body.get("kind", ""), str), (name, body)
    if v2:
        assert body["code"] == name, (name, body)
    else:
        assert "code" not in body, (name, body)
    for error in body.get("errors", []):
        assert isinstance(error["message"], str) and error["message"], (name, error)
        assert {"pointer", "line", "field"} & set(error), (name, error)


@pytest.mark.parametrize("name", sorted(itd.PROBLEM_TYPES))
@pytest.mark.parametrize("v2", [False, True])
def test_the_renderer_gives_every_type_its_envelope(name, v2):
    problem = itd.Problem(name, "what went wrong", code=name if v2 else None)
    resp = itd.problem_response(problem)
    check_envelope(name, resp.status, resp.content_type, json.loads(resp.text), v2=v2)
    assert (resp.headers.get("WWW-Authenticate") is not None) == (resp.status == 401)


@pytest.fixture
async def d(tmp_path, aiohttp_client):
    config = itd.Config(servers={"flaky": itd.ServerConfig("flaky", command=(sys.executable, FLAKY))},
                        playbooks={"local/default": ("flaky",), "acme/other": ()})
    return await start_daemon(aiohttp_client, str(tmp_path / "t.db"), config=config)


async def test_every_problem_type_through_the_app(d):
    seen: list[tuple[str, int, str, dict[str, Any], bool]] = []

    async def got(name: str, method: str, path: str, *, role: str | None = "operator", headers: Any = None,
                  **kw: Any) -> dict[str, Any]:
        v2 = path.startswith("/v2/")
        path = path if path.startswith(("/v1/", "/v2/")) else d.url(path)
        resp = await d.client.request(method, path, headers={**(d.auth(role) if role else {}), **(headers or {})}, **kw)
        body = await resp.json(content_type=None)
        assert body.get("type") == f"/problems/{name}", (name, resp.status, body)
        seen.append((name, resp.status, resp.content_type, body, v2))
        return body

    async def ask(run_id: str, kind: str = "approval", **input_: Any) -> str:
        status, run = await d.call("POST", "/runs", {"type": "interaction", "name": f"ask-{kind}", "run_id": run_id,
                                                     "input": {"prompt": "Ship it?", "to": "ana", **input_}})
        assert status == 202, run
        return run_id

    async def v2_id(run_id: str) -> str:
        return (await d.call("GET", f"/v2/interactions?run_id={run_id}"))[1]["data"][0]["id"]

    # Errors of the call itself (v1).
    await got("unauthorized", "GET", "/runs", role=None)
    await got("forbidden", "POST", "/runs", role="reader", json={"name": "ask-text"})
    await got("not_found", "GET", "/runs/no-such-run")
    await got("bad_request", "POST", "/runs", data=b"{nope", headers={"Content-Type": "application/json"})
    await got("too_large", "POST", "/runs", data=b'{"x": "' + b"a" * MIB + b'"}',
              headers={"Content-Type": "application/json"})
    body = await got("invalid_document", "POST", "/definitions",
                     json={"type": "interaction", "name": "bad", "source": "---\nto: [\n---\nHi\n"})
    assert body["errors"] and all("line" in e for e in body["errors"])
    body = await got("invalid_request", "GET", "/runs?limit=0")
    assert body["errors"] == [{"pointer": "/limit", "message": body["errors"][0]["message"]}]
    await got("conflict", "POST", "/definitions", json={"type": "interaction", "name": "ask-text", "source": NOTIFY})

    # Answers the request's state refuses.
    await ask("a-1")
    body = await got("invalid_input", "POST", "/runs/a-1/answer", json={"answer": {"approved": "yes"}})
    assert body["errors"][0]["pointer"].startswith("/answer")
    body = await got("digest_mismatch", "POST", "/runs/a-1/answer", json={"answer": {"approved": True}, "digest": "0" * 64})
    assert len(body["digest"]) == 64 and body["digest"] != "0" * 64
    assert (await d.call("POST", "/runs/a-1/answer", {"answer": {"approved": True}}))[0] == 200
    await got("answered", "POST", "/runs/a-1/answer", json={"answer": {"approved": False}})
    await ask("c-1")
    assert (await d.call("POST", "/runs/c-1/cancel"))[0] == 200
    assert (await got("not_open", "POST", "/runs/c-1/answer", json={"answer": {"approved": True}}))["kind"] == "cancelled"
    await d.define("notify", NOTIFY)
    status, note = await d.call("POST", "/runs", {"name": "notify", "input": {"owner": "ana"}, "run_id": "n-1"})
    assert status == 201, note
    await got("notification", "POST", "/runs/n-1/answer", json={"answer": {}})
    body = await got("run_id_taken", "POST", "/runs",
                     json={"name": "ask-approval", "run_id": "c-1", "input": {"prompt": "Other?", "to": "ana"}})
    assert body["kind"] == "run_id_taken" and body["run_id"] == "c-1"

    # Tools.
    body = await got("unavailable", "POST", "/tools/nowhere/echo", json={"arguments": {}})
    assert body["kind"] == "tool_not_offered"
    body = await got("unworkable", "POST", "/tools/flaky/echo", json={"arguments": {"text": "a" * 20_000}})
    assert body["kind"] == "unworkable"
    body = await got("effect_unknown", "POST", "/tools/flaky/crash_rw", json={"arguments": {}})
    assert body["kind"] == "effect_unknown"
    await d.define("write", SYSTEM_RW)
    status, run = await d.call("POST", "/runs", {"name": "write", "run_id": "w-1"})
    assert status == 409 and run["kind"] == "effect_unknown", run          # the run object, its problem inside
    await got("tools_called", "POST", "/runs", json={"name": "write", "run_id": "w-1"})

    # An approval answered by the caller that asked for the call: four eyes.
    status, gate = await d.call("POST", "/tools/flaky/echo", {"arguments": {"text": "hi"}, "approve": {"to": "ana"}})
    assert status == 202, gate
    await got("approval_not_yours", "POST", f"/runs/{gate['run_id']}/answer", json={"answer": {"approved": True}})
    # Two approvers: the first one's edit stands; a later edit is refused.
    status, pair = await d.call("POST", "/tools/flaky/echo", {"arguments": {"text": "hi"},
                                                             "approve": {"to": ["ana", "ben"], "need": 2, "edit": ["/text"]}})
    assert status == 202, pair
    d.tokens["ana"], d.tokens["ben"] = person_token(d.db, "ana"), person_token(d.db, "ben")
    status, _ = await d.call("POST", f"/runs/{pair['run_id']}/answer",
                             {"answer": {"approved": True, "arguments": {"text": "hello"}}}, role="ana")
    assert status == 200
    await got("arguments_changed", "POST", f"/runs/{pair['run_id']}/answer", role="ben",
              json={"answer": {"approved": True, "arguments": {"text": "bye"}}})

    # The typed API: the same envelope, with `code`.
    await got("unauthorized", "GET", "/v2/interactions", role=None)
    await got("not_found", "GET", "/v2/interactions/int_01JAZ6Y5M3Q8F7N2R4T6V9W0XC")
    pending = await v2_id(await ask("v-1"))
    await got("idempotency_key_required", "POST", f"/v2/interactions/{pending}/responses",
              json={"type": "approval", "approved": True})
    await got("interaction_type_mismatch", "POST", f"/v2/interactions/{pending}/responses",
              headers={"Idempotency-Key": "k-0"}, json={"type": "text", "text": "yes"})
    body = await got("validation_failed", "POST", f"/v2/interactions/{pending}/responses",
                     headers={"Idempotency-Key": "k-0"}, json={"type": "approval"})
    assert [(e["field"], e["code"]) for e in body["errors"]] == [("approved", "required")]
    resp = await d.client.post(f"/v2/interactions/{pending}/responses", json={"type": "approval", "approved": True},
                               headers={**d.auth(), "Idempotency-Key": "k-1"})
    assert resp.status == 200
    await got("idempotency_key_conflict", "POST", f"/v2/interactions/{pending}/responses",
              headers={"Idempotency-Key": "k-1"}, json={"type": "approval", "approved": False})
    await got("interaction_not_pending", "POST", f"/v2/interactions/{pending}/responses",
              headers={"Idempotency-Key": "k-2"}, json={"type": "approval", "approved": False})

    for name, status, content_type, body, v2 in seen:
        check_envelope(name, status, content_type, body, v2=v2)
    assert set(itd.PROBLEM_TYPES) - {name for name, *_ in seen} == RENDERED_ONLY
    assert len(seen) == len(itd.PROBLEM_TYPES) - len(RENDERED_ONLY) + 2        # unauthorized, not_found: v1 and v2

    # Every type resolves on the daemon, without a token, as a page naming it.
    for name, (status, title, _) in itd.PROBLEM_TYPES.items():
        resp = await d.client.get(f"/problems/{name}")
        assert resp.status == 200 and (await resp.text()).startswith(f"{title} ({status})"), name


async def test_the_problems_recorded_on_runs_have_the_envelope_too(d):
    """A run's ending is told by the run object, its `problem` the same envelope (here: rejected ones)."""
    for run_id in ("late", "gone"):
        status, _ = await d.call("POST", "/runs", {"name": "ask-text", "run_id": run_id,
                                                   "input": {"prompt": "Colour?", "to": "ana", "expires": "PT1M"}})
        assert status == 202
    await d.call("POST", "/runs/gone/cancel")
    await d.advance("PT1M")
    for run_id, name, kind in (("late", "unanswered", "expired"), ("gone", "cancelled", "cancelled")):
        status, run = await d.call("POST", f"/runs/{run_id}/wait?timeout=0")
        assert status == 410 and run["kind"] == kind
        check_envelope(name, status, "application/problem+json", run["problem"], v2=False)
        assert run["problem"]["kind"] == kind
