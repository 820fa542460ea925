"""Runs: one task given to a harness's agent, headless.

``run_create`` writes the run (queued) and hands it to a worker: ``run_start`` resumes the
harness if it is paused, records the workspace's tree, and starts the agent's headless command
in ``/workspace`` as a live process of the node's stream bridge (so its output streams to
whoever follows it, and is kept), with the prompt in ``$HANGAR_PROMPT`` and on stdin. When the
process ends, the bridge's record of its end calls :func:`run_process_ended`, and
``run_finish`` takes the diff between the tree before and the tree after, and the final status.
The run's id is in the process's environment (``HANGAR_RUN_ID``, and in
``OTEL_RESOURCE_ATTRIBUTES``), so what the agent exports lands with it.
"""

from __future__ import annotations

import logging
import re
import shlex
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from .. import enqueue, presets, streams
from ..errors import Conflict, InvalidValue, NotFound, ServiceError
from ..models import Exec, Harness, Run, Sandbox, Team
from . import audit, spans
from . import harnesses as harness_svc
from . import sandbox_io as io_svc
from .channel_layer import run_with_own_layer
from .processes import ProcessHandle, process_start

log = logging.getLogger(__name__)
MAX_PROMPT = 100_000  # one environment string may hold 128 KiB
DIFF_MAX_BYTES = 1024 * 1024


def runs_for_harness(*, harness: Harness) -> QuerySet[Run]:
    return Run.objects.filter(harness=harness).select_related("exec")


def run_get(*, team: Team, run_id: str) -> Run:
    row = (
        Run.objects.select_related("harness", "harness__sandbox", "harness__sandbox__node", "exec")
        .filter(id=run_id, harness__team=team)
        .first()
    )
    if row is None:
        raise NotFound(f"no run {run_id!r} in team {team.name}")
    return row


TREE_RE = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def _tree_id(out: bytes | bytearray) -> str:
    """A git tree id from the tree script's output ("" for anything else: the workspace is
    the agent's, so is whatever git it runs)."""
    text = out.decode("ascii", "replace").strip()
    return text if TREE_RE.fullmatch(text) else ""


def _elide(argv: list[str], prompt: str) -> str:
    return shlex.join(["<prompt>" if a == prompt else a for a in argv])


def run_create(*, harness: Harness, user: User | None, prompt: str, timeout_s: int | None = None) -> Run:
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidValue("prompt must not be empty")
    if len(prompt.encode()) > MAX_PROMPT or "\0" in prompt:
        raise InvalidValue(f"prompt must be at most {MAX_PROMPT} bytes (UTF-8), without NUL bytes")
    limit = settings.HANGAR_RUN_MAX_TIMEOUT_S
    timeout_s = min(3600, limit) if timeout_s is None else timeout_s
    if not 1 <= timeout_s <= limit:
        raise InvalidValue(f"timeout_s must be between 1 and {limit}, got {timeout_s}")
    status = harness_svc.harness_status(harness)
    if status == "failed" and harness.setup == Harness.Setup.FAILED:
        raise Conflict(f"harness {harness.name}'s workspace setup failed ({harness.setup_error}); "
                       "fix it and resume the harness, or create a new one", status=status)  # fmt: skip
    argv = presets.preset(harness.agent).run_argv(prompt, harness.command)
    with transaction.atomic():
        run = Run.objects.create(
            harness=harness, prompt=prompt, timeout_s=timeout_s, argv=argv,
            created_by=user if user is not None and getattr(user, "is_authenticated", False) else None,
        )  # fmt: skip
        transaction.on_commit(lambda: _enqueue("run_start", run.id))
    harness_svc.harness_log(harness, "event", f"run {run.id} queued", run=run)
    audit.record("run.create", team=harness.team, target=f"{run.id} in {harness.name}", timeout_s=timeout_s)
    return run


def _enqueue(task: str, run_id: str) -> None:
    try:
        enqueue.send(task, [run_id], queue="control")
    except Exception as exc:
        log.error("could not enqueue %s for run %s: %s", task, run_id, exc)
        _end(run_id, Run.Status.FAILED, error=f"the task queue is unreachable: {exc}", frm=Run.ACTIVE)


