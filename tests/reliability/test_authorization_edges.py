"""Who may call what beside the REST API: the E2B control-plane API (its operations read from its
router, so a new one missing from the table fails here) and its catch-all, envd (the in-sandbox
API and its per-sandbox access token), the MCP tools, OTLP ingest and preview URLs, each against
every kind of caller. Each surface's expected outcome is written here, in one table, as a user
would expect it (viewers read, members change), not read from the production rules: a loosened
rule fails a cell."""

from __future__ import annotations

import json
import re
import secrets
import struct
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from unittest import mock

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from runtime.models import ApiToken, Harness, Membership, Run, Sandbox, Team
from runtime.services import auth as auth_svc

ROLES = ("viewer", "member", "admin", "owner")
DEAD = ("no token", "garbage", "expired", "revoked", "a member who left")
# The role a caller acts as, where its name does not say it.
ACTS_AS = {"staff member": "member", "owner's viewer token": "viewer", "another team's owner": "owner",
           "read-only scope": "owner"}  # fmt: skip
MISSING_SB = "sbnosuch0000000000000"
THEIRS, OUTSIDER = "another team's", "another team's owner"


@dataclass(frozen=True)
class Caller:
    raw: str | None  # what it sends as its API token (None: nothing)
    token_id: int | None  # that token's row (None: no token, garbage)
    team: str  # the team whose objects are its own


@pytest.fixture
def callers(transactional_db) -> dict[str, Caller]:
    """As test_authorization.py's, with each token's row (envd's access tokens are bound to it)."""
    User = get_user_model()
    team = Team.objects.create(name="matrix")
    other = Team.objects.create(name="elsewhere")
    out = {
        "no token": Caller(None, None, "matrix"),
        "garbage": Caller("hgr_not-a-real-token", None, "matrix"),
    }

    def issue(caller: str, user: Any, t: Team = team, **kw: Any) -> auth_svc.IssuedToken:
        made = auth_svc.token_create(user=user, team=t, **kw)
        out[caller] = Caller(made.raw, made.token.id, t.name)
        return made

    for role in ROLES:
        user = User.objects.create_user(username=f"u-{role}", password=None)
        Membership.objects.create(user=user, team=team, role=role)
        issue(role, user, name=role)
    staff = User.objects.create_user(username="u-staff", password=None, is_staff=True)
    Membership.objects.create(user=staff, team=team, role="member")
    issue("staff member", staff)
    owner = User.objects.get(username="u-owner")
    issue("owner's viewer token", owner, role="viewer")
    issue("read-only scope", owner, scopes=["sandboxes:read"])
    expired = issue("expired", owner, expires_in_s=60)
    ApiToken.objects.filter(id=expired.token.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    revoked = issue("revoked", owner)
    ApiToken.objects.filter(id=revoked.token.id).update(revoked_at=timezone.now())
    outsider = User.objects.create_user(username="u-outsider", password=None)
    Membership.objects.create(user=outsider, team=other, role="owner")
    issue("another team's owner", outsider, other)
    gone = User.objects.create_user(username="u-left", password=None)
    Membership.objects.create(user=gone, team=team, role="admin")
    issue("a member who left", gone)
    Membership.objects.filter(user=gone).delete()
    return out


def want(caller: str, spec: str) -> str:
    """401, 403 or allowed for ``caller`` under ``spec`` ("member sandboxes:write": least role, scope)."""
    role, scope = spec.split()
    if caller in DEAD:
        return "401"
    if caller == "read-only scope" and scope != "sandboxes:read":
        return "403"
    return "allowed" if ROLES.index(ACTS_AS.get(caller, caller)) >= ROLES.index(role) else "403"


def _sandbox(team: Team, status: str = "paused", **kw: Any) -> Sandbox:
    return Sandbox.objects.create(team=team, image="busybox", image_digest="sha256:" + "a" * 64, status=status,
                                  **kw)  # fmt: skip


def _state() -> list[Any]:
    """What a refused call must leave as it was: every sandbox's state, ports and expiry, the runs."""
    rows = Sandbox.objects.order_by("id").values_list("id", "status", "ports", "expires_at")
    return [list(rows), Run.objects.count()]


def _same(text: str, *ids: str) -> str:
    return re.sub("|".join(map(re.escape, ids)), "<id>", text)


# -- the E2B control-plane API (/e2b/) ---------------------------------------------------------------

SB = "/sandboxes/{sandbox_id}"
E2B_EXPECTED = {
    ("POST", "/sandboxes"): "member sandboxes:write", ("POST", "/v2/sandboxes"): "member sandboxes:write",
    ("GET", "/sandboxes"): "viewer sandboxes:read", ("GET", "/v2/sandboxes"): "viewer sandboxes:read",
    ("GET", SB): "viewer sandboxes:read", ("DELETE", SB): "member sandboxes:write",
    ("POST", f"{SB}/timeout"): "member sandboxes:write", ("POST", f"{SB}/pause"): "member sandboxes:write",
    ("POST", f"{SB}/resume"): "member sandboxes:write", ("POST", f"{SB}/connect"): "member sandboxes:write",
    ("POST", f"/v2{SB}/connect"): "member sandboxes:write", ("GET", f"{SB}/metrics"): "viewer sandboxes:read",
}  # fmt: skip
# Bodies an allowed call gets past validation with (a template that does not exist: no sandbox made).
E2B_BODY: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/sandboxes"): {"templateID": "no-such-template"}, ("POST", "/v2/sandboxes"): {"templateID": "no-such-template"},
    ("POST", f"{SB}/timeout"): {"timeout": 60}, ("POST", f"{SB}/connect"): {"timeout": 60},
    ("POST", f"/v2{SB}/connect"): {"timeout": 60},
}  # fmt: skip


