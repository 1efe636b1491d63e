"""A small chat service (channels, threads, users) exposed as an MCP tool server.

All state lives in one SQLite file (WAL), so the MCP server child, tests and a person's terminal share it:

    python examples/chat_server.py [serve] --db chat.db [--http 8765] [--bot-user NAME]   # stdio by default
    python examples/chat_server.py say   --db chat.db --channel ops --user alice [--thread TS] approve it
    python examples/chat_server.py show  --db chat.db --channel ops [--json]
    python examples/chat_server.py fail  --db chat.db --tool thread_replies --times 2 [--retry-after-ms 1500]
                                         [--mode error|hang|crash]
    python examples/chat_server.py calls --db chat.db --tool thread_replies

Tools: post_message (as the bot user), thread_replies and channel_history (read-only). Timestamps are
Slack-like "<seconds>.<6 digits>", strictly increasing across processes. Injected faults are queued in the
db and consumed one per call; every call is counted per tool. --db defaults to $CHAT_DB, then ./chat.db.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sqlite3
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:                      # mcp is imported lazily: `say`/`show`/`fail` start in ~50 ms
    from mcp.server import Server

log = logging.getLogger("chat_server")

SCHEMA = """
CREATE TABLE IF NOT EXISTS messages(channel TEXT NOT NULL, ts TEXT NOT NULL, ts_us INTEGER NOT NULL UNIQUE,
    user TEXT NOT NULL, text TEXT NOT NULL, thread_ts TEXT);
