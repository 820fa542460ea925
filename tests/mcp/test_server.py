"""/mcp against the real server: its tools as a client lists them, its token check (a 401
before any MCP message), the protocol revisions it accepts, and the refusals that come back as
tool errors (a read-only token, a viewer, an unknown sandbox, run or harness, bad arguments)."""

from __future__ import annotations

import anyio
import httpx
import pytest

from .conftest import call, connect, issue, ok, text

TOOLS = {
    "create_sandbox": {"image"},
    "list_sandboxes": set(),
    "run_command": {"sandbox_id", "command"},
    "write_file": {"sandbox_id", "path", "content"},
    "read_file": {"sandbox_id", "path"},
    "list_files": {"sandbox_id", "path"},
    "get_preview_url": {"sandbox_id", "port"},
    "pause_sandbox": {"sandbox_id"},
    "resume_sandbox": {"sandbox_id"},
    "delete_sandbox": {"sandbox_id"},
    "start_run": {"harness", "prompt"},
    "get_run": {"run_id"},
}
OPTIONAL = {"create_sandbox": {"cpu", "memory_mb", "timeout_s"}, "run_command": {"cwd", "timeout_s"}}
ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def _initialize(version: str) -> dict:
    return {
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}},
    }  # fmt: skip


def test_tools_are_listed_with_their_arguments_described(mcp_url, team_token):
    async def main():
        async with connect(mcp_url, team_token) as session:
            return (await session.list_tools()).tools

    listed = {t.name: t for t in anyio.run(main)}
    assert set(listed) == set(TOOLS)
    for name, tool in listed.items():
        schema = tool.inputSchema
        assert set(schema.get("required", [])) == TOOLS[name], name
        assert set(schema["properties"]) == TOOLS[name] | OPTIONAL.get(name, set()), name
        assert all(p.get("description") for p in schema["properties"].values()), name
        assert tool.description
    assert listed["list_sandboxes"].annotations.readOnlyHint is True
    assert listed["delete_sandbox"].annotations.destructiveHint is True


def test_a_missing_or_wrong_token_is_a_401_before_any_mcp_message(mcp_url, team_token):
    body = _initialize("2025-06-18")
    for headers in ({}, {"Authorization": "Bearer hgr_nope"}, {"Authorization": f"Basic {team_token}"}):
        r = httpx.post(mcp_url, json=body, headers={**ACCEPT, **headers}, timeout=30)
        assert r.status_code == 401, r.text
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert "token" in r.json()["detail"]
    # Not even a body is read: an unparseable one is refused the same way.
    r = httpx.post(mcp_url, content=b"{", headers=ACCEPT, timeout=30)
    assert r.status_code == 401
    # Stateless: no stream for a GET, no session for a DELETE (but the token comes first).
    for method in ("GET", "DELETE"):
        assert httpx.request(method, mcp_url, headers=ACCEPT, timeout=30).status_code == 401
        r = httpx.request(
            method, mcp_url, headers={**ACCEPT, "Authorization": f"Bearer {team_token}"}, timeout=30
        )
        assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
    # A revoked token stops at its next request (each one is checked).
    from runtime.services.auth import token_revoke_row

    issued = issue()
    headers = {**ACCEPT, "Authorization": f"Bearer {issued.raw}"}
    assert httpx.post(mcp_url, json=body, headers=headers, timeout=30).status_code == 200
    token_revoke_row(issued.token)
    assert httpx.post(mcp_url, json=body, headers=headers, timeout=30).status_code == 401


@pytest.mark.parametrize("version", ["2024-11-05", "2025-03-26", "2025-06-18"])
def test_older_protocol_revisions_are_accepted(mcp_url, team_token, version):
    headers = {**ACCEPT, "Authorization": f"Bearer {team_token}"}
    r = httpx.post(mcp_url, json=_initialize(version), headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    result = r.json()["result"]
    assert result["protocolVersion"] == version
    assert result["serverInfo"]["name"] == "hangar" and "tools" in result["capabilities"]
    # Stateless: the next request needs no session, only the token (and the version header).
    listed = httpx.post(
        mcp_url, json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
        headers={**headers, "MCP-Protocol-Version": version}, timeout=30,
    )  # fmt: skip
    assert listed.status_code == 200, listed.text
    assert {t["name"] for t in listed.json()["result"]["tools"]} == set(TOOLS)


def test_refusals_and_mistakes_are_tool_errors(mcp_url, team_token):
    read_only = issue(scopes=["sandboxes:read"]).raw
    viewer = issue(role="viewer").raw

    async def main():
        async with connect(mcp_url, read_only) as session:
            assert (await ok(session, "list_sandboxes")) == {"sandboxes": []}
            refused = await call(session, "create_sandbox", image="busybox")
            assert refused.isError and "sandboxes:write" in text(refused)
        async with connect(mcp_url, viewer) as session:
            refused = await call(session, "run_command", sandbox_id="nope", command="id")
            assert refused.isError and "viewer" in text(refused) and "member" in text(refused)
        async with connect(mcp_url, team_token) as session:
            for name, args in [
                ("run_command", {"sandbox_id": "nope", "command": "id"}),
                ("read_file", {"sandbox_id": "nope", "path": "/etc/hostname"}),
                ("delete_sandbox", {"sandbox_id": "nope"}),
                ("get_run", {"run_id": "nope"}),
                ("start_run", {"harness": "nope", "prompt": "hi"}),
            ]:
                result = await session.call_tool(name, args)
                assert result.isError and "no " in text(result), (name, text(result))
            missing = await call(session, "run_command", sandbox_id="nope")
            assert missing.isError and "command" in text(missing)
            extra = await call(session, "list_sandboxes", everything=True)
            assert extra.isError
            unknown = await call(session, "format_disk")
            assert unknown.isError and "format_disk" in text(unknown)
            too_big = await call(session, "create_sandbox", image="busybox", cpu=10_000)
            assert too_big.isError and "10000" in text(too_big)
            image = await call(session, "create_sandbox", image="no-such-image")
            assert image.isError and "no-such-image" in text(image)

    anyio.run(main)
