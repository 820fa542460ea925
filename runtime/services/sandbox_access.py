"""One road to a sandbox: :func:`sandbox_access` gives what runs commands, files, live
processes and tunnels in it. When the sandbox runs on this node that is its launcher, bound to
the sandbox's handle (:class:`LocalAccess`); when it runs on another, a proxy with the same
methods that carries each call to that node (:class:`RemoteAccess`): a blocking call through
the node's Celery queue (:func:`node_op` is the node's side, answering with a
:class:`LocalAccess`), a tunnel through its tunnel listener. Live processes start through the
node's stream bridge either way. Callers never ask where the sandbox is.

The queue's messages are JSON: bytes travel as base64, and each kind of value is written and
read in one pair of functions here (``_to_wire`` / ``_from_wire``), so both sides agree.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import dataclasses
from collections.abc import Iterable, Iterator
from functools import cached_property, partial
from typing import Any

from .. import streams
from ..aio import within
from ..errors import Conflict, InvalidValue, NodeUnavailable
from ..launchers.base import (
    PSEUDO_FS_REFUSED,
    ExecRequest,
    ExecResult,
    FileEntry,
    FileOpError,
    Launcher,
    LauncherError,
    OutputCallback,
    SandboxNotRunning,
    Stats,
)
from ..models import Sandbox
from ..node.local import launcher_for, local_node_name
from ..node.tunnels import open_local, open_remote
from . import uploads
from .channel_layer import channel_layer
from .nodes import node_call
from .sandbox_calls import runtime_failure

START_TIMEOUT_S = 15.0  # for the node's bridge to say a live process started
Tunnel = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class NoTunnel(Exception):
    """No tunnel can be opened to the sandbox at all (as opposed to a port where nothing
    listens yet, :class:`runtime.node.tunnels.TunnelError`)."""


class NotRunningHere(NoTunnel):
    """The sandbox has no node, or no running runtime on it."""


class NoTunnelListener(NoTunnel):
    """The sandbox's node takes no tunnels from other machines (no ``HANGAR_TUNNEL_PORT``)."""


