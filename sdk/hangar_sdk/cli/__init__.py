"""The ``hangar`` command. This distribution owns it: sandboxes, harnesses, runs, volumes,
``login``, shell completion, on a laptop with only the SDK installed. A server install plugs
its own commands (``up``, ``node``, ``token``, ``user``, ``team``, ``image``, ``mcp``…) into
the same command through the ``hangar.cli`` entry-point group: each entry point is a
``register(subparsers) -> run`` function that adds its subcommands and returns the function
that runs them (with that side's own error handling)."""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from .. import _api as api
from .._config import config_path, forget, load_stored, store
from .._errors import AuthError, HangarError, NetworkError
from .._transport import Config, Transport, __version__, api_base
from . import harnesses, sandboxes
from ._common import CliError, connect, emit_json, fail, reset, say
from .completion import SCRIPTS, candidates

DEFAULT_URL = "http://127.0.0.1:8000"
# Commands only a server install has: asked for on a laptop, they get a hint, not "invalid choice".
SERVER_COMMANDS = ("up", "node", "bridge", "ssh-gateway", "token", "user", "team", "secrets", "image",
                   "manage")  # fmt: skip
Runner = Callable[[argparse.Namespace], int]


def cmd_mcp(args: argparse.Namespace) -> int:
    """An MCP client that starts its servers as commands runs this (docs/mcp.md)."""
    try:
        from .mcp import main as mcp_main
    except ImportError as exc:
        if exc.name not in ("mcp", "anyio") and not str(exc.name or "").startswith("mcp."):
            raise
        raise CliError(
            "`hangar mcp` needs the MCP SDK: pip install 'hangar-runtime-sdk[mcp]'", code=2
        ) from None
    return mcp_main(url=args.url, token=args.token)


def cmd_login(args: argparse.Namespace) -> int:
    stored = load_stored()
    url = args.url or os.environ.get("HANGAR_URL") or stored.get("url")
    interactive = sys.stdin.isatty()
    if not url:
        url = (input(f"Hangar URL [{DEFAULT_URL}]: ").strip() if interactive else "") or DEFAULT_URL
    if args.token_stdin:
        token = sys.stdin.readline().strip()
    else:
        token = args.token or os.environ.get("HANGAR_TOKEN") or ""
        if not token and interactive:
            token = getpass.getpass(
                "API token (hgr_…; make one on the Tokens page or with `hangar token create`): "
            )
    token = token.strip()
    if not token:
        fail("no token: pass --token, --token-stdin, set HANGAR_TOKEN, or run on a terminal to be asked", 2)
    t = Transport(Config(url=api_base(url), token=token))
    try:
        who = t.json(api.token_current())
    except AuthError as exc:
        fail(f"{url} refused this token: {exc.message}")
    except NetworkError as exc:
        fail(f"cannot reach {url}: {exc.message}")
    finally:
        t.close()
    path = store(url.rstrip("/"), token)
    say(f"logged in to {url} as {who['user']} in team {who['team']} (role {who['effective_role']}); "
        f"saved in {path}")  # fmt: skip
    return 0


def cmd_logout(args: argparse.Namespace) -> int:
    say(f"removed {config_path()}" if forget() else "not logged in")
    return 0


def cmd_whoami(args: argparse.Namespace) -> int:
    t = connect(args)
    who = t.json(api.token_current())
    if args.json:
        emit_json({**who, "url": t.config.url.removesuffix("/api/v1")})
        return 0
    print(
        f"{who['user']} in team {who['team']} (role {who['effective_role']}) at {t.config.url.removesuffix('/api/v1')}"
    )
    print(f"token {who['prefix']}… {who['name'] or ''}".rstrip()
          + (f", scopes {', '.join(who['scopes'])}" if who["scopes"] else ", all scopes")
          + (f", expires {who['expires_at']}" if who.get("expires_at") else ""))  # fmt: skip
    return 0


def cmd_completion(args: argparse.Namespace) -> int:
    sys.stdout.write(SCRIPTS[args.shell])
    return 0


