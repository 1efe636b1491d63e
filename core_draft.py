# Draft of the store/engine/HTTP sections; merged into interactiond.py once the document layer lands.
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import heapq
import logging
import queue
import signal
import sqlite3
import urllib.error
import urllib.request
from collections import OrderedDict
from pathlib import Path

from aiohttp import web

import interactiond as _I
globals().update({k: v for k, v in vars(_I).items() if not k.startswith("__")})
__version__ = _I.__version__
from interactiond import Iterable, Any, Callable, Final, dataclass, field, enum, json, os, re, sys, threading, time

log = logging.getLogger("interactiond")


# Store ##########################################################################################
#
# One SQLite file in WAL mode, two connections, each owned by its own thread: the writer and a
# reader. Asyncio code hands the writer a whole *change* - a plain function of the connection -
# and awaits its commit; the writer takes every change waiting in its queue, runs each inside its
# own SAVEPOINT of one `BEGIN IMMEDIATE` transaction, commits once, and only then answers each
# caller. So sixteen concurrent answers cost one fsync and one thread hop each, and one change that
# raises rolls back alone. A change never awaits anything: no transaction is ever held across a
# tool call or a network round trip.
#
# What a change means for the in-memory side (timers to arm, waiters to wake, stream events to
# publish) is collected in its `Effects` and applied on the event loop right after the commit,
# whether or not the caller is still there to see its result.

SCHEMA_VERSION: Final = 1


def _schema_sql() -> str:
    here = Path(__file__).with_name("schema.sql")
    try:
        return here.read_text()
    except OSError:
        return SCHEMA_SQL


class Effects:
    """What a committed change asks of the in-memory side, applied after the commit."""

    __slots__ = ("timers", "untimers", "wakes", "published", "later")

    def __init__(self) -> None:
        self.timers: list[tuple[str, int]] = []
        self.untimers: list[str] = []
        self.wakes: list[tuple[str, str]] = []
        self.published: list[dict[str, Any]] = []
        self.later: list[Callable[[], Any]] = []


def _connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=5.0)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=5000")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA temp_store=MEMORY")
    return conn


class _DbThread(threading.Thread):
    """A thread that owns one connection and runs functions of it, in batches when it writes."""

    def __init__(self, path: str, loop: asyncio.AbstractEventLoop, *, writer: bool,
                 sink: Callable[[Effects], None] | None = None) -> None:
        super().__init__(name="interactiond-writer" if writer else "interactiond-reader", daemon=True)
        self.path = path
        self.sink = sink
        self.loop = loop
        self.writer = writer
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.ready = threading.Event()
        self.conn: sqlite3.Connection | None = None
        self.start_error: BaseException | None = None

    def run(self) -> None:
        try:
            self.conn = _connect(self.path)
        except BaseException as exc:  # reported by Store.open
            self.start_error = exc
            self.ready.set()
            return
        self.ready.set()
        while True:
            item = self.q.get()
            if item is None:
                break
            batch = [item]
            while len(batch) < 512:
                try:
                    nxt = self.q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.q.put(None)
                    break
                batch.append(nxt)
            settled = self._run_batch(batch) if self.writer else [self._run_read(*it) for it in batch]
            self.loop.call_soon_threadsafe(_settle_all, settled, self.sink)
        self.conn.close()

    def _run_read(self, fn: Callable[..., Any], fut: asyncio.Future[Any], fx: None) -> tuple[Any, ...]:
        try:
            return (fut, fn(self.conn), None, None)
        except BaseException as exc:
            return (fut, None, exc, None)

    def _run_batch(self, batch: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        conn = self.conn
        out: list[tuple[Any, ...]] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
        except BaseException as exc:
            return [(fut, None, exc, None) for _, fut, _ in batch]
        for fn, fut, fx in batch:
            try:
                conn.execute("SAVEPOINT change")
            except BaseException as exc:
                out.append((fut, None, exc, None))
                continue
            try:
                result = fn(conn, fx)
            except BaseException as exc:
                try:
                    conn.execute("ROLLBACK TO change")
                    conn.execute("RELEASE change")
                except sqlite3.Error:
                    pass
                out.append((fut, None, exc, None))
            else:
                conn.execute("RELEASE change")
                out.append((fut, result, None, fx))
        try:
            conn.execute("COMMIT")
        except BaseException as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            failure = Problem("failed", f"the database refused the write: {exc}")
            return [(fut, None, failure, None) for fut, *_ in out]
        return out


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


class Store:
    """The SQLite file: the schema, one writer thread with group commit, one reader thread."""

    def __init__(self, path: str, on_commit: Callable[[Effects], None] | None = None) -> None:
        self.path = path
        self.on_commit = on_commit
        self._writer: _DbThread | None = None
        self._reader: _DbThread | None = None

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        init = _connect(self.path)
        try:
            init.executescript(_schema_sql())
            if init.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                init.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        finally:
            init.close()
        self._writer = _DbThread(self.path, loop, writer=True, sink=lambda fx: self.on_commit and self.on_commit(fx))
        self._reader = _DbThread(self.path, loop, writer=False)
        for t in (self._writer, self._reader):
            t.start()
            t.ready.wait()
            if t.start_error:
                raise t.start_error

    async def close(self) -> None:
        for t in (self._writer, self._reader):
            if t is not None and t.is_alive():
                t.q.put(None)
        for t in (self._writer, self._reader):
            if t is not None:
                await asyncio.get_running_loop().run_in_executor(None, t.join, 5.0)
        self._writer = self._reader = None

    def write(self, change: Callable[[sqlite3.Connection, Effects], Any]) -> asyncio.Future[Any]:
        """Run `change(conn, effects)` in the next group commit; resolves after COMMIT."""
        fut = asyncio.get_running_loop().create_future()
        self._writer.q.put((change, fut, Effects()))
        return fut

    def read(self, query: Callable[[sqlite3.Connection], Any]) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        self._reader.q.put((query, fut, None))
        return fut

    def read_sync(self, query: Callable[[sqlite3.Connection], Any]) -> Any:
        """For the command line and start-up, outside the loop."""
        conn = _connect(self.path)
        try:
            return query(conn)
        finally:
            conn.close()


def open_sync(path: str) -> sqlite3.Connection:
    """A connection with the schema applied, for the command line (token, check) and tests."""
    conn = _connect(path)
    conn.executescript(_schema_sql())
    if conn.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    return conn


def append_event(conn: sqlite3.Connection, fx: Effects | None, playbook: str, run_id: str | None, type_: str,
                 at: int, by: str | None, payload: dict[str, Any]) -> int:
    """Append one event; run events also take the next run_seq. Returns the event id."""
    text = dumps(payload)
    run_seq = None
    if run_id is not None:
        run_seq = conn.execute("UPDATE runs SET events = events + 1 WHERE playbook = ? AND run_id = ? RETURNING events",
                               (playbook, run_id)).fetchone()[0]
    cur = conn.execute(
        "INSERT INTO events (playbook, run_id, run_seq, type, at, by, payload, size) VALUES (?,?,?,?,?,?,?,?)",
        (playbook, run_id, run_seq, type_, at, by, text, len(text.encode())))
    event_id = cur.lastrowid
    if fx is not None:
        fx.published.append({"id": event_id, "playbook": playbook, "run_id": run_id, "type": type_, "at": at,
                             "payload": payload})
    return event_id


# Tool servers ###################################################################################
#
# interactiond is also an MCP client of the tool servers its operator configures. Each server has
# one `ToolSession`: opened lazily on first use, shared by every run, reopened after it breaks. The
# SDK's client holds anyio task groups that must be exited by the task that entered them, so one
# *owner task* per server enters `async with Client(...)` and waits; any task may call through the
# live client meanwhile. Every failure is flattened out of exception groups and classified once,
# here, into a `ToolFailure` whose `because` the engine records (see the table in TECH-NOTES 3).
# Nothing here touches the database: the engine records before it sends and after it hears back.

import anyio
import httpx2
from mcp import Client as _McpClient, MCPError, StdioServerParameters
from mcp.client.sse import sse_client as _sse_client
from mcp.client.streamable_http import streamable_http_client as _streamable_client

_CONNECTION_ERRORS: Final = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream,
                             httpx2.TransportError, ConnectionError, OSError, EOFError)


class ToolFailure(Exception):
    """A tool server failed us. `sent` tells whether the call may have reached the tool."""

    def __init__(self, because: str, message: str, *, sent: bool, retry_after_ms: int | None = None) -> None:
        self.because = because            # server_failure | timed_out | arguments_refused | not_offered
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
                return max(0, int((parsedate_to_datetime(value).timestamp() - time.time()) * 1000))
    return None


def classify_failure(exc: BaseException, *, sent: bool) -> ToolFailure:
    """One name for every way a tool server can fail."""
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
    for leaf in leaf_errors(exc):
        if isinstance(leaf, MCPError):
            if leaf.code == -32000 or (leaf.code == -32600 and "Session not found" in leaf.message):
                return True
        elif isinstance(leaf, _CONNECTION_ERRORS):
            return True
    return False


def result_meta(result: Any) -> dict[str, Any]:
    return dict(result.meta or {}) if getattr(result, "meta", None) else {}


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

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.tools: dict[str, Any] = {}
        self._client: Any = None
        self._owner: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._lock = asyncio.Lock()

    def _transport(self, stack: contextlib.AsyncExitStack) -> Any:
        c = self.config
        if c.transport == "stdio":
            env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV")}
            env.update(c.env)
            return StdioServerParameters(command=c.command[0], args=list(c.command[1:]), env=env)
        if c.transport == "sse":
            return _sse_client(c.url, headers=c.headers, timeout=OPEN_TIMEOUT_S)
        return None

    async def _hold(self, ready: asyncio.Future[Any]) -> None:
        try:
            async with contextlib.AsyncExitStack() as stack:
                transport = self._transport(stack)
                if transport is None:
                    http = await stack.enter_async_context(httpx2.AsyncClient(
                        headers=self.config.headers, follow_redirects=True,
                        timeout=httpx2.Timeout(CALL_TIMEOUT_S + 5, connect=OPEN_TIMEOUT_S)))
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
                log.warning("tool server %s: session ended: %r", self.config.name, exc)
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
                tools.update({t.name: t for t in page.tools})
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
                    raise classify_failure(exc, sent=False) from None
            return self._client

    def read_only(self, tool: str) -> bool:
        t = self.tools.get(tool)
        return bool(t is not None and t.annotations is not None and t.annotations.read_only_hint)

    async def call(self, tool: str, arguments: dict[str, Any], timeout: float = CALL_TIMEOUT_S) -> Any:
        """Call once; a broken session is dropped so the next use reopens it. Never re-sends."""
        client = await self.ensure()
        try:
            return await asyncio.wait_for(client.call_tool(tool, arguments, read_timeout_seconds=timeout),
                                          timeout + 1)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if _is_connection_error(exc):
                await self.close()
            raise classify_failure(exc, sent=True) from None

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


_SECRET_KEY_RE: Final = re.compile(r"pass(word)?|secret|token|api[_-]?key|authorization|credential", re.I)
_TOKEN_RE: Final = re.compile(r"itd_[A-Za-z0-9_-]{20,}")
SCRUBBED: Final = "[scrubbed]"


class Scrubber:
    """Removes secrets from anything recorded: configured env/header values, API tokens, and the
    values of keys named like password, secret, token, api_key or authorization."""

    def __init__(self, secrets_: Iterable[str]) -> None:
        values = sorted({v for v in secrets_ if isinstance(v, str) and len(v) >= 4}, key=len, reverse=True)
        self._re = re.compile("|".join(re.escape(v) for v in values)) if values else None

    def text(self, value: str) -> str:
        if self._re is not None:
            value = self._re.sub(SCRUBBED, value)
        return _TOKEN_RE.sub(SCRUBBED, value)

    def __call__(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self(v) for v in value]
        if isinstance(value, dict):
            return {k: (SCRUBBED if isinstance(k, str) and _SECRET_KEY_RE.search(k) and isinstance(v, (str, int, float))
                        else self(v)) for k, v in value.items()}
        return value


