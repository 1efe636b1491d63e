"""The fast paths give what the slow ones gave: JSON read and written by orjson, answers and inputs
checked by a compiled schema first, and `serve` on uvloop (or on asyncio's own loop when told)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

import interactiond
from interactiond import JsonRefused, compile_schema, dumps, read_json, schema_errors

ROOT = Path(__file__).resolve().parent.parent


# -- JSON in --------------------------------------------------------------------------------------

def _stdlib_read(raw: bytes) -> object:
    """read_json as the standard library alone reads it (orjson taken away)."""
    saved = interactiond._orjson
    interactiond._orjson = None
    try:
        return read_json(raw)
    finally:
        interactiond._orjson = saved


BODIES = [b'{"answer": {"verdict": "approve", "note": "Ship it."}}', b'[1, 2.5, -0.0, 1e308, "\\u00e9", null, true]',
          b'{"a": 18446744073709551616, "b": -9223372036854775809}', b'{"big": 12345678901234567890123}',
          b'{"a": 1, "a": 2}', b'"\\ud83d\\ude00"', b'\xef\xbb\xbf{"bom": 1}', b'{"e": 1E2, "f": 0.1}',
          b"[" * 499 + b"]" * 499, b"[" * 700 + b"]" * 700]


@pytest.mark.parametrize("raw", BODIES, ids=range(len(BODIES)))
def test_read_json_reads_what_the_standard_library_reads(raw):
    assert interactiond._orjson is not None, "orjson is a dependency"
    value = read_json(raw)
    assert value == _stdlib_read(raw)
    assert json.dumps(value) == json.dumps(_stdlib_read(raw))          # ints stay ints, floats floats


REFUSED = [(b"NaN", "NaN is not a JSON number"), (b'{"a": Infinity}', "Infinity is not a JSON number"),
           (b"[1e400]", "past the range"), (b'"\\ud800"', "lone surrogate"), (b'"\xed\xa0\x80"', "which is not Unicode"),
           (b"[" * 5000, "too deep"), (b'{"a": 1', "malformed JSON"), (b'"a\x00"', "malformed JSON")]


@pytest.mark.parametrize("raw,words", REFUSED, ids=[w for _, w in REFUSED])
def test_read_json_refuses_as_before_in_the_same_words(raw, words):
    with pytest.raises(JsonRefused) as fast:
        read_json(raw)
    with pytest.raises(JsonRefused) as slow:
        _stdlib_read(raw)
    assert words in str(fast.value)
    assert (str(fast.value), fast.value.pointer) == (str(slow.value), slow.value.pointer)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_dumps_and_read_json_round_trip_any_value(value):
    text = dumps(value)
    assert read_json(text.encode()) == value
    assert json.loads(text) == value
    assert text == json.dumps(value, ensure_ascii=False, separators=(",", ":")) or any(
        isinstance(x, float) for x in _leaves(value))                   # only a float's spelling may differ


def _leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_loads_reads_a_stored_text_as_the_standard_library_does(value):
    text = dumps(value)
    assert json.dumps(interactiond.loads(text)) == json.dumps(json.loads(text))     # ints past 64 bits stay ints


def test_dumps_writes_what_orjson_cannot_through_the_standard_library():
    assert dumps({"n": 2 ** 70, 1: "one"}) == '{"n":1180591620717411303424,"1":"one"}'
    assert dumps({"t": "é✓", "s": ["a", None]}) == '{"t":"é✓","s":["a",null]}'


# -- the compiled check ---------------------------------------------------------------------------

APPROVAL = {"type": "object", "required": ["verdict"], "additionalProperties": False, "properties": {
    "verdict": {"type": "string", "enum": ["approve", "revise"]}, "note": {"type": "string", "maxLength": 20},
    "score": {"type": "integer", "minimum": 0, "maximum": 10},
    "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "maxItems": 3}}}

INSTANCES = [{"verdict": "approve"}, {"verdict": "maybe"}, {}, {"verdict": "approve", "extra": 1},
             {"verdict": "revise", "note": "x" * 21}, {"verdict": "revise", "score": 10.0}, {"verdict": "revise", "score": 11},
             {"verdict": "revise", "score": True}, {"verdict": "revise", "tags": ["a", "a"]},
             {"verdict": "revise", "tags": ["a", "b", "c", "d"]}, {"verdict": "revise", "score": 2 ** 80}, [], "approve",
             {"verdict": "approve", "note": "\U0001F600" * 20}]


def _jsonschema_alone(validator, instance):
    saved = dict(interactiond._FAST_CHECKS)
    interactiond._FAST_CHECKS.clear()
    try:
        return schema_errors(validator, instance, "/answer")
    finally:
        interactiond._FAST_CHECKS.update(saved)


def test_a_plain_schema_is_checked_fast_with_the_same_verdicts_and_words():
    validator = compile_schema(APPROVAL)
    assert interactiond._FAST_CHECKS[id(validator)][0] is validator        # it has a compiled check
    for instance in INSTANCES:
        assert schema_errors(validator, instance, "/answer") == _jsonschema_alone(validator, instance), instance
    assert schema_errors(validator, {"verdict": "maybe"}, "/answer") == [
        {"pointer": "/answer/verdict", "message": "'maybe' is not one of ['approve', 'revise']"}]


@pytest.mark.parametrize("schema", [
    {"type": "string", "format": "email"}, {"type": "string", "pattern": "^a+$"}, {"type": "number", "multipleOf": 0.1},
    {"$defs": {"a": {"type": "string"}}, "$ref": "#/$defs/a"}, {"type": "object", "patternProperties": {"^x": {}}},
    {"$schema": "http://json-schema.org/draft-07/schema#", "type": "string"},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}}}])
def test_a_schema_whose_keywords_differ_between_the_two_is_checked_by_jsonschema_alone(schema):
    validator = compile_schema(schema)
    assert id(validator) not in interactiond._FAST_CHECKS
    assert interactiond._fast_check(schema) is None


def test_what_the_compiled_check_refuses_jsonschema_still_decides():
    """A value the compiled check cannot take (an integer past 64 bits) goes to jsonschema, which decides."""
    validator = compile_schema({"type": "integer", "minimum": 0})
    assert schema_errors(validator, 2 ** 200) == []
    assert schema_errors(validator, -(2 ** 200)) == [{"pointer": "", "message": f"{-(2 ** 200)} is less than the minimum of 0"}]


# -- the event loop -------------------------------------------------------------------------------

def _serve_and_answer(tmp_path: Path, env: dict[str, str]) -> str:
    """serve, run an ask-text question and answer it over HTTP; the event loop's library as /proc sees it."""
    tmp_path.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "interactiond", "serve", "--port", "0", "--host", "127.0.0.1",
                             "--db", str(tmp_path / "loop.db")], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    try:
        url = re.search(r"at (http://\S+)", proc.stdout.readline()).group(1)
        token = (tmp_path / "loop.db.token").read_text().strip()

        def call(method, path, body=None):
            req = urllib.request.Request(url + "/v1/orgs/local/playbooks/default" + path, method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        status, run = call("POST", "/runs", {"name": "ask-text", "input": {"prompt": "Why?", "to": "ana"}})
        assert status in (201, 202), run
        status, fact = call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"text": "because"}})
        assert status == 200 and fact["answer"] == {"text": "because"}
        status, ended = call("GET", f"/runs/{run['run_id']}")
        assert ended["status"] == "succeeded"
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        return "uvloop" if re.search(r"uvloop/loop\.cpython", maps) else "asyncio"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


