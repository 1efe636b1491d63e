"""No writer can make one render or one check take more than ~100 ms or ~50 MB.

Templates bound every value they compute, not only their output: a chain of `replace` filters, a
`join` over a long separator, a huge range listed, `uniq`'s comparisons, a long `date` format, and a
loop of filters over a large input all fail as a render fails, at once and in little memory, while
`/healthz` answers. JSON Schema patterns are matched by RE2 in linear time; a pattern RE2 cannot take
is refused when a document is saved (with its line), but a tool server's schema that holds one still
lets its tool be called. A schema that names a base or a reference outside itself is refused when
saved, since references are never fetched.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

import interactiond as itd
from daemon_kit import APPROVAL, start_daemon

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PATTERN_SERVER = str(HERE / "servers" / "pattern_server.py")
INPUT = {"owner": "ana", "review": "the brief"}
MB = 1_000_000

#: 250 characters that make a gigabyte unbounded: each `replace` multiplies the text by ten.
CHAIN = "{{ 'aaaaaaaaaa'" + " | replace: 'a', 'aaaaaaaaaa'" * 8 + " }}"
#: `^(a+)+$` against forty `a`s and a `!` takes a backtracking engine about 2**40 steps.
EVIL = "^(a+)+$"
EVIL_TEXT = "a" * 40 + "!"


@pytest.fixture
async def d(tmp_path, aiohttp_client):
    servers = {"patterns": itd.ServerConfig("patterns", command=(sys.executable, PATTERN_SERVER))}
    config = itd.Config(servers=servers, playbooks={"local/default": ("patterns",), "acme/other": ()})
    return await start_daemon(aiohttp_client, str(tmp_path / "t.db"), config=config)


def with_message(message: str) -> str:
    head, _, _ = APPROVAL.partition("---\nYour brief")
    return f"{head}---\n{message}\n"


def with_output_schema(schema_lines: str) -> str:
    """APPROVAL whose output schema is `schema_lines` (YAML, indented four spaces)."""
    head, _, rest = APPROVAL.partition("output:\n  schema:\n")
    _, _, tail = rest.partition("---\n")
    return f"{head}output:\n  schema:\n{schema_lines}---\n{tail}"


async def define_refused(d: Any, source: str) -> list[dict[str, Any]]:
    status, body = await d.call("POST", "/definitions", {"type": "interaction", "name": "refused", "source": source})
    assert status == 422 and body["type"] == "/problems/invalid_document", (status, body)
    return body["errors"]


def line_of(source: str, text: str) -> int:
    return next(i + 1 for i, line in enumerate(source.split("\n")) if text in line)


def cli_check(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    doc = tmp_path / "doc.md"
    doc.write_text(source)
    return subprocess.run([sys.executable, "-m", "interactiond", "check", str(doc)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


# -- 2. every value of a render is bounded ------------------------------------------------------

async def test_a_replace_chain_fails_as_a_render_failure_in_bounded_memory_while_healthz_answers(d):
    await d.define("looping", with_message("{% for i in (1..20000) %}x{% endfor %}"))
    await d.define("chain", with_message(CHAIN))
    status, looping = await d.run("looping", INPUT)   # a render failure as the daemon always had them
    assert status == 409 and (looping["status"], looping["kind"]) == ("conflict", "unworkable"), looping

    async def ping_while(task: asyncio.Task) -> float:
        """The longest a /healthz took while `task` ran (one is always in flight)."""
        worst = 0.0
        while not task.done():
            start = time.monotonic()
            resp = await d.client.get("/healthz")
            await resp.read()
            assert resp.status == 200
            worst = max(worst, time.monotonic() - start)
        return worst

    tracemalloc.start()
    try:
        idle = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        task = asyncio.create_task(d.run("chain", INPUT))
        worst = await ping_while(task)
        status, run = await task
        peak = tracemalloc.get_traced_memory()[1] - idle
    finally:
        tracemalloc.stop()
    assert status == 409 and (run["status"], run["kind"]) == (looping["status"], looping["kind"]), run
    assert run["problem"]["type"] == looping["problem"]["type"] == "/problems/unworkable"
    assert "replace" in run["problem"]["detail"] and "256 KiB" in run["problem"]["detail"], run["problem"]
    assert peak < 50 * MB, f"{peak / MB:.0f} MB above idle"
    assert worst < 1.0, f"/healthz took {worst:.1f} s"
    _, page = await d.call("GET", "/interactions")
    assert page["data"] == []   # nothing half-made: no request was opened


BIG = {"s": "x" * 200_000, "fmt": "%99Y" * 60_000, "huge": "y" * 900_000}
#: Each first template passes a bound only inside the render: unbounded, it makes 100 MB or more, or
#: works for seconds. Each second one uses the same filters within the bounds, and renders as before.
COMPUTED = {
    "join over a long separator": ("{{ (1..1000) | join: input.s | size }}",
                                   "{{ (1..3) | join: '--' }}", "1--2--3"),
    "a huge range listed": ("{{ (1..3000000) | reverse | size }}", "{{ (1..3) | reverse | join: ',' }}", "3,2,1"),
    "uniq's comparisons": ("{{ (1..10000) | join: ',' | split: ',' | uniq | size }}",
                           "{{ 'a,b,a' | split: ',' | uniq | join: ',' }}", "a,b"),
    "a date format of 240,000 characters": ("{{ 'now' | date: input.fmt | size }}",
                                            "{{ '2027-01-15' | date: '%d %b %Y' }}", "15 Jan 2027"),
    "a loop of filters over a large input": (
        "{% for i in (1..10000) %}{{ input.s | upcase | size }}{% endfor %}",
        "{% for i in (1..3) %}{{ input.s | slice: 0, 2 | upcase }}{% endfor %} {{ input.huge | size }}",
        "XXXXXX 900000"),
}


@pytest.mark.parametrize("over,within,rendered", COMPUTED.values(), ids=COMPUTED.keys())
def test_values_computed_inside_a_render_are_bounded(over, within, rendered):
    ctx = itd.base_context(0, input=BIG)
    tracemalloc.start()
    try:
        idle = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        with pytest.raises(itd.RenderError) as caught:
            itd.Template(over).render(ctx)
        peak = tracemalloc.get_traced_memory()[1] - idle
    finally:
        tracemalloc.stop()
    assert caught.value.kind == "limit", caught.value.message
    assert peak < 50 * MB, f"{peak / MB:.0f} MB above idle"
    assert itd.Template(within).render_text(ctx) == rendered


# -- 3. patterns match in linear time -----------------------------------------------------------

async def test_a_catastrophic_pattern_checks_a_long_answer_at_once_and_rightly(d):
    source = with_output_schema(
        "    type: object\n"
        "    required: [verdict]\n"
        "    properties:\n"
        f"      verdict: {{ type: string, pattern: '{EVIL}' }}\n"
        "    patternProperties:\n"
        f"      '{EVIL}': {{ type: integer }}\n"
        "    additionalProperties: false\n")
    await d.define("evil", source)
    _, run = await d.run("evil", INPUT)
    start = time.monotonic()
    status, body = await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": EVIL_TEXT}})
    assert status == 422 and [e["pointer"] for e in body["errors"]] == ["/answer/verdict"], body
    status, body = await d.call("POST", f"/runs/{run['run_id']}/answer",
                                {"answer": {"verdict": "aaaa", EVIL_TEXT: 1}})
    assert status == 422 and "does not match any of the regexes" in body["errors"][0]["message"], body
    assert time.monotonic() - start < 2.0   # a backtracking engine takes hours over either
    status, body = await d.call("POST", f"/runs/{run['run_id']}/answer",
                                {"answer": {"verdict": "a" * 40, "a" * 40: 7}})
    assert status == 200, body
    _, got = await d.call("GET", f"/runs/{run['run_id']}")
    assert got["output"] == {"verdict": "a" * 40, "a" * 40: 7}


@pytest.mark.parametrize("schema_lines,field,marker", [
    ("    type: object\n    properties:\n      verdict: { type: string, pattern: '^(?!no)' }\n",
     "output.schema.properties.verdict.pattern", "(?!no)"),
    ("    type: object\n    patternProperties:\n      '^(a)\\1$': { type: string }\n",
     "output.schema.patternProperties.^(a)\\1$", "'^(a)"),
    ("    type: object\n    properties:\n      verdict: { type: string, pattern: '(?<=x)y' }\n",
     "output.schema.properties.verdict.pattern", "(?<=x)"),
], ids=["lookahead", "backreference", "lookbehind"])
async def test_a_pattern_re2_cannot_take_is_refused_at_save_with_its_line(d, tmp_path, schema_lines, field, marker):
    source = with_output_schema(schema_lines)
    errors = await define_refused(d, source)
    assert [(e["line"], e["field"]) for e in errors] == [(line_of(source, marker), field)], errors
    assert "linear time" in errors[0]["message"] and "RE2" in errors[0]["message"]
    out = cli_check(tmp_path, source)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.startswith(f"{tmp_path / 'doc.md'}:{line_of(source, marker)}: {field}:"), out.stdout


async def test_unevaluated_properties_beside_pattern_properties_is_refused_at_save(d):
    source = with_output_schema("    type: object\n    patternProperties:\n      '^a': { type: string }\n"
                                "    unevaluatedProperties: false\n")
    errors = await define_refused(d, source)
    assert [(e["line"], e["field"]) for e in errors] == [
        (line_of(source, "unevaluatedProperties"), "output.schema.unevaluatedProperties")], errors


async def test_ecma_escapes_and_classes_mean_what_they_say(d):
    source = with_output_schema(
        "    type: object\n"
        "    properties:\n"
        "      code: { type: string, pattern: '^\\u0041\\d+\\p{Lu}\\cJ?$' }\n")
    await d.define("codes", source)
    _, run = await d.run("codes", INPUT)
    for wrong in ("B12C", "A\u0661\u0662C", "A12c"):   # not A; Arabic-Indic digits are no \d in ECMA-262
        status, body = await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"code": wrong}})
        assert status == 422 and body["errors"][0]["pointer"] == "/answer/code", (wrong, body)
    status, body = await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"code": "A12\u00c9\n"}})
    assert status == 200, body


async def test_a_tool_servers_schema_with_patterns_re2_cannot_take_still_lets_the_tool_be_called(d, caplog):
    status, info = await d.call("GET", "/tools/patterns/label")
    assert status == 200 and info["input_schema"]["properties"]["name"]["pattern"] == "^(?!admin$)[a-z]+$"
    start = time.monotonic()
    status, out = await d.call("POST", "/tools/patterns/label", {"arguments": {"name": "bob", "code": "aaa", "xx": 2}})
    assert status == 200 and out["answer"] == {"got": {"name": "bob", "code": "aaa", "xx": 2}}, out
    # the patterns RE2 takes are checked, long texts at once; those it cannot are the server's to check
    status, out = await d.call("POST", "/tools/patterns/label", {"arguments": {"name": "bob", "code": EVIL_TEXT}})
    assert status == 409 and [e["pointer"] for e in out["errors"]] == ["/arguments/code"], out
    status, out = await d.call("POST", "/tools/patterns/label", {"arguments": {"name": "bob", EVIL_TEXT: 1}})
    assert status == 200 and out["answer"] == {"got": {"name": "bob", EVIL_TEXT: 1}}, out
    assert time.monotonic() - start < 5.0
    assert "pattern '^(?!admin$)[a-z]+$' is not checked" in caplog.text
    assert "unevaluatedProperties is not checked" in caplog.text


# -- 12. references are never fetched: a remote $id is refused ------------------------------------

@pytest.mark.parametrize("base", ["https://example.com/schemas/answer.json", "file:///etc/answer.json"])
async def test_a_remote_id_is_refused_at_save_with_its_line(d, tmp_path, base):
    source = with_output_schema(
        f"    $id: '{base}'\n"
        "    type: object\n"
        "    properties:\n"
        "      verdict: { $ref: 'verdict.json' }\n")
    errors = await define_refused(d, source)
    assert [(e["line"], e["field"]) for e in errors] == [(line_of(source, "$id"), "output.schema.$id")], errors
    assert "never fetched" in errors[0]["message"]
    out = cli_check(tmp_path, source)
    assert out.returncode == 1 and out.stdout.startswith(f"{tmp_path / 'doc.md'}:{line_of(source, '$id')}: "
                                                         "output.schema.$id:"), out.stdout


async def test_a_reference_the_schema_does_not_hold_is_refused_whatever_its_base(d):
    for ref in ("verdict.json", "#/$defs/missing"):
        source = with_output_schema(
            "    $id: 'urn:example:answer'\n"
            "    type: object\n"
            "    properties:\n"
            f"      verdict: {{ $ref: '{ref}' }}\n"
            "    $defs:\n"
            "      verdict: { enum: [approve, revise] }\n")
        errors = await define_refused(d, source)
        assert [(e["line"], e["field"]) for e in errors] == [
            (line_of(source, "$ref"), "output.schema.properties.verdict.$ref")], errors
    held = with_output_schema(
        "    $id: 'urn:example:answer'\n"
        "    type: object\n"
        "    properties:\n"
        "      verdict: { $ref: '#/$defs/verdict' }\n"
        "    $defs:\n"
        "      verdict: { enum: [approve, revise] }\n")
    await d.define("held", held)
    _, run = await d.run("held", INPUT)
    status, body = await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "maybe"}})
    assert status == 422 and body["errors"][0]["pointer"] == "/answer/verdict", body
    status, body = await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"verdict": "approve"}})
    assert status == 200, body
