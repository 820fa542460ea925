"""Each joined node's own Postgres role: what a node is handed at its join instead of the
control plane's own database credentials (docs/fleet.md, "What a compromised node can reach").

A node's processes (its Celery worker on ``node.<name>``, its stream bridge, its heartbeat and
reconciliation) read and write the sandbox side of the schema: ``NODE_GRANTS`` lists every
table they touch and how. The role gets exactly that, so a node taken over cannot read users'
password hashes, sessions, API-token, invitation or join-token hashes, SSH keys, memberships or
team policies, nor write anything outside its work (it cannot make a token, a user or a team).
It still reads every team's secrets' ciphertext (a node decrypts a sandbox's secrets to start
it, with the keys its operator gives it) and writes the shared sandbox tables.

The role is named from the database and the node's name, so two Hangars on one Postgres
cluster never share one; its password is new at each join; removing the node drops it (and
ends its connections). Grants are applied at each join and after each ``migrate`` (for the
tables a new migration adds to ``NODE_GRANTS``). Needs a control plane whose database user
may create roles (``CREATEROLE`` or a superuser): ``HANGAR_NODE_DB_ROLES`` says what to do
when it may not."""

from __future__ import annotations

import hashlib
import logging
import secrets
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from psycopg import sql

log = logging.getLogger(__name__)

# table → what a node does with it (columns where a node needs only some). Found by reading
# every node code path; tests/runtime/test_node_roles.py checks the sensitive ones are absent and
# the fleet tests run nodes on these roles.
NODE_GRANTS: dict[str, str] = {
    "runtime_node": "SELECT, INSERT, UPDATE",  # register, heartbeat, its allocation (trigger)
    "runtime_sandbox": "SELECT, UPDATE",  # transitions, moves, activity, stats
    "runtime_sandboxevent": "SELECT, INSERT",
    "runtime_usagehour": "SELECT, INSERT, UPDATE",  # usage accrued in each transition
    "runtime_image": "SELECT, INSERT, UPDATE",  # images it builds, pulls and holds
    "runtime_image_nodes": "SELECT, INSERT, DELETE",
    "runtime_imagejob": "SELECT, UPDATE",
    "runtime_volume": "SELECT",
    "runtime_sandboxvolume": "SELECT",
    "runtime_exec": "SELECT, UPDATE",  # a process's pid and end (the bridge)
    "runtime_terminal": "SELECT, UPDATE",
    "runtime_run": "SELECT, UPDATE",  # a run ended by the bridge when the broker is down
    "runtime_harness": "SELECT, UPDATE",  # a harness's setup
    "runtime_harnesslogentry": "SELECT, INSERT, DELETE",
    "runtime_secret": "SELECT",  # ciphertext: a sandbox's env, and masking spans
    "runtime_team": "SELECT",
    "runtime_trace": "SELECT, INSERT, UPDATE",  # Hangar's own spans of a start
    "runtime_tracespan": "SELECT, INSERT",
    "runtime_tracevalue": "SELECT, INSERT",
    # Which task a stopping sandbox waits on, after a lost worker: never who did it or from where.
    "runtime_auditevent": "SELECT (id, target, action, created_at)",
}

# Never granted, whatever NODE_GRANTS grows to (tests/runtime/test_node_roles.py checks it).
NEVER: frozenset[str] = frozenset({
    "auth_user", "auth_group", "auth_permission", "auth_user_groups", "auth_user_user_permissions",
    "auth_group_permissions", "django_session", "django_admin_log", "django_migrations",
    "runtime_apitoken", "runtime_invitation", "runtime_sshkey", "runtime_nodejointoken",
    "runtime_membership", "runtime_teampolicy", "runtime_sitedefaults",
    "runtime_noderedisuser",  # nodes' Redis users' password hashes (runtime/services/node_redis.py)
})  # fmt: skip


class NodeRoleRefused(Exception):
    """The control plane's database user may not make roles, and HANGAR_NODE_DB_ROLES=on."""


