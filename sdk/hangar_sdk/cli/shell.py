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
from ._common import exit_status, fail, say


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


def interactive(sandbox: Any, *, cmd: list[str] | None = None, cwd: str | None = None,
                env: Mapping[str, str] | None = None) -> int:  # fmt: skip
    """Attach this terminal to a new terminal of ``sandbox`` until its shell exits; returns
    the shell's exit status. Any other way out is one line on stderr (said once the local
    terminal is itself again) and a non-zero status."""
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
    left: list[int] = []  # SIGTERM or SIGHUP

    # The handlers only wake the loop: an exception raised from a handler could land inside
    # the websocket's own code, midway through a frame.
    def on_winch(signum: int, frame: FrameType | None) -> None:
        os.write(wake_w, b"w")

    def on_leave(signum: int, frame: FrameType | None) -> None:
        left.append(signum)
        os.write(wake_w, b"t")

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
    try:
        signal.signal(signal.SIGWINCH, on_winch)
        signal.signal(signal.SIGTERM, on_leave)
        signal.signal(signal.SIGHUP, on_leave)
        if is_tty:
            tty.setraw(in_fd, termios.TCSANOW)
        reader.start()
        reading = True
        while not left:
            ready, _, _ = select.select([wake_r, in_fd] if reading else [wake_r], [], [])
            if wake_r in ready:
                woke = os.read(wake_r, 256)
                if b"x" in woke or b"t" in woke:
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
    except HangarError as exc:  # a send or a resize on a connection that has closed
        failure.append(exc)
    finally:
        if saved is not None:
            termios.tcsetattr(in_fd, termios.TCSADRAIN, saved)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        _end(term, exited=term.exit_info is not None)
        if reader.is_alive():
            reader.join(timeout=5)
        if not reader.is_alive():  # else it may still write to wake_w: left open, never reused
            os.close(wake_r)
            os.close(wake_w)
    if left:
        name = signal.Signals(left[0]).name
        fail(f"{name}: left terminal {term.id} of {sandbox.id} and ended its shell", 128 + left[0])
    if failure and not isinstance(failure[0], HangarError | OSError):
        raise failure[0]
    return _outcome(sandbox, term, failure[0] if failure else None)


def _outcome(sandbox: Any, term: Any, failure: BaseException | None) -> int:
    """The shell's exit status; when it did not exit by itself (killed, its sandbox deleted,
    the connection dropped), one line more that says what happened."""
    end = term.exit_info
    code = None if end is None else end.get("exit_code")
    signum = 0
    if end is not None:
        signum = int(end.get("signal") or 0) or (-int(code) if code is not None and int(code) < 0 else 0)
        if code is not None and not signum and not end.get("error"):
            return exit_status(end)
    gone = ""
    try:
        status = sandbox.refresh().status
    except HangarError as exc:
        gone = f"; sandbox {sandbox.id}: {exc.message}"
    else:
        if status != "running":
            gone = f"; sandbox {sandbox.id} is {status}"
    if end is not None:
        how = f"its shell was killed by signal {signum}" if signum else "its shell ended without a status"
        say(f"hangar: terminal {term.id}: {end.get('error') or how}{gone}")
        return 128 + signum if signum or code is None else int(code) & 0xFF
    if failure is not None:
        fail(
            f"{failure}{gone}" if isinstance(failure, HangarError) else f"terminal {term.id}: {failure}{gone}"
        )
    fail(f"terminal {term.id}: the connection closed before its shell exited{gone}")


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
