"""A process started with its follower attached (``START`` carrying ``attach``): the follower
is in place before the command's first byte is read, so it sees everything from offset 0 and
the exit without a separate attach round trip; the starter is told whether the attach was taken.

The bridge here is the real one on an in-memory channel layer, with a command that prints one
line and exits 3."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from channels.layers import InMemoryChannelLayer

from runtime import streams
from runtime.launchers.base import Process, ProcessExit
from runtime.node import bridge as bridge_mod
from runtime.services.channel_layer import LAYER

BRIDGE = streams.bridge_channel("node-start")


class Quick(Process):
    pid = 7

    def events(self) -> Iterator[tuple[str, bytes | ProcessExit]]:
        yield ("stdout", b"hi\n")
        yield ("exit", ProcessExit(exit_code=3, signal=0, timed_out=False))

    def send_stdin(self, data: bytes) -> None:
        pass

    def close_stdin(self) -> None:
        pass

    def resize(self, rows: int, cols: int) -> None:
        pass

    def send_signal(self, sig: int) -> None:
        pass

    def close(self) -> None:
        pass


class Launcher:
    def open_process(self, handle: dict, req: object) -> Quick:
        return Quick()


@pytest.fixture(autouse=True)
def fake_runtime(monkeypatch):
    monkeypatch.setattr(bridge_mod, "launcher_for", lambda runtime: Launcher())
    monkeypatch.setattr(bridge_mod, "_record_end", lambda *a, **k: None)  # no database here


async def _bridge() -> tuple[bridge_mod.Bridge, asyncio.Task, InMemoryChannelLayer]:
    layer = InMemoryChannelLayer(capacity=1000)
    LAYER.set(layer)
    bridge = bridge_mod.Bridge("node-start", layer)
    bridge.loop = asyncio.get_running_loop()

    async def serve() -> None:
        while True:
            await bridge.dispatch(await layer.receive(bridge.channel))

    return bridge, asyncio.create_task(serve()), layer


def _start_message(reply: str, **extra: object) -> dict:
    return {"type": streams.START, "key": "x9", "reply": reply, "argv": ["echo", "hi"], "runtime": "fake",
            "handle": {}, "sandbox_id": "sb1", **extra}  # fmt: skip


def test_a_follower_attached_with_the_start_gets_all_the_output_and_the_exit():
    async def main() -> None:
        _, task, layer = await _bridge()
        reply, viewer = await layer.new_channel(), await layer.new_channel()
        await layer.group_add(streams.proc_group("x9"), viewer)
        attach = {"reply": viewer, "offset": 0, "live": False, "flow": True}
        await layer.send(BRIDGE, _start_message(reply, attach=attach))
        started = await asyncio.wait_for(layer.receive(reply), 5)
        assert started["type"] == streams.STARTED and started["pid"] == 7 and started["attached"] is True
        follower = streams.Follower(want=0)
        seen: list[tuple] = []
        while not follower.done:
            msg = await asyncio.wait_for(layer.receive(viewer), 5)
            if msg["type"] == streams.SYNCED:
                assert msg["start"] == 0  # attached before anything was read
            seen += follower.feed(msg)
        assert [e for e in seen if e[0] == "output"] == [("output", "stdout", b"hi\n", 3)]
        assert seen[-1][0] == "exit" and seen[-1][1]["exit_code"] == 3
        assert not [e for e in seen if e[0] in ("resync", "skipped")]
        task.cancel()

    asyncio.run(main())


def test_a_start_without_an_attach_says_so():
    async def main() -> None:
        _, task, layer = await _bridge()
        reply = await layer.new_channel()
        await layer.send(BRIDGE, _start_message(reply))
        started = await asyncio.wait_for(layer.receive(reply), 5)
        assert started["type"] == streams.STARTED and started["attached"] is False
        task.cancel()

    asyncio.run(main())


def test_a_slow_start_holds_up_no_other_stream_and_what_comes_for_it_waits_for_it(monkeypatch):
    """A sandbox slow to start a command (its agent busy, the sandbox being paused) must not
    stop the node's bridge answering everyone else; an attach sent for the command while it
    starts is answered once it has (not "unknown")."""
    import threading

    go = threading.Event()

    class Slow(Launcher):
        def open_process(self, handle: dict, req: object) -> Quick:
            go.wait(10)
            return Quick()

    monkeypatch.setattr(bridge_mod, "launcher_for", lambda runtime: Slow())

    async def main() -> None:
        _, task, layer = await _bridge()
        reply, early, other = await layer.new_channel(), await layer.new_channel(), await layer.new_channel()
        await layer.send(BRIDGE, _start_message(reply))
        await layer.send(BRIDGE, {"type": streams.ATTACH, "key": "x9", "reply": early, "offset": 0, "live": False,
                                  "flow": False})  # fmt: skip
        await layer.send(BRIDGE, {"type": streams.ATTACH, "key": "x8", "reply": other, "offset": 0, "live": False,
                                  "flow": False})  # fmt: skip
        # Another process's follower is answered while the start still waits on its sandbox.
        assert (await asyncio.wait_for(layer.receive(other), 2))["type"] == streams.UNKNOWN
        assert not go.is_set()
        go.set()
        assert (await asyncio.wait_for(layer.receive(reply), 5))["type"] == streams.STARTED
        assert (await asyncio.wait_for(layer.receive(early), 5))["type"] == streams.SYNCED
        task.cancel()

    asyncio.run(main())
