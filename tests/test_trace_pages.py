"""The trace pages: the team's traces listed and filtered, a trace's waterfall rendered on the
server (span names in the HTML, nested, coloured by kind), the span panel (attributes, events,
a model call's messages as a conversation, logs), paging of a large trace, another team's trace
not found. Through Django's test client, with spans stored through the ingest's own services."""

from __future__ import annotations

import json
import re
import secrets
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth import get_user_model

from runtime.models import Exec, Membership, Sandbox, Team, TraceSpan
from runtime.services import otlp, traces


def _member(username: str, team: Team, role: str = "viewer"):
    user = get_user_model().objects.create_user(username, password="pw")
    Membership.objects.create(user=user, team=team, role=role)
    return user


def _kv(attrs: dict) -> list[dict]:
    def any_value(v):
        if isinstance(v, bool):
            return {"boolValue": v}
        if isinstance(v, int):
            return {"intValue": str(v)}
        return {"stringValue": v}

    return [{"key": k, "value": any_value(v)} for k, v in attrs.items()]


def _store(team: Team, spans: list[dict], service: str = "agent") -> str:
    now = time.time_ns()
    trace_id = secrets.token_hex(16)
    body = {"resourceSpans": [{"resource": {"attributes": _kv({"service.name": service})}, "scopeSpans": [{"spans": [
        {"traceId": trace_id, "spanId": s["id"], "parentSpanId": s.get("parent", ""), "name": s["name"],
         "startTimeUnixNano": str(now + s.get("at", 0) * 1_000_000),
         "endTimeUnixNano": str(now + (s.get("at", 0) + s.get("ms", 1)) * 1_000_000),
         "attributes": _kv(s.get("attrs", {})), "status": {"code": s.get("status", 0)},
         "events": [{"name": e, "timeUnixNano": str(now)} for e in s.get("events", [])]}
        for s in spans
    ]}]}]}  # fmt: skip
    decoded = otlp.span_rows(otlp.parse("traces", json.dumps(body).encode(), "application/json"))
    traces.spans_store(team=team, decoded=decoded)
    return trace_id


@pytest.fixture
def crew(db) -> Team:
    return Team.objects.create(name="crew")


def _agent_trace(team: Team) -> tuple[str, dict[str, str]]:
    ids = {n: secrets.token_hex(8) for n in ("root", "chat", "tool", "exec")}
    messages = json.dumps([{"role": "user", "content": "fix the failing test"},
                           {"role": "assistant", "content": "I will run pytest"}])  # fmt: skip
    trace_id = _store(team, [
        {"id": ids["root"], "name": "invoke_agent", "ms": 100, "attrs": {"gen_ai.operation.name": "invoke_agent"}},
        {"id": ids["chat"], "parent": ids["root"], "name": "chat claude", "at": 5, "ms": 40,
         "attrs": {"gen_ai.operation.name": "chat", "gen_ai.request.model": "claude-x", "gen_ai.input.messages": messages,
                   "gen_ai.usage.input_tokens": 1200}},
        {"id": ids["tool"], "parent": ids["root"], "name": "execute_tool bash", "at": 50, "ms": 30, "status": 2,
         "attrs": {"gen_ai.tool.name": "bash"}, "events": ["tool.result"]},
        {"id": ids["exec"], "parent": ids["tool"], "name": "exec", "at": 55, "ms": 20,
         "attrs": {"process.exit_code": 1}},
    ])  # fmt: skip
    return trace_id, ids


def test_the_traces_page_lists_and_filters_the_teams_traces(client, crew):
    client.force_login(_member("vera", crew))
    trace_id, _ = _agent_trace(crew)
    quiet = _store(crew, [{"id": secrets.token_hex(8), "name": "ping"}], service="other")
    page = client.get("/traces/")
    assert page.status_code == 200
    html = page.content.decode()
    assert trace_id in html and quiet in html and "invoke_agent" in html
    errors = client.get("/traces/", {"status": "error"}).content.decode()
    assert trace_id in errors and quiet not in errors
    assert quiet not in client.get("/traces/", {"service": "agent"}).content.decode()
    assert client.get("/traces/", {"from": "not a date"}).status_code == 200  # a message, not an error page
    # Tied to a sandbox, a harness and a run; long; and by time.
    tied = _store(crew, [{"id": secrets.token_hex(8), "name": "sandbox.create", "ms": 900,
                          "attrs": {"hangar.sandbox.id": "sbpage1", "hangar.harness.id": "hpage1", "hangar.run.id": "rpage1"}}],
                  service="hangar")  # fmt: skip
    for key, value in (
        ("sandbox", "sbpage1"),
        ("harness", "hpage1"),
        ("run", "rpage1"),
        ("min_duration_ms", "500"),
    ):
        listed = client.get("/traces/", {key: value}).content.decode()
        assert tied in listed and trace_id not in listed and quiet not in listed, key

    def at(hours: float) -> str:
        return (datetime.now(UTC) + timedelta(hours=hours)).strftime("%Y-%m-%dT%H:%M:%SZ")

    later = client.get("/traces/", {"from": at(1), "to": at(2)}).content.decode()
    assert "<td" in later and tied not in later and trace_id not in later
    assert tied in client.get("/traces/", {"from": at(-1), "to": at(1)}).content.decode()


