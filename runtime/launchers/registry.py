"""Launchers found by name.

A launcher is a class implementing :class:`~runtime.launchers.base.Launcher`, registered under
the ``hangar.launchers`` entry point group (a package's ``pyproject.toml``), so a new runtime is
a package, not an edit here. :func:`register` adds one without packaging (a node's
``HANGAR_LAUNCHER_CLASSES``); the built-in ones are known even to a checkout that was never
pip-installed (its pyproject.toml says which they are).
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import threading
import tomllib
from collections.abc import Mapping
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from .base import Launcher, LauncherError

log = logging.getLogger(__name__)

# This checkout's own launchers are those its pyproject.toml declares: found by a checkout that
# was never pip-installed, and whatever an install made before a launcher moved says.
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
GROUP = "hangar.launchers"
_registered: dict[str, str] = {}  # name → "module:Class", registered in this process
NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}$")  # fits Sandbox.runtime, reads well in a URL or a log
TARGET_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def parse_classes(text: str) -> dict[str, str]:
    """``"name=module:Class,other=module:Class"`` → {name: target}; ValueError says what is wrong."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, target = (s.strip() for s in item.partition("="))
        if not sep or not NAME_RE.fullmatch(name) or not TARGET_RE.fullmatch(target):
            raise ValueError(f"{item!r} is not name=module:Class (a name of a-z, 0-9 and -)")
        out[name] = target
    return out


def register(name: str, target: str) -> None:
    """Make ``target`` (``"module:Class"``) the launcher called ``name`` in this process."""
    if not NAME_RE.fullmatch(name) or not TARGET_RE.fullmatch(target):
        raise LauncherError(f"cannot register {name}={target}: expected a name and module:Class")
    _registered[name] = target


def register_all(classes: Mapping[str, str]) -> None:
    for name, target in classes.items():
        register(name, target)


@cache
def _builtin() -> dict[str, str]:
    try:
        with open(PYPROJECT, "rb") as f:
            project = tomllib.load(f).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return {}  # an installed copy: its entry points are the registry
    return dict(project.get("entry-points", {}).get(GROUP, {}))


@cache
def _entry_points() -> dict[str, Any]:
    # Read once per process: scanning the installed packages costs milliseconds, and every
    # create asks for the names.
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def launcher_names() -> list[str]:
    """Every launcher this process can load, by name (whether or not this node runs it)."""
    return sorted({*_builtin(), *_entry_points(), *_registered})


def _load(target: str) -> type[Launcher]:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def launcher_class(name: str) -> type[Launcher]:
    if name in _registered:
        return _load(_registered[name])
    ep = _entry_points().get(name)
    if ep is not None:
        try:
            return ep.load()
        except (ImportError, AttributeError) as exc:
            if name not in _builtin():
                raise LauncherError(f"the {name} launcher ({ep.value}) cannot be loaded: {exc}") from exc
            log.warning("entry point %s = %s is stale (%s): using the built-in one; reinstall Hangar "
                        "(pip install -e .) to refresh it", name, ep.value, exc)  # fmt: skip
    target = _builtin().get(name)
    if target is None:
        raise LauncherError(f"unknown runtime {name!r}; available: {', '.join(launcher_names())}")
    return _load(target)


def new_launcher(name: str, **config: Any) -> Launcher:
    """A launcher instance of the class registered as ``name``, answering to that name (a class
    registered under a second name, with other settings, is a runtime of its own)."""
    launcher = launcher_class(name)(**config)
    launcher.name = name
    return launcher


_instances: dict[tuple[str, str], Launcher] = {}
_instances_lock = threading.Lock()


def get_launcher(name: str, **config: Any) -> Launcher:
    """One launcher instance per (name, config) per process."""
    key = (name, json.dumps(config, sort_keys=True, default=str))
    with _instances_lock:
        if key not in _instances:
            _instances[key] = new_launcher(name, **config)
        return _instances[key]
