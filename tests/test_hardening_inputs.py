"""No input gets a 500: bad cursors, numbers past their range, NaN, deep nesting, lone surrogates and
durations past what a date holds are 400/422 problems on every route (HTTP v1 and v2, MCP, the
command line), and a Last-Event-ID the stream never sent is refused rather than skipping events.
The last test throws random requests at every route the app serves."""
from __future__ import annotations

import asyncio
import base64
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import interactiond as itd
from daemon_kit import APPROVAL, START_MS, make_tokens

ROOT = Path(__file__).resolve().parent.parent
PROBLEM = "application/problem+json"


def b64(value: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


#: Cursors that decode to JSON, but not to a position of a page: the wrong shape, or past 64 bits.
BAD_CURSORS = [b64([]), b64([{}]), b64([2 ** 64]), b64([2 ** 63]), b64([-1]), b64(["7"]), b64([1.5]), b64([True]),
               b64([None]), b64({"seq": 1}), b64(7)]


@pytest.fixture
def backend() -> str:
    return "sqlite"                                 # what is refused is refused before the store


async def send(d: Any, method: str, path: str, data: bytes | None = None, headers: dict[str, str] | None = None,
               role: str = "operator") -> tuple[int, str, Any]:
    resp = await d.client.request(method, path, data=data, headers={**d.auth(role), **(headers or {})})
    text = await resp.text()
    return resp.status, resp.content_type, (json.loads(text) if text else None)


def assert_problem(status: int, ctype: str, body: Any, expected: int, name: str) -> None:
    assert (status, ctype) == (expected, PROBLEM), (status, body)
    assert body["status"] == expected and body["type"] == f"/problems/{name}", body
    assert "Traceback" not in body["detail"] and "Error" not in body["detail"], body


async def seed(d: Any) -> tuple[str, str]:
    """A waiting run of `approve` and its interaction id."""
    await d.define("approve", APPROVAL)
    status, run = await d.run("approve", {"owner": "ana", "review": "r"})
    assert status == 202, run
    status, page = await d.call("GET", "/v2/interactions")
    return run["run_id"], page["data"][0]["id"]


# -- cursors, versions --------------------------------------------------------------------------

async def test_cursors_of_the_wrong_shape_or_past_64_bits_are_400_on_every_listing(d):
    run_id, _ = await seed(d)
    listings = [d.url("/runs"), d.url(f"/runs/{run_id}/events"), d.url("/events"), d.url("/interactions"),
                "/v2/interactions"]
    for cursor in BAD_CURSORS:
        for path in listings:
            status, ctype, body = await send(d, "GET", f"{path}?cursor={cursor}")
            assert_problem(status, ctype, body, 400, "bad_request")
            assert body["errors"] == [{"pointer": "/cursor", "message": "next_cursor of the previous page, as it came"}]
            if path.startswith("/v2/"):
                assert body["code"] == "bad_request"
    # A cursor the daemon gave still pages.
    for _ in range(2):
        await d.run("approve", {"owner": "bo", "review": "r"})
    status, _, first = await send(d, "GET", d.url("/runs?limit=2"))
    assert status == 200 and first["next_cursor"]
    status, _, second = await send(d, "GET", d.url(f"/runs?limit=2&cursor={first['next_cursor']}"))
    assert status == 200 and len(second["data"]) == 1


async def test_version_past_64_bits_is_422(d):
    await seed(d)
    for version in ["99999999999999999999999", str(2 ** 63), "9" * 5000, "0", "١"]:
        status, ctype, body = await send(d, "GET", d.url(f"/definitions/interaction/approve?version={version}"))
        assert_problem(status, ctype, body, 422, "invalid_request")
        assert body["errors"][0]["pointer"] == "/version"
    status, _, body = await send(d, "GET", d.url(f"/definitions/interaction/approve?version={2 ** 63 - 1}"))
    assert status == 404, body
    status, _, body = await send(d, "GET", d.url("/definitions/interaction/approve?version=1"))
    assert status == 200 and body["version"] == 1


# -- bodies -------------------------------------------------------------------------------------

NASTY = {
    "NaN": b"NaN", "Infinity": b"Infinity", "-Infinity": b"-Infinity", "1e400": b"1e400", "-1e400": b"-1e400",
    "lone surrogate": b'"\\ud800"', "lone low surrogate": b'"x\\udfff"', "surrogate as bytes": b'"\xed\xa0\x80"',
}


async def test_non_finite_numbers_and_lone_surrogates_are_400_on_every_body_route(d):
    run_id, iid = await seed(d)
    routes = [
        ("POST", d.url("/definitions"), b'{"type": "interaction", "name": "n", "source": "---\\nto: x\\n---\\nhi",'
                                        b' "x": @}'),
        ("POST", d.url("/runs"), b'{"name": "approve", "input": {"owner": "ana", "review": "r", "deep": [{"n": @}]}}'),
        ("POST", d.url(f"/runs/{run_id}/answer"), b'{"answer": {"verdict": "approve", "note": @}}'),
        ("POST", f"/v2/interactions/{iid}/responses", b'{"type": "form", "answer": {"verdict": "approve", "note": @}}'),
        ("POST", "/v1/admin/clock", b'{"advance": "PT1S", "x": @}'),
        ("POST", "/web/render", b'{"items": [{"markdown": "hi", "x": @}]}'),
        ("POST", d.url("/tools/chat/post_message"), b'{"arguments": {"text": @}}'),
    ]
    for name, token in NASTY.items():
        for method, path, template in routes:
            status, ctype, body = await send(d, method, path, template.replace(b"@", token),
                                             {"Content-Type": "application/json", "Idempotency-Key": f"k-{name}"})
            assert_problem(status, ctype, body, 400, "bad_request")
            assert name.split()[0].lstrip("-") in body["detail"] or "surrogate" in body["detail"], body
    # Nothing was written: one run, its request still open, the clock where it was, one definition.
    status, _, runs = await send(d, "GET", d.url("/runs"))
    assert [r["status"] for r in runs["data"]] == ["waiting"]
    status, _, page = await send(d, "GET", "/v2/interactions")
    assert [x["status"] for x in page["data"]] == ["pending"]
    assert d.clock.now_ms() == START_MS
    status, _, defs = await send(d, "GET", d.url("/definitions"))
    assert "n" not in {x["name"] for x in defs["data"]}


async def test_deep_nesting_is_400_on_every_body_route(d):
    _, iid = await seed(d)
    deep = b"[" * 10_000
    closed = b"[" * 10_000 + b"]" * 10_000
    for path in [d.url("/definitions"), d.url("/runs"), f"/v2/interactions/{iid}/responses", "/v1/admin/clock",
                 "/web/render"]:
        for raw in (deep, closed, b'{"a":' * 10_000 + b"1" + b"}" * 10_000):
            status, ctype, body = await send(d, "POST", path, raw, {"Idempotency-Key": "k-deep"})
            assert_problem(status, ctype, body, 400, "bad_request")
            assert "too deep" in body["detail"], body


async def test_nesting_the_parser_reads_past_the_bound_is_a_clear_problem_on_every_body_route(d):
    """Nested 600 and 1,024 levels (orjson reads up to 1,024) in each value a body route reads: the
    route refuses it past its bound (or reads it into nothing it keeps), and never answers 500."""
    _, iid = await seed(d)
    for depth in (600, 1_024):
        nest = b"[" * depth + b"]" * depth
        for path, raw in [(d.url("/definitions"), b'{"type": "interaction", "name": "n", "source": ' + nest + b"}"),
                          (d.url("/runs"), b'{"name": "approve", "input": ' + nest + b"}"),
                          (d.url("/runs"), b'{"name": "approve", "input": {"owner": "ana", "review": ' + nest + b"}}"),
                          (f"/v2/interactions/{iid}/responses", b'{"type": "form", "answer": ' + nest + b"}"),
                          ("/v1/admin/clock", b'{"advance": ' + nest + b"}"),
                          ("/web/render", b'{"items": [{"markdown": "x", "schema": ' + nest + b"}]}"),
                          ("/web/render", nest)]:
            status, ctype, body = await send(d, "POST", path, raw, {"Idempotency-Key": f"k-{depth}"})
            assert status < 300 or (400 <= status < 500 and ctype == "application/problem+json"), (depth, path, body)
            if path.endswith("/runs") or path.endswith("/responses"):       # inputs and answers: 512 levels
                assert 400 <= status < 500, (depth, path, body)


async def test_mcp_arguments_with_nan_or_a_bad_cursor_are_errors_that_say_so(d):
    """Over the real /mcp transport, raw JSON-RPC (an SDK client cannot send NaN)."""
    headers = {**d.auth(), "Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    resp = await d.client.post("/mcp", data=json.dumps(init), headers=headers)
    assert resp.status == 200
    headers.update({"Mcp-Session-Id": resp.headers["Mcp-Session-Id"], "Mcp-Protocol-Version": "2025-06-18"})
    await resp.read()
    resp = await d.client.post("/mcp", data=json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}),
                               headers=headers)
    assert resp.status == 202

    async def call(tool: str, args: bytes) -> dict[str, Any]:
        raw = b'{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "' + tool.encode() + \
              b'", "arguments": ' + args + b"}}"
        resp = await d.client.post("/mcp", data=raw, headers=headers)
        text = await resp.text()
        data = next(line[6:] for line in text.splitlines() if line.startswith("data: "))
        result = json.loads(data)["result"]
        assert result["isError"] is True, result
        return result["structuredContent"]

    for cursor in BAD_CURSORS[:4]:
        for tool, extra in (("list_interactions", b""), ("list_playbook_events", b""),
                            ("list_run_events", b', "run_id": "r"')):
            problem = await call(tool, b'{"cursor": "' + cursor.encode() + b'"' + extra + b"}")
            assert problem["type"] == "/problems/bad_request" and problem["errors"][0]["pointer"] == "/cursor", problem
    for token, pointer in ((b"NaN", "/input/review"), (b"Infinity", "/input/review"), (b"1e400", "/input/review")):
        problem = await call("run_definition", b'{"name": "approve", "input": {"owner": "ana", "review": ' + token + b"}}")
        assert problem["type"] == "/problems/invalid_request", problem
        assert problem["errors"][0]["pointer"] == pointer and "not a JSON number" in problem["errors"][0]["message"]
    problem = await call("get_definition", b'{"name": "approve", "version": 100000000000000000000000}')
    assert problem["type"] == "/problems/invalid_request" and problem["errors"][0]["pointer"] == "/version"
    status, runs = await d.call("GET", "/runs")
    assert runs["data"] == []                     # nothing was run


