"""Long-lived connections that are not websocket consumers (SSH sessions, followed output
streams) watching for the end of their access, as the consumers do (:mod:`dashboard.websockets.consumers`):
an ``auth.changed`` message to their user's group (``runtime.notify.auth_changed``) or, in case
one was lost, every ``HANGAR_AUTH_RECHECK_S`` and at the token's expiry, makes them check again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Any

from channels.layers import get_channel_layer
from django.conf import settings
from django.utils import timezone

from runtime.aio import blocking, stop, within
from runtime.notify import auth_group
from runtime.services.auth import token_current

from .streaming import error_line

log = logging.getLogger(__name__)


class AuthWatch:
    """Calls ``check`` (which says why access ended, or "" while it goes on) on each message
    for ``user_id`` and periodically; once it says why, ``ended`` is set and ``why`` holds it.
    ``settled`` is clear while a check that a message asked for is under way: input the client
    sends meanwhile waits for its outcome (:meth:`may_go_on`)."""

    def __init__(
        self, user_id: int, check: Callable[[], Awaitable[str]], *, expires_at: datetime | None = None
    ) -> None:
        self.user_id = user_id
        self.check = check
        self.expires_at = expires_at
        self.ended = asyncio.Event()
        self.settled = asyncio.Event()
        self.settled.set()
        self.why = ""
        self.task: asyncio.Task[None] | None = None
        self.channel = ""
        self.stopping = False

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        task = self.task
        if task is None or task.done():
            return
        self.stopping = True
        try:
            # A layer's receive is never cancelled to stop it (a cancelled channels_redis receive
            # can hold the stop up for as long as it waits): a message to its own channel ends it.
            if self.channel:
                with contextlib.suppress(Exception):
                    await get_channel_layer().send(self.channel, {"type": "hangar.watch.stop"})
                with contextlib.suppress(Exception):
                    await within(asyncio.shield(task), 5)
        finally:
            await stop(task)

    async def may_go_on(self) -> bool:
        """Once no check is under way: whether access goes on."""
        if not self.settled.is_set():
            await self.settled.wait()
        return not self.ended.is_set()

    def _wait(self) -> float:
        wait = float(settings.HANGAR_AUTH_RECHECK_S)
        if self.expires_at is not None:
            wait = min(wait, max(0.0, (self.expires_at - timezone.now()).total_seconds()) + 0.05)
        return wait

    async def _run(self) -> None:
        layer = get_channel_layer()
        channel = await layer.new_channel()
        group = auth_group(self.user_id)
        await layer.group_add(group, channel)
        self.channel = channel
        received: asyncio.Future[Any] | None = None
        try:
            while True:
                # The receive is waited for, not cancelled, when the time for a check comes.
                received = received or asyncio.ensure_future(layer.receive(channel))
                await asyncio.wait({received}, timeout=self._wait())
                if received.done():
                    received.result()
                    received = None
                    if self.stopping:
                        return
                    self.settled.clear()  # a change was announced: hold input until checked
                try:
                    why = await self.check()
                except Exception:  # the database away for a moment: try again at the next turn
                    log.warning("could not check again who a connection acts for", exc_info=True)
                    self.settled.set()
                    continue
                if why:
                    self.why = why
                    self.ended.set()
                    return
                self.settled.set()
        finally:
            self.settled.set()  # never leaves input waiting (ended says what to do with it)
            if received is not None and not received.done():
                received.cancel()
            with contextlib.suppress(Exception):
                await layer.group_discard(group, channel)


def _token_ended(token_id: int) -> str:
    if token_current(token_id=token_id) is None:
        return "the token was revoked or expired, or its user is no longer in the team"
    return ""


async def while_authorised(body: AsyncIterator[bytes], token: Any) -> AsyncIterator[bytes]:
    """``body`` (NDJSON lines) for as long as ``token`` stays good: once it is revoked or
    expires, or its user leaves the team, a last ``{"type": "error"}`` line and the end (a
    streamed exec that belongs to the request is then killed, as when the client hangs up)."""
    watch = AuthWatch(token.user_id, blocking(lambda: _token_ended(token.id)), expires_at=token.expires_at)
    watch.start()
    ended = asyncio.ensure_future(watch.ended.wait())
    it = body.__aiter__()
    chunk: asyncio.Future[bytes] | None = None
    try:
        while True:
            chunk = asyncio.ensure_future(it.__anext__())
            await asyncio.wait({chunk, ended}, return_when=asyncio.FIRST_COMPLETED)
            if not chunk.done():
                yield error_line(f"access ended: {watch.why}")
                return
            try:
                data = chunk.result()
            except StopAsyncIteration:
                return
            chunk = None
            yield data
    finally:
        ended.cancel()
        if chunk is not None and not chunk.done():
            chunk.cancel()  # the body's own cleanup runs in it (a streamed exec is killed)
            await asyncio.wait({chunk}, timeout=5)
        if chunk is not None and chunk.done() and not chunk.cancelled():
            chunk.exception()  # its end or failure, seen: the stream is over either way
        with contextlib.suppress(Exception):
            await it.aclose()  # type: ignore[attr-defined]
        await watch.stop()
