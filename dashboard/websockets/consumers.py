"""Websocket consumers: terminals, streamed exec, and live dashboard pages.

They authenticate (``dashboard.websockets.ws_auth``), check that the caller's team owns what they touch,
and then only move bytes between the socket and the services: the processes themselves live
in the node's stream bridge, so a socket closing never ends a terminal.

Terminal protocol (``/ws/v1/terminals/{id}``): binary frames both ways are terminal bytes;
text frames are small JSON control messages. Client → server: ``{"type": "resize", "rows",
"cols"}``, ``{"type": "ack", "bytes": n}`` (bytes of binary frames consumed; only with
``?flow=1``), ``{"type": "ping"}``, ``{"type": "input", "data": "text"}``. Server → client:
``{"type": "pong"}``, ``{"type": "skipped", "bytes"}``, ``{"type": "exit", "exit_code", …}``
and then a close. With ``?flow=1`` the shell is held back while the client has more than
128 KiB unacknowledged (the xterm.js flow-control guide); without it the server counts a frame
as consumed once it is handed to the socket.

Every socket is watched from its acceptance (:meth:`_Base.accept`): it joins its user's group
(``runtime.notify.auth_group``), and on an ``auth.changed`` message, and every
``HANGAR_AUTH_RECHECK_S`` and at its token's expiry, it checks again who it acts for. A token
revoked or expired, or a user deactivated or out of the team, closes it with 4401 (a signed-in
session whose user left the socket's team: 4403), after an ``error`` frame where the protocol
has them; a member lowered to viewer watches on but may no longer type, resize or start.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import json
import logging
import time
from collections import deque
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.contrib.auth import get_user_model
from django.template.loader import render_to_string
from django.utils import timezone

from runtime.aio import stop
from runtime.errors import ServiceError
from runtime.models import Exec, ImageJob, Membership, Sandbox, Team
from runtime.notify import auth_group
from runtime.services import processes as proc_svc
from runtime.services import sandboxes as svc
from runtime.services.auth import role_at_least, token_allows, token_current

from ..live import hub
from ..pages.teams import session_team
from . import ws_frames as frames
from .ws_auth import same_origin

log = logging.getLogger(__name__)

CLOSE_UNAUTHORIZED = 4401
CLOSE_NOT_FOUND = 4404
CLOSE_BAD_REQUEST = 4400
CLOSE_FORBIDDEN = 4403
PAGE_CATCH_UP = 100  # rows a live list catches up on when its socket opens
REFUSAL_EVERY_S = 2.0  # refused input is said to a websocket client at most this often
VIEWER_REFUSAL = "viewers of this team can watch but not type, resize or start commands"


SCOPE_REFUSAL = "this token lacks the scope 'sandboxes:read' (it has: {scopes})"


def _identity(scope: dict[str, Any]) -> tuple[Any, Team, bool] | str | None:
    """(user, team, may change things) for a token or a same-origin session; None if neither;
    why, for a valid token whose scopes do not reach sandboxes (a 4403, as the REST API's 403).
    A team's viewers may watch terminals and commands but not type into them or start any."""
    token = scope.get("api_token")
    if token is not None:
        # A token's own role and scopes bound it here as on the REST API.
        if not token_allows(token, "sandboxes:read"):
            return SCOPE_REFUSAL.format(scopes=", ".join(token.scopes))
        may_change = role_at_least(token.effective_role, "member") and token_allows(token, "sandboxes:write")
        return token.user, token.team, may_change
    if scope.get("token_presented"):
        return None  # a bad token is not rescued by a cookie
    user = scope.get("user")
    if user is None or not user.is_authenticated or not same_origin(scope):
        return None
    team = session_team(user=user, session=scope.get("session"))
    if team is None:
        return None
    role = Membership.objects.filter(user=user, team=team).values_list("role", flat=True).first()
    return user, team, role is not None and role != Membership.Role.VIEWER


def _identity_now(scope: dict[str, Any], team_id: int | None) -> tuple[int, bool]:
    """(close code, may change things) for an open socket's identity as it stands now (the
    code is 0 while it may go on): its token re-read, or its user and their role in ``team_id``."""
    token = scope.get("api_token")
    if token is not None:
        token = token_current(token_id=token.id)
        if token is None or not token_allows(token, "sandboxes:read"):
            return CLOSE_UNAUTHORIZED, False
        return 0, role_at_least(token.effective_role, "member") and token_allows(token, "sandboxes:write")
    user = scope.get("user")
    if user is None or not get_user_model().objects.filter(pk=user.pk, is_active=True).exists():
        return CLOSE_UNAUTHORIZED, False
    if team_id is None:
        return 0, False
    role = Membership.objects.filter(user_id=user.pk, team_id=team_id).values_list("role", flat=True).first()
    if role is None:
        return CLOSE_FORBIDDEN, False
    return 0, role != Membership.Role.VIEWER


def _query(scope: dict[str, Any]) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()}


