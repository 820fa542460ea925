"""``hangar sandbox shell`` and ``hangar harness shell``: the sandbox's terminal in this one.
The local terminal goes raw (every key, Ctrl-C included, goes to the remote shell), a window
resize (SIGWINCH) resizes the remote PTY, and the local terminal's settings come back on every
way out: the shell exiting, the connection dropping, an error, SIGTERM or SIGHUP."""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
from collections.abc import Mapping
from types import FrameType
from typing import Any

from .._errors import HangarError
from ._common import fail


def window_size(fd: int) -> tuple[int, int]:
    """(rows, cols) of the terminal on ``fd``; 24x80 when it is not one."""
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 24, 80
    return size.lines or 24, size.columns or 80


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class _Leave(Exception):
    """SIGTERM or SIGHUP: leave through the ``finally`` that restores the terminal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def interactive(sandbox: Any, *, cmd: list[str] | None = None, cwd: str | None = None,
                env: Mapping[str, str] | None = None) -> int:  # fmt: skip
    """Attach this terminal to a new terminal of ``sandbox`` until its shell exits; returns
    the shell's exit status."""
    try:
        import termios
        import tty
    except ImportError:  # not a POSIX system
        fail("hangar shell needs a POSIX terminal (Linux, macOS)")
    in_fd, out_fd = sys.stdin.fileno(), sys.stdout.fileno()
    is_tty = os.isatty(in_fd)
    rows, cols = window_size(in_fd if is_tty else out_fd)
    remote_env = {"TERM": os.environ.get("TERM") or "xterm-256color", **(env or {})}
    term = sandbox.terminal(cmd, cwd=cwd, env=remote_env, rows=rows, cols=cols)
    saved = termios.tcgetattr(in_fd) if is_tty else None
    wake_r, wake_w = os.pipe()
    failure: list[BaseException] = []

    def on_winch(signum: int, frame: FrameType | None) -> None:
        os.write(wake_w, b"w")

    def on_leave(signum: int, frame: FrameType | None) -> None:
        raise _Leave(signum)

    def pump_out() -> None:
        try:
            while data := term.recv():
                _write_all(out_fd, data)
        except BaseException as exc:  # reported by the main thread
            failure.append(exc)
        finally:
            os.write(wake_w, b"x")

    reader = threading.Thread(target=pump_out, name="terminal-out", daemon=True)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGWINCH, signal.SIGTERM, signal.SIGHUP)}
    done = False
    try:
        signal.signal(signal.SIGWINCH, on_winch)
        signal.signal(signal.SIGTERM, on_leave)
        signal.signal(signal.SIGHUP, on_leave)
        if is_tty:
            tty.setraw(in_fd, termios.TCSANOW)
        reader.start()
        reading = True
        while True:
            ready, _, _ = select.select([wake_r, in_fd] if reading else [wake_r], [], [])
            if wake_r in ready:
                woke = os.read(wake_r, 256)
                if b"x" in woke:
                    break
                if b"w" in woke and is_tty:
                    term.resize(*window_size(in_fd))
            if in_fd in ready:
                data = os.read(in_fd, 65536)
                if data:
                    term.send(data)
                else:  # local end of input: the remote shell gets end-of-file too
                    term.send(b"\x04")
                    reading = False
        if failure and not isinstance(failure[0], HangarError | OSError):
            raise failure[0]
        if failure:
            fail(f"the terminal failed: {failure[0]}")
        done = term.exit_code is not None
        return term.exit_code if term.exit_code is not None else 1
    except _Leave as leave:
        return 128 + leave.signum
    finally:
        if saved is not None:
            termios.tcsetattr(in_fd, termios.TCSADRAIN, saved)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        _end(term, exited=done)
        if reader.is_alive():
            reader.join(timeout=5)
        if not reader.is_alive():  # else it may still write to wake_w: left open, never reused
            os.close(wake_r)
            os.close(wake_w)


def _end(term: Any, *, exited: bool) -> None:
    """Leave the terminal; a shell this command started and left running (an error, a signal)
    is ended too: nobody could come back to it from here."""
    try:
        if exited:
            term.close()
        else:
            term.kill()
    except Exception:  # the connection or the server is already gone
        pass
