"""Who may call what: every endpoint of the API (read from its URL conf, so a new endpoint
without a row below fails here) against every kind of caller, each cell's answer checked
against the table below: the table is the specification, written here and not read from
``dashboard/api/permissions.py``, so a rule loosened there fails a cell here."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from dashboard.api import api
from dashboard.api.permissions import RULES
from runtime.models import ApiToken, Membership, Team
from runtime.services import auth as auth_svc

ROLES = ("viewer", "member", "admin", "owner")
SB = "/sandboxes/{sandbox_id}"

# Who may call each endpoint: "<least role> <scope>" (a token needs the scope: its own, its
# ``resource:*``, ``admin``, or no scopes at all; ``write`` covers ``read``), "staff <scope>"
# (site staff, whatever their role), "staff+<role> <scope>" (staff of at least that role),
# "<role> any-scope" (a token of any scopes), or "public" (no token needed).
EXPECTED: dict[tuple[str, str], str] = {
    # Sandboxes: viewers look, members change and run things.
    ("POST", "/sandboxes"): "member sandboxes:write",
    ("GET", "/sandboxes"): "viewer sandboxes:read",
    ("GET", f"{SB}"): "viewer sandboxes:read",
    ("DELETE", f"{SB}"): "member sandboxes:write",
    ("POST", f"{SB}/exec"): "member sandboxes:write",
    ("POST", f"{SB}/keepalive"): "member sandboxes:write",
    ("POST", f"{SB}/pause"): "member sandboxes:write",
    ("POST", f"{SB}/resume"): "member sandboxes:write",
    ("POST", f"{SB}/stop"): "member sandboxes:write",
    ("PUT", f"{SB}/network"): "member sandboxes:write",
    ("GET", f"{SB}/ports"): "viewer sandboxes:read",
    ("POST", f"{SB}/ports"): "member sandboxes:write",
    ("DELETE", f"{SB}/ports/{{port}}"): "member sandboxes:write",
    ("PUT", f"{SB}/files"): "member sandboxes:write",
    ("GET", f"{SB}/files"): "viewer sandboxes:read",
    ("GET", f"{SB}/files/list"): "viewer sandboxes:read",
    ("GET", f"{SB}/stats"): "viewer sandboxes:read",
    ("GET", f"{SB}/events"): "viewer sandboxes:read",
    ("GET", f"{SB}/processes"): "viewer sandboxes:read",
    ("GET", f"{SB}/processes/{{process_id}}"): "viewer sandboxes:read",
    ("GET", f"{SB}/processes/{{process_id}}/output"): "viewer sandboxes:read",
    ("POST", f"{SB}/processes/{{process_id}}/stdin"): "member sandboxes:write",
    ("POST", f"{SB}/processes/{{process_id}}/signal"): "member sandboxes:write",
    ("POST", f"{SB}/terminals"): "member sandboxes:write",
    ("GET", f"{SB}/terminals"): "viewer sandboxes:read",
    ("DELETE", f"{SB}/terminals/{{terminal_id}}"): "member sandboxes:write",
    # Images are shared by every team: only staff build or pull them.
    ("GET", "/images"): "viewer images:read",
    ("POST", "/images/build"): "staff+member images:write",
    ("POST", "/images/pull"): "staff+member images:write",
    ("GET", "/images/jobs"): "viewer images:read",
    ("GET", "/images/jobs/{job_id}"): "viewer images:read",
    # Volumes and warm pools: as sandboxes.
    ("POST", "/volumes"): "member volumes:write",
    ("GET", "/volumes"): "viewer volumes:read",
    ("GET", "/volumes/{volume}"): "viewer volumes:read",
    ("DELETE", "/volumes/{volume}"): "member volumes:write",
    ("POST", "/pools"): "member pools:write",
    ("GET", "/pools"): "viewer pools:read",
    ("GET", "/pools/{pool_id}"): "viewer pools:read",
    ("PATCH", "/pools/{pool_id}"): "member pools:write",
    ("DELETE", "/pools/{pool_id}"): "member pools:write",
    # Tokens are one's own (issued at most at one's own role and scopes): any role.
    ("GET", "/tokens"): "viewer tokens:read",
    ("GET", "/tokens/current"): "viewer any-scope",
    ("POST", "/tokens"): "viewer tokens:write",
    ("DELETE", "/tokens/{token_id}"): "viewer tokens:write",
    ("GET", "/health"): "public",
    # Teams: admins manage members, invitations, quotas and budgets; anyone may leave;
    # staff set the ceilings and rates every team lives under.
    ("GET", "/teams"): "viewer teams:read",
    ("POST", "/teams"): "staff teams:write",
    ("GET", "/teams/{team_id}/members"): "viewer teams:read",
    ("POST", "/teams/{team_id}/members"): "admin teams:write",
    ("PATCH", "/teams/{team_id}/members/{username}"): "admin teams:write",
    ("DELETE", "/teams/{team_id}/members/{username}"): "viewer teams:write",
    ("GET", "/teams/{team_id}/invitations"): "admin teams:read",
    ("POST", "/teams/{team_id}/invitations"): "admin teams:write",
    ("DELETE", "/teams/{team_id}/invitations/{invitation_id}"): "admin teams:write",
    ("GET", "/teams/{team_id}/quotas"): "viewer teams:read",
    ("PUT", "/teams/{team_id}/quotas"): "admin teams:write",
    ("PUT", "/teams/{team_id}/quotas/ceilings"): "staff teams:write",
    ("GET", "/teams/{team_id}/usage"): "admin teams:read",
    ("GET", "/teams/{team_id}/budget"): "admin teams:read",
    ("PUT", "/teams/{team_id}/budget"): "admin teams:write",
    ("GET", "/teams/{team_id}/rates"): "viewer teams:read",
    ("PUT", "/teams/{team_id}/rates"): "staff teams:write",
    # Secrets: anyone in the team sees the names (to give them to sandboxes); admins manage them.
    ("GET", "/secrets"): "viewer secrets:read",
    ("POST", "/secrets"): "admin secrets:write",
    ("PUT", "/secrets/{name}"): "admin secrets:write",
    ("DELETE", "/secrets/{name}"): "admin secrets:write",
    # The audit log is for admins; traces for the whole team.
    ("GET", "/audit"): "admin audit:read",
    ("GET", "/traces"): "viewer traces:read",
    ("GET", "/traces/{trace_id}"): "viewer traces:read",
    ("GET", "/traces/{trace_id}/values/{value_id}"): "viewer traces:read",
    # Harnesses: members create and use them (a shell is a member's right); viewers look.
    ("POST", "/harnesses"): "member harnesses:write",
    ("GET", "/harnesses"): "viewer harnesses:read",
    ("GET", "/harnesses/{harness_id}"): "viewer harnesses:read",
    ("DELETE", "/harnesses/{harness_id}"): "member harnesses:write",
    ("POST", "/harnesses/{harness_id}/pause"): "member harnesses:write",
    ("POST", "/harnesses/{harness_id}/resume"): "member harnesses:write",
    ("GET", "/harnesses/{harness_id}/logs"): "viewer harnesses:read",
    ("POST", "/harnesses/{harness_id}/runs"): "member harnesses:write",
    ("GET", "/harnesses/{harness_id}/runs"): "viewer harnesses:read",
    ("GET", "/runs/{run_id}"): "viewer harnesses:read",
    ("GET", "/runs/{run_id}/logs"): "viewer harnesses:read",
    ("POST", "/runs/{run_id}/cancel"): "member harnesses:write",
    # SSH keys are each user's own, whatever their role.
    ("GET", "/ssh-keys"): "viewer ssh_keys:read",
    ("POST", "/ssh-keys"): "viewer ssh_keys:write",
    ("DELETE", "/ssh-keys/{key_id}"): "viewer ssh_keys:write",
    # Nodes: anyone sees names and states; staff run them. A joining node has a join token.
    ("GET", "/nodes"): "viewer system:read",
    ("POST", "/nodes/{name}/cordon"): "staff system:write",
    ("POST", "/nodes/{name}/uncordon"): "staff system:write",
    ("POST", "/nodes/{name}/drain"): "staff system:write",
    ("DELETE", "/nodes/{name}"): "staff system:write",
    ("GET", "/nodes/tokens"): "staff system:read",
    ("POST", "/nodes/tokens"): "staff system:write",
    ("DELETE", "/nodes/tokens/{token_id}"): "staff system:write",
    ("POST", "/nodes/join"): "public",
    ("GET", "/site/quotas"): "staff system:read",
    ("PUT", "/site/quotas"): "staff system:write",
    ("GET", "/site/rates"): "staff system:read",
    ("PUT", "/site/rates"): "staff system:write",
}


def operations() -> list[tuple[str, str]]:
    ops = []
    for prefix, router in api._routers:
        for path, path_view in router.path_operations.items():
            for op in path_view.operations:
                for method in op.methods:
                    ops.append((method, f"{prefix}{path}" or "/"))
    return sorted(ops)


def test_every_endpoint_has_a_row_in_the_table_and_a_permission_rule():
    ops = operations()
    assert not (missing := [f"{m} {p}" for m, p in ops if (m, p) not in EXPECTED]), (
        f"endpoints without a row in this test's EXPECTED: {missing}"
    )
    assert not (stale := [f"{m} {p}" for m, p in EXPECTED if (m, p) not in ops]), stale
    missing = [f"{m} {p}" for m, p in ops if (m, p) not in RULES]
    assert not missing, f"endpoints without a rule in dashboard/api/permissions.py: {missing}"
    stale = [f"{m} {p}" for m, p in RULES if (m, p) not in ops]
    assert not stale, f"rules for endpoints that do not exist: {stale}"


@pytest.fixture
def callers(transactional_db):
    User = get_user_model()
    team = Team.objects.create(name="matrix")
    other = Team.objects.create(name="elsewhere")
    tokens: dict[str, str | None] = {"no token": None, "garbage": "hgr_not-a-real-token"}
    for role in ROLES:
        user = User.objects.create_user(username=f"u-{role}", password="x")
        Membership.objects.create(user=user, team=team, role=role)
        tokens[role] = auth_svc.token_create(user=user, team=team, name=role).raw
    staff = User.objects.create_user(username="u-staff", password="x", is_staff=True)
    Membership.objects.create(user=staff, team=team, role="member")
    tokens["staff member"] = auth_svc.token_create(user=staff, team=team).raw
    owner = User.objects.get(username="u-owner")
    # An owner's token issued as a viewer can do what a viewer can, no more.
    tokens["owner's viewer token"] = auth_svc.token_create(user=owner, team=team, role="viewer").raw
    # Tokens limited by scope: to reading sandboxes; to harnesses (write covers read); to all of
    # teams (``teams:*``); ``admin`` (every scope, still at most the owner's role).
    for name, scopes in SCOPED.items():
        tokens[name] = auth_svc.token_create(user=owner, team=team, scopes=scopes).raw
    expired = auth_svc.token_create(user=owner, team=team, expires_in_s=60)
    ApiToken.objects.filter(id=expired.token.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    tokens["expired"] = expired.raw
    revoked = auth_svc.token_create(user=owner, team=team)
    ApiToken.objects.filter(id=revoked.token.id).update(revoked_at=timezone.now())
    tokens["revoked"] = revoked.raw
    outsider = User.objects.create_user(username="u-outsider", password="x")
    Membership.objects.create(user=outsider, team=other, role="owner")
    tokens["another team's owner"] = auth_svc.token_create(user=outsider, team=other).raw
    gone = User.objects.create_user(username="u-left", password="x")
    Membership.objects.create(user=gone, team=team, role="admin")
    tokens["a member who left"] = auth_svc.token_create(user=gone, team=team).raw
    Membership.objects.filter(user=gone).delete()
    return tokens


SCOPED = {
    "read-only scope": ["sandboxes:read"],
    "harnesses:write scope": ["harnesses:write"],
    "teams:* scope": ["teams:*"],
    "admin scope": ["admin"],
}
# Whose token each caller holds, and at what role it acts (the lower of the token's and the team's).
ACTS_AS = {
    "staff member": "member",
    "owner's viewer token": "viewer",
    "another team's owner": "owner",
    **{name: "owner" for name in SCOPED},
}
NO_CALLER = ("no token", "garbage", "expired", "revoked", "a member who left")


def covers(held: list[str], needed: str) -> bool:
    """Whether scopes ``held`` (none: all) let a token use ``needed``, as the table's key says."""
    resource, _, action = needed.partition(":")
    return needed == "any-scope" or any(
        h in (needed, "admin", f"{resource}:*") or (action == "read" and h == f"{resource}:write")
        for h in held
    )


