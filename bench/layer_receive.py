#!/usr/bin/env python3
"""How long a message waits in a process's channel-layer queue while that process's event loop
is busy, as the server's is under API load: channels_redis's receive (Hangar's layer before
it read in batches) against Hangar's (:mod:`runtime.services.redis_layer`), interleaved.

A sender thread (the stream bridge: its own event loop and layer) sends ``--rate`` messages a
second, spread over ``--channels`` channels of the receiving process (its terminals), for
``--seconds``; the receiving loop runs a consumer per channel (``receive`` in a loop, as
Channels' consumers do) beside ``--busy`` tasks that each burn ``--slice-ms`` of CPU between
awaits, again and again (the API requests the server serves meanwhile). Each message carries
when it was sent; the figure is how long after that its consumer had it. Needs Redis
(``REDIS_URL``, default the test one). Prints a table, writes JSON (default
bench/results/layer_receive.json).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

from _common import pct, write_results  # noqa: E402


def _send(layer_cls, hosts, prefix, channels, rate, seconds, ready, sent) -> None:
    """In a process of its own, as the bridge is (a thread would share the busy loop's GIL)."""

    async def main() -> None:
        layer = layer_cls(hosts=hosts, prefix=prefix, capacity=1000, expiry=60)
        await layer.send(channels[0], {"type": "x", "t": None})  # connected before the clock starts
        ready.wait()
        started, total = time.monotonic(), int(rate * seconds)
        n = 0
        while n < total:  # the same messages every round, however late they go out
            due = min(total, int((time.monotonic() - started) * rate))
            while n < due:
                await layer.send(channels[n % len(channels)], {"type": "x", "t": time.time(), "n": n})
                n += 1
            await asyncio.sleep(0.005)
        await layer.close_pools()
        sent.value = n

    asyncio.run(main())


async def _round(receiver_cls, sender_cls, hosts, args) -> dict:
    prefix = f"bench-layer-{uuid.uuid4().hex[:8]}"
    layer = receiver_cls(hosts=hosts, prefix=prefix, capacity=1000, expiry=60)
    channels = [await layer.new_channel() for _ in range(args.channels)]
    waits: list[float] = []
    stop = asyncio.Event()

    async def consumer(channel: str) -> None:
        while True:
            message = await layer.receive(channel)
            if message["t"] is not None:
                waits.append(time.time() - message["t"])

    async def busy() -> None:
        while not stop.is_set():
            until = time.perf_counter() + args.slice_ms / 1000
            while time.perf_counter() < until:
                pass
            await asyncio.sleep(0)

    context = multiprocessing.get_context("spawn")
    ready, sent = context.Event(), context.Value("i", -1)
    sender = context.Process(
        target=_send, args=(sender_cls, hosts, prefix, channels, args.rate, args.seconds, ready, sent)
    )
    sender.start()
    consumers = [asyncio.ensure_future(consumer(c)) for c in channels]
    load = [asyncio.ensure_future(busy()) for _ in range(args.busy)]
    await asyncio.sleep(0.5)  # the consumers are waiting
    ready.set()
    while sender.is_alive():
        await asyncio.sleep(0.1)
    deadline = time.monotonic() + args.drain
    while len(waits) < sent.value and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    stop.set()
    for task in [*consumers, *load]:
        task.cancel()
    await asyncio.gather(*consumers, *load, return_exceptions=True)
    await layer.flush()
    await layer.close_pools()
    return {
        "sent": sent.value,
        "received": len(waits),
        "wait_p50_s": pct(waits, 50),
        "wait_p95_s": pct(waits, 95),
        "wait_max_s": max(waits),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=200, help="messages a second (default 200)")
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--channels", type=int, default=20)
    parser.add_argument("--busy", type=int, default=50, help="busy tasks on the receiving loop")
    parser.add_argument("--slice-ms", type=float, default=0.2, help="CPU each burns between awaits")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--drain", type=float, default=60, help="seconds to wait for the rest after")
    parser.add_argument("--out", default=str(ROOT / "bench/results/layer_receive.json"))
    args = parser.parse_args()

    import django

    django.setup()
    from channels_redis.core import RedisChannelLayer
    from django.conf import settings

    from runtime.services.redis_layer import RedisLayer

    hosts = [os.environ.get("REDIS_URL", settings.REDIS_URL)]
    layers = {"channels_redis receive (parent)": RedisChannelLayer, "batched receive (this)": RedisLayer}
    runs: dict[str, list[dict]] = {name: [] for name in layers}
    print(
        f"\n{args.rate:g} msg/s over {args.channels} channels for {args.seconds:g} s; "
        f"receiving loop: {args.busy} tasks × {args.slice_ms:g} ms CPU between awaits"
        f" (got: received within {args.drain:g} s after the last was sent)\n"
    )
    print(f"{'receive':34} {'sent':>6} {'got':>6} {'p50 s':>7} {'p95 s':>7} {'max s':>7}", flush=True)
    for _ in range(args.repeat):
        for name, cls in layers.items():  # interleaved: the same machine state for both
            r = asyncio.run(_round(cls, RedisLayer, hosts, args))
            runs[name].append(r)
            print(
                f"{name:34} {r['sent']:>6} {r['received']:>6} {r['wait_p50_s']:>7.3f} "
                f"{r['wait_p95_s']:>7.3f} {r['wait_max_s']:>7.3f}",
                flush=True,
            )
    write_results(args.out, {"config": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