def e2b_operations() -> list[tuple[str, str]]:
    from dashboard.e2b.api import api

    return sorted(
        (method, f"{prefix}{path}")
        for prefix, router in api._routers
        for path, view in router.path_operations.items()
        for op in view.operations
        for method in op.methods
    )


def test_the_e2b_table_names_every_operation_of_the_e2b_api():
    ops = set(e2b_operations())
    assert not ops - set(E2B_EXPECTED), f"operations missing from E2B_EXPECTED: {ops - set(E2B_EXPECTED)}"
    assert not set(E2B_EXPECTED) - ops, f"E2B_EXPECTED names what is gone: {set(E2B_EXPECTED) - ops}"


def _e2b(client: Client, method: str, path: str, raw: str | None, body: Any = None) -> tuple[int, str, str]:
    """(status, the error's message, the whole body) of one call."""
    headers = {"HTTP_X_API_KEY": raw} if raw else {}
    r = client.generic(method, "/e2b" + path, json.dumps(body or {}), "application/json", **headers)
    text = r.content.decode(errors="replace")
    try:
        doc = json.loads(text)
    except ValueError:
        doc = {}
    return r.status_code, str(doc.get("message", "")) if isinstance(doc, dict) else "", text


def test_the_e2b_api_matrix(callers, report):
    """Every operation x caller; where it names a sandbox, at the caller's own team's (reached:
    anything but a refusal, a "no sandbox" or a 5xx), another team's and a nonexistent one (both
    the same 404, word for word), and nothing changes but what an allowed caller asked of its own."""
    client = Client()
    teams = {t.name: t for t in Team.objects.all()}
    for team in teams.values():  # one running, one paused: what a list would show if it leaked
        _sandbox(team, status="running"), _sandbox(team)
    failures, cells = [], 0
    for (method, path), spec in sorted(E2B_EXPECTED.items()):
        body = E2B_BODY.get((method, path), {})
        for name, caller in callers.items():
            expect = want(name, spec)
            if "{sandbox_id}" not in path:
                before = _state()
                got, message, text = _e2b(client, method, path, caller.raw, body)
                cells += 1
                ok = str(got) == expect if expect != "allowed" else got not in (401, 403) and got < 500
                foreign = Sandbox.objects.exclude(team__name=caller.team).values_list("id", flat=True)
                if any(i in text for i in foreign):
                    ok, message = False, f"lists another team's sandbox: {message}"
                if not ok or _state() != before:
                    failures.append(f"{name:>22}  {method:6} {path}: {got} (want {expect}) {message[:100]}")
                continue
            mine = _sandbox(teams[caller.team])
            theirs = _sandbox(next(t for n, t in teams.items() if n != caller.team))
            answers = {}
            for whose, sid in ((THEIRS, theirs.id), ("nonexistent", MISSING_SB), ("own", mine.id)):
                before = _state()
                got, message, _ = _e2b(client, method, path.replace("{sandbox_id}", sid), caller.raw, body)
                cells += 1
                answers[whose] = (got, _same(message, sid))
                if expect != "allowed":
                    ok = str(got) == expect and _state() == before  # refused before any lookup
                elif whose == "own":
                    ok = got not in (401, 403) and got < 500 and not (got == 404 and "no sandbox" in message)
                else:
                    ok = got == 404 and _state() == before
                if not ok:
                    failures.append(f"{name:>22} {whose:>15}  {method:6} {path}: {got} (want {expect}) {message[:100]}")  # fmt: skip
            if answers[THEIRS] != answers["nonexistent"]:
                failures.append(f"{name:>22} {method:6} {path}: another team's sandbox answers "
                                f"{answers[THEIRS]}, a missing one {answers['nonexistent']}")  # fmt: skip
    assert not failures, f"{len(failures)} of {cells} cells:\n" + "\n".join(failures)
    report.held("authorization", "E2B API: operation x caller x sandbox (own, another team's, nonexistent)",
                cells=cells)  # fmt: skip


