"""A configured secret never leaves the daemon and is never written to disk (SPEC section 10).

Against a real MCP tool server that gives its secrets away (tests/servers/secret_server.py, a stdio
subprocess configured with `env`), and the real example chat server for replies. Every answer is read
as a reader would read it, and the database file and its -wal file are searched byte by byte.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

import interactiond as itd
from daemon_kit import APPROVAL, start_chat_daemon, start_daemon, until

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SECRET_SERVER = str(HERE / "servers" / "secret_server.py")
sys.path.insert(0, str(HERE / "servers"))
sys.path.insert(0, str(ROOT / "examples"))
import chat_server  # noqa: E402
import secret_server  # noqa: E402

SECRET = "sk-live-4f9a2b7c1d"                       # the operator's env value for the secret server
KEYED = (secret_server.KEYED_API_KEY, secret_server.KEYED_ACCESS_TOKEN, secret_server.KEYED_PASSWORD)
SEED_CHAT = (HERE / "fixtures" / "seed-chat-approval.md").read_text()


@pytest.fixture
async def d(tmp_path, aiohttp_client):
    secret = itd.ServerConfig("secret", command=(sys.executable, SECRET_SERVER), env={"SECRET_VALUE": SECRET})
    return await start_chat_daemon(aiohttp_client, str(tmp_path / "t.db"), tmp_path / "chat.db",
                                   servers={"secret": secret})


def call_doc(tool: str, read: str | None = None, output: str = "{}") -> str:
    lines = ["---", "description: Asks the secret server", "call:", "  server: secret", f"  tool: {tool}",
             "  with: {}"]
    if read:
        lines.append(f"  read: {read}")
    lines += ["input:", "  schema: {type: object}", "output:", f"  schema: {output}", "---", ""]
    return "\n".join(lines)


def disk(d: Any) -> bytes:
    """The database file and its write-ahead log, as the disk holds them."""
    out = b""
    for suffix in ("", "-wal"):
        path = Path(d.db + suffix)
        if path.exists():
            out += path.read_bytes()
    return out


async def everything_read(d: Any, run_ids: list[str]) -> str:
    """Every run, event list and event a reader can read, as one text."""
    seen: list[Any] = []
    for run_id in run_ids:
        status, run = await d.call("GET", f"/runs/{run_id}", role="reader")
        assert status == 200, run
        status, events = await d.call("GET", f"/runs/{run_id}/events", role="reader")
        assert status == 200 and events["data"], events
        seen += [run, events]
        for e in events["data"]:
            status, one = await d.call("GET", f"/events/{e['id']}", role="reader")
            assert status == 200, one
            seen.append(one)
    status, pb = await d.call("GET", "/events", role="reader")
    assert status == 200
    seen.append(pb)
    return json.dumps(seen, ensure_ascii=False)


def assert_absent(values: tuple[str, ...], *texts: str | bytes) -> None:
    for text in texts:
        for value in values:
            needle = value.encode() if isinstance(text, bytes) else value
            assert needle not in text, f"{value!r} leaked"


async def test_a_configured_secret_leaves_no_run_event_problem_or_file(d):
    await d.define("leak", call_doc("leak"))
    status, ok = await d.run("leak", {})
    assert status == 201 and ok["status"] == "succeeded", ok
    # The tool did send the secret (inside longer strings, in every part): it arrives scrubbed.
    assert ok["output"] == {"greeting": "hello [scrubbed]!", "deep": {"list": ["<[scrubbed]>"]}}

    # An output.schema error quotes the value it refuses.
    await d.define("typed", call_doc("leak", read="/greeting", output="{type: integer}"))
    status, typed = await d.run("typed", {})
    assert status == 409 and typed["kind"] == "unworkable", typed
    assert "[scrubbed]" in json.dumps(typed["problem"]["errors"])

    # A tool error's text and a refusal's message become a problem's detail.
    await d.define("fail", call_doc("fail"))
    status, failed = await d.run("fail", {})
    assert status == 503 and failed["kind"] == "tools_unfinished" and "[scrubbed]" in failed["problem"]["detail"]
    await d.define("refuse", call_doc("refuse"))
    status, refused = await d.run("refuse", {})
    assert status == 409 and refused["problem"]["because"] == "arguments_refused", refused
    assert "[scrubbed]" in refused["problem"]["detail"]

    runs = [ok, typed, failed, refused]
    read = await everything_read(d, [r["run_id"] for r in runs])
    assert "run_succeeded" in read and "tool_call_answered" in read
    assert_absent((SECRET,), json.dumps(runs), read, disk(d))


async def test_execute_over_http_and_mcp_returns_no_secret(d):
    status, out = await d.call("POST", "/tools/secret/leak", {"arguments": {}}, role="writer")
    assert status == 200, out
    assert out["structured_content"]["greeting"] == "hello [scrubbed]!"
    assert out["content"][0]["text"] == "the key is [scrubbed] (from the environment)"

    url = str(d.client.make_url("/mcp"))
    async with httpx2.AsyncClient(headers=d.auth("writer"), timeout=30) as http:
        async with Client(streamable_http_client(url, http_client=http)) as c:
            r = await c.call_tool("execute", {"server": "secret", "tool": "leak", "arguments": {}})
            assert not r.is_error, r
            via_mcp = r.model_dump_json(by_alias=True)
            assert r.structured_content["answer"]["deep"] == {"list": ["<[scrubbed]>"]}
            r = await c.call_tool("execute", {"server": "secret", "tool": "refuse", "arguments": {}})
            assert r.is_error and "[scrubbed]" in r.structured_content["detail"]
            via_mcp += r.model_dump_json(by_alias=True)
            r = await c.call_tool("introspect", {"server": "secret", "tool": "stderr"})
            assert not r.is_error and "[scrubbed]" in r.structured_content["description"]
            via_mcp += r.model_dump_json(by_alias=True)

    status, found = await d.call("GET", "/tools", role="reader")
    assert status == 200
    status, events = await d.call("GET", "/events", role="reader")
    assert status == 200 and {e["type"] for e in events["data"]} >= {"tool_call_answered", "tool_call_failed"}
    assert_absent((SECRET,), json.dumps(out), via_mcp, json.dumps(found), json.dumps(events), disk(d))


async def test_values_under_secret_named_keys_leave_text_and_meta_too(d):
    status, out = await d.call("POST", "/tools/secret/keyed", {"arguments": {}}, role="writer")
    assert status == 200, out
    assert out["structured_content"] == {"user": "bob", "api_key": "[scrubbed]",
                                         "session": {"access_token": "[scrubbed]"}}
    assert out["content"][0]["text"] == "signed in as bob with key [scrubbed]; session [scrubbed]"
    assert json.loads(out["content"][1]["text"]) == {"user": "bob", "password": "[scrubbed]"}

    await d.define("keyed", call_doc("keyed"))
    status, run = await d.run("keyed", {})
    assert status == 201 and run["output"]["api_key"] == "[scrubbed]", run
    read = await everything_read(d, [run["run_id"]])
    answered = next(e for e in (await d.call("GET", f"/runs/{run['run_id']}/events", role="reader"))[1]["data"]
                    if e["type"] == "tool_call_answered")
    assert answered["payload"]["result"]["_meta"]["hint"] == "the password was [scrubbed]"
    assert_absent(KEYED, json.dumps(out), json.dumps(run), read, disk(d))


async def test_a_tool_servers_stderr_is_logged_scrubbed(d, caplog, capfd):
    caplog.set_level(logging.INFO, logger="interactiond")
    status, out = await d.call("POST", "/tools/secret/stderr", {"arguments": {}}, role="writer")
    assert status == 200 and out["answer"] == "ok", out
    await until(lambda: "secret_server: debug" in caplog.text,   # the server's stderr arrives on a pipe of its own
                what="the tool server's stderr is logged")
    assert "secret_server: debug: key=[scrubbed]" in caplog.text
    assert_absent((SECRET,), caplog.text, capfd.readouterr().err)


async def test_an_api_token_or_secret_in_an_answer_is_not_recorded(d):
    token = d.tokens["reader"]
    assert token.startswith("itd_")
    await d.define("approve", APPROVAL)
    runs = []
    for _ in range(3):
        status, run = await d.run("approve", {"owner": "ana", "review": "ok"})
        assert status == 202, run
        runs.append(run["run_id"])
    note = f"use {token} and {SECRET} to deploy"
    scrubbed = "use [scrubbed] and [scrubbed] to deploy"

    # /v1 over HTTP
    status, fact = await d.call("POST", f"/runs/{runs[0]}/answer",
                                {"answer": {"verdict": "approve", "note": note}, "claimed_for": f"ana {token}"},
                                role="writer")
    assert status == 200 and fact["answer"]["note"] == scrubbed, fact
    # MCP
    url = str(d.client.make_url("/mcp"))
    async with httpx2.AsyncClient(headers=d.auth("writer"), timeout=30) as http:
        async with Client(streamable_http_client(url, http_client=http)) as c:
            r = await c.call_tool("answer_interaction",
                                  {"run_id": runs[1], "answer": {"verdict": "revise", "note": note}})
            assert not r.is_error and r.structured_content["answer"]["note"] == scrubbed, r
    # /v2 responses
    _, page = await d.call("GET", f"/v2/interactions?run_id={runs[2]}")
    ident = page["data"][0]["id"]
    resp = await d.client.post(f"/v2/interactions/{ident}/responses",
                               json={"type": "form", "answer": {"verdict": "approve", "note": note}},
                               headers={**d.auth("writer"), "Idempotency-Key": "k-secret"})
    body = await resp.json()
    assert resp.status == 200 and body["response"]["answer"]["note"] == scrubbed, body
    # The same answer again is the same answer: a replay, not a conflict.
    status, again = await d.call("POST", f"/runs/{runs[0]}/answer",
                                 {"answer": {"verdict": "approve", "note": note}}, role="writer")
    assert status == 200, again

    for run_id in runs:
        _, run = await d.call("GET", f"/runs/{run_id}", role="reader")
        assert run["status"] == "succeeded" and run["output"]["note"] == scrubbed, run
    read = await everything_read(d, runs)
    assert_absent((token, SECRET), read, disk(d))


async def test_an_api_token_in_a_chat_reply_is_not_recorded(d):
    token = d.tokens["writer"]
    await d.define("chat-approval", SEED_CHAT)
    status, run = await d.run("chat-approval", {"owner": "ana", "draft": "Spring copy"})
    assert status == 202, run
    await d.advance("PT0S")
    ts = chat_server.messages(d.chat, "ana")[0]["ts"]
    chat_server.say(d.chat, "ana", "ana", f"revise the key {token} is in the doc", thread_ts=ts)
    await d.advance("PT5M")
    _, done = await d.call("GET", f"/runs/{run['run_id']}", role="reader")
    assert done["status"] == "succeeded" and done["output"] == {"verdict": "revise",
                                                                "note": "the key [scrubbed] is in the doc"}, done
    read = await everything_read(d, [run["run_id"]])
    assert_absent((token,), read, disk(d))


async def test_record_content_false_still_records_sizes_and_digests_only(tmp_path, aiohttp_client):
    config = itd.Config(servers={"secret": itd.ServerConfig("secret", command=(sys.executable, SECRET_SERVER),
                                                            env={"SECRET_VALUE": SECRET}, record_content=False)},
                        playbooks={"local/default": ("secret",), "acme/other": ()})
    d = await start_daemon(aiohttp_client, str(tmp_path / "q.db"), config=config)
    status, out = await d.call("POST", "/tools/secret/keyed", {"arguments": {}}, role="writer")
    assert status == 200 and out["structured_content"]["api_key"] == "[scrubbed]"
    _, events = await d.call("GET", "/events?type=tool_call_answered", role="reader")
    result = events["data"][-1]["payload"]["result"]
    assert set(result) == {"size", "sha256"}
    assert_absent((*KEYED, "bob"), json.dumps(events), disk(d))


SLASHED = "sk/live/7e3d9c1b"                      # a secret with slashes, which JSON may write as \/


async def test_a_secret_a_tool_spells_with_json_escapes_is_scrubbed_everywhere(tmp_path, aiohttp_client):
    """The tool writes the secret in JSON text with \\/ and \\uXXXX escapes: the daemon decodes that text,
    so what it decodes must not hold the secret - not in execute's answer (HTTP and MCP), a run's output,
    its events, a problem's schema error, or the database file."""
    servers = {"secret": itd.ServerConfig("secret", command=(sys.executable, SECRET_SERVER), env={"SECRET_VALUE": SLASHED})}
    d = await start_daemon(aiohttp_client, str(tmp_path / "t.db"),
                           config=itd.Config(servers=servers, playbooks={"local/default": ("secret",), "acme/other": ()}))
    status, out = await d.call("POST", "/tools/secret/escaped", {"arguments": {}}, role="writer")
    assert status == 200, out
    assert out["answer"] == {"greeting": "hello [scrubbed]!", "slashed": "[scrubbed]", "n": 1}, out

    await d.define("escaped", call_doc("escaped"))
    status, ok = await d.run("escaped", {})
    assert status == 201 and ok["output"]["greeting"] == "hello [scrubbed]!", ok
    await d.define("typed", call_doc("escaped", read="/slashed", output="{type: integer}"))
    status, typed = await d.run("typed", {})
    assert status == 409 and typed["kind"] == "unworkable", typed
    assert "[scrubbed]" in json.dumps(typed["problem"]["errors"])

    url = str(d.client.make_url("/mcp"))
    async with httpx2.AsyncClient(headers=d.auth("writer"), timeout=30) as http:
        async with Client(streamable_http_client(url, http_client=http)) as c:
            r = await c.call_tool("execute", {"server": "secret", "tool": "escaped", "arguments": {}})
            assert not r.is_error and r.structured_content["answer"]["slashed"] == "[scrubbed]", r
            via_mcp = r.model_dump_json(by_alias=True)

    read = await everything_read(d, [ok["run_id"], typed["run_id"]])
    assert "run_succeeded" in read and "run_conflict" in read
    escaped = (SLASHED, SLASHED.replace("/", "\\/"), SLASHED.replace("/", "\\u002f"))
    assert_absent(escaped, json.dumps(out), json.dumps([ok, typed]), via_mcp, read, disk(d))


def test_the_scrubber_catches_every_json_spelling_of_a_secret():
    scrub = itd.Scrubber(["p@ss/w\u00f6rd\U0001F511"])
    spellings = [json.dumps("p@ss/w\u00f6rd\U0001F511"), json.dumps("p@ss/w\u00f6rd\U0001F511", ensure_ascii=False),
                 '"p\\u0040ss\\/w\\u00F6rd\\ud83d\\uDD11"', '"\\u0070@ss/w\\u00f6rd\\uD83D\\uDD11"']
    for text in spellings:
        assert json.loads(text) == "p@ss/w\u00f6rd\U0001F511"
        scrubbed = scrub.text(f'{{"k": {text}, "m": "x"}}')
        assert json.loads(scrubbed) == {"k": "[scrubbed]", "m": "x"}, (text, scrubbed)
    assert scrub.text("p@ss/w\u00f6rd") == "p@ss/w\u00f6rd"            # only the whole secret is scrubbed