class ToolServers:
    """The operator's tool servers, which playbook may use which, and their sessions."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.sessions = {name: ToolSession(sc) for name, sc in config.servers.items()}
        self.scrub = Scrubber(v for sc in config.servers.values() for v in (*sc.env.values(), *sc.headers.values()))

    def offered(self, playbook: str, server: str, tool: str | None = None) -> bool:
        """May this playbook use this server (and the operator allow this tool)?"""
        if server not in self.config.playbooks.get(playbook, ()) or server not in self.sessions:
            return False
        allow = self.config.servers[server].tools
        return tool is None or allow is None or tool in allow

    def record(self, server: str, value: Any) -> Any:
        """What may be recorded of `value`: scrubbed, or only its size and digest."""
        if not self.config.servers[server].record_content:
            text = dumps(value)
            return {"size": len(text.encode()), "sha256": sha256_hex(text)}
        return self.scrub(value)

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.sessions.values()), return_exceptions=True)


# Engine #########################################################################################
#
# Theory of operation. Every operation of the product is one method of `Engine`; the HTTP routes
# and the MCP tools are thin adapters over them. A method does its pure work on the event loop
# (parse, validate, render), then hands the store ONE change that re-reads what it depends on,
# guards every transition in SQL (`UPDATE ... WHERE status = 'open'`), writes the rows and appends
# the events together. What the change means in memory - a timer to arm, a waiter to wake, an event
# to stream - is applied after the commit (see Effects).
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


@dataclass(frozen=True)
class Caller:
    """Who makes a call: a token's id, `stdio`, or `local`; what it may do and see."""

    id: str
    role: Role
    playbook: str | None = None          # bound to one playbook; None sees every one

    def sees(self, playbook: str) -> bool:
        return self.role is Role.OPERATOR or self.playbook is None or self.playbook == playbook

    def require(self, role: Role) -> None:
        if self.role.rank < role.rank:
            raise Problem("forbidden", f"this operation needs a {role.value} token; this one is a {self.role.value}")


OPERATOR_LOCAL: Final = Caller("local", Role.OPERATOR)


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


@dataclass(frozen=True)
class Config:
    host: str = "127.0.0.1"
    port: int = 8765
    database: str = "interactiond.db"
    open_requests: int = DEFAULT_OPEN_REQUESTS
    servers: dict[str, ServerConfig] = field(default_factory=dict)
    playbooks: dict[str, tuple[str, ...]] = field(default_factory=lambda: {DEFAULT_PLAYBOOK: ()})
    source: str | None = None


class ConfigError(Exception):
    """The configuration breaks a rule; each problem names its key path."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


def load_config(path: str | None, environ: dict[str, str] | None = None) -> Config:
    """Read the operator's YAML configuration; every problem is reported with its key path."""
    environ = os.environ if environ is None else environ
    raw: Any = {}
    if path:
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
    known = {"listen", "database", "open_requests", "servers", "playbooks"}
    problems += [f"{k}: unknown key (known: {', '.join(sorted(known))})" for k in raw if k not in known]
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
        problems.append("database: a file path")
    open_requests = raw.get("open_requests", DEFAULT_OPEN_REQUESTS)
    if "INTERACTION_OPEN_REQUESTS" in environ:
        try:
            open_requests = int(environ["INTERACTION_OPEN_REQUESTS"])
        except ValueError:
            problems.append("INTERACTION_OPEN_REQUESTS: a whole number")
    if not isinstance(open_requests, int) or isinstance(open_requests, bool) or open_requests < 0:
        problems.append("open_requests: a whole number, 0 or more")
    servers: dict[str, ServerConfig] = {}
    raw_servers = raw.get("servers") or {}
    if not isinstance(raw_servers, dict):
        problems.append("servers: a mapping of server names to their settings")
        raw_servers = {}
    for name, s in raw_servers.items():
        where = f"servers.{name}"
        if not isinstance(name, str) or not SERVER_RE.fullmatch(name):
            problems.append(f"{where}: a server name is 1 to 32 lowercase letters, digits and hyphens, starting with a letter")
            continue
        if not isinstance(s, dict):
            problems.append(f"{where}: a mapping with command or url")
            continue
        allowed = {"command", "url", "transport", "env", "headers", "tools", "record_content"}
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
        servers[name] = ServerConfig(name, tuple(command) if isinstance(command, list) else None,
                                     url if isinstance(url, str) else None, transport, maps["env"], maps["headers"],
                                     tuple(tools) if tools is not None else None, bool(record))
    playbooks: dict[str, tuple[str, ...]] = {DEFAULT_PLAYBOOK: ()}
    raw_pbs = raw.get("playbooks") or {}
    if not isinstance(raw_pbs, dict):
        problems.append("playbooks: a mapping of ORG/NAME to their settings")
        raw_pbs = {}
    for pb, p in raw_pbs.items():
        where = f"playbooks.{pb}"
        if not isinstance(pb, str) or not PLAYBOOK_RE.fullmatch(pb):
            problems.append(f"{where}: a playbook is ORG/NAME in lowercase letters, digits and hyphens")
            continue
        p = p or {}
        if not isinstance(p, dict):
            problems.append(f"{where}: a mapping with servers")
            continue
        problems += [f"{where}.{k}: unknown key" for k in p if k != "servers"]
        names = p.get("servers") or []
        if not isinstance(names, list):
            problems.append(f"{where}.servers: a list of server names")
            names = []
        for i, n in enumerate(names):
            if n not in raw_servers:
                problems.append(f"{where}.servers[{i}]: {n!r} is not a server of this configuration")
        playbooks[pb] = tuple(n for n in names if isinstance(n, str))
    if problems:
        raise ConfigError(problems)
    return Config(host, port, database, open_requests, servers, playbooks, path)


def run_object(row: sqlite3.Row | dict[str, Any]) -> dict[str, Any]:
    """The run as every API shows it."""
    return {
        "run_id": row["run_id"], "playbook": row["playbook"], "type": row["type"], "name": row["name"],
        "version": row["version"], "status": row["status"], "kind": row["kind"],
        "input": json.loads(row["input"]),
        "output": json.loads(row["output"]) if row["output"] is not None else None,
        "problem": json.loads(row["problem"]) if row["problem"] is not None else None,
        "created_at": fmt_time(row["created_at"]), "ended_at": fmt_time(row["ended_at"]),
        "settled_by": row["settled_by"],
    }


def request_object(row: sqlite3.Row) -> dict[str, Any]:
    """An open request as list_interactions shows it."""
    return {
        "run_id": row["run_id"], "type": row["type"], "name": row["name"], "version": row["version"],
        "to": row["party"], "from": row["answerer"],
        "delivery": {"server": row["server"], "tool": row["tool"]} if row["server"] else None,
        "message": row["message"], "takes_answer": row["answer_schema"] is not None,
        "asked_at": fmt_time(row["asked_at"]), "expires_at": fmt_time(row["expires_at"]),
        "attempts": row["attempts"], "delivery_state": row["delivery_state"],
        "answer_schema": json.loads(row["answer_schema"]) if row["answer_schema"] is not None else None,
        "conversation": row["conversation"], "answerer": row["answerer"],
        "refused_replies": row["refused_replies"],
    }


def event_object(row: sqlite3.Row, *, whole: bool = False) -> dict[str, Any]:
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


def answer_fact(row: sqlite3.Row) -> dict[str, Any]:
    fact = {"run_id": row["run_id"], "answer_id": f"evt_{row['answer_id']}", "answer": json.loads(row["answer"]),
            "claimed_for": row["claimed_for"], "answered_by": row["answered_by"],
            "answered_at": fmt_time(row["answered_at"])}
    if row["reply_id"] is not None:
        fact["reply"] = {"id": row["reply_id"]}
    return fact


def _status_of(problem: Problem) -> RunStatus:
    """The run ending a problem stands for, by its HTTP status."""
    return {422: RunStatus.INVALID_INPUT, 409: RunStatus.CONFLICT, 503: RunStatus.UNAVAILABLE,
            410: RunStatus.REJECTED}.get(problem.status, RunStatus.FAILED)


def _page(data: list[Any], rows: list[Any], n: int, last: Callable[[], list[Any]]) -> dict[str, Any]:
    """A page of `data`; `rows` was fetched with one extra row to know whether more follow."""
    return {"data": data, "next_cursor": encode_cursor(last()) if len(rows) > n else None}


def _timer_key(kind: str, playbook: str, ref: str) -> str:
    return f"{kind}:{playbook}:{ref}"


def _set_timer(conn: sqlite3.Connection, fx: Effects, key: str, due: int) -> None:
    conn.execute("INSERT INTO timers (key, due_at) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET due_at = excluded.due_at",
                 (key, due))
    fx.timers.append((key, due))


def _drop_timer(conn: sqlite3.Connection, fx: Effects, key: str) -> None:
    conn.execute("DELETE FROM timers WHERE key = ?", (key,))
    fx.untimers.append(key)


def _end_run(conn: sqlite3.Connection, fx: Effects, playbook: str, run_id: str, status: RunStatus, *,
             now: int, by: str | None, kind: str | None = None, output: Any = None,
             problem: Problem | None = None) -> None:
    """Write a run's ending and its event; the run must be live (guarded)."""
    pbody = problem.body() if problem is not None else None
    cur = conn.execute(
        "UPDATE runs SET status = ?, kind = ?, output = ?, problem = ?, ended_at = ?, settled_by = ?"
        " WHERE playbook = ? AND run_id = ? AND status IN ('started', 'waiting')",
        (status.value, kind, dumps(output) if output is not None else None, dumps(pbody) if pbody else None,
         now, by, playbook, run_id))
    if cur.rowcount != 1:
        raise Problem("conflict", "the run has already ended")
    payload: dict[str, Any] = {"status": status.value, "kind": kind}
    if status is RunStatus.SUCCEEDED:
        payload["output"] = output
    else:
        payload["problem"] = pbody
    append_event(conn, fx, playbook, run_id, "run_" + status.value, now, by, payload)
    fx.wakes.append((playbook, run_id))


class TimerWheel:
    """The daemon's one timer task: a heap of (due, key) mirrored from the `timers` table."""

    def __init__(self, clock: SystemClock | ManualClock, fire: Callable[[list[str]], Any]) -> None:
        self.clock = clock
        self.fire = fire
        self._heap: list[tuple[int, str]] = []
        self._due: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        clock.on_change(self._wake.set)

    def __len__(self) -> int:
        return len(self._due)

    def set(self, key: str, due: int) -> None:
        earliest = self._heap[0][0] if self._heap else None
        self._due[key] = due
        heapq.heappush(self._heap, (due, key))
        if earliest is None or due < earliest:
            self._wake.set()

    def cancel(self, key: str) -> None:
        self._due.pop(key, None)

    def next_due(self) -> int | None:
        while self._heap and self._due.get(self._heap[0][1]) != self._heap[0][0]:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def _pop_due(self, now: int) -> list[str]:
        keys = []
        while self._heap and self._heap[0][0] <= now:
            due, key = heapq.heappop(self._heap)
            if self._due.get(key) == due:
                del self._due[key]
                keys.append(key)
        return keys

    async def run_due(self) -> int:
        """Fire every timer that is due now; returns how many fired."""
        async with self._lock:
            keys = self._pop_due(self.clock.now_ms())
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
    required = ["prompt", "to"] + (["options"] if kind == "choice" else [])
    front = {
        "description": f"Asks a person to {_ASK_WORDS[kind]} (built in; run it with the ask tool)",
        "to": "{{ input.to }}", "expires": "P1D",
        "input": {"schema": {"type": "object", "required": required, "additionalProperties": False,
                             "properties": props}},
        "output": {"schema": ASK_ANSWER_SCHEMAS[kind]},
    }
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
        raise ending_problem(RunStatus.INVALID_INPUT, None, "the question's input is not valid", errors=errors)
    return {"expires_at": now + int(td.total_seconds() * 1000), "answer_schema": schema}


