"""The typed API (v2): objects, the error table in its order, idempotency, the event stream, the client."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

import interactiond as itd
from daemon_kit import APPROVAL, NOTIFY, START_MS, make_tokens, start_daemon

DAY_MS = 86_400_000
UNKNOWN_ID = "int_01JAZ6Y5M3Q8F7N2R4T6V9W0XC"
OPTIONS = [{"id": "opt_a", "label": "Ship it"}, {"id": "opt_b", "label": "Hold it"}]


@pytest.fixture
async def d(db, aiohttp_client):
    return await start_daemon(aiohttp_client, db)


async def ask(d: Any, kind: str, playbook: str | None = None, **extra: Any) -> dict[str, Any]:
    """Raise a built-in typed question; returns its v2 object."""
    input_ = {"prompt": f"A {kind} question?", "to": "ana", **extra}
    status, run = await d.call("POST", "/runs", {"type": "interaction", "name": f"ask-{kind}", "input": input_},
                               playbook=playbook)
    assert status == 202, run
    status, page = await d.call("GET", f"/v2/interactions?run_id={run['run_id']}")
    assert status == 200 and len(page["data"]) == 1, page
    return page["data"][0]


async def respond(d: Any, ident: str, body: Any, key: str | None = "k-1", role: str = "writer") -> tuple[int, Any, Any]:
    headers = d.auth(role)
    if key is not None:
        headers["Idempotency-Key"] = key
    resp = await d.client.post(f"/v2/interactions/{ident}/responses", json=body, headers=headers)
    return resp.status, await resp.json(), resp.headers


def assert_problem(body: dict[str, Any], status: int, code: str) -> None:
    assert body["status"] == status and body["code"] == code and body["type"] == f"/problems/{code}", body
    assert body["title"] and body["detail"]


# -- the object ---------------------------------------------------------------------------------

async def test_objects_of_every_type(d):
    approval = await ask(d, "approval")
    assert approval["id"].startswith("int_") and approval["run_id"].startswith("run_")
    assert approval["type"] == "approval" and approval["status"] == "pending"
    assert approval["prompt"].strip() == "A approval question?"
    assert approval["payload"] == {} and approval["response"] is None and approval["answered_at"] is None
    assert approval["created_at"] == itd.fmt_time(START_MS)
    assert approval["expires_at"] == itd.fmt_time(START_MS + DAY_MS)

    choice = await ask(d, "choice", options=OPTIONS, multiple=True, expires="PT4H")
    assert choice["type"] == "choice" and choice["payload"] == {"options": OPTIONS, "multiple": True}
    assert choice["expires_at"] == itd.fmt_time(START_MS + 4 * 3600_000)
    text = await ask(d, "text", placeholder="a colour")
    assert text["type"] == "text" and text["payload"] == {"placeholder": "a colour"}
    confirmation = await ask(d, "confirmation")
    assert confirmation["type"] == "confirmation" and confirmation["payload"] == {}

    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", {"owner": "ana", "review": "fine"})
    _, page = await d.call("GET", f"/v2/interactions?run_id={run['run_id']}")
    form = page["data"][0]
    assert form["type"] == "form" and form["payload"]["schema"]["properties"]["verdict"]["enum"] == ["approve", "revise"]
    assert "fine" in form["prompt"]

    status, got = await d.call("GET", f"/v2/interactions/{choice['id']}", role="reader")
    # A reader sees it all but the answer link, which only a writer (who may answer) is shown.
    assert status == 200 and "answer_url" not in got and got == {k: v for k, v in choice.items() if k != "answer_url"}
    assert choice["answer_url"].startswith("http://") and f"/a/{choice['id']}." in choice["answer_url"]


async def test_notifications_are_not_interactions(d):
    await d.define("notify", NOTIFY)
    status, run = await d.run("notify", {"owner": "ana"})
    assert status == 201
    await ask(d, "approval")
    _, page = await d.call("GET", "/v2/interactions")
    assert [x["type"] for x in page["data"]] == ["approval"]


async def test_list_statuses_paging_and_filters(d):
    answered = await ask(d, "approval")
    expired = await ask(d, "confirmation", expires="PT1M")
    cancelled = await ask(d, "text")
    pending = [await ask(d, "approval") for _ in range(3)]
    assert (await respond(d, answered["id"], {"type": "approval", "approved": True}))[0] == 200
    assert (await d.call("POST", f"/runs/{cancelled['run_id']}/cancel"))[0] == 200
    await d.advance("PT2M")

    async def ids(query: str) -> list[str]:
        status, page = await d.call("GET", f"/v2/interactions{query}")
        assert status == 200, page
        return [x["id"] for x in page["data"]]

    assert await ids("?status=pending") == [p["id"] for p in reversed(pending)]
    assert await ids("?status=answered") == [answered["id"]]
    assert await ids("?status=expired") == [expired["id"]]
    assert await ids("?status=cancelled") == [cancelled["id"]]
    everything = await ids("")
    assert everything == [x["id"] for x in reversed([answered, expired, cancelled, *pending])]
    assert await ids(f"?run_id={expired['run_id']}") == [expired["id"]]
    assert await ids(f"?run_id={expired['run_id']}&status=pending") == []

    seen, cursor = [], None
    while True:
        status, page = await d.call("GET", "/v2/interactions?limit=4" + (f"&cursor={cursor}" if cursor else ""))
        seen += [x["id"] for x in page["data"]]
        assert page["page"]["has_more"] == (page["page"]["next_cursor"] is not None)
        if not page["page"]["has_more"]:
            break
        cursor = page["page"]["next_cursor"]
    assert seen == everything

    status, body = await d.call("GET", "/v2/interactions?status=open")
    assert status == 422 and body["code"] == "validation_failed" and body["errors"][0]["field"] == "status"
    status, body = await d.call("GET", "/v2/interactions?limit=0")
    assert status == 422 and body["errors"][0] == {"field": "limit", "code": "invalid_value",
                                                   "message": body["errors"][0]["message"]}
    status, body = await d.call("GET", "/v2/interactions?cursor=%21%21")
    assert_problem(body, 400, "bad_request")


async def test_status_mapping_after_v1_events(d):
    x = await ask(d, "approval", expires="PT1M")
    await d.advance("PT1M")
    _, got = await d.call("GET", f"/v2/interactions/{x['id']}")
    assert got["status"] == "expired" and got["response"] is None and got["answered_at"] is None


# -- the error table, row by row and in its order -------------------------------------------------

async def test_404_comes_first_even_without_a_key(d):
    mine = await ask(d, "approval")
    theirs = await ask(d, "approval", playbook="acme/other")
    body = {"type": "approval", "approved": True}
    for ident in (UNKNOWN_ID, "not-an-id", "int_", theirs["id"]):
        for key in (None, "k-404"):
            status, problem, _ = await respond(d, ident, body, key=key)
            assert status == 404, (ident, key, problem)
            assert_problem(problem, 404, "not_found")
        status, problem = await d.call("GET", f"/v2/interactions/{ident}", role="writer")
        assert status == 404 and problem["code"] == "not_found"
    # Another playbook's interaction is invisible to a bound token, and listed for its own.
    _, page = await d.call("GET", "/v2/interactions", role="writer")
    assert [x["id"] for x in page["data"]] == [mine["id"]]
    _, page = await d.call("GET", "/v2/interactions", role="other")
    assert [x["id"] for x in page["data"]] == [theirs["id"]]
    _, page = await d.call("GET", "/v2/interactions", role="operator")
    assert {x["id"] for x in page["data"]} == {mine["id"], theirs["id"]}
    _, theirs_now = await d.call("GET", f"/v2/interactions/{theirs['id']}", role="operator")
    assert theirs_now["status"] == "pending"


async def test_400_without_an_idempotency_key(d):
    x = await ask(d, "approval")
    for key in (None, "", "k" * 256):
        status, problem, _ = await respond(d, x["id"], {"type": "approval", "approved": True}, key=key)
        assert status == 400, key
        assert_problem(problem, 400, "idempotency_key_required")
    _, got = await d.call("GET", f"/v2/interactions/{x['id']}")
    assert got["status"] == "pending"
    # The key is checked before the interaction's state: an answered one still says 400 first.
    assert (await respond(d, x["id"], {"type": "approval", "approved": True}, key="first"))[0] == 200
    status, problem, _ = await respond(d, x["id"], {"type": "text", "text": "x"}, key=None)
    assert status == 400 and problem["code"] == "idempotency_key_required"


async def test_replay_returns_the_first_response_and_another_body_conflicts(d):
    x = await ask(d, "approval")
    y = await ask(d, "approval")
    body = {"type": "approval", "approved": True, "comment": "ship it"}
    status, first, headers = await respond(d, x["id"], body, key="key-1")
    assert status == 200 and "Idempotent-Replayed" not in headers
    assert first["status"] == "answered" and first["answered_at"] == itd.fmt_time(START_MS)
    assert first["response"] == {"type": "approval", "approved": True, "comment": "ship it",
                                 "submitted_at": itd.fmt_time(START_MS)}
    await d.advance("PT1H")
    status, again, headers = await respond(d, x["id"], dict(reversed(list(body.items()))), key="key-1")
    assert status == 200 and again == first and headers["Idempotent-Replayed"] == "true"

    status, problem, _ = await respond(d, x["id"], {"type": "approval", "approved": False}, key="key-1")
    assert status == 409
    assert_problem(problem, 409, "idempotency_key_conflict")
    # The same key for another interaction is another request too.
    status, problem, _ = await respond(d, y["id"], body, key="key-1")
    assert status == 409 and problem["code"] == "idempotency_key_conflict"
    _, still = await d.call("GET", f"/v2/interactions/{y['id']}")
    assert still["status"] == "pending"
    # Keys belong to their token: another token's same key is a new request.
    status, other, _ = await respond(d, y["id"], body, key="key-1", role="operator")
    assert status == 200 and other["id"] == y["id"]

    _, hist = await d.call("GET", f"/runs/{x['run_id']}/events")
    assert [e["type"] for e in hist["data"]].count("request_answered") == 1


async def test_409_interaction_not_pending(d):
    answered, expired, cancelled = await ask(d, "approval"), await ask(d, "approval", expires="PT1M"), await ask(d, "approval")
    assert (await respond(d, answered["id"], {"type": "approval", "approved": True}, key="a"))[0] == 200
    await d.call("POST", f"/runs/{cancelled['run_id']}/cancel")
    await d.advance("PT1M")
    for x, state in ((answered, "answered"), (expired, "expired"), (cancelled, "cancelled")):
        # Even the very answer it took, and a body of another type, are 409: the state comes first.
        for body in ({"type": "approval", "approved": True}, {"type": "text", "text": "no", "bogus": 1}):
            status, problem, _ = await respond(d, x["id"], body, key=f"new-{state}-{len(body)}")
            assert status == 409, (state, problem)
            assert_problem(problem, 409, "interaction_not_pending")
            assert problem["interaction_status"] == state


async def test_422_type_mismatch_before_validation(d):
    x = await ask(d, "approval")
    for body in ({"type": "text", "text": "yes"}, {"type": "form", "answer": {"approved": True}},
                 {"type": "choice", "option_ids": ["a"], "bogus": True}, {"type": 7}):
        status, problem, _ = await respond(d, x["id"], body, key=json.dumps(body))
        assert status == 422, body
        assert_problem(problem, 422, "interaction_type_mismatch")
    _, got = await d.call("GET", f"/v2/interactions/{x['id']}")
    assert got["status"] == "pending"


async def test_422_validation_failed_with_fields(d):
    x = await ask(d, "approval")
    cases = [
        ({"type": "approval", "approved": True, "extra": 1, "other": "x"},
         [("extra", "unknown_field"), ("other", "unknown_field")]),
        ({"type": "approval"}, [("approved", "required")]),
        ({"type": "approval", "approved": "yes", "comment": "c" * 2001},
         [("approved", "invalid_type"), ("comment", "too_long")]),
        ({"approved": True}, [("type", "required")]),
    ]
    for n, (body, expected) in enumerate(cases):
        status, problem, _ = await respond(d, x["id"], body, key=f"v{n}")
        assert status == 422, body
        assert_problem(problem, 422, "validation_failed")
        assert [(e["field"], e["code"]) for e in problem["errors"]] == expected, problem
        assert all(e["message"] for e in problem["errors"])
    _, got = await d.call("GET", f"/v2/interactions/{x['id']}")
    assert got["status"] == "pending"
    # A failed response stores nothing under its key: the key can carry the corrected body.
    status, ok, _ = await respond(d, x["id"], {"type": "approval", "approved": True}, key="v0")
    assert status == 200 and ok["status"] == "answered"


async def test_choice_option_ids_must_be_the_interactions(d):
    x = await ask(d, "choice", options=OPTIONS)
    await ask(d, "choice", options=[{"id": "opt_z", "label": "Elsewhere"}])
    cases = [
        (["opt_z"], [("option_ids[0]", "invalid_option")]),
        (["opt_a", "opt_b"], [("option_ids", "too_many")]),
        ([], [("option_ids", "too_few")]),
        (["opt_a", "nope"], [("option_ids", "too_many"), ("option_ids[1]", "invalid_option")]),
    ]
    for n, (ids, expected) in enumerate(cases):
        status, problem, _ = await respond(d, x["id"], {"type": "choice", "option_ids": ids}, key=f"c{n}")
        assert status == 422 and problem["code"] == "validation_failed", problem
        assert [(e["field"], e["code"]) for e in problem["errors"]] == expected, problem
    status, done, _ = await respond(d, x["id"], {"type": "choice", "option_ids": ["opt_b"]}, key="c-ok")
    assert status == 200 and done["response"]["option_ids"] == ["opt_b"] and done["response"]["type"] == "choice"
    _, run = await d.call("GET", f"/runs/{x['run_id']}")
    assert run["status"] == "succeeded" and run["output"] == {"option_ids": ["opt_b"]}


async def test_multiple_choice_text_and_confirmation_answers(d):
    many = await ask(d, "choice", options=OPTIONS, multiple=True)
    status, got, _ = await respond(d, many["id"], {"type": "choice", "option_ids": ["opt_b", "opt_a"]})
    assert status == 200 and got["response"]["option_ids"] == ["opt_b", "opt_a"]
    text = await ask(d, "text")
    status, got, _ = await respond(d, text["id"], {"type": "text", "text": "blue"}, key="t")
    assert status == 200 and got["response"] == {"type": "text", "text": "blue", "submitted_at": got["answered_at"]}
    conf = await ask(d, "confirmation")
    status, got, _ = await respond(d, conf["id"], {"type": "confirmation", "confirmed": False}, key="c")
    assert status == 200 and got["response"]["confirmed"] is False
    _, run = await d.call("GET", f"/runs/{conf['run_id']}")
    assert run["output"] == {"confirmed": False}


async def test_form_responses(d):
    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", {"owner": "ana", "review": "fine"})
    _, page = await d.call("GET", f"/v2/interactions?run_id={run['run_id']}")
    x = page["data"][0]
    status, problem, _ = await respond(d, x["id"], {"type": "form", "answer": {"verdict": "maybe", "bogus": 1},
                                                    "extra": 2}, key="f1")
    assert status == 422 and problem["code"] == "validation_failed"
    assert [(e["field"], e["code"]) for e in problem["errors"]] == [
        ("answer.verdict", "invalid_option"), ("extra", "unknown_field")], problem
    status, problem, _ = await respond(d, x["id"], {"type": "form"}, key="f2")
    assert status == 422 and [(e["field"], e["code"]) for e in problem["errors"]] == [("answer", "required")]
    status, got, _ = await respond(d, x["id"], {"type": "form", "answer": {"verdict": "approve"}}, key="f3")
    assert status == 200 and got["response"] == {"type": "form", "answer": {"verdict": "approve"},
                                                 "submitted_at": itd.fmt_time(START_MS)}


async def test_problems_on_v2_carry_a_code(d):
    resp = await d.client.get("/v2/interactions")
    body = await resp.json()
    assert resp.status == 401 and body["code"] == "unauthorized"
    x = await ask(d, "approval")
    status, problem, _ = await respond(d, x["id"], {"type": "approval", "approved": True}, role="reader")
    assert status == 403 and problem["code"] == "forbidden"
    resp = await d.client.post(f"/v2/interactions/{x['id']}/responses", data=b"{nope",
                               headers={**d.auth("writer"), "Idempotency-Key": "j"})
    body = await resp.json()
    assert resp.status == 400 and body["code"] == "bad_request"
    # v1 problems stay as they were.
    status, body = await d.call("GET", "/runs/nope")
    assert status == 404 and "code" not in body
    resp = await d.client.get("/v2/nothing-here")       # routing's own problem, with its request id
    body = await resp.json()
    assert resp.status == 404 and body["code"] == "not_found" and resp.headers["X-Request-Id"]


async def test_typed_api_mounted_on_an_app_of_its_own_codes_its_problems(aiohttp_client):
    """Without the daemon's observe_middleware, mount_typed_api brings the `code` middleware itself."""
    async def refuse(request: web.Request) -> web.Response:
        return itd.problem_response(itd.Problem("forbidden", "no"))
    app = web.Application()
    app.router.add_get("/v2/x", refuse)
    app.router.add_get("/v1/x", refuse)
    itd.mount_typed_api(app)
    client = await aiohttp_client(app)
    resp = await client.get("/v2/x")
    assert resp.status == 403 and (await resp.json())["code"] == "forbidden"
    resp = await client.get("/v1/x")
    assert resp.status == 403 and "code" not in await resp.json()
    assert itd.observe_middleware not in app.middlewares


