"""Email (SPEC section 26): a request sent through a real SMTP server (aiosmtpd, in the test process)
with aiosmtplib - text and HTML, the answer link, one link per choice that opens the answer page with
that choice made (the GET answers nothing; the page's button does) - attempted with delivery's rules,
reminded and escalated by email, and `ask`'s email. Both backends; time runs on the manual clock."""
from __future__ import annotations

import email
import email.policy
import re
import threading
import urllib.parse
from typing import Any

import pytest
from aiosmtpd.controller import Controller

import interactiond as itd
from daemon_kit import start_daemon

SENDER = "Approvals <approvals@example.org>"
EMAILED = """---
description: Asks a brief's owner by email
to: '{{ input.owner }}'
expires: P2D
deliver: {email: '{{ to }}@example.org'}
remind: {after: [PT4H], message: 'Still waiting on {{ input.title }}'}
escalate: {after: P1D, to: '{{ input.manager }}', message: 'Over to you: {{ input.title }}'}
input:
  schema:
    type: object
    required: [owner, manager, title]
    properties:
      owner: { type: string }
      manager: { type: string }
      title: { type: string }
output:
  schema:
    type: object
    required: [verdict]
    properties:
      verdict: { type: string, enum: [approve, revise] }
      note: { type: string, maxLength: 2000 }
---
Please approve **{{ input.title }}**.
"""
INPUT = {"owner": "ana", "manager": "bo", "title": "Spring brief"}
NOTICE = """---
to: '{{ input.owner }}'
expires: PT1H
deliver: {email: '{{ input.address }}'}
input:
  schema:
    type: object
    required: [owner, address]
    properties:
      owner: { type: string }
      address: { type: string }
---
Heads up: the brief shipped.
"""


class Mailbox:
    """What a real SMTP server in this process received; `later` answers the next messages with a
    temporary failure, and a recipient nobody@... is refused for good."""

    def __init__(self) -> None:
        self.got: list[Any] = []
        self.later: list[str] = []
        self.lock = threading.Lock()

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        if address.startswith("nobody@"):
            return "550 5.1.1 no such mailbox"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server, session, envelope):
        with self.lock:
            if self.later:
                return self.later.pop(0)
            msg = email.message_from_bytes(envelope.content, policy=email.policy.default)
            self.got.append({"from": envelope.mail_from, "to": list(envelope.rcpt_tos), "msg": msg})
        return "250 Message accepted for delivery"

    def texts(self, i: int = -1) -> tuple[str, str]:
        msg = self.got[i]["msg"]
        return msg.get_body(("plain",)).get_content(), msg.get_body(("html",)).get_content()


@pytest.fixture
def mailbox(unused_tcp_port):
    box = Mailbox()
    controller = Controller(box, hostname="127.0.0.1", port=unused_tcp_port)
    controller.start()
    box.port = unused_tcp_port
    yield box
    controller.stop()


@pytest.fixture
async def d(db, aiohttp_client, mailbox):
    config = itd.Config(playbooks={"local/default": (), "acme/other": ()},
                        email=itd.EmailConfig("127.0.0.1", SENDER, mailbox.port))
    daemon = await start_daemon(aiohttp_client, db, config=config)
    await daemon.define("brief", EMAILED)
    return daemon


async def events(d, run_id: str, type_: str | None = None) -> list[dict[str, Any]]:
    _, page = await d.call("GET", f"/runs/{run_id}/events?limit=200")
    return [e for e in page["data"] if type_ is None or e["type"] == type_]