class Engine:
    """Every operation of the product, over one store, one clock and one timer task."""

    def __init__(self, store: Store, clock: SystemClock | ManualClock, config: Config) -> None:
        self.store = store
        self.clock = clock
        self.config = config
        self.open_limit = config.open_requests
        store.on_commit = self._apply
        self.wheel = TimerWheel(clock, self._fire)
        self._waiters: dict[tuple[str, str], set[asyncio.Future[None]]] = {}
        self._docs: OrderedDict[tuple[str, str, str, int], Any] = OrderedDict()
        self._current: dict[tuple[str, str, str], tuple[int, Any] | None] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()
        self._timer_task: asyncio.Task[None] | None = None
        self.playbooks: set[str] = set(config.playbooks)
        self.tools = ToolServers(config)

    # -- life ---------------------------------------------------------------------------------

    async def start(self) -> None:
        now = self.clock.now_ms()
        builtins = {name: _ask_source(kind) for name, kind in ASK_FUNCTIONS.items()}
        docs = {name: parse_function(src) for name, src in builtins.items()}

        def init(conn: sqlite3.Connection, fx: Effects) -> list[tuple[str, int]]:
            for pb in self.playbooks:
                conn.execute("INSERT OR IGNORE INTO playbooks (id, created_at) VALUES (?, ?)", (pb, now))
                for name, source in builtins.items():
                    conn.execute(
                        "INSERT OR IGNORE INTO definitions (playbook, type, name, version, source, source_sha, overview,"
                        " description, active, created_at, created_by) VALUES (?, 'interaction', ?, 1, ?, ?, ?, ?, 1, ?,"
                        " 'interactiond')", (pb, name, source, sha256_hex(source), docs[name].overview,
                                             docs[name].description, now))
            # Recount open requests: the counter is a cache of requests.open.
            conn.execute("UPDATE playbooks SET open_requests ="
                         " (SELECT COUNT(*) FROM requests r WHERE r.playbook = playbooks.id AND r.open = 1)")
            return [(r[0], r[1]) for r in conn.execute("SELECT key, due_at FROM timers")]

        for key, due in await self.store.write(init):
            self.wheel.set(key, due)
        self._timer_task = asyncio.create_task(self.wheel.run(), name="interactiond-timers")

    async def stop(self) -> None:
        if self._timer_task is not None:
            self._timer_task.cancel()
            await asyncio.gather(self._timer_task, return_exceptions=True)
            self._timer_task = None
        if self._tasks:
            done, pending = await asyncio.wait(set(self._tasks), timeout=SHUTDOWN_GRACE_S)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for futs in self._waiters.values():
            for f in futs:
                if not f.done():
                    f.set_result(None)
        await self.tools.close()

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

    def _apply(self, fx: Effects) -> None:
        for key, due in fx.timers:
            self.wheel.set(key, due)
        for key in fx.untimers:
            self.wheel.cancel(key)
        for key in fx.wakes:
            for fut in self._waiters.pop(key, ()):
                if not fut.done():
                    fut.set_result(None)
        for event in fx.published:
            for q in list(self._subscribers):
                if q.qsize() < 1000:
                    q.put_nowait(event)
        for fn in fx.later:
            fn()

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any]]) -> None:
        self._subscribers.discard(q)

    # -- access ---------------------------------------------------------------------------------

    def playbook(self, caller: Caller, playbook: str) -> str:
        """The playbook id when the caller may see it; 404 otherwise (never 403)."""
        if playbook not in self.playbooks or not caller.sees(playbook):
            raise not_found(f"no playbook {playbook} is visible to this caller")
        return playbook

    # -- definitions ----------------------------------------------------------------------------

    def _parse(self, type_: str, source: str) -> Any:
        if type_ == "interaction":
            return parse_function(source)
        raise Problem("invalid_request", "workflow definitions are not served by this version",
                      errors=[{"pointer": "/type", "message": "must be interaction"}])

    def _doc(self, playbook: str, type_: str, name: str, version: int, source: str) -> Any:
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

    @staticmethod
    def _check_def_name(type_: Any, name: Any) -> None:
        errors = []
        if type_ not in ("interaction", "workflow"):
            errors.append({"pointer": "/type", "message": "must be interaction or workflow"})
        if not isinstance(name, str) or not FUNCTION_NAME_RE.fullmatch(name):
            errors.append({"pointer": "/name", "message": "1 to 128 lowercase letters, digits, hyphens and underscores, starting with a letter or digit"})
        if errors:
            raise Problem("invalid_request", "the definition's type or name is not valid", errors=errors)

    async def create_definition(self, caller: Caller, playbook: str, type_: str, name: str,
                                source: str) -> tuple[dict[str, Any], bool]:
        caller.require(Role.WRITER)
        self._check_def_name(type_, name)
        self._not_builtin(type_, name)
        if not isinstance(source, str) or not source.strip():
            raise Problem("invalid_request", "source is the document's text",
                          errors=[{"pointer": "/source", "message": "a non-empty text"}])
        try:
            doc = self._parse(type_, source)
        except DocumentError as exc:
            raise Problem("invalid_document", f"the document breaks {len(exc.problems)} rule(s)",
                          errors=exc.problems) from None
        sha = sha256_hex(source)
        now = self.clock.now_ms()

        def change(conn: sqlite3.Connection, fx: Effects) -> tuple[int, bool]:
            row = conn.execute("SELECT version, source_sha, active FROM definitions WHERE playbook = ? AND type = ?"
                               " AND name = ? ORDER BY version DESC LIMIT 1", (playbook, type_, name)).fetchone()
            if row is not None and row["active"] and row["source_sha"] == sha:
                return row["version"], False
            version = (row["version"] + 1) if row is not None else 1
            if row is not None:
                conn.execute("UPDATE definitions SET active = 0 WHERE playbook = ? AND type = ? AND name = ?",
                             (playbook, type_, name))
            conn.execute("INSERT INTO definitions (playbook, type, name, version, source, source_sha, overview,"
                         " description, active, created_at, created_by) VALUES (?,?,?,?,?,?,?,?,1,?,?)",
                         (playbook, type_, name, version, source, sha, doc.overview, doc.description, now,
                          caller.id))
            append_event(conn, fx, playbook, None, "definition_created", now, caller.id,
                         {"type": type_, "name": name, "version": version, "sha256": sha})
            return version, True

        version, created = await self.store.write(change)
        self._docs[(playbook, type_, name, version)] = doc
        self._current[(playbook, type_, name)] = (version, doc)
        return await self.get_definition(caller, playbook, type_, name, version), created

    async def _definition_row(self, playbook: str, type_: str, name: str, version: int | None) -> sqlite3.Row:
        def query(conn: sqlite3.Connection) -> sqlite3.Row | None:
            if version is None:
                return conn.execute("SELECT * FROM definitions WHERE playbook = ? AND type = ? AND name = ?"
                                    " AND active = 1 ORDER BY version DESC LIMIT 1", (playbook, type_, name)).fetchone()
            return conn.execute("SELECT * FROM definitions WHERE playbook = ? AND type = ? AND name = ? AND version = ?",
                                (playbook, type_, name, version)).fetchone()
        row = await self.store.read(query)
        if row is None:
            raise not_found(f"no {type_} named {name!r}" + (f" at version {version}" if version else "")
                            + " in this playbook; list_definitions shows what there is")
        return row

    async def get_definition(self, caller: Caller, playbook: str, type_: str, name: str,
                             version: int | None = None) -> dict[str, Any]:
        row = await self._definition_row(playbook, type_, name, version)
        used_by: list[dict[str, Any]] = []
        overview = row["overview"]
        if used_by:
            overview += "\n\n**Used by:** " + ", ".join(u["name"] for u in used_by)
        return {"playbook": playbook, "type": type_, "name": name, "version": row["version"],
                "active": bool(row["active"]), "source": row["source"],
                "media_type": "text/markdown" if type_ == "interaction" else "application/yaml",
                "overview": overview, "used_by": used_by, "created_at": fmt_time(row["created_at"])}

    async def list_definitions(self, caller: Caller, playbook: str, type_: str | None = None) -> list[dict[str, Any]]:
        def query(conn: sqlite3.Connection) -> list[sqlite3.Row]:
            return conn.execute(
                "SELECT type, name, MAX(version) AS version, description FROM definitions"
                " WHERE playbook = ? AND active = 1 AND (? IS NULL OR type = ?) GROUP BY type, name ORDER BY type, name",
                (playbook, type_, type_)).fetchall()
        rows = await self.store.read(query)
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

        def change(conn: sqlite3.Connection, fx: Effects) -> int:
            cur = conn.execute("UPDATE definitions SET active = 0 WHERE playbook = ? AND type = ? AND name = ? AND active = 1",
                               (playbook, type_, name))
            if cur.rowcount:
                append_event(conn, fx, playbook, None, "definition_deleted", now, caller.id, {"type": type_, "name": name})
            return cur.rowcount
        if not await self.store.write(change):
            raise not_found(f"no active {type_} named {name!r} in this playbook")
        self._current.pop((playbook, type_, name), None)
        return {"playbook": playbook, "type": type_, "name": name, "active": False}

    async def _current_doc(self, playbook: str, type_: str, name: str) -> tuple[int, Any]:
        key = (playbook, type_, name)
        hit = self._current.get(key)
        if hit is None:
            row = await self._definition_row(playbook, type_, name, None)
            hit = (row["version"], self._doc(playbook, type_, name, row["version"], row["source"]))
            self._current[key] = hit
        return hit

    # -- runs -----------------------------------------------------------------------------------

    @staticmethod
    def _render_party(tpl: Any, ctx: dict[str, Any], what: str) -> str:
        """Render `to` or `from`; a bound broken is an `unworkable` conflict (RenderError passes)."""
        value = tpl.render(ctx)
        if not isinstance(value, str):
            raise ending_problem(RunStatus.CONFLICT, "unworkable", f"{what} rendered as {type(value).__name__}, not text")
        value = value.strip()
        if not value:
            raise ending_problem(RunStatus.CONFLICT, "unworkable", f"{what} rendered empty")
        if has_control_char(value):
            raise ending_problem(RunStatus.CONFLICT, "unworkable", f"{what} holds a control character")
        if len(value.encode()) > MAX_PARTY_BYTES:
            raise ending_problem(RunStatus.CONFLICT, "unworkable", f"{what} is longer than {MAX_PARTY_BYTES} bytes")
        return value

    def _prepare_request(self, doc: Any, input_: Any, now: int) -> dict[str, Any]:
        """Check the input and render what the request shows; raises the problem of an ending."""
        if doc.input_validator is not None:
            errors = schema_errors(doc.input_validator, input_, "/input")
            if errors:
                raise ending_problem(RunStatus.INVALID_INPUT, None, "the input does not match the input schema",
                                     errors=errors)
        ctx = base_context(now, input=input_)
        try:
            party = self._render_party(doc.to, ctx, "to")
            answerer = self._render_party(doc.from_, ctx, "from") if doc.from_ is not None else party
            message = doc.message.render_text(ctx)
        except RenderError as exc:
            if exc.kind == "undefined":
                raise ending_problem(RunStatus.INVALID_INPUT, None, str(exc),
                                     errors=[{"pointer": "/input", "message": str(exc)}]) from None
            raise ending_problem(RunStatus.CONFLICT, "unworkable", str(exc)) from None
        if len(message.encode()) > MAX_MESSAGE_BYTES:
            raise ending_problem(RunStatus.CONFLICT, "unworkable", f"the message is longer than {MAX_MESSAGE_BYTES // KIB} KiB")
        return {"party": party, "answerer": answerer, "message": message,
                "expires_at": now + int(doc.expires.total_seconds() * 1000)}

    async def run_definition(self, caller: Caller, playbook: str, type_: str, name: str, input_: Any = None,
                             run_id: str | None = None) -> tuple[dict[str, Any], bool]:
        """Start a run. Returns the run object and whether this call started it."""
        caller.require(Role.WRITER)
        self._check_def_name(type_, name)
        if run_id is not None and (not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id)):
            raise Problem("invalid_request", "run_id is 1 to 128 of A-Z a-z 0-9 _ . : -",
                          errors=[{"pointer": "/run_id", "message": "1 to 128 of A-Z a-z 0-9 _ . : -"}])
        input_ = {} if input_ is None else input_
        if json_size(input_) > MAX_BODY_BYTES or json_depth(input_) > MAX_JSON_DEPTH:
            raise Problem("too_large", "the input is too large or too deep")
        version, doc = await self._current_doc(playbook, type_, name)
        run_id = run_id or new_run_id()
        input_text = dumps(input_)
        input_sha = sha256_hex(json.dumps(input_, sort_keys=True, separators=(",", ":"), ensure_ascii=False))
        now = self.clock.now_ms()
        ending: Problem | None = None
        prepared: dict[str, Any] = {}
        if doc.shape is Shape.SYSTEM:
            return await self._run_system(caller, playbook, type_, name, version, doc, input_, run_id,
                                          input_text, input_sha)
        else:
            try:
                prepared = self._prepare_request(doc, input_, now)
                if name in ASK_FUNCTIONS:
                    prepared.update(_ask_overrides(ASK_FUNCTIONS[name], input_, now))
            except Problem as exc:
                ending = exc
            if doc.deliver is not None and ending is None:
                ending = self._check_offered(playbook, doc.deliver.server,
                                             [doc.deliver.tool] + ([doc.replies.tool] if doc.replies else [])
                                             + ([doc.replies.tell.tool] if doc.replies and doc.replies.tell else []))
        limit = self.open_limit

        def change(conn: sqlite3.Connection, fx: Effects) -> tuple[dict[str, Any], bool]:
            row = conn.execute("SELECT * FROM runs WHERE playbook = ? AND run_id = ?", (playbook, run_id)).fetchone()
            if row is not None:
                return self._rerun(row, type_, name, input_sha), False
            conn.execute("INSERT INTO runs (playbook, run_id, type, name, version, input, input_sha, status,"
                         " created_at, created_by) VALUES (?,?,?,?,?,?,?,'started',?,?)",
                         (playbook, run_id, type_, name, version, input_text, input_sha, now, caller.id))
            end = ending
            if end is None and (doc.output_schema is not None or doc.deliver is not None):
                cur = conn.execute("UPDATE playbooks SET open_requests = open_requests + 1"
                                   " WHERE id = ? AND open_requests < ?", (playbook, limit))
                if cur.rowcount == 0 and end is None:
                    end = ending_problem(RunStatus.UNAVAILABLE, "requests_full",
                                         f"the playbook already has {limit} open requests; answer or cancel some first")
            if end is not None:
                _end_run(conn, fx, playbook, run_id, _status_of(end), now=now, by=caller.id,
                         kind=end.kind, problem=end)
            else:
                self._open_request(conn, fx, playbook, run_id, type_, name, version, doc, prepared, now, caller.id)
            return run_object(conn.execute("SELECT * FROM runs WHERE playbook = ? AND run_id = ?",
                                           (playbook, run_id)).fetchone()), True

        run, fresh = await self.store.write(change)
        if fresh and run["status"] == RunStatus.WAITING.value:
            run = dict(run, status=RunStatus.STARTED.value)
        return run, fresh

    def _rerun(self, row: sqlite3.Row, type_: str, name: str, input_sha: str) -> dict[str, Any]:
        """A run id used before: the same run as it stands, or why it cannot be reused."""
        if row["type"] != type_ or row["name"] != name or row["input_sha"] != input_sha:
            raise Problem("run_id_taken", f"run id {row['run_id']} belongs to a run of another function or input;"
                          " use a new run id", kind="run_id_taken", status=409, extra={"run_id": row["run_id"]})
        if row["tools_called"] and row["status"] != RunStatus.SUCCEEDED.value and RunStatus(row["status"]).ended:
            raise Problem("tools_called", f"run {row['run_id']} called its tool and did not succeed; check its history,"
                          " then start a new run under a new id", kind="tools_called", status=409,
                          extra={"run_id": row["run_id"]})
        return run_object(row)

    def _open_request(self, conn: sqlite3.Connection, fx: Effects, playbook: str, run_id: str, type_: str,
                      name: str, version: int, doc: Any, prepared: dict[str, Any], now: int, by: str) -> None:
        answer_schema = prepared.get("answer_schema", doc.output_schema)
        notification = answer_schema is None
        deliver = doc.deliver
        state = DeliveryState.IN_INBOX if deliver is None else DeliveryState.TO_DELIVER
        inbox_note = notification and deliver is None
        conn.execute(
            "INSERT INTO requests (id, playbook, run_id, type, name, version, party, answerer, message, answer_schema,"
            " server, tool, status, open, delivery_state, asked_at, expires_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            ("int_" + new_ulid(), playbook, run_id, type_, name, version, prepared["party"], prepared["answerer"],
             prepared["message"], dumps(answer_schema) if answer_schema is not None else None,
             deliver.server if deliver else None, deliver.tool if deliver else None,
             "notified" if inbox_note else "open", 0 if inbox_note else 1, state.value, now, prepared["expires_at"]))
        append_event(conn, fx, playbook, run_id, "interaction_requested", now, by, {
            "delivery": {"server": deliver.server, "tool": deliver.tool} if deliver else None,
            "to": prepared["party"], "from": prepared["answerer"],
            "message_size": len(prepared["message"].encode()), "takes_answer": not notification,
            "expires_at": fmt_time(prepared["expires_at"])})
        if inbox_note:
            _end_run(conn, fx, playbook, run_id, RunStatus.SUCCEEDED, now=now, by=by, output={})
            return
        conn.execute("UPDATE runs SET status = 'waiting' WHERE playbook = ? AND run_id = ?", (playbook, run_id))
        _set_timer(conn, fx, _timer_key("expire", playbook, run_id), prepared["expires_at"])

    async def get_run(self, caller: Caller, playbook: str, run_id: str) -> dict[str, Any]:
        row = await self.store.read(lambda c: c.execute("SELECT * FROM runs WHERE playbook = ? AND run_id = ?",
                                                        (playbook, run_id)).fetchone())
        if row is None:
            raise not_found(f"no run {run_id} in this playbook")
        return run_object(row)

    async def wait_run(self, caller: Caller, playbook: str, run_id: str, timeout: float,
                       tick: Callable[[float], Any] | None = None) -> dict[str, Any]:
        """The run once it ends, or as it stands when `timeout` seconds (real time) pass."""
        key = (playbook, run_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        while True:
            fut = loop.create_future()
            self._waiters.setdefault(key, set()).add(fut)
            try:
                run = await self.get_run(caller, playbook, run_id)
                left = deadline - loop.time()
                if RunStatus(run["status"]).ended or left <= 0:
                    return run
                step = min(left, 5.0) if tick is not None else left
                try:
                    await asyncio.wait_for(asyncio.shield(fut), step)
                except asyncio.TimeoutError:
                    if tick is not None:
                        await tick(deadline - loop.time())
            finally:
                waiters = self._waiters.get(key)
                if waiters is not None:
                    waiters.discard(fut)
                    if not waiters:
                        self._waiters.pop(key, None)

    async def cancel_run(self, caller: Caller, playbook: str, run_id: str) -> dict[str, Any]:
        caller.require(Role.WRITER)
        now = self.clock.now_ms()

        def change(conn: sqlite3.Connection, fx: Effects) -> dict[str, Any]:
            run = conn.execute("SELECT * FROM runs WHERE playbook = ? AND run_id = ?", (playbook, run_id)).fetchone()
            if run is None:
                raise not_found(f"no run {run_id} in this playbook")
            if RunStatus(run["status"]).ended:
                if run["kind"] == "cancelled":
                    return run_object(run)
                raise Problem("not_open", f"run {run_id} has already ended ({run['status']})", kind="ended")
            req = conn.execute("SELECT * FROM requests WHERE playbook = ? AND run_id = ?", (playbook, run_id)).fetchone()
            if req is not None and req["delivery_state"] == DeliveryState.DELIVERING.value:
                conn.execute("UPDATE requests SET delivery_state = 'cancelling' WHERE seq = ?", (req["seq"],))
                append_event(conn, fx, playbook, run_id, "cancel_requested", now, caller.id, {})
            else:
                self._close_request(conn, fx, playbook, run_id, "cancelled", now)
                _end_run(conn, fx, playbook, run_id, RunStatus.REJECTED, now=now, by=caller.id, kind="cancelled",
                         problem=ending_problem(RunStatus.REJECTED, "cancelled", "the run was cancelled"))
            return run_object(conn.execute("SELECT * FROM runs WHERE playbook = ? AND run_id = ?",
                                           (playbook, run_id)).fetchone())
        return await self.store.write(change)

    def _close_request(self, conn: sqlite3.Connection, fx: Effects, playbook: str, run_id: str, status: str,
                       now: int) -> sqlite3.Row | None:
        """Close the run's open request (if any): the inbox drops it, the counter follows, timers go."""
        row = conn.execute("UPDATE requests SET status = ?, open = 0 WHERE playbook = ? AND run_id = ? AND open = 1"
                           " RETURNING *", (status, playbook, run_id)).fetchone()
        if row is not None:
            conn.execute("UPDATE playbooks SET open_requests = open_requests - 1 WHERE id = ?", (playbook,))
            for kind in ("expire", "attempt", "lost"):
                _drop_timer(conn, fx, _timer_key(kind, playbook, run_id))
        return row

    async def list_runs(self, caller: Caller, playbook: str, status: str | None = None, function: str | None = None,
                        limit: Any = None, cursor: str | None = None) -> dict[str, Any]:
        n = check_limit(limit)
        if status is not None and status not in {s.value for s in RunStatus}:
            raise Problem("invalid_request", "unknown status", errors=[{"pointer": "/status", "message": "not a run status"}])
        before = decode_cursor(cursor)[0] if cursor else None

        def query(conn: sqlite3.Connection) -> list[sqlite3.Row]:
            return conn.execute(
                "SELECT * FROM runs WHERE playbook = ? AND (? IS NULL OR status = ?) AND (? IS NULL OR name = ?)"
                " AND (? IS NULL OR seq < ?) ORDER BY seq DESC LIMIT ?",
                (playbook, status, status, function, function, before, before, n + 1)).fetchall()
        rows = await self.store.read(query)
        return _page([run_object(r) for r in rows[:n]], rows, n, lambda: [rows[n - 1]["seq"]])

    # -- tool servers ---------------------------------------------------------------------------

    def _check_offered(self, playbook: str, server: str, tools: list[str]) -> Problem | None:
        if not self.tools.offered(playbook, server):
            return ending_problem(RunStatus.UNAVAILABLE, "tool_not_offered",
                                  f"this playbook may not use the tool server {server!r}; call search to see the servers it may use")
        for tool in tools:
            if not self.tools.offered(playbook, server, tool):
                return ending_problem(RunStatus.UNAVAILABLE, "tool_not_offered",
                                      f"the operator does not allow the tool {tool!r} of {server!r}; call search to see the tools this playbook may use")
        return None

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

    async def _offered_tool(self, playbook: str, server: str, tool: str) -> tuple[ToolSession, Any]:
        problem = self._check_offered(playbook, server, [tool])
        if problem is not None:
            raise problem
        session = self.tools.sessions[server]
        try:
            await session.ensure()
        except ToolFailure as exc:
            raise ending_problem(RunStatus.UNAVAILABLE, "tool_server_failed",
                                 f"the tool server {server!r} could not be reached: {exc.message}; call search to see its state") from None
        t = session.tools.get(tool)
        if t is None:
            raise ending_problem(RunStatus.UNAVAILABLE, "tool_not_offered",
                                 f"the tool server {server!r} lists no tool {tool!r}; call search to see its tools")
        return session, t

    async def introspect(self, caller: Caller, playbook: str, server: str, tool: str) -> dict[str, Any]:
        session, t = await self._offered_tool(playbook, server, tool)
        return {"server": server, "tool": tool, "description": t.description, "input_schema": t.input_schema,
                "output_schema": t.output_schema, "read_only": session.read_only(tool),
                "annotations": t.annotations.model_dump(mode="json", by_alias=True, exclude_none=True) if t.annotations else None}

    async def execute(self, caller: Caller, playbook: str, server: str, tool: str,
                      arguments: dict[str, Any]) -> dict[str, Any]:
        """Call one tool once and return its answer; the call is a playbook event."""
        caller.require(Role.WRITER)
        if not isinstance(arguments, dict):
            raise Problem("invalid_request", "arguments is an object", errors=[{"pointer": "/arguments", "message": "an object"}])
        if json_size(arguments) > MAX_ARGUMENTS_BYTES:
            raise ending_problem(RunStatus.CONFLICT, "unworkable", f"the arguments pass {MAX_ARGUMENTS_BYTES // KIB} KiB")
        session, t = await self._offered_tool(playbook, server, tool)
        errors = schema_errors(compile_schema(t.input_schema or {"type": "object"}), arguments, "/arguments")
        if errors:
            raise ending_problem(RunStatus.CONFLICT, "unworkable", f"the arguments do not match the input schema of {tool}",
                                 errors=errors)
        now = self.clock.now_ms()
        record: dict[str, Any] = {"server": server, "tool": tool, "arguments": self.tools.record(server, arguments),
                                  "arguments_size": json_size(arguments)}
        try:
            result = await session.call(tool, arguments)
        except ToolFailure as exc:
            record.update(because=exc.because, message=self.tools.scrub(exc.message))
            await self.store.write(lambda c, fx: append_event(c, fx, playbook, None, "tool_call_failed", now, caller.id, record))
            kind = "tools_unfinished" if session.read_only(tool) else "effect_unknown"
            status = RunStatus.UNAVAILABLE if kind == "tools_unfinished" else RunStatus.CONFLICT
            if exc.because == "arguments_refused":
                status, kind = RunStatus.CONFLICT, "unworkable"
            raise ending_problem(status, kind, exc.message, extra={"because": exc.because}) from None
        has, answer = result_answer(result)
        record.update(is_error=bool(result.is_error), result=self.tools.record(server, result_wire(result)))
        await self.store.write(lambda c, fx: append_event(c, fx, playbook, None, "tool_call_answered", now, caller.id, record))
        return {"server": server, "tool": tool, "is_error": bool(result.is_error), "answer": answer if has else None,
                "structured_content": result.structured_content,
                "content": [b.model_dump(mode="json", by_alias=True, exclude_none=True) for b in result.content or ()]}

    async def _run_system(self, caller: Caller, playbook: str, type_: str, name: str, version: int, doc: Any,
                          input_: Any, run_id: str, input_text: str, input_sha: str) -> tuple[dict[str, Any], bool]:
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
                ending = ending_problem(RunStatus.INVALID_INPUT, None, "the input does not match the input schema",
                                        errors=errors)
        if ending is None:
            try:
                arguments = render_args(call.with_, base_context(now, input=input_))
            except RenderError as exc:
                ending = (ending_problem(RunStatus.INVALID_INPUT, None, str(exc)) if exc.kind == "undefined"
                          else ending_problem(RunStatus.CONFLICT, "unworkable", str(exc)))
        if ending is None and json_size(arguments) > MAX_ARGUMENTS_BYTES:
            ending = ending_problem(RunStatus.CONFLICT, "unworkable", f"the arguments pass {MAX_ARGUMENTS_BYTES // KIB} KiB")
        if ending is None:
            try:
                session, tool = await asyncio.wait_for(self._offered_tool(playbook, call.server, call.tool),
                                                       OPEN_TIMEOUT_S + LIST_TIMEOUT_S + 1)
                errors = schema_errors(compile_schema(tool.input_schema or {"type": "object"}), arguments, "/arguments")
                if errors:
                    ending = ending_problem(RunStatus.CONFLICT, "unworkable",
                                            f"the tool {call.tool} refused the arguments: they do not match its input schema",
                                            errors=errors)
            except Problem as exc:
                ending = exc
            except asyncio.TimeoutError:
                ending = ending_problem(RunStatus.UNAVAILABLE, "tool_server_failed",
                                        f"the tool server {call.server!r} did not open in time; call search to see its state")
        started = {"server": call.server, "tool": call.tool,
                   "arguments": self.tools.record(call.server, arguments) if ending is None else None,
                   "arguments_size": json_size(arguments) if arguments is not None else None,
                   "arguments_sha256": sha256_hex(dumps(arguments)) if arguments is not None else None}

        def begin(conn: sqlite3.Connection, fx: Effects) -> tuple[dict[str, Any], bool]:
            row = conn.execute("SELECT * FROM runs WHERE playbook = ? AND run_id = ?", (playbook, run_id)).fetchone()
            if row is not None:
                return self._rerun(row, type_, name, input_sha), False
            conn.execute("INSERT INTO runs (playbook, run_id, type, name, version, input, input_sha, status,"
                         " tools_called, created_at, created_by) VALUES (?,?,?,?,?,?,?,'started',?,?,?)",
                         (playbook, run_id, type_, name, version, input_text, input_sha,
                          0 if ending is not None else 1, now, caller.id))
            if ending is not None:
                _end_run(conn, fx, playbook, run_id, _status_of(ending), now=now, by=caller.id, kind=ending.kind,
                         problem=ending)
            else:
                append_event(conn, fx, playbook, run_id, "tool_call_started", now, caller.id, started)
            return run_object(conn.execute("SELECT * FROM runs WHERE playbook = ? AND run_id = ?",
                                           (playbook, run_id)).fetchone()), True

        run, fresh = await self.store.write(begin)
        if not fresh or ending is not None:
            return run, fresh
        assert session is not None
        read_only = session.read_only(call.tool)
        answered: dict[str, Any] | None = None
        output: Any = None
        try:
            result = await session.call(call.tool, arguments, min(CALL_TIMEOUT_S, max(1.0, deadline - loop.time())))
        except ToolFailure as exc:
            failed = {"because": "server_failed" if exc.because != "arguments_refused" else exc.because,
                      "message": self.tools.scrub(exc.message)}
            if exc.because == "arguments_refused":
                ending = ending_problem(RunStatus.CONFLICT, "unworkable", f"the tool refused the arguments: {exc.message}",
                                        extra={"because": "arguments_refused"})
            else:
                ending = self._unfinished(read_only, "server_failed", exc.message)
        else:
            has, answer = result_answer(result)
            answered = {"is_error": bool(result.is_error), "result": self.tools.record(call.server, result_wire(result)),
                        "result_size": json_size(result_wire(result))}
            if result.is_error:
                ending = self._unfinished(read_only, "tool_error", _result_text(result))
            elif not has:
                ending = self._unusable(read_only, "the tool's answer holds nothing to read")
            else:
                try:
                    output = pointer_get(answer, call.read) if call.read else answer
                except LookupError:
                    ending = self._unusable(read_only, f"the tool's answer holds nothing at {call.read}")
                else:
                    if json_depth(output) > MAX_JSON_DEPTH or json_size(output) + json_size(input_) > MAX_OUTPUT_BYTES:
                        ending = self._unusable(read_only, "the part of the answer at read is more than a run may record (1 MiB)")
                    else:
                        errors = schema_errors(doc.output_validator, output, "/output") if doc.output_validator else []
                        if errors:
                            ending = self._unusable(read_only, "the tool's answer does not match output.schema", errors=errors)
        end_now = self.clock.now_ms()

        def finish(conn: sqlite3.Connection, fx: Effects) -> dict[str, Any]:
            if answered is not None:
                append_event(conn, fx, playbook, run_id, "tool_call_answered", end_now, caller.id, answered)
            else:
                append_event(conn, fx, playbook, run_id, "tool_call_failed", end_now, caller.id, failed)
            if ending is None:
                _end_run(conn, fx, playbook, run_id, RunStatus.SUCCEEDED, now=end_now, by=caller.id, output=output)
            else:
                _end_run(conn, fx, playbook, run_id, _status_of(ending), now=end_now, by=caller.id, kind=ending.kind,
                         problem=ending)
            return run_object(conn.execute("SELECT * FROM runs WHERE playbook = ? AND run_id = ?",
                                           (playbook, run_id)).fetchone())
        return await self.store.write(finish), True

    @staticmethod
    def _unfinished(read_only: bool, because: str, message: str) -> Problem:
        if read_only:
            return ending_problem(RunStatus.UNAVAILABLE, "tools_unfinished",
                                  f"the call failed ({because}): {message}; the tool is read-only, so running again under a new run id is safe",
                                  extra={"because": because})
        return ending_problem(RunStatus.CONFLICT, "effect_unknown",
                              f"the call failed ({because}): {message}; the tool may have changed something, so check before running again",
                              extra={"because": because})

    @staticmethod
    def _unusable(read_only: bool, detail: str, **kw: Any) -> Problem:
        if not read_only:
            detail += "; running again calls the tool again"
        return ending_problem(RunStatus.CONFLICT, "unworkable", detail, **kw)

    # -- the inbox ------------------------------------------------------------------------------

    async def list_interactions(self, caller: Caller, playbook: str, to: str | None = None, type_: str | None = None,
                                function: str | None = None, limit: Any = None,
                                cursor: str | None = None) -> dict[str, Any]:
        n = check_limit(limit)
        before = decode_cursor(cursor)[0] if cursor else None

        def query(conn: sqlite3.Connection) -> list[sqlite3.Row]:
            sql = "SELECT * FROM requests WHERE playbook = ? AND open = 1"
            args: list[Any] = [playbook]
            for col, val in (("party", to), ("type", type_), ("name", function)):
                if val is not None:
                    sql += f" AND {col} = ?"
                    args.append(val)
            if before is not None:
                sql += " AND seq < ?"
                args.append(before)
            return conn.execute(sql + " ORDER BY seq DESC LIMIT ?", (*args, n + 1)).fetchall()
        rows = await self.store.read(query)
        return _page([request_object(r) for r in rows[:n]], rows, n, lambda: [rows[n - 1]["seq"]])

    async def answer_interaction(self, caller: Caller, playbook: str, run_id: str, answer: Any,
                                 claimed_for: str | None = None, *, reply_id: str | None = None,
                                 by: str | None = None) -> tuple[dict[str, Any], bool]:
        """Record the answer of an open request and end its run. Returns the fact and whether it is new."""
        if reply_id is None:
            caller.require(Role.WRITER)
        by = by or caller.id
        if claimed_for is not None and (not isinstance(claimed_for, str) or len(claimed_for.encode()) > MAX_CLAIM_BYTES):
            raise ending_problem(RunStatus.INVALID_INPUT, None, f"claimed_for is a text of at most {MAX_CLAIM_BYTES} bytes",
                                 errors=[{"pointer": "/claimed_for", "message": f"a text of at most {MAX_CLAIM_BYTES} bytes"}])
        if json_depth(answer) > MAX_JSON_DEPTH or json_size(answer) > MAX_ANSWER_BYTES:
            raise ending_problem(RunStatus.INVALID_INPUT, None, f"the answer takes at most {MAX_ANSWER_BYTES // KIB} KiB as JSON",
                                 errors=[{"pointer": "/answer", "message": f"at most {MAX_ANSWER_BYTES // KIB} KiB as JSON, {MAX_JSON_DEPTH} levels"}])
        req = await self.store.read(lambda c: c.execute("SELECT * FROM requests WHERE playbook = ? AND run_id = ?",
                                                        (playbook, run_id)).fetchone())
        if req is None:
            raise not_found(f"no request of run {run_id} in this playbook")
        answer_text = dumps(answer)
        self._answer_state_check(req, answer)
        errors = schema_errors(compile_schema(json.loads(req["answer_schema"])), answer, "/answer")
        if errors:
            raise ending_problem(RunStatus.INVALID_INPUT, None, "the answer does not match the request's answer schema",
                                 errors=errors)
        now = self.clock.now_ms()

        def change(conn: sqlite3.Connection, fx: Effects) -> tuple[dict[str, Any], bool]:
            row = conn.execute("SELECT * FROM requests WHERE seq = ?", (req["seq"],)).fetchone()
            if self._answer_state_check(row, answer):
                return answer_fact(row), False
            answer_id = append_event(conn, fx, playbook, run_id, "request_answered", now, by,
                                     {"answer": answer, "claimed_for": claimed_for,
                                      **({"reply": {"id": reply_id}} if reply_id is not None else {})})
            conn.execute("UPDATE requests SET answer = ?, answer_id = ?, answered_by = ?, answered_at = ?,"
                         " claimed_for = ?, reply_id = ? WHERE seq = ?",
                         (answer_text, answer_id, by, now, claimed_for, reply_id, row["seq"]))
            self._close_request(conn, fx, playbook, run_id, "answered", now)
            _end_run(conn, fx, playbook, run_id, RunStatus.SUCCEEDED, now=now, by=by, output=answer)
            return answer_fact(conn.execute("SELECT * FROM requests WHERE seq = ?", (row["seq"],)).fetchone()), True
        return await self.store.write(change)

    @staticmethod
    def _answer_state_check(req: sqlite3.Row, answer: Any) -> bool:
        """True when the request already took this very answer; raises when it takes none."""
        if req["answer_schema"] is None:
            raise Problem("notification", "a notification takes no answer", kind="notification")
        if req["status"] == "answered":
            if json.loads(req["answer"]) == answer:
                return True
            raise Problem("answered", "the request already took a different answer; a run takes one answer",
                          kind="answered")
        if req["status"] != "open":
            raise Problem("not_open", f"the request has ended ({req['status']})", kind=req["status"])
        if req["delivery_state"] == DeliveryState.CANCELLING.value:
            raise Problem("not_open", "the run is being cancelled", kind="cancelling")
        return False

    # -- events ---------------------------------------------------------------------------------

    async def list_run_events(self, caller: Caller, playbook: str, run_id: str, limit: Any = None,
                              cursor: str | None = None) -> dict[str, Any]:
        n = check_limit(limit)
        after = decode_cursor(cursor)[0] if cursor else 0
        await self.get_run(caller, playbook, run_id)
        rows = await self.store.read(lambda c: c.execute(
            "SELECT * FROM events WHERE playbook = ? AND run_id = ? AND id > ? ORDER BY id LIMIT ?",
            (playbook, run_id, after, n + 1)).fetchall())
        return _page([event_object(r) for r in rows[:n]], rows, n, lambda: [rows[n - 1]["id"]])

    async def list_playbook_events(self, caller: Caller, playbook: str, type_: str | None = None, limit: Any = None,
                                   cursor: str | None = None) -> dict[str, Any]:
        n = check_limit(limit)
        after = decode_cursor(cursor)[0] if cursor else 0
        rows = await self.store.read(lambda c: c.execute(
            "SELECT * FROM events WHERE playbook = ? AND run_id IS NULL AND (? IS NULL OR type = ?) AND id > ?"
            " ORDER BY id LIMIT ?", (playbook, type_, type_, after, n + 1)).fetchall())
        return _page([event_object(r) for r in rows[:n]], rows, n, lambda: [rows[n - 1]["id"]])

    async def get_event(self, caller: Caller, playbook: str, event_id: str) -> dict[str, Any]:
        eid = parse_event_id(event_id)
        row = await self.store.read(lambda c: c.execute("SELECT * FROM events WHERE id = ? AND playbook = ?",
                                                        (eid, playbook)).fetchone())
        if row is None:
            raise not_found(f"no event {event_id} in this playbook")
        return event_object(row, whole=True)

    # -- timers ---------------------------------------------------------------------------------

    async def _fire(self, keys: list[str]) -> None:
        jobs = []
        for key in keys:
            kind, playbook, ref = key.split(":", 2)
            if kind == "expire":
                jobs.append(self._expire(playbook, ref, key))
            else:
                log.warning("timer of unknown kind %s dropped", kind)
        if jobs:
            await asyncio.gather(*jobs, return_exceptions=True)

    async def _expire(self, playbook: str, run_id: str, key: str) -> None:
        now = self.clock.now_ms()

        def change(conn: sqlite3.Connection, fx: Effects) -> None:
            row = conn.execute("SELECT due_at FROM timers WHERE key = ?", (key,)).fetchone()
            if row is None or row["due_at"] > now:
                return                                          # answered, cancelled, or moved
            _drop_timer(conn, fx, key)
            req = conn.execute("SELECT * FROM requests WHERE playbook = ? AND run_id = ? AND open = 1",
                               (playbook, run_id)).fetchone()
            if req is None:
                return
            self._close_request(conn, fx, playbook, run_id, "expired", now)
            _end_run(conn, fx, playbook, run_id, RunStatus.REJECTED, now=now, by="interactiond", kind="expired",
                     problem=ending_problem(RunStatus.REJECTED, "expired",
                                            f"nobody answered before {fmt_time(req['expires_at'])}"))
        await self.store.write(change)


# HTTP API #######################################################################################
#
# Thin handlers over Engine methods. One middleware turns every error into problem+json and
# authenticates: `Authorization: Bearer <token>`, or the inbox page's session cookie (then a
# state-changing request must also carry a matching Origin). The route table below is the single
# source of both the router and /openapi.json, so the two cannot drift apart.

ENGINE_KEY: Final = web.AppKey("engine", Engine)
TOKENS_KEY: Final = web.AppKey("tokens", dict)
CALLER_KEY: Final = web.RequestKey("caller", Caller)
SESSION_COOKIE: Final = "interactiond_session"
TOKEN_CACHE_S: Final = 2.0          # a revoked token stops working within this long
PB: Final = "/v1/orgs/{org}/playbooks/{playbook}"
PUBLIC_PATHS: Final = ("/healthz", "/openapi.json", "/problems/", "/login", "/favicon.ico")


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


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise Problem("too_large", f"the body is larger than {MAX_BODY_BYTES // MIB} MiB") from None
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the body is a JSON object")
    return body


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=dumps(data), status=status, content_type="application/json")


