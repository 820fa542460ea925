"""The MCP tools: each one is an API call of ``/api/v1`` in another shape, authorised by that
call's rule (``dashboard.api.permissions.RULES``: the token's scopes and the lower of its role
and its user's role in the team) and done by the same services, so a tool reaches exactly what
the token reaches on the API (its team's sandboxes; a harness's own token, what its harness
made). Answers are text an LLM can read, with the same facts as structured content beside it;
a refusal or a mistake is a :class:`ServiceError`, which the server turns into a tool error."""

from __future__ import annotations

import asyncio
import codecs
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from typing import Any

from django.conf import settings

from dashboard.live import wait_for
from runtime.aio import blocking
from runtime.errors import ServiceError
from runtime.models import ApiToken, Run, Sandbox
from runtime.notify import sandbox_channel
from runtime.services import exec_limits
from runtime.services import harnesses as harness_svc
from runtime.services import processes as proc_svc
from runtime.services import runs as run_svc
from runtime.services import sandbox_io as io_svc
from runtime.services import sandboxes as svc
from runtime.services.previews import port_expose, previews_of

from ..api.permissions import RULES, SB, check_rule, sees_pseudo_fs

# What one answer carries of a command's output (each stream), a file, a diff or a run's
# output: an LLM reads text, and megabytes of it help nobody. The tail is kept (where errors are).
OUTPUT_CHARS = 64 * 1024
FILE_BYTES = 1024 * 1024
RUN_TAIL_CHARS = 16 * 1024
LIST_LIMIT = 200


@dataclass
class Result:
    """A tool's answer: ``text`` for the model, ``data`` as structured content, ``error`` for a
    result that is a failure (a sandbox that failed to start, a command that timed out is not)."""

    text: str
    data: dict[str, Any] = field(default_factory=dict)
    error: bool = False


Handler = Callable[[ApiToken, dict[str, Any]], Awaitable[Result]]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    properties: dict[str, dict[str, Any]]
    required: tuple[str, ...]
    rule: tuple[str, str]  # the API call it stands for: its key in RULES
    handler: Handler
    read_only: bool = False
    destructive: bool = False

    def input_schema(self) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": self.properties,
            "required": list(self.required),
            "additionalProperties": False,
        }

    def check(self, token: ApiToken) -> None:
        check_rule(token, RULES[self.rule])


# -- arguments --------------------------------------------------------------------------------


def _string(description: str, **more: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **more}


def _sandbox_id() -> dict[str, Any]:
    return _string("the sandbox's id, as create_sandbox or list_sandboxes gave it", minLength=1, maxLength=64)


def _path(what: str) -> dict[str, Any]:
    return _string(f"absolute path inside the sandbox of {what}, e.g. /tmp/hello.txt", minLength=1)


# -- helpers ----------------------------------------------------------------------------------


def _get(token: ApiToken, sandbox_id: str) -> Sandbox:
    return svc.sandbox_get(team=token.team, sandbox_id=sandbox_id, caller=token)


def _iso(when: datetime | None) -> str | None:
    return when.isoformat() if when else None


def _sandbox_data(sb: Sandbox) -> dict[str, Any]:
    return {
        "id": sb.id, "status": sb.status, "status_reason": sb.status_reason, "image": sb.image,
        "runtime": sb.runtime, "cpu": sb.cpu, "memory_mb": sb.memory_mb, "timeout_s": sb.timeout_s,
        "created_at": _iso(sb.created_at), "expires_at": _iso(sb.expires_at),
    }  # fmt: skip


def _sandbox_line(sb: Sandbox) -> str:
    why = f" ({sb.status_reason})" if sb.status_reason else ""
    expires = f", expires {_iso(sb.expires_at)}" if sb.expires_at else ""
    return f"{sb.id}: {sb.status}{why}, image {sb.image}, {sb.cpu:g} vCPU, {sb.memory_mb} MB{expires}"


def _tail(text: str, limit: int) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    return f"[… {len(text) - limit} characters cut …]\n" + text[-limit:], True


def _decode(data: bytes | bytearray) -> str:
    return bytes(data).decode("utf-8", errors="replace")


async def _wait(sandbox_id: str, statuses: tuple[str, ...]) -> Sandbox:
    """The sandbox once its status is one of ``statuses`` (or HANGAR_CREATE_WAIT_S has passed),
    waited for on the event loop as the API's ``wait`` does."""
    return await wait_for(
        sandbox_channel(sandbox_id), lambda: Sandbox.objects.get(id=sandbox_id),
        lambda row: row.status in statuses, settings.HANGAR_CREATE_WAIT_S,
    )  # fmt: skip