# -- v1 and v2 are one inbox --------------------------------------------------------------------

async def test_v1_and_v2_agree_on_one_request(d):
    x = await ask(d, "approval")
    _, v1 = await d.call("GET", "/interactions")
    assert [r["run_id"] for r in v1["data"]] == [x["run_id"]]
    status, got, _ = await respond(d, x["id"], {"type": "approval", "approved": False, "comment": "not yet"})
    assert status == 200
    answer = {"approved": False, "comment": "not yet"}
    _, run = await d.call("GET", f"/runs/{x['run_id']}")
    assert run["status"] == "succeeded" and run["output"] == answer
    assert run["settled_by"].startswith("tok_") and got["answered_at"] == run["ended_at"]
    _, hist = await d.call("GET", f"/runs/{x['run_id']}/events")
    assert [e["type"] for e in hist["data"]] == ["interaction_requested", "request_answered", "run_succeeded"]
    assert hist["data"][1]["payload"]["answer"] == answer
    _, v1 = await d.call("GET", "/interactions")
    assert v1["data"] == []
    # v1 sees the v2 answer as the fact it is: the same answer is the same fact, another is 409.
    status, fact = await d.call("POST", f"/runs/{x['run_id']}/answer", {"answer": answer}, role="writer")
    assert status == 200 and fact["answer_id"] == hist["data"][1]["id"]
    status, _ = await d.call("POST", f"/runs/{x['run_id']}/answer", {"answer": {"approved": True}})
    assert status == 409

    # And a v1 answer shows on v2 as answered, refusing a v2 response.
    y = await ask(d, "choice", options=OPTIONS)
    await d.advance("PT5M")
    status, fact = await d.call("POST", f"/runs/{y['run_id']}/answer", {"answer": {"option_ids": ["opt_a"]}})
    assert status == 200
    _, got = await d.call("GET", f"/v2/interactions/{y['id']}")
    assert got["status"] == "answered" and got["answered_at"] == itd.fmt_time(START_MS + 300_000)
    assert got["response"] == {"type": "choice", "option_ids": ["opt_a"], "submitted_at": got["answered_at"]}
    status, problem, _ = await respond(d, y["id"], {"type": "choice", "option_ids": ["opt_a"]}, key="late")
    assert status == 409 and problem["code"] == "interaction_not_pending"