def test_the_e2b_catch_all_answers_everyone_alike_and_tells_nothing(callers, report):
    """Paths under /e2b that no operation serves answer without looking at the key (a 400 naming
    the unsupported feature, or a 404): the same words whoever asks, whichever sandbox the path
    names, so it tells no one whether a sandbox exists."""
    matrix, elsewhere = Team.objects.get(name="matrix"), Team.objects.get(name="elsewhere")
    ids = {"own": _sandbox(matrix).id, THEIRS: _sandbox(elsewhere).id, "nonexistent": MISSING_SB}
    paths = {"/templates": 400, "/v2/templates/base": 400, f"{SB}/logs": 400, f"{SB}/snapshots": 400,
             f"{SB}/fork": 400, "/volumes": 400, "/secrets": 400, "/api-keys": 400, "/nosuch": 404,
             f"{SB}/nosuch": 404}  # fmt: skip
    client = Client()
    failures, cells = [], 0
    for path, status in paths.items():
        for method in ("GET", "POST", "DELETE"):
            seen = set()
            for name in ("no token", "garbage", "revoked", "viewer", "member", "another team's owner"):
                for sid in ids.values():
                    url = path.replace("{sandbox_id}", sid)
                    got, message, _ = _e2b(client, method, url, callers[name].raw)
                    cells += 1
                    seen.add((got, _same(message, sid)))
            if len(seen) != 1 or next(iter(seen))[0] != status:
                failures.append(f"{method} {path}: {sorted(seen)} (want one answer, {status})")
    assert not failures, "\n".join(failures)
    report.held("authorization", "E2B catch-all: unserved path x caller x sandbox: one answer each, no key "
                "needed, nothing told", cells=cells)  # fmt: skip


# -- envd (/e2b/envd/): the sandbox's access token ------------------------------------------------

# envd runs commands and touches files in the sandbox: every call of it is a command's right,
# reads included (a member's, with sandboxes:write), and /health is no exception.
ENVD_EXPECTED = dict.fromkeys([
    "POST process.Process/List", "POST process.Process/SendInput", "POST process.Process/SendSignal",
    "POST process.Process/CloseStdin", "POST process.Process/Update", "POST process.Process/StreamInput",
    "POST process.Process/Start", "POST process.Process/Connect", "POST filesystem.Filesystem/Stat",
    "POST filesystem.Filesystem/MakeDir", "POST filesystem.Filesystem/Move", "POST filesystem.Filesystem/ListDir",
    "POST filesystem.Filesystem/Remove", "POST filesystem.Filesystem/CreateWatcher",
    "POST filesystem.Filesystem/GetWatcherEvents", "POST filesystem.Filesystem/RemoveWatcher",
    "POST filesystem.Filesystem/WatchDir", "GET files", "POST files", "GET health",
], "member sandboxes:write")  # fmt: skip
CODE = {401: "unauthenticated", 403: "permission_denied"}