class _Base(AsyncWebsocketConsumer):
    user: Any
    team: Team
    can_change = False
    auth_watch: asyncio.Task[None] | None = None
    auth_ended = False

    accepted = False
    refusing = False

    async def close(self, code: int | bool | None = None, reason: str | None = None) -> None:
        # A close before the handshake is answered reaches the client as an HTTP 403 (that is
        # how daphne refuses a handshake), and the close code it should read is lost: accept
        # first, so a refusal arrives as the code the docs give (4401, 4403, 4404, 4400).
        if not self.accepted:
            await self._accept_to_refuse()
        await super().close(code=code, reason=frames.close_reason(reason) if reason else None)

    async def _refuse_query(self, model: type[Any]) -> Any:
        """The socket's query string as ``model``, or None after closing it with 4400. Why is
        said in an error frame first (daphne does not pass a close's reason on)."""
        try:
            return frames.parse_query(_query(self.scope), model)
        except frames.FrameError as exc:
            await self._accept_to_refuse()
            await self.send_json({"type": "error", "message": exc.message})
            await self.close(code=CLOSE_BAD_REQUEST, reason=exc.message)
            return None

    async def _authenticate(self) -> bool:
        who = await database_sync_to_async(_identity)(self.scope)
        if who is None:
            await self.close(code=CLOSE_UNAUTHORIZED)
            return False
        if isinstance(who, str):  # said in a frame first: daphne does not pass a close's reason on
            await self._accept_to_refuse()
            await self.send_json({"type": "error", "message": who})
            await self.close(code=CLOSE_FORBIDDEN, reason=who)
            return False
        self.user, self.team, self.can_change = who
        return True

    # -- who it acts for, while it is open ---------------------------------------------------

    async def _accept_to_refuse(self) -> None:
        """Accepted only to be closed with its refusal's code: nothing to watch."""
        self.refusing = True
        await self.accept()

    async def accept(self, subprotocol: str | None = None, headers: Any = None) -> None:
        if self.accepted:
            return
        self.accepted = True
        await super().accept(subprotocol, headers)
        if self.refusing or getattr(self, "user", None) is None:
            return
        # A change between the handshake's authentication and this join is caught by the
        # periodic check.
        group = auth_group(self.user.pk)
        await self.channel_layer.group_add(group, self.channel_name)
        self.groups = [group]  # left in websocket_disconnect
        self.auth_watch = asyncio.create_task(self._recheck_periodically())

    async def auth_changed(self, event: dict[str, Any]) -> None:
        """``auth.changed`` (runtime.notify): a token revoked, a membership changed…"""
        await self._recheck()

    def _recheck_in(self) -> float:
        wait = float(settings.HANGAR_AUTH_RECHECK_S)
        token = self.scope.get("api_token")
        if token is not None and token.expires_at is not None:
            wait = min(wait, max(0.0, (token.expires_at - timezone.now()).total_seconds()) + 0.05)
        return wait

    async def _recheck_periodically(self) -> None:
        while not self.auth_ended:
            await asyncio.sleep(self._recheck_in())
            await self._recheck()

    async def _recheck(self) -> None:
        if self.auth_ended:
            return
        team = getattr(self, "team", None)  # none for the pages of Hangar-wide things
        code, may_change = await database_sync_to_async(_identity_now)(self.scope, team.id if team else None)
        if code:
            self.auth_ended = True
            await self._auth_lost(code)
        elif self.can_change and not may_change:
            self.can_change = False
            await self._auth_lowered()
        else:
            self.can_change = may_change

    async def _auth_lost(self, code: int) -> None:
        why = ("its token was revoked or expired, or its user removed" if code == CLOSE_UNAUTHORIZED
               else "you are no longer in this team")  # fmt: skip
        await self.send_json({"type": "error", "message": f"access ended: {why}"})
        await self.close(code=code)

    async def _auth_lowered(self) -> None:
        await self.send_json({"type": "error", "message": f"your role changed: {VIEWER_REFUSAL}"})

    async def websocket_receive(self, message: dict[str, Any]) -> None:
        if self.auth_ended:
            return  # frames that came in behind the end of its access are not acted on
        await super().websocket_receive(message)

    async def websocket_disconnect(self, message: dict[str, Any]) -> None:
        if self.auth_watch is not None:
            self.auth_watch.cancel()
        await super().websocket_disconnect(message)

    async def _refuse_viewer(self) -> bool:
        """True (after telling the client) when the caller may only watch."""
        if self.can_change:
            return False
        await self.send_json({"type": "error", "message": VIEWER_REFUSAL})
        return True

    async def send_json(self, obj: dict[str, Any]) -> None:
        await self.send(text_data=json.dumps(obj, separators=(",", ":")))

    process: proc_svc.ProcessHandle
    input_sent = 0
    refusal_said_at = 0.0

    async def _send_input(self, data: bytes) -> None:
        """The client's input for the process. A websocket's frames cannot be held back, so
        nothing waits here; input the node refuses (the command has left too much unread) is
        reported to this client (:meth:`proc_input_acked`) rather than dropped without a word."""
        if not data:
            return
        self.input_sent += len(data)
        await self.process.send_input(data, ack_to=self.channel_name, upto=self.input_sent)

    async def proc_input_acked(self, event: dict[str, Any]) -> None:
        """The bridge on this client's input (``proc.input_acked``, to this consumer's channel):
        a refusal, said once per burst of refused frames (a paste is many)."""
        now = time.monotonic()
        if event.get("refused") and now - self.refusal_said_at >= REFUSAL_EVERY_S:
            self.refusal_said_at = now
            await self.send_json(
                {"type": "error", "message": f"input refused: {proc_svc.input_refused_message()}"}
            )


