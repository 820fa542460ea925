"""Rows of deleted sandboxes go after HANGAR_DELETED_RETENTION_DAYS, with what hangs off them
(real Postgres)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from runtime.models import Exec, Harness, Run, Sandbox, SandboxEvent, SandboxVolume, Team, Terminal, Volume
from runtime.services.retention import sandboxes_prune

S = Sandbox.Status


@pytest.fixture
def team(transactional_db):
    return Team.objects.create(name="t")


def _sandbox(team, status, stopped_days_ago=None, *, execs=0):
    sb = Sandbox.objects.create(team=team, image="x", image_digest="sha256:x", status=status)
    if stopped_days_ago is not None:
        Sandbox.objects.filter(id=sb.id).update(stopped_at=timezone.now() - timedelta(days=stopped_days_ago))
    SandboxEvent.objects.create(sandbox=sb, kind="status", status_to=status)
    Terminal.objects.create(sandbox=sb, name="t", argv=["sh"])
    Exec.objects.bulk_create(Exec(sandbox=sb, argv=["true"], started_at=timezone.now()) for _ in range(execs))
    return sb


def test_deleted_sandboxes_past_retention_go_with_their_rows_in_batches(team, settings):
    settings.HANGAR_DELETED_RETENTION_DAYS = 30
    old = [_sandbox(team, S.DELETED, 40, execs=3) for _ in range(5)]
    recent = _sandbox(team, S.DELETED, 10)
    stopped_long_ago = _sandbox(team, S.STOPPED, 400)  # kept: not deleted
    running = _sandbox(team, S.RUNNING)
    volume = Volume.objects.create(team=team, name="v", size_mb=16)
    SandboxVolume.objects.create(sandbox=old[0], volume=volume, mount_path="/data")
    harness = Harness.objects.create(team=team, name="h", agent="custom", sandbox=old[1], volume=volume)
    run = Run.objects.create(harness=harness, prompt="p", exec=old[1].execs.first())

    assert sandboxes_prune(batch=2) == 5
    kept = {recent.id, stopped_long_ago.id, running.id}
    assert set(Sandbox.objects.values_list("id", flat=True)) == kept
    assert set(SandboxEvent.objects.values_list("sandbox_id", flat=True)) == kept
    assert set(Terminal.objects.values_list("sandbox_id", flat=True)) == kept
    assert not Exec.objects.exists() and not SandboxVolume.objects.exists()
    # What pointed at them stays, pointing at nothing: the volume, the harness, its run.
    assert Volume.objects.filter(id=volume.id).exists()
    harness.refresh_from_db()
    run.refresh_from_db()
    assert harness.sandbox_id is None and run.exec_id is None
    assert sandboxes_prune() == 0


def test_retention_of_zero_days_keeps_deleted_sandboxes(team, settings):
    settings.HANGAR_DELETED_RETENTION_DAYS = 0
    sb = _sandbox(team, S.DELETED, 4000)
    assert sandboxes_prune() == 0
    assert Sandbox.objects.filter(id=sb.id).exists()


def test_pruning_runs_from_beat(settings):
    assert settings.CELERY_BEAT_SCHEDULE["sandboxes-prune"]["task"] == "runtime.tasks.sandboxes_prune"
    from runtime import tasks

    assert tasks.sandboxes_prune.name == "runtime.tasks.sandboxes_prune"
