"""Shell completion: ``hangar completion bash|zsh|fish`` prints a script that asks ``hangar
__complete WORDS…`` for the candidates, which walks the command's own parser (subcommands,
options, their choices) and, for an argument naming a sandbox, harness or volume, asks the
server (briefly: completion never hangs a shell)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from .. import _api as api

SCRIPTS = {
    "bash": """# hangar completion for bash: eval "$(hangar completion bash)"
_hangar_complete() {
    local IFS=$'\\n'
    COMPREPLY=($(hangar __complete "${COMP_WORDS[@]:1:COMP_CWORD}" 2>/dev/null))
}
complete -o default -F _hangar_complete hangar
""",
    "zsh": """# hangar completion for zsh: eval "$(hangar completion zsh)"
autoload -U +X bashcompinit && bashcompinit
_hangar_complete() {
    local IFS=$'\\n'
    COMPREPLY=($(hangar __complete "${COMP_WORDS[@]:1:COMP_CWORD}" 2>/dev/null))
}
complete -o default -F _hangar_complete hangar
""",
    "fish": """# hangar completion for fish: hangar completion fish | source
complete -c hangar -f -a '(hangar __complete (commandline -opc)[2..-1] (commandline -ct) 2>/dev/null)'
""",
}

# A positional argument's name, and how to list what it may name.
DYNAMIC: dict[str, Callable[[Any], list[str]]] = {
    "sandbox_id": lambda t: [s["id"] for s in t.json(api.sandbox_list(status=None, limit=200, offset=0))],
    "harness": lambda t: [h["name"] for h in t.json(api.harness_list())],
    "volume": lambda t: [v["name"] for v in t.json(api.volume_list())],
}
DYNAMIC["sandbox_ids"] = DYNAMIC["sandbox_id"]
DYNAMIC["volumes"] = DYNAMIC["volume"]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _positionals(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a for a in parser._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)
    ]


def _remote(dest: str) -> list[str]:
    from .._transport import Config, Transport

    try:
        t = Transport(Config.resolve())
        t.client.timeout = 2.0
        try:
            return DYNAMIC[dest](t)
        finally:
            t.close()
    except Exception:  # no server, no login: no candidates
        return []


def candidates(parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
    """What may come next, given the words typed after ``hangar`` (the last one partial)."""
    *done, prefix = words or [""]
    p = parser
    pending: argparse.Action | None = None  # an option waiting for its value
    position = 0
    for word in done:
        if pending is not None:
            pending = None
            continue
        if word.startswith("-"):
            action = p._option_string_actions.get(word.split("=", 1)[0])
            if action is not None and action.nargs != 0 and "=" not in word:
                pending = action
            continue
        subs = _subcommands(p)
        if word in subs:
            p, position = subs[word], 0
        else:
            position += 1
    if pending is not None:
        return sorted(str(c) for c in (pending.choices or ()) if str(c).startswith(prefix))
    if prefix.startswith("-"):
        options = [o for a in p._actions if a.help != argparse.SUPPRESS for o in a.option_strings]
        return sorted(o for o in options if o.startswith(prefix))
    subs = _subcommands(p)
    if subs:
        return sorted(name for name in subs if name.startswith(prefix) and not name.startswith("_"))
    positionals = _positionals(p)
    if positionals:
        action = positionals[min(position, len(positionals) - 1)]
        if action.choices:
            return sorted(str(c) for c in action.choices if str(c).startswith(prefix))
        if action.dest in DYNAMIC:
            return sorted(x for x in _remote(action.dest) if x.startswith(prefix))
    return []
