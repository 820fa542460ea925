"""The E2B API's sandbox endpoints, each a translation onto Hangar's sandbox services: create,
list, get info, kill, set timeout, pause, connect (which resumes), metrics."""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from typing import Literal
from urllib.parse import parse_qsl, unquote

from django.conf import settings
from django.db.models import Q, QuerySet
from django.db.models.fields.json import KeyTextTransform
from django.http import HttpResponse, JsonResponse
from django.utils import timezone
from ninja import Query, Router, Schema
from pydantic import Field

from dashboard.live import wait_for
from runtime.errors import BadRequest, Conflict, InvalidValue, NotFound
from runtime.models import Sandbox
from runtime.notify import sandbox_channel
from runtime.services import sandbox_io as io_svc
from runtime.services import sandboxes as svc
from runtime.services import volumes as volume_svc
from runtime.services.harnesses import harness_token_create_check
from runtime.services.images import image_resolve

from ..api.auth import AuthedRequest
from ..api.blocking import blocking
from ..api.schemas import ObjectIn
from .schemas import (
    LIVE,
    STATES,
    ConnectIn,
    NewSandboxIn,
    PauseIn,
    TimeoutIn,
    created_out,
    detail_out,
    egress_policy,
    error,
    listed_out,
    metric_out,
    open_ports,
    refusals,
)

router = Router(tags=["sandboxes"])
S = Sandbox.Status
SB = "/sandboxes/{sandbox_id}"
# What the answers show, loaded in the worker thread (never lazily on the event loop).
_full = Sandbox.objects.select_related("node").prefetch_related("volume_mounts__volume")
# Keys Hangar's own API keeps for harnesses (dashboard/api/sandboxes.py refuses them too).
_RESERVED_METADATA = {"harness", "harness_name", "repo_auth"}


def _get(request: AuthedRequest, sandbox_id: str) -> Sandbox:
    """The team's sandbox, while E2B would know it (running or paused); another team's, or one
    that has ended, is not found."""
    sandbox = svc.sandbox_get(team=request.auth.team, sandbox_id=sandbox_id, caller=request.auth)
    if sandbox.status not in LIVE:
        raise NotFound(f"sandbox {sandbox_id!r} is {sandbox.status}")
    return sandbox


async def _settled(sandbox_id: str, statuses: tuple[str, ...]) -> Sandbox:
    """The sandbox once its status is one of ``statuses`` (or HANGAR_CREATE_WAIT_S has
    passed), waited for on the event loop."""
    return await wait_for(sandbox_channel(sandbox_id), lambda: _full.get(id=sandbox_id),
                          lambda row: row.status in statuses, settings.HANGAR_CREATE_WAIT_S)  # fmt: skip


def _not_running(sandbox: Sandbox) -> JsonResponse:
    why = f": {sandbox.status_reason}" if sandbox.status_reason else ""
    # Not the caller's doing, nor Hangar failing: the runtime could not start (or pause) it.
    return error(502, f"sandbox {sandbox.id} is {sandbox.status}{why}")


# The templates e2b-code-interpreter's Sandbox asks for (its Jupyter kernel): unless an image has
# that name, a create from one is refused as the unsupported feature it is, not as a typo.
CODE_INTERPRETER_TEMPLATES = frozenset({"code-interpreter-v1", "code-interpreter-beta", "code-interpreter"})


