"""Asking a person through a chat tool: delivery attempts, reading replies, reply rules and tellings.

Against the real example chat server (a subprocess speaking MCP over stdio), on the manual clock.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

import interactiond as itd
from daemon_kit import START_MS, start_daemon, until

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import chat_server  # noqa: E402

SEED_CHAT = (Path(__file__).parent / "fixtures" / "seed-chat-approval.md").read_text()

CHANNEL_DOC = """---
description: Ask in a channel; replies are read from the whole channel
to: '{{ input.owner }}'
expires: P1D
deliver:
  server: chat
  tool: post_message
  with: { channel: team, text: '{{ message }}' }
  sent: { conversation: /channel, id: /ts }
replies:
  conversation: '{{ sent.conversation }}'
  tool: channel_history
  with: { channel: '{{ sent.conversation }}', oldest: '%s' }
  read:
    list: /messages
    order: oldest_first
    each: { id: /ts, sender: /user, text: /text, to: /thread_ts }
  wait: PT5S
  tell:
    with: { channel: '{{ sent.conversation }}', thread_ts: '{{ sent.id }}', text: '{{ message }}' }
reply:
  verdict: { from: word, words: { approve: [yes, ok] } }
  note: rest
input:
  schema:
    type: object
    required: [owner, ask]
    properties:
      owner: { type: string }
      ask: { type: string }
output:
  schema:
    type: object
    required: [verdict]
    properties:
      verdict: { type: string, enum: [approve, revise] }
      note: { type: string }
---
{{ input.ask }}
"""

NOTIFY_DOC = """---
to: '{{ input.owner }}'
expires: P1D
deliver:
  server: chat
  tool: post_message
  with: { channel: '{{ to }}', text: '{{ message }}' }
input:
  schema: { type: object, required: [owner], properties: { owner: { type: string } } }
