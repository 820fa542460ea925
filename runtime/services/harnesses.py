"""Harnesses: persistent workspaces for coding agents.

A harness is a sandbox (paused and resumed with it) whose ``/workspace`` is a volume of its
own, plus what makes it a workspace: a git repository cloned there, the agent's CLI (installed
from npm into the volume when the image lacks it), the agent's credentials (team secrets,
given as environment variables, never written to a file), an API token of its team, and a log.
Its ``HOME`` is on the volume (``/workspace/.hangar/home``), so the agent's own config
survives pauses and even a new sandbox.

Create: the volume, the token, the sandbox (through :func:`sandbox_create`, so quotas,
scheduling and egress are the sandbox's), then, on the node once the sandbox runs,
:func:`harness_setup` streams the clone and the install to the log.
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets as pysecrets
import threading
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.db.models import Max, Q, QuerySet
from django.utils import timezone

from .. import enqueue, notify, presets
from ..errors import Conflict, Forbidden, InvalidValue, NotFound
from ..launchers.base import ExecRequest, LauncherError
from ..models import Harness, HarnessLogEntry, Run, Sandbox, Secret, Team, Volume
from ..node.local import local_node_name
from ..streams import Masker
from . import audit, quotas
from . import auth as auth_svc
from . import checks as checks_svc
from . import sandbox_calls as calls_svc
from . import sandboxes as sandbox_svc
from . import secrets as secret_svc
from . import volumes as volume_svc
from .sandbox_access import sandbox_access

log = logging.getLogger(__name__)
S = Sandbox.Status
NAME_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
BRANCH_RE = re.compile(r"[A-Za-z0-9._/-]{1,255}")
REPO_RE = re.compile(r"(?:https?|git|ssh|file)://\S+|[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:\S+")
# The harness's own token: the sandboxes that harness made (its own, and those it creates: see
# auth.sandbox_reach), and its traces. Nothing else of the team's.
TOKEN_SCOPES = ["sandboxes:write", "traces:write"]
SETUP_TIMEOUT_S = 1800
LOG_KEEP_ENTRIES = 5000


# -- selectors ---------------------------------------------------------------------------------


def harnesses_for_team(*, team: Team) -> QuerySet[Harness]:
    return (
        Harness.objects.filter(team=team, deleted_at__isnull=True)
        .select_related("sandbox", "sandbox__node", "volume", "team")
        .annotate(last_run_at=Max("runs__created_at"))
        .order_by("name")
    )


def harness_get(*, team: Team, harness_id: str) -> Harness:
    """By id or by name, within the team; deleted ones are gone."""
    row = (
        harnesses_for_team(team=team).filter(Q(id=harness_id) | Q(name=harness_id)).first()
        if harness_id
        else None
    )
    if row is None:
        raise NotFound(f"no harness {harness_id!r} in team {team.name}")
    return row


def harness_status(h: Harness) -> str:
    """One word for the harness: creating, running, pausing, paused, resuming, stopped, failed,
    deleted."""
    if h.deleted_at is not None:
        return "deleted"
    sb = h.sandbox
    if sb is None:
        return "failed" if h.setup == Harness.Setup.FAILED else "creating"
    if sb.status in (S.PENDING, S.STARTING):
        return "creating"
    if sb.status == S.RUNNING:
        if h.setup == Harness.Setup.FAILED:
            return "failed"
        return "running" if h.setup == Harness.Setup.DONE else "creating"
    if sb.status in (S.PAUSING, S.PAUSED, S.RESUMING):
        return sb.status
    if sb.status == S.FAILED:
        return "failed"
    return "stopped"


def ssh_command(h: Harness) -> str:
    host = settings.HANGAR_SSH_HOST
    port = settings.HANGAR_SSH_PORT
    return f"ssh -p {port} {h.name}@{host}" if port != 22 else f"ssh {h.name}@{host}"


def harness_last_activity(h: Harness) -> Any:
    sb = h.sandbox
    times = [t for t in (sb.last_activity_at if sb else None, sb.started_at if sb else None) if t]
    if hasattr(h, "last_run_at"):  # annotated by harnesses_for_team
        last_run = h.last_run_at
    else:
        last_run = h.runs.order_by("-created_at").values_list("created_at", flat=True).first()
    if last_run:
        times.append(last_run)
    return max(times) if times else h.created_at


# -- validation ---------------------------------------------------------------------------------


def _command(agent: str, command: Any) -> list[str]:
    if agent != "custom":
        if command:
            raise InvalidValue(f"command is for the custom agent; {agent} runs its own CLI")
        return []
    if isinstance(command, str):
        if not command.strip():
            raise InvalidValue('the custom agent needs a command, e.g. "./agent.sh"')
        return ["/bin/sh", "-c", command]
    if not command or not isinstance(command, list) or not all(isinstance(a, str) and a for a in command):
        raise InvalidValue(
            "the custom agent needs a command: a string (run by /bin/sh -c) or a list of strings"
        )
    if any("\0" in a for a in command):
        raise InvalidValue("command contains a NUL byte")
    return list(command)


def _repo(team: Team, repo: dict[str, Any] | None) -> tuple[str, str, str, str]:
    """(url, branch, secret name, auth kind: token | ssh-key | "")."""
    if not repo:
        return "", "", "", ""
    url = str(repo.get("url") or "").strip()
    branch = str(repo.get("branch") or "").strip()
    secret = str(repo.get("secret") or "").strip()
    if not url:
        if branch or secret:
            raise InvalidValue("repo.url is required when repo.branch or repo.secret is given")
        return "", "", "", ""
    if len(url) > 1000 or not REPO_RE.fullmatch(url) or url.startswith("-"):
        raise InvalidValue(
            f"repo.url {url!r} is not a git URL: use https://host/owner/repo.git, ssh://…, git://… "
            "or git@host:owner/repo.git"
        )
    if re.match(r"https?://[^/@]*:[^/@]*@", url):
        raise InvalidValue("repo.url must not carry a password or token: put it in a team secret and "
                           "name that secret in repo.secret")  # fmt: skip
    if branch and (not BRANCH_RE.fullmatch(branch) or branch.startswith(("-", "/")) or ".." in branch):
        raise InvalidValue(f"repo.branch {branch!r} is not a valid branch name")
    auth = ""
    if secret:
        row = secret_svc.secret_get(team=team, name=secret)  # NotFound names it
        value = secret_svc.decrypt(row.ciphertext)
        auth = "ssh-key" if value.lstrip().startswith("-----BEGIN") else "token"
    return url, branch, secret, auth


def _volume_name(team: Team, name: str) -> str:
    base = f"{name}-workspace"[:64]
    if not Volume.objects.filter(team=team, name=base).exists():
        return base
    return f"{base[:58]}-{pysecrets.token_hex(2)}"


def _sandbox_env(h: Harness, image_path: str) -> dict[str, str]:
    p = presets.preset(h.agent)
    env = {
        "HOME": presets.HOME,
        "PATH": f"{presets.TOOLS_BIN}:{image_path}",
        "HANGAR_HARNESS_ID": h.id,
        "HANGAR_HARNESS": h.name,
        "HANGAR_API_URL": settings.HANGAR_SANDBOX_API_URL,
        "OTEL_EXPORTER_OTLP_ENDPOINT": settings.HANGAR_SANDBOX_OTLP_ENDPOINT,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": h.agent,
        "OTEL_RESOURCE_ATTRIBUTES": f"hangar.team={h.team_id},hangar.harness.id={h.id}",
        **p.env,
        **h.env,
    }
    return env


def mask_values(h: Harness) -> list[str]:
    """Values that must never appear in the harness's log or its runs' output."""
    names = set(h.secrets) | ({h.repo_secret} if h.repo_secret else set())
    values = []
    for ct in Secret.objects.filter(team_id=h.team_id, name__in=names).values_list("ciphertext", flat=True):
        with contextlib.suppress(Exception):
            values.append(secret_svc.decrypt(bytes(ct)))
    if h.api_token_ciphertext:
        with contextlib.suppress(Exception):
            values.append(secret_svc.decrypt(bytes(h.api_token_ciphertext)))
    return [v for v in values if len(v) >= secret_svc.MASK_MIN_CHARS]


# -- create ---------------------------------------------------------------------------------------


def harness_create(
    *,
    team: Team,
    user: User,
    name: str,
    agent: str,
    command: Any = None,
    image: str = "base",
    runtime: str | None = None,
    cpu: float = 1.0,
    memory_mb: int = 2048,
    disk_mb: int | None = None,
    repo: dict[str, Any] | None = None,
    secrets: list[str] | None = None,
    env: dict[str, str] | None = None,
    idle_timeout_s: int | None = None,
    network: dict[str, Any] | None = None,
    volume: str | None = None,
) -> Harness:
    """``volume``: an existing volume of the team to work in (a deleted harness's kept
    workspace, say) instead of a new one; it must not be attached to a sandbox."""
    name = (name or "").strip()
    if not NAME_RE.fullmatch(name):
        raise InvalidValue(f"invalid harness name {name!r}: 1-63 of a-z 0-9 - (it is the SSH user name), "
                           "starting and ending with a letter or digit")  # fmt: skip
    try:
        p = presets.preset(agent)
    except ValueError as exc:
        raise InvalidValue(str(exc)) from None
    argv = _command(agent, command)
    url, branch, repo_secret, repo_auth = _repo(team, repo)
    env = dict(env or {})
    checks_svc.validate_env(env)
    secret_names = secret_svc.validate_names(team=team, names=list(secrets or []), env=env)
    disk_mb = settings.HANGAR_HARNESS_DISK_MB if disk_mb is None else disk_mb
    if idle_timeout_s == 0:
        idle_timeout_s = None  # never idle
    # The agent reaches Hangar (its API token, OTLP) at hangar.internal unless told not to.
    net: dict[str, Any] = (
        dict(network) if isinstance(network, dict) else ({"egress": "all"} if network is None else network)
    )
    if isinstance(net, dict) and settings.HANGAR_SANDBOX_GATEWAY_PORT:
        net.setdefault("hangar", True)
    net = sandbox_svc.validate_network(net)
    image_row = sandbox_svc.image_resolve(image)
    runtime = checks_svc.validate_runtime(runtime or settings.HANGAR_DEFAULT_RUNTIME)
    checks_svc.validate_limits(cpu=cpu, memory_mb=memory_mb, timeout_s=60)
    if Harness.objects.filter(team=team, name=name, deleted_at__isnull=True).exists():
        raise Conflict(f"team {team.name} already has a harness named {name!r}")
    with transaction.atomic():
        quotas.lock_team(team)
        quotas.check(team, harnesses=1)
    # The volume first (its own quota, on a node): the sandbox goes where its volume is.
    if volume:
        existing = volume_svc.volume_get(team=team, volume=volume)
        holders = volume_svc.volume_holders(existing)
        if holders:
            raise Conflict(f"volume {existing.name} is attached to {', '.join(holders)}; a harness needs it alone",
                           sandboxes=holders)  # fmt: skip
        if Harness.objects.filter(volume=existing, deleted_at__isnull=True).exists():
            raise Conflict(f"volume {existing.name} is another harness's workspace")
        vol, made = existing, False
        disk_mb = existing.size_mb
    else:
        vol, made = (
            volume_svc.volume_create(team=team, name=_volume_name(team, name), size_mb=disk_mb, user=user),
            True,
        )
    h = Harness(
        team=team, name=name, agent=agent, command=argv, image=image_row.name, runtime=runtime, cpu=cpu,
        memory_mb=memory_mb,
        disk_mb=disk_mb, repo_url=url, repo_branch=branch, repo_secret=repo_secret, secrets=secret_names,
        env=env, network=net, idle_timeout_s=idle_timeout_s, volume=vol,
        created_by=user if getattr(user, "is_authenticated", False) else None,
    )  # fmt: skip
    try:
        with transaction.atomic():
            quotas.lock_team(team)
            quotas.check(team, harnesses=1)
            h.save(force_insert=True)
    except IntegrityError:
        if made:
            volume_svc.volume_delete(volume=vol)
        raise Conflict(f"team {team.name} already has a harness named {name!r}") from None
    except Exception:
        if made:
            volume_svc.volume_delete(volume=vol)
        raise
    try:
        issued = auth_svc.token_create(user=user, team=team, name=f"harness {name}", role=_token_role(user, team),
                                       scopes=TOKEN_SCOPES, harness=h)  # fmt: skip
        h.api_token = issued.token
        h.api_token_ciphertext = secret_svc.encrypt(issued.raw)
        h.save(update_fields=["api_token", "api_token_ciphertext"])
        # One transaction: the sandbox is provisioned (after commit) once the harness names it.
        with transaction.atomic():
            h.sandbox = _start_sandbox(h, user=user, image_config=image_row.config, repo_auth=repo_auth)
            h.save(update_fields=["sandbox"])
    except Exception:
        _undo_create(h, delete_volume=made)
        raise
    audit.record("harness.create", team=team, target=f"{h.name} ({h.id})", agent=agent, image=h.image,
                 repo=url, branch=branch, secrets=secret_names, volume=vol.name)  # fmt: skip
    harness_log(h, "event", f"created: agent {p.label}, image {h.image}, {cpu:g} vCPU, {memory_mb} MB, "
                f"workspace volume {vol.name} ({disk_mb} MB)")  # fmt: skip
    return h


def _token_role(user: User, team: Team) -> str:
    held = auth_svc.role_of(user, team) or "member"
    return "member" if auth_svc.role_at_least(held, "member") else held


def _undo_create(h: Harness, delete_volume: bool = True) -> None:
    with contextlib.suppress(Exception):
        if h.sandbox_id:
            sandbox_svc.sandbox_delete(
                sandbox=Sandbox.objects.get(id=h.sandbox_id), reason="harness creation failed"
            )
    if h.api_token_id:
        with contextlib.suppress(Exception):
            if h.api_token is not None:
                auth_svc.token_revoke_row(h.api_token)
    Harness.objects.filter(id=h.id).update(deleted_at=timezone.now(), sandbox=None)
    if h.volume_id and delete_volume:
        _delete_volume_when_free(h.volume_id)


def _start_sandbox(h: Harness, *, user: Any, image_config: dict[str, Any], repo_auth: str = "") -> Sandbox:
    image_env = dict(e.split("=", 1) for e in image_config.get("env") or [] if "=" in e)
    timeout_s = min(settings.HANGAR_HARNESS_TIMEOUT_S, quotas.effective(h.team)["lifetime_s"]["limit"])
    names = list(h.secrets) + ([h.repo_secret] if h.repo_secret and h.repo_secret not in h.secrets else [])
    assert h.volume_id is not None  # every harness is made with its workspace volume
    spec = sandbox_svc.SandboxRequest(
        image=h.image, runtime=h.runtime, cpu=h.cpu, memory_mb=h.memory_mb, timeout_s=int(timeout_s),
        env=_sandbox_env(h, image_env.get("PATH", "/usr/local/bin:/usr/bin:/bin")),
        metadata={"harness": h.id, "harness_name": h.name, "repo_auth": repo_auth},
        volumes=[volume_svc.VolumeMount(volume=h.volume_id, mount_path=presets.WORKSPACE)],
        on_expire=sandbox_svc.ON_EXPIRE_PAUSE, idle_timeout_s=h.idle_timeout_s, secrets=names,
        network=h.network or None,
    )  # fmt: skip
    return sandbox_svc.sandbox_create(team=h.team, user=user, request=spec)


# -- setup (on the sandbox's node) -------------------------------------------------------------


def harness_setup_enqueue(sandbox: Sandbox) -> None:
    """Called on the node when a harness's sandbox first runs (a receiver of
    ``events.sandbox_started``): prepare its workspace."""
    if sandbox.node is None or "harness" not in (sandbox.metadata or {}):
        return  # (a harness's sandbox says so in its metadata, which only Hangar writes: no query for the rest)
    hid = Harness.objects.filter(sandbox_id=sandbox.id).values_list("id", flat=True).first()
    if hid is None:
        return
    # A fresh start: no setup survives one, so a setup marked running was cut short (a worker
    # restarted): it goes again. Only the harness's own sandbox, of its own team, counts.
    Harness.objects.filter(id=hid, team_id=sandbox.team_id, sandbox_id=sandbox.id,
                           setup=Harness.Setup.RUNNING).update(setup=Harness.Setup.PENDING)  # fmt: skip
    if not Harness.objects.filter(id=hid, team_id=sandbox.team_id).exists():
        return
    try:
        enqueue.send("harness_setup", [hid], queue=sandbox.node.queue)
    except Exception as exc:
        log.error("could not enqueue the setup of harness %s: %s", hid, exc)
        Harness.objects.filter(id=hid).update(
            setup=Harness.Setup.FAILED, setup_error=f"could not enqueue: {exc}"
        )


class _LogWriter:
    """Output of a command in the harness, written to its log in chunks (at most every half a
    second), secrets masked."""

    def __init__(self, h: Harness, source: str, mask: list[str], run: Run | None = None) -> None:
        self.h, self.source, self.run = h, source, run
        self.masker = Masker(mask)
        self.buf: list[str] = []
        self.at = time.monotonic()
        self.lock = threading.Lock()

    def __call__(self, stream: str, data: bytes) -> None:
        text = self.masker.feed(data).decode("utf-8", "replace").replace("\r\n", "\n")
        with self.lock:
            self.buf.append(text)
            if time.monotonic() - self.at >= 0.5:
                self._flush()

    def _flush(self) -> None:
        text = "".join(self.buf)
        self.buf.clear()
        self.at = time.monotonic()
        if text:
            # git's progress redraws one line with \r: keep the last state of each line.
            lines = [
                ln.rsplit("\r", 1)[-1] if "\r" in ln.rstrip("\r") else ln.rstrip("\r")
                for ln in text.split("\n")
            ]
            harness_log(self.h, self.source, "\n".join(lines), run=self.run)

    def close(self) -> None:
        with self.lock:
            self.buf.append(self.masker.flush().decode("utf-8", "replace"))
            self._flush()


def harness_setup(*, harness_id: str) -> None:
    """Prepare the workspace in the harness's running sandbox: clone, configure git, install
    the agent's CLI. Its output goes to the harness's log as it comes. Runs once (a harness
    whose setup is done or running is left alone)."""
    if not Harness.objects.filter(id=harness_id, deleted_at__isnull=True, setup=Harness.Setup.PENDING).update(
        setup=Harness.Setup.RUNNING, setup_error="", updated_at=timezone.now()
    ):
        return
    h = Harness.objects.select_related("sandbox", "sandbox__node", "team").get(id=harness_id)
    sandbox = h.sandbox
    if sandbox is None or sandbox.status != S.RUNNING:
        Harness.objects.filter(id=h.id).update(setup=Harness.Setup.PENDING)
        return
    if sandbox.node is None or sandbox.node.name != local_node_name():
        # Asked on the wrong node: the sandbox's own node does it.
        Harness.objects.filter(id=h.id).update(setup=Harness.Setup.PENDING)
        harness_setup_enqueue(Sandbox.objects.select_related("node").get(id=sandbox.id))
        return
    p = presets.preset(h.agent)
    script = presets.setup_script(p=p, repo_url=h.repo_url, repo_branch=h.repo_branch, repo_secret=h.repo_secret,
                                  repo_auth=(sandbox.metadata or {}).get("repo_auth", ""))  # fmt: skip
    env = {**sandbox.env, **secret_svc.env_for(sandbox), "GIT_TERMINAL_PROMPT": "0"}
    harness_log(h, "event", "setting up the workspace")
    writer = _LogWriter(h, "setup", mask_values(h))
    req = ExecRequest(argv=["/bin/sh", "-c", script], env=env, cwd="/", timeout=SETUP_TIMEOUT_S,
                      max_output=1 << 20)  # fmt: skip
    try:
        result = sandbox_access(sandbox).exec(req, on_output=writer)
    except LauncherError as exc:
        writer.close()
        if not Sandbox.objects.filter(id=sandbox.id, status=S.RUNNING).exists():
            Harness.objects.filter(id=h.id, setup=Harness.Setup.RUNNING).update(setup=Harness.Setup.PENDING)
            harness_log(h, "event", "setup interrupted: it carries on when the harness starts again")
            return
        _setup_failed(h, f"the sandbox could not run the setup: {exc}")
        return
    writer.close()
    if not Sandbox.objects.filter(id=sandbox.id, status=S.RUNNING).exists():
        # Paused or stopped under it: done again (every step is skipped when already done)
        # when the harness next starts.
        Harness.objects.filter(id=h.id, setup=Harness.Setup.RUNNING).update(setup=Harness.Setup.PENDING)
        harness_log(h, "event", "setup interrupted: it carries on when the harness starts again")
        return
    if result.timed_out:
        _setup_failed(h, f"setup took longer than {SETUP_TIMEOUT_S} s")
        return
    if result.exit_code != 0:
        _setup_failed(h, f"setup failed (exit code {result.exit_code}); see the log above")
        return
    version = ""
    if p.binary:
        text = result.stdout.decode("utf-8", "replace")
        for line in text.splitlines():
            if line.startswith(f"{p.binary}: "):
                version = line[len(p.binary) + 2 :].strip()[:200]
    Harness.objects.filter(id=h.id, setup=Harness.Setup.RUNNING).update(
        setup=Harness.Setup.DONE, agent_version=version
    )
    harness_log(h, "event", "workspace ready")
    harness_notify(h)


def _setup_failed(h: Harness, why: str) -> None:
    Harness.objects.filter(id=h.id).update(setup=Harness.Setup.FAILED, setup_error=why)
    harness_log(h, "event", why)
    harness_notify(h)


def harness_notify(h: Harness) -> None:
    """The harness's pages and followers hear that it changed (its setup, its runs)."""
    if h.sandbox_id:
        notify.sandbox_changed(h.sandbox_id, "harness", h.team_id)


