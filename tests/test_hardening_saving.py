"""Saving is bounded, and workflow expressions do not wait on each other (SPEC section 22).

Every test runs the real aiohttp app. The times asserted are the SPEC's promises, as generous
upper bounds: a save answers within 2 s, /healthz within 100 ms while a document is checked, and
a cheap expression is not held up by another run's expression that runs to its 2 s bound.
"""
from __future__ import annotations

import asyncio
import http.client
import threading
import time

import pytest

import interactiond as itd

SAVE_S = 2.0        # SPEC 22: saving any document answers within 2 s
HEALTHZ_S = 0.1     # ... and /healthz answers within 100 ms meanwhile

FRONT = "---\ndescription: x\nto: ana\nexpires: P1D\n"          # the body starts on line 6


def wf(name: str, body: str) -> str:
    return f"document: {{dsl: '1.0.3', namespace: tests, name: {name}, version: '1.0.0'}}\n" + body


@pytest.fixture
def backend() -> str:
    return "sqlite"                                 # checking a document does not touch the store


async def save_watching_healthz(d, type_: str, name: str, source: str) -> tuple[int, dict, float, list[float]]:
    """POST the document while another client, on a thread of its own, asks /healthz again and
    again: status, body, the save's wall time and the latency of every /healthz asked meanwhile."""
    done = threading.Event()
    latencies: list[float] = []
    url = d.client.make_url("/healthz")

    def poll() -> None:
        conn = http.client.HTTPConnection(url.host, url.port, timeout=30)
        try:
            while not done.is_set():
                t0 = time.perf_counter()
                conn.request("GET", "/healthz")
                resp = conn.getresponse()
                resp.read()
                assert resp.status == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.005)
        finally:
            conn.close()

    poller = threading.Thread(target=poll, name="healthz", daemon=True)
    poller.start()
    while not latencies:                            # the poller is answered before the save starts
        await asyncio.sleep(0.005)
    latencies.clear()
    t0 = time.perf_counter()
    status, body = await d.call("POST", "/definitions", {"type": type_, "name": name, "source": source})
    took = time.perf_counter() - t0
    done.set()
    while poller.is_alive():                        # its last request may wait for the loop
        await asyncio.sleep(0.005)
    return status, body, took, latencies


def tagged(n: int) -> str:
    """A message of `n` lines, each with one output tag."""
    return "".join(f"line {i}: {{{{ input.a }}}}\n" for i in range(n))


# Each: (type, source, the line refused, words of its message). Sized so that the check before the
# bounds took seconds (and held the event loop all along), and takes milliseconds now.
REFUSED = {
    "deep parentheses in a tag": (
        "interaction", FRONT + "---\nHello.\n{% if " + "(" * 12_000 + "true" + ")" * 12_000 + " %}x{% endif %}\n",
        7, "nest more than 32 deep"),
    "tens of thousands of tags": (
        "interaction", FRONT + "---\n" + tagged(20_000), 6 + itd.MAX_DOCUMENT_TAGS, "more than 2000 tags"),
    "thousands of expressions": (
        "workflow", wf("many", "do:\n  - s:\n      set:\n" + "".join(
            f"        k{i}: '${{ . + {i} }}'\n" for i in range(2_000))),
        5 + itd.MAX_DOCUMENT_EXPRESSIONS, f"more than {itd.MAX_DOCUMENT_EXPRESSIONS} runtime expressions"),
    "huge YAML": (
        "interaction", FRONT + "input:\n  schema:\n    type: object\n    examples:\n" + "      - 1\n" * 60_000
        + "---\nHello.\n", 9 + itd.MAX_DOCUMENT_NODES - 15, "more than 20000 YAML nodes"),
    "unclosed openings": (
        "interaction", FRONT + "---\nHello.\n\n" + "{{" * 4_000 + "\n", 8, "nothing closes"),
}


