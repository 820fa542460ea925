"""channels_redis's layer with fewer round trips to Redis per message.

Every chunk of a live process's output, every keystroke and every start goes through the
layer (:mod:`runtime.streams`), so its round trips are on the path of each command a client
waits for. channels_redis 4 spends four on a ``send`` (trim, count, add, expire) and four on a
``group_send`` (trim and read the group, trim the members' queues, add); this layer does the
same work, with the same keys, messages and capacity rule, in one Lua script per ``send`` and
in two trips per ``group_send`` (read the group; one script for its members). A receive
takes a message already waiting in one trip (channels_redis spends three: put back what an
interrupted receive left in the channel's backup queue, pop, back it up; this script does the
three at once) and waits for one as channels_redis does. Processes on either layer interoperate.
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


class RedisLayer(RedisChannelLayer):
    """``channels_redis.core.RedisChannelLayer`` with ``send``, ``group_send`` and ``group_add``
    in fewer round trips (see the module's docstring)."""

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
