"""The one place that knows the API: each endpoint's method, path, body and answer. The sync
and async classes build a :class:`Call` here, hand it to their transport, and read the answer
with the parsers here, so both speak the API the same way."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from ._errors import HangarError, NetworkError
from ._models import ExecResult, FileEntry, HarnessInfo, ProcessInfo, RunInfo, SandboxInfo, from_dict

# How long a call may wait for its answer beyond what it asks the server to wait: creates and
# pauses wait server-side up to HANGAR_CREATE_WAIT_S (60 s).
WAITING_S = 90.0
# A streamed answer sends a keepalive line every 15 s; a read that waits this long means a
# dead connection.
STREAM_READ_S = 60.0


@dataclass(frozen=True)
class Call:
    """One request to the API. ``path`` is under ``/api/v1``. ``idempotent``: safe to send
    again after a 502/503, a 429 or a broken connection (GET, DELETE, and the calls the API
    documents as setting a state rather than doing something)."""

    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    content: Any = None
    idempotent: bool = False
    read_timeout: float = 60.0
    headers: dict[str, str] = field(default_factory=dict)


def _sb(sandbox_id: str) -> str:
    return f"/sandboxes/{quote(sandbox_id, safe='')}"


def _clean(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body without the arguments left out (None), so the server's defaults apply."""
    return {k: v for k, v in body.items() if v is not None}


# -- sandboxes ---------------------------------------------------------------------------------


