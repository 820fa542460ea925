"""``hangar sandbox shell`` under a real PTY, as a person at a terminal uses it: a command
typed and its output read, a window resize seen by ``stty size`` inside, Ctrl-C reaching the
remote command, the shell's exit status, and the local terminal's settings restored."""

from __future__ import annotations

import fcntl
import json
import os
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

from tests.support import requires_runsc

pytestmark = [requires_runsc, pytest.mark.timeout(180)]

# Runs the CLI's main on the PTY, then says whether the terminal's settings are as they were.
CHILD = """
import sys, termios
from hangar_sdk.cli import main
before = termios.tcgetattr(0)
code = main(["sandbox", "shell", sys.argv[1]])
after = termios.tcgetattr(0)
print("\\r\\nLOCAL-TERMINAL-" + ("RESTORED" if after == before else f"CHANGED {before} {after}"), flush=True)
sys.exit(code)
"""


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


def test_the_shell_is_a_terminal_here(cli):
    sid = json.loads(cli("sandbox", "create", "--image", "busybox", "--memory-mb", "256", "--json").stdout)[
        "id"
    ]
    try:
        fd, slave = os.openpty()
        _set_size(slave, 30, 100)
        # The CLI on the PTY's slave side, which is its controlling terminal (so a resize
        # signals it, as a terminal emulator's does).
        child = subprocess.Popen([sys.executable, "-c", CHILD, sid], stdin=slave, stdout=slave, stderr=slave,
                                 env=cli.env, start_new_session=True,
                                 preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))  # fmt: skip
        os.close(slave)
        screen = Screen(fd)
        try:
            screen.send(b"echo typed-$((6*7))\r")
            screen.expect(b"typed-42")
            screen.send(b"stty size\r")
            screen.expect(b"30 100")
            _set_size(fd, 40, 120)  # the local window changes: SIGWINCH, then the remote PTY's size
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
            screen.expect(b"LOCAL-TERMINAL-RESTORED")
            code = child.wait(timeout=20)
        except BaseException:
            child.kill()
            child.wait()
            raise
        finally:
            os.close(fd)
        assert code == 7
    finally:
        cli("sandbox", "rm", sid)
