"""Client for ``hangar-agent``, the guest agent that runs as PID 1 in every sandbox of an
agent-based launcher (the protocol: protocol.py).

The agent listens on a socket the host reaches directly (through a :class:`Transport`: a unix
socket into gVisor; a vsock or a virtio-serial port into a VM), so one exec or file operation
is one connection (a few ms) rather than a process such as ``runsc exec`` (~45 ms). Everything
the agent sends is untrusted (the sandbox can answer in its place): lengths, sizes and names are
checked, and a malformed answer is an :class:`AgentError`, never a hang or an unbounded
allocation.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from .protocol import (
    DATA_CHUNK,
    MAX_PAYLOAD,
    AgentDetached,
    AgentError,
    AgentFileError,
    AgentUnavailable,
    DirEntry,
    ExitInfo,
    Fields,
    FieldValue,
    FileStat,
    chunks,
    decode_fields,
    encode_fields,
    enforced,
    expect,
    file_error,
    pseudo_fs_field,
    read_frame,
    readable_now,
    send_frame,
    stat_from,
)
from .transport import Transport, UnixTransport

# Stdin up to one frame is sent inline: the agent always takes a whole frame in, so a single
# frame cannot deadlock against output the client is not reading yet. More goes from a thread.
INLINE_STDIN = MAX_PAYLOAD
# How much longer than the command's own timeout the client waits on a silent socket.
EXEC_TIMEOUT_MARGIN = 5.0

# A listing is held in memory whole, from frames the sandbox sends: at most this many entries.
MAX_LIST_ENTRIES = 100_000
MAX_LIST_BYTES = 64 << 20
# What the agent may send after its answer to a quiesce, before it closes the connection.
MAX_QUIESCE_TAIL = 64 << 10


@dataclass
class ExecResult:
    exit_code: int
    stdout: bytes | bytearray  # the buffer the output was read into, not a copy of it
    stderr: bytes | bytearray
    timed_out: bool
    signal: int
    duration_ms: float
    pid: int
    truncated: bool


# -- client -------------------------------------------------------------------------------


class AgentClient:
    """Talks to one agent. Cheap to create; holds no connection between calls, so one client
    may be used from several threads at once."""

    def __init__(
        self,
        transport: Transport | str | os.PathLike[str],
        *,
        connect_timeout: float = 5.0,
        io_timeout: float | None = 60.0,
    ) -> None:
        # A path is a unix socket's (gVisor's agent, and the agent run on the host in tests).
        self.transport: Transport = (
            UnixTransport(transport) if isinstance(transport, str | os.PathLike) else transport
        )
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout  # for everything but exec's streams

    def __repr__(self) -> str:
        return f"AgentClient({self.transport!r})"

    # -- plumbing

    def _connect(self, timeout: float | None, connect_timeout: float | None = None) -> socket.socket:
        connect_timeout = self.connect_timeout if connect_timeout is None else connect_timeout
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                sock = self.transport.connect(connect_timeout)
            except BlockingIOError:
                # The listen backlog is full: the agent is busy, not gone.
                if time.monotonic() >= deadline:
                    raise AgentUnavailable(
                        f"agent at {self.transport} is not accepting connections"
                    ) from None
                time.sleep(0.002)
                continue
            except (OSError, ValueError) as exc:
                raise AgentUnavailable(f"cannot connect to the agent at {self.transport}: {exc}") from exc
            sock.settimeout(timeout)
            return sock

    def _request(self, kind: bytes, fields: Fields, timeout: float | None = None) -> socket.socket:
        payload = encode_fields(fields)
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(f"request of {len(payload)} bytes exceeds the agent's {MAX_PAYLOAD}")
        sock = self._connect(self.io_timeout if timeout is None else timeout)
        try:
            send_frame(sock, kind, payload)
        except OSError as exc:
            sock.close()
            raise AgentError(f"lost the connection to the agent: {exc}") from exc
        return sock

    def _call(self, kind: bytes, fields: Fields = ()) -> dict[str, str]:
        """A request whose whole answer is one ``K`` (or ``F``) frame."""
        with contextlib.closing(self._request(kind, fields)) as sock:
            return expect(*read_frame(sock), b"K")

    # -- operations

    def ping(self) -> dict[str, str]:
        return self._call(b"P")

    def wait_listening(self, timeout: float) -> None:
        """Wait until the agent listens (a unix socket's path exists only then: the agent binds
        under a temporary name and renames it into place). No round trip, so the agent forks its first
        handlers while the caller goes on; a connection made meanwhile waits in the backlog.
        Raises :class:`AgentUnavailable` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.transport.listening():
            if time.monotonic() >= deadline:
                raise AgentUnavailable(f"agent at {self.transport} was not listening within {timeout:g}s")
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
                    send_frame(sock, b"P")
                    expect(*read_frame(sock), b"K")
                return
            except (AgentError, OSError) as exc:
                if time.monotonic() >= deadline:
                    raise AgentUnavailable(
                        f"agent at {self.transport} did not answer within {timeout:g}s: {exc}"
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
        try:
            # Its start is answered at once, or the agent is stuck (a sandbox being paused):
            # the wait for it is bounded, whatever the command's own timeout.
            sock.settimeout(self.io_timeout if io_timeout is None else max(io_timeout, self.io_timeout or 0))
            started = expect(*read_frame(sock), b"S")
            # A command may be silent for as long as it runs: without a timeout of its own, its
            # stream must not inherit the client's default for requests (None there means that).
            sock.settimeout(io_timeout)
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
            # Each stream is kept in one buffer that grows in place: what is kept costs its size
            # once (a list of chunks joined at the end cost it twice), and past max_output
            # nothing more is held.
            out = {"stdout": bytearray(), "stderr": bytearray()}
            truncated = False
            info: ExitInfo | None = None
            for kind, data in proc.events():
                if isinstance(data, ExitInfo):
                    info = data
                    break
                if on_output is not None:
                    on_output(kind, data)
                room = len(data) if max_output is None else max_output - len(out[kind])
                if len(data) > room:
                    truncated = True
                    if room > 0:
                        out[kind] += memoryview(data)[:room]
                else:
                    out[kind] += data
            if info is None:
                raise AgentError("the agent ended the exec without reporting an exit")
        finally:
            if feeder is not None:
                proc.shutdown()  # unblocks a feeder still stuck in sendall
                feeder.join()
            proc.close()
        return ExecResult(
            exit_code=info.code,
            stdout=out["stdout"],
            stderr=out["stderr"],
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
            expect(*read_frame(sock), b"K")
            tail = 0
            while data := sock.recv(4096):  # the agent's close is the signal that all are closed
                tail += len(data)
                if tail > MAX_QUIESCE_TAIL:
                    raise AgentError("the agent kept sending after its answer to a quiesce")

    def tunnel(self, port: int, io_timeout: float | None = None) -> socket.socket:
        """A connection to TCP ``port`` on the sandbox's own loopback: after the agent's ``K``
        it carries raw bytes both ways (a preview URL's server). Raises
        :class:`AgentFileError` (``ECONNREFUSED``) when nothing listens there."""
        sock = self._request(b"T", [("port", int(port))])
        try:
            expect(*read_frame(sock), b"K")
            sock.settimeout(io_timeout)
        except BaseException:
            sock.close()
            raise
        return sock

    def attach(self, pid: int, io_timeout: float | None = None) -> socket.socket:
        """A new connection to the detached command ``pid``, its stream going on from here."""
        sock = self._request(b"A", [("pid", int(pid))])
        try:
            expect(*read_frame(sock), b"S")
            sock.settimeout(io_timeout)
        except BaseException:
            sock.close()
            raise
        return sock

    def iter_file(
        self, path: str, chunk_size: int = DATA_CHUNK, *, no_pseudo_fs: bool = False
    ) -> tuple[FileStat, Iterator[bytes]]:
        """Stat and content of a regular file, streamed. Errors about the file itself (missing,
        a directory, on /proc with ``no_pseudo_fs``) are raised here, before the first chunk.
        The size is what the agent said at open: the chunks may add up to more or less."""
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        sock = self._request(b"R", [("path", path), *pseudo_fs_field(no_pseudo_fs)])
        try:
            st = stat_from(enforced(expect(*read_frame(sock), b"T"), no_pseudo_fs))
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
        data: bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview],
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
                for chunk in chunks(data, DATA_CHUNK):
                    if readable_now(sock):
                        break  # the agent answered before the end: an error, read it below
                    send_frame(sock, b"D", chunk)
                else:
                    send_frame(sock, b"C")
            except TimeoutError as exc:
                raise AgentError("timed out sending a file to the agent") from exc
            except OSError as exc:
                send_error = exc  # the agent may have hung up after saying why
            try:
                reply = expect(*read_frame(sock), b"K")
            except AgentFileError:
                raise
            except AgentError:
                if send_error is None:
                    raise
                raise AgentError(f"lost the connection to the agent: {send_error}") from send_error
            size = reply.get("size", "0")
            if not (size.isascii() and size.isdigit()):
                raise AgentError(f"malformed write reply from the agent: {dict(reply)}")
            return int(size)

    def list_dir(self, path: str, *, no_pseudo_fs: bool = False) -> list[DirEntry]:
        """Entries of a directory, sorted by name; symlinks are reported, never followed. At
        most :data:`MAX_LIST_ENTRIES` and :data:`MAX_LIST_BYTES` (``E2BIG`` beyond): what the sandbox sends is bounded."""
        entries: list[DirEntry] = []
        received = 0
        with contextlib.closing(
            self._request(b"L", [("path", path), *pseudo_fs_field(no_pseudo_fs)])
        ) as sock:
            while True:
                kind, payload = read_frame(sock)
                if kind != b"N":
                    enforced(expect(kind, payload, b"K"), no_pseudo_fs)
                    break
                received += len(payload)
                if len(entries) >= MAX_LIST_ENTRIES or received > MAX_LIST_BYTES:
                    raise AgentFileError(
                        "E2BIG", f"{path} holds more than {len(entries)} entries, too many to list at once"
                    )
                f = decode_fields(payload)
                st = stat_from(f)
                name = f.get("name", "")
                if not name or "/" in name or name in (".", ".."):
                    raise AgentError(f"malformed directory entry {name!r} from the agent")
                entries.append(
                    DirEntry(name, posixpath.join(path, name), st.type, st.size, st.mode, st.mtime)
                )
        entries.sort(key=lambda e: e.name)
        return entries

    def stat(self, path: str, *, no_pseudo_fs: bool = False) -> FileStat:
        """lstat: a symlink is described, not followed."""
        return stat_from(
            enforced(self._call(b"S", [("path", path), *pseudo_fs_field(no_pseudo_fs)]), no_pseudo_fs)
        )

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
            kind, payload = read_frame(sock)
            if kind == b"D":
                if len(payload) <= chunk_size:
                    yield payload
                else:
                    for start in range(0, len(payload), chunk_size):
                        yield payload[start : start + chunk_size]
            elif kind == b"K":
                return
            elif kind == b"F":
                raise file_error(payload)
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
            send_frame(self._sock, kind, payload)

    def send_stdin(self, data: bytes) -> None:
        for chunk in chunks(data, MAX_PAYLOAD):
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
            kind, payload = read_frame(self._sock)
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
                raise file_error(payload)
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

    def shutdown(self) -> None:
        """Wake a thread blocked reading or writing this connection (it sees it closed)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Hang up; if the command is still running the agent kills its process group."""
        self._sock.close()