def harness_log(h: Harness, source: str, text: str, run: Run | None = None) -> None:
    if not text:
        return
    entry = HarnessLogEntry.objects.create(harness_id=h.id, source=source, text=text[-65536:], run=run)
    if entry.id % 200 == 0:  # now and then, the oldest beyond what is kept go
        HarnessLogEntry.objects.filter(harness_id=h.id, id__lte=entry.id - LOG_KEEP_ENTRIES * 4).delete()
        keep_from = (
            HarnessLogEntry.objects.filter(harness_id=h.id)
            .order_by("-id")
            .values_list("id", flat=True)[LOG_KEEP_ENTRIES - 1 : LOG_KEEP_ENTRIES]
        )
        if keep_from:
            HarnessLogEntry.objects.filter(harness_id=h.id, id__lt=keep_from[0]).delete()


def harness_log_entries(*, harness: Harness, after: int = 0, limit: int = 500) -> list[HarnessLogEntry]:
    qs = HarnessLogEntry.objects.filter(harness=harness)
    if after:
        return list(qs.filter(id__gt=after).order_by("id")[:limit])
    return list(reversed(qs.order_by("-id")[:limit]))


# -- lifecycle ------------------------------------------------------------------------------------


def harness_pause(*, harness: Harness) -> Harness:
    """Stop the harness's processes and terminals; the workspace (the volume) and the rest of
    its files stay."""
    sb = harness.sandbox
    if sb is None:
        raise Conflict(f"harness {harness.name} has no sandbox to pause", status=harness_status(harness))
    sandbox_svc.sandbox_pause(sandbox=sb, mode=sandbox_svc.PAUSE_MODE_STOP, reason="pausing the harness")
    harness_log(harness, "event", "pausing")
    audit.record("harness.pause", team=harness.team, target=f"{harness.name} ({harness.id})")
    return harness


