"""/api/v1/sandboxes/{id}/processes and /terminals: live commands and shells.

Streamed output is newline-delimited JSON (``application/x-ndjson``), one event per line:
``{"type": "start", "id", "pid"}``, ``{"type": "stdout"|"stderr", "data"}``, ``{"type":
"skipped", "bytes"}`` (output older than the node kept), ``{"type": "exit", "exit_code",
"signal", "timed_out"[, "error"]}``. ``data`` is UTF-8 text (a character split across chunks is
kept whole), or base64 with ``encoding=base64``. A stream that fails once started ends with
``{"type": "error", "message"}`` (see :mod:`dashboard.streaming`).
"""

from __future__ import annotations

import base64
import codecs
import json
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any, Literal

from django.conf import settings
from django.http import HttpRequest
from ninja import Path, Query, Router, Schema
from pydantic import Field

from runtime.errors import InvalidValue
from runtime.models import Exec, Sandbox, Terminal
from runtime.services import processes as proc_svc
from runtime.services import sandboxes as svc

from ..auth_watch import while_authorised
from ..streaming import ndjson_response
from .auth import AuthedRequest
from .blocking import blocking
from .schemas import NDJSON_CONTENT, StrictIn, errors

STDIN_WAIT_S = 5.0  # a stdin call answers once its input is read, or after this long

router = Router(tags=["processes"])
ProcessId = Annotated[
    int, Path(description="the process's `id` (from the exec answer or the list), not its `pid`")
]

Encoding = Literal["utf-8", "base64"]
# The largest output offset: 2**53 - 1, the largest integer a JSON number carries exactly.
MAX_OFFSET = 2**53 - 1


class ProcessOut(Schema):
    id: int
    kind: str
    status: str
    pid: int | None
    argv: list[str]
    cwd: str
    exit_code: int | None
    signal: int
    timed_out: bool
    error: str
    timeout_s: float | None
    started_at: datetime
    finished_at: datetime | None
    duration_ms: float | None
    stdout_bytes: int
    stderr_bytes: int


class OutputQuery(Schema):
    offset: int = Field(0, ge=0, le=MAX_OFFSET, description="output offset to start from (0: the start)")
    live: bool = Field(False, description="only output produced from now on")
    follow: bool = Field(True, description="keep streaming until the process exits")
    encoding: Encoding = "utf-8"


class StdinIn(StrictIn):
    data: str = ""
    data_b64: str | None = None
    close: bool = False


class SignalIn(StrictIn):
    signal: Annotated[int, Field(ge=1, le=64)] | Annotated[str, Field(min_length=1, max_length=16)] = Field(
        "TERM", description="a name (TERM, INT, KILL, HUP…, with or without SIG) or a number from 1 to 64"
    )


class ProcessFilter(Schema):
    status: Literal[tuple(Exec.Status.values)] | None = None  # type: ignore[valid-type]
    limit: int = Field(100, ge=1, le=1000)


TerminalSize = Annotated[int, Field(ge=1, le=1000)]


class TerminalIn(StrictIn):
    name: str = Field("", max_length=64)
    cmd: str | Annotated[list[str], Field(min_length=1)] | None = None
    cwd: str | None = None
    env: dict[str, str] = {}
    rows: TerminalSize = 24
    cols: TerminalSize = 80


class TerminalOut(Schema):
    id: str
    sandbox: str
    name: str
    status: str
    pid: int | None
    rows: int
    cols: int
    exit_code: int | None
    error: str
    created_at: datetime
    ended_at: datetime | None
    websocket: str

    @staticmethod
    def resolve_sandbox(obj: Terminal) -> str:
        return obj.sandbox_id

    @staticmethod
    def resolve_websocket(obj: Terminal) -> str:
        return f"/ws/v1/terminals/{obj.id}"


