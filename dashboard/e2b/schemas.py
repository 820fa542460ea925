"""The E2B API's shapes: request bodies as the SDK sends them (camelCase, as E2B's OpenAPI spec
names them) and answers with every field its generated client requires. What a request asks
for that Hangar has no counterpart of is refused here, by name (:func:`refusals`)."""

from __future__ import annotations

import json
import math
from datetime import datetime
from typing import Any

from django.conf import settings
from django.http import JsonResponse
from pydantic import ConfigDict, Field

from runtime.errors import BadRequest
from runtime.models import Sandbox
from runtime.services import previews

from ..api.schemas import ObjectIn
from .tokens import ENVD_VERSION, envd_access_token

S = Sandbox.Status
# E2B knows two states; Hangar's statuses on the way to or from one are shown as it.
STATES: dict[str, tuple[str, ...]] = {
    "running": (S.PENDING, S.STARTING, S.RUNNING, S.RESUMING),
    "paused": (S.PAUSING, S.PAUSED),
}
LIVE = STATES["running"] + STATES["paused"]
ALL_TRAFFIC = "0.0.0.0/0"


class _In(ObjectIn):
    # Fields a newer SDK adds are ignored, not refused: an old Hangar keeps working with it.
    model_config = ConfigDict(extra="ignore")


class AutoResumeIn(_In):
    enabled: bool = False


class NetworkIn(ObjectIn):
    """E2B's egress rules; Hangar's policy is an allowlist or all or nothing, and a field it
    cannot honour is refused (a sandbox that is more open than asked would be worse)."""

    model_config = ConfigDict(extra="forbid")

    allow_out: list[str] | None = Field(None, alias="allowOut", max_length=200)
    deny_out: list[str] | None = Field(None, alias="denyOut", max_length=200)
    allow_public_traffic: bool | None = Field(None, alias="allowPublicTraffic")
    egress_proxy: Any = Field(None, alias="egressProxy")
    mask_request_host: str | None = Field(None, alias="maskRequestHost")
    rules: Any = None
    dns_servers: list[str] | None = Field(None, alias="dnsServers")
    https_ports: list[int] | None = Field(None, alias="httpsPorts")


class VolumeMountIn(_In):
    name: str = Field(min_length=1, max_length=64)
    path: str = Field(min_length=1, max_length=512)


class NewSandboxIn(_In):
    template_id: str = Field(alias="templateID", min_length=1, max_length=300)
    timeout: int | None = Field(None, ge=0)
    auto_pause: bool | None = Field(None, alias="autoPause")
    auto_pause_memory: bool | None = Field(None, alias="autoPauseMemory")
    auto_resume: AutoResumeIn | None = Field(None, alias="autoResume")
    secure: bool | None = None  # every sandbox's envd is secured by its access token
    allow_internet_access: bool | None = None
    network: NetworkIn | None = None
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(None, alias="envVars")
    mcp: Any = None
    iam: Any = None
    volume_mounts: list[VolumeMountIn] | None = Field(None, alias="volumeMounts", max_length=16)


class ConnectIn(_In):
    timeout: int | None = Field(None, ge=0)
    memory: bool | None = None  # "reboot" (false): Hangar resumes as the sandbox was paused


class PauseIn(_In):
    memory: bool | None = None
    require_healthy_guest: bool | None = Field(None, alias="requireHealthyGuest")


class TimeoutIn(_In):
    timeout: int = Field(ge=0)


def refusals(body: NewSandboxIn) -> None:
    """Refuse, naming it, what a create asks for that Hangar has no counterpart of."""
    if body.mcp:
        raise BadRequest("the MCP gateway is not supported by Hangar's E2B API (create without mcp)")
    if body.iam:
        raise BadRequest("workload identity (iam) is not supported by Hangar's E2B API")
    net = body.network
    if net is None:
        return
    unsupported = {
        "egressProxy": net.egress_proxy, "maskRequestHost": net.mask_request_host, "rules": net.rules,
        "dnsServers": net.dns_servers, "httpsPorts": net.https_ports,
    }  # fmt: skip
    named = [name for name, value in unsupported.items() if value is not None]
    if named:
        raise BadRequest(f"network {', '.join(named)} is not supported by Hangar's E2B API")
    if net.deny_out and net.deny_out != [ALL_TRAFFIC]:
        raise BadRequest(f"network denyOut takes only {ALL_TRAFFIC!r} on Hangar (whose egress policy is an "
                         "allowlist): deny everything and list what is allowed in allowOut")  # fmt: skip


def egress_policy(body: NewSandboxIn) -> dict[str, Any] | None:
    """Hangar's egress policy for a create: internet access unset or true is egress ``all``,
    false is no network at all; ``denyOut: ["0.0.0.0/0"]`` with ``allowOut`` is an allowlist."""
    net = body.network
    allow = list(net.allow_out or []) if net else []
    deny_all = bool(net and net.deny_out) or body.allow_internet_access is False
    if not deny_all:
        return {"egress": "all"}
    return {"egress": "allowlist", "allow": allow} if allow else None