def harness_resume(*, harness: Harness, user: Any = None) -> Harness:
    """Start the harness again over its files; a harness whose sandbox is gone (failed,
    stopped) gets a new one on the same volume."""
    sb = harness.sandbox
    if harness.setup == Harness.Setup.FAILED:
        # Resume after a failed setup tries it again (a secret fixed, a branch pushed…).
        Harness.objects.filter(id=harness.id).update(setup=Harness.Setup.PENDING, setup_error="")
        harness.setup, harness.setup_error = Harness.Setup.PENDING, ""
        harness_log(harness, "event", "trying the workspace setup again")
        if sb is not None and sb.status == S.RUNNING:
            harness_setup_enqueue(sb)
            audit.record("harness.resume", team=harness.team, target=f"{harness.name} ({harness.id})")
            return harness
    if sb is not None and sb.status == S.PAUSED:
        sandbox_svc.sandbox_resume(sandbox=sb)
        harness_log(harness, "event", "resuming")
    elif sb is not None and sb.status in (S.RUNNING, S.RESUMING, S.PENDING, S.STARTING):
        return harness
    elif sb is not None and sb.status == S.PAUSING:
        raise Conflict(f"harness {harness.name} is pausing; resume it once it is paused", status="pausing")
    else:
        # Its sandbox failed or was stopped: a new one, over the same workspace. Under the
        # harness's row lock, which a delete takes too: never a sandbox for a deleted harness.
        with transaction.atomic():
            if (
                not Harness.objects.select_for_update()
                .filter(id=harness.id, deleted_at__isnull=True)
                .exists()
            ):
                raise NotFound(f"harness {harness.name} was deleted")
            if sb is not None and sb.status != S.DELETED:
                sandbox_svc.sandbox_delete(sandbox=sb, reason="replaced by a new sandbox for its harness")
            image_row = sandbox_svc.image_resolve(harness.image)
            harness.sandbox = _start_sandbox(harness, user=user or harness.created_by,
                                             image_config=image_row.config, repo_auth=_repo_auth(harness))  # fmt: skip
            harness.setup = Harness.Setup.PENDING
            harness.save(update_fields=["sandbox", "setup", "updated_at"])
        harness_log(harness, "event", f"starting a new sandbox ({harness.sandbox.id}) over the workspace")
    audit.record("harness.resume", team=harness.team, target=f"{harness.name} ({harness.id})")
    return harness


