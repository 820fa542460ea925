"""Moving a paused sandbox to another node (a drain moves what can move): the copy of its
files between the nodes, and the node halves of the move.

The node it moves to pulls: its worker (the ``move_in`` task) opens a TCP connection to the
source node's tunnel port (``HANGAR_TUNNEL_PORT``, the one preview URLs use between machines,
:mod:`.tunnels`) and sends one line of JSON, ``{"move": SANDBOX, "expires", "sig"}``, signed
with HMAC-SHA256 under a key derived from the ``SECRET_KEY`` every machine of a Hangar shares
(valid for 30 s). The source node's bridge checks it and that the sandbox is paused there, and
answers ``OK`` then the files its launcher names (:meth:`Launcher.paused_files`: a checkpoint,
a disk), each as a line of JSON ``{"path", "size"}`` followed by its data extents only (a 10 GB
disk that holds 40 MB sends 40 MB): an extent is ``offset`` and ``length`` (8 bytes each,
big-endian) and its bytes, and a zero length ends the file; ``{"end": true}`` ends the stream.
Or ``ERR <reason>``.

The copy lands in the launcher's :meth:`~Launcher.incoming_dir`; then one conditional update
makes the row this node's, if it is still paused on the source (a resume or a delete that came
meanwhile wins, and the copy is dropped), and the launcher adopts the copy. The source node is
then told to forget its own (``moved_away``); its reconciliation would, too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import shutil
import socket
import struct
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

from django.conf import settings

log = logging.getLogger(__name__)
VALID_S = 30
EXTENT = struct.Struct(">QQ")
CHUNK = 1 << 20
# The names a launcher's paused files may have: a checkpoint's files and a disk image.
NAME = re.compile(r"^(checkpoint/[A-Za-z0-9][A-Za-z0-9._-]{0,100}|disk/disk\.ext4)$")
MAX_FILE_BYTES = 1 << 40
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0


class MoveError(Exception):
    pass


# -- the request --------------------------------------------------------------------------------


def _sig(sandbox_id: str, expires: int) -> str:
    key = hashlib.sha256(b"hangar.move:" + settings.SECRET_KEY.encode()).digest()
    return hmac.new(key, f"{sandbox_id}:{expires}".encode(), hashlib.sha256).hexdigest()


def request_line(sandbox_id: str) -> bytes:
    expires = int(time.time()) + VALID_S
    return (
        json.dumps({"move": sandbox_id, "expires": expires, "sig": _sig(sandbox_id, expires)}).encode()
        + b"\n"
    )


def check_request(body: dict[str, Any]) -> str:
    """The sandbox id of a move request (a tunnel line's JSON), or ValueError."""
    sandbox_id, expires = str(body["move"]), int(body["expires"])
    if not hmac.compare_digest(str(body.get("sig", "")), _sig(sandbox_id, expires)):
        raise ValueError("bad signature")
    if not time.time() <= expires <= time.time() + VALID_S + 5:
        raise ValueError("expired")
    return sandbox_id


# -- the stream ---------------------------------------------------------------------------------


def _extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of each run of data in the file; its holes are left out."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole from here on
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end - start
        offset = end


def encode(files: list[tuple[str, Path]]) -> Iterator[bytes]:
    """The stream of ``files`` ((name, path) each), in pieces of at most about 1 MB."""
    for name, path in files:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            yield json.dumps({"path": name, "size": size}).encode() + b"\n"
            for start, length in _extents(fd, size):
                yield EXTENT.pack(start, length)
                done = 0
                while done < length:
                    data = os.pread(fd, min(CHUNK, length - done), start + done)
                    if not data:
                        raise MoveError(f"{name} shrank while it was being sent")
                    yield data
                    done += len(data)
            yield EXTENT.pack(0, 0)
        finally:
            os.close(fd)
    yield b'{"end": true}\n'


def decode(stream: Any, into: Path) -> list[str]:
    """Write the files of a stream (a binary file object) under ``into`` (which must not exist
    yet), sparse as they were; their names. Refuses names other than a launcher's own."""
    into.mkdir(parents=True, mode=0o700)
    names: list[str] = []
    while True:
        line = stream.readline(4096)
        if not line.endswith(b"\n"):
            raise MoveError("the stream ended before its end")
        head = json.loads(line)
        if head.get("end"):
            return names
        name, size = str(head["path"]), int(head["size"])
        if not NAME.match(name) or ".." in name or name in names:
            raise MoveError(f"a file the stream may not hold: {name!r}")
        if not 0 <= size <= MAX_FILE_BYTES:
            raise MoveError(f"{name}: a size out of range")
        path = into / name
        path.parent.mkdir(exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            while True:
                start, length = EXTENT.unpack(_exactly(stream, EXTENT.size))
                if length == 0:
                    break
                if start + length > size:
                    raise MoveError(f"{name}: data past its size")
                done = 0
                while done < length:
                    data = stream.read(min(CHUNK, length - done))
                    if not data:
                        raise MoveError("the stream ended before its end")
                    os.pwrite(fd, data, start + done)
                    done += len(data)
            os.fsync(fd)
        finally:
            os.close(fd)
        names.append(name)


def _exactly(stream: Any, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise MoveError("the stream ended before its end")
    return bytes(data)


# -- the source node's side (its bridge) ---------------------------------------------------------


async def serve(body: dict[str, Any], writer: asyncio.StreamWriter, node_name: str) -> None:
    """Answer a move request read by the tunnel listener (:func:`.tunnels._handle`)."""
    from asgiref.sync import sync_to_async

    from ..models import Sandbox
    from .local import launcher_for

    try:
        sandbox_id = check_request(body)
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("move request from %s refused: %s", writer.get_extra_info("peername"), exc)
        writer.write(b"ERR a bad move request\n")
        return
    runtime = await sync_to_async(
        lambda: Sandbox.objects.filter(id=sandbox_id, node__name=node_name, status=Sandbox.Status.PAUSED)
        .values_list("runtime", flat=True).first(), thread_sensitive=False,
    )()  # fmt: skip
    if not runtime:
        writer.write(f"ERR sandbox {sandbox_id} is not paused on node {node_name}\n".encode())
        return
    pieces = _pieces(launcher_for(runtime), sandbox_id)
    started, sent = time.monotonic(), 0
    try:
        first = await asyncio.to_thread(next, pieces, None)  # its files, whole and still, or why not
        writer.write(b"OK\n")
        piece = first
        while piece is not None:
            writer.write(piece)
            sent += len(piece)
            await writer.drain()
            piece = await asyncio.to_thread(next, pieces, None)
        log.info(
            "sandbox %s sent for its move: %d MB in %.2f s",
            sandbox_id,
            sent >> 20,
            time.monotonic() - started,
        )
    except MoveError as exc:
        writer.write(f"ERR {exc}\n".encode())
    except (OSError, ConnectionError) as exc:
        log.warning("sending sandbox %s for its move failed: %s", sandbox_id, exc)
    finally:
        await asyncio.to_thread(pieces.close)  # its lock, held by the thread that took it


def _pieces(launcher: Any, sandbox_id: str) -> Generator[bytes, None, None]:
    from ..launchers.base import LauncherError

    try:
        with launcher.paused_files(sandbox_id) as files:
            yield from encode(files)
    except LauncherError as exc:
        raise MoveError(str(exc)) from None


# -- the node it moves to --------------------------------------------------------------------------


def pull(address: str, sandbox_id: str, into: Path) -> list[str]:
    """Copy the paused sandbox's files from the node whose tunnel listens at ``address``."""
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
    except (OSError, ValueError) as exc:
        raise MoveError(f"cannot reach node's tunnel at {address}: {exc}") from None
    with contextlib.closing(sock):
        sock.settimeout(READ_TIMEOUT_S)
        sock.sendall(request_line(sandbox_id))
        with sock.makefile("rb", buffering=CHUNK) as stream:
            try:
                answer = stream.readline(4096).decode(errors="replace").strip()
                if answer != "OK":
                    raise MoveError(answer.removeprefix("ERR ") or "the node closed the connection")
                return decode(stream, into)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                shutil.rmtree(into, ignore_errors=True)
                raise MoveError(f"copying from {address} failed: {exc}") from None
            except MoveError:
                shutil.rmtree(into, ignore_errors=True)
                raise


# -- the tasks' bodies ---------------------------------------------------------------------------


def node_sandbox_move_in(*, sandbox_id: str, from_node: str) -> bool:
    """Move the sandbox, paused on ``from_node``, to this node (the ``move_in`` task): copy its
    files, make the row this node's if it is still paused there, adopt the copy and tell the
    source to forget its own. Whether it moved; a move that fails leaves it where it was, with
    an event that says why."""
    from django.db import transaction
    from django.utils import timezone

    from .. import enqueue
    from ..lifecycle import record_event
    from ..models import Node, Sandbox
    from .local import launcher_for, local_node_name

    paused = Sandbox.Status.PAUSED
    row = (
        Sandbox.objects.filter(id=sandbox_id, status=paused, node__name=from_node)
        .select_related("node")
        .first()
    )
    here = Node.objects.filter(name=local_node_name()).first()
    if row is None or row.node is None or here is None or row.node_id == here.id:
        return False
    source = row.node
    launcher = launcher_for(row.runtime)
    into = launcher.incoming_dir(sandbox_id)
    shutil.rmtree(into, ignore_errors=True)  # an earlier try's
    started = time.monotonic()
    try:
        if not source.tunnel_address:
            raise MoveError(
                f"node {source.name} takes no connections from other nodes (no HANGAR_TUNNEL_PORT)"
            )
        names = pull(source.tunnel_address, sandbox_id, into)
    except MoveError as exc:
        log.warning("sandbox %s could not move from %s to %s: %s", sandbox_id, source.name, here.name, exc)
        record_event(sandbox_id, "move_failed", f"could not move to node {here.name}: {exc}; it stays paused on "
                     f"node {source.name}", node=source.name, to=here.name)  # fmt: skip
        return False
    size = sum(p.stat().st_blocks * 512 for p in into.rglob("*") if p.is_file())
    took = time.monotonic() - started
    with transaction.atomic():
        moved = Sandbox.objects.filter(id=sandbox_id, status=paused, node=source).update(
            node=here, updated_at=timezone.now()
        )
        if moved:
            what = " and ".join(sorted({n.split("/")[0] for n in names})) or "nothing (it kept no files)"
            record_event(sandbox_id, "moved", f"moved from node {source.name} to node {here.name}: "
                         f"{what} copied ({size >> 20} MB in {took:.1f} s)",
                         node=here.name, frm=source.name, bytes=size, seconds=round(took, 3))  # fmt: skip
    if not moved:  # resumed or deleted meanwhile: it stays where it was
        shutil.rmtree(into, ignore_errors=True)
        return False
    launcher.adopt(sandbox_id)
    with contextlib.suppress(Exception):  # the source's reconciliation forgets it too
        enqueue.send("moved_away", [sandbox_id], queue=source.queue)
    log.info(
        "sandbox %s moved from %s to %s (%d MB in %.2f s)",
        sandbox_id,
        source.name,
        here.name,
        size >> 20,
        took,
    )
    return True


def node_sandbox_moved_away(*, sandbox_id: str) -> bool:
    """Forget this node's copy of a sandbox that now lives on another node (the ``moved_away``
    task); a sandbox whose row still says this node is left alone."""
    from ..models import Sandbox
    from .local import launcher_for, local_node_name

    row = Sandbox.objects.filter(id=sandbox_id).select_related("node").first()
    if row is None or (row.node is not None and row.node.name == local_node_name()):
        return False
    launcher = launcher_for(row.runtime)
    launcher.destroy(launcher.handle_for(sandbox_id))
    return True