@router.post("/v2/sandboxes", operation_id="e2b_create_sandbox_v2", url_name="e2b-create-v2")
@router.post("/sandboxes", operation_id="e2b_create_sandbox", url_name="e2b-create")
async def create_sandbox(request: AuthedRequest, payload: NewSandboxIn) -> HttpResponse:
    """Start a sandbox from a template, which is a Hangar image (E2B's default, `base`, is the
    image named base), and answer once it runs."""

    def create() -> Sandbox:
        refusals(payload)
        try:
            image_resolve(payload.template_id)
        except BadRequest as exc:
            if payload.template_id in CODE_INTERPRETER_TEMPLATES:
                raise BadRequest(
                    f"Hangar's E2B API does not support e2b-code-interpreter's Jupyter kernel (template "
                    f"{payload.template_id!r}): run code with sandbox.commands.run (python3 -c …) in an image that "
                    "has the language, or build one named like this template with a Jupyter server of your own"
                ) from None
            raise NotFound(f"template {payload.template_id!r} not found (a template is a Hangar image): "
                           f"{exc.message}") from None  # fmt: skip
        metadata = payload.metadata or {}
        if reserved := sorted(set(metadata) & _RESERVED_METADATA):
            raise InvalidValue(f"metadata keys {', '.join(reserved)} are Hangar's own; use other names")
        volumes = [volume_svc.VolumeMount(v.name, v.path) for v in payload.volume_mounts or []]
        harness_token_create_check(token=request.auth, secrets=[], volumes=volumes)
        keep_memory = payload.auto_pause_memory is not False
        spec = svc.SandboxRequest(
            image=payload.template_id, timeout_s=payload.timeout if payload.timeout is not None else 300,
            env=payload.env_vars or {}, metadata=dict(metadata), volumes=volumes,
            on_expire=svc.ON_EXPIRE_PAUSE if payload.auto_pause else svc.ON_EXPIRE_DESTROY,
            pause_mode=svc.PAUSE_MODE_CHECKPOINT if payload.auto_pause and keep_memory else svc.PAUSE_MODE_STOP,
            auto_resume=bool(payload.auto_resume and payload.auto_resume.enabled),
            network=egress_policy(payload), open_ports=open_ports(payload),
        )  # fmt: skip
        return svc.sandbox_create(team=request.auth.team, user=request.auth.user, request=spec,
                                  created_by_token=request.auth)  # fmt: skip

    sandbox = await blocking(create)()
    sandbox = await _settled(sandbox.id, svc.SETTLED)
    if sandbox.status not in STATES["running"]:
        return _not_running(sandbox)
    return JsonResponse(created_out(sandbox, request.auth), status=201)


class ListQuery(Schema):
    metadata: str | None = Field(None, description='"key=value&key2=value2", each key and value URL-encoded')
    state: list[str] = Field([], description="running, paused (comma-separated); default both")
    order: Literal["asc", "desc"] = "desc"
    started_after: datetime | None = Field(None, alias="startedAfter")
    template: str | None = None
    next_token: str | None = Field(None, alias="nextToken")
    limit: int = Field(100, ge=1, le=100)


def _states(values: list[str]) -> tuple[str, ...]:
    asked = [s for value in values for s in value.split(",") if s]
    if unknown := sorted(set(asked) - set(STATES)):
        raise BadRequest(f"unknown state {', '.join(unknown)}; one of: {', '.join(STATES)}")
    return tuple(status for name in asked or STATES for status in STATES[name])


def _with_metadata(qs: QuerySet[Sandbox], query: str) -> QuerySet[Sandbox]:
    # The SDK URL-encodes each key and value, then the pairs as a query string.
    for i, (key, value) in enumerate(parse_qsl(query, keep_blank_values=True)):
        name = f"e2b_meta_{i}"
        qs = qs.alias(**{name: KeyTextTransform(unquote(key), "metadata")}).filter(**{name: unquote(value)})
    return qs


def _token(sandbox: Sandbox) -> str:
    raw = json.dumps([sandbox.created_at.isoformat(), sandbox.id])
    return base64.urlsafe_b64encode(raw.encode()).decode()


def _after(token: str) -> tuple[datetime, str]:
    try:
        created, sandbox_id = json.loads(base64.urlsafe_b64decode(token.encode()))
        return datetime.fromisoformat(created), str(sandbox_id)
    except (ValueError, TypeError, binascii.Error):
        raise BadRequest("nextToken is not one this API gave") from None


def _page(
    request: AuthedRequest, q: ListQuery, statuses: tuple[str, ...]
) -> tuple[list[Sandbox], str | None]:
    """One page of the team's sandboxes in ``statuses``, by creation time, and the token of the
    next (None on the last)."""
    qs = svc.sandboxes_for_team(team=request.auth.team, caller=request.auth).filter(status__in=statuses)
    qs = qs.prefetch_related("volume_mounts__volume")
    if q.metadata:
        qs = _with_metadata(qs, q.metadata)
    if q.template:
        qs = qs.filter(image=q.template)
    if q.started_after:
        qs = qs.filter(created_at__gte=q.started_after)
    desc = q.order == "desc"
    if q.next_token:
        at, last = _after(q.next_token)
        if desc:
            qs = qs.filter(Q(created_at__lt=at) | Q(created_at=at, id__lt=last))
        else:
            qs = qs.filter(Q(created_at__gt=at) | Q(created_at=at, id__gt=last))
    rows = list(qs.order_by(*(("-created_at", "-id") if desc else ("created_at", "id")))[: q.limit + 1])
    more = len(rows) > q.limit
    rows = rows[: q.limit]
    return rows, _token(rows[-1]) if more else None


