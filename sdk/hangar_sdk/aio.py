"""The async SDK: :class:`AsyncSandbox` has :class:`~hangar_sdk.Sandbox`'s methods, awaited.
Calls, paths and answers come from :mod:`hangar_sdk._api`, as for the sync SDK."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Generator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, Literal, TypeVar, overload

from . import _api as api
from ._dirs import Progress, afile_chunks, local_target, local_tree
from ._errors import CommandTimeout, HangarError, NotFoundError
from ._models import ExecResult, FileEntry, ProcessInfo, SandboxInfo
from ._transport import AsyncTransport, Config
from .sandbox import Output
from .terminal import AsyncTerminal

T = TypeVar("T", bound="_Closing")


class _Closing:
    async def __aenter__(self: T) -> T:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        await self._exit()

    async def _exit(self) -> None:
        raise NotImplementedError


class Creating(Generic[T]):
    """What :meth:`AsyncSandbox.create` returns: await it for the sandbox, or use it as
    ``async with AsyncSandbox.create(...) as sb:`` to have it deleted at the end."""

    def __init__(self, make: Callable[[], Awaitable[T]]) -> None:
        self._make = make
        self._made: T | None = None

    def __await__(self) -> Generator[Any, None, T]:
        return self._make().__await__()

    async def __aenter__(self) -> T:
        self._made = await self._make()
        return self._made

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        if self._made is not None:
            await self._made._exit()


class AsyncSandbox(_Closing):
    """A sandbox, for asyncio: ``sb = await AsyncSandbox.create(...)``, or
    ``async with AsyncSandbox.create(...) as sb:`` (deleted on exit)."""

    def __init__(self, info: SandboxInfo, transport: AsyncTransport) -> None:
        self.info = info
        self._t = transport
        self.files = AsyncFiles(self)

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.status}>"

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def status(self) -> str:
        return self.info.status

    @classmethod
    def create(
        cls, image: str, *, timeout_s: int | None = None, memory_mb: int | None = None,
        cpu: float | None = None, env: Mapping[str, str] | None = None,
        network: str | Mapping[str, Any] | None = None, url: str | None = None, token: str | None = None,
        **extra: Any,
    ) -> Creating[AsyncSandbox]:  # fmt: skip
        call = api.sandbox_create(image=image, timeout_s=timeout_s, memory_mb=memory_mb, cpu=cpu, env=env,
                                  network=network, extra=extra)  # fmt: skip

        async def make() -> AsyncSandbox:
            t = AsyncTransport(Config.resolve(url, token))
            info = api.parse_sandbox(await t.opening(call))
            if info.status == "failed":
                await t.close()
                raise api.start_failed(info)
            return cls(info, t)

        return Creating(make)

    @classmethod
    async def get(cls, sandbox_id: str, *, url: str | None = None, token: str | None = None) -> AsyncSandbox:
        t = AsyncTransport(Config.resolve(url, token))
        return cls(api.parse_sandbox(await t.opening(api.sandbox_get(sandbox_id))), t)

    @classmethod
    async def list(cls, status: str | None = None, *, limit: int = 100, offset: int = 0,
                   url: str | None = None, token: str | None = None) -> list[AsyncSandbox]:  # fmt: skip
        t = AsyncTransport(Config.resolve(url, token))
        rows = await t.opening(api.sandbox_list(status=status, limit=limit, offset=offset))
        return [cls(api.parse_sandbox(row), t) for row in rows]

    async def _update(self, call: api.Call) -> AsyncSandbox:
        self.info = api.parse_sandbox(await self._t.json(call))
        return self

    async def refresh(self) -> AsyncSandbox:
        return await self._update(api.sandbox_get(self.id))

    async def pause(self, mode: str | None = None) -> AsyncSandbox:
        return await self._update(api.sandbox_pause(self.id, mode=mode))

    async def resume(self) -> AsyncSandbox:
        return await self._update(api.sandbox_resume(self.id))

    async def keepalive(self, timeout_s: int) -> AsyncSandbox:
        return await self._update(api.sandbox_keepalive(self.id, timeout_s=timeout_s))

    async def stop(self) -> AsyncSandbox:
        return await self._update(api.sandbox_stop(self.id))

    async def set_network(self, network: str | Mapping[str, Any]) -> AsyncSandbox:
        return await self._update(api.sandbox_set_network(self.id, network=network))

    async def delete(self) -> None:
        await self._t.json(api.sandbox_delete(self.id))

    async def preview_url(self, port: int, *, public: bool = False) -> str:
        return api.preview_url(await self._t.json(api.sandbox_expose(self.id, port=port, public=public)))

    async def stats(self) -> dict[str, Any]:
        return dict(await self._t.json(api.sandbox_stats(self.id)))

    async def close(self) -> None:
        await self._t.close()

    async def _exit(self) -> None:
        try:
            await self.delete()
        except NotFoundError:
            pass
        finally:
            await self.close()

    @overload
    async def exec(self, cmd: str | Sequence[str], *, cwd: str | None = ...,
                   env: Mapping[str, str] | None = ..., stdin: str | None = ..., timeout_s: float | None = ...,
                   on_stdout: api.OutputCallback | None = ..., on_stderr: api.OutputCallback | None = ...,
                   background: Literal[False] = ..., stdin_open: bool = ...) -> ExecResult: ...  # fmt: skip
    @overload
    async def exec(self, cmd: str | Sequence[str], *, cwd: str | None = ...,
                   env: Mapping[str, str] | None = ..., stdin: str | None = ..., timeout_s: float | None = ...,
                   on_stdout: api.OutputCallback | None = ..., on_stderr: api.OutputCallback | None = ...,
                   background: Literal[True], stdin_open: bool = ...) -> AsyncProcess: ...  # fmt: skip
    async def exec(self, cmd: str | Sequence[str], *, cwd: str | None = None,
                   env: Mapping[str, str] | None = None, stdin: str | None = None,
                   timeout_s: float | None = None, on_stdout: api.OutputCallback | None = None,
                   on_stderr: api.OutputCallback | None = None, background: bool = False,
                   stdin_open: bool = False) -> ExecResult | AsyncProcess:  # fmt: skip
        """:meth:`hangar_sdk.Sandbox.exec`, awaited (the callbacks are plain functions)."""
        if background:
            call = api.exec_call(self.id, cmd=cmd, cwd=cwd, env=env, stdin=stdin, timeout_s=timeout_s,
                                 background=True, stdin_open=stdin_open)  # fmt: skip
            data = await self._t.json(call)
            return AsyncProcess(self, int(data["id"]), data.get("pid"))
        if on_stdout is None and on_stderr is None:
            call = api.exec_call(self.id, cmd=cmd, cwd=cwd, env=env, stdin=stdin, timeout_s=timeout_s)
            return api.parse_exec(await self._t.json(call))
        call = api.exec_call(
            self.id, cmd=cmd, cwd=cwd, env=env, stdin=stdin, timeout_s=timeout_s, stream=True
        )
        collector = api.OutputCollector(on_stdout, on_stderr)
        async for line in self._t.lines(call):
            collector.feed_line(line)
        return collector.result()

    async def terminal(self, cmd: str | Sequence[str] | None = None, *, cwd: str | None = None,
                       env: Mapping[str, str] | None = None, rows: int = 24, cols: int = 80) -> AsyncTerminal:  # fmt: skip
        call = api.terminal_open(self.id, cmd=cmd, cwd=cwd, env=env, rows=rows, cols=cols)
        return await AsyncTerminal.open(self, await self._t.json(call))

    async def process(self, process_id: int) -> AsyncProcess:
        info = await self._process_info(process_id)
        return AsyncProcess(self, info.id, info.pid)

    async def _process_info(self, process_id: int) -> ProcessInfo:
        return api.parse_process(await self._t.json(api.process_get(self.id, process_id)))


class AsyncProcess:
    """:class:`hangar_sdk.Process`, awaited."""

    def __init__(self, sandbox: AsyncSandbox, process_id: int, pid: int | None) -> None:
        self.sandbox = sandbox
        self.id = process_id
        self.pid = pid

    def __repr__(self) -> str:
        return f"<AsyncProcess {self.id} in {self.sandbox.id}>"

    async def info(self) -> ProcessInfo:
        return await self.sandbox._process_info(self.id)

    async def wait(self, timeout: float | None = None, *, on_stdout: api.OutputCallback | None = None,
                   on_stderr: api.OutputCallback | None = None) -> ExecResult:  # fmt: skip
        deadline = None if timeout is None else time.monotonic() + timeout
        collector = api.OutputCollector(on_stdout, on_stderr)
        collector.process_id = self.id
        async for line in self.sandbox._t.lines(api.process_output(self.sandbox.id, self.id, follow=True)):
            collector.feed_line(line)
            if collector.exit is None and deadline is not None and time.monotonic() > deadline:
                raise CommandTimeout(f"process {self.id} still running after {timeout} s")
        return collector.result()

    async def output(self) -> Output:
        collector = api.OutputCollector()
        async for line in self.sandbox._t.lines(api.process_output(self.sandbox.id, self.id, follow=False)):
            collector.feed_line(line)
        return Output(collector.stdout, collector.stderr)

    async def send_stdin(self, data: str | bytes, *, close: bool = False) -> None:
        await self.sandbox._t.send(api.process_stdin(self.sandbox.id, self.id, data=data, close=close))

    async def close_stdin(self) -> None:
        await self.send_stdin("", close=True)

    async def signal(self, signal: str | int) -> None:
        await self.sandbox._t.send(api.process_signal(self.sandbox.id, self.id, signal=signal))

    async def kill(self) -> None:
        await self.signal("KILL")


class AsyncFiles:
    """:class:`hangar_sdk.Files`, awaited."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def write(self, path: str, data: bytes | str | AsyncIterable[bytes]) -> int:
        content = data.encode() if isinstance(data, str) else data
        return int((await self._sb._t.json(api.file_write(self._sb.id, path, content)))["size"])

    async def read(self, path: str) -> bytes:
        async with self._sb._t.stream(api.file_read(self._sb.id, path)) as response:
            return await response.aread()

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def download(
        self, path: str, local: str | os.PathLike[str], *, progress: Progress | None = None
    ) -> int:
        size = 0
        async with self._sb._t.stream(api.file_read(self._sb.id, path)) as response:
            with open(local, "wb") as f:
                async for chunk in response.aiter_bytes():
                    size += f.write(chunk)
                    if progress is not None:
                        progress(len(chunk))
        return size

    async def upload(
        self, local: str | os.PathLike[str], path: str, *, progress: Progress | None = None
    ) -> int:
        src = Path(local)
        call = api.file_write(self._sb.id, path, afile_chunks(src, progress), size=src.stat().st_size)
        return int((await self._sb._t.json(call))["size"])

    async def list(self, path: str) -> list[FileEntry]:
        return api.parse_entries(await self._sb._t.json(api.file_list(self._sb.id, path)))

    async def upload_dir(self, local: str | os.PathLike[str], path: str, *,
                         progress: Progress | None = None) -> int:  # fmt: skip
        files, empty = local_tree(local)
        for rel, src in files:
            await self.upload(src, api.join(path, rel), progress=progress)
        if empty:
            made = await self._sb.exec(["mkdir", "-p", *(api.join(path, rel) for rel in empty)])
            if made.exit_code != 0:
                raise HangarError(f"could not make directories under {path}: {made.stderr.strip()}")
        return len(files)

    async def download_dir(self, path: str, local: str | os.PathLike[str], *,
                           progress: Progress | None = None) -> int:  # fmt: skip
        count = 0
        pending = [""]
        while pending:
            rel_dir = pending.pop()
            local_target(local, rel_dir or ".").mkdir(parents=True, exist_ok=True)
            for entry in await self.list(api.join(path, rel_dir)):
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                if entry.type == "dir":
                    pending.append(rel)
                elif entry.type == "file":
                    await self.download(api.join(path, rel), local_target(local, rel), progress=progress)
                    count += 1
        return count
