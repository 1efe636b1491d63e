"""Client.require_approval and Client.ask (SPEC section 26) against a real daemon on a real port:
a decorated function (sync and async) is shown for approval and runs once with the approved - maybe
edited - arguments, or raises Declined or Unanswered and never runs; `ask` returns the answer.
The person answers over HTTP while the call waits; time runs on the manual clock."""
from __future__ import annotations

import asyncio
import json
import urllib.parse
from typing import Any

import aiohttp
import pytest

import interactiond as itd
from daemon_kit import START_MS, make_tokens, until


@pytest.fixture
def backend() -> str:
    return "sqlite"                      # the client sees HTTP only; the backends are tested beneath it


@pytest.fixture
async def live(db, aiohttp_server):
    tokens = make_tokens(db)
    engine = itd.Engine(itd.Store(db), itd.ManualClock(START_MS),
                        itd.Config(playbooks={"local/default": (), "acme/other": ()}))
    server = await aiohttp_server(itd.build_app(engine))
    url = str(server.make_url("")).rstrip("/")
    return {"client": itd.Client(url, tokens["writer"], backoff=0.01), "url": url, "tokens": tokens, "engine": engine}


async def call(live, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.request(method, live["url"] + path, json=body,
                             headers={"Authorization": f"Bearer {live['tokens']['operator']}"}) as resp:
            return resp.status, await resp.json()


V1 = "/v1/orgs/local/playbooks/default"


async def asked(live, to: str = "ana", n: int = 1) -> list[dict[str, Any]]:
    """The open requests addressed to `to`, once there are `n` of them."""
    async def look() -> list[dict[str, Any]] | None:
        _, page = await call(live, "GET", f"{V1}/interactions?to={to}")
        return page["data"] if len(page["data"]) >= n else None
    return await until(look, what=f"{n} request(s) for {to}")


async def answer(live, run_id: str, answer_: dict[str, Any]) -> tuple[int, Any]:
    return await call(live, "POST", f"{V1}/runs/{run_id}/answer", {"answer": answer_})


async def test_a_sync_call_runs_once_with_the_arguments_as_approved_and_edited(live):
    c: itd.Client = live["client"]
    ran: list[tuple[str, int, str]] = []

    @c.require_approval(to="ana", expires="PT2H", edit=["amount"])
    def pay(invoice: str, amount: int, currency: str = "EUR") -> str:
        ran.append((invoice, amount, currency))
        return f"paid {amount} {currency} on {invoice}"

    assert pay.__name__ == "pay"
    waiting = asyncio.create_task(asyncio.to_thread(pay, "inv-7", 1200))
    [req] = await asked(live)
    assert req["name"] == "approve-test-a-sync-call-runs-once-with-the-arguments-as-approved-and-edited-locals-pay"
    assert req["message"].startswith("May `test_a_sync_call_runs_once_with_the_arguments_as_approved_and_edited"
                                     ".<locals>.pay` run with these arguments?")
    assert '"invoice": "inv-7"' in req["message"] and "You may change: amount." in req["message"]
    assert '"amount": 1200' in req["message"] and '"currency": "EUR"' in req["message"]
    assert req["expires_at"] == itd.fmt_time(START_MS + 2 * 3_600_000)
    assert ran == []                                          # nothing runs before the answer
    async with aiohttp.ClientSession() as s:                  # the person's page: approve or not, and the change
        parts = urllib.parse.urlsplit(req["answer_url"])
        async with s.get(live["url"] + parts.path) as resp:
            page = await resp.text()
    assert resp.status == 200 and '<button type="submit" name="choice" value="0">Yes</button>' in page
    assert "You may change: amount." in page and 'class="json"' in page
    status, problem = await answer(live, req["run_id"], {"approved": True, "arguments": {"invoice": "inv-8"}})
    assert status == 422, problem                             # only `amount` may change
    status, _ = await answer(live, req["run_id"], {"approved": True, "arguments": {"amount": 1000},
                                                   "note": "capped"})
    assert status == 200
    assert await waiting == "paid 1000 EUR on inv-7"
    assert ran == [("inv-7", 1000, "EUR")]


async def test_an_async_call_waits_without_holding_the_loop_and_runs_once(live):
    c: itd.Client = live["client"]
    ran: list[dict[str, Any]] = []

    @c.require_approval(to="bo", name="deploy-approval")
    async def deploy(service: str, *, version: str) -> str:
        await asyncio.sleep(0)
        ran.append({"service": service, "version": version})
        return "deployed"

    waiting = asyncio.create_task(deploy("api", version="1.4.2"))
    [req] = await asked(live, "bo")
    assert req["name"] == "deploy-approval" and ran == []
    assert (await answer(live, req["run_id"], {"approved": True}))[0] == 200
    assert await asyncio.wait_for(waiting, 10) == "deployed"
    assert ran == [{"service": "api", "version": "1.4.2"}]
    # The saved approval is used again, not saved again; a second call asks again.
    second = asyncio.create_task(deploy("web", version="2.0"))
    [req2] = await asked(live, "bo")
    assert req2["run_id"] != req["run_id"] and req2["version"] == req["version"]
    assert (await answer(live, req2["run_id"], {"approved": True}))[0] == 200
    assert await asyncio.wait_for(second, 10) == "deployed" and len(ran) == 2


async def test_a_refusal_raises_declined_and_the_function_never_runs(live):
    c: itd.Client = live["client"]
    ran: list[str] = []

    @c.require_approval(to="ana")
    def drop_table(name: str) -> None:
        ran.append(name)

    waiting = asyncio.create_task(asyncio.to_thread(drop_table, "users"))
    [req] = await asked(live)
    assert (await answer(live, req["run_id"], {"approved": False, "note": "not on a Friday"}))[0] == 200
    with pytest.raises(itd.Declined) as err:
        await waiting
    assert err.value.note == "not on a Friday" and err.value.run_id == req["run_id"]
    assert "not on a Friday" in str(err.value) and ran == []


async def test_no_answer_before_it_expires_raises_unanswered(live):
    c: itd.Client = live["client"]
    ran: list[int] = []

    @c.require_approval(to="ana", expires="PT1H")
    async def restart(node: int) -> None:
        ran.append(node)

    waiting = asyncio.create_task(restart(3))
    await asked(live)
    status, _ = await call(live, "POST", "/v1/admin/clock", {"advance": "PT1H"})
    assert status == 200
    with pytest.raises(itd.Unanswered) as err:
        await asyncio.wait_for(waiting, 10)
    assert err.value.kind == "expired" and ran == []


async def test_a_callers_timeout_cancels_the_request(live):
    c: itd.Client = live["client"]

    @c.require_approval(to="ana", timeout=0.3)
    def rotate(key: str) -> None:
        raise AssertionError("never runs")

    with pytest.raises(itd.Unanswered) as err:
        await asyncio.to_thread(rotate, "k1")
    assert err.value.kind == "timed_out"
    status, run = await call(live, "GET", f"{V1}/runs/{err.value.run_id}")
    assert run["status"] == "rejected" and run["kind"] == "cancelled"


async def test_what_cannot_be_shown_or_edited_is_refused_before_anything_is_asked(live):
    c: itd.Client = live["client"]
    with pytest.raises(ValueError, match="edit names amount"):
        @c.require_approval(to="ana", edit=["amount"])
        def f(x: int) -> None: ...
    with pytest.raises(ValueError):
        c.require_approval(to="ana", expires="tomorrow")

    @c.require_approval(to="ana")
    def g(when: object) -> None: ...

    with pytest.raises(TypeError, match="shown for approval as JSON"):
        await asyncio.to_thread(g, object())
    _, page = await call(live, "GET", f"{V1}/interactions")
    assert page["data"] == []


async def test_ask_returns_the_answer(live):
    c: itd.Client = live["client"]
    waiting = asyncio.create_task(asyncio.to_thread(c.ask, "Ship the spring release?", to="ana"))
    [req] = await asked(live)
    assert req["name"] == "ask-approval" and req["message"] == "Ship the spring release?"
    assert (await answer(live, req["run_id"], {"approved": True, "comment": "go"}))[0] == 200
    assert await waiting == {"approved": True, "comment": "go"}

    options = [{"id": "a", "label": "Monday"}, {"id": "b", "label": "Friday"}]
    waiting = asyncio.create_task(asyncio.to_thread(c.ask, "Which day?", to="bo", type="choice", options=options,
                                                    expires="PT4H"))
    [req] = await asked(live, "bo")
    assert req["expires_at"] == itd.fmt_time(START_MS + 4 * 3_600_000)
    assert (await answer(live, req["run_id"], {"option_ids": ["b"]}))[0] == 200
    assert await waiting == {"option_ids": ["b"]}

    waiting = asyncio.create_task(asyncio.to_thread(c.ask, "Still there?", to="cy", type="confirmation",
                                                    expires="PT1M"))
    await asked(live, "cy")
    await call(live, "POST", "/v1/admin/clock", {"advance": "PT1M"})
    with pytest.raises(itd.Unanswered) as err:
        await waiting
    assert err.value.kind == "expired"
    with pytest.raises(ValueError):
        c.ask("?", to="ana", type="poll")
    with pytest.raises(itd.ClientError) as bad:
        await asyncio.to_thread(c.ask, "Which?", to="ana", type="choice")     # a choice needs options
    assert bad.value.status == 422 and json.dumps(bad.value.problem)
