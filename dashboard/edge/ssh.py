"""The SSH gateway into harnesses (``hangar ssh-gateway``, started by ``hangar up``).

``ssh -p 2222 NAME@host`` opens a shell in the harness ``NAME`` (or its id) of one of the
user's teams. Keys are the users' registered public keys (``runtime.services.ssh_keys``):
public-key authentication only, the key found by its SHA256 fingerprint. A paused harness is
resumed on connect.

The gateway only moves bytes: a session becomes a live process of the harness's sandbox, held
by the node's stream bridge exactly like a browser terminal (:mod:`dashboard.websockets.consumers`), with
SSH in place of the websocket:

- a shell or ``ssh -t host cmd`` with a PTY: a terminal (``terminal_open``) in ``/workspace``,
  with the client's TERM and size; window changes resize it;
- ``ssh host cmd`` without a PTY: a streamed exec of ``/bin/sh -c cmd``, stdout and stderr kept
  apart, stdin forwarded up to its EOF, the exit status (or signal) returned;
- the ``sftp`` subsystem: the image's own ``sftp-server`` run the same way, bytes piped both
  ways (modern ``scp`` and ``sftp`` speak SFTP; ``scp -O`` runs ``scp -t`` as a plain exec).

Output is flow-controlled end to end: the bridge holds the process back while the SSH channel's
window is full (this follower acknowledges a chunk once the channel has taken it). Input waits
in a bounded buffer here; past it the channel stops reading, so the SSH window holds the client
back. When the client goes away, the process is killed. Port, agent and X11 forwarding are
refused.

A connection lasts as long as its access: when its key is deleted, its user deactivated, removed
from the harness's team or lowered below member there (``runtime.notify.auth_changed``, or the
periodic re-check of :class:`dashboard.auth_watch.AuthWatch`), its sessions are told why on
stderr, exit with 255 (their processes are killed) and the connection is closed.

Audit: ``ssh.connect`` once per authenticated connection; ``ssh.refused`` once per connection
refused for a registered key (an unknown key is only logged: anyone on the internet can offer
one, and the audit log keeps every row forever).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal as signal_module
import time
import weakref
from collections import deque
from functools import partial
from pathlib import Path
from typing import Any

import asyncssh
from django.conf import settings

from runtime.aio import blocking, within
from runtime.errors import NotFound, ServiceError
from runtime.services import audit
from runtime.services import processes as proc_svc

from ..auth_watch import AuthWatch

log = logging.getLogger("hangar.ssh")

WORKSPACE = "/workspace"
# The image's own sftp-server, wherever its distribution puts it, started in the workspace.
SFTP_SCRIPT = (
    "for p in /usr/lib/openssh/sftp-server /usr/libexec/sftp-server /usr/libexec/openssh/sftp-server "
    "/usr/lib/sftp-server /usr/lib/ssh/sftp-server; do "
    f'if [ -x "$p" ]; then exec "$p" -d {WORKSPACE}; fi; done; '
    "echo 'hangar: this image has no sftp-server (Debian: apt-get install openssh-sftp-server)' >&2; exit 127"
)
USERNAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
PASSED_ENV_RE = re.compile(r"LANG|LANGUAGE|LC_[A-Z]+")
INPUT_CHUNK = proc_svc.INPUT_CHUNK  # input bytes per message to the bridge
INPUT_HIGH = 512 * 1024  # the channel stops reading above this much unsent input…
INPUT_LOW = 128 * 1024  # …and reads again below this
TOUCH_EVERY_S = 15.0  # traffic marks the sandbox active at most this often
MAX_KEY_LOOKUPS = 10  # keys looked up per connection (OpenSSH's MaxAuthTries is 6)
GONE_EXIT = 255  # what ssh itself returns when it fails: the gateway could not run the command

_live_sessions: weakref.WeakSet[Session] = weakref.WeakSet()
_background: set[asyncio.Future[Any]] = set()


def _later(coro: Any) -> None:
    """Run a coroutine without waiting for it (keeping a reference until it ends)."""
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


# -- host key ------------------------------------------------------------------------------------


def host_key(path: Path) -> asyncssh.SSHKey:
    """The gateway's ed25519 host key: made once (0600, in a 0700 directory), then reused, so
    clients' known_hosts stay valid across restarts."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = asyncssh.generate_private_key("ssh-ed25519", comment="hangar ssh gateway")
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(key.export_private_key())
            try:
                os.link(tmp, path)  # atomic and refuses to replace: a gateway started at once wins
                log.info("generated the SSH host key %s (%s)", path, key.get_fingerprint("sha256"))
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
    if path.stat().st_mode & 0o077:
        log.warning("the SSH host key %s was readable by others; making it 0600", path)
        path.chmod(0o600)
    return asyncssh.read_private_key(str(path))


