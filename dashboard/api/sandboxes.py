"""/api/v1/sandboxes: create, inspect, exec, files, delete."""

from __future__ import annotations

import codecs
import json
import weakref
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import quote

from django.conf import settings
from django.http import HttpRequest, StreamingHttpResponse
from ninja import Query, Router, Schema
from pydantic import Field

from dashboard.live import wait_for
from runtime.errors import Forbidden, InvalidValue
from runtime.memory import GIVE_BACK_AFTER, give_memory_back
from runtime.models import Exec, Sandbox, SandboxEvent
from runtime.notify import sandbox_channel
from runtime.services import exec_limits
from runtime.services import sandbox_io as io_svc
from runtime.services import sandboxes as svc
from runtime.services import volumes as volume_svc
from runtime.services.harnesses import harness_of_token, harness_token_create_check
from runtime.services.previews import port_expose, port_unexpose, previews_of

from ..auth_watch import while_authorised
from ..streaming import download_response
from .auth import AuthedRequest
from .blocking import blocking
from .permissions import sees_pseudo_fs
from .schemas import BINARY_CONTENT, MAX_OFFSET, NDJSON_CONTENT, StrictIn, errors

router = Router(tags=["sandboxes"])

Port = Annotated[int, Field(ge=1, le=65535)]
# The statuses a sandbox can have, as `?status=` takes them.
# (mypy cannot build a Literal from a tuple, and reads it as a str.)
if TYPE_CHECKING:
    SandboxStatus = str
else:
    SandboxStatus = Literal[tuple(Sandbox.Status.values)]


class VolumeMountIn(StrictIn):
    volume: str = Field(min_length=1, max_length=64, description="the volume's id or name")
    mount_path: str = Field(max_length=512, description="where it appears in the sandbox, e.g. /workspace")
    read_only: bool = False


class VolumeMountOut(Schema):
    volume: str
    name: str
    mount_path: str
    read_only: bool


class PortIn(StrictIn):
    port: Port
    public: bool = Field(False, description="reachable without a token")


class PreviewOut(Schema):
    port: int
    public: bool
    url: str = Field(description="private ones carry a signed token, valid HANGAR_PREVIEW_TOKEN_TTL_S")


class NetworkIn(StrictIn):
    egress: Literal["none", "allowlist", "all"] = "none"
    allow: list[str] = Field(
        [], max_length=200, description='for allowlist: "host", "host:port", "1.2.3.4", "10.0.0.0/24"'
    )
    hangar: bool = Field(False, description="may reach Hangar's API at hangar.internal (harnesses do)")

    def policy(self) -> dict[str, Any]:
        out: dict[str, Any] = {"egress": self.egress, "allow": self.allow}
        if self.hangar:
            out["hangar"] = True
        return out


