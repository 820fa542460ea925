"""``hangar sandbox …``: create, list, get, exec, shell, cp, logs, pause, resume, rm (and
keepalive, preview, ps)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .. import _api as api
from .._errors import ConflictError, HangarError
from .._models import SandboxInfo
from ..sandbox import Sandbox
from ._common import ago, call, connect, emit_json, exit_status, fail, pairs, pump, say, table
from .copy import copy
from .shell import interactive

# How often ``logs`` asks for new events, and the statuses after which a sandbox has no more.
POLL_S = 1.0
GONE = ("deleted", "failed")


def _sandbox(args: argparse.Namespace, sandbox_id: str) -> Sandbox:
    data = call(args, api.sandbox_get(sandbox_id))
    return Sandbox(api.parse_sandbox(data), connect(args))


def _network(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.allow:
        if args.network not in (None, "allowlist"):
            fail("--allow goes with --network allowlist (or alone)", 2)
        return {"egress": "allowlist", "allow": args.allow}
    return {"egress": args.network} if args.network else None


def _volumes(specs: list[str] | None) -> list[dict[str, Any]]:
    out = []
    for spec in specs or ():
        name, sep, rest = spec.partition(":")
        path, _, mode = rest.partition(":")
        if not sep or not name or not path.startswith("/") or mode not in ("", "ro", "rw"):
            fail(f"--volume must be NAME:/path[:ro], not {spec!r}", 2)
        out.append({"volume": name, "mount_path": path, "read_only": mode == "ro"})
    return out


def cmd_create(args: argparse.Namespace) -> int:
    extra: dict[str, Any] = {
        "disk_mb": args.disk_mb, "secrets": args.secret or None, "metadata": pairs(args.metadata, "--metadata") or None,
        "ports": args.port or None, "volumes": _volumes(args.volume) or None, "runtime": args.runtime,
        "pause_mode": args.pause_mode, "idle_timeout_s": args.idle_timeout_s,
    }  # fmt: skip
    request = api.sandbox_create(
        image=args.image, timeout_s=args.timeout_s, memory_mb=args.memory_mb, cpu=args.cpu,
        env=pairs(args.env, "--env"), network=_network(args), extra={k: v for k, v in extra.items() if v is not None},
    )  # fmt: skip
    if not args.json:
        say(f"starting a sandbox from {args.image}…")
    data = call(args, request)
    info = api.parse_sandbox(data)
    if args.json:
        emit_json(data)
    else:
        print(info.id)
    if info.status == "failed":
        fail(f"sandbox {info.id} failed to start: {info.status_reason}")
    return 0


def _row(s: SandboxInfo) -> list[Any]:
    return [s.id, s.status, s.image, s.runtime, f"{s.cpu:g}", s.memory_mb, ago(s.created_at),
            ago(s.expires_at) if s.status == "running" else ""]  # fmt: skip


HEADERS = ["ID", "STATUS", "IMAGE", "RUNTIME", "CPU", "MEMORY_MB", "CREATED", "EXPIRES"]


def cmd_list(args: argparse.Namespace) -> int:
    rows = call(args, api.sandbox_list(status=args.status, limit=args.limit, offset=0))
    if args.json:
        emit_json(rows)
    else:
        table([_row(api.parse_sandbox(r)) for r in rows], HEADERS)
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    data = call(args, api.sandbox_get(args.sandbox_id))
    if args.json:
        emit_json(data)
        return 0
    s = api.parse_sandbox(data)
    fields = [
        ("id", s.id), ("status", s.status + (f" ({s.status_reason})" if s.status_reason else "")),
        ("image", s.image), ("runtime", s.runtime), ("node", s.node), ("cpu", f"{s.cpu:g}"),
        ("memory", f"{s.memory_mb} MB"), ("disk", f"{s.disk_mb} MB" if s.disk_mb else "-"),
        ("created", ago(s.created_at)), ("expires", ago(s.expires_at)),
        ("network", s.network.get("egress", "-")),
    ]  # fmt: skip
    fields += [(f"port {p.get('port')}", p.get("url", "")) for p in s.previews]
    fields += [(f"meta {k}", v) for k, v in s.metadata.items()]
    width = max(len(k) for k, _ in fields)
    for key, value in fields:
        print(f"{key.ljust(width)}  {value if value not in (None, '') else '-'}")
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    argv = list(args.command)
    if not argv:
        fail("no command: hangar sandbox exec ID -- CMD [ARGS…]", 2)
    stdin = sys.stdin.read() if args.stdin else None
    cmd: str | list[str] = argv[0] if args.shell_string and len(argv) == 1 else argv
    request = api.exec_call(args.sandbox_id, cmd=cmd, cwd=args.cwd, env=pairs(args.env, "--env") or None,
                            stdin=stdin, timeout_s=args.timeout_s, stream=True)  # fmt: skip
    return exit_status(pump(connect(args).lines(request)))


def cmd_shell(args: argparse.Namespace) -> int:
    sandbox = _sandbox(args, args.sandbox_id)
    if sandbox.status == "paused":
        say(f"resuming {sandbox.id}…")
        sandbox.resume()
    return interactive(sandbox, cmd=args.command or None, cwd=args.cwd, env=pairs(args.env, "--env"))


def cmd_cp(args: argparse.Namespace) -> int:
    return copy(args, args.src, args.dst)


def _print_event(e: dict[str, Any]) -> None:
    change = f"{e.get('status_from') or '-'} -> {e.get('status_to')}" if e.get("status_to") else ""
    stamp = str(e.get("created_at", ""))[:19].replace("T", " ")
    print("  ".join(p for p in (stamp, e.get("kind", ""), change, e.get("message", "")) if p), flush=True)


def cmd_logs(args: argparse.Namespace) -> int:
    t = connect(args)
    if args.process is not None:
        return exit_status(
            pump(t.lines(api.process_output(args.sandbox_id, args.process, follow=args.follow)))
        )
    after = 0
    while True:
        events = t.json(api.sandbox_events(args.sandbox_id, after=after))
        for event in events:
            _print_event(event)
            after = max(after, int(event["id"]))
        if not args.follow:
            return 0
        if not events:
            status = t.json(api.sandbox_get(args.sandbox_id))["status"]
            if status in GONE:
                return 0
            time.sleep(POLL_S)


def cmd_ps(args: argparse.Namespace) -> int:
    rows = call(args, api.process_list(args.sandbox_id))
    if args.json:
        emit_json(rows)
    else:
        table([[p["id"], p.get("pid"), p["status"], p.get("exit_code"), " ".join(p.get("argv") or [])]
               for p in rows], ["ID", "PID", "STATUS", "EXIT", "COMMAND"])  # fmt: skip
    return 0


def _state_change(args: argparse.Namespace, request: api.Call, verb: str) -> int:
    try:
        data = call(args, request)
    except ConflictError as exc:
        fail(f"cannot {verb} {args.sandbox_id}: {exc.message}")
    if args.json:
        emit_json(data)
    else:
        say(f"{args.sandbox_id}: {data['status']}")
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    return _state_change(args, api.sandbox_pause(args.sandbox_id, mode=args.mode), "pause")


def cmd_resume(args: argparse.Namespace) -> int:
    return _state_change(args, api.sandbox_resume(args.sandbox_id), "resume")


def cmd_keepalive(args: argparse.Namespace) -> int:
    return _state_change(args, api.sandbox_keepalive(args.sandbox_id, timeout_s=args.timeout_s), "keep alive")


def cmd_preview(args: argparse.Namespace) -> int:
    data = call(args, api.sandbox_expose(args.sandbox_id, port=args.port, public=args.public))
    if args.json:
        emit_json(data)
    else:
        print(api.preview_url(data))
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    failed = 0
    for sandbox_id in args.sandbox_ids:
        try:
            call(args, api.sandbox_delete(sandbox_id))
        except HangarError as exc:
            say(f"hangar: {sandbox_id}: {exc.message}")
            failed += 1
        else:
            say(f"{sandbox_id}: deleted")
    return 1 if failed else 0


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("sandbox", aliases=["sb"], help="sandboxes: create, exec, shell, cp, logs…")
    s = p.add_subparsers(dest="sandbox_cmd", required=True, metavar="COMMAND")
    json_flag = argparse.ArgumentParser(add_help=False)
    json_flag.add_argument(
        "--json", action="store_true", help="print the API's JSON (one document) and nothing else"
    )

    c = s.add_parser("create", parents=[common, json_flag], help="start a sandbox; prints its id")
    c.add_argument("--image", required=True, help="an image name (hangar's `GET /images`)")
    c.add_argument("--cpu", type=float, help="cores (default 1)")
    c.add_argument("--memory-mb", type=int, help="memory limit (default 512)")
    c.add_argument("--disk-mb", type=int, help="its own disk of this size")
    c.add_argument("--timeout-s", type=int, help="it expires this long from now (default 300)")
    c.add_argument("--idle-timeout-s", type=int, help="paused after this long without activity")
    c.add_argument("--env", action="append", metavar="K=V", help="an environment variable (repeatable)")
    c.add_argument(
        "--secret", action="append", metavar="NAME", help="a team secret as an env var (repeatable)"
    )
    c.add_argument("--metadata", action="append", metavar="K=V", help="a label (repeatable)")
    c.add_argument("--network", choices=["none", "all", "allowlist"], help="egress (default none)")
    c.add_argument("--allow", action="append", metavar="HOST", help="egress allowed to HOST[:PORT] or a CIDR")
    c.add_argument("--port", action="append", type=int, help="give this port a preview URL (repeatable)")
    c.add_argument("--volume", action="append", metavar="NAME:/PATH[:ro]", help="mount a volume (repeatable)")
    c.add_argument("--runtime", help="gvisor or microvm (default: the server's)")
    c.add_argument("--pause-mode", choices=["stop", "checkpoint"])
    c.set_defaults(fn=cmd_create)

    ls = s.add_parser("list", aliases=["ls"], parents=[common, json_flag], help="the team's sandboxes")
    ls.add_argument("--status", help="only these (e.g. running, paused, deleted)")
    ls.add_argument("--limit", type=int, default=100)
    ls.set_defaults(fn=cmd_list)

    g = s.add_parser("get", parents=[common, json_flag], help="one sandbox")
    g.add_argument("sandbox_id", metavar="ID")
    g.set_defaults(fn=cmd_get)

    e = s.add_parser("exec", parents=[common], help="run a command, streaming its output; exits with its status",
                     usage="hangar sandbox exec ID [options] -- CMD [ARGS…]")  # fmt: skip
    e.add_argument("sandbox_id", metavar="ID")
    e.add_argument("--cwd", help="working directory")
    e.add_argument("--env", action="append", metavar="K=V")
    e.add_argument("--timeout-s", type=float, help="kill it after this long (exit status 124)")
    e.add_argument("-i", "--stdin", action="store_true", help="send this command's stdin to it")
    e.add_argument("-c", "--shell-string", action="store_true",
                   help="one argument that is a shell command line (run by /bin/sh -c)")  # fmt: skip
    e.add_argument("command", nargs="*", help="after --: the command and its arguments")
    e.set_defaults(fn=cmd_exec)

    sh = s.add_parser("shell", parents=[common], help="an interactive terminal in the sandbox")
    sh.add_argument("sandbox_id", metavar="ID")
    sh.add_argument("--cwd")
    sh.add_argument("--env", action="append", metavar="K=V")
    sh.add_argument("command", nargs="*", help="after --: a command instead of a login shell")
    sh.set_defaults(fn=cmd_shell)

    cp = s.add_parser("cp", parents=[common], help="copy files or directories in or out: cp ./src ID:/code",
                      description="SRC or DST is ID:/path. A directory's contents land at DST; a file lands "
                      "at DST, or inside it when DST is a directory or ends with /.")  # fmt: skip
    cp.add_argument("src")
    cp.add_argument("dst")
    bar = cp.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="always show a progress bar (default: on a terminal, for transfers over 4 MiB)")  # fmt: skip
    bar.add_argument("--no-progress", dest="progress", action="store_false")
    cp.set_defaults(fn=cmd_cp)

    lg = s.add_parser("logs", parents=[common], help="follow the sandbox's events, or a process's output")
    lg.add_argument("sandbox_id", metavar="ID")
    lg.add_argument("--process", type=int, metavar="PID", help="a process's output (its id from `ps`)")
    lg.add_argument("--no-follow", dest="follow", action="store_false", help="what there is now, then exit")
    lg.set_defaults(fn=cmd_logs)

    ps = s.add_parser("ps", parents=[common, json_flag], help="its streamed and background processes")
    ps.add_argument("sandbox_id", metavar="ID")
    ps.set_defaults(fn=cmd_ps)

    pa = s.add_parser("pause", parents=[common, json_flag], help="pause it (with its processes: checkpoint)")
    pa.add_argument("sandbox_id", metavar="ID")
    pa.add_argument("--mode", choices=["stop", "checkpoint"])
    pa.set_defaults(fn=cmd_pause)

    r = s.add_parser("resume", parents=[common, json_flag], help="resume a paused sandbox")
    r.add_argument("sandbox_id", metavar="ID")
    r.set_defaults(fn=cmd_resume)

    k = s.add_parser("keepalive", parents=[common, json_flag], help="expire TIMEOUT_S from now")
    k.add_argument("sandbox_id", metavar="ID")
    k.add_argument("timeout_s", type=int, metavar="TIMEOUT_S")
    k.set_defaults(fn=cmd_keepalive)

    pv = s.add_parser("preview", parents=[common, json_flag], help="the preview URL of a port")
    pv.add_argument("sandbox_id", metavar="ID")
    pv.add_argument("port", type=int)
    pv.add_argument("--public", action="store_true", help="no token in the URL: anyone may reach it")
    pv.set_defaults(fn=cmd_preview)

    rm = s.add_parser("rm", aliases=["delete"], parents=[common], help="delete sandboxes")
    rm.add_argument("sandbox_ids", nargs="+", metavar="ID")
    rm.set_defaults(fn=cmd_rm)