def envd_operations() -> list[str]:
    from dashboard.e2b.envd import views

    rpcs = [*views.UNARY, *views.CLIENT_STREAM, *views.SERVER_STREAM]
    plain = [str(p.pattern) for p in views.urlpatterns if "<" not in str(p.pattern)]
    return sorted([f"POST {m}" for m in rpcs] + [f"GET {p}" for p in plain] + ["POST files"])


def test_the_envd_table_names_every_call_of_envd():
    assert sorted(ENVD_EXPECTED) == envd_operations()


def _access_token(caller: Caller, sandbox_id: str) -> str | None:
    """The envd access token bound to the caller's API token for ``sandbox_id``, made as the
    server makes it (for a viewer too: one made before a demotion must stop working)."""
    from dashboard.e2b.tokens import _mac

    if caller.token_id is None:
        return caller.raw
    return f"{caller.token_id}.{_mac(sandbox_id, caller.token_id)}"


def _envd(client: Client, op: str, sandbox_id: str, access: str | None) -> tuple[str, str]:
    """(the Connect code, or "ok"; the message) of one call."""
    from dashboard.e2b.envd import views
    from dashboard.e2b.envd.protocol import envelope

    method, name = op.split(" ")
    headers = {"HTTP_E2B_SANDBOX_ID": sandbox_id, **({"HTTP_X_ACCESS_TOKEN": access} if access else {})}
    if name in views.SERVER_STREAM or name in views.CLIENT_STREAM:
        data, ctype = envelope({}), "application/connect+json"
    elif name == "files":
        data, ctype = b"x", "application/octet-stream"
        name += "?path=/tmp/probe" if method == "POST" else "?path=/etc/hostname"
    else:
        data, ctype = b"{}", "application/json"
    r = client.generic(method, f"/e2b/envd/{name}", data if method == "POST" else b"", ctype, **headers)
    body = b"".join(r.streaming_content) if r.streaming else r.content
    if r.get("Content-Type", "").startswith("application/connect+json"):
        at, end = 0, {}
        while at + 5 <= len(body):
            flags, size = struct.unpack(">BI", body[at : at + 5])
            if flags & 0x02:
                end = json.loads(body[at + 5 : at + 5 + size])
            at += 5 + size
        error = end.get("error") or {}
        return error.get("code", "ok"), error.get("message", "")
    doc = json.loads(body) if body.startswith(b"{") else {}
    code = doc.get("code", "ok" if r.status_code < 400 else str(r.status_code))
    return (CODE.get(code, str(code)) if isinstance(code, int) else code), str(doc.get("message", ""))


def test_the_envd_matrix(callers, report):
    """Every envd call x caller, with an access token made for: the caller's own team's sandbox
    (reached where the table allows it: a paused sandbox answers that it is not running, never a
    refusal), that token sent for another sandbox of the same team, and a token made for another
    team's sandbox or a nonexistent one (refused alike, word for word)."""
    teams = {t.name: t for t in Team.objects.all()}
    sandboxes = {name: (_sandbox(t), _sandbox(t)) for name, t in teams.items()}
    client = Client()
    failures, cells = [], 0
    for name, caller in callers.items():
        (a, b), theirs = sandboxes[caller.team], next(s for n, s in sandboxes.items() if n != caller.team)[0]
        for op, spec in ENVD_EXPECTED.items():
            expect = want(name, spec)
            before = _state()
            code, message = _envd(client, op, a.id, _access_token(caller, a.id))
            cells += 1
            reached = code not in (*CODE.values(), "internal", "unknown", "not_found")
            ok = reached if expect == "allowed" else code == CODE[int(expect)]
            if not ok:
                failures.append(f"{name:>22}  own sandbox    {op}: {code} (want {expect}) {message[:100]}")
            # The token of sandbox A never opens sandbox B, whoever it was made for.
            code, message = _envd(client, op, b.id, _access_token(caller, a.id))
            cells += 1
            if code != "unauthenticated":
                failures.append(f"{name:>22}  A's token on B {op}: {code} {message[:100]}")
            answers = []
            for sid in (theirs.id, MISSING_SB):
                code, message = _envd(client, op, sid, _access_token(caller, sid))
                cells += 1
                answers.append((code, _same(message, sid)))
                if code not in CODE.values():
                    failures.append(f"{name:>22}  {sid} {op}: {code} {message[:100]}")
            if answers[0] != answers[1]:
                failures.append(f"{name:>22}  {op}: another team's sandbox {answers[0]}, a missing one {answers[1]}")  # fmt: skip
            if _state() != before:
                failures.append(f"{name:>22}  {op}: a sandbox changed")
    assert not failures, f"{len(failures)} of {cells} cells:\n" + "\n".join(failures)
    report.held("authorization", "envd: call x caller x access token (own sandbox, another sandbox of the "
                "team, another team's, nonexistent)", cells=cells)  # fmt: skip


