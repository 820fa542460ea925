"""``hangar harness …`` (create, list, get, shell, run, runs, logs, pause, resume, rm),
``hangar run …`` (get, logs, cancel, diff) and ``hangar volume …`` (create, list, get, rm)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .. import _api as api
from .._errors import HangarError
from ..sandbox import Sandbox
from ._common import ago, call, connect, emit_json, fail, human_bytes, pairs, pump, say, table
from .shell import interactive

POLL_S = 1.0
# A run's final states, and how `hangar harness run` exits for each that is not a success.
RUN_EXIT = {"succeeded": 0, "failed": 1, "timed_out": 124, "cancelled": 130}


def _h_row(h: dict[str, Any]) -> list[Any]:
    repo = (h.get("repo") or {}).get("url", "")
    return [h["name"], h["status"], h.get("setup"), h.get("agent"), repo, ago(h.get("last_activity_at"))]


def _wait_ready(args: argparse.Namespace, name: str, timeout: float) -> dict[str, Any]:
    """Poll until the harness has settled with its setup done, streaming its setup log."""
    deadline = time.monotonic() + timeout
    after = 0
    while True:
        for entry in call(args, api.harness_logs(name, after=after)):
            after = max(after, int(entry["id"]))
            if not args.json:
                say(f"  {entry['text'].rstrip()}")
        h = call(args, api.harness_get(name))
        if h["status"] in api.HARNESS_SETTLED and h.get("setup") in ("done", "failed"):
            return dict(h)
        if h["status"] in ("failed", "stopped", "deleted"):
            return dict(h)
        if time.monotonic() > deadline:
            fail(
                f"harness {name} is not ready after {timeout:.0f} s (status {h['status']}, setup {h.get('setup')})"
            )
        time.sleep(POLL_S)


def cmd_h_create(args: argparse.Namespace) -> int:
    repo = None
    if args.repo:
        repo = {"url": args.repo, "branch": args.branch or "", "secret": args.repo_secret or ""}
    extra: dict[str, Any] = {
        "command": args.command, "image": args.image, "runtime": args.runtime, "cpu": args.cpu,
        "memory_mb": args.memory_mb,
        "disk_mb": args.disk_mb, "secrets": args.secret or None, "env": pairs(args.env, "--env") or None,
        "idle_timeout_s": args.idle_timeout_s, "volume": args.volume,
        "network": {"egress": args.network} if args.network else None,
    }  # fmt: skip
    request = api.harness_create(name=args.name, agent=args.agent, repo=repo,
                                 extra={k: v for k, v in extra.items() if v is not None})  # fmt: skip
    data = call(args, request)
    if args.wait:
        if not args.json:
            say(f"setting up harness {args.name}…")
        data = _wait_ready(args, data["id"], args.wait_timeout)
    if args.json:
        emit_json(data)
    else:
        print(data["name"])
        if data.get("ssh_command"):
            say(f"ssh: {data['ssh_command']}")
    if data.get("setup") == "failed" or data["status"] == "failed":
        fail(f"harness {data['name']}: setup failed: {data.get('setup_error') or data['status']}")
    return 0


def cmd_h_list(args: argparse.Namespace) -> int:
    rows = call(args, api.harness_list())
    if args.json:
        emit_json(rows)
    else:
        table([_h_row(h) for h in rows], ["NAME", "STATUS", "SETUP", "AGENT", "REPO", "ACTIVE"])
    return 0


def cmd_h_get(args: argparse.Namespace) -> int:
    h = call(args, api.harness_get(args.harness))
    if args.json:
        emit_json(h)
        return 0
    fields = [("name", h["name"]), ("id", h["id"]), ("status", h["status"]), ("setup", h.get("setup")),
              ("agent", f"{h.get('agent')} {h.get('agent_version') or ''}".strip()), ("image", h.get("image")),
              ("runtime", h.get("runtime")),
              ("repo", (h.get("repo") or {}).get("url")), ("sandbox", h.get("sandbox")),
              ("volume", h.get("volume_name")), ("ssh", h.get("ssh_command"))]  # fmt: skip
    if h.get("setup_error"):
        fields.append(("setup error", h["setup_error"]))
    width = max(len(k) for k, _ in fields)
    for key, value in fields:
        print(f"{key.ljust(width)}  {value if value not in (None, '') else '-'}")
    return 0


def cmd_h_shell(args: argparse.Namespace) -> int:
    h = call(args, api.harness_get(args.harness))
    if h["status"] == "paused":
        say(f"resuming {h['name']}…")
        h = call(args, api.harness_resume(h["id"]))
    if h["status"] != "running" or not h.get("sandbox"):
        fail(f"harness {h['name']} is {h['status']}; a shell needs it running")
    sandbox = Sandbox(api.parse_sandbox(call(args, api.sandbox_get(h["sandbox"]))), connect(args))
    return interactive(sandbox, cmd=args.command or None, cwd="/workspace", env=pairs(args.env, "--env"))


def _follow_run(args: argparse.Namespace, run_id: str) -> dict[str, Any]:
    """Stream the run's output until it ends; its final record."""
    end = pump(connect(args).lines(api.run_logs(run_id)), all_to_stderr=bool(getattr(args, "json", False)))
    run = dict(end) if end is not None and end.get("_run") else call(args, api.run_get(run_id))
    run.pop("_run", None)
    run.pop("type", None)
    while run["status"] in api.RUN_ACTIVE:
        time.sleep(POLL_S)
        run = call(args, api.run_get(run_id))
    return run


