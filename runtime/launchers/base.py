"""The launcher interface: what every isolation runtime on a node implements.

Shaped like jupyter_client's kernel provisioners: a small typed surface, a persisted
``handle`` (a plain dict) so a restarted node re-adopts the sandboxes it already runs, and
registration by name through the ``hangar.launchers`` entry point group. Nothing here imports
Django: a node can run and test launchers with no database.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OutputCallback = Callable[[str, bytes], None]


class LauncherError(Exception):
    """A runtime operation failed; the message is safe to show to the sandbox's owner."""


class SandboxNotRunning(LauncherError):
    """The sandbox exists on the node but its processes are gone (or it never started)."""

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


class SandboxGone(LauncherError):
    """The node has no trace of the sandbox."""


class FileOpError(LauncherError):
    """A file operation inside the sandbox failed (``errno_name`` is e.g. ``ENOENT``)."""

    def __init__(self, errno_name: str, message: str) -> None:
        super().__init__(f"{errno_name}: {message}")
        self.errno_name = errno_name
        self.message = message


@dataclass(frozen=True)
class Mount:
    source: str
    destination: str
    read_only: bool = False


@dataclass(frozen=True)
class SandboxSpec:
    """Everything a launcher needs to start one sandbox."""

    id: str
    rootfs: Path
    cpu: float = 1.0
    memory_mb: int = 512
    env: dict[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    hostname: str = "sandbox"
    working_dir: str = "/"
    # The egress policy, {"egress": "none" | "allowlist" | "all", "allow": [...]}; with
    # egress other than none the sandbox gets a network of its own (see network.py).
    network: dict[str, Any] | None = None
    # The size of its writable layer (every file it writes outside volumes): None for the
    # launcher's default, 0 for no limit of its own (the node's filesystem is the limit).
    disk_mb: int | None = None


@dataclass
class ExecRequest:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    stdin: bytes | None = None
    timeout: float | None = None
    max_output: int | None = None


@dataclass
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_ms: float
    timed_out: bool = False
    signal: int = 0
    truncated: bool = False


@dataclass
class ProcessRequest:
    """A command to start and keep talking to: stdin, resize and signals while it runs."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    tty: bool = False
    rows: int = 24
    cols: int = 80
    stdin: bool = True
    timeout: float | None = None


@dataclass(frozen=True)
class ProcessExit:
    exit_code: int
    signal: int = 0
    timed_out: bool = False


class Process(abc.ABC):
    """A live command inside a sandbox, shaped like ``subprocess.Popen`` with pipes.

    ``events()`` blocks; it yields ``("stdout"|"stderr", bytes)`` as output arrives (a TTY
    gives stdout only) and ends with ``("exit", ProcessExit)``. Not reading it holds the
    command back once the buffers between are full: that is the flow control. Closing the
    process kills its whole process group if it still runs."""

    pid: int

    @abc.abstractmethod
    def events(self) -> Iterator[tuple[str, bytes | ProcessExit]]: ...

    @abc.abstractmethod
    def send_stdin(self, data: bytes) -> None: ...

    @abc.abstractmethod
    def close_stdin(self) -> None: ...

    @abc.abstractmethod
    def resize(self, rows: int, cols: int) -> None: ...

    @abc.abstractmethod
    def send_signal(self, sig: int) -> None:
        """Signal the command's process group."""

    @abc.abstractmethod
    def close(self) -> None: ...


@dataclass(frozen=True)
class FileEntry:
    name: str
    path: str
    type: str
    size: int
    mode: int
    mtime: float


@dataclass(frozen=True)
class RuntimeState:
    """What the node sees for one sandbox: ``running``, ``paused``, ``stopped`` or ``missing``."""

    status: str
    reason: str | None = None


@dataclass(frozen=True)
class Stats:
    cpu_seconds: float
    memory_bytes: int
    memory_limit_bytes: int
    pids: int = 0
    disk_bytes: int = 0  # used by its writable layer (0 when unknown)
    disk_limit_bytes: int = 0  # 0: no limit of its own


Handle = dict[str, Any]


class Launcher(abc.ABC):
    """One isolation runtime on one node. Every method is safe to call twice."""

    name: str = ""

    @abc.abstractmethod
    def create(self, spec: SandboxSpec) -> Handle:
        """Create and start the sandbox; return once its agent answers. Returns the handle to persist."""

    @abc.abstractmethod
    def exec(
        self, handle: Handle, request: ExecRequest, on_output: OutputCallback | None = None
    ) -> ExecResult:
        """Run one command to completion (or timeout), streaming output to ``on_output``."""

    @abc.abstractmethod
    def open_process(self, handle: Handle, request: ProcessRequest) -> Process:
        """Start a command and return it live (with or without a TTY). Raises
        :class:`FileOpError` when it cannot start (no such binary or cwd)."""

    @abc.abstractmethod
    def read_file(self, handle: Handle, path: str) -> tuple[FileEntry, Iterator[bytes]]:
        """Stream a file's bytes, resolved inside the sandbox."""

    @abc.abstractmethod
    def write_file(self, handle: Handle, path: str, data: bytes | Iterable[bytes], mode: int = 0o644) -> int:
        """Write (atomically replace) a file inside the sandbox; returns bytes written."""

    @abc.abstractmethod
    def list_files(self, handle: Handle, path: str) -> list[FileEntry]:
        """List a directory inside the sandbox (symlinks are reported, never followed)."""

    @abc.abstractmethod
    def stop(self, handle: Handle, timeout: float = 5.0) -> None:
        """Stop every process of the sandbox (SIGTERM, then SIGKILL after ``timeout``)."""

    @abc.abstractmethod
    def suspend(self, sandbox_id: str, keep_files: bool = True) -> None:
        """End every process of the sandbox and free its CPU and memory, keeping what it wrote
        to its root filesystem (unless ``keep_files`` is false) so that :meth:`create` with the
        same id starts it again over the same files. Idempotent."""

    #: Whether :meth:`checkpoint` and :meth:`restore` work with this runtime.
    can_checkpoint = False

    def checkpoint(self, sandbox_id: str) -> None:
        """Save the running sandbox whole (processes, memory, open files) to the node's disk
        and free its CPU and memory; :meth:`restore` continues it. Idempotent: a repeated
        call after a completed checkpoint only finishes releasing the runtime. If it raises,
        the sandbox may be gone (the runtime stops it either way): fall back to
        :meth:`suspend`, which keeps its files."""
        raise LauncherError(f"the {self.name} runtime cannot checkpoint a sandbox")

    def restore(self, spec: SandboxSpec) -> Handle:
        """Continue a sandbox saved by :meth:`checkpoint`. If it raises, the saved state is
        discarded, and :meth:`create` starts the sandbox afresh over its kept files."""
        raise LauncherError(f"the {self.name} runtime cannot restore a sandbox")

    #: Whether sandboxes of this runtime can have a network (an egress policy other than none).
    can_network = False

    def set_network(self, sandbox_id: str, policy: dict[str, Any]) -> None:
        """Put a new egress policy in force for a running sandbox that has a network, at once
        and atomically."""
        raise LauncherError(f"the {self.name} runtime gives sandboxes no network")

    def network_reconcile(self, live: dict[str, dict[str, Any]]) -> list[str]:
        """Remove network leftovers of sandboxes not in ``live`` (id → policy) and refresh the
        pinned names of those that are; returns the ids cleaned up."""
        return []

    def prepare(self) -> None:
        """Make ahead of time what creates will need (a disk template, say); idempotent,
        called when the node starts."""
        return None

    @abc.abstractmethod
    def destroy(self, handle: Handle) -> None:
        """Remove everything the sandbox holds on the node: processes, mounts, cgroups, state."""

    @abc.abstractmethod
    def state(self, handle: Handle) -> RuntimeState:
        """What the runtime reports for this sandbox right now."""

    @abc.abstractmethod
    def list(self) -> list[str]:
        """Ids of every sandbox this launcher holds resources for on this node (for reconciliation)."""

    def states(self) -> dict[str, RuntimeState]:
        """State of every sandbox on the node at once (reconciliation); runtimes that can
        answer in one call override this."""
        return {sandbox_id: self.state(self._handle_for(sandbox_id)) for sandbox_id in self.list()}

    def _handle_for(self, sandbox_id: str) -> Handle:
        return {"id": sandbox_id}

    @abc.abstractmethod
    def destroy_id(self, sandbox_id: str) -> None:
        """Destroy by id alone: reconciliation of resources that no row owns."""

    @abc.abstractmethod
    def stats(self, handle: Handle) -> Stats:
        """CPU and memory the sandbox uses now."""
