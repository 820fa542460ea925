"""Preview URLs: a web server running inside a sandbox, reached at
``{scheme}://{port}-{sandbox_id}.{HANGAR_PREVIEW_DOMAIN}``.

The control plane proxies such requests (:mod:`dashboard.edge.preview`) to the sandbox's agent,
which connects to the port on the sandbox's own loopback (the agent's ``T`` tunnel): the
server needs no network of its own and is reachable whatever the sandbox's egress rules.

Access: a port is private unless exposed as public. A private preview takes a signed,
expiring token (``?hangar_token=…`` in the URL Hangar hands out, then kept in a cookie for
that host), or an API token of the sandbox's team (``Authorization: Bearer hgr_…``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core import signing
from django.db import transaction
from django.utils.crypto import constant_time_compare, salted_hmac

from ..errors import Conflict, InvalidValue, NotFound
from ..models import Sandbox
from . import audit

# A sandbox's ``open_ports``: "" (only the ports it exposes), every port "public", or every
# port "private" (reached with its traffic access token, or as any private preview is).
OPEN_PORTS = ("", "public", "private")
TRAFFIC_HEADER = "e2b-traffic-access-token"  # E2B's name for it: its SDK's users send it so
_TRAFFIC_SALT = "hangar.previews.traffic-access-token"

MAX_PORTS = 20
CACHE_S = 1.0
# The proxy keeps a running sandbox's row a moment: a page load is dozens of requests, each
# would otherwise read it. Changes made through this process forget it at once; others (a
# pause by the reaper, a change on another server) are seen within CACHE_S.
_rows: dict[str, tuple[float, Sandbox]] = {}
TOKEN_PARAM = "hangar_token"
COOKIE = "hangar_preview"
_SALT = "hangar.preview"


@dataclass(frozen=True)
class Preview:
    port: int
    public: bool
    url: str


def host_pattern() -> re.Pattern[str]:
    return re.compile(
        rf"^(\d{{1,5}})-([a-z0-9]{{3,32}})\.{re.escape(settings.HANGAR_PREVIEW_DOMAIN)}(?::\d+)?$"
    )


def parse_host(host: str) -> tuple[int, str] | None:
    """``(port, sandbox_id)`` for a preview host name, else None."""
    m = host_pattern().match((host or "").lower())
    if not m:
        return None
    port = int(m.group(1))
    return (port, m.group(2)) if 1 <= port <= 65535 else None


def base_url(sandbox_id: str, port: int) -> str:
    shown = settings.HANGAR_PREVIEW_PORT
    default = {"http": 80, "https": 443}.get(settings.HANGAR_PREVIEW_SCHEME)
    suffix = f":{shown}" if shown and shown != default else ""
    return f"{settings.HANGAR_PREVIEW_SCHEME}://{port}-{sandbox_id}.{settings.HANGAR_PREVIEW_DOMAIN}{suffix}"


def sign(sandbox_id: str, port: int) -> str:
    return signing.TimestampSigner(salt=_SALT).sign(f"{sandbox_id}:{port}")


def verify(token: str, sandbox_id: str, port: int) -> bool:
    """A signed preview token for exactly this sandbox and port, not expired."""
    try:
        value = signing.TimestampSigner(salt=_SALT).unsign(token, max_age=settings.HANGAR_PREVIEW_TOKEN_TTL_S)
    except signing.BadSignature:  # SignatureExpired is one
        return False
    return value == f"{sandbox_id}:{port}"


def previews_of(sandbox: Sandbox) -> list[Preview]:
    """The sandbox's preview URLs; a private one carries a fresh signed token."""
    out = []
    for p in sandbox.ports or []:
        url = base_url(sandbox.id, p["port"]) + "/"
        if not p.get("public"):
            url += f"?{TOKEN_PARAM}={sign(sandbox.id, p['port'])}"
        out.append(Preview(port=p["port"], public=bool(p.get("public")), url=url))
    return out


def validate_ports(ports: list[Any]) -> list[dict[str, Any]]:
    """``[8000, {"port": 3000, "public": true}]`` → ``[{"port", "public"}]``, checked."""
    if not isinstance(ports, list):
        raise InvalidValue("ports is a list of port numbers (or {port, public} objects)")
    out: dict[int, dict[str, Any]] = {}
    for item in ports:
        port, public = (
            (item.get("port"), bool(item.get("public", False))) if isinstance(item, dict) else (item, False)
        )
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidValue(f"a port is a number from 1 to 65535, got {port!r}")
        out[port] = {"port": port, "public": public}
    if len(out) > MAX_PORTS:
        raise InvalidValue(f"at most {MAX_PORTS} ports can have preview URLs")
    return sorted(out.values(), key=lambda p: p["port"])