# -- authentication (run in threads) -----------------------------------------------------------


def _check_key(fingerprint: str, target: str) -> tuple[Any, Any, str]:
    """(user, harness, "") for a key that may open ``target``; else (user or None, None, why)."""
    from runtime.services.ssh_keys import harness_for_ssh, ssh_key_user

    user = ssh_key_user(fingerprint=fingerprint)
    if user is None:
        return None, None, (f"hangar: the key {fingerprint} is not registered with Hangar; add your public "
                            "key under SSH keys in the dashboard (or POST /api/v1/ssh-keys)")  # fmt: skip
    if not USERNAME_RE.fullmatch(target):
        return user, None, f"hangar: no harness {target!r} in your teams"
    try:
        harness = harness_for_ssh(user=user, target=target, fingerprint=fingerprint)
    except ServiceError as exc:
        return user, None, f"hangar: {exc.message}"
    return user, harness, ""


def _access_ended(fingerprint: str, user_id: int, target: str, harness_id: str) -> str:
    from runtime.services.ssh_keys import ssh_access_ended

    return ssh_access_ended(fingerprint=fingerprint, user_id=user_id, target=target, harness_id=harness_id)


def _record(action: str, *, actor: audit.Actor, outcome: str = "ok", **fields: Any) -> None:
    try:
        audit.record(action, actor=actor, outcome=outcome, **fields)
    except Exception:
        log.exception("could not record %s in the audit log", action)


