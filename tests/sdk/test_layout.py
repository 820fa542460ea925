"""The SDK stands alone: it imports only the standard library, httpx and itself (never Django,
nor the server's packages; websockets, its other dependency, only where a terminal opens), and each of its modules
stays small enough to hold in one's head."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "sdk" / "hangar_sdk"
MAX_MODULE_LINES = 800


def test_the_sdk_imports_only_the_standard_library_httpx_and_itself():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "websockets" and path.name == "terminal.py":
                    continue  # imported when a terminal opens, not with the package
                if top in ("mcp", "anyio") and path.name == "mcp.py" and path.parent.name == "cli":
                    continue  # the [mcp] extra's: imported by `hangar mcp` alone, not with the package
                if top not in sys.stdlib_module_names and top not in ("httpx", "hangar_sdk", "__future__"):
                    found.append(f"{path.name} imports {name}")
    assert not found, found


def test_no_module_of_the_sdk_is_over_the_size_budget():
    sizes = {p.name: len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert all(n <= MAX_MODULE_LINES for n in sizes.values()), sizes
