"""The ``hangar`` command: run Hangar on one machine, join nodes, manage tokens and images."""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dashboard import node_cli, supervise


def _setup_django() -> Any:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
    import django

    django.setup()
    from django.conf import settings

    settings.DATA_DIR.mkdir(parents=True, exist_ok=True)
    return settings


def _as_cli() -> None:
    """What an admin command changes goes in the audit log as done from the CLI, by this
    machine's user (the long-running commands, up, node, bridge, act as Hangar itself)."""
    import getpass

    from runtime.services import audit

    audit.set_actor(audit.Actor(via="cli", username=f"cli:{getpass.getuser()}"))


def admin_setup() -> None:
    """What an admin command needs first: Django, the schema up to date, the CLI as the actor."""
    _setup_django()
    _migrate()
    _as_cli()


def _say(message: str) -> None:
    print(message, flush=True)


# -- embedded Redis ---------------------------------------------------------------------------


def _start_embedded_redis(data_dir: Path) -> subprocess.Popen[bytes]:
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit(
            "hangar: no REDIS_URL is set and redis-server is not installed; "
            "run `apt-get install redis-server` (or `make up`), or point REDIS_URL at a Redis server"
        )
    sock = data_dir / "redis.sock"
    sock.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [server, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700", "--save", "",
         "--appendonly", "no", "--dir", str(data_dir), "--logfile", str(data_dir / "redis.log")],
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"hangar: embedded redis-server did not start; see {data_dir / 'redis.log'}")
        time.sleep(0.02)
    return proc


# -- first start ------------------------------------------------------------------------------


def _prepare_node(settings: Any, *, build_default_image: bool) -> None:
    from runtime.launchers.base import LauncherError
    from runtime.node.local import local_capabilities, local_launchers, local_node_name, node_memory_mb
    from runtime.services.images import image_build, images_sync_local
    from runtime.services.nodes import local_disk_free_mb, node_register

    _private_data_dir(Path(settings.DATA_DIR))

    from runtime.models import Node

    tunnel = (
        f"{settings.HANGAR_NODE_ADDRESS}:{settings.HANGAR_TUNNEL_PORT}" if settings.HANGAR_TUNNEL_PORT else ""
    )

    def register() -> None:  # its heartbeat: from here on placement may choose it
        node_register(
            name=local_node_name(), launchers=local_capabilities(), cpu=settings.HANGAR_NODE_CPU,
            memory_mb=node_memory_mb(), version=_version(), tunnel_address=tunnel, disk_free_mb=local_disk_free_mb(),
        )  # fmt: skip

    # A node that has just joined (its row made by the join, never heard from, so never placed
    # on) first gets its runtimes ready and the default image, then says it is there.
    joined = Node.objects.filter(name=local_node_name(), heartbeat_at__isnull=True).exists()
    if not joined:
        register()
    images = images_sync_local()
    for runtime, launcher in local_launchers().items():
        try:
            launcher.prepare()  # so the first create does not wait for it
        except LauncherError as exc:
            _say(f"hangar: warning: the {runtime} runtime could not prepare: {exc}")
    if build_default_image and not images:
        _say("hangar: building the busybox image (first start)…")
        image_build(kind="busybox", progress=lambda line: _say(f"  {line}"))
    if joined:
        register()