# -- sandboxes --------------------------------------------------------------------------------


async def create_sandbox(token: ApiToken, args: dict[str, Any]) -> Result:
    def create() -> str:
        harness_svc.harness_token_create_check(token=token, secrets=[], volumes=[])
        spec = svc.SandboxRequest(
            image=args["image"], cpu=float(args.get("cpu", 1.0)), memory_mb=int(args.get("memory_mb", 512)),
            timeout_s=int(args.get("timeout_s", 300)),
        )  # fmt: skip
        return svc.sandbox_create(team=token.team, user=token.user, request=spec, created_by_token=token).id

    sb = await _wait(await blocking(create)(), svc.SETTLED)
    data = _sandbox_data(sb)
    if sb.status == Sandbox.Status.RUNNING:
        return Result(f"Created sandbox {sb.id}; it is running.\n{_sandbox_line(sb)}", data)
    if sb.status == Sandbox.Status.FAILED:
        return Result(f"Sandbox {sb.id} failed to start: {sb.status_reason}", data, error=True)
    return Result(f"Created sandbox {sb.id}; it is {sb.status} (not running yet).\n{_sandbox_line(sb)}", data)


async def list_sandboxes(token: ApiToken, args: dict[str, Any]) -> Result:
    rows = await blocking(lambda: list(svc.sandboxes_for_team(team=token.team, caller=token)[:LIST_LIMIT]))()
    if not rows:
        return Result("No sandboxes.", {"sandboxes": []})
    text = f"{len(rows)} sandbox(es), newest first:\n" + "\n".join(_sandbox_line(sb) for sb in rows)
    return Result(text, {"sandboxes": [_sandbox_data(sb) for sb in rows]})


async def run_command(token: ApiToken, args: dict[str, Any]) -> Result:
    timeout_s = float(args.get("timeout_s", 60))
    slot = exec_limits.blocking_exec_slot(team=token.team)
    try:
        outcome = await blocking(
            lambda: io_svc.sandbox_exec(
                sandbox=_get(token, args["sandbox_id"]), cmd=args["command"], cwd=args.get("cwd"),
                timeout_s=timeout_s, user=token.user,
            )
        )()  # fmt: skip
    finally:
        slot.release()
    r = outcome.result
    stdout, cut_out = _tail(_decode(r.stdout), OUTPUT_CHARS)
    stderr, cut_err = _tail(_decode(r.stderr), OUTPUT_CHARS)
    notes = []
    if r.timed_out:
        notes.append(f"timed out after {timeout_s:g} s and was killed")
    if r.truncated:
        notes.append("output past HANGAR_EXEC_MAX_OUTPUT_BYTES was dropped")
    head = f"exit code: {r.exit_code}" + (f" ({'; '.join(notes)})" if notes else "")
    text = f"{head}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    data = {
        "exit_code": r.exit_code, "stdout": stdout, "stderr": stderr, "duration_ms": round(r.duration_ms, 3),
        "timed_out": r.timed_out, "truncated": r.truncated or cut_out or cut_err, "id": outcome.exec.id,
    }  # fmt: skip
    return Result(text, data)


async def write_file(token: ApiToken, args: dict[str, Any]) -> Result:
    data = args["content"].encode()
    path = args["path"]
    size = await blocking(
        lambda: io_svc.sandbox_file_write(
            sandbox=_get(token, args["sandbox_id"]), path=path, data=[data], size=len(data)
        )
    )()
    return Result(f"Wrote {size} bytes to {path}.", {"path": path, "size": size})


async def read_file(token: ApiToken, args: dict[str, Any]) -> Result:
    path = args["path"]

    def read() -> tuple[int, bytes, bool]:
        entry, chunks = io_svc.sandbox_file_read(
            sandbox=_get(token, args["sandbox_id"]), path=path,
            no_pseudo_fs=not sees_pseudo_fs(token.effective_role),
        )  # fmt: skip
        got, cut = bytearray(), False
        try:
            for chunk in chunks:
                got += chunk
                if len(got) > FILE_BYTES:
                    cut = True
                    break
        finally:
            getattr(chunks, "close", lambda: None)()
        return entry.size, bytes(got[:FILE_BYTES]), cut

    size, data, cut = await blocking(read)()
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        content = decoder.decode(data, final=not cut)
        binary = False
    except UnicodeDecodeError:
        content, binary = _decode(data), True
    note = f" (the first {FILE_BYTES} bytes of {size})" if cut else ""
    kind = " It is not UTF-8 text: invalid bytes are shown as U+FFFD." if binary else ""
    text = f"{path}, {size} bytes{note}.{kind}\n{content}"
    return Result(text, {"path": path, "size": size, "content": content, "truncated": cut, "binary": binary})


