"""Harnesses (a coding agent's workspace) and their runs, sync and async."""

from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import Mapping
from typing import Any

from . import _api as api
from ._errors import CommandTimeout, HangarError
from ._models import HarnessInfo, RunInfo
from ._transport import AsyncTransport, Config, Transport

POLL_S = 0.5


def _settled(info: HarnessInfo, name: str) -> HarnessInfo:
    if info.status == "failed" or info.setup == "failed":
        raise HangarError(f"harness {name} failed: {info.setup_error or info.status}",
                          body={"id": info.id, "status": info.status})  # fmt: skip
    return info


class _RunLog:
    """A run's log stream: the agent's output to the callbacks, and the run's final record
    (the stream's last line, ``{"type": "run", …}``)."""

    def __init__(self, on_stdout: api.OutputCallback | None, on_stderr: api.OutputCallback | None) -> None:
        self.collector = api.OutputCollector(on_stdout, on_stderr)
        self.record: RunInfo | None = None

    def feed_line(self, line: str) -> None:
        if not line.strip():
            return
        event = api.parse_event(line)
        if event.get("type") == "run":
            self.record = api.parse_run(event)
        else:
            self.collector.feed(event)


class Harness:
    """A harness: ``Harness.create(name=…, agent=…, repo={…})``, then ``h.run("task")``."""

    def __init__(self, info: HarnessInfo, transport: Transport) -> None:
        self.info = info
        self._t = transport

    def __repr__(self) -> str:
        return f"<Harness {self.name} {self.status}>"

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def status(self) -> str:
        return self.info.status

    @classmethod
    def create(cls, name: str, agent: str, repo: Mapping[str, Any] | str | None = None, *, wait: bool = True,
               timeout: float = 300.0, url: str | None = None, token: str | None = None,
               **extra: Any) -> Harness:  # fmt: skip
        """Create a harness (``extra``: ``command``, ``image``, ``runtime``, ``env``, ``secrets``,
        ``network``, ``memory_mb``, …). With ``wait`` it returns once its workspace is set up (the repository
        cloned, the agent installed), raising if that failed or took longer than ``timeout``."""
        t = Transport(Config.resolve(url, token))
        h = cls(
            api.parse_harness(t.opening(api.harness_create(name=name, agent=agent, repo=repo, extra=extra))),
            t,
        )
        if wait:
            h.wait_ready(timeout)
        return h

    @classmethod
    def get(cls, harness_id: str, *, url: str | None = None, token: str | None = None) -> Harness:
        t = Transport(Config.resolve(url, token))
        return cls(api.parse_harness(t.opening(api.harness_get(harness_id))), t)

    @classmethod
    def list(cls, *, url: str | None = None, token: str | None = None) -> list[Harness]:
        """The team's harnesses, by name."""
        t = Transport(Config.resolve(url, token))
        return [cls(api.parse_harness(row), t) for row in t.opening(api.harness_list())]

    def refresh(self) -> Harness:
        self.info = api.parse_harness(self._t.json(api.harness_get(self.id)))
        return self

    def runs(self) -> builtins.list[Run]:
        """Its runs, newest first (the last 100)."""
        return [Run(api.parse_run(row), self._t) for row in self._t.json(api.harness_runs(self.id))]

    def wait_ready(self, timeout: float = 300.0) -> Harness:
        deadline = time.monotonic() + timeout
        while not (self.refresh().status in api.HARNESS_SETTLED and self.info.setup in ("done", "failed")):
            _settled(self.info, self.name)
            if time.monotonic() > deadline:
                raise CommandTimeout(f"harness {self.name} not ready after {timeout} s ({self.info.status})")
            time.sleep(POLL_S)
        _settled(self.info, self.name)
        return self

    def run(self, prompt: str, *, timeout_s: int | None = None) -> Run:
        """Give the agent a task; it starts at once (``run.wait()`` for its end)."""
        return Run(api.parse_run(self._t.json(api.run_create(self.id, prompt=prompt, timeout_s=timeout_s))),
                   self._t)  # fmt: skip

    def pause(self) -> Harness:
        self.info = api.parse_harness(self._t.json(api.harness_pause(self.id)))
        return self

    def resume(self) -> Harness:
        self.info = api.parse_harness(self._t.json(api.harness_resume(self.id)))
        return self

    def delete(self, *, delete_volume: bool = False) -> None:
        self._t.json(api.harness_delete(self.id, delete_volume=delete_volume))


