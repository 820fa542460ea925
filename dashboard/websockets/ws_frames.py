"""What websocket clients may send, checked in one place: every JSON text frame and every
query string a consumer reads is parsed here, into a typed message, or refused with a
:class:`FrameError` whose message says what to fix. A consumer answers a refused frame with an
``error`` frame and goes on serving; a refused query string closes the socket with 4400."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dashboard.api.schemas import explain, has_lone_surrogate

Size = Annotated[int, Field(ge=1, le=1000)]


class FrameError(ValueError):
    """A frame or query string the server refuses; ``message`` says why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Frame(BaseModel):
    # Frames are JSON: a number is a number ("24" is not), and keys a message does not know
    # are left alone (a client may send more than this server reads).
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


# -- terminals (/ws/v1/terminals/{id}) ------------------------------------------------------------


class Ack(_Frame):
    type: Literal["ack"]
    bytes: int = Field(ge=0)


class Resize(_Frame):
    type: Literal["resize"]
    rows: Size
    cols: Size


class Input(_Frame):
    type: Literal["input"]
    data: str = ""


class Ping(_Frame):
    type: Literal["ping"]


# -- streamed commands (/ws/v1/sandboxes/{id}/exec) -----------------------------------------------


class Stdin(_Frame):
    type: Literal["stdin"]
    data: str = ""


class StdinB64(_Frame):
    type: Literal["stdin_b64"]
    data: str = ""

    @field_validator("data")
    @classmethod
    def _base64(cls, value: str) -> str:
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("is not valid base64") from None
        return value

    def decoded(self) -> bytes:
        return base64.b64decode(self.data)


class Eof(_Frame):
    type: Literal["eof"]


class Signal(_Frame):
    type: Literal["signal"]
    signal: Annotated[int, Field(ge=1, le=64)] | Annotated[str, Field(min_length=1, max_length=16)] = "TERM"


class ExecStart(_Frame):
    """The first frame on an exec socket: the command, as for ``POST …/exec``, plus ``tty``,
    ``rows`` and ``cols``."""

    cmd: str | Annotated[list[str], Field(min_length=1)]
    cwd: str | None = None
    env: dict[str, str] = {}
    stdin: str | None = None
    stdin_open: bool = True
    tty: bool = False
    rows: Size = 24
    cols: Size = 80
    timeout_s: float | None = Field(None, gt=0)


def _by_type(*kinds: type[_Frame]) -> dict[str, type[_Frame]]:
    return {k.model_fields["type"].annotation.__args__[0]: k for k in kinds}  # type: ignore[union-attr]


TERMINAL_FRAMES = _by_type(Ack, Resize, Input, Ping)
EXEC_FRAMES = _by_type(Stdin, StdinB64, Eof, Signal, Resize)


def _explain(exc: ValidationError) -> str:
    return explain(exc.errors(include_url=False))  # type: ignore[arg-type]


def _json_object(text: str | None) -> dict[str, Any]:
    try:
        data = json.loads(text or "")
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise FrameError("text frames must be JSON objects")
    if "\\u" in (text or "") and has_lone_surrogate(data):
        raise FrameError("a string holds a lone UTF-16 surrogate: send text as UTF-8")
    return data


def parse_frame(text: str | None, kinds: dict[str, type[_Frame]]) -> _Frame:
    """One control frame of a socket that takes ``kinds`` (:data:`TERMINAL_FRAMES`,
    :data:`EXEC_FRAMES`), checked."""
    data = _json_object(text)
    kind = data.get("type")
    model = kinds.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise FrameError(f"unknown message type {kind!r}; one of: {', '.join(kinds)}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise FrameError(f"bad {kind} message: {_explain(exc)}") from None


def parse_start(text: str | None) -> ExecStart:
    """The first frame of an exec socket: the command to run."""
    data = _json_object(text)
    try:
        return ExecStart.model_validate(data)
    except ValidationError as exc:
        raise FrameError(
            f'the first message must be the command, {{"cmd": "..."}}: {_explain(exc)}'
        ) from None


# -- query strings --------------------------------------------------------------------------------


class _Query(BaseModel):
    # Query values are text: "5" is read as the number 5.
    model_config = ConfigDict(extra="ignore", frozen=True)


class ExecQuery(_Query):
    process: int | None = Field(None, ge=1, description="attach to this process instead of starting one")
    offset: int = Field(0, ge=0, description="output offset to start from when attaching")
    encoding: Literal["utf-8", "base64"] = "utf-8"


class LiveSandboxQuery(_Query):
    after: int = Field(0, ge=0, description="events after this id")


class LiveTraceQuery(_Query):
    after: int = Field(0, ge=0, le=2**63 - 1, description="spans stored after this row id")


def parse_query(query: dict[str, str], model: type[_Query]) -> Any:
    """A socket's query string (first value of each parameter), checked against ``model``."""
    try:
        return model.model_validate(query)
    except ValidationError as exc:
        raise FrameError(f"bad query string: {_explain(exc)}") from None


def close_reason(message: str) -> str:
    """``message`` cut to what a close frame carries (123 bytes of UTF-8)."""
    raw = message.encode()[:123]
    return raw.decode(errors="ignore")
