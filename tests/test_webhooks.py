"""Signed webhooks (SPEC section 26): a playbook's events POSTed to a real receiver (an aiohttp app in
the test process) with Standard Webhooks' headers, the signature checked here by its own code; the
retries at 1 min, 5 min, 30 min, 2 h and 8 h (Retry-After honoured), a receiver that hangs holding
nothing else up, the operator's list of deliveries, the secret scrubbed, the configuration's checks.
Every test runs on both backends, on the manual clock."""
from __future__ import annotations

import asyncio
import base64
import json
import time
from datetime import datetime, timezone
from typing import Any

import pytest
from aiohttp import web
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

import interactiond as itd
from daemon_kit import APPROVAL, START_MS, start_daemon, until

SECRET = "whsec_" + base64.b64encode(b"a receiver's shared key, 32 byte").decode()
INPUT = {"owner": "ana", "review": "Clear goals; budget missing."}
MIN = 60_000


class Receiver:
    """A webhook receiver on a real port: every request it got, answered as `answers` says (one a
    request, then 204s), or held until `release` is set while `hold` is."""

    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []
        self.answers: list[web.Response] = []
        self.hold = False
        self.release = asyncio.Event()
        self.arrived = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.got.append({"headers": dict(request.headers), "body": body, "path": request.path})
        self.arrived.set()
        if self.hold:
            await self.release.wait()
        return self.answers.pop(0) if self.answers else web.Response(status=204)


def verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """Whether one of the message's v1 signatures is the one Standard Webhooks' own library makes of
    its id, timestamp and body (the library's whole verify() also wants a timestamp near the real
    time, which the manual clock is not: test_a_standard_webhooks_receiver_takes_it does that)."""
    when = datetime.fromtimestamp(int(headers["webhook-timestamp"]), timezone.utc)
    expected = Webhook(secret).sign(headers["webhook-id"], when, body)
    return expected in headers["webhook-signature"].split(" ")


@pytest.fixture
async def hooked(db, aiohttp_client, aiohttp_server):
    receiver = Receiver()
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    app.router.add_post("/ended", receiver.handle)
    server = await aiohttp_server(app)
    url = str(server.make_url("/hook"))
    hooks = {"local/default": (itd.WebhookConfig(url, frozenset({"*"}), "HOOK_SECRET", SECRET),
                               itd.WebhookConfig(str(server.make_url("/ended")), frozenset({"run_ended"}),
                                                 "HOOK_SECRET", SECRET))}
    config = itd.Config(playbooks={"local/default": (), "acme/other": ()}, webhooks=hooks)
    d = await start_daemon(aiohttp_client, db, config=config)
    await d.define("approve", APPROVAL)
    return d, receiver


def sent(receiver: Receiver, path: str = "/hook", type_: str | None = None) -> list[dict[str, Any]]:
    got = [{**g, "json": json.loads(g["body"])} for g in receiver.got if g["path"] == path]
    return [g for g in got if type_ is None or g["json"]["type"] == type_]


async def deliveries(d, **q: Any) -> dict[str, Any]:
    query = "&".join(f"{k}={v}" for k, v in q.items())
    status, body = await d.call("GET", "/webhooks/deliveries" + (f"?{query}" if query else ""))
    assert status == 200, body
    return body


