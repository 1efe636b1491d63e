"""An operator's view of a running daemon: GET /metrics (parsed with prometheus-client's own parser),
the 401 challenge (and what the official MCP client makes of it), and one name for the wait limit."""
from __future__ import annotations

import sys
from pathlib import Path

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from prometheus_client.parser import text_string_to_metric_families

import interactiond as itd
from daemon_kit import APPROVAL, start_daemon

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import chat_server  # noqa: E402

CHAT_DOC = (ROOT / "examples" / "chat-approval.md").read_text()


async def scrape(d, **headers) -> dict[tuple[str, tuple], float]:
    """Every sample of GET /metrics, as {(name, sorted labels): value}, read by prometheus-client."""
    resp = await d.client.get("/metrics", headers=headers or d.auth("operator"))
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(await resp.text()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples, name) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


@pytest.fixture
def backend() -> str:
    return "sqlite"                                 # the exposition and the command line: one backend is enough


@pytest.fixture
def d(chat_d):
    return chat_d


async def test_metrics_parse_and_move_when_a_request_is_answered(d):
    await d.define("approve", APPROVAL)
    before = await scrape(d)
    assert value(before, "interactiond_open_requests", playbook="local/default") == 0
    status, run = await d.run("approve", {"owner": "ana", "review": "r"})
    assert status == 202
    opened = await scrape(d)
    assert value(opened, "interactiond_open_requests", playbook="local/default") == 1
    assert value(opened, "interactiond_runs_started_total", playbook="local/default", type="interaction") == 1
    status, _ = await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "approve"}})
    assert status == 200
    after = await scrape(d)
    assert value(after, "interactiond_open_requests", playbook="local/default") == 0
    assert value(after, "interactiond_answers_total", playbook="local/default", channel="api") == 1
    assert value(after, "interactiond_runs_ended_total", playbook="local/default", status="succeeded", kind="") == 1
    answer_route = "/v1/orgs/{org}/playbooks/{playbook}/runs/{run_id}/answer"
    assert value(after, "interactiond_http_request_duration_seconds_count",
                 method="POST", route=answer_route, status="200") == 1
    assert total(after, "interactiond_commit_batch_size_count") > total(opened, "interactiond_commit_batch_size_count")
    assert total(after, "interactiond_commit_seconds_count") == total(after, "interactiond_commit_batch_size_count")

    # An expiry is a timer: it fires on the manual clock at its own moment, so it is not late.
    _, run = await d.run("approve", {"owner": "bo", "review": "r"})
    await d.advance("P3D")
    expired = await scrape(d)
    assert value(expired, "interactiond_runs_ended_total", playbook="local/default", status="rejected",
                 kind="expired") == 1
    assert total(expired, "interactiond_timer_lag_seconds_count") >= 1
    assert value(expired, "interactiond_timer_lag_seconds_bucket", le="0.001") == \
        total(expired, "interactiond_timer_lag_seconds_count")


async def test_metrics_count_delivery_attempts_reads_and_replies(d):
    chat_server.inject_fault(d.chat, "post_message", 1)
    await d.define("chat-approval", CHAT_DOC)
    status, run = await d.run("chat-approval", {"channel": "ops", "owner": "ana", "change": "More cache"})
    assert status == 202
    await d.advance("PT0S")                                     # the first attempt fails
    await d.advance("PT1M")                                     # the second is delivered
    ts = chat_server.messages(d.chat, "ops")[0]["ts"]
    await d.advance("PT30S")                                    # a read with nothing in it
    chat_server.say(d.chat, "ops", "ana", "go fine by me", thread_ts=ts)
    await d.advance("PT10M")
    samples = await scrape(d)
    assert value(samples, "interactiond_delivery_attempts_total", playbook="local/default", outcome="delivered") == 1
    failed = {dict(k[1])["outcome"]: v for k, v in samples.items()
              if k[0] == "interactiond_delivery_attempts_total" and dict(k[1])["outcome"] != "delivered"}
    assert sum(failed.values()) == 1, failed
    assert value(samples, "interactiond_reads_total", playbook="local/default", outcome="ok") >= 2
    assert value(samples, "interactiond_answers_total", playbook="local/default", channel="reply") == 1
    assert (await d.call("GET", f"/runs/{run['run_id']}"))[1]["status"] == "succeeded"


