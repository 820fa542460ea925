"""Storing ingested spans: a NUL character anywhere in an OTLP string (protobuf or JSON, spans or
logs) is stored as U+FFFD and the request answers 200; the bulk (COPY) write keeps every column,
adds each batch to its traces' summaries, gives the live pages the rows' ids, masks secrets
wherever they are (a resource shared by many spans included) and cuts large values."""

from __future__ import annotations

import json
import math
import secrets as pysecrets
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.db import connection
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from runtime.models import Team, Trace, TraceLog, TraceSpan, TraceValue
from runtime.services import otlp, trace_live, traces

NUL = "\x00"


def _post(server: str, token: str, path: str, body: bytes, ctype: str) -> httpx.Response:
    headers = {"Content-Type": ctype, "Authorization": f"Bearer {token}"}
    return httpx.post(f"{server}{path}", content=body, headers=headers, timeout=30)


def _proto_trace(trace_id: str, span_id: str) -> bytes:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    kv = rs.resource.attributes.add()
    kv.key, kv.value.string_value = "service.name", f"svc{NUL}x"
    ss = rs.scope_spans.add()
    ss.scope.name = f"scope{NUL}"
    span = ss.spans.add()
    span.trace_id, span.span_id = bytes.fromhex(trace_id), bytes.fromhex(span_id)
    span.name = f"exec{NUL}ls"
    span.start_time_unix_nano = time.time_ns()
    span.end_time_unix_nano = span.start_time_unix_nano + 1000
    span.status.code, span.status.message = 2, f"failed{NUL}"
    for key, text in ((f"k{NUL}ey", "v"), ("out", f"a{NUL}b{NUL}")):
        kv = span.attributes.add()
        kv.key, kv.value.string_value = key, text
    listed = span.attributes.add()
    listed.key = "argv"
    listed.value.array_value.values.add().string_value = f"x{NUL}"
    event = span.events.add()
    event.name, event.time_unix_nano = f"ev{NUL}", span.start_time_unix_nano
    return req.SerializeToString()


def _proto_logs(trace_id: str) -> bytes:
    req = ExportLogsServiceRequest()
    record = req.resource_logs.add().scope_logs.add().log_records.add()
    record.trace_id, record.time_unix_nano = bytes.fromhex(trace_id), time.time_ns()
    record.body.string_value, record.severity_text = f"line{NUL}end", f"IN{NUL}FO"
    kv = record.attributes.add()
    kv.key, kv.value.string_value = "stream", f"std{NUL}out"
    return req.SerializeToString()


def test_a_nul_in_protobuf_spans_and_logs_is_stored_as_a_replacement_character(server, team_token):
    trace_id, span_id = pysecrets.token_hex(16), pysecrets.token_hex(8)
    r = _post(server, team_token, "/v1/traces", _proto_trace(trace_id, span_id), otlp.PROTOBUF)
    assert r.status_code == 200, r.text
    r = _post(server, team_token, "/v1/logs", _proto_logs(trace_id), otlp.PROTOBUF)
    assert r.status_code == 200, r.text
    span = TraceSpan.objects.get(trace_id=trace_id)
    assert span.name == "exec\ufffdls" and span.status_message == "failed\ufffd"
    assert span.attributes == {"k\ufffdey": "v", "out": "a\ufffdb\ufffd", "argv": ["x\ufffd"]}
    assert span.events[0]["name"] == "ev\ufffd" and span.scope["name"] == "scope\ufffd"
    assert span.service == "svc\ufffdx" and span.resource == {"service.name": "svc\ufffdx"}
    log = TraceLog.objects.get(trace_id=trace_id)
    assert log.body == "line\ufffdend" and log.severity_text == "IN\ufffdFO"
    assert log.attributes == {"stream": "std\ufffdout"}


def test_a_nul_in_otlp_json_spans_and_logs_is_stored_as_a_replacement_character(server, team_token):
    trace_id, span_id = pysecrets.token_hex(16), pysecrets.token_hex(8)
    now = time.time_ns()
    doc = {"resourceSpans": [{"scopeSpans": [{"spans": [{
        "traceId": trace_id, "spanId": span_id, "name": "chat\u0000", "startTimeUnixNano": str(now),
        "endTimeUnixNano": str(now + 1), "attributes": [{"key": "gen_ai.prompt", "value": {"stringValue": "hi\u0000"}}],
    }]}]}]}  # fmt: skip
    body = json.dumps(doc).encode()
    assert b"\\u0000" in body
    assert _post(server, team_token, "/v1/traces", body, otlp.JSON).status_code == 200
    logs = {"resourceLogs": [{"scopeLogs": [{"logRecords": [
        {"timeUnixNano": str(now), "traceId": trace_id, "body": {"stringValue": "out\u0000put"}},
    ]}]}]}  # fmt: skip
    assert _post(server, team_token, "/v1/logs", json.dumps(logs).encode(), otlp.JSON).status_code == 200
    span = TraceSpan.objects.get(trace_id=trace_id)
    assert span.name == "chat\ufffd" and span.attributes == {"gen_ai.prompt": "hi\ufffd"}
    assert TraceLog.objects.get(trace_id=trace_id).body == "out\ufffdput"
    assert Trace.objects.get(trace_id=trace_id).root_name == "chat\ufffd"