async def list_files(token: ApiToken, args: dict[str, Any]) -> Result:
    path = args["path"]
    entries = await blocking(
        lambda: io_svc.sandbox_file_list(
            sandbox=_get(token, args["sandbox_id"]), path=path,
            no_pseudo_fs=not sees_pseudo_fs(token.effective_role),
        )
    )()  # fmt: skip
    rows = [e.__dict__ for e in entries]
    lines = [f"{e.type:<8} {e.size:>10}  {e.path}" for e in entries]
    text = f"{path}: {len(entries)} entries\n" + "\n".join(lines) if entries else f"{path} is empty."
    return Result(text, {"path": path, "entries": rows})


async def get_preview_url(token: ApiToken, args: dict[str, Any]) -> Result:
    port = int(args["port"])

    def preview() -> dict[str, Any]:
        sb = _get(token, args["sandbox_id"])
        found = [p for p in previews_of(sb) if p.port == port]
        if found:
            return found[0].__dict__
        # Giving a port its URL is a change (POST .../ports): a member's, with the write scope.
        check_rule(token, RULES[("POST", f"{SB}/ports")])
        return port_expose(sandbox=sb, port=port).__dict__

    p = await blocking(preview)()
    who = "anyone" if p["public"] else "anyone with this URL (it carries a signed token)"
    text = f"Port {port} of sandbox {args['sandbox_id']} is reachable by {who} at:\n{p['url']}"
    return Result(text, {"sandbox_id": args["sandbox_id"], **p})


async def pause_sandbox(token: ApiToken, args: dict[str, Any]) -> Result:
    sid = args["sandbox_id"]
    await blocking(lambda: svc.sandbox_pause(sandbox=_get(token, sid)))()
    sb = await _wait(sid, (Sandbox.Status.PAUSED, Sandbox.Status.FAILED, Sandbox.Status.DELETED))
    return Result(f"Sandbox {sid} is {sb.status}.\n{_sandbox_line(sb)}", _sandbox_data(sb),
                  error=sb.status == Sandbox.Status.FAILED)  # fmt: skip


async def resume_sandbox(token: ApiToken, args: dict[str, Any]) -> Result:
    sid = args["sandbox_id"]
    await blocking(lambda: svc.sandbox_resume(sandbox=_get(token, sid)))()
    sb = await _wait(sid, svc.SETTLED)
    return Result(f"Sandbox {sid} is {sb.status}.\n{_sandbox_line(sb)}", _sandbox_data(sb),
                  error=sb.status == Sandbox.Status.FAILED)  # fmt: skip


async def delete_sandbox(token: ApiToken, args: dict[str, Any]) -> Result:
    sid = args["sandbox_id"]

    def delete() -> Sandbox:
        svc.sandbox_delete(sandbox=_get(token, sid), reason="deleted through MCP")
        return Sandbox.objects.get(id=sid)

    sb = await blocking(delete)()
    return Result(f"Sandbox {sid} is {sb.status}: it is stopped and destroyed.", _sandbox_data(sb))


# -- harness runs -----------------------------------------------------------------------------


def _run_data(r: Run) -> dict[str, Any]:
    diff, diff_cut = _tail(r.diff, OUTPUT_CHARS)
    return {
        "id": r.id, "harness": r.harness_id, "harness_name": r.harness.name, "status": r.status,
        "exit_code": r.exit_code, "error": r.error, "duration_ms": r.duration_ms, "diff": diff,
        "diff_truncated": r.diff_truncated or diff_cut, "created_at": _iso(r.created_at),
        "started_at": _iso(r.started_at), "finished_at": _iso(r.finished_at),
    }  # fmt: skip


def _run_text(data: dict[str, Any]) -> str:
    lines = [f"run {data['id']} of harness {data['harness_name']}: {data['status']}"]
    if data["exit_code"] is not None:
        lines.append(f"exit code: {data['exit_code']}")
    if data["error"]:
        lines.append(f"error: {data['error']}")
    if data.get("output") is not None:
        lines.append(f"--- output (tail) ---\n{data['output']}")
    if data["diff"]:
        lines.append(f"--- diff ---\n{data['diff']}")
    elif data["status"] not in Run.ACTIVE:
        lines.append("diff: (no changes)")
    return "\n".join(lines)


