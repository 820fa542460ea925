"""gVisor's side of a sandbox, looked at directly: its directory, runsc's record, its cgroups."""

from __future__ import annotations

import subprocess
from pathlib import Path

from runtime.launchers.gvisor.launcher import GVisorLauncher
from tests.launchers import helpers


def assert_nothing_left(launcher: GVisorLauncher, sandbox_id: str) -> None:
    helpers.assert_nothing_left(launcher, sandbox_id)
    assert not cgroup_dirs(launcher, sandbox_id)
    assert not (launcher.sandboxes_dir / sandbox_id).exists()
    assert not runsc_lists(launcher, sandbox_id)


def upper_dir(launcher: GVisorLauncher, sandbox_id: str) -> Path:
    """Where the host keeps the files the sandbox wrote (its overlay's upper dir)."""
    d = launcher.sandboxes_dir / sandbox_id
    return d / "disk" / "fs" / "upper" if (d / "disk").exists() else d / "upper"


def runsc_lists(launcher: GVisorLauncher, sandbox_id: str) -> bool:
    listed = subprocess.run(
        [launcher.runsc.binary, "--root", str(launcher.runsc.root), "list", "--quiet"],
        capture_output=True,
        text=True,
    ).stdout
    return sandbox_id in listed.split()


def cgroup_dirs(launcher: GVisorLauncher, sandbox_id: str) -> list[Path]:
    parent = launcher.names.cgroup_parent
    return [root / parent / sandbox_id for root in Path("/sys/fs/cgroup").iterdir()
            if (root / parent / sandbox_id).exists()]  # fmt: skip
