"""Traces: OTLP ingest from the real OpenTelemetry SDK and exporter (protobuf) and as OTLP/JSON,
read back through the API as a tree with typed attributes; logs joining a trace; the OTLP
status codes for bad input; another team's trace not found; secrets masked; large values cut
and kept; retention."""

from __future__ import annotations

import gzip
import json
import secrets as pysecrets
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from django.utils import timezone
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode

from runtime.models import Trace, TraceLog, TraceSpan
from tests.support import wait_until


def _provider(
    endpoint: str | None, token: str, monkeypatch, service: str = "agent-under-test"
) -> TracerProvider:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"Authorization=Bearer {token}")
    provider = TracerProvider(
        resource=Resource.create({"service.name": service, "hangar.sandbox.id": "sbtrace1"})
    )
    exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def _get(server: str, token: str, path: str, **params) -> httpx.Response:
    return httpx.get(
        f"{server}/api/v1{path}", params=params, headers={"Authorization": f"Bearer {token}"}, timeout=30
    )


def _wait_trace(server: str, token: str, trace_id: str, spans: int) -> dict:
    deadline = time.monotonic() + 5  # "readable through the API within 5 s"
    while True:
        r = _get(server, token, f"/traces/{trace_id}")
        if r.status_code == 200 and len(r.json()["spans"]) >= spans:
            return r.json()
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)


def test_the_real_sdk_exporter_sends_a_genai_trace_that_reads_back_as_a_tree(server, team_token, monkeypatch):
    # The endpoint from OTEL_EXPORTER_OTLP_ENDPOINT as the base URL: the SDK appends /v1/traces.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", server)
    provider = _provider(None, team_token, monkeypatch)
    tracer = provider.get_tracer("test.agent", "1.2.3")
    with tracer.start_as_current_span(
        "invoke_agent", attributes={"gen_ai.operation.name": "invoke_agent"}
    ) as root:
        with tracer.start_as_current_span("chat", attributes={
            "gen_ai.operation.name": "chat", "gen_ai.request.model": "claude-x",
            "gen_ai.usage.input_tokens": 1200, "gen_ai.usage.output_tokens": 80,
            "hangar.flag": True, "ratio": 0.25, "tags": ["a", "b"],
        }):  # fmt: skip
            pass
        with tracer.start_as_current_span("execute_tool", attributes={"gen_ai.tool.name": "bash"}) as tool:
            tool.add_event("tool.result", {"exit_code": 1})
            tool.set_status(Status(StatusCode.ERROR, "the command failed"))
    provider.force_flush()
    provider.shutdown()
    trace_id = format(root.get_span_context().trace_id, "032x")

    got = _wait_trace(server, team_token, trace_id, 3)
    by_name = {s["name"]: s for s in got["spans"]}
    assert set(by_name) == {"invoke_agent", "chat", "execute_tool"}
    assert by_name["invoke_agent"]["parent_span_id"] is None
    root_id = by_name["invoke_agent"]["span_id"]
    assert len(root_id) == 16 and root_id == root_id.lower()
    assert (
        by_name["chat"]["parent_span_id"] == root_id and by_name["execute_tool"]["parent_span_id"] == root_id
    )
    attrs = by_name["chat"]["attributes"]
    assert attrs["gen_ai.usage.input_tokens"] == 1200 and attrs["hangar.flag"] is True
    assert (
        attrs["ratio"] == 0.25 and attrs["tags"] == ["a", "b"] and attrs["gen_ai.request.model"] == "claude-x"
    )
    assert by_name["execute_tool"]["status"] == {"code": "error", "message": "the command failed"}
    assert by_name["execute_tool"]["events"][0]["name"] == "tool.result"
    assert by_name["chat"]["resource"]["service.name"] == "agent-under-test"
    assert by_name["chat"]["scope"] == {"name": "test.agent", "version": "1.2.3"}
    assert got["span_count"] == 3 and got["error_count"] == 1 and got["root_name"] == "invoke_agent"

    listed = _get(server, team_token, "/traces").json()
    row = next(t for t in listed if t["trace_id"] == trace_id)
    assert (
        row["root_name"] == "invoke_agent" and row["service"] == "agent-under-test" and row["span_count"] == 3
    )
    assert row["error_count"] == 1 and row["duration_ms"] >= 0
    # Filters: the resource's hangar.sandbox.id ties it to the sandbox; status; service.
    assert [t["trace_id"] for t in _get(server, team_token, "/traces", sandbox="sbtrace1").json()] == [
        trace_id
    ]
    assert _get(server, team_token, "/traces", sandbox="sbother").json() == []
    assert [t["trace_id"] for t in _get(server, team_token, "/traces", status="error").json()] == [trace_id]
    assert _get(server, team_token, "/traces", status="ok").json() == []
    assert _get(server, team_token, "/traces", service="nobody").json() == []

    # The OTLP/JSON export of it parses back as the same spans.
    exported = _get(server, team_token, f"/traces/{trace_id}", format="otlp").json()
    spans = [s for rs in exported["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    assert sorted(s["name"] for s in spans) == ["chat", "execute_tool", "invoke_agent"]
    assert all(s["traceId"] == trace_id for s in spans)


def _json_trace(trace_id: str, span_id: str, **extra) -> dict:
    now = time.time_ns()
    span = {"traceId": trace_id, "spanId": span_id, "name": "exec", "kind": 3,
            "startTimeUnixNano": str(now), "endTimeUnixNano": str(now + 5_000_000),
            "attributes": [{"key": "process.exit_code", "value": {"intValue": "0"}}], **extra}  # fmt: skip
    return {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "curl"}}]},
                               "scopeSpans": [{"scope": {"name": "manual"}, "spans": [span]}]}]}  # fmt: skip