class SandboxIn(StrictIn):
    image: str = Field(
        min_length=1, max_length=300, examples=["busybox"], description="an image of GET /images"
    )
    runtime: str = Field(
        settings.HANGAR_DEFAULT_RUNTIME, min_length=1, max_length=32,
        description="a launcher this install has (422 lists them); default HANGAR_DEFAULT_RUNTIME",
    )  # fmt: skip
    cpu: float = Field(1.0, ge=0.1, le=settings.HANGAR_SANDBOX_MAX_CPU)
    memory_mb: int = Field(
        512, ge=settings.HANGAR_SANDBOX_MIN_MEMORY_MB, le=settings.HANGAR_SANDBOX_MAX_MEMORY_MB
    )
    disk_mb: int | None = Field(
        None,
        ge=settings.HANGAR_SANDBOX_MIN_DISK_MB,
        le=settings.HANGAR_SANDBOX_MAX_DISK_MB,
        description="size of its own disk, which holds every file it writes outside volumes (a write past "
        "it fails inside with ENOSPC); default HANGAR_SANDBOX_DISK_MB (10240)",
    )
    timeout_s: int = Field(300, ge=1, le=settings.HANGAR_SANDBOX_MAX_TIMEOUT_S)
    env: dict[str, str] = {}
    secrets: list[str] = Field(
        [], max_length=100, description="team secrets to set as environment variables, by name"
    )
    metadata: dict[str, Any] = Field(
        {},
        description=f"yours, kept with it: at most HANGAR_METADATA_MAX_BYTES ({settings.HANGAR_METADATA_MAX_BYTES}) of JSON",
    )
    ports: list[Port | PortIn] = Field(
        [], max_length=20, description="ports of servers inside to give preview URLs: 8000 or {port, public}"
    )
    auto_resume: bool = Field(False, description="a request to a preview URL resumes it when paused")
    network: NetworkIn | None = Field(None, description="egress policy; default none (no network at all)")
    volumes: list[VolumeMountIn] = Field([], max_length=16)
    node_selector: dict[str, str] = Field(
        {},
        examples=[{"zone": "a"}],
        description="labels its node must carry, every one of them (at most 16; names and values up to 63 "
        "letters, digits or -_./); a create no node matches is refused with the reason per node",
    )
    ephemeral: bool = Field(False, description="keep nothing outside volumes when paused")
    on_expire: Literal["pause", "destroy"] = Field(
        "destroy", description="what happens when timeout_s runs out"
    )
    idle_timeout_s: int | None = Field(
        None,
        ge=10,
        le=settings.HANGAR_SANDBOX_MAX_TIMEOUT_S,
        description="pause it after this long without activity",
    )
    pause_mode: Literal["stop", "checkpoint"] = Field(
        "stop", description="how a pause keeps it when the pause call does not say (see /pause)"
    )
    wait: bool = True


class SandboxOut(Schema):
    id: str
    status: str
    status_reason: str
    image: str
    image_digest: str
    runtime: str
    node: str | None
    node_selector: dict[str, str] = Field(description="labels its node must carry ({}: any node)")
    cpu: float
    memory_mb: int
    disk_mb: int = Field(description="size of its own disk (0: none, the node's filesystem with no limit)")
    timeout_s: int
    created_at: datetime
    started_at: datetime | None
    stopped_at: datetime | None
    expires_at: datetime | None
    metadata: dict[str, Any]
    secrets: list[str] = Field(description="names of the team secrets it was given (values never come back)")
    previews: list[PreviewOut] = Field(description="preview URLs of its exposed ports")
    open_ports: Literal["", "public", "private"] = Field(
        description="every port of it has a preview URL besides `previews` (sandboxes created through "
        "the E2B API): public, or private (its traffic access token, or the ways into any private preview); "
        "empty: only `previews`"
    )
    network: dict[str, Any] = Field(description="its egress policy ({} when it has no network)")
    auto_resume: bool
    volumes: list[VolumeMountOut]
    ephemeral: bool
    on_expire: str
    idle_timeout_s: int | None
    pause_mode: str
    paused_mode: str = Field(description="while paused: stop or checkpoint, how it was paused")
    last_activity_at: datetime | None
    pool: str | None = Field(None, description="the warm pool it was claimed from")

    @staticmethod
    def resolve_previews(obj: Sandbox) -> list[PreviewOut]:
        return [PreviewOut(port=p.port, public=p.public, url=p.url) for p in previews_of(obj)]

    @staticmethod
    def resolve_pool(obj: Sandbox) -> str | None:
        return obj.pool_id

    @staticmethod
    def resolve_node(obj: Sandbox) -> str | None:
        return obj.node.name if obj.node else None

    @staticmethod
    def resolve_volumes(obj: Sandbox) -> list[VolumeMountOut]:
        return [
            VolumeMountOut(
                volume=m.volume_id, name=m.volume.name, mount_path=m.mount_path, read_only=m.read_only
            )
            for m in obj.volume_mounts.all()
        ]


