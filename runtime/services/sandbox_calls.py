"""How a call on a sandbox reads to its caller: the checks before it (running, activity) and
what a runtime's failure means (a conflict, a sandbox that died, a file error). The road to the
sandbox itself is :mod:`.sandbox_access`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from django.db.models import Q
from django.utils import timezone

from ..errors import Conflict, Forbidden, InvalidValue, NotFound, ServiceError
from ..launchers.base import (
    PSEUDO_FS_REFUSED,
    FileOpError,
    Handle,
    Launcher,
    LauncherError,
    SandboxGone,
    SandboxNotRunning,
)
from ..lifecycle import transition
from ..models import Sandbox

log = logging.getLogger(__name__)
S = Sandbox.Status


ACTIVITY_EVERY_S = 5  # last_activity_at is written at most this often per sandbox


def require_running(sandbox: Sandbox) -> None:
    if sandbox.status != S.RUNNING:
        detail = f": {sandbox.status_reason}" if sandbox.status_reason else ""
        raise Conflict(f"sandbox {sandbox.id} is {sandbox.status}{detail}", status=sandbox.status)


def runtime_failure(sandbox: Sandbox, exc: LauncherError) -> Conflict:
    reason = exc.reason if isinstance(exc, SandboxNotRunning) else str(exc)
    if not isinstance(exc, (SandboxNotRunning, SandboxGone)):
        return Conflict(f"sandbox {sandbox.id}: {reason}", status=sandbox.status)  # it runs on
    sandbox_fail(sandbox_id=sandbox.id, reason=reason)
    sandbox.refresh_from_db()
    return Conflict(f"sandbox {sandbox.id} is no longer running: {reason}", status=sandbox.status)


def handle_of(sandbox: Sandbox, launcher: Launcher) -> Handle:
    """The sandbox's handle: as its row keeps it while it runs, else as its node keeps it."""
    return sandbox.handle or launcher.handle_for(sandbox.id)


T = TypeVar("T")


def sandbox_call(sandbox: Sandbox, fn: Callable[[], T]) -> T:
    """``fn()`` on the running sandbox, marked active; a runtime's failure raised as what it
    means to the caller."""
    require_running(sandbox)
    sandbox_mark_active(sandbox.id, sandbox.last_activity_at)
    try:
        return fn()
    except LauncherError as exc:
        raise file_failure(sandbox, exc) from exc


def file_failure(sandbox: Sandbox, exc: LauncherError) -> ServiceError:
    if not isinstance(exc, FileOpError):
        return runtime_failure(sandbox, exc)
    if exc.errno_name == PSEUDO_FS_REFUSED:
        return Forbidden(
            "viewers cannot read /proc or /sys (every process's environment, the sandbox's secrets "
            f"included, shows there): {exc.message}"
        )
    if exc.errno_name == "ENOENT":
        return NotFound(f"{exc.message}")
    if exc.errno_name in ("EISDIR", "ENOTDIR", "EINVAL", "ENAMETOOLONG", "ELOOP"):
        return InvalidValue(f"{exc.message} ({exc.errno_name})")
    return Conflict(f"{exc.message} ({exc.errno_name})")


def sandbox_fail(*, sandbox_id: str, reason: str) -> bool:
    """Record that the sandbox died (out of memory, lost by its node…) with the reason."""
    return transition(
        sandbox_id, to=S.FAILED, frm=[S.PENDING, S.STARTING, S.RUNNING, S.PAUSING, S.RESUMING], reason=reason,
        fields={"stopped_at": timezone.now()},
    )  # fmt: skip


def sandbox_mark_active(sandbox_id: str, last: Any = None) -> None:
    """Someone used the sandbox (an API call on it, an exec, terminal traffic): it is not idle.
    ``last``: its ``last_activity_at`` as just read, if at hand; recent enough, nothing is
    written (no write at all on most calls, which matters on SQLite)."""
    now = timezone.now()
    if last is not None and now - last < timedelta(seconds=ACTIVITY_EVERY_S):
        return
    Sandbox.objects.filter(id=sandbox_id).filter(
        Q(last_activity_at__isnull=True) | Q(last_activity_at__lt=now - timedelta(seconds=ACTIVITY_EVERY_S))
    ).update(last_activity_at=now)
