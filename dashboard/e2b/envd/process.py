"""envd's ``process.Process`` service on Hangar's live processes (:mod:`runtime.services.processes`):
every command is a background process of the sandbox, so it outlives the call that started it
and is found again by its pid; a stream that ends (the client left, its access ended) only
stops following it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from django.conf import settings
from django.http import HttpRequest

from dashboard.auth_watch import AuthWatch
from runtime.aio import blocking
from runtime.errors import InvalidValue, ServiceError
from runtime.models import Exec
from runtime.services import processes as proc_svc
from runtime.services import sandbox_io as io_svc
from runtime.services import spans

from . import users
from .protocol import Caller, RpcError, b64, require_running, still_authorised, unb64

# A command that runs as root with the program it names starts as it is (bash where asked for
# and the image has it, else /bin/sh: busybox images have no bash). One on a PTY, or as another
# user, starts through this script: ``$1`` the user, ``$2`` the program, the rest its arguments;
# its ``$0`` marks it, so :func:`_config` and a reconnect read back what it was.
_LAUNCH = (
    'u=$1; p=$2; shift 2; if [ "$p" = /bin/bash ] && [ ! -x /bin/bash ]; then p=/bin/sh; fi; '
    'if [ -z "$u" ] || [ "$u" = root ]; then exec "$p" "$@"; fi; '
    'id -u "$u" >/dev/null 2>&1 || { echo "user $u does not exist in this sandbox" >&2; exit 126; }; '
    # Options first, then --: busybox's su would take the program's own options (-i, -l) as its.
    'exec su -s /bin/sh -c \'exec "$0" "$@"\' -- "$u" "$p" "$@"'
)
_SH = ["/bin/sh", "-c", _LAUNCH]
_MARK_CMD, _MARK_PTY = "e2b-process", "e2b-pty"
_HAS_BASH: dict[str, bool] = {}  # sandbox id -> whether its /bin holds bash (looked up once)
STDIN_WAIT_S = 5.0
_CLOSING: set[asyncio.Future[None]] = set()
# A stream's first moments are covered by the check at its start; a watch on the token (a
# Redis channel of its own) is set up only for streams that last longer than this.
WATCH_AFTER_S = 0.5


def _has_bash(caller: Caller) -> None:
    """Note whether the sandbox's image has /bin/bash, asked of its agent once per sandbox (a
    command then starts with no shell in front of it to choose; one that could not tell, with)."""
    try:
        with spans.silenced():  # Hangar's own question, not the caller's: no file.list span
            names = {e.name for e in io_svc.sandbox_file_list(sandbox=caller.sandbox, path="/bin")}
    except ServiceError:
        return
    if len(_HAS_BASH) > 10_000:
        _HAS_BASH.clear()
    _HAS_BASH[caller.sandbox.id] = "bash" in names


def _argv(caller: Caller, cmd: str, args: list[str], pty: bool, user: str) -> list[str]:
    if not cmd:
        raise RpcError("invalid_argument", "process.cmd is empty")
    if not pty and user in ("", "root"):
        has_bash = _HAS_BASH.get(caller.sandbox.id) if cmd == "/bin/bash" else True
        if has_bash is not None:
            return [cmd if has_bash else "/bin/sh", *args]
    return [*_SH, _MARK_PTY if pty else _MARK_CMD, user, cmd, *args]


def _is_pty(row: Exec) -> bool:
    return len(row.argv) > 4 and row.argv[:3] == _SH and row.argv[3] == _MARK_PTY


def _config(row: Exec) -> dict[str, Any]:
    argv = list(row.argv)
    if argv[:3] == _SH and len(argv) > 5:
        argv = argv[5:]
    config: dict[str, Any] = {"cmd": argv[0] if argv else "", "args": argv[1:], "envs": {}}
    if row.cwd:
        config["cwd"] = row.cwd
    return config


def _selected(caller: Caller, selector: dict[str, Any] | None) -> Exec:
    """The live process a ``ProcessSelector`` names (by pid; Hangar keeps no tags)."""
    selector = selector or {}
    if "tag" in selector:
        raise RpcError(
            "not_found", f"no process tagged {selector['tag']!r} (Hangar's processes have no tags)"
        )
    pid = selector.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        raise RpcError("invalid_argument", "process.pid must be a number")
    row = (
        proc_svc.processes_for_sandbox(sandbox=caller.sandbox, status=Exec.Status.RUNNING)
        .filter(pid=pid)
        .order_by("-id")
        .first()
    )
    if row is None:
        raise RpcError("not_found", f"process with pid {pid} not found")
    return row


def _handle(caller: Caller, row: Exec) -> proc_svc.ProcessHandle:
    return proc_svc.ProcessHandle.of_exec(caller.sandbox, row.id)


async def _live(caller: Caller, message: dict[str, Any]) -> tuple[Exec, proc_svc.ProcessHandle]:
    def find() -> Exec:
        require_running(caller)
        return _selected(caller, message.get("process"))

    row = await blocking(find)()
    return row, _handle(caller, row)


# -- streams ------------------------------------------------------------------------------------


def _keepalive_s(request: HttpRequest) -> float:
    """How often a quiet stream says it is alive: as the SDK asks (``Keepalive-Ping-Interval``,
    seconds), at most ``HANGAR_STREAM_KEEPALIVE_S`` (proxies cut quieter connections)."""
    most = float(settings.HANGAR_STREAM_KEEPALIVE_S)
    try:
        asked = float(request.headers.get("Keepalive-Ping-Interval", most))
    except ValueError:
        asked = most
    return min(max(asked, 1.0), most)


def _end(info: dict[str, Any]) -> dict[str, Any]:
    code, sig = info.get("exit_code"), int(info.get("signal") or 0)
    end: dict[str, Any]
    if code is not None and not sig:
        end = {"exitCode": int(code), "exited": True, "status": f"exit status {code}"}
    else:
        # As Go's ProcessState says of a process a signal ended: exit code -1, not exited.
        end = {"exitCode": -1, "exited": False, "status": f"signal: {sig}" if sig else "terminated"}
    if info.get("timed_out"):
        end["error"] = "timed out"
    elif info.get("error"):
        end["error"] = str(info["error"])
    return {"event": {"end": end}}


async def _events(
    caller: Caller, follow: proc_svc.ProcessFollow, pty: bool, keepalive_s: float
) -> AsyncIterator[dict[str, Any]]:
    """The follow's output and end as ``ProcessEvent``s, a keepalive after ``keepalive_s`` of
    quiet; while the caller's access lasts (an ``unauthenticated`` error once it ends)."""
    token = caller.token
    watch = AuthWatch(token.user_id, blocking(lambda: still_authorised(caller)), expires_at=token.expires_at)
    watching = asyncio.ensure_future(_watch_later(watch))
    it = follow.__aiter__()
    ended = asyncio.ensure_future(watch.ended.wait())
    nxt: asyncio.Future[Any] | None = None
    try:
        while True:
            nxt = nxt or asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait(
                {nxt, ended}, timeout=keepalive_s, return_when=asyncio.FIRST_COMPLETED
            )
            if nxt in done:
                try:
                    event = nxt.result()
                except StopAsyncIteration:
                    return
                nxt = None
                if event[0] == "output":
                    kind = "pty" if pty else event[1]
                    yield {"event": {"data": {kind: b64(event[2])}}}
                elif event[0] == "exit":
                    yield _end(event[1])
                    return
            elif ended in done:
                raise RpcError("unauthenticated", f"access ended: {watch.why}")
            else:
                yield {"event": {"keepalive": {}}}
    finally:
        ended.cancel()
        watching.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()
            await asyncio.wait({nxt}, timeout=5)
        # Leaving the follow's group and stopping the watch take round trips through Redis:
        # not on the way to the stream's end.
        closing = asyncio.ensure_future(_close(follow, it, watch))
        _CLOSING.add(closing)  # held until done: the loop keeps only a weak reference to a task
        closing.add_done_callback(_CLOSING.discard)


