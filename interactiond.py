"""interactiond - ask a person (or a system) a question and wait, durably, for a validated answer.

One asyncio process: an aiohttp HTTP API, an MCP server (stdio, streamable HTTP, SSE), one timer
task, and a WAL-mode SQLite file. Agents and scripts save *interaction functions* (Markdown with
YAML front matter), run them, and wait for the answer a person gives in the inbox, through a chat
tool, or that a system returns.

Run it:

    pip install -e . && interactiond serve        # http://127.0.0.1:8765, ./interactiond.db
    interactiond stdio                             # MCP over stdin/stdout for a local agent
    interactiond check examples/*.md               # validate function documents offline

The module reads top to bottom, each section using only those above it:

    Constants and limits      every bound of the product, with its reason
    Problems                  one exception type carrying an RFC 9457 problem object
    Small parsers             durations, JSON Pointers, ids, the clock, JSON helpers
    Templates                 python-liquid with limits, static analysis, typed rendering
    Documents                 YAML front matter with lines, save-time rules, reply rules, overview
    Store                     SQLite schema, one writer with group commit, reader queries
    Tool servers              MCP client sessions, one owner task per server
    Engine                    runs, requests, deliveries, readings, the timer task
    HTTP API                  aiohttp routes, problem+json, auth, OpenAPI
    MCP server                the same operations as MCP tools over three transports
    Typed API and client      /v2/interactions and interactiond.Client
    Web inbox                 the page a person answers on
    Command line              serve, stdio, check, token, run, inbox, answer
"""

from __future__ import annotations

import base64
import enum
import functools
import hashlib
import json
import math
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, Callable, Final, Iterable

import referencing
import referencing.exceptions
import yaml
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import SchemaError
from liquid import Environment, RenderContext, StrictDefaultUndefined
from liquid.builtin.output import Output, OutputNode
from liquid.builtin.tags.echo_tag import EchoNode, EchoTag
from liquid.exceptions import LiquidError, ResourceLimitError, UndefinedError
from liquid.extra import JSON as LiquidJSON
from liquid.stringify import to_liquid_string
from liquid.undefined import Undefined

__version__ = "0.1.0"

__all__ = [
    "Problem",
    "DocumentError",
    "RunStatus",
    "DeliveryState",
    "parse_duration",
    "parse_function",
    "main",
    "RenderError",
    "Template",
    "render_args",
    "base_context",
    "Shape",
    "FunctionDoc",
    "CallSpec",
    "DeliverSpec",
    "SentSpec",
    "RepliesSpec",
    "ReadSpec",
    "TellSpec",
    "ReplyRule",
    "RulePart",
    "derive_rule",
    "compile_schema",
    "schema_errors",
    "check_documents",
]


# Constants and limits ###########################################################################
#
# Every bound of the product lives here, once, with the reason it has the value it has. The
# function-document bounds come from the behaviour reference; the HTTP ones keep a single
# self-hosted process safe from one careless (or hostile) client.

KIB: Final = 1024
MIB: Final = 1024 * 1024

#: A rendered party (`to`, `from`): short enough to be a name a reader filters by.
MAX_PARTY_BYTES: Final = 256
#: A rendered message: a question a person reads, not a document.
MAX_MESSAGE_BYTES: Final = 8 * KIB
#: The arguments of any tool call, as JSON.
MAX_ARGUMENTS_BYTES: Final = 16 * KIB
#: What `sent` reads, and a conversation key.
MAX_KEY_BYTES: Final = 256
#: A reading tool's whole result; past it the read failed, the reading goes on.
MAX_READ_RESULT_BYTES: Final = 64 * KIB
#: The words of one reply.
MAX_REPLY_BYTES: Final = 8 * KIB
#: A reply rule: values, words a value, bytes a word.
MAX_RULE_VALUES: Final = 16
MAX_RULE_WORDS: Final = 16
MAX_RULE_WORD_BYTES: Final = 64
#: Refused replies of one request: recorded, and told.
MAX_REFUSED_RECORDED: Final = 10
MAX_REFUSED_TOLD: Final = 3
#: What a function's `read` takes with the run's record, and how deep.
MAX_OUTPUT_BYTES: Final = 1 * MIB
MAX_JSON_DEPTH: Final = 512
#: An answer, as JSON.
MAX_ANSWER_BYTES: Final = 64 * KIB
#: `claimed_for`.
MAX_CLAIM_BYTES: Final = 256
#: `description` of a function, in characters.
MAX_DESCRIPTION_CHARS: Final = 1000
#: Open requests of a playbook unless the operator says otherwise (INTERACTION_OPEN_REQUESTS).
DEFAULT_OPEN_REQUESTS: Final = 10_000
#: Any HTTP body; a document or an answer is far smaller.
MAX_BODY_BYTES: Final = 1 * MIB
#: Event payload previews in listings.
PREVIEW_BYTES: Final = 2 * KIB
#: Paging.
DEFAULT_PAGE: Final = 50
MAX_PAGE: Final = 200

#: `expires` of a request, and the floor of the reading cadence.
EXPIRES_MIN: Final = timedelta(minutes=1)
EXPIRES_MAX: Final = timedelta(days=30)
WAIT_MIN: Final = timedelta(seconds=5)
WAIT_MAX: Final = timedelta(hours=1)
WAIT_DEFAULT: Final = timedelta(seconds=5)

#: Delivery attempts: at once, then these gaps after the one before (five attempts in all).
ATTEMPT_GAPS_S: Final = (60, 120, 240, 480)
MAX_ATTEMPTS: Final = len(ATTEMPT_GAPS_S) + 1
#: A server's Retry-After is honoured up to this long for a delivery, and for a read.
MAX_RETRY_AFTER_DELIVERY_S: Final = 8 * 60
MAX_RETRY_AFTER_READ_S: Final = 60 * 60
#: An attempt with no recorded end after a restart counts as failed this long after it started.
LOST_ATTEMPT_S: Final = 60
#: Gaps between reads of a conversation: 5 s after a request joins, 10, 20, 40, then a minute
#: through the 18th read, then five minutes.
READ_GAPS_S: Final = (5, 10, 20, 40) + (60,) * 14
READ_GAP_LATE_S: Final = 300

#: I/O bounds, in real seconds whatever the clock.
OPEN_TIMEOUT_S: Final = 10.0
LIST_TIMEOUT_S: Final = 10.0
CALL_TIMEOUT_S: Final = 30.0
SYSTEM_CALL_TOTAL_S: Final = 70.0
SHUTDOWN_GRACE_S: Final = 10.0
#: Long polls: HTTP `wait` and MCP `wait_run`.
MAX_HTTP_WAIT_S: Final = 60.0
DEFAULT_MCP_WAIT_S: Final = 25.0
MAX_MCP_WAIT_S: Final = 55.0

#: Template rendering: never hangs, never eats memory.
TEMPLATE_LOOP_LIMIT: Final = 10_000
TEMPLATE_OUTPUT_LIMIT: Final = 64 * KIB
TEMPLATE_NAMESPACE_LIMIT: Final = 64 * KIB

#: Names.
PLAYBOOK_RE: Final = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,62})/[a-z0-9](?:[a-z0-9-]{0,62})")
SERVER_RE: Final = re.compile(r"[a-z][a-z0-9-]{0,31}")
TOOL_RE: Final = re.compile(r"[A-Za-z0-9_.-]{1,128}")
FUNCTION_NAME_RE: Final = re.compile(r"[a-z0-9][a-z0-9_-]{0,127}")
RUN_ID_RE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
DEFAULT_PLAYBOOK: Final = "local/default"

#: Where problem types resolve on the daemon itself.
PROBLEM_BASE: Final = "/problems/"


# Problems #######################################################################################
#
# One exception type, `Problem`, carries an RFC 9457 problem object. Every handler (HTTP, MCP,
# command line) turns it into its own envelope with `Problem.body()`; nothing else is serialised
# as an error. A run's ending that is not `succeeded` is also described by a problem, named as
# SPEC section 6 says: the ending for invalid_input/unavailable/failed, the kind for a conflict,
# `unanswered` or `cancelled` for a rejection.

#: name -> (status, title, what it means); /problems/{name} serves these.
PROBLEM_TYPES: Final[dict[str, tuple[int, str, str]]] = {
    "bad_request": (400, "Bad request", "The request could not be read: malformed JSON, a bad cursor, or a missing field."),
    "unauthorized": (401, "Unauthorized", "No valid bearer token or session cookie was given."),
    "forbidden": (403, "Forbidden", "The token's role does not allow this operation."),
    "not_found": (404, "Not found", "The resource does not exist or is not visible to this token."),
    "too_large": (413, "Payload too large", "The request body is larger than the daemon accepts."),
    "invalid_document": (422, "Invalid document", "The document breaks one or more save-time rules; `errors` lists each with its line."),
    "invalid_request": (422, "Invalid request", "A parameter of the call is out of range; `errors` names it."),
    "invalid_input": (422, "Invalid input", "The input, or an answer, does not match its schema, or a template reads a value that is missing."),
    "unworkable": (409, "Unworkable", "What the run would send or record breaks a bound, or the tool's answer cannot be used. Running again does not change that."),
    "effect_unknown": (409, "Effect unknown", "A tool that may change something was called and failed; whether it had an effect is unknown."),
    "tools_called": (409, "Tools called", "A run under this id called its tool and did not succeed; start a new run under a new id."),
    "run_id_taken": (409, "Run id taken", "This run id belongs to a run of another function or another input."),
    "answered": (409, "Already answered", "The request already took a different answer."),
    "not_open": (409, "Not open", "The request has ended or its run is being cancelled."),
    "notification": (409, "Notification", "A notification takes no answer."),
    "conflict": (409, "Conflict", "The operation conflicts with the current state."),
    "unavailable": (503, "Unavailable", "A tool server or a limit of the daemon stopped the run before anything was sent; it may be run again."),
    "unanswered": (410, "Unanswered", "Nobody answered the request before it expired, or a notification could not be delivered."),
    "cancelled": (410, "Cancelled", "The run was cancelled."),
    "failed": (500, "Failed", "The daemon itself broke down while running."),
    "timeout": (408, "Timeout", "A workflow task ran out of time."),
}


