"""The audit log: who changed what, when, from which token or session, and how it ended.

Services call :func:`record` where a change happens (in the change's transaction: a change
that rolls back leaves no record). Who is acting comes from the request: the API sets it from
the token (:class:`dashboard.api.auth.TokenAuth`), the dashboard from the session
(:class:`dashboard.middleware.AuditActorMiddleware`), the CLI as itself; with none set, the
actor is Hangar (``system``: the reaper, idle rules, budgets). Refused attempts to change
something through the API are recorded too, with what refused them. Rows are never updated
or deleted: the database refuses it (a trigger, see migration 0010). Nothing secret is ever
put in a record: secret values, tokens and passwords stay out of ``message`` and ``data``.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from django.db.models import Q, QuerySet

from ..errors import InvalidValue
from ..models import AuditEvent, Team


@dataclass(frozen=True)
class Actor:
    via: str  # api | dashboard | cli | system
    user_id: int | None = None
    username: str = ""
    token: str = ""  # the API token's prefix (never the token)
    session: str = ""  # a hash of the session key (never the key)
    ip: str = ""


SYSTEM = Actor(via="system")
_actor: ContextVar[Actor | None] = ContextVar("hangar_audit_actor", default=None)


def current() -> Actor:
    return _actor.get() or SYSTEM


def set_actor(actor: Actor | None) -> Any:
    return _actor.set(actor)


def reset_actor(token: Any) -> None:
    try:
        _actor.reset(token)
    except ValueError:  # set in another context (a copy): that copy ends with its request
        _actor.set(None)


@contextlib.contextmanager
def acting(actor: Actor) -> Iterator[None]:
    reset = _actor.set(actor)
    try:
        yield
    finally:
        _actor.reset(reset)


def for_token(token: Any, ip: str = "") -> Actor:
    return Actor(
        via="api", user_id=token.user_id, username=token.user.get_username(), token=token.prefix, ip=ip
    )


def for_session(user: Any, session_key: str | None, ip: str = "") -> Actor:
    digest = hashlib.sha256(session_key.encode()).hexdigest()[:12] if session_key else ""
    return Actor(via="dashboard", user_id=user.pk, username=user.get_username(), session=digest, ip=ip)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def record(
    action: str,
    *,
    team: Team | None = None,
    target: str = "",
    outcome: str = "ok",
    message: str = "",
    system: bool = False,
    actor: Actor | None = None,
    **data: Any,
) -> AuditEvent:
    """Write one audit event (``action``: ``sandbox.create``, ``member.role``…)."""
    who = SYSTEM if system else (actor or current())
    return AuditEvent.objects.create(
        team_id_ref=team.id if team is not None else None,
        team_name=team.name if team is not None else "",
        actor_id=who.user_id, actor=who.username, via=who.via, token=who.token, session=who.session,
        ip=who.ip[:64], action=action[:64], target=target[:200], outcome=outcome, message=message,
        data=_jsonable(data),
    )  # fmt: skip


def with_ip(actor: Actor, ip: str) -> Actor:
    return replace(actor, ip=ip)


# -- reading ----------------------------------------------------------------------------------

FILTERS = ("action", "actor", "outcome", "target", "via")
COLUMNS = ("id", "created_at", "team_name", "actor", "via", "token", "session", "ip", "action", "target",
           "outcome", "message", "data")  # fmt: skip


def events(
    *,
    team: Team | None,
    action: str = "",
    actor: str = "",
    outcome: str = "",
    target: str = "",
    via: str = "",
    since: datetime | None = None,
    until: datetime | None = None,
    before_id: int | None = None,
) -> QuerySet[AuditEvent]:
    """Newest first. ``team`` None: every team's and the site's (site administrators).
    ``action`` matches a prefix (``sandbox.`` for every sandbox change)."""
    # Refused here, not by the database when the query runs: an export's query runs once its
    # answer has started, too late for an error answer.
    for name, value in (("action", action), ("actor", actor), ("target", target), ("via", via)):
        if "\x00" in value:
            raise InvalidValue(f"{name} cannot hold a NUL character")
    qs = AuditEvent.objects.all()
    if team is not None:
        qs = qs.filter(team_id_ref=team.id)
    if action:
        qs = qs.filter(action__startswith=action)
    if actor:
        qs = qs.filter(actor=actor)
    if outcome:
        if outcome not in ("ok", "refused", "error"):
            raise InvalidValue(f"outcome is ok, refused or error, got {outcome!r}")
        qs = qs.filter(outcome=outcome)
    if target:
        qs = qs.filter(Q(target__icontains=target))
    if via:
        qs = qs.filter(via=via)
    if since:
        qs = qs.filter(created_at__gte=since)
    if until:
        qs = qs.filter(created_at__lt=until)
    if before_id:
        qs = qs.filter(id__lt=before_id)
    return qs.order_by("-id")


def csv_cell(value: Any) -> Any:
    """A cell a spreadsheet will not run as a formula (names come from users)."""
    if isinstance(value, dict | list):
        import json

        value = json.dumps(value, sort_keys=True)
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


CSV_PAGE = 1000  # events a page of the export reads at once


def csv_page(rows: QuerySet[AuditEvent], *, before_id: int | None = None) -> tuple[str, int | None]:
    """One page of the export: CSV text for up to ``CSV_PAGE`` events older than
    ``before_id`` (the header first when None), and the id to go on from (None: the end).
    Each page is a query of its own (keyset, by id), so an export of a long log holds one page
    in memory at a time and no cursor between pages."""
    page = list((rows.filter(id__lt=before_id) if before_id else rows)[:CSV_PAGE])
    buf = io.StringIO()
    writer = csv.writer(buf)
    if before_id is None:
        writer.writerow(COLUMNS)
    for e in page:
        writer.writerow([csv_cell(v) for v in (e.id, e.created_at.isoformat(), e.team_name, e.actor, e.via, e.token,
                                               e.session, e.ip, e.action, e.target, e.outcome, e.message, e.data)])  # fmt: skip
    return buf.getvalue(), (page[-1].id if len(page) == CSV_PAGE else None)