async def test_each_event_is_posted_signed_in_standard_webhooks_form(hooked):
    d, receiver = hooked
    _, run = await d.run("approve", INPUT)
    run_id = run["run_id"]
    await d.advance("PT0S")
    [opened] = sent(receiver)
    h = opened["headers"]
    assert h["Content-Type"] == "application/json"
    assert verify(SECRET, h, opened["body"])
    assert not verify("whsec_" + base64.b64encode(b"another key").decode(), h, opened["body"])
    assert not verify(SECRET, h, opened["body"].replace(b"ana", b"eve"))
    assert h["webhook-timestamp"] == str(START_MS // 1000)               # the daemon's clock, in seconds
    assert h["webhook-id"].startswith("msg_")
    body = opened["json"]
    assert body["type"] == "request_opened" and body["timestamp"] == itd.fmt_time(START_MS)
    assert body["data"]["run_id"] == run_id and body["data"]["playbook"] == "local/default"
    assert body["data"]["event"] == "interaction_requested" and body["data"]["payload"]["to"] == "ana"

    await d.advance("PT1H")
    status, _ = await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"verdict": "approve"}})
    assert status == 200
    await d.advance("PT0S")
    got = sent(receiver)
    assert [g["json"]["type"] for g in got] == ["request_opened", "request_answered", "run_ended"]
    assert all(verify(SECRET, g["headers"], g["body"]) for g in got)
    assert got[1]["json"]["data"]["payload"]["answer"] == {"verdict": "approve"}
    assert got[2]["json"]["data"]["payload"]["status"] == "succeeded"
    assert got[1]["headers"]["webhook-timestamp"] == str((START_MS + 3_600_000) // 1000)
    assert len({g["headers"]["webhook-id"] for g in got}) == 3
    # The second hook takes run_ended only.
    [ended] = sent(receiver, "/ended")
    assert ended["json"]["type"] == "run_ended" and verify(SECRET, ended["headers"], ended["body"])
    listed = await deliveries(d)
    assert [x["type"] for x in listed["data"]] == ["run_ended", "run_ended", "request_answered", "request_opened"]
    assert all(x["state"] == "delivered" and x["attempts"] == 1 for x in listed["data"])
    assert listed["data"][-1]["history"] == [{"n": 1, "at": itd.fmt_time(START_MS), "status": 204, "error": None}]
    assert listed["page"] == {"has_more": False, "next_cursor": None}
    assert await d.engine.store.read(lambda tx: [k for k, _ in tx.all_timers() if k.startswith("webhook:")]) == []


async def test_a_standard_webhooks_receiver_takes_it(db, aiohttp_client, aiohttp_server):
    """On a clock at the real time, the library's whole check passes: headers, timestamp, signature."""
    receiver = Receiver()
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    server = await aiohttp_server(app)
    config = itd.Config(playbooks={"local/default": (), "acme/other": ()},
                        webhooks={"local/default": (itd.WebhookConfig(str(server.make_url("/hook")),
                                                                      frozenset({"request_opened"}), "S", SECRET),)})
    d = await start_daemon(aiohttp_client, db, config=config, clock=itd.ManualClock(int(time.time() * 1000)))
    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", INPUT)
    await d.advance("PT0S")
    [got] = receiver.got
    assert Webhook(SECRET).verify(got["body"], got["headers"])["data"]["run_id"] == run["run_id"]
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(got["body"].replace(b"ana", b"eve"), got["headers"])
    with pytest.raises(WebhookVerificationError):
        Webhook("whsec_" + base64.b64encode(b"not the key").decode()).verify(got["body"], got["headers"])


async def test_reminders_and_escalations_are_posted_to_the_hooks_that_take_them(hooked):
    d, receiver = hooked
    followed = APPROVAL.replace("expires: P2D\n", "expires: P2D\nremind: {after: [PT1H]}\n"
                                                  "escalate: {after: PT2H, to: bo}\n")
    await d.define("followed", followed)
    _, run = await d.run("followed", INPUT)
    await d.advance("PT2H")
    got = sent(receiver)
    assert [g["json"]["type"] for g in got] == ["request_opened", "request_reminded", "request_escalated"]
    assert got[1]["json"]["data"]["payload"]["n"] == 1 and got[2]["json"]["data"]["payload"]["to"] == "bo"
    assert got[2]["json"]["timestamp"] == itd.fmt_time(START_MS + 2 * 3_600_000)
    assert sent(receiver, "/ended") == []                   # that hook takes run_ended only
    await d.call("POST", f"/runs/{run['run_id']}/cancel")
    await d.advance("PT0S")
    [ended] = sent(receiver, "/ended")
    assert ended["json"]["data"]["event"] == "run_rejected" and ended["json"]["data"]["payload"]["kind"] == "cancelled"


async def test_failures_are_tried_again_at_1_5_30_minutes_2_and_8_hours_then_given_up(hooked):
    d, receiver = hooked
    receiver.answers = [web.Response(status=500, text="busy") for _ in range(6)]
    _, run = await d.run("approve", INPUT)
    await d.advance("PT0S")
    assert len(sent(receiver, type_="request_opened")) == 1
    times = [START_MS]
    for gap in (1, 5, 30, 120, 480):                       # minutes after the attempt before
        await d.advance(f"PT{gap * 60 - 1}S")
        assert len(sent(receiver, type_="request_opened")) == len(times), f"too early before the attempt {gap} minutes on"
        await d.advance("PT1S")
        times.append(times[-1] + gap * MIN)
        assert len(sent(receiver, type_="request_opened")) == len(times)
    await d.advance("P2D")
    assert len(sent(receiver, type_="request_opened")) == 6                        # six attempts in all
    [item] = [x for x in (await deliveries(d))["data"] if x["type"] == "request_opened"]
    assert item["state"] == "failed" and item["attempts"] == 6 and item["next_attempt_at"] is None
    assert [h["at"] for h in item["history"]] == [itd.fmt_time(t) for t in times]
    assert all(h["status"] == 500 and h["error"] == "HTTP 500: busy" for h in item["history"])
    # Every attempt sent the same message: one id, one body, each signed afresh.
    assert len({g["headers"]["webhook-id"] for g in sent(receiver, type_="request_opened")}) == 1
    assert len({g["body"] for g in sent(receiver, type_="request_opened")}) == 1
    assert all(verify(SECRET, g["headers"], g["body"]) for g in sent(receiver, type_="request_opened"))
    # The run itself went on as if nothing were wrong: it expired after two days, which was sent too.
    assert (await d.call("GET", f"/runs/{run['run_id']}"))[1]["status"] == "rejected"
    assert len(sent(receiver, type_="run_ended")) == 1


async def test_retry_after_is_honoured(hooked):
    d, receiver = hooked
    receiver.answers = [web.Response(status=429, headers={"Retry-After": "600"}),
                        web.Response(status=503, headers={"Retry-After": "30"})]
    await d.run("approve", INPUT)
    await d.advance("PT0S")
    await d.advance("PT9M59S")
    assert len(sent(receiver)) == 1                        # not at 1 minute: the receiver asked for 10
    await d.advance("PT1S")
    assert len(sent(receiver)) == 2
    await d.advance("PT30S")
    assert len(sent(receiver)) == 3                        # 30 s after, as asked (sooner than 5 minutes)
    [item] = [x for x in (await deliveries(d))["data"] if x["url"].endswith("/hook")]
    assert item["state"] == "delivered" and [h["status"] for h in item["history"]] == [429, 503, 204]


async def test_a_receiver_that_is_down_is_retried_and_then_answers(db, aiohttp_client, aiohttp_server, unused_tcp_port):
    url = f"http://127.0.0.1:{unused_tcp_port}/hook"             # nothing listens there yet
    config = itd.Config(playbooks={"local/default": (), "acme/other": ()},
                        webhooks={"local/default": (itd.WebhookConfig(url, frozenset({"request_opened"}),
                                                                      "HOOK_SECRET", SECRET),)})
    d = await start_daemon(aiohttp_client, db, config=config)
    await d.define("approve", APPROVAL)
    await d.run("approve", INPUT)
    await d.advance("PT0S")
    [item] = (await deliveries(d))["data"]
    assert item["state"] == "retrying" and item["history"][0]["status"] is None
    assert "Connect" in item["history"][0]["error"] and item["next_attempt_at"] == itd.fmt_time(START_MS + MIN)
    receiver = Receiver()
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    await aiohttp_server(app, port=unused_tcp_port)
    await d.advance("PT1M")
    assert len(receiver.got) == 1 and verify(SECRET, receiver.got[0]["headers"], receiver.got[0]["body"])
    [item] = (await deliveries(d))["data"]
    assert item["state"] == "delivered" and item["attempts"] == 2


async def test_a_receiver_that_hangs_holds_nothing_else_up(hooked):
    d, receiver = hooked
    receiver.hold = True
    _, run = await d.run("approve", INPUT)
    await asyncio.wait_for(receiver.arrived.wait(), 10)      # the POST is in flight, and stays there
    status, fact = await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "revise"}})
    assert status == 200 and fact["answer"] == {"verdict": "revise"}
    assert (await d.call("GET", f"/runs/{run['run_id']}"))[1]["status"] == "succeeded"
    _, other = await d.run("approve", INPUT)                 # a new run starts meanwhile
    assert other["status"] == "started"
    await until(lambda: len(receiver.got) >= 4, what="the later events' attempts run beside the held one")
    receiver.release.set()
    await d.advance("PT0S")
    states = {x["state"] for x in (await deliveries(d))["data"]}
    assert states == {"delivered"}