def problem_response(exc: Problem) -> web.Response:
    return web.Response(text=dumps(exc.body()), status=exc.status, content_type="application/problem+json")


def _run_response(run: dict[str, Any], fresh: bool = False) -> web.Response:
    status = RUN_HTTP_STATUS[RunStatus(run["status"])]
    if fresh and status == 200:
        status = 201
    return _json(run, status)


def _caller(request: web.Request) -> Caller:
    return request[CALLER_KEY]


def _pb(request: web.Request) -> str:
    engine = request.app[ENGINE_KEY]
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
    engine = request.app[ENGINE_KEY]
    d, created = await engine.create_definition(_caller(request), _pb(request), body.get("type", "interaction"),
                                                _str_field(body, "name"), _str_field(body, "source"))
    return _json(d, 201 if created else 200)


async def h_list_definitions(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return _json({"data": await engine.list_definitions(_caller(request), _pb(request), request.query.get("type"))})


def _version_param(request: web.Request) -> int | None:
    v = request.query.get("version")
    if v is None:
        return None
    if not v.isdigit():
        raise Problem("invalid_request", "version is a whole number", errors=[{"pointer": "/version", "message": "a whole number"}])
    return int(v)


async def h_get_definition(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return _json(await engine.get_definition(_caller(request), _pb(request), request.match_info["type"],
                                             request.match_info["name"], _version_param(request)))


async def h_delete_definition(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return _json(await engine.delete_definition(_caller(request), _pb(request), request.match_info["type"],
                                                request.match_info["name"]))


async def h_run_definition(request: web.Request) -> web.Response:
    body = await _json_body(request)
    engine = request.app[ENGINE_KEY]
    run, fresh = await engine.run_definition(_caller(request), _pb(request), body.get("type", "interaction"),
                                             _str_field(body, "name"), body.get("input"),
                                             _str_field(body, "run_id", required=False))
    return _run_response(run, fresh)


async def h_list_runs(request: web.Request) -> web.Response:
    q = request.query
    engine = request.app[ENGINE_KEY]
    return _json(await engine.list_runs(_caller(request), _pb(request), q.get("status"), q.get("function"),
                                        q.get("limit"), q.get("cursor")))


async def h_get_run(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return _json(await engine.get_run(_caller(request), _pb(request), request.match_info["run_id"]))


async def h_wait_run(request: web.Request) -> web.Response:
    try:
        timeout = float(request.query.get("timeout", "30"))
    except ValueError:
        timeout = -1
    if not 0 <= timeout <= MAX_HTTP_WAIT_S:
        raise Problem("invalid_request", f"timeout is 0 to {MAX_HTTP_WAIT_S:g} seconds",
                      errors=[{"pointer": "/timeout", "message": f"0 to {MAX_HTTP_WAIT_S:g} seconds"}])
    engine = request.app[ENGINE_KEY]
    run = await engine.wait_run(_caller(request), _pb(request), request.match_info["run_id"], timeout)
    return _run_response(run)


async def h_cancel_run(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return _json(await engine.cancel_run(_caller(request), _pb(request), request.match_info["run_id"]))


async def h_run_events(request: web.Request) -> web.Response:
    q = request.query
    engine = request.app[ENGINE_KEY]
    return _json(await engine.list_run_events(_caller(request), _pb(request), request.match_info["run_id"],
                                              q.get("limit"), q.get("cursor")))


async def h_get_event(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return _json(await engine.get_event(_caller(request), _pb(request), request.match_info["event_id"]))


async def h_playbook_events(request: web.Request) -> web.Response:
    q = request.query
    engine = request.app[ENGINE_KEY]
    return _json(await engine.list_playbook_events(_caller(request), _pb(request), q.get("type"), q.get("limit"),
                                                   q.get("cursor")))


async def h_list_interactions(request: web.Request) -> web.Response:
    q = request.query
    engine = request.app[ENGINE_KEY]
    return _json(await engine.list_interactions(_caller(request), _pb(request), q.get("to"), q.get("type"),
                                                q.get("function"), q.get("limit"), q.get("cursor")))


async def h_answer(request: web.Request) -> web.Response:
    body = await _json_body(request)
    if "answer" not in body:
        raise Problem("invalid_request", "answer is required", errors=[{"pointer": "/answer", "message": "required"}])
    engine = request.app[ENGINE_KEY]
    fact, _ = await engine.answer_interaction(_caller(request), _pb(request), request.match_info["run_id"],
                                              body["answer"], body.get("claimed_for"))
    return _json(fact)


async def h_search(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return _json(await engine.search(_caller(request), _pb(request), request.query.get("query")))


async def h_introspect(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    m = request.match_info
    return _json(await engine.introspect(_caller(request), _pb(request), m["server"], m["tool"]))


async def h_execute(request: web.Request) -> web.Response:
    body = await _json_body(request)
    engine = request.app[ENGINE_KEY]
    m = request.match_info
    return _json(await engine.execute(_caller(request), _pb(request), m["server"], m["tool"], body.get("arguments", {})))


async def h_clock(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.clock.manual:
        raise Problem("conflict", "the clock is the system's; start the daemon with --clock manual to move it")
    body = await _json_body(request)
    try:
        delta = parse_duration(body.get("advance", "PT0S"))
    except ValueError as exc:
        raise Problem("invalid_request", str(exc), errors=[{"pointer": "/advance", "message": str(exc)}]) from None
    engine.clock.advance(delta)
    await engine.settle()
    return _json({"now": fmt_time(engine.clock.now_ms())})


async def h_problem_page(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in PROBLEM_TYPES:
        raise not_found(f"no problem type {name}")
    status, title, text = PROBLEM_TYPES[name]
    return web.Response(text=f"{title} ({status})\n\n{text}\n", content_type="text/plain")


async def h_openapi(request: web.Request) -> web.Response:
    return _json(openapi_spec())


_DEF_BODY: Final = {"type": "object", "required": ["name", "source"], "properties": {
    "type": {"type": "string", "enum": ["interaction", "workflow"]}, "name": {"type": "string"},
    "source": {"type": "string"}}}
_RUN_BODY: Final = {"type": "object", "required": ["name"], "properties": {
    "type": {"type": "string", "enum": ["interaction", "workflow"]}, "name": {"type": "string"},
    "input": {}, "run_id": {"type": "string"}}}
_ANSWER_BODY: Final = {"type": "object", "required": ["answer"], "properties": {
    "answer": {}, "claimed_for": {"type": "string", "maxLength": 256}}}

ROUTES: Final[list[Route]] = [
    Route("GET", "/healthz", h_healthz, "Liveness", public=True),
    Route("GET", "/openapi.json", h_openapi, "This description", public=True),
    Route("GET", "/problems/{name}", h_problem_page, "What a problem type means", public=True),
    Route("POST", "/v1/admin/clock", h_clock, "Move the manual clock (tests and demos)", Role.OPERATOR,
          {"type": "object", "properties": {"advance": {"type": "string"}}}),
    Route("POST", PB + "/definitions", h_create_definition, "create_definition", Role.WRITER, _DEF_BODY),
    Route("GET", PB + "/definitions", h_list_definitions, "list_definitions", query=("type",)),
    Route("GET", PB + "/definitions/{type}/{name}", h_get_definition, "get_definition", query=("version",)),
    Route("DELETE", PB + "/definitions/{type}/{name}", h_delete_definition, "delete_definition", Role.WRITER),
    Route("POST", PB + "/runs", h_run_definition, "run_definition", Role.WRITER, _RUN_BODY),
    Route("GET", PB + "/runs", h_list_runs, "list runs", query=("status", "function", "limit", "cursor")),
    Route("GET", PB + "/runs/{run_id}", h_get_run, "get_run"),
    Route("GET", PB + "/runs/{run_id}/events", h_run_events, "list_run_events", query=("limit", "cursor")),
    Route("POST", PB + "/runs/{run_id}/wait", h_wait_run, "wait for a run to end", Role.READER, None, ("timeout",)),
    Route("POST", PB + "/runs/{run_id}/cancel", h_cancel_run, "cancel_run", Role.WRITER),
    Route("POST", PB + "/runs/{run_id}/answer", h_answer, "answer_interaction", Role.WRITER, _ANSWER_BODY),
    Route("GET", PB + "/interactions", h_list_interactions, "list_interactions",
          query=("to", "type", "function", "limit", "cursor")),
    Route("GET", PB + "/events", h_playbook_events, "list_playbook_events", query=("type", "limit", "cursor")),
    Route("GET", PB + "/events/{event_id}", h_get_event, "get_event"),
    Route("GET", PB + "/tools", h_search, "search", query=("query",)),
    Route("GET", PB + "/tools/{server}/{tool}", h_introspect, "introspect"),
    Route("POST", PB + "/tools/{server}/{tool}", h_execute, "execute", Role.WRITER,
          {"type": "object", "properties": {"arguments": {"type": "object"}}}),
]


ROUTE_BY_HANDLER: Final = {r.handler: r for r in ROUTES}


def openapi_spec() -> dict[str, Any]:
    """OpenAPI 3.1, generated from ROUTES."""
    problem = {"$ref": "#/components/schemas/Problem"}
    paths: dict[str, Any] = {}
    for r in ROUTES:
        op: dict[str, Any] = {"summary": r.summary, "operationId": re.sub(r"\W+", "_", f"{r.method}_{r.path}").strip("_"),
                              "responses": {"default": {"description": "A problem",
                                                        "content": {"application/problem+json": {"schema": problem}}},
                                            "200": {"description": "OK", "content": {"application/json": {"schema": {}}}}}}
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
                "detail": {"type": "string"}, "kind": {"type": ["string", "null"]}, "errors": {"type": "array"}}}},
        },
    }


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
        origin = request.headers.get("Origin")
        if origin != f"{request.scheme}://{request.host}":
            raise Problem("forbidden", "a request made with the session cookie must come from the inbox page")
    return caller


async def lookup_token(app: web.Application, secret: str) -> Caller | None:
    cache: dict[str, tuple[float, Caller | None]] = app[TOKENS_KEY]
    digest = sha256_hex(secret)
    hit = cache.get(digest)
    if hit is not None and hit[0] > time.monotonic():
        return hit[1]
    row = await app[ENGINE_KEY].store.read(lambda c: c.execute(
        "SELECT id, role, playbook FROM tokens WHERE hash = ? AND revoked_at IS NULL AND purpose != 'login'",
        (digest,)).fetchone())
    caller = Caller(row["id"], Role(row["role"]), row["playbook"]) if row is not None else None
    if len(cache) > 10_000:
        cache.clear()
    cache[digest] = (time.monotonic() + TOKEN_CACHE_S, caller)
    return caller


@web.middleware
async def api_middleware(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    try:
        route: Route | None = ROUTE_BY_HANDLER.get(request.match_info.route.handler)
        if route is not None and not route.public:
            caller = await _authenticate(request)
            request[CALLER_KEY] = caller
            caller.require(route.role)
        elif route is None and not request.path.startswith(PUBLIC_PATHS) and request.match_info.http_exception is None \
                and request.path not in ("/",):
            request[CALLER_KEY] = await _authenticate(request)
        return await handler(request)
    except Problem as exc:
        return problem_response(exc)
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


def build_app(engine: Engine, *, manage_engine: bool = True, hosts: Iterable[str] = ()) -> web.Application:
    """The aiohttp application over an engine (started and stopped with the app when asked)."""
    app = web.Application(middlewares=[api_middleware], client_max_size=MAX_BODY_BYTES)
    app[ENGINE_KEY] = engine
    app[TOKENS_KEY] = {}
    for r in ROUTES:
        app.router.add_route(r.method, r.path, r.handler)
    mount_mcp(app, engine, sorted({"127.0.0.1:*", "localhost:*", "[::1]:*", *(f"{h}:*" for h in hosts)}))
    if manage_engine:
        async def lifecycle(app: web.Application) -> Any:
            await engine.store.open()
            await engine.start()
            yield
            await engine.stop()
            await engine.store.close()
        app.cleanup_ctx.append(lifecycle)
    return app



# MCP server #####################################################################################
#
# The same operations as the HTTP API, as MCP tools, served by the SDK's low-level `Server` over
# stdio, streamable HTTP (/mcp) and legacy SSE (/sse). The SDK checks no arguments, so each call
# is checked here against the tool's own input schema; a Problem becomes an `isError` result whose
# structured content is the problem object, and any other exception a generic one (no internal
# text leaks). The HTTP transports run behind the API's auth middleware; the bridge below hands the
# authenticated caller to the tool handler through the ASGI scope.

from mcp.server import Server as _McpServer
from mcp.server.sse import SseServerTransport
from mcp.server.transport_security import TransportSecuritySettings
from mcp import types as mt


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
    call: Callable[..., Any]              # async (engine, caller, playbook, args, progress) -> (result, is_error)
    read_only: bool = False


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
    return run, run["status"] not in ("started", "waiting", "succeeded")


async def _t_run(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    run, _fresh = await e.run_definition(c, pb, a.get("type", "interaction"), a["name"], a.get("input"), a.get("run_id"))
    return _run_result(run)


async def _t_get_run(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    return await e.get_run(c, pb, a["run_id"])


async def _t_wait_run(e: Engine, c: Caller, pb: str, a: dict[str, Any], progress: Any) -> Any:
    max_wait = float(a.get("max_wait", DEFAULT_MCP_WAIT_S))
    return await e.wait_run(c, pb, a["run_id"], max_wait, tick=progress)


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
    return await e.execute(c, pb, a["server"], a["tool"], a.get("arguments") or {})


async def _t_ask(e: Engine, c: Caller, pb: str, a: dict[str, Any], _: Any) -> Any:
    input_ = {k: a[k] for k in ("prompt", "to", "expires", "options", "multiple", "placeholder") if k in a}
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
             "version": _p("integer", "A past version; the current one when left out.", minimum=1)},
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
            "Wait for a run to end. Returns the ended run, or the run as it stands when max_wait seconds pass "
            "(then call wait_run again). Progress notifications are sent while it waits, so a person who is slow "
            "to answer does not make this call time out.",
            {"run_id": _RUN_ID_ARG,
             "max_wait": _p("number", f"Seconds to wait, 0 to {MAX_MCP_WAIT_S:g} (default {DEFAULT_MCP_WAIT_S:g}).",
                            minimum=0, maximum=MAX_MCP_WAIT_S)}, ("run_id",), _t_wait_run, True),
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
            (), _t_inbox, True),
    McpTool("answer_interaction",
            "Answer an open request on a person's behalf, in the shape of its answer_schema (list_interactions "
            "shows it). Returns the recorded answer fact. An answer that does not match comes back as an error "
            "with a JSON Pointer per problem, and the request stays open.",
            {"run_id": _RUN_ID_ARG, "answer": _p("object", "The answer, matching the request's answer_schema."),
             "claimed_for": _p("string", "Whom you answer for (kept, never checked), at most 256 bytes.")},
            ("run_id", "answer"), _t_answer),
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
             "arguments": _p("object", "The tool's arguments, as its input schema names them.")},
            ("server", "tool"), _t_execute),
    McpTool("ask",
            "Ask a person a typed question without writing a document: approval (yes/no with a comment), text, "
            "choice (pick from options) or confirmation. Returns the started run; call wait_run for the answer.",
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
             "run_id": _p("string", "Optional id of your choosing, for safe retries.", pattern=RUN_ID_RE.pattern)},
            ("type", "prompt", "to"), _t_ask),
]


def _mcp_schema(tool: McpTool, scoped: bool) -> dict[str, Any]:
    props = dict(tool.properties)
    if not scoped:
        props["playbook"] = _PLAYBOOK_ARG
    return {"type": "object", "properties": props, "required": list(tool.required), "additionalProperties": False}


def make_mcp_server(engine: Engine, *, caller: Caller | None = None, scoped_playbook: str | None = None) -> _McpServer:
    """An MCP server over the engine. `caller` fixes who calls (stdio); otherwise each HTTP request's."""
    tools = {t.name: t for t in MCP_TOOLS}
    schemas = {t.name: _mcp_schema(t, scoped_playbook is not None) for t in MCP_TOOLS}
    validators = {name: compile_schema(s) for name, s in schemas.items()}
    listed = [mt.Tool(name=t.name, description=t.description, input_schema=schemas[t.name],
                      annotations=mt.ToolAnnotations(read_only_hint=t.read_only)) for t in MCP_TOOLS]

    async def list_tools(ctx: Any, params: Any) -> mt.ListToolsResult:
        return mt.ListToolsResult(tools=listed)

    def result(data: Any, is_error: bool = False) -> mt.CallToolResult:
        return mt.CallToolResult(content=[mt.TextContent(type="text", text=dumps(data))],
                                 structured_content=data, is_error=is_error)

    async def call_tool(ctx: Any, params: Any) -> mt.CallToolResult:
        try:
            tool = tools.get(params.name)
            if tool is None:
                raise not_found(f"no tool {params.name}; list the tools to see them")
            args = dict(params.arguments or {})
            errors = schema_errors(validators[tool.name], args, "")
            if errors:
                raise Problem("invalid_request", f"the arguments of {tool.name} do not match its input schema",
                              errors=errors)
            who = caller
            if who is None:
                state = getattr(getattr(ctx, "request", None), "scope", {}).get("state", {})
                who = state.get("interactiond_caller")
            if who is None:
                raise Problem("unauthorized", "no caller: the HTTP transports need a bearer token")
            pb = scoped_playbook or args.pop("playbook", None) or who.playbook or DEFAULT_PLAYBOOK
            pb = engine.playbook(who, pb)

            async def progress(left: float) -> None:
                with contextlib.suppress(Exception):
                    await ctx.session.report_progress(0, None, f"still waiting; {left:.0f} s left in this call")
            out = await tool.call(engine, who, pb, args, progress)
            if isinstance(out, tuple):
                return result(*out)
            return result(out)
        except Problem as exc:
            return result(exc.body(), True)
        except Exception:
            log.exception("MCP tool %s failed", getattr(params, "name", "?"))
            return result(Problem("failed", "the daemon failed on this call; its log says why").body(), True)

    return _McpServer("interactiond", version=__version__, on_list_tools=list_tools, on_call_tool=call_tool,
                      instructions="Ask a person (or a system) a question and wait for a validated answer. "
                                   "Start with list_definitions, or use ask for a quick typed question.")


def asgi_handler(app: Callable[..., Any], *, grace_s: float = 2.0) -> Callable[[web.Request], Any]:
    """Serve an ASGI app (the MCP SDK's transports) from an aiohttp handler.

    Two things matter: after the body, `receive()` blocks until the peer leaves; and the app runs
    in its own task, shielded from the handler's cancellation, because the SDK drops a session
    whose opening request was cancelled half-way.
    """
    async def handler(request: web.Request) -> web.StreamResponse:
        tr = request.transport
        peer = tr.get_extra_info("peername") if tr else None
        sock = tr.get_extra_info("sockname") if tr else None
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": f"{request.version.major}.{request.version.minor}", "method": request.method,
            "scheme": request.scheme, "path": request.path, "raw_path": request.rel_url.raw_path.encode(),
            "root_path": "", "query_string": request.rel_url.raw_query_string.encode(),
            "headers": [(k.lower(), v) for k, v in request.raw_headers],
            "client": tuple(peer[:2]) if peer else None, "server": tuple(sock[:2]) if sock else None,
            "state": {"interactiond_caller": request.get(CALLER_KEY)}, "extensions": {},
        }
        resp: web.StreamResponse | None = None
        body_done = False
        gone = asyncio.Event()

        async def receive() -> dict[str, Any]:
            nonlocal body_done
            if not body_done and not gone.is_set():
                chunk = await request.content.readany()
                body_done = request.content.at_eof()
                return {"type": "http.request", "body": chunk, "more_body": not body_done}
            while not gone.is_set():
                t = request.transport
                if t is None or t.is_closing():
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(gone.wait(), 0.5)
            return {"type": "http.disconnect"}

        async def send(msg: dict[str, Any]) -> None:
            nonlocal resp
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
        streams: set[asyncio.Task[Any]] = request.app[STREAMS_KEY]
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