def _row(trace_id: str, name: str, parent: str = "", **attrs) -> dict:
    now = time.time_ns()
    return {"trace_id": trace_id, "span_id": pysecrets.token_hex(8), "parent_span_id": parent, "name": name,
            "kind": 1, "start_ns": now, "end_ns": now + 5_000, "status_code": 0, "status_message": "",
            "attributes": attrs, "events": [], "links": [], "resource": {"service.name": "agent"},
            "scope": {"name": "s", "version": "1"}, "service": "agent", "sandbox_id": "", "run_id": "",
            "harness_id": ""}  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_a_batch_is_stored_whole_with_its_traces_summed_and_its_ids_announced(monkeypatch):
    team = Team.objects.create(name="bulk")
    announced: list[tuple[str, int | None]] = []
    monkeypatch.setattr(trace_live, "spans_stored", lambda *, team_id, spans: announced.extend(spans))
    a, b = pysecrets.token_hex(16), pysecrets.token_hex(16)
    shared = {"service.name": "agent", "hangar.sandbox.id": "sbshared"}
    rows = [_row(a, f"child {i}", parent="ab" * 8, n=i, ratio=0.5, ok=True, tags=["x"]) for i in range(300)]
    rows += [_row(b, "tool\tcall\nwith \\ specials", parent="cd" * 8) for _ in range(5)]
    for row in rows:
        row["resource"] = shared
    rows[7]["events"] = [{"name": "e", "time_ns": 1, "attributes": {"k": 1}}]
    rows[8]["links"] = [{"trace_id": b, "span_id": "ef" * 8, "attributes": {}}]
    rows[9]["attributes"]["weird"] = math.nan
    assert traces.spans_store(team=team, decoded=otlp.Decoded(rows=rows)) == 305
    stored = {s.span_id: s for s in TraceSpan.objects.filter(team=team)}
    assert len(stored) == 305
    s7 = stored[rows[7]["span_id"]]
    assert s7.attributes == {"n": 7, "ratio": 0.5, "ok": True, "tags": ["x"]}
    assert s7.events == rows[7]["events"]
    assert stored[rows[8]["span_id"]].links == rows[8]["links"]
    assert stored[rows[9]["span_id"]].attributes["weird"] == "nan"  # JSON has no NaN
    assert stored[rows[300]["span_id"]].name == "tool\tcall\nwith \\ specials"
    assert all(s.resource == shared and s.scope == {"name": "s", "version": "1"} for s in stored.values())
    # The live pages hear each stored row's id, by trace.
    assert sorted(i for _, i in announced) == sorted(s.pk for s in stored.values())
    assert {t for t, _ in announced} == {a, b}

    # A second batch of trace a, with its root this time, grows its summary in place.
    root = _row(a, "invoke_agent")
    root["status_code"], root["start_ns"] = 2, rows[0]["start_ns"] - 10
    traces.spans_store(team=team, decoded=otlp.Decoded(rows=[root]))
    ta, tb = Trace.objects.get(team=team, trace_id=a), Trace.objects.get(team=team, trace_id=b)
    assert (ta.span_count, ta.error_count, ta.root_name) == (301, 1, "invoke_agent")
    assert ta.start_ns == root["start_ns"]
    assert (tb.span_count, tb.root_name, tb.service) == (5, "", "agent")


@pytest.mark.django_db(transaction=True)
def test_concurrent_batches_of_the_same_traces_add_up():
    team = Team.objects.create(name="concurrent")
    ids = [pysecrets.token_hex(16) for _ in range(6)]

    def send(k: int) -> None:
        try:
            rows = [_row(ids[(k + i) % 6], "s") for i in range(60)]
            traces.spans_store(team=team, decoded=otlp.Decoded(rows=rows[::-1] if k % 2 else rows))
        finally:
            connection.close()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, range(16)))
    assert sum(Trace.objects.filter(team=team).values_list("span_count", flat=True)) == 16 * 60
    assert TraceSpan.objects.filter(team=team).count() == 16 * 60


