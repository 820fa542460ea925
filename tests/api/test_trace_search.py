"""Searching traces by span attribute (``GET /api/v1/traces?attr=key=value``): typed values
matched as numbers, booleans or text, several terms all required, another team's spans never
matching, bad terms a 422 that says why (never a 500), and the GIN index answering the search."""

from __future__ import annotations

import json
import secrets as pysecrets
import time

import httpx
import pytest
from django.db import connection, transaction

from runtime.models import TraceSpan

from .test_traces import _get, _post


def _any(v):
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    return {"stringValue": v}


def _send(server: str, token: str, name: str, attrs: dict) -> str:
    trace_id = pysecrets.token_hex(16)
    now = time.time_ns()
    span = {"traceId": trace_id, "spanId": pysecrets.token_hex(8), "name": name, "kind": 1,
            "startTimeUnixNano": str(now), "endTimeUnixNano": str(now + 1_000_000),
            "attributes": [{"key": k, "value": _any(v)} for k, v in attrs.items()]}  # fmt: skip
    body = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "s"}}]},
                               "scopeSpans": [{"spans": [span]}]}]}  # fmt: skip
    r = _post(server, token, "/v1/traces", json.dumps(body).encode(), "application/json")
    assert r.status_code == 200, r.text
    return trace_id


def _ids(server: str, token: str, *attrs: str) -> set[str]:
    r = httpx.get(f"{server}/api/v1/traces", params=[("attr", a) for a in attrs],
                  headers={"Authorization": f"Bearer {token}"}, timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    return {t["trace_id"] for t in r.json()}


def test_traces_are_found_by_span_attribute_typed_and_combined(server, team_token, other_team_token):
    bash = _send(server, team_token, "execute_tool", {"gen_ai.tool.name": "bash", "process.exit_code": 1,
                                                      "retried": True, "note": "a=b"})  # fmt: skip
    edit = _send(server, team_token, "execute_tool", {"gen_ai.tool.name": "edit", "process.exit_code": 0})
    text_one = _send(server, team_token, "x", {"process.exit_code": "1"})
    theirs = _send(server, other_team_token, "execute_tool", {"gen_ai.tool.name": "bash"})

    assert _ids(server, team_token, "gen_ai.tool.name=bash") == {bash}  # never another team's
    assert _ids(server, other_team_token, "gen_ai.tool.name=bash") == {theirs}
    assert _ids(server, team_token, "process.exit_code=1") == {bash, text_one}  # the number or the text
    assert _ids(server, team_token, "process.exit_code=0") == {edit}
    assert _ids(server, team_token, "retried=true") == {bash}
    assert _ids(server, team_token, "note=a=b") == {bash}  # split at the first "="
    assert _ids(server, team_token, "gen_ai.tool.name=bash", "process.exit_code=0") == set()  # all of them
    assert _ids(server, team_token, "gen_ai.tool.name=edit", "process.exit_code=0") == {edit}
    assert _ids(server, team_token, "gen_ai.tool.name=nothing") == set()
    assert _ids(server, team_token, "gen_ai.tool.name=") == set()  # an empty value is a value


@pytest.mark.parametrize(
    "params, says",
    [
        ([("attr", "no-equals-sign")], "key=value"),
        ([("attr", "=value")], "key=value"),
        ([("attr", "k=" + "v" * 2000)], "at most 1024"),
        ([("attr", "k" * 300 + "=v")], "at most 256"),
        ([("attr", f"k{i}=v") for i in range(9)], ""),
        ([("attr", "k=\x00")], "NUL"),
    ],
)
def test_bad_attribute_terms_are_422s_that_say_why(server, team_token, params, says):
    r = _get_raw(server, team_token, params)
    assert r.status_code == 422, (r.status_code, r.text)
    assert says in r.text


def _get_raw(server: str, token: str, params) -> httpx.Response:
    return httpx.get(f"{server}/api/v1/traces", params=params, headers={"Authorization": f"Bearer {token}"},
                     timeout=30)  # fmt: skip


def test_the_attribute_search_is_answered_by_the_gin_index(server, team_token):
    _send(server, team_token, "execute_tool", {"gen_ai.tool.name": "bash"})
    assert _get(server, team_token, "/traces", attr="gen_ai.tool.name=bash").status_code == 200
    qs = TraceSpan.objects.filter(attributes__contains={"gen_ai.tool.name": "bash"}).values("trace_id")
    sql, params = qs.query.sql_with_params()
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SET LOCAL enable_seqscan = off")  # a tiny table: otherwise a scan is cheaper
        cur.execute(f"EXPLAIN {sql}", params)
        plan = "\n".join(row[0] for row in cur.fetchall())
    assert "span_attrs_gin" in plan, plan
