"""How many blocking execs a team may have in flight on this server process.

A blocking exec holds its output (up to ``HANGAR_EXEC_MAX_OUTPUT_BYTES`` of each stream) from
the moment it runs until its answer has been sent, however slowly the client reads: so one
team's calls must not add up without bound. The count is per process because the memory is:
each server replica bounds what it holds.
"""

from __future__ import annotations

import threading
from collections import Counter

from django.conf import settings

from ..errors import TooManyRequests
from ..models import Team

_lock = threading.Lock()
_in_flight: Counter[int] = Counter()
RETRY_AFTER_S = 2


class ExecSlot:
    """One of a team's blocking exec slots, held until :meth:`release` (idempotent)."""

    def __init__(self, team_id: int) -> None:
        self.team_id = team_id
        self._held = True

    def release(self) -> None:
        with _lock:
            if self._held:
                self._held = False
                _in_flight[self.team_id] -= 1
                if _in_flight[self.team_id] <= 0:
                    del _in_flight[self.team_id]

    def __enter__(self) -> ExecSlot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def blocking_exec_slot(*, team: Team) -> ExecSlot:
    """A slot for one blocking exec of ``team``, or :class:`TooManyRequests` (429) when it has
    ``HANGAR_EXEC_BLOCKING_PER_TEAM`` in flight already."""
    limit = settings.HANGAR_EXEC_BLOCKING_PER_TEAM
    with _lock:
        if _in_flight[team.id] >= limit:
            raise TooManyRequests(
                f"team {team.name} has {limit} blocking execs in flight on this server, its limit "
                f"(HANGAR_EXEC_BLOCKING_PER_TEAM): wait for one to end, or use stream or background",
                retry_after=RETRY_AFTER_S, limit=limit, in_flight=_in_flight[team.id],
            )  # fmt: skip
        _in_flight[team.id] += 1
    return ExecSlot(team.id)