async def test_openapi_documents_the_typed_routes(d):
    spec = await (await d.client.get("/openapi.json")).json()
    for path, method in (("/v2/interactions", "get"), ("/v2/interactions/{id}", "get"),
                         ("/v2/interactions/{id}/responses", "post"), ("/v2/events", "get"),
                         ("/v1/orgs/{org}/playbooks/{playbook}/stream", "get")):
        assert method in spec["paths"][path], path
    for code in ("idempotency_key_required", "idempotency_key_conflict", "interaction_not_pending",
                 "interaction_type_mismatch", "validation_failed"):
        assert (await d.client.get(f"/problems/{code}")).status == 200


# -- the event stream ---------------------------------------------------------------------------

class SseReader:
    """Parses a text/event-stream response into events (and keeps the comment lines it saw)."""

    def __init__(self, resp: Any) -> None:
        self.resp = resp
        self.comments: list[str] = []

    async def next(self, timeout: float = 10.0) -> dict[str, str]:
        async def one() -> dict[str, str]:
            block: dict[str, str] = {}
            while True:
                try:
                    line = (await self.resp.content.readline()).decode()
                except aiohttp.ClientPayloadError:
                    line = ""
                if not line:
                    raise EOFError("the stream ended")
                line = line.rstrip("\r\n")
                if not line:
                    if "event" in block:
                        return block
                    block = {}
                elif line.startswith(":"):
                    self.comments.append(line[1:].strip())
                else:
                    name, _, value = line.partition(":")
                    block[name] = value[1:] if value.startswith(" ") else value
        return await asyncio.wait_for(one(), timeout)

    async def take(self, n: int) -> list[tuple[str, str, dict[str, Any]]]:
        out = []
        for _ in range(n):
            ev = await self.next()
            out.append((ev["id"], ev["event"], json.loads(ev["data"])))
        return out