def _private_data_dir(data_dir: Path) -> None:
    """The data dir holds what no other user of the host may reach: sandboxes' files and
    bundles, volumes (whose roots a sandbox can chmod), images with their setuid binaries,
    the SQLite database and the embedded Redis's socket. Root's alone, whatever made it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    mode = stat.S_IMODE(data_dir.stat().st_mode)
    if mode & 0o077:
        data_dir.chmod(0o700)
        _say(f"hangar: {data_dir} was open to other users (mode {mode:o}); it is now 700")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hangar")
    except PackageNotFoundError:
        return "dev"


def _migrate() -> None:
    from django.core.management import call_command

    from runtime.services.node_roles import on_node_role

    if on_node_role():
        return  # a joined node's own role may not change the schema: the control plane migrates
    call_command("migrate", interactive=False, verbosity=0)


def cmd_up(args: argparse.Namespace) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
    from django.conf import settings as lazy_settings

    data_dir = Path(lazy_settings.DATA_DIR)
    data_dir.mkdir(parents=True, exist_ok=True)
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    redis_proc = None
    if not os.environ.get("REDIS_URL"):
        redis_proc = _start_embedded_redis(data_dir)
    try:
        settings = _setup_django()
        _migrate()
        from runtime.models import Node
        from runtime.node.local import local_node_id, local_node_name
        from runtime.services.auth import bootstrap_admin, token_create

        user, team, password = bootstrap_admin()
        _prepare_node(settings, build_default_image=True)
        token = token_create(user=user, team=team, name="hangar up").raw if password else None

        node = Node.objects.get(name=local_node_name())
        _become_subreaper()
        py = sys.executable
        # The port it serves on is what its children tell others (preview URLs, hangar.internal).
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HANGAR_PORT": str(args.port)}
        if redis_proc is not None:
            env["REDIS_URL"] = settings.REDIS_URL
        specs = [
            ("server", [py, "-m", "dashboard.server", "-b", args.host, "-p", str(args.port), "-v", "0",
                        "dashboard.asgi:application"]),
            ("worker", [py, "-m", "celery", "-A", "dashboard", "worker", "-Q", f"control,{node.queue}",
                        "-n", f"{node.name}@%h", "--pool", "threads", "--concurrency", str(args.concurrency),
                        "--loglevel", args.log_level, "--without-gossip", "--without-mingle"]),
            ("beat", [py, "-m", "celery", "-A", "dashboard", "beat", "--loglevel", "WARNING",
                      "-s", str(data_dir / "celerybeat-schedule")]),
            ("bridge", [py, "-m", "dashboard.cli", "bridge"]),
        ]  # fmt: skip
        if settings.HANGAR_SSH_PORT:
            specs.append(("ssh-gateway", [py, "-m", "dashboard.cli", "ssh-gateway"]))
        logs = supervise.start_children(specs, env, data_dir, children)
        url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
        _say("")
        _say(f"Hangar is up at {url}  (API docs: {url}/api/v1/docs)")
        if settings.HANGAR_SSH_PORT:
            _say(
                f"  ssh:   port {settings.HANGAR_SSH_PORT} on {settings.HANGAR_SSH_BIND} "
                f"(ssh -p {settings.HANGAR_SSH_PORT} HARNESS@{settings.HANGAR_SSH_HOST})"
            )
        _say(f"  node:  {node.name} (queue {node.queue}, host id {local_node_id()}), data in {data_dir}")
        _say(
            f"  logs:  {logs}/ (server, worker, beat, bridge, ssh-gateway; warnings and errors show here too)"
        )
        if password:
            _say(f"  admin: {user.get_username()} / {password}   (sign in at {url}/login/)")
            _say(f"  API token (shown once): {token}")
        else:
            _say(
                f"  admin: {user.get_username()} (password shown on first start); new token: hangar token create --user {user.get_username()}"
            )
        _say_e2b(url, token, user.get_username())
        _say("Press Ctrl-C to stop.")
        return supervise.supervise(children, supervise.restarter(specs, env, logs))
    finally:
        supervise.stop_all(children)
        if redis_proc is not None:
            supervise.stop_all([("redis", redis_proc)])


def _say_e2b(url: str, token: str | None, username: str) -> None:
    """The e2b SDK's three variables as lines a shell takes pasted whole (the comment too)."""
    if token:
        _say("  # the e2b SDK against this Hangar, with the token above (paste into a shell):")
    else:
        _say(f"  # the e2b SDK against this Hangar (paste into a shell; put a token from "
             f"`hangar token create --user {username}` for hgr_YOUR_TOKEN):")  # fmt: skip
    _say(f"  export E2B_API_URL={url}/e2b")
    _say(f"  export E2B_SANDBOX_URL={url}/e2b/envd")
    _say(f"  export E2B_API_KEY={token or 'hgr_YOUR_TOKEN'}")


