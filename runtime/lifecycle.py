"""The sandbox state machine. Every transition is a conditional update on the current status,
so a retried or duplicated task that finds the row already moved does nothing."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from django.db import transaction
from django.utils import timezone

from . import events, notify
from .models import Sandbox, SandboxEvent

S = Sandbox.Status

TRANSITIONS: dict[str, set[str]] = {
    S.PENDING: {S.STARTING, S.STOPPING, S.FAILED},
    S.STARTING: {S.RUNNING, S.STOPPING, S.FAILED, S.PENDING},  # pending: its worker died mid-start
    S.RUNNING: {S.STOPPING, S.FAILED, S.PAUSING},
    S.PAUSING: {S.PAUSED, S.STOPPING, S.FAILED},
    S.PAUSED: {S.RESUMING, S.STOPPING},
    S.RESUMING: {S.RUNNING, S.STOPPING, S.FAILED, S.PAUSED},
    S.STOPPING: {S.STOPPED, S.DELETED, S.FAILED},
    S.STOPPED: {S.STOPPING, S.DELETED},
    S.FAILED: {S.STOPPING, S.DELETED},
    S.DELETED: set(),
}


def sources_of(target: str) -> list[str]:
    return [src for src, targets in TRANSITIONS.items() if target in targets]


def transition(
    sandbox_id: str,
    *,
    to: str,
    frm: list[str] | tuple[str, ...] | None = None,
    reason: str = "",
    fields: dict[str, Any] | None = None,
) -> bool:
    """Move the sandbox to ``to`` if its status is one of ``frm`` (default: every legal source).

    Returns False, changing nothing, when another process got there first.
    """
    return transition_row(sandbox_id, to=to, frm=frm, reason=reason, fields=fields) is not None


def transition_row(
    sandbox_id: str,
    *,
    to: str,
    frm: list[str] | tuple[str, ...] | None = None,
    reason: str = "",
    fields: dict[str, Any] | None = None,
) -> Sandbox | None:
    """:func:`transition`, returning the row as it now is (None when it did not move): for a
    caller that goes on with the sandbox, one read fewer."""
    allowed = list(frm) if frm is not None else sources_of(to)
    illegal = [s for s in allowed if to not in TRANSITIONS[s]]
    if illegal:
        raise ValueError(f"illegal transition {illegal} -> {to}")
    with transaction.atomic():
        row = Sandbox.objects.select_for_update().filter(id=sandbox_id, status__in=allowed).first()
        if row is None:
            return None
        now = timezone.now()
        # Usage is counted up to each change into or out of holding CPU and memory (a receiver).
        updates: dict[str, Any] = {"status": to, "updated_at": now}
        for metered in events.status_changing.send(row, to, now):
            updates.update(metered)
        updates.update(fields or {})
        if reason or to in (S.FAILED, S.RUNNING):
            updates["status_reason"] = reason
        Sandbox.objects.filter(id=sandbox_id).update(**updates)
        from_status = row.status
        for name, value in updates.items():
            setattr(row, name, value)
        SandboxEvent.objects.create(
            sandbox_id=sandbox_id, kind="status", status_from=from_status, status_to=to, message=reason
        )
        team_id = row.team_id
        transaction.on_commit(lambda: notify.sandbox_changed(sandbox_id, to, team_id))
    events.status_changed.send(sandbox_id, to)  # e.g. the preview proxy's copy of the row
    return row


def record_event(sandbox_id: str, kind: str, message: str = "", **data: Any) -> None:
    SandboxEvent.objects.create(sandbox_id=sandbox_id, kind=kind, message=message, data=data)
    transaction.on_commit(lambda: notify.sandbox_changed(sandbox_id, "event"))


def record_events(events: Iterable[tuple[str, str, str, dict[str, Any]]]) -> None:
    """Many sandboxes' events in one statement: ``(sandbox_id, kind, message, data)`` each."""
    rows = SandboxEvent.objects.bulk_create(
        SandboxEvent(sandbox_id=sid, kind=kind, message=message, data=data)
        for sid, kind, message, data in events
    )
    for sandbox_id in dict.fromkeys(row.sandbox_id for row in rows):
        transaction.on_commit(functools.partial(notify.sandbox_changed, sandbox_id, "event"))
