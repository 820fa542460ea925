"""Commands and files in a running sandbox: blocking exec (recorded as an ``Exec`` row), file
reads, writes and listings, and the usage figures pages show."""

from __future__ import annotations

import dataclasses
import logging
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.utils import timezone

from .. import notify
from ..errors import InvalidValue, TooLarge
from ..launchers.base import (
    ExecRequest,
    ExecResult,
    FileEntry,
    FileOpError,
    LauncherError,
)
from ..lifecycle import record_event
from ..models import Exec, Sandbox
from ..node.local import launcher_for
from . import secrets as secret_svc
from . import spans, uploads
from .checks import validate_command_size, validate_env
from .sandbox_access import sandbox_access
from .sandbox_calls import file_failure, require_running, runtime_failure, sandbox_call, sandbox_mark_active

log = logging.getLogger(__name__)
S = Sandbox.Status


STATS_KEY = "hangar:sandbox-stats"
_last_cpu: dict[str, tuple[float, float]] = {}  # sandbox id -> (monotonic time, cpu seconds)


@dataclass
class ExecOutcome:
    exec: Exec
    result: ExecResult


def _check_path(path: str) -> str:
    if not path or not path.startswith("/"):
        raise InvalidValue(f"path must be absolute (start with /), got {path!r}")
    if "\0" in path:
        raise InvalidValue("path contains a NUL byte")
    return posixpath.normpath(path) if path != "/" else "/"


def _decode_for_storage(data: bytes | bytearray, limit: int) -> str:
    return (
        data[:limit].decode("utf-8", errors="replace").replace("\x00", "\ufffd")
    )  # a text column holds no NUL