class ExecIn(StrictIn):
    cmd: str | Annotated[list[str], Field(min_length=1)] = Field(
        examples=["echo hello"],
        description="argv, cwd and env together are at most the agent's 1 MiB (its frame)",
    )
    cwd: str | None = None
    env: dict[str, str] = {}
    stdin: str | None = None
    timeout_s: float | None = Field(
        None,
        gt=0,
        le=settings.HANGAR_EXEC_MAX_TIMEOUT_S,
        description="kill the command after this long (default 60 s; background: no limit)",
    )
    stream: bool = Field(False, description="answer with the output as NDJSON events while it runs")
    background: bool = Field(False, description="return the process id at once; see /processes")
    stdin_open: bool = Field(False, description="background: keep stdin open for .../processes/{id}/stdin")
    encoding: Literal["utf-8", "base64"] = "utf-8"


class BackgroundOut(Schema):
    id: int
    pid: int | None
    status: str
    output: str


class ExecOut(Schema):
    id: int
    exit_code: int
    stdout: str
    stderr: str
    duration_ms: float
    timed_out: bool
    truncated: bool


class FileEntryOut(Schema):
    name: str
    path: str
    type: str
    size: int
    mode: int
    mtime: float


class EventOut(Schema):
    id: int
    kind: str
    status_from: str
    status_to: str
    message: str
    data: dict[str, Any]
    created_at: datetime


class ListFilter(Schema):
    status: SandboxStatus | None = None
    limit: int = Field(100, ge=1, le=1000)
    offset: int = Field(0, ge=0, le=MAX_OFFSET)


class PathQuery(Schema):
    path: str = Field(examples=["/tmp/hello.txt"], description="absolute, inside the sandbox")


def _team(request: AuthedRequest):
    return request.auth.team


# What a SandboxOut shows, loaded in the worker thread (never lazily in the event loop).
_full = Sandbox.objects.select_related("node").prefetch_related("volume_mounts__volume")


def _get(request: AuthedRequest, sandbox_id: str) -> Sandbox:
    return svc.sandbox_get(team=_team(request), sandbox_id=sandbox_id, caller=request.auth)


async def _answer(sandbox_id: str, statuses: tuple[str, ...], *, wait: bool) -> Sandbox:
    """The sandbox as the answer shows it; with ``wait``, once its status is one of ``statuses``
    (or ``HANGAR_CREATE_WAIT_S`` has passed), waiting on the event loop, not on a thread."""

    def read() -> Sandbox:
        return _full.get(id=sandbox_id)

    def status() -> str:  # what the wait re-reads on each wake: the status alone, not the whole row
        return Sandbox.objects.filter(id=sandbox_id).values_list("status", flat=True).first() or ""

    if wait:
        await wait_for(sandbox_channel(sandbox_id), status, lambda now: now in statuses or not now,
                       settings.HANGAR_CREATE_WAIT_S)  # fmt: skip
    return await blocking(read)()


@router.post("", response={201: SandboxOut, **errors(404, 409, 429, 502, 503)})
async def create_sandbox(request: AuthedRequest, payload: SandboxIn):
    """Start a sandbox from an image. With `wait` (default) it answers once the sandbox is running
    or has failed (the reason is in `status_reason`)."""

    def create() -> tuple[Sandbox, bool]:
        if set(payload.metadata) & {"harness", "harness_name", "repo_auth"}:
            raise InvalidValue(
                "metadata keys harness, harness_name and repo_auth are Hangar's own; use other names"
            )
        volumes = [volume_svc.VolumeMount(v.volume, v.mount_path, v.read_only) for v in payload.volumes]
        harness_token_create_check(token=request.auth, secrets=payload.secrets, volumes=volumes)
        spec = svc.SandboxRequest(
            image=payload.image, runtime=payload.runtime, cpu=payload.cpu, memory_mb=payload.memory_mb,
            timeout_s=payload.timeout_s, env=payload.env, metadata=payload.metadata, volumes=volumes,
            ephemeral=payload.ephemeral, on_expire=payload.on_expire, idle_timeout_s=payload.idle_timeout_s,
            pause_mode=payload.pause_mode, secrets=payload.secrets, auto_resume=payload.auto_resume,
            ports=[p if isinstance(p, int) else p.dict() for p in payload.ports],
            network=payload.network.policy() if payload.network else None, disk_mb=payload.disk_mb,
            node_selector=payload.node_selector,
        )  # fmt: skip
        sandbox = svc.sandbox_create(
            team=_team(request), user=request.auth.user,
            request=spec, created_by_token=request.auth,
        )  # fmt: skip
        if payload.wait and sandbox.status not in svc.SETTLED:  # a claimed pool member already runs
            return sandbox, True
        return _full.get(id=sandbox.id), False

    sandbox, starting = await blocking(create)()
    if starting:
        sandbox = await _answer(sandbox.id, svc.SETTLED, wait=True)
    return 201, sandbox