async def open_stream(d: Any, path: str = "/v2/events", role: str = "writer", last: str | None = None) -> SseReader:
    headers = d.auth(role)
    if last is not None:
        headers["Last-Event-ID"] = last
    resp = await d.client.get(path, headers=headers)
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    return SseReader(resp)


async def test_stream_delivers_created_then_answered_and_resumes(d):
    stream = await open_stream(d)
    x = await ask(d, "approval")
    assert (await respond(d, x["id"], {"type": "approval", "approved": True}))[0] == 200
    got = await stream.take(3)
    assert [name for _, name, _ in got] == ["interaction.created", "interaction.answered", "run.ended"]
    ids = [int(i.removeprefix("evt_")) for i, _, _ in got]
    assert ids == sorted(ids) and len(set(ids)) == 3
    created, answered, ended = (data for _, _, data in got)
    assert created["interaction_id"] == x["id"] and created["interaction_type"] == "approval"
    assert created["run_id"] == x["run_id"] and created["event_id"] == got[0][0]
    assert answered["response"] == {"type": "approval", "approved": True, "submitted_at": itd.fmt_time(START_MS)}
    assert ended["status"] == "succeeded"
    stream.resp.close()

    # Resuming after the first event replays what followed it, once, then goes on live.
    again = await open_stream(d, last=got[0][0])
    assert await again.take(2) == got[1:]
    y = await ask(d, "text")
    (next_id, name, data), = await again.take(1)
    assert name == "interaction.created" and data["interaction_id"] == y["id"]
    assert int(next_id.removeprefix("evt_")) > ids[-1]
    # A resume from before everything replays the whole history in order.
    whole = await open_stream(d, last="0")
    assert [n for _, n, _ in await whole.take(4)] == ["interaction.created", "interaction.answered", "run.ended",
                                                      "interaction.created"]