# -- durations ----------------------------------------------------------------------------------

async def test_clock_advance_past_what_a_date_holds_is_422(d):
    for advance in ["P99999999999999999999D", "PT99999999999999999999S", "P999999999W", "P9999999D"]:
        status, ctype, body = await send(d, "POST", "/v1/admin/clock", json.dumps({"advance": advance}).encode())
        assert_problem(status, ctype, body, 422, "invalid_request")
        assert body["errors"][0]["pointer"] == "/advance"
    assert d.clock.now_ms() == START_MS
    await d.advance("P30D")
    assert d.clock.now_ms() == START_MS + 30 * 86_400_000


async def test_expires_past_what_a_date_holds_is_422_with_its_line(d):
    huge = APPROVAL.replace("expires: P2D", "expires: P99999999999999999999D")
    status, ctype, body = await send(d, "POST", d.url("/definitions"),
                                     json.dumps({"name": "big", "source": huge}).encode())
    assert_problem(status, ctype, body, 422, "invalid_document")
    assert [(e["line"], e["field"]) for e in body["errors"]] == [(4, "expires")]
    flow = "document: {dsl: '1.0.3', namespace: t, name: f, version: '1.0.0'}\ndo:\n  - pause:\n      wait: {days: 1e30}\n"
    status, ctype, body = await send(d, "POST", d.url("/definitions"),
                                     json.dumps({"type": "workflow", "name": "f", "source": flow}).encode())
    assert_problem(status, ctype, body, 422, "invalid_document")
    assert [e["line"] for e in body["errors"]] == [4]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "interactiond", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_check_prints_a_duration_past_what_a_date_holds_with_its_line(tmp_path):
    doc = tmp_path / "big.md"
    doc.write_text(APPROVAL.replace("expires: P2D", "expires: P99999999999999999999D"))
    out = cli("check", str(doc), cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.startswith(f"{doc}:4: expires:") and "longer than" in out.stdout, out.stdout


def test_command_line_refuses_nan_and_deep_json_in_one_line(tmp_path):
    for text, words in (("NaN", "NaN is not a JSON number"), ('{"a": 1e400}', "1e400"), ("[" * 5000, "too deep"),
                        ('"\\ud800"', "surrogate")):
        out = cli("run", "interaction", "approve", "--input", text, "--token", "t", "--url", "http://127.0.0.1:9",
                  cwd=tmp_path)
        assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
        assert words in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


# -- Last-Event-ID ------------------------------------------------------------------------------

async def test_last_event_id_never_sent_is_400_naming_the_header(d):
    await seed(d)
    newest = int((await d.engine.store.read(lambda c: c.conn.execute("SELECT MAX(id) FROM events").fetchone()))[0])
    for path in (d.url("/stream"), "/v2/events"):
        for last in (f"evt_{newest + 1}", f"evt_{newest + 1000}", "999999999999999999", "evt_x", "evt_" + "9" * 30):
            resp = await asyncio.wait_for(d.client.get(path, headers={**d.auth(), "Last-Event-ID": last}), 10)
            assert (resp.status, resp.content_type) == (400, PROBLEM), (path, last, resp.status)
            body = await resp.json(content_type=None)
            assert "Last-Event-ID" in body["detail"] and body["errors"][0]["header"] == "Last-Event-ID", body
        resp = await asyncio.wait_for(d.client.get(f"{path}?last_event_id=evt_{newest + 5}", headers=d.auth()), 10)
        assert resp.status == 400
        body = await resp.json(content_type=None)
        assert body["errors"][0]["pointer"] == "/last_event_id", body
        # The newest id, and one before it, still resume.
        for last in (f"evt_{newest}", f"evt_{newest - 1}", "0"):
            resp = await asyncio.wait_for(d.client.get(path, headers={**d.auth(), "Last-Event-ID": last}), 10)
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            resp.close()


# -- every route, random requests ---------------------------------------------------------------

class ThreadedDaemon:
    """The real app on a real port, on the manual clock, its loop in a thread: so that hypothesis
    (which runs synchronous tests) can send it requests with http.client."""

    def __init__(self, db: str) -> None:
        self.db = db
        self.tokens = make_tokens(db)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzzed-daemon", daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.run_id = self.interaction_id = ""        # a waiting run and its interaction, once seeded

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)

    async def _start(self) -> None:
        self.clock = itd.ManualClock(START_MS)
        engine = itd.Engine(itd.Store(self.db), self.clock,
                            itd.Config(playbooks={"local/default": (), "acme/other": ()}))
        self.app = itd.build_app(engine)
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    def stop(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        asyncio.run_coroutine_threadsafe(self._end_tasks(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()

    async def _end_tasks(self) -> None:
        """What the MCP SDK's SSE transport leaves behind when its streams were cut."""
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in left:
            t.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    def request(self, method: str, target: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
        """One request; a stream that opens is closed at once, its status and type read."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.putrequest(method, target, skip_accept_encoding=True)
            head = {"Authorization": f"Bearer {self.tokens['operator']}", **(headers or {})}
            if body is not None:
                head["Content-Length"] = str(len(body))
            for k, v in head.items():
                conn.putheader(k, v)
            conn.endheaders(body)
            resp = conn.getresponse()
            ctype = resp.getheader("Content-Type", "").split(";")[0].strip()
            data = b"" if ctype == "text/event-stream" or method == "HEAD" else resp.read()
            return resp.status, ctype, data
        finally:
            conn.close()


@pytest.fixture
def fuzzed(tmp_path):
    daemon = ThreadedDaemon(str(tmp_path / "fuzz.db"))
    daemon.start()
    try:
        pb = "/v1/orgs/local/playbooks/default"
        status, _, data = daemon.request("POST", pb + "/definitions",
                                         json.dumps({"name": "approve", "source": APPROVAL}).encode())
        assert status == 201, data
        status, _, data = daemon.request("POST", pb + "/runs", json.dumps(
            {"name": "approve", "input": {"owner": "ana", "review": "r"}}).encode())
        assert status == 202, data
        daemon.run_id = json.loads(data)["run_id"]
        daemon.interaction_id = json.loads(daemon.request("GET", "/v2/interactions")[2])["data"][0]["id"]
        yield daemon
    finally:
        daemon.stop()


def routes_of(app: web.Application) -> list[tuple[str, str]]:
    """(method, path template) of every route the app serves, read from its router."""
    out = []
    for route in app.router.routes():
        template = route.resource.canonical if route.resource is not None else ""
        for method in (("GET", "POST", "DELETE") if route.method == "*" else (route.method,)):
            out.append((method, template))
    return sorted(set(out))


#: Streams: a GET opens one and the request returns with its head; these get a few examples only.
STREAMS = re.compile(r"(/stream|/v2/events|/sse|/mcp)$")
TOKENS = [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"1" * 5000, b"18446744073709551616",
          b"-9223372036854775809", b"1e-400", b"-0", b'"\\ud800"', b'"\\udc00\\ud800"', b'"\xed\xa0\x80"',
          b'"\\u0000"', b'"P99999999999999999999D"', b'"PT1S"', b'"P1D"', b"null", b"{}", b"[]", b'""',
          b"[" * 800 + b"]" * 800, b"[" * 5000]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=2 ** 63 - 2, max_value=2 ** 80)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
FILLER = st.sampled_from(TOKENS) | JSON_VALUES.map(lambda v: json.dumps(v).encode())
TEMPLATES = {
    "/definitions": [b'{"type": "interaction", "name": "fz", "source": @}',
                     b'{"type": @, "name": @, "source": "---\\nto: x\\nexpires: PT1H\\n---\\nhi"}',
                     b'{"type": "workflow", "name": "wf", "source": @}'],
    "/runs": [b'{"name": "approve", "input": {"owner": "ana", "review": @}}', b'{"name": @, "input": @, "run_id": @}'],
    "/answer": [b'{"answer": {"verdict": "approve", "note": @}}', b'{"answer": @, "claimed_for": @}'],
    "/responses": [b'{"type": "form", "answer": {"verdict": @}}', b'{"type": @, "approved": @, "comment": @}'],
    "/clock": [b'{"advance": @}'],
    "/render": [b'{"items": [{"markdown": @, "schema": @}]}', b'{"items": @}'],
    "/mcp": [b'{"jsonrpc": "2.0", "id": @, "method": "tools/call", "params": {"name": "run_definition",'
             b' "arguments": {"name": "approve", "input": @}}}'],
}
DEEP = [b"[" * 10_000, b"[" * 10_000 + b"]" * 10_000, b'{"a":' * 3000 + b"1" + b"}" * 3000, b"[" * 511 + b"]" * 511,
        b'{"input": ' + b"[" * 600 + b"]" * 600 + b', "name": "approve"}']
QUERY_VALUES: dict[str, list[str]] = {
    "limit": ["0", "1", "200", "201", "-1", "1.5", "1e400", "NaN", "99999999999999999999999", "１"],
    "cursor": [*BAD_CURSORS, "W10", "!!", "", "=" * 5, b64([1]), b64([0])],
    "version": ["1", "0", "99999999999999999999999", str(2 ** 63), "-1", "x", "9" * 5000],
    "status": ["waiting", "pending", "answered", "nope", ""],
    "to": ["ana", "", "\x00"], "type": ["interaction", "workflow", "run_started", "x"],
    "function": ["approve", "x"], "run_id": ["r", ""], "query": ["chat", ""],
    "last_event_id": ["evt_1", "evt_99999999999999", "x", "0"], "token": ["nope", ""],
}
#: A wait holds the call for its timeout: only values that do not wait long.
TIMEOUTS = ["0", "0.001", "-1", "61", "x", "nan", "inf", "-inf", "1e400", "", "9" * 400]
ASCII = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)


def path_value(name: str, daemon: ThreadedDaemon) -> st.SearchStrategy[str]:
    known = {"org": ["local", "acme"], "playbook": ["default", "other"], "run_id": [daemon.run_id, "r"],
             "type": ["interaction", "workflow"], "name": ["approve", "bad_request", "ask-text"],
             "event_id": ["evt_1", "evt_99999999999999999999", "1"], "server": ["chat"], "tool": ["post_message"],
             "id": [daemon.interaction_id, "int_x"]}.get(name, ["x"])
    wild = st.binary(min_size=1, max_size=30).map(lambda b: urllib.parse.quote_from_bytes(b, safe=""))
    return st.sampled_from(known) | wild


@st.composite
def fuzz_request(draw: Any, method: str, template: str, daemon: ThreadedDaemon) -> tuple[str, bytes | None, dict]:
    path = re.sub(r"{(\w+)}", lambda m: draw(path_value(m.group(1), daemon)), template)
    query: dict[str, str | bytes] = {}
    for key in draw(st.sets(st.sampled_from(sorted(QUERY_VALUES)), max_size=4)):
        query[key] = draw(st.sampled_from(QUERY_VALUES[key]) | ASCII | st.binary(max_size=20))
    if template.endswith("/wait"):
        query["timeout"] = draw(st.sampled_from(TIMEOUTS))
    elif draw(st.booleans()):
        query.pop("timeout", None)
    target = path + ("?" + "&".join(f"{k}={urllib.parse.quote_from_bytes(v.encode() if isinstance(v, str) else v)}"
                                    for k, v in query.items()) if query else "")
    headers: dict[str, str] = {}
    if draw(st.booleans()):
        headers["Last-Event-ID"] = draw(st.sampled_from(["evt_1", "0", "evt_999999999999999999", "x"]) | ASCII)
    if draw(st.booleans()):
        headers["Idempotency-Key"] = draw(ASCII)
    body = None
    if method in ("POST", "DELETE", "PUT", "PATCH"):
        shape = draw(st.sampled_from(["template", "template", "json", "token", "deep", "bytes", "none"]))
        templates = [t for suffix, ts in TEMPLATES.items() if template.endswith(suffix) for t in ts]
        if shape == "template" and templates:
            body = draw(st.sampled_from(templates))
            while b"@" in body:
                body = body.replace(b"@", draw(FILLER), 1)
        elif shape in ("json", "template"):
            body = json.dumps(draw(JSON_VALUES)).encode()
        elif shape == "token":
            body = draw(st.sampled_from(TOKENS))
        elif shape == "deep":
            body = draw(st.sampled_from(DEEP))
        elif shape == "bytes":
            body = draw(st.binary(max_size=200))
        if body is not None:
            headers["Content-Type"] = draw(st.sampled_from(["application/json", "text/plain", "application/json"]))
    if template == "/mcp":
        headers["Accept"] = "application/json, text/event-stream"
    return target, body, headers


def fuzz_every_route(daemon: ThreadedDaemon, examples: int, derandomize: bool) -> None:
    routes = routes_of(daemon.app)
    assert len(routes) >= 30 and ("GET", "/v2/interactions") in routes and ("POST", "/web/render") in routes
    failures: list[str] = []
    for method, template in routes:
        @settings(max_examples=max(2, examples // 4) if STREAMS.search(template) else examples, deadline=None,
                  database=None, derandomize=derandomize, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=fuzz_request(method, template, daemon))
        def hit(case: tuple[str, bytes | None, dict[str, str]]) -> None:
            target, body, headers = case
            status, ctype, data = daemon.request(method, target, body, headers)
            where = f"{method} {target[:120]} body={body[:80] if body else body!r}"
            assert status != 500 and b"/problems/failed" not in data, f"{where} -> {status} {data[:300]!r}"
            assert b"Traceback" not in data, f"{where} -> {data[:300]!r}"
            if ctype == PROBLEM and method != "HEAD":
                problem = json.loads(data)
                assert problem["status"] == status and problem["type"].startswith("/problems/"), problem
        try:
            hit()
        except AssertionError as exc:                  # collected: every route is tried
            failures.append(str(exc)[:800])
    assert not failures, "\n\n".join(failures[:10])


def test_fuzz_every_route_never_500(fuzzed):
    fuzz_every_route(fuzzed, examples=10, derandomize=True)


@pytest.mark.slow
def test_fuzz_every_route_long(fuzzed):
    fuzz_every_route(fuzzed, examples=300, derandomize=False)
