"""A service underneath away (the database restarting, Redis out of reach) is a 503 that says
which, with Retry-After: never a bare 500 (dashboard.unavailable, Django's handler500). The
faults suite (tests/reliability/test_faults.py) does it for real with Postgres restarted."""

from __future__ import annotations

import pytest
from django.db import OperationalError
from django.test import Client
from redis.exceptions import ConnectionError as RedisConnectionError


@pytest.mark.parametrize(
    ("error", "named"),
    [(OperationalError("connection refused"), "the database"), (RedisConnectionError(), "Redis")],
)
def test_a_service_away_is_a_503_naming_it(db, monkeypatch, error, named):
    def away(*_args, **_kw):
        raise error

    monkeypatch.setattr("dashboard.api.auth.token_authenticate", away)
    client = Client(raise_request_exception=False)
    r = client.get("/api/v1/sandboxes", HTTP_AUTHORIZATION="Bearer hgr_x")
    assert r.status_code == 503
    assert named in r.json()["detail"] and "connection refused" not in r.json()["detail"]
    assert r["Retry-After"] == "5"
    page = client.get("/api/v1/no-such-path-but-json", HTTP_AUTHORIZATION="Bearer hgr_x")
    assert page.status_code == 404


def test_another_error_is_still_a_500_without_its_details(db, monkeypatch):
    def broken(*_args, **_kw):
        raise RuntimeError("secret-detail")

    monkeypatch.setattr("dashboard.api.auth.token_authenticate", broken)
    r = Client(raise_request_exception=False).get("/api/v1/sandboxes", HTTP_AUTHORIZATION="Bearer hgr_x")
    assert r.status_code == 500
    assert "secret-detail" not in r.content.decode() and "log" in r.json()["detail"]
