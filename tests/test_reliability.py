"""Reliability: kill -9 at random points with an audit of the file, fuzzers over the HTTP API,
misbehaving tool servers, and a locked or full database.

The long variants are marked `slow` (run them with `python -m pytest -m slow tests/test_reliability.py`);
bench/README.md lists them. "50 concurrent different answers: exactly one wins" is
tests/test_inbox.py::test_fifty_concurrent_different_answers_one_wins and is not repeated here.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import interactiond as itd
from daemon_kit import APPROVAL, NOTIFY, chat_command, start_daemon, write_chat_config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import chat_server  # noqa: E402

PB = "/v1/orgs/local/playbooks/default"
ENDINGS = {s.value for s in itd.RunStatus if s.ended}
SEED_CHAT = (Path(__file__).parent / "fixtures" / "seed-chat-approval.md").read_text()
CHAT_ASK = SEED_CHAT.replace("expires: P2D", "expires: PT20M")
APPROVE_SHORT = APPROVAL.replace("expires: P2D", "expires: PT10M")
NOTIFY_CHAT = """---
to: '{{ input.owner }}'
expires: PT1H
deliver:
  server: chat
  tool: post_message
  with: { channel: '{{ to }}', text: '{{ message }}' }
input:
  schema: { type: object, required: [owner], properties: { owner: { type: string } } }