def postgres() -> bool:
    return connection.vendor == "postgresql"


def role_name(node_name: str) -> str:
    """``hangar_node_<hash>``: of the database and the node's name (Postgres roles belong to the
    whole cluster, which several Hangars may share)."""
    digest = hashlib.sha256(f"{connection.settings_dict['NAME']}\0{node_name}".encode()).hexdigest()
    return f"hangar_node_{digest[:20]}"


def on_node_role() -> bool:
    """Whether this process reaches the database as a joined node's role (it may not migrate)."""
    return postgres() and connection.settings_dict.get("USER", "").startswith("hangar_node_")


# Catalog rows that GRANTs and role changes rewrite are not locked by Postgres: two joins at once
# may fail one with "tuple concurrently updated". Every change here takes this lock first.
_LOCK = 0x68616E67  # "hang"


def _serialize(cur: Any) -> None:
    cur.execute("SELECT pg_advisory_xact_lock(%s)", [_LOCK])


def _may_create_roles() -> bool:
    """A superuser, or a user with CREATEROLE that owns every table nodes use (it made them, by
    migrating): only an owner may grant a table to another role."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT rolsuper OR (rolcreaterole AND NOT EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = "
            "current_schema() AND tablename = ANY(%s) AND tableowner <> current_user)) "
            "FROM pg_roles WHERE rolname = current_user",
            [list(NODE_GRANTS)],
        )
        row = cur.fetchone()
    return bool(row and row[0])


def _where(cur: Any, role: str, verb: str) -> None:
    """CONNECT on the database and USAGE on the schema, to or from ``role``: where this user may
    (it owns them); where it may not, PUBLIC's defaults (both, in a new database) let nodes in."""
    who, prep = sql.Identifier(role), "TO" if verb == "GRANT" else "FROM"
    cur.execute("SELECT current_database(), current_schema()")
    database, schema = cur.fetchone()
    for what, name in (("DATABASE", database), ("SCHEMA", schema)):
        privilege = "CONNECT" if what == "DATABASE" else "USAGE"
        try:
            with transaction.atomic():
                cur.execute(
                    sql.SQL(f"{verb} {privilege} ON {what} {{}} {prep} {{}}").format(
                        sql.Identifier(name), who
                    )
                )
        except DatabaseError:
            log.info("%s %s on %s %s: not this user's to give", verb, privilege, what.lower(), name)


def _grant(cur: Any, role: str) -> None:
    who = sql.Identifier(role)
    _where(cur, role, "GRANT")
    cur.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p') AND c.relname = ANY(%s)",
        [list(NODE_GRANTS)],
    )
    present = {name for (name,) in cur.fetchall()}
    for table, privileges in NODE_GRANTS.items():
        if table not in present:
            continue  # a migration not applied yet: granted after it is
        cur.execute(sql.SQL("GRANT {} ON {} TO {}").format(sql.SQL(privileges), sql.Identifier(table), who))
        if "INSERT" in privileges:  # the id's sequence (serial or identity)
            cur.execute("SELECT pg_get_serial_sequence(%s, 'id')", [table])
            (sequence,) = cur.fetchone()
            if sequence:  # already quoted by Postgres
                cur.execute(
                    sql.SQL("GRANT USAGE, SELECT ON SEQUENCE {} TO {}").format(sql.SQL(sequence), who)
                )