class TerminalConsumer(_Base):
    """A viewer of one terminal; any number may watch the same one."""

    async def connect(self) -> None:
        if not await self._authenticate():
            return
        terminal_id = self.scope["url_route"]["kwargs"]["terminal_id"]
        try:
            term = await database_sync_to_async(proc_svc.terminal_get)(
                team=self.team, terminal_id=terminal_id, caller=self.scope.get("api_token")
            )
        except ServiceError:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        self.process = proc_svc.ProcessHandle.of_terminal(term.sandbox, term.id)
        self.client_flow = _query(self.scope).get("flow") == "1"
        self.unacked: deque[tuple[int, int]] = deque()  # (frame length, end offset) not yet acked
        self.follow = self.process.follow(offset=0, flow=True, auto_ack=not self.client_flow)
        await self.accept()
        self.pump = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        try:
            async for event in self.follow:
                if event[0] == "output":
                    if self.client_flow:
                        self.unacked.append((len(event[2]), event[3]))
                    await self.send(bytes_data=event[2])
                elif event[0] == "skipped":
                    await self.send_json({"type": "skipped", "bytes": event[1]})
                elif event[0] == "exit":
                    await self.send_json({"type": "exit", **event[1]})
                    await self.close(code=1000)
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("terminal %s: stream failed", self.process.row_id)
            await self.close(code=1011)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if bytes_data is not None:
            if not await self._refuse_viewer():
                await self._input(bytes_data)
            return
        try:
            msg = frames.parse_frame(text_data, frames.TERMINAL_FRAMES)
        except frames.FrameError as exc:
            await self.send_json({"type": "error", "message": exc.message})
            return
        if isinstance(msg, frames.Ack):
            await self._ack(msg.bytes)
        elif isinstance(msg, frames.Resize):
            # A viewer's window does not resize the terminal the others type into.
            if self.can_change:
                await self.process.resize(msg.rows, msg.cols)
        elif isinstance(msg, frames.Input):
            if not await self._refuse_viewer():
                await self._input(msg.data.encode("utf-8", "surrogatepass"))
        elif isinstance(msg, frames.Ping):
            # A ping only keeps the connection open: it is not activity (see the idle rules).
            await self.send_json({"type": "pong"})

    async def _input(self, data: bytes) -> None:
        await self._send_input(data)

    async def _ack(self, nbytes: int) -> None:
        # The client counts bytes; the bridge wants offsets: walk the frames it has consumed.
        offset = None
        while nbytes > 0 and self.unacked:
            length, end = self.unacked[0]
            if nbytes >= length:
                nbytes -= length
                offset = end
                self.unacked.popleft()
            else:
                self.unacked[0] = (length - nbytes, end)
                break
        if offset is not None:
            await self.follow.ack(offset)

    async def disconnect(self, code: int) -> None:
        await stop(getattr(self, "pump", None))