def network_body(network: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``"all"`` is short for ``{"egress": "all"}``; a dict is sent as it is."""
    if network is None:
        return None
    if isinstance(network, str):
        return {"egress": network}
    return dict(network)


def sandbox_create(*, image: str, timeout_s: int | None, memory_mb: int | None, cpu: float | None,
                   env: Mapping[str, str] | None, network: str | Mapping[str, Any] | None,
                   extra: Mapping[str, Any]) -> Call:  # fmt: skip
    body = _clean({"image": image, "timeout_s": timeout_s, "memory_mb": memory_mb, "cpu": cpu,
                   "env": dict(env) if env else None, "network": network_body(network), **extra})  # fmt: skip
    return Call("POST", "/sandboxes", json=body, read_timeout=WAITING_S)


def sandbox_get(sandbox_id: str) -> Call:
    return Call("GET", _sb(sandbox_id), idempotent=True)


def sandbox_list(*, status: str | None, limit: int, offset: int) -> Call:
    params = _clean({"status": status, "limit": limit, "offset": offset})
    return Call("GET", "/sandboxes", params=params, idempotent=True)


def sandbox_delete(sandbox_id: str) -> Call:
    return Call("DELETE", _sb(sandbox_id), idempotent=True, read_timeout=WAITING_S)


def sandbox_stop(sandbox_id: str) -> Call:
    return Call("POST", f"{_sb(sandbox_id)}/stop", json={}, read_timeout=WAITING_S)


def sandbox_pause(sandbox_id: str, *, mode: str | None) -> Call:
    return Call("POST", f"{_sb(sandbox_id)}/pause", json=_clean({"mode": mode, "wait": True}),
                read_timeout=WAITING_S)  # fmt: skip


def sandbox_resume(sandbox_id: str) -> Call:
    return Call("POST", f"{_sb(sandbox_id)}/resume", json={"wait": True}, read_timeout=WAITING_S)


def sandbox_keepalive(sandbox_id: str, *, timeout_s: int) -> Call:
    # Sets the expiry to now + timeout_s: sending it twice does what sending it once does.
    return Call("POST", f"{_sb(sandbox_id)}/keepalive", json={"timeout_s": timeout_s}, idempotent=True)


def sandbox_expose(sandbox_id: str, *, port: int, public: bool) -> Call:
    # Gives the port a preview URL, or makes it public or private: a state, not an action.
    return Call("POST", f"{_sb(sandbox_id)}/ports", json={"port": port, "public": public}, idempotent=True)


def sandbox_set_network(sandbox_id: str, *, network: str | Mapping[str, Any]) -> Call:
    return Call("PUT", f"{_sb(sandbox_id)}/network", json=network_body(network), idempotent=True)


def sandbox_stats(sandbox_id: str) -> Call:
    return Call("GET", f"{_sb(sandbox_id)}/stats", idempotent=True)


def sandbox_events(sandbox_id: str, *, after: int = 0, limit: int = 1000) -> Call:
    return Call("GET", f"{_sb(sandbox_id)}/events", params={"after": after, "limit": limit}, idempotent=True)


def process_list(sandbox_id: str) -> Call:
    return Call("GET", f"{_sb(sandbox_id)}/processes", idempotent=True)


def parse_sandbox(data: Any) -> SandboxInfo:
    return from_dict(SandboxInfo, data)


def start_failed(info: SandboxInfo) -> HangarError:
    """A create answered with a sandbox that failed to start (its reason in ``status_reason``)."""
    return HangarError(f"sandbox {info.id} failed to start: {info.status_reason}",
                       body={"id": info.id, "status": info.status})  # fmt: skip


def preview_url(data: Any) -> str:
    return str(data["url"])


# -- commands and processes ---------------------------------------------------------------------


def exec_call(sandbox_id: str, *, cmd: str | Sequence[str], cwd: str | None, env: Mapping[str, str] | None,
              stdin: str | None, timeout_s: float | None, stream: bool = False, background: bool = False,
              stdin_open: bool = False) -> Call:  # fmt: skip
    body = _clean({
        "cmd": cmd if isinstance(cmd, str) else list(cmd), "cwd": cwd, "env": dict(env) if env else None,
        "stdin": stdin, "timeout_s": timeout_s,
        "stream": True if stream else None, "background": True if background else None,
        "stdin_open": True if stdin_open else None,
    })  # fmt: skip
    wait = timeout_s if timeout_s is not None else 60.0
    read = STREAM_READ_S if stream else (60.0 if background else wait + 30.0)
    return Call("POST", f"{_sb(sandbox_id)}/exec", json=body, read_timeout=read)


def parse_exec(data: Any) -> ExecResult:
    return from_dict(ExecResult, data)


def _proc(sandbox_id: str, process_id: int) -> str:
    return f"{_sb(sandbox_id)}/processes/{int(process_id)}"


def process_get(sandbox_id: str, process_id: int) -> Call:
    return Call("GET", _proc(sandbox_id, process_id), idempotent=True)


def process_output(sandbox_id: str, process_id: int, *, follow: bool) -> Call:
    params = {"offset": 0, "follow": "true" if follow else "false"}
    return Call("GET", f"{_proc(sandbox_id, process_id)}/output", params=params, idempotent=True,
                read_timeout=STREAM_READ_S)  # fmt: skip


def process_stdin(sandbox_id: str, process_id: int, *, data: str | bytes, close: bool) -> Call:
    body: dict[str, Any] = {"close": close}
    if isinstance(data, bytes):
        body["data_b64"] = base64.b64encode(data).decode()
    else:
        body["data"] = data
    return Call("POST", f"{_proc(sandbox_id, process_id)}/stdin", json=body)


def process_signal(sandbox_id: str, process_id: int, *, signal: str | int) -> Call:
    return Call("POST", f"{_proc(sandbox_id, process_id)}/signal", json={"signal": signal})


def parse_process(data: Any) -> ProcessInfo:
    return from_dict(ProcessInfo, data)


OutputCallback = Callable[[str], object]


def parse_event(line: str | bytes) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        raise HangarError(f"the server sent a line that is not a JSON object: {line[:200]!r}")
    return event


class OutputCollector:
    """Reads the NDJSON events of a streamed command or a process's output: hands stdout and
    stderr text to the callbacks as it comes, keeps it, and builds the result from the exit
    event. Keepalives, and event types it does not know, are skipped (as docs/api.md asks)."""

    def __init__(self, on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None):
        self.callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        self.out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.process_id: int | None = None
        self.exit: dict[str, Any] | None = None

    def feed_line(self, line: str | bytes) -> None:
        if not line.strip():
            return
        self.feed(parse_event(line))

    def feed(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind in ("stdout", "stderr"):
            data = event.get("data", "")
            if event.get("encoding") == "base64":
                data = base64.b64decode(data).decode("utf-8", "replace")
            self.out[kind].append(data)
            callback = self.callbacks[kind]
            if callback is not None:
                callback(data)
        elif kind == "start":
            self.process_id = event.get("id")
        elif kind == "exit":
            self.exit = event
        elif kind == "error":
            raise HangarError(f"the stream failed: {event.get('message', '')}")

    @property
    def stdout(self) -> str:
        return "".join(self.out["stdout"])

    @property
    def stderr(self) -> str:
        return "".join(self.out["stderr"])

    def result(self) -> ExecResult:
        if self.exit is None:
            raise NetworkError("the output stream ended before the command did")
        code = self.exit.get("exit_code")
        if code is None:  # killed by a signal: as a shell reports it
            code = 128 + int(self.exit.get("signal") or 0)
        return ExecResult(
            exit_code=int(code), stdout=self.stdout, stderr=self.stderr,
            duration_ms=float(self.exit.get("duration_ms") or 0.0),
            timed_out=bool(self.exit.get("timed_out")), id=self.process_id,
        )  # fmt: skip


def terminal_open(sandbox_id: str, *, cmd: str | Sequence[str] | None, cwd: str | None,
                  env: Mapping[str, str] | None, rows: int, cols: int) -> Call:  # fmt: skip
    body = _clean({"cmd": cmd if cmd is None or isinstance(cmd, str) else list(cmd), "cwd": cwd,
                   "env": dict(env) if env else None, "rows": rows, "cols": cols})  # fmt: skip
    return Call("POST", f"{_sb(sandbox_id)}/terminals", json=body)


def terminal_delete(sandbox_id: str, terminal_id: str) -> Call:
    return Call("DELETE", f"{_sb(sandbox_id)}/terminals/{quote(terminal_id, safe='')}", idempotent=True)


# -- files --------------------------------------------------------------------------------------


def file_write(sandbox_id: str, path: str, content: Any, *, size: int | None = None) -> Call:
    # A PUT of whole bytes replaces the file atomically: the same again is the same file. A
    # stream (a file object, an iterator) cannot be sent twice, so it is never retried. A
    # stream's size, when known, goes as its Content-Length (else it is sent chunked).
    headers = {"Content-Type": "application/octet-stream"}
    if size is not None:
        headers["Content-Length"] = str(size)
    return Call("PUT", f"{_sb(sandbox_id)}/files", params={"path": path}, content=content,
                idempotent=isinstance(content, bytes), read_timeout=300.0, headers=headers)  # fmt: skip


def file_read(sandbox_id: str, path: str) -> Call:
    return Call("GET", f"{_sb(sandbox_id)}/files", params={"path": path}, idempotent=True,
                read_timeout=STREAM_READ_S)  # fmt: skip


def file_list(sandbox_id: str, path: str) -> Call:
    return Call("GET", f"{_sb(sandbox_id)}/files/list", params={"path": path}, idempotent=True)


def parse_entries(data: Any) -> list[FileEntry]:
    return [from_dict(FileEntry, e) for e in data]


def join(base: str, *parts: str) -> str:
    """A path inside the sandbox (always ``/``-separated)."""
    out = base.rstrip("/") or "/"
    for part in parts:
        if part:
            out = f"{out.rstrip('/')}/{part}"
    return out


# -- harnesses and runs -------------------------------------------------------------------------


def harness_create(*, name: str, agent: str, repo: Mapping[str, Any] | str | None,
                   extra: Mapping[str, Any]) -> Call:  # fmt: skip
    repo_body = {"url": repo} if isinstance(repo, str) else (dict(repo) if repo is not None else None)
    body = _clean({"name": name, "agent": agent, "repo": repo_body, **extra})
    return Call("POST", "/harnesses", json=body, read_timeout=WAITING_S)


def harness_list() -> Call:
    return Call("GET", "/harnesses", idempotent=True)


def harness_runs(harness_id: str) -> Call:
    return Call("GET", f"/harnesses/{quote(harness_id, safe='')}/runs", idempotent=True)


def harness_logs(harness_id: str, *, after: int = 0, limit: int = 500) -> Call:
    return Call("GET", f"/harnesses/{quote(harness_id, safe='')}/logs", params={"after": after, "limit": limit},
                idempotent=True)  # fmt: skip


def harness_get(harness_id: str) -> Call:
    return Call("GET", f"/harnesses/{quote(harness_id, safe='')}", idempotent=True)


def harness_delete(harness_id: str, *, delete_volume: bool) -> Call:
    params = {"delete_volume": "true" if delete_volume else "false"}
    return Call("DELETE", f"/harnesses/{quote(harness_id, safe='')}", params=params, idempotent=True,
                read_timeout=WAITING_S)  # fmt: skip


def harness_pause(harness_id: str) -> Call:
    return Call("POST", f"/harnesses/{quote(harness_id, safe='')}/pause", json={"wait": True},
                read_timeout=WAITING_S)  # fmt: skip


def harness_resume(harness_id: str) -> Call:
    return Call("POST", f"/harnesses/{quote(harness_id, safe='')}/resume", json={"wait": True},
                read_timeout=WAITING_S)  # fmt: skip


def run_create(harness_id: str, *, prompt: str, timeout_s: int | None) -> Call:
    body = _clean({"prompt": prompt, "timeout_s": timeout_s})
    return Call("POST", f"/harnesses/{quote(harness_id, safe='')}/runs", json=body)


def run_get(run_id: str) -> Call:
    return Call("GET", f"/runs/{quote(run_id, safe='')}", idempotent=True)


def run_logs(run_id: str, *, follow: bool = True) -> Call:
    return Call("GET", f"/runs/{quote(run_id, safe='')}/logs", params={"follow": "true" if follow else "false"},
                idempotent=True, read_timeout=STREAM_READ_S)  # fmt: skip


def run_cancel(run_id: str) -> Call:
    return Call("POST", f"/runs/{quote(run_id, safe='')}/cancel", json={})


# -- volumes and tokens -------------------------------------------------------------------------


def volume_create(*, name: str, size_mb: int, node: str | None = None) -> Call:
    return Call("POST", "/volumes", json=_clean({"name": name, "size_mb": size_mb, "node": node}))


def volume_list() -> Call:
    return Call("GET", "/volumes", idempotent=True)


def volume_get(volume: str) -> Call:
    return Call("GET", f"/volumes/{quote(volume, safe='')}", idempotent=True)


def volume_delete(volume: str) -> Call:
    return Call("DELETE", f"/volumes/{quote(volume, safe='')}", idempotent=True)


def token_current() -> Call:
    return Call("GET", "/tokens/current", idempotent=True)


def parse_harness(data: Any) -> HarnessInfo:
    return from_dict(HarnessInfo, data)


def parse_run(data: Any) -> RunInfo:
    return from_dict(RunInfo, data)


# A harness's states that end a wait for it to run, and a run's that are not final.
HARNESS_SETTLED = ("running", "failed", "stopped", "deleted")
RUN_ACTIVE = ("queued", "running")
