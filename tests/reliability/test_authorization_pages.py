"""Who may open what in the dashboard: every page and page action of ``dashboard/urls.py``
against every kind of session caller and, where a page names an object, the caller's own
team's object, another team's and one that does not exist.

What each cell should answer is written out in ``PAGES`` below, on purpose not read from the
code under test (nor from ``dashboard/api/permissions.py``): a page that starts letting more
through, or that tells another team's object from a missing one, fails here."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlsplit

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import URLPattern, reverse

from dashboard import urls
from dashboard.pages.teams import SESSION_KEY
from runtime.models import (
    ApiToken,
    Exec,
    Harness,
    ImageJob,
    Invitation,
    Membership,
    Node,
    NodeJoinToken,
    Run,
    Sandbox,
    SandboxVolume,
    Secret,
    SshKey,
    Team,
    Terminal,
    Trace,
    TraceSpan,
    Volume,
)
from runtime.services import auth as auth_svc
from runtime.services import spans

ROLES = ("viewer", "member", "admin", "owner")
FILE = object()  # in a page's data: a small uploaded file


@dataclass(frozen=True)
class Page:
    """The spec of one (method, route): who may, and what everyone else sees."""

    # public | signed-in | a least role in the current team | admin|staff (or site staff) | staff
    least: str
    obj: str | None = None  # the kind of object its path or form names (SCOPE)
    ok: tuple[int, ...] = (200,)  # what an allowed caller gets at their own object
    refused: int = 403  # what a signed-in caller below ``least`` gets
    missing: int = 404  # another team's object, exactly as one that does not exist
    data: dict[str, Any] = field(default_factory=dict)  # query or form; "{sandbox_id}": the object's
    staff_every_team: bool = False  # a staff user sees every team's here, not only their own
    only: tuple[str, ...] = ()  # objects to try, when not all of them


# Objects: a team's (another team's is a 404 to the caller), a user's own (another user's too),
# or the site's (images, nodes, invitation links: there is no other team's, only a missing one).
SCOPE = {"sandbox": "team", "harness": "team", "run": "team", "trace": "team", "span": "team",
         "volume": "team", "secret": "team", "team": "team", "key": "user",
         "node": "site", "image_job": "site", "invitation": "site"}  # fmt: skip
MISSING = {"sandbox_id": "sbnosuch00000000000", "harness_id": "hnosuch", "run_id": "runnosuch",
           "trace_id": "f" * 32, "span_id": "f" * 16, "volume": "nosuch", "secret": "NOSUCH",
           "team_id": "999999", "key": "999999", "name": "nosuch-node", "action": "cordon",
           "job_id": "999999", "code": "hinv_nosuch"}  # fmt: skip
REDIRECT = (302,)  # an action answers with a redirect (its message says how it went)
SB = {"obj": "sandbox"}

# The matrix's spec: (method, route name) -> Page. Sandbox actions on a stopped sandbox answer
# "not running" (reached, no node needed); a harness's sandbox is "resuming", so resume is a
# no-op and terminals are refused for it; forms posted empty are refused by validation (422).
PAGES: dict[tuple[str, str], Page] = {
    ("GET", "login"): Page("public", ok=(200, 302)),  # a signed-in user is sent on
    ("POST", "login"): Page("public", ok=(200, 302)),  # empty: no password tried, none throttled
    ("POST", "logout"): Page("public", ok=REDIRECT),
    ("GET", "invitation"): Page("public", obj="invitation"),
    ("POST", "invitation"): Page("public", obj="invitation", only=("missing",)),
    ("GET", "overview"): Page("signed-in"),
    ("POST", "team_switch"): Page("signed-in", obj="team", ok=REDIRECT, missing=403, data={"team": "{team_id}"}),
    ("GET", "profile"): Page("signed-in"),
    ("POST", "profile"): Page("signed-in", obj="key", ok=REDIRECT, data={"action": "delete", "key": "{key}"}),
    ("GET", "sandboxes"): Page("signed-in"),  # the current team's; none for a user without one
    ("POST", "sandboxes"): Page("member", ok=(422,)),
    ("GET", "sandbox"): Page("viewer", **SB),
    ("POST", "sandbox_stop"): Page("member", ok=REDIRECT, **SB),
    ("POST", "sandbox_pause"): Page("member", ok=REDIRECT, **SB),
    ("POST", "sandbox_resume"): Page("member", ok=REDIRECT, **SB),
    ("POST", "sandbox_delete"): Page("member", ok=REDIRECT, **SB),
    ("POST", "sandbox_keepalive"): Page("member", ok=REDIRECT, data={"seconds": "60"}, **SB),
    ("POST", "terminal_create"): Page("member", ok=REDIRECT, **SB),
    ("POST", "command_run"): Page("member", ok=REDIRECT, data={"cmd": "id"}, **SB),
    ("GET", "file_download"): Page("viewer", ok=REDIRECT, data={"path": "/etc/hostname"}, **SB),
    ("POST", "file_upload"): Page("member", ok=REDIRECT, data={"path": "/tmp", "file": FILE}, **SB),
    ("GET", "harnesses"): Page("signed-in"),
    ("POST", "harnesses"): Page("member", ok=(422,)),
    ("POST", "harness_image_build"): Page("staff", ok=REDIRECT),  # no node here: the form says so
    ("GET", "harness"): Page("viewer", obj="harness"),
    ("GET", "harness_log"): Page("viewer", obj="harness"),
    ("POST", "harness_pause"): Page("member", obj="harness", ok=REDIRECT),
    ("POST", "harness_resume"): Page("member", obj="harness", ok=REDIRECT),
    ("POST", "harness_delete"): Page("member", obj="harness", ok=REDIRECT),
    ("POST", "harness_terminal"): Page("member", obj="harness", ok=REDIRECT),
    ("POST", "harness_run"): Page("member", obj="harness", ok=REDIRECT, data={"prompt": ""}),
    ("GET", "run"): Page("viewer", obj="run"),
    ("POST", "run_cancel"): Page("member", obj="run", ok=REDIRECT),
    ("GET", "traces"): Page("signed-in"),
    ("GET", "trace"): Page("viewer", obj="trace"),
    ("GET", "trace_span"): Page("viewer", obj="span"),
    ("GET", "nodes"): Page("signed-in"),  # names and states; the rest for staff
    ("POST", "node_join_token"): Page("staff", data={"uses": "1"}),
    ("POST", "node_action"): Page("staff", obj="node"),
    ("GET", "images"): Page("signed-in"),
    ("POST", "images"): Page("staff", ok=(422,), data={"action": "build", "kind": "nosuch"}),
    ("GET", "image_job"): Page("signed-in", obj="image_job"),  # images are every team's
    ("GET", "volumes"): Page("signed-in"),
    # The team's volume is held by its sandbox: deleting it is refused (409) without a node.
    ("POST", "volumes"): Page("member", obj="volume", ok=(409,), data={"action": "delete", "volume": "{volume}"}),
    ("GET", "team"): Page("viewer"),
    ("POST", "team"): Page("admin", obj="secret", ok=REDIRECT, data={"action": "secret_delete", "name": "{secret}"}),
    ("GET", "usage"): Page("admin|staff", staff_every_team=True),
    ("GET", "usage_csv"): Page("admin|staff", obj="team", refused=404, staff_every_team=True),
    ("GET", "audit"): Page("admin|staff", staff_every_team=True),
    ("GET", "audit_csv"): Page("admin|staff", staff_every_team=True),
}  # fmt: skip

NOT_PAGES = ("admin/", "api/v1/", "e2b/", "^e2b/", "v1/traces", "v1/logs")


class Caller(NamedTuple):
    user: str
    team: str | None  # their current (only) team
    role: str | None
    staff: bool = False


CALLERS: dict[str, Caller | None] = {
    "anonymous": None,
    **{role: Caller(f"u-{role}", "matrix", role) for role in ROLES},
    "staff member": Caller("u-staff", "matrix", "member", staff=True),
    "another team's owner": Caller("u-outsider", "elsewhere", "owner"),
    "a member who left": Caller("u-left", None, None),
}


def page_routes() -> dict[str, URLPattern]:
    return {
        p.name: p
        for p in urls.urlpatterns
        if isinstance(p, URLPattern) and p.name and not str(p.pattern).startswith(NOT_PAGES)
    }


def test_every_page_route_has_a_row_in_the_table():
    routes = set(page_routes())
    named = {route for _, route in PAGES}
    assert not routes - named, f"pages without a row in PAGES: {sorted(routes - named)}"
    assert not named - routes, f"rows for routes that do not exist: {sorted(named - routes)}"
    # Every other route of dashboard/urls.py is one of the API's, the E2B API's, OTLP or the admin.
    others = [str(p.pattern) for p in urls.urlpatterns if getattr(p, "name", None) not in routes]
    assert all(o.startswith(NOT_PAGES) or o.startswith("api/v1/otlp/") for o in others), others


def permits(page: Page, caller: Caller | None) -> bool:
    if page.least == "public":
        return True
    if caller is None:
        return False
    if page.least == "signed-in":
        return True
    if page.least == "staff":
        return caller.staff
    if page.least == "admin|staff" and caller.staff:
        return True
    least = page.least.split("|")[0]
    return caller.role is not None and ROLES.index(caller.role) >= ROLES.index(least)


def expected(page: Page, caller: Caller | None, whose: str | None) -> tuple[str, set[int]]:
    """What the cell must answer: ("login", …) a redirect to sign in; ("ok", statuses) reached;
    ("refused" | "missing", statuses)."""
    if caller is None and page.least != "public":
        return "login", {302}
    seen_as_own = whose == "other" and caller is not None and caller.staff and page.staff_every_team
    allowed = permits(page, caller)
    if whose in ("other", "missing") and not seen_as_own:
        # Either refusal may come first, the role's or the lookup's; whichever, the two match.
        return ("missing", {page.missing}) if allowed else ("refused", {page.refused, page.missing})
    if allowed:
        return "ok", set(page.ok)
    assert caller is not None
    # Without a team there is no role to be below, nor a team to look in: a 403 or a 404.
    return "refused", {403, 404} if caller.team is None else {page.refused}


def whose_list(page: Page, caller: Caller | None) -> list[str | None]:
    if page.obj is None:
        return [None]
    if page.only:
        return list(page.only)
    if SCOPE[page.obj] == "site":
        return ["missing", "own"]
    if SCOPE[page.obj] == "team" and caller is not None and caller.team is None:
        return ["other", "missing"]  # the team they left is another team now
    return ["other", "missing", "own"]  # own last: an allowed action may change it


class World:
    """Two teams, their users, and a fresh set of objects of each (made again after an allowed
    action changed them)."""

    def __init__(self) -> None:
        User = get_user_model()
        self.teams = {name: Team.objects.create(name=name) for name in ("matrix", "elsewhere")}
        self.users = {}
        for caller in CALLERS.values():
            if caller is None:
                continue
            user = User.objects.create_user(username=caller.user, password="x", is_staff=caller.staff)
            team = self.teams[caller.team or "matrix"]
            Membership.objects.create(user=user, team=team, role=caller.role or "admin")
            self.users[caller.user] = user
        Membership.objects.filter(user__username="u-left").delete()
        self.refresh()

    def refresh(self) -> None:
        self.sets = {name: self._team_objects(team) for name, team in self.teams.items()}
        tag = secrets.token_hex(4)
        node = Node.objects.create(name=f"node-{tag}")
        job = ImageJob.objects.create(kind="build", ref="busybox", status="succeeded")
        invite = auth_svc.invitation_create(inviter_role="owner", user=self.users["u-owner"],
                                            team=self.teams["matrix"], role="viewer")  # fmt: skip
        self.site = {"name": node.name, "action": "cordon", "job_id": str(job.id), "code": invite.raw}
        self.keys = {
            name: str(SshKey.objects.create(user=user, name=f"k-{tag}", public_key="ssh-ed25519 AAAA",
                                            fingerprint=f"SHA256:{secrets.token_hex(16)}").id)
            for name, user in self.users.items()
        }  # fmt: skip

    @staticmethod
    def _team_objects(team: Team) -> dict[str, str]:
        tag = secrets.token_hex(4)
        sb = Sandbox.objects.create(team=team, image="busybox", image_digest="sha256:" + "a" * 64,
                                    status="stopped")  # fmt: skip
        held = Sandbox.objects.create(team=team, image="busybox", image_digest="sha256:" + "a" * 64,
                                      status="resuming")  # fmt: skip
        h = Harness.objects.create(team=team, name=f"h-{tag}", agent="custom", image="busybox", sandbox=held,
                                   setup="done")  # fmt: skip
        run = Run.objects.create(harness=h, prompt="p")
        vol = Volume.objects.create(team=team, name=f"vol-{tag}", size_mb=64)
        SandboxVolume.objects.create(sandbox=sb, volume=vol, mount_path="/data")
        secret = Secret.objects.create(team=team, name=f"S_{tag.upper()}", ciphertext=b"x")
        trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
        Trace.objects.create(team=team, trace_id=trace_id, start_ns=1, end_ns=2)
        TraceSpan.objects.create(
            team=team, trace_id=trace_id, span_id=span_id, name="exec", start_ns=1, end_ns=2
        )
        return {"sandbox_id": sb.id, "harness_id": h.id, "run_id": run.id, "trace_id": trace_id,
                "span_id": span_id, "volume": vol.name, "secret": secret.name, "team_id": str(team.id),
                "harness_name": h.name, "harness_sandbox": held.id}  # fmt: skip

    def client(self, caller: Caller | None) -> Client:
        """A session signed in as the caller, working in their team (the one they left, for the
        removed member: the session still names it)."""
        client = Client()
        if caller is not None:
            client.force_login(self.users[caller.user])
            session = client.session
            session[SESSION_KEY] = self.teams[caller.team or "matrix"].id
            session.save()
        return client

    def values(self, caller: Caller | None, whose: str | None) -> dict[str, str]:
        if whose == "missing":
            return MISSING
        mine = (caller.team if caller else None) or "matrix"
        team = mine if whose != "other" or (caller and caller.team is None) else (
            "elsewhere" if mine == "matrix" else "matrix")  # fmt: skip
        me = caller.user if caller else "u-owner"
        key_of = me if whose != "other" else ("u-owner" if me == "u-outsider" else "u-outsider")
        return {**self.site, **self.sets[team], "key": self.keys[key_of]}

    def foreign(self, caller: Caller) -> list[str]:
        """What no page may show this caller: the ids and names of other teams' objects."""
        return [
            v for name, s in self.sets.items() if name != caller.team for k, v in s.items() if k != "team_id"
        ]


