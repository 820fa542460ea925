"""Checks of a request's size and names that more than one service makes: the runtime a
sandbox asks for, its metadata, a command's size against what the runtime can carry."""

from __future__ import annotations

import json
import re
from typing import Any

from django.conf import settings

from ..errors import InvalidValue
from ..launchers.base import command_bytes
from ..launchers.registry import launcher_names
from ..models import Node


def validate_runtime(runtime: str) -> str:
    """A runtime this install has a launcher for. (One that no node runs, or none with room,
    is refused when the sandbox is scheduled: a 503.)"""
    names = launcher_names()
    if runtime not in names:
        raise InvalidValue(
            f"unknown runtime {runtime!r}; this install has: {', '.join(names)}", runtimes=names
        )
    return runtime


def validate_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    """Metadata small enough to come back in every list: at most HANGAR_METADATA_MAX_BYTES of JSON."""
    metadata = metadata or {}
    limit = settings.HANGAR_METADATA_MAX_BYTES
    size = len(
        json.dumps(metadata, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    )
    if size > limit:
        raise InvalidValue(
            f"metadata is {size} bytes of JSON; at most {limit} (HANGAR_METADATA_MAX_BYTES)", limit=limit
        )
    return metadata


def validate_command_size(
    *, node: Node | None, runtime: str, argv: list[str], env: dict[str, str], cwd: str | None
) -> None:
    """Refuse a command too large for the runtime to hand to the sandbox (the agent takes one
    1 MiB frame), before anything is started or written. The limit is what ``node`` (the
    sandbox's) advertises for the runtime."""
    limit = (node.launchers or {}).get(runtime, {}).get("max_command_bytes") if node is not None else None
    if limit is None:
        return
    size = command_bytes(argv, env, cwd)
    if size > limit:
        raise InvalidValue(
            f"the command's argv, environment (the sandbox's, its secrets and this call's) and cwd come to "
            f"{size} bytes; the {runtime} runtime takes at most {limit} per command: pass large data on "
            "stdin or in a file",
            limit=limit,
        )


def validate_env(env: dict[str, str]) -> None:
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise InvalidValue(
                f"env name {key!r} is not a valid variable name (letters, digits, _; not starting with a digit)"
            )
        if "\0" in value:
            raise InvalidValue(f"env value of {key} contains a NUL byte")


def validate_limits(*, cpu: float, memory_mb: int, timeout_s: int) -> None:
    max_cpu = settings.HANGAR_SANDBOX_MAX_CPU
    if not 0.1 <= cpu <= max_cpu:
        raise InvalidValue(f"cpu must be between 0.1 and {max_cpu:g}, got {cpu:g}")
    lo, hi = settings.HANGAR_SANDBOX_MIN_MEMORY_MB, settings.HANGAR_SANDBOX_MAX_MEMORY_MB
    if not lo <= memory_mb <= hi:
        raise InvalidValue(f"memory_mb must be between {lo} and {hi}, got {memory_mb}")
    max_t = settings.HANGAR_SANDBOX_MAX_TIMEOUT_S
    if not 1 <= timeout_s <= max_t:
        raise InvalidValue(f"timeout_s must be between 1 and {max_t}, got {timeout_s}")


# A node_selector's labels: Kubernetes' shape, kept small (each one is a condition on every
# placement, and the sandbox's JSON carries them).
SELECTOR_MAX_LABELS = 16
LABEL_MAX_CHARS = 63
_LABEL_CHARS = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?")


def validate_node_selector(selector: Any) -> dict[str, str]:
    """``{"label": "value", …}``: at most 16 labels, each key 1–63 characters and each value up
    to 63, letters, digits and ``-_./`` (starting and ending with a letter or digit), or a 422."""
    if selector is None:
        return {}
    if not isinstance(selector, dict):
        raise InvalidValue('node_selector must be an object of labels: {"label": "value", …}')
    if len(selector) > SELECTOR_MAX_LABELS:
        raise InvalidValue(f"node_selector has {len(selector)} labels; at most {SELECTOR_MAX_LABELS}")
    for key, value in selector.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidValue(f"node_selector: label {key!r} must have a string value, got {value!r}")
        if not 1 <= len(key) <= LABEL_MAX_CHARS or not _LABEL_CHARS.fullmatch(key):
            raise InvalidValue(
                f"node_selector: label name {key[:80]!r} must be 1-{LABEL_MAX_CHARS} letters, digits or -_./, "
                "starting and ending with a letter or digit"
            )
        if len(value) > LABEL_MAX_CHARS or (value and not _LABEL_CHARS.fullmatch(value)):
            raise InvalidValue(
                f"node_selector: the value of {key!r} must be up to {LABEL_MAX_CHARS} letters, digits or -_./, "
                "starting and ending with a letter or digit"
            )
    return dict(selector)