def path_of(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return parts.path + (f"?{parts.query}" if parts.query else "")


async def test_the_message_is_emailed_with_its_answer_link_and_a_link_per_choice(d, mailbox):
    _, run = await d.run("brief", INPUT)
    run_id = run["run_id"]
    await d.advance("PT0S")
    [sent] = mailbox.got
    msg = sent["msg"]
    assert sent["to"] == ["ana@example.org"] and sent["from"] == "approvals@example.org"
    assert msg["To"] == "ana@example.org" and msg["From"] == SENDER and msg["Subject"] == "Please approve Spring brief."
    assert msg.get_content_type() == "multipart/alternative"
    text, html = mailbox.texts()
    [item] = (await d.call("GET", "/interactions"))[1]["data"]
    url = item["answer_url"]
    assert url and item["delivery"] == {"email": "ana@example.org"} and item["delivery_state"] == "delivered"
    assert "Please approve **Spring brief**." in text and f"Answer: {url}" in text
    assert f"- approve: {url}?verdict=approve" in text and f"- revise: {url}?verdict=revise" in text
    assert "It expires on 2027-01-17 08:00 UTC." in text
    assert "<strong>Spring brief</strong>" in html and f'<a href="{url}">Answer it</a>' in html
    assert f'<a href="{url}?verdict=revise">revise</a>' in html
    started, = await events(d, run_id, "delivery_started")
    assert started["payload"]["email"] == "ana@example.org" and started["payload"]["attempt"] == 1
    assert len(await events(d, run_id, "delivery_succeeded")) == 1

    # The link of a choice opens the page with it chosen; nothing is answered until its button is pressed.
    resp = await d.client.get(path_of(f"{url}?verdict=revise"))
    page = await resp.text()
    assert resp.status == 200 and "You chose <strong>revise</strong>" in page
    assert '<button type="submit" name="choice" value="1" class="primary" autofocus' in page
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["status"] == "waiting"
    assert await events(d, run_id, "request_answered") == []
    form = re.search(r'name="form" value="([^"]+)"', page).group(1)
    resp = await d.client.post(path_of(url), data={"form": form, "choice": "1"}, allow_redirects=False)
    assert resp.status == 303
    run = (await d.call("GET", f"/runs/{run_id}"))[1]
    assert run["status"] == "succeeded" and run["output"] == {"verdict": "revise"}


async def test_attempts_follow_deliverys_rules(d, mailbox):
    mailbox.later = ["451 4.3.0 try again later", "451 4.3.0 try again later"]
    _, run = await d.run("brief", INPUT)
    run_id = run["run_id"]
    await d.advance("PT0S")
    assert mailbox.got == [] and len(await events(d, run_id, "delivery_failed")) == 1
    await d.advance("PT59S")
    assert len(await events(d, run_id, "delivery_failed")) == 1          # the next attempt: a minute on
    await d.advance("PT1S")
    failed = await events(d, run_id, "delivery_failed")
    assert len(failed) == 2 and "451" in failed[1]["payload"]["message"]
    await d.advance("PT1M59S")
    assert mailbox.got == []                                            # then two minutes on
    await d.advance("PT1S")
    assert len(mailbox.got) == 1
    assert [e["payload"]["attempt"] for e in await events(d, run_id, "delivery_started")] == [1, 2, 3]
    assert (await d.call("GET", "/interactions"))[1]["data"][0]["delivery_state"] == "delivered"


async def test_a_refused_address_is_not_tried_again_and_the_question_stays_open(d, mailbox):
    await d.define("notice", NOTICE)
    status, run = await d.run("notice", {"owner": "ana", "address": "nobody@example.org"})
    assert status == 202
    await d.advance("PT0S")
    [refused] = await events(d, run["run_id"], "delivery_refused")
    assert refused["payload"]["because"] == "recipient_refused" and "550" in refused["payload"]["message"]
    await d.advance("PT30M")
    assert len(await events(d, run["run_id"], "delivery_started")) == 1 and mailbox.got == []


async def test_a_notification_by_email_ends_once_it_is_sent(d, mailbox):
    await d.define("notice", NOTICE)
    _, run = await d.run("notice", {"owner": "ana", "address": "ana@example.org"})
    await d.advance("PT0S")
    text, _ = mailbox.texts()
    assert "Heads up: the brief shipped." in text and "Answer:" not in text
    run = (await d.call("GET", f"/runs/{run['run_id']}"))[1]
    assert run["status"] == "succeeded"


async def test_reminders_and_the_escalation_go_by_email(d, mailbox):
    _, run = await d.run("brief", INPUT)
    run_id = run["run_id"]
    await d.advance("PT0S")
    await d.advance("PT4H")
    assert len(mailbox.got) == 2
    reminder = mailbox.got[1]
    assert reminder["to"] == ["ana@example.org"] and reminder["msg"]["Subject"] == "Reminder: Please approve Spring brief."
    text, html = mailbox.texts(1)
    assert text.startswith("Still waiting on Spring brief") and "Answer: http" in text
    [reminded] = await events(d, run_id, "request_reminded")
    assert reminded["payload"]["by_email"] is True
    await d.advance("PT20H")
    assert len(mailbox.got) == 3
    escalation = mailbox.got[2]
    assert escalation["to"] == ["bo@example.org"] and escalation["msg"]["Subject"] == "Escalated: Please approve Spring brief."
    assert mailbox.texts(2)[0].startswith("Over to you: Spring brief")
    told = await events(d, run_id, "telling_succeeded")
    assert [(e["payload"]["for"], e["payload"]["email"]) for e in told] == [("reminder", "ana@example.org"),
                                                                          ("escalation", "bo@example.org")]


async def test_ask_takes_an_email(d, mailbox):
    status, run = await d.call("POST", "/runs", {"type": "interaction", "name": "ask-approval",
                                                 "input": {"prompt": "Ship it?", "to": "ana", "email": "ana@example.org"}})
    assert status == 202, run
    await d.advance("PT0S")
    text, _ = mailbox.texts()
    link = re.search(r"- Yes: (\S+)", text).group(1)
    assert link.endswith("?approved=true") and re.search(r"- No: \S+\?approved=false", text)
    page = await (await d.client.get(path_of(link))).text()
    assert "You chose <strong>Yes</strong>" in page
    status, bad = await d.call("POST", "/runs", {"type": "interaction", "name": "ask-approval",
                                                 "input": {"prompt": "Ship it?", "to": "ana", "email": "ana at home"}})
    assert status == 422 and bad["problem"]["errors"][0]["pointer"] == "/input/email"


async def test_the_mcp_ask_tool_takes_an_email(d, mailbox):
    from test_mcp import connect
    async with connect(d, "http") as c:
        r = await c.call_tool("ask", {"type": "choice", "prompt": "Which day?", "to": "bo", "email": "bo@example.org",
                                      "options": [{"id": "mon", "label": "Monday"}, {"id": "fri", "label": "Friday"}]})
        assert not r.is_error, r.structured_content
        await d.advance("PT0S")
    [sent] = mailbox.got
    assert sent["to"] == ["bo@example.org"] and sent["msg"]["Subject"] == "Which day?"
    text, html = mailbox.texts()
    assert re.search(r"- Monday: \S+\?option_ids=mon", text) and re.search(r"- Friday: \S+\?option_ids=fri", text)
    link = re.search(r"- Friday: (\S+)", text).group(1)
    page = await (await d.client.get(path_of(link))).text()
    assert re.search(r'<input type="radio" name="f0" value="1" checked> Friday', page), page


async def test_without_an_smtp_server_an_emailed_run_ends_unworkable(db, aiohttp_client):
    daemon = await start_daemon(aiohttp_client, db)
    await daemon.define("brief", EMAILED)
    status, run = await daemon.run("brief", INPUT)
    assert status == 409 and run["kind"] == "unworkable" and "email" in run["problem"]["detail"]


def test_an_emailed_function_is_checked_at_save():
    doc = itd.parse_function(EMAILED)
    assert doc.email.source == "{{ to }}@example.org" and doc.deliver is None    # reminders need no replies.tell
    assert "**Where:** By email to **to**@example.org, with its answer link, and in the playbook's inbox" in doc.overview
    for bad, where, words in (
            (EMAILED.replace("deliver: {email: '{{ to }}@example.org'}",
                             "deliver: {email: '{{ to }}@example.org', server: chat}"), "deliver.server", "not a key of deliver"),
            (EMAILED.replace("deliver: {email: '{{ to }}@example.org'}", "deliver: {email: '{{ input.nope }}'}"),
             "deliver.email", "nope"),
            (EMAILED.replace("input:\n", "replies: {tool: read, with: {}, read: {list: /m, each: {id: /id,"
                                         " sender: /s, text: /t}}}\ninput:\n"), "replies", "answer link")):
        with pytest.raises(itd.DocumentError) as err:
            itd.parse_function(bad)
        found = [p for p in err.value.problems if p["field"] == where]
        assert found and words in found[0]["message"] and found[0]["line"] >= 2, err.value.problems


def test_the_configuration_reads_email_and_keeps_its_password_out_of_records(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("email:\n  smtp: {host: smtp.example.org, starttls: true, username: itd, password_env: SMTP_PW}\n"
                    "  from: 'Approvals <approvals@example.org>'\n")
    config = itd.load_config(str(path), {"SMTP_PW": "hunter22-smtp"})
    assert config.email.host == "smtp.example.org" and config.email.port == 587 and config.email.starttls
    assert config.email.password == "hunter22-smtp" and "hunter22-smtp" in config.secrets
    assert "hunter22-smtp" not in repr(config)
    path.write_text("email:\n  smtp: {port: 70000, tls: yes, starttls: true, colour: blue}\n  from: nobody\n")
    with pytest.raises(itd.ConfigError) as err:
        itd.load_config(str(path), {})
    assert err.value.problems == [
        "email.smtp.colour: unknown key",
        "email.smtp.host: the SMTP server's host name or address",
        "email.smtp: starttls (upgrade a plain connection) or tls (TLS from the start), not both",
        "email.smtp.port: a port number from 1 to 65535",
        "email.from: the address requests come from, e.g. 'Approvals <approvals@example.org>'"]
