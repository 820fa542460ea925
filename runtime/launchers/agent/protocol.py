"""The wire protocol of ``hangar-agent``, the guest agent that runs as PID 1 in every sandbox
of an agent-based launcher (see client.py for the client, transport.py for how it is reached).

Protocol. Every message is a frame: 1 byte type (an ASCII letter), a 4-byte big-endian payload
length, the payload (at most 1 MiB). One connection carries one request: the client's first
frame. Request payloads and most reply payloads are ``key=value\\0`` fields (see
:func:`encode_fields`). Replies: ``K`` ok (with fields), ``F`` failure (``errno``, ``message``).

===========  ============================================  ===================================
request      fields                                        reply
===========  ============================================  ===================================
``P`` ping   (none)                                        ``K`` version, pid
``E`` exec   arg (repeated), env (``NAME=VALUE``,          ``F``, or ``S`` pid, then ``O``
             repeated), cwd, timeout_ms, tty, rows, cols,  stdout / ``R`` stderr bytes, then
             stdin, detach                                 ``X`` code, signal, timed_out
             (or ``H``: detached, see below)
``R`` read   path, offset, length, no_pseudo_fs            ``T`` stat, ``D`` data..., ``K``
``W`` write  path, mode, mkdirs, append; then ``D`` data   ``K`` size
             frames and a final ``C``
``L`` list   path, no_pseudo_fs                            ``N`` per entry, then ``K``
``M`` mkdir  path, mode                                    ``K``
``D`` delete path, recursive                               ``K``
``S`` stat   path, no_pseudo_fs                            ``K`` type, size, mode, mtime
``Q`` quiesce (none)                                       ``K`` once every connection is
                                                           closed; then the agent closes
``A`` attach pid (of a detached command)                   ``S`` pid, then as ``E`` goes on
``T`` tunnel port (TCP, on the sandbox's loopback)              ``K``, then raw bytes both ways
===========  ============================================  ===================================

While an exec runs the client may send ``I`` stdin bytes, ``C`` close stdin, ``Z`` resize
(rows, cols) and ``G`` signal (sig, sent to the command's process group). Hanging up kills the
command's process group. Paths must be absolute. Standard library only.

``no_pseudo_fs=1`` (read, list, stat) refuses, with errno ``EPSEUDOFS``, a path that is on
procfs or sysfs or passes through them (the agent resolves it itself, checking every step); an
agent that enforced it says ``no_pseudo_fs=1`` in its ``T`` or ``K`` reply, and an answer
without it (an agent older than the check) is refused here. Everything the agent sends is
untrusted (the sandbox can replace it): frame lengths, sizes and names are checked, and a
malformed answer is an :class:`AgentError`, never a hang or an unbounded allocation.

Checkpoints: gVisor cannot save a host socket, so before one the client sends ``Q``. The agent
stops listening; every exec opened with ``detach=1`` sends ``H`` and closes its connection while
its command runs on (its output waits in the pipe); every other exec ends. After the restore
the host sends the agent SIGUSR2 (``runsc kill ID USR2``) to listen again, and ``A`` picks a
detached command's stream up where it stopped.
"""

from __future__ import annotations

import math
import select
import socket
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

PROTOCOL_VERSION = 1
MAX_PAYLOAD = 1 << 20
DATA_CHUNK = 256 * 1024
# The errno name of a path refused under ``no_pseudo_fs``.
PSEUDO_FS_REFUSED = "EPSEUDOFS"
FILE_TYPES = frozenset({"file", "dir", "symlink", "other"})

_HEADER = struct.Struct(">cI")

FieldValue = str | bytes | int | bool
Fields = Mapping[str, FieldValue] | Iterable[tuple[str, FieldValue]]


class AgentError(Exception):
    """The agent could not be talked to: connection lost, timeout, or a malformed frame."""


class AgentUnavailable(AgentError):
    """Nothing accepts connections on the agent's socket (missing, refused, or not yet up)."""


class AgentDetached(AgentError):
    """The agent let go of a running command's connection for a checkpoint; the command goes
    on, and :meth:`AgentProcess.reattach` picks its stream up again once the agent listens."""


class AgentFileError(AgentError):
    """The agent refused or failed the operation (an ``F`` reply), e.g. ``ENOENT``."""

    def __init__(self, errno_name: str, message: str) -> None:
        super().__init__(f"{errno_name}: {message}")
        self.errno_name = errno_name
        self.message = message


@dataclass(frozen=True)
class ExitInfo:
    """How a command ended: ``code`` is the exit status, 128+signal if killed, -1 on timeout."""

    code: int
    signal: int
    timed_out: bool


@dataclass(frozen=True)
class FileStat:
    type: str  # "file", "dir", "symlink" or "other"
    size: int
    mode: int  # permission bits
    mtime: float


@dataclass(frozen=True)
class DirEntry:
    name: str
    path: str
    type: str
    size: int
    mode: int
    mtime: float


# -- framing ------------------------------------------------------------------------------