class Gateway(asyncssh.SSHServer):
    """One SSH connection: who it is (key, user, harness) and its sessions."""

    def __init__(self) -> None:
        self.conn: asyncssh.SSHServerConnection | None = None
        self.ip = ""
        self.checked: dict[tuple[str, str], tuple[Any, Any, str]] = {}
        self.accepted: tuple[Any, Any, str, str] | None = None  # (user, harness, fingerprint, target)
        self.lookups = 0
        self.refused: tuple[Any, str, str, str] | None = None  # (user, target, why, fingerprint)
        self.banner_sent = False
        self.actor: audit.Actor | None = None
        self.sessions: set[Session] = set()
        self.watch: AuthWatch | None = None
        self.watcher: asyncio.Future[None] | None = None

    # asyncssh calls these ------------------------------------------------------------------

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.conn = conn
        peer = conn.get_extra_info("peername")
        self.ip = str(peer[0]) if peer else ""

    def connection_lost(self, exc: Exception | None) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
        if self.actor is None and self.refused is not None:
            user, target, why, fingerprint = self.refused
            actor = audit.Actor(via="ssh", user_id=user.pk, username=user.get_username(), ip=self.ip)
            _later(blocking(_record)("ssh.refused", actor=actor, outcome="refused", target=target[:200],
                                     message=why.removeprefix("hangar: "), fingerprint=fingerprint))  # fmt: skip

    def begin_auth(self, username: str) -> bool:
        return True  # authentication is always required

    def password_auth_supported(self) -> bool:
        return False

    def kbdint_auth_supported(self) -> bool:
        return False

    def host_based_auth_supported(self) -> bool:
        return False

    def public_key_auth_supported(self) -> bool:
        return True

    async def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        fingerprint = key.get_fingerprint("sha256")
        # Called for the client's query and again for its signed request: look up once.
        result = self.checked.get((username, fingerprint))
        if result is None:
            self.lookups += 1
            if self.lookups > MAX_KEY_LOOKUPS:
                return False  # a client trying key after key: no more database work for it
            result = await blocking(_check_key)(fingerprint, username)
            self.checked[(username, fingerprint)] = result
        user, harness, why = result
        if harness is None:
            log.info("ssh: refused %s for %r from %s: %s", fingerprint, username, self.ip, why)
            if user is not None:
                self.refused = (user, username, why, fingerprint)
            self._banner(why)
            return False
        # The last key accepted is the one whose signature completes the authentication: the
        # signed request is validated again right before success, with no await in between.
        self.accepted = (user, harness, fingerprint, username)
        return True

    async def auth_completed(self) -> None:
        assert self.accepted is not None
        user, harness, fingerprint, _ = self.accepted
        self.actor = audit.Actor(via="ssh", user_id=user.pk, username=user.get_username(), ip=self.ip)
        log.info("ssh: %s (%s) connected to harness %s from %s", user.get_username(), fingerprint, harness.id,
                 self.ip)  # fmt: skip
        await blocking(_record)("ssh.connect", actor=self.actor, team=harness.team,
                                target=f"{harness.name} ({harness.id})", fingerprint=fingerprint)  # fmt: skip
        check = blocking(partial(_access_ended, fingerprint, user.pk, self.accepted[3], harness.id))
        self.watch = AuthWatch(user.pk, check)
        self.watcher = asyncio.ensure_future(self._end_with_access(self.watch))

    def session_requested(self) -> Session:
        return Session(self)

    async def _end_with_access(self, watch: AuthWatch) -> None:
        """Once the connection's access ends: its sessions, then the connection."""
        watch.start()
        try:
            await watch.ended.wait()
        finally:
            await watch.stop()
        log.info("ssh: connection of %s from %s ended: %s", self._who(), self.ip, watch.why)
        sessions = list(self.sessions)
        for session in sessions:
            session.end(watch.why)
        # Their messages and exit statuses go out before the connection closes.
        with contextlib.suppress(Exception):
            await within(asyncio.gather(*(s.chan.wait_closed() for s in sessions if s.chan is not None)), 5)
        if self.conn is not None:
            self.conn.close()

    def _who(self) -> str:
        return self.accepted[0].get_username() if self.accepted else "?"

    # refused by not overriding: connection_requested / server_requested (port forwarding),
    # unix_* (socket forwarding); agent and X11 forwarding are off in the server's options.

    def _banner(self, text: str) -> None:
        if self.banner_sent or self.conn is None:
            return
        self.banner_sent = True
        with contextlib.suppress(OSError):
            self.conn.send_auth_banner(text + "\n")


# -- sessions --------------------------------------------------------------------------------------


def _ensure_running(harness_id: str, target: str, user_id: int, actor: audit.Actor, timeout: float) -> Any:
    """The harness, running (resumed if need be), with its sandbox and node loaded; the user's
    access is checked again (a multiplexed connection can outlive a removal from the team)."""
    from django.contrib.auth import get_user_model

    from runtime.models import Sandbox
    from runtime.services.harnesses import harness_ensure_running
    from runtime.services.ssh_keys import harness_for_ssh

    user = get_user_model().objects.filter(pk=user_id, is_active=True).first()
    if user is None:
        raise NotFound("your account is no longer active")
    h = harness_for_ssh(user=user, target=target)
    if h.id != harness_id:
        raise NotFound(f"harness {target!r} changed since you connected; connect again")
    with audit.acting(actor):
        h = harness_ensure_running(harness=h, timeout=timeout, user=user)
    sandbox = Sandbox.objects.select_related("node").get(id=h.sandbox_id)
    return user, h, sandbox