class Run:
    """A task given to a harness's agent."""

    def __init__(self, info: RunInfo, transport: Transport) -> None:
        self.info = info
        self._t = transport

    def __repr__(self) -> str:
        return f"<Run {self.id} {self.status}>"

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def status(self) -> str:
        return self.info.status

    @property
    def exit_code(self) -> int | None:
        return self.info.exit_code

    @property
    def diff(self) -> str:
        """What the run changed in ``/workspace``, as a git diff (once it has ended)."""
        return self.info.diff

    @classmethod
    def get(cls, run_id: str, *, url: str | None = None, token: str | None = None) -> Run:
        t = Transport(Config.resolve(url, token))
        return cls(api.parse_run(t.opening(api.run_get(run_id))), t)

    def refresh(self) -> Run:
        self.info = api.parse_run(self._t.json(api.run_get(self.id)))
        return self

    def wait(self, timeout: float | None = None, *, on_stdout: api.OutputCallback | None = None,
             on_stderr: api.OutputCallback | None = None) -> Run:  # fmt: skip
        """Follow the agent's output (to the callbacks) until the run ends; returns the run,
        with its ``status``, ``exit_code`` and ``diff``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        log = _RunLog(on_stdout, on_stderr)
        for line in self._t.lines(api.run_logs(self.id)):
            log.feed_line(line)
            if deadline is not None and time.monotonic() > deadline:
                raise CommandTimeout(f"run {self.id} still {self.status} after {timeout} s")
        if log.record is not None:
            self.info = log.record
        while self.info.status in api.RUN_ACTIVE:
            if deadline is not None and time.monotonic() > deadline:
                raise CommandTimeout(f"run {self.id} still {self.status} after {timeout} s")
            time.sleep(POLL_S)
            self.refresh()
        return self

    def cancel(self) -> Run:
        self.info = api.parse_run(self._t.json(api.run_cancel(self.id)))
        return self


class AsyncHarness:
    """:class:`Harness`, awaited."""

    def __init__(self, info: HarnessInfo, transport: AsyncTransport) -> None:
        self.info = info
        self._t = transport

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def status(self) -> str:
        return self.info.status

    @classmethod
    async def create(cls, name: str, agent: str, repo: Mapping[str, Any] | str | None = None, *,
                     wait: bool = True, timeout: float = 300.0, url: str | None = None,
                     token: str | None = None, **extra: Any) -> AsyncHarness:  # fmt: skip
        t = AsyncTransport(Config.resolve(url, token))
        call = api.harness_create(name=name, agent=agent, repo=repo, extra=extra)
        h = cls(api.parse_harness(await t.opening(call)), t)
        if wait:
            await h.wait_ready(timeout)
        return h

    @classmethod
    async def get(cls, harness_id: str, *, url: str | None = None, token: str | None = None) -> AsyncHarness:
        t = AsyncTransport(Config.resolve(url, token))
        return cls(api.parse_harness(await t.opening(api.harness_get(harness_id))), t)

    @classmethod
    async def list(cls, *, url: str | None = None, token: str | None = None) -> list[AsyncHarness]:
        t = AsyncTransport(Config.resolve(url, token))
        return [cls(api.parse_harness(row), t) for row in await t.opening(api.harness_list())]

    async def runs(self) -> builtins.list[AsyncRun]:
        return [
            AsyncRun(api.parse_run(row), self._t) for row in await self._t.json(api.harness_runs(self.id))
        ]

    async def refresh(self) -> AsyncHarness:
        self.info = api.parse_harness(await self._t.json(api.harness_get(self.id)))
        return self

    async def wait_ready(self, timeout: float = 300.0) -> AsyncHarness:
        deadline = time.monotonic() + timeout
        while not (
            (await self.refresh()).status in api.HARNESS_SETTLED and self.info.setup in ("done", "failed")
        ):
            _settled(self.info, self.name)
            if time.monotonic() > deadline:
                raise CommandTimeout(f"harness {self.name} not ready after {timeout} s ({self.info.status})")
            await asyncio.sleep(POLL_S)
        _settled(self.info, self.name)
        return self

    async def run(self, prompt: str, *, timeout_s: int | None = None) -> AsyncRun:
        call = api.run_create(self.id, prompt=prompt, timeout_s=timeout_s)
        return AsyncRun(api.parse_run(await self._t.json(call)), self._t)

    async def pause(self) -> AsyncHarness:
        self.info = api.parse_harness(await self._t.json(api.harness_pause(self.id)))
        return self

    async def resume(self) -> AsyncHarness:
        self.info = api.parse_harness(await self._t.json(api.harness_resume(self.id)))
        return self

    async def delete(self, *, delete_volume: bool = False) -> None:
        await self._t.json(api.harness_delete(self.id, delete_volume=delete_volume))


class AsyncRun:
    """:class:`Run`, awaited."""

    def __init__(self, info: RunInfo, transport: AsyncTransport) -> None:
        self.info = info
        self._t = transport

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def status(self) -> str:
        return self.info.status

    @property
    def exit_code(self) -> int | None:
        return self.info.exit_code

    @property
    def diff(self) -> str:
        return self.info.diff

    @classmethod
    async def get(cls, run_id: str, *, url: str | None = None, token: str | None = None) -> AsyncRun:
        t = AsyncTransport(Config.resolve(url, token))
        return cls(api.parse_run(await t.opening(api.run_get(run_id))), t)

    async def refresh(self) -> AsyncRun:
        self.info = api.parse_run(await self._t.json(api.run_get(self.id)))
        return self

    async def wait(self, timeout: float | None = None, *, on_stdout: api.OutputCallback | None = None,
                   on_stderr: api.OutputCallback | None = None) -> AsyncRun:  # fmt: skip
        deadline = None if timeout is None else time.monotonic() + timeout
        log = _RunLog(on_stdout, on_stderr)
        async for line in self._t.lines(api.run_logs(self.id)):
            log.feed_line(line)
            if deadline is not None and time.monotonic() > deadline:
                raise CommandTimeout(f"run {self.id} still {self.status} after {timeout} s")
        if log.record is not None:
            self.info = log.record
        while self.info.status in api.RUN_ACTIVE:
            if deadline is not None and time.monotonic() > deadline:
                raise CommandTimeout(f"run {self.id} still {self.status} after {timeout} s")
            await asyncio.sleep(POLL_S)
            await self.refresh()
        return self

    async def cancel(self) -> AsyncRun:
        self.info = api.parse_run(await self._t.json(api.run_cancel(self.id)))
        return self