STREAMS_KEY: Final = web.AppKey("streams", set)


def mount_mcp(app: web.Application, engine: Engine, allowed_hosts: list[str]) -> None:
    """Streamable HTTP at /mcp and legacy SSE at /sse (+ /messages/) on the API's port."""
    server = make_mcp_server(engine)
    security = TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=allowed_hosts,
                                         allowed_origins=[f"http://{h}" for h in allowed_hosts])
    streamable = server.streamable_http_app(streamable_http_path="/mcp", transport_security=security)
    sse = SseServerTransport("/messages/", security_settings=security)

    async def sse_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        async with sse.connect_sse(scope, receive, send) as (read, write):
            await server.run(read, write, server.create_initialization_options())

    app[STREAMS_KEY] = set()
    app.router.add_route("*", "/mcp", asgi_handler(streamable))
    app.router.add_get("/sse", asgi_handler(sse_app))
    app.router.add_post("/messages/", asgi_handler(sse.handle_post_message))

    async def session_manager(app: web.Application) -> Any:
        started, stop = asyncio.Event(), asyncio.Event()

        async def hold() -> None:
            async with server.session_manager.run():
                started.set()
                await stop.wait()
        task = asyncio.create_task(hold(), name="interactiond-mcp-sessions")
        await started.wait()
        yield
        stop.set()
        await task

    async def cancel_streams(app: web.Application) -> None:
        for t in list(app[STREAMS_KEY]):
            t.cancel()

    app.cleanup_ctx.append(session_manager)
    app.on_shutdown.append(cancel_streams)


