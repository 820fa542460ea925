"""A joined node's own database role (runtime/services/node_roles.py): it reaches what a node's
processes use and nothing of users, tokens, sessions, keys or teams' settings; a removed node's
credentials stop working; every table of the schema is either granted or decided against. The
fleet tests (tests/reliability/test_fleet.py, tests/test_node_cli.py) run real nodes on it."""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit

import psycopg
import pytest
from django.db import connection, transaction
from psycopg import errors

from runtime.errors import Conflict
from runtime.models import Node, NodeJoinToken
from runtime.services import fleet, node_roles

# Tables a node is never granted beyond node_roles.NEVER, each decided: a new table must be
# added to NODE_GRANTS or here (the first test fails until it is).
NOT_FOR_NODES = node_roles.NEVER | {
    "django_content_type",  # migrations' bookkeeping: the control plane migrates
    "runtime_pool",  # pools are refilled on the control plane
    "runtime_tracelog",  # OTLP logs arrive at the server
}


def _tables() -> set[str]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p')"
        )
        return {name for (name,) in cur.fetchall()}


def _join(name: str) -> dict:
    return fleet.node_join(raw=fleet.join_token_create(user=None).raw, name=name, labels={})


def _drop_role(name: str) -> None:
    node_roles.node_role_drop(name)


@pytest.fixture
def joined(transactional_db):
    """A node joined through the real service; its role dropped after the test."""
    made: list[str] = []

    def join(name: str) -> dict:
        made.append(name)
        return _join(name)

    yield join
    for name in made:
        _drop_role(name)


def _connect(url: str) -> psycopg.Connection:
    return psycopg.connect(url, autocommit=True, connect_timeout=10)


def test_every_table_is_granted_to_nodes_or_decided_against(db):
    tables = _tables()
    assert not set(node_roles.NODE_GRANTS) & NOT_FOR_NODES
    assert set(node_roles.NODE_GRANTS) <= tables, set(node_roles.NODE_GRANTS) - tables
    undecided = tables - set(node_roles.NODE_GRANTS) - NOT_FOR_NODES
    assert not undecided, (
        f"tables neither in node_roles.NODE_GRANTS nor in NOT_FOR_NODES: {sorted(undecided)}"
    )


def test_a_joined_node_reaches_the_sandbox_tables_and_nothing_of_users_tokens_or_keys(joined):
    got = joined("role-a")
    url = urlsplit(got["database_url"])
    assert url.username == node_roles.role_name("role-a") and url.password and len(url.password) >= 24
    assert url.path == f"/{connection.settings_dict['NAME']}"
    node = Node.objects.get(name="role-a")
    with _connect(got["database_url"]) as conn:
        assert conn.execute("SELECT current_user").fetchone()[0] == url.username
        # What a node does: its heartbeat, a sandbox row, a span, a harness's log, an image it holds.
        conn.execute("UPDATE runtime_node SET heartbeat_at = now() WHERE id = %s", [node.id])
        conn.execute("SELECT id, status FROM runtime_sandbox FOR UPDATE")
        conn.execute("SELECT count(*) FROM runtime_secret")
        conn.execute("SELECT nextval(pg_get_serial_sequence('runtime_tracespan', 'id'))")
        conn.execute("SELECT target, action FROM runtime_auditevent")
        # What it may not: users' password hashes, sessions, token and key hashes, teams' settings.
        for table in sorted(node_roles.NEVER & _tables()):
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(f"SELECT 1 FROM {table} LIMIT 1")
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute("SELECT session FROM runtime_auditevent")  # who did what from where
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute("DELETE FROM runtime_sandbox")  # rows end through their transitions
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute("INSERT INTO runtime_team (name) VALUES ('made-by-a-node')")
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute(f"ALTER ROLE {url.username} SUPERUSER")


def test_a_removed_node_loses_its_credentials_and_a_new_join_gets_new_ones(joined):
    first = joined("role-b")
    conn = _connect(first["database_url"])
    fleet.node_remove(name="role-b")
    with connection.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [node_roles.role_name("role-b")])
        assert cur.fetchone() is None
    with pytest.raises(psycopg.OperationalError):  # its open connection was ended
        conn.execute("SELECT 1")
    with pytest.raises(psycopg.OperationalError, match="does not exist|authentication failed"):
        _connect(first["database_url"])
    again = joined("role-b")  # taken back by a join: a role again, with a new password
    assert urlsplit(again["database_url"]).password != urlsplit(first["database_url"]).password
    with _connect(again["database_url"]) as conn:
        assert conn.execute("SELECT count(*) FROM runtime_node WHERE name = 'role-b'").fetchone()[0] == 1


