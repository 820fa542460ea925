"""Checks of a request's size and names that more than one service makes: the runtime a
sandbox asks for, its metadata, a command's size against what the runtime can carry."""

from __future__ import annotations

import json
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