---
The release went out.
"""


# -- a daemon as a subprocess ----------------------------------------------------------------------

class Daemon:
    """`interactiond serve --clock manual` on a file, started, killed and started again."""

    def __init__(self, db: Path, config: Path | None = None) -> None:
        self.db, self.config = db, config
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.log = db.with_suffix(".log")

    def start(self) -> None:
        argv = [sys.executable, "-m", "interactiond", "serve", "--db", str(self.db), "--host", "127.0.0.1",
                "--port", "0", "--clock", "manual"]
        if self.config:
            argv += ["--config", str(self.config)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, cwd=ROOT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().decode()
            if not line:
                raise RuntimeError(f"the daemon exited: {self.proc.wait()}; see {self.log}")
            m = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
            if m:
                self.url = m.group(1)
                return
        raise RuntimeError("the daemon printed no URL")

    @property
    def token(self) -> str:
        return Path(str(self.db) + ".token").read_text().strip()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class Api:
    def __init__(self, daemon: Daemon) -> None:
        self.url = daemon.url
        self.headers = {"Authorization": f"Bearer {daemon.token}"}
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90))

    async def call(self, method: str, tail: str, body: Any = None) -> tuple[int, Any]:
        url = self.url + (tail if tail.startswith("/v1/admin") else PB + tail)
        async with self.session.request(method, url, json=body, headers=self.headers) as resp:
            text = await resp.text()
            return resp.status, (json.loads(text) if text else None)

    async def close(self) -> None:
        await self.session.close()


# -- the audit -------------------------------------------------------------------------------------

def audit(db: Path, acknowledged: dict[str, tuple[Any, str]], *, final: bool = False) -> dict[str, int]:
    """Check the file as the daemon left it (killed or stopped); returns counts for the report."""
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        runs = {r["run_id"]: r for r in conn.execute("SELECT * FROM runs")}
        reqs = {r["run_id"]: r for r in conn.execute("SELECT * FROM requests")}
        timers = {r["key"] for r in conn.execute("SELECT key FROM timers")}
        events: dict[str, list[sqlite3.Row]] = {}
        for e in conn.execute("SELECT * FROM events WHERE run_id IS NOT NULL ORDER BY id"):
            events.setdefault(e["run_id"], []).append(e)

        for run_id, run in runs.items():
            evs = events.get(run_id, [])
            # Per-run run_seq is gap-free 1..n and the counter agrees.
            assert [e["run_seq"] for e in evs] == list(range(1, len(evs) + 1)), run_id
            assert run["events"] == len(evs), run_id
            # A run ended once: one ending event for an ended run, none for a live one.
            endings = [e for e in evs if e["type"].startswith("run_") and e["type"][4:] in ENDINGS]
            if run["status"] in ENDINGS:
                assert len(endings) == 1 and endings[0]["type"] == "run_" + run["status"], (run_id, endings)
                assert endings[-1]["id"] == evs[-1]["id"], f"{run_id}: events after its ending"
            else:
                assert endings == [], (run_id, run["status"])
                assert not final, f"{run_id} is still {run['status']} after the final advance"
            answered = [e for e in evs if e["type"] == "request_answered"]
            assert len(answered) <= 1, f"{run_id} answered {len(answered)} times"

        for run_id, req in reqs.items():
            run = runs[run_id]
            pb = req["playbook"]
            if req["open"]:
                # Not stuck: an open request belongs to a waiting run and has its expiry armed, and
                # whatever its delivery waits for is armed too.
                assert run["status"] == "waiting", (run_id, run["status"])
                assert f"expire:{pb}:{run_id}" in timers, f"{run_id}: open with no expiry timer"
                state = req["delivery_state"]
                if state in ("to_deliver", "retrying"):
                    assert f"attempt:{pb}:{run_id}" in timers, f"{run_id}: {state} with no attempt timer"
                if state in ("delivering", "cancelling"):
                    assert f"lost:{pb}:{run_id}" in timers, f"{run_id}: {state} with no lost-attempt timer"
                assert not final
            else:
                assert run["status"] in ENDINGS, f"{run_id}: request {req['status']} but the run is {run['status']}"
                assert not any(f"{k}:{pb}:{run_id}" in timers for k in ("expire", "attempt", "lost")), run_id
            answered = [e for e in events.get(run_id, []) if e["type"] == "request_answered"]
            if req["status"] == "answered":
                assert len(answered) == 1 and req["answer_id"] == answered[0]["id"], run_id
                assert run["status"] == "succeeded" and json.loads(run["output"]) == json.loads(req["answer"])
            else:
                assert answered == [], run_id
        # Readings with an open request have their next read armed.
        for r in conn.execute("SELECT DISTINCT reading, playbook FROM requests WHERE open = 1 AND reading IS NOT NULL"):
            assert f"read:{r['playbook']}:{r['reading']}" in timers, f"reading {r['reading']} has no read timer"
        # A reply is taken once.
        taken = [r["reply_id"] for r in reqs.values() if r["reply_id"] is not None]
        assert len(taken) == len(set(taken)), "a reply answered two requests"

        # Every answer a client saw acknowledged (HTTP 200) is recorded, once, and its run succeeded.
        for run_id, (answer, answer_id) in acknowledged.items():
            req = reqs[run_id]
            assert req["status"] == "answered", f"acknowledged answer of {run_id} lost ({req['status']})"
            assert json.loads(req["answer"]) == answer and f"evt_{req['answer_id']}" == answer_id, run_id
            assert runs[run_id]["status"] == "succeeded", run_id
        open_count = conn.execute("SELECT COUNT(*) FROM requests WHERE open = 1").fetchone()[0]
        return {"states": {f"{r['status']}/{r['delivery_state']}" for r in reqs.values()}, "runs": len(runs), "ended": sum(r["status"] in ENDINGS for r in runs.values()),
                "answered": sum(r["status"] == "answered" for r in reqs.values()), "open": open_count,
                "acknowledged": len(acknowledged), "events": sum(len(v) for v in events.values())}
    finally:
        conn.close()


# -- the kill -9 loop ------------------------------------------------------------------------------

def chat_config(tmp_path: Path) -> tuple[Path, str]:
    chat_db = str(tmp_path / "chat.db")
    return write_chat_config(tmp_path / "interactiond.yaml", chat_db), chat_db


async def kill_loop(tmp_path: Path, kills: int, seed: int, per_round: int) -> dict[str, int]:
    rng = random.Random(seed)
    config, chat_db = chat_config(tmp_path)
    daemon = Daemon(tmp_path / "k.db", config)
    acknowledged: dict[str, tuple[Any, str]] = {}
    created: list[tuple[str, str]] = []                 # (function, run_id)
    points: list[str] = []
    states: set[str] = set()
    n = 0

    def record(run_id: str, result: Any) -> None:
        if isinstance(result, tuple) and result[0] == 200:
            acknowledged[run_id] = (result[1]["answer"], result[1]["answer_id"])

    def answer_of(i: int) -> dict[str, Any]:
        return {"verdict": rng.choice(["approve", "revise"]), "note": f"note {i}"}

    for rnd in range(kills + 1):
        daemon.start()
        api = Api(daemon)
        try:
            for name, source in (("approve", APPROVE_SHORT), ("chat-ask", CHAT_ASK), ("notify", NOTIFY_CHAT)):
                status, body = await api.call("POST", "/definitions", {"type": "interaction", "name": name,
                                                                       "source": source})
                assert status in (200, 201), body
            if rnd == kills:                            # the last start: every expiry passes, every run ends
                status, _ = await api.call("POST", "/v1/admin/clock", {"advance": "PT2H"})
                assert status == 200
                await api.close()
                daemon.kill(signal.SIGTERM)
                return {**audit(daemon.db, acknowledged, final=True), "points": points, "states": states}
            if rng.random() < 0.5:
                chat_server.inject_fault(chat_db, "post_message", rng.randint(1, 3))

            async def start(name: str, input_: dict[str, Any]) -> None:
                status, run = await api.call("POST", "/runs", {"type": "interaction", "name": name, "input": input_})
                assert status == 202, run
                created.append((name, run["run_id"]))
            jobs = []
            for _ in range(per_round):
                n += 1
                kind = rng.choice(["approve", "approve", "chat-ask", "notify"])
                owner = f"user{n % 5}"
                input_ = {"approve": {"owner": owner, "review": f"review {n}"},
                          "chat-ask": {"owner": owner, "draft": f"draft {n}"},
                          "notify": {"owner": owner}}[kind]
                jobs.append(start(kind, input_))
            await asyncio.gather(*jobs)
            await api.call("POST", "/v1/admin/clock", {"advance": "PT0S"})          # first delivery attempts

            # Replies in the chat threads of some delivered questions (taken by the next read).
            for owner in {f"user{i}" for i in range(5)}:
                for m in chat_server.messages(chat_db, owner):
                    if m["user"] == "interactiond" and not m["thread_ts"] and rng.random() < 0.3:
                        chat_server.say(chat_db, owner, owner, rng.choice(["approve ok", "revise more data"]),
                                        thread_ts=m["ts"])

            # Answers that are waited for: acknowledged, so they must survive every kill.
            live = [rid for fn, rid in created if fn != "notify"]
            for rid in rng.sample(live, min(len(live), per_round // 3)):
                record(rid, await api.call("POST", f"/runs/{rid}/answer", {"answer": answer_of(n)}))

            # Time passes: reads, retries, and the expiry of what earlier rounds asked.
            status, _ = await api.call("POST", "/v1/admin/clock", {"advance": rng.choice(["PT1M", "PT3M", "PT6M"])})
            assert status == 200

            # Then the kill, at a random point.
            point = ["answers", "advance", "deliveries"][rnd % 3] if rnd < 3 else rng.choice(["answers", "advance",
                                                                                            "deliveries"])
            points.append(point)
            pending: list[tuple[str, asyncio.Task[Any]]] = []
            if point == "answers":
                for rid in rng.sample(live, min(len(live), 12)):
                    for _ in range(rng.choice([1, 1, 2])):                     # some get two different answers
                        body = {"answer": answer_of(rng.randint(0, 10**6))}
                        pending.append((rid, asyncio.ensure_future(api.call("POST", f"/runs/{rid}/answer", body))))
                await asyncio.sleep(rng.uniform(0, 0.03))
            elif point == "advance":
                step = rng.choice(["PT1M", "PT5M", "PT11M", "PT21M"])
                pending.append(("", asyncio.ensure_future(api.call("POST", "/v1/admin/clock", {"advance": step}))))
                await asyncio.sleep(rng.uniform(0, 0.3))
            else:                                         # in the middle of delivery attempts
                chat_server.inject_fault(chat_db, "post_message", 1, mode="hang")     # one stays `delivering`
                for _ in range(8):
                    n += 1
                    await start(rng.choice(["chat-ask", "notify"]), {"owner": f"user{n % 5}", "draft": f"draft {n}"})
                pending.append(("", asyncio.ensure_future(api.call("POST", "/v1/admin/clock", {"advance": "PT0S"}))))
                await asyncio.sleep(rng.uniform(0.02, 0.2))
            daemon.kill(signal.SIGKILL)
            for rid, task in pending:
                try:
                    result = await task
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    continue
                if rid:
                    record(rid, result)
        finally:
            await api.close()
            daemon.kill(signal.SIGKILL)
        seen = audit(daemon.db, acknowledged)            # the file exactly as the kill left it
        states.update(seen["states"])
    raise AssertionError("unreachable")


async def test_kill9_loop_loses_nothing(tmp_path):
    counts = await kill_loop(tmp_path, kills=3, seed=int(os.environ.get("ITD_KILL_SEED", "7")), per_round=15)
    assert counts["acknowledged"] > 0 and counts["ended"] == counts["runs"] and counts["open"] == 0, counts


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
async def test_kill9_loop_long(tmp_path, seed):
    counts = await kill_loop(tmp_path, kills=12, seed=1000 + seed, per_round=40)
    assert counts["ended"] == counts["runs"] and counts["open"] == 0, counts


# -- fuzzers over the HTTP API ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One daemon subprocess for the fuzzers (the manual clock: nothing moves unless asked)."""
    daemon = Daemon(tmp_path_factory.mktemp("fuzz") / "f.db")
    daemon.start()
    yield daemon
    daemon.kill(signal.SIGTERM)


