"""Input flow control between a sender and the node's stream bridge: a command that does not
read its stdin holds its sender back (at most a window in flight) instead of filling the
bridge's memory, and the bridge keeps a bounded amount of unread input per process.

The bridge here is the real one on an in-memory channel layer, with a command that reads its
stdin only when the test lets it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from channels.layers import InMemoryChannelLayer

from runtime import streams
from runtime.launchers.base import Process, ProcessExit
from runtime.node import bridge as bridge_mod
from runtime.services import processes as proc_svc
from runtime.services.channel_layer import LAYER

NODE = "node-in"


class SlowReader(Process):
    """A command whose stdin is read only while ``reading`` is set (send_stdin blocks, as a
    write to a full pipe does)."""

    pid = 42

    def __init__(self) -> None:
        self.reading = threading.Event()
        self.received = bytearray()
        self.closed = threading.Event()
        self.lock = threading.Lock()
        self.signals: list[int] = []

    def events(self) -> Iterator[tuple[str, bytes | ProcessExit]]:
        self.closed.wait()
        yield ("exit", ProcessExit(exit_code=0, signal=0, timed_out=False))

    def send_stdin(self, data: bytes) -> None:
        with self.lock:  # as the agent's connection: no other frame passes a write in progress
            while not self.reading.wait(0.05):
                if self.closed.is_set():
                    raise OSError("the process ended")
            self.received += data

    def close_stdin(self) -> None:
        pass

    def resize(self, rows: int, cols: int) -> None:
        pass

    def send_signal(self, sig: int) -> None:
        with self.lock:
            if self.closed.is_set():
                raise OSError("the process ended")
            self.signals.append(sig)

    def close(self) -> None:
        self.closed.set()


class Launcher:
    def __init__(self, process: SlowReader) -> None:
        self.process = process

    def open_process(self, handle: dict, req: object) -> SlowReader:
        return self.process


@pytest.fixture
def rig(monkeypatch):
    process = SlowReader()
    monkeypatch.setattr(bridge_mod, "launcher_for", lambda runtime: Launcher(process))
    monkeypatch.setattr(bridge_mod, "_record_end", lambda *a, **k: None)  # no database here
    monkeypatch.setattr(bridge_mod, "STDIN_PENDING", 1024 * 1024)
    yield process
    process.close()


async def _start(process: SlowReader) -> tuple[bridge_mod.Bridge, asyncio.Task, object]:
    layer = InMemoryChannelLayer(capacity=1000)
    LAYER.set(layer)
    bridge = bridge_mod.Bridge(NODE, layer)
    bridge.loop = asyncio.get_running_loop()

    async def serve() -> None:
        while True:
            await bridge.dispatch(await layer.receive(bridge.channel))

    task = asyncio.create_task(serve())
    reply = await layer.new_channel()
    await layer.send(bridge.channel, {"type": streams.START, "key": "x1", "reply": reply, "argv": ["cat"],
                                      "runtime": "fake", "handle": {}, "sandbox_id": "sb1", "stdin_open": True})  # fmt: skip
    assert (await layer.receive(reply))["type"] == streams.STARTED
    return bridge, task, layer


async def _finish(process: SlowReader, bridge: bridge_mod.Bridge, task: asyncio.Task) -> None:
    """End the command while the loop still runs (its reader thread reports to the loop)."""
    process.close()
    for _ in range(100):
        if bridge.procs["x1"].exit is not None:
            break
        await asyncio.sleep(0.05)
    task.cancel()


def test_a_command_that_does_not_read_holds_its_sender_back_to_a_window(rig):
    data = bytes(range(256)) * (12 * 1024)  # 3 MiB

    async def main() -> None:
        bridge, task, _ = await _start(rig)
        sender = proc_svc.InputSender(NODE, "x1", window=256 * 1024)
        await sender.send(data[:5])  # under the window: sent at once
        assert not await sender.drain(0.2)  # but not read: a caller can say so and move on
        sending = asyncio.create_task(sender.send(data[5:]))
        await asyncio.sleep(0.5)
        # Nothing is read: the sender waits with one window in flight, and the bridge holds
        # no more than that of it.
        assert not sending.done()
        assert sender.sent - sender.written <= 256 * 1024 + proc_svc.INPUT_CHUNK, sender.sent
        assert bridge.procs["x1"].stdin_pending <= 256 * 1024 + proc_svc.INPUT_CHUNK
        rig.reading.set()
        await asyncio.wait_for(sending, 10)
        assert await sender.drain(5)
        assert bytes(rig.received) == data  # all of it, in order
        assert bridge.procs["x1"].stdin_pending == 0
        await _finish(rig, bridge, task)

    asyncio.run(main())


def test_unread_input_past_the_nodes_bound_is_refused_not_kept(rig):
    async def main() -> None:
        bridge, task, layer = await _start(rig)
        # A source that does not wait (a terminal's keystrokes) fills the bound; the rest is
        # dropped and counted, not kept.
        for _ in range(24):
            await proc_svc.process_send(node_name=NODE, key="x1", kind=streams.INPUT, data=b"k" * 65536)
        await asyncio.sleep(0.2)
        lp = bridge.procs["x1"]
        assert lp.stdin_pending <= 1024 * 1024 and lp.stdin_refused >= 8 * 65536, (
            lp.stdin_pending,
            lp.stdin_refused,
        )
        # A sender that asks is told, with what to do.
        sender = proc_svc.InputSender(NODE, "x1")
        await sender.send(b"z" * 65536, whole=True)
        with pytest.raises(proc_svc.InputRefused, match="has not read the input it was sent"):
            await sender.drain(5)
        # Once the command reads, input is taken again; but not more of a stream that was cut
        # (it would go in with a gap).
        rig.reading.set()
        await asyncio.sleep(0.3)
        await sender.send(b"rest", whole=True)
        with pytest.raises(proc_svc.InputRefused):
            await sender.drain(5)
        assert not bytes(rig.received).endswith(b"rest")
        sender = proc_svc.InputSender(NODE, "x1")
        await sender.send(b"after", whole=True)
        assert await sender.drain(5)
        assert bytes(rig.received).endswith(b"after") and lp.stdin_pending == 0
        await _finish(rig, bridge, task)

    asyncio.run(main())


def test_a_sender_waiting_on_a_command_that_ends_is_let_go(rig):
    async def main() -> None:
        bridge, task, _ = await _start(rig)
        sender = proc_svc.InputSender(NODE, "x1", window=128 * 1024)
        sending = asyncio.create_task(sender.send(b"q" * (1024 * 1024)))
        await asyncio.sleep(0.3)
        assert not sending.done()
        rig.close()  # the command exits without reading
        await asyncio.wait_for(sending, 10)  # the rest goes to a process that is gone: acknowledged
        assert await sender.drain(5)
        assert bridge.procs["x1"].exit is not None
        for _ in range(40):  # the write that was under way when it ended fails in a moment
            if bridge.procs["x1"].stdin_pending == 0:
                break
            await asyncio.sleep(0.05)
        assert bridge.procs["x1"].stdin_pending == 0
        await _finish(rig, bridge, task)

    asyncio.run(main())


def test_a_kill_gets_through_to_a_command_whose_connection_is_held_by_unread_input(rig, monkeypatch):
    """The kill cannot pass the write in progress (the agent reads no frame past it): the
    bridge hangs up after a moment, which ends the command, and its loop never waits."""
    monkeypatch.setattr(bridge_mod, "KILL_WAIT_S", 0.5)

    async def main() -> None:
        bridge, task, layer = await _start(rig)
        await proc_svc.process_send(node_name=NODE, key="x1", kind=streams.INPUT, data=b"w" * 4096)
        await asyncio.sleep(0.2)  # the write is under way, and blocked
        started = asyncio.get_running_loop().time()
        await proc_svc.process_send(node_name=NODE, key="x1", kind=streams.KILL)
        # Meanwhile the bridge answers others at once.
        probe = proc_svc.InputSender(NODE, "gone")
        await probe.send(b"x", whole=True)
        assert await probe.drain(0.3)
        for _ in range(60):
            if bridge.procs["x1"].exit is not None:
                break
            await asyncio.sleep(0.05)
        assert bridge.procs["x1"].exit is not None and rig.closed.is_set()
        assert asyncio.get_running_loop().time() - started < 2.5
        await _finish(rig, bridge, task)

    asyncio.run(main())
