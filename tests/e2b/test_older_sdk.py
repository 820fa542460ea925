"""The control plane driven by an ``e2b`` release a year older than the newest (installed apart
from the test environment by ``make test-deps``: one Python cannot import two versions of a
package), in a process of its own: code that pinned its SDK a year ago works on Hangar too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import requires_runsc

from .test_control_plane import _hangar

# The release of a year before 2.63.0 (e2b 2.8.1: 2025-12-01); the Makefile's E2B_OLDER.
OLDER = "2.8.1"
OLDER_DIR = Path(os.environ.get("HANGAR_TEST_E2B_OLDER_DIR", str(Path(sys.prefix) / f"e2b-{OLDER}")))

SCRIPT = r"""
import asyncio, json, sys, time
import e2b
from e2b import AsyncSandbox, AuthenticationException, NotFoundException, Sandbox, SandboxQuery
from e2b.sandbox.commands.command_handle import PtySize

def state(s):
    return getattr(s, "value", s)

out = {"file": e2b.__file__}
sbx = Sandbox.create("busybox", metadata={"suite": "older"}, envs={"FOO": "bar"}, timeout=120,
                     allow_internet_access=False)
sid = out["id"] = sbx.sandbox_id
info = sbx.get_info()
out["info"] = [info.sandbox_id, info.template_id, info.metadata, state(info.state), info.cpu_count,
               info.memory_mb, (info.end_at - info.started_at).total_seconds()]
run = sbx.commands.run("echo $FOO; echo err >&2", envs={"FOO": "from-run"})
out["run"] = [run.stdout, run.stderr, run.exit_code]
sbx.files.write("/tmp/older.txt", "kept")
out["read"] = sbx.files.read("/tmp/older.txt")
out["files"] = ["older.txt" in [e.name for e in sbx.files.list("/tmp")], sbx.files.exists("/tmp/older.txt"),
                sbx.files.exists("/tmp/none"), sbx.files.rename("/tmp/older.txt", "/tmp/moved.txt").path,
                sbx.files.read("/tmp/moved.txt")]
try:
    sbx.files.read("/tmp/missing.txt")
    out["missing"] = "read"
except NotFoundException:
    out["missing"] = "NotFoundException"
bg = sbx.commands.run("sleep 600", background=True)
out["background"] = [bg.pid in [p.pid for p in sbx.commands.list()], sbx.commands.kill(bg.pid)]
out["listed"] = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"suite": "older"})).next_items()]
sbx.set_timeout(600)
out["paused"] = sbx.beta_pause() if hasattr(sbx, "beta_pause") else sbx.pause()
out["paused_state"] = state(sbx.get_info().state)
again = Sandbox.connect(sid)
out["connected_state"] = state(again.get_info().state)
out["killed"] = again.kill()
try:
    Sandbox.get_info(sid)
    out["after_kill"] = "found"
except NotFoundException:
    out["after_kill"] = "NotFoundException"
try:
    Sandbox.create("busybox", api_key="hgr_not-a-real-key")
    out["wrong_key"] = "created"
except AuthenticationException:
    out["wrong_key"] = "AuthenticationException"


async def until(check):
    for _ in range(300):
        if check():
            return True
        await asyncio.sleep(0.05)
    return False


async def async_case():
    sbx = await AsyncSandbox.create("busybox", envs={"FOO": "bar"}, timeout=120, allow_internet_access=False)
    try:
        lines = []
        run = await sbx.commands.run("echo $FOO; echo err >&2", on_stdout=lines.append)
        out["async_run"] = [run.stdout, run.stderr, lines]
        await sbx.files.write("/tmp/a.txt", "async")
        out["async_files"] = [await sbx.files.read("/tmp/a.txt"), [e.name for e in await sbx.files.list("/tmp")],
                              await sbx.files.exists("/tmp/a.txt")]
        try:
            await sbx.files.read("/tmp/missing.txt")
            out["async_missing"] = "read"
        except NotFoundException:
            out["async_missing"] = "NotFoundException"
        bg = await sbx.commands.run("sleep 600", background=True)
        out["async_background"] = [bg.pid in [p.pid for p in await sbx.commands.list()],
                                   await sbx.commands.kill(bg.pid)]
        seen = bytearray()
        term = await sbx.pty.create(PtySize(rows=24, cols=80), on_data=seen.extend)
        await sbx.pty.send_stdin(term.pid, b"stty size\n")
        sized = await until(lambda: b"24 80" in seen)
        await sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
        await sbx.pty.send_stdin(term.pid, b"stty size\n")
        out["async_pty"] = [sized, await until(lambda: b"30 100" in seen), await sbx.pty.kill(term.pid)]
    finally:
        await sbx.kill()


asyncio.run(async_case())
print(json.dumps(out))
"""


@requires_runsc
@pytest.mark.timeout(240)
def test_an_sdk_a_year_older_sync_and_async_drives_sandboxes_commands_files_and_ptys(e2b, api, team_token):
    assert (OLDER_DIR / "e2b").is_dir(), f"e2b {OLDER} is not installed in {OLDER_DIR}: run `make test-deps`"
    env = {**os.environ, "PYTHONPATH": str(OLDER_DIR), "E2B_API_URL": e2b, "E2B_SANDBOX_URL": f"{e2b}/envd",
           "E2B_API_KEY": team_token}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=200
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["file"].startswith(str(OLDER_DIR))  # this release, not the test environment's
    sid = out["id"]
    assert out["info"][:4] == [sid, "busybox", {"suite": "older"}, "running"]
    assert out["info"][4:6] == [1, 512] and 100 < out["info"][6] <= 120
    assert out["run"] == ["from-run\n", "err\n", 0] and out["read"] == "kept"  # through envd
    assert (
        out["files"] == [True, True, False, "/tmp/moved.txt", "kept"]
        and out["missing"] == "NotFoundException"
    )
    assert out["background"] == [True, True]
    assert out["listed"] == [sid]
    assert out["paused"] in (True, None) and out["paused_state"] == "paused"
    assert out["connected_state"] == "running" and out["killed"] is True
    assert out["after_kill"] == "NotFoundException" and out["wrong_key"] == "AuthenticationException"
    assert _hangar(api, sid)["status"] in ("stopping", "deleted")
    # The async client of the same release: commands, files, a background command, a PTY resized.
    assert out["async_run"] == ["bar\n", "err\n", ["bar\n"]]
    assert out["async_files"][0] == "async" and "a.txt" in out["async_files"][1] and out["async_files"][2]
    assert out["async_missing"] == "NotFoundException" and out["async_background"] == [True, True]
    assert out["async_pty"] == [True, True, True]