async def test_an_attempt_cut_off_by_a_stop_is_made_again_a_minute_later(hooked, aiohttp_client, monkeypatch):
    d, receiver = hooked
    monkeypatch.setattr(itd, "SHUTDOWN_GRACE_S", 0.2)
    receiver.hold = True
    await d.run("approve", INPUT)
    await asyncio.wait_for(receiver.arrived.wait(), 10)
    [item] = (await deliveries(d))["data"]
    assert item["state"] == "sending" and item["attempts"] == 1
    await d.client.close()                           # the daemon stops with the POST in flight: no end recorded
    receiver.hold = False
    receiver.release.set()
    d2 = await start_daemon(aiohttp_client, d.db, clock=itd.ManualClock(START_MS), config=d.config, tokens=d.tokens)
    await d2.advance("PT59S")
    assert len(sent(receiver)) == 1
    await d2.advance("PT1S")
    assert len(sent(receiver)) == 2 and sent(receiver)[0]["body"] == sent(receiver)[1]["body"]
    assert verify(SECRET, sent(receiver)[1]["headers"], sent(receiver)[1]["body"])
    [item] = (await deliveries(d2))["data"]
    assert item["state"] == "delivered" and item["attempts"] == 2
    assert item["history"][0]["error"].startswith("lost") and item["history"][1]["status"] == 204