def _become_subreaper() -> None:
    """Sandboxes outlive the `runsc run` that started them, so they are orphans; as a child
    subreaper this process inherits and reaps them when they exit. Left to an init that reaps
    lazily, `runsc delete` waits for each exited sandbox to disappear (over a second each)."""
    import ctypes

    pr_set_child_subreaper = 36
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) != 0:
        _say("hangar: could not become a child subreaper; exited sandboxes are reaped by init")


def cmd_node(args: argparse.Namespace) -> int:
    """Join this machine as a node: register it and consume its own queue."""
    if not getattr(args, "joined", False):
        from dashboard.node_cli import load_joined_settings

        load_joined_settings()  # a machine that joined before: the settings its join was given
    settings = _setup_django()
    _migrate() if args.migrate else None
    from runtime.models import Node
    from runtime.node.local import local_node_id, local_node_name

    # A node that has just joined builds the default image if it holds none (placement needs it).
    _prepare_node(settings, build_default_image=bool(getattr(args, "joined", False)))
    node = Node.objects.get(name=local_node_name())
    _say(f"hangar: node {node.name} consuming {node.queue} (host id {local_node_id()})")
    py = sys.executable
    specs = [
        ("worker", [py, "-m", "celery", "-A", "dashboard", "worker", "-Q", node.queue, "-n", f"{node.name}@%h",
                    "--pool", "threads", "--concurrency", str(args.concurrency), "--loglevel", args.log_level,
                    "--without-gossip", "--without-mingle"]),
        ("bridge", [py, "-m", "dashboard.cli", "bridge"]),
    ]  # fmt: skip
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    _become_subreaper()
    try:
        logs = supervise.start_children(specs, dict(os.environ), Path(settings.DATA_DIR), children)
        _say(f"hangar: logs in {logs}/ (warnings and errors show here too)")
        return supervise.supervise(children, supervise.restarter(specs, dict(os.environ), logs))
    finally:
        supervise.stop_all(children)


def cmd_bridge(args: argparse.Namespace) -> int:
    """This node's stream bridge: live processes and terminals (started by up and node)."""
    _setup_django()
    from runtime.node.bridge import run_bridge

    run_bridge(args.node)
    return 0


def cmd_ssh_gateway(args: argparse.Namespace) -> int:
    """The SSH gateway into harnesses (started by up unless HANGAR_SSH_PORT is 0)."""
    _setup_django()
    from .edge.ssh import main as run_ssh_gateway

    run_ssh_gateway(host=args.bind, port=args.port)
    return 0


def _user_named(name: str, hint: str = "") -> Any:
    """The user called ``name``; a NotFound (printed by main) if there is none."""
    from django.contrib.auth import get_user_model

    from runtime.errors import NotFound

    user = get_user_model().objects.filter(username=name).first()
    if user is None:
        raise NotFound(f"no user named {name!r}{hint}")
    return user


def cmd_token_create(args: argparse.Namespace) -> int:
    _setup_django()
    _migrate()
    _as_cli()
    from runtime.services.auth import team_for_user, token_create

    user = _user_named(args.user)
    team = team_for_user(user=user, team_name=args.team)
    issued = token_create(user=user, team=team, name=args.name or "cli", role=args.role,
                          scopes=args.scope or None, expires_in_s=args.expires_in)  # fmt: skip
    print(
        f"token for {user.get_username()} in team {team.name}, role {issued.token.role} "
        "(shown once, stored hashed):"
    )
    print(issued.raw)
    return 0


def cmd_user_create(args: argparse.Namespace) -> int:
    _setup_django()
    _migrate()
    _as_cli()
    from runtime.services.auth import user_create

    user, password = user_create(username=args.name, password=args.password, staff=args.staff)
    kind = "site administrator" if args.staff else "user"
    print(f"{kind} {user.get_username()} created" + ("" if args.password else f"; password: {password}"))
    return 0


