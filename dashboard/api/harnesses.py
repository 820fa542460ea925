"""/api/v1/harnesses, /api/v1/runs, /api/v1/ssh-keys: workspaces for coding agents, the tasks
given to them, and the keys that open them over SSH."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

from django.conf import settings
from django.http import HttpRequest
from ninja import Query, Router, Schema
from pydantic import Field

from runtime import presets, streams
from runtime.models import Harness, Run, Sandbox
from runtime.services import harnesses as svc
from runtime.services import processes as proc_svc
from runtime.services import runs as run_svc
from runtime.services import ssh_keys as key_svc

from .blocking import blocking
from .processes import ndjson_events, ndjson_response

router = Router(tags=["harnesses"])
runs_router = Router(tags=["harnesses"])
keys_router = Router(tags=["ssh keys"])


class RepoIn(Schema):
    url: str = Field(description="https://…, ssh://…, git://… or git@host:owner/repo.git")
    branch: str = Field("", description="default: the repository's default branch")
    secret: str = Field("", description="a team secret holding a token (https) or a deploy key (ssh)")


class HarnessIn(Schema):
    name: str = Field(description="1-63 of a-z 0-9 -, unique in the team: the SSH user name")
    agent: str = Field(description=f"one of: {', '.join(presets.PRESETS)}")
    command: str | list[str] | None = Field(
        None, description="custom agent: the command (a string runs in sh -c)"
    )
    image: str = "base"
    cpu: float = 1.0
    memory_mb: int = 2048
    disk_mb: int | None = Field(
        None, description="the workspace volume's size (default HANGAR_HARNESS_DISK_MB)"
    )
    repo: RepoIn | None = None
    secrets: list[str] = Field(default_factory=list, description="team secrets given as env vars (API keys)")
    env: dict[str, str] = Field(default_factory=dict)
    idle_timeout_s: int | None = Field(
        None,
        description="pause after this long without activity (default HANGAR_HARNESS_IDLE_TIMEOUT_S; 0: never)",
    )
    network: dict[str, Any] | None = Field(None, description='egress policy (default {"egress": "all"})')
    volume: str | None = Field(
        None,
        description="work in this existing volume of the team (e.g. a deleted "
        "harness's kept workspace) instead of a new one",
    )


class RepoOut(Schema):
    url: str
    branch: str
    secret: str


class HarnessOut(Schema):
    id: str
    name: str
    agent: str
    command: list[str]
    status: str = Field(description="creating, running, pausing, paused, resuming, stopped, failed, deleted")
    setup: str = Field(description="pending, running, done, failed: cloning and installing the agent")
    setup_error: str
    agent_version: str
    image: str
    cpu: float
    memory_mb: int
    disk_mb: int
    repo: RepoOut | None
    secrets: list[str]
    network: dict[str, Any]
    idle_timeout_s: int | None
    sandbox: str | None
    sandbox_status: str | None
    volume: str | None
    volume_name: str | None
    ssh_command: str
    last_activity_at: datetime | None
    created_at: datetime


def harness_out(h: Harness) -> HarnessOut:
    return HarnessOut(
        id=h.id, name=h.name, agent=h.agent, command=h.command, status=svc.harness_status(h), setup=h.setup,
        setup_error=h.setup_error, agent_version=h.agent_version, image=h.image, cpu=h.cpu, memory_mb=h.memory_mb,
        disk_mb=h.disk_mb,
        repo=RepoOut(url=h.repo_url, branch=h.repo_branch, secret=h.repo_secret) if h.repo_url else None,
        secrets=h.secrets, network=h.network, idle_timeout_s=h.idle_timeout_s, sandbox=h.sandbox_id,
        sandbox_status=h.sandbox.status if h.sandbox else None, volume=h.volume_id,
        volume_name=h.volume.name if h.volume else None, ssh_command=svc.ssh_command(h),
        last_activity_at=svc.harness_last_activity(h), created_at=h.created_at,
    )  # fmt: skip


class RunIn(Schema):
    prompt: str
    timeout_s: int | None = Field(None, description="default 3600 (at most HANGAR_RUN_MAX_TIMEOUT_S)")


class RunOut(Schema):
    id: str
    harness: str
    harness_name: str
    status: str = Field(description="queued, running, succeeded, failed, timed_out, cancelled")
    prompt: str
    exit_code: int | None
    error: str
    duration_ms: float | None
    diff: str
    diff_truncated: bool
    timeout_s: int
    process: int | None = Field(description="the process in the harness's sandbox that ran the agent")
    sandbox: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


def run_out(r: Run) -> RunOut:
    return RunOut(
        id=r.id, harness=r.harness_id, harness_name=r.harness.name, status=r.status, prompt=r.prompt,
        exit_code=r.exit_code, error=r.error, duration_ms=r.duration_ms, diff=r.diff,
        diff_truncated=r.diff_truncated, timeout_s=r.timeout_s, process=r.exec_id,
        sandbox=r.exec.sandbox_id if r.exec_id and r.exec else r.harness.sandbox_id, created_at=r.created_at,
        started_at=r.started_at, finished_at=r.finished_at,
    )  # fmt: skip


class DeleteQuery(Schema):
    delete_volume: bool = Field(False, description="delete its workspace volume too (default: keep it)")


class WaitIn(Schema):
    wait: bool = Field(False, description="answer once the change is done (at most HANGAR_CREATE_WAIT_S)")


class LogQuery(Schema):
    after: int = Field(0, ge=0, description="entries after this id (for polling)")
    limit: int = Field(500, ge=1, le=5000)


class LogEntryOut(Schema):
    id: int
    source: str
    run: str | None
    text: str
    created_at: datetime


def _team(request: HttpRequest):
    return request.auth.team  # type: ignore[attr-defined]


def _user(request: HttpRequest):
    return request.auth.user  # type: ignore[attr-defined]


def _get(request: HttpRequest, harness_id: str) -> Harness:
    return svc.harness_get(team=_team(request), harness_id=harness_id)


# -- harnesses ----------------------------------------------------------------------------------


@router.post("", response={201: HarnessOut})
async def create_harness(request: HttpRequest, payload: HarnessIn):
    """Create a harness: a workspace volume at `/workspace`, a sandbox over it, then (streamed
    to its log) the repository cloned there and the agent's CLI installed if the image lacks
    it. Answers at once with status `creating`; poll until `running`."""

    def create() -> HarnessOut:
        idle = payload.idle_timeout_s
        if idle is None:
            idle = settings.HANGAR_HARNESS_IDLE_TIMEOUT_S or None
        h = svc.harness_create(
            team=_team(request), user=_user(request), name=payload.name, agent=payload.agent,
            command=payload.command, image=payload.image, cpu=payload.cpu, memory_mb=payload.memory_mb,
            disk_mb=payload.disk_mb, repo=payload.repo.dict() if payload.repo else None, secrets=payload.secrets,
            env=payload.env, idle_timeout_s=idle, network=payload.network, volume=payload.volume,
        )  # fmt: skip
        return harness_out(svc.harness_get(team=_team(request), harness_id=h.id))

    return 201, await blocking(create)()


@router.get("", response=list[HarnessOut])
async def list_harnesses(request: HttpRequest):
    """The team's harnesses by name."""
    return await blocking(lambda: [harness_out(h) for h in svc.harnesses_for_team(team=_team(request))])()