async def test_the_list_is_the_operators_and_pages(hooked):
    d, receiver = hooked
    for _ in range(3):
        await d.run("approve", INPUT)
    await d.advance("PT0S")
    first = await deliveries(d, limit=2)
    assert len(first["data"]) == 2 and first["page"]["has_more"] is True
    assert first["next_cursor"] == first["page"]["next_cursor"]
    second = await deliveries(d, limit=2, cursor=first["page"]["next_cursor"])
    assert len(second["data"]) == 1 and second["page"] == {"has_more": False, "next_cursor": None}
    ids = [x["id"] for x in first["data"] + second["data"]]
    assert len(set(ids)) == 3 and ids == sorted(ids, key=lambda i: int(i[4:]), reverse=True)
    for role in ("writer", "reader"):
        status, problem = await d.call("GET", "/webhooks/deliveries", role=role)
        assert status == 403, problem
    status, body = await d.call("GET", "/webhooks/deliveries?limit=0")
    assert status == 422 and body["errors"][0]["pointer"] == "/limit"
    status, body = await d.call("GET", "/webhooks/deliveries", playbook="acme/other")
    assert status == 200 and body["data"] == []                         # a playbook with no webhooks


async def test_the_secret_is_scrubbed_from_what_is_recorded(hooked):
    d, receiver = hooked
    _, run = await d.run("approve", INPUT)
    status, fact = await d.call("POST", f"/runs/{run['run_id']}/answer",
                                {"answer": {"verdict": "revise", "note": f"the key is {SECRET}"}})
    assert status == 200 and SECRET not in json.dumps(fact) and itd.SCRUBBED in fact["answer"]["note"]
    await d.advance("PT0S")
    assert all(SECRET.encode() not in g["body"] for g in receiver.got)
    assert SECRET not in json.dumps(await deliveries(d))