def test_serve_runs_on_uvloop_when_installed_and_on_asyncio_when_told(tmp_path):
    pytest.importorskip("uvloop")
    assert _serve_and_answer(tmp_path / "a", {}) == "uvloop"
    assert _serve_and_answer(tmp_path / "b", {"INTERACTIOND_LOOP": "asyncio"}) == "asyncio"


# -- storage --------------------------------------------------------------------------------------

async def test_the_wal_file_is_emptied_once_writes_go_quiet(tmp_path, monkeypatch):
    """Under writes the WAL grows (it restarts only at the writer's safety net); once they stop, the
    checkpointer copies what is left and empties the file, so the disk holds the database alone."""
    import asyncio
    import time

    monkeypatch.setattr(interactiond, "CHECKPOINT_QUIET_S", 0.2)
    db = str(tmp_path / "wal.db")
    store = interactiond.Store(db)
    await store.open()
    try:
        await store.write(lambda tx, fx: tx.ensure_playbook("local/default", now=0))
        for i in range(200):
            await store.write(lambda tx, fx, i=i: tx.set_timer(fx, f"expire:local/default:{i}", i))
        wal = Path(db + "-wal")
        assert wal.stat().st_size > 0
        deadline = time.monotonic() + 10
        while wal.stat().st_size > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)                   # waiting for the checkpointer's thread, not for logic
        assert wal.stat().st_size == 0
        assert len(await store.read(lambda tx: tx.all_timers())) == 200
    finally:
        await store.close()