def _repo_auth(h: Harness) -> str:
    if not h.repo_secret:
        return ""
    with contextlib.suppress(NotFound):
        value = secret_svc.decrypt(secret_svc.secret_get(team=h.team, name=h.repo_secret).ciphertext)
        return "ssh-key" if value.lstrip().startswith("-----BEGIN") else "token"
    return ""


def harness_ensure_running(*, harness: Harness, timeout: float, user: Any = None) -> Harness:
    """Resume the harness if it is paused and wait (at most ``timeout``) until it runs; the
    SSH gateway and runs use it. Raises :class:`Conflict` if it does not come up in time."""
    found = (
        Harness.objects.select_related("sandbox", "sandbox__node", "team")
        .filter(id=harness.id, deleted_at__isnull=True)
        .first()
    )
    if found is None:
        raise NotFound("the harness was deleted")
    harness = found
    if harness.sandbox is None or harness.sandbox.status != S.RUNNING:
        if harness.sandbox is not None and harness.sandbox.status == S.PAUSING:
            sandbox_svc.sandbox_wait(sandbox=harness.sandbox, timeout=timeout, statuses=(S.PAUSED, S.FAILED))
        harness.sandbox.refresh_from_db() if harness.sandbox else None
        harness_resume(harness=harness, user=user)
        assert harness.sandbox is not None
        sb = sandbox_svc.sandbox_wait(sandbox=harness.sandbox, timeout=timeout)
        if sb.status != S.RUNNING:
            raise Conflict(f"harness {harness.name} did not start within {timeout:.0f} s "
                           f"(its sandbox is {sb.status}{': ' + sb.status_reason if sb.status_reason else ''})",
                           status=sb.status)  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:
        setup = Harness.objects.filter(id=harness.id).values_list("setup", "setup_error").first()
        if setup is None or setup[0] in (Harness.Setup.DONE, Harness.Setup.FAILED):
            break
        if time.monotonic() >= deadline:
            raise Conflict(
                f"harness {harness.name} is still being set up; try again shortly", status="creating"
            )
        time.sleep(0.2)
    harness.refresh_from_db()
    return harness


