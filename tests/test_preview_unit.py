"""The preview proxy's own rules, without a sandbox: what goes upstream, where a token's
redirect may point, cross-site use of the sign-in cookie, and the always-denied networks."""

from __future__ import annotations

import asyncio

import pytest

from dashboard.edge.preview import Denied, Preview
from runtime.host.hostnames import HostNames
from runtime.host.network import Network
from runtime.services import previews


def make(headers: dict[str, str], path: str = "/", query: str = "", kind: str = "http", method: str = "GET"):
    scope = {
        "type": kind,
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("10.0.0.9", 5),
    }
    return Preview(scope, None, None, 8000, "sbunit1")  # type: ignore[arg-type]


class Row:
    id, team_id = "sbunit1", 1

    def __init__(self, public: bool = False, open_ports: str = "") -> None:
        self.ports = [{"port": 8000, "public": public}]
        self.open_ports = open_ports


def test_hangar_tokens_and_cookie_never_go_upstream_and_the_query_is_kept_verbatim():
    p = make({"Host": "8000-sbunit1.localhost", "Authorization": "Bearer hgr_secret", "Cookie":
              "hangar_preview=abc; app=1", "e2b-traffic-access-token": "1.abc"}, query="flag&x=%FF&hangar_token=t")  # fmt: skip
    asyncio.run(p._authorize(Row(public=True)))
    up = dict(p._upstream_headers())
    assert b"e2b-traffic-access-token" not in up  # E2B's traffic token is Hangar's too
    assert b"authorization" not in up and up[b"cookie"] == b"app=1"
    assert p._target() == b"/?flag&x=%FF"
    p = make({"Authorization": "Bearer app-own-token"})
    assert dict(p._upstream_headers())[b"authorization"] == b"Bearer app-own-token"


def test_a_token_redirect_stays_on_the_preview_host(settings):
    token = previews.sign("sbunit1", 8000)
    p = make({"Host": "8000-sbunit1.localhost"}, path="//evil.example/", query=f"hangar_token={token}")
    assert asyncio.run(p._authorize(Row())) == "/evil.example/"


def test_the_cookie_is_refused_for_changes_started_by_another_site():
    token = previews.sign("sbunit1", 8000)
    cookie = f"hangar_preview={token}"
    host = "8000-sbunit1.localhost:8000"
    ok = make({"Host": host, "Cookie": cookie, "Origin": f"http://{host}"}, method="POST")
    assert asyncio.run(ok._authorize(Row())) is None
    assert asyncio.run(make({"Host": host, "Cookie": cookie})._authorize(Row())) is None  # a plain GET
    for p in (
        make({"Host": host, "Cookie": cookie, "Origin": "http://3000-sbevil.localhost:8000"}, method="POST"),
        make(
            {"Host": host, "Cookie": cookie, "Origin": "http://3000-sbevil.localhost:8000"}, kind="websocket"
        ),
    ):
        with pytest.raises(Denied) as info:
            asyncio.run(p._authorize(Row()))
        assert info.value.status == 403


def test_exceptions_never_open_the_pool_of_other_sandboxes(tmp_path):
    names, claims = HostNames("abc123"), tmp_path / "claims"
    net = Network(tmp_path, names, pool="10.88.0.0/16", exceptions=["10.0.0.0/8"], nameservers=["1.1.1.1"],
                  claims_dir=claims)  # fmt: skip
    denied = net.denied()
    assert "10.88.0.0/16" in denied and not any(d == "10.0.0.0/8" for d in denied)
    net = Network(tmp_path, names, pool="10.88.0.0/16", exceptions=["192.168.5.0/24"], nameservers=["1.1.1.1"],
                  claims_dir=claims)  # fmt: skip
    assert "192.168.5.0/24" not in net.denied() and "192.168.4.0/24" in net.denied()


def test_requests_for_a_paused_sandbox_share_one_wake_up_and_hold_no_threads(transactional_db, monkeypatch):
    """Forty requests (a page and its assets) for a paused sandbox with auto_resume: one resume,
    one waiting task on the event loop; not a thread held by each request for the whole wait."""
    import threading

    from django.db import connection

    from dashboard.edge import preview
    from runtime import notify
    from runtime.models import Sandbox, Team
    from runtime.services import sandboxes as svc

    team = Team.objects.create(name="wake")
    sb = Sandbox.objects.create(team=team, image="x", image_digest="sha256:x", status="paused", auto_resume=True,
                                ports=[{"port": 8000, "public": True}])  # fmt: skip
    resumes: list[str] = []

    def resume(*, sandbox):  # the node's part, simulated: running half a second later
        resumes.append(sandbox.id)
        Sandbox.objects.filter(id=sandbox.id).update(status="resuming")

        def later() -> None:
            import time

            time.sleep(0.5)
            Sandbox.objects.filter(id=sandbox.id).update(status="running")
            notify.sandbox_changed(sandbox.id, "running")
            connection.close()

        threading.Thread(target=later, daemon=True).start()
        return sandbox

    monkeypatch.setattr(svc, "sandbox_resume", resume)
    calls = []
    real_blocking = preview.blocking

    def counting(fn):
        calls.append(fn)
        return real_blocking(fn)

    monkeypatch.setattr(preview, "blocking", counting)

    async def many():
        ps = [make({"Host": f"8000-{sb.id}.localhost"}) for _ in range(40)]
        return await asyncio.gather(*(p._running(sb) for p in ps))

    rows = asyncio.run(many())
    assert resumes == [sb.id]
    assert {r.status for r in rows} == {"running"}
    # A read, the resume, a read or two after the notification: not one call per request.
    assert len(calls) <= 6, len(calls)

    # Deleted meanwhile: every waiter is told so (404), nothing raised past the proxy.
    Sandbox.objects.filter(id=sb.id).update(status="paused")
    Sandbox.objects.filter(id=sb.id).delete()
    with pytest.raises(Denied) as exc:
        asyncio.run(make({})._running(sb))
    assert exc.value.status == 404


def test_a_request_that_joins_a_wake_up_late_still_gets_its_whole_wait(
    transactional_db, monkeypatch, settings
):
    """The wait is each request's own: one that arrives while the sandbox has been waking up for
    a while is not cut short by the first request's deadline."""
    import time

    from runtime.models import Sandbox, Team
    from runtime.services import sandboxes as svc

    settings.HANGAR_PREVIEW_RESUME_WAIT_S = 2
    team = Team.objects.create(name="slow")
    sb = Sandbox.objects.create(team=team, image="x", image_digest="sha256:x", status="paused", auto_resume=True,
                                ports=[{"port": 8000, "public": True}])  # fmt: skip

    def resume(*, sandbox):  # a resume that never finishes
        Sandbox.objects.filter(id=sandbox.id).update(status="resuming")
        return sandbox

    monkeypatch.setattr(svc, "sandbox_resume", resume)

    async def scenario():
        first = asyncio.create_task(make({})._running(sb))
        await asyncio.sleep(1.5)
        start = time.monotonic()
        with pytest.raises(Denied) as late:
            await make({})._running(sb)
        waited = time.monotonic() - start
        with pytest.raises(Denied):
            await first
        return waited, late.value

    waited, denied = asyncio.run(scenario())
    assert denied.status == 503 and "waking up" in denied.title
    assert waited >= 1.8, waited  # its own 2 s, not the 0.5 s the first request had left