@router.get("/v2/sandboxes", operation_id="e2b_list_sandboxes_v2", url_name="e2b-list-v2")
async def list_sandboxes(request: AuthedRequest, q: Query[ListQuery]) -> HttpResponse:
    """The team's running and paused sandboxes, newest first, a page at a time (`X-Next-Token`)."""
    rows, next_token = await blocking(lambda: _page(request, q, _states(q.state)))()
    response = JsonResponse([listed_out(sb) for sb in rows], safe=False)
    if next_token:
        response["X-Next-Token"] = next_token
    return response


class OldListQuery(Schema):
    metadata: str | None = None


@router.get("/sandboxes", operation_id="e2b_list_sandboxes", url_name="e2b-list")
async def list_running_sandboxes(request: AuthedRequest, q: Query[OldListQuery]) -> HttpResponse:
    """The team's running sandboxes (E2B's older list, which SDKs before /v2 call), up to 100."""
    query = ListQuery.model_validate({"metadata": q.metadata})
    rows, _ = await blocking(lambda: _page(request, query, STATES["running"]))()
    return JsonResponse([listed_out(sb) for sb in rows], safe=False)


@router.get(SB, operation_id="e2b_get_sandbox", url_name="e2b-get")
async def get_sandbox(request: AuthedRequest, sandbox_id: str) -> HttpResponse:
    sandbox = await blocking(lambda: _full.get(id=_get(request, sandbox_id).id))()
    return JsonResponse(detail_out(sandbox, request.auth))


@router.delete(SB, operation_id="e2b_kill_sandbox", url_name="e2b-kill")
async def kill_sandbox(request: AuthedRequest, sandbox_id: str) -> HttpResponse:
    """Destroy the sandbox (its row stays in Hangar, as deleted); one already gone is not found."""

    def kill() -> None:
        sandbox = svc.sandbox_get(team=request.auth.team, sandbox_id=sandbox_id, caller=request.auth)
        if sandbox.status in (S.DELETED, S.STOPPING):
            raise NotFound(f"sandbox {sandbox_id!r} is {sandbox.status}")
        svc.sandbox_delete(sandbox=sandbox, reason="killed through the E2B API")

    await blocking(kill)()
    return HttpResponse(status=204)


@router.post(f"{SB}/timeout", operation_id="e2b_set_timeout", url_name="e2b-timeout")
async def set_timeout(request: AuthedRequest, sandbox_id: str, payload: TimeoutIn) -> HttpResponse:
    """The sandbox expires `timeout` seconds from now (within the site's maximum)."""
    await blocking(
        lambda: svc.sandbox_keepalive(sandbox=_get(request, sandbox_id), timeout_s=payload.timeout)
    )()
    return HttpResponse(status=204)


@router.post(f"{SB}/pause", operation_id="e2b_pause_sandbox", url_name="e2b-pause")
async def pause_sandbox(
    request: AuthedRequest, sandbox_id: str, payload: PauseIn | None = None
) -> HttpResponse:
    """Pause, and answer once paused. `memory` true (E2B's full snapshot) is Hangar's checkpoint,
    false (filesystem only) Hangar's stop; unset, a checkpoint where the runtime can take one."""

    def pause() -> None:
        sandbox = _get(request, sandbox_id)
        if sandbox.status in STATES["paused"]:
            raise Conflict(f"sandbox {sandbox_id} is already {sandbox.status}", status=sandbox.status)
        memory = payload.memory if payload else None
        if memory is None:
            node = sandbox.node
            memory = bool(node and node.can(sandbox.runtime, "checkpoint")) and not sandbox.ephemeral
        mode = svc.PAUSE_MODE_CHECKPOINT if memory else svc.PAUSE_MODE_STOP
        svc.sandbox_pause(sandbox=sandbox, mode=mode)

    await blocking(pause)()
    sandbox = await _settled(sandbox_id, (S.PAUSED, S.FAILED, S.DELETED))
    if sandbox.status != S.PAUSED:
        return _not_running(sandbox)
    return HttpResponse(status=204)


