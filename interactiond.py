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
    Documents                 YAML front matter with lines, save-time rules, reply rules, overview
    Templates                 python-liquid with limits, static analysis, typed rendering
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
import hashlib
import json
import os
import re
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Final, Iterable

__version__ = "0.1.0"

__all__ = [
    "Problem",
    "DocumentError",
    "RunStatus",
    "DeliveryState",
    "parse_duration",
    "parse_function",
    "main",
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


# >>> SECTION: Documents and Templates (see below) <<<
