"""What the MCP tests share: the MCP SDK's own client against the real server's /mcp."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from mcp import ClientSession, types
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client


@pytest.fixture
def mcp_url(server, team_token) -> str:
    return f"{server}/mcp"


@pytest.fixture
def sandboxes(server, celery_worker, bridge, local_node, team_token) -> str:
    """The whole stack (worker, bridge, this node with the busybox image): returns /mcp's URL."""
    return f"{server}/mcp"


@contextlib.asynccontextmanager
async def connect(url: str, token: str) -> AsyncIterator[ClientSession]:
    """An initialised MCP session, as an MCP client opens one, with ``token`` as its Bearer."""
    async with (
        create_mcp_http_client(headers={"Authorization": f"Bearer {token}"}) as http,
        streamable_http_client(url, http_client=http) as (read, write, _),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


def text(result: types.CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, types.TextContent))


async def call(session: ClientSession, name: str, **arguments: Any) -> types.CallToolResult:
    return await session.call_tool(name, arguments)


async def ok(session: ClientSession, name: str, **arguments: Any) -> dict[str, Any]:
    """A tool's structured content, once it has said it did not fail."""
    result = await call(session, name, **arguments)
    assert not result.isError, text(result)
    assert result.structuredContent is not None
    return result.structuredContent


def issue(**kwargs):
    """Another token of the team's owner (``team_token``'s user), with ``kwargs``."""
    from runtime.models import ApiToken
    from runtime.services.auth import token_create

    made = ApiToken.objects.select_related("user", "team").order_by("id").first()
    return token_create(user=made.user, team=made.team, **kwargs)
