"""A token and the sandbox it names, checked in one query: what every call to the in-sandbox API
(E2B's envd) asks before anything else.

:func:`runtime.services.auth.token_current` then :func:`runtime.services.sandboxes.sandbox_get`
answer the same in two queries (the token with its user, team and the user's role in the team;
then the sandbox of that team, within a harness token's reach, with its node). This joins them:
the token's row, its user's, its team's, the membership's role as a subquery, and the sandbox
and its node as a left join on the same conditions, so a token that may not reach the sandbox
still comes back (its caller says "not found", not "revoked"). Rows become model instances as
the ORM would make them (each column through the backend's and the field's converters)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import Model
from django.utils import timezone

from ..models import ApiToken, Harness, Membership, Node, Sandbox, Team
from .auth import token_alive

Converter = Callable[[Any, Any, Any], Any]


class _Table:
    """One model's columns in the query (under ``alias``) and how to make an instance of them."""

    def __init__(self, model: type[Model], alias: str) -> None:
        self.model, self.alias = model, alias
        fields = list(model._meta.concrete_fields)
        self.names = [f.attname for f in fields]
        self.pk = self.names.index(model._meta.pk.attname)
        q = connection.ops.quote_name
        self.columns = [f"{alias}.{q(str(f.column))}" for f in fields]
        # As the ORM's compiler reads a column: the backend's converters, then the field's.
        self.converters: list[tuple[Any, list[Converter]]] = []
        for f in fields:
            col = f.get_col(alias)
            self.converters.append(
                (col, [*connection.ops.get_db_converters(col), *col.get_db_converters(connection)])
            )

    def make(self, values: Sequence[Any]) -> Any:
        converted = []
        for value, (col, converters) in zip(values, self.converters, strict=True):
            for convert in converters:
                value = convert(value, col, connection)
            converted.append(value)
        return self.model.from_db(connection.alias, self.names, converted)


def _sql(tables: dict[str, _Table]) -> str:
    q = connection.ops.quote_name

    def t(model: type[Model]) -> str:
        return q(model._meta.db_table)

    select = ", ".join(c for table in tables.values() for c in table.columns)
    return (
        f"SELECT {select}, "
        f"(SELECT m.{q('role')} FROM {t(Membership)} m WHERE m.{q('user_id')} = tk.{q('user_id')} "
        f"AND m.{q('team_id')} = tk.{q('team_id')} LIMIT 1) "
        f"FROM {t(ApiToken)} tk "
        f"INNER JOIN {t(get_user_model())} us ON us.{q('id')} = tk.{q('user_id')} "
        f"INNER JOIN {t(Team)} tm ON tm.{q('id')} = tk.{q('team_id')} "
        f"LEFT OUTER JOIN {t(Sandbox)} sb ON sb.{q('id')} = %s AND sb.{q('team_id')} = tk.{q('team_id')} "
        # A harness's own token reaches its harness's sandbox and those it created (sandbox_reach).
        f"AND (tk.{q('harness_id')} IS NULL OR sb.{q('created_by_token_id')} = tk.{q('id')} "
        f"OR sb.{q('id')} IN (SELECT h.{q('sandbox_id')} FROM {t(Harness)} h WHERE h.{q('id')} = tk.{q('harness_id')})) "
        f"LEFT OUTER JOIN {t(Node)} nd ON nd.{q('id')} = sb.{q('node_id')} "
        f"WHERE tk.{q('id')} = %s"
    )  # fmt: skip


_QUERY: dict[str, tuple[dict[str, _Table], str]] = {}  # by database vendor: built once


def _query() -> tuple[dict[str, _Table], str]:
    if connection.vendor not in _QUERY:
        tables = {
            "token": _Table(ApiToken, "tk"), "user": _Table(get_user_model(), "us"), "team": _Table(Team, "tm"),
            "sandbox": _Table(Sandbox, "sb"), "node": _Table(Node, "nd"),
        }  # fmt: skip
        _QUERY[connection.vendor] = tables, _sql(tables)
    return _QUERY[connection.vendor]


def token_and_sandbox(*, token_id: int, sandbox_id: str) -> tuple[ApiToken | None, Sandbox | None]:
    """The token ``token_id`` as :func:`~runtime.services.auth.token_current` gives it (None
    once it is revoked or expired, or its user is deactivated or out of its team) and, for a
    live token, the sandbox ``sandbox_id`` as ``sandbox_get`` gives it to that token (None: not
    of its team, beyond a harness token's reach, or no such sandbox), in one query."""
    tables, sql = _query()
    with connection.cursor() as cursor:
        cursor.execute(sql, [sandbox_id, token_id])
        row = cursor.fetchone()
    if row is None:
        return None, None
    at, parts = 0, {}
    for name, table in tables.items():
        parts[name] = row[at : at + len(table.names)]
        at += len(table.names)
    token = tables["token"].make(parts["token"])
    token.user = tables["user"].make(parts["user"])
    token.team = tables["team"].make(parts["team"])
    token.member_role = row[at]
    if token_alive(token, timezone.now()) is None:
        return None, None
    if parts["sandbox"][tables["sandbox"].pk] is None:  # no sandbox joined
        return token, None
    sandbox = tables["sandbox"].make(parts["sandbox"])
    sandbox.node = tables["node"].make(parts["node"]) if sandbox.node_id is not None else None
    return token, sandbox
