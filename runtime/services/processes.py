"""Live processes: streamed and background execs, and terminals.

They run on the sandbox's node, held by that node's stream bridge (:mod:`runtime.node.bridge`);
these services start them (through the sandbox's one road, :mod:`.sandbox_access`), follow
their output, and send them input, through the Channels layer (:mod:`runtime.streams`
describes the wire). Callers hold a :class:`ProcessHandle`, never the wire's keys or frames.
The starting and following services are async: they are called from async views and
websocket consumers, which wait on the layer.
"""

from __future__ import annotations

import asyncio
import signal as signal_module
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from channels.exceptions import ChannelFull
from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection
from django.db.models import QuerySet
from django.utils import timezone

from .. import events, streams
from ..aio import blocking, within
from ..errors import Conflict, InvalidValue, NodeUnavailable, NotFound
from ..models import Exec, Sandbox, Team, Terminal
from ..notify import redis_client
from . import secrets as secret_svc
from . import spans
from .auth import sandbox_reached
from .channel_layer import channel_layer
from .checks import validate_command_size
from .sandbox_access import sandbox_access
from .sandbox_calls import require_running, sandbox_mark_active
from .sandbox_io import exec_validate

# A follower that hears nothing for this long checks the row (did the bridge go away?).
FOLLOW_IDLE_S = 30.0
# How often a quiet follower looks whether the bridge holding its process is still there.
BRIDGE_CHECK_S = 5.0
MAX_INLINE_STDIN = 1024 * 1024
ACK_EVERY_BYTES = 64 * 1024
ACK_EVERY_S = 0.05
DEFAULT_SHELL = [
    "/bin/sh", "-c",
    'if command -v bash >/dev/null 2>&1; then exec bash -l; else exec sh -l; fi',
]  # fmt: skip


def _db(fn: Any) -> Any:
    return blocking(fn)


# -- selectors ---------------------------------------------------------------------------------


def processes_for_sandbox(*, sandbox: Sandbox, status: str | None = None) -> QuerySet[Exec]:
    """Streamed and background commands of the sandbox, newest first."""
    qs = sandbox.execs.filter(kind__in=[Exec.Kind.STREAM, Exec.Kind.BACKGROUND])
    if status:
        if status not in Exec.Status.values:
            raise InvalidValue(f"unknown status {status!r}; one of {', '.join(Exec.Status.values)}")
        qs = qs.filter(status=status)
    return qs


def process_get(*, sandbox: Sandbox, process_id: int | str) -> Exec:
    try:
        pk = int(process_id)
    except (TypeError, ValueError):
        raise NotFound(f"no process {process_id!r} in sandbox {sandbox.id}") from None
    row = sandbox.execs.filter(id=pk).first()
    if row is None:
        by_pid = sandbox.execs.filter(pid=pk).order_by("-id").values_list("id", flat=True).first()
        hint = f": {pk} is the pid of process {by_pid}; paths take the process's id" if by_pid else ""
        raise NotFound(f"no process {process_id!r} in sandbox {sandbox.id}{hint}")
    return row


def terminals_for_sandbox(*, sandbox: Sandbox) -> QuerySet[Terminal]:
    return sandbox.terminals.all()


def terminal_get(*, team: Team, terminal_id: str, caller: Any = None) -> Terminal:
    row = Terminal.objects.select_related("sandbox__node").filter(id=terminal_id, sandbox__team=team).first()
    if row is not None and not sandbox_reached(caller=caller, sandbox_id=row.sandbox_id):
        row = None  # beyond a harness's token: as if it were another team's
    if row is None:
        raise NotFound(f"no terminal {terminal_id!r} in team {team.name}")
    return row


# -- starting ----------------------------------------------------------------------------------


async def process_start(
    *,
    sandbox: Sandbox,
    cmd: str | list[str],
    kind: str = Exec.Kind.BACKGROUND,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    stdin: bytes | None = None,
    stdin_open: bool = False,
    tty: bool = False,
    rows: int = 24,
    cols: int = 80,
    timeout_s: float | None = None,
    user: User | None = None,
    mask: list[str] | None = None,
) -> Exec:
    """Start a command as a live process of the sandbox's node and return its row at once.
    Without ``timeout_s`` it runs as long as the sandbox does."""
    row, _ = await _process_start(
        sandbox=sandbox, cmd=cmd, kind=kind, cwd=cwd, env=env, stdin=stdin, stdin_open=stdin_open, tty=tty,
        rows=rows, cols=cols, timeout_s=timeout_s, user=user, mask=mask, follow=False,
    )  # fmt: skip
    return row


