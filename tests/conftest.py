"""Shared fixtures: a real Celery worker and a real daphne server on the test database, the
local test node with the busybox image, and a team with an API token."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from runtime.host.images.store import ImageStore
from runtime.launchers.agent.build import agent_binary

from .support import WORLD_A, WORLD_B, WORLD_GW, WORLD_IFACE, WORLD_NS, die_with_parent, free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent


def _flush_retrying_deadlocks() -> None:
    """The test database is emptied (TRUNCATE) after each transactional test while the real
    worker, bridge and server processes may still be writing (a task finishing, activity being
    recorded). Postgres then aborts one side with a deadlock; it is the harness's cleanup, not
    the product, so the flush is tried again instead of failing every later test."""
    from django.db import OperationalError
    from django.test import TransactionTestCase

    original = TransactionTestCase._fixture_teardown

    def teardown(self) -> None:  # type: ignore[no-untyped-def]
        for attempt in range(5):
            try:
                return original(self)
            except Exception as exc:  # CommandError wraps the OperationalError
                cause = exc if isinstance(exc, OperationalError) else exc.__cause__ or exc.__context__
                if attempt == 4 or "deadlock detected" not in str(cause):
                    raise
                time.sleep(0.5)

    TransactionTestCase._fixture_teardown = teardown  # type: ignore[method-assign]


_flush_retrying_deadlocks()


def pytest_configure(config) -> None:
    """The run across workers (`pytest -n`) and the reliability suites' budgets and report: plugins,
    so that they also run in the controller of a `pytest -n` run, which loads no other conftest."""
    from . import hangs, parallel
    from .reliability import budgets

    for plugin in (parallel, budgets, hangs):
        if not config.pluginmanager.is_registered(plugin):
            config.pluginmanager.register(plugin, f"hangar-{plugin.__name__}")


logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request drowns the failures
ARTIFACTS = Path(os.environ.get("HANGAR_TEST_ARTIFACTS", ROOT / "test-artifacts"))


@pytest.fixture(scope="session", autouse=True)
def _no_mount_outlives_the_run(tmp_path_factory) -> Iterator[None]:
    """Set up first, so torn down last (after the worker): the test node's spare sandbox disks
    go, and whatever a failed test left mounted under the run's directories with them."""
    yield
    from django.conf import settings

    from runtime.node.local import local_launchers

    for launcher in local_launchers().values():
        launcher.release_spares()
    roots = (str(tmp_path_factory.getbasetemp()) + "/", str(settings.DATA_DIR) + "/")
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted((p for p in points if p.startswith(roots)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


@pytest.fixture(scope="session")
def agent_cache_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("agent-bin")
    agent_binary(path)
    return path


@pytest.fixture(scope="session")
def image_store(tmp_path_factory) -> ImageStore:
    return ImageStore(tmp_path_factory.mktemp("images"))


# -- the Django side ---------------------------------------------------------------------------


def _service_env(db_name: str) -> dict[str, str]:
    from django.conf import settings

    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        DATABASE_URL=f"postgres://postgres@127.0.0.1:5432/{db_name}",
        REDIS_URL=settings.REDIS_URL,
        HANGAR_DATA_DIR=str(settings.DATA_DIR),
        HANGAR_NODE_NAME=settings.HANGAR_NODE_NAME,
        PYTHONUNBUFFERED="1",
    )
    return env


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@pytest.fixture(scope="session")
def service_env(django_db_setup, django_db_blocker) -> dict[str, str]:
    from django.db import connection

    from runtime.notify import redis_client

    # Stale messages from an earlier run must not reach this run's worker.
    redis_client().flushdb()
    return _service_env(connection.settings_dict["NAME"])


@pytest.fixture(scope="session")
def celery_worker(service_env) -> Iterator[subprocess.Popen]:
    """A real Celery worker process consuming the control queue and the test node's queue."""
    from django.conf import settings

    log_path = Path(tempfile.mkdtemp()) / "worker.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "dashboard", "worker", "-Q", f"control,node.{settings.HANGAR_NODE_NAME}",
         "-n", f"{settings.HANGAR_NODE_NAME}@%h", "--pool", "threads", "--concurrency", "16", "--loglevel", "INFO",
         "--without-gossip", "--without-mingle", "--without-heartbeat"],
        cwd=ROOT, env=service_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
    )  # fmt: skip
    wait_until(
        lambda: b"ready." in log_path.read_bytes() or proc.poll() is not None, 60, what="celery worker"
    )
    assert proc.poll() is None, log_path.read_text()
    proc.log_path = log_path  # type: ignore[attr-defined]
    yield proc
    _stop(proc)
    log.close()


