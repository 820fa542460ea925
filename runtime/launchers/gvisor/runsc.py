"""Invoking ``runsc``: which one, its flags, and what it says about a sandbox."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

from ...host.network import unshare_wrapper
from ..base import LauncherError

NEWER_RUNSC = "/usr/local/lib/hangar/runsc"
# ptrace works everywhere, and on the 2-CPU VM Hangar is developed on it ran an exec in
# ~11 ms where the newer runsc's own default, systrap, took ~42 ms (measured, both runsc
# 20240729). Nodes with KVM (bare metal) can set HANGAR_RUNSC_PLATFORM=kvm.
DEFAULT_PLATFORM = "ptrace"

log = logging.getLogger(__name__)


def default_runsc() -> str:
    """The runsc to use when none is configured: the newer one ``scripts/install-runsc.sh``
    puts beside Debian 12's (which cannot ``statx`` and always compresses checkpoints), else
    the one on PATH."""
    return NEWER_RUNSC if os.access(NEWER_RUNSC, os.X_OK) else "runsc"


def run(argv: list[str], *, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        raise LauncherError(f"{argv[0]} not found: install it (apt-get install runsc)") from exc
    except subprocess.TimeoutExpired as exc:
        raise LauncherError(f"{' '.join(argv[:4])} timed out after {timeout:.0f}s") from exc
    if check and proc.returncode != 0:
        raise LauncherError(f"{' '.join(argv[:5])} failed: {proc.stderr.strip()[-500:]}")
    return proc


def wait_blocking(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Wait for ``proc`` in the kernel; kill it after ``timeout`` (then None). Python's own
    ``wait(timeout=…)`` polls with sleeps growing to 50 ms, which added ~35 ms to every
    ``runsc run`` (it returns after ~130 ms; the poll noticed at ~165 ms)."""
    expired = threading.Event()

    def kill() -> None:
        expired.set()
        proc.kill()

    timer = threading.Timer(timeout, kill)
    timer.daemon = True
    timer.start()
    try:
        returncode = proc.wait()
    finally:
        timer.cancel()
    return None if expired.is_set() else returncode


def exited(pid: int) -> bool:
    """Whether host process ``pid`` is gone or a zombie."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


def wait_exited(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not exited(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


class Runsc:
    """One runsc binary with one state root (``--root``), as this node's gVisor launcher runs it."""

    def __init__(self, binary: str, root: Path, platform: str = DEFAULT_PLATFORM,
                 extra_flags: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.binary = binary
        self.root = root
        self.platform = platform
        self.extra_flags = tuple(extra_flags)
        self._help: dict[str, str] = {}

    def argv(self, *args: str, network: bool = False) -> list[str]:
        flags = [
            self.binary,
            "--root",
            str(self.root),
            "--network=sandbox" if network else "--network=none",
            "--host-uds=create",
            "--overlay2=none",
        ]
        if self.platform:
            flags.append(f"--platform={self.platform}")
        if network and self.knows("flags", "-net-disconnect-ok"):
            # gVisor cannot save a TCP connection to outside the sandbox (the peer's side is not
            # saved with it), and without this refuses the whole checkpoint while one is open,
            # even one in its last ACK. With it, such connections are reset on the checkpoint,
            # as a peer would see after any pause; connections inside the sandbox are saved.
            flags.append("--net-disconnect-ok")
        return [*flags, *self.extra_flags, *args]

    def __call__(
        self, *args: str, timeout: float = 30.0, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        return run(self.argv(*args), timeout=timeout, check=check)

    def knows(self, command: str, flag: str) -> bool:
        """Whether this runsc's ``command`` (``flags`` for global ones) lists ``flag``."""
        if command not in self._help:
            argv = [self.binary, "flags"] if command == "flags" else [self.binary, command, "--help"]
            proc = run(argv, check=False)
            self._help[command] = proc.stdout + proc.stderr
        return flag in self._help[command]

    def checkpoint_flags(self) -> tuple[str, ...]:
        # Newer runsc (2024) can skip compressing the saved memory: writing it plainly is several
        # times faster (flate runs at ~150 MB/s on one core) at the cost of disk. Older ones
        # always compress.
        return ("--compression=none",) if self.knows("checkpoint", "-compression") else ()

    def has_state(self, sandbox_id: str) -> bool:
        # runsc keeps `<id>_sandbox:<id>.state` (and a lock) per container under its root; a
        # glob is much cheaper than spawning `runsc state` on the hot path.
        return self.root.exists() and any(self.root.glob(f"*{sandbox_id}*"))

    def state(self, sandbox_id: str) -> tuple[str, int]:
        """runsc's status of the sandbox, and the host PID of its process (0 if none).
        ``unknown`` when runsc could not tell (it failed for another reason than the sandbox not
        existing, or timed out): a busy host must not pass for a lost sandbox."""
        try:
            proc = self("state", sandbox_id, timeout=15)
        except LauncherError as exc:
            log.warning("runsc state %s: %s", sandbox_id, exc)
            return "unknown", 0
        if proc.returncode != 0:
            if "does not exist" in proc.stderr or "not found" in proc.stderr.lower():
                return "missing", 0
            log.warning("runsc state %s failed: %s", sandbox_id, proc.stderr.strip()[-300:])
            return "unknown", 0
        try:
            state = json.loads(proc.stdout)
        except ValueError:
            log.warning("runsc state %s answered what is not JSON: %.200s", sandbox_id, proc.stdout)
            return "unknown", 0
        status = str(state.get("status", "missing"))
        pid = state.get("pid")
        pid = pid if isinstance(pid, int) else 0
        # Newer runsc (2024) says "running" for as long as the sandbox's process exists, and one
        # that exited (after a checkpoint, say) is a zombie until the host's init reaps it (a
        # second or more): a restore took it for running. Older runsc says "stopped" at once.
        if status == "running" and exited(pid):
            return "stopped", pid
        return status, pid

    def status(self, sandbox_id: str) -> str:
        return self.state(sandbox_id)[0]

    def ids(self) -> set[str]:
        """The containers runsc has a record of under this root."""
        proc = self("list", "--format=json")
        if proc.returncode != 0 or proc.stdout.strip() in ("", "null"):
            return set()
        with contextlib.suppress(ValueError, TypeError, KeyError):
            return {c["id"] for c in json.loads(proc.stdout)}
        return set()

    def kill(self, sandbox_id: str, signal: str, *, all_processes: bool = False) -> None:
        self("kill", *(["--all"] if all_processes else []), sandbox_id, signal)

    def delete(self, sandbox_id: str) -> None:
        self("delete", "--force", sandbox_id)

    def start(self, log_path: Path, *args: str, network: bool = False) -> None:
        """``runsc run|restore --detach …``; raises LauncherError with runsc's words. With a
        ``network``, runsc runs with its own network stack, wrapped (see host/network.py)."""
        argv = unshare_wrapper(self.argv(*args, network=True)) if network else self.argv(*args)
        # The sandbox inherits runsc's stdio and keeps it open for its whole life: give it a
        # log file, never a pipe we would wait on.
        with open(log_path, "ab") as log:
            start = log.tell()
            returncode = wait_blocking(
                subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
                ),
                timeout=120,
            )
        if returncode is None:
            raise LauncherError(f"runsc {args[0]} did not finish within 120 s")
        if returncode != 0:
            with open(log_path, "rb") as log:
                log.seek(max(start, log.seek(0, os.SEEK_END) - 800))
                err = log.read(800).decode(errors="replace").strip()
            raise LauncherError(f"runsc {args[0]} failed: {err}")