@router.get("", response=list[SandboxOut])
async def list_sandboxes(request: AuthedRequest, filters: Query[ListFilter]):
    """The caller's team's sandboxes, newest first (deleted ones only with `?status=deleted`);
    `limit` (default 100, at most 1000) and `offset` page through them."""

    def page() -> list[Sandbox]:
        qs = svc.sandboxes_for_team(team=_team(request), status=filters.status, caller=request.auth)
        return list(qs[filters.offset : filters.offset + filters.limit])

    return await blocking(page)()


@router.get("/{sandbox_id}", response=SandboxOut)
async def get_sandbox(request: AuthedRequest, sandbox_id: str):
    return await blocking(lambda: _full.get(id=_get(request, sandbox_id).id))()


@router.delete("/{sandbox_id}", response={204: None})
async def delete_sandbox(request: AuthedRequest, sandbox_id: str):
    """Stop and destroy the sandbox. Its row stays, with status `deleted`."""

    def delete() -> None:
        svc.sandbox_delete(sandbox=_get(request, sandbox_id), reason="deleted through the API")

    await blocking(delete)()
    return 204, None


@router.post(
    "/{sandbox_id}/exec",
    response={200: ExecOut, 202: BackgroundOut, **errors(409, 502)},
    openapi_extra={"responses": {200: {"content": {"application/x-ndjson": NDJSON_CONTENT}}}},
)
async def exec_command(request: AuthedRequest, sandbox_id: str, payload: ExecIn):
    """Run a command. A string runs under `/bin/sh -c`; a list is the argv. By default it runs
    to completion and answers with its output; `stream` answers at once with NDJSON events
    (`start`, `stdout`/`stderr`, `exit`) as it runs, and hanging up kills it; `background`
    answers 202 with a process id at once and it runs on (see `/processes/{id}`)."""
    if payload.stream and payload.background:
        raise InvalidValue("choose one of stream and background")
    if payload.stream or payload.background:
        return await _exec_live(request, sandbox_id, payload)
    timeout_s = payload.timeout_s if payload.timeout_s is not None else 60
    slot = exec_limits.blocking_exec_slot(team=_team(request))

    def run() -> io_svc.ExecOutcome:
        return io_svc.sandbox_exec(
            sandbox=_get(request, sandbox_id), cmd=payload.cmd, cwd=payload.cwd, env=payload.env,
            stdin=payload.stdin.encode() if payload.stdin is not None else None,
            timeout_s=timeout_s, user=request.auth.user,
        )  # fmt: skip

    try:
        outcome = await blocking(run)()
    except BaseException:
        slot.release()
        raise
    response = StreamingHttpResponse(_exec_answer(outcome, slot), content_type="application/json")
    # The answer's end gives the slot back; an answer never started (its client gone between
    # the view and the first byte) gives it back when it is dropped.
    weakref.finalize(response, slot.release)
    return response


# The output is written into the answer this much at a time.
ANSWER_PIECE = 64 * 1024


async def _exec_answer(outcome: io_svc.ExecOutcome, slot: exec_limits.ExecSlot) -> AsyncIterator[bytes]:
    """An :class:`ExecOut` as JSON, written from the output as the client reads it: the output
    (up to HANGAR_EXEC_MAX_OUTPUT_BYTES of each stream) is held once, in the buffer it was read
    into, never as text, its JSON and that JSON's bytes besides (up to 6 bytes a byte for
    control characters). The team's exec slot is given back when the answer ends."""
    try:
        r = outcome.result
        yield f'{{"id": {json.dumps(outcome.exec.id)}, "exit_code": {json.dumps(r.exit_code)}, "stdout": "'.encode()
        for piece in _json_string_pieces(r.stdout):
            yield piece
        yield b'", "stderr": "'
        for piece in _json_string_pieces(r.stderr):
            yield piece
        tail = {"duration_ms": round(r.duration_ms, 3), "timed_out": r.timed_out, "truncated": r.truncated}
        yield b'", ' + json.dumps(tail)[1:].encode()
    finally:
        slot.release()
        size = len(outcome.result.stdout) + len(outcome.result.stderr)
        del outcome
        if size >= GIVE_BACK_AFTER:
            give_memory_back()