CREATE INDEX IF NOT EXISTS messages_channel ON messages(channel, ts_us);
CREATE INDEX IF NOT EXISTS messages_thread ON messages(channel, thread_ts, ts_us);
CREATE TABLE IF NOT EXISTS clock(id INTEGER PRIMARY KEY CHECK (id = 1), last_us INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS faults(id INTEGER PRIMARY KEY, tool TEXT NOT NULL, mode TEXT NOT NULL,
    remaining INTEGER NOT NULL, retry_after_ms INTEGER);
CREATE TABLE IF NOT EXISTS calls(tool TEXT PRIMARY KEY, n INTEGER NOT NULL);
"""
FAULT_MODES = ("error", "hang", "crash")
_TS_RE = re.compile(r"^(\d{1,12})(?:\.(\d{1,6}))?$")
_initialised: set[tuple[str, int]] = set()


# ---------------------------------------------------------------- storage (plain, importable)

@contextlib.contextmanager
def _tx(db_path: str, write: bool = True):
    """One short transaction on a fresh connection: safe across processes and threads."""
    con = sqlite3.connect(db_path, timeout=10, isolation_level=None)
    con.row_factory = sqlite3.Row
    try:
        con.execute("PRAGMA busy_timeout=10000")
        key = (os.path.abspath(db_path), os.stat(db_path).st_ino)   # a re-created file needs its schema again
        if key not in _initialised:
            con.execute("PRAGMA journal_mode=WAL")          # persistent in the file
            con.executescript(SCHEMA)
            _initialised.add(key)
        con.execute("PRAGMA synchronous=NORMAL")
        con.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield con
        except BaseException:
            con.execute("ROLLBACK")
            raise
        con.execute("COMMIT")
    finally:
        con.close()


def parse_ts(ts: str) -> int:
    """'1750000000.000123' (or '0', '12.5') -> integer microseconds; ValueError otherwise."""
    m = _TS_RE.match(ts) if isinstance(ts, str) else None
    if not m:
        raise ValueError(f"invalid ts {ts!r}: expected '<seconds>.<up to 6 digits>'")
    return int(m.group(1)) * 1_000_000 + int((m.group(2) or "0").ljust(6, "0"))


def _next_ts(con: sqlite3.Connection) -> tuple[str, int]:
    row = con.execute("SELECT last_us FROM clock WHERE id = 1").fetchone()
    us = time.time_ns() // 1000
    if row is not None:
        us = max(us, row[0] + 1)                             # strictly increasing, even if the clock steps back
    con.execute("INSERT INTO clock(id, last_us) VALUES (1, ?) "
                "ON CONFLICT(id) DO UPDATE SET last_us = excluded.last_us", (us,))
    return f"{us // 1_000_000}.{us % 1_000_000:06d}", us


def _root(con: sqlite3.Connection, channel: str, ts: str) -> str:
    """The thread root of the message with this ts (a reply's ts names its thread)."""
    row = con.execute("SELECT ts, thread_ts FROM messages WHERE channel = ? AND ts_us = ?",
                      (channel, parse_ts(ts))).fetchone()
    if row is None:
        raise ValueError(f"no message {ts} in channel {channel!r}")
    return row["thread_ts"] or row["ts"]


def _post(db_path: str, channel: str, user: str, text: str, thread_ts: str | None) -> str:
    if not channel:
        raise ValueError("channel must not be empty")
    if not text.strip():
        raise ValueError("text must not be empty")
    with _tx(db_path) as con:
        root = _root(con, channel, thread_ts) if thread_ts is not None else None
        ts, us = _next_ts(con)
        con.execute("INSERT INTO messages(channel, ts, ts_us, user, text, thread_ts) VALUES (?, ?, ?, ?, ?, ?)",
                    (channel, ts, us, user, text, root))
    return ts


def _rows(rows: list[sqlite3.Row]) -> list[dict]:
    return [{"ts": r["ts"], "user": r["user"], "text": r["text"], "thread_ts": r["thread_ts"]} for r in rows]


def say(db_path: str, channel: str, user: str, text: str, thread_ts: str | None = None) -> str:
    """Post as `user` (a person's reply); returns the new ts. ValueError on empty text or unknown thread."""
    return _post(db_path, channel, user, text, thread_ts)


def messages(db_path: str, channel: str) -> list[dict]:
    """Every message of the channel (top-level and replies), oldest first."""
    with _tx(db_path, write=False) as con:
        return _rows(con.execute("SELECT * FROM messages WHERE channel = ? ORDER BY ts_us", (channel,)).fetchall())


def inject_fault(db_path: str, tool: str, times: int, retry_after_ms: int | None = None, mode: str = "error") -> None:
    """Make the next `times` calls of `tool` fail: 'error' (is_error, optional retry_after_ms), 'hang', 'crash'."""
    if mode not in FAULT_MODES:
        raise ValueError(f"mode must be one of {FAULT_MODES}")
    if times < 1:
        raise ValueError("times must be >= 1")
    with _tx(db_path) as con:
        con.execute("INSERT INTO faults(tool, mode, remaining, retry_after_ms) VALUES (?, ?, ?, ?)",
                    (tool, mode, times, retry_after_ms))


def calls(db_path: str, tool: str) -> int:
    """How many tools/call requests for `tool` the server(s) on this db received."""
    with _tx(db_path, write=False) as con:
        row = con.execute("SELECT n FROM calls WHERE tool = ?", (tool,)).fetchone()
    return row[0] if row else 0


def _begin_call(db_path: str, tool: str) -> tuple[str, int | None] | None:
    """Count the call and consume one injected fault (oldest first), atomically."""
    with _tx(db_path) as con:
        con.execute("INSERT INTO calls(tool, n) VALUES (?, 1) ON CONFLICT(tool) DO UPDATE SET n = n + 1", (tool,))
        row = con.execute("SELECT id, mode, retry_after_ms FROM faults WHERE tool = ? AND remaining > 0 "
                          "ORDER BY id LIMIT 1", (tool,)).fetchone()
        if row is None:
            return None
        con.execute("UPDATE faults SET remaining = remaining - 1 WHERE id = ?", (row["id"],))
        return row["mode"], row["retry_after_ms"]


# ---------------------------------------------------------------- MCP tools

def _str(desc: str, **kw: Any) -> dict:
    return {"type": "string", "description": desc, **kw}


TS = {"type": "string", "pattern": _TS_RE.pattern}
MESSAGE = {"type": "object", "additionalProperties": False, "required": ["ts", "user", "text", "thread_ts"],
           "properties": {"ts": {"type": "string"}, "user": {"type": "string"}, "text": {"type": "string"},
                          "thread_ts": {"type": ["string", "null"]}}}
MESSAGES_OUT = {"type": "object", "required": ["messages", "has_more"],
                "properties": {"messages": {"type": "array", "items": MESSAGE},
                               "has_more": {"type": "boolean", "description": "More messages after the last one."}}}
OLDEST = {**TS, "default": "0", "description": "Only messages with ts > oldest."}
READ_ONLY = {"read_only_hint": True, "open_world_hint": True}
TOOL_SPECS: list[dict] = [
    dict(name="post_message", title="Post a message",
         description="Post a message to a channel (created on first use), optionally as a reply in a thread.",
         input_schema={"type": "object", "additionalProperties": False, "required": ["channel", "text"],
                       "properties": {"channel": _str("Channel name, e.g. 'ops'.", minLength=1),
                                      "text": _str("Message text (not empty).", minLength=1),
                                      "thread_ts": {**TS, "description": "ts of the thread's parent to reply in."}}},
         output_schema={"type": "object", "required": ["channel", "ts"],
                        "properties": {"channel": {"type": "string"}, "ts": {"type": "string"}}},
         annotations={"read_only_hint": False, "destructive_hint": False, "idempotent_hint": False,
                      "open_world_hint": True}),
    dict(name="thread_replies", title="Read a thread",
         description="The thread's parent message and its replies, oldest first, only those newer than `oldest`.",
         input_schema={"type": "object", "additionalProperties": False, "required": ["channel", "ts"],
                       "properties": {"channel": _str("Channel name.", minLength=1),
                                      "ts": {**TS, "description": "ts of the thread's parent (a reply's ts works too)."},
                                      "oldest": OLDEST,
                                      "limit": {"type": "integer", "minimum": 1, "maximum": 200, "default": 15,
                                                "description": "At most this many messages."}}},
         output_schema=MESSAGES_OUT, annotations=READ_ONLY),
    dict(name="channel_history", title="Read a channel",
         description="Top-level messages and replies of a channel, oldest first, only those newer than `oldest`.",
         input_schema={"type": "object", "additionalProperties": False, "required": ["channel"],
                       "properties": {"channel": _str("Channel name.", minLength=1),
                                      "oldest": OLDEST,
                                      "limit": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100,
                                                "description": "At most this many messages."}}},
         output_schema=MESSAGES_OUT, annotations=READ_ONLY),
]
_SPECS = {t["name"]: t for t in TOOL_SPECS}


def check_args(schema: dict, args: dict) -> list[str]:
    """The subset of JSON Schema these tools use (importing jsonschema costs seconds at start-up)."""
    types = {"string": str, "object": dict, "boolean": bool}
    props = schema["properties"]
    problems = [f"missing required argument {k!r}" for k in schema.get("required", ()) if k not in args]
    problems += [f"unexpected argument {k!r}" for k in args if k not in props]
    for k, v in args.items():
        s = props.get(k)
        if s is None:
            continue
        if s["type"] == "integer":
            ok = isinstance(v, int) and not isinstance(v, bool)
        else:
            ok = isinstance(v, types[s["type"]])
        if not ok:
            problems.append(f"{k!r} must be of type {s['type']}")
        elif isinstance(v, str) and len(v) < s.get("minLength", 0):
            problems.append(f"{k!r} must not be empty")
        elif isinstance(v, str) and "pattern" in s and not re.search(s["pattern"], v):
            problems.append(f"{k!r} must match {s['pattern']}: {v!r}")
        elif isinstance(v, int) and not s.get("minimum", v) <= v <= s.get("maximum", v):
            problems.append(f"{k!r} must be between {s['minimum']} and {s['maximum']}")
    return problems


def _page(con: sqlite3.Connection, where: str, args: tuple, oldest: str, limit: int) -> dict:
    rows = con.execute(f"SELECT * FROM messages WHERE {where} AND ts_us > ? ORDER BY ts_us LIMIT ?",
                       (*args, parse_ts(oldest), limit + 1)).fetchall()
    return {"messages": _rows(rows[:limit]), "has_more": len(rows) > limit}


def _run_tool(db_path: str, bot_user: str, name: str, args: dict) -> dict:
    """Synchronous tool body (runs in a worker thread); ValueError -> tool error."""
    if name == "post_message":
        ts = _post(db_path, args["channel"], bot_user, args["text"], args.get("thread_ts"))
        return {"channel": args["channel"], "ts": ts}
    with _tx(db_path, write=False) as con:
        if name == "thread_replies":
            root = _root(con, args["channel"], args["ts"])
            return _page(con, "channel = ? AND (ts = ? OR thread_ts = ?)", (args["channel"], root, root),
                         args.get("oldest", "0"), args.get("limit", 15))
        return _page(con, "channel = ?", (args["channel"],), args.get("oldest", "0"), args.get("limit", 100))


def make_server(db_path: str, bot_user: str = "interactiond") -> Server:
    import anyio
    from mcp import MCPError
    from mcp.server import Server, ServerRequestContext
    from mcp.types import (INVALID_PARAMS, CallToolRequestParams, CallToolResult, ListToolsResult,
                           PaginatedRequestParams, TextContent, Tool, ToolAnnotations)

    tools = [Tool(**{**spec, "annotations": ToolAnnotations(**spec["annotations"])}) for spec in TOOL_SPECS]

    def result(data: dict, *, is_error: bool = False, meta: dict | None = None) -> CallToolResult:
        return CallToolResult(content=[TextContent(type="text", text=json.dumps(data))], structured_content=data,
                              is_error=is_error, meta=meta)

    def error(text: str) -> CallToolResult:
        return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)

    async def list_tools(ctx: ServerRequestContext, params: PaginatedRequestParams | None) -> ListToolsResult:
        return ListToolsResult(tools=tools)

    async def call_tool(ctx: ServerRequestContext, params: CallToolRequestParams) -> CallToolResult:
        name, args = params.name, params.arguments or {}
        if name not in _SPECS:
            raise MCPError(INVALID_PARAMS, f"Unknown tool: {name}")
        fault = await anyio.to_thread.run_sync(_begin_call, db_path, name)
        if fault is not None:
            mode, retry_after_ms = fault
            log.warning("injected fault on %s: %s", name, mode)
            if mode == "crash":
                sys.stderr.flush()
                os._exit(3)
            if mode == "hang":
                await anyio.sleep(3600)
            if retry_after_ms is None:
                return error(f"injected fault: {name} failed")
            return result({"error": f"injected fault: {name} failed, retry later", "retry_after_ms": retry_after_ms},
                          is_error=True, meta={"retry_after_ms": retry_after_ms})
        problems = check_args(_SPECS[name]["input_schema"], args)
        if problems:
            return error(f"invalid arguments for {name}: " + "; ".join(problems))
        try:
            return result(await anyio.to_thread.run_sync(_run_tool, db_path, bot_user, name, args))
        except ValueError as e:
            return error(str(e))

    return Server("chat", version="0.1.0", instructions="A small chat service: channels, threads and users.",
                  on_list_tools=list_tools, on_call_tool=call_tool)