class Problem(Exception):
    """An error that the caller can act on, carried as an RFC 9457 problem object."""

    def __init__(
        self,
        name: str,
        detail: str,
        *,
        status: int | None = None,
        kind: str | None = None,
        errors: list[dict[str, Any]] | None = None,
        title: str | None = None,
        code: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        known = PROBLEM_TYPES.get(name)
        self.name = name
        self.status = status if status is not None else (known[0] if known else 400)
        self.title = title or (known[1] if known else name.replace("_", " ").capitalize())
        self.detail = detail
        self.kind = kind
        self.errors = errors
        self.code = code
        self.extra = extra or {}
        super().__init__(detail)

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": PROBLEM_BASE + self.name,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        if self.kind is not None:
            out["kind"] = self.kind
        if self.code is not None:
            out["code"] = self.code
        if self.errors is not None:
            out["errors"] = self.errors
        out.update(self.extra)
        return out

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> "Problem":
        name = str(body.get("type", "failed")).rsplit("/", 1)[-1] or "failed"
        extra = {k: v for k, v in body.items() if k not in {"type", "title", "status", "detail", "kind", "errors", "code"}}
        return cls(name, str(body.get("detail", "")), status=body.get("status"), kind=body.get("kind"),
                   errors=body.get("errors"), title=body.get("title"), code=body.get("code"), extra=extra)


def bad_request(detail: str, **kw: Any) -> Problem:
    return Problem("bad_request", detail, **kw)


def not_found(detail: str = "The resource does not exist or is not visible to this token.") -> Problem:
    return Problem("not_found", detail)


class RunStatus(str, enum.Enum):
    """Where a run stands. The first two are live; the rest are endings, each final."""

    STARTED = "started"            # accepted; nothing to wait for yet, or a system call in flight
    WAITING = "waiting"            # a request is open (or a workflow waits on a child or a timer)
    SUCCEEDED = "succeeded"        # the answer, the delivered notification, or the tool's answer
    INVALID_INPUT = "invalid_input"
    CONFLICT = "conflict"
    UNAVAILABLE = "unavailable"
    REJECTED = "rejected"          # unanswered (expired, undelivered) or cancelled
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        return self not in (RunStatus.STARTED, RunStatus.WAITING)


#: HTTP status of a run object by its status (201 replaces 200 when the run just ran).
RUN_HTTP_STATUS: Final = {
    RunStatus.STARTED: 202, RunStatus.WAITING: 202, RunStatus.SUCCEEDED: 200,
    RunStatus.INVALID_INPUT: 422, RunStatus.CONFLICT: 409, RunStatus.UNAVAILABLE: 503,
    RunStatus.REJECTED: 410, RunStatus.FAILED: 500,
}


class DeliveryState(str, enum.Enum):
    """How a request's delivery stands, as list_interactions shows it."""

    IN_INBOX = "in_inbox"          # no deliver: waits in the inbox
    TO_DELIVER = "to_deliver"      # an attempt is due
    DELIVERING = "delivering"      # an attempt is in flight
    DELIVERED = "delivered"        # an attempt succeeded
    RETRYING = "retrying"          # an attempt failed; the next is scheduled
    UNDELIVERED = "undelivered"    # every attempt failed (a question stays open in the inbox)
    CANCELLING = "cancelling"      # cancel asked; an attempt in flight finishes first


def ending_problem(status: RunStatus, kind: str | None, detail: str, **kw: Any) -> Problem:
    """The problem that describes a run's ending (SPEC section 6 names)."""
    if status is RunStatus.CONFLICT:
        name = kind or "conflict"
    elif status is RunStatus.REJECTED:
        name = "cancelled" if kind == "cancelled" else "unanswered"
    else:
        name = status.value
    return Problem(name, detail, status=RUN_HTTP_STATUS[status], kind=kind, **kw)


# Small parsers ##################################################################################
#
# Durations, JSON Pointers, identifiers, the clock and JSON helpers: pure functions that the
# documents, the store and the engine share.

_DURATION_RE: Final = re.compile(
    r"P(?!$)(?:(?P<weeks>\d+)W)?(?:(?P<days>\d+)D)?"
    r"(?:T(?=\d)(?:(?P<hours>\d+)H)?(?:(?P<minutes>\d+)M)?(?:(?P<seconds>\d+(?:\.\d+)?)S)?)?",
    re.ASCII,
)


def parse_duration(text: str) -> timedelta:
    """An ISO 8601 duration of weeks, days, hours, minutes and seconds (`PT5S`, `P2D`, `P1W`).

    Months and years are refused: they have no fixed length.
    """
    if not isinstance(text, str):
        raise ValueError("a duration is a text such as PT5M or P2D")
    m = _DURATION_RE.fullmatch(text.strip().upper())
    if not m:
        raise ValueError(f"{text!r} is not an ISO 8601 duration such as PT30S, PT4H or P2D (months and years are not allowed)")
    return timedelta(**{k: float(v) for k, v in m.groupdict().items() if v is not None})


def duration_words(td: timedelta) -> str:
    """`P2D` -> "2 days", `PT1H30M` -> "1 hour 30 minutes"."""
    total = int(td.total_seconds())
    parts = []
    for unit, size in (("week", 604800), ("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
        n, total = divmod(total, size)
        if n:
            parts.append(f"{n} {unit}{'s' if n != 1 else ''}")
    return " ".join(parts) or "0 seconds"


def pointer_parse(pointer: str) -> list[str]:
    """RFC 6901: "" is the whole document; otherwise "/a/b~1c/~0d" -> ["a", "b/c", "~d"]."""
    if not isinstance(pointer, str):
        raise ValueError("a JSON Pointer is a text such as /messages")
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise ValueError(f"JSON Pointer {pointer!r} must start with a slash, such as /messages")
    parts = pointer[1:].split("/")
    for part in parts:
        if re.search(r"~(?![01])", part):
            raise ValueError(f"JSON Pointer {pointer!r} writes '~' as '~0' and '/' within a name as '~1'")
    return [p.replace("~1", "/").replace("~0", "~") for p in parts]


def pointer_join(parts: Iterable[Any]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


_MISSING: Final = object()


def pointer_get(doc: Any, pointer: str | list[str], default: Any = _MISSING) -> Any:
    """The value at `pointer`, or `default` (LookupError when none is given) where nothing is."""
    parts = pointer_parse(pointer) if isinstance(pointer, str) else pointer
    cur = doc
    for part in parts:
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and re.fullmatch(r"0|[1-9][0-9]*", part) and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            if default is _MISSING:
                raise LookupError(f"nothing at {pointer_join(parts) if not isinstance(pointer, str) else pointer}")
            return default
    return cur


_CROCKFORD: Final = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


class _Ulid:
    """Monotonic ULIDs: 48 bits of wall-clock milliseconds, 80 bits that increase within one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ms = -1
        self._last_rand = 0

    def __call__(self) -> str:
        with self._lock:
            ms = int(time.time() * 1000)
            if ms <= self._last_ms:
                ms = self._last_ms
                self._last_rand += 1
            else:
                self._last_rand = int.from_bytes(secrets.token_bytes(10), "big") >> 1
            self._last_ms = ms
            value = (ms << 80) | (self._last_rand & ((1 << 80) - 1))
        return "".join(_CROCKFORD[(value >> (5 * i)) & 31] for i in range(25, -1, -1))


new_ulid: Final = _Ulid()


def new_run_id() -> str:
    return "run_" + new_ulid()


def new_token_secret() -> str:
    return "itd_" + secrets.token_urlsafe(32)


def sha256_hex(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()


def dumps(value: Any) -> str:
    """Compact JSON, as stored and as measured against the byte bounds."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def json_size(value: Any) -> int:
    return len(dumps(value).encode())


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of a JSON value, stopping early once past `limit`."""
    stack = [(value, 1)]
    deepest = 0
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def has_control_char(text: str) -> bool:
    return any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 for c in text)


# The clock. Every schedule of the product reads one clock object; `ManualClock` stands still
# until told to move, so tests and demos show a two-day expiry in a second. Times are integer
# milliseconds since the epoch, in the database and in memory; RFC 3339 only at the edges.

class SystemClock:
    manual = False

    def now_ms(self) -> int:
        return int(time.time() * 1000)

    def on_change(self, callback: Callable[[], None]) -> None:
        """The real clock only moves forward by itself; nobody needs telling."""


class ManualClock:
    manual = True

    def __init__(self, start_ms: int | None = None) -> None:
        self._now = start_ms if start_ms is not None else int(time.time() * 1000)
        self._listeners: list[Callable[[], None]] = []

    def now_ms(self) -> int:
        return self._now

    def advance(self, delta: timedelta | float) -> int:
        ms = int((delta.total_seconds() if isinstance(delta, timedelta) else delta) * 1000)
        if ms < 0:
            raise ValueError("the clock only moves forward")
        self._now += ms
        for cb in list(self._listeners):
            cb()
        return self._now

    def on_change(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)


def fmt_time(ms: int | None) -> str | None:
    """RFC 3339 UTC with milliseconds: 2026-11-30T03:33:18.123Z."""
    if ms is None:
        return None
    dt = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def fmt_date(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d")


def encode_cursor(values: list[Any]) -> str:
    return base64.urlsafe_b64encode(dumps(values).encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> list[Any]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        values = json.loads(raw)
        if not isinstance(values, list):
            raise ValueError
        return values
    except Exception:
        raise bad_request("The cursor does not decode; pass next_cursor from the previous page as it came.") from None


def check_limit(limit: Any) -> int:
    if limit is None or limit == "":
        return DEFAULT_PAGE
    try:
        n = int(limit)
    except (TypeError, ValueError):
        n = -1
    if isinstance(limit, bool) or not 1 <= n <= MAX_PAGE or (isinstance(limit, float) and limit != n):
        raise Problem("invalid_request", f"limit is between 1 and {MAX_PAGE}",
                      errors=[{"pointer": "/limit", "message": f"must be an integer from 1 to {MAX_PAGE}"}])
    return n


# Templates ######################################################################################
#
# Every text of a function that can differ from run to run is a Liquid template: `to`, `from`,
# the message, and each string inside a `with` tree. All of them compile in one locked-down
# environment, `LIQUID`:
#
#   - strict: reading a name that is not there is an error (`| default:` still works), so is a
#     filter that does not exist; nothing is HTML-escaped, and there is no other template to
#     `include` or `render`, so no template reads a file;
#   - bounded: loop iterations, output size and assigned values are capped (TEMPLATE_*), so a
#     render never hangs and never eats memory;
#   - known in advance: a template lists the names it reads (the library's static analysis), so
#     `check_template` refuses, when the document is saved, a name its place does not offer, a
#     property the input schema does not allow, or an object printed inside text.
#
# Rendering is typed. A template that is exactly one `{{ expression }}` yields the value itself
# (a number stays a number, an object stays an object); any other template renders text, and an
# object or a list printed inside that text is an error (kind "structure") rather than Python's
# idea of how it looks. Every failure of a render is one `RenderError` whose `kind` tells the
# engine how the run ends.

_RENDER_KINDS: Final = frozenset({"undefined", "structure", "limit", "error"})


class RenderError(Exception):
    """A template could not render: `kind` is undefined, structure, limit or error."""

    def __init__(self, kind: str, message: str) -> None:
        assert kind in _RENDER_KINDS, kind
        super().__init__(message)
        self.kind = kind
        self.message = message


class _StructureError(LiquidError):
    """An object or a list was printed inside text."""


def _write_text(node: OutputNode, context: RenderContext, buffer: Any) -> int:
    value = node.expression.evaluate(context)
    if not _is_undefined(value) and isinstance(value, (Mapping, list, tuple)):
        what = "an object" if isinstance(value, Mapping) else "a list"
        raise _StructureError(f"{node.expression} is {what}; write `| json` to put it in text", token=node.token)
    return buffer.write(to_liquid_string(value, context.autoescape))


class _OutputNode(OutputNode):
    __slots__ = ()

    def render_to_output(self, context: RenderContext, buffer: Any) -> int:
        return _write_text(self, context, buffer)


class _EchoNode(EchoNode):
    __slots__ = ()

    def render_to_output(self, context: RenderContext, buffer: Any) -> int:
        return _write_text(self, context, buffer)


class _Output(Output):
    node_class = _OutputNode


class _Echo(EchoTag):
    node_class = _EchoNode


class _LiquidEnv(Environment):
    loop_iteration_limit = TEMPLATE_LOOP_LIMIT
    output_stream_limit = TEMPLATE_OUTPUT_LIMIT
    local_namespace_limit = TEMPLATE_NAMESPACE_LIMIT
    context_depth_limit = 10
    block_nesting_limit = 20

    def error(self, exc: Any, msg: str | None = None, token: Any = None) -> None:
        # python-liquid 2.3.6 gives errors found at the end of an expression a token with no
        # position; the enclosing token has one, and the line is what a document's author needs.
        if (isinstance(exc, LiquidError) and token is not None and token.start_index >= 0
                and (exc.token is None or exc.token.start_index < 0)):
            exc.token = token
        super().error(exc, msg, token)


def _make_liquid() -> Environment:
    env = _LiquidEnv(undefined=StrictDefaultUndefined, strict_filters=True, autoescape=False)
    env.add_tag(_Output)
    env.add_tag(_Echo)
    for name in ("include", "render"):
        env.tags.pop(name, None)
    env.filters["json"] = LiquidJSON(default=str)
    return env


#: The one environment every template compiles in.
LIQUID: Final = _make_liquid()


def _render_error(exc: BaseException) -> RenderError:
    message = str(exc.message) if isinstance(exc, LiquidError) else f"{type(exc).__name__}: {exc}"
    if isinstance(exc, UndefinedError):
        return RenderError("undefined", message)
    if isinstance(exc, _StructureError):
        return RenderError("structure", message)
    if isinstance(exc, ResourceLimitError):
        return RenderError("limit", message)
    return RenderError("error", message)


def _is_undefined(value: Any) -> bool:
    # isinstance() would ask the value for its __class__, which a strict undefined refuses.
    return issubclass(type(value), Undefined)


def _plain(value: Any) -> Any:
    """A rendered value as JSON data: Liquid's own types become numbers, lists and text."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RenderError("error", f"{value} is not a number JSON can carry")
        return value
    if isinstance(value, Decimal):
        return _plain(int(value) if value == value.to_integral_value() else float(value))
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return to_liquid_string(value, False)


#: Words python-liquid 2 reserves inside expressions even after a dot, where Liquid lets a path
#: use them (`input.limit`); they are rewritten as `input["limit"]` before compiling.
_RESERVED_MEMBER_RE: Final = re.compile(
    r"(\"[^\"]*\"|'[^']*')|(?<=[\w\]?])\.(true|false|nil|null|empty|blank|and|or|contains|not|in|offset"
    r"|limit|reversed|cols|continue|with|for|as|if|else|required)(?![\w?-])")
_LIQUID_MARKUP_RE: Final = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.S)


def _unreserve(source: str) -> str:
    def member(m: re.Match[str]) -> str:
        return m.group(1) or f'["{m.group(2)}"]'
    return _LIQUID_MARKUP_RE.sub(lambda m: _RESERVED_MEMBER_RE.sub(member, m.group(0)), source)


class Template:
    """A compiled template and the line of the document it starts on."""

    __slots__ = ("source", "line", "_bound", "_whole")

    def __init__(self, source: str, line: int = 1) -> None:
        self.source = source
        self.line = line
        self._bound = LIQUID.from_string(_unreserve(source))  # LiquidError when it does not compile
        nodes = self._bound.nodes
        self._whole = nodes[0] if len(nodes) == 1 and isinstance(nodes[0], _OutputNode) else None

    def __repr__(self) -> str:
        return f"Template({self.source!r}, line={self.line})"

    @property
    def whole(self) -> bool:
        """True when the template is exactly one `{{ expression }}` (it renders a typed value)."""
        return self._whole is not None

    @property
    def roots(self) -> frozenset[str]:
        """The top-level names the template reads (`input`, `today`, `sent`, ...)."""
        return frozenset(self._bound.global_variables())

    def render(self, ctx: Mapping[str, Any]) -> Any:
        """The value of a whole expression, typed; the rendered text of anything else."""
        if self._whole is None:
            return self.render_text(ctx)
        expr = self._whole.expression
        try:
            value = expr.evaluate(RenderContext(self._bound, globals=ctx))
        except Exception as exc:
            raise _render_error(exc) from None
        if _is_undefined(value):
            raise RenderError("undefined", f"{expr} is undefined")
        return _plain(value)

    def render_text(self, ctx: Mapping[str, Any]) -> str:
        """The rendered text, whatever the template is."""
        try:
            return self._bound.render(ctx)
        except Exception as exc:
            raise _render_error(exc) from None


def render_args(tree: Any, ctx: Mapping[str, Any]) -> Any:
    """Render a `with` tree: its templates as `Template.render` does, anything else as written."""
    if isinstance(tree, Template):
        return tree.render(ctx)
    if isinstance(tree, dict):
        return {k: render_args(v, ctx) for k, v in tree.items()}
    if isinstance(tree, list):
        return [render_args(v, ctx) for v in tree]
    return tree


def base_context(now_ms: int, **extra: Any) -> dict[str, Any]:
    """The names every template may read at the moment `now_ms`, plus `extra`."""
    return {"today": fmt_date(now_ms), "now": fmt_time(now_ms), **extra}


@dataclass(frozen=True, slots=True)
class Place:
    """Where a template sits in a document: the names it reads and whether it is always text."""

    reads: frozenset[str]   # roots (`input`) and members (`sent.id`) the place offers
    text: bool = False      # to, from, the message and the conversation key render text only

    def allows(self, segments: list[Any]) -> bool:
        root = str(segments[0])
        if root in self.reads:
            return True
        return len(segments) > 1 and isinstance(segments[1], str) and f"{root}.{segments[1]}" in self.reads

    def offered(self) -> str:
        return ", ".join(sorted(self.reads))


_RUN_NAMES: Final = frozenset({"input", "today", "now"})
_SENT_NAMES: Final = frozenset({"to", "sent.conversation", "sent.id"})

#: The names each place of a document reads (the behaviour reference's table).
PLACES: Final[dict[str, Place]] = {
    "party": Place(_RUN_NAMES, text=True),
    "message": Place(_RUN_NAMES, text=True),
    "call.with": Place(_RUN_NAMES),
    "deliver.with": Place(_RUN_NAMES | {"to", "message", "run_id", "function", "expires_at", "answer_schema"}),
    "replies.conversation": Place(_SENT_NAMES, text=True),
    "replies.with": Place(_SENT_NAMES | {"conversation", "since"}),
    "tell.with": Place(_SENT_NAMES | {"message"}),
}

#: Filters whose result is still a list: printing it inside text is the same mistake.
_LIST_FILTERS: Final = frozenset({"compact", "concat", "map", "reverse", "sort", "sort_natural",
                                  "uniq", "where", "split", "slice"})


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _schema_member(schema: Any, name: Any) -> tuple[Any, str | None]:
    """The subschema of property `name`, and why the name is refused (None when it is not).

    A name is refused where the schema lists `properties` without it and does not say, with
    `additionalProperties: true` or a schema, that others are welcome (SPEC section 4). Where the
    schema composes others (allOf, $ref, ...) nothing is known and nothing is refused.
    """
    if not isinstance(schema, dict) or not isinstance(name, str):
        return None, None
    if any(k in schema for k in ("$ref", "$dynamicRef", "allOf", "anyOf", "oneOf", "if")):
        return None, None
    props = schema.get("properties")
    if isinstance(props, dict) and name in props:
        return props[name], None
    for pattern, sub in (schema.get("patternProperties") or {}).items():
        try:
            if re.search(pattern, name):
                return sub, None
        except re.error:
            return None, None
    extra = schema.get("additionalProperties")
    if isinstance(props, dict) and extra is not True and not isinstance(extra, dict):
        listed = ", ".join(sorted(props)) or "none"
        return None, f"the input schema has no property {name!r} (its properties: {listed})"
    return (extra if isinstance(extra, dict) else None), None


def _input_path_problem(segments: list[Any], schema: Any) -> tuple[str | None, Any]:
    """Walk `input.a.b` through the input schema: the refusal, if any, and the schema reached."""
    for seg in segments[1:]:
        if isinstance(seg, int) or (isinstance(seg, str) and seg.lstrip("-").isdigit()):
            schema = schema.get("items") if isinstance(schema, dict) and isinstance(schema.get("items"), dict) else None
            continue
        if not isinstance(seg, str):
            return None, None
        schema, refusal = _schema_member(schema, seg)
        if refusal:
            return refusal, None
        if schema is None:
            return None, None
    return None, schema


def _line_of(source: str, index: int) -> int:
    return source.count("\n", 0, max(index, 0))


def _walk_outputs(bound: Any) -> Iterable[OutputNode]:
    static = RenderContext(bound)
    stack = list(bound.nodes)
    while stack:
        node = stack.pop()
        if isinstance(node, OutputNode):
            yield node
        stack.extend(node.children(static, include_partials=False))


def _path_of(expr: Any) -> list[Any] | None:
    left = getattr(expr, "left", None)
    path = getattr(left, "path", None)
    return path if isinstance(path, list) and path and isinstance(path[0], str) else None


def check_template(source: str, line: int, place: Place,
                   input_schema: Any = None) -> tuple[Template | None, list[tuple[int, str]]]:
    """Compile `source` for `place`; the template, or the problems as (line, message) pairs."""
    problems: list[tuple[int, str]] = []
    if "${" in source:
        problems.append((line + _line_of(source, source.index("${")),
                         "a template holds no `${`: a document is never filled from the environment"))
    try:
        template = Template(source, line)
    except LiquidError as exc:
        where = exc.context()
        problems.append((line + (where[0] - 1 if where else 0), f"the template does not compile: {exc.message}"))
        return None, problems
    except RecursionError:
        return None, problems + [(line, "the template nests too deeply")]
    compiled = _unreserve(source)  # what the analysis indexes into; it has the same lines
    analysis = template._bound.analyze(include_partials=False)
    for name, spans in analysis.filters.items():
        if name not in LIQUID.filters:
            problems.append((line + _line_of(compiled, spans[0].index), f"there is no filter {name!r}"))
    for refs in analysis.globals.values():
        for var in refs:
            at = line + _line_of(compiled, var.span.index)
            if not place.allows(var.segments):
                problems.append((at, f"`{var}` is not a name this place reads; it reads {place.offered()}"))
            elif var.segments[0] == "input" and input_schema is not None:
                refusal, _ = _input_path_problem(var.segments, input_schema)
                if refusal:
                    problems.append((at, f"`{var}`: {refusal}"))
    if input_schema is not None and (place.text or not template.whole):
        problems.extend(_structure_problems(template, compiled, line, input_schema))
    return (None if problems else template), problems


def _structure_problems(template: Template, compiled: str, line: int, input_schema: Any) -> list[tuple[int, str]]:
    """Input objects and lists printed inside text, found from the input schema."""
    out = []
    for node in _walk_outputs(template._bound):
        expr = node.expression
        path = _path_of(expr)
        filters = getattr(expr, "filters", None) or []
        if path is None or path[0] != "input" or (filters and filters[-1].name not in _LIST_FILTERS):
            continue
        _, schema = _input_path_problem(path, input_schema)
        kinds = _schema_types(schema) & {"object", "array"}
        if kinds:
            what = "an object" if "object" in kinds else "a list"
            at = line + _line_of(compiled, node.token.start_index)
            out.append((at, f"`{expr}` is {what} inside text; write `{{{{ {'.'.join(map(str, path))} | json }}}}`"))
    return out


# Documents ######################################################################################
#
# A function document is Markdown: YAML front matter between two `---` lines, then the message.
# `parse_function` turns one into a frozen `FunctionDoc` in three steps, and never stops at the
# first problem: every problem comes back together in one `DocumentError`, each with the line
# of the source it was written on (line 1 is the opening `---`) and its field (`deliver.with.text`).
#
#   1. Split and compose. The front matter is composed, not loaded: a SafeLoader that knows only
#      YAML 1.2's plain scalars (`yes` stays text), refuses anchors, aliases and tags, and hands
#      back nodes with their marks. `_Reader.construct` builds plain JSON data from them, refusing
#      a duplicate key, and records the line of every field in `where`.
#   2. Check. One reader function per block (`call`, `deliver`, `replies`, `reply`, schemas)
#      applies the save-time rules of the behaviour reference: which fields each shape takes,
#      names, pointers, durations, bounds, JSON Schemas, the reply rule.
#   3. Compile. Each template is compiled for its place (Templates, above); a `with` tree keeps
#      its numbers and structure as written and holds `Template` objects where it had strings.
#
# The overview, the function in plain words, is written from the checked document. Answers and
# inputs are checked at run time by validators compiled once (`compile_schema`, cached), whose
# errors come back as JSON Pointers (`schema_errors`).

class Shape(str, enum.Enum):
    """What a run of the function does."""

    SYSTEM = "system"   # calls one tool and returns part of its answer
    INBOX = "inbox"     # asks a person through the playbook's inbox
    TOOL = "tool"       # asks a person through a tool such as a chat's


# JSON Schemas. Draft 2020-12 unless the schema's `$schema` names another dialect; formats are
# asserted; references resolve within the schema only: an empty registry means a remote `$ref` is
# never fetched (jsonschema's default registry would fetch it).

@functools.lru_cache(maxsize=1024)
def _compiled_schema(text: str) -> Any:
    schema = json.loads(text)
    cls = validators.validator_for(schema, default=Draft202012Validator)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER, registry=referencing.Registry())


def compile_schema(schema: Any) -> Any:
    """A validator for `schema`, compiled once per distinct schema. Raises SchemaError."""
    return _compiled_schema(dumps(schema))


def schema_errors(validator: Any, instance: Any, prefix: str = "") -> list[dict[str, str]]:
    """Every way `instance` fails, as `{"pointer", "message"}`; pointers start with `prefix`.

    A missing required member is pointed at itself, not at the object that lacks it.
    """
    try:
        errors = list(validator.iter_errors(instance))
    except referencing.exceptions.Unresolvable as exc:
        return [{"pointer": prefix, "message": f"the schema refers to {exc.ref!r}, which it does not hold"}]
    seen: dict[tuple[Any, ...], int] = {}
    out = []
    for err in errors:
        path = list(err.absolute_path)
        if err.validator == "required" and isinstance(err.instance, dict):
            missing = [p for p in err.validator_value if p not in err.instance]
            key = (tuple(path), tuple(err.absolute_schema_path))
            nth = seen.get(key, 0)
            seen[key] = nth + 1
            path += missing[nth:nth + 1]
        out.append({"pointer": prefix + pointer_join(path), "message": err.message})
    return sorted(out, key=lambda e: e["pointer"])


def _schema_problem(schema: Any) -> tuple[tuple[Any, ...], str] | None:
    """Why `schema` cannot be used, as (where within it, message), or None."""
    if isinstance(schema, dict) and "$schema" in schema and (
            not isinstance(schema["$schema"], str) or validators.validator_for(schema, default=None) is None):
        return ("$schema",), f"{schema['$schema']!r} is not a JSON Schema dialect this daemon knows"
    cls = validators.validator_for(schema, default=Draft202012Validator)
    try:
        cls.check_schema(schema)
    except SchemaError as exc:
        return tuple(exc.absolute_path), f"not a valid JSON Schema: {exc.message}"
    entries = list(_schema_entries(schema, ()))
    if any(key == "$id" for _, key, _ in entries):
        return None   # relative references may name an embedded $id; they resolve within the schema or fail
    for path, key, value in entries:
        if key in ("$ref", "$dynamicRef") and isinstance(value, str) and not value.startswith("#"):
            return path + (key,), f"{value!r} is outside the schema; references are never fetched, so use #/$defs/..."
    return None


def _schema_entries(node: Any, path: tuple[Any, ...]) -> Iterable[tuple[tuple[Any, ...], str, Any]]:
    """Every (path, key, value) of the mappings within a schema."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield path, k, v
            yield from _schema_entries(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _schema_entries(v, path + (i,))


# Reply rules. A rule maps top-level string properties of the answer to where in a reply their
# value comes from: the first word (matched against the enum values and their listed words,
# without case or surrounding punctuation), the rest after it, or the whole text.

_PART_SOURCES: Final = ("word", "rest", "text")


def _word_key(word: str) -> str:
    return re.sub(r"^[\W_]+|[\W_]+$", "", word).casefold()


@dataclass(frozen=True, slots=True)
class RulePart:
    """Where one property comes from; for `word`, each enum value and the words that mean it."""

    source: str                                    # "word", "rest" or "text"
    words: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplyRule:
    """Reads an answer from the words of a reply."""

    parts: dict[str, RulePart]

    @functools.cached_property
    def _lookup(self) -> dict[str, dict[str, str]]:
        table: dict[str, dict[str, str]] = {}
        for name, part in self.parts.items():
            if part.source == "word":
                found: dict[str, str] = {}
                for value, words in part.words.items():
                    for word in (value, *words):
                        found.setdefault(_word_key(word), value)
                table[name] = found
        return table

    def apply(self, text: str) -> tuple[dict[str, str] | None, list[str]]:
        """The answer a reply gives, or None and the reasons it cannot be read."""
        whole = (text or "").strip()
        if not whole:
            return None, ["the reply is empty"]
        if len(whole.encode()) > MAX_REPLY_BYTES:
            return None, [f"the reply is longer than {MAX_REPLY_BYTES // KIB} KiB"]
        pieces = whole.split(None, 1)
        first, rest = pieces[0], (pieces[1].strip() if len(pieces) > 1 else "")
        answer: dict[str, str] = {}
        reasons = []
        for name, part in self.parts.items():
            if part.source == "text":
                answer[name] = whole
            elif part.source == "rest":
                if rest:
                    answer[name] = rest
            elif (value := self._lookup[name].get(_word_key(first))) is not None:
                answer[name] = value
            else:
                reasons.append(f"the first word, {first!r}, is not one of {_or_list(part.words)}")
        return (None, reasons) if reasons else (answer, [])

    def describe(self) -> str:
        """The rule in plain words, for the overview."""
        out = []
        for name, part in self.parts.items():
            if part.source == "word":
                values = [v + (f" (also {', '.join(w)})" if w else "") for v, w in part.words.items()]
                out.append(f"**{name}** is the first word of the reply: {_or_list(values)}.")
            elif part.source == "rest":
                out.append(f"**{name}** is what the reply says after its first word, if anything.")
            else:
                out.append(f"**{name}** is the whole reply.")
        return " ".join(out)

    def how_to_answer(self) -> str:
        """What a party is told when a reply was not an answer."""
        word = next((p for p in self.parts.values() if p.source == "word"), None)
        kept = " and the ".join(n for n, p in self.parts.items() if p.source == "rest")
        whole = [n for n, p in self.parts.items() if p.source == "text"]
        if word:
            text = f"To answer, reply with {_or_list(word.words)} as the first word"
            text += f"; what follows it is kept as the {kept}." if kept else "."
        else:
            text = "To answer, reply in your own words."
            text += f" What follows your first word is kept as the {kept}." if kept else ""
        if whole:
            text += f" The whole reply is kept as the {' and the '.join(whole)}."
        return text


def _or_list(items: Iterable[str]) -> str:
    """["a", "b", "c"] -> "a, b or c"."""
    items = list(items)
    if len(items) < 2:
        return items[0] if items else "nothing"
    return ", ".join(items[:-1]) + " or " + items[-1]


def _string_property(schema: Any, name: str) -> dict[str, Any] | None:
    """The schema of top-level property `name` when it is a string, else None."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    prop = props.get(name) if isinstance(props, dict) else None
    if not isinstance(prop, dict):
        return None
    types = _schema_types(prop)
    if "string" in types:
        return prop
    enum_ = prop.get("enum")
    if not types and isinstance(enum_, list) and enum_ and all(isinstance(v, str) for v in enum_):
        return prop
    return prop if not types and isinstance(prop.get("const"), str) else None


def _enum_strings(prop: dict[str, Any]) -> list[str]:
    values = prop.get("enum") if isinstance(prop.get("enum"), list) else [prop["const"]] if "const" in prop else []
    return [v for v in values if isinstance(v, str)]


def derive_rule(schema: Any) -> ReplyRule | None:
    """The rule made from an answer schema with exactly one required property, a string."""
    required = schema.get("required") if isinstance(schema, dict) else None
    if not (isinstance(required, list) and len(required) == 1 and isinstance(required[0], str)):
        return None
    prop = _string_property(schema, required[0])
    if prop is None:
        return None
    values = _enum_strings(prop)
    part = RulePart("word", {v: () for v in values}) if values else RulePart("text")
    return ReplyRule({required[0]: part})


# The document, checked and compiled.

@dataclass(frozen=True, slots=True)
class CallSpec:
    server: str
    tool: str
    with_: Any                  # the arguments, with Template objects in place of strings
    read: str | None            # JSON Pointer into the answer; None is the whole answer
    reads_input: bool           # whether any argument reads `input`


@dataclass(frozen=True, slots=True)
class SentSpec:
    conversation: str           # JSON Pointers into the sending tool's answer
    id: str


@dataclass(frozen=True, slots=True)
class DeliverSpec:
    server: str
    tool: str
    with_: Any
    sent: SentSpec | None


@dataclass(frozen=True, slots=True)
class ReadSpec:
    list: str                   # pointer to the list of messages
    order: str                  # "oldest_first" or "newest_first"
    each: dict[str, str]        # id, sender, text and optionally to: pointers within a message


@dataclass(frozen=True, slots=True)
class TellSpec:
    tool: str
    with_: Any


@dataclass(frozen=True, slots=True)
class RepliesSpec:
    conversation: Template
    tool: str
    with_: Any
    read: ReadSpec
    wait: timedelta
    tell: TellSpec | None


@dataclass(frozen=True)
class FunctionDoc:
    """A checked function document, its templates compiled."""

    source: str
    shape: Shape
    description: str | None
    to: Template | None
    from_: Template | None
    message: Template | None
    expires: timedelta | None
    expires_text: str | None
    input_schema: Any
    output_schema: Any
    call: CallSpec | None
    deliver: DeliverSpec | None
    replies: RepliesSpec | None
    reply_rule: ReplyRule | None    # the rule in force: written, or made from output.schema
    overview: str = ""

    @property
    def is_notification(self) -> bool:
        return self.output_schema is None and self.shape is not Shape.SYSTEM

    @functools.cached_property
    def input_validator(self) -> Any:
        return None if self.input_schema is None else compile_schema(self.input_schema)

    @functools.cached_property
    def output_validator(self) -> Any:
        return None if self.output_schema is None else compile_schema(self.output_schema)


class DocumentError(Exception):
    """A document breaks save-time rules; `problems` lists each with its line and field."""

    def __init__(self, problems: list[dict[str, Any]]) -> None:
        self.problems = sorted(problems, key=lambda p: p["line"])
        first = self.problems[0] if self.problems else {"line": 1, "message": "invalid document"}
        more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        super().__init__(f"line {first['line']}: {first['message']}{more}")


# Reading the front matter with lines.

class _FrontMatterLoader(yaml.SafeLoader):
    """Composes YAML 1.2 core scalars only, and refuses anchors and aliases."""

    yaml_implicit_resolvers: dict[Any, Any] = {}

    def compose_node(self, parent: Any, index: Any) -> Any:
        # Refused, not raised, so the document's other problems still come back: an alias
        # becomes a scalar that `_scalar` refuses, an anchor a mark that `construct` reports.
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self.get_event()
            return yaml.ScalarNode(_ALIAS_TAG, "", event.start_mark, event.end_mark)
        anchored = getattr(event, "anchor", None) is not None
        if anchored:
            event.anchor = None
        node = super().compose_node(parent, index)
        node.anchored = anchored
        return node


for _tag, _pattern, _first in (
    ("null", r"~|null|Null|NULL|", "~nN"),
    ("bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
    ("int", r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", "-+0123456789"),
    ("float", r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?", "-+.0123456789"),
):
    _FrontMatterLoader.add_implicit_resolver(
        f"tag:yaml.org,2002:{_tag}", re.compile(f"^(?:{_pattern})$"), list(_first) + ([""] if _tag == "null" else []))

_YAML_TAG: Final = "tag:yaml.org,2002:"
_ALIAS_TAG: Final = "!alias"
_NO_ANCHORS: Final = "anchors and aliases (&name, *name) are not allowed"
_COLLECTION_TAGS: Final = (_YAML_TAG + "map", _YAML_TAG + "seq")
_FRONT_OFFSET: Final = 2   # YAML's 0-based line 0 is the source's line 2, below the opening ---


@dataclass(frozen=True, slots=True)
class _Where:
    line: int         # the line of the key (or list item)
    text_line: int    # the line the value's text starts on (a block scalar starts below its `|`)


def _scalar(node: Any) -> Any:
    tag, text = node.tag, node.value
    if tag == _YAML_TAG + "str":
        return text
    if tag == _YAML_TAG + "null":
        return None
    if tag == _YAML_TAG + "bool":
        return text.lower() == "true"
    if tag == _YAML_TAG + "int":
        return int(text) if re.fullmatch(r"[-+]?[0-9]+", text) else int(text, 0)
    if tag == _YAML_TAG + "float":
        number = float(text)
        if not math.isfinite(number):
            raise ValueError(f"{text} is not a finite number")
        return number
    raise ValueError(_NO_ANCHORS if tag == _ALIAS_TAG else f"the YAML tag {tag!r} is not allowed")


class _Reader:
    """The problems of one document, and the lines its fields were written on."""

    def __init__(self) -> None:
        self.where: dict[tuple[Any, ...], _Where] = {}
        self.problems: list[dict[str, Any]] = []

    def line(self, path: tuple[Any, ...]) -> int:
        while path:
            if path in self.where:
                return self.where[path].line
            path = path[:-1]
        return 1

    def text_line(self, path: tuple[Any, ...]) -> int:
        found = self.where.get(path)
        return found.text_line if found else self.line(path)

    def add(self, path: tuple[Any, ...], message: str, line: int | None = None) -> None:
        self.problems.append({"line": line or self.line(path), "field": ".".join(map(str, path)), "message": message})

    # Composing.

    def construct(self, node: Any, path: tuple[Any, ...]) -> Any:
        """Plain data from a YAML node, noting each field's line; problems are collected."""
        if getattr(node, "anchored", False):
            self.add(path, _NO_ANCHORS, line=node.start_mark.line + _FRONT_OFFSET)
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and node.tag not in _COLLECTION_TAGS:
            self.add(path, f"the YAML tag {node.tag!r} is not allowed", line=node.start_mark.line + _FRONT_OFFSET)
            return None
        if isinstance(node, yaml.MappingNode):
            out: dict[str, Any] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    self.add(path, "a key is a plain text", line=key_node.start_mark.line + _FRONT_OFFSET)
                    continue
                key = key_node.value
                if key in out:
                    self.add(path + (key,), f"{key!r} is written twice (first on line {self.line(path + (key,))})",
                             line=key_node.start_mark.line + _FRONT_OFFSET)
                    continue
                self.where[path + (key,)] = _Where(key_node.start_mark.line + _FRONT_OFFSET, _text_line(value_node))
                out[key] = self.construct(value_node, path + (key,))
            return out
        if isinstance(node, yaml.SequenceNode):
            items = []
            for i, item in enumerate(node.value):
                self.where[path + (i,)] = _Where(item.start_mark.line + _FRONT_OFFSET, _text_line(item))
                items.append(self.construct(item, path + (i,)))
            return items
        try:
            return _scalar(node)
        except ValueError as exc:
            self.add(path, str(exc), line=node.start_mark.line + _FRONT_OFFSET)
            return None

    # Typed fields.

    def mapping(self, path: tuple[Any, ...], value: Any, keys: tuple[str, ...],
                required: tuple[str, ...] = ()) -> dict[str, Any] | None:
        if not isinstance(value, dict):
            self.add(path, f"is a mapping of {', '.join(keys)}")
            return None
        for key in value:
            if key not in keys:
                self.add(path + (key,), f"{key!r} is not a key of {'.'.join(map(str, path))} (its keys: {', '.join(keys)})")
        for key in required:
            if key not in value:
                self.add(path + (key,), f"{'.'.join(map(str, path))} needs {key!r}", line=self.line(path))
        return value

    def text(self, path: tuple[Any, ...], value: Any, what: str) -> str | None:
        if isinstance(value, str):
            return value
        self.add(path, f"is {what}, written as text")
        return None

    def name(self, path: tuple[Any, ...], value: Any, pattern: re.Pattern[str], rule: str) -> str | None:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            self.add(path, f"{value!r} is not a {path[-1]} name: {rule}")
            return None
        return value

    def pointer(self, path: tuple[Any, ...], value: Any, *, empty: bool = True) -> str | None:
        if not isinstance(value, str):
            self.add(path, "is a JSON Pointer, such as /messages")
            return None
        if value == "" and not empty:
            self.add(path, "an empty pointer is not allowed here; leave read out to take the whole answer")
            return None
        try:
            pointer_parse(value)
        except ValueError as exc:
            self.add(path, str(exc))
            return None
        return value

    def duration(self, path: tuple[Any, ...], value: Any, low: timedelta, high: timedelta,
                 bounds: str) -> timedelta | None:
        try:
            span = parse_duration(value)
        except ValueError as exc:
            self.add(path, str(exc))
            return None
        if not low <= span <= high:
            self.add(path, f"{value} is outside {bounds}")
            return None
        return span

    def schema(self, path: tuple[Any, ...], value: Any) -> Any:
        if not isinstance(value, (dict, bool)):
            self.add(path, "is a JSON Schema: a mapping such as {type: object, properties: ...}")
            return None
        problem = _schema_problem(value)
        if problem:
            self.add(path + problem[0], problem[1])
            return None
        return value

    def template(self, path: tuple[Any, ...], value: Any, place: Place, input_schema: Any,
                 line: int | None = None) -> Template | None:
        if self.text(path, value, "a template") is None:
            return None
        template, problems = check_template(value, line or self.text_line(path), place, input_schema)
        for at, message in problems:
            self.add(path, message, line=at)
        return template

    def arguments(self, path: tuple[Any, ...], value: Any, place: Place, input_schema: Any) -> Any:
        """A `with` tree compiled, or None; arguments that read only today/now are measured."""
        if not isinstance(value, dict):
            self.add(path, "is the tool's arguments: a mapping of names to values")
            return None
        before = len(self.problems)
        tree = self._tree(path, value, place, input_schema)
        if len(self.problems) > before:
            return None
        templates = list(_templates_in(tree))
        if all(t.roots <= {"today", "now"} for t in templates):
            try:
                size = json_size(render_args(tree, base_context(0)))
            except RenderError as exc:
                self.add(path, f"the arguments do not render: {exc.message}")
                return None
            if size > MAX_ARGUMENTS_BYTES:
                self.add(path, f"the arguments take {size} bytes as JSON, past {MAX_ARGUMENTS_BYTES // KIB} KiB")
                return None
        return tree

    def _tree(self, path: tuple[Any, ...], value: Any, place: Place, input_schema: Any) -> Any:
        if isinstance(value, str):
            return self.template(path, value, place, input_schema)
        if isinstance(value, dict):
            return {k: self._tree(path + (k,), v, place, input_schema) for k, v in value.items()}
        if isinstance(value, list):
            return [self._tree(path + (i,), v, place, input_schema) for i, v in enumerate(value)]
        return value


def _text_line(node: Any) -> int:
    block = isinstance(node, yaml.ScalarNode) and node.style in ("|", ">")
    return node.start_mark.line + _FRONT_OFFSET + (1 if block else 0)


def _templates_in(tree: Any) -> Iterable[Template]:
    if isinstance(tree, Template):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _templates_in(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _templates_in(v)


def _split_source(source: str) -> tuple[str, str, int]:
    """The front matter, the body, and the line the body starts on."""
    lines = source.replace("\r\n", "\n").replace("\r", "\n").removeprefix("\ufeff").split("\n")
    if lines[0].rstrip() != "---":
        raise DocumentError([{"line": 1, "field": "", "message":
                              "a function document starts with a line of three dashes (---), then its YAML "
                              "front matter, another --- line, and the message"}])
    close = next((i for i in range(1, len(lines)) if lines[i].rstrip() == "---"), None)
    if close is None:
        raise DocumentError([{"line": len(lines), "field": "",
                              "message": "the front matter never ends: close it with a line of three dashes (---)"}])
    body = lines[close + 1:]
    blank = next((i for i, line in enumerate(body) if line.strip()), 0)
    return "\n".join(lines[1:close]), "\n".join(body[blank:]).rstrip(), close + 2 + blank


def _compose(r: _Reader, text: str) -> dict[str, Any]:
    loader = None
    try:
        loader = _FrontMatterLoader(text)
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + _FRONT_OFFSET if mark else 1
        raise DocumentError([{"line": line, "field": "", "message": f"the front matter is not valid YAML: {exc.problem}"}])
    except yaml.YAMLError as exc:
        line = text.count("\n", 0, getattr(exc, "position", 0)) + _FRONT_OFFSET
        raise DocumentError([{"line": line, "field": "", "message": f"the front matter is not valid YAML: {exc}"}])
    finally:
        if loader is not None:
            loader.dispose()
    if node is None:
        return {}
    if not isinstance(node, yaml.MappingNode):
        raise DocumentError([{"line": node.start_mark.line + _FRONT_OFFSET, "field": "",
                              "message": "the front matter is a mapping of fields, such as description: ..."}])
    return r.construct(node, ())


# The save-time rules.

_FIELDS: Final = ("description", "call", "to", "from", "expires", "deliver", "replies", "input", "output", "reply")
_NOT_WITH_CALL: Final = ("to", "from", "expires", "deliver", "replies", "reply")
_SERVER_RULE: Final = "1 to 32 lowercase letters, digits and hyphens, starting with a letter"
_TOOL_RULE: Final = "1 to 128 letters, digits, underscores, hyphens and dots"


def parse_function(source: str) -> FunctionDoc:
    """Check and compile a function document; DocumentError lists every problem."""
    if not isinstance(source, str):
        raise DocumentError([{"line": 1, "field": "", "message": "a function document is text"}])
    r = _Reader()
    try:
        front, body, body_line = _split_source(source)
        data = _compose(r, front)
        doc = _check(r, source, data, body, body_line)
    except RecursionError:
        raise DocumentError([{"line": 1, "field": "", "message": "the document nests too deeply"}]) from None
    if r.problems or doc is None:
        raise DocumentError(r.problems or [{"line": 1, "field": "", "message": "invalid document"}])
    return replace(doc, overview=overview(doc))


def _check(r: _Reader, source: str, data: dict[str, Any], body: str, body_line: int) -> FunctionDoc | None:
    for key in data:
        if key not in _FIELDS:
            r.add((key,), f"{key!r} is not a field of a function document (its fields: {', '.join(_FIELDS)})")
    shape = Shape.SYSTEM if "call" in data else Shape.TOOL if "deliver" in data else Shape.INBOX
    description = _description(r, data)
    input_schema = _schema_block(r, data, "input")
    output_schema = _schema_block(r, data, "output")
    to = from_ = message = expires = None
    call = deliver = replies = None
    if shape is Shape.SYSTEM:
        for key in _NOT_WITH_CALL:
            if key in data:
                r.add((key,), f"a function with call asks a system, so it has no {key}")
        if body.strip():
            r.add(("body",), "a function with call sends no message: leave the body after the front matter empty",
                  line=body_line)
        if "output" not in data:
            r.add(("output", "schema"), "a function with call needs output.schema: the shape of the part it reads")
        call = _read_call(r, data["call"], input_schema)
    else:
        for key in ("to", "expires"):
            if key not in data:
                r.add((key,), f"{key!r} is required: a function that asks a person needs it")
        if "to" in data:
            to = r.template(("to",), data["to"], PLACES["party"], input_schema)
        if "from" in data:
            from_ = r.template(("from",), data["from"], PLACES["party"], input_schema)
        if "expires" in data:
            expires = r.duration(("expires",), data["expires"], EXPIRES_MIN, EXPIRES_MAX, "PT1M to P30D (1 minute to 30 days)")
        if body.strip():
            message = r.template(("body",), body, PLACES["message"], input_schema, line=body_line)
        else:
            r.add(("body",), "the message is missing: write it after the front matter", line=body_line)
        if "deliver" in data:
            deliver = _read_deliver(r, data["deliver"], input_schema)
    rule = _reply_rule(r, data, shape, output_schema)
    if "replies" in data and shape is not Shape.SYSTEM:
        replies = _read_replies(r, data, deliver, output_schema, rule)
    if r.problems:
        return None
    return FunctionDoc(
        source=source, shape=shape, description=description, to=to, from_=from_, message=message,
        expires=expires, expires_text=data.get("expires"), input_schema=input_schema,
        output_schema=output_schema, call=call, deliver=deliver, replies=replies, reply_rule=rule)


def _description(r: _Reader, data: dict[str, Any]) -> str | None:
    if "description" not in data:
        return None
    text = r.text(("description",), data["description"], "an explanation")
    if text is not None and not 1 <= len(text.strip()) <= MAX_DESCRIPTION_CHARS:
        r.add(("description",), f"is 1 to {MAX_DESCRIPTION_CHARS} characters, not {len(text.strip())}")
    return text


def _schema_block(r: _Reader, data: dict[str, Any], key: str) -> Any:
    if key not in data:
        return None
    block = r.mapping((key,), data[key], ("schema",), ("schema",))
    if block is None or "schema" not in block:
        return None
    return r.schema((key, "schema"), block["schema"])


def _read_call(r: _Reader, value: Any, input_schema: Any) -> CallSpec | None:
    block = r.mapping(("call",), value, ("server", "tool", "with", "read"), ("server", "tool"))
    if block is None:
        return None
    server = r.name(("call", "server"), block.get("server"), SERVER_RE, _SERVER_RULE) if "server" in block else None
    tool = r.name(("call", "tool"), block.get("tool"), TOOL_RE, _TOOL_RULE) if "tool" in block else None
    with_ = r.arguments(("call", "with"), block.get("with", {}), PLACES["call.with"], input_schema)
    read = r.pointer(("call", "read"), block["read"], empty=False) if "read" in block else None
    if server is None or tool is None or with_ is None or ("read" in block and read is None):
        return None
    reads_input = any("input" in t.roots for t in _templates_in(with_))
    return CallSpec(server, tool, with_, read, reads_input)


def _read_deliver(r: _Reader, value: Any, input_schema: Any) -> DeliverSpec | None:
    block = r.mapping(("deliver",), value, ("server", "tool", "with", "sent"), ("server", "tool", "with"))
    if block is None:
        return None
    server = r.name(("deliver", "server"), block.get("server"), SERVER_RE, _SERVER_RULE) if "server" in block else None
    tool = r.name(("deliver", "tool"), block.get("tool"), TOOL_RE, _TOOL_RULE) if "tool" in block else None
    with_ = r.arguments(("deliver", "with"), block["with"], PLACES["deliver.with"], input_schema) if "with" in block else None
    sent = None
    if "sent" in block:
        sent_block = r.mapping(("deliver", "sent"), block["sent"], ("conversation", "id"), ("conversation", "id"))
        if sent_block is not None:
            conversation = r.pointer(("deliver", "sent", "conversation"), sent_block.get("conversation", ""))
            id_ = r.pointer(("deliver", "sent", "id"), sent_block.get("id", ""))
            if conversation is not None and id_ is not None:
                sent = SentSpec(conversation, id_)
    if server is None or tool is None or with_ is None:
        return None
    return DeliverSpec(server, tool, with_, sent)


def _read_replies(r: _Reader, data: dict[str, Any], deliver: DeliverSpec | None,
                  output_schema: Any, rule: ReplyRule | None) -> RepliesSpec | None:
    path = ("replies",)
    if "deliver" not in data:
        r.add(path, "replies are read from a delivered message: replies needs deliver")
        return None
    if isinstance(data["deliver"], dict) and "sent" not in data["deliver"]:
        r.add(path, "reading replies needs deliver.sent: where the tool's answer names the message it sent")
    if "output" not in data:
        r.add(path, "reading replies needs output.schema: a notification takes no answer")
    elif output_schema is not None and rule is None and "reply" not in data:
        r.add(path, "reading replies needs a reply rule: write reply, or give output.schema exactly one "
                    "required property that is a string")
    block = r.mapping(path, data["replies"], ("conversation", "tool", "with", "read", "wait", "tell"),
                      ("tool", "with", "read"))
    if block is None:
        return None
    if "conversation" in block:
        conversation = r.template(path + ("conversation",), block["conversation"], PLACES["replies.conversation"], None)
    else:
        conversation = Template("{{ sent.conversation }}", r.line(path))
    tool = r.name(path + ("tool",), block.get("tool"), TOOL_RE, _TOOL_RULE) if "tool" in block else None
    with_ = r.arguments(path + ("with",), block["with"], PLACES["replies.with"], None) if "with" in block else None
    read = _read_read(r, block["read"]) if "read" in block else None
    wait = r.duration(path + ("wait",), block["wait"], WAIT_MIN, WAIT_MAX, "PT5S to PT1H") if "wait" in block else WAIT_DEFAULT
    tell = _read_tell(r, block["tell"], deliver) if "tell" in block else None
    if None in (conversation, tool, with_, read, wait) or ("tell" in block and tell is None):
        return None
    return RepliesSpec(conversation, tool, with_, read, wait, tell)


def _read_read(r: _Reader, value: Any) -> ReadSpec | None:
    path = ("replies", "read")
    block = r.mapping(path, value, ("list", "order", "each"), ("list", "order", "each"))
    if block is None:
        return None
    list_ = r.pointer(path + ("list",), block["list"]) if "list" in block else None
    order = block.get("order")
    if "order" in block and order not in ("oldest_first", "newest_first"):
        r.add(path + ("order",), f"{order!r} is not an order: write oldest_first or newest_first")
        order = None
    each: dict[str, str] | None = None
    if "each" in block:
        each_block = r.mapping(path + ("each",), block["each"], ("id", "sender", "text", "to"), ("id", "sender", "text"))
        if each_block is not None:
            pointers = {k: r.pointer(path + ("each", k), v) for k, v in each_block.items() if k in ("id", "sender", "text", "to")}
            if all(p is not None for p in pointers.values()) and {"id", "sender", "text"} <= pointers.keys():
                each = {k: p for k, p in pointers.items() if p is not None}
    if list_ is None or order is None or each is None:
        return None
    return ReadSpec(list_, order, each)


def _read_tell(r: _Reader, value: Any, deliver: DeliverSpec | None) -> TellSpec | None:
    path = ("replies", "tell")
    block = r.mapping(path, value, ("tool", "with"), ("with",))
    if block is None:
        return None
    tool = r.name(path + ("tool",), block["tool"], TOOL_RE, _TOOL_RULE) if "tool" in block else (deliver and deliver.tool)
    with_ = r.arguments(path + ("with",), block["with"], PLACES["tell.with"], None) if "with" in block else None
    return TellSpec(tool, with_) if tool and with_ is not None else None


def _reply_rule(r: _Reader, data: dict[str, Any], shape: Shape, output_schema: Any) -> ReplyRule | None:
    if shape is Shape.SYSTEM:
        return None
    if "reply" not in data:
        return derive_rule(output_schema) if output_schema is not None else None
    if "output" not in data:
        r.add(("reply",), "reply reads an answer from a reply, so it needs output.schema (a notification takes none)")
        return None
    if output_schema is None:
        return None
    return _read_rule(r, data["reply"], output_schema, needs_required="replies" in data)


def _read_rule(r: _Reader, value: Any, schema: Any, needs_required: bool) -> ReplyRule | None:
    path = ("reply",)
    if not isinstance(value, dict) or not value:
        r.add(path, "is a mapping of answer properties to word, rest or text, such as {verdict: word, note: rest}")
        return None
    before = len(r.problems)
    parts: dict[str, RulePart] = {}
    for name, spec in value.items():
        part = _read_part(r, path + (name,), name, spec, schema)
        if part is not None:
            parts[name] = part
    words = [n for n, p in parts.items() if p.source == "word"]
    if len(words) > 1:
        r.add(path + (words[1],), f"only one property takes the first word, and {words[0]} already does")
    if needs_required and isinstance(schema, dict) and isinstance(schema.get("required"), list):
        for name in schema["required"]:
            if isinstance(name, str) and name not in value:
                r.add(path, f"replies are read with this rule, and it gives no value to the required property {name!r}")
    return ReplyRule(parts) if len(r.problems) == before else None


def _read_part(r: _Reader, path: tuple[Any, ...], name: str, spec: Any, schema: Any) -> RulePart | None:
    prop = _string_property(schema, name)
    if prop is None:
        r.add(path, f"{name!r} is not a top-level string property of output.schema")
        return None
    words_spec = None
    if isinstance(spec, dict):
        before = len(r.problems)
        r.mapping(path, spec, ("from", "words"), ("from",))
        if len(r.problems) > before:
            return None
        source, words_spec, where = spec["from"], spec.get("words"), path + ("from",)
    else:
        source, where = spec, path
    if source not in _PART_SOURCES:
        r.add(where, f"{source!r} is not a part of a reply: write word, rest or text")
        return None
    if words_spec is not None and source != "word":
        r.add(path + ("words",), "only a part read from the first word (word) takes words")
        return None
    if source != "word":
        return RulePart(source)
    return _read_word_part(r, path, name, prop, words_spec)


def _read_word_part(r: _Reader, path: tuple[Any, ...], name: str, prop: dict[str, Any],
                    words_spec: Any) -> RulePart | None:
    values = _enum_strings(prop)
    if not values:
        r.add(path, f"{name} is read from a word, so output.schema must list its values in an enum")
        return None
    before = len(r.problems)
    meaning: dict[str, str] = {}
    for value in values:
        key = _word_key(value)
        if key and meaning.setdefault(key, value) != value:
            r.add(path, f"the values {meaning[key]!r} and {value!r} read as the same word")
    words: dict[str, tuple[str, ...]] = {v: () for v in values}
    if words_spec is None:
        return RulePart("word", words)
    wpath = path + ("words",)
    if not isinstance(words_spec, dict):
        r.add(wpath, "is a mapping of values to the words that also mean them, such as {approve: [yes, ok]}")
        return None
    if len(words_spec) > MAX_RULE_VALUES:
        r.add(wpath, f"a reply rule lists words for at most {MAX_RULE_VALUES} values, not {len(words_spec)}")
    for value, listed in words_spec.items():
        vpath = wpath + (value,)
        if value not in words:
            r.add(vpath, f"{value!r} is not a value of {name} (its enum: {', '.join(values)})")
        elif not isinstance(listed, list):
            r.add(vpath, "is a list of words, such as [yes, ok]")
        elif len(listed) > MAX_RULE_WORDS:
            r.add(vpath, f"a value takes at most {MAX_RULE_WORDS} words, not {len(listed)}")
        else:
            words[value] = tuple(_read_words(r, vpath, value, listed, meaning))
    return RulePart("word", words) if len(r.problems) == before else None


def _read_words(r: _Reader, path: tuple[Any, ...], value: str, listed: list[Any],
                meaning: dict[str, str]) -> Iterable[str]:
    for i, word in enumerate(listed):
        if isinstance(word, int) and not isinstance(word, bool):
            word = str(word)
        key = _word_key(word) if isinstance(word, str) else ""
        if not key or len(word.split()) != 1:
            r.add(path + (i,), f"{word!r} is not one word")
        elif len(word.encode()) > MAX_RULE_WORD_BYTES:
            r.add(path + (i,), f"a word takes at most {MAX_RULE_WORD_BYTES} bytes")
        elif meaning.setdefault(key, value) != value:
            r.add(path + (i,), f"{word!r} already means {meaning[key]!r}: a word means one value only")
        else:
            yield word


# The overview: the function in plain words, for a person who reads neither Liquid nor YAML.

_TYPE_WORDS: Final = {"string": "text", "integer": "whole number", "number": "number", "boolean": "yes or no",
                      "array": "list", "object": "object", "null": "nothing"}
_LIQUID_OUTPUT_RE: Final = re.compile(r"\{\{-?(.*?)-?\}\}", re.S)
_LIQUID_TAG_RE: Final = re.compile(r"\{%-?.*?-?%\}", re.S)


def _expression_words(expression: str) -> str:
    head = expression.split("|", 1)[0].strip()
    literal = re.fullmatch(r"'([^']*)'|\"([^\"]*)\"", head)
    if literal:
        return literal.group(1) if literal.group(1) is not None else literal.group(2)
    path = re.match(r"[A-Za-z_][\w-]*(?:\.[A-Za-z_][\w-]*)*", head)
    return f"**{path.group(0).rsplit('.', 1)[-1]}**" if path else f"`{head}`"


def template_words(source: str) -> str:
    """A template as a person reads it: each value it reads as its name in bold, tags dropped."""
    return _LIQUID_OUTPUT_RE.sub(lambda m: _expression_words(m.group(1)), _LIQUID_TAG_RE.sub("", source))


def _type_words(schema: dict[str, Any]) -> str:
    types = [_TYPE_WORDS.get(t, t) for t in sorted(_schema_types(schema))]
    if "array" in _schema_types(schema) and isinstance(schema.get("items"), dict) and _schema_types(schema["items"]):
        types = [t if t != "list" else f"list of {_type_words(schema['items'])}" for t in types]
    return " or ".join(types) or "any value"


def _bound_words(schema: dict[str, Any]) -> list[str]:
    out = []
    for low, high, unit in (("minLength", "maxLength", "characters"), ("minItems", "maxItems", "items"),
                            ("minimum", "maximum", "")):
        lo, hi = schema.get(low), schema.get(high)
        unit = f" {unit}" if unit else ""
        if lo is not None and hi is not None:
            out.append(f"{lo} to {hi}{unit}")
        elif hi is not None:
            out.append(f"at most {hi}{unit}")
        elif lo is not None:
            out.append(f"at least {lo}{unit}")
    if isinstance(schema.get("enum"), list):
        out.append("one of " + ", ".join(map(str, schema["enum"])))
    if "const" in schema:
        out.append(f"always {schema['const']}")
    if isinstance(schema.get("format"), str):
        out.append(f"format {schema['format']}")
    if "default" in schema:
        out.append(f"{dumps(schema['default'])} when left out")
    return out


def _field_lines(schema: Any) -> list[str]:
    """One bullet per property of an object schema (of its items, for a list of objects)."""
    if isinstance(schema, dict) and "array" in _schema_types(schema) and isinstance(schema.get("items"), dict):
        schema = schema["items"]
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return []
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    out = []
    for name, sub in props.items():
        sub = sub if isinstance(sub, dict) else {}
        kind = _type_words(sub) + (", required" if name in required else "")
        notes = ([str(sub["description"])] if sub.get("description") else []) + _bound_words(sub)
        out.append(f"- **{name}** ({kind})" + (": " + "; ".join(notes) if notes else ""))
    return out


def _schema_words(schema: Any, none: str, empty: str) -> str:
    if schema is None:
        return none
    lines = _field_lines(schema)
    if lines:
        return "\n".join(lines)
    return empty if not isinstance(schema, dict) or not _schema_types(schema) else f"{empty} ({_type_words(schema)})"


def overview(doc: FunctionDoc) -> str:
    """The function in plain Markdown: what it needs, whom it asks, what it sends and expects."""
    parts = [doc.description.strip() if doc.description else "This function has no description yet."]
    parts += _system_overview(doc) if doc.shape is Shape.SYSTEM else _person_overview(doc)
    return "\n\n".join(parts) + "\n"


def _system_overview(doc: FunctionDoc) -> list[str]:
    call = doc.call
    assert call is not None
    where = f"the part of the tool's answer at `{call.read}`" if call.read else "the tool's whole answer"
    return [
        f"**Who it asks:** the tool `{call.tool}` of the tool server `{call.server}`, once for each run.",
        "**What it sends:**\n" + _schema_words(doc.input_schema, "Arguments that read no input.",
                                               "An input whose fields the schema does not list"),
        f"**What it reads:** {where}.\n" + _schema_words(doc.output_schema, "", "A value of any shape"),
    ]


def _person_overview(doc: FunctionDoc) -> list[str]:
    assert doc.to is not None and doc.message is not None and doc.expires is not None
    to = template_words(doc.to.source)
    who = f"{to}; the answer that counts comes from {template_words(doc.from_.source)}." if doc.from_ else f"{to}."
    message = "\n".join("> " + line if line else ">" for line in template_words(doc.message.source).split("\n"))
    if doc.deliver:
        where = f"Through the tool `{doc.deliver.tool}` of the tool server `{doc.deliver.server}`."
    else:
        where = "In the playbook's inbox, where it waits for an answer."
    if doc.is_notification:
        answer = "None: this function sends a notification, which takes no answer."
    else:
        answer = _schema_words(doc.output_schema, "", "An answer that matches its schema")
    out = [
        "**What it needs:**\n" + _schema_words(doc.input_schema, "Any input: the function names no input schema.",
                                               "An input whose fields the schema does not list"),
        f"**Who it asks:** {who}",
        "**What it sends:**\n\n" + message,
        f"**Where:** {where}",
        f"**How long it waits:** {duration_words(doc.expires)}; then the request ends unanswered.",
        "**What answer it expects:**\n" + answer,
    ]
    if doc.replies and doc.reply_rule:
        told = (f" A reply that is not an answer is met with how to answer, sent with `{doc.replies.tell.tool}`."
                if doc.replies.tell else "")
        out.append(f"**Replies:** read with the tool `{doc.replies.tool}`, no more often than every "
                   f"{duration_words(doc.replies.wait)}. {doc.reply_rule.describe()}{told}")
    return out


def check_documents(paths: list[str], out: Any = None) -> int:
    """`interactiond check`: print each problem as FILE:LINE: field: message; 1 on any problem."""
    out = out or sys.stdout
    status = 0
    for path in paths:
        try:
            with open(path, encoding="utf-8") as fh:
                source = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            print(f"{path}: cannot read it: {getattr(exc, 'strerror', None) or exc}", file=out)
            status = 1
            continue
        try:
            parse_function(source)
        except DocumentError as exc:
            status = 1
            for p in exc.problems:
                print(f"{path}:{p['line']}: {p['field'] + ': ' if p['field'] else ''}{p['message']}", file=out)
        else:
            print(f"{path}: ok", file=out)
    return status
