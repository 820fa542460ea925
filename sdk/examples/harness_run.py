"""Give a coding agent a task in a harness and print what it changed.

    HANGAR_URL=http://127.0.0.1:8000 HANGAR_TOKEN=hgr_… python harness_run.py \
        --repo https://github.com/you/project.git --agent claude-code "fix the failing test"

With ``--agent custom --command '…'`` any command plays the agent (it gets the prompt in
``$HANGAR_PROMPT`` and on stdin). The harness is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import sys

from hangar_sdk import Harness


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt")
    p.add_argument("--name", default="sdk-example")
    p.add_argument("--agent", default="claude-code")
    p.add_argument("--command", help="the custom agent's command")
    p.add_argument("--repo", help="a git URL to clone into /workspace")
    p.add_argument("--image", default="base")
    p.add_argument("--disk-mb", type=int, help="the workspace volume's size")
    p.add_argument("--network", help='an egress policy as JSON, e.g. \'{"egress": "all"}\'')
    p.add_argument("--keep", action="store_true", help="keep the harness afterwards")
    args = p.parse_args()

    extra: dict[str, object] = {"image": args.image, "memory_mb": 512}
    if args.command:
        extra["command"] = args.command
    if args.disk_mb:
        extra["disk_mb"] = args.disk_mb
    if args.network:
        extra["network"] = json.loads(args.network)
    h = Harness.create(
        name=args.name, agent=args.agent, repo={"url": args.repo} if args.repo else None, **extra
    )
    try:
        run = h.run(args.prompt)
        run.wait(on_stdout=lambda s: print(s, end=""), on_stderr=lambda s: print(s, end="", file=sys.stderr))
        print(f"\nrun {run.id}: {run.status} (exit code {run.exit_code})")
        print(run.diff or "(no diff)")
        return 0 if run.status == "succeeded" else 1
    finally:
        if not args.keep:
            h.delete(delete_volume=True)


if __name__ == "__main__":
    raise SystemExit(main())