async def process_start_followed(*, sandbox: Sandbox, **options: Any) -> tuple[Exec, ProcessFollow]:
    """:func:`process_start` (same options) for a caller that follows the output from its
    first byte: the follower attaches with the start, which saves a round trip to the node.
    The caller iterates the follow, or :meth:`ProcessFollow.close` s it."""
    row, follow = await _process_start(sandbox=sandbox, follow=True, **options)
    assert follow is not None
    return row, follow


async def _process_start(
    *,
    sandbox: Sandbox,
    cmd: str | list[str],
    kind: str = Exec.Kind.BACKGROUND,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    stdin: bytes | None = None,
    stdin_open: bool = False,
    tty: bool = False,
    rows: int = 24,
    cols: int = 80,
    timeout_s: float | None = None,
    user: User | None = None,
    mask: list[str] | None = None,
    follow: bool = False,
) -> tuple[Exec, ProcessFollow | None]:
    require_running(sandbox)
    argv, env, cwd = exec_validate(cmd=cmd, env=env, cwd=cwd, timeout_s=timeout_s)
    if kind not in (Exec.Kind.STREAM, Exec.Kind.BACKGROUND):
        raise InvalidValue(f"kind must be stream or background, got {kind!r}")
    if stdin is not None and len(stdin) > MAX_INLINE_STDIN:
        raise InvalidValue(
            f"stdin is limited to {MAX_INLINE_STDIN} bytes here; send more through the process's stdin"
        )
    _check_size(rows, cols)
    asked = env

    def create() -> tuple[Exec, dict[str, str]]:
        # One trip to the database: the secrets, the activity mark and the row.
        # A claimed pool member got its env and secrets after it started: they come with each exec.
        full = {**sandbox.env, **secret_svc.env_for(sandbox), **asked}
        validate_command_size(node=sandbox.node, runtime=sandbox.runtime, argv=argv, env=full, cwd=cwd)
        sandbox_mark_active(sandbox.id, sandbox.last_activity_at)
        row = Exec.objects.create(
            sandbox=sandbox, kind=kind, status=Exec.Status.RUNNING, argv=argv, cwd=cwd or "",
            timeout_s=timeout_s, started_at=timezone.now(),
            created_by=user if user is not None and user.is_authenticated else None,
        )  # fmt: skip
        return row, full

    with spans.span("process.start", **spans.of(sandbox),
                    attributes={"process.command_args": argv, "hangar.process.tty": tty}) as traced:  # fmt: skip
        row, follower = await _launch(sandbox, create, argv, env, cwd, tty, rows, cols, timeout_s, stdin,
                                      stdin_open, mask, follow)  # fmt: skip
        traced.set({"hangar.exec.id": row.id, "process.pid": row.pid})
    return row, follower


async def _launch(
    sandbox: Sandbox, create: Any, argv: list[str], env: Any, cwd: str | None, tty: bool, rows: int, cols: int,
    timeout_s: float | None, stdin: bytes | None, stdin_open: bool, mask: list[str] | None, follow: bool,
) -> tuple[Exec, ProcessFollow | None]:  # fmt: skip
    row, env = await _db(create)()
    fields = {
        "argv": argv, "env": env, "cwd": cwd, "tty": tty, "rows": rows, "cols": cols, "timeout": timeout_s,
        "stdin_data": stdin or b"", "stdin_open": stdin_open, "kind": "exec", "mask": list(mask or []),
    }  # fmt: skip
    follower = ProcessHandle.of_exec(sandbox, row.id).follow(offset=0) if follow else None
    try:
        if follower is not None:
            fields["attach"] = await follower.open()
        row.pid, attached, recorded = await sandbox_access(sandbox).start_process(
            streams.exec_key(row.id), fields
        )
    except (InvalidValue, Conflict, NodeUnavailable) as exc:
        if follower is not None:
            await follower.close()
        if isinstance(exc, InvalidValue):  # refused by the sandbox (no such binary or cwd): nothing ran
            await _db(Exec.objects.filter(id=row.id).delete)()
        else:  # the node's or the runtime's failure: the row says what happened
            row.status, row.error, row.finished_at = Exec.Status.FAILED, exc.message, timezone.now()
            await _db(row.save)(update_fields=["status", "error", "finished_at"])
        raise
    except BaseException:
        if follower is not None:
            await follower.close()
        raise
    if follower is not None:
        follower.attached = attached
    if not recorded:  # the bridge writes it as the process starts; one that could not, here
        await _db(Exec.objects.filter(id=row.id, pid__isnull=True).update)(pid=row.pid)
    return row, follower


