"""The whole life of an inbox request over the real HTTP API, on the manual clock."""
from __future__ import annotations

import asyncio
import re

import pytest

import interactiond as itd
from daemon_kit import APPROVAL, NOTIFY, START_MS, start_daemon, watching_waits


INPUT = {"owner": "ana", "review": "Clear goals; budget missing."}


async def test_definition_versions(d):
    status, first = await d.call("POST", "/definitions", {"type": "interaction", "name": "approve", "source": APPROVAL})
    assert status == 201 and first["version"] == 1 and first["media_type"] == "text/markdown"
    assert first["source"] == APPROVAL and first["overview"]
    status, same = await d.call("POST", "/definitions", {"type": "interaction", "name": "approve", "source": APPROVAL})
    assert status == 200 and same["version"] == 1
    changed = APPROVAL.replace("P2D", "P3D")
    status, second = await d.call("POST", "/definitions", {"type": "interaction", "name": "approve", "source": changed})
    assert status == 201 and second["version"] == 2
    status, old = await d.call("GET", "/definitions/interaction/approve?version=1")
    assert status == 200 and old["source"] == APPROVAL
    status, listing = await d.call("GET", "/definitions")
    mine = [(x["name"], x["version"]) for x in listing["data"]
            if not x["name"].startswith("ask-") and x["name"] != "approve-tool-call"]      # the built-ins
    assert mine == [("approve", 2)]
    status, _ = await d.call("DELETE", "/definitions/interaction/approve")
    assert status == 200
    status, gone = await d.call("GET", "/definitions/interaction/approve")
    assert status == 404 and gone["type"] == "/problems/not_found"
    status, rerun = await d.run("approve", INPUT)
    assert status == 404


async def test_bad_document_is_422_with_lines(d):
    status, body = await d.call("POST", "/definitions", {"type": "interaction", "name": "bad",
                                                         "source": APPROVAL.replace("expires: P2D", "expires: P2D\nmodel: gpt")})
    assert status == 422
    assert body["type"] == "/problems/invalid_document"
    assert any(e["field"] == "model" and e["line"] == 5 for e in body["errors"]), body


async def test_whole_life_of_an_inbox_request(d):
    await d.define("approve", APPROVAL)
    status, run = await d.run("approve", INPUT)
    assert status == 202 and run["status"] == "started" and run["run_id"].startswith("run_")
    run_id = run["run_id"]
    status, got = await d.call("GET", f"/runs/{run_id}")
    assert status == 200 and got["status"] == "waiting" and got["version"] == 1

    status, page = await d.call("GET", "/interactions")
    assert status == 200 and len(page["data"]) == 1
    req = page["data"][0]
    assert req["run_id"] == run_id and req["to"] == "ana" and req["from"] == "ana"
    assert req["delivery"] is None and req["delivery_state"] == "in_inbox" and req["takes_answer"] is True
    assert "Clear goals; budget missing." in req["message"]
    assert req["answer_schema"]["properties"]["verdict"]["enum"] == ["approve", "revise"]
    assert req["expires_at"] == itd.fmt_time(START_MS + 2 * 86400_000)
    assert req["asked_at"] == itd.fmt_time(START_MS)

    answer = {"verdict": "approve", "note": "Ship it."}
    status, fact = await d.call("POST", f"/runs/{run_id}/answer", {"answer": answer, "claimed_for": "the team"})
    assert status == 200
    assert fact["answer"] == answer and fact["claimed_for"] == "the team" and fact["answer_id"].startswith("evt_")
    assert fact["answered_by"].startswith("tok_") and fact["answered_at"] == itd.fmt_time(START_MS)

    status, got = await d.call("GET", f"/runs/{run_id}")
    assert got["status"] == "succeeded" and got["output"] == answer and got["settled_by"] == fact["answered_by"]
    status, page = await d.call("GET", "/interactions")
    assert page["data"] == []

    status, hist = await d.call("GET", f"/runs/{run_id}/events")
    assert [e["type"] for e in hist["data"]] == ["interaction_requested", "request_answered", "run_succeeded"]
    assert hist["data"][1]["id"] == fact["answer_id"]
    status, ev = await d.call("GET", f"/events/{fact['answer_id']}")
    assert status == 200 and ev["payload"]["answer"] == answer and ev["payload"]["claimed_for"] == "the team"

    # The same answer again returns the same fact; a different one is a conflict.
    status, again = await d.call("POST", f"/runs/{run_id}/answer", {"answer": answer, "claimed_for": "the team"})
    assert status == 200 and again == fact
    status, other = await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"verdict": "revise"}})
    assert status == 409 and other["status"] == 409


