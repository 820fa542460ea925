"""``hangar sandbox shell`` under a real PTY, as a person at a terminal uses it: the installed
``hangar`` command on the PTY, a command typed and its output read, a window resize seen by
``stty size`` inside, Ctrl-C reaching the remote command, the shell's exit status; and on every
way out (the shell exiting, SIGTERM, the sandbox deleted or the terminal killed from outside)
one line and no traceback, and the local terminal's settings as they were."""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.cli.conftest import HANGAR, Cli
from tests.support import requires_runsc, wait_until

pytestmark = [requires_runsc, pytest.mark.timeout(180)]


def _set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class Screen:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.seen = b""

    def expect(self, marker: bytes, timeout: float = 30.0) -> bytes:
        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"{marker!r} never came; the screen had: {self.seen[-2000:]!r}"
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:
                    chunk = b""
                assert chunk, f"the terminal closed before {marker!r}; it had: {self.seen[-2000:]!r}"
                self.seen += chunk
        at = self.seen.index(marker) + len(marker)
        out, self.seen = self.seen[:at], self.seen[at:]
        return out

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)


@contextmanager
def shell_on_a_pty(cli: Cli, sid: str) -> Iterator[tuple[subprocess.Popen[bytes], Screen, int]]:
    """``hangar sandbox shell SID`` on a new PTY whose slave is its controlling terminal (so a
    resize signals it, as a terminal emulator's does). Yields the process, the screen and the
    slave (kept open here: its settings are the local terminal's, to compare after)."""
    fd, slave = os.openpty()
    _set_size(slave, 30, 100)
    child = subprocess.Popen([str(HANGAR), "sandbox", "shell", sid], stdin=slave, stdout=slave, stderr=slave,
                             env=cli.env, start_new_session=True,
                             preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))  # fmt: skip
    try:
        yield child, Screen(fd), slave
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        os.close(fd)
        os.close(slave)


def _new_sandbox(cli: Cli) -> str:
    made = cli("sandbox", "create", "--image", "busybox", "--memory-mb", "256", "--json")
    assert made.returncode == 0, made.stderr
    return str(json.loads(made.stdout)["id"])


def _one_line_after(screen: Screen, child: subprocess.Popen[bytes], code: int) -> str:
    """Wait for the CLI to exit with ``code``; what it wrote after the remote shell's output,
    which must be one ``hangar: …`` line and no traceback."""
    assert child.wait(timeout=30) == code
    screen.expect(b"hangar: ", timeout=5)
    rest = screen.seen
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline and select.select([screen.fd], [], [], 0.2)[0]:
        try:
            rest += os.read(screen.fd, 65536)
        except OSError:
            break
    text = rest.decode(errors="replace")
    assert "Traceback" not in text and text.rstrip("\r\n").count("\n") == 0, text
    return text.strip()


def test_the_shell_is_a_terminal_here(cli):
    sid = _new_sandbox(cli)
    try:
        with shell_on_a_pty(cli, sid) as (child, screen, slave):
            before = termios.tcgetattr(slave)
            screen.send(b"echo typed-$((6*7))\r")
            screen.expect(b"typed-42")
            assert termios.tcgetattr(slave) != before  # raw while the shell is open
            screen.send(b"stty size\r")
            screen.expect(b"30 100")
            _set_size(screen.fd, 40, 120)  # the local window changes: SIGWINCH, then the remote PTY's
            time.sleep(0.5)
            screen.send(b"stty size\r")
            screen.expect(b"40 120")
            screen.send(b"sleep 60; echo not-interrupted\r")
            time.sleep(1.0)
            started = time.monotonic()
            screen.send(b"\x03")  # Ctrl-C: to the remote sleep, not to the local CLI
            screen.send(b"echo after-$((1+1))\r")
            screen.expect(b"after-2", timeout=20)
            assert time.monotonic() - started < 20  # not the 60 s of the sleep
            screen.send(b"exit 7\r")
            assert child.wait(timeout=20) == 7
            assert termios.tcgetattr(slave) == before
    finally:
        cli("sandbox", "rm", sid)


def test_sigterm_restores_the_terminal_and_ends_the_remote_shell(cli, server, team_token):
    sid = _new_sandbox(cli)
    try:
        with shell_on_a_pty(cli, sid) as (child, screen, slave):
            before = termios.tcgetattr(slave)
            screen.send(b"echo up-$((2*3))\r")
            screen.expect(b"up-6")
            assert termios.tcgetattr(slave) != before
            child.send_signal(signal.SIGTERM)
            line = _one_line_after(screen, child, 128 + signal.SIGTERM)
            assert "SIGTERM" in line and "ended its shell" in line, line
            assert termios.tcgetattr(slave) == before
        # Nobody could come back to the shell it left: it was ended, not left running.
        terminals = f"{server}/api/v1/sandboxes/{sid}/terminals"
        auth = {"Authorization": f"Bearer {team_token}"}
        wait_until(lambda: all(t["status"] != "running" for t in httpx.get(terminals, headers=auth).json()),
                   20, what="the remote shell ended")  # fmt: skip
    finally:
        cli("sandbox", "rm", sid)


def test_the_sandbox_deleted_from_outside_ends_the_shell_with_one_line(cli):
    sid = _new_sandbox(cli)
    try:
        with shell_on_a_pty(cli, sid) as (child, screen, slave):
            before = termios.tcgetattr(slave)
            screen.send(b"echo up-$((2*4))\r")
            screen.expect(b"up-8")
            gone = cli("sandbox", "rm", sid)
            assert gone.returncode == 0, gone.stderr
            assert child.wait(timeout=60) != 0
            line = _one_line_after(screen, child, child.returncode)
            assert sid in line and ("deleted" in line or "stopping" in line), line
            assert termios.tcgetattr(slave) == before
    finally:
        cli("sandbox", "rm", sid)


def test_the_terminal_killed_from_outside_ends_the_shell_with_one_line(cli, server, team_token):
    sid = _new_sandbox(cli)
    terminals = f"{server}/api/v1/sandboxes/{sid}/terminals"
    auth = {"Authorization": f"Bearer {team_token}"}
    try:
        with shell_on_a_pty(cli, sid) as (child, screen, slave):
            before = termios.tcgetattr(slave)
            screen.send(b"echo up-$((2*5))\r")
            screen.expect(b"up-10")
            (term,) = [t for t in httpx.get(terminals, headers=auth).json() if t["status"] == "running"]
            assert httpx.delete(f"{terminals}/{term['id']}", headers=auth).status_code == 204
            line = _one_line_after(screen, child, 128 + signal.SIGKILL)  # its process group was killed
            assert term["id"] in line and "killed by signal 9" in line, line
            assert termios.tcgetattr(slave) == before
    finally:
        cli("sandbox", "rm", sid)