async def _close(follow: proc_svc.ProcessFollow, it: Any, watch: AuthWatch) -> None:
    with contextlib.suppress(Exception):
        await it.aclose()
        await follow.close()  # opened with the start and never iterated: still listening
    await watch.stop()


async def _watch_later(watch: Any) -> None:
    await asyncio.sleep(WATCH_AFTER_S)
    why = await watch.check()  # anything that changed before the watch listened
    if why:
        watch.why = why
        watch.ended.set()
        return
    watch.start()


async def start(
    caller: Caller, message: dict[str, Any], request: HttpRequest
) -> AsyncIterator[dict[str, Any]]:
    """``Start``: run a command (on a PTY when ``pty`` is given), then its output and end."""
    require_running(caller)
    config = message.get("process") or {}
    pty = message.get("pty")
    size = (pty or {}).get("size") or {}
    rows, cols = int(size.get("rows") or 24), int(size.get("cols") or 80)
    cmd, args = str(config.get("cmd") or ""), [str(a) for a in config.get("args") or []]
    if cmd == "/bin/bash" and caller.sandbox.id not in _HAS_BASH:
        await blocking(_has_bash)(caller)
    # The user the SDK named, else the image's own (as E2B's templates run as theirs).
    user = caller.user or users.known_default_user(caller)
    if user is None:
        user = await blocking(users.default_user)(caller)
    argv = _argv(caller, cmd, args, pty is not None, user)
    envs = {str(k): str(v) for k, v in (config.get("envs") or {}).items()}
    if pty is not None:
        envs = {"TERM": "xterm-256color", **envs}
    stdin = message.get("stdin", True) is not False or pty is not None
    try:
        # Followed from its first byte: the follower attaches with the start (one round trip).
        row, follow = await proc_svc.process_start_followed(
            sandbox=caller.sandbox, cmd=argv, kind=Exec.Kind.BACKGROUND, cwd=config.get("cwd") or None,
            env=envs, stdin_open=stdin, tty=pty is not None, rows=rows, cols=cols, user=caller.token.user,
        )  # fmt: skip
    except InvalidValue as exc:
        raise RpcError("invalid_argument", exc.message) from None
    try:
        yield {"event": {"start": {"pid": row.pid or 0}}}
    except BaseException:  # the client left at the start: the process runs on, unfollowed
        await follow.close()
        raise
    async for event in _events(caller, follow, pty is not None, _keepalive_s(request)):
        yield event