def _post(
    server: str, token: str | None, path: str, body: bytes, ctype: str, **headers: str
) -> httpx.Response:
    h = {"Content-Type": ctype, **headers}
    if token:
        h["Authorization"] = f"Bearer {token}"
    return httpx.post(f"{server}{path}", content=body, headers=h, timeout=30)


def test_otlp_json_gzip_and_logs_joining_the_trace(server, team_token):
    trace_id, span_id = pysecrets.token_hex(16), pysecrets.token_hex(8)
    body = gzip.compress(json.dumps(_json_trace(trace_id, span_id)).encode())
    r = _post(
        server, team_token, "/api/v1/otlp/v1/traces", body, "application/json", **{"Content-Encoding": "gzip"}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), r.text
    assert r.json() == {}  # nothing rejected
    logs = {"resourceLogs": [{"resource": {"attributes": [{"key": "hangar.run.id", "value": {"stringValue": "runlog1"}}]},
            "scopeLogs": [{"logRecords": [
                {"timeUnixNano": str(time.time_ns()), "severityNumber": 9, "severityText": "INFO",
                 "body": {"stringValue": "tool started"}, "traceId": trace_id, "spanId": span_id},
                {"timeUnixNano": str(time.time_ns()), "body": {"stringValue": "no trace: the run's timeline"}},
            ]}]}]}  # fmt: skip
    r = _post(server, team_token, "/v1/logs", json.dumps(logs).encode(), "application/json")
    assert r.status_code == 200, r.text
    got = _wait_trace(server, team_token, trace_id, 1)
    assert got["spans"][0]["attributes"] == {"process.exit_code": 0} and got["spans"][0]["kind"] == 3
    assert [entry["body"] for entry in got["logs"]] == ["tool started"] and got["logs"][0][
        "span_id"
    ] == span_id
    assert TraceLog.objects.filter(trace_id="", run_id="runlog1").count() == 1
    # The run's trace (a span of it names the run) shows the record that named only the run.
    run_trace = _json_trace(pysecrets.token_hex(16), pysecrets.token_hex(8))
    run_trace["resourceSpans"][0]["resource"]["attributes"].append(
        {"key": "hangar.run.id", "value": {"stringValue": "runlog1"}}
    )
    r = _post(server, team_token, "/v1/traces", json.dumps(run_trace).encode(), "application/json")
    assert r.status_code == 200, r.text
    got = _wait_trace(
        server, team_token, run_trace["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"], 1
    )
    assert [entry["body"] for entry in got["logs"]] == ["no trace: the run's timeline"], got["logs"]
    # A record that names only a sandbox joins the traces of that sandbox it falls within.
    sandbox_trace = _json_trace(pysecrets.token_hex(16), pysecrets.token_hex(8))
    sandbox_trace["resourceSpans"][0]["resource"]["attributes"].append(
        {"key": "hangar.sandbox.id", "value": {"stringValue": "sblogjoin1"}}
    )
    inside = (
        int(sandbox_trace["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["startTimeUnixNano"]) + 1_000_000
    )
    by_sandbox = {"resourceLogs": [{"resource": {"attributes": [{"key": "hangar.sandbox.id", "value": {"stringValue": "sblogjoin1"}}]},
                  "scopeLogs": [{"logRecords": [
                      {"timeUnixNano": str(inside), "body": {"stringValue": "within the sandbox's trace"}},
                      {"timeUnixNano": str(inside - 3_600_000_000_000), "body": {"stringValue": "an hour before it"}},
                  ]}]}]}  # fmt: skip
    assert (
        _post(server, team_token, "/v1/logs", json.dumps(by_sandbox).encode(), "application/json").status_code
        == 200
    )
    assert (
        _post(
            server, team_token, "/v1/traces", json.dumps(sandbox_trace).encode(), "application/json"
        ).status_code
        == 200
    )
    got = _wait_trace(
        server, team_token, sandbox_trace["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"], 1
    )
    assert [entry["body"] for entry in got["logs"]] == ["within the sandbox's trace"], got["logs"]
    # A span with a bad id is rejected alone: a partial success that says why.
    bad = _json_trace(pysecrets.token_hex(16), "")
    r = _post(server, team_token, "/v1/traces", json.dumps(bad).encode(), "application/json")
    assert r.status_code == 200 and r.json()["partialSuccess"]["rejectedSpans"] == "1", r.text


def test_bad_requests_get_the_otlp_status_codes_and_store_nothing(server, team_token, other_team_token):
    before = TraceSpan.objects.count()
    good = json.dumps(_json_trace(pysecrets.token_hex(16), pysecrets.token_hex(8))).encode()
    assert _post(server, None, "/v1/traces", good, "application/json").status_code == 401
    assert _post(server, "hgr_nottoken", "/v1/traces", good, "application/json").status_code == 401
    assert _post(server, team_token, "/v1/traces", good, "text/plain").status_code == 415
    assert (
        _post(
            server, team_token, "/v1/traces", good, "application/json", **{"Content-Encoding": "br"}
        ).status_code
        == 415
    )
    assert (
        _post(server, team_token, "/v1/traces", b"\xff\x00garbage", "application/x-protobuf").status_code
        == 400
    )
    assert _post(server, team_token, "/v1/traces", b"{not json", "application/json").status_code == 400
    r = _post(server, team_token, "/v1/traces", b"[1, 2]", "application/json")
    assert r.status_code == 400 and "object" in r.json()["message"]
    bad_hex = json.dumps(_json_trace("zz" * 16, pysecrets.token_hex(8))).encode()
    assert _post(server, team_token, "/v1/traces", bad_hex, "application/json").status_code == 400
    assert (
        _post(
            server, team_token, "/v1/traces", b"x", "application/json", **{"Content-Encoding": "gzip"}
        ).status_code
        == 400
    )
    huge = b"{" + b" " * (16 * 1024 * 1024 + 10) + b"}"
    assert _post(server, team_token, "/v1/traces", huge, "application/json").status_code == 413
    bomb = gzip.compress(b" " * (17 * 1024 * 1024))  # small sent, too large unpacked
    r = _post(server, team_token, "/v1/traces", bomb, "application/json", **{"Content-Encoding": "gzip"})
    assert r.status_code == 413
    assert TraceSpan.objects.count() == before

    trace_id = pysecrets.token_hex(16)
    ok = json.dumps(_json_trace(trace_id, pysecrets.token_hex(8))).encode()
    assert _post(server, team_token, "/v1/traces", ok, "application/json").status_code == 200
    assert _get(server, other_team_token, f"/traces/{trace_id}").status_code == 404
    assert trace_id not in [t["trace_id"] for t in _get(server, other_team_token, "/traces").json()]
    assert _get(server, team_token, "/traces/not-a-trace-id").status_code == 404


def test_a_token_without_traces_write_cannot_ingest_and_one_without_read_cannot_list(server, team_token):
    from runtime.models import ApiToken
    from runtime.services.auth import token_create

    owner = ApiToken.objects.select_related("user", "team").get(team__name="alpha")
    reader = token_create(user=owner.user, team=owner.team, scopes=["traces:read"]).raw
    writer = token_create(user=owner.user, team=owner.team, scopes=["traces:write"]).raw
    sandboxes_only = token_create(user=owner.user, team=owner.team, scopes=["sandboxes:read"]).raw
    body = json.dumps(_json_trace(pysecrets.token_hex(16), pysecrets.token_hex(8))).encode()
    r = _post(server, reader, "/v1/traces", body, "application/json")
    assert r.status_code == 403 and "traces:write" in r.json()["message"]
    assert _post(server, writer, "/v1/traces", body, "application/json").status_code == 200
    assert _get(server, reader, "/traces").status_code == 200
    assert _get(server, sandboxes_only, "/traces").status_code == 403


def test_secrets_are_masked_and_large_values_cut_and_kept(server, team_token):
    from runtime.models import Team
    from runtime.services import secrets as secret_svc

    secret_svc.secret_create(
        team=Team.objects.get(name="alpha"), name="OPENAI_API_KEY", value="sk-live-supersecret-123"
    )
    trace_id = pysecrets.token_hex(16)
    doc = _json_trace(trace_id, pysecrets.token_hex(8))
    span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    prompt = "x" * 40_000 + " the end"
    span["attributes"] += [
        {
            "key": "http.request.header.authorization",
            "value": {"stringValue": "Bearer sk-live-supersecret-123"},
        },
        {"key": "gen_ai.prompt", "value": {"stringValue": prompt}},
    ]
    assert (
        _post(server, team_token, "/v1/traces", json.dumps(doc).encode(), "application/json").status_code
        == 200
    )
    attrs = _wait_trace(server, team_token, trace_id, 1)["spans"][0]["attributes"]
    assert attrs["http.request.header.authorization"] == "Bearer ***"
    assert "supersecret" not in json.dumps(
        list(TraceSpan.objects.filter(trace_id=trace_id).values()), default=str
    )
    assert len(attrs["gen_ai.prompt"]) == 16 * 1024
    # Ingested log records are masked alike: their bodies and attributes.
    record = {"timeUnixNano": str(time.time_ns()), "traceId": trace_id,
              "body": {"stringValue": "calling with key sk-live-supersecret-123"},
              "attributes": [{"key": "api.key", "value": {"stringValue": "sk-live-supersecret-123"}}]}  # fmt: skip
    logs = {"resourceLogs": [{"resource": {"attributes": []}, "scopeLogs": [{"logRecords": [record]}]}]}
    assert (
        _post(server, team_token, "/v1/logs", json.dumps(logs).encode(), "application/json").status_code
        == 200
    )
    wait_until(lambda: TraceLog.objects.filter(trace_id=trace_id).exists(), timeout=5)
    got = _get(server, team_token, f"/traces/{trace_id}").json()["logs"]
    assert got[0]["body"] == "calling with key ***" and got[0]["attributes"]["api.key"] == "***", got
    assert "supersecret" not in json.dumps(
        list(TraceLog.objects.filter(trace_id=trace_id).values()), default=str
    )
    whole = _get(server, team_token, f"/traces/{trace_id}/values/{attrs['hangar.truncated.gen_ai.prompt']}")
    assert whole.status_code == 200 and whole.text == prompt


@pytest.mark.django_db
def test_traces_past_their_retention_are_pruned(settings):
    from runtime.models import Team
    from runtime.services import otlp, traces

    settings.HANGAR_TRACE_RETENTION_DAYS = 3
    team = Team.objects.create(name="retained")
    old_id, new_id = pysecrets.token_hex(16), pysecrets.token_hex(16)
    for trace_id in (old_id, new_id):
        decoded = otlp.span_rows(otlp.parse("traces", json.dumps(_json_trace(trace_id, pysecrets.token_hex(8))).encode(),
                                            "application/json"))  # fmt: skip
        traces.spans_store(team=team, decoded=decoded)
    Trace.objects.filter(trace_id=old_id).update(updated_at=timezone.now() - timedelta(days=4))
    assert traces.traces_prune() == 1
    assert list(Trace.objects.filter(team=team).values_list("trace_id", flat=True)) == [new_id]
    assert not TraceSpan.objects.filter(trace_id=old_id).exists()
    settings.HANGAR_TRACE_RETENTION_DAYS = 0
    Trace.objects.update(updated_at=timezone.now() - timedelta(days=400))
    assert traces.traces_prune() == 0  # 0 keeps everything


@pytest.mark.django_db(transaction=True)
def test_a_saturated_ingest_answers_429_with_retry_after(team_token, monkeypatch):
    import asyncio

    from django.test import AsyncRequestFactory

    from dashboard import otlp

    monkeypatch.setattr(otlp, "_SLOTS", asyncio.Semaphore(0))  # every slot taken
    body = json.dumps(_json_trace(pysecrets.token_hex(16), pysecrets.token_hex(8))).encode()
    request = AsyncRequestFactory().post(
        "/v1/traces",
        data=body,
        content_type="application/json",
        headers={"Authorization": f"Bearer {team_token}"},
    )
    response = asyncio.run(otlp.traces(request))
    assert response.status_code == 429 and response["Retry-After"] == "1"
    assert not TraceSpan.objects.exists()


def test_the_list_filters_by_harness_time_duration_and_limit(server, team_token):
    """Three traces of one harness (a short one, a long one, one an hour old), one of another."""
    harness, other = "h" + pysecrets.token_hex(6), "h" + pysecrets.token_hex(6)
    now = time.time_ns()

    def send(harness_id: str, start_ns: int, ms: int) -> str:
        trace_id = pysecrets.token_hex(16)
        body = _json_trace(trace_id, pysecrets.token_hex(8), startTimeUnixNano=str(start_ns),
                           endTimeUnixNano=str(start_ns + ms * 1_000_000))  # fmt: skip
        body["resourceSpans"][0]["resource"]["attributes"].append(
            {"key": "hangar.harness.id", "value": {"stringValue": harness_id}}
        )
        assert (
            _post(server, team_token, "/v1/traces", json.dumps(body).encode(), "application/json").status_code
            == 200
        )
        return trace_id

    short, long_ = send(harness, now, 5), send(harness, now + 1_000_000, 900)
    old = send(harness, now - 3600 * 10**9, 50)
    send(other, now, 5)
    headers = {"Authorization": f"Bearer {team_token}"}

    def listed(**params) -> list[str]:
        r = httpx.get(
            f"{server}/api/v1/traces", params={"harness": harness, **params}, headers=headers, timeout=30
        )
        assert r.status_code == 200, r.text
        return [t["trace_id"] for t in r.json()]

    wait_until(lambda: len(listed()) == 3, 5, what="the three traces listed")
    assert listed() == [long_, short, old]  # newest first, the other harness's left out
    assert listed(min_duration_ms=100) == [long_]
    since = datetime.fromtimestamp((now - 60 * 10**9) / 1e9, tz=UTC).isoformat()
    assert listed(**{"from": since}) == [long_, short]
    assert listed(to=since) == [old]
    assert listed(limit=1) == [long_]
    r = httpx.get(f"{server}/api/v1/traces", params={"limit": 0}, headers=headers, timeout=30)
    assert r.status_code == 422, r.text