def _end(run_id: str, status: str, *, frm: tuple[str, ...], error: str = "", **fields: Any) -> bool:
    now = timezone.now()
    done = Run.objects.filter(id=run_id, status__in=frm).update(status=status, error=error[:4000], finished_at=now,
                                                                 **fields)  # fmt: skip
    if done:
        run = Run.objects.select_related("harness", "exec").get(id=run_id)
        _trace_end(run)
        took = f" in {run.duration_ms / 1000:.1f} s" if run.duration_ms is not None else ""
        code = f" (exit code {run.exit_code})" if run.exit_code is not None else ""
        why = f": {error}" if error and status != Run.Status.SUCCEEDED else ""
        harness_svc.harness_log(run.harness, "event", f"run {run.id} {status}{took}{code}{why}", run=run)
        harness_svc.harness_notify(run.harness)
    return bool(done)


def _trace_end(run: Run) -> None:
    """The run's trace gets its root span (and its agent's process, if it ran) once it ends."""
    root = spans.run_trace(run.id)
    h = run.harness
    ties = {"hangar.run.id": run.id, "hangar.harness.id": h.id, "hangar.sandbox.id": h.sandbox_id or ""}
    end = spans.ns(run.finished_at or timezone.now())
    ex = run.exec
    if ex is not None and ex.started_at is not None:
        spans.record(
            "run.agent", team_id=h.team_id, context=spans.SpanContext(root.trace_id, spans.new_span_id()),
            parent_span_id=root.span_id, start_ns=spans.ns(ex.started_at),
            end_ns=spans.ns(ex.finished_at) if ex.finished_at else end,
            attributes={**ties, "process.command_args": _elide(run.argv, run.prompt), "process.exit_code": ex.exit_code,
                        "hangar.exec.id": ex.id},
            error=ex.error or ("" if ex.exit_code in (0, None) else f"exit code {ex.exit_code}"),
        )  # fmt: skip
    spans.record(
        "invoke_agent", team_id=h.team_id, context=root, parent_span_id="",
        start_ns=spans.ns(run.created_at), end_ns=end,
        attributes={**ties, "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": h.agent,
                    "gen_ai.agent.id": h.id, "gen_ai.conversation.id": run.id,
                    "hangar.run.status": run.status, "process.exit_code": run.exit_code},
        error="" if run.status == Run.Status.SUCCEEDED else (run.error or run.status), kind=spans.SERVER,
    )  # fmt: skip


def run_start(*, run_id: str) -> None:
    """The worker's side of :func:`run_create` (idempotent: only a queued run is started).
    Whatever goes wrong ends the run as failed, with the reason: a run never stays queued."""
    try:
        _run_start(run_id)
    except Exception as exc:
        log.exception("run %s could not be started", run_id)
        _end(run_id, Run.Status.FAILED, frm=(Run.Status.QUEUED,), error=f"it could not be started: {exc}")
        raise


def _run_start(run_id: str) -> None:
    run = Run.objects.select_related("harness", "harness__team", "created_by").filter(id=run_id).first()
    if run is None or run.status != Run.Status.QUEUED:
        return
    h = run.harness
    if h.deleted_at is not None:
        _end(run.id, Run.Status.CANCELLED, frm=(Run.Status.QUEUED,), error="the harness was deleted")
        return
    try:
        h = harness_svc.harness_ensure_running(harness=h, timeout=settings.HANGAR_HARNESS_RESUME_WAIT_S)
    except ServiceError as exc:
        _end(run.id, Run.Status.FAILED, frm=(Run.Status.QUEUED,), error=exc.message)
        return
    if h.setup == Harness.Setup.FAILED:
        _end(
            run.id,
            Run.Status.FAILED,
            frm=(Run.Status.QUEUED,),
            error=f"the workspace setup failed: {h.setup_error}",
        )
        return
    sandbox = Sandbox.objects.select_related("node").get(id=h.sandbox_id)
    # What Hangar does for the run goes in the run's trace, under its root span.
    parent = spans.set_parent(spans.run_trace(run.id))
    try:
        _launch_run(run, h, sandbox)
    finally:
        spans.reset_parent(parent)


