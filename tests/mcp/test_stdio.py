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
import httpx
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from tests.support import requires_runsc

from .conftest import text
from .test_server import TOOLS

# The installed console script, as an MCP client's configuration names it (`make install` puts
# it in the venv); the server's `mcp` command is in it through the `hangar.cli` plug-in.
HANGAR = Path(sys.executable).with_name("hangar")
COMMAND = [str(HANGAR), "mcp"]


def _env(tmp_path: Path, **more: str) -> dict[str, str]:
    """A bare environment: no DJANGO_SETTINGS_MODULE, DATABASE_URL or PYTHONPATH, a config dir
    of its own."""
    assert HANGAR.is_file(), f"{HANGAR} is missing: `make install` installs the `hangar` console script"
    return {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "config"),
            **more}  # fmt: skip


async def _tools_and(env: dict[str, str], *calls: tuple[str, dict]) -> tuple[set[str], list]:
    """Start the stdio server (``hangar mcp``), list its tools and make the calls; a call
    without a ``sandbox_id`` that takes one goes to the sandbox the last ``create_sandbox`` made."""
    params = StdioServerParameters(command=COMMAND[0], args=COMMAND[1:], env=env, cwd=env["HOME"])
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        names = {t.name for t in (await session.list_tools()).tools}
        results = []
        made = None
        for name, args in calls:
            if "sandbox_id" in TOOLS[name] and "sandbox_id" not in args:  # the sandbox made before
                args = {**args, "sandbox_id": made}
            results.append(result := await session.call_tool(name, args))
            if name == "create_sandbox" and not result.isError:
                made = result.structuredContent["id"]
        return names, results


@requires_runsc
def test_hangar_mcp_forwards_tools_to_the_server(sandboxes, server, team_token, tmp_path):
    env = _env(tmp_path, HANGAR_URL=server, HANGAR_TOKEN=team_token)
    names, (made, ran, wrote, read, listed, unknown, deleted) = anyio.run(
        _tools_and, env,
        ("create_sandbox", {"image": "busybox", "memory_mb": 256}),
        ("run_command", {"command": "echo via stdio; exit 4"}),
        ("write_file", {"path": "/tmp/stdio/note.txt", "content": "written over stdio\n"}),
        ("read_file", {"path": "/tmp/stdio/note.txt"}),
        ("list_files", {"path": "/tmp/stdio"}),
        ("read_file", {"sandbox_id": "nope", "path": "/x"}),
        ("delete_sandbox", {}),
    )  # fmt: skip
    assert names == set(TOOLS)
    assert not made.isError and made.structuredContent["status"] == "running", text(made)
    assert ran.structuredContent["exit_code"] == 4 and ran.structuredContent["stdout"] == "via stdio\n"
    assert "exit code: 4" in text(ran)
    assert not wrote.isError, text(wrote)
    assert not read.isError and "written over stdio" in text(read), text(read)
    assert "note.txt" in text(listed), text(listed)
    assert unknown.isError and "no sandbox 'nope'" in text(unknown)
    assert not deleted.isError, text(deleted)
    status = httpx.get(f"{server}/api/v1/sandboxes/{made.structuredContent['id']}",
                       headers={"Authorization": f"Bearer {team_token}"}, timeout=30).json()["status"]  # fmt: skip
    assert status in ("stopping", "deleted"), status


def test_hangar_mcp_reads_the_config_file_and_says_what_is_wrong(server, team_token, tmp_path):
    # A token the server refuses: said at once, on stderr, before any MCP message.
    bad = subprocess.run(COMMAND, env=_env(tmp_path, HANGAR_URL=server, HANGAR_TOKEN="hgr_wrong"),
                         cwd=tmp_path, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip
    assert bad.returncode == 2 and "refused the token (401)" in bad.stderr, bad.stderr
    none = subprocess.run(COMMAND, env=_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)  # fmt: skip
    assert none.returncode == 2 and "HANGAR_TOKEN" in none.stderr, none.stderr
    down = subprocess.run(COMMAND, env=_env(tmp_path, HANGAR_URL="http://127.0.0.1:9", HANGAR_TOKEN="hgr_x"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip
    assert down.returncode == 2 and "cannot reach" in down.stderr, down.stderr
    # The config file `hangar login` will write stands in for the environment.
    config = tmp_path / "config" / "hangar" / "config.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps({"url": server, "token": team_token}))
    names, (listed,) = anyio.run(_tools_and, _env(tmp_path), ("list_sandboxes", {}))
    assert names == set(TOOLS) and not listed.isError, text(listed)


def test_hangar_mcp_finds_its_server_and_token_where_the_cli_does(monkeypatch, tmp_path):
    from hangar_sdk.cli.mcp import ConfigError, remote

    for name in ("HANGAR_URL", "HANGAR_TOKEN", "HANGAR_API_URL", "HANGAR_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    # Inside a harness: its own variables, the API's URL standing for the server's.
    monkeypatch.setenv("HANGAR_API_URL", "http://hangar.internal:8000/api/v1")
    monkeypatch.setenv("HANGAR_API_TOKEN", "hgr_harness")
    assert remote() == ("http://hangar.internal:8000/mcp", "hgr_harness")
    # What `hangar login` stored comes before them; the environment before that; arguments first.
    (tmp_path / "hangar").mkdir()
    (tmp_path / "hangar" / "config.json").write_text(
        json.dumps({"url": "http://stored:1", "token": "hgr_stored"})
    )
    assert remote() == ("http://stored:1/mcp", "hgr_stored")
    monkeypatch.setenv("HANGAR_URL", "http://env:2/")
    monkeypatch.setenv("HANGAR_TOKEN", "hgr_env")
    assert remote() == ("http://env:2/mcp", "hgr_env")
    assert remote("http://arg:3", "hgr_arg") == ("http://arg:3/mcp", "hgr_arg")
    for name in ("HANGAR_URL", "HANGAR_TOKEN", "HANGAR_API_URL", "HANGAR_API_TOKEN"):
        monkeypatch.delenv(name)
    (tmp_path / "hangar" / "config.json").unlink()
    with pytest.raises(ConfigError, match="no token"):
        remote()
    assert remote(token="hgr_t") == ("http://127.0.0.1:8000/mcp", "hgr_t")