@pytest.mark.django_db(transaction=True)
def test_secrets_are_masked_in_a_shared_resource_and_in_text_columns_and_long_values_kept(settings):
    from runtime.services import secrets as secret_svc

    settings.HANGAR_TRACE_VALUE_BYTES = 256
    team = Team.objects.create(name="masked")
    secret_svc.secret_create(team=team, name="TOKEN", value='tok"en-\\42')
    trace_id = pysecrets.token_hex(16)
    leaky = {"service.name": "agent", "env": 'TOKEN=tok"en-\\42'}
    rows = [_row(trace_id, "clean", n=1), _row(trace_id, 'say tok"en-\\42', out="y" * 300 + 'tok"en-\\42')]
    rows[1]["resource"] = leaky
    rows.append(_row(trace_id, "scoped"))
    rows[2]["scope"] = {"name": 'lib tok"en-\\42', "version": "1"}
    rows[0]["status_message"] = 'bad tok"en-\\42'
    traces.spans_store(team=team, decoded=otlp.Decoded(rows=rows))
    assert "tok" not in json.dumps(list(TraceSpan.objects.filter(team=team).values()), default=str)
    masked = TraceSpan.objects.get(team=team, name="say ***")
    assert masked.resource == {"service.name": "agent", "env": "TOKEN=***"}
    assert len(masked.attributes["out"]) == 256
    whole = TraceValue.objects.get(id=masked.attributes["hangar.truncated.out"])
    assert whole.value == "y" * 300 + "***"
    clean = TraceSpan.objects.get(team=team, name="clean")
    assert clean.status_message == "bad ***"
    assert TraceSpan.objects.get(team=team, name="scoped").scope == {"name": "lib ***", "version": "1"}


@pytest.mark.django_db(transaction=True)
def test_a_secret_that_is_part_of_an_id_masks_the_text_never_the_ids_and_bounded_columns_stay_bounded():
    """A secret whose value is hex digits found in a trace's, span's or link's ids (or a short one
    found everywhere) must not change the ids: the batch would not be stored at all."""
    from runtime.services import secrets as secret_svc

    team = Team.objects.create(name="hexy")
    trace_id, span_id = "ab12" * 8, "cd34" * 4
    secret_svc.secret_create(team=team, name="HEX", value="ab12")  # in the trace id, 8 times
    secret_svc.secret_create(team=team, name="SHORT", value="e")  # under MASK_MIN_CHARS: left alone
    row = _row(trace_id, "x" * 250 + "ab12", "ef56" * 4, said="key ab12")
    row["span_id"], row["service"], row["sandbox_id"] = span_id, "s" * 253 + "ab12", "sbab12"
    row["links"] = [{"trace_id": trace_id, "span_id": span_id, "attributes": {"why": "ab12"}}]
    traces.spans_store(team=team, decoded=otlp.Decoded(rows=[row]))
    got = TraceSpan.objects.get(team=team)
    assert (got.trace_id, got.span_id, got.parent_span_id, got.sandbox_id) == (
        trace_id,
        span_id,
        "ef56" * 4,
        "sbab12",
    )
    assert got.attributes == {"said": "key ***"} and got.links[0] == {
        "trace_id": trace_id, "span_id": span_id, "attributes": {"why": "***"}}  # fmt: skip
    assert got.name == ("x" * 250 + "***")[:255] and len(got.service) == 255
    assert Trace.objects.get(team=team, trace_id=trace_id).span_count == 1
    log = {"trace_id": trace_id, "span_id": span_id, "time_ns": time.time_ns(), "severity_number": 9,
           "severity_text": "ab12" * 8, "body": "the key is ab12", "attributes": {}, "resource": {},
           "service": "agent", "sandbox_id": "", "run_id": "", "harness_id": ""}  # fmt: skip
    traces.logs_store(team=team, decoded=otlp.Decoded(rows=[log]))
    stored = TraceLog.objects.get(team=team)
    assert (stored.trace_id, stored.span_id, stored.body) == (trace_id, span_id, "the key is ***")
    assert stored.severity_text == ("***" * 8)[:32]


def test_a_nan_or_infinite_double_decodes_as_text():
    req = ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id = bytes(range(1, 17)), bytes(range(1, 9))
    for key, number in (("a", math.nan), ("b", math.inf), ("c", 0.5)):
        kv = span.attributes.add()
        kv.key, kv.value.double_value = key, number
    rows = otlp.span_rows(req).rows
    assert rows[0]["attributes"] == {"a": "nan", "b": "inf", "c": 0.5}