def test_without_roles_a_node_gets_the_control_planes_credentials_or_the_join_is_refused(
    joined, settings, monkeypatch
):
    settings.HANGAR_NODE_DB_ROLES = "off"
    assert joined("role-off")["database_url"] == settings.DATABASE_URL
    settings.HANGAR_NODE_DB_ROLES = "auto"
    monkeypatch.setattr(node_roles, "_may_create_roles", lambda: False)
    assert joined("role-auto")["database_url"] == settings.DATABASE_URL  # with a warning in the log
    settings.HANGAR_NODE_DB_ROLES = "on"
    issued = fleet.join_token_create(user=None)
    with pytest.raises(Conflict, match="may not create roles"):
        fleet.node_join(raw=issued.raw, name="role-on", labels={})
    assert NodeJoinToken.objects.get(id=issued.token.id).used == 0  # not spent on the refusal
    assert not Node.objects.filter(name="role-on").exists()


def test_a_migration_grants_the_roles_there_are_what_nodes_use(joined):
    got = joined("role-c")
    role = node_roles.role_name("role-c")
    with connection.cursor() as cur:
        cur.execute(f'REVOKE ALL ON runtime_sandbox FROM "{role}"')
    with _connect(got["database_url"]) as conn, pytest.raises(errors.InsufficientPrivilege):
        conn.execute("SELECT 1 FROM runtime_sandbox")
    node_roles.node_roles_regrant()  # what post_migrate runs
    with _connect(got["database_url"]) as conn:
        conn.execute("SELECT 1 FROM runtime_sandbox")


def test_a_control_plane_user_with_createrole_that_owns_the_tables_makes_and_drops_roles(transactional_db):
    """Not a superuser: a user with CREATEROLE that owns Hangar's tables (it migrated them), as a
    managed Postgres gives one. It makes a node's role, grants it, and drops it on remove."""
    cp = f"hangar_cp_{uuid.uuid4().hex[:8]}"
    with connection.cursor() as cur:
        cur.execute("SELECT current_user")
        (owner,) = cur.fetchone()
        tables = sorted(_tables())
        cur.execute(f'CREATE ROLE "{cp}" NOSUPERUSER CREATEROLE')
        for table in tables:
            cur.execute(f'ALTER TABLE "{table}" OWNER TO "{cp}"')
    try:
        with connection.cursor() as cur:
            cur.execute(f'SET ROLE "{cp}"')
        assert node_roles._may_create_roles()
        url = node_roles.node_database_url("role-d")
        role = node_roles.role_name("role-d")
        assert urlsplit(url).username == role
        with _connect(url) as conn:
            conn.execute("SELECT count(*) FROM runtime_sandbox")
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute("SELECT 1 FROM runtime_apitoken")
        assert node_roles.node_database_url("role-d") != url  # joined again: a new password
        with transaction.atomic():
            node_roles.node_role_drop("role-d")
        with connection.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
            assert cur.fetchone() is None
    finally:
        with connection.cursor() as cur:
            cur.execute("RESET ROLE")
            for table in tables:
                cur.execute(f'ALTER TABLE "{table}" OWNER TO "{owner}"')
            cur.execute(f'DROP OWNED BY "{cp}"')
            cur.execute(f'DROP ROLE "{cp}"')
            cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [node_roles.role_name("role-d")])
            if cur.fetchone():
                cur.execute(f'DROP OWNED BY "{node_roles.role_name("role-d")}"')
                cur.execute(f'DROP ROLE "{node_roles.role_name("role-d")}"')


def test_a_user_with_createrole_that_does_not_own_the_tables_hands_out_its_own_credentials(
    transactional_db, settings
):
    cp = f"hangar_cp_{uuid.uuid4().hex[:8]}"
    with connection.cursor() as cur:
        cur.execute(f'CREATE ROLE "{cp}" NOSUPERUSER CREATEROLE')
        cur.execute(f'SET ROLE "{cp}"')
    try:
        assert not node_roles._may_create_roles()  # it could make a role, but not grant it our tables
        assert node_roles.node_database_url("role-e") == settings.DATABASE_URL
        settings.HANGAR_NODE_DB_ROLES = "on"
        with pytest.raises(node_roles.NodeRoleRefused, match="own Hangar's tables"):
            node_roles.node_database_url("role-e")
    finally:
        with connection.cursor() as cur:
            cur.execute("RESET ROLE")
            cur.execute(f'DROP ROLE "{cp}"')
