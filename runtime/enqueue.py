"""Sending a task of :mod:`runtime.tasks` by its name.

A task calls one service, so ``runtime.tasks`` imports the services; a service that enqueues
work sends the task by name from here instead of importing the tasks module back. The message
is the one ``Task.apply_async`` sends: the worker applies the task's own options.
"""

from __future__ import annotations

from typing import Any

from celery import current_app
from celery.result import AsyncResult

# Publishing again when the broker blips (a create's row is committed: its task must go).
RETRY_POLICY = {"max_retries": 3, "interval_start": 0.2}


def send(task: str, args: list[Any], *, queue: str, answer: bool = False, **options: Any) -> AsyncResult:
    """Send ``runtime.tasks.<task>`` to ``queue``. ``answer``: the caller waits for the task's
    result (only tasks that keep theirs, ``node_op`` and ``volume_op``); otherwise nothing
    listens for one."""
    return current_app.send_task(
        f"runtime.tasks.{task}", args=args, queue=queue, ignore_result=not answer, **options
    )
