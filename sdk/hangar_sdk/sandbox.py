"""Sandboxes, their commands, background processes and files: the sync SDK. The async one
(:mod:`hangar_sdk.aio`) has the same names, awaited."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal, overload

from . import _api as api
from ._dirs import Progress, file_chunks, local_target, local_tree
from ._errors import CommandTimeout, HangarError, NotFoundError
from ._models import ExecResult, FileEntry, ProcessInfo, SandboxInfo
from ._transport import Config, Transport
from .terminal import Terminal


@dataclass
class Output:
    """What a background process has written so far."""

    stdout: str
    stderr: str


class Sandbox:
    """A sandbox. Make one with :meth:`create`, find one with :meth:`get` or :meth:`list`.
    ``with Sandbox.create(...) as sb:`` deletes it at the end of the block."""

    def __init__(self, info: SandboxInfo, transport: Transport) -> None:
        self.info = info
        self._t = transport
        self.files = Files(self)

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.status}>"

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def status(self) -> str:
        """The status when last seen (after create, get, pause, resume, refresh…)."""
        return self.info.status

    # -- finding and making them ----------------------------------------------------------------

    @classmethod
    def create(
        cls, image: str, *, timeout_s: int | None = None, memory_mb: int | None = None,
        cpu: float | None = None, env: Mapping[str, str] | None = None,
        network: str | Mapping[str, Any] | None = None, url: str | None = None, token: str | None = None,
        **extra: Any,
    ) -> Sandbox:  # fmt: skip
        """Start a sandbox and return it once it runs. ``extra`` takes the API's other create
        fields (``disk_mb``, ``node_selector``, ``secrets``, ``ports``, ``metadata``, ``volumes``, …)."""
        t = Transport(Config.resolve(url, token))
        call = api.sandbox_create(image=image, timeout_s=timeout_s, memory_mb=memory_mb, cpu=cpu, env=env,
                                  network=network, extra=extra)  # fmt: skip
        info = api.parse_sandbox(t.opening(call))
        if info.status == "failed":
            t.close()
            raise api.start_failed(info)
        return cls(info, t)

    @classmethod
    def get(cls, sandbox_id: str, *, url: str | None = None, token: str | None = None) -> Sandbox:
        t = Transport(Config.resolve(url, token))
        return cls(api.parse_sandbox(t.opening(api.sandbox_get(sandbox_id))), t)

    @classmethod
    def list(cls, status: str | None = None, *, limit: int = 100, offset: int = 0, url: str | None = None,
             token: str | None = None) -> list[Sandbox]:  # fmt: skip
        """The team's sandboxes, newest first (deleted ones only with ``status="deleted"``)."""
        t = Transport(Config.resolve(url, token))
        rows = t.opening(api.sandbox_list(status=status, limit=limit, offset=offset))
        return [cls(api.parse_sandbox(row), t) for row in rows]

    # -- its life -------------------------------------------------------------------------------

    def refresh(self) -> Sandbox:
        self.info = api.parse_sandbox(self._t.json(api.sandbox_get(self.id)))
        return self

    def pause(self, mode: str | None = None) -> Sandbox:
        """Pause it (``mode``: ``stop`` or ``checkpoint``; default its ``pause_mode``)."""
        self.info = api.parse_sandbox(self._t.json(api.sandbox_pause(self.id, mode=mode)))
        return self

    def resume(self) -> Sandbox:
        self.info = api.parse_sandbox(self._t.json(api.sandbox_resume(self.id)))
        return self

    def keepalive(self, timeout_s: int) -> Sandbox:
        """It now expires ``timeout_s`` seconds from now."""
        self.info = api.parse_sandbox(self._t.json(api.sandbox_keepalive(self.id, timeout_s=timeout_s)))
        return self

    def stop(self) -> Sandbox:
        self.info = api.parse_sandbox(self._t.json(api.sandbox_stop(self.id)))
        return self

    def delete(self) -> None:
        """Stop and destroy it: answers at once, the sandbox goes ``stopping`` and then
        ``deleted`` (its row stays, with its events)."""
        self._t.json(api.sandbox_delete(self.id))

    def set_network(self, network: str | Mapping[str, Any]) -> Sandbox:
        """A new egress policy, in force at once: ``"none"``, ``"all"`` or
        ``{"egress": "allowlist", "allow": [...]}``."""
        self.info = api.parse_sandbox(self._t.json(api.sandbox_set_network(self.id, network=network)))
        return self

    def preview_url(self, port: int, *, public: bool = False) -> str:
        """A URL that reaches the server listening on ``port`` inside (private ones carry a
        signed token)."""
        return api.preview_url(self._t.json(api.sandbox_expose(self.id, port=port, public=public)))

    def stats(self) -> dict[str, Any]:
        return dict(self._t.json(api.sandbox_stats(self.id)))

    def close(self) -> None:
        """Close its connections (the sandbox itself lives on)."""
        self._t.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        try:
            self.delete()
        except NotFoundError:
            pass
        finally:
            self.close()

    # -- commands -------------------------------------------------------------------------------

    @overload
    def exec(self, cmd: str | Sequence[str], *, cwd: str | None = ..., env: Mapping[str, str] | None = ...,
             stdin: str | None = ..., timeout_s: float | None = ..., on_stdout: api.OutputCallback | None = ...,
             on_stderr: api.OutputCallback | None = ..., background: Literal[False] = ...,
             stdin_open: bool = ...) -> ExecResult: ...  # fmt: skip
    @overload
    def exec(self, cmd: str | Sequence[str], *, cwd: str | None = ..., env: Mapping[str, str] | None = ...,
             stdin: str | None = ..., timeout_s: float | None = ..., on_stdout: api.OutputCallback | None = ...,
             on_stderr: api.OutputCallback | None = ..., background: Literal[True],
             stdin_open: bool = ...) -> Process: ...  # fmt: skip
    def exec(self, cmd: str | Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
             stdin: str | None = None, timeout_s: float | None = None,
             on_stdout: api.OutputCallback | None = None, on_stderr: api.OutputCallback | None = None,
             background: bool = False, stdin_open: bool = False) -> ExecResult | Process:  # fmt: skip
        """Run a command (a string runs under ``/bin/sh -c``, a list is the argv) to its end and
        return its result; a non-zero exit is a result, not an exception. With ``on_stdout`` or
        ``on_stderr`` the output is handed to them as it is produced. With ``background`` it
        returns a :class:`Process` at once (``stdin_open`` to feed it with ``send_stdin``)."""
        if background:
            call = api.exec_call(self.id, cmd=cmd, cwd=cwd, env=env, stdin=stdin, timeout_s=timeout_s,
                                 background=True, stdin_open=stdin_open)  # fmt: skip
            data = self._t.json(call)
            return Process(self, int(data["id"]), data.get("pid"))
        if on_stdout is None and on_stderr is None:
            call = api.exec_call(self.id, cmd=cmd, cwd=cwd, env=env, stdin=stdin, timeout_s=timeout_s)
            return api.parse_exec(self._t.json(call))
        call = api.exec_call(
            self.id, cmd=cmd, cwd=cwd, env=env, stdin=stdin, timeout_s=timeout_s, stream=True
        )
        collector = api.OutputCollector(on_stdout, on_stderr)
        for line in self._t.lines(call):
            collector.feed_line(line)
        return collector.result()

    def terminal(self, cmd: str | Sequence[str] | None = None, *, cwd: str | None = None,
                 env: Mapping[str, str] | None = None, rows: int = 24, cols: int = 80) -> Terminal:  # fmt: skip
        """A shell on a PTY (default: bash if the image has it, else sh, as a login shell),
        connected: ``send``, ``read_until``, ``recv``, ``resize``, ``kill``. Needs websockets."""
        call = api.terminal_open(self.id, cmd=cmd, cwd=cwd, env=env, rows=rows, cols=cols)
        return Terminal(self, self._t.json(call))

    def process(self, process_id: int) -> Process:
        """A streamed or background process of this sandbox, by its id."""
        info = self._process_info(process_id)
        return Process(self, info.id, info.pid)

    def _process_info(self, process_id: int) -> ProcessInfo:
        return api.parse_process(self._t.json(api.process_get(self.id, process_id)))