def port_expose(*, sandbox: Sandbox, port: int, public: bool = False) -> Preview:
    """Give ``port`` a preview URL (or change whether it is public)."""
    (entry,) = validate_ports([{"port": port, "public": public}])
    with transaction.atomic():
        row = Sandbox.objects.select_for_update().get(id=sandbox.id)
        if row.status == Sandbox.Status.DELETED:
            raise Conflict(f"sandbox {sandbox.id} is deleted", status=row.status)
        ports = [p for p in row.ports or [] if p["port"] != port] + [entry]
        row.ports = validate_ports(ports)
        row.save(update_fields=["ports", "updated_at"])
        audit.record("sandbox.port", team=row.team, target=sandbox.id, port=port, public=public)
    forget_row(sandbox.id)
    sandbox.ports = row.ports
    return next(p for p in previews_of(sandbox) if p.port == port)


def port_unexpose(*, sandbox: Sandbox, port: int) -> None:
    with transaction.atomic():
        row = Sandbox.objects.select_for_update().get(id=sandbox.id)
        if not any(p["port"] == port for p in row.ports or []):
            if row.open_ports:
                raise NotFound(f"port {port} of sandbox {sandbox.id} has no preview URL of its own to remove: every "
                               f"port of this sandbox is open ({row.open_ports}, as E2B's sandboxes are), for its life")  # fmt: skip
            raise NotFound(f"port {port} of sandbox {sandbox.id} has no preview URL")
        row.ports = [p for p in row.ports if p["port"] != port]
        row.save(update_fields=["ports", "updated_at"])
        audit.record("sandbox.unport", team=row.team, target=sandbox.id, port=port)
    forget_row(sandbox.id)
    sandbox.ports = row.ports


def cached_row(sandbox_id: str) -> Sandbox | None:
    hit = _rows.get(sandbox_id)
    if hit is not None and time.monotonic() - hit[0] < CACHE_S:
        return hit[1]
    return None


def remember_row(sandbox: Sandbox) -> None:
    if len(_rows) > 10_000:
        _rows.clear()
    _rows[sandbox.id] = (time.monotonic(), sandbox)


def forget_row(sandbox_id: str) -> None:
    _rows.pop(sandbox_id, None)


def on_status_changed(sandbox_id: str, status: str) -> None:
    """A receiver of ``events.status_changed``: this process's copy of the row is stale."""
    forget_row(sandbox_id)


def port_entry(sandbox: Sandbox, port: int) -> dict[str, Any] | None:
    """The port's preview: its entry in ``ports``, else (a sandbox whose every port is open, as
    E2B's are) ``{"port", "public"}`` by its ``open_ports``; None when it has none."""
    found = next((p for p in sandbox.ports or [] if p["port"] == port), None)
    if found is None and sandbox.open_ports in OPEN_PORTS[1:]:
        return {"port": port, "public": sandbox.open_ports == "public", "open": True}
    return found


def traffic_token(sandbox_id: str, token_id: int) -> str:
    """The token that opens a private sandbox's every port (``open_ports`` "private"), sent as
    the ``e2b-traffic-access-token`` header, for the API token ``token_id`` that asked for it:
    ``<API token id>.<HMAC of the sandbox id and that id under SECRET_KEY>``. Derived, never
    stored; it opens the ports only while that API token is live, of the sandbox's team, may read
    its sandboxes and reaches this one (:func:`traffic_token_valid`), so revoking the API token
    (or the user's leaving the team) closes them too."""
    mac = salted_hmac(_TRAFFIC_SALT, f"{sandbox_id}:{token_id}", algorithm="sha256").hexdigest()
    return f"{token_id}.{mac}"


_TRAFFIC_OK: dict[tuple[str, str], float] = {}  # (token, sandbox id) -> until when it was found valid
TRAFFIC_CACHE_S = 2.0  # a page load's dozens of requests check the API token once


def traffic_token_valid(token: str, sandbox: Sandbox) -> bool:
    """Whether ``token`` is this sandbox's traffic token for an API token that may still read
    it (checked at most every :data:`TRAFFIC_CACHE_S` per token and sandbox)."""
    from .auth import sandbox_reached, token_allows, token_current

    head, _, _ = token.partition(".")
    if not head.isdigit() or not constant_time_compare(token, traffic_token(sandbox.id, int(head))):
        return False
    key, now = (token, sandbox.id), time.monotonic()
    if _TRAFFIC_OK.get(key, 0.0) > now:
        return True
    api_token = token_current(token_id=int(head))
    valid = bool(
        api_token is not None and api_token.team_id == sandbox.team_id and token_allows(api_token, "sandboxes:read")
        and sandbox_reached(caller=api_token, sandbox_id=sandbox.id)
    )  # fmt: skip
    if valid:
        if len(_TRAFFIC_OK) > 10_000:
            _TRAFFIC_OK.clear()
        _TRAFFIC_OK[key] = now + TRAFFIC_CACHE_S
    else:
        _TRAFFIC_OK.pop(key, None)
    return valid
