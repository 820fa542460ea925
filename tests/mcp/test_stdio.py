"""``hangar mcp``: the CLI as a stdio MCP server, started by the MCP SDK's own stdio client as
an MCP client starts it, forwarding to the real server's /mcp with HANGAR_URL and HANGAR_TOKEN
(or the config file); no Django settings or database in its environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from tests.support import requires_runsc

from .conftest import ok, text
from .test_server import TOOLS

ROOT = Path(__file__).resolve().parents[2]
COMMAND = [sys.executable, "-m", "dashboard.cli", "mcp"]


def _env(tmp_path: Path, **more: str) -> dict[str, str]:
    """A bare environment: no DJANGO_SETTINGS_MODULE or DATABASE_URL, a config dir of its own."""
    return {
        "PATH": os.environ["PATH"], "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "PYTHONPATH": str(ROOT), **more,
    }  # fmt: skip


async def _tools_and(env: dict[str, str], *calls: tuple[str, dict]) -> tuple[set[str], list]:
    params = StdioServerParameters(command=COMMAND[0], args=COMMAND[1:], env=env, cwd=str(ROOT))
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        names = {t.name for t in (await session.list_tools()).tools}
        results = []
        for name, args in calls:
            if name == "run_command" and "sandbox_id" not in args:  # the sandbox made just before
                args = {**args, "sandbox_id": results[-1].structuredContent["id"]}
            results.append(await session.call_tool(name, args))
        return names, results


@requires_runsc
def test_hangar_mcp_forwards_tools_to_the_server(sandboxes, server, team_token, tmp_path):
    env = _env(tmp_path, HANGAR_URL=server, HANGAR_TOKEN=team_token)
    names, (made, ran, unknown) = anyio.run(
        _tools_and, env,
        ("create_sandbox", {"image": "busybox", "memory_mb": 256}),
        ("run_command", {"command": "echo via stdio; exit 4"}),
        ("read_file", {"sandbox_id": "nope", "path": "/x"}),
    )  # fmt: skip
    assert names == set(TOOLS)
    assert not made.isError and made.structuredContent["status"] == "running", text(made)
    assert ran.structuredContent["exit_code"] == 4 and ran.structuredContent["stdout"] == "via stdio\n"
    assert "exit code: 4" in text(ran)
    assert unknown.isError and "no sandbox 'nope'" in text(unknown)

    async def delete():
        from .conftest import connect

        async with connect(f"{server}/mcp", team_token) as session:
            await ok(session, "delete_sandbox", sandbox_id=made.structuredContent["id"])

    anyio.run(delete)


def test_hangar_mcp_reads_the_config_file_and_says_what_is_wrong(server, team_token, tmp_path):
    # A token the server refuses: said at once, on stderr, before any MCP message.
    bad = subprocess.run(COMMAND, env=_env(tmp_path, HANGAR_URL=server, HANGAR_TOKEN="hgr_wrong"),
                         cwd=ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip
    assert bad.returncode == 2 and "refused the token (401)" in bad.stderr, bad.stderr
    none = subprocess.run(COMMAND, env=_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)  # fmt: skip
    assert none.returncode == 2 and "HANGAR_TOKEN" in none.stderr, none.stderr
    down = subprocess.run(COMMAND, env=_env(tmp_path, HANGAR_URL="http://127.0.0.1:9", HANGAR_TOKEN="hgr_x"),
                          cwd=ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip
    assert down.returncode == 2 and "cannot reach" in down.stderr, down.stderr
    # The config file `hangar login` will write stands in for the environment.
    config = tmp_path / "config" / "hangar" / "config.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps({"url": server, "token": team_token}))
    names, (listed,) = anyio.run(_tools_and, _env(tmp_path), ("list_sandboxes", {}))
    assert names == set(TOOLS) and not listed.isError, text(listed)