def test_a_trace_page_renders_the_waterfall_on_the_server_and_the_span_panel(client, crew):
    client.force_login(_member("vera", crew))
    trace_id, ids = _agent_trace(crew)
    page = client.get(f"/traces/{trace_id}/")
    assert page.status_code == 200
    html = page.content.decode()
    rows = re.findall(r'class="wf-row[^"]*" data-depth="(\d+)" data-span="([0-9a-f]{16})"', html)
    assert [(int(d), s) for d, s in rows] == [
        (0, ids["root"]),
        (1, ids["chat"]),
        (1, ids["tool"]),
        (2, ids["exec"]),
    ]
    assert "wf-bar model" in html and "wf-bar tool" in html and "wf-bar command" in html
    assert "chat claude" in html and "execute_tool bash" in html

    panel = client.get(f"/traces/{trace_id}/spans/{ids['chat']}/", HTTP_HX_REQUEST="true").content.decode()
    assert "gen_ai.request.model" in panel and "claude-x" in panel and "1200" in panel
    assert (
        'class="msg-turn user"' in panel and "fix the failing test" in panel and "I will run pytest" in panel
    )
    tool_panel = client.get(f"/traces/{trace_id}/spans/{ids['tool']}/").content.decode()
    assert "tool.result" in tool_panel and "error" in tool_panel


def test_log_records_are_on_the_spans_timeline_and_kinds_are_coloured(client, crew):
    client.force_login(_member("vera", crew))
    trace_id, ids = _agent_trace(crew)
    root = TraceSpan.objects.get(trace_id=trace_id, span_id=ids["root"])
    logs = {"resourceLogs": [{"resource": {"attributes": _kv({"service.name": "agent"})}, "scopeLogs": [{"logRecords": [
        {"timeUnixNano": str(root.start_ns + 25_000_000), "traceId": trace_id, "spanId": ids["chat"],
         "severityText": "INFO", "body": {"stringValue": "model answered"}},
        {"timeUnixNano": str(root.start_ns + 75_000_000), "traceId": trace_id, "severityText": "WARN",
         "body": {"stringValue": "tool failed"}},
    ]}]}]}  # fmt: skip
    traces.logs_store(
        team=crew, decoded=otlp.log_rows(otlp.parse("logs", json.dumps(logs).encode(), "application/json"))
    )
    trace = traces.trace_get(team=crew, trace_id=trace_id)[0]
    html = client.get(f"/traces/{trace_id}/").content.decode()
    marks = re.findall(r'class="wf-row wf-log"[^>]*>\s*<div class="wf-name"><span class="badge">(\w+)</span> '
                       r'<span class="wf-label">([^<]+)</span></div>\s*<div class="wf-track"><div class="wf-mark" '
                       r'style="left: ([0-9.]+)%"', html)  # fmt: skip
    total = trace.end_ns - trace.start_ns
    assert [(sev, body) for sev, body, _ in marks] == [("INFO", "model answered"), ("WARN", "tool failed")], (
        html
    )
    for (_, _, left), at in zip(marks, (25_000_000, 75_000_000), strict=True):
        assert float(left) == pytest.approx(100 * (root.start_ns + at - trace.start_ns) / total, abs=0.01)
    # A record tied to a span is in that span's panel too.
    assert "model answered" in client.get(f"/traces/{trace_id}/spans/{ids['chat']}/").content.decode()
    # Hangar's lifecycle spans are coloured as such.
    lifecycle = _store(crew, [{"id": secrets.token_hex(8), "name": "sandbox.create"}], service="hangar")
    assert "wf-bar lifecycle" in client.get(f"/traces/{lifecycle}/").content.decode()


