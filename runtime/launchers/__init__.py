"""Node-level isolation runtimes, found by name.

A runtime is a class implementing :class:`runtime.launchers.base.Launcher`, registered under
the ``hangar.launchers`` entry point group, so a new kind is a package, not an edit here.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import entry_points
from typing import Any

from .base import Launcher, LauncherError

# Built-in runtimes, so a checkout that was never pip-installed still finds them.
_BUILTIN = {"gvisor": "runtime.launchers.gvisor:GVisorLauncher"}


def launcher_names() -> list[str]:
    names = set(_BUILTIN)
    names.update(ep.name for ep in entry_points(group="hangar.launchers"))
    return sorted(names)


def launcher_class(name: str) -> type[Launcher]:
    for ep in entry_points(group="hangar.launchers"):
        if ep.name == name:
            return ep.load()  # type: ignore[no-any-return]
    target = _BUILTIN.get(name)
    if target is None:
        raise LauncherError(f"unknown runtime {name!r}; available: {', '.join(launcher_names())}")
    module_name, _, attr = target.partition(":")
    module = __import__(module_name, fromlist=[attr])
    return getattr(module, attr)  # type: ignore[no-any-return]


@cache
def _cached(name: str, frozen_config: tuple[tuple[str, Any], ...]) -> Launcher:
    return launcher_class(name)(**dict(frozen_config))


def get_launcher(name: str, **config: Any) -> Launcher:
    """One launcher instance per (name, config) per process."""
    return _cached(name, tuple(sorted(config.items())))
