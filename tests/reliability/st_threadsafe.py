"""schemathesis's ``st`` command, with ``ast.parse`` serialised across threads.

On CPython 3.11 before 3.11.9 (3.11.7 here) ``ast.parse`` is not thread-safe (gh-106905: "AST
constructor recursion depth mismatch"), and hypothesis parses its filters' and lambdas' source
from each of schemathesis's worker threads: with ``-w 2`` the tool itself crashed now and then.
One lock around the parse (microseconds, a few hundred times a run) lets the issue's command
run exactly as written, two workers included. Run as ``python st_threadsafe.py run …``, with
``st``'s own arguments."""

from __future__ import annotations

import ast
import sys
import threading
from typing import Any

_LOCK = threading.RLock()
_PARSE = ast.parse


def _parse(*args: Any, **kwargs: Any) -> Any:
    with _LOCK:
        return _PARSE(*args, **kwargs)


ast.parse = _parse  # type: ignore[assignment]  # ast.literal_eval reads the module's own name too

if __name__ == "__main__":
    from schemathesis.cli import schemathesis

    sys.argv[0] = "st"
    sys.exit(schemathesis())