class ExecConsumer(_Base):
    """``/ws/v1/sandboxes/{id}/exec``: run a command (the first text frame is the request, as
    for ``POST .../exec``, plus ``tty``, ``rows``, ``cols``), or attach to a running process
    with ``?process=<id>``. Server → client: JSON ``start``, ``stdout``/``stderr`` (``data``
    text, or base64 with ``"encoding": "base64"``), ``exit``. Client → server: ``{"type":
    "stdin", "data"}``, ``{"type": "stdin_b64", "data"}``, ``{"type": "eof"}``, ``{"type":
    "signal", "signal": "INT"}``, ``{"type": "resize", "rows", "cols"}``. A command started on
    this socket is killed when the socket closes before it ends; an attached one runs on."""

    async def connect(self) -> None:
        self.pump: asyncio.Task[None] | None = None
        self.owned = False
        self.finished = False
        if not await self._authenticate():
            return
        sandbox_id = self.scope["url_route"]["kwargs"]["sandbox_id"]
        try:
            self.sandbox = await database_sync_to_async(svc.sandbox_get)(
                team=self.team, sandbox_id=sandbox_id, caller=self.scope.get("api_token")
            )
        except ServiceError:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        query = await self._refuse_query(frames.ExecQuery)
        if query is None:
            return
        self.encoding = query.encoding
        await self.accept()
        if query.process is not None:
            try:
                row = await database_sync_to_async(proc_svc.process_get)(
                    sandbox=self.sandbox, process_id=query.process
                )
            except ServiceError as exc:
                await self._fail(exc.message)
                return
            self._follow(row, offset=query.offset)
            await self.send_json({"type": "start", "id": row.id, "pid": row.pid, "attached": True})

    def _follow(self, row: Exec, offset: int = 0) -> None:
        self.process = proc_svc.ProcessHandle.of_exec(self.sandbox, row.id)
        self.pump = asyncio.create_task(self._pump(self.process.follow(offset=offset)))

    async def _pump(self, follow: proc_svc.ProcessFollow) -> None:
        decoders = {s: codecs.getincrementaldecoder("utf-8")(errors="replace") for s in ("stdout", "stderr")}
        try:
            async for event in follow:
                if event[0] == "output":
                    stream, data = event[1], event[2]
                    if self.encoding == "base64":
                        await self.send_json({"type": stream, "data": base64.b64encode(data).decode()})
                    elif text := decoders[stream].decode(data):
                        await self.send_json({"type": stream, "data": text})
                elif event[0] == "skipped":
                    await self.send_json({"type": "skipped", "bytes": event[1]})
                elif event[0] == "exit":
                    self.finished = True
                    await self.send_json({"type": "exit", **event[1]})
                    await self.close(code=1000)
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("exec stream failed")
            await self.close(code=1011)

    async def _fail(self, message: str) -> None:
        await self.send_json({"type": "error", "message": message})
        await self.close(code=CLOSE_BAD_REQUEST)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if bytes_data is not None:
            if self.pump is not None and not await self._refuse_viewer():
                await self._send_input(bytes_data)
            return
        if self.pump is None:
            if not self.can_change:
                await self.send_json({"type": "error", "message": VIEWER_REFUSAL})
                await self.close(code=CLOSE_FORBIDDEN)
                return
            try:
                start = frames.parse_start(text_data)
            except frames.FrameError as exc:
                await self._fail(exc.message)
                return
            await self._start(start)
            return
        try:
            msg = frames.parse_frame(text_data, frames.EXEC_FRAMES)
        except frames.FrameError as exc:
            await self.send_json({"type": "error", "message": exc.message})
            return
        if await self._refuse_viewer():
            return
        try:
            if isinstance(msg, frames.Stdin):
                await self._send_input(msg.data.encode("utf-8", "surrogatepass"))
            elif isinstance(msg, frames.StdinB64):
                await self._send_input(msg.decoded())
            elif isinstance(msg, frames.Eof):
                await self.process.close_input()
            elif isinstance(msg, frames.Signal):
                await self.process.signal(msg.signal)
            elif isinstance(msg, frames.Resize):
                await self.process.resize(msg.rows, msg.cols)
        except ServiceError as exc:
            await self.send_json({"type": "error", "message": exc.message})

    async def _start(self, msg: frames.ExecStart) -> None:
        try:
            row = await proc_svc.process_start(
                sandbox=self.sandbox, cmd=msg.cmd, kind=Exec.Kind.STREAM, cwd=msg.cwd, env=dict(msg.env),
                stdin=msg.stdin.encode("utf-8", "surrogatepass") if msg.stdin is not None else None,
                stdin_open=msg.stdin_open, tty=msg.tty, rows=msg.rows, cols=msg.cols, timeout_s=msg.timeout_s,
                user=self.user,
            )  # fmt: skip
        except ServiceError as exc:
            await self._fail(exc.message)
            return
        self.owned = True
        await self.send_json({"type": "start", "id": row.id, "pid": row.pid})
        self._follow(row)

    async def disconnect(self, code: int) -> None:
        if self.pump is not None:
            try:
                await stop(self.pump)
            finally:  # even when daphne cancels a disconnect that takes too long
                if self.owned and not self.finished:
                    await self.process.kill()