async def test_stream_expiry_and_cancel_and_visibility(d):
    mine = await open_stream(d, d.url("/stream"))
    everything = await open_stream(d, role="operator")
    x = await ask(d, "approval", expires="PT1M")
    y = await ask(d, "confirmation")
    theirs = await ask(d, "approval", playbook="acme/other")
    await d.call("POST", f"/runs/{y['run_id']}/cancel")
    await d.advance("PT1M")
    got = await mine.take(6)
    assert [(n, data.get("interaction_id")) for _, n, data in got] == [
        ("interaction.created", x["id"]), ("interaction.created", y["id"]),
        ("interaction.cancelled", y["id"]), ("run.ended", None),
        ("interaction.expired", x["id"]), ("run.ended", None)]
    assert got[2][0] == got[3][0] and got[4][0] == got[5][0]       # one fact: one id
    assert got[3][2]["kind"] == "cancelled" and got[5][2]["kind"] == "expired"
    seen = await everything.take(7)
    assert [data.get("interaction_id") for _, n, data in seen if n == "interaction.created"] == [
        x["id"], y["id"], theirs["id"]]
    # Another playbook's stream is 404 to a bound token.
    resp = await d.client.get(d.url("/stream", "acme/other"), headers=d.auth("writer"))
    assert resp.status == 404
    resp = await d.client.get("/v2/events", headers={**d.auth("writer"), "Last-Event-ID": "yesterday"})
    assert resp.status == 400 and (await resp.json())["code"] == "bad_request"