def _run_exit(run: dict[str, Any]) -> int:
    status = run["status"]
    if status == "failed" and isinstance(run.get("exit_code"), int) and run["exit_code"] > 0:
        return int(run["exit_code"]) & 0xFF
    return RUN_EXIT.get(status, 1)


def cmd_h_run(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    run = call(args, api.run_create(args.harness, prompt=prompt, timeout_s=args.timeout_s))
    if args.detach:
        emit_json(run) if args.json else print(run["id"])
        return 0
    if not args.json:
        say(f"run {run['id']} ({run['status']})")
    run = _follow_run(args, run["id"])
    if args.json:
        emit_json(run)
    else:
        say(f"run {run['id']} {run['status']}" + (f": {run['error']}" if run.get("error") else ""))
    return _run_exit(run)


def _run_rows(rows: list[dict[str, Any]]) -> list[list[Any]]:
    return [[r["id"], r["status"], r.get("exit_code"), f"{(r.get('duration_ms') or 0) / 1000:.1f}s",
             ago(r.get("created_at")), r["prompt"].splitlines()[0][:50] if r.get("prompt") else ""]
            for r in rows]  # fmt: skip


def cmd_h_runs(args: argparse.Namespace) -> int:
    rows = call(args, api.harness_runs(args.harness))
    if args.json:
        emit_json(rows)
    else:
        table(_run_rows(rows), ["ID", "STATUS", "EXIT", "DURATION", "CREATED", "PROMPT"])
    return 0


def cmd_h_logs(args: argparse.Namespace) -> int:
    after = 0
    while True:
        entries = call(args, api.harness_logs(args.harness, after=after))
        for entry in entries:
            after = max(after, int(entry["id"]))
            sys.stdout.write(entry["text"] if entry["text"].endswith("\n") else entry["text"] + "\n")
        sys.stdout.flush()
        if not args.follow:
            return 0
        if not entries:
            time.sleep(POLL_S)


def _h_state(args: argparse.Namespace, request: api.Call) -> int:
    h = call(args, request)
    emit_json(h) if args.json else say(f"{h['name']}: {h['status']}")
    return 0


def cmd_h_pause(args: argparse.Namespace) -> int:
    return _h_state(args, api.harness_pause(args.harness))


def cmd_h_resume(args: argparse.Namespace) -> int:
    return _h_state(args, api.harness_resume(args.harness))


def cmd_h_rm(args: argparse.Namespace) -> int:
    call(args, api.harness_delete(args.harness, delete_volume=args.delete_volume))
    kept = "" if args.delete_volume else " (its workspace volume is kept: --delete-volume to remove it too)"
    say(f"{args.harness}: deleted{kept}")
    return 0


# -- runs ---------------------------------------------------------------------------------------


def cmd_run_get(args: argparse.Namespace) -> int:
    run = call(args, api.run_get(args.run_id))
    if args.json:
        emit_json(run)
        return 0
    fields = [("id", run["id"]), ("harness", run.get("harness_name")), ("status", run["status"]),
              ("exit code", run.get("exit_code")), ("duration", f"{(run.get('duration_ms') or 0) / 1000:.1f}s"),
              ("created", ago(run.get("created_at"))), ("trace", run.get("trace_id")),
              ("error", run.get("error")), ("prompt", run.get("prompt"))]  # fmt: skip
    width = max(len(k) for k, _ in fields)
    for key, value in fields:
        print(f"{key.ljust(width)}  {value if value not in (None, '') else '-'}")
    if run.get("diff"):
        print(f"{'diff'.ljust(width)}  {len(run['diff'].splitlines())} lines (hangar run diff {run['id']})")
    return 0


def cmd_run_logs(args: argparse.Namespace) -> int:
    end = pump(connect(args).lines(api.run_logs(args.run_id, follow=args.follow)))
    if end is not None and end.get("_run") and end["status"] not in api.RUN_ACTIVE:
        return _run_exit(end)
    return 0


def cmd_run_cancel(args: argparse.Namespace) -> int:
    run = call(args, api.run_cancel(args.run_id))
    emit_json(run) if args.json else say(f"{run['id']}: {run['status']}")
    return 0


def cmd_run_diff(args: argparse.Namespace) -> int:
    run = call(args, api.run_get(args.run_id))
    if run["status"] in api.RUN_ACTIVE:
        fail(f"run {run['id']} is still {run['status']}: its diff is made when it ends")
    sys.stdout.write(run.get("diff") or "")
    sys.stdout.flush()
    if run.get("diff_truncated"):
        say("hangar: the diff was cut at the server's limit; the whole change is in the harness's /workspace")
    return 0


# -- volumes ------------------------------------------------------------------------------------


def cmd_v_create(args: argparse.Namespace) -> int:
    v = call(args, api.volume_create(name=args.name, size_mb=args.size_mb, node=args.node))
    emit_json(v) if args.json else print(v["name"])
    return 0


def cmd_v_list(args: argparse.Namespace) -> int:
    rows = call(args, api.volume_list())
    if args.json:
        emit_json(rows)
    else:
        table([[v["name"], v["id"], v["size_mb"], v.get("node"), ",".join(v.get("attached_to") or []),
                ago(v.get("created_at"))] for v in rows],
              ["NAME", "ID", "SIZE_MB", "NODE", "ATTACHED_TO", "CREATED"])  # fmt: skip
    return 0


def cmd_v_get(args: argparse.Namespace) -> int:
    v = call(args, api.volume_get(args.volume))
    if args.json:
        emit_json(v)
        return 0
    used = v.get("used_bytes")
    for key, value in (("name", v["name"]), ("id", v["id"]), ("size", f"{v['size_mb']} MB"),
                       ("used", human_bytes(used) if used is not None else "-"), ("node", v.get("node")),
                       ("attached to", ", ".join(v.get("attached_to") or []) or "-")):  # fmt: skip
        print(f"{key.ljust(11)}  {value}")
    return 0


def cmd_v_rm(args: argparse.Namespace) -> int:
    failed = 0
    for name in args.volumes:
        try:
            call(args, api.volume_delete(name))
        except HangarError as exc:
            say(f"hangar: {name}: {exc.message}")
            failed += 1
        else:
            say(f"{name}: deleted")
    return 1 if failed else 0


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    json_flag = argparse.ArgumentParser(add_help=False)
    json_flag.add_argument(
        "--json", action="store_true", help="print the API's JSON (one document) and nothing else"
    )
    both = [common, json_flag]

    p = sub.add_parser("harness", help="harnesses: workspaces for coding agents")
    s = p.add_subparsers(dest="harness_cmd", required=True, metavar="COMMAND")
    c = s.add_parser("create", parents=both, help="create a harness and wait for its setup")
    c.add_argument("name", help="1-63 of a-z 0-9 -: also its SSH user name")
    c.add_argument(
        "--agent", required=True, help="claude-code, codex, opencode, pi, or custom (with --command)"
    )
    c.add_argument("--command", help="the custom agent's command")
    c.add_argument("--repo", metavar="URL", help="a git repository cloned into /workspace")
    c.add_argument("--branch")
    c.add_argument("--repo-secret", metavar="SECRET", help="a team secret with the repository's token or key")
    c.add_argument("--image")
    c.add_argument("--runtime", help="gvisor or microvm (default: the server's)")
    c.add_argument("--cpu", type=float)
    c.add_argument("--memory-mb", type=int)
    c.add_argument("--disk-mb", type=int, help="the workspace volume's size")
    c.add_argument("--env", action="append", metavar="K=V")
    c.add_argument("--secret", action="append", metavar="NAME", help="a team secret as an env var (API keys)")
    c.add_argument("--network", choices=["none", "all"], help="egress (default all)")
    c.add_argument("--idle-timeout-s", type=int, help="pause after this long idle (0: never)")
    c.add_argument("--volume", help="work in this existing volume instead of a new one")
    c.add_argument("--no-wait", dest="wait", action="store_false", help="return at once (status creating)")
    c.add_argument("--wait-timeout", type=float, default=600.0, metavar="SECONDS")
    c.set_defaults(fn=cmd_h_create)

    ls = s.add_parser("list", aliases=["ls"], parents=both, help="the team's harnesses")
    ls.set_defaults(fn=cmd_h_list)
    g = s.add_parser("get", parents=both, help="one harness")
    g.add_argument("harness", metavar="NAME")
    g.set_defaults(fn=cmd_h_get)
    sh = s.add_parser("shell", parents=[common], help="an interactive terminal in its /workspace")
    sh.add_argument("harness", metavar="NAME")
    sh.add_argument("--env", action="append", metavar="K=V")
    sh.add_argument("command", nargs="*", help="after --: a command instead of a login shell")
    sh.set_defaults(fn=cmd_h_shell)
    r = s.add_parser("run", parents=both, help="give the agent a task; follows its output to the end")
    r.add_argument("harness", metavar="NAME")
    r.add_argument("prompt", help="the task (- reads it from stdin)")
    r.add_argument("--timeout-s", type=int)
    r.add_argument("-d", "--detach", action="store_true", help="print the run's id and return")
    r.set_defaults(fn=cmd_h_run)
    rs = s.add_parser("runs", parents=both, help="its runs, newest first")
    rs.add_argument("harness", metavar="NAME")
    rs.set_defaults(fn=cmd_h_runs)
    lg = s.add_parser("logs", parents=[common], help="its log: setup, runs starting and ending…")
    lg.add_argument("harness", metavar="NAME")
    lg.add_argument("-f", "--follow", action="store_true")
    lg.set_defaults(fn=cmd_h_logs)
    for name, fn, text in (("pause", cmd_h_pause, "pause it (its workspace stays)"),
                           ("resume", cmd_h_resume, "resume it")):  # fmt: skip
        x = s.add_parser(name, parents=both, help=text)
        x.add_argument("harness", metavar="NAME")
        x.set_defaults(fn=fn)
    rm = s.add_parser("rm", aliases=["delete"], parents=[common], help="delete it (its volume is kept)")
    rm.add_argument("harness", metavar="NAME")
    rm.add_argument("--delete-volume", action="store_true", help="delete its workspace volume too")
    rm.set_defaults(fn=cmd_h_rm)

    p = sub.add_parser("run", help="runs of harnesses' agents")
    s = p.add_subparsers(dest="run_cmd", required=True, metavar="COMMAND")
    g = s.add_parser("get", parents=both, help="a run: status, exit code, trace")
    g.add_argument("run_id", metavar="RUN")
    g.set_defaults(fn=cmd_run_get)
    lg = s.add_parser("logs", parents=[common], help="the agent's output (live while it runs)")
    lg.add_argument("run_id", metavar="RUN")
    lg.add_argument("--no-follow", dest="follow", action="store_false")
    lg.set_defaults(fn=cmd_run_logs)
    cn = s.add_parser("cancel", parents=both, help="cancel a queued or running run")
    cn.add_argument("run_id", metavar="RUN")
    cn.set_defaults(fn=cmd_run_cancel)
    d = s.add_parser("diff", parents=[common], help="what the run changed in /workspace (a git diff)")
    d.add_argument("run_id", metavar="RUN")
    d.set_defaults(fn=cmd_run_diff)

    p = sub.add_parser("volume", aliases=["vol"], help="volumes: storage that outlives sandboxes")
    s = p.add_subparsers(dest="volume_cmd", required=True, metavar="COMMAND")
    c = s.add_parser("create", parents=both, help="create a volume")
    c.add_argument("name")
    c.add_argument("--size-mb", type=int, required=True)
    c.add_argument("--node", help="the node it lives on (default: chosen)")
    c.set_defaults(fn=cmd_v_create)
    ls = s.add_parser("list", aliases=["ls"], parents=both, help="the team's volumes")
    ls.set_defaults(fn=cmd_v_list)
    g = s.add_parser("get", parents=both, help="one volume, with the space in use")
    g.add_argument("volume", metavar="NAME")
    g.set_defaults(fn=cmd_v_get)
    rm = s.add_parser(
        "rm", aliases=["delete"], parents=[common], help="delete volumes (none may be attached)"
    )
    rm.add_argument("volumes", nargs="+", metavar="NAME")
    rm.set_defaults(fn=cmd_v_rm)