def post(daemon: Daemon, path: str, raw: bytes, content_type: str = "application/json") -> tuple[int, Any]:
    host, port = daemon.url.rsplit("/", 1)[-1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=raw, headers={"Authorization": f"Bearer {daemon.token}",
                                                      "Content-Type": content_type})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, (json.loads(data) if data else None)
    finally:
        conn.close()


SEEDS = [APPROVAL, NOTIFY, SEED_CHAT, CHAT_ASK, NOTIFY_CHAT,
         *(p.read_text() for p in sorted((ROOT / "examples").glob("*.md"))),
         *(p.read_text() for p in sorted((Path(__file__).parent / "fixtures").glob("*.md")))]
SNIPPETS = ["", "---", "to: x", "to: '{{ input.owner }}'", "expires: P40D", "expires: PT0S", "expires: soon",
            "from: '{{ input.x | json }}'", "input:", "  schema:", "    type: object", "output: {schema: 5}",
            "deliver: {server: chat, tool: post_message, with: {text: '{{ message }}'}}",
            "replies: {tool: thread_replies}", "call: {server: x, tool: y}", "reply: {verdict: word}",
            "model: gpt", "a: &x [1]", "b: *x", "c: !!python/object:os.system x", "d: ${HOME}",
            "{{ input.owner", "{% for x in (1..100000000) %}{{ x }}{% endfor %}", "{{ 'x' * 99 }}",
            "    ", "\t", "key: [unclosed", "key: {a: 1, a: 2}", "- list item", "é ü 漢字 🙂", "\x00", "\ufeff",
            "'", '"', "|", ">", "? complex", "%YAML 1.2", "\r\n"]


