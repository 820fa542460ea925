"""A server install has one ``hangar`` command: the SDK's distribution owns the console script,
and the server's distribution plugs its commands in through the ``hangar.cli`` entry-point
group, so ``hangar --help`` lists both sets and each runs."""

from __future__ import annotations

import re
import subprocess
from importlib.metadata import distribution, entry_points

from tests.cli.conftest import HANGAR

USER_COMMANDS = {"sandbox", "harness", "run", "volume", "login", "whoami", "completion", "mcp"}
SERVER_COMMANDS = {"up", "node", "token", "user", "team", "image"}


def _commands(help_text: str) -> set[str]:
    """The command names in ``hangar --help``'s COMMAND list."""
    listing = help_text.split("positional arguments:", 1)[1].split("options:", 1)[0]
    return set(re.findall(r"^    ([a-z][a-z-]*)", listing, flags=re.M))


def test_the_installed_hangar_lists_the_sdks_and_the_servers_commands(cli_env):
    assert HANGAR.exists(), f"{HANGAR} is missing: `make install` installs the SDK's console script"
    helped = subprocess.run([str(HANGAR), "--help"], capture_output=True, text=True, timeout=60, env=cli_env)
    assert helped.returncode == 0 and "warning" not in helped.stderr, helped.stderr
    names = _commands(helped.stdout)
    assert USER_COMMANDS <= names and SERVER_COMMANDS <= names, names
    # The plug-in's commands run through the same command (their parsers are the server's).
    up = subprocess.run(
        [str(HANGAR), "up", "--help"], capture_output=True, text=True, timeout=60, env=cli_env
    )
    assert up.returncode == 0 and "usage: hangar up" in up.stdout, up.stderr
    token = subprocess.run([str(HANGAR), "token", "--help"], capture_output=True, text=True, timeout=60,
                           env=cli_env)  # fmt: skip
    assert token.returncode == 0 and "usage: hangar token" in token.stdout, token.stderr


def test_one_distribution_owns_the_console_script_and_the_other_plugs_in():
    scripts = [ep for ep in entry_points(group="console_scripts") if ep.name == "hangar"]
    assert [ep.value for ep in scripts] == ["hangar_sdk.cli:run"], scripts
    assert scripts[0].dist is not None and scripts[0].dist.name == "hangar-runtime-sdk"
    plugins = {ep.name: ep.value for ep in entry_points(group="hangar.cli")}
    assert plugins == {"server": "dashboard.cli:register"}, plugins
    assert distribution("hangar-runtime-sdk").version