def _launch_run(run: Run, h: Harness, sandbox: Sandbox) -> None:
    try:
        with spans.span(
            "run.setup", team_id=h.team_id, sandbox_id=sandbox.id, run_id=run.id, harness_id=h.id
        ):
            tree = io_svc.sandbox_exec(
                sandbox=sandbox, cmd=presets.TREE_SCRIPT, timeout_s=300, keep_output=False
            )
        tree_before = _tree_id(tree.result.stdout) if tree.result.exit_code == 0 else ""
    except ServiceError as exc:
        _end(
            run.id,
            Run.Status.FAILED,
            frm=(Run.Status.QUEUED,),
            error=f"could not read the workspace: {exc.message}",
        )
        return
    env = {
        "HANGAR_PROMPT": run.prompt,
        "HANGAR_RUN_ID": run.id,
        "OTEL_RESOURCE_ATTRIBUTES": f"hangar.team={h.team_id},hangar.harness.id={h.id},hangar.run.id={run.id}",
        # The run's root span: an agent (or a script) that honours it puts its spans in the run's trace.
        "TRACEPARENT": spans.traceparent(spans.run_trace(run.id)),
    }
    if not Run.objects.filter(id=run.id, status=Run.Status.QUEUED).exists():
        return  # cancelled meanwhile
    mask = harness_svc.mask_values(h)
    try:
        row = run_with_own_layer(lambda: process_start(
            sandbox=sandbox, cmd=run.argv, kind=Exec.Kind.BACKGROUND, cwd=presets.WORKSPACE, env=env,
            stdin=run.prompt.encode(), stdin_open=False, timeout_s=run.timeout_s, user=run.created_by,
            mask=mask,
        ))  # fmt: skip
    except ServiceError as exc:
        _end(run.id, Run.Status.FAILED, frm=(Run.Status.QUEUED,), error=exc.message)
        return
    started = Run.objects.filter(id=run.id, status=Run.Status.QUEUED).update(
        status=Run.Status.RUNNING, exec=row, tree_before=tree_before, started_at=row.started_at
    )
    if not started:  # cancelled while it started
        _kill(sandbox, row.id)
        return
    harness_svc.harness_log(h, "event", f"run {run.id} started: {_elide(run.argv, run.prompt)}", run=run)
    harness_svc.harness_notify(h)
    # It may have ended before the run knew its process: then nobody else will finish it.
    if Exec.objects.filter(id=row.id).exclude(status=Exec.Status.RUNNING).exists():
        _enqueue("run_finish", run.id)


def run_process_ended(*, exec_id: int) -> None:
    """The bridge recorded the end of a process: if it was a run's, finish the run."""
    for run_id in Run.objects.filter(exec_id=exec_id, status=Run.Status.RUNNING).values_list("id", flat=True):
        _enqueue("run_finish", run_id)


def run_finish(*, run_id: str) -> None:
    """Record the run's outcome and diff once its process has ended (idempotent)."""
    run = Run.objects.select_related("harness", "exec").filter(id=run_id).first()
    if run is None or run.status != Run.Status.RUNNING or run.exec is None:
        return
    ex = run.exec
    if ex.status == Exec.Status.RUNNING:
        return
    sandbox = Sandbox.objects.select_related("node").filter(id=run.harness.sandbox_id).first()
    parent = spans.set_parent(spans.run_trace(run.id))
    try:
        diff, truncated, note = _diff(run, sandbox)
    finally:
        spans.reset_parent(parent)
    if run.cancel_requested:
        status, error = Run.Status.CANCELLED, "cancelled"
    elif ex.timed_out:
        status, error = Run.Status.TIMED_OUT, f"took longer than its timeout of {run.timeout_s} s"
    elif ex.exit_code == 0:
        status, error = Run.Status.SUCCEEDED, ""
    else:
        status = Run.Status.FAILED
        error = ex.error or (f"exit code {ex.exit_code}" if ex.exit_code is not None else "it was lost")
    _end(run.id, status, frm=(Run.Status.RUNNING,), error=(error + note).lstrip("; "), exit_code=ex.exit_code,
         duration_ms=ex.duration_ms, diff=diff, diff_truncated=truncated)  # fmt: skip