@router.post(f"/v2{SB}/connect", operation_id="e2b_connect_sandbox_v2", url_name="e2b-connect-v2")
@router.post(f"{SB}/connect", operation_id="e2b_connect_sandbox", url_name="e2b-connect")
async def connect_sandbox(request: AuthedRequest, sandbox_id: str, payload: ConnectIn) -> HttpResponse:
    """The sandbox, running: a paused one is resumed first (201), a running one answers at once
    (200). `timeout` only ever extends the running one's expiry; a resumed one's is `timeout`."""
    return await _connect(request, sandbox_id, payload.timeout, resumed_status=201)


class ResumeIn(ObjectIn):
    timeout: int | None = Field(None, ge=0)


@router.post(f"{SB}/resume", operation_id="e2b_resume_sandbox", url_name="e2b-resume")
async def resume_sandbox(request: AuthedRequest, sandbox_id: str, payload: ResumeIn) -> HttpResponse:
    """E2B's older resume (SDKs before connect): as connect, a running sandbox is a 409."""
    status = await blocking(lambda: _get(request, sandbox_id).status)()
    if status in STATES["running"]:
        raise Conflict(f"sandbox {sandbox_id} is already running", status=status)
    return await _connect(request, sandbox_id, payload.timeout, resumed_status=201)


async def _connect(
    request: AuthedRequest, sandbox_id: str, timeout: int | None, *, resumed_status: int
) -> HttpResponse:
    status = await blocking(lambda: _get(request, sandbox_id).status)()
    if status == S.PAUSING:  # resume it once its pause is done
        await _settled(sandbox_id, (S.PAUSED, S.FAILED, S.DELETED))

    def resume() -> bool:
        sandbox = _get(request, sandbox_id)
        if sandbox.status != S.PAUSED:
            return False
        svc.sandbox_resume(sandbox=sandbox)
        return True

    resumed = await blocking(resume)()
    sandbox = await _settled(sandbox_id, svc.SETTLED)
    if sandbox.status != S.RUNNING:
        return _not_running(sandbox)
    if timeout is not None:
        await blocking(lambda: _extend(sandbox, timeout, only_later=not resumed))()
    return JsonResponse(created_out(sandbox, request.auth), status=resumed_status if resumed else 200)


def _extend(sandbox: Sandbox, timeout: int, *, only_later: bool) -> None:
    until = timezone.now().timestamp() + timeout
    if only_later and sandbox.expires_at and sandbox.expires_at.timestamp() >= until:
        return
    svc.sandbox_keepalive(sandbox=sandbox, timeout_s=timeout)


@router.get(f"{SB}/metrics", operation_id="e2b_sandbox_metrics", url_name="e2b-metrics")
async def sandbox_metrics(request: AuthedRequest, sandbox_id: str) -> HttpResponse:
    """One sample, now, of a running sandbox's CPU, memory and disk (Hangar keeps no series, so
    `start` and `end` are not read); none for a paused one."""

    def sample() -> list[dict]:
        sandbox = _get(request, sandbox_id)
        if sandbox.status != S.RUNNING:
            return []
        stats = io_svc.sandbox_stats(sandbox=sandbox)
        now = timezone.now()
        cached = io_svc.sandboxes_stats_cached(ids=[sandbox.id]).get(sandbox.id, {})
        cpu_pct = cached.get("cpu_pct")
        if cpu_pct is None:  # no recent sample from the node: the average since it started
            ran = max((now - (sandbox.started_at or sandbox.created_at)).total_seconds(), 1.0)
            cpu_pct = 100.0 * stats["cpu_seconds"] / ran / max(sandbox.cpu, 0.01)
        return [metric_out(sandbox, stats, float(cpu_pct), now)]

    return JsonResponse(await blocking(sample)(), safe=False)