def _json_string_pieces(data: bytes | bytearray) -> Iterator[bytes]:
    """The inside of a JSON string holding ``data`` decoded as UTF-8 (invalid bytes as U+FFFD),
    a piece at a time: the same text as encoding it whole."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    view = memoryview(data)
    for start in range(0, len(view), ANSWER_PIECE):
        end = start + ANSWER_PIECE
        text = decoder.decode(view[start:end], final=end >= len(view))
        if text:
            yield json.dumps(text)[1:-1].encode()


async def _exec_live(request: AuthedRequest, sandbox_id: str, payload: ExecIn):
    from runtime.services import processes as proc_svc

    from ..streaming import ndjson_response
    from .processes import ndjson_events

    sandbox = await blocking(lambda: _full.get(pk=_get(request, sandbox_id).pk))()
    timeout_s = payload.timeout_s if payload.timeout_s is not None else (None if payload.background else 60)
    row = await proc_svc.process_start(
        sandbox=sandbox, cmd=payload.cmd, kind=Exec.Kind.BACKGROUND if payload.background else Exec.Kind.STREAM,
        cwd=payload.cwd, env=payload.env, stdin=payload.stdin.encode() if payload.stdin is not None else None,
        stdin_open=payload.stdin_open, timeout_s=timeout_s, user=request.auth.user,
    )  # fmt: skip
    if payload.background:
        output = f"/api/v1/sandboxes/{sandbox.id}/processes/{row.id}/output"
        return 202, BackgroundOut(id=row.id, pid=row.pid, status=row.status, output=output)
    follow = proc_svc.ProcessHandle.of_exec(sandbox, row.id).follow()
    head = {"type": "start", "id": row.id, "pid": row.pid}
    return await ndjson_response(
        while_authorised(
            ndjson_events(follow, encoding=payload.encoding, head=head, kill_on_close=True), request.auth
        )
    )


class KeepaliveIn(StrictIn):
    timeout_s: int = Field(
        ge=1,
        le=settings.HANGAR_SANDBOX_MAX_TIMEOUT_S,
        description="seconds from now until the sandbox expires",
    )


@router.post("/{sandbox_id}/keepalive", response={200: SandboxOut, **errors(409, 429)})
async def keepalive(request: AuthedRequest, sandbox_id: str, payload: KeepaliveIn):
    """Push the sandbox's expiry to `timeout_s` seconds from now (within the site's maximum)."""

    def extend() -> Sandbox:
        sandbox = svc.sandbox_keepalive(sandbox=_get(request, sandbox_id), timeout_s=payload.timeout_s)
        return _full.get(id=sandbox.id)

    return await blocking(extend)()


class PauseIn(StrictIn):
    mode: Literal["stop", "checkpoint"] | None = Field(
        None,
        description="stop: processes end, files stay; checkpoint: processes and memory are saved "
        "and continue on resume. Default: the sandbox's pause_mode",
    )
    wait: bool = Field(True, description="answer once it is paused")


class ResumeIn(StrictIn):
    wait: bool = Field(True, description="answer once it runs again")


@router.post("/{sandbox_id}/pause", response={200: SandboxOut, **errors(409)})
async def pause_sandbox(request: AuthedRequest, sandbox_id: str, payload: PauseIn):
    """Pause a running sandbox; its CPU and memory are freed either way. `mode=stop`: its
    processes and terminals end; its files stay, on volumes and (unless it is `ephemeral`)
    outside them. `mode=checkpoint`: the whole sandbox is saved (gVisor checkpoint), and on
    resume its processes continue from where they were, with their memory; background
    processes and terminals opened through Hangar stream on. A paused sandbox does not
    expire; resume it, or delete it."""

    def pause() -> None:
        svc.sandbox_pause(sandbox=_get(request, sandbox_id), mode=payload.mode)

    await blocking(pause)()
    done = (Sandbox.Status.PAUSED, Sandbox.Status.FAILED, Sandbox.Status.DELETED)
    return await _answer(sandbox_id, done, wait=payload.wait)


@router.post("/{sandbox_id}/resume", response={200: SandboxOut, **errors(400, 409, 429, 503)})
async def resume_sandbox(request: AuthedRequest, sandbox_id: str, payload: ResumeIn):
    """Start a paused sandbox again: over the files it had (stop mode), or restored with its
    processes (checkpoint mode). Its TTL starts afresh."""

    def resume() -> None:
        svc.sandbox_resume(sandbox=_get(request, sandbox_id))

    await blocking(resume)()
    return await _answer(sandbox_id, svc.SETTLED, wait=payload.wait)


@router.put("/{sandbox_id}/network", response={200: SandboxOut, **errors(409, 502)})
async def set_network(request: AuthedRequest, sandbox_id: str, payload: NetworkIn):
    """Change the egress policy: applied at once (atomically, below the sandbox) if it runs
    with a network, else from its next start."""

    def put() -> Sandbox:
        sandbox = _get(request, sandbox_id)
        if harness_of_token(request.auth, sandbox):
            raise Forbidden(
                "a harness's own token cannot change its harness's network (ask a member of the team)"
            )
        svc.sandbox_set_network(sandbox=sandbox, network=payload.policy())
        return _full.get(id=sandbox_id)

    return await blocking(put)()


@router.get("/{sandbox_id}/ports", response=list[PreviewOut])
async def list_ports(request: AuthedRequest, sandbox_id: str):
    """The sandbox's preview URLs (private ones with a fresh signed token)."""
    return await blocking(lambda: [p.__dict__ for p in previews_of(_get(request, sandbox_id))])()