def exec_validate(
    *, cmd: str | list[str], env: dict[str, str] | None, cwd: str | None, timeout_s: float | None
) -> tuple[list[str], dict[str, str], str | None]:
    """Check a command's parameters; returns (argv, env, cwd). ``timeout_s=None``: no limit."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidValue("cmd must not be empty")
        argv = ["/bin/sh", "-c", cmd]
    else:
        if not cmd or not all(isinstance(a, str) for a in cmd) or not cmd[0]:
            raise InvalidValue("cmd must be a non-empty string or a non-empty list of strings")
        argv = list(cmd)
    if any("\0" in a for a in argv):
        raise InvalidValue("cmd contains a NUL byte")
    env = env or {}
    validate_env(env)
    max_timeout = settings.HANGAR_EXEC_MAX_TIMEOUT_S
    if timeout_s is not None and not 0 < timeout_s <= max_timeout:
        raise InvalidValue(f"timeout_s must be between 1 and {max_timeout}, got {timeout_s:g}")
    if cwd is not None:
        cwd = _check_path(cwd)
    return argv, env, cwd


def sandbox_exec(
    *,
    sandbox: Sandbox,
    cmd: str | list[str],
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    stdin: bytes | None = None,
    timeout_s: float = 60,
    user: User | None = None,
    keep_output: bool = True,
) -> ExecOutcome:
    """Run a command to completion in a running sandbox; a string runs under ``/bin/sh -c``.
    ``keep_output=False``: its output is returned but not kept in its history row (Hangar's
    own commands whose output may hold what a user's files hold: a run's diff)."""
    require_running(sandbox)
    sandbox_mark_active(sandbox.id, sandbox.last_activity_at)
    argv, env, cwd = exec_validate(cmd=cmd, env=env, cwd=cwd, timeout_s=timeout_s)
    # A claimed pool member got its env and secrets after it started: they come with each exec.
    env = {**sandbox.env, **secret_svc.env_for(sandbox), **env}
    validate_command_size(node=sandbox.node, runtime=sandbox.runtime, argv=argv, env=env, cwd=cwd)
    # One row per exec, written once it has ended (one write on the hot path, not two).
    row = Exec(
        sandbox=sandbox, argv=argv, cwd=cwd or "", started_at=timezone.now(),
        created_by=user if user is not None and user.is_authenticated else None,
    )  # fmt: skip
    max_output = settings.HANGAR_EXEC_MAX_OUTPUT_BYTES
    req = ExecRequest(argv=argv, env=env, cwd=cwd, stdin=stdin, timeout=timeout_s, max_output=max_output)
    with spans.span("exec", **spans.of(sandbox),
                    attributes={"process.command_args": argv, "process.working_directory": cwd or ""}) as traced:  # fmt: skip
        outcome = _exec(sandbox, row, req, argv, keep_output)
        result = outcome.result
        traced.set({"process.exit_code": result.exit_code, "hangar.exec.id": row.id,
                    "hangar.exec.duration_ms": round(result.duration_ms, 2), "hangar.exec.timed_out": result.timed_out})  # fmt: skip
        if result.exit_code != 0:
            traced.fail(f"exit code {result.exit_code}" + (" (timed out)" if result.timed_out else ""))
    return outcome


def _exec(sandbox: Sandbox, row: Exec, req: ExecRequest, argv: list[str], keep_output: bool) -> ExecOutcome:
    try:
        result = sandbox_access(sandbox).exec(req)
    except FileOpError as exc:
        # The agent could not start the command (no such binary, missing cwd): a client error,
        # refused whole (its row is never written: nothing ran).
        raise InvalidValue(f"could not run {argv[0]!r}: {exc.message} ({exc.errno_name})") from exc
    except LauncherError as exc:
        row.error, row.finished_at = str(exc), timezone.now()
        row.save()
        raise runtime_failure(sandbox, exc) from exc
    keep = settings.HANGAR_EXEC_KEEP_OUTPUT_BYTES
    row.exit_code, row.timed_out = result.exit_code, result.timed_out
    if not keep_output:
        keep = 0
    row.stdout = _decode_for_storage(result.stdout, keep)
    row.stderr = _decode_for_storage(result.stderr, keep)
    row.stdout_bytes, row.stderr_bytes = len(result.stdout), len(result.stderr)
    row.finished_at, row.duration_ms = timezone.now(), result.duration_ms
    row.save()
    return ExecOutcome(exec=row, result=result)


def _file_chunks(sandbox: Sandbox, chunks: Iterator[bytes]) -> Iterator[bytes]:
    """``chunks``, with a failure on the way raised as the service error it means (EIO from
    /proc/self/mem is a 409 like any other file's)."""
    try:
        yield from chunks
    except LauncherError as exc:
        raise file_failure(sandbox, exc) from exc


@spans.traced("file.write")
def sandbox_file_write(*, sandbox: Sandbox, path: str, data: uploads.Chunks, size: int | None = None) -> int:
    """Write a file inside the sandbox (parents created, replaced atomically). ``data`` may be
    an iterable of chunks: they go to the sandbox as they come, never held whole; ``size`` is
    what the caller announced, checked before any of it is read."""
    path = _check_path(path)
    limit = settings.HANGAR_FILE_MAX_BYTES
    if size is not None and size > limit:
        raise TooLarge(f"file is larger than the {limit} byte limit (HANGAR_FILE_MAX_BYTES)")
    chunks = uploads.at_most(data, limit)

    written = sandbox_call(sandbox, lambda: sandbox_access(sandbox).write_file(path, chunks))
    record_event(sandbox.id, "file", f"wrote {path} ({written} bytes)", path=path, size=written)
    return written


@spans.traced("file.read")
def sandbox_file_read(
    *, sandbox: Sandbox, path: str, no_pseudo_fs: bool = False
) -> tuple[FileEntry, Iterator[bytes]]:
    """Stream a file from inside the sandbox. ``no_pseudo_fs`` (callers who may not exec):
    a path on /proc or /sys, or through them, is refused (403). The entry's size is the
    sandbox's word, not a promise about the bytes that follow."""
    path = _check_path(path)

    entry, chunks = sandbox_call(
        sandbox, lambda: sandbox_access(sandbox).read_file(path, no_pseudo_fs=no_pseudo_fs)
    )
    return entry, _file_chunks(sandbox, chunks)


@spans.traced("file.list")
def sandbox_file_list(*, sandbox: Sandbox, path: str, no_pseudo_fs: bool = False) -> list[FileEntry]:
    """List a directory inside the sandbox (``no_pseudo_fs`` as for :func:`sandbox_file_read`)."""
    path = _check_path(path)

    return sandbox_call(sandbox, lambda: sandbox_access(sandbox).list_files(path, no_pseudo_fs=no_pseudo_fs))


def sandbox_stats(*, sandbox: Sandbox) -> dict[str, Any]:
    """CPU time, memory and disk the running sandbox uses now."""

    return dataclasses.asdict(sandbox_call(sandbox, lambda: sandbox_access(sandbox).stats()))


def sandboxes_stats_collect(*, node_name: str) -> int:
    """Sample CPU and memory of every running sandbox on this node into Redis (one hash), so
    pages show usage for a thousand rows with one round trip instead of one runtime call each."""
    import json
    import time
    from concurrent.futures import ThreadPoolExecutor

    rows = list(
        Sandbox.objects.filter(node__name=node_name, status=S.RUNNING).values_list("id", "runtime", "handle")
    )

    def sample(row: tuple[str, str, dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
        sandbox_id, runtime, handle = row
        try:
            st = launcher_for(runtime).stats(handle)
        except LauncherError:
            return None
        now = time.monotonic()
        prev = _last_cpu.get(sandbox_id)
        _last_cpu[sandbox_id] = (now, st.cpu_seconds)
        cpu_pct = None
        if prev is not None and now > prev[0]:
            cpu_pct = max(0.0, (st.cpu_seconds - prev[1]) / (now - prev[0]) * 100.0)
        return sandbox_id, {"cpu_pct": cpu_pct, "memory_bytes": st.memory_bytes, "disk_bytes": st.disk_bytes,
                            "at": time.time()}  # fmt: skip

    with ThreadPoolExecutor(max_workers=4) as pool:
        samples = [s for s in pool.map(sample, rows) if s is not None]
    live = {r[0] for r in rows}
    for gone in set(_last_cpu) - live:
        del _last_cpu[gone]
    if samples:
        notify.redis_client().hset(STATS_KEY, mapping={sid: json.dumps(v) for sid, v in samples})
    return len(samples)


def sandboxes_stats_cached(*, ids: list[str]) -> dict[str, dict[str, Any]]:
    """The last usage sample of each sandbox (see :func:`sandboxes_stats_collect`)."""
    import json

    if not ids:
        return {}
    try:
        values = notify.redis_client().hmget(STATS_KEY, ids)
    except Exception:  # usage figures are decoration; a Redis blip must not break a page
        return {}
    return {sid: json.loads(v) for sid, v in zip(ids, values, strict=True) if v}