def harness_delete(*, harness: Harness, delete_volume: bool = False) -> None:
    """Delete the harness and its sandbox; its volume stays unless ``delete_volume`` (then it
    is deleted once the sandbox has let go of it). Its API token is revoked; runs still going
    are cancelled."""
    now = timezone.now()
    with transaction.atomic():  # after any resume that holds the row: its new sandbox is seen below
        if not Harness.objects.select_for_update().filter(id=harness.id, deleted_at__isnull=True).exists():
            return
        Harness.objects.filter(id=harness.id).update(deleted_at=now)
    harness = Harness.objects.select_related("sandbox", "sandbox__node", "volume", "api_token", "team").get(
        id=harness.id
    )
    for run in Run.objects.filter(harness=harness, status__in=Run.ACTIVE):
        Run.objects.filter(id=run.id, status__in=Run.ACTIVE).update(
            status=Run.Status.CANCELLED, error="the harness was deleted", finished_at=now
        )
    if harness.sandbox is not None and harness.sandbox.status != S.DELETED:
        sandbox_svc.sandbox_delete(sandbox=harness.sandbox, reason=f"harness {harness.name} deleted")
    if harness.api_token_id:
        with contextlib.suppress(Exception):
            if harness.api_token is not None:
                auth_svc.token_revoke_row(harness.api_token)
    kept = harness.volume.name if harness.volume else ""
    if delete_volume and harness.volume_id:
        _delete_volume_when_free(harness.volume_id)
    audit.record("harness.delete", team=harness.team, target=f"{harness.name} ({harness.id})",
                 delete_volume=delete_volume, volume=kept)  # fmt: skip


