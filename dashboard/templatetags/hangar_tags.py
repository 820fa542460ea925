"""Template filters of the dashboard."""

from __future__ import annotations

from typing import Any

from django import template

from runtime.models import Sandbox
from runtime.services.previews import Preview, previews_of
from runtime.services.sandboxes import sandboxes_stats_cached

register = template.Library()


@register.filter
def previews(sandbox) -> list[Preview]:  # type: ignore[no-untyped-def]
    """The sandbox's preview URLs (private ones with a fresh signed token)."""
    return previews_of(sandbox)


@register.filter
def usage_sample(sandbox) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The running sandbox's last usage sample (memory and disk used; see the stats sampler),
    or {} when it is not running or has none yet."""
    if sandbox.status != Sandbox.Status.RUNNING:
        return {}
    return sandboxes_stats_cached(ids=[sandbox.id]).get(sandbox.id) or {}
