"""Searching traces by their spans' attributes: ``attr=key=value`` (repeatable) keeps the traces
that have a span whose attribute ``key`` equals ``value``, for each one given.

Attribute values keep their JSON types (:mod:`runtime.services.otlp`), and a query string does
not: ``process.exit_code=1`` matches the number 1 or the text "1", ``flag=true`` the boolean or
the text. On Postgres each term is a JSONB containment (``attributes @> {"key": value}``), which
the GIN index on span attributes answers (migration 0022); elsewhere (SQLite) it reads the key."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from django.db import connection
from django.db.models import Q, QuerySet
from django.db.models.fields.json import KeyTransform

from ..errors import InvalidValue
from ..models import Team, TraceSpan

MAX_TERMS = 8
MAX_KEY = 256
MAX_VALUE = 1024
INT_RE = re.compile(r"-?\d{1,18}")


def attr_terms(raw: Sequence[str]) -> list[tuple[str, list[Any]]]:
    """``key=value`` strings as (key, the values it may be stored as); :class:`InvalidValue`
    (a 422) says what is wrong with a bad one."""
    if len(raw) > MAX_TERMS:
        raise InvalidValue(f"at most {MAX_TERMS} attr filters, got {len(raw)}")
    terms = []
    for item in raw:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise InvalidValue(f"attr must be key=value (gen_ai.tool.name=bash), got {item[:80]!r}")
        if len(key) > MAX_KEY:
            raise InvalidValue(f"an attr key is at most {MAX_KEY} characters")
        if len(value) > MAX_VALUE:
            raise InvalidValue(f"an attr value is at most {MAX_VALUE} characters")
        if "\x00" in item:
            raise InvalidValue("attr must not contain NUL characters")
        terms.append((key, _typed(value)))
    return terms


def _typed(value: str) -> list[Any]:
    out: list[Any] = [value]
    if value in ("true", "false"):
        out.append(value == "true")
    elif INT_RE.fullmatch(value):
        out.append(int(value))
    else:
        try:
            number = float(value)
        except ValueError:
            return out
        if math.isfinite(number) and any(c.isdigit() for c in value):
            out.append(number)
    return out


def _span_matches(key: str, values: list[Any]) -> Q:
    q = Q()
    for v in values:
        q |= Q(attributes__contains={key: v})
    return q


def traces_with_attrs(*, team: Team, terms: list[tuple[str, list[Any]]]) -> list[QuerySet[TraceSpan, Any]]:
    """For each term, the ``trace_id`` of the team's spans that match it (a subquery each)."""
    out = []
    for key, values in terms:
        spans = TraceSpan.objects.filter(team=team)
        if connection.vendor == "postgresql":
            spans = spans.filter(_span_matches(key, values))
        else:  # SQLite has no JSON containment: compare the key's value
            spans = spans.alias(attr_value=KeyTransform(key, "attributes")).filter(attr_value__in=values)
        out.append(spans.values("trace_id"))
    return out
