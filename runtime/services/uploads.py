"""A file written into a sandbox from a stream of chunks, held in memory a part at a time
wherever the sandbox runs.

On the sandbox's own node the chunks go to its agent as they come (one write request, replaced
atomically at its end). For a sandbox on another node they travel through that node's queue in
parts of :data:`REMOTE_PART` bytes, which the node appends to a file of its own
(``$HANGAR_DATA_DIR/uploads``) and, at the end, streams into the sandbox the same way: a Celery
message holds one part, never the whole file. A node drops parts of an upload that never
finished after :data:`STALE_AFTER_S`.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from django.conf import settings

from ..errors import TooLarge

REMOTE_PART = 8 * 1024 * 1024
STALE_AFTER_S = 3600
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")

Chunks = bytes | bytearray | memoryview | Iterable[bytes]


def at_most(data: Chunks, limit: int) -> Iterator[bytes | bytearray | memoryview]:
    """``data``'s chunks, raising :class:`TooLarge` (413) once they add up to more than ``limit``
    (a write that stops there leaves the sandbox's file as it was)."""
    chunks = (data,) if isinstance(data, bytes | bytearray | memoryview) else data
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise TooLarge(f"file is larger than the {limit} byte limit (HANGAR_FILE_MAX_BYTES)")
        yield chunk


def _parts(chunks: Iterable[bytes | bytearray | memoryview], size: int) -> Iterator[bytes]:
    part = bytearray()
    for chunk in chunks:
        part += chunk
        while len(part) >= size:
            yield bytes(part[:size])
            del part[:size]
    if part:
        yield bytes(part)


def remote_write(path: str, chunks: Iterable[bytes | bytearray | memoryview],
                 call: Callable[[str, dict[str, Any]], dict[str, Any]]) -> int:  # fmt: skip
    """Write through the sandbox's node: ``call(op, payload)`` runs one node operation there."""
    upload = secrets.token_hex(16)
    try:
        sent = False
        for part in _parts(chunks, REMOTE_PART):
            call("write_part", {"upload": upload, "data": base64.b64encode(part).decode()})
            sent = True
        if not sent:  # an empty file: the commit makes it from nothing
            call("write_part", {"upload": upload, "data": ""})
        return int(call("write_commit", {"upload": upload, "path": path})["size"])
    except BaseException:
        with contextlib.suppress(Exception):
            call("write_abort", {"upload": upload})
        raise


# -- the node's side ------------------------------------------------------------------------


def _upload_path(upload: str) -> Path:
    if not _UPLOAD_ID.fullmatch(upload):
        raise ValueError(f"malformed upload id {upload!r}")
    return Path(settings.DATA_DIR) / "uploads" / upload


def node_upload_part(*, upload: str, data: str) -> None:
    """Append one part (base64) to the upload's file on this node."""
    path = _upload_path(upload)
    if not path.exists():
        path.parent.mkdir(mode=0o700, exist_ok=True)
        _drop_stale(path.parent)
    with open(path, "ab") as f:
        f.write(base64.b64decode(data))


def node_upload_commit(*, upload: str, write: Callable[[Iterator[bytes]], int]) -> int:
    """Stream the upload's file into the sandbox with ``write(chunks)``, then drop it."""
    path = _upload_path(upload)
    try:
        with open(path, "rb") as f:
            return write(iter(lambda: f.read(1024 * 1024), b""))
    finally:
        path.unlink(missing_ok=True)


def node_upload_abort(*, upload: str) -> None:
    _upload_path(upload).unlink(missing_ok=True)


def _drop_stale(directory: Path) -> None:
    cutoff = time.time() - STALE_AFTER_S
    for entry in os.scandir(directory):
        with contextlib.suppress(OSError):
            if entry.stat().st_mtime < cutoff:
                os.unlink(entry.path)