async def serve(server: Server, http_port: int | None = None) -> None:
    """MCP over stdio, or over streamable HTTP at http://127.0.0.1:PORT/mcp."""
    if http_port is None:
        from mcp.server.stdio import stdio_server
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
        return
    import uvicorn
    app = server.streamable_http_app(host="127.0.0.1")
    log.info("serving MCP on http://127.0.0.1:%d/mcp", http_port)
    await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=http_port, log_level="warning")).serve()


# ---------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("serve", "say", "show", "fail", "calls")
    if not argv or argv[0] not in commands + ("-h", "--help"):
        argv.insert(0, "serve")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=os.environ.get("CHAT_DB", "chat.db"), help="SQLite file ($CHAT_DB)")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve", parents=[common], help="run the MCP server (stdio unless --http)")
    p.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT/mcp")
    p.add_argument("--bot-user", default=os.environ.get("CHAT_BOT_USER", "interactiond"))
    p = sub.add_parser("say", parents=[common], help="post as a user; prints the new ts")
    p.add_argument("--channel", required=True)
    p.add_argument("--user", required=True)
    p.add_argument("--thread", metavar="TS")
    p.add_argument("text", nargs="+")
    p = sub.add_parser("show", parents=[common], help="print a channel's messages")
    p.add_argument("--channel", required=True)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("fail", parents=[common], help="inject a fault for the next N calls of a tool")
    p.add_argument("--tool", required=True)
    p.add_argument("--times", type=int, default=1)
    p.add_argument("--retry-after-ms", type=int)
    p.add_argument("--mode", choices=FAULT_MODES, default="error")
    p = sub.add_parser("calls", parents=[common], help="print how many calls a tool received")
    p.add_argument("--tool", required=True)
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="chat_server: %(levelname)s %(message)s")
    try:
        if a.cmd == "serve":
            import anyio
            anyio.run(serve, make_server(a.db, a.bot_user), a.http)
        elif a.cmd == "say":
            print(say(a.db, a.channel, a.user, " ".join(a.text), a.thread))
        elif a.cmd == "show":
            for m in messages(a.db, a.channel):
                print(json.dumps(m) if a.json else
                      f"{m['ts']}  {'  ↳ ' if m['thread_ts'] else ''}{m['user']}: {m['text']}")
        elif a.cmd == "fail":
            inject_fault(a.db, a.tool, a.times, a.retry_after_ms, a.mode)
        else:
            print(calls(a.db, a.tool))
    except ValueError as e:
        parser.exit(2, f"chat_server: error: {e}\n")
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