class Process:
    """A command running in the background (``sb.exec(..., background=True)``)."""

    def __init__(self, sandbox: Sandbox, process_id: int, pid: int | None) -> None:
        self.sandbox = sandbox
        self.id = process_id
        self.pid = pid

    def __repr__(self) -> str:
        return f"<Process {self.id} in {self.sandbox.id}>"

    def info(self) -> ProcessInfo:
        return self.sandbox._process_info(self.id)

    def wait(self, timeout: float | None = None, *, on_stdout: api.OutputCallback | None = None,
             on_stderr: api.OutputCallback | None = None) -> ExecResult:  # fmt: skip
        """Wait for it to end and return its result with all its output (``on_stdout`` and
        ``on_stderr`` get it as it comes). Past ``timeout`` seconds (checked at least every
        15 s, as the server's keepalives arrive) raises :class:`CommandTimeout`; it runs on."""
        deadline = None if timeout is None else time.monotonic() + timeout
        collector = api.OutputCollector(on_stdout, on_stderr)
        collector.process_id = self.id
        for line in self.sandbox._t.lines(api.process_output(self.sandbox.id, self.id, follow=True)):
            collector.feed_line(line)
            if collector.exit is None and deadline is not None and time.monotonic() > deadline:
                raise CommandTimeout(f"process {self.id} still running after {timeout} s")
        return collector.result()

    def output(self) -> Output:
        """What it has written so far (as far as the node keeps: the last 4 MiB)."""
        collector = api.OutputCollector()
        for line in self.sandbox._t.lines(api.process_output(self.sandbox.id, self.id, follow=False)):
            collector.feed_line(line)
        return Output(collector.stdout, collector.stderr)

    def send_stdin(self, data: str | bytes, *, close: bool = False) -> None:
        """Write to its stdin (it must have been started with ``stdin_open=True``); ``close``
        ends its input afterwards."""
        self.sandbox._t.send(api.process_stdin(self.sandbox.id, self.id, data=data, close=close))

    def close_stdin(self) -> None:
        self.send_stdin("", close=True)

    def signal(self, signal: str | int) -> None:
        self.sandbox._t.send(api.process_signal(self.sandbox.id, self.id, signal=signal))

    def kill(self) -> None:
        self.signal("KILL")


