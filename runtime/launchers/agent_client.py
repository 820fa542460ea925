"""Client for ``hangar-agent``, the guest agent that runs as PID 1 in every sandbox.

The agent listens on a unix socket that the host reaches directly, so one exec or file
operation is one connection (a few ms) rather than a ``runsc exec`` process (~45 ms).

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
``R`` read   path, offset, length                          ``T`` stat, ``D`` data..., ``K``
``W`` write  path, mode, mkdirs, append; then ``D`` data   ``K`` size
             frames and a final ``C``
``L`` list   path                                          ``N`` per entry, then ``K``
``M`` mkdir  path, mode                                    ``K``
``D`` delete path, recursive                               ``K``
``S`` stat   path                                          ``K`` type, size, mode, mtime
``Q`` quiesce (none)                                       ``K`` once every connection is
                                                           closed; then the agent closes
``A`` attach pid (of a detached command)                   ``S`` pid, then as ``E`` goes on
``T`` tunnel port (TCP, on the sandbox's loopback)              ``K``, then raw bytes both ways
===========  ============================================  ===================================

While an exec runs the client may send ``I`` stdin bytes, ``C`` close stdin, ``Z`` resize
(rows, cols) and ``G`` signal (sig, sent to the command's process group). Hanging up kills the
command's process group. Paths must be absolute. This module uses only the standard library.

Checkpoints: gVisor cannot save a host socket, so before one the client sends ``Q``. The agent
stops listening; every exec opened with ``detach=1`` sends ``H`` and closes its connection while
its command runs on (its output waits in the pipe); every other exec ends. After the restore
the host sends the agent SIGUSR2 (``runsc kill ID USR2``) to listen again, and ``A`` picks a
detached command's stream up where it stopped.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

PROTOCOL_VERSION = 1
MAX_PAYLOAD = 1 << 20
DATA_CHUNK = 256 * 1024
# Stdin up to one frame is sent inline: the agent always takes a whole frame in, so a single
# frame cannot deadlock against output the client is not reading yet. More goes from a thread.
INLINE_STDIN = MAX_PAYLOAD
# How much longer than the command's own timeout the client waits on a silent socket.
EXEC_TIMEOUT_MARGIN = 5.0

# A listing is held in memory whole, from frames the sandbox sends: at most this many entries.
MAX_LIST_ENTRIES = 100_000
MAX_LIST_BYTES = 64 << 20

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


@dataclass
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    signal: int
    duration_ms: float
    pid: int
    truncated: bool


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


def _send_frame(sock: socket.socket, kind: bytes, payload: bytes | bytearray | memoryview = b"") -> None:
    if len(payload) > 65536:
        # Big payloads go as they are rather than copied behind a header.
        sock.sendall(_HEADER.pack(kind, len(payload)))
        sock.sendall(payload)
    else:
        sock.sendall(_HEADER.pack(kind, len(payload)) + bytes(payload))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
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


def _read_frame(sock: socket.socket) -> tuple[bytes, bytes]:
    kind, length = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if not kind.isalpha() or length > MAX_PAYLOAD:
        raise AgentError(f"malformed frame from the agent (type {kind!r}, length {length})")
    return kind, _recv_exact(sock, length) if length else b""


def _file_error(payload: bytes) -> AgentFileError:
    fields = decode_fields(payload)
    return AgentFileError(fields.get("errno", "EIO"), fields.get("message", "the agent reported an error"))


def _expect(kind: bytes, payload: bytes, wanted: bytes) -> dict[str, str]:
    if kind == wanted:
        return decode_fields(payload)
    if kind == b"F":
        raise _file_error(payload)
    raise AgentError(f"unexpected {kind!r} frame from the agent (wanted {wanted!r})")


def _stat_from(fields: Mapping[str, str]) -> FileStat:
    try:
        return FileStat(fields["type"], int(fields["size"]), int(fields["mode"], 8), float(fields["mtime"]))
    except (KeyError, ValueError) as exc:
        raise AgentError(f"malformed stat reply from the agent: {dict(fields)}") from exc


def _readable_now(sock: socket.socket) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _chunks(data: bytes | bytearray | memoryview | Iterable[bytes], size: int) -> Iterator[memoryview]:
    if isinstance(data, bytes | bytearray | memoryview):
        data = (data,)
    for piece in data:
        view = memoryview(piece).cast("B")
        for start in range(0, len(view), size):
            yield view[start : start + size]


# -- client -------------------------------------------------------------------------------


class AgentClient:
    """Talks to one agent. Cheap to create; holds no connection between calls, so one client
    may be used from several threads at once."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        connect_timeout: float = 5.0,
        io_timeout: float | None = 60.0,
    ) -> None:
        self.socket_path = os.fspath(socket_path)
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout  # for everything but exec's streams

    def __repr__(self) -> str:
        return f"AgentClient({self.socket_path!r})"

    # -- plumbing

    def _connect(self, timeout: float | None, connect_timeout: float | None = None) -> socket.socket:
        connect_timeout = self.connect_timeout if connect_timeout is None else connect_timeout
        deadline = time.monotonic() + connect_timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(connect_timeout)
            try:
                self._connect_path(sock)
            except BlockingIOError:
                # The listen backlog is full: the agent is busy, not gone.
                sock.close()
                if time.monotonic() >= deadline:
                    raise AgentUnavailable(
                        f"agent at {self.socket_path} is not accepting connections"
                    ) from None
                time.sleep(0.002)
                continue
            except (OSError, ValueError) as exc:
                sock.close()
                raise AgentUnavailable(f"cannot connect to the agent at {self.socket_path}: {exc}") from exc
            sock.settimeout(timeout)
            return sock

    def _connect_path(self, sock: socket.socket) -> None:
        # The socket's directory is one the sandbox writes in: never follow a symlink there
        # (it could aim at one of the host's own sockets), and connect only to a socket.
        # Connecting through /proc/self/fd also reaches a socket deeper than sun_path's 107 bytes.
        fd = os.open(self.socket_path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                raise ConnectionRefusedError(errno.ECONNREFUSED, f"{self.socket_path} is not a socket")
            sock.connect(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)

    def _request(self, kind: bytes, fields: Fields, timeout: float | None = None) -> socket.socket:
        payload = encode_fields(fields)
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(f"request of {len(payload)} bytes exceeds the agent's {MAX_PAYLOAD}")
        sock = self._connect(self.io_timeout if timeout is None else timeout)
        try:
            _send_frame(sock, kind, payload)
        except OSError as exc:
            sock.close()
            raise AgentError(f"lost the connection to the agent: {exc}") from exc
        return sock

    def _call(self, kind: bytes, fields: Fields = ()) -> dict[str, str]:
        """A request whose whole answer is one ``K`` (or ``F``) frame."""
        with contextlib.closing(self._request(kind, fields)) as sock:
            return _expect(*_read_frame(sock), b"K")

    # -- operations

    def ping(self) -> dict[str, str]:
        return self._call(b"P")

    def wait_listening(self, timeout: float) -> None:
        """Wait until the agent listens: its socket's path exists only then (it binds under a
        temporary name and renames it into place). No round trip, so the agent forks its first
        handlers while the caller goes on; a connection made meanwhile waits in the backlog.
        Raises :class:`AgentUnavailable` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if stat.S_ISSOCK(os.lstat(self.socket_path).st_mode):
                    return
            except OSError:
                pass
            if time.monotonic() >= deadline:
                raise AgentUnavailable(f"agent at {self.socket_path} was not listening within {timeout:g}s")
            time.sleep(0.001)

    def wait_ready(self, timeout: float) -> None:
        """Retry until the agent answers a ping, or raise :class:`AgentUnavailable`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                left = max(0.05, deadline - time.monotonic())
                with contextlib.closing(
                    self._connect(min(left, 2.0), connect_timeout=min(left, 2.0))
                ) as sock:
                    _send_frame(sock, b"P")
                    _expect(*_read_frame(sock), b"K")
                return
            except (AgentError, OSError) as exc:
                if time.monotonic() >= deadline:
                    raise AgentUnavailable(
                        f"agent at {self.socket_path} did not answer within {timeout:g}s: {exc}"
                    ) from exc
            time.sleep(0.002)  # the agent is usually up within a few ms of `runsc run` returning

    def open_process(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        tty: bool = False,
        rows: int = 24,
        cols: int = 80,
        stdin: bool = True,
        timeout: float | None = None,
        detachable: bool = False,
    ) -> AgentProcess:
        """Start a command and return its live connection. Raises :class:`AgentFileError` if it
        cannot start (``ENOENT`` for a missing binary or cwd). Close it (or use it as a context
        manager): hanging up kills the command's process group. A ``detachable`` command
        survives a checkpoint of the sandbox (see :meth:`quiesce`); its stream then raises
        :class:`AgentDetached`, and :meth:`AgentProcess.reattach` continues it."""
        io_timeout = None if timeout is None or timeout <= 0 else timeout + EXEC_TIMEOUT_MARGIN
        return self._open_process(argv, env, cwd, tty, rows, cols, stdin, timeout, io_timeout, detachable)

    def _open_process(
        self,
        argv: list[str],
        env: Mapping[str, str] | None,
        cwd: str | None,
        tty: bool,
        rows: int,
        cols: int,
        stdin: bool,
        timeout: float | None,
        io_timeout: float | None,
        detachable: bool = False,
    ) -> AgentProcess:
        if not argv:
            raise ValueError("argv must not be empty")
        fields: list[tuple[str, FieldValue]] = [("arg", a) for a in argv]
        for name, value in (env or {}).items():
            if not name or "=" in name:
                raise ValueError(f"invalid environment variable name {name!r}")
            fields.append(("env", f"{name}={value}"))
        if cwd:
            fields.append(("cwd", cwd))
        if timeout is not None and timeout > 0:
            fields.append(("timeout_ms", max(1, int(timeout * 1000 + 0.999))))
        if tty:
            fields += [("tty", 1), ("rows", rows), ("cols", cols)]
        if stdin:
            fields.append(("stdin", 1))
        if detachable:
            fields.append(("detach", 1))
        sock = self._request(b"E", fields, timeout=io_timeout)
        # A command may be silent for as long as it runs: without a timeout of its own, its
        # stream must not inherit the client's default for requests (None there means that).
        sock.settimeout(io_timeout)
        try:
            started = _expect(*_read_frame(sock), b"S")
            return AgentProcess(sock, int(started["pid"]), self, io_timeout)
        except (KeyError, ValueError) as exc:
            sock.close()
            raise AgentError("malformed start reply from the agent") from exc
        except BaseException:
            sock.close()
            raise

    def exec(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
        max_output: int | None = None,
    ) -> ExecResult:
        """Run a command to completion and collect its output.

        ``on_output("stdout"|"stderr", chunk)`` sees every chunk as it arrives, even past
        ``max_output``, which only bounds what is kept in the result (the first ``max_output``
        bytes of each stream; ``truncated`` says whether anything was dropped)."""
        start = time.monotonic()
        io_timeout = None if timeout is None or timeout <= 0 else timeout + EXEC_TIMEOUT_MARGIN
        proc = self._open_process(argv, env, cwd, False, 24, 80, stdin is not None, timeout, io_timeout)
        feeder: threading.Thread | None = None
        try:
            if stdin is not None:
                if len(stdin) <= INLINE_STDIN:
                    _feed_stdin(proc, stdin)
                else:
                    # Writing it all first could deadlock: the command stops reading stdin
                    # while its output, which we would not be reading, is backed up.
                    feeder = threading.Thread(target=_feed_stdin, args=(proc, stdin), daemon=True)
                    feeder.start()
            out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
            kept = {"stdout": 0, "stderr": 0}
            truncated = False
            info: ExitInfo | None = None
            for kind, data in proc.events():
                if isinstance(data, ExitInfo):
                    info = data
                    break
                if on_output is not None:
                    on_output(kind, data)
                if max_output is None:
                    out[kind].append(data)
                    continue
                room = max_output - kept[kind]
                if len(data) > room:
                    truncated = True
                    data = data[: max(room, 0)]
                if data:
                    out[kind].append(data)
                    kept[kind] += len(data)
            if info is None:
                raise AgentError("the agent ended the exec without reporting an exit")
        finally:
            if feeder is not None:
                proc._shutdown()  # unblocks a feeder still stuck in sendall
                feeder.join()
            proc.close()
        return ExecResult(
            exit_code=info.code,
            stdout=b"".join(out["stdout"]),
            stderr=b"".join(out["stderr"]),
            timed_out=info.timed_out,
            signal=info.signal,
            duration_ms=(time.monotonic() - start) * 1000.0,
            pid=proc.pid,
            truncated=truncated,
        )

    def quiesce(self) -> None:
        """Make the sandbox checkpointable: the agent stops listening and closes every
        connection to the host (detachable commands detach, other commands end). Returns once
        the agent has closed the last one. Undone by SIGUSR2 to the agent (``runsc kill``)."""
        with contextlib.closing(self._request(b"Q", [], timeout=10.0)) as sock:
            _expect(*_read_frame(sock), b"K")
            while sock.recv(4096):  # the agent's close is the signal that all are closed
                pass

    def tunnel(self, port: int, io_timeout: float | None = None) -> socket.socket:
        """A connection to TCP ``port`` on the sandbox's own loopback: after the agent's ``K``
        it carries raw bytes both ways (a preview URL's server). Raises
        :class:`AgentFileError` (``ECONNREFUSED``) when nothing listens there."""
        sock = self._request(b"T", [("port", int(port))])
        try:
            _expect(*_read_frame(sock), b"K")
            sock.settimeout(io_timeout)
        except BaseException:
            sock.close()
            raise
        return sock

    def attach(self, pid: int, io_timeout: float | None = None) -> socket.socket:
        """A new connection to the detached command ``pid``, its stream going on from here."""
        sock = self._request(b"A", [("pid", int(pid))])
        try:
            _expect(*_read_frame(sock), b"S")
            sock.settimeout(io_timeout)
        except BaseException:
            sock.close()
            raise
        return sock

    def iter_file(self, path: str, chunk_size: int = DATA_CHUNK) -> tuple[FileStat, Iterator[bytes]]:
        """Stat and content of a regular file, streamed. Errors about the file itself (missing,
        a directory) are raised here, before the first chunk."""
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        sock = self._request(b"R", [("path", path)])
        try:
            st = _stat_from(_expect(*_read_frame(sock), b"T"))
        except BaseException:
            sock.close()
            raise
        return st, _file_chunks(sock, chunk_size)

    def read_file(self, path: str) -> bytes:
        _, chunks = self.iter_file(path)
        return b"".join(chunks)

    def write_file(
        self,
        path: str,
        data: bytes | bytearray | memoryview | Iterable[bytes],
        *,
        mode: int = 0o644,
        mkdirs: bool = True,
        append: bool = False,
    ) -> int:
        """Replace (or with ``append``, extend) a file; returns the bytes written. Unless
        appending, the file changes atomically: readers see the old or the new content, and
        a failure part way leaves the old one."""
        fields: list[tuple[str, FieldValue]] = [("path", path), ("mode", f"{mode:o}")]
        if mkdirs:
            fields.append(("mkdirs", 1))
        if append:
            fields.append(("append", 1))
        with contextlib.closing(self._request(b"W", fields)) as sock:
            send_error: OSError | None = None
            try:
                for chunk in _chunks(data, DATA_CHUNK):
                    if _readable_now(sock):
                        break  # the agent answered before the end: an error, read it below
                    _send_frame(sock, b"D", chunk)
                else:
                    _send_frame(sock, b"C")
            except TimeoutError as exc:
                raise AgentError("timed out sending a file to the agent") from exc
            except OSError as exc:
                send_error = exc  # the agent may have hung up after saying why
            try:
                reply = _expect(*_read_frame(sock), b"K")
            except AgentFileError:
                raise
            except AgentError:
                if send_error is None:
                    raise
                raise AgentError(f"lost the connection to the agent: {send_error}") from send_error
            return int(reply.get("size", "0"))

    def list_dir(self, path: str) -> list[DirEntry]:
        """Entries of a directory, sorted by name; symlinks are reported, never followed. At
        most :data:`MAX_LIST_ENTRIES` and :data:`MAX_LIST_BYTES` (``E2BIG`` beyond): what the sandbox sends is bounded."""
        entries = []
        received = 0
        with contextlib.closing(self._request(b"L", [("path", path)])) as sock:
            while True:
                kind, payload = _read_frame(sock)
                if kind != b"N":
                    _expect(kind, payload, b"K")
                    break
                received += len(payload)
                if len(entries) >= MAX_LIST_ENTRIES or received > MAX_LIST_BYTES:
                    raise AgentFileError(
                        "E2BIG", f"{path} holds more than {len(entries)} entries, too many to list at once"
                    )
                f = decode_fields(payload)
                st = _stat_from(f)
                name = f.get("name", "")
                entries.append(
                    DirEntry(name, posixpath.join(path, name), st.type, st.size, st.mode, st.mtime)
                )
        entries.sort(key=lambda e: e.name)
        return entries

    def stat(self, path: str) -> FileStat:
        """lstat: a symlink is described, not followed."""
        return _stat_from(self._call(b"S", [("path", path)]))

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        """mkdir -p; an existing directory is fine."""
        self._call(b"M", [("path", path), ("mode", f"{mode:o}")])

    def remove(self, path: str, recursive: bool = False) -> None:
        """Delete a file, symlink or empty directory; with ``recursive``, a whole tree."""
        fields: list[tuple[str, FieldValue]] = [("path", path)]
        if recursive:
            fields.append(("recursive", 1))
        self._call(b"D", fields)


def _file_chunks(sock: socket.socket, chunk_size: int) -> Iterator[bytes]:
    with contextlib.closing(sock):
        while True:
            kind, payload = _read_frame(sock)
            if kind == b"D":
                if len(payload) <= chunk_size:
                    yield payload
                else:
                    for start in range(0, len(payload), chunk_size):
                        yield payload[start : start + chunk_size]
            elif kind == b"K":
                return
            elif kind == b"F":
                raise _file_error(payload)
            else:
                raise AgentError(f"unexpected {kind!r} frame while reading a file")


def _feed_stdin(proc: AgentProcess, data: bytes) -> None:
    # The command may exit without reading all of it; the agent then drops the rest and,
    # once the exit is reported, hangs up. Neither is an error of the exec.
    with contextlib.suppress(OSError):
        proc.send_stdin(data)
        proc.close_stdin()


class AgentProcess:
    """A running command: one open exec connection."""

    def __init__(
        self,
        sock: socket.socket,
        pid: int,
        client: AgentClient | None = None,
        io_timeout: float | None = None,
    ) -> None:
        self._sock = sock
        self._client = client
        self._io_timeout = io_timeout
        self._send_lock = threading.Lock()  # frames from several threads must not interleave
        self.pid = pid
        self.exit_info: ExitInfo | None = None

    def __enter__(self) -> AgentProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, kind: bytes, payload: bytes | memoryview = b"") -> None:
        with self._send_lock:
            _send_frame(self._sock, kind, payload)

    def send_stdin(self, data: bytes) -> None:
        for chunk in _chunks(data, MAX_PAYLOAD):
            self._send(b"I", chunk)

    def close_stdin(self) -> None:
        self._send(b"C")

    def resize(self, rows: int, cols: int) -> None:
        self._send(b"Z", encode_fields([("rows", rows), ("cols", cols)]))

    def signal(self, sig: int) -> None:
        """Send a signal to the command's whole process group."""
        self._send(b"G", encode_fields([("sig", int(sig))]))

    def events(self) -> Iterator[tuple[str, bytes | ExitInfo]]:
        """``("stdout", bytes)``, ``("stderr", bytes)`` as output arrives (a tty gives stdout
        only), and finally ``("exit", ExitInfo)``."""
        while self.exit_info is None:
            kind, payload = _read_frame(self._sock)
            if kind == b"O":
                yield "stdout", payload
            elif kind == b"R":
                yield "stderr", payload
            elif kind == b"X":
                f = decode_fields(payload)
                try:
                    info = ExitInfo(int(f["code"]), int(f["signal"]), f.get("timed_out") == "1")
                except (KeyError, ValueError) as exc:
                    raise AgentError(f"malformed exit report from the agent: {f}") from exc
                self.exit_info = info
                yield "exit", info
            elif kind == b"F":
                raise _file_error(payload)
            elif kind == b"H":
                raise AgentDetached(f"the agent detached command {self.pid} for a checkpoint")
            else:
                raise AgentError(f"unexpected {kind!r} frame from a running command")

    def reattach(self) -> None:
        """Continue the stream of a detached command on a new connection (see
        :class:`AgentDetached`). Raises :class:`AgentUnavailable` while the agent is not
        listening yet, :class:`AgentFileError` (``ESRCH``) if the command did not survive."""
        if self._client is None:
            raise AgentError("this process cannot be re-attached")
        sock = self._client.attach(self.pid, self._io_timeout)
        with self._send_lock:
            old, self._sock = self._sock, sock
        old.close()

    def fileno(self) -> int:
        return self._sock.fileno()

    def _shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Hang up; if the command is still running the agent kills its process group."""
        self._sock.close()
