"""Traces: spans and log records, ingested over OTLP or written by Hangar, per team.

A trace's spans arrive in any order and in many batches (an agent's exporter, Hangar's own);
:class:`Trace` is the trace's summary, kept up to date as they arrive, so that listing a team's
traces reads one row per trace. Times are nanoseconds since the epoch, as OTLP carries them.
Large values (prompts, tool results) are cut at ``HANGAR_TRACE_VALUE_BYTES`` in the attributes and
kept whole in :class:`TraceValue`."""

from __future__ import annotations

from django.db import models


class Trace(models.Model):
    team = models.ForeignKey("runtime.Team", on_delete=models.CASCADE, related_name="+")
    trace_id = models.CharField(max_length=32)  # lowercase hex
    root_name = models.CharField(max_length=255, blank=True)  # the span without a parent, once seen
    service = models.CharField(max_length=255, blank=True)  # the root's service, else the first seen
    span_count = models.IntegerField(default=0)
    error_count = models.IntegerField(default=0)
    start_ns = models.BigIntegerField()
    end_ns = models.BigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True, db_index=True)

    class Meta:
        app_label = "runtime"
        constraints = [models.UniqueConstraint(fields=["team", "trace_id"], name="trace_unique_per_team")]
        indexes = [models.Index(fields=["team", "-start_ns"], name="trace_team_start")]


class TraceSpan(models.Model):
    team = models.ForeignKey("runtime.Team", on_delete=models.CASCADE, related_name="+")
    trace_id = models.CharField(max_length=32)
    span_id = models.CharField(max_length=16)
    parent_span_id = models.CharField(max_length=16, blank=True)  # "" for a root
    name = models.CharField(max_length=255)
    kind = models.SmallIntegerField(default=0)  # OTLP's SpanKind: 0 unspecified … 5 consumer
    start_ns = models.BigIntegerField()
    end_ns = models.BigIntegerField()
    status_code = models.SmallIntegerField(default=0)  # 0 unset, 1 ok, 2 error
    status_message = models.TextField(blank=True)
    attributes = models.JSONField(default=dict)
    events = models.JSONField(default=list)
    links = models.JSONField(default=list)
    resource = models.JSONField(default=dict)
    scope = models.JSONField(default=dict)  # {"name", "version"}
    service = models.CharField(max_length=255, blank=True)
    # What the filters ask for, lifted from the span's or its resource's attributes.
    sandbox_id = models.CharField(max_length=32, blank=True)
    run_id = models.CharField(max_length=32, blank=True)
    harness_id = models.CharField(max_length=32, blank=True)

    class Meta:
        app_label = "runtime"
        indexes = [
            models.Index(fields=["team", "trace_id", "start_ns"], name="span_trace_start"),
            models.Index(fields=["team", "sandbox_id"], name="span_team_sandbox"),
            models.Index(fields=["team", "run_id"], name="span_team_run"),
            models.Index(fields=["team", "harness_id"], name="span_team_harness"),
        ]


class TraceLog(models.Model):
    """A log record: on its trace's timeline when it names one, else on its run's or sandbox's
    (from its resource's attributes)."""

    team = models.ForeignKey("runtime.Team", on_delete=models.CASCADE, related_name="+")
    trace_id = models.CharField(max_length=32, blank=True)
    span_id = models.CharField(max_length=16, blank=True)
    time_ns = models.BigIntegerField()
    severity_number = models.SmallIntegerField(default=0)
    severity_text = models.CharField(max_length=32, blank=True)
    body = models.JSONField(null=True)
    attributes = models.JSONField(default=dict)
    resource = models.JSONField(default=dict)
    service = models.CharField(max_length=255, blank=True)
    sandbox_id = models.CharField(max_length=32, blank=True)
    run_id = models.CharField(max_length=32, blank=True)
    harness_id = models.CharField(max_length=32, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        app_label = "runtime"
        indexes = [
            models.Index(fields=["team", "trace_id", "time_ns"], name="log_trace_time"),
            models.Index(fields=["team", "run_id"], name="log_team_run"),
            models.Index(fields=["team", "sandbox_id"], name="log_team_sandbox"),
        ]


class TraceValue(models.Model):
    """A value too large for a span's attributes, whole (the attribute holds its start and a
    ``hangar.truncated`` note naming this row)."""

    team = models.ForeignKey("runtime.Team", on_delete=models.CASCADE, related_name="+")
    trace_id = models.CharField(max_length=32)
    value = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        app_label = "runtime"
        indexes = [models.Index(fields=["team", "trace_id"], name="value_team_trace")]