# -- live pages (sessions only) ------------------------------------------------------------------


class LivePage(_Base):
    """A dashboard page's socket (sessions only): what :meth:`render` makes of the messages on
    its channel (:mod:`dashboard.live`), batched, pushed as text."""

    channel_name_: str
    queue: asyncio.Queue[str] | None = None

    async def _subscribe(self, channel: str) -> None:
        self.channel_name_ = channel
        self.queue = await hub.subscribe(channel)
        self.pump = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        assert self.queue is not None
        while True:
            first = await self.queue.get()
            await asyncio.sleep(0.1)  # a burst of changes becomes one update
            items = {first}
            while not self.queue.empty():
                items.add(self.queue.get_nowait())
            try:
                html = await database_sync_to_async(self.render)(items)
            except Exception:
                log.exception("live page update failed")
                continue
            if html:
                await self.send(text_data=html)

    def render(self, items: set[str]) -> str:
        raise NotImplementedError

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        pass  # the htmx websocket extension sends nothing we need

    async def _auth_lost(self, code: int) -> None:
        await self.close(code=code)  # the page's socket takes HTML only

    async def _auth_lowered(self) -> None:
        pass

    async def disconnect(self, code: int) -> None:
        if self.queue is not None:
            hub.unsubscribe(self.channel_name_, self.queue)
            self.pump.cancel()


class SandboxesLiveConsumer(LivePage):
    """``/ws/ui/sandboxes``: rows of the team's sandboxes list, pushed as they change."""

    async def connect(self) -> None:
        if self.scope.get("api_token") is not None or not await self._authenticate():
            if self.scope.get("api_token") is not None:
                await self.close(code=CLOSE_UNAUTHORIZED)
            return
        await self.accept()
        from runtime.notify import team_channel

        await self._subscribe(team_channel(self.team.id))
        # What changed between the page's rendering and this subscription would be missed.
        try:
            since = float(_query(self.scope).get("since") or 0)
        except ValueError:
            since = 0.0
        if since:
            for sandbox_id in await database_sync_to_async(self._changed_since)(since):
                self.queue.put_nowait(sandbox_id)  # type: ignore[union-attr]

    def _changed_since(self, since: float) -> list[str]:
        when = datetime.fromtimestamp(since, tz=UTC)
        return list(
            Sandbox.objects.filter(team=self.team, updated_at__gt=when)
            .order_by("-updated_at")
            .values_list("id", flat=True)[:PAGE_CATCH_UP]
        )

    def render(self, items: set[str]) -> str:
        from ..pages.sandbox_views import sandbox_rows_context

        rows = sandbox_rows_context(team=self.team, ids=sorted(items))
        return render_to_string("hangar/partials/sandbox_rows_oob.html", {"rows": rows})