async def test_stream_keep_alive(d, monkeypatch):
    monkeypatch.setattr(itd, "SSE_KEEPALIVE_S", 0.05)
    stream = await open_stream(d)
    x = await ask(d, "approval")
    (_, name, data), = await stream.take(1)
    assert name == "interaction.created" and data["interaction_id"] == x["id"]

    async def keep_alive() -> None:
        while "keep-alive" not in stream.comments:
            line = (await stream.resp.content.readline()).decode()
            if line.startswith(":"):
                stream.comments.append(line[1:].strip())
    await asyncio.wait_for(keep_alive(), 10)


@pytest.fixture
def stalled_writes(monkeypatch):
    """Holds every stream write that carries events until the gate opens: a consumer that does not read."""
    gate = asyncio.Event()
    write = web.StreamResponse.write

    async def held(self: web.StreamResponse, data: bytes) -> None:
        if self.content_type == "text/event-stream" and b"\nevent: " in data:
            await gate.wait()
        await write(self, data)
    monkeypatch.setattr(web.StreamResponse, "write", held)
    return gate


async def test_a_slow_consumer_never_blocks_the_engine(d, stalled_writes):
    stream = await open_stream(d)
    n = 1200                                    # past the engine's per-subscriber queue bound

    async def one(i: int) -> None:
        await d.engine.run_definition(itd.OPERATOR_LOCAL, "local/default", "interaction", "ask-confirmation",
                                      {"prompt": f"#{i}", "to": "ana"})
    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 60)
    assert len(d.engine.bus._subscribers) == 1      # the stream is still there, stuck in its write
    stalled_writes.set()
    got = [await stream.next() for _ in range(n)]
    ids = [int(e["id"].removeprefix("evt_")) for e in got]
    assert all(e["event"] == "interaction.created" for e in got)
    assert ids == sorted(set(ids)) and len(ids) == n       # no gap, no duplicate, in order


