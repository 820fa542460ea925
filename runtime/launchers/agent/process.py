"""A live command of an agent-based launcher: :class:`~runtime.launchers.base.Process` over one
open exec connection to the sandbox's agent."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from ..base import LauncherError, Process, ProcessExit, SandboxGone
from .client import AgentProcess
from .protocol import AgentDetached, AgentError, AgentFileError, ExitInfo


class AgentBackedProcess(Process):
    """``not_running()`` says why the connection ended without an exit report; ``exists()``
    whether the sandbox is still on the node (a detached command waits for its restore only
    while it is)."""

    def __init__(
        self, proc: AgentProcess, not_running: Callable[[], LauncherError], exists: Callable[[], bool]
    ) -> None:
        self._proc = proc
        self._not_running = not_running
        self._exists = exists
        self._closed = False
        self.pid = proc.pid

    def events(self) -> Iterator[tuple[str, bytes | ProcessExit]]:
        while True:
            try:
                for kind, data in self._proc.events():
                    if isinstance(data, ExitInfo):
                        yield "exit", ProcessExit(data.code, data.signal, data.timed_out)
                        return
                    yield kind, data
            except AgentDetached:
                self._await_restore()  # paused in checkpoint mode: the command lives on
                continue
            except AgentError as exc:
                raise self._not_running() from exc
            raise self._not_running()

    def _await_restore(self) -> None:
        """Wait, however long the sandbox stays paused, until its agent listens again, then
        pick the stream up where it was. Ends when the sandbox is deleted or this is closed."""
        waited = 0.0
        while not self._closed:
            if not self._exists():
                raise SandboxGone(f"the sandbox was deleted while process {self.pid} was detached")
            try:
                self._proc.reattach()
                return
            except AgentFileError as exc:
                raise LauncherError(f"process {self.pid} did not survive the pause: {exc.message}") from exc
            except AgentError:
                pass  # not listening yet: still paused, or being restored
            delay = 0.02 if waited < 30 else 0.5
            time.sleep(delay)
            waited += delay
        raise LauncherError(f"process {self.pid} was closed while detached")

    def send_stdin(self, data: bytes) -> None:
        self._proc.send_stdin(data)

    def close_stdin(self) -> None:
        self._proc.close_stdin()

    def resize(self, rows: int, cols: int) -> None:
        self._proc.resize(rows, cols)

    def send_signal(self, sig: int) -> None:
        self._proc.signal(sig)

    def close(self) -> None:
        self._closed = True
        self._proc.shutdown()  # wakes a reader blocked in recv() in another thread
        self._proc.close()
