"""``hangar login`` (checks the token, stores URL and token 0600, the environment overrides
it), ``whoami``, ``logout``, and shell completion run by a real bash."""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path

import pytest

from tests.cli.conftest import HANGAR, Cli
from tests.support import requires_runsc

pytestmark = [requires_runsc, pytest.mark.timeout(180)]


def test_login_stores_a_checked_token_that_later_commands_use(cli_env, server, team_token, transactional_db):
    bare = Cli(cli_env)
    config = Path(cli_env["XDG_CONFIG_HOME"]) / "hangar" / "config.json"

    refused = bare("login", "--url", server, "--token-stdin", input="hgr_not-a-token\n")
    assert refused.returncode == 1 and "refused" in refused.stderr and not config.exists()
    unreachable = bare("login", "--url", "http://127.0.0.1:9", "--token", team_token)
    assert unreachable.returncode == 1 and "cannot reach" in unreachable.stderr and not config.exists()

    ok = bare("login", "--url", server, "--token-stdin", input=f"{team_token}\n")
    assert ok.returncode == 0, ok.stderr
    assert "as alice in team alpha" in ok.stderr and team_token not in ok.stderr + ok.stdout
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert stat.S_IMODE(config.parent.stat().st_mode) == 0o700
    assert json.loads(config.read_text()) == {"url": server, "token": team_token}

    who = bare("whoami", "--json")
    assert who.returncode == 0, who.stderr
    me = json.loads(who.stdout)
    assert (me["user"], me["team"], me["url"]) == ("alice", "alpha", server) and "token" not in me
    assert bare("sandbox", "list", "--json").stdout.strip() == "[]"
    # The environment wins over what is stored.
    overridden = bare("whoami", env={"HANGAR_TOKEN": "hgr_wrong"})
    assert overridden.returncode == 1 and "hangar login" in overridden.stderr

    out = bare("logout")
    assert out.returncode == 0 and not config.exists()
    assert bare("whoami").returncode == 1


def _complete(env: dict[str, str], *words: str) -> list[str]:
    """What bash offers after ``hangar WORDS…`` (the last word partial), through the script
    ``hangar completion bash`` prints."""
    quoted = " ".join(f"'{w}'" for w in ("hangar", *words))
    script = (f'eval "$({HANGAR} completion bash | sed "s#hangar __complete#{HANGAR} __complete#")"; '
              f"COMP_WORDS=({quoted}); COMP_CWORD={len(words)}; _hangar_complete; "
              'printf "%s\\n" "${COMPREPLY[@]}"')  # fmt: skip
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return [w for w in out.stdout.splitlines() if w]


def test_completion_offers_commands_options_choices_and_sandbox_ids(cli):
    env = cli.env
    assert "sandbox" in _complete(env, "sa") and "harness" in _complete(env, "h")
    assert _complete(env, "sandbox", "cr") == ["create"]
    assert "--memory-mb" in _complete(env, "sandbox", "create", "--me")
    assert _complete(env, "sandbox", "create", "--network", "a") == ["all", "allowlist"]
    sid = json.loads(cli("sandbox", "create", "--image", "busybox", "--memory-mb", "256", "--json").stdout)[
        "id"
    ]
    try:
        assert sid in _complete(env, "sandbox", "exec", "")
        assert _complete(env, "sandbox", "get", sid[:6]) == [sid]
    finally:
        cli("sandbox", "rm", sid)
    for shell in ("bash", "zsh", "fish"):
        script = cli("completion", shell)
        assert script.returncode == 0 and "__complete" in script.stdout
