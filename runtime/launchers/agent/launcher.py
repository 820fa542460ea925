"""What every agent-based launcher shares: its sandboxes run ``hangar-agent`` as PID 1, and
exec, live processes, files, tunnels and the CA install all go through that agent. A launcher
built on :class:`AgentBackedLauncher` says how to reach its agent (:meth:`agent`, over its own
transport) and why one cannot be reached; the rest is here, the same for every runtime."""

from __future__ import annotations

import abc
import contextlib
import os
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..base import (
    ExecRequest,
    ExecResult,
    FileEntry,
    FileOpError,
    Handle,
    Launcher,
    LauncherError,
    OutputCallback,
    Process,
    ProcessRequest,
)
from .build import agent_binary
from .ca import SandboxCA
from .client import AgentClient
from .process import AgentBackedProcess
from .protocol import AgentError, AgentFileError


class AgentBackedLauncher(Launcher):
    def __init__(
        self,
        *,
        state_dir: str | os.PathLike[str],
        agent_cache_dir: str | os.PathLike[str] | None = None,
        ca_certs: str = "",
    ) -> None:
        self.state_dir = Path(state_dir)
        self.agent_cache_dir = Path(agent_cache_dir) if agent_cache_dir else self.state_dir / "bin"
        self.ca_certs = ca_certs  # a PEM bundle every sandbox trusts (see ca.py)
        self._agent_binary: Path | None = None
        self._ca: SandboxCA | None = None

    @abc.abstractmethod
    def agent(self, handle: Handle) -> AgentClient:
        """A client for the sandbox's agent (cheap: it holds no connection)."""

    def _unreachable(self, handle: Handle, exc: Exception | None = None) -> LauncherError:
        """Why the sandbox's agent cannot be reached (``exc``: what the client saw). A launcher
        says more where it knows more: the sandbox is gone, stopped, out of memory."""
        return LauncherError(f"the sandbox's agent did not answer: {exc or 'no reason given'}")

    def _lost(self, handle: Handle) -> LauncherError:
        """Why a live process's connection to the agent ended without an exit report."""
        return self._unreachable(handle)

    def _exists(self, handle: Handle) -> bool:
        """Whether the sandbox is still on this node (paused counts)."""
        return True

    # -- what the node gives every sandbox ------------------------------------------------

    @property
    def agent_binary(self) -> Path:
        """The agent, compiled for this node (once per source version)."""
        if self._agent_binary is None:
            self._agent_binary = agent_binary(self.agent_cache_dir)
        return self._agent_binary

    @property
    def sandbox_ca(self) -> SandboxCA | None:
        if self.ca_certs and self._ca is None:
            self._ca = SandboxCA(self.ca_certs, self.state_dir / "ca")
        return self._ca

    def install_ca(self, handle: Handle) -> None:
        """Add the node's CA bundle to the sandbox's system stores, through its agent."""
        if self.sandbox_ca is not None:
            self.sandbox_ca.install(self.agent(handle))

    # -- exec, processes, files, tunnels --------------------------------------------------

    @contextlib.contextmanager
    def _agent_call(self, handle: Handle) -> Iterator[AgentClient]:
        try:
            yield self.agent(handle)
        except AgentFileError as exc:
            raise FileOpError(exc.errno_name, exc.message) from exc
        except AgentError as exc:
            raise self._unreachable(handle, exc) from exc

    def exec(
        self, handle: Handle, request: ExecRequest, on_output: OutputCallback | None = None
    ) -> ExecResult:
        with self._agent_call(handle) as client:
            r = client.exec(
                request.argv,
                env=request.env or None,
                cwd=request.cwd,
                stdin=request.stdin,
                timeout=request.timeout,
                on_output=on_output,
                max_output=request.max_output,
            )
        return ExecResult(
            exit_code=r.exit_code,
            stdout=r.stdout,
            stderr=r.stderr,
            duration_ms=r.duration_ms,
            timed_out=r.timed_out,
            signal=r.signal,
            truncated=r.truncated,
        )

    def open_process(self, handle: Handle, request: ProcessRequest) -> Process:
        with self._agent_call(handle) as client:
            proc = client.open_process(
                request.argv, env=request.env or None, cwd=request.cwd, tty=request.tty,
                rows=request.rows, cols=request.cols, stdin=request.stdin, timeout=request.timeout,
                detachable=True,
            )  # fmt: skip
        return AgentBackedProcess(proc, lambda: self._lost(handle), lambda: self._exists(handle))

    def read_file(
        self, handle: Handle, path: str, *, no_pseudo_fs: bool = False
    ) -> tuple[FileEntry, Iterator[bytes]]:
        with self._agent_call(handle) as client:
            st, chunks = client.iter_file(path, no_pseudo_fs=no_pseudo_fs)
        entry = FileEntry(os.path.basename(path), path, st.type, st.size, st.mode, st.mtime)
        return entry, self._guard_iter(handle, chunks)

    def _guard_iter(self, handle: Handle, chunks: Iterator[bytes]) -> Iterator[bytes]:
        with self._agent_call(handle):
            yield from chunks

    def write_file(
        self,
        handle: Handle,
        path: str,
        data: bytes | Iterable[bytes | bytearray | memoryview],
        mode: int = 0o644,
    ) -> int:
        with self._agent_call(handle) as client:
            return client.write_file(path, data, mode=mode, mkdirs=True)

    def list_files(self, handle: Handle, path: str, *, no_pseudo_fs: bool = False) -> list[FileEntry]:
        with self._agent_call(handle) as client:
            entries = client.list_dir(path, no_pseudo_fs=no_pseudo_fs)
        return [FileEntry(e.name, e.path, e.type, e.size, e.mode, e.mtime) for e in entries]

    def open_tunnel(self, handle: Handle, port: int) -> socket.socket:
        with self._agent_call(handle) as client:
            return client.tunnel(port)
