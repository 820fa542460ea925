"""/api/v1/harnesses, /api/v1/runs, /api/v1/ssh-keys: workspaces for coding agents, the tasks
given to them, and the keys that open them over SSH."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Annotated, Any, Literal

from django.conf import settings
from ninja import Query, Router, Schema
from pydantic import Field

from dashboard.live import wait_for
from runtime import presets
from runtime.models import Harness, Run, Sandbox
from runtime.notify import sandbox_channel
from runtime.services import harnesses as svc
from runtime.services import processes as proc_svc
from runtime.services import runs as run_svc
from runtime.services import spans
from runtime.services import ssh_keys as key_svc
from runtime.services.auth import token_allows
from runtime.services.runs import MAX_PROMPT
from runtime.services.sandboxes import SETTLED
from runtime.services.volumes import MIN_MB as VOLUME_MIN_MB

from ..auth_watch import while_authorised
from ..streaming import ndjson_response
from .auth import AuthedRequest
from .blocking import blocking
from .processes import MAX_OFFSET, ndjson_events
from .schemas import NDJSON_CONTENT, StrictIn, errors

router = Router(tags=["harnesses"])
runs_router = Router(tags=["harnesses"])
keys_router = Router(tags=["ssh keys"])


class RepoIn(StrictIn):
    url: str = Field(description="https://…, ssh://…, git://… or git@host:owner/repo.git")
    branch: str = Field("", description="default: the repository's default branch")
    secret: str = Field("", description="a team secret holding a token (https) or a deploy key (ssh)")


class HarnessIn(StrictIn):
    name: str = Field(
        min_length=1, max_length=63, description="1-63 of a-z 0-9 -, unique in the team: the SSH user name"
    )
    agent: Literal[tuple(presets.PRESETS)] = Field(  # type: ignore[valid-type]
        description="the coding agent (custom: your own `command`)"
    )
    command: str | list[str] | None = Field(
        None, description="custom agent: the command (a string runs in sh -c)"
    )
    image: str = Field("base", min_length=1, max_length=300)
    runtime: str = Field(
        settings.HANGAR_DEFAULT_RUNTIME, min_length=1, max_length=32,
        description="its sandbox's runtime: a launcher this install has (422 lists them); default HANGAR_DEFAULT_RUNTIME",
    )  # fmt: skip
    cpu: float = Field(1.0, ge=0.1, le=settings.HANGAR_SANDBOX_MAX_CPU)
    memory_mb: int = Field(
        2048, ge=settings.HANGAR_SANDBOX_MIN_MEMORY_MB, le=settings.HANGAR_SANDBOX_MAX_MEMORY_MB
    )
    disk_mb: int | None = Field(
        None,
        ge=VOLUME_MIN_MB,
        le=settings.HANGAR_VOLUME_MAX_MB,
        description="the workspace volume's size (default HANGAR_HARNESS_DISK_MB)",
    )
    repo: RepoIn | None = None
    secrets: list[str] = Field(default_factory=list, description="team secrets given as env vars (API keys)")
    env: dict[str, str] = Field(default_factory=dict)
    idle_timeout_s: (
        Literal[0] | Annotated[int, Field(ge=10, le=settings.HANGAR_SANDBOX_MAX_TIMEOUT_S)] | None
    ) = Field(
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
    runtime: str
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
        setup_error=h.setup_error, agent_version=h.agent_version, image=h.image, runtime=h.runtime, cpu=h.cpu,
        memory_mb=h.memory_mb,
        disk_mb=h.disk_mb,
        repo=RepoOut(url=h.repo_url, branch=h.repo_branch, secret=h.repo_secret) if h.repo_url else None,
        secrets=h.secrets, network=h.network, idle_timeout_s=h.idle_timeout_s, sandbox=h.sandbox_id,
        sandbox_status=h.sandbox.status if h.sandbox else None, volume=h.volume_id,
        volume_name=h.volume.name if h.volume else None, ssh_command=svc.ssh_command(h),
        last_activity_at=svc.harness_last_activity(h), created_at=h.created_at,
    )  # fmt: skip


class RunIn(StrictIn):
    prompt: str = Field(min_length=1, description=f"at most {MAX_PROMPT} bytes of UTF-8")
    timeout_s: int | None = Field(
        None,
        ge=1,
        le=settings.HANGAR_RUN_MAX_TIMEOUT_S,
        description="default 3600 (at most HANGAR_RUN_MAX_TIMEOUT_S)",
    )


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
    trace_id: str = Field(
        description="the run's trace (GET /traces/{trace_id}): Hangar's spans and the agent's"
    )


def run_out(r: Run) -> RunOut:
    return RunOut(
        id=r.id, harness=r.harness_id, harness_name=r.harness.name, status=r.status, prompt=r.prompt,
        exit_code=r.exit_code, error=r.error, duration_ms=r.duration_ms, diff=r.diff,
        diff_truncated=r.diff_truncated, timeout_s=r.timeout_s, process=r.exec_id,
        sandbox=r.exec.sandbox_id if r.exec_id and r.exec else r.harness.sandbox_id, created_at=r.created_at,
        started_at=r.started_at, finished_at=r.finished_at, trace_id=spans.run_trace(r.id).trace_id,
    )  # fmt: skip


class DeleteQuery(Schema):
    delete_volume: bool = Field(False, description="delete its workspace volume too (default: keep it)")


class WaitIn(StrictIn):
    wait: bool = Field(
        True, description="answer once the change is done (at most HANGAR_CREATE_WAIT_S), as for sandboxes"
    )


class LogQuery(Schema):
    after: int = Field(0, ge=0, description="entries after this id (for polling)")
    limit: int = Field(500, ge=1, le=5000)


class LogEntryOut(Schema):
    id: int
    source: str
    run: str | None
    text: str
    created_at: datetime


def _team(request: AuthedRequest):
    return request.auth.team


def _user(request: AuthedRequest):
    return request.auth.user


def _get(request: AuthedRequest, harness_id: str) -> Harness:
    return svc.harness_get(team=_team(request), harness_id=harness_id)


# -- harnesses ----------------------------------------------------------------------------------


@router.post("", response={201: HarnessOut, **errors(404, 409, 429, 502, 503)})
async def create_harness(request: AuthedRequest, payload: HarnessIn):
    """Create a harness: a workspace volume at `/workspace`, a sandbox over it, then (streamed
    to its log) the repository cloned there and the agent's CLI installed if the image lacks
    it. Answers at once with status `creating`; poll until `running`."""

    def create() -> HarnessOut:
        idle = payload.idle_timeout_s
        if idle is None:
            idle = settings.HANGAR_HARNESS_IDLE_TIMEOUT_S or None
        h = svc.harness_create(
            team=_team(request), user=_user(request), name=payload.name, agent=payload.agent,
            command=payload.command, image=payload.image, runtime=payload.runtime, cpu=payload.cpu,
            memory_mb=payload.memory_mb,
            disk_mb=payload.disk_mb, repo=payload.repo.dict() if payload.repo else None, secrets=payload.secrets,
            env=payload.env, idle_timeout_s=idle, network=payload.network, volume=payload.volume,
        )  # fmt: skip
        return harness_out(svc.harness_get(team=_team(request), harness_id=h.id))

    return 201, await blocking(create)()


@router.get("", response=list[HarnessOut])
async def list_harnesses(request: AuthedRequest):
    """The team's harnesses by name."""
    return await blocking(lambda: [harness_out(h) for h in svc.harnesses_for_team(team=_team(request))])()