# -- MCP (/mcp, the real server) ------------------------------------------------------------------

MCP_EXPECTED = {
    "create_sandbox": "member sandboxes:write", "list_sandboxes": "viewer sandboxes:read",
    "run_command": "member sandboxes:write", "write_file": "member sandboxes:write",
    "read_file": "viewer sandboxes:read", "list_files": "viewer sandboxes:read",
    "get_preview_url": "viewer sandboxes:read",  # of a port that has its URL already
    "get_preview_url, a port without a URL": "member sandboxes:write",  # giving it one is a change
    "pause_sandbox": "member sandboxes:write", "resume_sandbox": "member sandboxes:write",
    "delete_sandbox": "member sandboxes:write",
    "start_run": "member harnesses:write", "get_run": "viewer harnesses:read",
}  # fmt: skip
MCP_ARGS: dict[str, dict[str, Any]] = {
    "create_sandbox": {"image": "no-such-image"}, "list_sandboxes": {},
    "run_command": {"sandbox_id": "{sb}", "command": "true"},
    "write_file": {"sandbox_id": "{sb}", "path": "/tmp/probe", "content": "x"},
    "read_file": {"sandbox_id": "{sb}", "path": "/etc/hostname"}, "list_files": {"sandbox_id": "{sb}", "path": "/"},
    "get_preview_url": {"sandbox_id": "{sb}", "port": 8000}, "pause_sandbox": {"sandbox_id": "{sb}"},
    "resume_sandbox": {"sandbox_id": "{sb}"}, "delete_sandbox": {"sandbox_id": "{sb}"},
    "start_run": {"harness": "{harness}", "prompt": "say hello"}, "get_run": {"run_id": "{run}"},
    "get_preview_url, a port without a URL": {"sandbox_id": "{sb}", "port": 9000},
}  # fmt: skip
# Whether a port needs its URL made (a member's change) is known once its sandbox is found: a
# viewer asking it of another team's sandbox or a missing one hears "no sandbox", alike for both.
LOOKUP_FIRST = {"get_preview_url, a port without a URL"}
REFUSED = re.compile(r"lacks the scope|this needs (member|admin|owner) or above")
NOT_FOUND = re.compile(r"no (sandbox|harness|run) ")


def test_the_mcp_table_names_every_tool():
    from dashboard.mcp.tools import tools

    assert {name.split(",")[0] for name in MCP_EXPECTED} == set(tools())


def _objects(team: Team) -> dict[str, str]:
    """A paused sandbox with port 8000's URL, a harness whose setup failed (a run of it is refused
    at once, no task queued) and a finished run of it."""
    sb = _sandbox(team, ports=[{"port": 8000, "public": False}])
    h = Harness.objects.create(team=team, name=f"h-{secrets.token_hex(4)}", agent="custom", image="busybox",
                               sandbox=_sandbox(team, status="failed"), setup="failed")  # fmt: skip
    run = Run.objects.create(harness=h, prompt="p", status="succeeded")
    return {"sb": sb.id, "harness": h.id, "run": run.id}


def _mcp(http: httpx.Client, raw: str | None, tool: str, args: dict[str, Any]) -> tuple[int, bool, str]:
    """(HTTP status, whether the tool answered an error, its text) of one tools/call."""
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    if raw:
        headers["Authorization"] = f"Bearer {raw}"
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": tool, "arguments": args}}
    r = http.post("/mcp", json=call, headers=headers)
    if r.status_code != 200:
        return r.status_code, True, r.text[:200]
    doc = r.json()
    result = doc.get("result") or {"isError": True, "content": [{"type": "text", "text": json.dumps(doc)}]}
    text = "\n".join(c.get("text", "") for c in result.get("content", []))
    return 200, bool(result.get("isError")), text