def encode_frame(kind: bytes | str, payload: bytes | bytearray | memoryview = b"") -> bytes:
    """One frame: type letter, big-endian length, payload."""
    if isinstance(kind, str):
        kind = kind.encode("ascii")
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"frame payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return _HEADER.pack(kind, len(payload)) + bytes(payload)


def _field_bytes(value: FieldValue) -> bytes:
    if isinstance(value, bool):
        return b"1" if value else b"0"
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")  # round-trips os.fsdecode()d names
    return str(value).encode("ascii")


def encode_fields(fields: Fields) -> bytes:
    """``key=value\\0`` for each pair, in order; a key may repeat (lists). Values are raw bytes
    and may contain ``=``, but neither keys nor values may contain NUL."""
    items = fields.items() if isinstance(fields, Mapping) else fields
    parts = []
    for key, value in items:
        k = key.encode("ascii")
        v = _field_bytes(value)
        if b"\0" in v or b"\0" in k or b"=" in k or not k:
            raise ValueError(f"field {key!r} cannot be sent: keys need no '=' or NUL, values no NUL")
        parts.append(b"%s=%s\0" % (k, v))
    return b"".join(parts)


def decode_fields(payload: bytes | bytearray | memoryview) -> dict[str, str]:
    """The reverse of :func:`encode_fields` (a repeated key keeps its last value). Values that
    are not UTF-8 (file names) are decoded with surrogateescape, as ``os.fsdecode`` does."""
    out: dict[str, str] = {}
    for item in bytes(payload).split(b"\0"):
        if not item:
            continue
        key, sep, value = item.partition(b"=")
        if not sep:
            raise AgentError(f"malformed field {item[:80]!r} from the agent")
        out[key.decode("ascii", "replace")] = value.decode("utf-8", "surrogateescape")
    return out


def send_frame(sock: socket.socket, kind: bytes, payload: bytes | bytearray | memoryview = b"") -> None:
    if len(payload) > 65536:
        # Big payloads go as they are rather than copied behind a header.
        sock.sendall(_HEADER.pack(kind, len(payload)))
        sock.sendall(payload)
    else:
        sock.sendall(_HEADER.pack(kind, len(payload)) + bytes(payload))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError as exc:
            raise AgentError("timed out waiting for the agent") from exc
        except OSError as exc:
            raise AgentError(f"lost the connection to the agent: {exc}") from exc
        if k == 0:
            raise AgentError("the agent closed the connection")
        got += k
    return bytes(buf)


def read_frame(sock: socket.socket) -> tuple[bytes, bytes]:
    kind, length = _HEADER.unpack(recv_exact(sock, _HEADER.size))
    if not kind.isalpha() or length > MAX_PAYLOAD:
        raise AgentError(f"malformed frame from the agent (type {kind!r}, length {length})")
    return kind, recv_exact(sock, length) if length else b""


def file_error(payload: bytes) -> AgentFileError:
    fields = decode_fields(payload)
    return AgentFileError(fields.get("errno", "EIO"), fields.get("message", "the agent reported an error"))


def expect(kind: bytes, payload: bytes, wanted: bytes) -> dict[str, str]:
    if kind == wanted:
        return decode_fields(payload)
    if kind == b"F":
        raise file_error(payload)
    raise AgentError(f"unexpected {kind!r} frame from the agent (wanted {wanted!r})")


def stat_from(fields: Mapping[str, str]) -> FileStat:
    try:
        st = FileStat(fields["type"], int(fields["size"]), int(fields["mode"], 8), float(fields["mtime"]))
    except (KeyError, ValueError) as exc:
        raise AgentError(f"malformed stat reply from the agent: {dict(fields)}") from exc
    if (
        st.type not in FILE_TYPES or not 0 <= st.size < 1 << 63 or not 0 <= st.mode <= 0o7777
        or not math.isfinite(st.mtime)
    ):  # fmt: skip
        raise AgentError(f"malformed stat reply from the agent: {dict(fields)}")
    return st


def pseudo_fs_field(no_pseudo_fs: bool) -> list[tuple[str, FieldValue]]:
    return [("no_pseudo_fs", 1)] if no_pseudo_fs else []


def enforced(fields: Mapping[str, str], no_pseudo_fs: bool) -> Mapping[str, str]:
    """The reply, once it says the agent kept ``no_pseudo_fs`` if it was asked to."""
    if no_pseudo_fs and fields.get("no_pseudo_fs") != "1":
        raise AgentFileError(
            PSEUDO_FS_REFUSED,
            "this sandbox's agent is older than the check that keeps callers out of /proc and /sys, "
            "so nothing it sends is shown (a restart of the sandbox gives it the current agent)",
        )
    return fields


def readable_now(sock: socket.socket) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def chunks(
    data: bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview], size: int
) -> Iterator[memoryview]:
    pieces: Iterable[bytes | bytearray | memoryview] = (
        (data,) if isinstance(data, bytes | bytearray | memoryview) else data
    )
    for piece in pieces:
        view = memoryview(piece).cast("B")
        for start in range(0, len(view), size):
            yield view[start : start + size]