async def test_a_stalled_consumer_is_dropped_and_resumes(d, stalled_writes, monkeypatch):
    monkeypatch.setattr(itd, "SSE_WRITE_TIMEOUT_S", 0.05)
    stream = await open_stream(d)
    x = await ask(d, "approval")
    with pytest.raises(EOFError):
        await stream.next()
    assert d.engine.bus._subscribers == set()
    stalled_writes.set()
    again = await open_stream(d, last="0")
    (_, name, data), = await again.take(1)
    assert name == "interaction.created" and data["interaction_id"] == x["id"]


# -- the client against the live app ------------------------------------------------------------

@pytest.fixture
async def live(db, aiohttp_server):
    """A real port: the app, the engine on the manual clock, tokens, and what a test middleware saw."""
    tokens = make_tokens(db)
    engine = itd.Engine(itd.Store(db), itd.ManualClock(START_MS),
                        itd.Config(playbooks={"local/default": (), "acme/other": ()}))
    app = itd.build_app(engine)
    seen: list[tuple[int, str | None]] = []
    faults: list[str] = []                      # "drop" or "500", used up one per answer

    @web.middleware
    async def fault_after_commit(request: web.Request, handler: Any) -> web.StreamResponse:
        resp = await handler(request)
        if request.method == "POST" and request.path.endswith("/responses"):
            seen.append((resp.status, resp.headers.get("Idempotent-Replayed")))
            if faults:
                fault = faults.pop(0)
                if fault == "drop":                        # committed, and the client never hears of it
                    request.transport.close()
                else:
                    return web.Response(status=500, text='{"type":"/problems/failed","title":"Failed",'
                                        '"status":500,"detail":"injected"}', content_type="application/problem+json")
        return resp
    app.middlewares.append(fault_after_commit)
    server = await aiohttp_server(app)
    client = itd.Client(str(server.make_url("")).rstrip("/"), tokens["writer"], backoff=0.01)
    return {"client": client, "engine": engine, "seen": seen, "faults": faults, "tokens": tokens,
            "url": str(server.make_url("")).rstrip("/")}


