"""The launcher interface: what every isolation runtime on a node implements.

Shaped like jupyter_client's kernel provisioners: a small typed surface, a persisted
``handle`` (a plain dict) so a restarted node re-adopts the sandboxes it already runs, and
registration by name (see registry.py). A launcher says what its sandboxes can have
(:class:`Capabilities`) and whether it can run on this node at all (:meth:`Launcher.probe`).
Nothing here imports Django: a node can run and test launchers with no database.
"""

from __future__ import annotations

import abc
import contextlib
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OutputCallback = Callable[[str, bytes], None]


# The steps of a create, timed for whoever asked (the node, for the start's trace): set to a
# list around ``create``; each :func:`phase` appends ``(name, start_ns, end_ns)`` to it.
PHASES: ContextVar[list[tuple[str, int, int]] | None] = ContextVar("hangar_launch_phases", default=None)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time a step of a create (``disk``, ``network``, ``runtime``) into :data:`PHASES`, if set.
    A step that raises is timed too."""
    got = PHASES.get()
    start = time.time_ns()
    try:
        yield
    finally:
        if got is not None:
            got.append((name, start, time.time_ns()))


class LauncherError(Exception):
    """A runtime operation failed; the message is safe to show to the sandbox's owner."""


class SandboxNotRunning(LauncherError):
    """The sandbox exists on the node but its processes are gone (or it never started)."""

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


class SandboxGone(LauncherError):
    """The node has no trace of the sandbox."""


# FileOpError's errno_name for a path refused under ``no_pseudo_fs`` (on /proc or /sys).
PSEUDO_FS_REFUSED = "EPSEUDOFS"


class FileOpError(LauncherError):
    """A file operation inside the sandbox failed (``errno_name`` is e.g. ``ENOENT``)."""

    def __init__(self, errno_name: str, message: str) -> None:
        super().__init__(f"{errno_name}: {message}")
        self.errno_name = errno_name
        self.message = message


@dataclass(frozen=True)
class Mount:
    """A volume in a sandbox at ``destination``: mounted on the node at ``source`` (bound in), or,
    for a runtime whose sandboxes are VMs (``Capabilities.vm``), its filesystem image ``disk``
    that the VM attaches and its kernel mounts (``source`` is then empty)."""

    source: str
    destination: str
    read_only: bool = False
    disk: str = ""


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
    stdout: bytes | bytearray  # the buffer the output was read into (a blocking exec's may be large)
    stderr: bytes | bytearray
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
    """What the node sees for one sandbox: ``running``, ``paused``, ``stopped`` or ``missing``;
    or ``unknown`` when the runtime could not tell this time (a reconciliation leaves such a
    sandbox as it is, and a failed call on it does not fail it)."""

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


@dataclass(frozen=True)
class Capabilities:
    """What sandboxes of a launcher can have on this node. The node advertises them in its
    heartbeat (:meth:`as_dict`, a JSON object on its row); the control plane reads them there,
    never from a launcher class."""

    network: bool  # an egress policy other than none (set_network while running)
    checkpoint: bool  # pause keeping processes and memory (checkpoint, restore)
    kvm: bool = False  # hardware virtualisation under the sandbox
    gpu: bool = False  # a GPU passed through
    vm: bool = False  # each sandbox a VM with a kernel of its own (``kvm`` then says how it runs)
    move: bool = False  # a paused sandbox can move to another node (paused_files, adopt: a drain)
    # The most a command's argv, environment and cwd may come to, counted by command_bytes()
    # (None: no limit of the runtime's own). An agent-based launcher's is the agent's frame.
    max_command_bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"network": self.network, "checkpoint": self.checkpoint, "kvm": self.kvm, "gpu": self.gpu,
                "vm": self.vm, "move": self.move, "max_command_bytes": self.max_command_bytes}  # fmt: skip


# Room in a command's request for what is not the command itself (a timeout, a terminal's
# size, flags: a few dozen bytes).
COMMAND_ROOM = 128