@st.composite
def mutated_document(draw: Any) -> str:
    lines = draw(st.sampled_from(SEEDS)).split("\n")
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["drop", "dup", "swap", "insert", "replace", "char", "indent", "cut"]))
        i = draw(st.integers(0, max(0, len(lines) - 1)))
        if op == "drop" and lines:
            del lines[i]
        elif op == "dup" and lines:
            lines.insert(i, lines[i])
        elif op == "swap" and len(lines) > 1:
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "insert":
            lines.insert(i, draw(st.sampled_from(SNIPPETS) | st.text(max_size=40)))
        elif op == "replace" and lines:
            lines[i] = draw(st.sampled_from(SNIPPETS) | st.text(max_size=40))
        elif op == "char" and lines and lines[i]:
            k = draw(st.integers(0, len(lines[i]) - 1))
            lines[i] = lines[i][:k] + draw(st.characters(blacklist_categories=("Cs",))) + lines[i][k + 1:]
        elif op == "indent" and lines:
            lines[i] = draw(st.sampled_from([" ", "  ", "    ", "\t"])) + lines[i]
        elif op == "cut":
            lines = lines[:i]
    return "\n".join(lines)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@st.composite
def definition_body(draw: Any) -> bytes:
    """A body for POST /definitions: mostly well-formed with a mutated document, sometimes anything."""
    shape = draw(st.sampled_from(["doc", "doc", "doc", "fields", "json", "raw"]))
    if shape == "doc":
        body = {"type": "interaction", "name": draw(st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True)),
                "source": draw(mutated_document())}
        return json.dumps(body).encode()
    if shape == "fields":
        body = {k: draw(JSON_VALUES | st.sampled_from(["interaction", "workflow", "x", APPROVAL]))
                for k in draw(st.sets(st.sampled_from(["type", "name", "source", "extra"])))}
        return json.dumps(body).encode()
    if shape == "json":
        return json.dumps(draw(JSON_VALUES)).encode()
    return draw(st.sampled_from([b"{", b"[]", b"null", b'{"name": NaN, "source": Infinity}', b'{"source": "\\ud800"}',
                                 b'{"name": "x", "source": "---\\nto: \\udfff\\n---\\nhi"}', b"\xff\xfe", b"[" * 5000,
                                 b'{"type": "interaction", "name": "x", "source": "' + b"\\u0000" * 10 + b'"}'])
                | st.binary(max_size=200))


