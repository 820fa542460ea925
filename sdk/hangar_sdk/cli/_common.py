"""What every ``hangar`` command shares: the connection (made on first use, from the flags,
the environment or ``hangar login``), output as a table or as exactly one JSON document, the
NDJSON output streams, and one-line errors."""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, NoReturn

from .. import _api as api
from .._errors import HangarError
from .._transport import Config, Transport


class CliError(Exception):
    """A message for the user (one line, no traceback) and the status to exit with."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def fail(message: str, code: int = 1) -> NoReturn:
    raise CliError(message, code)


def say(message: str) -> None:
    """Progress and messages: to stderr, so stdout stays the command's answer."""
    print(message, file=sys.stderr, flush=True)


_transport: Transport | None = None


def connect(args: argparse.Namespace | None = None) -> Transport:
    """The transport to the server (one per process), from ``--url``/``--token``, else
    ``HANGAR_URL``/``HANGAR_TOKEN``, else what ``hangar login`` stored."""
    global _transport
    if _transport is None:
        url = getattr(args, "url", None) if args is not None else None
        token = getattr(args, "token", None) if args is not None else None
        _transport = Transport(Config.resolve(url, token))
    return _transport


def reset() -> None:
    """Forget the connection (tests call ``main`` more than once in a process)."""
    global _transport
    if _transport is not None:
        _transport.close()
    _transport = None


def call(args: argparse.Namespace, request: api.Call) -> Any:
    return connect(args).json(request)


# -- output -------------------------------------------------------------------------------------


def emit_json(value: Any) -> None:
    """The answer as exactly one JSON document on stdout (for ``--json``)."""
    json.dump(value, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    sys.stdout.flush()


def ago(value: str | None, now: datetime | None = None) -> str:
    """``3m ago`` / ``in 5m`` for an ISO time from the API; ``-`` for none."""
    if not value:
        return "-"
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return value
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)  # noqa: UP017 (the SDK runs on 3.10)
    seconds = ((now or datetime.now(timezone.utc)) - when).total_seconds()  # noqa: UP017
    span = abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if span >= size:
            text = f"{int(span // size)}{unit}"
            break
    else:
        text = f"{int(span)}s"
    return f"{text} ago" if seconds >= 0 else f"in {text}"


def table(rows: Iterable[Sequence[Any]], headers: Sequence[str]) -> None:
    """Columns as wide as their widest cell, the last one left ragged."""
    cells = [[str(h) for h in headers], *[["-" if c is None or c == "" else str(c) for c in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        line = "  ".join(c.ljust(widths[i]) if i < len(row) - 1 else c for i, c in enumerate(row))
        print(line.rstrip())
    sys.stdout.flush()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def pairs(items: Sequence[str] | None, what: str) -> dict[str, str]:
    """``K=V`` arguments as a dict; a malformed one is a clear error."""
    out: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"{what} must be KEY=VALUE, not {item!r}", 2)
        out[key] = value
    return out


# -- streams of NDJSON events -------------------------------------------------------------------


def pump(lines: Iterable[str], *, all_to_stderr: bool = False) -> dict[str, Any] | None:
    """Write a command's streamed output as it comes (stdout to stdout, stderr to stderr, as
    bytes: nothing is kept; both to stderr with ``all_to_stderr``, when stdout is for JSON)
    and return its exit event (None if the stream ended without)."""
    outs = {"stdout": sys.stderr.buffer if all_to_stderr else sys.stdout.buffer, "stderr": sys.stderr.buffer}
    end: dict[str, Any] | None = None
    for line in lines:
        if not line.strip():
            continue
        event = api.parse_event(line)
        kind = event.get("type")
        if kind in outs:
            data = event.get("data", "")
            raw = base64.b64decode(data) if event.get("encoding") == "base64" else str(data).encode()
            outs[kind].write(raw)
            outs[kind].flush()
        elif kind == "exit":
            end = event
        elif kind == "run":
            end = {**event, "_run": True}
        elif kind == "error":
            raise HangarError(f"the stream failed: {event.get('message', '')}")
    return end


def exit_status(event: Mapping[str, Any] | None) -> int:
    """A shell's exit status for a command's exit event: its code, 128+N for signal N, 124
    for a timeout (as ``timeout(1)``). Why a command ended without a status of its own (its
    node's bridge stopped, the process is gone) is said on stderr: 128 alone says nothing."""
    if event is None:
        fail("the output stream ended before the command did")
    if event.get("error"):
        say(f"hangar: {event['error']}")
    if event.get("timed_out"):
        say("hangar: the command timed out")
        return 124
    code = event.get("exit_code")
    if code is None:
        return 128 + int(event.get("signal") or 0)
    return int(code) & 0xFF if int(code) >= 0 else 128 + (-int(code) & 0x7F)
