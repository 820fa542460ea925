"""What the lower layers announce, and the features above that listen.

The state machine, the sandbox services and the stream bridge's record of a process's end
know nothing of usage metering, previews, harnesses, runs or pools: they send a hook, and each
feature connects its receiver in :meth:`runtime.apps.RuntimeConfig.ready`. A hook calls its
receivers in the order they were connected, in the caller's thread and transaction, so a
receiver runs exactly where the call it replaces ran (inside the transition's transaction for
:data:`status_changing`, after it for :data:`status_changed`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

if TYPE_CHECKING:
    from .models import Sandbox

P = ParamSpec("P")
R = TypeVar("R")


class Hook(Generic[P, R]):
    """A named list of receivers with one signature."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.receivers: list[Callable[P, R]] = []

    def connect(self, receiver: Callable[P, R]) -> None:
        """Add ``receiver`` (once: ``ready()`` may run again in a test process)."""
        if receiver not in self.receivers:
            self.receivers.append(receiver)

    def send(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Every receiver's answer, in the order they were connected."""
        return [receiver(*args, **kwargs) for receiver in self.receivers]

    def first(self, *args: P.args, **kwargs: P.kwargs) -> R | None:
        """The first answer that is not None; the receivers after it are not called."""
        for receiver in self.receivers:
            answer = receiver(*args, **kwargs)
            if answer is not None:
                return answer
        return None

    def __repr__(self) -> str:
        return f"<Hook {self.name}: {len(self.receivers)} receivers>"


# A sandbox's status is about to change: (the locked row, the new status, now). Called inside
# the transition's transaction; each receiver returns fields to write with the new status.
status_changing: Hook[[Sandbox, str, datetime], dict[str, Any]] = Hook("status_changing")

# A sandbox's status changed in this process: (sandbox id, the new status). Called once the
# transition's own atomic block has ended (inside the caller's transaction, if it has one).
status_changed: Hook[[str, str], None] = Hook("status_changed")

# On its node, a sandbox has just started or restarted (its row is now running).
sandbox_started: Hook[[Sandbox], None] = Hook("sandbox_started")

# A create is about to start a new sandbox: a receiver may hand over one already started
# instead (a warm pool's member), claimed for the caller. Keyword arguments: see
# ``runtime.services.pools.pool_claim``.
sandbox_claim: Hook[..., Sandbox | None] = Hook("sandbox_claim")

# Of these sandbox ids, those at work that expiry and idleness must not pause (a harness's run
# going): each receiver answers a set of them.
sandboxes_busy: Hook[[list[str]], set[str]] = Hook("sandboxes_busy")

# The stream bridge recorded the end of a live process: ``exec_id``, its ``Exec`` row's id.
process_ended: Hook[..., None] = Hook("process_ended")
