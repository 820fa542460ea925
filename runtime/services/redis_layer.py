"""channels_redis's layer with fewer round trips to Redis per message.

Every chunk of a live process's output, every keystroke and every start goes through the
layer (:mod:`runtime.streams`), so its round trips are on the path of each command a client
waits for. channels_redis 4 spends four on a ``send`` (trim, count, add, expire) and four on a
``group_send`` (trim and read the group, trim the members' queues, add); this layer does the
same work, with the same keys, messages and capacity rule, in one Lua script per ``send`` and
in two trips per ``group_send`` (read the group; one script for its members).

Its receive reads a process's own queue (``specific.<id>!``, where the bridge sends every
terminal's output) in batches. channels_redis pops one message per four round trips (the
backup clean-up script, ``BZPOPMIN``, the backup ``ZADD``, its removal), serialised by a lock
per queue; on an event loop busy serving API requests each trip waits its turn behind them,
so the queue drained at a few dozen messages a second and terminal output waited behind the
load for as long as it lasted (docs/reliability.md). Here one script takes up to
``RECEIVE_BATCH`` messages into the same backup queue and the process hands each to its
channel's waiting receiver; the backup is dropped once they are handed over, so a receive
cancelled mid-trip loses nothing (the next one puts the backup back first, as channels_redis
does). Keys, messages and order within a channel are channels_redis's, so processes on either
layer interoperate.
Any other channel's receive (the bridge's, a worker's) takes a message already waiting in one
trip (channels_redis spends three: put back what an interrupted receive left in the backup
queue, pop, back it up; one script does the three) and waits for one as channels_redis does.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

from channels.exceptions import ChannelFull
from channels_redis.core import RedisChannelLayer  # type: ignore[import-untyped]
from redis.exceptions import NoScriptError

log = logging.getLogger("hangar.layer")

# KEYS: the channels' queues; ARGV: their messages, then their capacities, then now and expiry.
# Returns how many were over capacity (their message is not added).
_ADD = """
local n = #KEYS
local now = tonumber(ARGV[2 * n + 1])
local expiry = tonumber(ARGV[2 * n + 2])
local over = 0
for i = 1, n do
    redis.call('ZREMRANGEBYSCORE', KEYS[i], 0, math.floor(now) - expiry)
    if redis.call('ZCOUNT', KEYS[i], '-inf', '+inf') < tonumber(ARGV[n + i]) then
        redis.call('ZADD', KEYS[i], now, ARGV[i])
        redis.call('EXPIRE', KEYS[i], expiry)
    else
        over = over + 1
    end
end
return over
"""
_ADD_SHA = hashlib.sha1(_ADD.encode()).hexdigest()

# KEYS: the channel's queue, its backup queue. channels_redis's clean-up (what an interrupted
# receive left in the backup goes back to the queue, in order), then the oldest message moved
# to the backup (removed once it is handed over, as channels_redis does); false when empty.
_POP = """
local backed_up = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
for i = #backed_up, 1, -2 do
    redis.call('ZADD', KEYS[1], backed_up[i], backed_up[i - 1])
end
redis.call('DEL', KEYS[2])
local popped = redis.call('ZPOPMIN', KEYS[1])
if popped[1] then
    redis.call('ZADD', KEYS[2], popped[2], popped[1])
    return popped[1]
end
return false
"""
_POP_SHA = hashlib.sha1(_POP.encode()).hexdigest()

# KEYS: a process's queue and its backup; ARGV: how many to take at most, the backup's expiry,
# and "1" when the process has handed over the batch the backup holds. If not (a receive was
# cancelled before it did), puts that batch back in front (those are the oldest). Then moves up
# to that many of the oldest messages to the backup and returns them, flattened (message,
# score, ...), oldest first.
_TAKE = """
if ARGV[3] ~= '1' then
    local backed_up = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
    for i = #backed_up, 1, -2 do
        redis.call('ZADD', KEYS[1], backed_up[i], backed_up[i - 1])
    end
end
redis.call('DEL', KEYS[2])
local taken = redis.call('ZPOPMIN', KEYS[1], tonumber(ARGV[1]))
for i = 1, #taken, 2 do
    redis.call('ZADD', KEYS[2], taken[i + 1], taken[i])
end
if #taken > 0 then
    redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
