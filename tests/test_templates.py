"""Templates: typed rendering, strictness, bounds, and the save-time checks of a place."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from liquid.exceptions import LiquidError

import interactiond as itd
from interactiond import PLACES, RenderError, Template, check_template, render_args

CTX = {
    "input": {"owner": "ana", "limit": 15, "ratio": 0.5, "ok": True, "tags": ["a", "b"], "meta": {"k": 1},
              "nothing": None, "offset": 3},
    "today": "2026-11-30",
    "now": "2026-11-30T03:33:18.123Z",
}


def render_kind(template: Template, method: str = "render", ctx: dict | None = None) -> str:
    with pytest.raises(RenderError) as info:
        getattr(template, method)(CTX if ctx is None else ctx)
    return info.value.kind


# Typed rendering ##################################################################################

@pytest.mark.parametrize("source, value", [
    ("{{ input.limit }}", 15),
    ("{{ input.ratio }}", 0.5),
    ("{{ input.ok }}", True),
    ("{{ input.tags }}", ["a", "b"]),
    ("{{ input.meta }}", {"k": 1}),
    ("{{ input.nothing }}", None),
    ("{{ input.owner }}", "ana"),
    ("{{ input.limit | plus: 1 }}", 16),
    ("{{- input.limit -}}", 15),
    ("{{ input }}", CTX["input"]),
])
def test_a_whole_expression_yields_the_value_itself(source, value):
    template = Template(source)
    assert template.whole
    result = template.render(CTX)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize("source, text", [
    ("limit {{ input.limit }}", "limit 15"),
    (" {{ input.limit }}", " 15"),
    ("{{ input.limit }}{{ input.limit }}", "1515"),
    ("{% if input.ok %}{{ input.owner }}{% endif %}", "ana"),
    ("plain", "plain"),
    ("", ""),
])
def test_anything_else_renders_text(source, text):
    template = Template(source)
    assert not template.whole
    assert template.render(CTX) == text


def test_render_text_is_always_text():
    assert Template("{{ input.limit }}").render_text(CTX) == "15"
    assert Template("{{ input.ok }}").render_text(CTX) == "true"
    assert Template("{{ input.nothing }}").render_text(CTX) == ""


def test_liquid_reserved_words_can_be_read_as_members():
    assert Template("{{ input.limit }}").render(CTX) == 15
    assert Template("at {{ input.offset }} of {{ 'x.limit' }}").render(CTX) == "at 3 of x.limit"
    assert Template("{% for t in input.tags limit: 1 %}{{ t }}{% endfor %}").render(CTX) == "a"


# Strictness ##########################################################################################

@pytest.mark.parametrize("source", ["{{ input.missing }}", "x {{ input.missing }}", "{{ missing }}",
                                    "{% if input.missing %}y{% endif %}", "{{ input.missing | upcase }}"])
def test_an_undefined_name_is_an_error(source):
    template = Template(source)
    assert render_kind(template) == "undefined"
    assert render_kind(template, "render_text") == "undefined"


def test_default_still_works_for_a_missing_name():
    assert Template('{{ input.missing | default: "none" }}').render(CTX) == "none"
    assert Template('{{ since | default: "0" }}').render({"since": ""}) == "0"


@pytest.mark.parametrize("source", ["x {{ input.tags }}", "x {{ input.meta }}", "{% echo input.meta %} y",
                                    "{% for t in input.tags %}{{ input.meta }}{% endfor %}"])
def test_a_structure_inside_text_is_an_error(source):
    assert render_kind(Template(source)) == "structure"


def test_a_whole_expression_rendered_as_text_refuses_a_structure():
    assert render_kind(Template("{{ input.meta }}"), "render_text") == "structure"


def test_json_makes_a_structure_text():
    assert Template("x {{ input.tags | json }}").render(CTX) == 'x ["a", "b"]'
    assert Template("{{ input.meta | json }}").render(CTX) == '{"k": 1}'


def test_a_filter_failing_is_an_error():
    assert render_kind(Template("{{ 1 | divided_by: 0 }}")) == "error"


# Bounds ################################################################################################

def test_loops_are_bounded():
    template = Template("{% for i in (1..100000) %}{% endfor %}done")
    assert render_kind(template) == "limit"


def test_nested_loops_count_together():
    template = Template("{% for i in (1..200) %}{% for j in (1..200) %}{% endfor %}{% endfor %}")
    assert render_kind(template) == "limit"


def test_output_is_bounded():
    template = Template("{% for i in (1..9000) %}0123456789{% endfor %}")
    assert render_kind(template, "render_text") == "limit"
    assert len(Template("{% for i in (1..100) %}0123456789{% endfor %}").render_text(CTX)) == 1000


def test_assigned_values_are_bounded():
    template = Template("{% assign s = 'xx' %}{% for i in (1..20) %}{% assign s = s | append: s %}{% endfor %}")
    assert render_kind(template) == "limit"


# render_args and the context ######################################################################

def test_render_args_renders_templates_and_keeps_values_as_written():
    tree = {"channel": Template("{{ input.owner }}"), "limit": Template("{{ input.limit }}"), "n": 5, "flag": False,
            "none": None, "nested": [Template("#{{ input.owner }}"), {"deep": Template("{{ input.meta }}")}, 1.5]}
    assert render_args(tree, CTX) == {"channel": "ana", "limit": 15, "n": 5, "flag": False, "none": None,
                                      "nested": ["#ana", {"deep": {"k": 1}}, 1.5]}


def test_base_context_gives_today_and_now_from_the_moment():
    moment = int(datetime(2026, 11, 30, 3, 33, 18, 123000, tzinfo=timezone.utc).timestamp() * 1000)
    ctx = itd.base_context(moment, input={"a": 1})
    assert ctx == {"today": "2026-11-30", "now": "2026-11-30T03:33:18.123Z", "input": {"a": 1}}
    assert Template("{{ today }} {{ now }}").render(ctx) == "2026-11-30 2026-11-30T03:33:18.123Z"


def test_a_template_that_does_not_compile_raises_at_construction():
    with pytest.raises(LiquidError):
        Template("{{ input.owner | }}")


# Save-time checks ###################################################################################

SCHEMA = {"type": "object", "properties": {"owner": {"type": "string"}, "tags": {"type": "array"},
                                           "meta": {"type": "object", "properties": {"inner": {"type": "array"}}}}}


def check(source: str, place: str = "message", line: int = 10, schema: object = SCHEMA):
    return check_template(source, line, PLACES[place], schema)


def test_a_good_template_compiles():
    template, problems = check("Hello {{ input.owner }} on {{ today }}")
    assert problems == [] and template.line == 10


def test_a_syntax_error_names_the_line_within_the_template():
    template, problems = check("one\ntwo\n{{ input.owner | }}")
    assert template is None and problems[0][0] == 12 and "compile" in problems[0][1]


def test_an_unclosed_block_is_reported():
    template, problems = check("{% if input.owner %}open")
    assert template is None and problems[0][0] == 10


def test_dollar_brace_is_refused_on_its_line():
    _, problems = check("fine\n${HOME}")
    assert problems == [(11, "a template holds no `${`: a document is never filled from the environment")]


def test_unknown_filter_is_refused_on_its_line():
    _, problems = check("a\n{{ input.owner | shout }}")
    assert problems[0][0] == 11 and "shout" in problems[0][1]


def test_names_are_checked_against_the_place_on_their_line():
    _, problems = check("a\nb {{ message }}")
    assert problems[0][0] == 11 and "`message`" in problems[0][1] and "input, now, request.answer_url, today" in problems[0][1]
    assert check("Answer here: {{ request.answer_url }}")[1] == []
    assert check("{{ request }}")[1] != [] and check("{{ request.id }}")[1] != []
    assert check("{{ sent.id }}{{ since }}", "replies.with")[1] == []
    assert check("{{ sent }}", "replies.with")[1] != []
    assert check("{{ sent.id }}", "message")[1] != []


def test_locals_are_not_names_of_the_place():
    assert check("{% assign x = input.owner %}{{ x }}{% for t in input.tags %}{{ t }}{{ forloop.index }}{% endfor %}")[1] == []


def test_input_properties_are_checked_against_the_schema():
    _, problems = check("{{ input.ownr }}")
    assert "no property 'ownr'" in problems[0][1]
    assert check("{{ input.ownr }}", schema=None)[1] == []
    assert "no property 'other'" in check("{{ input.meta.other }}")[1][0][1]  # the same rule, one level down
    assert check("{{ input.tags.first }}")[1] == []  # a list lists no properties
    closed = {"type": "object", "additionalProperties": False, "properties": {"meta": {
        "type": "object", "additionalProperties": False, "properties": {"a": {"type": "string"}}}}}
    assert "no property 'b'" in check("{{ input.meta.b }}", schema=closed)[1][0][1]


def test_structures_inside_text_are_found_from_the_schema():
    assert "a list inside text" in check("x {{ input.tags }}")[1][0][1]
    assert "an object inside text" in check("x {{ input.meta }}")[1][0][1]
    assert "a list inside text" in check("x {{ input.meta.inner }}")[1][0][1]
    assert check("x {{ input.tags | json }}")[1] == []
    assert check("{{ input.tags }}", "call.with")[1] == []      # typed: sent as the list
    assert check("{{ input.tags }}", "message")[1] != []        # a message is always text


def test_place_table():
    assert PLACES["party"].reads == {"input", "today", "now"}
    assert PLACES["deliver.with"].reads == {"input", "today", "now", "to", "message", "run_id", "function",
                                            "expires_at", "answer_schema", "request.answer_url"}
    assert PLACES["message"].reads == {"input", "today", "now", "request.answer_url"}
    assert PLACES["replies.conversation"].reads == {"to", "sent.conversation", "sent.id"}
    assert PLACES["replies.with"].reads == {"to", "sent.conversation", "sent.id", "conversation", "since"}
    assert PLACES["tell.with"].reads == {"to", "sent.conversation", "sent.id", "message"}


# Plain templates ##################################################################################
#
# A template that only prints names renders without Liquid; whatever the context, its result (or
# its failure, kind and words) is Liquid's.

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_NAMES = ["a", "b", "size", "first", "last", "limit", "x"]
_TEXT = st.text(alphabet="ab \r\n\t-é😀", max_size=8)
_SCALARS = (st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=True) | _TEXT
            | st.sampled_from(["\ud800", "x\r\n", "\r", "y" * (itd.TEMPLATE_OUTPUT_LIMIT // 2 + 1), "ü" * 40_000]))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.sampled_from(_NAMES), inner, max_size=4), max_leaves=8)
_PATHS = st.tuples(st.sampled_from(["input", "input", "input", "today", "request", "partial", "template", "nope"]),
                   st.lists(st.sampled_from(_NAMES), max_size=3))
_TAILS = st.sampled_from(["", "", "", " | upcase", " | size", "[0]", ".first.a"])


@st.composite
def _outputs(draw: st.DrawFn) -> str:
    root, members = draw(_PATHS)
    left, right = draw(st.sampled_from(["{{", "{{-"])), draw(st.sampled_from(["}}", "-}}"]))
    return f"{left} {'.'.join([root, *members])}{draw(_TAILS)} {right}"


_SOURCES = st.lists(_TEXT | _outputs(), min_size=1, max_size=5).map("".join)
_CONTEXTS = st.fixed_dictionaries({"input": _VALUES, "today": _TEXT, "now": _TEXT},
                                  optional={"request": st.dictionaries(st.sampled_from(_NAMES), _VALUES, max_size=2)})


def _outcome(call: Any) -> tuple[Any, ...]:
    try:
        value = call()
    except RenderError as exc:
        return ("error", exc.kind, exc.message)
    return ("value", type(value), value if value == value else "nan")


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_SOURCES, _CONTEXTS)
def test_a_plain_template_renders_as_liquid_does(source, ctx):
    try:
        template = Template(source)
    except Exception:
        return                                    # not a template (Liquid refuses it): nothing to render
    assert _outcome(lambda: template.render_text(ctx)) == _outcome(lambda: template._liquid_text(ctx)), source
    if template.whole:
        assert _outcome(lambda: template.render(ctx)) == _outcome(lambda: template._liquid_value(ctx)), source


@pytest.mark.parametrize("source, plain", [
    ("{{ input.owner }}", True),
    ("Please review this brief:\n\n{{ input.brief }}\n\nApprove it, or ask for a revision.\n", True),
    ("{{- input.a.b -}} and {{ today }}", True),
    ("no names at all", True),
    ("{{ input.owner | upcase }}", False),
    ("{{ input.tags[0] }}", False),
    ("{% if input.ok %}yes{% endif %}", False),
    ("{{ partial }}", False),
])
def test_which_templates_render_without_liquid(source, plain):
    assert Template(source).plain is plain


def test_the_plain_path_gives_liquids_text_and_values():
    message = Template("Brief:\r\n{{ input.brief }}\rend {{ input.n }} {{ input.ok }} {{ input.none }}.")
    ctx = {"input": {"brief": "one\r\ntwo", "n": 1.5, "ok": False, "none": None}}
    assert message.render_text(ctx) == message._liquid_text(ctx) == "Brief:\none\ntwo\nend 1.5 false ."
    to = Template("{{ input.owner }}")
    assert to.render({"input": {"owner": "ana"}}) == "ana"
    assert render_kind(to, ctx={"input": {}}) == "undefined"
    assert render_kind(message, "render_text", {"input": {"brief": {"k": 1}}}) == "structure"
    assert render_kind(message, "render_text", {"input": {"brief": "\ud800", "n": 1, "ok": 1, "none": 1}}) == "error"
    big = {"input": {"brief": "x" * itd.TEMPLATE_OUTPUT_LIMIT, "n": 1, "ok": 1, "none": 1}}
    assert render_kind(message, "render_text", big) == "limit"