def cmd_team_create(args: argparse.Namespace) -> int:
    _setup_django()
    _migrate()
    _as_cli()
    from runtime.services.auth import team_create

    owner = _user_named(args.owner, " (create one: hangar user create NAME)")
    team = team_create(name=args.name, owner=owner)
    print(f"team {team.name} created, owned by {owner.get_username()}")
    return 0


def cmd_secrets_rotate(args: argparse.Namespace) -> int:
    _setup_django()
    _migrate()
    _as_cli()
    from runtime.services.secrets import secrets_rotate

    n = secrets_rotate()
    print(
        f"{n} secret(s) re-encrypted under the first key of HANGAR_SECRETS_KEYS; older keys can now be dropped"
    )
    return 0


def cmd_image(args: argparse.Namespace) -> int:
    _setup_django()
    _migrate()
    from runtime.errors import ServiceError
    from runtime.host.images.base import ImageError
    from runtime.node.local import image_store
    from runtime.services import images as svc

    def progress(line: str) -> None:
        print(f"  {line}", flush=True)

    try:
        if args.image_cmd == "list":
            rows = image_store().list()
            print(f"{'NAME':<24} {'DIGEST':<20} {'SIZE':>10}  SOURCE")
            for info in rows:
                print(
                    f"{info.name or '-':<24} {info.digest[:19]:<20} {info.size_bytes / 1e6:>8.1f}MB  {info.source}"
                )
            return 0
        if args.image_cmd == "build":
            image = svc.image_build(kind=args.kind, progress=progress)
        elif args.image_cmd == "import":
            image = svc.image_import(path=args.file, name=args.name, progress=progress)
        else:
            image = svc.image_pull(
                ref=args.ref, name=args.name, tls_verify=not args.insecure, progress=progress
            )
    except (ImageError, ServiceError) as exc:
        print(f"hangar: {exc}", file=sys.stderr)
        return 2
    print(f"{image.name} {image.digest}")
    return 0


def cmd_manage(args: argparse.Namespace) -> int:
    _setup_django()
    from django.core.management import execute_from_command_line

    execute_from_command_line(["hangar manage", *args.rest])
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The server's commands alone (``python -m dashboard.cli``); the ``hangar`` command of an
    install has them too, plugged into the SDK's (:func:`register`)."""
    p = argparse.ArgumentParser(prog="hangar", description="Hangar: a self-hosted runtime for AI agents.")
    add_commands(p.add_subparsers(dest="cmd", required=True))
    return p


def register(sub: argparse._SubParsersAction) -> Callable[[argparse.Namespace], int]:
    """The ``hangar.cli`` entry point: the server's commands in the SDK's ``hangar`` command."""
    add_commands(sub)
    return run_command