class Files:
    """The sandbox's filesystem: ``sb.files``."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def write(self, path: str, data: bytes | str | IO[bytes] | Iterable[bytes]) -> int:
        """Write ``data`` to ``path`` (parents are made, an existing file replaced atomically);
        a file object or an iterator of bytes is streamed. Returns the size written."""
        content = data.encode() if isinstance(data, str) else data
        return int(self._sb._t.json(api.file_write(self._sb.id, path, content))["size"])

    def read(self, path: str) -> bytes:
        with self._sb._t.stream(api.file_read(self._sb.id, path)) as response:
            return response.read()

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self.read(path).decode(encoding)

    def download(self, path: str, local: str | os.PathLike[str], *, progress: Progress | None = None) -> int:
        """Copy the file at ``path`` to the local file ``local``, streamed (``progress`` is told
        the bytes of each piece as it lands). Returns its size."""
        size = 0
        with self._sb._t.stream(api.file_read(self._sb.id, path)) as response, open(local, "wb") as f:
            for chunk in response.iter_bytes():
                size += f.write(chunk)
                if progress is not None:
                    progress(len(chunk))
        return size

    def upload(self, local: str | os.PathLike[str], path: str, *, progress: Progress | None = None) -> int:
        """Copy the local file ``local`` to ``path``, streamed (``progress`` is told the bytes
        of each piece as it goes). Returns its size."""
        src = Path(local)
        call = api.file_write(self._sb.id, path, file_chunks(src, progress), size=src.stat().st_size)
        return int(self._sb._t.json(call)["size"])

    def list(self, path: str) -> list[FileEntry]:
        """The entries of the directory at ``path`` (symlinks listed, not followed)."""
        return api.parse_entries(self._sb._t.json(api.file_list(self._sb.id, path)))

    def upload_dir(
        self, local: str | os.PathLike[str], path: str, *, progress: Progress | None = None
    ) -> int:
        """Copy the local directory ``local`` to ``path``, keeping relative paths (and empty
        directories); one file at a time, streamed. Returns the number of files."""
        files, empty = local_tree(local)
        for rel, src in files:
            self.upload(src, api.join(path, rel), progress=progress)
        if empty:
            made = self._sb.exec(["mkdir", "-p", *(api.join(path, rel) for rel in empty)])
            if made.exit_code != 0:
                raise HangarError(f"could not make directories under {path}: {made.stderr.strip()}")
        return len(files)

    def download_dir(
        self, path: str, local: str | os.PathLike[str], *, progress: Progress | None = None
    ) -> int:
        """Copy the directory at ``path`` to the local directory ``local``, keeping relative
        paths; one file at a time, streamed. Symlinks and special files are skipped. Returns the
        number of files."""
        count = 0
        pending = [""]
        while pending:
            rel_dir = pending.pop()
            local_target(local, rel_dir or ".").mkdir(parents=True, exist_ok=True)
            for entry in self.list(api.join(path, rel_dir)):
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                if entry.type == "dir":
                    pending.append(rel)
                elif entry.type == "file":
                    self.download(api.join(path, rel), local_target(local, rel), progress=progress)
                    count += 1
        return count