---
The release went out.
"""


@pytest.fixture
def d(chat_d):
    return chat_d


async def events(d, run_id):
    return (await d.call("GET", f"/runs/{run_id}/events"))[1]["data"]


async def request_of(d, run_id):
    page = (await d.call("GET", "/interactions"))[1]["data"]
    return next((r for r in page if r["run_id"] == run_id), None)


async def start(d, name, source, input_):
    await d.define(name, source)
    status, run = await d.run(name, input_)
    assert status == 202, run
    await d.advance("PT0S")                     # the first attempt is due at once
    return run["run_id"]


async def test_seed_chat_document_end_to_end(d):
    run_id = await start(d, "chat-approval", SEED_CHAT, {"owner": "ana", "draft": "Spring campaign copy"})
    req = await request_of(d, run_id)
    assert req["delivery_state"] == "delivered" and req["attempts"] == 1
    assert req["delivery"] == {"server": "chat", "tool": "post_message"}
    posted = chat_server.messages(d.chat, "ana")
    assert len(posted) == 1 and "Spring campaign copy" in posted[0]["text"]
    ts = posted[0]["ts"]
    assert req["conversation"] == f"ana/{ts}"
    types = [e["type"] for e in await events(d, run_id)]
    assert types == ["interaction_requested", "delivery_started", "delivery_succeeded"]
    ok = (await events(d, run_id))[2]["payload"]
    assert ok["delivered_as"] == {"conversation": "ana", "id": ts}

    reply_ts = chat_server.say(d.chat, "ana", "ana", "Approve! Looks good", thread_ts=ts)
    await d.advance("PT59S")                    # wait: PT1M - no read yet
    assert chat_server.calls(d.chat, "thread_replies") == 0
    await d.advance("PT1S")
    assert chat_server.calls(d.chat, "thread_replies") == 1
    _, run = await d.call("GET", f"/runs/{run_id}")
    assert run["status"] == "succeeded" and run["output"] == {"verdict": "approve", "note": "Looks good"}
    assert run["settled_by"] == "playbook:local/default"
    answered = [e for e in await events(d, run_id) if e["type"] == "request_answered"][0]
    assert answered["payload"]["reply"] == {"id": reply_ts, "sender": "ana"}
    _, pb = await d.call("GET", "/events?type=replies_read")
    assert pb["data"][-1]["payload"]["taken"] == 1


async def test_only_the_answerer_counts(d):
    run_id = await start(d, "chat-approval", SEED_CHAT, {"owner": "ana", "draft": "x"})
    ts = chat_server.messages(d.chat, "ana")[0]["ts"]
    chat_server.say(d.chat, "ana", "bo", "approve", thread_ts=ts)
    await d.advance("PT1M")
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["status"] == "waiting"
    assert not [e for e in await events(d, run_id) if e["type"] == "reply_refused"]
    chat_server.say(d.chat, "ana", "ana", "revise Name the job role.", thread_ts=ts)
    await d.advance("PT10M")
    run = (await d.call("GET", f"/runs/{run_id}"))[1]
    assert run["output"] == {"verdict": "revise", "note": "Name the job role."}


async def test_synonym_and_one_read_for_a_shared_conversation(d):
    source = CHANNEL_DOC % "{{ since | default: \"0\" }}"
    r1 = await start(d, "ask", source, {"owner": "ana", "ask": "First?"})
    await d.define("ask", source)
    r2 = (await d.run("ask", {"owner": "ana", "ask": "Second?"}))[1]["run_id"]
    await d.advance("PT0S")
    reqs = {r["run_id"]: r for r in (await d.call("GET", "/interactions"))[1]["data"]}
    assert reqs[r1]["conversation"] == reqs[r2]["conversation"] == "team"
    # A reply outside any thread, with two requests open: refused and told.
    chat_server.say(d.chat, "team", "ana", "yes")
    await d.advance("PT5S")
    assert chat_server.calls(d.chat, "channel_history") == 1          # one read serves both
    refused = [e for e in await events(d, r1) if e["type"] == "reply_refused"]
    assert len(refused) == 1 and "text" not in refused[0]["payload"]
    told = [m for m in chat_server.messages(d.chat, "team") if m["user"] == "interactiond" and m["thread_ts"]]
    assert len(told) == 1 and "thread" in told[0]["text"]
    # A reply in the thread of the second request answers it; "yes" means approve.
    second_ts = next(m["ts"] for m in chat_server.messages(d.chat, "team") if m["text"].strip() == "Second?")
    chat_server.say(d.chat, "team", "ana", "yes, ship it", thread_ts=second_ts)
    await d.advance("PT10S")
    assert chat_server.calls(d.chat, "channel_history") == 2
    run2 = (await d.call("GET", f"/runs/{r2}"))[1]
    assert run2["status"] == "succeeded" and run2["output"] == {"verdict": "approve", "note": "ship it"}
    assert (await d.call("GET", f"/runs/{r1}"))[1]["status"] == "waiting"


async def test_unreadable_replies_told_three_times_then_silence(d):
    run_id = await start(d, "chat-approval", SEED_CHAT, {"owner": "ana", "draft": "x"})
    ts = chat_server.messages(d.chat, "ana")[0]["ts"]
    for i in range(5):
        chat_server.say(d.chat, "ana", "ana", f"maybe later {i}", thread_ts=ts)
        await d.advance("PT5M")
    refused = [e for e in await events(d, run_id) if e["type"] == "reply_refused"]
    assert len(refused) == 5
    assert chat_server.calls(d.chat, "post_message") == 1 + 3
    tellings = [m for m in chat_server.messages(d.chat, "ana") if m["user"] == "interactiond" and m["thread_ts"]]
    assert len(tellings) == 3 and "approve" in tellings[0]["text"]
    req = await request_of(d, run_id)
    assert req["refused_replies"] == 5
    _, pb = await d.call("GET", "/events?type=telling_succeeded")
    assert len(pb["data"]) == 3


async def test_a_reply_is_never_taken_twice(d):
    # The reading tool here ignores `since`: every read lists every message again.
    run_id = await start(d, "ask", CHANNEL_DOC % "0", {"owner": "ana", "ask": "Ok?"})
    chat_server.say(d.chat, "team", "ana", "perhaps")
    for _ in range(3):
        await d.advance("PT1M")
    assert len([e for e in await events(d, run_id) if e["type"] == "reply_refused"]) == 1


async def test_delivery_fails_four_times_then_succeeds_at_minute_15(d):
    chat_server.inject_fault(d.chat, "post_message", 4)
    run_id = await start(d, "chat-approval", SEED_CHAT, {"owner": "ana", "draft": "x"})
    seen = []
    for minute in (1, 3, 7, 15):
        req = await request_of(d, run_id)
        seen.append((req["attempts"], req["delivery_state"]))
        await d.advance("PT59S")
        before = (await request_of(d, run_id))["attempts"]
        now_min = (d.clock.now_ms() - START_MS) / 60000
        await d.advance(f"PT{round((minute - now_min) * 60)}S")
        assert (await request_of(d, run_id))["attempts"] == before + 1
    assert seen == [(1, "retrying"), (2, "retrying"), (3, "retrying"), (4, "retrying")]
    req = await request_of(d, run_id)
    assert req["delivery_state"] == "delivered" and req["attempts"] == 5
    starts = [e for e in await events(d, run_id) if e["type"] == "delivery_started"]
    assert [(itd_ms(e["at"]) - START_MS) // 60000 for e in starts] == [0, 1, 3, 7, 15]
    failed = [e for e in await events(d, run_id) if e["type"] == "delivery_failed"]
    assert len(failed) == 4 and {e["payload"]["because"] for e in failed} == {"tool_error"}


def itd_ms(text: str) -> int:
    from datetime import datetime
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


async def test_notification_undelivered_after_five_failures(d):
    chat_server.inject_fault(d.chat, "post_message", 5)
    run_id = await start(d, "notify", NOTIFY_DOC, {"owner": "ana"})
    await d.advance("PT15M")
    run = (await d.call("GET", f"/runs/{run_id}"))[1]
    assert run["status"] == "rejected" and run["kind"] == "undelivered"
    assert run["problem"]["type"] == "/problems/unanswered"
    assert chat_server.calls(d.chat, "post_message") == 5


async def test_notification_delivered_succeeds_with_empty_output(d):
    run_id = await start(d, "notify", NOTIFY_DOC, {"owner": "ana"})
    run = (await d.call("GET", f"/runs/{run_id}"))[1]
    assert run["status"] == "succeeded" and run["output"] == {}


async def test_a_question_whose_attempts_are_spent_stays_open(d):
    chat_server.inject_fault(d.chat, "post_message", 5)
    run_id = await start(d, "chat-approval", SEED_CHAT, {"owner": "ana", "draft": "x"})
    await d.advance("PT20M")
    req = await request_of(d, run_id)
    assert req["delivery_state"] == "undelivered" and req["attempts"] == 5
    status, fact = await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"verdict": "approve"}})
    assert status == 200


@pytest.mark.parametrize("retry_ms,expected_min", [(180_000, 3), (3_600_000, 8)])
async def test_retry_after_is_honoured_up_to_8_minutes(d, retry_ms, expected_min):
    chat_server.inject_fault(d.chat, "post_message", 1, retry_after_ms=retry_ms)
    run_id = await start(d, "chat-approval", SEED_CHAT, {"owner": "ana", "draft": "x"})
    failed = [e for e in await events(d, run_id) if e["type"] == "delivery_failed"][0]
    assert failed["payload"]["retry_after_ms"] == retry_ms
    await d.advance(f"PT{expected_min}M")
    await d.advance("PT0S")
    await d.advance("PT-0S") if False else None
    req = await request_of(d, run_id)
    assert req["attempts"] == 2 and req["delivery_state"] == "delivered"


async def test_expiry_while_retrying(d):
    source = SEED_CHAT.replace("expires: P2D", "expires: PT5M")
    chat_server.inject_fault(d.chat, "post_message", 10)
    run_id = await start(d, "short", source, {"owner": "ana", "draft": "x"})
    await d.advance("PT5M")
    run = (await d.call("GET", f"/runs/{run_id}"))[1]
    assert run["status"] == "rejected" and run["kind"] == "expired"
    calls = chat_server.calls(d.chat, "post_message")
    await d.advance("PT30M")
    assert chat_server.calls(d.chat, "post_message") == calls


async def test_restart_in_the_middle_of_an_attempt(tmp_path, aiohttp_client, d, monkeypatch):
    monkeypatch.setattr(itd, "SHUTDOWN_GRACE_S", 0.5)
    chat_server.inject_fault(d.chat, "post_message", 1, mode="hang")
    await d.define("chat-approval", SEED_CHAT)
    run_id = (await d.run("chat-approval", {"owner": "ana", "draft": "x"}))[1]["run_id"]
    # Let the attempt start (it hangs in the tool), then stop the daemon under it.
    await until(lambda: chat_server.calls(d.chat, "post_message") == 1, what="the chat server is sent to")
    assert (await request_of(d, run_id))["delivery_state"] == "delivering"
    now = d.clock.now_ms()
    await d.client.close()

    d2 = await start_daemon(aiohttp_client, d.db, clock=itd.ManualClock(now), config=d.config, tokens=d.tokens)
    await d2.advance("PT59S")
    assert (await request_of(d2, run_id))["delivery_state"] == "delivering"
    await d2.advance("PT1S")
    req = await request_of(d2, run_id)
    assert req["delivery_state"] == "delivered" and req["attempts"] == 2
    failed = [e for e in await events(d2, run_id) if e["type"] == "delivery_failed"]
    assert [e["payload"]["because"] for e in failed] == ["lost"]
    assert chat_server.calls(d.chat, "post_message") == 2     # a tool may be called twice for one request


async def test_cancel_while_delivered(d):
    run_id = await start(d, "chat-approval", SEED_CHAT, {"owner": "ana", "draft": "x"})
    status, run = await d.call("POST", f"/runs/{run_id}/cancel")
    assert run["status"] == "rejected" and run["kind"] == "cancelled"
    ts = chat_server.messages(d.chat, "ana")[0]["ts"]
    chat_server.say(d.chat, "ana", "ana", "approve", thread_ts=ts)
    await d.advance("PT10M")
    assert chat_server.calls(d.chat, "thread_replies") == 0       # the reading rests: nobody waits
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["kind"] == "cancelled"


async def test_http_429_retry_after_reaches_the_schedule(db, aiohttp_client):
    """A tool server over streamable HTTP answering 429 with Retry-After: 2 is retried 2 s later."""
    from test_tool_servers import FLAKY, HttpServer
    server = HttpServer(FLAKY, "--http-429", "2")   # discover, then initialize
    try:
        url = server.url()
        config = itd.Config(servers={"web": itd.ServerConfig("web", url=url, transport="http")},
                            playbooks={"local/default": ("web",)})
        d = await start_daemon(aiohttp_client, db, config=config)
        source = NOTIFY_DOC.replace("server: chat", "server: web").replace("tool: post_message", "tool: echo") \
            .replace("with: { channel: '{{ to }}', text: '{{ message }}' }", "with: { text: '{{ message }}' }")
        run_id = await start(d, "note", source, {"owner": "ana"})
        failed = [e for e in await events(d, run_id) if e["type"] == "delivery_failed"]
        assert len(failed) == 1 and failed[0]["payload"]["retry_after_ms"] == 2000
        await d.advance("PT1S")
        assert (await d.call("GET", f"/runs/{run_id}"))[1]["status"] == "waiting"
        await d.advance("PT1S")
        run = (await d.call("GET", f"/runs/{run_id}"))[1]
        assert run["status"] == "succeeded", await events(d, run_id)
    finally:
        server.stop()


async def test_own_messages_are_not_replies_and_failed_reads_go_on(d):
    run_id = await start(d, "chat-approval", SEED_CHAT, {"owner": "ana", "draft": "x"})
    await d.advance("PT1M")                       # the thread holds only the playbook's own message
    assert chat_server.calls(d.chat, "thread_replies") == 1
    assert (await d.call("GET", "/events?type=replies_read"))[1]["data"] == []
    chat_server.inject_fault(d.chat, "thread_replies", 1, retry_after_ms=30 * 60_000)
    await d.advance("PT1M")
    failed = (await d.call("GET", "/events?type=reading_failed"))[1]["data"]
    assert len(failed) == 1 and failed[0]["payload"]["because"] == "tool_error"
    # Retry-After on a read is honoured (up to an hour): nothing for 30 minutes, then the reading goes on.
    await d.advance("PT29M")
    assert chat_server.calls(d.chat, "thread_replies") == 2
    ts = chat_server.messages(d.chat, "ana")[0]["ts"]
    chat_server.say(d.chat, "ana", "ana", "approve", thread_ts=ts)
    await d.advance("PT1M")
    assert chat_server.calls(d.chat, "thread_replies") == 3
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["output"] == {"verdict": "approve"}


async def test_a_reply_past_8_kib_is_refused(d):
    run_id = await start(d, "chat-approval", SEED_CHAT, {"owner": "ana", "draft": "x"})
    ts = chat_server.messages(d.chat, "ana")[0]["ts"]
    chat_server.say(d.chat, "ana", "ana", "approve " + "x" * 9000, thread_ts=ts)
    await d.advance("PT1M")
    refused = [e for e in await events(d, run_id) if e["type"] == "reply_refused"]
    assert len(refused) == 1 and "x" * 50 not in str(refused[0])
    told = [m for m in chat_server.messages(d.chat, "ana") if m["user"] == "interactiond" and m["thread_ts"]]
    assert "8 KiB" in told[0]["text"]


async def test_unreadable_sent_pointer_delivers_without_replies(d):
    source = SEED_CHAT.replace("conversation: /channel", "conversation: /nowhere")
    run_id = await start(d, "chat-approval", source, {"owner": "ana", "draft": "x"})
    req = await request_of(d, run_id)
    assert req["delivery_state"] == "delivered" and req["conversation"] is None
    ok = [e for e in await events(d, run_id) if e["type"] == "delivery_succeeded"][0]
    assert ok["payload"]["delivered_as"] is None
    await d.advance("PT10M")
    assert chat_server.calls(d.chat, "thread_replies") == 0
    assert (await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"verdict": "approve"}}))[0] == 200


async def test_a_tool_no_longer_offered_fails_the_attempt(d, aiohttp_client):
    chat_server.inject_fault(d.chat, "post_message", 1)
    run_id = await start(d, "chat-approval", SEED_CHAT, {"owner": "ana", "draft": "x"})
    now = d.clock.now_ms()
    await d.client.close()
    narrowed = itd.Config(servers={"chat": itd.ServerConfig("chat", command=d.config.servers["chat"].command,
                                                            tools=("thread_replies",))},
                          playbooks={"local/default": ("chat",)})
    d2 = await start_daemon(aiohttp_client, d.db, clock=itd.ManualClock(now), config=narrowed, tokens=d.tokens)
    await d2.advance("PT1M")
    failed = [e for e in await events(d2, run_id) if e["type"] == "delivery_failed"]
    assert [e["payload"]["because"] for e in failed] == ["tool_error", "tool_not_offered"]
    req = await request_of(d2, run_id)
    assert req["attempts"] == 2 and req["delivery_state"] == "retrying"


async def test_an_attempts_end_refused_by_a_busy_database_is_written_again_not_sent_again(d, monkeypatch):
    # The database refuses the write of the attempt's end once, as a busy one does: the message went
    # out, so the end is written again (not counted lost a minute later and the message sent twice).
    monkeypatch.setattr(itd, "ATTEMPT_END_RETRY_S", (0.05, 0.05, 0.05))
    store = d.engine.store
    write = store.write
    refused: list[str] = []

    def busy_once(change):
        if change.__qualname__.endswith("_end_attempt.<locals>.attempt_ended") and not refused:
            refused.append(change.__qualname__)
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(itd.Problem("unavailable", "the database is locked", kind="database_busy"))
            return fut
        return write(change)

    monkeypatch.setattr(store, "write", busy_once)
    run_id = await start(d, "chat-approval", SEED_CHAT, {"owner": "ana", "draft": "x"})
    assert refused                              # the attempt wrote its end again, after a pause, before it ended
    req = await request_of(d, run_id)
    assert req["delivery_state"] == "delivered" and req["attempts"] == 1
    await d.advance(f"PT{itd.LOST_ATTEMPT_S + 1}S")        # past when a lost attempt would be sent again
    assert chat_server.calls(d.chat, "post_message") == 1
    types = [e["type"] for e in await events(d, run_id)]
    assert types.count("delivery_succeeded") == 1 and "delivery_failed" not in types