def snapshot() -> tuple[Any, ...]:
    """Everything a page action could change."""
    return (
        sorted(Sandbox.objects.values_list("id", "status", "expires_at", "updated_at")),
        sorted(Harness.objects.values_list("id", "deleted_at", "sandbox_id", "setup", "updated_at")),
        sorted(Run.objects.values_list("id", "status", "cancel_requested")),
        sorted(Volume.objects.values_list("id", flat=True)),
        sorted(Secret.objects.values_list("id", "updated_at")),
        sorted(Node.objects.values_list("name", "state")),
        sorted(SshKey.objects.values_list("id", flat=True)),
        sorted(Membership.objects.values_list("user_id", "team_id", "role")),
        sorted(Invitation.objects.values_list("id", "accepted_at", "revoked_at")),
        sorted(ApiToken.objects.values_list("id", "revoked_at")),
        NodeJoinToken.objects.count(), ImageJob.objects.count(), Terminal.objects.count(), Exec.objects.count(),
    )  # fmt: skip


@pytest.fixture
def world(transactional_db) -> World:
    return World()


def request(client: Client, method: str, route: str, page: Page, values: dict[str, str]) -> tuple[str, Any]:
    params = page_routes()[route].pattern.converters  # type: ignore[attr-defined]
    path = reverse(route, kwargs={p: values[p] for p in params})
    data = {
        k: SimpleUploadedFile("a.txt", b"hi") if v is FILE else v.format(**values)
        for k, v in page.data.items()
    }
    return path, (client.get(path, data) if method == "GET" else client.post(path, data))