def command_bytes(argv: Iterable[str], env: Mapping[str, str] | None, cwd: str | None) -> int:
    """What a command's argv, environment and cwd come to, as every launcher counts them against
    its ``max_command_bytes``: each as ``key=value`` and a NUL (exactly what the guest agent's
    exec request takes, see agent/protocol.py), and :data:`COMMAND_ROOM` for the rest."""

    def field(key: str, value: str) -> int:
        return len(key) + len(value.encode("utf-8", "surrogatepass")) + 2  # key=value\0

    size = sum(field("arg", a) for a in argv) + COMMAND_ROOM
    size += sum(field("env", f"{name}={value}") for name, value in (env or {}).items())
    return size + (field("cwd", cwd) if cwd else 0)


class Launcher(abc.ABC):
    """One isolation runtime on one node. Every method is safe to call twice.

    A launcher is constructed with keyword arguments: the node-wide ones every launcher gets
    (:data:`NODE_PARAMETERS`) and its own settings block (``HANGAR_LAUNCHER_CONFIG[name]``).
    Every method that acts on a sandbox takes its ``handle``: what :meth:`create` or
    :meth:`restore` returned (persisted by the caller), or :meth:`handle_for` its id when only
    the id is known (reconciliation, a restarted node). Ids name sandboxes to the outside;
    nothing outside the launcher looks inside a handle."""

    name: str = ""

    @classmethod
    def probe(cls, config: Mapping[str, Any]) -> str | None:
        """Whether this launcher can run on this node with ``config`` (the keyword arguments it
        would be constructed with): None if it can, else why not, in words for the node's log.
        Cheap: the node calls it once when it starts."""
        return None

    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What sandboxes of this launcher can have on this node."""

    @abc.abstractmethod
    def handle_for(self, sandbox_id: str) -> Handle:
        """The handle this node keeps for ``sandbox_id`` (or a minimal one naming it, when it
        keeps none): for acting on a sandbox known by its id alone."""

    @abc.abstractmethod
    def create(self, spec: SandboxSpec) -> Handle:
        """Create and start the sandbox; return once its agent answers. Returns the handle to
        persist. A spec asking for what :meth:`capabilities` lacks (a network) raises."""

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
    def read_file(
        self, handle: Handle, path: str, *, no_pseudo_fs: bool = False
    ) -> tuple[FileEntry, Iterator[bytes]]:
        """Stream a file's bytes, resolved inside the sandbox. ``no_pseudo_fs``: a path on
        /proc or /sys, or through them (symlinks included), raises :class:`FileOpError`
        ``EPSEUDOFS``. The entry's size is the sandbox's word: the bytes may differ."""

    @abc.abstractmethod
    def write_file(
        self,
        handle: Handle,
        path: str,
        data: bytes | Iterable[bytes | bytearray | memoryview],
        mode: int = 0o644,
    ) -> int:
        """Write (atomically replace) a file inside the sandbox; returns bytes written."""

    @abc.abstractmethod
    def list_files(self, handle: Handle, path: str, *, no_pseudo_fs: bool = False) -> list[FileEntry]:
        """List a directory inside the sandbox (symlinks are reported, never followed);
        ``no_pseudo_fs`` as for :meth:`read_file`."""

    @abc.abstractmethod
    def open_tunnel(self, handle: Handle, port: int) -> socket.socket:
        """A connected byte stream to TCP ``port`` on the sandbox's own loopback (a preview
        URL's server). Raises :class:`FileOpError` ``ECONNREFUSED`` when nothing listens there."""

    @abc.abstractmethod
    def suspend(self, handle: Handle, keep_files: bool = True) -> None:
        """End every process of the sandbox and free its CPU and memory, keeping what it wrote
        to its root filesystem (unless ``keep_files`` is false) so that :meth:`create` with the
        same id starts it again over the same files. Idempotent."""

    def checkpoint(self, handle: Handle) -> None:
        """Save the running sandbox whole (processes, memory, open files) to the node's disk
        and free its CPU and memory; :meth:`restore` continues it. Idempotent: a repeated
        call after a completed checkpoint only finishes releasing the runtime. If it raises,
        the sandbox may be gone (the runtime stops it either way): fall back to
        :meth:`suspend`, which keeps its files. Only where ``capabilities().checkpoint``."""
        raise LauncherError(f"the {self.name} runtime cannot checkpoint a sandbox")

    def restore(self, spec: SandboxSpec) -> Handle:
        """Continue a sandbox saved by :meth:`checkpoint`. If it raises, the saved state is
        discarded, and :meth:`create` starts the sandbox afresh over its kept files."""
        raise LauncherError(f"the {self.name} runtime cannot restore a sandbox")

    def paused_files(self, sandbox_id: str) -> contextlib.AbstractContextManager[list[tuple[str, Path]]]:
        """While the context lasts, the files that make the paused sandbox ``sandbox_id`` (its
        checkpoint, its disk), each as (its name relative to the sandbox, where it is here),
        whole and still: for another node to copy (:mod:`runtime.node.moves`). The sandbox stays
        here, paused, and can resume here. Raises :class:`LauncherError` when it cannot move
        (it runs, or the runtime cannot move sandboxes)."""
        raise LauncherError(f"the {self.name} runtime cannot move a sandbox to another node")

    def incoming_dir(self, sandbox_id: str) -> Path:
        """Where a paused sandbox's files copied from another node go, under the names
        :meth:`paused_files` gave them; nothing here treats them as a sandbox until
        :meth:`adopt` (reconciliation does not see them)."""
        raise LauncherError(f"the {self.name} runtime cannot move a sandbox to another node")

    def adopt(self, sandbox_id: str) -> None:
        """Make the files in :meth:`incoming_dir` the paused sandbox ``sandbox_id`` of this node,
        which :meth:`restore` (or :meth:`create`, over its files) continues. Idempotent."""
        raise LauncherError(f"the {self.name} runtime cannot move a sandbox to another node")

    def sweep_incoming(self, idle_s: float) -> list[str]:
        """Remove copies in :meth:`incoming_dir` that nothing has written to for ``idle_s``
        seconds (their move died with its worker); the sandbox ids (reconciliation)."""
        return []

    def prune_images(self, kept: set[Path]) -> list[str]:
        """Remove what the launcher keeps per image (built from its rootfs) for images this node
        no longer has: ``kept`` holds the rootfs of those it has. Never what a sandbox it holds
        uses. Returns what went (reconciliation)."""
        return []

    def set_network(self, handle: Handle, policy: dict[str, Any]) -> None:
        """Put a new egress policy in force for a running sandbox that has a network, at once
        and atomically. Only where ``capabilities().network``."""
        raise LauncherError(f"the {self.name} runtime gives sandboxes no network")

    def network_reconcile(self, live: dict[str, dict[str, Any]]) -> list[str]:
        """Remove network leftovers of sandboxes not in ``live`` (id → policy) and refresh the
        pinned names of those that are; returns the ids cleaned up."""
        return []

    def address_pool(self) -> str | None:
        """The network (CIDR) its sandboxes take addresses from, or None when they have none:
        the node's gateway (hangar.internal) takes connections from these addresses only."""
        return None

    def prepare(self) -> None:
        """Make ahead of time what creates will need (a disk template, say); idempotent,
        called when the node starts."""
        return None

    def release_spares(self) -> None:
        """Give back what :meth:`prepare` and creates keep ready ahead of time (spare disks):
        for a node, or a test, that is going away."""
        return None

    @abc.abstractmethod
    def destroy(self, handle: Handle) -> None:
        """Remove everything the sandbox holds on the node: processes, mounts, cgroups, state."""

    @abc.abstractmethod
    def states(self) -> dict[str, RuntimeState]:
        """Every sandbox this launcher holds resources for on this node, with what the runtime
        reports for it now (reconciliation)."""

    @abc.abstractmethod
    def stats(self, handle: Handle) -> Stats:
        """CPU and memory the sandbox uses now."""


# What the node gives every launcher, whatever its kind (see runtime/node/local.py): where it keeps
# its state, the node's id (in every host-global name), where the guest agent is compiled to,
# the node's network settings, the default size and the spares of sandboxes' own disks, and a
# CA bundle every sandbox trusts. A launcher takes what it uses and ignores the rest.
NODE_PARAMETERS = (
    "state_dir", "node_id", "agent_cache_dir", "network_pool", "network_exceptions", "network_nameservers",
    "gateway_port", "disk_mb", "spare_disks", "ca_certs",
)  # fmt: skip
