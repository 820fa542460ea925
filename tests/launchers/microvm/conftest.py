"""What the microVM launcher's own test modules share: a launcher of the module's own (its
state dir, so its node id, names and address pool, are its alone) and the busybox image."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from runtime.launchers.microvm.launcher import MicroVMLauncher
from tests.launchers.helpers import make_launcher, remove_all


@pytest.fixture(scope="module")
def launcher(request, tmp_path_factory, agent_cache_dir) -> Iterator[MicroVMLauncher]:
    name = request.module.__name__.rsplit(".", 1)[-1]
    launcher = make_launcher("microvm", tmp_path_factory.mktemp(f"microvm-{name}"), agent_cache_dir)
    assert isinstance(launcher, MicroVMLauncher)
    yield launcher
    remove_all(launcher)


@pytest.fixture(scope="module")
def busybox(image_store):
    return image_store.build_busybox()
