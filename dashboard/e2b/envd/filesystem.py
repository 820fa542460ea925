"""envd's ``filesystem.Filesystem`` service on Hangar's sandbox file services
(:mod:`runtime.services.sandbox_io`): listings and stats from the sandbox's agent; making,
moving and removing as small commands (``mkdir``, ``mv``, ``rm``: the agent's file API has no
rename) run with their paths as arguments, never inside the script. Hangar's sandboxes run
commands as root, so a relative path is relative to /root, E2B's home directory of the user."""

from __future__ import annotations

import asyncio
import posixpath
import stat as stat_module
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.http import HttpRequest

from runtime.aio import blocking
from runtime.errors import NotFound, ServiceError
from runtime.launchers.base import FileEntry
from runtime.services import sandbox_io as io_svc
from runtime.services import spans

from . import users
from .protocol import Caller, RpcError, require_running, still_authorised

HOME = "/root"
_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
_MODE_BITS = {"file": stat_module.S_IFREG, "dir": stat_module.S_IFDIR, "symlink": stat_module.S_IFLNK}
MAX_LISTED = 10_000
WATCH_POLL_S = 0.5  # how often a watcher lists its directory again
# (exit code of the script, the Connect error it means)
_EXISTS, _MISSING = 17, 2
_MAKE_DIR = '[ -e "$1" ] && exit 17; mkdir -p -- "$1"'
_MOVE = '[ -e "$1" ] || [ -L "$1" ] || exit 2; mkdir -p -- "$(dirname -- "$2")" && mv -f -- "$1" "$2"'
_REMOVE = '[ -e "$1" ] || [ -L "$1" ] || exit 2; rm -rf -- "$1"'


def resolve(path: Any, home: str = HOME) -> str:
    """An absolute path: a relative one is under ``home`` (the acting user's: :func:`users.home`)."""
    if not isinstance(path, str) or not path:
        raise RpcError("invalid_argument", "path is empty")
    if "\0" in path:
        raise RpcError("invalid_argument", "path contains a NUL byte")
    return posixpath.normpath(posixpath.join(home, path)) if path != "/" else "/"


def entry_info(entry: FileEntry) -> dict[str, Any]:
    """An ``EntryInfo`` (proto JSON: int64 as a string, the time in RFC 3339)."""
    mode = entry.mode | _MODE_BITS.get(entry.type, 0)
    return {
        "name": entry.name, "type": _TYPES.get(entry.type, "FILE_TYPE_UNSPECIFIED"), "path": entry.path,
        "size": str(entry.size), "mode": entry.mode, "permissions": stat_module.filemode(mode),
        "owner": "", "group": "",
        "modifiedTime": datetime.fromtimestamp(entry.mtime, UTC).isoformat().replace("+00:00", "Z"),
    }  # fmt: skip


def _stat(caller: Caller, path: str) -> FileEntry:
    if path == "/":
        return FileEntry("/", "/", "dir", 0, 0o755, 0.0)
    parent, name = posixpath.split(path)
    try:
        entries = io_svc.sandbox_file_list(sandbox=caller.sandbox, path=parent)
    except NotFound:
        entries = []
    for entry in entries:
        if entry.name == name:
            return entry
    raise RpcError("not_found", f"no such file or directory: {path}")


def _run(caller: Caller, script: str, *paths: str) -> int:
    outcome = io_svc.sandbox_exec(
        sandbox=caller.sandbox, cmd=["/bin/sh", "-c", script, "sh", *paths], timeout_s=60
    )
    result = outcome.result
    if result.exit_code not in (0, _EXISTS, _MISSING):
        message = bytes(result.stderr).decode(errors="replace").strip() or f"exit code {result.exit_code}"
        raise RpcError("internal", message)
    return result.exit_code


def _call(fn: Any) -> Any:
    async def run(caller: Caller, message: dict[str, Any]) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            require_running(caller)
            return fn(caller, message)

        return await blocking(work)()

    return run


@_call
def stat(caller: Caller, message: dict[str, Any]) -> dict[str, Any]:
    return {"entry": entry_info(_stat(caller, resolve(message.get("path"), users.home(caller))))}


@_call
def make_dir(caller: Caller, message: dict[str, Any]) -> dict[str, Any]:
    path = resolve(message.get("path"), users.home(caller))
    if _run(caller, _MAKE_DIR, path) == _EXISTS:
        raise RpcError("already_exists", f"{path} already exists")
    users.hand_over(caller, [path])
    return {"entry": entry_info(_stat(caller, path))}


@_call
def move(caller: Caller, message: dict[str, Any]) -> dict[str, Any]:
    home = users.home(caller)
    source, destination = resolve(message.get("source"), home), resolve(message.get("destination"), home)
    if _run(caller, _MOVE, source, destination) == _MISSING:
        raise RpcError("not_found", f"no such file or directory: {source}")
    return {"entry": entry_info(_stat(caller, destination))}


@_call
def remove(caller: Caller, message: dict[str, Any]) -> dict[str, Any]:
    path = resolve(message.get("path"), users.home(caller))
    if _run(caller, _REMOVE, path) == _MISSING:
        raise RpcError("not_found", f"no such file or directory: {path}")
    return {}


def _listing(caller: Caller, path: str, depth: int) -> list[FileEntry]:
    """The entries under ``path`` down to ``depth`` levels, each directory's before its own."""
    try:
        entries = io_svc.sandbox_file_list(sandbox=caller.sandbox, path=path)
    except NotFound:
        raise RpcError("not_found", f"no such directory: {path}") from None
    except ServiceError as exc:
        if "ENOTDIR" in exc.message:
            raise RpcError("invalid_argument", f"{path} is not a directory") from None
        raise
    found: list[FileEntry] = []
    for entry in entries:
        found.append(entry)
        if entry.type == "dir" and depth > 1 and len(found) < MAX_LISTED:
            try:
                with spans.silenced():  # one span for the listing, not one per directory
                    found.extend(_listing(caller, entry.path, depth - 1))
            except RpcError:  # gone meanwhile, or unreadable: listed without its contents
                pass
        if len(found) >= MAX_LISTED:
            raise RpcError(
                "resource_exhausted", f"more than {MAX_LISTED} entries under {path}; list less deep"
            )
    return found