async def _secret_env(sandbox: Sandbox) -> dict[str, str]:
    return await _db(secret_svc.env_for)(sandbox)


def _check_size(rows: int, cols: int) -> None:
    if not (1 <= rows <= 1000 and 1 <= cols <= 1000):
        raise InvalidValue(f"rows and cols must be between 1 and 1000, got {rows}x{cols}")


async def terminal_open(
    *,
    sandbox: Sandbox,
    name: str = "",
    cmd: str | list[str] | None = None,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    rows: int = 24,
    cols: int = 80,
    user: User | None = None,
) -> Terminal:
    """Start a shell (or ``cmd``) on a PTY in the sandbox; it lives until it exits or the
    sandbox stops, whoever is watching."""
    require_running(sandbox)
    if cwd is None and await _db(sandbox.harnesses.exists)():
        cwd = "/workspace"  # a harness's terminals open in its workspace, wherever they are opened
    argv, env, cwd = exec_validate(cmd=cmd or DEFAULT_SHELL, env=env, cwd=cwd, timeout_s=None)
    _check_size(rows, cols)
    if len(name) > 64:
        raise InvalidValue("name is limited to 64 characters")
    env = {
        "TERM": "xterm-256color",
        "COLORTERM": "truecolor",
        **sandbox.env,
        **(await _secret_env(sandbox)),
        **env,
    }
    validate_command_size(node=sandbox.node, runtime=sandbox.runtime, argv=argv, env=env, cwd=cwd)

    def create() -> Terminal:
        sandbox_mark_active(sandbox.id, sandbox.last_activity_at)
        n = name or f"terminal {sandbox.terminals.count() + 1}"
        return Terminal.objects.create(
            sandbox=sandbox, name=n, argv=argv, cwd=cwd or "", rows=rows, cols=cols,
            created_by=user if user is not None and user.is_authenticated else None,
        )  # fmt: skip

    with spans.span("terminal.open", **spans.of(sandbox),
                    attributes={"process.command_args": argv}) as traced:  # fmt: skip
        row = await _open_terminal(sandbox, create, argv, env, cwd, rows, cols)
        traced.set({"hangar.terminal.id": row.id, "process.pid": row.pid})
    return row


async def _open_terminal(
    sandbox: Sandbox, create: Any, argv: list[str], env: dict[str, str], cwd: str | None, rows: int, cols: int
) -> Terminal:
    row = await _db(create)()
    fields = {
        "argv": argv, "env": env, "cwd": cwd, "tty": True, "rows": rows, "cols": cols, "timeout": None,
        "stdin_data": b"", "stdin_open": True, "kind": "terminal",
    }  # fmt: skip
    try:
        row.pid, _, _ = await sandbox_access(sandbox).start_process(streams.terminal_key(row.id), fields)
    except (InvalidValue, Conflict, NodeUnavailable) as exc:
        if isinstance(exc, InvalidValue):  # refused, as a command's start is: no row is left of it
            await _db(Terminal.objects.filter(id=row.id).delete)()
        else:
            row.status, row.error, row.ended_at = Terminal.Status.FAILED, exc.message, timezone.now()
            await _db(row.save)(update_fields=["status", "error", "ended_at"])
        raise
    await _db(Terminal.objects.filter(id=row.id).update)(pid=row.pid)
    return row


# -- input -------------------------------------------------------------------------------------


async def process_send(*, node_name: str, key: str, kind: str, **fields: Any) -> None:
    """Input for a live process: ``proc.input`` (data), ``proc.eof``, ``proc.resize`` (rows,
    cols), ``proc.signal`` (signal), ``proc.kill``, ``proc.ack``/``proc.detach`` (reply)."""
    await channel_layer().send(streams.bridge_channel(node_name), {"type": kind, "key": key, **fields})