def _common() -> argparse.ArgumentParser:
    """``--url`` and ``--token`` on every command (left out, the root's or the config's apply)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url", default=argparse.SUPPRESS, help="the server (default: HANGAR_URL or hangar login's)"
    )
    common.add_argument(
        "--token", default=argparse.SUPPRESS, help="an API token (default: HANGAR_TOKEN or login's)"
    )
    return common


def _plugins(sub: argparse._SubParsersAction) -> None:
    """Let other distributions (the server) add their commands."""
    for ep in entry_points(group="hangar.cli"):
        before = set(sub.choices)
        try:
            register = ep.load()
            runner: Runner | None = register(sub)
        except Exception as exc:  # a broken plug-in leaves the user's commands working
            say(f"hangar: warning: the commands of {ep.name} ({ep.value}) did not load: {exc}")
            continue
        if runner is not None:
            for name in set(sub.choices) - before:
                sub.choices[name].set_defaults(_runner=runner)


def build_parser(plugins: bool = True) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    common = _common()
    p = argparse.ArgumentParser(prog="hangar", description="Hangar: sandboxes and harnesses for AI agents.",
                                epilog="Configuration: HANGAR_URL and HANGAR_TOKEN, else `hangar login`.")  # fmt: skip
    p.add_argument("--url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--token", default=None, help=argparse.SUPPRESS)
    p.add_argument("--version", action="version", version=f"hangar {__version__} (hangar-runtime-sdk)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    sandboxes.add_parsers(sub, common)
    harnesses.add_parsers(sub, common)

    login = sub.add_parser("login", parents=[common], help="store the server's URL and a token (0600)")
    login.add_argument("--token-stdin", action="store_true", help="read the token from stdin")
    login.set_defaults(fn=cmd_login)
    sub.add_parser("logout", help="forget the stored token").set_defaults(fn=cmd_logout)
    who = sub.add_parser("whoami", parents=[common], help="the token's user, team, role and scopes")
    who.add_argument("--json", action="store_true")
    who.set_defaults(fn=cmd_whoami)
    mcp = sub.add_parser(
        "mcp", help="an MCP server on stdin/stdout for this Hangar (needs the SDK's mcp extra)"
    )
    mcp.add_argument(
        "--url", help="the Hangar's base URL (else HANGAR_URL, `hangar login`'s, HANGAR_API_URL)"
    )
    mcp.add_argument(
        "--token", help="a Hangar API token (else HANGAR_TOKEN, `hangar login`'s, HANGAR_API_TOKEN)"
    )
    mcp.set_defaults(fn=cmd_mcp)
    comp = sub.add_parser(
        "completion", help='print a shell completion script: eval "$(hangar completion bash)"'
    )
    comp.add_argument("shell", choices=sorted(SCRIPTS))
    comp.set_defaults(fn=cmd_completion)
    if plugins:
        _plugins(sub)
    return p, sub


def _run(args: argparse.Namespace) -> int:
    runner: Runner | None = getattr(args, "_runner", None)
    if runner is not None:
        return int(runner(args) or 0)
    return int(args.fn(args) or 0)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; for ``exec`` and ``shell`` everything after the first ``--`` is the
    command, taken as it is (a later ``--`` included, which argparse would drop)."""
    if "--" in argv and {"exec", "shell"} & set(argv[: argv.index("--")]):
        at = argv.index("--")
        args = parser.parse_args(argv[:at])
        if hasattr(args, "command"):
            args.command = [*args.command, *argv[at + 1 :]]
            return args
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, sub = build_parser()
    if argv[:1] == ["__complete"]:  # the completion scripts' question: what may come next
        for word in candidates(parser, argv[1:]):
            print(word)
        return 0
    first = next((a for a in argv if not a.startswith("-")), "")
    if first in SERVER_COMMANDS and first not in sub.choices:
        print(f"hangar: `hangar {first}` is a server command; this machine has only the SDK's commands "
              "(install Hangar's server to run one: its README, `make install`)", file=sys.stderr)  # fmt: skip
        return 2
    args = _parse(parser, argv)
    try:
        return _run(args)
    except CliError as exc:
        print(f"hangar: {exc.message}", file=sys.stderr)
        return exc.code
    except AuthError as exc:
        hint = " (run `hangar login`, or check HANGAR_TOKEN)" if exc.status_code == 401 else ""
        print(f"hangar: {exc.message}{hint}", file=sys.stderr)
        return 1
    except HangarError as exc:
        print(f"hangar: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `hangar … | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # a local file, a socket the SDK did not wrap
        print(f"hangar: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # unforeseen: still one line (HANGAR_TRACEBACK=1 prints the traceback)
        if os.environ.get("HANGAR_TRACEBACK") == "1":
            raise
        print(f"hangar: {type(exc).__name__}: {exc} (HANGAR_TRACEBACK=1 shows where)", file=sys.stderr)
        return 1
    finally:
        reset()


def run() -> Any:
    sys.exit(main())
