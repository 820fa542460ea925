"""What a test's event loops are waiting on when it is about to run out of time.

pytest-timeout prints every thread's stack when a test overruns; for a test stuck inside
``asyncio.run`` that is only the loop's ``select``. A few seconds before that, this prints each
running loop's tasks with their stacks (to the test's stderr, shown with its failure), so a
hang shows which coroutine it is."""

from __future__ import annotations

import asyncio
import gc
import io
import sys
import threading
from typing import Any

AHEAD_S = 5.0  # how long before the timeout the tasks are printed
_timers: dict[str, threading.Timer] = {}


def _running_loops() -> list[asyncio.AbstractEventLoop]:
    return [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]


def dump_tasks(title: str) -> str:
    out = io.StringIO()
    for loop in _running_loops():
        tasks = asyncio.all_tasks(loop)
        print(f"--- {title}: {len(tasks)} task(s) of {loop!r}", file=out)
        for task in tasks:
            print(f"{task!r}", file=out)
            try:
                task.print_stack(limit=12, file=out)
            except Exception as exc:  # another thread runs it: a frame may go as it is read
                print(f"  (stack unreadable: {exc})", file=out)
    return out.getvalue()


def pytest_timeout_set_timer(item: Any, settings: Any) -> None:
    timeout = float(getattr(settings, "timeout", 0) or 0)
    if timeout <= AHEAD_S * 2:
        return

    def fire() -> None:
        text = dump_tasks(f"{item.nodeid} is {AHEAD_S:.0f} s from its timeout")
        if text:
            sys.stderr.write(text)
            sys.stderr.flush()

    timer = threading.Timer(timeout - AHEAD_S, fire)
    timer.daemon = True
    timer.start()
    _timers[item.nodeid] = timer


def pytest_timeout_cancel_timer(item: Any) -> None:
    timer = _timers.pop(item.nodeid, None)
    if timer is not None:
        timer.cancel()