@router.post("/{sandbox_id}/ports", response={201: PreviewOut, **errors(409)})
async def expose_port(request: AuthedRequest, sandbox_id: str, payload: PortIn):
    """Give a port a preview URL, `https://{port}-{id}.{domain}` (or make it public or
    private again): HTTP, streaming and websockets reach the server listening on it."""
    return 201, await blocking(
        lambda: (
            port_expose(sandbox=_get(request, sandbox_id), port=payload.port, public=payload.public).__dict__
        )
    )()


@router.delete("/{sandbox_id}/ports/{port}", response={204: None})
async def unexpose_port(request: AuthedRequest, sandbox_id: str, port: int):
    await blocking(lambda: port_unexpose(sandbox=_get(request, sandbox_id), port=port))()
    return 204, None


@router.post("/{sandbox_id}/stop", response={200: SandboxOut, **errors(409)})
async def stop_sandbox(request: AuthedRequest, sandbox_id: str):
    """Stop every process of the sandbox and release its CPU and memory; the row stays, as
    `stopped`, with its events and command history (delete it to remove it)."""

    def stop() -> Sandbox:
        svc.sandbox_stop(sandbox=_get(request, sandbox_id), reason="stopped through the API")
        return _full.get(id=sandbox_id)

    return await blocking(stop)()


class WrittenOut(Schema):
    path: str
    size: int


@router.put(
    "/{sandbox_id}/files",
    response={200: WrittenOut, **errors(409, 413, 502)},
    openapi_extra={
        # No body is an empty file (as `: > path` makes one), so the body is not required.
        "requestBody": {"required": False, "content": {"application/octet-stream": BINARY_CONTENT}}
    },
)
async def put_file(request: AuthedRequest, sandbox_id: str, q: Query[PathQuery]):
    """Write the raw request body to `path` inside the sandbox (parents are created; an existing
    file is replaced atomically; no body writes an empty file). The body goes to the sandbox as it is read, never held whole."""

    def write() -> WrittenOut:
        size = io_svc.sandbox_file_write(
            sandbox=_get(request, sandbox_id), path=q.path, data=_body(request), size=_content_length(request)
        )
        return WrittenOut(path=q.path, size=size)

    return await blocking(write)()