def _delete_volume_when_free(volume_id: str) -> None:
    """The volume's sandbox is being destroyed on its node; delete the volume once it is
    (a task, retried until the sandbox lets go)."""
    transaction.on_commit(
        lambda: enqueue.send("volume_delete_when_free", [volume_id], queue="control", countdown=1)
    )


def volume_delete_when_free(*, volume_id: str) -> bool:
    """True when done (deleted, or already gone); False: a sandbox still holds it."""
    volume = Volume.objects.filter(id=volume_id).first()
    if volume is None:
        return True
    if volume_svc.volume_holders(volume):
        return False
    try:
        volume_svc.volume_delete(volume=volume)
    except Conflict:  # held again meanwhile, or its node busy: the next try
        return False
    return True


def harnesses_setup_sweep() -> int:
    """A setup marked running for longer than any setup may take was lost with its worker."""
    stale = timezone.now() - timedelta(seconds=SETUP_TIMEOUT_S + 300)
    n = 0
    for h in Harness.objects.filter(
        setup=Harness.Setup.RUNNING, updated_at__lt=stale, deleted_at__isnull=True
    ):
        _setup_failed(h, "the workspace setup was lost (its worker stopped); resume the harness to try again")
        n += 1
    return n


def harnesses_with_active_runs(sandbox_ids: list[str]) -> set[str]:
    """Of these sandboxes, those whose harness has a run going (they are not idle)."""
    return set(
        Run.objects.filter(harness__sandbox_id__in=sandbox_ids, status__in=Run.ACTIVE).values_list(
            "harness__sandbox_id", flat=True
        )
    )


def harness_token_create_check(*, token: Any, secrets: list[str], volumes: list[Any]) -> None:
    """What a harness's own token may give a sandbox it creates: the secrets its harness has
    (the agent holds their values already) and no volume (another harness's workspace, say)."""
    if getattr(token, "harness_id", None) is None:
        return
    h = Harness.objects.filter(id=token.harness_id).values_list("secrets", "repo_secret").first()
    allowed = set(h[0]) | ({h[1]} if h[1] else set()) if h else set()
    if extra := sorted(set(secrets) - allowed):
        raise Forbidden(
            f"a harness's token may give a sandbox only its harness's secrets, not {', '.join(extra)}"
        )
    if volumes:
        raise Forbidden("a harness's token cannot attach volumes to a sandbox")


def harness_of_token(token: Any, sandbox: Sandbox) -> bool:
    """Is ``token`` the API token of the harness whose sandbox this is? (An agent must not
    loosen its own harness's network with the token it was given.)"""
    return Harness.objects.filter(api_token_id=getattr(token, "id", None), sandbox_id=sandbox.id).exists()


def harness_touch(h: Harness) -> None:
    if h.sandbox_id:
        calls_svc.sandbox_mark_active(h.sandbox_id)