def body(r: Any) -> str:
    if not r.streaming:
        return r.content.decode(errors="replace")

    async def read() -> bytes:  # the CSV streams are async iterators (ASGI)
        return b"".join([chunk async for chunk in r.streaming_content])

    return async_to_sync(read)().decode(errors="replace")


def test_the_pages_authorization_matrix(world, report):
    """Each page and action against each caller and object: the table's answer exactly; a
    refused action, or one at another team's object, changes nothing; no page a caller may see
    shows another team's objects; another team's object answers as a missing one does."""
    clients = {name: world.client(caller) for name, caller in CALLERS.items()}
    failures: list[str] = []
    cells = 0
    for (method, route), page in PAGES.items():
        for name, caller in CALLERS.items():
            answers: dict[str | None, int] = {}
            for whose in whose_list(page, caller):
                values = world.values(caller, whose)
                client = clients[name]
                if route == "logout":  # it signs out a client of its own
                    client = world.client(caller)
                before = snapshot() if method == "POST" else None
                path, r = request(client, method, route, page, values)
                cells += 1
                answers[whose] = r.status_code
                kind, statuses = expected(page, caller, whose)
                where = f"{name:>20} {whose or '':>8}  {method:4} {route}"
                to_login = r.status_code == 302 and r["Location"].startswith("/login/?next=")
                if r.status_code not in statuses or to_login != (kind == "login"):
                    failures.append(f"{where}: {r.status_code} {r.get('Location', '')} (want {kind} "
                                    f"{sorted(statuses)}) {body(r)[:100]!r}")  # fmt: skip
                elif kind == "login":
                    nxt = parse_qs(urlsplit(r["Location"]).query).get("next", [""])[0]
                    if not nxt.startswith(path):
                        failures.append(f"{where}: signs in to come back to {nxt!r}, not {path!r}")
                if before is not None:
                    if kind == "ok":
                        world.refresh()  # an allowed action may have changed its object
                    elif snapshot() != before:
                        failures.append(f"{where}: refused ({r.status_code}) but changed something")
                # No answer (a page, a refusal, an error page) names another team's objects,
                # but for what the caller sent itself (in the path or the form).
                if caller is not None and not (
                    caller.staff and page.staff_every_team and r.status_code == 200
                ):
                    text = body(r)
                    sent = " ".join(
                        [path, *(v.format(**values) for v in page.data.values() if isinstance(v, str))]
                    )
                    if shown := [v for v in world.foreign(caller) if v in text and v not in sent]:
                        failures.append(f"{where}: {r.status_code} shows another team's {shown}")
            if "other" in answers and expected(page, caller, "other")[0] != "ok":
                if answers["other"] != answers["missing"]:
                    failures.append(f"{name:>20} {method:4} {route}: another team's object answers "
                                    f"{answers['other']}, a missing one {answers['missing']}")  # fmt: skip
    spans.flush()  # the actions' spans are written off this thread: before the tables are emptied
    assert not failures, f"{len(failures)} of {cells} cells:\n" + "\n".join(failures)
    report.held(
        "authorization",
        "dashboard page x session caller (anonymous, 4 roles, staff, another team's owner, removed "
        "member) x object (own team's, another team's, nonexistent)",
        cells=cells,
    )