async def test_metrics_need_an_operator_unless_opened_on_loopback(d, tmp_path, aiohttp_client):
    assert (await d.client.get("/metrics")).status == 401
    assert (await d.client.get("/metrics", headers=d.auth("writer"))).status == 403
    opened = await start_daemon(aiohttp_client, str(tmp_path / "open.db"),
                                config=itd.Config(metrics_open_on_loopback=True))
    assert (await opened.client.get("/metrics")).status == 200
    # Through a proxy on this machine the peer is loopback too: a forwarded request needs the token.
    assert (await opened.client.get("/metrics", headers={"X-Forwarded-For": "203.0.113.9"})).status == 401
    assert (await opened.client.get("/metrics", headers={"X-Forwarded-For": "203.0.113.9", **opened.auth()})).status == 200
    assert "/metrics" in (await (await d.client.get("/openapi.json")).json())["paths"]


def test_metrics_in_the_configuration(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("metrics: {open_on_loopback: true}\n")
    assert itd.load_config(str(cfg), environ={}).metrics_open_on_loopback is True
    cfg.write_text("metrics: {open_on_loopback: 'yes', port: 1}\n")
    with pytest.raises(itd.ConfigError) as exc:
        itd.load_config(str(cfg), environ={})
    assert set(exc.value.problems) == {"metrics.port: unknown key", "metrics.open_on_loopback: true or false"}


async def test_every_401_carries_a_bearer_challenge(d):
    for headers, invalid in (({}, False), ({"Authorization": "Bearer itd_nope"}, True)):
        for method, path in (("GET", d.url("/runs")), ("GET", "/v2/interactions"), ("POST", "/mcp"),
                             ("GET", "/metrics")):
            resp = await d.client.request(method, path, headers=headers, json={})
            assert resp.status == 401, (method, path)
            challenge = resp.headers["WWW-Authenticate"]
            assert challenge.startswith("Bearer realm=") and ('error="invalid_token"' in challenge) == invalid


async def test_the_official_mcp_client_names_a_refused_token(d):
    url = str(d.client.make_url("/mcp"))
    async with httpx2.AsyncClient(headers={"Authorization": "Bearer itd_wrong"}, timeout=30) as http:
        with pytest.raises(Exception) as exc:
            async with Client(streamable_http_client(url, http_client=http)) as c:
                await c.list_tools()
    assert any("Unauthorized: the token is unknown or revoked" in str(e) for e in itd.leaf_errors(exc.value))


async def test_the_wait_limit_has_one_name_and_a_longer_wait_is_cut(d):
    await d.define("approve", APPROVAL)
    _, run = await d.run("approve", {"owner": "ana", "review": "r"})
    path = d.url(f"/runs/{run['run_id']}/wait")
    resp = await d.client.post(path + "?max_wait=0", headers=d.auth())          # the alias
    assert resp.status == 202 and "X-Timeout-Cut-To" not in resp.headers
    resp = await d.client.post(path + "?timeout=-1", headers=d.auth())
    assert resp.status == 422 and (await resp.json())["errors"][0]["pointer"] == "/timeout"
    await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "approve"}})
    resp = await d.client.post(path + "?timeout=120", headers=d.auth())        # cut, not refused
    assert resp.status == 200 and resp.headers["X-Timeout-Cut-To"] == "60"
    assert (await resp.json())["status"] == "succeeded"


async def test_a_kind_of_a_workflows_own_is_counted_as_other(d):
    source = ("document: {dsl: '1.0.0', namespace: t, name: boom, version: '1.0.0'}\n"
              "do:\n  - fail:\n      raise:\n        error: {type: https://serverlessworkflow.io/spec/1.0.0/errors/teapot,"
              " status: 409, kind: teapot}\n")
    status, body = await d.call("POST", "/definitions", {"type": "workflow", "name": "boom", "source": source})
    assert status == 201, body
    status, run = await d.call("POST", "/runs", {"type": "workflow", "name": "boom", "input": {}})
    await d.advance("PT0S")
    ended = (await d.call("GET", f"/runs/{run['run_id']}"))[1]
    assert ended["status"] == "conflict" and ended["kind"] == "teapot"
    samples = await scrape(d)
    assert value(samples, "interactiond_runs_started_total", playbook="local/default", type="workflow") == 1
    assert value(samples, "interactiond_runs_ended_total", playbook="local/default", status="conflict",
                 kind="other") == 1
