"""Template filters of the dashboard."""

from __future__ import annotations

from django import template

from runtime.services.previews import Preview, previews_of

register = template.Library()


@register.filter
def previews(sandbox) -> list[Preview]:  # type: ignore[no-untyped-def]
    """The sandbox's preview URLs (private ones with a fresh signed token)."""
    return previews_of(sandbox)