@pytest.mark.parametrize("case", list(REFUSED))
async def test_saving_a_document_past_the_bounds_is_refused_in_time_with_its_line(d, case):
    type_, source, line, words = REFUSED[case]
    assert len(source.encode()) < itd.MAX_BODY_BYTES
    status, body, took, latencies = await save_watching_healthz(d, type_, "many" if type_ == "workflow" else "big",
                                                                source)
    assert took < SAVE_S, f"the save took {took:.2f} s"
    assert max(latencies, default=0.0) < HEALTHZ_S, f"/healthz took up to {max(latencies):.3f} s"
    assert status == 422 and body["type"] == "/problems/invalid_document", body
    assert [(e["line"], words in e["message"]) for e in body["errors"]] == [(line, True)], body["errors"]


async def test_healthz_answers_while_a_large_document_is_checked(d):
    """A document within the bounds that takes a good part of a second to check is checked off the
    event loop: /healthz answers meanwhile, and the document is saved."""
    sets = "".join(f"  - s{i}:\n      set: {{a: '${{ .a + {i} }}', b: '${{ [.b, {i}] | add }}'}}\n"
                   for i in range(itd.MAX_DOCUMENT_EXPRESSIONS // 2))
    schema = "".join(f"          p{i}: {{type: string, maxLength: {i + 1}}}\n" for i in range(300))
    source = wf("large", "input:\n  schema:\n    document:\n      type: object\n      properties:\n"
                + schema + "do:\n" + sets)
    status, body, took, latencies = await save_watching_healthz(d, "workflow", "large", source)
    assert took < SAVE_S, f"the save took {took:.2f} s"
    assert max(latencies) < HEALTHZ_S, f"/healthz took up to {max(latencies):.3f} s"
    assert len(latencies) >= 3, latencies       # the check took long enough to be watched
    assert status == 201, body


# -- workflow expressions --------------------------------------------------------------------------------


async def run_status(d, run_id: str) -> dict:
    return (await d.call("GET", f"/runs/{run_id}"))[1]


async def test_an_expression_that_runs_to_its_bound_does_not_hold_up_another_runs(d):
    for name, body in (("spin", "do:\n  - loop: {set: {n: '${ last(range(1e15)) }'}}\n"),
                       ("calm", "do:\n  - add: {set: {n: '${ .n + 1 }'}}\n")):
        status, saved = await d.call("POST", "/definitions", {"type": "workflow", "name": name, "source": wf(name, body)})
        assert status == 201, saved
    # A first evaluation starts the expressions' processes: the spin below meets them running.
    status, warm = await d.call("POST", "/runs", {"type": "workflow", "name": "calm", "input": {"n": 0}})
    await d.advance("PT0S")
    assert (await run_status(d, warm["run_id"]))["output"] == {"n": 1}

    status, spin = await d.call("POST", "/runs", {"type": "workflow", "name": "spin", "input": {}})
    assert status == 202, spin
    moving = asyncio.create_task(d.advance("PT0S"))     # drives the spin run, until its expression is stopped
    driving = d.engine.kinds["workflow"]._busy          # the runs being driven
    t0 = time.perf_counter()
    while ("local/default", spin["run_id"]) not in driving:
        assert time.perf_counter() - t0 < itd.JQ_TIMEOUT_S / 4, "the spin run is not being driven"
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.2)                            # its expression is under way: it reads its run, then asks jq

    t1 = time.perf_counter()
    status, calm = await d.call("POST", "/runs", {"type": "workflow", "name": "calm", "input": {"n": 41}})
    assert status == 202, calm
    while (got := await run_status(d, calm["run_id"]))["status"] == "started":
        await asyncio.sleep(0.01)
    took = time.perf_counter() - t1
    spinning = (await run_status(d, spin["run_id"]))["status"]
    assert got["status"] == "succeeded" and got["output"] == {"n": 42}, got
    assert spinning == "started", "the slow expression ended before the cheap one of the other run"
    assert took < itd.JQ_TIMEOUT_S / 4, f"the cheap run took {took:.2f} s beside a slow expression"

    await moving
    got = await run_status(d, spin["run_id"])
    assert got["status"] == "invalid_input" and "was stopped" in got["problem"]["detail"], got