# Command line ###################################################################################
#
# `serve` and `stdio` run the engine; `check` and `token` work on files; `run`, `inbox` and
# `answer` are thin clients of the HTTP API. Files beside the database (mode 0600): `.lock` (the
# engine's OS lock), `.token` (the operator token the first start made) and `.url` (where the
# running engine listens).

def create_token(conn: sqlite3.Connection, role: str, playbook: str | None, name: str | None,
                 purpose: str = "api", now: int | None = None) -> tuple[str, str]:
    """Store a new token's hash; returns (id, secret). The secret is shown once."""
    if role not in {r.value for r in Role}:
        raise ValueError(f"role is one of reader, writer, operator, not {role!r}")
    if playbook is not None and not PLAYBOOK_RE.fullmatch(playbook):
        raise ValueError(f"playbook is ORG/NAME, not {playbook!r}")
    secret = new_token_secret()
    token_id = "tok_" + new_ulid().lower()
    conn.execute("INSERT INTO tokens (id, hash, playbook, role, name, purpose, created_at) VALUES (?,?,?,?,?,?,?)",
                 (token_id, sha256_hex(secret), playbook, role, name, purpose,
                  now if now is not None else int(time.time() * 1000)))
    return token_id, secret


def _beside(db: str, suffix: str) -> Path:
    return Path(db + suffix)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o600)