def expected(caller: str, method: str, path: str) -> str:
    """ "allowed", "401" or "403" for ``caller`` at ``method path``, from :data:`EXPECTED`."""
    who, _, scope = EXPECTED[(method, path)].partition(" ")
    if who == "public":
        return "allowed"
    if caller in NO_CALLER:
        return "401"
    if caller in SCOPED and not covers(SCOPED[caller], scope):
        return "403"
    role = ACTS_AS.get(caller, caller)
    if who.startswith("staff"):
        if caller != "staff member":
            return "403"
        who = who.partition("+")[2] or "viewer"
    return "allowed" if ROLES.index(role) >= ROLES.index(who) else "403"


def test_the_authorization_matrix(callers, report):
    client = Client()
    failures = []
    for method, path in operations():
        # Ids that name nothing: an allowed caller gets 404 (or 422), never a change made.
        url = "/api/v1" + re.sub(r"\{(\w+)\}", lambda m: "999999" if m.group(1) in (
            "process_id", "terminal_id", "job_id", "token_id", "team_id") else "nosuch", path)  # fmt: skip
        for caller, raw in callers.items():
            headers = {"HTTP_AUTHORIZATION": f"Bearer {raw}"} if raw else {}
            r = client.generic(method, url, data="{}", content_type="application/json", **headers)
            want = expected(caller, method, path)
            got = str(r.status_code)
            ok = got == want if want in ("401", "403") else got not in ("401", "403") and r.status_code < 500
            if not ok:
                failures.append(f"{caller:>22}  {method:6} {path}: {got} (want {want}) {r.content[:120]!r}")
    assert not failures, "\n" + "\n".join(failures)
    report.held(
        "authorization",
        "endpoint x caller (4 roles, staff, 4 scoped tokens, viewer-issued, expired, revoked, "
        "removed member, another team, no token, garbage), against the test's own table",
        cells=len(operations()) * len(callers),
    )