def test_the_mcp_matrix(callers, server, report):
    """Every tool x caller through /mcp at the caller's own team's sandbox, harness or run (reached
    where allowed), another team's and a nonexistent one (one error, word for word). A dead token is
    a 401 before any MCP message; a refused tool, a tool error that says why, changing nothing."""
    teams = {t.name: t for t in Team.objects.all()}
    missing = {"sb": MISSING_SB, "harness": "no-such-harness", "run": "runmissing0000000"}
    failures, cells = [], 0
    with httpx.Client(base_url=server, timeout=30) as http:
        for name, caller in callers.items():
            own_team = teams[caller.team]
            other_team = next(t for n, t in teams.items() if n != caller.team)
            kept = {"own": _objects(own_team), THEIRS: _objects(other_team), "nonexistent": missing}
            for tool, spec in MCP_EXPECTED.items():
                expect = want(name, spec)
                template = MCP_ARGS[tool]
                fresh = tool == "delete_sandbox"  # the one tool that leaves nothing for the next
                objects = [("own", _objects(own_team) if fresh else kept["own"])]
                if any("{" in str(v) for v in template.values()):
                    objects = [(THEIRS, _objects(other_team) if fresh else kept[THEIRS]),
                               ("nonexistent", missing), *objects]  # fmt: skip
                answers = {}
                for whose, ids in objects:
                    args = {k: v.format(**ids) if isinstance(v, str) else v for k, v in template.items()}
                    before = _state()
                    status, is_error, text = _mcp(http, caller.raw, tool.split(",")[0], args)
                    cells += 1
                    answers[whose] = (status, is_error, _same(text, *ids.values()))
                    if expect == "401":
                        ok = status == 401
                    elif expect == "403" and (whose == "own" or tool not in LOOKUP_FIRST):
                        ok = status == 200 and is_error and bool(REFUSED.search(text))
                    elif whose == "own":  # reached; and a list shows the caller's own team's only
                        leaks = any(i in text for i in kept[THEIRS].values())
                        ok = status == 200 and not REFUSED.search(text) and not NOT_FOUND.search(text)
                        ok = ok and "failed on the server" not in text and not leaks
                    else:
                        ok = status == 200 and is_error and bool(NOT_FOUND.search(text))
                    if (expect != "allowed" or whose != "own") and _state() != before:
                        ok = False
                        text += " [and it changed something]"
                    if not ok:
                        failures.append(f"{name:>22} {whose:>15}  {tool}: {status} {is_error} (want {expect}) {text[:120]}")  # fmt: skip
                if "nonexistent" in answers and answers[THEIRS] != answers["nonexistent"]:
                    failures.append(f"{name:>22}  {tool}: another team's {answers[THEIRS]}, "
                                    f"a missing one {answers['nonexistent']}")  # fmt: skip
    assert not failures, f"{len(failures)} of {cells} cells:\n" + "\n".join(failures)
    report.held(
        "authorization", "MCP: tool x caller x object (own, another team's, nonexistent)", cells=cells
    )


# -- OTLP ingest ----------------------------------------------------------------------------------

OTLP_EXPECTED = {path: "member traces:write" for path in
                 ("/v1/traces", "/v1/logs", "/api/v1/otlp/v1/traces", "/api/v1/otlp/v1/logs")}  # fmt: skip


def test_the_otlp_table_names_every_ingest_route():
    from django.urls import get_resolver

    from dashboard import otlp

    routes = {f"/{p.pattern}" for p in get_resolver().url_patterns if getattr(p, "callback", None) in
              (otlp.traces, otlp.logs)}  # fmt: skip
    assert routes == set(OTLP_EXPECTED)