@router.get("/{harness_id}", response=HarnessOut)
async def get_harness(request: HttpRequest, harness_id: str):
    """One harness, by id or name."""
    return await blocking(lambda: harness_out(_get(request, harness_id)))()


@router.post("/{harness_id}/pause", response=HarnessOut)
async def pause_harness(request: HttpRequest, harness_id: str, payload: WaitIn | None = None):
    """Stop its processes and terminals; `/workspace` (the volume) and the rest of its files
    stay. It costs only its disk while paused."""

    def pause() -> HarnessOut:
        h = svc.harness_pause(harness=_get(request, harness_id))
        if payload is not None and payload.wait and h.sandbox is not None:
            svc.sandbox_svc.sandbox_wait(sandbox=h.sandbox, timeout=settings.HANGAR_CREATE_WAIT_S,
                                         statuses=[Sandbox.Status.PAUSED, Sandbox.Status.FAILED])  # fmt: skip
        return harness_out(_get(request, harness_id))

    return await blocking(pause)()


@router.post("/{harness_id}/resume", response=HarnessOut)
async def resume_harness(request: HttpRequest, harness_id: str, payload: WaitIn | None = None):
    """Start it again over the same files, git state and agent config (a harness whose sandbox
    failed gets a new one over the same volume)."""

    def resume() -> HarnessOut:
        h = svc.harness_resume(harness=_get(request, harness_id), user=_user(request))
        if payload is not None and payload.wait and h.sandbox is not None:
            svc.sandbox_svc.sandbox_wait(sandbox=h.sandbox, timeout=settings.HANGAR_CREATE_WAIT_S)
        return harness_out(_get(request, harness_id))

    return await blocking(resume)()