@router.get("/{harness_id}", response=HarnessOut)
async def get_harness(request: AuthedRequest, harness_id: str):
    """One harness, by id or name."""
    return await blocking(lambda: harness_out(_get(request, harness_id)))()


async def _answer(request: AuthedRequest, harness_id: str, h: Harness, statuses: tuple[str, ...],
                  wait: bool) -> HarnessOut:  # fmt: skip
    """The harness as the answer shows it; with ``wait``, once its sandbox's status is one of
    ``statuses`` (or ``HANGAR_CREATE_WAIT_S`` has passed), waiting on the event loop, not on a
    thread (as the sandboxes' pause and resume do)."""
    sandbox_id = h.sandbox_id
    if wait and sandbox_id:

        def status() -> str:
            row = Sandbox.objects.filter(id=sandbox_id).values_list("status", flat=True).first()
            return row or Sandbox.Status.DELETED

        await wait_for(
            sandbox_channel(sandbox_id), status, lambda s: s in statuses, settings.HANGAR_CREATE_WAIT_S
        )
    return await blocking(lambda: harness_out(_get(request, harness_id)))()


@router.post("/{harness_id}/pause", response={200: HarnessOut, **errors(409)})
async def pause_harness(request: AuthedRequest, harness_id: str, payload: WaitIn | None = None):
    """Stop its processes and terminals; `/workspace` (the volume) and the rest of its files
    stay. It costs only its disk while paused. With `wait` (default) it answers once paused."""
    h = await blocking(lambda: svc.harness_pause(harness=_get(request, harness_id)))()
    done = (Sandbox.Status.PAUSED, Sandbox.Status.FAILED, Sandbox.Status.DELETED)
    return await _answer(request, harness_id, h, done, wait=payload is None or payload.wait)