def test_another_teams_trace_and_span_are_not_found(client, crew):
    trace_id, ids = _agent_trace(crew)
    other = Team.objects.create(name="others")
    client.force_login(_member("otto", other))
    assert client.get(f"/traces/{trace_id}/").status_code == 404
    assert client.get(f"/traces/{trace_id}/spans/{ids['root']}/").status_code == 404
    assert trace_id not in client.get("/traces/").content.decode()
    client.logout()
    assert client.get("/traces/").status_code == 302  # sign in first


def test_a_large_trace_is_paged(client, crew, monkeypatch):
    from dashboard.pages import trace_views

    monkeypatch.setattr(trace_views, "PAGE_SPANS", 50)
    client.force_login(_member("vera", crew))
    root = secrets.token_hex(8)
    trace_id = _store(crew, [{"id": root, "name": "root", "ms": 500}] + [
        {"id": secrets.token_hex(8), "parent": root, "name": f"step {i}", "at": i, "ms": 1} for i in range(120)
    ])  # fmt: skip
    first = client.get(f"/traces/{trace_id}/").content.decode()
    assert first.count(" data-depth=") == 50 and 'id="trace-next"' in first and "step 48" in first
    assert "data-live=" not in first  # new spans grow the last page only
    last = client.get(f"/traces/{trace_id}/", {"offset": 100}).content.decode()
    assert last.count(" data-depth=") == 21 and "step 119" in last and 'id="trace-next"' not in last
    assert f'data-live="/ws/ui/traces/{trace_id}"' in last


def test_the_traces_page_searches_by_attribute_and_explains_a_bad_term(client, crew):
    client.force_login(_member("vera", crew))
    trace_id, _ = _agent_trace(crew)
    quiet = _store(
        crew, [{"id": secrets.token_hex(8), "name": "ping", "attrs": {"gen_ai.tool.name": "edit"}}]
    )
    page = client.get("/traces/", {"attr": "gen_ai.tool.name=bash"}).content.decode()
    assert trace_id in page and quiet not in page
    assert 'name="attr" value="gen_ai.tool.name=bash"' in page  # the form keeps the search
    both = client.get("/traces/", {"attr": ["gen_ai.tool.name=bash", "process.exit_code=1"]}).content.decode()
    assert trace_id in both and quiet not in both
    bad = client.get("/traces/", {"attr": "no equals sign"})
    assert bad.status_code == 200 and "attr must be key=value" in bad.content.decode()


def test_a_command_s_span_shows_its_output_and_links_to_it_on_its_sandbox_s_page(client, crew):
    client.force_login(_member("vera", crew))
    sandbox = Sandbox.objects.create(team=crew, image="busybox", image_digest="sha256:x", status="running")
    ran = Exec.objects.create(sandbox=sandbox, argv=["sh", "-c", "pytest -q"], exit_code=1,
                              stdout="1 failed, 41 passed\n", stderr="E   assert 2 == 3\n")  # fmt: skip
    others = Team.objects.create(name="others")
    elsewhere = Sandbox.objects.create(
        team=others, image="busybox", image_digest="sha256:x", status="running"
    )
    theirs = Exec.objects.create(sandbox=elsewhere, argv=["cat", "/secret"], stdout="their output\n")
    ids = {n: secrets.token_hex(8) for n in ("mine", "theirs", "none")}
    trace_id = _store(crew, [
        {"id": ids["mine"], "name": "exec", "attrs": {"hangar.exec.id": ran.id, "hangar.sandbox.id": sandbox.id}},
        # A span (ingested: anyone of the team can send one) naming another team's command.
        {"id": ids["theirs"], "name": "exec", "attrs": {"hangar.exec.id": theirs.id, "hangar.sandbox.id": elsewhere.id}},
        {"id": ids["none"], "name": "exec", "attrs": {"process.exit_code": 0}},
    ])  # fmt: skip
    panel = client.get(f"/traces/{trace_id}/spans/{ids['mine']}/").content.decode()
    assert "1 failed, 41 passed" in panel and "E   assert 2 == 3" in panel
    assert f"/sandboxes/{sandbox.id}/?tab=commands&amp;process={ran.id}" in panel
    assert f"/api/v1/sandboxes/{sandbox.id}/processes/{ran.id}/output" in panel
    foreign = client.get(f"/traces/{trace_id}/spans/{ids['theirs']}/").content.decode()
    assert "their output" not in foreign and ">Output<" not in foreign
    assert ">Output<" not in client.get(f"/traces/{trace_id}/spans/{ids['none']}/").content.decode()