async def test_history_previews_are_cut_and_get_event_is_whole(d):
    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", INPUT)
    note = "x" * 1990
    await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "approve", "note": note}})
    _, hist = await d.call("GET", f"/runs/{run['run_id']}/events")
    answered = hist["data"][1]
    assert answered["truncated"] is True and "payload" not in answered
    assert answered["size"] > itd.PREVIEW_BYTES and len(answered["preview"].encode()) <= itd.PREVIEW_BYTES
    _, whole = await d.call("GET", f"/events/{answered['id']}")
    assert whole["payload"]["answer"]["note"] == note


async def test_invalid_answer_keeps_request_open(d):
    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", INPUT)
    status, body = await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "maybe", "extra": 1, "note": 5}})
    assert status == 422 and body["type"] == "/problems/invalid_input"
    pointers = sorted(e["pointer"] for e in body["errors"])
    assert pointers == ["/answer/note", "/answer/verdict"]
    status, missing = await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {}})
    assert status == 422 and [e["pointer"] for e in missing["errors"]] == ["/answer/verdict"]
    _, page = await d.call("GET", "/interactions")
    assert len(page["data"]) == 1
    _, got = await d.call("GET", f"/runs/{run['run_id']}")
    assert got["status"] == "waiting"


async def test_answer_bounds(d):
    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", INPUT)
    status, body = await d.call("POST", f"/runs/{run['run_id']}/answer",
                                {"answer": {"verdict": "approve", "note": "y" * (70 * 1024)}})
    assert status == 422 and body["errors"][0]["pointer"] == "/answer"
    status, body = await d.call("POST", f"/runs/{run['run_id']}/answer",
                                {"answer": {"verdict": "approve"}, "claimed_for": "z" * 257})
    assert status == 422 and body["errors"][0]["pointer"] == "/claimed_for"


async def test_invalid_input_ends_the_run(d):
    await d.define("approve", APPROVAL)
    status, run = await d.run("approve", {"owner": 7})
    assert status == 422 and run["status"] == "invalid_input"
    assert run["problem"]["type"] == "/problems/invalid_input"
    assert sorted(e["pointer"] for e in run["problem"]["errors"]) == ["/input/owner", "/input/review"]
    _, page = await d.call("GET", "/interactions")
    assert page["data"] == []


@pytest.mark.parametrize("owner,why", [("", "empty"), ("a\u0007b", "control"), ("o" * 257, "256")])
async def test_party_bounds_are_unworkable(d, owner, why):
    await d.define("approve", APPROVAL)
    status, run = await d.run("approve", {"owner": owner, "review": "r"})
    assert status == 409 and run["status"] == "conflict" and run["kind"] == "unworkable", run
    assert run["problem"]["type"] == "/problems/unworkable"


async def test_message_over_8_kib_is_unworkable(d):
    await d.define("approve", APPROVAL)
    status, run = await d.run("approve", {"owner": "ana", "review": "r" * 9000})
    assert status == 409 and run["kind"] == "unworkable" and "8 KiB" in run["problem"]["detail"]


async def test_notification_succeeds_at_once(d):
    await d.define("notify", NOTIFY)
    status, run = await d.run("notify", {"owner": "ana"})
    assert status == 201 and run["status"] == "succeeded" and run["output"] == {}
    _, page = await d.call("GET", "/interactions")
    assert page["data"] == []
    status, body = await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {}})
    assert status == 409 and body["kind"] == "notification"


async def test_open_request_limit(db, aiohttp_client):
    d = await start_daemon(aiohttp_client, db,
                           config=itd.Config(open_requests=2, playbooks={"local/default": ()}))
    await d.define("approve", APPROVAL)
    for _ in range(2):
        assert (await d.run("approve", INPUT))[0] == 202
    status, run = await d.run("approve", INPUT)
    assert status == 503 and run["status"] == "unavailable" and run["kind"] == "requests_full"
    _, page = await d.call("GET", "/interactions")
    await d.call("POST", f"/runs/{page['data'][0]['run_id']}/answer", {"answer": {"verdict": "approve"}})
    assert (await d.run("approve", INPUT))[0] == 202


async def test_client_run_ids(d):
    await d.define("approve", APPROVAL)
    status, first = await d.run("approve", INPUT, run_id="brief-42")
    assert status == 202 and first["run_id"] == "brief-42"
    status, again = await d.run("approve", INPUT, run_id="brief-42")
    assert status == 202 and again["status"] == "waiting"
    _, page = await d.call("GET", "/interactions")
    assert len(page["data"]) == 1
    status, other = await d.run("approve", dict(INPUT, owner="bo"), run_id="brief-42")
    assert status == 409 and other["kind"] == "run_id_taken"
    status, bad = await d.run("approve", INPUT, run_id="has space")
    assert status == 422 and bad["errors"][0]["pointer"] == "/run_id"
    await d.call("POST", "/runs/brief-42/answer", {"answer": {"verdict": "revise"}})
    status, ended = await d.run("approve", INPUT, run_id="brief-42")
    assert status == 200 and ended["status"] == "succeeded" and ended["output"] == {"verdict": "revise"}


