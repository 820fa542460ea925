"""Hangar's own spans, in the same traces as the callers': a create with its start's phases; an
exec and a file write made inside a real OpenTelemetry SDK's tool span (W3C ``traceparent``)
land under that span; a harness run is one trace named by the run, with ``TRACEPARENT`` on
the agent's process. Real runsc sandboxes, the real server, worker and bridge."""

from __future__ import annotations

import json
import time

import httpx
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.propagate import inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from ..support import requires_runsc
from .test_harnesses_api import wait_run, wait_status

pytestmark = [requires_runsc]


def _trace(api: httpx.Client, trace_id: str, names: set[str], timeout: float = 10) -> dict[str, dict]:
    """The trace's spans by name, once all of ``names`` are there (spans are written off the
    request path, within a second)."""
    deadline = time.monotonic() + timeout
    while True:
        r = api.get(f"/traces/{trace_id}")
        got = {s["name"]: s for s in r.json()["spans"]} if r.status_code == 200 else {}
        if names <= set(got):
            return got
        assert time.monotonic() < deadline, f"{sorted(names - set(got))} missing from {sorted(got)}"
        time.sleep(0.2)


def _traces_of(api: httpx.Client, sandbox_id: str, root: str, timeout: float = 10) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = [
            t for t in api.get("/traces", params={"sandbox": sandbox_id}).json() if t["root_name"] == root
        ]
        if found:
            return found
        assert time.monotonic() < deadline, f"no {root} trace for {sandbox_id}"
        time.sleep(0.2)


