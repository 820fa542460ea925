"""The async ``e2b`` SDK (``AsyncSandbox``) from PyPI against the real server, worker, bridge and
runsc sandboxes: what the sync SDK's tests cover in tests/e2b/test_envd.py and
test_control_plane.py, the async client does too. One sandbox serves every case that only runs
commands and reads or writes files."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from e2b import (
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    NotFoundException,
    SandboxState,
)
from e2b.sandbox.commands.command_handle import PtySize

from tests.support import requires_runsc


async def _until(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _commands(sbx: AsyncSandbox) -> None:
    # Create-time envs reach every command; a command's own envs add to them, for that command only.
    assert (await sbx.commands.run('printf %s "$CREATED"')).stdout == "at-create"
    r = await sbx.commands.run('printf "%s %s" "$CREATED" "$FOO"', envs={"CREATED": "per-run", "FOO": "bar"})
    assert r.stdout == "per-run bar"
    assert (await sbx.commands.run('printf "%s %s" "$CREATED" "$FOO"')).stdout == "at-create "
    assert (await sbx.commands.run("pwd", cwd="/tmp")).stdout == "/tmp\n"
    with pytest.raises(CommandExitException) as failed:
        await sbx.commands.run("echo nope >&2; exit 3")
    assert failed.value.exit_code == 3 and failed.value.stderr == "nope\n"

    # on_stdout hears a line as it is written: the first one long before the command ends.
    heard: list[tuple[float, str]] = []
    r = await sbx.commands.run("echo first; sleep 2; echo second",
                               on_stdout=lambda line: heard.append((time.monotonic(), line)))  # fmt: skip
    ended = time.monotonic()
    assert [line for _, line in heard] == ["first\n", "second\n"] and r.stdout == "first\nsecond\n"
    assert ended - heard[0][0] > 1.5, ended - heard[0][0]

    # A background command: listed, reconnected by pid (its new output heard there), killed.
    proc = await sbx.commands.run("read line; echo got $line; sleep 600", background=True, stdin=True)
    assert proc.pid in {p.pid for p in await sbx.commands.list()}
    followed: list[str] = []
    follower = await sbx.commands.connect(proc.pid, on_stdout=followed.append)
    await sbx.commands.send_stdin(proc.pid, "hello\n")
    await _until(lambda: "".join(followed) == "got hello\n", 15, "the reconnected command's output")
    assert await sbx.commands.kill(proc.pid) is True
    with pytest.raises(CommandExitException):  # the follower sees it end, killed
        await asyncio.wait_for(follower.wait(), 15)
    assert proc.pid not in {p.pid for p in await sbx.commands.list()}
    assert await sbx.commands.kill(proc.pid) is False  # gone: the SDK's answer for not_found
    with pytest.raises(NotFoundException):
        await sbx.commands.connect(proc.pid)


async def _files(sbx: AsyncSandbox) -> None:
    info = await sbx.files.write("/work/dir/hello.txt", "héllo\n")
    assert info.path == "/work/dir/hello.txt" and info.name == "hello.txt"
    assert await sbx.files.read("/work/dir/hello.txt") == "héllo\n"
    assert (await sbx.commands.run("cat /work/dir/hello.txt")).stdout == "héllo\n"  # where commands see it
    assert await sbx.files.exists("/work/dir/hello.txt") is True
    assert await sbx.files.exists("/work/none") is False
    assert await sbx.files.make_dir("/work/new/deeper") is True
    assert await sbx.files.make_dir("/work/new/deeper") is False  # already there
    moved = await sbx.files.rename("/work/dir/hello.txt", "/work/new/hello.txt")
    assert moved.path == "/work/new/hello.txt" and not await sbx.files.exists("/work/dir/hello.txt")
    assert await sbx.files.read("/work/new/hello.txt") == "héllo\n"
    await sbx.files.remove("/work/new")
    assert not await sbx.files.exists("/work/new/hello.txt") and not await sbx.files.exists("/work/new")
    with pytest.raises(NotFoundException):
        await sbx.files.read("/work/missing.txt")
    with pytest.raises(NotFoundException):
        await sbx.files.rename("/work/missing.txt", "/work/x")


async def _pty(sbx: AsyncSandbox) -> None:
    seen = bytearray()
    term = await sbx.pty.create(PtySize(rows=24, cols=80), on_data=seen.extend)
    await sbx.pty.send_stdin(term.pid, b"stty size; echo mark-$((6*7))\n")
    await _until(lambda: b"mark-42" in seen, 15, "the PTY's answer")
    assert b"24 80" in seen, bytes(seen)
    await sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
    await sbx.pty.send_stdin(term.pid, b"stty size\n")
    await _until(lambda: b"30 100" in seen, 15, "the new size")
    assert await sbx.pty.kill(term.pid) is True
    with pytest.raises(CommandExitException):  # its stream ends with it, killed
        await asyncio.wait_for(term.wait(), 15)


@requires_runsc
def test_async_sdk_commands_files_pty_pause_and_connect_on_one_sandbox(e2b):
    async def scenario() -> None:
        sbx = await AsyncSandbox.create("busybox", envs={"CREATED": "at-create"}, timeout=120,
                                        allow_internet_access=False)  # fmt: skip
        try:
            await _commands(sbx)
            await _files(sbx)
            await _pty(sbx)

            # A wrong key is refused, at create and at connect.
            with pytest.raises(AuthenticationException):
                await AsyncSandbox.create("busybox", api_key="hgr_not-a-real-key")
            with pytest.raises(AuthenticationException):
                await AsyncSandbox.connect(sbx.sandbox_id, api_key="hgr_not-a-real-key")

            # Paused, then connected: running again, with its files.
            await sbx.files.write("/work/kept.txt", "kept")
            assert await sbx.pause() is True
            assert (await sbx.get_info()).state == SandboxState.PAUSED
            again = await AsyncSandbox.connect(sbx.sandbox_id, timeout=120)
            assert await again.is_running() is True
            assert await again.files.read("/work/kept.txt") == "kept"
            assert (await again.commands.run("cat /work/kept.txt")).stdout == "kept"
            assert (await again.commands.run('printf %s "$CREATED"')).stdout == "at-create"
        finally:
            await sbx.kill()

    asyncio.run(scenario())