async def test_expiry_at_the_exact_moment(d):
    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", INPUT)
    await d.advance("PT47H59M59.999S")
    _, got = await d.call("GET", f"/runs/{run['run_id']}")
    assert got["status"] == "waiting"
    await d.advance("PT0.001S")
    status, got = await d.call("POST", f"/runs/{run['run_id']}/wait?timeout=0")
    assert status == 410 and got["status"] == "rejected" and got["kind"] == "expired"
    assert got["problem"]["type"] == "/problems/unanswered"
    assert got["ended_at"] == itd.fmt_time(START_MS + 2 * 86400_000)
    _, page = await d.call("GET", "/interactions")
    assert page["data"] == []
    status, body = await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "approve"}})
    assert status == 409 and body["type"] == "/problems/not_open"


async def test_cancel(d):
    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", INPUT)
    status, got = await d.call("POST", f"/runs/{run['run_id']}/cancel")
    assert status == 200 and got["status"] == "rejected" and got["kind"] == "cancelled"
    assert got["problem"]["type"] == "/problems/cancelled"
    _, page = await d.call("GET", "/interactions")
    assert page["data"] == []
    status, body = await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "approve"}})
    assert status == 409
    _, hist = await d.call("GET", f"/runs/{run['run_id']}/events")
    assert [e["type"] for e in hist["data"]] == ["interaction_requested", "run_rejected"]
    # The expiry timer went with the request: moving past it changes nothing.
    await d.advance("P3D")
    _, hist2 = await d.call("GET", f"/runs/{run['run_id']}/events")
    assert len(hist2["data"]) == 2


async def test_paging_across_three_pages(d):
    await d.define("approve", APPROVAL)
    ids = []
    for i in range(5):
        _, run = await d.run("approve", dict(INPUT, owner="ana" if i % 2 == 0 else "bo"))
        ids.append(run["run_id"])
    seen, cursor, pages = [], None, 0
    while True:
        q = "/interactions?limit=2" + (f"&cursor={cursor}" if cursor else "")
        status, page = await d.call("GET", q)
        assert status == 200
        pages += 1
        seen += [r["run_id"] for r in page["data"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert pages == 3 and seen == list(reversed(ids))
    _, only_ana = await d.call("GET", "/interactions?to=ana")
    assert [r["run_id"] for r in only_ana["data"]] == [ids[4], ids[2], ids[0]]
    _, by_function = await d.call("GET", "/interactions?function=other")
    assert by_function["data"] == []
    assert (await d.call("GET", "/interactions?limit=0"))[0] == 422
    assert (await d.call("GET", "/interactions?limit=201"))[1]["errors"][0]["pointer"] == "/limit"
    assert (await d.call("GET", "/interactions?cursor=%%%"))[0] == 400


async def test_fifty_concurrent_different_answers_one_wins(d):
    schema_doc = APPROVAL.replace("note: { type: string, maxLength: 2000 }", "note: { type: string }")
    await d.define("approve", schema_doc)
    _, run = await d.run("approve", INPUT)
    results = await asyncio.gather(*[
        d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "approve", "note": f"n{i}"}})
        for i in range(50)])
    statuses = sorted(s for s, _ in results)
    assert statuses.count(200) == 1 and statuses.count(409) == 49
    winner = next(b for s, b in results if s == 200)
    _, got = await d.call("GET", f"/runs/{run['run_id']}")
    assert got["output"] == winner["answer"]
    _, hist = await d.call("GET", f"/runs/{run['run_id']}/events")
    assert [e["type"] for e in hist["data"]].count("request_answered") == 1


async def test_wait_is_woken_by_the_answer(d):
    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", INPUT)
    with watching_waits(d) as parked:
        waiter = asyncio.create_task(d.call("POST", f"/runs/{run['run_id']}/wait?timeout=30"))
        await asyncio.wait_for(parked.wait(), 5)
    assert not waiter.done()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "approve"}})
    status, got = await asyncio.wait_for(waiter, 5)
    assert status == 200 and got["status"] == "succeeded"
    assert loop.time() - t0 < 5


