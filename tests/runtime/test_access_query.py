"""The envd surface's one-query access check answers exactly as the two queries it replaced
(:func:`token_current`, then :func:`sandbox_get` for that token) in every case: live, revoked,
expired and orphaned tokens, roles and scopes, another team's sandbox, a missing or deleted one,
a harness's own token (real Postgres)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from runtime.errors import NotFound
from runtime.models import ApiToken, Harness, Membership, Node, Sandbox, Team
from runtime.services.access_query import token_and_sandbox
from runtime.services.auth import token_create, token_current
from runtime.services.sandboxes import sandbox_get


def _old_path(token_id: int, sandbox_id: str) -> tuple[ApiToken | None, Sandbox | None]:
    token = token_current(token_id=token_id)
    if token is None:
        return None, None
    try:
        return token, sandbox_get(team=token.team, sandbox_id=sandbox_id, caller=token)
    except NotFound:
        return token, None


def _row(obj: Any) -> dict[str, Any] | None:
    if obj is None:
        return None
    return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}


def _answer(token: ApiToken | None, sandbox: Sandbox | None) -> dict[str, Any]:
    """Everything a caller reads of the answer: the rows, as typed values, and the token's role."""
    return {
        "token": _row(token),
        "effective_role": getattr(token, "effective_role", None),
        "user": _row(token.user) if token else None,
        "team": _row(token.team) if token else None,
        "sandbox": _row(sandbox),
        "node": _row(sandbox.node) if sandbox else None,
    }


def assert_same(token_id: int, sandbox_id: str) -> tuple[ApiToken | None, Sandbox | None]:
    new = token_and_sandbox(token_id=token_id, sandbox_id=sandbox_id)
    assert _answer(*new) == _answer(*_old_path(token_id, sandbox_id))
    return new


@pytest.fixture
def world(db):
    User = get_user_model()
    alice = User.objects.create_user(username="alice", password="x")
    team = Team.objects.create(name="a")
    other = Team.objects.create(name="b")
    Membership.objects.create(user=alice, team=team, role="member")
    node = Node.objects.create(name="n1", launchers={"gvisor": {"network": True}})
    sb = Sandbox.objects.create(
        team=team, image="busybox", image_digest="sha256:x", status="running", node=node,
        env={"A": "1"}, metadata={"k": "v"}, handle={"id": "h"}, secrets=["S"],
        started_at=timezone.now(), last_activity_at=timezone.now(),
    )  # fmt: skip
    theirs = Sandbox.objects.create(team=other, image="busybox", image_digest="sha256:x", status="running")
    return {"alice": alice, "team": team, "other": other, "node": node, "sb": sb, "theirs": theirs}


def test_live_token_gets_its_teams_sandbox_with_its_node_and_typed_fields(world):
    issued = token_create(user=world["alice"], team=world["team"], scopes=["sandboxes:write"])
    token, sandbox = assert_same(issued.token.id, world["sb"].id)
    assert token is not None and sandbox is not None
    assert token.effective_role == "member" and token.scopes == ["sandboxes:write"]
    assert sandbox.node is not None and sandbox.node.launchers == {"gvisor": {"network": True}}
    assert sandbox.env == {"A": "1"} and sandbox.started_at is not None and sandbox.started_at.tzinfo


def test_sandbox_without_a_node(world):
    sb = Sandbox.objects.create(team=world["team"], image="busybox", image_digest="sha256:x")
    issued = token_create(user=world["alice"], team=world["team"])
    token, sandbox = assert_same(issued.token.id, sb.id)
    assert sandbox is not None and sandbox.node is None


def test_another_teams_sandbox_is_not_found(world):
    issued = token_create(user=world["alice"], team=world["team"])
    token, sandbox = assert_same(issued.token.id, world["theirs"].id)
    assert token is not None and sandbox is None


def test_missing_sandbox_is_not_found(world):
    issued = token_create(user=world["alice"], team=world["team"])
    token, sandbox = assert_same(issued.token.id, "sb_nope")
    assert token is not None and sandbox is None


def test_deleted_sandbox_comes_back_as_the_old_path_gave_it(world):
    Sandbox.objects.filter(id=world["sb"].id).update(status="deleted")
    issued = token_create(user=world["alice"], team=world["team"])
    _, sandbox = assert_same(issued.token.id, world["sb"].id)
    assert sandbox is not None and sandbox.status == "deleted"


def test_missing_token(world):
    assert assert_same(999_999, world["sb"].id) == (None, None)


def test_revoked_token(world):
    issued = token_create(user=world["alice"], team=world["team"])
    ApiToken.objects.filter(id=issued.token.id).update(revoked_at=timezone.now())
    assert assert_same(issued.token.id, world["sb"].id) == (None, None)


def test_expired_token(world):
    issued = token_create(user=world["alice"], team=world["team"])
    ApiToken.objects.filter(id=issued.token.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert assert_same(issued.token.id, world["sb"].id) == (None, None)


def test_token_that_has_not_expired_yet(world):
    issued = token_create(user=world["alice"], team=world["team"], expires_in_s=3600)
    token, sandbox = assert_same(issued.token.id, world["sb"].id)
    assert token is not None and token.expires_at is not None and sandbox is not None


def test_deactivated_user(world):
    issued = token_create(user=world["alice"], team=world["team"])
    get_user_model().objects.filter(id=world["alice"].id).update(is_active=False)
    assert assert_same(issued.token.id, world["sb"].id) == (None, None)


def test_user_who_left_the_team(world):
    issued = token_create(user=world["alice"], team=world["team"])
    Membership.objects.filter(user=world["alice"]).delete()
    assert assert_same(issued.token.id, world["sb"].id) == (None, None)


@pytest.mark.parametrize(
    ("token_role", "member_role", "effective"),
    [
        ("viewer", "member", "viewer"),
        ("member", "viewer", "viewer"),
        ("", "admin", "admin"),
        ("admin", "owner", "admin"),
    ],
)
def test_role_is_the_lower_of_the_tokens_and_the_membership(world, token_role, member_role, effective):
    Membership.objects.filter(user=world["alice"]).update(role="owner")
    issued = token_create(user=world["alice"], team=world["team"], role=token_role or None)
    ApiToken.objects.filter(id=issued.token.id).update(role=token_role)
    Membership.objects.filter(user=world["alice"]).update(role=member_role)
    token, _ = assert_same(issued.token.id, world["sb"].id)
    assert token is not None and token.effective_role == effective


def test_harness_token_reaches_its_harness_sandbox_and_what_it_created_only(world):
    team = world["team"]
    harness = Harness.objects.create(
        team=team, name="h", agent="claude", image="busybox", sandbox=world["sb"]
    )
    issued = token_create(user=world["alice"], team=team, harness=harness)
    mine = Sandbox.objects.create(
        team=team, image="busybox", image_digest="sha256:x", created_by_token=issued.token
    )
    elsewhere = Sandbox.objects.create(team=team, image="busybox", image_digest="sha256:x")
    assert assert_same(issued.token.id, world["sb"].id)[1] is not None
    assert assert_same(issued.token.id, mine.id)[1] is not None
    assert assert_same(issued.token.id, elsewhere.id)[1] is None
    # Every other token of the team reaches all three.
    plain = token_create(user=world["alice"], team=team)
    for sb in (world["sb"], mine, elsewhere):
        assert assert_same(plain.token.id, sb.id)[1] is not None