@pytest.fixture(scope="session")
def bridge(service_env, server) -> Iterator[subprocess.Popen]:
    """The test node's real stream bridge process (live processes and terminals, and
    hangar.internal, which forwards to the test server)."""
    log_path = Path(tempfile.mkdtemp()) / "bridge.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dashboard.cli", "bridge"],
        cwd=ROOT, env={**service_env, "HANGAR_INTERNAL_URL": server}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
    )  # fmt: skip
    wait_until(lambda: b"listening on" in log_path.read_bytes() or proc.poll() is not None, 60, what="bridge")
    assert proc.poll() is None, log_path.read_text()
    proc.log_path = log_path  # type: ignore[attr-defined]
    yield proc
    _stop(proc)
    log.close()


@pytest.fixture(scope="session")
def server_process(service_env) -> Iterator[subprocess.Popen]:
    """The real ASGI app served by Hangar's server (daphne with back-pressure, :mod:`dashboard.server`),
    as `hangar up` runs it; ``.url`` is where."""
    proc = start_server(service_env)
    yield proc
    _stop(proc)
    proc.log.close()  # type: ignore[attr-defined]


def start_server(env: dict[str, str]) -> subprocess.Popen:
    """A server process on a free port with ``env``, once it answers: ``.url``, ``.log_path``."""
    port = free_port()
    log_path = Path(tempfile.mkdtemp()) / "daphne.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dashboard.server", "-b", "127.0.0.1", "-p", str(port), "dashboard.asgi:application"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(log_path.read_text())
        try:
            return httpx.get(f"{url}/api/v1/health", timeout=2).status_code in (200, 503)
        except httpx.HTTPError:
            return False

    wait_until(up, 60, what="the server")
    proc.url, proc.log_path, proc.log = url, log_path, log  # type: ignore[attr-defined]
    return proc


@pytest.fixture(scope="session")
def server(server_process) -> str:
    """Where the real server answers: ``http://127.0.0.1:PORT``."""
    return server_process.url  # type: ignore[no-any-return]


@pytest.fixture
def local_node(transactional_db):
    """This machine registered as the test node, holding the busybox image."""
    from django.conf import settings

    from runtime.node.local import local_capabilities, node_memory_mb
    from runtime.services.images import image_build
    from runtime.services.nodes import node_register

    node = node_register(
        name=settings.HANGAR_NODE_NAME,
        launchers=local_capabilities(),
        cpu=4,
        memory_mb=min(node_memory_mb(), 16384),
    )
    image_build(kind="busybox")
    yield node
    _destroy_all_sandboxes()
    _delete_all_volumes()


@pytest.fixture
def minimal_image(local_node) -> str:
    """The ``minimal`` Debian image (bash, git, ssh client, sftp-server) for harness tests:
    built once per machine with mmdebstrap (about 40 s), then kept in the test data dir's store."""
    from runtime.host.images.base import ImageError
    from runtime.node.local import image_store
    from runtime.services.images import image_build, image_register

    try:
        image_register(info=image_store().get("minimal"), name="minimal", node_name=local_node.name)
    except ImageError:
        image_build(kind="minimal")
    return "minimal"


@pytest.fixture(scope="session")
def base_image_info():
    """The ``base`` Debian image (Node.js and npm for the agents' CLIs, git, Python) and the
    progress lines of its build: built once per machine into the test data dir's store (73 s
    here with a nearby mirror, minutes with a distant one) and kept, so a run builds it at most
    once. Only with HANGAR_TEST_BASE_IMAGE=1."""
    if not os.environ.get("HANGAR_TEST_BASE_IMAGE"):
        pytest.skip(
            "needs the base image, built from the Debian mirror (minutes); CI sets HANGAR_TEST_BASE_IMAGE=1"
        )
    from runtime.host.images.base import ImageError
    from runtime.node.local import image_store

    lines: list[str] = []
    try:
        info = image_store().get("base")
    except ImageError:
        info = image_store().build_base(progress=lines.append)
    return info, lines


def _destroy_all_sandboxes() -> None:
    from runtime.node.local import local_launchers

    for launcher in local_launchers().values():
        for sandbox_id in launcher.states():
            launcher.destroy(launcher.handle_for(sandbox_id))


def _delete_all_volumes() -> None:
    """Volumes are loop mounts on this machine: none may outlive the test that made it."""
    from runtime.node.local import volume_store

    store = volume_store()
    for volume_id in store.list():
        store.delete(volume_id)


def _member_token(username: str, team_name: str) -> str:
    from django.contrib.auth import get_user_model

    from runtime.models import Membership, Team
    from runtime.services.auth import token_create

    user = get_user_model().objects.create_user(username=username, password="pw")
    team = Team.objects.create(name=team_name)
    Membership.objects.create(user=user, team=team, role=Membership.Role.OWNER)
    return token_create(user=user, team=team).raw


@pytest.fixture
def team_token(transactional_db) -> str:
    return _member_token("alice", "alpha")


@pytest.fixture
def other_team_token(transactional_db) -> str:
    return _member_token("mallory", "beta")