async def test_restart_keeps_requests_and_their_expiry(db, aiohttp_client):
    d = await start_daemon(aiohttp_client, db)
    await d.define("approve", APPROVAL)
    _, r1 = await d.run("approve", INPUT)
    _, r2 = await d.run("approve", INPUT)
    await d.advance("PT1H")
    now = d.clock.now_ms()
    await d.client.close()

    d2 = await start_daemon(aiohttp_client, db, clock=itd.ManualClock(now), tokens=d.tokens)
    _, page = await d2.call("GET", "/interactions")
    assert {r["run_id"] for r in page["data"]} == {r1["run_id"], r2["run_id"]}
    await d2.call("POST", f"/runs/{r1['run_id']}/answer", {"answer": {"verdict": "approve"}})
    await d2.advance("PT46H59M59S")
    assert (await d2.call("GET", f"/runs/{r2['run_id']}"))[1]["status"] == "waiting"
    await d2.advance("PT1S")
    got = (await d2.call("GET", f"/runs/{r2['run_id']}"))[1]
    assert got["status"] == "rejected" and got["kind"] == "expired"
    assert (await d2.call("GET", f"/runs/{r1['run_id']}"))[1]["status"] == "succeeded"


async def test_auth(d):
    url = d.url("/interactions")
    assert (await d.client.get(url)).status == 401
    resp = await d.client.get(url, headers={"Authorization": "Bearer nope"})
    assert resp.status == 401 and resp.content_type == "application/problem+json"
    assert (await d.call("GET", "/interactions", role="reader"))[0] == 200
    status, body = await d.call("POST", "/definitions", {"type": "interaction", "name": "a", "source": APPROVAL},
                                role="reader")
    assert status == 403 and body["type"] == "/problems/forbidden"
    # A token bound to another playbook sees nothing of this one: 404, never 403.
    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", INPUT)
    assert (await d.call("GET", f"/runs/{run['run_id']}", role="other"))[0] == 404
    assert (await d.call("GET", f"/runs/{run['run_id']}", role="writer"))[0] == 200
    assert (await d.call("GET", "/interactions", role="writer", playbook="acme/other"))[0] == 404
    assert (await d.call("GET", "/interactions", role="other", playbook="acme/other"))[0] == 200
    assert (await d.call("POST", "/v1/admin/clock", {"advance": "PT1M"}, role="writer"))[0] == 403
    assert (await d.client.get("/healthz")).status == 200


async def test_body_limits(d):
    resp = await d.client.post(d.url("/definitions"), data=b"{" + b" " * (2 * 1024 * 1024) + b"}",
                               headers=dict(d.auth(), **{"Content-Type": "application/json"}))
    assert resp.status == 413 and (await resp.json())["type"] == "/problems/too_large"
    resp = await d.client.post(d.url("/runs"), data=b"{not json", headers=d.auth())
    assert resp.status == 400 and (await resp.json())["type"] == "/problems/bad_request"


async def test_openapi_matches_routes(d):
    resp = await d.client.get("/openapi.json")
    spec = await resp.json()
    assert spec["openapi"].startswith("3.1")
    documented = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    served = set()
    for route in d.client.app.router.routes():
        info = route.resource.get_info() if route.resource else {}
        path = info.get("path") or info.get("formatter")
        if path and route.method not in ("HEAD", "*"):
            served.add((route.method, path))
    assert documented <= served
    assert {p for _, p in served if p.startswith("/v1/")} <= {p for _, p in documented}
    status = (await d.client.get("/problems/unanswered")).status
    assert status == 200


async def test_every_route_resolves_to_its_handler(d):
    """The router adds runs and answers first; each path of ROUTES still reaches its own handler."""
    from aiohttp.test_utils import make_mocked_request
    app = d.client.app
    for r in itd.ROUTES:
        path = re.sub(r"{(\w+)}", lambda m: "x" if m.group(1) != "org" else "acme", r.path)
        info = await app.router.resolve(make_mocked_request(r.method, path, app=app))
        assert info.handler is r.handler, (r.method, r.path)
    first = [res.canonical for res in app.router.resources()][:2]
    assert set(first) == {itd.PB + "/runs", itd.PB + "/runs/{run_id}/answer"}
    resp = await d.client.put(d.url("/runs"), headers=d.auth())
    assert resp.status == 405 and (await resp.json())["status"] == 405


async def test_list_runs_filters_and_pages(d):
    await d.define("approve", APPROVAL)
    await d.define("notify", NOTIFY)
    waiting = [(await d.run("approve", INPUT))[1]["run_id"] for _ in range(3)]
    done = (await d.run("notify", {"owner": "ana"}))[1]["run_id"]
    _, page = await d.call("GET", "/runs?status=waiting&limit=2")
    assert [r["run_id"] for r in page["data"]] == waiting[::-1][:2] and page["next_cursor"]
    _, rest = await d.call("GET", f"/runs?status=waiting&limit=2&cursor={page['next_cursor']}")
    assert [r["run_id"] for r in rest["data"]] == [waiting[0]] and rest["next_cursor"] is None
    _, by_fn = await d.call("GET", "/runs?function=notify")
    assert [r["run_id"] for r in by_fn["data"]] == [done]
    assert (await d.call("GET", "/runs?status=bogus"))[0] == 422
