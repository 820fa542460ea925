"""The SDK is its own distribution: ``pip install ./sdk`` into a fresh virtual environment
that has no Django (nor anything else of the server) fetches httpx and websockets, lays down
``py.typed`` and the ``hangar`` console script, and the package imports there and talks to the
server. A broken ``sdk/pyproject.toml`` fails here: nothing is copied in by hand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import requires_runsc

pytestmark = [requires_runsc, pytest.mark.timeout(420)]
SDK = Path(__file__).resolve().parents[2] / "sdk"

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


def _install(venv: Path) -> Path:
    """``pip install ./sdk`` as the Makefile runs it (its dependencies from the index pip is
    configured with); the ``hangar`` console script it made."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    got = subprocess.run([*pip, str(SDK)], capture_output=True, text=True, timeout=180)
    assert got.returncode == 0, f"pip install ./sdk failed:\n{got.stdout[-2000:]}{got.stderr[-4000:]}"
    (site,) = (venv / "lib").glob("python3*/site-packages")
    assert (site / "hangar_sdk" / "py.typed").is_file(), "py.typed is missing"
    assert (site / "hangar_sdk" / "cli" / "shell.py").is_file()
    for dependency in ("httpx", "websockets"):
        assert (site / dependency / "__init__.py").is_file(), f"{dependency} was not installed with the SDK"
    hangar = venv / "bin" / "hangar"
    assert hangar.is_file() and os.access(hangar, os.X_OK), "the `hangar` console script is not installed"
    return hangar


def test_the_sdk_installs_and_works_in_a_venv_without_django(hangar, tmp_path, team_token):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=60)
    hangar_cmd = [str(_install(venv))]
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

    # `hangar mcp` is the SDK's too: without its extra it says what to install; with it (the MCP
    # SDK, still no Django) it runs, and says in words that a bad token is refused.
    mcp = subprocess.run([*hangar_cmd, "mcp"], capture_output=True, text=True, timeout=60, env=user_env)
    assert mcp.returncode == 2 and "pip install 'hangar-runtime-sdk[mcp]'" in mcp.stderr, mcp.stderr
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    got = subprocess.run([*pip, f"{SDK}[mcp]"], capture_output=True, text=True, timeout=180)
    assert got.returncode == 0, f"pip install ./sdk[mcp] failed:\n{got.stderr[-4000:]}"
    refused = subprocess.run([*hangar_cmd, "mcp", "--token", "hgr_not_a_token"], capture_output=True, text=True,
                             timeout=60, env=user_env, stdin=subprocess.DEVNULL)  # fmt: skip
    assert refused.returncode == 2 and "refused the token (401)" in refused.stderr, refused.stderr
    assert "django" not in subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list"], capture_output=True,
                                          text=True, timeout=60).stdout.lower()  # fmt: skip
