"""The Channels layer that live processes are reached through: the process's shared one, or,
on a worker thread's own event loop, one of that loop's own (:func:`run_with_own_layer`)."""

from __future__ import annotations

import asyncio
import contextlib
from contextvars import ContextVar
from typing import Any

# Set for the duration of :func:`run_with_own_layer` (and by tests with a layer of their own).
LAYER: ContextVar[Any] = ContextVar("hangar_channel_layer", default=None)


def channel_layer() -> Any:
    layer = LAYER.get()
    if layer is not None:
        return layer
    from channels.layers import get_channel_layer

    return get_channel_layer()


def run_with_own_layer(make_coro: Any) -> Any:
    """Run ``make_coro()`` to the end on a new event loop with a Channels layer of its own
    (from a worker thread: the shared layer belongs to whichever loop used it first)."""

    async def main() -> Any:
        from channels.layers import DEFAULT_CHANNEL_LAYER, channel_layers

        layer = channel_layers.make_backend(DEFAULT_CHANNEL_LAYER)
        LAYER.set(layer)
        try:
            return await make_coro()
        finally:
            close = getattr(layer, "close_pools", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()

    return asyncio.run(main())