# -- CSRF: a signed-in session's POST without the token is refused, and changes nothing ----------

CSRF_CELLS = [  # (caller, route): a POST at their own object, as in PAGES
    ("member", "sandbox_delete"),
    ("member", "sandbox_stop"),
    ("member", "harness_delete"),
    ("member", "run_cancel"),
    ("member", "sandboxes"),
    ("member", "volumes"),
    ("owner", "team"),
    ("owner", "team_switch"),
    ("staff member", "node_action"),
    ("staff member", "node_join_token"),
    ("member", "profile"),
]


def test_a_post_without_the_csrf_token_is_refused_and_changes_nothing(world, report):
    failures = []
    for name, route in CSRF_CELLS:
        caller = CALLERS[name]
        assert caller is not None
        client = Client(enforce_csrf_checks=True)
        client.force_login(world.users[caller.user])
        before = snapshot()
        _, r = request(client, "POST", route, PAGES[("POST", route)], world.values(caller, "own"))
        if r.status_code != 403 or b"CSRF" not in r.content:
            failures.append(f"{name} POST {route} without a token: {r.status_code}")
        if snapshot() != before:
            failures.append(f"{name} POST {route} without a token changed something")
    # Signing out is a POST too: without the token the session stays signed in.
    client = Client(enforce_csrf_checks=True)
    client.force_login(world.users["u-member"])
    if (
        client.post(reverse("logout")).status_code != 403
        or client.get(reverse("sandboxes")).status_code != 200
    ):
        failures.append("a POST to log out without a token signed the session out")
    # With the token (as the pages send it, in htmx's header) the same action goes through.
    client.get(reverse("sandboxes"))
    token = client.cookies["csrftoken"].value
    sandbox_id = world.sets["matrix"]["sandbox_id"]
    r = client.post(reverse("sandbox_delete", args=[sandbox_id]), HTTP_X_CSRFTOKEN=token)
    if r.status_code != 302 or Sandbox.objects.get(id=sandbox_id).status != Sandbox.Status.DELETED:
        failures.append(
            f"the same delete with the token: {r.status_code}, {Sandbox.objects.get(id=sandbox_id).status}"
        )
    assert not failures, "\n".join(failures)
    report.held("authorization", "session POST without a CSRF token (11 actions and sign-out) refused",
                cells=len(CSRF_CELLS) + 1)  # fmt: skip