def open_ports(body: NewSandboxIn) -> str:
    """Every port of an E2B sandbox is reachable at its preview host (``get_host(port)``):
    by anyone, or with ``allowPublicTraffic: false`` only with its traffic access token."""
    return "private" if body.network is not None and body.network.allow_public_traffic is False else "public"


def traffic_access_token(sandbox: Sandbox, caller: Any) -> str | None:
    """What E2B's SDK keeps as ``traffic_access_token``: the token a private sandbox's ports
    take in the ``e2b-traffic-access-token`` header, bound to the caller's API token (see
    :func:`runtime.services.previews.traffic_token`); None for a public one."""
    return previews.traffic_token(sandbox.id, caller.pk) if sandbox.open_ports == "private" else None


def domain() -> str:
    """Where the sandbox's ports are reached: the preview domain, with the port previews are
    served on when it is not the scheme's own (so the SDK's ``get_host`` gives a preview host)."""
    shown = settings.HANGAR_PREVIEW_PORT
    default = {"http": 80, "https": 443}.get(settings.HANGAR_PREVIEW_SCHEME)
    suffix = f":{shown}" if shown and shown != default else ""
    return f"{settings.HANGAR_PREVIEW_DOMAIN}{suffix}"


def state(sandbox: Sandbox) -> str:
    return "paused" if sandbox.status in STATES["paused"] else "running"


def created_out(sandbox: Sandbox, caller: Any) -> dict[str, Any]:
    """E2B's ``Sandbox``: what create and connect answer (the envd access token is the
    caller's: see :func:`.tokens.envd_access_token`)."""
    return {
        "templateID": sandbox.image,
        "sandboxID": sandbox.id,
        "alias": sandbox.image,
        "clientID": sandbox.node.name if sandbox.node else "",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": envd_access_token(sandbox.id, caller),
        "trafficAccessToken": traffic_access_token(sandbox, caller),
        "domain": domain(),
    }


def _started(sandbox: Sandbox) -> datetime:
    return sandbox.started_at or sandbox.created_at


def listed_out(sandbox: Sandbox) -> dict[str, Any]:
    """E2B's ``ListedSandbox``."""
    return {
        "templateID": sandbox.image,
        "alias": sandbox.image,
        "sandboxID": sandbox.id,
        "clientID": sandbox.node.name if sandbox.node else "",
        "startedAt": _started(sandbox),
        # A paused sandbox does not expire on Hangar: its end is the expiry it had.
        "endAt": sandbox.expires_at or _started(sandbox),
        "cpuCount": max(1, math.ceil(sandbox.cpu)),
        "memoryMB": sandbox.memory_mb,
        "diskSizeMB": sandbox.disk_mb,
        # E2B's metadata is strings; what Hangar's own API stored otherwise is shown as JSON.
        "metadata": {
            k: v if isinstance(v, str) else json.dumps(v) for k, v in (sandbox.metadata or {}).items()
        },
        "state": state(sandbox),
        "envdVersion": ENVD_VERSION,
        "volumeMounts": [{"name": m.volume.name, "path": m.mount_path} for m in sandbox.volume_mounts.all()],
    }


def detail_out(sandbox: Sandbox, caller: Any) -> dict[str, Any]:
    """E2B's ``SandboxDetail``: get info."""
    egress = (sandbox.network or {}).get("egress", "none")
    network: dict[str, Any] = {}
    if egress != "all":
        network["denyOut"] = [ALL_TRAFFIC]
    if egress == "allowlist":
        network["allowOut"] = list(sandbox.network.get("allow", []))
    if sandbox.open_ports == "private":
        network["allowPublicTraffic"] = False
    return {
        **listed_out(sandbox),
        "envdAccessToken": envd_access_token(sandbox.id, caller),
        "domain": domain(),
        "allowInternetAccess": egress == "all",
        "network": network,
        "lifecycle": {
            "onTimeout": "pause" if sandbox.on_expire == "pause" else "kill",
            "autoResume": sandbox.auto_resume,
        },  # fmt: skip
    }


def metric_out(sandbox: Sandbox, stats: dict[str, Any], cpu_pct: float, at: datetime) -> dict[str, Any]:
    """E2B's ``SandboxMetric`` from Hangar's stats of the running sandbox."""
    return {
        "timestamp": at,
        "timestampUnix": int(at.timestamp()),
        "cpuCount": max(1, math.ceil(sandbox.cpu)),
        "cpuUsedPct": round(cpu_pct, 2),
        "memUsed": stats["memory_bytes"],
        "memTotal": stats["memory_limit_bytes"],
        "memCache": 0,  # not measured separately: memUsed is what the sandbox's cgroup holds
        "diskUsed": stats["disk_bytes"],
        "diskTotal": stats["disk_limit_bytes"] or sandbox.disk_mb * 1024 * 1024,
    }


def error(status: int, message: str) -> JsonResponse:
    """An error as E2B answers it, ``{"code", "message"}``: the SDK turns it into its own
    exception (401 AuthenticationException, 429 RateLimitException, others SandboxException
    with the message; 404 NotFoundException where it expects one)."""
    return JsonResponse({"code": status, "message": message}, status=status)