@router.delete("/{harness_id}", response={204: None})
async def delete_harness(request: HttpRequest, harness_id: str, q: Query[DeleteQuery]):
    """Delete the harness and its sandbox. Its workspace volume is kept (it shows in
    /volumes) unless `delete_volume=true`."""
    await blocking(
        lambda: svc.harness_delete(harness=_get(request, harness_id), delete_volume=q.delete_volume)
    )()
    return 204, None


@router.get("/{harness_id}/logs", response=list[LogEntryOut])
async def harness_logs(request: HttpRequest, harness_id: str, q: Query[LogQuery]):
    """The harness's log: setup output (clone, install), runs starting and ending, pauses…
    The last `limit` entries, or those after `after` (poll with the last id you have)."""

    def entries() -> list[LogEntryOut]:
        rows = svc.harness_log_entries(harness=_get(request, harness_id), after=q.after, limit=q.limit)
        return [LogEntryOut(id=e.id, source=e.source, run=e.run_id, text=e.text, created_at=e.created_at)
                for e in rows]  # fmt: skip

    return await blocking(entries)()


@router.post("/{harness_id}/runs", response={201: RunOut})
async def create_run(request: HttpRequest, harness_id: str, payload: RunIn):
    """Give the agent a task: it runs headless in `/workspace` with the prompt (its preset's
    form, e.g. `claude -p`; every agent also gets `$HANGAR_PROMPT` and the prompt on stdin).
    A paused harness is resumed first. Answers at once (`queued`); follow
    `/runs/{id}/logs`, or poll `/runs/{id}` until it ends."""

    def create() -> RunOut:
        run = run_svc.run_create(harness=_get(request, harness_id), user=_user(request), prompt=payload.prompt,
                                 timeout_s=payload.timeout_s)  # fmt: skip
        return run_out(run_svc.run_get(team=_team(request), run_id=run.id))

    return 201, await blocking(create)()


@router.get("/{harness_id}/runs", response=list[RunOut])
async def list_runs(request: HttpRequest, harness_id: str):
    """The harness's runs, newest first (the last 100)."""

    def rows() -> list[RunOut]:
        h = _get(request, harness_id)
        return [run_out(r) for r in run_svc.runs_for_harness(harness=h).select_related("harness")[:100]]

    return await blocking(rows)()


# -- runs ---------------------------------------------------------------------------------------


@runs_router.get("/{run_id}", response=RunOut)
async def get_run(request: HttpRequest, run_id: str):
    """A run: its status, exit code, duration and the diff it left in `/workspace`."""
    return await blocking(lambda: run_out(run_svc.run_get(team=_team(request), run_id=run_id)))()


class RunLogQuery(Schema):
    offset: int = Field(0, ge=0, description="output offset to start from")
    follow: bool = Field(True, description="until the run's process exits")


