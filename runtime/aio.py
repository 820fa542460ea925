"""Run blocking service calls off the event loop.

Django runs plain sync views on one shared thread under ASGI, so a request that waits for a
sandbox to start would hold up every other request. API views, consumers and async services
hand their blocking work to this pool instead; each call closes the connections it used.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asgiref.sync import sync_to_async
from django.db import close_old_connections

_POOL = ThreadPoolExecutor(max_workers=64, thread_name_prefix="hangar-blocking")


def blocking(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        close_old_connections()
        try:
            return fn(*args, **kwargs)
        finally:
            close_old_connections()

    return sync_to_async(call, thread_sensitive=False, executor=_POOL)
