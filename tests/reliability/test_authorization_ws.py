"""Who may open which websocket: every websocket route (read from the routing, so a new one
without a row below fails here) × every kind of caller (the REST matrix's API tokens, and
signed-in browser sessions) × object (own team's, another team's, nonexistent). The outcome
of each cell is in :data:`ROUTES`, this test's own table: a close code (4401 not signed in,
4403 not allowed, 4404 no such object), or open to watch only, or open to type and run
commands. The sockets run against the real ASGI application (``channels.testing``); no
sandbox runs, so the objects are rows (a stopped sandbox, a terminal, a trace, an image job)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.test import Client

from dashboard.asgi import application
from dashboard.websockets.consumers import VIEWER_REFUSAL
from dashboard.websockets.routing import websocket_urlpatterns
from runtime.models import ImageJob, Membership, Sandbox, Team, Terminal
from runtime.trace_models import Trace

from .test_authorization import ACTS_AS, NO_CALLER, ROLES, SCOPED, callers, covers  # noqa: F401 (a fixture)


@dataclass(frozen=True)
class Route:
    """Who may open a websocket route: by API ``token`` and/or a same-origin browser
    ``session``; the least role and the token scope to open it; whether what is opened can be
    changed (typed into, commands started) and by whom; the team object it names, if any;
    ``site``: a page of Hangar-wide things any signed-in user may watch, in a team or not."""

    path: str
    token: bool
    session: bool
    least: str = "viewer"
    scope: str = "sandboxes:read"
    change: str = ""  # "<least role> <scope>" to type or start commands; "" for watch-only routes
    obj: str = ""  # "sandbox" | "terminal" | "trace" | "job"
    site: bool = False


# The table: one row per route of dashboard/websockets/routing.py.
ROUTES = {
    "ws/v1/terminals/<str:terminal_id>": Route(
        "/ws/v1/terminals/{terminal}",
        token=True,
        session=True,
        change="member sandboxes:write",
        obj="terminal",
    ),
    "ws/v1/sandboxes/<str:sandbox_id>/exec": Route(
        "/ws/v1/sandboxes/{sandbox}/exec",
        token=True,
        session=True,
        change="member sandboxes:write",
        obj="sandbox",
    ),
    # The dashboard's live pages are the browser's: an API token is refused (4401).
    "ws/ui/sandboxes": Route("/ws/ui/sandboxes", token=False, session=True),
    "ws/ui/sandboxes/<str:sandbox_id>": Route(
        "/ws/ui/sandboxes/{sandbox}", token=False, session=True, obj="sandbox"
    ),
    "ws/ui/traces/<str:trace_id>": Route("/ws/ui/traces/{trace}", token=False, session=True, obj="trace"),
    # Images are every team's: any signed-in user watches the list and a job's progress.
    "ws/ui/images": Route("/ws/ui/images", token=False, session=True, site=True),
    "ws/ui/images/jobs/<int:job_id>": Route("/ws/ui/images/jobs/{job}", token=False, session=True, site=True),
}

# Browser sessions: who is signed in, and how the socket is opened.
SESSIONS = {
    "no session": None,
    **{f"{role} session": f"u-{role}" for role in ROLES},
    "staff member session": "u-staff",
    "another team's owner session": "u-outsider",
    "a member who left session": "u-left",
    "owner session, another site's page": "u-owner",  # Origin: a page elsewhere using the cookie
    "owner session with a bad token": "u-owner",  # a bad token is not rescued by the cookie
}
SESSION_ROLE = {"staff member session": "member", "another team's owner session": "owner",
                "owner session, another site's page": "owner", "owner session with a bad token": "owner",
                **{f"{role} session": role for role in ROLES}}  # fmt: skip


def test_every_websocket_route_has_a_row():
    routes = [str(p.pattern) for p in websocket_urlpatterns]
    assert sorted(routes) == sorted(ROUTES), f"routes {set(routes) ^ set(ROUTES)} differ from the table"


def expected(route: Route, caller: str, whose: str) -> str:
    """ "4401", "4403", "4404", "watch" (open, typing refused), "change" or "open"."""
    if caller in SESSIONS:
        user = SESSIONS[caller]
        if user is None or caller in ("owner session, another site's page", "owner session with a bad token"):
            return "4401"
        if route.site:
            return "open"
        if caller == "a member who left session":
            return "4401"  # in no team: the session has none to act in
        role = SESSION_ROLE[caller]
        scopes: list[str] = []
    else:
        if caller in NO_CALLER or not route.token:
            return "4401"
        scopes = SCOPED.get(caller, [])
        if scopes and not covers(scopes, route.scope):
            return "4403"
        role = ACTS_AS.get(caller, caller)
    if ROLES.index(role) < ROLES.index(route.least):
        return "4403"
    if route.obj and whose != "own":
        return "4404"  # another team's object is exactly a missing one
    if not route.change:
        return "open"
    least, _, scope = route.change.partition(" ")
    may = ROLES.index(role) >= ROLES.index(least) and (not scopes or covers(scopes, scope))
    return "change" if may else "watch"


def _objects(team: Team, tag: str) -> dict[str, str]:
    sb = Sandbox.objects.create(
        team=team, image="busybox", image_digest="sha256:" + "a" * 64, status="stopped"
    )
    term = Terminal.objects.create(sandbox=sb, argv=["/bin/sh"])
    trace = Trace.objects.create(
        team=team, trace_id=(tag.encode().hex() + "0" * 32)[:32], start_ns=1, end_ns=2
    )
    return {"sandbox": sb.id, "terminal": term.id, "trace": trace.trace_id}


@pytest.fixture(autouse=True)
def fresh_channel_layer():
    """A layer of this test's own: Channels' layer keeps state bound to the loop that used it."""
    from channels.layers import channel_layers

    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


async def _open(path: str, headers: list[tuple[bytes, bytes]]) -> tuple[str, WebsocketCommunicator | None]:
    """The close code a socket is refused with, or "open" and the socket."""
    comm = WebsocketCommunicator(application, path, headers=headers)
    connected, _ = await comm.connect(timeout=5)
    assert connected, f"{path}: refused at the handshake (a real client sees an HTTP 403, no code)"
    while not await comm.receive_nothing(0.3):
        msg = await comm.receive_output(2)
        if msg["type"] == "websocket.close":
            return str(msg["code"]), None
    return "open", comm


async def _probe_change(route: Route, comm: WebsocketCommunicator) -> str:
    """ "watch" if the socket refuses its caller's typing (or command), else "change"."""
    if "exec" in route.path:
        await comm.send_to(text_data=json.dumps({"cmd": "true"}))  # a stopped sandbox: 4400 if allowed
        said = []
        while True:
            msg = await comm.receive_output(5)
            if msg["type"] == "websocket.close":
                return "watch" if msg["code"] == 4403 and VIEWER_REFUSAL in " ".join(said) else "change"
            said.append(msg.get("text", ""))
    # Typing, then a ping: its pong comes after whatever the typing got (frames are handled in
    # order), so a refusal is never missed for being slow.
    await comm.send_to(bytes_data=b"x")
    await comm.send_to(text_data=json.dumps({"type": "ping"}))
    said = []
    while '"pong"' not in (text := (await comm.receive_output(5)).get("text") or ""):
        said.append(text)
    return "watch" if VIEWER_REFUSAL in " ".join(said) else "change"