def _otlp_body(path: str, marker: str, foreign_sandbox: str) -> dict[str, Any]:
    # A resource naming another team's sandbox: where a span lands is the token's word alone.
    resource = {"attributes": [{"key": "service.name", "value": {"stringValue": "matrix"}},
                               {"key": "hangar.sandbox.id", "value": {"stringValue": foreign_sandbox}}]}  # fmt: skip
    now = str(time.time_ns())
    if path.endswith("traces"):
        span = {"traceId": marker, "spanId": marker[:16], "name": "probe", "kind": 1,
                "startTimeUnixNano": now, "endTimeUnixNano": now}  # fmt: skip
        return {"resourceSpans": [{"resource": resource, "scopeSpans": [{"spans": [span]}]}]}
    record = {"timeUnixNano": now, "body": {"stringValue": marker}, "traceId": marker}
    return {"resourceLogs": [{"resource": resource, "scopeLogs": [{"logRecords": [record]}]}]}


def test_the_otlp_matrix(callers, report):
    """Every route x caller: 401 for a missing, unknown, expired or revoked token (or a member
    who left); 403 without traces:write or below member; 200 otherwise, and what was sent lands
    in the caller's own team only, whatever sandbox its resource names."""
    from runtime.models import Trace, TraceLog, TraceSpan

    sandboxes = {t.name: _sandbox(t) for t in Team.objects.all()}
    client = Client()
    failures, cells = [], 0
    for path, spec in OTLP_EXPECTED.items():
        for name, caller in callers.items():
            expect = want(name, spec)
            marker = secrets.token_hex(16)
            foreign = next(sb.id for team, sb in sandboxes.items() if team != caller.team)
            headers = {"HTTP_AUTHORIZATION": f"Bearer {caller.raw}"} if caller.raw else {}
            r = client.post(path, data=json.dumps(_otlp_body(path, marker, foreign)),
                            content_type="application/json", **headers)  # fmt: skip
            cells += 1
            if path.endswith("traces"):
                landed = set(TraceSpan.objects.filter(trace_id=marker).values_list("team__name", flat=True))
                landed |= set(Trace.objects.filter(trace_id=marker).values_list("team__name", flat=True))
            else:
                landed = set(TraceLog.objects.filter(trace_id=marker).values_list("team__name", flat=True))
            ok = landed == {caller.team} if expect == "allowed" else not landed
            ok = ok and str(r.status_code) == ("200" if expect == "allowed" else expect)
            if not ok:
                failures.append(f"{name:>22}  {path}: {r.status_code} (want {expect}), landed in {landed or 'none'} "
                                f"{r.content[:100]!r}")  # fmt: skip
    assert not failures, f"{len(failures)} of {cells} cells:\n" + "\n".join(failures)
    report.held("authorization", "OTLP: route x caller, and the team the data lands in", cells=cells)


# -- preview URLs (the real server: the preview router sits in front of Django) ----------------------

# A private preview of the matrix team's sandbox, by what the request carries. "allowed" is
# reached: past the check, the stopped sandbox's own 503 ("nothing answers"), or the 302 that
# moves a signed link into the host's cookie.
PREVIEW_EXPECTED = {
    "nothing": "401", "a link signed for it": "allowed", "its cookie": "allowed",
    "its cookie, a cross-site POST": "403", "a link signed for it, expired": "401",
    "a link signed for another sandbox": "401", "a link signed for another port": "401",
    "a cookie signed for another sandbox": "401", "a link of another team's sandbox": "401",
    "bearer: viewer": "allowed", "bearer: member": "allowed", "bearer: admin": "allowed", "bearer: owner": "allowed",
    "bearer: staff member": "allowed", "bearer: owner's viewer token": "allowed", "bearer: read-only scope": "allowed",
    "bearer: no token": "401", "bearer: garbage": "401", "bearer: expired": "401", "bearer: revoked": "401",
    "bearer: a member who left": "401", "bearer: another team's owner": "401",
    # A sandbox whose every port is private (E2B's allowPublicTraffic: false) takes the traffic
    # access token its create answered, bound to the API token that asked: alive, of its team.
    "traffic token: member": "allowed", "traffic token: viewer": "allowed", "traffic token: read-only scope": "allowed",
    "traffic token: revoked": "403", "traffic token: another team's owner": "403",
    "traffic token of another sandbox": "403",
}  # fmt: skip