class SandboxAccess(abc.ABC):
    """Commands, files, network policy, usage, live processes and tunnels of one sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    @abc.abstractmethod
    def exec(self, request: ExecRequest, on_output: OutputCallback | None = None) -> ExecResult:
        """Run one command to completion (or its timeout)."""

    @abc.abstractmethod
    def read_file(self, path: str, *, no_pseudo_fs: bool = False) -> tuple[FileEntry, Iterator[bytes]]: ...

    @abc.abstractmethod
    def write_file(self, path: str, data: Iterable[bytes | bytearray | memoryview]) -> int: ...

    @abc.abstractmethod
    def list_files(self, path: str, *, no_pseudo_fs: bool = False) -> list[FileEntry]: ...

    @abc.abstractmethod
    def set_network(self, policy: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    def stats(self) -> Stats: ...

    @abc.abstractmethod
    async def open_tunnel(self, port: int) -> Tunnel:
        """A connection to ``port`` inside the sandbox. Raises :class:`NoTunnel`, or
        :class:`runtime.node.tunnels.TunnelError` (worth trying again: a server starting)."""

    async def start_process(self, key: str, fields: dict[str, Any]) -> tuple[int, bool, bool]:
        """Ask the sandbox's node's stream bridge to start a live process (``key`` names it on
        the wire); returns its pid inside the sandbox, whether the ``attach`` in ``fields``
        (a follower's, see :mod:`runtime.node.bridge`) was taken, and whether the bridge wrote
        the pid to the process's row. The bridge holds it from then on."""
        sandbox = self.sandbox
        layer = channel_layer()
        reply = await layer.new_channel()
        message = {
            "type": streams.START, "key": key, "reply": reply, "sandbox_id": sandbox.id,
            "runtime": sandbox.runtime, "handle": sandbox.handle, **fields,
        }  # fmt: skip
        if sandbox.node is None:
            raise Conflict(f"sandbox {sandbox.id} is not placed on a node", status=sandbox.status)
        node = sandbox.node.name
        await layer.send(streams.bridge_channel(node), message)
        try:
            answer = await within(layer.receive(reply), START_TIMEOUT_S)
        except TimeoutError:
            raise NodeUnavailable(
                f"the stream bridge of node {node} did not answer within {START_TIMEOUT_S:.0f} s "
                "(is `hangar up` or `hangar node` running there?)"
            ) from None
        if answer["type"] == streams.STARTED:
            return int(answer["pid"]), bool(answer.get("attached")), bool(answer.get("recorded"))
        if answer.get("error") == "start":
            raise InvalidValue(
                f"could not run {fields['argv'][0]!r}: {answer['message']} ({answer['errno']})"
            )
        raise runtime_failure(sandbox, LauncherError(answer.get("message", "the runtime failed")))


def sandbox_access(sandbox: Sandbox) -> SandboxAccess:
    """The one road to the sandbox, wherever it runs."""
    if sandbox.node is not None and sandbox.node.name == local_node_name():
        return LocalAccess(sandbox)
    return RemoteAccess(sandbox)


class LocalAccess(SandboxAccess):
    """The launcher of this node, bound to the sandbox's handle as its row keeps it."""

    def __init__(self, sandbox: Sandbox) -> None:
        super().__init__(sandbox)
        self.handle = sandbox.handle

    @cached_property
    def launcher(self) -> Launcher:
        # Found on first use: making the access costs nothing (an async caller makes it on
        # its loop), and the launcher's own first start happens where the call is run.
        return launcher_for(self.sandbox.runtime)

    def exec(self, request: ExecRequest, on_output: OutputCallback | None = None) -> ExecResult:
        return self.launcher.exec(self.handle, request, on_output=on_output)

    def read_file(self, path: str, *, no_pseudo_fs: bool = False) -> tuple[FileEntry, Iterator[bytes]]:
        return self.launcher.read_file(self.handle, path, no_pseudo_fs=no_pseudo_fs)

    def write_file(self, path: str, data: Iterable[bytes | bytearray | memoryview]) -> int:
        return self.launcher.write_file(self.handle, path, data)

    def list_files(self, path: str, *, no_pseudo_fs: bool = False) -> list[FileEntry]:
        return self.launcher.list_files(self.handle, path, no_pseudo_fs=no_pseudo_fs)

    def set_network(self, policy: dict[str, Any]) -> None:
        self.launcher.set_network(self.handle, policy)

    def stats(self) -> Stats:
        return self.launcher.stats(self.handle)

    async def open_tunnel(self, port: int) -> Tunnel:
        if not self.handle:
            raise NotRunningHere(f"sandbox {self.sandbox.id} is not running")
        return await open_local(self.sandbox.runtime, self.handle, port)


class RemoteAccess(SandboxAccess):
    """The sandbox on another node: each call runs there (see :func:`node_op`)."""

    def exec(self, request: ExecRequest, on_output: OutputCallback | None = None) -> ExecResult:
        # The answer comes whole: what streams as it comes is a live process, not this.
        timeout = (request.timeout or 0) + 30
        result = _exec_result_from_wire(self._call("exec", _exec_request_to_wire(request), timeout))
        if on_output is not None:
            for stream in ("stdout", "stderr"):
                if data := getattr(result, stream):
                    on_output(stream, bytes(data))
        return result

    def read_file(self, path: str, *, no_pseudo_fs: bool = False) -> tuple[FileEntry, Iterator[bytes]]:
        a = _kept_out(self._call("read", {"path": path, "no_pseudo_fs": no_pseudo_fs}, 120), no_pseudo_fs)
        return FileEntry(**a["entry"]), iter([base64.b64decode(a["data"])])

    def write_file(self, path: str, data: Iterable[bytes | bytearray | memoryview]) -> int:
        return uploads.remote_write(path, data, lambda op, payload: self._call(op, payload, 120))

    def list_files(self, path: str, *, no_pseudo_fs: bool = False) -> list[FileEntry]:
        answer = _kept_out(self._call("list", {"path": path, "no_pseudo_fs": no_pseudo_fs}, 60), no_pseudo_fs)
        return [FileEntry(**e) for e in answer["entries"]]

    def set_network(self, policy: dict[str, Any]) -> None:
        self._call("network", {"policy": policy}, 30)

    def stats(self) -> Stats:
        return Stats(**self._call("stats", {}, 30))

    async def open_tunnel(self, port: int) -> Tunnel:
        node = self.sandbox.node
        if node is None:
            raise NotRunningHere(f"sandbox {self.sandbox.id} is not placed on a node")
        if not node.tunnel_address:
            raise NoTunnelListener(f"node {node.name} takes no tunnels from other machines")
        return await open_remote(node.tunnel_address, self.sandbox.id, port)

    def _call(self, op: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Run one operation on the sandbox's node through its queue and wait for the answer."""
        assert self.sandbox.node is not None
        answer = node_call(self.sandbox.node, "node_op", [op, self.sandbox.id, payload], timeout)
        if "error" in answer:
            kind = answer["error"]
            if kind == "file":
                raise FileOpError(answer["errno"], answer["message"])
            if kind == "not_running":
                raise SandboxNotRunning(answer["message"], reason=answer["message"])
            raise LauncherError(answer["message"])
        return answer


def _kept_out(answer: dict[str, Any], no_pseudo_fs: bool) -> dict[str, Any]:
    """A node's answer, once it says it kept ``no_pseudo_fs`` if asked (an older node ignores it)."""
    if no_pseudo_fs and not answer.get("no_pseudo_fs"):
        raise FileOpError(PSEUDO_FS_REFUSED, "the sandbox's node runs a Hangar too old to keep callers out of /proc "
                                             "and /sys, so nothing it sends is shown")  # fmt: skip
    return answer


# -- the node's side -----------------------------------------------------------------------------


def node_op(*, op: str, sandbox_id: str, payload: dict[str, Any]) -> dict[str, Any]:
    """The node side of :class:`RemoteAccess`: one operation on a sandbox of this node, JSON in,
    JSON out (a failure is an answer too: ``{"error": ...}``)."""
    sandbox = Sandbox.objects.filter(id=sandbox_id).first()
    if sandbox is None or not sandbox.handle:
        return {"error": "not_running", "message": f"sandbox {sandbox_id} is not running on this node"}
    here = LocalAccess(sandbox)
    kept_out = bool(payload.get("no_pseudo_fs"))  # said back: the asking side checks it was kept
    try:
        if op == "exec":
            return _exec_result_to_wire(here.exec(_exec_request_from_wire(payload)))
        if op == "read":
            entry, chunks = here.read_file(payload["path"], no_pseudo_fs=kept_out)
            return {"entry": entry.__dict__, "data": base64.b64encode(b"".join(chunks)).decode(),
                    "no_pseudo_fs": kept_out}  # fmt: skip
        if op == "write":
            return {"size": here.write_file(payload["path"], [base64.b64decode(payload["data"])])}
        if op == "write_part":
            uploads.node_upload_part(upload=payload["upload"], data=payload["data"])
            return {}
        if op == "write_commit":
            write = partial(here.write_file, payload["path"])
            return {"size": uploads.node_upload_commit(upload=payload["upload"], write=write)}
        if op == "write_abort":
            uploads.node_upload_abort(upload=payload["upload"])
            return {}
        if op == "list":
            entries = here.list_files(payload["path"], no_pseudo_fs=kept_out)
            return {"entries": [e.__dict__ for e in entries], "no_pseudo_fs": kept_out}
        if op == "network":
            here.set_network(payload["policy"])
            return {}
        if op == "stats":
            return dataclasses.asdict(here.stats())
    except FileOpError as exc:
        return {"error": "file", "errno": exc.errno_name, "message": exc.message}
    except SandboxNotRunning as exc:
        return {"error": "not_running", "message": exc.reason}
    except LauncherError as exc:
        return {"error": "launcher", "message": str(exc)}
    return {"error": "launcher", "message": f"unknown node operation {op!r}"}


# -- values on the queue -------------------------------------------------------------------------


def _exec_request_to_wire(req: ExecRequest) -> dict[str, Any]:
    return {
        "argv": req.argv, "env": req.env, "cwd": req.cwd, "timeout": req.timeout, "max_output": req.max_output,
        "stdin": base64.b64encode(req.stdin).decode() if req.stdin is not None else None,
    }  # fmt: skip


def _exec_request_from_wire(payload: dict[str, Any]) -> ExecRequest:
    return ExecRequest(
        argv=payload["argv"], env=payload["env"], cwd=payload["cwd"],
        stdin=base64.b64decode(payload["stdin"]) if payload["stdin"] is not None else None,
        timeout=payload["timeout"], max_output=payload["max_output"],
    )  # fmt: skip


def _exec_result_to_wire(r: ExecResult) -> dict[str, Any]:
    return {
        "exit_code": r.exit_code, "stdout": base64.b64encode(r.stdout).decode(),
        "stderr": base64.b64encode(r.stderr).decode(), "duration_ms": r.duration_ms,
        "timed_out": r.timed_out, "signal": r.signal, "truncated": r.truncated,
    }  # fmt: skip


def _exec_result_from_wire(a: dict[str, Any]) -> ExecResult:
    return ExecResult(
        exit_code=a["exit_code"], stdout=base64.b64decode(a["stdout"]), stderr=base64.b64decode(a["stderr"]),
        duration_ms=a["duration_ms"], timed_out=a["timed_out"], signal=a["signal"], truncated=a["truncated"],
    )  # fmt: skip
