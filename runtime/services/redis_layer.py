"""channels_redis's layer with fewer round trips to Redis per message.

Every chunk of a live process's output, every keystroke and every start goes through the
layer (:mod:`runtime.streams`), so its round trips are on the path of each command a client
waits for. channels_redis 4 spends four on a ``send`` (trim, count, add, expire) and four on a
``group_send`` (trim and read the group, trim the members' queues, add); this layer does the
same work, with the same keys, messages and capacity rule, in one Lua script per ``send`` and
in two trips per ``group_send`` (read the group; one script for its members). Its messages are
read by the unchanged receive path, so processes on either layer interoperate.
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


class RedisLayer(RedisChannelLayer):
    """``channels_redis.core.RedisChannelLayer`` with ``send``, ``group_send`` and ``group_add``
    in fewer round trips (see the module's docstring)."""

    async def _add(
        self, connection: Any, keys: list[str], messages: list[bytes], capacities: list[int]
    ) -> int:
        """Add each message to its queue (unless full, as channels_redis judges it): how many were not."""
        args = [*messages, *capacities, time.time(), int(self.expiry)]
        try:
            return int(await connection.evalsha(_ADD_SHA, len(keys), *keys, *args))
        except NoScriptError:  # a Redis that has not seen it yet (or restarted): load it once
            await connection.script_load(_ADD)
            return int(await connection.evalsha(_ADD_SHA, len(keys), *keys, *args))

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
