"""Reply rules: reading an answer from the words of a reply."""

from __future__ import annotations

import pytest

from interactiond import ReplyRule, RulePart, derive_rule, parse_function

VERDICT = RulePart("word", {"approve": ("yes", "ok", "lgtm"), "revise": ("no",)})
RULE = ReplyRule({"verdict": VERDICT, "note": RulePart("rest")})

SCHEMA = {"type": "object", "required": ["verdict"],
          "properties": {"verdict": {"type": "string", "enum": ["approve", "revise"]}, "note": {"type": "string"}}}


@pytest.mark.parametrize("reply, answer", [
    ("approve", {"verdict": "approve"}),
    ("revise: name the job role", {"verdict": "revise", "note": "name the job role"}),
    ("  Approve   ship it today  ", {"verdict": "approve", "note": "ship it today"}),
    ("APPROVE!", {"verdict": "approve"}),
    ("**approve** fine", {"verdict": "approve", "note": "fine"}),
    ("(revise) needs numbers\nand a chart", {"verdict": "revise", "note": "needs numbers\nand a chart"}),
    ("yes", {"verdict": "approve"}),
    ("OK, go ahead", {"verdict": "approve", "note": "go ahead"}),
    ("LGTM.", {"verdict": "approve"}),
    ("No - not yet", {"verdict": "revise", "note": "- not yet"}),
])
def test_word_and_rest(reply, answer):
    assert RULE.apply(reply) == (answer, [])


@pytest.mark.parametrize("reply", ["maybe later", "approved", "re-vise", "yess"])
def test_a_first_word_that_means_no_value_is_unreadable(reply):
    answer, reasons = RULE.apply(reply)
    assert answer is None
    assert reasons and reply.split()[0] in reasons[0] and "approve or revise" in reasons[0]


@pytest.mark.parametrize("reply", ["", "   ", "\n\t"])
def test_an_empty_reply_is_unreadable(reply):
    assert RULE.apply(reply) == (None, ["the reply is empty"])


def test_a_reply_past_8_kib_is_unreadable():
    answer, reasons = RULE.apply("approve " + "x" * 8192)
    assert answer is None and "8 KiB" in reasons[0]


def test_text_takes_the_whole_reply_stripped():
    rule = ReplyRule({"comment": RulePart("text")})
    assert rule.apply("  Looks good, ship it.\n") == ({"comment": "Looks good, ship it."}, [])


def test_rest_is_left_out_when_nothing_follows():
    rule = ReplyRule({"note": RulePart("rest")})
    assert rule.apply("approve") == ({}, [])
    assert rule.apply("approve now") == ({"note": "now"}, [])


def test_word_text_and_rest_together():
    rule = ReplyRule({"verdict": VERDICT, "note": RulePart("rest"), "raw": RulePart("text")})
    assert rule.apply("no, too long") == ({"verdict": "revise", "note": "too long", "raw": "no, too long"}, [])


def test_describe_and_how_to_answer():
    assert RULE.describe() == ("**verdict** is the first word of the reply: approve (also yes, ok, lgtm) or "
                               "revise (also no). **note** is what the reply says after its first word, if anything.")
    assert RULE.how_to_answer() == ("To answer, reply with approve or revise as the first word; "
                                    "what follows it is kept as the note.")
    text_only = ReplyRule({"comment": RulePart("text")})
    assert text_only.how_to_answer() == "To answer, reply in your own words. The whole reply is kept as the comment."
    assert text_only.describe() == "**comment** is the whole reply."


# The rule made from the schema ####################################################################

def test_a_required_string_with_an_enum_is_read_from_the_first_word():
    rule = derive_rule(SCHEMA)
    assert rule.parts == {"verdict": RulePart("word", {"approve": (), "revise": ()})}
    assert rule.apply("Revise it please") == ({"verdict": "revise"}, [])  # the rest is dropped


def test_a_required_string_without_an_enum_is_the_whole_reply():
    rule = derive_rule({"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}})
    assert rule.parts == {"text": RulePart("text")}
    assert rule.apply(" all good ") == ({"text": "all good"}, [])


@pytest.mark.parametrize("schema", [
    {"type": "object", "required": ["a", "b"], "properties": {"a": {"type": "string"}, "b": {"type": "string"}}},
    {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}},
    {"type": "object", "properties": {"a": {"type": "string"}}},
    {"type": "object", "required": ["a"]},
    {"type": "string"},
    True,
])
def test_no_rule_is_made_otherwise(schema):
    assert derive_rule(schema) is None


def test_an_enum_without_a_type_counts_as_a_string():
    rule = derive_rule({"required": ["v"], "properties": {"v": {"enum": ["up", "down"]}}})
    assert rule.apply("down") == ({"v": "down"}, [])


# Rules written in documents ##########################################################################

DOC = """\
---
to: '{{ input.owner }}'
expires: P1D
deliver:
  server: chat
  tool: post_message
  with: { channel: '{{ to }}', text: '{{ message }}' }
  sent: { conversation: /channel, id: /ts }
replies:
  tool: thread_replies
  with: { channel: '{{ sent.conversation }}', ts: '{{ sent.id }}' }
  read: { list: /messages, order: oldest_first, each: { id: /ts, sender: /user, text: /text } }
reply: RULE
input:
  schema: { type: object, properties: { owner: { type: string } } }
output:
  schema:
    type: object
    required: [verdict]
    properties:
      verdict: { type: string, enum: [approve, revise] }
      note: { type: string }
---
Approve?
"""


def test_a_written_rule_with_yaml_words_that_look_boolean():
    doc = parse_function(DOC.replace("RULE", "{ verdict: { from: word, words: { approve: [yes, y, on], revise: [no, off] } }, note: rest }"))
    rule = doc.reply_rule
    assert rule.parts["verdict"].words == {"approve": ("yes", "y", "on"), "revise": ("no", "off")}
    assert rule.apply("Yes: ship it") == ({"verdict": "approve", "note": "ship it"}, [])
    assert rule.apply("off") == ({"verdict": "revise"}, [])


def test_a_written_rule_with_text_only():
    doc = parse_function(DOC.replace("RULE", "{ verdict: text }").replace("enum: [approve, revise]", "maxLength: 100"))
    assert doc.reply_rule.apply("whatever I say") == ({"verdict": "whatever I say"}, [])


def test_the_written_rule_wins_over_the_one_made_from_the_schema():
    doc = parse_function(DOC.replace("RULE", "{ verdict: word, note: rest }"))
    assert doc.reply_rule.apply("approve with a note") == ({"verdict": "approve", "note": "with a note"}, [])
    doc = parse_function(DOC.replace("reply: RULE\n", ""))
    assert doc.reply_rule.apply("approve with a note") == ({"verdict": "approve"}, [])


def test_values_that_read_as_the_same_word_are_refused():
    from interactiond import DocumentError
    source = DOC.replace("RULE", "{ verdict: word }").replace("enum: [approve, revise]", "enum: [Approve, approve]")
    with pytest.raises(DocumentError) as info:
        parse_function(source)
    assert info.value.problems[0]["field"] == "reply.verdict"
    assert "same word" in info.value.problems[0]["message"]


def test_how_to_answer_without_a_word_names_the_rest():
    rule = ReplyRule({"note": RulePart("rest")})
    assert rule.how_to_answer() == ("To answer, reply in your own words. "
                                    "What follows your first word is kept as the note.")