def test_the_preview_matrix(callers, server, report):
    """Every way into a private preview: only the sandbox's own signed link or cookie, its own
    team's live token (a viewer's too: a preview is read), or its own traffic token, gets past
    the check. Another team's token is no better than none: it answers as nothing sent does. (A
    nonexistent sandbox answers 404 to anyone where an existing private one answers 401: the
    preview host is the sandbox's public address, as a public port's is, not a secret.)"""
    from django.conf import settings

    from runtime.services.previews import TRAFFIC_HEADER, sign, traffic_token

    matrix, elsewhere = Team.objects.get(name="matrix"), Team.objects.get(name="elsewhere")
    private = [{"port": 8000, "public": False}]
    sb = _sandbox(matrix, status="stopped", ports=private)
    sibling = _sandbox(matrix, status="stopped", ports=private)
    foreign = _sandbox(elsewhere, status="stopped", ports=private)
    closed = _sandbox(matrix, status="stopped", open_ports="private")
    link = {"a link signed for it": sign(sb.id, 8000), "a link signed for another sandbox": sign(sibling.id, 8000),
            "a link signed for another port": sign(sb.id, 8001), "a link of another team's sandbox": sign(foreign.id, 8000)}  # fmt: skip
    long_ago = time.time() - settings.HANGAR_PREVIEW_TOKEN_TTL_S - 60
    with mock.patch("django.core.signing.time.time", return_value=long_ago):
        link["a link signed for it, expired"] = sign(sb.id, 8000)
    cookie = {"its cookie": sign(sb.id, 8000), "its cookie, a cross-site POST": sign(sb.id, 8000),
              "a cookie signed for another sandbox": sign(sibling.id, 8000)}  # fmt: skip
    failures = []
    with httpx.Client(base_url=server, timeout=30) as http:
        for cell, expect in PREVIEW_EXPECTED.items():
            target, method, query, headers = sb.id, "GET", "", {}
            if cell in link:
                query = f"?hangar_token={link[cell]}"
            elif cell in cookie:
                headers["Cookie"] = f"hangar_preview={cookie[cell]}"
                if "POST" in cell:
                    method, headers["Origin"] = "POST", "http://attacker.example"
            elif cell.startswith("bearer: "):
                raw = callers[cell.removeprefix("bearer: ")].raw
                headers.update({"Authorization": f"Bearer {raw}"} if raw else {})
            elif cell.startswith("traffic token"):
                target = closed.id
                who = cell.removeprefix("traffic token: ") if ": " in cell else "member"
                bound = sibling.id if "another sandbox" in cell else closed.id
                headers[TRAFFIC_HEADER] = traffic_token(bound, callers[who].token_id or 0)
            headers["Host"] = f"8000-{target}.localhost"
            http.cookies.clear()  # a cell's own cookie only, never one an earlier 302 set
            r = http.request(method, f"/{query}", headers=headers, follow_redirects=False)
            # Past the check: a signed link is traded for the preview's cookie (a 302 to the same
            # page without the token); anything else reaches the sandbox (stopped here: a 503).
            if cell in link:
                reached = (r.status_code == 302 and "hangar_token" not in r.headers.get("location", "")
                           and "hangar_preview=" in r.headers.get("set-cookie", ""))  # fmt: skip
            else:
                reached = r.status_code == 503 and "is stopped" in r.text
            ok = reached if expect == "allowed" else str(r.status_code) == expect
            if not ok:
                title = re.search(r"<h1>(.*?)</h1>", r.text)
                failures.append(f"{cell:>40}: {r.status_code} (want {expect}) {title and title.group(1)}")
        # Another team's token is no better than none, on the page it gets too.
        page = {}
        for name in ("no token", OUTSIDER):
            raw, _ = callers[name].raw, http.cookies.clear()
            auth = {"Authorization": f"Bearer {raw}"} if raw else {}
            r = http.get("/", headers={"Host": f"8000-{sb.id}.localhost", **auth})
            page[name] = (r.status_code, r.text)
        if page["no token"] != page[OUTSIDER]:
            failures.append(f"another team's token answers {page[OUTSIDER][0]}, none {page['no token'][0]}")
    assert not failures, "\n".join(failures)
    report.held("authorization", "preview URLs: credential (signed link, cookie, each caller's token, "
                "traffic token) x a private preview", cells=len(PREVIEW_EXPECTED) + 2)  # fmt: skip