ALLOWED = {200, 201, 400, 413, 422}


def check_definition_response(raw: bytes, status: int, body: Any) -> None:
    assert status in ALLOWED, (status, body, raw[:300])
    if status >= 400:
        assert isinstance(body, dict) and body["status"] == status and body["type"].startswith("/problems/"), body
    if status == 422 and body["type"] == "/problems/invalid_document":
        assert body["errors"], body
        for e in body["errors"]:
            assert isinstance(e["line"], int) and e["line"] >= 1 and e["message"], e


def fuzz_definitions(served: Daemon, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, database=None, derandomize=examples <= 300,
              suppress_health_check=list(HealthCheck))
    @given(raw=definition_body())
    def run(raw: bytes) -> None:
        status, body = post(served, PB + "/definitions", raw)
        check_definition_response(raw, status, body)
    run()


def test_fuzz_create_definition_never_500(served):
    fuzz_definitions(served, 250)


@pytest.mark.slow
def test_fuzz_create_definition_long(served):
    fuzz_definitions(served, 5000)


# -- schemathesis over /openapi.json ----------------------------------------------------------------

def no_failure_500(ctx: Any, response: Any, case: Any) -> None:
    """No 500 of the daemon breaking down. (A run that ended `failed` answers 500 with its run object,
    and 503 is a tool server or a limit: both are the contract, not a crash.)"""
    if response.status_code >= 500:
        body = response.json()
        assert body.get("type") != "/problems/failed", f"{response.status_code}: {response.text[:500]}"


def schemathesis_run(served: Daemon, positive: int, negative: int) -> None:
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import Phase
    from hypothesis.errors import Unsatisfiable
    from schemathesis import checks as C

    checks = [no_failure_500, C.status_code_conformance, C.content_type_conformance, C.response_schema_conformance,
              C.response_headers_conformance, C.ignored_auth]
    headers = {"Authorization": f"Bearer {served.token}"}
    status, _ = post(served, PB + "/definitions", json.dumps({"type": "interaction", "name": "approve",
                                                              "source": APPROVAL}).encode())
    assert status in (200, 201)
    runs = [post(served, PB + "/runs", json.dumps({"name": "approve", "input": {"owner": "ana", "review": "r"}})
                 .encode())[1]["run_id"] for _ in range(4)]
    schema = schemathesis.openapi.from_url(served.url + "/openapi.json")
    failures: list[str] = []
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 20
    for op in operations:
        if op.path.endswith("/stream") or op.path == "/v2/events":
            continue                                     # Server-Sent Events: a stream, not an answer
        for mode, examples in ((schemathesis.GenerationMode.POSITIVE, positive),
                               (schemathesis.GenerationMode.NEGATIVE, negative)):
            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode), data=st.data())
            def call(case: Any, data: Any) -> None:
                # Aim half the cases at what exists, so they get past 404 into the handlers.
                path = case.path_parameters or {}
                if "org" in path and data.draw(st.booleans()):
                    path["org"], path["playbook"] = "local", "default"
                if "run_id" in path and data.draw(st.booleans()):
                    path["run_id"] = data.draw(st.sampled_from(runs))
                if "type" in path and "name" in path and data.draw(st.booleans()):
                    path["type"], path["name"] = "interaction", "approve"
                if op.path.endswith("/wait"):                  # a live run would hold the call for up to 60 s
                    case.query = {"timeout": data.draw(st.sampled_from(["0", "0.1", "x", "-1", "nan"]))}
                if case.method == "POST" and op.path.endswith("/runs") and data.draw(st.booleans()):
                    case.body = {"name": "approve",
                                 "input": data.draw(st.sampled_from([{"owner": "ana", "review": "r"}, {}, {"owner": 5}]))}
                response = case.call(base_url=served.url, headers=headers, timeout=30)
                try:
                    case.validate_response(response, checks=checks)
                except BaseException as exc:                  # collected: every operation is tried
                    failures.append(f"{op.label} [{mode.value}] {response.status_code}: {str(exc)[:600]}")
            try:
                call()
            except Unsatisfiable:
                pass                                           # nothing negative to make of this operation
    assert not failures, "\n\n".join(failures[:10])


