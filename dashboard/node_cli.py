"""``hangar node …``: run this machine as a node (bare ``hangar node``), join a control plane
with a join token, and the operator's commands on nodes (cordon, uncordon, drain, remove) and
join tokens. See docs/fleet.md."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def _django() -> None:
    from dashboard.cli import admin_setup

    admin_setup()


def _said(node: Any) -> str:
    return f"node {node.name}: {node.state}"


def cmd_cordon(args: argparse.Namespace) -> int:
    _django()
    from runtime.services import fleet

    print(_said(fleet.node_cordon(name=args.name)) + " (no new sandboxes are placed there)")
    return 0


def cmd_uncordon(args: argparse.Namespace) -> int:
    _django()
    from runtime.services import fleet

    print(_said(fleet.node_uncordon(name=args.name)))
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    _django()
    from runtime.services import fleet

    done = fleet.node_drain(name=args.name)
    print(f"node {done['node']}: {done['state']}; {len(done['replaced'])} warm-pool member(s) replaced elsewhere, "
          f"{len(done['kept'])} kept (no room elsewhere), {len(done['moving'])} paused sandbox(es) moving, "
          f"{done['remaining']} sandbox(es) left to end or move")  # fmt: skip
    for sandbox_id, to in done["moving"].items():
        print(f"  {sandbox_id} moving to {to}")
    for sandbox_id, why in done["staying"].items():
        print(f"  {sandbox_id} stays: {why}")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    _django()
    from runtime.services import fleet

    print(_said(fleet.node_remove(name=args.name)))
    return 0


def cmd_token_create(args: argparse.Namespace) -> int:
    _django()
    from runtime.services import fleet

    issued = fleet.join_token_create(user=None, expires_in_s=args.expires_in, uses=args.uses)
    t = issued.token
    until = f"until {t.expires_at:%Y-%m-%d %H:%M:%S} UTC" if t.expires_at else "until revoked"
    print(
        f"join token {t.id} ({t.uses} join{'s' if t.uses != 1 else ''}, {until}; shown once, stored hashed)."
    )
    print("On the new machine: hangar node join <this control plane's URL> --token <the token below>")
    print(issued.raw)
    return 0


def cmd_token_revoke(args: argparse.Namespace) -> int:
    _django()
    from runtime.services import fleet

    t = fleet.join_token_revoke(token_id=args.id)
    print(f"join token {t.id} ({t.prefix}…) revoked")
    return 0


def cmd_token_list(args: argparse.Namespace) -> int:
    _django()
    from runtime.services import fleet

    for t in fleet.join_tokens():
        state = "revoked" if t.revoked_at else f"{t.used}/{t.uses} used"
        expires = f"expires {t.expires_at:%Y-%m-%d %H:%M}" if t.expires_at else "no expiry"
        print(f"{t.id}\t{t.prefix}…\t{state}\t{expires}\t{','.join(t.nodes)}")
    return 0


def parse_labels(text: str) -> dict[str, str]:
    """``zone=a,gpu=h100`` → ``{"zone": "a", "gpu": "h100"}``."""
    labels: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"label {part!r} is not key=value")
        labels[key.strip()] = value.strip()
    return labels


def _default_name() -> str:
    return (os.environ.get("HANGAR_NODE_NAME") or socket.gethostname().split(".")[0] or "node").lower()


def join_request(
    url: str, token: str, name: str, labels: dict[str, str], timeout: float = 30
) -> dict[str, Any]:
    """POST the join to the control plane at ``url``; its answer, or SystemExit saying why not."""
    body = json.dumps({"token": token, "name": name, "labels": labels}).encode()
    request = urllib.request.Request(
        url.rstrip("/") + "/api/v1/nodes/join", data=body, method="POST",
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - the operator's URL
            answer: dict[str, Any] = json.load(response)
            return answer
    except urllib.error.HTTPError as exc:
        try:
            detail = json.load(exc).get("detail", "")
        except ValueError:
            detail = ""
        raise SystemExit(
            f"hangar: the control plane refused the join (HTTP {exc.code}): {detail or exc.reason}"
        ) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise SystemExit(f"hangar: could not reach the control plane at {url}: {exc}") from None


JOINED_FILE = "node-join.json"


def joined_settings_path() -> Path:
    """Where ``join`` keeps what the control plane handed it (this machine's data dir)."""
    return Path(os.environ.get("HANGAR_DATA_DIR") or "~/.local/share/hangar").expanduser() / JOINED_FILE


def keep_joined_settings(env: dict[str, str]) -> None:
    """The database (the node's own role), the broker and the node's name, readable by root
    only, so that a bare ``hangar node`` runs this machine as the joined node again."""
    path = joined_settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(env, f)
    os.replace(tmp, path)


def load_joined_settings() -> None:
    """For a bare ``hangar node``: what the last join handed this machine, under whatever the
    environment sets itself (a ``DATABASE_URL`` there wins over the kept one)."""
    path = joined_settings_path()
    if "DATABASE_URL" in os.environ or not path.exists():
        return
    for key, value in json.loads(path.read_text()).items():
        os.environ.setdefault(key, value)


def run_node(args: argparse.Namespace, env: dict[str, str]) -> int:
    """Run this machine as the node the join made, in the foreground (what a bare ``hangar
    node`` does), with the control plane's settings."""
    os.environ.update(env)
    from dashboard.cli import cmd_node

    return cmd_node(args)


def cmd_join(args: argparse.Namespace) -> int:
    try:
        labels = parse_labels(args.labels)
    except ValueError as exc:
        print(f"hangar: --labels: {exc}", file=sys.stderr)
        return 2
    name = args.name or _default_name()
    answer = join_request(args.url, args.token, name, labels)
    env = {
        "DATABASE_URL": answer["database_url"],
        "REDIS_URL": answer["redis_url"],
        "CELERY_BROKER_URL": answer["celery_broker_url"],
        "CELERY_RESULT_BACKEND": answer["celery_result_backend"],
        "HANGAR_NODE_NAME": answer["name"],
    }
    print(f"hangar: joined {args.url} as node {answer['name']}"
          + (f" (labels {','.join(f'{k}={v}' for k, v in answer['labels'].items())})" if answer["labels"] else ""),
          flush=True)  # fmt: skip
    keep_joined_settings(env)
    args.joined = True  # builds the default image (busybox) if this machine holds none
    return run_node(args, env)


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--migrate", action="store_true", help="apply database migrations first")
    p.add_argument("--log-level", default=os.environ.get("HANGAR_LOG_LEVEL", "WARNING"))


def add_node_commands(sub: argparse._SubParsersAction, run: Any) -> None:
    """``hangar node`` (``run``: a bare one runs this machine as a registered node) and its
    subcommands."""
    node = sub.add_parser(
        "node",
        help="run this machine as a node (same DB and Redis), join one, or manage nodes (docs/fleet.md)",
    )
    _run_options(node)
    node.set_defaults(fn=run)
    nsub = node.add_subparsers(dest="node_cmd")
    for verb, fn, what in (
        ("cordon", cmd_cordon, "stop placing new sandboxes on a node"),
        ("uncordon", cmd_uncordon, "let a cordoned or draining node take sandboxes again"),
        ("drain", cmd_drain, "cordon a node and move off it what can move"),
        ("remove", cmd_remove, "take a node out for good (refused while it holds sandboxes)"),
    ):
        p = nsub.add_parser(verb, help=what)
        p.add_argument("name")
        p.set_defaults(fn=fn)
    join = nsub.add_parser("join", help="join a control plane with a join token, then run as its node")
    join.add_argument("url", help="the control plane's URL, e.g. https://hangar.example.com")
    join.add_argument("--token", required=True, help="a join token (hangar node token create)")
    join.add_argument("--name", help="this node's name (default: HANGAR_NODE_NAME, else the host name)")
    join.add_argument("--labels", default="", help="k=v,… matched by sandboxes' node_selector")
    _run_options(join)
    join.set_defaults(fn=cmd_join)
    token = nsub.add_parser("token", help="join tokens")
    tsub = token.add_subparsers(dest="node_token_cmd", required=True)
    tc = tsub.add_parser("create", help="print a new join token (alone on the last line)")
    tc.add_argument("--expires-in", type=int, metavar="SECONDS", help="stop working this long from now")
    tc.add_argument(
        "--uses", type=int, default=1, metavar="N", help="how many nodes may join with it (default 1)"
    )
    tc.set_defaults(fn=cmd_token_create)
    tr = tsub.add_parser("revoke", help="revoke a join token")
    tr.add_argument("id", type=int)
    tr.set_defaults(fn=cmd_token_revoke)
    tsub.add_parser("list", help="list join tokens").set_defaults(fn=cmd_token_list)
