"""The SDK and the API cannot drift apart silently: every field of the SDK's models exists in
the schema component it reads, and every call the SDK makes is an operation of the server's
OpenAPI schema (the one the test server serves)."""

from __future__ import annotations

import dataclasses
import inspect
import re

import httpx
import pytest

from hangar_sdk import _api as api
from hangar_sdk._models import SCHEMA
from hangar_sdk._transport import Config, api_base, retry_delay


@pytest.fixture(scope="module")
def openapi(server) -> dict:
    r = httpx.get(f"{server}/api/v1/openapi.json", timeout=30)
    assert r.status_code == 200
    return r.json()


@pytest.mark.parametrize("model", list(SCHEMA), ids=lambda m: m.__name__)
def test_each_model_field_is_a_field_of_its_schema_component(openapi, model):
    component = openapi["components"]["schemas"][SCHEMA[model]]
    missing = [f.name for f in dataclasses.fields(model) if f.name not in component["properties"]]
    assert not missing, f"{model.__name__} has fields {SCHEMA[model]} lacks: {missing}"
    # What the server always sends, the SDK needs no default for.
    required = set(component.get("required", []))
    for f in dataclasses.fields(model):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            assert f.name in required, f"{model.__name__}.{f.name} has no default but the server may omit it"


def _calls() -> list[api.Call]:
    sb, p, h, r = "sbx", 1, "hx", "rx"
    return [
        api.sandbox_create(image="busybox", timeout_s=1, memory_mb=1, cpu=1, env={}, network="none", extra={}),
        api.sandbox_get(sb), api.sandbox_list(status=None, limit=1, offset=0), api.sandbox_delete(sb),
        api.sandbox_stop(sb), api.sandbox_pause(sb, mode=None), api.sandbox_resume(sb),
        api.sandbox_keepalive(sb, timeout_s=1), api.sandbox_expose(sb, port=80, public=False),
        api.sandbox_set_network(sb, network="all"), api.sandbox_stats(sb),
        api.exec_call(sb, cmd="true", cwd=None, env=None, stdin=None, timeout_s=None),
        api.process_get(sb, p), api.process_output(sb, p, follow=True),
        api.process_stdin(sb, p, data="x", close=False), api.process_signal(sb, p, signal="KILL"),
        api.terminal_open(sb, cmd=None, cwd=None, env=None, rows=24, cols=80), api.terminal_delete(sb, "tx"),
        api.file_write(sb, "/x", b""), api.file_read(sb, "/x"), api.file_list(sb, "/"),
        api.harness_create(name="n", agent="custom", repo=None, extra={}), api.harness_get(h),
        api.harness_delete(h, delete_volume=False), api.harness_pause(h), api.harness_resume(h),
        api.run_create(h, prompt="x", timeout_s=None), api.run_get(r), api.run_logs(r), api.run_cancel(r),
        api.harness_list(), api.harness_runs(h), api.harness_logs(h), api.sandbox_events(sb),
        api.process_list(sb), api.volume_create(name="v", size_mb=64, node=None), api.volume_list(),
        api.volume_get("v"), api.volume_delete("v"), api.token_current(),
    ]  # fmt: skip


def test_every_request_builder_of_the_sdk_is_checked_against_the_schema():
    builders = {
        name for name, fn in inspect.getmembers(api, inspect.isfunction)
        if fn.__module__ == api.__name__ and not name.startswith("_") and fn.__annotations__.get("return") == "Call"
    }  # fmt: skip
    checked = set(re.findall(r"\bapi\.(\w+)\(", inspect.getsource(_calls)))
    assert builders - checked == set(), "request builders the schema test does not call"


def test_every_call_of_the_sdk_is_an_operation_of_the_api(openapi):
    operations = []
    for path, ops in openapi["paths"].items():
        pattern = re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", path.removeprefix("/api/v1")) + "$")
        operations += [(method.upper(), pattern, op) for method, op in ops.items()]
    for call in _calls():
        found = [
            op for method, pattern, op in operations if method == call.method and pattern.match(call.path)
        ]
        assert found, f"{call.method} {call.path} is not in the API's schema"
        params = {p["name"] for p in found[0].get("parameters", []) if p["in"] == "query"}
        assert set(call.params or {}) <= params, (call, params)
        body = found[0].get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        if isinstance(call.json, dict) and body and "$ref" in body:
            fields = openapi["components"]["schemas"][body["$ref"].split("/")[-1]]["properties"]
            assert set(call.json) <= set(fields), (call, sorted(fields))


def test_the_url_may_name_the_api_or_the_server_and_a_harness_is_found_by_its_own_variables(monkeypatch):
    assert api_base("http://h:8000") == api_base("http://h:8000/") == "http://h:8000/api/v1"
    assert api_base("http://hangar.internal/api/v1/") == "http://hangar.internal/api/v1"
    for name in ("HANGAR_URL", "HANGAR_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HANGAR_API_URL", "http://hangar.internal/api/v1")
    monkeypatch.setenv("HANGAR_API_TOKEN", "hgr_harness")
    assert Config.resolve() == Config("http://hangar.internal/api/v1", "hgr_harness")
    monkeypatch.setenv("HANGAR_URL", "http://mine:8000")
    monkeypatch.setenv("HANGAR_TOKEN", "hgr_mine")
    assert Config.resolve() == Config("http://mine:8000/api/v1", "hgr_mine")
    assert Config.resolve(url="http://arg", token="t") == Config("http://arg/api/v1", "t")


def test_only_calls_that_are_safe_to_repeat_are_retried():
    get, execute = api.sandbox_get("sb"), api.exec_call("sb", cmd="x", cwd=None, env=None, stdin=None,
                                                         timeout_s=None)  # fmt: skip
    assert retry_delay(get, 1, status=503) is not None and retry_delay(execute, 1, status=503) is None
    assert retry_delay(get, 1, exc=httpx.ReadError("reset")) is not None
    assert retry_delay(execute, 1, exc=httpx.ReadError("reset")) is None
    # Nothing reached the server, or it refused with a Retry-After before doing anything.
    assert retry_delay(execute, 1, exc=httpx.ConnectError("refused")) is not None
    assert retry_delay(execute, 1, status=429, retry_after=2) == 2
    assert retry_delay(execute, 1, status=429) is None  # a quota: no retry
    assert retry_delay(get, 4, status=503) is None  # bounded
    assert retry_delay(get, 1, status=429, retry_after=3600) == 30.0
    stream = api.file_write("sb", "/x", iter([b"x"]))
    assert retry_delay(stream, 1, exc=httpx.ConnectError("refused")) is None
