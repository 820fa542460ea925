"""The user's ``hangar`` command, run as users run it: the installed console script, in a
subprocess, against the real test stack, configured by the environment or by ``hangar login``
(in a config dir of the test's own)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# The console script the SDK's distribution installs (`make install` puts it in the venv).
HANGAR = Path(sys.executable).parent / "hangar"


@dataclass
class Cli:
    env: dict[str, str]

    def __call__(self, *argv: str, input: str | None = None, timeout: float = 120,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
        return subprocess.run([str(HANGAR), *argv], input=input, capture_output=True, text=True, timeout=timeout,
                              env={**self.env, **(env or {})})  # fmt: skip


@pytest.fixture
def cli_env(tmp_path) -> dict[str, str]:
    """An environment with no Hangar settings at all, and a config dir of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGAR_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    return env


@pytest.fixture
def cli(server, celery_worker, bridge, local_node, team_token, cli_env) -> Cli:
    """``hangar`` with HANGAR_URL and HANGAR_TOKEN set, as a user sets them."""
    assert HANGAR.exists(), f"{HANGAR} is missing: `make install` installs the SDK's console script"
    return Cli({**cli_env, "HANGAR_URL": server, "HANGAR_TOKEN": team_token})