def _body(request: HttpRequest) -> Iterator[bytes]:
    """The request's body a piece at a time, from where the server keeps it (a temporary file
    past FILE_UPLOAD_MAX_MEMORY_SIZE): ``request.body`` would read it into memory whole."""
    while chunk := request.read(256 * 1024):
        yield chunk


def _content_length(request: HttpRequest) -> int | None:
    try:
        return int(request.META.get("CONTENT_LENGTH") or "")
    except ValueError:
        return None


def _no_pseudo_fs(request: AuthedRequest) -> bool:
    return not sees_pseudo_fs(request.auth.effective_role)


@router.get(
    "/{sandbox_id}/files",
    response={200: None, **errors(409, 502)},
    openapi_extra={
        "responses": {
            200: {"description": "the file's bytes", "content": {"application/octet-stream": BINARY_CONTENT}}
        }
    },
)
async def get_file(request: AuthedRequest, sandbox_id: str, q: Query[PathQuery]):
    """The raw bytes of the file at `path` inside the sandbox, streamed: with its exact
    `Content-Length` when it ends within the first 512 KiB, else with the size it had when
    opened (a file that grew is cut there), or chunked when that is less than it sent (/proc).
    A failure once the bytes flow cuts the connection (the body is incomplete). Viewers cannot
    read /proc or /sys (403)."""
    entry, chunks = await blocking(
        lambda: io_svc.sandbox_file_read(
            sandbox=_get(request, sandbox_id), path=q.path, no_pseudo_fs=_no_pseudo_fs(request)
        )
    )()
    return await download_response(
        chunks, size=entry.size, disposition=f"attachment; filename*=UTF-8''{quote(entry.name or 'file')}",
        what=f"{q.path} from sandbox {sandbox_id}",
    )  # fmt: skip


@router.get("/{sandbox_id}/files/list", response={200: list[FileEntryOut], **errors(409, 502)})
async def list_files(request: AuthedRequest, sandbox_id: str, q: Query[PathQuery]):
    """Entries of the directory at `path` inside the sandbox; symlinks are listed, not followed.
    Viewers cannot list /proc or /sys (403)."""
    entries = await blocking(
        lambda: io_svc.sandbox_file_list(
            sandbox=_get(request, sandbox_id), path=q.path, no_pseudo_fs=_no_pseudo_fs(request)
        )
    )()
    return [FileEntryOut(**e.__dict__) for e in entries]


class StatsOut(Schema):
    cpu_seconds: float
    memory_bytes: int
    memory_limit_bytes: int
    pids: int
    disk_bytes: int = Field(description="used on its own disk")
    disk_limit_bytes: int = Field(
        description="what its own disk holds (its size less the filesystem's own); 0: no limit"
    )


@router.get("/{sandbox_id}/stats", response={200: StatsOut, **errors(409, 502)})
async def get_stats(request: AuthedRequest, sandbox_id: str):
    """CPU time used so far, memory and disk in use now (409 unless running)."""
    return await blocking(lambda: io_svc.sandbox_stats(sandbox=_get(request, sandbox_id)))()


class EventQuery(Schema):
    after: int = Field(
        0, ge=0, le=2**63 - 1, description="only events after this id (to follow: poll with the last id seen)"
    )
    limit: int = Field(1000, ge=1, le=1000)


@router.get("/{sandbox_id}/events", response=list[EventOut])
async def list_events(request: AuthedRequest, sandbox_id: str, q: Query[EventQuery]):
    """What happened to the sandbox, oldest first (the first `limit` after `after`)."""

    def events() -> list[SandboxEvent]:
        rows = _get(request, sandbox_id).events.all()
        if q.after:
            rows = rows.filter(id__gt=q.after)
        return list(rows.order_by("id")[: q.limit])

    return await blocking(events)()