def add_commands(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="run everything on this machine (server, worker, beat, embedded Redis)")
    up.add_argument("--port", type=int, default=int(os.environ.get("HANGAR_PORT", "8000")))
    up.add_argument("--host", default=os.environ.get("HANGAR_HOST", "127.0.0.1"))
    up.add_argument("--concurrency", type=int, default=32, help="worker threads (default 32)")
    up.add_argument(
        "--log-level", default=os.environ.get("HANGAR_LOG_LEVEL", "WARNING"),
        help="the worker's log level (INFO logs every task, heartbeats included)",
    )  # fmt: skip
    up.set_defaults(fn=cmd_up)

    node_cli.add_node_commands(sub, cmd_node)

    bridge = sub.add_parser(
        "bridge", help="run this node's stream bridge alone (hangar up and hangar node start it)"
    )
    bridge.add_argument("--node", help="node name (default: HANGAR_NODE_NAME)")
    bridge.set_defaults(fn=cmd_bridge)

    ssh = sub.add_parser("ssh-gateway", help="run the SSH gateway into harnesses alone (hangar up starts it)")
    ssh.add_argument("--port", type=int, help="port to listen on (default: HANGAR_SSH_PORT, 2222)")
    ssh.add_argument("--bind", help="address to listen on (default: HANGAR_SSH_BIND, 127.0.0.1)")
    ssh.set_defaults(fn=cmd_ssh_gateway)

    token = sub.add_parser("token", help="API tokens")
    tsub = token.add_subparsers(dest="token_cmd", required=True)
    tc = tsub.add_parser("create", help="print a new API token (alone on the last line)")
    tc.add_argument("--user", required=True)
    tc.add_argument("--team")
    tc.add_argument("--name", default="")
    tc.add_argument("--role", choices=["viewer", "member", "admin", "owner"],
                    help="at most the user's role in the team (default: that role)")  # fmt: skip
    tc.add_argument("--scope", action="append", help="limit it to a scope, e.g. sandboxes:read (repeatable)")
    tc.add_argument("--expires-in", type=int, metavar="SECONDS", help="stop working this long from now")
    tc.set_defaults(fn=cmd_token_create)

    user = sub.add_parser("user", help="users")
    usub = user.add_subparsers(dest="user_cmd", required=True)
    uc = usub.add_parser("create", help="create a user (prints a generated password unless --password)")
    uc.add_argument("name")
    uc.add_argument("--password")
    uc.add_argument("--staff", action="store_true", help="a site administrator (manages every team)")
    uc.set_defaults(fn=cmd_user_create)

    team = sub.add_parser("team", help="teams")
    teamsub = team.add_subparsers(dest="team_cmd", required=True)
    tmc = teamsub.add_parser("create", help="create a team owned by a user")
    tmc.add_argument("name")
    tmc.add_argument("--owner", required=True)
    tmc.set_defaults(fn=cmd_team_create)

    secrets = sub.add_parser("secrets", help="team secrets")
    ssub = secrets.add_subparsers(dest="secrets_cmd", required=True)
    ssub.add_parser(
        "rotate", help="re-encrypt every secret under the first key of HANGAR_SECRETS_KEYS (key rotation)"
    ).set_defaults(fn=cmd_secrets_rotate)

    image = sub.add_parser("image", help="images on this node")
    isub = image.add_subparsers(dest="image_cmd", required=True)
    isub.add_parser("list", help="list images").set_defaults(fn=cmd_image)
    ib = isub.add_parser("build", help="build a built-in image")
    ib.add_argument("kind", choices=["busybox", "base", "minimal"])
    ib.set_defaults(fn=cmd_image)
    ii = isub.add_parser("import", help="import an OCI layout, OCI archive or docker-save tarball")
    ii.add_argument("file")
    ii.add_argument("--name")
    ii.set_defaults(fn=cmd_image)
    ip = isub.add_parser("pull", help="pull from an OCI registry")
    ip.add_argument("ref")
    ip.add_argument("--name")
    ip.add_argument("--insecure", action="store_true", help="plain HTTP / unverified TLS (local registries)")
    ip.set_defaults(fn=cmd_image)

    manage = sub.add_parser("manage", help="run a Django management command")
    manage.add_argument("rest", nargs=argparse.REMAINDER)
    manage.set_defaults(fn=cmd_manage)


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed server command: a configuration or service error is one line and status 2."""
    from django.core.exceptions import ImproperlyConfigured

    from runtime.errors import ServiceError

    try:
        return int(args.fn(args) or 0)
    except ImproperlyConfigured as exc:
        print(f"hangar: configuration error: {exc}", file=sys.stderr)
        return 2
    except ServiceError as exc:  # a caller's mistake, said by the service
        print(f"hangar: {exc.message}", file=sys.stderr)
        return 2
    finally:
        audit = sys.modules.get("runtime.services.audit")
        if audit is not None:  # called in-process (tests): the next caller is not the CLI
            audit.set_actor(None)


if __name__ == "__main__":
    sys.exit(main())