# -- the Team page's actions: each refused below the role it needs, changing nothing ------------

# (caller, action, form): what the Team page posts, each one its caller may not do. The actions
# that come before the page's own admin check are each checked by their service.
TEAM_ACTIONS = [
    (role, action, data)
    for role in ("viewer", "member")
    for action, data in (
        ("member_add", {"username": "u-outsider", "role": "member"}),
        ("member_role", {"username": "u-admin", "role": "viewer"}),
        ("member_remove", {"username": "u-admin"}),
        ("invite", {"role": "member", "days": "1"}),
        ("token_create", {"name": "up", "role": "owner"}),  # a token above one's own role
        ("token_revoke", {"token": "{owner_token}"}),  # another user's token
    )
] + [("admin", "member_role", {"username": "u-owner", "role": "viewer"})]  # an admin over an owner


def test_the_team_pages_actions_are_refused_below_their_role_and_change_nothing(world, report):
    owner = world.users["u-owner"]
    owner_token = auth_svc.token_create(user=owner, team=world.teams["matrix"], name="owners").token
    failures = []
    for name, action, data in TEAM_ACTIONS:
        caller = CALLERS[name]
        assert caller is not None
        client = Client()
        client.force_login(world.users[caller.user])
        before = snapshot()
        form = {"action": action, **{k: v.format(owner_token=owner_token.id) for k, v in data.items()}}
        r = client.post(reverse("team"), form, follow=True)
        if snapshot() != before:
            failures.append(f"{name} {action}: changed something ({r.status_code})")
        if r.status_code not in (200, 403, 404) or (r.status_code == 200 and b"class=\"error" not in r.content
                                               and b"role=\"alert\"" not in r.content):  # fmt: skip
            failures.append(f"{name} {action}: {r.status_code}, and no refusal on the page")
    # A positive control: an admin's role change goes through.
    client = Client()
    client.force_login(world.users["u-admin"])
    client.post(reverse("team"), {"action": "member_role", "username": "u-member", "role": "viewer"})
    if Membership.objects.get(user__username="u-member", team=world.teams["matrix"]).role != "viewer":
        failures.append("an admin's role change did not go through: the cells above prove nothing")
    assert not failures, "\n".join(failures)
    report.held("authorization", "the Team page's actions below their role (viewer, member, an admin over "
                "an owner): refused, nothing changed", cells=len(TEAM_ACTIONS))  # fmt: skip
