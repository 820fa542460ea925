"""Live traces: once spans are stored, the pages watching their traces are told which rows are
new, so a trace still being written grows on the page (:mod:`dashboard.websockets.trace_live`).

A plain Redis PUBLISH per trace after the transaction commits (as :mod:`runtime.notify` does
for sandboxes), on ``hangar:trace:<team>:<trace id>`` (``hangar:dbN:…`` in Redis database N), carrying the range of the new rows' ids,
``"<first>-<last>"``: the page's socket reads exactly those, whatever order concurrent batches
commit in. Nobody listening costs a publish; a lost message costs the page that batch until
its next one or a reload, never the store."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import redis
from django.db import transaction

from ..notify import pubsub_prefix, redis_client

log = logging.getLogger(__name__)


def trace_channel(team_id: int, trace_id: str) -> str:
    return f"{pubsub_prefix()}trace:{team_id}:{trace_id}"


def spans_stored(*, team_id: int, spans: Iterable[tuple[str, int | None]]) -> None:
    """Called by the store with the spans it just inserted, as (trace id, row id): their traces'
    live pages hear of them once the current transaction commits."""
    ranges: dict[str, tuple[int, int]] = {}
    for trace_id, pk in spans:
        if pk is None:  # a database that does not return ids: the page reads what is new
            ranges[trace_id] = (0, 0)
            continue
        lo, hi = ranges.get(trace_id, (pk, pk))
        if lo:
            ranges[trace_id] = (min(lo, pk), max(hi, pk))
    if ranges:
        transaction.on_commit(lambda: _publish(team_id, ranges))


def _publish(team_id: int, ranges: dict[str, tuple[int, int]]) -> None:
    try:
        pipe = redis_client().pipeline(transaction=False)
        for trace_id, (lo, hi) in ranges.items():
            pipe.publish(trace_channel(team_id, trace_id), f"{lo}-{hi}" if lo else "new")
        pipe.execute()
    except redis.RedisError:
        log.warning("could not announce new spans of team %s", team_id, exc_info=True)
