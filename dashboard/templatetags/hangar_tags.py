"""Template filters of the dashboard."""

from __future__ import annotations

from typing import Any

from django import template

from runtime.models import Sandbox
from runtime.services.previews import Preview, previews_of
from runtime.services.sandbox_io import sandboxes_stats_cached

register = template.Library()


@register.filter
def previews(sandbox) -> list[Preview]:
    """The sandbox's preview URLs (private ones with a fresh signed token)."""
    return previews_of(sandbox)


@register.filter
def usage_sample(sandbox) -> dict[str, Any]:
    """The running sandbox's last usage sample (memory and disk used; see the stats sampler),
    or {} when it is not running or has none yet."""
    if sandbox.status != Sandbox.Status.RUNNING:
        return {}
    return sandboxes_stats_cached(ids=[sandbox.id]).get(sandbox.id) or {}


@register.filter
def runtimes_said(launchers: dict[str, dict[str, bool]] | None) -> str:
    """A node's runtimes, each with what its sandboxes cannot have and, for microvm, whether it has
    KVM: "gvisor, microvm (no network, no checkpoint, emulated: no KVM)"."""
    from dashboard.pages.forms import runtime_notes

    out = []
    for name, caps in sorted((launchers or {}).items()):
        notes = runtime_notes(caps)
        out.append(f"{name} ({', '.join(notes)})" if notes else name)
    return ", ".join(out)