# -- objects: own team's, another team's, nonexistent ---------------------------------------------

# The path parameters that name a team's (or a user's) object, and the least of it the matrix makes.
OBJECT_PARAMS = ("sandbox_id", "volume", "harness_id", "name", "pool_id", "run_id", "trace_id", "team_id",
                 "invitation_id", "token_id", "key_id")  # fmt: skip
SUB_IDS = {"process_id": "999999", "terminal_id": "999999", "port": "8000", "username": "nosuchuser",
           "value_id": "999999"}  # fmt: skip
# Whose user a caller's token is (its own tokens and SSH keys are that user's).
USER_OF = {**{role: f"u-{role}" for role in ROLES}, "staff member": "u-staff",
           "another team's owner": "u-outsider"}  # fmt: skip
MISSING = {"sandbox_id": "sbnosuch00000000000", "volume": "nosuch", "harness_id": "nosuch", "name": "NOSUCH",
           "pool_id": "plnosuch000000000000", "run_id": "rnnosuch000000000000", "trace_id": "f" * 32,
           "team_id": "999999", "invitation_id": "999999", "token_id": "999999", "key_id": "999999"}  # fmt: skip


def _objects(team: Team, tag: str, username: str) -> dict[str, str]:
    """One of each object in ``team``, and a token and an SSH key of ``username``'s there."""
    import secrets

    from runtime.models import Harness, Invitation, Pool, Run, Sandbox, Secret, SshKey, Volume
    from runtime.trace_models import Trace

    user = get_user_model().objects.get(username=username)
    sb = Sandbox.objects.create(
        team=team, image="busybox", image_digest="sha256:" + "a" * 64, status="stopped"
    )
    vol = Volume.objects.create(team=team, name=f"vol-{tag}", size_mb=64)
    h = Harness.objects.create(team=team, name=f"h-{tag}", agent="custom", image="busybox", sandbox=sb,
                               setup="done")  # fmt: skip
    Secret.objects.create(team=team, name=f"S_{tag.upper()}", ciphertext=b"x")
    pool = Pool.objects.create(team=team, image="busybox", size=0)
    run = Run.objects.create(harness=h, prompt="p", status="succeeded")
    trace = Trace.objects.create(team=team, trace_id=secrets.token_hex(16), start_ns=1, end_ns=2)
    invitation = Invitation.objects.create(
        team=team,
        role="member",
        token_hash=secrets.token_hex(32),
        expires_at=timezone.now() + timedelta(days=1),
    )
    token = auth_svc.token_create(user=user, team=team, name=f"t-{tag}").token
    key = SshKey.objects.create(user=user, team=team, name=f"k-{tag}", public_key="ssh-ed25519 AAAA",
                                fingerprint=f"SHA256:{secrets.token_hex(16)}")  # fmt: skip
    return {"sandbox_id": sb.id, "volume": vol.name, "harness_id": h.name, "name": f"S_{tag.upper()}",
            "pool_id": pool.id, "run_id": run.id, "trace_id": trace.trace_id, "team_id": str(team.id),
            "invitation_id": str(invitation.id), "token_id": str(token.id), "key_id": str(key.id)}  # fmt: skip