async def connect(
    caller: Caller, message: dict[str, Any], request: HttpRequest
) -> AsyncIterator[dict[str, Any]]:
    """``Connect``: follow a running process's output from now on, then its end."""
    row, handle = await _live(caller, message)
    yield {"event": {"start": {"pid": row.pid or 0}}}
    async for event in _events(caller, handle.follow(live=True), _is_pty(row), _keepalive_s(request)):
        yield event


# -- unary calls --------------------------------------------------------------------------------


async def list_processes(caller: Caller, message: dict[str, Any]) -> dict[str, Any]:
    def rows() -> list[Exec]:
        require_running(caller)
        return list(proc_svc.processes_for_sandbox(sandbox=caller.sandbox, status=Exec.Status.RUNNING)[:1000])

    found = await blocking(rows)()
    return {"processes": [{"config": _config(r), "pid": r.pid} for r in found if r.pid]}


async def _send(handle: proc_svc.ProcessHandle, data: bytes) -> None:
    limit = settings.HANGAR_STDIN_PENDING_BYTES
    if len(data) > limit:
        raise RpcError("resource_exhausted", f"at most {limit} bytes of input per message")
    sender = handle.input_sender()
    await sender.send(data, whole=True)
    await sender.drain(STDIN_WAIT_S)


def _input(value: dict[str, Any] | None) -> bytes:
    value = value or {}
    for kind in ("stdin", "pty"):
        if kind in value:
            return unb64(value[kind], f"input.{kind}")
    return b""


async def send_input(caller: Caller, message: dict[str, Any]) -> dict[str, Any]:
    _, handle = await _live(caller, message)
    if data := _input(message.get("input")):
        await _send(handle, data)
    return {}


async def stream_input(caller: Caller, message: dict[str, Any]) -> dict[str, Any]:
    """``StreamInput``: a start naming the process, then its input in order (Hangar's server
    takes a request whole before it answers, so the input goes to the process once the client
    has sent all of it)."""
    messages = message["messages"]
    if not messages or "start" not in messages[0]:
        raise RpcError("invalid_argument", "the input stream must begin with a start event")
    _, handle = await _live(caller, messages[0]["start"])
    for event in messages[1:]:
        if "data" in event and (data := _input((event["data"] or {}).get("input"))):
            await _send(handle, data)
    return {}


async def send_signal(caller: Caller, message: dict[str, Any]) -> dict[str, Any]:
    _, handle = await _live(caller, message)
    signal = message.get("signal")
    if signal in ("SIGNAL_SIGKILL", 9):
        await handle.kill()
    elif signal in ("SIGNAL_SIGTERM", 15):
        await handle.signal(15)
    else:
        raise RpcError("invalid_argument", f"signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM, got {signal!r}")
    return {}


async def close_stdin(caller: Caller, message: dict[str, Any]) -> dict[str, Any]:
    _, handle = await _live(caller, message)
    await handle.close_input()
    return {}


async def update(caller: Caller, message: dict[str, Any]) -> dict[str, Any]:
    _, handle = await _live(caller, message)
    size = (message.get("pty") or {}).get("size")
    if size:
        rows, cols = int(size.get("rows") or 0), int(size.get("cols") or 0)
        if not (1 <= rows <= 1000 and 1 <= cols <= 1000):
            raise RpcError("invalid_argument", f"rows and cols must be between 1 and 1000, got {rows}x{cols}")
        await handle.resize(rows, cols)
    return {}
