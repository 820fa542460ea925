"""``hangar sandbox shell`` when the websocket fails, behind a proxy in front of the real
server: a handshake refused, and a connection cut while the shell is open. Each is one
``hangar: …`` line on stderr, no traceback, a non-zero status, and no shell left running."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time

import httpx
import pytest

from tests.cli.conftest import HANGAR, Cli
from tests.cli.gate import WebsocketGate
from tests.support import requires_runsc, wait_until

pytestmark = [requires_runsc, pytest.mark.timeout(180)]


def _one_line(stderr: str) -> str:
    assert "Traceback" not in stderr and stderr.startswith("hangar: ") and stderr.count("\n") == 1, stderr
    return stderr.strip()


def _no_shell_left(server: str, token: str, sid: str) -> None:
    url = f"{server}/api/v1/sandboxes/{sid}/terminals"
    auth = {"Authorization": f"Bearer {token}"}
    wait_until(lambda: all(t["status"] != "running" for t in httpx.get(url, headers=auth).json()), 20,
               what="no terminal left running")  # fmt: skip


@pytest.fixture
def sid(cli: Cli):
    made = cli("sandbox", "create", "--image", "busybox", "--memory-mb", "256", "--json")
    assert made.returncode == 0, made.stderr
    sandbox_id = json.loads(made.stdout)["id"]
    yield sandbox_id
    cli("sandbox", "rm", sandbox_id)


def test_a_refused_websocket_is_one_line(cli, sid, server, team_token):
    gate = WebsocketGate(server, refuse_websockets=502)
    try:
        refused = cli("sandbox", "shell", sid, input="", env={"HANGAR_URL": gate.url})
    finally:
        gate.close()
    assert gate.upgrades == 1 and refused.returncode == 1
    line = _one_line(refused.stderr)
    assert "websocket was refused with HTTP 502" in line, line
    _no_shell_left(server, team_token, sid)


def test_a_connection_cut_while_the_shell_is_open_is_one_line(cli, sid, server, team_token):
    gate = WebsocketGate(server)
    shell = subprocess.Popen([str(HANGAR), "sandbox", "shell", sid], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env={**cli.env, "HANGAR_URL": gate.url})  # fmt: skip
    assert shell.stdin is not None and shell.stdout is not None and shell.stderr is not None
    try:
        shell.stdin.write(b"echo ready-$((1+1))\n")
        shell.stdin.flush()
        seen, deadline = b"", time.monotonic() + 30
        while b"ready-2" not in seen:
            assert time.monotonic() < deadline, seen
            if select.select([shell.stdout], [], [], 1)[0]:
                seen += os.read(shell.stdout.fileno(), 65536)
        gate.cut()
        try:  # typing on into a connection that is gone
            shell.stdin.write(b"echo after-the-cut\n")
            shell.stdin.flush()
        except BrokenPipeError:  # the CLI had already left
            pass
        assert shell.wait(timeout=30) == 1
        line = _one_line(shell.stderr.read().decode())
    finally:
        if shell.poll() is None:
            shell.kill()
            shell.wait()
        gate.close()
    assert "terminal" in line and ("closed" in line or "connection" in line), line
    _no_shell_left(server, team_token, sid)