def footprint() -> str:
    """What any request at an object could change, as one digest of the rows (one query)."""
    from django.db import connection

    from runtime.models import (
        ApiToken,
        Harness,
        Invitation,
        Pool,
        Run,
        Sandbox,
        Secret,
        SshKey,
        TeamPolicy,
        Volume,
    )

    watched = {
        Sandbox: ("id", "status", "expires_at", "updated_at"), Harness: ("id", "deleted_at", "updated_at"),
        Volume: ("id", "size_mb"), Secret: ("id", "updated_at"), Pool: ("id", "size"),
        Run: ("id", "status", "cancel_requested"), ApiToken: ("id", "revoked_at"), SshKey: ("id", "team_id"),
        Invitation: ("id", "revoked_at", "accepted_at"), Membership: ("user_id", "team_id", "role"),
        TeamPolicy: tuple(f.column for f in TeamPolicy._meta.concrete_fields),
    }  # fmt: skip
    parts = []
    for model, columns in watched.items():
        row = "concat_ws('|', " + ", ".join(f"{c}::text" for c in columns) + ")"
        parts.append(
            f"(SELECT md5(coalesce(string_agg({row}, ',' ORDER BY {row}), '')) FROM {model._meta.db_table})"
        )
    with connection.cursor() as cur:
        cur.execute("SELECT " + " || ".join(parts))
        return cur.fetchone()[0]