async def start_run(token: ApiToken, args: dict[str, Any]) -> Result:
    def start() -> dict[str, Any]:
        harness = harness_svc.harness_get(team=token.team, harness_id=args["harness"])
        run = run_svc.run_create(harness=harness, user=token.user, prompt=args["prompt"])
        return _run_data(run_svc.run_get(team=token.team, run_id=run.id))

    data = await blocking(start)()
    text = _run_text(data) + "\nFollow it with get_run until its status is no longer queued or running."
    return Result(text, data)


async def _output_tail(handle: proc_svc.ProcessHandle) -> str:
    """The tail of what the run's process has written so far (stdout and stderr as they came),
    from the stream bridge's ring: what is there now, never waiting for more."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = ""
    try:
        async with asyncio.timeout(5):
            async for event in handle.follow(follow=False, flow=False):
                if event[0] == "output":
                    text = (text + decoder.decode(event[2]))[-2 * RUN_TAIL_CHARS :]
    except TimeoutError:
        pass
    return _tail(text, RUN_TAIL_CHARS)[0]


async def get_run(token: ApiToken, args: dict[str, Any]) -> Result:
    def read() -> tuple[dict[str, Any], proc_svc.ProcessHandle | None]:
        run = run_svc.run_get(team=token.team, run_id=args["run_id"])
        if not (run.exec_id and run.exec):
            return _run_data(run), None
        # Where the process runs is read here, on the pool (its node is a row).
        return _run_data(run), proc_svc.ProcessHandle.of_exec(run.exec.sandbox, run.exec_id)

    data, handle = await blocking(read)()
    data["output"] = await _output_tail(handle) if handle else ""
    return Result(_run_text(data), data)


# -- the list ---------------------------------------------------------------------------------


@cache
def tools() -> dict[str, Tool]:
    """Every tool by name (built once, after the settings that bound the arguments are read)."""
    s = settings
    found = [
        Tool(
            "create_sandbox",
            "Create an isolated Linux sandbox (gVisor) from an image and wait until it runs. Returns its "
            "id, which every other sandbox tool takes. It has no network and is destroyed when timeout_s "
            "runs out.",
            {
                "image": _string(
                    "the image to start from, e.g. busybox or base (Debian with git, Python, "
                    "Node.js); the images this Hangar has are named in the error for an unknown "
                    "one",
                    minLength=1,
                    maxLength=300,
                ),
                "cpu": {
                    "type": "number",
                    "minimum": 0.1,
                    "maximum": s.HANGAR_SANDBOX_MAX_CPU,
                    "description": "vCPUs (default 1)",
                },
                "memory_mb": {
                    "type": "integer",
                    "minimum": s.HANGAR_SANDBOX_MIN_MEMORY_MB,
                    "maximum": s.HANGAR_SANDBOX_MAX_MEMORY_MB,
                    "description": "memory limit in MB (default 512)",
                },
                "timeout_s": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": s.HANGAR_SANDBOX_MAX_TIMEOUT_S,
                    "description": "seconds until it expires and is destroyed (default 300)",
                },
            },
            ("image",),
            ("POST", "/sandboxes"),
            create_sandbox,
        ),
        Tool(
            "list_sandboxes",
            "List the sandboxes this token can reach (newest first, deleted ones left out): id, status, "
            "image, size, expiry.",
            {},
            (),
            ("GET", "/sandboxes"),
            list_sandboxes,
            read_only=True,
        ),
        Tool(
            "run_command",
            "Run a shell command in a running sandbox (under /bin/sh -c) and wait for it to finish. "
            "Returns its exit code, stdout and stderr.",
            {
                "sandbox_id": _sandbox_id(),
                "command": _string(
                    "the command line, run by /bin/sh -c, e.g. 'ls -la /tmp && echo done'", minLength=1
                ),
                "cwd": _string(
                    "the directory to run it in (absolute; default: the image's working directory)"
                ),
                "timeout_s": {
                    "type": "number",
                    "exclusiveMinimum": 0,
                    "maximum": s.HANGAR_EXEC_MAX_TIMEOUT_S,
                    "description": "kill it after this many seconds (default 60)",
                },
            },
            ("sandbox_id", "command"),
            ("POST", f"{SB}/exec"),
            run_command,
        ),
        Tool(
            "write_file",
            "Write a text file inside a running sandbox (UTF-8; parent directories are created, an "
            "existing file is replaced).",
            {
                "sandbox_id": _sandbox_id(),
                "path": _path("the file to write"),
                "content": _string("the file's whole content, as text"),
            },
            ("sandbox_id", "path", "content"),
            ("PUT", f"{SB}/files"),
            write_file,
        ),
        Tool(
            "read_file",
            f"Read a file inside a running sandbox as text (its first {FILE_BYTES} bytes at most).",
            {"sandbox_id": _sandbox_id(), "path": _path("the file to read")},
            ("sandbox_id", "path"),
            ("GET", f"{SB}/files"),
            read_file,
            read_only=True,
        ),
        Tool(
            "list_files",
            "List a directory inside a running sandbox: each entry's type (file, dir, symlink…), size and "
            "path; symlinks are listed, not followed.",
            {"sandbox_id": _sandbox_id(), "path": _path("the directory to list, e.g. /")},
            ("sandbox_id", "path"),
            ("GET", f"{SB}/files/list"),
            list_files,
            read_only=True,
        ),
        Tool(
            "get_preview_url",
            "Get the URL at which a server listening on a port inside the sandbox can be reached over "
            "HTTP(S) and websockets (a private URL with a signed token; the port is given one if it has "
            "none yet).",
            {
                "sandbox_id": _sandbox_id(),
                "port": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 65535,
                    "description": "the port the server listens on inside",
                },
            },
            ("sandbox_id", "port"),
            ("GET", f"{SB}/ports"),
            get_preview_url,
        ),
        Tool(
            "pause_sandbox",
            "Pause a running sandbox and wait until it is paused: its CPU and memory are freed, its files "
            "kept (in its pause mode, stop by default, its processes end). A paused sandbox does not expire.",
            {"sandbox_id": _sandbox_id()},
            ("sandbox_id",),
            ("POST", f"{SB}/pause"),
            pause_sandbox,
        ),
        Tool(
            "resume_sandbox",
            "Resume a paused sandbox and wait until it runs again, over the files it had; its timeout "
            "starts afresh.",
            {"sandbox_id": _sandbox_id()},
            ("sandbox_id",),
            ("POST", f"{SB}/resume"),
            resume_sandbox,
        ),
        Tool(
            "delete_sandbox",
            "Stop and destroy a sandbox and everything in it (not its volumes). It cannot be undone.",
            {"sandbox_id": _sandbox_id()},
            ("sandbox_id",),
            ("DELETE", SB),
            delete_sandbox,
            destructive=True,
        ),
        Tool(
            "start_run",
            "Give a harness's coding agent (Claude Code, Codex…, set up in its workspace) a task: it runs "
            "headless in /workspace with this prompt. Returns the run's id at once; poll get_run.",
            {
                "harness": _string("the harness's id or name", minLength=1, maxLength=64),
                "prompt": _string(
                    f"the task for the agent (at most {run_svc.MAX_PROMPT} bytes)", minLength=1
                ),
            },
            ("harness", "prompt"),
            ("POST", "/harnesses/{harness_id}/runs"),
            start_run,
        ),
        Tool(
            "get_run",
            "A harness run: its status (queued, running, succeeded, failed, timed_out, cancelled), exit "
            "code, the tail of the agent's output and the diff it left in the workspace.",
            {"run_id": _string("the run's id, as start_run gave it", minLength=1, maxLength=64)},
            ("run_id",),
            ("GET", "/runs/{run_id}"),
            get_run,
            read_only=True,
        ),
    ]
    for tool in found:
        if tool.rule not in RULES:  # a tool stands for an API call: it has that call's rule
            raise AssertionError(f"tool {tool.name}: no API rule {tool.rule}")
    return {tool.name: tool for tool in found}


def explain(exc: ServiceError) -> str:
    """A service's refusal as a tool error's text: its message, and what it carries (a quota's
    use and limit, the role needed)."""
    extra = {
        k: v
        for k, v in exc.extra.items()
        if isinstance(v, str | int | float | bool) and str(v) not in exc.message
    }
    more = f" ({', '.join(f'{k}: {v}' for k, v in extra.items())})" if extra else ""
    return f"{exc.message}{more}"


__all__ = ["Result", "Tool", "explain", "tools"]