def _diff(run: Run, sandbox: Sandbox | None) -> tuple[str, bool, str]:
    """What the run changed in the workspace: (diff, truncated, a note if it could not be taken)."""
    if not run.tree_before:
        return "", False, ""
    if sandbox is None or sandbox.status != Sandbox.Status.RUNNING:
        return "", False, "; the diff could not be taken: the harness stopped"
    h = run.harness
    try:
        with spans.span("run.diff", team_id=h.team_id, sandbox_id=sandbox.id, run_id=run.id, harness_id=h.id):
            after = io_svc.sandbox_exec(
                sandbox=sandbox, cmd=presets.TREE_SCRIPT, timeout_s=300, keep_output=False
            )
            tree_after = _tree_id(after.result.stdout)
            if after.result.exit_code != 0 or not tree_after:
                return "", False, ""
            out = io_svc.sandbox_exec(sandbox=sandbox, cmd=presets.diff_script(run.tree_before, tree_after),
                                      timeout_s=300, keep_output=False)  # fmt: skip
    except ServiceError as exc:
        return "", False, f"; the diff could not be taken: {exc.message}"
    data = out.result.stdout
    truncated = len(data) > DIFF_MAX_BYTES or out.result.truncated
    masker = streams.Masker(harness_svc.mask_values(h))
    data = masker.feed(bytes(data[:DIFF_MAX_BYTES])) + masker.flush()
    return data.decode("utf-8", "replace"), truncated, ""


def _kill(sandbox: Sandbox, exec_id: int) -> None:
    if sandbox.node is None:
        return
    run_with_own_layer(ProcessHandle.of_exec(sandbox, exec_id).kill)


def run_cancel(*, run: Run) -> tuple[Run, ProcessHandle | None]:
    """Cancel the run: a queued one ends at once; a running one is killed (the caller kills
    the returned process) and ends as cancelled when it exits."""
    if run.status == Run.Status.QUEUED:
        if _end(run.id, Run.Status.CANCELLED, frm=(Run.Status.QUEUED,), error="cancelled before it started"):
            audit.record("run.cancel", team=run.harness.team, target=f"{run.id} in {run.harness.name}")
            run.refresh_from_db()
            return run, None
        run.refresh_from_db()
    if run.status != Run.Status.RUNNING:
        raise Conflict(f"run {run.id} is {run.status}; only a queued or running run can be cancelled",
                       status=run.status)  # fmt: skip
    Run.objects.filter(id=run.id).update(cancel_requested=True)
    run.cancel_requested = True
    audit.record("run.cancel", team=run.harness.team, target=f"{run.id} in {run.harness.name}")
    sandbox = run.harness.sandbox
    if run.exec_id is None or sandbox is None or sandbox.node is None:
        return run, None
    return run, ProcessHandle.of_exec(sandbox, run.exec_id)


def runs_sweep() -> int:
    """Finish runs whose process ended unseen (a bridge restart, a lost message), and fail
    runs queued for too long (their worker died)."""
    n = harness_svc.harnesses_setup_sweep()
    for run_id in (
        Run.objects.filter(status=Run.Status.RUNNING)
        .exclude(exec__status=Exec.Status.RUNNING)
        .values_list("id", flat=True)[:200]
    ):
        _enqueue("run_finish", run_id)  # its diff takes commands in the sandbox: not on the reaper
        n += 1
    stale = timezone.now() - timedelta(seconds=settings.HANGAR_HARNESS_RESUME_WAIT_S + 600)
    for run_id in Run.objects.filter(status=Run.Status.QUEUED, created_at__lt=stale).values_list(
        "id", flat=True
    )[:200]:
        n += _end(
            run_id,
            Run.Status.FAILED,
            frm=(Run.Status.QUEUED,),
            error="it was never started (a worker lost it)",
        )
    return n