def node_database_url(node_name: str) -> str:
    """The DATABASE_URL a joining node is handed: its own role's (made or given a new password),
    or, where roles are off or cannot be made, the control plane's own (``HANGAR_NODE_DB_ROLES``:
    ``auto``, the default, makes them when it may; ``on`` refuses the join when it may not;
    ``off`` hands every node the control plane's credentials)."""
    mode = settings.HANGAR_NODE_DB_ROLES
    if mode == "off" or not postgres():
        return settings.DATABASE_URL
    if not _may_create_roles():
        why = ("the control plane's database user may not create roles for nodes (it needs to be a superuser, or "
               "to have CREATEROLE and own Hangar's tables)")  # fmt: skip
        if mode == "on":
            raise NodeRoleRefused(f"{why}, and HANGAR_NODE_DB_ROLES=on")
        log.warning("%s: node %s gets the control plane's own database credentials", why, node_name)
        return settings.DATABASE_URL
    role, password = role_name(node_name), secrets.token_urlsafe(24)
    with connection.cursor() as cur:
        _serialize(cur)
        cur.execute("SELECT rolsuper OR rolreplication OR rolcreaterole OR rolcreatedb FROM pg_roles "
                    "WHERE rolname = %s", [role])  # fmt: skip
        row = cur.fetchone()
        if row is None:
            cur.execute(sql.SQL(
                "CREATE ROLE {} WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION PASSWORD {}"
            ).format(sql.Identifier(role), sql.Literal(password)))  # fmt: skip
        elif row[0]:  # not one this module made: never hand out a role with powers
            raise NodeRoleRefused(
                f"the database role {role} exists with more than a node's powers; drop it first"
            )
        else:  # a node that joins again: a new password (what ALTER ROLE lets a non-superuser say)
            cur.execute(sql.SQL("ALTER ROLE {} WITH LOGIN PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(password)))  # fmt: skip
        _grant(cur, role)
    # The control plane's URL (host, port, options) with the role's name and password, and the
    # database this process uses (the same but in tests, which use a database of their own).
    parts = urlsplit(settings.DATABASE_URL)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(
        netloc=f"{quote(role, safe='')}:{quote(password, safe='')}@{host}",
        path="/" + quote(str(connection.settings_dict["NAME"]), safe=""),
    ))  # fmt: skip


def node_role_drop(node_name: str) -> None:
    """A removed node's role goes (in the caller's transaction) and, once that commits, its open
    connections are ended: its credentials no longer work."""
    if not postgres() or not _may_create_roles():
        return
    role = role_name(node_name)
    who = sql.Identifier(role)
    with connection.cursor() as cur:
        _serialize(cur)
        cur.execute("SELECT oid FROM pg_roles WHERE rolname = %s", [role])
        row = cur.fetchone()
        if row is None:
            return
        oid = row[0]
        cur.execute("SELECT current_schema()")
        (schema,) = cur.fetchone()
        # Its grants here (what an owner may revoke; column grants go with their table's).
        cur.execute(
            sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA {} FROM {}").format(sql.Identifier(schema), who)
        )
        cur.execute(
            sql.SQL("REVOKE ALL ON ALL SEQUENCES IN SCHEMA {} FROM {}").format(sql.Identifier(schema), who)
        )
        _where(cur, role, "REVOKE")
        cur.execute(sql.SQL("DROP ROLE {}").format(who))

    def end_sessions() -> None:
        try:
            with connection.cursor() as cur:
                cur.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usesysid = %s", [oid]
                )
        except Exception:  # a user without the right to signal them: they hold no privileges now
            log.warning(
                "could not end the sessions of node %s's dropped database role", node_name, exc_info=True
            )

    transaction.on_commit(end_sessions)


def node_roles_regrant(**_: object) -> None:
    """After ``migrate``: the roles of the nodes there are get the grants of tables made since."""
    if not postgres() or settings.HANGAR_NODE_DB_ROLES == "off":
        return
    from ..models import Node

    try:
        with transaction.atomic():
            names = list(Node.objects.values_list("name", flat=True))
            with connection.cursor() as cur:
                _serialize(cur)
                cur.execute("SELECT rolname FROM pg_roles WHERE rolname LIKE %s", ["hangar\\_node\\_%"])
                existing = {name for (name,) in cur.fetchall()}
                for name in names:
                    if (role := role_name(name)) in existing:
                        _grant(cur, role)
    except Exception:  # a database user that may not grant: the next join grants
        log.warning("could not renew the nodes' database grants", exc_info=True)
