"""``/mcp``: Hangar's MCP server over streamable HTTP, stateless, with JSON answers.

Every HTTP request is authenticated on its own (``Authorization: Bearer <a Hangar API token>``,
checked again each time, so a revoked token stops at its next call) before the MCP SDK sees a
byte of it: a missing or wrong token is a 401. Each request then gets a fresh transport and a
run of the one low-level :class:`mcp.server.lowlevel.Server`, in a task group of its own that
ends with the request. daphne sends no ASGI lifespan events, so nothing here may wait for one
(the SDK's session manager wants its ``run()`` entered at startup); stateless also means any
server process can answer any request. The SDK negotiates the protocol revision with each
client (2024-11-05 onwards)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
from contextvars import ContextVar
from typing import Any

import anyio
from anyio.abc import TaskStatus
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.streamable_http import StreamableHTTPServerTransport
from mcp.server.transport_security import RequestBodyLimitMiddleware

from runtime.aio import blocking
from runtime.errors import ServiceError
from runtime.models import ApiToken
from runtime.services import audit
from runtime.services.auth import token_authenticate

from .tools import explain, tools

log = logging.getLogger(__name__)

# A request's body is read whole by the SDK's transport; write_file's content rides in it.
MAX_BODY_BYTES = 16 * 1024 * 1024

INSTRUCTIONS = (
    "Hangar runs isolated Linux sandboxes (gVisor) and coding-agent harnesses. Create a sandbox with "
    "create_sandbox (it returns an id), then run commands, write, read and list files in it; "
    "get_preview_url gives a URL for a server listening inside; delete it when done."
)

# The token of the HTTP request being served: set before the request's server task starts,
# which (and whose handlers) inherit it.
_caller: ContextVar[ApiToken | None] = ContextVar("hangar_mcp_caller", default=None)


def _version() -> str:
    try:
        return importlib.metadata.version("hangar")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "0"


server: Server[Any, Any] = Server("hangar", version=_version(), instructions=INSTRUCTIONS)


@server.list_tools()
async def list_tools() -> list[types.Tool]:
    return [
        types.Tool(
            name=t.name,
            description=t.description,
            inputSchema=t.input_schema(),
            annotations=types.ToolAnnotations(
                readOnlyHint=t.read_only, destructiveHint=t.destructive, openWorldHint=False
            ),
        )  # fmt: skip
        for t in tools().values()
    ]


def _error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], isError=True)


@server.call_tool()  # the SDK checks the arguments against the tool's input schema first
async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
    token = _caller.get()
    tool = tools().get(name)
    if token is None:  # not served through app() below
        return _error("not authenticated")
    if tool is None:
        return _error(f"unknown tool {name!r}; the tools are: {', '.join(tools())}")
    try:
        tool.check(token)
        result = await tool.handler(token, arguments)
    except ServiceError as exc:
        return _error(explain(exc))
    except Exception:
        log.exception("MCP tool %s failed", name)
        return _error(f"{name} failed on the server (an internal error, logged there); try again")
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=result.text)],
        structuredContent=result.data,
        isError=result.error,
    )


def _authenticate(raw: str, ip: str) -> tuple[ApiToken, audit.Actor] | None:
    token = token_authenticate(raw)
    if token is None:
        return None
    token.team  # noqa: B018 (loaded here, on the pool: refusals name the team on the event loop)
    return token, audit.for_token(token, ip=ip)


def _bearer(scope: dict[str, Any]) -> str:
    for key, value in scope.get("headers", []):
        if key == b"authorization":
            kind, _, raw = value.decode("latin-1").partition(" ")
            return raw.strip() if kind.lower() == "bearer" else ""
    return ""


async def _refuse(send: Any, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="hangar"'))
    elif status == 405:
        headers.append((b"allow", b"POST"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _serve(scope: Any, receive: Any, send: Any) -> None:
    transport = StreamableHTTPServerTransport(mcp_session_id=None, is_json_response_enabled=True)

    async def run(*, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with transport.connect() as (read, write):
            task_status.started()
            await server.run(read, write, server.create_initialization_options(), stateless=True)

    async with anyio.create_task_group() as tg:
        await tg.start(run)
        try:
            await transport.handle_request(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await transport.terminate()
            tg.cancel_scope.cancel()  # the answer is sent: the request's server ends with it


_limited = RequestBodyLimitMiddleware(_serve, MAX_BODY_BYTES)


async def app(scope: Any, receive: Any, send: Any) -> None:
    """The ASGI app at ``/mcp`` (``dashboard.asgi`` routes it here)."""
    raw = _bearer(scope)
    client = scope.get("client") or ("", 0)
    found = await blocking(_authenticate)(raw, client[0] or "") if raw else None
    if found is None:
        await _refuse(send, 401, "missing, invalid, expired or revoked token: send a Hangar API token "
                                 "as Authorization: Bearer hgr_…")  # fmt: skip
        return
    if scope["method"] != "POST":
        # A stateless server has no stream to offer a GET (the spec's answer is 405) and no
        # session for a DELETE to end; the SDK's transport would hold a GET open for ever.
        await _refuse(send, 405, "this MCP server is stateless: POST JSON-RPC messages to /mcp")
        return
    token, actor = found
    caller, acting = _caller.set(token), audit.set_actor(actor)
    try:
        await _limited(scope, receive, send)
    finally:
        audit.reset_actor(acting)
        _caller.reset(caller)