@router.post("/{harness_id}/resume", response={200: HarnessOut, **errors(409, 429, 502, 503)})
async def resume_harness(request: AuthedRequest, harness_id: str, payload: WaitIn | None = None):
    """Start it again over the same files, git state and agent config (a harness whose sandbox
    failed gets a new one over the same volume). With `wait` (default) it answers once its
    sandbox runs again."""
    h = await blocking(lambda: svc.harness_resume(harness=_get(request, harness_id), user=_user(request)))()
    return await _answer(request, harness_id, h, SETTLED, wait=payload is None or payload.wait)


@router.delete("/{harness_id}", response={204: None, **errors(409, 502)})
async def delete_harness(request: AuthedRequest, harness_id: str, q: Query[DeleteQuery]):
    """Delete the harness and its sandbox. Its workspace volume is kept (it shows in
    /volumes) unless `delete_volume=true`."""
    await blocking(
        lambda: svc.harness_delete(harness=_get(request, harness_id), delete_volume=q.delete_volume)
    )()
    return 204, None


@router.get("/{harness_id}/logs", response=list[LogEntryOut])
async def harness_logs(request: AuthedRequest, harness_id: str, q: Query[LogQuery]):
    """The harness's log: setup output (clone, install), runs starting and ending, pauses…
    The last `limit` entries, or those after `after` (poll with the last id you have)."""

    def entries() -> list[LogEntryOut]:
        rows = svc.harness_log_entries(harness=_get(request, harness_id), after=q.after, limit=q.limit)
        return [LogEntryOut(id=e.id, source=e.source, run=e.run_id, text=e.text, created_at=e.created_at)
                for e in rows]  # fmt: skip

    return await blocking(entries)()


@router.post("/{harness_id}/runs", response={201: RunOut, **errors(409)})
async def create_run(request: AuthedRequest, harness_id: str, payload: RunIn):
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
async def list_runs(request: AuthedRequest, harness_id: str):
    """The harness's runs, newest first (the last 100)."""

    def rows() -> list[RunOut]:
        h = _get(request, harness_id)
        return [run_out(r) for r in run_svc.runs_for_harness(harness=h).select_related("harness")[:100]]

    return await blocking(rows)()


# -- runs ---------------------------------------------------------------------------------------


@runs_router.get("/{run_id}", response=RunOut)
async def get_run(request: AuthedRequest, run_id: str):
    """A run: its status, exit code, duration and the diff it left in `/workspace`."""
    return await blocking(lambda: run_out(run_svc.run_get(team=_team(request), run_id=run_id)))()


class RunLogQuery(Schema):
    offset: int = Field(0, ge=0, le=MAX_OFFSET, description="output offset to start from")
    follow: bool = Field(True, description="until the run's process exits")