class SandboxLiveConsumer(LivePage):
    """``/ws/ui/sandboxes/{id}``: the detail page's status header and new events."""

    async def connect(self) -> None:
        if self.scope.get("api_token") is not None or not await self._authenticate():
            if self.scope.get("api_token") is not None:
                await self.close(code=CLOSE_UNAUTHORIZED)
            return
        sandbox_id = self.scope["url_route"]["kwargs"]["sandbox_id"]
        try:
            self.sandbox = await database_sync_to_async(svc.sandbox_get)(
                team=self.team, sandbox_id=sandbox_id
            )
        except ServiceError:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        query = await self._refuse_query(frames.LiveSandboxQuery)
        if query is None:
            return
        self.last_event = query.after
        await self.accept()
        from runtime.notify import sandbox_channel

        await self._subscribe(sandbox_channel(self.sandbox.id))
        # One update at once: a change between the page's rendering and this subscription
        # (a sandbox that came up meanwhile) would otherwise wait for the next one.
        self.queue.put_nowait("sync")  # type: ignore[union-attr]

    def render(self, items: set[str]) -> str:
        sandbox = Sandbox.objects.select_related("node").get(id=self.sandbox.id)
        events = list(sandbox.events.filter(id__gt=self.last_event).order_by("id")[:200])
        if events:
            self.last_event = events[-1].id
        return render_to_string(
            "hangar/partials/sandbox_live_oob.html", {"sandbox": sandbox, "events": events}
        )


def _session_user(scope: dict[str, Any]) -> Any:
    user = scope.get("user")
    if scope.get("token_presented") or user is None or not same_origin(scope) or not user.is_authenticated:
        return None
    return user


class _SessionLivePage(LivePage):
    """A live page of Hangar-wide things (no one team's): any signed-in session."""

    async def _accept_session(self) -> bool:
        # A signed-in user of this site's own pages, in a team or not (a staff user may be in none).
        user = await database_sync_to_async(_session_user)(self.scope)
        if user is None:
            await self.close(code=CLOSE_UNAUTHORIZED)
            return False
        self.user = user
        await self.accept()
        return True


class ImagesLiveConsumer(_SessionLivePage):
    """``/ws/ui/images``: the images page's tables, redrawn as builds and pulls move on."""

    async def connect(self) -> None:
        if not await self._accept_session():
            return
        from runtime.notify import images_channel

        await self._subscribe(images_channel())

    def render(self, items: set[str]) -> str:
        from ..pages.views import images_context

        return render_to_string(
            "hangar/partials/images_live_oob.html", {**images_context(), "can_manage": self.user.is_staff}
        )


class ImageJobLiveConsumer(_SessionLivePage):
    """``/ws/ui/images/jobs/{id}``: one job's status and progress log, until it is over."""

    async def connect(self) -> None:
        if not await self._accept_session():
            return
        self.job_id = int(self.scope["url_route"]["kwargs"]["job_id"])
        from runtime.notify import image_job_channel

        await self._subscribe(image_job_channel(self.job_id))
        self.queue.put_nowait("sync")  # type: ignore[union-attr]  # what happened before this

    def render(self, items: set[str]) -> str:
        from runtime.services.images import image_job_get

        try:
            job = image_job_get(job_id=self.job_id)
        except ServiceError:
            return ""
        if job.status in (ImageJob.Status.SUCCEEDED, ImageJob.Status.FAILED):
            self.done = True
        return render_to_string("hangar/partials/image_job_oob.html", {"job": job})

    async def send(
        self, text_data: str | None = None, bytes_data: bytes | None = None, close: bool = False
    ) -> None:
        await super().send(text_data=text_data, bytes_data=bytes_data, close=close)
        if getattr(self, "done", False) and not close:
            await self.close(code=1000)  # the job is over: nothing more will come