@runs_router.get("/{run_id}/logs")
async def run_logs(request: HttpRequest, run_id: str, q: Query[RunLogQuery]):
    """The agent's output as NDJSON (`{"type": "stdout"|"stderr", "data"}` lines, then
    `{"type": "exit", …}`), live while it runs. A queued run is waited for (until it starts
    or ends); the last line is `{"type": "run", …}` with its final record."""

    async def body():
        run = await blocking(run_svc.run_get)(team=_team(request), run_id=run_id)
        while run.status == Run.Status.QUEUED and q.follow:
            await asyncio.sleep(0.5)
            run = await blocking(run_svc.run_get)(team=_team(request), run_id=run_id)
        if run.exec_id is not None:
            node = await blocking(lambda: run.exec.sandbox.node.name if run.exec.sandbox.node else "")()
            target = proc_svc.FollowTarget(
                node_name=node, key=streams.exec_key(run.exec_id), row_id=run.exec_id
            )
            follow = proc_svc.ProcessFollow(target, offset=q.offset, follow=q.follow)
            async for line in ndjson_events(follow):
                yield line
            # The bridge has seen the exit; the run's record follows within moments.
            for _ in range(40):
                run = await blocking(run_svc.run_get)(team=_team(request), run_id=run_id)
                if run.status not in Run.ACTIVE or not q.follow:
                    break
                await asyncio.sleep(0.25)
        import json

        yield (json.dumps({"type": "run", **run_out(run).dict()}, default=str) + "\n").encode()

    return ndjson_response(body())


@runs_router.post("/{run_id}/cancel", response=RunOut)
async def cancel_run(request: HttpRequest, run_id: str):
    """Cancel a queued or running run: the agent's process is killed, the run ends as
    `cancelled` (with the diff of what it had done)."""
    run, target = await blocking(
        lambda: run_svc.run_cancel(run=run_svc.run_get(team=_team(request), run_id=run_id))
    )()
    if target is not None:
        await proc_svc.process_send(node_name=target[0], key=target[1], kind=streams.KILL)
    return await blocking(lambda: run_out(run_svc.run_get(team=_team(request), run_id=run_id)))()


# -- ssh keys -----------------------------------------------------------------------------------


class SshKeyIn(Schema):
    name: str = Field("", description="default: the key's comment")
    public_key: str = Field(description="one line in OpenSSH format (the .pub file)")


class SshKeyOut(Schema):
    id: int
    name: str
    team: str | None = Field(description="the only team whose harnesses it opens (null: all of yours)")
    public_key: str
    fingerprint: str
    created_at: datetime
    last_used_at: datetime | None


def _key_out(k: Any) -> SshKeyOut:
    return SshKeyOut(id=k.id, name=k.name, team=k.team.name if k.team_id else None, public_key=k.public_key,
                     fingerprint=k.fingerprint, created_at=k.created_at, last_used_at=k.last_used_at)  # fmt: skip


@keys_router.get("", response=list[SshKeyOut])
async def list_keys(request: HttpRequest):
    """Your SSH public keys (the token's user's): they open your teams' harnesses over SSH."""
    return await blocking(
        lambda: [_key_out(k) for k in key_svc.ssh_keys_for_user(user=_user(request)).select_related("team")]
    )()


@keys_router.post("", response={201: SshKeyOut})
async def add_key(request: HttpRequest, payload: SshKeyIn):
    """Register a public key for yourself; then `ssh -p <port> <harness>@<host>`. A key
    registered with a token opens only the harnesses of the token's team (keys added on the
    profile page open all of your teams')."""
    key = await blocking(lambda: key_svc.ssh_key_add(user=_user(request), name=payload.name,
                                                     public_key=payload.public_key, team=_team(request)))()  # fmt: skip
    return 201, _key_out(key)


@keys_router.delete("/{key_id}", response={204: None})
async def delete_key(request: HttpRequest, key_id: str):
    """Remove one of your keys (by id or name); SSH with it is refused from then on."""
    await blocking(lambda: key_svc.ssh_key_delete(user=_user(request), key_id=key_id))()
    return 204, None