def _sandbox(request: AuthedRequest, sandbox_id: str) -> Sandbox:
    return svc.sandbox_get(team=request.auth.team, sandbox_id=sandbox_id, caller=request.auth)


def _process(request: AuthedRequest, sandbox_id: str, process_id: int) -> tuple[Sandbox, Exec]:
    sandbox = _sandbox(request, sandbox_id)
    return sandbox, proc_svc.process_get(sandbox=sandbox, process_id=process_id)


def _process_handle(sandbox: Sandbox, row: Exec) -> proc_svc.ProcessHandle:
    return proc_svc.ProcessHandle.of_exec(sandbox, row.id)


async def ndjson_events(
    follow: proc_svc.ProcessFollow, *, encoding: str = "utf-8", head: dict[str, Any] | None = None,
    kill_on_close: bool = False,
) -> AsyncIterator[bytes]:  # fmt: skip
    """Encode a follow as NDJSON lines. ``kill_on_close``: a client that hangs up before the
    exit ends the process (a streamed exec belongs to its request)."""
    decoders = {s: codecs.getincrementaldecoder("utf-8")(errors="replace") for s in ("stdout", "stderr")}
    finished = False
    try:
        if head is not None:
            yield _line(head)
        async for event in follow:
            if event[0] == "output":
                stream, data = event[1], event[2]
                if encoding == "base64":
                    yield _line({"type": stream, "data": base64.b64encode(data).decode()})
                else:
                    text = decoders[stream].decode(data)
                    if text:
                        yield _line({"type": stream, "data": text})
            elif event[0] == "skipped":
                yield _line({"type": "skipped", "bytes": event[1]})
            elif event[0] == "exit":
                finished = True
                for stream, dec in decoders.items():
                    if encoding != "base64" and (rest := dec.decode(b"", final=True)):
                        yield _line({"type": stream, "data": rest})
                yield _line({"type": "exit", **event[1]})
    finally:
        if kill_on_close and not finished:
            await follow.handle.kill()


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


@router.get("/{sandbox_id}/processes", response=list[ProcessOut])
async def list_processes(request: AuthedRequest, sandbox_id: str, filters: Query[ProcessFilter]):
    """Streamed and background commands of the sandbox, newest first (`?status=running`)."""

    def rows() -> list[Exec]:
        qs = proc_svc.processes_for_sandbox(sandbox=_sandbox(request, sandbox_id), status=filters.status)
        return list(qs[: filters.limit])

    return await blocking(rows)()


@router.get("/{sandbox_id}/processes/{process_id}", response=ProcessOut)
async def get_process(request: HttpRequest, sandbox_id: str, process_id: ProcessId):
    return (await blocking(_process)(request, sandbox_id, process_id))[1]


@router.get(
    "/{sandbox_id}/processes/{process_id}/output",
    response={200: None},
    openapi_extra={
        "responses": {
            200: {"description": "NDJSON events", "content": {"application/x-ndjson": NDJSON_CONTENT}}
        }
    },
)
async def process_output(
    request: AuthedRequest, sandbox_id: str, process_id: ProcessId, q: Query[OutputQuery]
):
    """The process's output as NDJSON: from `offset` (default: the start, as far as the node
    still holds it; older output comes from what was kept when it ended) or `live`; with
    `follow` (default) until it exits. Leaving does not stop the process."""
    sandbox, row = await blocking(_process)(request, sandbox_id, process_id)
    follow = _process_handle(sandbox, row).follow(offset=q.offset, live=q.live, follow=q.follow)
    return await ndjson_response(while_authorised(ndjson_events(follow, encoding=q.encoding), request.auth))