def test_schemathesis_openapi(served):
    schemathesis_run(served, positive=12, negative=8)


@pytest.mark.slow
def test_schemathesis_openapi_long(served):
    schemathesis_run(served, positive=200, negative=100)


# -- misbehaving tool servers block no one ----------------------------------------------------------

FLAKY = str(Path(__file__).parent / "servers" / "flaky_server.py")
GARBAGE_SERVER = """\
import sys
for line in sys.stdin:                 # answers every JSON-RPC message with bytes that are not JSON-RPC
    sys.stdout.write("garbage \\x01 {not json-rpc}\\n")
    sys.stdout.flush()
"""


def call_doc(server: str, tool: str) -> str:
    return (f"---\ndescription: Calls {server}/{tool}\ncall:\n  server: {server}\n  tool: {tool}\n  with: {{}}\n"
            "input:\n  schema: {type: object}\noutput:\n  schema: {}\n---\n")


async def test_hung_crashing_and_garbage_servers_block_no_one(tmp_path, aiohttp_client, monkeypatch):
    """Deliveries to a hung chat server, a system call to a hung, a crashing and a garbage-speaking
    server, all at once: inbox runs, answers and waits go on at their usual pace meanwhile.
    (tests/test_system_calls.py has each failure's ending on its own.)"""
    monkeypatch.setattr(itd, "CALL_TIMEOUT_S", 3.0)
    monkeypatch.setattr(itd, "OPEN_TIMEOUT_S", 3.0)
    garbage = tmp_path / "garbage_server.py"
    garbage.write_text(GARBAGE_SERVER)
    chat_db = str(tmp_path / "chat.db")
    servers = {
        "chat": itd.ServerConfig("chat", command=chat_command(chat_db)),
        "flaky": itd.ServerConfig("flaky", command=(sys.executable, FLAKY)),
        "garbage": itd.ServerConfig("garbage", command=(sys.executable, str(garbage))),
    }
    d = await start_daemon(aiohttp_client, str(tmp_path / "t.db"),
                           config=itd.Config(servers=servers, playbooks={"local/default": tuple(servers)}))
    for name, source in (("approve", APPROVAL), ("chat-ask", SEED_CHAT), ("hang", call_doc("flaky", "hang_ro")),
                         ("crash", call_doc("flaky", "crash_rw")), ("garbage", call_doc("garbage", "anything"))):
        await d.define(name, source)
    chat_server.inject_fault(chat_db, "post_message", 3, mode="hang")
    status, asked = await d.run("chat-ask", {"owner": "ana", "draft": "x"})
    assert status == 202
    delivering = asyncio.create_task(d.advance("PT0S"))             # the first attempt hangs in the tool
    stuck = [asyncio.create_task(d.run(name, {})) for name in ("hang", "crash", "garbage")]
    await asyncio.sleep(0.3)

    slowest = 0.0
    for i in range(10):
        t0 = time.perf_counter()
        status, run = await d.run("approve", {"owner": "bo", "review": f"r{i}"})
        assert status == 202
        waiting = asyncio.create_task(d.call("POST", f"/runs/{run['run_id']}/wait?timeout=5"))
        status, fact = await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "approve"}})
        assert status == 200
        status, ended = await waiting
        assert status == 200 and ended["status"] == "succeeded"
        slowest = max(slowest, time.perf_counter() - t0)
    assert slowest < 1.5, f"an inbox run took {slowest:.2f} s while the tool servers misbehaved"
    assert not delivering.done() and not all(t.done() for t in stuck)

    endings = {name: (await t)[1] for name, t in zip(("hang", "crash", "garbage"), stuck)}
    assert endings["hang"]["kind"] == "tools_unfinished", endings["hang"]
    assert endings["crash"]["kind"] == "effect_unknown", endings["crash"]
    assert endings["garbage"]["kind"] == "tool_server_failed", endings["garbage"]
    await delivering
    req = next(r for r in (await d.call("GET", "/interactions"))[1]["data"] if r["run_id"] == asked["run_id"])
    assert req["delivery_state"] == "retrying" and req["attempts"] == 1
    events = (await d.call("GET", f"/runs/{asked['run_id']}/events"))[1]["data"]
    assert events[-1]["type"] == "delivery_failed" and events[-1]["payload"]["because"] == "timed_out", events[-1]


