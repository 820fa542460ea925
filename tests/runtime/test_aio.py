"""``runtime.aio``'s waits never lose the caller's cancellation (a lost one leaves a
connection's task running for good: it kept a test's event loop from closing)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from runtime.aio import stop, within


async def _cancelled_as_it_finishes(wait: Callable[[Awaitable[Any], float], Awaitable[Any]]) -> str:
    """A task waiting (with ``wait``) on a future is cancelled in the same turn of the loop as
    the future gets its result: what the task does next."""
    inner: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def waiter() -> str:
        await wait(inner, 10)
        await asyncio.sleep(0.2)
        return "went on after its cancellation"

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)  # the task waits on the future
    inner.set_result(1)
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


def test_within_keeps_a_cancellation_that_arrives_as_the_wait_ends() -> None:
    assert asyncio.run(_cancelled_as_it_finishes(within)) == "cancelled"


def test_the_flaw_within_is_there_for() -> None:
    """Python 3.11's wait_for loses it (3.12 rewrote wait_for on asyncio.timeout): the reason
    the code waits with :func:`within`. If this starts to fail, the runtime's Python no longer
    has the flaw, and this test can go."""
    import sys

    got = asyncio.run(_cancelled_as_it_finishes(asyncio.wait_for))
    if sys.version_info < (3, 12):
        assert got == "went on after its cancellation"
    else:
        assert got == "cancelled"


def test_within_times_out_and_cancels_what_it_waited_on() -> None:
    async def main() -> None:
        slow = asyncio.ensure_future(asyncio.sleep(10))
        with pytest.raises(TimeoutError):
            await within(slow, 0.05)
        await asyncio.sleep(0)
        assert slow.cancelled()
        assert await within(asyncio.sleep(0, "answer"), 1) == "answer"
        assert await within(asyncio.sleep(0, "no limit"), None) == "no limit"

    asyncio.run(main())


def test_stop_waits_for_its_tasks_but_not_past_its_own_cancellation() -> None:
    async def main() -> None:
        cleaned = asyncio.Event()

        async def slow_to_stop() -> None:
            try:
                await asyncio.sleep(10)
            finally:
                await asyncio.sleep(0.3)  # its clean-up takes a while
                cleaned.set()

        async def failing() -> None:
            raise RuntimeError("ended badly")

        # What the stopped tasks end with is not raised, and they have ended when it returns.
        child, bad = asyncio.create_task(slow_to_stop()), asyncio.create_task(failing())
        await asyncio.sleep(0)
        await stop(child, bad, None)
        assert child.cancelled() and cleaned.is_set() and bad.done()

        # The caller cancelled while it waits for a task's clean-up: the caller ends
        # (``suppress(CancelledError)`` around the wait would have swallowed this one too).
        cleaned.clear()
        child = asyncio.create_task(slow_to_stop())
        after: list[str] = []

        async def caller() -> None:
            await stop(child)
            after.append("went on")

        outer = asyncio.create_task(caller())
        await asyncio.sleep(0.05)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        assert after == []
        with contextlib.suppress(asyncio.CancelledError):
            await child
        assert cleaned.is_set()

    asyncio.run(main())


def test_stop_reads_what_a_task_ends_with_even_after_its_caller_gave_up() -> None:
    """No "Task exception was never retrieved" for a stopped task that fails in its clean-up
    after the one stopping it was itself cancelled."""
    import gc

    unread: list[str] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: unread.append(ctx["message"]))

        async def fails_on_the_way_out() -> None:
            try:
                await asyncio.sleep(10)
            finally:
                await asyncio.sleep(0.1)
                raise RuntimeError("clean-up failed")  # noqa: B012

        child = asyncio.create_task(fails_on_the_way_out())
        await asyncio.sleep(0)
        caller = asyncio.create_task(stop(child))
        await asyncio.sleep(0.02)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0.2)
        assert child.done()
        del child
        gc.collect()

    asyncio.run(main())
    assert unread == []
