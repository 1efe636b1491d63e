"""Shared pieces for the daemon's tests: a real app on a temporary file, on the manual clock."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import interactiond as itd

START_MS = 1_800_000_000_000          # 2027-01-15T08:00:00Z: far from any real date

APPROVAL = """---
description: Asks a brief's owner to approve it
to: '{{ input.owner }}'
expires: P2D
input:
  schema:
    type: object
    required: [owner, review]
    properties:
      owner: { type: string }
      review: { type: string }
output:
  schema:
    type: object
    required: [verdict]
    properties:
      verdict: { type: string, enum: [approve, revise] }
      note: { type: string, maxLength: 2000 }
---
Your brief was reviewed:

{{ input.review }}

Approve it, or ask for a revision.
"""

NOTIFY = """---
to: '{{ input.owner }}'
expires: PT1H
input:
  schema:
    type: object
    required: [owner]
    properties:
      owner: { type: string }
---
Heads up, {{ input.owner }}: the brief shipped.
"""


@dataclass
class Daemon:
    client: Any
    engine: Any
    clock: Any
    db: str
    tokens: dict[str, str] = field(default_factory=dict)
    playbook: str = "local/default"

    def url(self, tail: str = "", playbook: str | None = None) -> str:
        org, name = (playbook or self.playbook).split("/")
        return f"/v1/orgs/{org}/playbooks/{name}{tail}"

    def auth(self, role: str = "operator") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}"}

    async def call(self, method: str, tail: str, body: Any = None, role: str = "operator",
                   playbook: str | None = None, **kw: Any) -> tuple[int, Any]:
        absolute = tail.startswith(("/v1/", "/v2/", "/healthz", "/openapi.json", "/problems/", "/mcp", "/sse"))
        path = tail if absolute else self.url(tail, playbook)
        resp = await self.client.request(method, path, json=body, headers=self.auth(role), **kw)
        text = await resp.text()
        return resp.status, (json.loads(text) if text else None)

    async def define(self, name: str, source: str) -> dict[str, Any]:
        status, body = await self.call("POST", "/definitions", {"type": "interaction", "name": name, "source": source})
        assert status in (200, 201), body
        return body

    async def run(self, name: str, input_: Any, run_id: str | None = None) -> tuple[int, dict[str, Any]]:
        body = {"type": "interaction", "name": name, "input": input_}
        if run_id:
            body["run_id"] = run_id
        return await self.call("POST", "/runs", body)

    async def advance(self, duration: str) -> None:
        status, body = await self.call("POST", "/v1/admin/clock", {"advance": duration})
        assert status == 200, body


def make_tokens(db: str) -> dict[str, str]:
    conn = itd.open_sync(db)
    try:
        out = {}
        for key, role, pb in (("operator", "operator", None), ("writer", "writer", "local/default"),
                              ("reader", "reader", "local/default"), ("other", "writer", "acme/other")):
            out[key] = itd.create_token(conn, role, pb, key)[1]
        return out
    finally:
        conn.close()


async def start_daemon(aiohttp_client: Any, db: str, *, clock: Any = None, config: Any = None,
                       tokens: dict[str, str] | None = None) -> Daemon:
    clock = clock or itd.ManualClock(START_MS)
    config = config or itd.Config(playbooks={"local/default": (), "acme/other": ()})
    tokens = tokens or make_tokens(db)
    engine = itd.Engine(itd.Store(db), clock, config)
    client = await aiohttp_client(itd.build_app(engine))
    return Daemon(client, engine, clock, db, tokens)
