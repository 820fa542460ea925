"""How much an API request may carry: JSON bodies (HANGAR_JSON_MAX_BYTES), a sandbox's
metadata (HANGAR_METADATA_MAX_BYTES), the data endpoints' own limits, and malformed text. A real
daphne server."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.support import requires_runsc

MIB = 1024 * 1024


@pytest.fixture
def client(server, team_token) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=f"{server}/api/v1", headers={"Authorization": f"Bearer {team_token}"}, timeout=30
    ) as c:
        yield c


def test_json_body_over_the_limit_is_413_naming_the_limit(client):
    body = json.dumps({"image": "busybox", "metadata": {"pad": "x" * (2 * MIB)}}).encode()
    r = client.post("/sandboxes", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["limit"] == MIB and "HANGAR_JSON_MAX_BYTES" in r.json()["detail"]


def test_chunked_json_body_is_413_once_it_grows_past_the_limit(client):
    piece = b"x" * (64 * 1024)

    def chunks() -> Iterator[bytes]:
        yield b'{"image": "busybox", "metadata": {"pad": "'
        for _ in range(40):  # 2.5 MiB, sent without a Content-Length
            yield piece
        yield b'"}}'

    r = client.post("/sandboxes", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert r.status_code == 413 and "HANGAR_JSON_MAX_BYTES" in r.json()["detail"]


def test_the_limit_is_per_route(settings):
    from dashboard.limits import body_limit

    assert body_limit("POST", "/api/v1/sandboxes") == (MIB, "HANGAR_JSON_MAX_BYTES")
    assert body_limit("PUT", "/api/v1/sandboxes/sbx/files")[0] == settings.HANGAR_FILE_MAX_BYTES
    stdin = body_limit("POST", "/api/v1/sandboxes/sbx/processes/7/stdin")
    assert stdin[0] == 2 * settings.HANGAR_STDIN_PENDING_BYTES
    assert body_limit("POST", "/api/v1/sandboxes/sbx/exec") == stdin
    assert body_limit("PUT", "/api/v1/sandboxes/sbx/network")[0] == MIB


def test_a_body_under_the_limit_is_taken(client):
    r = client.post("/sandboxes", json={"image": "busybox", "metadata": {"pad": "x" * 1000}, "cpu": 10**6})
    assert r.status_code == 422 and "cpu" in r.json()["detail"]  # read and validated, not refused whole


def test_metadata_over_its_limit_is_422_naming_the_limit(client):
    r = client.post("/sandboxes", json={"image": "busybox", "metadata": {"blob": "x" * (65 * 1024)}})
    assert r.status_code == 422
    assert "HANGAR_METADATA_MAX_BYTES" in r.json()["detail"] and r.json()["limit"] == 64 * 1024


def test_query_parameters_that_are_not_utf8_are_422_not_replaced(client):
    r = client.get("/sandboxes/sbnosuch/files/list?path=/tmp/%ff%fe")
    assert r.status_code == 422
    assert r.json()["detail"].startswith("path: is not valid UTF-8")


def test_a_single_valued_query_parameter_given_twice_is_422_and_a_list_one_repeats(client):
    r = client.get("/traces/0123456789abcdef0123456789abcdef?offset=1&offset=7.0")
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith("offset: is given 2 times; give it once")
    r = client.get("/sandboxes?limit=5&limit=6")
    assert r.status_code == 422 and r.json()["detail"].startswith("limit: is given 2 times")
    # attr= is a list: each one another term.
    assert client.get("/traces?attr=a%3D1&attr=b%3D2").status_code == 200


def test_a_lone_surrogate_in_a_json_string_is_refused(client):
    body = b'{"image": "busybox", "env": {"A": "\\udc80"}}'
    r = client.post("/sandboxes", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400


@requires_runsc
def test_data_endpoints_are_not_held_to_the_json_limit(api):
    from tests.api.test_sandboxes_api import create

    sid = create(api)["id"]
    data = b"x" * (3 * MIB)
    r = api.put(f"/sandboxes/{sid}/files", params={"path": "/tmp/big"}, content=data)
    assert r.status_code == 200 and r.json()["size"] == len(data)
    r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": ["wc", "-c"], "stdin": "y" * (3 * MIB)})
    assert r.status_code == 200 and r.json()["stdout"].strip() == str(3 * MIB)


def test_json_values_must_have_their_schema_types(client):
    team_id = client.get("/teams").json()[0]["id"]
    for path, body in [
        (f"/teams/{team_id}/budget", {"amount": True}),
        (f"/teams/{team_id}/budget", {"amount": "10"}),
        (f"/teams/{team_id}/quotas", {"sandboxes": True}),
        ("/volumes", {"name": "v", "size_mb": "32"}),
    ]:
        r = client.put(path, json=body) if path.startswith("/teams") else client.post(path, json=body)
        assert r.status_code == 422, (path, body, r.text)
    assert client.put(f"/teams/{team_id}/budget", json={"amount": 10}).json()["amount"] == 10