def streamed_operations() -> set[tuple[str, str]]:
    """The operations that answer NDJSON streams."""
    spec = api.get_openapi_schema(path_prefix="")
    return {(method.upper(), path) for path, item in spec["paths"].items() for method, op in item.items()
            if any("application/x-ndjson" in r.get("content", {}) for r in op.get("responses", {}).values())}  # fmt: skip


def _streamed(method: str, url: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """A streamed answer read whole in the loop that made it, as a server does: Django's sync
    test client would leave the stream's watchers to a loop that is closing."""
    from asgiref.sync import async_to_sync
    from django.test import AsyncClient

    async def go() -> tuple[int, bytes]:
        auth = {"Authorization": headers["HTTP_AUTHORIZATION"]} if headers else {}
        r = await AsyncClient().generic(method, url, data="{}", content_type="application/json", headers=auth)
        if not r.streaming:
            return r.status_code, r.content
        return r.status_code, b"".join([chunk async for chunk in r.streaming_content])

    return async_to_sync(go)()


def _same(text: str, *ids: str) -> str:
    """``text`` with the ids it names masked: another team's object and a missing one compared."""
    return re.sub("|".join(re.escape(i) for i in ids if i), "<id>", text)


@pytest.mark.timeout(600)  # thousands of requests: minutes on a machine busy with another worker
def test_another_teams_objects_are_a_404_to_everyone_and_own_ones_are_reached(callers, report):
    """For every endpoint naming a team's object (a sandbox and what is under it, a volume, a
    harness, a secret, a pool, a run, a trace, the team itself, an invitation) or a user's (a
    token, an SSH key): the caller's own is reached (whatever the operation then says: never a
    404 for the object itself, never a 5xx); another team's is a 404 in the very words a name
    that does not exist gets (never a 409 or a 2xx that would tell it exists), for every caller
    that may call it; those that may not get their 401 or 403 first (before any view runs). A
    request at another team's or a missing object changes nothing."""
    matrix, elsewhere = Team.objects.get(name="matrix"), Team.objects.get(name="elsewhere")
    client = Client()
    failures = []
    cells = 0
    n = 0
    streams = streamed_operations()
    their_objects = {False: _objects(elsewhere, "t0", "u-outsider"), True: _objects(matrix, "t1", "u-owner")}
    own_objects: dict[str, dict[str, str]] = {}
    for method, path in operations():
        params = re.findall(r"\{(\w+)\}", path)
        named = [p for p in params if p in OBJECT_PARAMS]
        if not named or any(p not in OBJECT_PARAMS and p not in SUB_IDS for p in params):
            continue
        for caller in callers:  # every role and token state, each at the three objects
            outsider = caller == "another team's owner"  # the matrix team's objects are another team's to it
            theirs = their_objects[outsider]  # never changed: each request at them is checked for that
            if caller not in own_objects:  # new ones after a request that may change them
                n += 1
                team = elsewhere if outsider else matrix
                own_objects[caller] = _objects(team, f"m{n}", USER_OF.get(caller, "u-owner"))
            mine = own_objects[caller] if method == "GET" else own_objects.pop(caller)
            # Site staff manage every team (its members, quotas, ceilings and rates): another
            # team is theirs to reach, as their own is.
            site_wide = caller == "staff member" and "team_id" in named
            answers = {}
            for whose, ids in (("another team's", theirs), ("nonexistent", MISSING), ("own", mine)):
                url = "/api/v1" + re.sub(
                    r"\{(\w+)\}", lambda m, ids=ids: ids.get(m.group(1)) or SUB_IDS[m.group(1)], path
                )
                raw = callers[caller]
                headers = {"HTTP_AUTHORIZATION": f"Bearer {raw}"} if raw else {}
                want = expected(caller, method, path)
                reached = whose == "own" or (site_wide and whose == "another team's")
                # A refused caller is stopped before any view runs (its 401 or 403 is checked);
                # an allowed one at another team's or a missing object must change nothing.
                before = footprint() if not reached and want == "allowed" else None
                if (method, path) in streams and whose == "own":
                    got, content = _streamed(method, url, headers)
                else:
                    r = client.generic(method, url, data="{}", content_type="application/json", **headers)
                    got, content = r.status_code, r.content
                cells += 1
                detail = content.decode(errors="replace")
                answers[whose] = (got, _same(detail, *(ids[p] for p in named)))
                if before is not None and footprint() != before:
                    failures.append(
                        f"{caller:>22} {whose:>15}  {method:6} {path}: {got}, and it changed rows"
                    )
                if want != "allowed":
                    ok = str(got) == want  # refused (401, 403) before any object is looked up
                elif reached:
                    # Reached: anything the operation says but "no such <object>" (a 404 for a
                    # sub-object, a process 999999, is the operation's own answer); a 502 only
                    # for an object whose node this matrix never made.
                    own_missing = got == 404 and re.search(
                        r"no (sandbox|volume|harness|secret|pool|run|trace|team|invitation|token|key|ssh key)\b",
                        detail, re.I)  # fmt: skip
                    ok = (
                        not own_missing
                        and got not in (401, 403)
                        and (got < 500 or (got == 502 and "node" in detail))
                    )
                else:
                    # Another team's object answers exactly as a name that does not exist: a 404
                    # (or the 422 of a body checked before any lookup), never a 2xx or a 409.
                    ok = got in (404, 422)
                if not ok:
                    failures.append(f"{caller:>22} {whose:>15}  {method:6} {path}: {got} {content[:140]!r}")
            if not site_wide and (theirs_got := answers["another team's"]) != (
                missing_got := answers["nonexistent"]
            ):
                failures.append(f"{caller:>22} {method:6} {path}: another team's object answers {theirs_got}, "
                                f"a missing one {missing_got}")  # fmt: skip
    assert cells > 1000, cells
    assert not failures, f"{len(failures)} of {cells} cells:\n" + "\n".join(failures)
    report.held(
        "authorization",
        "endpoint x caller (every role and token state) x object (own team's, another team's, nonexistent): "
        "sandboxes, volumes, harnesses, secrets, pools, runs, traces, teams, invitations, tokens, SSH keys",
        cells=cells,
    )


# -- members: who may remove whom, and make whom what ------------------------------------------

# (acting role, target's role) -> what removing the target answers; leaving oneself is anyone's.
REMOVE = {
    **{(actor, target): "403" for actor in ("viewer", "member") for target in ROLES},
    **{("admin", target): "204" for target in ("viewer", "member", "admin")},
    ("admin", "owner"): "403",  # only an owner removes an owner
    **{("owner", target): "204" for target in ROLES},
}
# (acting role, target's role, new role) -> the answer: admins set roles below owner on
# non-owners; only an owner makes or unmakes an owner.
SET_ROLE = {
    **{(actor, target, new): "403" for actor in ("viewer", "member") for target in ROLES for new in ROLES},
    **{
        ("admin", target, new): "200"
        for target in ("viewer", "member", "admin")
        for new in ROLES
        if new != "owner"
    },
    **{("admin", target, "owner"): "403" for target in ROLES},
    **{("admin", "owner", new): "403" for new in ROLES},
    **{("owner", target, new): "200" for target in ROLES for new in ROLES},
}


def test_who_may_remove_whom_and_change_whose_role(transactional_db, report):
    """Every acting role × target's role × action on a team's members, against the tables
    above; a refusal changes nothing; anyone may leave (but the last owner, a 409)."""
    from runtime.models import Membership

    User = get_user_model()
    failures, n = [], 0

    def team_with(actor_role: str, target_role: str) -> tuple[Team, str, str]:
        nonlocal n
        n += 1
        team = Team.objects.create(name=f"members-{n}")
        users = {}
        for who, role in (("actor", actor_role), ("target", target_role), ("spare owner", "owner")):
            users[who] = User.objects.create(username=f"m{n}-{who.replace(' ', '-')}")  # no password to hash
            Membership.objects.create(user=users[who], team=team, role=role)
        raw = auth_svc.token_create(user=users["actor"], team=team).raw
        return team, raw, users["target"].username

    def call(method: str, url: str, raw: str, body: dict) -> int:
        r = Client().generic(method, url, data=json.dumps(body), content_type="application/json",
                             HTTP_AUTHORIZATION=f"Bearer {raw}")  # fmt: skip
        return r.status_code

    for (actor, target), want in REMOVE.items():
        team, raw, username = team_with(actor, target)
        before = sorted(Membership.objects.filter(team=team).values_list("user__username", "role"))
        got = str(call("DELETE", f"/api/v1/teams/{team.id}/members/{username}", raw, {}))
        after = sorted(Membership.objects.filter(team=team).values_list("user__username", "role"))
        if got != want or (want != "204") != (before == after):
            failures.append(f"{actor} removing a {target}: {got} (want {want}); members {before} -> {after}")
    for (actor, target, new), want in SET_ROLE.items():
        team, raw, username = team_with(actor, target)
        got = str(call("PATCH", f"/api/v1/teams/{team.id}/members/{username}", raw, {"role": new}))
        role = Membership.objects.get(team=team, user__username=username).role
        if got != want or role != (new if want == "200" else target):
            failures.append(f"{actor} making a {target} {new}: {got} (want {want}); now {role}")
    for role in ROLES:  # leaving
        team, raw, _ = team_with(role, "viewer")
        actor = Membership.objects.get(team=team, role=role, user__username__endswith="-actor").user.username
        got = call("DELETE", f"/api/v1/teams/{team.id}/members/{actor}", raw, {})
        if got != 204 or Membership.objects.filter(team=team, user__username=actor).exists():
            failures.append(f"a {role} leaving: {got}")
    team = Team.objects.create(name="last-owner")
    last = User.objects.create(username="last-owner")
    Membership.objects.create(user=last, team=team, role="owner")
    got = call(
        "DELETE",
        f"/api/v1/teams/{team.id}/members/last-owner",
        auth_svc.token_create(user=last, team=team).raw,
        {},
    )
    if got != 409:
        failures.append(f"the last owner leaving: {got} (want 409)")
    assert not failures, "\n".join(failures)
    report.held("authorization", "members: acting role x target's role x remove / set role, leaving, the last owner",
                cells=len(REMOVE) + len(SET_ROLE) + len(ROLES) + 1)  # fmt: skip