# -- a locked or full database ----------------------------------------------------------------------

@pytest.fixture
async def d_short_busy(tmp_path, aiohttp_client, monkeypatch):
    """An in-process daemon whose connections wait 300 ms, not 5 s, for a lock another process holds."""
    connect = itd._connect

    def short_busy(path: str) -> sqlite3.Connection:
        conn = connect(path)
        conn.execute("PRAGMA busy_timeout=300")
        return conn
    monkeypatch.setattr(itd, "_connect", short_busy)
    d = await start_daemon(aiohttp_client, str(tmp_path / "t.db"))
    await d.define("approve", APPROVAL)
    return d


def run_rows(db: str, run_id: str) -> tuple[int, int, int]:
    conn = sqlite3.connect(db)
    try:
        return tuple(conn.execute(f"SELECT COUNT(*) FROM {t} WHERE run_id = ?", (run_id,)).fetchone()[0]
                     for t in ("runs", "requests", "events"))
    finally:
        conn.close()


async def test_locked_database_is_a_clear_error_and_nothing_half_written(d_short_busy):
    d = d_short_busy
    status, first = await d.run("approve", {"owner": "ana", "review": "r"}, run_id="before")
    assert status == 202
    holder = sqlite3.connect(d.db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")                              # another process holds the write lock
    try:
        status, problem = await d.run("approve", {"owner": "ana", "review": "r"}, run_id="during")
        assert status == 503 and problem["type"] == "/problems/unavailable", problem
        assert "locked" in problem["detail"] and problem["kind"] == "database_busy", problem
        status, problem = await d.call("POST", "/runs/before/answer", {"answer": {"verdict": "approve"}})
        assert status == 503 and "locked" in problem["detail"], problem
        status, got = await d.call("GET", "/runs/before")          # reading goes on meanwhile
        assert status == 200 and got["status"] == "waiting"
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert run_rows(d.db, "during") == (0, 0, 0)
    status, run = await d.run("approve", {"owner": "ana", "review": "r"}, run_id="during")
    assert status == 202
    assert run_rows(d.db, "during") == (1, 1, 1)
    status, fact = await d.call("POST", "/runs/before/answer", {"answer": {"verdict": "approve"}})
    assert status == 200
    assert run_rows(d.db, "before") == (1, 1, 3)                  # requested, answered, succeeded: once each


async def test_full_disk_is_a_clear_error_and_nothing_half_written(d_short_busy):
    d = d_short_busy
    pages = await d.engine.store.write(lambda c, fx: c.conn.execute("PRAGMA page_count").fetchone()[0])
    await d.engine.store.write(lambda c, fx: c.conn.execute(f"PRAGMA max_page_count = {pages}").fetchone())
    big = {"owner": "ana", "review": "r", "attachment": "x" * 300_000}   # ~75 more pages than the file has
    status, problem = await d.run("approve", big, run_id="too-big")
    assert status == 503 and problem["kind"] == "disk_full" and "full" in problem["detail"], problem
    assert run_rows(d.db, "too-big") == (0, 0, 0)
    status, small = await d.run("approve", {"owner": "ana", "review": "r"}, run_id="small")
    assert status in (202, 503)                                     # fits in free pages, or is refused whole
    assert run_rows(d.db, "small") in ((1, 1, 1), (0, 0, 0))
    # Changes committed in one batch with the one that fills the disk: each caller's answer is what
    # the file holds (a full disk rolls the whole transaction back, its earlier changes with it).
    names = [f"batch-{i}" for i in range(12)]
    results = await asyncio.gather(*(d.run("approve", big if i == 6 else {"owner": "ana", "review": "r"}, run_id=n)
                                     for i, n in enumerate(names)))
    for n, (status, body) in zip(names, results):
        assert (status, run_rows(d.db, n)) in ((202, (1, 1, 1)), (503, (0, 0, 0))), (n, status, body)
        assert status == 202 or body["kind"] == "disk_full", body
    assert results[6][0] == 503
    await d.engine.store.write(lambda c, fx: c.conn.execute("PRAGMA max_page_count = 1073741823").fetchone())
    status, run = await d.run("approve", big, run_id="too-big")
    assert status == 202 and run_rows(d.db, "too-big") == (1, 1, 1), run
