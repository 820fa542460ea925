"""The layers hold, read off the source with ``ast`` (every import counts: at the top, inside
functions, under ``TYPE_CHECKING``): launchers know nothing of Django or the layers above; no
package's ``__init__`` imports its own submodules; runtime/ has no import cycle, its services
import at the top and never another module's private name; no module is over the size budget
(800 lines); the dashboard never speaks the stream protocol, and only launchers look inside a
handle."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / package.replace(".", "/")).rglob("*.py")):
        if "migrations" in path.parts:
            continue
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path) -> Iterator[tuple[str, list[str], bool]]:
    """(imported module, names, inside a function) for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    base = module.split(".") if is_package else module.split(".")[:-1]

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[str, list[str], bool]]:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, [], in_function
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    anchor = base[: len(base) - (child.level - 1)] if child.level > 1 else base
                    target = ".".join(anchor + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                yield target, [a.name for a in child.names], in_function
            yield from visit(child, inner)

    yield from visit(tree, False)


def test_launchers_import_nothing_of_django_or_the_layers_above():
    forbidden = ("django", "channels", "celery", "runtime.models", "runtime.services", "dashboard",
                 "runtime.tasks", "runtime.node")  # fmt: skip
    found = []
    for mod, path in _modules("runtime.launchers").items():
        for target, _, _ in _imports(mod, path):
            if any(target == f or target.startswith(f + ".") for f in forbidden):
                found.append(f"{mod} imports {target}")
    assert not found, "\n".join(found)


def test_a_launcher_or_node_package_init_imports_none_of_its_own_submodules():
    found = []
    for mod, path in {**_modules("runtime.launchers"), **_modules("runtime.node")}.items():
        if path.name != "__init__.py":
            continue
        for target, names, _ in _imports(mod, path):
            subs = [n for n in names if (path.parent / f"{n}.py").exists() or (path.parent / n).is_dir()]
            if target.startswith(mod + ".") or (target == mod and subs):
                found.append(f"{mod} imports {target} {subs or ''}")
    assert not found, "\n".join(found)


def _string_literals(path: Path) -> Iterator[tuple[int, str]]:
    """(line, value) of every string constant in the file but docstrings."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_only_the_gvisor_launcher_and_the_settings_name_gvisor():
    """The default runtime is a setting: no literal of it in models, forms, services, the node,
    the API or the pages; only its own package (and the settings that configure it) name it.
    (Prose about gVisor in comments and docstrings is not a name in the code.)"""
    allowed = (ROOT / "runtime" / "launchers" / "gvisor", ROOT / "dashboard" / "settings.py",
               ROOT / "runtime" / "migrations")  # fmt: skip
    word = re.compile(r"\bgvisor\b")
    found = []
    for path in sorted([*(ROOT / "runtime").rglob("*.py"), *(ROOT / "dashboard").rglob("*.py")]):
        if any(path.is_relative_to(a) for a in allowed):
            continue
        found += [f"{path.relative_to(ROOT)}:{n}: {v!r}" for n, v in _string_literals(path) if word.search(v)]
    for path in sorted((ROOT / "templates").rglob("*.html")):
        text = path.read_text()
        found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in word.finditer(text)]
    assert not found, "\n".join(found)


def _graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (``from . import x`` names module x)."""
    mods = _modules(package)
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        edges = set()
        for target, names, _ in _imports(mod, path):
            subs = {f"{target}.{n}" for n in names if f"{target}.{n}" in mods}
            edges |= subs or ({target} if target in mods else set())
        graph[mod] = edges - {mod}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle in ``graph`` (its modules, the first repeated at the end), if any."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        path.append(mod)
        for nxt in sorted(graph.get(mod, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[mod] = 2
        return None

    for mod in sorted(graph):
        if mod not in state and (found := visit(mod)):
            return found
    return None


def test_runtime_has_no_import_cycle():
    """Lower layers announce (runtime/events.py), features listen: no module of runtime/ imports
    one that imports it back, even inside a function or under TYPE_CHECKING."""
    cycle = _cycle(_graph("runtime"))
    assert cycle is None, "import cycle in runtime/: " + " -> ".join(cycle or [])


def test_no_package_init_in_runtime_imports_its_own_submodules():
    found = []
    for mod, path in _modules("runtime").items():
        if path.name != "__init__.py":
            continue
        for target, names, _ in _imports(mod, path):
            subs = [n for n in names if (path.parent / f"{n}.py").exists() or (path.parent / n).is_dir()]
            if target.startswith(mod + ".") or (target == mod and subs):
                found.append(f"{mod} imports {target} {subs or ''}")
    assert not found, "\n".join(found)


MAX_FUNCTION_IMPORTS_IN_SERVICES = 20


def test_services_import_at_the_top_of_their_modules():
    """An import inside a function hides a dependency (and, before the events, held a cycle
    together): runtime/services/ keeps at most a few, for costly optional modules."""
    found = [f"{mod}: {target}" for mod, path in _modules("runtime.services").items()
             for target, _, inside in _imports(mod, path) if inside]  # fmt: skip
    assert len(found) <= MAX_FUNCTION_IMPORTS_IN_SERVICES, (
        f"{len(found)} imports inside functions in runtime/services/ (at most "
        f"{MAX_FUNCTION_IMPORTS_IN_SERVICES}):\n" + "\n".join(found)
    )


def test_no_module_imports_another_modules_private_name():
    """A helper shared between services (or between runtime's packages) is public where it
    lives; a ``_name`` stays its own module's. The same holds in dashboard/."""
    mods = {**_modules("runtime"), **_modules("dashboard")}
    found = []
    for mod, path in mods.items():
        for target, names, _ in _imports(mod, path):
            if not target.startswith(("runtime", "dashboard")) or target == mod:
                continue
            private = [
                n
                for n in names
                if n.startswith("_") and not n.startswith("__") and f"{target}.{n}" not in mods
            ]
            found += [f"{mod} imports {target}.{n}" for n in private]
    assert not found, "\n".join(found)


MAX_MODULE_LINES = 800


def test_no_module_of_runtime_or_dashboard_is_over_the_size_budget():
    found = []
    for package in ("runtime", "dashboard"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            lines = len(path.read_text().splitlines())
            if lines > MAX_MODULE_LINES:
                found.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not found, f"modules over {MAX_MODULE_LINES} lines (split them along their seams):\n" + "\n".join(
        found
    )


def test_the_dashboard_speaks_process_handles_not_the_stream_protocol():
    """Pages, the API, websockets and SSH reach a live process through
    ``runtime.services.processes.ProcessHandle``; stream keys and raw frames stay in runtime."""
    found = []
    for mod, path in _modules("dashboard").items():
        for target, names, _ in _imports(mod, path):
            if target == "runtime.streams" or (target == "runtime" and "streams" in names):
                found.append(f"{mod} imports {target} {names}")
    assert not found, "\n".join(found)


def test_only_launchers_look_inside_a_handle_or_open_an_agent_client():
    """Previews and tunnels go through the launcher's ``open_tunnel``; every other call on a
    sandbox through ``sandbox_access``: a handle is the launcher's own business."""
    found = []
    launchers = ROOT / "runtime" / "launchers"
    for path in sorted([*(ROOT / "runtime").rglob("*.py"), *(ROOT / "dashboard").rglob("*.py")]):
        if path.is_relative_to(launchers):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(a.name == "AgentClient" for a in node.names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports AgentClient")
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.slice, ast.Constant)
                and node.slice.value == "socket"
            ):
                found.append(f'{path.relative_to(ROOT)}:{node.lineno} reads ["socket"]')
    assert not found, "\n".join(found)
