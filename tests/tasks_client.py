"""The client side of MCP's Tasks extension, on the official `mcp` client: the extension a client
declares (so each request's `_meta` carries it), the task handle it claims from `tools/call`, and the
extension's requests (`tasks/get`, `tasks/update`, `tasks/cancel`) and the 2025-11-25 era's
experimental ones, sent through the client's own session."""
from __future__ import annotations

from typing import Any, Literal

from mcp import types as mt
from mcp.client.extension import ClaimContext, ClientExtension, NotificationBinding, ResultClaim
from pydantic import ConfigDict, Field, TypeAdapter

TASKS = "io.modelcontextprotocol/tasks"


class CreatedTask(mt.Result):
    """A CreateTaskResult: the task's fields, `resultType: task`."""

    model_config = ConfigDict(extra="allow")
    result_type: Literal["task"] = Field(alias="resultType")
    task_id: str = Field(alias="taskId")
    status: str


async def _unresolved(result: CreatedTask, ctx: ClaimContext) -> mt.CallToolResult:
    raise AssertionError("the tests read the task handle itself (allow_claimed=True)")


class _Task(mt.NotificationParams):
    model_config = ConfigDict(extra="allow")


class TasksClient(ClientExtension):
    """Declares the extension, claims the task handle, and keeps each `notifications/tasks` it gets."""

    identifier = TASKS

    def __init__(self) -> None:
        self.notified: list[dict[str, Any]] = []

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=CreatedTask, resolve=_unresolved)]

    def notifications(self) -> list[NotificationBinding[Any]]:
        async def keep(params: _Task) -> None:
            self.notified.append(params.model_dump(by_alias=True, mode="json", exclude_none=True))
        return [NotificationBinding(method="notifications/tasks", params_type=_Task, handler=keep)]


class _Params(mt.RequestParams):
    model_config = ConfigDict(extra="allow")


def _request(method: str) -> type:
    class Req(mt.Request[_Params, str]):
        name_param = "taskId"
    Req.__name__ = method.replace("/", "_")
    return Req


_REQUESTS = {m: _request(m) for m in ("tasks/get", "tasks/update", "tasks/cancel", "tasks/result", "tasks/list",
                                       "subscriptions/listen")}
_ANY = TypeAdapter(dict[str, Any])


async def rpc(client: Any, method: str, **params: Any) -> dict[str, Any]:
    """Send one of the extension's requests and return its raw result (an MCPError on an error)."""
    model = _REQUESTS[method]
    if "taskId" not in params:
        model = type(model.__name__, (model,), {"name_param": None})
    raw = await client.session.send_request(model(method=method, params=_Params(**params)), _ANY)
    raw.pop("_meta", None)
    return raw