async def test_client_end_to_end(live):
    c: itd.Client = live["client"]

    def scenario() -> dict[str, Any]:
        d = c.definitions.create("interaction", "approve", APPROVAL)
        assert d["version"] == 1 and c.definitions.get("interaction", "approve")["source"] == APPROVAL
        runs = [c.runs.start("interaction", "ask-choice", {"prompt": f"pick {i}", "to": "ana", "options": OPTIONS})
                for i in range(3)]
        assert all(r["status"] == "started" and r["run_id"].startswith("run_") for r in runs)
        listed = list(c.interactions.list(status="pending", limit=1))          # three pages of one
        assert [x["run_id"] for x in listed] == [r["run_id"] for r in reversed(runs)]
        pending, = c.runs.pending_interactions(runs[0]["run_id"])
        assert pending["type"] == "choice" and pending["payload"]["options"] == OPTIONS
        assert c.interactions.get(pending["id"]) == pending
        done = c.interactions.respond(pending["id"], type="choice", option_ids=["opt_b"])
        assert done["status"] == "answered" and done["response"]["option_ids"] == ["opt_b"]
        ended = c.runs.wait(runs[0]["run_id"], timeout=5)
        assert ended["status"] == "succeeded" and ended["output"] == {"option_ids": ["opt_b"]}
        assert c.runs.get(runs[0]["run_id"]) == ended
        assert c.runs.pending_interactions(runs[0]["run_id"]) == []
        with pytest.raises(itd.ClientError) as err:
            c.interactions.respond(pending["id"], type="choice", option_ids=["opt_b"])
        assert err.value.status == 409 and err.value.problem["code"] == "interaction_not_pending"
        other, = c.runs.pending_interactions(runs[1]["run_id"])
        with pytest.raises(itd.ClientError) as err:
            c.interactions.respond(other["id"], type="approval", approved=True)
        assert err.value.problem["code"] == "interaction_type_mismatch"
        with pytest.raises(itd.ClientError) as err:
            c.interactions.get("int_nothing")
        assert err.value.status == 404 and err.value.code == "not_found" and isinstance(err.value, itd.Problem)
        with pytest.raises(itd.ClientError) as err:
            c.runs.start("interaction", "no-such-function")
        assert err.value.status == 404
        # A run's ending comes back as the run object, whatever its HTTP status.
        bad = c.runs.start("interaction", "approve", {"owner": 7})
        assert bad["status"] == "invalid_input"
        still = c.runs.wait(runs[2]["run_id"], timeout=0)
        assert still["status"] == "waiting"
        return {"answered": runs[0]["run_id"]}

    out = await asyncio.to_thread(scenario)
    events = await live["engine"].list_run_events(itd.OPERATOR_LOCAL, "local/default", out["answered"])
    assert [e["type"] for e in events["data"]].count("request_answered") == 1


@pytest.mark.parametrize("fault", ["drop", "500"])
async def test_client_retry_after_commit_does_not_answer_twice(live, fault):
    c: itd.Client = live["client"]
    run = await asyncio.to_thread(c.runs.start, "interaction", "ask-approval", {"prompt": "Ship?", "to": "ana"})
    pending, = await asyncio.to_thread(c.runs.pending_interactions, run["run_id"])
    live["faults"].append(fault)
    done = await asyncio.to_thread(lambda: c.interactions.respond(pending["id"], type="approval", approved=True,
                                                                  comment="ship it"))
    assert done["status"] == "answered" and done["response"]["comment"] == "ship it"
    # The first try was answered and lost on the way back; the retry carried the same key and got
    # the first response again (a new key would have been refused as not pending).
    assert live["seen"] == [(200, None), (200, "true")]
    events = await live["engine"].list_run_events(itd.OPERATOR_LOCAL, "local/default", run["run_id"])
    assert [e["type"] for e in events["data"]] == ["interaction_requested", "request_answered", "run_succeeded"]


async def test_client_gives_up_with_one_error_type(live):
    c = itd.Client("http://127.0.0.1:9", "nope", retries=1, backoff=0.01)
    with pytest.raises(itd.ClientError) as err:
        await asyncio.to_thread(c.interactions.get, UNKNOWN_ID)
    assert err.value.code == "unreachable"
    bad = itd.Client(live["url"], "not-a-token")
    with pytest.raises(itd.ClientError) as err:
        await asyncio.to_thread(lambda: list(bad.interactions.list()))
    assert err.value.status == 401 and err.value.problem["code"] == "unauthorized"