@runs_router.get(
    "/{run_id}/logs",
    response={200: None},
    openapi_extra={
        "responses": {
            200: {"description": "NDJSON events", "content": {"application/x-ndjson": NDJSON_CONTENT}}
        }
    },
)
async def run_logs(request: AuthedRequest, run_id: str, q: Query[RunLogQuery]):
    """The agent's output as NDJSON (`{"type": "stdout"|"stderr", "data"}` lines, then
    `{"type": "exit", …}`), live while it runs. A queued run is waited for (until it starts
    or ends); the last line is `{"type": "run", …}` with its final record (or, if the stream
    fails on the way, `{"type": "error", "message"}`)."""
    # Looked up before the answer starts: an unknown run is a 404, not a 200 cut short.
    first = await blocking(run_svc.run_get)(team=_team(request), run_id=run_id)

    async def body():
        run = first
        while run.status == Run.Status.QUEUED and q.follow:
            await asyncio.sleep(0.5)
            run = await blocking(run_svc.run_get)(team=_team(request), run_id=run_id)
        if run.exec_id is not None:
            process = await blocking(lambda: proc_svc.ProcessHandle.of_exec(run.exec.sandbox, run.exec_id))()
            follow = process.follow(offset=q.offset, follow=q.follow)
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

    return await ndjson_response(while_authorised(body(), request.auth))


@runs_router.post("/{run_id}/cancel", response={200: RunOut, **errors(409)})
async def cancel_run(request: AuthedRequest, run_id: str):
    """Cancel a queued or running run: the agent's process is killed, the run ends as
    `cancelled` (with the diff of what it had done)."""
    run, process = await blocking(
        lambda: run_svc.run_cancel(run=run_svc.run_get(team=_team(request), run_id=run_id))
    )()
    if process is not None:
        await process.kill()
    return await blocking(lambda: run_out(run_svc.run_get(team=_team(request), run_id=run_id)))()


# -- ssh keys -----------------------------------------------------------------------------------


class SshKeyIn(StrictIn):
    name: str = Field("", description="default: the key's comment")
    public_key: str = Field(description="one line in OpenSSH format (the .pub file)")


class SshKeyOut(Schema):
    id: int
    name: str
    team: str | None = Field(description="the only team whose harnesses it opens (null: all of yours)")
    role: str | None = Field(description="the most it acts as there (null: your role in the team); a key "
                             "registered with a token acts at most as the token could")  # fmt: skip
    public_key: str
    fingerprint: str
    created_at: datetime
    last_used_at: datetime | None


def _key_out(k: Any) -> SshKeyOut:
    return SshKeyOut(id=k.id, name=k.name, team=k.team.name if k.team_id else None, role=k.role or None,
                     public_key=k.public_key, fingerprint=k.fingerprint, created_at=k.created_at,
                     last_used_at=k.last_used_at)  # fmt: skip


@keys_router.get("", response=list[SshKeyOut])
async def list_keys(request: AuthedRequest):
    """Your SSH public keys (the token's user's): they open your teams' harnesses over SSH."""
    return await blocking(
        lambda: [_key_out(k) for k in key_svc.ssh_keys_for_user(user=_user(request)).select_related("team")]
    )()


@keys_router.post("", response={201: SshKeyOut, **errors(409)})
async def add_key(request: AuthedRequest, payload: SshKeyIn):
    """Register a public key for yourself; then `ssh -p <port> <harness>@<host>`. A key
    registered with a token opens only the harnesses of the token's team (keys added on the
    profile page open all of your teams')."""
    token = request.auth
    # The key acts at most as this token could: its role, and a viewer's where its scopes do not
    # let it use harnesses (a viewer's or a narrowly scoped token does not make a member's shell).
    role = token.effective_role if token_allows(token, "harnesses:write") else "viewer"
    key = await blocking(lambda: key_svc.ssh_key_add(user=_user(request), name=payload.name,
                                                     public_key=payload.public_key, team=_team(request),
                                                     role=role))()  # fmt: skip
    return 201, _key_out(key)


@keys_router.delete("/{key_id}", response={204: None})
async def delete_key(request: AuthedRequest, key_id: str):
    """Remove one of your keys (by id or name); SSH with it is refused from then on."""
    await blocking(lambda: key_svc.ssh_key_delete(user=_user(request), key_id=key_id))()
    return 204, None