@_call
def list_dir(caller: Caller, message: dict[str, Any]) -> dict[str, Any]:
    path = resolve(message.get("path"), users.home(caller))
    depth = int(message.get("depth") or 1)
    return {"entries": [entry_info(e) for e in _listing(caller, path, depth)]}


# -- watchers: by polling the listing (the sandbox's agent has no inotify) ----------------------

Snapshot = dict[str, FileEntry]
# watcher id -> (directory, recursive, include entries, the last listing). Kept by this server process: a
# deployment with several replicas sends a watcher's calls to the one that made it.
_WATCHERS: dict[str, tuple[str, bool, bool, Snapshot]] = {}


def _snapshot(caller: Caller, path: str, recursive: bool) -> Snapshot:
    return {e.path: e for e in _listing(caller, path, 64 if recursive else 1)}


def _quiet_snapshot(caller: Caller, path: str, recursive: bool) -> Snapshot:
    """A watch's poll (WatchDir's, or a watcher's GetWatcherEvents, which an SDK polls): no span,
    or a watch would be a listing a second in the sandbox's traces."""
    with spans.silenced():
        return _snapshot(caller, path, recursive)


def _changes(root: str, before: Snapshot, after: Snapshot, with_entry: bool) -> list[dict[str, Any]]:
    """``FilesystemEvent``s between two listings: created, written (size or time changed), removed."""
    changed = [
        *((p, "EVENT_TYPE_CREATE") for p in sorted(after.keys() - before.keys())),
        *(
            (p, "EVENT_TYPE_WRITE")
            for p in sorted(before.keys() & after.keys())
            if (before[p].type, before[p].size, before[p].mtime)
            != (after[p].type, after[p].size, after[p].mtime)
        ),
        *((p, "EVENT_TYPE_REMOVE") for p in sorted(before.keys() - after.keys())),
    ]
    events = []
    for path, kind in changed:
        event: dict[str, Any] = {"name": posixpath.relpath(path, root), "type": kind}
        if with_entry and path in after:
            event["entry"] = entry_info(after[path])
        events.append(event)
    return events


@_call
def create_watcher(caller: Caller, message: dict[str, Any]) -> dict[str, Any]:
    path, recursive = resolve(message.get("path"), users.home(caller)), bool(message.get("recursive"))
    with_entry = bool(message.get("includeEntry"))
    if _stat(caller, path).type != "dir":
        raise RpcError("invalid_argument", f"{path} is not a directory")
    watcher_id = f"{caller.sandbox.id}.{uuid.uuid4().hex}"
    if len(_WATCHERS) >= 1000:
        raise RpcError("resource_exhausted", "too many watchers on this server; remove some")
    _WATCHERS[watcher_id] = (path, recursive, with_entry, _snapshot(caller, path, recursive))
    return {"watcherId": watcher_id}


def _watcher(caller: Caller, message: dict[str, Any]) -> tuple[str, tuple[str, bool, bool, Snapshot]]:
    watcher_id = str(message.get("watcherId") or "")
    found = _WATCHERS.get(watcher_id)
    if found is None or not watcher_id.startswith(f"{caller.sandbox.id}."):
        raise RpcError("not_found", f"watcher {watcher_id!r} not found")
    return watcher_id, found


@_call
def get_watcher_events(caller: Caller, message: dict[str, Any]) -> dict[str, Any]:
    watcher_id, (path, recursive, with_entry, before) = _watcher(caller, message)
    after = _quiet_snapshot(caller, path, recursive)
    _WATCHERS[watcher_id] = (path, recursive, with_entry, after)
    return {"events": _changes(path, before, after, with_entry)}


@_call
def remove_watcher(caller: Caller, message: dict[str, Any]) -> dict[str, Any]:
    watcher_id, _ = _watcher(caller, message)
    _WATCHERS.pop(watcher_id, None)
    return {}


async def watch_dir(
    caller: Caller, message: dict[str, Any], request: HttpRequest
) -> AsyncIterator[dict[str, Any]]:
    """``WatchDir``: a start, then the changes seen every :data:`WATCH_POLL_S`, a keepalive
    after ``HANGAR_STREAM_KEEPALIVE_S`` of quiet; until the client leaves or its access ends."""
    recursive = bool(message.get("recursive"))
    with_entry = bool(message.get("includeEntry"))

    def first() -> tuple[str, Snapshot]:
        require_running(caller)
        path = resolve(message.get("path"), users.home(caller))
        if _stat(caller, path).type != "dir":
            raise RpcError("invalid_argument", f"{path} is not a directory")
        return path, _snapshot(caller, path, recursive)

    path, before = await blocking(first)()
    yield {"start": {}}
    poll, quiet_since = WATCH_POLL_S, time.monotonic()
    while True:
        await asyncio.sleep(poll)
        why = await blocking(lambda: still_authorised(caller))()
        if why:
            raise RpcError("unauthenticated", f"access ended: {why}")
        after = await blocking(lambda: _quiet_snapshot(caller, path, recursive))()
        events = _changes(path, before, after, with_entry)
        before = after
        for event in events:
            yield {"filesystem": event}
        if events:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= settings.HANGAR_STREAM_KEEPALIVE_S:
            quiet_since = time.monotonic()
            yield {"keepalive": {}}
