"""The SDK is its own distribution: it installs into a fresh virtual environment that has no
Django (nor anything else of the server), imports there, and talks to the server."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.support import requires_runsc

pytestmark = [requires_runsc, pytest.mark.timeout(120)]
SDK = Path(__file__).resolve().parents[2] / "sdk"
# httpx and what it needs, and websockets: the SDK's only dependencies.
HTTPX_DEPS = ("httpx", "httpcore", "h11", "anyio", "sniffio", "idna", "certifi", "websockets")

PROBE = """
import os, hangar_sdk
try:
    import django
except ImportError:
    print("no django")
else:
    raise SystemExit(f"django importable from {django.__file__}")
assert "site-packages" in hangar_sdk.__file__ and "/sdk/hangar_sdk" not in hangar_sdk.__file__, hangar_sdk.__file__
# Inside a harness: HANGAR_API_URL already ends in /api/v1.
print("sandboxes:", len(hangar_sdk.Sandbox.list()))
"""


def _install(venv: Path) -> list[str]:
    """Install the SDK; the ``hangar`` command as the install made it."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    got = subprocess.run([*pip, str(SDK)], capture_output=True, text=True, timeout=90)
    if got.returncode == 0:
        return [str(venv / "bin" / "hangar")]
    # No index to fetch httpx or a build backend from (an offline machine): the package copied
    # in as pip would lay it out, and httpx with what it needs linked one by one from this
    # interpreter's packages (never Django).
    site = next((venv / "lib").glob("python3*/site-packages"))
    shutil.copytree(SDK / "hangar_sdk", site / "hangar_sdk")
    here = Path(sysconfig.get_paths()["purelib"])
    shared = venv / "shared-httpx"
    shared.mkdir()
    for name in HTTPX_DEPS:
        (shared / name).symlink_to(here / name)
    (site / "shared-httpx.pth").write_text(f"{shared}\n")
    return [str(venv / "bin" / "python"), "-m", "hangar_sdk"]  # no console script without pip


def test_the_sdk_installs_and_works_in_a_venv_without_django(hangar, tmp_path, team_token):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=60)
    hangar_cmd = _install(venv)
    env = {"PATH": "/usr/bin:/bin", "HANGAR_API_URL": f"{hangar}/api/v1", "HANGAR_API_TOKEN": team_token,
           "XDG_CONFIG_HOME": str(tmp_path / "config")}  # fmt: skip
    out = subprocess.run([str(venv / "bin" / "python"), "-c", PROBE], capture_output=True, text=True,
                         timeout=60, env=env, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no django" in out.stdout and "sandboxes: 0" in out.stdout

    # The user's `hangar` command comes with the SDK alone: its commands, not the server's.
    user_env = {**env, "HANGAR_URL": hangar, "HANGAR_TOKEN": team_token}
    listed = subprocess.run([*hangar_cmd, "sandbox", "list", "--json"], capture_output=True, text=True,
                            timeout=60, env=user_env, cwd=tmp_path)  # fmt: skip
    assert (listed.returncode, listed.stdout.strip()) == (0, "[]"), listed.stderr
    helped = subprocess.run([*hangar_cmd, "--help"], capture_output=True, text=True, timeout=60, env=user_env)
    assert "sandbox" in helped.stdout and "harness" in helped.stdout and " up " not in helped.stdout
    server_only = subprocess.run(
        [*hangar_cmd, "up"], capture_output=True, text=True, timeout=60, env=user_env
    )
    assert server_only.returncode == 2 and "server command" in server_only.stderr
