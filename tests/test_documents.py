"""Function documents: parsing with lines, every save-time rule, schemas, the overview, `check`."""

from __future__ import annotations

import io
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema.exceptions import SchemaError

import interactiond as itd
from interactiond import DocumentError, Shape, Template, parse_function

HERE = Path(__file__).parent
EXAMPLES = sorted((HERE.parent / "examples").glob("*.md"))
SEED_INBOX = (HERE / "fixtures" / "seed-approve-campaign-brief.md").read_text()
SEED_CHAT = (HERE / "fixtures" / "seed-chat-approval.md").read_text()

INBOX = """\
---
description: Ask the owner to approve an item
to: '{{ input.owner }}'
expires: P2D
input:
  schema:
    type: object
    required: [owner, item]
    properties:
      owner: { type: string }
      item: { type: string, maxLength: 300, description: The thing to approve }
      tags: { type: array }
      meta: { type: object }
output:
  schema:
    type: object
    required: [verdict]
    properties:
      verdict: { type: string, enum: [approve, revise] }
      note: { type: string, maxLength: 500 }
---
Please look at {{ input.item }} and approve it or ask for a revision.
"""

TOOL = """\
---
to: '{{ input.owner }}'
expires: PT4H
deliver:
  server: chat
  tool: post_message
  with:
    channel: '{{ to }}'
    text: '{{ message }}'
  sent:
    conversation: /channel
    id: /ts
replies:
  tool: thread_replies
  with:
    channel: '{{ sent.conversation }}'
    ts: '{{ sent.id }}'
    oldest: '{{ since | default: "0" }}'
  read:
    list: /messages
    order: newest_first
    each: { id: /ts, sender: /user, text: /text }
  tell:
    with:
      channel: '{{ sent.conversation }}'
      text: '{{ message }}'
reply: { verdict: word, note: rest }
input:
  schema:
    type: object
    properties:
      owner: { type: string }
output:
  schema:
    type: object
    required: [verdict]
    properties:
      verdict: { type: string, enum: [approve, revise] }
      note: { type: string }
---
Approve or revise?
"""

SYSTEM = """\
---
description: Read a thread
call:
  server: chat
  tool: thread_replies
  with:
    channel: '{{ input.channel }}'
    limit: 10
  read: /messages
input:
  schema:
    type: object
    properties:
      channel: { type: string }
output:
  schema: { type: array }
---
"""


def problems(source: str) -> list[dict]:
    with pytest.raises(DocumentError) as info:
        parse_function(source)
    return info.value.problems


def line_of(source: str, text: str, nth: int = 0) -> int:
    """The 1-based line of the nth line holding `text`."""
    hits = [i + 1 for i, line in enumerate(source.split("\n")) if text in line]
    return hits[nth]


def assert_problem(source: str, line: int, field: str, says: str = "") -> dict:
    found = problems(source)
    for p in found:
        if p["line"] == line and p["field"] == field and says in p["message"]:
            return p
    raise AssertionError(f"no problem at line {line} for {field!r} saying {says!r}: {found}")