def ensure_operator_token(db: str) -> str:
    """The operator token the first start made (written beside the database), made now if missing."""
    path = _beside(db, ".token")
    conn = open_sync(db)
    try:
        if path.exists():
            secret = path.read_text().strip()
            if conn.execute("SELECT 1 FROM tokens WHERE hash = ? AND revoked_at IS NULL",
                            (sha256_hex(secret),)).fetchone():
                return secret
        _, secret = create_token(conn, "operator", None, "first start")
        _write_private(path, secret + "\n")
        return secret
    finally:
        conn.close()


class EngineLock:
    """The OS lock that makes one engine per database file."""

    def __init__(self, db: str) -> None:
        self.path = _beside(db, ".lock")
        self.fh: Any = None

    def acquire(self) -> bool:
        self.fh = open(self.path, "a+")
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


def _make_clock(name: str, host: str) -> SystemClock | ManualClock:
    if name == "manual":
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit("--clock manual is for tests and demos: it needs --host 127.0.0.1")
        return ManualClock()
    return SystemClock()


async def _serve(args: Any, config: Config) -> int:
    db = args.db or os.environ.get("INTERACTIOND_DB") or config.database
    host = args.host or config.host
    port = args.port if args.port is not None else config.port
    lock = EngineLock(db)
    if not lock.acquire():
        print(f"interactiond: {db} is already served by process {lock.holder()}; stop it first", file=sys.stderr)
        return 1
    try:
        secret = ensure_operator_token(db)
        conn = open_sync(db)
        _, login = create_token(conn, "operator", None, "inbox login", purpose="login")
        conn.close()
        engine = Engine(Store(db), _make_clock(args.clock, host), config)
        app = build_app(engine)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        url = f"http://{host}:{bound}"
        _write_private(_beside(db, ".url"), url + "\n")
        print(f"interactiond {__version__} serving {db} at {url}", flush=True)
        print(f"inbox: {url}/login?token={login}", flush=True)
        print(f"operator token: {_beside(db, '.token')}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print("interactiond: stopping", file=sys.stderr, flush=True)
        await runner.cleanup()
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
    lock = EngineLock(db)
    if not lock.acquire():
        return await _stdio_front(db, args.playbook)
    runner = None
    try:
        ensure_operator_token(db)
        engine = Engine(Store(db), SystemClock(), config)
        if args.playbook and args.playbook not in engine.playbooks:
            print(f"interactiond: no playbook {args.playbook} in the configuration", file=sys.stderr)
            return 2
        await engine.store.open()
        await engine.start()
        if args.http is not None:
            runner = web.AppRunner(build_app(engine, manage_engine=False), handle_signals=False)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", args.http).start()
            bound = runner.addresses[0][1] if runner.addresses else args.http
            _write_private(_beside(db, ".url"), f"http://127.0.0.1:{bound}\n")
            print(f"interactiond: HTTP at http://127.0.0.1:{bound}", file=sys.stderr)
        server = make_mcp_server(engine, caller=Caller("stdio", Role.OPERATOR, args.playbook),
                                 scoped_playbook=args.playbook)
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
        return 0
    finally:
        if runner is not None:
            await runner.cleanup()
            with contextlib.suppress(OSError):
                _beside(db, ".url").unlink()
        if "engine" in locals():
            await engine.stop()
            await engine.store.close()
        lock.release()


async def _stdio_front(db: str, playbook: str | None) -> int:
    """Another process runs the engine of this file: relay MCP to its /mcp endpoint."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.server.stdio import stdio_server

    try:
        url = _beside(db, ".url").read_text().strip()
        token = _beside(db, ".token").read_text().strip()
    except OSError:
        print(f"interactiond: {db} is served by another process, which publishes no URL (start it with serve)",
              file=sys.stderr)
        return 1
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(90)) as http:
        async with Client(streamable_http_client(url + "/mcp", http_client=http)) as upstream:
            async def list_tools(ctx: Any, params: Any) -> mt.ListToolsResult:
                tools = (await upstream.list_tools()).tools
                if playbook:
                    for t in tools:
                        t.input_schema.get("properties", {}).pop("playbook", None)
                return mt.ListToolsResult(tools=tools)

            async def call_tool(ctx: Any, params: Any) -> mt.CallToolResult:
                args = dict(params.arguments or {})
                if playbook:
                    args["playbook"] = playbook

                async def relay(progress: float, total: float | None, message: str | None) -> None:
                    await ctx.session.report_progress(progress, total, message)
                return await upstream.call_tool(params.name, args, progress_callback=relay)

            server = _McpServer("interactiond", version=__version__, on_list_tools=list_tools, on_call_tool=call_tool)
            async with stdio_server() as (read, write):
                await server.run(read, write, server.create_initialization_options())
    return 0


def _client_token(args: Any) -> tuple[str, str]:
    db = args.db or os.environ.get("INTERACTIOND_DB") or "interactiond.db"
    url = args.url
    if not url:
        try:
            url = _beside(db, ".url").read_text().strip()
        except OSError:
            url = "http://127.0.0.1:8765"
    token = args.token or os.environ.get("INTERACTIOND_TOKEN")
    if not token:
        try:
            token = _beside(db, ".token").read_text().strip()
        except OSError:
            raise SystemExit("no token: pass --token, set INTERACTIOND_TOKEN, or run beside the database that serve made")
    return url.rstrip("/"), token


def _http(method: str, url: str, token: str, body: Any = None) -> tuple[int, Any]:
    data = dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=70) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"detail": raw.decode(errors="replace")}


def _cli_client(args: Any) -> int:
    url, token = _client_token(args)
    base = f"{url}/v1/orgs/{args.playbook}/playbooks".replace("/playbooks", "", 0)
    org, _, name = args.playbook.partition("/")
    base = f"{url}/v1/orgs/{org}/playbooks/{name}"
    if args.cmd == "run":
        try:
            input_ = json.loads(args.input)
        except ValueError as exc:
            raise SystemExit(f"--input is JSON: {exc}")
        status, out = _http("POST", f"{base}/runs", token, {"type": args.type, "name": args.name, "input": input_,
                                                             **({"run_id": args.run_id} if args.run_id else {})})
    elif args.cmd == "inbox":
        query = f"?to={urllib.request.quote(args.to)}" if args.to else ""
        status, out = _http("GET", f"{base}/interactions{query}", token)
    else:
        try:
            answer = json.loads(args.answer)
        except ValueError as exc:
            raise SystemExit(f"the answer is JSON: {exc}")
        status, out = _http("POST", f"{base}/runs/{args.run_id}/answer", token, {"answer": answer})
    print(json.dumps(out, indent=2, ensure_ascii=False))
    return 0 if status < 400 else 1


def _cli_token(args: Any) -> int:
    db = args.db or os.environ.get("INTERACTIOND_DB") or "interactiond.db"
    conn = open_sync(db)
    try:
        if args.token_cmd == "create":
            try:
                token_id, secret = create_token(conn, args.role, args.playbook, args.name)
            except ValueError as exc:
                print(f"interactiond: {exc}", file=sys.stderr)
                return 2
            print(f"{token_id} {secret}")
        elif args.token_cmd == "list":
            for r in conn.execute("SELECT id, role, playbook, name, created_at, revoked_at FROM tokens"
                                  " WHERE purpose = 'api' ORDER BY created_at"):
                state = "revoked" if r["revoked_at"] else "active"
                print(f"{r['id']}\t{r['role']}\t{r['playbook'] or '*'}\t{state}\t{r['name'] or ''}")
        else:
            cur = conn.execute("UPDATE tokens SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                               (int(time.time() * 1000), args.id))
            if not cur.rowcount:
                print(f"interactiond: no active token {args.id}", file=sys.stderr)
                return 1
            print(f"revoked {args.id}")
        return 0
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="interactiond", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    def common(p: Any) -> None:
        p.add_argument("--db", help="the SQLite file (env: INTERACTIOND_DB; default ./interactiond.db)")
        p.add_argument("--config", help="the operator configuration, YAML (env: INTERACTIOND_CONFIG)")

    p = sub.add_parser("serve", help="run the daemon: HTTP API, MCP over HTTP, the inbox page")
    common(p)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--clock", choices=["system", "manual"], default="system",
                   help="manual: time moves only through POST /v1/admin/clock (tests and demos)")
    p = sub.add_parser("stdio", help="MCP over stdin/stdout for a local agent")
    common(p)
    p.add_argument("--playbook", help="scope the connection to one playbook, ORG/NAME")
    p.add_argument("--http", type=int, metavar="PORT", help="also serve the HTTP API and the inbox on this port")
    p = sub.add_parser("check", help="validate function documents; exit 1 on any problem")
    common(p)
    p.add_argument("files", nargs="+")
    p = sub.add_parser("token", help="create, list or revoke API tokens")
    common(p)
    tsub = p.add_subparsers(dest="token_cmd", required=True)
    t = tsub.add_parser("create")
    t.add_argument("--playbook")
    t.add_argument("--role", required=True, choices=[r.value for r in Role])
    t.add_argument("--name")
    tsub.add_parser("list")
    t = tsub.add_parser("revoke")
    t.add_argument("id")
    for name, helptext in (("run", "start a run"), ("inbox", "list open requests"), ("answer", "answer a request")):
        p = sub.add_parser(name, help=helptext)
        common(p)
        p.add_argument("--url", help="the daemon's URL (default: the one serve wrote beside the database)")
        p.add_argument("--token", help="an API token (env: INTERACTIOND_TOKEN)")
        p.add_argument("--playbook", default=DEFAULT_PLAYBOOK)
        if name == "run":
            p.add_argument("type", choices=["interaction", "workflow"])
            p.add_argument("name")
            p.add_argument("--input", default="{}")
            p.add_argument("--run-id")
        elif name == "inbox":
            p.add_argument("--to")
        else:
            p.add_argument("run_id")
            p.add_argument("answer")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    if args.cmd == "check":
        return check_documents(args.files)
    if args.cmd == "token":
        return _cli_token(args)
    if args.cmd in ("run", "inbox", "answer"):
        return _cli_client(args)
    try:
        config = load_config(args.config or os.environ.get("INTERACTIOND_CONFIG"))
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"interactiond: configuration: {problem}", file=sys.stderr)
        return 2
    if args.cmd == "stdio":
        return asyncio.run(_stdio(args, config))
    return asyncio.run(_serve(args, config))


if __name__ == "__main__":
    sys.exit(main())
