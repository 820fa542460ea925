"""Hangar's processes under `hangar up` and `hangar node`: each started in its own process
group with its log under ``<data dir>/logs/``, its warnings and errors echoed on the console,
and started again when it dies (a crash, an OOM kill, a library's unrecoverable error on a
Redis restart) rather than taking the rest down with it. One that keeps dying is given up on,
and everything stops, saying which and where its log is."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

Children = list[tuple[str, "subprocess.Popen[bytes]"]]

# A child that fails this many times in a row, each within HEALTHY_AFTER_S of being started, is
# in a crash loop and is not started again (systemd's StartLimitBurst, counted per run). One that
# ran longer than HEALTHY_AFTER_S was up and serving: its exit (a Redis restart that a library
# does not survive) starts the count afresh, however many came before. A SIGKILL is not the
# child failing but something outside ending it (the OOM killer, an operator, a test of faults):
# it is started again, after the same growing waits, and never given up on for it.
RESTART_LIMIT = 5
HEALTHY_AFTER_S = 60.0
# Waits before each start again: the first at once, then longer (a crash loop does not spin).
RESTART_DELAYS_S = (0.0, 1.0, 2.0, 5.0, 10.0)  # by how many exits RESTART_WINDOW_S has seen
RESTART_WINDOW_S = 300.0


def say(message: str) -> None:
    print(message, flush=True)


# Run before a child's own program (the same process: it execs): asks the kernel to SIGKILL it
# when the supervisor dies (PR_SET_PDEATHSIG survives exec), so a supervisor killed with
# SIGKILL leaves no worker or bridge behind, half-alive. If the supervisor is already gone
# (its pid is no longer our parent), it does not start at all. A wrapper rather than a
# preexec_fn: the supervisor has threads, and preexec_fn is not safe with threads.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)\n"  # PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def dies_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that it is killed when this process dies, however it dies."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


def start_child(name: str, argv: list[str], env: dict[str, str], logs: Path) -> subprocess.Popen[bytes]:
    """Start one of Hangar's processes in its own process group (Ctrl-C reaches only the
    supervisor, which stops them in order), its output appended to ``logs/<name>.log``; it
    dies with the supervisor (:func:`dies_with_parent`)."""
    with open(logs / f"{name}.log", "ab") as log:
        start = log.seek(0, os.SEEK_END)
        proc = subprocess.Popen(
            dies_with_parent(argv), env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT
        )
    _echo_problems(name, logs / f"{name}.log", start)
    return proc


def start_children(
    specs: list[tuple[str, list[str]]], env: dict[str, str], data_dir: Path, children: Children
) -> Path:
    """Start Hangar's processes (:func:`start_child`); the console shows Hangar's own lines and
    the children's warnings and errors (not Celery's banner, nor every request). Returns the
    logs' directory."""
    logs = data_dir / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    for name, argv in specs:
        children.append((name, start_child(name, argv, env, logs)))
    return logs


def restarter(
    specs: list[tuple[str, list[str]]], env: dict[str, str], logs: Path
) -> Callable[[str], subprocess.Popen[bytes]]:
    """What :func:`supervise` calls to start the child ``name`` again, as it was first started."""
    argv = dict(specs)
    return lambda name: start_child(name, argv[name], env, logs)


# A child's line worth a console line: a log record at warning or above, or a traceback.
_PROBLEM = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|^Traceback ")


def _echo_problems(name: str, path: Path, start: int) -> None:
    """Follow a child's log from ``start`` and say its warnings and errors (with a traceback's
    lines) on the console, prefixed with its name."""

    def follow() -> None:
        with open(path, errors="replace") as f:
            f.seek(start)
            in_traceback, partial = False, ""
            while True:
                partial += f.readline()
                if not partial.endswith("\n"):  # nothing new, or a line still being written
                    time.sleep(0.3)
                    continue
                line, partial = partial.rstrip("\n"), ""
                if in_traceback:  # its frames, then the exception's own line, which ends it
                    say(f"hangar[{name}]: {line}")
                    in_traceback = line[:1] in (" ", "\t")
                elif _PROBLEM.search(line):
                    say(f"hangar[{name}]: {line}")
                    in_traceback = line.startswith("Traceback ")

    threading.Thread(target=follow, name=f"log-{name}", daemon=True).start()


def supervise(children: Children, restart: Callable[[str], subprocess.Popen[bytes]] | None = None) -> int:
    """Reap, until SIGINT or SIGTERM (0) or a child that cannot be kept up (1). A child that
    exits is started again with ``restart`` (after RESTART_DELAYS_S), unless it has failed
    RESTART_LIMIT times in a row each within HEALTHY_AFTER_S of its start (a SIGKILL is not a
    failure); without ``restart``, any exit stops all."""
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    names = {proc.pid: name for name, proc in children}
    started = {name: time.monotonic() for name, _ in children}
    quick: dict[str, int] = {}  # failures in a row, each soon after its start
    deaths: dict[str, list[float]] = {}  # every exit within RESTART_WINDOW_S: the wait grows with them
    due: dict[str, float] = {}  # children to start again, and when
    # Woken by SIGCHLD, not a poll: an exited sandbox is reaped at once, and `runsc delete`
    # (a pause's or a resume's) waits for just that. Blocked in this thread only, after the
    # children started, so none of them inherits the mask.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    while not stop["signal"]:
        # Reap everything: our own children and the orphaned sandboxes we inherit.
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pid, status = 0, 0
        if pid in names:
            name = names.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            now = time.monotonic()
            ran = now - started.get(name, now)
            killed = code == -signal.SIGKILL
            if not killed:
                quick[name] = quick.get(name, 0) + 1 if ran < HEALTHY_AFTER_S else 1
            recent = [t for t in deaths.get(name, []) if now - t < RESTART_WINDOW_S] + [now]
            deaths[name] = recent
            if restart is None or quick.get(name, 0) >= RESTART_LIMIT:
                again = (f" {quick[name]} times in a row, each within {HEALTHY_AFTER_S:.0f} s of starting"
                         if restart is not None else "")  # fmt: skip
                say(f"hangar: {name} exited with status {code}{again}; stopping everything "
                    f"(its log: logs/{name}.log in the data dir)")  # fmt: skip
                return 1
            delay = RESTART_DELAYS_S[min(len(recent) - 1, len(RESTART_DELAYS_S) - 1)]
            say(f"hangar: {name} exited with status {code}; starting it again"
                f"{f' in {delay:.0f} s' if delay else ''} (its log: logs/{name}.log in the data dir)")  # fmt: skip
            due[name] = now + delay
        for name, at in list(due.items()):
            if time.monotonic() >= at and restart is not None:
                del due[name]
                proc = restart(name)
                names[proc.pid] = name
                started[name] = time.monotonic()
                children[:] = [(n, proc if n == name else p) for n, p in children]
        if pid == 0:
            signal.sigtimedwait({signal.SIGCHLD}, 0.2)  # a signal to stop is seen within 0.2 s
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    say("hangar: stopping…")
    return 0


def stop_all(children: list[tuple[str, subprocess.Popen[bytes]]], timeout: float = 15.0) -> None:
    for _, proc in children:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for _, proc in children:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for _, proc in children:
        # Whatever is left of each group (worker pool processes, a stuck child) goes too.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if proc.poll() is None:
            proc.wait(5)
