"""E2B's control plane, driven by the real ``e2b`` SDK from PyPI (sync and async) against the
real server, worker and runsc sandboxes: what code written for E2B does, it does on Hangar."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    AuthenticationException,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxQuery,
    SandboxState,
)

from dashboard.e2b.schemas import domain
from dashboard.e2b.tokens import ENVD_VERSION, envd_access_token, envd_access_token_owner
from tests.support import requires_runsc, wait_until


def _token(raw: str):
    from runtime.services.auth import token_authenticate

    return token_authenticate(raw)


def _hangar(api, sandbox_id: str) -> dict:
    r = api.get(f"/sandboxes/{sandbox_id}")
    assert r.status_code == 200, r.text
    return r.json()


def _env_of(api, sandbox_id: str, name: str) -> str:
    r = api.post(f"/sandboxes/{sandbox_id}/exec", json={"cmd": f'printf %s "${name}"'})
    assert r.status_code == 200, r.text
    return r.json()["stdout"]


# -- no server needed ---------------------------------------------------------------------------


def test_envd_access_tokens_are_per_sandbox_and_caller_and_only_for_those_who_may_exec(settings):
    from types import SimpleNamespace

    member = SimpleNamespace(pk=7, scopes=[], effective_role="member")
    token = envd_access_token("sbx-one", member)
    assert token is not None and token.startswith("7.")
    assert token == envd_access_token("sbx-one", member) and token != envd_access_token("sbx-two", member)
    assert token != envd_access_token("sbx-one", SimpleNamespace(pk=8, scopes=[], effective_role="member"))
    assert envd_access_token_owner("sbx-one", token) == 7  # whose rights the in-sandbox API checks
    assert envd_access_token_owner("sbx-two", token) is None
    assert envd_access_token_owner("sbx-one", "8." + token.split(".", 1)[1]) is None  # another token's id
    assert envd_access_token_owner("sbx-one", "") is None
    # No way into a sandbox's commands for those who may not run them.
    assert envd_access_token("sbx-one", SimpleNamespace(pk=9, scopes=[], effective_role="viewer")) is None
    reader = SimpleNamespace(pk=9, scopes=["sandboxes:read"], effective_role="owner")
    assert envd_access_token("sbx-one", reader) is None
    settings.SECRET_KEY = "another key"
    assert envd_access_token_owner("sbx-one", token) is None  # a new SECRET_KEY voids them all


def test_every_e2b_endpoint_has_a_permission_rule():
    from dashboard.e2b.api import api as e2b_api
    from dashboard.e2b.auth import RULES

    ops = {
        (method, f"{prefix}{path}")
        for prefix, router in e2b_api._routers
        for path, path_view in router.path_operations.items()
        for op in path_view.operations
        for method in op.methods
    }
    assert ops == set(RULES), (sorted(ops - set(RULES)), sorted(set(RULES) - ops))


# -- the sync SDK ------------------------------------------------------------------------------


@requires_runsc
def test_create_with_metadata_and_envs_then_info_timeout_metrics_and_kill(e2b, api, team_token):
    sbx = Sandbox.create("busybox", metadata={"owner": "ci", "odd key": "a&b=c"}, envs={"FOO": "bar baz"},
                         timeout=120, allow_internet_access=False)  # fmt: skip
    sid = sbx.sandbox_id
    row = _hangar(api, sid)
    assert row["status"] == "running" and row["image"] == "busybox"
    assert row["metadata"] == {"owner": "ci", "odd key": "a&b=c"}
    assert row["network"] == {} and row["timeout_s"] == 120  # no internet access: no network at all
    assert _env_of(api, sid, "FOO") == "bar baz"
    # What the SDK keeps for the envd slice: the version it switches features on, the token.
    assert str(sbx._envd_version) == ENVD_VERSION and sbx._envd_access_token == envd_access_token(
        sid, _token(team_token)
    )
    assert sbx.sandbox_domain == domain() and sbx.get_host(8000) == f"8000-{sid}.{domain()}"

    info = sbx.get_info()
    assert info.sandbox_id == sid and info.template_id == "busybox" and info.name == "busybox"
    assert info.metadata == {"owner": "ci", "odd key": "a&b=c"} and info.state == SandboxState.RUNNING
    assert info.cpu_count == 1 and info.memory_mb == 512 and info.envd_version == ENVD_VERSION
    assert info.allow_internet_access is False and info.network == {"deny_out": ["0.0.0.0/0"]}
    assert info.lifecycle == {"on_timeout": "kill", "auto_resume": False}
    assert timedelta(seconds=100) < info.end_at - info.started_at < timedelta(seconds=140)
    assert Sandbox.get_info(sid).sandbox_id == sid  # the class's variant too

    sbx.set_timeout(600)
    ends = datetime.fromisoformat(_hangar(api, sid)["expires_at"])
    assert timedelta(seconds=590) < ends - datetime.now(ends.tzinfo) <= timedelta(seconds=600)
    Sandbox.set_timeout(sid, 300)
    assert sbx.get_info().end_at - datetime.now(ends.tzinfo) <= timedelta(seconds=300)

    [metric] = sbx.get_metrics()
    assert metric.mem_total == 512 * 1024 * 1024 and 0 < metric.mem_used <= metric.mem_total
    assert metric.cpu_count == 1 and metric.cpu_used_pct >= 0 and metric.disk_total > 0

    sbx.kill()
    wait_until(lambda: _hangar(api, sid)["status"] == "deleted", 30, what="deleted")
    with pytest.raises(NotFoundException):
        sbx.get_info()
    assert Sandbox.kill(sid) is False  # already gone: the SDK's answer for a 404


@requires_runsc
def test_default_template_is_the_image_named_base_with_internet_access(e2b, api):
    sbx = Sandbox.create(timeout=60)
    try:
        row = _hangar(api, sbx.sandbox_id)
        assert row["image"] == "base" and row["network"]["egress"] == "all"
        info = sbx.get_info()
        assert info.template_id == "base" and info.allow_internet_access is True and info.network == {}
    finally:
        sbx.kill()


@requires_runsc
def test_deny_all_with_allow_out_is_an_allowlist(e2b, api):
    sbx = Sandbox.create("busybox", network={"allow_out": ["1.1.1.1"], "deny_out": ["0.0.0.0/0"]})
    try:
        assert _hangar(api, sbx.sandbox_id)["network"] == {"egress": "allowlist", "allow": ["1.1.1.1"]}
        info = sbx.get_info()
        assert info.network == {"allow_out": ["1.1.1.1"], "deny_out": ["0.0.0.0/0"]}
        assert info.allow_internet_access is False
    finally:
        sbx.kill()


@requires_runsc
def test_lifecycle_and_volume_mounts_map_to_hangars_expiry_pause_and_volumes(e2b, api):
    assert api.post("/volumes", json={"name": "keep", "size_mb": 32}).status_code == 201
    sbx = Sandbox.create("busybox", allow_internet_access=False, volume_mounts={"/keep": "keep"},
                         lifecycle={"on_timeout": "pause", "auto_resume": True})  # fmt: skip
    try:
        row = _hangar(api, sbx.sandbox_id)
        assert (
            row["on_expire"] == "pause" and row["pause_mode"] == "checkpoint" and row["auto_resume"] is True
        )
        assert [(v["name"], v["mount_path"]) for v in row["volumes"]] == [("keep", "/keep")]
        info = sbx.get_info()
        assert info.lifecycle == {"on_timeout": "pause", "auto_resume": True}
        assert info.volume_mounts == [{"name": "keep", "path": "/keep"}]
    finally:
        sbx.kill()


@requires_runsc
def test_list_filters_by_metadata_and_state_and_pages_with_the_next_token(e2b, api):
    suite = f"list-{uuid.uuid4().hex[:8]}"
    sandboxes = [Sandbox.create("busybox", metadata={"suite": suite, "n": str(i), "q": "a b/c&d"},
                                allow_internet_access=False) for i in range(3)]  # fmt: skip
    ids = [s.sandbox_id for s in sandboxes]
    try:
        query = SandboxQuery(metadata={"suite": suite, "q": "a b/c&d"})
        paginator = Sandbox.list(query=query, limit=2)
        first = paginator.next_items()
        assert paginator.has_next and paginator.next_token
        second = paginator.next_items()
        assert not paginator.has_next
        assert [s.sandbox_id for s in first + second] == ids[::-1]  # newest first
        assert all(s.metadata["suite"] == suite and s.state == SandboxState.RUNNING for s in first)

        oldest_first = Sandbox.list(query=query, order="asc").next_items()
        assert [s.sandbox_id for s in oldest_first] == ids
        one = Sandbox.list(query=SandboxQuery(metadata={"suite": suite, "n": "1"})).next_items()
        assert [s.sandbox_id for s in one] == [ids[1]]
        assert Sandbox.list(query=SandboxQuery(metadata={"suite": "nobody"})).next_items() == []
        running = SandboxQuery(metadata={"suite": suite}, state=[SandboxState.RUNNING])
        assert len(Sandbox.list(query=running).next_items()) == 3
        paused = SandboxQuery(metadata={"suite": suite}, state=[SandboxState.PAUSED])
        assert Sandbox.list(query=paused).next_items() == []
        by_template = SandboxQuery(metadata={"suite": suite}, template="busybox")
        assert len(Sandbox.list(query=by_template).next_items()) == 3
        later = SandboxQuery(
            metadata={"suite": suite}, started_after=datetime.now().astimezone() + timedelta(hours=1)
        )
        assert Sandbox.list(query=later).next_items() == []

        sandboxes[0].kill()
        wait_until(lambda: len(Sandbox.list(query=query).next_items()) == 2, 30, what="a killed one unlisted")
    finally:
        for s in sandboxes:
            Sandbox.kill(s.sandbox_id)


@requires_runsc
def test_pause_then_connect_resumes_it_with_its_files(e2b, api, team_token):
    sbx = Sandbox.create("busybox", allow_internet_access=False, timeout=120)
    sid = sbx.sandbox_id
    try:
        assert (
            api.put(f"/sandboxes/{sid}/files", params={"path": "/work/kept.txt"}, content=b"kept").status_code
            == 200
        )
        assert sbx.pause() is True  # E2B's default, a full snapshot: Hangar's checkpoint
        row = _hangar(api, sid)
        assert row["status"] == "paused" and row["paused_mode"] == "checkpoint"
        assert sbx.get_info().state == SandboxState.PAUSED
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert sid in [s.sandbox_id for s in paused]
        assert sbx.pause() is False  # already paused: the SDK's answer for a 409

        again = Sandbox.connect(sid, timeout=200)  # resumes it, and answers once it runs
        assert again.sandbox_id == sid and again._envd_access_token == envd_access_token(
            sid, _token(team_token)
        )
        row = _hangar(api, sid)
        assert row["status"] == "running"
        assert api.get(f"/sandboxes/{sid}/files", params={"path": "/work/kept.txt"}).content == b"kept"
        ends = datetime.fromisoformat(row["expires_at"])
        assert timedelta(seconds=190) < ends - datetime.now(ends.tzinfo) <= timedelta(seconds=200)

        # A running one: connect answers at once, and only ever extends its expiry.
        assert Sandbox.connect(sid, timeout=10).sandbox_id == sid
        assert datetime.fromisoformat(_hangar(api, sid)["expires_at"]) == ends

        assert sbx.pause(mode="filesystem") is True  # files only: Hangar's stop
        assert _hangar(api, sid)["paused_mode"] == "stop"
        sbx.connect()
        assert _hangar(api, sid)["status"] == "running"
        assert api.get(f"/sandboxes/{sid}/files", params={"path": "/work/kept.txt"}).content == b"kept"
    finally:
        Sandbox.kill(sid)


# -- refusals and other teams ------------------------------------------------------------------


@requires_runsc
def test_unknown_template_wrong_key_and_unsupported_features_are_refused(e2b, api, team_token):
    with pytest.raises(SandboxException, match="template 'no-such-image' not found.*busybox") as caught:
        Sandbox.create("no-such-image")
    assert caught.value.status_code == 404
    # e2b-code-interpreter's template: the unsupported feature named, not a missing image.
    with pytest.raises(
        SandboxException, match="does not support e2b-code-interpreter's Jupyter kernel"
    ) as caught:
        Sandbox.create("code-interpreter-v1")
    assert caught.value.status_code == 400
    with pytest.raises(AuthenticationException):
        Sandbox.create("busybox", api_key="hgr_not-a-real-key")
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="e2b_0000").next_items()
    with pytest.raises(SandboxException, match="MCP gateway"):
        Sandbox.create("busybox", mcp={"exa": {"apiKey": "x"}})
    with pytest.raises(SandboxException, match="does not support snapshots"):
        Sandbox.list_snapshots().next_items()
    with pytest.raises(SandboxException, match="egressProxy"):
        Sandbox.create("busybox", network={"egress_proxy": {"address": "proxy.example.com:1080"}})
    # A token that may only read sandboxes cannot create one (Hangar's scopes hold here too).
    from runtime.models import ApiToken
    from runtime.services.auth import token_create

    owner = ApiToken.objects.get(team__name="alpha").user
    reader = token_create(user=owner, team=ApiToken.objects.get(team__name="alpha").team,
                          scopes=["sandboxes:read"]).raw  # fmt: skip
    with pytest.raises(SandboxException, match="lacks the scope 'sandboxes:write'"):
        Sandbox.create("busybox", api_key=reader)
    assert Sandbox.list(api_key=reader).next_items() == []
    assert api.get("/sandboxes").json() == []  # nothing was started by any of these
    sid = Sandbox.create("busybox", allow_internet_access=False).sandbox_id
    assert Sandbox.get_info(sid, api_key=reader).sandbox_id == sid
    with httpx.Client(base_url=e2b, headers={"X-API-KEY": reader}, timeout=60) as http:
        detail = http.get(f"/sandboxes/{sid}").json()
    assert detail["sandboxID"] == sid and detail["envdAccessToken"] is None  # it may not run commands
    assert Sandbox.kill(sid) is True


@requires_runsc
def test_template_build_fork_snapshots_and_volumes_through_the_sdk_name_what_is_unsupported(e2b, api):
    from e2b import AsyncTemplate, AsyncVolume, Template, Volume

    sbx = Sandbox.create("busybox", timeout=60, allow_internet_access=False)
    try:
        # (the call, what the refusal must name), each through the SDK's own method.
        refused = [
            (lambda: Template.build(Template().from_image("busybox"), "mine"), "templates built by E2B's builder"),
            (lambda: Template.exists("mine"), "templates built by E2B's builder"),
            (lambda: sbx.fork(), "does not support fork"),
            (lambda: sbx.create_snapshot(), "does not support snapshots"),
            (lambda: Sandbox.delete_snapshot("snap"), "or snapshots"),
            (lambda: Volume.create("data"), "does not support volumes through the E2B API"),
            (lambda: Volume.connect("data"), "does not support volumes through the E2B API"),
            (lambda: Volume.list(), "does not support volumes through the E2B API"),
        ]  # fmt: skip
        for call, named in refused:
            with pytest.raises(Exception, match=f"^400: Hangar's E2B API .*{named}") as caught:
                call()
            assert type(caught.value).__module__ == "e2b.exceptions"  # the SDK's own, read from our answer
        asyncs = [
            (lambda: AsyncTemplate.build(AsyncTemplate().from_image("busybox"), "mine"), "E2B's builder"),
            (lambda: AsyncSandbox.fork(sbx.sandbox_id), "does not support fork"),
            (lambda: AsyncVolume.create("data"), "does not support volumes through the E2B API"),
        ]  # fmt: skip
        for acall, named in asyncs:
            with pytest.raises(Exception, match=f"^400: Hangar's E2B API .*{named}"):
                asyncio.run(acall())
        assert _hangar(api, sbx.sandbox_id)["status"] == "running"  # untouched
        assert [s["id"] for s in api.get("/sandboxes").json()] == [sbx.sandbox_id]  # nothing forked
    finally:
        sbx.kill()


@requires_runsc
def test_another_teams_key_finds_no_sandbox(e2b, api, other_team_token):
    sbx = Sandbox.create("busybox", allow_internet_access=False)
    sid = sbx.sandbox_id
    try:
        other = {"api_key": other_team_token}
        with pytest.raises(NotFoundException):
            Sandbox.get_info(sid, **other)
        with pytest.raises(NotFoundException):
            Sandbox.connect(sid, **other)
        with pytest.raises(NotFoundException):
            Sandbox.set_timeout(sid, 30, **other)
        with pytest.raises(NotFoundException):
            Sandbox.pause(sid, **other)
        with pytest.raises(NotFoundException):
            Sandbox.get_metrics(sid, **other)
        assert Sandbox.kill(sid, **other) is False
        assert Sandbox.list(**other).next_items() == []
        assert _hangar(api, sid)["status"] == "running"  # untouched
    finally:
        sbx.kill()


# -- the async SDK -----------------------------------------------------------------------------


@requires_runsc
def test_async_sdk_creates_lists_pauses_connects_and_kills(e2b, api):
    async def scenario() -> str:
        sbx = await AsyncSandbox.create("busybox", metadata={"via": "async"}, envs={"A": "1"},
                                        allow_internet_access=False)  # fmt: skip
        info = await sbx.get_info()
        assert info.metadata == {"via": "async"} and info.state == SandboxState.RUNNING
        listed = await AsyncSandbox.list(query=SandboxQuery(metadata={"via": "async"})).next_items()
        assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
        await sbx.set_timeout(90)
        assert await sbx.pause() is True
        assert (await sbx.get_info()).state == SandboxState.PAUSED
        again = await AsyncSandbox.connect(sbx.sandbox_id)
        assert (await again.get_info()).state == SandboxState.RUNNING
        with pytest.raises(SandboxException, match="not found"):
            await AsyncSandbox.create("no-such-image")
        assert await again.kill() is True
        return sbx.sandbox_id

    sid = asyncio.run(scenario())
    wait_until(lambda: _hangar(api, sid)["status"] == "deleted", 30, what="deleted")


# -- the older paths, over plain HTTP ----------------------------------------------------------


@requires_runsc
def test_older_sdk_paths_and_error_shapes_over_http(e2b, api, team_token):

    with httpx.Client(base_url=e2b, headers={"X-API-KEY": team_token}, timeout=120) as http:
        r = http.post("/sandboxes", json={"templateID": "busybox", "allow_internet_access": False})
        assert r.status_code == 201, r.text
        created = r.json()
        sid = created["sandboxID"]
        assert created["envdVersion"] == ENVD_VERSION and created["envdAccessToken"] == envd_access_token(
            sid, _token(team_token)
        )
        assert created["domain"] == domain() and created["templateID"] == "busybox"
        assert [s["sandboxID"] for s in http.get("/sandboxes").json()] == [sid]

        r = http.post(f"/sandboxes/{sid}/resume", json={})
        assert r.status_code == 409 and r.json()["code"] == 409, r.text
        assert http.post(f"/sandboxes/{sid}/pause").status_code == 204  # no body, as older SDKs send
        assert http.get("/sandboxes").json() == []  # the older list shows running ones only
        assert http.post(f"/sandboxes/{sid}/resume", json={"timeout": 60}).status_code == 201
        r = http.post(f"/sandboxes/{sid}/connect", json={"timeout": 30})
        assert r.status_code == 200 and r.json()["sandboxID"] == sid

        r = http.put(f"/sandboxes/{sid}/network", json={})
        assert r.status_code == 400 and "network" in r.json()["message"], r.text
        r = http.get("/no/such/path")
        assert r.status_code == 404 and r.json() == {
            "code": 404, "message": "Hangar's E2B API has no endpoint GET /no/such/path"
        }  # fmt: skip
        r = http.post("/v2/sandboxes", json={"templateID": "busybox", "timeout": "soon"})
        assert r.status_code == 400 and r.json()["message"].startswith("timeout:"), r.text
        r = http.get("/v2/sandboxes", params={"state": "running,sleeping"})
        assert r.status_code == 400 and "sleeping" in r.json()["message"]
        r = http.get("/v2/sandboxes", params={"nextToken": "garbage"})
        assert r.status_code == 400 and "nextToken" in r.json()["message"]
        assert http.get("/v2/sandboxes", headers={"X-API-KEY": "wrong"}).json()["code"] == 401

        assert http.delete(f"/sandboxes/{sid}").status_code == 204
        assert http.delete(f"/sandboxes/{sid}").json()["code"] == 404


# -- get_host(port): every port, public or with the traffic access token -----------------------

# A CGI script that answers with the request's headers as the app sees them (HTTP_* variables).
CGI_HEADERS = """#!/bin/sh
printf 'Content-Type: text/plain\\r\\n\\r\\n'
env | grep '^HTTP_' | sort
"""


def _serve(sbx: Sandbox) -> None:
    sbx.files.write("/www/index.html", "hello from e2b\n")
    sbx.files.write("/www/cgi-bin/headers", CGI_HEADERS)
    sbx.commands.run("chmod 755 /www/cgi-bin/headers")
    sbx.commands.run("httpd -f -p 127.0.0.1:8000 -h /www", background=True)
    wait_until(lambda: sbx.commands.run("wget -q -O- http://127.0.0.1:8000/ || true").stdout == "hello from e2b\n",
               20, what="httpd")  # fmt: skip


def _get(server: str, sbx: Sandbox, path: str, **headers: str) -> httpx.Response:
    """A request to ``get_host(8000)`` as any HTTP client makes it (through the test server, the
    host in the Host header), with no Hangar credentials."""
    return httpx.get(f"{server}{path}", headers={"Host": sbx.get_host(8000), **headers}, timeout=30)


@requires_runsc
def test_every_port_is_reached_at_get_host_public_or_with_the_traffic_access_token(e2b, server, api):
    public = Sandbox.create("busybox", timeout=120, allow_internet_access=False)
    private = Sandbox.create("busybox", timeout=120, allow_internet_access=False,
                             network={"allow_public_traffic": False})  # fmt: skip
    try:
        # Public by default (E2B's way): no port was exposed through Hangar's API, none is needed.
        assert public.traffic_access_token is None
        _serve(public)
        r = _get(server, public, "/")
        assert r.status_code == 200 and r.text == "hello from e2b\n", r.text

        # Private: the SDK holds the token (from create, and from connect), the proxy wants it.
        token = private.traffic_access_token
        assert token and Sandbox.connect(private.sandbox_id).traffic_access_token == token
        assert private.get_info().network == {"deny_out": ["0.0.0.0/0"], "allow_public_traffic": False}
        _serve(private)
        refused = _get(server, private, "/")
        assert refused.status_code == 401 and "traffic access token" in refused.text
        wrong = _get(server, private, "/", **{"e2b-traffic-access-token": "0" * 64})
        assert wrong.status_code == 403
        # Another sandbox's token opens nothing here.
        other = _get(server, private, "/", **{"e2b-traffic-access-token": public.sandbox_id})
        assert other.status_code == 403
        r = _get(server, private, "/cgi-bin/headers", **{"e2b-traffic-access-token": token})
        assert r.status_code == 200, r.text
        # The token is Hangar's, never the app's: it is not passed on.
        assert "HTTP_HOST" in r.text and "TRAFFIC" not in r.text.upper(), r.text

        # Each key gets a token of its own, which lasts as long as that key.
        made = api.post("/tokens", json={"name": "e2b-traffic"})
        assert made.status_code == 201, made.text
        theirs = Sandbox.connect(private.sandbox_id, api_key=made.json()["token"]).traffic_access_token
        assert theirs and theirs != token
        assert _get(server, private, "/", **{"e2b-traffic-access-token": theirs}).status_code == 200
        assert api.delete(f"/tokens/{made.json()['id']}").status_code == 204
        wait_until(lambda: _get(server, private, "/", **{"e2b-traffic-access-token": theirs}).status_code == 403,
                   10, what="the revoked key's traffic token refused")  # fmt: skip
        assert _get(server, private, "/", **{"e2b-traffic-access-token": token}).status_code == 200
    finally:
        public.kill()
        private.kill()