end
return taken
"""
_TAKE_SHA = hashlib.sha1(_TAKE.encode()).hexdigest()

# The most messages one receive takes from Redis: enough that a busy queue drains in a trip or
# two a second's worth, few enough that one batch never fills a channel's local buffer.
RECEIVE_BATCH = 100


class RedisLayer(RedisChannelLayer):
    """``channels_redis.core.RedisChannelLayer`` with ``send``, ``group_send``, ``group_add`` and
    the receive of process-local channels in fewer round trips (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Per queue: whether the batch in its backup was handed over.
        self._handed: dict[str, bool] = {}

    @staticmethod
    async def _script(connection: Any, script: str, sha: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await connection.evalsha(sha, len(keys), *keys, *args)
        except NoScriptError:  # a Redis that has not seen it yet (or restarted): load it once
            await connection.script_load(script)
            return await connection.evalsha(sha, len(keys), *keys, *args)

    async def _add(
        self, connection: Any, keys: list[str], messages: list[bytes], capacities: list[int]
    ) -> int:
        """Add each message to its queue (unless full, as channels_redis judges it): how many were not."""
        args = [*messages, *capacities, time.time(), int(self.expiry)]
        return int(await self._script(connection, _ADD, _ADD_SHA, keys, args))

    async def _brpop_with_clean(self, index: int, channel: str, timeout: float) -> Any:
        """channels_redis's (the next message, kept in the backup queue until it is handed over;
        None after ``timeout``), with a message already waiting taken in one trip."""
        backup = self._backup_channel_name(channel)
        connection = self.connection(index)
        member = await self._script(connection, _POP, _POP_SHA, [channel, backup], [])
        if member is not None:
            return member
        # Nothing waiting: block as channels_redis does (the backup is empty now).
        result = await connection.bzpopmin(channel, timeout=timeout)
        if result is None:
            return None
        _, member, score = result
        await connection.zadd(backup, {member: float(score)})
        return member

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        assert isinstance(message, dict), "message is not a dict"
        assert self.require_valid_channel_name(channel), "Channel name not valid"
        assert "__asgi_channel__" not in message
        name = channel
        if "!" in channel:  # a process-local channel: its process's queue, with its full name inside
            message = {**message, "__asgi_channel__": channel}
            name = self.non_local_name(channel)
            index = self.consistent_hash(channel)
        else:
            index = next(self._send_index_generator)
        connection = self.connection(index)
        if await self._add(
            connection, [self.prefix + name], [self.serialize(message)], [self.get_capacity(channel)]
        ):
            raise ChannelFull()

    async def group_add(self, group: str, channel: str) -> None:
        assert self.require_valid_group_name(group), "Group name not valid"
        assert self.require_valid_channel_name(channel), "Channel name not valid"
        connection = self.connection(self.consistent_hash(group))
        async with connection.pipeline(transaction=False) as pipe:
            pipe.zadd(self._group_key(group), {channel: time.time()})
            pipe.expire(self._group_key(group), self.group_expiry)
            await pipe.execute()

    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        assert self.require_valid_group_name(group), "Group name not valid"
        key = self._group_key(group)
        connection = self.connection(self.consistent_hash(group))
        async with connection.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(key, min=0, max=int(time.time()) - self.group_expiry)
            pipe.zrange(key, 0, -1)
            _, members = await pipe.execute()
        names = [m.decode("utf8") for m in members]
        if not names:
            return
        by_connection, messages, capacities = self._map_channel_keys_to_connection(names, message)
        for index, keys in by_connection.items():
            over = await self._add(
                self.connection(index), keys, [messages[k] for k in keys], [capacities[k] for k in keys]
            )
            if over:
                log.info("%d of %d channels over capacity in group %s", over, len(names), group)

    def _batch_size(self) -> int:
        """How many messages a receive may take: no more than the fullest local buffer has room
        for, so a batch never pushes out a message its receiver has not read yet."""
        fullest = max((q.qsize() for q in self.receive_buffer.values()), default=0)
        return max(1, min(RECEIVE_BATCH, self.capacity - fullest))

    async def receive_single(self, channel: str) -> tuple[Any, dict[str, Any]]:
        """Take the oldest messages of this process's queue in one trip: every one but the last
        goes to its channel's buffer here, the last is returned (``receive`` buffers it), so
        each channel's messages keep their order. A general channel is read as channels_redis does."""
        if "!" not in channel:
            return await super().receive_single(channel)
        assert self.require_valid_channel_name(channel, receive=True), "Channel name invalid"
        assert channel.endswith("!")
        key = self.prefix + channel
        backup = self._backup_channel_name(key)
        connection = self.connection(self.consistent_hash(channel))
        await self.receive_clean_locks.acquire(key)  # one receive takes from a queue at a time
        try:
            while True:
                # Whether the backup's batch was handed over, asked once: if this trip is cancelled,
                # the next one puts back what it took (at worst a batch twice, never one lost).
                handed = "1" if self._handed.pop(key, False) else "0"
                args = [self._batch_size(), int(self.expiry), handed]
                taken = await self._script(connection, _TAKE, _TAKE_SHA, [key, backup], args)
                if taken:
                    break
                # Nothing there: wait for the next message, keep it in the (now empty) backup,
                # as channels_redis does, and take it with whatever came after it.
                popped = await connection.bzpopmin(key, timeout=self.brpop_timeout)
                if popped is not None:
                    _, member, score = popped
                    await connection.zadd(backup, {member: float(score)})
            # Nothing is awaited from here on: the whole batch reaches the buffers at once.
            received = [self._unpack(channel, taken[i]) for i in range(0, len(taken), 2)]
            for names, message in received[:-1]:
                for name in names if isinstance(names, list) else [names]:
                    self.receive_buffer[name].put_nowait(message)
            self._handed[key] = True
            return received[-1]
        finally:
            self.receive_clean_locks.release(key)

    def _unpack(self, channel: str, content: bytes) -> tuple[Any, dict[str, Any]]:
        """The channel a message is for and the message. A ``group_send`` sends one message per
        process for all its channels in the group: then the channel is a list of them."""
        message = self.deserialize(content)
        name = message.pop("__asgi_channel__", channel)
        return name, message