def test_a_create_and_an_exec_under_a_callers_span_are_traced(api, server, team_token, monkeypatch):
    sb = api.post(
        "/sandboxes", json={"image": "busybox", "memory_mb": 256, "network": {"egress": "all"}}
    ).json()
    assert sb["status"] == "running", sb

    # The create (no traceparent): a trace of its own, its scheduling, the node's start and its
    # phases under it, the launcher's own steps (its disk, its network, the runtime up) under the launch.
    created = _traces_of(api, sb["id"], "sandbox.create")[0]
    steps = ("disk", "network", "runtime")
    spans = _trace(api, created["trace_id"], {"sandbox.create", "sandbox.create.schedule", "sandbox.start",
                                              "sandbox.start.image", "sandbox.start.volumes", "sandbox.start.launch",
                                              *(f"sandbox.start.{step}" for step in steps)})  # fmt: skip
    assert spans["sandbox.create"]["parent_span_id"] is None
    schedule = spans["sandbox.create.schedule"]
    assert schedule["parent_span_id"] == spans["sandbox.create"]["span_id"]
    assert schedule["attributes"]["hangar.node"] and schedule["attributes"]["hangar.runtime"] == sb["runtime"]
    assert spans["sandbox.start"]["parent_span_id"] == spans["sandbox.create"]["span_id"]
    for phase in ("image", "volumes", "launch"):
        assert spans[f"sandbox.start.{phase}"]["parent_span_id"] == spans["sandbox.start"]["span_id"]
    launch = spans["sandbox.start.launch"]
    for step in steps:
        got = spans[f"sandbox.start.{step}"]
        assert got["parent_span_id"] == launch["span_id"], step
        assert launch["start_ns"] <= got["start_ns"] <= got["end_ns"] <= launch["end_ns"], (step, got, launch)
    assert spans["sandbox.start"]["attributes"]["hangar.sandbox.id"] == sb["id"]
    assert spans["sandbox.create"]["service"] == "hangar"

    # A secret of the team's, which a command names on its command line: masked in the span.
    r = api.post("/secrets", json={"name": "TRACED_SECRET", "value": "hush-0123456789"})
    assert r.status_code == 201, r.text

    # An agent's tool call runs a command in the sandbox, passing its span on.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"Authorization=Bearer {team_token}")
    provider = TracerProvider(resource=Resource.create({"service.name": "tool-caller"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{server}/v1/traces")))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("execute_tool", attributes={"gen_ai.tool.name": "bash"}) as tool:
        headers: dict[str, str] = {}
        inject(headers)
        assert headers["traceparent"].startswith("00-")
        r = api.post(f"/sandboxes/{sb['id']}/exec", headers=headers,
                     json={"cmd": "echo hi; exit 3", "env": {"API_KEY": "value-never-traced"}})  # fmt: skip
        assert r.status_code == 200 and r.json()["exit_code"] == 3, r.text
        r = api.put(
            f"/sandboxes/{sb['id']}/files", params={"path": "/tmp/a.txt"}, content=b"abc", headers=headers
        )
        assert r.status_code in (200, 201, 204), r.text
        r = api.get(f"/sandboxes/{sb['id']}/files/list", params={"path": "/tmp"}, headers=headers)
        assert r.status_code == 200 and "/tmp/a.txt" in [e["path"] for e in r.json()], r.text
        r = api.put(f"/sandboxes/{sb['id']}/network", headers=headers,
                    json={"egress": "allowlist", "allow": ["198.18.0.5"]})  # fmt: skip
        assert r.status_code == 200, r.text
        assert api.post(f"/sandboxes/{sb['id']}/exec", headers=headers,
                        json={"cmd": "echo hush-0123456789"}).json()["exit_code"] == 0  # fmt: skip
        # A create made inside the caller's span: its whole tree under it.
        child = api.post("/sandboxes", headers=headers, json={"image": "busybox", "memory_mb": 128}).json()
        assert child["status"] == "running", child
    provider.force_flush()
    provider.shutdown()
    trace_id = format(tool.get_span_context().trace_id, "032x")
    tool_id = format(tool.get_span_context().span_id, "016x")

    names = {
        "execute_tool",
        "exec",
        "file.write",
        "file.list",
        "sandbox.network",
        "sandbox.create",
        "sandbox.start",
    }
    spans = _trace(api, trace_id, names)
    for name in ("exec", "file.write", "file.list", "sandbox.network", "sandbox.create"):
        assert spans[name]["parent_span_id"] == tool_id, name
    assert spans["sandbox.start"]["parent_span_id"] == spans["sandbox.create"]["span_id"]
    assert spans["sandbox.create"]["attributes"]["hangar.sandbox.id"] == child["id"]
    assert spans["file.list"]["attributes"]["file.path"] == "/tmp"
    network = spans["sandbox.network"]["attributes"]
    assert network["hangar.network.egress"] == "allowlist" and network["hangar.network.allow"] == [
        "198.18.0.5"
    ]
    everything = api.get(f"/traces/{trace_id}").json()
    execs = [x for x in everything["spans"] if x["name"] == "exec"]
    assert ["/bin/sh", "-c", "echo ***"] in [x["attributes"]["process.command_args"] for x in execs]
    assert "hush-0123456789" not in json.dumps(everything)
    api.delete(f"/sandboxes/{child['id']}")
    spans |= {x["name"]: x for x in execs if x["attributes"]["process.exit_code"] == 3}  # the first exec
    attrs = spans["exec"]["attributes"]
    assert attrs["process.command_args"] == ["/bin/sh", "-c", "echo hi; exit 3"]
    assert attrs["process.exit_code"] == 3 and attrs["hangar.sandbox.id"] == sb["id"]
    assert isinstance(attrs["hangar.exec.id"], int) and attrs["hangar.exec.duration_ms"] >= 0
    assert spans["exec"]["status"]["code"] == "error"  # a non-zero exit
    assert spans["file.write"]["attributes"]["file.path"] == "/tmp/a.txt"
    assert "value-never-traced" not in json.dumps(api.get(f"/traces/{trace_id}").json())
    # The caller's trace is found from the sandbox too.
    assert trace_id in [t["trace_id"] for t in api.get("/traces", params={"sandbox": sb["id"]}).json()]


def test_a_harness_run_is_one_trace_named_by_the_run(api, minimal_image):
    body = {"name": "traced", "agent": "custom", "command": 'echo "tp=$TRACEPARENT"', "image": "minimal",
            "disk_mb": 256, "memory_mb": 512}  # fmt: skip
    r = api.post("/harnesses", json=body)
    assert r.status_code == 201, r.text
    h = wait_status(api, r.json()["id"], "running")
    r = api.post(f"/harnesses/{h['id']}/runs", json={"prompt": "say hi"})
    assert r.status_code in (200, 201, 202), r.text
    run = wait_run(api, r.json()["id"])
    assert run["status"] == "succeeded", run
    trace_id = run["trace_id"]
    assert len(trace_id) == 32

    # No repository: the workspace has no tree to diff, so no run.diff (the harness tests' runs have one).
    spans = _trace(api, trace_id, {"invoke_agent", "run.setup", "process.start", "run.agent"})
    root = spans["invoke_agent"]
    assert root["parent_span_id"] is None and root["attributes"]["hangar.run.id"] == run["id"]
    assert root["attributes"]["hangar.harness.id"] == h["id"] and root["status"]["code"] != "error"
    for name in ("run.setup", "process.start", "run.agent"):
        assert spans[name]["parent_span_id"] == root["span_id"], name
    assert spans["exec"]["parent_span_id"] == spans["run.setup"]["span_id"]  # the workspace's tree, read
    # The agent's process was told the run's root span.
    output = "".join(line for line in api.get(f"/runs/{run['id']}/logs").text.splitlines() if "tp=" in line)
    assert f"tp=00-{trace_id}-{root['span_id']}-01" in output, output
    listed = api.get("/traces", params={"run": run["id"]}).json()
    assert [t["trace_id"] for t in listed] == [trace_id]


# A scripted agent that exports one span of its own over OTLP/JSON, with bash alone (the minimal
# image has no curl): to $OTEL_EXPORTER_OTLP_ENDPOINT/v1/traces with the run's token, under the
# run's root span that $TRACEPARENT names, as an OpenTelemetry SDK in the agent would.
EXPORTING_AGENT = r"""
tp=${TRACEPARENT#00-}; trace=${tp%%-*}; rest=${tp#*-}; parent=${rest%%-*}
start=${EPOCHREALTIME/./}000; sleep 0.05; end=${EPOCHREALTIME/./}000
body='{"resourceSpans":[{"resource":{"attributes":[{"key":"service.name","value":{"stringValue":"scripted-agent"}}]},
"scopeSpans":[{"scope":{"name":"scripted"},"spans":[{"traceId":"'$trace'","spanId":"00f067aa0ba902b7",
"parentSpanId":"'$parent'","name":"chat scripted-model","kind":3,"startTimeUnixNano":"'$start'",
"endTimeUnixNano":"'$end'","attributes":[{"key":"gen_ai.operation.name","value":{"stringValue":"chat"}},
{"key":"gen_ai.request.model","value":{"stringValue":"scripted-model"}}]}]}]}]}'
u=${OTEL_EXPORTER_OTLP_ENDPOINT#http://}; hp=${u%%/*}; host=${hp%:*}; port=${hp#*:}; base=/${u#*/}
[ "$base" = "/$u" ] && base=/
exec 3<>"/dev/tcp/$host/$port" || exit 9
printf 'POST %sv1/traces HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s' \
  "${base%/}/" "$hp" "$HANGAR_API_TOKEN" "${#body}" "$body" >&3
head -n 1 <&3
"""


def test_an_agent_s_own_spans_join_its_run_s_trace(api, minimal_image):
    body = {"name": "exporting", "agent": "custom", "command": "bash /tmp/agent.sh", "image": "minimal",
            "disk_mb": 256, "memory_mb": 512}  # fmt: skip
    r = api.post("/harnesses", json=body)
    assert r.status_code == 201, r.text
    h = wait_status(api, r.json()["id"], "running")
    r = api.put(f"/sandboxes/{h['sandbox']}/files", params={"path": "/tmp/agent.sh"}, content=EXPORTING_AGENT)
    assert r.status_code in (200, 201), r.text
    r = api.post(f"/harnesses/{h['id']}/runs", json={"prompt": "say hi"})
    assert r.status_code in (200, 201, 202), r.text
    run = wait_run(api, r.json()["id"])
    logs = api.get(f"/runs/{run['id']}/logs").text
    assert run["status"] == "succeeded", (run, logs)
    assert "HTTP/1.1 200" in logs, logs  # what Hangar's OTLP endpoint answered the agent

    spans = _trace(api, run["trace_id"], {"invoke_agent", "run.agent", "chat scripted-model"})
    chat, root = spans["chat scripted-model"], spans["invoke_agent"]
    assert chat["parent_span_id"] == root["span_id"]
    assert chat["attributes"]["gen_ai.request.model"] == "scripted-model"
    assert chat["resource"]["service.name"] == "scripted-agent", chat
    assert [t["trace_id"] for t in api.get("/traces", params={"run": run["id"]}).json()] == [run["trace_id"]]


def test_a_sandbox_s_other_operations_are_each_a_span_tied_to_it(api):
    """Files read, a terminal opened, a pause, a resume and the delete: each a trace of its own
    (no traceparent), its root span named for the operation and tied to the sandbox."""
    sb = api.post("/sandboxes", json={"image": "busybox", "memory_mb": 256}).json()
    sid = sb["id"]
    assert sb["status"] == "running", sb
    assert api.put(f"/sandboxes/{sid}/files", params={"path": "/tmp/a.txt"}, content=b"a").status_code == 200
    assert api.get(f"/sandboxes/{sid}/files", params={"path": "/tmp/a.txt"}).content == b"a"
    term = api.post(f"/sandboxes/{sid}/terminals", json={"cmd": ["sh"]})
    assert term.status_code == 201, term.text
    assert api.post(f"/sandboxes/{sid}/pause", json={"wait": True}).json()["status"] == "paused"
    assert api.post(f"/sandboxes/{sid}/resume", json={"wait": True}).json()["status"] == "running"
    assert api.delete(f"/sandboxes/{sid}").status_code == 204
    for name in (
        "file.write",
        "file.read",
        "terminal.open",
        "sandbox.pause",
        "sandbox.resume",
        "sandbox.delete",
    ):
        root = _traces_of(api, sid, name)[0]
        spans = _trace(api, root["trace_id"], {name})
        assert spans[name]["attributes"]["hangar.sandbox.id"] == sid, name
        assert spans[name]["parent_span_id"] is None and spans[name]["status"]["code"] != "error", name
    assert (
        _trace(api, _traces_of(api, sid, "file.read")[0]["trace_id"], {"file.read"})["file.read"][
            "attributes"
        ]["file.path"]
        == "/tmp/a.txt"
    )