def test_the_websocket_matrix(callers, report):  # noqa: F811 (the REST matrix's fixture)
    """Every route × caller × object answers as the table says; a viewer's socket is open to
    watch but refuses typing and commands; no refusal happens at the handshake (it is a close
    code a client can read)."""
    User = get_user_model()
    matrix, elsewhere = Team.objects.get(name="matrix"), Team.objects.get(name="elsewhere")
    mine, theirs = _objects(matrix, "m"), _objects(elsewhere, "t")
    missing = {"sandbox": "sbnosuch00000000000", "terminal": "tmnosuch0000", "trace": "f" * 32}
    job = ImageJob.objects.create(kind="build", ref="busybox")
    outsider = User.objects.get(username="u-outsider")
    assert Membership.objects.filter(user=outsider, team=elsewhere).exists()
    cookies = {}
    for caller, username in SESSIONS.items():
        if username:
            client = Client()
            client.force_login(User.objects.get(username=username))
            cookies[caller] = f"sessionid={client.cookies['sessionid'].value}".encode()

    def cells():
        for pattern, route in ROUTES.items():
            for caller in [*callers, *SESSIONS]:
                for whose in ("own", "another team's", "nonexistent") if route.obj else ("",):
                    yield pattern, route, caller, whose

    async def main() -> tuple[int, list[str]]:
        n, failures = 0, []
        for _pattern, route, caller, whose in cells():
            outsider_caller = caller.startswith("another team's owner")
            ids = {"own": theirs if outsider_caller else mine, "another team's": mine if outsider_caller else theirs,
                   "nonexistent": missing, "": {}}[whose]  # fmt: skip
            path = route.path.format(
                job=job.id, **{k: ids.get(k, "") for k in ("sandbox", "terminal", "trace")}
            )
            headers = [(b"host", b"testserver")]
            if caller in SESSIONS:
                if caller in cookies:
                    headers.append((b"cookie", cookies[caller]))
                origin = b"http://evil.example" if "another site" in caller else b"http://testserver"
                headers.append((b"origin", origin))
                if "bad token" in caller:
                    headers.append((b"authorization", b"Bearer hgr_not-a-real-token"))
            elif callers[caller]:
                headers.append((b"authorization", f"Bearer {callers[caller]}".encode()))
            got, comm = await _open(path, headers)
            if comm is not None:
                if route.change:
                    got = await _probe_change(route, comm)
                await comm.disconnect()
            n += 1
            if got != (want := expected(route, caller, whose)):
                failures.append(f"{caller:>36} {whose:>15}  {route.path}: {got} (want {want})")
        return n, failures

    n, failures = asyncio.run(main())
    assert n > 300, n
    assert not failures, f"{len(failures)} of {n} cells:\n" + "\n".join(failures)
    report.held(
        "authorization",
        "websocket route x caller (API tokens of every role and state, browser sessions of every role, "
        "cross-site, with a bad token) x object (own team's, another team's, nonexistent), "
        "against the test's own table",
        cells=n,
    )
