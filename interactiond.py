"""interactiond - ask a person (or a system) a question and wait, durably, for a validated answer.

One asyncio process: an aiohttp HTTP API, an MCP server (stdio, streamable HTTP, SSE), one timer
task, and a WAL-mode SQLite file (or a PostgreSQL database that several daemons share). Agents and scripts save *interaction functions* (Markdown with
YAML front matter), run them, and wait for the answer a person gives in the inbox, through a chat
tool, or that a system returns.

Run it:

    pip install -e . && interactiond serve        # http://127.0.0.1:8765, ./interactiond.db
    interactiond stdio                             # MCP over stdin/stdout for a local agent
    interactiond check examples/*.md               # validate function documents offline

The module reads top to bottom, each section using only those above it:

    Constants and limits      every bound of the product, with its reason
    Problems                  one exception type carrying an RFC 9457 problem object
    States                    run, request and delivery states; transition tables; the ENDINGS table
    Small parsers             durations, JSON Pointers, ids, the clock, JSON helpers
    Templates                 python-liquid with limits, static analysis, typed rendering
    Documents                 YAML front matter with lines, save-time rules, reply rules, overview
    Settings                  the configuration file: tool servers, playbooks, secrets
    Store                     the schema and migrations, one writer with group commit, a reader, and
                              the Tx operations: every SQL statement, named and guarded (SqlTx,
                              on SQLiteTx; the SQL's differences between backends in a Dialect)
    PostgreSQL                the same store on a server: its schema and migrations, PostgresTx,
                              the daemons' registry (PgDaemons), the bus across daemons (PgBus)
    Tool servers              MCP client sessions, one owner task per server, and the one door
                              every tool call goes through (ToolServers.call)
    Engine                    the timer task, end() (the one way a run ends) and the parts -
                              Definitions, ToolCalls (a system call's call and ending), Approvals
                              (a person approves a call), SystemCalls, Inbox, Readings,
                              Deliveries, Reminders (reminders, escalation, default answers),
                              Runs - each built after the parts it calls and given them, behind
                              Engine: it builds them, starts and stops, fires the timers and
                              answers every operation the sections below call; AnswerLinks signs
                              the links people answer on
    Workflows                 the workflow language, its checker and its step-by-step executor
    HTTP API                  aiohttp routes, problem+json, auth, OpenAPI
    MCP server                the same operations as MCP tools over three transports
    Typed API and client      /v2/interactions and interactiond.Client
    The page's text           the inbox page's HTML, CSS and script
    Web inbox                 the page a person answers on
    Command line              serve, stdio, demo, check, token, and the clients of the HTTP API

How to change it:

    a new ending              one row of ENDINGS (States): its run status, request status, kind,
                              problem, HTTP, v2 and stream names follow from it; then the code
                              that reaches it calls end(tx, fx, playbook, run_id, "name", detail)
    a field of the run        a column in schema.sql and schema-postgres.sql (and SCHEMA_SQL and
                              POSTGRES_SCHEMA_SQL, and a step in MIGRATIONS and POSTGRES_MIGRATIONS),
                              the INSERT in SqlTx.insert_run, and one line in run_object
    a state change            an operation of SqlTx: one UPDATE guarded by the states it may
                              leave (allowed_from), whose empty RETURNING means "not allowed"
    an engine operation       a method of the part whose area it is, given in its __init__ only
                              what it uses (a part it calls is built before it and passed in);
                              if a section below calls it, one line in Engine.__init__ hands it on
    a timer                   a key `kind:<playbook>:<ref>` set inside a change (tx.set_timer),
                              and one Engine.on_timer(kind, handler) saying what fires it (the
                              wheel holds the next hour's due times and reads on as it goes)
    a tool call               ToolServers.call, the one door (allow-list, approval gate, bounds,
                              scrubbing); never a session's call directly
    a kind of run             a RunKind registered in RUN_KINDS (as Workflows does)
    a problem type            one entry of PROBLEM_TYPES, and its name in README.md (the tests
                              check every name the module raises is in both)
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import contextvars
import enum
import fcntl
import functools
import gc
import hashlib
import heapq
import hmac
import itertools
import json
import logging
import math
import os
import queue
import re
import resource
import secrets
import select
import signal
import sqlite3
import sys
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from html import escape as _esc
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Final, Iterable, Iterator, Protocol

# The heavy libraries load where they are first used, so a command that only talks to a daemon
# (`inbox`, `get`, `answer`, `runs`, `--version`) starts in a fraction of the time (SPEC section 13):
# python-liquid in the Templates section's `_liquid()`, jsonschema (`_jsonschema()`), referencing,
# RE2 and PyYAML in the functions of Documents that need them, aiohttp where the HTTP API makes an
# app or a response, urllib's HTTP client where a client calls the daemon, and the MCP SDK (with its
# pydantic models, a third of a daemon's memory) at a tool server's session or the first MCP
# request. The names below are for annotations only.
if TYPE_CHECKING:
    from aiohttp import web
    from jsonschema import FormatChecker
    from jsonschema.exceptions import ValidationError
    from liquid import Environment, RenderContext
    from liquid.builtin.output import OutputNode

try:                                    # JSON in and out, five to ten times faster (see dumps, read_json)
    import orjson as _orjson
except ImportError:                     # pragma: no cover - a dependency; the standard library does it all
    _orjson = None

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
    "Client",
    "ClientError",
    "interaction_object",
    "mount_typed_api",
]

log = logging.getLogger("interactiond")


# Constants and limits ###########################################################################
#
# Every bound of the product lives here, once, with the reason it has the value it has. The
# function-document bounds come from the behaviour reference; the HTTP ones keep a single
# self-hosted process safe from one careless (or hostile) client.

KIB: Final = 1024
MIB: Final = 1024 * 1024

#: A rendered party (`to`, `from`): short enough to be a name a reader filters by.
MAX_PARTY_BYTES: Final = 256
#: The people a quorum approval may name in `to` (SPEC section 25).
MAX_QUORUM: Final = 16
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
#: Connections: each holds a file descriptor whether or not it ever sends a request. Its request
#: line and headers arrive within HEADERS_TIMEOUT_S of its opening (or of a kept-alive one's next
#: byte); one idle between requests closes after KEEPALIVE_TIMEOUT_S (longer than the usual
#: proxy's 60 s, so a proxy closes first); at most `max_connections` are open, and FD_RESERVE
#: descriptors under the open-file limit stay for the database, tool servers and accepting.
HEADERS_TIMEOUT_S: Final = 10.0
KEEPALIVE_TIMEOUT_S: Final = 75.0
DEFAULT_MAX_CONNECTIONS: Final = 4096
MAX_MAX_CONNECTIONS: Final = 1_000_000
FD_RESERVE: Final = 256
#: Connections the kernel holds before the daemon accepts them. At the usual 100, a burst of
#: connections fills it and a client's connection attempt waits a second to be tried again.
LISTEN_BACKLOG: Final = 1024
#: Event payload previews in listings.
PREVIEW_BYTES: Final = 2 * KIB
#: Paging.
DEFAULT_PAGE: Final = 50
MAX_PAGE: Final = 200

#: Reminders of one request (a function's `remind.after`, `ask`'s `remind_after`): a few nudges,
#: not a stream of them.
MAX_REMINDERS: Final = 10
#: What a reminder and an escalation say where the function writes no message of its own.
DEFAULT_REMINDER: Final = "A reminder: this question is still waiting for your answer."
DEFAULT_ESCALATION: Final = "This question has not been answered in time, so it now comes to you as well."

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
#: An attempt's end that the database refused for a moment (busy, out of reach) is written again
#: after these pauses, in real seconds (write_attempt_end).
ATTEMPT_END_RETRY_S: Final = (0.2, 1.0, 5.0)
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
MAX_MCP_WAIT_S: Final = 3600.0
#: A long MCP wait sends a heartbeat (`notifications/progress`, when the request asked for progress)
#: this often, in seconds of real time: a client that resets its timeout on progress keeps waiting.
MCP_HEARTBEAT_S: Final = 15.0
#: MCP tasks: how often a client is asked to poll `tasks/get` (`pollIntervalMs`), and how long a
#: task is kept after its request expires (counted into `ttlMs`).
MCP_TASK_POLL_MS: Final = 2000
MCP_TASK_KEPT_MS: Final = 24 * 3600 * 1000
#: A wait_run that asks the person at the MCP client (elicitation) asks at most this often: an answer
#: that does not fit is asked again with the daemon's words, then the wait goes on without asking.
MAX_ELICIT_ASKS: Final = 3

#: MCP sessions over HTTP (the SDK alone keeps up to 10,000, 30 minutes each): a token holds at
#: most this many (one more closes its oldest idle one), and one without a request this long on
#: the daemon's clock is closed.
MCP_SESSIONS_PER_TOKEN: Final = 32
MCP_SESSION_IDLE: Final = timedelta(minutes=10)
#: Inbox sessions (the cookie a login link trades for): ended after this long unused, and this
#: long after sign-in whatever the use. A session's last use is written at most once a minute.
INBOX_SESSION_IDLE: Final = timedelta(hours=12)
INBOX_SESSION_MAX: Final = timedelta(days=7)
INBOX_SESSION_TOUCH: Final = timedelta(minutes=1)
#: A sign-in link made with `interactiond link` or POST .../links works once, until this long
#: after it was made unless it says otherwise (at most LOGIN_LINK_MAX). The one a start prints is
#: named START_LOGIN_NAME: the next start revokes it (a person's links stand).
LOGIN_LINK_DEFAULT: Final = timedelta(days=7)
LOGIN_LINK_MAX: Final = timedelta(days=30)
START_LOGIN_NAME: Final = "inbox login"
#: The pruning pass on the timer task: typed-API idempotency keys older than this go, and so do
#: ended inbox sessions and spent login links; it runs this often (the first a minute after start).
IDEMPOTENCY_KEEP: Final = timedelta(hours=24)
PRUNE_EVERY: Final = timedelta(hours=1)
#: The timer wheel holds the due times of the next hour, reading the next hour's from the store as
#: it goes: memory stays flat however many requests are open (each has an expiry), and an hour's
#: read is one indexed range of the timers table.
TIMER_WINDOW_MS: Final = 3_600_000

#: Template rendering: never hangs, never eats memory.
TEMPLATE_LOOP_LIMIT: Final = 10_000
TEMPLATE_OUTPUT_LIMIT: Final = 64 * KIB
TEMPLATE_NAMESPACE_LIMIT: Final = 64 * KIB
#: Every value a filter reads or makes, in characters (an item of a list or an object counts 16
#: more): a chain of filters never multiplies a value past it, so a render's memory stays a few MiB.
TEMPLATE_VALUE_LIMIT: Final = 256 * KIB
#: All the values the filters of one render read and make, together: a loop of filters ends fast.
TEMPLATE_WORK_LIMIT: Final = 2 * MIB
#: Digits of a number a render computes (Python prints no longer integer).
TEMPLATE_NUMBER_DIGITS: Final = 4300
#: The longest text `date` reads as a date (a longer one is no date and comes back as it is), and
#: the longest format it takes.
TEMPLATE_DATE_CHARS: Final = 1 * KIB

#: Saving a document: what one function or workflow document may hold, so that checking any
#: document up to MAX_BODY_BYTES takes a fraction of a second and a few MiB (the check runs off
#: the event loop too, DOCUMENT_CHECK_THREADS at a time). Each bound is far above what a real
#: document holds; past it the document is refused with the line where it passed.
#: YAML nodes (each mapping, list and value): composing and checking one takes some 30 us.
MAX_DOCUMENT_NODES: Final = 20_000
#: How deep mappings and lists nest: the readers and JSON Schema checks recurse.
MAX_DOCUMENT_DEPTH: Final = 64
#: Liquid tags of all the templates of a document (`{{ }}`, `{% %}`, each line of a `{% liquid %}`):
#: python-liquid parses and analyses each in Python.
MAX_DOCUMENT_TAGS: Final = 2_000
#: Characters inside those tags, together: a tag of a hundred thousand filters takes seconds to parse.
MAX_DOCUMENT_MARKUP: Final = 64 * KIB
#: Parentheses and brackets nested inside one tag: python-liquid takes time quadratic in the depth.
MAX_TEMPLATE_NESTING: Final = 32
#: Objects (schemas and mappings) in the JSON Schemas of a document, together: checking a schema
#: against its meta-schema takes some 0.6 ms an object.
MAX_SCHEMA_OBJECTS: Final = 1_000
#: Runtime expressions (`${ }`) of one workflow: jq compiles each in about 2 ms, and takes time
#: quadratic in the length of some (a text of 8 KiB of string interpolations took 0.8 s); so an
#: expression is at most MAX_EXPRESSION_CHARS, and a workflow's are MAX_DOCUMENT_EXPRESSION_CHARS.
MAX_DOCUMENT_EXPRESSIONS: Final = 128
MAX_EXPRESSION_CHARS: Final = 1 * KIB
MAX_DOCUMENT_EXPRESSION_CHARS: Final = 16 * KIB
#: Documents checked at once, each in a thread of its own: the event loop keeps its share of the
#: interpreter (the GIL) while they run.
DOCUMENT_CHECK_THREADS: Final = 2

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
    "approval_not_yours": (403, "Approval not yours", "An approval is answered only by the person it is addressed to, or by an operator, and never by the caller that started the call it approves."),
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
    "declined": (410, "Declined", "The person asked to approve a tool call refused it; the tool was not called. The note, if any, is in the detail."),
    "failed": (500, "Failed", "The daemon itself broke down while running."),
    "timeout": (408, "Timeout", "A workflow task ran out of time."),
    "idempotency_key_required": (400, "Idempotency key required", "Responding on the typed API needs an Idempotency-Key header, so that a retried request cannot answer twice."),
    "idempotency_key_conflict": (409, "Idempotency key conflict", "This Idempotency-Key was used before with another request body; use a new key for a new response."),
    "interaction_not_pending": (409, "Interaction not pending", "The interaction is already answered, expired or cancelled."),
    "interaction_type_mismatch": (422, "Interaction type mismatch", "The response's type is not the interaction's type."),
    "arguments_changed": (409, "Arguments changed", "An earlier approval of this quorum set the call's arguments; a later approver approves or refuses them as shown, without changes."),
    "digest_mismatch": (409, "Digest mismatch", "The answer names the digest of something the request does not show (another request, or this one before it changed): read the request again and answer what it shows."),
    "validation_failed": (422, "Validation failed", "The response has missing, unknown or invalid fields; `errors` lists each as {field, code, message}."),
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


# States #########################################################################################
#
# Every status the product stores or shows, as enums, and every way a run ends, as one table.
#
# Rule 1: a run, a request and a delivery move only along the transitions written here. The store
# guards each move again in SQL (`UPDATE ... WHERE status IN (<allowed from>)`), so a move the
# table refuses is also one the database refuses; `next_state` raises InvalidTransition for it.
# Rule 2: `ENDINGS` is the one home of what an ending means: the run's status and kind, how its
# open request closes, the problem that describes it, the HTTP status of the run object, the
# typed API's status and stream event, and the status a workflow step sees. Every status map of
# the module is derived from it. A new ending is a row here plus the code that reaches it.


class InvalidTransition(Exception):
    """A move the transition tables do not allow."""

    def __init__(self, table: str, state: Any, event: Any) -> None:
        self.table, self.state, self.event = table, state, event
        super().__init__(f"{table}: cannot handle {getattr(event, 'value', event)!r} in state "
                         f"{getattr(state, 'value', state)!r}")


class RunStatus(str, enum.Enum):
    """Where a run stands. The first two are live; the rest are endings, each final."""

    STARTED = "started"            # accepted; nothing to wait for yet, or a system call in flight
    WAITING = "waiting"            # a request is open (or a workflow waits on a child or a timer)
    SUCCEEDED = "succeeded"        # an answer (a default one too), a delivered notification, a tool's answer
    INVALID_INPUT = "invalid_input"
    CONFLICT = "conflict"
    UNAVAILABLE = "unavailable"
    REJECTED = "rejected"          # unanswered (expired, undelivered) or cancelled
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        return self not in (RunStatus.STARTED, RunStatus.WAITING)


#: The live statuses, from which a run may end (the store's guard).
LIVE_RUN_STATUSES: Final = (RunStatus.STARTED, RunStatus.WAITING)


class RequestStatus(str, enum.Enum):
    """A request: open until it is answered, notified, expired, undelivered or cancelled."""

    OPEN = "open"                  # waiting for an answer (or for its notification's delivery)
    ANSWERED = "answered"          # open -> answered
    NOTIFIED = "notified"          # open -> notified: a notification was delivered
    EXPIRED = "expired"            # open -> expired (holding its default answer, when it took one)
    UNDELIVERED = "undelivered"    # open -> undelivered: a notification's attempts are spent
    CANCELLED = "cancelled"        # open -> cancelled


class DeliveryState(str, enum.Enum):
    """How a request's delivery stands, as list_interactions shows it."""

    IN_INBOX = "in_inbox"          # no deliver: waits in the inbox
    TO_DELIVER = "to_deliver"      # an attempt is due
    DELIVERING = "delivering"      # an attempt is in flight
    DELIVERED = "delivered"        # an attempt succeeded
    RETRYING = "retrying"          # an attempt failed; the next is scheduled
    UNDELIVERED = "undelivered"    # every attempt failed (a question stays open in the inbox)
    CANCELLING = "cancelling"      # cancel asked; an attempt in flight finishes first


class DeliveryEvent(str, enum.Enum):
    """What moves a delivery."""

    BEGIN = "begin"                # an attempt starts (recorded before it is sent)
    SUCCEED = "succeed"
    FAIL = "fail"                  # a failed or lost attempt with attempts left
    SPEND = "spend"                # a failed attempt that was the last one
    CANCEL = "cancel"


class EventType(str, enum.Enum):
    """The facts the events table holds (a run's history and the playbook's own events)."""

    DEFINITION_CREATED = "definition_created"
    DEFINITION_DELETED = "definition_deleted"
    INTERACTION_REQUESTED = "interaction_requested"        # a request opens: -> open
    REQUEST_ANSWERED = "request_answered"                  # open -> answered
    REQUEST_REMINDED = "request_reminded"                  # open, reminded once more (n)
    REQUEST_ESCALATED = "request_escalated"                # open, asks the escalation's party too (to)
    REQUEST_DEFAULTED = "request_defaulted"                # open -> expired with its default answer
    CANCEL_REQUESTED = "cancel_requested"                  # delivery -> cancelling
    DELIVERY_STARTED = "delivery_started"                  # to_deliver/retrying -> delivering
    DELIVERY_SUCCEEDED = "delivery_succeeded"              # delivering -> delivered
    DELIVERY_FAILED = "delivery_failed"                    # delivering -> retrying/undelivered
    DELIVERY_REFUSED = "delivery_refused"                  # the arguments break a bound: no attempt
    READING_FAILED = "reading_failed"
    REPLIES_READ = "replies_read"
    REPLY_REFUSED = "reply_refused"
    TELLING_STARTED = "telling_started"
    TELLING_SUCCEEDED = "telling_succeeded"
    TELLING_FAILED = "telling_failed"
    TOOL_CALL_STARTED = "tool_call_started"
    TOOL_CALL_ANSWERED = "tool_call_answered"
    TOOL_CALL_FAILED = "tool_call_failed"
    TOOL_CALL_REFUSED = "tool_call_refused"                # the door refused a gated tool's call: nothing sent
    APPROVAL_REQUESTED = "approval_requested"              # a call waits for a person's approval
    APPROVAL_ANSWERED = "approval_answered"                # approved (the call follows) or refused
    APPROVAL_VOTE = "approval_vote"                        # one addressee of a quorum approved or refused
    DEPUTY_ADDED = "deputy_added"                          # the playbook's: a deputy stands for a person
    DEPUTY_REMOVED = "deputy_removed"
    ELICITATION_DECLINED = "elicitation_declined"          # the person at an MCP client declined to answer there
    ELICITATION_REFUSED = "elicitation_refused"            # an answer given for an MCP task's question did not fit
    MCP_TASK_CANCELLED = "mcp_task_cancelled"              # an MCP task's tasks/cancel cancelled its run
    TASK_STARTED = "task_started"
    TASK_COMPLETED = "task_completed"
    TASK_FAULTED = "task_faulted"
    TASK_RETRIED = "task_retried"
    RUN_SUCCEEDED = "run_succeeded"                        # a run's ending: run_<status>
    RUN_INVALID_INPUT = "run_invalid_input"
    RUN_CONFLICT = "run_conflict"
    RUN_UNAVAILABLE = "run_unavailable"
    RUN_REJECTED = "run_rejected"
    RUN_FAILED = "run_failed"

    @classmethod
    def ending(cls, status: RunStatus) -> "EventType":
        return cls("run_" + status.value)


#: Requests: (state, the status it closes with) -> the next state. Only an open request closes.
REQUEST_TRANSITIONS: Final[dict[RequestStatus, dict[RequestStatus, RequestStatus]]] = {
    RequestStatus.OPEN: {s: s for s in RequestStatus if s is not RequestStatus.OPEN},
    **{s: {} for s in RequestStatus if s is not RequestStatus.OPEN},
}

#: Deliveries: state -> {event: next state}. A request starts `in_inbox` (nothing to send) or
#: `to_deliver`. Cancel moves only an attempt in flight (it finishes, then the run ends cancelled);
#: any other request simply closes. A cancelling, delivered or undelivered delivery moves no more.
DELIVERY_TRANSITIONS: Final[dict[DeliveryState, dict[DeliveryEvent, DeliveryState]]] = {
    DeliveryState.IN_INBOX: {},
    DeliveryState.TO_DELIVER: {DeliveryEvent.BEGIN: DeliveryState.DELIVERING},
    DeliveryState.RETRYING: {DeliveryEvent.BEGIN: DeliveryState.DELIVERING},
    DeliveryState.DELIVERING: {DeliveryEvent.SUCCEED: DeliveryState.DELIVERED,
                               DeliveryEvent.FAIL: DeliveryState.RETRYING,
                               DeliveryEvent.SPEND: DeliveryState.UNDELIVERED,
                               DeliveryEvent.CANCEL: DeliveryState.CANCELLING},
    DeliveryState.DELIVERED: {},
    DeliveryState.UNDELIVERED: {},
    DeliveryState.CANCELLING: {},
}


def next_state(table: Mapping[Any, Mapping[Any, Any]], state: Any, event: Any) -> Any:
    """The state `event` moves `state` to, by the table; InvalidTransition if it may not."""
    try:
        return table[state][event]
    except KeyError:
        name = "requests" if table is REQUEST_TRANSITIONS else "deliveries"
        raise InvalidTransition(name, state, event) from None


def allowed_from(table: Mapping[Any, Mapping[Any, Any]], event: Any) -> tuple[Any, ...]:
    """The states `event` may leave: what a guarded statement's `WHERE status IN (...)` lists."""
    return tuple(state for state, moves in table.items() if event in moves)


@dataclass(frozen=True)
class Ending:
    """One way a run ends, and everything that follows from it."""

    name: str                          # the ending's own name (its kind where it has one)
    run: RunStatus
    kind: str | None
    request: RequestStatus | None      # how the run's open request closes; None: it has none
    problem: str | None                # the problem type that describes it; None for a success
    http: int                          # the run object's HTTP status
    v2: str | None                     # the typed API's status of its request
    stream: str | None                 # the typed stream's event for its request
    workflow: int | None               # the status of the error a workflow step sees


_S = RunStatus
_R = RequestStatus
#: Every ending. (The generic row of a status - kind None - covers kinds a workflow raises.)
ENDINGS: Final[dict[str, Ending]] = {e.name: e for e in (
    #       name                run            kind                request        problem             http v2           stream                    workflow
    Ending("succeeded",        _S.SUCCEEDED,  None,               None,          None,               200, None,        None,                     None),
    Ending("answered",         _S.SUCCEEDED,  None,               _R.ANSWERED,   None,               200, "answered",  "interaction.answered",   None),
    Ending("notified",         _S.SUCCEEDED,  None,               _R.NOTIFIED,   None,               200, None,        None,                     None),
    Ending("defaulted",        _S.SUCCEEDED,  "defaulted",        _R.EXPIRED,    None,               200, "expired",   "interaction.expired",    None),
    Ending("invalid_input",    _S.INVALID_INPUT, None,            None,          "invalid_input",    422, None,        None,                     400),
    Ending("conflict",         _S.CONFLICT,   None,               None,          "conflict",         409, None,        None,                     409),
    Ending("unworkable",       _S.CONFLICT,   "unworkable",       None,          "unworkable",       409, None,        None,                     409),
    Ending("effect_unknown",   _S.CONFLICT,   "effect_unknown",   None,          "effect_unknown",   409, None,        None,                     409),
    Ending("tools_called",     _S.CONFLICT,   "tools_called",     None,          "tools_called",     409, None,        None,                     409),
    Ending("run_id_taken",     _S.CONFLICT,   "run_id_taken",     None,          "run_id_taken",     409, None,        None,                     409),
    Ending("unavailable",      _S.UNAVAILABLE, None,              None,          "unavailable",      503, None,        None,                     503),
    Ending("tool_not_offered", _S.UNAVAILABLE, "tool_not_offered", None,         "unavailable",      503, None,        None,                     503),
    Ending("tool_server_failed", _S.UNAVAILABLE, "tool_server_failed", None,     "unavailable",      503, None,        None,                     503),
    Ending("tools_unfinished", _S.UNAVAILABLE, "tools_unfinished", None,         "unavailable",      503, None,        None,                     503),
    Ending("requests_full",    _S.UNAVAILABLE, "requests_full",   None,          "unavailable",      503, None,        None,                     503),
    Ending("rejected",         _S.REJECTED,   None,               None,          "unanswered",       410, None,        None,                     410),
    Ending("expired",          _S.REJECTED,   "expired",          _R.EXPIRED,    "unanswered",       410, "expired",   "interaction.expired",    410),
    Ending("undelivered",      _S.REJECTED,   "undelivered",      _R.UNDELIVERED, "unanswered",      410, "expired",   None,                     410),
    Ending("cancelled",        _S.REJECTED,   "cancelled",        _R.CANCELLED,  "cancelled",        410, "cancelled", "interaction.cancelled",  410),
    Ending("declined",         _S.REJECTED,   "declined",         _R.ANSWERED,   "declined",         410, "answered",  None,                     410),
    Ending("failed",           _S.FAILED,     None,               None,          "failed",           500, None,        None,                     500),
)}
del _S, _R


_ENDING_BY: Final[dict[tuple[RunStatus, str | None], Ending]] = {}
for _e in ENDINGS.values():
    if _e.request is None or (_e.run, _e.kind) not in _ENDING_BY:
        _ENDING_BY[(_e.run, _e.kind)] = _e           # (succeeded, None) is the generic row, not `answered`


def ending_of(status: RunStatus, kind: str | None) -> Ending:
    """The row of ENDINGS for a run's status and kind (the status's own row for a kind it lacks)."""
    return _ENDING_BY.get((status, kind)) or _ENDING_BY[(status, None)]


#: HTTP status of a run object by its status (201 replaces 200 when the run just ran).
RUN_HTTP_STATUS: Final = {
    RunStatus.STARTED: 202, RunStatus.WAITING: 202,
    **{e.run: e.http for e in ENDINGS.values() if e.kind is None and e.request is None},
}
#: The typed API's status of a request, by its status (a notification never shows).
V2_STATUS: Final = {RequestStatus.OPEN.value: "pending",
                    **{e.request.value: e.v2 for e in ENDINGS.values() if e.request is not None and e.v2}}
#: The status of the error a child run's ending raises in its workflow (SPEC section 15).
CHILD_ERROR_STATUS: Final = {e.run.value: e.workflow for e in ENDINGS.values()
                             if e.kind is None and e.request is None and e.workflow is not None}
#: The typed stream's event when a run ends with a given kind, for a typed request.
STREAM_ENDINGS: Final = {e.kind: e.stream for e in ENDINGS.values()
                         if e.run is RunStatus.REJECTED and e.stream is not None}


def ended(name: str, detail: str, **kw: Any) -> Problem:
    """The problem of the ending ENDINGS[name], with its detail (and errors, extra...)."""
    e = ENDINGS[name]
    return ending_problem(e.run, e.kind, detail, **kw)


def ending_problem(status: RunStatus, kind: str | None, detail: str, **kw: Any) -> Problem:
    """The problem that describes a run's ending (SPEC section 6 names, from ENDINGS): a conflict is
    named by its kind (a workflow's own kinds too), every other ending by its row."""
    e = ending_of(status, kind)
    name = kind if status is RunStatus.CONFLICT and kind else e.problem
    return Problem(name or status.value, detail, status=e.http, kind=kind, **kw)


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
    try:
        return timedelta(**{k: float(v) for k, v in m.groupdict().items() if v is not None})
    except OverflowError:
        raise ValueError(f"{text.strip()[:40]!r} is longer than any duration the daemon keeps "
                         f"(at most {timedelta.max.days} days)") from None


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
    """Monotonic ULIDs: 48 bits of wall-clock milliseconds, 80 bits that increase within one.

    The random start of each millisecond comes from os.urandom, drawn RANDOM_POOL bytes at a time:
    the system call lets go of the GIL, and on a busy daemon the loop then waits out the writer's
    turn before it goes on (85 us a call on average under the bench's load, one call every seven
    ids), where one call now serves 409 milliseconds.
    """

    RANDOM_POOL: Final = 4090              # 409 draws of 10 bytes

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ms = -1
        self._last_rand = 0
        self._pool = b""
        self._taken = 0
        if hasattr(os, "register_at_fork"):    # a forked child draws its own: never the parent's next ids
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._pool, self._taken, self._last_ms = b"", 0, -1

    def _random_start(self) -> int:
        """79 random bits (one short of 80, so a millisecond's ids have room to count up)."""
        if self._taken + 10 > len(self._pool):
            self._pool, self._taken = secrets.token_bytes(self.RANDOM_POOL), 0
        start = self._taken
        self._taken = start + 10
        return int.from_bytes(self._pool[start:start + 10], "big") >> 1

    def __call__(self) -> str:
        with self._lock:
            ms = WALL.now_ms()
            if ms <= self._last_ms:
                ms = self._last_ms
                self._last_rand += 1
            else:
                self._last_rand = self._random_start()
            self._last_ms = ms
            value = (ms << 80) | (self._last_rand & ((1 << 80) - 1))
        return "".join(_CROCKFORD[(value >> shift) & 31] for shift in range(125, -1, -5))   # 26 letters


new_ulid: Final = _Ulid()


def new_run_id() -> str:
    return "run_" + new_ulid()


def new_token_secret() -> str:
    return "itd_" + secrets.token_urlsafe(32)


def sha256_hex(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()


def canonical_json(value: Any) -> bytes:
    """`value` as RFC 8785 (JSON Canonicalization Scheme) bytes: sorted keys, no spaces, numbers as
    ECMAScript writes them - the same bytes for the same JSON whoever serialises it. An integer past
    I-JSON's range (2**53) is the double JSON numbers are under JCS."""
    import rfc8785                      # small and pure Python; loaded where a digest is first taken

    try:
        return rfc8785.dumps(value)
    except rfc8785.IntegerDomainError:
        def as_double(v: Any) -> Any:
            if isinstance(v, bool) or not isinstance(v, (int, dict, list)):
                return v
            if isinstance(v, int):
                return float(v) if abs(v) > 2 ** 53 - 1 else v
            return {k: as_double(x) for k, x in v.items()} if isinstance(v, dict) else [as_double(x) for x in v]
        return rfc8785.dumps(as_double(value))


def request_digest(message: str, answer_schema: Any, arguments: Any = None) -> str:
    """What a request shows, bound in 64 hex digits: sha256 of the canonical JSON of
    `{message, answer_schema, arguments}` (arguments null except for an approval's, as shown). An
    answer that names another digest answered something else (`digest_mismatch`)."""
    return hashlib.sha256(canonical_json({"message": message, "answer_schema": answer_schema,
                                          "arguments": arguments})).hexdigest()


def arguments_digest(arguments: Any) -> str:
    """sha256 hex of a tool call's arguments as canonical JSON: what an approval approved, and what
    the call then sent, compare equal."""
    return hashlib.sha256(canonical_json(arguments)).hexdigest()


class JsonRefused(ValueError):
    """JSON the daemon will not keep: why, and where (a JSON Pointer, "" for the whole text)."""

    def __init__(self, message: str, pointer: str = "") -> None:
        super().__init__(message)
        self.pointer = pointer


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonRefused(f"the number {text[:40]} is past the range of a JSON number the daemon keeps (about 1.8e308)")
    return value


def _refuse_constant(name: str) -> Any:
    raise JsonRefused(f"{name} is not a JSON number")


def json_flaw(value: Any, limit: int = MAX_JSON_DEPTH) -> JsonRefused | None:
    """What makes a parsed value one the daemon cannot keep as JSON, or None.

    NaN or an infinity (a JSON number has neither), a lone surrogate in a text or a name (not
    Unicode, so not storable as UTF-8), or nesting deeper than `limit`. Walks without recursion.
    """
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        v, path = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return JsonRefused(f"{v} is not a JSON number", pointer_join(path))
        if isinstance(v, str) and not _is_unicode(v):
            return JsonRefused("a text holds a lone surrogate (\\ud800-\\udfff), which is not Unicode", pointer_join(path))
        if isinstance(v, (dict, list)):
            if len(path) >= limit:
                return JsonRefused(f"the value nests deeper than {limit} levels", pointer_join(path))
            if isinstance(v, dict):
                for k, c in v.items():
                    if isinstance(k, str) and not _is_unicode(k):
                        return JsonRefused("a name holds a lone surrogate (\\ud800-\\udfff), which is not Unicode",
                                           pointer_join(path))
                    stack.append((c, path + (k,)))
            else:
                stack.extend((c, path + (i,)) for i, c in enumerate(v))
    return None


def nul_pointer(value: Any, base: str = "") -> str | None:
    """The JSON pointer (under `base`) of the first text or name in `value` that holds a NUL
    character (U+0000), or None. PostgreSQL keeps no NUL in a text, so neither backend keeps one:
    a value that holds one is refused where it enters. Walks without recursion."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if "\x00" in v:
                return base + pointer_join(path)
        elif isinstance(v, dict):
            if any(isinstance(k, str) and "\x00" in k for k in v):
                return base + pointer_join(path)            # the object whose name holds it
            stack.extend((c, path + (k,)) for k, c in reversed(list(v.items())))
        elif isinstance(v, list):
            stack.extend((c, path + (i,)) for i, c in reversed(list(enumerate(v))))
    return None


#: What a refusal of a NUL character says, at its pointer.
NUL_MESSAGE: Final = "holds a NUL character (\\u0000), which no text the daemon keeps may hold"


def refuse_nul(value: Any, base: str, what: str) -> None:
    """Refuse `value` (an input, an answer, the text at `base`) where a text or name in it holds a
    NUL: invalid_input (422) at its pointer, on every backend and whichever door it came through."""
    pointer = nul_pointer(value, base)
    if pointer is not None:
        raise ending_problem(RunStatus.INVALID_INPUT, None, f"{what} {NUL_MESSAGE}",
                             errors=[{"pointer": pointer, "message": NUL_MESSAGE}])


def _is_unicode(text: str) -> bool:
    try:
        text.encode()
        return True
    except UnicodeEncodeError:
        return False


def read_json(raw: bytes | str) -> Any:
    """JSON as a request or an argument carries it; JsonRefused (a ValueError) where it is not
    JSON the daemon can keep: malformed, NaN or Infinity, a number past a float's range, nesting
    too deep for the parser, a lone surrogate.

    orjson reads it first, where it reads it as the standard library does: it refuses NaN,
    infinities, lone surrogates, invalid UTF-8 and nesting past 1,024 levels itself, and it is not
    asked to read an integer past 64 bits (it would read a float). Whatever it refuses is read
    again below, which says why in the daemon's words.
    """
    if _orjson is not None and len(raw) < 4 * MIB and not _LONG_NUMBER.search(raw if isinstance(raw, bytes) else
                                                                               raw.encode("utf-8", "surrogatepass")):
        try:
            return _orjson.loads(raw)
        except ValueError:
            pass
    try:
        value = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except JsonRefused:
        raise
    except json.JSONDecodeError as exc:
        raise JsonRefused(f"malformed JSON: {exc}") from None
    except UnicodeDecodeError:
        raise JsonRefused("malformed JSON: not UTF-8 text") from None
    except RecursionError:
        raise JsonRefused("JSON nested too deep to read") from None
    except ValueError:                   # an integer of more digits than Python converts
        raise JsonRefused(f"an integer of more than {sys.get_int_max_str_digits()} digits") from None
    if not isinstance(raw, bytes) or b"\\u" in raw or b"\xed" in raw:
        flaw = json_flaw(value, limit=sys.getrecursionlimit())
        if flaw is not None:
            raise flaw
    return value


def dumps(value: Any) -> str:
    """Compact JSON, as stored and as measured against the byte bounds.

    orjson writes it: five to ten times faster than the standard library, and the same text but
    for how a few floats are spelled (0.00001 and 2.5e-7, not 1e-05 and 2.5e-07: the same numbers
    when read). What orjson does not take (an integer past 64 bits, a name that is not text) the
    standard library writes. A NaN or an infinity, which JSON cannot carry and which nothing the
    daemon reads holds (see read_json), orjson writes as null."""
    if _orjson is not None:
        try:
            return _orjson.dumps(value).decode()
        except TypeError:
            pass
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


#: A run of 19 digits: an integer orjson might read as a float (past 64 bits), so read_json does not ask it.
_LONG_NUMBER: Final = re.compile(rb"[0-9]{19}")
_LONG_NUMBER_TEXT: Final = re.compile(r"[0-9]{19}")


def loads(text: str) -> Any:
    """JSON the daemon wrote (a row's column): orjson reads it, but for an integer past 64 bits,
    which it would read as a float and the standard library reads as it was written."""
    if _orjson is not None and not _LONG_NUMBER_TEXT.search(text):
        return _orjson.loads(text)
    return json.loads(text)


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


def _same_json(a: Any, b: Any) -> bool:
    """JSON equality: true is not 1, and 1 is 1.0."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(v, b[k]) for k, v in a.items())
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def json_patch(before: Any, after: Any, at: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    """The RFC 6902 JSON Patch that turns `before` into `after`: `add`, `remove` and `replace` at the
    deepest place each difference stands (a list of another length is replaced whole)."""
    if _same_json(before, after):
        return []
    if isinstance(before, dict) and isinstance(after, dict):
        ops: list[dict[str, Any]] = []
        for k in before:
            if k not in after:
                ops.append({"op": "remove", "path": pointer_join(at + (k,))})
        for k, v in after.items():
            if k not in before:
                ops.append({"op": "add", "path": pointer_join(at + (k,)), "value": v})
            else:
                ops += json_patch(before[k], v, at + (k,))
        return ops
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [op for i, (x, y) in enumerate(zip(before, after)) for op in json_patch(x, y, at + (i,))]
    return [{"op": "replace", "path": pointer_join(at), "value": after}]


def json_patch_apply(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """`doc` with the `add`, `remove` and `replace` operations of a patch `json_patch` made applied
    (to a copy); LookupError where an operation's place is not there."""
    doc = json.loads(dumps(doc))
    for op in ops:
        parts = pointer_parse(op["path"])
        if not parts:
            doc = op.get("value")
            continue
        parent = pointer_get(doc, parts[:-1])
        key: Any = parts[-1]
        if isinstance(parent, list):
            key = int(key)
        elif not isinstance(parent, dict):
            raise LookupError(f"nothing holds {op['path']}")
        if op["op"] == "remove":
            del parent[key]
        else:
            parent[key] = op["value"]
    return doc


# The clock. Every schedule of the product reads one clock object; `ManualClock` stands still
# until told to move, so tests and demos show a two-day expiry in a second. Times are integer
# milliseconds since the epoch, in the database and in memory; RFC 3339 only at the edges. Nothing
# else reads the time of day: what is not the daemon's schedule (a ULID's time, a Retry-After date,
# the command line's token stamps) reads `WALL`, the system clock.

class Clock(Protocol):
    """What every reader of the time sees: the daemon's clock, system or manual."""

    manual: bool

    def now_ms(self) -> int: ...

    def on_change(self, callback: Callable[[], None]) -> None: ...


class SystemClock:
    manual = False

    def now_ms(self) -> int:
        return int(time.time() * 1000)

    def on_change(self, callback: Callable[[], None]) -> None:
        """The real clock only moves forward by itself; nobody needs telling."""


class ManualClock:
    manual = True

    def __init__(self, start_ms: int | None = None) -> None:
        self._now = start_ms if start_ms is not None else WALL.now_ms()
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

    def catch_up(self, ms: int) -> None:
        """Move to `ms` (never back) without telling the listeners: another daemon sharing the
        database moved the clock, and fires what fell due."""
        self._now = max(self._now, ms)


#: The system clock, for what is not the daemon's schedule.
WALL: Final = SystemClock()

#: 9999-12-31T23:59:59.999Z: the last moment RFC 3339 writes; no clock moves past it.
MAX_TIME_MS: Final = 253_402_300_799_999


def fmt_time(ms: int | None) -> str | None:
    """RFC 3339 UTC with milliseconds: 2026-11-30T03:33:18.123Z."""
    if ms is None:
        return None
    seconds, millis = divmod(ms, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(seconds)) + f"{millis:03d}Z"


def parse_rfc3339(text: Any) -> int:
    """An RFC 3339 time with its offset (`2026-12-02T09:00:00Z`, `...+01:00`) as milliseconds since the
    epoch; ValueError says what it is not."""
    if not isinstance(text, str) or not re.fullmatch(
            r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})", text):
        raise ValueError("an RFC 3339 time with its offset, such as 2026-12-02T09:00:00Z")
    try:
        when = datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", text).replace("z", "Z"))
    except ValueError as exc:
        raise ValueError(f"not a time: {exc}") from None
    return int(when.timestamp() * 1000)


def fmt_date(ms: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(ms // 1000))


def encode_cursor(values: list[Any]) -> str:
    return base64.urlsafe_b64encode(dumps(values).encode()).decode().rstrip("=")


#: The largest integer SQLite stores (signed 64 bits): a position, a version or an id past it is no row's.
MAX_SQL_INT: Final = 2 ** 63 - 1


def decode_cursor(cursor: str) -> list[Any]:
    """The positions a next_cursor holds: a non-empty list of whole numbers that SQLite can compare."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        values = json.loads(raw)
        if not isinstance(values, list) or not values:
            raise ValueError
        if not all(type(v) is int and 0 <= v <= MAX_SQL_INT for v in values):
            raise ValueError
        return values
    except Exception:
        raise bad_request("The cursor does not decode; pass next_cursor from the previous page as it came.",
                          errors=[{"pointer": "/cursor", "message": "next_cursor of the previous page, as it came"}]) from None


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


# Patterns are matched by RE2 in time linear in the text, read in ECMA-262's dialect (the rules
# are written out where JSON Schemas are, in Documents); templates' static analysis matches
# `patternProperties` with them too.

_ECMA_ESCAPE_RE: Final = re.compile(
    r"\\(?:u(D[89AB][0-9A-F]{2})\\u(D[C-F][0-9A-F]{2})|u([0-9A-F]{4})|u\{([0-9A-F]{1,6})\}|c([A-Z])|(.))",
    re.S | re.I)


def _re2_source(pattern: str) -> str:
    """An ECMA-262 pattern in RE2's spelling: its `\\u` and `\\c` escapes as `\\x{...}`."""
    def escape(m: re.Match[str]) -> str:
        high, low, four, braced, control, _ = m.groups()
        if high:
            code = 0x10000 + ((int(high, 16) - 0xD800) << 10) + (int(low, 16) - 0xDC00)
        elif four or braced:
            code = int(four or braced, 16)
        elif control:
            code = ord(control) % 32
        else:
            return m.group(0)
        return f"\\x{{{code:X}}}"
    return _ECMA_ESCAPE_RE.sub(escape, pattern)


@functools.cache
def _re2_options() -> Any:
    import re2
    options = re2.Options()
    options.log_errors = False     # a refused pattern is told to its writer, not to stderr
    options.never_capture = True   # only whether it matches: the fastest of RE2's engines
    return options


def _re2_compile(pattern: str) -> tuple[Any, str | None]:
    """The RE2 program of an ECMA-262 pattern, or None and why RE2 cannot take it."""
    import re2
    try:
        return re2.compile(_re2_source(pattern), _re2_options()), None
    except re2.error as exc:
        reason = exc.args[0] if exc.args else "RE2 refuses it"
        return None, reason.decode(errors="replace") if isinstance(reason, bytes) else str(reason)
    except UnicodeError:
        return None, "it holds a lone surrogate"


#: Schemas' patterns, compiled once each (a validator is cached too; this outlives its schema).
_re2_program: Final = functools.lru_cache(maxsize=256)(_re2_compile)


@functools.lru_cache(maxsize=256)
def _unchecked_pattern(pattern: str, reason: str) -> None:
    log.warning("a schema's pattern %r is not checked: RE2 cannot take it (%s)", pattern, reason)


def _finds(pattern: str, text: str) -> bool | None:
    """Whether `pattern` matches somewhere in `text`; None when RE2 cannot take the pattern."""
    program, reason = _re2_program(pattern)
    if program is None:
        _unchecked_pattern(pattern, reason or "")
        return None
    return program.search(text.encode("utf-8", "surrogatepass")) is not None



# Templates ######################################################################################
#
# Every text of a function that can differ from run to run is a Liquid template: `to`, `from`,
# the message, and each string inside a `with` tree. All of them compile in one locked-down
# environment, `_liquid().env`:
#
#   - strict: reading a name that is not there is an error (`| default:` still works), so is a
#     filter that does not exist; nothing is HTML-escaped, and there is no other template to
#     `include` or `render`, so no template reads a file;
#   - bounded: loop iterations, output size and assigned values are capped (TEMPLATE_*), and so
#     is every value a filter reads or makes (`_BoundedFilter`): a filter whose result would pass
#     the bound fails before it builds it, so `replace` chained eight times fails at once instead of
#     building a gigabyte; together the filters of one render read and make a bounded amount, so a
#     render never hangs and never eats memory;
#   - known in advance: a template lists the names it reads (the library's static analysis), so
#     `check_template` refuses, when the document is saved, a name its place does not offer, a
#     property the input schema does not allow, or an object printed inside text;
#   - cheap to check: before python-liquid parses a template, `markup_problem` refuses what it
#     would take seconds over (brackets nested deep, an opening nothing closes) and charges the
#     document's tags to its bounds (MAX_DOCUMENT_TAGS, MAX_DOCUMENT_MARKUP).
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


def _write_text(node: OutputNode, context: RenderContext, buffer: Any) -> int:
    value = node.expression.evaluate(context)
    if not _is_undefined(value) and isinstance(value, (Mapping, list, tuple)):
        what = "an object" if isinstance(value, Mapping) else "a list"
        raise _liquid().structure_error(f"{node.expression} is {what}; write `| json` to put it in text",
                                        token=node.token)
    return buffer.write(_liquid().to_text(value, context.autoescape))


#: What one item of a list or an object counts, beyond its contents: a list of a million empty
#: strings is small as text but not in memory, nor in the time a filter takes over it.
_ITEM_COST: Final = 16
#: Filters that read nothing but the top of their value, whatever its size.
_READ_NOTHING: Final = frozenset({"size", "first", "last", "default"})


def _value_size(value: Any, cap: int = TEMPLATE_VALUE_LIMIT) -> int:
    """What `value` takes: characters of its text, digits of its numbers, _ITEM_COST an item.

    Counting stops just past `cap`, so measuring a large value costs no more than the bound.
    """
    total = 0
    stack = [value]
    while stack and total <= cap:
        item = stack.pop()
        kind = type(item)   # type(), not isinstance(): a strict undefined refuses to be asked its class
        if issubclass(kind, str):
            total += len(item)
        elif issubclass(kind, int):
            total += item.bit_length() * 3 // 10 + 1
        elif issubclass(kind, range):   # lazy: (1..10000000000) takes nothing until a filter lists it
            total += max((item.stop - item.start) // item.step, 0) * _ITEM_COST
        elif issubclass(kind, Mapping):
            total += _ITEM_COST * len(item)
            if total <= cap:
                for k, v in item.items():
                    stack.append(k)
                    stack.append(v)
        elif issubclass(kind, (list, tuple)):
            total += _ITEM_COST * len(item)
            if total <= cap:
                stack.extend(item)
        else:
            total += _ITEM_COST
    return total


def _as_text(value: Any) -> str:
    """A filter's operand as the string filters read it (an undefined as nothing)."""
    if issubclass(type(value), str):
        return value
    return "" if value is None or _is_undefined(value) else str(value)


def _result_estimate(name: str, left: Any, args: tuple[Any, ...], read: int) -> int:
    """What the result of a filter that multiplies its value will take, before it is built."""
    if name == "replace" and args:
        text, old = _as_text(left), _as_text(args[0])
        new = len(_as_text(args[1])) if len(args) > 1 else 0
        count = text.count(old) if old else len(text) + 1
        return len(text) + count * max(new - len(old), 0)
    if name == "join" and issubclass(type(left), (list, tuple, range)):
        sep = len(_as_text(args[0])) if args else 1
        return read + len(left) * sep
    return 0


class _BoundedFilter:
    """A registered filter, wrapped: what it reads and what it makes are measured and bounded.

    Each value it reads (bar `_READ_NOTHING`) is at most TEMPLATE_VALUE_LIMIT; the result of a
    filter that multiplies its value (`replace`, `join`) is estimated before it is built, and every
    result is measured after. `date` reads no date longer than TEMPLATE_DATE_CHARS, nor a format
    (strftime writes up to 256 characters for each of its own). What the filters of one render
    read and make is tallied against TEMPLATE_WORK_LIMIT (`uniq` counts its comparisons). Each
    failure is a `value_limit_error`, a render failure of kind "limit".
    """

    with_context = True

    def __init__(self, name: str, func: Callable[..., Any], env: Environment) -> None:
        self.name = name
        self.func = functools.partial(func, environment=env) if getattr(func, "with_environment", False) else func

    def _fail(self, what: str) -> None:
        raise _liquid().value_limit_error(f"{self.name}: {what}", token=None)

    def __call__(self, left: Any, *args: Any, context: RenderContext, **kwargs: Any) -> Any:
        limit = TEMPLATE_VALUE_LIMIT
        read = 0
        if self.name not in _READ_NOTHING:
            for value in (left, *args, *kwargs.values()):
                size = _value_size(value)
                if size > limit:
                    self._fail(f"it reads a value past {limit // KIB} KiB, the most a template computes with")
                read += size
        if self.name == "date":
            if issubclass(type(left), str) and len(left) > TEMPLATE_DATE_CHARS:
                return left   # no date is that long; the filter gives back what is not a date
            if args and len(_as_text(args[0])) > TEMPLATE_DATE_CHARS:
                self._fail(f"its format passes {TEMPLATE_DATE_CHARS} characters")
        if self.name == "uniq" and issubclass(type(left), (list, tuple)):
            read += len(left) * len(left) // 2   # it compares each item with those before it
        if _result_estimate(self.name, left, args, read) > limit:
            self._fail(f"its result would pass {limit // KIB} KiB, the most a template computes")
        work = context.tag_namespace.setdefault("interactiond.work", [0])
        work[0] += read
        if work[0] > TEMPLATE_WORK_LIMIT:
            self._fail(f"the filters of this template read and make more than {TEMPLATE_WORK_LIMIT // MIB} MiB")
        result = self.func(left, *args, **kwargs)
        if type(result) is int and result.bit_length() * 3 // 10 > TEMPLATE_NUMBER_DIGITS:
            self._fail(f"its result passes {TEMPLATE_NUMBER_DIGITS} digits")
        size = _value_size(result)
        if size > limit:
            self._fail(f"its result passes {limit // KIB} KiB, the most a template computes")
        work[0] += size
        return result


@dataclass(frozen=True)
class _Liquid:
    """python-liquid, locked down: the environment every template compiles in, and the classes of
    ours it renders with. Made on first use (`_liquid()`), so a command that renders no template
    never loads the library."""

    env: Any                #: the one environment every template compiles in
    output_node: type       #: a `{{ ... }}` of ours: an object or a list inside text is an error
    structure_error: type   #: an object or a list was printed inside text
    value_limit_error: type  #: a value a render computes would pass its bound
    undefined: type         #: the library's undefined value (a name that is not there)
    to_text: Callable[[Any, bool], str]  #: a value as Liquid prints it


@functools.cache
def _liquid() -> _Liquid:
    """python-liquid and the one locked-down environment, loaded and made by the first template."""
    from liquid import Environment, StrictDefaultUndefined
    from liquid.builtin.output import Output, OutputNode
    from liquid.builtin.tags.echo_tag import EchoNode, EchoTag
    from liquid.exceptions import LiquidError, ResourceLimitError
    from liquid.extra import JSON as LiquidJSON
    from liquid.stringify import to_liquid_string
    from liquid.undefined import Undefined

    class _StructureError(LiquidError):
        """An object or a list was printed inside text."""

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

    class _ValueLimitError(ResourceLimitError):
        """A value a render computes would pass its bound (TEMPLATE_VALUE_LIMIT and the others)."""

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

    env = _LiquidEnv(undefined=StrictDefaultUndefined, strict_filters=True, autoescape=False)
    env.add_tag(_Output)
    env.add_tag(_Echo)
    for name in ("include", "render"):
        env.tags.pop(name, None)
    env.filters["json"] = LiquidJSON(default=str)
    env.filters = {name: _BoundedFilter(name, func, env) for name, func in env.filters.items()}
    return _Liquid(env, _OutputNode, _StructureError, _ValueLimitError, Undefined, to_liquid_string)


def _render_error(exc: BaseException) -> RenderError:
    from liquid.exceptions import LiquidError, ResourceLimitError, UndefinedError
    message = str(exc.message) if isinstance(exc, LiquidError) else f"{type(exc).__name__}: {exc}"
    if isinstance(exc, UndefinedError):
        return RenderError("undefined", message)
    if isinstance(exc, _liquid().structure_error):
        return RenderError("structure", message)
    if isinstance(exc, ResourceLimitError):
        return RenderError("limit", message)
    return RenderError("error", message)


def _is_undefined(value: Any) -> bool:
    # isinstance() would ask the value for its __class__, which a strict undefined refuses.
    return issubclass(type(value), _liquid().undefined)


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
    return _liquid().to_text(value, False)


#: Words python-liquid 2 reserves inside expressions even after a dot, where Liquid lets a path
#: use them (`input.limit`); they are rewritten as `input["limit"]` before compiling.
_RESERVED_MEMBER_RE: Final = re.compile(
    r"(\"[^\"]*\"|'[^']*')|(?<=[\w\]?])\.(true|false|nil|null|empty|blank|and|or|contains|not|in|offset"
    r"|limit|reversed|cols|continue|with|for|as|if|else|required)(?![\w?-])")
_MARKUP_OPEN_RE: Final = re.compile(r"\{[{%]")


def _markup_spans(source: str, unclosed: bool = False) -> Iterable[tuple[int, int]]:
    r"""Where the tags of a template are: each `{{ ... }}` and `{% ... %}`, start and end.

    What `re.finditer(r"\{\{.*?\}\}|\{%.*?%\}", source, re.S)` finds, in time linear in the source
    (that pattern looks for a closing from every opening: a text of unclosed `{{` took seconds).
    With `unclosed`, an opening that nothing after it closes comes too, as (start, -1).
    """
    pos = 0
    closes = {"{{": "}}", "{%": "%}"}
    never: set[str] = set()             # openings no later text closes
    while (m := _MARKUP_OPEN_RE.search(source, pos)) is not None:
        start, opening = m.start(), m.group()
        end = -1 if opening in never else source.find(closes[opening], start + 2)
        if end < 0:
            never.add(opening)
            if unclosed:
                yield start, -1
            pos = start + 1
            continue
        yield start, end + 2
        pos = end + 2


def _unreserve(source: str) -> str:
    def member(m: re.Match[str]) -> str:
        return m.group(1) or f'["{m.group(2)}"]'
    pieces, pos = [], 0
    for start, end in _markup_spans(source):
        pieces += [source[pos:start], _RESERVED_MEMBER_RE.sub(member, source[start:end])]
        pos = end
    return "".join(pieces) + source[pos:] if pieces else source


#: What nests inside a tag: brackets, and the quoted texts whose brackets do not count.
_NESTING_RE: Final = re.compile(r"""[(\[]|[)\]]|"[^"]*"|'[^']*'""")
#: The tags whose text python-liquid's lexer takes whole, up to their end tag, and those ends.
_VERBATIM_RE: Final = re.compile(r"\{%-?\s*(raw|doc)\s*-?%\}")
_VERBATIM_END: Final = {name: re.compile(r"\{%-?\s*end" + name + r"\s*-?%\}") for name in ("raw", "doc")}


@dataclass(slots=True)
class MarkupBudget:
    """What the templates of one document may still hold: tags and the characters inside them."""

    tags: int = MAX_DOCUMENT_TAGS
    chars: int = MAX_DOCUMENT_MARKUP
    spent: bool = False                 # a template took it past a bound (refused once)


def markup_problem(source: str, budget: MarkupBudget | None = None) -> tuple[int, str] | None:
    """Why `source` is refused before it is parsed, as (index in it, message), or None.

    python-liquid's lexer looks for the end of an opening from each one: an opening that nothing
    closes (`{{` without `}}`), and a `{% raw %}` or `{% doc %}` without its end tag, are refused
    here, where finding that out takes no time. So is a tag whose parentheses and brackets nest
    past MAX_TEMPLATE_NESTING. `budget`, when given, is charged with the template's tags (a
    `{% liquid %}` tag one a line) and the characters inside them, and the tag that takes it
    past its bounds is refused.
    """
    verbatim_end = 0                    # the text up to here is a raw or doc block's
    for start, end in _markup_spans(source, unclosed=True):
        if start < verbatim_end:
            continue
        if end < 0:
            opening = source[start:start + 2]
            return start, f"`{opening}` opens a tag that nothing closes (`{'}}' if opening == '{{' else '%}'}`)"
        verbatim = _VERBATIM_RE.fullmatch(source, start, end)
        if verbatim:
            name = verbatim.group(1)
            closing = _VERBATIM_END[name].search(source, end)
            if closing is None:
                return start, f"`{{% {name} %}}` needs its `{{% end{name} %}}`"
            verbatim_end = closing.end()
        depth = 0
        for m in _NESTING_RE.finditer(source, start, end):
            bracket = m.group()
            if bracket in ("(", "["):
                depth += 1
                if depth > MAX_TEMPLATE_NESTING:
                    return m.start(), (f"parentheses and brackets nest more than {MAX_TEMPLATE_NESTING} deep"
                                       " inside one tag")
            elif bracket in (")", "]"):
                depth = max(depth - 1, 0)
        if budget is not None:
            budget.tags -= 1 + source.count("\n", start, end)
            budget.chars -= end - start
            if budget.tags < 0 or budget.chars < 0:
                budget.spent = True
                return start, (f"the document's templates hold more than {MAX_DOCUMENT_TAGS} tags"
                               if budget.tags < 0 else
                               f"the document's templates hold more than {MAX_DOCUMENT_MARKUP // KIB} KiB in their tags")
    return None


# Plain templates. Most templates only print names: `{{ input.owner }}`, or a message of text
# with `{{ input.brief }}` in it. Such a template renders without Liquid: each name is looked up in
# the context as Liquid looks it up (a dict's member at each step), and the text is joined as
# Liquid's output buffer writes it (each piece counted against TEMPLATE_OUTPUT_LIMIT in UTF-8, its
# \r\n and \r made \n piece by piece). Anything else goes to Liquid, which says what is wrong: a name
# not there, a member of something that is not a dict, an object or a list inside text, a text past
# the limit, a lone surrogate. The bench's `to` 3.2 -> 0.2 us, its message 9.9 -> 0.8 us.

#: Names Liquid itself puts in a render's scope above the context (BoundTemplate's namespace): a
#: template that reads one is always rendered by Liquid.
_LIQUID_OWN_NAMES: Final = frozenset({"partial", "template"})


def _plain_parts(nodes: list[Any]) -> tuple[str | tuple[str, ...], ...] | None:
    """A template's nodes as text and plain names (`{{ name }}`, `{{ input.a.b }}`: no filter, no
    index, no name inside a name), or None when a node is anything else."""
    from liquid.builtin.content import ContentNode
    from liquid.builtin.expressions import FilteredExpression, Path as LiquidPath
    parts: list[str | tuple[str, ...]] = []
    for node in nodes:
        if type(node) is ContentNode:
            parts.append(node.text)
        elif type(node) is _liquid().output_node:
            expr = node.expression
            if type(expr) is not FilteredExpression or expr.filters or type(expr.left) is not LiquidPath:
                return None
            path = expr.left.path
            if not path or any(type(seg) is not str for seg in path) or path[0] in _LIQUID_OWN_NAMES:
                return None
            parts.append(tuple(path))
        else:
            return None
    return tuple(parts)


def _plain_value(ctx: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    """The value a plain name reads, or _MISSING where Liquid would have to say why there is none."""
    value = ctx.get(path[0], _MISSING)
    for key in path[1:]:
        if type(value) is not dict:
            return _MISSING
        value = value.get(key, _MISSING)
    return value


def _liquid_newlines(text: str) -> str:
    """What Liquid's output buffer (a StringIO with universal newlines) keeps of one piece written."""
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


class Template:
    """A compiled template and the line of the document it starts on."""

    __slots__ = ("source", "line", "_bound", "_whole", "_parts")

    def __init__(self, source: str, line: int = 1) -> None:
        self.source = source
        self.line = line
        self._bound = _liquid().env.from_string(_unreserve(source))  # LiquidError when it does not compile
        nodes = self._bound.nodes
        self._whole = nodes[0] if len(nodes) == 1 and isinstance(nodes[0], _liquid().output_node) else None
        self._parts = _plain_parts(nodes)     # None: Liquid renders it

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

    @property
    def plain(self) -> bool:
        """True when the template renders without Liquid where its names are there (see above)."""
        return self._parts is not None

    def render(self, ctx: Mapping[str, Any]) -> Any:
        """The value of a whole expression, typed; the rendered text of anything else."""
        if self._whole is None:
            return self.render_text(ctx)
        if self._parts is not None:
            value = _plain_value(ctx, self._parts[0])   # type: ignore[arg-type]
            if value is not _MISSING:
                return _plain(value)
        return self._liquid_value(ctx)

    def _liquid_value(self, ctx: Mapping[str, Any]) -> Any:
        """`render` of a whole expression by Liquid."""
        from liquid import RenderContext
        assert self._whole is not None
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
        if self._parts is not None:
            pieces = []
            for part in self._parts:
                if type(part) is str:
                    pieces.append(part)
                    continue
                value = _plain_value(ctx, part)
                if value is _MISSING or isinstance(value, (Mapping, list, tuple)):
                    break
                pieces.append(value if type(value) is str else _liquid().to_text(value, False))
            else:
                text = "".join(pieces)
                try:
                    size = len(text.encode())
                except UnicodeEncodeError:
                    size = TEMPLATE_OUTPUT_LIMIT + 1
                if size <= TEMPLATE_OUTPUT_LIMIT:
                    return "".join(map(_liquid_newlines, pieces)) if "\r" in text else text
        return self._liquid_text(ctx)

    def _liquid_text(self, ctx: Mapping[str, Any]) -> str:
        """`render_text` by Liquid."""
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
#: The request's own link (SPEC 18), for the message and the sending tool's arguments.
_REQUEST_NAMES: Final = frozenset({"request.answer_url"})
_SENT_NAMES: Final = frozenset({"to", "sent.conversation", "sent.id"})

#: The names each place of a document reads (the behaviour reference's table).
PLACES: Final[dict[str, Place]] = {
    "party": Place(_RUN_NAMES, text=True),
    "message": Place(_RUN_NAMES | _REQUEST_NAMES, text=True),
    "call.with": Place(_RUN_NAMES),
    "deliver.with": Place(_RUN_NAMES | _REQUEST_NAMES | {"to", "message", "run_id", "function", "expires_at",
                                                         "answer_schema"}),
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
        found = _finds(pattern, name) if isinstance(pattern, str) else None
        if found is None:
            return None, None
        if found:
            return sub, None
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
    from liquid import RenderContext
    from liquid.builtin.output import OutputNode
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


def check_template(source: str, line: int, place: Place, input_schema: Any = None,
                   budget: MarkupBudget | None = None) -> tuple[Template | None, list[tuple[int, str]]]:
    """Compile `source` for `place`; the template, or the problems as (line, message) pairs.

    `budget` is what the document's templates may still hold (`markup_problem`); once a template
    has taken it past its bounds, the document is refused and its later templates are not parsed.
    """
    problems: list[tuple[int, str]] = []
    if "${" in source:
        problems.append((line + _line_of(source, source.index("${")),
                         "a template holds no `${`: a document is never filled from the environment"))
    if budget is not None and budget.spent:
        return None, problems
    found = markup_problem(source, budget)
    if found is not None:
        return None, problems + [(line + _line_of(source, found[0]), found[1])]
    from liquid.exceptions import LiquidError
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
        if name not in _liquid().env.filters:
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
# never fetched (jsonschema's default registry would fetch it), and a schema that names anything
# outside itself (a `$ref` it does not hold, an `$id` on the network) is refused when saved.
#
# Patterns are matched by RE2, never by Python's backtracking `re`: RE2 takes time linear in the
# text, so `^(a+)+$` checks forty characters as fast as four. The validator classes are
# jsonschema's own with `pattern`, `patternProperties` and `additionalProperties` matching through
# `_finds` (`_linear`), and the `regex` format is "a pattern RE2 takes"; `unevaluatedProperties`,
# which jsonschema matches by `re`, is refused beside `patternProperties`. A schema is written in
# ECMA-262's dialect: `_re2_source` rewrites the escapes RE2 spells otherwise (`\uXXXX`, `\u{X}`,
# `\cX`); `\d`, `\w`, `\p{L}` and the rest mean what they say. A pattern RE2 cannot take (a
# backreference, a lookaround, a repetition past 1000) is refused when a document is saved, with
# its line. A schema from elsewhere (a tool server's) may hold one: its validator leaves that
# pattern unchecked, says so once in the log, and the tool server checks its own arguments.

def _regex_ok(instance: object) -> bool:
    """The `regex` format: a pattern RE2 takes (not cached: answers are not schemas)."""
    return not isinstance(instance, str) or _re2_compile(instance)[0] is not None


def _pattern_refusal(pattern: Any) -> str:
    reason = _re2_compile(pattern)[1] if isinstance(pattern, str) else "not a text"
    return (f"the pattern {pattern!r} cannot be matched in linear time ({reason}); patterns are matched "
            "by RE2, which takes no backreference, lookahead or lookbehind")


@functools.cache
def _jsonschema() -> Any:
    """The jsonschema package, loaded on first use (a command that checks no schema never loads it).

    It imports the checkers of some formats as it loads when their packages are installed; two
    cost time (rfc3987_syntax builds a grammar for `iri`: seconds; isoduration for `duration`: a
    tenth of one). They are kept out while it loads; each loads on the first value of its format.
    """
    deferred = [m for m in ("rfc3987_syntax", "isoduration") if sys.modules.setdefault(m, None) is None]  # type: ignore[arg-type]
    try:
        import jsonschema
        import jsonschema.exceptions
        import jsonschema.validators
    finally:
        for name in deferred:
            del sys.modules[name]
    return jsonschema


def _kw_pattern(validator: Any, pattern: Any, instance: Any, schema: Any) -> Iterable[ValidationError]:
    if validator.is_type(instance, "string") and isinstance(pattern, str) and _finds(pattern, instance) is False:
        yield _jsonschema().ValidationError(f"{instance!r} does not match {pattern!r}")


def _kw_pattern_properties(validator: Any, patterns: Any, instance: Any, schema: Any) -> Iterable[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _finds(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _unlisted(instance: dict[str, Any], schema: Any) -> list[str]:
    """The keys of `instance` that neither `properties` nor `patternProperties` of `schema` name."""
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    return [key for key in instance
            if key not in properties and not any(_finds(p, key) is not False for p in patterns)]


def _kw_additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Iterable[ValidationError]:
    # jsonschema's own, with its patterns matched by RE2; the messages are its messages
    if not validator.is_type(instance, "object"):
        return
    extras = set(_unlisted(instance, schema))
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif not extra and extras:
        if "patternProperties" in schema:
            verb = "does" if len(extras) == 1 else "do"
            joined = ", ".join(repr(each) for each in sorted(extras))
            patterns = ", ".join(repr(each) for each in sorted(schema["patternProperties"]))
            yield _jsonschema().ValidationError(f"{joined} {verb} not match any of the regexes: {patterns}")
        else:
            names = sorted(extras, key=str)
            yield _jsonschema().ValidationError(f"Additional properties are not allowed ({', '.join(repr(n) for n in names)} "
                                  f"{'was' if len(names) == 1 else 'were'} unexpected)")


#: jsonschema matches these by Python's `re` when a schema holds both (`_linear`).
_KEYWORDS_BY_RE: Final = frozenset({"patternProperties", "unevaluatedProperties"})


def _unchecked(validator: Any, value: Any, instance: Any, schema: Any) -> Iterable[ValidationError]:
    return iter(())


@functools.lru_cache(maxsize=None)
def _linear(cls: Any, unevaluated: bool = True) -> Any:
    """The validator class `cls` with every keyword that matches a pattern matching by RE2.

    jsonschema's `unevaluatedProperties` matches `patternProperties` by Python's `re`: a schema
    holding both is refused when saved, and one from elsewhere gets `unevaluated=False`, which
    leaves that keyword unchecked.
    """
    keywords = {"pattern": _kw_pattern, "patternProperties": _kw_pattern_properties,
                "additionalProperties": _kw_additional_properties}
    if not unevaluated:
        keywords["unevaluatedProperties"] = _unchecked
    linear = _jsonschema().validators.extend(cls, keywords)
    linear.__name__ = linear.__qualname__ = cls.__name__   # the dialect's name, as validator_for gives it
    return linear


def _iri_ok(rule: str, instance: object) -> bool:
    if not isinstance(instance, str):
        return True
    try:
        from rfc3987_syntax import is_valid_syntax
    except ImportError:                       # not installed: the format passes unchecked
        return True
    return bool(is_valid_syntax(rule, instance))


def _duration_ok(instance: object) -> bool:
    if not isinstance(instance, str):
        return True
    try:
        import isoduration
    except ImportError:                       # not installed: the format passes unchecked
        return True
    try:
        isoduration.parse_duration(instance)
    except isoduration.DurationParsingException:
        return False
    return instance.endswith(tuple("DMYWHMS"))   # isoduration also takes "P" and "PT" alone


@functools.lru_cache(maxsize=None)
def _format_checker(cls: Any, regex: bool = True) -> FormatChecker:
    """The validator class's format checks, with the deferred ones loaded on first use.

    `regex` is checked by RE2; without `regex`, it is not checked (a schema from elsewhere whose
    pattern RE2 cannot take is still used, that pattern unchecked).
    """
    checker = _jsonschema().FormatChecker()
    checker.checkers = dict(cls.FORMAT_CHECKER.checkers)
    for name, rule in (("iri", "iri"), ("iri-reference", "iri_reference")):
        checker.checks(name, raises=ValueError)(functools.partial(_iri_ok, rule))
    checker.checks("duration")(_duration_ok)
    checker.checkers.pop("regex", None)
    if regex:
        checker.checks("regex")(_regex_ok)
    return checker


@functools.lru_cache(maxsize=1024)
def _compiled_schema(text: str) -> Any:
    import referencing
    schema = json.loads(text)
    jsonschema = _jsonschema()
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema, format_checker=_format_checker(cls, regex=False))
    unevaluated = not _KEYWORDS_BY_RE <= {key for _, key, _ in _schema_entries(schema, ())}
    if not unevaluated:
        log.warning("a schema's unevaluatedProperties is not checked: it stands beside patternProperties")
    validator = _linear(cls, unevaluated)(schema, format_checker=_format_checker(cls), registry=referencing.Registry())
    fast = _fast_check(schema)
    if fast is not None:
        _FAST_CHECKS[id(validator)] = (validator, fast)
        if len(_FAST_CHECKS) > 1024:
            _FAST_CHECKS.popitem(last=False)
    return validator


# The compiled check. jsonschema walks a schema in Python (10-40 us an answer); jsonschema-rs
# compiles it to Rust (well under 1 us). schema_errors asks the compiled check first, and only an
# instance it refuses goes through jsonschema, which words the errors (so their pointers and words
# stay as they were) and has the last word. A schema gets a compiled check only when each of its
# keywords means the same in both, which they were measured to: no `format` (asserted here, by
# jsonschema's checkers), no `pattern` (RE2 here), no `multipleOf` (floats are divided
# differently), no references, and Draft 2020-12. It stays for the answer ratio bar (at least half
# the bare handler's rate, bench/README.md): jsonschema alone adds ~16 us of CPU to each answer's
# ~150 and each run's ~175.

#: The dialect a schema without `$schema` is read in.
DRAFT_2020_12: Final = "https://json-schema.org/draft/2020-12/schema"

#: Keywords whose meaning the compiled check shares with jsonschema: a schema made only of these
#: (at every depth) is checked fast.
_FAST_KEYWORDS: Final = frozenset({
    "type", "enum", "const", "required", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "minItems", "maxItems", "uniqueItems", "minProperties", "maxProperties",
    "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment"})
_FAST_SUBSCHEMA: Final = frozenset({"items", "additionalProperties", "not", "contains", "propertyNames"})
_FAST_SUBSCHEMAS: Final = frozenset({"anyOf", "allOf", "oneOf", "prefixItems"})

#: id(jsonschema validator) -> (that validator, its compiled check); the validator is held, so its id
#: is not reused while the entry stands.
_FAST_CHECKS: Final[OrderedDict[int, tuple[Any, Callable[[Any], bool]]]] = OrderedDict()


def _fast_keywords_only(node: Any) -> bool:
    if isinstance(node, bool):
        return True
    if not isinstance(node, dict):
        return False
    for key, value in node.items():
        if key == "properties":
            if not isinstance(value, dict) or not all(_fast_keywords_only(v) for v in value.values()):
                return False
        elif key in _FAST_SUBSCHEMA:
            if not _fast_keywords_only(value):
                return False
        elif key in _FAST_SUBSCHEMAS:
            if not isinstance(value, list) or not all(_fast_keywords_only(v) for v in value):
                return False
        elif key not in _FAST_KEYWORDS:
            return False
    return True


def _fast_check(schema: Any) -> Callable[[Any], bool] | None:
    """The compiled check of a schema whose keywords allow one (see above), else None."""
    if isinstance(schema, dict) and schema.get("$schema", DRAFT_2020_12) != DRAFT_2020_12:
        return None
    if not _fast_keywords_only({k: v for k, v in schema.items() if k != "$schema"} if isinstance(schema, dict)
                               else schema):
        return None
    try:
        import jsonschema_rs
        return jsonschema_rs.validator_for(schema).is_valid
    except Exception:                     # not installed, or a schema it reads otherwise: jsonschema alone
        return None



def compile_schema(schema: Any) -> Any:
    """A validator for `schema`, compiled once per distinct schema. Raises SchemaError."""
    return _compiled_schema(dumps(schema))


def schema_errors(validator: Any, instance: Any, prefix: str = "") -> list[dict[str, str]]:
    """Every way `instance` fails, as `{"pointer", "message"}`; pointers start with `prefix`.

    A missing required member is pointed at itself, not at the object that lacks it.
    """
    import referencing.exceptions
    fast = _FAST_CHECKS.get(id(validator))
    if fast is not None and fast[0] is validator:
        with contextlib.suppress(KeyError):     # a document checked in a thread may have dropped it
            _FAST_CHECKS.move_to_end(id(validator))
        try:
            if fast[1](instance):
                return []
        except Exception:                 # a value it cannot take (e.g. an integer past 64 bits)
            pass
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
    jsonschema = _jsonschema()
    validators = jsonschema.validators
    if isinstance(schema, dict) and "$schema" in schema and (
            not isinstance(schema["$schema"], str) or validators.validator_for(schema, default=None) is None):
        return ("$schema",), f"{schema['$schema']!r} is not a JSON Schema dialect this daemon knows"
    cls = validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    entries = list(_schema_entries(schema, ()))
    for path, key, value in entries:   # before the meta-schema, which points at the mapping, not the key
        if key == "patternProperties" and isinstance(value, dict):
            for pattern in value:
                if _re2_compile(pattern)[0] is None:
                    return path + (key, pattern), _pattern_refusal(pattern)
    try:
        cls.check_schema(schema, format_checker=_format_checker(cls))
    except jsonschema.SchemaError as exc:
        if exc.validator == "format" and exc.validator_value == "regex":
            return tuple(exc.absolute_path), _pattern_refusal(exc.instance)
        return tuple(exc.absolute_path), f"not a valid JSON Schema: {exc.message}"
    if _KEYWORDS_BY_RE <= {key for _, key, _ in entries}:
        path = next(path for path, key, _ in entries if key == "unevaluatedProperties")
        return path + ("unevaluatedProperties",), (
            "unevaluatedProperties beside patternProperties cannot be checked in linear time; "
            "use additionalProperties")
    for path, key, value in entries:
        if key == "$id" and isinstance(value, str) and _remote(value):
            return path + (key,), (f"{value!r} is a base outside the daemon, and references are never fetched; "
                                   "leave out this $id and refer within the schema by #/$defs/...")
    return _unheld_reference(schema, cls)


def _remote(uri: str) -> bool:
    """Whether an `$id` names a place (`https://...`, `file:...`) rather than a name (`urn:`, `tag:`)."""
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:
        return True
    return bool(parts.netloc) or parts.scheme.lower() not in ("", "urn", "tag")


def _unheld_reference(schema: Any, cls: Any) -> tuple[tuple[Any, ...], str] | None:
    """The first `$ref` (or `$dynamicRef`) that `schema` does not hold itself, or None.

    Each is looked up as the validator will, from the base its enclosing `$id`s make, in a
    registry that holds the schema and nothing else.
    """
    import referencing.exceptions
    import referencing.jsonschema
    spec = referencing.jsonschema.specification_with(cls.META_SCHEMA.get("$id", ""),
                                                      default=referencing.jsonschema.DRAFT202012)
    root = spec.create_resource(schema)
    registry = referencing.Registry().with_resource(root.id() or "", root).crawl()

    def refs(node: Any, path: tuple[Any, ...], base: str) -> Iterable[tuple[tuple[Any, ...], str, str, str]]:
        if isinstance(node, dict):
            try:
                ident = spec.id_of(node)
            except (AttributeError, TypeError):
                ident = None
            base = urllib.parse.urljoin(base, ident) if isinstance(ident, str) else base
            for k, v in node.items():
                if k in ("$ref", "$dynamicRef") and isinstance(v, str):
                    yield path, k, v, base
                yield from refs(v, path + (k,), base)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                yield from refs(v, path + (i,), base)

    for path, key, ref, base in refs(schema, (), ""):
        try:
            registry.resolver(base_uri=base).lookup(ref)
        except (referencing.exceptions.Unresolvable, ValueError):
            if ref.startswith("#"):
                return path + (key,), f"{ref!r} points at nothing in the schema"
            return path + (key,), f"{ref!r} is outside the schema; references are never fetched, so use #/$defs/..."
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


@dataclass(frozen=True, slots=True)
class ApproveSpec:
    """A call that waits for a person's approval: whom to ask, how long, and what they may change."""

    to: Template
    expires: timedelta
    edit: tuple[str, ...]       # JSON Pointers into the arguments; nothing is editable without them
    also: tuple[Template, ...] = ()     # `to: [a, b, c]`: the other addressees of a quorum
    need: int = 1               # approvals it takes (a quorum's `need`)
    veto: bool = True           # one refusal ends it refused


#: What an approval takes (SPEC section 20): the verdict, the arguments as the approver leaves them
#: (changed only at the editable places; left out, the proposed ones), and a note.
APPROVAL_ANSWER_SCHEMA: Final[dict[str, Any]] = {
    "type": "object", "required": ["approved"], "additionalProperties": False, "properties": {
        "approved": {"type": "boolean", "description": "Whether the call may go ahead"},
        "arguments": {"type": "object", "description": "The arguments to call with, changed only where the approver may"},
        "note": {"type": "string", "maxLength": 2000, "description": "Why, in the approver's words"}}}


class ApprovalRule(ReplyRule):
    """The reply rule of a delivered approval: `approve [note]` or `reject [note]`."""

    def apply(self, text: str) -> tuple[dict[str, Any] | None, list[str]]:  # type: ignore[override]
        answer, reasons = super().apply(text)
        if answer is None:
            return None, reasons
        return {**answer, "approved": answer["approved"] == "approve"}, []


APPROVAL_RULE: Final = ApprovalRule({
    "approved": RulePart("word", {"approve": ("approved", "yes", "ok"), "reject": ("rejected", "refuse", "no")}),
    "note": RulePart("rest")})
@dataclass(frozen=True, slots=True)
class RemindSpec:
    after: tuple[timedelta, ...]    # from when the request opened, increasing, each before `expires`
    message: Template | None        # None: DEFAULT_REMINDER


@dataclass(frozen=True, slots=True)
class EscalateSpec:
    after: timedelta
    to: Template                    # a party, as `to` renders one
    message: Template | None        # None: DEFAULT_ESCALATION


@dataclass(frozen=True, slots=True)
class OnExpirySpec:
    answer: Any                     # the default answer, valid against output.schema


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
    #: A call's approval gate; its deliver and replies stand in `deliver` and `replies`, the message
    #: it shows in `message`, and its reply rule is APPROVAL_RULE.
    approve: ApproveSpec | None = None
    remind: RemindSpec | None = None
    escalate: EscalateSpec | None = None
    on_expiry: OnExpirySpec | None = None
    #: The tools it sends and reads with, each as (field, server, tool, line): what the save checks
    #: against the operator's approval gate (no gated tool may deliver, read or tell).
    tool_uses: tuple[tuple[str, str, str, int], ...] = ()

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

class _TooLarge(Exception):
    """A document past MAX_DOCUMENT_NODES or MAX_DOCUMENT_DEPTH, marked where it passed."""

    def __init__(self, problem: str, problem_mark: Any) -> None:
        super().__init__(problem)
        self.problem = problem
        self.problem_mark = problem_mark


@functools.cache
def _front_matter_loader() -> type:
    """The loader class of front matter and workflow documents, made on first use (with PyYAML)."""
    import yaml
    try:
        from yaml._yaml import CParser as _YamlEvents    # libyaml: a MiB of YAML read in milliseconds
    except ImportError:                                  # PyYAML built without it: its reader in Python
        _YamlEvents = yaml.SafeLoader

    class _FrontMatterLoader(yaml.composer.Composer, yaml.resolver.Resolver):
        """Composes YAML 1.2 core scalars only, refuses anchors and aliases, and stops at the bounds.

        libyaml reads the text into events, which are composed here, in Python, with their marks; the
        composing stops at the node past MAX_DOCUMENT_NODES or MAX_DOCUMENT_DEPTH (`_TooLarge`), so
        neither the time nor the memory of composing grows with what a document holds past them.
        """

        yaml_implicit_resolvers: dict[Any, Any] = {}

        def __init__(self, text: str) -> None:
            yaml.composer.Composer.__init__(self)
            yaml.resolver.Resolver.__init__(self)
            self.text = text
            self.nodes = 0
            self.depth = 0
            self.events = self._read(_YamlEvents, text)

        def _read(self, step: Callable[..., Any], *args: Any) -> Any:
            try:
                return step(*args)
            except UnicodeEncodeError as exc:   # libyaml reads UTF-8, which a lone surrogate is not
                raise yaml.reader.ReaderError("<unicode string>", exc.start, ord(self.text[exc.start]), "unicode",
                                              "special characters are not allowed") from None
            except yaml.reader.ReaderError as exc:
                if _YamlEvents is not yaml.SafeLoader:   # libyaml's position counts bytes of UTF-8
                    exc.position = len(self.text.encode("utf-8", "surrogatepass")[:exc.position].decode("utf-8", "ignore"))
                raise

        def check_event(self, *choices: Any) -> bool:
            return self._read(self.events.check_event, *choices)

        def peek_event(self) -> Any:
            return self._read(self.events.peek_event)

        def get_event(self) -> Any:
            return self._read(self.events.get_event)

        def dispose(self) -> None:
            self.events.dispose()

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            self.nodes += 1
            if self.nodes > MAX_DOCUMENT_NODES:
                raise _TooLarge(problem=f"the document holds more than {MAX_DOCUMENT_NODES} YAML nodes"
                                " (mappings, lists and values)", problem_mark=event.start_mark)
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)) and self.depth >= MAX_DOCUMENT_DEPTH:
                raise _TooLarge(problem=f"mappings and lists nest more than {MAX_DOCUMENT_DEPTH} deep",
                                problem_mark=event.start_mark)
            # Refused, not raised, so the document's other problems still come back: an alias
            # becomes a scalar that `_scalar` refuses, an anchor a mark that `construct` reports.
            if isinstance(event, yaml.AliasEvent):
                self.get_event()
                return yaml.ScalarNode(_ALIAS_TAG, "", event.start_mark, event.end_mark)
            anchored = getattr(event, "anchor", None) is not None
            if anchored:
                event.anchor = None
            self.depth += 1
            try:
                node = super().compose_node(parent, index)
            finally:
                self.depth -= 1
            node.anchored = anchored
            return node

    for tag, pattern, first in (
        ("null", r"~|null|Null|NULL|", "~nN"),
        ("bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
        ("int", r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", "-+0123456789"),
        ("float", r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?", "-+.0123456789"),
    ):
        _FrontMatterLoader.add_implicit_resolver(
            f"tag:yaml.org,2002:{tag}", re.compile(f"^(?:{pattern})$"), list(first) + ([""] if tag == "null" else []))
    return _FrontMatterLoader


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
        self.markup = MarkupBudget()        # what the document's templates may still hold
        self.room = {"schema objects": MAX_SCHEMA_OBJECTS}   # what its JSON Schemas may still hold

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
        import yaml
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
        room = self.room["schema objects"]
        if room < 0:                    # refused already: the document is
            return None
        room = self.room["schema objects"] = room - _objects_in(value)
        if room < 0:
            self.add(path, f"the document's JSON Schemas hold more than {MAX_SCHEMA_OBJECTS} objects together")
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
        template, problems = check_template(value, line or self.text_line(path), place, input_schema, self.markup)
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


class _Within(_Reader):
    """A reader of a block nested under `prefix` (`approve`): the block readers written for the top
    level (`_read_deliver`, `_read_replies`) report their fields and lines below it."""

    def __init__(self, outer: _Reader, prefix: tuple[Any, ...]) -> None:
        self.where, self.problems, self.prefix = outer.where, outer.problems, prefix
        self.markup, self.room = outer.markup, outer.room

    def line(self, path: tuple[Any, ...]) -> int:
        return super().line(self.prefix + path)

    def text_line(self, path: tuple[Any, ...]) -> int:
        return super().text_line(self.prefix + path)

    def add(self, path: tuple[Any, ...], message: str, line: int | None = None) -> None:
        self.problems.append({"line": line or self.line(path), "field": ".".join(map(str, self.prefix + path)),
                              "message": message})


def _objects_in(value: Any) -> int:
    """The mappings within `value`, itself included."""
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            count += 1
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def _text_line(node: Any) -> int:
    import yaml
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
    import yaml
    loader = None
    try:
        loader = _front_matter_loader()(text)
        node = loader.get_single_node()
    except _TooLarge as exc:
        raise DocumentError([{"line": exc.problem_mark.line + _FRONT_OFFSET, "field": "", "message": exc.problem}]) from None
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

_FIELDS: Final = ("description", "call", "approve", "to", "from", "expires", "deliver", "replies", "input", "output",
                  "reply", "remind", "escalate", "on_expiry")
_NOT_WITH_CALL: Final = ("to", "from", "expires", "deliver", "replies", "reply", "remind", "escalate", "on_expiry")
_SERVER_RULE: Final = "1 to 32 lowercase letters, digits and hyphens, starting with a letter"
_TOOL_RULE: Final = "1 to 128 letters, digits, underscores, hyphens and dots"


#: The threads documents are checked in when they are saved (DOCUMENT_CHECK_THREADS of them,
#: started on first use): checking a large document takes a good part of a second of Python, which
#: the event loop must not wait for. A check holds the GIL for a few milliseconds at a time, so
#: the loop still answers (GET /healthz within a few tens of milliseconds) while one runs.
_DOCUMENT_CHECKS: Final = concurrent.futures.ThreadPoolExecutor(DOCUMENT_CHECK_THREADS,
                                                                thread_name_prefix="document-check")


class _CollectorPaused:
    """Python's cycle collector paused while a document is checked.

    A check makes a hundred thousand objects that live until it ends; meanwhile they would set off
    a collection of the whole heap, which holds the GIL (so the event loop) for a tenth of a second
    or more. Paused, they are freed by their reference counts when the check ends, and what is
    left is collected young, in milliseconds. The collector runs again when no check does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._checks = 0
        self._resume = False

    def __enter__(self) -> None:
        with self._lock:
            if self._checks == 0:
                self._resume = gc.isenabled()
                gc.disable()
            self._checks += 1

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._checks -= 1
            if self._checks == 0 and self._resume:
                gc.enable()


_COLLECTOR_PAUSED: Final = _CollectorPaused()


def _check_paused(check: Callable[..., Any], *args: Any) -> Any:
    with _COLLECTOR_PAUSED:
        return check(*args)


async def check_off_loop(check: Callable[..., Any], *args: Any) -> Any:
    """`check(*args)` (such as parse_function) in a document-checking thread, awaited."""
    return await asyncio.get_running_loop().run_in_executor(
        _DOCUMENT_CHECKS, functools.partial(_check_paused, check, *args))


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
    call = deliver = replies = approve = None
    if "approve" in data and shape is not Shape.SYSTEM:
        r.add(("approve",), "approve gates a call of a tool: only a function with call has it")
    if shape is Shape.SYSTEM:
        for key in _NOT_WITH_CALL:
            if key in data:
                r.add((key,), f"a function with call asks a system, so it has no {key}")
        if "approve" in data:          # the body is the message the approver reads
            approve, deliver, replies = _read_approve(r, data, input_schema)
            if body.strip():
                message = r.template(("body",), body, PLACES["message"], input_schema, line=body_line)
        elif body.strip():
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
    follow = _read_follow_up(r, data, expires, input_schema, output_schema) if shape is not Shape.SYSTEM else {}
    if r.problems:
        return None
    uses: list[tuple[str, str, str, int]] = []
    if deliver is not None:
        at = ("approve",) if approve is not None else ()
        sends: list[tuple[tuple[str, ...], str]] = [(("deliver", "tool"), deliver.tool)]
        if replies is not None:
            sends.append((("replies", "tool"), replies.tool))
            if replies.tell is not None:
                sends.append((("replies", "tell", "tool"), replies.tell.tool))
        uses = [(".".join(at + path), deliver.server, tool_, r.line(at + path)) for path, tool_ in sends]
    return FunctionDoc(
        source=source, shape=shape, description=description, to=to, from_=from_, message=message,
        expires=expires, expires_text=data.get("expires"), input_schema=input_schema,
        output_schema=output_schema, call=call, deliver=deliver, replies=replies,
        reply_rule=APPROVAL_RULE if approve is not None and replies is not None else rule, approve=approve,
        tool_uses=tuple(uses), **follow)


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


def _read_approve(r: _Reader, data: dict[str, Any],
                  input_schema: Any) -> tuple[ApproveSpec | None, DeliverSpec | None, RepliesSpec | None]:
    """The approval gate of a call: `to`, `expires`, `edit`, and optionally `deliver` and `replies`
    as an interaction has them (the replies read by APPROVAL_RULE)."""
    path = ("approve",)
    block = r.mapping(path, data["approve"], ("to", "expires", "edit", "deliver", "replies", "need", "veto"),
                      ("to", "expires"))
    if block is None:
        return None, None, None
    listed = block.get("to")
    if isinstance(listed, list):            # a quorum: `to: [a, b, c]`, `need: N`, `veto`
        if not 1 <= len(listed) <= MAX_QUORUM:
            r.add(path + ("to",), f"lists 1 to {MAX_QUORUM} people, not {len(listed)}")
        parties = [r.template(path + ("to", i), t, PLACES["party"], input_schema) for i, t in enumerate(listed)]
        to = parties[0] if parties and all(t is not None for t in parties) else None
        also = tuple(t for t in parties[1:] if t is not None)
    else:
        to = r.template(path + ("to",), listed, PLACES["party"], input_schema) if "to" in block else None
        also = ()
    need, veto = block.get("need", 1), block.get("veto", True)
    if isinstance(need, bool) or not isinstance(need, int) or not 1 <= need <= 1 + len(also):
        r.add(path + ("need",), f"is how many of the {1 + len(also)} people in `to` must approve: 1 to {1 + len(also)}")
    if not isinstance(veto, bool):
        r.add(path + ("veto",), "is true (one refusal refuses the call) or false (refusals only fail to approve)")
    expires = (r.duration(path + ("expires",), block["expires"], EXPIRES_MIN, EXPIRES_MAX,
                          "PT1M to P30D (1 minute to 30 days)") if "expires" in block else None)
    with_ = data["call"].get("with") if isinstance(data.get("call"), dict) else None
    edit = _read_edit(r, path + ("edit",), block.get("edit", []), with_)
    within = _Within(r, path)
    deliver = _read_deliver(within, block["deliver"], input_schema) if "deliver" in block else None
    replies = None
    if "replies" in block:
        shown = {"replies": block["replies"], "output": True, **({"deliver": block["deliver"]} if "deliver" in block else {})}
        replies = _read_replies(within, shown, deliver, APPROVAL_ANSWER_SCHEMA, APPROVAL_RULE)
    if to is None or expires is None or edit is None:
        return None, None, None
    return ApproveSpec(to, expires, edit, also, need, veto), deliver, replies


def _read_edit(r: _Reader, path: tuple[Any, ...], value: Any, with_: Any) -> tuple[str, ...] | None:
    """The pointers an approver may change: each into the arguments `with` writes, where they can be
    followed (a template's value is known only when it renders)."""
    if not isinstance(value, list):
        r.add(path, "is a list of JSON Pointers into the call's arguments, such as [/service, /force]")
        return None
    before = len(r.problems)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            r.add(path + (i,), "is a JSON Pointer into the call's arguments, such as /service")
        elif item == "":
            r.add(path + (i,), "the empty pointer would let the approver change every argument: list each one")
        elif r.pointer(path + (i,), item) is None:
            pass
        elif value.index(item) != i:
            r.add(path + (i,), f"{item} is listed twice")
        else:
            pointer = item
            cur = with_
            for part in pointer_parse(pointer):
                if isinstance(cur, dict):
                    if part not in cur:
                        r.add(path + (i,), f"call.with writes no {pointer}: the approver may change only the "
                                           "arguments the call sends (write a default there to offer one)")
                        break
                    cur = cur[part]
                elif isinstance(cur, list) and re.fullmatch(r"0|[1-9][0-9]*", part) and int(part) < len(cur):
                    cur = cur[int(part)]
                else:
                    break                   # a template's value, or a scalar: known when the call renders
    return tuple(value) if len(r.problems) == before else None


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


def _read_follow_up(r: _Reader, data: dict[str, Any], expires: timedelta | None, input_schema: Any,
                    output_schema: Any) -> dict[str, Any]:
    """`remind`, `escalate` and `on_expiry` of a function that asks a person, checked: FunctionDoc's
    fields of the same names, for those the document writes."""
    out: dict[str, Any] = {}
    bounds = "PT1M to P30D (1 minute to 30 days)"

    def before_expiry(path: tuple[Any, ...], span: timedelta | None, text: Any) -> timedelta | None:
        if span is not None and expires is not None and span >= expires:
            r.add(path, f"{text} is not before expires ({data.get('expires')}): the request has ended by then")
            return None
        return span

    for key in ("remind", "escalate"):
        if key in data and "output" not in data:
            r.add((key,), f"{key} needs output.schema: a notification takes no answer, so nobody waits for one")
        if key in data and "deliver" in data and not (isinstance(data.get("replies"), dict)
                                                      and "tell" in data["replies"]):
            r.add((key,), f"a function sent through a tool sends its {'reminders' if key == 'remind' else 'escalation'}"
                          " into the message's thread with replies.tell: add replies.tell")
    if "remind" in data:
        block = r.mapping(("remind",), data["remind"], ("after", "message"), ("after",))
        if block is not None and "after" in block:
            path = ("remind", "after")
            listed = block["after"] if isinstance(block["after"], list) else [block["after"]]
            spans: list[timedelta | None] = []
            if not listed:
                r.add(path, "lists at least one duration, such as [PT4H, P1D]")
            elif len(listed) > MAX_REMINDERS:
                r.add(path, f"a request is reminded at most {MAX_REMINDERS} times, not {len(listed)}")
            for i, text in enumerate(listed):
                at = path + (i,) if isinstance(block["after"], list) else path
                span = before_expiry(at, r.duration(at, text, EXPIRES_MIN, EXPIRES_MAX, bounds), text)
                earlier = next((s for s in reversed(spans) if s is not None), None)
                if span is not None and earlier is not None and span <= earlier:
                    r.add(at, f"{text} does not come after the reminder before it: list the durations in increasing order")
                    span = None
                spans.append(span)
            message = (r.template(("remind", "message"), block["message"], PLACES["message"], input_schema)
                       if "message" in block else None)
            if listed and all(s is not None for s in spans) and ("message" not in block or message is not None):
                out["remind"] = RemindSpec(tuple(s for s in spans if s is not None), message)
    if "escalate" in data:
        block = r.mapping(("escalate",), data["escalate"], ("after", "to", "message"), ("after", "to"))
        if block is not None:
            after = (before_expiry(("escalate", "after"), r.duration(("escalate", "after"), block["after"], EXPIRES_MIN,
                                                                       EXPIRES_MAX, bounds), block["after"])
                     if "after" in block else None)
            to = r.template(("escalate", "to"), block["to"], PLACES["party"], input_schema) if "to" in block else None
            message = (r.template(("escalate", "message"), block["message"], PLACES["message"], input_schema)
                       if "message" in block else None)
            if after is not None and to is not None and ("message" not in block or message is not None):
                out["escalate"] = EscalateSpec(after, to, message)
    if "on_expiry" in data:
        block = r.mapping(("on_expiry",), data["on_expiry"], ("answer",), ("answer",))
        if "output" not in data:
            r.add(("on_expiry",), "on_expiry gives a default answer, so it needs output.schema (a notification"
                                  " takes no answer)")
        elif block is not None and "answer" in block and output_schema is not None:
            errors = schema_errors(compile_schema(output_schema), block["answer"])
            for e in errors:
                parts = pointer_parse(e["pointer"])
                r.add(("on_expiry", "answer", *parts), f"the default answer does not match output.schema at"
                      f" {e['pointer'] or 'its top'}: {e['message']}")
            if not errors:
                out["on_expiry"] = OnExpirySpec(block["answer"])
    return out


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

_OVERVIEW_TYPE_WORDS: Final = {"string": "text", "integer": "whole number", "number": "number", "boolean": "yes or no",
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
    types = [_OVERVIEW_TYPE_WORDS.get(t, t) for t in sorted(_schema_types(schema))]
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
    ] + (_approve_overview(doc) if doc.approve is not None else [])


def _approve_overview(doc: FunctionDoc) -> list[str]:
    gate = doc.approve
    assert gate is not None
    edit = (f"they may change {', '.join(f'`{p}`' for p in gate.edit)} before approving"
            if gate.edit else "they approve or refuse the arguments as they are")
    where = (f" The question is sent with the tool `{doc.deliver.tool}` of `{doc.deliver.server}`." if doc.deliver else "")
    who = template_words(gate.to.source)
    refusal = "A refusal ends the run declined"
    if gate.also:                   # a quorum
        who = (f"{gate.need} of {', '.join(template_words(t.source) for t in (gate.to, *gate.also))}, each once"
               f" (the first approval's arguments stand for the rest)")
        refusal = ("A refusal by any of them ends the run declined" if gate.veto else
                   "Refusals only fail to approve; when too few are left to approve, the run ends declined")
    out = [f"**Who approves:** each call first waits for {who} to approve it, at most "
           f"{duration_words(gate.expires)}; {edit}. {refusal}, no answer in time ends it "
           f"unanswered, and the tool is not called.{where}"]
    if doc.replies is not None:
        out.append(f"**Replies:** read with the tool `{doc.replies.tool}`. {APPROVAL_RULE.describe()}")
    return out


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
        f"**How long it waits:** {duration_words(doc.expires)}; then "
        + ("it takes its default answer." if doc.on_expiry else "the request ends unanswered."),
        "**What answer it expects:**\n" + answer,
    ]
    if doc.remind or doc.escalate or doc.on_expiry:
        out.append("**Until it is answered:** " + _follow_up_words(doc) + ".")
    if doc.replies and doc.reply_rule:
        told = (f" A reply that is not an answer is met with how to answer, sent with `{doc.replies.tell.tool}`."
                if doc.replies.tell else "")
        out.append(f"**Replies:** read with the tool `{doc.replies.tool}`, no more often than every "
                   f"{duration_words(doc.replies.wait)}. {doc.reply_rule.describe()}{told}")
    return out


def _follow_up_words(doc: FunctionDoc) -> str:
    """Reminders, escalation and the default answer in a sentence: "reminds **owner** after 4 hours and
    after 1 day; from 1 day on also asks **manager**; if nobody answers in 2 days, takes ..."."""
    assert doc.to is not None and doc.expires is not None
    said = []
    if doc.remind:
        times = [f"after {duration_words(s)}" for s in doc.remind.after]
        said.append(f"reminds {template_words(doc.to.source)} "
                    + (", ".join(times[:-1]) + " and " + times[-1] if len(times) > 1 else times[0]))
    if doc.escalate:
        said.append(f"from {duration_words(doc.escalate.after)} on also asks {template_words(doc.escalate.to.source)}")
    if doc.on_expiry:
        said.append(f"if nobody answers in {duration_words(doc.expires)}, takes {_answer_words(doc.on_expiry.answer)}")
    return "; ".join(said)


def _answer_words(answer: Any) -> str:
    """A default answer as a person reads it: `revise` for {verdict: revise}, each field named when several."""
    if isinstance(answer, dict) and len(answer) == 1 and not isinstance(next(iter(answer.values())), (dict, list)):
        return str(next(iter(answer.values())))
    if isinstance(answer, dict) and answer and all(not isinstance(v, (dict, list)) for v in answer.values()):
        return ", ".join(f"{v} as its **{k}**" for k, v in answer.items())
    return f"`{dumps(answer)}`"


def check_documents(paths: list[str], out: Any = None,
                    parsers: Mapping[str, Callable[[str], Any]] | None = None) -> int:
    """`interactiond check`: print each problem as FILE:LINE: field: message; 1 on any problem.

    `parsers` maps a file suffix to its parser (`.yaml` to the workflow parser, say); any other file
    is a function document.
    """
    out = out or sys.stdout
    parsers = parsers or {}
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
            parsers.get(Path(path).suffix.lower(), parse_function)(source)
        except DocumentError as exc:
            status = 1
            for p in exc.problems:
                print(f"{path}:{p['line']}: {p['field'] + ': ' if p['field'] else ''}{p['message']}", file=out)
        else:
            print(f"{path}: ok", file=out)
    return status


# Settings #######################################################################################
#
# The operator's configuration (YAML): where to listen, the database, the open-request limit, the
# tool servers and which playbook may use which. Every problem is reported with its key path and
# the daemon does not start.

@dataclass(frozen=True)
class ServerConfig:
    name: str
    command: tuple[str, ...] | None = None
    url: str | None = None
    transport: str = "stdio"                    # stdio | http | sse
    env: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    tools: tuple[str, ...] | None = None        # the operator's allow-list; None allows every tool
    record_content: bool = True
    approve: ApprovalPolicy | None = None       # calls of these tools wait for a person's approval


@dataclass(frozen=True)
class ApprovalPolicy:
    """`servers.NAME.approve`: every call of these tools - from a function or `execute` - waits for
    `to` to approve it, at most `expires`."""

    tools: tuple[str, ...]
    to: str
    expires: timedelta = timedelta(days=1)


@dataclass(frozen=True)
class Config:
    host: str = "127.0.0.1"
    port: int = 8765
    database: str = "interactiond.db"
    open_requests: int = DEFAULT_OPEN_REQUESTS
    servers: dict[str, ServerConfig] = field(default_factory=dict)
    playbooks: dict[str, tuple[str, ...]] = field(default_factory=lambda: {DEFAULT_PLAYBOOK: ()})
    source: str | None = None
    metrics_open_on_loopback: bool = False      # GET /metrics without a token from this machine
    public_url: str | None = None               # the base of answer and sign-in links
    mcp_as: str | None = None                   # `mcp.as`: the person at an MCP client whose token names none
    max_connections: int = DEFAULT_MAX_CONNECTIONS   # open HTTP connections at most

    @property
    def links_base(self) -> str:
        """Where answer and sign-in links point: public_url, else the listen address (a serving daemon
        puts the port it bound in its place)."""
        if self.public_url:
            return self.public_url
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"


#: The keys of a configuration file (and how `check` tells one from a workflow).
CONFIG_KEYS: Final = ("listen", "database", "open_requests", "servers", "playbooks", "metrics", "public_url", "mcp",
                      "max_connections")


class ConfigError(Exception):
    """The configuration breaks a rule; each problem names its key path."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


def _config_mapping(raw: dict[str, Any], key: str, what: str, problems: list[str]) -> dict[Any, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        problems.append(f"{key}: {what}")
        return {}
    return value


def _read_server(name: Any, s: Any, problems: list[str]) -> ServerConfig | None:
    """One entry of `servers`; its problems are appended with their key paths."""
    where = f"servers.{name}"
    if not isinstance(name, str) or not SERVER_RE.fullmatch(name):
        problems.append(f"{where}: a server name is 1 to 32 lowercase letters, digits and hyphens, starting with a letter")
        return None
    if not isinstance(s, dict):
        problems.append(f"{where}: a mapping with command or url")
        return None
    allowed = {"command", "url", "transport", "env", "headers", "tools", "record_content", "approve"}
    problems += [f"{where}.{k}: unknown key" for k in s if k not in allowed]
    command, url = s.get("command"), s.get("url")
    if (command is None) == (url is None):
        problems.append(f"{where}: give exactly one of command (stdio) or url (HTTP)")
    if command is not None and (not isinstance(command, list) or not command
                                or not all(isinstance(c, str) and c for c in command)):
        problems.append(f"{where}.command: a list of texts, the program and its arguments")
    if url is not None and (not isinstance(url, str) or not re.match(r"https?://", url)):
        problems.append(f"{where}.url: an http:// or https:// URL")
    transport = s.get("transport") or ("stdio" if command is not None else
                                       "sse" if isinstance(url, str) and url.rstrip("/").endswith("/sse") else "http")
    if transport not in {"stdio", "http", "sse"} or (transport == "stdio") != (command is not None):
        problems.append(f"{where}.transport: stdio with command; http or sse with url")
    maps = {}
    for key in ("env", "headers"):
        value = s.get(key) or {}
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, (str, int)) for k, v in value.items()):
            problems.append(f"{where}.{key}: a mapping of names to texts")
            value = {}
        maps[key] = {k: str(v) for k, v in value.items()}
    tools = s.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, str) and TOOL_RE.fullmatch(t) for t in tools)):
        problems.append(f"{where}.tools: a list of tool names")
        tools = None
    record = s.get("record_content", True)
    if not isinstance(record, bool):
        problems.append(f"{where}.record_content: true or false")
    approve = _read_policy(where + ".approve", s["approve"], problems) if "approve" in s else None
    return ServerConfig(name, tuple(command) if isinstance(command, list) else None,
                        url if isinstance(url, str) else None, transport, maps["env"], maps["headers"],
                        tuple(tools) if tools is not None else None, bool(record), approve)


def _read_policy(where: str, a: Any, problems: list[str]) -> ApprovalPolicy | None:
    """`servers.NAME.approve: {tools: [...], to: PERSON, expires: PT1H}` (expires: P1D when left out)."""
    if not isinstance(a, dict):
        problems.append(f"{where}: a mapping with tools, to and expires")
        return None
    count = len(problems)
    problems += [f"{where}.{k}: unknown key" for k in a if k not in ("tools", "to", "expires")]
    tools = a.get("tools")
    if not isinstance(tools, list) or not tools or not all(isinstance(t, str) and TOOL_RE.fullmatch(t) for t in tools):
        problems.append(f"{where}.tools: a list of the tool names whose calls wait for approval")
    to = a.get("to")
    if not isinstance(to, str) or not to.strip() or has_control_char(to) or len(to.encode()) > MAX_PARTY_BYTES:
        problems.append(f"{where}.to: the person who approves, as requests name them (at most {MAX_PARTY_BYTES} bytes)")
    expires = timedelta(days=1)
    try:
        expires = parse_duration(a.get("expires", "P1D"))
        if not EXPIRES_MIN <= expires <= EXPIRES_MAX:
            raise ValueError("it lies between PT1M and P30D")
    except ValueError as exc:
        problems.append(f"{where}.expires: an ISO 8601 duration, PT1M to P30D ({exc})")
    if len(problems) > count:
        return None
    return ApprovalPolicy(tuple(tools), to.strip(), expires)


def _read_playbook(pb: Any, p: Any, raw_servers: dict[Any, Any], problems: list[str]) -> tuple[str, ...] | None:
    """One entry of `playbooks`: the servers it may use."""
    where = f"playbooks.{pb}"
    if not isinstance(pb, str) or not PLAYBOOK_RE.fullmatch(pb):
        problems.append(f"{where}: a playbook is ORG/NAME in lowercase letters, digits and hyphens")
        return None
    p = p or {}
    if not isinstance(p, dict):
        problems.append(f"{where}: a mapping with servers")
        return None
    problems += [f"{where}.{k}: unknown key" for k in p if k != "servers"]
    names = p.get("servers") or []
    if not isinstance(names, list):
        problems.append(f"{where}.servers: a list of server names")
        names = []
    for i, n in enumerate(names):
        if n not in raw_servers:
            problems.append(f"{where}.servers[{i}]: {n!r} is not a server of this configuration")
    return tuple(n for n in names if isinstance(n, str))


def load_config(path: str | None, environ: dict[str, str] | None = None) -> Config:
    """Read the operator's YAML configuration; every problem is reported with its key path."""
    environ = os.environ if environ is None else environ
    raw: Any = {}
    if path:
        import yaml
        try:
            with open(path, encoding="utf-8") as fh:
                raw = yaml.safe_load(fh) or {}
        except OSError as exc:
            raise ConfigError([f"{path}: {exc.strerror}"]) from None
        except yaml.YAMLError as exc:
            raise ConfigError([f"{path}: not YAML: {exc}"]) from None
    problems: list[str] = []
    if not isinstance(raw, dict):
        raise ConfigError(["(top): the configuration is a mapping of keys such as listen, servers, playbooks"])
    problems += [f"{k}: unknown key (known: {', '.join(sorted(CONFIG_KEYS))})" for k in raw if k not in CONFIG_KEYS]
    listen = raw.get("listen") or {}
    host, port = "127.0.0.1", 8765
    if not isinstance(listen, dict):
        problems.append("listen: a mapping with host and port")
    else:
        problems += [f"listen.{k}: unknown key" for k in listen if k not in {"host", "port"}]
        host = listen.get("host", host)
        port = listen.get("port", port)
        if not isinstance(host, str) or not host:
            problems.append("listen.host: a host name or address")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            problems.append("listen.port: a port number from 0 to 65535")
    database = raw.get("database", "interactiond.db")
    if not isinstance(database, str) or not database:
        problems.append("database: a file path, or a postgresql:// URL")
    open_requests = raw.get("open_requests", DEFAULT_OPEN_REQUESTS)
    if "INTERACTION_OPEN_REQUESTS" in environ:
        try:
            open_requests = int(environ["INTERACTION_OPEN_REQUESTS"])
        except ValueError:
            problems.append("INTERACTION_OPEN_REQUESTS: a whole number")
    if not isinstance(open_requests, int) or isinstance(open_requests, bool) or open_requests < 0:
        problems.append("open_requests: a whole number, 0 or more")
    raw_servers = _config_mapping(raw, "servers", "a mapping of server names to their settings", problems)
    servers = {name: sc for name, value in raw_servers.items()
               if (sc := _read_server(name, value, problems)) is not None}
    playbooks: dict[str, tuple[str, ...]] = {DEFAULT_PLAYBOOK: ()}
    for pb, value in _config_mapping(raw, "playbooks", "a mapping of ORG/NAME to their settings", problems).items():
        names = _read_playbook(pb, value, raw_servers, problems)
        if names is not None:
            playbooks[pb] = names
    metrics = _config_mapping(raw, "metrics", "a mapping with open_on_loopback", problems)
    problems += [f"metrics.{k}: unknown key" for k in metrics if k != "open_on_loopback"]
    if not isinstance(metrics.get("open_on_loopback", False), bool):
        problems.append("metrics.open_on_loopback: true or false")
    public_url = raw.get("public_url")
    if public_url is not None and not (isinstance(public_url, str) and re.fullmatch(r"https?://[^/\s?#]+(/[^\s?#]*)?", public_url)):
        problems.append("public_url: an http:// or https:// URL people reach the daemon at, e.g."
                        " https://inbox.example.org (no query or fragment)")
        public_url = None
    mcp = _config_mapping(raw, "mcp", "a mapping with as", problems)
    problems += [f"mcp.{k}: unknown key" for k in mcp if k != "as"]
    mcp_as = mcp.get("as")
    if mcp_as is not None and (not isinstance(mcp_as, str) or not mcp_as.strip() or has_control_char(mcp_as)
                               or len(mcp_as.encode()) > MAX_PARTY_BYTES):
        problems.append(f"mcp.as: the person at the MCP client, as requests name them"
                        f" (at most {MAX_PARTY_BYTES} bytes)")
        mcp_as = None
    max_connections = raw.get("max_connections", DEFAULT_MAX_CONNECTIONS)
    if not isinstance(max_connections, int) or isinstance(max_connections, bool) \
            or not 1 <= max_connections <= MAX_MAX_CONNECTIONS:
        problems.append(f"max_connections: a whole number from 1 to {MAX_MAX_CONNECTIONS:,}"
                        f" (default {DEFAULT_MAX_CONNECTIONS:,})")
    if problems:
        raise ConfigError(problems)
    return Config(host, port, database, open_requests, servers, playbooks, path,
                  metrics_open_on_loopback=metrics.get("open_on_loopback") is True,
                  public_url=public_url.rstrip("/") if public_url else None,
                  mcp_as=mcp_as.strip() if mcp_as else None, max_connections=max_connections)


# Store ##########################################################################################
#
# One SQLite file in WAL mode, two connections, each owned by its own thread: the writer and a
# reader. Asyncio code hands the writer a whole *change* - a plain function of the connection -
# and awaits its commit; the writer takes every change waiting in its queue, runs them one after
# another in one `BEGIN IMMEDIATE` transaction, commits once, and only then answers each caller.
# So sixteen concurrent answers share one commit; each change runs in a savepoint of its own, so
# one that raises is undone and fails alone, its neighbours commit, and no change runs twice.
# A change never awaits anything: no transaction is ever held across a
# tool call or a network round trip.
#
# What a change means for the in-memory side (timers to arm, waiters to wake, stream events to
# publish) is collected in its `Effects` and applied on the event loop right after the commit,
# whether or not the caller is still there to see its result.
#
# A third connection, on its own thread, only checkpoints: it copies the WAL into the database file
# beside the writer's commits, so no commit pays for a checkpoint. A database that is locked past
# the busy timeout, full or failing answers the caller with a problem that says so, and a batch is
# committed whole or not at all (see _run_batch).
#
# The end of this section runs the same store, threads and SQL on a PostgreSQL server.

#: PRAGMA user_version of a file this version made; an earlier one is migrated at open (MIGRATIONS).
SCHEMA_VERSION: Final = 10


#: The schema, embedded so an installed wheel needs no data file; tests keep it equal to schema.sql.
SCHEMA_SQL: Final = """\
-- interactiond's SQLite schema. Applied at every start (idempotent); PRAGMA user_version tells
-- which migrations a file has had. Times are integer milliseconds since the epoch (UTC); JSON
-- columns hold compact JSON text. Every state change is one transaction that updates its rows
-- and appends its events together.

CREATE TABLE IF NOT EXISTS playbooks (
    id            TEXT PRIMARY KEY,                  -- ORG/NAME
    open_requests INTEGER NOT NULL DEFAULT 0,        -- kept in step with requests.open
    created_at    INTEGER NOT NULL
);

-- One row per version; `active` is cleared on every version of a name when it is deleted.
CREATE TABLE IF NOT EXISTS definitions (
    playbook   TEXT NOT NULL REFERENCES playbooks(id),
    type       TEXT NOT NULL CHECK (type IN ('interaction', 'workflow')),
    name       TEXT NOT NULL,
    version    INTEGER NOT NULL,
    source     TEXT NOT NULL,
    source_sha TEXT NOT NULL,
    overview   TEXT NOT NULL,
    description TEXT,
    uses       TEXT NOT NULL DEFAULT '[]',           -- JSON: [[type, name], ...] a workflow calls
    answer_schema TEXT,                              -- JSON: the answer schema its requests share
    active     INTEGER NOT NULL DEFAULT 1,
    created_at INTEGER NOT NULL,
    created_by TEXT NOT NULL,
    PRIMARY KEY (playbook, type, name, version)
);

CREATE TABLE IF NOT EXISTS runs (
    seq          INTEGER PRIMARY KEY,                -- listing order and cursors
    playbook     TEXT NOT NULL REFERENCES playbooks(id),
    run_id       TEXT NOT NULL,
    type         TEXT NOT NULL,
    name         TEXT NOT NULL,
    version      INTEGER NOT NULL,
    input        TEXT NOT NULL,
    input_sha    TEXT NOT NULL,
    status       TEXT NOT NULL CHECK (status IN (
                     'started',                      -- accepted, nothing open yet
                     'waiting',                      -- started -> waiting: a request is open
                     'succeeded',                    -- -> answered, delivered, or the tool answered
                     'invalid_input', 'conflict', 'unavailable',
                     'rejected',                     -- -> expired, undelivered, cancelled
                     'failed')),
    kind         TEXT,
    output       TEXT,
    problem      TEXT,
    tools_called INTEGER NOT NULL DEFAULT 0,         -- a tool call was sent under this run id
    events       INTEGER NOT NULL DEFAULT 0,         -- per-run event counter (gap-free run_seq)
    parent       TEXT,                               -- the workflow run that started it
    state        TEXT,                               -- a workflow's position and data
    created_at   INTEGER NOT NULL,
    ended_at     INTEGER,
    created_by   TEXT NOT NULL,
    settled_by   TEXT,
    UNIQUE (playbook, run_id)
);
CREATE INDEX IF NOT EXISTS runs_by_status ON runs (playbook, status, seq);

-- The open question of a run that asks a person; one per run.
CREATE TABLE IF NOT EXISTS requests (
    seq            INTEGER PRIMARY KEY,              -- newest first in the inbox
    id             TEXT NOT NULL UNIQUE,             -- int_<ULID>, the typed API's id
    playbook       TEXT NOT NULL,
    run_id         TEXT NOT NULL,
    type           TEXT NOT NULL,
    name           TEXT NOT NULL,
    version        INTEGER NOT NULL,
    party          TEXT NOT NULL,                    -- rendered `to`
    answerer       TEXT NOT NULL,                    -- rendered `from`, else `to`
    message        TEXT NOT NULL,
    own_schema     TEXT,                             -- its answer schema where its definition's is not it;
                                                     -- NULL: the definition's (NULL too: a notification)
    server         TEXT,                             -- deliver.server, NULL for the inbox
    tool           TEXT,
    status         TEXT NOT NULL CHECK (status IN (
                       'open',                       -- waiting for an answer or a delivery
                       'answered',                   -- open -> answered
                       'notified',                   -- open -> notified (a notification delivered)
                       'expired',                    -- open -> expired
                       'undelivered',                -- open -> undelivered (a notification)
                       'cancelled')),                -- open -> cancelled
    open           INTEGER NOT NULL DEFAULT 1,       -- 1 while status = 'open'
    delivery_state TEXT NOT NULL CHECK (delivery_state IN (
                       'in_inbox', 'to_deliver', 'delivering', 'delivered', 'retrying',
                       'undelivered', 'cancelling')),
    attempts       INTEGER NOT NULL DEFAULT 0,
    asked_at       INTEGER NOT NULL,
    expires_at     INTEGER NOT NULL,
    answer         TEXT,
    answer_id      INTEGER,
    answered_by    TEXT,
    answered_at    INTEGER,
    claimed_for    TEXT,
    reply_id       TEXT,
    sent_conversation TEXT,
    sent_id        TEXT,
    conversation   TEXT,                             -- the reading key, when replies are read
    refused_replies INTEGER NOT NULL DEFAULT 0,
    told           INTEGER NOT NULL DEFAULT 0,
    deliver_args   TEXT,                             -- rendered once at the run's start
    attempt_started_at INTEGER,                      -- of the attempt in flight or the last one
    reading        INTEGER REFERENCES readings(id),  -- the reading it joined, once delivered
    approval       TEXT,                             -- a call's approval gate (JSON); NULL for a question
    follow_up      TEXT,                             -- JSON: its reminders, escalation, default answer
    reminded       INTEGER NOT NULL DEFAULT 0,       -- reminders so far (request_reminded's n)
    escalated_to   TEXT,                             -- once escalated: the party asked too, who may answer
    reply_sender   TEXT,                             -- who wrote the reply that answered
    answered_by_name TEXT,                           -- who answered, in words: a token's or person's name, a sender
    digest         TEXT,                             -- sha256 of what it shows (request_digest); NULL: opened before
    on_behalf_of   TEXT,                             -- a deputy's answer: the person they stood for
    UNIQUE (playbook, run_id)
);
CREATE INDEX IF NOT EXISTS requests_open ON requests (playbook, seq) WHERE open = 1;
CREATE INDEX IF NOT EXISTS requests_open_party ON requests (playbook, party, seq) WHERE open = 1;
CREATE INDEX IF NOT EXISTS requests_open_escalated ON requests (playbook, escalated_to, seq)
    WHERE open = 1 AND escalated_to IS NOT NULL;
CREATE INDEX IF NOT EXISTS requests_by_status ON requests (status, seq);

-- One reading per (playbook, server, reading tool, conversation key), shared by every open
-- request with that key: one read serves them all.
CREATE TABLE IF NOT EXISTS readings (
    id           INTEGER PRIMARY KEY,
    playbook     TEXT NOT NULL,
    server       TEXT NOT NULL,
    tool         TEXT NOT NULL,
    conversation TEXT NOT NULL,
    since        TEXT NOT NULL DEFAULT '',           -- the newest message id a read listed
    reads        INTEGER NOT NULL DEFAULT 0,         -- reads since a request last joined
    wait_ms      INTEGER NOT NULL DEFAULT 5000,
    UNIQUE (playbook, server, tool, conversation)
);

-- Every message id a reading has dealt with (taken, refused or passed over): never twice.
CREATE TABLE IF NOT EXISTS replies_seen (
    reading  INTEGER NOT NULL REFERENCES readings(id),
    reply_id TEXT NOT NULL,
    PRIMARY KEY (reading, reply_id)
) WITHOUT ROWID;

-- Reminders and escalation messages sent into a delivered request's thread (with replies.tell),
-- each attempted as a delivery is: recorded before it is sent, then 1, 2, 4 and 8 minutes apart.
CREATE TABLE IF NOT EXISTS nudges (
    id         INTEGER PRIMARY KEY,
    playbook   TEXT NOT NULL,
    run_id     TEXT NOT NULL,
    what       TEXT NOT NULL CHECK (what IN ('reminder', 'escalation')),
    n          INTEGER NOT NULL,                     -- the reminder's number (1 for the escalation)
    message    TEXT NOT NULL,
    state      TEXT NOT NULL CHECK (state IN (      -- as a delivery's
                   'to_deliver', 'delivering', 'delivered', 'retrying', 'undelivered')),
    attempts   INTEGER NOT NULL DEFAULT 0,
    started_at INTEGER                               -- of the attempt in flight or the last one
);

-- Append-only. `id` is monotonic and never reused; run events also carry a gap-free run_seq.
CREATE TABLE IF NOT EXISTS events (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    playbook TEXT NOT NULL,
    run_id   TEXT,                                   -- NULL for the playbook's own events
    run_seq  INTEGER,
    type     TEXT NOT NULL,
    at       INTEGER NOT NULL,
    by       TEXT,
    payload  TEXT NOT NULL,
    size     INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_run ON events (playbook, run_id, id);
CREATE INDEX IF NOT EXISTS events_by_playbook ON events (playbook, id) WHERE run_id IS NULL;

-- Due times for the one timer task: expiries, attempts, lost-attempt checks, reads, waits.
CREATE TABLE IF NOT EXISTS timers (
    key    TEXT PRIMARY KEY,                         -- kind:playbook:ref
    due_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS timers_due ON timers (due_at);   -- the timer wheel reads a window at a time

-- API tokens, stored as sha256 hashes of their secrets; also one-time login links and the inbox
-- sessions they trade for (12 h idle, 7 days at most). A person's token, link or session names
-- the person (a party as `to` renders it): it sees and answers only the requests addressed to them.
CREATE TABLE IF NOT EXISTS tokens (
    id         TEXT PRIMARY KEY,                     -- tok_...
    hash       TEXT NOT NULL UNIQUE,
    playbook   TEXT,                                 -- NULL: every playbook
    role       TEXT NOT NULL CHECK (role IN ('reader', 'writer', 'operator')),
    name       TEXT,
    purpose    TEXT NOT NULL DEFAULT 'api' CHECK (purpose IN ('api', 'login', 'session')),
    created_at INTEGER NOT NULL,
    revoked_at INTEGER,
    used_at    INTEGER,                              -- a session's last use (to the minute)
    expires_at INTEGER,                              -- a session's or a login link's end at the latest
    person     TEXT                                  -- NULL: not a person's (an operator's, a program's)
);

-- The daemon's own keys, made once and kept: `answer_links` signs the answer links (HMAC-SHA256).
CREATE TABLE IF NOT EXISTS daemon_keys (
    name       TEXT PRIMARY KEY,
    secret     TEXT NOT NULL,                        -- hex
    created_at INTEGER NOT NULL
);

-- Typed-API idempotency keys: a replay returns the first response.
CREATE TABLE IF NOT EXISTS idempotency (
    caller     TEXT NOT NULL,
    key        TEXT NOT NULL,
    body_sha   TEXT NOT NULL,
    status     INTEGER NOT NULL,
    response   TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (caller, key)
);
CREATE INDEX IF NOT EXISTS idempotency_by_age ON idempotency (created_at);

-- Deputies: while [starts_at, ends_at) holds on the daemon's clock, what is addressed to `for_person`
-- in the playbook is addressed to `to_person` too; their answer records them and whom they stood for.
CREATE TABLE IF NOT EXISTS deputies (
    id          TEXT PRIMARY KEY,                    -- dep_<ULID>
    playbook    TEXT NOT NULL,
    for_person  TEXT NOT NULL,
    to_person   TEXT NOT NULL,
    starts_at   INTEGER,                             -- NULL: from its making
    ends_at     INTEGER,                             -- NULL: until removed
    created_at  INTEGER NOT NULL,
    created_by  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS deputies_to ON deputies (playbook, to_person);

-- A quorum approval's addressees besides its party: listing by `to` finds it under each of them.
CREATE TABLE IF NOT EXISTS addressees (
    playbook TEXT NOT NULL,
    person   TEXT NOT NULL,
    run_id   TEXT NOT NULL,
    PRIMARY KEY (playbook, person, run_id)
);
"""


def _schema_sql() -> str:
    here = Path(__file__).with_name("schema.sql")
    try:
        return here.read_text()
    except OSError:
        return SCHEMA_SQL


def _migrate_to_2(conn: sqlite3.Connection) -> None:
    """Inbox sessions expire: tokens gain `used_at` and `expires_at`; a session open at the upgrade
    counts as used at its sign-in and ends 7 days after it (an older one has ended)."""
    conn.execute("ALTER TABLE tokens ADD COLUMN used_at INTEGER")
    conn.execute("ALTER TABLE tokens ADD COLUMN expires_at INTEGER")
    conn.execute("UPDATE tokens SET used_at = created_at, expires_at = created_at + ? WHERE purpose = 'session'",
                 (int(INBOX_SESSION_MAX.total_seconds() * 1000),))


def _migrate_to_3(conn: sqlite3.Connection) -> None:
    """Approval gates on tool calls: a request may carry one (`requests.approval`)."""
    conn.execute("ALTER TABLE requests ADD COLUMN approval TEXT")


def _migrate_to_4(conn: sqlite3.Connection) -> None:
    """People: a token, login link or session may name its person (the daemon_keys table is new,
    made by the schema itself)."""
    conn.execute("ALTER TABLE tokens ADD COLUMN person TEXT")


#: The columns version 5 adds to requests: reminders, escalation and the default answer (the
#: nudges table and the escalation's index come with the schema itself).
_FOLLOW_UP_COLUMNS: Final = (("follow_up", "TEXT"), ("reminded", "INTEGER NOT NULL DEFAULT 0"),
                             ("escalated_to", "TEXT"), ("reply_sender", "TEXT"))


def _migrate_to_5(conn: sqlite3.Connection) -> None:
    """Requests remind, escalate and default: they gain the columns that plan and record it (an open
    request of an earlier version has none of it, and goes on as it was)."""
    for name, decl in _FOLLOW_UP_COLUMNS:
        conn.execute(f"ALTER TABLE requests ADD COLUMN {name} {decl}")


def _migrate_to_6(conn: sqlite3.Connection) -> None:
    """Answer schemas are kept once per function version: definitions gain `answer_schema`, and a
    request keeps one (`own_schema`) only where its definition's is not it (a choice's options);
    timers become a WITHOUT ROWID table (their key is their only index)."""
    conn.execute("ALTER TABLE definitions ADD COLUMN answer_schema TEXT")
    _share_answer_schemas(conn)
    conn.execute("CREATE TABLE timers_v3 (key TEXT PRIMARY KEY, due_at INTEGER NOT NULL) WITHOUT ROWID")
    conn.execute("INSERT INTO timers_v3 (key, due_at) SELECT key, due_at FROM timers")
    conn.execute("DROP TABLE timers")
    conn.execute("ALTER TABLE timers_v3 RENAME TO timers")


def _share_answer_schemas(conn: Any) -> None:
    """Version 6's step on either database: each function version's answer schema on its definition
    (from its document; a document this version no longer reads keeps none, and its requests keep
    theirs), then the requests' own copies of it dropped."""
    rows = conn.execute("SELECT playbook, type, name, version, source FROM definitions WHERE type = 'interaction'"
                        ).fetchall()
    for playbook, type_, name, version, source in (tuple(r) for r in rows):
        try:
            schema = parse_function(source).output_schema
        except DocumentError:
            continue
        if schema is not None:
            conn.execute("UPDATE definitions SET answer_schema = ? WHERE playbook = ? AND type = ? AND name = ?"
                         " AND version = ?", (dumps(schema), playbook, type_, name, version))
    conn.execute("ALTER TABLE requests RENAME COLUMN answer_schema TO own_schema")
    conn.execute("UPDATE requests SET own_schema = NULL WHERE own_schema = (SELECT d.answer_schema FROM definitions d"
                 " WHERE d.playbook = requests.playbook AND d.type = requests.type AND d.name = requests.name"
                 " AND d.version = requests.version)")


def _migrate_to_7(conn: Any) -> None:
    """An answer keeps who gave it in words (`requests.answered_by_name`); an earlier answer has none.
    PostgreSQL's step too (POSTGRES_MIGRATIONS): the same statement in either dialect."""
    conn.execute("ALTER TABLE requests ADD COLUMN answered_by_name TEXT")


def _migrate_to_10(conn: Any) -> None:
    """Teams: requests gain `digest` (answers bound to what was shown), filled for the open ones from
    what they show (message, answer schema, an approval's arguments), a closed one keeping none; and
    `on_behalf_of` (a deputy's answer). The deputies and votes tables come with the schema itself.
    PostgreSQL's step too (POSTGRES_MIGRATIONS): the same statements in either dialect."""
    conn.execute("ALTER TABLE requests ADD COLUMN digest TEXT")
    conn.execute("ALTER TABLE requests ADD COLUMN on_behalf_of TEXT")
    rows = conn.execute("SELECT q.seq, q.message, COALESCE(q.own_schema, d.answer_schema), q.approval"
                        " FROM requests q LEFT JOIN definitions d ON d.playbook = q.playbook AND d.type = q.type"
                        " AND d.name = q.name AND d.version = q.version WHERE q.open = 1").fetchall()
    for seq, message, schema, approval in (tuple(r) for r in rows):
        arguments = json.loads(approval).get("arguments") if approval is not None else None
        conn.execute("UPDATE requests SET digest = ? WHERE seq = ?",
                     (request_digest(message, json.loads(schema) if schema is not None else None, arguments), seq))


#: Each step takes a file made by an earlier version to the next PRAGMA user_version, in order.
MIGRATIONS: Final[tuple[tuple[int, Callable[[sqlite3.Connection], None]], ...]] = (
    (2, _migrate_to_2),
    (3, _migrate_to_3),
    (4, _migrate_to_4),
    (5, _migrate_to_5),
    (6, _migrate_to_6),
    (7, _migrate_to_7),
    (10, _migrate_to_10),
)


def apply_schema(conn: sqlite3.Connection) -> None:
    """Bring a file to SCHEMA_VERSION: the migrations it has not had (each in its own transaction,
    with the version it reaches), then the schema itself, which is idempotent."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'tokens'").fetchone() is not None:
        for target, step in MIGRATIONS:
            conn.execute("BEGIN IMMEDIATE")         # read the version under the lock: one process migrates
            try:
                if conn.execute("PRAGMA user_version").fetchone()[0] < target:
                    step(conn)
                    conn.execute(f"PRAGMA user_version = {target}")
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
    conn.executescript(_schema_sql())
    if conn.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


class Effects:
    """What a committed change asks of the in-memory side, delivered by the Bus after the commit."""

    __slots__ = ("timers", "wakes", "published", "invalidated")

    def __init__(self) -> None:
        self.timers: list[tuple[str, int | None]] = []       # in order; None cancels
        self.wakes: list[tuple[str, str]] = []               # (playbook, run_id) whose waiters look again
        self.published: list[dict[str, Any]] = []            # events, to the streams
        self.invalidated: list[tuple[str, ...]] = []         # cached things that changed, e.g. a definition


class LocalBus:
    """The effects of committed changes, delivered in this process: due times to the timer wheel,
    wake-ups to the waiters of a run, events to the streams, invalidations to the caches.

    Everything after a commit goes through here, so a bus that also tells other processes (a
    database's notifications) can take its place without the engine changing.
    """

    def __init__(self) -> None:
        self._waiters: dict[tuple[str, str], set[asyncio.Future[None]]] = {}
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()
        self._timer_sinks: list[Callable[[str, int | None], None]] = []
        self._invalidators: list[Callable[[tuple[str, ...]], None]] = []
        self._event_sinks: list[Callable[[dict[str, Any]], None]] = []
        self._gone_sinks: list[Callable[[], None]] = []
        self.stopped = False

    def on_timer(self, sink: Callable[[str, int | None], None]) -> None:
        self._timer_sinks.append(sink)

    def on_invalidate(self, sink: Callable[[tuple[str, ...]], None]) -> None:
        self._invalidators.append(sink)

    def on_event(self, sink: Callable[[dict[str, Any]], None]) -> None:
        """`sink(event)` for every event this daemon's commits publish (the metrics count them; another
        daemon's are its own to count); it must not raise."""
        self._event_sinks.append(sink)

    def on_gone(self, sink: Callable[[], None]) -> None:
        """`sink()` when other daemons sharing the database are found gone, so their work is taken over;
        never on a file, which has one daemon."""
        self._gone_sinks.append(sink)

    def deliver(self, fx: Effects, remote: bool = False) -> None:
        """The effects of a commit; `remote`: another daemon's, which this one's metrics do not count."""
        for key, due in fx.timers:
            for sink in self._timer_sinks:
                sink(key, due)
        for what in fx.invalidated:
            for sink in self._invalidators:
                sink(what)
        for key in fx.wakes:
            for fut in self._waiters.pop(key, ()):
                if not fut.done():
                    fut.set_result(None)
        for event in fx.published:
            if not remote:
                for event_sink in self._event_sinks:
                    event_sink(event)
            for q in list(self._subscribers):
                if q.qsize() < 1000:
                    q.put_nowait(event)

    def waiter(self, key: tuple[str, str]) -> asyncio.Future[None]:
        """A future that resolves when a change wakes `key` (or the bus stops); `forget` it after."""
        fut = asyncio.get_running_loop().create_future()
        if self.stopped:
            fut.set_result(None)
        else:
            self._waiters.setdefault(key, set()).add(fut)
        return fut

    def forget(self, key: tuple[str, str], fut: asyncio.Future[None]) -> None:
        waiters = self._waiters.get(key)
        if waiters is not None:
            waiters.discard(fut)
            if not waiters:
                self._waiters.pop(key, None)

    def end_waits(self) -> None:
        """At shutdown: every waiter resolves now, and none waits again."""
        self.stopped = True
        for futs in self._waiters.values():
            for f in futs:
                if not f.done():
                    f.set_result(None)

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any]]) -> None:
        self._subscribers.discard(q)


def _private_file(path: str) -> None:
    """Create `path` (and the WAL and shared-memory files SQLite will put beside it) readable by the
    owner only: SQLite gives the -wal and -shm files the mode of the database file."""
    if path == ":memory:" or path.startswith("file:"):
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    os.close(fd)
    os.chmod(path, 0o600)


def _connect(path: str) -> sqlite3.Connection:
    _private_file(path)
    # Every statement of the store stays prepared: sqlite3 keeps 128 by default, fewer than the
    # store's statements and their variants (a listing's filters, IN lists), and a statement
    # prepared again costs more than most run.
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=5.0, cached_statements=1024)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=5000")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA temp_store=MEMORY")
    return conn


class _DbThread(threading.Thread):
    """A thread that owns one connection and runs functions of it, in batches when it writes.

    `connect` opens the connection as the backend's operations (SQLiteTx or PostgresTx); what the
    dialects do differently at a transaction's edges (begin, whether it still stands, which errors
    mean an unavailable database) the operations object says.

    On a file the writer's batches usually run on the event loop's thread instead (`commit_here`),
    on the same connection, while nothing handed to the thread is still to settle; the thread takes
    the batches that find the file locked by another connection, and every batch after them until
    they have settled, so the changes commit in the order they were asked for.
    """

    def __init__(self, connect: Callable[[], "SqlTx"], loop: asyncio.AbstractEventLoop, *, writer: bool,
                 sink: Callable[[Effects], None] | None = None,
                 on_batch: Callable[[int, float], None] | None = None) -> None:
        super().__init__(name="interactiond-writer" if writer else "interactiond-reader", daemon=True)
        self.connect = connect
        self.sink = sink
        self.on_batch = on_batch            # (changes, seconds) of each group commit, for the metrics
        self.loop = loop
        self.writer = writer
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.ready = threading.Event()
        self.conn: Any = None
        self.start_error: BaseException | None = None
        self.checkpointer: _Checkpointer | None = None
        self.pending = 0                    # handed to the thread and not settled yet (counted on the loop)

    def hand(self, batch: list[tuple[Any, ...]]) -> None:
        """Give the thread a batch (on the loop); its results settle on the loop when it is done."""
        self.pending += 1
        self.q.put(batch)

    def _settle(self, settled: list[tuple[Any, ...]], handed: int) -> None:
        self.pending -= handed
        _settle_all(settled, self.sink)

    def commit_here(self, batch: list[tuple[Any, ...]]) -> bool:
        """Run a batch of changes and commit it now, on the calling thread (the event loop's), when the
        write lock is free: False, nothing run, when another connection holds it (the thread then
        waits for it, not the loop). Only while the thread is idle (`pending` is 0): one connection.

        On a file a commit appends to the WAL without an fsync (synchronous=NORMAL), so running it
        here costs the loop what it costs the thread, and saves the hand-over: the thread's wake-up,
        the GIL passed to it and back at every statement, and the loop's wake-up for the results
        (bench/README.md has the figures).
        """
        try:
            if not self.tx.begin_at_once():
                return False
        except BaseException as exc:
            failure = self.tx.problem(exc)
            _settle_all([(fut, None, failure, None) for _, fut, *_ in batch], None)
            return True
        began = time.perf_counter()
        settled = self.tx.run_begun(batch)
        if self.on_batch is not None:
            self.on_batch(len(batch), time.perf_counter() - began)
        if self.checkpointer is not None:
            self.checkpointer.due.set()
        _settle_all(settled, self.sink)
        return True

    def run(self) -> None:
        try:
            self.tx = self.connect()
            self.conn = self.tx.conn
        except BaseException as exc:  # reported by Store.open
            self.start_error = exc
            self.ready.set()
            return
        self.ready.set()
        while True:
            item = self.q.get()
            if item is None:
                break
            batch = list(item)              # the loop hands over what one of its turns asked for
            handed = 1
            while len(batch) < 512:
                try:
                    nxt = self.q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.q.put(None)
                    break
                batch.extend(nxt)
                handed += 1
            began = time.perf_counter()
            settled = self._run_batch(batch) if self.writer else [self._run_read(*it) for it in batch]
            if self.on_batch is not None:
                self.on_batch(len(batch), time.perf_counter() - began)
            self.loop.call_soon_threadsafe(self._settle, settled, handed)
            if self.checkpointer is not None:
                self.checkpointer.due.set()
        self.tx.close()

    def _run_read(self, fn: Callable[..., Any], fut: asyncio.Future[Any], fx: None) -> tuple[Any, ...]:
        try:
            self.tx.ready()
            return (fut, fn(self.tx), None, None)
        except BaseException as exc:
            return (fut, None, self.tx.problem(exc), None)

    def _run_batch(self, batch: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        tx = self.tx
        try:
            tx.begin()
        except BaseException as exc:
            failure = tx.problem(exc)
            return [(fut, None, failure, None) for _, fut, *_ in batch]
        return self.tx.run_begun(batch)


def _db_problem(exc: BaseException, otherwise: str | None = None) -> BaseException:
    """A locked, full or failing database as a problem that says so (nothing of the change was written);
    any other error as it is (or as a plain failure when `otherwise` describes it)."""
    name = getattr(exc, "sqlite_errorname", "") if isinstance(exc, sqlite3.Error) else ""
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return Problem("unavailable", "the database is locked by another process and stayed locked past the busy"
                       " timeout; nothing was written, try again", kind="database_busy")
    if name.startswith("SQLITE_FULL"):
        return Problem("unavailable", "the database's disk is full; nothing was written", kind="disk_full")
    if name.startswith(("SQLITE_IOERR", "SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_CORRUPT", "SQLITE_NOTADB")):
        return Problem("failed", f"the database could not be written ({name}); nothing was written", kind="database")
    return Problem("failed", otherwise) if otherwise is not None else exc


#: Changes that commit on the loop wait this many more turns of it first (Store._hand_over), unless
#: this many are waiting already: the requests read in the next turn reach their changes in the one
#: after, so two turns let a commit carry them too (bench/README.md: "a commit that waits two turns").
COMMIT_GATHER_TURNS: Final = 2
COMMIT_GATHER_MAX: Final = 32
#: The writer checkpoints only if the checkpointer falls this far behind (pages of 4 KiB).
WRITER_AUTOCHECKPOINT_PAGES: Final = 16_000
#: How long the checkpointer lets commits gather before it copies them into the database file.
CHECKPOINT_EVERY_S: Final = 0.25
#: After this long without a commit the checkpointer empties the WAL file (TRUNCATE): under a
#: steady load the WAL only restarts at the writer's safety net, so its file grows, and stays that
#: size on disk, unless it is emptied (bench/README.md, "Storage").
CHECKPOINT_QUIET_S: Final = 1.0
#: What the WAL file is cut back to whenever it restarts from its beginning.
WAL_SIZE_LIMIT_BYTES: Final = 4 * MIB


class _Checkpointer(threading.Thread):
    """Copies the WAL into the database file on its own connection, off the write path.

    SQLite's automatic checkpoint runs inside the commit that crosses 1,000 WAL pages: with ~17
    pages a run, every ~60th commit stalled 11-15 ms, and so did every caller in its batch. A
    PASSIVE checkpoint here runs beside the writer's commits (WAL allows it) and never waits for
    a lock; what it cannot copy yet, the next one does.
    """

    def __init__(self, path: str) -> None:
        super().__init__(name="interactiond-checkpoint", daemon=True)
        self.path = path
        self.due = threading.Event()
        self.halt = threading.Event()

    def run(self) -> None:
        conn = _connect(self.path)
        conn.execute("PRAGMA busy_timeout = 100")      # an emptying waits this long for a writer, at most
        try:
            while not self.halt.is_set():
                self.due.wait()
                if self.halt.wait(CHECKPOINT_EVERY_S):      # let commits gather: one copy, one fsync
                    return
                self.due.clear()
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                except sqlite3.Error:
                    log.warning("a checkpoint of %s failed; the next one tries again", self.path, exc_info=True)
                if not self.due.wait(CHECKPOINT_QUIET_S) and not self.halt.is_set():
                    # Quiet: copy what is left and empty the WAL file (busy when a write began meanwhile:
                    # the next quiet moment tries again).
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            conn.close()

    def stop(self) -> None:
        self.halt.set()
        self.due.set()


def _settle_all(settled: list[tuple[Any, ...]], sink: Callable[[Effects], None] | None) -> None:
    for fut, result, exc, fx in settled:
        if fx is not None and sink is not None:
            try:
                sink(fx)
            except Exception:
                log.exception("applying the effects of a committed change failed")
        if fut.done():
            continue
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)


@dataclass(frozen=True)
class Backend:
    """A database the store also runs on, registered by its section below (as PostgreSQL does):
    which paths are its (`owns`), its Store subclass, and its open_sync."""

    owns: Callable[[str], bool]
    store: type
    open_sync: Callable[[str], Any]


#: The other backends, by their sections; a path none of them owns is an SQLite file.
STORE_BACKENDS: Final[list[Backend]] = []


def _backend_of(path: str) -> Backend | None:
    return next((b for b in STORE_BACKENDS if b.owns(path)), None)


class Store:
    """The SQLite file: the schema, one writer thread with group commit, one reader thread.

    `Store(path)` with a path another backend owns (a PostgreSQL URL, postgresql://...) makes that
    backend's store instead: the same operations, threads and commits over a database server.
    """

    #: Whether a turn's changes commit on the event loop's thread when the writer thread is idle and
    #: the write lock free (_DbThread.commit_here): a file's commit is a write to its WAL; a server's
    #: is a round trip the loop must not wait for.
    commits_on_loop = True

    def __new__(cls, path: str, on_commit: Callable[[Effects], None] | None = None) -> "Store":
        if cls is Store and (backend := _backend_of(path)) is not None:
            cls = backend.store
        return super().__new__(cls)

    def __init__(self, path: str, on_commit: Callable[[Effects], None] | None = None) -> None:
        self.path = path
        self.on_commit = on_commit
        self.on_batch: Callable[[int, float], None] | None = None     # each group commit: (changes, seconds)
        self._writer: _DbThread | None = None
        self._reader: _DbThread | None = None
        self._checkpointer: _Checkpointer | None = None
        self._writes: list[tuple[Any, ...]] = []          # asked for in this turn of the loop (write)
        self._reads: list[tuple[Any, ...]] = []
        self._handing_over = False
        self._gathered = 0                                 # turns the changes waiting here have waited

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        init = _connect(self.path)
        try:
            apply_schema(init)
        finally:
            init.close()
        self._writer = _DbThread(lambda: self._connect_tx(True), loop, writer=True,
                                 sink=lambda fx: self.on_commit and self.on_commit(fx),
                                 on_batch=lambda n, s: self.on_batch and self.on_batch(n, s))
        self._reader = _DbThread(lambda: self._connect_tx(False), loop, writer=False)
        self._checkpointer = _Checkpointer(self.path)
        self._checkpointer.start()
        self._writer.checkpointer = self._checkpointer
        for t in (self._writer, self._reader):
            t.start()
            t.ready.wait()
            if t.start_error:
                raise t.start_error

    def make_bus(self, clock: Clock) -> LocalBus:
        """The bus that delivers the effects of this store's commits (the engine's): in-process here."""
        return LocalBus()

    def _connect_tx(self, writer: bool) -> "SQLiteTx":
        conn = _connect(self.path)
        if writer:                          # the checkpointer copies the WAL; this is only a safety net
            conn.execute(f"PRAGMA wal_autocheckpoint = {WRITER_AUTOCHECKPOINT_PAGES}")
            conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT_BYTES}")
        return SQLiteTx(conn)

    async def close(self) -> None:
        self._hand_over(gather=False)
        for t in (self._writer, self._reader):
            if t is not None and t.is_alive():
                t.q.put(None)
        for t in (self._writer, self._reader):
            if t is not None:
                await asyncio.get_running_loop().run_in_executor(None, t.join, 5.0)
        if self._checkpointer is not None:
            self._checkpointer.stop()
            await asyncio.get_running_loop().run_in_executor(None, self._checkpointer.join, 5.0)
        self._writer = self._reader = self._checkpointer = None

    def write(self, change: Callable[[sqlite3.Connection, Effects], Any]) -> asyncio.Future[Any]:
        """Run `change(conn, effects)` in the next group commit; resolves after COMMIT.

        A change reaches the database through `conn` and the daemon through `effects` only, and runs
        once, in a savepoint of its own within the group commit (SQLiteTx.run_begun): when it raises,
        what it wrote is undone and the other changes of the group commit stand.

        The changes and readings asked for in one turn of the event loop go to their threads
        together, at the end of the turn (changes that commit on the loop gather a little longer:
        _hand_over): one wake-up of each thread per turn, not one per call.
        Waking a thread costs the loop a system call and, on a busy machine, its core for a while
        (the woken thread is scheduled where the loop runs and asks for the GIL the loop holds):
        a tenth of the loop's time when it was one per call."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._writes.append((change, fut, Effects()))
        if not self._handing_over:
            self._handing_over = True
            loop.call_soon(self._hand_over)
        return fut

    def read(self, query: Callable[[sqlite3.Connection], Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._reads.append((query, fut, None))
        if not self._handing_over:
            self._handing_over = True
            loop.call_soon(self._hand_over)
        return fut

    def _hand_over(self, gather: bool = True) -> None:
        """Give the writer and the reader what this turn of the loop asked of them (see write).

        Changes that would commit here, on the loop, first wait COMMIT_GATHER_TURNS more turns
        (fewer than COMMIT_GATHER_MAX of them, and unless `gather` is False): the requests that
        arrived beside theirs are read in the next turn and reach their own changes in the one
        after, so the commit carries those too. Its cost is much the same whatever it carries
        (the WAL's shared pages, BEGIN and COMMIT, the results settled in one go)."""
        self._handing_over = False
        if self._writes:
            writer = self._writer
            here = self.commits_on_loop and not writer.pending
            if here and gather and self._gathered < COMMIT_GATHER_TURNS and len(self._writes) < COMMIT_GATHER_MAX:
                self._gathered += 1
                self._handing_over = True
                asyncio.get_running_loop().call_soon(self._hand_over)
            else:
                self._gathered = 0
                batch, self._writes = self._writes, []
                if not (here and writer.commit_here(batch)):
                    writer.hand(batch)
        if self._reads:
            batch, self._reads = self._reads, []
            self._reader.hand(batch)

    def read_sync(self, query: Callable[[sqlite3.Connection], Any]) -> Any:
        """For the command line and start-up, outside the loop."""
        conn = _connect(self.path)
        try:
            return query(SQLiteTx(conn))
        finally:
            conn.close()

    async def claim(self, key: str, *, due_by: int | None = None) -> bool:
        """Hold the work of a timer's key (a conversation's reading, a workflow run's steps) for this
        daemon until `release`; False when another daemon holds it (or, with `due_by`, when the timer
        is no longer due by then). A file has one daemon, its lock says so: nothing to hold against."""
        return True

    async def release(self, key: str) -> bool:
        """Give the work of `key` back; True when another daemon asked for it meanwhile, so it is this
        daemon's to do again. Nothing is held on a file: False."""
        return False


def open_sync(path: str) -> "SqlTx":
    """The file (or the PostgreSQL database) with the schema applied, outside the loop: for the
    command line (token, check) and tests. Each operation commits on its own."""
    if (backend := _backend_of(path)) is not None:
        return backend.open_sync(path)
    conn = _connect(path)
    apply_schema(conn)
    return SQLiteTx(conn)


#: What a database failure raises below the store, for the command line to say in one line.
STORE_ERRORS: Final = (sqlite3.Error,)

#: A row as the store gives it: read by column name (`row["status"]`), whatever the backend.
Row = Mapping[str, Any]


class Tx(Protocol):
    """What a change or a reading is handed: the store's named operations (SqlTx's, on SQLiteTx for
    the embedded file or PostgresTx on a server). The engine reaches the database through these only;
    tests/test_store_contract.py runs them on both backends. The main ones, by what they move:"""

    # Runs.

    def insert_run(self, *, playbook: str, run_id: str, type_: str, name: str, version: int, input_text: str,
                   input_sha: str, parent: str | None, now: int, by: str, tools_called: bool = False,
                   state: str | None = None) -> bool: ...
    def insert_asking_run(self, *, playbook: str, run_id: str, type_: str, name: str, version: int, input_text: str,
                          input_sha: str, parent: str | None, now: int, by: str, limit: int) -> tuple[bool, bool]: ...
    def run(self, playbook: str, run_id: str) -> Row | None: ...
    def end_run(self, fx: Effects, playbook: str, run_id: str, status: RunStatus, *, now: int, by: str | None,
                kind: str | None = None, output: Any = None, problem: Problem | None = None) -> None: ...
    def list_runs(self, playbook: str, *, status: str | None, function: str | None, before: int | None,
                  limit: int) -> list[Row]: ...
    def step_workflow(self, playbook: str, run_id: str, *, read: str, state: str, status: RunStatus,
                      live_child: str | None = None) -> bool: ...

    # Requests.

    def take_request_slot(self, playbook: str, limit: int) -> bool: ...
    def open_request(self, *, request_id: str, playbook: str, run_id: str, type_: str, name: str, version: int,
                     party: str, answerer: str, message: str, answer_schema: str | None, server: str | None,
                     tool: str | None, delivery: DeliveryState, asked_at: int, expires_at: int,
                     deliver_args: str | None, notified: bool = False, follow_up: str | None = None,
                     digest: str | None = None) -> None: ...
    def request(self, playbook: str, run_id: str) -> Row | None: ...
    def close_request(self, fx: Effects, playbook: str, run_id: str, ending: Ending) -> Row | None: ...
    def record_answer(self, fx: Effects, req: Row, answer: Any, *, by: str, now: int,
                      claimed_for: str | None = None, reply_id: str | None = None,
                      reply_sender: str | None = None, on_behalf_of: str | None = None) -> None: ...
    def answer_request(self, fx: Effects, req: Row, answer: Any, *, by: str, now: int,
                       claimed_for: str | None = None, reply_id: str | None = None,
                       reply_sender: str | None = None, on_behalf_of: str | None = None) -> Row: ...
    def record_default(self, fx: Effects, req: Row, answer: Any, *, now: int) -> None: ...
    def cancel_delivery(self, playbook: str, run_id: str) -> bool: ...

    # Attempts.

    def begin_attempt(self, playbook: str, run_id: str, *, now: int) -> Row | None: ...
    def end_attempt(self, seq: int, attempt: int, state: DeliveryState, *, sent_conversation: str | None = None,
                    sent_id: str | None = None, conversation: str | None = None) -> bool: ...
    def fail_attempt(self, seq: int, *, spent: bool) -> bool: ...

    # Timers and events.

    def set_timer(self, fx: Effects, key: str, due: int) -> None: ...
    def drop_timer(self, fx: Effects, key: str) -> None: ...
    def take_timer(self, fx: Effects, key: str, now: int) -> bool: ...
    def timer_due(self, key: str) -> int | None: ...
    def all_timers(self) -> list[tuple[str, int]]: ...
    def timers_due(self, after: int | None, until: int) -> list[tuple[str, int]]: ...
    def append_event(self, fx: Effects | None, playbook: str, run_id: str | None, type_: str, at: int,
                     by: str | None, payload: dict[str, Any], *, run_seq: int | None = None) -> int: ...
    def run_events(self, playbook: str, run_id: str, *, after: int, limit: int) -> list[Row]: ...
    def playbook_events(self, playbook: str, *, type_: str | None, after: int, limit: int) -> list[Row]: ...

    # Readings.

    def join_reading(self, seq: int, *, playbook: str, server: str, tool: str, conversation: str,
                     wait_ms: int) -> Row: ...
    def reading(self, reading_id: int) -> Row | None: ...
    def see_reply(self, reading_id: int, reply_id: str) -> bool: ...
    def read_up_to(self, reading_id: int, since: str) -> None: ...
    def count_read(self, reading_id: int) -> Row: ...

    # Definitions.

    def save_definition(self, *, playbook: str, type_: str, name: str, source: str, sha: str, overview: str,
                        description: str | None, uses: Any, now: int, by: str,
                        answer_schema: str | None = None) -> tuple[int, bool]: ...
    def definition(self, playbook: str, type_: str, name: str, version: int | None = None) -> Row | None: ...
    def list_definitions(self, playbook: str, type_: str | None = None) -> list[Row]: ...
    def deactivate_definition(self, playbook: str, type_: str, name: str) -> bool: ...

    # Tokens and sessions.

    def insert_token(self, *, token_id: str, digest: str, playbook: str | None, role: str, name: str | None,
                     purpose: str, now: int, used_at: int | None, expires_at: int | None,
                     person: str | None = None) -> None: ...
    def caller_token(self, digest: str) -> Row | None: ...
    def touch_session(self, token_id: str, now: int) -> bool: ...
    def spend_login(self, digest: str, now: int) -> Row | None: ...
    def end_session(self, digest: str, now: int) -> bool: ...
    def revoke_token(self, token_id: str, now: int) -> bool: ...

    # Deputies.

    def add_deputy(self, *, deputy_id: str, playbook: str, for_person: str, to_person: str,
                   starts_at: int | None, ends_at: int | None, now: int, by: str) -> None: ...
    def deputies(self, playbook: str | None) -> list[Row]: ...
    def remove_deputy(self, playbook: str | None, deputy_id: str) -> Row | None: ...
    def standing_for(self, playbook: str, person: str, now: int) -> list[str]: ...
    def add_addressees(self, playbook: str, run_id: str, people: Iterable[str]) -> None: ...
    def set_digest(self, playbook: str, run_id: str, digest: str) -> None: ...

    # Idempotency.

    def idempotent_response(self, caller: str, key: str) -> Row | None: ...
    def remember_response(self, *, caller: str, key: str, body_sha: str, response: dict[str, Any],
                          now: int) -> None: ...

    # Work held by one daemon among several.

    def release_lease(self, key: str) -> bool: ...
    def attempt_elsewhere(self, playbook: str, run_id: str) -> bool: ...
    def take_over(self, fx: Effects, now: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Dialect:
    """How the store's shared SQL (SqlTx's) is said on one backend where the two differ. The
    statements are written with `?` placeholders; `sql` gives them in the driver's."""

    #: The store's statement in the driver's placeholders.
    sql: Callable[[str], str]
    #: The larger of two values: a function of two arguments.
    greatest: str
    #: The active definitions of a playbook (of one type, or all: the type given twice, or NULL):
    #: type, name, latest version and its description, by type and name.
    latest_definitions: str
    #: A condition on a definition `d`: its `uses`, a JSON list of [type, name] pairs, holds the pair
    #: given (two placeholders).
    uses_pair: str
    #: A run inserted (_INSERT_RUN_SQL's values) and, if it was, its request counted (the playbook and
    #: the limit), in one statement returning whether each happened; "" where two statements do.
    asking_run: str = ""


SQLITE_DIALECT: Final = Dialect(
    sql=lambda text: text,
    greatest="MAX",
    # SQLite takes a bare column from the row of MAX().
    latest_definitions="SELECT type, name, MAX(version) AS version, description FROM definitions"
                       " WHERE playbook = ? AND active = 1 AND (? IS NULL OR type = ?) GROUP BY type, name"
                       " ORDER BY type, name",
    uses_pair="EXISTS (SELECT 1 FROM json_each(d.uses) u WHERE json_extract(u.value, '$[0]') = ?"
              " AND json_extract(u.value, '$[1]') = ?)",
)


class SqlTx:
    """The store's named operations, on one connection: a change's transaction or a reading; shared
    by the two backends, SQLiteTx and PostgresTx, each of which says how it begins, commits and
    undoes a change, and how its SQL differs (`dialect`).

    A change is a plain function `change(tx, fx)` handed to `Store.write`; a reading is
    `query(tx)` handed to `Store.read`. Everything above the store talks to the database through
    these methods only, so no SQL and no driver type stands outside this section. Each state change
    is guarded in its own statement: `UPDATE ... WHERE status IN (<the states it may leave>)
    RETURNING ...`; no row back means the move was not allowed, and the operation says so (None,
    False or a `conflict` problem) rather than reading, checking in Python and writing by key.
    """

    __slots__ = ("conn",)

    #: How the shared SQL is said on this backend (SQLITE_DIALECT, POSTGRES_DIALECT).
    dialect: "Dialect"
    #: The driver's errors: a rollback after a failure may raise one again, and it is ignored then.
    errors: tuple[type[BaseException], ...] = ()

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def close(self) -> None:
        self.conn.close()

    # The edges of a transaction, as the writer thread drives them, are each backend's (begin,
    # run_change, commit, rollback, in_transaction, problem): a group commit opens one transaction
    # and runs its changes one after another in it, each in a savepoint of its own.

    def run_begun(self, batch: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """Run each change `(change, future, effects)` of a batch in the transaction just begun,
        each in a savepoint of its own (run_change), and commit: (future, result, problem, effects) of
        each. The writer thread (and the loop's commit_here) drives this.

        A change that raises is undone back to its savepoint and fails alone: the changes before and
        after it keep what they wrote, and none runs twice. A failure that ends the transaction
        itself (a full disk, an I/O error, a lost connection) fails every change of the batch, as
        does a commit that fails."""
        out: list[tuple[Any, ...]] = []
        for i, (fn, fut, fx) in enumerate(batch):
            try:
                result = self.run_change(fn, fx)
            except BaseException as exc:
                if not self.in_transaction():
                    # The whole transaction is gone: the changes before this one with it, and the ones
                    # after it must not run outside one.
                    failure = self.problem(exc)
                    with contextlib.suppress(*self.errors):
                        self.rollback()
                    return [(f, None, failure if e is None else e, None) for f, _, e, _ in out] + \
                        [(f, None, failure, None) for _, f, *_ in batch[i:]]
                out.append((fut, None, self.problem(exc), None))
                continue
            out.append((fut, result, None, fx))
        try:
            self.before_commit([fx for *_, fx in out if fx is not None])
            self.commit()
        except BaseException as exc:
            with contextlib.suppress(*self.errors):
                self.rollback()
            failure = self.problem(exc, f"the database refused the write: {exc}")
            return [(fut, None, failure if e is None else e, None) for fut, _, e, _ in out]
        return out

    # Events and timers.

    def append_event(self, fx: Effects | None, playbook: str, run_id: str | None, type_: str, at: int,
                     by: str | None, payload: dict[str, Any], *, run_seq: int | None = None) -> int:
        """Append one event; run events also take the next run_seq (or the one given, already
        counted in runs.events by the caller's own UPDATE); `not_found` when the run is not there.
        Returns the event id."""
        text = dumps(payload)
        event_id = self._insert_event(playbook, run_id, run_seq, (type_, at, by, text, len(text.encode())))
        if fx is not None:
            fx.published.append({"id": event_id, "playbook": playbook, "run_id": run_id, "type": type_, "at": at,
                                 "by": by, "payload": payload})
        return event_id

    def counted_events(self, fx: Effects, playbook: str, run_id: str, at: int, by: str | None,
                       events: list[tuple[int, str, dict[str, Any]]]) -> list[int]:
        """Append events of a run that the caller counted in runs.events itself: (run_seq, type,
        payload) each, in one statement where the backend can. Their ids."""
        rows = []
        for run_seq, type_, payload in events:
            text = dumps(payload)
            rows.append((run_seq, (type_, at, by, text, len(text.encode()))))
        ids = self._insert_events(playbook, run_id, rows)
        fx.published.extend({"id": event_id, "playbook": playbook, "run_id": run_id, "type": type_, "at": at,
                             "by": by, "payload": payload} for event_id, (_, type_, payload) in zip(ids, events))
        return ids

    def _insert_event(self, playbook: str, run_id: str | None, run_seq: int | None, values: tuple[Any, ...]) -> int:
        """The event's row (`values`: type, at, by, payload, size), counted on its run unless `run_seq`
        is given; its id. Each backend's."""
        raise NotImplementedError

    def _insert_events(self, playbook: str, run_id: str, rows: list[tuple[int, tuple[Any, ...]]]) -> list[int]:
        """Events of a run, each (run_seq, values) already counted; their ids."""
        return [self._insert_event(playbook, run_id, run_seq, values) for run_seq, values in rows]

    def guard(self, cursor: Any, problem: Problem) -> None:
        """A guarded statement's outcome that the change needs only as a whole: `problem` is raised,
        and the change undone, when it changed no row - here at once, on a server at the change's
        end (PostgresTx), so that its statements travel together."""
        if not cursor.rowcount:
            raise problem

    def set_timer(self, fx: Effects, key: str, due: int) -> None:
        self.conn.execute("INSERT INTO timers (key, due_at) VALUES (?, ?)"
                          " ON CONFLICT(key) DO UPDATE SET due_at = excluded.due_at", (key, due))
        fx.timers.append((key, due))

    def drop_timer(self, fx: Effects, key: str) -> None:
        self.conn.execute("DELETE FROM timers WHERE key = ?", (key,))
        fx.timers.append((key, None))

    def take_timer(self, fx: Effects, key: str, now: int) -> bool:
        """Claim a due timer: True once, for the change that fires it; False if it moved or went."""
        taken = self.conn.execute("DELETE FROM timers WHERE key = ? AND due_at <= ? RETURNING key",
                                  (key, now)).fetchone()
        if taken is None:
            return False
        fx.timers.append((key, None))
        return True

    def timer_due(self, key: str) -> int | None:
        """When a timer is due, or None when there is none."""
        row = self.conn.execute("SELECT due_at FROM timers WHERE key = ?", (key,)).fetchone()
        return row["due_at"] if row is not None else None

    # Runs.

    def end_run(self, fx: Effects, playbook: str, run_id: str, status: RunStatus, *, now: int, by: str | None,
                kind: str | None = None, output: Any = None, problem: Problem | None = None) -> None:
        """Write a run's ending and its event; only a live run ends (guarded), else `conflict`."""
        self._end_run(fx, playbook, run_id, status, now=now, by=by, kind=kind, output=output, problem=problem)

    def _end_run(self, fx: Effects, playbook: str, run_id: str, status: RunStatus, *, now: int, by: str | None,
                 kind: str | None = None, output: Any = None, problem: Problem | None = None,
                 before: tuple[str, dict[str, Any]] | None = None) -> int | None:
        """end_run; with `before` (type, payload), an event of the run appended just before the
        ending's and counted in the same UPDATE. Its id, or None."""
        pbody = problem.body() if problem is not None else None
        ended = self.conn.execute(_END_RUN_SQL, (status.value, kind, dumps(output) if output is not None else None,
                                                 dumps(pbody) if pbody else None, now, by, 1 if before is None else 2,
                                                 playbook, run_id)).fetchone()
        if ended is None:
            raise Problem("conflict", "the run has already ended")
        parent, seq = ended["parent"], ended["events"]
        payload: dict[str, Any] = {"status": status.value, "kind": kind}
        if status is RunStatus.SUCCEEDED:
            payload["output"] = output
        else:
            payload["problem"] = pbody
        events = [(seq, "run_" + status.value, payload)]
        if before is not None:
            events.insert(0, (seq - 1, *before))
        ids = self.counted_events(fx, playbook, run_id, now, by, events)
        first = ids[0] if before is not None else None
        fx.wakes.append((playbook, run_id))
        if parent is not None:      # workflows: the one waiting on this run moves on, woken in this transaction
            self.set_timer(fx, timer_key("workflow", playbook, parent), now)
        return first

    # Housekeeping.

    def prune(self, *, now: int) -> tuple[int, int]:
        """Delete idempotency keys past IDEMPOTENCY_KEEP and ended sessions and login links; the counts."""
        keys = self.conn.execute("DELETE FROM idempotency WHERE created_at <= ?",
                                 (now - int(IDEMPOTENCY_KEEP.total_seconds() * 1000),)).rowcount
        idle_ms = int(INBOX_SESSION_IDLE.total_seconds() * 1000)
        sessions = self.conn.execute(
            "DELETE FROM tokens WHERE (purpose = 'login' AND (revoked_at IS NOT NULL OR expires_at <= ?)) OR"
            " (purpose = 'session' AND (revoked_at IS NOT NULL OR expires_at <= ? OR used_at <= ?))",
            (now, now, now - idle_ms)).rowcount
        return keys, sessions

    # Definitions and runs: documents saved and deleted, runs inserted, read and listed, system calls.

    def save_definition(self, *, playbook: str, type_: str, name: str, source: str, sha: str, overview: str,
                        description: str | None, uses: Any, now: int, by: str,
                        answer_schema: str | None = None) -> tuple[int, bool]:
        """Save a document as the next version of its name (every earlier one goes inactive); the active
        latest version with the same text is kept instead. The version, and whether it is new.
        `answer_schema` is the one its requests share (the document's output schema, as dumps writes it)."""
        conn = self.conn
        row = conn.execute("SELECT version, source_sha, active FROM definitions WHERE playbook = ? AND type = ?"
                           " AND name = ? ORDER BY version DESC LIMIT 1", (playbook, type_, name)).fetchone()
        if row is not None and row["active"] and row["source_sha"] == sha:
            return row["version"], False
        version = (row["version"] + 1) if row is not None else 1
        if row is not None:
            conn.execute("UPDATE definitions SET active = 0 WHERE playbook = ? AND type = ? AND name = ?",
                         (playbook, type_, name))
        conn.execute("INSERT INTO definitions (playbook, type, name, version, source, source_sha, overview,"
                     " description, uses, answer_schema, active, created_at, created_by)"
                     " VALUES (?,?,?,?,?,?,?,?,?,?,1,?,?)",
                     (playbook, type_, name, version, source, sha, overview, description, dumps(uses), answer_schema,
                      now, by))
        return version, True

    def save_builtin(self, playbook: str, name: str, *, source: str, sha: str, overview: str,
                     description: str | None, now: int, answer_schema: str | None = None) -> None:
        """Save a built-in function at version 1, or bring the playbook's version 1 to this daemon's text
        (a built-in's input may grow; nobody else saves under its name)."""
        self.conn.execute(
            "INSERT INTO definitions (playbook, type, name, version, source, source_sha, overview, description,"
            " answer_schema, active, created_at, created_by)"
            " VALUES (?, 'interaction', ?, 1, ?, ?, ?, ?, ?, 1, ?, 'interactiond')"
            " ON CONFLICT (playbook, type, name, version) DO UPDATE SET source = excluded.source,"
            " source_sha = excluded.source_sha, overview = excluded.overview, description = excluded.description,"
            " answer_schema = excluded.answer_schema WHERE definitions.source_sha <> excluded.source_sha",
            (playbook, name, source, sha, overview, description, answer_schema, now))

    def definition(self, playbook: str, type_: str, name: str, version: int | None = None) -> Row | None:
        """A definition at `version`, or its active latest version when `version` is None."""
        if version is None:
            return self.conn.execute("SELECT * FROM definitions WHERE playbook = ? AND type = ? AND name = ?"
                                     " AND active = 1 ORDER BY version DESC LIMIT 1", (playbook, type_, name)).fetchone()
        return self.conn.execute("SELECT * FROM definitions WHERE playbook = ? AND type = ? AND name = ? AND version = ?",
                                 (playbook, type_, name, version)).fetchone()

    def list_definitions(self, playbook: str, type_: str | None = None) -> list[Row]:
        """The active definitions of a playbook (of one type, if given): type, name, latest version, description."""
        return self.conn.execute(self.dialect.latest_definitions, (playbook, type_, type_)).fetchall()

    def deactivate_definition(self, playbook: str, type_: str, name: str) -> bool:
        """Make every version of a name inactive; False if none was active."""
        return self.conn.execute("UPDATE definitions SET active = 0 WHERE playbook = ? AND type = ? AND name = ?"
                                 " AND active = 1", (playbook, type_, name)).rowcount > 0

    def ensure_playbook(self, playbook: str, *, now: int) -> None:
        """Add a configured playbook the file does not hold yet."""
        self.conn.execute("INSERT INTO playbooks (id, created_at) VALUES (?, ?) ON CONFLICT DO NOTHING", (playbook, now))

    def insert_run(self, *, playbook: str, run_id: str, type_: str, name: str, version: int, input_text: str,
                   input_sha: str, parent: str | None, now: int, by: str, tools_called: bool = False,
                   state: str | None = None) -> bool:
        """Insert a run, started; False (nothing written) when its run id is taken."""
        return self.conn.execute(_INSERT_RUN_SQL + " RETURNING seq", (
            playbook, run_id, type_, name, version, input_text, input_sha, RunStatus.STARTED.value,
            1 if tools_called else 0, parent, state, now, by)).fetchone() is not None

    def insert_asking_run(self, *, playbook: str, run_id: str, type_: str, name: str, version: int, input_text: str,
                          input_sha: str, parent: str | None, now: int, by: str, limit: int) -> tuple[bool, bool]:
        """insert_run for a run that opens a request, and, when it was inserted, take_request_slot:
        whether the run was inserted, and whether its request was counted."""
        if self.dialect.asking_run:
            row = self.conn.execute(self.dialect.asking_run, (
                playbook, run_id, type_, name, version, input_text, input_sha, RunStatus.STARTED.value, 0, parent,
                None, now, by, playbook, limit)).fetchone()
            return bool(row[0]), bool(row[1])
        inserted = self.insert_run(playbook=playbook, run_id=run_id, type_=type_, name=name, version=version,
                                   input_text=input_text, input_sha=input_sha, parent=parent, now=now, by=by)
        return inserted, inserted and self.take_request_slot(playbook, limit)

    def run(self, playbook: str, run_id: str) -> Row | None:
        """A run's row."""
        return self.conn.execute("SELECT * FROM runs WHERE playbook = ? AND run_id = ?", (playbook, run_id)).fetchone()

    def take_request_slot(self, playbook: str, limit: int) -> bool:
        """Count one more open request in the playbook; False (nothing counted) when it has `limit` already."""
        return self.conn.execute("UPDATE playbooks SET open_requests = open_requests + 1"
                                 " WHERE id = ? AND open_requests < ?", (playbook, limit)).rowcount > 0

    def open_request(self, *, request_id: str, playbook: str, run_id: str, type_: str, name: str, version: int,
                     party: str, answerer: str, message: str, answer_schema: str | None, server: str | None,
                     tool: str | None, delivery: DeliveryState, asked_at: int, expires_at: int,
                     deliver_args: str | None, notified: bool = False, follow_up: str | None = None,
                     digest: str | None = None) -> None:
        """Insert a run's request: open, and the started run waits for it (guarded, else `conflict`); or,
        `notified`, a notification the inbox shows at once, which leaves the run as it is. `follow_up`
        is its plan of reminders, escalation and default answer (JSON), if it has one. `digest` binds
        what it shows (request_digest; of its message and answer schema when not given).

        The caller appends the event that records it next."""
        status = RequestStatus.NOTIFIED if notified else RequestStatus.OPEN
        if digest is None:
            digest = request_digest(message, loads(answer_schema) if answer_schema is not None else None)
        self.conn.execute(_INSERT_REQUEST_SQL, (
            request_id, playbook, run_id, type_, name, version, party, answerer, message, answer_schema,
            playbook, type_, name, version, server, tool,
            status.value, 0 if notified else 1, delivery.value, asked_at, expires_at, deliver_args, follow_up, digest))
        if not notified:
            self.guard(self.conn.execute(_RUN_WAITS_SQL, (playbook, run_id)),
                       Problem("conflict", "the run is not waiting to open a request"))

    def cancel_delivery(self, playbook: str, run_id: str) -> bool:
        """Mark the attempt in flight of a run's request as cancelling (guarded); False if none is in flight."""
        return self.conn.execute(_CANCEL_DELIVERY_SQL, (playbook, run_id)).rowcount > 0

    def close_request(self, fx: Effects, playbook: str, run_id: str, ending: Ending) -> Row | None:
        """Close the run's open request as `ending` closes it (guarded): the inbox drops it, the counter
        follows, its timers go. The closed row, or None when the run has no open request."""
        conn = self.conn                # UPDATE then SELECT: cheaper than UPDATE ... RETURNING * (bench/README.md)
        if not conn.execute(_CLOSE_REQUEST_SQL[ending.request], (ending.request.value, playbook, run_id)).rowcount:
            return None
        return self._closed(fx, playbook, run_id)

    def _closed(self, fx: Effects, playbook: str, run_id: str) -> Row:
        """After a request closed: the counter follows, its timers go; the closed row."""
        row = self.conn.execute(_REQUEST_ROW + " WHERE q.playbook = ? AND q.run_id = ?", (playbook, run_id)).fetchone()
        self._request_gone(fx, playbook, run_id)
        return row

    def _request_gone(self, fx: Effects, playbook: str, run_id: str, req: Row | None = None) -> None:
        """After a request closed: the counter follows, its timers go (with its row: only the kinds
        such a request may have, see _timer_kinds)."""
        conn = self.conn
        conn.execute("UPDATE playbooks SET open_requests = open_requests - 1 WHERE id = ?", (playbook,))
        kinds = _timer_kinds(req) if req is not None else _REQUEST_TIMERS
        keys = [timer_key(kind, playbook, run_id) for kind in kinds]
        conn.execute(_DROP_TIMERS_SQL[len(keys)], keys)     # one statement, not one a key
        fx.timers.extend((key, None) for key in keys)

    def answer_request(self, fx: Effects, req: Row, answer: Any, *, by: str, now: int,
                       claimed_for: str | None = None, reply_id: str | None = None,
                       reply_sender: str | None = None, by_name: str | None = None,
                       on_behalf_of: str | None = None) -> Row:
        """The one fact of an answer, as record_answer, close_request (answered) and end_run (succeeded)
        write it, in seven statements rather than ten: the run ends (guarded: live, else `conflict`)
        counting request_answered and run_succeeded at once; both are appended; the answer is written
        on the request as it closes (guarded: open and not being cancelled, else `not_open`); the
        counter follows and the timers go.

        The closed row: `req` (as read in this change) with what the answer wrote, not read back.
        `by_name` is who answered in words (answered_by_name), kept on the request and in request_answered;
        `on_behalf_of`, the person a deputy answered for."""
        playbook, run_id = req["playbook"], req["run_id"]
        reply = {"id": reply_id, **({"sender": reply_sender} if reply_sender is not None else {})}
        answer_id = self._end_run(fx, playbook, run_id, RunStatus.SUCCEEDED, now=now, by=by, output=answer,
                                  before=("request_answered", {"answer": answer, "claimed_for": claimed_for,
                                          **({"reply": reply} if reply_id is not None else {}),
                                          **({"answered_by_name": by_name} if by_name is not None else {}),
                                          **({"digest": req["digest"]} if req["digest"] is not None else {}),
                                          **({"on_behalf_of": on_behalf_of} if on_behalf_of is not None else {})}))
        text = dumps(answer)
        self.guard(self.conn.execute(_ANSWER_AND_CLOSE_SQL, (text, answer_id, by, now, claimed_for, reply_id,
                                                             reply_sender, by_name, on_behalf_of, req["seq"])),
                   Problem("not_open", "the request has ended; it takes no answer", kind="ended"))
        self._request_gone(fx, playbook, run_id, req)
        closed = dict(zip(req.keys(), req))      # dict(row) looks each name up along the row's columns
        closed.update(answer=text, answer_id=answer_id, answered_by=by, answered_at=now, claimed_for=claimed_for,
                      reply_id=reply_id, reply_sender=reply_sender, answered_by_name=by_name,
                      on_behalf_of=on_behalf_of, status=RequestStatus.ANSWERED.value, open=0)
        return closed

    def list_runs(self, playbook: str, *, status: str | None, function: str | None, before: int | None,
                  limit: int) -> list[Row]:
        """A page of a playbook's runs, newest first, before the cursor's `seq` (None: from the newest)."""
        return self.conn.execute(
            "SELECT * FROM runs WHERE playbook = ? AND (CAST(? AS TEXT) IS NULL OR status = ?)"
            " AND (CAST(? AS TEXT) IS NULL OR name = ?) AND (CAST(? AS BIGINT) IS NULL OR seq < ?)"
            " ORDER BY seq DESC LIMIT ?",
            (playbook, status, status, function, function, before, before, limit)).fetchall()

    def system_calls_in_flight(self) -> list[tuple[str, str, dict[str, Any] | None]]:
        """Runs of functions that ask a system whose call was sent and never ended (the daemon stopped):
        playbook, run id and the payload of the run's last tool_call_started event."""
        conn = self.conn
        out = []
        for run in conn.execute("SELECT playbook, run_id FROM runs WHERE status = ? AND tools_called = 1"
                                " AND type IN ('interaction', 'execute')", (RunStatus.STARTED.value,)).fetchall():
            started = conn.execute("SELECT payload FROM events WHERE playbook = ? AND run_id = ?"
                                   " AND type = ? ORDER BY id DESC LIMIT 1",
                                   (run["playbook"], run["run_id"], EventType.TOOL_CALL_STARTED.value)).fetchone()
            out.append((run["playbook"], run["run_id"], json.loads(started["payload"]) if started else None))
        return out

    def set_approval(self, playbook: str, run_id: str, approval: str) -> None:
        """Write the approval gate a run's request carries (JSON): the call proposed, as the request
        opens; then the arguments approved, in the transaction of the answer."""
        self.conn.execute("UPDATE requests SET approval = ? WHERE playbook = ? AND run_id = ?",
                          (approval, playbook, run_id))

    def resume_run(self, playbook: str, run_id: str) -> None:
        """A run waiting for its approval goes back to started, its call to follow (guarded, else `conflict`)."""
        if not self.conn.execute("UPDATE runs SET status = ? WHERE playbook = ? AND run_id = ? AND status = ?",
                                 (RunStatus.STARTED.value, playbook, run_id, RunStatus.WAITING.value)).rowcount:
            raise Problem("conflict", "the run is not waiting for an approval")

    def begin_call(self, playbook: str, run_id: str) -> bool:
        """Mark a started run's tool as called, once (guarded): False when the run has ended or called it."""
        return self.conn.execute("UPDATE runs SET tools_called = 1 WHERE playbook = ? AND run_id = ? AND status = ?"
                                 " AND tools_called = 0", (playbook, run_id, RunStatus.STARTED.value)).rowcount > 0

    def recount_open_requests(self) -> None:
        """Set every playbook's open-request counter (a cache of requests.open) from the requests."""
        self.conn.execute("UPDATE playbooks SET open_requests ="
                          " (SELECT COUNT(*) FROM requests r WHERE r.playbook = playbooks.id AND r.open = 1)")

    def open_request_counts(self) -> dict[str, int]:
        """Each playbook's open requests, as its counter keeps them (the metrics read it)."""
        return {r[0]: r[1] for r in self.conn.execute("SELECT id, open_requests FROM playbooks")}

    def all_timers(self) -> list[tuple[str, int]]:
        """Every due time the database holds (key, due_at)."""
        return [(r[0], r[1]) for r in self.conn.execute("SELECT key, due_at FROM timers")]

    def timers_due(self, after: int | None, until: int) -> list[tuple[str, int]]:
        """The due times of a window of the timer wheel: after `after` (None: any) and up to `until`."""
        return [(r[0], r[1]) for r in self.conn.execute(
            "SELECT key, due_at FROM timers WHERE due_at > ? AND due_at <= ?",
            (after if after is not None else -(2 ** 62), until))]

    # Requests, answers, deliveries and readings: the inbox and the chat tools.

    def open_requests(self, playbook: str, *, to: str | None, type_: str | None, name: str | None,
                      before: int | None, limit: int, also: Iterable[str] = ()) -> list[Row]:
        """A page of a playbook's open requests, newest first, before the cursor's `seq` (None: from the
        newest); only those to one party (its own, or escalated to it), of one type or of one function,
        where given."""
        sql = _REQUEST_ROW + " WHERE q.playbook = ? AND q.open = 1"
        args: list[Any] = [playbook]
        for col, val in (("type", type_), ("name", name)):
            if val is not None:
                sql += f" AND q.{col} = ?"
                args.append(val)
        if before is not None:
            sql += " AND q.seq < ?"
            args.append(before)
        if to is None:
            return self.conn.execute(sql + " ORDER BY q.seq DESC LIMIT ?", (*args, limit)).fetchall()
        # A party's own requests and those escalated to it: a range of each one's index, merged; with
        # `also` (the people a deputy stands for), theirs too.
        rows: list[Row] = []
        for who in dict.fromkeys((to, *also)):
            rows += self.conn.execute(sql + " AND q.party = ? ORDER BY q.seq DESC LIMIT ?", (*args, who, limit)).fetchall()
            rows += self.conn.execute(sql + " AND q.escalated_to = ? AND q.party <> ? ORDER BY q.seq DESC LIMIT ?",
                                      (*args, who, who, limit)).fetchall()
            rows += self.conn.execute(sql + " AND q.run_id IN (SELECT a.run_id FROM addressees a WHERE a.playbook = ?"
                                      " AND a.person = ?) ORDER BY q.seq DESC LIMIT ?",
                                      (*args, playbook, who, limit)).fetchall()
        rows = list({r["seq"]: r for r in rows}.values())
        return sorted(rows, key=lambda r: r["seq"], reverse=True)[:limit]

    def request(self, playbook: str, run_id: str) -> Row | None:
        """The request of a run, open or closed; None when the run asks nobody."""
        return self.conn.execute(_REQUEST_ROW + " WHERE q.playbook = ? AND q.run_id = ?", (playbook, run_id)).fetchone()

    def record_answer(self, fx: Effects, req: Row, answer: Any, *, by: str, now: int,
                      claimed_for: str | None = None, reply_id: str | None = None,
                      reply_sender: str | None = None, by_name: str | None = None,
                      on_behalf_of: str | None = None) -> None:
        """Append request_answered and write the answer on the request, guarded: only an open request that is
        not being cancelled takes one (else `not_open`). Its closing and its run's ending follow in the change.
        A reply's answer names the reply and who wrote it."""
        reply = {"id": reply_id, **({"sender": reply_sender} if reply_sender is not None else {})}
        answer_id = self.append_event(fx, req["playbook"], req["run_id"], "request_answered", now, by,
                                      {"answer": answer, "claimed_for": claimed_for,
                                       **({"reply": reply} if reply_id is not None else {}),
                                       **({"answered_by_name": by_name} if by_name is not None else {}),
                                       **({"digest": req["digest"]} if req["digest"] is not None else {}),
                                       **({"on_behalf_of": on_behalf_of} if on_behalf_of is not None else {})})
        if not self.conn.execute(_RECORD_ANSWER_SQL, (dumps(answer), answer_id, by, now, claimed_for, reply_id,
                                                      reply_sender, by_name, on_behalf_of, req["seq"])).rowcount:
            raise Problem("not_open", "the request has ended; it takes no answer", kind="ended")

    def record_default(self, fx: Effects, req: Row, answer: Any, *, now: int) -> None:
        """Append request_defaulted, carrying the fact of the default answer (answered by nobody), and write
        the answer on the request, guarded as an answer is (else `not_open`); its closing as expired and
        its run's ending follow in the change. The event's id is the fact's answer_id."""
        fact = {"run_id": req["run_id"], "answer": answer, "claimed_for": None, "answered_by": None,
                "answered_by_name": None, "answered_at": fmt_time(now), "defaulted": True}
        answer_id = self.append_event(fx, req["playbook"], req["run_id"], "request_defaulted", now, "interactiond",
                                      fact)
        if not self.conn.execute(_RECORD_ANSWER_SQL, (dumps(answer), answer_id, None, now, None, None, None, None,
                                                      None, req["seq"])).rowcount:
            raise Problem("not_open", "the request has ended; it takes no default answer", kind="ended")

    def remind_request(self, playbook: str, run_id: str, reminded: int) -> Row | None:
        """Count one more reminder of an open request that has had `reminded` (guarded: a request that closed,
        or a reminder counted meanwhile, moves nothing). The request as it now stands, or None."""
        return self.conn.execute(_REMIND_SQL, (playbook, run_id, reminded)).fetchone()

    def escalate_request(self, playbook: str, run_id: str, to: str) -> Row | None:
        """An open request not yet escalated asks `to` too (guarded). The request as it now stands, or None."""
        return self.conn.execute(_ESCALATE_SQL, (to, playbook, run_id)).fetchone()

    def queue_nudge(self, playbook: str, run_id: str, *, what: str, n: int, message: str) -> int:
        """A reminder or escalation message to send into a request's thread, its first attempt due; its id."""
        return self.conn.execute(
            "INSERT INTO nudges (playbook, run_id, what, n, message, state) VALUES (?, ?, ?, ?, ?, ?) RETURNING id",
            (playbook, run_id, what, n, message, DeliveryState.TO_DELIVER.value)).fetchone()[0]

    def nudge(self, nudge_id: int) -> Row | None:
        """A nudge as it stands, with what its sending reads of its request: the server, the function, the
        party, where the request's message was delivered, and whether the request is still open."""
        return self.conn.execute(
            "SELECT n.*, q.server, q.type, q.name, q.version, q.party, q.sent_conversation, q.sent_id,"
            " q.status AS request_status FROM nudges n JOIN requests q ON q.playbook = n.playbook"
            " AND q.run_id = n.run_id WHERE n.id = ?", (nudge_id,)).fetchone()

    def begin_nudge(self, nudge_id: int, *, now: int) -> Row | None:
        """Start a nudge's next attempt, guarded as a delivery's (DELIVERY_TRANSITIONS), with an attempt left
        and its request still open. The nudge as it now stands, or None."""
        return self.conn.execute(_BEGIN_NUDGE_SQL, (now, nudge_id, MAX_ATTEMPTS)).fetchone()

    def end_nudge(self, nudge_id: int, attempt: int, event: DeliveryEvent) -> bool:
        """Record how attempt `attempt` of a nudge ended: SUCCEED, FAIL (the next is scheduled) or SPEND (none is
        left), moving it as DELIVERY_TRANSITIONS says. Guarded: False when that attempt is no longer in flight."""
        state = next_state(DELIVERY_TRANSITIONS, DeliveryState.DELIVERING, event)
        return self.conn.execute(_END_NUDGE_SQL, (state.value, nudge_id, attempt)).rowcount > 0

    def idempotent_response(self, caller: str, key: str) -> Row | None:
        """What a caller's Idempotency-Key first came with (body_sha) and the response it got; None: a new key."""
        return self.conn.execute("SELECT body_sha, response FROM idempotency WHERE caller = ? AND key = ?",
                                 (caller, key)).fetchone()

    def remember_response(self, *, caller: str, key: str, body_sha: str, response: dict[str, Any],
                          now: int) -> None:
        """Keep the response a new answer got under the caller's Idempotency-Key, in the answer's change (which
        looked the key up first: one writer, so no other change can take it in between)."""
        self.conn.execute("INSERT INTO idempotency (caller, key, body_sha, status, response, created_at)"
                          " VALUES (?, ?, ?, 200, ?, ?)", (caller, key, body_sha, dumps(response), now))

    def run_events(self, playbook: str, run_id: str, *, after: int, limit: int) -> list[Row]:
        """A page of a run's events, oldest first, after the event id `after`."""
        return self.conn.execute("SELECT * FROM events WHERE playbook = ? AND run_id = ? AND id > ? ORDER BY id LIMIT ?",
                                 (playbook, run_id, after, limit)).fetchall()

    def playbook_events(self, playbook: str, *, type_: str | None, after: int, limit: int) -> list[Row]:
        """A page of the playbook's own events (of one type, where given), oldest first, after `after`."""
        return self.conn.execute(
            "SELECT * FROM events WHERE playbook = ? AND run_id IS NULL AND (CAST(? AS TEXT) IS NULL OR type = ?)"
            " AND id > ? ORDER BY id LIMIT ?", (playbook, type_, type_, after, limit)).fetchall()

    def event(self, playbook: str, event_id: int) -> Row | None:
        """One event of the playbook (its own or one of its runs')."""
        return self.conn.execute("SELECT * FROM events WHERE id = ? AND playbook = ?", (event_id, playbook)).fetchone()

    def begin_attempt(self, playbook: str, run_id: str, *, now: int) -> Row | None:
        """Start the next attempt of an open request's delivery, guarded: only a delivery an attempt may begin
        (DELIVERY_TRANSITIONS), with an attempt left. The request as it now stands, or None."""
        begun = self.conn.execute(_BEGIN_ATTEMPT_SQL, (now, playbook, run_id, MAX_ATTEMPTS)).fetchone()
        return self.request_by_seq(begun["seq"]) if begun is not None else None

    def request_by_seq(self, seq: int) -> Row | None:
        """A request by its `seq`, as it stands now (an attempt's end reads it again)."""
        return self.conn.execute(_REQUEST_ROW + " WHERE q.seq = ?", (seq,)).fetchone()

    def end_attempt(self, seq: int, attempt: int, state: DeliveryState, *, sent_conversation: str | None = None,
                    sent_id: str | None = None, conversation: str | None = None) -> bool:
        """Record how attempt `attempt` ended: DELIVERED (where it went, and the conversation whose replies are
        read) or UNDELIVERED (a bound refused its arguments: no attempt is left). Guarded: False when that
        attempt is no longer the one in flight."""
        if state is DeliveryState.DELIVERED:
            params: tuple[Any, ...] = (sent_conversation, sent_id, conversation, seq, attempt)
        else:
            params = (MAX_ATTEMPTS, seq, attempt)
        return self.conn.execute(_END_ATTEMPT_SQL[state], params).rowcount > 0

    def fail_attempt(self, seq: int, *, spent: bool) -> bool:
        """A failed attempt: retrying (the next is scheduled), or undelivered when `spent` (none is left).
        Guarded by the states a failure leaves: False when no attempt is in flight."""
        return self.conn.execute(_FAIL_ATTEMPT_SQL[DeliveryEvent.SPEND if spent else DeliveryEvent.FAIL],
                                 (seq,)).rowcount > 0

    def join_reading(self, seq: int, *, playbook: str, server: str, tool: str, conversation: str,
                     wait_ms: int) -> Row:
        """Join a delivered request to the reading of its conversation, made if new (a join restarts the
        reading's gaps and keeps the longest wait): the reading's id and wait_ms."""
        reading = self.conn.execute(
            "INSERT INTO readings (playbook, server, tool, conversation, wait_ms) VALUES (?,?,?,?,?)"
            " ON CONFLICT (playbook, server, tool, conversation) DO UPDATE SET reads = 0,"
            f" wait_ms = {self.dialect.greatest}(readings.wait_ms, excluded.wait_ms) RETURNING id, wait_ms",
            (playbook, server, tool, conversation, wait_ms)).fetchone()
        self.conn.execute("UPDATE requests SET reading = ? WHERE seq = ?", (reading["id"], seq))
        return reading

    def reading(self, reading_id: int) -> Row | None:
        """A reading: its server, tool, conversation key, `since`, reads and wait."""
        return self.conn.execute("SELECT * FROM readings WHERE id = ?", (reading_id,)).fetchone()

    def reading_requests(self, reading_id: int) -> list[Row]:
        """The open requests that joined a reading, oldest first."""
        return self.conn.execute(_REQUEST_ROW + " WHERE q.reading = ? AND q.open = 1 ORDER BY q.seq",
                                 (reading_id,)).fetchall()

    def sent_ids(self, reading_id: int) -> list[str]:
        """The ids of the messages the playbook sent into a reading's conversation: its own, never replies."""
        return [r[0] for r in self.conn.execute("SELECT sent_id FROM requests WHERE reading = ? AND sent_id IS NOT NULL",
                                                (reading_id,))]

    def count_read(self, reading_id: int) -> Row:
        """Count a read of the reading: its reads since a request last joined, and its wait_ms."""
        return self.conn.execute("UPDATE readings SET reads = reads + 1 WHERE id = ? RETURNING reads, wait_ms",
                                 (reading_id,)).fetchone()

    def reading_waited_on(self, reading_id: int) -> bool:
        """Whether an open request still waits on the reading's replies."""
        return self.conn.execute("SELECT 1 FROM requests WHERE reading = ? AND open = 1 LIMIT 1",
                                 (reading_id,)).fetchone() is not None

    def definition_source(self, playbook: str, type_: str, name: str, version: int) -> str | None:
        """The source of one version of a definition; None when there is none."""
        row = self.conn.execute("SELECT source FROM definitions WHERE playbook = ? AND type = ? AND name = ?"
                                " AND version = ?", (playbook, type_, name, version)).fetchone()
        return row["source"] if row is not None else None

    def see_reply(self, reading_id: int, reply_id: str) -> bool:
        """Note a message id as dealt with by the reading: True the first time, False ever after."""
        return self.conn.execute("INSERT INTO replies_seen (reading, reply_id) VALUES (?, ?)"
                                 " ON CONFLICT (reading, reply_id) DO NOTHING", (reading_id, reply_id)).rowcount > 0

    def read_up_to(self, reading_id: int, since: str) -> None:
        """Move the reading's `since` to the newest message id a read listed."""
        self.conn.execute("UPDATE readings SET since = ? WHERE id = ?", (since, reading_id))

    def count_refusal(self, seq: int) -> Row:
        """Count a reply refused on a request: its refused_replies and told, as they now stand."""
        return self.conn.execute("UPDATE requests SET refused_replies = refused_replies + 1 WHERE seq = ?"
                                 " RETURNING refused_replies, told", (seq,)).fetchone()

    def count_telling(self, seq: int) -> None:
        """Count a telling sent to a request's answerer about a refused reply."""
        self.conn.execute("UPDATE requests SET told = told + 1 WHERE seq = ?", (seq,))

    def interaction(self, interaction_id: str) -> Row | None:
        """The typed API's view of a request that takes an answer, by its id, with its run's input."""
        return self.conn.execute(_V2_SELECT + " AND q.id = ?", (interaction_id,)).fetchone()

    def interactions(self, playbooks: list[str], statuses: Iterable[str], *, run_id: str | None,
                     before: int | None, limit: int, party: str | None = None) -> list[Row]:
        """A page of the typed API's view of the playbooks' requests in `statuses` (of one run, and addressed
        to one party, where given), newest first, before the cursor's `seq` (None: from the newest)."""
        statuses = tuple(statuses)
        sql = (_V2_SELECT + f" AND q.playbook IN ({','.join('?' * len(playbooks))})"
               f" AND q.status IN ({','.join('?' * len(statuses))})")
        args: list[Any] = [*playbooks, *statuses]
        if run_id is not None:
            sql += " AND q.run_id = ?"
            args.append(run_id)
        if party is not None:
            sql += " AND q.party = ?"
            args.append(party)
        if before is not None:
            sql += " AND q.seq < ?"
            args.append(before)
        return self.conn.execute(sql + " ORDER BY q.seq DESC LIMIT ?", (*args, limit)).fetchall()

    def events_after(self, after: int, *, types: Iterable[str], playbooks: list[str], limit: int) -> list[Row]:
        """Up to `limit` events of the playbooks, of the given types, after the event id `after`, oldest first."""
        types = tuple(types)
        return self.conn.execute(
            f"SELECT id, playbook, run_id, type, at, payload FROM events WHERE id > ?"
            f" AND type IN ({','.join('?' * len(types))}) AND playbook IN ({','.join('?' * len(playbooks))})"
            " ORDER BY id LIMIT ?", (after, *types, *playbooks, limit)).fetchall()

    def request_shape(self, playbook: str, run_id: str) -> Row | None:
        """A run's request id and answer schema (None for a notification); None when the run asks nobody."""
        return self.conn.execute("SELECT q.id, COALESCE(q.own_schema, d.answer_schema) AS answer_schema FROM requests q"
                                 + _DEFINITION_JOIN + " WHERE q.playbook = ? AND q.run_id = ?", (playbook, run_id)).fetchone()

    def last_event_id(self) -> int:
        """The newest event's id; 0 before the first."""
        return self.conn.execute("SELECT COALESCE(MAX(id), 0) FROM events").fetchone()[0]

    # Workflows, tokens, sessions, idempotency and the typed API's listings.

    def workflows_calling(self, playbook: str, type_: str, name: str) -> list[Row]:
        """The active workflows of the playbook whose `uses` name this definition: name, version."""
        return self.conn.execute(
            "SELECT name, version FROM definitions d WHERE playbook = ? AND type = 'workflow' AND active = 1"
            f" AND {self.dialect.uses_pair} ORDER BY name", (playbook, type_, name)).fetchall()

    def defined_names(self, playbook: str) -> set[tuple[str, str]]:
        """The (type, name) of every active definition of the playbook."""
        return {(r["type"], r["name"]) for r in self.conn.execute(
            "SELECT DISTINCT type, name FROM definitions WHERE playbook = ? AND active = 1", (playbook,))}

    def run_depth(self, playbook: str, run_id: str) -> int:
        """How many runs stand in the chain of parents from this one up, itself included (64 at most)."""
        row = self.conn.execute(
            "WITH RECURSIVE up(id, n) AS (SELECT CAST(? AS TEXT), 1 UNION ALL SELECT r.parent, up.n + 1 FROM runs r JOIN up"
            " ON r.playbook = ? AND r.run_id = up.id WHERE r.parent IS NOT NULL AND up.n < 64) SELECT MAX(n) FROM up",
            (run_id, playbook)).fetchone()
        return row[0] or 1

    def request_expiry(self, playbook: str, run_id: str) -> int | None:
        """When the run's request expires; None when the run has no request."""
        row = self.conn.execute("SELECT expires_at FROM requests WHERE playbook = ? AND run_id = ?",
                                (playbook, run_id)).fetchone()
        return row["expires_at"] if row is not None else None

    def step_workflow(self, playbook: str, run_id: str, *, read: str, state: str, status: RunStatus,
                      live_child: str | None = None) -> bool:
        """Write a workflow's transition, guarded by the state it was computed from: the run is live and
        still holds `read`, and `live_child` (the child seen live) still is. False: it moved meanwhile."""
        sql = _STEP_WORKFLOW_SQL if live_child is None else _STEP_WORKFLOW_CHILD_SQL
        params: tuple[Any, ...] = (state, status.value, playbook, run_id, read)
        return self.conn.execute(sql, params if live_child is None else (*params, live_child)).fetchone() is not None

    def child_to_cancel(self, playbook: str, run_id: str) -> Row | None:
        """A workflow's child run that a cancel reaches: live, and a workflow or a run with a request
        (a system call in flight ends alone). None otherwise."""
        return self.conn.execute(
            f"SELECT * FROM runs r WHERE playbook = ? AND run_id = ? AND status IN ({_LIVE_SQL}) AND (type = 'workflow'"
            " OR EXISTS (SELECT 1 FROM requests q WHERE q.playbook = r.playbook AND q.run_id = r.run_id))",
            (playbook, run_id)).fetchone()

    def open_counts_by_party(self, playbook: str) -> list[Row]:
        """The playbook's open requests counted by party (`party`, `n`), in the order of the party."""
        return self.conn.execute(
            "SELECT party, COUNT(*) AS n FROM requests WHERE playbook = ? AND open = 1 GROUP BY party ORDER BY party",
            (playbook,)).fetchall()

    def insert_token(self, *, token_id: str, digest: str, playbook: str | None, role: str, name: str | None,
                     purpose: str, now: int, used_at: int | None, expires_at: int | None,
                     person: str | None = None) -> None:
        """A new token (api, login or session), by the hash of its secret; a person's names them."""
        self.conn.execute("INSERT INTO tokens (id, hash, playbook, role, name, purpose, created_at, used_at, expires_at,"
                          " person) VALUES (?,?,?,?,?,?,?,?,?,?)",
                          (token_id, digest, playbook, role, name, purpose, now, used_at, expires_at, person))

    def add_deputy(self, *, deputy_id: str, playbook: str, for_person: str, to_person: str,
                   starts_at: int | None, ends_at: int | None, now: int, by: str) -> None:
        """A deputy: `to_person` answers what is addressed to `for_person` while [starts_at, ends_at) holds."""
        self.conn.execute("INSERT INTO deputies (id, playbook, for_person, to_person, starts_at, ends_at, created_at,"
                          " created_by) VALUES (?,?,?,?,?,?,?,?)",
                          (deputy_id, playbook, for_person, to_person, starts_at, ends_at, now, by))

    def deputies(self, playbook: str | None) -> list[Row]:
        """The deputies of a playbook (None: of every playbook), oldest first."""
        return self.conn.execute("SELECT * FROM deputies WHERE CAST(? AS TEXT) IS NULL OR playbook = ?"
                                 " ORDER BY created_at, id", (playbook, playbook)).fetchall()

    def remove_deputy(self, playbook: str | None, deputy_id: str) -> Row | None:
        """Remove a deputy (of the playbook, where given); the removed row, or None when there was none."""
        return self.conn.execute("DELETE FROM deputies WHERE id = ? AND (CAST(? AS TEXT) IS NULL OR playbook = ?)"
                                 " RETURNING *", (deputy_id, playbook, playbook)).fetchone()

    def standing_for(self, playbook: str, person: str, now: int) -> list[str]:
        """Whom `person` stands for in the playbook at `now` (the deputies whose window is open), by name."""
        return [r[0] for r in self.conn.execute(
            "SELECT DISTINCT for_person FROM deputies WHERE playbook = ? AND to_person = ? AND for_person <> ?"
            " AND (starts_at IS NULL OR starts_at <= ?) AND (ends_at IS NULL OR ends_at > ?) ORDER BY for_person",
            (playbook, person, person, now, now)).fetchall()]

    def add_addressees(self, playbook: str, run_id: str, people: Iterable[str]) -> None:
        """A quorum approval's addressees besides its party, so listing by `to` finds it under each."""
        for person in people:           # a few: at most MAX_QUORUM
            self.conn.execute("INSERT INTO addressees (playbook, person, run_id) VALUES (?,?,?) ON CONFLICT DO NOTHING",
                              (playbook, person, run_id))

    def set_digest(self, playbook: str, run_id: str, digest: str) -> None:
        """What an open request shows changed (a quorum's first approval edited its arguments): its digest."""
        self.conn.execute(f"UPDATE requests SET digest = ? WHERE playbook = ? AND run_id = ? AND {_OPEN_REQUEST_SQL}",
                          (digest, playbook, run_id))

    def token_known(self, digest: str) -> bool:
        """Whether a token of any purpose with this hash stands unrevoked."""
        return self.conn.execute("SELECT 1 FROM tokens WHERE hash = ? AND revoked_at IS NULL",
                                 (digest,)).fetchone() is not None

    def caller_token(self, digest: str) -> Row | None:
        """The unrevoked api or session token with this hash: id, role, playbook, purpose, used_at, expires_at,
        person."""
        return self.conn.execute("SELECT id, role, playbook, purpose, used_at, expires_at, person FROM tokens"
                                 " WHERE hash = ? AND revoked_at IS NULL AND purpose != 'login'", (digest,)).fetchone()

    def touch_session(self, token_id: str, now: int) -> bool:
        """Record a session's use at `now`, unless a later use is recorded already."""
        return self.conn.execute("UPDATE tokens SET used_at = ? WHERE id = ? AND (used_at IS NULL OR used_at < ?)",
                                 (now, token_id, now)).rowcount > 0

    def spend_login(self, digest: str, now: int) -> Row | None:
        """Revoke an unspent login link that has not expired: its role, playbook and person, or None when it
        is spent, expired or unknown."""
        return self.conn.execute("UPDATE tokens SET revoked_at = ? WHERE hash = ? AND purpose = 'login'"
                                 " AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > ?)"
                                 " RETURNING role, playbook, person", (now, digest, now)).fetchone()

    def revoke_logins(self, now: int, name: str = START_LOGIN_NAME) -> int:
        """Revoke every unspent login link of this name (the ones a start printed); how many."""
        return self.conn.execute("UPDATE tokens SET revoked_at = ? WHERE purpose = 'login' AND revoked_at IS NULL"
                                 " AND name = ?", (now, name)).rowcount

    def end_session(self, digest: str, now: int) -> bool:
        """Revoke the live session with this hash; False when there is none."""
        return self.conn.execute("UPDATE tokens SET revoked_at = ? WHERE hash = ? AND purpose = 'session'"
                                 " AND revoked_at IS NULL", (now, digest)).rowcount > 0

    def revoke_token(self, token_id: str, now: int) -> bool:
        """Revoke a token by id; False when there is no unrevoked token of that id."""
        return self.conn.execute("UPDATE tokens SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                                 (now, token_id)).rowcount > 0

    def listed_tokens(self) -> list[Row]:
        """API tokens and inbox sessions, oldest first (login links are not listed)."""
        return self.conn.execute("SELECT id, role, playbook, name, purpose, created_at, revoked_at, used_at,"
                                 " expires_at, person FROM tokens WHERE purpose IN ('api', 'session') ORDER BY created_at"
                                 ).fetchall()

    def token_name(self, token_id: str) -> str | None:
        """The name a token was given (for a page that says who answered); None when it has none."""
        row = self.conn.execute("SELECT name FROM tokens WHERE id = ?", (token_id,)).fetchone()
        return row["name"] if row is not None else None

    def daemon_key(self, name: str, candidate: str, now: int) -> str:
        """The daemon's key of this name: the one kept, or `candidate` kept now when there is none (so
        every daemon of a database, and every start, signs with the same key)."""
        self.conn.execute("INSERT INTO daemon_keys (name, secret, created_at) VALUES (?, ?, ?)"
                          " ON CONFLICT (name) DO NOTHING", (name, candidate, now))
        return self.conn.execute("SELECT secret FROM daemon_keys WHERE name = ?", (name,)).fetchone()["secret"]

    def linked_request(self, request_id: str) -> Row | None:
        """A request by its id, open or ended, with its run's input (what an answer link shows)."""
        return self.conn.execute("SELECT q.*, COALESCE(q.own_schema, d.answer_schema) AS answer_schema,"
                                 " r.input AS run_input FROM requests q JOIN runs r ON r.playbook = q.playbook"
                                 " AND r.run_id = q.run_id" + _DEFINITION_JOIN + " WHERE q.id = ?",
                                 (request_id,)).fetchone()

    # A whole database copied into another (`interactiond copy`): COPIED_TABLES, read in one snapshot
    # (each backend's begin_snapshot, table_rows) and written in one transaction, in batches.

    def end(self, commit: bool = True) -> None:
        """Commit (or roll back) the transaction `begin` or `begin_snapshot` opened."""
        if commit:
            self.commit()
        else:
            self.rollback()

    def count_rows(self, table: str) -> int:
        return self.conn.execute(f"SELECT COUNT(*) FROM {_copied(table)}").fetchone()[0]


class SQLiteTx(SqlTx):
    """The store's operations on an SQLite file (SqlTx's), with the file's transactions: BEGIN
    IMMEDIATE for a group commit, a SAVEPOINT for each change."""

    __slots__ = ("busy_ms", "waits")

    dialect = SQLITE_DIALECT
    errors = (sqlite3.Error,)

    def __init__(self, conn: sqlite3.Connection) -> None:
        super().__init__(conn)
        self.busy_ms: int | None = None     # the connection's busy timeout, once begin_at_once took it off
        self.waits = True                   # whether a lock held elsewhere is waited for (busy_ms)

    def begin(self) -> None:
        """Open the group commit's transaction, holding the write lock from its start (waiting the
        connection's busy timeout for it when another connection holds it)."""
        if not self.waits:
            self.conn.execute(f"PRAGMA busy_timeout = {self.busy_ms}")
            self.waits = True
        self.conn.execute("BEGIN IMMEDIATE")

    def begin_at_once(self) -> bool:
        """begin, without waiting: False, no transaction, when another connection holds the write lock.
        The busy timeout stays off until a `begin` waits again (one statement fewer each time)."""
        conn = self.conn
        if self.waits:
            if self.busy_ms is None:
                self.busy_ms = conn.execute("PRAGMA busy_timeout").fetchone()[0]
            conn.execute("PRAGMA busy_timeout = 0")
            self.waits = False
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorname", "").startswith("SQLITE_BUSY"):
                return False
            raise
        return True

    def commit(self) -> None:
        self.conn.execute("COMMIT")

    def rollback(self) -> None:
        self.conn.execute("ROLLBACK")

    def ready(self) -> None:
        """Before a reading: nothing to do on a file (a server's connection may need opening again)."""

    def in_transaction(self) -> bool:
        """Whether the transaction still stands after an error (a full disk rolls it all back)."""
        return self.conn.in_transaction

    def run_change(self, change: Callable[..., Any], fx: Effects) -> Any:
        """`change(self, fx)` in a savepoint: what it wrote is undone when it raises (if the transaction
        still stands), and the error goes on."""
        conn = self.conn
        conn.execute("SAVEPOINT change")
        try:
            result = change(self, fx)
        except BaseException:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK TO change")
                    conn.execute("RELEASE change")
            raise
        conn.execute("RELEASE change")
        return result

    def _insert_event(self, playbook: str, run_id: str | None, run_seq: int | None, values: tuple[Any, ...]) -> int:
        conn = self.conn
        if run_id is not None and run_seq is None:
            counted = conn.execute("UPDATE runs SET events = events + 1 WHERE playbook = ? AND run_id = ?"
                                   " RETURNING events", (playbook, run_id)).fetchone()
            if counted is None:
                raise Problem("not_found", f"no run {run_id} in this playbook")
            run_seq = counted[0]
        return conn.execute("INSERT INTO events (playbook, run_id, run_seq, type, at, by, payload, size)"
                            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (playbook, run_id, run_seq) + values).lastrowid

    def before_commit(self, changes: list[Effects]) -> None:
        """Last in the transaction, with the effects of the changes it commits: nothing to tell others
        on a file (a server's daemons are told here)."""

    @staticmethod
    def problem(exc: BaseException, otherwise: str | None = None) -> BaseException:
        """A driver's error as the problem a caller gets (see _db_problem)."""
        return _db_problem(exc, otherwise)

    # Work one daemon holds while it does it: a file has one daemon (the lock beside it), so these
    # hold nothing here; PostgresTx keeps them in its `leases` table for several daemons.

    def release_lease(self, key: str) -> bool:
        """Give the work of a timer's key back; whether another daemon asked for it meanwhile: never on a file."""
        return False

    def attempt_elsewhere(self, playbook: str, run_id: str) -> bool:
        """Whether the attempt in flight of a run's request is another live daemon's: never on a file."""
        return False

    def take_over(self, fx: Effects, now: int) -> None:
        """Take over what daemons that are gone held (PostgresTx): none on a file."""

    # A whole database copied (see SqlTx).

    def begin_snapshot(self) -> None:
        """A read transaction: every table read until `end` shows the database at one moment."""
        self.conn.execute("BEGIN")

    def holds_data(self) -> bool:
        """Whether the database has interactiond's tables (so it is one, of some version)."""
        return self.conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'runs'").fetchone() is not None

    def table_columns(self, table: str) -> list[str]:
        """A copied table's columns, in their order."""
        return [r["name"] for r in self.conn.execute(f"PRAGMA table_info({_copied(table)})")]

    def table_rows(self, table: str, columns: list[str], batch: int) -> Iterable[list[tuple[Any, ...]]]:
        """A copied table's rows (the values of `columns`), `batch` at a time, without holding them all."""
        cur = self.conn.execute(f"SELECT {', '.join(_copied_column(c) for c in columns)} FROM {_copied(table)}")
        while rows := cur.fetchmany(batch):
            yield [tuple(r) for r in rows]

    def insert_rows(self, table: str, columns: list[str], rows: list[tuple[Any, ...]]) -> None:
        self.conn.executemany(f"INSERT INTO {_copied(table)} ({', '.join(_copied_column(c) for c in columns)})"
                              f" VALUES ({', '.join('?' * len(columns))})", rows)

    def after_copy(self) -> None:
        """What a copy leaves to put right: nothing on a file (AUTOINCREMENT follows the ids inserted)."""


#: What `interactiond copy` moves, in an order that respects the references between tables; the
#: daemons, leases and clock of a PostgreSQL database stay behind (they are its daemons').
COPIED_TABLES: Final = ("playbooks", "definitions", "runs", "readings", "requests", "replies_seen", "events",
                        "timers", "tokens", "idempotency", "nudges", "daemon_keys", "deputies",
                        "addressees")
#: Columns one backend has and the other has not, which a copy leaves behind.
COPY_DROPPABLE: Final = {("events", "daemon")}


def _copied(table: str) -> str:
    """A table name for the copy's statements: only one of COPIED_TABLES."""
    if table not in COPIED_TABLES:
        raise ValueError(f"{table} is not a table a copy moves")
    return table


def _copied_column(name: str) -> str:
    """A column name as a statement names it (quoted: `by` and `key` are words of SQL)."""
    if not re.fullmatch(r"[a-z_]+", name):
        raise ValueError(f"{name!r} is not a column a copy moves")
    return f'"{name}"'


#: The live run states, as SQL's IN list (the statuses a run ends from).
_LIVE_SQL: Final = ", ".join(f"'{s.value}'" for s in LIVE_RUN_STATUSES)

#: Closing a request, by the status it closes with: guarded by the statuses it may leave (REQUEST_TRANSITIONS).
_CLOSE_REQUEST_SQL: Final = {
    to: "UPDATE requests SET status = ?, open = 0 WHERE playbook = ? AND run_id = ? AND status IN ("
        + ", ".join(f"'{s.value}'" for s in allowed_from(REQUEST_TRANSITIONS, to)) + ")"
    for to in RequestStatus if allowed_from(REQUEST_TRANSITIONS, to)}

#: Cancelling the attempt in flight: guarded by the deliveries a cancel may move (DELIVERY_TRANSITIONS).
_CANCEL_DELIVERY_SQL: Final = (
    f"UPDATE requests SET delivery_state = '{DeliveryState.CANCELLING.value}' WHERE playbook = ? AND run_id = ?"
    " AND delivery_state IN (" + ", ".join(f"'{s.value}'" for s in allowed_from(DELIVERY_TRANSITIONS, DeliveryEvent.CANCEL))
    + ")")

#: A workflow's transition, guarded by the state it read (SqlTx.step_workflow); the second form
#: also wants the child it saw live still live.
_STEP_WORKFLOW_SQL: Final = (
    "UPDATE runs SET state = ?, status = ? WHERE playbook = ? AND run_id = ?"
    f" AND status IN ({_LIVE_SQL}) AND state = ? RETURNING run_id")
_STEP_WORKFLOW_CHILD_SQL: Final = _STEP_WORKFLOW_SQL.replace(
    " RETURNING", f" AND EXISTS (SELECT 1 FROM runs c WHERE c.playbook = runs.playbook AND c.run_id = ?"
    f" AND c.status IN ({_LIVE_SQL})) RETURNING")


#: The states an attempt is in flight in: delivering, or cancelling (cancel asked meanwhile; the attempt
#: finishes first). Its end leaves either, as SQL's IN list.
_IN_FLIGHT_SQL: Final = ", ".join(f"'{s.value}'" for s in (
    *allowed_from(DELIVERY_TRANSITIONS, DeliveryEvent.SUCCEED),
    *(DELIVERY_TRANSITIONS[s][DeliveryEvent.CANCEL] for s in allowed_from(DELIVERY_TRANSITIONS, DeliveryEvent.CANCEL))))

#: An answer: guarded by the statuses an answer closes (REQUEST_TRANSITIONS), and not while cancelling.
_RECORD_ANSWER_SQL: Final = (
    "UPDATE requests SET answer = ?, answer_id = ?, answered_by = ?, answered_at = ?, claimed_for = ?, reply_id = ?,"
    " reply_sender = ?, answered_by_name = ?, on_behalf_of = ? WHERE seq = ? AND status IN (" + ", ".join(f"'{s.value}'" for s in allowed_from(REQUEST_TRANSITIONS, RequestStatus.ANSWERED))
    + f") AND delivery_state <> '{DeliveryState.CANCELLING.value}'")

#: An answer that closes its request (answer_request): _RECORD_ANSWER_SQL's guard, and the closing's.
_ANSWER_AND_CLOSE_SQL: Final = _RECORD_ANSWER_SQL.replace(
    " WHERE seq = ?", f", status = '{RequestStatus.ANSWERED.value}', open = 0 WHERE seq = ?")

#: A request inserted; its answer schema only where the function version's is not it (see _REQUEST_ROW).
_INSERT_REQUEST_SQL: Final = (
    "INSERT INTO requests (id, playbook, run_id, type, name, version, party, answerer, message, own_schema,"
    " server, tool, status, open, delivery_state, asked_at, expires_at, deliver_args, follow_up, digest)"
    " VALUES (?,?,?,?,?,?,?,?,?,NULLIF(?, (SELECT answer_schema FROM definitions WHERE playbook = ? AND type = ?"
    " AND name = ? AND version = ?)),?,?,?,?,?,?,?,?,?,?)")

#: A run inserted, started (ON CONFLICT: nothing, when its run id is taken).
_INSERT_RUN_SQL: Final = (
    "INSERT INTO runs (playbook, run_id, type, name, version, input, input_sha, status, tools_called,"
    " parent, state, created_at, created_by) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (playbook, run_id) DO NOTHING")

#: A run ends (guarded: only a live one), counting its ending event (and one just before it, with `before`).
_END_RUN_SQL: Final = (
    "UPDATE runs SET status = ?, kind = ?, output = ?, problem = ?, ended_at = ?, settled_by = ?,"
    f" events = events + ? WHERE playbook = ? AND run_id = ? AND status IN ({_LIVE_SQL}) RETURNING parent, events")

#: A started run waits for the request it opened (guarded).
_RUN_WAITS_SQL: Final = (
    f"UPDATE runs SET status = '{RunStatus.WAITING.value}' WHERE playbook = ? AND run_id = ?"
    f" AND status = '{RunStatus.STARTED.value}'")

#: An attempt begins: guarded by the deliveries that may begin one (DELIVERY_TRANSITIONS) and the attempts left.
_BEGIN_ATTEMPT_SQL: Final = (
    f"UPDATE requests SET delivery_state = '{DeliveryState.DELIVERING.value}', attempts = attempts + 1,"
    " attempt_started_at = ? WHERE playbook = ? AND run_id = ? AND open = 1 AND delivery_state IN ("
    + ", ".join(f"'{s.value}'" for s in allowed_from(DELIVERY_TRANSITIONS, DeliveryEvent.BEGIN)) + ") AND attempts < ?"
    " RETURNING seq")

#: An attempt ends, delivered or refused: guarded by the attempt in flight (its number and state).
_END_ATTEMPT_SQL: Final = {
    DeliveryState.DELIVERED: f"UPDATE requests SET delivery_state = '{DeliveryState.DELIVERED.value}',"
                             " sent_conversation = ?, sent_id = ?, conversation = ?"
                             f" WHERE seq = ? AND attempts = ? AND delivery_state IN ({_IN_FLIGHT_SQL})",
    DeliveryState.UNDELIVERED: f"UPDATE requests SET delivery_state = '{DeliveryState.UNDELIVERED.value}', attempts = ?"
                               f" WHERE seq = ? AND attempts = ? AND delivery_state IN ({_IN_FLIGHT_SQL})",
}

#: A failed attempt: retrying (FAIL) or undelivered (SPEND), guarded by the states each leaves.
_FAIL_ATTEMPT_SQL: Final = {
    event: f"UPDATE requests SET delivery_state = '{next_state(DELIVERY_TRANSITIONS, DeliveryState.DELIVERING, event).value}'"
           " WHERE seq = ? AND delivery_state IN ("
           + ", ".join(f"'{s.value}'" for s in allowed_from(DELIVERY_TRANSITIONS, event)) + ")"
    for event in (DeliveryEvent.FAIL, DeliveryEvent.SPEND)}

#: A reminder counted, or an escalation: guarded by the request being open (and by what it had).
_OPEN_REQUEST_SQL: Final = f"status = '{RequestStatus.OPEN.value}'"
_REMIND_SQL: Final = ("UPDATE requests SET reminded = reminded + 1 WHERE playbook = ? AND run_id = ?"
                      f" AND {_OPEN_REQUEST_SQL} AND reminded = ? RETURNING *")
_ESCALATE_SQL: Final = ("UPDATE requests SET escalated_to = ? WHERE playbook = ? AND run_id = ?"
                        f" AND {_OPEN_REQUEST_SQL} AND escalated_to IS NULL RETURNING *")

#: A nudge's attempt begins as a delivery's does (DELIVERY_TRANSITIONS), while its request is open; it
#: ends guarded by the attempt in flight.
_BEGIN_NUDGE_SQL: Final = (
    f"UPDATE nudges SET state = '{DeliveryState.DELIVERING.value}', attempts = attempts + 1, started_at = ?"
    " WHERE id = ? AND state IN (" + ", ".join(f"'{s.value}'" for s in allowed_from(DELIVERY_TRANSITIONS, DeliveryEvent.BEGIN))
    + ") AND attempts < ? AND EXISTS (SELECT 1 FROM requests q WHERE q.playbook = nudges.playbook"
    f" AND q.run_id = nudges.run_id AND q.{_OPEN_REQUEST_SQL}) RETURNING *")
_END_NUDGE_SQL: Final = (
    "UPDATE nudges SET state = ? WHERE id = ? AND attempts = ? AND state IN ("
    + ", ".join(f"'{s.value}'" for s in allowed_from(DELIVERY_TRANSITIONS, DeliveryEvent.SUCCEED)) + ")")

#: A request's definition, for the answer schema its version's requests share.
_DEFINITION_JOIN: Final = (" LEFT JOIN definitions d ON d.playbook = q.playbook AND d.type = q.type AND d.name = q.name"
                           " AND d.version = q.version")

#: A request's row as every reading of one gives it: its columns, and `answer_schema`, its own where it
#: has one, else its function version's (NULL for a notification). A function's answer schema is kept
#: once, on its definition, not once per request.
_REQUEST_ROW: Final = ("SELECT q.*, COALESCE(q.own_schema, d.answer_schema) AS answer_schema FROM requests q"
                       + _DEFINITION_JOIN)

#: The typed API's view of a request that takes an answer, joined with its run's input (interaction_object).
_V2_SELECT: Final = (
    "SELECT q.seq, q.id, q.playbook, q.run_id, q.name, q.status, q.delivery_state, q.message,"
    " COALESCE(q.own_schema, d.answer_schema) AS answer_schema, q.answer, q.answered_at, q.asked_at, q.expires_at,"
    " q.party, q.reminded, q.escalated_to, q.digest, r.input AS run_input FROM requests q JOIN runs r ON r.playbook = q.playbook AND r.run_id = q.run_id"
    + _DEFINITION_JOIN + " WHERE COALESCE(q.own_schema, d.answer_schema) IS NOT NULL")


def timer_key(kind: str, playbook: str, ref: str) -> str:
    return f"{kind}:{playbook}:{ref}"


#: The timers a request may have, by its run's key; a closed request's go with it.
_REQUEST_TIMERS: Final = ("expire", "attempt", "lost", "remind", "escalate")
_DROP_TIMERS_SQL: Final = {n: "DELETE FROM timers WHERE key " + ("= ?" if n == 1 else f"IN ({', '.join('?' * n)})")
                           for n in range(1, len(_REQUEST_TIMERS) + 1)}


def _timer_kinds(req: Row) -> tuple[str, ...]:
    """The timers a request's row says it may have: its expiry always; a delivery's attempts (and
    their loss) only when it is delivered through a tool (`server`); reminders and an escalation
    only with a plan of them (`follow_up`). Fewer keys: a statement without an IN list, which
    SQLite keeps in a table of its own for each run, and fewer due times for the wheel to drop."""
    return ("expire",) + (("attempt", "lost") if req["server"] is not None else ()) + \
        (("remind", "escalate") if req["follow_up"] is not None else ())


# PostgreSQL #####################################################################################
#
# The same store on a database server: `--db postgresql://...`, `database:` in the configuration,
# or INTERACTIOND_DB. The driver, psycopg 3, comes with `pip install 'interactiond[postgres]'` and
# is imported only when such a URL is used, so the default install and its start-up stay as they
# are. There is one set of SQL, SqlTx's, shared by SQLiteTx and PostgresTx: what differs between
# the two is said by each one's Dialect (POSTGRES_DIALECT: `?` placeholders as psycopg's `%s`, once
# per statement text). The threads are Store's: one writer with group commit (BEGIN, the changes
# each in a savepoint, one COMMIT, all in psycopg's pipeline mode) and one reader, each on its own
# connection. A lost connection answers its changes `unavailable` and is opened again at the next
# transaction.
#
# Several daemons may share the database; each store is one of them. A third connection enters
# the daemon in the `daemons` table, beats, and LISTENs: every write transaction NOTIFYs what its
# changes mean for the others (PostgresTx.before_commit), and their PgBus delivers it as their own
# effects. The writes of every daemon commit one after another (an advisory lock taken at BEGIN),
# so what a change reads and guards holds as under SQLite's one writer.

#: The first schema version made on PostgreSQL: the migrations below it are SQLite's only.
POSTGRES_FIRST_VERSION: Final = 2

#: Each step takes a database made by an earlier version to the next schema_version, in order;
#: a migration of SQLite's past POSTGRES_FIRST_VERSION has its PostgreSQL step here (tested).
def _pg_migrate_to_3(conn: Any) -> None:
    """As _migrate_to_3: a request may carry an approval gate."""
    conn.execute("ALTER TABLE requests ADD COLUMN IF NOT EXISTS approval TEXT")


def _pg_migrate_to_4(conn: Any) -> None:
    """People (see _migrate_to_4): tokens gain `person`."""
    conn.execute("ALTER TABLE tokens ADD COLUMN IF NOT EXISTS person TEXT")


def _pg_migrate_to_5(conn: Any) -> None:
    """As _migrate_to_5, in PostgreSQL's dialect."""
    for name, decl in _FOLLOW_UP_COLUMNS:
        conn.execute(f"ALTER TABLE requests ADD COLUMN IF NOT EXISTS {name} "
                     + ('TEXT COLLATE "C"' if name == "escalated_to" else decl))


def _pg_migrate_to_6(conn: Any) -> None:
    """Version 6 (see _migrate_to_6): answer schemas kept once per function version; PostgreSQL's
    timers have no rowid to drop."""
    conn.execute("ALTER TABLE definitions ADD COLUMN answer_schema TEXT")
    _share_answer_schemas(conn)


POSTGRES_MIGRATIONS: Final[tuple[tuple[int, Callable[[Any], None]], ...]] = (
    (3, _pg_migrate_to_3),
    (4, _pg_migrate_to_4),
    (5, _pg_migrate_to_5),
    (6, _pg_migrate_to_6),
    (7, _migrate_to_7),
    (10, _migrate_to_10),
)

#: Keys of the transaction-level advisory locks (pg_advisory_xact_lock): writes, and the schema.
_PG_WRITE_LOCK: Final = 0x69_74_64_77          # "itdw"
_PG_LOCK_SQL: Final = f"SELECT pg_advisory_xact_lock({_PG_WRITE_LOCK})"
_PG_SCHEMA_LOCK: Final = 0x69_74_64_73         # "itds"
#: How long a write waits for another daemon's transaction before it answers `unavailable`
#: (SQLite's busy timeout).
PG_LOCK_TIMEOUT_MS: Final = 5000
#: A connection attempt gives up after this many seconds (unless the URL says otherwise).
PG_CONNECT_TIMEOUT_S: Final = 10
#: Each daemon on a database beats this often (daemons.seen_at) ...
DAEMON_BEAT_S: Final = 5.0
#: A daemon refreshes the tables' statistics (PgDaemons.refresh_statistics) after its writer has
#: committed this many changes, and again each time it has committed this factor more.
PG_ANALYZE_FIRST: Final = 256
PG_ANALYZE_GROWTH: Final = 8
#: ... and is dead once unseen this long: a live daemon's heartbeat (or a start) takes its work
#: over - its calls in flight end, its attempts in flight count as lost, its leases are dropped.
#: The work a daemon holds (leases) is renewed by its heartbeat to this long ahead.
DAEMON_LEASE_S: Final = 30.0
#: The channel of the daemons' notifications (LISTEN/NOTIFY), and the most one carries (the
#: server's limit is 8000 bytes; larger effects go in several).
PG_CHANNEL: Final = "interactiond"
PG_NOTIFY_BYTES: Final = 7000
#: Milliseconds since the epoch on the database server's clock: one clock for every daemon's lease.
_PG_NOW_SQL: Final = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)"


def _lease_ms() -> int:
    """A daemon's lease, and the lease of the work it holds, in milliseconds."""
    return int(DAEMON_LEASE_S * 1000)


#: The schema, embedded so an installed wheel needs no data file; tests keep it equal to
#: schema-postgres.sql.
POSTGRES_SCHEMA_SQL: Final = """\
-- interactiond's schema in PostgreSQL's dialect: the tables, columns and checks of schema.sql, in
-- the order their references need, and what several daemons sharing the database keep (daemons,
-- events.daemon, the manual clock). Applied at every start (idempotent) under an advisory lock;
-- the schema_version table tells which migrations a database has had. Times are integer
-- milliseconds since the epoch (UTC), BIGINT; JSON columns hold compact JSON text, as in SQLite.
-- Text a listing sorts by is COLLATE "C": the same order as SQLite's, whatever the database's
-- locale. Every state change is one transaction that updates its rows and appends its events
-- together.

CREATE TABLE IF NOT EXISTS schema_version (
    one     BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (one),   -- a single row
    version INTEGER NOT NULL
);

CREATE TABLE IF NOT EXISTS playbooks (
    id            TEXT PRIMARY KEY,                  -- ORG/NAME
    open_requests INTEGER NOT NULL DEFAULT 0,        -- kept in step with requests.open
    created_at    BIGINT NOT NULL
);

-- One row per version; `active` is cleared on every version of a name when it is deleted.
CREATE TABLE IF NOT EXISTS definitions (
    playbook   TEXT NOT NULL REFERENCES playbooks(id),
    type       TEXT COLLATE "C" NOT NULL CHECK (type IN ('interaction', 'workflow')),
    name       TEXT COLLATE "C" NOT NULL,
    version    INTEGER NOT NULL,
    source     TEXT NOT NULL,
    source_sha TEXT NOT NULL,
    overview   TEXT NOT NULL,
    description TEXT,
    uses       TEXT NOT NULL DEFAULT '[]',           -- JSON: [[type, name], ...] a workflow calls
    answer_schema TEXT,                              -- JSON: the answer schema its requests share
    active     INTEGER NOT NULL DEFAULT 1,
    created_at BIGINT NOT NULL,
    created_by TEXT NOT NULL,
    PRIMARY KEY (playbook, type, name, version)
);

CREATE TABLE IF NOT EXISTS runs (
    seq          BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,   -- listing order and cursors
    playbook     TEXT NOT NULL REFERENCES playbooks(id),
    run_id       TEXT NOT NULL,
    type         TEXT NOT NULL,
    name         TEXT NOT NULL,
    version      INTEGER NOT NULL,
    input        TEXT NOT NULL,
    input_sha    TEXT NOT NULL,
    status       TEXT NOT NULL CHECK (status IN (
                     'started',                      -- accepted, nothing open yet
                     'waiting',                      -- started -> waiting: a request is open
                     'succeeded',                    -- -> answered, delivered, or the tool answered
                     'invalid_input', 'conflict', 'unavailable',
                     'rejected',                     -- -> expired, undelivered, cancelled
                     'failed')),
    kind         TEXT,
    output       TEXT,
    problem      TEXT,
    tools_called INTEGER NOT NULL DEFAULT 0,         -- a tool call was sent under this run id
    events       INTEGER NOT NULL DEFAULT 0,         -- per-run event counter (gap-free run_seq)
    parent       TEXT,                               -- the workflow run that started it
    state        TEXT,                               -- a workflow's position and data
    created_at   BIGINT NOT NULL,
    ended_at     BIGINT,
    created_by   TEXT NOT NULL,
    settled_by   TEXT,
    UNIQUE (playbook, run_id)
);
CREATE INDEX IF NOT EXISTS runs_by_status ON runs (playbook, status, seq);

-- One reading per (playbook, server, reading tool, conversation key), shared by every open
-- request with that key: one read serves them all.
CREATE TABLE IF NOT EXISTS readings (
    id           BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    playbook     TEXT NOT NULL,
    server       TEXT NOT NULL,
    tool         TEXT NOT NULL,
    conversation TEXT NOT NULL,
    since        TEXT NOT NULL DEFAULT '',           -- the newest message id a read listed
    reads        INTEGER NOT NULL DEFAULT 0,         -- reads since a request last joined
    wait_ms      BIGINT NOT NULL DEFAULT 5000,
    UNIQUE (playbook, server, tool, conversation)
);

-- The open question of a run that asks a person; one per run.
CREATE TABLE IF NOT EXISTS requests (
    seq            BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,  -- newest first in the inbox
    id             TEXT NOT NULL UNIQUE,             -- int_<ULID>, the typed API's id
    playbook       TEXT NOT NULL,
    run_id         TEXT NOT NULL,
    type           TEXT NOT NULL,
    name           TEXT NOT NULL,
    version        INTEGER NOT NULL,
    party          TEXT COLLATE "C" NOT NULL,        -- rendered `to`
    answerer       TEXT NOT NULL,                    -- rendered `from`, else `to`
    message        TEXT NOT NULL,
    own_schema     TEXT,                             -- its answer schema where its definition's is not it;
                                                     -- NULL: the definition's (NULL too: a notification)
    server         TEXT,                             -- deliver.server, NULL for the inbox
    tool           TEXT,
    status         TEXT NOT NULL CHECK (status IN (
                       'open',                       -- waiting for an answer or a delivery
                       'answered',                   -- open -> answered
                       'notified',                   -- open -> notified (a notification delivered)
                       'expired',                    -- open -> expired
                       'undelivered',                -- open -> undelivered (a notification)
                       'cancelled')),                -- open -> cancelled
    open           INTEGER NOT NULL DEFAULT 1,       -- 1 while status = 'open'
    delivery_state TEXT NOT NULL CHECK (delivery_state IN (
                       'in_inbox', 'to_deliver', 'delivering', 'delivered', 'retrying',
                       'undelivered', 'cancelling')),
    attempts       INTEGER NOT NULL DEFAULT 0,
    asked_at       BIGINT NOT NULL,
    expires_at     BIGINT NOT NULL,
    answer         TEXT,
    answer_id      BIGINT,
    answered_by    TEXT,
    answered_at    BIGINT,
    claimed_for    TEXT,
    reply_id       TEXT,
    sent_conversation TEXT,
    sent_id        TEXT,
    conversation   TEXT,                             -- the reading key, when replies are read
    refused_replies INTEGER NOT NULL DEFAULT 0,
    told           INTEGER NOT NULL DEFAULT 0,
    deliver_args   TEXT,                             -- rendered once at the run's start
    attempt_started_at BIGINT,                       -- of the attempt in flight or the last one
    reading        BIGINT REFERENCES readings(id),   -- the reading it joined, once delivered
    approval       TEXT,                             -- a call's approval gate (JSON); NULL for a question
    follow_up      TEXT,                             -- JSON: its reminders, escalation, default answer
    reminded       INTEGER NOT NULL DEFAULT 0,       -- reminders so far (request_reminded's n)
    escalated_to   TEXT COLLATE "C",                 -- once escalated: the party asked too, who may answer
    reply_sender   TEXT,                             -- who wrote the reply that answered
    answered_by_name TEXT,                           -- who answered, in words: a token's or person's name, a sender
    digest         TEXT,                             -- sha256 of what it shows (request_digest); NULL: opened before
    on_behalf_of   TEXT,                             -- a deputy's answer: the person they stood for
    UNIQUE (playbook, run_id)
);
CREATE INDEX IF NOT EXISTS requests_open ON requests (playbook, seq) WHERE open = 1;
CREATE INDEX IF NOT EXISTS requests_open_party ON requests (playbook, party, seq) WHERE open = 1;
CREATE INDEX IF NOT EXISTS requests_open_escalated ON requests (playbook, escalated_to, seq)
    WHERE open = 1 AND escalated_to IS NOT NULL;
CREATE INDEX IF NOT EXISTS requests_by_status ON requests (status, seq);

-- Every message id a reading has dealt with (taken, refused or passed over): never twice.
CREATE TABLE IF NOT EXISTS replies_seen (
    reading  BIGINT NOT NULL REFERENCES readings(id),
    reply_id TEXT NOT NULL,
    PRIMARY KEY (reading, reply_id)
);

-- Reminders and escalation messages sent into a delivered request's thread (with replies.tell),
-- each attempted as a delivery is: recorded before it is sent, then 1, 2, 4 and 8 minutes apart.
CREATE TABLE IF NOT EXISTS nudges (
    id         BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    playbook   TEXT NOT NULL,
    run_id     TEXT NOT NULL,
    what       TEXT NOT NULL CHECK (what IN ('reminder', 'escalation')),
    n          INTEGER NOT NULL,                     -- the reminder's number (1 for the escalation)
    message    TEXT NOT NULL,
    state      TEXT NOT NULL CHECK (state IN (      -- as a delivery's
                   'to_deliver', 'delivering', 'delivered', 'retrying', 'undelivered')),
    attempts   INTEGER NOT NULL DEFAULT 0,
    started_at BIGINT                                -- of the attempt in flight or the last one
);

-- Append-only. `id` is monotonic and never reused, and ids commit in increasing order (a write
-- takes the store's advisory lock first); run events also carry a gap-free run_seq.
CREATE TABLE IF NOT EXISTS events (
    id       BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    playbook TEXT NOT NULL,
    run_id   TEXT,                                   -- NULL for the playbook's own events
    run_seq  INTEGER,
    type     TEXT NOT NULL,
    at       BIGINT NOT NULL,
    by       TEXT,
    payload  TEXT NOT NULL,
    size     INTEGER NOT NULL,
    daemon   TEXT                                    -- the daemon that wrote it (daemons.id)
);
CREATE INDEX IF NOT EXISTS events_by_run ON events (playbook, run_id, id);
CREATE INDEX IF NOT EXISTS events_by_playbook ON events (playbook, id) WHERE run_id IS NULL;

-- Due times for the timer task: expiries, attempts, lost-attempt checks, reads, waits.
CREATE TABLE IF NOT EXISTS timers (
    key    TEXT PRIMARY KEY,                         -- kind:playbook:ref
    due_at BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS timers_due ON timers (due_at);   -- the timer wheel reads a window at a time

-- API tokens, stored as sha256 hashes of their secrets; also one-time login links and the inbox
-- sessions they trade for (12 h idle, 7 days at most). A person's token, link or session names
-- the person (a party as `to` renders it): it sees and answers only the requests addressed to them.
CREATE TABLE IF NOT EXISTS tokens (
    id         TEXT PRIMARY KEY,                     -- tok_...
    hash       TEXT NOT NULL UNIQUE,
    playbook   TEXT,                                 -- NULL: every playbook
    role       TEXT NOT NULL CHECK (role IN ('reader', 'writer', 'operator')),
    name       TEXT,
    purpose    TEXT NOT NULL DEFAULT 'api' CHECK (purpose IN ('api', 'login', 'session')),
    created_at BIGINT NOT NULL,
    revoked_at BIGINT,
    used_at    BIGINT,                               -- a session's last use (to the minute)
    expires_at BIGINT,                               -- a session's or a login link's end at the latest
    person     TEXT                                  -- NULL: not a person's (an operator's, a program's)
);

-- The daemon's own keys, made once and kept: `answer_links` signs the answer links (HMAC-SHA256).
CREATE TABLE IF NOT EXISTS daemon_keys (
    name       TEXT PRIMARY KEY,
    secret     TEXT NOT NULL,                        -- hex
    created_at BIGINT NOT NULL
);

-- Typed-API idempotency keys: a replay returns the first response.
CREATE TABLE IF NOT EXISTS idempotency (
    caller     TEXT NOT NULL,
    key        TEXT NOT NULL,
    body_sha   TEXT NOT NULL,
    status     INTEGER NOT NULL,
    response   TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (caller, key)
);
CREATE INDEX IF NOT EXISTS idempotency_by_age ON idempotency (created_at);

-- The daemons serving this database: each registers at its start, beats every few seconds and
-- leaves at its stop; times are the database server's (one clock for every machine). A daemon
-- unseen past its lease is dead: a start takes over its calls in flight, never a live one's.
CREATE TABLE IF NOT EXISTS daemons (
    id         TEXT PRIMARY KEY,                     -- dmn_<ULID>
    host       TEXT NOT NULL,
    pid        INTEGER NOT NULL,
    started_at BIGINT NOT NULL,
    seen_at    BIGINT NOT NULL
);

-- The manual clock's time (--clock manual, for tests and demos), shared: advancing it on any daemon
-- moves it for all. A single row; the system clock never reads it.
CREATE TABLE IF NOT EXISTS clock (
    one    BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (one),
    now_ms BIGINT NOT NULL
);

-- Work one daemon does at a time, by the key of its timer (read:PLAYBOOK:ID, a conversation's reading;
-- workflow:PLAYBOOK:RUN, a workflow run's steps): claimed by one guarded statement, renewed by the
-- holder's heartbeat, deleted when done. A lease past until_ms (the server's clock), or whose daemon
-- has left, may be claimed by another; a daemon that finds another gone takes its leases over.
CREATE TABLE IF NOT EXISTS leases (
    key      TEXT PRIMARY KEY,
    daemon   TEXT NOT NULL,                          -- daemons.id of the holder
    until_ms BIGINT NOT NULL,
    again    BOOLEAN NOT NULL DEFAULT FALSE          -- another daemon asked for the work meanwhile
);

-- Deputies: while [starts_at, ends_at) holds on the daemon's clock, what is addressed to `for_person`
-- in the playbook is addressed to `to_person` too; their answer records them and whom they stood for.
CREATE TABLE IF NOT EXISTS deputies (
    id          TEXT PRIMARY KEY,                    -- dep_<ULID>
    playbook    TEXT NOT NULL,
    for_person  TEXT NOT NULL,
    to_person   TEXT NOT NULL,
    starts_at   BIGINT,                             -- NULL: from its making
    ends_at     BIGINT,                             -- NULL: until removed
    created_at  BIGINT NOT NULL,
    created_by  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS deputies_to ON deputies (playbook, to_person);

-- A quorum approval's addressees besides its party: listing by `to` finds it under each of them.
CREATE TABLE IF NOT EXISTS addressees (
    playbook TEXT NOT NULL,
    person   TEXT NOT NULL,
    run_id   TEXT NOT NULL,
    PRIMARY KEY (playbook, person, run_id)
);
"""


def is_postgres_url(db: str) -> bool:
    """Whether `db` names a PostgreSQL database (postgresql://... or postgres://...) rather than a file."""
    return db.startswith(("postgresql://", "postgres://"))


def postgres_url_shown(db: str) -> str:
    """The URL without its password, to print or log."""
    parts = urllib.parse.urlsplit(db)
    if parts.password is None:
        return db
    netloc = parts.netloc.replace(":" + parts.password + "@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def postgres_database_name(db: str) -> str:
    """The database's name in the URL (the user's name when it names none, as libpq does), for file names."""
    parts = urllib.parse.urlsplit(db)
    name = urllib.parse.unquote(parts.path.lstrip("/")) or parts.username or "postgres"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def db_shown(db: str) -> str:
    """The database as a message names it: a file's path, or a URL without its password."""
    return postgres_url_shown(db) if is_postgres_url(db) else db


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError:
        raise SystemExit("interactiond: a postgresql:// database needs its driver:"
                         " pip install 'interactiond[postgres]'") from None
    return psycopg


def _postgres_schema_sql() -> str:
    here = Path(__file__).with_name("schema-postgres.sql")
    try:
        return here.read_text()
    except OSError:
        return POSTGRES_SCHEMA_SQL


class PgRow:
    """A row as psycopg gives it to the store, read as sqlite3.Row is: by column name or by index,
    with keys(), and as a mapping by dict()."""

    __slots__ = ("_values", "_names")

    def __init__(self, values: Any, names: dict[str, int]) -> None:
        self._values = values
        self._names = names

    def __getitem__(self, key: str | int) -> Any:
        if isinstance(key, str):
            return self._values[self._names[key]]
        return self._values[key]

    def keys(self) -> list[str]:
        return list(self._names)

    def as_dict(self) -> dict[str, Any]:
        """The row as a dict by name (a name twice: its first column), in one pass: dict(row) looks each
        name up through __getitem__."""
        names = self._names
        return dict(zip(names, map(self._values.__getitem__, names.values())))

    def __iter__(self) -> Any:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PgRow) and self.keys() == other.keys() and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PgRow({dict(zip(self._names, self._values))!r})"


def _pg_rows(cursor: Any) -> Callable[[Any], PgRow]:
    """psycopg's row factory for the store: each row a PgRow, the result's column names worked out
    once for all its rows (from the result itself: the cursor's `description` makes an object for
    each column, a tenth of a change's CPU)."""
    names: dict[str, int] = {}
    result = cursor.pgresult
    if result is not None:
        for i in range(result.nfields):
            names.setdefault(result.fname(i).decode(), i)      # a name twice (a join's *): the first
    return lambda values: PgRow(values, names)


@functools.lru_cache(maxsize=1)
def _pg_cursor() -> type:
    """psycopg's cursor, but for its rowcount: in pipeline mode it waits for the statement's result
    first, as reading the rows does (a guard that counts the rows it changed reads it)."""
    psycopg = _psycopg()

    class PgCursor(psycopg.Cursor):  # type: ignore[misc,name-defined]
        @property
        def rowcount(self) -> int:
            self._fetch_pipeline()
            return super().rowcount  # type: ignore[no-any-return]

    return PgCursor


@functools.lru_cache(maxsize=1024)
def _pg_sql(sql: str) -> str:
    """The store's SQL with psycopg's placeholders (`?` as `%s`, a literal `%` doubled). No statement
    of the store holds a `?` inside a string literal."""
    return sql.replace("%", "%%").replace("?", "%s")


#: Statements a connection keeps prepared (psycopg's prepared_max); the least used go past it.
PG_PREPARED_MAX: Final = 512


class _PgConn:
    """A PostgreSQL connection that takes the store's SQL as sqlite3's does: `execute(sql, params)`
    with `?` placeholders, rows by name or index (PgRow). Autocommit: the writer opens its
    transactions itself, and a reading's statements each see what is committed.

    Statements go through psycopg's own cursor, each prepared on the server at its first run
    (`prepare=True`). Within a write the writer puts the connection in psycopg's pipeline mode
    (PostgresTx.begin): a statement whose result nobody reads travels with the next one that is
    read, or with the change's end."""

    __slots__ = ("url", "setup", "raw")

    def __init__(self, url: str, setup: tuple[str, ...] = ()) -> None:
        self.url = url
        self.setup = setup
        self.raw: Any = None
        self.reopen()

    def reopen(self) -> None:
        """(Re)connect, with the session's settings; the old connection, if any, is dropped."""
        psycopg = _psycopg()
        if self.raw is not None:
            with contextlib.suppress(Exception):
                self.raw.close()
            self.raw = None
        extra: dict[str, Any] = {"application_name": "interactiond"}
        if "connect_timeout" not in self.url:
            extra["connect_timeout"] = PG_CONNECT_TIMEOUT_S
        raw = psycopg.connect(self.url, autocommit=True, row_factory=_pg_rows, cursor_factory=_pg_cursor(), **extra)
        raw.prepared_max = PG_PREPARED_MAX
        for sql in self.setup:
            raw.execute(sql)
        self.raw = raw

    @property
    def lost(self) -> bool:
        return self.raw is None or self.raw.closed or self.raw.broken

    def execute(self, sql: str, params: Any = ()) -> Any:
        return self.raw.execute(_pg_sql(sql), params, prepare=True)

    def close(self) -> None:
        if self.raw is not None:
            self.raw.close()


def _pg_problem(exc: BaseException, otherwise: str | None = None) -> BaseException:
    """A busy, unreachable or full database server as a problem that says so (as _db_problem does
    for SQLite); any other error as it is (or as a plain failure when `otherwise` describes it)."""
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None and isinstance(exc, psycopg.Error):
        state = exc.sqlstate or ""
        if state in ("40001", "40P01", "55P03"):   # serialization failure, deadlock, lock timeout
            return Problem("unavailable", "the database was busy with another daemon's writes past the lock"
                           " timeout; nothing was written, try again", kind="database_busy")
        if state == "53100":
            return Problem("unavailable", "the database server's disk is full; nothing was written", kind="disk_full")
        if isinstance(exc, psycopg.OperationalError) and (not state or state.startswith(("08", "57P", "53"))):
            return Problem("unavailable", "the database server could not be reached or dropped the connection;"
                           " try again", kind="database_unreachable")
    return Problem("failed", otherwise) if otherwise is not None else exc


POSTGRES_DIALECT: Final = Dialect(
    sql=_pg_sql,
    greatest="GREATEST",
    # PostgreSQL says which row of a name is its latest with DISTINCT ON.
    latest_definitions="SELECT DISTINCT ON (type, name) type, name, version, description FROM definitions"
                       " WHERE playbook = ? AND active = 1 AND (CAST(? AS TEXT) IS NULL OR type = ?)"
                       " ORDER BY type, name, version DESC",
    uses_pair="EXISTS (SELECT 1 FROM jsonb_array_elements(d.uses::jsonb) u WHERE u->>0 = ? AND u->>1 = ?)",
    asking_run="WITH ins AS (" + _INSERT_RUN_SQL + " RETURNING seq), slot AS (UPDATE playbooks SET open_requests ="
               " open_requests + 1 WHERE id = ? AND open_requests < ? AND EXISTS (SELECT 1 FROM ins) RETURNING id)"
               " SELECT EXISTS (SELECT 1 FROM ins), EXISTS (SELECT 1 FROM slot)",
)


#: An event, and (the second) an event of a run counted on it in the same statement: a data-modifying
#: WITH, which inserts nothing when the run is not there.
_PG_INSERT_EVENT_SQL: Final = ("INSERT INTO events (id, playbook, run_id, run_seq, type, at, by, payload, size, daemon)"
                               " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
_PG_COUNTED_EVENT_SQL: Final = (
    "WITH r AS (UPDATE runs SET events = events + 1 WHERE playbook = ? AND run_id = ? RETURNING events)"
    " INSERT INTO events (id, playbook, run_id, run_seq, type, at, by, payload, size, daemon)"
    " SELECT ?, ?, ?, r.events, ?, ?, ?, ?, ?, ? FROM r")
#: The last event id taken. Events are never deleted, and every write holds the writes' lock from
#: its BEGIN to its COMMIT, so the writer numbers the events it inserts itself, from this on.
_PG_LAST_EVENT_SQL: Final = "SELECT COALESCE(MAX(id), 0) FROM events"


class PostgresTx(SqlTx):
    """The store's operations on a PostgreSQL connection (SqlTx's, in POSTGRES_DIALECT), with the
    server's transactions, and what several daemons sharing the database need of a change. `daemon`
    is the id of the daemon whose store it serves (None for the command line)."""

    __slots__ = ("daemon", "_pipeline", "_sync", "_event_id", "_guards")

    conn: _PgConn
    dialect = POSTGRES_DIALECT

    def __init__(self, conn: _PgConn, daemon: str | None = None) -> None:
        super().__init__(conn)  # type: ignore[arg-type]
        self.daemon = daemon
        self._pipeline: contextlib.ExitStack | None = None     # psycopg's pipeline of the group commit
        self._sync: Callable[[], None] = lambda: None           # ... and its sync()
        self._event_id: int | None = None       # within a write: the last event id taken
        self._guards: list[tuple[Any, Problem]] = []     # the change's guards, checked at its end

    @property
    def errors(self) -> tuple[type[BaseException], ...]:  # type: ignore[override]
        return (_psycopg().Error,)

    # A group commit is one transaction in psycopg's pipeline mode (Connection.pipeline), each of its
    # changes in a savepoint of its own (psycopg's Transaction): a change's statements travel
    # together, and its end waits for their results, so a change that fails is undone alone. A
    # change waits for a result within it only where it reads a row it goes on with: its guards
    # (SqlTx.guard) are checked at its end, and the ids of its events are the writer's own.

    def begin(self) -> None:
        # Event ids come from a sequence when a row is inserted, not when it commits: two
        # transactions (two daemons, or a daemon and `interactiond token`) could commit ids 8 and
        # then 7, and a stream or a Last-Event-ID that has passed 8 reads `WHERE id > 8` and never
        # sees 7. Every write takes this lock first and holds it to its COMMIT, so transactions
        # take ids and commit one after another. Taken at BEGIN, before any row lock, so it waits
        # in no cycle with one: it is SQLite's BEGIN IMMEDIATE, for every daemon on the database.
        conn = self.conn
        self._leave_pipeline()
        if conn.lost:
            conn.reopen()
        elif conn.raw.info.transaction_status != _psycopg().pq.TransactionStatus.IDLE:
            conn.raw.rollback()                 # a transaction left open by a failure: never built upon
        try:
            self._begin()
        except _psycopg().OperationalError:
            self._leave_pipeline()
            if not conn.lost:
                raise
            # The connection was dropped while idle (a restart, a failover): nothing of the
            # transaction ran, so it begins again, once, on a new connection.
            conn.reopen()
            self._begin()

    def _begin(self) -> None:
        raw = self.conn.raw
        stack = contextlib.ExitStack()
        pipeline = stack.enter_context(raw.pipeline())
        self._pipeline, self._sync = stack, pipeline.sync
        raw.execute("BEGIN")
        raw.execute(_PG_LOCK_SQL)
        last = raw.execute(_PG_LAST_EVENT_SQL)
        pipeline.sync()             # waits for the lock; psycopg learns that a transaction is open
        self._event_id = last.fetchone()[0]

    def _leave_pipeline(self) -> None:
        stack, self._pipeline = self._pipeline, None
        self._event_id = None
        if stack is not None:
            with contextlib.suppress(Exception):
                stack.close()

    def run_change(self, change: Callable[..., Any], fx: Effects) -> Any:
        """`change(self, fx)` in a savepoint (the Transaction that Connection.transaction() gives, here
        without the second sync it makes in pipeline mode): the change's end syncs the pipeline, so a
        statement of it that failed raises here, and the savepoint is rolled back to; its RELEASE, or
        ROLLBACK TO, goes with the next change's statements."""
        psycopg = _psycopg()
        event_id, guards = self._event_id, self._guards
        with psycopg.Transaction(self.conn.raw):
            try:
                result = change(self, fx)
                self._sync()
                for cursor, problem in guards:
                    if not cursor.rowcount:
                        raise problem
            except BaseException:
                self._event_id = event_id       # the ids the change took go back with it
                with contextlib.suppress(psycopg.Error):
                    self._sync()                # out of the aborted state, so that the rollback runs
                raise
            finally:
                guards.clear()
            return result

    def guard(self, cursor: Any, problem: Problem) -> None:
        if self._pipeline is None:
            super().guard(cursor, problem)
        else:
            self._guards.append((cursor, problem))

    def _insert_event(self, playbook: str, run_id: str | None, run_seq: int | None, values: tuple[Any, ...]) -> int:
        conn = self.conn
        if self._event_id is None:              # outside a write (the command line): numbered as it is inserted
            self._event_id = conn.execute(_PG_LAST_EVENT_SQL).fetchone()[0]
        self._event_id = event_id = self._event_id + 1
        values += (self.daemon,)
        if run_id is not None and run_seq is None:
            self.guard(conn.execute(_PG_COUNTED_EVENT_SQL, (playbook, run_id, event_id, playbook, run_id) + values),
                       Problem("not_found", f"no run {run_id} in this playbook"))
        else:
            conn.execute(_PG_INSERT_EVENT_SQL, (event_id, playbook, run_id, run_seq) + values)
        if self._pipeline is None:
            self._event_id = None
        return event_id

    def _insert_events(self, playbook: str, run_id: str, rows: list[tuple[int, tuple[Any, ...]]]) -> list[int]:
        if len(rows) == 1 or self._pipeline is None:
            return super()._insert_events(playbook, run_id, rows)
        start = self._event_id
        assert start is not None
        self._event_id = start + len(rows)
        self.conn.execute(_PG_INSERT_EVENT_SQL + ", (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)" * (len(rows) - 1), [
            v for i, (run_seq, values) in enumerate(rows, 1) for v in (start + i, playbook, run_id, run_seq, *values,
                                                                          self.daemon)])
        return list(range(start + 1, start + len(rows) + 1))

    def commit(self) -> None:
        """COMMIT, sent with the pipeline's last sync: the transaction's one wait at its end."""
        stack, self._pipeline, self._event_id = self._pipeline, None, None
        if stack is None:
            self.conn.raw.commit()
            return
        self.conn.raw.execute("COMMIT")
        stack.close()

    def rollback(self) -> None:
        self._leave_pipeline()
        conn = self.conn
        if not conn.lost and conn.raw.info.transaction_status != _psycopg().pq.TransactionStatus.IDLE:
            conn.raw.rollback()

    def ready(self) -> None:
        if self.conn.lost:
            self.conn.reopen()

    def in_transaction(self) -> bool:
        conn = self.conn
        if conn.lost:
            return False
        return conn.raw.info.transaction_status != _psycopg().pq.TransactionStatus.IDLE

    @staticmethod
    def problem(exc: BaseException, otherwise: str | None = None) -> BaseException:
        return _pg_problem(exc, otherwise)

    # Several daemons on one database.

    def before_commit(self, changes: list[Effects]) -> None:
        """Tell the other daemons what the changes mean for them (due times, wake-ups, new events,
        invalidated caches): NOTIFY in the changing transaction, so they hear it at the COMMIT, and
        never of a change rolled back. Sent with the COMMIT, in its round trip."""
        if self.daemon is not None:
            # Only while another daemon is entered (its row read under the writes' lock, as it enters
            # under it: register_daemon): a daemon alone hears nothing of its own commits.
            for payload in _bus_payloads(self.daemon, changes):
                self.conn.execute("SELECT pg_notify(?, ?) WHERE EXISTS (SELECT 1 FROM daemons WHERE id <> ?)",
                                  (PG_CHANNEL, payload, self.daemon))

    # A whole database copied (see SqlTx).

    def begin_snapshot(self) -> None:
        self.conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")

    def holds_data(self) -> bool:
        return self.conn.execute("SELECT to_regclass('runs') IS NOT NULL").fetchone()[0]

    def table_columns(self, table: str) -> list[str]:
        return [r[0] for r in self.conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema()"
            " AND table_name = ? ORDER BY ordinal_position", (_copied(table),)).fetchall()]

    def table_rows(self, table: str, columns: list[str], batch: int) -> Iterable[list[tuple[Any, ...]]]:
        # A server-side cursor: the rows come a batch at a time, not all into memory at once.
        with self.conn.raw.cursor(name=f"copy_{_copied(table)}") as cur:
            cur.itersize = batch
            cur.execute(f"SELECT {', '.join(_copied_column(c) for c in columns)} FROM {table}")
            while rows := cur.fetchmany(batch):
                yield [tuple(r) for r in rows]

    def insert_rows(self, table: str, columns: list[str], rows: list[tuple[Any, ...]]) -> None:
        with self.conn.raw.cursor() as cur:                # executemany pipelines the batch: one round trip
            cur.executemany(_pg_sql(f"INSERT INTO {_copied(table)} ({', '.join(_copied_column(c) for c in columns)})"
                                    f" VALUES ({', '.join('?' * len(columns))})"), rows)

    def after_copy(self) -> None:
        """The ids copied in were given, not drawn: each identity goes on from the largest one copied."""
        for table, column in (("runs", "seq"), ("readings", "id"), ("requests", "seq"), ("events", "id")):
            self.conn.execute(f"SELECT setval(pg_get_serial_sequence(?, ?), COALESCE(MAX({column}), 0) + 1, false)"
                              f" FROM {table}", (table, column))

    def definition_keys(self) -> list[tuple[str, str, str]]:
        """Every (playbook, type, name) that has a definition."""
        return [(r[0], r[1], r[2]) for r in self.conn.execute("SELECT DISTINCT playbook, type, name FROM definitions")]

    def system_calls_in_flight(self) -> list[tuple[str, str, dict[str, Any] | None]]:
        """As SQLiteTx's, but only the calls of daemons that are gone: a call that a live daemon sent
        (by the daemon of its last tool_call_started event) is that daemon's to end."""
        rows = self.conn.execute(
            "SELECT r.playbook, r.run_id, e.payload FROM runs r LEFT JOIN LATERAL (SELECT payload, daemon FROM events"
            " WHERE playbook = r.playbook AND run_id = r.run_id AND type = ? ORDER BY id DESC LIMIT 1) e ON TRUE"
            " WHERE r.status = ? AND r.tools_called = 1 AND r.type IN ('interaction', 'execute') AND NOT EXISTS (SELECT 1"
            f" FROM daemons d WHERE d.id = e.daemon AND d.seen_at > {_PG_NOW_SQL} - ?)",
            (EventType.TOOL_CALL_STARTED.value, RunStatus.STARTED.value, int(DAEMON_LEASE_S * 1000))).fetchall()
        return [(r["playbook"], r["run_id"], json.loads(r["payload"]) if r["payload"] else None) for r in rows]

    # Leases: work one daemon does at a time (a conversation's reading, a workflow run's steps), and
    # the work of daemons that are gone.

    def claim_lease(self, key: str, *, due_by: int | None = None) -> bool:
        """Hold the work of a timer's key for this daemon, in one guarded statement: a new lease, or one
        whose holder stopped beating or left; with `due_by`, only while that timer is due by then. False
        when another daemon holds it - which is then told to do the work again when it releases it."""
        if self.conn.execute(
                f"INSERT INTO leases (key, daemon, until_ms) SELECT ?, ?, {_PG_NOW_SQL} + ? WHERE CAST(? AS BIGINT)"
                " IS NULL OR EXISTS (SELECT 1 FROM timers WHERE key = ? AND due_at <= ?) ON CONFLICT (key) DO UPDATE"
                " SET daemon = excluded.daemon, until_ms = excluded.until_ms, again = FALSE"
                f" WHERE leases.until_ms < {_PG_NOW_SQL} OR NOT EXISTS (SELECT 1 FROM daemons d"
                " WHERE d.id = leases.daemon) RETURNING key",
                (key, self.daemon, _lease_ms(), due_by, key, due_by)).fetchone() is not None:
            return True
        self.conn.execute("UPDATE leases SET again = TRUE WHERE key = ? AND daemon <> ?", (key, self.daemon))
        return False

    def release_lease(self, key: str) -> bool:
        """Give this daemon's lease of `key` back; True when another daemon asked for the work meanwhile."""
        row = self.conn.execute("DELETE FROM leases WHERE key = ? AND daemon = ? RETURNING again",
                                (key, self.daemon)).fetchone()
        return bool(row is not None and row[0])

    def attempt_elsewhere(self, playbook: str, run_id: str) -> bool:
        """Whether the attempt in flight of a run's request was begun by another daemon that is alive (by
        the daemon of its delivery_started event): how it ends is that daemon's to record."""
        return self.conn.execute(
            f"SELECT 1 FROM daemons WHERE id <> ? AND seen_at > {_PG_NOW_SQL} - ? AND id = (SELECT daemon"
            " FROM events WHERE playbook = ? AND run_id = ? AND type = 'delivery_started' ORDER BY id DESC LIMIT 1)",
            (self.daemon, _lease_ms(), playbook, run_id)).fetchone() is not None

    def take_over(self, fx: Effects, now: int) -> None:
        """What daemons that are gone held: each lease is dropped and its timer armed again (due now at the
        latest) on every daemon; each attempt they had in flight counts as lost now (its `lost` timer)."""
        for (key,) in self.conn.execute(
                f"DELETE FROM leases WHERE daemon NOT IN (SELECT id FROM daemons WHERE seen_at > {_PG_NOW_SQL} - ?)"
                " RETURNING key", (_lease_ms(),)).fetchall():
            due = self.timer_due(key)
            self.set_timer(fx, key, now if due is None else min(due, now))
        for r in self.conn.execute(
                f"SELECT q.playbook, q.run_id FROM requests q WHERE q.open = 1 AND q.delivery_state IN ({_IN_FLIGHT_SQL})"
                f" AND NOT EXISTS (SELECT 1 FROM daemons d WHERE d.seen_at > {_PG_NOW_SQL} - ? AND d.id = (SELECT"
                " e.daemon FROM events e WHERE e.playbook = q.playbook AND e.run_id = q.run_id"
                " AND e.type = 'delivery_started' ORDER BY e.id DESC LIMIT 1))", (_lease_ms(),)).fetchall():
            self.set_timer(fx, timer_key("lost", r["playbook"], r["run_id"]), now)

    def share_clock(self, now: int) -> int:
        """Keep the manual clock's time in the database, the later of `now` and the time kept, and tell
        the other daemons (in this transaction); the time kept."""
        kept = self.conn.execute("INSERT INTO clock (now_ms) VALUES (?) ON CONFLICT (one) DO UPDATE"
                                 " SET now_ms = GREATEST(clock.now_ms, excluded.now_ms) RETURNING now_ms",
                                 (now,)).fetchone()[0]
        if self.daemon is not None:
            self.conn.execute("SELECT pg_notify(?, ?)", (PG_CHANNEL, dumps({"d": self.daemon, "x": [["c", kept]]})))
        return kept

    def clock_kept(self) -> int | None:
        """The manual clock's time in the database; None before a manual clock kept one."""
        row = self.conn.execute("SELECT now_ms FROM clock").fetchone()
        return row[0] if row is not None else None


class PgDaemons:
    """The daemons sharing a database, on a connection of their own (a store's listening one, or the
    command line's): entering, heartbeats, the daemons found gone, leaving, and the tables'
    statistics. A file has one daemon, and nothing of this."""

    __slots__ = ("conn",)

    def __init__(self, conn: _PgConn) -> None:
        self.conn = conn

    def close(self) -> None:
        self.conn.close()

    def register_daemon(self, daemon: str, host: str, pid: int) -> None:
        """Enter a daemon that starts (its connection LISTENs already); a daemon of this host whose
        process is gone (a crash, a kill) leaves now rather than when its lease ends. Under the writes'
        lock: a write that finds no other daemon entered notifies nobody (before_commit), so it must
        commit before this one enters, and the new daemon then reads what it wrote."""
        for row in self.conn.execute("SELECT id, pid FROM daemons WHERE host = ?", (host,)).fetchall():
            if row["pid"] != pid and not _process_alive(row["pid"]):
                self.conn.execute("DELETE FROM daemons WHERE id = ?", (row["id"],))
        self.conn.execute("BEGIN")
        try:
            self.conn.execute(_PG_LOCK_SQL)
            self.conn.execute(f"INSERT INTO daemons (id, host, pid, started_at, seen_at) VALUES (?, ?, ?,"
                              f" {_PG_NOW_SQL}, {_PG_NOW_SQL})", (daemon, host, pid))
            self.conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(_psycopg().Error):
                self.conn.execute("ROLLBACK")
            raise

    def refresh_statistics(self) -> None:
        """ANALYZE the tables the changes address by key. A statement's plan is made once per
        connection (its fifth run), from the statistics of the moment, and made again when they
        change; made before a table had any, it may take a key lookup for a scan of an index on a
        leading column the two share (a run's events numbered by scanning every run of its playbook:
        answers ~4x slower with 3,000 open). The server's autovacuum refreshes them too, but looks at
        most once a minute. Only a table never analyzed, or changed by half its rows since, is: a
        large database's are left to autovacuum. A table another session holds locked (a VACUUM FULL,
        another daemon's ANALYZE) is skipped, never waited for: the listener's thread beats the
        daemon's heartbeat. A role that does not own the tables is told so by a warning, and skipped."""
        stale = [r[0] for r in self.conn.execute(
            "SELECT relname FROM pg_stat_user_tables WHERE schemaname = current_schema()"
            " AND relname IN ('runs', 'requests', 'events', 'timers') AND (COALESCE(last_analyze, last_autoanalyze)"
            " IS NULL OR n_mod_since_analyze * 2 > n_live_tup) ORDER BY relname").fetchall()]
        if stale:
            self.conn.execute("ANALYZE (SKIP_LOCKED) " + ", ".join(stale))     # names of the list above, not a caller's

    def beat(self, daemon: str) -> bool:
        """A live daemon's heartbeat, which renews the leases it holds; False when its row has gone (it is
        entered again)."""
        if not self.conn.execute(f"UPDATE daemons SET seen_at = {_PG_NOW_SQL} WHERE id = ?", (daemon,)).rowcount:
            return False
        self.conn.execute(f"UPDATE leases SET until_ms = {_PG_NOW_SQL} + ? WHERE daemon = ?", (_lease_ms(), daemon))
        return True

    def reap_daemons(self, host: str, pid: int) -> list[str]:
        """Remove the daemons that are gone - unseen past their lease, or of this host with their process
        ended (a crash, a kill) - and say which: each is removed once, by one daemon, which takes its
        work over (Engine._take_over)."""
        ended = [r["id"] for r in self.conn.execute("SELECT id, pid FROM daemons WHERE host = ?", (host,)).fetchall()
                 if r["pid"] != pid and not _process_alive(r["pid"])]
        return [r[0] for r in self.conn.execute(
            f"DELETE FROM daemons WHERE seen_at <= {_PG_NOW_SQL} - ? OR id = ANY(CAST(? AS TEXT[])) RETURNING id",
            (_lease_ms(), ended)).fetchall()]

    def leave(self, daemon: str) -> None:
        """A daemon that stops: its calls still in flight are the next start's to end (or a live daemon's
        `lost` timer's); the work it still held is given back, its timers told again to every daemon."""
        self.conn.execute("DELETE FROM daemons WHERE id = ?", (daemon,))
        fx = Effects()
        for (key,) in self.conn.execute("DELETE FROM leases WHERE daemon = ? RETURNING key", (daemon,)).fetchall():
            timer = self.conn.execute("SELECT due_at FROM timers WHERE key = ?", (key,)).fetchone()
            if timer is not None:
                fx.timers.append((key, timer[0]))
        for payload in _bus_payloads(daemon, [fx]):
            self.conn.execute("SELECT pg_notify(?, ?)", (PG_CHANNEL, payload))

    def live_daemons(self) -> list[Row]:
        """The daemons seen within their lease: id, host, pid, started_at, seen_at."""
        return self.conn.execute(f"SELECT * FROM daemons WHERE seen_at > {_PG_NOW_SQL} - ? ORDER BY started_at, id",
                                 (int(DAEMON_LEASE_S * 1000),)).fetchall()


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:                                 # another user's process: it exists
        return True
    return True


def _bus_payloads(daemon: str, changes: list[Effects]) -> list[str]:
    """The effects of committed changes as NOTIFY payloads of at most PG_NOTIFY_BYTES: JSON
    {"d": daemon, "x": [item, ...]}, an item being ["t", key, due or null] (a due time), ["w",
    playbook, run_id] (a wake-up), ["e", id, playbook, run_id, type, at] (an event, without its
    payload: a stream reads it from the table) or ["i", ...] (an invalidated cache entry)."""
    items: list[str] = []
    for fx in changes:
        items += (dumps(["t", key, due]) for key, due in fx.timers)
        items += (dumps(["w", *key]) for key in fx.wakes)
        items += (dumps(["e", e["id"] if type(e["id"]) is int else None, e["playbook"], e["run_id"], e["type"], e["at"]])
                  for e in fx.published)          # an id still to come back: null (the stream reads the table)
        items += (dumps(["i", *what]) for what in fx.invalidated)
    out: list[str] = []
    head = '{"d":' + dumps(daemon) + ',"x":['
    chunk: list[str] = []
    size = len(head) + 2
    for item in items:
        n = len(item.encode()) + 1
        if chunk and size + n > PG_NOTIFY_BYTES:
            out.append(head + ",".join(chunk) + "]}")
            chunk, size = [], len(head) + 2
        chunk.append(item)
        size += n
    if chunk:
        out.append(head + ",".join(chunk) + "]}")
    return out


class PgBus(LocalBus):
    """LocalBus, told also of other daemons' commits on the database: their notifications (sent in
    their changing transactions) arrive on the store's listening connection and are delivered here
    as this daemon's own effects are, so a long poll on one daemon wakes on an answer given on
    another, a stream rings, a timer set elsewhere is armed here, a definition saved elsewhere is
    read again. The database stays the truth: a notification only says where to look again."""

    def __init__(self, store: "PostgresStore", clock: Clock) -> None:
        super().__init__()
        self.store = store
        self.clock = clock
        self._tasks: set[asyncio.Task[Any]] = set()
        if clock.manual:                       # the manual clock's time lives in the database
            clock.on_change(self._clock_moved)

    def _clock_moved(self) -> None:
        """This daemon moved the manual clock: keep the time in the database (in the writer's order,
        so before the changes the move fires), and the other daemons catch up."""
        if self.store._writer is None:
            return                              # not open yet: the open shares the clock
        now = self.clock.now_ms()
        fut = self.store.write(lambda tx, fx: tx.share_clock(now))
        fut.add_done_callback(lambda f: f.cancelled() or f.exception() is None or log.warning(
            "the manual clock's time could not be kept in the database: %s", f.exception()))

    def remote(self, text: str) -> None:
        """A notification from the database (on the event loop); this daemon's own are skipped."""
        try:
            msg = json.loads(text)
            if msg.get("d") == self.store.daemon_id:
                return
            fx = Effects()
            for item in msg["x"]:
                kind = item[0]
                if kind == "t":
                    fx.timers.append((item[1], item[2]))
                elif kind == "w":
                    fx.wakes.append((item[1], item[2]))
                elif kind == "e":
                    fx.published.append({"id": item[1], "playbook": item[2], "run_id": item[3], "type": item[4],
                                         "at": item[5], "payload": None})
                elif kind == "i":
                    fx.invalidated.append(tuple(item[1:]))
                elif kind == "c" and self.clock.manual:
                    self.clock.catch_up(item[1])        # type: ignore[attr-defined]
        except (ValueError, KeyError, IndexError, TypeError):
            log.warning("a notification on %s could not be read; dropped", PG_CHANNEL)
            return
        self.deliver(fx, remote=True)

    def gone(self) -> None:
        """The heartbeat found other daemons gone (and removed them): their work is this one's to take over."""
        for sink in self._gone_sinks:
            sink()

    def resync(self) -> None:
        """The listening connection was lost and opened again, so notifications may have been missed:
        every due time is loaded again (and the manual clock's time), every cached definition
        invalidated, every waiter and stream told to look again."""
        async def again() -> None:
            timers, names, kept = await self.store.read(
                lambda tx: (tx.all_timers(), tx.definition_keys(), tx.clock_kept()))
            if kept is not None and self.clock.manual:
                self.clock.catch_up(kept)            # type: ignore[attr-defined]
            fx = Effects()
            fx.timers.extend(timers)
            fx.invalidated.extend(("definition", *k) for k in names)
            fx.wakes.extend(self._waiters)
            fx.published.append({"id": None, "playbook": None, "run_id": None, "type": None, "at": None,
                                 "payload": None})
            self.deliver(fx, remote=True)
        if self.stopped:
            return
        task = asyncio.ensure_future(again())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class _PgListener(threading.Thread):
    """A store's own connection for being one of the database's daemons: it enters the daemon at the
    store's open, LISTENs to the other daemons' notifications and hands each to the bus, beats every
    DAEMON_BEAT_S, and removes the daemon at the close. A lost connection is opened again (and the
    bus told to look at everything again, since notifications went missing meanwhile)."""

    def __init__(self, url: str, daemon: str) -> None:
        super().__init__(name="interactiond-listener", daemon=True)
        self.url = url
        self.daemon_id = daemon
        self.daemons: PgDaemons | None = None
        self.halt = threading.Event()
        self.deliver: Callable[[str], None] | None = None      # a notification's payload, to the bus
        self.lost: Callable[[], None] | None = None            # the connection came back: resync
        self.gone: Callable[[], None] | None = None            # other daemons were found gone
        self._analyze = threading.Event()                       # the tables' statistics to be refreshed
        self._wake_r, self._wake_w = os.pipe()

    def register(self) -> None:
        """Connect, LISTEN and enter the daemon (on the caller's thread, before the store serves)."""
        self.daemons = PgDaemons(_PgConn(self.url, ("SET application_name = 'interactiond-listener'",
                                                    f"LISTEN {PG_CHANNEL}")))
        self.daemons.register_daemon(self.daemon_id, _HOST, os.getpid())

    def run(self) -> None:
        tx = self.daemons
        own = '{"d":' + dumps(self.daemon_id) + ","          # as _bus_payloads begins this daemon's
        next_beat = time.monotonic() + DAEMON_BEAT_S
        failures = 0
        while not self.halt.is_set():
            try:
                if tx.conn.lost:
                    tx.conn.reopen()                    # LISTENs again (its setup)
                    if not tx.beat(self.daemon_id):
                        tx.register_daemon(self.daemon_id, _HOST, os.getpid())
                    if self.lost is not None:
                        self.lost()
                raw = tx.conn.raw
                ready, _, _ = select.select([raw.fileno(), self._wake_r], [], [],
                                            max(0.0, next_beat - time.monotonic()))
                if self.halt.is_set():
                    break
                if self._wake_r in ready:
                    os.read(self._wake_r, 512)
                if time.monotonic() >= next_beat:
                    if not tx.beat(self.daemon_id):
                        # Taken for gone and removed: the others stopped telling it of their commits.
                        tx.register_daemon(self.daemon_id, _HOST, os.getpid())
                        if self.lost is not None:
                            self.lost()
                    if tx.reap_daemons(_HOST, os.getpid()) and self.gone is not None:
                        self.gone()
                    next_beat = time.monotonic() + DAEMON_BEAT_S
                if self._analyze.is_set():
                    self._analyze.clear()
                    tx.refresh_statistics()
                # What arrived, and what a beat's query read meanwhile (psycopg keeps those for
                # notifies()). This daemon's own notifications come back too: dropped here,
                # without waking the loop.
                for note in tx.conn.raw.notifies(timeout=0):
                    if self.deliver is not None and not note.payload.startswith(own):
                        self.deliver(note.payload)
                failures = 0
            except Exception as exc:
                failures += 1
                log.warning("daemon %s lost its listening connection (%s); opening it again",
                            self.daemon_id, _pg_problem(exc))
                with contextlib.suppress(Exception):
                    tx.conn.close()
                tx.conn.raw = None
                self.halt.wait(min(5.0, 0.1 * 2 ** failures))
        with contextlib.suppress(Exception):
            if tx.conn.lost:
                tx.conn.reopen()
            tx.leave(self.daemon_id)
        tx.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def stop(self) -> None:
        self.halt.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def analyze_soon(self) -> None:
        """Have the tables' statistics refreshed (PgDaemons.refresh_statistics), here, not on the caller's thread."""
        self._analyze.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")


#: This machine's name, as the daemons table records it.
_HOST: Final = os.uname().nodename


def apply_postgres_schema(conn: _PgConn) -> None:
    """Bring a database to SCHEMA_VERSION, in one transaction under the schema's advisory lock (so
    daemons starting together migrate once): the migrations it has not had, then the schema itself,
    which is idempotent, then the version it reached."""
    raw = conn.raw
    raw.execute("SET client_min_messages = warning")          # not a notice per table that exists
    with raw.transaction():
        raw.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_SCHEMA_LOCK,))
        # The writes' lock too, before any table's: CREATE INDEX IF NOT EXISTS locks its table (SHARE)
        # even when the index is there, in the schema's order, and a daemon's write locks its tables
        # in its own; interleaved, the server ends one of the two as a deadlock. So a start (or the
        # command line) applies the schema between two writes of the daemons already serving.
        raw.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_WRITE_LOCK,))
        version = 0
        if raw.execute("SELECT to_regclass('schema_version')").fetchone()[0] is not None:
            row = raw.execute("SELECT version FROM schema_version").fetchone()
            version = row[0] if row is not None else 0
            for target, step in POSTGRES_MIGRATIONS:
                if version < target:
                    step(conn)
                    version = target
        raw.execute(_postgres_schema_sql())
        raw.execute("INSERT INTO schema_version (version) VALUES (%s) ON CONFLICT (one) DO UPDATE"
                    " SET version = GREATEST(schema_version.version, excluded.version)",
                    (max(version, SCHEMA_VERSION),))


def _reach_postgres(url: str) -> _PgConn:
    """A connection to the database; one line and an exit when the server cannot be reached."""
    try:
        return _PgConn(url)
    except _psycopg().OperationalError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SystemExit(f"interactiond: cannot reach {postgres_url_shown(url)}: {first}") from None


def open_postgres_sync(url: str) -> PostgresTx:
    """The database with the schema applied, outside the loop (see open_sync)."""
    conn = _reach_postgres(url)
    try:
        apply_postgres_schema(conn)
    except BaseException:
        conn.close()
        raise
    return PostgresTx(conn)


def open_copy_source(db: str) -> SqlTx:
    """A database to copy from (`interactiond copy`), brought to this version's schema as a start would
    bring it; ValueError, in one line, when it is no file or holds no interactiond database (nothing
    is made or changed then)."""
    if is_postgres_url(db):
        probe: SqlTx = PostgresTx(_reach_postgres(db))
    elif not Path(db).is_file():
        raise ValueError(f"{db}: no such file")
    else:
        probe = SQLiteTx(_connect(db))
    try:
        if not probe.holds_data():
            raise ValueError(f"{db_shown(db)} holds no interactiond database")
    finally:
        probe.close()
    return open_sync(db)


class PostgresStore(Store):
    """The store on a PostgreSQL database: Store's writer and reader threads and group commit, with
    PostgresTx's operations; no checkpointer (the server keeps its own log). Each store is one
    daemon of the database, entered in its `daemons` table with a heartbeat (`daemon_id`)."""

    commits_on_loop = False

    def __init__(self, path: str, on_commit: Callable[[Effects], None] | None = None) -> None:
        super().__init__(path, on_commit)
        self.daemon_id = "dmn_" + new_ulid().lower()
        self._changes = 0                           # committed by this daemon's writer
        self._analyze_at = PG_ANALYZE_FIRST         # ... when the tables' statistics are next refreshed
        self._listener: _PgListener | None = None
        self._bus: PgBus | None = None

    def make_bus(self, clock: Clock) -> LocalBus:
        """A PgBus: the effects of this daemon's commits, and of the other daemons' on the database."""
        self._bus = PgBus(self, clock)
        return self._bus

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        init = await loop.run_in_executor(None, open_postgres_sync, self.path)
        try:
            if self._bus is not None and self._bus.clock.manual:     # the later of this clock and the shared one
                init.daemon = self.daemon_id
                self._bus.clock.catch_up(init.share_clock(self._bus.clock.now_ms()))  # type: ignore[attr-defined]
        finally:
            init.close()
        self._listener = _PgListener(self.path, self.daemon_id)
        await loop.run_in_executor(None, self._listener.register)
        if self._bus is not None:
            bus = self._bus
            self._listener.deliver = lambda payload: loop.call_soon_threadsafe(bus.remote, payload)
            self._listener.lost = lambda: loop.call_soon_threadsafe(bus.resync)
            self._listener.gone = lambda: loop.call_soon_threadsafe(bus.gone)
        self._listener.start()
        self._writer = _DbThread(lambda: self._connect_tx(True), loop, writer=True,
                                 sink=lambda fx: self.on_commit and self.on_commit(fx), on_batch=self._batched)
        self._reader = _DbThread(lambda: self._connect_tx(False), loop, writer=False)
        for t in (self._writer, self._reader):
            t.start()
            t.ready.wait()
            if t.start_error:
                raise t.start_error

    def _batched(self, changes: int, seconds: float) -> None:
        """Each group commit, on the writer's thread: counted for the metrics, and for the statistics."""
        if self.on_batch is not None:
            self.on_batch(changes, seconds)
        self._changes += changes
        if self._changes >= self._analyze_at and self._listener is not None:
            self._analyze_at *= PG_ANALYZE_GROWTH
            self._listener.analyze_soon()

    def _connect_tx(self, writer: bool) -> PostgresTx:
        # A prepared statement's generic plan is made once, on its 5th run, often while the tables
        # are nearly empty: a scan of the whole table was then the cheapest plan, and it stays the
        # plan as the table grows (answers fell from ~600/s to ~250/s with 10,000 due times to scan
        # past). Every statement of the store finds its rows by a key or an index; the planner
        # still scans where none serves, it only prices a scan higher.
        setup: tuple[str, ...] = ("SET enable_seqscan = off",)
        if writer:
            setup += (f"SET lock_timeout = {PG_LOCK_TIMEOUT_MS}", "SET standard_conforming_strings = on")
        return PostgresTx(_PgConn(self.path, setup), self.daemon_id)

    async def claim(self, key: str, *, due_by: int | None = None) -> bool:
        return await self.write(lambda tx, fx: tx.claim_lease(key, due_by=due_by))

    async def release(self, key: str) -> bool:
        return await self.write(lambda tx, fx: tx.release_lease(key))

    async def close(self) -> None:
        await super().close()
        if self._listener is not None:             # after the writer: the daemon leaves last
            self._listener.stop()
            await asyncio.get_running_loop().run_in_executor(None, self._listener.join, 5.0)
            self._listener = None

    def read_sync(self, query: Callable[[Any], Any]) -> Any:
        tx = PostgresTx(_PgConn(self.path))
        try:
            return query(tx)
        finally:
            tx.close()


STORE_BACKENDS.append(Backend(is_postgres_url, PostgresStore, open_postgres_sync))


# Tool servers ###################################################################################
#
# interactiond is also an MCP client of the tool servers its operator configures. Each server has
# one `ToolSession`: opened lazily on first use, shared by every run, reopened after it breaks. The
# SDK's client holds anyio task groups that must be exited by the task that entered them, so one
# *owner task* per server enters `async with Client(...)` and waits; any task may call through the
# live client meanwhile. Every failure is flattened out of exception groups and classified once,
# here, into a `ToolFailure` whose `because` the engine records (see the table in TECH-NOTES 3).
# Nothing here touches the database: the engine records before it sends and after it hears back.


@functools.lru_cache(maxsize=None)
def _connection_errors() -> tuple[type[BaseException], ...]:
    import anyio
    import httpx2
    return (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, httpx2.TransportError,
            ConnectionError, OSError, EOFError)


class ToolFailure(Exception):
    """A tool server failed us. `sent` tells whether the call may have reached the tool."""

    def __init__(self, because: str, message: str, *, sent: bool, retry_after_ms: int | None = None) -> None:
        #: server_failure | timed_out | arguments_refused, or the door's refusals (nothing sent):
        #: tool_not_offered | gated | too_large
        self.because = because
        self.message = message
        self.sent = sent
        self.retry_after_ms = retry_after_ms
        super().__init__(message)


def leaf_errors(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in leaf_errors(sub)]
    return [exc]


def _retry_after_ms(exc: BaseException) -> int | None:
    """A 429/503 answer's Retry-After (seconds or an HTTP date), in milliseconds."""
    for leaf in leaf_errors(exc):
        response = getattr(leaf, "response", None)
        value = response.headers.get("retry-after") if response is not None else None
        if value:
            if value.strip().isdigit():
                return int(value.strip()) * 1000
            with contextlib.suppress(Exception):
                from email.utils import parsedate_to_datetime
                return max(0, int(parsedate_to_datetime(value).timestamp() * 1000) - WALL.now_ms())
    return None


def classify_failure(exc: BaseException, *, sent: bool) -> ToolFailure:
    """One name for every way a tool server can fail."""
    from mcp import MCPError
    if isinstance(exc, ToolFailure):
        return exc
    leaves = leaf_errors(exc)
    for leaf in leaves:
        if isinstance(leaf, MCPError) and leaf.code == -32602:
            return ToolFailure("arguments_refused", f"the server refused the arguments: {leaf.message}", sent=sent)
    for leaf in leaves:
        if isinstance(leaf, (asyncio.TimeoutError, TimeoutError)) or (isinstance(leaf, MCPError) and leaf.code == -32001):
            return ToolFailure("timed_out", "the server did not respond in time", sent=sent)
    leaf = leaves[0] if leaves else exc
    text = leaf.message if isinstance(leaf, MCPError) else (str(leaf) or type(leaf).__name__)
    return ToolFailure("server_failure", f"the server failed: {text}"[:500], sent=sent,
                       retry_after_ms=_retry_after_ms(exc))


def _is_connection_error(exc: BaseException) -> bool:
    from mcp import MCPError
    for leaf in leaf_errors(exc):
        if isinstance(leaf, MCPError):
            if leaf.code == -32000 or (leaf.code == -32600 and "Session not found" in leaf.message):
                return True
        elif isinstance(leaf, _connection_errors()):
            return True
    return False


def result_meta(result: Any) -> dict[str, Any]:
    return dict(result.meta or {}) if getattr(result, "meta", None) else {}


def result_retry_after(result: Any) -> int | None:
    """The wait a tool's error result asks for: `retry_after_ms` in its _meta or structured content."""
    retry = result_meta(result).get("retry_after_ms")
    if retry is None and isinstance(result.structured_content, dict):
        retry = result.structured_content.get("retry_after_ms")
    return int(retry) if isinstance(retry, (int, float)) and not isinstance(retry, bool) and retry >= 0 else None


def result_answer(result: Any) -> tuple[bool, Any]:
    """What a tool answered: structured content, else its first text parsed as JSON, else that text."""
    if result.structured_content is not None:
        return True, result.structured_content
    for block in result.content or ():
        if getattr(block, "type", None) == "text":
            try:
                return True, json.loads(block.text)
            except ValueError:
                return True, block.text
    return False, None


def _result_text(result: Any) -> str:
    texts = [b.text for b in result.content or () if getattr(b, "type", None) == "text"]
    return (" ".join(texts) or "the tool returned an error")[:500]


def result_wire(result: Any) -> dict[str, Any]:
    return result.model_dump(mode="json", by_alias=True, exclude_none=True)


class ToolSession:
    """One configured tool server: a lazily opened, shared, self-healing MCP client session."""

    def __init__(self, config: ServerConfig, scrub: Scrubber | None = None) -> None:
        self.config = config
        #: Every result, listing and failure of this server passes through here as it is received.
        self.scrub = scrub or Scrubber((*config.env.values(), *config.headers.values()))
        self.tools: dict[str, Any] = {}
        self._client: Any = None
        self._owner: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._lock = asyncio.Lock()
        self._retry_after_ms: int | None = None

    def _transport(self, stack: contextlib.AsyncExitStack) -> Any:
        from mcp import StdioServerParameters
        from mcp.client.sse import sse_client as _sse_client
        from mcp.client.stdio import stdio_client as _stdio_client
        c = self.config
        if c.transport == "stdio":
            env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV")}
            env.update(c.env)
            return _stdio_client(StdioServerParameters(command=c.command[0], args=list(c.command[1:]), env=env),
                                 errlog=self._errlog(stack))
        if c.transport == "sse":
            return _sse_client(c.url, headers=c.headers, timeout=OPEN_TIMEOUT_S)
        return None

    def _errlog(self, stack: contextlib.AsyncExitStack) -> Any:
        """The server's stderr: a pipe whose lines the daemon logs scrubbed, never passed on as they are."""
        read_fd, write_fd = os.pipe()
        writer = os.fdopen(write_fd, "w")
        stack.callback(writer.close)            # the last to close: the child holds its own copy

        def pump() -> None:
            with os.fdopen(read_fd, "r", encoding="utf-8", errors="replace") as reader:
                while line := reader.readline(MAX_STDERR_LINE_CHARS):
                    if line := line.rstrip():
                        log.info("tool server %s: %s", self.config.name, self.scrub.text(line))
        threading.Thread(target=pump, name=f"interactiond-stderr-{self.config.name}", daemon=True).start()
        return writer

    async def _hold(self, ready: asyncio.Future[Any]) -> None:
        import httpx2
        from mcp import Client as _McpClient
        from mcp.client.streamable_http import streamable_http_client as _streamable_client
        try:
            async with contextlib.AsyncExitStack() as stack:
                transport = self._transport(stack)
                if transport is None:
                    http = await stack.enter_async_context(httpx2.AsyncClient(
                        headers=self.config.headers, follow_redirects=True,
                        timeout=httpx2.Timeout(CALL_TIMEOUT_S + 5, connect=OPEN_TIMEOUT_S),
                        event_hooks={"response": [self._note_retry_after]}))
                    transport = _streamable_client(self.config.url, http_client=http)
                client = await stack.enter_async_context(
                    _McpClient(transport, read_timeout_seconds=LIST_TIMEOUT_S))
                ready.set_result(client)
                await self._stop.wait()
        except asyncio.CancelledError:
            if not ready.done():
                ready.cancel()
            raise
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            else:
                log.warning("tool server %s: session ended: %s", self.config.name, self.scrub.text(repr(exc)))
        finally:
            self._client = None

    async def _open(self) -> None:
        self._stop = asyncio.Event()
        ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._owner = asyncio.create_task(self._hold(ready), name=f"interactiond-tools-{self.config.name}")
        try:
            client = await asyncio.wait_for(asyncio.shield(ready), OPEN_TIMEOUT_S)
            tools, cursor = {}, None
            while True:
                page = await asyncio.wait_for(client.list_tools(cursor=cursor), LIST_TIMEOUT_S)
                tools.update({t.name: t for t in map(self._listed, page.tools)})
                cursor = page.next_cursor
                if not cursor:
                    break
        except BaseException:
            await self.close()
            raise
        self.tools = tools
        self._client = client

    async def ensure(self) -> Any:
        """The live client, opened now if need be (10 s to open, 10 s to list the tools)."""
        if self._client is not None:
            return self._client
        async with self._lock:
            if self._client is None:
                try:
                    await self._open()
                except Exception as exc:
                    raise self._failure(exc, sent=False) from None
            return self._client

    async def _note_retry_after(self, response: Any) -> None:
        """The SDK turns a 429/503 into a bare error; keep the Retry-After it came with."""
        if response.status_code in (429, 503):
            value = response.headers.get("retry-after", "").strip()
            self._retry_after_ms = int(float(value) * 1000) if re.fullmatch(r"\d+(\.\d+)?", value) else None

    def _listed(self, tool: Any) -> Any:
        """A listed tool, its description and schemas scrubbed by value (a schema's keys are its own)."""
        wire = tool.model_dump(mode="json", by_alias=True, exclude_none=True)
        clean = self.scrub.values(wire)
        return tool if clean == wire else type(tool).model_validate(clean)

    def _received(self, result: Any) -> Any:
        """A tool's result, scrubbed in every part before anything reads it (see Scrubber.result)."""
        wire = result_wire(result)
        clean = self.scrub.result(wire)
        return result if clean == wire else type(result).model_validate(clean)

    def _failure(self, exc: BaseException, *, sent: bool) -> ToolFailure:
        failure = classify_failure(exc, sent=sent)
        failure.message = self.scrub.text(failure.message)
        failure.args = (failure.message,)
        if failure.retry_after_ms is None and self._retry_after_ms is not None:
            failure.retry_after_ms = self._retry_after_ms
        self._retry_after_ms = None
        return failure

    def read_only(self, tool: str) -> bool:
        t = self.tools.get(tool)
        return bool(t is not None and t.annotations is not None and t.annotations.read_only_hint)

    async def call(self, tool: str, arguments: dict[str, Any], timeout: float = CALL_TIMEOUT_S) -> Any:
        """Call once; a broken session is dropped so the next use reopens it. Never re-sends."""
        client = await self.ensure()
        try:
            result = await asyncio.wait_for(client.call_tool(tool, arguments, read_timeout_seconds=timeout),
                                            timeout + 1)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if _is_connection_error(exc):
                await self.close()
            raise self._failure(exc, sent=True) from None
        return self._received(result)

    async def close(self) -> None:
        self._client = None
        owner, self._owner = self._owner, None
        if owner is not None:
            self._stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(owner), 5)
            except (asyncio.TimeoutError, Exception):
                owner.cancel()
                await asyncio.gather(owner, return_exceptions=True)


#: Keys whose values are secrets: matched anywhere in the key ...
_SECRET_KEY_RE: Final = re.compile(r"passw(or)?d|passphrase|secret|api[_-]?key|authori[sz]ation|credential"
                                   r"|private[_-]?key|access[_-]?key|cookie", re.I)
#: ... or as one of its words (split at `_`, `-`, `.` and camelCase): `pass`, `pwd`, `auth`, `bearer`, and
#: any word ending in `token` (`access_token`, `refreshToken`, `accesstoken`); `max_tokens` counts words.
_SECRET_WORDS: Final = frozenset({"pass", "pwd", "auth", "bearer"})
_KEY_WORD_RE: Final = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_TOKEN_RE: Final = re.compile(r"itd_[A-Za-z0-9_-]{20,}")
SCRUBBED: Final = "[scrubbed]"
MIN_SECRET_CHARS: Final = 4               # shorter values are too common in text to be scrubbed by value
MAX_STDERR_LINE_CHARS: Final = 4096        # a tool server's stderr is logged in lines of at most this


@functools.lru_cache(maxsize=4096)
def secret_key(key: str) -> bool:
    """Does this key name a secret (password, api_key, X-Api-Key, access_token, Authorization...)?"""
    if _SECRET_KEY_RE.search(key):
        return True
    return any(w in _SECRET_WORDS or w.endswith("token") for w in (w.lower() for w in _KEY_WORD_RE.findall(key)))


def _keyed_values(value: Any, found: set[str], under: bool = False) -> None:
    """Collect the values that stand under secret-named keys, also inside strings that hold JSON."""
    if isinstance(value, str):
        if under:
            if len(value) >= MIN_SECRET_CHARS:
                found.add(value)
        elif (text := value.strip())[:1] in ("{", "[") and text[-1:] in ("}", "]"):
            try:
                inner = json.loads(text)
            except ValueError:
                return
            _keyed_values(inner, found)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if under and len(text := dumps(value)) >= MIN_SECRET_CHARS:
            found.add(text)
    elif isinstance(value, list):
        for v in value:
            _keyed_values(v, found, under)
    elif isinstance(value, dict):
        for k, v in value.items():
            _keyed_values(v, found, under or (isinstance(k, str) and secret_key(k)))


#: The JSON escapes that stand for a character besides \\uXXXX.
_SHORT_ESCAPES: Final = {'"': '\\"', "\\": "\\\\", "/": "\\/", "\b": "\\b", "\f": "\\f", "\n": "\\n",
                         "\r": "\\r", "\t": "\\t"}


def _escaped_forms(secret: str) -> str:
    """A pattern matching `secret` however JSON text spells it: each character as itself, as
    \\uXXXX (hex digits in either case; a surrogate pair past the BMP), or as its short escape (\\/, \\n...).
    A tool that escapes its text cannot carry a secret past the scrubber into the daemon's decoding."""
    def hex4(n: int) -> str:
        return "".join(f"[{h}{h.upper()}]" if h.isalpha() else h for h in f"{n:04x}")

    def one(c: str) -> str:
        code = ord(c)
        if code > 0xFFFF:
            hi, lo = 0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)
            forms = [re.escape(c), rf"\\u{hex4(hi)}\\u{hex4(lo)}"]
        else:
            forms = [re.escape(c), rf"\\u{hex4(code)}"]
        if c in _SHORT_ESCAPES:
            forms.append(re.escape(_SHORT_ESCAPES[c]))
        return "(?:" + "|".join(forms) + ")"
    return "".join(map(one, secret))


class Scrubber:
    """Removes secrets from anything that leaves the daemon or is recorded: configured env/header
    values and API tokens (`itd_...`) by value, wherever they stand, inside longer strings too (and
    in their JSON-escaped form); and, with `__call__`, every value under a key named like password,
    secret, token, api_key or authorization."""

    def __init__(self, secrets_: Iterable[str]) -> None:
        self.secrets = frozenset(v for v in secrets_ if isinstance(v, str) and len(v) >= MIN_SECRET_CHARS)
        values = sorted(self.secrets, key=len, reverse=True)
        self._re = re.compile("|".join(map(_escaped_forms, values))) if values else None

    def text(self, value: str) -> str:
        if self._re is not None:
            value = self._re.sub(SCRUBBED, value)
        return _TOKEN_RE.sub(SCRUBBED, value)

    def values(self, value: Any) -> Any:
        """Scrubbed by value only, keys included: for answers and tool listings, whose keys are the schema's."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.values(v) for v in value]
        if isinstance(value, dict):
            return {(self.text(k) if isinstance(k, str) else k): self.values(v) for k, v in value.items()}
        return value

    def __call__(self, value: Any, under: bool = False) -> Any:
        """Scrubbed by value, and every string or number under a secret-named key replaced whole."""
        if isinstance(value, str):
            return SCRUBBED if under else self.text(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return SCRUBBED if under else value
        if isinstance(value, list):
            return [self(v, under) for v in value]
        if isinstance(value, dict):
            return {(self.text(k) if isinstance(k, str) else k):
                    self(v, under or (isinstance(k, str) and secret_key(k))) for k, v in value.items()}
        return value

    def result(self, wire: dict[str, Any]) -> dict[str, Any]:
        """A tool's result as it came (its wire form), scrubbed in every part: content blocks, structured
        content and _meta. The values found under secret-named keys are secrets for this result too, so
        a text block that repeats them (or JSON text holding them) loses them as well."""
        found: set[str] = set()
        _keyed_values(wire, found)
        scrub = Scrubber((*self.secrets, *found)) if found - self.secrets else self
        return scrub(wire)


class ToolServers:
    """The operator's tool servers, which playbook may use which, their sessions, and the one door
    every call of their tools goes through (`call`)."""

    def __init__(self, config: Config, store: Store | None = None, clock: Clock | None = None) -> None:
        self.config = config
        self.scrub = Scrubber(v for sc in config.servers.values() for v in (*sc.env.values(), *sc.headers.values()))
        self.sessions = {name: ToolSession(sc, self.scrub) for name, sc in config.servers.items()}
        self.store = store                  # where a refused call is recorded (tool_call_refused)
        self.clock = clock

    def offered(self, playbook: str, server: str, tool: str | None = None) -> bool:
        """May this playbook use this server (and the operator allow this tool)?"""
        if server not in self.config.playbooks.get(playbook, ()) or server not in self.sessions:
            return False
        allow = self.config.servers[server].tools
        return tool is None or allow is None or tool in allow

    def gated(self, server: str, tool: str) -> ApprovalPolicy | None:
        """The operator's gate on this tool (`servers.NAME.approve`), if any."""
        sc = self.config.servers.get(server)
        policy = sc.approve if sc is not None else None
        return policy if policy is not None and tool in policy.tools else None

    async def call(self, playbook: str, run_id: str | None, server: str, tool: str, arguments: Any, *,
                   approval: Mapping[str, Any] | None = None, timeout: float = CALL_TIMEOUT_S) -> Any:
        """The one door of every call of a configured tool - a function's call, execute, a delivery, a
        reading, a telling, a reminder, an approved call: nothing else calls a session. It applies the
        operator's allow-list, the approval gate (a gated tool is called only with the arguments an
        approval approved: `approval` is the approved gate), and the bounds on the arguments and the
        wait; the session scrubs what comes back. A refusal raises ToolFailure (sent=False) and calls
        nothing; a gated refusal is also recorded on the run as `tool_call_refused`."""
        if not self.offered(playbook, server, tool):
            raise ToolFailure("tool_not_offered", f"the playbook may not use the tool {tool!r} of {server!r}", sent=False)
        if self.gated(server, tool) is not None and not (
                approval is not None and approval.get("server") == server and approval.get("tool") == tool
                and "approved" in approval and approval["approved"] == arguments):
            if self.store is not None and self.clock is not None:
                now, record = self.clock.now_ms(), {"server": server, "tool": tool, "because": "gated"}
                await self.store.write(lambda tx, fx: tx.append_event(fx, playbook, run_id, "tool_call_refused", now,
                                                                      "interactiond", record))
            raise ToolFailure("gated", f"the operator gates the tool {tool!r} of {server!r}: it is called only once a"
                                       " person approves the call", sent=False)
        if not isinstance(arguments, dict) or json_size(arguments) > MAX_ARGUMENTS_BYTES:
            raise ToolFailure("too_large", f"the arguments are an object of at most {MAX_ARGUMENTS_BYTES // KIB} KiB",
                              sent=False)
        session = self.sessions[server]
        await session.ensure()
        if tool not in session.tools:
            raise ToolFailure("tool_not_offered", f"the tool server {server!r} lists no tool {tool!r}", sent=False)
        return await session.call(tool, arguments, timeout)

    def record(self, server: str, value: Any) -> Any:
        """What may be recorded of `value`: scrubbed, or only its size and digest."""
        if not self.config.servers[server].record_content:
            text = dumps(value)
            return {"size": len(text.encode()), "sha256": sha256_hex(text)}
        return self.scrub(value)

    async def close(self) -> None:
        """At a stop: every session at once, each stdio server given TOOL_EXIT_GRACE_S to exit."""
        with _stdio_exit_bounded():
            await asyncio.gather(*(s.close() for s in self.sessions.values()), return_exceptions=True)


#: A stdio tool server has this long to exit once its input closes at a stop, and as long again
#: after SIGTERM before SIGKILL (the SDK's own waits are 2 s each): a launcher that lingers after its
#: server ends (`sh -c`, package runners) cannot hold a stop past 2 s.
TOOL_EXIT_GRACE_S: Final = 0.5


@contextlib.contextmanager
def _stdio_exit_bounded() -> Iterator[None]:
    """The SDK's waits for a stdio server's exit (read as a session closes) at TOOL_EXIT_GRACE_S meanwhile."""
    sdk_stdio = sys.modules.get("mcp.client.stdio")         # not imported: no stdio session was opened
    names = [n for n in ("PROCESS_TERMINATION_TIMEOUT", "FORCE_KILL_TIMEOUT") if hasattr(sdk_stdio, n)]
    before = {n: getattr(sdk_stdio, n) for n in names}
    for name in names:
        setattr(sdk_stdio, name, TOOL_EXIT_GRACE_S)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(sdk_stdio, name, value)


# Engine #########################################################################################
#
# Theory of operation. Every operation of the product is one method of a part of the engine, and
# `Engine` answers it; the HTTP routes and the MCP tools are thin adapters over them. The parts,
# each built with only what it uses and calling only parts built before it:
#
#     Definitions    saving and reading definitions; the cache of parsed documents
#     SystemCalls    the tool servers a playbook sees; execute; functions that ask a system
#     Runs           starting, waiting for, cancelling and listing runs (Definitions, SystemCalls)
#     Inbox          open requests, answers, events (Runs)
#     Readings       reading replies in conversations, taking answers from them (Definitions, Inbox)
#     Deliveries     attempts to send a request through a tool (Definitions, Readings)
#
# `Engine` builds them, owns the life cycle and the timer task, and routes each due timer by the
# kind its key starts with to the handler registered with `on_timer`.
#
# A method does its pure work on the event loop (parse, validate, render), then hands the store
# ONE change that re-reads what it depends on, guards every transition in SQL (`UPDATE ... WHERE
# status = 'open'`), writes the rows and appends the events together. What the change means in
# memory - a timer to arm, a waiter to wake, an event to stream - is applied after the commit (see
# Effects).
#
# Time: one `TimerWheel` task sleeps until the earliest due time and is woken when an earlier one
# is added or the manual clock moves. The due times live in the `timers` table, so a restart loads
# them again: 10,000 open requests are 10,000 rows and heap entries, not 10,000 sleeping tasks.


class Role(str, enum.Enum):
    READER = "reader"
    WRITER = "writer"
    OPERATOR = "operator"

    @property
    def rank(self) -> int:
        return {"reader": 0, "writer": 1, "operator": 2}[self.value]


def quorum_people(request: Mapping[str, Any]) -> list[str]:
    """The addressees of a quorum approval (`to: [a, b, c]`) from a request's row; [] for any other
    request (or a row read without its approval)."""
    try:
        approval = request["approval"]
    except (KeyError, IndexError):
        return []
    if approval is None or '"quorum"' not in approval:
        return []
    return list(json.loads(approval).get("quorum", {}).get("to", []))


@dataclass(frozen=True)
class Caller:
    """Who makes a call: a token's id, `stdio`, or `local`; what it may do and see.

    A person's caller (a token, sign-in or answer link made `--for` them) sees only the requests
    addressed to them and answers as themselves: `answered_by` and the events' `by` name the person.
    Everything else (runs, definitions, events, other people's requests) is 404 to them: the HTTP
    routes and MCP tools a person may use say so (Route.person, McpTool.person), and the inbox
    operations scope their reads with `inbox_to` and `addressed`.
    """

    id: str
    role: Role
    playbook: str | None = None          # bound to one playbook; None sees every one
    person: str | None = None            # a person's caller: the party they are
    name: str | None = None              # a token's name (`token create NAME`), said of its answers
    stands_for: tuple[str, ...] = ()     # a person's: whom they are a deputy of now (Inbox.deputized)

    def sees(self, playbook: str) -> bool:
        return self.role is Role.OPERATOR or self.playbook is None or self.playbook == playbook

    def require(self, role: Role) -> None:
        if self.role.rank < role.rank:
            raise Problem("forbidden", f"this operation needs a {role.value} token; this one is a {self.role.value}")

    @property
    def by(self) -> str:
        """Who an answer or an event records: the person's name, else the caller's id."""
        return self.person if self.person is not None else self.id

    @property
    def by_name(self) -> str | None:
        """Who an answer records in words (answered_by_name): the person's name, else the token's; None
        for a caller with neither (stdio, the command line's own)."""
        return self.person if self.person is not None else self.name

    def inbox_to(self, to: str | None) -> str | None:
        """The addressee a listing of open requests keeps: a person's own name (another's is 404)."""
        if self.person is None:
            return to
        if to is not None and to != self.person and to not in self.stands_for:
            raise not_found("a person sees only the requests addressed to them")
        return to if to is not None else self.person

    def addressed(self, request: Mapping[str, Any]) -> bool:
        """Whether this caller may see and answer a request (a row with its `party`, and `escalated_to`
        where the row has it): a person only their own, or one escalated to them."""
        if self.person is None or request["party"] == self.person or request["party"] in self.stands_for:
            return True
        if any(p == self.person or p in self.stands_for for p in quorum_people(request)):
            return True
        try:
            return request["escalated_to"] is not None and (request["escalated_to"] == self.person
                                                            or request["escalated_to"] in self.stands_for)
        except (KeyError, IndexError):
            return False

    def on_behalf_of(self, request: Mapping[str, Any]) -> str | None:
        """Whom a person's answer of `request` stands for: None when it is addressed to them, else the
        person (its party, or whom it was escalated to) they are a deputy of."""
        if self.person is None:
            return None
        try:
            escalated = request["escalated_to"]
        except (KeyError, IndexError):
            escalated = None
        people = quorum_people(request)
        if self.person in (request["party"], escalated, *people):
            return None
        return next((p for p in (request["party"], *people) if p in self.stands_for), escalated)


OPERATOR_LOCAL: Final = Caller("local", Role.OPERATOR)


def person_name(text: Any) -> str:
    """A person's name as `to` renders it (trimmed); ValueError says why it is not one."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("a person is named as requests address them (their `to`), e.g. ana")
    name = text.strip()
    if has_control_char(name) or len(name.encode()) > MAX_PARTY_BYTES:
        raise ValueError(f"a person's name is at most {MAX_PARTY_BYTES} bytes, without control characters")
    return name


class AnswerLinks:
    """The answer links of open requests: `{base}/a/{request id}.{signature}`.

    The signature is an HMAC-SHA256 (cut to 192 bits) over the request's id, playbook, run and
    addressee with the daemon's `answer_links` key, made once and kept in the database (every
    daemon of a database signs alike, and a restart keeps the links working). The link is the
    capability: whoever holds it answers as the addressee, once, with answer_interaction's rules;
    a link that does not verify is a plain 404. A form on the link's page carries `form_token`,
    derived from the link, so no other site can post it blind.
    """

    KEY_NAME: Final = "answer_links"

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")            # public_url, else the daemon's own address
        self.key: bytes | None = None           # loaded at the engine's start

    def load(self, tx: Any, now: int) -> None:
        self.key = bytes.fromhex(tx.daemon_key(self.KEY_NAME, secrets.token_hex(32), now))

    def _mac(self, text: str) -> str:
        assert self.key is not None
        digest = hmac.new(self.key, text.encode(), hashlib.sha256).digest()[:24]
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def token(self, row: Mapping[str, Any], person: str | None = None) -> str | None:
        """The signed part of a request's link (a row with id, playbook, run_id, party); None before the key.
        A deputy's link (`person`, standing for the party) names them after the signature."""
        if self.key is None:
            return None
        who = person if person is not None else row["party"]
        mac = self._mac(chr(31).join((row["id"], row["playbook"], row["run_id"], who)))
        if who == row["party"]:
            return f"{row['id']}.{mac}"
        return f"{row['id']}.{mac}.{base64.urlsafe_b64encode(who.encode()).decode().rstrip('=')}"

    def url(self, row: Mapping[str, Any], person: str | None = None) -> str | None:
        token = self.token(row, person)
        return f"{self.base}/a/{token}" if token is not None else None

    def holder(self, token: str, row: Mapping[str, Any]) -> str | None:
        """Whom a link that verifies is for: the request's party, or the deputy it names; None when it
        does not verify."""
        parts = token.split(".")
        who = row["party"]
        if len(parts) == 3:
            try:
                who = base64.urlsafe_b64decode(parts[2] + "=" * (-len(parts[2]) % 4)).decode()
            except (ValueError, UnicodeDecodeError):
                return None
            if who == row["party"]:
                return None
        mine = self.token(row, who)
        return who if mine is not None and hmac.compare_digest(mine.encode(), token.encode()) else None

    def verifies(self, token: str, row: Mapping[str, Any]) -> bool:
        return self.holder(token, row) is not None

    def form_token(self, token: str) -> str:
        return self._mac("form" + chr(31) + token)

    def sign(self, purpose: str, text: str) -> str:
        """A MAC of `text` for one purpose with the same key (the MCP bridge's request state)."""
        return self._mac(purpose + chr(31) + text)

    def shown(self, obj: dict[str, Any], row: Mapping[str, Any], caller: Caller) -> dict[str, Any]:
        """`obj` with the request's `answer_url` when the caller may answer it: a writer (a person only
        their own requests); readers never see it. `row` is the request's (id, playbook, run_id, party)."""
        deputy = caller.person if caller.on_behalf_of(row) is not None else None     # a deputy's own link
        if caller.role.rank >= Role.WRITER.rank and caller.addressed(row) and (url := self.url(row, deputy)) is not None:
            obj["answer_url"] = url
        return obj

    async def on_run(self, store: Any, caller: Caller, run: dict[str, Any]) -> dict[str, Any]:
        """A waiting run as get_run shows it: with its open request's `answer_url` for a writer."""
        if run["status"] == RunStatus.WAITING.value and caller.role.rank >= Role.WRITER.rank and self.key is not None:
            req = await store.read(lambda tx: tx.request(run["playbook"], run["run_id"]))
            if req is not None and req["status"] == RequestStatus.OPEN:
                self.shown(run, req, caller)
        return run


def run_object(row: Row) -> dict[str, Any]:
    """The run as every API shows it."""
    return {
        "run_id": row["run_id"], "playbook": row["playbook"], "type": row["type"], "name": row["name"],
        "version": row["version"], "status": row["status"], "kind": row["kind"],
        "input": loads(row["input"]),
        "output": loads(row["output"]) if row["output"] is not None else None,
        "problem": loads(row["problem"]) if row["problem"] is not None else None,
        "created_at": fmt_time(row["created_at"]), "ended_at": fmt_time(row["ended_at"]),
        "settled_by": row["settled_by"],
    }


@functools.lru_cache(maxsize=256)
def _listed_schema(text: str) -> Any:
    """An answer schema as listed: requests of one function share its text, so it is parsed once.
    (The object is shared between listings; they are only serialised.)"""
    return json.loads(text)


def addressees(row: Row) -> list[str]:
    """Whom a request asks: its party and, once escalated, the escalation's party too (either may answer);
    a quorum approval, each of its `to`."""
    escalated = row["escalated_to"]
    listed = quorum_people(row) or [row["party"]]
    return listed if escalated is None or escalated in listed else [*listed, escalated]


def may_reply(row: Row, sender: str) -> bool:
    """Whether a reply from `sender` counts for a request: from its answerer, or from the party it was
    escalated to; for a quorum approval, from any of its addressees (a vote as the sender)."""
    return sender == row["answerer"] or (row["escalated_to"] is not None and sender == row["escalated_to"]) \
        or sender in quorum_people(row)


def request_object(row: Row) -> dict[str, Any]:
    """An open request as list_interactions shows it."""
    return {
        "run_id": row["run_id"], "type": row["type"], "name": row["name"], "version": row["version"],
        "to": row["party"], "addressees": addressees(row), "from": row["answerer"],
        "delivery": {"server": row["server"], "tool": row["tool"]} if row["server"] else None,
        "message": row["message"], "takes_answer": row["answer_schema"] is not None,
        "asked_at": fmt_time(row["asked_at"]), "expires_at": fmt_time(row["expires_at"]),
        "attempts": row["attempts"], "delivery_state": row["delivery_state"],
        "answer_schema": _listed_schema(row["answer_schema"]) if row["answer_schema"] is not None else None,
        "conversation": row["conversation"], "answerer": row["answerer"],
        "refused_replies": row["refused_replies"], "reminded": row["reminded"],
        "approval": _approval_shown(row["approval"]) if row["approval"] is not None else None,
        "digest": row["digest"],
    }


def event_object(row: Row, *, whole: bool = False) -> dict[str, Any]:
    """An event; listings cut the payload to a preview of 2 KiB and say its full size."""
    out = {"id": f"evt_{row['id']}", "type": row["type"], "run_id": row["run_id"], "playbook": row["playbook"],
           "at": fmt_time(row["at"]), "by": row["by"], "size": row["size"]}
    if whole or row["size"] <= PREVIEW_BYTES:
        out["payload"] = json.loads(row["payload"])
        out["truncated"] = False
    else:
        out["preview"] = row["payload"].encode()[:PREVIEW_BYTES].decode("utf-8", "ignore")
        out["truncated"] = True
    return out


def parse_event_id(text: str) -> int:
    m = re.fullmatch(r"(?:evt_)?([0-9]{1,18})", str(text))
    if not m:
        raise not_found("no such event")
    return int(m.group(1))


def answer_errors(row: Row, answer: Any, digest: Any = None) -> list[dict[str, Any]]:
    """The one check of an answer, whichever door it comes in by (the API, the page, an answer link,
    a reply in a thread, an MCP elicitation): the request's answer schema, as stored. An answer that
    names the digest of what it was given (`digest`) answers that only: another request's, or the
    same request's before it changed, is 409 digest_mismatch."""
    if digest is not None:
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ended("invalid_input", "digest is the request's 64 lowercase hex digits, as shown with it",
                        errors=[{"pointer": "/digest", "message": "64 lowercase hex digits"}])
        if row["digest"] is not None and not hmac.compare_digest(digest, row["digest"]):
            raise Problem("digest_mismatch", f"the answer was given to a request showing something else (digest"
                          f" {digest[:12]}...); the request shows {row['digest'][:12]}... now: read it again",
                          extra={"digest": row["digest"]})
    return schema_errors(_compiled_schema(row["answer_schema"]), answer, "/answer")


def answer_fact(row: Row) -> dict[str, Any]:
    fact = {"run_id": row["run_id"], "answer_id": f"evt_{row['answer_id']}", "answer": loads(row["answer"]),
            "claimed_for": row["claimed_for"], "answered_by": row["answered_by"],
            "answered_by_name": row["answered_by_name"], "answered_at": fmt_time(row["answered_at"]),
            "digest": row["digest"]}
    if row["on_behalf_of"] is not None:
        fact["on_behalf_of"] = row["on_behalf_of"]
    if row["reply_id"] is not None:
        fact["reply"] = {"id": row["reply_id"], **({"sender": row["reply_sender"]} if row["reply_sender"] else {})}
    return fact


def _renders_empty(tree: Any, value: Any) -> bool:
    """Whether a text template of a `with` tree (not a whole expression) rendered to nothing."""
    if isinstance(tree, Template):
        return not tree.whole and value == "" and tree.source.strip() != ""
    if isinstance(tree, dict):
        return any(_renders_empty(t, value.get(k)) for k, t in tree.items())
    if isinstance(tree, list):
        return any(_renders_empty(t, v) for t, v in zip(tree, value))
    return False


def _valid_key(value: Any) -> bool:
    return isinstance(value, str) and value != "" and not has_control_char(value) and len(value.encode()) <= MAX_KEY_BYTES


def _sent_value(answer: Any, pointer: str) -> str | None:
    """A text or whole number of at most 256 bytes at `pointer`, as text; None otherwise."""
    value = pointer_get(answer, pointer, None)
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    return value if _valid_key(value) else None


def _read_messages(result: Any, read: Any) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The messages of a reading tool's answer, oldest first, or why the read failed."""
    if result.is_error:
        return {"because": "tool_error", "message": _result_text(result),
                "retry_after_ms": result_retry_after(result)}, []
    has, answer = result_answer(result)
    if not has:
        return {"because": "no_list", "message": "the answer holds nothing"}, []
    if json_size(result_wire(result)) > MAX_READ_RESULT_BYTES:
        return {"because": "too_large", "message": f"the answer passes {MAX_READ_RESULT_BYTES // KIB} KiB"}, []
    items = pointer_get(answer, read.list, None)
    if not isinstance(items, list):
        return {"because": "no_list", "message": f"the answer holds no list at {read.list}"}, []
    if read.order == "newest_first":
        items = list(reversed(items))
    out = []
    for item in items:
        m = {k: _sent_value(item, p) for k, p in read.each.items() if k in ("id", "sender", "to")}
        text = pointer_get(item, read.each["text"], "")
        m["text"] = text if isinstance(text, str) else ""
        out.append(m)
    return None, out


def _status_of(problem: Problem) -> RunStatus:
    """The run ending a problem stands for, by its HTTP status."""
    return {422: RunStatus.INVALID_INPUT, 409: RunStatus.CONFLICT, 503: RunStatus.UNAVAILABLE,
            410: RunStatus.REJECTED}.get(problem.status, RunStatus.FAILED)


def next_attempt_at(attempts: int, started_at: int | None, now: int, retry_after_ms: int | None) -> int:
    """When the next attempt of a delivery (or of a nudge) falls due after attempt `attempts` failed:
    1, 2, 4 or 8 minutes after that attempt started, or after the Retry-After a server asked (up to 8
    minutes); never before `now`."""
    gap = ATTEMPT_GAPS_S[attempts - 1] * 1000
    if retry_after_ms is not None:
        gap = min(max(0, int(retry_after_ms)), MAX_RETRY_AFTER_DELIVERY_S * 1000)
    return max(now, (started_at or now) + gap)


def _page(data: list[Any], rows: list[Any], n: int, last: Callable[[], list[Any]]) -> dict[str, Any]:
    """A page of `data`; `rows` was fetched with one extra row to know whether more follow."""
    return {"data": data, "next_cursor": encode_cursor(last()) if len(rows) > n else None}


#: The pruning pass's key on the wheel; it lives in memory only (each start arms it again).
PRUNE_TIMER: Final = "prune:-:store"


def session_ended(row: Row, now: int) -> bool:
    """Whether an inbox session has expired: unused for INBOX_SESSION_IDLE, or past its end."""
    idle_ms = int(INBOX_SESSION_IDLE.total_seconds() * 1000)
    return ((row["expires_at"] is not None and now >= row["expires_at"])
            or (row["used_at"] is not None and now >= row["used_at"] + idle_ms))


class TimerWheel:
    """The daemon's one timer task: a heap of (due, key) mirrored from the `timers` table, a window
    at a time. With a `load`, the wheel holds only the due times up to its `horizon` (TIMER_WINDOW
    ahead); when the clock reaches the horizon it moves it one window on and reads that window from
    the store. A timer set beyond the horizon stays in the store until its window comes, so memory
    does not grow with open requests (every one of which has a due time: its expiry)."""

    def __init__(self, clock: Clock, fire: Callable[[list[str]], Any],
                 load: Callable[[int, int], Any] | None = None) -> None:
        self.clock = clock
        self.fire = fire
        self.load = load                # async (after, until) -> [(key, due)]: the store's due times in a window
        self.horizon: int | None = None     # the wheel holds every due time up to here (None: all of them)
        self._heap: list[tuple[int, str]] = []
        self._due: dict[str, int] = {}
        self._touched: set[str] | None = None   # keys set or cancelled while a window loads
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self.on_lag: Callable[[float], None] | None = None     # seconds a due timer fired late (metrics)
        clock.on_change(self._wake.set)

    def __len__(self) -> int:
        return len(self._due)

    def set(self, key: str, due: int, *, own: bool = False) -> None:
        """Hold `key` due at `due`; an `own` timer (the wheel's alone, kept in no store) is held
        whatever the horizon."""
        if self._touched is not None:
            self._touched.add(key)
        if self.horizon is not None and due > self.horizon and not own:
            self._due.pop(key, None)        # its window will read it (an earlier due time it had is gone)
            return
        earliest = self._heap[0][0] if self._heap else None
        self._due[key] = due
        heapq.heappush(self._heap, (due, key))
        if earliest is None or due < earliest:
            self._wake.set()

    def cancel(self, key: str) -> None:
        if self._touched is not None:
            self._touched.add(key)
        self._due.pop(key, None)

    def start_window(self, now: int, due: Iterable[tuple[str, int]]) -> None:
        """At start: the due times of the first window (read up to now + TIMER_WINDOW)."""
        self.horizon = now + TIMER_WINDOW_MS if self.load is not None else None
        for key, at in due:
            self.set(key, at)

    async def _next_window(self, now: int) -> None:
        """Move the horizon a window on and read the due times it now covers. Keys set or cancelled
        while the read is under way keep what the bus told (the read may predate them)."""
        assert self.load is not None and self.horizon is not None
        after, self.horizon = self.horizon, now + TIMER_WINDOW_MS
        self._touched = set()
        try:
            due = await self.load(after, self.horizon)
        finally:
            touched, self._touched = self._touched, None
        for key, at in due:
            if key not in touched:
                self.set(key, at)

    def next_due(self) -> int | None:
        while self._heap and self._due.get(self._heap[0][1]) != self._heap[0][0]:
            heapq.heappop(self._heap)
        nxt = self._heap[0][0] if self._heap else None
        if self.horizon is not None and (nxt is None or self.horizon < nxt):
            return self.horizon             # the next window is read then
        return nxt

    def _pop_due(self, now: int) -> list[str]:
        keys = []
        while self._heap and self._heap[0][0] <= now:
            due, key = heapq.heappop(self._heap)
            if self._due.get(key) == due:
                del self._due[key]
                keys.append(key)
                if self.on_lag is not None:
                    self.on_lag((now - due) / 1000)
        return keys

    async def run_due(self) -> int:
        """Fire every timer that is due now; returns how many fired."""
        async with self._lock:
            now = self.clock.now_ms()
            if self.horizon is not None and now >= self.horizon:
                await self._next_window(now)
            keys = self._pop_due(now)
            if keys:
                await self.fire(keys)
            return len(keys)

    async def run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.run_due()
            except Exception:
                log.exception("a timer failed")
            nxt = self.next_due()
            timeout = None
            if nxt is not None and not self.clock.manual:
                timeout = max(0.0, (nxt - self.clock.now_ms()) / 1000)
            elif nxt is not None and nxt <= self.clock.now_ms():
                timeout = 0
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass


#: The typed questions `ask` raises: built-in functions in every playbook, version 1. Their answer
#: schemas are the four canonical shapes; ask-choice narrows its own to the options of each run.
ASK_ANSWER_SCHEMAS: Final[dict[str, dict[str, Any]]] = {
    "approval": {"type": "object", "required": ["approved"], "additionalProperties": False, "properties": {
        "approved": {"type": "boolean", "description": "Whether it is approved"},
        "comment": {"type": "string", "maxLength": 2000, "description": "An optional comment"}}},
    "text": {"type": "object", "required": ["text"], "additionalProperties": False, "properties": {
        "text": {"type": "string", "maxLength": 8000, "description": "The answer, in words"}}},
    "choice": {"type": "object", "required": ["option_ids"], "additionalProperties": False, "properties": {
        "option_ids": {"type": "array", "items": {"type": "string"}, "minItems": 1, "uniqueItems": True,
                       "description": "The ids of the options picked"}}},
    "confirmation": {"type": "object", "required": ["confirmed"], "additionalProperties": False, "properties": {
        "confirmed": {"type": "boolean", "description": "Whether it is confirmed"}}},
}
_ASK_WORDS: Final = {"approval": "approve or decline, with an optional comment", "text": "answer in words",
                     "choice": "pick from a list of options", "confirmation": "confirm or not"}


#: The follow-up a typed question takes (Reminders checks it against its expiry and answer).
_ASK_FOLLOW_UP: Final[dict[str, Any]] = {
    "remind_after": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_REMINDERS,
                     "description": "When to remind, each an ISO 8601 duration after it is asked (PT4H, P1D),"
                                    " increasing, before it expires"},
    "escalate_to": {"type": "string", "description": "Who is asked too from escalate_after on; either may answer"},
    "escalate_after": {"type": "string", "description": "When escalate_to is asked too: an ISO 8601 duration"
                                                        " after it is asked, before it expires"},
    "default": {"description": "The answer it takes if nobody answers before it expires (in the answer's shape)"},
}


def _ask_source(kind: str) -> str:
    props: dict[str, Any] = {
        "prompt": {"type": "string", "maxLength": 8192, "description": "The question, in Markdown"},
        "to": {"type": "string", "description": "Who is asked"},
        "expires": {"type": "string", "description": "How long the question stands, PT1M to P30D (default P1D)"},
    }
    if kind == "choice":
        props["options"] = {"type": "array", "minItems": 1, "maxItems": 50, "description": "The options",
                            "items": {"type": "object", "required": ["id", "label"], "additionalProperties": False,
                                      "properties": {"id": {"type": "string", "minLength": 1, "maxLength": 128},
                                                     "label": {"type": "string", "maxLength": 256}}}}
        props["multiple"] = {"type": "boolean", "description": "Whether several options may be picked"}
    if kind == "text":
        props["placeholder"] = {"type": "string", "maxLength": 256, "description": "A hint for the empty field"}
    props.update(_ASK_FOLLOW_UP)
    required = ["prompt", "to"] + (["options"] if kind == "choice" else [])
    front = {
        "description": f"Asks a person to {_ASK_WORDS[kind]} (built in; run it with the ask tool)",
        "to": "{{ input.to }}", "expires": "P1D",
        "input": {"schema": {"type": "object", "required": required, "additionalProperties": False,
                             "properties": props}},
        "output": {"schema": ASK_ANSWER_SCHEMAS[kind]},
    }
    import yaml
    return "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n{{ input.prompt }}\n"


ASK_FUNCTIONS: Final[dict[str, str]] = {f"ask-{k}": k for k in ASK_ANSWER_SCHEMAS}


def _ask_overrides(kind: str, input_: dict[str, Any], now: int) -> dict[str, Any]:
    """Per-run parts of a typed question: its expiry, and for a choice the option ids."""
    errors = []
    expires = input_.get("expires", "P1D")
    try:
        td = parse_duration(expires)
        if not EXPIRES_MIN <= td <= EXPIRES_MAX:
            raise ValueError("expires lies between PT1M and P30D")
    except ValueError as exc:
        errors.append({"pointer": "/input/expires", "message": str(exc)})
        td = timedelta(days=1)
    schema = ASK_ANSWER_SCHEMAS[kind]
    if kind == "choice":
        ids = [o["id"] for o in input_["options"]]
        if len(set(ids)) != len(ids):
            errors.append({"pointer": "/input/options", "message": "option ids must be unique"})
        schema = json.loads(dumps(schema))
        opt = schema["properties"]["option_ids"]
        opt["items"]["enum"] = ids
        opt["maxItems"] = len(ids) if input_.get("multiple") else 1
    if errors:
        raise ended("invalid_input", "the question's input is not valid", errors=errors)
    return {"expires_at": now + int(td.total_seconds() * 1000), "answer_schema": schema}


class RunKind(Protocol):
    """A kind of run that lives beside the engine, with its own definition type.

    The engine's own kinds are interactions (asking a person) and system calls (asking a tool);
    a section below registers another in RUN_KINDS at import (Workflows: `workflow`). The engine
    parses, starts, cancels and wakes such runs only through this face, and the kind uses only the
    engine's public one (`document`, `run_definition`, `cancel_in`, `store`, `clock`, `spawn`), so
    neither reaches into the other.
    """

    def parse(self, source: str, name: str | None = None) -> Any: ...

    async def start(self, caller: Caller, playbook: str, name: str, version: int, doc: Any, input_: Any,
                    run_id: str, input_text: str, input_sha: str, parent: str | None) -> tuple[dict[str, Any], bool]: ...

    def cancel_in(self, tx: Tx, fx: Effects, run: Row, now: int, by: str) -> None: ...

    async def on_timer(self, playbook: str, ref: str) -> None: ...

    async def used_by(self, playbook: str, type_: str, name: str) -> list[dict[str, Any]]: ...

    async def warnings(self, playbook: str, doc: Any) -> list[dict[str, Any]]: ...

    async def close(self) -> None: ...


#: The run kinds registered by the sections below: definition type -> a factory given the engine.
#: A kind's runs wake on timers of the same name (`workflow:<playbook>:<run_id>`).
RUN_KINDS: Final[dict[str, Callable[[Any], RunKind]]] = {}


def end(tx: Tx, fx: Effects, playbook: str, run_id: str, ending: str | Problem, detail: str = "", *,
        now: int, by: str, output: Any = None, **problem: Any) -> Row | None:
    """The one way a run ends, by its row of ENDINGS - named, or a Problem that names its status and
    kind: the run's open request (if the row closes one) closes as the row says, then the run ends with
    the row's status and kind, a success with its output, any other ending with its problem (`detail`
    and `problem`'s errors or extra). The closed request, if any."""
    if isinstance(ending, Problem):
        row, why = ending_of(_status_of(ending), ending.kind), ending
    else:
        row = ENDINGS[ending]
        why = ended(ending, detail, **problem) if row.run is not RunStatus.SUCCEEDED else None
    closed = tx.close_request(fx, playbook, run_id, row) if row.request is not None else None
    tx.end_run(fx, playbook, run_id, row.run, now=now, by=by, kind=why.kind if why is not None else row.kind,
               output=output, problem=why)
    return closed


def end_cancelled(tx: Tx, fx: Effects, playbook: str, run_id: str, *, now: int, by: str) -> None:
    """The one cancelled ending of every kind of run: its open request (if any) closes, the run ends."""
    end(tx, fx, playbook, run_id, "cancelled", "the run was cancelled", now=now, by=by)


def rerun_check(row: Row, type_: str, name: str, input_sha: str) -> dict[str, Any]:
    """A run id used before: the same run as it stands, or why it cannot be reused."""
    if row["type"] != type_ or row["name"] != name or row["input_sha"] != input_sha:
        raise Problem("run_id_taken", f"run id {row['run_id']} belongs to a run of another function or input;"
                      " use a new run id", kind="run_id_taken", status=409, extra={"run_id": row["run_id"]})
    if row["tools_called"] and row["status"] != RunStatus.SUCCEEDED.value and RunStatus(row["status"]).ended:
        raise Problem("tools_called", f"run {row['run_id']} called its tool and did not succeed; check its history,"
                      " then start a new run under a new id", kind="tools_called", status=409,
                      extra={"run_id": row["run_id"]})
    return run_object(row)


def render_party(tpl: Any, ctx: dict[str, Any], what: str) -> str:
    """Render `to` or `from`; a bound broken is an `unworkable` conflict (RenderError passes)."""
    value = tpl.render(ctx)
    if not isinstance(value, str):
        raise ended("unworkable", f"{what} rendered as {type(value).__name__}, not text")
    value = value.strip()
    if not value:
        raise ended("unworkable", f"{what} rendered empty")
    if has_control_char(value):
        raise ended("unworkable", f"{what} holds a control character")
    if len(value.encode()) > MAX_PARTY_BYTES:
        raise ended("unworkable", f"{what} is longer than {MAX_PARTY_BYTES} bytes")
    return value


def deliver_args(doc: Any, name: str, run_id: str, input_: Any, prepared: dict[str, Any], now: int) -> Any:
    """The sending tool's arguments, rendered once at the start: every attempt sends the same."""
    ctx = base_context(now, input=input_, to=prepared["party"], message=prepared["message"], run_id=run_id,
                       function=name, expires_at=fmt_time(prepared["expires_at"]), request=prepared["request"],
                       answer_schema=prepared.get("answer_schema", doc.output_schema))
    try:
        args = render_args(doc.deliver.with_, ctx)
    except RenderError as exc:
        if exc.kind == "undefined":
            raise ended("invalid_input", str(exc),
                                 errors=[{"pointer": "/input", "message": str(exc)}]) from None
        raise ended("unworkable", f"deliver.with: {exc}") from None
    if _renders_empty(doc.deliver.with_, args):
        raise ended("unworkable", "an argument of deliver renders no text")
    if json_size(args) > MAX_ARGUMENTS_BYTES:
        raise ended("unworkable",
                             f"the arguments of deliver pass {MAX_ARGUMENTS_BYTES // KIB} KiB")
    return args


class Definitions:
    """Saving, reading, listing and deactivating definitions, and the cache of their parsed documents.

    `kinds` is the engine's registry of run kinds (filled once the engine is built): a definition
    of such a type is parsed, checked and described by its kind.
    """

    def __init__(self, store: Store, clock: Clock, kinds: dict[str, RunKind],
                 gated: Callable[[str, str], Any] = lambda server, tool: None) -> None:
        self.store = store
        self.clock = clock
        self.kinds = kinds
        self.gated = gated              # the operator's approval gate on a tool (ToolServers.gated)
        self._docs: OrderedDict[tuple[str, str, str, int], Any] = OrderedDict()
        self._current: dict[tuple[str, str, str], tuple[int, Any] | None] = {}

    # -- definitions ----------------------------------------------------------------------------

    def _parse(self, type_: str, source: str, name: str | None = None) -> Any:
        if type_ == "interaction":
            return parse_function(source)
        return self.kinds[type_].parse(source, name)    # e.g. Workflows: `name` (when saving) must equal document.name

    def parsed(self, playbook: str, type_: str, name: str, version: int, source: str) -> Any:
        """The document of a definition's version, parsed once and kept (the 512 most recent)."""
        key = (playbook, type_, name, version)
        doc = self._docs.get(key)
        if doc is None:
            doc = self._parse(type_, source)
            self._docs[key] = doc
            if len(self._docs) > 512:
                self._docs.popitem(last=False)
        else:
            self._docs.move_to_end(key)
        return doc

    async def document(self, playbook: str, type_: str, name: str, version: int | None = None) -> tuple[int, Any]:
        """The one lookup of a definition's document: (version, parsed document), of `version` or,
        without it, of the active version (cached until the bus says the definition changed)."""
        if version is None:
            hit = self._current.get((playbook, type_, name))
            if hit is not None:
                return hit
        else:
            doc = self._docs.get((playbook, type_, name, version))
            if doc is not None:
                self._docs.move_to_end((playbook, type_, name, version))
                return version, doc
        row = await self._definition_row(playbook, type_, name, version)
        hit = (row["version"], self.parsed(playbook, type_, name, row["version"], row["source"]))
        if version is None:
            self._current[(playbook, type_, name)] = hit
        return hit

    def forget(self, playbook: str, type_: str, name: str) -> None:
        """The definition changed (another daemon, or a delete): its current version is read again."""
        self._current.pop((playbook, type_, name), None)

    @staticmethod
    def check_def_name(type_: Any, name: Any) -> None:
        errors = []
        if type_ not in ("interaction", *RUN_KINDS):
            errors.append({"pointer": "/type", "message": "must be " + " or ".join(("interaction", *RUN_KINDS))})
        if not isinstance(name, str) or not FUNCTION_NAME_RE.fullmatch(name):
            errors.append({"pointer": "/name", "message": "1 to 128 lowercase letters, digits, hyphens and underscores, starting with a letter or digit"})
        if errors:
            raise Problem("invalid_request", "the definition's type or name is not valid", errors=errors)

    async def create_definition(self, caller: Caller, playbook: str, type_: str, name: str,
                                source: str) -> tuple[dict[str, Any], bool]:
        caller.require(Role.WRITER)
        self.check_def_name(type_, name)
        self._not_builtin(type_, name)
        if not isinstance(source, str) or not source.strip():
            raise Problem("invalid_request", "source is the document's text",
                          errors=[{"pointer": "/source", "message": "a non-empty text"}])
        if "\x00" in source:
            line = source.count("\n", 0, source.index("\x00")) + 1
            raise Problem("invalid_document", f"the document {NUL_MESSAGE} (line {line})",
                          errors=[{"line": line, "field": "", "pointer": "/source", "message": f"this line {NUL_MESSAGE}"}])
        try:
            doc = await check_off_loop(self._parse, type_, source, name)
        except DocumentError as exc:
            raise Problem("invalid_document", f"the document breaks {len(exc.problems)} rule(s)",
                          errors=exc.problems) from None
        gated = [{"line": line, "field": field_, "code": "gated_tool",
                  "message": f"the operator gates the tool {tool!r} of {server!r}: it is called only with a person's"
                             " approval, so it cannot deliver, read replies or tell"}
                 for field_, server, tool, line in getattr(doc, "tool_uses", ()) if self.gated(server, tool) is not None]
        if gated:
            raise Problem("invalid_document", f"the document breaks {len(gated)} rule(s)", errors=gated)
        sha = sha256_hex(source)
        now = self.clock.now_ms()

        def change(tx: Tx, fx: Effects) -> tuple[int, bool]:
            version, created = tx.save_definition(
                playbook=playbook, type_=type_, name=name, source=source, sha=sha, overview=doc.overview,
                description=doc.description, uses=getattr(doc, "uses", []),   # uses: what a workflow calls
                now=now, by=caller.id, answer_schema=dumps(doc.output_schema)
                if type_ == "interaction" and doc.output_schema is not None else None)
            if created:
                tx.append_event(fx, playbook, None, "definition_created", now, caller.id,
                                {"type": type_, "name": name, "version": version, "sha256": sha})
                fx.invalidated.append(("definition", playbook, type_, name))
            return version, created

        version, created = await self.store.write(change)
        self._docs[(playbook, type_, name, version)] = doc
        self._current[(playbook, type_, name)] = (version, doc)
        out = await self.get_definition(caller, playbook, type_, name, version)
        if type_ in self.kinds:                # e.g. a workflow's calls of definitions that do not exist yet
            out["warnings"] = await self.kinds[type_].warnings(playbook, doc)
        return out, created

    async def _definition_row(self, playbook: str, type_: str, name: str, version: int | None) -> Row:
        row = await self.store.read(lambda tx: tx.definition(playbook, type_, name, version))
        if row is None:
            raise not_found(f"no {type_} named {name!r}" + (f" at version {version}" if version else "")
                            + f" in {playbook} (list the playbook's definitions to see what there is)")
        return row

    async def get_definition(self, caller: Caller, playbook: str, type_: str, name: str,
                             version: int | None = None) -> dict[str, Any]:
        row = await self._definition_row(playbook, type_, name, version)
        used_by = [u for kind in self.kinds.values()                   # e.g. the active workflows calling it
                   for u in await kind.used_by(playbook, type_, name)]
        overview = row["overview"]
        if used_by:
            overview += "\n\n**Used by:** " + ", ".join(u["name"] for u in used_by)
        return {"playbook": playbook, "type": type_, "name": name, "version": row["version"],
                "active": bool(row["active"]), "source": row["source"],
                "media_type": "text/markdown" if type_ == "interaction" else "application/yaml",
                "overview": overview, "used_by": used_by, "created_at": fmt_time(row["created_at"])}

    async def list_definitions(self, caller: Caller, playbook: str, type_: str | None = None) -> list[dict[str, Any]]:
        rows = await self.store.read(lambda tx: tx.list_definitions(playbook, type_))
        return [{"type": r["type"], "name": r["name"], "version": r["version"],
                 "description": r["description"]} for r in rows]

    @staticmethod
    def _not_builtin(type_: str, name: str) -> None:
        if type_ == "interaction" and name in ASK_FUNCTIONS:
            raise Problem("conflict", f"{name} is built in; save your own function under another name")

    async def delete_definition(self, caller: Caller, playbook: str, type_: str, name: str) -> dict[str, Any]:
        caller.require(Role.WRITER)
        self._not_builtin(type_, name)
        now = self.clock.now_ms()

        def change(tx: Tx, fx: Effects) -> bool:
            deleted = tx.deactivate_definition(playbook, type_, name)
            if deleted:
                tx.append_event(fx, playbook, None, "definition_deleted", now, caller.id, {"type": type_, "name": name})
                fx.invalidated.append(("definition", playbook, type_, name))
            return deleted
        if not await self.store.write(change):
            raise not_found(f"no active {type_} named {name!r} in this playbook")
        return {"playbook": playbook, "type": type_, "name": name, "active": False}

class Runs:
    """Starting runs, reading, waiting for and cancelling them.

    A system call is run by `system_calls`; a run of a registered kind (`kinds`) by its kind.
    """

    def __init__(self, store: Store, clock: Clock, bus: LocalBus, definitions: Definitions,
                 system_calls: SystemCalls, kinds: dict[str, RunKind], open_limit: int,
                 links: AnswerLinks | None = None, reminders: Reminders | None = None) -> None:
        self.store = store
        self.links = links or AnswerLinks("")          # answer links (no key: none shown)
        self.reminders = reminders                     # plans a request's reminders, escalation and default
        self.clock = clock
        self.bus = bus
        self.definitions = definitions
        self.system_calls = system_calls
        self.kinds = kinds
        self.open_limit = open_limit
        self.stopping = False                 # shutdown: long polls answer at once (set by Engine)

    # -- runs -----------------------------------------------------------------------------------

    def _prepare_request(self, doc: Any, input_: Any, now: int, playbook: str = "", run_id: str = "") -> dict[str, Any]:
        """Check the input and render what the request shows; raises the problem of an ending."""
        if doc.input_validator is not None:
            errors = schema_errors(doc.input_validator, input_, "/input")
            if errors:
                raise ended("invalid_input", "the input does not match the input schema",
                                     errors=errors)
        ctx = base_context(now, input=input_)
        # made here, not in the writer: ULIDs share a lock, and a lock held across threads
        # stalled the loop behind the writer's GIL turn
        request_id = "int_" + new_ulid()
        try:
            party = render_party(doc.to, ctx, "to")
            answerer = render_party(doc.from_, ctx, "from") if doc.from_ is not None else party
            ctx["request"] = {"answer_url": self.links.url({"id": request_id, "playbook": playbook, "run_id": run_id,
                                                            "party": party})}
            message = doc.message.render_text(ctx)
        except RenderError as exc:
            if exc.kind == "undefined":
                raise ended("invalid_input", str(exc),
                                     errors=[{"pointer": "/input", "message": str(exc)}]) from None
            raise ended("unworkable", str(exc)) from None
        if len(message.encode()) > MAX_MESSAGE_BYTES:
            raise ended("unworkable", f"the message is longer than {MAX_MESSAGE_BYTES // KIB} KiB")
        return {"party": party, "answerer": answerer, "message": message,
                "expires_at": now + int(doc.expires.total_seconds() * 1000),
                "request_id": request_id, "request": ctx["request"]}

    async def run_definition(self, caller: Caller, playbook: str, type_: str, name: str, input_: Any = None,
                             run_id: str | None = None, *, parent: str | None = None) -> tuple[dict[str, Any], bool]:
        """Start a run. Returns the run object and whether this call started it.

        `parent` is the workflow run that starts this one as a step; its ending wakes that run.
        """
        caller.require(Role.WRITER)
        self.definitions.check_def_name(type_, name)
        if run_id is not None and (not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id)):
            raise Problem("invalid_request", "run_id is 1 to 128 of A-Z a-z 0-9 _ . : -",
                          errors=[{"pointer": "/run_id", "message": "1 to 128 of A-Z a-z 0-9 _ . : -"}])
        input_ = {} if input_ is None else input_
        input_text = dumps(input_)                      # once: for the bound and for the row
        if len(input_text.encode()) > MAX_BODY_BYTES or json_depth(input_) > MAX_JSON_DEPTH:
            raise Problem("too_large", "the input is too large or too deep")
        if "\\u0000" in input_text:                    # dumps() escapes a NUL so: only then is it walked
            refuse_nul(input_, "/input", "the input")
        version, doc = await self.definitions.document(playbook, type_, name)
        run_id = run_id or new_run_id()  # known before rendering: deliver.with may read it
        input_sha = sha256_hex(json.dumps(input_, sort_keys=True, separators=(",", ":"), ensure_ascii=False))
        now = self.clock.now_ms()
        ending: Problem | None = None
        prepared: dict[str, Any] = {}
        if type_ in self.kinds:                 # e.g. a workflow: the run row; its tasks follow on the timer task
            return await self.kinds[type_].start(caller, playbook, name, version, doc, input_, run_id, input_text,
                                                 input_sha, parent)
        if doc.shape is Shape.SYSTEM:
            return await self.system_calls.run_system(caller, playbook, type_, name, version, doc, input_, run_id,
                                                       input_text, input_sha, parent=parent)
        else:
            try:
                prepared = self._prepare_request(doc, input_, now, playbook, run_id)
                if name in ASK_FUNCTIONS:
                    prepared.update(_ask_overrides(ASK_FUNCTIONS[name], input_, now))
                if self.reminders is not None:
                    prepared["follow_up"] = self.reminders.plan(doc, name, input_, now, prepared)
                if doc.deliver is not None:
                    prepared["deliver_args"] = deliver_args(doc, name, run_id or "", input_, prepared, now)
            except Problem as exc:
                ending = exc
            if doc.deliver is not None and ending is None:
                ending = self.system_calls.calls.check_offered(playbook, doc.deliver.server,
                                                          [doc.deliver.tool] + ([doc.replies.tool] if doc.replies else [])
                                                          + ([doc.replies.tell.tool] if doc.replies and doc.replies.tell else []))
        limit = self.open_limit

        asks = ending is None and (doc.output_schema is not None or doc.deliver is not None)

        def change(tx: Tx, fx: Effects) -> tuple[dict[str, Any], bool]:
            run = dict(playbook=playbook, run_id=run_id, type_=type_, name=name, version=version, input_text=input_text,
                       input_sha=input_sha, parent=parent, now=now, by=caller.id)
            inserted, counted = tx.insert_asking_run(**run, limit=limit) if asks else (tx.insert_run(**run), False)
            if not inserted:
                return rerun_check(tx.run(playbook, run_id), type_, name, input_sha), False   # the id was used
            ending_ = ending
            if asks and not counted:
                ending_ = ended("requests_full",
                                     f"the playbook already has {limit} open requests; answer or cancel some first")
            if ending_ is not None:
                end(tx, fx, playbook, run_id, ending_, now=now, by=caller.id)
            elif self._open_request(tx, fx, playbook, run_id, type_, name, version, doc, prepared, now, caller.id):
                # The run as this change wrote it, waiting for its request, not read back (a ninth of a
                # run's statements).
                return run_object({"run_id": run_id, "playbook": playbook, "type": type_, "name": name,
                                   "version": version, "status": RunStatus.WAITING.value, "kind": None,
                                   "input": input_text, "output": None, "problem": None, "created_at": now,
                                   "ended_at": None, "settled_by": None}), True
            return run_object(tx.run(playbook, run_id)), True

        run, fresh = await self.store.write(change)
        if fresh and run["status"] == RunStatus.WAITING.value:
            run = dict(run, status=RunStatus.STARTED.value)
        return run, fresh

    def _open_request(self, tx: Tx, fx: Effects, playbook: str, run_id: str, type_: str,
                      name: str, version: int, doc: Any, prepared: dict[str, Any], now: int, by: str) -> bool:
        """Open the run's request; True when the run now waits for it, False when it ended (a
        notification the inbox only shows)."""
        answer_schema = prepared.get("answer_schema", doc.output_schema)
        notification = answer_schema is None
        deliver = doc.deliver
        inbox_note = notification and deliver is None
        tx.open_request(request_id=prepared["request_id"], playbook=playbook, run_id=run_id, type_=type_, name=name,
                        version=version, party=prepared["party"], answerer=prepared["answerer"],
                        message=prepared["message"],
                        answer_schema=dumps(answer_schema) if answer_schema is not None else None,
                        server=deliver.server if deliver else None, tool=deliver.tool if deliver else None,
                        delivery=DeliveryState.IN_INBOX if deliver is None else DeliveryState.TO_DELIVER,
                        asked_at=now, expires_at=prepared["expires_at"],
                        deliver_args=dumps(prepared["deliver_args"]) if deliver else None, notified=inbox_note,
                        follow_up=dumps(prepared["follow_up"]) if prepared.get("follow_up") else None)
        tx.append_event(fx, playbook, run_id, "interaction_requested", now, by, {
            "delivery": {"server": deliver.server, "tool": deliver.tool} if deliver else None,
            "to": prepared["party"], "from": prepared["answerer"],
            "message_size": len(prepared["message"].encode()), "takes_answer": not notification,
            "expires_at": fmt_time(prepared["expires_at"]), **Reminders.requested(prepared.get("follow_up"))})
        if inbox_note:
            end(tx, fx, playbook, run_id, "succeeded", now=now, by=by, output={})
            return False
        tx.set_timer(fx, timer_key("expire", playbook, run_id), prepared["expires_at"])
        Reminders.arm(tx, fx, playbook, run_id, prepared.get("follow_up"))
        if deliver is not None:
            tx.set_timer(fx, timer_key("attempt", playbook, run_id), now)
        return True

    async def get_run(self, caller: Caller, playbook: str, run_id: str) -> dict[str, Any]:
        row = await self.store.read(lambda tx: tx.run(playbook, run_id))
        if row is None:
            raise not_found(f"no run {run_id} in this playbook")
        return await self.links.on_run(self.store, caller, run_object(row))

    async def wait_run(self, caller: Caller, playbook: str, run_id: str, timeout: float,
                       tick: Callable[[float], Any] | None = None) -> dict[str, Any]:
        """The run once it ends, or as it stands when `timeout` seconds (real time) pass."""
        key = (playbook, run_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        while True:
            fut = self.bus.waiter(key)
            try:
                run = await self.get_run(caller, playbook, run_id)
                left = deadline - loop.time()
                if RunStatus(run["status"]).ended or left <= 0 or self.stopping:
                    return run
                step = min(left, MCP_HEARTBEAT_S) if tick is not None else left
                try:
                    await asyncio.wait_for(asyncio.shield(fut), step)
                except asyncio.TimeoutError:
                    if tick is not None:
                        await tick(deadline - loop.time())
            finally:
                self.bus.forget(key, fut)

    async def cancel_run(self, caller: Caller, playbook: str, run_id: str) -> dict[str, Any]:
        caller.require(Role.WRITER)
        now = self.clock.now_ms()

        def change(tx: Tx, fx: Effects) -> dict[str, Any]:
            run = tx.run(playbook, run_id)
            if run is None:
                raise not_found(f"no run {run_id} in this playbook")
            if RunStatus(run["status"]).ended:
                if run["kind"] == "cancelled":
                    return run_object(run)
                raise Problem("not_open", f"run {run_id} has already ended ({run['status']})", kind="ended")
            self.cancel_in(tx, fx, run, now, caller.id)
            return run_object(tx.run(playbook, run_id))
        return await self.store.write(change)

    def cancel_in(self, tx: Tx, fx: Effects, run: Row, now: int, by: str) -> None:
        """Cancel a live run inside a change: cancel_run, and a workflow cancelling its child."""
        playbook, run_id = run["playbook"], run["run_id"]
        if run["type"] in self.kinds:          # e.g. a workflow: its open child is cancelled with it
            self.kinds[run["type"]].cancel_in(tx, fx, run, now, by)
            return
        if tx.cancel_delivery(playbook, run_id):      # an attempt in flight finishes first
            tx.append_event(fx, playbook, run_id, "cancel_requested", now, by, {})
        else:
            end_cancelled(tx, fx, playbook, run_id, now=now, by=by)

    async def list_runs(self, caller: Caller, playbook: str, status: str | None = None, function: str | None = None,
                        limit: Any = None, cursor: str | None = None) -> dict[str, Any]:
        n = check_limit(limit)
        if status is not None and status not in {s.value for s in RunStatus}:
            raise Problem("invalid_request", "unknown status", errors=[{"pointer": "/status", "message": "not a run status"}])
        before = decode_cursor(cursor)[0] if cursor else None

        rows = await self.store.read(lambda tx: tx.list_runs(playbook, status=status, function=function,
                                                             before=before, limit=n + 1))
        return _page([run_object(r) for r in rows[:n]], rows, n, lambda: [rows[n - 1]["seq"]])

    async def cancel_task(self, caller: Caller, playbook: str, run_id: str) -> dict[str, Any]:
        """cancel_run for an MCP task's `tasks/cancel`: the same cancel, with an event saying the task
        asked it (its task then reads `cancelled`). A run that has ended already is left as it is."""
        caller.require(Role.WRITER)
        now = self.clock.now_ms()

        def change(tx: Tx, fx: Effects) -> dict[str, Any]:
            run = tx.run(playbook, run_id)
            if run is None:
                raise not_found(f"no run {run_id} in this playbook")
            if not RunStatus(run["status"]).ended:
                tx.append_event(fx, playbook, run_id, EventType.MCP_TASK_CANCELLED.value, now, caller.by, {})
                self.cancel_in(tx, fx, run, now, caller.id)
                run = tx.run(playbook, run_id)
            return run_object(run)
        return await self.store.write(change)


class ToolCalls:
    """A system call's one tool call, for a function's call, an approved call and `execute` alike:
    whether the playbook may use the tool, the call through the tools' one door (ToolServers.call),
    and the run's ending from what the tool answered (`call_and_end`). SystemCalls and Approvals both
    end their calls here."""

    def __init__(self, store: Store, clock: Clock, tools: ToolServers) -> None:
        self.store = store
        self.clock = clock
        self.tools = tools

    def check_offered(self, playbook: str, server: str, tools: list[str]) -> Problem | None:
        """The ending of a run whose playbook may not use these tools of `server`, else None."""
        if not self.tools.offered(playbook, server):
            return ended("tool_not_offered",
                                  f"this playbook may not use the tool server {server!r}; call search to see the servers it may use")
        for tool in tools:
            if not self.tools.offered(playbook, server, tool):
                return ended("tool_not_offered",
                                      f"the operator does not allow the tool {tool!r} of {server!r}; call search to see the tools this playbook may use")
        return None

    async def offered_tool(self, playbook: str, server: str, tool: str) -> tuple[ToolSession, Any]:
        """The open session of a tool the playbook may use, and the tool as listed; else the problem."""
        problem = self.check_offered(playbook, server, [tool])
        if problem is not None:
            raise problem
        session = self.tools.sessions[server]
        try:
            await session.ensure()
        except ToolFailure as exc:
            raise ended("tool_server_failed",
                                 f"the tool server {server!r} could not be reached: {exc.message}; call search to see its state") from None
        t = session.tools.get(tool)
        if t is None:
            raise ended("tool_not_offered",
                                 f"the tool server {server!r} lists no tool {tool!r}; call search to see its tools")
        return session, t

    @staticmethod
    def unfinished(read_only: bool, because: str, message: str) -> Problem:
        if read_only:
            return ended("tools_unfinished",
                                  f"the call failed ({because}): {message}; the tool is read-only, so running again under a new run id is safe",
                                  extra={"because": because})
        return ended("effect_unknown",
                              f"the call failed ({because}): {message}; the tool may have changed something, so check before running again",
                              extra={"because": because})

    @staticmethod
    def unusable(read_only: bool, detail: str, **kw: Any) -> Problem:
        if not read_only:
            detail += "; running again calls the tool again"
        return ended("unworkable", detail, **kw)

    def outcome(self, doc: Any, server: str, tool: str, read_only: bool, result: Any,
                input_: Any = None) -> tuple[Any, Problem | None]:
        """A run's output from the tool's result, or its ending: a function's is the part at `read`,
        checked against output.schema and, with the run's input, the 1 MiB a run records; an `execute`
        run's (no document) is what execute answers."""
        has, answer = result_answer(result)
        if doc is None:
            output: Any = {"server": server, "tool": tool, "is_error": bool(result.is_error),
                           "answer": answer if has else None, "structured_content": result.structured_content,
                           "content": [b.model_dump(mode="json", by_alias=True, exclude_none=True)
                                       for b in result.content or ()]}
        elif result.is_error:
            return None, self.unfinished(read_only, "tool_error", _result_text(result))
        elif not has:
            return None, self.unusable(read_only, "the tool's answer holds nothing to read")
        else:
            try:
                output = pointer_get(answer, doc.call.read) if doc.call.read else answer
            except LookupError:
                return None, self.unusable(read_only, f"the tool's answer holds nothing at {doc.call.read}")
        if json_depth(output) > MAX_JSON_DEPTH or json_size(output) + json_size(input_) > MAX_OUTPUT_BYTES:
            return None, self.unusable(read_only, "the part of the answer at read is more than a run may record (1 MiB)")
        errors = schema_errors(doc.output_validator, output, "/output") if doc is not None and doc.output_validator else []
        if errors:
            return None, self.unusable(read_only, "the tool's answer does not match output.schema", errors=errors)
        return output, None

    async def call_and_end(self, playbook: str, run_id: str, by: str, server: str, tool: str, arguments: Any,
                           read_only: bool, doc: Any, input_: Any = None, *, approval: Mapping[str, Any] | None = None,
                           timeout: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        """Call the tool (its `tool_call_started` is already recorded) and, in one change, record its
        answer or failure and end the run - unless the run ended meanwhile (cancelled while the call
        was in flight). The run as it then stands."""
        answered: dict[str, Any] | None = None
        failed: dict[str, Any] = {}
        output: Any = None
        try:
            result = await self.tools.call(playbook, run_id, server, tool, arguments, approval=approval, timeout=timeout)
        except ToolFailure as exc:
            refused = exc.because == "arguments_refused"
            failed = {"because": exc.because if refused or not exc.sent else "server_failed",
                      "message": self.tools.scrub(exc.message)}
            if refused:
                ending = ended("unworkable", f"the tool refused the arguments: {exc.message}",
                                        extra={"because": "arguments_refused"})
            elif exc.because in ("tool_not_offered", "gated"):          # refused at the door: nothing was sent
                ending = ended("tool_not_offered", exc.message)
            else:
                ending = self.unfinished(read_only, "server_failed", exc.message)
        else:
            wire = result_wire(result)
            answered = {"is_error": bool(result.is_error), "result": self.tools.record(server, wire),
                        "result_size": json_size(wire)}
            output, ending = self.outcome(doc, server, tool, read_only, result, input_)
        end_now = self.clock.now_ms()

        def finish(tx: Tx, fx: Effects) -> dict[str, Any]:
            if answered is not None:
                tx.append_event(fx, playbook, run_id, "tool_call_answered", end_now, by, answered)
            else:
                tx.append_event(fx, playbook, run_id, "tool_call_failed", end_now, by, failed)
            live = tx.run(playbook, run_id)
            if live is not None and not RunStatus(live["status"]).ended:
                end(tx, fx, playbook, run_id, ending or "succeeded", now=end_now, by=by, output=output)
            return run_object(tx.run(playbook, run_id))
        return await self.store.write(finish)


class SystemCalls:
    """The tool servers as a playbook sees them (`config.playbooks` says which it may use), a tool
    called directly (execute), and functions that ask a system."""

    def __init__(self, store: Store, clock: Clock, tools: ToolServers, config: Config, calls: ToolCalls,
                 approvals: Approvals) -> None:
        self.store = store
        self.clock = clock
        self.tools = tools
        self.config = config
        self.calls = calls
        self.approvals = approvals        # the approval gate: a gated call waits for a person

    # -- tool servers ---------------------------------------------------------------------------

    async def search(self, caller: Caller, playbook: str, query: str | None = None) -> dict[str, Any]:
        """The servers this playbook may use and the tools each offers."""
        async def one(name: str) -> dict[str, Any]:
            session = self.tools.sessions[name]
            try:
                await session.ensure()
            except ToolFailure as exc:
                return {"name": name, "available": False, "error": exc.message, "tools": []}
            tools = []
            for t in session.tools.values():
                if not self.tools.offered(playbook, name, t.name):
                    continue
                if query and query.lower() not in f"{t.name} {t.description or ''}".lower():
                    continue
                tools.append({"name": t.name, "description": t.description, "read_only": session.read_only(t.name)})
            return {"name": name, "available": True, "tools": tools}
        names = [n for n in self.config.playbooks.get(playbook, ()) if n in self.tools.sessions]
        return {"servers": list(await asyncio.gather(*(one(n) for n in names)))}

    async def introspect(self, caller: Caller, playbook: str, server: str, tool: str) -> dict[str, Any]:
        session, t = await self.calls.offered_tool(playbook, server, tool)
        return {"server": server, "tool": tool, "description": t.description, "input_schema": t.input_schema,
                "output_schema": t.output_schema, "read_only": session.read_only(tool),
                "annotations": t.annotations.model_dump(mode="json", by_alias=True, exclude_none=True) if t.annotations else None}

    async def execute_tool(self, caller: Caller, playbook: str, server: str, tool: str,
                      arguments: dict[str, Any], approve: Any = None) -> dict[str, Any]:
        """Call one tool once and return its answer; the call is a playbook event. A gated call (the
        operator's gate on the tool, or `approve`) returns the started run that waits for approval."""
        caller.require(Role.WRITER)
        if not isinstance(arguments, dict):
            raise Problem("invalid_request", "arguments is an object", errors=[{"pointer": "/arguments", "message": "an object"}])
        if json_size(arguments) > MAX_ARGUMENTS_BYTES:
            raise ended("unworkable", f"the arguments pass {MAX_ARGUMENTS_BYTES // KIB} KiB")
        session, t = await self.calls.offered_tool(playbook, server, tool)
        errors = schema_errors(compile_schema(t.input_schema or {"type": "object"}), arguments, "/arguments")
        if errors:
            raise ended("unworkable", f"the arguments do not match the input schema of {tool}",
                                 errors=errors)
        if approve is not None or self.approvals.policy(server, tool) is not None:
            return await self.approvals.ask_execute(caller, playbook, server, tool, arguments, session.read_only(tool),
                                                    t.input_schema or {"type": "object"}, approve)
        now = self.clock.now_ms()
        record: dict[str, Any] = {"server": server, "tool": tool, "arguments": self.tools.record(server, arguments),
                                  "arguments_size": json_size(arguments)}
        try:
            result = await self.tools.call(playbook, None, server, tool, arguments)
        except ToolFailure as exc:
            if not exc.sent:                    # refused at the door: nothing was called
                raise ended("tool_not_offered", exc.message) from None
            record.update(because=exc.because, message=self.tools.scrub(exc.message))
            await self.store.write(lambda c, fx: c.append_event(fx, playbook, None, "tool_call_failed", now, caller.id, record))
            name = ("unworkable" if exc.because == "arguments_refused" else
                    "tools_unfinished" if session.read_only(tool) else "effect_unknown")
            raise ended(name, exc.message, extra={"because": exc.because}) from None
        has, answer = result_answer(result)
        record.update(is_error=bool(result.is_error), result=self.tools.record(server, result_wire(result)))
        await self.store.write(lambda c, fx: c.append_event(fx, playbook, None, "tool_call_answered", now, caller.id, record))
        return {"server": server, "tool": tool, "is_error": bool(result.is_error), "answer": answer if has else None,
                "structured_content": result.structured_content,
                "content": [b.model_dump(mode="json", by_alias=True, exclude_none=True) for b in result.content or ()]}

    async def run_system(self, caller: Caller, playbook: str, type_: str, name: str, version: int, doc: Any,
                          input_: Any, run_id: str, input_text: str, input_sha: str, *,
                          parent: str | None = None) -> tuple[dict[str, Any], bool]:
        """A function that asks a system: one call, within 70 s, ending as the behaviour table says."""
        call = doc.call
        now = self.clock.now_ms()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SYSTEM_CALL_TOTAL_S
        ending: Problem | None = None
        arguments: Any = None
        session: ToolSession | None = None
        if doc.input_validator is not None:
            errors = schema_errors(doc.input_validator, input_, "/input")
            if errors:
                ending = ended("invalid_input", "the input does not match the input schema",
                                        errors=errors)
        if ending is None:
            try:
                arguments = render_args(call.with_, base_context(now, input=input_))
            except RenderError as exc:
                ending = (ended("invalid_input", str(exc)) if exc.kind == "undefined"
                          else ended("unworkable", str(exc)))
        if ending is None and json_size(arguments) > MAX_ARGUMENTS_BYTES:
            ending = ended("unworkable", f"the arguments pass {MAX_ARGUMENTS_BYTES // KIB} KiB")
        if ending is None:
            try:
                session, tool = await asyncio.wait_for(self.calls.offered_tool(playbook, call.server, call.tool),
                                                       OPEN_TIMEOUT_S + LIST_TIMEOUT_S + 1)
                errors = schema_errors(compile_schema(tool.input_schema or {"type": "object"}), arguments, "/arguments")
                if errors:
                    ending = ended("unworkable",
                                            f"the tool {call.tool} refused the arguments: they do not match its input schema",
                                            errors=errors)
            except Problem as exc:
                ending = exc
            except asyncio.TimeoutError:
                ending = ended("tool_server_failed",
                                        f"the tool server {call.server!r} did not open in time; call search to see its state")
        if ending is None and (doc.approve is not None or self.approvals.policy(call.server, call.tool) is not None):
            return await self.approvals.ask_function(caller, playbook, type_, name, version, doc, input_, run_id, input_text,
                                                     input_sha, parent, arguments, session.read_only(call.tool),
                                                     tool.input_schema or {"type": "object"})
        started = {"server": call.server, "tool": call.tool,
                   "read_only": session.read_only(call.tool) if session is not None else None,
                   "arguments": self.tools.record(call.server, arguments) if ending is None else None,
                   "arguments_size": json_size(arguments) if arguments is not None else None,
                   "arguments_sha256": sha256_hex(dumps(arguments)) if arguments is not None else None}

        def begin(tx: Tx, fx: Effects) -> tuple[dict[str, Any], bool]:
            row = tx.run(playbook, run_id)
            if row is not None:
                return rerun_check(row, type_, name, input_sha), False
            tx.insert_run(playbook=playbook, run_id=run_id, type_=type_, name=name, version=version,
                          input_text=input_text, input_sha=input_sha, parent=parent, now=now, by=caller.id,
                          tools_called=ending is None)
            if ending is not None:
                end(tx, fx, playbook, run_id, ending, now=now, by=caller.id)
            else:
                tx.append_event(fx, playbook, run_id, "tool_call_started", now, caller.id, started)
            return run_object(tx.run(playbook, run_id)), True

        run, fresh = await self.store.write(begin)
        if not fresh or ending is not None:
            return run, fresh
        assert session is not None
        return await self.calls.call_and_end(playbook, run_id, caller.id, call.server, call.tool, arguments,
                                             session.read_only(call.tool), doc, input_,
                                             timeout=min(CALL_TIMEOUT_S, max(1.0, deadline - loop.time()))), True

@dataclass(frozen=True)
class IdempotencyKey:
    """A typed response's Idempotency-Key, as answer_interaction keeps it with the answer it gives."""

    caller: str                                     # keys belong to their caller (its token's id)
    key: str
    body_sha: str                                   # what the key came with; another digest is a conflict
    response: Callable[[Row], dict[str, Any]]       # what a new answer keeps under it, from the closed request


class Inbox:
    """Open requests, their answers, and the events of runs and playbooks. An answer is checked and
    kept as scrubbed by `tools.scrub`; a run's events are listed once `runs` finds the run."""

    def __init__(self, store: Store, clock: Clock, tools: ToolServers, approvals: Approvals,
                 links: AnswerLinks | None = None) -> None:
        self.store = store
        self.links = links or AnswerLinks("")          # answer links (no key: none shown)
        self.clock = clock
        self.tools = tools
        self.approvals = approvals        # an approval's answer: four eyes, then its call or its refusal

    # -- the inbox ------------------------------------------------------------------------------

    async def list_interactions(self, caller: Caller, playbook: str, to: str | None = None, type_: str | None = None,
                                function: str | None = None, limit: Any = None,
                                cursor: str | None = None) -> dict[str, Any]:
        n = check_limit(limit)
        before = decode_cursor(cursor)[0] if cursor else None
        caller = await self.deputized(caller, playbook)
        to = caller.inbox_to(to)
        also = caller.stands_for if caller.person is not None and to == caller.person else ()
        rows = await self.store.read(lambda tx: tx.open_requests(playbook, to=to, type_=type_, name=function,
                                                                 before=before, limit=n + 1, also=also))
        return _page([self.links.shown(request_object(r), r, caller) for r in rows[:n]], rows, n,
                     lambda: [rows[n - 1]["seq"]])

    async def request_for(self, caller: Caller, playbook: str, run_id: str) -> dict[str, Any] | None:
        """A run's own request as `caller` may see it - {id, status, to, message, answer_schema, and
        answer_url while open} - or None when the run asks nobody, or asks someone else of a person."""
        caller = await self.deputized(caller, playbook)
        row = await self.store.read(lambda tx: tx.request(playbook, run_id))
        if row is None or not caller.addressed(row):
            return None
        obj = {"id": row["id"], "status": row["status"], "to": row["party"], "message": row["message"],
               "answer_schema": json.loads(row["answer_schema"]) if row["answer_schema"] is not None else None,
               "digest": row["digest"]}
        return self.links.shown(obj, row, caller) if row["status"] == RequestStatus.OPEN else obj

    async def elicitation_declined(self, caller: Caller, playbook: str, run_id: str, mode: str, action: str) -> None:
        """The person at an MCP client declined (or dismissed) the question there: the request stays
        open, and its run's history says so."""
        now = self.clock.now_ms()

        def change(tx: Tx, fx: Effects) -> None:
            row = tx.request(playbook, run_id)
            if row is not None and row["status"] == RequestStatus.OPEN:
                tx.append_event(fx, playbook, run_id, "elicitation_declined", now, caller.by,
                                {"mode": mode, "action": action})
        await self.store.write(change)

    async def answer_interaction(self, caller: Caller, playbook: str, run_id: str, answer: Any,
                                 claimed_for: str | None = None,
                                 idempotency: IdempotencyKey | None = None,
                                 digest: Any = None) -> tuple[dict[str, Any], bool]:
        """Record the answer of an open request and end its run. Returns the fact and whether it is new.

        Under an idempotency key (the typed API) it returns the key's response in place of the fact: a new
        answer keeps `idempotency.response(closed request)` under the key in its own transaction; a key
        used before returns its first response (not new), or idempotency_key_conflict when it came with
        another request; a request this key did not answer is `not_open` (or `answered`)."""
        caller.require(Role.WRITER)
        by = caller.by
        if claimed_for is not None and (not isinstance(claimed_for, str) or len(claimed_for.encode()) > MAX_CLAIM_BYTES):
            raise ended("invalid_input", f"claimed_for is a text of at most {MAX_CLAIM_BYTES} bytes",
                                 errors=[{"pointer": "/claimed_for", "message": f"a text of at most {MAX_CLAIM_BYTES} bytes"}])
        if json_depth(answer) > MAX_JSON_DEPTH or json_size(answer) > MAX_ANSWER_BYTES:
            raise ended("invalid_input", f"the answer takes at most {MAX_ANSWER_BYTES // KIB} KiB as JSON",
                                 errors=[{"pointer": "/answer", "message": f"at most {MAX_ANSWER_BYTES // KIB} KiB as JSON, {MAX_JSON_DEPTH} levels"}])
        refuse_nul(answer, "/answer", "the answer")
        if claimed_for is not None:
            refuse_nul(claimed_for, "/claimed_for", "claimed_for")
        # An API token or a configured secret pasted into an answer is never recorded: the answer is
        # checked and kept as scrubbed (by value, so the answer schema's own keys stand).
        answer = self.tools.scrub.values(answer)
        if claimed_for is not None:
            claimed_for = self.tools.scrub.text(claimed_for)
        now = self.clock.now_ms()

        # One hop to the writer: the request is read, checked and answered in one change (a read
        # first and then the write cost a second thread hop, the larger part of an answer's latency).
        def change(tx: Tx, fx: Effects) -> tuple[dict[str, Any], bool]:
            row = tx.request(playbook, run_id)
            who = caller
            if row is not None and not who.addressed(row):     # a deputy's, while their window is open
                who = replace(caller, stands_for=tuple(tx.standing_for(playbook, caller.person, now)))
            if row is None or not who.addressed(row):
                raise not_found(f"no request of run {run_id} in this playbook")
            if idempotency is not None:
                # Looked up in the answer's own transaction: a concurrent call under the same key that
                # committed first is replayed here, and no other change can take the key before this one.
                first = self._first_response(tx.idempotent_response(idempotency.caller, idempotency.key), idempotency)
                if first is not None:
                    return first, False
            if self._answer_state_check(row, answer):
                if idempotency is not None:
                    raise Problem("not_open", "the request has ended (answered)", kind=row["status"])
                return answer_fact(row), False
            if row["approval"] is not None:
                self.approvals.may_answer(who, row)
            errors = answer_errors(row, answer, digest)
            if errors:
                raise ended("invalid_input", "the answer does not match the request's answer schema",
                                     errors=errors)
            closed = self.record_answer(tx, fx, row, answer, claimed_for, by, now, by_name=caller.by_name,
                                        on_behalf_of=who.on_behalf_of(row))
            if idempotency is None:
                return answer_fact(closed), True
            response = idempotency.response(closed)
            tx.remember_response(caller=idempotency.caller, key=idempotency.key, body_sha=idempotency.body_sha,
                                 response=response, now=now)
            return response, True
        return await self.store.write(change)

    async def replayed(self, key: IdempotencyKey) -> dict[str, Any] | None:
        """The response first given under `key` (a replay), or None when the key is new; the problem
        idempotency_key_conflict when the key came with another request."""
        return self._first_response(await self.store.read(lambda tx: tx.idempotent_response(key.caller, key.key)), key)

    @staticmethod
    def _first_response(seen: Row | None, key: IdempotencyKey) -> dict[str, Any] | None:
        """Decide a key by what the store kept under it (`seen`): its first response, None, or a conflict."""
        if seen is None:
            return None
        if seen["body_sha"] != key.body_sha:
            raise Problem("idempotency_key_conflict",
                          "this Idempotency-Key was used with another request; use a new key for a new response",
                          code="idempotency_key_conflict")
        return json.loads(seen["response"])

    def record_answer(self, tx: Tx, fx: Effects, row: Row, answer: Any, claimed_for: str | None, by: str,
                       now: int, *, reply_id: str | None = None, reply_sender: str | None = None,
                       by_name: str | None = None, on_behalf_of: str | None = None) -> Row:
        """The one fact of an answer: request_answered, the request closed, the run succeeded. Who gave
        it in words (`by_name`) is the caller's name, or a reply's sender; a deputy's answer names whom
        they stood for (`on_behalf_of`).

        Returns the closed request's row (its answer columns filled)."""
        by_name = by_name if by_name is not None else reply_sender
        if row["approval"] is not None:        # an approval: its call follows, or the run ends declined
            return self.approvals.answered(tx, fx, row, answer, claimed_for, by, now, reply_id=reply_id,
                                           by_name=by_name, on_behalf_of=on_behalf_of)
        return tx.answer_request(fx, row, answer, by=by, now=now, claimed_for=claimed_for, reply_id=reply_id,
                                 reply_sender=reply_sender, by_name=by_name, on_behalf_of=on_behalf_of)

    @staticmethod
    def _answer_state_check(req: Row, answer: Any) -> bool:
        """True when the request already took this very answer; raises when it takes none."""
        if req["answer_schema"] is None:
            raise Problem("notification", "a notification takes no answer", kind="notification")
        if req["status"] == RequestStatus.ANSWERED:
            if json.loads(req["answer"]) == answer:
                return True
            raise Problem("answered", "the request already took a different answer; a run takes one answer",
                          kind="answered")
        if req["status"] != RequestStatus.OPEN:
            raise Problem("not_open", f"the request has ended ({req['status']})", kind=req["status"])
        if req["delivery_state"] == DeliveryState.CANCELLING.value:
            raise Problem("not_open", "the run is being cancelled", kind="cancelling")
        return False



    # -- deputies -------------------------------------------------------------------------------

    async def deputized(self, caller: Caller, playbook: str) -> Caller:
        """A person's caller with whom they stand for now, on the daemon's clock (their deputies' open
        windows); anyone else's as it is."""
        if caller.person is None:
            return caller
        now = self.clock.now_ms()
        stands = await self.store.read(lambda tx: tx.standing_for(playbook, caller.person, now))
        return replace(caller, stands_for=tuple(stands)) if stands else caller

    def deputy_object(self, row: Row) -> dict[str, Any]:
        now = self.clock.now_ms()
        return {"id": row["id"], "playbook": row["playbook"], "for": row["for_person"], "to": row["to_person"],
                "from": fmt_time(row["starts_at"]), "until": fmt_time(row["ends_at"]),
                "open": (row["starts_at"] is None or row["starts_at"] <= now)
                and (row["ends_at"] is None or now < row["ends_at"]),
                "created_at": fmt_time(row["created_at"]), "created_by": row["created_by"]}

    async def add_deputy(self, caller: Caller, playbook: str, body: Any) -> dict[str, Any]:
        """A deputy (operator): `to` answers what is addressed to `for` from `from` (default: now) until
        `until` (default: until removed), RFC 3339 times on the daemon's clock."""
        caller.require(Role.OPERATOR)
        if not isinstance(body, dict):
            raise Problem("invalid_request", "the body is an object: {for, to, from?, until?}",
                          errors=[{"pointer": "", "message": "an object: {for, to, from?, until?}"}])
        errors = [{"pointer": f"/{k}", "message": "not a key of a deputy (for, to, from, until)"}
                  for k in body if k not in ("for", "to", "from", "until")]
        names: dict[str, str] = {}
        for key in ("for", "to"):
            try:
                names[key] = person_name(body.get(key))
            except ValueError as exc:
                errors.append({"pointer": f"/{key}", "message": str(exc)})
        times: dict[str, int | None] = {"from": None, "until": None}
        for key in times:
            if body.get(key) is not None:
                try:
                    times[key] = parse_rfc3339(body[key])
                except ValueError as exc:
                    errors.append({"pointer": f"/{key}", "message": str(exc)})
        if len(names) == 2 and names["for"] == names["to"]:
            errors.append({"pointer": "/to", "message": "a person is not their own deputy"})
        if times["from"] is not None and times["until"] is not None and times["until"] <= times["from"]:
            errors.append({"pointer": "/until", "message": "until comes after from"})
        if errors:
            raise Problem("invalid_request", "the deputy is not valid", errors=errors)
        now = self.clock.now_ms()
        deputy_id = "dep_" + new_ulid()

        def change(tx: Tx, fx: Effects) -> Row:
            tx.add_deputy(deputy_id=deputy_id, playbook=playbook, for_person=names["for"], to_person=names["to"],
                          starts_at=times["from"], ends_at=times["until"], now=now, by=caller.by)
            tx.append_event(fx, playbook, None, "deputy_added", now, caller.by,
                            {"id": deputy_id, "for": names["for"], "to": names["to"],
                             "from": fmt_time(times["from"]), "until": fmt_time(times["until"])})
            return {"id": deputy_id, "playbook": playbook, "for_person": names["for"], "to_person": names["to"],
                    "starts_at": times["from"], "ends_at": times["until"], "created_at": now, "created_by": caller.by}
        return self.deputy_object(await self.store.write(change))

    async def list_deputies(self, caller: Caller, playbook: str) -> dict[str, Any]:
        caller.require(Role.OPERATOR)
        rows = await self.store.read(lambda tx: tx.deputies(playbook))
        return {"data": [self.deputy_object(r) for r in rows], "page": {"has_more": False, "next_cursor": None}}

    async def remove_deputy(self, caller: Caller, playbook: str, deputy_id: str) -> dict[str, Any]:
        caller.require(Role.OPERATOR)
        now = self.clock.now_ms()

        def change(tx: Tx, fx: Effects) -> Row | None:
            row = tx.remove_deputy(playbook, deputy_id)
            if row is not None:
                tx.append_event(fx, playbook, None, "deputy_removed", now, caller.by,
                                {"id": deputy_id, "for": row["for_person"], "to": row["to_person"]})
            return row
        row = await self.store.write(change)
        if row is None:
            raise not_found(f"no deputy {deputy_id} in this playbook")
        return self.deputy_object(row)

    # -- events ---------------------------------------------------------------------------------

    async def list_run_events(self, caller: Caller, playbook: str, run_id: str, limit: Any = None,
                              cursor: str | None = None) -> dict[str, Any]:
        n = check_limit(limit)
        after = decode_cursor(cursor)[0] if cursor else 0
        def read(tx: Tx) -> list[Row] | None:
            return tx.run_events(playbook, run_id, after=after, limit=n + 1) if tx.run(playbook, run_id) else None
        rows = await self.store.read(read)
        if rows is None:
            raise not_found(f"no run {run_id} in this playbook")
        return _page([event_object(r) for r in rows[:n]], rows, n, lambda: [rows[n - 1]["id"]])

    async def list_playbook_events(self, caller: Caller, playbook: str, type_: str | None = None, limit: Any = None,
                                   cursor: str | None = None) -> dict[str, Any]:
        n = check_limit(limit)
        after = decode_cursor(cursor)[0] if cursor else 0
        rows = await self.store.read(lambda tx: tx.playbook_events(playbook, type_=type_, after=after, limit=n + 1))
        return _page([event_object(r) for r in rows[:n]], rows, n, lambda: [rows[n - 1]["id"]])

    async def get_event(self, caller: Caller, playbook: str, event_id: str) -> dict[str, Any]:
        eid = parse_event_id(event_id)
        row = await self.store.read(lambda tx: tx.event(playbook, eid))
        if row is None:
            raise not_found(f"no event {event_id} in this playbook")
        return event_object(row, whole=True)

    async def elicitation_refused(self, caller: Caller, playbook: str, run_id: str, key: str,
                                  refused: Problem) -> None:
        """An answer given at an MCP client for an MCP task's question (its key) did not fit: the key
        is spent, and the next ask says why (the run's history keeps the daemon's words, not the answer)."""
        now = self.clock.now_ms()

        def change(tx: Tx, fx: Effects) -> None:
            row = tx.request(playbook, run_id)
            if row is not None and row["status"] == RequestStatus.OPEN:
                tx.append_event(fx, playbook, run_id, EventType.ELICITATION_REFUSED.value, now, caller.by,
                                {"key": key, "request": row["id"], "detail": refused.detail,
                                 "errors": refused.errors or []})
        await self.store.write(change)

    async def task_view(self, caller: Caller, playbook: str, run_id: str) -> dict[str, Any]:
        """What an MCP task shows of a run besides the run: its request's party and expiry (ms, when
        the caller may see the request), when the run was created and last changed (ms), and the
        events that say how its questions at MCP clients went (declined, refused, the task cancelled)."""
        kept = {EventType.ELICITATION_DECLINED.value, EventType.ELICITATION_REFUSED.value,
                EventType.MCP_TASK_CANCELLED.value}

        def read(tx: Tx) -> tuple[Row | None, Row | None, list[Row]]:
            rows: list[Row] = []
            while len(rows) < 50 * MAX_PAGE:
                page = tx.run_events(playbook, run_id, after=rows[-1]["id"] if rows else 0, limit=MAX_PAGE)
                rows.extend(page)
                if len(page) < MAX_PAGE:
                    break
            return tx.run(playbook, run_id), tx.request(playbook, run_id), rows
        run, req, rows = await self.store.read(read)
        if run is None:
            raise not_found(f"no run {run_id} in this playbook")
        seen = req is not None and caller.addressed(req)
        return {"created_at": run["created_at"],
                "updated_at": max([run["created_at"], run["ended_at"] or 0, *(r["at"] for r in rows)]),
                "party": req["party"] if seen else None, "expires_at": req["expires_at"] if seen else None,
                "events": [{"type": r["type"], "by": r["by"], "payload": loads(r["payload"])}
                           for r in rows if r["type"] in kept]}


async def write_attempt_end(store: Store, end: Callable[[Any, Effects], None]) -> None:
    """Write an attempt's end (a delivery's, a telling's), again after a pause while the database
    refuses it for a moment: the message went out, and an attempt whose end is never written counts
    as lost a minute later and is sent again - the person would read it twice. An end is guarded by
    the attempt it ends, so one already written (or counted lost meanwhile) is left as it is."""
    for pause in (*ATTEMPT_END_RETRY_S, None):
        try:
            await store.write(end)
            return
        except Problem as exc:
            if pause is None or exc.kind not in ("database_busy", "database_unreachable"):
                raise
            log.warning("the end of an attempt could not be written (%s); trying again in %.1f s", exc.detail, pause)
            await asyncio.sleep(pause)


class Deliveries:
    """Sending requests through a tool: attempts, retries, lost attempts. A delivered question whose
    replies are read joins its conversation's reading (`readings`)."""

    def __init__(self, store: Store, clock: Clock, tools: ToolServers, definitions: Definitions,
                 readings: Readings) -> None:
        self.store = store
        self.clock = clock
        self.tools = tools
        self.definitions = definitions
        self.readings = readings
        self._inflight: set[tuple[str, str]] = set()     # attempts running in this process

    # -- delivery -------------------------------------------------------------------------------
    #
    # An attempt is two transactions around one tool call. The first records delivery_started
    # (size and digest of the arguments) and arms a `lost` timer a minute ahead; the second records
    # how it ended and schedules what follows. A restart between the two leaves the `lost` timer,
    # which counts the attempt as failed and schedules the next. No transaction spans the call.

    async def attempt(self, playbook: str, run_id: str, key: str) -> None:
        now = self.clock.now_ms()

        def begin(tx: Tx, fx: Effects) -> Row | None:
            if not tx.take_timer(fx, key, now):
                return None
            req = tx.begin_attempt(playbook, run_id, now=now)
            if req is None:
                return None
            args = req["deliver_args"]
            tx.append_event(fx, playbook, run_id, "delivery_started", now, "interactiond", {
                "attempt": req["attempts"], "server": req["server"], "tool": req["tool"],
                "arguments_size": len(args.encode()), "arguments_sha256": sha256_hex(args)})
            tx.set_timer(fx, timer_key("lost", playbook, run_id), now + LOST_ATTEMPT_S * 1000)
            return req

        req = await self.store.write(begin)
        if req is None:
            return
        self._inflight.add((playbook, run_id))
        try:
            outcome = await self.send(req)
        finally:
            self._inflight.discard((playbook, run_id))
        await self._end_attempt(req, outcome)

    async def send(self, req: Row) -> dict[str, Any]:
        """One call of the sending tool; what happened, as the attempt's end records it."""
        playbook, server, tool = req["playbook"], req["server"], req["tool"]
        args = json.loads(req["deliver_args"])
        if len(req["deliver_args"].encode()) > MAX_ARGUMENTS_BYTES:
            return {"refused": "too_large", "message": f"the arguments pass {MAX_ARGUMENTS_BYTES // KIB} KiB"}
        try:
            result = await self.tools.call(playbook, req["run_id"], server, tool, args)
        except ToolFailure as exc:
            if exc.because in ("tool_not_offered", "gated"):   # refused at the door: nothing was called
                return {"because": "tool_not_offered", "message": exc.message}
            because = {"server_failure": "server_failure", "timed_out": "timed_out",
                       "arguments_refused": "arguments_refused"}.get(exc.because, "server_failure")
            return {"because": because, "message": self.tools.scrub(exc.message), "retry_after_ms": exc.retry_after_ms}
        wire = result_wire(result)
        if result.is_error:
            return {"because": "tool_error", "message": self.tools.scrub(_result_text(result)),
                    "retry_after_ms": result_retry_after(result)}
        has, answer = result_answer(result)
        return {"ok": True, "answer": answer if has else None, "result_size": json_size(wire),
                "result_sha256": sha256_hex(dumps(wire))}

    async def _end_attempt(self, req: Row, outcome: dict[str, Any]) -> None:
        playbook, run_id = req["playbook"], req["run_id"]
        _, doc = await self.definitions.document(playbook, req["type"], req["name"], req["version"])
        now = self.clock.now_ms()
        sent_conv = sent_id = conversation = None
        if outcome.get("ok") and doc.deliver.sent is not None:
            sent_conv = _sent_value(outcome["answer"], doc.deliver.sent.conversation)
            sent_id = _sent_value(outcome["answer"], doc.deliver.sent.id)
            if sent_conv is not None and sent_id is not None and doc.replies is not None:
                try:
                    key = doc.replies.conversation.render_text(
                        {"to": req["party"], "sent": {"conversation": sent_conv, "id": sent_id}})
                except RenderError:
                    key = ""
                conversation = key if _valid_key(key) else None

        def attempt_ended(tx: Tx, fx: Effects) -> None:
            row = tx.request_by_seq(req["seq"])
            if row["attempts"] != req["attempts"] or row["delivery_state"] not in (DeliveryState.DELIVERING, DeliveryState.CANCELLING):
                return                                  # counted lost meanwhile; this end is stale
            tx.drop_timer(fx, timer_key("lost", playbook, run_id))
            attempt = row["attempts"]
            if outcome.get("ok"):
                payload: dict[str, Any] = {"attempt": attempt, "result_size": outcome["result_size"],
                                           "result_sha256": outcome["result_sha256"]}
                if doc.deliver.sent is not None:
                    payload["delivered_as"] = ({"conversation": sent_conv, "id": sent_id}
                                               if sent_conv is not None and sent_id is not None else None)
                    if doc.replies is not None:
                        payload["replies_read_at"] = conversation
                tx.append_event(fx, playbook, run_id, "delivery_succeeded", now, "interactiond", payload)
                tx.end_attempt(row["seq"], attempt, DeliveryState.DELIVERED, sent_conversation=sent_conv,
                               sent_id=sent_id, conversation=conversation)
            elif "refused" in outcome:
                tx.append_event(fx, playbook, run_id, "delivery_refused", now, "interactiond",
                                {"attempt": attempt, "because": outcome["refused"], "message": outcome["message"]})
                tx.end_attempt(row["seq"], attempt, DeliveryState.UNDELIVERED)
            else:
                tx.append_event(fx, playbook, run_id, "delivery_failed", now, "interactiond",
                                {"attempt": attempt, "because": outcome["because"], "message": outcome.get("message"),
                                 "retry_after_ms": outcome.get("retry_after_ms")})
            if row["delivery_state"] == DeliveryState.CANCELLING or row["status"] != RequestStatus.OPEN:
                if row["delivery_state"] == DeliveryState.CANCELLING and row["status"] == RequestStatus.OPEN:
                    end_cancelled(tx, fx, playbook, run_id, now=now, by="interactiond")
                return
            if outcome.get("ok"):
                if row["answer_schema"] is None:
                    end(tx, fx, playbook, run_id, "notified", now=now, by="interactiond", output={})
                elif conversation is not None:
                    self.readings.join_reading(tx, fx, row, doc, conversation, now)
                return
            self._after_failed_attempt(tx, fx, row, now, outcome.get("retry_after_ms"),
                                       spent="refused" in outcome)
        await write_attempt_end(self.store, attempt_ended)

    def _after_failed_attempt(self, tx: Tx, fx: Effects, row: Row, now: int,
                              retry_after_ms: int | None, spent: bool = False) -> None:
        """Schedule the next attempt, or give up: a notification ends undelivered, a question stays open."""
        playbook, run_id = row["playbook"], row["run_id"]
        if not spent and row["attempts"] < MAX_ATTEMPTS:
            tx.fail_attempt(row["seq"], spent=False)
            tx.set_timer(fx, timer_key("attempt", playbook, run_id),
                         next_attempt_at(row["attempts"], row["attempt_started_at"], now, retry_after_ms))
            return
        tx.fail_attempt(row["seq"], spent=True)         # a refused attempt has ended undelivered already
        if row["answer_schema"] is None:
            end(tx, fx, playbook, run_id, "undelivered", "every attempt to deliver the notification failed",
                now=now, by="interactiond")

    async def lost(self, playbook: str, run_id: str, key: str) -> None:
        """An attempt with no recorded end a minute after it started counts as failed."""
        if (playbook, run_id) in self._inflight:
            return                                   # still running here; its end will be recorded
        now = self.clock.now_ms()

        def change(tx: Tx, fx: Effects) -> None:
            if tx.attempt_elsewhere(playbook, run_id):
                return                          # a live daemon's attempt: its end is that daemon's to record
            if not tx.take_timer(fx, key, now):
                return
            row = tx.request(playbook, run_id)
            if row is None or row["delivery_state"] not in (DeliveryState.DELIVERING, DeliveryState.CANCELLING):
                return
            tx.append_event(fx, playbook, run_id, "delivery_failed", now, "interactiond",
                            {"attempt": row["attempts"], "because": "lost",
                             "message": "the attempt had no recorded end a minute after it started (the daemon restarted)",
                             "retry_after_ms": None})
            if row["delivery_state"] == DeliveryState.CANCELLING:
                end_cancelled(tx, fx, playbook, run_id, now=now, by="interactiond")
            elif row["status"] == RequestStatus.OPEN:
                self._after_failed_attempt(tx, fx, row, now, None)
        await self.store.write(change)


class Readings:
    """Reading replies in conversations and taking answers from them: an answer found is recorded
    as `inbox` records any answer."""

    def __init__(self, store: Store, clock: Clock, tools: ToolServers, definitions: Definitions,
                 inbox: Inbox) -> None:
        self.store = store
        self.clock = clock
        self.tools = tools
        self.definitions = definitions
        self.inbox = inbox
        #: `observe("read", playbook, ok or why it failed)` after each read (Engine.observe sets it).
        self.observe: Callable[[str, str, str], None] | None = None

    # -- reading replies --------------------------------------------------------------------------
    #
    # Open requests whose replies are read share one reading per (playbook, server, reading tool,
    # conversation key). A read is one call; everything it finds - answers taken, replies refused,
    # the new `since` and every message id dealt with - is written in ONE transaction, so a reply is
    # taken once and only once, across restarts. Tellings follow the commit, each its own call.

    def join_reading(self, tx: Tx, fx: Effects, req: Row, doc: Any, conversation: str,
                      now: int) -> None:
        replies = doc.replies
        reading = tx.join_reading(req["seq"], playbook=req["playbook"], server=req["server"], tool=replies.tool,
                                  conversation=conversation, wait_ms=int(replies.wait.total_seconds() * 1000))
        key = timer_key("read", req["playbook"], str(reading["id"]))
        due = now + max(READ_GAPS_S[0] * 1000, reading["wait_ms"])
        current = tx.timer_due(key)
        if current is None or current > due:
            tx.set_timer(fx, key, due)

    async def read(self, playbook: str, reading_id: int, key: str) -> None:
        now = self.clock.now_ms()

        def load(tx: Tx) -> tuple[Row, list[Row], list[str]] | None:
            due = tx.timer_due(key)
            if due is None or due > now:
                return None
            return tx.reading(reading_id), tx.reading_requests(reading_id), tx.sent_ids(reading_id)
        loaded = await self.store.read(load)
        if loaded is None:
            return
        reading, reqs, own = loaded
        if not reqs:
            await self.store.write(lambda c, fx: c.take_timer(fx, key, now))
            return
        if not await self.store.claim(key, due_by=now):
            return                                  # another daemon reads the conversation (or has read it)
        oldest = reqs[0]
        # Requests of different functions (or versions) may share a conversation: each reply is
        # read by its own request's reply rule, so every document they need is loaded now.
        docs = {}
        for r in reqs:
            key_ = (r["playbook"], r["type"], r["name"], r["version"])
            if key_ not in docs:
                docs[key_] = (await self.definitions.document(*key_))[1]
        doc = docs[(oldest["playbook"], oldest["type"], oldest["name"], oldest["version"])]
        replies = doc.replies
        ctx = {"to": oldest["party"], "sent": {"conversation": oldest["sent_conversation"], "id": oldest["sent_id"]},
               "conversation": reading["conversation"], "since": reading["since"]}
        event: dict[str, Any] = {"server": reading["server"], "tool": reading["tool"],
                                 "conversation": reading["conversation"]}
        failure: dict[str, Any] | None = None
        messages: list[Any] = []
        try:
            args = render_args(replies.with_, ctx)
            if json_size(args) > MAX_ARGUMENTS_BYTES:
                raise RenderError("limit", f"the reading arguments pass {MAX_ARGUMENTS_BYTES // KIB} KiB")
        except RenderError as exc:
            failure = {"because": "unworkable", "message": str(exc)}
        else:
            try:
                result = await self.tools.call(playbook, oldest["run_id"], reading["server"], reading["tool"], args)
            except ToolFailure as exc:
                failure = {"because": exc.because, "message": self.tools.scrub(exc.message),
                           "retry_after_ms": exc.retry_after_ms}
            else:
                failure, messages = _read_messages(result, replies.read)
        done = self.clock.now_ms()
        tellings: list[tuple[Row, str]] = []

        def change(tx: Tx, fx: Effects) -> None:
            tx.release_lease(key)
            if not tx.take_timer(fx, key, now):
                return
            if failure is not None:
                tx.append_event(fx, playbook, None, "reading_failed", done, "interactiond", {**event, **failure})
                if failure["because"] != "gated":       # a gated reading tool is never called: the reading stops
                    self._next_read(tx, fx, reading_id, key, done, failure.get("retry_after_ms"))
                return
            self._take_replies(tx, fx, reading, messages, own, replies, event, done, tellings, docs)
            self._next_read(tx, fx, reading_id, key, done, None)
        await self.store.write(change)
        if self.observe is not None:
            self.observe("read", playbook, failure["because"] if failure is not None else "ok")
        for req, text in tellings:
            await self._tell(req, text)

    def _next_read(self, tx: Tx, fx: Effects, reading_id: int, key: str, now: int,
                   retry_after_ms: int | None) -> None:
        reading = tx.count_read(reading_id)
        if not tx.reading_waited_on(reading_id):
            return                                                  # nobody waits: the reading rests
        n = reading["reads"]
        gap = (READ_GAPS_S[n] if n < len(READ_GAPS_S) else READ_GAP_LATE_S) * 1000
        gap = max(gap, reading["wait_ms"])
        if retry_after_ms is not None:
            gap = max(gap, min(int(retry_after_ms), MAX_RETRY_AFTER_READ_S * 1000))
        tx.set_timer(fx, key, now + gap)

    def _take_replies(self, tx: Tx, fx: Effects, reading: Row, messages: list[dict[str, Any]],
                      own: list[str], replies: Any, event: dict[str, Any], now: int,
                      tellings: list[tuple[Row, str]], docs: dict[tuple[str, str, str, int], Any]) -> None:
        """Deal with one read's messages, oldest first, in the read's one transaction. `docs` holds
        the document of every request open in the reading when it was loaded; one that joined since
        is parsed here from its definition row."""
        def doc_of(req: Row) -> Any:
            key = (req["playbook"], req["type"], req["name"], req["version"])
            if key not in docs:
                source = tx.definition_source(*key)
                docs[key] = self.definitions.parsed(*key, source) if source is not None else None
            return docs[key]

        playbook = reading["playbook"]
        since = reading["since"]
        counted = taken = refused = 0
        has_to = "to" in replies.read.each
        open_reqs = list(tx.reading_requests(reading["id"]))      # once a read; an answered one leaves it
        for m in messages:
            if m["id"] is None:
                continue
            since = m["id"]
            if m["id"] in own:
                continue                                   # the playbook's own message
            if not tx.see_reply(reading["id"], m["id"]):
                continue                                   # dealt with by an earlier read
            if m["sender"] is None:
                continue
            counted += 1
            target = None
            if has_to and m.get("to") is not None:
                target = next((r for r in open_reqs if r["sent_id"] == m["to"]), None)
                if target is None:
                    continue                               # answers none of the open requests
            elif len(open_reqs) == 1:
                target = open_reqs[0]
            if target is None:
                mine = [r for r in open_reqs if may_reply(r, m["sender"])]
                if mine:
                    refused += 1
                    self._refuse(tx, fx, mine[0], doc_of(mine[0]), m["id"], "several requests are open here", now,
                                 tellings,
                                 "Several questions are open in this conversation: reply in the thread of the one you answer.")
                continue
            if not may_reply(target, m["sender"]):
                continue                                   # only the answerer's replies count (and the escalation's)
            if target["approval"] is not None and m["sender"] == json.loads(target["approval"]).get("asked_by_person"):
                refused += 1                               # four eyes: the person who started the call does not approve it
                self._refuse(tx, fx, target, doc_of(target), m["id"], "the approval's own asker replied", now, tellings,
                             "You started this call, so another person approves it.")
                continue
            text = m["text"] if isinstance(m["text"], str) else ""
            if len(text.encode()) > MAX_REPLY_BYTES:
                refused += 1
                self._refuse(tx, fx, target, doc_of(target), m["id"], "the reply is too long", now, tellings,
                             f"Your reply is longer than {MAX_REPLY_BYTES // KIB} KiB, the most a reply may hold.")
                continue
            doc_rule = doc_of(target)
            rule = doc_rule.reply_rule if doc_rule is not None else None
            answer, reasons = rule.apply(text) if rule is not None else (None, ["no reply rule"])
            if answer is not None:
                errors = answer_errors(target, answer)
                if errors:
                    reasons = [f"{e['pointer']}: {e['message']}" for e in errors]
                    answer = None
            if answer is None:
                refused += 1
                how = rule.how_to_answer() if rule is not None else ""
                self._refuse(tx, fx, target, doc_rule, m["id"], "; ".join(reasons), now, tellings,
                             ("Your reply could not be taken: " + "; ".join(reasons) + ". " + how).strip())
                continue
            try:
                took = self.inbox.record_answer(tx, fx, target, answer, None, f"playbook:{playbook}", now,
                                                reply_id=m["id"], reply_sender=m["sender"])
            except Problem as exc:                     # a quorum's vote it refuses (a second one, a change)
                if exc.name not in ("answered", "arguments_changed", "approval_not_yours"):
                    raise
                refused += 1
                self._refuse(tx, fx, target, doc_rule, m["id"], exc.detail, now, tellings,
                             f"Your reply could not be taken: {exc.detail}.")
                continue
            taken += 1
            at = open_reqs.index(target)
            open_reqs.remove(target)
            if took["status"] == RequestStatus.OPEN.value:     # one vote of a quorum: it stays open for the rest
                open_reqs.insert(at, tx.request(target["playbook"], target["run_id"]))
        tx.read_up_to(reading["id"], since)
        if counted:
            tx.append_event(fx, playbook, None, "replies_read", now, "interactiond",
                            {**event, "replies": counted, "taken": taken, "refused": refused, "since": since})

    def _refuse(self, tx: Tx, fx: Effects, req: Row, doc: Any, reply_id: str, reason: str,
                now: int, tellings: list[tuple[Row, str]], telling: str) -> None:
        row = tx.count_refusal(req["seq"])
        if row["refused_replies"] <= MAX_REFUSED_RECORDED:
            tx.append_event(fx, req["playbook"], req["run_id"], "reply_refused", now, "interactiond",
                            {"reply": {"id": reply_id}, "reason": reason[:500]})
        if doc is not None and doc.replies.tell is not None and row["told"] < MAX_REFUSED_TOLD:
            tx.count_telling(req["seq"])
            tellings.append((req, telling))

    async def _tell(self, req: Row, telling: str) -> None:
        _, doc = await self.definitions.document(req["playbook"], req["type"], req["name"], req["version"])
        tell = doc.replies.tell
        playbook = req["playbook"]
        base = {"server": req["server"], "tool": tell.tool, "run_id": req["run_id"]}
        ctx = {"to": req["party"], "sent": {"conversation": req["sent_conversation"], "id": req["sent_id"]},
               "message": telling}
        try:
            args = render_args(tell.with_, ctx)
            if json_size(args) > MAX_ARGUMENTS_BYTES:
                raise RenderError("limit", "the telling's arguments pass 16 KiB")
        except RenderError as exc:
            now, failed = self.clock.now_ms(), {**base, "because": "unworkable", "message": str(exc)}
            await self.store.write(lambda c, fx: c.append_event(fx, playbook, None, "telling_failed", now, "interactiond",
                                                              failed))
            return
        now = self.clock.now_ms()
        await self.store.write(lambda c, fx: c.append_event(fx, playbook, None, "telling_started", now, "interactiond",
                                                          {**base, "arguments_size": json_size(args)}))
        outcome: dict[str, Any]
        try:
            result = await self.tools.call(playbook, req["run_id"], req["server"], tell.tool, args)
            outcome = {"because": "tool_error", "message": _result_text(result)} if result.is_error else {}
        except ToolFailure as exc:
            outcome = {"because": exc.because, "message": self.tools.scrub(exc.message)}
        done = self.clock.now_ms()
        kind = "telling_failed" if outcome else "telling_succeeded"
        await self.store.write(lambda c, fx: c.append_event(fx, playbook, None, kind, done, "interactiond",
                                                          {**base, **outcome}))


def _approval_shown(text: str) -> dict[str, Any]:
    """The gate of an approval request as listings show it: the call proposed, and what may change;
    for a quorum, whom it asks, how many approvals it takes, and the votes so far."""
    gate = json.loads(text)
    shown = {"server": gate["server"], "tool": gate["tool"], "read_only": gate["read_only"],
             "arguments": gate["arguments"], "edit": gate["edit"]}
    if "quorum" in gate:
        shown.update(gate["quorum"], votes=_votes_shown(gate))
    return shown


def _votes_shown(gate: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"by": v["by"], "approved": v["approved"], "note": v["note"], "at": fmt_time(v["at"]),
             **({"on_behalf_of": v["on_behalf_of"]} if v.get("on_behalf_of") else {})} for v in gate.get("votes", [])]


class Approvals:
    """The approval gate on a system call (SPEC section 20): a part of the engine, made with what it uses.

    A gated call is a run whose request is the approval. The run renders and checks its arguments as
    any call does (unworkable as ever when they do not fit the tool), then ONE transaction inserts the
    run, opens its request - answer schema APPROVAL_ANSWER_SCHEMA, the gate on it (`requests.approval`:
    the call proposed, the arguments shown and kept, what may change, the tool's input schema) - and
    records `approval_requested`. The answer (answer_interaction, or a reply read by APPROVAL_RULE) is
    checked against the gate and, in the answer's own transaction, records `approval_answered` with
    its patch, then either ends the run declined, or keeps the approved arguments on the gate, puts
    the run back to started and arms a `call` timer. The call follows on the timer task as a
    function's call does: `tool_call_started` (the run's tool marked called, once) before it is sent,
    its answer or failure after. A restart before the timer fires makes the call then; a call cut off
    in flight ends its run as any cut-off call does (Engine.start).
    """

    def __init__(self, store: Store, clock: Clock, tools: ToolServers, calls: ToolCalls, open_limit: int,
                 spawn: Callable[[Any, str], Any], document: Callable[..., Any], links: AnswerLinks | None = None) -> None:
        self.store, self.clock, self.tools, self.calls = store, clock, tools, calls
        self.links = links or AnswerLinks("")          # answer links (no key: none shown)
        self.open_limit, self.spawn, self.document = open_limit, spawn, document

    def policy(self, server: str, tool: str) -> ApprovalPolicy | None:
        """The operator's gate on this tool (`servers.NAME.approve`), if any."""
        return self.tools.gated(server, tool)

    # -- asking ---------------------------------------------------------------------------------

    async def ask_function(self, caller: Caller, playbook: str, type_: str, name: str, version: int, doc: Any,
                           input_: Any, run_id: str, input_text: str, input_sha: str, parent: str | None,
                           arguments: Any, read_only: bool, schema: Any) -> tuple[dict[str, Any], bool]:
        """A run of a function whose call waits for approval: the run and its request, or its ending."""
        call, gate, policy = doc.call, doc.approve, self.policy(doc.call.server, doc.call.tool)
        now = self.clock.now_ms()
        ending: Problem | None = None
        prepared: dict[str, Any] = {}
        quorum: dict[str, Any] | None = None
        ctx = base_context(now, input=input_)
        try:
            party = policy.to if policy is not None else render_party(gate.to, ctx, "approve.to")
            if policy is None and gate.also:        # a quorum: each of `to`, once
                people = list(dict.fromkeys([party, *(render_party(t, ctx, "approve.to") for t in gate.also)]))
                if len(people) < gate.need:
                    raise ended("unworkable", f"approve.to names {len(people)} different people, and need is {gate.need}")
                quorum = {"to": people, "need": gate.need, "veto": gate.veto}
            request_id = "int_" + new_ulid()
            ctx["request"] = {"answer_url": self.links.url({"id": request_id, "playbook": playbook, "run_id": run_id,
                                                            "party": party})}
            message = (doc.message.render_text(ctx) if doc.message is not None else
                       f"The function **{name}** asks to call **{call.tool}** on the tool server **{call.server}**."
                       " Approve the call, or reject it.")
            expires = policy.expires if policy is not None else gate.expires
            prepared = {"party": party, "answerer": party, "message": message,
                        "expires_at": now + int(expires.total_seconds() * 1000),
                        "request_id": request_id, "request": ctx["request"], "answer_schema": APPROVAL_ANSWER_SCHEMA}
            if len(message.encode()) > MAX_MESSAGE_BYTES:
                raise ended("unworkable", f"the message is longer than {MAX_MESSAGE_BYTES // KIB} KiB")
            if doc.deliver is not None:
                prepared["deliver_args"] = deliver_args(doc, name, run_id, input_, prepared, now)
                ending = self.calls.check_offered(playbook, doc.deliver.server,
                                            [doc.deliver.tool] + ([doc.replies.tool] if doc.replies else [])
                                            + ([doc.replies.tell.tool] if doc.replies and doc.replies.tell else []))
        except RenderError as exc:
            ending = (ended("invalid_input", str(exc), errors=[{"pointer": "/input", "message": str(exc)}])
                      if exc.kind == "undefined" else ended("unworkable", str(exc)))
        except Problem as exc:
            ending = exc
        edit = list(gate.edit) if gate is not None else []
        shown = self._gate(call.server, call.tool, read_only, arguments, edit, schema)
        if quorum is not None:
            shown["quorum"] = quorum
        return await self._ask(caller, playbook, run_id, type_, name, version, input_text, input_sha, parent,
                               doc.deliver, prepared, shown, ending)

    async def ask_execute(self, caller: Caller, playbook: str, server: str, tool: str, arguments: dict[str, Any],
                          read_only: bool, schema: Any, approve: Any) -> dict[str, Any]:
        """`execute` of a gated tool (the operator's gate, or `approve` given): the started run to wait on."""
        policy = self.policy(server, tool)
        quorum = self._execute_quorum(approve) if policy is None else None
        if quorum is not None:
            approve = {**approve, "to": quorum["to"][0]}
        to, expires, edit = self._execute_gate(approve, arguments, needs_to=policy is None)
        if policy is not None:
            to, expires = policy.to, policy.expires
        now = self.clock.now_ms()
        input_ = {"server": server, "tool": tool, "arguments": self.tools.record(server, arguments)}
        input_text = dumps(input_)
        kind = "may only read" if read_only else "may change something"
        prepared = {"party": to, "answerer": to, "request_id": "int_" + new_ulid(),
                    "expires_at": now + int(expires.total_seconds() * 1000), "answer_schema": APPROVAL_ANSWER_SCHEMA,
                    "message": f"A call of **{tool}** on the tool server **{server}** (it {kind}) waits for approval."
                               " Approve the call, or reject it."}
        gate = self._gate(server, tool, read_only, arguments, edit, schema)
        if quorum is not None:
            gate["quorum"] = quorum
        run, _ = await self._ask(caller, playbook, new_run_id(), "execute", f"{server}/{tool}", 0, input_text,
                                 sha256_hex(input_text), None, None, prepared, gate, None)
        return run

    @staticmethod
    def _execute_quorum(approve: Any) -> dict[str, Any] | None:
        """`execute`'s `approve` naming a quorum - `to: [a, b, c]`, `need`, `veto` - checked; None when it
        names one person (`to` a text)."""
        if not isinstance(approve, dict) or not isinstance(approve.get("to"), list):
            for key in ("need", "veto"):
                if isinstance(approve, dict) and key in approve:
                    raise Problem("invalid_request", "approve is not valid", errors=[
                        {"pointer": f"/approve/{key}", "message": "goes with `to` as a list of people"}])
            return None
        errors = []
        people: list[str] = []
        for i, p in enumerate(approve["to"]):
            try:
                people.append(person_name(p))
            except ValueError as exc:
                errors.append({"pointer": f"/approve/to/{i}", "message": str(exc)})
        people = list(dict.fromkeys(people))
        if not 1 <= len(approve["to"]) <= MAX_QUORUM:
            errors.append({"pointer": "/approve/to", "message": f"1 to {MAX_QUORUM} people"})
        need, veto = approve.get("need", 1), approve.get("veto", True)
        if isinstance(need, bool) or not isinstance(need, int) or not 1 <= need <= max(len(people), 1):
            errors.append({"pointer": "/approve/need", "message": f"how many of the {len(people)} different people"
                                                                  f" in to must approve: 1 to {len(people)}"})
        if not isinstance(veto, bool):
            errors.append({"pointer": "/approve/veto", "message": "true or false"})
        if errors:
            raise Problem("invalid_request", "approve is not valid", errors=errors)
        return {"to": people, "need": need, "veto": veto}

    def _gate(self, server: str, tool: str, read_only: bool, arguments: Any, edit: list[str],
              schema: Any) -> dict[str, Any]:
        """What the request carries: the call, the arguments as shown (scrubbed) and as sent, what
        may change, and the tool's input schema an edit is checked against."""
        return {"server": server, "tool": tool, "read_only": read_only, "arguments": self.tools.scrub(arguments),
                "proposed": arguments, "edit": edit, "schema": schema}

    @staticmethod
    def _execute_gate(approve: Any, arguments: dict[str, Any],
                      needs_to: bool) -> tuple[str, timedelta, list[str]]:
        """`execute`'s own `approve: {to, expires, edit}`: checked, with P1D when expires is left out."""
        if approve is None:
            approve = {}
        if not isinstance(approve, dict):
            raise Problem("invalid_request", "approve is an object: {to, expires, edit}",
                          errors=[{"pointer": "/approve", "message": "an object: {to, expires, edit}"}])
        errors = [{"pointer": f"/approve/{k}", "message": "not a key of approve (to, expires, edit, need, veto)"}
                  for k in approve if k not in ("to", "expires", "edit", "need", "veto")]
        to = approve.get("to")
        if to is None and needs_to:
            errors.append({"pointer": "/approve/to", "message": "required: the person who approves the call"})
        elif to is not None and (not isinstance(to, str) or not to.strip() or has_control_char(to)
                                 or len(to.encode()) > MAX_PARTY_BYTES):
            errors.append({"pointer": "/approve/to", "message": f"a name of at most {MAX_PARTY_BYTES} bytes"})
        expires = timedelta(days=1)
        try:
            expires = parse_duration(approve.get("expires", "P1D"))
            if not EXPIRES_MIN <= expires <= EXPIRES_MAX:
                raise ValueError("it lies between PT1M and P30D")
        except ValueError as exc:
            errors.append({"pointer": "/approve/expires", "message": str(exc)})
        edit = approve.get("edit", [])
        if not isinstance(edit, list):
            errors.append({"pointer": "/approve/edit", "message": "a list of JSON Pointers into the arguments"})
            edit = []
        for i, p in enumerate(edit):
            try:
                if not isinstance(p, str) or p == "":
                    raise ValueError("a JSON Pointer to one argument, such as /service")
                pointer_get(arguments, p)
            except (ValueError, LookupError) as exc:
                errors.append({"pointer": f"/approve/edit/{i}", "message": str(exc) if isinstance(exc, ValueError)
                               else f"the arguments hold nothing at {p}"})
        if errors:
            raise Problem("invalid_request", "approve is not valid", errors=errors)
        return (to or "").strip(), expires, list(dict.fromkeys(edit))

    async def _ask(self, caller: Caller, playbook: str, run_id: str, type_: str, name: str, version: int,
                   input_text: str, input_sha: str, parent: str | None, deliver: DeliverSpec | None,
                   prepared: dict[str, Any], gate: dict[str, Any], ending: Problem | None) -> tuple[dict[str, Any], bool]:
        now = self.clock.now_ms()
        limit = self.open_limit
        server = gate["server"]
        requested = {"server": server, "tool": gate["tool"], "read_only": gate["read_only"],
                     "arguments": self.tools.record(server, gate["proposed"]),
                     "arguments_size": json_size(gate["proposed"]), "arguments_sha256": sha256_hex(dumps(gate["proposed"])),
                     "edit": gate["edit"], "to": prepared.get("party"), "expires_at": fmt_time(prepared.get("expires_at"))}

        def change(tx: Tx, fx: Effects) -> tuple[dict[str, Any], bool]:
            row = tx.run(playbook, run_id)
            if row is not None:
                return rerun_check(row, type_, name, input_sha), False
            tx.insert_run(playbook=playbook, run_id=run_id, type_=type_, name=name, version=version,
                          input_text=input_text, input_sha=input_sha, parent=parent, now=now, by=caller.id)
            ending_ = ending
            if ending_ is None and not tx.take_request_slot(playbook, limit):
                ending_ = ended("requests_full",
                                     f"the playbook already has {limit} open requests; answer or cancel some first")
            if ending_ is not None:
                end(tx, fx, playbook, run_id, ending_, now=now, by=caller.id)
                return run_object(tx.run(playbook, run_id)), True
            tx.append_event(fx, playbook, run_id, "approval_requested", now, caller.id, requested)
            tx.open_request(request_id=prepared["request_id"], playbook=playbook, run_id=run_id, type_=type_, name=name,
                            version=version, party=prepared["party"], answerer=prepared["answerer"],
                            message=prepared["message"], answer_schema=dumps(APPROVAL_ANSWER_SCHEMA),
                            server=deliver.server if deliver else None, tool=deliver.tool if deliver else None,
                            delivery=DeliveryState.IN_INBOX if deliver is None else DeliveryState.TO_DELIVER,
                            asked_at=now, expires_at=prepared["expires_at"],
                            deliver_args=dumps(prepared["deliver_args"]) if deliver else None,
                            digest=request_digest(prepared["message"], APPROVAL_ANSWER_SCHEMA, gate["arguments"]))
            tx.set_approval(playbook, run_id, dumps({**gate, "asked_by": caller.id, "asked_by_person": caller.person}))
            if "quorum" in gate:                # listing by `to` finds it under each addressee
                tx.add_addressees(playbook, run_id, [p for p in gate["quorum"]["to"] if p != prepared["party"]])
            tx.append_event(fx, playbook, run_id, "interaction_requested", now, caller.id, {
                "delivery": {"server": deliver.server, "tool": deliver.tool} if deliver else None,
                "to": prepared["party"], "from": prepared["answerer"],
                "message_size": len(prepared["message"].encode()), "takes_answer": True,
                "expires_at": fmt_time(prepared["expires_at"])})
            tx.set_timer(fx, timer_key("expire", playbook, run_id), prepared["expires_at"])
            if deliver is not None:
                tx.set_timer(fx, timer_key("attempt", playbook, run_id), now)
            return dict(run_object(tx.run(playbook, run_id)), status=RunStatus.STARTED.value), True
        return await self.store.write(change)

    # -- the answer -----------------------------------------------------------------------------

    @staticmethod
    def may_answer(caller: Caller, row: Row) -> None:
        """Four eyes: an approval is answered by its addressee (a person's caller it is addressed or
        escalated to) or by an operator, never by the caller that started the call - the same token or
        the same person. Anyone else: 403 approval_not_yours."""
        gate = json.loads(row["approval"])
        if caller.id == gate.get("asked_by") or (caller.person is not None and caller.person == gate.get("asked_by_person")):
            raise Problem("approval_not_yours", "this call was started by the same caller that answers its approval;"
                                                " another person (its addressee) or an operator approves it")
        if caller.role is not Role.OPERATOR and (caller.person is None or not caller.addressed(row)):
            raise Problem("approval_not_yours", f"this approval is addressed to {row['party']}: only that person"
                                                " (their session, token or answer link) or an operator answers it")

    def answered(self, tx: Tx, fx: Effects, row: Row, answer: Any, claimed_for: str | None, by: str, now: int,
                 reply_id: str | None = None, by_name: str | None = None, on_behalf_of: str | None = None) -> Row:
        """Inside the answer's change: take an approval's answer (it passed the answer schema). A change
        outside `edit`, or arguments the tool's schema refuses, is `invalid_input` and writes nothing."""
        playbook, run_id = row["playbook"], row["run_id"]
        gate = json.loads(row["approval"])
        approved = answer.get("approved") is True
        patch: list[dict[str, Any]] = []
        arguments = None
        if "quorum" in gate:                # one vote of several; the last one needed decides below
            voted = self._vote(tx, fx, row, gate, answer, claimed_for, by, now, reply_id, by_name, on_behalf_of)
            if not isinstance(voted, dict) or "decided" not in voted:
                return voted
            gate, patch, arguments = voted["gate"], voted["patch"], voted["arguments"]
            approved = voted["decided"]
        elif approved:
            patch, arguments = self._approved(gate, answer)
        tx.record_answer(fx, row, answer, by=by, now=now, claimed_for=claimed_for, reply_id=reply_id, by_name=by_name,
                         on_behalf_of=on_behalf_of)
        note = answer.get("note")
        if not approved:                # the run ends declined, its request closed as answered
            tx.append_event(fx, playbook, run_id, "approval_answered", now, by, {
                "approved": approved, "by": by, "patch": self.tools.record(gate["server"], patch), "note": note})
            detail = f"{by} refused the call of {gate['tool']} on {gate['server']}" + (f": {note}" if note else "")
            if "quorum" in gate and not gate["quorum"]["veto"]:         # too few left to approve
                detail = (f"the call of {gate['tool']} on {gate['server']} cannot have the {gate['quorum']['need']}"
                          f" approvals it needs: too many of {', '.join(gate['quorum']['to'])} refused")
            if "quorum" in gate:
                tx.set_approval(playbook, run_id, dumps(gate))
            closed = end(tx, fx, playbook, run_id, "declined", detail, now=now, by=by)
            assert closed is not None
            return closed
        closed = tx.close_request(fx, playbook, run_id, ENDINGS["answered"])
        tx.append_event(fx, playbook, run_id, "approval_answered", now, by, {
            "approved": approved, "by": by, "patch": self.tools.record(gate["server"], patch), "note": note,
            "arguments_digest": arguments_digest(arguments)})
        tx.set_approval(playbook, run_id, dumps({**gate, "approved": arguments}))
        tx.resume_run(playbook, run_id)
        tx.set_timer(fx, timer_key("call", playbook, run_id), now)
        return closed

    def _vote(self, tx: Tx, fx: Effects, row: Row, gate: dict[str, Any], answer: dict[str, Any],
              claimed_for: str | None, by: str, now: int, reply_id: str | None, by_name: str | None,
              on_behalf_of: str | None) -> Any:
        """One addressee's vote on a quorum approval, inside the answer's change (SPEC section 25).

        Each person votes once, counted as the person a deputy stands for (a reply's vote is its
        sender's; an operator's, one vote under the token). The first approval's arguments stand: a
        later approval that changes them is 409 arguments_changed. Returns the open request's row with
        this vote as its answer while it is not decided, else {decided: approved?, gate, patch,
        arguments} for answered() to record as the approval's answer."""
        playbook, run_id = row["playbook"], row["run_id"]
        quorum = gate["quorum"]
        person = by_name if reply_id is not None else by
        counted = on_behalf_of or person
        if counted == gate.get("asked_by_person") or person == gate.get("asked_by_person"):
            raise Problem("approval_not_yours", "this call was started by the same person that votes on it;"
                                                " the others in its `to` approve it")
        votes: list[dict[str, Any]] = list(gate.get("votes", []))
        mine = next((v for v in votes if v["counted"] == counted), None)
        if mine is not None:
            if mine["answer"] == answer:                # the same vote again: its fact, no second vote
                return {**dict(zip(row.keys(), row)), "answer": dumps(answer), "answer_id": mine["answer_id"],
                        "answered_by": mine["by"], "answered_at": mine["at"], "answered_by_name": mine.get("name"),
                        "on_behalf_of": mine.get("on_behalf_of"), "claimed_for": claimed_for, "reply_id": reply_id}
            raise Problem("answered", f"{counted} has voted on this approval already; each person votes once",
                          kind="answered")
        approved = answer.get("approved") is True
        patch: list[dict[str, Any]] = []
        arguments = None
        if approved and any(v["approved"] for v in votes):      # approve what the first approval left
            if "arguments" in answer and json_patch(gate["arguments"], answer["arguments"]):
                raise Problem("arguments_changed", "an earlier approval set these arguments: approve or refuse them as"
                              " they are shown now, without changes", extra={"arguments": gate["arguments"]})
            arguments = gate["proposed"]
        elif approved:
            patch, arguments = self._approved(gate, answer)
        note = answer.get("note")
        vote_id = tx.append_event(fx, playbook, run_id, EventType.APPROVAL_VOTE.value, now, by, {
            "by": person, "approved": approved, "note": note, "patch": self.tools.record(gate["server"], patch),
            **({"on_behalf_of": on_behalf_of} if on_behalf_of else {})})
        votes.append({"by": person, "counted": counted, "approved": approved, "note": note, "at": now,
                      "answer_id": vote_id, "answer": answer, "name": by_name,
                      **({"on_behalf_of": on_behalf_of} if on_behalf_of else {})})
        gate = {**gate, "votes": votes}
        if approved and patch:                  # the first approval's edits stand for the rest
            gate.update(arguments=self.tools.scrub(arguments), proposed=arguments, first_patch=patch)
            tx.set_digest(playbook, run_id, request_digest(row["message"], APPROVAL_ANSWER_SCHEMA, gate["arguments"]))
        yes = sum(1 for v in votes if v["approved"])
        left = len([p for p in quorum["to"] if p not in {v["counted"] for v in votes}])
        if (not approved and quorum["veto"]) or yes + left < quorum["need"]:
            return {"decided": False, "gate": gate, "patch": patch, "arguments": None}
        if yes >= quorum["need"]:
            return {"decided": True, "gate": gate, "patch": gate.get("first_patch", patch),
                    "arguments": gate["proposed"]}
        tx.set_approval(playbook, run_id, dumps(gate))
        return {**dict(zip(row.keys(), row)), "answer": dumps(answer), "answer_id": vote_id, "answered_by": by,
                "answered_at": now, "answered_by_name": by_name, "on_behalf_of": on_behalf_of,
                "claimed_for": claimed_for, "reply_id": reply_id}

    async def with_votes(self, run: dict[str, Any]) -> dict[str, Any]:
        """A run object with its quorum approval's `approval: {need, votes}`, when it has one."""
        req = await self.store.read(lambda tx: tx.request(run["playbook"], run["run_id"]))
        if req is not None and req["approval"] is not None and '"quorum"' in req["approval"]:
            gate = json.loads(req["approval"])
            run["approval"] = {"to": gate["quorum"]["to"], "need": gate["quorum"]["need"],
                               "veto": gate["quorum"]["veto"], "votes": _votes_shown(gate)}
        return run

    @staticmethod
    def _approved(gate: dict[str, Any], answer: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
        """The patch an approval's arguments make to the ones shown, and the arguments to send: the
        proposed ones with that patch (a scrubbed value left as shown is sent as it was)."""
        edit = gate["edit"]
        patch = json_patch(gate["arguments"], answer.get("arguments", gate["arguments"]))
        may = f"the approver may change only {', '.join(edit)}" if edit else "the approver may change no argument"
        errors = [{"pointer": "/answer/arguments" + op["path"], "message": f"this argument may not be changed: {may}"}
                  for op in patch if not any(op["path"] == e or op["path"].startswith(e + "/") for e in edit)]
        if errors:
            raise ended("invalid_input", "the answer changes arguments it may not change",
                                 errors=errors)
        try:
            arguments = json_patch_apply(gate["proposed"], patch)
        except (LookupError, ValueError, IndexError) as exc:
            raise ended("invalid_input", f"the changed arguments cannot be applied: {exc}",
                                 errors=[{"pointer": "/answer/arguments", "message": str(exc)}]) from None
        errors = schema_errors(compile_schema(gate["schema"]), arguments, "/answer/arguments")
        if errors:
            raise ended("invalid_input",
                                 f"the changed arguments do not match the input schema of {gate['tool']}", errors=errors)
        if json_size(arguments) > MAX_ARGUMENTS_BYTES:
            raise ended("invalid_input", f"the arguments pass {MAX_ARGUMENTS_BYTES // KIB} KiB",
                                 errors=[{"pointer": "/answer/arguments", "message": "too large"}])
        return patch, arguments

    # -- the call -------------------------------------------------------------------------------

    async def on_timer(self, key: str) -> None:
        """A `call` timer is due: the approved call runs as a side task (the timer task waits on no tool)."""
        _, playbook, run_id = key.split(":", 2)
        self.spawn(self._call(playbook, run_id, key), f"call {run_id}")

    async def _call(self, playbook: str, run_id: str, key: str) -> None:
        now = self.clock.now_ms()

        def load(tx: Tx) -> tuple[Row, Row | None] | None:
            due = tx.timer_due(key)
            return None if due is None or due > now else (tx.run(playbook, run_id), tx.request(playbook, run_id))
        loaded = await self.store.read(load)
        if loaded is None:
            return
        run, req = loaded
        gate = json.loads(req["approval"]) if req is not None and req["approval"] is not None else {}
        if run is None or run["status"] != RunStatus.STARTED.value or "approved" not in gate:
            await self.store.write(lambda tx, fx: tx.take_timer(fx, key, now))     # cancelled meanwhile
            return
        server, tool, arguments = gate["server"], gate["tool"], gate["approved"]
        by = req["answered_by"] or "interactiond"
        ending: Problem | None = None
        session: ToolSession | None = None
        doc = None
        try:
            if run["type"] != "execute":           # a function's run: its read and output schema
                doc = (await self.document(playbook, run["type"], run["name"], run["version"]))[1]
            session, _ = await asyncio.wait_for(self.calls.offered_tool(playbook, server, tool),
                                                OPEN_TIMEOUT_S + LIST_TIMEOUT_S + 1)
        except Problem as exc:
            ending = exc
        except asyncio.TimeoutError:
            ending = ended("tool_server_failed",
                                    f"the tool server {server!r} did not open in time; call search to see its state")
        read_only = session.read_only(tool) if session is not None else bool(gate["read_only"])
        started = {"server": server, "tool": tool, "read_only": read_only,
                   "arguments": self.tools.record(server, arguments), "arguments_size": json_size(arguments),
                   "arguments_sha256": sha256_hex(dumps(arguments)), "arguments_digest": arguments_digest(arguments)}

        def begin(tx: Tx, fx: Effects) -> bool:
            if not tx.take_timer(fx, key, now):
                return False
            if ending is not None:                  # nothing was sent
                live = tx.run(playbook, run_id)
                if live is not None and not RunStatus(live["status"]).ended:
                    end(tx, fx, playbook, run_id, ending, now=now, by=by)
                return False
            if not tx.begin_call(playbook, run_id):
                return False
            tx.append_event(fx, playbook, run_id, "tool_call_started", now, by, started)
            return True
        if not await self.store.write(begin):
            return
        await self.calls.call_and_end(playbook, run_id, by, server, tool, arguments, read_only, doc, approval=gate)

def _ms(span: timedelta) -> int:
    return int(span.total_seconds() * 1000)


def _follow_up_party(value: Any, what: str) -> str:
    """A rendered escalation party, as `to` is checked; a bound broken is an `unworkable` conflict."""
    if not isinstance(value, str):
        raise ended("unworkable", f"{what} rendered as {type(value).__name__}, not text")
    value = value.strip()
    if not value or has_control_char(value) or len(value.encode()) > MAX_PARTY_BYTES:
        raise ended("unworkable", f"{what} is not a party: it renders empty, holds a"
                             f" control character, or is longer than {MAX_PARTY_BYTES} bytes")
    return value


class Reminders:
    """Reminders, escalation and the default answer of a request (SPEC section 19), on the one timer task.

    A request's follow-up is planned once, when its run starts (`plan`): the reminder times, the
    escalation's time and party, their messages rendered, and the default answer. The plan is kept on
    the request and its times are timers, `remind:<playbook>:<run_id>` (the next reminder) and
    `escalate:<playbook>:<run_id>`; closing the request drops them. A reminder or an escalation is one
    change, guarded by the request being open, that appends its event: request_reminded with its
    number `n`, request_escalated with `to` (who may answer from then on, and under whom listings by
    `to` find the request). Reminders that fell due while no daemon ran are one reminder when a daemon
    starts: the next number, `missed` saying how many due times it stands for.

    A request sent through a tool also gets the message in its thread: a *nudge*, sent with
    replies.tell (its `message` being the reminder's text) and attempted as a delivery is: recorded
    as telling_started before it is sent, then telling_succeeded or telling_failed; tried again 1, 2,
    4 and 8 minutes after the attempt before, or after the Retry-After a server asks (up to 8 minutes);
    an attempt cut off by a stop counts as failed a minute after it started (its `nudge_lost` timer).
    A nudge is sent only while its request is open.

    The default answer is taken by the expiry, in the expiry's own change (`take_default`): the request
    closes as expired holding the default, request_defaulted carries the answer's fact (answered by
    nobody, `defaulted: true`), and the run succeeds with the default as its output, kind `defaulted`.
    """

    #: The timer kinds it fires (Engine._fire hands them here).
    TIMER_KINDS: Final = ("remind", "escalate", "nudge", "nudge_lost")

    def __init__(self, store: Store, clock: Clock, document: Callable[..., Any],
                 send: Callable[[Mapping[str, Any]], Any], spawn: Callable[[Any, str], Any]) -> None:
        self.store = store
        self.clock = clock
        self.document = document      # (playbook, type, name, version) -> (version, parsed document)
        self.send = send              # the deliveries' one call of a tool: {playbook, server, tool, deliver_args}
        self.spawn = spawn            # a named side task (a nudge's attempt waits on a tool)
        self._inflight: set[int] = set()

    # -- planning, when a run starts ----------------------------------------------------------

    def plan(self, doc: Any, name: str, input_: Any, now: int, prepared: dict[str, Any]) -> dict[str, Any] | None:
        """The follow-up of a request about to open, or None: from the function's remind, escalate and
        on_expiry, or, for a built-in question (ask-*), from the run's input. Raises the problem of an ending."""
        if name in ASK_FUNCTIONS:
            return self._asked_plan(input_, now, prepared)
        plan: dict[str, Any] = {}
        if doc.remind is None and doc.escalate is None and doc.on_expiry is None:
            return None                             # most functions: nothing to render
        ctx = base_context(now, input=input_)
        if "request" in prepared:                   # a reminder may carry the answer link, as the message does
            ctx["request"] = prepared["request"]
        try:
            if doc.remind is not None:
                plan["remind"] = {"at": [now + _ms(s) for s in doc.remind.after],
                                  "message": self._text(doc.remind.message, ctx, DEFAULT_REMINDER, "remind.message")}
            if doc.escalate is not None:
                plan["escalate"] = {"at": now + _ms(doc.escalate.after),
                                    "to": _follow_up_party(doc.escalate.to.render(ctx), "escalate.to"),
                                    "message": self._text(doc.escalate.message, ctx, DEFAULT_ESCALATION,
                                                          "escalate.message")}
        except RenderError as exc:
            if exc.kind == "undefined":
                raise ended("invalid_input", str(exc),
                                     errors=[{"pointer": "/input", "message": str(exc)}]) from None
            raise ended("unworkable", str(exc)) from None
        if doc.on_expiry is not None:
            plan["default"] = {"answer": doc.on_expiry.answer}
        return plan or None

    @staticmethod
    def _text(template: Template | None, ctx: dict[str, Any], default: str, what: str) -> str:
        text = template.render_text(ctx) if template is not None else default
        if len(text.encode()) > MAX_MESSAGE_BYTES:
            raise ended("unworkable", f"{what} is longer than {MAX_MESSAGE_BYTES // KIB} KiB")
        return text

    @staticmethod
    def _asked_plan(input_: dict[str, Any], now: int, prepared: dict[str, Any]) -> dict[str, Any] | None:
        """`ask`'s remind_after, escalate_to with escalate_after, and default, checked against its expiry and
        its answer schema; every problem is an `invalid_input` pointer under /input."""
        errors: list[dict[str, str]] = []
        expires_at = prepared["expires_at"]

        def due(text: Any, pointer: str) -> int | None:
            try:
                span = parse_duration(text)
            except ValueError as exc:
                errors.append({"pointer": pointer, "message": str(exc)})
                return None
            if span < EXPIRES_MIN or now + _ms(span) >= expires_at:
                errors.append({"pointer": pointer, "message": f"{text} lies between PT1M and the question's expiry"})
                return None
            return now + _ms(span)

        plan: dict[str, Any] = {}
        if "remind_after" in input_:
            times: list[int] = []
            for i, text in enumerate(input_["remind_after"]):
                at = due(text, f"/input/remind_after/{i}")
                if at is not None and times and at <= times[-1]:
                    errors.append({"pointer": f"/input/remind_after/{i}", "message": "reminders come in increasing order"})
                elif at is not None:
                    times.append(at)
            plan["remind"] = {"at": times, "message": DEFAULT_REMINDER}
        if ("escalate_to" in input_) != ("escalate_after" in input_):
            missing = "escalate_after" if "escalate_to" in input_ else "escalate_to"
            errors.append({"pointer": f"/input/{missing}", "message": "escalate_to and escalate_after go together"})
        elif "escalate_to" in input_:
            at = due(input_["escalate_after"], "/input/escalate_after")
            try:
                to = _follow_up_party(input_["escalate_to"], "escalate_to")
            except Problem as exc:
                errors.append({"pointer": "/input/escalate_to", "message": exc.detail})
            else:
                plan["escalate"] = {"at": at, "to": to, "message": DEFAULT_ESCALATION}
        if "default" in input_:
            errors += schema_errors(compile_schema(prepared["answer_schema"]), input_["default"], "/input/default")
            plan["default"] = {"answer": input_["default"]}
        if errors:
            raise ended("invalid_input", "the question's follow-up is not valid",
                                 errors=sorted(errors, key=lambda e: e["pointer"]))
        return plan or None

    @staticmethod
    def requested(plan: dict[str, Any] | None) -> dict[str, Any]:
        """What interaction_requested says of the plan: when it reminds and escalates, whether it defaults."""
        out: dict[str, Any] = {}
        if plan and "remind" in plan:
            out["reminds_at"] = [fmt_time(t) for t in plan["remind"]["at"]]
        if plan and "escalate" in plan:
            out["escalates"] = {"at": fmt_time(plan["escalate"]["at"]), "to": plan["escalate"]["to"]}
        if plan and "default" in plan:
            out["defaults"] = True
        return out

    @staticmethod
    def arm(tx: Tx, fx: Effects, playbook: str, run_id: str, plan: dict[str, Any] | None) -> None:
        """In the change that opens the request: its first reminder's timer and its escalation's."""
        if plan and plan.get("remind", {}).get("at"):
            tx.set_timer(fx, timer_key("remind", playbook, run_id), plan["remind"]["at"][0])
        if plan and "escalate" in plan:
            tx.set_timer(fx, timer_key("escalate", playbook, run_id), plan["escalate"]["at"])

    # -- the timers -----------------------------------------------------------------------------

    async def fire(self, kind: str, playbook: str, ref: str, key: str) -> None:
        if kind == "remind":
            await self.store.write(lambda tx, fx: self._remind(tx, fx, playbook, ref, key, self.clock.now_ms()))
        elif kind == "escalate":
            await self.store.write(lambda tx, fx: self._escalate(tx, fx, playbook, ref, key, self.clock.now_ms()))
        elif kind == "nudge":
            self.spawn(self._attempt(playbook, int(ref), key), f"nudge {ref}")
        else:
            await self._lost(int(ref), key)

    def _open_plan(self, tx: Tx, playbook: str, run_id: str) -> tuple[Row, dict[str, Any]] | None:
        req = tx.request(playbook, run_id)
        if (req is None or req["status"] != RequestStatus.OPEN.value or req["follow_up"] is None
                or req["delivery_state"] == DeliveryState.CANCELLING.value):
            return None
        return req, json.loads(req["follow_up"])

    def _remind(self, tx: Tx, fx: Effects, playbook: str, run_id: str, key: str, now: int) -> None:
        due = tx.timer_due(key)
        if due is None or not tx.take_timer(fx, key, now) or (found := self._open_plan(tx, playbook, run_id)) is None:
            return
        req, plan = found
        times = plan["remind"]["at"]
        passed = [t for t in times if due <= t <= now]
        row = tx.remind_request(playbook, run_id, req["reminded"])
        if row is None:
            return
        message = plan["remind"]["message"]
        payload = {"n": row["reminded"], "message": message, "due_at": fmt_time(passed[-1] if passed else due),
                   **({"missed": len(passed) - 1} if len(passed) > 1 else {}),
                   **self._queue(tx, fx, row, "reminder", row["reminded"], message, now)}
        tx.append_event(fx, playbook, run_id, "request_reminded", now, "interactiond", payload)
        later = next((t for t in times if t > now), None)
        if later is not None:
            tx.set_timer(fx, key, later)

    def _escalate(self, tx: Tx, fx: Effects, playbook: str, run_id: str, key: str, now: int) -> None:
        if not tx.take_timer(fx, key, now) or (found := self._open_plan(tx, playbook, run_id)) is None:
            return
        plan = found[1]["escalate"]
        row = tx.escalate_request(playbook, run_id, plan["to"])
        if row is None:
            return
        tx.append_event(fx, playbook, run_id, "request_escalated", now, "interactiond", {
            "to": plan["to"], "message": plan["message"],
            **self._queue(tx, fx, row, "escalation", 1, plan["message"], now)})

    @staticmethod
    def _queue(tx: Tx, fx: Effects, req: Row, what: str, n: int, message: str, now: int) -> dict[str, Any]:
        """A nudge for a request sent through a tool, due now; what its event says of it (`in_thread`:
        false while the message has not been delivered with what it was delivered as)."""
        if req["server"] is None:
            return {}
        if req["sent_conversation"] is None or req["sent_id"] is None:
            return {"in_thread": False}
        nudge_id = tx.queue_nudge(req["playbook"], req["run_id"], what=what, n=n, message=message)
        tx.set_timer(fx, timer_key("nudge", req["playbook"], str(nudge_id)), now)
        return {"in_thread": True}

    # -- nudges: a reminder or escalation message in the thread, attempted as a delivery is ---------

    async def _attempt(self, playbook: str, nudge_id: int, key: str) -> None:
        row = await self.store.read(lambda tx: tx.nudge(nudge_id))
        if row is None:
            return
        doc = (await self.document(row["playbook"], row["type"], row["name"], row["version"]))[1]
        tell = doc.replies.tell if doc.replies is not None else None
        args: Any = None
        refused = None if tell is not None else "the function has no replies.tell"
        if tell is not None:
            ctx = {"to": row["party"], "sent": {"conversation": row["sent_conversation"], "id": row["sent_id"]},
                   "message": row["message"]}
            try:
                args = render_args(tell.with_, ctx)
                if json_size(args) > MAX_ARGUMENTS_BYTES:
                    refused = f"the telling's arguments pass {MAX_ARGUMENTS_BYTES // KIB} KiB"
            except RenderError as exc:
                refused = str(exc)
        text = dumps(args) if refused is None else ""
        base = {"for": row["what"], "n": row["n"], "server": row["server"], "tool": tell.tool if tell else None}
        run_id, lost_key = row["run_id"], timer_key("nudge_lost", playbook, str(nudge_id))
        now = self.clock.now_ms()

        def begin(tx: Tx, fx: Effects) -> Row | None:
            if not tx.take_timer(fx, key, now) or (started := tx.begin_nudge(nudge_id, now=now)) is None:
                return None
            if refused is not None:
                tx.append_event(fx, playbook, run_id, "telling_failed", now, "interactiond", {
                    **base, "attempt": started["attempts"], "because": "unworkable", "message": refused})
                tx.end_nudge(nudge_id, started["attempts"], DeliveryEvent.SPEND)
                return None
            tx.append_event(fx, playbook, run_id, "telling_started", now, "interactiond", {
                **base, "attempt": started["attempts"], "arguments_size": len(text.encode()),
                "arguments_sha256": sha256_hex(text)})
            tx.set_timer(fx, lost_key, now + LOST_ATTEMPT_S * 1000)
            return started

        started = await self.store.write(begin)
        if started is None:
            return
        self._inflight.add(nudge_id)
        try:
            outcome = await self.send({"playbook": playbook, "run_id": run_id, "server": row["server"],
                                       "tool": tell.tool, "deliver_args": text})
        finally:
            self._inflight.discard(nudge_id)
        done = self.clock.now_ms()

        def attempt_ended(tx: Tx, fx: Effects) -> None:
            cur = tx.nudge(nudge_id)
            if cur is None or cur["attempts"] != started["attempts"] or cur["state"] != DeliveryState.DELIVERING.value:
                return                                  # counted lost meanwhile; this end is stale
            tx.drop_timer(fx, lost_key)
            attempt = cur["attempts"]
            if outcome.get("ok"):
                tx.append_event(fx, playbook, run_id, "telling_succeeded", done, "interactiond", {
                    **base, "attempt": attempt, "result_size": outcome["result_size"],
                    "result_sha256": outcome["result_sha256"]})
                tx.end_nudge(nudge_id, attempt, DeliveryEvent.SUCCEED)
                return
            failed = {**base, "attempt": attempt, "because": outcome.get("refused") or outcome.get("because"),
                      "message": outcome.get("message"), "retry_after_ms": outcome.get("retry_after_ms")}
            tx.append_event(fx, playbook, run_id, "telling_failed", done, "interactiond", failed)
            self._after_failure(tx, fx, cur, done, outcome.get("retry_after_ms"), spent="refused" in outcome)
        await write_attempt_end(self.store, attempt_ended)

    @staticmethod
    def _after_failure(tx: Tx, fx: Effects, cur: Row, now: int, retry_after_ms: int | None,
                       spent: bool = False) -> None:
        """The next attempt of a nudge whose attempt failed, while attempts are left and its request is open."""
        attempt = cur["attempts"]
        if spent or attempt >= MAX_ATTEMPTS or cur["request_status"] != RequestStatus.OPEN.value:
            tx.end_nudge(cur["id"], attempt, DeliveryEvent.SPEND)
            return
        tx.end_nudge(cur["id"], attempt, DeliveryEvent.FAIL)
        tx.set_timer(fx, timer_key("nudge", cur["playbook"], str(cur["id"])),
                     next_attempt_at(attempt, cur["started_at"], now, retry_after_ms))

    async def _lost(self, nudge_id: int, key: str) -> None:
        """A nudge's attempt with no recorded end a minute after it started counts as failed."""
        if nudge_id in self._inflight:
            return                                   # still running here; its end will be recorded
        now = self.clock.now_ms()

        def change(tx: Tx, fx: Effects) -> None:
            if not tx.take_timer(fx, key, now):
                return
            cur = tx.nudge(nudge_id)
            if cur is None or cur["state"] != DeliveryState.DELIVERING.value:
                return
            tx.append_event(fx, cur["playbook"], cur["run_id"], "telling_failed", now, "interactiond", {
                "for": cur["what"], "n": cur["n"], "attempt": cur["attempts"], "because": "lost",
                "message": "the attempt had no recorded end a minute after it started (the daemon stopped)",
                "retry_after_ms": None})
            self._after_failure(tx, fx, cur, now, None)
        await self.store.write(change)

    # -- the default answer, in the expiry's change ----------------------------------------------

    def take_default(self, tx: Tx, fx: Effects, playbook: str, run_id: str, now: int) -> bool:
        """At the expiry: a request with a default answer takes it, and its run succeeds with it. False
        (nothing written) when the request has none, or is not open or being cancelled."""
        found = self._open_plan(tx, playbook, run_id)
        if found is None or "default" not in found[1]:
            return False
        req, answer = found[0], found[1]["default"]["answer"]
        tx.record_default(fx, req, answer, now=now)
        end(tx, fx, playbook, run_id, "defaulted", now=now, by="interactiond", output=answer)
        return True


class Engine:
    """Every operation of the product, over one store, one clock and one timer task.

    The operations live in the parts above, one class per area, each built here with only what it
    uses; this class builds them, owns the life cycle (start, stop, settle, advance) and the timer
    task's dispatch, and answers the operations the sections below call by handing each to its part.
    """

    def __init__(self, store: Store, clock: Clock, config: Config) -> None:
        self.store = store
        self.clock = clock
        self.config = config
        self.bus = store.make_bus(clock)      # LocalBus; on PostgreSQL, a PgBus that hears other daemons too
        store.on_commit = self.bus.deliver
        self.wheel = TimerWheel(clock, self._fire,
                                lambda after, until: store.read(lambda tx: tx.timers_due(after, until)))
        self.bus.on_timer(lambda key, due: self.wheel.cancel(key) if due is None else self.wheel.set(key, due))
        self.bus.on_invalidate(self._invalidate)
        self.bus.on_gone(lambda: self.spawn(self._take_over(), "take over"))
        self._tasks: set[asyncio.Task[Any]] = set()
        self._timer_task: asyncio.Task[None] | None = None
        #: What fires a timer, by the kind its key starts with (see on_timer).
        self._timers: dict[str, tuple[Callable[[str, str, str], Any], bool]] = {}
        self.playbooks: set[str] = set(config.playbooks)
        self.tools = ToolServers(config, store, clock)
        #: The run kinds of the sections below (Workflows), each made with this engine once its parts exist.
        self.kinds: dict[str, RunKind] = {}

        self.links = AnswerLinks(config.links_base)     # its key is loaded at start

        # The parts, each built after the parts it calls and given them (the run kinds, made last,
        # call the engine's operations).
        self.definitions = Definitions(store, clock, self.kinds, self.tools.gated)
        self.calls = ToolCalls(store, clock, self.tools)
        #: The approval gate on calls (SPEC section 20); its `call` timers make the approved calls.
        self.approvals = Approvals(store, clock, self.tools, self.calls, config.open_requests, self.spawn,
                                   self.definitions.document, links=self.links)
        self.system_calls = SystemCalls(store, clock, self.tools, config, self.calls, self.approvals)
        self.inbox = Inbox(store, clock, self.tools, self.approvals, links=self.links)
        self.readings = Readings(store, clock, self.tools, self.definitions, self.inbox)
        self.deliveries = Deliveries(store, clock, self.tools, self.definitions, self.readings)
        #: Reminders, escalation and default answers of requests, on this engine's timers; they send
        #: as the deliveries do.
        self.reminders = Reminders(store, clock, self.definitions.document, self.deliveries.send, self.spawn)
        self.runs = Runs(store, clock, self.bus, self.definitions, self.system_calls, self.kinds, config.open_requests,
                         links=self.links, reminders=self.reminders)

        # The operations the sections below call, each answered by the part that owns it.
        self.document = self.definitions.document
        self.create_definition = self.definitions.create_definition
        self.get_definition = self.definitions.get_definition
        self.list_definitions = self.definitions.list_definitions
        self.delete_definition = self.definitions.delete_definition
        self.get_run = self._with_votes(self.runs.get_run)       # a quorum approval's run shows its votes
        self.wait_run = self._with_votes(self.runs.wait_run)
        self.cancel_run = self.runs.cancel_run
        self.cancel_in = self.runs.cancel_in
        self.list_runs = self.runs.list_runs
        self.search = self.system_calls.search
        self.introspect = self.system_calls.introspect
        self.execute_tool = self.system_calls.execute_tool
        self.list_interactions = self.inbox.list_interactions
        self.answer_interaction = self.inbox.answer_interaction
        self.deputized = self.inbox.deputized
        self.add_deputy, self.list_deputies = self.inbox.add_deputy, self.inbox.list_deputies
        self.remove_deputy = self.inbox.remove_deputy
        self.request_for = self.inbox.request_for
        self.elicitation_declined = self.inbox.elicitation_declined
        self.elicitation_refused = self.inbox.elicitation_refused
        self.task_view = self.inbox.task_view
        self.cancel_task = self.runs.cancel_task
        self.replayed = self.inbox.replayed
        self.list_run_events = self.inbox.list_run_events
        self.list_playbook_events = self.inbox.list_playbook_events
        self.get_event = self.inbox.get_event

        self.kinds.update((type_, make(self)) for type_, make in RUN_KINDS.items())
        self.on_timer("expire", self._expire)
        self.on_timer("attempt", self.deliveries.attempt, side=True)
        self.on_timer("lost", self.deliveries.lost)
        self.on_timer("read", lambda playbook, ref, key: self.readings.read(playbook, int(ref), key), side=True)
        self.on_timer("call", lambda playbook, ref, key: self.approvals.on_timer(key))
        for kind_ in Reminders.TIMER_KINDS:
            self.on_timer(kind_, lambda playbook, ref, key, k=kind_: self.reminders.fire(k, playbook, ref, key))
        self.on_timer("prune", lambda playbook, ref, key: self._prune(key))
        for type_, kind in self.kinds.items():    # e.g. a workflow run to move on (started, woken, or due)
            self.on_timer(type_, lambda playbook, ref, key, kind=kind: kind.on_timer(playbook, ref), side=True)

    @property
    def observe(self) -> Callable[[str, str, str], None] | None:
        """`observe(what, playbook, label)` of what the events do not tell: a run started (label: its
        type), a read of replies done (label: ok or why it failed). The metrics set it."""
        return self.readings.observe

    @observe.setter
    def observe(self, fn: Callable[[str, str, str], None] | None) -> None:
        self.readings.observe = fn

    # -- life ---------------------------------------------------------------------------------

    async def start(self) -> None:
        now = self.clock.now_ms()
        builtins = {name: _ask_source(kind) for name, kind in ASK_FUNCTIONS.items()}
        docs = {name: parse_function(src) for name, src in builtins.items()}

        def init(tx: Tx, fx: Effects) -> list[tuple[str, int]]:
            for pb in self.playbooks:
                tx.ensure_playbook(pb, now=now)
                for name, source in builtins.items():
                    tx.save_builtin(pb, name, source=source, sha=sha256_hex(source), overview=docs[name].overview,
                                    description=docs[name].description, now=now,
                                    answer_schema=dumps(docs[name].output_schema))
            self._end_calls_in_flight(tx, fx, now)
            # Recount open requests: the counter is a cache of requests.open.
            tx.recount_open_requests()
            self.links.load(tx, now)
            return tx.timers_due(None, now + TIMER_WINDOW_MS)

        self.wheel.start_window(now, await self.store.write(init))
        self.wheel.set(PRUNE_TIMER, now + 60_000, own=True)
        self._timer_task = asyncio.create_task(self.wheel.run(), name="interactiond-timers")

    def _end_calls_in_flight(self, tx: Tx, fx: Effects, now: int) -> None:
        # A call to a system cut off by a stop failed as a call that got no answer does: a
        # read-only tool's run is unfinished, any other tool may have acted (effect_unknown).
        for playbook, run_id, started in tx.system_calls_in_flight():
            read_only = bool(started and started.get("read_only"))
            problem = ToolCalls.unfinished(read_only, "lost", "the daemon stopped while the call was in flight")
            end(tx, fx, playbook, run_id, problem, now=now, by="interactiond")

    async def _take_over(self) -> None:
        """Other daemons on the database were found gone: their calls in flight end as a start ends them,
        their attempts in flight count as lost and the work they held is armed again (tx.take_over)."""
        now = self.clock.now_ms()

        def change(tx: Tx, fx: Effects) -> None:
            self._end_calls_in_flight(tx, fx, now)
            tx.take_over(fx, now)
        await self.store.write(change)

    def end_waits(self) -> None:
        """At shutdown: every long poll answers now with its run as it stands, and none waits again."""
        self.runs.stopping = True
        self.bus.end_waits()

    async def stop(self) -> None:
        self.runs.stopping = True
        if self._timer_task is not None:
            self._timer_task.cancel()
            await asyncio.gather(self._timer_task, return_exceptions=True)
            self._timer_task = None
        if self._tasks:
            done, pending = await asyncio.wait(set(self._tasks), timeout=SHUTDOWN_GRACE_S)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self.bus.end_waits()
        await self.tools.close()
        for kind in self.kinds.values():      # e.g. Workflows: its jq process
            await kind.close()

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        """A named side task, kept until it ends; its failure is logged, never lost."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("task %s failed", name, exc_info=t.exception())
        task.add_done_callback(done)
        return task

    async def settle(self) -> None:
        """Run every due timer and wait for the work it started (the manual clock's `advance`)."""
        for _ in range(10_000):
            fired = await self.wheel.run_due()
            if self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
            nxt = self.wheel.next_due()
            if not fired and not self._tasks and (nxt is None or nxt > self.clock.now_ms()):
                return

    async def advance(self, delta: timedelta) -> None:
        """Move the manual clock forward as time would pass: every timer fires at its own moment."""
        target = self.clock.now_ms() + int(delta.total_seconds() * 1000)
        await self.settle()
        # (Another daemon on the database may move the shared clock meanwhile: never back, then.)
        while (nxt := self.wheel.next_due()) is not None and nxt <= target:
            self.clock.advance(max(0, nxt - self.clock.now_ms()) / 1000)
            await self.settle()
        self.clock.advance(max(0, target - self.clock.now_ms()) / 1000)
        await self.settle()

    def _invalidate(self, what: tuple[str, ...]) -> None:
        """A cached thing changed (told by the bus): a definition's current version is read again."""
        if what[0] == "definition":
            self.definitions.forget(*what[1:])

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        return self.bus.subscribe()

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any]]) -> None:
        self.bus.unsubscribe(q)

    def _with_votes(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, answering a run object, with the votes of its quorum approval (Approvals.with_votes)."""
        async def call(*args: Any, **kw: Any) -> Any:
            run = await fn(*args, **kw)
            return await self.approvals.with_votes(run) if isinstance(run, dict) and "run_id" in run else run
        return call

    async def run_definition(self, caller: Caller, playbook: str, type_: str, name: str, input_: Any = None,
                             run_id: str | None = None, *, parent: str | None = None) -> tuple[dict[str, Any], bool]:
        """Start a run (see Runs.run_definition), told to `observe` when this call started it."""
        run, fresh = await self.runs.run_definition(caller, playbook, type_, name, input_, run_id, parent=parent)
        if fresh and self.observe is not None:
            self.observe("run_started", playbook, type_)
        return run, fresh

    # -- access ---------------------------------------------------------------------------------

    def playbook(self, caller: Caller, playbook: str) -> str:
        """The playbook id when the caller may see it; 404 otherwise (never 403)."""
        if playbook not in self.playbooks or not caller.sees(playbook):
            raise not_found(f"no playbook {playbook} is visible to this caller")
        return playbook


    # -- timers ---------------------------------------------------------------------------------

    def on_timer(self, kind: str, handler: Callable[[str, str, str], Any], *, side: bool = False) -> None:
        """Fire timers whose key is `kind:<playbook>:<ref>` with `await handler(playbook, ref, key)`:
        within the firing, or with `side` as a task of its own (one that calls a tool, or may take
        long). The engine's own kinds and the run kinds register here as it is built; a section below
        registers its own (the MCP sessions' idle check, `mcp`), kept in memory only."""
        self._timers[kind] = (handler, side)

    async def _fire(self, keys: list[str]) -> None:
        jobs = []
        for key in keys:
            kind, playbook, ref = key.split(":", 2)
            handler, side = self._timers.get(kind, (None, False))
            if handler is None:
                log.warning("timer of unknown kind %s dropped", kind)
            elif side:
                self.spawn(handler(playbook, ref, key), f"{kind} {ref}")
            else:
                jobs.append(handler(playbook, ref, key))
        if jobs:
            await asyncio.gather(*jobs, return_exceptions=True)

    async def _expire(self, playbook: str, run_id: str, key: str) -> None:
        now = self.clock.now_ms()

        def change(tx: Tx, fx: Effects) -> None:
            if not tx.take_timer(fx, key, now):
                return                                          # answered, cancelled, or moved
            if self.reminders.take_default(tx, fx, playbook, run_id, now):
                return                                          # it had a default answer: the run succeeded
            req = tx.request(playbook, run_id)
            if req is None or req["status"] != RequestStatus.OPEN:
                return
            end(tx, fx, playbook, run_id, "expired", f"nobody answered before {fmt_time(req['expires_at'])}",
                now=now, by="interactiond")
        await self.store.write(change)

    async def _prune(self, key: str) -> None:
        """The pruning pass, every PRUNE_EVERY on the daemon's clock: typed-API idempotency keys older
        than IDEMPOTENCY_KEEP, ended inbox sessions (signed out, revoked or expired) and spent login
        links. Nothing else is ever deleted."""
        now = self.clock.now_ms()
        try:
            await self.store.write(lambda tx, fx: tx.prune(now=now))
        finally:
            self.wheel.set(key, now + int(PRUNE_EVERY.total_seconds() * 1000), own=True)


# Workflows ######################################################################################
#
# Theory of operation. A workflow document is YAML in the shape of the CNCF Serverless Workflow
# DSL 1.0 (the subset of SPEC section 15). It is read with the documents' line-tracking YAML reader,
# checked whole (every problem with its line) and compiled once: each task gets its JSON Pointer
# (`/do/0/approval/try/0/ask`), each runtime expression `${ ... }` is compiled by jq with the
# variables its place may read.
#
# A run of a workflow is a *stack of frames* kept in `runs.state`: a frame for every task list being
# walked (where it stands, and the data flowing through it) and one for every task that has started
# and not ended (its input, its deadline, the child run it waits on, the attempt of a `try`).
# `Workflows.drive` moves a run on by one *transition* at a time - a task started, completed, faulted
# or retried - and writes the transition's events with the new state in ONE change, whose first
# statement writes the state guarded by the state it read (`SQLiteTx.step_workflow`). A crash
# therefore leaves the run at the old position or the new one, never between.
#
# Nothing sleeps. A run that waits (on a child run, a `wait`, a retry's delay) owns one timer,
# `workflow:<playbook>:<run_id>`, due when it must look again: the end of the wait, or the earliest
# deadline. A child run's ending sets its parent's timer due at once, inside the transaction that
# ends it (`end_run`), so an answer moves the workflow on even if the daemon stops right after it.
# While a run is busy its timer stands a minute ahead, which picks it up after a restart.

PROBLEM_TYPES.setdefault(
    "expression", (400, "Expression failed", "A runtime expression of a workflow failed; the detail names its task."))

#: The DSL's own error URIs; `errors.with.type` compares the last segment (the name) whatever the
#: prefix, so documents written against ours, the behaviour reference's or these all match.
DSL_ERRORS: Final = "https://serverlessworkflow.io/spec/1.0.0/errors/"
#: A `call: run_definition` step waits at most the function's expiry (or a system call's 70 s)
#: plus this long; then its request is cancelled and the step raises `timeout`.
WORKFLOW_STEP_GRACE_MS: Final = 60_000
#: While a run is busy its timer stands this far ahead: a restart mid-transition resumes it.
WORKFLOW_BUSY_MS: Final = 60_000
#: Tasks started in one run: ends a `then` loop that never waits before it spins for ever.
WORKFLOW_MAX_TASKS: Final = 100_000
#: A run's whole state as JSON (the data of every frame).
WORKFLOW_MAX_STATE_BYTES: Final = 4 * MIB
#: Workflows started by workflows nest this deep at most.
WORKFLOW_MAX_DEPTH: Final = 8
#: `wait` and a retry's delay: up to the longest expiry of a request.
WORKFLOW_WAIT_MAX: Final = EXPIRES_MAX
#: A task's `timeout` and a retry's `limit.duration`: a year at most.
WORKFLOW_TIMEOUT_MAX: Final = timedelta(days=366)
#: Attempts of a retry, the first included.
WORKFLOW_MAX_ATTEMPTS: Final = 100

_DSL_RE: Final = re.compile(r"1\.0\.\d+")
_NAMESPACE_RE: Final = re.compile(r"[a-z0-9](?:-?[a-z0-9]){0,62}")
_TASK_NAME_RE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_JQ_VAR_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
#: The variables every expression may read; a catch adds its `as` (default `error`).
_EXPR_VARS: Final = ("input", "data", "context", "workflow", "task", "runtime")
_WF_KEYS: Final = ("document", "input", "do", "output")
_TASK_COMMON: Final = ("if", "input", "output", "export", "timeout", "then", "metadata")
_TASK_KINDS: Final = ("call", "set", "switch", "wait", "raise", "try", "do")
_TASK_KEYS: Final = {"call": ("call", "with"), "try": ("try", "catch")}
_DSL_ONLY_TASKS: Final = ("emit", "for", "fork", "listen", "run")
_FLOW: Final = ("continue", "exit", "end")
_WORKFLOW_ENDINGS: Final = {400: RunStatus.INVALID_INPUT, 409: RunStatus.CONFLICT, 410: RunStatus.REJECTED,
                            503: RunStatus.UNAVAILABLE}
_ERROR_PREFIXES: Final = ("https://on.auto/problems/", DSL_ERRORS, PROBLEM_BASE)


# Runtime expressions: jq, guarded.
#
# jq can read the process environment (`env`, `$ENV`) and a few other things a workflow must not
# see; a prelude shadows them. The variables are bound from one input array, so a program compiles
# once per text and scope, not once per evaluation. jq holds the GIL while it runs, so a program that
# loops or swells would stall the whole daemon: programs run in child processes instead, bounded
# in time and memory, and one that passes a bound is stopped (its process with it). Runs do not
# share one process: a program that runs to its bound delays no other run's (JqRunner).

#: One evaluation of a runtime expression: real seconds, and the child process's address space.
JQ_TIMEOUT_S: Final = 2.0
JQ_MEMORY_BYTES: Final = 1024 * MIB
#: Evaluations at once, each in a child process of its own (some 15 MB each): a slow expression
#: holds up no other run's; past this many, an evaluation waits for a process to come free.
JQ_WORKERS: Final = 4

_JQ_GUARD: Final = (
    'def env: {}; def input_filename: null; def get_search_list: []; def get_prog_origin: null;'
    ' def get_jq_origin: null; def input: error("input is not available in a workflow"); def inputs: empty;'
    ' def debug: .; def debug(m): .; def stderr: .; def halt: error("halt is not available in a workflow");'
    ' def halt_error: halt; def halt_error(c): halt; {} as $ENV | ')

#: The child process: one JSON request a line, {"p": program, "v": input}; one reply a line.
_JQ_WORKER: Final = """\
import json, resource, sys
try:
    resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))
except (ValueError, OSError):
    pass
import jq
programs = {{}}
for line in sys.stdin:
    req = json.loads(line)
    try:
        program = programs.get(req["p"])
        if program is None:
            if len(programs) >= 1024:
                programs.clear()
            program = programs[req["p"]] = jq.compile(req["p"])
        out = program.input_value(req["v"]).all()
        text = json.dumps({{"ok": out[0] if out else None, "n": len(out)}})
        if len(text) > {size}:
            text = json.dumps({{"err": "its value passes {mib} MiB as JSON"}})
    except MemoryError:
        text = json.dumps({{"err": "it needs more memory than an expression may use"}})
    except Exception as exc:
        text = json.dumps({{"err": str(exc)}})
    sys.stdout.write(text + "\\n")
    sys.stdout.flush()
""".format(memory=JQ_MEMORY_BYTES, size=MAX_OUTPUT_BYTES + 64, mib=MAX_OUTPUT_BYTES // MIB)


class ExprError(Exception):
    """A runtime expression that does not compile or does not evaluate."""


def _jq_message(exc: BaseException | str) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if lines else "it failed"
    text = re.sub(r"^jq: error(?: \(at [^)]*\))?: ", "", text)
    return re.sub(r" at <top-level>, line \d+(?:, column \d+)?:?$", "", text).strip()


def _jq_source(text: str, names: tuple[str, ...]) -> str:
    binds = "".join(f".[{i + 1}] as ${n} | " for i, n in enumerate(names))
    return f"{_JQ_GUARD}{binds}.[0] | (\n{text}\n)"


@functools.lru_cache(maxsize=2048)
def _jq_program(text: str, names: tuple[str, ...]) -> Any:
    """Compile in process: the save-time check (compiling is bounded by the text; running is not)."""
    import jq  # imported here: only workflows need it

    try:
        return jq.compile(_jq_source(text, names))
    except ValueError as exc:
        raise ExprError(_jq_message(exc)) from None


@dataclass(frozen=True, slots=True)
class Expr:
    """A jq expression of a workflow, and the variables its place lets it read."""

    text: str
    names: tuple[str, ...]

    def quoted(self) -> str:
        text = " ".join(self.text.split())
        return "${ " + (text if len(text) <= 200 else text[:197] + "...") + " }"


class JqRunner:
    """Runs workflow expressions in child processes, each within its bounds.

    A process evaluates one expression at a time, and up to JQ_WORKERS evaluate at once: an
    expression that runs to JQ_TIMEOUT_S holds up its own run, never another's. Processes are
    started as they are needed and kept while idle; while one is free no other is started, and
    while none is (and there is room) one more is started ahead, so the next evaluation does not
    wait the tenth of a second a process takes to start.
    """

    def __init__(self) -> None:
        self._idle: list[asyncio.subprocess.Process] = []
        self._busy: set[asyncio.subprocess.Process] = set()
        self._spare: asyncio.Task[asyncio.subprocess.Process] | None = None   # one being started ahead
        self._slots = asyncio.Semaphore(JQ_WORKERS)

    @staticmethod
    async def _start() -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-X", "utf8", "-c", _JQ_WORKER, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, limit=2 * MAX_OUTPUT_BYTES)

    async def _take(self) -> asyncio.subprocess.Process:
        """A process for one evaluation: an idle one, the one started ahead, or a new one."""
        while self._idle:
            proc = self._idle.pop()
            if proc.returncode is None:
                return proc
        spare, self._spare = self._spare, None
        if spare is not None:
            with contextlib.suppress(OSError):
                proc = await spare
                if proc.returncode is None:
                    return proc
        return await self._start()

    def _start_ahead(self) -> None:
        if not self._idle and self._spare is None and len(self._busy) < JQ_WORKERS:
            self._spare = asyncio.ensure_future(self._start())

    @staticmethod
    def _stop(proc: asyncio.subprocess.Process | None) -> None:
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    async def _end(self, proc: asyncio.subprocess.Process | None) -> None:
        self._stop(proc)
        if proc is not None:
            await proc.wait()

    async def eval(self, expr: Expr, dot: Any, scope: Mapping[str, Any]) -> Any:
        request = dumps({"p": _jq_source(expr.text, expr.names), "v": [dot, *(scope.get(n) for n in expr.names)]})
        async with self._slots:
            proc = None
            try:
                proc = await self._take()
                self._busy.add(proc)
                self._start_ahead()
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(request.encode() + b"\n")
                await proc.stdin.drain()
                line = await asyncio.wait_for(proc.stdout.readline(), JQ_TIMEOUT_S)
            except asyncio.TimeoutError:
                await self._end(proc)
                raise ExprError(f"{expr.quoted()} ran longer than {JQ_TIMEOUT_S:g} seconds and was stopped") from None
            except (OSError, ValueError, asyncio.LimitOverrunError) as exc:
                await self._end(proc)
                raise ExprError(f"{expr.quoted()} could not be run: {exc}") from None
            except BaseException:
                # Cancelled: a reply may still come, and the next request must not read it as its own.
                self._stop(proc)
                raise
            finally:
                self._busy.discard(proc)      # type: ignore[arg-type]
            if not line:
                await self._end(proc)
                raise ExprError(f"{expr.quoted()} needed more memory than an expression may use and was stopped")
            self._idle.append(proc)
        reply = json.loads(line)
        if "err" in reply:
            raise ExprError(f"{_jq_message(reply['err'])}, in {expr.quoted()}")
        if reply["n"] > 1:
            raise ExprError(f"{expr.quoted()} gives {reply['n']} values where one is expected (collect them with [ ... ])")
        if json_depth(reply["ok"]) > MAX_JSON_DEPTH:
            raise ExprError(f"{expr.quoted()} gives a value deeper than {MAX_JSON_DEPTH} levels")
        return reply["ok"]

    async def fill(self, tree: Any, dot: Any, scope: Mapping[str, Any]) -> Any:
        """A value with every expression in it evaluated."""
        if isinstance(tree, Expr):
            return await self.eval(tree, dot, scope)
        if isinstance(tree, dict):
            return {k: await self.fill(v, dot, scope) for k, v in tree.items()}
        if isinstance(tree, list):
            return [await self.fill(v, dot, scope) for v in tree]
        return tree

    async def close(self) -> None:
        procs, self._idle = [*self._idle, *self._busy], []
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.cancel()                # none started yet: none is
            with contextlib.suppress(asyncio.CancelledError, OSError):
                procs.append(await spare)
        for proc in procs:
            self._stop(proc)
        for proc in procs:
            await proc.wait()


def _truthy(value: Any) -> bool:
    return value is not None and value is not False


def _error_name(type_: Any) -> str:
    """`https://on.auto/problems/unanswered`, `/problems/unanswered` and `unanswered` all name `unanswered`."""
    return str(type_).rstrip("/").rsplit("/", 1)[-1]


def _wf_error(name: str, detail: str, *, instance: str, status: int | None = None, kind: str | None = None,
              **extra: Any) -> dict[str, Any]:
    body = Problem(name, detail, status=status, kind=kind).body()
    body["instance"] = instance
    body.update(extra)
    return body


def _time_object(ms: int) -> dict[str, Any]:
    return {"iso8601": fmt_time(ms), "epoch": {"seconds": ms // 1000, "milliseconds": ms}}


# The document.

@dataclass(frozen=True, slots=True)
class WfRetry:
    delay_ms: int
    backoff: str                    # constant | linear | exponential
    count: int | None               # attempts in all, the first included
    limit_ms: int | None            # from the first attempt's start

    def delay(self, retry: int) -> int:
        """The wait before retry number `retry` (1 for the second attempt)."""
        if self.backoff == "linear":
            ms = self.delay_ms * retry
        elif self.backoff == "exponential":
            ms = self.delay_ms * 2 ** min(retry - 1, 40)
        else:
            ms = self.delay_ms
        return min(ms, int(WORKFLOW_WAIT_MAX.total_seconds() * 1000))


@dataclass(frozen=True, slots=True)
class WfCatch:
    with_: dict[str, Any]           # errors.with: type, status, kind, instance (AND-ed)
    as_: str
    when: Expr | None
    except_when: Expr | None
    retry: WfRetry | None
    do: str | None                  # the pointer of the catch's task list


@dataclass(frozen=True, slots=True)
class WfCall:
    type: str
    name: str
    input: Any


@dataclass(frozen=True, slots=True)
class WfCase:
    name: str
    when: Expr | None
    then: str


@dataclass(frozen=True, slots=True)
class WfTask:
    name: str
    ref: str                        # JSON Pointer in the document, the errors' `instance`
    kind: str                       # call | set | switch | wait | raise | try | do
    if_: Expr | None = None
    input_from: Any = None
    output_as: Any = None
    export_as: Any = None
    timeout_ms: int | None = None
    then: str | None = None
    body: Any = None                # set: a value; wait: ms; raise: the error; call: WfCall; switch: cases
    lists: tuple[str, ...] = ()     # try: the try list; do: its list
    catch: WfCatch | None = None


@dataclass(frozen=True)
class WorkflowDoc:
    """A checked workflow document, compiled."""

    name: str
    document: dict[str, Any]
    description: str | None
    input_schema: Any
    input_from: Any
    output_as: Any
    tasks: dict[str, WfTask]
    lists: dict[str, tuple[WfTask, ...]]
    calls: tuple[tuple[str, str, int, str], ...]    # (type, name, line, field) of each call
    overview: str = ""

    @property
    def uses(self) -> list[list[str]]:
        return [list(u) for u in sorted({(t, n) for t, n, _, _ in self.calls})]

    @functools.cached_property
    def input_validator(self) -> Any:
        return compile_schema(self.input_schema) if self.input_schema is not None else None


def parse_workflow(source: str, name: str | None = None) -> WorkflowDoc:
    """Check and compile a workflow document; DocumentError lists every problem with its line.

    `name`, when given, is the definition's name, which `document.name` must equal.
    """
    if not isinstance(source, str):
        raise DocumentError([{"line": 1, "field": "", "message": "a workflow document is YAML text"}])
    r = _Reader()
    try:
        data = _compose_workflow(r, source)
        doc = _WorkflowReader(r, name).read(data)
    except RecursionError:
        raise DocumentError([{"line": 1, "field": "", "message": "the document nests too deeply"}]) from None
    if r.problems or doc is None:
        raise DocumentError(r.problems or [{"line": 1, "field": "", "message": "invalid workflow document"}])
    return replace(doc, overview=workflow_overview(doc))


def _compose_workflow(r: _Reader, source: str) -> dict[str, Any]:
    """The document's data; `r` learns every field's line. Same loader as the front matter."""
    import yaml
    text = source.replace("\r\n", "\n").replace("\r", "\n").removeprefix("\ufeff")
    loader = None
    try:
        loader = _front_matter_loader()(text)
        node = loader.get_single_node()
    except _TooLarge as exc:
        raise DocumentError([{"line": exc.problem_mark.line + 1, "field": "", "message": exc.problem}]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise DocumentError([{"line": mark.line + 1 if mark else 1, "field": "",
                              "message": f"the document is not valid YAML: {exc.problem}"}]) from None
    except yaml.YAMLError as exc:
        raise DocumentError([{"line": 1, "field": "", "message": f"the document is not valid YAML: {exc}"}]) from None
    finally:
        if loader is not None:
            loader.dispose()
    if not isinstance(node, yaml.MappingNode):
        raise DocumentError([{"line": node.start_mark.line + 1 if node is not None else 1, "field": "",
                              "message": "a workflow document is a YAML mapping of document, input, do and output"}])
    data = r.construct(node, ())
    # The reader counts lines as for front matter (below a --- line); a workflow starts on line 1.
    shift = _FRONT_OFFSET - 1
    r.where = {k: _Where(w.line - shift, w.text_line - shift) for k, w in r.where.items()}
    for p in r.problems:
        p["line"] = max(1, p["line"] - shift)
    return data


class _WorkflowReader:
    """The save-time rules of a workflow document, over the data `_Reader` composed."""

    def __init__(self, r: _Reader, name: str | None) -> None:
        self.r = r
        self.name = name
        self.tasks: dict[str, WfTask] = {}
        self.lists: dict[str, tuple[WfTask, ...]] = {}
        self.calls: list[tuple[str, str, int, str]] = []
        self.expressions = [0, 0]       # expressions and their characters so far (past the bounds none compiles)

    def read(self, data: dict[str, Any]) -> WorkflowDoc | None:
        r = self.r
        for key in data:
            if key not in _WF_KEYS:
                r.add((key,), f"{key!r} is not part of the workflows interactiond runs (their keys: {', '.join(_WF_KEYS)})")
        for key in ("document", "do"):
            if key not in data:
                r.add((key,), f"a workflow needs {key!r}", line=1)
        document = self.document(data.get("document")) if "document" in data else {}
        input_schema, input_from = self.input(data["input"]) if "input" in data else (None, None)
        output_as = None
        if "output" in data and r.mapping(("output",), data["output"], ("as",)) is not None and "as" in data["output"]:
            output_as = self.tree(("output", "as"), data["output"]["as"], _EXPR_VARS)
        if "do" in data:
            self.task_list(("do",), data["do"], _EXPR_VARS)
        if r.problems:
            return None
        return WorkflowDoc(name=document["name"], document=document,
                           description=document.get("summary") or document.get("title"),
                           input_schema=input_schema, input_from=input_from, output_as=output_as,
                           tasks=self.tasks, lists=self.lists, calls=tuple(self.calls))

    # -- the parts ------------------------------------------------------------------------------

    def document(self, value: Any) -> dict[str, Any]:
        r, path = self.r, ("document",)
        doc = r.mapping(path, value, ("dsl", "namespace", "name", "version", "title", "summary", "tags", "metadata"),
                        required=("dsl", "namespace", "name", "version"))
        if doc is None:
            return {}
        if "dsl" in doc and not (isinstance(doc["dsl"], str) and _DSL_RE.fullmatch(doc["dsl"])):
            r.add(path + ("dsl",), f"{doc['dsl']!r} is not a DSL version interactiond reads: write '1.0.x', such as '1.0.3'")
        if "namespace" in doc and not (isinstance(doc["namespace"], str) and _NAMESPACE_RE.fullmatch(doc["namespace"])):
            r.add(path + ("namespace",), "is lowercase letters and digits, single hyphens between them, at most 63")
        if "name" in doc:
            got = doc["name"]
            if not isinstance(got, str) or not FUNCTION_NAME_RE.fullmatch(got):
                r.add(path + ("name",), "is the workflow's name: 1 to 128 lowercase letters, digits, hyphens and underscores")
            elif self.name is not None and got != self.name:
                r.add(path + ("name",), f"is {got!r}, but the definition is saved as {self.name!r}; the two must be equal")
        for key in ("version", "title", "summary"):
            if key in doc and (not isinstance(doc[key], str) or not doc[key].strip()):
                r.add(path + (key,), "is a text (quote a version such as '1.0.0')")
        if "tags" in doc and not (isinstance(doc["tags"], dict) and all(isinstance(v, str) for v in doc["tags"].values())):
            r.add(path + ("tags",), "is a mapping of names to texts")
        if "metadata" in doc and not isinstance(doc["metadata"], dict):
            r.add(path + ("metadata",), "is a mapping")
        return doc

    def input(self, value: Any) -> tuple[Any, Any]:
        r, path = self.r, ("input",)
        inp = r.mapping(path, value, ("schema", "from"))
        if inp is None:
            return None, None
        schema = None
        if "schema" in inp:
            block = r.mapping(path + ("schema",), inp["schema"], ("format", "document"), required=("document",))
            if block is not None:
                if block.get("format", "json") != "json":
                    r.add(path + ("schema", "format"), "is json, the only schema format interactiond reads")
                if "document" in block:
                    schema = r.schema(path + ("schema", "document"), block["document"])
        from_ = self.tree(path + ("from",), inp["from"], _EXPR_VARS) if "from" in inp else None
        return schema, from_

    def duration(self, path: tuple[Any, ...], value: Any, low: timedelta, high: timedelta) -> int | None:
        """An ISO 8601 text or the DSL's {days, hours, minutes, seconds, milliseconds}, as ms."""
        r = self.r
        if isinstance(value, dict):
            units = {"days": 86_400_000, "hours": 3_600_000, "minutes": 60_000, "seconds": 1000, "milliseconds": 1}
            ms = 0
            for key, n in value.items():
                if key not in units:
                    r.add(path + (key,), f"{key!r} is not a unit of a duration ({', '.join(units)})")
                    return None
                if isinstance(n, bool) or not isinstance(n, (int, float)) or n < 0:
                    r.add(path + (key,), "is a number of zero or more")
                    return None
                ms += int(n * units[key])
            try:
                span = timedelta(milliseconds=ms)
            except OverflowError:
                r.add(path, f"is longer than any duration the daemon keeps (at most {timedelta.max.days} days)")
                return None
        else:
            try:
                span = parse_duration(value)
            except ValueError as exc:
                r.add(path, str(exc))
                return None
        if not low <= span <= high:
            r.add(path, f"is {duration_words(span)}; it lies between {duration_words(low)} and {duration_words(high)}")
            return None
        return int(span.total_seconds() * 1000)

    def expr(self, path: tuple[Any, ...], value: Any, names: tuple[str, ...]) -> Expr | None:
        """A field that is an expression whole (if, when, exceptWhen): `${ ... }` or bare jq."""
        if not isinstance(value, str) or not value.strip():
            self.r.add(path, "is a runtime expression, such as '${ .approved == true }'")
            return None
        text = value.strip()
        if text.startswith("${") and text.endswith("}"):
            text = text[2:-1]
        return self.compile(path, text, names)

    def compile(self, path: tuple[Any, ...], text: str, names: tuple[str, ...]) -> Expr | None:
        if not text.strip():
            self.r.add(path, "the runtime expression is empty")
            return None
        if len(text) > MAX_EXPRESSION_CHARS:
            self.r.add(path, f"the runtime expression is longer than {MAX_EXPRESSION_CHARS} characters",
                       line=self.r.text_line(path))
            return None
        count, chars = self.expressions
        if count > MAX_DOCUMENT_EXPRESSIONS or chars > MAX_DOCUMENT_EXPRESSION_CHARS:
            return None                 # refused already: the document is
        count, chars = self.expressions = [count + 1, chars + len(text)]
        if count > MAX_DOCUMENT_EXPRESSIONS or chars > MAX_DOCUMENT_EXPRESSION_CHARS:
            self.r.add(path, f"the workflow holds more than {MAX_DOCUMENT_EXPRESSIONS} runtime expressions"
                       if count > MAX_DOCUMENT_EXPRESSIONS else
                       f"the workflow's runtime expressions take more than {MAX_DOCUMENT_EXPRESSION_CHARS // KIB} KiB",
                       line=self.r.text_line(path))
            return None
        try:
            _jq_program(text, names)
        except ExprError as exc:
            self.r.add(path, f"the expression does not compile: {exc} (it may read {', '.join('$' + n for n in names)})",
                       line=self.r.text_line(path))
            return None
        return Expr(text, names)

    def tree(self, path: tuple[Any, ...], value: Any, names: tuple[str, ...]) -> Any:
        """A value whose texts of the form `${ ... }` are expressions."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("${") and text.endswith("}"):
                return self.compile(path, text[2:-1], names)
            if "${" in value:
                self.r.add(path, "a runtime expression is a whole value, '${ ... }'; to build a text use jq's"
                           " interpolation, such as '${ \"Hello \\(.name)\" }'", line=self.r.text_line(path))
            return value
        if isinstance(value, dict):
            return {k: self.tree(path + (k,), v, names) for k, v in value.items()}
        if isinstance(value, list):
            return [self.tree(path + (i,), v, names) for i, v in enumerate(value)]
        return value

    def task_list(self, path: tuple[Any, ...], value: Any, names: tuple[str, ...]) -> str:
        r = self.r
        ref = pointer_join(path)
        self.lists[ref] = ()
        if not isinstance(value, list) or not value:
            r.add(path, "is a list of named tasks, such as - ask: {call: run_definition, with: {...}}")
            return ref
        tasks: list[WfTask] = []
        seen: dict[str, int] = {}
        jumps: list[tuple[tuple[Any, ...], Any]] = []
        for i, item in enumerate(value):
            at = path + (i,)
            if not isinstance(item, dict) or len(item) != 1:
                r.add(at, "is one named task: a mapping with a single key, the task's name")
                continue
            (tname, body), = item.items()
            if not _TASK_NAME_RE.fullmatch(tname):
                r.add(at, f"{tname!r} is not a task name: 1 to 64 letters, digits, underscores, dots and hyphens")
                continue
            if tname in seen:
                r.add(at, f"a task named {tname!r} is already on line {r.line(path + (seen[tname],))}; names are unique in a list")
                continue
            seen[tname] = i
            task = self.task(at + (tname,), tname, body, names, jumps)
            if task is not None:
                tasks.append(task)
        for jpath, target in jumps:
            if not isinstance(target, str) or (target not in _FLOW and target not in seen):
                r.add(jpath, f"{target!r} is neither continue, exit, end nor the name of a task of this list"
                      f" ({', '.join(seen) or 'none'})")
        self.lists[ref] = tuple(tasks)
        return ref

    def task(self, path: tuple[Any, ...], name: str, body: Any, names: tuple[str, ...],
             jumps: list[tuple[tuple[Any, ...], Any]]) -> WfTask | None:
        r = self.r
        if not isinstance(body, dict):
            r.add(path, "is a task: a mapping such as {set: {...}} or {call: run_definition, with: {...}}")
            return None
        for key in body:
            if key in _DSL_ONLY_TASKS:
                r.add(path + (key,), f"{key} is a task of the DSL that interactiond does not run;"
                      f" it runs {', '.join(_TASK_KINDS)}")
        kinds = [k for k in _TASK_KINDS if k in body]
        if len(kinds) != 1:
            if not any(k in body for k in _DSL_ONLY_TASKS):
                r.add(path, f"holds {' and '.join(kinds)}; a task does one thing" if kinds else
                      f"does nothing: a task is one of {', '.join(_TASK_KINDS)}")
            return None
        kind = kinds[0]
        allowed = _TASK_COMMON + _TASK_KEYS.get(kind, (kind,))
        for key in body:
            if key not in allowed and key not in _DSL_ONLY_TASKS and key not in _TASK_KINDS:
                r.add(path + (key,), f"{key!r} is not a key of a {kind} task (its keys: {', '.join(allowed)})")
        ref = pointer_join(path)
        common: dict[str, Any] = {}
        if "if" in body:
            common["if_"] = self.expr(path + ("if",), body["if"], names)
        for key, attr in (("input", "from"), ("output", "as"), ("export", "as")):
            if key in body and r.mapping(path + (key,), body[key], (attr,)) is not None and attr in body[key]:
                common[f"{key}_{attr}" if key != "input" else "input_from"] = self.tree(path + (key, attr), body[key][attr], names)
        if "timeout" in body and r.mapping(path + ("timeout",), body["timeout"], ("after",), required=("after",)):
            if "after" in body["timeout"]:
                common["timeout_ms"] = self.duration(path + ("timeout", "after"), body["timeout"]["after"],
                                                     timedelta(seconds=1), WORKFLOW_TIMEOUT_MAX)
        if "then" in body:
            jumps.append((path + ("then",), body["then"]))
            common["then"] = body["then"] if isinstance(body["then"], str) else None
        spec = body[kind]
        at = path + (kind,)
        if kind == "call":
            return self._task(name, ref, kind, common, body=self.call(path, spec, body.get("with"), names))
        if kind == "set":
            if not isinstance(spec, (dict, str)):
                r.add(at, "is the data to set: a mapping, or a runtime expression '${ ... }'")
            return self._task(name, ref, kind, common, body=self.tree(at, spec, names))
        if kind == "switch":
            return self._task(name, ref, kind, common, body=self.switch(at, spec, names, jumps))
        if kind == "wait":
            return self._task(name, ref, kind, common, body=self.duration(at, spec, timedelta(0), WORKFLOW_WAIT_MAX))
        if kind == "raise":
            return self._task(name, ref, kind, common, body=self.raise_(at, spec, names))
        if kind == "do":
            return self._task(name, ref, kind, common, lists=(self.task_list(at, spec, names),))
        try_ref = self.task_list(at, spec, names)
        if "catch" not in body:
            r.add(path, "a try needs its catch: which errors it takes, and what then")
            return None
        return self._task(name, ref, kind, common, lists=(try_ref,), catch=self.catch(path + ("catch",), body["catch"], names))

    def _task(self, name: str, ref: str, kind: str, common: dict[str, Any], **kw: Any) -> WfTask:
        task = WfTask(name=name, ref=ref, kind=kind, **common, **kw)
        self.tasks[ref] = task
        return task

    def call(self, path: tuple[Any, ...], call: Any, with_: Any, names: tuple[str, ...]) -> WfCall | None:
        r = self.r
        if call != "run_definition":
            r.add(path + ("call",), f"calls {call!r}; interactiond runs call: run_definition, with a function or"
                  " workflow of this playbook (http, grpc, openapi and asyncapi calls are not run)")
            return None
        w = r.mapping(path + ("with",), with_, ("type", "name", "input"), required=("name",))
        if w is None:
            return None
        type_ = w.get("type", "interaction")
        if type_ not in ("interaction", "workflow"):
            r.add(path + ("with", "type"), f"{type_!r} is not a definition type: interaction or workflow")
            return None
        fn = w.get("name")
        if not isinstance(fn, str) or not FUNCTION_NAME_RE.fullmatch(fn):
            r.add(path + ("with", "name"), "is the name of a definition of this playbook, written out (not an expression):"
                  " 1 to 128 lowercase letters, digits, hyphens and underscores")
            return None
        self.calls.append((type_, fn, r.line(path + ("with", "name")), ".".join(map(str, path + ("with", "name")))))
        return WfCall(type_, fn, self.tree(path + ("with", "input"), w.get("input", {}), names))

    def switch(self, path: tuple[Any, ...], spec: Any, names: tuple[str, ...],
               jumps: list[tuple[tuple[Any, ...], Any]]) -> tuple[WfCase, ...]:
        r = self.r
        if not isinstance(spec, list) or not spec:
            r.add(path, "is a list of named cases, such as - approved: {when: '${ .approved }', then: publish}")
            return ()
        cases = []
        defaults = 0
        for i, item in enumerate(spec):
            at = path + (i,)
            if not isinstance(item, dict) or len(item) != 1:
                r.add(at, "is one named case: a mapping with a single key, the case's name")
                continue
            (cname, case), = item.items()
            c = r.mapping(at + (cname,), case, ("when", "then"), required=("then",))
            if c is None or "then" not in c:
                continue
            when = self.expr(at + (cname, "when"), c["when"], names) if "when" in c else None
            defaults += "when" not in c
            jumps.append((at + (cname, "then"), c["then"]))
            cases.append(WfCase(str(cname), when, c["then"] if isinstance(c["then"], str) else "continue"))
        if defaults > 1:
            r.add(path, "has more than one default case (a case without when)")
        return tuple(cases)

    def raise_(self, path: tuple[Any, ...], spec: Any, names: tuple[str, ...]) -> dict[str, Any] | None:
        r = self.r
        block = r.mapping(path, spec, ("error",), required=("error",))
        if block is None or "error" not in block:
            return None
        at = path + ("error",)
        err = r.mapping(at, block["error"], ("type", "status", "title", "detail", "kind", "instance"),
                        required=("type", "status"))
        if err is None:
            return None
        if "type" in err and (not isinstance(err["type"], str) or not err["type"].strip() or "${" in err["type"]):
            r.add(at + ("type",), "is the error's type, a URI such as https://serverlessworkflow.io/spec/1.0.0/errors/validation")
        status = err.get("status")
        if "status" in err and (isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599):
            r.add(at + ("status",), "is an HTTP status, 100 to 599")
        for key in ("kind", "instance"):
            if key in err and not isinstance(err[key], str):
                r.add(at + (key,), "is a text")
        return {k: (self.tree(at + (k,), v, names) if k in ("title", "detail") else v) for k, v in err.items()}

    def catch(self, path: tuple[Any, ...], spec: Any, names: tuple[str, ...]) -> WfCatch | None:
        r = self.r
        c = r.mapping(path, spec, ("errors", "as", "when", "exceptWhen", "retry", "do"))
        if c is None:
            return None
        with_: dict[str, Any] = {}
        if "errors" in c:
            errors = r.mapping(path + ("errors",), c["errors"], ("with",))
            if errors is not None and "with" in errors:
                at = path + ("errors", "with")
                w = r.mapping(at, errors["with"], ("type", "status", "kind", "instance"))
                for key, v in (w or {}).items():
                    if key == "status" and (isinstance(v, bool) or not isinstance(v, int)):
                        r.add(at + (key,), "is an HTTP status such as 503")
                    elif key != "status" and (not isinstance(v, str) or not v.strip()):
                        r.add(at + (key,), "is a text")
                    else:
                        with_[key] = v
        as_ = c.get("as", "error")
        if not isinstance(as_, str) or not _JQ_VAR_RE.fullmatch(as_) or as_ in _EXPR_VARS or as_ == "ENV":
            r.add(path + ("as",), f"is the name of the variable the error is kept in, such as error; not one of"
                  f" {', '.join(_EXPR_VARS)}")
            as_ = "error"
        inner = tuple(dict.fromkeys(names + (as_,)))
        when = self.expr(path + ("when",), c["when"], inner) if "when" in c else None
        except_when = self.expr(path + ("exceptWhen",), c["exceptWhen"], inner) if "exceptWhen" in c else None
        retry = self.retry(path + ("retry",), c["retry"]) if "retry" in c else None
        do = self.task_list(path + ("do",), c["do"], inner) if "do" in c else None
        if "retry" in c and "do" in c:
            r.add(path + ("do",), "a catch with retry re-raises the error once its attempts are used up, so its do"
                  " would never run; handle the error in an enclosing try instead")
        return WfCatch(with_, as_, when, except_when, retry, do)

    def retry(self, path: tuple[Any, ...], spec: Any) -> WfRetry | None:
        r = self.r
        if isinstance(spec, str):
            r.add(path, "is a retry policy written out (interactiond has no use.retries to name one from)")
            return None
        block = r.mapping(path, spec, ("delay", "backoff", "limit"))
        if block is None:
            return None
        delay = self.duration(path + ("delay",), block["delay"], timedelta(0), WORKFLOW_WAIT_MAX) if "delay" in block else 0
        backoff = "constant"
        if "backoff" in block:
            b = r.mapping(path + ("backoff",), block["backoff"], ("constant", "linear", "exponential"))
            if b is not None:
                if len(b) != 1:
                    r.add(path + ("backoff",), "names one of constant, linear and exponential, such as {exponential: {}}")
                else:
                    backoff = next(iter(b))
        count = limit = None
        lim = r.mapping(path + ("limit",), block.get("limit"), ("attempt", "duration")) if "limit" in block else None
        if lim is not None:
            if "attempt" in lim:
                att = r.mapping(path + ("limit", "attempt"), lim["attempt"], ("count",), required=("count",))
                n = (att or {}).get("count")
                if att is not None and "count" in att:
                    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= WORKFLOW_MAX_ATTEMPTS:
                        r.add(path + ("limit", "attempt", "count"),
                              f"is the number of attempts in all, the first included: 1 to {WORKFLOW_MAX_ATTEMPTS}")
                    else:
                        count = n
            if "duration" in lim:
                limit = self.duration(path + ("limit", "duration"), lim["duration"], timedelta(seconds=1), WORKFLOW_TIMEOUT_MAX)
        if count is None and limit is None and not any(p["field"].startswith(".".join(map(str, path))) for p in r.problems):
            r.add(path, "needs limit.attempt.count or limit.duration, so the retries end")
        if delay is None:
            return None
        return WfRetry(delay, backoff, count, limit)


# The overview.

def workflow_overview(doc: WorkflowDoc) -> str:
    """The workflow in plain Markdown: what it needs and what each task does."""
    parts = [doc.description.strip() if doc.description else "This workflow has no summary yet."]
    parts.append("**What it needs:**\n" + _schema_words(doc.input_schema, "Any input; the document gives no schema.",
                                                       "An input whose fields the schema does not list"))
    parts.append("**What it does:**\n" + "\n".join(_list_words(doc, "/do", 0)))
    return "\n\n".join(parts) + "\n"


def _list_words(doc: WorkflowDoc, ref: str, depth: int) -> list[str]:
    out = []
    for t in doc.lists.get(ref, ()):
        out += _task_words(doc, t, depth)
    return out


def _catch_words(c: WfCatch) -> str:
    f = c.with_
    if not f:
        return "any error"
    what = " ".join(x for x in (_error_name(f["type"]) if f.get("type") else "an error",
                                 f.get("kind") and f"({f['kind']})", f.get("status") and f"of status {f['status']}") if x)
    if f.get("instance"):
        what += f" from {f['instance']}"
    if c.when is not None or c.except_when is not None:
        what += " (under a condition)"
    return what


def _task_words(doc: WorkflowDoc, t: WfTask, depth: int) -> list[str]:
    pad = "  " * depth
    words = {"set": "sets the data", "switch": "chooses what comes next by its cases",
             "try": "tries these tasks:", "do": "does these tasks:"}.get(t.kind, "")
    if t.kind == "raise" and t.body is not None:
        words = f"raises the error {_error_name(t.body.get('type', ''))} (status {t.body.get('status')})"
    elif t.kind == "call" and t.body is not None:
        words = f"runs the {t.body.type} **{t.body.name}** and waits for its ending"
    elif t.kind == "wait" and t.body is not None:
        words = f"waits {duration_words(timedelta(milliseconds=t.body))}"
    if t.if_ is not None:
        words = "when a condition holds, " + words
    if t.timeout_ms:
        words += f" (at most {duration_words(timedelta(milliseconds=t.timeout_ms))})"
    lines = [f"{pad}- **{t.name}** {words}"]
    for ref in t.lists:
        lines += _list_words(doc, ref, depth + 1)
    if t.catch is not None:
        c = t.catch
        if c.retry is not None:
            limit = f"up to {c.retry.count} attempts in all" if c.retry.count else "for a while"
            lines.append(f"{pad}  when they fail with {_catch_words(c)}, tries again, {limit}")
        elif c.do is not None:
            lines.append(f"{pad}  when they fail with {_catch_words(c)}:")
            lines += _list_words(doc, c.do, depth + 1)
        else:
            lines.append(f"{pad}  when they fail with {_catch_words(c)}, carries on")
    if t.then and t.then != "continue":
        lines[0] += f"; then {'goes to ' + t.then if t.then not in _FLOW else t.then + 's'}"
    return lines


# The executor.

class _Walk:
    """One transition of one workflow run, computed in memory; `Workflows` writes it."""

    def __init__(self, jq: JqRunner, doc: WorkflowDoc, run: Row, state: dict[str, Any], now: int,
                 child: Row | None, child_expires_at: int | None, start_error: dict[str, Any] | None) -> None:
        self.jq = jq
        self.doc = doc
        self.run = run
        self.state = state
        self.stack: list[dict[str, Any]] = state["stack"]
        self.now = now
        self.child = child
        self.child_expires_at = child_expires_at
        self.start_error = start_error
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.cancel: list[str] = []                    # child runs to cancel in the same change
        self.ending: tuple[RunStatus, str | None, Any, Problem | None] | None = None
        self.start_child: dict[str, Any] | None = None  # a call frame whose child must be started
        self.input = json.loads(run["input"])

    # -- what the transition leaves --------------------------------------------------------------

    def waiting(self) -> bool:
        top = self.stack[-1] if self.stack else {}
        return "child" in top or "until" in top

    def suspended(self) -> bool:
        """Nothing to do before a child ends, a wait passes or a deadline comes."""
        if self.ending is not None or not self.stack:
            return self.ending is not None
        top = self.stack[-1]
        if "child" in top:
            return self.child is not None and not RunStatus(self.child["status"]).ended
        return "until" in top and top["until"] > self.now

    def due(self) -> int | None:
        """When the run's timer must fire next; None: no timer (ended, or only a child's ending wakes it)."""
        if self.ending is not None:
            return None
        if self.start_child is not None or not self.suspended():
            return self.now + WORKFLOW_BUSY_MS
        # Moments already past were let pass for an earlier one (see _deadlines): the child's ending wakes it.
        times = [t for fr in self.stack for t in (fr.get("deadline"), fr.get("child_deadline"), fr.get("until"))
                 if t and t > self.now]
        return min(times) if times else None

    # -- moving on --------------------------------------------------------------------------------

    async def advance(self) -> None:
        """Move on until a task boundary: something happened, the run waits, or it ended."""
        for _ in range(10_000):
            before = dumps(self.state)
            await self._once()
            if self.events or self.ending is not None or self.start_child is not None or self.suspended():
                return
            if dumps(self.state) == before:
                return
        self._fail(_wf_error("failed", "the workflow skipped more than 10,000 tasks without running one", instance="/do"))

    async def _once(self) -> None:
        if not self.stack:
            await self._begin_workflow()
            return
        if await self._deadlines():
            return
        top = self.stack[-1]
        if "list" in top:
            tasks = self.doc.lists[top["list"]]
            if top["i"] >= len(tasks):
                await self._finish_list()
            else:
                await self._begin(tasks[top["i"]])
            return
        task = self.doc.tasks[top["task"]]
        if task.kind == "call":
            await self._resume_call(task, top)
        elif task.kind == "wait" and top["until"] <= self.now:
            await self._complete(task, top["input"], top["input"])
        elif task.kind == "try" and top.get("phase") == "retry" and top["until"] <= self.now:
            top["phase"] = "try"
            del top["until"]
            self.stack.append({"list": task.lists[0], "i": 0, "data": top["input"]})

    async def _begin_workflow(self) -> None:
        data = self.input
        if self.doc.input_from is not None:
            try:
                data = await self.jq.fill(self.doc.input_from, self.input, self._scope(None, self.input, self.now))
            except ExprError as exc:
                self._fail(_wf_error("expression", f"the workflow's input.from failed: {exc}", instance="/input/from"))
                return
        self.stack.append({"list": "/do", "i": 0, "data": data})

    async def _deadlines(self) -> bool:
        """Time out the outermost task whose deadline passed; True if one did.

        After the daemon was down several moments may have passed at once; the earliest one wins. So a
        child whose request expired before a deadline, or a wait that ended before it, is let end first.
        """
        top = self.stack[-1]
        first: int | None = top.get("until")
        if "child" in top and self.child is not None:
            # It ended (or its request expired, which ends it) before a deadline: its ending is taken.
            ended = self.child["ended_at"] if RunStatus(self.child["status"]).ended else None
            first = min((t for t in (ended, self.child_expires_at) if t is not None), default=None)
        for idx, fr in enumerate(self.stack):
            if "task" not in fr:
                continue
            own, bound = fr.get("deadline"), fr.get("child_deadline")
            due = min(t for t in (own, bound, math.inf) if t)
            if due > self.now or (first is not None and first <= self.now and first <= due):
                continue
            task = self.doc.tasks[fr["task"]]
            top = self.stack[-1]
            if "child" in top and self.child is not None and not RunStatus(self.child["status"]).ended:
                self.cancel.append(top["child"])
            del self.stack[idx + 1:]
            if own and own == due:
                why = f"its timeout of {duration_words(timedelta(milliseconds=task.timeout_ms or 0))} passed"
            else:
                why = "its run did not end within the function's expiry plus one minute; the request was cancelled"
            await self._fault(task, _wf_error("timeout", f"task {task.name!r} ran out of time: {why}", instance=task.ref,
                                        **({"run_id": fr["child"]} if "child" in fr else {})))
            return True
        return False

    def _scope(self, task: WfTask | None, task_input: Any, started: int, **extra: Any) -> dict[str, Any]:
        scope = {
            "input": task_input, "data": task_input, "context": self.state["context"],
            "workflow": {"id": self.run["run_id"], "input": self.input, "definition": {"document": self.doc.document},
                         "startedAt": _time_object(self.run["created_at"])},
            "task": None if task is None else {"name": task.name, "reference": task.ref, "input": task_input,
                                               "startedAt": _time_object(started)},
            "runtime": {"name": "interactiond", "version": __version__},
        }
        for fr in self.stack:
            if fr.get("phase") == "catch":
                scope[self.doc.tasks[fr["task"]].catch.as_] = fr["error"]
        scope.update(extra)
        return scope

    async def _expr_failed(self, task: WfTask, where: str, exc: ExprError) -> None:
        await self._fault(task, _wf_error("expression", f"task {task.name!r}: its {where} failed: {exc}", instance=task.ref))

    async def _begin(self, task: WfTask) -> None:
        lf = self.stack[-1]
        data = lf["data"]
        if task.if_ is not None:
            try:
                go = _truthy(await self.jq.eval(task.if_, data, self._scope(task, data, self.now)))
            except ExprError as exc:
                await self._expr_failed(task, "if", exc)
                return
            if not go:
                lf["i"] += 1
                return
        self.state["tasks"] = self.state.get("tasks", 0) + 1
        if self.state["tasks"] > WORKFLOW_MAX_TASKS:
            self._fail(_wf_error("failed", f"the run started more than {WORKFLOW_MAX_TASKS} tasks; does a then loop"
                                 " never end?", instance=task.ref))
            return
        started: dict[str, Any] = {"task": task.name, "ref": task.ref}
        self.events.append(("task_started", started))
        try:
            input_ = await self.jq.fill(task.input_from, data, self._scope(task, data, self.now)) if task.input_from is not None else data
        except ExprError as exc:
            await self._expr_failed(task, "input.from", exc)
            return
        scope = self._scope(task, input_, self.now)
        frame: dict[str, Any] = {"task": task.ref, "input": input_, "at": self.now}
        if task.timeout_ms:
            frame["deadline"] = self.now + task.timeout_ms
        try:
            if task.kind == "set":
                await self._complete(task, await self.jq.fill(task.body, input_, scope), input_)
            elif task.kind == "switch":
                chosen = None
                for case in task.body:
                    if case.when is not None and _truthy(await self.jq.eval(case.when, input_, scope)):
                        chosen = case
                        break
                chosen = chosen or next((c for c in task.body if c.when is None), None)
                await self._complete(task, input_, input_, then=chosen.then if chosen else None)
            elif task.kind == "raise":
                await self._fault(task, self._raised(task, await self.jq.fill(task.body, input_, scope)))
            elif task.kind == "wait":
                frame["until"] = self.now + task.body
                self.stack.append(frame)
            elif task.kind == "call":
                call: WfCall = task.body
                frame.update(child=new_run_id(), fn=[call.type, call.name], child_input=await self.jq.fill(call.input, input_, scope))
                started["run"] = {"type": call.type, "name": call.name, "run_id": frame["child"]}
                self.stack.append(frame)
            elif task.kind == "try":
                frame.update(phase="try", attempt=1)
                self.stack += [frame, {"list": task.lists[0], "i": 0, "data": input_}]
            else:
                self.stack += [frame, {"list": task.lists[0], "i": 0, "data": input_}]
        except ExprError as exc:
            await self._expr_failed(task, task.kind, exc)

    @staticmethod
    def _raised(task: WfTask, err: dict[str, Any]) -> dict[str, Any]:
        type_ = str(err["type"])
        if type_.startswith(_ERROR_PREFIXES):
            type_ = PROBLEM_BASE + _error_name(type_)
        out = {"type": type_, "title": err.get("title") or _error_name(type_).replace("_", " ").capitalize(),
               "status": err["status"], "detail": err.get("detail") or f"task {task.name!r} raised it",
               "instance": err.get("instance") or task.ref}
        if err.get("kind") is not None:
            out["kind"] = err["kind"]
        return out

    async def _resume_call(self, task: WfTask, fr: dict[str, Any]) -> None:
        child = self.child
        if child is None:
            if self.start_error is not None:
                await self._fault(task, dict(self.start_error, instance=task.ref, run_id=fr["child"]))
            else:
                self.start_child = fr
            return
        if not RunStatus(child["status"]).ended:
            if "child_deadline" not in fr:                 # its bound, once the child run exists
                if self.child_expires_at is not None:
                    fr["child_deadline"] = self.child_expires_at + WORKFLOW_STEP_GRACE_MS
                elif child["type"] == "interaction":       # a system call: 70 s at most
                    fr["child_deadline"] = fr["at"] + int(SYSTEM_CALL_TOTAL_S * 1000) + WORKFLOW_STEP_GRACE_MS
                else:
                    fr["child_deadline"] = None            # a workflow: only a timeout bounds it
            return
        if child["status"] == RunStatus.SUCCEEDED.value:
            output = json.loads(child["output"]) if child["output"] is not None else None
            await self._complete(task, output, fr["input"], run_id=child["run_id"])
            return
        body = json.loads(child["problem"]) if child["problem"] else Problem("failed", "the run failed").body()
        await self._fault(task, dict(body, status=CHILD_ERROR_STATUS.get(child["status"], 500), instance=task.ref,
                               run_id=child["run_id"]))

    async def _complete(self, task: WfTask, raw: Any, task_input: Any, *, then: str | None = None,
                  run_id: str | None = None) -> None:
        top = self.stack[-1]
        started = top["at"] if top.get("task") == task.ref else self.now
        scope = self._scope(task, task_input, started)
        out = raw
        try:
            if task.output_as is not None:
                out = await self.jq.fill(task.output_as, raw, scope)
            if task.export_as is not None:
                self.state["context"] = await self.jq.fill(task.export_as, out, scope)
        except ExprError as exc:
            await self._expr_failed(task, "output.as" if task.output_as is not None else "export.as", exc)
            return
        if top.get("task") == task.ref:
            self.stack.pop()
        done: dict[str, Any] = {"task": task.name, "ref": task.ref, "output": out}
        if run_id is not None:
            done["run_id"] = run_id
        self.events.append(("task_completed", done))
        await self._flow(then or task.then or "continue", out)

    async def _flow(self, then: str, out: Any) -> None:
        lf = self.stack[-1]
        tasks = self.doc.lists[lf["list"]]
        lf["data"] = out
        if then == "continue":
            lf["i"] += 1
        elif then == "exit":
            lf["i"] = len(tasks)
        elif then == "end":
            await self._end(out)
        else:
            lf["i"] = next(i for i, t in enumerate(tasks) if t.name == then)

    async def _finish_list(self) -> None:
        lf = self.stack.pop()
        if not self.stack:
            await self._end(lf["data"])
            return
        owner = self.stack[-1]
        await self._complete(self.doc.tasks[owner["task"]], lf["data"], owner["input"])

    async def _end(self, out: Any) -> None:
        if self.doc.output_as is not None:
            try:
                out = await self.jq.fill(self.doc.output_as, out, self._scope(None, out, self.now))
            except ExprError as exc:
                self._fail(_wf_error("expression", f"the workflow's output.as failed: {exc}", instance="/output/as"))
                return
        self.ending = (RunStatus.SUCCEEDED, None, out, None)

    def _fail(self, error: dict[str, Any]) -> None:
        """An error nobody caught: the run ends as its status implies, the error its problem."""
        status = _WORKFLOW_ENDINGS.get(error.get("status"), RunStatus.FAILED)
        name = _error_name(error.get("type", "failed"))
        problem = Problem(name, str(error.get("detail", "")), status=error.get("status"), kind=error.get("kind"),
                          title=error.get("title"))
        problem.extra = {k: v for k, v in error.items() if k not in ("title", "status", "detail", "kind")}
        self.ending = (status, error.get("kind"), None, problem)

    async def _fault(self, task: WfTask, error: dict[str, Any]) -> None:
        """`task` raised `error`: it ends faulted, and the error climbs to the nearest try that takes it."""
        faulted = {"task": task.name, "ref": task.ref, "error": error}
        self.events.append(("task_faulted", faulted))
        if self.stack and self.stack[-1].get("task") == task.ref:
            self.stack.pop()
        while self.stack:
            top = self.stack[-1]
            if "list" in top:
                self.stack.pop()
                continue
            owner = self.doc.tasks[top["task"]]
            if owner.kind == "try" and top.get("phase") == "try":
                taken, error = await self._catch(owner, top, error)
                if taken:
                    return
            self.events.append(("task_faulted", {"task": owner.name, "ref": owner.ref, "error": error}))
            self.stack.pop()
        self._fail(error)

    async def _catch(self, task: WfTask, fr: dict[str, Any], error: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        c = task.catch
        assert c is not None
        for key, want in c.with_.items():
            got = error.get(key)
            if (key == "type" and _error_name(got or "") != _error_name(want)) or (key != "type" and got != want):
                return False, error
        scope = self._scope(task, fr["input"], fr["at"], **{c.as_: error})
        try:
            if c.when is not None and not _truthy(await self.jq.eval(c.when, error, scope)):
                return False, error
            if c.except_when is not None and _truthy(await self.jq.eval(c.except_when, error, scope)):
                return False, error
        except ExprError as exc:
            return False, _wf_error("expression", f"task {task.name!r}: its catch's condition failed: {exc}",
                                    instance=task.ref)
        if c.retry is not None:
            r = c.retry
            attempt = fr["attempt"]
            wait = r.delay(attempt)
            if (r.count is None or attempt < r.count) and (r.limit_ms is None or self.now + wait - fr["at"] <= r.limit_ms):
                fr.update(phase="retry", attempt=attempt + 1, until=self.now + wait)
                self.events.append(("task_retried", {"task": task.name, "ref": task.ref, "attempt": attempt + 1,
                                                     "delay_ms": wait, "at": fmt_time(self.now + wait), "error": error}))
                return True, error
            return False, error                          # retries used up: the error goes on up
        fr.update(phase="catch", error=error)
        if c.do is not None:
            self.stack.append({"list": c.do, "i": 0, "data": fr["input"]})
        else:
            await self._complete(task, fr["input"], fr["input"])
        return True, error


class Workflows:
    """The `workflow` run kind (RunKind): its documents, its start, every transition, its cancel, its uses."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._busy: dict[tuple[str, str], bool] = {}              # run -> drive again when done
        self._start_errors: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
        self.jq = JqRunner()

    async def close(self) -> None:
        await self.jq.close()

    def parse(self, source: str, name: str | None = None) -> WorkflowDoc:
        return parse_workflow(source, name)

    async def on_timer(self, playbook: str, ref: str) -> None:
        await self.drive(playbook, ref)

    # -- definitions ----------------------------------------------------------------------------

    async def used_by(self, playbook: str, type_: str, name: str) -> list[dict[str, Any]]:
        """The active workflows of the playbook that call this definition."""
        rows = await self.engine.store.read(lambda tx: tx.workflows_calling(playbook, type_, name))
        return [{"type": "workflow", "name": r["name"], "version": r["version"]} for r in rows]

    async def warnings(self, playbook: str, doc: WorkflowDoc) -> list[dict[str, Any]]:
        """Calls of definitions that do not exist (yet): saved anyway, a run fails at that task."""
        known = await self.engine.store.read(lambda tx: tx.defined_names(playbook))
        return [{"line": line, "field": field,
                 "message": f"no {type_} named {name!r} in this playbook yet; a run fails at this task until it exists"}
                for type_, name, line, field in doc.calls if (type_, name) not in known]

    # -- runs -----------------------------------------------------------------------------------

    async def start(self, caller: Caller, playbook: str, name: str, version: int, doc: WorkflowDoc, input_: Any,
                    run_id: str, input_text: str, input_sha: str, parent: str | None) -> tuple[dict[str, Any], bool]:
        """The run row, with its timer due now: the first transition follows on the timer task."""
        now = self.engine.clock.now_ms()
        ending: Problem | None = None
        if doc.input_validator is not None:
            errors = schema_errors(doc.input_validator, input_, "/input")
            if errors:
                ending = ended("invalid_input", "the input does not match the workflow's"
                                        " input schema", errors=errors)
        state = dumps({"stack": [], "context": {}, "tasks": 0})

        def change(tx: Tx, fx: Effects) -> tuple[dict[str, Any], bool]:
            if not tx.insert_run(playbook=playbook, run_id=run_id, type_="workflow", name=name, version=version,
                          input_text=input_text, input_sha=input_sha, parent=parent, state=state,
                          now=now, by=caller.id):
                return rerun_check(tx.run(playbook, run_id), "workflow", name, input_sha), False
            # Raising rolls the new row back with the rest of the change.
            if parent is not None and tx.run_depth(playbook, parent) >= WORKFLOW_MAX_DEPTH:
                raise ended("unworkable", f"workflows nest at most {WORKFLOW_MAX_DEPTH} deep")
            if ending is not None:
                end(tx, fx, playbook, run_id, ending, now=now, by=caller.id)
            else:
                tx.set_timer(fx, timer_key("workflow", playbook, run_id), now)
            return run_object(tx.run(playbook, run_id)), True
        return await self.engine.store.write(change)

    async def drive(self, playbook: str, run_id: str) -> None:
        """Move a run on as far as it goes now; one drive per run at a time, asked again if busy. Of the
        daemons sharing a database, the one that holds the run's lease drives it (Store.claim), and a
        daemon refused meanwhile has the holder drive it again."""
        key = (playbook, run_id)
        if key in self._busy:
            self._busy[key] = True
            return
        self._busy[key] = False
        lease = timer_key("workflow", playbook, run_id)
        held = False
        try:
            while held := await self.engine.store.claim(lease):
                while True:
                    if await self._step(playbook, run_id):
                        continue
                    if not self._busy[key]:
                        break
                    self._busy[key] = False
                held = False
                if not await self.engine.store.release(lease):
                    break
        finally:
            self._busy.pop(key, None)
            self._start_errors.pop(key, None)
            if held:
                with contextlib.suppress(Exception):
                    await self.engine.store.release(lease)

    async def _doc(self, run: Row) -> WorkflowDoc:
        return (await self.engine.document(run["playbook"], "workflow", run["name"], run["version"]))[1]

    async def _step(self, playbook: str, run_id: str) -> bool:
        """One transition, written; True when there is more to do at once."""
        engine = self.engine
        key = timer_key("workflow", playbook, run_id)

        def look(tx: Tx) -> tuple[Any, ...]:
            run = tx.run(playbook, run_id)
            timer_due = tx.timer_due(key)
            child = expires = None
            stack = json.loads(run["state"])["stack"] if run is not None and run["state"] else []
            if stack and "child" in stack[-1]:
                child = tx.run(playbook, stack[-1]["child"])
                expires = tx.request_expiry(playbook, stack[-1]["child"])
            return run, timer_due, child, expires

        run, timer_due, child, expires = await engine.store.read(look)
        if run is None or run["type"] != "workflow" or not run["state"]:
            return False
        if RunStatus(run["status"]).ended:
            # Ended meanwhile (cancelled while a child was being started): leave nothing behind.
            if timer_due is not None or (child is not None and not RunStatus(child["status"]).ended):
                await engine.store.write(lambda tx, fx: self._tidy(tx, fx, run, key))
            return False
        now = engine.clock.now_ms()
        doc = await self._doc(run)
        state = json.loads(run["state"])
        failed = self._start_errors.get((playbook, run_id))
        top = state["stack"][-1] if state["stack"] else {}
        walk = _Walk(self.jq, doc, run, state, now, child, expires,
                     failed[1] if failed is not None and failed[0] == top.get("child") else None)
        try:
            await walk.advance()
        except Exception:
            log.exception("workflow run %s broke down", run_id)
            walk = _Walk(self.jq, doc, run, json.loads(run["state"]), now, child, expires, None)
            walk._fail(_wf_error("failed", "the daemon broke down while running the workflow", instance="/do"))
        new_state = dumps(walk.state)
        if walk.ending is None and len(new_state.encode()) > WORKFLOW_MAX_STATE_BYTES:
            walk.events.clear()
            walk._fail(_wf_error("failed", f"the workflow's data passed {WORKFLOW_MAX_STATE_BYTES // MIB} MiB",
                                 instance="/do"))
            new_state = run["state"]
        status = RunStatus.WAITING if walk.waiting() else RunStatus.STARTED
        due = walk.due()
        if (not walk.events and walk.ending is None and not walk.cancel and new_state == run["state"]
                and status.value == run["status"] and due == timer_due):
            if walk.start_child is None:
                return False
        else:
            live_child = child["run_id"] if child is not None and not RunStatus(child["status"]).ended else None

            def change(tx: Tx, fx: Effects) -> bool:
                # Guarded by what it read: the run still live at the state it was computed from, and
                # the child it saw live still live; else it (or its child) moved meanwhile: look again.
                if not tx.step_workflow(playbook, run_id, read=run["state"], state=new_state, status=status,
                                        live_child=live_child):
                    return False
                for type_, payload in walk.events:
                    tx.append_event(fx, playbook, run_id, type_, now, "interactiond", payload)
                for child_id in walk.cancel:
                    self._cancel_child(tx, fx, playbook, child_id, now, "interactiond")
                if walk.ending is not None:
                    end_status, kind, output, problem = walk.ending
                    tx.end_run(fx, playbook, run_id, end_status, now=now, by="interactiond", kind=kind,
                               output=output, problem=problem)
                if due is None:
                    tx.drop_timer(fx, key)
                else:
                    tx.set_timer(fx, key, due)
                return True
            if not await engine.store.write(change):
                return True
        if walk.start_child is not None:
            await self._start_child(run, walk.start_child)
            return True
        moved = bool(walk.events) or new_state != run["state"]
        return walk.ending is None and not walk.suspended() and moved

    async def _start_child(self, run: Row, fr: dict[str, Any]) -> None:
        playbook, run_id = run["playbook"], run["run_id"]
        caller = Caller(run["created_by"], Role.WRITER, playbook)
        type_, name = fr["fn"]
        try:
            await self.engine.run_definition(caller, playbook, type_, name, fr["child_input"], run_id=fr["child"],
                                              parent=run_id)
        except Problem as exc:
            body = exc.body()
            if exc.name == "not_found":
                body["detail"] = (f"task {self._task_name(fr)!r} runs the {type_} {name!r}, which does not exist in this"
                                  " playbook (or was deleted); save it, then run the workflow again")
            self._start_errors[(playbook, run_id)] = (fr["child"], body)
        except Exception:
            log.exception("starting a child run of workflow run %s failed", run_id)
            self._start_errors[(playbook, run_id)] = (fr["child"], Problem("failed", "the child run could not be started").body())

    @staticmethod
    def _task_name(fr: dict[str, Any]) -> str:
        return pointer_parse(fr["task"])[-1]

    # -- cancelling -----------------------------------------------------------------------------

    def _cancel_child(self, tx: Tx, fx: Effects, playbook: str, child_id: str, now: int,
                      by: str) -> None:
        """Cancel a workflow's open child run inside the workflow's change (a system call in flight ends alone)."""
        child = tx.child_to_cancel(playbook, child_id)
        if child is not None:
            self.engine.cancel_in(tx, fx, child, now, by)

    def cancel_in(self, tx: Tx, fx: Effects, run: Row, now: int, by: str) -> None:
        """cancel_run of a live workflow: its open child is cancelled and it ends cancelled, together."""
        stack = json.loads(run["state"])["stack"] if run["state"] else []
        for fr in stack:
            if "child" in fr:
                self._cancel_child(tx, fx, run["playbook"], fr["child"], now, by)
        end_cancelled(tx, fx, run["playbook"], run["run_id"], now=now, by=by)
        tx.drop_timer(fx, timer_key("workflow", run["playbook"], run["run_id"]))

    def _tidy(self, tx: Tx, fx: Effects, run: Row, key: str) -> None:
        stack = json.loads(run["state"])["stack"] if run["state"] else []
        if stack and "child" in stack[-1]:
            self._cancel_child(tx, fx, run["playbook"], stack[-1]["child"], self.engine.clock.now_ms(), "interactiond")
        tx.drop_timer(fx, key)


RUN_KINDS["workflow"] = Workflows


# HTTP API #######################################################################################
#
# Thin handlers over Engine methods. One middleware turns every error into problem+json and
# authenticates: `Authorization: Bearer <token>`, or the inbox page's session cookie (then a
# state-changing request must also carry a matching Origin). The route table below is the single
# source of both the router and /openapi.json, so the two cannot drift apart.

@functools.cache
def state_key(name: str, kind: Any, request: bool = False) -> Any:
    """The typed key of the app's (or, with `request`, a request's) state `name`, one object a name.

    Made on first use, with aiohttp, which loads only where an app is built or a response made.
    """
    from aiohttp import web
    return web.RequestKey(name, kind) if request else web.AppKey(name, kind)


def _v2_code(resp: web.StreamResponse) -> None:
    """Every problem on /v2 carries `code` beside the problem fields, also those of auth and routing."""
    from aiohttp import web
    if (isinstance(resp, web.Response) and resp.content_type == "application/problem+json"
            and isinstance(resp.body, bytes)):
        body = json.loads(resp.body)
        if "code" not in body:
            body["code"] = str(body.get("type", "")).rsplit("/", 1)[-1]
            resp.text = dumps(body)         # its headers stand (WWW-Authenticate, X-Request-Id)


engine_key: Final = functools.partial(state_key, "engine", Engine)
tokens_key: Final = functools.partial(state_key, "tokens", dict)
caller_key: Final = functools.partial(state_key, "caller", Caller, True)
SESSION_COOKIE: Final = "interactiond_session"
TOKEN_CACHE_S: Final = 2.0          # a revoked token stops working within this long
PB: Final = "/v1/orgs/{org}/playbooks/{playbook}"
PUBLIC_PATHS: Final = ("/healthz", "/openapi.json", "/problems/", "/login", "/favicon.ico", "/a/")
#: What every 401 answers in `WWW-Authenticate` (RFC 6750), so a client names the failure.
BEARER_CHALLENGE: Final = 'Bearer realm="interactiond"'


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Callable[[web.Request], Any]
    summary: str
    role: Role = Role.READER
    body: dict[str, Any] | None = None          # JSON schema of the request body, for OpenAPI
    query: tuple[str, ...] = ()
    public: bool = False
    media: str = "application/json"             # what a 200 carries, for OpenAPI
    person: bool = False                        # a person's caller may call it (else it is 404 to them)


async def _json_body(request: web.Request) -> dict[str, Any]:
    from aiohttp import web
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise Problem("too_large", f"the body is larger than {MAX_BODY_BYTES // MIB} MiB") from None
    if not raw:
        return {}
    body = body_json(raw)
    if not isinstance(body, dict):
        raise bad_request("the body is a JSON object")
    return body


def body_json(raw: bytes) -> Any:
    """A request body's JSON, or a 400 problem saying why it is not JSON the daemon reads (every route)."""
    try:
        return read_json(raw)
    except JsonRefused as exc:
        raise bad_request(f"the body is refused: {exc}",
                          errors=[{"pointer": exc.pointer, "message": str(exc)}] if exc.pointer else None) from None


def _json(data: Any, status: int = 200) -> web.Response:
    from aiohttp import web
    try:                                # orjson's bytes as they are: no round trip through str
        body = _orjson.dumps(data) if _orjson is not None else dumps(data).encode()
    except TypeError:
        body = dumps(data).encode()
    return web.Response(body=body, status=status, content_type="application/json", charset="utf-8")


def problem_response(exc: Problem) -> web.Response:
    from aiohttp import web
    resp = web.Response(text=dumps(exc.body()), status=exc.status, content_type="application/problem+json")
    if exc.status == 401:
        resp.headers["WWW-Authenticate"] = BEARER_CHALLENGE
    return resp


def _run_response(run: dict[str, Any], fresh: bool = False) -> web.Response:
    status = RUN_HTTP_STATUS[RunStatus(run["status"])]
    if fresh and status == 200:
        status = 201
    return _json(run, status)


def _caller(request: web.Request) -> Caller:
    return request[caller_key()]


def _pb(request: web.Request) -> str:
    engine = request.app[engine_key()]
    return engine.playbook(_caller(request), f"{request.match_info['org']}/{request.match_info['playbook']}")


def _str_field(body: dict[str, Any], key: str, *, required: bool = True) -> Any:
    value = body.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise Problem("invalid_request", f"{key} is required text",
                      errors=[{"pointer": f"/{key}", "message": "required text"}])
    return value


async def h_healthz(request: web.Request) -> web.Response:
    return _json({"ok": True, "version": __version__})


async def h_create_definition(request: web.Request) -> web.Response:
    body = await _json_body(request)
    engine = request.app[engine_key()]
    d, created = await engine.create_definition(_caller(request), _pb(request), body.get("type", "interaction"),
                                                _str_field(body, "name"), _str_field(body, "source"))
    return _json(d, 201 if created else 200)


async def h_list_definitions(request: web.Request) -> web.Response:
    engine = request.app[engine_key()]
    return _json({"data": await engine.list_definitions(_caller(request), _pb(request), request.query.get("type"))})


def _version_param(request: web.Request) -> int | None:
    v = request.query.get("version")
    if v is None:
        return None
    if not (v.isascii() and v.isdigit()) or len(v) > 19 or not 1 <= int(v) <= MAX_SQL_INT:
        raise Problem("invalid_request", "version is a whole number from 1 on",
                      errors=[{"pointer": "/version", "message": "a whole number from 1 on"}])
    return int(v)


async def h_get_definition(request: web.Request) -> web.Response:
    engine = request.app[engine_key()]
    return _json(await engine.get_definition(_caller(request), _pb(request), request.match_info["type"],
                                             request.match_info["name"], _version_param(request)))


async def h_delete_definition(request: web.Request) -> web.Response:
    engine = request.app[engine_key()]
    return _json(await engine.delete_definition(_caller(request), _pb(request), request.match_info["type"],
                                                request.match_info["name"]))


async def h_run_definition(request: web.Request) -> web.Response:
    body = await _json_body(request)
    engine = request.app[engine_key()]
    run, fresh = await engine.run_definition(_caller(request), _pb(request), body.get("type", "interaction"),
                                             _str_field(body, "name"), body.get("input"),
                                             _str_field(body, "run_id", required=False))
    return _run_response(run, fresh)


async def h_list_runs(request: web.Request) -> web.Response:
    q = request.query
    engine = request.app[engine_key()]
    return _json(await engine.list_runs(_caller(request), _pb(request), q.get("status"), q.get("function"),
                                        q.get("limit"), q.get("cursor")))


async def h_get_run(request: web.Request) -> web.Response:
    engine = request.app[engine_key()]
    return _json(await engine.get_run(_caller(request), _pb(request), request.match_info["run_id"]))


async def h_wait_run(request: web.Request) -> web.Response:
    # `timeout`, as the MCP tool names it too (`max_wait` is its alias on both); a longer wait than
    # one call holds is cut to the longest, and the response says so in a header.
    name = "timeout" if "timeout" in request.query or "max_wait" not in request.query else "max_wait"
    try:
        timeout = float(request.query.get(name, "30"))
    except ValueError:
        timeout = -1
    if not 0 <= timeout < math.inf:
        raise Problem("invalid_request", f"{name} is a number of seconds, 0 or more (at most {MAX_HTTP_WAIT_S:g} are waited)",
                      errors=[{"pointer": f"/{name}", "message": "a number of seconds, 0 or more"}])
    cut = timeout > MAX_HTTP_WAIT_S
    engine = request.app[engine_key()]
    run = await engine.wait_run(_caller(request), _pb(request), request.match_info["run_id"],
                                min(timeout, MAX_HTTP_WAIT_S))
    resp = _run_response(run)
    if cut:
        resp.headers[WAIT_CUT_HEADER] = f"{MAX_HTTP_WAIT_S:g}"
    return resp


#: Set when a wait asked for longer than one call holds: the seconds it waited at most.
WAIT_CUT_HEADER: Final = "X-Timeout-Cut-To"


def run_loop(main: Any) -> Any:
    """Run the daemon's coroutine on uvloop where it is installed (`pip install 'interactiond[fast]'`):
    the same daemon, with the loop's own work (sockets, transports, wake-ups from the store's
    threads) done in C. INTERACTIOND_LOOP=asyncio keeps the standard library's loop."""
    if os.environ.get("INTERACTIOND_LOOP", "").lower() != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(main)
    return asyncio.run(main)


async def h_cancel_run(request: web.Request) -> web.Response:
    engine = request.app[engine_key()]
    return _json(await engine.cancel_run(_caller(request), _pb(request), request.match_info["run_id"]))


async def h_run_events(request: web.Request) -> web.Response:
    q = request.query
    engine = request.app[engine_key()]
    return _json(await engine.list_run_events(_caller(request), _pb(request), request.match_info["run_id"],
                                              q.get("limit"), q.get("cursor")))


async def h_get_event(request: web.Request) -> web.Response:
    engine = request.app[engine_key()]
    return _json(await engine.get_event(_caller(request), _pb(request), request.match_info["event_id"]))


async def h_playbook_events(request: web.Request) -> web.Response:
    q = request.query
    engine = request.app[engine_key()]
    return _json(await engine.list_playbook_events(_caller(request), _pb(request), q.get("type"), q.get("limit"),
                                                   q.get("cursor")))


async def h_list_interactions(request: web.Request) -> web.Response:
    q = request.query
    engine = request.app[engine_key()]
    return _json(await engine.list_interactions(_caller(request), _pb(request), q.get("to"), q.get("type"),
                                                q.get("function"), q.get("limit"), q.get("cursor")))


async def h_answer(request: web.Request) -> web.Response:
    body = await _json_body(request)
    if "answer" not in body:
        raise Problem("invalid_request", "answer is required", errors=[{"pointer": "/answer", "message": "required"}])
    engine = request.app[engine_key()]
    fact, _ = await engine.answer_interaction(_caller(request), _pb(request), request.match_info["run_id"],
                                              body["answer"], body.get("claimed_for"), digest=body.get("digest"))
    return _json(fact)


async def h_search(request: web.Request) -> web.Response:
    engine = request.app[engine_key()]
    return _json(await engine.search(_caller(request), _pb(request), request.query.get("query")))


async def h_introspect(request: web.Request) -> web.Response:
    engine = request.app[engine_key()]
    m = request.match_info
    return _json(await engine.introspect(_caller(request), _pb(request), m["server"], m["tool"]))


async def h_execute(request: web.Request) -> web.Response:
    body = await _json_body(request)
    engine = request.app[engine_key()]
    m = request.match_info
    out = await engine.execute_tool(_caller(request), _pb(request), m["server"], m["tool"], body.get("arguments", {}),
                                    body.get("approve"))
    return _run_response(out) if "run_id" in out else _json(out)      # a gated call: the run that waits


async def h_clock(request: web.Request) -> web.Response:
    engine = request.app[engine_key()]
    if not engine.clock.manual:
        raise Problem("conflict", "the clock is the system's; start the daemon with --clock manual to move it")
    body = await _json_body(request)
    try:
        delta = parse_duration(body.get("advance", "PT0S"))
        if engine.clock.now_ms() + delta.total_seconds() * 1000 > MAX_TIME_MS:
            raise ValueError(f"the clock would pass {fmt_time(MAX_TIME_MS)}, the last time the daemon writes")
    except ValueError as exc:
        raise Problem("invalid_request", str(exc), errors=[{"pointer": "/advance", "message": str(exc)}]) from None
    await engine.advance(delta)
    return _json({"now": fmt_time(engine.clock.now_ms())})


async def h_create_link(request: web.Request) -> web.Response:
    body = await _json_body(request)
    engine, playbook = request.app[engine_key()], _pb(request)
    try:
        person = person_name(body["for"]) if body.get("for") is not None else None
    except ValueError as exc:
        raise Problem("invalid_request", str(exc), errors=[{"pointer": "/for", "message": str(exc)}]) from None
    try:
        lasts = parse_duration(body.get("expires", "P7D"))
        if not EXPIRES_MIN <= lasts <= LOGIN_LINK_MAX:
            raise ValueError(f"a sign-in link lasts from {EXPIRES_MIN.seconds // 60} minute to"
                             f" {LOGIN_LINK_MAX.days} days")
    except (ValueError, TypeError) as exc:
        raise Problem("invalid_request", f"expires: {exc}", errors=[{"pointer": "/expires", "message": str(exc)}]) from None
    url, expires_at = await make_login_link(engine, person, playbook, lasts)
    return _json({"url": url, "for": person, "playbook": playbook if person is not None else None,
                  "expires_at": fmt_time(expires_at)}, 201)


async def h_add_deputy(request: web.Request) -> web.Response:
    body = await _json_body(request)
    return _json(await request.app[engine_key()].add_deputy(_caller(request), _pb(request), body), 201)


async def h_list_deputies(request: web.Request) -> web.Response:
    return _json(await request.app[engine_key()].list_deputies(_caller(request), _pb(request)))


async def h_remove_deputy(request: web.Request) -> web.Response:
    return _json(await request.app[engine_key()].remove_deputy(_caller(request), _pb(request),
                                                               request.match_info["deputy_id"]))


async def h_problem_page(request: web.Request) -> web.Response:
    from aiohttp import web
    name = request.match_info["name"]
    if name not in PROBLEM_TYPES:
        raise not_found(f"no problem type {name}")
    status, title, text = PROBLEM_TYPES[name]
    return web.Response(text=f"{title} ({status})\n\n{text}\n", content_type="text/plain")


async def h_openapi(request: web.Request) -> web.Response:
    return _json(openapi_spec())


# -- connections ------------------------------------------------------------------------------------
#
# aiohttp bounds neither how long a connection may take to send its request's head nor how many are
# open, and each holds a file descriptor. A serving daemon wraps every accepted connection in a
# `_Connection` that counts it, gives it HEADERS_TIMEOUT_S to send a request's line and headers, and
# hands everything else on to aiohttp's own handler; observe_middleware says when a request starts
# and ends. At the cap, a new connection closes the one idle longest (it sent no request yet, or it
# waits between requests); when every one has a request in flight, the new one is refused at once.
# So connections that send nothing cannot take the descriptors /healthz and real clients need.

class _Connection(asyncio.Protocol):
    """One accepted connection: aiohttp's handler behind a count, a deadline for the head, the cap."""

    __slots__ = ("gate", "handler", "transport", "busy", "deadline")

    def __init__(self, gate: Connections, handler: asyncio.Protocol) -> None:
        self.gate = gate
        self.handler = handler
        self.transport: Any = None
        self.busy = 0                               # requests in flight
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if not self.gate.admit(self):
            transport.abort()
            return
        self.handler.connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self.deadline = asyncio.get_running_loop().call_later(HEADERS_TIMEOUT_S, self._late)

    def _late(self) -> None:
        self.deadline = None
        if self.busy == 0:                          # no request line and headers in time
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.deadline is None and self.busy == 0:
            self._arm()                             # a kept-alive connection's next request begins
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if self.gate.forget(self):
            self.handler.connection_lost(exc)

    def started(self) -> None:
        """A request's head has arrived and its handling begins."""
        self.busy += 1
        self.gate.idle.pop(self, None)
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def ended(self) -> None:
        self.busy -= 1
        if self.busy == 0 and self.transport in self.gate.open:
            self.gate.idle[self] = None             # idle from now: the last to be closed at the cap


class Connections:
    """The open connections of a serving daemon, at most `cap` (config `max_connections`)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open: dict[Any, _Connection] = {}     # by transport
        self.idle: dict[_Connection, None] = {}    # no request in flight, idle longest first
        self._warned = -math.inf

    def factory(self, handler_factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """The protocol factory of the listening socket, over aiohttp's (`runner.server`)."""
        return lambda: _Connection(self, handler_factory())

    def admit(self, conn: _Connection) -> bool:
        if len(self.open) >= self.cap:
            if not self.idle:
                if time.monotonic() - self._warned >= 60:
                    self._warned = time.monotonic()
                    log.warning("%d connections are open, each with a request in flight (max_connections):"
                                " new connections are refused", len(self.open))
                return False
            oldest = next(iter(self.idle))
            self.forget(oldest)
            oldest.handler.connection_lost(None)
            oldest.transport.close()
        self.open[conn.transport] = conn
        self.idle[conn] = None
        return True

    def forget(self, conn: _Connection) -> bool:
        """Take a connection out of the count; False when it was never in it, or is out already."""
        self.idle.pop(conn, None)
        return self.open.pop(conn.transport, None) is not None

    def of(self, request: web.Request) -> _Connection | None:
        return self.open.get(request.transport)


connections_key: Final = functools.partial(state_key, "connections", Connections)


# -- metrics and request ids ------------------------------------------------------------------------
#
# GET /metrics speaks Prometheus text format through prometheus-client, from one registry per
# daemon. Counters are fed from four places: every committed event (through the bus: run endings,
# answers, delivery attempts), the engine's `observe` (runs started, reads), the timer wheel (how
# late a timer fired) and the store's writer (each group commit's size and time); the HTTP
# middleware below times each request by its route. Open requests are read from the store when
# scraped.

#: The id of the HTTP request being handled: every log line it causes carries it.
REQUEST_ID: Final[contextvars.ContextVar[str | None]] = contextvars.ContextVar("interactiond_request_id",
                                                                              default=None)
_REQUEST_ID_RE: Final = re.compile(r"[A-Za-z0-9._:-]{1,64}")
#: Request ids the daemon makes: 16 hex digits counted up from a random start per process (random
#: bytes per request cost a system call each).
_REQUEST_IDS: Final = itertools.count(secrets.randbits(64))


def _next_request_id() -> str:
    return f"{next(_REQUEST_IDS) & 0xFFFF_FFFF_FFFF_FFFF:016x}"
_HTTP_METHODS: Final = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
access_log = logging.getLogger("interactiond.access")
#: The kinds a run's ending is counted under; any other (a workflow may raise its own) is `other`.
_ENDING_KINDS: Final = frozenset(e.kind for e in ENDINGS.values() if e.kind)


def answer_channel(event: Mapping[str, Any]) -> str:
    """How an answer came: `reply` (read from a chat thread), `stdio` (the stdio MCP peer), `api`
    (a token or session: the HTTP APIs, MCP over HTTP, the inbox page), `local` or `other`."""
    by = event.get("by") or ""
    if (event.get("payload") or {}).get("reply") is not None or by.startswith("playbook:"):
        return "reply"
    if by.startswith("tok_"):
        return "api"
    return by if by in ("stdio", "local") else "other"


class Metrics:
    """The daemon's metrics: one prometheus-client registry over one engine (see above)."""

    def __init__(self, engine: Engine) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.engine = engine
        r = self.registry = CollectorRegistry()
        self.open_requests = Gauge("interactiond_open_requests", "Open requests, by playbook", ["playbook"], registry=r)
        self.runs_started = Counter("interactiond_runs_started", "Runs started, by playbook and type",
                                    ["playbook", "type"], registry=r)
        self.runs_ended = Counter("interactiond_runs_ended", "Runs ended, by playbook, status and kind",
                                  ["playbook", "status", "kind"], registry=r)
        self.answers = Counter("interactiond_answers", "Answers taken, by playbook and channel (api, reply, stdio,"
                               " local)", ["playbook", "channel"], registry=r)
        self.attempts = Counter("interactiond_delivery_attempts", "Delivery attempts ended, by playbook and outcome"
                                " (delivered, refused, or why it failed)", ["playbook", "outcome"], registry=r)
        self.reads = Counter("interactiond_reads", "Reads of a conversation's replies, by playbook and outcome (ok,"
                             " or why it failed)", ["playbook", "outcome"], registry=r)
        self.timer_lag = Histogram("interactiond_timer_lag_seconds", "How late a due timer fired",
                                   buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30), registry=r)
        self.http = Histogram("interactiond_http_request_duration_seconds", "HTTP requests, by method, route and"
                              " status", ["method", "route", "status"], registry=r,
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30, 60))
        self.batch_size = Histogram("interactiond_commit_batch_size", "Changes in one group commit", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.commit_seconds = Histogram("interactiond_commit_seconds", "Time of one group commit", registry=r,
                                        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5))
        engine.bus.on_event(self._event)
        engine.store.on_batch = self._batch
        engine.wheel.on_lag = self.timer_lag.observe
        engine.observe = self._observe
        # Each metric's child per label values, kept: prometheus-client's labels() checks and locks
        # every time (1.5 us, three times a request).
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *values: str) -> Any:
        """metric.labels(*values), kept after its first use (label values come from bounded sets)."""
        key = (metric, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def _event(self, event: dict[str, Any]) -> None:
        try:
            type_, pb, payload = event["type"], event["playbook"], event.get("payload") or {}
            if type_.startswith("run_"):
                kind = payload.get("kind") or ""
                self.child(self.runs_ended, pb, payload.get("status") or type_[4:],
                           kind if kind in _ENDING_KINDS or not kind else "other").inc()
            elif type_ == "request_answered":
                self.child(self.answers, pb, answer_channel(event)).inc()
            elif type_ == "delivery_succeeded":
                self.child(self.attempts, pb, "delivered").inc()
            elif type_ == "delivery_refused":
                self.child(self.attempts, pb, "refused").inc()
            elif type_ == "delivery_failed":
                self.attempts.labels(pb, str(payload.get("because") or "failed")).inc()
        except Exception:
            log.exception("counting an event failed")

    def _observe(self, what: str, playbook: str, label: str) -> None:
        self.child(self.runs_started if what == "run_started" else self.reads, playbook, label).inc()

    def _batch(self, changes: int, seconds: float) -> None:
        self.batch_size.observe(changes)
        self.commit_seconds.observe(seconds)

    async def exposition(self) -> bytes:
        """The text a scrape reads; open requests as the store counts them now."""
        from prometheus_client import generate_latest

        counts = await self.engine.store.read(lambda tx: tx.open_request_counts())
        for pb in sorted(self.engine.playbooks | set(counts)):
            self.open_requests.labels(pb).set(counts.get(pb, 0))
        return generate_latest(self.registry)


metrics_key: Final = functools.partial(state_key, "metrics", Metrics)
access_log_key: Final = functools.partial(state_key, "access_log", bool)


def _from_loopback(request: web.Request) -> bool:
    """A request from this machine that no proxy forwarded (a proxy on this machine is loopback too)."""
    return request.remote in ("127.0.0.1", "::1") and not any(
        h in request.headers for h in ("Forwarded", "X-Forwarded-For", "X-Real-IP"))


async def h_metrics(request: web.Request) -> web.Response:
    from aiohttp import web
    engine = request.app[engine_key()]
    if not (engine.config.metrics_open_on_loopback and _from_loopback(request)):
        (await _authenticate(request)).require(Role.OPERATOR)
    from prometheus_client import CONTENT_TYPE_LATEST

    return web.Response(body=await request.app[metrics_key()].exposition(),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


async def observe_middleware(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    """Give the request an id (the client's `X-Request-Id` when it is a plain one), time it by its
    route for the metrics, and write the access line when asked (`serve --access-log`); within it,
    api_middleware, and after it the typed API's `code` on a /v2 problem (one middleware for
    aiohttp, not three: each costs every request a layer)."""
    from aiohttp import web
    rid = request.headers.get("X-Request-Id", "")
    if not rid or not _REQUEST_ID_RE.fullmatch(rid):
        rid = _next_request_id()
    reset = REQUEST_ID.set(rid)
    began = time.perf_counter()
    status = 500
    conn = connections.of(request) if (connections := request.app.get(connections_key())) is not None else None
    if conn is not None:
        conn.started()
    try:
        resp = await api_middleware(request, handler)
        status = resp.status
        if not resp.prepared:
            resp.headers["X-Request-Id"] = rid
        if request.path.startswith("/v2/"):
            _v2_code(resp)
        return resp
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = 499                        # the client went away first
        raise
    finally:
        elapsed = time.perf_counter() - began
        metrics = request.app.get(metrics_key())
        if metrics is not None:
            resource = request.match_info.route.resource
            metrics.child(metrics.http, request.method if request.method in _HTTP_METHODS else "other",
                          resource.canonical if resource is not None else "unmatched", str(status)).observe(elapsed)
        if request.app.get(access_log_key()):
            access_log.info("%s %s %s %.1f ms", request.method, request.path, status, elapsed * 1000)
        if conn is not None:
            conn.ended()
        REQUEST_ID.reset(reset)


_DEF_BODY: Final = {"type": "object", "required": ["name", "source"], "properties": {
    "type": {"type": "string", "enum": ["interaction", "workflow"]}, "name": {"type": "string"},
    "source": {"type": "string"}}}
_RUN_BODY: Final = {"type": "object", "required": ["name"], "properties": {
    "type": {"type": "string", "enum": ["interaction", "workflow"]}, "name": {"type": "string"},
    "input": {}, "run_id": {"type": "string"}}}
_APPROVE_BODY: Final = {"type": "object", "description": "Have a person approve the call first (202 and the run)",
                        "properties": {"to": {"type": "string"}, "expires": {"type": "string"},
                                       "edit": {"type": "array", "items": {"type": "string"}}}}
_ANSWER_BODY: Final = {"type": "object", "required": ["answer"], "properties": {
    "answer": {}, "claimed_for": {"type": "string", "maxLength": 256},
    "digest": {"type": "string", "description": "the request's digest as shown: another is 409 digest_mismatch"}}}

ROUTES: Final[list[Route]] = [
    Route("GET", "/healthz", h_healthz, "Liveness", public=True),
    Route("GET", "/openapi.json", h_openapi, "This description", public=True),
    Route("GET", "/problems/{name}", h_problem_page, "What a problem type means", public=True),
    Route("POST", "/v1/admin/clock", h_clock, "Move the manual clock (tests and demos)", Role.OPERATOR,
          {"type": "object", "properties": {"advance": {"type": "string"}}}),
    Route("POST", PB + "/links", h_create_link, "A one-time sign-in link: a person's (for) in this playbook, or an"
          " operator's", Role.OPERATOR, {"type": "object", "properties": {
              "for": {"type": ["string", "null"]}, "expires": {"type": "string"}}}),
    Route("POST", PB + "/deputies", h_add_deputy, "A deputy: `to` answers what is addressed to `for` while the window"
          " (from, until: RFC 3339) is open", Role.OPERATOR, {"type": "object", "required": ["for", "to"], "properties": {
              "for": {"type": "string"}, "to": {"type": "string"}, "from": {"type": ["string", "null"]},
              "until": {"type": ["string", "null"]}}}),
    Route("GET", PB + "/deputies", h_list_deputies, "The playbook's deputies", Role.OPERATOR),
    Route("DELETE", PB + "/deputies/{deputy_id}", h_remove_deputy, "Remove a deputy", Role.OPERATOR),
    Route("POST", PB + "/definitions", h_create_definition, "create_definition", Role.WRITER, _DEF_BODY),
    Route("GET", PB + "/definitions", h_list_definitions, "list_definitions", query=("type",)),
    Route("GET", PB + "/definitions/{type}/{name}", h_get_definition, "get_definition", query=("version",)),
    Route("DELETE", PB + "/definitions/{type}/{name}", h_delete_definition, "delete_definition", Role.WRITER),
    Route("POST", PB + "/runs", h_run_definition, "run_definition", Role.WRITER, _RUN_BODY),
    Route("GET", PB + "/runs", h_list_runs, "list runs", query=("status", "function", "limit", "cursor")),
    Route("GET", PB + "/runs/{run_id}", h_get_run, "get_run"),
    Route("GET", PB + "/runs/{run_id}/events", h_run_events, "list_run_events", query=("limit", "cursor")),
    Route("POST", PB + "/runs/{run_id}/wait", h_wait_run, "wait for a run to end", Role.READER, None,
          ("timeout", "max_wait")),
    Route("POST", PB + "/runs/{run_id}/cancel", h_cancel_run, "cancel_run", Role.WRITER),
    Route("POST", PB + "/runs/{run_id}/answer", h_answer, "answer_interaction", Role.WRITER, _ANSWER_BODY,
          person=True),
    Route("GET", PB + "/interactions", h_list_interactions, "list_interactions",
          query=("to", "type", "function", "limit", "cursor"), person=True),
    Route("GET", PB + "/events", h_playbook_events, "list_playbook_events", query=("type", "limit", "cursor")),
    Route("GET", PB + "/events/{event_id}", h_get_event, "get_event"),
    Route("GET", PB + "/tools", h_search, "search", query=("query",)),
    Route("GET", PB + "/tools/{server}/{tool}", h_introspect, "introspect"),
    Route("POST", PB + "/tools/{server}/{tool}", h_execute, "execute", Role.WRITER,
          {"type": "object", "properties": {"arguments": {"type": "object"}, "approve": _APPROVE_BODY}}),
    Route("GET", "/metrics", h_metrics, "The daemon's metrics, in Prometheus text format (operator token, or none"
          " from this machine when the configuration opens it)", Role.OPERATOR, public=True, media="text/plain"),
]


ROUTE_BY_HANDLER: Final = {r.handler: r for r in ROUTES}
#: The paths most requests take (runs and answers): build_app adds them to the router first.
_HOT_PATHS: Final = frozenset({PB + "/runs", PB + "/runs/{run_id}/answer"})


def openapi_spec() -> dict[str, Any]:
    """OpenAPI 3.1, generated from ROUTES."""
    problem = {"$ref": "#/components/schemas/Problem"}
    run = {"$ref": "#/components/schemas/Run"}
    paths: dict[str, Any] = {}
    for r in ROUTES:
        op: dict[str, Any] = {"summary": r.summary, "operationId": re.sub(r"\W+", "_", f"{r.method}_{r.path}").strip("_"),
                              "responses": {"default": {"description": "A problem",
                                                        "content": {"application/problem+json": {"schema": problem}}},
                                            "200": {"description": "OK", "content": {r.media: {"schema": {}}}}}}
        if r.handler is h_create_definition:
            op["responses"]["201"] = {"description": "A new version", "content": {"application/json": {"schema": {}}}}
        if r.handler is h_execute:
            op["responses"]["202"] = {"description": "A gated call: the run that waits for its approval",
                                      "content": {"application/json": {"schema": run}}}
        if r.handler is h_create_link:
            op["responses"]["201"] = {"description": "The link: {url, for, playbook, expires_at}",
                                      "content": {"application/json": {"schema": {}}}}
        if r.handler in (h_run_definition, h_wait_run):
            # The run object whatever its ending, its status telling the ending; a problem alone
            # is about the call itself (SPEC section 6).
            for code in sorted({str(c) for c in RUN_HTTP_STATUS.values()} | {"201"}):
                content: dict[str, Any] = {"application/json": {"schema": run}}
                if code >= "400":
                    content["application/problem+json"] = {"schema": problem}
                op["responses"][code] = {"description": "The run; its status tells the ending", "content": content}
        params = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                  for n in re.findall(r"{(\w+)}", r.path)]
        params += [{"name": n, "in": "query", "required": False, "schema": {"type": "string"}} for n in r.query]
        if params:
            op["parameters"] = params
        if r.body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": r.body}}}
        if not r.public:
            op["security"] = [{"bearer": []}]
        paths.setdefault(r.path, {})[r.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "interactiond", "version": __version__,
                 "description": "Ask a person or a system, and wait durably for a validated answer."},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Problem": {"type": "object", "required": ["type", "title", "status"], "properties": {
                "type": {"type": "string"}, "title": {"type": "string"}, "status": {"type": "integer"},
                "detail": {"type": "string"}, "kind": {"type": ["string", "null"]}, "errors": {"type": "array"}}},
                "Run": {"type": "object", "required": ["run_id", "playbook", "type", "name", "version", "status"],
                        "properties": {"run_id": {"type": "string"}, "playbook": {"type": "string"},
                                       "type": {"type": "string"}, "name": {"type": "string"},
                                       "version": {"type": "integer"},
                                       "status": {"type": "string", "enum": [s.value for s in RunStatus]},
                                       "kind": {"type": ["string", "null"]},
                                       "problem": {"anyOf": [{"type": "null"}, problem]}}}},
        },
    }


def create_token(tx: Tx, role: str, playbook: str | None, name: str | None,
                 purpose: str = "api", now: int | None = None, *, person: str | None = None,
                 expires_at: int | None = None) -> tuple[str, str]:
    """Store a new token's hash; returns (id, secret). The secret is shown once. A session starts
    used now and ends INBOX_SESSION_MAX later at the latest; a login link ends at `expires_at`
    (None: when a start revokes it). A person's token, link or session (`person`) is a reader's or
    a writer's, bound to one playbook."""
    if role not in {r.value for r in Role}:
        raise ValueError(f"role is one of reader, writer, operator, not {role!r}")
    if playbook is not None and not PLAYBOOK_RE.fullmatch(playbook):
        raise ValueError(f"playbook is ORG/NAME, not {playbook!r}")
    if role == Role.OPERATOR.value and playbook is not None:
        raise ValueError("an operator is global (every playbook, tokens, the clock): leave out --playbook,"
                         " or make a reader or writer token for one playbook")
    if person is not None:
        person = person_name(person)
        if role == Role.OPERATOR.value:
            raise ValueError("a person answers their own requests: make them a writer (or a reader), not an operator")
        if playbook is None:
            raise ValueError("a person's token is bound to one playbook: give --playbook")
    secret = new_token_secret()
    token_id = "tok_" + new_ulid().lower()
    at = now if now is not None else WALL.now_ms()
    session = purpose == "session"
    tx.insert_token(token_id=token_id, digest=sha256_hex(secret), playbook=playbook, role=role, name=name,
                    purpose=purpose, now=at, used_at=at if session else None,
                    expires_at=at + int(INBOX_SESSION_MAX.total_seconds() * 1000) if session else expires_at,
                    person=person)
    return token_id, secret


def login_link_name(person: str | None) -> str:
    return f"sign-in link for {person}" if person is not None else "sign-in link"


async def make_login_link(engine: Engine, person: str | None, playbook: str,
                          lasts: timedelta = LOGIN_LINK_DEFAULT) -> tuple[str, int]:
    """A one-time sign-in link (its URL, and when it ends on the daemon's clock): a person's, a writer
    in `playbook` who sees only their own requests; without a person, an operator's."""
    now = engine.clock.now_ms()
    expires_at = now + int(lasts.total_seconds() * 1000)
    _, secret = await engine.store.write(lambda tx, fx: create_token(
        tx, Role.WRITER.value if person is not None else Role.OPERATOR.value, playbook if person is not None else None,
        login_link_name(person), purpose="login", now=now, person=person, expires_at=expires_at))
    return f"{engine.links.base}/login?token={secret}", expires_at


@functools.lru_cache(maxsize=8)
def public_origin(public_url: str | None) -> tuple[str, str] | None:
    """`public_url`'s origin, as a browser sends it in `Origin` (`https://host`, a default port left
    out), and its host, as a TLS proxy passes it on in `Host`; None without a public_url."""
    if not public_url:
        return None
    parts = urllib.parse.urlsplit(public_url)
    host = parts.netloc.rsplit("@", 1)[-1].lower()
    default = ":443" if parts.scheme == "https" else ":80"
    if host.endswith(default):
        host = host[:-len(default)]
    return f"{parts.scheme}://{host}", host


def _same_origin(request: web.Request, origin: str | None) -> bool:
    """Does a state-changing request's Origin name the page's own address: the one it was reached
    at, or public_url's (behind a TLS proxy the daemon sees http, the browser says https)?"""
    if origin is None:
        return False
    if origin == f"{request.scheme}://{request.host}":
        return True
    public = public_origin(request.app[engine_key()].config.public_url)
    return public is not None and origin == public[0]


async def _authenticate(request: web.Request) -> Caller:
    header = request.headers.get("Authorization", "")
    secret = None
    via_cookie = False
    if header.lower().startswith("bearer "):
        secret = header[7:].strip()
    elif SESSION_COOKIE in request.cookies:
        secret = request.cookies[SESSION_COOKIE]
        via_cookie = True
    if not secret:
        raise Problem("unauthorized", "send Authorization: Bearer <token>")
    caller = await lookup_token(request.app, secret)
    if caller is None:
        raise Problem("unauthorized", "the token is unknown or revoked")
    if via_cookie and request.method not in ("GET", "HEAD", "OPTIONS"):
        if not _same_origin(request, request.headers.get("Origin")):
            raise Problem("forbidden", "a request made with the session cookie must come from the inbox page")
    return caller


async def lookup_token(app: web.Application, secret: str) -> Caller | None:
    """The caller a token (or an inbox session's cookie) stands for; None when unknown, revoked or,
    for a session, expired on the daemon's clock. A session's use is written at most once a minute."""
    cache: dict[str, tuple[float, Caller | None, dict[str, Any] | None]] = app[tokens_key()]
    engine = app[engine_key()]
    digest = sha256_hex(secret)
    hit = cache.get(digest)
    if hit is None or hit[0] <= time.monotonic():
        def read(tx: Tx) -> tuple[Row | None, str | None]:
            row = tx.caller_token(digest)
            return row, (tx.token_name(row["id"]) if row is not None and row["person"] is None else None)
        row, name = await engine.store.read(read)
        caller = Caller(row["id"], Role(row["role"]), row["playbook"], row["person"], name) if row is not None else None
        times = ({"used_at": row["used_at"], "expires_at": row["expires_at"]}
                 if row is not None and row["purpose"] == "session" else None)
        if len(cache) > 10_000:
            cache.clear()
        hit = cache[digest] = (time.monotonic() + TOKEN_CACHE_S, caller, times)
    caller, times = hit[1], hit[2]
    if caller is None or times is None:
        return caller
    now = engine.clock.now_ms()
    if session_ended(times, now):
        return None
    if times["used_at"] is None or now - times["used_at"] >= int(INBOX_SESSION_TOUCH.total_seconds() * 1000):
        times["used_at"] = now
        await engine.store.write(lambda tx, fx: tx.touch_session(caller.id, now))
    return caller


def _challenge(request: web.Request) -> str:
    """RFC 6750's challenge: `invalid_token` when a token (or a session cookie) came and was refused."""
    sent = request.headers.get("Authorization", "").lower().startswith("bearer ") or SESSION_COOKIE in request.cookies
    return BEARER_CHALLENGE + (', error="invalid_token"' if sent else "")


async def api_middleware(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    from aiohttp import web
    try:
        route: Route | None = ROUTE_BY_HANDLER.get(request.match_info.route.handler)
        if route is not None and not route.public:
            caller = await _authenticate(request)
            request[caller_key()] = caller
            if caller.person is not None and not route.person:
                raise not_found("a person's sign-in sees only the requests addressed to them")
            caller.require(route.role)
        elif route is None and not request.path.startswith(PUBLIC_PATHS) and request.match_info.http_exception is None \
                and request.path not in ("/",):
            request[caller_key()] = await _authenticate(request)
        return await handler(request)
    except Problem as exc:
        if exc.status == 401 and request.path == "/mcp" and request.method == "POST":
            # The MCP client shows a JSON-RPC error it finds in the body, and only a generic
            # "error response" otherwise: say what is wrong in its terms.
            return web.Response(text=dumps({"jsonrpc": "2.0", "id": None, "error": {
                "code": -32001, "message": f"Unauthorized: {exc.detail}", "data": exc.body()}}),
                status=401, content_type="application/json", headers={"WWW-Authenticate": _challenge(request)})
        resp = problem_response(exc)
        if exc.status == 401:
            resp.headers["WWW-Authenticate"] = _challenge(request)
        return resp
    except web.HTTPRequestEntityTooLarge:
        return problem_response(Problem("too_large", f"the body is larger than {MAX_BODY_BYTES // MIB} MiB"))
    except web.HTTPException as exc:
        if exc.status >= 400:
            name = {404: "not_found", 405: "bad_request", 413: "too_large"}.get(exc.status, "bad_request")
            return problem_response(Problem(name, exc.reason, status=exc.status))
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return problem_response(Problem("failed", "the daemon failed on this request; its log says why"))


# MCP server #####################################################################################
#
# The same operations as the HTTP API, as MCP tools, served by the SDK's low-level `Server` over
# stdio, streamable HTTP (/mcp) and legacy SSE (/sse). The SDK checks no arguments, so each call
# is checked here against the tool's own input schema; a Problem becomes an `isError` result whose
# structured content is the problem object, and any other exception a generic one (no internal
# text leaks). The HTTP transports run behind the API's auth middleware; the bridge below hands the
# authenticated caller to the tool handler through the ASGI scope. A client that declares MCP's
# Tasks extension gets a durable task (the run) in place of a long call (McpTasks, below).


def _p(kind: str, text: str, **kw: Any) -> dict[str, Any]:
    return {"type": kind, "description": text, **kw}


_PLAYBOOK_ARG: Final = _p("string", "The playbook, ORG/NAME. Leave it out on a connection scoped to one playbook; "
                                    "otherwise it defaults to the token's playbook, or local/default.",
                          pattern=PLAYBOOK_RE.pattern)
_RUN_ID_ARG: Final = _p("string", "The run's id, as run_definition returned it or list_interactions shows it.")
_PAGE_ARGS: Final = {
    "limit": _p("integer", "Items per page, 1 to 200 (default 50).", minimum=1, maximum=MAX_PAGE),
    "cursor": _p("string", "next_cursor of the previous page, to read the next one."),
}
_TYPE_ARG: Final = _p("string", "The definition type: interaction (a function) or workflow.", enum=["interaction", "workflow"])


@dataclass(frozen=True)
class McpTool:
    name: str
    description: str
    properties: dict[str, Any]
    required: tuple[str, ...]
    call: Callable[..., Any]              # async (engine, caller, playbook, args, McpCall) -> (result, is_error)
    read_only: bool = False
    person: bool = False                  # a person's token may call it (else it is 404 to them, and not listed)


@dataclass(frozen=True)
class McpCall:
    """What a tool's handler learns of its MCP request besides the arguments: a heartbeat for a long
    wait, the SDK's request context, and the person at the client (None when nobody is named)."""

    progress: Callable[[float], Any]
    ctx: Any = None
    here: str | None = None
    params: Any = None                    # the tools/call request's (2026-07-28: with the client's responses)
    tasks: bool = False                   # the request declared the Tasks extension: a wait returns at once


async def _t_create(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    d, created = await e.create_definition(c, pb, a.get("type", "interaction"), a["name"], a["source"])
    return dict(d, created=created)


async def _t_get_def(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    return await e.get_definition(c, pb, a.get("type", "interaction"), a["name"], a.get("version"))


async def _t_list_defs(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    return {"data": await e.list_definitions(c, pb, a.get("type"))}


async def _t_delete_def(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    return await e.delete_definition(c, pb, a.get("type", "interaction"), a["name"])


def _run_result(run: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    return run, run["status"] not in (RunStatus.STARTED, RunStatus.WAITING, RunStatus.SUCCEEDED)


async def _t_run(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    run, _fresh = await e.run_definition(c, pb, a.get("type", "interaction"), a["name"], a.get("input"), a.get("run_id"))
    return _run_result(run)


async def _t_get_run(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    return await e.get_run(c, pb, a["run_id"])


#: What a person's wait_run shows of a run that asks them: its outcome, not its input.
_PERSON_RUN_FIELDS: Final = ("run_id", "playbook", "type", "name", "status", "kind", "output", "problem",
                             "created_at", "ended_at", "settled_by", "answer_url")


async def _t_wait_run(e: Engine, c: Caller, pb: str, a: dict[str, Any], call: McpCall) -> Any:
    # `timeout`, as the HTTP route names it (`max_wait` is its alias); longer than a call holds is cut.
    timeout = float(a.get("timeout", a.get("max_wait", DEFAULT_MCP_WAIT_S)))
    run_id = a["run_id"]
    if c.person is not None and await e.request_for(c, pb, run_id) is None:
        raise not_found(f"no run {run_id} in this playbook")     # a person waits only on runs that ask them
    bridge = ElicitationBridge.make(e, c, pb, run_id, call) if not call.tasks else None
    notes = []
    if call.tasks:
        run = await e.get_run(c, pb, run_id)        # the task is the run: it waits, the call does not
    elif bridge is None:
        run = await e.wait_run(c, pb, run_id, min(timeout, MAX_MCP_WAIT_S), tick=call.progress)
    else:
        out = await bridge.wait(min(timeout, MAX_MCP_WAIT_S))
        if not isinstance(out, tuple):
            return out                                  # 2026-07-28: the question, for the client to ask
        run, note = out
        if note:
            notes.append(note)
    if c.person is not None:
        run = {k: run[k] for k in _PERSON_RUN_FIELDS if k in run}
    if timeout > MAX_MCP_WAIT_S and not call.tasks:
        notes.append(f"timeout {timeout:g} s was cut to {MAX_MCP_WAIT_S:g} s, the longest one call waits;"
                     " call wait_run again to wait longer")
    return (run, False, " ".join(notes)) if notes else run


async def _t_cancel(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    return await e.cancel_run(c, pb, a["run_id"])


async def _t_get_event(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    return await e.get_event(c, pb, a["event_id"])


async def _t_run_events(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    return await e.list_run_events(c, pb, a["run_id"], a.get("limit"), a.get("cursor"))


async def _t_inbox(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    return await e.list_interactions(c, pb, a.get("to"), a.get("type"), a.get("function"), a.get("limit"), a.get("cursor"))


async def _t_answer(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    fact, _new = await e.answer_interaction(c, pb, a["run_id"], a["answer"], a.get("claimed_for"))
    return fact


async def _t_pb_events(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    return await e.list_playbook_events(c, pb, a.get("type"), a.get("limit"), a.get("cursor"))


async def _t_search(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    return await e.search(c, pb, a.get("query"))


async def _t_introspect(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    return await e.introspect(c, pb, a["server"], a["tool"])


async def _t_execute(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    out = await e.execute_tool(c, pb, a["server"], a["tool"], a.get("arguments") or {}, a.get("approve"))
    return _run_result(out) if "run_id" in out else out     # a gated call: the run that waits


async def _t_ask(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    input_ = {k: a[k] for k in ("prompt", "to", "expires", "options", "multiple", "placeholder", *_ASK_FOLLOW_UP)
              if k in a}
    run, _fresh = await e.run_definition(c, pb, "interaction", "ask-" + a["type"], input_, a.get("run_id"))
    return _run_result(run)


MCP_TOOLS: Final[list[McpTool]] = [
    McpTool("create_definition",
            "Save a function document (Markdown with YAML front matter) or a workflow under a name. A new name "
            "becomes version 1, a changed source the next version, the same source changes nothing. Returns the "
            "saved definition with its overview; a document that breaks a rule comes back as an error listing "
            "every problem with its line and field.",
            {"type": _TYPE_ARG, "name": _p("string", "The definition's name, e.g. approve-brief."),
             "source": _p("string", "The whole document text.")}, ("name", "source"), _t_create),
    McpTool("get_definition",
            "Read a saved definition: its source, version, media type and an overview in plain words. Use it to "
            "show a person what a function does before running it.",
            {"type": _TYPE_ARG, "name": _p("string", "The definition's name."),
             "version": _p("integer", "A past version; the current one when left out.", minimum=1, maximum=MAX_SQL_INT)},
            ("name",), _t_get_def, True),
    McpTool("list_definitions",
            "List the playbook's active definitions (name, type, version, description), including the built-in "
            "ask-approval, ask-text, ask-choice and ask-confirmation functions.",
            {"type": _TYPE_ARG}, (), _t_list_defs, True),
    McpTool("delete_definition", "Deactivate a definition's name; runs that used it keep their version.",
            {"type": _TYPE_ARG, "name": _p("string", "The definition's name.")}, ("name",), _t_delete_def),
    McpTool("run_definition",
            "Run a saved function with an input. A function that asks a person returns at once with status "
            "started and a run_id: call wait_run to wait for the answer. A function that asks a system returns "
            "its ended run with the output. Passing your own run_id makes a retry safe: the same function and "
            "input under the same run_id return the existing run.",
            {"type": _TYPE_ARG, "name": _p("string", "The function's name."),
             "input": _p("object", "The input, matching the function's input schema."),
             "run_id": _p("string", "Optional id of your choosing: 1 to 128 of A-Z a-z 0-9 _ . : -",
                          pattern=RUN_ID_RE.pattern)}, ("name",), _t_run),
    McpTool("get_run",
            "Read a run as it stands: status (started, waiting, or how it ended), kind, output and problem.",
            {"run_id": _RUN_ID_ARG}, ("run_id",), _t_get_run, True),
    McpTool("wait_run",
            "Wait for a run to end. Returns the ended run, or the run as it stands when timeout seconds pass "
            "(then call wait_run again). Progress notifications are sent while it waits, so a person who is slow "
            "to answer does not make this call time out. When the run asks the person at this client and the "
            "client can ask them (elicitation), the question is asked here while it waits.",
            {"run_id": _RUN_ID_ARG,
             "timeout": _p("number", f"Seconds to wait (default {DEFAULT_MCP_WAIT_S:g}); more than "
                                     f"{MAX_MCP_WAIT_S:g} is cut to {MAX_MCP_WAIT_S:g}, and the result says so.",
                           minimum=0),
             "max_wait": _p("number", "The same as timeout (an older name).", minimum=0)},
            ("run_id",), _t_wait_run, True, person=True),
    McpTool("cancel_run",
            "Cancel a run that is still waiting: its request leaves the inbox and the run ends rejected, kind "
            "cancelled. Returns the run.", {"run_id": _RUN_ID_ARG}, ("run_id",), _t_cancel),
    McpTool("get_event", "Read one event of the playbook whole (listings cut payloads to 2 KiB).",
            {"event_id": _p("string", "The event's id, evt_ followed by a number.")}, ("event_id",), _t_get_event, True),
    McpTool("list_run_events",
            "A run's history in order: the request, each delivery attempt, the answer, the end.",
            {"run_id": _RUN_ID_ARG, **_PAGE_ARGS}, ("run_id",), _t_run_events, True),
    McpTool("list_interactions",
            "List the open requests of the playbook, newest first: who each is for, its message, the answer "
            "schema an answer must match, and when it expires. Use it to find the run_id to answer.",
            {"to": _p("string", "Only requests to this party."),
             "type": _p("string", "Only requests of functions of this type."),
             "function": _p("string", "Only requests of the function of this name."), **_PAGE_ARGS},
            (), _t_inbox, True, person=True),
    McpTool("answer_interaction",
            "Answer an open request on a person's behalf, in the shape of its answer_schema (list_interactions "
            "shows it). Returns the recorded answer fact. An answer that does not match comes back as an error "
            "with a JSON Pointer per problem, and the request stays open.",
            {"run_id": _RUN_ID_ARG, "answer": _p("object", "The answer, matching the request's answer_schema."),
             "claimed_for": _p("string", "Whom you answer for (kept, never checked), at most 256 bytes.")},
            ("run_id", "answer"), _t_answer, person=True),
    McpTool("list_playbook_events",
            "The playbook's own events: definitions saved, reads of conversations, tellings, execute calls.",
            {"type": _p("string", "Only events of this type."), **_PAGE_ARGS}, (), _t_pb_events, True),
    McpTool("search",
            "List the tool servers this playbook may use, the tools each offers, and which are read-only. Call "
            "it before writing a function that calls or sends through a tool.",
            {"query": _p("string", "Only tools whose name or description holds this text.")}, (), _t_search, True),
    McpTool("introspect", "Read one tool's input schema, output schema and annotations.",
            {"server": _p("string", "The server, as search names it."), "tool": _p("string", "The tool's name.")},
            ("server", "tool"), _t_introspect, True),
    McpTool("execute",
            "Call one tool once with the given arguments and return its answer (recorded as a playbook event). "
            "Use it to learn what a tool returns before writing a function's read or sent pointers.",
            {"server": _p("string", "The server, as search names it."), "tool": _p("string", "The tool's name."),
             "arguments": _p("object", "The tool's arguments, as its input schema names them."),
             "approve": {"type": "object", "additionalProperties": False,
                         "description": "Have a person approve the call first: the started run comes back; "
                                        "call wait_run for the tool's answer. A tool the operator gates waits "
                                        "for approval anyway.",
                         "properties": {"to": _p("string", "Who approves."),
                                        "expires": _p("string", "ISO 8601 duration, PT1M to P30D; P1D when left out."),
                                        "edit": {"type": "array", "items": {"type": "string"},
                                                 "description": "JSON Pointers of the arguments the approver may change."}}}},
            ("server", "tool"), _t_execute),
    McpTool("ask",
            "Ask a person a typed question without writing a document: approval (yes/no with a comment), text, "
            "choice (pick from options) or confirmation. It may remind (remind_after), also ask someone else "
            "later (escalate_to, escalate_after) and take a default answer when it expires (default). Returns the "
            "started run; call wait_run for the answer.",
            {"type": _p("string", "The kind of question.", enum=["approval", "text", "choice", "confirmation"]),
             "prompt": _p("string", "The question, in Markdown, at most 8 KiB.", maxLength=8192),
             "to": _p("string", "Who is asked: the name they filter their inbox by."),
             "expires": _p("string", "ISO 8601 duration, PT1M to P30D; P1D when left out."),
             "options": {"type": "array", "description": "choice only: 1 to 50 options, ids unique.",
                         "minItems": 1, "maxItems": 50,
                         "items": {"type": "object", "required": ["id", "label"], "additionalProperties": False,
                                   "properties": {"id": {"type": "string"}, "label": {"type": "string"}}}},
             "multiple": _p("boolean", "choice only: may several options be picked (default false)."),
             "placeholder": _p("string", "text only: a hint shown in the empty answer field."),
             **_ASK_FOLLOW_UP,
             "run_id": _p("string", "Optional id of your choosing, for safe retries.", pattern=RUN_ID_RE.pattern)},
            ("type", "prompt", "to"), _t_ask),
]


def _mcp_schema(tool: McpTool, scoped: bool) -> dict[str, Any]:
    props = dict(tool.properties)
    if not scoped:
        props["playbook"] = _PLAYBOOK_ARG
    return {"type": "object", "properties": props, "required": list(tool.required), "additionalProperties": False}


# -- asking the person at the client (elicitation) ------------------------------------------------
#
# An MCP session may name the person at its client: `stdio --as ana`, a person's token, an operator's
# token with the `Interactiond-As` header (how stdio's relay passes `--as` on), or `mcp.as` in the
# configuration for every session whose token names nobody. While wait_run waits on a run whose
# request is addressed to that person, and the client declared elicitation, the question is asked
# in the client: as a form when the answer schema is MCP's restricted form, else as a link to the
# request's answer page. In the 2025-11-25 era the daemon sends `elicitation/create` over the
# session and can withdraw it when the request is answered elsewhere; in 2026-07-28 wait_run
# returns `input_required` and the client's retry carries the person's answer (and the state the
# daemon signed), so a question cannot be withdrawn and an answer that comes late is refused as a
# second answer is.

#: The members a form field of each type keeps (MCP's restricted schema).
_FORM_MEMBERS: Final = {
    "string": frozenset({"type", "title", "description", "default", "minLength", "maxLength", "format", "enum",
                         "enumNames", "oneOf"}),
    "number": frozenset({"type", "title", "description", "default", "minimum", "maximum"}),
    "integer": frozenset({"type", "title", "description", "default", "minimum", "maximum"}),
    "boolean": frozenset({"type", "title", "description", "default"}),
    "array": frozenset({"type", "title", "description", "default", "minItems", "maxItems", "items"}),
}
#: Checks a form cannot show but the daemon makes when the answer comes (a failing answer is asked again).
_FORM_CHECKED: Final = frozenset({"pattern", "multipleOf", "exclusiveMinimum", "exclusiveMaximum", "uniqueItems",
                                  "examples", "$comment", "deprecated"})
_FORM_FORMATS: Final = frozenset({"date", "date-time", "email", "uri"})
_FORM_TOP: Final = frozenset({"type", "properties", "required", "additionalProperties", "title", "description",
                              "$schema", "$comment"})


def _titled_consts(options: Any) -> list[dict[str, str]] | None:
    """`[{const, title?}]` of texts (a titled choice), else None."""
    if not isinstance(options, list) or not options:
        return None
    out = []
    for o in options:
        if (not isinstance(o, dict) or not isinstance(o.get("const"), str) or set(o) - {"const", "title", "description"}
                or not isinstance(o.get("title", ""), str)):
            return None
        out.append({k: o[k] for k in ("const", "title") if k in o})
    return out


def _form_field(schema: Any) -> dict[str, Any] | None:
    """One property as an MCP form field (text, number, yes/no, one choice, or several choices), or None."""
    if not isinstance(schema, dict) or not isinstance(schema.get("type"), str) or schema["type"] not in _FORM_MEMBERS:
        return None
    kind = schema["type"]
    if set(schema) - _FORM_MEMBERS[kind] - _FORM_CHECKED:
        return None
    out = {k: v for k, v in schema.items()
           if k in _FORM_MEMBERS[kind] and k not in ("enum", "enumNames", "oneOf", "items")}
    if kind == "string":
        if out.get("format") not in _FORM_FORMATS:
            out.pop("format", None)              # checked by the daemon when the answer comes
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
                return None
            out["enum"] = schema["enum"]
            names = schema.get("enumNames")
            if isinstance(names, list) and len(names) == len(schema["enum"]) and all(isinstance(n, str) for n in names):
                out["enumNames"] = names
        elif "oneOf" in schema:
            if (consts := _titled_consts(schema["oneOf"])) is None:
                return None
            out["oneOf"] = consts
    elif kind == "array":
        items = schema.get("items")
        if not isinstance(items, dict):
            return None
        values = items.get("enum")
        if (isinstance(values, list) and values and all(isinstance(v, str) for v in values)
                and not set(items) - {"type", "enum", "title", "description"} and items.get("type", "string") == "string"):
            out["items"] = {"type": "string", "enum": values}
        elif not set(items) - {"anyOf", "oneOf"} and len(items) == 1 \
                and (consts := _titled_consts(items.get("anyOf", items.get("oneOf")))) is not None:
            out["items"] = {"anyOf": consts}
        else:
            return None
    return out


def elicitation_form(schema: Any) -> dict[str, Any] | None:
    """An answer schema as MCP's restricted form - a flat object whose members are texts, numbers,
    whole numbers, yes/no, one choice of texts, or a list of choices - else None (the answer link
    asks it). Checks a form cannot carry (a pattern, say) are left to the daemon's own check."""
    if (not isinstance(schema, dict) or schema.get("type") != "object" or set(schema) - _FORM_TOP
            or not isinstance(schema.get("properties"), dict) or not schema["properties"]
            or not isinstance(schema.get("additionalProperties", False), bool)):
        return None
    fields = {}
    for name, member in schema["properties"].items():
        if (f := _form_field(member)) is None:
            return None
        fields[name] = f
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) and r in fields for r in required):
        return None
    return {"type": "object", "properties": fields, **({"required": required} if required else {})}


class ElicitationBridge:
    """One wait_run that asks the person at the client (see above). Made only when the client
    declared elicitation, the caller may answer, and the session names a person."""

    STATE: Final = "elicitation-state"       # what the request state's signature is for

    def __init__(self, engine: Engine, caller: Caller, playbook: str, run_id: str, call: McpCall,
                 form: bool, url: bool) -> None:
        self.engine = engine
        self.caller = caller
        self.playbook = playbook
        self.run_id = run_id
        self.call = call
        self.ctx = call.ctx
        assert call.here is not None
        self.person = replace(caller, person=call.here)     # who answers: the person, with the caller's rights
        self.form, self.url = form, url

    @classmethod
    def make(cls, engine: Engine, caller: Caller, playbook: str, run_id: str,
             call: McpCall) -> ElicitationBridge | None:
        if call.here is None or call.ctx is None or caller.role.rank < Role.WRITER.rank:
            return None
        caps = getattr(call.ctx.session, "client_capabilities", None)
        declared = getattr(caps, "elicitation", None)
        if declared is None:
            return None
        url = declared.url is not None
        return cls(engine, caller, playbook, run_id, call, declared.form is not None or not url, url)

    @property
    def modern(self) -> bool:
        from mcp_types.version import MODERN_PROTOCOL_VERSIONS
        return self.ctx.protocol_version in MODERN_PROTOCOL_VERSIONS

    async def _askable(self) -> dict[str, Any] | None:
        """The run's request when it is open, takes an answer, and is addressed to the person here
        (with an `ask` choice's options, whose labels the form shows)."""
        req = await self.engine.request_for(self.person, self.playbook, self.run_id)
        if req is None or req["status"] != RequestStatus.OPEN or req["answer_schema"] is None:
            return None
        if "option_ids" in (req["answer_schema"].get("properties") or {}):
            run = await self.engine.get_run(self.caller, self.playbook, self.run_id)
            if isinstance(run["input"], dict) and isinstance(run["input"].get("options"), list):
                req["options"] = run["input"]["options"]
        return req

    @staticmethod
    def _labelled(form: dict[str, Any], options: Any) -> dict[str, Any]:
        """An `ask` choice's form with its options' labels: each id titled with its label."""
        field = form["properties"].get("option_ids")
        labels = {o["id"]: o["label"] for o in options or () if isinstance(o, dict)
                  and isinstance(o.get("id"), str) and isinstance(o.get("label"), str)}
        ids = (field or {}).get("items", {}).get("enum")
        if not ids or not all(i in labels for i in ids):
            return form
        items = {"anyOf": [{"const": i, "title": labels[i]} for i in ids]}
        return dict(form, properties=dict(form["properties"], option_ids=dict(field, items=items)))

    def _question(self, req: dict[str, Any], n: int, refused: Problem | None) -> tuple[str, Any] | None:
        """The n-th ask of `req` as (mode, elicitation params), or None when this client cannot be asked it."""
        from mcp import types as mt
        form = elicitation_form(req["answer_schema"]) if self.form else None
        if form is not None:
            form = self._labelled(form, req.get("options"))
            message = req["message"] or "Your answer, please."
            if refused is not None:
                lines = [f"- {(e.get('pointer') or '').removeprefix('/answer').lstrip('/') or 'the answer'}: "
                         f"{e.get('message')}" for e in refused.errors or []]
                message += (f"\n\nThat answer was not taken: {refused.detail}.\n" + "\n".join(lines)
                            + f"\n(ask {n} of {MAX_ELICIT_ASKS})")
            return "form", mt.ElicitRequestFormParams(message=message, requested_schema=form)
        if self.url and req.get("answer_url"):
            message = (f"A question waits for {self.person.person}; its answer takes a form this client cannot"
                       f" show, so it is answered at its page.\n\n{req['message']}")
            return "url", mt.ElicitRequestURLParams(message=message, url=req["answer_url"],
                                                    elicitation_id=f"{req['id']}.{secrets.token_hex(4)}")
        return None

    async def _took(self, mode: str, result: Any, n: int) -> tuple[Problem | None, str | None]:
        """Act on the person's response to the n-th ask: answer as them, or note a decline. Returns
        (the refusal to ask again with, or None) and a note for the caller."""
        if result.action != "accept":
            await self.engine.elicitation_declined(self.person, self.playbook, self.run_id, mode, result.action)
            return None, None
        if mode == "url":
            return None, None                    # they went to the page; the wait goes on
        answer = {k: v for k, v in (result.content or {}).items() if v is not None}   # a field left empty
        try:
            await self.engine.answer_interaction(self.person, self.playbook, self.run_id, answer)
        except Problem as exc:
            if exc.name == "invalid_input" and exc.errors and n < MAX_ELICIT_ASKS:
                return exc, None
            if exc.name != "invalid_input":      # answered or ended meanwhile: refused as a second answer is
                return None, f"The answer given at the client was not taken: {exc.detail}."
        return None, None

    async def wait(self, timeout: float) -> tuple[dict[str, Any], str | None] | Any:
        """The run (and a note) once it ends or the wait's time is up; in 2026-07-28 also the question
        itself (an input_required result) while the person is still to be asked."""
        return await (self._wait_modern(timeout) if self.modern else self._wait_session(timeout))

    # 2025-11-25: ask over the session while waiting --------------------------------------------

    async def _wait_session(self, timeout: float) -> tuple[dict[str, Any], str | None]:
        e = self.engine
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        req = await self._askable()
        n, refused, note = 0, None, None
        pending: asyncio.Future[Any] | None = None
        waiting: asyncio.Future[Any] | None = None
        mode, link_id = "", None
        run: dict[str, Any] | None = None
        try:
            while True:
                if pending is None and req is not None:
                    question = self._question(req, n + 1, refused) if n < MAX_ELICIT_ASKS else None
                    if question is None:
                        req = None
                    else:
                        n += 1
                        mode, params = question
                        if mode == "url":
                            link_id = params.elicitation_id
                            ask = self.ctx.session.elicit_url(params.message, params.url, params.elicitation_id,
                                                              related_request_id=self.ctx.request_id)
                        else:
                            ask = self.ctx.session.elicit_form(params.message, params.requested_schema,
                                                               related_request_id=self.ctx.request_id)
                        pending = asyncio.ensure_future(ask)
                left = deadline - loop.time()
                # While the question is open in the client the wait holds past its time (the person is at it).
                span = max(0.0, left) if pending is None or left > 0 else MAX_MCP_WAIT_S
                began = loop.time()
                waiting = asyncio.ensure_future(e.wait_run(self.caller, self.playbook, self.run_id, span,
                                                           tick=self.call.progress))
                await asyncio.wait({waiting} | ({pending} if pending is not None else set()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if pending is not None and pending.done():
                    waiting.cancel()
                    await asyncio.gather(waiting, return_exceptions=True)
                    asked, pending = pending, None
                    try:
                        result = asked.result()
                    except Exception as exc:             # the client could not ask: the wait goes on without
                        log.info("asking at the MCP client failed: %s", exc)
                        req = None
                        continue
                    refused, said = await self._took(mode, result, n)
                    note = said or note
                    if refused is None:
                        req = None
                    continue
                run = waiting.result()
                ended = RunStatus(run["status"]).ended
                # A wait that came back early without an ending: the daemon is stopping.
                if ended or pending is None or loop.time() - began < span / 2:
                    return run, note
        finally:
            if waiting is not None and not waiting.done():   # the call itself ended (the client left)
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
            if pending is not None:                      # answered elsewhere (or the call ended): withdrawn
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            if link_id is not None and run is not None and RunStatus(run["status"]).ended:
                with contextlib.suppress(Exception):
                    await self.ctx.session.send_elicit_complete(link_id, related_request_id=self.ctx.request_id)

    # 2026-07-28: the question is the call's result; the client's retry brings the response ---------

    def _seal(self, state: dict[str, Any]) -> str:
        text = base64.urlsafe_b64encode(dumps(state).encode()).decode().rstrip("=")
        return f"{text}.{self.engine.links.sign(self.STATE, text)}"

    def _unseal(self, token: str) -> dict[str, Any]:
        text, _, mac = token.partition(".")
        state: Any = None
        if mac and hmac.compare_digest(mac.encode(), self.engine.links.sign(self.STATE, text).encode()):
            with contextlib.suppress(ValueError):
                state = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
        if (not isinstance(state, dict) or state.get("run") != self.run_id or state.get("playbook") != self.playbook
                or state.get("who") != self.person.person):
            raise Problem("invalid_request", "request_state is not one this daemon gave for this wait of this run;"
                                             " call wait_run again without it")
        return state

    def _input_required(self, req: dict[str, Any], n: int, question: tuple[str, Any]) -> Any:
        from mcp import types as mt
        mode, params = question
        if mode == "url":
            params = params.model_copy(update={"elicitation_id": None})     # not in this era's wire format
        state = {"run": self.run_id, "playbook": self.playbook, "who": self.person.person, "request": req["id"],
                 "n": n, "mode": mode}
        return mt.InputRequiredResult(input_requests={"answer": mt.ElicitRequest(params=params)},
                                      request_state=self._seal(state))

    async def _wait_modern(self, timeout: float) -> tuple[dict[str, Any], str | None] | Any:
        from mcp import types as mt
        params = self.call.params
        token = getattr(params, "request_state", None)
        note = None
        if token is None:
            req = await self._askable()
            question = self._question(req, 1, None) if req is not None else None
            if req is not None and question is not None:
                return self._input_required(req, 1, question)
        else:
            state = self._unseal(token)
            result = (getattr(params, "input_responses", None) or {}).get("answer")
            if isinstance(result, mt.ElicitResult):
                n = int(state.get("n", MAX_ELICIT_ASKS))
                refused, note = await self._took(str(state.get("mode")), result, n)
                if refused is not None:
                    req = await self._askable()
                    question = self._question(req, n + 1, refused) if req is not None else None
                    if req is not None and question is not None and req["id"] == state.get("request"):
                        return self._input_required(req, n + 1, question)
        run = await self.engine.wait_run(self.caller, self.playbook, self.run_id, timeout, tick=self.call.progress)
        return run, note


# -- durable tasks (the Tasks extension) ----------------------------------------------------------
#
# A client that declares `io.modelcontextprotocol/tasks` in a request's `_meta` gets, for a call of
# ask, run_definition, wait_run or execute whose run does not end at once, a task handle in place of
# the result. The task is the run: its id is the run's (`ORG/NAME/RUN` for a run of a playbook other
# than the connection's own), it is durable before the reply because the run is, and `tasks/get`
# reads it from the store, so it outlives the client's connection and the daemon, and any session of
# a token that may read the run (any daemon on PostgreSQL) serves it. What a task keeps besides the
# run - a question declined or refused at a client, a cancel by `tasks/cancel` - is in the run's
# events. The 2025-11-25 era's experimental tasks (`params.task`) are the same runs in that era's
# shapes.

TASKS_EXTENSION: Final = "io.modelcontextprotocol/tasks"
CLIENT_CAPABILITIES_META: Final = "io.modelcontextprotocol/clientCapabilities"
#: The tools a declaring client's call may get a task for (their result is a run).
TASK_TOOLS: Final = frozenset({"ask", "run_definition", "wait_run", "execute"})
#: JSON-RPC error codes of the extension.
INVALID_PARAMS: Final = -32602
MISSING_CLIENT_CAPABILITY: Final = -32021


def _declares_tasks(ctx: Any) -> bool:
    """Whether this request's `_meta` declares the Tasks extension (a declaration earlier in the
    session does not count: each request says it)."""
    meta = getattr(ctx, "meta", None)
    caps = meta.get(CLIENT_CAPABILITIES_META) if isinstance(meta, Mapping) else None
    exts = caps.get("extensions") if isinstance(caps, Mapping) else None
    return isinstance(exts, Mapping) and TASKS_EXTENSION in exts


def _legacy_tasks(ctx: Any) -> bool:
    """A connection of the 2025-11-25 era (or older), whose experimental tasks have their own shapes."""
    from mcp_types.version import MODERN_PROTOCOL_VERSIONS
    return getattr(ctx, "protocol_version", None) not in MODERN_PROTOCOL_VERSIONS


class McpTasks:
    """The Tasks extension over the engine's runs, for one MCP server (see above). `who` gives a
    request's caller, `home` the playbook a task id without one names, `here` the person at the
    client (whom a task's question is put to)."""

    def __init__(self, engine: Engine, who: Callable[[Any], Caller | None], home: Callable[[Any, Caller], str],
                 here: Callable[[Any, Caller], str | None]) -> None:
        self.engine = engine
        self.who = who
        self.home = home
        self.here = here

    # -- ids, scope and errors ----------------------------------------------------------------------

    @staticmethod
    def error(code: int, message: str, data: Any = None) -> Exception:
        from mcp.shared.exceptions import MCPError
        return MCPError(code=code, message=message, data=data)

    def missing(self) -> Exception:
        return self.error(MISSING_CLIENT_CAPABILITY, "Missing required client capability: declare the extension "
                          f"{TASKS_EXTENSION} in the request's _meta",
                          {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}})

    def task_id(self, ctx: Any, caller: Caller, playbook: str, run_id: str) -> str:
        return run_id if playbook == self.home(ctx, caller) else f"{playbook}/{run_id}"

    def locate(self, ctx: Any, task_id: Any) -> tuple[Caller, str, str]:
        """(caller, playbook, run id) of a task id this caller may read, else -32602."""
        caller = self.who(ctx)
        if not isinstance(task_id, str) or caller is None:
            raise self.error(INVALID_PARAMS, "Failed to retrieve task: taskId is a text")
        org, _, rest = task_id.rpartition("/")
        playbook, run_id = (org, rest) if org else (self.home(ctx, caller), task_id)
        if not RUN_ID_RE.fullmatch(run_id) or not PLAYBOOK_RE.fullmatch(playbook):
            raise self.error(INVALID_PARAMS, "Failed to retrieve task: Task not found")
        try:
            playbook = self.engine.playbook(caller, playbook)
        except Problem:
            raise self.error(INVALID_PARAMS, "Failed to retrieve task: Task not found") from None
        return caller, playbook, run_id

    def params(self, ctx: Any) -> Mapping[str, Any]:
        raw = getattr(ctx, "params", None)
        return raw if isinstance(raw, Mapping) else {}

    # -- the task, as tasks/get shows it ------------------------------------------------------------

    def bridge(self, ctx: Any, caller: Caller, playbook: str, run_id: str) -> ElicitationBridge | None:
        async def quiet(left: float) -> None:
            return None
        return ElicitationBridge.make(self.engine, caller, playbook, run_id,
                                      McpCall(quiet, ctx, self.here(ctx, caller), None, tasks=True))

    async def question(self, ctx: Any, caller: Caller, playbook: str, run_id: str,
                       view: dict[str, Any]) -> tuple[str, str, Any] | None:
        """The question the task puts to the person at this client now - (key, mode, elicitation
        params) - or None: not theirs, this client cannot ask it, they declined, or it was asked
        MAX_ELICIT_ASKS times. A key is the request's id and the ask's number: one key per ask."""
        bridge = self.bridge(ctx, caller, playbook, run_id)
        if bridge is None:
            return None
        req = await bridge._askable()
        if req is None:
            return None
        person = bridge.person.by
        if any(ev["type"] == EventType.ELICITATION_DECLINED.value and ev["by"] == person for ev in view["events"]):
            return None
        refusals = [ev["payload"] for ev in view["events"] if ev["type"] == EventType.ELICITATION_REFUSED.value
                    and ev["payload"].get("request") == req["id"]]
        n = len(refusals) + 1
        if n > MAX_ELICIT_ASKS:
            return None
        refused = (Problem("invalid_input", refusals[-1].get("detail") or "the answer does not fit",
                           errors=refusals[-1].get("errors") or None) if refusals else None)
        asked = bridge._question(req, n, refused)
        if asked is None:
            return None
        mode, params = asked
        if mode == "url" and not _legacy_tasks(ctx):
            params = params.model_copy(update={"elicitation_id": None})
        return f"{req['id']}.{n}", mode, params

    def call_result(self, caller: Caller, run: dict[str, Any]) -> dict[str, Any]:
        """The CallToolResult a blocking wait_run gives for an ended run."""
        from mcp import types as mt
        data, is_error = _run_result(run)
        if caller.person is not None:
            data = {k: data[k] for k in _PERSON_RUN_FIELDS if k in data}
        return mt.CallToolResult(content=[mt.TextContent(type="text", text=dumps(data))], structured_content=data,
                                 is_error=is_error).model_dump(by_alias=True, mode="json", exclude_none=True,
                                                               exclude={"result_type"})

    async def task(self, ctx: Any, caller: Caller, playbook: str, run_id: str, *,
                   detailed: bool = True) -> dict[str, Any]:
        """The task of a run as this caller sees it (a Problem when they may not read it)."""
        engine = self.engine
        if caller.person is not None and await engine.request_for(caller, playbook, run_id) is None:
            raise not_found(f"no run {run_id} in this playbook")      # a person sees only runs that ask them
        run = await engine.get_run(caller, playbook, run_id)
        view = await engine.task_view(caller, playbook, run_id)
        expires = view["expires_at"]
        task: dict[str, Any] = {
            "taskId": self.task_id(ctx, caller, playbook, run_id), "status": "working",
            "createdAt": fmt_time(view["created_at"]), "lastUpdatedAt": fmt_time(view["updated_at"]),
            "ttlMs": expires + MCP_TASK_KEPT_MS - view["created_at"] if expires is not None else None,
            "pollIntervalMs": MCP_TASK_POLL_MS,
        }
        if RunStatus(run["status"]).ended:
            cancelled = run["kind"] == "cancelled" and any(
                ev["type"] == EventType.MCP_TASK_CANCELLED.value for ev in view["events"])
            if cancelled:
                task.update(status="cancelled", statusMessage="cancelled by tasks/cancel")
            else:
                task.update(status="completed", statusMessage=f"the run ended: {run['status']}"
                            + (f", {run['kind']}" if run["kind"] else ""))
                if detailed:
                    task["result"] = self.call_result(caller, run)
            return task
        task["statusMessage"] = (f"waiting for {view['party']} until {fmt_time(expires)}" if view["party"]
                                 else "the run is working")
        asked = await self.question(ctx, caller, playbook, run_id, view)
        if asked is not None:
            key, _mode, params = asked
            task["status"] = "input_required"
            if detailed:
                task["inputRequests"] = {key: {"method": "elicitation/create",
                                               "params": params.model_dump(by_alias=True, mode="json",
                                                                           exclude_none=True)}}
        return task

    async def read(self, ctx: Any) -> tuple[Caller, str, str, dict[str, Any]]:
        caller, playbook, run_id = self.locate(ctx, self.params(ctx).get("taskId"))
        try:
            return caller, playbook, run_id, await self.task(ctx, caller, playbook, run_id)
        except Problem as exc:
            if exc.status == 404 or exc.status == 403:
                raise self.error(INVALID_PARAMS, "Failed to retrieve task: Task not found") from None
            raise self.error(-32603, exc.detail or "the task could not be read") from None

    # -- the methods ----------------------------------------------------------------------------------

    async def get(self, ctx: Any, params: Any) -> dict[str, Any]:
        if not _declares_tasks(ctx):
            if _legacy_tasks(ctx):
                return await self.legacy_get(ctx)
            raise self.missing()
        return (await self.read(ctx))[3]

    async def update(self, ctx: Any, params: Any) -> dict[str, Any]:
        """Responses to the task's question: an accept answers as the person here (an answer that
        does not fit is asked again under the next key), a decline or cancel leaves the request open
        and this person is not asked here again; a key not outstanding now is ignored."""
        from mcp import types as mt
        if not _declares_tasks(ctx):
            raise self.missing()
        caller, playbook, run_id, task = await self.read(ctx)
        responses = self.params(ctx).get("inputResponses")
        if not isinstance(responses, Mapping):
            raise self.error(INVALID_PARAMS, "inputResponses is an object of responses by key")
        if task["status"] != "input_required":
            return {}
        view = await self.engine.task_view(caller, playbook, run_id)
        asked = await self.question(ctx, caller, playbook, run_id, view)
        if asked is None or asked[0] not in responses:
            return {}
        key, mode, _params = asked
        try:
            response = mt.ElicitResult.model_validate(responses[key])
        except Exception:
            raise self.error(INVALID_PARAMS, f"inputResponses.{key} is not an elicitation result") from None
        bridge = self.bridge(ctx, caller, playbook, run_id)
        assert bridge is not None
        person = bridge.person
        if response.action != "accept":
            await self.engine.elicitation_declined(person, playbook, run_id, mode, response.action)
        elif mode == "form":
            answer = {k: v for k, v in (response.content or {}).items() if v is not None}
            try:
                await self.engine.answer_interaction(person, playbook, run_id, answer)
            except Problem as exc:
                if exc.name == "invalid_input" and exc.errors:
                    await self.engine.elicitation_refused(person, playbook, run_id, key, exc)
                elif exc.name == "invalid_input":
                    raise self.error(INVALID_PARAMS, exc.detail or "the answer does not fit") from None
                # answered or ended meanwhile: refused as a second answer is, and the task shows the ending
        return {}

    async def cancel(self, ctx: Any, params: Any) -> dict[str, Any]:
        if not _declares_tasks(ctx) and not _legacy_tasks(ctx):
            raise self.missing()
        caller, playbook, run_id, task = await self.read(ctx)
        try:
            await self.engine.cancel_task(caller, playbook, run_id)
        except Problem as exc:
            raise self.error(INVALID_PARAMS, f"The task cannot be cancelled: {exc.detail}") from None
        if _declares_tasks(ctx):
            return {}
        return self.legacy_shape(await self.task(ctx, caller, playbook, run_id, detailed=False))

    async def created(self, ctx: Any, run: Any) -> dict[str, Any] | None:
        """The CreateTaskResult for a call's run that has not ended, else None (the result stands)."""
        caller = self.who(ctx)
        if (caller is None or not isinstance(run, Mapping) or not isinstance(run.get("run_id"), str)
                or not isinstance(run.get("playbook"), str) or RunStatus(run.get("status", "started")).ended):
            return None
        task = await self.task(ctx, caller, run["playbook"], run["run_id"], detailed=False)
        if task["status"] in ("completed", "cancelled", "failed"):
            return None                                  # it ended meanwhile: the blocking result says so
        return {"resultType": "task", **task}

    async def intercept(self, params: Any, ctx: Any, call_next: Callable[[Any], Any]) -> Any:
        """`tools/call`: a task in place of a run that waits, for a request that declared the extension
        (the 2026-07-28 era; the 2025-11-25 era's `params.task` is served by `legacy_call`)."""
        from mcp import types as mt
        out = await call_next(ctx)
        if (params.name not in TASK_TOOLS or not _declares_tasks(ctx) or _legacy_tasks(ctx)
                or not isinstance(out, mt.CallToolResult) or out.is_error):
            return out
        return await self.created(ctx, out.structured_content) or out

    async def waited(self, caller: Caller, playbook: str, run_id: str, seconds: float) -> bool:
        """Wait up to `seconds` for the run to end; False when the wait came back early without an
        ending (the daemon is stopping: a loop over waits then stops too)."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        run = await self.engine.wait_run(caller, playbook, run_id, seconds)
        return RunStatus(run["status"]).ended or loop.time() - began >= seconds / 2

    # -- subscriptions/listen: notifications/tasks ------------------------------------------------------

    async def listen(self, ctx: Any, params: Any) -> Any:
        """`subscriptions/listen` with `notifications.taskIds`: the whole task at each change of its
        status (the first at once), until each has ended or the client leaves."""
        from mcp import types as mt
        from mcp.shared.subscriptions import SUBSCRIPTION_ID_META_KEY
        asked = (self.params(ctx).get("notifications") or {}).get("taskIds")
        if asked is not None and not _declares_tasks(ctx):
            raise self.missing()
        meta = {SUBSCRIPTION_ID_META_KEY: ctx.request_id}
        watched: dict[str, tuple[Caller, str, str]] = {}
        for tid in asked if isinstance(asked, list) else []:
            try:
                caller, playbook, run_id, _ = await self.read(_With(ctx, {"taskId": tid}))
            except Exception:
                continue                                 # unknown or not theirs: not agreed to
            watched[tid] = (caller, playbook, run_id)
        notifications = mt.SubscriptionFilter.model_validate(self.params(ctx).get("notifications") or {})
        ack = notifications.model_dump(by_alias=True, mode="json", exclude_none=True)
        ack["taskIds"] = list(watched)
        await ctx.session.send_notification(_notice(method="notifications/subscriptions/acknowledged",
                                                    params={"notifications": ack, "_meta": meta}),
                                            related_request_id=ctx.request_id)
        last: dict[str, str] = {}
        while watched:
            for tid, (caller, playbook, run_id) in list(watched.items()):
                try:
                    task = await self.task(ctx, caller, playbook, run_id)
                except Problem:
                    watched.pop(tid)
                    continue
                mark = f"{task['status']}:{sorted(task.get('inputRequests') or {})}"
                if last.get(tid) != mark:
                    last[tid] = mark
                    await ctx.session.send_notification(_notice(method="notifications/tasks",
                                                                params={**task, "_meta": meta}),
                                                        related_request_id=ctx.request_id)
                if task["status"] in ("completed", "cancelled", "failed"):
                    watched.pop(tid)
            if watched and not await self.waited(*next(iter(watched.values())), MCP_TASK_POLL_MS / 1000):
                break
        return mt.SubscriptionsListenResult(_meta=meta)

    # -- the 2025-11-25 era's experimental tasks ----------------------------------------------------------

    @staticmethod
    def legacy_shape(task: dict[str, Any]) -> dict[str, Any]:
        """A task in the 2025-11-25 era's words (ttl and pollInterval; no result inline)."""
        out = {k: task[k] for k in ("taskId", "status", "statusMessage", "createdAt", "lastUpdatedAt") if k in task}
        out["ttl"] = task["ttlMs"]
        out["pollInterval"] = task["pollIntervalMs"]
        return out

    async def legacy_get(self, ctx: Any) -> dict[str, Any]:
        _caller, _playbook, _run_id, task = await self.read(ctx)
        return self.legacy_shape(task)

    async def legacy_result(self, ctx: Any, params: Any) -> dict[str, Any]:
        """`tasks/result` (2025-11-25): the CallToolResult once the run has ended; until then it waits."""
        caller, playbook, run_id = self.locate(ctx, self.params(ctx).get("taskId"))
        try:
            while True:
                task = await self.task(ctx, caller, playbook, run_id)
                if task["status"] in ("completed", "cancelled"):
                    break
                if not await self.waited(caller, playbook, run_id, MAX_MCP_WAIT_S):
                    raise self.error(-32603, "the daemon is stopping; ask for the result again")
        except Problem:
            raise self.error(INVALID_PARAMS, "Failed to retrieve task: Task not found") from None
        if task["status"] == "cancelled":
            raise self.error(INVALID_PARAMS, "The task was cancelled")
        related = {"io.modelcontextprotocol/related-task": {"taskId": task["taskId"]}}
        return dict(task["result"], _meta=related)

    async def legacy_list(self, ctx: Any, params: Any) -> dict[str, Any]:
        """`tasks/list` (2025-11-25): the open runs of the connection's playbook this caller may read."""
        caller = self.who(ctx)
        if caller is None:
            raise self.error(INVALID_PARAMS, "no caller")
        playbook = self.home(ctx, caller)
        cursor = self.params(ctx).get("cursor")
        try:
            page = await self.engine.list_runs(caller, playbook, "waiting", None, None,
                                               cursor if isinstance(cursor, str) else None)
        except Problem as exc:
            raise self.error(INVALID_PARAMS, exc.detail or "the list could not be read") from None
        tasks = []
        for run in page["data"]:
            with contextlib.suppress(Problem):
                tasks.append(self.legacy_shape(await self.task(ctx, caller, playbook, run["run_id"], detailed=False)))
        return {"tasks": tasks, **({"nextCursor": page["next_cursor"]} if page.get("next_cursor") else {})}

    async def legacy_call(self, ctx: Any, call_next: Callable[[Any], Any]) -> Any:
        """A `tools/call` with `params.task` (2025-11-25): a CreateTaskResult for a run that waits; the
        run is made (or read) by the call itself, which returns at once."""
        out = await call_next(ctx)
        raw = self.params(ctx)
        if raw.get("name") not in TASK_TOOLS or not isinstance(out, Mapping):
            return out
        run = out.get("structuredContent")
        if out.get("isError") or not isinstance(run, Mapping):
            return out
        task = await self.created(ctx, run)
        return {"task": self.legacy_shape(task)} if task is not None else out


@dataclass(frozen=True)
class _With:
    """A request context with other params (to read a task named in a listen request)."""

    ctx: Any
    params: Mapping[str, Any]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ctx, name)


def _notice(method: str, params: dict[str, Any]) -> Any:
    """A notification of a method the SDK's types do not name (notifications/tasks)."""
    from mcp import types as mt
    return mt.Notification[dict[str, Any], str](method=method, params=params)


def make_mcp_server(engine: Engine, *, caller: Caller | None = None, scoped_playbook: str | None = None,
                    here: str | None = None) -> Any:
    """An MCP server over the engine. `caller` fixes who calls (stdio); otherwise each HTTP request's.
    `here` is the person at a stdio client (`--as`); over HTTP it is the token's person, the one an
    operator's token names in the Interactiond-As header, else the configuration's `mcp.as`."""
    from mcp import types as mt
    from mcp.server import Server as _McpServer
    from mcp.server.extension import compose_tool_call_handler
    tools = {t.name: t for t in MCP_TOOLS}
    schemas = {t.name: _mcp_schema(t, scoped_playbook is not None) for t in MCP_TOOLS}
    validators = {name: compile_schema(s) for name, s in schemas.items()}
    listed = [mt.Tool(name=t.name, description=t.description, input_schema=schemas[t.name],
                      annotations=mt.ToolAnnotations(read_only_hint=t.read_only),
                      execution=mt.ToolExecution(task_support="optional") if t.name in TASK_TOOLS else None)
              for t in MCP_TOOLS]

    def who_calls(ctx: Any) -> Caller | None:
        if caller is not None:
            return caller
        return getattr(getattr(ctx, "request", None), "scope", {}).get("state", {}).get("interactiond_caller")

    def here_of(ctx: Any, who: Caller) -> str | None:
        """The person at the client, whom wait_run may ask there (None: nobody, or a reader's session)."""
        named = getattr(getattr(ctx, "request", None), "headers", None)
        named = named.get("interactiond-as") if named is not None and caller is None else None
        if named is not None:
            if who.role is not Role.OPERATOR or who.person is not None:
                raise Problem("forbidden", "only an operator's token may name the person at the client"
                                           " (the Interactiond-As header)")
            try:
                return person_name(named)
            except ValueError as exc:
                raise Problem("invalid_request", f"Interactiond-As: {exc}") from None
        if who.role.rank < Role.WRITER.rank:
            return None
        return who.person or here or engine.config.mcp_as

    async def list_tools(ctx: Any, params: Any) -> mt.ListToolsResult:
        who = who_calls(ctx)
        if who is not None and who.person is not None:          # a person's token: the inbox tools only
            return mt.ListToolsResult(tools=[t for t in listed if tools[t.name].person])
        return mt.ListToolsResult(tools=listed)

    def result(data: Any, is_error: bool = False, note: str | None = None) -> mt.CallToolResult:
        content = [mt.TextContent(type="text", text=dumps(data))]
        if note:
            content.append(mt.TextContent(type="text", text=note))
        return mt.CallToolResult(content=content, structured_content=data, is_error=is_error)

    async def call_tool(ctx: Any, params: Any) -> mt.CallToolResult | mt.InputRequiredResult:
        try:
            tool = tools.get(params.name)
            who = who_calls(ctx)
            if tool is None or (who is not None and who.person is not None and not tool.person):
                raise not_found(f"no tool {params.name}; list the tools to see them")
            args = dict(params.arguments or {})
            flaw = json_flaw(args)
            if flaw is not None:
                raise Problem("invalid_request", f"the arguments of {tool.name} are not JSON the daemon keeps: {flaw}",
                              errors=[{"pointer": flaw.pointer, "message": str(flaw)}])
            errors = schema_errors(validators[tool.name], args, "")
            if errors:
                raise Problem("invalid_request", f"the arguments of {tool.name} do not match its input schema",
                              errors=errors)
            if who is None:
                raise Problem("unauthorized", "no caller: the HTTP transports need a bearer token")
            pb = scoped_playbook or args.pop("playbook", None) or who.playbook or DEFAULT_PLAYBOOK
            pb = engine.playbook(who, pb)

            began = time.monotonic()
            waits_for: list[str] = []

            async def progress(left: float) -> None:
                """A heartbeat while a call waits (every MCP_HEARTBEAT_S): progress in seconds waited, so a
                client's timeout resets, and whom the run waits for until when."""
                with contextlib.suppress(Exception):
                    waited = time.monotonic() - began
                    if not waits_for:
                        view = await engine.task_view(who, pb, str(args.get("run_id")))
                        waits_for.append(f"waiting for {view['party']} until {fmt_time(view['expires_at'])}"
                                         if view["party"] else "waiting for the run to end")
                    await ctx.session.report_progress(round(waited, 1), round(waited + max(0.0, left), 1),
                                                      f"{waits_for[0]}; {left:.0f} s left in this call")
            tasked = _declares_tasks(ctx) or (_legacy_tasks(ctx) and isinstance((ctx.params or {}).get("task"), Mapping))
            out = await tool.call(engine, who, pb, args, McpCall(progress, ctx, here_of(ctx, who), params,
                                                                 tasks=tasked and tool.name in TASK_TOOLS))
            if isinstance(out, mt.InputRequiredResult):
                return out
            if isinstance(out, tuple):
                return result(*out)
            return result(out)
        except Problem as exc:
            return result(exc.body(), True)
        except Exception:
            log.exception("MCP tool %s failed", getattr(params, "name", "?"))
            return result(Problem("failed", "the daemon failed on this call; its log says why").body(), True)

    def home(ctx: Any, who: Caller) -> str:
        return scoped_playbook or who.playbook or DEFAULT_PLAYBOOK

    def person_here(ctx: Any, who: Caller) -> str | None:
        try:
            return here_of(ctx, who)
        except Problem:
            return None

    tasks = McpTasks(engine, who_calls, home, person_here)
    extension = _tasks_extension(tasks)
    server = _McpServer("interactiond", version=__version__, on_list_tools=list_tools,
                        on_call_tool=compose_tool_call_handler([extension], call_tool),
                        on_subscriptions_listen=tasks.listen,
                        instructions="Ask a person (or a system) a question and wait for a validated answer. "
                                     "Start with list_definitions, or use ask for a quick typed question.")
    server.extensions[extension.identifier] = extension.settings()
    for binding in extension.methods():
        server.add_request_handler(binding.method, binding.params_type, binding.handler)
    capabilities = server.get_capabilities

    def with_tasks(*a: Any, **kw: Any) -> Any:
        """The capabilities, with the 2025-11-25 era's experimental tasks (tools/call, list, cancel)."""
        caps = capabilities(*a, **kw)
        caps.tasks = mt.ServerTasksCapability(list={}, cancel={}, requests={"tools": {"call": {}}})
        return caps
    server.get_capabilities = with_tasks

    async def legacy_tasks(ctx: Any, call_next: Any) -> Any:
        """A 2025-11-25 `tools/call` with `params.task` gets that era's CreateTaskResult (the result's
        shape is not a CallToolResult, so it is made here, above the SDK's check of the result)."""
        if (ctx.method == "tools/call" and _legacy_tasks(ctx) and isinstance(ctx.params, Mapping)
                and isinstance(ctx.params.get("task"), Mapping)):
            return await tasks.legacy_call(ctx, call_next)
        return await call_next(ctx)
    server.middleware.append(legacy_tasks)
    return server


def _tasks_extension(tasks: McpTasks) -> Any:
    """The Tasks extension, through the SDK's extension interface: its methods, and the tools/call
    interceptor that answers with a task."""
    from mcp import types as mt
    from mcp.server.extension import Extension, MethodBinding

    class Tasks(Extension):
        identifier = TASKS_EXTENSION

        def methods(self) -> list[MethodBinding]:
            return [MethodBinding("tasks/get", mt.RequestParams, tasks.get),
                    MethodBinding("tasks/update", mt.RequestParams, tasks.update),
                    MethodBinding("tasks/cancel", mt.RequestParams, tasks.cancel),
                    MethodBinding("tasks/result", mt.RequestParams, tasks.legacy_result),
                    MethodBinding("tasks/list", mt.RequestParams, tasks.legacy_list)]

        async def intercept_tool_call(self, params: Any, ctx: Any, call_next: Any) -> Any:
            return await tasks.intercept(params, ctx, call_next)
    return Tasks()


def asgi_handler(app: Callable[..., Any], *, grace_s: float = 2.0,
                 user: Callable[[Caller], Any] | None = None) -> Callable[..., Any]:
    """Serve an ASGI app (the MCP SDK's transports) from an aiohttp handler.

    Three things matter: the body is read whole first, under the API's 1 MiB bound (413 beyond);
    after it, `receive()` blocks until the peer leaves; and the app runs in its own task, shielded
    from the handler's cancellation, because the SDK drops a session whose opening request was
    cancelled half-way. `user` makes the ASGI `user` of the caller, so the SDK binds each session
    to the token that opened it. Per request, `on_send` sees each message the app sends, and
    `on_start` is handed a function that ends the request as if the peer had left.
    """
    from aiohttp import web
    async def handler(request: web.Request, on_send: Callable[[dict[str, Any]], None] | None = None,
                      on_start: Callable[[Callable[[], None]], None] | None = None) -> web.StreamResponse:
        body = await request.read()         # HTTPRequestEntityTooLarge past client_max_size: a 413 problem
        tr = request.transport
        peer = tr.get_extra_info("peername") if tr else None
        sock = tr.get_extra_info("sockname") if tr else None
        caller = request.get(caller_key())
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": f"{request.version.major}.{request.version.minor}", "method": request.method,
            "scheme": request.scheme, "path": request.path, "raw_path": request.rel_url.raw_path.encode(),
            "root_path": "", "query_string": request.rel_url.raw_query_string.encode(),
            "headers": [(k.lower(), v) for k, v in request.raw_headers],
            "client": tuple(peer[:2]) if peer else None, "server": tuple(sock[:2]) if sock else None,
            "state": {"interactiond_caller": caller}, "extensions": {},
        }
        if user is not None and caller is not None:
            scope["user"] = user(caller)
        resp: web.StreamResponse | None = None
        body_done = False
        gone = asyncio.Event()
        if on_start is not None:
            on_start(gone.set)

        async def receive() -> dict[str, Any]:
            nonlocal body_done
            if not body_done and not gone.is_set():
                body_done = True
                return {"type": "http.request", "body": body, "more_body": False}
            while not gone.is_set():
                t = request.transport
                if t is None or t.is_closing():
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(gone.wait(), 0.5)
            return {"type": "http.disconnect"}

        async def send(msg: dict[str, Any]) -> None:
            nonlocal resp
            if on_send is not None:
                on_send(msg)
            if msg["type"] == "http.response.start":
                resp = web.StreamResponse(status=msg["status"])
                for k, v in msg.get("headers", ()):
                    resp.headers.add(k.decode("latin-1"), v.decode("latin-1"))
                await resp.prepare(request)
            elif msg["type"] == "http.response.body" and resp is not None:
                if msg.get("body"):
                    await resp.write(msg["body"])
                if not msg.get("more_body", False):
                    await resp.write_eof()

        task = asyncio.ensure_future(app(scope, receive, send))
        streams: set[asyncio.Task[Any]] = request.app[streams_key()]
        me = asyncio.current_task()
        if me is not None:
            streams.add(me)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            gone.set()
            done, _ = await asyncio.wait({task}, timeout=grace_s)
            if not done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            raise
        finally:
            if me is not None:
                streams.discard(me)
        return resp if resp is not None else web.Response(status=500)
    return handler


streams_key: Final = functools.partial(state_key, "streams", set)


@dataclass(eq=False)
class McpSession:
    id: str
    owner: str                          # the id of the token that opened it
    used: int                           # the daemon's clock, at its last request or message
    close: Callable[[], Any]            # ends it (async)
    busy: int = 0                       # its requests in flight (an open GET stream too)
    order: int = 0                      # of its last use among all sessions: ties of `used` go by it


class McpSessions:
    """The MCP sessions open over HTTP, each owned by the token that opened it.

    The SDK keeps the sessions; this adds what it lacks. A request that names another token's
    session is 404, as if it did not exist (the SDK checks the same through the ASGI `user`). A
    token holds at most MCP_SESSIONS_PER_TOKEN: opening one more closes its oldest idle one, or is
    refused (503) when every one is busy. A session with no request in flight and none for
    MCP_SESSION_IDLE on the daemon's clock is closed by one timer on the engine's wheel, armed at
    the earliest moment one can go idle: no task per session. A streamable-HTTP session is busy
    while a request of its own is in flight; an SSE session's stream is always open, so it counts
    as used when a message goes either way.
    """

    TIMER: Final = "mcp:-:idle"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.by_id: dict[str, McpSession] = {}
        self.opening: dict[str, int] = {}       # owner -> opening requests in flight
        self.armed: int | None = None
        self.uses = 0
        self.idle_ms = int(MCP_SESSION_IDLE.total_seconds() * 1000)
        engine.on_timer("mcp", lambda playbook, ref, key: self.sweep(key))

    def owned(self, sid: str, caller: Caller) -> McpSession | None:
        """The session `sid` of this caller; 404 when another token owns it."""
        s = self.by_id.get(sid)
        if s is not None and s.owner != caller.id:
            raise not_found("no MCP session of that id for this token")
        return s

    def count(self, owner: str) -> int:
        return sum(1 for s in self.by_id.values() if s.owner == owner)

    async def admit(self, caller: Caller) -> None:
        """Make room for one more session of `caller` (closing its oldest idle one at the cap)."""
        victim = None
        if self.count(caller.id) + self.opening.get(caller.id, 0) >= MCP_SESSIONS_PER_TOKEN:
            idle = [s for s in self.by_id.values() if s.owner == caller.id and s.busy == 0]
            if not idle:
                raise Problem("unavailable", f"this token has {MCP_SESSIONS_PER_TOKEN} MCP sessions open and each is"
                              " busy; end one (DELETE /mcp) before opening another", kind="too_many_sessions")
            victim = min(idle, key=lambda s: (s.used, s.order))
            self.by_id.pop(victim.id, None)
        self.opening[caller.id] = self.opening.get(caller.id, 0) + 1
        if victim is not None:
            await self._end(victim)

    def release(self, caller: Caller) -> None:
        """An opening request ended, whether or not it opened a session."""
        left = self.opening.get(caller.id, 0) - 1
        if left > 0:
            self.opening[caller.id] = left
        else:
            self.opening.pop(caller.id, None)

    def opened(self, caller: Caller, sid: str, close: Callable[[], Any], busy: int) -> McpSession:
        self.uses += 1
        s = self.by_id[sid] = McpSession(sid, caller.id, self.engine.clock.now_ms(), close, busy, self.uses)
        self.arm()
        return s

    def touch(self, s: McpSession) -> None:
        self.uses += 1
        s.used, s.order = self.engine.clock.now_ms(), self.uses
        if s.busy == 0:
            self.arm()

    def forget(self, sid: str) -> None:
        self.by_id.pop(sid, None)

    async def _end(self, s: McpSession) -> None:
        self.by_id.pop(s.id, None)
        try:
            await s.close()
        except Exception:
            log.warning("closing an MCP session failed", exc_info=True)

    def arm(self) -> None:
        """Arm the idle check at the earliest moment a session can be idle long enough. Once armed
        it stays: a use only moves a session's moment later, and the check arms the next one."""
        if self.armed is not None or not self.by_id:
            return
        now = self.engine.clock.now_ms()
        idle = [s.used for s in self.by_id.values() if s.busy == 0]
        self.armed = (min(idle) if idle else now) + self.idle_ms
        self.engine.wheel.set(self.TIMER, self.armed, own=True)

    async def sweep(self, key: str) -> None:
        """The idle check (a timer of the wheel): close each session idle for MCP_SESSION_IDLE."""
        now = self.engine.clock.now_ms()
        self.armed = None
        for s in [s for s in self.by_id.values() if s.busy == 0 and now - s.used >= self.idle_ms]:
            await self._end(s)
        self.arm()


def _opens_session(request: web.Request) -> bool:
    """A streamable-HTTP request that may open a session: a POST with no session id, of the
    protocol eras that have sessions (2026-07-28 has none)."""
    from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
    version = request.headers.get("mcp-protocol-version")
    return (request.method == "POST" and "mcp-session-id" not in request.headers
            and (version is None or version in HANDSHAKE_PROTOCOL_VERSIONS))


_SSE_SESSION_RE: Final = re.compile(rb"session_id=([0-9a-f]{32})")


class _McpTransports:
    """The SDK's streamable-HTTP and SSE apps over one MCP server, built on the first MCP request.

    The streamable transport's session manager needs a task that enters and exits its task group;
    it is started with the transports and stopped when the app shuts down. The sessions it keeps
    are tracked in `sessions` (owner, cap, idle limit); the SDK's own idle timer is off, the
    daemon's clock decides.
    """

    def __init__(self, engine: Engine, allowed_hosts: list[str], allowed_origins: list[str]) -> None:
        self.engine = engine
        self.allowed_hosts = allowed_hosts
        self.allowed_origins = allowed_origins
        self.handlers: dict[str, Callable[..., Any]] | None = None
        self.sessions = McpSessions(engine)
        self.server: Any = None
        self._lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def handler(self, name: str) -> Callable[..., Any]:
        if self.handlers is None:
            await asyncio.shield(self._build())
        assert self.handlers is not None
        return self.handlers[name]

    async def _build(self) -> None:
        async with self._lock:
            if self.handlers is not None:
                return
            from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
            from mcp.server.auth.provider import AccessToken
            from mcp.server.sse import SseServerTransport
            from mcp.server.transport_security import TransportSecuritySettings

            server = self.server = make_mcp_server(self.engine)
            security = TransportSecuritySettings(enable_dns_rebinding_protection=True,
                                                 allowed_hosts=self.allowed_hosts,
                                                 allowed_origins=self.allowed_origins)
            streamable = server.streamable_http_app(streamable_http_path="/mcp", transport_security=security,
                                                    max_request_body_size=MAX_BODY_BYTES, session_idle_timeout=None)
            sse = SseServerTransport("/messages/", security_settings=security, max_request_body_size=MAX_BODY_BYTES)

            async def sse_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
                answered: list[int] = []

                async def sending(msg: dict[str, Any]) -> None:
                    if msg["type"] == "http.response.start":
                        answered.append(msg["status"])
                    await send(msg)
                try:
                    async with sse.connect_sse(scope, receive, sending) as (read, write):
                        await server.run(read, write, server.create_initialization_options())
                except ValueError:
                    # The SDK refused the request (its Host or Origin), answered it (421, 403), logged
                    # one line, and raises besides: that is not a failure of the daemon.
                    if not answered or answered[0] < 400:
                        raise

            def user(caller: Caller) -> Any:
                return AuthenticatedUser(AccessToken(token="", client_id=caller.id, scopes=[]))

            started = asyncio.Event()

            async def hold() -> None:
                async with server.session_manager.run():
                    started.set()
                    await self._stop.wait()
            self._task = asyncio.create_task(hold(), name="interactiond-mcp-sessions")
            await started.wait()
            self.handlers = {"mcp": asgi_handler(streamable, user=user), "sse": asgi_handler(sse_app, user=user),
                             "messages": asgi_handler(sse.handle_post_message, user=user)}

    async def _end_streamable(self, sid: str) -> None:
        """Terminate a streamable-HTTP session: its id answers 404 from now on, its server task ends."""
        transport = getattr(self.server.session_manager, "_server_instances", {}).get(sid)
        if transport is not None:
            await transport.terminate()

    async def serve_mcp(self, request: web.Request) -> web.StreamResponse:
        handler = await self.handler("mcp")
        caller: Caller = request[caller_key()]
        reg = self.sessions
        sid = request.headers.get("mcp-session-id")
        if sid is not None:
            s = reg.owned(sid, caller)
            if s is None:
                return await handler(request)           # unknown or ended: the SDK answers 404
            s.busy += 1
            reg.touch(s)
            try:
                resp = await handler(request)
            finally:
                s.busy -= 1
                reg.touch(s)
            if resp.status == 404 or (request.method == "DELETE" and resp.status < 400):
                reg.forget(sid)
            return resp
        if not _opens_session(request):
            return await handler(request)
        await reg.admit(caller)
        opened: list[McpSession] = []

        def watch(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.start" and msg["status"] < 400 and not opened:
                for k, v in msg.get("headers", ()):
                    if k.lower() == b"mcp-session-id":
                        new = v.decode("latin-1")
                        opened.append(reg.opened(caller, new, functools.partial(self._end_streamable, new), busy=1))
                        reg.release(caller)
        try:
            return await handler(request, watch)
        finally:
            if opened:
                opened[0].busy -= 1
                reg.touch(opened[0])
            else:
                reg.release(caller)

    async def serve_sse(self, request: web.Request) -> web.StreamResponse:
        handler = await self.handler("sse")
        caller: Caller = request[caller_key()]
        reg = self.sessions
        await reg.admit(caller)
        opened: list[McpSession] = []
        ends: list[Callable[[], None]] = []

        async def close() -> None:
            for end in ends:
                end()                       # as if the client had left: the SDK ends the stream and the session

        def watch(msg: dict[str, Any]) -> None:
            if msg["type"] != "http.response.body":
                return
            chunk = msg.get("body") or b""
            if not opened:
                m = _SSE_SESSION_RE.search(chunk)
                if m:
                    opened.append(reg.opened(caller, m.group(1).decode(), close, busy=0))
                    reg.release(caller)
            elif chunk.startswith(b"event: message"):
                reg.touch(opened[0])
        try:
            return await handler(request, watch, ends.append)
        finally:
            if opened:
                reg.forget(opened[0].id)
            else:
                reg.release(caller)

    async def serve_messages(self, request: web.Request) -> web.StreamResponse:
        handler = await self.handler("messages")
        s = self.sessions.owned(request.query.get("session_id", ""), request[caller_key()])
        if s is not None:
            self.sessions.touch(s)
        return await handler(request)

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)


def mcp_allowed(listen_hosts: Iterable[str], public_url: str | None) -> tuple[list[str], list[str]]:
    """The `Host` and `Origin` values /mcp and /sse accept (the SDK's DNS-rebinding protection stays
    on): loopback and the addresses the daemon listens at, on any port, and public_url's host and
    origin, as a TLS proxy passes them on."""
    names = {"127.0.0.1", "localhost", "::1",
             *(h for h in listen_hosts if h and h not in ("0.0.0.0", "::"))}      # a wildcard names no host
    hosts = {f"[{h}]:*" if ":" in h else f"{h}:*" for h in names}
    origins = {f"http://{h}" for h in hosts}
    public = public_origin(public_url)
    if public is not None:
        hosts.add(public[1])
        origins.add(public[0])
    return sorted(hosts), sorted(origins)


def mount_mcp(app: web.Application, engine: Engine, listen_hosts: Iterable[str] = ()) -> None:
    """Streamable HTTP at /mcp and legacy SSE at /sse (+ /messages/) on the API's port."""
    transports = _McpTransports(engine, *mcp_allowed(listen_hosts, engine.config.public_url))
    app[streams_key()] = set()
    app.router.add_route("*", "/mcp", transports.serve_mcp)
    app.router.add_get("/sse", transports.serve_sse)
    app.router.add_post("/messages/", transports.serve_messages)

    async def cancel_streams(app: web.Application) -> None:
        for t in list(app[streams_key()]):
            t.cancel()

    async def close(app: web.Application) -> None:
        await transports.close()

    app.on_shutdown.append(cancel_streams)
    app.on_cleanup.append(close)


# Typed API and client ###########################################################################
#
# The same inbox, presented as typed interactions (SPEC section 8): an open request whose answer
# schema is one of the four canonical shapes is an `approval`, `text`, `choice` or `confirmation`;
# any other answer schema is a `form`. Notifications take no answer and are left out. The typed
# API adds no state of its own besides its idempotency keys: a response becomes an answer through
# `Engine.answer_interaction`, so `request_answered` is the one fact whichever API gave it, and the
# idempotency row is written in the same transaction as that answer (a retry after a crash finds
# either both or neither).
#
# Order of checks on POST /v2/interactions/{id}/responses, as the contract fixes it:
#   1. 404 not_found                      unknown, malformed, or not visible to the token
#   2. 400 idempotency_key_required       no Idempotency-Key header
#   3. replay / 409 idempotency_key_conflict   a key seen before, same body or another
#   4. 409 interaction_not_pending        answered, expired or cancelled
#   5. 422 interaction_type_mismatch      the body's variant is not the interaction's type
#   6. 422 validation_failed              errors: [{field, code, message}], `unknown_field` per extra
#
# The event stream (SSE) reads the events table, never a copy: the engine's subscriber queue only
# rings a doorbell, and each wake reads the committed events after the last id sent. So a replay
# from Last-Event-ID and the live tail are one loop, without gaps or duplicates, and a consumer
# that falls behind costs the engine nothing (its queue is bounded and may drop rings). A consumer
# that stops reading is dropped after SSE_WRITE_TIMEOUT_S and resumes with Last-Event-ID.

V2_STATUS_FILTER: Final = {s: tuple(k for k, v in V2_STATUS.items() if v == s) for s in dict.fromkeys(V2_STATUS.values())}
INTERACTION_ID_RE: Final = re.compile(r"int_[0-9A-Za-z]{1,64}")
#: An Idempotency-Key: long enough for a UUID or a hash, short enough to index.
MAX_IDEMPOTENCY_KEY_CHARS: Final = 255
#: A comment line on an idle stream, so proxies and clients see the connection alive.
SSE_KEEPALIVE_S: Final = 15.0
#: A stream write that cannot finish this long is a consumer that stopped reading: drop it.
SSE_WRITE_TIMEOUT_S: Final = 30.0
#: Events read per hop to the database while a stream catches up.
SSE_PAGE: Final = 500
#: What a reconnecting EventSource waits, in milliseconds.
SSE_RETRY_MS: Final = 2000

_FIELD_CODES: Final = {"type": "invalid_type", "enum": "invalid_option", "maxLength": "too_long",
                       "minLength": "too_short", "maxItems": "too_many", "minItems": "too_few",
                       "uniqueItems": "duplicate", "format": "invalid_format", "pattern": "invalid_format"}


def _v2_problem(name: str, detail: str, **kw: Any) -> Problem:
    return Problem(name, detail, code=name, **kw)


def _bare_schema(schema: Any) -> Any:
    """A schema without its words (description, title), to compare shapes."""
    if isinstance(schema, dict):
        return {k: ({p: _bare_schema(s) for p, s in v.items()} if k == "properties" and isinstance(v, dict)
                    else _bare_schema(v)) for k, v in schema.items() if k not in ("description", "title")}
    if isinstance(schema, list):
        return [_bare_schema(s) for s in schema]
    return schema


@functools.lru_cache(maxsize=1024)
def typed_shape(schema_text: str) -> tuple[str, tuple[str, ...], bool]:
    """(type, option ids, multiple) of an answer schema as recorded; `form` unless it is canonical.

    A choice is the canonical choice schema narrowed to its options: `items.enum` lists them and
    `maxItems` is 1 unless several may be picked.
    """
    bare = _bare_schema(json.loads(schema_text))
    for kind, canon in ASK_ANSWER_SCHEMAS.items():
        if kind != "choice" and bare == _bare_schema(canon):
            return kind, (), False
    opt = bare.get("properties", {}).get("option_ids") if isinstance(bare, dict) else None
    if isinstance(opt, dict) and isinstance(opt.get("items"), dict):
        opt = dict(opt, items=dict(opt["items"]))
        ids = opt["items"].pop("enum", None)
        most = opt.pop("maxItems", None)
        shaped = dict(bare, properties=dict(bare["properties"], option_ids=opt))
        if (shaped == _bare_schema(ASK_ANSWER_SCHEMAS["choice"]) and isinstance(ids, list) and ids
                and all(isinstance(i, str) for i in ids) and len(set(ids)) == len(ids)):
            return "choice", tuple(ids), most != 1
    return "form", (), False


def _typed_payload(row: Mapping[str, Any], kind: str, ids: tuple[str, ...], multiple: bool) -> dict[str, Any]:
    """What a client renders beside the prompt: the options of a choice, a text's hint, a form's schema."""
    input_ = json.loads(row["run_input"]) if row["name"] in ASK_FUNCTIONS else {}
    if kind == "choice":
        labels = {o.get("id"): o.get("label") for o in input_.get("options", []) if isinstance(o, dict)}
        return {"options": [{"id": i, "label": labels.get(i, i)} for i in ids], "multiple": multiple}
    if kind == "text":
        return {"placeholder": input_.get("placeholder")}
    if kind == "form":
        return {"schema": json.loads(row["answer_schema"])}
    return {}


def typed_response(kind: str, answer: Any, submitted_at: int | None) -> dict[str, Any]:
    """An answer as the typed API shows it: the body that gives it, with submitted_at merged."""
    body = {"type": kind, **answer} if kind != "form" else {"type": "form", "answer": answer}
    return dict(body, submitted_at=fmt_time(submitted_at))


def interaction_object(row: Mapping[str, Any]) -> dict[str, Any]:
    """The one place a request (joined with its run's input, see _V2_SELECT) becomes a v2 object."""
    kind, ids, multiple = typed_shape(row["answer_schema"])
    answered = row["status"] == RequestStatus.ANSWERED
    # An expired request that holds an answer took its default: that is its response, given by nobody.
    defaulted = row["status"] == RequestStatus.EXPIRED.value and row["answer"] is not None
    return {
        "id": row["id"], "playbook": row["playbook"], "run_id": row["run_id"], "type": kind,
        "status": V2_STATUS[row["status"]], "prompt": row["message"],
        "payload": _typed_payload(row, kind, ids, multiple),
        "response": (typed_response(kind, json.loads(row["answer"]), row["answered_at"])
                     if answered or defaulted else None),
        "defaulted": defaulted,
        "expires_at": fmt_time(row["expires_at"]), "created_at": fmt_time(row["asked_at"]),
        "answered_at": fmt_time(row["answered_at"]) if answered else None,
        "addressees": addressees(row), "reminded": row["reminded"], "digest": row["digest"],
    }


def _field_name(path: Iterable[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _field_errors(validator: Any, instance: Any, prefix: list[Any]) -> list[dict[str, str]]:
    """Every way `instance` fails its schema, as {field, code, message}; extra members are unknown_field."""
    out: dict[tuple[str, str], str] = {}
    for err in validator.iter_errors(instance):
        path = prefix + list(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            known = err.schema.get("properties", {}) if isinstance(err.schema, dict) else {}
            for extra in (k for k in err.instance if k not in known):
                out[(_field_name(path + [extra]), "unknown_field")] = f"{extra} is not a field of this response"
        elif err.validator == "required" and isinstance(err.instance, dict):
            for missing in (k for k in err.validator_value if k not in err.instance):
                out[(_field_name(path + [missing]), "required")] = f"{missing} is required"
        elif err.validator == "enum" and "option_ids" in path:
            out[(_field_name(path), "invalid_option")] = f"{err.instance!r} is not an option of this interaction"
        else:
            out[(_field_name(path), _FIELD_CODES.get(str(err.validator), "invalid_value"))] = err.message
    return [{"field": f, "code": c, "message": m} for (f, c), m in sorted(out.items())]


def typed_answer(kind: str, schema: dict[str, Any], body: dict[str, Any]) -> Any:
    """The answer a response body gives, after checks 5 and 6 of the order above."""
    given = body.get("type")
    if given is None:
        raise _v2_problem("validation_failed", "the response names no type",
                          errors=[{"field": "type", "code": "required", "message": f"type is required ({kind} here)"}])
    if given != kind:
        raise _v2_problem("interaction_type_mismatch", f"this interaction takes a {kind} response, not {given!r}")
    validator = compile_schema(schema)
    if kind != "form":
        answer = {k: v for k, v in body.items() if k != "type"}
        errors = _field_errors(validator, answer, [])
    else:
        answer = body.get("answer")
        errors = [{"field": k, "code": "unknown_field", "message": f"{k} is not a field of a form response"}
                  for k in body if k not in ("type", "answer")]
        if "answer" not in body:
            errors.append({"field": "answer", "code": "required", "message": "answer is required"})
        else:
            errors += _field_errors(validator, answer, ["answer"])
    if errors:
        raise _v2_problem("validation_failed", "the response does not fit the interaction",
                          errors=sorted(errors, key=lambda e: (e["field"], e["code"])))
    return answer


def _limit_v2(limit: Any) -> int:
    try:
        return check_limit(limit)
    except Problem:
        raise _v2_problem("validation_failed", f"limit is between 1 and {MAX_PAGE}", errors=[
            {"field": "limit", "code": "invalid_value", "message": f"an integer from 1 to {MAX_PAGE}"}]) from None


def _visible(engine: Engine, caller: Caller) -> list[str]:
    return sorted(pb for pb in engine.playbooks if caller.sees(pb))


async def find_interaction(engine: Engine, caller: Caller, ident: str) -> Row:
    """The request behind an interaction id, or 404 when it is unknown, malformed or not the caller's."""
    row = None
    if INTERACTION_ID_RE.fullmatch(ident):
        row = await engine.store.read(lambda tx: tx.interaction(ident))
    if row is None or row["playbook"] not in engine.playbooks or not caller.sees(row["playbook"]) \
            or not (await engine.deputized(caller, row["playbook"])).addressed(row):
        raise _v2_problem("not_found", "The interaction does not exist or is not visible to this token.")
    return row


async def list_typed_interactions(engine: Engine, caller: Caller, status: str | None = None,
                                  run_id: str | None = None, limit: Any = None,
                                  cursor: str | None = None) -> dict[str, Any]:
    """Newest first, cursor-paged: {data, page: {has_more, next_cursor}}."""
    if status is not None and status not in V2_STATUS_FILTER:
        raise _v2_problem("validation_failed", "unknown status", errors=[
            {"field": "status", "code": "invalid_value", "message": "one of " + ", ".join(V2_STATUS_FILTER)}])
    n = _limit_v2(limit)
    before = decode_cursor(cursor)[0] if cursor else None
    if before is not None and (not isinstance(before, int) or isinstance(before, bool)):
        raise _v2_problem("bad_request", "The cursor does not decode; pass next_cursor as it came.")
    playbooks = _visible(engine, caller)
    statuses = V2_STATUS_FILTER[status] if status else tuple(V2_STATUS)
    rows = await engine.store.read(lambda tx: tx.interactions(playbooks, statuses, run_id=run_id, before=before,
                                                              limit=n + 1, party=caller.person)) if playbooks else []
    more = len(rows) > n
    return {"data": [engine.links.shown(interaction_object(r), r, caller) for r in rows[:n]],
            "page": {"has_more": more, "next_cursor": encode_cursor([rows[n - 1]["seq"]]) if more else None}}


async def respond_interaction(engine: Engine, caller: Caller, row: Row, key: str | None,
                              raw: bytes) -> tuple[int, dict[str, Any], bool]:
    """Answer the interaction `row` (found by find_interaction) with a typed response.

    Returns (HTTP status, the interaction object, whether it is a replay of the key's first response).
    """
    if not key:
        raise _v2_problem("idempotency_key_required", "send an Idempotency-Key header (a UUID will do)")
    if len(key) > MAX_IDEMPOTENCY_KEY_CHARS or not key.isprintable():
        raise _v2_problem("idempotency_key_required",
                          f"the Idempotency-Key is 1 to {MAX_IDEMPOTENCY_KEY_CHARS} printable characters")
    body = body_json(raw) if raw else None
    if not isinstance(body, dict):
        raise _v2_problem("bad_request", "the body is a JSON object: the response variant")
    body_sha = sha256_hex(json.dumps({"interaction": row["id"], "body": body}, sort_keys=True, ensure_ascii=False))
    # The answer's own transaction keeps the key with the response, built from the closed request.
    idempotency = IdempotencyKey(caller=caller.id, key=key, body_sha=body_sha,
                                 response=lambda closed: interaction_object({**closed, "run_input": row["run_input"]}))
    if (first := await engine.replayed(idempotency)) is not None:
        return 200, first, True
    if row["status"] != RequestStatus.OPEN or row["delivery_state"] == DeliveryState.CANCELLING.value:
        raise _not_pending(row["status"])
    kind, _, _ = typed_shape(row["answer_schema"])
    # The digest of what was shown, beside the variant's fields (its own, not a field of the answer).
    digest = body.get("digest")
    answer = typed_answer(kind, json.loads(row["answer_schema"]), {k: v for k, v in body.items() if k != "digest"})
    try:
        response, new = await engine.answer_interaction(caller, row["playbook"], row["run_id"], answer,
                                                        idempotency=idempotency, digest=digest)
    except Problem as exc:
        raise _v2_refusal(exc, kind) from None
    return 200, response, not new


def _not_pending(status: str) -> Problem:
    """409 interaction_not_pending for a request in `status` (or `cancelling`: open, being cancelled)."""
    shown = V2_STATUS.get(status, "pending")
    words = "being cancelled" if shown == "pending" else shown
    return _v2_problem("interaction_not_pending", f"the interaction is {words}; it takes no response",
                       extra={"interaction_status": shown})


def _v2_refusal(exc: Problem, kind: str) -> Problem:
    """The engine's refusal of a typed response, as the typed API names it: a request that has ended
    (its status is the problem's kind) is not pending, an answer off its schema fails validation."""
    if exc.name in ("answered", "not_open"):
        return _not_pending(exc.kind or "")
    if exc.name == "digest_mismatch":
        return _v2_problem("digest_mismatch", exc.detail, extra=exc.extra)
    if exc.name == "invalid_input" and exc.errors and exc.errors[0]["pointer"] == "/digest":
        return _v2_problem("validation_failed", exc.detail, errors=[
            {"field": "digest", "code": "invalid_value", "message": exc.errors[0]["message"]}])
    if exc.name == "invalid_input":
        prefix = "answer" if kind == "form" else ""
        return _v2_problem("validation_failed", exc.detail, errors=[
            {"field": _field_name(([prefix] if prefix else []) + [p for p in e["pointer"].split("/")[2:] if p])
             or "answer", "code": "invalid_value", "message": e["message"]} for e in exc.errors or []])
    return exc


# -- the event stream ---------------------------------------------------------------------------

_RUN_ENDINGS: Final = tuple(f"run_{s.value}" for s in RunStatus if s.ended)
_STREAMED: Final = ("interaction_requested", "request_answered", "request_reminded", "request_escalated",
                     "request_defaulted", *_RUN_ENDINGS)


def _stream_messages(ev: Row, req: Row | None) -> list[tuple[str, dict[str, Any]]]:
    """The stream messages one committed event stands for: none, one, or an interaction's end and run.ended."""
    payload = json.loads(ev["payload"])
    base = {"event_id": f"evt_{ev['id']}", "at": fmt_time(ev["at"]), "playbook": ev["playbook"],
            "run_id": ev["run_id"]}
    typed = req is not None and req["answer_schema"] is not None
    kind = typed_shape(req["answer_schema"])[0] if typed else None
    about = {"interaction_id": req["id"], "interaction_type": kind} if typed else {}
    if ev["type"] == "interaction_requested":
        return [("interaction.created", {**base, **about})] if typed else []
    if ev["type"] == "request_answered":
        return [("interaction.answered", {**base, **about,
                                          "response": typed_response(kind, payload.get("answer"), ev["at"])})] if typed else []
    if ev["type"] == "request_reminded":
        return [("interaction.reminded", {**base, **about, "n": payload.get("n")})] if typed else []
    if ev["type"] == "request_escalated":
        return [("interaction.escalated", {**base, **about, "to": payload.get("to")})] if typed else []
    if ev["type"] == "request_defaulted":          # the interaction expired, taking its default as its response
        return [(ENDINGS["defaulted"].stream or "", {**base, **about, "defaulted": True,
                 "response": typed_response(kind, payload.get("answer"), ev["at"])})] if typed else []
    out = []
    if typed and ev["type"] == EventType.RUN_REJECTED.value and payload.get("kind") in STREAM_ENDINGS:
        out.append((STREAM_ENDINGS[payload["kind"]], {**base, **about}))
    out.append(("run.ended", {**base, "status": payload.get("status"), "kind": payload.get("kind")}))
    return out


def _stream_page(tx: Tx, playbooks: list[str], after: int) -> tuple[bytes, int, bool]:
    """The SSE bytes of the streamed events after `after`; the last id read; whether more follow."""
    rows = tx.events_after(after, types=_STREAMED, playbooks=playbooks, limit=SSE_PAGE)
    reqs: dict[tuple[str, str], Row | None] = {}
    chunks = []
    for ev in rows:
        where = (ev["playbook"], ev["run_id"])
        if where not in reqs:
            reqs[where] = tx.request_shape(*where)
        for name, data in _stream_messages(ev, reqs[where]):
            chunks.append(f"id: evt_{ev['id']}\nevent: {name}\ndata: {dumps(data)}\n\n")
    return "".join(chunks).encode(), (rows[-1]["id"] if rows else after), len(rows) == SSE_PAGE


def _last_event_id_source(request: web.Request) -> dict[str, str]:
    """Where the resume point came from, for a problem's `errors`: the header or the query parameter."""
    return {"header": "Last-Event-ID"} if request.headers.get("Last-Event-ID") else {"pointer": "/last_event_id"}


def _last_event_id(request: web.Request) -> int | None:
    text = request.headers.get("Last-Event-ID") or request.query.get("last_event_id")
    if not text:
        return None
    m = re.fullmatch(r"(?:evt_)?([0-9]{1,18})", text.strip())
    if not m:
        raise _v2_problem("bad_request", "Last-Event-ID is an event id as the stream sent it (evt_123)",
                          errors=[{**_last_event_id_source(request), "message": "an event id the stream sent"}])
    return int(m.group(1))


async def serve_stream(request: web.Request, playbooks: list[str]) -> web.StreamResponse:
    """Server-Sent Events of `playbooks`, from Last-Event-ID (or from now) on, until the client leaves."""
    from aiohttp import web
    engine = request.app[engine_key()]
    after = _last_event_id(request)
    doorbell = engine.subscribe()           # before reading: nothing committed from here on is missed
    tasks: set[asyncio.Task[Any]] = request.app[sse_tasks_key()]
    me = asyncio.current_task()
    tasks.add(me)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    try:
        newest = await engine.store.read(lambda tx: tx.last_event_id())
        if after is None:
            after = newest
        elif after > newest:                # never sent: resuming there would skip what comes before it
            raise _v2_problem("bad_request", f"Last-Event-ID evt_{after} names no event the stream sent; the newest "
                              f"is evt_{newest}. Resume from an id the stream sent, or leave the header out.",
                              errors=[{**_last_event_id_source(request), "message": "an event id the stream sent"}])
        await resp.prepare(request)
        await resp.write(f"retry: {SSE_RETRY_MS}\n: stream open after evt_{after}\n\n".encode())
        while True:
            while not doorbell.empty():
                doorbell.get_nowait()
            data, after, more = await engine.store.read(functools.partial(_stream_page, playbooks=playbooks,
                                                                          after=after))
            if data:
                await asyncio.wait_for(resp.write(data), SSE_WRITE_TIMEOUT_S)
            if more:
                continue
            try:
                await asyncio.wait_for(doorbell.get(), SSE_KEEPALIVE_S)
            except asyncio.TimeoutError:
                await asyncio.wait_for(resp.write(b": keep-alive\n\n"), SSE_WRITE_TIMEOUT_S)
    except (asyncio.TimeoutError, ConnectionError):
        if not resp.prepared:
            raise
        if request.transport is not None:       # a consumer that stopped reading: it resumes later
            request.transport.close()
        return resp
    finally:
        engine.unsubscribe(doorbell)
        tasks.discard(me)


# -- routes -------------------------------------------------------------------------------------

sse_tasks_key: Final = functools.partial(state_key, "sse_tasks", set)


async def h_v2_list(request: web.Request) -> web.Response:
    q = request.query
    return _json(await list_typed_interactions(request.app[engine_key()], _caller(request), q.get("status"),
                                               q.get("run_id"), q.get("limit"), q.get("cursor")))


async def h_v2_get(request: web.Request) -> web.Response:
    engine, caller = request.app[engine_key()], _caller(request)
    row = await find_interaction(engine, caller, request.match_info["id"])
    return _json(engine.links.shown(interaction_object(row), row, caller))


async def h_v2_respond(request: web.Request) -> web.Response:
    from aiohttp import web
    engine, caller = request.app[engine_key()], _caller(request)
    row = await find_interaction(engine, caller, request.match_info["id"])     # 404 before anything else
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _v2_problem("too_large", f"the body is larger than {MAX_BODY_BYTES // MIB} MiB") from None
    status, obj, replayed = await respond_interaction(engine, caller, row, request.headers.get("Idempotency-Key"), raw)
    resp = _json(engine.links.shown(dict(obj), row, caller), status)
    if replayed:
        resp.headers["Idempotent-Replayed"] = "true"
    return resp


async def h_v2_events(request: web.Request) -> web.StreamResponse:
    return await serve_stream(request, _visible(request.app[engine_key()], _caller(request)))


async def h_playbook_stream(request: web.Request) -> web.StreamResponse:
    return await serve_stream(request, [_pb(request)])


_RESPONSE_BODY: Final = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": [*ASK_ANSWER_SCHEMAS, "form"]},
    "approved": {"type": "boolean"}, "comment": {"type": "string", "maxLength": 2000},
    "text": {"type": "string", "maxLength": 8000}, "option_ids": {"type": "array", "items": {"type": "string"}},
    "confirmed": {"type": "boolean"}, "answer": {}}}

TYPED_ROUTES: Final[list[Route]] = [
    Route("GET", "/v2/interactions", h_v2_list, "List typed interactions, newest first",
          query=("status", "run_id", "limit", "cursor"), person=True),
    Route("GET", "/v2/interactions/{id}", h_v2_get, "Get one typed interaction", person=True),
    Route("POST", "/v2/interactions/{id}/responses", h_v2_respond,
          "Respond to an interaction (Idempotency-Key header required)", Role.WRITER, _RESPONSE_BODY, person=True),
    Route("GET", "/v2/events", h_v2_events, "Server-Sent Events of every visible playbook (Last-Event-ID resumes)"),
    Route("GET", PB + "/stream", h_playbook_stream, "Server-Sent Events of one playbook (Last-Event-ID resumes)"),
]
ROUTES.extend(TYPED_ROUTES)                 # served by build_app's loop and documented in /openapi.json
ROUTE_BY_HANDLER.update({r.handler: r for r in TYPED_ROUTES})


async def _v2_codes(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    """_v2_code as a middleware of its own, for an app without observe_middleware (which does it)."""
    resp = await handler(request)
    if request.path.startswith("/v2/"):
        _v2_code(resp)
    return resp


def mount_typed_api(app: web.Application) -> None:
    """What the typed API needs of an app beyond its routes: `code` on its problems, streams ended at shutdown."""
    from aiohttp import web
    if observe_middleware not in app.middlewares:
        app.middlewares.insert(0, web.middleware(_v2_codes))
    app[sse_tasks_key()] = set()

    async def end_streams(app: web.Application) -> None:
        for task in list(app[sse_tasks_key()]):
            task.cancel()
    app.on_shutdown.append(end_streams)


# -- the Python client --------------------------------------------------------------------------
#
# `Client(base_url, token)` speaks the HTTP API with the standard library only. Every call may be
# retried after a lost connection or a 5xx problem: answering carries one Idempotency-Key for all
# its tries, a run gets its run_id before the first try, and the rest are reads or idempotent.


class ClientError(Problem):
    """What the daemon answered with a problem (or `unreachable` when it was not reached)."""

    @property
    def problem(self) -> dict[str, Any]:
        return self.body()


class Client:
    """A small synchronous client of interactiond's HTTP API (urllib only)."""

    def __init__(self, base_url: str, token: str, *, playbook: str = DEFAULT_PLAYBOOK, timeout: float = 75.0,
                 retries: int = 3, backoff: float = 0.25) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.playbook = playbook
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        org, _, name = playbook.partition("/")
        self.pb_path = f"/v1/orgs/{org}/playbooks/{name}"
        self.interactions = _Interactions(self)
        self.runs = _Runs(self)
        self.definitions = _Definitions(self)

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, Any] | None = None,
                headers: dict[str, str] | None = None) -> Any:
        """One call, retried after a lost connection or a 5xx problem; a problem raises ClientError.

        A run object comes back whatever its HTTP status (the status tells the run's ending).
        """
        import http.client
        import urllib.error
        import urllib.request
        url = self.base_url + path
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        data = dumps(body).encode() if body is not None else None
        head = {"Authorization": f"Bearer {self.token}", "Accept": "application/json", **(headers or {})}
        if data is not None:
            head["Content-Type"] = "application/json"
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            req = urllib.request.Request(url, data=data, method=method, headers=head)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read() or b"null")
            except urllib.error.HTTPError as exc:
                raw, ctype = exc.read(), exc.headers.get_content_type()
                try:
                    got = json.loads(raw)
                except ValueError:
                    got = None
                if ctype == "application/json" and isinstance(got, dict) and "run_id" in got:
                    return got
                if exc.code >= 500 and not last:
                    time.sleep(self.backoff * 2 ** attempt)
                    continue
                if not isinstance(got, dict):
                    got = {"type": PROBLEM_BASE + "failed", "title": exc.reason, "status": exc.code,
                           "detail": raw.decode(errors="replace")[:500]}
                raise ClientError.from_body(got) from None
            except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
                if not last:
                    time.sleep(self.backoff * 2 ** attempt)
                    continue
                raise ClientError("unreachable", f"{method} {url}: {exc}", status=503, code="unreachable") from exc
        raise AssertionError("unreachable")


class _Interactions:
    def __init__(self, client: Client) -> None:
        self._c = client

    def list(self, status: str | None = None, run_id: str | None = None, limit: int | None = None) -> Iterable[dict[str, Any]]:
        """Every matching interaction, newest first, fetching `limit` per page as the iteration goes."""
        cursor = None
        while True:
            page = self._c.request("GET", "/v2/interactions", query={"status": status, "run_id": run_id,
                                                                      "limit": limit, "cursor": cursor})
            yield from page["data"]
            cursor = page["page"]["next_cursor"]
            if not page["page"]["has_more"] or not cursor:
                return

    def get(self, interaction_id: str) -> dict[str, Any]:
        return self._c.request("GET", f"/v2/interactions/{urllib.parse.quote(interaction_id, safe='')}")

    def respond(self, interaction_id: str, type: str, *, idempotency_key: str | None = None,
                **fields: Any) -> dict[str, Any]:
        """Answer: respond(id, type="approval", approved=True, comment=...), type="text", text=...,
        type="choice", option_ids=[...], type="confirmation", confirmed=..., or type="form", answer={...}.
        """
        key = idempotency_key or secrets.token_hex(16)
        return self._c.request("POST", f"/v2/interactions/{urllib.parse.quote(interaction_id, safe='')}/responses",
                               {"type": type, **fields}, headers={"Idempotency-Key": key})


class _Runs:
    def __init__(self, client: Client) -> None:
        self._c = client

    def _path(self, run_id: str, tail: str = "") -> str:
        return f"{self._c.pb_path}/runs/{urllib.parse.quote(run_id, safe='')}{tail}"

    def start(self, type: str, name: str, input: Any = None, run_id: str | None = None) -> dict[str, Any]:
        """Start a run; its run_id is chosen before the first try, so a retry finds the same run."""
        body = {"type": type, "name": name, "input": {} if input is None else input, "run_id": run_id or new_run_id()}
        return self._c.request("POST", f"{self._c.pb_path}/runs", body)

    def get(self, run_id: str) -> dict[str, Any]:
        return self._c.request("GET", self._path(run_id))

    def wait(self, run_id: str, timeout: float = 60.0) -> dict[str, Any]:
        """The run once it ends, or as it stands after `timeout` seconds (long polls of up to a minute)."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            run = self._c.request("POST", self._path(run_id, "/wait"),
                                  query={"timeout": f"{min(left, MAX_HTTP_WAIT_S):.3f}"})
            if RunStatus(run["status"]).ended or left <= 0:
                return run

    def cancel(self, run_id: str) -> dict[str, Any]:
        return self._c.request("POST", self._path(run_id, "/cancel"))

    def pending_interactions(self, run_id: str) -> list[dict[str, Any]]:
        return list(self._c.interactions.list(status="pending", run_id=run_id))


class _Definitions:
    def __init__(self, client: Client) -> None:
        self._c = client

    def create(self, type: str, name: str, source: str) -> dict[str, Any]:
        return self._c.request("POST", f"{self._c.pb_path}/definitions", {"type": type, "name": name, "source": source})

    def get(self, type: str, name: str, version: int | None = None) -> dict[str, Any]:
        return self._c.request("GET", f"{self._c.pb_path}/definitions/{type}/{urllib.parse.quote(name, safe='')}",
                               query={"version": version})


# The page's text ################################################################################
#
# The inbox page's stylesheet, script and HTML, just above the code that serves them. The page is
# one document with its style and script inline, allowed by their hashes (INBOX_HEADERS).

_INBOX_CSS: Final = """
:root { color-scheme: light dark; --fg: #1c1f24; --bg: #f5f6f8; --card: #fff; --line: #cfd5de; --muted: #565e6b;
  --accent: #1b5cc4; --on-accent: #fff; --err: #b0001e; --ok: #1b7a3a; }
@media (prefers-color-scheme: dark) { :root { --fg: #e6e8eb; --bg: #14161a; --card: #1e2126; --line: #3b414a;
  --muted: #a7aeb9; --accent: #86b4ff; --on-accent: #0b1830; --err: #ff9090; --ok: #80d69b; } }
* { box-sizing: border-box; }
[hidden] { display: none !important; }
body { margin: 0; font: 16px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
  background: var(--bg); }
a { color: var(--accent); }
:focus-visible { outline: 3px solid var(--accent); outline-offset: 2px; }
header.top { display: flex; flex-wrap: wrap; gap: .5rem 1rem; align-items: center; padding: .6rem 1rem;
  background: var(--card); border-bottom: 1px solid var(--line); }
.brand { font-weight: 700; }
nav a { margin-right: .9rem; }
nav a[aria-current=page] { font-weight: 700; text-decoration: none; }
.ctl { margin-left: auto; display: flex; flex-wrap: wrap; gap: .5rem; align-items: center; }
main { max-width: 60rem; margin: 0 auto; padding: 1rem; }
h1 { font-size: 1.5rem; margin: .25rem 0 .75rem; }
h2 { font-size: 1.15rem; margin: 0; }
.muted, .hint { color: var(--muted); }
.hint { font-size: .875rem; margin: .15rem 0 0; }
.bar { display: flex; flex-wrap: wrap; gap: .5rem; align-items: center; margin-bottom: 1rem; }
ol.requests, ol.timeline { list-style: none; padding: 0; margin: 0; }
.card, .req article { background: var(--card); border: 1px solid var(--line); border-radius: .5rem; padding: 1rem;
  margin-bottom: 1rem; }
.to { font-weight: 400; color: var(--muted); font-size: .95rem; }
.meta { margin: .25rem 0 .5rem; font-size: .875rem; color: var(--muted); }
.msg { overflow-wrap: anywhere; }
.msg pre { overflow-x: auto; }
.msg img { max-width: 100%; }
.msg table { border-collapse: collapse; }
.msg th, .msg td { border: 1px solid var(--line); padding: .2rem .4rem; }
label, legend { font-weight: 600; }
.field { display: flex; flex-direction: column; margin: .6rem 0; }
.opt { font-weight: 400; display: inline-flex; gap: .4rem; align-items: center; margin-right: 1rem; min-height: 2rem; }
textarea, input, select { font: inherit; color: inherit; background: var(--bg); border: 1px solid var(--line);
  border-radius: .35rem; padding: .4rem .5rem; max-width: 100%; }
textarea { width: 100%; resize: vertical; }
textarea.json, code, pre, .preview { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
textarea.json { font-size: .9rem; }
input[type=number] { width: 12rem; }
fieldset { border: 1px solid var(--line); border-radius: .35rem; margin: 0; padding: .3rem .75rem .5rem; }
legend { padding: 0 .25rem; }
button { font: inherit; cursor: pointer; border: 1px solid var(--line); border-radius: .35rem; padding: .45rem .9rem;
  background: var(--card); color: inherit; min-height: 2.5rem; }
button.primary, .choice button { background: var(--accent); border-color: var(--accent); color: var(--on-accent);
  font-weight: 600; }
button:disabled { opacity: .6; cursor: default; }
[aria-invalid=true] { border-color: var(--err); box-shadow: 0 0 0 1px var(--err); }
.choice-row { display: flex; flex-wrap: wrap; gap: .5rem 1rem; align-items: flex-end; margin-top: .5rem; }
.choice-row .field { flex: 1 1 16rem; margin: 0; }
.choice-col { display: flex; flex-direction: column; gap: .25rem; }
.choice { display: flex; flex-wrap: wrap; gap: .5rem; }
.err { color: var(--err); font-size: .9rem; margin: .2rem 0 0; font-weight: 600; }
.err:empty { display: none; }
#status p { background: var(--card); border-left: 4px solid var(--ok); padding: .5rem .75rem; margin: 0 0 1rem; }
.timeline li { margin-bottom: .5rem; }
button.event { width: 100%; text-align: left; display: flex; flex-wrap: wrap; gap: .1rem .75rem; }
.preview { flex-basis: 100%; font-size: .85rem; color: var(--muted); overflow-wrap: anywhere; }
pre { background: var(--card); border: 1px solid var(--line); border-radius: .35rem; padding: .75rem;
  overflow-x: auto; font-size: .85rem; margin: .25rem 0 .75rem; }
dl.run { display: grid; grid-template-columns: max-content 1fr; gap: .25rem 1rem; }
dl.run dt { font-weight: 600; }
dl.run dd { margin: 0; overflow-wrap: anywhere; }
details.card summary { cursor: pointer; font-weight: 600; }
.wide { overflow-x: auto; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .35rem .5rem; border-bottom: 1px solid var(--line); }
@media (max-width: 40rem) { main { padding: .75rem; } .ctl { margin-left: 0; } .choice button { flex: 1 1 auto; }
  input[type=number] { width: 100%; } }
"""

_INBOX_JS: Final = r"""
"use strict";
const $ = (sel) => document.querySelector(sel);
const enc = encodeURIComponent;
const S = {session: null, pb: null, to: "", items: new Map(), gone: new Set(), timer: null, es: null, skew: 0,
           seq: 0, busy: false, again: false, countsSig: "", loaded: false};
const STREAM_EVENTS = ["interaction.created", "interaction.answered", "interaction.expired", "interaction.cancelled",
                       "interaction.reminded", "interaction.escalated", "run.ended"];
const FORCE_POLL = new URLSearchParams(location.search).get("live") === "poll";   // for proxies that break SSE

function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === false || v === null || v === undefined) continue;
    if (k === "text") el.textContent = v;
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid !== null && kid !== undefined && kid !== false) el.append(kid instanceof Node ? kid : String(kid));
  }
  return el;
}

function base(pb = S.pb) {
  const [org, name] = pb.split("/");
  return `/v1/orgs/${enc(org)}/playbooks/${enc(name)}`;
}

async function api(method, path, body) {
  const init = {method, credentials: "same-origin", headers: {"Accept": "application/json"}};
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let resp;
  try {
    resp = await fetch(path, init);
  } catch (e) {
    return {status: 0, ok: false, body: {title: "The daemon did not answer", detail: String(e)}};
  }
  const text = await resp.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (e) { data = {detail: text}; }
  if (resp.status === 401 && S.session) signedOut();
  return {status: resp.status, ok: resp.ok, body: data};
}

function problemText(p) {
  if (!p) return "The daemon did not say why.";
  return [p.title, p.detail].filter(Boolean).join(": ") || JSON.stringify(p);
}

// Times: the daemon's clock may differ from this machine's (a manual clock in demos), so relative
// times count from the daemon's "now" as last reported.
const RTF = new Intl.RelativeTimeFormat("en", {numeric: "auto"});
const UNITS = [["year", 31536000], ["month", 2592000], ["week", 604800], ["day", 86400], ["hour", 3600], ["minute", 60]];
function setNow(iso) { if (iso) S.skew = Date.parse(iso) - Date.now(); }
function relative(iso) {
  if (!iso) return "";
  const d = (Date.parse(iso) - (Date.now() + S.skew)) / 1000, a = Math.abs(d);
  for (const [unit, s] of UNITS) if (a >= s) return RTF.format(Math.round(d / s), unit);
  return RTF.format(Math.round(d), "second");
}
function relTime(iso) { return h("time", {datetime: iso, title: iso, "data-rel": ""}, relative(iso)); }
function absTime(iso) {
  return h("time", {datetime: iso, title: relative(iso)},
           iso ? new Date(iso).toLocaleString("en-GB", {dateStyle: "medium", timeStyle: "medium"}) : "");
}
setInterval(() => document.querySelectorAll("time[data-rel]").forEach(t => { t.textContent = relative(t.dateTime); }), 15000);

function say(...parts) {
  const p = h("p", {tabindex: "-1"}, ...parts);
  $("#status").replaceChildren(p);
  return p;
}

// Signing in and the playbook -----------------------------------------------------------------

async function boot() {
  const r = await api("GET", "/web/session");
  $("#loading").hidden = true;
  if (r.status === 401) return signedOut();
  if (!r.ok) return say(problemText(r.body));
  S.session = r.body;
  setNow(r.body.now);
  const saved = sessionStorage.getItem("interactiond.playbook");
  S.pb = r.body.playbooks.includes(saved) ? saved : r.body.playbook;
  if (!S.pb) return say("This sign-in sees no playbook.");
  // A person sees the requests addressed to them, and nothing else: no runs, definitions or filter.
  const person = r.body.person;
  $("#who").textContent = person ? `Signed in as ${person}` : `Signed in as ${r.body.role}`;
  $("#who").title = r.body.caller;
  const sel = $("#pb");
  sel.replaceChildren(...r.body.playbooks.map(pb => h("option", {value: pb}, pb)));
  sel.value = S.pb;
  $("#pb-wrap").hidden = r.body.playbooks.length < 2;
  for (const id of ["#logout", "#app"]) $(id).hidden = false;
  $("#nav").hidden = Boolean(person);
  $("#to-wrap").hidden = Boolean(person);
  if (person) $("#inbox-h").firstChild.textContent = `Inbox of ${person} `;
  route(false);
  startLive();
}

function signedOut() {
  S.session = null;
  stopLive();
  for (const id of ["#nav", "#logout", "#app", "#pb-wrap"]) $(id).hidden = true;
  $("#who").textContent = "";
  $("#signin").hidden = false;
}

function switchPlaybook(pb) {
  S.pb = pb;
  sessionStorage.setItem("interactiond.playbook", pb);
  for (const it of S.items.values()) it.el.remove();
  S.items.clear();
  S.to = "";
  S.countsSig = "";
  S.loaded = false;
  startLive();
  route(false);
}

// Live updates: the event stream when the daemon serves one, else asking again every poll_ms -----

function stopLive() {
  clearInterval(S.timer);
  S.timer = null;
  if (S.es) { S.es.close(); S.es = null; }
}

function startLive() {
  stopLive();
  refresh();
  if (S.session.stream && window.EventSource && !FORCE_POLL) {
    const es = new EventSource(`${base()}/stream`);
    S.es = es;
    const kick = () => refresh();
    es.onopen = () => { $("#live").textContent = "Live: event stream"; refresh(); };
    es.onmessage = kick;
    for (const t of STREAM_EVENTS) es.addEventListener(t, kick);
    es.onerror = () => { if (es.readyState === EventSource.CLOSED && S.es === es) { S.es = null; poll(); } };
    S.timer = setInterval(refresh, 10000);      // a backstop: the stream tells no notification's arrival
  } else {
    poll();
  }
}

function poll() {
  clearInterval(S.timer);
  S.timer = setInterval(refresh, S.session.poll_ms);
  $("#live").textContent = `Live: checks every ${S.session.poll_ms / 1000} s`;
}

async function refresh() {
  if (!S.session) return;
  if (S.busy) { S.again = true; return; }
  S.busy = true;
  try {
    do {
      S.again = false;
      const pb = S.pb, to = S.to;
      const query = to ? `&to=${enc(to)}` : "";
      const [list, counts] = await Promise.all([
        api("GET", `${base(pb)}/interactions?limit=200${query}`),
        api("GET", `/web${base(pb).slice(3)}/counts`)]);
      if (pb !== S.pb || to !== S.to) { S.again = true; continue; }
      if (counts.ok) showCounts(counts.body);
      if (list.ok) await showList(list.body, pb);
    } while (S.again && S.session);
  } finally {
    S.busy = false;
  }
}

// The inbox ----------------------------------------------------------------------------------

function showCounts(c) {
  setNow(c.now);
  $("#count").textContent = `${c.total} pending`;
  const sig = JSON.stringify([c.to, c.total, S.to]);
  if (sig === S.countsSig) return;
  S.countsSig = sig;
  const sel = $("#to");
  const opts = [h("option", {value: ""}, `everyone (${c.total})`)];
  if (S.to && !c.to.some(x => x.to === S.to)) opts.push(h("option", {value: S.to}, `${S.to} (0)`));
  for (const x of c.to) opts.push(h("option", {value: x.to}, `${x.to} (${x.count})`));
  sel.replaceChildren(...opts);
  sel.value = S.to;
}

async function showList(page, pb) {
  const want = page.data.filter(r => !S.gone.has(r.run_id));
  const ids = new Set(want.map(r => r.run_id));
  let left = 0;
  for (const [id, it] of S.items) {
    if (!ids.has(id)) { it.el.remove(); S.items.delete(id); left += 1; }
  }
  const fresh = want.filter(r => !S.items.has(r.run_id));
  if (fresh.length) {
    const r = await api("POST", "/web/render", {items: fresh.map(x => ({markdown: x.message, schema: x.answer_schema,
                                                                      playbook: pb, run_id: x.run_id}))});
    if (!r.ok || pb !== S.pb) return;
    fresh.forEach((x, i) => {
      if (!S.items.has(x.run_id) && !S.gone.has(x.run_id)) S.items.set(x.run_id, {req: x, el: requestEl(x, r.body.items[i])});
    });
  }
  const ol = $("#requests");
  let cur = ol.firstElementChild;
  for (const x of want) {
    const it = S.items.get(x.run_id);
    if (!it) continue;
    it.el.querySelector(".nudged").textContent = nudgedWords(x);
    it.el.querySelector("h2 .to").textContent = forWords(x);
    if (it.el === cur) cur = cur.nextElementSibling;
    else ol.insertBefore(it.el, cur);
  }
  $("#empty").hidden = S.items.size > 0;
  $("#more").hidden = !page.next_cursor;
  if (S.loaded && (fresh.length || left)) {
    const words = [];
    if (fresh.length) words.push(`${fresh.length} new request${fresh.length > 1 ? "s" : ""}`);
    if (left) words.push(`${left} left the inbox`);
    $("#news").textContent = words.join(", ") + ".";
    clearTimeout(S.newsTimer);
    S.newsTimer = setTimeout(() => { $("#news").textContent = ""; }, 8000);
  }
  S.loaded = true;
}

function requestEl(req, shown) {
  const n = ++S.seq, hid = `req-${n}`;
  const msg = h("div", {class: "msg"});
  msg.innerHTML = shown.html || "";             // rendered by the daemon with raw HTML off
  const form = req.approval ? approvalEl(req, n) : req.takes_answer ? formEl(req, shown.form, n)
                                : h("p", {class: "muted"}, "A notification: there is nothing to answer.");
  const delivery = req.delivery ? ` · sent with ${req.delivery.server}/${req.delivery.tool} (${req.delivery_state})` : "";
  const person = S.session.person;
  return h("li", {class: "req", "data-run-id": req.run_id},
    h("article", {"aria-labelledby": hid},
      h("h2", {id: hid}, req.name, " ", h("span", {class: "to"}, forWords(req))),
      h("p", {class: "meta"}, "asked ", relTime(req.asked_at), " · ",
        req.expires_at ? ["expires ", relTime(req.expires_at)] : "never expires", delivery,
        h("span", {class: "nudged"}, nudgedWords(req)),
        req.digest ? [" · digest ", h("code", {class: "digest", "data-digest": req.digest,
          title: `sha256 of what this request shows (message, form, arguments): ${req.digest}`}, req.digest.slice(0, 12))] : null,
        person ? null : [" · ", h("a", {href: `#/runs/${enc(req.run_id)}`}, "History")],
        req.answer_url && !person ? [" · ", h("a", {href: req.answer_url, class: "answer-link", target: "_blank", rel: "noreferrer",
          title: `The link ${req.to} answers on without signing in; copy it to send it`}, "Answer link")] : null),
      msg, form));
}

// Whom a request asks (its party, and whom it was escalated to), and how often it was reminded: both
// change while it stays listed, so showList writes them again on each refresh.
function forWords(req) { return `for ${(req.addressees || [req.to]).join(" and ")}`; }
function nudgedWords(req) {
  return req.reminded ? ` · reminded ${req.reminded} time${req.reminded === 1 ? "" : "s"}` : "";
}

function formEl(req, form, n) {
  const f = h("form", {class: "answer", novalidate: true, "aria-label": `Answer: ${req.name}`});
  const fields = [];
  const formErr = h("p", {class: "err", id: `fe-${n}`, "aria-live": "polite"});
  const notes = form.mode === "choice" ? form.fields.filter(fd => fd.note) : [];
  const others = form.fields.filter(fd => !notes.includes(fd));
  if (form.mode === "choice") {
    // The first submit button is a form's default: a disabled one keeps Enter from picking a choice.
    f.append(h("button", {type: "submit", disabled: true, hidden: true, tabindex: "-1", "aria-hidden": "true"}));
  }
  others.forEach((fd, i) => f.append(fieldEl(fd, `${n}-${i}`, fields)));
  if (form.mode === "choice") {
    const c = form.choice, gid = `c-${n}`;
    const err = h("p", {class: "err", id: `${gid}-err`});
    const group = h("div", {class: "choice", role: "group", "aria-labelledby": gid, "aria-describedby": `${gid}-err`},
      c.values.map((v, i) => h("button", {type: "submit", "data-index": String(i)}, c.labels[i])));
    fields.push({fd: c, err, control: group.firstElementChild, box: group, choice: true});
    f.append(h("div", {class: "choice-row"}, notes.map((fd, i) => fieldEl(fd, `${n}-n${i}`, fields)),
      h("div", {class: "choice-col"}, h("span", {class: "label", id: gid}, c.label), group, err)));
  } else {
    f.append(h("div", {class: "actions"}, h("button", {type: "submit", class: "primary"}, "Send the answer")));
  }
  f.append(formErr);
  f.addEventListener("submit", (ev) => {
    ev.preventDefault();
    submitAnswer(req, form, f, fields, formErr, ev.submitter);
  });
  return f;
}

// An approval of a tool call: its arguments as a table, the ones the approver may change as fields,
// then Approve or Reject with an optional note. Errors come back at /answer/arguments/... pointers.
function approvalEl(req, n) {
  const a = req.approval, fields = [], rows = [];
  const f = h("form", {class: "answer approval", novalidate: true, "aria-label": `Approve: ${req.name}`});
  const formErr = h("p", {class: "err", id: `fe-${n}`, "aria-live": "polite"});
  const esc = (k) => String(k).replace(/~/g, "~0").replace(/\//g, "~1");
  const walk = (value, ptr) => {
    if (value && typeof value === "object" && a.edit.some(e => e.startsWith(ptr + "/"))) {
      for (const [k, v] of Object.entries(value)) walk(v, `${ptr}/${esc(k)}`);
    } else rows.push([ptr, value]);
  };
  walk(a.arguments, "");
  const body = rows.map(([ptr, value], i) => {
    const id = `ap-${n}-${i}`, name = ptr.slice(1).replace(/~1/g, "/").replace(/~0/g, "~") || "(all)";
    if (!a.edit.includes(ptr)) {
      return h("tr", {}, h("th", {scope: "row"}, h("code", {}, name)),
        h("td", {}, typeof value === "string" ? value : JSON.stringify(value)));
    }
    const err = h("p", {class: "err", id: `${id}-err`});
    let control, kind;
    if (typeof value === "boolean") {
      kind = "boolean";
      control = h("select", {id, "aria-describedby": `${id}-err`},
        h("option", {value: "true", selected: value}, "true"), h("option", {value: "false", selected: !value}, "false"));
    } else if (typeof value === "number") {
      kind = "number";
      control = h("input", {id, type: "number", step: "any", value: String(value), "aria-describedby": `${id}-err`});
    } else if (typeof value === "string") {
      kind = "text";
      control = h("input", {id, type: "text", value, "aria-describedby": `${id}-err`});
    } else {
      kind = "json";
      control = h("textarea", {id, rows: 3, class: "json", spellcheck: "false", "aria-describedby": `${id}-err`},
        JSON.stringify(value === undefined ? null : value, null, 2));
    }
    const cell = h("td", {}, control, err);
    fields.push({fd: {pointer: `/arguments${ptr}`, arg: ptr, kind}, err, control, box: cell});
    return h("tr", {}, h("th", {scope: "row"}, h("label", {for: id}, h("code", {}, name), " (may change)")), cell);
  });
  const noteId = `ap-${n}-note`, noteErr = h("p", {class: "err", id: `${noteId}-err`});
  const note = h("textarea", {id: noteId, rows: 2, maxlength: 2000, "aria-describedby": `${noteId}-err`});
  const noteBox = h("div", {class: "field"}, h("label", {for: noteId}, "Note (optional)"), note, noteErr);
  fields.push({fd: {pointer: "/note"}, err: noteErr, control: note, box: noteBox});
  // The first submit button is a form's default: a disabled one keeps Enter in a field from deciding.
  f.append(h("button", {type: "submit", disabled: true, hidden: true, tabindex: "-1", "aria-hidden": "true"}));
  f.append(
    h("p", {class: "meta"}, "Calls ", h("strong", {}, a.tool), " on ", h("strong", {}, a.server), " · ",
      a.read_only ? "read-only" : "may change something"),
    rows.length ? h("div", {class: "wide"}, h("table", {class: "arguments"},
      h("thead", {}, h("tr", {}, h("th", {scope: "col"}, "Argument"), h("th", {scope: "col"}, "Value"))),
      h("tbody", {}, body)))
      : h("p", {class: "muted"}, "The call takes no arguments."),
    noteBox,
    h("div", {class: "choice"}, h("button", {type: "submit", class: "primary", value: "approve"}, "Approve"),
      h("button", {type: "submit", value: "reject"}, "Reject")),
    formErr);
  f.addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (ev.submitter && ev.submitter.value) submitApproval(req, f, fields, formErr, ev.submitter.value === "approve");
  });
  return f;
}

async function submitApproval(req, f, fields, formErr, approved) {
  clearErrors(fields, formErr);
  const answer = {approved}, args = JSON.parse(JSON.stringify(req.approval.arguments));
  let first = null, edited = false;
  for (const x of fields) {
    const {arg, kind} = x.fd;
    if (arg === undefined) continue;
    let v = x.control.value;
    if (kind === "boolean") v = v === "true";
    else if (kind === "number") {
      if (v.trim() === "" || Number.isNaN(Number(v))) { first = first || placeError(fields, formErr, `/answer${x.fd.pointer}`, "Write a number."); continue; }
      v = Number(v);
    } else if (kind === "json") {
      try { v = JSON.parse(v); } catch (e) { first = first || placeError(fields, formErr, `/answer${x.fd.pointer}`, `Not JSON: ${e.message}`); continue; }
    }
    edited = true;
    if (arg === "") { Object.keys(args).forEach(k => delete args[k]); Object.assign(args, v); continue; }
    const parts = arg.split("/").slice(1).map(p => p.replace(/~1/g, "/").replace(/~0/g, "~"));
    let cur = args;
    for (const p of parts.slice(0, -1)) cur = cur[p];
    cur[parts[parts.length - 1]] = v;
  }
  if (first) { first.control.focus(); return; }
  if (approved && edited) answer.arguments = args;
  const note = fields.find(x => x.fd.pointer === "/note").control.value.trim();
  if (note) answer.note = note;
  const buttons = [...f.querySelectorAll("button:not([hidden])")];
  buttons.forEach(b => { b.disabled = true; });
  f.setAttribute("aria-busy", "true");
  // The digest of what this card shows goes back with the answer: if the request changed meanwhile,
  // the daemon refuses it (409 digest_mismatch) rather than take it for what it shows now.
  const r = await api("POST", `${base()}/runs/${enc(req.run_id)}/answer`, {answer, digest: req.digest});
  f.removeAttribute("aria-busy");
  buttons.forEach(b => { b.disabled = false; });
  if (r.ok) return answered(req);
  const errors = r.body && Array.isArray(r.body.errors) ? r.body.errors : [];
  for (const e of errors) first = placeError(fields, formErr, e.pointer, e.message) || first;
  if (!errors.length) formErr.textContent = problemText(r.body);
  if (first) first.control.focus();
  if ([404, 409, 410].includes(r.status)) refresh();
}

function fieldEl(fd, key, fields) {
  const id = `f-${key}`, errId = `${id}-err`, hintId = `${id}-hint`;
  const err = h("p", {class: "err", id: errId});
  const words = [fd.hint, fd.bounds].filter(Boolean).join(" · ");
  const hint = words ? h("p", {class: "hint", id: hintId}, words) : null;
  const describedBy = [hint ? hintId : null, errId].filter(Boolean).join(" ");
  const label = fd.required ? fd.label : `${fd.label} (optional)`;
  if (fd.kind === "choice" || fd.kind === "checkboxes") {
    const multi = fd.kind === "checkboxes";
    const box = h("fieldset", {"aria-describedby": describedBy}, h("legend", {}, label),
      fd.values.map((v, i) => h("label", {class: "opt"},
        h("input", {type: multi ? "checkbox" : "radio", name: id, value: String(i)}), fd.labels[i])));
    fields.push({fd, err, control: box.querySelector("input"), box});
    return h("div", {class: "field"}, box, hint, err);
  }
  let control;
  if (fd.kind === "number") {
    control = h("input", {id, name: fd.name, type: "number", inputmode: fd.integer ? "numeric" : "decimal",
                          step: fd.integer ? "1" : "any", min: fd.min, max: fd.max, "aria-describedby": describedBy});
  } else if (fd.kind === "text") {
    control = h("textarea", {id, name: fd.name, rows: fd.note ? 2 : 3, maxlength: fd.maxLength, minlength: fd.minLength,
                             "aria-describedby": describedBy});
  } else {
    control = h("textarea", {id, name: fd.name, rows: 6, class: "json", spellcheck: "false",
                             "aria-describedby": describedBy}, fd.example || "");
  }
  const box = h("div", {class: "field"}, h("label", {for: id}, label), control, hint, err);
  fields.push({fd, err, control, box});
  return box;
}

function collect(form, fields, submitter) {
  const answer = {}, bad = [];
  let root, hasRoot = false;
  const put = (fd, v) => { if (fd.pointer === "") { root = v; hasRoot = true; } else answer[fd.name] = v; };
  for (const {fd, control, box, choice} of fields) {
    if (choice) continue;
    if (fd.kind === "text") {
      if (control.value !== "" || fd.pointer === "") put(fd, control.value);
    } else if (fd.kind === "number") {
      if (control.validity.badInput) bad.push([fd.pointer, "Not a number."]);
      else if (control.value !== "") put(fd, Number(control.value));
    } else if (fd.kind === "choice") {
      const c = box.querySelector("input:checked");
      if (c) put(fd, fd.array ? [fd.values[Number(c.value)]] : fd.values[Number(c.value)]);
    } else if (fd.kind === "checkboxes") {
      const vs = [...box.querySelectorAll("input:checked")].map(c => fd.values[Number(c.value)]);
      if (vs.length || fd.required) put(fd, vs);
    } else {
      const t = control.value.trim();
      if (t) {
        try { put(fd, JSON.parse(t)); } catch (e) { bad.push([fd.pointer, `Not JSON: ${e.message}`]); }
      } else if (fd.pointer === "") {
        bad.push([fd.pointer, "Write the answer as JSON."]);
      }
    }
  }
  if (form.mode === "choice") put(form.choice, form.choice.values[Number(submitter.dataset.index)]);
  return {answer: hasRoot ? root : answer, bad};
}

function clearErrors(fields, formErr) {
  formErr.textContent = "";
  for (const x of fields) {
    x.err.textContent = "";
    x.box.querySelectorAll("[aria-invalid]").forEach(el => el.removeAttribute("aria-invalid"));
    x.box.removeAttribute("aria-invalid");
  }
}

// An error lands at the field whose pointer is the longest prefix of the error's pointer.
function placeError(fields, formErr, pointer, message) {
  const rel = typeof pointer === "string" && (pointer === "/answer" || pointer.startsWith("/answer/")) ? pointer.slice(7) : null;
  let best = null;
  if (rel !== null) {
    for (const x of fields) {
      const p = x.fd.pointer;
      if ((rel === p || rel.startsWith(p + "/")) && (!best || p.length > best.fd.pointer.length)) best = x;
    }
  }
  if (!best) {
    formErr.textContent = [formErr.textContent, message].filter(Boolean).join(" ");
    return null;
  }
  best.err.textContent = [best.err.textContent, message].filter(Boolean).join(" ");
  const target = best.choice || best.box.tagName === "FIELDSET" ? best.box : best.control;
  target.setAttribute("aria-invalid", "true");
  return best;
}

async function submitAnswer(req, form, f, fields, formErr, submitter) {
  if (form.mode === "choice" && !(submitter && submitter.dataset.index !== undefined)) return;
  clearErrors(fields, formErr);
  const {answer, bad} = collect(form, fields, submitter);
  let first = null;
  if (bad.length) {
    for (const [p, m] of bad) first = first || placeError(fields, formErr, `/answer${p}`, m);
    (first ? first.control : f).focus();
    return;
  }
  const buttons = [...f.querySelectorAll("button:not([hidden])")];
  buttons.forEach(b => { b.disabled = true; });
  f.setAttribute("aria-busy", "true");
  // The page's own answer route: answer_interaction's rules, its errors in a person's words.
  const r = await api("POST", `/web${base().slice(3)}/runs/${enc(req.run_id)}/answer`, {answer, digest: req.digest});
  f.removeAttribute("aria-busy");
  buttons.forEach(b => { b.disabled = false; });
  if (r.ok) return answered(req);
  const errors = r.body && Array.isArray(r.body.errors) ? r.body.errors : [];
  for (const e of errors) first = placeError(fields, formErr, e.pointer, e.message) || first;
  if (!errors.length) formErr.textContent = problemText(r.body);
  const invalid = f.querySelector("[aria-invalid=true]");
  if (invalid) (invalid.matches("input, textarea") ? invalid : invalid.querySelector("input, button") || invalid).focus();
  if ([404, 409, 410].includes(r.status)) refresh();
}

function answered(req) {
  S.gone.add(req.run_id);
  const it = S.items.get(req.run_id);
  if (it) { it.el.remove(); S.items.delete(req.run_id); }
  $("#empty").hidden = S.items.size > 0;
  say(`Answered ${req.name} for ${req.to}. `,
      S.session.person ? null : h("a", {href: `#/runs/${enc(req.run_id)}`}, "Open its history")).focus();
  refresh();
}

// Pages: a run's history, the runs, the definitions -------------------------------------------

function route(focus) {
  const hash = location.hash.replace(/^#/, "") || "/";
  if (!hash.startsWith("/") || !S.session) return;
  const inbox = hash === "/";
  if (!inbox) $("#status").replaceChildren();
  $("#inbox").hidden = !inbox;
  $("#page").hidden = inbox;
  const section = hash.split("/")[1] || "";
  document.querySelectorAll("#nav a").forEach(a => {
    if (a.getAttribute("href") === `#/${section}`) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  });
  let m, done;
  if (inbox) { document.title = "Inbox · interactiond"; done = Promise.resolve($("#inbox-h")); }
  else if ((m = hash.match(/^\/runs\/(.+)$/))) done = showRun(decodeURIComponent(m[1]));
  else if (hash === "/runs") done = showRuns();
  else if (hash === "/definitions") done = showDefinitions();
  else done = Promise.resolve(page("Not found", h("p", {}, h("a", {href: "#/"}, "Back to the inbox"))));
  if (focus) done.then(el => el && el.focus());
}

function page(title, ...parts) {
  document.title = `${title} · interactiond`;
  const h1 = h("h1", {tabindex: "-1"}, title);
  $("#page").replaceChildren(h1, ...parts.flat().filter(x => x !== null && x !== undefined && x !== false));
  return h1;
}

function pre(value) { return h("pre", {}, JSON.stringify(value, null, 2)); }

async function showRun(id) {
  page(`Run ${id}`, h("p", {class: "muted"}, "Loading…"));
  const [run, events] = await Promise.all([api("GET", `${base()}/runs/${enc(id)}`), runEvents(id)]);
  if (!run.ok) return page(`Run ${id}`, h("p", {class: "err"}, problemText(run.body)));
  const r = run.body, who = await answeredBy(events), rows = [["Function", `${r.name} (${r.type}, version ${r.version})`],
    ["Status", r.kind ? `${r.status} (${r.kind})` : r.status], ["Started", absTime(r.created_at)],
    ["Ended", r.ended_at ? absTime(r.ended_at) : "not yet"],
    who ? ["Answered by", h("span", {class: "answered-by"}, who.name, " on ", absTime(who.at))]
        : ["Settled by", r.settled_by || "—"]];
  const list = h("ol", {class: "timeline", "aria-label": "History"}, events.map(eventEl));
  return page(`Run ${id}`,
    h("dl", {class: "run card"}, rows.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
    r.output !== null && r.output !== undefined ? [h("h2", {}, "Output"), pre(r.output)] : null,
    r.problem ? [h("h2", {}, "Problem"), pre(r.problem)] : null,
    h("h2", {}, "History"), h("p", {class: "muted"}, "Each event with its time; open one to see all of it."), list);
}

// Who answered a run's request, in words, and when: request_answered's answered_by_name (read
// whole when the listing cut its payload), else the event's `by`.
async function answeredBy(events) {
  const e = events.find(x => x.type === "request_answered");
  if (!e) return null;
  let payload = e.payload;
  if (e.truncated) {
    const r = await api("GET", `${base()}/events/${enc(e.id)}`);
    payload = r.ok ? r.body.payload : null;
  }
  const by = e.by && e.by.startsWith("tok_") ? "an API token" : e.by;
  return {name: (payload && payload.answered_by_name) || by || "—", at: e.at};
}

async function runEvents(id) {
  const out = [];
  let cursor = null;
  for (let i = 0; i < 25; i++) {
    const r = await api("GET", `${base()}/runs/${enc(id)}/events?limit=200${cursor ? `&cursor=${enc(cursor)}` : ""}`);
    if (!r.ok) break;
    out.push(...r.body.data);
    cursor = r.body.next_cursor;
    if (!cursor) break;
  }
  return out;
}

function eventEl(e) {
  const pid = `ev-${++S.seq}`;
  const text = e.truncated ? `${e.preview}… (${e.size} bytes)` : JSON.stringify(e.payload);
  const whole = h("pre", {id: pid, hidden: true});
  const btn = h("button", {type: "button", class: "event", "aria-expanded": "false", "aria-controls": pid},
    absTime(e.at), h("strong", {}, e.type), e.by || (e.payload && e.payload.answered_by_name)
      ? h("span", {class: "muted"}, `by ${(e.payload && e.payload.answered_by_name) || e.by}`) : null,
    h("span", {class: "preview"}, text.length > 240 ? `${text.slice(0, 240)}…` : text));
  btn.addEventListener("click", async () => {
    if (btn.getAttribute("aria-expanded") === "true") {
      btn.setAttribute("aria-expanded", "false");
      whole.hidden = true;
      return;
    }
    if (!whole.dataset.loaded) {
      const r = await api("GET", `${base()}/events/${enc(e.id)}`);
      whole.textContent = r.ok ? JSON.stringify(r.body, null, 2) : problemText(r.body);
      if (r.ok) whole.dataset.loaded = "1";
    }
    btn.setAttribute("aria-expanded", "true");
    whole.hidden = false;
  });
  return h("li", {"data-event-id": e.id}, btn, whole);
}

// The runs, newest first, filtered by status and function; "Show older" reads the next page.
const RUN_STATUSES = ["started", "waiting", "succeeded", "invalid_input", "conflict", "unavailable", "rejected", "failed"];
S.runs = {status: "", fn: ""};

async function showRuns() {
  const h1 = page("Runs", h("p", {class: "muted"}, "Loading…"));
  const [r, defs] = await Promise.all([runsPage(null), api("GET", `${base()}/definitions`)]);
  if (!r.ok) return page("Runs", h("p", {class: "err"}, problemText(r.body)));
  const status = h("select", {id: "run-status"}, h("option", {value: ""}, "any status"),
    RUN_STATUSES.map(st => h("option", {value: st}, st)));
  const names = defs.ok ? [...new Set(defs.body.data.map(d => d.name))].sort() : [];
  if (S.runs.fn && !names.includes(S.runs.fn)) names.push(S.runs.fn);
  const fn = h("select", {id: "run-function"}, h("option", {value: ""}, "any function"),
    names.map(n => h("option", {value: n}, n)));
  status.value = S.runs.status;
  fn.value = S.runs.fn;
  const body = h("tbody", {});
  const table = h("div", {class: "wide"}, h("table", {},
    h("caption", {class: "muted"}, "Runs, newest first"),
    h("thead", {}, h("tr", {}, ["Run", "Function", "Status", "Started"].map(t => h("th", {scope: "col"}, t)))), body));
  const none = h("p", {class: "muted", id: "runs-none"}, "No runs here.");
  const more = h("button", {type: "button", id: "runs-more"}, "Show older runs");
  let cursor = null;
  const add = (res) => {
    body.append(...res.body.data.map(x => h("tr", {"data-run-id": x.run_id},
      h("td", {}, h("a", {href: `#/runs/${enc(x.run_id)}`}, x.run_id)), h("td", {}, x.name),
      h("td", {}, x.kind ? `${x.status} (${x.kind})` : x.status), h("td", {}, absTime(x.created_at)))));
    cursor = res.body.next_cursor;
    more.hidden = !cursor;
    none.hidden = body.childElementCount > 0;
    table.hidden = !none.hidden;
  };
  more.addEventListener("click", async () => {
    more.disabled = true;
    const next = await runsPage(cursor);
    more.disabled = false;
    if (next.ok) add(next); else say(problemText(next.body));
  });
  const refilter = () => { S.runs = {status: status.value, fn: fn.value}; route(false); };
  status.addEventListener("change", refilter);
  fn.addEventListener("change", refilter);
  page("Runs", h("div", {class: "bar"}, h("label", {for: "run-status"}, "Status"), status,
    h("label", {for: "run-function"}, "Function"), fn), table, none, more);
  add(r);
  return $("#page h1") || h1;
}

function runsPage(cursor) {
  const q = [`limit=200`, S.runs.status ? `status=${enc(S.runs.status)}` : "",
             S.runs.fn ? `function=${enc(S.runs.fn)}` : "", cursor ? `cursor=${enc(cursor)}` : ""].filter(Boolean);
  return api("GET", `${base()}/runs?${q.join("&")}`);
}

async function showDefinitions() {
  page("Definitions", h("p", {class: "muted"}, "Loading…"));
  const r = await api("GET", `${base()}/definitions`);
  if (!r.ok) return page("Definitions", h("p", {class: "err"}, problemText(r.body)));
  const items = r.body.data.map(d => {
    const body = h("div", {}, h("p", {class: "muted"}, "Loading…"));
    const det = h("details", {class: "card", "data-name": d.name},
      h("summary", {}, `${d.name} `, h("span", {class: "to"}, `${d.type}, version ${d.version}`)),
      d.description ? h("p", {}, d.description) : null, body);
    det.addEventListener("toggle", async () => {
      if (!det.open || det.dataset.loaded) return;
      det.dataset.loaded = "1";
      const g = await api("GET", `${base()}/definitions/${enc(d.type)}/${enc(d.name)}`);
      if (!g.ok) { body.replaceChildren(h("p", {class: "err"}, problemText(g.body))); return; }
      const shown = await api("POST", "/web/render", {items: [{markdown: g.body.overview || ""}]});
      const overview = h("div", {class: "msg"});
      if (shown.ok) overview.innerHTML = shown.body.items[0].html; else overview.textContent = g.body.overview || "";
      body.replaceChildren(h("h2", {}, "Overview"), overview, h("h2", {}, "Source"), h("pre", {}, g.body.source));
    });
    return det;
  });
  return page("Definitions", items.length ? items : h("p", {class: "muted"}, "No definitions."));
}

// Wiring -------------------------------------------------------------------------------------

$("#to").addEventListener("change", (ev) => {
  S.to = ev.target.value;
  refresh();
});
$("#pb").addEventListener("change", (ev) => switchPlaybook(ev.target.value));
$("#logout").addEventListener("click", async () => {
  await api("POST", "/logout");
  signedOut();
});
window.addEventListener("hashchange", () => route(true));
boot();
"""

_INBOX_PAGE: Final = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<title>Inbox · interactiond</title>
<link rel="icon" href="data:,">
<style>{css}</style>
</head>
<body>
<header class="top">
  <span class="brand">interactiond</span>
  <nav id="nav" aria-label="Pages" hidden><a href="#/">Inbox</a><a href="#/runs">Runs</a><a href="#/definitions">Definitions</a></nav>
  <div class="ctl">
    <span id="pb-wrap" hidden><label for="pb">Playbook</label> <select id="pb"></select></span>
    <span id="who" class="muted"></span>
    <button id="logout" type="button" hidden>Log out</button>
  </div>
</header>
<main id="main">
  <p id="loading" class="muted">Loading…</p>
  <section id="signin" hidden>
    <h1>Sign in</h1>
    <p>Open a sign-in link: the one <code>interactiond serve</code> printed when it started, or one
      made for you with <code>interactiond link --for NAME</code>. It ends in <code>/login?token=…</code>
      and works once; ask for a new one when it is spent.</p>
  </section>
  <div id="app" hidden>
    <div id="status" role="status" aria-live="polite"></div>
    <section id="inbox" aria-labelledby="inbox-h">
      <h1 id="inbox-h" tabindex="-1">Inbox <span id="count" class="to"></span></h1>
      <div class="bar">
        <span id="to-wrap"><label for="to">Addressed to</label>
        <select id="to"><option value="">everyone</option></select></span>
        <span id="live" class="muted"></span>
        <span id="news" class="muted" aria-live="polite"></span>
      </div>
      <p id="empty" class="muted" hidden>Nothing is waiting for an answer.</p>
      <ol id="requests" class="requests" aria-label="Pending requests, newest first"></ol>
      <p id="more" class="muted" hidden>Only the newest 200 are shown; answer some to see the rest.</p>
    </section>
    <section id="page" hidden></section>
  </div>
</main>
<script>{js}</script>
</body>
</html>
"""


def _csp_source(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


INBOX_HTML: Final = _INBOX_PAGE.replace("{css}", _INBOX_CSS).replace("{js}", _INBOX_JS)
#: The page runs only its own inline script and style (by hash) and talks only to this daemon.
INBOX_HEADERS: Final = {
    "Content-Security-Policy": f"default-src 'none'; script-src {_csp_source(_INBOX_JS)}; style-src "
                               f"{_csp_source(_INBOX_CSS)}; connect-src 'self'; img-src 'self' data:; base-uri 'none';"
                               " form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
}
#: An answer link's page (Web inbox, answer links): made on the daemon, the inbox's style, no script;
#: its form posts only to itself.
LINK_PAGE: Final = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<meta name="robots" content="noindex, nofollow">
<title>{title} · interactiond</title>
<link rel="icon" href="data:,">
<style>""" + _INBOX_CSS + """</style>
</head>
<body>
<header class="top"><span class="brand">interactiond</span></header>
<main id="main">{body}</main>
</body>
</html>
"""
LINK_HEADERS: Final = {
    "Content-Security-Policy": f"default-src 'none'; style-src {_csp_source(_INBOX_CSS)}; img-src 'self' data:;"
                               " base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
    "X-Robots-Tag": "noindex, nofollow",
}
LOGIN_SPENT_HTML: Final = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>Sign-in link spent · interactiond</title></head>
<body><h1>This sign-in link does not work</h1>
<p>It was used already, it has expired, or it is not one this daemon made. Each sign-in link works
once: ask for a new one (<code>interactiond link --for NAME</code> makes one), or use the one the
latest start of <code>interactiond serve</code> printed.</p></body></html>
"""



# Web inbox ######################################################################################
#
# The page a person answers on, served from the module at `GET /`: one HTML document with its CSS
# and JavaScript inline (no build step, no external assets; the Content-Security-Policy admits
# exactly those two, by their hashes). It signs in by trading the one-time login token that `serve`
# prints (`GET /login?token=...`, revoked on use) for a session token of the same role, kept in an
# HttpOnly SameSite=Strict cookie, and then calls the v1 API with that cookie like any client: the
# same role rules hold, and the middleware checks the Origin of every state-changing call. Three
# small helpers serve what the page cannot do well itself:
#
#   GET  /web/session                                 who is signed in, the playbooks they see,
#                                                     whether the daemon serves an event stream
#   POST /web/render  {items: [{markdown, schema}]}   Markdown as safe HTML (raw HTML off), and an
#                                                     answer schema as a form (`answer_form`)
#   GET  /web/orgs/{org}/playbooks/{playbook}/counts  open requests by addressee
#
# Live updates: the playbook's event stream (`.../stream`, EventSource) when the daemon serves one,
# else (or with `/?live=poll`, for a proxy that breaks SSE) `/interactions` every WEB_POLL_MS.

WEB_POLL_MS: Final = 2000           # without an event stream, how often the page asks /interactions
WEB_RENDER_ITEMS: Final = 200       # items per POST /web/render: one full page of /interactions
#: A string property with one of these words in its name sits beside the choice buttons, as a note.
NOTE_WORDS: Final = frozenset({"note", "notes", "comment", "comments", "reason", "remark", "remarks", "feedback",
                               "explanation", "why", "message", "detail", "details"})


def _form_label(name: str, schema: dict[str, Any]) -> str:
    title = schema.get("title")
    if isinstance(title, str) and title.strip():
        return title.strip()
    text = re.sub(r"[_-]+", " ", name).strip()
    return text[:1].upper() + text[1:] if text else "Answer"


def _form_types(schema: dict[str, Any]) -> set[str]:
    t = schema.get("type")
    types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    return types - {"null"} if len(types) > 1 else types


def _form_choices(schema: dict[str, Any], named: Mapping[Any, str] | None = None) -> tuple[list[Any], list[str]] | None:
    """The values a choice offers, with their labels: an enum, a oneOf/anyOf of consts (their titles), a
    boolean. `named` gives labels of values from elsewhere (an ask-choice's options)."""
    def scalar(v: Any) -> bool:
        return not isinstance(v, (dict, list))

    def label(v: Any) -> str:
        if named and isinstance(v, str) and v in named:
            return named[v]
        return {True: "Yes", False: "No", None: "None"}.get(v, str(v)) if isinstance(v, (bool, type(None))) else str(v)
    enum_ = schema.get("enum")
    if isinstance(enum_, list) and enum_ and all(map(scalar, enum_)):
        return list(enum_), [label(v) for v in enum_]
    alts = schema.get("oneOf") or schema.get("anyOf")
    if isinstance(alts, list) and alts and all(isinstance(a, dict) and "const" in a and scalar(a["const"]) for a in alts):
        return [a["const"] for a in alts], [str(a.get("title") or label(a["const"])) for a in alts]
    if _form_types(schema) == {"boolean"}:
        return [True, False], ["Yes", "No"]
    return None


def _number_bounds(schema: dict[str, Any], integer: bool) -> dict[str, Any]:
    """The input's min/max (inclusive) and the bounds in words, e.g. "a whole number from 1 to 12"."""
    def num(key: str) -> Any:
        v = schema.get(key)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    out: dict[str, Any] = {}
    said: list[str] = []
    for attr, inclusive, exclusive, sign in (("min", "minimum", "exclusiveMinimum", 1), ("max", "maximum", "exclusiveMaximum", -1)):
        inc, exc = num(inclusive), num(exclusive)
        if exc is not None and (inc is None or (exc - inc) * sign >= 0):
            if integer:
                out[attr] = math.floor(exc) + 1 if sign > 0 else math.ceil(exc) - 1
            else:
                out[attr] = exc
                said.append(f"{'more' if sign > 0 else 'less'} than {exc}")
                continue
        elif inc is not None:
            out[attr] = inc
        else:
            continue
        said.append(f"{'at least' if sign > 0 else 'at most'} {out[attr]}")
    if said == [f"at least {out.get('min')}", f"at most {out.get('max')}"]:
        said = [f"from {out['min']} to {out['max']}"]
    out["bounds"] = " ".join(["a whole number" if integer else "a number", " and ".join(said)]).strip()
    return out


def form_field(name: str, pointer: str, schema: Any, required: bool,
               named: Mapping[Any, str] | None = None) -> dict[str, Any]:
    """How the page asks for one value; `kind` is choice, text, number, checkboxes or json.

    A choice is one of radios (or the choice buttons, see answer_form); a list of choices of which
    at most one may be picked is a choice too, marked `array` (its answer is a list of that one).
    `named` labels the values of a choice (an ask-choice's options)."""
    schema = schema if isinstance(schema, dict) else {}
    out: dict[str, Any] = {"name": name, "pointer": pointer, "label": _form_label(name, schema), "required": required}
    if isinstance(schema.get("description"), str):
        out["hint"] = schema["description"]
    types = _form_types(schema)
    items = schema.get("items")
    if named and "title" not in schema:
        out["label"] = "Your choice"
        out.pop("hint", None)
    if (choices := _form_choices(schema, named)) is not None:
        out.update(kind="choice", values=choices[0], labels=choices[1])
    elif types == {"string"}:
        out.update(kind="text", **{k: schema[k] for k in ("maxLength", "minLength") if isinstance(schema.get(k), int)})
        if "maxLength" in out:
            out["bounds"] = f"at most {out['maxLength']} characters"
        if NOTE_WORDS & {w.lower() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])", name)}:
            out["note"] = True
    elif types and types <= {"integer", "number"}:
        integer = types == {"integer"}
        out.update(kind="number", integer=integer, **_number_bounds(schema, integer))
    elif types == {"array"} and isinstance(items, dict) and _form_types(items) != {"boolean"} \
            and (choices := _form_choices(items, named)) is not None:
        if schema.get("maxItems") == 1:
            out.update(kind="choice", array=True, values=choices[0], labels=choices[1])
        else:
            out.update(kind="checkboxes", values=choices[0], labels=choices[1],
                       **{k: schema[k] for k in ("minItems", "maxItems") if isinstance(schema.get(k), int)})
    else:
        out.update(kind="json", example="{}" if types == {"object"} else "[]" if types == {"array"} else "",
                   bounds="JSON, checked by the daemon when you send it")
    return out


def answer_form(schema: Any, named: Mapping[Any, str] | None = None) -> dict[str, Any]:
    """The form the page generates for an answer schema.

    `mode` is `choice` (one button per value of the one choice, which sends the answer; a note-like
    text field beside the buttons), `fields` (a form with a send button), `json` (one JSON editor)
    or `none` (a notification). Each field's `pointer` is relative to the answer, as the server's
    error pointers are after `/answer`, so an error lands next to the field it names. A list of
    choices (one pick: radios, several: checkboxes) is never the buttons. `named` labels the
    option ids of an ask-choice (`option_labels`).
    """
    if schema is None:
        return {"mode": "none", "fields": []}
    if not isinstance(schema, dict):
        return {"mode": "json", "fields": [form_field("answer", "", {}, True)]}
    props = schema.get("properties")
    if isinstance(props, dict) and props and _form_types(schema) in ({"object"}, set()):
        required = set(schema.get("required") or ())
        fields = [form_field(n, pointer_join([n]), s, n in required, named if n == "option_ids" else None)
                  for n, s in props.items()]
        choices = [f for f in fields if f["kind"] == "choice" and not f.get("array")]
        if len(choices) == 1:
            return {"mode": "choice", "choice": choices[0], "fields": [f for f in fields if f is not choices[0]]}
        return {"mode": "fields", "fields": fields}
    root = form_field("answer", "", schema, True)
    if root["kind"] == "choice" and not root.get("array"):
        return {"mode": "choice", "choice": root, "fields": []}
    return {"mode": "json" if root["kind"] == "json" else "fields", "fields": [root]}


@functools.cache
def _markdown() -> Any:
    from markdown_it import MarkdownIt      # on first use: only the inbox page renders Markdown
    return MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])


def render_markdown(text: str) -> str:
    """Markdown as HTML that is safe to show: raw HTML is escaped, unsafe link schemes dropped."""
    return _markdown().render(text)


def option_labels(name: str, run_input: Any) -> dict[str, str] | None:
    """An ask-choice's option labels by id, from its run's input (JSON text or value); None for any
    other function (a document's labels are in its schema: `oneOf` consts with `title`s)."""
    if ASK_FUNCTIONS.get(name) != "choice":
        return None
    input_ = json.loads(run_input) if isinstance(run_input, str) else run_input
    options = input_.get("options") if isinstance(input_, dict) else None
    if not isinstance(options, list):
        return None
    return {o["id"]: o["label"] for o in options if isinstance(o, dict) and isinstance(o.get("id"), str)
            and isinstance(o.get("label"), str)} or None


# -- an answer's errors in words ----------------------------------------------------------------
#
# The engine reports an answer that does not fit its schema with JSON Schema's own messages ("40 is
# greater than the maximum of 12"), which suit a program. The page and the answer link's page say
# the same in a person's words, as the typed API does ("text is required"), each at its pointer so
# it lands beside its field, named by the field's label.

_TYPE_WORDS: Final = {"string": "text", "integer": "a whole number", "number": "a number", "boolean": "yes or no",
                      "array": "a list", "object": "a set of fields", "null": "empty"}
_FORMAT_EXAMPLES: Final = {"date": "a date such as 2026-05-01", "date-time": "a time such as 2026-05-01T09:30:00Z",
                           "time": "a time of day such as 09:30:00Z", "email": "an email address",
                           "uri": "a web address such as https://example.org", "duration": "a duration such as P1D"}


def _error_label(labels: Mapping[str, str], path: list[Any], schema: Any) -> str:
    """How an error names the value it is about: its field's label, else its member's name, else the answer."""
    for cut in range(len(path), -1, -1):
        pointer = pointer_join(path[:cut])
        if pointer in labels:
            return labels[pointer]
        if cut and isinstance(path[cut - 1], str):
            return _form_label(path[cut - 1], schema if cut == len(path) and isinstance(schema, dict) else {})
    return "The answer"


def _error_words(err: Any, label: str) -> str:
    v, val = err.validator, err.validator_value
    if v in ("enum", "const") or (v in ("oneOf", "anyOf") and isinstance(val, list)
                                  and all(isinstance(a, dict) and "const" in a for a in val)):
        return f"{label}: pick one of the options"
    if v == "type":
        types = [val] if isinstance(val, str) else list(val)
        return f"{label} must be " + " or ".join(_TYPE_WORDS.get(t, t) for t in types)
    words = {
        "minLength": f"{label} is required" if val == 1 else f"{label} needs at least {val} characters",
        "maxLength": f"{label} takes at most {val} characters",
        "minimum": f"{label} must be at least {val}", "maximum": f"{label} must be at most {val}",
        "exclusiveMinimum": f"{label} must be more than {val}", "exclusiveMaximum": f"{label} must be less than {val}",
        "multipleOf": f"{label} must be a multiple of {val}",
        "minItems": f"{label}: pick at least {'one' if val == 1 else val}",
        "maxItems": f"{label}: pick only one" if val == 1 else f"{label}: pick at most {val}",
        "uniqueItems": f"{label}: pick each one once",
        "pattern": f"{label} is not in the form it must have",
        "format": f"{label} must be {_FORMAT_EXAMPLES.get(str(val), 'a ' + str(val))}",
    }
    return words.get(str(v), f"{label}: {err.message}")


def answer_error_words(schema: Any, answer: Any, labels: Mapping[str, str] | None = None) -> list[dict[str, str]]:
    """Every way `answer` fails `schema`, in words, as `{"pointer": "/answer/...", "message"}` (the
    pointers schema_errors gives). `labels` names fields by their pointer within the answer."""
    import referencing.exceptions
    labels = labels or {}
    try:
        errors = list(compile_schema(schema).iter_errors(answer))
    except (_jsonschema().SchemaError, referencing.exceptions.Unresolvable):
        return []
    out: list[dict[str, str]] = []
    seen: dict[tuple[Any, ...], int] = {}
    for err in errors:
        path = list(err.absolute_path)
        if err.validator == "required" and isinstance(err.instance, dict):
            missing = [p for p in err.validator_value if p not in err.instance]
            key = (tuple(path), tuple(err.absolute_schema_path))
            nth = seen.get(key, 0)
            seen[key] = nth + 1
            for name in missing[nth:nth + 1]:
                member = (err.schema.get("properties") or {}).get(name) if isinstance(err.schema, dict) else None
                label = labels.get(pointer_join(path + [name])) or _form_label(name, member if isinstance(member, dict) else {})
                out.append({"pointer": "/answer" + pointer_join(path + [name]), "message": f"{label} is required"})
            continue
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            known = err.schema.get("properties", {}) if isinstance(err.schema, dict) else {}
            for extra in (k for k in err.instance if k not in known):
                out.append({"pointer": "/answer" + pointer_join(path + [extra]),
                            "message": f"{extra} is not a field of this answer"})
            continue
        out.append({"pointer": "/answer" + pointer_join(path),
                    "message": _error_words(err, _error_label(labels, path, err.schema))})
    return sorted(out, key=lambda e: e["pointer"])


def form_labels(form: Mapping[str, Any]) -> dict[str, str]:
    """The labels of a form's fields (answer_form), by their pointer within the answer."""
    fields = list(form.get("fields") or []) + ([form["choice"]] if form.get("choice") else [])
    return {f["pointer"]: f["label"] for f in fields}


def reworded(exc: Problem, schema_text: str | None, answer: Any, named: Mapping[Any, str] | None) -> Problem:
    """An answer's refusal with its errors in words (an invalid_input with errors; else as it is)."""
    if exc.name != "invalid_input" or not exc.errors or schema_text is None:
        return exc
    schema = json.loads(schema_text)
    words = answer_error_words(schema, answer, form_labels(answer_form(schema, named)))
    if words:
        exc.errors = words
    return exc


async def trade_login_token(store: Store, secret: str, now: int | None = None) -> str | None:
    """Revoke a one-time login token and make a session token of its role; None when it is spent.
    `now` is the daemon's clock: the session expires on it."""
    now = now if now is not None else WALL.now_ms()

    def change(tx: Tx, fx: Effects) -> str | None:
        row = tx.spend_login(sha256_hex(secret), now)
        if row is None:
            return None
        return create_token(tx, row["role"], row["playbook"], "inbox session", purpose="session", now=now,
                            person=row["person"])[1]
    return await store.write(change)


def _see_other(location: str) -> web.Response:
    from aiohttp import web
    return web.Response(status=303, headers={"Location": location, "Cache-Control": "no-store",
                                             "Referrer-Policy": "no-referrer"})


async def h_inbox_page(request: web.Request) -> web.Response:
    from aiohttp import web
    return web.Response(text=INBOX_HTML, content_type="text/html", headers=INBOX_HEADERS)


async def h_login(request: web.Request) -> web.Response:
    from aiohttp import web
    secret = request.query.get("token", "")
    engine = request.app[engine_key()]
    session = await trade_login_token(engine.store, secret, engine.clock.now_ms()) if secret else None
    if session is None:
        current = request.cookies.get(SESSION_COOKIE)
        if current and await lookup_token(request.app, current) is not None:
            return _see_other("/")          # a spent link opened again by someone signed in
        return web.Response(status=401, text=LOGIN_SPENT_HTML, content_type="text/html", headers=INBOX_HEADERS)
    resp = _see_other("/")
    public = engine.config.public_url or ""
    resp.set_cookie(SESSION_COOKIE, session, httponly=True, samesite="Strict", path="/",
                    secure=request.secure or public.startswith("https://"))      # behind a TLS proxy too
    return resp


async def h_logout(request: web.Request) -> web.Response:
    from aiohttp import web
    secret = request.cookies.get(SESSION_COOKIE)
    if secret:
        digest, now = sha256_hex(secret), request.app[engine_key()].clock.now_ms()
        await request.app[engine_key()].store.write(lambda tx, fx: tx.end_session(digest, now))
        request.app[tokens_key()].pop(digest, None)
    resp = web.Response(status=204, headers={"Cache-Control": "no-store"})
    resp.del_cookie(SESSION_COOKIE, path="/")
    return resp


async def h_web_session(request: web.Request) -> web.Response:
    caller, engine = _caller(request), request.app[engine_key()]
    seen = sorted(pb for pb in engine.playbooks if caller.sees(pb))
    # A person's page asks for their requests every poll_ms: the event stream is the playbook's.
    stream = caller.person is None and any(getattr(r, "canonical", None) == PB + "/stream"
                                           for r in request.app.router.resources())
    return _json({"caller": caller.id, "role": caller.role.value, "person": caller.person, "playbooks": seen,
                  "playbook": DEFAULT_PLAYBOOK if DEFAULT_PLAYBOOK in seen else (seen[0] if seen else None),
                  "stream": stream, "poll_ms": WEB_POLL_MS, "now": fmt_time(engine.clock.now_ms())})


async def h_web_render(request: web.Request) -> web.Response:
    items = (await _json_body(request)).get("items")
    if not isinstance(items, list) or len(items) > WEB_RENDER_ITEMS:
        raise Problem("invalid_request", f"items is a list of at most {WEB_RENDER_ITEMS}",
                      errors=[{"pointer": "/items", "message": f"a list of at most {WEB_RENDER_ITEMS}"}])
    items = [item if isinstance(item, dict) else {} for item in items]
    named = await _named_options(request, items)
    out = []
    for i, item in enumerate(items):
        done: dict[str, Any] = {}
        if isinstance(item.get("markdown"), str):
            done["html"] = render_markdown(item["markdown"])
        if "schema" in item:
            done["form"] = answer_form(item["schema"], named.get(i))
        out.append(done)
    return _json({"items": out})


async def _named_options(request: web.Request, items: list[dict[str, Any]]) -> dict[int, dict[str, str]]:
    """The option labels of the items that name an ask-choice's run (`playbook`, `run_id`) the caller
    may answer, by the item's index: read from the runs' input, in one reading."""
    caller, engine = _caller(request), request.app[engine_key()]
    wanted = {i: (it["playbook"], it["run_id"]) for i, it in enumerate(items)
              if isinstance(it.get("playbook"), str) and isinstance(it.get("run_id"), str)
              and it["playbook"] in engine.playbooks and caller.sees(it["playbook"])
              and typed_shape(dumps(it.get("schema")))[0] == "choice"}

    def read(tx: Tx) -> dict[int, dict[str, str]]:
        out = {}
        for i, (pb, run_id) in wanted.items():
            req, run = tx.request(pb, run_id), tx.run(pb, run_id)
            if req is not None and run is not None and caller.addressed(req) \
                    and (named := option_labels(run["name"], run["input"])) is not None:
                out[i] = named
        return out
    return await engine.store.read(read) if wanted else {}


async def h_web_answer(request: web.Request) -> web.Response:
    """answer_interaction for the page: the same rules, and an answer that does not fit its schema
    comes back with its errors in words (answer_error_words), each at its field's pointer."""
    body = await _json_body(request)
    if "answer" not in body:
        raise Problem("invalid_request", "answer is required", errors=[{"pointer": "/answer", "message": "required"}])
    engine, caller, playbook = request.app[engine_key()], _caller(request), _pb(request)
    run_id = request.match_info["run_id"]
    try:
        fact, _ = await engine.answer_interaction(caller, playbook, run_id, body["answer"], digest=body.get("digest"))
    except Problem as exc:
        if exc.name == "invalid_input" and exc.errors:
            req, run = await engine.store.read(lambda tx: (tx.request(playbook, run_id), tx.run(playbook, run_id)))
            if req is not None and run is not None:
                raise reworded(exc, req["answer_schema"], body["answer"], option_labels(run["name"], run["input"]))
        raise
    return _json(fact)


async def h_web_counts(request: web.Request) -> web.Response:
    playbook, engine = _pb(request), request.app[engine_key()]
    caller = await engine.deputized(_caller(request), playbook)       # a deputy counts whom they stand for too
    rows = [r for r in await engine.store.read(lambda tx: tx.open_counts_by_party(playbook)) if caller.addressed(r)]
    return _json({"total": sum(r["n"] for r in rows), "to": [{"to": r["party"], "count": r["n"]} for r in rows],
                  "now": fmt_time(engine.clock.now_ms())})


# -- answer links ------------------------------------------------------------------------------------
#
# `GET /a/{id}.{signature}` is a page of its own, made on the daemon: the question, its form (no
# script: a plain HTML form that posts back to the same address), or once the request has ended
# who answered and when. A GET never changes anything, so a link unfurler or a mail scanner that
# opens the link answers nothing. `POST` answers once as the addressee: a JSON body
# `{"answer": ...}` (a program holding the link; problems as answer_interaction's), or the page's
# form, which must carry the form token derived from the link. A link that does not verify, or
# whose playbook this daemon does not serve, is a plain 404 page.

_LINK_RE: Final = re.compile(r"(int_[0-9A-Za-z]{1,64})\.[A-Za-z0-9_-]{32}(?:\.[A-Za-z0-9_-]{1,400})?")


async def _linked(request: web.Request) -> tuple[str, Row] | None:
    """The link's signed part and its request (with the run's input), or None when it does not verify -
    or when it is a deputy's whose window has closed."""
    engine, token = request.app[engine_key()], request.match_info["token"]
    m = _LINK_RE.fullmatch(token)
    if m is None:
        return None
    row = await engine.store.read(lambda tx: tx.linked_request(m.group(1)))
    if row is None or row["playbook"] not in engine.playbooks or (holder := engine.links.holder(token, row)) is None:
        return None
    if holder != row["party"]:
        deputy = await engine.deputized(Caller("link", Role.WRITER, row["playbook"], holder), row["playbook"])
        if not deputy.addressed(row):
            return None
    return token, row


def _link_caller(row: Row, token: str = "") -> Caller:
    """Who answers through a link: its addressee (or the deputy it was made for), a writer of its playbook."""
    parts = token.split(".")
    person = row["party"]
    if len(parts) == 3:
        person = base64.urlsafe_b64decode(parts[2] + "=" * (-len(parts[2]) % 4)).decode()
    return Caller(f"link:{row['id']}", Role.WRITER, row["playbook"], person)


async def _answered_by_words(engine: Engine, by: str | None, name: str | None = None) -> str:
    """Who answered, as a person reads it: the name the answer keeps (a person's, a token's, a reply's
    sender); for an answer kept without one, what `by` says: a token's name, a reply, this machine."""
    if by and by.startswith("tok_"):
        name = name or await engine.store.read(lambda tx: tx.token_name(by))
        return f"{name} (an API token)" if name else "an API token"
    if name:
        return name
    if not by:
        return "nobody"
    if by.startswith("playbook:"):
        return "a reply in the conversation it was sent to"
    return {"stdio": "the local agent", "local": "the command line", "interactiond": "the daemon"}.get(by, by)


def _link_html(title: str, *parts: str, status: int = 200) -> web.Response:
    from aiohttp import web
    head, tail = LINK_PAGE.split("{body}")
    return web.Response(text=head.replace("{title}", _esc(title)) + "".join(parts) + tail,
                        status=status, content_type="text/html", headers=LINK_HEADERS)


def _link_not_found() -> web.Response:
    return _link_html("Link not found", "<h1>This link does not work</h1><p>It is not a link this daemon made, or"
                      " part of it is missing. Ask whoever sent it for the link again.</p>", status=404)


def _field_html(fd: dict[str, Any], key: str, value: list[str], error: str | None) -> str:
    """One field of an answer link's form, with its hint, its error, and what was sent in it."""
    fid, eid, hid = f"f{key}", f"f{key}-err", f"f{key}-hint"
    words = " · ".join(str(w) for w in (fd.get("hint"), fd.get("bounds")) if w)
    hint = f'<p class="hint" id="{hid}">{_esc(words)}</p>' if words else ""
    err = f'<p class="err" id="{eid}">{_esc(error)}</p>' if error else ""
    described = " ".join(x for x in (hid if words else "", eid if error else "") if x)
    invalid = ' aria-invalid="true"' if error else ""
    label = fd["label"] if fd["required"] else f"{fd['label']} (optional)"
    if fd["kind"] in ("choice", "checkboxes"):
        multi = fd["kind"] == "checkboxes"
        picked = set(value)
        opts = "".join(
            f'<label class="opt"><input type="{"checkbox" if multi else "radio"}" name="{fid}" value="{i}"'
            f'{" checked" if str(i) in picked else ""}> {_esc(lab)}</label>' for i, lab in enumerate(fd["labels"]))
        return (f'<div class="field"><fieldset aria-describedby="{described}"{invalid}><legend>{_esc(label)}</legend>'
                f'{opts}</fieldset>{hint}{err}</div>')
    attrs = f'id="{fid}" name="{fid}" aria-describedby="{described}"{invalid}'
    text = value[0] if value else ""
    if fd["kind"] == "number":
        bounds = "".join(f' {k}="{fd[k]}"' for k in ("min", "max") if fd.get(k) is not None)
        control = (f'<input type="number" {attrs} step="{"1" if fd.get("integer") else "any"}"{bounds}'
                   f' value="{_esc(text)}">')
    elif fd["kind"] == "text":
        most = f' maxlength="{fd["maxLength"]}"' if fd.get("maxLength") else ""
        control = f'<textarea {attrs} rows="{2 if fd.get("note") else 3}"{most}>{_esc(text)}</textarea>'
    else:
        control = f'<textarea {attrs} rows="6" class="json" spellcheck="false">{_esc(text or fd.get("example", ""))}</textarea>'
    return f'<div class="field"><label for="{fid}">{_esc(label)}</label>{control}{hint}{err}</div>'


def _place_errors(fields: list[dict[str, Any]], errors: list[dict[str, Any]]) -> tuple[dict[str, str], list[str]]:
    """Errors by the pointer of the field they land at (the longest that prefixes theirs), and the rest."""
    at: dict[str, str] = {}
    rest: list[str] = []
    for e in errors:
        pointer, message = e.get("pointer") or "", str(e.get("message") or "")
        rel = pointer[len("/answer"):] if pointer == "/answer" or pointer.startswith("/answer/") else None
        best = None
        for fd in fields:
            p = fd["pointer"]
            if rel is not None and (rel == p or rel.startswith(p + "/")) and (best is None or len(p) > len(best)):
                best = p
        if best is None:
            rest.append(message)
        else:
            at[best] = f"{at[best]} {message}" if best in at else message
    return at, rest


def _link_form_html(form: dict[str, Any], form_token: str, sent: Mapping[str, list[str]],
                    errors: list[dict[str, Any]], digest: str | None = None) -> str:
    fields = form["fields"] + ([form["choice"]] if form["mode"] == "choice" else [])
    at, rest = _place_errors(fields, errors)
    parts = [f'<form class="answer" method="post" action="" novalidate>'
             f'<input type="hidden" name="form" value="{_esc(form_token)}">'
             + (f'<input type="hidden" name="digest" value="{_esc(digest)}">' if digest else "")]
    parts += [_field_html(fd, str(i), sent.get(f"f{i}", []), at.get(fd["pointer"])) for i, fd in enumerate(form["fields"])]
    if form["mode"] == "choice":
        c = form["choice"]
        err = at.get(c["pointer"])
        parts.append(f'<div class="choice-col"><span class="label" id="c-label">{_esc(c["label"])}</span>'
                     f'<div class="choice" role="group" aria-labelledby="c-label">'
                     + "".join(f'<button type="submit" name="choice" value="{i}">{_esc(lab)}</button>'
                               for i, lab in enumerate(c["labels"]))
                     + "</div>" + (f'<p class="err">{_esc(err)}</p>' if err else "") + "</div>")
    else:
        parts.append('<div class="actions"><button type="submit" class="primary">Send the answer</button></div>')
    if rest:
        parts.append(f'<p class="err" role="alert">{_esc(" ".join(rest))}</p>')
    return "".join(parts) + "</form>"


def form_answer(form: dict[str, Any], sent: Mapping[str, list[str]]) -> tuple[Any, list[dict[str, str]]]:
    """The answer an answer link's form posted (`sent`: each field's values by its name, `f0`...,
    and the button pressed, `choice`), and what could not be read (not a number, not JSON), as
    errors at the fields' pointers."""
    answer: dict[str, Any] = {}
    root: list[Any] = []
    bad: list[dict[str, str]] = []

    def put(fd: dict[str, Any], value: Any) -> None:
        if fd["pointer"] == "":
            root.append(value)
        else:
            answer[fd["name"]] = value

    def pick(fd: dict[str, Any], raw: Any) -> Any:
        try:
            return fd["values"][int(raw)]
        except (ValueError, IndexError, TypeError):
            return None
    for i, fd in enumerate(form["fields"]):
        values = sent.get(f"f{i}") or []
        kind = fd["kind"]
        if kind == "checkboxes":
            picked = [v for v in (pick(fd, r) for r in values) if v is not None]
            if picked or fd["required"]:
                put(fd, picked)
            continue
        raw = values[0] if values else ""
        if kind == "text":
            if raw != "" or fd["pointer"] == "":
                put(fd, raw)
        elif kind == "number":
            if raw.strip():
                try:
                    number = float(raw) if not re.fullmatch(r"\s*-?\d+\s*", raw) else int(raw)
                    if not math.isfinite(number):
                        raise ValueError(raw)
                    put(fd, int(number) if fd.get("integer") and isinstance(number, float) and number.is_integer()
                        else number)
                except ValueError:
                    bad.append({"pointer": "/answer" + fd["pointer"], "message": f"{fd['label']} must be a number"})
        elif kind == "choice":
            if raw != "" and (value := pick(fd, raw)) is not None:
                put(fd, [value] if fd.get("array") else value)
        elif raw.strip():
            try:
                put(fd, read_json(raw))
            except ValueError as exc:
                bad.append({"pointer": "/answer" + fd["pointer"], "message": f"{fd['label']} is not JSON: {exc}"})
        elif fd["pointer"] == "":
            bad.append({"pointer": "/answer", "message": "Write the answer as JSON"})
    if form["mode"] == "choice":
        value = pick(form["choice"], (sent.get("choice") or [""])[0])
        if value is None:
            bad.append({"pointer": "/answer" + form["choice"]["pointer"], "message": "Pick one of the buttons"})
        else:
            put(form["choice"], value)
    return (root[0] if root else answer), bad


async def _link_page(engine: Engine, token: str, row: Row, *, sent: Mapping[str, Any] | None = None,
                     errors: list[dict[str, Any]] | None = None, status: int = 200) -> web.Response:
    """The page of an answer link: the question and its form while it is open, else how it ended."""
    title = f"{row['name']} for {row['party']}"
    head = (f'<h1>{_esc(row["name"])} <span class="to">for {_esc(row["party"])}</span></h1>'
            f'<p class="meta">asked {_esc(_when_words(row["asked_at"]))}'
            + (f' · expires {_esc(_when_words(row["expires_at"]))}' if row["status"] == RequestStatus.OPEN else "") + "</p>"
            f'<div class="msg">{render_markdown(row["message"])}</div>'
            + (f'<p class="meta digest" title="sha256 of what this request shows: its message, answer form and'
               f' arguments">digest <code id="digest">{_esc(row["digest"])}</code></p>' if row["digest"] else ""))
    state = row["status"]
    if state == RequestStatus.ANSWERED:
        who = await _answered_by_words(engine, row["answered_by"], row["answered_by_name"])
        shown = json.dumps(json.loads(row["answer"]), indent=2, ensure_ascii=False)
        end = (f'<div id="status" class="card" role="status"><p>Answered by <strong>{_esc(who)}</strong> on'
               f' {_esc(_when_words(row["answered_at"]))}. It takes no other answer.</p><pre>{_esc(shown)}</pre></div>')
    elif state == RequestStatus.EXPIRED:
        end = (f'<div id="status" class="card" role="status"><p>Nobody answered in time: it expired on'
               f' {_esc(_when_words(row["expires_at"]))}. It takes no answer now.</p></div>')
    elif state == RequestStatus.CANCELLED:
        end = '<div id="status" class="card" role="status"><p>It was cancelled. It takes no answer now.</p></div>'
    elif row["answer_schema"] is None:
        end = '<p class="muted">A notification: there is nothing to answer.</p>'
    elif row["delivery_state"] == DeliveryState.CANCELLING.value:
        end = '<div id="status" class="card" role="status"><p>It is being cancelled. It takes no answer now.</p></div>'
    else:
        form = answer_form(json.loads(row["answer_schema"]), option_labels(row["name"], row["run_input"]))
        end = _link_form_html(form, engine.links.form_token(token), sent or {}, errors or [], row["digest"])
    return _link_html(title, head, end, status=status)


def _when_words(ms: int | None) -> str:
    """A time as a person reads it on a page made on the daemon: `2027-01-15 08:00 UTC`."""
    text = fmt_time(ms)
    return f"{text[:10]} {text[11:16]} UTC" if text else ""


async def h_answer_link(request: web.Request) -> web.Response:
    found = await _linked(request)
    if found is None:
        return _link_not_found()
    return await _link_page(request.app[engine_key()], *found)


async def h_answer_link_post(request: web.Request) -> web.Response:
    found = await _linked(request)
    if found is None:
        if request.content_type == "application/json":
            raise not_found("no such answer link")
        return _link_not_found()
    engine, (token, row) = request.app[engine_key()], found
    caller = _link_caller(row, token)
    if request.content_type == "application/json":     # a program holding the link: answer_interaction's answers
        body = await _json_body(request)
        if "answer" not in body:
            raise Problem("invalid_request", "answer is required", errors=[{"pointer": "/answer", "message": "required"}])
        fact, _ = await engine.answer_interaction(caller, row["playbook"], row["run_id"], body["answer"],
                                                  body.get("claimed_for"), digest=body.get("digest"))
        return _json(fact)
    posted = await request.post()
    sent = {k: [str(v) for v in posted.getall(k)] for k in set(posted.keys())}
    if not hmac.compare_digest(str(posted.get("form", "")).encode(), engine.links.form_token(token).encode()):
        return _link_html("Form refused", "<h1>This form was not sent from its page</h1><p>Open the link again and"
                          " answer on its page.</p>", status=403)
    if row["status"] != RequestStatus.OPEN or row["answer_schema"] is None:
        return await _link_page(engine, token, row, status=409)
    named = option_labels(row["name"], row["run_input"])
    form = answer_form(json.loads(row["answer_schema"]), named)
    answer, bad = form_answer(form, sent)
    if bad:
        return await _link_page(engine, token, row, sent=sent, errors=bad, status=422)
    try:
        await engine.answer_interaction(caller, row["playbook"], row["run_id"], answer,
                                        digest=str(posted["digest"]) if "digest" in posted else None)
    except Problem as exc:
        if exc.name in ("answered", "not_open", "notification"):         # ended meanwhile: say how
            row = await engine.store.read(lambda tx: tx.linked_request(row["id"])) or row
            return await _link_page(engine, token, row, status=409)
        exc = reworded(exc, row["answer_schema"], answer, named)
        return await _link_page(engine, token, row, sent=sent, status=exc.status,
                                errors=exc.errors or [{"pointer": "", "message": exc.detail}])
    return _see_other(token)           # relative: the link's own address, whatever public_url's path


def mount_web(app: web.Application) -> None:
    """The inbox page, its sign-in and its helpers (the middleware authenticates all but / and /login)."""
    app.router.add_get("/", h_inbox_page)
    app.router.add_get("/login", h_login)
    app.router.add_post("/logout", h_logout)
    app.router.add_get("/web/session", h_web_session)
    app.router.add_post("/web/render", h_web_render)
    app.router.add_get("/web/orgs/{org}/playbooks/{playbook}/counts", h_web_counts)
    app.router.add_post("/web/orgs/{org}/playbooks/{playbook}/runs/{run_id}/answer", h_web_answer)
    app.router.add_get("/a/{token}", h_answer_link)
    app.router.add_post("/a/{token}", h_answer_link_post)


# Command line ###################################################################################
#
# `serve`, `stdio` and `demo` run the engine; `check` and `token` work on files; `define`, `run`,
# `get`, `wait`, `cancel`, `inbox`, `answer`, `runs` and `definitions` are thin clients of the HTTP
# API. Files beside the database (mode 0600): `.lock` (the engine's OS lock), `.token` (the
# operator token the first start made) and `.url` (where the running engine listens).
# For a PostgreSQL database they are interactiond-NAME.token and so on, in the working directory.

def build_app(engine: Engine, *, manage_engine: bool = True, hosts: Iterable[str] = (),
              access_log: bool = False) -> web.Application:
    """The aiohttp application over an engine (started and stopped with the app when asked); its
    metrics count from now on, `access_log` writes a line per request, and /mcp and /sse accept
    `hosts` (the addresses it listens at) in `Host`."""
    from aiohttp import web
    app = web.Application(middlewares=[web.middleware(observe_middleware)],   # api_middleware within
                          client_max_size=MAX_BODY_BYTES)
    app[engine_key()] = engine
    app[tokens_key()] = {}
    app[connections_key()] = Connections(engine.config.max_connections)
    app[metrics_key()] = Metrics(engine)
    app[access_log_key()] = access_log
    # aiohttp tries the routes under /v1/orgs one after another, in the order they were added: a
    # run's and an answer's first (POST /runs 3.2 -> 2.0 us to resolve, an answer 6.0 -> 2.8 us).
    for r in sorted(ROUTES, key=lambda r: r.path not in _HOT_PATHS):
        app.router.add_route(r.method, r.path, r.handler)
    mount_mcp(app, engine, hosts)
    mount_typed_api(app)
    mount_web(app)

    async def end_waits(app: web.Application) -> None:
        engine.end_waits()              # with the streams ended above: a stop takes no long poll's time
    app.on_shutdown.append(end_waits)
    if manage_engine:
        async def lifecycle(app: web.Application) -> Any:
            await engine.store.open()
            await engine.start()
            yield
            await engine.stop()
            await engine.store.close()
        app.cleanup_ctx.append(lifecycle)
    return app


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard one (every connection is a descriptor); the soft
    limit it stands at now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit is refused as a soft one (Linux: fs.nr_open; macOS: OPEN_MAX): then the
    # most the system takes.
    for target in ((hard,) if hard != resource.RLIM_INFINITY else (1 << 20, 1 << 16, 10240)):
        if soft != resource.RLIM_INFINITY and target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                break
            except (ValueError, OSError):
                continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def start_serving(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, asyncio.AbstractServer]:
    """Start `app` and accept its connections at host:port, each through the app's `Connections`,
    whose cap leaves FD_RESERVE descriptors under the open-file limit; stop with stop_serving.
    OSError when it cannot listen there (the app is cleaned up)."""
    from aiohttp import web
    limit = raise_open_file_limit()
    conns = app[connections_key()]
    room = limit - min(FD_RESERVE, limit // 4)
    if conns.cap > room:
        log.warning("the open-file limit is %d: at most %d connections (max_connections: %d)", limit, room,
                    conns.cap)
        conns.cap = room
    # No access log from aiohttp (a line per request cost 1/6 of the loop; `--access-log` writes ours).
    runner = web.AppRunner(app, handle_signals=False, access_log=None, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
    await runner.setup()
    try:
        server = await asyncio.get_running_loop().create_server(conns.factory(runner.server), host, port,
                                                                 backlog=LISTEN_BACKLOG)
    except BaseException:
        await runner.cleanup()
        raise
    return runner, server


async def stop_serving(runner: web.AppRunner, server: asyncio.AbstractServer) -> None:
    """Stop accepting, then end every connection and the app (long polls and streams at once)."""
    server.close()
    await runner.cleanup()


def _beside(db: str, suffix: str) -> Path:
    if is_postgres_url(db):         # no file to stand beside: the working directory, by the database's name
        return Path(f"interactiond-{postgres_database_name(db)}{suffix}")
    return Path(db + suffix)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o600)


def ensure_operator_token(db: str) -> str:
    """The operator token the first start made (written beside the database), made now if missing."""
    path = _beside(db, ".token")
    tx = open_sync(db)
    try:
        if path.exists():
            secret = path.read_text().strip()
            if tx.token_known(sha256_hex(secret)):
                return secret
        _, secret = create_token(tx, "operator", None, "first start")
        _write_private(path, secret + "\n")
        return secret
    finally:
        tx.close()


class EngineLock:
    """The OS lock that makes one engine per database file."""

    def __init__(self, db: str) -> None:
        self.path = _beside(db, ".lock")
        self.fh: Any = None

    def acquire(self) -> bool:
        self.fh = os.fdopen(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600), "a+")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.fh.close()
            self.fh = None
            return False
        self.fh.seek(0)
        self.fh.truncate()
        self.fh.write(str(os.getpid()))
        self.fh.flush()
        return True

    def holder(self) -> str:
        try:
            return self.path.read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def release(self) -> None:
        if self.fh is not None:
            fcntl.flock(self.fh, fcntl.LOCK_UN)
            self.fh.close()
            self.fh = None


def _make_clock(name: str, host: str) -> Clock:
    if name == "manual":
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit("--clock manual is for tests and demos: it needs --host 127.0.0.1")
        return ManualClock()
    return SystemClock()


async def _serve(args: Any, config: Config,
                 after_start: Callable[[Engine, str], Any] | None = None) -> int:
    """`serve` (and `demo`, whose `after_start(engine, url)` runs once the daemon listens)."""
    db = args.db or os.environ.get("INTERACTIOND_DB") or config.database
    host = args.host or config.host
    port = args.port if args.port is not None else config.port
    lock = EngineLock(db)
    if not lock.acquire():
        print(f"interactiond: {db_shown(db)} is already served by process {lock.holder()}; stop it first",
              file=sys.stderr)
        return 1
    try:
        secret = ensure_operator_token(db)
        tx = open_sync(db)
        # One login link at a time: the link an earlier start printed stops working.
        tx.revoke_logins(WALL.now_ms())
        _, login = create_token(tx, "operator", None, START_LOGIN_NAME, purpose="login")
        tx.close()
        engine = Engine(Store(db), _make_clock(args.clock, host), config)
        app = build_app(engine, hosts=[host], access_log=args.access_log)
        try:
            runner, server = await start_serving(app, host, port)
        except OSError as exc:
            print(f"interactiond: cannot listen on {host}:{port}: {exc.strerror or exc}"
                  " (another daemon there? choose another with --port)", file=sys.stderr)
            return 1
        bound = server.sockets[0].getsockname()[1] if server.sockets else port
        url = f"http://{host}:{bound}"
        _write_private(_beside(db, ".url"), url + "\n")
        if not config.public_url:           # answer and sign-in links: the address it listens at
            engine.links.base = Config(host=host, port=bound).links_base
        stop = asyncio.Event()              # before the lines below: a stop right after them is a clean one
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(f"interactiond {__version__} serving {db_shown(db)} at {url}", flush=True)
        print(f"inbox: {url}/login?token={login}", flush=True)
        print(f"operator token: {_beside(db, '.token')}", flush=True)
        if after_start is not None:
            await after_start(engine, url)
        await stop.wait()
        log.info("stopping: in-flight tool calls get %g s to finish", SHUTDOWN_GRACE_S)
        await stop_serving(runner, server)
        with contextlib.suppress(OSError):
            _beside(db, ".url").unlink()
        return 0
    finally:
        lock.release()


async def _stdio(args: Any, config: Config) -> int:
    """MCP over stdin/stdout: the engine itself, or a thin front over the engine that runs already."""
    from mcp.server.stdio import stdio_server

    db = args.db or os.environ.get("INTERACTIOND_DB") or config.database
    if args.playbook and not PLAYBOOK_RE.fullmatch(args.playbook):
        print("interactiond: --playbook is ORG/NAME", file=sys.stderr)
        return 2
    here = None
    if args.as_ is not None:
        try:
            here = person_name(args.as_)
        except ValueError as exc:
            print(f"interactiond: --as: {exc}", file=sys.stderr)
            return 2
    lock = EngineLock(db)
    if not lock.acquire():
        return await _stdio_front(db, args.playbook, here or config.mcp_as)
    runner = listening = None
    try:
        ensure_operator_token(db)
        engine = Engine(Store(db), SystemClock(), config)
        if args.playbook and args.playbook not in engine.playbooks:
            print(f"interactiond: no playbook {args.playbook} in the configuration", file=sys.stderr)
            return 2
        await engine.store.open()
        await engine.start()
        if args.http is not None:
            runner, listening = await start_serving(build_app(engine, manage_engine=False, access_log=args.access_log),
                                                    "127.0.0.1", args.http)
            bound = listening.sockets[0].getsockname()[1] if listening.sockets else args.http
            _write_private(_beside(db, ".url"), f"http://127.0.0.1:{bound}\n")
            if not config.public_url:
                engine.links.base = f"http://127.0.0.1:{bound}"
            login, _ = await make_login_link(engine, None, DEFAULT_PLAYBOOK)
            print(f"interactiond: HTTP at http://127.0.0.1:{bound}", file=sys.stderr)
            print(f"interactiond: inbox: {login}", file=sys.stderr)
        server = make_mcp_server(engine, caller=Caller("stdio", Role.OPERATOR, args.playbook),
                                 scoped_playbook=args.playbook, here=here)
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
        return 0
    finally:
        if runner is not None and listening is not None:
            await stop_serving(runner, listening)
            with contextlib.suppress(OSError):
                _beside(db, ".url").unlink()
        if "engine" in locals():
            await engine.stop()
            await engine.store.close()
        lock.release()


async def _stdio_front(db: str, playbook: str | None, here: str | None = None) -> int:
    """Another process runs the engine of this file: relay MCP to its /mcp endpoint.

    The relay speaks 2026-07-28 to the daemon. With `--as` it names the person at the client
    (Interactiond-As) and declares elicitation when its own client did, so the daemon's questions
    come back as `input_required`: passed on as they are to a client of that era, asked with
    `elicitation/create` of a client of the session era (and the call retried with the answers)."""
    import httpx2
    from mcp import Client
    from mcp import types as mt
    from mcp.client.streamable_http import streamable_http_client
    from mcp.server import Server as _McpServer
    from mcp.server.stdio import stdio_server
    from mcp_types.version import MODERN_PROTOCOL_VERSIONS

    try:
        url = _beside(db, ".url").read_text().strip()
        token = _beside(db, ".token").read_text().strip()
    except OSError:
        print(f"interactiond: {db_shown(db)} is served by another process, which publishes no URL (start it with serve)",
              file=sys.stderr)
        return 1
    headers = {"Authorization": f"Bearer {token}", **({"Interactiond-As": here} if here else {})}
    loop = asyncio.get_running_loop()
    wants: asyncio.Future[bool] = loop.create_future()       # does the client here ask its person?
    ready: asyncio.Future[Any] = loop.create_future()        # the client of the daemon
    stop = asyncio.Event()

    async def never_asked(ctx: Any, params: Any) -> Any:      # the relay drives questions itself
        return mt.ElicitResult(action="cancel")

    async def hold() -> None:
        """The relay's client of the daemon, opened (once the first request shows what this client can
        do) and closed in this one task."""
        elicits = await wants
        if stop.is_set():
            return
        async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(90)) as http:
            async with Client(streamable_http_client(url + "/mcp", http_client=http),
                              elicitation_callback=never_asked if elicits else None) as upstream:
                ready.set_result(upstream)
                await stop.wait()

    def opened(task: asyncio.Task[None]) -> None:
        if stop.is_set() and not ready.done():
            ready.cancel()
        elif not ready.done():
            failed = None if task.cancelled() else task.exception()
            ready.set_exception(failed or ConnectionError("the relay's connection to the daemon ended"))
    holder = asyncio.create_task(hold())
    holder.add_done_callback(opened)

    async def upstream(ctx: Any) -> Any:
        if not wants.done():
            caps = ctx.session.client_capabilities
            wants.set_result(here is not None and getattr(caps, "elicitation", None) is not None)
        return await asyncio.shield(ready)

    async def list_tools(ctx: Any, params: Any) -> mt.ListToolsResult:
        tools = (await (await upstream(ctx)).list_tools()).tools
        if playbook:
            for t in tools:
                t.input_schema.get("properties", {}).pop("playbook", None)
        return mt.ListToolsResult(tools=tools)

    async def call_tool(ctx: Any, params: Any) -> Any:
        up = await upstream(ctx)
        args = dict(params.arguments or {})
        if playbook:
            args["playbook"] = playbook

        async def relay(progress: float, total: float | None, message: str | None) -> None:
            await ctx.session.report_progress(progress, total, message)
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:     # the same era: questions pass through
            return await up.session.call_tool(params.name, args, progress_callback=relay,
                                              input_responses=params.input_responses,
                                              request_state=params.request_state, allow_input_required=True)
        result = await up.session.call_tool(params.name, args, progress_callback=relay, allow_input_required=True)
        for _ in range(MAX_ELICIT_ASKS + 1):
            if not isinstance(result, mt.InputRequiredResult):
                break
            answers: dict[str, Any] = {}
            for key, asked in (result.input_requests or {}).items():
                q = asked.params
                try:
                    if isinstance(q, mt.ElicitRequestURLParams):
                        answers[key] = await ctx.session.elicit_url(q.message, q.url,
                                                                    q.elicitation_id or secrets.token_hex(8),
                                                                    related_request_id=ctx.request_id)
                    else:
                        answers[key] = await ctx.session.elicit_form(q.message, q.requested_schema,
                                                                     related_request_id=ctx.request_id)
                except Exception:                      # this client cannot ask it: dismissed
                    answers[key] = mt.ElicitResult(action="cancel")
            result = await up.session.call_tool(params.name, args, progress_callback=relay, input_responses=answers,
                                                request_state=result.request_state, allow_input_required=True)
        if isinstance(result, mt.InputRequiredResult):
            return mt.CallToolResult(content=[mt.TextContent(type="text", text="the daemon kept asking; call again")],
                                     is_error=True)
        return result

    server = _McpServer("interactiond", version=__version__, on_list_tools=list_tools, on_call_tool=call_tool)
    try:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
    finally:
        stop.set()
        if not wants.done():
            wants.set_result(False)
        await asyncio.gather(holder, return_exceptions=True)
    return 0


# -- the command-line clients ---------------------------------------------------------------------
#
# Thin clients of the HTTP API (standard library only). Every failure a user can meet is one line
# on stderr and an exit code: 0 done, 1 refused, 2 usage, 3 the daemon could not be reached (and,
# for `wait --timeout`, 4 when the run goes on). Lists print a table on a terminal and JSON when
# piped or with --json.

EXIT_REFUSED: Final = 1
EXIT_USAGE: Final = 2
EXIT_UNREACHABLE: Final = 3
EXIT_STILL_WAITING: Final = 4
EXIT_CODES: Final = """exit codes:
  0  done
  1  refused: the daemon said no (the problem is printed on one line), `check` found problems, or
     the run that `run` or `wait` shows ended other than succeeded
  2  usage: a bad option or argument
  3  the daemon could not be reached
  4  `wait --timeout` passed and the run goes on"""


class CliError(Exception):
    """A command that cannot go on: one line for stderr, and the exit code."""

    def __init__(self, message: str, code: int = EXIT_REFUSED) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class DaemonAddress:
    """Where a client command finds the daemon, where it learnt that (for a message), and its token."""

    url: str
    source: str
    token: str | None


def daemon_address(args: Any, db: str, config: Config) -> DaemonAddress:
    """--url, else the URL the running engine wrote beside the database, else the configuration's
    listen address; --token, else INTERACTIOND_TOKEN, else the operator token beside the database."""
    url_file = _beside(db, ".url")
    if args.url:
        url, source = args.url, "--url"
    else:
        try:
            url, source = url_file.read_text().strip(), str(url_file)
        except OSError:
            host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
            url, source = f"http://{host}:{config.port}", f"the default; no {url_file} beside the database"
    token = args.token or os.environ.get("INTERACTIOND_TOKEN")
    if not token:
        with contextlib.suppress(OSError):
            token = _beside(db, ".token").read_text().strip() or None
    return DaemonAddress(url.rstrip("/"), source, token)


def _http(method: str, url: str, token: str | None, body: Any = None,
          timeout: float = MAX_HTTP_WAIT_S + 10) -> tuple[int, Any, Mapping[str, str]]:
    """One call: (status, JSON body, headers). Raises OSError (URLError included) when nothing answered."""
    import urllib.error
    import urllib.request
    data = dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw, got = resp.status, resp.read(), resp.headers
    except urllib.error.HTTPError as exc:
        status, raw, got = exc.code, exc.read(), exc.headers
    try:
        return status, json.loads(raw or b"null"), got
    except ValueError:
        return status, {"title": f"HTTP {status}", "detail": raw.decode(errors="replace")[:200]}, got


def call_daemon(d: DaemonAddress, method: str, path: str, body: Any = None,
                query: Mapping[str, Any] | None = None) -> tuple[int, Any, Mapping[str, str]]:
    """A call to the daemon, or a CliError that says in one line why there was none."""
    import http.client
    q = {k: v for k, v in (query or {}).items() if v is not None}
    url = d.url + path + ("?" + urllib.parse.urlencode(q) if q else "")
    unreachable = CliError(f"cannot reach the daemon at {d.url} (from {d.source}): is `interactiond serve` running?",
                           EXIT_UNREACHABLE)
    if not re.match(r"https?://[^/\s]+(/\S*)?$", d.url):
        raise CliError(f"{d.url} (from {d.source}) is not a daemon's URL such as http://127.0.0.1:8765", EXIT_USAGE)
    if d.token is None:
        try:
            _http("GET", d.url + "/healthz", None, timeout=10)
        except (OSError, http.client.HTTPException):
            raise unreachable from None
        raise CliError("no token: pass --token, set INTERACTIOND_TOKEN, or give the --db that serve made"
                       " (its token is beside it)", EXIT_USAGE)
    try:
        return _http(method, url, d.token, body)
    except (OSError, http.client.HTTPException):
        raise unreachable from None


def problem_line(status: int, body: Any) -> str:
    """A problem object as one line: its title and detail, then each error's place and message."""
    if not isinstance(body, dict):
        return f"the daemon answered {status}"
    line = f"{body.get('title') or f'HTTP {status}'}: {body.get('detail') or ''}".rstrip(": ")
    errors = body.get("errors") if isinstance(body.get("errors"), list) else []
    shown = []
    for e in errors[:5]:
        if isinstance(e, dict):
            where = e.get("pointer") or e.get("field") or (f"line {e['line']}" if e.get("line") else "")
            shown.append(f"{where}: {e.get('message')}" if where else str(e.get("message")))
    if shown:
        line += " (" + "; ".join(shown) + (f"; and {len(errors) - 5} more" if len(errors) > 5 else "") + ")"
    return line


def _is_run(body: Any) -> bool:
    return isinstance(body, dict) and "run_id" in body and "status" in body and "type" in body


def _run_ending_line(run: dict[str, Any]) -> str:
    status = run["status"] + (f"/{run['kind']}" if run.get("kind") else "")
    detail = (run.get("problem") or {}).get("detail") or ""
    return f"run {run['run_id']} ended {status}" + (f": {detail}" if detail else "")


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


def _when(text: Any) -> str:
    """An RFC 3339 time as `YYYY-MM-DD HH:MM` (UTC), for a table."""
    return f"{text[:10]} {text[11:16]}" if isinstance(text, str) and len(text) >= 16 else ""


def _cell(value: Any, width: int = 48) -> str:
    text = " ".join(str(value if value is not None else "").split())
    return text if len(text) <= width else text[:width - 3] + "..."


def render_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell, the last one left as it is."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    lines = []
    for cells in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells[:-1], widths)) + ("  " if len(cells) > 1 else "")
                     + cells[-1])
    return "\n".join(line.rstrip() for line in lines)


def _print_list(args: Any, out: dict[str, Any], header: list[str], row: Callable[[dict[str, Any]], list[str]],
                empty: str) -> None:
    """A listing: a table on a terminal, else (or with --json) the API's JSON."""
    if args.json or not sys.stdout.isatty():
        _print_json(out)
        return
    items = out.get("data") or []
    print(render_table(header, [row(x) for x in items]) if items else empty)
    if out.get("next_cursor"):
        print(f"(more: add --cursor {out['next_cursor']})")


def _answered_words(name: Any, by: Any, at: Any) -> str:
    """Who answered and when, as the command line says it under the JSON (on stderr): the name the
    answer keeps, else its `by` (a token's id only as "an API token")."""
    who = name or ("an API token" if isinstance(by, str) and by.startswith("tok_") else by) or "nobody"
    return f"answered by {who} on {_when(at)} UTC"


def _answered_line(d: DaemonAddress, base: str, run: dict[str, Any]) -> str | None:
    """For a run that ended with an answer: who gave it, in words, and when (its request_answered:
    answered_by_name, else the event's `by`); None for a run without one."""
    if run.get("status") != RunStatus.SUCCEEDED.value or run.get("type") != "interaction":
        return None
    path = f"{base}/runs/{urllib.parse.quote(run['run_id'], safe='')}/events"
    cursor = None
    for _ in range(25):
        status, page, _ = call_daemon(d, "GET", path, query={"limit": "200", "cursor": cursor})
        if status >= 400 or not isinstance(page, dict):
            return None
        for e in page.get("data") or []:
            if e.get("type") == "request_answered":
                if e.get("truncated"):
                    _, whole, _ = call_daemon(d, "GET", f"{base}/events/{urllib.parse.quote(e['id'], safe='')}")
                    e = whole if isinstance(whole, dict) else e
                return _answered_words((e.get("payload") or {}).get("answered_by_name"), e.get("by"), e.get("at"))
        cursor = page.get("next_cursor")
        if not cursor:
            return None
    return None


def _elapsed(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _wait_for_run(d: DaemonAddress, base: str, run_id: str, timeout: float | None) -> int:
    """`wait`: long polls until the run ends (or --timeout passes), showing that it waits."""
    path = f"{base}/runs/{urllib.parse.quote(run_id, safe='')}"
    status, body, _ = call_daemon(d, "GET", path)           # first: is there such a run, and is it live?
    if not _is_run(body):
        raise CliError(problem_line(status, body))
    path += "/wait"
    began = time.monotonic()
    done: dict[str, Any] = {} if body["status"] in (RunStatus.STARTED, RunStatus.WAITING) else {"run": body}

    def poll() -> None:
        try:
            while True:
                left = MAX_HTTP_WAIT_S if timeout is None else max(0.0, timeout - (time.monotonic() - began))
                status, body, _ = call_daemon(d, "POST", path, query={"timeout": f"{min(left, MAX_HTTP_WAIT_S):.3f}"})
                if not _is_run(body):
                    done["problem"] = (status, body)
                    return
                if body["status"] not in (RunStatus.STARTED, RunStatus.WAITING) or (timeout is not None and left <= 0):
                    done["run"] = body
                    return
        except BaseException as exc:            # a CliError, to raise in the main thread
            done["error"] = exc

    worker = threading.Thread(target=poll, name="interactiond-wait", daemon=True)
    if not done:
        worker.start()
    shown = sys.stderr.isatty() and not done
    if not shown and not done:
        print(f"waiting for run {run_id} to end", file=sys.stderr, flush=True)
    try:
        while worker.is_alive():
            worker.join(1.0)
            if shown and worker.is_alive():
                print(f"\rwaiting for run {run_id} to end: {_elapsed(time.monotonic() - began)}", end="",
                      file=sys.stderr, flush=True)
    finally:
        if shown:
            print("\r\x1b[K", end="", file=sys.stderr, flush=True)
    if "error" in done:
        raise done["error"]
    if "problem" in done:
        raise CliError(problem_line(*done["problem"]))
    run = done["run"]
    _print_json(run)
    if (said := _answered_line(d, base, run)) is not None:
        print(said, file=sys.stderr)
    if run["status"] in (RunStatus.STARTED, RunStatus.WAITING):
        print(f"interactiond: run {run_id} is still {run['status']} after {timeout:g} s", file=sys.stderr)
        return EXIT_STILL_WAITING
    if run["status"] != RunStatus.SUCCEEDED.value:
        print(f"interactiond: {_run_ending_line(run)}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


def _json_argument(text: str, what: str, example: str) -> Any:
    try:
        return read_json(text)
    except ValueError as exc:
        raise CliError(f"{what} is not JSON ({exc}); write it as {example}", EXIT_USAGE) from None


def _cli_client(args: Any, db: str, config: Config) -> int:
    if not PLAYBOOK_RE.fullmatch(args.playbook):
        raise CliError(f"--playbook is ORG/NAME in lowercase letters, digits and hyphens, not {args.playbook!r}",
                       EXIT_USAGE)
    d = daemon_address(args, db, config)
    org, _, name = args.playbook.partition("/")
    base = f"/v1/orgs/{org}/playbooks/{name}"
    cmd = args.cmd
    rid = urllib.parse.quote(getattr(args, "run_id", "") or "", safe="")
    if cmd == "define":
        try:
            source = Path(args.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"{args.file}: cannot read it: {getattr(exc, 'strerror', None) or exc}", EXIT_USAGE) from None
        type_ = args.type or ("workflow" if args.file.endswith((".yaml", ".yml")) else "interaction")
        status, out, _ = call_daemon(d, "POST", f"{base}/definitions",
                                     {"type": type_, "name": args.name or Path(args.file).stem, "source": source})
        if status == 422 and isinstance(out, dict) and any("line" in e for e in out.get("errors") or []):
            for e in out["errors"]:                 # a document's problems, each with its line, as `check` prints them
                print(f"{args.file}:{e.get('line')}: {e['field'] + ': ' if e.get('field') else ''}{e.get('message')}",
                      file=sys.stderr)
            return EXIT_REFUSED
    elif cmd == "run":
        input_ = _json_argument(args.input, "--input", """'{"owner": "ana"}'""")
        status, out, _ = call_daemon(d, "POST", f"{base}/runs", {"type": args.type, "name": args.name, "input": input_,
                                                                 **({"run_id": args.run_id} if args.run_id else {})})
    elif cmd == "get":
        status, out, _ = call_daemon(d, "GET", f"{base}/runs/{rid}")
    elif cmd == "wait":
        if args.timeout is not None and not 0 <= args.timeout < math.inf:
            raise CliError("--timeout is a number of seconds, 0 or more", EXIT_USAGE)
        return _wait_for_run(d, base, args.run_id, args.timeout)
    elif cmd == "cancel":
        status, out, _ = call_daemon(d, "POST", f"{base}/runs/{rid}/cancel")
    elif cmd == "answer":
        answer = _json_argument(args.answer, "the answer", """'{"decision": "publish"}'""")
        status, out, _ = call_daemon(d, "POST", f"{base}/runs/{rid}/answer", {"answer": answer})
    elif cmd == "inbox":
        status, out, _ = call_daemon(d, "GET", f"{base}/interactions", query={
            "to": args.to, "function": args.function, "limit": args.limit, "cursor": args.cursor})
        if status < 400:
            _print_list(args, out, ["RUN", "TO", "FUNCTION", "ASKED", "EXPIRES", "DELIVERY", "MESSAGE"], lambda r: [
                r["run_id"], _cell(r.get("to"), 24), r["name"], _when(r.get("asked_at")), _when(r.get("expires_at")),
                r.get("delivery_state") or "", _cell(r.get("message"))], "no open requests")
            return 0
    elif cmd == "runs":
        status, out, _ = call_daemon(d, "GET", f"{base}/runs", query={
            "status": args.status, "function": args.function, "limit": args.limit, "cursor": args.cursor})
        if status < 400:
            _print_list(args, out, ["RUN", "FUNCTION", "STATUS", "CREATED", "ENDED"], lambda r: [
                r["run_id"], f"{r['name']} v{r['version']}" + (" (workflow)" if r["type"] == "workflow" else ""),
                r["status"] + (f"/{r['kind']}" if r.get("kind") else ""), _when(r.get("created_at")),
                _when(r.get("ended_at"))], "no runs")
            return 0
    else:                                           # definitions
        if args.name:
            status, out, _ = call_daemon(d, "GET", f"{base}/definitions/{args.type or 'interaction'}/"
                                                   f"{urllib.parse.quote(args.name, safe='')}")
            if status < 400 and not args.json and sys.stdout.isatty():
                print(out["overview"])
                return 0
        else:
            status, out, _ = call_daemon(d, "GET", f"{base}/definitions", query={"type": args.type})
            if status < 400:
                _print_list(args, out, ["TYPE", "NAME", "VERSION", "DESCRIPTION"], lambda r: [
                    r["type"], r["name"], str(r["version"]), _cell(r.get("description"), 72)], "no definitions")
                return 0
    if _is_run(out):                                # run, get, cancel: the run, whatever its status
        _print_json(out)
        if cmd == "get" and (said := _answered_line(d, base, out)) is not None:
            print(said, file=sys.stderr)
        if cmd == "run" and status >= 400:
            print(f"interactiond: {_run_ending_line(out)}", file=sys.stderr)
            return EXIT_REFUSED
        return 0
    if status >= 400:
        if getattr(args, "json", False):
            _print_json(out)
        raise CliError(problem_line(status, out))
    _print_json(out)
    if cmd == "answer" and isinstance(out, dict) and "answered_at" in out:
        print(_answered_words(out.get("answered_by_name"), out.get("answered_by"), out["answered_at"]), file=sys.stderr)
    return 0


def _cli_deputy(args: Any, db: str, config: Config) -> int:
    """`deputy add|list|remove`: the running daemon's deputies (their windows are on its clock)."""
    if not PLAYBOOK_RE.fullmatch(args.playbook):
        raise CliError(f"--playbook is ORG/NAME in lowercase letters, digits and hyphens, not {args.playbook!r}",
                       EXIT_USAGE)
    org, _, name = args.playbook.partition("/")
    path = f"/v1/orgs/{org}/playbooks/{name}/deputies"
    d = daemon_address(args, db, config)
    if args.deputy_cmd == "add":
        body = {"for": args.for_, "to": args.to, "from": args.from_, "until": args.until}
        status, out, _ = call_daemon(d, "POST", path, {k: v for k, v in body.items() if v is not None})
    elif args.deputy_cmd == "remove":
        status, out, _ = call_daemon(d, "DELETE", f"{path}/{urllib.parse.quote(args.id, safe='')}")
    else:
        status, out, _ = call_daemon(d, "GET", path)
    if status >= 400:
        raise CliError(problem_line(status, out))

    def line(dep: dict[str, Any]) -> str:
        window = f"from {dep['from'] or 'its making'} until {dep['until'] or 'removed'}"
        return f"{dep['id']}  {dep['to']} for {dep['for']}  {window}  ({'open' if dep['open'] else 'closed'} now)"
    if args.deputy_cmd == "list":
        for dep in out["data"]:
            print(line(dep))
        if not out["data"]:
            print(f"no deputies in {args.playbook}", file=sys.stderr)
    else:
        print(line(out))
        if args.deputy_cmd == "remove":
            print("removed", file=sys.stderr)
    return 0


def _cli_link(args: Any, db: str, config: Config) -> int:
    """`link`: a one-time sign-in link, made by the running daemon (its clock, its public_url), else
    written straight to the database when no daemon answers."""
    if not PLAYBOOK_RE.fullmatch(args.playbook):
        raise CliError(f"--playbook is ORG/NAME in lowercase letters, digits and hyphens, not {args.playbook!r}",
                       EXIT_USAGE)
    try:
        person = person_name(args.for_) if args.for_ is not None else None
        lasts = parse_duration(args.expires)
        if not EXPIRES_MIN <= lasts <= LOGIN_LINK_MAX:
            raise ValueError(f"--expires is from PT1M to P{LOGIN_LINK_MAX.days}D")
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    d = daemon_address(args, db, config)
    org, _, name = args.playbook.partition("/")
    body = {"for": person, "expires": args.expires}
    url: str | None = None
    if args.url or _beside(db, ".url").exists():
        try:
            status, out, _ = call_daemon(d, "POST", f"/v1/orgs/{org}/playbooks/{name}/links", body)
        except CliError as exc:
            if args.url or exc.code != EXIT_UNREACHABLE:
                raise
            status, out = 0, None               # a daemon that stopped: the database itself
        if status >= 400:
            raise CliError(problem_line(status, out))
        if status:
            url, expires_at = out["url"], out["expires_at"]
    if url is None:
        if args.playbook not in config.playbooks:
            raise CliError(f"no playbook {args.playbook} in the configuration", EXIT_USAGE)
        tx = open_sync(db)
        try:
            now = WALL.now_ms()
            ends = now + int(lasts.total_seconds() * 1000)
            _, secret = create_token(tx, Role.WRITER.value if person else Role.OPERATOR.value,
                                     args.playbook if person else None, login_link_name(person), purpose="login",
                                     now=now, person=person, expires_at=ends)
        finally:
            tx.close()
        url, expires_at = f"{config.links_base}/login?token={secret}", fmt_time(ends)
    print(url)
    whose = f"{person}'s, in {args.playbook}" if person else "an operator's"
    print(f"interactiond: a one-time sign-in link ({whose}), until {expires_at}", file=sys.stderr)
    return 0


def _cli_token(args: Any, db: str) -> int:
    tx = open_sync(db)
    try:
        if args.token_cmd == "create":
            try:
                playbook = args.playbook or (DEFAULT_PLAYBOOK if args.for_ is not None else None)
                token_id, secret = create_token(tx, args.role, playbook, args.name, person=args.for_)
            except ValueError as exc:
                print(f"interactiond: {exc}", file=sys.stderr)
                return 2
            print(f"{token_id} {secret}")
        elif args.token_cmd == "list":
            # API tokens and inbox sessions (a session's state on this machine's clock; the daemon's
            # own clock decides); login links are one-time and not listed.
            now = WALL.now_ms()
            idle_ms = int(INBOX_SESSION_IDLE.total_seconds() * 1000)
            for r in tx.listed_tokens():
                state = "revoked" if r["revoked_at"] else "expired" if session_ended(r, now) else "active"
                name = (r["name"] or "") + (f" (for {r['person']})" if r["person"] else "")
                line = f"{r['id']}\t{r['role']}\t{r['playbook'] or '*'}\t{state}\t{name}"
                if r["purpose"] == "session":
                    ends = min(r["expires_at"], r["used_at"] + idle_ms)
                    line += f"\tsession, signed in {fmt_time(r['created_at'])}, last used {fmt_time(r['used_at'])}," \
                            f" ends {fmt_time(ends)} at the latest"
                print(line)
        else:
            if not tx.revoke_token(args.id, WALL.now_ms()):
                print(f"interactiond: no active token {args.id}", file=sys.stderr)
                return 1
            print(f"revoked {args.id}")
        return 0
    finally:
        tx.close()


# -- copy: a whole database into an empty one -------------------------------------------------------

#: Rows a copy reads and writes at a time.
COPY_BATCH: Final = 1000


def _cli_copy(args: Any) -> int:
    """`copy --from DB --to DB`: every table of COPIED_TABLES, read in one snapshot of the source and
    written in one transaction on the target (a failure leaves the target as empty as it was). A
    line per table on a terminal, a JSON summary when piped or with --json."""
    shown_from, shown_to = db_shown(args.source), db_shown(args.target)
    if os.path.abspath(args.source) == os.path.abspath(args.target):
        raise CliError("--from and --to name the same database", EXIT_USAGE)
    tty = sys.stdout.isatty() and not args.json
    began = time.monotonic()
    try:
        source = open_copy_source(args.source)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    counts: dict[str, int] = {}
    try:
        target = open_sync(args.target)
    except BaseException:
        source.close()
        raise
    errors = (*source.errors, *target.errors)
    try:
        source.begin_snapshot()
        target.begin()
        try:
            held = {t: n for t in COPIED_TABLES if (n := target.count_rows(t))}
            if held:
                raise CliError(f"{shown_to} is not empty ({', '.join(f'{t}: {n}' for t, n in held.items())});"
                               " copy only into a new database")
            if tty:
                print(f"copying {shown_from} into {shown_to}", flush=True)
            for table in COPIED_TABLES:
                have = set(target.table_columns(table))
                columns = source.table_columns(table)
                missing = [c for c in columns if c not in have and (table, c) not in COPY_DROPPABLE]
                if missing:
                    raise CliError(f"{shown_to} has no column {table}.{missing[0]}: it was made by another version")
                columns = [c for c in columns if c in have]
                total, done = source.count_rows(table), 0
                for rows in source.table_rows(table, columns, COPY_BATCH):
                    target.insert_rows(table, columns, rows)
                    done += len(rows)
                    if tty:
                        print(f"\r  {table:<13} {done:>11,} of {total:,} rows", end="", flush=True)
                counts[table] = done
                if tty:
                    print(f"\r  {table:<13} {done:>11,} rows" + " " * (len(f"{total:,}") + 4), flush=True)
            target.after_copy()
            target.end()
        except BaseException:
            with contextlib.suppress(*errors):
                target.end(commit=False)
            raise
    except errors as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CliError(f"the copy failed ({first}); nothing was written to {shown_to}") from None
    finally:
        with contextlib.suppress(*errors):
            source.end(commit=False)
        source.close()
        target.close()
    seconds = time.monotonic() - began
    if tty:
        print(f"copied {sum(counts.values()):,} rows in {seconds:.1f} s; start the daemon on {shown_to}")
    else:
        _print_json({"from": shown_from, "to": shown_to, "tables": counts, "rows": sum(counts.values()),
                     "seconds": round(seconds, 3)})
    return 0


# -- logs: no token, link, cookie or session id in a line ------------------------------------------
#
# aiohttp's bad-request log quotes the request line and headers it could not parse (a login
# link's `?token=`, a bearer token, the session cookie); the MCP SDK logs session ids. A filter on
# the root handler (and on those loggers) rewrites each record before it is written, and the SDK's
# chatty loggers only speak from WARNING up.

#: A name and its value: `name=v`, `name: v`, `'name': 'v'`, `(b'name', b'v'`.
_SEP: Final = r"""([ \t]*[:=][ \t]*['"]?|['"][ \t]*[:,][ \t]*b?['"])"""
_REDACT: Final = (
    (re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]+"), r"\1\2[redacted]"),
    (re.compile(r"(?i)\b(authorization|proxy-authorization|cookie|set-cookie)" + _SEP + r"[^\r\n'\"]+"),
     r"\1\2[redacted]"),
    (re.compile(r"(?i)\b(token|session_id|mcp-session-id|interactiond_session)" + _SEP + r"[A-Za-z0-9_.~%-]+"),
     r"\1\2[redacted]"),
    (re.compile(r"\bitd_[A-Za-z0-9_-]+"), "itd_[redacted]"),
    (re.compile(r"/a/(int_[0-9A-Za-z]{1,64})\.[A-Za-z0-9_-]+"), r"/a/\1.[redacted]"),       # an answer link
    (re.compile(r"(?i)\b[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}\b"), "[session id]"),
)
#: Loggers that speak of each request or session at INFO; quiet below WARNING.
QUIET_LOGGERS: Final = ("mcp", "httpx2", "sse_starlette")


def redact(text: str) -> str:
    """`text` with tokens, `token=` values, Authorization and Cookie values and session ids taken out."""
    for pattern, replacement in _REDACT:
        text = pattern.sub(replacement, text)
    return text


class RedactingFilter(logging.Filter):
    """Rewrites a record's message, traceback and stack with `redact` (it never drops a record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            message = str(record.msg)
        record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def install_log_redaction() -> None:
    """Put the redacting filter on every root handler and the loggers that quote requests; quiet the SDK."""
    redacting = RedactingFilter()
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(redacting)
    for name in ("aiohttp.server", "aiohttp.access", "aiohttp.web", "aiohttp.client", *QUIET_LOGGERS):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactingFilter) for f in logger.filters):
            logger.addFilter(redacting)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


class BadRequestFilter(logging.Filter):
    """aiohttp logs a request it cannot parse (a bad request line, a bad header) with the parser's
    traceback, several lines a request: one line instead, at WARNING (the client's mistake), saying
    what was wrong but not quoting what was sent."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            first = (str(exc.message).strip().splitlines() or [""])[0]
            reason = re.split(r"""\s*(?:bytearray\(|b'|b"|:$)""", first, maxsplit=1)[0].rstrip(" :")
            record.msg, record.args = f"{record.getMessage()}: {exc.code} {reason or type(exc).__name__}", None
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class JsonLogFormatter(logging.Formatter):
    """`--log-format json`: one JSON object a line (time, level, logger, message, and the id of the
    HTTP request the line comes from; the traceback as `exc`)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        request_id = getattr(record, "request_id", None)
        if request_id:
            line["request_id"] = request_id
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line["exc"] = record.exc_text
        return json.dumps(line, ensure_ascii=False)


class RequestIdFilter(logging.Filter):
    """Puts the id of the HTTP request being handled (if any) on each record as `request_id`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


def configure_logging(log_format: str = "text") -> None:
    """Log to stderr, as text (with the request id when there is one) or as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    if log_format == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(RequestIdTextFormatter("%(asctime)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, BadRequestFilter) for f in server_log.filters):
        server_log.addFilter(BadRequestFilter())
    install_log_redaction()


class RequestIdTextFormatter(logging.Formatter):
    """The text lines, ended by `request_id=...` when the line comes from an HTTP request."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        request_id = getattr(record, "request_id", None)
        return f"{text} request_id={request_id}" if request_id else text


# -- check --------------------------------------------------------------------------------------------

#: What `check` reads in a directory.
CHECKED_SUFFIXES: Final = (".md", ".yaml", ".yml")


def file_kind(path: Path, source: str) -> str:
    """What a file is read as: a `.yaml` whose keys are a configuration's (and not a workflow's
    `document` or `do`) is a configuration, any other `.yaml` a workflow, anything else a function
    document."""
    if path.suffix.lower() not in (".yaml", ".yml"):
        return "function document"
    import yaml
    try:
        raw = yaml.safe_load(source)
    except yaml.YAMLError:
        return "workflow"                       # its parser says where, with the line
    if isinstance(raw, dict) and not {"document", "do"} & set(raw) and set(raw) & set(CONFIG_KEYS):
        return "configuration"
    return "workflow"


def check_files(paths: list[str], out: Any = None) -> int:
    """`interactiond check`: each file (a directory: its .md and .yaml files) read as a function
    document, a workflow or a configuration; every problem on a line (`FILE:LINE: field: message`,
    or `FILE: key.path: message` for a configuration); 1 on any problem."""
    out = out or sys.stdout
    status = 0
    files: list[Path] = []
    for name in paths:
        p = Path(name)
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix.lower() in CHECKED_SUFFIXES and f.is_file())
            if not found:
                print(f"{p}: no .md or .yaml files in this directory", file=out)
                status = 1
            files += found
        else:
            files.append(p)
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            print(f"{path}: cannot read it: {getattr(exc, 'strerror', None) or exc}", file=out)
            status = 1
            continue
        kind = file_kind(path, source)
        problems: list[str] = []
        if kind == "configuration":
            try:
                load_config(str(path), environ={})
            except ConfigError as exc:
                problems = [p if p.startswith(str(path)) else f"{path}: {p}" for p in exc.problems]
        else:
            try:
                (parse_workflow if kind == "workflow" else parse_function)(source)
            except DocumentError as exc:
                problems = [f"{path}:{p['line']}: {p['field'] + ': ' if p['field'] else ''}{p['message']}"
                            for p in exc.problems]
        for line in problems:
            print(line, file=out)
        if problems:
            status = 1
            print(f"{path}: {len(problems)} problem{'s' if len(problems) > 1 else ''} (read as a {kind})", file=out)
        else:
            print(f"{path}: ok ({kind})", file=out)
    return status


# -- demo ---------------------------------------------------------------------------------------------

#: Where the examples are: beside the module in a checkout (or an editable install).
EXAMPLES_DIR: Final = Path(__file__).resolve().parent / "examples"


async def _demo(args: Any) -> int:
    """`interactiond demo`: a daemon on a fresh temporary database, the examples defined, the example
    chat server wired, two requests open (one in the inbox, one posted in the chat); it prints the
    page's link and three things to try. The directory goes when the demo stops."""
    import shutil
    import tempfile

    if not (EXAMPLES_DIR / "chat_server.py").is_file():
        print(f"interactiond: the demo needs the examples of the source tree ({EXAMPLES_DIR} is missing);"
              " install from a checkout with pip install -e .", file=sys.stderr)
        return 1
    where = Path(tempfile.mkdtemp(prefix="interactiond-demo-"))
    try:
        chat_db = where / "chat.db"
        config_path = where / "demo.yaml"
        config_path.write_text(dumps({
            "listen": {"host": "127.0.0.1", "port": args.port},
            "database": str(where / "interactiond.db"),
            "servers": {"chat": {"command": [sys.executable, str(EXAMPLES_DIR / "chat_server.py"), "serve",
                                             "--db", str(chat_db)],
                                 "tools": ["post_message", "thread_replies", "channel_history"]}},
            "playbooks": {DEFAULT_PLAYBOOK: {"servers": ["chat"]}}}) + "\n")
        config = load_config(str(config_path), environ={})
        args.db, args.host, args.clock, args.config = config.database, "127.0.0.1", "system", str(config_path)
        return await _serve(args, config, after_start=lambda engine, url: _demo_open(engine, where, chat_db))
    finally:
        shutil.rmtree(where, ignore_errors=True)


async def _demo_open(engine: Engine, where: Path, chat_db: Path) -> None:
    """Define the examples and open the demo's requests; then say what to try."""
    import shlex
    import shutil

    pb, me = DEFAULT_PLAYBOOK, OPERATOR_LOCAL
    for path in sorted(EXAMPLES_DIR.iterdir()):
        type_ = {".md": "interaction", ".yaml": "workflow"}.get(path.suffix)
        if type_ is None or file_kind(path, path.read_text(encoding="utf-8")) == "configuration":
            continue
        try:
            await engine.create_definition(me, pb, type_, path.stem, path.read_text(encoding="utf-8"))
        except Problem as exc:
            print(f"demo: {path.name} was not defined: {exc.detail}", flush=True)
    inbox, _ = await engine.run_definition(me, pb, "interaction", "approve-brief", {
        "editor": "ana", "title": "Q3 launch post", "draft": "We launch the new plans on Monday; prices stay as they are."})
    chat, _ = await engine.run_definition(me, pb, "interaction", "chat-approval", {
        "channel": "ops", "owner": "ana", "change": "Raise the cache size to 2 GB"})
    thread = None
    for _ in range(150):                    # the delivery is the timer task's: at most ~15 s
        items = (await engine.list_interactions(me, pb, function="chat-approval"))["data"]
        item = next((i for i in items if i["run_id"] == chat["run_id"]), None)
        if item is None or item["delivery_state"] in (DeliveryState.DELIVERED, DeliveryState.UNDELIVERED, DeliveryState.RETRYING):
            thread = (item or {}).get("conversation")
            break
        await asyncio.sleep(0.1)
    python = "python" if shutil.which("python") == sys.executable else shlex.quote(sys.executable)
    db = shlex.quote(str(where / "interactiond.db"))
    chat_server = shlex.quote(str(EXAMPLES_DIR / "chat_server.py"))
    ts = thread.rsplit("/", 1)[-1] if thread else "TS"
    posted = (f"posted in the chat's #ops channel, thread {ts}" if thread
              else "not posted yet (`interactiond inbox` shows its delivery)")
    print(f"""
demo: a fresh database in {where} (removed when the demo stops), every example defined, and the
example chat server wired to {pb}. Open now:
  - approve-brief asks ana to sign off a draft, in the inbox (run {inbox['run_id']})
  - chat-approval asks ana about a change in the chat: {posted} (run {chat['run_id']})

Three things to try:
  1. Open the inbox link above and answer approve-brief (publish or rework).
  2. Answer in the chat thread as ana, then see the run end:
       {python} {chat_server} say --db {shlex.quote(str(chat_db))} --channel ops --user ana --thread {ts} go looks safe
       interactiond wait {chat['run_id']} --db {db}
  3. Ask from the command line, and watch it arrive in the inbox:
       interactiond run interaction ask-approval --db {db} --input '{{"prompt": "Deploy?", "to": "ana"}}'
       interactiond inbox --db {db}

Stop the demo with Ctrl-C.""", flush=True)


# -- the parser ---------------------------------------------------------------------------------------

#: (command, one line that says what it does), in the order --help lists them.
COMMANDS: Final = (
    ("serve", "run the daemon: the HTTP API, MCP over HTTP, the inbox page and the timers"),
    ("stdio", "speak MCP over stdin/stdout for a local agent (a relay when serve runs on the same database)"),
    ("demo", "a daemon on a fresh temporary database with the examples and a few open requests, for workshops"),
    ("check", "check function documents, workflows and configuration files offline; exit 1 on any problem"),
    ("token", "create, list or revoke API tokens; list or end inbox sessions"),
    ("link", "print a one-time sign-in link to the inbox: a person's (--for NAME) or an operator's"),
    ("deputy", "add, list or remove deputies: who answers what is addressed to a person while they are away"),
    ("copy", "copy a whole database into an empty one: an SQLite file into PostgreSQL, or back"),
    ("define", "save a function document or a workflow from a file"),
    ("run", "start a run of a function or a workflow"),
    ("get", "show a run as it stands"),
    ("wait", "wait for a run to end, showing that it waits, and print it"),
    ("cancel", "cancel a run that is still waiting"),
    ("inbox", "list the open requests (a table on a terminal, JSON when piped or with --json)"),
    ("answer", "answer a run's open request"),
    ("runs", "list runs, newest first (a table on a terminal, JSON when piped or with --json)"),
    ("definitions", "list the playbook's definitions, or show one"),
)
CLIENT_COMMANDS: Final = ("define", "run", "get", "wait", "cancel", "inbox", "answer", "runs", "definitions")


def build_parser() -> Any:
    """The command line's parser: every command and option with its help, defaults shown."""
    import argparse

    class Help(argparse.RawDescriptionHelpFormatter):
        """Shows an option's default after its help, unless there is none or the help says it."""

        def _get_help_string(self, action: Any) -> str:
            text = action.help or ""
            if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text \
                    and (action.option_strings or action.nargs in ("?", "*")):
                text += " (default: %(default)s)"
            return text

    parser = argparse.ArgumentParser(
        prog="interactiond", formatter_class=Help, description=__doc__.splitlines()[0],
        epilog="environment: INTERACTIOND_DB, INTERACTIOND_CONFIG, INTERACTIOND_TOKEN, "
               "INTERACTION_OPEN_REQUESTS\n\n" + EXIT_CODES)
    parser.add_argument("--version", action="version", version=__version__, help="print the version and stop")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    helps = dict(COMMANDS)

    def command(name: str) -> Any:
        p = sub.add_parser(name, help=helps[name], description=helps[name] + ".", formatter_class=Help,
                           epilog=EXIT_CODES)
        p.add_argument("--db", metavar="PATH", help="the SQLite file, or a PostgreSQL database as postgresql://USER@HOST/NAME"
                                                    " (env: INTERACTIOND_DB; else the configuration's database:, else"
                                                    " ./interactiond.db)")
        p.add_argument("--config", metavar="PATH", help="the operator configuration, YAML (env: INTERACTIOND_CONFIG)")
        return p

    def logs(p: Any) -> None:
        p.add_argument("--log-format", choices=["text", "json"], default="text",
                       help="json: one JSON object a line, with the HTTP request's id")
        p.add_argument("--access-log", action="store_true", help="log a line per HTTP request (costs throughput)")

    p = command("serve")
    p.add_argument("--host", help="the address to listen on (default: the configuration's listen.host, else"
                                  " 127.0.0.1)")
    p.add_argument("--port", type=int, help="the port (default: the configuration's listen.port, else 8765;"
                                            " 0 picks a free one)")
    p.add_argument("--clock", choices=["system", "manual"], default="system",
                   help="manual: time moves only through POST /v1/admin/clock (tests and demos; needs --host"
                        " 127.0.0.1)")
    logs(p)
    p = command("stdio")
    p.add_argument("--playbook", metavar="ORG/NAME", help="scope the connection to one playbook (default: every"
                                                          " playbook, named in each call)")
    p.add_argument("--http", type=int, metavar="PORT", help="also serve the HTTP API and the inbox page on this"
                                                            " port of 127.0.0.1 (0 picks a free one)")
    p.add_argument("--as", dest="as_", metavar="PERSON", help="the person at this client (as requests name them):"
                                                              " wait_run asks them here, in the client, the"
                                                              " questions addressed to them (default: the"
                                                              " configuration's mcp.as)")
    logs(p)
    p = command("demo")
    p.add_argument("--port", type=int, default=8765, help="the port (0 picks a free one)")
    logs(p)
    p = command("check")
    p.add_argument("files", nargs="+", metavar="FILE", help="a function document (.md), a workflow or a"
                                                            " configuration (.yaml), or a directory of them")
    p = command("token")
    tsub = p.add_subparsers(dest="token_cmd", required=True, metavar="ACTION")
    for name, text in (("create", "make a token and print it once (only its hash is kept)"),
                       ("list", "list tokens and inbox sessions (never their secrets)"),
                       ("revoke", "revoke a token, or end an inbox session, by its id")):
        t = tsub.add_parser(name, help=text, description=text + ".", formatter_class=Help)
        t.add_argument("--db", metavar="PATH", help="the SQLite file (env: INTERACTIOND_DB; else the"
                                                    " configuration's database:, else ./interactiond.db)")
        t.add_argument("--config", metavar="PATH", help="the operator configuration, YAML (env: INTERACTIOND_CONFIG)")
        if name == "create":
            t.add_argument("--playbook", metavar="ORG/NAME", help="bind the token to one playbook (default: every"
                                                                  " playbook; an operator is always global)")
            t.add_argument("--role", required=True, choices=[r.value for r in Role],
                           help="reader: read; writer: also create, run, answer, cancel, execute; operator: "
                                "everything, in every playbook")
            t.add_argument("--name", help="a name to know the token by in `token list`")
            t.add_argument("--for", dest="for_", metavar="PERSON",
                           help="a person's token: it sees and answers only the requests addressed to PERSON"
                                " (their `to`), and answers as PERSON (default playbook: local/default)")
        elif name == "revoke":
            t.add_argument("id", help="the token's or the session's id (tok_...), as `token list` shows it")
    p = command("deputy")
    dsub = p.add_subparsers(dest="deputy_cmd", required=True, metavar="ACTION")
    for name, text in (("add", "add a deputy: --to answers what is addressed to --for while the window is open"),
                       ("list", "list the playbook's deputies, and whether each window is open now"),
                       ("remove", "remove a deputy by its id")):
        t = dsub.add_parser(name, help=text, description=text + " (on the running daemon's clock).",
                            formatter_class=Help, epilog=EXIT_CODES)
        t.add_argument("--db", metavar="PATH", help="the database the daemon serves (its URL and token are beside it)")
        t.add_argument("--config", metavar="PATH", help="the operator configuration, YAML (env: INTERACTIOND_CONFIG)")
        t.add_argument("--playbook", metavar="ORG/NAME", default=DEFAULT_PLAYBOOK, help="the playbook")
        t.add_argument("--url", help="the daemon's URL (default: the one serve wrote beside the database)")
        t.add_argument("--token", help="an operator token (env: INTERACTIOND_TOKEN; default: the one serve wrote"
                                       " beside the database)")
        if name == "add":
            t.add_argument("--for", dest="for_", metavar="PERSON", required=True, help="the person who is away")
            t.add_argument("--to", metavar="PERSON", required=True, help="the person who answers for them")
            t.add_argument("--from", dest="from_", metavar="TIME", help="RFC 3339, e.g. 2026-12-02T09:00:00Z"
                                                                      " (default: now)")
            t.add_argument("--until", metavar="TIME", help="RFC 3339 (default: until removed)")
        elif name == "remove":
            t.add_argument("id", help="the deputy's id (dep_...), as `deputy list` shows it")
    p = command("link")
    p.add_argument("--for", dest="for_", metavar="PERSON",
                   help="the person the link signs in: they see and answer only the requests addressed to them"
                        " (default: an operator's link, which sees everything)")
    p.add_argument("--playbook", metavar="ORG/NAME", default=DEFAULT_PLAYBOOK, help="the person's playbook")
    p.add_argument("--expires", metavar="DURATION", default="P7D",
                   help="how long the link works if nobody opens it, ISO 8601, PT1M to P30D")
    p.add_argument("--url", help="the daemon's URL (default: the one serve wrote beside the database; with none,"
                                 " the link is written to the database itself)")
    p.add_argument("--token", help="an operator token (env: INTERACTIOND_TOKEN; default: the one serve wrote"
                                   " beside the database)")

    p = sub.add_parser("copy", help=helps["copy"], formatter_class=Help, epilog=EXIT_CODES,
                       description=helps["copy"] + ": definitions with their versions, runs, requests, events,"
                       " timers, tokens and sessions, in one transaction on the target. Stop the daemons of"
                       " the source first: what they write after the copy began stays behind.")
    p.add_argument("--from", dest="source", required=True, metavar="DB",
                   help="the database to copy: an SQLite file, or postgresql://USER@HOST/NAME")
    p.add_argument("--to", dest="target", required=True, metavar="DB",
                   help="an empty database (its schema is applied first): postgresql://USER@HOST/NAME, or an SQLite file")
    p.add_argument("--json", action="store_true", help="print the JSON summary on a terminal too (it is printed"
                                                       " when piped; a terminal gets a line per table)")
    for name in CLIENT_COMMANDS:
        p = command(name)
        p.add_argument("--url", help="the daemon's URL (default: the one serve wrote beside the database, else the"
                                     " configuration's listen address)")
        p.add_argument("--token", help="an API token (env: INTERACTIOND_TOKEN; default: the operator token serve"
                                       " wrote beside the database)")
        p.add_argument("--playbook", metavar="ORG/NAME", default=DEFAULT_PLAYBOOK, help="the playbook")
        p.add_argument("--json", action="store_true", help="print JSON: lists print a table on a terminal without"
                                                           " it; a refusal prints its problem object too")
        if name == "define":
            p.add_argument("file", help="a function document (.md) or a workflow (.yaml)")
            p.add_argument("--name", help="the definition's name (default: the file's name without its extension)")
            p.add_argument("--type", choices=["interaction", "workflow"],
                           help="what the file holds (default: workflow for .yaml/.yml, else interaction)")
        elif name == "run":
            p.add_argument("type", choices=["interaction", "workflow"], help="what to run: a function or a workflow")
            p.add_argument("name", help="the definition's name")
            p.add_argument("--input", default="{}", metavar="JSON", help="the run's input, a JSON object")
            p.add_argument("--run-id", help="an id of your choosing (1 to 128 of A-Z a-z 0-9 _ . : -): running"
                                            " again under it returns the same run (default: a new id)")
        elif name in ("get", "wait", "cancel", "answer"):
            p.add_argument("run_id", help="the run's id (run_...)")
            if name == "wait":
                p.add_argument("--timeout", type=float, metavar="SECONDS",
                               help="give up after this long, exit 4 (default: wait until the run ends)")
            if name == "answer":
                p.add_argument("answer", metavar="JSON", help="the answer, a JSON value that matches the request's"
                                                              """ answer schema, e.g. '{"decision": "publish"}'""")
        elif name in ("inbox", "runs"):
            if name == "inbox":
                p.add_argument("--to", help="only the requests addressed to this party")
            else:
                p.add_argument("--status", choices=[s.value for s in RunStatus], help="only runs in this status")
            p.add_argument("--function", metavar="NAME", help="only those of this function or workflow")
            p.add_argument("--limit", type=int, default=DEFAULT_PAGE, help=f"how many, 1 to {MAX_PAGE}")
            p.add_argument("--cursor", help="the next page, as the last listing gave it")
        else:                                   # definitions
            p.add_argument("name", nargs="?", help="show this definition (its overview on a terminal)")
            p.add_argument("--type", choices=["interaction", "workflow"],
                           help="only this type (with a name: default interaction)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line: every failure a user can meet is one line on stderr and an exit code."""
    args = build_parser().parse_args(argv)
    configure_logging(getattr(args, "log_format", "text"))
    try:
        if args.cmd == "check":
            return check_files(args.files)
        if args.cmd == "demo":
            return asyncio.run(_demo(args))
        if args.cmd == "copy":
            return _cli_copy(args)
        try:
            config = load_config(args.config or os.environ.get("INTERACTIOND_CONFIG"))
        except ConfigError as exc:
            for problem in exc.problems:
                print(f"interactiond: configuration: {problem}", file=sys.stderr)
            return EXIT_USAGE
        # The database: --db, else INTERACTIOND_DB, else the configuration's `database:` (default ./interactiond.db).
        db = args.db or os.environ.get("INTERACTIOND_DB") or config.database
        if args.cmd == "token":
            return _cli_token(args, db)
        if args.cmd == "link":
            return _cli_link(args, db, config)
        if args.cmd == "deputy":
            return _cli_deputy(args, db, config)
        if args.cmd in CLIENT_COMMANDS:
            return _cli_client(args, db, config)
        if args.cmd == "stdio":
            return run_loop(_stdio(args, config))
        code = run_loop(_serve(args, config))
        # Everything is closed: the collector need not walk every object once more on the way out
        # (half a second of a stop's 2 s).
        gc.freeze()
        return code
    except CliError as exc:
        print(f"interactiond: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("interactiond: interrupted", file=sys.stderr)
        return 130
    except (OSError, *STORE_ERRORS) as exc:         # a file or the database, as the system said it
        print(f"interactiond: {getattr(exc, 'filename', None) or 'the database'}: "
              f"{getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