def edit(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old
    return source.replace(old, new)


# Documents that must be accepted ###############################################################

def test_the_three_base_documents_parse():
    assert parse_function(INBOX).shape is Shape.INBOX
    assert parse_function(TOOL).shape is Shape.TOOL
    assert parse_function(SYSTEM).shape is Shape.SYSTEM


def test_seed_inbox_example_is_accepted():
    doc = parse_function(SEED_INBOX)
    assert doc.shape is Shape.INBOX
    assert doc.description == "Asks the campaign owner to approve a reviewed brief"
    assert doc.expires == timedelta(days=2) and doc.expires_text == "P2D"
    assert doc.to.source == "{{ input.owner }}" and doc.to.line == 3
    assert doc.message.line == 20 and doc.message.source.startswith("The review of your campaign brief")
    assert doc.deliver is None and doc.replies is None and doc.call is None
    assert doc.reply_rule.parts["verdict"].source == "word"  # made from the schema
    assert not doc.is_notification


def test_seed_chat_example_is_accepted_with_every_block():
    doc = parse_function(SEED_CHAT)
    assert doc.shape is Shape.TOOL
    assert doc.deliver.server == "chat" and doc.deliver.tool == "post_message"
    assert doc.deliver.sent == itd.SentSpec(conversation="/channel", id="/ts")
    replies = doc.replies
    assert replies.tool == "thread_replies" and replies.wait == timedelta(minutes=1)
    assert replies.read == itd.ReadSpec("/messages", "oldest_first",
                                        {"id": "/ts", "sender": "/user", "text": "/text", "to": "/thread_ts"})
    assert replies.with_["limit"] == 15 and isinstance(replies.with_["oldest"], Template)
    assert replies.tell.tool == "post_message"  # tell names no tool: the sending tool
    assert replies.conversation.source == "{{ sent.conversation }}/{{ sent.id }}"
    assert set(doc.reply_rule.parts) == {"verdict", "note"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_are_accepted(path):
    doc = parse_function(path.read_text())
    assert doc.overview


def test_examples_cover_each_shape_and_a_notification():
    docs = {p.name: parse_function(p.read_text()) for p in EXAMPLES}
    assert docs["approve-brief.md"].shape is Shape.INBOX
    assert docs["chat-approval.md"].replies is not None
    assert docs["thread-replies.md"].shape is Shape.SYSTEM
    assert docs["notify-owner.md"].is_notification


def test_defaults_of_the_tool_blocks():
    source = edit(TOOL, "  wait: PT1M\n", "") if "wait:" in TOOL else TOOL
    doc = parse_function(source)
    assert doc.replies.wait == timedelta(seconds=5)
    assert doc.replies.conversation.source == "{{ sent.conversation }}"
    assert doc.replies.tell.tool == "post_message"
    doc = parse_function(edit(TOOL, "  tell:\n", "  tell:\n    tool: post_reply\n"))
    assert doc.replies.tell.tool == "post_reply"


def test_with_trees_hold_templates_and_keep_values_as_written():
    doc = parse_function(SYSTEM)
    assert isinstance(doc.call.with_["channel"], Template)
    assert doc.call.with_["limit"] == 10
    assert doc.call.read == "/messages" and doc.call.reads_input
    doc = parse_function(edit(SYSTEM, "'{{ input.channel }}'", "C1"))
    assert not doc.call.reads_input


def test_call_with_defaults_to_no_arguments_and_read_to_the_whole_answer():
    source = edit(SYSTEM, "  with:\n    channel: '{{ input.channel }}'\n    limit: 10\n  read: /messages\n", "")
    doc = parse_function(source)
    assert doc.call.with_ == {} and doc.call.read is None


def test_validators_are_compiled_from_the_schemas():
    doc = parse_function(INBOX)
    assert doc.input_validator.is_valid({"owner": "ana", "item": "x"})
    assert not doc.output_validator.is_valid({"verdict": "maybe"})
    assert parse_function(edit(INBOX, "input:\n  schema:\n    type: object\n    required: [owner, item]\n"
                                      "    properties:\n      owner: { type: string }\n"
                                      "      item: { type: string, maxLength: 300, description: The thing to approve }\n"
                                      "      tags: { type: array }\n      meta: { type: object }\n", "")
                          ).input_validator is None


def test_yaml_1_2_scalars_keep_yes_and_no_as_text():
    doc = parse_function(edit(INBOX, "enum: [approve, revise]", "enum: [yes, no, on]"))
    assert doc.output_schema["properties"]["verdict"]["enum"] == ["yes", "no", "on"]


# The front matter ################################################################################

def test_a_document_starts_with_three_dashes():
    p = problems("to: x\n---\nhi")
    assert p == [{"line": 1, "field": "", "message": p[0]["message"]}]


def test_front_matter_must_end():
    assert problems("---\nto: x\nexpires: P1D\n")[0]["line"] == 4


def test_yaml_syntax_errors_name_their_line():
    source = edit(INBOX, "expires: P2D", "expires: [P2D")
    assert problems(source)[0]["line"] >= line_of(source, "expires:")
    assert "YAML" in problems(source)[0]["message"]


def test_front_matter_must_be_a_mapping():
    assert problems("---\n- a\n- b\n---\nhi\n")[0]["line"] == 2


def test_duplicate_keys_are_refused_at_the_second():
    source = edit(INBOX, "expires: P2D\n", "expires: P2D\nexpires: P3D\n")
    p = assert_problem(source, line_of(source, "expires: P3D"), "expires", "twice")
    assert str(line_of(source, "expires: P2D")) in p["message"]


def test_nested_duplicate_keys_are_refused():
    source = edit(TOOL, "    id: /ts\n", "    id: /ts\n    id: /id\n")
    assert_problem(source, line_of(source, "id: /id"), "deliver.sent.id", "twice")


def test_anchors_and_aliases_are_refused_and_other_problems_still_reported():
    source = edit(INBOX, "expires: P2D\n", "expires: &e P2D\nmodel: *e\n")
    assert_problem(source, line_of(source, "expires:"), "expires", "anchors")
    assert_problem(source, line_of(source, "model:"), "model", "anchors")
    assert_problem(source, line_of(source, "model:"), "model", "not a field")


def test_billion_laughs_is_refused_without_expanding():
    lol = "---\na: &a ['lol','lol','lol','lol','lol','lol','lol','lol','lol']\n"
    for i in range(1, 9):
        lol += f"{'b' * i}: &{'b' * i} [{', '.join(['*' + ('b' * (i - 1) if i > 1 else 'a')] * 9)}]\n"
    lol += "---\nhi\n"
    assert any("anchors" in p["message"] for p in problems(lol))


def test_yaml_tags_are_refused():
    source = edit(INBOX, "expires: P2D", "expires: !!binary UDJE")
    assert_problem(source, line_of(source, "expires:"), "expires", "tag")


def test_every_problem_comes_back_sorted_by_line():
    source = edit(edit(edit(INBOX, "expires: P2D", "expires: P90D"), "description: Ask", "language: en\ndescription: Ask"),
                  "{{ input.item }}", "{{ input.item | nosuch }}")
    found = problems(source)
    assert [p["field"] for p in found] == ["language", "expires", "body"]
    assert [p["line"] for p in found] == sorted(p["line"] for p in found)


# Fields ############################################################################################

@pytest.mark.parametrize("name", ["model", "config", "tools", "language", "Description"])
def test_unknown_fields_are_refused_with_their_line(name):
    source = edit(INBOX, "expires: P2D\n", f"expires: P2D\n{name}: x\n")
    assert_problem(source, line_of(source, f"{name}: x"), name, "not a field")


@pytest.mark.parametrize("base, anchor, field", [
    (SYSTEM, "  read: /messages\n", "call.extra"),
    (TOOL, "  server: chat\n", "deliver.extra"),
    (TOOL, "    id: /ts\n", "deliver.sent.extra"),
    (TOOL, "  tool: thread_replies\n", "replies.extra"),
    (TOOL, "    order: newest_first\n", "replies.read.extra"),
    (TOOL, "  tell:\n", "replies.tell.extra"),
    (INBOX, "output:\n", "input.extra"),
])
def test_unknown_keys_inside_blocks_are_refused(base, anchor, field):
    indent = anchor[: len(anchor) - len(anchor.lstrip())]
    if anchor.strip() in ("tell:", "output:"):  # insert under the block's own header
        indent += "  "
    if anchor == "output:\n":
        source = edit(base, "input:\n", "input:\n  extra: 1\n")
    else:
        source = edit(base, anchor, anchor + f"{indent}extra: 1\n")
    assert_problem(source, line_of(source, "extra: 1"), field, "not a key")


def test_unknown_keys_in_read_each_are_refused():
    source = edit(TOOL, "each: { id: /ts, sender: /user, text: /text }", "each: { id: /ts, sender: /user, text: /text, at: /x }")
    assert_problem(source, line_of(source, "each:"), "replies.read.each.at", "not a key")


@pytest.mark.parametrize("value, says", [("''", "1 to 1000"), ("'" + "x" * 1001 + "'", "1 to 1000"), ("[a]", "text")])
def test_description_bounds(value, says):
    source = edit(INBOX, "description: Ask the owner to approve an item", f"description: {value}")
    assert_problem(source, 2, "description", says)


def test_description_of_1000_characters_is_accepted():
    doc = parse_function(edit(INBOX, "description: Ask the owner to approve an item", "description: " + "x" * 1000))
    assert doc.description == "x" * 1000 and doc.shape is Shape.INBOX


@pytest.mark.parametrize("value, ok", [("PT1M", True), ("P30D", True), ("PT59S", False), ("P31D", False),
                                       ("P1M", False), ("two days", False), ("P1W", True)])
def test_expires_bounds(value, ok):
    source = edit(INBOX, "expires: P2D", f"expires: {value}")
    if ok:
        assert parse_function(source).expires_text == value
    else:
        assert_problem(source, 4, "expires")


@pytest.mark.parametrize("value, ok", [("PT5S", True), ("PT1H", True), ("PT4S", False), ("PT2H", False), ("soon", False)])
def test_wait_bounds(value, ok):
    source = edit(TOOL, "  tell:\n", f"  wait: {value}\n  tell:\n")
    if ok:
        assert parse_function(source).replies.wait == itd.parse_duration(value)
    else:
        assert_problem(source, line_of(source, "wait:"), "replies.wait")


@pytest.mark.parametrize("base, old, new, field", [
    (SYSTEM, "read: /messages", "read: ''", "call.read"),
    (SYSTEM, "read: /messages", "read: messages", "call.read"),
    (SYSTEM, "read: /messages", "read: /a~2b", "call.read"),
    (TOOL, "id: /ts\n", "id: ts\n", "deliver.sent.id"),
    (TOOL, "conversation: /channel", "conversation: 5", "deliver.sent.conversation"),
    (TOOL, "list: /messages", "list: messages", "replies.read.list"),
    (TOOL, "text: /text }", "text: /text, to: thread }", "replies.read.each.to"),
])
def test_pointers_are_checked(base, old, new, field):
    source = edit(base, old, new)
    assert_problem(source, line_of(source, new.strip()), field)


def test_escaped_pointers_are_accepted():
    assert parse_function(edit(SYSTEM, "read: /messages", "read: /a~1b/~0c/0")).call.read == "/a~1b/~0c/0"


def test_read_order_is_oldest_first_or_newest_first():
    source = edit(TOOL, "order: newest_first", "order: newest")
    assert_problem(source, line_of(source, "order:"), "replies.read.order", "oldest_first")


@pytest.mark.parametrize("base, old, new, field", [
    (SYSTEM, "server: chat", "server: Chat", "call.server"),
    (SYSTEM, "server: chat", "server: 1chat", "call.server"),
    (SYSTEM, "server: chat", "server: " + "c" * 33, "call.server"),
    (SYSTEM, "tool: thread_replies", "tool: thread replies", "call.tool"),
    (TOOL, "tool: post_message", "tool: post/message", "deliver.tool"),
    (TOOL, "tool: thread_replies", "tool: 'a:b'", "replies.tool"),
    (TOOL, "  tell:\n", "  tell:\n    tool: '#t'\n", "replies.tell.tool"),
])
def test_server_and_tool_names_are_checked(base, old, new, field):
    source = edit(base, old, new)
    assert_problem(source, line_of(source, new.strip().split("\n")[-1].strip()), field, "name")


def test_names_that_only_look_odd_are_accepted():
    doc = parse_function(edit(edit(SYSTEM, "server: chat", "server: c-2"), "tool: thread_replies", "tool: Thread.replies-2"))
    assert (doc.call.server, doc.call.tool) == ("c-2", "Thread.replies-2")
    assert doc.shape is Shape.SYSTEM and doc.call.read == "/messages"


# Fields by shape ###################################################################################

@pytest.mark.parametrize("extra", ["to: x", "from: x", "expires: P1D", "reply: { a: text }",
                                   "deliver: { server: chat, tool: t, with: {} }",
                                   "replies: { tool: t, with: {}, read: {list: /m, order: oldest_first, each: {id: /a, sender: /b, text: /c}} }"])
def test_a_system_call_refuses_the_fields_of_a_person(extra):
    source = edit(SYSTEM, "description: Read a thread\n", f"description: Read a thread\n{extra}\n")
    key = extra.split(":")[0]
    assert_problem(source, 3, key, "call")


def test_a_system_call_refuses_a_body():
    source = SYSTEM + "\nSome message\n"
    assert_problem(source, line_of(source, "Some message"), "body", "no message")


def test_a_system_call_needs_output_schema():
    source = edit(SYSTEM, "output:\n  schema: { type: array }\n", "")
    assert_problem(source, 1, "output.schema", "call")


def test_a_system_call_needs_server_and_tool():
    source = edit(SYSTEM, "  server: chat\n", "")
    assert_problem(source, line_of(source, "call:"), "call.server", "needs")


@pytest.mark.parametrize("drop, field", [("to: '{{ input.owner }}'\n", "to"), ("expires: P2D\n", "expires")])
def test_asking_a_person_needs_to_and_expires(drop, field):
    assert_problem(edit(INBOX, drop, ""), 1, field, "required")


def test_asking_a_person_needs_a_message():
    source = INBOX.split("---\nPlease")[0] + "---\n\n   \n"
    assert_problem(source, line_of(source, "---", 1) + 1, "body", "message")


def test_replies_need_deliver():
    source = edit(INBOX, "output:\n", "replies: { tool: t, with: {}, read: {} }\noutput:\n")
    assert_problem(source, line_of(source, "replies:"), "replies", "deliver")


def test_deliver_needs_server_tool_and_with():
    source = edit(TOOL, "  with:\n    channel: '{{ to }}'\n    text: '{{ message }}'\n", "")
    assert_problem(source, line_of(source, "deliver:"), "deliver.with", "needs")


def test_replies_need_deliver_sent():
    source = edit(TOOL, "  sent:\n    conversation: /channel\n    id: /ts\n", "")
    assert_problem(source, line_of(source, "replies:"), "replies", "deliver.sent")


def test_deliver_without_sent_is_fine_without_replies():
    source = TOOL.split("replies:")[0] + "input:" + TOOL.split("\ninput:")[1]
    source = edit(source, "  sent:\n    conversation: /channel\n    id: /ts\n", "")
    assert parse_function(source).deliver.sent is None


def test_replies_need_output_schema():
    source = TOOL.split("reply:")[0] + "input:" + TOOL.split("\ninput:")[1].split("output:")[0] + "---\nhi\n"
    assert_problem(source, line_of(source, "replies:"), "replies", "output.schema")


def test_replies_need_a_reply_rule_when_none_can_be_made():
    source = edit(edit(TOOL, "reply: { verdict: word, note: rest }\n", ""), "required: [verdict]", "required: [verdict, note]")
    assert_problem(source, line_of(source, "replies:"), "replies", "reply rule")


def test_replies_take_the_rule_made_from_the_schema():
    doc = parse_function(edit(TOOL, "reply: { verdict: word, note: rest }\n", ""))
    assert doc.reply_rule.parts == {"verdict": itd.RulePart("word", {"approve": (), "revise": ()})}


def test_reply_needs_output_schema():
    source = edit(INBOX, "output:\n  schema:\n    type: object\n    required: [verdict]\n    properties:\n"
                         "      verdict: { type: string, enum: [approve, revise] }\n"
                         "      note: { type: string, maxLength: 500 }\n", "reply: { verdict: word }\n")
    assert_problem(source, line_of(source, "reply:"), "reply", "output.schema")


def test_a_notification_has_no_rule():
    source = edit(INBOX, "output:\n  schema:\n    type: object\n    required: [verdict]\n    properties:\n"
                         "      verdict: { type: string, enum: [approve, revise] }\n"
                         "      note: { type: string, maxLength: 500 }\n", "")
    doc = parse_function(source)
    assert doc.is_notification and doc.reply_rule is None and doc.output_validator is None


def test_a_system_call_is_not_a_notification():
    assert not parse_function(SYSTEM).is_notification


# The reply rule at save time #######################################################################

def rule_doc(rule: str) -> str:
    return edit(TOOL, "reply: { verdict: word, note: rest }", f"reply: {rule}")


@pytest.mark.parametrize("rule, field, says", [
    ("{ verdict: word, size: rest }", "reply.size", "string property"),
    ("{ verdict: word, note: sentence }", "reply.note", "word, rest or text"),
    ("{ verdict: word, note: { from: rest, words: { a: [b] } } }", "reply.note.words", "only"),
    ("{ verdict: { from: word, words: { maybe: [perhaps] } } }", "reply.verdict.words.maybe", "not a value"),
    ("{ verdict: { from: word, words: { approve: [ok], revise: [OK] } } }", "reply.verdict.words.revise.0", "one value"),
    ("{ verdict: { from: word, words: { approve: [revise] } } }", "reply.verdict.words.approve.0", "one value"),
    ("{ verdict: { from: word, words: { approve: [looks good] } } }", "reply.verdict.words.approve.0", "one word"),
    ("{ verdict: { from: word, words: { approve: ['" + "y" * 65 + "'] } } }", "reply.verdict.words.approve.0", "64 bytes"),
    ("{ verdict: { from: word, words: { approve: [" + ", ".join(f"w{i}" for i in range(17)) + "] } } }",
     "reply.verdict.words.approve", "16 words"),
    ("{ verdict: { from: word, words: [yes] } }", "reply.verdict.words", "mapping"),
    ("{ verdict: { words: { approve: [y] } } }", "reply.verdict.from", "needs"),
    ("{ note: rest }", "reply", "required property 'verdict'"),
    ("[verdict]", "reply", "mapping"),
])
def test_reply_rule_refusals(rule, field, says):
    source = rule_doc(rule)
    assert_problem(source, line_of(source, "reply:"), field, says)


def test_a_word_part_needs_an_enum():
    source = rule_doc("{ verdict: word, note: word }")
    assert_problem(source, line_of(source, "reply:"), "reply.note", "enum")


def test_a_rule_refuses_more_than_16_values():
    values = [f"v{i}" for i in range(17)]
    source = edit(rule_doc("{ verdict: { from: word, words: {" + ", ".join(f"{v}: [{v}x]" for v in values) + "} } }"),
                  "enum: [approve, revise]", f"enum: [{', '.join(values)}]")
    assert_problem(source, line_of(source, "reply:"), "reply.verdict.words", "16 values")


def test_a_rule_with_16_values_and_16_words_is_accepted():
    values = [f"v{i}" for i in range(16)]
    words = lambda v: "[" + ", ".join(f"{v}w{j}" for j in range(16)) + "]"  # noqa: E731
    source = edit(rule_doc("{ verdict: { from: word, words: {" + ", ".join(f"{v}: {words(v)}" for v in values) + "} } }"),
                  "enum: [approve, revise]", f"enum: [{', '.join(values)}]")
    rule = parse_function(source).reply_rule
    assert rule.apply("v3w15")[0] == {"verdict": "v3"}


def test_rule_keys_must_be_top_level_string_properties():
    source = edit(rule_doc("{ verdict: word, count: text }"), "note: { type: string }", "count: { type: integer }")
    assert_problem(source, line_of(source, "reply:"), "reply.count", "string property")


def test_reply_is_accepted_on_an_inbox_function():
    doc = parse_function(edit(INBOX, "output:\n", "reply: { verdict: word, note: rest }\noutput:\n"))
    assert doc.reply_rule.parts["note"].source == "rest"


# Templates in documents ##############################################################################

@pytest.mark.parametrize("old, new, field, marker", [
    ("to: '{{ input.owner }}'", "to: '{{ message }}'", "to", "to:"),
    ("to: '{{ input.owner }}'", "to: '{{ run_id }}'", "to", "to:"),
    ("{{ input.item }}", "{{ since }}", "body", "{{ since }}"),
    ("text: '{{ message }}'\n  sent", "text: '{{ since }}'\n  sent", "deliver.with.text", "{{ since }}"),
    ("ts: '{{ sent.id }}'", "ts: '{{ message }}'", "replies.with.ts", "    ts:"),
    ("ts: '{{ sent.id }}'", "ts: '{{ sent.other }}'", "replies.with.ts", "    ts:"),
    ("ts: '{{ sent.id }}'", "ts: '{{ input.owner }}'", "replies.with.ts", "    ts:"),
    ("      text: '{{ message }}'\nreply", "      text: '{{ since }}'\nreply", "replies.tell.with.text", "{{ since }}"),
    ("  tool: thread_replies\n", "  tool: thread_replies\n  conversation: '{{ input.owner }}'\n",
     "replies.conversation", "conversation: '"),
])
def test_templates_read_only_the_names_of_their_place(old, new, field, marker):
    source = edit(INBOX if field in ("to", "body") else TOOL, old, new)
    assert_problem(source, line_of(source, marker), field, "not a name this place reads")


@pytest.mark.parametrize("old, new, where, roots", [
    ("text: '{{ message }}'\n  sent", "text: '{{ message }} {{ run_id }} {{ function }} {{ expires_at }} {{ to }} {{ today }}'\n  sent",
     lambda doc: doc.deliver.with_["text"], {"message", "run_id", "function", "expires_at", "to", "today"}),
    ("text: '{{ message }}'\n  sent", "text: '{{ answer_schema }}'\n  sent",
     lambda doc: doc.deliver.with_["text"], {"answer_schema"}),
    ("ts: '{{ sent.id }}'", "ts: '{{ since }}{{ conversation }}{{ to }}'",
     lambda doc: doc.replies.with_["ts"], {"since", "conversation", "to"}),
    ("      text: '{{ message }}'\nreply", "      text: '{{ message }} {{ to }} {{ sent.id }}'\nreply",
     lambda doc: doc.replies.tell.with_["text"], {"message", "to", "sent"}),
    ("  tool: thread_replies\n", "  tool: thread_replies\n  conversation: '{{ to }}:{{ sent.id }}'\n",
     lambda doc: doc.replies.conversation, {"to", "sent"}),
])
def test_templates_may_read_the_names_of_their_place(old, new, where, roots):
    source = edit(TOOL, old, new)
    template = where(parse_function(source))
    assert f"'{template.source}'" in new and template.line == line_of(source, template.source)
    assert template.roots == roots


def test_call_with_reads_input_today_and_now_only():
    doc = parse_function(edit(SYSTEM, "limit: 10", "limit: '{{ today }} {{ now }}'"))
    assert doc.call.with_["limit"].source == "{{ today }} {{ now }}" and doc.call.with_["limit"].roots == {"today", "now"}
    assert doc.call.reads_input                                         # channel still reads input.channel
    source = edit(SYSTEM, "limit: 10", "limit: '{{ to }}'")
    assert_problem(source, line_of(source, "limit:"), "call.with.limit", "not a name")


def test_a_template_holding_a_dollar_brace_is_refused():
    source = edit(INBOX, "{{ input.item }} and", "{{ input.item }}\nand ${HOME}")
    assert_problem(source, line_of(source, "${HOME}"), "body", "${")
    source = edit(SYSTEM, "limit: 10", "limit: '${LIMIT}'")
    assert_problem(source, line_of(source, "limit:"), "call.with.limit", "${")


def test_a_template_that_does_not_compile_names_its_line_in_the_body():
    source = edit(INBOX, "Please look at {{ input.item }} and approve it or ask for a revision.",
                  "Line one\n\nLine three {% if input.item %}\nbroken {{ input.item | }}\n{% endif %}")
    assert_problem(source, line_of(source, "broken"), "body", "compile")


def test_a_template_that_does_not_compile_in_a_block_scalar_names_its_line():
    source = edit(TOOL, "    text: '{{ message }}'\n  sent:", "    text: |\n      first\n      second {{ message | }}\n  sent:")
    assert_problem(source, line_of(source, "second"), "deliver.with.text", "compile")


def test_unknown_filters_are_refused_at_save_time():
    source = edit(INBOX, "{{ input.item }}", "{{ input.item | shout }}")
    assert_problem(source, line_of(source, "shout"), "body", "no filter 'shout'")


def test_include_and_render_are_not_available():
    source = edit(INBOX, "{{ input.item }}", "{% include 'secrets' %}")
    assert_problem(source, line_of(source, "include"), "body", "compile")


def test_input_properties_outside_the_schema_are_refused():
    source = edit(INBOX, "{{ input.item }}", "{{ input.itme }}")
    assert_problem(source, line_of(source, "itme"), "body", "no property 'itme'")


@pytest.mark.parametrize("extra", ["additionalProperties: true", "additionalProperties: { type: string }"])
def test_other_input_properties_are_allowed_when_the_schema_says_so(extra):
    source = edit(edit(INBOX, "    required: [owner, item]\n", f"    required: [owner, item]\n    {extra}\n"),
                  "{{ input.item }}", "{{ input.other }}")
    doc = parse_function(source)
    assert doc.message.roots == {"input"} and "{{ input.other }}" in doc.message.source
    assert doc.message.render_text({"input": {"owner": "o", "item": "i", "other": "X"}}).startswith("Please look at X and")


def test_additional_properties_false_refuses_them():
    source = edit(edit(INBOX, "    required: [owner, item]\n", "    required: [owner, item]\n    additionalProperties: false\n"),
                  "{{ input.item }}", "{{ input.other }}")
    assert_problem(source, line_of(source, "input.other"), "body", "other")


def test_any_input_property_is_allowed_without_a_schema_listing_them():
    source = edit(INBOX, "    properties:\n      owner: { type: string }\n", "    $comment: no properties listed\n")
    source = source.replace("      item: { type: string, maxLength: 300, description: The thing to approve }\n"
                            "      tags: { type: array }\n      meta: { type: object }\n", "")
    doc = parse_function(edit(source, "{{ input.item }}", "{{ input.anything }}"))
    assert doc.input_schema == {"type": "object", "required": ["owner", "item"], "$comment": "no properties listed"}
    assert doc.message.render_text({"input": {"anything": "Y"}}).startswith("Please look at Y and")


@pytest.mark.parametrize("template", ["{{ input.tags }}", "{{ input.meta }}", "{{ input }}", "{{ input.tags | sort }}"])
def test_a_structure_inside_text_is_refused(template):
    source = edit(INBOX, "{{ input.item }}", template)
    assert_problem(source, line_of(source, "Please look"), "body", "inside text")


@pytest.mark.parametrize("template, text", [("{{ input.tags | json }}", '["a", "b"]'), ("{{ input.meta | json }}", '{"k": 1}'),
                                            ("{{ input.tags | size }}", "2"), ("{{ input.tags | join: ', ' }}", "a, b")])
def test_a_structure_made_text_is_accepted(template, text):
    doc = parse_function(edit(INBOX, "{{ input.item }}", template))
    rendered = doc.message.render_text({"input": {"owner": "o", "item": "i", "tags": ["a", "b"], "meta": {"k": 1}}})
    assert rendered == f"Please look at {text} and approve it or ask for a revision."


def test_a_whole_expression_argument_may_send_a_structure():
    source = edit(INBOX, "output:\n", "deliver: { server: chat, tool: post, with: { tags: '{{ input.tags }}', "
                                      "text: '{{ message }}' } }\noutput:\n")
    doc = parse_function(source)
    assert doc.deliver.with_["tags"].whole
    source = edit(source, "tags: '{{ input.tags }}'", "tags: 'x {{ input.tags }}'")
    assert_problem(source, line_of(source, "deliver:"), "deliver.with.tags", "inside text")


def test_a_party_is_text_even_as_one_expression():
    source = edit(INBOX, "to: '{{ input.owner }}'", "to: '{{ input.meta }}'")
    assert_problem(source, 3, "to", "inside text")


def test_a_template_is_text():
    assert_problem(edit(INBOX, "to: '{{ input.owner }}'", "to: 5"), 3, "to", "text")


# Arguments that read no input ###################################################################

def test_call_arguments_past_16_kib_that_read_no_input_are_refused():
    source = edit(edit(SYSTEM, "'{{ input.channel }}'", "C1"), "limit: 10",
                  "limit: 10\n    pad: '{{ today }}" + "x" * (16 * 1024) + "'")
    assert_problem(source, line_of(source, "with:"), "call.with", "16 KiB")


def test_call_arguments_that_render_past_16_kib_from_a_loop_are_refused():
    source = edit(SYSTEM, "'{{ input.channel }}'", "'{% for i in (1..1700) %}0123456789{% endfor %}'")
    assert_problem(source, line_of(source, "with:"), "call.with", "16 KiB")


def test_call_arguments_just_under_16_kib_are_accepted():
    pad = 16 * 1024 - len('{"channel":"C","limit":10,"pad":""}')
    doc = parse_function(edit(edit(SYSTEM, "'{{ input.channel }}'", "C"), "limit: 10", f"limit: 10\n    pad: '{'x' * pad}'"))
    assert not doc.call.reads_input
    assert doc.call.with_["pad"].source == "x" * pad and doc.call.with_["channel"].source == "C"


def test_call_arguments_that_read_input_are_measured_at_run_time():
    doc = parse_function(edit(SYSTEM, "limit: 10", "limit: 10\n    pad: '" + "x" * (16 * 1024) + "'"))
    assert doc.call.reads_input and doc.call.with_["pad"].source == "x" * (16 * 1024)


def test_delivery_arguments_with_only_constants_are_measured_too():
    source = edit(TOOL, "    text: '{{ message }}'\n  sent:", "    text: '{{ message }}'\n    pad: '" + "x" * (17 * 1024) + "'\n  sent:")
    doc = parse_function(source)  # reads message and to: measured when sent
    assert doc.deliver.with_["pad"].source == "x" * (17 * 1024)
    assert {name: t.roots for name, t in doc.deliver.with_.items() if name != "pad"} == {"channel": {"to"}, "text": {"message"}}
    source = edit(TOOL, "    channel: '{{ to }}'\n    text: '{{ message }}'\n", "    pad: '" + "x" * (17 * 1024) + "'\n")
    assert_problem(source, line_of(source, "  with:"), "deliver.with", "16 KiB")


# Schemas ############################################################################################

def test_an_invalid_input_schema_names_the_keyword_line():
    source = edit(INBOX, "tags: { type: array }", "tags: { type: arrray }")
    assert_problem(source, line_of(source, "tags:"), "input.schema.properties.tags.type", "JSON Schema")


def test_an_invalid_output_schema_is_refused():
    source = edit(INBOX, "note: { type: string, maxLength: 500 }", "note: { type: string, maxLength: -1 }")
    assert_problem(source, line_of(source, "note:"), "output.schema.properties.note.maxLength")


def test_a_schema_is_a_mapping():
    source = edit(SYSTEM, "schema: { type: array }", "schema: [array]")
    assert_problem(source, line_of(source, "schema: [array]"), "output.schema", "JSON Schema")


def test_an_unknown_dialect_is_refused_and_a_known_one_accepted():
    source = edit(SYSTEM, "schema: { type: array }", "schema: { $schema: 'https://example.com/s', type: array }")
    assert_problem(source, line_of(source, "$schema"), "output.schema.$schema", "dialect")
    doc = parse_function(edit(SYSTEM, "schema: { type: array }",
                              "schema: { $schema: 'http://json-schema.org/draft-07/schema#', type: array }"))
    assert type(doc.output_validator).__name__ == "Draft7Validator"


def test_remote_references_are_refused_and_local_ones_accepted():
    source = edit(SYSTEM, "schema: { type: array }", "schema: { items: { $ref: 'https://example.com/x.json' } }")
    assert_problem(source, line_of(source, "$ref"), "output.schema.items.$ref", "fetched")
    doc = parse_function(edit(SYSTEM, "schema: { type: array }",
                              "schema: { $defs: { m: { type: object } }, type: array, items: { $ref: '#/$defs/m' } }"))
    assert doc.output_schema == {"$defs": {"m": {"type": "object"}}, "type": "array", "items": {"$ref": "#/$defs/m"}}
    assert doc.output_validator.is_valid([{}]) and not doc.output_validator.is_valid([1])   # the reference resolved


def test_compile_schema_checks_formats_and_caches():
    validator = itd.compile_schema({"type": "string", "format": "date-time"})
    assert validator is itd.compile_schema({"type": "string", "format": "date-time"})
    assert validator.is_valid("2026-01-02T03:04:05Z")
    assert not validator.is_valid("2026-13-02T03:04:05Z")
    assert not itd.compile_schema({"format": "uri"}).is_valid("not a uri")


def test_compile_schema_refuses_a_bad_schema():
    with pytest.raises(SchemaError):
        itd.compile_schema({"type": "strin"})


def test_schema_errors_point_at_each_problem():
    validator = itd.compile_schema({
        "type": "object", "required": ["verdict", "reason", "when"], "additionalProperties": False,
        "properties": {"verdict": {"enum": ["approve", "revise"]}, "reason": {"type": "string"},
                       "when": {"type": "string"}, "items": {"type": "array", "items": {"type": "integer"}}}})
    errors = itd.schema_errors(validator, {"verdict": "maybe", "items": [1, "x"], "extra": 1}, "/answer")
    pointers = [e["pointer"] for e in errors]
    assert pointers == sorted(pointers)
    assert set(pointers) == {"/answer", "/answer/verdict", "/answer/reason", "/answer/when", "/answer/items/1"}
    assert all(e["message"] for e in errors)
    assert itd.schema_errors(validator, {"verdict": "approve", "reason": "r", "when": "w"}) == []


def test_remote_references_are_never_fetched(monkeypatch):
    fetched = []

    def no_network(request, *args, **kwargs):
        fetched.append(getattr(request, "full_url", request))
        raise OSError("no network in tests")
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    validator = itd.compile_schema({"$ref": "https://example.com/never.json"})
    errors = itd.schema_errors(validator, {"a": 1}, "/answer")
    assert fetched == []
    assert errors[0]["pointer"] == "/answer" and "never.json" in errors[0]["message"]


# The overview ###########################################################################################

def test_overview_of_a_person_function():
    text = parse_function(INBOX).overview
    assert text.startswith("Ask the owner to approve an item")
    assert "**Who it asks:** **owner**." in text
    assert "> Please look at **item** and approve it" in text
    assert "2 days" in text
    assert "inbox" in text
    assert "- **verdict** (text, required): one of approve, revise" in text
    assert "- **item** (text, required): The thing to approve; at most 300 characters" in text
    assert "{{" not in text and "Used by" not in text


def test_overview_names_each_fields_type_and_a_lists_items():
    source = edit(INBOX, "      tags: { type: array }\n",
                  "      tags: { type: array, items: { type: string } }\n      count: { type: integer }\n")
    text = parse_function(source).overview
    assert "- **tags** (list of text)" in text
    assert "- **count** (whole number)" in text
    assert "- **meta** (object)" in text


def test_overview_without_a_description_says_so():
    text = parse_function(edit(INBOX, "description: Ask the owner to approve an item\n", "")).overview
    assert text.startswith("This function has no description yet.")


def test_overview_of_a_notification_and_a_tool():
    source = TOOL.split("replies:")[0] + "input:" + TOOL.split("\ninput:")[1].split("output:")[0] + "---\nhi\n"
    source = edit(source, "expires: PT4H", "expires: PT1H30M")
    text = parse_function(source).overview
    assert "notification" in text
    assert "`post_message`" in text and "`chat`" in text
    assert "1 hour 30 minutes" in text


def test_overview_names_the_answerer_and_the_reply_rule():
    source = edit(rule_doc("{ verdict: { from: word, words: { approve: [yes, ok] } }, note: rest }"),
                  "expires: PT4H\n", "expires: PT4H\nfrom: '{{ input.owner | downcase }}'\n")
    text = parse_function(source).overview
    assert "the answer that counts comes from **owner**" in text
    assert "`thread_replies`" in text and "5 seconds" in text
    assert "approve (also yes, ok) or revise" in text
    assert "**note** is what the reply says after its first word" in text


def test_overview_of_a_system_call():
    text = parse_function(SYSTEM).overview
    assert "`thread_replies`" in text and "`chat`" in text and "`/messages`" in text
    assert "- **channel** (text)" in text
    assert "**What it needs:**" not in text


# check_files (the `interactiond check` command) ######################################################

def test_check_files_prints_ok_and_problems(tmp_path):
    good = tmp_path / "good.md"
    good.write_text(INBOX)
    bad = tmp_path / "bad.md"
    bad.write_text(edit(INBOX, "expires: P2D", "expires: P99D"))
    out = io.StringIO()
    assert itd.check_files([str(good), str(bad)], out=out) == 1
    lines = out.getvalue().splitlines()
    assert lines[0] == f"{good}: ok (function document)"
    assert lines[1].startswith(f"{bad}:4: expires: ")


def test_check_files_succeeds_on_good_files_and_fails_on_missing_ones(tmp_path):
    good = tmp_path / "good.md"
    good.write_text(SYSTEM)
    out = io.StringIO()
    assert itd.check_files([str(good)], out=out) == 0
    assert itd.check_files([str(tmp_path / "missing.md")], out=out) == 1
    assert "missing.md: cannot read it" in out.getvalue()


def test_check_files_on_the_examples():
    out = io.StringIO()
    assert itd.check_files([str(p) for p in EXAMPLES], out=out) == 0
    assert out.getvalue().count(": ok (") == len(EXAMPLES) >= 4


# Fuzzing ###################################################################################################

SCRAPS = ["", "---", "x: y", "  - a", "{{ input.owner }}", "{% for x in y %}", "&a", "*a", "!!binary x", "? [a]",
          "<<: *a", "to: [", "'", '"', "|", ">", "- [a, {b: c}]", "reply: {verdict: {from: word, words: {x: [1]}}}",
          "replies: 5", "deliver: {with: []}", "call: {server: s, tool: t, with: {a: '{{ x }}'}}", "input: {schema: 5}",
          "output: {schema: {type: foo}}", "\t", "\x00", "\x85", "\u2028", "${x}", "{{", "}}", "expires: PT0S",
          "description: " + "z" * 1200, "wait: P1D", "each: {id: ''}", "read: {list: ~}", "a: 1e400", "b: 0x", "c: 1_0"]
VALUES = st.sampled_from(["null", "[]", "{}", "1", "-1", "1.5", "true", "x", "'{{ x }}'", "P1D", "/a", "''",
                          "'{{ input.tags }} x'", "[1, [2, [3]]]", "{a: {b: {c: d}}}", "'{{ since }}'", "word"])


@st.composite
def mutated(draw):
    base = draw(st.sampled_from([INBOX, TOOL, SYSTEM, SEED_CHAT, SEED_INBOX]))
    lines = base.split("\n")
    for _ in range(draw(st.integers(1, 5))):
        i = draw(st.integers(0, len(lines) - 1))
        action = draw(st.sampled_from(["delete", "duplicate", "insert", "char", "value"]))
        if action == "delete" and len(lines) > 1:
            del lines[i]
        elif action == "duplicate":
            lines.insert(i, lines[i])
        elif action == "insert":
            lines.insert(i, draw(st.sampled_from(SCRAPS) | st.text(max_size=20)))
        elif action == "char" and lines[i]:
            j = draw(st.integers(0, len(lines[i]) - 1))
            lines[i] = lines[i][:j] + draw(st.characters()) + lines[i][j + 1:]
        elif action == "value" and ":" in lines[i]:
            lines[i] = lines[i].split(":", 1)[0] + ": " + draw(VALUES)
    return "\n".join(lines)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_documents_parse_or_raise_document_error(source):
    try:
        doc = parse_function(source)
    except DocumentError as exc:
        assert exc.problems
        for p in exc.problems:
            assert isinstance(p["line"], int) and 1 <= p["line"] <= source.count("\n") + 2
            assert isinstance(p["field"], str) and isinstance(p["message"], str) and p["message"]
    else:
        assert isinstance(doc.overview, str) and doc.overview


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["", "x", "word", "rest", "text", "/a", "P1D", "PT5S", "oldest_first", "{{ input.owner }}",
                       "{{ sent.id }}", "{{ x | json }}", "string", "object", "approve"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
        ["type", "enum", "from", "words", "server", "tool", "with", "read", "list", "each", "id", "text", "sender",
         "properties", "required", "approve", "verdict", "schema", "sent", "conversation", "tell", "x"]), inner, max_size=3),
    max_leaves=8)


def _paths(tree, path=()):
    yield path
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, path + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _paths(v, path + (i,))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_documents_with_values_of_the_wrong_shape_raise_document_error(data):
    import yaml
    base = data.draw(st.sampled_from([INBOX, TOOL, SYSTEM, SEED_CHAT]))
    front = yaml.safe_load(base.split("---\n")[1])
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from([p for p in _paths(front) if p]))
        node = front
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = data.draw(JSON_VALUES)
    source = "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n" + base.split("---\n", 2)[2]
    try:
        parse_function(source)
    except DocumentError as exc:
        assert all(isinstance(p["line"], int) and p["line"] >= 1 for p in exc.problems)
