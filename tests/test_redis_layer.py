"""Hangar's Channels layer (:mod:`runtime.services.redis_layer`) on the test Redis: the same
messages, capacity rule and expiry as channels_redis's, in fewer round trips, and messages
that channels_redis's own layer reads (and the other way round)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from channels.exceptions import ChannelFull
from channels_redis.core import RedisChannelLayer
from django.conf import settings

from runtime.services.redis_layer import RedisLayer


def _layers(**config: object) -> tuple[RedisLayer, RedisChannelLayer]:
    prefix = f"test-layer-{uuid.uuid4().hex[:8]}"  # nothing shared with other tests' keys
    hosts = [settings.REDIS_URL]
    return (
        RedisLayer(hosts=hosts, prefix=prefix, **config),
        RedisChannelLayer(hosts=hosts, prefix=prefix, **config),
    )


def run(coro_fn, capacity: int = 3) -> None:
    async def main() -> None:
        ours, stock = _layers(capacity=capacity)
        try:
            await coro_fn(ours, stock)
        finally:
            await ours.flush()
            await ours.close_pools()
            await stock.close_pools()

    asyncio.run(main())


def test_a_message_sent_on_either_layer_is_received_on_the_other():
    async def check(ours: RedisLayer, stock: RedisChannelLayer) -> None:
        local = await stock.new_channel()
        await ours.send(local, {"type": "x.one", "data": b"\x00\xff"})
        assert await asyncio.wait_for(stock.receive(local), 5) == {"type": "x.one", "data": b"\x00\xff"}
        await ours.send("hangar.general", {"type": "x.two"})  # a general channel: no "!" in it
        assert (await asyncio.wait_for(stock.receive("hangar.general"), 5))["type"] == "x.two"
        mine = await ours.new_channel()
        await stock.send(mine, {"type": "x.three"})
        assert (await asyncio.wait_for(ours.receive(mine), 5))["type"] == "x.three"

    run(check)


def test_a_full_channel_refuses_as_channels_redis_does():
    async def check(ours: RedisLayer, stock: RedisChannelLayer) -> None:
        channel = await stock.new_channel()
        for i in range(3):
            await ours.send(channel, {"type": "x", "i": i})
        with pytest.raises(ChannelFull):
            await ours.send(channel, {"type": "x", "i": 3})
        with pytest.raises(ChannelFull):
            await stock.send(channel, {"type": "x", "i": 3})  # the same rule on the same queue
        got = [(await asyncio.wait_for(stock.receive(channel), 5))["i"] for _ in range(3)]
        assert got == [0, 1, 2]
        await ours.send(channel, {"type": "x", "i": 4})  # room again once read
        assert (await asyncio.wait_for(stock.receive(channel), 5))["i"] == 4

    run(check)


def test_group_send_reaches_every_member_once_and_skips_a_full_one():
    async def check(ours: RedisLayer, stock: RedisChannelLayer) -> None:
        a, b = await stock.new_channel(), await stock.new_channel()  # one process's two channels
        other = await ours.new_channel()  # another process's
        for channel in (a, b, other):
            await ours.group_add("g", channel)
        await ours.group_send("g", {"type": "x.hello"})
        for layer, channel in ((stock, a), (stock, b), (ours, other)):
            assert (await asyncio.wait_for(layer.receive(channel), 5))["type"] == "x.hello"
        for i in range(3):
            await ours.send(other, {"type": "x.fill", "i": i})
        await ours.group_send("g", {"type": "x.again"})  # other is full: the rest still get it
        assert (await asyncio.wait_for(stock.receive(a), 5))["type"] == "x.again"
        assert (await asyncio.wait_for(stock.receive(b), 5))["type"] == "x.again"
        assert [(await asyncio.wait_for(ours.receive(other), 5))["type"] for _ in range(3)] == ["x.fill"] * 3
        await ours.group_discard("g", a)
        await ours.group_send("g", {"type": "x.after"})
        assert (await asyncio.wait_for(stock.receive(b), 5))["type"] == "x.after"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(stock.receive(a), 0.3)

    run(check)


def test_a_group_send_to_an_empty_group_and_expired_members_send_nothing():
    async def check(ours: RedisLayer, stock: RedisChannelLayer) -> None:
        await ours.group_send("nobody", {"type": "x"})  # no members: nothing to do, no error
        channel = await stock.new_channel()
        await ours.group_add("g", channel)
        connection = ours.connection(0)
        # As if it had been added longer ago than the group expiry.
        await connection.zadd(ours._group_key("g"), {channel: time.time() - ours.group_expiry - 10})
        await ours.group_send("g", {"type": "x.late"})
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(stock.receive(channel), 0.3)
        assert await connection.zcard(ours._group_key("g")) == 0

    run(check)


def test_it_loads_its_script_again_after_redis_forgets_it():
    async def check(ours: RedisLayer, stock: RedisChannelLayer) -> None:
        channel = await stock.new_channel()
        await ours.send(channel, {"type": "x.before"})
        await ours.connection(0).script_flush()  # a restarted Redis has no scripts
        await ours.send(channel, {"type": "x.after"})
        got = [(await asyncio.wait_for(stock.receive(channel), 5))["type"] for _ in range(2)]
        assert got == ["x.before", "x.after"]

    run(check)


def _counting(layer: RedisLayer) -> list[str]:
    """The names of the commands ``layer`` sends to Redis from now on."""
    sent: list[str] = []
    for index in range(layer.ring_size):
        connection = layer.connection(index)
        execute = connection.execute_command

        async def counted(*args, _execute=execute, **kwargs):
            sent.append(str(args[0]).upper())
            return await _execute(*args, **kwargs)

        connection.execute_command = counted
    return sent


def test_a_waiting_message_is_taken_in_one_trip_and_others_in_order():
    async def check(ours: RedisLayer, stock: RedisChannelLayer) -> None:
        for i in range(3):
            await stock.send("hangar.general", {"type": "x", "i": i})
        sent = _counting(ours)
        first = await asyncio.wait_for(ours.receive("hangar.general"), 5)
        assert first["i"] == 0
        assert sent[0] == "EVALSHA" and "BZPOPMIN" not in sent and "EVAL" not in sent
        rest = [(await asyncio.wait_for(ours.receive("hangar.general"), 5))["i"] for _ in range(2)]
        assert rest == [1, 2]
        # None waiting: the receive waits for the next one, as channels_redis's does.
        later = asyncio.ensure_future(ours.receive("hangar.general"))
        await asyncio.sleep(0.1)
        await stock.send("hangar.general", {"type": "x", "i": 3})
        assert (await asyncio.wait_for(later, 5))["i"] == 3
        await asyncio.sleep(0.1)  # the handed-over messages leave the backup queue
        backup = ours._backup_channel_name(ours.prefix + "hangar.general")
        assert await ours.connection(0).zcard(backup) == 0

    run(check)


def test_what_an_interrupted_receive_left_in_the_backup_is_received_again():
    async def check(ours: RedisLayer, stock: RedisChannelLayer) -> None:
        await stock.send("hangar.general", {"type": "x.lost"})
        await stock.send("hangar.general", {"type": "x.next"})
        key = ours.prefix + "hangar.general"
        connection = ours.connection(0)
        # As a receive cancelled between its pop and its hand-over leaves it.
        [(member, score)] = await connection.zpopmin(key)
        await connection.zadd(ours._backup_channel_name(key), {member: score})
        got = [(await asyncio.wait_for(ours.receive("hangar.general"), 5))["type"] for _ in range(2)]
        assert got == ["x.lost", "x.next"]

    run(check)


def test_hangar_uses_it():
    assert settings.CHANNEL_LAYERS["default"]["BACKEND"] == "runtime.services.redis_layer.RedisLayer"


def test_a_batch_reaches_each_channel_in_order_in_one_trip():
    async def check(ours: RedisLayer, stock: RedisChannelLayer) -> None:
        a, b = await ours.new_channel(), await ours.new_channel()
        for i in range(20):
            await stock.send(a if i % 2 else b, {"type": "x", "i": i})
        trips = 0
        take = ours._script

        async def counted(*args: object) -> object:
            nonlocal trips
            trips += 1
            return await take(*args)

        ours._script = counted  # type: ignore[method-assign]
        got_a = [(await asyncio.wait_for(ours.receive(a), 5))["i"] for _ in range(10)]
        got_b = [(await asyncio.wait_for(ours.receive(b), 5))["i"] for _ in range(10)]
        assert got_a == list(range(1, 20, 2)) and got_b == list(range(0, 20, 2))
        assert trips == 1  # all twenty came in one script call (channels_redis: 4 trips each)

    run(check, capacity=100)


def test_a_batch_never_pushes_out_a_message_not_yet_read():
    async def check(ours: RedisLayer, stock: RedisChannelLayer) -> None:
        # capacity=3: a local buffer holds 3, so a batch is 3 at most, less the most any holds unread.
        slow, busy = await ours.new_channel(), await ours.new_channel()
        for i in range(3):
            await ours.send(slow, {"type": "x", "i": i})
        assert (await asyncio.wait_for(ours.receive(slow), 5))["i"] == 0  # takes 0, 1, 2
        assert ours._batch_size() == 1  # slow's buffer holds 2 unread of 3
        await ours.send(busy, {"type": "x.busy"})
        for i in range(3, 5):
            await ours.send(slow, {"type": "x", "i": i})
        assert (await asyncio.wait_for(ours.receive(busy), 5))["type"] == "x.busy"  # takes only it
        got = [(await asyncio.wait_for(ours.receive(slow), 5))["i"] for _ in range(4)]
        assert got == [1, 2, 3, 4]

    run(check)


def test_a_receive_cancelled_mid_trip_loses_nothing():
    async def check(ours: RedisLayer, stock: RedisChannelLayer) -> None:
        channel = await ours.new_channel()
        key = ours.prefix + ours.non_local_name(channel)
        for i in range(3):
            await stock.send(channel, {"type": "x", "i": i})
        take = ours._script

        async def cancelled_after(*args: object) -> object:
            await take(*args)  # Redis moved the batch to the backup; its answer never arrives
            raise asyncio.CancelledError

        ours._script = cancelled_after  # type: ignore[method-assign]
        with pytest.raises(asyncio.CancelledError):
            await ours.receive(channel)
        assert await ours.connection(0).zcard(key + "$inflight") == 3  # kept in the backup
        ours._script = take  # type: ignore[method-assign]
        got = [(await asyncio.wait_for(ours.receive(channel), 5))["i"] for _ in range(3)]
        assert got == [0, 1, 2]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(ours.receive(channel), 0.3)  # and nothing twice

    run(check)


def test_a_receiver_waiting_on_an_empty_queue_gets_what_is_sent_later():
    async def check(ours: RedisLayer, stock: RedisChannelLayer) -> None:
        a, b = await ours.new_channel(), await ours.new_channel()
        waiting = [asyncio.ensure_future(ours.receive(c)) for c in (a, b)]
        await asyncio.sleep(0.2)  # both wait, one of them blocked in Redis
        await stock.send(b, {"type": "x.b"})
        await stock.send(a, {"type": "x.a"})
        got = await asyncio.wait_for(asyncio.gather(*waiting), 5)
        assert [m["type"] for m in got] == ["x.a", "x.b"]
        key = ours.prefix + ours.non_local_name(a)
        await ours.send(a, {"type": "x.next"})
        assert (await asyncio.wait_for(ours.receive(a), 5))["type"] == "x.next"
        assert await ours.connection(0).zcard(key) == 0

    run(check)


def test_a_group_message_for_several_of_a_process_channels_reaches_each_in_a_batch():
    async def check(ours: RedisLayer, stock: RedisChannelLayer) -> None:
        # group_send sends one message per process, naming all its channels in the group.
        a, b, c = [await ours.new_channel() for _ in range(3)]
        for channel in (a, b):
            await ours.group_add("g", channel)
        await stock.send(c, {"type": "x.before"})
        await ours.group_send("g", {"type": "x.all"})
        await stock.send(a, {"type": "x.after"})
        assert (await asyncio.wait_for(ours.receive(c), 5))["type"] == "x.before"  # takes all three
        assert [(await asyncio.wait_for(ours.receive(a), 5))["type"] for _ in range(2)] == [
            "x.all",
            "x.after",
        ]
        assert (await asyncio.wait_for(ours.receive(b), 5))["type"] == "x.all"

    run(check, capacity=100)
