"""``hangar mcp``: an MCP server on stdin/stdout for clients that start their servers as
commands, forwarding every tool listing and call to a Hangar's ``/mcp`` with the MCP SDK's own
streamable-HTTP client. The tools live once, on the server; this process needs no Django, no
database and no settings: only the server's URL and a token, found where the user's CLI finds
them (:func:`remote`). Part of the SDK's distribution, so a laptop with the SDK alone has it:
the MCP SDK comes with its ``mcp`` extra (``pip install 'hangar-runtime-sdk[mcp]'``; a server
install has it), and this module is imported only by ``hangar mcp``."""

from __future__ import annotations

import builtins
import json
import os
import sys
from typing import Any

import anyio
import httpx
from mcp import ClientSession, types
from mcp.client.streamable_http import streamable_http_client
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.shared._httpx_utils import create_mcp_http_client

from .._config import config_path

DEFAULT_URL = "http://127.0.0.1:8000"


class ConfigError(Exception):
    pass


def remote(url: str | None = None, token: str | None = None) -> tuple[str, str]:
    """The server's ``/mcp`` URL and the token, as the user's CLI and the SDK find them: the
    arguments (``--url``, ``--token``), else ``HANGAR_URL`` and ``HANGAR_TOKEN``, else what
    ``hangar login`` stored, else (inside a harness) ``HANGAR_API_URL`` and ``HANGAR_API_TOKEN``;
    the URL last of all ``http://127.0.0.1:8000``. A URL ending in ``/api/v1`` will do."""
    env = os.environ
    url = url or env.get("HANGAR_URL")
    token = token or env.get("HANGAR_TOKEN")
    path = config_path()
    if not (url and token) and path.is_file():
        try:
            stored: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from exc
        url, token = url or stored.get("url"), token or stored.get("token")
    url = url or env.get("HANGAR_API_URL") or DEFAULT_URL
    token = token or env.get("HANGAR_API_TOKEN") or ""
    if not token:
        raise ConfigError(
            "no token: set HANGAR_TOKEN (a Hangar API token, hgr_…), pass --token or run `hangar login`"
        )
    return url.rstrip("/").removesuffix("/api/v1") + "/mcp", token


def _error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], isError=True)


async def serve(url: str, token: str) -> None:
    """Connect to ``url`` (refused at once if the token is), then serve stdio until it closes."""
    proxy: Server[Any, Any] = Server("hangar")
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        create_mcp_http_client(headers=headers) as http,
        streamable_http_client(url, http_client=http) as (read, write, _),
        ClientSession(read, write) as session,
    ):
        init = await session.initialize()
        proxy.instructions = init.instructions

        @proxy.list_tools()
        async def list_tools() -> types.ListToolsResult:
            return await session.list_tools()

        # The server checks the arguments; a second check here would only lag behind its schemas.
        @proxy.call_tool(validate_input=False)
        async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
            try:
                return await session.call_tool(name, arguments)
            except httpx.HTTPStatusError as exc:
                return _error(
                    f"Hangar at {url} answered {exc.response.status_code}: {exc.response.text[:500]}"
                )
            except httpx.HTTPError as exc:
                return _error(f"cannot reach Hangar at {url}: {exc}")

        async with stdio_server() as (stdin, stdout):
            await proxy.run(stdin, stdout, proxy.create_initialization_options())


def check(url: str, token: str) -> None:
    """Say now, in words, if the server cannot be reached or refuses the token: an MCP client
    that starts this command shows its stderr, where a failed handshake says little."""
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json, text/event-stream"}
    try:
        response = httpx.post(
            url, headers=headers, json={"jsonrpc": "2.0", "id": 0, "method": "ping"}, timeout=30
        )
    except httpx.HTTPError as exc:
        raise ConfigError(f"cannot reach {url}: {exc}") from exc
    if response.status_code == 401:
        raise ConfigError(f"{url} refused the token (401): is it a live Hangar API token?")
    if response.status_code == 404:
        raise ConfigError(
            f"{url} has no MCP server (404): is {url.removesuffix('/mcp')} a Hangar's base URL?"
        )


def _first(exc: BaseException) -> BaseException:
    groups = getattr(builtins, "BaseExceptionGroup", ())  # (Python 3.10 has none of its own)
    while groups and isinstance(exc, groups) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def main(url: str | None = None, token: str | None = None) -> int:
    try:
        url, token = remote(url, token)
        check(url, token)
        anyio.run(serve, url, token)
    except ConfigError as exc:
        print(f"hangar mcp: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 (said in words, not as a traceback, to the MCP client's log)
        print(f"hangar mcp: {_first(exc)!r}", file=sys.stderr)
        return 1
    return 0