async def process_send_patiently(*, node_name: str, key: str, kind: str, **fields: Any) -> None:
    """:func:`process_send`, waiting and trying again while the bridge's channel is full (for
    a client's input, which must not be lost)."""
    for delay in (*SEND_RETRY_S, None):
        try:
            await process_send(node_name=node_name, key=key, kind=kind, **fields)
            return
        except ChannelFull:
            if delay is None:
                raise
            await asyncio.sleep(delay)


INPUT_CHUNK = 64 * 1024  # input bytes per message to the bridge
INPUT_WINDOW = 2 * 1024 * 1024  # sent and not yet written to the command: the sender waits above this
INPUT_ACK_EVERY = 256 * 1024  # a sender asks to hear how far its input is written this often
ACK_WAIT_S = 10.0  # a sender with a full window that hears nothing this long asks again
SEND_RETRY_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)  # a full bridge channel: wait, then try again


class InputRefused(Conflict):
    """The process's node already holds as much unread input for it as it keeps."""


def input_refused_message() -> str:
    mib = settings.HANGAR_STDIN_PENDING_BYTES / (1024 * 1024)
    return (
        f"the process has not read the input it was sent ({mib:g} MiB is waiting, as much as its node keeps); "
        "send more once it has read some"
    )


class InputSender:
    """Input for one live process from one source (an SSH channel, an API call), paced by the
    command: at most ``window`` bytes are sent and not yet written to its stdin, and
    :meth:`send` waits for the rest. The node's bridge says how far it has written (see
    :mod:`runtime.node.bridge`) on a channel of this sender's own, so a sender that stops reading
    its client while it waits holds the client back through its transport's own flow control."""

    def __init__(self, node_name: str, key: str, *, window: int = INPUT_WINDOW) -> None:
        # Well under what the node keeps unread, so that a sender alone is never refused.
        window = min(window, settings.HANGAR_STDIN_PENDING_BYTES // 2)
        self.node_name, self.key, self.window = node_name, key, max(window, INPUT_CHUNK)
        self.ack_every = min(INPUT_ACK_EVERY, self.window // 4)  # several answers per window
        self.sent = 0  # bytes sent to the bridge
        self.written = 0  # of which the bridge has said are written (or moot: the process ended)
        self.asked = 0  # the offset of the last acknowledgement asked for
        self.channel = ""
        self._layer = channel_layer()

    async def send(self, data: bytes, *, whole: bool = False) -> None:
        """Send ``data`` in order, in chunks (``whole``: in one message, which the node takes or
        refuses as a whole). Raises :class:`InputRefused`."""
        pieces = [data] if whole else [data[i : i + INPUT_CHUNK] for i in range(0, len(data), INPUT_CHUNK)]
        for piece in pieces:
            probe = self.asked <= self.written  # nothing asked for that could answer
            while self.sent - self.written >= self.window:
                if probe:
                    await self._send(streams.INPUT, data=b"", **await self._ask())
                # An answer lost on the way (a full channel) must not stall the input for good:
                # ask again after a while (answers carry offsets, so a second one is harmless).
                probe = not await self._acked(ACK_WAIT_S) or self.asked <= self.written
            self.sent += len(piece)
            # Every message names this sender, so that a refusal is always heard of, and says
            # it is part of one stream (after a refusal, nothing more of it is taken: no gaps).
            fields: dict[str, Any] = {"data": piece, "ack_to": await self._channel(), "upto": self.sent,
                                      "stream": True}  # fmt: skip
            if whole or self.sent - self.asked >= self.ack_every:
                fields.update(await self._ask())
            await self._send(streams.INPUT, **fields)

    async def drain(self, timeout: float) -> bool:
        """Wait until everything sent is written to the command's stdin: False if it has not
        been within ``timeout`` (it stays queued). Raises :class:`InputRefused`."""
        if self.asked < self.sent:
            await self._send(streams.INPUT, data=b"", **await self._ask())  # acknowledged in order
        deadline = time.monotonic() + timeout
        while self.written < self.sent:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await self._acked(left)
        return True

    async def _channel(self) -> str:
        if not self.channel:
            self.channel = await self._layer.new_channel()
        return self.channel

    async def _ask(self) -> dict[str, Any]:
        self.asked = self.sent
        return {"ack_to": await self._channel(), "upto": self.sent, "ack": True}

    async def _acked(self, timeout: float) -> bool:
        """Take the node's next answer (False: none came within ``timeout``)."""
        try:
            msg = await within(self._layer.receive(self.channel), timeout)
        except TimeoutError:
            return False
        if msg.get("type") == streams.INPUT_ACKED and msg.get("key") == self.key:
            if msg.get("refused"):
                raise InputRefused(input_refused_message())
            self.written = max(self.written, int(msg.get("upto") or 0))
        return True

    async def _send(self, kind: str, **fields: Any) -> None:
        await process_send_patiently(node_name=self.node_name, key=self.key, kind=kind, **fields)


def signal_number(value: str | int) -> int:
    """``9``, ``"KILL"``, ``"SIGKILL"`` -> 9."""
    if isinstance(value, int) or (isinstance(value, str) and value.isascii() and value.isdigit()):
        number = int(value)
        if not 1 <= number <= 64:
            raise InvalidValue(f"signal must be between 1 and 64, got {number}")
        return number
    name = str(value).upper()
    name = name if name.startswith("SIG") else "SIG" + name
    try:
        return int(signal_module.Signals[name])
    except KeyError:
        raise InvalidValue(f"unknown signal {value!r}; use a name like TERM or INT, or a number") from None


# -- following ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessHandle:
    """One live process (a streamed or background exec, a terminal) as its callers speak to it:
    follow its output, send it input, resize, signal or kill it. Where it runs and how the
    messages travel to its node's bridge (:mod:`runtime.streams`) stay behind it.

    ``patient``: a control message waits and tries again while the bridge's channel is full
    (an SSH session's, which must not be lost) instead of raising ``ChannelFull``."""

    node_name: str
    key: str
    row_id: int | str
    patient: bool = False

    @classmethod
    def of_exec(cls, sandbox: Sandbox, exec_id: int) -> ProcessHandle:
        return cls(node_name=_placed_on(sandbox), key=streams.exec_key(exec_id), row_id=exec_id)

    @classmethod
    def of_terminal(cls, sandbox: Sandbox, terminal_id: str) -> ProcessHandle:
        return cls(node_name=_placed_on(sandbox), key=streams.terminal_key(terminal_id), row_id=terminal_id)

    def patiently(self) -> ProcessHandle:
        return replace(self, patient=True)

    def follow(
        self,
        *,
        offset: int = 0,
        live: bool = False,
        flow: bool = True,
        auto_ack: bool = True,
        follow: bool = True,
    ) -> ProcessFollow:
        """Its output (see :class:`ProcessFollow`)."""
        return ProcessFollow(self, offset=offset, live=live, flow=flow, auto_ack=auto_ack, follow=follow)

    def input_sender(self, *, window: int = INPUT_WINDOW) -> InputSender:
        """Input paced by the command (see :class:`InputSender`)."""
        return InputSender(self.node_name, self.key, window=window)

    async def send_input(self, data: bytes, *, ack_to: str, upto: int) -> None:
        """A client's input, as it comes; a refusal is told on ``ack_to`` (``proc.input_acked``)
        with ``upto``, the client's count of bytes sent so far. Never lost to a full channel."""
        await process_send_patiently(node_name=self.node_name, key=self.key, kind=streams.INPUT, data=data,
                                     ack_to=ack_to, upto=upto)  # fmt: skip

    async def close_input(self) -> None:
        await self._control(streams.EOF)

    async def resize(self, rows: int, cols: int) -> None:
        await self._control(streams.RESIZE, rows=rows, cols=cols)

    async def signal(self, value: str | int) -> None:
        """``value``: a name (``TERM``, ``SIGINT``) or a number; raises :class:`InvalidValue`."""
        await self._control(streams.SIGNAL, signal=signal_number(value))

    async def kill(self) -> None:
        await self._control(streams.KILL)

    async def _control(self, kind: str, **fields: Any) -> None:
        send = process_send_patiently if self.patient else process_send
        await send(node_name=self.node_name, key=self.key, kind=kind, **fields)


def _placed_on(sandbox: Sandbox) -> str:
    return sandbox.node.name if sandbox.node else ""


class ProcessFollow:
    """The process's output from ``offset`` (or from now, ``live``), in order, then its exit,
    as an async iterator of ``("output", stream, data, end_offset)``, ``("skipped", n)`` and
    finally ``("exit", info)``.

    With ``flow`` the process is held back to this follower's pace: with ``auto_ack`` each
    chunk counts as consumed once the loop asks for the next one; otherwise the caller reports
    progress with :meth:`ack` (a browser acknowledging what xterm.js has rendered)."""

    def __init__(
        self, handle: ProcessHandle, *, offset: int = 0, live: bool = False, flow: bool = True,
        auto_ack: bool = True, follow: bool = True,
    ) -> None:  # fmt: skip
        self.handle = handle
        self.offset = max(0, offset)
        self.live = live
        self.flow = flow
        self.auto_ack = auto_ack
        self.follow = follow  # False: what is there now, then stop (no exit event if still running)
        self.channel = ""
        self.attached = False  # the attach went with the process's start (see :meth:`open`)
        self._layer = channel_layer()
        self._acked, self._acked_at = self.offset, time.monotonic()

    async def open(self) -> dict[str, Any]:
        """Listen before iterating, and return the attach for the process's start to carry
        (``START``'s ``attach``); set :attr:`attached` if the node took it."""
        await self._listen()
        return {"reply": self.channel, "offset": self.offset, "live": self.live, "flow": self.flow}

    async def close(self) -> None:
        """Stop listening, for a follow opened and never iterated."""
        if self.channel:
            channel, self.channel = self.channel, ""
            await self._layer.group_discard(streams.proc_group(self.handle.key), channel)
            if self.attached:
                await process_send(node_name=self.handle.node_name, key=self.handle.key,
                                   kind=streams.DETACH, reply=channel)  # fmt: skip

    async def _listen(self) -> None:
        if not self.channel:
            # The default prefix on purpose: channels_redis reads all of a process's own channels
            # through one Redis list, and a second prefix would wait forever behind the first.
            self.channel = await self._layer.new_channel()
            await self._layer.group_add(streams.proc_group(self.handle.key), self.channel)

    async def _send(self, kind: str, **fields: Any) -> None:
        await process_send(node_name=self.handle.node_name, key=self.handle.key, kind=kind, **fields)

    async def ack(self, offset: int) -> None:
        if self.channel:
            self._acked, self._acked_at = offset, time.monotonic()
            await self._send(streams.ACK, reply=self.channel, offset=offset)

    async def _auto_ack(self, offset: int) -> None:
        # One ack per chunk would double the messages; every 64 KiB (well under the bridge's
        # low watermark) or 50 ms keeps the command flowing at a fraction of the cost.
        if offset - self._acked >= ACK_EVERY_BYTES or time.monotonic() - self._acked_at >= ACK_EVERY_S:
            await self.ack(offset)

    async def _attach(self, offset: int, live: bool = False) -> None:
        await self._send(streams.ATTACH, reply=self.channel, offset=offset, live=live, flow=self.flow)

    async def __aiter__(self) -> AsyncIterator[tuple[Any, ...]]:
        layer = self._layer
        await self._listen()
        group = streams.proc_group(self.handle.key)
        follower = streams.Follower(want=self.offset)
        retried = False
        try:
            if not self.attached:
                await self._attach(self.offset, self.live)
            quiet_since, heard = time.monotonic(), False
            bridge = _BridgeWatch(self.handle.node_name)
            while not follower.done:
                try:
                    msg = await within(layer.receive(self.channel), BRIDGE_CHECK_S)
                except TimeoutError:
                    gone = await bridge.gone()
                    if gone:
                        follower.done = True
                        yield ("exit", {"exit_code": None, "signal": 0, "timed_out": False, "error": gone})
                        break
                    if (
                        follower.syncing and not heard and not self.live and follower.want == 0
                        and await _db(_ended_info)(self.handle) is not None
                    ):  # fmt: skip
                        # No word from the bridge at all, and the row says the process ended:
                        # what the row kept (its output's tail, then its exit) is the answer: a
                        # follower of an ended process does not wait on a bridge that is busy,
                        # or gone with its node. (The finally below detaches its attach.)
                        async for stored in _stored_output(self.handle, follower.want):
                            yield stored
                        return
                    if time.monotonic() - quiet_since < FOLLOW_IDLE_S:
                        continue
                    quiet_since = time.monotonic()
                    # Quiet for long: normal for a busy command, but if its row says it ended
                    # the bridge lost it; ask once more, then report the row's outcome.
                    ended = await _db(_ended_info)(self.handle)
                    if ended is not None and retried:
                        follower.done = True
                        yield ("exit", ended)
                    elif ended is not None:
                        retried = True
                        await self._attach(follower.want)
                    continue
                quiet_since, heard = time.monotonic(), True
                if msg.get("type") == streams.SYNCED and msg.get("bridge"):
                    bridge.instance = msg["bridge"]  # the one holding the process: its restart ends it
                for event in follower.feed(msg):
                    if event[0] == "resync":
                        await self._attach(event[1])
                    elif event[0] == "unknown":
                        async for stored in _stored_output(self.handle, follower.want):
                            yield stored
                        return
                    elif event[0] == "skipped" and self.live:
                        continue
                    else:
                        yield event
                        if event[0] == "output" and self.flow and self.auto_ack:
                            await self._auto_ack(event[3])
                if (
                    not self.follow and not follower.done and not follower.syncing
                    and follower.sync_end is not None and follower.want >= follower.sync_end
                ):  # fmt: skip
                    return
        finally:
            channel, self.channel = self.channel, ""  # a later close() has nothing left to do
            await layer.group_discard(group, channel)
            if not follower.done:
                await self._send(streams.DETACH, reply=channel)


class _BridgeWatch:
    """Whether the bridge that holds a process is still the one that did (streams' liveness
    key): asked only when a follower has heard nothing for a while, so a busy stream costs no
    Redis call. Gone: the key missing twice in a row (a Redis just restarted has lost it for a
    moment), or another bridge's instance (a restart, which ends the processes it held)."""

    def __init__(self, node_name: str | None) -> None:
        self.node_name = node_name
        self.instance: str | None = None
        self.missing = 0

    async def gone(self) -> str | None:
        if not self.node_name:
            return None
        try:
            raw = await asyncio.to_thread(redis_client().get, streams.bridge_alive_key(self.node_name))
        except Exception:  # Redis unreachable: no word either way
            return None
        now = raw.decode() if isinstance(raw, bytes) else raw
        if now is None:
            self.missing += 1
            if self.missing >= 2:
                return f"the stream bridge of node {self.node_name} stopped: no more output of this command can come"
            return None
        self.missing = 0
        if self.instance is None:
            self.instance = now
        elif now != self.instance:
            return f"the stream bridge of node {self.node_name} restarted, which ends the processes it held"
        return None


def _ended_info(target: ProcessHandle) -> dict[str, Any] | None:
    if target.key.startswith("x"):
        row = Exec.objects.filter(id=target.row_id).first()
        if row is None or row.status != Exec.Status.RUNNING:
            return _exit_of(row)
        return None
    term = Terminal.objects.filter(id=target.row_id).first()
    if term is None or term.status != Terminal.Status.RUNNING:
        return {"exit_code": term.exit_code if term else None, "signal": 0, "timed_out": False,
                "error": term.error if term else "the terminal is gone"}  # fmt: skip
    return None


def _exit_of(row: Exec | None) -> dict[str, Any]:
    if row is None:
        return {"exit_code": None, "signal": 0, "timed_out": False, "error": "the process is gone"}
    info: dict[str, Any] = {"exit_code": row.exit_code, "signal": row.signal, "timed_out": row.timed_out}
    if row.duration_ms is not None:
        info["duration_ms"] = round(row.duration_ms, 1)
    if row.error:
        info["error"] = row.error
    return info


async def _stored_output(target: ProcessHandle, offset: int) -> AsyncIterator[tuple[Any, ...]]:
    """What the row kept, for a process its bridge no longer holds (ended long ago, or lost)."""

    def load() -> tuple[list[tuple[str, bytes]], dict[str, Any]]:
        if not target.key.startswith("x"):
            info = _ended_info(target) or {
                "exit_code": None, "signal": 0, "timed_out": False,
                "error": "the terminal's node no longer holds it",
            }  # fmt: skip
            return [], info
        row = Exec.objects.filter(id=target.row_id).first()
        if row is not None and row.status == Exec.Status.RUNNING:
            Exec.objects.filter(id=row.id, status=Exec.Status.RUNNING).update(
                status=Exec.Status.FAILED,
                error="its node no longer holds this process",
                finished_at=timezone.now(),
            )
            row.refresh_from_db()
        parts = (
            []
            if row is None or offset
            else [("stdout", row.stdout.encode()), ("stderr", row.stderr.encode())]
        )
        return [p for p in parts if p[1]], _exit_of(row)

    parts, info = await _db(load)()
    end = offset
    for stream, data in parts:
        end += len(data)
        yield ("output", stream, data, end)
    yield ("exit", info)


# -- the bridge's side (sync, called from its threads) ------------------------------------------


def process_record_end(
    *, key: str, info: dict[str, Any], ring: streams.OutputRing, duration_ms: float
) -> None:
    """Write a live process's outcome to its row (exit status, the kept tail of its output);
    its node's bridge then sends the exit, then calls :func:`process_end_announce`."""
    now = timezone.now()
    error = info.get("error") or ""
    if key.startswith("x"):
        keep = settings.HANGAR_EXEC_KEEP_OUTPUT_BYTES
        _exec_update_running(int(key[1:]), {
            "status": Exec.Status.EXITED if info.get("exit_code") is not None else Exec.Status.FAILED,
            "exit_code": info.get("exit_code"), "signal": info.get("signal") or 0,
            "timed_out": bool(info.get("timed_out")),
            "stdout": ring.text("stdout", keep), "stderr": ring.text("stderr", keep),
            "stdout_bytes": ring.totals.get("stdout", 0), "stderr_bytes": ring.totals.get("stderr", 0),
            "error": error, "finished_at": now, "duration_ms": duration_ms,
        })  # fmt: skip
    elif key.startswith("t"):
        Terminal.objects.filter(id=key[1:], status=Terminal.Status.RUNNING).update(
            status=Terminal.Status.EXITED if info.get("exit_code") is not None else Terminal.Status.FAILED,
            exit_code=info.get("exit_code"), error=error, ended_at=now,
        )  # fmt: skip


def process_end_announce(*, key: str) -> None:
    """A live process's end is recorded and sent: tell who listens (a run's process: the run
    finishes)."""
    if key.startswith("x"):
        events.process_ended.send(exec_id=int(key[1:]))


def _exec_update_running(exec_id: int, values: dict[str, Any]) -> int:
    """``Exec.objects.filter(id=exec_id, status=RUNNING).update(**values)`` as one statement
    written out once: every process's end is written through here, on the node's bridge, and
    building the ORM's query cost more than running it. Values go through each field's own
    preparation for the database, as the ORM's update does."""
    fields = [f for f in Exec._meta.concrete_fields if f.name in values]
    q = connection.ops.quote_name
    sets = ", ".join(f"{q(str(f.column))} = %s" for f in fields)
    sql = f"UPDATE {q(Exec._meta.db_table)} SET {sets} WHERE {q('id')} = %s AND {q('status')} = %s"
    params = [f.get_db_prep_save(values[f.name], connection) for f in fields]
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, exec_id, Exec.Status.RUNNING.value])
        return cursor.rowcount


def process_record_pid(*, key: str, pid: int | None) -> None:
    """Write a live exec's pid to its row as its node starts it (once: a row with a pid keeps it)."""
    if key.startswith("x") and pid is not None:
        q = connection.ops.quote_name
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {q(Exec._meta.db_table)} SET {q('pid')} = %s WHERE {q('id')} = %s AND {q('pid')} IS NULL",
                [pid, int(key[1:])],
            )


def processes_mark_lost(*, node_name: str, reason: str) -> int:
    """Mark the live processes and terminals recorded on a node as ended (its bridge restarted)."""
    now = timezone.now()
    n = Exec.objects.filter(
        sandbox__node__name=node_name, status=Exec.Status.RUNNING,
        kind__in=[Exec.Kind.STREAM, Exec.Kind.BACKGROUND],
    ).update(status=Exec.Status.FAILED, error=reason, finished_at=now)  # fmt: skip
    n += Terminal.objects.filter(sandbox__node__name=node_name, status=Terminal.Status.RUNNING).update(
        status=Terminal.Status.FAILED, error=reason, ended_at=now
    )
    return n