def test_a_function_versions_answer_schema_is_kept_once(tmp_path):
    """Requests of one function version keep no copy of its answer schema; one of its own is kept."""
    db = str(tmp_path / "once.db")
    tx = interactiond.open_sync(db)
    try:
        tx.ensure_playbook("local/default", now=0)
        schema = dumps({"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}})
        tx.save_definition(playbook="local/default", type_="interaction", name="ask", source="---\n", sha="s",
                           overview="", description=None, uses=[], now=0, by="t", answer_schema=schema)
        for run_id, own in (("a", schema), ("b", schema), ("c", '{"type":"object"}')):
            tx.insert_run(playbook="local/default", run_id=run_id, type_="interaction", name="ask", version=1,
                          input_text="{}", input_sha="x", parent=None, now=0, by="t")
            tx.open_request(request_id=f"int_{run_id}", playbook="local/default", run_id=run_id, type_="interaction",
                            name="ask", version=1, party="ann", answerer="ann", message="m", answer_schema=own,
                            server=None, tool=None, delivery=interactiond.DeliveryState.IN_INBOX, asked_at=0,
                            expires_at=1, deliver_args=None)
        stored = dict(tx.conn.execute("SELECT run_id, own_schema FROM requests").fetchall())
        assert stored == {"a": None, "b": None, "c": '{"type":"object"}'}
        assert [tx.request("local/default", r)["answer_schema"] for r in "abc"] == [schema, schema, '{"type":"object"}']
    finally:
        tx.close()


# -- the bench's check ----------------------------------------------------------------------------

def test_the_bench_check_fails_a_figure_more_than_15_percent_worse_than_recorded():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    recorded = {"figures": [
        {"name": "answer_ratio_10k_open", "value": 0.5, "met": True, "daemon_cpu_ms_per_answer": 0.2},
        {"name": "storage_bytes_per_open_request", "value": 2000, "met": True},
        {"name": "wake_p99_ms", "value": 4.0, "met": True}]}
    same = [dict(f) for f in recorded["figures"]]
    assert bench.check(same, recorded) == []
    slightly = [dict(recorded["figures"][0], value=0.44, daemon_cpu_ms_per_answer=0.229)]   # 12% and 14.5% worse
    assert bench.check(slightly, recorded) == []
    worse = [dict(recorded["figures"][0], value=0.42), dict(recorded["figures"][1], value=2400)]
    assert [line.split(":")[0] for line in bench.check(worse, recorded)] == [
        "answer_ratio_10k_open.value", "storage_bytes_per_open_request.value"]
    missed = [dict(recorded["figures"][2], value=11.0, met=False, bar="< 10")]
    assert bench.check(missed, recorded) == ["wake_p99_ms: 11.0 misses its bar < 10 (recorded: 4.0)"]
    assert bench.check([dict(recorded["figures"][1], value=1500)], recorded) == []     # better is fine


def test_ulids_spell_their_time_and_order_in_crockfords_base32():
    letters = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    before = interactiond.WALL.now_ms()
    ids = [interactiond.new_ulid() for _ in range(2000)]
    after = interactiond.WALL.now_ms()
    assert ids == sorted(ids) and len(set(ids)) == len(ids)             # monotonic, none twice
    for ulid in ids[:50] + ids[-50:]:
        assert len(ulid) == 26 and set(ulid) <= set(letters)
        value = 0
        for ch in ulid:
            value = value * 32 + letters.index(ch)
        assert value < 2 ** 128 and before <= value >> 80 <= after     # 48 bits of milliseconds, then 80


def test_ulid_random_starts_are_drawn_in_bulk_and_never_repeat():
    """Each millisecond's random start comes from os.urandom, RANDOM_POOL bytes at a time: the
    pool is used ten bytes a draw, then drawn anew, and no two starts are the same."""
    ulid = interactiond._Ulid()
    per_pool = interactiond._Ulid.RANDOM_POOL // 10
    first = ulid._random_start()
    pool = ulid._pool
    assert len(pool) == interactiond._Ulid.RANDOM_POOL and first == int.from_bytes(pool[:10], "big") >> 1
    starts = [first] + [ulid._random_start() for _ in range(per_pool - 1)]
    assert ulid._pool is pool and starts[-1] == int.from_bytes(pool[-10:], "big") >> 1
    starts += [ulid._random_start() for _ in range(per_pool * 2)]
    assert ulid._pool is not pool                                   # drawn again
    assert len(set(starts)) == len(starts) and all(0 <= s < 2 ** 79 for s in starts)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_draws_ulids_of_its_own():
    interactiond.new_ulid()                        # the parent has a pool and a millisecond
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: its next id, then out at once
        os.write(write, interactiond.new_ulid().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 26).decode()
    mine = interactiond.new_ulid()
    assert child[10:] != mine[10:] and child != mine