@router.post("/{sandbox_id}/processes/{process_id}/stdin", response={202: None, **errors(409, 502)})
async def process_stdin(request: HttpRequest, sandbox_id: str, process_id: ProcessId, payload: StdinIn):
    """Send input (`data` as text, or `data_b64`); `close` ends its stdin afterwards. Needs a
    process started with `stdin_open`. Answers once its node has written it to the command's
    stdin (at once, unless the command has left earlier input unread), or after 5 s with it
    still queued there; 409 when the node already holds as much unread input for the process
    as it keeps (`HANGAR_STDIN_PENDING_BYTES`)."""
    sandbox, row = await blocking(_process)(request, sandbox_id, process_id)
    _require_live(row)
    data = payload.data.encode()
    if payload.data_b64 is not None:
        try:
            data = base64.b64decode(payload.data_b64, validate=True)
        except ValueError:
            raise InvalidValue("data_b64 is not valid base64") from None
    limit = settings.HANGAR_STDIN_PENDING_BYTES
    if len(data) > limit:
        raise InvalidValue(f"at most {limit} bytes of input per call ({len(data)} given): send it in parts")
    process = _process_handle(sandbox, row)
    if data:
        sender = process.input_sender()
        await sender.send(data, whole=True)  # taken or refused as a whole
        await sender.drain(STDIN_WAIT_S)
    if payload.close:
        await process.close_input()
    return 202, None


@router.post("/{sandbox_id}/processes/{process_id}/signal", response={202: None, **errors(409, 502)})
async def process_signal(request: HttpRequest, sandbox_id: str, process_id: ProcessId, payload: SignalIn):
    """Send a signal (`TERM`, `INT`, `KILL`, `HUP`… or a number) to the process's group."""
    sandbox, row = await blocking(_process)(request, sandbox_id, process_id)
    number = proc_svc.signal_number(payload.signal)
    _require_live(row)
    await _process_handle(sandbox, row).signal(number)
    return 202, None


def _require_live(row: Exec) -> None:
    from runtime.errors import Conflict

    if row.kind == Exec.Kind.RUN:
        raise Conflict(f"exec {row.id} ran to completion in its request; it is not a live process")
    if row.status != Exec.Status.RUNNING:
        raise Conflict(f"process {row.id} has ended (status {row.status}, exit code {row.exit_code})")


@router.post("/{sandbox_id}/terminals", response={201: TerminalOut, **errors(409, 502)})
async def open_terminal(request: AuthedRequest, sandbox_id: str, payload: TerminalIn):
    """Start a shell on a PTY (a login shell: bash when the image has it, else sh). Attach
    with the websocket at `/ws/v1/terminals/{id}`; it keeps running with no one attached."""
    sandbox = await blocking(_sandbox)(request, sandbox_id)
    term = await proc_svc.terminal_open(
        sandbox=sandbox, name=payload.name, cmd=payload.cmd, cwd=payload.cwd, env=payload.env,
        rows=payload.rows, cols=payload.cols, user=request.auth.user,
    )  # fmt: skip
    return 201, term


@router.get("/{sandbox_id}/terminals", response=list[TerminalOut])
async def list_terminals(request: AuthedRequest, sandbox_id: str):
    def rows() -> list[Terminal]:
        return list(proc_svc.terminals_for_sandbox(sandbox=_sandbox(request, sandbox_id))[:200])

    return await blocking(rows)()


@router.delete("/{sandbox_id}/terminals/{terminal_id}", response={204: None})
async def close_terminal(request: AuthedRequest, sandbox_id: str, terminal_id: str):
    """End the terminal's shell (its process group is killed)."""

    def get() -> Terminal:
        sandbox = _sandbox(request, sandbox_id)
        term = proc_svc.terminal_get(team=sandbox.team, terminal_id=terminal_id)
        if term.sandbox_id != sandbox.id:
            from runtime.errors import NotFound

            raise NotFound(f"no terminal {terminal_id!r} in sandbox {sandbox.id}")
        return term

    term = await blocking(get)()
    if term.status == Terminal.Status.RUNNING and term.sandbox.node is not None:
        await proc_svc.ProcessHandle.of_terminal(term.sandbox, term.id).kill()
    return 204, None