def test_the_configuration_reads_webhooks_and_names_every_problem(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("playbooks:\n  acme/ops:\n    webhooks:\n"
                    "      - {url: 'https://hooks.example.org/in', events: [request_answered, run_ended],"
                    " secret_env: HOOK_SECRET}\n")
    config = itd.load_config(str(path), {"HOOK_SECRET": SECRET})
    [hook] = config.webhooks["acme/ops"]
    assert hook.url == "https://hooks.example.org/in" and hook.events == {"request_answered", "run_ended"}
    assert hook.key() == b"a receiver's shared key, 32 byte" and SECRET in config.secrets
    assert SECRET not in repr(config)
    with pytest.raises(itd.ConfigError) as err:
        itd.load_config(str(path), {})
    assert err.value.problems == ["playbooks.acme/ops.webhooks[0].secret_env: the environment variable"
                                  " HOOK_SECRET is not set (it holds the secret)"]
    path.write_text("playbooks:\n  acme/ops:\n    webhooks:\n"
                    "      - {url: 'ftp://x', events: [request_closed], secret_env: HOOK_SECRET, retries: 3}\n")
    with pytest.raises(itd.ConfigError) as err:
        itd.load_config(str(path), {"HOOK_SECRET": "plain-secret"})
    assert err.value.problems == [
        "playbooks.acme/ops.webhooks[0].retries: unknown key",
        "playbooks.acme/ops.webhooks[0].url: an http:// or https:// URL the events are POSTed to",
        "playbooks.acme/ops.webhooks[0].events: 'request_closed' is not an event (known: request_opened,"
        " request_answered, request_reminded, request_escalated, run_ended, or *)"]
    path.write_text("playbooks:\n  acme/ops:\n    webhooks: {url: 'https://x'}\n")
    with pytest.raises(itd.ConfigError) as err:
        itd.load_config(str(path), {})
    assert err.value.problems[0].startswith("playbooks.acme/ops.webhooks: a list of at most 16 webhooks")


async def test_two_daemons_on_one_postgresql_database_send_each_message_once(aiohttp_client, aiohttp_server):
    from daemon_kit import fresh_postgres
    receiver = Receiver()
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    server = await aiohttp_server(app)
    config = itd.Config(playbooks={"local/default": (), "acme/other": ()},
                        webhooks={"local/default": (itd.WebhookConfig(str(server.make_url("/hook")), frozenset({"*"}),
                                                                      "HOOK_SECRET", SECRET),)})
    receiver.answers = [web.Response(status=503) for _ in range(4)]        # the first four attempts fail
    with fresh_postgres() as url:
        a = await start_daemon(aiohttp_client, url, config=config)
        b = await start_daemon(aiohttp_client, url, config=config, tokens=a.tokens)
        await a.define("approve", APPROVAL)
        for i in range(4):
            _, run = await (a if i % 2 else b).run("approve", INPUT)
            assert (await (b if i % 2 else a).call("POST", f"/runs/{run['run_id']}/answer",
                                                   {"answer": {"verdict": "approve"}}))[0] == 200
        await asyncio.gather(a.advance("PT10M"), b.advance("PT10M"))
        kinds = [json.loads(g["body"])["type"] for g in receiver.got]
        ids = [g["headers"]["webhook-id"] for g in receiver.got[4:]]          # after the four that failed
        assert len(ids) == len(set(ids)) == 12                               # 12 messages, each delivered once
        assert sorted(set(kinds)) == ["request_answered", "request_opened", "run_ended"]
        listed = (await a.call("GET", "/webhooks/deliveries"))[1]["data"]
        assert len(listed) == 12 and {x["state"] for x in listed} == {"delivered"}
        assert sum(x["attempts"] for x in listed) == 16
        assert await a.engine.store.read(lambda tx: [k for k, _ in tx.all_timers() if k.startswith("webhook:")]) == []