def _harness_state(harness_id: str) -> tuple[str, str]:
    from runtime.models import Harness
    from runtime.services.harnesses import harness_status

    h = Harness.objects.select_related("sandbox").filter(id=harness_id).first()
    return (harness_status(h), h.name) if h is not None else ("deleted", harness_id)


def _mark_active(sandbox_id: str) -> None:
    from runtime.services.sandbox_calls import sandbox_mark_active

    sandbox_mark_active(sandbox_id)


class Session(asyncssh.SSHServerSession[bytes]):
    """One SSH channel: a shell, a command or the sftp subsystem, as a live process."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.chan: asyncssh.SSHServerChannel[bytes] | None = None
        self.pty = False
        self.term = "xterm-256color"
        self.rows, self.cols = 24, 80
        self.kind = ""  # shell | exec | sftp
        self.command = ""
        # ("data", bytes) | ("eof",) | ("resize", rows, cols) | ("signal", n), in arrival order
        self.inbox: deque[tuple[Any, ...]] = deque()
        self.inbox_bytes = 0
        self.inbox_ready = asyncio.Event()
        self.reading_paused = False
        self.writable = asyncio.Event()
        self.writable.set()
        self.closed = asyncio.Event()
        self.process: proc_svc.ProcessHandle | None = None
        self.sandbox_id = ""
        self.finished = False
        self.touched = 0.0
        self.task: asyncio.Task[None] | None = None

    # asyncssh calls these ------------------------------------------------------------------

    def connection_made(self, chan: asyncssh.SSHServerChannel[bytes]) -> None:
        self.chan = chan

    def pty_requested(self, term_type: str, term_size: tuple[int, int, int, int], term_modes: Any) -> bool:
        self.pty = True
        self.term = term_type if term_type and re.fullmatch(r"[A-Za-z0-9._+-]{1,64}", term_type) else "xterm"
        self.cols, self.rows = _size(term_size[0], 80), _size(term_size[1], 24)
        return True

    def shell_requested(self) -> bool:
        self.kind = "shell"
        return True

    def exec_requested(self, command: str) -> bool:
        if "\0" in command:
            return False
        self.kind, self.command = "exec", command
        return True

    def subsystem_requested(self, subsystem: str) -> bool:
        if subsystem != "sftp":
            return False
        self.kind = "sftp"
        return True

    def session_started(self) -> None:
        _live_sessions.add(self)
        self.gateway.sessions.add(self)
        self.task = asyncio.ensure_future(self._run())

    def data_received(self, data: bytes, datatype: Any) -> None:
        self._queue(("data", bytes(data)))
        self.inbox_bytes += len(data)
        if self.inbox_bytes > INPUT_HIGH and not self.reading_paused and self.chan is not None:
            self.reading_paused = True
            self.chan.pause_reading()

    def eof_received(self) -> bool:
        self._queue(("eof",))
        return True  # half-open: the output still flows until the process exits

    def terminal_size_changed(self, width: int, height: int, pixwidth: int, pixheight: int) -> None:
        self._queue(("resize", _size(height, 24), _size(width, 80)))

    def signal_received(self, signal: str) -> None:
        with contextlib.suppress(ServiceError):
            self._queue(("signal", proc_svc.signal_number(signal)))

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()
        self.writable.set()

    # the session ---------------------------------------------------------------------------

    def _queue(self, item: tuple[Any, ...]) -> None:
        self.inbox.append(item)
        self.inbox_ready.set()

    def _nl(self) -> str:
        return "\r\n" if self.pty else "\n"

    def _say(self, text: str) -> None:
        """A line from the gateway itself, on the client's stderr."""
        if self.chan is not None and not self.closed.is_set():
            with contextlib.suppress(OSError):
                self.chan.write_stderr((text + self._nl()).encode())

    def _exit(self, code: int) -> None:
        if self.chan is not None:
            with contextlib.suppress(OSError):
                self.chan.exit(code)

    def end(self, why: str) -> None:
        """Its access ended: say why and exit (closing the channel, which kills the process)."""
        self._say(f"hangar: access ended: {why}")
        self._exit(GONE_EXIT)
        # As if the client had gone: the pipe stops at once and the process is killed.
        self.closed.set()
        self.writable.set()

    async def _run(self) -> None:
        try:
            await self._serve()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("ssh: session on harness %s failed", self._harness_label())
            self._say("hangar: the gateway failed to run this session (see its log)")
            self._exit(GONE_EXIT)
        finally:
            await self._kill()

    def _harness_label(self) -> str:
        accepted = self.gateway.accepted
        return accepted[1].id if accepted else "?"

    async def _serve(self) -> None:
        gw = self.gateway
        assert gw.accepted is not None and gw.actor is not None and self.chan is not None
        user, harness, _, target = gw.accepted
        if not self.kind:
            self._say("hangar: nothing to run (ask for a shell, a command or the sftp subsystem)")
            self._exit(GONE_EXIT)
            return
        state, name = await blocking(_harness_state)(harness.id)
        if state in ("paused", "pausing", "resuming"):
            self._say(f"hangar: resuming harness {name}…")
        elif state != "running":
            self._say(f"hangar: harness {name} is {state}; waiting for it…")
        try:
            user, harness, sandbox = await blocking(_ensure_running)(
                harness.id, target, user.pk, gw.actor, float(settings.HANGAR_HARNESS_RESUME_WAIT_S)
            )
        except ServiceError as exc:
            self._say(f"hangar: {exc.message}")
            self._exit(GONE_EXIT)
            return
        if self.closed.is_set():
            return
        if harness.setup == "failed":
            self._say(f"hangar: warning: the workspace setup failed: {harness.setup_error}")
        self.sandbox_id = sandbox.id
        sent = self.chan.get_environment()
        env = {k: v for k, v in sent.items() if PASSED_ENV_RE.fullmatch(k) and "\0" not in v}
        try:
            if self.pty:
                row = await self._started(proc_svc.terminal_open(
                    sandbox=sandbox, name=f"ssh {user.get_username()}"[:64],
                    cmd=["/bin/sh", "-c", self.command] if self.kind == "exec" else None,
                    cwd=WORKSPACE, env={**env, "TERM": self.term}, rows=self.rows, cols=self.cols, user=user,
                ), sandbox, terminal=True)  # fmt: skip
            else:
                if self.kind == "sftp":
                    cmd: list[str] = ["/bin/sh", "-c", SFTP_SCRIPT]
                elif self.kind == "exec":
                    cmd = ["/bin/sh", "-c", self.command]
                else:
                    cmd = list(proc_svc.DEFAULT_SHELL)
                row = await self._started(proc_svc.process_start(
                    sandbox=sandbox, cmd=cmd, kind="stream", cwd=WORKSPACE, env=env, stdin_open=True,
                    tty=False, user=user,
                ), sandbox, terminal=False)  # fmt: skip
        except ServiceError as exc:
            self._say(f"hangar: {exc.message}")
            self._exit(GONE_EXIT)
            return
        assert sandbox.node is not None
        self.process = _handle(sandbox, row.id, terminal=self.pty)
        log.info("ssh: %s runs %s %s in harness %s", user.get_username(), self.kind, row.id, harness.id)
        await self._pipe()

    async def _started(self, start: Any, sandbox: Any, *, terminal: bool) -> Any:
        """The started process's row. Cancelled meanwhile (the gateway stops, the client
        goes): the start is let finish, and the process is known, so that it is killed."""
        task = asyncio.ensure_future(start)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                row = await within(task, 15)
                self.process = _handle(sandbox, row.id, terminal=terminal)
            raise

    async def _pipe(self) -> None:
        output = asyncio.ensure_future(self._pump_output())
        inp = asyncio.ensure_future(self._pump_input())
        closed = asyncio.ensure_future(self.closed.wait())
        try:
            await asyncio.wait({output, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (output, inp, closed):
                task.cancel()  # no-op for one that is done
            await asyncio.gather(output, inp, closed, return_exceptions=True)
        if self.closed.is_set() or output.cancelled():
            return  # the client went away: _kill ends the process
        exc = output.exception()
        if exc is not None:
            raise exc
        info = output.result()
        if info is not None:
            self.finished = True
            self._finish(info)

    async def _pump_output(self) -> dict[str, Any] | None:
        assert self.process is not None and self.chan is not None
        follow = self.process.follow(offset=0, flow=True, auto_ack=False)
        async for event in follow:
            if event[0] == "output":
                _, stream, data, end = event
                if self.closed.is_set():
                    return None
                self.chan.write(data, asyncssh.EXTENDED_DATA_STDERR if stream == "stderr" else None)
                self._touch()
                # Acknowledged once the channel has room again: a slow client holds the
                # process back instead of filling memory here or in the bridge.
                await self.writable.wait()
                await follow.ack(end)
            elif event[0] == "skipped":
                if not self.pty:
                    # Lost bytes would corrupt a file transfer or a command's output: stop.
                    self._say(f"hangar: {event[1]} bytes of output were lost (the client read too slowly)")
                    return {"exit_code": None, "signal": 0, "error": "output lost"}
            elif event[0] == "exit":
                return dict(event[1])
        return {"exit_code": None, "signal": 0, "error": "the process's output stream ended"}

    async def _pump_input(self) -> None:
        process = self.process
        assert process is not None
        input_sender = process.input_sender()
        while True:
            if not self.inbox:
                self.inbox_ready.clear()
                await self.inbox_ready.wait()
                continue
            # Input that comes in while a change of access is being checked waits for the outcome.
            if self.gateway.watch is not None and not await self.gateway.watch.may_go_on():
                return
            item = self.inbox.popleft()
            if item[0] == "data":
                data = bytearray(item[1])
                while self.inbox and self.inbox[0][0] == "data" and len(data) < INPUT_CHUNK:
                    data += self.inbox.popleft()[1]
                self.inbox_bytes -= len(data)
                if self.reading_paused and self.inbox_bytes < INPUT_LOW and self.chan is not None:
                    self.reading_paused = False
                    self.chan.resume_reading()
                self._touch()
                # At most a window in flight: while the command does not read, this waits, the
                # inbox fills, the channel stops reading and SSH's window holds the client.
                try:
                    await input_sender.send(bytes(data))
                except proc_svc.InputRefused as exc:
                    await self._input_refused(exc)
                    return
            elif item[0] == "eof":
                # A PTY has no half-close (sshd ignores it too): the shell ends when it exits.
                if not self.pty:
                    # Only once all of the input is in: a refusal heard of after the EOF would
                    # leave the command with a stream that ends early, and say it was whole.
                    try:
                        while not await input_sender.drain(60.0):
                            pass
                    except proc_svc.InputRefused as exc:
                        await self._input_refused(exc)
                        return
                    await process.close_input()
            elif item[0] == "resize":
                if self.pty:
                    await process.resize(item[1], item[2])
            elif item[0] == "signal":
                await process.signal(item[1])

    async def _input_refused(self, exc: proc_svc.InputRefused) -> None:
        """Part of the client's input was refused (the command left too much unread, with
        other input beside this session's): the command must not go on with a stream that has
        a gap in it, so it is ended, and the client is told why."""
        self._say(f"hangar: input refused: {exc.message}; the command was ended")
        assert self.process is not None
        with contextlib.suppress(Exception):
            await self.process.kill()

    def _touch(self) -> None:
        now = time.monotonic()
        if self.sandbox_id and now - self.touched >= TOUCH_EVERY_S:
            self.touched = now
            _later(blocking(_mark_active)(self.sandbox_id))

    def _finish(self, info: dict[str, Any]) -> None:
        sig = int(info.get("signal") or 0)
        code = info.get("exit_code")
        if code is None:
            self._say(f"hangar: {info.get('error') or 'the process ended without an exit status'}")
            self._exit(GONE_EXIT)
        elif sig:
            try:
                name = signal_module.Signals(sig).name.removeprefix("SIG")
            except ValueError:
                self._exit(128 + sig)
                return
            if self.chan is not None:
                with contextlib.suppress(OSError):
                    self.chan.exit_with_signal(name, False, "", "")
        else:
            self._exit(int(code))

    async def _kill(self) -> None:
        """End the process if it still runs (the client went away, or the gateway stops)."""
        _live_sessions.discard(self)
        self.gateway.sessions.discard(self)
        if self.process is not None and not self.finished:
            self.finished = True
            with contextlib.suppress(Exception):
                await self.process.kill()


def _handle(sandbox: Any, row_id: Any, *, terminal: bool) -> proc_svc.ProcessHandle:
    """The session's process; its messages wait out a full channel (a client's input and
    controls must not be lost)."""
    make = proc_svc.ProcessHandle.of_terminal if terminal else proc_svc.ProcessHandle.of_exec
    return make(sandbox, row_id).patiently()


def _size(value: int, default: int) -> int:
    return min(1000, int(value)) if value and value > 0 else default


# -- running ---------------------------------------------------------------------------------------


async def run_gateway(host: str, port: int, ready: asyncio.Event | None = None) -> None:
    """Serve SSH on ``host:port`` until cancelled; on the way out, end the sessions' processes."""
    key = host_key(Path(settings.HANGAR_SSH_HOST_KEY))
    server = await asyncssh.create_server(
        Gateway, host, port, server_host_keys=[key], encoding=None, allow_pty=True, line_editor=False,
        agent_forwarding=False, x11_forwarding=False, password_auth=False, kbdint_auth=False,
        keepalive_interval=30, keepalive_count_max=3, login_timeout=60, server_version="Hangar",
    )  # fmt: skip
    bound = ", ".join(f"{s.getsockname()[0]}:{s.getsockname()[1]}" for s in server.sockets)
    log.info("ssh gateway listening on %s (host key %s)", bound, key.get_fingerprint("sha256"))
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        server.close()
        # The sessions' processes first, all at once (a cancelled task's own cleanup could be
        # cut short), then the sessions' tasks.
        sessions = list(_live_sessions)
        with contextlib.suppress(Exception):
            await within(asyncio.gather(*(s._kill() for s in sessions), return_exceptions=True), 10)
        tasks = [s.task for s in sessions if s.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=20)


def main(host: str | None = None, port: int | None = None) -> None:
    """``hangar ssh-gateway``: run the gateway until SIGTERM or Ctrl-C (Django is set up)."""
    logging.getLogger("asyncssh").setLevel(logging.WARNING)  # a line per packet exchange at INFO
    host = settings.HANGAR_SSH_BIND if host is None else host
    port = settings.HANGAR_SSH_PORT if port is None else port

    async def serve() -> None:
        task = asyncio.ensure_future(run_gateway(host, port))
        loop = asyncio.get_running_loop()
        for signum in (signal_module.SIGTERM, signal_module.SIGINT):
            loop.add_signal_handler(signum, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            log.info("ssh gateway stopped")
        except OSError as exc:
            raise SystemExit(f"hangar ssh-gateway: cannot listen on {host}:{port}: {exc} (set HANGAR_SSH_PORT "
                             "to a free port, or to 0 for no SSH gateway)") from None  # fmt: skip

    asyncio.run(serve())
