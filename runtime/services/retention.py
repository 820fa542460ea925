"""How long what is deleted stays: a deleted sandbox keeps its row (readable, status
``deleted``) for HANGAR_DELETED_RETENTION_DAYS, then goes with its events, commands, terminals
and volume attachments."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from ..models import Exec, Sandbox, SandboxEvent, Terminal

BATCH = 100  # sandboxes per transaction
CHUNK = 1000  # dependent rows per delete: a sandbox may have run a great many commands
MAX_BATCHES = 50  # per call: a large backlog goes over several beats, not in one long task


def sandboxes_prune(*, now: datetime | None = None, batch: int = BATCH) -> int:
    """Delete the rows of sandboxes deleted more than HANGAR_DELETED_RETENTION_DAYS ago (0:
    none) and what hangs off them, a small batch at a time; returns how many sandboxes went."""
    days = settings.HANGAR_DELETED_RETENTION_DAYS
    if not days:
        return 0
    cutoff = (now or timezone.now()) - timedelta(days=days)
    expired = Sandbox.objects.filter(status=Sandbox.Status.DELETED).filter(
        Q(stopped_at__lt=cutoff) | Q(stopped_at__isnull=True, updated_at__lt=cutoff)
    )
    pruned = 0
    for _ in range(MAX_BATCHES):
        ids = list(expired.order_by("stopped_at").values_list("id", flat=True)[:batch])
        if not ids:
            break
        for model in (SandboxEvent, Exec, Terminal):
            _delete_in_chunks(model.objects.filter(sandbox_id__in=ids))
        with transaction.atomic():
            _, per_model = expired.filter(id__in=ids).delete()  # the rest cascades (attachments)
        pruned += per_model.get(Sandbox._meta.label, 0)
        if len(ids) < batch:
            break
    return pruned


def _delete_in_chunks(rows: QuerySet) -> None:
    while pks := list(rows.values_list("pk", flat=True)[:CHUNK]):
        rows.model.objects.filter(pk__in=pks).delete()