@pytest.fixture
def api(server, celery_worker, bridge, local_node, team_token) -> Iterator[httpx.Client]:
    """An HTTP client for /api/v1 with the team's token, against the real server and worker."""
    with httpx.Client(
        base_url=f"{server}/api/v1", headers={"Authorization": f"Bearer {team_token}"}, timeout=120
    ) as client:
        yield client


@pytest.fixture
def other_api(server, other_team_token) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=f"{server}/api/v1", headers={"Authorization": f"Bearer {other_team_token}"}, timeout=60
    ) as client:
        yield client


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """A namespace playing the internet: a web server on A and one on B, port 8080."""
    _sh("ip", "netns", "delete", WORLD_NS, check=False)
    _sh("ip", "link", "delete", WORLD_IFACE, check=False)
    _sh("ip", "netns", "add", WORLD_NS)
    _sh("ip", "link", "add", WORLD_IFACE, "type", "veth", "peer", "name", "eth0", "netns", WORLD_NS)
    _sh("ip", "addr", "add", f"{WORLD_GW}/24", "dev", WORLD_IFACE)
    _sh("ip", "link", "set", WORLD_IFACE, "up")
    for addr in (WORLD_A, WORLD_B):
        _sh("ip", "-n", WORLD_NS, "addr", "add", f"{addr}/24", "dev", "eth0")
    _sh("ip", "-n", WORLD_NS, "link", "set", "eth0", "up")
    _sh("ip", "-n", WORLD_NS, "link", "set", "lo", "up")
    servers = []
    for name, addr in (("server-a", WORLD_A), ("server-b", WORLD_B)):
        root = tmp_path_factory.mktemp(name)
        (root / "index.html").write_text(f"{name}\n")
        servers.append(subprocess.Popen(
            ["ip", "netns", "exec", WORLD_NS, sys.executable, "-m", "http.server", "8080", "--bind", addr,
             "--directory", str(root)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip
    for addr in (WORLD_A, WORLD_B):
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection((addr, 8080), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"the world's server on {addr} did not start"
                time.sleep(0.1)
    yield
    for p in servers:
        p.kill()
        p.wait()
    _sh("ip", "netns", "delete", WORLD_NS, check=False)


GIT_PORT = 9418


@pytest.fixture(scope="session")
def git_repos(tmp_path_factory) -> Path:
    """A directory holding ``project.git``: a README on ``main`` and a ``feature`` branch."""
    root = tmp_path_factory.mktemp("git")
    work = root / "work"
    env = {**os.environ, "GIT_AUTHOR_NAME": "Test", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "Test", "GIT_COMMITTER_EMAIL": "t@example.com", "HOME": str(root)}  # fmt: skip

    def git(*args: str, cwd=work) -> None:
        subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, timeout=30)

    work.mkdir()
    git("init", "-q", "-b", "main")
    (work / "README.md").write_text("# project\n")
    (work / "app.py").write_text("print('hello')\n")
    git("add", ".")
    git("commit", "-q", "-m", "first")
    git("checkout", "-q", "-b", "feature")
    (work / "feature.txt").write_text("feature\n")
    git("add", ".")
    git("commit", "-q", "-m", "feature")
    git("checkout", "-q", "main")
    git("clone", "-q", "--bare", str(work), str(root / "project.git"), cwd=root)
    return root


@pytest.fixture(scope="session")
def git_server(world, git_repos):
    """A git daemon on the world's address A (``git://<WORLD_A>/project.git``), read-only."""
    root = git_repos
    proc = subprocess.Popen(
        ["ip", "netns", "exec", WORLD_NS, "git", "daemon", "--reuseaddr", f"--base-path={root}", "--export-all",
         f"--listen={WORLD_A}", f"--port={GIT_PORT}", str(root)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection((WORLD_A, GIT_PORT), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "git daemon did not start"
            time.sleep(0.1)
    yield f"git://{WORLD_A}/project.git"
    # `git daemon` runs git-daemon as a child of its own: the whole group goes, or it outlives the run.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


GIT_HTTP_PORT = 8081


@pytest.fixture(scope="session")
def private_git_server(world, git_repos):
    """The same repository over git's smart HTTP behind basic authentication, as a forge serves
    a private repository: (``http://<WORLD_A>:8081/project.git``, user, token)."""
    token = "ghp_private_" + os.urandom(12).hex()
    proc = subprocess.Popen(
        ["ip", "netns", "exec", WORLD_NS, sys.executable, str(ROOT / "tests" / "git_http_server.py"),
         str(git_repos), WORLD_A, str(GIT_HTTP_PORT), "x-access-token", token],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection((WORLD_A, GIT_HTTP_PORT), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "the git HTTP server did not start"
            time.sleep(0.1)
    yield f"http://{WORLD_A}:{GIT_HTTP_PORT}/project.git", "x-access-token", token
    proc.kill()
    proc.wait()
